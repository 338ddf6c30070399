// Qwen3's attention prologue in one pass: per-head RMSNorm of q and k over the head dim (weights
// [D]) followed by RoPE (gpuops.qk_norm_rotary), and its backward (qk_norm_rotary_backward).
//
// A head row (D elements) belongs to a group of G lanes (G = a power of two <= 32 chosen by the
// host); an item is a rotary unit (two packs, see rope_common.cuh) or a pass-through pack. With
// 16-byte packs each lane holds one item in registers (the row is read once and written once);
// with one-element packs (strided or unaligned heads) lanes loop over items in two passes. The
// row's sums are butterflies over the group's lanes.
//
// Forward:  n = x * rstd, rstd = 1 / sqrt(mean(x^2) + eps); y = n * w; out = rotate(y).
// Backward: gy = rotate^-1(g) (pass-through: gy = g); dn = gy * w;
//           dx = rstd * (dn - n * mean(dn * n)); dw += gy * n.
// The weight gradients are deterministic, with no atomics: the backward runs a fixed grid of
// persistent blocks (blocks [0, nbq) walk the q rows, the others the k rows); each lane adds its
// columns' terms into its slot's row of a shared-memory table, a block adds the slots in a fixed
// order and writes one partial row; qk_norm_dw_reduce adds the partial rows in a fixed order.
#include "rotary/rope_common.cuh"
#include "common/opaque.cuh"
#include "common/pdl.cuh"

namespace gpuops {

// The largest head dim of the fused kernels (gpuops/ops/rotary.py: BWD_SMEM_FLOATS / 8): fwd3 keeps
// both weight vectors of that length in shared memory.
constexpr int kQkNormMaxD = 512;

// Element offsets of item `it` of a head row: a rotary unit (two packs) or a pass-through pack
// (off1 = -1).
template <int V>
__device__ __forceinline__ void item_offsets(int it, int units, int r, bool inter, int& off0,
                                             int& off1) {
  if (it < units) {
    unit_offsets<V>(it, r, inter, off0, off1);
  } else {
    off0 = r + (it - units) * V;
    off1 = -1;
  }
}

// Loads item `it` of a head row at x (element stride sd when V == 1) into v[0], v[1]
// (v[1] = 0 for a pass-through pack).
template <class T, int V>
__device__ __forceinline__ void load_item(const T* x, long long sd, int it, int units, int r,
                                          bool inter, float (&v)[2][V]) {
  int off0, off1;
  item_offsets<V>(it, units, r, inter, off0, off1);
  load_pack<T, V>(x, off0, sd, v[0]);
  if (off1 >= 0) {
    load_pack<T, V>(x, off1, sd, v[1]);
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) v[1][e] = 0.0f;
  }
}

template <class T, int V>
__device__ __forceinline__ void store_item(T* o, long long sd, int it, int units, int r,
                                           bool inter, const float (&v)[2][V]) {
  int off0, off1;
  item_offsets<V>(it, units, r, inter, off0, off1);
  store_pack<T, V>(o, off0, sd, v[0]);
  if (off1 >= 0) store_pack<T, V>(o, off1, sd, v[1]);
}

// The weights of item `it` in the same layout (0 for the missing second pack).
template <class TC, int V>
__device__ __forceinline__ void load_item_weights(const TC* w, long long ws, int it, int units,
                                                  int r, bool inter, float (&out)[2][V]) {
  int off0, off1;
  item_offsets<V>(it, units, r, inter, off0, off1);
#pragma unroll
  for (int e = 0; e < V; ++e) {
    out[0][e] = to_float(w[(off0 + e) * ws]);
    out[1][e] = off1 >= 0 ? to_float(w[(off1 + e) * ws]) : 0.0f;
  }
}

// Rotates a rotary unit in pack layout by the token's angles (sign = -1: the inverse).
template <class TC, int V>
__device__ __forceinline__ void rotate_unit(const RopeTables& tb, long long b, long long r0,
                                            long long r1, long long r2, bool ok, int it, bool inter,
                                            float sign, float (&v)[2][V]) {
  float c[V], sn[V], lo[V], hi[V];
  fetch_cos_sin<TC, V>(tb, b, r0, r1, r2, ok, it * V, sign, c, sn);
  unit_pairs<V>(v, inter, lo, hi);
  rotate_pairs<V>(lo, hi, c, sn);
  unit_scatter<V>(lo, hi, inter, v);
}

// Where a head row of q or k (or of their gradients, outputs, ...) starts.
template <class T>
__device__ __forceinline__ T* row_ptr(const void* base, const long long (&st)[4], long long b,
                                      long long s, long long h) {
  return static_cast<T*>(const_cast<void*>(base)) + (b * st[0] + s * st[1] + h * st[2]);
}

// One head row per group of G lanes: a.total = tokens * (hq + hk) rows, one per group. Element
// by element (V = 1; 16-byte packs take qk_norm_rope_fwd2): any number of items per lane, two
// passes (sum of squares, then the output); the second reads the row again (from L1/L2). For
// strided or unaligned heads and odd head dims.
template <class T, class TC, int V>
__global__ void __launch_bounds__(kRopeThreads, 4)
qk_norm_rope_fwd(RopeQK a, RopeTables tb, NormArgs n) {
  pdl_start();
  static_assert(V == 1, "16-byte packs: qk_norm_rope_fwd2");
  const int G = n.group;
  const int lane = threadIdx.x & (G - 1);
  const int slots = kRopeThreads / G;
  const long long row = static_cast<long long>(blockIdx.x) * slots + threadIdx.x / G;
  const bool valid = row < a.total;
  const int units = a.r / (2 * V);
  const int per_head = units + (a.d - a.r) / V;
  const bool inter = a.interleaved != 0;

  long long b = 0, s = 0;
  unsigned h = 0;
  if (valid) split_index(row, a.total, static_cast<unsigned>(a.hq + a.hk), a.seq, b, s, h);
  const bool is_q = static_cast<int>(h) < a.hq;
  const long long hh = is_q ? h : h - a.hq;
  const T* x = row_ptr<const T>(is_q ? a.q : a.k, is_q ? a.q_s : a.k_s, b, s, hh);
  const long long xsd = is_q ? a.q_s[3] : a.k_s[3];

  float v[2][V];
  float ss = 0.0f;
  if (valid) {
    for (int it = lane; it < per_head; it += G) {
      load_item<T, V>(x, xsd, it, units, a.r, inter, v);
      ss = fmaf(v[0][0], v[0][0], fmaf(v[1][0], v[1][0], ss));
    }
  }
  ss = group_sum(ss, G);
  if (!valid) return;                         // after the last shuffle
  const float rstd = rsqrtf(ss / static_cast<float>(a.d) + n.eps);

  T* o = row_ptr<T>(is_q ? a.oq : a.ok, is_q ? a.oq_s : a.ok_s, b, s, hh);
  const long long osd = is_q ? a.oq_s[3] : a.ok_s[3];
  const TC* w = static_cast<const TC*>(is_q ? n.wq : n.wk);
  const long long ws = is_q ? n.wq_s : n.wk_s;
  long long r0, r1, r2;
  bool ok;
  token_rows(tb, b, s, r0, r1, r2, ok);
  for (int it = lane; it < per_head; it += G) {
    load_item<T, V>(x, xsd, it, units, a.r, inter, v);
    float wv[2][V];
    load_item_weights<TC, V>(w, ws, it, units, a.r, inter, wv);
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int e = 0; e < V; ++e) v[p][e] = v[p][e] * rstd * wv[p][e];
    if (it < units) rotate_unit<TC, V>(tb, b, r0, r1, r2, ok, it, inter, a.sign, v);
    store_item<T, V>(o, osd, it, units, a.r, inter, v);
  }
}

template <class T> struct IsHalf { static constexpr bool value = false; };
template <> struct IsHalf<float16_t> { static constexpr bool value = true; };

// Forward, 16-byte packs only (V > 1): the same math as qk_norm_rope_fwd, but every
// load of a row (x, its weights, its cos/sin) is issued before the row's sum of squares, as
// 16-byte words where aligned (weights at unit stride, tables as above), so a lane's reads are
// all in flight at once and nothing but shuffles and arithmetic separates the read from the
// store (qk_norm_rope_fwd reads the weights and tables after the reduction, one element at a
// time). Anything not aligned falls back, per lane, to the element reads after the reduction.
template <class T, class TC, int V>
__global__ void __launch_bounds__(kRopeThreads, 4)
qk_norm_rope_fwd2(RopeQK a, RopeTables tb, NormArgs n) {
  pdl_start();
  static_assert(V > 1, "16-byte packs only");
  const int G = n.group;
  const int lane = threadIdx.x & (G - 1);
  const int slots = kRopeThreads / G;
  const long long row = static_cast<long long>(blockIdx.x) * slots + threadIdx.x / G;
  const bool valid = row < a.total;
  const int units = a.r / (2 * V);
  const int per_head = units + (a.d - a.r) / V;
  const bool inter = a.interleaved != 0;
  const bool active = valid && lane < per_head;

  long long b = 0, s = 0;
  unsigned h = 0;
  if (valid) split_index(row, a.total, static_cast<unsigned>(a.hq + a.hk), a.seq, b, s, h);
  const bool is_q = static_cast<int>(h) < a.hq;
  const long long hh = is_q ? h : h - a.hq;
  const T* x = row_ptr<const T>(is_q ? a.q : a.k, is_q ? a.q_s : a.k_s, b, s, hh);
  const TC* w = static_cast<const TC*>(is_q ? n.wq : n.wk);
  const long long ws = is_q ? n.wq_s : n.wk_s;
  int off0 = 0, off1 = -1;
  item_offsets<V>(lane, units, a.r, inter, off0, off1);
  const bool rotary = lane < units;
  long long r0 = 0, r1 = 0, r2 = 0;
  bool ok = true;
  if (valid) token_rows(tb, b, s, r0, r1, r2, ok);

  uint4 xr[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  RawPack<TC, V> w0, w1, cw, sw;
  // Early weight/table words fit the register budget when they are as wide as the data (a
  // float32 table with 16-bit data would need 32 more registers; fp16's cvt unpacking spilled
  // 20 bytes on sm_90): else the late element reads.
  constexpr bool kEarly = sizeof(TC) == sizeof(T) && !IsHalf<T>::value;
  const bool wvec = kEarly && ws == 1 && aligned16(w + off0) && (off1 < 0 || aligned16(w + off1));
  const TC* ct = nullptr;
  const TC* st = nullptr;
  bool tvec = false;
  if (active) {
    xr[0] = load16(x + off0);
    if (off1 >= 0) xr[1] = load16(x + off1);
    if (wvec) {
      w0.load(w + off0);
      if (off1 >= 0) w1.load(w + off1);
    }
    if (kEarly && rotary) {
      tvec = table_words<TC, V>(tb, b, r0, ok, lane * V, ct, st);
      if (tvec) {
        cw.load(ct);
        sw.load(st);
      }
    }
  }
  float v[2][V];
  Vec16<T>::unpack(xr[0], v[0]);
  Vec16<T>::unpack(xr[1], v[1]);                  // pass-through pack: xr[1] = 0
  float ss = 0.0f;
#pragma unroll
  for (int p = 0; p < 2; ++p)
#pragma unroll
    for (int e = 0; e < V; ++e) ss = fmaf(v[p][e], v[p][e], ss);
  ss = group_sum(ss, G);
  if (!active) return;                            // after the last shuffle
  const float rstd = rsqrtf(ss / static_cast<float>(a.d) + n.eps);

  float wv[2][V];
  if (wvec) {
    w0.unpack(wv[0]);
    if (off1 >= 0) w1.unpack(wv[1]);
    else
#pragma unroll
      for (int e = 0; e < V; ++e) wv[1][e] = 0.0f;
  } else {
    load_item_weights<TC, V>(w, ws, lane, units, a.r, inter, wv);
  }
  // The same scale-and-rotate steps as scale_rotate (fwd3 / fwd4), written out here on purpose:
  // this kernel sits at its 64-register cap, and sharing them through one helper (tried in
  // session 14) turned sm_70's allocation of the bf16 instance into an 8-byte spill.
#pragma unroll
  for (int p = 0; p < 2; ++p)
#pragma unroll
    for (int e = 0; e < V; ++e) v[p][e] = v[p][e] * rstd * wv[p][e];
  if (rotary) {
    float c[V], sn[V], lo[V], hi[V];
    if (tvec) {
      cw.unpack(c);
      sw.unpack(sn, a.sign);
    } else {
      fetch_cos_sin<TC, V>(tb, b, r0, r1, r2, ok, lane * V, a.sign, c, sn);
    }
    unit_pairs<V>(v, inter, lo, hi);
    rotate_pairs<V>(lo, hi, c, sn);
    unit_scatter<V>(lo, hi, inter, v);
  }
  T* o = row_ptr<T>(is_q ? a.oq : a.ok, is_q ? a.oq_s : a.ok_s, b, s, hh);
  store16(o + off0, Vec16<T>::pack(v[0]));
  if (off1 >= 0) store16(o + off1, Vec16<T>::pack(v[1]));
}

// The end of a fused forward row (fwd3, fwd4): v = v * rstd * w, then on rotary lanes the
// rotation by the token's cos/sin words, NaN where its position lies outside the table (as fwd2).
template <class TC, int V>
__device__ __forceinline__ void scale_rotate(float (&v)[2][V], float rstd,
                                             const RawPack<TC, V>& w0, const RawPack<TC, V>& w1,
                                             bool rotary, bool ok, const RawPack<TC, V>& cw,
                                             const RawPack<TC, V>& sw, float sign) {
  constexpr bool inter = false;                   // GPT-NeoX halves only (the host checks)
  float wv[2][V];
  w0.unpack(wv[0]);
  w1.unpack(wv[1]);
#pragma unroll
  for (int p = 0; p < 2; ++p)
#pragma unroll
    for (int e = 0; e < V; ++e) v[p][e] = v[p][e] * rstd * wv[p][e];
  if (rotary) {
    float c[V], sn[V], lo[V], hi[V];
    if (ok) {
      cw.unpack(c);
      sw.unpack(sn, sign);
    } else {
      const float nan = __int_as_float(0x7fffffff);
#pragma unroll
      for (int j = 0; j < V; ++j) c[j] = sn[j] = nan;
    }
    unit_pairs<V>(v, inter, lo, hi);
    rotate_pairs<V>(lo, hi, c, sn);
    unit_scatter<V>(lo, hi, inter, v);
  }
}

// Forward, one-shot and lean (fwd3's host conditions, plus weights at unit stride with 16-byte
// aligned rows): one row per lane as fwd2, but only x's and the cos/sin words are read before
// the row's reduction; the weight words, which hit L1 (every block reads the same weights),
// after it. No element-by-element fallback paths and 32-bit rows: <= 48 registers, 5 blocks of
// 256 per SM as rope_kernel (fwd2 holds x, weight and table words through the reduction at 64
// registers: 4 blocks). Runs 67-68: the cos/sin words read after the reduction too cost 7-10%
// (bf16 [4, 4096, 32, 8, 128] 128.0 against 116.5 us): their L2 latency then follows the
// shuffles on every row's path to its store; the weights' L1 hits do not show.
template <class T, class TC, int V>
__global__ void __launch_bounds__(kRopeThreads, 5)
qk_norm_rope_fwd4(RopeQK a, RopeTables tb, NormArgs n) {
  pdl_start();
  static_assert(V > 1 && sizeof(TC) == sizeof(T), "16-byte packs, tables as wide as the data");
  const int G = n.group;
  const int lane = threadIdx.x & (G - 1);
  const int slots = kRopeThreads / G;
  const int total = static_cast<int>(a.total);    // the host checks total + grid < 2^31
  const int row = static_cast<int>(blockIdx.x) * slots + threadIdx.x / G;
  const int units = a.r / (2 * V);
  const int per_head = units + (a.d - a.r) / V;
  constexpr bool inter = false;                   // GPT-NeoX halves only (the host checks)
  const bool rotary = lane < units;
  const bool active = row < total && lane < per_head;
  int off0 = 0, off1 = -1;
  item_offsets<V>(lane, units, a.r, inter, off0, off1);
  long long b = 0, sq = 0;
  unsigned h = 0;
  split_index(row < total ? row : 0, 0, static_cast<unsigned>(a.hq + a.hk), a.seq, b, sq, h);
  const bool q = static_cast<int>(h) < a.hq;
  const long long hh = q ? h : h - a.hq;
  uint4 x0 = make_uint4(0, 0, 0, 0), x1 = make_uint4(0, 0, 0, 0);
  if (active) {
    const T* x = row_ptr<const T>(q ? a.q : a.k, q ? a.q_s : a.k_s, b, sq, hh);
    x0 = load16(x + static_cast<unsigned>(off0));    // unsigned: no sign-extension words
    if (off1 >= 0) x1 = load16(x + static_cast<unsigned>(off1));
  }
  long long r0 = 0, r1 = 0, r2 = 0;
  bool ok = true;
  RawPack<TC, V> cw, sw;
  if (active) {
    token_rows(tb, b, sq, r0, r1, r2, ok);
    if (rotary && ok) {
      const TC* ct = static_cast<const TC*>(tb.cos) + b * tb.c_sb + r0 * tb.c_sr + lane * V;
      cw.load(ct);
      // sin's words sit as far from its base as cos's (same batch and row strides: the host
      // checks); bases from the parameters, not registers
      sw.load(static_cast<const TC*>(tb.sin) + (ct - static_cast<const TC*>(tb.cos)));
    }
  }
  float ss = 0.0f;
  {
    float t[2][V];
    Vec16<T>::unpack(x0, t[0]);
    Vec16<T>::unpack(x1, t[1]);                   // pass-through pack or inactive lane: 0
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int e = 0; e < V; ++e) ss = fmaf(t[p][e], t[p][e], ss);
  }
  ss = group_sum(ss, G);
  if (!active) return;                            // after the last shuffle
  const float rstd = rsqrtf(ss / static_cast<float>(a.d) + n.eps);

  const TC* w = static_cast<const TC*>(q ? n.wq : n.wk);
  RawPack<TC, V> w0, w1;
  w0.load(w + off0);
  if (off1 >= 0) w1.load(w + off1);
  else w1.clear();
  // x's floats again from its 8 words (opaque: not kept from the sum of squares, 16 registers
  // through the reads)
  opaque(x0);
  opaque(x1);
  float v[2][V];
  Vec16<T>::unpack(x0, v[0]);
  Vec16<T>::unpack(x1, v[1]);
  scale_rotate<TC, V>(v, rstd, w0, w1, rotary, ok, cw, sw, a.sign);
  T* o = row_ptr<T>(q ? a.oq : a.ok, q ? a.oq_s : a.ok_s, b, sq, hh);
  store16(o + static_cast<unsigned>(off0), Vec16<T>::pack(v[0]));
  if (off1 >= 0) store16(o + static_cast<unsigned>(off1), Vec16<T>::pack(v[1]));
}

// Where output head row `row` (< 2^31) starts.
template <class T>
__device__ __forceinline__ T* out_row(const RopeQK& a, int row) {
  long long b = 0, sq = 0;
  unsigned h = 0;
  split_index(row, 0, static_cast<unsigned>(a.hq + a.hk), a.seq, b, sq, h);
  const bool q = static_cast<int>(h) < a.hq;
  return row_ptr<T>(q ? a.oq : a.ok, q ? a.oq_s : a.ok_s, b, sq, q ? h : h - a.hq);
}

// One head row's reads for qk_norm_rope_fwd3, issued a row ahead: x's two packs, and where the
// row's cos/sin words are (tables as 16-byte words: the host guarantees it).
template <class T, class TC, int V>
struct Fwd3Row {
  uint4 x0, x1;
  const TC* cos;                    // the lane's cos words
  bool q, ok;                       // a q row; the token's position is inside the table

  __device__ __forceinline__ void load(const RopeQK& a, const RopeTables& tb, int row,
                                       bool active, int off0, int off1, int f0) {
    long long b = 0, sq = 0;
    unsigned h = 0;
    split_index(row, 0, static_cast<unsigned>(a.hq + a.hk), a.seq, b, sq, h);   // 32 bits
    q = static_cast<int>(h) < a.hq;
    const long long hh = q ? h : h - a.hq;
    const T* x = row_ptr<const T>(q ? a.q : a.k, q ? a.q_s : a.k_s, b, sq, hh);
    long long r0 = 0, r1 = 0, r2 = 0;
    token_rows(tb, b, sq, r0, r1, r2, ok);
    cos = static_cast<const TC*>(tb.cos) + b * tb.c_sb + r0 * tb.c_sr + f0;
    x0 = x1 = make_uint4(0, 0, 0, 0);
    if (!active) return;
    x0 = load16(x + off0);
    if (off1 >= 0) x1 = load16(x + off1);
  }
};

// Forward, persistent (16-byte packs; tables in one stream at unit column stride with 16-byte
// aligned rows; weights and tables as wide as the data): fwd2's math, but a grid of resident
// blocks walks the rows (row += gridDim.x * slots), each lane loading its next row (x and its
// cos/sin words) before it reduces and stores the current one. fwd2's blocks hold one row per
// lane and have nothing in flight once their loads land (reduce, store, retire, the next block
// starts); here a lane always has a row's reads in flight, and there is no block churn. The
// weights are read once per block into shared memory (any stride).
// kProbe (benchmarks/experiments/qk_norm_forward.py only; wrong results): bit 1 skips the row's
// shuffles, bit 2 the weights, bit 4 the cos/sin loads and the rotation.
template <class T, class TC, int V, int kProbe = 0>
__global__ void __launch_bounds__(kRopeThreads, 4)
qk_norm_rope_fwd3(RopeQK a, RopeTables tb, NormArgs n) {
  pdl_start();
  static_assert(V > 1 && sizeof(TC) == sizeof(T), "16-byte packs, tables as wide as the data");
  __shared__ __align__(16) TC wsm[2][kQkNormMaxD];    // q weights, k weights
  for (int i = threadIdx.x; i < a.d; i += kRopeThreads) {
    wsm[0][i] = static_cast<const TC*>(n.wq)[i * n.wq_s];
    wsm[1][i] = static_cast<const TC*>(n.wk)[i * n.wk_s];
  }
  __syncthreads();

  const int G = n.group;
  const int lane = threadIdx.x & (G - 1);
  const int slots = kRopeThreads / G;
  const int units = a.r / (2 * V);
  const int per_head = units + (a.d - a.r) / V;
  constexpr bool inter = false;                   // GPT-NeoX halves only (the host checks)
  const bool rotary = lane < units;
  const bool lane_active = lane < per_head;
  int off0 = 0, off1 = -1;
  item_offsets<V>(lane, units, a.r, inter, off0, off1);
  // 32-bit rows (the host checks total + step < 2^31)
  const int total = static_cast<int>(a.total);
  const int step = static_cast<int>(gridDim.x) * slots;
  const int warp_first = (threadIdx.x & 31) / G;  // this lane's row - the warp's first row
  int row = static_cast<int>(blockIdx.x) * slots + threadIdx.x / G;

  // The warp's first row decides the trip count: group_sum shuffles over the whole warp.
  Fwd3Row<T, TC, V> next;
  if (row - warp_first < total)
    next.load(a, tb, row < total ? row : 0, lane_active && row < total, off0, off1, lane * V);
  for (; row - warp_first < total; row += step) {
    const Fwd3Row<T, TC, V> cur = next;
    const bool active = lane_active && row < total;
    // this row's cos/sin (mostly L1 hits: a block's rows share a few tokens), then the next row
    RawPack<TC, V> cw, sw;
    if (!(kProbe & 4) && active && rotary && cur.ok) {
      cw.load(cur.cos);
      // sin's words sit as far from its base as cos's (the host checks that both tables have
      // the same batch and row strides); bases from the parameters, not registers
      sw.load(static_cast<const TC*>(tb.sin) + (cur.cos - static_cast<const TC*>(tb.cos)));
    }
    const int nrow = row + step;
    if (nrow - warp_first < total)
      next.load(a, tb, nrow < total ? nrow : 0, lane_active && nrow < total, off0, off1, lane * V);

    float v[2][V];
    Vec16<T>::unpack(cur.x0, v[0]);
    Vec16<T>::unpack(cur.x1, v[1]);               // pass-through pack or inactive lane: 0
    float ss = 0.0f;
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int e = 0; e < V; ++e) ss = fmaf(v[p][e], v[p][e], ss);
    if (!(kProbe & 1)) ss = group_sum(ss, G);
    if (!active) continue;
    const float rstd = rsqrtf(ss / static_cast<float>(a.d) + n.eps);

    const TC* w = wsm[cur.q ? 0 : 1];
    RawPack<TC, V> w0, w1;
    if (!(kProbe & 2)) {
      w0.load(w + off0);
      if (off1 >= 0) w1.load(w + off1);
      else w1.clear();
    } else {
      w0.r[0] = w1.r[0] = Vec16<TC>::splat(from_float<TC>(1.0f));
    }
    scale_rotate<TC, V>(v, rstd, w0, w1, !(kProbe & 4) && rotary, cur.ok, cw, sw, a.sign);
    T* out = out_row<T>(a, row);                  // recomputed: fewer registers across the loop
    store16(out + off0, Vec16<T>::pack(v[0]));
    if (off1 >= 0) store16(out + off1, Vec16<T>::pack(v[1]));
  }
}

// red[off + e] += x[e] over a pack (red: this slot's row of column sums in shared memory).
template <int V>
__device__ __forceinline__ void smem_add(float* red, int off, const float (&x)[V]) {
  if constexpr (V % 4 == 0) {
    float4* p = reinterpret_cast<float4*>(red + off);   // off and D are multiples of 4 here
#pragma unroll
    for (int e = 0; e < V / 4; ++e) {
      float4 t = p[e];
      t.x += x[4 * e]; t.y += x[4 * e + 1]; t.z += x[4 * e + 2]; t.w += x[4 * e + 3];
      p[e] = t;
    }
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) red[off + e] += x[e];
  }
}

// Loads item `it` of the gradient and of x, and turns the gradient back (gy = rotate^-1(g)).
template <class T, class TC, int V>
__device__ __forceinline__ void load_grad_item(const RopeTables& tb, const T* g, long long gsd,
                                               const T* x, long long xsd, int it, int units, int r,
                                               bool inter, float sign, long long b, long long r0,
                                               long long r1, long long r2, bool ok,
                                               float (&gy)[2][V], float (&xv)[2][V]) {
  load_item<T, V>(g, gsd, it, units, r, inter, gy);
  load_item<T, V>(x, xsd, it, units, r, inter, xv);
  if (it < units) rotate_unit<TC, V>(tb, b, r0, r1, r2, ok, it, inter, sign, gy);
}

// Backward, element by element (V = 1; 16-byte packs take qk_norm_rope_bwd2): two passes per
// row, as the forward. Per row: S_xx = sum x^2, S_gwx = sum gy w x; rstd = 1/sqrt(S_xx/D + eps); with
// n = x rstd, dn = gy w: mean(dn n) = rstd S_gwx / D and dx = rstd (dn - n mean(dn n)).
// a: q/k = the output gradients, oq/ok = the input gradients (written), sign = -1,
//    total = tokens. n: xq/xk = the forward's q and k, partial = [gridDim.x, D] floats.
// Resident blocks per SM the register budget must allow: 3 (<= 85 registers) where that does not
// spill, 2 on sm_61/sm_70 (16-bit rows need ~100 registers there). The host's persistent grid
// (gpuops/ops/rotary.py, _bwd_grid) follows the same rule.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750
constexpr int kNormBwdMinBlocks = 2;
#else
constexpr int kNormBwdMinBlocks = 3;
#endif

template <class T, class TC, int V>
__global__ void __launch_bounds__(kRopeThreads, kNormBwdMinBlocks)
qk_norm_rope_bwd(RopeQK a, RopeTables tb, NormArgs n) {
  pdl_start();
  static_assert(V == 1, "16-byte packs: qk_norm_rope_bwd2");
  // Column sums of gy * n per slot (each (slot, column) belongs to one lane): slots * D <= 4096
  // (host-checked).
  __shared__ __align__(16) float red[4096];
  const int G = n.group;
  const int lane = threadIdx.x & (G - 1);
  const int slots = kRopeThreads / G;
  const int slot = threadIdx.x / G;
  const bool is_q = static_cast<int>(blockIdx.x) < n.nbq;
  const long long lb = is_q ? blockIdx.x : blockIdx.x - n.nbq;
  const long long nb = is_q ? n.nbq : gridDim.x - n.nbq;
  const int heads = is_q ? a.hq : a.hk;
  const long long rows = a.total * heads;
  const int units = a.r / (2 * V);
  const int per_head = units + (a.d - a.r) / V;
  const bool inter = a.interleaved != 0;
  const float inv_d = 1.0f / static_cast<float>(a.d);
  for (int i = threadIdx.x; i < slots * a.d; i += kRopeThreads) red[i] = 0.0f;
  __syncthreads();
  float* my_red = red + slot * a.d;

  const void* g0 = is_q ? a.q : a.k;
  const void* x0 = is_q ? n.xq : n.xk;
  void* o0 = is_q ? a.oq : a.ok;
  const long long gsd = is_q ? a.q_s[3] : a.k_s[3];
  const long long xsd = is_q ? n.xq_s[3] : n.xk_s[3];
  const long long osd = is_q ? a.oq_s[3] : a.ok_s[3];
  const TC* w = static_cast<const TC*>(is_q ? n.wq : n.wk);
  const long long ws = is_q ? n.wq_s : n.wk_s;

  for (long long base = lb * slots; base < rows; base += nb * slots) {
    const long long row = base + slot;
    const bool valid = row < rows;
    long long b = 0, s = 0;
    unsigned hh = 0;
    if (valid) split_index(row, rows, static_cast<unsigned>(heads), a.seq, b, s, hh);
    long long r0 = 0, r1 = 0, r2 = 0;
    bool ok = true;
    if (valid) token_rows(tb, b, s, r0, r1, r2, ok);
    const T* g = row_ptr<const T>(g0, is_q ? a.q_s : a.k_s, b, s, hh);
    const T* x = row_ptr<const T>(x0, is_q ? n.xq_s : n.xk_s, b, s, hh);

    float gy[2][V], xv[2][V];
    float sxx = 0.0f, sgwx = 0.0f;
    if (valid) {
      for (int it = lane; it < per_head; it += G) {
        load_grad_item<T, TC, V>(tb, g, gsd, x, xsd, it, units, a.r, inter, a.sign, b, r0, r1,
                                 r2, ok, gy, xv);
        float wv[2][V];
        load_item_weights<TC, V>(w, ws, it, units, a.r, inter, wv);
#pragma unroll
        for (int p = 0; p < 2; ++p)
#pragma unroll
          for (int e = 0; e < V; ++e) {
            sxx = fmaf(xv[p][e], xv[p][e], sxx);
            sgwx = fmaf(gy[p][e] * wv[p][e], xv[p][e], sgwx);
          }
      }
    }
    sxx = group_sum(sxx, G);
    sgwx = group_sum(sgwx, G);
    if (!valid) continue;                       // (the loop bound is uniform across the block)
    const float rstd = rsqrtf(sxx * inv_d + n.eps);
    const float mean_dn_n = rstd * sgwx * inv_d;
    T* o = row_ptr<T>(o0, is_q ? a.oq_s : a.ok_s, b, s, hh);
    for (int it = lane; it < per_head; it += G) {
      load_grad_item<T, TC, V>(tb, g, gsd, x, xsd, it, units, a.r, inter, a.sign, b, r0, r1, r2,
                               ok, gy, xv);
      int off0, off1;
      item_offsets<V>(it, units, a.r, inter, off0, off1);
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        if (p == 1 && off1 < 0) break;
        float wv[V], prod[V];
#pragma unroll
        for (int e = 0; e < V; ++e) wv[e] = to_float(w[((p ? off1 : off0) + e) * ws]);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float nv = xv[p][e] * rstd;
          prod[e] = gy[p][e] * nv;                                  // dw terms
          gy[p][e] = rstd * fmaf(-nv, mean_dn_n, gy[p][e] * wv[e]);  // dx
        }
        smem_add<V>(my_red, p ? off1 : off0, prod);
      }
      store_item<T, V>(o, osd, it, units, a.r, inter, gy);
    }
  }

  // Block sum of the slots' column sums, in slot order: one partial row per block.
  __syncthreads();
  float* part = n.partial + static_cast<long long>(blockIdx.x) * a.d;
  for (int c = threadIdx.x; c < a.d; c += kRopeThreads) {
    float sum = 0.0f;
    for (int sl = 0; sl < slots; ++sl) sum += red[sl * a.d + c];
    part[c] = sum;
  }
}

// Backward, 16-byte packs only (V > 1): the math, grid and weight-gradient tables of
// qk_norm_rope_bwd, with (1) the lane's weights read once per block (a block walks only q rows
// or only k rows and a lane always holds the same item), kept as raw words; (2) the gradient and
// x of the block's next row read into raw words while the current row is reduced and finished
// (two rows in flight per lane); (3) cos/sin as 16-byte words where aligned.
// Two rows in flight per lane need more registers than 3 blocks per SM allow without spills:
// 2 blocks per SM (<= 128 registers) on every arch; the host's grid follows (BWD2_MIN_BLOCKS).
constexpr int kNormBwd2MinBlocks = 2;

template <class T, class TC, int V>
__global__ void __launch_bounds__(kRopeThreads, kNormBwd2MinBlocks)
qk_norm_rope_bwd2(RopeQK a, RopeTables tb, NormArgs n) {
  pdl_start();
  static_assert(V > 1, "16-byte packs only");
  __shared__ __align__(16) float red[4096];
  const int G = n.group;
  const int lane = threadIdx.x & (G - 1);
  const int slots = kRopeThreads / G;
  const int slot = threadIdx.x / G;
  const bool is_q = static_cast<int>(blockIdx.x) < n.nbq;
  const long long lb = is_q ? blockIdx.x : blockIdx.x - n.nbq;
  const long long nb = is_q ? n.nbq : gridDim.x - n.nbq;
  const int heads = is_q ? a.hq : a.hk;
  const long long rows = a.total * heads;
  const int units = a.r / (2 * V);
  const int per_head = units + (a.d - a.r) / V;
  const bool inter = a.interleaved != 0;
  const float inv_d = 1.0f / static_cast<float>(a.d);
  for (int i = threadIdx.x; i < slots * a.d; i += kRopeThreads) red[i] = 0.0f;
  __syncthreads();
  float* my_red = red + slot * a.d;

  const void* g0 = is_q ? a.q : a.k;
  const void* x0 = is_q ? n.xq : n.xk;
  void* o0 = is_q ? a.oq : a.ok;
  const long long (&gst)[4] = is_q ? a.q_s : a.k_s;
  const long long (&xst)[4] = is_q ? n.xq_s : n.xk_s;
  const long long (&ost)[4] = is_q ? a.oq_s : a.ok_s;
  const TC* w = static_cast<const TC*>(is_q ? n.wq : n.wk);
  const long long ws = is_q ? n.wq_s : n.wk_s;
  const bool lane_on = lane < per_head;
  int off0 = 0, off1 = -1;
  item_offsets<V>(lane, units, a.r, inter, off0, off1);
  const bool rotary = lane < units;

  RawPack<TC, V> w0, w1;                          // this lane's weights, once
  w0.clear();
  w1.clear();
  if (lane_on) {
    if (ws == 1 && aligned16(w + off0) && (off1 < 0 || aligned16(w + off1))) {
      w0.load(w + off0);
      if (off1 >= 0) w1.load(w + off1);
    } else {
      w0.load_strided(w + off0 * ws, ws);
      if (off1 >= 0) w1.load_strided(w + off1 * ws, ws);
    }
  }

  const long long step = nb * slots;
  long long row = lb * slots + slot;
  long long b = 0, s = 0;
  unsigned hh = 0;
  uint4 gr[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  uint4 xr[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  if (row < rows) {
    split_index(row, rows, static_cast<unsigned>(heads), a.seq, b, s, hh);
    if (lane_on) {
      const T* g = row_ptr<const T>(g0, gst, b, s, hh);
      const T* x = row_ptr<const T>(x0, xst, b, s, hh);
      gr[0] = load16(g + off0);
      xr[0] = load16(x + off0);
      if (off1 >= 0) {
        gr[1] = load16(g + off1);
        xr[1] = load16(x + off1);
      }
    }
  }

  for (long long base = lb * slots; base < rows; base += step) {
    const bool valid = row < rows;
    // the next row's reads go out first
    const long long nrow = row + step;
    long long nbb = 0, ns = 0;
    unsigned nhh = 0;
    uint4 ngr[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
    uint4 nxr[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
    if (nrow < rows) {
      split_index(nrow, rows, static_cast<unsigned>(heads), a.seq, nbb, ns, nhh);
      if (lane_on) {
        const T* g = row_ptr<const T>(g0, gst, nbb, ns, nhh);
        const T* x = row_ptr<const T>(x0, xst, nbb, ns, nhh);
        ngr[0] = load16(g + off0);
        nxr[0] = load16(x + off0);
        if (off1 >= 0) {
          ngr[1] = load16(g + off1);
          nxr[1] = load16(x + off1);
        }
      }
    }

    float gy[2][V];
    Vec16<T>::unpack(gr[0], gy[0]);
    Vec16<T>::unpack(gr[1], gy[1]);
    if (valid && lane_on && rotary) {
      long long r0 = 0, r1 = 0, r2 = 0;
      bool ok = true;
      token_rows(tb, b, s, r0, r1, r2, ok);
      float c[V], sn[V], lo[V], hi[V];
      cos_sin<TC, V>(tb, b, r0, r1, r2, ok, lane * V, a.sign, c, sn);
      unit_pairs<V>(gy, inter, lo, hi);
      rotate_pairs<V>(lo, hi, c, sn);
      unit_scatter<V>(lo, hi, inter, gy);
    }
    float sxx = 0.0f, sgwx = 0.0f;
    {
      float xv[2][V], wv[2][V];
      Vec16<T>::unpack(xr[0], xv[0]);
      Vec16<T>::unpack(xr[1], xv[1]);
      w0.unpack(wv[0]);
      w1.unpack(wv[1]);
#pragma unroll
      for (int p = 0; p < 2; ++p)
#pragma unroll
        for (int e = 0; e < V; ++e) {
          sxx = fmaf(xv[p][e], xv[p][e], sxx);
          sgwx = fmaf(gy[p][e] * wv[p][e], xv[p][e], sgwx);   // zeros where no item
        }
    }
    sxx = group_sum(sxx, G);
    sgwx = group_sum(sgwx, G);
    if (valid && lane_on) {
      const float rstd = rsqrtf(sxx * inv_d + n.eps);
      const float mean_dn_n = rstd * sgwx * inv_d;
      T* o = row_ptr<T>(o0, ost, b, s, hh);
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        if (p == 1 && off1 < 0) break;
        float xv[V], wv[V], prod[V];
        Vec16<T>::unpack(xr[p], xv);
        (p ? w1 : w0).unpack(wv);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float nv = xv[e] * rstd;
          prod[e] = gy[p][e] * nv;                                  // dw terms
          gy[p][e] = rstd * fmaf(-nv, mean_dn_n, gy[p][e] * wv[e]);  // dx
        }
        smem_add<V>(my_red, p ? off1 : off0, prod);
        store16(o + (p ? off1 : off0), Vec16<T>::pack(gy[p]));
      }
    }
    row = nrow;
    b = nbb;
    s = ns;
    hh = nhh;
    gr[0] = ngr[0]; gr[1] = ngr[1];
    xr[0] = nxr[0]; xr[1] = nxr[1];
  }

  __syncthreads();
  float* part = n.partial + static_cast<long long>(blockIdx.x) * a.d;
  for (int c = threadIdx.x; c < a.d; c += kRopeThreads) {
    float sum = 0.0f;
    for (int sl = 0; sl < slots; ++sl) sum += red[sl * a.d + c];
    part[c] = sum;
  }
}

// dw[c] = sum of partial[row][c] over the rows of q ([0, nbq), blockIdx.y = 0) or of k
// ([nbq, nbq + nbk), blockIdx.y = 1), in a fixed order: 32 columns x 32 row strides per block.
// nbq or nbk may be 0 (no rows): the gradient is then 0.
template <class TW>
__global__ void __launch_bounds__(1024)
qk_norm_dw_reduce(const float* __restrict__ partial, TW* __restrict__ dwq, TW* __restrict__ dwk,
                  int nbq, int nbk, int d) {
  pdl_start();
  __shared__ float sm[32][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  const int lo = blockIdx.y == 0 ? 0 : nbq;
  const int hi = blockIdx.y == 0 ? nbq : nbq + nbk;
  float sum = 0.0f;
  if (c < d)
    for (int r = lo + static_cast<int>(threadIdx.y); r < hi; r += 32)
      sum += partial[static_cast<long long>(r) * d + c];
  sm[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < d) {
    float total = 0.0f;
#pragma unroll
    for (int j = 0; j < 32; ++j) total += sm[j][threadIdx.x];
    (blockIdx.y == 0 ? dwq : dwk)[c] = from_float<TW>(total);
  }
}

}  // namespace gpuops
