// Host stand-in for cuda_src/common/fastmath.cuh (same API, no inline PTX): the exact functions,
// within the MUFU versions' stated errors.
#pragma once
#include <cmath>

namespace gpuops {

inline float fast_exp2(float x) { return std::exp2(x); }
inline float fast_rcp(float x) { return 1.0f / x; }

}  // namespace gpuops
