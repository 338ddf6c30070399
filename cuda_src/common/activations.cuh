// Activation functions in fp32, shared by the elementwise family and (later) GEMM epilogues.
// Each is written to match torch's results on NaN and +-inf, and to avoid the cancellation in
// torch's own 1 + erf(x) / 1 + tanh(u) forms, which loses all relative precision for x << 0.
#pragma once

namespace gpuops {

// x * sigmoid(x), torch's formula: silu(-inf) = NaN, silu(-100) = -0.
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

// 0.5 x (1 + erf(x / sqrt 2)). torch's form costs one erff and is accurate for x >= -3; below,
// 1 + erf cancels (all relative precision is gone by x = -6), so the tail uses
// 0.5 x erfc(-x / sqrt 2). erfcf everywhere was compute-bound on the H100 (70% of copy bandwidth,
// run 2026-11-22 #1); the tail is 0.13% of a unit normal's values.
__device__ __forceinline__ float gelu_erf_f(float x) {
  if (x >= -3.0f) return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
  return 0.5f * x * erfcf(-x * 0.70710678118654752f);  // also NaN and -inf (-> NaN, as torch)
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
