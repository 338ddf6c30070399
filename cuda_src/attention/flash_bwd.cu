// Flash attention backward, SIMT fp32 (runs on sm_61 and up; fp16/bf16/fp32 storage, fp32 math).
//
// FlashAttention-2's backward without tensor cores, recomputing the probabilities from the
// forward's log-sum-exp (nothing of size S x S is stored):
//
//   flash_bwd_prep:  D_i = rowsum(dO_i * O_i) and lse2_i = lse_i * log2(e) (+inf for a row that
//                    saw no key, so that its probabilities come out 0) into an fp32 workspace;
//                    zeroes the fp32 dq accumulator.
//   flash_bwd_dkdv:  a block owns BC key rows of one (batch, kv head) and keeps their dK and dV
//                    in registers; it walks the query tiles (of every query head of its GQA
//                    group, so dK/dV need no atomics) that can see its keys, and per tile:
//                      S  = Q K^T,  dP = dO V^T                   (one pass over the head dim)
//                      P  = exp2(S * scale log2(e) - lse2),  dS = P (dP - D)   (0 where masked)
//                      dV += P^T dO,  dK += dS^T Q                (P^T, dS^T through shared)
//                      dQ += dS K * scale                         (fp32 atomics, DQ_ATOMIC)
//                    and writes dK * scale and dV once at the end.
//   flash_bwd_dq_convert: dq accumulator (fp32) -> dq in the storage type (not for fp32 storage,
//                    where the accumulator is dq itself).
//
// dQ by atomics (as FlashAttention-2) costs 5 tile products per (query tile, key tile) pair; a
// separate query-parallel dQ kernel (deterministic) would recompute S and dP: 7. The SIMT kernel
// is compute-bound, so the atomics win (benchmarks/notes_attention.md, backward section). The
// kernel keeps DQ_ATOMIC as a template flag so that such a dQ kernel can reuse it for dK/dV.
//
// Causal / window: only the query rows that can see the block's keys are visited. GENERAL =
// false: head dim == D (32, 64, 96, 128); K and V stay in shared memory for the whole block.
// GENERAL = true: any head dim; D is a chunk width, S and dP loop over the head dim in chunks
// (Q, dO, K, V chunks through shared memory, the block's own chunk loaded last so that it is
// what phases dV/dK/dQ read), and blockIdx.z picks the D columns of dK, dV, dQ this block owns
// (S and dP recomputed per chunk: correct for any head dim, not fast).
#include "attention/flash_bwd.cuh"

namespace gpuops {

// ------------------------------------------------------------------------------ preprocess

// One warp per (b, h, i) row, 4 rows per block of 128 threads.
template <class T>
__global__ void __launch_bounds__(128) flash_bwd_prep(const FlashBwdArgs a) {
  const int lane = threadIdx.x & 31;
  const long long rows = static_cast<long long>(a.batch) * a.hq * a.sq;
  const long long row = static_cast<long long>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  if (row >= rows) return;   // whole warps only: the shuffles below stay full-warp
  const long long bh = row / a.sq;
  const int i = static_cast<int>(row - bh * a.sq);
  const int b = static_cast<int>(bh / a.hq), h = static_cast<int>(bh - static_cast<long long>(b) * a.hq);
  const T* o = static_cast<const T*>(a.o) + b * a.os[0] + h * a.os[1] + i * a.os[2];
  const T* g = static_cast<const T*>(a.dout) + b * a.dos[0] + h * a.dos[1] + i * a.dos[2];
  float acc = 0.0f;
  for (int d = lane; d < a.hd; d += 32) acc = fmaf(to_float(g[d * a.dos[3]]), to_float(o[d * a.os[3]]), acc);
  if (a.dq_acc != nullptr) {
    float* z = a.dq_acc + b * a.dqas[0] + h * a.dqas[1] + i * a.dqas[2];
    for (int d = lane; d < a.hd; d += 32) z[d * a.dqas[3]] = 0.0f;
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (lane == 0) {
    a.stats[row] = acc;
    const float lse = a.lse[b * a.lses[0] + h * a.lses[1] + i * a.lses[2]];
    a.stats[rows + row] = lse == attn_neg_inf() ? -attn_neg_inf() : lse * kAttnLog2e;
  }
}

// ------------------------------------------------------------------------------ tile phases

// S += Q K^T and dP += dO V^T over one head-dim chunk in shared memory.
template <class Tile>
__device__ __forceinline__ void bwd_scores(const float* Qs, const float* dOs, const float* Ks,
                                           const float* Vs, float (&s)[Tile::RM][Tile::CN],
                                           float (&dp)[Tile::RM][Tile::CN]) {
  constexpr int RM = Tile::RM, CN = Tile::CN, TY = Tile::TY, kLd = Tile::kLd;
  const int tx = threadIdx.x & 7, ty = threadIdx.x >> 3;
#pragma unroll 2
  for (int d = 0; d < Tile::D; d += 4) {
    AttnF4 qa[RM], ga[RM];
#pragma unroll
    for (int r = 0; r < RM; ++r) {
      qa[r] = *reinterpret_cast<const AttnF4*>(Qs + (ty + TY * r) * kLd + d);
      ga[r] = *reinterpret_cast<const AttnF4*>(dOs + (ty + TY * r) * kLd + d);
    }
#pragma unroll
    for (int c = 0; c < CN; ++c) {
      const AttnF4 kb = *reinterpret_cast<const AttnF4*>(Ks + (tx + 8 * c) * kLd + d);
      const AttnF4 vb = *reinterpret_cast<const AttnF4*>(Vs + (tx + 8 * c) * kLd + d);
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        float x = s[r][c], y = dp[r][c];
        x = fmaf(qa[r].x, kb.x, x);
        y = fmaf(ga[r].x, vb.x, y);
        x = fmaf(qa[r].y, kb.y, x);
        y = fmaf(ga[r].y, vb.y, y);
        x = fmaf(qa[r].z, kb.z, x);
        y = fmaf(ga[r].z, vb.z, y);
        x = fmaf(qa[r].w, kb.w, x);
        y = fmaf(ga[r].w, vb.w, y);
        s[r][c] = x;
        dp[r][c] = y;
      }
    }
  }
}

// P = exp2(S * scale log2(e) (+ mask log2(e)) - lse2) and dS = P (dP - D), both 0 where the key
// is invisible (outside the sequence, window or causal range, or masked out by a bool mask), into
// the transposed tiles PTs / dSTs [BC][BR + 4] (PTs may be null: not wanted).
template <class Tile, class T>
__device__ __forceinline__ void bwd_probs(const FlashBwdArgs& a, int b, int h, int q0, int k0,
                                          const float* lse2s, const float* Dis,
                                          const float (&s)[Tile::RM][Tile::CN],
                                          const float (&dp)[Tile::RM][Tile::CN], float* PTs,
                                          float* dSTs) {
  constexpr int RM = Tile::RM, CN = Tile::CN, TY = Tile::TY, kLdt = Tile::kLdt;
  const int tx = threadIdx.x & 7, ty = threadIdx.x >> 3;
  const long long mbase = b * a.ms[0] + h * a.ms[1];
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    const int row = ty + TY * r, i = q0 + row;
    const float lse2 = lse2s[row], di = Dis[row];
#pragma unroll
    for (int c = 0; c < CN; ++c) {
      const int col = tx + 8 * c, j = k0 + col;
      bool keep = i < a.sq && j < a.sk && (a.left < 0 || j >= i - a.left) &&
                  (a.right < 0 || j <= i + a.right);
      float x = s[r][c] * a.scale_log2;
      if (keep && a.mask_kind != 0) {
        const long long mo = mbase + i * a.ms[2] + j * a.ms[3];
        if (a.mask_kind == 1)
          keep = static_cast<const unsigned char*>(a.mask)[mo] != 0;
        else
          x = fmaf(to_float(static_cast<const T*>(a.mask)[mo]), kAttnLog2e, x);
      }
      const float p = keep ? attn_exp2(x - lse2) : 0.0f;
      const float ds = keep ? p * (dp[r][c] - di) : 0.0f;
      if (PTs != nullptr) PTs[col * kLdt + row] = p;
      dSTs[col * kLdt + row] = ds;
    }
  }
}

// dV += P^T dO and dK += dS^T Q for the block's BC keys (registers), reading P^T / dS^T and the
// query tile from shared memory.
template <class Tile>
__device__ __forceinline__ void bwd_dkdv(const float* PTs, const float* dSTs, const float* Qs,
                                         const float* dOs, float (&dk)[Tile::KC][Tile::DK][4],
                                         float (&dv)[Tile::KC][Tile::DK][4]) {
  constexpr int KC = Tile::KC, DK = Tile::DK, TY = Tile::TY, kLd = Tile::kLd, kLdt = Tile::kLdt;
  const int tx = threadIdx.x & 7, ty = threadIdx.x >> 3;
#pragma unroll 1
  for (int r = 0; r < Tile::BR; r += 4) {
    AttnF4 p4[KC], d4[KC];
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      p4[c] = *reinterpret_cast<const AttnF4*>(PTs + (ty + TY * c) * kLdt + r);
      d4[c] = *reinterpret_cast<const AttnF4*>(dSTs + (ty + TY * c) * kLdt + r);
    }
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
#pragma unroll
      for (int k = 0; k < DK; ++k) {
        const AttnF4 gb = *reinterpret_cast<const AttnF4*>(dOs + (r + rr) * kLd + 4 * tx + 32 * k);
        const AttnF4 qb = *reinterpret_cast<const AttnF4*>(Qs + (r + rr) * kLd + 4 * tx + 32 * k);
#pragma unroll
        for (int c = 0; c < KC; ++c) {
          const float p = attn_f4_get(p4[c], rr), ds = attn_f4_get(d4[c], rr);
          dv[c][k][0] = fmaf(p, gb.x, dv[c][k][0]);
          dv[c][k][1] = fmaf(p, gb.y, dv[c][k][1]);
          dv[c][k][2] = fmaf(p, gb.z, dv[c][k][2]);
          dv[c][k][3] = fmaf(p, gb.w, dv[c][k][3]);
          dk[c][k][0] = fmaf(ds, qb.x, dk[c][k][0]);
          dk[c][k][1] = fmaf(ds, qb.y, dk[c][k][1]);
          dk[c][k][2] = fmaf(ds, qb.z, dk[c][k][2]);
          dk[c][k][3] = fmaf(ds, qb.w, dk[c][k][3]);
        }
      }
    }
  }
}

// acc += dS K for the tile's BR query rows (registers), reading dS^T and K from shared memory.
template <class Tile>
__device__ __forceinline__ void bwd_dq(const float* dSTs, const float* Ks,
                                       float (&acc)[Tile::RM][Tile::DK][4]) {
  constexpr int RM = Tile::RM, DK = Tile::DK, TY = Tile::TY, kLd = Tile::kLd, kLdt = Tile::kLdt;
  const int tx = threadIdx.x & 7, ty = threadIdx.x >> 3;
#pragma unroll 4
  for (int c = 0; c < Tile::BC; ++c) {
    float ds[RM];
#pragma unroll
    for (int r = 0; r < RM; ++r) ds[r] = dSTs[c * kLdt + ty + TY * r];
#pragma unroll
    for (int k = 0; k < DK; ++k) {
      const AttnF4 kb = *reinterpret_cast<const AttnF4*>(Ks + c * kLd + 4 * tx + 32 * k);
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        acc[r][k][0] = fmaf(ds[r], kb.x, acc[r][k][0]);
        acc[r][k][1] = fmaf(ds[r], kb.y, acc[r][k][1]);
        acc[r][k][2] = fmaf(ds[r], kb.z, acc[r][k][2]);
        acc[r][k][3] = fmaf(ds[r], kb.w, acc[r][k][3]);
      }
    }
  }
}

// ------------------------------------------------------------------------------ dK, dV (+ dQ)

// __launch_bounds__(NT, 1): up to 255 registers (capped at 128 for two 256-thread blocks per SM,
// the D = 64 tile spilled).
template <class T, int D, int BR, int BC, int NT, bool GENERAL, bool DQ_ATOMIC>
__global__ void __launch_bounds__(NT, 1) flash_bwd_dkdv(const FlashBwdArgs a) {
  using Tile = BwdTile<D, BR, BC, NT>;
  constexpr int RM = Tile::RM, CN = Tile::CN, KC = Tile::KC, DK = Tile::DK, TY = Tile::TY;
  constexpr int kLd = Tile::kLd, kLdt = Tile::kLdt;
  extern __shared__ AttnF4 flash_bwd_smem[];
  float* Ks = reinterpret_cast<float*>(flash_bwd_smem);   // [BC][D + 4]
  float* Vs = Ks + BC * kLd;                              // [BC][D + 4]
  float* Qs = Vs + BC * kLd;                              // [BR][D + 4]
  float* dOs = Qs + BR * kLd;                             // [BR][D + 4]
  float* PTs = dOs + BR * kLd;                            // [BC][BR + 4]  P^T
  float* dSTs = PTs + BC * kLdt;                          // [BC][BR + 4]  dS^T
  float* lse2s = dSTs + BC * kLdt;                        // [BR]
  float* Dis = lse2s + BR;                                // [BR]

  const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3;
  const int hkv = a.hq / a.group;
  const int b = blockIdx.x / hkv, hk = blockIdx.x - b * hkv;
  const int k0 = blockIdx.y * BC;
  const int zc = GENERAL ? blockIdx.z : 0;                // the head-dim chunk this block owns
  const int dv0 = zc * D;
  const int nchunks = GENERAL ? (a.hd + D - 1) / D : 1;
  const long long rows = static_cast<long long>(a.batch) * a.hq * a.sq;

  const T* kp = static_cast<const T*>(a.k) + b * a.ks[0] + hk * a.ks[1];
  const T* vp = static_cast<const T*>(a.v) + b * a.vs[0] + hk * a.vs[1];

  // query rows that can see any key of this tile
  const int klast = attn_imin(k0 + BC, a.sk) - 1;
  int ilo = 0, ihi = a.sq;
  if (a.right >= 0) ilo = attn_imax(0, k0 - a.right);
  if (a.left >= 0) ihi = attn_imin(a.sq, klast + a.left + 1);

  float dk[KC][DK][4], dv[KC][DK][4];
#pragma unroll
  for (int c = 0; c < KC; ++c)
#pragma unroll
    for (int k = 0; k < DK; ++k)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[c][k][e] = dv[c][k][e] = 0.0f;

  if (!GENERAL) {
    attn_load_tile<T, BC, D, NT>(Ks, kp, k0, a.sk, a.ks[2], 0, a.hd, a.ks[3], (a.vec & 1) != 0);
    attn_load_tile<T, BC, D, NT>(Vs, vp, k0, a.sk, a.vs[2], 0, a.hd, a.vs[3], (a.vec & 1) != 0);
  }

  for (int g = 0; g < a.group; ++g) {
    const int h = hk * a.group + g;
    const T* qp = static_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1];
    const T* gp = static_cast<const T*>(a.dout) + b * a.dos[0] + h * a.dos[1];
    const long long srow = (static_cast<long long>(b) * a.hq + h) * a.sq;   // stats row base

    for (int q0 = ilo; q0 < ihi; q0 += BR) {
      float s[RM][CN], dp[RM][CN];
#pragma unroll
      for (int r = 0; r < RM; ++r)
#pragma unroll
        for (int c = 0; c < CN; ++c) s[r][c] = dp[r][c] = 0.0f;

      for (int n = 0; n < nchunks; ++n) {
        const int dc = GENERAL ? (zc + 1 + n) % nchunks : 0;   // own chunk last
        __syncthreads();   // the previous tile (or chunk) is done with every shared tile
        if (GENERAL) {
          attn_load_tile<T, BC, D, NT>(Ks, kp, k0, a.sk, a.ks[2], dc * D, a.hd, a.ks[3], false);
          attn_load_tile<T, BC, D, NT>(Vs, vp, k0, a.sk, a.vs[2], dc * D, a.hd, a.vs[3], false);
        }
        attn_load_tile<T, BR, D, NT>(Qs, qp, q0, a.sq, a.qs[2], dc * D, a.hd, a.qs[3],
                                     !GENERAL && (a.vec & 1) != 0);
        attn_load_tile<T, BR, D, NT>(dOs, gp, q0, a.sq, a.dos[2], dc * D, a.hd, a.dos[3],
                                     !GENERAL && (a.vec & 1) != 0);
        if (n == 0) {
          for (int r = tid; r < BR; r += NT) {
            const int i = q0 + r;
            lse2s[r] = i < a.sq ? a.stats[rows + srow + i] : -attn_neg_inf();
            Dis[r] = i < a.sq ? a.stats[srow + i] : 0.0f;
          }
        }
        __syncthreads();
        bwd_scores<Tile>(Qs, dOs, Ks, Vs, s, dp);
      }

      // P^T, dS^T: nobody reads them before this tile's barrier below, and every thread has
      // passed the chunk loop's barrier, so the previous tile's readers are done
      bwd_probs<Tile, T>(a, b, h, q0, k0, lse2s, Dis, s, dp, PTs, dSTs);
      __syncthreads();
      bwd_dkdv<Tile>(PTs, dSTs, Qs, dOs, dk, dv);

      if (DQ_ATOMIC) {
        float acc[RM][DK][4];
#pragma unroll
        for (int r = 0; r < RM; ++r)
#pragma unroll
          for (int k = 0; k < DK; ++k) acc[r][k][0] = acc[r][k][1] = acc[r][k][2] = acc[r][k][3] = 0.0f;
        bwd_dq<Tile>(dSTs, Ks, acc);
        float* dqa = a.dq_acc + b * a.dqas[0] + h * a.dqas[1];
        // 16-byte vector reductions: whole groups of 4 columns, rows 16-byte aligned (host)
        const bool vec4 = !GENERAL && (a.vec & 2) != 0;
#pragma unroll
        for (int r = 0; r < RM; ++r) {
          const int i = q0 + ty + TY * r;
          if (i >= a.sq) continue;
#pragma unroll
          for (int k = 0; k < DK; ++k) {
            const int col = dv0 + 4 * tx + 32 * k;
            const float vals[4] = {acc[r][k][0] * a.scale, acc[r][k][1] * a.scale,
                                   acc[r][k][2] * a.scale, acc[r][k][3] * a.scale};
            float* dst = dqa + i * a.dqas[2] + col * a.dqas[3];
            if (vec4 || col + 3 < a.hd) {
              bwd_atomic_add4(dst, vals, vec4);
            } else {
#pragma unroll
              for (int e = 0; e < 4; ++e)
                if (col + e < a.hd) atomicAdd(dst + e * a.dqas[3], vals[e]);
            }
          }
        }
      }
    }
  }

  // dK = scale dS^T Q, dV = P^T dO
  T* dkp = static_cast<T*>(a.dk) + b * a.dks[0] + hk * a.dks[1];
  T* dvp = static_cast<T*>(a.dv) + b * a.dvs[0] + hk * a.dvs[1];
#pragma unroll
  for (int c = 0; c < KC; ++c) {
    const int j = k0 + ty + TY * c;
    if (j >= a.sk) continue;
#pragma unroll
    for (int k = 0; k < DK; ++k) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = dv0 + 4 * tx + 32 * k + e;
        if (col < a.hd) {
          dkp[j * a.dks[2] + col * a.dks[3]] = from_float<T>(dk[c][k][e] * a.scale);
          dvp[j * a.dvs[2] + col * a.dvs[3]] = from_float<T>(dv[c][k][e]);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------ dq conversion

// dq = dq_acc in the storage type, one warp per (b, h, i) row.
template <class T>
__global__ void __launch_bounds__(128) flash_bwd_dq_convert(const FlashBwdArgs a) {
  const int lane = threadIdx.x & 31;
  const long long rows = static_cast<long long>(a.batch) * a.hq * a.sq;
  const long long row = static_cast<long long>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  if (row >= rows) return;
  const long long bh = row / a.sq;
  const int i = static_cast<int>(row - bh * a.sq);
  const int b = static_cast<int>(bh / a.hq), h = static_cast<int>(bh - static_cast<long long>(b) * a.hq);
  const float* src = a.dq_acc + b * a.dqas[0] + h * a.dqas[1] + i * a.dqas[2];
  T* dst = static_cast<T*>(a.dq) + b * a.dqs[0] + h * a.dqs[1] + i * a.dqs[2];
  for (int d = lane; d < a.hd; d += 32) dst[d * a.dqs[3]] = from_float<T>(src[d * a.dqas[3]]);
}

}  // namespace gpuops
