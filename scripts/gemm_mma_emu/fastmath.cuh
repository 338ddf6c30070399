// Host stand-in for cuda_src/common/fastmath.cuh (scripts/gemm_mma_emu/run.py): libm instead of MUFU.
#pragma once
#include <cmath>
namespace gpuops {
inline float fast_exp2(float x) { return std::exp2(x); }
inline float fast_rcp(float x) { return 1.0f / x; }
}
