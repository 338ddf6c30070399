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
// bounds ask registers for (256 threads x 2 blocks: 128 registers; 128 x 2: 255), and PIPE:
//  * PIPE = 0: the double buffer above, staged through registers (any dtype);
//  * PIPE = S >= 3 (fp32 only): a ring of S shared-memory stages filled by cp.async (sm_80+), S - 1
//    K tiles in flight, no registers or stores spent on staging (cuBLAS' sm_80 FFMA kernels, which
//    the H100 runs for fp32, are built so: ncu, run 90); the K-contiguous operand is transposed
//    by 4-byte copies. Before sm_80 the copies are a load and a store (correct, not a speed path).
// The dual kernel (SwiGLU: silu(A @ B) * (A @ B2)) shares each A tile between two B tiles of BN/2
// columns; a thread then owns WM/8 x WN/8 outputs of each product, so its registers stay those of
// the single kernel.
#include "common/mma.cuh"
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

// fp32 global -> shared (dst: a shared-memory address, smem_addr) without registers where the
// GPU can (cp.async, sm_80+; the CPU emulator too); before sm_80 a load and a store, and commit /
// wait are no-ops. An invalid element is zero-filled; its source must still be a valid address.
__device__ __forceinline__ void simt_copy4(unsigned int dst, const float* src, bool valid) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ < 800
  const float v = valid ? *src : 0.0f;
  asm volatile("st.shared.f32 [%0], %1;" :: "r"(dst), "f"(v));
#else
  cp_async4(dst, src, valid ? 4 : 0);
#endif
}

__device__ __forceinline__ void simt_copy16(unsigned int dst, const float* src) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ < 800
  const float4 v = *reinterpret_cast<const float4*>(src);
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(dst), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w));
#else
  cp_async16(dst, src, 16);
#endif
}

__device__ __forceinline__ void simt_copy_commit() {
#if !(defined(__CUDACC_RTC__) && __CUDA_ARCH__ < 800)
  cp_async_commit();
#endif
}

template <int N>
__device__ __forceinline__ void simt_copy_wait() {
#if !(defined(__CUDACC_RTC__) && __CUDA_ARCH__ < 800)
  cp_async_wait<N>();
#endif
}

// SimtTile's geometry (gemm_common.cuh: the same runs per thread, the same k-major shared layout
// S[k * kLd + r]) for fp32 operands copied straight into a ring stage. Aligned tiles wholly
// inside the matrix take a path without checks: a run along k (kcontig) is 4 copies of 4 bytes
// (transposing), a run along r one 16-byte copy. Else every element is checked and copied
// alone, out-of-range ones zero-filled.
template <int ROWS, int BK, int NT>
struct SimtAsyncTile {
  static constexpr int kRuns = ROWS * BK / 4 / NT;
  static_assert(ROWS * BK / 4 % NT == 0, "tile must split evenly over the threads");
  static_assert(NT % (BK / 4) == 0 && NT % (ROWS / 4) == 0, "a thread's runs a fixed step apart");
  static constexpr int kRowStep = NT / (BK / 4);
  static constexpr int kKStep = NT / (ROWS / 4);
  static constexpr int kLd = ROWS + kSimtPad;
  const float* base;      // the operand's first element: the source of zero-filled copies
  const float* ptr;       // the first run's first element in the next tile
  long long step;         // elements from one run to the next
  long long kl;           // K - (the first run's k in the next tile)
  int rl;                 // R - (the first run's row), clamped to +-2^30
  unsigned int sbase;     // the first run's byte offset in a stage: 4 (k * kLd + row)

  __device__ __forceinline__ void init(const float* b, long long sr, long long sk, long long R,
                                       long long K, long long r0, bool kcontig, int tid) {
    const int rk = kcontig ? tid / (BK / 4) : (tid % (ROWS / 4)) * 4;
    const int kk = kcontig ? (tid % (BK / 4)) * 4 : tid / (ROWS / 4);
    base = b;
    ptr = b + (r0 + rk) * sr + kk * sk;
    step = kcontig ? kRowStep * sr : kKStep * sk;
    kl = K - kk;
    const long long left = R - r0 - rk;
    rl = (int)(left > (1 << 30) ? (1 << 30) : (left < -(1 << 30) ? -(1 << 30) : left));
    sbase = 4u * (unsigned int)(kk * kLd + rk);
  }

  // The copies of the next K tile when it lies wholly inside an operand read in aligned vectors
  // (gemm.py _operand_layout: vec means unit stride along the run), then on to the tile after.
  __device__ __forceinline__ void issue_whole(unsigned int S, long long sk, bool kcontig) {
    const unsigned int s = S + sbase;
#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      if (kcontig) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          simt_copy4(s + 4u * (i * kRowStep + j * kLd), ptr + i * step + j, true);
      } else {
        simt_copy16(s + 4u * (i * kKStep * kLd), ptr + i * step);
      }
    }
    ptr += BK * sk;
    kl -= BK;
  }

  // Issues the copies of the next K tile into the stage at shared address S and moves on.
  __device__ __forceinline__ void issue(unsigned int S, long long sr, long long sk, bool kcontig,
                                        bool vec) {
    const unsigned int s = S + sbase;
    const bool whole = kcontig ? (kl >= 4 && rl - (kRuns - 1) * kRowStep >= 1)
                               : (kl - (kRuns - 1) * kKStep >= 1 && rl >= 4);
    if (vec && whole) {
      issue_whole(S, sk, kcontig);
      return;
    }
#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      const float* const p = ptr + i * step;
      const bool in = kcontig ? rl - i * kRowStep >= 1 : kl - i * kKStep >= 1;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool ok = in && (kcontig ? kl > j : rl > j);
        const unsigned int d = kcontig ? s + 4u * (i * kRowStep + j * kLd)
                                       : s + 4u * (i * kKStep * kLd + j);
        simt_copy4(d, ok ? p + j * (kcontig ? sk : sr) : base, ok);
      }
    }
    ptr += BK * sk;
    kl -= BK;
  }
};

template <class T, bool DUAL, int BM, int BN, int BK, int WM, int WN, int MINB, int PIPE>
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
  static_assert(PIPE == 0 || (PIPE >= 3 && sizeof(T) == 4), "a cp.async ring: fp32, >= 3 stages");
  constexpr int kLdA = BM + kSimtPad, kLdB = kBN + kSimtPad;
  constexpr int kStageA = BK * kLdA, kStageB = BK * kLdB;
  // dynamic shared memory (the host's _wt_smem): max(2, PIPE) stages of the A tile and of each
  // B tile, As [stages][kStageA] then Bs [stages][kNB][kStageB]
  extern __shared__ __align__(16) float wt_smem[];
  float* const As = wt_smem;
  float* const Bs = wt_smem + (PIPE == 0 ? 2 : PIPE) * kStageA;

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

  // a thread's fragments of step k of the K tile in stage (as, bs): kRM + kSeg float4 reads per
  // B operand
  auto fetch = [&](const float* as, const float* bs, int k, float (&a)[4 * kRM],
                   float (&b)[kNB][4 * kSeg]) {
#pragma unroll
    for (int i = 0; i < kRM; ++i) {
      const float4 av = *reinterpret_cast<const float4*>(as + k * kLdA + a_off + 32 * i);
      a[4 * i] = av.x; a[4 * i + 1] = av.y; a[4 * i + 2] = av.z; a[4 * i + 3] = av.w;
    }
#pragma unroll
    for (int d = 0; d < kNB; ++d)
#pragma unroll
      for (int s = 0; s < kSeg; ++s) {
        const float4 bv = *reinterpret_cast<const float4*>(bs + d * kStageB + k * kLdB +
                                                           b_off + 16 * s);
        b[d][4 * s] = bv.x; b[d][4 * s + 1] = bv.y; b[d][4 * s + 2] = bv.z; b[d][4 * s + 3] = bv.w;
      }
  };
  auto fma_step = [&](const float (&a)[4 * kRM], const float (&b)[kNB][4 * kSeg]) {
#pragma unroll
    for (int d = 0; d < kNB; ++d)
#pragma unroll
      for (int i = 0; i < 4 * kRM; ++i)
#pragma unroll
        for (int j = 0; j < 4 * kSeg; ++j) acc[d][i][j] = fmaf(a[i], b[d][j], acc[d][i][j]);
  };
  const int ktiles = (int)((p.K + BK - 1) / BK);
  if constexpr (PIPE == 0) {
    SimtTile<T, BM, BK, kThreads> ta;
    SimtTile<T, kBN, BK, kThreads / kNB> tb;   // dual: half the threads per B
    ta.init(op.a, p.a_sm, p.a_sk, p.M, p.K, (long long)tm * BM, op.a_k, tid);
    tb.init(b_sel ? op.b2 : op.b, p.b_sn, p.b_sk, p.N, p.K, (long long)tn * kBN, op.b_k, b_tid);
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
#pragma unroll
      for (int k = 0; k < BK; ++k) {
        float a[4 * kRM], b[kNB][4 * kSeg];
        fetch(As + cur * kStageA, Bs + cur * kNB * kStageB, k, a, b);
        fma_step(a, b);
      }
      if (more) {   // the other buffer was last read before the previous barrier
        ta.store(As + (cur ^ 1) * kStageA, op.a_k);
        tb.store(Bs + ((cur ^ 1) * kNB + b_sel) * kStageB, op.b_k);
      }
      __syncthreads();
    }
  } else {
    // The ring: tile t in stage t % PIPE, tiles kt + 1 .. kt + PIPE - 1 in flight during the
    // math on tile kt. Fragments are double-buffered in registers (step k + 1's read before step
    // k's FMAs), and the one barrier per tile sits before the tile's last step: by then every
    // read of tile kt's stage has been issued (step BK - 1's fragments are in registers), so
    // the barrier both publishes tile kt + 1 and frees tile kt's stage, and tile kt + 1's first
    // fragments are read under step BK - 1's FMAs instead of after a barrier with nothing to
    // issue (ncu, run 91: the first FMA after the barrier was the loop's largest stall).
    // Measured and not kept (runs 94, 95; benchmarks/notes_gemm.md): forming the post-barrier
    // addresses before the math (less waiting on reads, but the copies then left in one burst
    // and filled the load queue: 3% slower) and spreading the copies over steps 1 and 3 (the
    // MIO queue then throttled the fragment reads: 1% slower).
    static_assert(BK % 2 == 0, "step BK - 1 and the next tile's step 0 use different fragments");
    const unsigned int sA = smem_addr(As), sB = smem_addr(Bs);
    SimtAsyncTile<BM, BK, kThreads> ta;
    SimtAsyncTile<kBN, BK, kThreads / kNB> tb;
    ta.init(reinterpret_cast<const float*>(op.a), p.a_sm, p.a_sk, p.M, p.K, (long long)tm * BM,
            op.a_k, tid);
    tb.init(reinterpret_cast<const float*>(b_sel ? op.b2 : op.b), p.b_sn, p.b_sk, p.N, p.K,
            (long long)tn * kBN, op.b_k, b_tid);
    // tiles wholly inside aligned operands are copied without checks, in a loop of their own
    // (the checked copies' code outside it: the loop body stays one tile's math and its copies)
    const bool interior = op.a_vec && op.b_vec && (long long)(tm + 1) * BM <= p.M &&
                          (long long)(tn + 1) * kBN <= p.N;
    const int kwhole = interior ? (int)(p.K / BK) : 0;
    // (whole is a constant at each call: the inlined copies keep only their own path)
    auto issue = [&](int t, int stage, bool whole) {
      if (t < ktiles) {
        const unsigned int da = sA + 4u * (stage * kStageA);
        const unsigned int db = sB + 4u * ((stage * kNB + b_sel) * kStageB);
        if (whole) {
          ta.issue_whole(da, p.a_sk, op.a_k);
          tb.issue_whole(db, p.b_sk, op.b_k);
        } else {
          ta.issue(da, p.a_sm, p.a_sk, op.a_k, op.a_vec);
          tb.issue(db, p.b_sn, p.b_sk, op.b_k, op.b_vec);
        }
      }
      simt_copy_commit();   // (empty past the last tile: the group count stays one per tile)
    };
#pragma unroll
    for (int t = 0; t < PIPE; ++t) issue(t, t, false);
    simt_copy_wait<PIPE - 1>();
    __syncthreads();
    float a[2][4 * kRM], b[2][kNB][4 * kSeg];
    fetch(As, Bs, 0, a[0], b[0]);
    int cur = 0;
    auto tile = [&](int kt, bool whole) {
      const float* const as = As + cur * kStageA;
      const float* const bs = Bs + cur * kNB * kStageB;
#pragma unroll
      for (int k = 0; k < BK - 1; ++k) {
        fetch(as, bs, k + 1, a[(k + 1) & 1], b[(k + 1) & 1]);
        fma_step(a[k & 1], b[k & 1]);
      }
      simt_copy_wait<PIPE - 2>();   // this thread's copies of tile kt + 1 have landed
      __syncthreads();
      const int next = cur + 1 == PIPE ? 0 : cur + 1;
      fetch(As + next * kStageA, Bs + next * kNB * kStageB, 0, a[0], b[0]);
      issue(kt + PIPE, cur, whole);
      fma_step(a[(BK - 1) & 1], b[(BK - 1) & 1]);
      cur = next;
    };
    int kt = 0;
    for (; kt < kwhole - PIPE; ++kt) tile(kt, true);
    for (; kt < ktiles; ++kt) tile(kt, false);
  }

  const long long m0 = (long long)tm * BM, n0 = (long long)tn * kBN;
  // (the ring's kernels only: in the 128-register configurations the extra path made ptxas spill)
  if (PIPE > 0 && !DUAL && epilogue_is_plain(p)) {
#pragma unroll
    for (int i = 0; i < 4 * kRM; ++i)
#pragma unroll
      for (int s = 0; s < kSeg; ++s) {
        const float g[4] = {acc[0][i][4 * s], acc[0][i][4 * s + 1], acc[0][i][4 * s + 2],
                            acc[0][i][4 * s + 3]};
        plain_run<T, 4>(p, o, m0 + a_off + (i / 4) * 32 + i % 4, n0 + b_off + 16 * s, g);
      }
    return;
  }
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
