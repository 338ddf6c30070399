// Single-instruction transcendental approximations (MUFU), for kernels whose math would otherwise
// be the bottleneck on 16-bit data. Each states its error; callers say why it is enough.
#pragma once

namespace gpuops {

// 2^x, relative error < 2^-22; results below 2^-126 flush to 0, NaN/+-inf as exp2.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x, error <= 1 ulp for normal x (denormal x flushes: only for arguments known to be >= 1 or
// otherwise far from the denormal range).
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace gpuops
