// Pieces shared by the rotary kernels (rope.cu, qk_norm_rope.cu): the argument structs, where a
// token's cos/sin come from (tables, positions, multi-section streams), and the rotation of one
// "unit" of 2V elements (V pairs of consecutive frequencies) held in registers.
//
// Layout of q and k (and of every output): [B, S, H, D] with strides in elements (packed [T, H, D]
// is B = 1, S = T). The first R = rotary dim elements of a head rotate, the rest pass through.
//   GPT-NeoX (half split):  pair j = (x[j], x[j + R/2]),  j < R/2
//   GPT-J (interleaved):    pair j = (x[2j], x[2j + 1])
// Pair j turns by the angle of frequency j: (a, b) -> (a cos - b sin, b cos + a sin); the
// backward turns by the opposite angle (sign = -1), which is the transpose of the rotation.
//
// A unit is the 2V elements of V consecutive pairs j0 .. j0 + V - 1 (j0 = u V), loaded as two
// packs of V elements (16 bytes each when V = 16 / sizeof(T); one element each when V = 1):
//   NeoX:        pack 0 at u V, pack 1 at u V + R/2    (pair j: pack 0 [j], pack 1 [j])
//   interleaved: pack 0 at 2 u V, pack 1 at 2 u V + V  (pair j: elements 2j, 2j + 1 of the unit)
// Both modes then share one register layout and one rotation; the mode only picks, at run time,
// which register feeds which pair (selects, no local memory).
#pragma once
#include "common/dtypes.cuh"
#include "common/vec.cuh"
#include "common/reduce.cuh"

namespace gpuops {

constexpr int kRopeThreads = 256;

// q and k in, q and k out (for the backward: gradients in, gradients out). Passed by value.
// Field order and sizes are mirrored by ROPE_QK in gpuops/ops/rotary.py ("4P18q5if").
struct RopeQK {
  const void* q; const void* k; void* oq; void* ok;
  long long q_s[4], k_s[4], oq_s[4], ok_s[4];   // strides (b, s, h, d) in elements
  long long seq;                                // S (tokens per batch row; T for packed input)
  long long total;                              // rope: work items; norm kernels: see there
  int hq, hk, d, r;                             // heads of q and k, head dim, rotary dim
  int interleaved;                              // 1: GPT-J pairs, 0: GPT-NeoX halves
  float sign;                                   // +1 forward rotation, -1 its inverse
};

// Where the cos/sin of (token, frequency f) come from ("3P12q4i" in gpuops/ops/rotary.py):
//   value = table[stream * X_sm + b * X_sb + row * X_sr + f * X_sc]
// row = the token's position (pos_mode 1/2: positions[stream * p_sm + b * p_sb + s * p_ss],
// int32 or int64) or its sequence index s (pos_mode 0). stream is 0 unless multi-section
// (M-RoPE): mrope_mode 1 = contiguous sections (Qwen2-VL: f < t -> 0, f < t + h -> 1, else 2;
// sec_a = t, sec_b = t + h), 2 = interleaved (Qwen3-VL: f % 3 == 1 and f < 3h -> 1,
// f % 3 == 2 and f < 3w -> 2, else 0; sec_a = 3h, sec_b = 3w). A position outside [0, rows)
// gives NaN cos/sin, so the rotated elements of that token are NaN (no out-of-bounds read).
struct RopeTables {
  const void* cos; const void* sin; const void* pos;
  long long c_sm, c_sb, c_sr, c_sc;
  long long s_sm, s_sb, s_sr, s_sc;
  long long p_sm, p_sb, p_ss;
  long long rows;
  int pos_mode, mrope_mode, sec_a, sec_b;
};

// Extra arguments of the fused RMSNorm + RoPE kernels ("5P10qf2i").
struct NormArgs {
  const void* wq; const void* wk;   // RMSNorm weights [D] of q and k (table dtype)
  const void* xq; const void* xk;   // backward: the forward's inputs q and k
  float* partial;                   // backward: [gridDim.x, D] per-block weight-gradient sums
  long long xq_s[4], xk_s[4];       // strides of xq, xk
  long long wq_s, wk_s;             // strides of the weights
  float eps;
  int group;                        // lanes per head row (power of two <= 32)
  int nbq;                          // backward: blocks [0, nbq) do q rows, the rest k rows
};

template <class T, int V>
__device__ __forceinline__ void load_pack(const T* p, long long off, long long sd, float (&x)[V]) {
  if constexpr (V == 1) {
    x[0] = to_float(p[off * sd]);
  } else {
    Vec16<T>::unpack(load16(p + off), x);
  }
}

template <class T, int V>
__device__ __forceinline__ void store_pack(T* p, long long off, long long sd, const float (&x)[V]) {
  if constexpr (V == 1) {
    p[off * sd] = from_float<T>(x[0]);
  } else {
    store16(p + off, Vec16<T>::pack(x));
  }
}

// A pass-through pack, copied bit for bit.
template <class T, int V>
__device__ __forceinline__ void copy_pack(const T* src, long long soff, long long ssd, T* dst,
                                          long long doff, long long dsd) {
  if constexpr (V == 1) {
    dst[doff * dsd] = src[soff * ssd];
  } else {
    store16(dst + doff, load16(src + soff));
  }
}

// Element offsets (within the head) of the two packs of rotary unit u.
template <int V>
__device__ __forceinline__ void unit_offsets(int u, int r, bool inter, int& off0, int& off1) {
  off0 = inter ? 2 * u * V : u * V;
  off1 = inter ? off0 + V : off0 + (r >> 1);
}

// The pairs of a unit in pack layout x[2][V]: lo[j], hi[j] of frequency j0 + j.
template <int V>
__device__ __forceinline__ void unit_pairs(const float (&x)[2][V], bool inter, float (&lo)[V],
                                           float (&hi)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    lo[j] = inter ? x[(2 * j) / V][(2 * j) % V] : x[0][j];
    hi[j] = inter ? x[(2 * j + 1) / V][(2 * j + 1) % V] : x[1][j];
  }
}

// The inverse of unit_pairs.
template <int V>
__device__ __forceinline__ void unit_scatter(const float (&lo)[V], const float (&hi)[V], bool inter,
                                             float (&x)[2][V]) {
#pragma unroll
  for (int p = 0; p < 2; ++p) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int el = p * V + e;
      x[p][e] = inter ? ((el & 1) ? hi[el >> 1] : lo[el >> 1]) : (p ? hi[e] : lo[e]);
    }
  }
}

// Table rows of a token for the three streams (all equal unless M-RoPE); ok = all in range.
__device__ __forceinline__ void token_rows(const RopeTables& tb, long long b, long long s,
                                           long long& r0, long long& r1, long long& r2, bool& ok) {
  if (tb.pos_mode == 0) {
    r0 = r1 = r2 = s;
    ok = true;
    return;
  }
  const long long at = b * tb.p_sb + s * tb.p_ss;
  if (tb.pos_mode == 1) {
    const int* p = static_cast<const int*>(tb.pos);
    r0 = p[at];
    r1 = tb.mrope_mode ? p[at + tb.p_sm] : r0;
    r2 = tb.mrope_mode ? p[at + 2 * tb.p_sm] : r0;
  } else {
    const long long* p = static_cast<const long long*>(tb.pos);
    r0 = p[at];
    r1 = tb.mrope_mode ? p[at + tb.p_sm] : r0;
    r2 = tb.mrope_mode ? p[at + 2 * tb.p_sm] : r0;
  }
  // unsigned compare: negative positions are out of range too
  ok = static_cast<unsigned long long>(r0) < static_cast<unsigned long long>(tb.rows) &&
       static_cast<unsigned long long>(r1) < static_cast<unsigned long long>(tb.rows) &&
       static_cast<unsigned long long>(r2) < static_cast<unsigned long long>(tb.rows);
}

__device__ __forceinline__ int mrope_stream(const RopeTables& tb, int f) {
  if (tb.mrope_mode == 1) return f < tb.sec_a ? 0 : (f < tb.sec_b ? 1 : 2);
  if (tb.mrope_mode == 2) {
    const int m = f % 3;
    return (m == 1 && f < tb.sec_a) ? 1 : ((m == 2 && f < tb.sec_b) ? 2 : 0);
  }
  return 0;
}

// V elements of a table-dtype array (weights, cos, sin) kept as raw 16-byte words until used:
// loaded with the row, before the row's reduction, in few registers (16-bit values stay packed).
template <class TC, int V>
struct RawPack {
  static constexpr int kPer = Vec16<TC>::size;
  static constexpr int N = V / kPer;                 // V * sizeof(TC) / 16 words
  static_assert(N >= 1 && N * kPer == V, "whole 16-byte words");
  uint4 r[N];
  __device__ __forceinline__ void load(const TC* p) {
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = load16(p + i * kPer);
  }
  // The same words from elements `st` apart (any alignment, st may be 0).
  static __device__ __forceinline__ unsigned word(const TC* p, long long st, int k) {
    if constexpr (sizeof(TC) == 4) {
      return __float_as_uint(to_float(p[k * st]));
    } else {
      return static_cast<unsigned>(p[(2 * k) * st].bits) |
             (static_cast<unsigned>(p[(2 * k + 1) * st].bits) << 16);
    }
  }
  __device__ __forceinline__ void load_strided(const TC* p, long long st) {
#pragma unroll
    for (int i = 0; i < N; ++i)
      r[i] = make_uint4(word(p, st, 4 * i), word(p, st, 4 * i + 1), word(p, st, 4 * i + 2),
                        word(p, st, 4 * i + 3));
  }
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = make_uint4(0, 0, 0, 0);
  }
  __device__ __forceinline__ void unpack(float (&f)[V], float scale = 1.0f) const {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float t[kPer];
      Vec16<TC>::unpack(r[i], t);
#pragma unroll
      for (int e = 0; e < kPer; ++e) f[i * kPer + e] = scale * t[e];
    }
  }
};

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// Where the cos/sin values of frequencies f0 .. f0 + V - 1 of a token start, when they lie in one
// stream at unit column stride and 16-byte aligned (the common case: one table row, no M-RoPE):
// then they are read as 16-byte words. false: use fetch_cos_sin.
template <class TC, int V>
__device__ __forceinline__ bool table_words(const RopeTables& tb, long long b, long long r0,
                                            bool ok, int f0, const TC*& ct, const TC*& st) {
  if (!ok || tb.mrope_mode != 0 || tb.c_sc != 1 || tb.s_sc != 1) return false;
  ct = static_cast<const TC*>(tb.cos) + b * tb.c_sb + r0 * tb.c_sr + f0;
  st = static_cast<const TC*>(tb.sin) + b * tb.s_sb + r0 * tb.s_sr + f0;
  return aligned16(ct) && aligned16(st);
}

// cos and sign * sin of frequencies f0 .. f0 + V - 1 for a token (rows from token_rows).
// Fast path: the unit's frequencies use one stream (always without M-RoPE; with Qwen2-VL's
// sections unless the unit straddles a section boundary) and the tables have unit column
// strides: V loads at constant offsets from one row pointer (few registers, all in flight at
// once). Anything else (GPT-J's duplicated tables, column-strided tables, Qwen3-VL's interleaved
// streams) reads one frequency per loop step into a local array: fewer registers than unrolled
// per-frequency addresses, and the loop is short next to the data's memory time.
template <class TC, int V>
__device__ __forceinline__ void fetch_cos_sin(const RopeTables& tb, long long b, long long r0,
                                              long long r1, long long r2, bool ok, int f0,
                                              float sign, float (&c)[V], float (&s)[V]) {
  if (!ok) {                           // never read outside the table
    const float nan = __int_as_float(0x7fffffff);
#pragma unroll
    for (int j = 0; j < V; ++j) c[j] = s[j] = nan;
    return;
  }
  const TC* ct = static_cast<const TC*>(tb.cos);
  const TC* st = static_cast<const TC*>(tb.sin);
  const int m0 = mrope_stream(tb, f0);
  if (tb.c_sc == 1 && tb.s_sc == 1 &&
      (tb.mrope_mode == 0 || (tb.mrope_mode == 1 && m0 == mrope_stream(tb, f0 + V - 1)))) {
    const long long row = m0 == 0 ? r0 : (m0 == 1 ? r1 : r2);
    ct += m0 * tb.c_sm + b * tb.c_sb + row * tb.c_sr + f0;
    st += m0 * tb.s_sm + b * tb.s_sb + row * tb.s_sr + f0;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      c[j] = to_float(ct[j]);
      s[j] = sign * to_float(st[j]);
    }
    return;
  }
  float cl[V], sl[V];
#pragma unroll 1
  for (int j = 0; j < V; ++j) {
    const int f = f0 + j;
    const int m = mrope_stream(tb, f);
    const long long row = m == 0 ? r0 : (m == 1 ? r1 : r2);
    cl[j] = to_float(ct[m * tb.c_sm + b * tb.c_sb + row * tb.c_sr + f * tb.c_sc]);
    sl[j] = sign * to_float(st[m * tb.s_sm + b * tb.s_sb + row * tb.s_sr + f * tb.s_sc]);
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    c[j] = cl[j];
    s[j] = sl[j];
  }
}

// cos and sign * sin as fetch_cos_sin, read as 16-byte words where table_words allows (one stream,
// unit column stride, aligned: two or four wide loads instead of 2V element loads).
template <class TC, int V>
__device__ __forceinline__ void cos_sin(const RopeTables& tb, long long b, long long r0,
                                        long long r1, long long r2, bool ok, int f0, float sign,
                                        float (&c)[V], float (&s)[V]) {
  const TC* ct = nullptr;
  const TC* st = nullptr;
  if (table_words<TC, V>(tb, b, r0, ok, f0, ct, st)) {
    RawPack<TC, V> cw, sw;
    cw.load(ct);
    sw.load(st);
    cw.unpack(c);
    sw.unpack(s, sign);
  } else {
    fetch_cos_sin<TC, V>(tb, b, r0, r1, r2, ok, f0, sign, c, s);
  }
}

// (lo, hi) -> (lo cos - hi sin, hi cos + lo sin), in place.
template <int V>
__device__ __forceinline__ void rotate_pairs(float (&lo)[V], float (&hi)[V], const float (&c)[V],
                                             const float (&s)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float a = lo[j], b = hi[j];
    lo[j] = fmaf(a, c[j], -b * s[j]);
    hi[j] = fmaf(b, c[j], a * s[j]);
  }
}

// Sum over the `group` lanes (a power of two <= 32, aligned) that share a head row; every lane of
// the warp must call it. Fixed butterfly order: deterministic.
__device__ __forceinline__ float group_sum(float v, int group) {
  for (int o = group >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// token = i / per_token, rem = i % per_token; then b = token / seq, s = token % seq. In 32 bits
// when i fits (a 64-bit division is a long software routine).
__device__ __forceinline__ void split_index(long long i, long long limit, unsigned per_token,
                                            long long seq, long long& b, long long& s,
                                            unsigned& rem) {
  if (limit <= 0xffffffffll) {
    const unsigned ii = static_cast<unsigned>(i);
    const unsigned t = ii / per_token;
    rem = ii - t * per_token;
    const unsigned sq = static_cast<unsigned>(seq);
    const unsigned bb = t / sq;
    b = bb;
    s = t - bb * sq;
  } else {
    const long long t = i / per_token;
    rem = static_cast<unsigned>(i - t * per_token);
    b = t / seq;
    s = t - b * seq;
  }
}

}  // namespace gpuops
