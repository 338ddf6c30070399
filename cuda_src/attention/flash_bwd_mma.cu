// Flash attention backward on tensor cores (variant 'mma': sm_80+, fp16/bf16 storage, fp32
// accumulation): FlashAttention-2's backward with mma.sync.aligned.m16n8k16.
//
// The preprocess (D_i = rowsum(dO_i O_i), lse2_i = lse_i log2(e), zeroed fp32 dq accumulator) and
// the dq conversion are memory-bound: flash_bwd_prep_vec / flash_bwd_dq_convert_vec below are the
// SIMT module's flash_bwd_prep / flash_bwd_dq_convert (flash_bwd.cu) with 16-byte accesses,
// taken where the rows are aligned (else the SIMT ones). The main kernel, flash_bwd_mma:
//
// A block of WARPS warps owns BC = 16 MT WARPS keys of one (batch, kv head); warp w owns keys
// 16 MT w .. 16 MT (w + 1) - 1 of them (MT m16 tiles). K and V stay in shared memory for the
// whole block; dK and dV of the warp's keys stay in fp32 registers (MT x D / 8 m16n8 fragments
// each). The block walks the query tiles of BR rows (of every query head of its GQA group, so
// dK and dV need no atomics) that can see its keys; per tile:
//
//   S^T  = K_w Q^T,  dP^T = V_w dO^T     [16 MT keys x BR queries] per warp, fp32 fragments.
//                                         Transposed (keys as rows) so that P^T and dS^T come out
//                                         of the accumulators in exactly the A-operand layout of
//                                         the next two products (the C fragment of an n8 tile
//                                         pair is the A fragment of m16n8k16): no shared-memory
//                                         round trip for P, none for dS on the dK side.
//   P^T  = exp2(S^T scale log2(e) - lse2),  dS^T = P^T (dP^T - D)   (0 where invisible/masked)
//   dV  += P^T dO,  dK += dS^T Q          dO and Q through ldmatrix.trans (rows are the k dim).
//   dS^T -> shared memory (16-bit, the rounded values the dK product used); barrier;
//   dQ   = dS K over the block's BC keys, the warps tiling [BR x D] as WM x WN (A = dS from the
//          dS^T tile by ldmatrix.trans, B = K by ldmatrix.trans), then fp32 atomics into the dq
//          accumulator (red.global.add.v2.f32 on sm_90, pairs of atomicAdd elsewhere), times
//          scale.
//
// and at the end writes dK * scale and dV (rounded to T). 2 barriers per query tile.
//
// Shared memory (16-bit tiles, rows of 16-byte chunks XOR-swizzled as the forward, attn_mma.cuh:
// every ldmatrix phase and cp.async hits 8 distinct 16-byte bank groups): K, V [BC][D], dS^T
// [BC][BR], and STAGES x (Q, dO [BR][D], lse2, D [BR] fp32). STAGES = 2: the next tile's Q, dO
// and statistics are loaded (cp.async; 4-byte copies for the statistics, whose rows need not be
// 16-byte aligned) right after the first barrier of the current tile, a whole tile ahead of
// their use. STAGES = 1: loaded after the second barrier, during the dQ phase.
//
// Masking: visibility (causal / window bounds, query and key tails) and attn_mask (MASK
// instantiations only; mask_kind 1 bool, 2 additive) are applied only on a warp's edge tiles;
// interior tiles compute p = exp2(fma(s, scale log2(e), -lse2)) straight. A warp none of whose
// keys a tile's queries can see skips its products (it writes zeros to its dS^T rows); a dQ warp
// whose rows cannot see any key of the block skips dQ.
//
// Precision: P and dS are rounded to T before the products that take them as A operands (as
// FlashAttention-2); everything else, and every accumulation, is fp32.
//
// The host (gpuops/ops/attention_backward.py) takes this kernel for fp16/bf16 on sm_80+ when the
// head dim has an instantiation, q, k, v and grad_out rows are 16-byte aligned with unit d stride
// and the tile fits the device's shared memory; otherwise the SIMT kernel. Same argument struct
// (FlashBwdArgs). Assumes (host-checked): dq_acc is the dense fp32 workspace (unit d stride), dk
// and dv rows have unit d stride and even strides (32-bit stores of element pairs).
#include "attention/attn_mma.cuh"
#include "attention/flash_bwd.cuh"
#include "common/vec.cuh"

namespace gpuops {

// The preprocess and the dq conversion with 16-byte accesses, for the tensor-core path (the host
// takes them when the rows involved are 16-byte aligned with unit d stride; else flash_bwd_prep /
// flash_bwd_dq_convert): flash_bwd.cuh, bwd_prep_vec / bwd_vec_row. Same results as the SIMT
// kernels (up to the fp32 summation order of D).
template <class T, int D>
__global__ void __launch_bounds__(128) flash_bwd_prep_vec(const FlashBwdArgs a) {
  bwd_prep_vec<T, D>(a, a.sq);
}

// dq = dq_acc in the storage type.
template <class T, int D>
__global__ void __launch_bounds__(128) flash_bwd_dq_convert_vec(const FlashBwdArgs a) {
  const long long rows = static_cast<long long>(a.batch) * a.hq * a.sq;
  int b, h, i;
  if (bwd_vec_row<D>(a, a.sq, b, h, i) >= rows) return;
  const int c = (threadIdx.x % (D / 8)) * 8;
  bwd_convert8(static_cast<T*>(a.dq) + b * a.dqs[0] + h * a.dqs[1] + i * a.dqs[2] + c,
               a.dq_acc + b * a.dqas[0] + h * a.dqas[1] + i * a.dqas[2] + c);
}

// Rows of the dQ warp grid: WM warps along the query rows x WARPS / WM along the head dim, each
// warp a (BR / WM) x (D / (WARPS / WM)) tile with both sides multiples of 16; the squarest such
// tile (fewest shared-memory bytes read per FLOP). 0 if there is none.
template <int WARPS, int BR, int D>
__host__ __device__ constexpr int bwd_dq_warp_rows() {
  int best = 0, cost = 1 << 30;
  for (int wm = 1; wm <= WARPS; wm *= 2) {
    const int wn = WARPS / wm;
    if (WARPS % wm != 0 || BR % (16 * wm) != 0 || D % (16 * wn) != 0) continue;
    if (BR / wm + D / wn < cost) {
      cost = BR / wm + D / wn;
      best = wm;
    }
  }
  return best;
}

// P^T and dS^T of an edge tile: lane (g, t) holds rows (keys) wk0 + 16 mt + g + 8 hr and columns
// (queries) q0 + 8 n + 2 t + e of the warp's S^T / dP^T fragments; on return s holds P^T and dp
// holds dS^T, both 0 where the key is invisible to the query (window / causal bounds, the key
// and query tails) or, with MASK, masked out by a bool attn_mask; an additive mask is added to the
// score. Mask entries are read only for visible pairs.
template <bool MASK, class T, int MT, int NS>
__device__ __forceinline__ void bwd_mma_edge(float (&s)[MT][NS][4], float (&dp)[MT][NS][4],
                                             const FlashBwdArgs& a, int wk0, int q0, int g, int t,
                                             long long mbase, const float* lse2s,
                                             const float* dis) {
  const int i0 = q0 + 2 * t;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int j = wk0 + 16 * mt + g + 8 * hr;
      // query i0 + c (c = 8 n + e, a constant) sees key j iff lo <= c <= hi
      const int lo = a.right >= 0 ? j - a.right - i0 : 0;
      int hi = a.sq - 1 - i0;
      if (a.left >= 0) hi = attn_imin(hi, j + a.left - i0);
      if (j >= a.sk) hi = -1;
      const long long ms2 = a.ms[2];
      const long long mrow = mbase + static_cast<long long>(j) * a.ms[3] + i0 * ms2;
#pragma unroll
      for (int n = 0; n < NS; ++n) {
        const float2 l2 = *reinterpret_cast<const float2*>(lse2s + 8 * n + 2 * t);
        const float2 di = *reinterpret_cast<const float2*>(dis + 8 * n + 2 * t);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = 8 * n + e;
          bool keep = c >= lo && c <= hi;
          float x = s[mt][n][2 * hr + e] * a.scale_log2;
          if (MASK && keep && a.mask_kind != 0) {
            const long long mo = mrow + c * ms2;
            if (a.mask_kind == 1)
              keep = static_cast<const unsigned char*>(a.mask)[mo] != 0;
            else
              x = fmaf(to_float(static_cast<const T*>(a.mask)[mo]), kAttnLog2e, x);
          }
          const float p = keep ? attn_exp2(x - (e ? l2.y : l2.x)) : 0.0f;
          const float ds = keep ? p * (dp[mt][n][2 * hr + e] - (e ? di.y : di.x)) : 0.0f;
          s[mt][n][2 * hr + e] = p;
          dp[mt][n][2 * hr + e] = ds;
        }
      }
    }
  }
}

template <class T, int D, int WARPS, int MT, int BR, int STAGES, int MINB, bool MASK>
__global__ void __launch_bounds__(WARPS * 32, MINB) flash_bwd_mma(const FlashBwdArgs a) {
  constexpr int kThreads = WARPS * 32, BC = 16 * MT * WARPS;
  constexpr int KD = D / 16;    // k steps of S^T, dP^T (over the head dim)
  constexpr int NS = BR / 8;    // n8 tiles of S^T, dP^T (queries)
  constexpr int KP = BR / 16;   // k steps of dV, dK (over the tile's queries)
  constexpr int NO = D / 8;     // n8 tiles of dK, dV
  constexpr int WM = bwd_dq_warp_rows<WARPS, BR, D>(), WN = WARPS / (WM > 0 ? WM : 1);
  constexpr int RQ = BR / (WM > 0 ? WM : 1), CQ = D / WN;   // the dQ warp tile
  constexpr int MQ = RQ / 16, NQ = CQ / 8, KQ = BC / 16;
  static_assert(sizeof(T) == 2 && D % 32 == 0 && BR % 32 == 0 && WM > 0, "tile shape");
  static_assert(STAGES == 1 || STAGES == 2, "one or two Q/dO buffers");
  constexpr bool FRESH = true;
  constexpr int kKV = BC * D * 2;          // bytes of the K tile (and of the V tile)
  constexpr int kQ = BR * D * 2;           // one Q (or dO) tile
  constexpr int kDS = BC * BR * 2;         // dS^T
  constexpr int kStage = 2 * kQ + 8 * BR;  // Q, dO, lse2 [BR], D [BR]
  extern __shared__ AttnF4 flash_bwd_mma_smem[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(flash_bwd_mma_smem);
  const unsigned int k_s = smem_addr(smem), v_s = k_s + kKV, ds_s = v_s + kKV;
  const unsigned int st_s = ds_s + kDS;    // stage s at st_s + s kStage
  unsigned char* ds_p = smem + 2 * kKV;
  const unsigned char* st_p = smem + 2 * kKV + kDS;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int hkv = a.hq / a.group;
  const int b = blockIdx.x / hkv, hk = blockIdx.x - b * hkv;
  const int k0 = blockIdx.y * BC;
  const int wk0 = k0 + warp * 16 * MT, wk1 = wk0 + 16 * MT - 1;   // the warp's keys
  const long long rows = static_cast<long long>(a.batch) * a.hq * a.sq;

  const T* kp = static_cast<const T*>(a.k) + b * a.ks[0] + hk * a.ks[1];
  const T* vp = static_cast<const T*>(a.v) + b * a.vs[0] + hk * a.vs[1];

  // query rows that can see any key of this block, in tiles of BR (per head of the group)
  const int klast = attn_imin(k0 + BC, a.sk) - 1;
  int ilo = 0, ihi = a.sq;
  if (a.right >= 0) ilo = attn_imax(0, k0 - a.right);
  if (a.left >= 0) ihi = attn_imin(a.sq, klast + a.left + 1);
  const int ntq = ihi > ilo ? (ihi - ilo + BR - 1) / BR : 0;
  const int total = a.group * ntq;

  // Q, dO rows and their lse2, D of tile `it` (head it / ntq of the group) -> stage st
  auto load_tile = [&](int it, int st) {
    const int gi = it / ntq, q0 = ilo + (it - gi * ntq) * BR, h = hk * a.group + gi;
    const unsigned int base = st_s + st * kStage;
    attn_tile_async<T, BR, D, kThreads>(
        base, static_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1], q0, a.sq, a.qs[2]);
    attn_tile_async<T, BR, D, kThreads>(
        base + kQ, static_cast<const T*>(a.dout) + b * a.dos[0] + h * a.dos[1], q0, a.sq,
        a.dos[2]);
    const long long srow = (static_cast<long long>(b) * a.hq + h) * a.sq;
    for (int r = tid; r < 2 * BR; r += kThreads) {
      const int i = q0 + (r < BR ? r : r - BR);
      const bool in = i < a.sq;
      const float* src = a.stats + (r < BR ? rows : 0) + srow + i;   // [lse2 BR][D BR]
      cp_async4(base + 2 * kQ + 4 * r, in ? src : a.stats, in ? 4 : 0);
    }
  };

  attn_tile_async<T, BC, D, kThreads>(k_s, kp, k0, a.sk, a.ks[2]);
  attn_tile_async<T, BC, D, kThreads>(v_s, vp, k0, a.sk, a.vs[2]);
  if (total > 0) load_tile(0, 0);
  cp_async_commit();

  float dk[MT][NO][4], dv[MT][NO][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[mt][n][e] = dv[mt][n][e] = 0.0f;

  // ldmatrix row addresses, lane l giving a row of matrix i = l / 8:
  //  A (K, V rows of the warp; m = keys, k = head dim): rows +8 (i & 1), chunk +(i >> 1)
  //  B (Q, dO rows; n = queries, k = head dim) and A^T (dS^T rows = keys = k, m = queries):
  //    rows +8 (i >> 1), chunk +(i & 1)
  //  B^T (dO, Q rows = queries = k, n = head dim; K rows = keys = k for dQ): rows +8 (i & 1),
  //    chunk +(i >> 1)
  const int a_row = warp * 16 * MT + (lane & 7) + ((lane >> 3) & 1) * 8, a_chunk = lane >> 4;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_chunk = (lane >> 3) & 1;
  const int t_row = (lane & 7) + ((lane >> 3) & 1) * 8, t_chunk = lane >> 4;
  const int wm = warp % WM, wn = warp / WM;   // the dQ warp tile: rows wm RQ, columns wn CQ
  const long long mbase_b = b * a.ms[0];

  for (int it = 0; it < total; ++it) {
    const int st = STAGES == 2 ? (it & 1) : 0;
    cp_async_wait<0>();
    // tile it landed; every warp is done with tile it - 1 (its stage and dS^T)
    __syncthreads();
    if (STAGES == 2 && it + 1 < total) {
      load_tile(it + 1, (it + 1) & 1);
      cp_async_commit();
    }
    const int gi = it / ntq, q0 = ilo + (it - gi * ntq) * BR, h = hk * a.group + gi;
    const int q1 = q0 + BR - 1;
    const unsigned int q_t = st_s + st * kStage, do_t = q_t + kQ;
    const float* lse2s = reinterpret_cast<const float*>(st_p + st * kStage + 2 * kQ);
    const float* dis = lse2s + BR;

    // can any query of the tile see a key of this warp?
    const bool active = wk0 < a.sk && q0 < a.sq && (a.right < 0 || wk0 <= q1 + a.right) &&
                        (a.left < 0 || wk1 >= q0 - a.left);
    if (active) {
      float s[MT][NS][4], dp[MT][NS][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][n][e] = dp[mt][n][e] = 0.0f;

      // S^T = K_w Q^T and dP^T = V_w dO^T
      const int a_off = attn_swz_tile<D, FRESH>(a_row, a_chunk);
      const int b_off = attn_swz_tile<D, FRESH>(b_row, b_chunk);
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        unsigned int kf[MT][4], vf[MT][4];
        const int ak = attn_swz_k<D>(a_off, a_row, a_chunk, kk);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ldmatrix_x4(kf[mt], k_s + mt * 16 * D * 2 + ak);
          ldmatrix_x4(vf[mt], v_s + mt * 16 * D * 2 + ak);
        }
        const int bk = attn_swz_k<D>(b_off, b_row, b_chunk, kk);
#pragma unroll
        for (int np = 0; np < NS / 2; ++np) {
          unsigned int qb[4], gb[4];
          ldmatrix_x4(qb, q_t + np * 16 * D * 2 + bk);
          ldmatrix_x4(gb, do_t + np * 16 * D * 2 + bk);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Mma<T>::run(s[mt][2 * np], kf[mt], qb[0], qb[1]);
            Mma<T>::run(s[mt][2 * np + 1], kf[mt], qb[2], qb[3]);
            Mma<T>::run(dp[mt][2 * np], vf[mt], gb[0], gb[1]);
            Mma<T>::run(dp[mt][2 * np + 1], vf[mt], gb[2], gb[3]);
          }
        }
      }

      // P^T, dS^T. Edge tiles: some pair of the warp's keys and the tile's queries is hidden
      // (window / causal borders, the key or query tail) or there is an attn_mask.
      const bool edge = (MASK && a.mask_kind != 0) || wk1 >= a.sk || q1 >= a.sq ||
                        (a.left >= 0 && q1 > wk0 + a.left) ||
                        (a.right >= 0 && wk1 > q0 + a.right);
      if (edge) {
        bwd_mma_edge<MASK, T, MT, NS>(s, dp, a, wk0, q0, g, t, mbase_b + h * a.ms[1], lse2s,
                                      dis);
      } else {
#pragma unroll
        for (int n = 0; n < NS; ++n) {
          const float2 l2 = *reinterpret_cast<const float2*>(lse2s + 8 * n + 2 * t);
          const float2 di = *reinterpret_cast<const float2*>(dis + 8 * n + 2 * t);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float p = attn_exp2(fmaf(s[mt][n][e], a.scale_log2, (e & 1) ? -l2.y : -l2.x));
              dp[mt][n][e] = p * (dp[mt][n][e] - ((e & 1) ? di.y : di.x));
              s[mt][n][e] = p;
            }
        }
      }

      // P^T, dS^T as m16n8k16 A fragments (keys x queries)
      unsigned int pf[MT][KP][4], sf[MT][KP][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kp = 0; kp < KP; ++kp) {
          pf[mt][kp][0] = pack_b16x2<T>(s[mt][2 * kp][0], s[mt][2 * kp][1]);
          pf[mt][kp][1] = pack_b16x2<T>(s[mt][2 * kp][2], s[mt][2 * kp][3]);
          pf[mt][kp][2] = pack_b16x2<T>(s[mt][2 * kp + 1][0], s[mt][2 * kp + 1][1]);
          pf[mt][kp][3] = pack_b16x2<T>(s[mt][2 * kp + 1][2], s[mt][2 * kp + 1][3]);
          sf[mt][kp][0] = pack_b16x2<T>(dp[mt][2 * kp][0], dp[mt][2 * kp][1]);
          sf[mt][kp][1] = pack_b16x2<T>(dp[mt][2 * kp][2], dp[mt][2 * kp][3]);
          sf[mt][kp][2] = pack_b16x2<T>(dp[mt][2 * kp + 1][0], dp[mt][2 * kp + 1][1]);
          sf[mt][kp][3] = pack_b16x2<T>(dp[mt][2 * kp + 1][2], dp[mt][2 * kp + 1][3]);
        }

      // dV += P^T dO, dK += dS^T Q (dO, Q through ldmatrix.trans)
      const int t_off = attn_swz_tile<D, FRESH>(t_row, t_chunk);
#pragma unroll
      for (int kp = 0; kp < KP; ++kp) {
#pragma unroll
        for (int dq = 0; dq < NO / 2; ++dq) {
          unsigned int gb[4], qb[4];
          const int off = kp * 16 * D * 2 + attn_swz_k<D>(t_off, t_row, t_chunk, dq);
          ldmatrix_x4_trans(gb, do_t + off);
          ldmatrix_x4_trans(qb, q_t + off);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Mma<T>::run(dv[mt][2 * dq], pf[mt][kp], gb[0], gb[1]);
            Mma<T>::run(dv[mt][2 * dq + 1], pf[mt][kp], gb[2], gb[3]);
            Mma<T>::run(dk[mt][2 * dq], sf[mt][kp], qb[0], qb[1]);
            Mma<T>::run(dk[mt][2 * dq + 1], sf[mt][kp], qb[2], qb[3]);
          }
        }
      }

      // dS^T -> shared memory for dQ: word (row g (+8), queries 16 kp + 2t (+8)) of each tile
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kp = 0; kp < KP; ++kp)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = warp * 16 * MT + 16 * mt + g + 8 * (e & 1);
            *reinterpret_cast<unsigned int*>(ds_p + attn_swz<BR>(r, 2 * kp + (e >> 1)) + 4 * t) =
                sf[mt][kp][e];
          }
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kp = 0; kp < KP; ++kp)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = warp * 16 * MT + 16 * mt + g + 8 * (e & 1);
            *reinterpret_cast<unsigned int*>(ds_p + attn_swz<BR>(r, 2 * kp + (e >> 1)) + 4 * t) =
                0u;
          }
    }

    __syncthreads();   // dS^T complete; every warp is done with this stage's Q and dO
    if (STAGES == 1 && it + 1 < total) {
      load_tile(it + 1, 0);
      cp_async_commit();
    }

    // dQ += scale dS K for the warp's RQ x CQ tile of [BR x D]
    const int r0 = q0 + wm * RQ;
    const bool dq_active = r0 < a.sq && (a.right < 0 || k0 <= r0 + RQ - 1 + a.right) &&
                           (a.left < 0 || klast >= r0 - a.left);
    if (dq_active) {
      float acc[MQ][NQ][4];
#pragma unroll
      for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
        for (int n = 0; n < NQ; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mq][n][e] = 0.0f;
      const int s_off = attn_swz_tile<BR, FRESH>(b_row, b_chunk);
      const int k_off = attn_swz_tile<D, FRESH>(t_row, t_chunk);
#pragma unroll
      for (int kk = 0; kk < KQ; ++kk) {
        unsigned int af[MQ][4];
#pragma unroll
        for (int mq = 0; mq < MQ; ++mq)
          ldmatrix_x4_trans(af[mq], ds_s + kk * 16 * BR * 2 +
                                        attn_swz_k<BR>(s_off, b_row, b_chunk, wm * MQ + mq));
#pragma unroll
        for (int dq = 0; dq < NQ / 2; ++dq) {
          unsigned int kb[4];
          ldmatrix_x4_trans(kb, k_s + kk * 16 * D * 2 +
                                    attn_swz_k<D>(k_off, t_row, t_chunk, wn * (CQ / 16) + dq));
#pragma unroll
          for (int mq = 0; mq < MQ; ++mq) {
            Mma<T>::run(acc[mq][2 * dq], af[mq], kb[0], kb[1]);
            Mma<T>::run(acc[mq][2 * dq + 1], af[mq], kb[2], kb[3]);
          }
        }
      }
      float* dqa = a.dq_acc + b * a.dqas[0] + h * a.dqas[1] + wn * CQ + 2 * t;
      const bool vec2 = (a.vec & 2) != 0;
#pragma unroll
      for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int i = r0 + 16 * mq + g + 8 * hr;
          if (i >= a.sq) continue;
          float* row = dqa + i * a.dqas[2];
#pragma unroll
          for (int n = 0; n < NQ; ++n)
            bwd_atomic_add2(row + 8 * n, acc[mq][n][2 * hr] * a.scale,
                            acc[mq][n][2 * hr + 1] * a.scale, vec2);
        }
    }
  }
  cp_async_wait<0>();   // nothing left in flight at exit (total = 0: the K and V loads)

  // dK = scale dS^T Q, dV = P^T dO: element pairs (key j, columns 8 n + 2 t, + 1)
  T* dkp = static_cast<T*>(a.dk) + b * a.dks[0] + hk * a.dks[1] + 2 * t;
  T* dvp = static_cast<T*>(a.dv) + b * a.dvs[0] + hk * a.dvs[1] + 2 * t;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int j = wk0 + 16 * mt + g + 8 * hr;
      if (j >= a.sk) continue;
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        *reinterpret_cast<unsigned int*>(dkp + j * a.dks[2] + 8 * n) =
            pack_b16x2<T>(dk[mt][n][2 * hr] * a.scale, dk[mt][n][2 * hr + 1] * a.scale);
        *reinterpret_cast<unsigned int*>(dvp + j * a.dvs[2] + 8 * n) =
            pack_b16x2<T>(dv[mt][n][2 * hr], dv[mt][n][2 * hr + 1]);
      }
    }
}

}  // namespace gpuops
