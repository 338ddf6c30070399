// Host stand-in for cuda_src/common/dtypes.cuh (same API, no inline PTX): bit-exact
// conversions, round to nearest even, NaN kept.
#pragma once

namespace gpuops {

struct __align__(2) float16_t { unsigned short bits; };
struct __align__(2) bfloat16_t { unsigned short bits; };

inline float to_float(float v) { return v; }

inline float to_float(float16_t v) {
  const unsigned h = v.bits, sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  unsigned u;
  if (e == 0) {
    if (m == 0) {
      u = sign;
    } else {                                     // subnormal: normalize
      int ee = -1;
      unsigned mm = m;
      do { ++ee; mm <<= 1; } while ((mm & 0x400u) == 0);
      u = sign | static_cast<unsigned>(127 - 15 - ee) << 23 | (mm & 0x3ffu) << 13;
    }
  } else if (e == 31) {
    u = sign | 0x7f800000u | m << 13;
  } else {
    u = sign | (e + 112) << 23 | m << 13;
  }
  return __uint_as_float(u);
}

inline float to_float(bfloat16_t v) { return __uint_as_float(static_cast<unsigned>(v.bits) << 16); }

template <class T> T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }

template <> inline float16_t from_float<float16_t>(float f) {
  const unsigned u = __float_as_uint(f);
  const unsigned sign = (u >> 16) & 0x8000u;
  const unsigned a = u & 0x7fffffffu;
  float16_t h;
  if (a > 0x7f800000u) { h.bits = static_cast<unsigned short>(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); return h; }
  if (a >= 0x477ff000u) { h.bits = static_cast<unsigned short>(sign | 0x7c00u); return h; }  // rounds to inf
  if (a < 0x38800000u) {                       // half subnormal (or zero): value / 2^-24
    const float scaled = __uint_as_float(a) * 16777216.0f;     // exact
    const float r = std::nearbyint(scaled);                     // ties to even (default mode)
    h.bits = static_cast<unsigned short>(sign | static_cast<unsigned>(r));
    return h;
  }
  unsigned m = a + 0xfffu + ((a >> 13) & 1u);   // round to nearest even at bit 13
  h.bits = static_cast<unsigned short>(sign | (((m >> 13) - (112u << 10)) & 0x7fffu));
  return h;
}

template <> inline bfloat16_t from_float<bfloat16_t>(float f) {
  bfloat16_t b;
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    b.bits = static_cast<unsigned short>((u >> 16) | 0x0040u);
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    b.bits = static_cast<unsigned short>(u >> 16);
  }
  return b;
}

}  // namespace gpuops
