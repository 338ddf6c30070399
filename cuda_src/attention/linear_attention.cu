// Linear attention, SIMT fp32 (sm_61 and up; fp16/bf16/fp32 storage, fp32 math and fp32 state).
//
//   out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps),  S_i = sum_j phi(k_j) v_j^T,  z_i = sum_j phi(k_j)
//
// with j over every key (non-causal) or j <= i (causal). Three kernels, all O(S):
//
// 1. linattn_state: the state records. One block per (chunk of key rows, batch x kv head,
//    64 feature rows, 64 value columns) computes S_c = phi(K_c)^T V_c (a [64 x 64] tile) and
//    z_c = phi(K_c)^T 1 over the chunk's rows, in 64-row tiles through shared memory. Causal:
//    chunks of 64 rows (one per query tile); non-causal: a few large chunks (enough blocks to
//    fill the device), summed by (2).
// 2. linattn_scan: per (batch x kv head), over the records in order: causal -> exclusive prefix
//    sums in place (record c = the state of all keys before chunk c); non-causal -> the total
//    into record 0. One thread per float of a record, so dk * (dv + 1) threads per head.
// 3. linattn_out: one block per (64 query rows, batch x head, 64 value columns). Loops over the
//    features in steps of 32: phi(Q) tile, the matching rows of the state record and of z
//    through shared memory; O += phi(Q) S, den += phi(Q) z. Causal adds the chunk's own keys:
//    A = phi(Q) phi(K_c)^T accumulated in the same loop, masked to j <= i (and j < Sk), then
//    den += A 1 and O += A V_c. Finally out = O / (den + eps).
//
// Thread layout of the 64 x 64 tiles (128 threads): tx = tid % 8, ty = tid / 8; a thread owns
// rows ty + 16 r (r < 4), value columns 4 tx + 32 kk .. + 3 (kk < 2) and score columns tx + 8 c
// (c < 8); the 8 lanes of a row are consecutive (row sums: 3 shuffles). Shared rows padded by 4
// floats (conflict-free LDS.128, as in flash_fwd.cu).
#include "attention/variants_common.cuh"

namespace gpuops {

template <class TK, class TV, int FM>
__global__ void __launch_bounds__(kLinThreads) linattn_state(const LinAttnArgs a) {
  constexpr int kLd = kLinCols + 4;
  __shared__ AttnF4 Ks4[(kLinRows * kLd) / 4];   // 16-byte aligned (LDS.128)
  float* Ks = reinterpret_cast<float*>(Ks4);
  __shared__ AttnF4 Vs4[(kLinRows * kLd) / 4];   // 16-byte aligned (LDS.128)
  float* Vs = reinterpret_cast<float*>(Vs4);

  const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3;
  const int bhk = blockIdx.x / a.nchunks, c = blockIdx.x - bhk * a.nchunks;
  const int b = bhk / a.hkv, hk = bhk - b * a.hkv;
  const int d0 = blockIdx.y * kLinCols, e0 = blockIdx.z * kLinCols;
  const TK* k = static_cast<const TK*>(a.k) + b * a.ks[0] + hk * a.ks[1];
  const TV* v = static_cast<const TV*>(a.v) + b * a.vs[0] + hk * a.vs[1];
  const int r0 = c * a.chunk_rows;
  const int r1 = attn_imin(a.sk, r0 + a.chunk_rows);
  const bool with_z = blockIdx.z == 0 && tid < kLinCols;   // 64 threads also sum phi(K)

  float acc[4][2][4];
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) acc[r][kk][0] = acc[r][kk][1] = acc[r][kk][2] = acc[r][kk][3] = 0.0f;
  float z = 0.0f;

  for (int j0 = r0; j0 < r1; j0 += kLinRows) {
    __syncthreads();   // the previous tile is consumed
    lin_load_tile<FM, kLinRows, kLinCols, kLd>(Ks, k, j0, r1, a.ks[2], d0, a.dk, a.ks[3]);
    lin_load_tile<kLinIdentity, kLinRows, kLinCols, kLd>(Vs, v, j0, r1, a.vs[2], e0, a.dv,
                                                         a.vs[3]);
    __syncthreads();
    if (with_z) {
#pragma unroll 8
      for (int j = 0; j < kLinRows; ++j) z += Ks[j * kLd + tid];
    }
#pragma unroll 4
    for (int j = 0; j < kLinRows; ++j) {
      float kd[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) kd[r] = Ks[j * kLd + ty + 16 * r];
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const AttnF4 vv = lin_ld4(Vs + j * kLd + 4 * tx + 32 * kk);
#pragma unroll
        for (int r = 0; r < 4; ++r) lin_axpy4(acc[r][kk], kd[r], vv);
      }
    }
  }

  float* rec = a.state + (static_cast<long long>(bhk) * a.nchunks + c) *
                             (static_cast<long long>(a.dk) * (a.dv + 1));
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int d = d0 + ty + 16 * r;
    if (d >= a.dk) continue;
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = e0 + 4 * tx + 32 * kk + e;
        if (col < a.dv) rec[static_cast<long long>(d) * a.dv + col] = acc[r][kk][e];
      }
  }
  if (with_z && d0 + tid < a.dk) rec[static_cast<long long>(a.dk) * a.dv + d0 + tid] = z;
}

// Records of one (batch x kv head) in order: total = 0 -> exclusive prefix sums in place;
// total = 1 -> their sum into record 0. blockIdx.y = batch x kv head. The loads of 8 records
// are issued before the dependent adds (latency: the chain is nchunks long).
constexpr int kLinScanThreads = 256;

__global__ void __launch_bounds__(kLinScanThreads) linattn_scan(float* state, long long rec,
                                                                int nchunks, int total) {
  const long long idx = static_cast<long long>(blockIdx.x) * kLinScanThreads + threadIdx.x;
  if (idx >= rec) return;
  float* p = state + static_cast<long long>(blockIdx.y) * nchunks * rec + idx;
  float run = 0.0f;
  int c = 0;
  for (; c + 8 <= nchunks; c += 8) {
    float t[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) t[u] = p[(c + u) * rec];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      if (!total) p[(c + u) * rec] = run;
      run += t[u];
    }
  }
  for (; c < nchunks; ++c) {
    const float t = p[c * rec];
    if (!total) p[c * rec] = run;
    run += t;
  }
  if (total) p[0] = run;
}

template <class TQK, class TV, int FM, bool CAUSAL>
__global__ void __launch_bounds__(kLinThreads) linattn_out(const LinAttnArgs a) {
  constexpr int kLdq = kLinDt + 4;       // Q, K tiles [64][32 + 4]
  constexpr int kLd = kLinCols + 4;      // state, A and V tiles [.][64 + 4]
  // Phase 1 (feature loop): Qs | Ks | Ss | zs. Phase 2 (causal): As | Vs over the same words.
  constexpr int kQ = 0, kK = kQ + kLinRows * kLdq, kS = kK + kLinRows * kLdq;
  constexpr int kZ = kS + kLinDt * kLd, kPhase1 = kZ + kLinDt;
  constexpr int kA = 0, kV = kLinRows * kLd, kPhase2 = kV + kLinRows * kLd;
  constexpr int kWords = CAUSAL ? (kPhase1 > kPhase2 ? kPhase1 : kPhase2) : kPhase1;
  __shared__ AttnF4 sm4[(kWords) / 4];   // 16-byte aligned (LDS.128)
  float* sm = reinterpret_cast<float*>(sm4);
  float* Qs = sm + kQ;
  float* Ks = sm + kK;
  float* Ss = sm + kS;
  float* zs = sm + kZ;

  const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3;
  const int tile = blockIdx.x, bh = blockIdx.y;
  const int b = bh / a.hq, h = bh - b * a.hq, hk = h / a.group;
  const int i0 = tile * kLinRows, e0 = blockIdx.z * kLinCols;
  const TQK* q = static_cast<const TQK*>(a.q) + b * a.qs[0] + h * a.qs[1];
  const TQK* k = static_cast<const TQK*>(a.k) + b * a.ks[0] + hk * a.ks[1];
  const long long rec_len = static_cast<long long>(a.dk) * (a.dv + 1);
  const float* rec = a.state +
      (static_cast<long long>(b * a.hkv + hk) * a.nchunks + (CAUSAL ? tile : 0)) * rec_len;
  const float* zrec = rec + static_cast<long long>(a.dk) * a.dv;
  const int klim = attn_imin(a.sk, i0 + kLinRows);   // this chunk's keys (causal)

  float o[4][2][4], s[4][8], den[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    den[r] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) o[r][kk][0] = o[r][kk][1] = o[r][kk][2] = o[r][kk][3] = 0.0f;
#pragma unroll
    for (int c = 0; c < 8; ++c) s[r][c] = 0.0f;
  }

  for (int d0 = 0; d0 < a.dk; d0 += kLinDt) {
    __syncthreads();   // the previous step is done with the tiles
    lin_load_tile<FM, kLinRows, kLinDt, kLdq>(Qs, q, i0, a.sq, a.qs[2], d0, a.dk, a.qs[3]);
    if (CAUSAL)
      lin_load_tile<FM, kLinRows, kLinDt, kLdq>(Ks, k, i0, klim, a.ks[2], d0, a.dk, a.ks[3]);
    for (int idx = tid; idx < kLinDt * kLinCols; idx += kLinThreads) {
      const int d = idx / kLinCols, e = idx & (kLinCols - 1);
      float val = 0.0f;
      if (d0 + d < a.dk && e0 + e < a.dv) val = rec[static_cast<long long>(d0 + d) * a.dv + e0 + e];
      Ss[d * kLd + e] = val;
    }
    if (tid < kLinDt) zs[tid] = d0 + tid < a.dk ? zrec[d0 + tid] : 0.0f;
    __syncthreads();

#pragma unroll 2
    for (int dd = 0; dd < kLinDt; dd += 4) {
      AttnF4 qa[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) qa[r] = lin_ld4(Qs + (ty + 16 * r) * kLdq + dd);
#pragma unroll
      for (int e4 = 0; e4 < 4; ++e4) {
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const AttnF4 sv = lin_ld4(Ss + (dd + e4) * kLd + 4 * tx + 32 * kk);
#pragma unroll
          for (int r = 0; r < 4; ++r) lin_axpy4(o[r][kk], lin_comp(qa[r], e4), sv);
        }
      }
      if (CAUSAL) {
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const AttnF4 kb = lin_ld4(Ks + (tx + 8 * c) * kLdq + dd);
#pragma unroll
          for (int r = 0; r < 4; ++r) s[r][c] = lin_dot4(qa[r], kb, s[r][c]);
        }
      }
    }
    // den: the 8 lanes of a row take 4 of the 32 features each (summed across lanes at the end)
    const AttnF4 z4 = lin_ld4(zs + 4 * tx);
#pragma unroll
    for (int r = 0; r < 4; ++r) den[r] = lin_dot4(lin_ld4(Qs + (ty + 16 * r) * kLdq + 4 * tx), z4, den[r]);
  }

  if (CAUSAL) {
    float* As = sm + kA;
    float* Vs = sm + kV;
    const TV* v = static_cast<const TV*>(a.v) + b * a.vs[0] + hk * a.vs[1];
    __syncthreads();   // everyone is done with Qs, Ks, Ss
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = ty + 16 * r, i = i0 + row;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const int j = i0 + tx + 8 * c;
        const float w = (j <= i && j < a.sk) ? s[r][c] : 0.0f;
        den[r] += w;
        As[row * kLd + tx + 8 * c] = w;
      }
    }
    lin_load_tile<kLinIdentity, kLinRows, kLinCols, kLd>(Vs, v, i0, klim, a.vs[2], e0, a.dv,
                                                         a.vs[3]);
    __syncthreads();
#pragma unroll 2
    for (int j = 0; j < kLinRows; j += 4) {
      AttnF4 p4[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) p4[r] = lin_ld4(As + (ty + 16 * r) * kLd + j);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const AttnF4 vv = lin_ld4(Vs + (j + jj) * kLd + 4 * tx + 32 * kk);
#pragma unroll
          for (int r = 0; r < 4; ++r) lin_axpy4(o[r][kk], lin_comp(p4[r], jj), vv);
        }
      }
    }
  }

  TV* out = static_cast<TV*>(a.o) + b * a.os[0] + h * a.os[1];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    float dn = den[r];
    dn += __shfl_xor_sync(0xffffffffu, dn, 1);
    dn += __shfl_xor_sync(0xffffffffu, dn, 2);
    dn += __shfl_xor_sync(0xffffffffu, dn, 4);
    const int i = i0 + ty + 16 * r;
    if (i >= a.sq) continue;
    const float inv = 1.0f / (dn + a.eps);
    TV* orow = out + static_cast<long long>(i) * a.os[2];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = e0 + 4 * tx + 32 * kk + e;
        if (col < a.dv) orow[static_cast<long long>(col) * a.os[3]] = from_float<TV>(o[r][kk][e] * inv);
      }
  }
}

}  // namespace gpuops
