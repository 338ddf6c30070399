// What the decode GEMV kernels (gemv.cu, gemv_mma.cu) share: the weight's streaming loads, the
// gather of 16 bytes at the edges and for strided operands, and the split-K workspace layout.
#pragma once
#include "gemm/gemm_common.cuh"
#include "common/pdl.cuh"

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

// Rows g and g + 8 of A (lo, hi: their first elements) at k .. k + 7 for the tensor-core GEMVs
// (16-bit A; the words are the mma's A fragment under gemv_mma's k permutation): one 16-byte load
// through L1 each where A is vector-readable (vec) and the pack whole, else gathered with zeros
// past nk elements; zeros for a row past M (lo_row / hi_row false).
template <class T>
__device__ __forceinline__ void load_a_pair16(const T* lo, const T* hi, long long k, long long nk,
                                              long long a_sk, bool lo_row, bool hi_row, bool vec,
                                              uint4& xl, uint4& xh) {
  const bool full = nk >= 8;
  xl = make_uint4(0u, 0u, 0u, 0u);
  xh = xl;
  if (lo_row) xl = (vec && full) ? load_cached16(lo + k) : gather16(lo + k * a_sk, a_sk, nk);
  if (hi_row) xh = (vec && full) ? load_cached16(hi + k) : gather16(hi + k * a_sk, a_sk, nk);
}

// The flag (GemmArgs::flags) that asks the K-contiguous GEMV kernels to prefetch their weight
// slice into L2 before pdl_start (host: PLAN['gemv_l2_prefetch']); flags bits 8..15: the bytes of
// each row's slice to prefetch / 256 (0: all of it).
constexpr int kWPrefetch = 64;

// Before pdl_start(): rows [n0, n0 + rows) of each weight w[d] over k [ks, ke), one bulk L2
// prefetch per row (threads 0 .. NB * rows - 1; K contiguous and 16-byte aligned rows: the kBVec
// case). A decode GEMV reads each weight byte once and nothing it computes decides which, so the
// whole slice of a block can be asked for at once, before the wait: a PDL secondary's DRAM reads
// then start while the previous kernel finishes, and every SM has its blocks' slices in flight
// from the start instead of one step per warp. sm_90+ (elsewhere l2_prefetch_bulk is nothing).
template <class T, int NB>
__device__ __forceinline__ void prefetch_weight_rows(const T* const (&w)[NB], const GemmArgs& p,
                                                     long long n0, int rows, long long ks,
                                                     long long ke, int tid) {
  if (!(p.flags & kWPrefetch) || !(p.flags & kBVec) || tid >= NB * rows) return;
  const long long n = n0 + tid % rows;
  const unsigned int head = ((unsigned int)p.flags >> 8 & 255u) * 256u;   // 0: the whole slice
  unsigned int bytes = (unsigned int)((ke - ks) * (long long)sizeof(T)) & ~15u;
  if (head != 0u && bytes > head) bytes = head;
  const T* base = tid < rows ? w[0] : w[NB - 1];   // a select (w[tid / rows] went to the stack)
  if (n < p.N && ke > ks && bytes != 0u) l2_prefetch_bulk(base + n * p.b_sn + ks, bytes);
}

// Where a split's partial sums go: ws[((split * nb + d) * batch + z) * M * N + m * N + n].
__device__ __forceinline__ long long ws_index(const GemmArgs& p, int split, int nb, int d,
                                             long long z, long long m, long long n) {
  return ((split * (long long)nb + d) * p.batch + z) * p.M * p.N + m * p.N + n;
}

}  // namespace gemm
}  // namespace gpuops
