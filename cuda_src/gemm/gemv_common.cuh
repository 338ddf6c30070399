// What the decode GEMV kernels (gemv.cu, gemv_mma.cu) share: the weight's streaming loads, the
// gather of 16 bytes at the edges and for strided operands, and the split-K workspace layout.
#pragma once
#include "gemm/gemm_common.cuh"

namespace gpuops {
namespace gemm {

// A 16-byte load of data read exactly once (the weight): not kept in L1 (on sm_70+), so that the
// rows of A, reused by every block, stay there. Host C++ (the CPU kernel emulator): a plain load.
__device__ __forceinline__ uint4 load_stream16(const void* p) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 700
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
#else
  return *reinterpret_cast<const uint4*>(p);
#endif
}

// A 16-byte load of data every block reads (the rows of A): through L1.
__device__ __forceinline__ uint4 load_cached16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ unsigned int raw_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ unsigned int raw_bits(float16_t v) { return v.bits; }
__device__ __forceinline__ unsigned int raw_bits(bfloat16_t v) { return v.bits; }

// The 16 bytes of elements p[0], p[step], ... as one raw pack, zeros past the first n (the edges
// of B, unaligned or strided operands).
template <class T>
__device__ __forceinline__ uint4 gather16(const T* p, long long step, long long n) {
  constexpr int kVec = 16 / sizeof(T), kPer = 4 / sizeof(T);
  unsigned int w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int j = 0; j < kVec; ++j)
    if (j < n) w[j / kPer] |= raw_bits(p[j * step]) << (32 / kPer * (j % kPer));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Where a split's partial sums go: ws[((split * nb + d) * batch + z) * M * N + m * N + n].
__device__ __forceinline__ long long ws_index(const GemmArgs& p, int split, int nb, int d,
                                             long long z, long long m, long long n) {
  return ((split * (long long)nb + d) * p.batch + z) * p.M * p.N + m * p.N + n;
}

}  // namespace gemm
}  // namespace gpuops
