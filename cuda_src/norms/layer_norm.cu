// LayerNorm forward: y = (x - mean) * rstd * w + b over rows of n elements, with the per-row mean
// and rstd = 1 / sqrt(var + eps) (biased variance) kept in fp32 for the backward. Statistics: two
// passes over the registers (the mean, then the sum of squared deviations from it: stable for rows
// far from zero mean, unlike E[x^2] - E[x]^2), and for rows split over blocks, Chan merges of the
// blocks' (count, mean, M2) (common/row_stats.cuh). Per-thread Welford triples merged by
// shuffles instead cost 4-8 more registers (one fewer resident block per SM at 4096-wide rows)
// and spilled on some archs. Row layout and phases: norms/norm_rows.cuh.
#include "norms/norm_rows.cuh"
#include "norms/norm_ring.cuh"
#include "norms/layer_norm_ring.cuh"
#include "norms/norm_stream.cuh"
#include "common/pdl.cuh"

namespace gpuops {

// Count, mean and M2 of the block's chunk (of a warp's row when !block_rows): two passes over
// each warp's values (sum -> the warp's mean, then squared deviations from it; shuffles only),
// then a block's warps merge their (count, mean, M2) through shared memory, every thread the same
// warps in the same order (Chan): one exchange (two barriers) per row, as rms_norm's one sum,
// instead of a block-wide mean before the deviations. The values of a thread stay in registers.
template <int VEC, int PACKS, class Src>
__device__ __forceinline__ MeanM2 chunk_stats(const Src& v, int u0, int units, bool block_rows,
                                              float* scratch) {
  const int step = static_cast<int>(blockDim.x);
  float t[2] = {0.0f, 0.0f};                     // sum, count of the valid values
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
    if (u0 + p * step < units) t[1] += static_cast<float>(VEC);
    float f[VEC];
    v.get(p, f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) t[0] += f[j];   // past the end: 0
  }
  warp_sum_n<2>(t);
  MeanM2 s;
  s.n = t[1];
  s.mean = s.n > 0.0f ? t[0] * fast_rcp(s.n) : 0.0f;
  float q[1] = {0.0f};
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
    if (u0 + p * step < units) {
      float f[VEC];
      v.get(p, f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = f[j] - s.mean;
        q[0] = fmaf(d, d, q[0]);
      }
    }
  }
  warp_sum_n<1>(q);
  s.m2 = q[0];
  if (!block_rows) return s;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();                               // (scratch may still be read by a prior use)
  if (lane == 0) {
    scratch[warp] = s.n;
    scratch[32 + warp] = s.mean;
    scratch[64 + warp] = s.m2;
  }
  __syncthreads();
  MeanM2 acc = {scratch[0], scratch[32], scratch[64]};
  for (int i = 1; i < warps; ++i) acc = welford_merge(acc, MeanM2{scratch[i], scratch[32 + i],
                                                                  scratch[64 + i]});
  return acc;
}

// w and b at this thread's units. Where they take at most 16 registers (up to two 16-byte packs:
// the [*, 4096] 16-bit case), they are loaded ahead, with the row: their L2 round trip overlaps
// the row's DRAM one and the statistics; else in groups of two packs when applied; kTight (a
// caller with two row buffers live, or layer_norm_compact's 32 registers): one pack at a time.
template <class T, int VEC, int PACKS, bool kTight = false>
struct AffineParams {
  using R = RawUnit<T, VEC>;
  using Raw = typename R::type;
  static constexpr bool kAhead = !kTight && VEC > 1 && PACKS <= 2;
  static constexpr int kGroup = kAhead ? PACKS : kTight ? 1 : PACKS < 2 ? PACKS : 2;
  static constexpr int kHeld = kAhead ? PACKS : 1;
  Raw wr[kHeld], br[kHeld];

  __device__ __forceinline__ void load_ahead(const T* w, const T* b, int u0, int units) {
    if (kAhead) {
      if (w != nullptr) load_params<T, VEC, kHeld>(w, u0, 0, units, wr);
      if (b != nullptr) load_params<T, VEC, kHeld>(b, u0, 0, units, br);
    }
  }
};

// y = (v - mean) * rstd * w + b for this thread's units of the row, w and b from `ahead` (loaded
// earlier) or loaded here, all of a group of packs before the first is used (one L2 round trip
// per group: a pack's branch kept the compiler from hoisting the next pack's loads).
template <class T, int VEC, int PACKS, bool kTight, class Src>
__device__ __forceinline__ void normalize_store(const Src& v, float mean, float rstd, const T* w,
                                                const T* b,
                                                const AffineParams<T, VEC, PACKS, kTight>& ahead,
                                                T* y_row, int u0, int units) {
  using A = AffineParams<T, VEC, PACKS, kTight>;
  using R = RawUnit<T, VEC>;
  constexpr int G = A::kGroup;
#pragma unroll
  for (int p0 = 0; p0 < PACKS; p0 += G) {
    typename R::type wr[G], br[G];
    if (A::kAhead) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        wr[g] = ahead.wr[A::kAhead ? p0 + g : 0];
        br[g] = ahead.br[A::kAhead ? p0 + g : 0];
      }
    } else {
      if (w != nullptr) load_params<T, VEC, G>(w, u0, p0, units, wr);
      if (b != nullptr) load_params<T, VEC, G>(b, u0, p0, units, br);
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int p = p0 + g;
      const int u = u0 + p * static_cast<int>(blockDim.x);
      if (u < units) {
        float f[VEC];
        v.get(p, f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] = (f[j] - mean) * rstd;
        if (w != nullptr) {
          float wv[VEC];
          R::unpack(wr[g], wv);
#pragma unroll
          for (int j = 0; j < VEC; ++j) f[j] *= wv[j];
        }
        if (b != nullptr) {
          float bv[VEC];
          R::unpack(br[g], bv);
#pragma unroll
          for (int j = 0; j < VEC; ++j) f[j] += bv[j];
        }
        Unit<T, VEC>::store(y_row + static_cast<long long>(u) * VEC, f);
      }
    }
  }
}

// Whole rows (C == 1, phase kFused) or the two launches of split rows (C > 1: kPartials, then
// kApply). x, y: rows of n elements, `x_stride` / `y_stride` elements apart (y may be x: in
// place). w, b: n elements or null. mean_out, rstd_out: one float per row, or null when not
// wanted with C == 1 (for C > 1 they carry the row statistics from kPartials to kApply).
// partials (rows * C * 3 floats) and counters (rows, zeroed): only for C > 1.
template <class T, int VEC, int PACKS>
__global__ void __launch_bounds__(1024, 1)
layer_norm_fwd(const T* x, long long x_stride, T* y, long long y_stride, const T* __restrict__ w,
               const T* __restrict__ b, float* mean_out, float* rstd_out,
               float* __restrict__ partials, unsigned* __restrict__ counters, long long rows,
               int n, int C, int phase, float eps) {
  pdl_start();
  __shared__ float scratch[96];   // block_sum_n<1>: 32, merge_welford_partials: 96
  __shared__ unsigned flag;
  const RowMap map(C, phase == kApply);
  const int units = n / VEC;
  const int u0 = first_unit<PACKS>(map.chunk);
  const bool block_rows = blockDim.x > 32;
  const float inv_n = 1.0f / static_cast<float>(n);   // n = 0: rstd = NaN, as torch

  for (long long row = map.first; row < rows; row += map.step) {
    RawTile<T, VEC, PACKS> xt;                       // raw: half the registers of 16-bit floats
    xt.load(x + row * x_stride, u0, units);
    const RawPacks<T, VEC, PACKS> v{xt};
    AffineParams<T, VEC, PACKS> ahead;
    if (phase != kPartials) ahead.load_ahead(w, b, u0, units);
    float mean, rstd;
    if (phase == kApply) {
      mean = mean_out[row];
      rstd = rstd_out[row];
    } else {
      const MeanM2 s = chunk_stats<VEC, PACKS>(v, u0, units, block_rows, scratch);
      if (C > 1) {   // kPartials
        float* row_partials = partials + row * C * 3;
        const float mine[3] = {s.n, s.mean, s.m2};
        if (split_arrive<3>(row_partials + 3 * map.chunk, mine, counters + row, &flag) ==
            static_cast<unsigned>(C - 1))
          merge_row_stats(row_partials, C, inv_n, eps, mean_out + row, rstd_out + row, scratch);
        continue;
      }
      mean = s.mean;
      rstd = rsqrtf(s.m2 * inv_n + eps);
      if (mean_out != nullptr && threadIdx.x == 0) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
      }
    }
    normalize_store<T, VEC, PACKS>(v, mean, rstd, w, b, ahead, y + row * y_stride, u0, units);
  }
}

// y = (v - mean) * rstd * w + b for this thread's units of the row, v (floats) overwritten, w
// and b loaded pack by pack where they are used (runs 11-14: 8 fewer registers than
// normalize_store with the same loads, as ptxas 13.0 counts for layer_norm_two_pass<bf16, 8, 2>).
template <class T, int VEC, int PACKS>
__device__ __forceinline__ void normalize_store_in_place(float (&v)[PACKS][VEC], float mean,
                                                         float rstd, const T* w, const T* b,
                                                         T* y_row, int u0, int units) {
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
    const int u = u0 + p * static_cast<int>(blockDim.x);
    if (u < units) {
      const long long e = static_cast<long long>(u) * VEC;
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[p][j] = (v[p][j] - mean) * rstd;
      if (w != nullptr) {
        float wv[VEC];
        Unit<T, VEC>::load(w + e, wv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[p][j] *= wv[j];
      }
      if (b != nullptr) {
        float bv[VEC];
        Unit<T, VEC>::load(b + e, bv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[p][j] += bv[j];
      }
      Unit<T, VEC>::store(y_row + e, v[p]);
    }
  }
}

// Whole rows, one block per row (C == 1, blockDim = (>32, 1, 1); arguments as layer_norm_fwd,
// partials / counters / C / phase unused), the algorithm of runs 11-14 (WHOLE_ROWS =
// "two_pass"; 94.7% of copy at [32768, 4096] bf16, 48 registers, 5 blocks/SM): x converted to
// floats on load, a block sum for the mean, then a block sum of squared deviations from it (two
// exchanges, four barriers), w and b loaded pack by pack after the statistics (their registers
// are never live with the row's loads in flight).
template <class T, int VEC, int PACKS>
__global__ void __launch_bounds__(1024, 1)
layer_norm_two_pass(const T* x, long long x_stride, T* y, long long y_stride,
                    const T* __restrict__ w, const T* __restrict__ b, float* mean_out,
                    float* rstd_out, float* partials, unsigned* counters, long long rows, int n,
                    int C, int phase, float eps) {
  pdl_start();
  __shared__ float scratch[32];
  const int units = n / VEC;
  const int u0 = static_cast<int>(threadIdx.x);
  const int step = static_cast<int>(blockDim.x);
  const float inv_n = 1.0f / static_cast<float>(n);   // n = 0: rstd = NaN, as torch
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    float v[PACKS][VEC];
    load_tile<T, VEC, PACKS>(x + row * x_stride, u0, units, v);
    float t[1] = {0.0f};
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) t[0] += v[p][j];   // past the end: 0
    }
    block_sum_n<1>(t, scratch);
    const float mean = t[0] / static_cast<float>(n);
    t[0] = 0.0f;
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      if (u0 + p * step < units) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = v[p][j] - mean;
          t[0] = fmaf(d, d, t[0]);
        }
      }
    }
    block_sum_n<1>(t, scratch);
    const float rstd = rsqrtf(t[0] * inv_n + eps);
    if (mean_out != nullptr && threadIdx.x == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
    normalize_store_in_place<T, VEC, PACKS>(v, mean, rstd, w, b, y + row * y_stride, u0, units);
  }
}

// Whole rows, one block per row (WHOLE_ROWS = "lean"; 16-byte units, at most 2 packs, gridDim.x
// == rows; arguments as layer_norm_two_pass): Liger's structure (w and b loaded with the row, two
// plain block sums) at fewer instructions. Its first version (x kept raw, converted at each of
// its three uses; x - mean computed twice; bounds checks on every pack; (v - mean) * rstd * w + b
// as four operations; two IEEE divisions by n) ran 105.6M instructions at [32768, 4096] bf16
// against the 83.1M of Liger's Triton kernel, same registers and occupancy (5 blocks of 256
// threads per SM), 148.0 us against 138.0 (Nsight Compute, run 161, H200). Here x is converted
// once (its floats replace the raw bits: 16 registers for 2 packs of bf16), the deviations
// d = x - mean are computed once and kept for the variance and the output, y = fma(d * rstd, w,
// b), one division (1 / n), and FULL (every thread's packs inside the row: n = 16 * threads *
// PACKS bytes) drops the bounds checks.
//
// ONE_EXCHANGE (16-bit outputs, blocks of <= 256 threads): the statistics from shifted sums in
// one block exchange (block_shifted_stats, each warp's shift its lane 0's first value) instead of
// two block sums, x held raw (converted for the sums and again for the output), and 40 registers
// (launch bounds: 6 blocks of 256 threads per SM; 42 without them, 47 for the two-sum instance).
// Run 162 (H200, [32768, 4096] bf16): the two-sum kernel ran 78.9M instructions (Liger 83.1M) at
// 141.2 us (Liger 140.6), issue slots 55% busy, while rms_norm_rows, one block sum, ran 129.2:
// what is left is the latency of the row's chain, of which the second exchange is a part.
template <class T, int VEC, int PACKS, bool FULL, bool ONE_EXCHANGE>
__global__ void __launch_bounds__(ONE_EXCHANGE ? 256 : 1024, ONE_EXCHANGE ? 6 : 1)
layer_norm_lean(const T* x, long long x_stride, T* y, long long y_stride,
                const T* __restrict__ w, const T* __restrict__ b, float* mean_out,
                float* rstd_out, float* partials, unsigned* counters, long long rows, int n,
                int C, int phase, float eps) {
  pdl_start_untriggered();        // (grids of many waves only: WHOLE_ROWS; common/pdl.cuh)
  static_assert(VEC > 1 && PACKS <= 2, "16-byte units, w and b held: at most 2 packs");
  static_assert(!ONE_EXCHANGE || sizeof(T) == 2, "shifted sums: 16-bit outputs only");
  using R = RawUnit<T, VEC>;
  __shared__ float scratch[ONE_EXCHANGE ? 96 : 32];
  const int units = n / VEC;
  const int u0 = static_cast<int>(threadIdx.x);
  const int step = static_cast<int>(blockDim.x);
  const long long row = blockIdx.x;
  const T* x_row = x + row * x_stride;
  // x, w and b loads all issued first, without a branch: a missing w or b reads the row instead
  // (n elements as well; never used). Behind `if (w != nullptr)` the compiler issued them only
  // after the row's sum, i.e. after x's DRAM round trip (the SASS of the first version).
  const T* w_src = w != nullptr ? w : x_row;
  const T* b_src = b != nullptr ? b : x_row;
  typename R::type xr[PACKS], wr[PACKS], br[PACKS];
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
    const int u = u0 + p * step;
    const long long e = static_cast<long long>(u) * VEC;
    const bool in = FULL || u < units;
    xr[p] = in ? R::load(x_row + e) : R::zero();
    wr[p] = in ? R::load(w_src + e) : R::zero();
    br[p] = in ? R::load(b_src + e) : R::zero();
  }
  float d[PACKS][VEC];
#pragma unroll
  for (int p = 0; p < PACKS; ++p) R::unpack(xr[p], d[p]);   // past the end: +0.0
  float mean, rstd;
  if (ONE_EXCHANGE) {
    // (lane 0's first unit lies in the row wherever the warp has any; else count = 0)
    const float k = __shfl_sync(kFullMask, d[0][0], 0);
    const int warp_u = u0 & ~31;
    float s1 = 0.0f, s2 = 0.0f, count = 0.0f;
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      if (FULL || u0 + p * step < units) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float e = d[p][j] - k;
          s1 += e;
          s2 = fmaf(e, e, s2);
        }
      }
      const int left = units - (warp_u + p * step);        // the warp's units of this pack
      count += FULL ? 32.0f * VEC : static_cast<float>(VEC * max(0, min(32, left)));
    }
    const MeanM2 s = block_shifted_stats(s1, s2, k, count, static_cast<float>(n), scratch);
    mean = s.mean;
    rstd = rsqrtf(s.m2 * (1.0f / static_cast<float>(n)) + eps);   // n = 0: NaN, as torch
  } else {
    float t[1] = {0.0f};
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) t[0] += d[p][j];
    }
    block_sum_n<1>(t, scratch);
    const float inv_n = 1.0f / static_cast<float>(n);        // n = 0: rstd = NaN, as torch
    mean = t[0] * inv_n;
    t[0] = 0.0f;
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) d[p][j] -= mean;
      if (FULL || u0 + p * step < units) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) t[0] = fmaf(d[p][j], d[p][j], t[0]);
      }
    }
    block_sum_n<1>(t, scratch);
    rstd = rsqrtf(t[0] * inv_n + eps);
  }
  if (mean_out != nullptr && threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  T* y_row = y + row * y_stride;
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
    const int u = u0 + p * step;
    if (FULL || u < units) {
      float o[VEC];
      if (ONE_EXCHANGE) {          // x converted again from its raw bits (8 registers, not 16)
        R::unpack(xr[p], o);
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] = (o[j] - mean) * rstd;
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] = d[p][j] * rstd;
      }
      if (w != nullptr) {
        float wv[VEC];
        R::unpack(wr[p], wv);
        if (b != nullptr) {
          float bv[VEC];
          R::unpack(br[p], bv);
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] = fmaf(o[j], wv[j], bv[j]);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] *= wv[j];
        }
      } else if (b != nullptr) {
        float bv[VEC];
        R::unpack(br[p], bv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] += bv[j];
      }
      R::store(y_row + static_cast<long long>(u) * VEC, R::pack(o));
    }
  }
}

// Whole rows, one block per row, for 8 blocks of 256 threads per SM (WHOLE_ROWS = "compact":
// <= 32 registers; 16-byte units, blockDim.x <= 256, gridDim.x == rows; arguments as
// layer_norm_two_pass): the row raw in registers (16-bit values: 8 registers for 2 packs,
// converted at each use), the statistics in one exchange (chunk_stats: each warp two-pass, Chan
// merge of the warps), then w and b loaded pack by pack after the statistics, when the row's
// loads have landed. What it took to fit 32 (ptxas 13.0, sm_90, 2 packs): no loop over rows
// (its 64-bit row counters: 8-36 B of spills), and w, b one pack at a time (both at once: 24-56
// B of spills), i.e. two dependent L2 round trips per row after the statistics, against 8 rows
// in flight per SM instead of 4-5.
template <class T, int VEC, int PACKS>
__global__ void __launch_bounds__(256, 8)
layer_norm_compact(const T* x, long long x_stride, T* y, long long y_stride,
                   const T* __restrict__ w, const T* __restrict__ b, float* mean_out,
                   float* rstd_out, float* partials, unsigned* counters, long long rows, int n,
                   int C, int phase, float eps) {
  pdl_start();
  static_assert(VEC > 1, "16-byte units");
  __shared__ float scratch[96];
  const int units = n / VEC;
  const int u0 = static_cast<int>(threadIdx.x);
  const long long row = blockIdx.x;
  RawTile<T, VEC, PACKS> xt;
  xt.load(x + row * x_stride, u0, units);
  const RawPacks<T, VEC, PACKS> v{xt};
  const MeanM2 s = chunk_stats<VEC, PACKS>(v, u0, units, true, scratch);
  const float rstd = rsqrtf(s.m2 * (1.0f / static_cast<float>(n)) + eps);   // n = 0: NaN
  if (mean_out != nullptr && threadIdx.x == 0) {
    mean_out[row] = s.mean;
    rstd_out[row] = rstd;
  }
  AffineParams<T, VEC, PACKS, true> late;          // (pack by pack)
  normalize_store<T, VEC, PACKS>(v, s.mean, rstd, w, b, late, y + row * y_stride, u0, units);
}

// One row of a split launch in one pass: publish the chunk's statistics, prefetch the chunk of
// this block's next row into `next` (it streams in while the row's blocks wait for each other),
// merge if last, wait for the row's statistics, apply.
template <class T, int VEC, int PACKS>
__device__ __forceinline__ void layer_norm_split_row(
    float (&cur)[PACKS][VEC], float (&next)[PACKS][VEC], long long row, long long next_row,
    const T* x, long long x_stride, T* y, long long y_stride, const T* w, const T* b,
    float* mean_out, float* rstd_out, float* partials, unsigned* counters, long long rows,
    int C, int chunk, int u0, int units, float inv_n, float eps, float* scratch,
    unsigned* flag) {
  const MeanM2 s = chunk_stats<VEC, PACKS>(FloatPacks<VEC, PACKS>{cur}, u0, units, true,
                                            scratch);
  float* row_partials = partials + row * C * 3;
  const float mine[3] = {s.n, s.mean, s.m2};
  const unsigned before = split_arrive<3>(row_partials + 3 * chunk, mine, counters + row, flag);
  if (next_row < rows) load_tile<T, VEC, PACKS>(x + next_row * x_stride, u0, units, next);
  if (before == static_cast<unsigned>(C - 1)) {
    merge_row_stats(row_partials, C, inv_n, eps, mean_out + row, rstd_out + row, scratch);
    split_release(counters + row);
  }
  split_wait(counters + row, static_cast<unsigned>(C + 1));
  const float mean = load_cg(mean_out + row);
  const float rstd = load_cg(rstd_out + row);
  AffineParams<T, VEC, PACKS, true> none;   // (two row buffers are live here: pack by pack)
  normalize_store<T, VEC, PACKS>(FloatPacks<VEC, PACKS>{cur}, mean, rstd, w, b, none,
                                 y + row * y_stride, u0, units);
}

// Split rows in one launch (C > 1, every block of the grid resident; arguments as
// layer_norm_fwd, with mean_out and rstd_out required and `phase` ignored). Two register buffers
// alternate between the row being finished and the next row being loaded.
template <class T, int VEC, int PACKS>
__global__ void __launch_bounds__(1024, 1)
layer_norm_split(const T* x, long long x_stride, T* y, long long y_stride,
                 const T* __restrict__ w, const T* __restrict__ b, float* mean_out,
                 float* rstd_out, float* __restrict__ partials, unsigned* __restrict__ counters,
                 long long rows, int n, int C, int phase, float eps) {
  pdl_start();
  __shared__ float scratch[96];
  __shared__ unsigned flag;
  const RowMap map(C);
  const int units = n / VEC;
  const int u0 = first_unit<PACKS>(map.chunk);
  const float inv_n = 1.0f / static_cast<float>(n);
  float va[PACKS][VEC], vb[PACKS][VEC];
  long long row = map.first;
  if (row < rows) load_tile<T, VEC, PACKS>(x + row * x_stride, u0, units, va);
  while (row < rows) {
    layer_norm_split_row<T, VEC, PACKS>(va, vb, row, row + map.step, x, x_stride, y, y_stride,
                                        w, b, mean_out, rstd_out, partials, counters, rows, C,
                                        map.chunk, u0, units, inv_n, eps, scratch, &flag);
    row += map.step;
    if (row >= rows) break;
    layer_norm_split_row<T, VEC, PACKS>(vb, va, row, row + map.step, x, x_stride, y, y_stride,
                                        w, b, mean_out, rstd_out, partials, counters, rows, C,
                                        map.chunk, u0, units, inv_n, eps, scratch, &flag);
    row += map.step;
  }
}

// Split rows, one pass (arguments as layer_norm_fwd; mean_out and rstd_out required; C tiles of
// blockDim.x * PACKS units per row, D ring slots in the dynamic shared memory of
// kRingHeaderBytes + D * blockDim.x * PACKS * sizeof(unit) bytes). Every block of the grid must
// be resident at once.
template <class T, int VEC, int PACKS>
__global__ void __launch_bounds__(512, GPUOPS_RING_MIN_BLOCKS)
layer_norm_ring(const T* x, long long x_stride, T* y, long long y_stride, const T* __restrict__ w,
                const T* __restrict__ b, float* mean_out, float* rstd_out,
                float* __restrict__ partials, unsigned* __restrict__ counters, long long rows,
                int n, int C, int D, float eps) {
  pdl_start();
  extern __shared__ uint4 ring_smem[];
  LayerNormRing<T, VEC, PACKS> pol(x, x_stride, y, y_stride, w, b, mean_out, rstd_out, n, eps);
  ring_rows(pol, rows, n / VEC, C, D, partials, counters,
            reinterpret_cast<unsigned char*>(ring_smem));
}

// The same with ring2's exchange (norm_ring.cuh): mean_out and rstd_out may be null; `state`:
// the host's per-stream ring2 state (launch counter, exit counter, rows * C * 2 words).
template <class T, int VEC, int PACKS>
__global__ void __launch_bounds__(512, GPUOPS_RING_MIN_BLOCKS)
layer_norm_ring2(const T* x, long long x_stride, T* y, long long y_stride,
                 const T* __restrict__ w, const T* __restrict__ b, float* mean_out,
                 float* rstd_out, unsigned* state, long long rows, int n, int C, int D,
                 float eps) {
  pdl_start();
  extern __shared__ uint4 ring_smem[];
  LayerNormRing<T, VEC, PACKS> pol(x, x_stride, y, y_stride, w, b, mean_out, rstd_out, n, eps);
  ring2_rows<LayerNormRing<T, VEC, PACKS>::kPollBatch>(
      pol, rows, n / VEC, C, D, state, reinterpret_cast<unsigned char*>(ring_smem));
}

// Split rows with every tile of a block held at once (norm_ring.cuh, "resident"; 16-byte units,
// sm_80+ for speed): arguments as layer_norm_ring2; D slots of shared memory as the ring's, and
// gridDim.x * (D + 1) >= rows * C. One block of 512 threads per SM.
template <class T, int VEC, int PACKS>
__global__ void __launch_bounds__(512, 1)
layer_norm_resident(const T* x, long long x_stride, T* y, long long y_stride,
                    const T* __restrict__ w, const T* __restrict__ b, float* mean_out,
                    float* rstd_out, unsigned* state, long long rows, int n, int C, int D,
                    float eps) {
  pdl_start();
  extern __shared__ uint4 ring_smem[];
  LayerNormRing<T, VEC, PACKS> pol(x, x_stride, y, y_stride, w, b, mean_out, rstd_out, n, eps);
  // The gather polls 2 words per lane per round trip (64 chunks of a row in one; ring2's
  // kPollBatch is 1 for the ring kernels' 64 registers): run 113, fp32 [8, 393216] 12.3 ->
  // 11.4 us, [16, 1M] bf16 33.6 -> 33.3.
  resident_rows<2>(
      pol, rows, n / VEC, C, D, state, reinterpret_cast<unsigned char*>(ring_smem));
}

// layer_norm's rows for stream_rows (norms/norm_stream.cuh): w and b (when given) in shared
// memory, units [0, units) and [units, 2 units); the row's statistics two-pass over the stage (the
// mean, then squared deviations from it: two team sums), y = (x - mean) * rstd * w + b as
// normalize_store.
template <class T, int VEC>
struct LayerNormStream {
  static constexpr int kParams = 2;
  static constexpr int kSources = 1;
  using R = RawUnit<T, VEC>;
  const T* x;
  long long x_stride;
  T* y;
  long long y_stride;
  const T* w;
  const T* b;
  float* mean_out;
  float* rstd_out;
  float inv_n, eps;

  __device__ __forceinline__ void load_params(uint4* smem, int units) const {
    stream_params<T, VEC>(smem, w, units);
    stream_params<T, VEC>(smem + units, b, units);
  }
  __device__ __forceinline__ void issue(uint4* stage, long long row, const StreamTeam& team,
                                        int units) const {
    stream_issue_row<T, VEC>(stage, x + row * x_stride, team.lane, team.size, units);
  }
  __device__ __forceinline__ void work(const uint4* stage, const uint4* params, long long row,
                                       StreamTeam& team, int units) const {
    float acc[VEC] = {};
#pragma unroll 4
    for (int u = team.lane; u < units; u += team.size) {
      float f[VEC];
      R::unpack(stage[u], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += f[j];
    }
    const float mean = team.sum(sum_lanes<VEC>(acc)) * inv_n;
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
#pragma unroll 4
    for (int u = team.lane; u < units; u += team.size) {
      float f[VEC];
      R::unpack(stage[u], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = f[j] - mean;
        acc[j] = fmaf(d, d, acc[j]);
      }
    }
    const float rstd = rsqrtf(team.sum(sum_lanes<VEC>(acc)) * inv_n + eps);
    if (mean_out != nullptr && team.lane == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
    T* y_row = y + row * y_stride;
    // (x - mean) first: fma(x, rstd, -mean * rstd) in its place (with w / b filled as 1 / 0 in
    // shared memory, 2 operations per element) ran slower (run 162, H200, [32768, 4096] bf16:
    // 154.1 us against run 160's 148.4) and lost the far-mean rows (mean 300: x * rstd rounded
    // at 300 * 2^-24 before the cancellation, 3x the test's bound).
#pragma unroll 4
    for (int u = team.lane; u < units; u += team.size) {
      float f[VEC];
      R::unpack(stage[u], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = (f[j] - mean) * rstd;
      if (w != nullptr) {
        float wv[VEC];
        R::unpack(params[u], wv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] *= wv[j];
      }
      if (b != nullptr) {
        float bv[VEC];
        R::unpack(params[units + u], bv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] += bv[j];
      }
      store16(y_row + static_cast<long long>(u) * VEC, R::pack(f));
    }
  }
};

// Whole rows streamed through shared memory, a team of `team` warps per row (norms/
// norm_stream.cuh; 16-byte units, n >= VEC): x, y rows of n elements `x_stride` / `y_stride`
// apart (y may be x); w, b: n elements or null; mean_out, rstd_out: a float per row, or null.
// blockDim.x / 32 / team teams (at most 15 when team > 1), D stages each: (2 + teams * D) *
// n / VEC * 16 bytes of dynamic shared memory, plus 8 * team * teams when team > 1, rounded
// up to 16. Any grid.
template <class T, int VEC>
__global__ void __launch_bounds__(512, 1)
layer_norm_stream(const T* x, long long x_stride, T* y, long long y_stride,
                  const T* __restrict__ w, const T* __restrict__ b, float* mean_out,
                  float* rstd_out, long long rows, int n, int D, int team, float eps) {
  static_assert(VEC > 1, "16-byte units");
  pdl_start();
  extern __shared__ uint4 ring_smem[];
  const LayerNormStream<T, VEC> pol{x, x_stride, y, y_stride, w, b, mean_out, rstd_out,
                                    1.0f / static_cast<float>(n), eps};
  stream_rows(pol, rows, n / VEC, D, team, ring_smem);
}

}  // namespace gpuops
