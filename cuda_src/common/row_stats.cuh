// Statistics of a row held in registers, reduced over a warp or a block: count/mean/M2 triples
// merged pairwise (Welford/Chan: numerically stable variance, never E[x^2] - E[x]^2; shifted
// sums about a value of the data, block_shifted_stats), and sums of
// K values at once (one shared-memory exchange for all K instead of one per value).
//
// Every reduction here is a butterfly, so every lane ends with the result; the merges are written
// symmetric in their two arguments, so that those results are bitwise identical in every lane
// (and in every block that merges the same partials in the same order): every thread of a row
// normalizes with exactly the same mean and rstd.
#pragma once
#include "common/reduce.cuh"
#include "common/fastmath.cuh"

namespace gpuops {

// n values with mean `mean` and sum of squared deviations from it `m2` (variance = m2 / n).
// n is a float: exact up to 2^24, and only ever a weight in the merge beyond that.
struct MeanM2 {
  float n, mean, m2;
};

// Chan, Golub and LeVeque's pairwise update. Symmetric in (a, b): the mean is the weighted sum
// with both products rounded separately (__fmul_rn is never contracted into an FMA, which would
// round one product and not the other), and d^2 is the same for d = mb - ma and d = ma - mb.
// 1/n by MUFU (1 ulp, n >= 1): an IEEE division here doubled the forward kernels' registers.
__device__ __forceinline__ MeanM2 welford_merge(const MeanM2& a, const MeanM2& b) {
  if (b.n == 0.0f) return a;
  if (a.n == 0.0f) return b;
  const float n = a.n + b.n;
  const float inv = fast_rcp(n);
  const float d = b.mean - a.mean;
  MeanM2 r;
  r.n = n;
  r.mean = (__fmul_rn(a.n, a.mean) + __fmul_rn(b.n, b.mean)) * inv;
  r.m2 = (a.m2 + b.m2) + d * d * (__fmul_rn(a.n, b.n) * inv);
  return r;
}

__device__ __forceinline__ MeanM2 warp_welford(MeanM2 s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    MeanM2 o;
    o.n = __shfl_xor_sync(kFullMask, s.n, offset);
    o.mean = __shfl_xor_sync(kFullMask, s.mean, offset);
    o.m2 = __shfl_xor_sync(kFullMask, s.m2, offset);
    s = welford_merge(s, o);
  }
  return s;
}

// Every thread of the block gets the merge of all threads' triples. `scratch`: 96 floats of
// shared memory. blockDim = (multiple of 32, 1, 1). Two __syncthreads(); may be called repeatedly
// with the same scratch.
__device__ __forceinline__ MeanM2 block_welford(MeanM2 s, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  s = warp_welford(s);
  __syncthreads();
  if (lane == 0) {
    scratch[warp] = s.n;
    scratch[32 + warp] = s.mean;
    scratch[64 + warp] = s.m2;
  }
  __syncthreads();
  MeanM2 t = {0.0f, 0.0f, 0.0f};
  if (lane < warps) t = MeanM2{scratch[lane], scratch[32 + lane], scratch[64 + lane]};
  return warp_welford(t);
}

// The merge of two triples of one count (a.n == b.n): Chan's update with n_a = n_b, i.e. the
// mean of the means and m2 + d^2 * n_a / 2: no reciprocal, three operations. Symmetric in (a, b).
__device__ __forceinline__ MeanM2 welford_merge_equal(const MeanM2& a, const MeanM2& b) {
  const float d = b.mean - a.mean;
  MeanM2 r;
  r.n = a.n + b.n;
  r.mean = 0.5f * (a.mean + b.mean);
  r.m2 = (a.m2 + b.m2) + d * d * (0.5f * a.n);
  return r;
}

// block_welford where every thread holds the same count and the block has a power-of-two number
// of warps (the caller's to check; every lane gets the result, bitwise the same): a full tile of
// the long-row plans, whose landing this keeps short (run 111: block_welford's merges, a MUFU
// reciprocal and two branches per level, made layer_norm's landing ~3x rms_norm's block sum).
__device__ __forceinline__ MeanM2 block_welford_equal(MeanM2 s, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    MeanM2 o;
    o.n = s.n;
    o.mean = __shfl_xor_sync(kFullMask, s.mean, offset);
    o.m2 = __shfl_xor_sync(kFullMask, s.m2, offset);
    s = welford_merge_equal(s, o);
  }
  __syncthreads();
  if (lane == 0) {
    scratch[32 + warp] = s.mean;
    scratch[64 + warp] = s.m2;
  }
  __syncthreads();
  const int w = lane & (warps - 1);    // lanes past the warps repeat them: xor stays in a group
  MeanM2 t = {s.n, scratch[32 + w], scratch[64 + w]};
  for (int offset = warps >> 1; offset > 0; offset >>= 1) {
    MeanM2 o;
    o.n = t.n;
    o.mean = __shfl_xor_sync(kFullMask, t.mean, offset);
    o.m2 = __shfl_xor_sync(kFullMask, t.m2, offset);
    t = welford_merge_equal(t, o);
  }
  return t;
}

// The block's mean and M2 in one exchange from shifted sums: each thread's s1 = sum(x - k) and
// s2 = sum((x - k)^2) about a shift k common to its warp and taken from the warp's own values,
// `count` the warp's number of values (the same in every lane), `total` the block's. Per warp,
// M2 = s2 - s1^2 / count: the shifted-data formula, whose rounding grows with
// count * (mean - k)^2 / variance ulps, i.e. a few ulps where k is a typical value of the warp and
// never the catastrophic E[x^2] - E[x]^2 of k = 0 on rows far from zero mean; across the warps
// Chan's merge (lane w takes warp w's triple). Against two block sums (the mean, then the squared
// deviations) this saves one exchange: two __syncthreads() and a round trip through `scratch` (96
// floats) on the row's critical path. Every lane gets bitwise the same result (butterfly sums of
// commutative additions).
__device__ __forceinline__ MeanM2 block_shifted_stats(float s1, float s2, float k, float count,
                                                      float total, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  s1 = warp_sum(s1);
  s2 = warp_sum(s2);
  __syncthreads();
  if (lane == 0) {
    const float inv = count > 0.0f ? fast_rcp(count) : 0.0f;
    scratch[warp] = count;
    scratch[32 + warp] = k + s1 * inv;
    scratch[64 + warp] = fmaxf(s2 - s1 * s1 * inv, 0.0f);
  }
  __syncthreads();
  float n_w = 0.0f, mean_w = 0.0f, m2_w = 0.0f;
  if (lane < warps) {
    n_w = scratch[lane];
    mean_w = scratch[32 + lane];
    m2_w = scratch[64 + lane];
  }
  MeanM2 r;
  r.n = total;
  r.mean = warp_sum(n_w * mean_w) * fast_rcp(total);
  const float d = mean_w - r.mean;
  r.m2 = warp_sum(fmaf(n_w * d, d, m2_w));
  return r;
}

// K sums at once over a warp: v[k] becomes the warp's total of v[k] in every lane.
template <int K>
__device__ __forceinline__ void warp_sum_n(float (&v)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
}

// K sums at once over the block (blockDim = (multiple of 32, 1, 1)): one exchange through
// `scratch` (32 * K floats of shared memory) and two __syncthreads() for all K.
template <int K>
__device__ __forceinline__ void block_sum_n(float (&v)[K], float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  warp_sum_n<K>(v);
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) scratch[32 * k + warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = lane < warps ? scratch[32 * k + lane] : 0.0f;
  warp_sum_n<K>(v);
}

}  // namespace gpuops
