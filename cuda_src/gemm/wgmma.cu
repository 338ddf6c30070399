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
#include "gemm/gemm_common.cuh"
#include "gemm/wgmma_common.cuh"

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
// 2^31), ktiles steps of K each. Computed by each warpgroup after its setmaxnreg: a value live
// across setmaxnreg would be spilled by ptxas.
struct WgShape {
  int tiles_m, tiles_n, tiles, work, ktiles;
  bool batched;
  __device__ __forceinline__ explicit WgShape(const GemmArgs& p) {
    tiles_m = (int)((p.M + kWgBM - 1) / kWgBM);
    tiles_n = (int)((p.N + kWgBN - 1) / kWgBN);
    tiles = tiles_m * tiles_n;
    work = tiles * (int)p.batch;
    ktiles = (int)((p.K + kWgBK - 1) / kWgBK);
    batched = p.batch > 1;
  }
};

// The output tile and batch matrix of work item w.
struct WgTile {
  long long z, m0, n0;
};

__device__ __forceinline__ WgTile wg_tile(const WgShape& sh, int w) {
  WgTile t;
  const int z = w / sh.tiles;
  int tm, tn;
  tile_coords(w - z * sh.tiles, sh.tiles_m, sh.tiles_n, tm, tn);
  t.z = z;
  t.m0 = (long long)tm * kWgBM;
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

// AMN: A is M-major in memory (a.T view); BMN: B is N-major (row-major [K, N]). Otherwise K-major.
template <class T, bool AMN, bool BMN>
__global__ void __launch_bounds__(kWgThreads, 1)
    gemm_wgmma(const __grid_constant__ TmaDesc tma_a, const __grid_constant__ TmaDesc tma_b,
               const GemmArgs p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(16) unsigned char smem_raw[];   // aligned to 1024 by hand below
  const unsigned int raw = smem_u32(smem_raw);
  const unsigned int pad = (1024u - (raw & 1023u)) & 1023u;
  const unsigned int sbase = raw + pad;                    // 1024-aligned shared address
  unsigned char* smem = smem_raw + pad;
  const unsigned int full_bar = sbase + kWgBarOffset;      // + 8 * stage
  const unsigned int empty_bar = full_bar + 8 * kWgStages;

  const int tid = threadIdx.x, wg = tid / 128;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kWgStages; ++s) {
      mbar_init(full_bar + 8 * s, 1);     // the producer's arrive.expect_tx (+ TMA's bytes)
      mbar_init(empty_bar + 8 * s, 8);    // one arrive per consumer warp
    }
    mbar_fence_init();
    tma_prefetch_desc(&tma_a);
    tma_prefetch_desc(&tma_b);
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------------ producer warpgroup
    setmaxnreg_dec<kWgProducerRegs>();
    if (tid != 0) return;
    const WgShape sh(p);
    int stage = 0;
    unsigned int phase = 0;
    for (int w = blockIdx.x; w < sh.work; w += gridDim.x) {
      const WgTile t = wg_tile(sh, w);
      int ca[3] = {0, 0, 0}, cb[3] = {0, 0, 0};
      if (sh.batched) {
        batch_coords(p, t.z, p.a_sb, ca);
        batch_coords(p, t.z, p.b_sb, cb);
      }
      // M/N-major operands come as 64-wide boxes; boxes wholly past M / N are not loaded (their
      // rows / columns of the product are never stored, so stale shared memory there is moot).
      const int a_boxes = AMN ? (t.m0 + 64 < p.M ? 2 : 1) : 1;
      const int b_boxes = BMN ? (int)min(4LL, (p.N - t.n0 + 63) / 64) : 1;
      const unsigned int bytes =
          (AMN ? a_boxes * kWgBoxBytes : kWgABytes) + (BMN ? b_boxes * kWgBoxBytes : kWgBBytes);
      for (int kt = 0; kt < sh.ktiles; ++kt) {
        mbar_wait(empty_bar + 8 * stage, phase ^ 1);
        const unsigned int fb = full_bar + 8 * stage;
        mbar_arrive_expect_tx(fb, bytes);
        const unsigned int sa = sbase + stage * kWgStageBytes, sb = sa + kWgABytes;
        const int k0 = kt * kWgBK;
        if (AMN) {
          for (int i = 0; i < a_boxes; ++i)
            tma_load(sa + i * kWgBoxBytes, &tma_a, fb, (int)t.m0 + 64 * i, k0, sh.batched, ca);
        } else {
          tma_load(sa, &tma_a, fb, k0, (int)t.m0, sh.batched, ca);
        }
        if (BMN) {
          for (int i = 0; i < b_boxes; ++i)
            tma_load(sb + i * kWgBoxBytes, &tma_b, fb, (int)t.n0 + 64 * i, k0, sh.batched, cb);
        } else {
          tma_load(sb, &tma_b, fb, k0, (int)t.n0, sh.batched, cb);
        }
        if (++stage == kWgStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    return;
  }

  // -------------------------------------------------------------------- consumer warpgroups
  setmaxnreg_inc<kWgConsumerRegs>();
  const WgShape sh(p);
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

  float acc[128];
  int stage = 0;
  unsigned int phase = 0;
  for (int w = blockIdx.x; w < sh.work; w += gridDim.x) {
    const WgTile t = wg_tile(sh, w);
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
      // the group of k-tile kt - 1 is complete: its stage goes back to the producer
      wgmma_wait<1>();
      reg_fence(acc);
      if (kt > 0 && lane == 0) mbar_arrive(empty_bar + 8 * prev);
      if (prefetch_res && kt == pf_kt)
        prefetch_residual_l2<T, 64, kWgBN, 128>(p, o, t.m0 + 64 * cg, t.n0, ctid);
      prev = stage;
      if (++stage == kWgStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    wgmma_wait<0>();
    reg_fence(acc);
    if (sh.ktiles > 0 && lane == 0) mbar_arrive(empty_bar + 8 * prev);

    // ---------------------------------------------------------------- epilogue
    // Warp cwarp holds rows 16 cwarp + g and + 8 (g = lane / 4) of this warpgroup's 64; its 32
    // n8 blocks j hold columns 8j + 2t, + 1 (t = lane % 4) in acc[4j .. 4j + 3].
    const long long m_base = t.m0 + 64 * cg + 16 * cwarp;
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
#else
  __trap();   // not reached: the module is built for sm_90a only
#endif
}

}  // namespace gemm
}  // namespace gpuops
