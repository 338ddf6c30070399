// Activations with their derivatives in fp32, for backward kernels (the forward formulas are in
// common/activations.cuh; these match them and torch's backward formulas on NaN and +-inf).
#pragma once
#include "common/activations.cuh"
#include "common/fastmath.cuh"

namespace gpuops {

// silu(x) = x s, s = sigmoid(x) = 1 / (1 + exp(-x)); silu'(x) = s (1 + x (1 - s)), torch's
// silu_backward formula: NaN at +-inf, as torch. 1 + exp(-x) >= 1, so the MUFU reciprocal is
// within 1 ulp (no denormal input); for x << 0 it gives s = 0 where torch's division gives a
// denormal, both below any tolerance.
__device__ __forceinline__ void silu_and_grad(float x, float& act, float& grad) {
  const float s = fast_rcp(1.0f + expf(-x));
  act = x * s;
  grad = s * fmaf(x, 1.0f - s, 1.0f);
}

// gelu(x) = x Phi(x); gelu'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
// Phi from the lower tail (normal_lower_tail_f, as the forward), so both terms keep their
// relative precision for x << 0. exp(-x^2/2) as 2^(-x^2 log2(e) / 2) with MUFU.EX2 (relative
// error 2^-22; the rounding of x^2 dominates for |x| > 4, where x phi(x) < 6e-4 |x| anyway).
// NaN at +-inf (x * phi(x) = inf * 0), as torch's gelu_backward.
__device__ __forceinline__ void gelu_erf_and_grad(float x, float& act, float& grad) {
  const float tail = normal_lower_tail_f(fabsf(x));       // Phi(-|x|)
  const float cdf = x >= 0.0f ? 1.0f - tail : tail;
  const float pdf = 0.39894228040143268f * fast_exp2(-0.72134752044448170f * x * x);
  act = x * cdf;
  grad = fmaf(x, pdf, cdf);
}

// gelu_tanh(x) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3). With s = sigmoid(2u):
// 0.5 (1 + tanh u) = s and 0.5 (1 - tanh^2 u) = 2 s (1 - s), so
//   gelu_tanh'(x) = s (1 + 2 x (1 - s) du/dx),  du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2),
// which does not cancel for x << 0 as torch's 0.5 (1 + tanh u) does. 1 - s = e s with
// e = exp(-2u) keeps full precision for x >> 0 (where 1 - s would round to 0 and 2 x du/dx is
// large); e = inf (x << 0) means 1 - s = 1. NaN at +-inf, as torch.
__device__ __forceinline__ void gelu_tanh_and_grad(float x, float& act, float& grad) {
  const float x2 = x * x;
  const float u = 0.79788456080286536f * fmaf(0.044715f * x2, x, x);
  const float e = expf(-2.0f * u);
  const float s = fast_rcp(1.0f + e);
  const float oms = e == __int_as_float(0x7f800000) ? 1.0f : e * s;
  const float du = 0.79788456080286536f * fmaf(0.134145f, x2, 1.0f);
  act = x * s;
  grad = s * fmaf(2.0f * x * oms, du, 1.0f);
}

template <Act A>
__device__ __forceinline__ void activate_and_grad(float x, float& act, float& grad) {
  if constexpr (A == Act::kSilu) silu_and_grad(x, act, grad);
  else if constexpr (A == Act::kGeluErf) gelu_erf_and_grad(x, act, grad);
  else {
    static_assert(A == Act::kGeluTanh, "no derivative written for this activation");
    gelu_tanh_and_grad(x, act, grad);
  }
}

}  // namespace gpuops
