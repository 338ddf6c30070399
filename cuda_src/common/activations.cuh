// Activation functions in fp32, shared by the elementwise family and (later) GEMM epilogues.
// Each is written to match torch's results on NaN and +-inf, and to avoid the cancellation in
// torch's own 1 + erf(x) / 1 + tanh(u) forms, which loses all relative precision for x << 0.
#pragma once

namespace gpuops {

// x * sigmoid(x), torch's formula: silu(-inf) = NaN, silu(-100) = -0.
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

// erfc(z) for z >= 0 as t exp(P(t) - z^2), t = 1 / (1 + z/2), with P of degree 9 fitted by
// scripts/fit_erfc.py: relative error 1e-7 in exact arithmetic, under 1e-5 evaluated in fp32
// (the rounding of z^2 dominates, and only where erfc(z) < 1e-30). One exp and one reciprocal:
// erfcf was compute-bound on the H100 (70% of copy bandwidth for bf16 GELU, run 2026-11-22 #1).
__device__ __forceinline__ float erfc_nonneg_f(float z) {
  const float t = __frcp_rn(fmaf(0.5f, z, 1.0f));
  float p = 1.708727777e-01f;
  p = fmaf(p, t, -8.221522345e-01f);
  p = fmaf(p, t, 1.488515889e+00f);
  p = fmaf(p, t, -1.135204000e+00f);
  p = fmaf(p, t, 2.788680845e-01f);
  p = fmaf(p, t, -1.862880617e-01f);
  p = fmaf(p, t, 9.678418949e-02f);
  p = fmaf(p, t, 3.740919597e-01f);
  p = fmaf(p, t, 1.000023680e+00f);
  p = fmaf(p, t, -1.265512225e+00f);
  return t * expf(p - z * z);
}

// x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)). Phi is taken from 0.5 erfc(|x| / sqrt 2), so it keeps
// full relative precision for x << 0, where torch's 1 + erf(x / sqrt 2) cancels. NaN -> NaN and
// -inf -> NaN, +inf -> inf, as torch.
__device__ __forceinline__ float gelu_erf_f(float x) {
  const float tail = 0.5f * erfc_nonneg_f(fabsf(x) * 0.70710678118654752f);  // Phi(-|x|)
  return x * (x >= 0.0f ? 1.0f - tail : tail);
}

// 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).
__device__ __forceinline__ float gelu_tanh_f(float x) {
  const float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
  return x / (1.0f + expf(-2.0f * u));
}

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
