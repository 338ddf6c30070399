// Decode-sized GEMMs on tensor cores (`variant='gemv_mma'`, sm_80+, fp16/bf16, B with K
// contiguous: a torch Linear weight): what it adds over the SIMT `gemv` is that the
// multiplications cost nothing. At M = 9..16 rows of A the SIMT kernel does 16 FMAs and 16
// conversions per weight element, which on an H100 is more than the FMA units finish while HBM
// delivers the weight; here one mma.sync m16n8k16 multiplies a 16x16 block of A by 16 weight
// elements of 8 rows, and M < 16 just leaves rows of A zero.
//
// The weight is still read once with 16-byte loads: lane (g, t) loads 8 consecutive k of weight
// row g and of A rows g and g + 8, and the k order inside the two mma steps of those 32 k is
// permuted consistently in A and B (the sum does not care): logical k {2t, 2t+1} of step s is
// physical k 8t + 4s + {0, 1}, logical {2t+8, 2t+9} is 8t + 4s + {2, 3}, so fragments are just
// the words of the 16-byte loads. A block of 8 warps owns NT n8 tiles (8 * NT weight rows) of each
// weight and splits K between its warps; sums meet in shared memory. Split-K over grid.y and the
// fp32 workspace as in gemv.cu. NT is a template parameter so that the host can pick the block
// size whose block count fills whole waves (blocks are long: a partly empty last wave idles
// SMs for a whole block's time): blocks of <= 16 weight rows in all fit 3 per SM, bigger ones 2.
// AHEAD > 0: where a block's rows are all inside N and the weight is vector-readable, a warp
// issues the weight loads of AHEAD whole steps before their multiplications (the edge and gather
// branches of the general loop keep the compiler from hoisting the next step's loads above an
// mma, so that loop has one step, NT x 512 bytes, in flight per warp).
//
// gemv_mma_pipe (PLAN['decode'] = 'pipe' / 'pipe_deep') is the same tensor-core step arranged for
// more loads in flight; see its comment below.
#include "gemm/gemv_common.cuh"
#include "common/mma.cuh"

namespace gpuops {
namespace gemm {

constexpr int kGmThreads = 256, kGmWarps = 8;

template <class T, int NT, int AHEAD, bool DUAL>
__global__ void __launch_bounds__(kGmThreads, (DUAL ? 2 : 1) * NT <= 2 ? 3 : 2) gemv_mma(GemmArgs p) {
#if __CUDA_ARCH__ >= 800
  constexpr int kNB = DUAL ? 2 : 1;
  constexpr int kNT = NT;                           // n8 tiles of each weight per block
  constexpr int kRows = kNT * 8;                    // weight rows of each weight per block
  constexpr int kVals = kNB * kNT * 4;              // accumulators per lane
  __shared__ float red[kGmWarps][kVals][32];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const long long z = p.z0 + blockIdx.z;
  const BatchOffsets o = batch_offsets(p, z);
  const long long n0 = (long long)blockIdx.x * kRows;
  const long long ks = (long long)blockIdx.y * p.k_split;
  const long long ke = ks + p.k_split < p.K ? ks + p.k_split : p.K;
  const bool w_vec = p.flags & kBVec, x_vec = p.flags & kAVec;
  const bool lo_row = g < p.M, hi_row = g + 8 < p.M;
  const T* x_lo = static_cast<const T*>(p.a) + o.a + g * p.a_sm;
  const T* x_hi = static_cast<const T*>(p.a) + o.a + (g + 8) * p.a_sm;
  const T* wbase[kNB];
  wbase[0] = static_cast<const T*>(p.b) + o.b;
  if constexpr (DUAL) wbase[kNB - 1] = static_cast<const T*>(p.b2) + o.b;
  prefetch_weight_rows<T, kNB>(wbase, p, n0, kRows, ks, ke, tid);
  pdl_start();
  const T* wrow[kNB][kNT];
  bool wok[kNT];
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    const long long n = n0 + 8 * j + g;
    wok[j] = n < p.N;
    wrow[0][j] = static_cast<const T*>(p.b) + o.b + n * p.b_sn;
    if constexpr (DUAL) wrow[kNB - 1][j] = static_cast<const T*>(p.b2) + o.b + n * p.b_sn;
  }

  float acc[kNB][kNT][4];
#pragma unroll
  for (int d = 0; d < kNB; ++d)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[d][j][c] = 0.0f;

  // one step: the rows of A at k .. k + 7 (zeros past nk), multiplied with the weight packs w
  auto mma_step = [&](long long k, long long nk, const uint4 (&w)[kNB][kNT]) {
    uint4 xl, xh;
    load_a_pair16(x_lo, x_hi, k, nk, p.a_sk, lo_row, hi_row, x_vec, xl, xh);
    const unsigned int a0[4] = {xl.x, xh.x, xl.y, xh.y};   // step 0: words 0, 1
    const unsigned int a1[4] = {xl.z, xh.z, xl.w, xh.w};   // step 1: words 2, 3
#pragma unroll
    for (int d = 0; d < kNB; ++d)
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        Mma<T>::run(acc[d][j], a0, w[d][j].x, w[d][j].y);
        Mma<T>::run(acc[d][j], a1, w[d][j].z, w[d][j].w);
      }
  };

  long long k0 = ks + warp * 32;
  if constexpr (AHEAD > 0) {
    // Whole steps of a block whose weight rows are all inside N and vector-readable: AHEAD steps'
    // weight loads issued together before their multiplications (branch-free, so they stay
    // ahead), AHEAD x NT x 512 bytes in flight per warp instead of one step's.
    if (w_vec && n0 + kRows <= p.N) {
      for (; k0 + 256ll * (AHEAD - 1) + 32 <= ke; k0 += 256ll * AHEAD) {
        uint4 w[AHEAD][kNB][kNT];
#pragma unroll
        for (int u = 0; u < AHEAD; ++u)
#pragma unroll
          for (int d = 0; d < kNB; ++d)
#pragma unroll
            for (int j = 0; j < kNT; ++j)
              w[u][d][j] = load_stream16(wrow[d][j] + k0 + 256ll * u + 8 * t);
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
          const long long k = k0 + 256ll * u + 8 * t;
          mma_step(k, ke - k, w[u]);
        }
      }
    }
  }
  // the rest (and every step of other blocks): each pack loaded or gathered with its own limits
#pragma unroll 2
  for (; k0 < ke; k0 += kGmWarps * 32) {
    const long long k = k0 + 8 * t;
    const long long nk = ke - k;                    // may be <= 0 in the last chunk
    const bool full = nk >= 8;
    uint4 w[kNB][kNT];
#pragma unroll
    for (int d = 0; d < kNB; ++d)
#pragma unroll
      for (int j = 0; j < kNT; ++j)
        w[d][j] = (wok[j] && w_vec && full) ? load_stream16(wrow[d][j] + k)
                                            : gather16(wrow[d][j] + k * p.b_sk, p.b_sk,
                                                        wok[j] ? nk : 0);
    mma_step(k, nk, w);
  }

#pragma unroll
  for (int d = 0; d < kNB; ++d)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) red[warp][(d * kNT + j) * 4 + c][lane] = acc[d][j][c];
  __syncthreads();
  // every thread finishes outputs (j, c, lane) of the block: sums over the 8 warps, epilogue
  for (int q = tid; q < kNT * 4 * 32; q += kGmThreads) {
    const int l = q % 32, c = (q / 32) % 4, j = q / 128;
    const long long m = l / 4 + (c >= 2 ? 8 : 0);
    const long long n = n0 + 8 * j + 2 * (l % 4) + (c & 1);
    if (m >= p.M || n >= p.N) continue;
    float s[kNB];
#pragma unroll
    for (int d = 0; d < kNB; ++d) {
      float v = 0.0f;
#pragma unroll
      for (int w = 0; w < kGmWarps; ++w) v += red[w][(d * kNT + j) * 4 + c][l];
      s[d] = v;
    }
    if (p.splits > 1) {
#pragma unroll
      for (int d = 0; d < kNB; ++d) p.ws[ws_index(p, blockIdx.y, kNB, d, z, m, n)] = s[d];
    } else if constexpr (DUAL) {
      const float gv[1] = {s[0]}, uv[1] = {s[kNB - 1]};
      swiglu_run<T, 1>(p, o, m, n, gv, uv);
    } else {
      const float v[1] = {s[0]};
      epilogue_run<T, 1>(p, o, m, n, v);
    }
  }
#else
  __trap();   // not reached: the module is built for sm_80+ only
#endif
}

// The 16-byte packs of one step of the pipelined kernel: weight rows n0 + 8 j + g (j < NT) of each
// weight at k = k0 + 8 t, k0 = 32 warp + 256 step. `full`: every pack of the warp is whole and the
// weight may be read with vector loads (warp-uniform), else each pack is gathered element by
// element with its own limits (zeros past K and past N).
template <class T, int NT, int NB>
__device__ __forceinline__ void gemv_pipe_issue(uint4 (&w)[NB][NT], const T* const (&wbase)[NB],
                                                const GemmArgs& p, long long n0, long long k0,
                                                int g, int t, bool w_vec) {
  const long long k = k0 + 8 * t;
  const bool full = w_vec && n0 + NT * 8 <= p.N && k0 + 32 <= p.K;
  if (full) {
#pragma unroll
    for (int d = 0; d < NB; ++d)
#pragma unroll
      for (int j = 0; j < NT; ++j) w[d][j] = load_stream16(wbase[d] + (n0 + 8 * j + g) * p.b_sn + k);
  } else {
    const long long nk = p.K - k;
#pragma unroll
    for (int d = 0; d < NB; ++d)
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const long long n = n0 + 8 * j + g;
        w[d][j] = gather16(wbase[d] + n * p.b_sn + k * p.b_sk, p.b_sk, n < p.N ? nk : 0);
      }
  }
}

// `PLAN['decode'] = 'pipe'` (U x NT = 8 packs = 4 KiB per warp in flight) and 'pipe_deep' (16
// packs): what it adds over gemv_mma is memory-level parallelism. gemv_mma issues a step's loads
// and multiplies them in the same loop iteration, and the edge / gather branches around each load
// keep the compiler from hoisting the next step's loads above the mma (sm_90 SASS: LDG, LDG,
// HMMA x 2 NT, LDG, LDG, HMMA ...): a warp has one step, NT x 512 bytes, in flight, so 3 blocks x
// 8 warps x 1 KiB = 24 KiB per SM at NT = 2 -- what HBM3 needs (3.35 TB/s x ~1 us / 132 SMs =
// 25 KiB) with nothing to spare once the loaded latency grows. Here each warp keeps a ring of U
// steps of weight packs in registers: consuming step s issues step s + U into the slot it frees,
// so U x NT x 512 bytes per warp stay in flight (x, reused by every block, is read from L1 when a
// step is consumed). Blocks are persistent (grid.x = the resident slots at most) and walk the row
// tiles blockIdx.x, + gridDim.x, ...; the ring runs on across tiles, so the next tile's loads are
// in flight while a tile's sums meet in shared memory (two buffers: one barrier per tile) and its
// epilogue runs. Every warp takes ceil(K / 256) steps per tile (a warp whose k chunk lies past K
// multiplies zeros), so tile boundaries fall at the same step everywhere in the block. No split-K:
// the host takes this kernel only when the row tiles alone give the blocks work and U <= steps
// (else 'balanced').
template <class T, int NT, int U, int MINB, bool DUAL>
__global__ void __launch_bounds__(kGmThreads, MINB) gemv_mma_pipe(GemmArgs p) {
#if __CUDA_ARCH__ >= 800
  constexpr int kNB = DUAL ? 2 : 1;
  constexpr int kRows = NT * 8;                     // weight rows of each weight per tile
  constexpr int kVals = kNB * NT * 4;               // accumulators per lane
  __shared__ float red[2][kGmWarps][kVals][32];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const long long z = p.z0 + blockIdx.z;
  const BatchOffsets o = batch_offsets(p, z);
  const bool w_vec = p.flags & kBVec, x_vec = p.flags & kAVec;
  const bool lo_row = g < p.M, hi_row = g + 8 < p.M;
  const T* x_lo = static_cast<const T*>(p.a) + o.a + g * p.a_sm;
  const T* x_hi = static_cast<const T*>(p.a) + o.a + (g + 8) * p.a_sm;
  const T* wbase[kNB];
  wbase[0] = static_cast<const T*>(p.b) + o.b;
  if constexpr (DUAL) wbase[kNB - 1] = static_cast<const T*>(p.b2) + o.b;
  pdl_start();

  const int tiles = (int)((p.N + kRows - 1) / kRows);       // the host keeps this < 2^31
  const int my_tiles = (tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
  const int steps = p.K > 256 ? (int)((p.K + 255) / 256) : 1;
  const long long kw = 32 * warp;

  uint4 ring[U][kNB][NT];
  int ii = 0, ij = 0;                               // the next step to issue: (tile, step)
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (ii < my_tiles)
      gemv_pipe_issue<T, NT, kNB>(ring[u], wbase, p,
                                  ((long long)blockIdx.x + (long long)ii * gridDim.x) * kRows,
                                  kw + 256ll * ij, g, t, w_vec);
    if (++ij == steps) { ij = 0; ++ii; }
  }

  float acc[kNB][NT][4];
#pragma unroll
  for (int d = 0; d < kNB; ++d)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[d][j][c] = 0.0f;
  int ci = 0, cj = 0, buf = 0;                      // the step to consume: (tile, step)
  while (ci < my_tiles) {
    // U steps, slot u = step u of the group (static register indices). The host keeps U <= steps,
    // so at most one tile ends in a group: its sums are parked in red[buf] at its last step and
    // reduced after the group (the epilogue's code exists once, not U times).
    int done = -1;                                  // the tile that ended in this group
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (ci < my_tiles) {                          // block-uniform
        const long long k = kw + 256ll * cj + 8 * t;
        uint4 xl, xh;
        load_a_pair16(x_lo, x_hi, k, p.K - k, p.a_sk, lo_row, hi_row, x_vec, xl, xh);
        const unsigned int a0[4] = {xl.x, xh.x, xl.y, xh.y};   // the k permutation of gemv_mma
        const unsigned int a1[4] = {xl.z, xh.z, xl.w, xh.w};
#pragma unroll
        for (int d = 0; d < kNB; ++d)
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            Mma<T>::run(acc[d][j], a0, ring[u][d][j].x, ring[u][d][j].y);
            Mma<T>::run(acc[d][j], a1, ring[u][d][j].z, ring[u][d][j].w);
          }
        if (ii < my_tiles)                          // the slot's next step, U steps ahead
          gemv_pipe_issue<T, NT, kNB>(ring[u], wbase, p,
                                      ((long long)blockIdx.x + (long long)ii * gridDim.x) * kRows,
                                      kw + 256ll * ij, g, t, w_vec);
        if (++ij == steps) { ij = 0; ++ii; }
        if (++cj == steps) {                        // tile ci ends: park its sums
#pragma unroll
          for (int d = 0; d < kNB; ++d)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
              for (int c = 0; c < 4; ++c) {
                red[buf][warp][(d * NT + j) * 4 + c][lane] = acc[d][j][c];
                acc[d][j][c] = 0.0f;
              }
          done = ci;
          cj = 0;
          ++ci;
        }
      }
    }
    if (done >= 0) {   // sums over the 8 warps and the epilogue, while the ring's loads fly
      __syncthreads();
      const long long n0 = ((long long)blockIdx.x + (long long)done * gridDim.x) * kRows;
      for (int q = tid; q < NT * 4 * 32; q += kGmThreads) {
        const int l = q % 32, c = (q / 32) % 4, j = q / 128;
        const long long m = l / 4 + (c >= 2 ? 8 : 0);
        const long long n = n0 + 8 * j + 2 * (l % 4) + (c & 1);
        if (m >= p.M || n >= p.N) continue;
        float s[kNB];
#pragma unroll
        for (int d = 0; d < kNB; ++d) {
          float v = 0.0f;
#pragma unroll
          for (int w = 0; w < kGmWarps; ++w) v += red[buf][w][(d * NT + j) * 4 + c][l];
          s[d] = v;
        }
        if constexpr (DUAL) {
          const float gv[1] = {s[0]}, uv[1] = {s[kNB - 1]};
          swiglu_run<T, 1>(p, o, m, n, gv, uv);
        } else {
          const float v[1] = {s[0]};
          epilogue_run<T, 1>(p, o, m, n, v);
        }
      }
      // no second barrier: red[buf] is written again two tiles on, after the next barrier
      buf ^= 1;
    }
  }
#else
  __trap();   // not reached: the module is built for sm_80+ only
#endif
}

}  // namespace gemm
}  // namespace gpuops
