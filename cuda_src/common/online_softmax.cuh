// Online softmax statistics: a running (max m, sum s = sum exp(x - m)) pair that can absorb new
// values and be merged with other pairs in any order (softmax over long rows split across threads
// or blocks, cross-entropy over large vocabularies, and later attention).
//
// The rules keep torch's NaN/inf results without special cases in the callers:
//   * an empty pair, or one that has only seen -inf, is (-inf, 0) and contributes nothing;
//   * a +inf value makes s NaN (torch's exp(x - max) is exp(inf - inf) = NaN there);
//   * a NaN value makes m and s NaN.
// Callers normalize with the raw m (exp(x - m) / s), so a row of only -inf gives NaN, as torch.
#pragma once
#include "common/fastmath.cuh"
#include "common/reduce.cuh"

namespace gpuops {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

// e^x through MUFU.EX2 on x * log2(e). Relative error <= 2^-22 + |x| * 2^-24 (the rounding of the
// product): for the values that matter in a softmax (x = v - max in [-20, 0]) that is below
// 1.5e-6, far below bf16/fp16 rounding and within fp32's 1e-5 budget. Results below 2^-126
// flush to 0 (those elements are 0 after rounding to any storage type but fp32 denormals).
__device__ __forceinline__ float exp_fast(float x) { return fast_exp2(x * kLog2e); }

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// e^x to within 0.87 ulp (99.5% of results correctly rounded; checked against double exp on
// every 7th float of (-87, 88)), for products whose error a cancellation then magnifies: in
// the log_softmax backward dx = g - exp(y) * sum(g), an error of exp(y) is multiplied by
// |sum(g)|, which can be many times |dx|, and exp_fast's 2^-22 is 2 to 4 ulp. About 12
// instructions (range reduction to f in [-ln2/2, ln2/2] with a two-part ln 2, a degree-7
// polynomial by N. Juffa, scaling by 2^i in two halves so that i = 128 and i = -126 are exact).
// Arguments below -87.34 give 0 (as exp_fast's flush), above 88.72 +inf; NaN stays NaN.
__device__ __forceinline__ float exp_accurate(float a) {
  if (!(a > -87.33654f)) return a != a ? a : 0.0f;
  if (a > 88.72284f) return __int_as_float(0x7f800000);
  const float t = fmaf(a, 1.44269504f, 12582912.0f) - 12582912.0f;   // rint(a log2(e))
  float f = fmaf(t, -6.93145752e-1f, a);                               // a - t ln2_hi
  f = fmaf(t, -1.42860677e-6f, f);                                     //   - t ln2_lo
  float r = 1.37805939e-3f;
  r = fmaf(r, f, 8.37312452e-3f);
  r = fmaf(r, f, 4.16695364e-2f);
  r = fmaf(r, f, 1.66664720e-1f);
  r = fmaf(r, f, 4.99999851e-1f);
  r = fmaf(r, f, 1.0f);
  r = fmaf(r, f, 1.0f);
  const int i = static_cast<int>(t), i1 = i >> 1, i2 = i - i1;
  return r * __int_as_float((i1 + 127) << 23) * __int_as_float((i2 + 127) << 23);
}

// exp(m - M) for merging a pair with max m into one with max M >= m: exactly 1 when m == M
// (which also covers m == M == -inf, where m - M would be NaN, and m == M == +inf, where the
// pair's own s already is NaN).
__device__ __forceinline__ float online_rescale(float m, float M) {
  return m == M ? 1.0f : exp_fast(m - M);
}

// (m, s) <- (m, s) merged with (m2, s2).
__device__ __forceinline__ void online_merge(float& m, float& s, float m2, float s2) {
  const float M = MaxOp::combine(m, m2);
  s = s * online_rescale(m, M) + s2 * online_rescale(m2, M);
  m = M;
}

// (m, s) <- (m, s) merged with K new values: one rescale per call, not per value.
template <int K>
__device__ __forceinline__ void online_add(float& m, float& s, const float (&v)[K]) {
  float pm = v[0];
#pragma unroll
  for (int k = 1; k < K; ++k) pm = MaxOp::combine(pm, v[k]);
  const float base = pm == neg_inf() ? 0.0f : pm;   // all -inf: every term is exp(-inf) = 0
  float ps = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k) ps += exp_fast(v[k] - base);
  online_merge(m, s, pm, ps);
}

// (m, s) <- (m, s) with one new value v: one exponential per value (for loops that see a
// column one element at a time). A new max rescales s; v - v + 1 is exp(v - v), which is NaN for
// v = +inf as torch's exp(inf - inf); a NaN v makes s NaN; -inf adds nothing.
__device__ __forceinline__ void online_add1(float& m, float& s, float v) {
  if (v > m) {
    s = fmaf(s, exp_fast(m - v), (v - v) + 1.0f);
    m = v;
  } else {
    s += v == neg_inf() ? 0.0f : exp_fast(v - m);
  }
}

}  // namespace gpuops
