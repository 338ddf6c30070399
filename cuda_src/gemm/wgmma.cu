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
// Configurations (template EPI; ops/gemm.py WGMMA_CONFIGS, PLAN["wgmma"]), for A/B runs:
//  * EPI = 1 'direct' epilogue (wg_epilogue_fragments): whole tiles of a 16-bit C go from the
//    fragments to global memory without staging (the tensor cores idle during the epilogue,
//    since both consumer warpgroups finish a tile together: it must be short);
//  * EPI = 3 'tma_store' epilogue (kernel gemm_wgmma_tmastore, a third tensor map for C): each
//    warp hands 32-column chunks of its rows to the TMA unit (tensor-map store from shared
//    memory) and goes on to the next tile while they drain;
//  * EPI = 4 'tma_fused' (kernel gemm_wgmma_tmafused, a fourth tensor map for the residual): EPI
//    3 for bare calls; fused calls keep the tensor stores, with the residual loaded by TMA into
//    the boxes the output leaves from and the bias row through shared memory, so no global load
//    is in flight at a chunk's proxy fence (wg_epilogue_tma_fused);
//  * EPI = 6 'pingpong' (kernel gemm_wgmma_pingpong, tma_fused's parameters): 128 x 128 tiles,
//    each consumer warpgroup its own (two m64n128k16 per k16 step), the two taking the CTA's
//    tiles in turns, so one warpgroup's epilogue (tma_fused's) runs under the other's MMAs.
#include "gemm/gemm_common.cuh"
#include "common/wgmma.cuh"
#include "common/mma.cuh"
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
// 'tma_fused' (EPI 4) lays out the space after the ring differently: 4 boxes of 16 x 32 16-bit
// elements (1 KiB, 64-byte swizzle) per consumer warp, where the residual arrives by TMA and the
// output leaves by TMA; a bias row of kWgBN elements per tile, double-buffered; the ring's
// barriers; one barrier per residual box.
constexpr int kWgFusedBoxes = 4;
constexpr int kWgFusedWarpBytes = kWgFusedBoxes * 1024;
constexpr int kWgFusedBiasOffset = kWgEpiOffset + 8 * kWgFusedWarpBytes;
constexpr int kWgFusedBarOffset = kWgFusedBiasOffset + 2 * kWgBN * 2;
constexpr int kWgFusedSmemBytes =
    kWgFusedBarOffset + 2 * kWgStages * 8 + 8 * kWgFusedBoxes * 8 + 1024;
static_assert(kWgFusedSmemBytes <= 227 * 1024, "tma_fused shared memory exceeds 227 KiB");

// 'pingpong' (EPI 6, kernel gemm_wgmma_pingpong): each consumer warpgroup owns whole 128 x 128
// output tiles (two m64n128k16 products per k16 step, 128 fp32 accumulators per thread as in the
// 64 x 256 layout), the two taking the CTA's tiles in turns, so one warpgroup's epilogue runs
// while the other's MMAs keep the tensor cores busy. A 6-stage ring of 32 KiB stages (A 128 x 64,
// B 128 x 64), tma_fused's 4 boxes per warp, a double-buffered bias row of kPpBN per warpgroup.
constexpr int kPpBN = 128, kPpStages = 6;
constexpr int kPpStageBytes = kWgABytes + kPpBN * kWgBK * 2;
constexpr int kPpBoxOffset = kPpStages * kPpStageBytes;
constexpr int kPpBiasOffset = kPpBoxOffset + 8 * kWgFusedWarpBytes;
constexpr int kPpBarOffset = kPpBiasOffset + 2 * 2 * kPpBN * 2;
// full and empty per stage, one order barrier per consumer warpgroup, one per residual box
constexpr int kPpSmemBytes =
    kPpBarOffset + 2 * kPpStages * 8 + 2 * 8 + 8 * kWgFusedBoxes * 8 + 1024;
static_assert(kPpSmemBytes <= 227 * 1024, "pingpong shared memory exceeds 227 KiB");

constexpr int kWgProducerRegs = 40, kWgConsumerRegs = 232;
static_assert((2 * kWgConsumerRegs + kWgProducerRegs) * 128 <= 65536, "register file");

// The work of one launch: splits x batch x tiles_m x tiles_n output tiles of BM x BN (the host
// keeps the count below 2^31), ktiles steps of K each, or with split-K (p.splits > 1: 'direct'
// launches only, whose fp32 partial tiles go to the workspace p.c as [split][batch][M][N], the
// host's reduce adds them) ksteps = k_split / kWgBK steps per split. Computed by each warpgroup
// after its setmaxnreg: a value live across setmaxnreg would be spilled by ptxas.
template <int BM = kWgBM, int BN = kWgBN>
struct WgShape {
  static constexpr int kBM = BM, kBN = BN;
  int tiles_m, tiles_n, tiles, per_split, work, ktiles, ksteps;
  bool batched;
  __device__ __forceinline__ explicit WgShape(const GemmArgs& p) {
    tiles_m = (int)((p.M + BM - 1) / BM);
    tiles_n = (int)((p.N + BN - 1) / BN);
    tiles = tiles_m * tiles_n;
    per_split = tiles * (int)p.batch;
    ktiles = (int)((p.K + kWgBK - 1) / kWgBK);
    const int splits = p.splits > 1 ? p.splits : 1;
    ksteps = splits > 1 ? (int)(p.k_split / kWgBK) : ktiles;
    work = per_split * splits;
    batched = p.batch > 1;
  }
};

// The output tile, batch matrix and K range (k-tiles kt0 .. kt0 + kn - 1) of work item w.
struct WgTile {
  long long z, m0, n0;
  int split, kt0, kn;
};

template <class Shape>
__device__ __forceinline__ WgTile wg_tile(const Shape& sh, int w) {
  WgTile t;
  const int split = w / sh.per_split;
  w -= split * sh.per_split;
  const int z = w / sh.tiles;
  int tm, tn;
  tile_coords(w - z * sh.tiles, sh.tiles_m, sh.tiles_n, tm, tn);
  t.z = z;
  t.m0 = (long long)tm * Shape::kBM;
  t.n0 = (long long)tn * Shape::kBN;
  t.split = split;
  t.kt0 = split * sh.ksteps;
  t.kn = min(sh.ktiles - t.kt0, sh.ksteps);
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
static_assert(kWgFusedWarpBytes == kWgFusedBoxes * kWgBoxBufBytes, "EPI 4: boxes per warp");
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

// Pair `i` (columns n0 + 2i, + 1) of a tile's bias row into the shared-memory row at `row`, by
// cp.async (it holds no register until the epilogue waits for it); pairs past N are zero-filled.
// The host checks that the bias is contiguous and 4-byte aligned and N even (EPI 4 and 6).
__device__ __forceinline__ void wg_copy_bias_pair(unsigned int row, const GemmArgs& p,
                                                  long long n0, int i) {
  const long long n = n0 + 2 * i;
  cp_async4(row + 4 * i, static_cast<const unsigned short*>(p.bias) + (n < p.N ? n : 0),
            n < p.N ? 4 : 0);
  cp_async_commit();
}

// The 32-column chunks of one consumer warp's accumulators in the tensor-store epilogues, 8 per
// tile, chunk c fed by acc[16c .. 16c + 15] (n8 blocks j = 4c .. 4c + 3):
//  * kHalves 1 (EPI 4: the warpgroup's 64 x 256 tile): the warp's 16 rows m_base.., chunk c at
//    columns 32c;
//  * kHalves 2 (EPI 6: the warpgroup's 128 x 128 tile, two m64n128 products): rows m_base..
//    (acc[0..63], chunks 0..3) and m_base + 64.. (acc[64..127], chunks 4..7), chunk c at
//    columns 32 (c % 4).
// Live chunks (some column < N, rows < M) are numbered s = 0, 1, .. in that order: `cols` per
// live half, `count` in all; offsets(s) gives live chunk s's row and column offsets.
template <int kHalves>
struct WgChunks {
  static_assert(kHalves == 1 || kHalves == 2, "64 x 256 or 2 x 64 x 128 per warpgroup");
  static constexpr int kCols = 8 / kHalves;
  int cols, count;
  __device__ __forceinline__ WgChunks(const GemmArgs& p, long long m_base, long long n0) {
    const long long left = p.N - n0;        // > 0: the tile starts inside N
    cols = left >= 32 * kCols ? kCols : (int)((left + 31) >> 5);
    count = (kHalves == 2 && m_base + 64 < p.M) ? 2 * cols : cols;
  }
  __device__ __forceinline__ void offsets(int s, int& dm, int& dn) const {
    const int h = (kHalves == 2 && s >= cols) ? 1 : 0;
    dm = 64 * h;
    dn = 32 * (s - h * cols);
  }
};

// A split-K work item's partial tile (p.splits > 1: 'direct' launches, fp32 C = the workspace,
// the host checks N % 2 == 0): each thread's accumulator pairs stored straight from registers as
// float2, rows g and g + 8 of the warp's 16, columns 8 j + 2 t, + 1 (a warp's store fills whole
// 32-byte sectors). The generic staged epilogue took ~12 us more per 128 x 256 fp32 tile than the
// bf16 one (run 182: [128, 6144, 2048] 37.7 us against 25.9).
__device__ __forceinline__ void wg_store_partials(const GemmArgs& p, const BatchOffsets& o,
                                                  const float (&acc)[128], long long m_base,
                                                  long long n0, int lane) {
  const int g = lane >> 2, tq = lane & 3;
  float* c = static_cast<float*>(p.c) + o.c;
  const long long m_lo = m_base + g, m_hi = m_lo + 8;
#pragma unroll
  for (int j = 0; j < kWgBN / 8; ++j) {
    const long long n = n0 + 8 * j + 2 * tq;
    if (n < p.N) {
      if (m_lo < p.M)
        *reinterpret_cast<float2*>(c + m_lo * p.N + n) = make_float2(acc[4 * j], acc[4 * j + 1]);
      if (m_hi < p.M)
        *reinterpret_cast<float2*>(c + m_hi * p.N + n) =
            make_float2(acc[4 * j + 2], acc[4 * j + 3]);
    }
  }
}

// GemmArgs::flags bit of 'tma_fused' calls (the other GEMM kernels never see it): out = (alpha *
// acc + bias) * silu(residual), no activation: swiglu_linear's up product with the gate product
// as its residual (gpuops/ops/gemm.py, RES_GATE; outside the low bits of gemm_common.cuh's flags).
constexpr int kResGate = 1 << 16;
// GemmArgs::flags bit of split-K 'direct' launches of swiglu_linear: each split's partials are
// two products apart in the workspace (gemv_splitk_reduce's [split][2][batch][M][N]).
constexpr int kSplitPair = 1 << 17;

// Epilogue 'tma_fused' (EPI 4) of a fused call (bias, activation and / or residual; 16-bit C,
// N % 8 == 0, and a residual TMA can read: the host checks): act(alpha * acc + bias) + residual,
// or with kGate (flag kResGate: swiglu_linear on Hopper) (alpha * acc + bias) * silu(residual),
// with no global load in the chunk loop, so the proxy fence before each tensor store has only
// this thread's shared-memory accesses to order (run 30: with generic bias / residual loads in
// flight across it, the tma_store epilogue cost +37-39%).
//  * residual: boxes of 16 rows x 32 columns in the C map's geometry and 64-byte swizzle, loaded
//    by TMA (tma_r) into the warp's 4 box buffers, so each thread finds its residual pair at the
//    address where it writes its result: ld.shared, math, st.shared in place, fence, tensor store
//    of the box. Chunks 0..3 were loaded during the main loop (wg_fused_residual_prologue);
//    chunk c + 3 (c = 1..4) is loaded into chunk c - 1's box as soon as that box's store has read
//    it, three chunks before its use. res_bar: the 4 boxes' mbarriers (one completion per load),
//    res_phase: their parities in bits 0..3 (other bits are the caller's), lane-uniform, kept
//    across tiles by the caller.
//  * bias: the tile's kWgBN bias values (T) in shared memory (bias_row, or null without bias),
//    copied by cp.async during the main loop and published before the epilogue (no load in
//    flight here); read as broadcast pairs.
// Chunks wholly past N (or M) are skipped (no load, no math, no store); the live chunks are
// handled in order as s = 0, 1, .. (WgChunks), box s % 4, so the bulk groups of a tile are
// consecutive. kHalves: the accumulators' geometry (WgChunks).
template <class T, Act A, int kHalves, bool kGate = false>
__device__ __forceinline__ void wg_epilogue_tma_fused(const GemmArgs& p, const float (&acc)[128],
                                                      long long m_base, long long n0, int lane,
                                                      unsigned char* buf,
                                                      const unsigned char* bias_row,
                                                      const TmaDesc* tma_c, const TmaDesc* tma_r,
                                                      int z, unsigned int res_bar,
                                                      unsigned int& res_phase, bool batched,
                                                      const int (&rc)[3]) {
  if (m_base >= p.M) return;                // all 16 rows of the warp lie past M (warp-uniform)
  unsigned int lane_u = (unsigned int)lane;
  opaque(lane_u);                           // recomputed per tile (see wg_epilogue_fragments)
  lane = (int)lane_u;
  const int g = lane >> 2, tq = lane & 3, sw = (g >> 1) & 3;
  const bool has_bias = bias_row != nullptr, has_res = p.residual != nullptr;
  const WgChunks<kHalves> live(p, m_base, n0);
  // the boxes' previous stores (last tile's) have read them; without a residual nothing else did
  // this wait (with one, wg_fused_residual_prologue did it before loading chunks 0..3)
  if (!has_res) {
    if (lane == 0) bulk_wait_read<0>();
    __syncwarp();
  }
  int seq = 0;                              // live chunks so far (kHalves 2)
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    constexpr int kCols = WgChunks<kHalves>::kCols;
    const int h = c / kCols, cc = c % kCols;  // row half and column chunk (compile-time)
    if (cc >= live.cols) {                  // past N (warp-uniform)
      if (kHalves == 1) break;
      continue;
    }
    if (h == 1 && live.count == live.cols) break;   // the second half lies past M
    // this chunk's place among the live ones: c itself when they are a prefix (kHalves 1)
    const int s = kHalves == 1 ? c : seq++;
    const int box = s & (kWgFusedBoxes - 1);
    unsigned char* chunk = buf + box * kWgBoxBufBytes;
    if (has_res) {
      mbar_wait(res_bar + 8 * box, (res_phase >> box) & 1u);
      res_phase ^= 1u << box;
    } else if (s >= kWgFusedBoxes) {
      if (lane == 0) bulk_wait_read<kWgFusedBoxes - 1>();   // chunk s - 4's store read the box
      __syncwarp();
    }
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int j = 4 * c + jj;             // n8 block of the accumulators
      const int jn = 4 * cc + jj;           // n8 block of the tile's columns: 8 jn + 2t, + 1
      // 16-byte unit jj of the 64-byte box row; rows g and g + 8 share the swizzle
      unsigned char* at = chunk + ((jj ^ sw) * 16) + 4 * tq;
      unsigned int* lo_at = reinterpret_cast<unsigned int*>(at + g * kWgBoxRowBytes);
      unsigned int* hi_at = reinterpret_cast<unsigned int*>(at + (g + 8) * kWgBoxRowBytes);
      float bz[8] = {}, r_lo[8] = {}, r_hi[8] = {};
      if (has_bias)
        Vec16<T>::unpack(make_uint4(*reinterpret_cast<const unsigned int*>(
                                        bias_row + (8 * jn + 2 * tq) * 2), 0u, 0u, 0u), bz);
      if (has_res) {
        Vec16<T>::unpack(make_uint4(*lo_at, 0u, 0u, 0u), r_lo);
        Vec16<T>::unpack(make_uint4(*hi_at, 0u, 0u, 0u), r_hi);
      }
      float lo[2], hi[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if constexpr (kGate) {
          static_assert(A == Act::kIdentity, "the gated epilogue takes no activation");
          lo[e] = (p.alpha * acc[4 * j + e] + bz[e]) * silu_f(r_lo[e]);
          hi[e] = (p.alpha * acc[4 * j + 2 + e] + bz[e]) * silu_f(r_hi[e]);
        } else {
          lo[e] = activate<A>(p.alpha * acc[4 * j + e] + bz[e]) + r_lo[e];
          hi[e] = activate<A>(p.alpha * acc[4 * j + 2 + e] + bz[e]) + r_hi[e];
        }
      }
      *lo_at = Vec16<T>::pack2(lo[0], lo[1]);
      *hi_at = Vec16<T>::pack2(hi[0], hi[1]);
    }
    fence_proxy_async_smem();               // the st.shared above, before the TMA unit reads
    __syncwarp();
    if (lane == 0) {
      // rows past M and columns past N are clipped by the map's extents, not written
      tma_store_3d(tma_c, smem_u32(chunk), (int)n0 + 32 * cc, (int)(m_base + 64 * h), z);
      bulk_commit();
      const int sn = s + kWgFusedBoxes - 1; // the chunk whose residual goes into chunk s - 1's box
      if (has_res && s >= 1 && sn < live.count) {
        bulk_wait_read<1>();                // chunk s - 1's store has read its box
        const int nb = sn & (kWgFusedBoxes - 1);
        int dm, dn;
        live.offsets(sn, dm, dn);
        mbar_arrive_expect_tx(res_bar + 8 * nb, kWgBoxBufBytes);
        tma_load(smem_u32(buf + nb * kWgBoxBufBytes), tma_r, res_bar + 8 * nb, (int)n0 + dn,
                 (int)m_base + dm, batched, rc);
      }
    }
  }
}

// The residual boxes of a tile's first kWgFusedBoxes live chunks, issued by lane 0 of each
// consumer warp during the tile's main loop (EPI 4 and 6; see wg_epilogue_tma_fused): the
// previous tile's stores must have read the boxes first.
template <int kHalves>
__device__ __forceinline__ void wg_fused_residual_prologue(const GemmArgs& p, long long m_base,
                                                          long long n0, unsigned char* buf,
                                                          const TmaDesc* tma_r,
                                                          unsigned int res_bar, bool batched,
                                                          const int (&rc)[3]) {
  const WgChunks<kHalves> live(p, m_base, n0);
  bulk_wait_read<0>();
#pragma unroll
  for (int b = 0; b < kWgFusedBoxes; ++b) {
    if (b < live.count) {
      int dm, dn;
      live.offsets(b, dm, dn);
      mbar_arrive_expect_tx(res_bar + 8 * b, kWgBoxBufBytes);
      tma_load(smem_u32(buf + b * kWgBoxBufBytes), tma_r, res_bar + 8 * b, (int)n0 + dn,
               (int)m_base + dm, batched, rc);
    }
  }
}

// The producer (one thread of warpgroup 0): every k-tile of every output tile of this CTA, in
// order, into a ring of S stages, each the kWgBM x 64 A tile and then the BN x 64 B tile; a stage
// is refilled once its "empty" barrier says its consumers are done with it.
template <bool AMN, bool BMN, int BN, int S>
__device__ __forceinline__ void wg_produce(const TmaDesc& tma_a, const TmaDesc& tma_b,
                                           const GemmArgs& p, unsigned int sbase,
                                           unsigned int full_bar, unsigned int empty_bar) {
  constexpr unsigned int kBBytes = BN * kWgBK * 2;
  constexpr unsigned int kStageBytes = kWgABytes + kBBytes;
  const WgShape<kWgBM, BN> sh(p);
  int stage = 0;
  unsigned int phase = 0;
  for (int w = blockIdx.x; w < sh.work; w += gridDim.x) {
    const WgTile t = wg_tile(sh, w);
    int ca[3] = {0, 0, 0}, cb[3] = {0, 0, 0};
    if (sh.batched) {
      batch_coords(p, t.z, p.a_sb, ca);
      batch_coords(p, t.z, p.b_sb, cb);
    }
    // M/N-major operands come as 64-wide boxes; boxes wholly past M / N are not loaded
    // (their rows / columns of the product are never stored, so stale shared memory there is
    // moot). a_live and b_live always hold (the loop visits only tiles inside M x N): the
    // checks stay because with them ptxas emits, byte for byte, the code run 33 measured,
    // and without them it reschedules the whole kernel, the consumers' loops included
    // (benchmarks/notes_gemm.md, 2026-11-23).
    const bool a_live = t.m0 < p.M;
    const int a_boxes = !a_live ? 0 : AMN ? (t.m0 + 64 < p.M ? 2 : 1) : 1;
    const int b_boxes = BMN ? (int)min((long long)(BN / 64), (p.N - t.n0 + 63) / 64) : 1;
    const int b_live = (int)min(1LL, (p.N - t.n0 + BN - 1) / BN);   // K-major B: 0 or 1
    const unsigned int a_bytes = AMN ? a_boxes * kWgBoxBytes : (a_live ? kWgABytes : 0);
    const unsigned int bytes = a_bytes + (BMN ? b_boxes * kWgBoxBytes : b_live * kBBytes);
    for (int kt = t.kt0; kt < t.kt0 + t.kn; ++kt) {
      mbar_wait(empty_bar + 8 * stage, phase ^ 1);
      const unsigned int fb = full_bar + 8 * stage;
      mbar_arrive_expect_tx(fb, bytes);
      const unsigned int sa = sbase + stage * kStageBytes, sb = sa + kWgABytes;
      const int k0 = kt * kWgBK;
      if (AMN) {
#pragma unroll 1
        for (int i = 0; i < a_boxes; ++i)
          tma_load(sa + i * kWgBoxBytes, &tma_a, fb, (int)t.m0 + 64 * i, k0, sh.batched, ca);
      } else if (a_live) {
        tma_load(sa, &tma_a, fb, k0, (int)t.m0, sh.batched, ca);
      }
      if (BMN) {
#pragma unroll 1
        for (int i = 0; i < b_boxes; ++i)
          tma_load(sb + i * kWgBoxBytes, &tma_b, fb, (int)t.n0 + 64 * i, k0, sh.batched, cb);
      } else if (b_live > 0) {
        tma_load(sb, &tma_b, fb, k0, (int)t.n0, sh.batched, cb);
      }
      if (++stage == S) {
        stage = 0;
        phase ^= 1;
      }
    }
  }
}

// The kernel body. AMN: A is M-major in memory (a.T view); BMN: B is N-major (row-major [K, N]);
// otherwise K-major. EPI: 0 = staged epilogue (shared memory, rolled chunks), 1 = direct, 3 = tensor
// store (tma_c), 4 = tensor store with fused epilogues through shared memory (tma_c, and tma_r
// for the residual; bare calls run EPI 3's code).
template <class T, bool AMN, bool BMN, int EPI>
__device__ __forceinline__ void gemm_wgmma_body(const TmaDesc& tma_a, const TmaDesc& tma_b,
                                                const TmaDesc* tma_c, const TmaDesc* tma_r,
                                                const GemmArgs& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(16) unsigned char smem_raw[];   // aligned to 1024 by hand below
  const unsigned int raw = smem_u32(smem_raw);
  const unsigned int pad = (1024u - (raw & 1023u)) & 1023u;
  const unsigned int sbase = raw + pad;                    // 1024-aligned shared address
  unsigned char* smem = smem_raw + pad;
  constexpr bool kTmaC = EPI == 3 || EPI == 4;              // C leaves through tma_c
  const unsigned int full_bar = sbase + (EPI == 4 ? kWgFusedBarOffset : kWgBarOffset);  // + 8 s
  const unsigned int empty_bar = full_bar + 8 * kWgStages;
  const unsigned int res_bar0 = empty_bar + 8 * kWgStages;  // EPI 4: + 8 (4 warp + box)

  const int tid = threadIdx.x, wg = tid / 128;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kWgStages; ++s) {
      mbar_init(full_bar + 8 * s, 1);       // the producer's arrive.expect_tx (+ TMA's bytes)
      mbar_init(empty_bar + 8 * s, 8);      // one arrive per consumer warp
    }
    if constexpr (EPI == 4) {
#pragma unroll 1
      for (int i = 0; i < 8 * kWgFusedBoxes; ++i) mbar_init(res_bar0 + 8 * i, 1);  // lane 0's
    }
    mbar_fence_init();
    tma_prefetch_desc(&tma_a);
    tma_prefetch_desc(&tma_b);
    if constexpr (kTmaC) tma_prefetch_desc(tma_c);
    if constexpr (EPI == 4) {
      if (p.residual != nullptr) tma_prefetch_desc(tma_r);
    }
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------------ producer warpgroup
    setmaxnreg_dec<kWgProducerRegs>();
    if (tid == 0)
      wg_produce<AMN, BMN, kWgBN, kWgStages>(tma_a, tma_b, p, sbase, full_bar, empty_bar);
    return;
  }

  // -------------------------------------------------------------------- consumer warpgroups
  setmaxnreg_inc<kWgConsumerRegs>();
  const WgShape<> sh(p);
  const int cg = wg - 1;                         // rows 64 cg .. 64 cg + 63 of the tile
  const int ctid = tid - 128 * wg;               // thread in the warpgroup
  const int cwarp = ctid / 32, lane = tid % 32;
  // this warpgroup's 64 rows inside a stage's A tile: K-major rows of 128 bytes, or the second
  // 64 x 64 box of an M-major tile; both 8192 bytes on
  const unsigned int a_off = cg * 8192;
  // descriptors: WgOperand (common/wgmma.cuh) holds LBO / SBO / k16 step of each layout
  static_assert(WgOperand<true>::kLbo == kWgBoxBytes, "M/N-major LBO = one 64 x 64 TMA box");
  float* stage_c = reinterpret_cast<float*>(
      smem + kWgEpiOffset + (cg * 4 + cwarp) * (EPI == 4 ? kWgFusedWarpBytes : kWgEpiWarpBytes));
  const bool prefetch_res = p.residual != nullptr && p.r_sn == 1;
  // EPI 4: fused calls (bias / activation / residual) take wg_epilogue_tma_fused; this warp's
  // residual barriers; epi_state: bits 0..3 the barriers' parities, bit 4 the bias row in use
  // (one register across the main loop: the consumers have none to spare there)
  const bool fused4 = EPI == 4 && (p.bias != nullptr || p.residual != nullptr || p.act != 0);
  const unsigned int res_bar = res_bar0 + 8 * kWgFusedBoxes * (cg * 4 + cwarp);
  unsigned int epi_state = 0;

  // a stage is free again once every consumer warp is done with it
  auto release = [&](int s) {
    if (lane == 0) mbar_arrive(empty_bar + 8 * s);
  };

  float acc[128];
  int stage = 0;
  unsigned int phase = 0;
  for (int w = blockIdx.x; w < sh.work; w += gridDim.x) {
    const WgTile t = wg_tile(sh, w);
    BatchOffsets o = batch_offsets(p, t.z);
    // split-K: this split's partial tile in the workspace ([split][batch][M][N]; kSplitPair: the
    // gate and up products of swiglu_linear interleave per split, [split][2][batch][M][N])
    if (t.split > 0)
      o.c += (long long)t.split * p.batch * p.M * p.N * ((p.flags & kSplitPair) ? 2 : 1);
    const int pf_kt = t.kn > 8 ? t.kn - 8 : 0;
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    int prev = 0;
    for (int kt = 0; kt < t.kn; ++kt) {
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
      if (prefetch_res && kt == pf_kt && t.m0 < p.M)   // t.m0 < p.M always holds: see a_live
        prefetch_residual_l2<T, 64, kWgBN, 128>(p, o, t.m0 + 64 * cg, t.n0, ctid);
      if constexpr (EPI == 4) {
        // the residual boxes of chunks 0..3 and the bias row, 8 k-tiles (or the whole main
        // loop) before the epilogue: their latency hides behind the MMAs
        if (fused4 && kt == pf_kt) {
          const long long mb = t.m0 + 64 * cg + 16 * cwarp;
          if (p.residual != nullptr && lane == 0 && mb < p.M) {
            int rc[3] = {0, 0, 0};
            if (sh.batched) batch_coords(p, t.z, p.r_sb, rc);
            wg_fused_residual_prologue<1>(p, mb, t.n0, reinterpret_cast<unsigned char*>(stage_c),
                                       tma_r, res_bar, sh.batched, rc);
          }
          if (p.bias != nullptr && cg == 0) {
            // the first warpgroup copies the row as 128 pairs
            wg_copy_bias_pair(sbase + kWgFusedBiasOffset + ((epi_state >> 4) & 1) * (kWgBN * 2),
                              p, t.n0, ctid);
          }
        }
      }
      prev = stage;
      if (++stage == kWgStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    wgmma_wait<0>();
    reg_fence(acc);
    if (t.kn > 0) release(prev);

    // ---------------------------------------------------------------- epilogue
    // Warp cwarp holds rows 16 cwarp + g and + 8 (g = lane / 4) of this warpgroup's 64; its 32
    // n8 blocks j hold columns 8j + 2t, + 1 (t = lane % 4) in acc[4j .. 4j + 3].
    const long long m_base = t.m0 + 64 * cg + 16 * cwarp;
    if (EPI == 1 && sh.ksteps < sh.ktiles) {   // split-K (p.splits > 1): fp32 partials
      wg_store_partials(p, o, acc, m_base, t.n0, lane);
      continue;
    }
    const bool whole = !p.out_f32 && t.n0 + kWgBN <= p.N;
    if constexpr (EPI == 4) {
      if (fused4) {
        // the tile's bias row, copied by the first warpgroup during the main loop, published to
        // both by one named barrier of their 256 threads; two rows by tile parity, so a row is
        // rewritten only after every warp has passed the next tile's barrier (and so finished
        // this tile's epilogue)
        unsigned char* bias_row = nullptr;
        if (p.bias != nullptr) {
          bias_row = smem + kWgFusedBiasOffset + ((epi_state >> 4) & 1) * (kWgBN * 2);
          if (cg == 0) cp_async_wait<0>();
          named_bar_sync(1, 256);
          epi_state ^= 16u;
        }
        int rc[3] = {0, 0, 0};
        if (sh.batched && p.residual != nullptr) batch_coords(p, t.z, p.r_sb, rc);
#define GPUOPS_WG_FUSED(A, G)                                                                \
  wg_epilogue_tma_fused<T, A, 1, G>(p, acc, m_base, t.n0, lane, reinterpret_cast<unsigned char*>(stage_c), \
                              bias_row, tma_c, tma_r, (int)t.z, res_bar, epi_state, sh.batched, rc)
        if (p.flags & kResGate) {
          GPUOPS_WG_FUSED(Act::kIdentity, true);
        } else {
          switch (p.act) {
            case 1: GPUOPS_WG_FUSED(Act::kRelu, false); break;
            case 2: GPUOPS_WG_FUSED(Act::kSilu, false); break;
            case 3: GPUOPS_WG_FUSED(Act::kGeluErf, false); break;
            case 4: GPUOPS_WG_FUSED(Act::kGeluTanh, false); break;
            default: GPUOPS_WG_FUSED(Act::kIdentity, false); break;
          }
        }
#undef GPUOPS_WG_FUSED
        continue;
      }
    }
    if constexpr (EPI == 4) {           // bare: EPI 3's code (its fused forms are not built)
      wg_epilogue_fragments<T, false, Act::kIdentity, kStoreTensor>(
          p, o, acc, m_base, t.n0, lane, reinterpret_cast<unsigned char*>(stage_c), tma_c,
          (int)t.z);
      continue;
    }
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
  if constexpr (kTmaC) bulk_wait<0>();    // the copies read this CTA's shared memory
#else
  __trap();   // not reached: the module is built for sm_90a only
#endif
}

// EPI 6 ('pingpong'), the kernel body. Warpgroup 0 produces as in gemm_wgmma_body (tiles of
// 128 x kPpBN, in the CTA's order); consumer warpgroup cg takes the CTA's tiles i = cg, cg + 2, ..
// Tile i's k-tiles are the ring's iterations i * ktiles .. (i + 1) * ktiles - 1 (stage = it % S,
// parity = it / S % 2), so each stage is read by one warpgroup at a time and its empty barrier
// counts that warpgroup's 4 warps.
// Order barriers: a warpgroup may wait on tile i's full barriers only after every fill of tile
// i - 1 has landed (a parity wait cannot tell phase n from phase n + 2: waiting for a stage two
// fills ahead of the ring would pass on the older one). The warpgroup of tile i - 1 arrives on
// the other's order barrier as soon as its last k-tile has landed; its epilogue then overlaps
// the other's main loop, and it waits for tile i + 1's turn (the other's arrival) before its own
// next main loop. The two barriers alternate strictly, so their parities never run two ahead.
// Fused calls: tma_fused's epilogue (bias row per warpgroup, residual boxes by TMA issued 8
// k-tiles before the end); bare calls take the same code with no bias, residual or activation.
template <class T, bool AMN, bool BMN>
__device__ __forceinline__ void gemm_wgmma_pingpong_body(const TmaDesc& tma_a,
                                                         const TmaDesc& tma_b,
                                                         const TmaDesc* tma_c,
                                                         const TmaDesc* tma_r, const GemmArgs& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(16) unsigned char smem_raw[];   // aligned to 1024 by hand below
  const unsigned int raw = smem_u32(smem_raw);
  const unsigned int pad = (1024u - (raw & 1023u)) & 1023u;
  const unsigned int sbase = raw + pad;
  unsigned char* smem = smem_raw + pad;
  const unsigned int full_bar = sbase + kPpBarOffset;        // + 8 stage
  const unsigned int empty_bar = full_bar + 8 * kPpStages;
  const unsigned int order_bar = empty_bar + 8 * kPpStages;  // + 8 cg: this warpgroup's turn
  const unsigned int res_bar0 = order_bar + 16;              // + 8 (4 warp + box)

  const int tid = threadIdx.x, wg = tid / 128;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kPpStages; ++s) {
      mbar_init(full_bar + 8 * s, 1);       // the producer's arrive.expect_tx (+ TMA's bytes)
      mbar_init(empty_bar + 8 * s, 4);      // one arrive per warp of the consuming warpgroup
    }
    mbar_init(order_bar, 1);
    mbar_init(order_bar + 8, 1);
#pragma unroll 1
    for (int i = 0; i < 8 * kWgFusedBoxes; ++i) mbar_init(res_bar0 + 8 * i, 1);   // lane 0's
    mbar_fence_init();
    tma_prefetch_desc(&tma_a);
    tma_prefetch_desc(&tma_b);
    tma_prefetch_desc(tma_c);
    if (p.residual != nullptr) tma_prefetch_desc(tma_r);
  }
  __syncthreads();

  if (wg == 0) {
    setmaxnreg_dec<kWgProducerRegs>();
    if (tid == 0)
      wg_produce<AMN, BMN, kPpBN, kPpStages>(tma_a, tma_b, p, sbase, full_bar, empty_bar);
    return;
  }

  setmaxnreg_inc<kWgConsumerRegs>();
  const WgShape<kWgBM, kPpBN> sh(p);
  const int cg = wg - 1;
  const int ctid = tid - 128 * wg;
  const int cwarp = ctid / 32, lane = tid % 32;
  unsigned char* boxes = smem + kPpBoxOffset + (cg * 4 + cwarp) * kWgFusedWarpBytes;
  const bool fused = p.bias != nullptr || p.residual != nullptr || p.act != 0;
  const bool prefetch_res = p.residual != nullptr && p.r_sn == 1;
  const int pf_kt = sh.ktiles > 8 ? sh.ktiles - 8 : 0;
  const unsigned int res_bar = res_bar0 + 8 * kWgFusedBoxes * (cg * 4 + cwarp);
  const int bias_rows = kPpBiasOffset + cg * (2 * kPpBN * 2);   // this warpgroup's two rows
  // bits 0..3: the residual boxes' parities; bit 4: the bias row in use; bit 5: the parity of
  // this warpgroup's order barrier
  unsigned int epi_state = 0;
  const unsigned int my_turn = order_bar + 8 * cg, their_turn = order_bar + 8 * (1 - cg);

  auto release = [&](int s) {
    if (lane == 0) mbar_arrive(empty_bar + 8 * s);
  };

  float acc[128];
  int i = cg;
  for (int w = blockIdx.x + cg * gridDim.x; w < sh.work; w += 2 * gridDim.x, i += 2) {
    const WgTile t = wg_tile(sh, w);
    const BatchOffsets o = batch_offsets(p, t.z);
    if (i > 0) {                             // tile i - 1's operands have all landed
      mbar_wait(my_turn, (epi_state >> 5) & 1u);
      epi_state ^= 32u;
    }
    if (sh.ktiles == 0 && ctid == 0) mbar_arrive(their_turn);   // (the host never sends K = 0)
    const unsigned int it0 = (unsigned int)i * (unsigned int)sh.ktiles;
    int stage = (int)(it0 % kPpStages);
    unsigned int phase = (it0 / kPpStages) & 1u;
#pragma unroll
    for (int q = 0; q < 128; ++q) acc[q] = 0.0f;
    float (&acc_lo)[64] = *reinterpret_cast<float (*)[64]>(&acc[0]);
    float (&acc_hi)[64] = *reinterpret_cast<float (*)[64]>(&acc[64]);
    int prev = 0;
    for (int kt = 0; kt < sh.ktiles; ++kt) {
      mbar_wait(full_bar + 8 * stage, phase);
      if (kt == sh.ktiles - 1 && ctid == 0) mbar_arrive(their_turn);
      const unsigned int sa = sbase + stage * kPpStageBytes;
      const unsigned int sb = sa + kWgABytes;
      reg_fence(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kWgBK / 16; ++kk) {
        // rows 0..63 and 64..127 of the A tile: the next 64 K-major rows, or the second 64 x 64
        // M-major box, 8192 bytes on either way
        const unsigned long long db = WgOperand<BMN>::desc(sb, kk);
        wgmma_ss_m64n128k16<T, AMN ? 1 : 0, BMN ? 1 : 0>(acc_lo, WgOperand<AMN>::desc(sa, kk),
                                                         db, 1);
        wgmma_ss_m64n128k16<T, AMN ? 1 : 0, BMN ? 1 : 0>(
            acc_hi, WgOperand<AMN>::desc(sa + 8192, kk), db, 1);
      }
      wgmma_commit();
      reg_fence(acc);
      wgmma_wait<1>();                       // k-tile kt - 1's group is complete
      reg_fence(acc);
      if (kt > 0) release(prev);
      if (prefetch_res && kt == pf_kt)
        prefetch_residual_l2<T, kWgBM, kPpBN, 128>(p, o, t.m0, t.n0, ctid);
      if (fused && kt == pf_kt) {
        const long long mb = t.m0 + 16 * cwarp;
        if (p.residual != nullptr && lane == 0 && mb < p.M) {
          int rc[3] = {0, 0, 0};
          if (sh.batched) batch_coords(p, t.z, p.r_sb, rc);
          wg_fused_residual_prologue<2>(p, mb, t.n0, boxes, tma_r, res_bar, sh.batched, rc);
        }
        if (p.bias != nullptr && ctid < kPpBN / 2) {
          // the tile's bias row as 64 pairs, by the warpgroup's first 64 threads
          wg_copy_bias_pair(sbase + bias_rows + ((epi_state >> 4) & 1) * (kPpBN * 2), p, t.n0,
                            ctid);
        }
      }
      prev = stage;
      if (++stage == kPpStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    wgmma_wait<0>();
    reg_fence(acc);
    if (sh.ktiles > 0) release(prev);

    // ---------------------------------------------------------------- epilogue
    // Warp cwarp holds rows 16 cwarp + g, + 8 (acc[0..63]) and 64 + 16 cwarp + g, + 8
    // (acc[64..127]) of the tile, columns 8j + 2t, + 1 (j < 16) in acc[4j..] / acc[64 + 4j..].
    const unsigned char* bias_row = nullptr;
    if (p.bias != nullptr) {
      // published to the warpgroup by a named barrier of its 128 threads; two rows by tile
      // parity, so a row is rewritten (two tiles on) only after every warp of the warpgroup has
      // passed the next tile's barrier, i.e. finished this epilogue
      bias_row = smem + bias_rows + ((epi_state >> 4) & 1) * (kPpBN * 2);
      cp_async_wait<0>();
      named_bar_sync(1 + cg, 128);
      epi_state ^= 16u;
    }
    int rc[3] = {0, 0, 0};
    if (sh.batched && p.residual != nullptr) batch_coords(p, t.z, p.r_sb, rc);
    const long long m_base = t.m0 + 16 * cwarp;
#define GPUOPS_WG_PP(A)                                                                      \
  wg_epilogue_tma_fused<T, A, 2>(p, acc, m_base, t.n0, lane, boxes, bias_row, tma_c, tma_r,  \
                                 (int)t.z, res_bar, epi_state, sh.batched, rc)
    switch (p.act) {
      case 1: GPUOPS_WG_PP(Act::kRelu); break;
      case 2: GPUOPS_WG_PP(Act::kSilu); break;
      case 3: GPUOPS_WG_PP(Act::kGeluErf); break;
      case 4: GPUOPS_WG_PP(Act::kGeluTanh); break;
      default: GPUOPS_WG_PP(Act::kIdentity); break;
    }
#undef GPUOPS_WG_PP
  }
  bulk_wait<0>();                            // the stores read this CTA's shared memory
#else
  __trap();   // not reached: the module is built for sm_90a only
#endif
}

template <class T, bool AMN, bool BMN, int EPI>
__global__ void __launch_bounds__(kWgThreads, 1)
    gemm_wgmma(const __grid_constant__ TmaDesc tma_a, const __grid_constant__ TmaDesc tma_b,
               const GemmArgs p) {
  gemm_wgmma_body<T, AMN, BMN, EPI>(tma_a, tma_b, nullptr, nullptr, p);
}

// EPI 3 ('tma_store'): C leaves through a third tensor map (dims N, M, batch; 32 x 16 boxes;
// 64-byte swizzle), encoded by the host like A's and B's.
template <class T, bool AMN, bool BMN>
__global__ void __launch_bounds__(kWgThreads, 1)
    gemm_wgmma_tmastore(const __grid_constant__ TmaDesc tma_a,
                        const __grid_constant__ TmaDesc tma_b,
                        const __grid_constant__ TmaDesc tma_c, const GemmArgs p) {
  gemm_wgmma_body<T, AMN, BMN, 3>(tma_a, tma_b, &tma_c, nullptr, p);
}

// EPI 4 ('tma_fused'): as EPI 3, and a fourth map for the residual (dims N, M[, batch dims],
// 32 x 16 boxes, 64-byte swizzle: C's box geometry on the residual's strides; the host passes
// C's map again when the call has no residual). Shared memory: kWgFusedSmemBytes.
template <class T, bool AMN, bool BMN>
__global__ void __launch_bounds__(kWgThreads, 1)
    gemm_wgmma_tmafused(const __grid_constant__ TmaDesc tma_a,
                        const __grid_constant__ TmaDesc tma_b,
                        const __grid_constant__ TmaDesc tma_c,
                        const __grid_constant__ TmaDesc tma_r, const GemmArgs p) {
  gemm_wgmma_body<T, AMN, BMN, 4>(tma_a, tma_b, &tma_c, &tma_r, p);
}

// EPI 6 ('pingpong'): the tma_fused kernel's parameters (the host passes C's map again as the
// residual's when the call has none). Shared memory: kPpSmemBytes.
template <class T, bool AMN, bool BMN>
__global__ void __launch_bounds__(kWgThreads, 1)
    gemm_wgmma_pingpong(const __grid_constant__ TmaDesc tma_a,
                        const __grid_constant__ TmaDesc tma_b,
                        const __grid_constant__ TmaDesc tma_c,
                        const __grid_constant__ TmaDesc tma_r, const GemmArgs p) {
  gemm_wgmma_pingpong_body<T, AMN, BMN>(tma_a, tma_b, &tma_c, &tma_r, p);
}

}  // namespace gemm
}  // namespace gpuops
