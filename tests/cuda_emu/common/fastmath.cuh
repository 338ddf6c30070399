// Host stand-in for cuda_src/common/fastmath.cuh (same API, no inline PTX): the MUFU
// approximations as correctly rounded host functions with their flush-to-zero behaviour.
#pragma once
#include <cfloat>

namespace gpuops {

inline float fast_exp2(float x) {
  const float y = std::exp2(x);
  return std::fabs(y) < FLT_MIN ? 0.0f : y;          // .ftz: subnormal results flush
}

inline float fast_rcp(float x) {
  if (std::fabs(x) < FLT_MIN) x = std::copysign(0.0f, x);   // .ftz: subnormal inputs flush
  const float y = 1.0f / x;
  return std::fabs(y) < FLT_MIN ? std::copysign(0.0f, y) : y;
}

}  // namespace gpuops
