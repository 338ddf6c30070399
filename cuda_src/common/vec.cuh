// 16-byte vector access: one LDG.128 / STG.128 per thread moves 4 fp32 or 8 fp16/bf16 values.
// Memory-bound kernels need these to reach full bandwidth; the host side guarantees 16-byte
// alignment (and otherwise launches the one-element variant).
//
// Packs travel as raw uint4 words and are converted 32 bits at a time (two 16-bit values per
// word by shifts or one cvt each): that keeps 16-bit values out of 16-bit registers, which ptxas
// handles poorly (it spilled them in an earlier version of the pointwise kernels).
#pragma once
#include "common/dtypes.cuh"

namespace gpuops {

template <class T> struct Vec16;

template <> struct Vec16<float> {
  static constexpr int size = 4;
  static __device__ __forceinline__ void unpack(const uint4& r, float (&f)[4]) {
    f[0] = __uint_as_float(r.x); f[1] = __uint_as_float(r.y);
    f[2] = __uint_as_float(r.z); f[3] = __uint_as_float(r.w);
  }
  static __device__ __forceinline__ uint4 pack(const float (&f)[4]) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
  static __device__ __forceinline__ uint4 splat(float v) {
    const unsigned int u = __float_as_uint(v);
    return make_uint4(u, u, u, u);
  }
};

template <> struct Vec16<bfloat16_t> {
  static constexpr int size = 8;
  static __device__ __forceinline__ void unpack(const uint4& r, float (&f)[8]) {
    const unsigned int w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  static __device__ __forceinline__ unsigned int pack2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    unsigned int u;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(u) : "f"(hi), "f"(lo));  // d.hi = a, d.lo = b
    return u;
#else
    return static_cast<unsigned int>(from_float<bfloat16_t>(lo).bits) |
           (static_cast<unsigned int>(from_float<bfloat16_t>(hi).bits) << 16);
#endif
  }
  static __device__ __forceinline__ uint4 pack(const float (&f)[8]) {
    return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
  }
  static __device__ __forceinline__ uint4 splat(bfloat16_t v) {
    const unsigned int u = v.bits | (static_cast<unsigned int>(v.bits) << 16);
    return make_uint4(u, u, u, u);
  }
};

template <> struct Vec16<float16_t> {
  static constexpr int size = 8;
  static __device__ __forceinline__ void unpack(const uint4& r, float (&f)[8]) {
    const unsigned int w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      asm("{.reg .b16 lo, hi;\n\t mov.b32 {lo, hi}, %2;\n\t"
          " cvt.f32.f16 %0, lo;\n\t cvt.f32.f16 %1, hi;}"
          : "=f"(f[2 * i]), "=f"(f[2 * i + 1]) : "r"(w[i]));
    }
  }
  static __device__ __forceinline__ unsigned int pack2(float lo, float hi) {
    unsigned int u;
    asm("{.reg .b16 l, h;\n\t cvt.rn.f16.f32 l, %1;\n\t cvt.rn.f16.f32 h, %2;\n\t"
        " mov.b32 %0, {l, h};}" : "=r"(u) : "f"(lo), "f"(hi));
    return u;
  }
  static __device__ __forceinline__ uint4 pack(const float (&f)[8]) {
    return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
  }
  static __device__ __forceinline__ uint4 splat(float16_t v) {
    const unsigned int u = v.bits | (static_cast<unsigned int>(v.bits) << 16);
    return make_uint4(u, u, u, u);
  }
};

template <class T>
__device__ __forceinline__ uint4 load16(const T* p) { return *reinterpret_cast<const uint4*>(p); }

template <class T>
__device__ __forceinline__ void store16(T* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }

// The same, evict-first in L2 (st.global.cs): output no one reads soon, whose lines should be the
// L2's next victims (written back now) rather than other data's (norms' "resident" drains).
template <class T>
__device__ __forceinline__ void store16_evict_first(T* p, const uint4& v) {
#ifdef __CUDA_ARCH__
  __stcs(reinterpret_cast<uint4*>(p), v);
#else
  store16(p, v);                         // (host emulation: tests/cuda_host_emulation.py)
#endif
}

}  // namespace gpuops
