// Host stand-in for cuda_src/common/opaque.cuh (no inline PTX; a no-op is equivalent here).
#pragma once

namespace gpuops {

inline void opaque(unsigned int&) {}
inline void opaque(float&) {}
inline void opaque(uint4&) {}

}  // namespace gpuops
