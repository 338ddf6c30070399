// Rotary position embedding of q and k in one launch (gpuops.apply_rotary and its backward,
// apply_rotary_backward, which turns by the opposite angle: sign = -1).
//
// One work item per thread, the grid covering the items once (the elementwise family's lesson):
// an item is one rotary unit (two packs of V elements: V pairs) or one pass-through pack of one
// head of q or k. Items are numbered token-major, then head (q heads, then k heads), then unit,
// so the threads of a warp share a token and its cos/sin rows stay in L1.
//   V = 16 / sizeof(T): 16-byte loads and stores, for heads whose last dim is contiguous and
//                       aligned (host-checked: ptrs and strides multiples of V, R % 2V == 0,
//                       D % V == 0);
//   V = 1:              one element per pack, any strides.
#include "rotary/rope_common.cuh"
#include "common/pdl.cuh"

namespace gpuops {

// 5 blocks of 256 per SM (<= 48 registers, no spills on sm_61 .. sm_90): the fp16 build at 54
// registers ran 4 blocks per SM (runs 63-65: 128.5-139.6 us against bf16's 118 at 48).
template <class T, class TC, int V>
__global__ void __launch_bounds__(kRopeThreads, 5)
rope_kernel(RopeQK a, RopeTables tb) {
  pdl_start();
  const long long i = static_cast<long long>(blockIdx.x) * kRopeThreads + threadIdx.x;
  if (i >= a.total) return;
  const int units = a.r / (2 * V);
  const int per_head = units + (a.d - a.r) / V;
  long long b, s;
  unsigned rem;
  split_index(i, a.total, static_cast<unsigned>((a.hq + a.hk) * per_head), a.seq, b, s, rem);
  const int h = static_cast<int>(rem / per_head);
  const int it = static_cast<int>(rem - h * per_head);

  const bool is_q = h < a.hq;
  const int hh = is_q ? h : h - a.hq;
  const T* x = static_cast<const T*>(is_q ? a.q : a.k);
  const long long xsd = is_q ? a.q_s[3] : a.k_s[3];
  const long long osd = is_q ? a.oq_s[3] : a.ok_s[3];
  x += b * (is_q ? a.q_s[0] : a.k_s[0]) + s * (is_q ? a.q_s[1] : a.k_s[1]) +
       hh * (is_q ? a.q_s[2] : a.k_s[2]);
  // The output pointer is formed at the stores (live across the reads, it spilled at 48
  // registers: 5 blocks per SM, the occupancy this kernel is measured at).
  auto out = [&]() {
    return static_cast<T*>(is_q ? a.oq : a.ok) + b * (is_q ? a.oq_s[0] : a.ok_s[0]) +
           s * (is_q ? a.oq_s[1] : a.ok_s[1]) + hh * (is_q ? a.oq_s[2] : a.ok_s[2]);
  };

  if (it >= units) {                       // pass-through part of the head (partial rotary)
    const int off = a.r + (it - units) * V;
    copy_pack<T, V>(x, off, xsd, out(), off, osd);
    return;
  }
  const bool inter = a.interleaved != 0;
  int off0, off1;
  unit_offsets<V>(it, a.r, inter, off0, off1);
  long long r0, r1, r2;
  bool ok;
  float v[2][V], c[V], sn[V], lo[V], hi[V];
  if constexpr (V > 1) {
    // Every read of the item (q/k words, cos/sin words) leaves before any is converted: a pack
    // unpacked right after its load (the fp16 build scheduled its HADD2.F32 there, ahead of the
    // table reads' branch) makes the table reads wait for q's bytes, two round trips in series.
    // (unsigned offsets: no sign-extension words live through the reads)
    const uint4 x0 = load16(x + static_cast<unsigned>(off0));
    const uint4 x1 = load16(x + static_cast<unsigned>(off1));
    token_rows(tb, b, s, r0, r1, r2, ok);
    cos_sin<TC, V>(tb, b, r0, r1, r2, ok, it * V, a.sign, c, sn);
    Vec16<T>::unpack(x0, v[0]);
    Vec16<T>::unpack(x1, v[1]);
  } else {
    load_pack<T, V>(x, off0, xsd, v[0]);
    load_pack<T, V>(x, off1, xsd, v[1]);
    token_rows(tb, b, s, r0, r1, r2, ok);
    fetch_cos_sin<TC, V>(tb, b, r0, r1, r2, ok, it * V, a.sign, c, sn);
  }
  unit_pairs<V>(v, inter, lo, hi);
  rotate_pairs<V>(lo, hi, c, sn);
  unit_scatter<V>(lo, hi, inter, v);
  T* o = out();
  if constexpr (V > 1) {
    store16(o + static_cast<unsigned>(off0), Vec16<T>::pack(v[0]));
    store16(o + static_cast<unsigned>(off1), Vec16<T>::pack(v[1]));
  } else {
    store_pack<T, V>(o, off0, osd, v[0]);
    store_pack<T, V>(o, off1, osd, v[1]);
  }
}

}  // namespace gpuops
