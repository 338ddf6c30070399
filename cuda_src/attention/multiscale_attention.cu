// Multiscale (dilated sliding-window) attention, SIMT fp32 (sm_61 and up; fp16/bf16/fp32
// storage, fp32 math). Cost O(S * w * D): every row visits only its own <= 2w + 1 keys.
//
// Head h belongs to scale g = h / heads_per_scale with window w and dilation d: query i sees
// keys j = i + t d for integer t, |t| <= w (causal: t <= 0), 0 <= j < Sk. The rows of one residue
// rho = i mod d see only keys of the same residue, and in the decimated index (i = rho + t d) the
// pattern is a plain sliding window of radius w. So a block takes 32 consecutive decimated rows
// of one residue (blockIdx.x = rho * tiles + tile), walks the union of their keys (32 + 2w
// decimated rows) in tiles of BC through shared memory (K and V rows gathered with row stride
// d), and each row runs an online softmax over exactly its visible keys of the tile.
//
// Threads: 256 = 32 rows x 8 lanes. Lane g8 of a row holds q and the output accumulator for
// columns 4 g8 + 32 c .. + 3 (c < DPL / 4), so a head dim up to 8 DPL; the score q . k is 8
// partial dots summed by 3 shuffles. The 4 rows of a warp walk the union of their key ranges
// (so the shuffles are warp-uniform); a key outside a row's own range gets score -inf.
#include "attention/variants_common.cuh"

namespace gpuops {

constexpr int kMsThreads = 256;
constexpr int kMsRows = kMsThreads / 8;   // decimated query rows per block

template <class T, int DPL, int BC>
__global__ void __launch_bounds__(kMsThreads, 1) multiscale_attn(const MultiscaleArgs a) {
  constexpr int DW = 8 * DPL, kLd = DW + 4, NC = DPL / 4;
  static_assert(DPL % 4 == 0 && (DW & (DW - 1)) == 0, "lane width");
  __shared__ AttnF4 Ks4[(BC * kLd) / 4];   // 16-byte aligned (LDS.128)
  float* Ks = reinterpret_cast<float*>(Ks4);
  __shared__ AttnF4 Vs4[(BC * kLd) / 4];   // 16-byte aligned (LDS.128)
  float* Vs = reinterpret_cast<float*>(Vs4);

  const int tid = threadIdx.x, g8 = tid & 7, rl = tid >> 3;
  const int bh = blockIdx.y;
  const int b = bh / a.hq, h = bh - b * a.hq, hk = h / a.group;
  const int sc = h / a.heads_per_scale;
  const int w = a.window[sc], dil = a.dilation[sc];
  const int tiles = ((a.sq + dil - 1) / dil + kMsRows - 1) / kMsRows;   // per residue, at most
  const int rho = blockIdx.x / tiles, t0 = (blockIdx.x - rho * tiles) * kMsRows;
  if (rho >= dil || rho >= a.sq) return;                 // whole block: before any barrier
  const int nq = (a.sq - rho + dil - 1) / dil;           // query rows of this residue
  if (t0 >= nq) return;
  const int nk = rho < a.sk ? (a.sk - rho + dil - 1) / dil : 0;

  const T* q = static_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1];
  const T* k = static_cast<const T*>(a.k) + b * a.ks[0] + hk * a.ks[1];
  const T* v = static_cast<const T*>(a.v) + b * a.vs[0] + hk * a.vs[1];

  // this row: decimated index t, sequence index i, visible decimated keys [lo, hi]
  const int t = t0 + rl;
  const bool row_ok = t < nq;
  const long long i = rho + static_cast<long long>(t) * dil;
  int lo = attn_imax(0, t - w);
  int hi = attn_imin(nk - 1, a.causal ? t : t + w);
  if (!row_ok) {
    lo = 0x7fffffff;
    hi = -1;
  }
  // the warp's union (4 rows): the loop bounds every lane of the warp shares
  int wlo = lo, whi = hi;
  wlo = attn_imin(wlo, __shfl_xor_sync(0xffffffffu, wlo, 8));
  wlo = attn_imin(wlo, __shfl_xor_sync(0xffffffffu, wlo, 16));
  whi = attn_imax(whi, __shfl_xor_sync(0xffffffffu, whi, 8));
  whi = attn_imax(whi, __shfl_xor_sync(0xffffffffu, whi, 16));

  AttnF4 qv[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    float e4[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 4 * g8 + 32 * c + e;
      e4[e] = (row_ok && col < a.hd)
                  ? to_float(q[i * a.qs[2] + static_cast<long long>(col) * a.qs[3]]) * a.scale_log2
                  : 0.0f;
    }
    qv[c] = AttnF4{e4[0], e4[1], e4[2], e4[3]};
  }
  float o[NC][4];
#pragma unroll
  for (int c = 0; c < NC; ++c) o[c][0] = o[c][1] = o[c][2] = o[c][3] = 0.0f;
  float m = attn_neg_inf(), l = 0.0f;

  // keys any row of the block sees
  const int s_lo = attn_imax(0, t0 - w);
  const int s_hi = attn_imin(nk - 1, t0 + kMsRows - 1 + (a.causal ? 0 : w));
  for (int s0 = s_lo; s0 <= s_hi; s0 += BC) {
    __syncthreads();   // the previous tile is consumed
    for (int idx = tid; idx < BC * DW; idx += kMsThreads) {
      const int r = idx / DW, c = idx & (DW - 1);
      const int s = s0 + r;
      float kv = 0.0f, vv = 0.0f;
      if (s <= s_hi && c < a.hd) {
        const long long j = rho + static_cast<long long>(s) * dil;
        kv = to_float(k[j * a.ks[2] + static_cast<long long>(c) * a.ks[3]]);
        vv = to_float(v[j * a.vs[2] + static_cast<long long>(c) * a.vs[3]]);
      }
      Ks[r * kLd + c] = kv;
      Vs[r * kLd + c] = vv;
    }
    __syncthreads();
    const int from = attn_imax(s0, wlo), to = attn_imin(s0 + BC - 1, whi);
    for (int s = from; s <= to; ++s) {
      const float* kr = Ks + (s - s0) * kLd + 4 * g8;
      float x = 0.0f;
#pragma unroll
      for (int c = 0; c < NC; ++c) x = lin_dot4(qv[c], lin_ld4(kr + 32 * c), x);
      x += __shfl_xor_sync(0xffffffffu, x, 1);
      x += __shfl_xor_sync(0xffffffffu, x, 2);
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      if (s < lo || s > hi) x = attn_neg_inf();
      const float mnew = attn_max(m, x);
      // a row that has seen only -inf keeps m = -inf: subtract 0 instead (exp2(-inf) = 0)
      const float base = mnew == attn_neg_inf() ? 0.0f : mnew;
      const float alpha = attn_exp2(m - base), p = attn_exp2(x - base);
      m = mnew;
      l = fmaf(l, alpha, p);
      const float* vr = Vs + (s - s0) * kLd + 4 * g8;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const AttnF4 v4 = lin_ld4(vr + 32 * c);
        o[c][0] = fmaf(p, v4.x, o[c][0] * alpha);
        o[c][1] = fmaf(p, v4.y, o[c][1] * alpha);
        o[c][2] = fmaf(p, v4.z, o[c][2] * alpha);
        o[c][3] = fmaf(p, v4.w, o[c][3] * alpha);
      }
    }
  }

  if (!row_ok) return;
  const float inv = l == 0.0f ? 0.0f : 1.0f / l;   // no visible key (Sq > Sk): 0, as SDPA
  T* orow = static_cast<T*>(a.o) + b * a.os[0] + h * a.os[1] + i * a.os[2];
#pragma unroll
  for (int c = 0; c < NC; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 4 * g8 + 32 * c + e;
      if (col < a.hd) orow[static_cast<long long>(col) * a.os[3]] = from_float<T>(o[c][e] * inv);
    }
}

}  // namespace gpuops
