// Flash attention forward on Hopper (variant 'wgmma': sm_90a, fp16/bf16 storage, fp32
// accumulation), FlashAttention-3's structure on gpuops' Hopper building blocks
// (common/wgmma.cuh, as the wgmma GEMM uses them):
//
//  * one block of 3 warpgroups per (batch x head, 128 query rows): warpgroup 0 is the producer
//    (one thread issues every TMA load; setmaxnreg gives its registers to the others),
//    warpgroups 1 and 2 are consumers of 64 query rows each (240 registers);
//  * Q (128 x D) is loaded once by TMA; K and V tiles of 128 keys stream through a ring of
//    shared memory (3 stages at D = 128, 4 at D = 64) with mbarriers: "K full" and "V full" per
//    stage (TMA bytes landed; S = Q K^T starts as soon as K is there) and "empty" per stage
//    (every consumer warp is done with both);
//  * S = Q K^T: wgmma m64n128k16 with both operands in shared memory (K-major, 128-byte swizzle
//    as TMA writes it), fp32 accumulators in registers;
//  * online softmax on the accumulator fragments (the log2 domain, the scale folded into the
//    exponent: p = exp2(fma(s, scale_log2, -m)), one FFMA per score; visibility (causal /
//    window bounds, the key tail) only on the tiles that need it); P rounded to T in registers is
//    directly the A operand of O += P V (wgmma with A from registers, V N-major in shared
//    memory: no P round trip through shared memory);
//  * intra-warpgroup overlap (FlashAttention-3, section 3.2): S_{j+1} = Q K_{j+1}^T is issued
//    before O += P_j V_j, and the softmax of S_{j+1} runs while O += P_j V_j is on the tensor
//    cores; O is rescaled by S_{j+1}'s factor after issuing S_{j+2}, before O += P_{j+1} V_{j+1};
//  * PINGPONG (template flag; host: attention.WGMMA_SCHEDULE): the two consumer warpgroups
//    take turns on the tensor cores (named barriers), so one's softmax runs under the other's
//    products (FlashAttention-3, section 3.1);
//  * epilogue: O / l rounded to T into this warpgroup's own rows of the Q tile in shared memory
//    (the swizzled layout a TMA box reads), then one TMA store per 64 columns (rows past the
//    sequence are clipped by the tensor map); lse = (m + log2 l) ln 2 per row when requested.
//
// Tensor maps (host: gpuops/ops/attention.py `_wgmma_maps`): q, k, v, out as 4-D [B, H, S, D]
// with any strides (bhsd and bshd alike); boxes of 64 head-dim columns (one 128-byte swizzle
// row) x 128 rows (Q, K) or x 64 rows (V, O). Rows past S arrive as zeros: key tails are masked,
// query tails are never stored. Same semantics as the mma kernel (flash_fwd_mma.cu): a row that
// sees no key gives 0 and lse -inf; NaN scores keep NaN; l sums the fp32 p.
//
// SPARSE (block_sparse_attention, template flag): the block walks only the key tiles with a
// block_mask entry on for its rows (producer and consumers walk the same list, WgaTiles); the
// host takes block sizes that are multiples of 64 only, so each consumer warpgroup's 64 rows lie
// in one query block and each 64-key half of a tile in one key block: a tile on for the block
// but off for a warpgroup's half hides that half's scores (wga_hide_halves), two mask bytes per
// tile, no per-score lookups.
//
// What it does not take (the host routes these to 'mma'): attn_mask, varlen, rotary, block
// sparsity with blocks not a multiple of 64, the bottom-right diagonal, a non-positive scale,
// head dims other than 64 / 128, operands TMA cannot describe (16-byte aligned bases and
// strides).
#include "attention/attn_common.cuh"
#include "common/mma.cuh"
#include "common/wgmma.cuh"

namespace gpuops {

constexpr int kWgaBM = 128;             // query rows per block (2 consumer warpgroups x 64)
constexpr int kWgaBN = 128;             // keys per tile
// K / V ring depth: D = 128, 3 stages (229 KB with Q: the most that fits); D = 64, 4. Run 49's
// trace (attention_wgmma_trace.py) had 2 stages starve the consumers: the load of tile j + 1
// could start only when both warpgroups had released tile j - 1 (after their O += P V), and it
// landed ~1400 cycles later, 1770 of a 4130-cycle iteration spent waiting for K.
// (GPUOPS_WGA_STAGES_D64: an experiment's override, benchmarks/experiments/attention_wgmma_stages.py)
#ifndef GPUOPS_WGA_STAGES_D64
#define GPUOPS_WGA_STAGES_D64 4
#endif
template <int D>
__host__ __device__ constexpr int wga_stages() { return D == 128 ? 3 : GPUOPS_WGA_STAGES_D64; }

// Whether the P V wait is kept after the softmax (wgmma_wait_after; else ptxas schedules it
// before the whole softmax, run 47). Run 56, same process: D64 +3..+5% (the softmax-bound head
// dim: run 55's trace, softmax ~1170 of a 2090-cycle period), D128 -1..-8%.
// (GPUOPS_WGA_WAIT_AFTER: an experiment's build with it at D128 too.)
template <int D>
__host__ __device__ constexpr bool wga_wait_after() {
#ifdef GPUOPS_WGA_WAIT_AFTER
  return true;
#else
  return D == 64;
#endif
}
constexpr int kWgaThreads = 384;
constexpr int kWgaProducerRegs = 24, kWgaConsumerRegs = 240;
// named barriers: 1 + cg the epilogue of consumer warpgroup cg (128 threads), kWgaTurnBar + cg
// its turn on the tensor cores (PINGPONG: 256 threads, both consumer warpgroups)
constexpr int kWgaTurnBar = 3;
static_assert((2 * kWgaConsumerRegs + kWgaProducerRegs) * 128 <= 65536, "register file");
// SPARSE: the producer warp walks the tile list (WgaTiles) besides issuing the loads, which
// spilled in 24 registers; 40 for it and 232 for the consumers move the same registers (the
// launch's 168 x 384: 2 x 64 x 256 given = 128 x 128 taken)
constexpr int kWgaSparseProducerRegs = 40, kWgaSparseConsumerRegs = 232;
static_assert((2 * kWgaSparseConsumerRegs + kWgaSparseProducerRegs) ==
                  (2 * kWgaConsumerRegs + kWgaProducerRegs), "the same registers moved");

// Shared memory, from a 1024-byte aligned base (the 128-byte swizzle's period): Q as D / 64 boxes
// of [128 rows][64]; per stage K as D / 64 boxes of [128 keys][64] and V as (128 / 64) x (D / 64)
// boxes of [64 keys][64] (box kc * D / 64 + dc: keys 64 kc.., columns 64 dc..); the barriers.
template <int D>
struct WgaLayout {
  static constexpr int kDC = D / 64;                 // 64-column chunks of the head dim
  static constexpr int kQBox = kWgaBM * 128;         // one [128][64] 16-bit box: 16 KiB
  static constexpr int kKBox = kWgaBN * 128;
  static constexpr int kVBox = 64 * 128;             // [64][64]: 8 KiB
  static constexpr int kQ = kDC * kQBox;
  static constexpr int kK = kDC * kKBox;
  static constexpr int kV = (kWgaBN / 64) * kDC * kVBox;
  static constexpr int kStage = kK + kV;
  static constexpr int kStages = wga_stages<D>();
  static constexpr int kBar = kQ + kStages * kStage;
  // q_full, then k_full[S], v_full[S], empty[S]
  // a scratch word for wgmma_wait_after (wga_wait_after), then 1 KiB of alignment slack
  static constexpr int kScratch = kBar + (1 + 3 * kStages) * 8;
  static constexpr int kBytes = kScratch + (wga_wait_after<D>() ? 8 : 0) + 1024;
  static_assert(kBytes <= 227 * 1024, "shared memory");
};

// The block's query tile and the key range its rows may see. Blocks are numbered on x alone
// and walk the (b x h) rows in chunks of `head_chunk` consecutive ones (host, causal /
// windowed: as many heads as keep their K / V within about half of L2; full rows: 1), the
// chunk's query tiles heaviest first, its heads fastest. So a wave holds few heads and each
// head's K / V is read from DRAM about once and from L2 by all its tiles (run 38 had every
// head in every wave: at B4 H32 a wave touched ~128 heads' K / V, 256 MB, and each block
// re-read its 2 MB from DRAM: 359 TFLOP/s against 470 at B1), and a causal grid still ends on
// its lightest tiles (run 39 had each head's tiles consecutive: the last heads' heavy tiles ran
// in the tail, causal B1 -8%).
struct WgaWork {
  int b, h, hk, q0, jlo, jhi, ntiles;
  __device__ __forceinline__ WgaWork(const FlashFwdArgs& a, int head_chunk) {
    const int ntq = (a.sq + kWgaBM - 1) / kWgaBM;
    const int bhs = static_cast<int>(gridDim.x) / ntq;               // B x Hq
    const int per_chunk = ntq * head_chunk;
    const int chunk = static_cast<int>(blockIdx.x) / per_chunk;
    const int rem = static_cast<int>(blockIdx.x) - chunk * per_chunk;
    const int heads = attn_imin(head_chunk, bhs - chunk * head_chunk);   // the last may be short
    const int tile = rem / heads;
    const int bh = chunk * head_chunk + (rem - tile * heads);
    b = bh / a.hq;
    h = bh - b * a.hq;
    hk = h / a.group;
    q0 = (ntq - 1 - tile) * kWgaBM;
    const int qlast = attn_imin(q0 + kWgaBM, a.sq) - 1;
    jlo = 0;
    jhi = a.sk;
    if (a.left >= 0) jlo = attn_imax(0, q0 - a.left);
    if (a.right >= 0) jhi = attn_imin(a.sk, qlast + a.right + 1);
    ntiles = jhi > jlo ? (jhi - jlo + kWgaBN - 1) / kWgaBN : 0;
  }
};

// Hides the scores of one tile that a row may not see (key past sk, outside the window /
// causal bound): lane (g, t) of warp rows w0 + g, w0 + g + 8; s[4j + 2hr + e] is key
// k0 + 8j + 2t + e of row w0 + g + 8hr.
__device__ __forceinline__ void wga_hide(float (&s)[64], const FlashFwdArgs& a, int w0, int k0,
                                         int g, int t) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int i = w0 + g + 8 * hr;
    int lo = -2 * t, hi = a.sk - 1 - k0 - 2 * t;    // key k0 + 2t + c visible iff lo <= c <= hi
    if (a.left >= 0) lo = attn_imax(lo, i - a.left - k0 - 2 * t);
    if (a.right >= 0) hi = attn_imin(hi, i + a.right - k0 - 2 * t);
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 8 * j + e;
        if (c < lo || c > hi) s[4 * j + 2 * hr + e] = attn_neg_inf();
      }
  }
}

// Block sparsity (SPARSE): which key tiles the block walks, 32 tiles at a time. Lane l of the warp
// tests tile base + l in one round of loads (blocks are multiples of 64: the block's 128 rows and
// a tile's 128 keys cover at most 2 x 2 mask entries; each 64-key half of the tile lies in one key
// block), and __ballot_sync gathers the bits: `on` (a block on for any of the block's rows: the
// tile is loaded and multiplied), half0 / half1 (the half's block on for the query block `qrow`
// of the caller's warpgroup: else its scores are hidden). Run 187 had each thread test its tiles
// one at a time with dependent loads on the consumers' critical path: 36% slower than the dense
// instance at density 1. Every lane of the warp walks (next) with the same j.
struct WgaTiles {
  int base = -32;                      // the window's first tile
  unsigned on = 0, half0 = 0, half1 = 0;

  template <bool HALVES>
  __device__ __forceinline__ void load(const FlashFwdArgs& a, const unsigned char* bm,
                                       const WgaWork& w, int qrow, int b) {
    const int j = b + static_cast<int>(threadIdx.x & 31);
    bool t = false, h0 = false, h1 = false;
    if (j < w.ntiles) {
      const int bs = a.block_size;
      const int k0 = w.jlo + j * kWgaBN;
      const int klast = attn_imin(k0 + kWgaBN, w.jhi) - 1;
      const int qlast = attn_imin(w.q0 + kWgaBM, a.sq) - 1;
      const unsigned char* r0 = bm + (w.q0 / bs) * a.bms[2];
      const unsigned char* r1 = bm + (qlast / bs) * a.bms[2];
      const long long c0 = (k0 / bs) * a.bms[3], c1 = (klast / bs) * a.bms[3];
      const unsigned char m00 = r0[c0], m01 = r0[c1], m10 = r1[c0], m11 = r1[c1];
      if constexpr (HALVES) {
        const unsigned char* rw = bm + qrow * a.bms[2];
        const long long ch = (attn_imin(k0 + 64, a.sk - 1) / bs) * a.bms[3];
        const unsigned char mh0 = rw[c0], mh1 = rw[ch];
        h0 = mh0 != 0;
        h1 = mh1 != 0;
      }
      t = (m00 | m01 | m10 | m11) != 0;
    }
    on = __ballot_sync(0xffffffffu, t);
    if constexpr (HALVES) {
      half0 = __ballot_sync(0xffffffffu, h0);
      half1 = __ballot_sync(0xffffffffu, h1);
    }
    base = b;
  }

  // the first tile at or after j that is on (w.ntiles when none); without SPARSE: j. HALVES:
  // also the halves' bits of the caller's warpgroup (the consumers; the producer needs only `on`)
  template <bool SPARSE, bool HALVES = true>
  __device__ __forceinline__ int next(const FlashFwdArgs& a, const unsigned char* bm,
                                      const WgaWork& w, int qrow, int j) {
    if constexpr (SPARSE) {
#pragma unroll 1
      while (j < w.ntiles) {
        const int b = j & ~31;
        if (b != base) load<HALVES>(a, bm, w, qrow, b);
        const unsigned rest = on >> (j - b);
        if (rest != 0u) return j + __ffs(rest) - 1;
        j = b + 32;
      }
      return w.ntiles;
    }
    return j;
  }

  // whether tile j's 64-key half is on for the warpgroup (j in the current window)
  __device__ __forceinline__ bool half_on(int j, int half) const {
    return (((half ? half1 : half0) >> (j - base)) & 1u) != 0u;
  }
};

// Hides the scores of the 64-key halves of a tile that are off for the warpgroup's rows (SPARSE:
// s[4j + ..] is key k0 + 8j + 2t + e, half j / 8).
__device__ __forceinline__ void wga_hide_halves(float (&s)[64], bool on0, bool on1) {
#pragma unroll
  for (int j = 0; j < 16; ++j)
    if (!(j < 8 ? on0 : on1)) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[4 * j + e] = attn_neg_inf();
    }
}

// One tile's online softmax on raw scores s (in place: s becomes p = exp2(s scale_log2 - m)):
// row max (pairwise tree, then the quad's 4 lanes), the new running max m (log2 units), the
// factor alpha that rescales the old O and l, l += the lane's partial row sums (the quad's
// partials meet at the end). A row that has seen only -inf subtracts 0 (no NaN).
__device__ __forceinline__ void wga_softmax(float (&s)[64], float (&m)[2], float (&l)[2],
                                            float (&alpha)[2], float scale_log2) {
  float mx[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float w[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) w[j] = attn_max(s[4 * j + 2 * hr], s[4 * j + 2 * hr + 1]);
#pragma unroll
    for (int step = 1; step < 16; step *= 2)
#pragma unroll
      for (int j = 0; j + step < 16; j += 2 * step) w[j] = attn_max(w[j], w[j + step]);
    mx[hr] = w[0] * scale_log2;
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
    mx[hr] = attn_max(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
    mx[hr] = attn_max(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
  float nbase[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const float mnew = attn_max(m[hr], mx[hr]);
    const float base = mnew == attn_neg_inf() ? 0.0f : mnew;
    alpha[hr] = attn_exp2(m[hr] - base);
    nbase[hr] = -base;
    m[hr] = mnew;
  }
#pragma unroll
  for (int i = 0; i < 64; ++i) s[i] = attn_exp2(fmaf(s[i], scale_log2, nbase[(i >> 1) & 1]));
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float w[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) w[j] = s[4 * j + 2 * hr] + s[4 * j + 2 * hr + 1];
#pragma unroll
    for (int step = 1; step < 16; step *= 2)
#pragma unroll
      for (int j = 0; j + step < 16; j += 2 * step) w[j] += w[j + step];
    l[hr] = fmaf(l[hr], alpha[hr], w[0]);
  }
}

// P (fp32 in s) -> the A fragments of O += P V: k step kk covers keys 16kk .. 16kk + 15 = the n8
// blocks 2kk, 2kk + 1 of S.
template <class T>
__device__ __forceinline__ void wga_pack_p(unsigned int (&pf)[8][4], const float (&s)[64]) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    pf[kk][0] = pack_b16x2<T>(s[8 * kk + 0], s[8 * kk + 1]);
    pf[kk][1] = pack_b16x2<T>(s[8 * kk + 2], s[8 * kk + 3]);
    pf[kk][2] = pack_b16x2<T>(s[8 * kk + 4], s[8 * kk + 5]);
    pf[kk][3] = pack_b16x2<T>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

// PROBE: 0 in every launch gpuops makes. Timing probes of
// benchmarks/experiments/attention_wgmma_probe.py (wrong results by design) leave parts out:
// bit 0 the softmax (visibility, max, exp2, sums: P = S), bit 1 the O += P V products, bit 2 the
// O rescale; bit 3 (a trace, not a leave-out): thread 0 of each consumer warpgroup of block
// gridDim.x / 2 writes clock64() at 7 points of each k-tile iteration into the lse buffer (as
// int64 [cg][tile][8]; lse itself is not written).
template <class T, int D, bool PINGPONG, int PROBE, bool SPARSE>
__global__ void __launch_bounds__(kWgaThreads, 1)
    flash_fwd_wgmma(const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,
                    const __grid_constant__ TmaDesc tma_v, const __grid_constant__ TmaDesc tma_o,
                    const FlashFwdArgs args, const int head_chunk) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(sizeof(T) == 2 && (D == 64 || D == 128), "head dims 64 and 128, 16-bit types");
  using L = WgaLayout<D>;
  extern __shared__ __align__(16) unsigned char wga_smem_raw[];
  const unsigned int raw = smem_u32(wga_smem_raw);
  const unsigned int sbase = raw + ((1024u - (raw & 1023u)) & 1023u);
  const unsigned int q_s = sbase;
  const unsigned int q_bar = sbase + L::kBar;
  constexpr int kStages = L::kStages;
  const unsigned int kfull_bar = q_bar + 8, vfull_bar = kfull_bar + 8 * kStages;
  const unsigned int empty_bar = vfull_bar + 8 * kStages;
  auto k_tile = [&](int stage) { return sbase + L::kQ + stage * L::kStage; };
  auto v_tile = [&](int stage) { return sbase + L::kQ + stage * L::kStage + L::kK; };

  const int tid = threadIdx.x, wg = tid / 128;
  if (tid == 0) {
    mbar_init(q_bar, 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(kfull_bar + 8 * s, 1);     // the producer's arrive.expect_tx (+ TMA's bytes)
      mbar_init(vfull_bar + 8 * s, 1);
      mbar_init(empty_bar + 8 * s, 8);     // one arrive per consumer warp
    }
    mbar_fence_init();
    tma_prefetch_desc(&tma_q);
    tma_prefetch_desc(&tma_k);
    tma_prefetch_desc(&tma_v);
    tma_prefetch_desc(&tma_o);
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------------ producer warpgroup
    setmaxnreg_dec<SPARSE ? kWgaSparseProducerRegs : kWgaProducerRegs>();
    // thread 0 issues every load; SPARSE: its warp walks the tile list with it (WgaTiles).
    // (Without SPARSE the loops below are the dense kernel's as before the sparse instance: its
    // machine code was 16 instructions longer with one loop for both, run 188.)
    if (SPARSE ? tid < 32 : tid == 0) {
      const bool issuer = tid == 0;
      const WgaWork w(args, head_chunk);
      const unsigned char* bm =
          SPARSE ? args.block_mask + w.b * args.bms[0] + w.h * args.bms[1] : nullptr;
      if (issuer) {
        mbar_arrive_expect_tx(q_bar, L::kQ);
#pragma unroll
        for (int dc = 0; dc < L::kDC; ++dc)
          tma_load_4d(q_s + dc * L::kQBox, &tma_q, q_bar, 64 * dc, w.q0, w.h, w.b);
      }
      // it counts the tiles loaded (the ring's stage and phase), j is the key tile
      WgaTiles tiles;
      int j = tiles.next<SPARSE, false>(args, bm, w, 0, 0);
      for (int it = 0; SPARSE ? j < w.ntiles : it < w.ntiles; ++it) {
        if constexpr (SPARSE) {
          if (it > 0) j = tiles.next<SPARSE, false>(args, bm, w, 0, j + 1);
          if (j >= w.ntiles) break;
          if (!issuer) continue;
        } else {
          j = it;
        }
        const int stage = it % kStages;
        mbar_wait(empty_bar + 8 * stage, ((it / kStages) & 1) ^ 1);
        const int k0 = w.jlo + j * kWgaBN;
        const unsigned int kb = kfull_bar + 8 * stage, vb = vfull_bar + 8 * stage;
        mbar_arrive_expect_tx(kb, L::kK);
#pragma unroll
        for (int dc = 0; dc < L::kDC; ++dc)
          tma_load_4d(k_tile(stage) + dc * L::kKBox, &tma_k, kb, 64 * dc, k0, w.hk, w.b);
        mbar_arrive_expect_tx(vb, L::kV);
#pragma unroll
        for (int kc = 0; kc < kWgaBN / 64; ++kc)
#pragma unroll
          for (int dc = 0; dc < L::kDC; ++dc)
            tma_load_4d(v_tile(stage) + (kc * L::kDC + dc) * L::kVBox, &tma_v, vb, 64 * dc,
                        k0 + 64 * kc, w.hk, w.b);
      }
    }
    return;
  }

  // -------------------------------------------------------------------- consumer warpgroups
  setmaxnreg_inc<SPARSE ? kWgaSparseConsumerRegs : kWgaConsumerRegs>();
  const FlashFwdArgs& a = args;
  const WgaWork w(a, head_chunk);
  const unsigned char* bm = SPARSE ? a.block_mask + w.b * a.bms[0] + w.h * a.bms[1] : nullptr;
  const int cg = wg - 1;                          // rows 64 cg .. 64 cg + 63 of the block
  const int ctid = tid - 128 * wg, cwarp = ctid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const int w0 = w.q0 + 64 * cg + 16 * cwarp;     // the warp's first query row
  const float sl2 = a.scale_log2;
  // descriptors (WgOperand's constants, common/wgmma.cuh): Q and K K-major, 128-byte rows,
  // k16 steps of 32 bytes inside a box, the next box every 4 steps; V N-major, k16 steps of 16
  // keys (2048 bytes), the next 64 keys one box row on, LBO = the next 64 head-dim columns
  auto q_desc = [&](int kk) {
    return wgmma_desc(q_s + (kk >> 2) * L::kQBox + cg * 8192 + (kk & 3) * 32, 16, 1024);
  };
  auto k_desc = [&](unsigned int kt, int kk) {
    return wgmma_desc(kt + (kk >> 2) * L::kKBox + (kk & 3) * 32, 16, 1024);
  };
  auto v_desc = [&](unsigned int vt, int kk) {
    return wgmma_desc(vt + (kk >> 2) * L::kDC * L::kVBox + (kk & 3) * 2048, L::kVBox, 1024);
  };

  float o[D / 2];
  float s[64];
  unsigned int pf[8][4];
  float m[2] = {attn_neg_inf(), attn_neg_inf()}, l[2] = {0.0f, 0.0f}, alpha[2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;

  auto issue_s = [&](int stage) {      // S = Q K^T of the tile in `stage`
    const unsigned int kt = k_tile(stage);
    reg_fence(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss_m64n128k16<T>(s, q_desc(kk), k_desc(kt, kk), kk > 0 ? 1 : 0);
    wgmma_commit();
    reg_fence(s);
  };
  auto issue_pv = [&](int stage) {     // O += P V of the tile in `stage`
    if (PROBE & 2) {                   // an empty group keeps the waits' counts
      wgmma_commit();
      return;
    }
    const unsigned int vt = v_tile(stage);
    reg_fence(o);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) reg_fence(pf[kk]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kWgaBN / 16; ++kk) wgmma_rs_m64k16<T, D>(o, pf[kk], v_desc(vt, kk), 1);
    wgmma_commit();
    reg_fence(o);
  };
  auto release = [&](int stage) {
    if (lane == 0) mbar_arrive(empty_bar + 8 * stage);
  };
  // O *= alpha of the latest softmax, right before O += P V of that tile (FlashAttention-3's
  // order: issued after the next S product, so the multiplies run under it; run 42 had them
  // after the P V wait, in front of the next turn)
  auto rescale_o = [&]() {
    if (PROBE & 4) return;
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
  };
  // SPARSE: the tile list (WgaTiles), with the halves on for this warpgroup's query block (rows
  // past sq read the last row's, inside the mask; so does a half past sk, hidden anyway)
  WgaTiles tiles;
  const int sparse_qrow = SPARSE ? attn_imin(w.q0 + 64 * cg, a.sq - 1) / a.block_size : 0;
  // an edge tile: some score of the warp's rows may be hidden (key tail, window / causal bound);
  // SPARSE: a 64-key half whose block is off for the warpgroup's rows
  auto softmax_tile = [&](int j) {
    if (PROBE & 1) return;
    const int k0 = w.jlo + j * kWgaBN;
    const bool edge = k0 + kWgaBN > a.sk || (a.right >= 0 && k0 + kWgaBN - 1 > w0 + a.right) ||
                      (a.left >= 0 && k0 < w0 + 15 - a.left);
    if (edge) wga_hide(s, a, w0, k0, g, t);
    if constexpr (SPARSE) {
      const bool on0 = tiles.half_on(j, 0), on1 = tiles.half_on(j, 1);
      if (!(on0 && on1)) wga_hide_halves(s, on0, on1);
    }
    wga_softmax(s, m, l, alpha, sl2);
  };

  // PINGPONG (FlashAttention-3, section 3.1): the two consumer warpgroups take turns issuing
  // their MMAs; named barrier kWgaTurnBar + cg opens a warpgroup's turn, the other warpgroup
  // arrives on it when its own issue section ends, so one warpgroup's softmax runs while the
  // other's products occupy the tensor cores. Warpgroup 0 goes first (warpgroup 1 arrives
  // once up front) and syncs once more at the end: every arrival is consumed before exit.
  auto turn_begin = [&]() {
    if (PINGPONG) named_bar_sync(kWgaTurnBar + cg, 256);
  };
  auto turn_end = [&]() {
    if (PINGPONG) named_bar_arrive(kWgaTurnBar + (cg ^ 1), 256);
  };
  if (PINGPONG && cg == 1) named_bar_arrive(kWgaTurnBar, 256);

  long long* trace = reinterpret_cast<long long*>(a.lse);
  const bool tracer = (PROBE & 8) && ctid == 0 && blockIdx.x == gridDim.x / 2 && trace != nullptr;
  auto mark = [&](int it, int ev) {
    if ((PROBE & 8) && tracer) trace[cg * 4096 + it * 8 + ev] = clock64();
  };
  mbar_wait(q_bar, 0);
  // it counts the tiles processed (the ring's stage and phase), j is the key tile (SPARSE: the
  // producer's list, WgaTiles)
  int j = tiles.next<SPARSE>(a, bm, w, sparse_qrow, 0);
  if (j < w.ntiles) {
    int stage = 0;
    unsigned int phase = 0;
    mbar_wait(kfull_bar, 0);
    turn_begin();
    issue_s(0);
    turn_end();
    wgmma_wait<0>();
    reg_fence(s);
    softmax_tile(j);                   // (its alpha meets O = 0)
    wga_pack_p<T>(pf, s);
    for (int it = 1; SPARSE || it < w.ntiles; ++it) {
      if constexpr (SPARSE) {
        j = tiles.next<SPARSE>(a, bm, w, sparse_qrow, j + 1);
        if (j >= w.ntiles) break;
      } else {
        j = it;
      }
      const int next = stage + 1 == kStages ? 0 : stage + 1;
      const unsigned int next_phase = next == 0 ? phase ^ 1 : phase;
      mbar_wait(kfull_bar + 8 * next, next_phase);
      mark(it, 0);
      turn_begin();
      mark(it, 1);
      issue_s(next);                   // S_it, while ...
      rescale_o();                     // (CUDA cores, under S_it: alpha of tile it - 1)
      mbar_wait(vfull_bar + 8 * stage, phase);
      issue_pv(stage);                 // ... O += P_{it-1} V_{it-1} follows it
      turn_end();
      mark(it, 2);
      wgmma_wait<1>();                 // groups complete in order: S_it is done
      reg_fence(s);
      mark(it, 3);
      softmax_tile(j);                 // under O += P V
      if (PROBE & 8) reg_fence(s);
      mark(it, 4);
      if constexpr (wga_wait_after<D>())
        wgmma_wait_after<0>(l[0] + l[1], sbase + L::kScratch);
      else
        wgmma_wait<0>();
      reg_fence(o);
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) reg_fence(pf[kk]);   // P is read until the product ends
      mark(it, 5);
      release(stage);
      wga_pack_p<T>(pf, s);
      mark(it, 6);
      stage = next;
      phase = next_phase;
    }
    mbar_wait(vfull_bar + 8 * stage, phase);
    turn_begin();
    rescale_o();
    issue_pv(stage);
    turn_end();
    wgmma_wait<0>();
    reg_fence(o);
    release(stage);
  }
  if (PINGPONG && cg == 0) named_bar_sync(kWgaTurnBar, 256);

  // ---------------------------------------------------------------------- epilogue
  // O / l -> T into this warpgroup's 64 rows of the Q tile (its own: the other warpgroup reads
  // only its rows; every wgmma of this warpgroup reading them is complete), in the box layout
  // (128-byte swizzle: chunk c of row r at c ^ (r % 8)), then TMA stores of 64 x 64 boxes.
  float inv[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float lt = l[hr];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    inv[hr] = lt == 0.0f ? 0.0f : 1.0f / lt;
    const int i = w0 + g + 8 * hr;
    if (!(PROBE & 8) && a.lse != nullptr && t == 0 && i < a.sq) {
      a.lse[w.b * a.ls[0] + w.h * a.ls[1] + i * a.ls[2]] =
          m[hr] == attn_neg_inf() ? attn_neg_inf() : (m[hr] + log2f(lt)) * kAttnLn2;
    }
  }
  unsigned char* smem_o = wga_smem_raw + (sbase - raw) + cg * 8192;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = 16 * cwarp + g + 8 * hr;      // r % 8 = g
      *reinterpret_cast<unsigned int*>(smem_o + (j >> 3) * L::kQBox + r * 128 +
                                       (((j & 7) ^ g) << 4) + 4 * t) =
          pack_b16x2<T>(o[4 * j + 2 * hr] * inv[hr], o[4 * j + 2 * hr + 1] * inv[hr]);
    }
  }
  fence_proxy_async_smem();            // the stores above, before the TMA unit reads them
  named_bar_sync(1 + cg, 128);
  if (ctid == 0) {
#pragma unroll
    for (int dc = 0; dc < L::kDC; ++dc)
      tma_store_4d(&tma_o, q_s + dc * L::kQBox + cg * 8192, 64 * dc, w.q0 + 64 * cg, w.h, w.b);
    bulk_commit();
    bulk_wait<0>();
  }
#else
  __trap();   // not reached: the module is built for sm_90a only
#endif
}

}  // namespace gpuops
