// RoPE of K once per call, into a scratch array: the pre-pass of the tensor-core forward's fused
// rotary (PLAN["rotary"] = "prepass" in gpuops/ops/attention.py). The forward then rotates only
// Q (once per block, before its key loop: EXTRAS bit kMmaRotaryQ) and reads K from the scratch,
// instead of rotating each K tile in shared memory once per query block (S / BR times per head).
//
// Reads the forward's own argument struct (k, its strides, cu_k, the rotary fields) so that the
// positions are what the in-loop form uses: key j of a sequence (varlen: the index inside its
// packed sequence, from cu_k on the device) at table row j, NaN past the table (attn_rope_cs).
// fp32 math with the in-loop form's fmaf pairs (attn_rope_rotate), rounded once to T: the rotated
// K is bit for bit the tile the in-loop form rotates in shared memory. q, k are never written.
//
// Block (batch x kv head, kRopeKRows key rows), items numbered row-major with the row's units
// fastest (a warp covers whole rows: contiguous 16-byte loads and stores). A unit is
//   GPT-NeoX: V pairs (f, f + rot_half) of frequencies f = c .. c + V - 1: the pack at column c
//             and its partner pack at c + rot_half;
//   GPT-J:    the pack at column c (W = max(V, 2) values: W / 2 pairs (2f, 2f + 1));
//   else:     a pass-through pack (columns past 2 rot_half: partial rotary), copied.
// V = 16 / sizeof(T) when the host guarantees whole packs (unit d stride, 16-byte aligned rows,
// rot_half % V == 0 for NeoX, 2 rot_half % V == 0 for GPT-J); V = 1 otherwise (unit d stride
// still: the forward that reads the scratch needs it).
#include "attention/attn_common.cuh"
#include "common/vec.cuh"

namespace gpuops {

constexpr int kRopeKThreads = 256;
constexpr int kRopeKRows = 64;

template <class T, int N>
__device__ __forceinline__ void rope_k_load(const T* p, float (&f)[N]) {
  if constexpr (N * sizeof(T) == 16) {
    Vec16<T>::unpack(load16(p), f);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) f[e] = to_float(p[e]);
  }
}

template <class T, int N>
__device__ __forceinline__ void rope_k_store(T* p, const float (&f)[N]) {
  if constexpr (N * sizeof(T) == 16) {
    store16(p, Vec16<T>::pack(f));
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) p[e] = from_float<T>(f[e]);
  }
}

// out: [B, Hkv, Sk, D] by strides (ob, oh, os), unit d stride (varlen: ob = 0, rows from cu_k).
template <class T, int V>
__global__ void __launch_bounds__(kRopeKThreads) attn_rope_k(const FlashFwdArgs a, T* out,
                                                             long long ob, long long oh,
                                                             long long os) {
  constexpr int W = V > 1 ? V : 2;   // GPT-J unit width (whole pairs)
  const int hkv = a.hq / a.group;
  const int b = static_cast<int>(blockIdx.x) / hkv, h = static_cast<int>(blockIdx.x) - b * hkv;
  int sk = a.sk;
  long long row0 = 0;
  if (a.cu_k != nullptr) {
    row0 = a.cu_k[b];
    sk = a.cu_k[b + 1] - static_cast<int>(row0);
  }
  const T* k = static_cast<const T*>(a.k) + b * a.ks[0] + h * a.ks[1] + row0 * a.ks[2];
  out += b * ob + h * oh + row0 * os;

  const int half = a.rot_half, rot = 2 * half;
  const bool gptj = a.rot_interleaved != 0;
  const int nrot = gptj ? rot / W : half / V;    // rotating units of a row
  const int per_row = nrot + (a.hd - rot) / V;  // + pass-through packs
  // grid.y covers the longest sequence the host knows of (max_seqlen_k); the stride loop also
  // rotates the rows of a longer one (a broken varlen precondition), so that every row the
  // forward may read is written (and reads NaN past the table, as the in-loop form)
#pragma unroll 1
  for (int j0 = static_cast<int>(blockIdx.y) * kRopeKRows; j0 < sk;
       j0 += static_cast<int>(gridDim.y) * kRopeKRows) {
    const int nrows = attn_imin(kRopeKRows, sk - j0);
#pragma unroll 1
    for (int idx = threadIdx.x; idx < nrows * per_row; idx += kRopeKThreads) {
      const int r = idx / per_row, u = idx - r * per_row, j = j0 + r;
      const T* src = k + j * a.ks[2];
      T* dst = out + j * os;
      if (u >= nrot) {                               // pass-through
        const int c = rot + (u - nrot) * V;
        float x[V];
        rope_k_load<T, V>(src + c, x);
        rope_k_store<T, V>(dst + c, x);
      } else if (gptj) {
        const int c = u * W;
        float x[W];
        rope_k_load<T, W>(src + c, x);
#pragma unroll
        for (int e = 0; e < W / 2; ++e) {
          float cv, sv;
          attn_rope_cs<T>(a, j, c / 2 + e, cv, sv);
          attn_rope_rotate(x[2 * e], x[2 * e + 1], cv, sv);
        }
        rope_k_store<T, W>(dst + c, x);
      } else {
        const int c = u * V;
        float x[V], y[V];
        rope_k_load<T, V>(src + c, x);
        rope_k_load<T, V>(src + c + half, y);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          float cv, sv;
          attn_rope_cs<T>(a, j, c + e, cv, sv);
          attn_rope_rotate(x[e], y[e], cv, sv);
        }
        rope_k_store<T, V>(dst + c, x);
        rope_k_store<T, V>(dst + c + half, y);
      }
    }
  }
}

}  // namespace gpuops
