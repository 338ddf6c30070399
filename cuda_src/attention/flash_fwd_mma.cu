// Flash attention forward on tensor cores (variant 'mma': sm_80+, fp16/bf16 storage, fp32
// accumulation): FlashAttention-2's forward with mma.sync.aligned.m16n8k16.
//
// A block of WARPS warps owns BR = 16 * MT * WARPS query rows of one (batch, head); warp w owns
// rows 16 MT w .. 16 MT (w + 1) - 1 (MT m16 tiles). It walks the visible keys in tiles of BC rows:
//   * Q [BR][D], K [BC][D], V [BC][D] in shared memory in the storage dtype, rows of 16-byte
//     chunks XOR-swizzled (attn_swz) so every ldmatrix phase and every cp.async hits 8 distinct
//     16-byte bank groups; loaded by cp.async (16 bytes per thread, no registers), rows past the
//     sequence zero-filled. STAGES = 1: one buffer each, overlapped as in FlashAttention-2: the
//     load of V_j runs during S = Q K_j^T and the softmax, the load of K_{j+1} during
//     O += P V_j; two barriers per key tile. STAGES = 2: K and V double-buffered, K_{j+1} and
//     V_{j+1} issued right after the one barrier of tile j, a whole tile ahead of their use.
//   * QREG: the warp's Q fragments are loaded once (ldmatrix) and stay in registers; otherwise
//     (big head dims or MT = 2, where registers go to the accumulators) they are re-read from
//     shared memory at every key tile.
//   * S = Q K^T: A = Q (ldmatrix), B = K rows (ldmatrix, non-transposed: a K row is a column of
//     K^T with k contiguous), fp32 accumulators in registers: lane (g, t) holds rows g, g + 8 of
//     each m16 tile and columns 2t, 2t + 1 of each n8 tile.
//   * Online softmax in the log2 domain (attn_common.cuh): scores * scale * log2(e), visibility
//     (window/causal, key tail) and attn_mask applied only on tiles that need them (edge tiles:
//     the diagonal of a causal mask, a window's borders, the last key tile, every tile with a
//     mask); row max and sum over the 4 lanes of a quad (2 shuffles); a row that has seen only
//     -inf subtracts 0 (exp2(-inf) = 0, no NaN); NaN scores keep NaN (attn_max: FMNMX.NAN). On
//     tiles without masking (and a positive scale) the row max is taken on the raw scores and
//     the scale folded into the exponent: p = exp2(fma(s, scale_log2, -m)), one FFMA per score.
//     The edge/fold decision is one branch per warp and tile; the softmax after it is
//     straight-line code over all 2 MT rows of a lane (pairwise max and sum trees), so the rows'
//     dependency chains (max, 2 shuffles, exp2, sum) overlap instead of running one after the
//     other (the per-row branches of the first version serialized them: ~1200 cycles a tile).
//   * MASK: attn_mask support compiled in (the host picks MASK = true only for masked calls; the
//     MASK = false instantiations ignore mask_kind and have no mask loads).
//   * P = exp2(s - m) rounded to the storage dtype in registers is directly the A operand of
//     O += P V (the m16n8 accumulator layout of two n8 tiles is the m16n8k16 A layout); V
//     through ldmatrix.trans (V rows are k-major for P V). l sums the fp32 p (FlashAttention's
//     convention): the output is off by at most the rounding of P (2^-8 relative for bf16,
//     2^-11 for fp16), on top of the output's own rounding.
//   * Key tiles no row of the block can see (causal, windows) are not visited; a warp whose rows
//     cannot see any key of a visited tile skips its mma work there (still loads and syncs).
//   * Epilogue: O / l rounded to T and staged through the warp's own Q rows in shared memory
//     (swizzled), then written with 16-byte stores; lse = (m + log2 l) ln 2 when requested.
//     Rows that see no key: 0 and lse -inf.
//
// The host (gpuops/ops/attention.py) takes this kernel for fp16/bf16 on sm_80+ when the head dim
// has an instantiation and q, k, v and out rows are 16-byte aligned with unit d stride; otherwise
// the SIMT kernel (flash_fwd.cu). Same argument struct (FlashFwdArgs); `vec` is always 1 here.
//
// Varlen, block sparsity and rotary embedding of q and k: bits of EXTRAS (0: none, the dense
// kernel), helpers in flash_mma_extras.cuh, called from the hooks marked [extras] below (the
// sequence's rows and diagonal before the key loop; which key tiles are visited and loaded; the
// per-score block test on edge tiles; RoPE of Q before the loop and of each landed K tile, in
// shared memory, or of Q alone when a pre-pass rotated K: kMmaRotaryQ; the lse strides). Each
// hook is `if constexpr` or folds to the dense expression for EXTRAS = 0: the dense
// instantiations compile to the same SASS as without the hooks.
#include "attention/attn_mma.cuh"
#include "attention/flash_mma_extras.cuh"
#include "common/opaque.cuh"
#include "common/vec.cuh"

namespace gpuops {

// Scores of one key tile on an edge tile (lane (g, t), rows g, g + 8 of the warp's m16 tile mt,
// first row wq0, first key k0): scaled to the log2 domain, hidden ones (-inf) by visibility
// (window/causal bounds, the key tail, rows past the queries) and, with MASK, by attn_mask
// (a.mask_kind 1: bool, 2: additive, T). Mask entries are read only for visible scores (the
// branch keeps the reads in bounds; clamped branch-free reads let the compiler hoist all of them
// at once: 64+ registers, spills). [extras] SPARSE: on a tile that mixes on and off blocks for
// the warp's rows (mixed), bit 16 hr + 2 n + e of bits[mt] (mma_blocks_on) keeps the score.
template <bool MASK, class T, int BC, bool SPARSE, int MT, int NS>
__device__ __forceinline__ void attn_mma_hide(float (&s)[MT][NS][4], const FlashFwdArgs& a,
                                              int wq0, int k0, int g, int t, long long mbase,
                                              bool mixed, const unsigned (&bits)[MT]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int i = wq0 + mt * 16 + g + 8 * hr;
      // key k0 + 2t + c (c = 8n + e, a constant) is visible iff lo <= c <= hi
      int lo = -2 * t, hi = a.sk - 1 - k0 - 2 * t;
      if (a.left >= 0) lo = attn_imax(lo, i - a.left - k0 - 2 * t);
      if (a.right >= 0) hi = attn_imin(hi, i + a.right - k0 - 2 * t);
      if (i >= a.sq) hi = -1 - BC;
      // attn_mask: walked by pointer from column k0 + 2t (8 columns per n8 tile)
      const long long ms3 = a.ms[3];
      const long long mrow = mbase + i * a.ms[2] + (k0 + 2 * t) * ms3;
#pragma unroll
      for (int n = 0; n < NS; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = 8 * n + e;
          bool keep = c >= lo && c <= hi;
          if (SPARSE && mixed)   // [extras] block sparsity
            keep = keep && ((bits[mt] >> (16 * hr + 2 * n + e)) & 1u);
          float x = s[mt][n][2 * hr + e] * a.scale_log2;
          if (MASK && keep && a.mask_kind != 0) {
            const long long mo = mrow + c * ms3;
            if (a.mask_kind == 1)
              keep = static_cast<const unsigned char*>(a.mask)[mo] != 0;
            else
              x = fmaf(to_float(static_cast<const T*>(a.mask)[mo]), kAttnLog2e, x);
          }
          s[mt][n][2 * hr + e] = keep ? x : attn_neg_inf();
        }
      }
    }
  }
}

template <class T, int D, int WARPS, int MT, int BC, bool QREG, int MINB, int STAGES, bool MASK,
          int EXTRAS = kMmaPlain>
__global__ void __launch_bounds__(WARPS * 32, MINB) flash_fwd_mma(const FlashFwdArgs args) {
  constexpr bool SPARSE = EXTRAS & kMmaSparse, ROTARY = EXTRAS & kMmaRotary;
  constexpr bool ROTARY_Q = ROTARY || (EXTRAS & kMmaRotaryQ);   // Q rotated before the loop
  constexpr bool VARLEN = EXTRAS & kMmaVarlen;
  constexpr int kThreads = WARPS * 32, BR = 16 * MT * WARPS;
  constexpr int KD = D / 16;    // mma k steps of Q K^T
  constexpr int NO = D / 8;     // n8 tiles of O
  constexpr int NS = BC / 8;    // n8 tiles of S
  constexpr int KP = BC / 16;   // mma k steps of P V
  constexpr int kTileBytes = BC * D * 2;   // one K or V tile
  static_assert(sizeof(T) == 2 && D % 32 == 0 && BC % 16 == 0, "tile shape");
  static_assert(STAGES == 1 || STAGES == 2, "one or two K/V buffers");
  extern __shared__ AttnF4 flash_mma_smem[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(flash_mma_smem);
  const unsigned int q_s = smem_addr(smem);          // [BR][D]; the output staging at the end
  const unsigned int kv_s = q_s + BR * D * 2;        // stage s: K [BC][D] at kv_s + 2 s kTileBytes,
                                                     // V [BC][D] right after it

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int bh = blockIdx.x;
  const int b = bh / args.hq, h = bh - b * args.hq, hk = h / args.group;
  // [extras] varlen: `a` is a copy of the arguments narrowed to the block's sequence (a block
  // past its end exits), query rows shifted by the bottom-right diagonal (flash_mma_extras.cuh).
  // Otherwise `a` is the kernel parameter itself (a copy, even one never written, changes the
  // dense kernel's code), shift 0 and sq_real = sq.
  FlashFwdArgs narrowed;
  int shift = 0, sq_real = args.sq;
  if constexpr (VARLEN) {
    narrowed = args;
    if (!mma_sequence<T>(narrowed, b, (gridDim.y - 1 - blockIdx.y) * BR, shift, sq_real)) return;
  }
  const FlashFwdArgs& a = VARLEN ? narrowed : args;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * BR + shift;  // the longest causal rows first
  const int wr0 = warp * 16 * MT;                      // the warp's first row in the tile
  const int wq0 = q0 + wr0, wq1 = wq0 + 16 * MT - 1;   // its first and last query

  const T* q = static_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1];
  const T* k = static_cast<const T*>(a.k) + b * a.ks[0] + hk * a.ks[1];
  const T* v = static_cast<const T*>(a.v) + b * a.vs[0] + hk * a.vs[1];
  const long long mbase = b * a.ms[0] + h * a.ms[1];
  // [extras] block sparsity: this (batch, head)'s block mask
  const unsigned char* bm = SPARSE ? a.block_mask + b * a.bms[0] + h * a.bms[1] : nullptr;

  // keys any row of this block may see
  const int qlast = attn_imin(q0 + BR, a.sq) - 1;
  int jlo = 0, jhi = a.sk;
  if (a.left >= 0) jlo = attn_imax(0, q0 - a.left);
  if (a.right >= 0) jhi = attn_imin(a.sk, qlast + a.right + 1);
  const int ntiles = jhi > jlo ? (jhi - jlo + BC - 1) / BC : 0;
  // [extras] block sparsity: the first key tile with a block on (ntiles if none); dense: 0
  const int it0 = mma_on_tile<SPARSE, BC>(a, bm, 0, ntiles, jlo, jhi, q0 - shift, qlast - shift);

  float o[MT][NO][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m[mt][0] = m[mt][1] = attn_neg_inf();
    l[mt][0] = l[mt][1] = 0.0f;
#pragma unroll
    for (int n = 0; n < NO; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
  }
  unsigned int qf[QREG ? MT : 1][QREG ? KD : 1][4];

  if (it0 < ntiles) {
    const int j0 = jlo + it0 * BC;
    attn_tile_async<T, BR, D, kThreads>(q_s, q, q0, a.sq, a.qs[2]);
    attn_tile_async<T, BC, D, kThreads>(kv_s, k, j0, a.sk, a.ks[2]);
    if (STAGES == 2) attn_tile_async<T, BC, D, kThreads>(kv_s + kTileBytes, v, j0, a.sk, a.vs[2]);
    cp_async_commit();
    if constexpr (ROTARY_Q) {   // [extras] rotary: RoPE of Q in place once landed, before the loop
      cp_async_wait<0>();
      __syncthreads();
      mma_rope_tile<T, BR, D, kThreads>(smem, a, q0 - shift, sq_real);
    }
  }

  // ldmatrix row addresses (constant over the key loop). A (Q): matrix i = lane / 8 is rows
  // +8 (i & 1), k +8 (i >> 1). B (K, n8 tiles 2np, 2np + 1): matrix i is keys +8 (i >> 1), k +8
  // (i & 1). B (V, .trans, n8 tiles 2dp, 2dp + 1): matrix i is keys +8 (i & 1), dims +8 (i >> 1).
  const int a_row = wr0 + (lane & 7) + ((lane >> 3) & 1) * 8, a_chunk = lane >> 4;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_chunk = (lane >> 3) & 1;
  const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8, v_chunk = lane >> 4;

  // [extras] block sparsity: the loop visits tiles it0, then next = the following tile with a
  // block on (dense: it + 1); with two stages the buffers alternate per visited tile (slot),
  // not per tile index.
  int slot = 0;
  for (int it = it0, next = it0 + 1; it < ntiles; it = next) {
    const int k0 = jlo + it * BC;
    const int buf = SPARSE ? slot : (it & 1);
    const unsigned int k_t = kv_s + (STAGES == 2 ? buf * 2 * kTileBytes : 0);
    const unsigned int v_t = k_t + kTileBytes;
    cp_async_wait<0>();
    // STAGES 1: K_it (and Q) landed; every warp is done with V_{it-1}. STAGES 2: K_it and V_it
    // landed; every warp is done with tile it - 1, whose buffers take tile it + 1 now.
    __syncthreads();
    if (STAGES == 1) {
      attn_tile_async<T, BC, D, kThreads>(v_t, v, k0, a.sk, a.vs[2]);
      cp_async_commit();
    } else {
      next = mma_on_tile<SPARSE, BC>(a, bm, it + 1, ntiles, jlo, jhi, q0 - shift, qlast - shift);
      if (next < ntiles) {
        const unsigned int n_t = kv_s + (SPARSE ? buf ^ 1 : (it + 1) & 1) * 2 * kTileBytes;
        const int n0 = SPARSE ? jlo + next * BC : k0 + BC;
        attn_tile_async<T, BC, D, kThreads>(n_t, k, n0, a.sk, a.ks[2]);
        attn_tile_async<T, BC, D, kThreads>(n_t + kTileBytes, v, n0, a.sk, a.vs[2]);
        cp_async_commit();
      }
    }
    // [extras] rotary (in-loop form): RoPE of the landed K tile in place (Q's, done before the
    // loop, was published by the loop's first barrier above). kMmaRotaryQ: K came rotated.
    if constexpr (ROTARY) {
      mma_rope_tile<T, BC, D, kThreads>(smem + (k_t - q_s), a, k0, a.sk);
      __syncthreads();
    }

    const int a_off = attn_swz_tile<D, (MT > 1)>(a_row, a_chunk);
    if (QREG && it == it0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < KD; ++kk)
          ldmatrix_x4(qf[QREG ? mt : 0][QREG ? kk : 0],
                      q_s + mt * 16 * D * 2 + attn_swz_k<D>(a_off, a_row, a_chunk, kk));
    }

    // [extras] block sparsity for the warp's rows: blocks all off (the tile is skipped as an
    // invisible one), or on and off (one bit per score, applied on the edge path)
    bool sp_on = true, sp_mixed = false;
    unsigned sp_bits[MT];
    if constexpr (SPARSE) {
      if (wq0 < a.sq) {
        sp_on = attn_tile_on(bm, a.bms[2], a.bms[3], a.block_size, wq0 - shift,
                             attn_imin(wq1, a.sq - 1) - shift, k0, attn_imin(k0 + BC, jhi),
                             &sp_mixed);
        if (sp_on && sp_mixed)
          mma_blocks_on<MT, NS>(sp_bits, a, bm, wq0 + g - shift, a.sq - 1 - shift, k0 + 2 * t,
                                attn_imin(k0 + BC, jhi) - 1);
      }
    }
    // Can any row of this warp see a key of this tile? (Conservative: skips only when none can.)
    const bool active = sp_on && wq0 < a.sq && (a.right < 0 || k0 <= wq1 + a.right) &&
                        (a.left < 0 || k0 + BC - 1 >= wq0 - a.left);
    unsigned int pf[MT][KP][4];   // P as m16n8k16 A fragments
    if (active) {
      float s[MT][NS][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NS; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;

      // S = Q K^T
      const int b_off = attn_swz_tile<D, (MT > 1)>(b_row, b_chunk);
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        unsigned int af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (QREG) {
#pragma unroll
            for (int e = 0; e < 4; ++e) af[mt][e] = qf[QREG ? mt : 0][QREG ? kk : 0][e];
          } else {
            ldmatrix_x4(af[mt],
                        q_s + mt * 16 * D * 2 + attn_swz_k<D>(a_off, a_row, a_chunk, kk));
          }
        }
        const unsigned int k_kk = k_t + attn_swz_k<D>(b_off, b_row, b_chunk, kk);
#pragma unroll
        for (int np = 0; np < NS / 2; ++np) {
          unsigned int bf[4];
          ldmatrix_x4(bf, k_kk + np * 16 * D * 2);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Mma<T>::run(s[mt][2 * np], af[mt], bf[0], bf[1]);
            Mma<T>::run(s[mt][2 * np + 1], af[mt], bf[2], bf[3]);
          }
        }
      }

      // Scores in the log2 domain. Edge tiles (some score of the warp's rows may be hidden:
      // the diagonal of a causal mask, a window's borders, the key tail, any attn_mask) and a
      // non-positive scale: scale first, then visibility and mask (cs = 1). Every other tile
      // keeps the raw scores: the row max is taken on them (a positive scale commutes with max)
      // and the scale is folded into the exponent, p = exp2(fma(s, scale_log2, -m)): one FFMA
      // per score. The branch is per warp and per tile, outside the row loops, so the softmax
      // below is straight-line code over all 2 MT rows of the lane: their max/shuffle/exp2/sum
      // chains interleave instead of running one row after the other.
      const bool edge = sp_mixed || (MASK && a.mask_kind != 0) || k0 + BC > a.sk ||
                        (a.right >= 0 && k0 + BC - 1 > wq0 + a.right) ||
                        (a.left >= 0 && k0 < wq1 - a.left);
      const bool fold = !edge && a.scale_log2 > 0.0f;
      const float cs = fold ? a.scale_log2 : 1.0f;
      if (edge) {
        attn_mma_hide<MASK, T, BC, SPARSE>(s, a, wq0, k0, g, t, mbase, sp_mixed, sp_bits);
      } else if (!fold) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][n][e] *= a.scale_log2;
      }

      // Online softmax over the lane's rows g, g + 8 of each m16 tile (index 2 mt + hr): row
      // max (pairwise tree, then the quad's 4 lanes by 2 shuffles); a row that has seen only
      // -inf subtracts 0 (exp2(-inf) = 0, no NaN); NaN scores keep NaN (attn_max).
      float mx[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float w[NS];
#pragma unroll
          for (int n = 0; n < NS; ++n) w[n] = attn_max(s[mt][n][2 * hr], s[mt][n][2 * hr + 1]);
#pragma unroll
          for (int step = 1; step < NS; step *= 2)
#pragma unroll
            for (int n = 0; n + step < NS; n += 2 * step) w[n] = attn_max(w[n], w[n + step]);
          mx[mt][hr] = w[0] * cs;
        }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
          mx[mt][hr] = attn_max(mx[mt][hr], __shfl_xor_sync(0xffffffffu, mx[mt][hr], 1));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
          mx[mt][hr] = attn_max(mx[mt][hr], __shfl_xor_sync(0xffffffffu, mx[mt][hr], 2));
      float alpha[MT][2], nbase[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const float mnew = attn_max(m[mt][hr], mx[mt][hr]);
          const float base = mnew == attn_neg_inf() ? 0.0f : mnew;
          alpha[mt][hr] = attn_exp2(m[mt][hr] - base);
          nbase[mt][hr] = -base;
          m[mt][hr] = mnew;
        }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[mt][n][e] = attn_exp2(fmaf(s[mt][n][e], cs, nbase[mt][e >> 1]));
      // l sums the fp32 p (pairwise; the quad's partial sums meet at the end)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float w[NS];
#pragma unroll
          for (int n = 0; n < NS; ++n) w[n] = s[mt][n][2 * hr] + s[mt][n][2 * hr + 1];
#pragma unroll
          for (int step = 1; step < NS; step *= 2)
#pragma unroll
            for (int n = 0; n + step < NS; n += 2 * step) w[n] += w[n + step];
          l[mt][hr] = fmaf(l[mt][hr], alpha[mt][hr], w[0]);
        }
      // O rescale, once per tile (alpha = 1 when the row max did not move)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NO; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[mt][n][e] *= alpha[mt][e >> 1];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kp = 0; kp < KP; ++kp) {
          pf[mt][kp][0] = pack_b16x2<T>(s[mt][2 * kp][0], s[mt][2 * kp][1]);
          pf[mt][kp][1] = pack_b16x2<T>(s[mt][2 * kp][2], s[mt][2 * kp][3]);
          pf[mt][kp][2] = pack_b16x2<T>(s[mt][2 * kp + 1][0], s[mt][2 * kp + 1][1]);
          pf[mt][kp][3] = pack_b16x2<T>(s[mt][2 * kp + 1][2], s[mt][2 * kp + 1][3]);
        }
    }

    if (STAGES == 1) {
      cp_async_wait<0>();
      __syncthreads();   // V landed; every warp is done with K
      // [extras] block sparsity: the next tile visited (it + 1 when dense)
      next = mma_on_tile<SPARSE, BC>(a, bm, it + 1, ntiles, jlo, jhi, q0 - shift, qlast - shift);
      if (next < ntiles) {
        attn_tile_async<T, BC, D, kThreads>(k_t, k, SPARSE ? jlo + next * BC : k0 + BC, a.sk,
                                            a.ks[2]);
        cp_async_commit();
      }
    } else {
      // No barrier here: __syncwarp keeps the compiler from hoisting the V fragment loads
      // into the softmax, where S, P and O are all live (spills at 32 rows x 64 keys).
      __syncwarp();
    }

    if (active) {
      // O += P V (V through ldmatrix.trans)
      const int v_off = attn_swz_tile<D, (MT > 1)>(v_row, v_chunk);
#pragma unroll
      for (int kp = 0; kp < KP; ++kp) {
#pragma unroll
        for (int dp = 0; dp < NO / 2; ++dp) {
          unsigned int bf[4];
          ldmatrix_x4_trans(bf, v_t + kp * 16 * D * 2 + attn_swz_k<D>(v_off, v_row, v_chunk, dp));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Mma<T>::run(o[mt][2 * dp], pf[mt][kp], bf[0], bf[1]);
            Mma<T>::run(o[mt][2 * dp + 1], pf[mt][kp], bf[2], bf[3]);
          }
        }
      }
    }
    slot ^= 1;
  }

  // O / l -> T, staged in the warp's own Q rows (no other warp reads them; the warp's own
  // ldmatrix reads of them are done: O depends on their results); lse = (m + log2 l) ln 2. Rows that saw no key: l = 0 -> 0 and -inf.
  if constexpr (VARLEN) mma_sequence_out<T>(narrowed, b, shift);   // [extras] its output rows
  T* out = static_cast<T*>(a.o) + b * a.os[0] + h * a.os[1];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float lt = l[mt][hr];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      const float inv = lt == 0.0f ? 0.0f : 1.0f / lt;
      const int rr = wr0 + mt * 16 + g + 8 * hr;
#pragma unroll
      for (int n = 0; n < NO; ++n)
        *reinterpret_cast<unsigned int*>(smem + attn_swz<D>(rr, n) + 4 * t) =
            pack_b16x2<T>(o[mt][n][2 * hr] * inv, o[mt][n][2 * hr + 1] * inv);
      const int i = q0 + rr;
      if (a.lse != nullptr && t == 0 && i < a.sq) {
        const float mm = m[mt][hr];
        // [extras] by strides (varlen: [Hq, T]); dense: contiguous [B, Hq, Sq]
        const long long li = EXTRAS ? b * a.ls[0] + h * a.ls[1] + i * a.ls[2]
                                    : static_cast<long long>(bh) * a.sq + i;
        a.lse[li] = mm == attn_neg_inf() ? attn_neg_inf() : (mm + log2f(lt)) * kAttnLn2;
      }
    }
  }
  __syncwarp();
  constexpr int kCPR = D / 8;
#pragma unroll
  for (int idx = lane; idx < 16 * MT * kCPR; idx += 32) {
    const int rr = idx / kCPR, c = idx - (idx / kCPR) * kCPR;
    const int i = wq0 + rr;
    if (i < a.sq)
      store16(out + i * a.os[2] + c * 8,
              *reinterpret_cast<const uint4*>(smem + attn_swz<D>(wr0 + rr, c)));
  }
}

}  // namespace gpuops
