// GEMM ladder, step 3 (`variant='register_tiled_vec4'`): 2-D block tiling with register tiles and
// vector loads. What it adds over `smem_tiled`: a 128x128 block tile computed by 256 threads, each
// owning an 8x8 tile of outputs in registers (64 FMAs per 16 values read from shared memory instead
// of 1 per 2); global loads of 4 consecutive elements at once (float4 for fp32, 8 bytes for
// fp16/bf16) along whichever dim of an operand is contiguous; the A tile stored transposed
// (k-major) in shared memory so that both operands are read as float4 in the math loop.
// Left for `warp_tiled`: the B reads of a warp hit 2-way bank conflicts (16 threads read 8
// consecutive floats each), and loads are not overlapped with math (two barriers per K step).
#include "gemm/gemm_common.cuh"
#include "common/opaque.cuh"

namespace gpuops {
namespace gemm {

constexpr int kRtBM = 128, kRtBN = 128, kRtBK = 8, kRtThreads = 256;

template <class T>
__global__ void __launch_bounds__(kRtThreads, 2) gemm_register_tiled_vec4(GemmArgs p) {
  using TileA = SimtTile<T, kRtBM, kRtBK, kRtThreads>;
  using TileB = SimtTile<T, kRtBN, kRtBK, kRtThreads>;
  __shared__ __align__(16) float As[kRtBK * TileA::kLd];
  __shared__ __align__(16) float Bs[kRtBK * TileB::kLd];
  const int tid = threadIdx.x;
  const int ty = tid / 16, tx = tid % 16;            // rows ty*8 .. +8, columns tx*8 .. +8
  const int tiles_m = (int)((p.M + kRtBM - 1) / kRtBM), tiles_n = (int)((p.N + kRtBN - 1) / kRtBN);
  int tm, tn;
  tile_coords(blockIdx.x, tiles_m, tiles_n, tm, tn);
  const long long m0 = (long long)tm * kRtBM, n0 = (long long)tn * kRtBN;
  const BatchOffsets o = batch_offsets(p, p.z0 + blockIdx.z);
  const SimtOperands<T> op(p, o);
  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
  TileA ta;
  TileB tb;
  ta.init(op.a, p.a_sm, p.a_sk, p.M, p.K, m0, op.a_k, tid);
  tb.init(op.b, p.b_sn, p.b_sk, p.N, p.K, n0, op.b_k, tid);
  for (long long k0 = 0; k0 < p.K; k0 += kRtBK) {
    ta.load(p.a_sm, p.a_sk, op.a_k, op.a_vec);
    tb.load(p.b_sn, p.b_sk, op.b_k, op.b_vec);
    ta.store(As, op.a_k);
    tb.store(Bs, op.b_k);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kRtBK; ++k) {
      float a[8], b[8];
      const float4 a0 = *reinterpret_cast<const float4*>(As + k * TileA::kLd + ty * 8);
      const float4 a1 = *reinterpret_cast<const float4*>(As + k * TileA::kLd + ty * 8 + 4);
      const float4 b0 = *reinterpret_cast<const float4*>(Bs + k * TileB::kLd + tx * 8);
      const float4 b1 = *reinterpret_cast<const float4*>(Bs + k * TileB::kLd + tx * 8 + 4);
      a[0] = a0.x; a[1] = a0.y; a[2] = a0.z; a[3] = a0.w;
      a[4] = a1.x; a[5] = a1.y; a[6] = a1.z; a[7] = a1.w;
      b[0] = b0.x; b[1] = b0.y; b[2] = b0.z; b[3] = b0.w;
      b[4] = b1.x; b[5] = b1.y; b[6] = b1.z; b[7] = b1.w;
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
  // The epilogue's tile, thread and batch offsets are recomputed here from the block index (made
  // opaque) instead of being held across the K loop, which needs all 128 registers: ptxas spilled
  // them otherwise once the activations' sigmoid became inline MUFU code.
  unsigned int block = blockIdx.x, thread = threadIdx.x;
  opaque(block);
  opaque(thread);
  int em, en;
  tile_coords((int)block, tiles_m, tiles_n, em, en);
  const long long rows = (long long)em * kRtBM + (thread / 16) * 8;
  const long long cols = (long long)en * kRtBN + (thread % 16) * 8;
  const BatchOffsets eo = batch_offsets(p, p.z0 + blockIdx.z);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float v[4] = {acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2], acc[i][4 * h + 3]};
      epilogue_run<T, 4>(p, eo, rows + i, cols + 4 * h, v);
    }
  }
}

}  // namespace gemm
}  // namespace gpuops
