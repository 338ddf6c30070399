// GEMM ladder, step 4 (`variant='warp_tiled'`): the best fp32 SIMT kernel, and gpuops' default for
// fp32 on every arch and for fp16/bf16 before sm_80 (fp32 math and accumulation throughout).
// What it adds over `register_tiled_vec4`:
//  * warp tiling: the BM x BN block tile is split into warp tiles of WM x WN; the 32 lanes of a
//    warp form 8 rows x 4 columns, and a thread's WM/8 x WN/4 outputs are 4-row pieces 32 rows
//    apart times 4-column pieces 16 columns apart, so the float4 shared-memory reads of a warp
//    cover 128 (A) and 64 (B) contiguous bytes: no bank conflicts, WM/32 + WN/16 LDS.128 per
//    WM * WN / 32 FMAs (64x32: 4 per 64; 64x64: 6 per 128);
//  * double-buffered shared memory: the next K tile is loaded into registers while the current
//    one is multiplied, then stored into the other buffer: one barrier per K step of BK;
//  * the A (and B^T) tile stored transposed with 4 floats of row padding: the transposing stores
//    of K-contiguous operands are conflict-free too (2-way at BK = 16).
// The tile shape is a template (gpuops/ops/gemm.py WARP_TILED_CONFIGS names the instantiated
// ones, PLAN['warp_tiled'] picks one): BM, BN, BK, WM, WN and MINB, the blocks per SM the launch
// bounds ask registers for (256 threads x 2 blocks: 128 registers; 128 x 2: 255).
// The dual kernel (SwiGLU: silu(A @ B) * (A @ B2)) shares each A tile between two B tiles of BN/2
// columns; a thread then owns WM/8 x WN/8 outputs of each product, so its registers stay those of
// the single kernel.
#include "gemm/gemm_common.cuh"

namespace gpuops {
namespace gemm {

template <int BM, int BN, int BK, int WM, int WN>
struct WarpTiledShape {
  static constexpr int kWarpsN = BN / WN;
  static constexpr int kThreads = (BM / WM) * kWarpsN * 32;
  static constexpr int kRM = WM / 32;   // 4-row pieces per thread, 32 rows apart
  static constexpr int kRN = WN / 16;   // 4-column pieces per thread, 16 columns apart
  static_assert(BM % WM == 0 && BN % WN == 0, "warp tiles must tile the block tile");
  static_assert(WM % 32 == 0 && WN % 16 == 0, "a warp is 8 x 4 lanes of 4 x 4 pieces");
  static_assert(BK % 4 == 0, "K tiles are loaded in runs of 4");
};

template <class T, bool DUAL, int BM, int BN, int BK, int WM, int WN, int MINB>
__global__ void __launch_bounds__(WarpTiledShape<BM, BN, BK, WM, WN>::kThreads, MINB)
    gemm_warp_tiled(GemmArgs p) {
  using Shape = WarpTiledShape<BM, BN, BK, WM, WN>;
  constexpr int kThreads = Shape::kThreads;
  constexpr int kNB = DUAL ? 2 : 1;
  constexpr int kRM = Shape::kRM;
  constexpr int kSeg = Shape::kRN / kNB;      // 4-column pieces per thread and B operand
  constexpr int kBN = BN / kNB;               // block tile columns per B operand
  static_assert(kSeg >= 1 && Shape::kRN % kNB == 0, "dual: each B needs whole pieces");
  static_assert(kThreads % (32 * kNB) == 0, "dual: B operands split the warps evenly");
  using TileA = SimtTile<T, BM, BK, kThreads>;
  using TileB = SimtTile<T, kBN, BK, kThreads / kNB>;   // dual: half the threads per B
  constexpr int kStageA = BK * TileA::kLd, kStageB = BK * TileB::kLd;
  // dynamic shared memory (the host's _wt_smem): two buffers of the A tile and of each B tile
  extern __shared__ __align__(16) float wt_smem[];
  float* const As = wt_smem;                            // [2][kStageA]
  float* const Bs = wt_smem + 2 * kStageA;              // [2][kNB][kStageB]

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int wm = warp / Shape::kWarpsN, wn = warp % Shape::kWarpsN;
  const int ty = lane / 4, tx = lane % 4;
  const int a_off = wm * WM + ty * 4;                   // rows a_off + 32 i + {0..3}
  const int b_off = wn * (WN / kNB) + tx * 4;           // columns b_off + 16 s + {0..3}
  // dual: threads [0, kThreads / 2) load B, the others B2 (warp-uniform)
  const int b_sel = DUAL ? tid / (kThreads / 2) : 0;
  const int b_tid = DUAL ? tid % (kThreads / 2) : tid;

  const int tiles_m = (int)((p.M + BM - 1) / BM), tiles_n = (int)((p.N + kBN - 1) / kBN);
  int tm, tn;
  tile_coords(blockIdx.x, tiles_m, tiles_n, tm, tn);
  // the tile's origin as 32-bit tile indices: kept over the main loop (64-bit m0 / n0 would take
  // 4 registers the 128-output configurations do not have)

  const BatchOffsets o = batch_offsets(p, p.z0 + blockIdx.z);
  const SimtOperands<T> op(p, o);
  float acc[kNB][4 * kRM][4 * kSeg];
#pragma unroll
  for (int d = 0; d < kNB; ++d)
#pragma unroll
    for (int i = 0; i < 4 * kRM; ++i)
#pragma unroll
      for (int j = 0; j < 4 * kSeg; ++j) acc[d][i][j] = 0.0f;

  TileA ta;
  TileB tb;
  ta.init(op.a, p.a_sm, p.a_sk, p.M, p.K, (long long)tm * BM, op.a_k, tid);
  tb.init(b_sel ? op.b2 : op.b, p.b_sn, p.b_sk, p.N, p.K, (long long)tn * kBN, op.b_k, b_tid);
  const int ktiles = (int)((p.K + BK - 1) / BK);
  if (ktiles > 0) {
    ta.load(p.a_sm, p.a_sk, op.a_k, op.a_vec);
    tb.load(p.b_sn, p.b_sk, op.b_k, op.b_vec);
    ta.store(As, op.a_k);
    tb.store(Bs + b_sel * kStageB, op.b_k);
  }
  __syncthreads();
  for (int kt = 0; kt < ktiles; ++kt) {
    const int cur = kt & 1;
    const bool more = kt + 1 < ktiles;
    if (more) {   // in flight during the math below
      ta.load(p.a_sm, p.a_sk, op.a_k, op.a_vec);
      tb.load(p.b_sn, p.b_sk, op.b_k, op.b_vec);
    }
    const float* as = As + cur * kStageA;
    const float* bs = Bs + cur * kNB * kStageB;
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      float a[4 * kRM];
#pragma unroll
      for (int i = 0; i < kRM; ++i) {
        const float4 av = *reinterpret_cast<const float4*>(as + k * TileA::kLd + a_off + 32 * i);
        a[4 * i] = av.x; a[4 * i + 1] = av.y; a[4 * i + 2] = av.z; a[4 * i + 3] = av.w;
      }
#pragma unroll
      for (int d = 0; d < kNB; ++d) {
        float b[4 * kSeg];
#pragma unroll
        for (int s = 0; s < kSeg; ++s) {
          const float4 bv = *reinterpret_cast<const float4*>(bs + d * kStageB + k * TileB::kLd +
                                                             b_off + 16 * s);
          b[4 * s] = bv.x; b[4 * s + 1] = bv.y; b[4 * s + 2] = bv.z; b[4 * s + 3] = bv.w;
        }
#pragma unroll
        for (int i = 0; i < 4 * kRM; ++i)
#pragma unroll
          for (int j = 0; j < 4 * kSeg; ++j) acc[d][i][j] = fmaf(a[i], b[j], acc[d][i][j]);
      }
    }
    if (more) {   // the other buffer was last read before the previous barrier
      ta.store(As + (cur ^ 1) * kStageA, op.a_k);
      tb.store(Bs + ((cur ^ 1) * kNB + b_sel) * kStageB, op.b_k);
    }
    __syncthreads();
  }

  const long long m0 = (long long)tm * BM, n0 = (long long)tn * kBN;
#pragma unroll
  for (int i = 0; i < 4 * kRM; ++i) {
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
