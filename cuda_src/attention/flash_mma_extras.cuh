// The options of the tensor-core flash forward (flash_fwd_mma.cu) carried by FlashFwdArgs'
// appended fields: packed sequences (varlen), block sparsity and rotary embedding. The kernel
// calls these helpers from a few hooks marked "[extras]", so its schedule stays readable.
//
// Each option is a bit of the kernel's EXTRAS template argument, instantiated only where a call
// needs it (MMA_EXTRAS_MODULES in gpuops/ops/attention.py: sparse, varlen, varlen + rotary), so
// the dense kernel (EXTRAS = 0) keeps its registers and code (its SASS is unchanged by the hooks;
// in particular it reads the kernel parameter itself, not a copy: see mma_sequence).
// * varlen (kMmaVarlen; also a dense call with a bottom-right diagonal): mma_sequence narrows
//   the kernel's copy of the arguments to the block's sequence (rows cu_q[b] .. of q, o, lse and
//   cu_k[b] .. of k, v; a block past the sequence's end exits) and, for a bottom-right diagonal
//   (FlashAttention's varlen: row i sees keys up to i + sk - sq), shifts the query coordinate by
//   diag = sk - sq: the kernel then computes with row indices i' = i + diag (q, o and lse base
//   pointers moved back by diag rows, sq' = sq + diag), for which its top-left window / causal
//   tests are the bottom-right ones. A row with i' < 0 sees no key (causal) and gives 0 / -inf,
//   as it should. The moved base pointers may point before the tensor: only rows inside the
//   sequence are addressed (cp.async zero-fills the others without reading: src-size 0). attn_mask
//   rows would be indexed by i' too: no op combines a mask with the bottom-right diagonal.
// * block sparsity (kMmaSparse): the key loop visits only tiles with a block that is on for
//   some row of the block (mma_on_tile; the cp.async prefetch jumps to the next such tile; with
//   two K/V stages the buffers alternate per visited tile); per warp, a tile whose blocks are all
//   off for the warp's rows is skipped like an invisible one, and on a tile that mixes on and off
//   blocks for them each thread first gathers one bit per score it holds (mma_blocks_on), which
//   the edge path then applies.
// * rotary (kMmaRotary): the Q tile once it has landed (before the key loop: one wait and one
//   barrier per block), and each K tile as it lands, are rotated in place in shared memory
//   (mma_rope_tile: fp32 math, then rounded to the storage dtype, which the tensor cores need):
//   one extra barrier per key tile; the main loop is otherwise unchanged.
// * rotary of Q only (kMmaRotaryQ; PLAN["rotary"] = "prepass", the default): K was rotated once
//   per call by the pre-pass attn_rope_k (rope_k.cu: the same fp32 math and rounding, so the
//   same bits as the in-loop K rotation) into a scratch array the host passes as k; only the Q
//   tile is rotated, before the loop. The key loop is the dense one (no rotation, no barrier).
#pragma once
#include "attention/attn_common.cuh"
#include "common/vec.cuh"

namespace gpuops {

// The shared-tile swizzle of flash_fwd_mma.cu (byte offset of 16-byte chunk c of row r).
template <int D>
__device__ __forceinline__ int attn_swz(int r, int c);

// Bits of flash_fwd_mma's EXTRAS template argument.
constexpr int kMmaPlain = 0;    // dense
constexpr int kMmaSparse = 1;   // + block_mask
constexpr int kMmaRotary = 2;   // + rot_cos / rot_sin
constexpr int kMmaVarlen = 4;   // + cu_q / cu_k and bottom_right
constexpr int kMmaRotaryQ = 8;  // + rot_cos / rot_sin for Q only: K comes rotated (rope_k.cu)

// Varlen and the bottom-right diagonal: `a` (the kernel's copy of its arguments) narrowed to
// sequence b for the key loop (q, k, v, sq, sk); returns false when the block's first row q0 lies
// past the sequence (the block exits). shift: the query coordinate offset (diag, see above);
// sq_real: the sequence's rows. o and lse are narrowed by mma_sequence_out at the epilogue (not
// here: their pointers would hold registers through the key loop). Dense calls with cu_q null
// keep their rows (a bottom-right diagonal alone).
template <class T>
__device__ __forceinline__ bool mma_sequence(FlashFwdArgs& a, int b, int q0, int& shift,
                                             int& sq_real) {
  long long qrow0 = 0, krow0 = 0;
  if (a.cu_q != nullptr) {
    const int qs0 = a.cu_q[b], ks0 = a.cu_k[b];
    a.sq = a.cu_q[b + 1] - qs0;
    a.sk = a.cu_k[b + 1] - ks0;
    qrow0 = qs0;
    krow0 = ks0;
  }
  if (q0 >= a.sq) return false;
  shift = a.bottom_right ? a.sk - a.sq : 0;
  a.q = static_cast<const T*>(a.q) + (qrow0 - shift) * a.qs[2];
  a.k = static_cast<const T*>(a.k) + krow0 * a.ks[2];
  a.v = static_cast<const T*>(a.v) + krow0 * a.vs[2];
  sq_real = a.sq;
  a.sq += shift;
  return true;
}

// The output rows of mma_sequence's sequence: o and lse moved to its first row, less shift rows.
template <class T>
__device__ __forceinline__ void mma_sequence_out(FlashFwdArgs& a, int b, int shift) {
  const long long qmove = (a.cu_q != nullptr ? a.cu_q[b] : 0) - static_cast<long long>(shift);
  a.o = static_cast<T*>(a.o) + qmove * a.os[2];
  if (a.lse != nullptr) a.lse += qmove * a.ls[2];
}

// Block sparsity. Does key range [k0, k1) of query rows [q0, q1] (sequence indices) touch a block
// that is on? Every thread of the caller reads the same bytes: attn_tile_on (attn_common.cuh).
// The first key tile at or after `it` (of ntiles from jlo, BC keys each, up to jhi) with a block
// on for rows [r0, r1]; ntiles when none. Without SPARSE: it.
template <bool SPARSE, int BC>
__device__ __forceinline__ int mma_on_tile(const FlashFwdArgs& a, const unsigned char* bm, int it,
                                           int ntiles, int jlo, int jhi, int r0, int r1) {
  if constexpr (SPARSE) {
#pragma unroll 1
    for (; it < ntiles; ++it) {
      bool mixed;
      const int k0 = jlo + it * BC;
      if (attn_tile_on(bm, a.bms[2], a.bms[3], a.block_size, r0, r1, k0,
                       attn_imin(k0 + BC, jhi), &mixed))
        break;
    }
  }
  return it;
}

// Bit 16 hr + 2 n + e of bits[mt]: is the score the thread holds in m16 tile mt (row
// i0 + 16 mt + 8 hr, sequence index), n8 tile n, column e (key j0 + 8 n + e) in a block that is
// on? Rows and keys past ilast / jlast (invisible anyway) read the last ones' entries, inside the
// mask. A rolled loop (few registers), run only on tiles that mix on and off blocks.
template <int MT, int NS>
__device__ __forceinline__ void mma_blocks_on(unsigned (&bits)[MT], const FlashFwdArgs& a,
                                              const unsigned char* bm, int i0, int ilast, int j0,
                                              int jlast) {
  static_assert(NS * 2 <= 16, "one bit per score of a row in 16 bits");
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) bits[mt] = 0;
#pragma unroll 1
  for (int x = 0; x < MT * 2 * NS * 2; ++x) {
    const int e = x & 1, n = (x >> 1) % NS, hr = (x / (2 * NS)) & 1, mt = x / (4 * NS);
    const long long o = (attn_imin(i0 + 16 * mt + 8 * hr, ilast) / a.block_size) * a.bms[2] +
                        (attn_imin(j0 + 8 * n + e, jlast) / a.block_size) * a.bms[3];
    const unsigned bit = static_cast<unsigned>(bm[o] != 0) << (16 * hr + 2 * n + e);
#pragma unroll
    for (int m = 0; m < MT; ++m)
      if (m == mt) bits[m] |= bit;
  }
}

// Four 16-bit values at shared address p (8-byte aligned) <-> fp32, as two 32-bit words.
template <class T>
__device__ __forceinline__ void mma_load4(const unsigned char* p, float (&f)[4]) {
  const unsigned int* w = reinterpret_cast<const unsigned int*>(p);
  const unsigned int u[2] = {w[0], w[1]};
#pragma unroll
  for (int e = 0; e < 4; ++e)
    f[e] = to_float(T{static_cast<unsigned short>(u[e >> 1] >> (16 * (e & 1)))});
}

template <class T>
__device__ __forceinline__ void mma_store4(unsigned char* p, const float (&f)[4]) {
  unsigned int u[2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
    u[i] = static_cast<unsigned int>(from_float<T>(f[2 * i]).bits) |
           static_cast<unsigned int>(from_float<T>(f[2 * i + 1]).bits) << 16;
  unsigned int* w = reinterpret_cast<unsigned int*>(p);
  w[0] = u[0];
  w[1] = u[1];
}

// Rotary: RoPE in place of the rows of a swizzled [ROWS][D] shared tile of T (base `tile`, byte
// offsets attn_swz<D>), tile row r at position pos0 + r; rows at positions >= rows_real (zero
// padding past the sequence) are left alone. Pairs (x, y) of frequency f -> (x cos - y sin,
// y cos + x sin) in fp32 (the SIMT kernel's fmas), rounded to T (round to nearest even). Items of
// 8 bytes (4 values; few registers: this runs with the accumulators live) when they hold whole
// pairs, their partner 8 bytes aligned too (GPT-J: rot_half even; GPT-NeoX: rot_half % 4 == 0,
// the usual rotary dims), else one pair per item.
template <class T, int ROWS, int D, int THREADS>
__device__ __forceinline__ void mma_rope_tile(unsigned char* tile, const FlashFwdArgs& a,
                                              int pos0, int rows_real) {
  const int half = a.rot_half;
  const int nrows = attn_imin(ROWS, rows_real - pos0);
  if (nrows <= 0) return;
  const int tid = static_cast<int>(threadIdx.x);
  // byte offset of element col of tile row r
  auto at = [](int r, int col) { return attn_swz<D>(r, col >> 3) + 2 * (col & 7); };
  if (a.rot_interleaved ? (half & 1) == 0 : (half & 3) == 0) {
    const bool gptj = a.rot_interleaved != 0;
    const int ipr = gptj ? half >> 1 : half >> 2;   // items per row (GPT-NeoX: + 4 partners)
#pragma unroll 1
    for (int idx = tid; idx < nrows * ipr; idx += THREADS) {
      const int r = idx / ipr, c4 = idx - r * ipr, pos = pos0 + r;
      unsigned char* px = tile + at(r, 4 * c4);
      float x[4];
      mma_load4<T>(px, x);
      if (gptj) {                       // pairs (2f, 2f + 1) of f = 2 c4, 2 c4 + 1
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float cv, sv;
          attn_rope_cs<T>(a, pos, 2 * c4 + e, cv, sv);
          attn_rope_rotate(x[2 * e], x[2 * e + 1], cv, sv);
        }
      } else {                          // columns f = 4 c4 .. + 3 with f + half
        unsigned char* py = tile + at(r, 4 * c4 + half);
        float y[4];
        mma_load4<T>(py, y);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float cv, sv;
          attn_rope_cs<T>(a, pos, 4 * c4 + e, cv, sv);
          attn_rope_rotate(x[e], y[e], cv, sv);
        }
        mma_store4<T>(py, y);
      }
      mma_store4<T>(px, x);
    }
  } else {
#pragma unroll 1
    for (int idx = tid; idx < nrows * half; idx += THREADS) {
      const int r = idx / half, f = idx - r * half;
      const int cx = a.rot_interleaved ? 2 * f : f, cy = a.rot_interleaved ? 2 * f + 1 : f + half;
      T* px = reinterpret_cast<T*>(tile + at(r, cx));
      T* py = reinterpret_cast<T*>(tile + at(r, cy));
      float cv, sv;
      attn_rope_cs<T>(a, pos0 + r, f, cv, sv);
      float x = to_float(*px), y = to_float(*py);
      attn_rope_rotate(x, y, cv, sv);
      *px = from_float<T>(x);
      *py = from_float<T>(y);
    }
  }
}

}  // namespace gpuops
