// opaque(v): an empty asm that the compiler must assume changes v. Used to stop it from keeping
// a value computed early alive in registers (common subexpression elimination across a long
// wait) when recomputing it later from fewer registers is cheaper.
#pragma once

namespace gpuops {

__device__ __forceinline__ void opaque(unsigned int& v) { asm volatile("" : "+r"(v)); }
__device__ __forceinline__ void opaque(float& v) { asm volatile("" : "+f"(v)); }
__device__ __forceinline__ void opaque(uint4& v) {
  asm volatile("" : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w));
}

}  // namespace gpuops
