// Flash attention backward on Hopper (variant 'wgmma': sm_90a, fp16/bf16 storage, fp32
// accumulation): the tensor-core backward of flash_bwd_mma.cu (FlashAttention-2's algorithm, dq
// by fp32 atomics) on warpgroup MMA, with the producer / consumer structure of the wgmma forward
// (flash_fwd_wgmma.cu) and gpuops' Hopper building blocks (common/wgmma.cuh).
//
//  * One block of 3 warpgroups per (batch x kv head, 128 keys): warpgroup 0 is the producer (one
//    thread issues every TMA load; setmaxnreg gives its registers away), warpgroups 1 and 2 are
//    consumers of 64 keys each (240 registers). K and V (128 x D) are loaded once; the block
//    walks the query tiles of 64 rows (of every query head of the GQA group) that can see its
//    keys, their Q, dO (TMA boxes) and lse2, D (1-D bulk copies from the padded statistics)
//    streaming through a 2-stage ring with "full" / "empty" mbarriers.
//  * Per query tile, consumer warpgroup cg (keys 64 cg .. 64 cg + 63 of the block):
//      S^T  = K_cg Q^T,  dP^T = V_cg dO^T        wgmma m64n64k16, both operands K-major in
//                                                 shared memory (keys as M: P^T and dS^T come
//                                                 out in the A-register layout of the next two)
//      P^T  = exp2(S^T scale log2 e - lse2),  dS^T = P^T (dP^T - D)   (fp32 registers; visibility
//                                                 only on the tiles that need it)
//      dV  += P^T dO,  dK += dS^T Q               wgmma m64nDk16, A from registers (P^T, dS^T
//                                                 rounded to T), dO / Q N-major (trans-b)
//      dS^T -> shared memory (one of two buffers, alternating per tile), then
//      dQ   = dS K                               wgmma m64n64k16 from shared memory, dS from the
//                                                 dS^T tile M-major (trans-a), K N-major; D = 128:
//                                                 warpgroup cg takes head-dim columns 64 cg ..
//                                                 over all 128 keys (both warpgroups' dS^T: one
//                                                 named barrier of the two); D = 64: all 64
//                                                 columns over its own 64 keys (no barrier across
//                                                 warpgroups; twice the atomics of a split by
//                                                 columns, which N = 32 boxes would need)
//      dq_acc += scale dQ                         the fp32 partial -> shared memory, then (at
//                                                 the next tile's start, under its first
//                                                 products) one bulk reduce-add
//                                                 (cp.reduce.async.bulk .add.f32, done at L2)
//                                                 of the 16 KiB per warpgroup into a
//                                                 tile-major accumulator
//                                                 (FlashAttention-3's dq_accum; run 44: fp32
//                                                 atomics from registers, 16 red.v2 per thread
//                                                 and tile, cost 34-40% of the kernel), which
//                                                 flash_bwd_wgmma_dq_convert turns into dq
//    and at the end dK * scale and dV rounded to T go to global memory.
//  * The statistics come from flash_bwd_wgmma_prep (below): [2][B Hq][seq_pad] with seq_pad =
//    sq rounded up to 64 (query tiles start at multiples of 64, so each tile's lse2 and D are
//    one aligned 256-byte bulk copy each; rows past sq hold D = 0, lse2 = +inf).
//  * Grid: 1-D, the key blocks of one (b, kv head) consecutive, so a wave holds few heads and a
//    head's Q / dO (read by every key block of it) come from L2 after the first block's reads.
//
// Same semantics as flash_bwd_mma.cu (P and dS rounded to T before their products, everything
// else fp32; a row with lse = -inf contributes nothing). What it does not take (the host routes
// these to 'mma'): attn_mask, head dims other than 64 / 128, operands TMA cannot describe.
#include "attention/flash_bwd.cuh"
#include "common/mma.cuh"
#include "common/opaque.cuh"
#include "common/wgmma.cuh"

namespace gpuops {

constexpr int kWgbBC = 128;             // keys per block (2 consumer warpgroups x 64)
constexpr int kWgbBR = 64;              // query rows per tile
// Q / dO ring depth. 3 stages (which fit at D = 128 with 456 bytes to spare) measured the same
// as 2 in run 53 (-1.1% / +0.8% / -2%, within run-to-run spread): the ~250 cycles per tile
// between the loop's top and "Q / dO landed" in the traces are not a wait for the loads.
constexpr int kWgbStages = 2;
constexpr int kWgbThreads = 384;
constexpr int kWgbProducerRegs = 24, kWgbConsumerRegs = 240;
// named barriers: 1 the dS^T exchange (D = 128, 256 threads) or 1 + cg (D = 64, 128), 3 + cg
// the dQ staging (128), kWgbTurnBar + cg warpgroup cg's turn (PINGPONG, 256)
constexpr int kWgbTurnBar = 5;
static_assert((2 * kWgbConsumerRegs + kWgbProducerRegs) * 128 <= 65536, "register file");

// rows per (b, h) of the padded statistics
__device__ __forceinline__ int wgb_seq_pad(int sq) { return (sq + kWgbBR - 1) / kWgbBR * kWgbBR; }

// Shared memory from a 1024-byte aligned base: K, V as D / 64 boxes of [128 keys][64]; per
// stage Q, dO as D / 64 boxes of [64 rows][64]; two dS^T buffers [128 keys][64 queries]; the
// two consumer warpgroups' dQ partials [64 x 64] fp32 (in fragment order, see wgb_dq_index);
// per stage lse2 [64], D [64] (fp32); the barriers.
template <int D>
struct WgbLayout {
  static constexpr int kDC = D / 64;
  static constexpr int kKBox = kWgbBC * 128;          // 16 KiB
  static constexpr int kQBox = kWgbBR * 128;          // 8 KiB
  static constexpr int kK = kDC * kKBox;
  static constexpr int kQ = kDC * kQBox;
  static constexpr int kDs = kWgbBC * kWgbBR * 2;     // 16 KiB
  static constexpr int kStats = 2 * kWgbBR * 4;       // 512 bytes
  static constexpr int kKOff = 0, kVOff = kK;
  static constexpr int kStageOff = 2 * kK;            // stage s: Q at + 2 kQ s, dO at + kQ
  static constexpr int kDsOff = kStageOff + kWgbStages * 2 * kQ;
  static constexpr int kDq = 64 * 64 * 4;              // a warpgroup's dQ partial, fp32: 16 KiB
  static constexpr int kDqOff = kDsOff + 2 * kDs;     // consumer warpgroup cg's at + cg kDq
  static constexpr int kStatsOff = kDqOff + 2 * kDq;
  static constexpr int kBar = kStatsOff + kWgbStages * kStats;
  // kv_full, then full[S], empty[S]
  static constexpr int kBytes = kBar + (1 + 2 * kWgbStages) * 8 + 1024;
  static_assert(kBytes <= 227 * 1024, "shared memory");
};

// The block's keys and the query tiles that can see them. Tile it (< total = group x ntq): query
// head hk group + it / ntq, rows q0 = ilo + 64 (it % ntq) ..; ilo is a multiple of 64.
struct WgbWork {
  int b, hk, k0, ilo, ntq, total;
  __device__ __forceinline__ explicit WgbWork(const FlashBwdArgs& a) {
    const int nkb = (a.sk + kWgbBC - 1) / kWgbBC;
    const int bh = static_cast<int>(blockIdx.x) / nkb;
    const int hkv = a.hq / a.group;
    b = bh / hkv;
    hk = bh - b * hkv;
    k0 = (static_cast<int>(blockIdx.x) - bh * nkb) * kWgbBC;
    const int klast = attn_imin(k0 + kWgbBC, a.sk) - 1;
    int lo = 0, hi = a.sq;
    if (a.right >= 0) lo = attn_imax(0, k0 - a.right) / kWgbBR * kWgbBR;
    if (a.left >= 0) hi = attn_imin(a.sq, klast + a.left + 1);
    ilo = lo;
    ntq = hi > lo ? (hi - lo + kWgbBR - 1) / kWgbBR : 0;
    total = a.group * ntq;
  }
  __device__ __forceinline__ void tile(const FlashBwdArgs& a, int it, int& h, int& q0) const {
    const int gi = it / ntq;
    h = hk * a.group + gi;
    q0 = ilo + (it - gi * ntq) * kWgbBR;
  }
};

// Which scores of an edge tile the lane's rows may see, as a bit mask: bit 4 jj + 2 hr + e for
// key wk0 + g + 8 hr and query q0 + 8 jj + 2 t + e (the accumulator position of the pair); 0
// where the key is invisible to the query (window / causal bounds, the key and query tails).
// One register for the whole tile, so the edge path costs no more registers than the interior.
__device__ __forceinline__ unsigned int wgb_visible(const FlashBwdArgs& a, int wk0, int q0, int t,
                                                    int g) {
  const int i0 = q0 + 2 * t;
  unsigned int vis = 0u;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int j = wk0 + g + 8 * hr;
    // query i0 + c (c = 8 jj + e) sees key j iff lo <= c <= hi
    const int lo = a.right >= 0 ? j - a.right - i0 : 0;
    int hi = a.sq - 1 - i0;
    if (a.left >= 0) hi = attn_imin(hi, j + a.left - i0);
    if (j >= a.sk) hi = -1;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 8 * jj + e;
        if (c >= lo && c <= hi) vis |= 1u << (4 * jj + 2 * hr + e);
      }
  }
  return vis;
}

// The dq accumulator of the wgmma backward: [B Hq][seq_pad / 64 tiles][64 x D] fp32, each
// tile's 64 x D block in the order the warpgroups' dQ fragments are staged (one contiguous bulk
// reduction each): column block cb (64 columns; D = 64: one) at cb 4096, inside it the float
// pair (r, 8 j + 2 t) of warp r / 16, lane 4 (r % 8) + t, fragment pair 2 j + (r / 8) % 2 at
// pair index (2 j + (r / 8) % 2) 128 + 32 (r / 16) + 4 (r % 8) + t. Returns the float index of
// (row r of the tile, column c) for c even.
__device__ __forceinline__ int wgb_dq_index(int r, int c) {
  const int cb = c >> 6, j = (c & 63) >> 3, t = (c & 7) >> 1;
  const int pair = (2 * j + ((r >> 3) & 1)) * 128 + 32 * (r >> 4) + 4 * (r & 7) + t;
  return cb * 4096 + 2 * pair;
}

// The statistics of the wgmma backward (padded rows: see the top of this file), the whole
// tile-major dq accumulator zeroed: bwd_prep_vec (flash_bwd.cuh) with seq = sq rounded up to 64.
template <class T, int D>
__global__ void __launch_bounds__(128) flash_bwd_wgmma_prep(const FlashBwdArgs a) {
  bwd_prep_vec<T, D, true>(a, wgb_seq_pad(a.sq));
}

// dq (storage type, strides dqs; rows 16-byte aligned) from the tile-major accumulator: D / 8
// lanes per row, 8 columns each = 4 consecutive float pairs of the accumulator.
template <class T, int D>
__global__ void __launch_bounds__(128) flash_bwd_wgmma_dq_convert(const FlashBwdArgs a) {
  const long long rows = static_cast<long long>(a.batch) * a.hq * a.sq;
  int b, h, i;
  if (bwd_vec_row<D>(a, a.sq, b, h, i) >= rows) return;
  const int c = (threadIdx.x % (D / 8)) * 8;
  const long long tile = (static_cast<long long>(b) * a.hq + h) * wgb_seq_pad(a.sq) + (i & ~63);
  bwd_convert8(static_cast<T*>(a.dq) + b * a.dqs[0] + h * a.dqs[1] + i * a.dqs[2] + c,
               a.dq_acc + tile * D + wgb_dq_index(i & 63, c));
}

// PROBE: 0 in every launch gpuops makes. Timing probes of
// benchmarks/experiments/attention_bwd_wgmma_probe.py (wrong results by design) leave parts out:
// bit 0 the dq reduction (staging + bulk reduce-add), bit 1 the whole dQ phase (dS^T store,
// barrier, product, reduction), bit 2 the elementwise P^T / dS^T math (P^T = S^T, dS^T = dP^T);
// bit 3 (a trace, not a leave-out): thread 0 of each consumer warpgroup of block gridDim.x / 2
// writes clock64() at 8 points of each query-tile iteration into the statistics buffer (as int64
// [cg][tile][8]; the gradients are garbage then).
// PINGPONG (host: attention_backward.WGMMA_PINGPONG): the two consumer warpgroups take turns
// issuing their S^T / dP^T products (named barriers kWgbTurnBar + cg), so the second
// warpgroup's products run under the first one's P^T / dS^T math instead of both warpgroups
// doing that math at once while the tensor cores idle (run 51's trace: the warpgroups in
// lockstep, ~950 of 4440 cycles per tile in that math).
template <class T, int D, bool PINGPONG, int PROBE>
__global__ void __launch_bounds__(kWgbThreads, 1)
    flash_bwd_wgmma(const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,
                    const __grid_constant__ TmaDesc tma_v, const __grid_constant__ TmaDesc tma_do,
                    const FlashBwdArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(sizeof(T) == 2 && (D == 64 || D == 128), "head dims 64 and 128, 16-bit types");
  using L = WgbLayout<D>;
  constexpr bool kSplitCols = D == 128;   // dQ: warpgroups split the head dim (else the keys)
  extern __shared__ __align__(16) unsigned char wgb_smem_raw[];
  const unsigned int raw = smem_u32(wgb_smem_raw);
  const unsigned int sbase = raw + ((1024u - (raw & 1023u)) & 1023u);
  const unsigned int k_s = sbase + L::kKOff, v_s = sbase + L::kVOff;
  const unsigned int kv_bar = sbase + L::kBar;
  const unsigned int full_bar = kv_bar + 8, empty_bar = full_bar + 8 * kWgbStages;
  auto q_tile = [&](int stage) { return sbase + L::kStageOff + stage * 2 * L::kQ; };
  auto do_tile = [&](int stage) { return sbase + L::kStageOff + stage * 2 * L::kQ + L::kQ; };
  auto stats_tile = [&](int stage) { return sbase + L::kStatsOff + stage * L::kStats; };
  auto ds_tile = [&](int buf) { return sbase + L::kDsOff + buf * L::kDs; };

  const int tid = threadIdx.x, wg = tid / 128;
  if (tid == 0) {
    mbar_init(kv_bar, 1);
#pragma unroll
    for (int s = 0; s < kWgbStages; ++s) {
      mbar_init(full_bar + 8 * s, 1);      // the producer's arrive.expect_tx (+ the bytes)
      mbar_init(empty_bar + 8 * s, 8);     // one arrive per consumer warp
    }
    mbar_fence_init();
    tma_prefetch_desc(&tma_q);
    tma_prefetch_desc(&tma_k);
    tma_prefetch_desc(&tma_v);
    tma_prefetch_desc(&tma_do);
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------------ producer warpgroup
    setmaxnreg_dec<kWgbProducerRegs>();
    if (tid == 0) {
      const FlashBwdArgs& a = args;
      const WgbWork w(a);
      mbar_arrive_expect_tx(kv_bar, 2 * L::kK);
#pragma unroll
      for (int dc = 0; dc < L::kDC; ++dc) {
        tma_load_4d(k_s + dc * L::kKBox, &tma_k, kv_bar, 64 * dc, w.k0, w.hk, w.b);
        tma_load_4d(v_s + dc * L::kKBox, &tma_v, kv_bar, 64 * dc, w.k0, w.hk, w.b);
      }
      const int seq = wgb_seq_pad(a.sq);
      const long long rows = static_cast<long long>(a.batch) * a.hq * seq;
      for (int it = 0; it < w.total; ++it) {
        const int stage = it % kWgbStages;
        mbar_wait(empty_bar + 8 * stage, ((it / kWgbStages) & 1) ^ 1);
        int h, q0;
        w.tile(a, it, h, q0);
        const unsigned int fb = full_bar + 8 * stage;
        mbar_arrive_expect_tx(fb, 2 * L::kQ + L::kStats);
#pragma unroll
        for (int dc = 0; dc < L::kDC; ++dc) {
          tma_load_4d(q_tile(stage) + dc * L::kQBox, &tma_q, fb, 64 * dc, q0, h, w.b);
          tma_load_4d(do_tile(stage) + dc * L::kQBox, &tma_do, fb, 64 * dc, q0, h, w.b);
        }
        const float* srow = a.stats + (static_cast<long long>(w.b) * a.hq + h) * seq + q0;
        bulk_load_1d(stats_tile(stage), srow + rows, kWgbBR * 4, fb);       // lse2
        bulk_load_1d(stats_tile(stage) + kWgbBR * 4, srow, kWgbBR * 4, fb);  // D
      }
    }
    return;
  }

  // -------------------------------------------------------------------- consumer warpgroups
  setmaxnreg_inc<kWgbConsumerRegs>();
  const FlashBwdArgs& a = args;
  const WgbWork w(a);
  const int cg = wg - 1;                          // keys 64 cg .. 64 cg + 63 of the block
  const int ctid = tid - 128 * wg, cwarp = ctid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const int wk0 = w.k0 + 64 * cg + 16 * cwarp;    // the warp's first key
  const float sl2 = a.scale_log2;
  unsigned char* smem = wgb_smem_raw + (sbase - raw);

  // descriptors (common/wgmma.cuh): K-major operands (K_cg, V_cg as A; Q, dO as B of S^T, dP^T)
  // step 32 bytes per k16 inside a box, the next box every 4 steps; N-major B (dO, Q of dV, dK:
  // k = query rows; K of dQ: k = keys) and the M-major A (dS from dS^T: k = keys) step 16 rows
  // (2048 bytes), LBO = the next 64 columns (the next box)
  auto kmaj = [](unsigned int tile, int box, int kk) {
    return wgmma_desc(tile + (kk >> 2) * box + (kk & 3) * 32, 16, 1024);
  };
  auto mnmaj = [](unsigned int tile, int box, int kk) {
    return wgmma_desc(tile + kk * 2048, box, 1024);
  };

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.0f;
  unsigned int pf[4][4], sf[4][4];
  // pins dV, dK and their A operands P^T, dS^T (read by the products until they complete)
  auto fence_dkdv = [&]() {
    reg_fence(dv);
    reg_fence(dk);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      reg_fence(pf[kk]);
      reg_fence(sf[kk]);
    }
  };

  // dQ: D = 128, warpgroup cg's 64 head-dim columns over the block's 128 keys (K box cg);
  // D = 64, all columns over its own 64 keys (rows 64 cg .. of dS^T and of K)
  constexpr int kDqSteps = kSplitCols ? kWgbBC / 16 : 64 / 16;
  const unsigned int dq_a_off = kSplitCols ? 0u : cg * 8192u;
  const unsigned int dq_b = k_s + (kSplitCols ? cg * L::kKBox : cg * 8192);
  const int seq = wgb_seq_pad(a.sq);
  const unsigned int dq_stage = sbase + L::kDqOff + cg * L::kDq;
  float2* dq_stage_p = reinterpret_cast<float2*>(smem + L::kDqOff + cg * L::kDq);

  // dq_acc += scale dQ of a tile whose fragments are in the staging buffer: the warpgroup's
  // barrier, then one bulk reduce-add of its 16 KiB into the tile's block of the accumulator
  // (wgb_dq_index); D = 64: both warpgroups' partials (their own keys) add into one block.
  // Issued at the next tile's start, after its S^T / dP^T products (the barrier waits under
  // them), and after the loop for the last tile.
  auto reduce_dq = [&](int h, int q0) {
    if (PROBE & 3) return;
    named_bar_sync(3 + cg, 128);
    if (ctid == 0) {
      float* dst_acc = a.dq_acc + ((static_cast<long long>(w.b) * a.hq + h) * seq + q0) * D +
                       (kSplitCols ? 4096 * cg : 0);
      bulk_reduce_add_f32(dst_acc, dq_stage, L::kDq);
      bulk_commit();
    }
  };
  int prev_h = 0, prev_q0 = 0;
  // PINGPONG turns (as the forward's, flash_fwd_wgmma.cu): warpgroup 0 goes first (warpgroup 1
  // arrives once up front) and syncs once more after the loop, so every arrival is consumed
  auto turn_begin = [&]() {
    if (PINGPONG) named_bar_sync(kWgbTurnBar + cg, 256);
  };
  auto turn_end = [&]() {
    if (PINGPONG) named_bar_arrive(kWgbTurnBar + (cg ^ 1), 256);
  };
  if (PINGPONG && cg == 1) named_bar_arrive(kWgbTurnBar, 256);
  long long* trace = reinterpret_cast<long long*>(a.stats);
  const bool tracer = (PROBE & 8) && ctid == 0 && blockIdx.x == gridDim.x / 2;
  auto mark = [&](int it, int ev) {
    if ((PROBE & 8) && tracer && it < 512) trace[cg * 4096 + it * 8 + ev] = clock64();
  };

  mbar_wait(kv_bar, 0);
  for (int it = 0; it < w.total; ++it) {
    mark(it, 0);
    const int stage = it % kWgbStages;
    int h, q0;
    w.tile(a, it, h, q0);
    mbar_wait(full_bar + 8 * stage, (it / kWgbStages) & 1);
    mark(it, 1);
    const unsigned int qt = q_tile(stage), dot = do_tile(stage);

    // S^T = K_cg Q^T, dP^T = V_cg dO^T. The accumulators are per tile (not carried across
    // tiles, so they hold no registers outside their products); their first k step writes them
    // without reading them (wgmma_ss_m64n64k16_first).
    float s[32], dp[32], dq[32];
    // the loop-invariant K_cg / V_cg addresses are recomputed per tile (opaque): hoisted, their
    // descriptors (2 x D / 16 64-bit values) spill
    unsigned int k_cg = k_s + cg * 8192, v_cg = v_s + cg * 8192;
    opaque(k_cg);
    opaque(v_cg);
    turn_begin();
    wgmma_fence();
    wgmma_ss_m64n64k16_first<T, 0, 0>(s, kmaj(k_cg, L::kKBox, 0), kmaj(qt, L::kQBox, 0));
#pragma unroll
    for (int kk = 1; kk < D / 16; ++kk)
      wgmma_ss_m64n64k16<T, 0, 0>(s, kmaj(k_cg, L::kKBox, kk), kmaj(qt, L::kQBox, kk));
    wgmma_ss_m64n64k16_first<T, 0, 0>(dp, kmaj(v_cg, L::kKBox, 0), kmaj(dot, L::kQBox, 0));
#pragma unroll
    for (int kk = 1; kk < D / 16; ++kk)
      wgmma_ss_m64n64k16<T, 0, 0>(dp, kmaj(v_cg, L::kKBox, kk), kmaj(dot, L::kQBox, kk));
    wgmma_commit();
    turn_end();
    reg_fence(s);
    reg_fence(dp);
    // the previous tile's dq reduction, under this tile's S^T / dP^T products
    if (it > 0) reduce_dq(prev_h, prev_q0);
    mark(it, 2);

    const float* lse2s = reinterpret_cast<const float*>(smem + L::kStatsOff + stage * L::kStats);
    const float* dis = lse2s + kWgbBR;
    const bool edge = wk0 + 15 >= a.sk || q0 + kWgbBR - 1 >= a.sq ||
                      (a.left >= 0 && q0 + kWgbBR - 1 > wk0 + a.left) ||
                      (a.right >= 0 && wk0 + 15 > q0 + a.right);
    wgmma_wait<0>();
    reg_fence(s);
    reg_fence(dp);
    mark(it, 3);
    const unsigned int vis = edge ? wgb_visible(a, wk0, q0, t, g) : ~0u;
#pragma unroll
    for (int jj = 0; jj < 8 && !(PROBE & 4); ++jj) {
      const float2 l2 = *reinterpret_cast<const float2*>(lse2s + 8 * jj + 2 * t);
      const float2 di = *reinterpret_cast<const float2*>(dis + 8 * jj + 2 * t);
#pragma unroll
      for (int x = 4 * jj; x < 4 * jj + 4; ++x) {
        float p = attn_exp2(fmaf(s[x], sl2, (x & 1) ? -l2.y : -l2.x));
        float ds = p * (dp[x] - ((x & 1) ? di.y : di.x));
        if (edge && !(vis & (1u << x))) p = ds = 0.0f;
        dp[x] = ds;
        s[x] = p;
      }
    }
    // P^T, dS^T as A fragments: k step kk = queries 16 kk .. 16 kk + 15 = the n8 blocks 2 kk,
    // 2 kk + 1 of the accumulators
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        pf[kk][r] = pack_b16x2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
        sf[kk][r] = pack_b16x2<T>(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);
      }
    }

    // dV += P^T dO, dK += dS^T Q (A from registers, dO / Q N-major)
    fence_dkdv();
    mark(it, 4);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs_m64k16<T, D>(dv, pf[kk], mnmaj(dot, L::kQBox, kk), 1);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs_m64k16<T, D>(dk, sf[kk], mnmaj(qt, L::kQBox, kk), 1);
    wgmma_commit();
    reg_fence(dv);
    reg_fence(dk);

    // dS^T -> this tile's buffer: row r = key, 64 queries in 128 bytes, 16-byte chunk jj of row
    // r at jj ^ (r % 8) (the 128-byte swizzle; r % 8 = g). The buffers alternate: the other
    // warpgroup may still be reading the previous tile's (it passed this tile's barrier only
    // after its own previous dQ product completed).
    const unsigned int dst = ds_tile(it & 1);
    unsigned char* ds_p = smem + (dst - sbase);
    if (PROBE & 2) {
      wgmma_wait<0>();
      fence_dkdv();
      if (lane == 0) mbar_arrive(empty_bar + 8 * stage);
      continue;
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = 64 * cg + 16 * cwarp + g + 8 * hr;
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
        *reinterpret_cast<unsigned int*>(ds_p + r * 128 + ((jj ^ g) << 4) + 4 * t) =
            sf[jj >> 1][2 * (jj & 1) + hr];
    }
    fence_proxy_async_smem();          // the stores above, before wgmma reads them
    // the previous tile's bulk reduction (issued at this tile's start) has read this
    // warpgroup's dQ staging buffer (the barrier below tells the other threads)
    if (ctid == 0) bulk_wait_read<0>();
    if (kSplitCols)
      named_bar_sync(1, 256);          // both warpgroups' dS^T
    else
      named_bar_sync(1 + cg, 128);     // this warpgroup's own rows
    mark(it, 5);

    // dQ = dS K
    unsigned int dq_bt = dq_b;
    opaque(dq_bt);
    wgmma_fence();
    wgmma_ss_m64n64k16_first<T, 1, 1>(dq, mnmaj(dst + dq_a_off, 8192, 0),
                                      mnmaj(dq_bt, L::kKBox, 0));
#pragma unroll
    for (int kk = 1; kk < kDqSteps; ++kk)
      wgmma_ss_m64n64k16<T, 1, 1>(dq, mnmaj(dst + dq_a_off, 8192, kk), mnmaj(dq_bt, L::kKBox, kk));
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(dq);
    fence_dkdv();
    mark(it, 6);
    if (lane == 0) mbar_arrive(empty_bar + 8 * stage);

    // scale dQ -> the staging buffer, fragments in order (float pair 128 (2 j + hr) + ctid:
    // consecutive lanes, consecutive 8-byte words); reduced at the next tile's start
    if (!(PROBE & 1)) {
#pragma unroll
      for (int j2 = 0; j2 < 16; ++j2)
        dq_stage_p[j2 * 128 + ctid] = make_float2(dq[2 * j2] * a.scale, dq[2 * j2 + 1] * a.scale);
      fence_proxy_async_smem();        // the stores above, before the bulk copy reads them
    }
    mark(it, 7);
    prev_h = h;
    prev_q0 = q0;
  }
  if (w.total > 0) reduce_dq(prev_h, prev_q0);
  if (PINGPONG && cg == 0) named_bar_sync(kWgbTurnBar, 256);
  if (ctid == 0) bulk_wait<0>();       // the reductions done before the block's exit

  // dK = scale dS^T Q, dV = P^T dO: element pairs (key j, columns 8 n + 2 t, + 1)
  T* dkp = static_cast<T*>(a.dk) + w.b * a.dks[0] + w.hk * a.dks[1] + 2 * t;
  T* dvp = static_cast<T*>(a.dv) + w.b * a.dvs[0] + w.hk * a.dvs[1] + 2 * t;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int j = wk0 + g + 8 * hr;
    if (j >= a.sk) continue;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<unsigned int*>(dkp + j * a.dks[2] + 8 * n) =
          pack_b16x2<T>(dk[4 * n + 2 * hr] * a.scale, dk[4 * n + 2 * hr + 1] * a.scale);
      *reinterpret_cast<unsigned int*>(dvp + j * a.dvs[2] + 8 * n) =
          pack_b16x2<T>(dv[4 * n + 2 * hr], dv[4 * n + 2 * hr + 1]);
    }
  }
#else
  __trap();   // not reached: the module is built for sm_90a only
#endif
}

}  // namespace gpuops
