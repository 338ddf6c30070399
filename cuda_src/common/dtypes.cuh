// Storage types and float conversions for every kernel in gpuops.
//
// gpuops defines its own 16-bit storage types instead of including cuda_fp16.h / cuda_bf16.h:
// NVRTC then needs no CUDA headers at all (a pip-installed NVRTC is enough), modules compile
// faster, and the conversions are exactly the ones below on every arch from sm_61 on.
// All arithmetic happens in fp32 (sm_61 has no fast fp16 math); these types only store.
#pragma once

namespace gpuops {

struct __align__(2) float16_t { unsigned short bits; };
struct __align__(2) bfloat16_t { unsigned short bits; };

__device__ __forceinline__ float to_float(float v) { return v; }

__device__ __forceinline__ float to_float(float16_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}

__device__ __forceinline__ float to_float(bfloat16_t v) {
  return __uint_as_float(static_cast<unsigned int>(v.bits) << 16);
}

template <class T> __device__ __forceinline__ T from_float(float f);

template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }

template <> __device__ __forceinline__ float16_t from_float<float16_t>(float f) {
  float16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));  // round to nearest even, NaN kept
  return h;
}

template <> __device__ __forceinline__ bfloat16_t from_float<bfloat16_t>(float f) {
  bfloat16_t b;
#if __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(f));
#else
  // Round to nearest even by integer arithmetic (no bf16 cvt before sm_80). A NaN must stay a
  // NaN: rounding its payload could carry into the exponent and give an infinity.
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    b.bits = static_cast<unsigned short>((u >> 16) | 0x0040u);
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    b.bits = static_cast<unsigned short>(u >> 16);
  }
#endif
  return b;
}

}  // namespace gpuops
