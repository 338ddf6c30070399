// GEMM ladder, step 4 (`variant='warp_tiled'`): the best fp32 SIMT kernel, and gpuops' default for
// fp32 on every arch and for fp16/bf16 before sm_80 (fp32 math and accumulation throughout).
// What it adds over `register_tiled_vec4`:
//  * warp tiling: the 128x128 block tile is split into 8 warp tiles of 64x32 (2 x 4 warps); a
//    thread's 8x8 outputs are two 4-row x two 4-column pieces 32 rows / 16 columns apart, so the
//    float4 shared-memory reads of a warp cover 128 (A) and 64 (B) contiguous bytes: no bank
//    conflicts, 4 LDS.128 per 64 FMAs;
//  * double-buffered shared memory: the next K tile is loaded into registers while the current
//    one is multiplied, then stored into the other buffer: one barrier per K step of 8;
//  * the A (and B^T) tile stored transposed with 4 floats of row padding: the transposing stores
//    of K-contiguous operands are conflict-free too.
// The dual kernel (SwiGLU: silu(A @ B) * (A @ B2)) shares each A tile between two B tiles of 64
// columns; a thread then owns 8x4 outputs of each product, so its registers stay those of the
// single kernel.
#include "gemm/gemm_common.cuh"

namespace gpuops {
namespace gemm {

constexpr int kWtBM = 128, kWtBK = 8, kWtThreads = 256;

template <class T, bool DUAL>
__global__ void __launch_bounds__(kWtThreads, 2) gemm_warp_tiled(GemmArgs p) {
  constexpr int kSeg = DUAL ? 1 : 2;          // 4-column pieces per thread and B operand
  constexpr int kBN = 64 * kSeg;              // block tile columns per B operand
  constexpr int kNB = DUAL ? 2 : 1;
  using TileA = SimtTile<T, kWtBM, kWtBK, kWtThreads>;
  using TileB = SimtTile<T, kBN, kWtBK, kWtThreads / kNB>;   // dual: half the threads per B
  __shared__ __align__(16) float As[2][kWtBK * TileA::kLd];
  __shared__ __align__(16) float Bs[2][kNB][kWtBK * TileB::kLd];

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int wm = warp / 4, wn = warp % 4;
  const int ty = lane / 4, tx = lane % 4;
  const int a_off = wm * 64 + ty * 4;               // rows a_off + {0..3, 32..35}
  const int b_off = wn * (16 * kSeg) + tx * 4;      // columns b_off + 16 s + {0..3}
  // dual: threads [0, 128) load B, [128, 256) load B2 (warp-uniform)
  const int b_sel = DUAL ? tid / (kWtThreads / 2) : 0;
  const int b_tid = DUAL ? tid % (kWtThreads / 2) : tid;

  const int tiles_m = (int)((p.M + kWtBM - 1) / kWtBM), tiles_n = (int)((p.N + kBN - 1) / kBN);
  int tm, tn;
  tile_coords(blockIdx.x, tiles_m, tiles_n, tm, tn);
  const long long m0 = (long long)tm * kWtBM, n0 = (long long)tn * kBN;

  const BatchOffsets o = batch_offsets(p, p.z0 + blockIdx.z);
  const SimtOperands<T> op(p, o);
  float acc[kNB][8][4 * kSeg];
#pragma unroll
  for (int d = 0; d < kNB; ++d)
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 4 * kSeg; ++j) acc[d][i][j] = 0.0f;

  TileA ta;
  TileB tb;
  ta.init(op.a, p.a_sm, p.a_sk, p.M, p.K, m0, op.a_k, tid);
  tb.init(b_sel ? op.b2 : op.b, p.b_sn, p.b_sk, p.N, p.K, n0, op.b_k, b_tid);
  const long long ktiles = (p.K + kWtBK - 1) / kWtBK;
  if (ktiles > 0) {
    ta.load(p.a_sm, p.a_sk, 0, op.a_k, op.a_vec);
    tb.load(p.b_sn, p.b_sk, 0, op.b_k, op.b_vec);
    ta.store(As[0], op.a_k, tid);
    tb.store(Bs[0][b_sel], op.b_k, b_tid);
  }
  __syncthreads();
  for (long long kt = 0; kt < ktiles; ++kt) {
    const int cur = (int)(kt & 1);
    const bool more = kt + 1 < ktiles;
    if (more) {   // in flight during the math below
      const long long k0 = (kt + 1) * kWtBK;
      ta.load(p.a_sm, p.a_sk, k0, op.a_k, op.a_vec);
      tb.load(p.b_sn, p.b_sk, k0, op.b_k, op.b_vec);
    }
    const float* as = As[cur];
#pragma unroll
    for (int k = 0; k < kWtBK; ++k) {
      float a[8];
      const float4 a0 = *reinterpret_cast<const float4*>(as + k * TileA::kLd + a_off);
      const float4 a1 = *reinterpret_cast<const float4*>(as + k * TileA::kLd + a_off + 32);
      a[0] = a0.x; a[1] = a0.y; a[2] = a0.z; a[3] = a0.w;
      a[4] = a1.x; a[5] = a1.y; a[6] = a1.z; a[7] = a1.w;
#pragma unroll
      for (int d = 0; d < kNB; ++d) {
        float b[4 * kSeg];
#pragma unroll
        for (int s = 0; s < kSeg; ++s) {
          const float4 bv =
              *reinterpret_cast<const float4*>(Bs[cur][d] + k * TileB::kLd + b_off + 16 * s);
          b[4 * s] = bv.x; b[4 * s + 1] = bv.y; b[4 * s + 2] = bv.z; b[4 * s + 3] = bv.w;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int j = 0; j < 4 * kSeg; ++j) acc[d][i][j] = fmaf(a[i], b[j], acc[d][i][j]);
      }
    }
    if (more) {   // the other buffer was last read before the previous barrier
      ta.store(As[cur ^ 1], op.a_k, tid);
      tb.store(Bs[cur ^ 1][b_sel], op.b_k, b_tid);
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const long long m = m0 + a_off + (i / 4) * 32 + i % 4;
#pragma unroll
    for (int s = 0; s < kSeg; ++s) {
      const long long n = n0 + b_off + 16 * s;
      const float g[4] = {acc[0][i][4 * s], acc[0][i][4 * s + 1], acc[0][i][4 * s + 2],
                          acc[0][i][4 * s + 3]};
      if constexpr (DUAL) {
        const float u[4] = {acc[kNB - 1][i][4 * s], acc[kNB - 1][i][4 * s + 1],
                            acc[kNB - 1][i][4 * s + 2], acc[kNB - 1][i][4 * s + 3]};
        swiglu_run<T, 4>(p, o, m, n, g, u);
      } else {
        epilogue_run<T, 4>(p, o, m, n, g);
      }
    }
  }
}

}  // namespace gemm
}  // namespace gpuops
