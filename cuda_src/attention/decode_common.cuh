// Shared pieces of the decode / paged attention kernels (decode_split.cu, decode_combine.cu).
#pragma once
#include "common/dtypes.cuh"
#include "common/vec.cuh"

namespace gpuops {

constexpr int kDecodeThreads = 128;   // DECODE_THREADS in gpuops/ops/attention_decode.py

// Experiments' overrides of DecodeCfg and decode_split (benchmarks/experiments/decode_b1_floor.py
// builds the split kernel with other values as separate modules): keys in flight per key group
// (0: the rule below) and steps of K/V loads in flight ahead of the step in use (-1: the rule
// below). Runs 58 and 60 (B1 S8192 bf16): U 1/4/8 and DEPTH 2 were all slower than the rule.
#ifndef GPUOPS_DECODE_U
#define GPUOPS_DECODE_U 0
#endif
#ifndef GPUOPS_DECODE_DEPTH
#define GPUOPS_DECODE_DEPTH -1
#endif

// Work layout of decode_split for storage T, head dim D (the template: the real head dim for the
// 16-byte path, the next of 64/256/1024 for the one-element path, which masks d >= d_rt),
// VEC elements per load (16 / sizeof(T), or 1) and RT query rows per block.
template <class T, int D, int VEC, int RT>
struct DecodeCfg {
  static constexpr int L = (D / VEC) < 32 ? (D / VEC) : 32;   // lanes per key row
  static constexpr int NV = D / (VEC * L);                    // loads per lane per row
  static constexpr int E = NV * VEC;                          // elements per lane
  // keys in flight per group: the q and o registers (2 * RT * E) and the K/V buffers
  // (2 * U * E, in 32-bit registers for packs) share ~ 160 registers
  static constexpr int U_RAW = 64 / (E * (RT + 1));
  static constexpr int U = GPUOPS_DECODE_U > 0 ? GPUOPS_DECODE_U
                                               : (U_RAW < 1 ? 1 : (U_RAW > 8 ? 8 : U_RAW));
  // steps of K/V loads in flight ahead of the step in use: one (a second set of 2 * U * NV load
  // registers) where q and o leave room: RT * E <= 32 (bf16 D128 up to RT 4, fp32 D128 up to
  // RT 8); the RT 8 16-bit configs already use ~250 registers, so they load and then wait
  static constexpr int DEPTH = GPUOPS_DECODE_DEPTH >= 0 ? GPUOPS_DECODE_DEPTH
                                                        : (RT * E <= 32 ? 1 : 0);
  static_assert(L * NV * VEC == D, "head dim template must split into lanes and packs");
};

template <class T, int VEC> struct KvLoad {          // 16-byte packs
  using Raw = uint4;
  static __device__ __forceinline__ Raw load(const T* p, bool ok) {
    return ok ? load16(p) : make_uint4(0u, 0u, 0u, 0u);
  }
  static __device__ __forceinline__ Raw zero() { return make_uint4(0u, 0u, 0u, 0u); }
  static __device__ __forceinline__ void unpack(const Raw& r, float* f) {
    float t[VEC];
    Vec16<T>::unpack(r, t);
#pragma unroll
    for (int e = 0; e < VEC; ++e) f[e] = t[e];
  }
};

template <class T> struct KvLoad<T, 1> {              // one element (any stride, any head dim)
  using Raw = float;
  static __device__ __forceinline__ Raw load(const T* p, bool ok) {
    return ok ? to_float(*p) : 0.f;
  }
  static __device__ __forceinline__ Raw zero() { return 0.f; }
  static __device__ __forceinline__ void unpack(const Raw& r, float* f) { f[0] = r; }
};

// Output columns of one merged row (decode_combine): acc * inv, as 4 columns (4c..4c+3) when
// vec4, else column c.
template <class T>
__device__ __forceinline__ void store_merged(T* orow, int c, const float4& acc, float inv,
                                             bool vec4) {
  if (vec4) {
    orow[4 * c] = from_float<T>(acc.x * inv);
    orow[4 * c + 1] = from_float<T>(acc.y * inv);
    orow[4 * c + 2] = from_float<T>(acc.z * inv);
    orow[4 * c + 3] = from_float<T>(acc.w * inv);
  } else {
    orow[c] = from_float<T>(acc.x * inv);
  }
}

}  // namespace gpuops
