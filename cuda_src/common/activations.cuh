// Activation functions in fp32, shared by the elementwise family and (later) GEMM epilogues.
// Each is written to match torch's results on NaN and +-inf, and to avoid the cancellation in
// torch's own 1 + erf(x) / 1 + tanh(u) forms, which loses all relative precision for x << 0.
#pragma once
#include "common/fastmath.cuh"

namespace gpuops {

// sigmoid(z) = 1 / (1 + exp(-z)) with one MUFU.EX2 and one MUFU.RCP (torch's IEEE division is a
// long instruction sequence per element: in a GEMM epilogue, where the tensor cores wait for it,
// bias+gelu_tanh cost +54.8% over the bare product with that form, run 87; +10.6% with this one,
// run 88). Relative error below 1e-6 (the rounding of -z log2(e) dominates), far under fp16 /
// bf16 storage rounding and within fp32's tolerance. z = -inf -> 0, +inf -> 1, NaN -> NaN; for
// z < -87.3 (1 + 2^t > 2^126) the reciprocal flushes to 0 where the exact value is below 2^-126.
__device__ __forceinline__ float sigmoid_f(float z) {
  return fast_rcp(1.0f + fast_exp2(-1.4426950408889634f * z));
}

// x * sigmoid(x), as torch for x = -inf (NaN), x << 0 (-0), +inf and NaN.
__device__ __forceinline__ float silu_f(float x) { return x * sigmoid_f(x); }

// Phi(-a) = 0.5 erfc(a / sqrt 2) for a >= 0, the lower tail of the normal CDF.
// erfc(z) = t exp(P(t) - z^2) with t = 1 / (1 + z/2) and P of degree 9 fitted by
// scripts/fit_erfc.py (relative error 1e-7 in exact arithmetic). Evaluated in base 2, with log2(e)
// and the 1/2 folded into the coefficients, so the whole tail is one MUFU.RCP, eleven FMAs and one
// MUFU.EX2: erfcf (70% of copy bandwidth for bf16 GELU on the H100), then expf with an IEEE
// reciprocal (84%), then exp2f with __fdividef (94%) left GELU compute-bound (runs #1, #3, #5).
// Relative error in fp32: under 1e-5 wherever Phi(-a) > 1e-30 (the rounding of a^2 dominates);
// below 2^-126 the tail flushes to 0, as torch's 1 + erf(x) does far sooner.
__device__ __forceinline__ float normal_lower_tail_f(float a) {
  const float t = fast_rcp(fmaf(0.35355339059327376f, a, 1.0f));  // 1 / (1 + a / sqrt 8), >= 1
  const float w = a * 0.84932180028801904f;                                // a sqrt(log2 e / 2)
  float q = 2.465173090e-01f;
  q = fmaf(q, t, -1.186114952e+00f);
  q = fmaf(q, t, 2.147474492e+00f);
  q = fmaf(q, t, -1.637753182e+00f);
  q = fmaf(q, t, 4.023216026e-01f);
  q = fmaf(q, t, -2.687568628e-01f);
  q = fmaf(q, t, 1.396300702e-01f);
  q = fmaf(q, t, 5.397006151e-01f);
  q = fmaf(q, t, 1.442729204e+00f);
  q = fmaf(q, t, -2.825748211e+00f);
  return t * fast_exp2(fmaf(-w, w, q));
}

// x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), with Phi from its lower tail so that it keeps full
// relative precision for x << 0, where torch's 1 + erf(x / sqrt 2) cancels. NaN -> NaN,
// -inf -> NaN and +inf -> inf, as torch.
__device__ __forceinline__ float gelu_erf_f(float x) {
  const float tail = normal_lower_tail_f(fabsf(x));   // Phi(-|x|)
  return x * (x >= 0.0f ? 1.0f - tail : tail);
}

// 2u of gelu_tanh: u = sqrt(2/pi) (x + 0.044715 x^3).
__device__ __forceinline__ float gelu_tanh_arg(float x) {
  return 1.5957691216057308f * (x + 0.044715f * x * x * x);
}

// 0.5 x (1 + tanh(u)) = x * sigmoid(2u). NaN -> NaN, -inf -> NaN, +inf -> inf as torch; x < -10
// gives -0 (torch's 1 + tanh(u) is 0 there already).
__device__ __forceinline__ float gelu_tanh_f(float x) { return x * sigmoid_f(gelu_tanh_arg(x)); }

// NaN stays NaN (a comparison with NaN is false), as in torch.relu.
__device__ __forceinline__ float relu_f(float x) { return x < 0.0f ? 0.0f : x; }

// Activation selected at compile time; the ids match gpuops.ops.elementwise.ACTIVATIONS.
enum class Act { kIdentity = 0, kRelu = 1, kSilu = 2, kGeluErf = 3, kGeluTanh = 4 };

template <Act A>
__device__ __forceinline__ float activate(float x) {
  if constexpr (A == Act::kRelu) return relu_f(x);
  else if constexpr (A == Act::kSilu) return silu_f(x);
  else if constexpr (A == Act::kGeluErf) return gelu_erf_f(x);
  else if constexpr (A == Act::kGeluTanh) return gelu_tanh_f(x);
  else return x;
}

}  // namespace gpuops
