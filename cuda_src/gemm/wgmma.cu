// GEMM ladder, step 6 (`variant='wgmma'`, Hopper sm_90a only, fp16/bf16 in, fp32 accumulate).
// What it adds over `mma` (mma.sync + cp.async, every warp both loads and multiplies):
//  * warpgroup MMA (wgmma.mma_async.m64n256k16): the tensor cores read both operands straight
//    from shared memory through matrix descriptors; no ldmatrix, no fragment registers, and
//    the MMAs run asynchronously to the issuing warps;
//  * TMA loads (cp.async.bulk.tensor) from tensor maps encoded on the host: one thread issues a
//    whole 128x64 or 256x64 tile with one instruction, the hardware does the address math, the
//    bounds (out-of-range elements arrive as zeros: M/N/K tails need no code) and the 128-byte
//    swizzle that wgmma reads without bank conflicts;
//  * warp specialization: warpgroup 0 is the producer (one thread issues TMA, setmaxnreg gives
//    its registers away), warpgroups 1 and 2 are consumers (64 rows x 256 columns each, 128 fp32
//    accumulators per thread, 232 registers); a 4-stage ring of shared memory with mbarrier
//    "full" (TMA bytes landed) and "empty" (both consumers done reading) barriers per stage
//    replaces __syncthreads;
//  * persistent blocks: one block per SM walks output tiles (grouped along M for L2 reuse) over
//    the whole batch, so the producer already loads the next tile while the consumers run the
//    epilogue of the current one.
// Block tile 128 x 256 x 64 (BK = 64 elements = one 128-byte swizzle row); per stage 48 KiB
// (A 16 KiB + B 32 KiB), 4 stages = 192 KiB. Both operand layouts of each of A and B are read in
// place: K-major (a row-major A, a Linear weight) or M-/N-major (a.T views, a row-major [K, N]
// B) through wgmma's transpose bits. The host requires what TMA requires (unit stride along one
// dim, 16-byte aligned base and strides) and otherwise uses `mma` (see ops/gemm.py).
//
// Epilogue (the family's: act(alpha * acc + bias) + residual in fp32, one rounding): each warp
// stages 16 rows x 32 columns of its accumulators at a time in shared memory (its own slice, so
// only __syncwarp), then stores rows in 64-byte runs (coalesced), with the next chunk's bias and
// residual loaded before the current chunk's math. The chunk loop is rolled: the accumulators
// shift down by 16 registers per chunk, so the activation code exists once.
//
// Configurations (template EPI / CL; ops/gemm.py WGMMA_CONFIGS, PLAN["wgmma"]), for A/B runs:
//  * EPI = 1 'direct' epilogue (wg_epilogue_fragments): whole tiles of a 16-bit C go from the
//    fragments to global memory without staging (the tensor cores idle during the epilogue,
//    since both consumer warpgroups finish a tile together: it must be short);
//  * EPI = 3 'tma_store' epilogue (kernel gemm_wgmma_tmastore, a third tensor map for C): each
//    warp hands 32-column chunks of its rows to the TMA unit (tensor-map store from shared
//    memory) and goes on to the next tile while they drain;
//  * CL = 2 (gemm_wgmma_mc2, __cluster_dims__(2, 1, 1)): CTA pairs take two tiles along M that
//    share B; each CTA loads half of B's stage and multicasts it to both (L2 -> SM traffic per
//    k-tile 48 -> 32 KiB); a stage is free when the consumers of both CTAs are done with it.
#include "gemm/gemm_common.cuh"
#include "gemm/wgmma_common.cuh"
#include "common/opaque.cuh"

namespace gpuops {
namespace gemm {

constexpr int kWgBM = 128, kWgBN = 256, kWgBK = 64, kWgStages = 4;
constexpr int kWgThreads = 384;                           // producer + 2 consumer warpgroups
constexpr int kWgABytes = kWgBM * kWgBK * 2;              // 16 KiB
constexpr int kWgBBytes = kWgBN * kWgBK * 2;              // 32 KiB
constexpr int kWgStageBytes = kWgABytes + kWgBBytes;
constexpr int kWgBoxBytes = 64 * 64 * 2;                  // one M/N-major TMA box: 64 x 64
constexpr int kWgEpiLd = 40;                              // floats per staged row (32 + 8 pad)
constexpr int kWgEpiWarpBytes = 16 * kWgEpiLd * 4;
constexpr int kWgEpiOffset = kWgStages * kWgStageBytes;
constexpr int kWgBarOffset = kWgEpiOffset + 8 * kWgEpiWarpBytes;
// dynamic shared memory the host must request: ring, epilogue staging, 2 barriers per stage,
// and 1 KiB of slack to align the ring to 1024 bytes (the 128-byte swizzle pattern's period)
constexpr int kWgSmemBytes = kWgBarOffset + 2 * kWgStages * 8 + 1024;
static_assert(kWgSmemBytes <= 227 * 1024, "wgmma shared memory exceeds sm_90's 227 KiB");

constexpr int kWgProducerRegs = 40, kWgConsumerRegs = 232;
static_assert((2 * kWgConsumerRegs + kWgProducerRegs) * 128 <= 65536, "register file");

// The work of one launch: batch x tiles_m x tiles_n output tiles (the host keeps the count below
// 2^31), ktiles steps of K each, walked in units of CL tiles stacked along M (CL = cluster size:
// the CTAs of a cluster take the CL tiles of one unit, which share their B columns). Computed by
// each warpgroup after its setmaxnreg: a value live across setmaxnreg would be spilled by ptxas.
template <int CL>
struct WgShape {
  int tiles_m, tiles_n, units_m, units_per_z, work, ktiles;
  bool batched;
  __device__ __forceinline__ explicit WgShape(const GemmArgs& p) {
    tiles_m = (int)((p.M + kWgBM - 1) / kWgBM);
    tiles_n = (int)((p.N + kWgBN - 1) / kWgBN);
    units_m = (tiles_m + CL - 1) / CL;
    units_per_z = units_m * tiles_n;
    work = units_per_z * (int)p.batch;
    ktiles = (int)((p.K + kWgBK - 1) / kWgBK);
    batched = p.batch > 1;
  }
};

// The output tile and batch matrix of work unit u, for the CTA of cluster rank `rank`.
struct WgTile {
  long long z, m0, n0;
};

template <int CL>
__device__ __forceinline__ WgTile wg_tile(const WgShape<CL>& sh, int u, int rank) {
  WgTile t;
  const int z = u / sh.units_per_z;
  int um, tn;
  tile_coords(u - z * sh.units_per_z, sh.units_m, sh.tiles_n, um, tn);
  t.z = z;
  t.m0 = (long long)(um * CL + rank) * kWgBM;
  t.n0 = (long long)tn * kWgBN;
  return t;
}

// The tensor-map coordinates of matrix z's batch dims (outermost last, as the host encodes
// them); a dim the operand broadcasts over (stride 0) has extent 1 in its map: coordinate 0.
__device__ __forceinline__ void batch_coords(const GemmArgs& p, long long z, const long long* sb,
                                             int (&c)[3]) {
  const long long i2 = z % p.bshape[2];
  const long long t = z / p.bshape[2];
  const long long i1 = t % p.bshape[1];
  const long long i0 = t / p.bshape[1];
  c[0] = sb[2] != 0 ? (int)i2 : 0;
  c[1] = sb[1] != 0 ? (int)i1 : 0;
  c[2] = sb[0] != 0 ? (int)i0 : 0;
}

__device__ __forceinline__ void tma_load(unsigned int dst, const TmaDesc* desc, unsigned int bar,
                                         int c0, int c1, bool batched, const int (&bc)[3]) {
  if (batched) tma_load_5d(dst, desc, bar, c0, c1, bc[0], bc[1], bc[2]);
  else tma_load_2d(dst, desc, bar, c0, c1);
}

// tma_load into the same offset of every CTA of the cluster (a plain load when CL == 1).
template <int CL>
__device__ __forceinline__ void tma_load_all(unsigned int dst, const TmaDesc* desc,
                                             unsigned int bar, int c0, int c1, bool batched,
                                             const int (&bc)[3]) {
  if constexpr (CL == 1) {
    tma_load(dst, desc, bar, c0, c1, batched, bc);
  } else {
    constexpr unsigned short kMask = (1u << CL) - 1;
    if (batched) tma_load_5d_mc(dst, desc, bar, c0, c1, bc[0], bc[1], bc[2], kMask);
    else tma_load_2d_mc(dst, desc, bar, c0, c1, kMask);
  }
}

// Epilogues 'direct' (EPI = 1) and 'tma_store' (EPI = 3), straight from the accumulator
// fragments: no rolled chunk loop (the staged one shifts 112 accumulator registers per 32-column
// chunk). Thread (warp w, g = lane / 4, t = lane % 4) holds rows m_base + g and + 8, columns
// n0 + 8j + 2t, + 1 (j < 32), converted to packed pairs (4 bytes).
//  * direct (kStore = kStoreDirect; tiles wholly inside N of a 16-bit C with even N; others take
//    the staged epilogue below): st.global of the pairs (a warp writes 8 rows x 16 bytes per
//    instruction). Every SM stores its 64 KiB tile in the same few microseconds (the tiles of a
//    round finish together) while its tensor cores idle: runs 27-30 measured 5.6-6.7 us per round
//    that cuBLAS does not pay.
//  * tensor (kStore = kStoreTensor; every tile of a 16-bit C with N % 8 == 0, the host checks):
//    each warp writes 32-column chunks of its 16 rows to shared memory (two 1 KiB boxes per warp,
//    in the 64-byte swizzle: 16-byte unit u of row r at u ^ ((r / 2) % 4), dense rows that TMA
//    reads and 32 distinct banks for the lanes' writes), and lane 0 hands each chunk to the TMA
//    unit as one tensor-map box (cp.async.bulk.tensor store, rows past M / columns past N
//    clipped): the warp goes on to the next chunk, and after the last to the next tile's MMAs,
//    while the stores drain. A box is rewritten only after its previous store has read it
//    (bulk_wait_read<1>). Run 30: fixed cost per round ~0 (direct 6.6 us). An intermediate form
//    (run 28-29, 'bulk': 16 row copies of 64 bytes per chunk) kept ~4-5 us: the TMA unit working
//    through 1024 small requests per tile.
// kFused = false: no bias / residual / activation (the bare product: alpha only). kFused: the bias
// and residual of the next 16 columns are loaded before the current 16 are computed (24 registers
// of lookahead); the activation A is chosen once per tile (one instantiation per activation:
// straight-line code, no per-element jump table). With tensor stores the per-chunk proxy fence
// appears to wait for those lookahead loads (run 30: bias +37%, residual +39% over bare, direct
// -5% / +17.5%): the host sends fused calls to 'direct'.
constexpr int kStoreDirect = 0, kStoreTensor = 1;
constexpr int kWgBoxRowBytes = 64, kWgBoxBufBytes = 16 * kWgBoxRowBytes;
static_assert(2 * kWgBoxBufBytes <= kWgEpiWarpBytes, "two boxes per warp's staging area");
static_assert(kWgEpiWarpBytes % 512 == 0 && kWgBoxBufBytes % 512 == 0,
              "64-byte-swizzled boxes start on 512-byte boundaries");

template <class T, bool kFused, Act A, int kStore>
__device__ __forceinline__ void wg_epilogue_fragments(const GemmArgs& p, const BatchOffsets& o,
                                                      const float (&acc)[128], long long m_base,
                                                      long long n0, int lane, unsigned char* buf,
                                                      const TmaDesc* tma_c, int z) {
  constexpr bool kBulk = kStore == kStoreTensor;
  constexpr int kBufBytes = kWgBoxBufBytes;
  if (m_base >= p.M) return;                // all 16 rows of the warp lie past M (warp-uniform)
  // the lane's offsets are recomputed per tile (opaque) rather than hoisted out of the tile loop
  // and held across the main loop, where the accumulators need every register (ptxas spilled
  // them otherwise)
  unsigned int lane_u = (unsigned int)lane;
  opaque(lane_u);
  lane = (int)lane_u;
  const int g = lane >> 2, tq = lane & 3;
  const long long m_lo = m_base + g, m_hi = m_lo + 8, n_t = n0 + 2 * tq;
  const bool lo_live = m_lo < p.M, hi_live = m_hi < p.M;
  if (!kBulk && !lo_live) return;           // tensor: every lane takes part in the warp's syncs
  T* c_lo = static_cast<T*>(p.c) + o.c + m_lo * p.N + n_t;
  T* c_hi = c_lo + 8 * p.N;
  const bool has_bias = kFused && p.bias != nullptr, has_res = kFused && p.residual != nullptr;
  const T* bias = static_cast<const T*>(p.bias) + n_t * p.bias_s;
  const T* res_lo = static_cast<const T*>(p.residual) + o.r + m_lo * p.r_sm + n_t * p.r_sn;
  const T* res_hi = res_lo + 8 * p.r_sm;
  const long long n_left = p.N - n_t;        // columns of this thread's pair left in C
  float bz[2][4], rs[2][8];
  auto load = [&](int grp, float (&b)[4], float (&r)[8]) {
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const long long dn = 8 * (2 * grp + jj) + e;
        // tensor stores also take tiles that overhang N (TMA clips the store): no loads there
        const bool col_live = kStore != kStoreTensor || dn < n_left;
        b[2 * jj + e] = (has_bias && col_live) ? to_float(bias[dn * p.bias_s]) : 0.0f;
        r[4 * jj + e] = (has_res && lo_live && col_live) ? to_float(res_lo[dn * p.r_sn]) : 0.0f;
        r[4 * jj + 2 + e] =
            (has_res && hi_live && col_live) ? to_float(res_hi[dn * p.r_sn]) : 0.0f;
      }
    }
  };
  if constexpr (kFused) load(0, bz[0], rs[0]);
#pragma unroll
  for (int grp = 0; grp < 16; ++grp) {
    if constexpr (kFused) {
      if (grp + 1 < 16) load(grp + 1, bz[(grp + 1) & 1], rs[(grp + 1) & 1]);
    }
    // tensor: chunk grp / 2 (32 columns) goes to box buffer (grp / 2) & 1
    unsigned char* chunk = buf + ((grp >> 1) & 1) * kBufBytes;
    if constexpr (kBulk) {
      if ((grp & 1) == 0) {
        bulk_wait_read<1>();                // this buffer's store of two chunks ago has read it
        __syncwarp();
      }
    }
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      const int j = 2 * grp + jj;
      float lo[2], hi[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = p.alpha * acc[4 * j + e], y = p.alpha * acc[4 * j + 2 + e];
        if constexpr (kFused) {
          x = activate<A>(x + bz[grp & 1][2 * jj + e]) + rs[grp & 1][4 * jj + e];
          y = activate<A>(y + bz[grp & 1][2 * jj + e]) + rs[grp & 1][4 * jj + 2 + e];
        }
        lo[e] = x;
        hi[e] = y;
      }
      if constexpr (kStore == kStoreTensor) {
        const int unit = (grp & 1) * 2 + jj;              // 16-byte unit of the 64-byte row
        // rows g and g + 8 have the same swizzle ((g + 8) / 2 % 4 == g / 2 % 4)
        unsigned char* at = chunk + ((unit ^ ((g >> 1) & 3)) * 16) + 4 * tq;
        *reinterpret_cast<unsigned int*>(at + g * kWgBoxRowBytes) = Vec16<T>::pack2(lo[0], lo[1]);
        *reinterpret_cast<unsigned int*>(at + (g + 8) * kWgBoxRowBytes) =
            Vec16<T>::pack2(hi[0], hi[1]);
      } else {
        *reinterpret_cast<unsigned int*>(c_lo + 8 * j) = Vec16<T>::pack2(lo[0], lo[1]);
        if (hi_live)
          *reinterpret_cast<unsigned int*>(c_hi + 8 * j) = Vec16<T>::pack2(hi[0], hi[1]);
      }
    }
    if constexpr (kBulk) {
      if (grp & 1) {
        fence_proxy_async_smem();           // the st.shared above, before the TMA unit reads
        __syncwarp();
        const int ch = grp >> 1;
        // rows past M and columns past N are clipped by the map's extents, not written
        if (lane == 0)
          tma_store_3d(tma_c, smem_u32(buf) + (ch & 1) * kWgBoxBufBytes, (int)n0 + 32 * ch,
                       (int)m_base, z);
        bulk_commit();
      }
    }
  }
}

// The whole-tile epilogue with the activation as a template argument.
template <class T, int kStore>
__device__ __forceinline__ void wg_epilogue_whole(const GemmArgs& p, const BatchOffsets& o,
                                                  const float (&acc)[128], long long m_base,
                                                  long long n0, int lane, unsigned char* buf,
                                                  const TmaDesc* tma_c, int z) {
#define GPUOPS_WG_EPI(F, A) \
  wg_epilogue_fragments<T, F, A, kStore>(p, o, acc, m_base, n0, lane, buf, tma_c, z)
  if (p.bias == nullptr && p.residual == nullptr && p.act == 0) {
    GPUOPS_WG_EPI(false, Act::kIdentity);
  } else {
    switch (p.act) {
      case 1: GPUOPS_WG_EPI(true, Act::kRelu); break;
      case 2: GPUOPS_WG_EPI(true, Act::kSilu); break;
      case 3: GPUOPS_WG_EPI(true, Act::kGeluErf); break;
      case 4: GPUOPS_WG_EPI(true, Act::kGeluTanh); break;
      default: GPUOPS_WG_EPI(true, Act::kIdentity); break;
    }
  }
#undef GPUOPS_WG_EPI
}

// The kernel body. AMN: A is M-major in memory (a.T view); BMN: B is N-major (row-major [K, N]);
// otherwise K-major. EPI: 0 = staged epilogue (shared memory, rolled chunks), 1 = direct, 3 = tensor
// store (tma_c).
// CL: cluster size along M (1, or 2: the two CTAs' tiles share B; each CTA loads half of B's
// stage and multicasts it to both, halving B's L2 -> SM traffic).
template <class T, bool AMN, bool BMN, int EPI, int CL>
__device__ __forceinline__ void gemm_wgmma_body(const TmaDesc& tma_a, const TmaDesc& tma_b,
                                                const TmaDesc* tma_c, const GemmArgs& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(CL == 1 || CL == 2, "clusters of 1 or 2 CTAs along M");
  extern __shared__ __align__(16) unsigned char smem_raw[];   // aligned to 1024 by hand below
  const unsigned int raw = smem_u32(smem_raw);
  // the same padding in every CTA (the same kernel, the same static layout): multicast writes
  // and remote arrives use CTA-relative offsets
  const unsigned int pad = (1024u - (raw & 1023u)) & 1023u;
  const unsigned int sbase = raw + pad;                    // 1024-aligned shared address
  unsigned char* smem = smem_raw + pad;
  const unsigned int full_bar = sbase + kWgBarOffset;      // + 8 * stage
  const unsigned int empty_bar = full_bar + 8 * kWgStages;

  const int tid = threadIdx.x, wg = tid / 128;
  const int rank = CL > 1 ? (int)cluster_ctarank() : 0;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kWgStages; ++s) {
      mbar_init(full_bar + 8 * s, 1);       // the producer's arrive.expect_tx (+ TMA's bytes)
      mbar_init(empty_bar + 8 * s, 8 * CL); // one arrive per consumer warp of every CTA
    }
    mbar_fence_init();
    tma_prefetch_desc(&tma_a);
    tma_prefetch_desc(&tma_b);
    if constexpr (EPI == 3) tma_prefetch_desc(tma_c);
  }
  __syncthreads();
  if constexpr (CL > 1) cluster_sync_all();   // the peers' barriers exist before any multicast

  if (wg == 0) {
    // ------------------------------------------------------------------ producer warpgroup
    setmaxnreg_dec<kWgProducerRegs>();
    if (tid == 0) {
      const WgShape<CL> sh(p);
      int stage = 0;
      unsigned int phase = 0;
      for (int u = blockIdx.x / CL; u < sh.work; u += gridDim.x / CL) {
        const WgTile t = wg_tile(sh, u, rank);
        int ca[3] = {0, 0, 0}, cb[3] = {0, 0, 0};
        if (sh.batched) {
          batch_coords(p, t.z, p.a_sb, ca);
          batch_coords(p, t.z, p.b_sb, cb);
        }
        // M/N-major operands come as 64-wide boxes; boxes wholly past M / N are not loaded
        // (their rows / columns of the product are never stored, so stale shared memory there is
        // moot). With CL = 2 the second tile of a unit may lie wholly past M: no A at all (its
        // CTA still loads and multicasts its half of B).
        const bool a_live = t.m0 < p.M;
        const int a_boxes = !a_live ? 0 : AMN ? (t.m0 + 64 < p.M ? 2 : 1) : 1;
        const int b_boxes = BMN ? (int)min(4LL, (p.N - t.n0 + 63) / 64) : 1;
        // K-major B with CL = 2: half boxes of 128 rows; a half wholly past N is not loaded (no
        // box starts outside the tensor), the same count in both CTAs of the pair
        constexpr int kRows = kWgBN / CL;
        const int b_halves = (int)min((long long)CL, (p.N - t.n0 + kRows - 1) / kRows);
        const unsigned int a_bytes = AMN ? a_boxes * kWgBoxBytes : (a_live ? kWgABytes : 0);
        const unsigned int bytes =
            a_bytes + (BMN ? b_boxes * kWgBoxBytes : b_halves * (kWgBBytes / CL));
        for (int kt = 0; kt < sh.ktiles; ++kt) {
          if constexpr (CL > 1) mbar_wait_cluster(empty_bar + 8 * stage, phase ^ 1);
          else mbar_wait(empty_bar + 8 * stage, phase ^ 1);
          const unsigned int fb = full_bar + 8 * stage;
          mbar_arrive_expect_tx(fb, bytes);
          const unsigned int sa = sbase + stage * kWgStageBytes, sb = sa + kWgABytes;
          const int k0 = kt * kWgBK;
          if (AMN) {
#pragma unroll 1
            for (int i = 0; i < a_boxes; ++i)
              tma_load(sa + i * kWgBoxBytes, &tma_a, fb, (int)t.m0 + 64 * i, k0, sh.batched, ca);
          } else if (a_live) {
            tma_load(sa, &tma_a, fb, k0, (int)t.m0, sh.batched, ca);
          }
          if (BMN) {
            // 64-column boxes; with CL = 2, rank r loads boxes r, r + 2 for both CTAs
#pragma unroll 1
            for (int i = rank; i < b_boxes; i += CL)
              tma_load_all<CL>(sb + i * kWgBoxBytes, &tma_b, fb, (int)t.n0 + 64 * i, k0,
                               sh.batched, cb);
          } else if (rank < b_halves) {
            // one box of kWgBN / CL rows (the host encodes B's map with that box)
            tma_load_all<CL>(sb + rank * kRows * 128, &tma_b, fb, k0, (int)t.n0 + kRows * rank,
                             sh.batched, cb);
          }
          if (++stage == kWgStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
    if constexpr (CL > 1) cluster_sync_all();
    return;
  }

  // -------------------------------------------------------------------- consumer warpgroups
  setmaxnreg_inc<kWgConsumerRegs>();
  const WgShape<CL> sh(p);
  const int cg = wg - 1;                         // rows 64 cg .. 64 cg + 63 of the tile
  const int ctid = tid - 128 * wg;               // thread in the warpgroup
  const int cwarp = ctid / 32, lane = tid % 32;
  // this warpgroup's 64 rows inside a stage's A tile: K-major rows of 128 bytes, or the second
  // 64 x 64 box of an M-major tile; both 8192 bytes on
  const unsigned int a_off = cg * 8192;
  // descriptors: WgOperand (wgmma_common.cuh) holds LBO / SBO / k16 step of each layout
  static_assert(WgOperand<true>::kLbo == kWgBoxBytes, "M/N-major LBO = one 64 x 64 TMA box");
  float* stage_c = reinterpret_cast<float*>(smem + kWgEpiOffset + (cg * 4 + cwarp) * kWgEpiWarpBytes);
  const bool prefetch_res = p.residual != nullptr && p.r_sn == 1;
  const int pf_kt = sh.ktiles > 8 ? sh.ktiles - 8 : 0;

  // a stage is free again once every consumer warp of every CTA that reads it is done with it
  auto release = [&](int s) {
    if (lane == 0) {
      mbar_arrive(empty_bar + 8 * s);
      if constexpr (CL > 1) {
#pragma unroll
        for (int r = 1; r < CL; ++r) mbar_arrive_remote(empty_bar + 8 * s, (rank + r) % CL);
      }
    }
  };

  float acc[128];
  int stage = 0;
  unsigned int phase = 0;
  for (int u = blockIdx.x / CL; u < sh.work; u += gridDim.x / CL) {
    const WgTile t = wg_tile(sh, u, rank);
    const BatchOffsets o = batch_offsets(p, t.z);
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    int prev = 0;
    for (int kt = 0; kt < sh.ktiles; ++kt) {
      mbar_wait(full_bar + 8 * stage, phase);
      const unsigned int sa = sbase + stage * kWgStageBytes + a_off;
      const unsigned int sb = sbase + stage * kWgStageBytes + kWgABytes;
      reg_fence(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kWgBK / 16; ++kk)
        wgmma_m64n256k16<T, AMN ? 1 : 0, BMN ? 1 : 0>(acc, WgOperand<AMN>::desc(sa, kk),
                                                      WgOperand<BMN>::desc(sb, kk));
      wgmma_commit();
      reg_fence(acc);
      // the group of k-tile kt - 1 is complete: its stage goes back to the producer(s)
      wgmma_wait<1>();
      reg_fence(acc);
      if (kt > 0) release(prev);
      if (prefetch_res && kt == pf_kt && t.m0 < p.M)
        prefetch_residual_l2<T, 64, kWgBN, 128>(p, o, t.m0 + 64 * cg, t.n0, ctid);
      prev = stage;
      if (++stage == kWgStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    wgmma_wait<0>();
    reg_fence(acc);
    if (sh.ktiles > 0) release(prev);

    // ---------------------------------------------------------------- epilogue
    // Warp cwarp holds rows 16 cwarp + g and + 8 (g = lane / 4) of this warpgroup's 64; its 32
    // n8 blocks j hold columns 8j + 2t, + 1 (t = lane % 4) in acc[4j .. 4j + 3].
    const long long m_base = t.m0 + 64 * cg + 16 * cwarp;
    const bool whole = !p.out_f32 && t.n0 + kWgBN <= p.N;
    if constexpr (EPI == 3) {           // every tile (the host checked what TMA needs)
      wg_epilogue_whole<T, kStoreTensor>(p, o, acc, m_base, t.n0, lane,
                                         reinterpret_cast<unsigned char*>(stage_c), tma_c, (int)t.z);
      continue;
    }
    if (EPI == 1 && whole && p.N % 2 == 0) {
      wg_epilogue_whole<T, kStoreDirect>(p, o, acc, m_base, t.n0, lane, nullptr, nullptr, 0);
      continue;
    }
    const int g = lane >> 2, tq = lane & 3;
    const int r0 = lane >> 3, my_c = (lane & 7) * 4;     // read side: rows r0 + 4 i, 4 columns
    const bool has_bias = p.bias != nullptr, has_res = p.residual != nullptr;
    float bz[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float res[4][4] = {};
    auto load_inputs = [&](long long nc, float (&b)[4], float (&r)[4][4]) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const long long n = nc + my_c + j;
        b[j] = (has_bias && n < p.N) ? load_out<T>(p.bias, n * p.bias_s, p.out_f32) : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const long long m = m_base + r0 + 4 * i;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const long long n = nc + my_c + j;
          r[i][j] = (has_res && m < p.M && n < p.N)
                        ? load_out<T>(p.residual, o.r + m * p.r_sm + n * p.r_sn, p.out_f32)
                        : 0.0f;
        }
      }
    };
    const bool rows_live = m_base < p.M;
    if (rows_live) load_inputs(t.n0, bz, res);
#pragma unroll 1
    for (int ch = 0; ch < kWgBN / 32; ++ch) {
      const long long nc = t.n0 + 32 * ch;
      if (rows_live && nc < p.N) {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          *reinterpret_cast<float2*>(stage_c + g * kWgEpiLd + 8 * jj + 2 * tq) =
              make_float2(acc[4 * jj], acc[4 * jj + 1]);
          *reinterpret_cast<float2*>(stage_c + (g + 8) * kWgEpiLd + 8 * jj + 2 * tq) =
              make_float2(acc[4 * jj + 2], acc[4 * jj + 3]);
        }
        __syncwarp();
        // the next chunk's bias and residual, in flight during this chunk's math and stores
        float bz_next[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        float res_next[4][4] = {};
        if (ch + 1 < kWgBN / 32 && nc + 32 < p.N) load_inputs(nc + 32, bz_next, res_next);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = r0 + 4 * i;
          const long long m = m_base + r;
          const float4 v4 = *reinterpret_cast<const float4*>(stage_c + r * kWgEpiLd + my_c);
          float v[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float x = has_bias ? p.alpha * v[j] + bz[j] : p.alpha * v[j];
            v[j] = apply_act(p.act, x) + res[i][j];
          }
          if (m < p.M) store_run<T, 4>(p, o, m, nc + my_c, v);
        }
        __syncwarp();
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          bz[j] = bz_next[j];
#pragma unroll
          for (int i = 0; i < 4; ++i) res[i][j] = res_next[i][j];
        }
      }
#pragma unroll
      for (int i = 0; i < 128 - 16; ++i) acc[i] = acc[i + 16];
    }
  }
  if constexpr (EPI == 3) bulk_wait<0>();  // the copies read this CTA's shared memory
  if constexpr (CL > 1) cluster_sync_all();   // no peer arrives on this CTA's barriers later
#else
  __trap();   // not reached: the module is built for sm_90a only
#endif
}

template <class T, bool AMN, bool BMN, int EPI>
__global__ void __launch_bounds__(kWgThreads, 1)
    gemm_wgmma(const __grid_constant__ TmaDesc tma_a, const __grid_constant__ TmaDesc tma_b,
               const GemmArgs p) {
  gemm_wgmma_body<T, AMN, BMN, EPI, 1>(tma_a, tma_b, nullptr, p);
}

// EPI 3 ('tma_store'): C leaves through a third tensor map (dims N, M, batch; 32 x 16 boxes;
// 64-byte swizzle), encoded by the host like A's and B's.
template <class T, bool AMN, bool BMN>
__global__ void __launch_bounds__(kWgThreads, 1)
    gemm_wgmma_tmastore(const __grid_constant__ TmaDesc tma_a,
                        const __grid_constant__ TmaDesc tma_b,
                        const __grid_constant__ TmaDesc tma_c, const GemmArgs p) {
  gemm_wgmma_body<T, AMN, BMN, 3, 1>(tma_a, tma_b, &tma_c, p);
}

// Clusters of 2 CTAs along M (compile-time cluster shape: a plain cuLaunchKernel launches
// clusters; the grid must be even), B multicast.
template <class T, bool AMN, bool BMN, int EPI>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kWgThreads, 1)
    gemm_wgmma_mc2(const __grid_constant__ TmaDesc tma_a, const __grid_constant__ TmaDesc tma_b,
                   const GemmArgs p) {
  gemm_wgmma_body<T, AMN, BMN, EPI, 2>(tma_a, tma_b, nullptr, p);
}

}  // namespace gemm
}  // namespace gpuops
