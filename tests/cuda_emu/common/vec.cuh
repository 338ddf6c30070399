// Host stand-in for cuda_src/common/vec.cuh (same API).
#pragma once
#include "common/dtypes.cuh"

namespace gpuops {

template <class T> struct Vec16;

template <> struct Vec16<float> {
  static constexpr int size = 4;
  static void unpack(const uint4& r, float (&f)[4]) {
    f[0] = __uint_as_float(r.x); f[1] = __uint_as_float(r.y);
    f[2] = __uint_as_float(r.z); f[3] = __uint_as_float(r.w);
  }
  static uint4 pack(const float (&f)[4]) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
};

template <class T> struct Vec16Half {
  static constexpr int size = 8;
  static void unpack(const uint4& r, float (&f)[8]) {
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
    for (int i = 0; i < 4; ++i) {
      T lo, hi;
      lo.bits = static_cast<unsigned short>(w[i] & 0xffffu);
      hi.bits = static_cast<unsigned short>(w[i] >> 16);
      f[2 * i] = to_float(lo);
      f[2 * i + 1] = to_float(hi);
    }
  }
  static unsigned pack2(float lo, float hi) {
    return from_float<T>(lo).bits | static_cast<unsigned>(from_float<T>(hi).bits) << 16;
  }
  static uint4 pack(const float (&f)[8]) {
    return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
  }
};
template <> struct Vec16<bfloat16_t> : Vec16Half<bfloat16_t> {};
template <> struct Vec16<float16_t> : Vec16Half<float16_t> {};

template <class T> inline uint4 load16(const T* p) {
  uint4 v{0, 0, 0, 0};
  if (reinterpret_cast<unsigned long long>(p) & 15u) { emu::fail("misaligned 16-byte load"); return v; }
  std::memcpy(&v, p, 16);
  return v;
}
template <class T> inline void store16(T* p, const uint4& v) {
  if (reinterpret_cast<unsigned long long>(p) & 15u) { emu::fail("misaligned 16-byte store"); return; }
  std::memcpy(p, &v, 16);
}
template <class T> inline void store16_evict_first(T* p, const uint4& v) { store16(p, v); }

}  // namespace gpuops
