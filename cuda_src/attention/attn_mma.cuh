// Tensor-core helpers of the attention kernels (sm_80+ modules only: they use cp.async and
// ldmatrix through common/mma.cuh): the XOR swizzle of 16-bit [rows][D] tiles in shared memory,
// the ldmatrix offsets derived from it, and the cp.async tile loader. Used by the flash forward
// (flash_fwd_mma.cu) and backward (flash_bwd_mma.cu) tensor-core kernels.
#pragma once
#include "attention/attn_common.cuh"
#include "common/mma.cuh"
#include "common/opaque.cuh"

namespace gpuops {

// Byte offset of 16-byte chunk c of row r in a [rows][D] tile of 16-bit values (D / 8 chunks per
// row). ldmatrix reads, per phase, 8 consecutive rows at one logical chunk: XOR with r % 8 puts
// them in 8 distinct 16-byte bank groups when a row is a multiple of 128 bytes; rows of 64 or 192
// bytes (D = 32, 96) already alternate between the two halves of the 128-byte bank window, so
// XOR with (r / 2) % 4 (which keeps c inside its group of 4 chunks) completes the 8.
template <int D>
__device__ __forceinline__ int attn_swz(int r, int c) {
  constexpr int kCPR = D / 8;
  static_assert(kCPR % 4 == 0, "head dim must be a multiple of 32");
  const int x = kCPR % 8 == 0 ? (r & 7) : ((r >> 1) & 3);
  return (r * kCPR + (c ^ x)) << 4;
}

// attn_swz(r, 2 kk + c0) from off0 = attn_swz(r, c0) (c0 = 0 or 1). With rows of a power of two
// of bytes the XOR distributes over the k step: one LOP3 per k step instead of a table of
// per-lane offsets kept in registers across the key loop. Adding 16 (or 8) rows adds
// 16 (8) row lengths to any of these offsets (the XOR term depends on r % 8 only).
template <int D>
__device__ __forceinline__ int attn_swz_k(int off0, int r, int c0, int kk) {
  constexpr int kRowBytes = D * 2;
  if constexpr ((kRowBytes & (kRowBytes - 1)) == 0) {
    return off0 ^ (kk << 5);
  } else {
    return attn_swz<D>(r, 2 * kk + c0);
  }
}

// attn_swz(r, c) for the ldmatrix addresses of one key tile. FRESH: hidden from the optimizer
// (opaque) so that it is taken afresh at every tile: otherwise the compiler hoists every k step's
// offset (attn_swz_k: one LOP3 each) out of the key loop and keeps them all in registers across
// it, 24 registers at D = 128, the difference between spilling and not at 32 rows x 64 keys per
// warp. (With 16 rows per warp the hoisted offsets fit, and ptxas allocates D = 256 better so.)
template <int D, bool FRESH>
__device__ __forceinline__ int attn_swz_tile(int r, int c) {
  unsigned int off = static_cast<unsigned int>(attn_swz<D>(r, c));
  if (FRESH) opaque(off);
  return static_cast<int>(off);
}

// Rows r0 .. r0 + ROWS - 1 of a [rows_total][D] operand (row stride rs elements, unit d stride,
// 16-byte aligned rows) -> the swizzled tile at shared address dst, by cp.async; rows past
// rows_total are zero-filled (their scores are masked, their V rows meet p = 0).
template <class T, int ROWS, int D, int THREADS>
__device__ __forceinline__ void attn_tile_async(unsigned int dst, const T* src, int r0,
                                                int rows_total, long long rs) {
  constexpr int kCPR = D / 8, kChunks = ROWS * kCPR, kIters = (kChunks + THREADS - 1) / THREADS;
  constexpr int kRowsPerIter = THREADS / kCPR;
  if constexpr (THREADS % kCPR == 0 && kRowsPerIter % 8 == 0 && kChunks % THREADS == 0) {
    // a thread keeps its chunk and swizzle; each step moves it kRowsPerIter rows down
    const int r = static_cast<int>(threadIdx.x) / kCPR, c = static_cast<int>(threadIdx.x) % kCPR;
    const unsigned int d0 = dst + attn_swz<D>(r, c);
    const T* s0 = src + (r0 + r) * rs + c * 8;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const bool in = r0 + r + it * kRowsPerIter < rows_total;
      cp_async16(d0 + it * kRowsPerIter * D * 2, in ? s0 + it * kRowsPerIter * rs : src,
                 in ? 16 : 0);
    }
  } else {
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int idx = static_cast<int>(threadIdx.x) + it * THREADS;
      if (kChunks % THREADS != 0 && idx >= kChunks) break;
      const int r = idx / kCPR, c = idx - (idx / kCPR) * kCPR;
      const int gr = r0 + r;
      const bool in = gr < rows_total;
      cp_async16(dst + attn_swz<D>(r, c), in ? src + gr * rs + c * 8 : src, in ? 16 : 0);
    }
  }
}

}  // namespace gpuops
