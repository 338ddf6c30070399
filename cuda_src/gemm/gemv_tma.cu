// Decode-sized GEMMs on Hopper with the weight streamed by TMA into a shared-memory ring
// (`PLAN['decode'] = 'tma'`, sm_90, fp16/bf16, M <= 16, a K-contiguous weight whose rows TMA can
// describe). What it adds over gemv_mma_pipe (gemv_mma.cu): the bytes in flight cost neither
// registers nor instructions. The pipe kernel keeps its loads in flight in a register ring of
// 4 KiB per warp (128 registers at NT 4) and spends ~38 instructions per 16-byte load; its time
// followed its steps per warp, not its bytes (H200 runs 194-197: 75% of copy at [14336, 4096],
// cuBLAS 88-94%, and every change that added steps or instructions per byte lost). cuBLAS's
// decode kernel (run 193's ncu: 3.86 TB/s, 164 KB of shared memory) moves the weight with TMA.
//
// MINB persistent blocks per SM (the default configuration: 2 blocks of 2 slots; one block of 5
// slots lost 7-10 us per call to its tile ends and start, run 203): warp 8 is the producer, warps
// 0..7 consume. The block owns a
// contiguous range of 8-row groups (the same count +-1 for every block: a ragged tile costs its
// bytes, not a full tile's steps) and walks it in tiles of NT groups; a tile is read in chunks
// of KC k. Per chunk the producer's lane 0 waits for the ring slot to be free, expects the bytes
// on the slot's mbarrier and issues one box of 8 rows x 256 k (4 KiB) per group and 256 k: one
// instruction per 4 KiB. (A first version, run 198-199, issued one 1-D bulk copy per row and
// chunk: ~75 ns per copy per SM whatever its size, 41-67% of copy.) Boxes land dense, rows 512
// bytes apart, so the 8 rows of one 16-byte load instruction share their banks (8 wavefronts
// instead of 4: a quarter of the shared memory's bandwidth at the DRAM rate). Elements past K
// or N arrive as zeros. The consumers wait for the slot; warp w multiplies the chunk's 32-k
// sub-steps w, w + 8, ... (lane (g, t): the 8 k at 8 t of weight row g of each group, against
// the same 8 k of rows g and g + 8 of A: gemv_mma's k permutation, so the fragments are the
// 16-byte words), A loaded two chunks ahead (the ring leaves L1 ~20 KiB: A comes from L2), then
// frees the slot (one arrival per warp). At a tile's end the 8 warps' sums meet in shared memory
// (two buffers, one barrier of the 256 consumer threads per tile) and the epilogue runs. Rows
// past the block's range are not loaded: their columns of the product are garbage (an mma's
// column n depends only on weight row n) and never stored.
//
// gemv_mma_tma_split (KS = 2; the host builds no other): the same, K split over a cluster of KS
// blocks, for weights with too few rows for a whole tile per block ([4096, 14336]: 128 tiles, so
// 128 blocks of the 264 slots ran and each read all of A: 70-79% of copy, runs 203-204; KS 2:
// 86-89%, run 205). The KS blocks of a cluster share one range of groups and each streams its
// KS-th of the chunks; at a tile's end ranks 1.. store their sums into rank 0's shared memory (distributed
// shared memory, one buffer per rank and tile parity) and arrive on rank 0's mbarrier, rank 0
// adds them and runs the epilogue, then tells each rank the buffer is free again (an mbarrier in
// that rank, skipped for its last two tiles, which nobody waits for). The producer warps take no
// part, so their rings run on across tile ends.
#include "gemm/gemv_common.cuh"
#include "common/mma.cuh"
#include "common/cluster.cuh"
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
#include "common/wgmma.cuh"   // mbarriers, TMA
#endif

namespace gpuops {
namespace gemm {

constexpr int kGtConsumers = 8, kGtThreads = (kGtConsumers + 1) * 32;

// Dynamic shared memory of one block: the ring, then the two reduction buffers.
// Slot layout: box (group n, 256-k part b) at (n * KC / 256 + b) * 4 KiB, row r of it at r * 512.
template <int NT, int KC, int STAGES>
struct GemvTmaSmem {
  static constexpr int kBoxBytes = 8 * 256 * 2;
  static constexpr int kStageBytes = NT * (KC / 256) * kBoxBytes;
  // (host: _gemv_tma_smem = STAGES x kStageBytes + 2 sum buffers of 8 x NT x 4 x 32 floats)
};

// The kernels' body. KS: the blocks of a cluster that split K (1: no cluster); the block's
// place: its group range `cluster` of `clusters`, its K slice `rank` of KS.
// DUAL (SwiGLU, gemv_mma_tma_dual): NT / 2 groups of each weight per tile, the gate's in slot
// positions 0 .. NT / 2 - 1 and the up projection's (tma_w2) after them, silu(gate) * up out.
template <class T, int NT, int KC, int STAGES, int KS, bool DUAL>
__device__ __forceinline__ void gemv_tma_body(const TmaDesc& tma_w, const TmaDesc& tma_w2,
                                              const GemmArgs& p, long long cluster,
                                              long long clusters, int rank) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
  static_assert(sizeof(T) == 2 && KC % 256 == 0, "16-bit weights, chunks of whole warp rounds");
  static_assert(!DUAL || (KS == 1 && NT % 2 == 0), "SwiGLU: no K split, a group of each weight");
  using Smem = GemvTmaSmem<NT, KC, STAGES>;
  constexpr int NTW = DUAL ? NT / 2 : NT;           // groups of each weight per tile
  constexpr int kRows = NTW * 8, kVals = NT * 4;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bars[2 * STAGES];   // full[s], then empty[s]
  // KS > 1: rank 0's "partials in" (ranks 1.. x 256 arrivals) and each rank's "buffer free"
  // (256 arrivals of rank 0), per tile parity
  __shared__ __align__(8) unsigned long long xbars[2][2];
  float(*red)[kGtConsumers][kVals][32] =
      reinterpret_cast<float(*)[kGtConsumers][kVals][32]>(smem + STAGES * Smem::kStageBytes);
  // KS > 1, rank 0: the other ranks' sums, [parity][rank - 1][kVals * 32]
  float* xred = reinterpret_cast<float*>(smem + STAGES * Smem::kStageBytes) +
                2 * kGtConsumers * kVals * 32;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const unsigned int full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[STAGES]);
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, kGtConsumers);
    }
    if (KS > 1) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        mbar_init(smem_u32(&xbars[b][0]), (KS - 1) * kGtConsumers * 32);
        mbar_init(smem_u32(&xbars[b][1]), kGtConsumers * 32);
      }
    }
    mbar_fence_init();
  }
  if (KS > 1)
    cluster_sync();   // every rank's barriers initialized before any remote arrival
  else
    __syncthreads();

  // the block's rows [n_lo, n_hi): 8-row groups [r0, r1); the host keeps clusters <= groups
  const long long groups = (p.N + 7) / 8;
  const long long r0 = groups * cluster / clusters, r1 = groups * (cluster + 1) / clusters;
  // (ints: the host keeps N < 2^31; two registers fewer than 64-bit bounds, which spilled)
  const int n_lo = (int)(8 * r0), n_hi = (int)(8 * r1 < p.N ? 8 * r1 : p.N);
  const int my_tiles = (int)((r1 - r0 + NTW - 1) / NTW);
  // its chunks [c_lo, c_lo + chunks) of K (the host keeps KS <= the chunks of K)
  const int all_chunks = (int)((p.K + KC - 1) / KC);
  const int c_lo = all_chunks * rank / KS;
  const int chunks = all_chunks * (rank + 1) / KS - c_lo;
  // kWPrefetch (PLAN['gemv_l2_prefetch']): the first tile's first STAGES chunks asked into L2
  // before the PDL wait (prefetch_weight_rows' reasoning, gemv_common.cuh: L2 is coherent, so
  // this is safe where loading them into shared memory before the wait would not be)
  if (warp == kGtConsumers && (p.flags & kWPrefetch) && lane < kRows && n_lo + lane < n_hi) {
    const long long kb = (p.K - c_lo * KC) < (long long)STAGES * KC ? (p.K - c_lo * KC)
                                                                     : (long long)STAGES * KC;
    const unsigned int bytes = (unsigned int)(kb * 2) & ~15u;
    if (bytes != 0u)
      l2_prefetch_bulk(static_cast<const T*>(p.b) + (n_lo + lane) * p.b_sn + c_lo * KC, bytes);
  }
  pdl_start();
  if (warp == kGtConsumers) {                       // the producer
    if (lane == 0) {
      tma_prefetch_desc(&tma_w);
      if (DUAL) tma_prefetch_desc(&tma_w2);
      long long q = 0;                              // chunks issued so far
      for (int i = 0; i < my_tiles; ++i) {
        const long long n0 = n_lo + (long long)i * kRows;
        const int nv = (int)((n_hi - n0 + 7) / 8 < NTW ? (n_hi - n0 + 7) / 8 : NTW);   // groups
        for (long long c = c_lo; c < c_lo + chunks; ++c, ++q) {
          const int s = (int)(q % STAGES);
          if (q >= STAGES) mbar_wait(empty0 + 8 * s, (unsigned int)((q / STAGES) & 1) ^ 1u);
          mbar_arrive_expect_tx(full0 + 8 * s,
                                (DUAL ? 2 : 1) * nv * (KC / 256) * Smem::kBoxBytes);
          const unsigned int dst = smem_u32(smem + s * Smem::kStageBytes);
          for (int n = 0; n < nv; ++n)
#pragma unroll
            for (int b = 0; b < KC / 256; ++b) {
              tma_load_2d(dst + (n * (KC / 256) + b) * Smem::kBoxBytes, &tma_w, full0 + 8 * s,
                          (int)(c * KC + 256 * b), (int)(n0 + 8 * n));
              if (DUAL)
                tma_load_2d(dst + ((NTW + n) * (KC / 256) + b) * Smem::kBoxBytes, &tma_w2,
                            full0 + 8 * s, (int)(c * KC + 256 * b), (int)(n0 + 8 * n));
            }
        }
      }
    }
    return;
  }

  // the consumers
  constexpr int kSub = KC / 256;                    // 32-k sub-steps of a warp per chunk
  const int g = lane / 4, t = lane % 4;
  const bool x_vec = p.flags & kAVec;
  const bool lo_row = g < p.M, hi_row = g + 8 < p.M;
  const T* x_lo = static_cast<const T*>(p.a) + g * p.a_sm;
  const T* x_hi = static_cast<const T*>(p.a) + (g + 8) * p.a_sm;
  const BatchOffsets o = batch_offsets(p, 0);
  // This warp's rows of A for chunk c (the same for every tile), loaded two chunks before their
  // mma: the ring leaves L1 ~20 KiB, so A comes from L2 (run 198's ncu: L1 hit rate 1.5%, the
  // consumers' loads of A in the same chunk set the pace, 46% of copy at [14336, 4096]).
  auto load_x = [&](long long c, uint4 (&xs)[kSub][2]) {
#pragma unroll
    for (int h = 0; h < kSub; ++h) {
      const long long k = c * KC + 32 * (warp + kGtConsumers * h) + 8 * t;
      load_a_pair16(x_lo, x_hi, k, p.K - k, p.a_sk, lo_row, hi_row, x_vec, xs[h][0], xs[h][1]);
    }
  };
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] = 0.0f;

  const int total = my_tiles * chunks;              // chunks this block consumes
  uint4 xr[2][kSub][2];                             // A of chunks q and q + 1 (static slots)
  if (total > 0) load_x(c_lo, xr[0]);
  if (total > 1) load_x(c_lo + 1 % chunks, xr[1]);
  int q = 0;
  int buf = 0;
  while (q < total) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (q < total) {                              // block-uniform
        const long long c = c_lo + q % chunks;
        const int s = q % STAGES;
        mbar_wait(full0 + 8 * s, (unsigned int)((q / STAGES) & 1));
        const unsigned char* slot = smem + s * Smem::kStageBytes;
#pragma unroll
        for (int h = 0; h < kSub; ++h) {
          const int j = warp + kGtConsumers * h;
          if (c * KC + 32 * j < p.K) {              // warp-uniform
            const unsigned int a0[4] = {xr[u][h][0].x, xr[u][h][1].x, xr[u][h][0].y,
                                        xr[u][h][1].y};   // gemv_mma's k permutation
            const unsigned int a1[4] = {xr[u][h][0].z, xr[u][h][1].z, xr[u][h][0].w,
                                        xr[u][h][1].w};
#pragma unroll
            for (int n = 0; n < NT; ++n) {
              // box (n, h), row g, k 32 warp + 8 t of its 256 (zeros past K: TMA's fill)
              const uint4 wv = *reinterpret_cast<const uint4*>(
                  slot + (n * kSub + h) * Smem::kBoxBytes + g * 512 + (32 * warp + 8 * t) * 2);
              Mma<T>::run(acc[n], a0, wv.x, wv.y);
              Mma<T>::run(acc[n], a1, wv.z, wv.w);
            }
          }
        }
        // our reads of the slot before the producer's next TMA fill of it: the mbarrier alone
        // does not order generic-proxy reads before async-proxy writes (decode_split_tma.cu
        // raced without this fence: H200 run 220, wrong 16-byte chunks in ~1% of outputs)
        fence_proxy_async_smem();
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * s);   // this warp is done with the slot
        if (q + 2 < total) load_x(c_lo + (q + 2) % chunks, xr[u]);
        if (q % chunks == chunks - 1) {             // the tile ends: sums over the 8 warps
#pragma unroll
          for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) {
              red[buf][warp][n * 4 + cc][lane] = acc[n][cc];
              acc[n][cc] = 0.0f;
            }
          named_bar_sync(1, kGtConsumers * 32);
          const int tile = q / chunks;
          const long long n0 = n_lo + tile * kRows;
          if (KS > 1 && rank != 0) {
            // into rank 0's buffer [buf][rank - 1], once rank 0 has read it two tiles ago
            if (tile >= 2)
              mbar_wait_cluster(smem_u32(&xbars[buf][1]), (unsigned int)((tile / 2 - 1) & 1));
            const unsigned int dst =
                cluster_smem_u32(smem_u32(xred + (buf * (KS - 1) + rank - 1) * kVals * 32), 0);
            for (int e = tid; e < kVals * 32; e += kGtConsumers * 32) {
              const int l = e % 32, cc = (e / 32) % 4, n = e / 128;
              float v = 0.0f;
#pragma unroll
              for (int ww = 0; ww < kGtConsumers; ++ww) v += red[buf][ww][n * 4 + cc][l];
              st_cluster_f32(dst + 4 * e, v);
            }
            // every thread releases its own stores (one arrival per block after a barrier and a
            // single release measured the same for one tile per block and 8 points slower
            // with 36 tiles per cluster, run 207)
            mbar_arrive_cluster(cluster_smem_u32(smem_u32(&xbars[buf][0]), 0));
          } else if (DUAL) {
            for (int e = tid; e < NTW * 4 * 32; e += kGtConsumers * 32) {
              const int l = e % 32, cc = (e / 32) % 4, n = e / 128;
              const long long m = l / 4 + (cc >= 2 ? 8 : 0);
              const long long col = n0 + 8 * n + 2 * (l % 4) + (cc & 1);
              if (m >= p.M || col >= n_hi) continue;
              float gv[1] = {0.0f}, uv[1] = {0.0f};
#pragma unroll
              for (int ww = 0; ww < kGtConsumers; ++ww) {
                gv[0] += red[buf][ww][n * 4 + cc][l];
                uv[0] += red[buf][ww][(NTW + n) * 4 + cc][l];
              }
              swiglu_run<T, 1>(p, o, m, col, gv, uv);
            }
          } else {
            if (KS > 1) mbar_wait_cluster(smem_u32(&xbars[buf][0]), (unsigned int)((tile / 2) & 1));
            for (int e = tid; e < kVals * 32; e += kGtConsumers * 32) {
              const int l = e % 32, cc = (e / 32) % 4, n = e / 128;
              const long long m = l / 4 + (cc >= 2 ? 8 : 0);
              const long long col = n0 + 8 * n + 2 * (l % 4) + (cc & 1);
              if (m >= p.M || col >= n_hi) continue;
              float v = 0.0f;
#pragma unroll
              for (int ww = 0; ww < kGtConsumers; ++ww) v += red[buf][ww][n * 4 + cc][l];
#pragma unroll
              for (int r = 0; r < KS - 1; ++r) v += xred[(buf * (KS - 1) + r) * kVals * 32 + e];
              const float vv[1] = {v};
              epilogue_run<T, 1>(p, o, m, col, vv);
            }
            if (KS > 1 && tile + 2 < my_tiles) {    // buffer [buf] free again for every rank
#pragma unroll
              for (int r = 1; r < KS; ++r)
                mbar_arrive_cluster(cluster_smem_u32(smem_u32(&xbars[buf][1]), r));
            }
          }
          // no second barrier: red[buf] is written again two tiles on, after the next barrier
          buf ^= 1;
        }
        ++q;
      }
    }
  }
#endif
}

// MINB: blocks per SM of the launch bounds (the host's grid is MINB x the SMs at most).
template <class T, int NT, int KC, int STAGES, int MINB>
__global__ void __launch_bounds__(kGtThreads, MINB)
    gemv_mma_tma(const __grid_constant__ TmaDesc tma_w, const GemmArgs p) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
  gemv_tma_body<T, NT, KC, STAGES, 1, false>(tma_w, tma_w, p, blockIdx.x, gridDim.x, 0);
#else
  __trap();   // not reached: the module is built for sm_90 only
#endif
}

// Clusters of KS blocks along x (grid.x = clusters x KS): block x is rank x % KS of group range
// x / KS.
template <class T, int NT, int KC, int STAGES, int MINB, int KS>
__global__ void GPUOPS_CLUSTER_DIMS(KS) __launch_bounds__(kGtThreads, MINB)
    gemv_mma_tma_split(const __grid_constant__ TmaDesc tma_w, const GemmArgs p) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
  static_assert(KS >= 2 && KS <= 8, "a cluster of 2..8 blocks");
  gemv_tma_body<T, NT, KC, STAGES, KS, false>(tma_w, tma_w, p, blockIdx.x / KS, gridDim.x / KS,
                                              (int)(blockIdx.x % KS));
#else
  __trap();   // not reached: the module is built for sm_90 only
#endif
}

// SwiGLU (swiglu_linear's decode): silu(x w^T) * (x w2^T), both weights streamed through the
// same ring (NT / 2 groups of each per tile, so a slot holds what the single kernel's does).
template <class T, int NT, int KC, int STAGES, int MINB>
__global__ void __launch_bounds__(kGtThreads, MINB)
    gemv_mma_tma_dual(const __grid_constant__ TmaDesc tma_w, const __grid_constant__ TmaDesc tma_w2,
                      const GemmArgs p) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
  gemv_tma_body<T, NT, KC, STAGES, 1, true>(tma_w, tma_w2, p, blockIdx.x, gridDim.x, 0);
#else
  __trap();   // not reached: the module is built for sm_90 only
#endif
}

}  // namespace gemm
}  // namespace gpuops
