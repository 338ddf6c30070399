// Split-KV decode attention on Hopper with K and V streamed by TMA into a shared-memory ring
// (sm_90, fp16/bf16, head dim 64 or 128, caches whose [B, S, Hkv, D] TMA can describe). The same
// contract as decode_split.cu (one block per kv head, chunk of keys and up to 16 q rows; every
// split writes its normalised partial output and natural log-sum-exp to the fp32 workspace that
// decode_combine.cu merges), a different way to move the bytes.
//
// Why (the decode GEMV's lesson, benchmarks/notes_gemm.md, H200 runs 193-216): a kernel that keeps
// its bytes in flight in registers stalled at ~75% of copy; a ring of shared-memory slots filled
// by TMA boxes (one instruction per 8 KiB, a producer warp, consumers waiting on mbarriers)
// reached 88-100%, with two blocks per SM overlapping each other's ends. The register kernel of
// decode_split.cu reads B1 S8192 at 61.7% of copy and B16 S4096 at ~87%.
// What it measured (H200 runs 218-233, notes_attention_decode.md): no faster than the register
// kernel at 2 q rows per kv head (the bare ring streams B16 S4096 in 67-69 us, the register kernel
// 70), its cost not growing with the rows up to 16 (GQA 64/8 B1 S8192 44.5 -> 18.5 us); the
// cp.async ring of decode_split_async.cu (same math) is faster on contiguous caches (B16 S4096
// 16/8 64.2 against 71.5), so the host takes this kernel for page pools, where it reads pages of
// 64 as fast as a contiguous cache (71.4 us) and the cp.async ring does not (87.7).
//
// Block: warps 0..3 consume (decode_ring.cuh: the stage layout, the math, the block's partial),
// warp 4 produces: one lane waits for a free slot, expects the stage's bytes on the slot's "full"
// mbarrier and issues 2 * D / 64 boxes of 64 keys x 64 head-dim columns in TMA's 128-byte
// swizzle (the layout decode_ring.cuh reads); a consumer warp frees the slot (one arrival per
// warp) after its part of the stage.
//
// Paged caches: see PAGED below. Keys at or past the sequence length inside the last box (the
// cache may hold anything there, NaN included) get score -inf and their V rows are zeroed in
// shared memory before P V (0 x NaN would be NaN); keys past S_max arrive as TMA's zeros. The
// producer reads the length before its first box (a split past the length loads nothing).
#include "attention/decode_ring.cuh"
#include "common/pdl.cuh"
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
#include "common/wgmma.cuh"   // mbarriers, TMA
#endif

namespace gpuops {

// Proxy fences (PTX ISA "Memory Consistency Model", proxies): the ring's bytes are written by
// TMA (the async proxy) and read, zeroed and reused for the final merge by ordinary shared-memory
// instructions (the generic proxy); the mbarriers order the two only together with
// fence.proxy.async: after a consumer's last read of a slot and before it hands the slot back
// (else the next TMA fill may land before the read: DeepEP's race, deepseek-ai/DeepEP#642), and
// after the block's last generic writes (the merge), which a later block's TMA fill of the same
// shared memory must not overtake. Experiments build the kernel without them
// (-DGPUOPS_DTMA_FENCES=0, benchmarks/experiments/decode_tma_debug.py).
#ifndef GPUOPS_DTMA_FENCES
#define GPUOPS_DTMA_FENCES 1
#endif

constexpr int kDtConsumers = kDrWarps, kDtThreads = (kDtConsumers + 1) * 32;   // TMA_THREADS
constexpr int kDtKeys = kDrKeys;                                              // keys per stage

// Dynamic shared memory: 1 KiB of alignment slack, then STAGES x (K boxes, V boxes) of
// kDtKeys x 128 bytes each (host: _tma_smem in gpuops/ops/attention_decode.py).
// (Runs 221 and 224 also measured two other layouts of a stage, one 5-D box per tensor with a key's
// two 128-byte halves adjacent, and whole 256-byte rows without swizzle: no faster, the second
// 36 us slower at B16 S4096 with the math; removed.)
// GPUOPS_DTMA_NOMATH=1 (experiments): the consumers only wait for each stage and hand it back.
#ifndef GPUOPS_DTMA_NOMATH
#define GPUOPS_DTMA_NOMATH 0
#endif

template <int D, int STAGES>
struct DecodeTmaSmem {
  using Tile = DecodeRingTile<D>;
  static constexpr int kBoxBytes = Tile::kBoxBytes;
  static constexpr int kBoxes = Tile::kBoxes;              // 64-column halves per tensor
  static constexpr int kTensorBytes = Tile::kBytes;        // K (or V) of one stage
  static constexpr int kStageBytes = 2 * kTensorBytes;
  static constexpr int kBytes = 1024 + STAGES * kStageBytes;
};

#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
struct DecodeTmaConsumersSync {                            // the consumer warps only
  static __device__ __forceinline__ void run() { named_bar_sync(1, kDtConsumers * 32); }
};
#endif

// pdl as in decode_split (bit 0: let the combine be scheduled; bit 1: wait for the previous
// kernel before the first memory access).
// PAGED (paged_attention): the tensor maps describe the page pool [num_pages, page_size, Hkv, D]
// with boxes of min(page_size, 64) rows (the host takes page sizes that divide 64 or are
// multiples of it); a stage's 64 keys are 64 / rows boxes, each from the page the block table
// names (lane i of the producer warp looks up and issues box i), and the stages start at a
// multiple of the box rows (keys before the split's start are masked).
template <class T, int D, int STAGES, bool PAGED>
__global__ void __launch_bounds__(kDtThreads, 2) decode_split_tma(
    const __grid_constant__ TmaDesc tma_k, const __grid_constant__ TmaDesc tma_v,
    const T* __restrict__ q, const int* __restrict__ seqlens, const int* __restrict__ block_table,
    float* __restrict__ ws_o, float* __restrict__ ws_lse, T* __restrict__ out,
    float* __restrict__ lse_out, long long q_sb, long long q_ss,
    long long q_sh, long long q_sd, long long seq_stride, long long table_s0, long long table_s1,
    int s_max, int sq, int hq, int hkv, int rows, int row_chunks, int chunk, int nsplit,
    int win_left, int pdl, int page_size, int num_pages, float scale_log2) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
  static_assert(sizeof(T) == 2 && (D == 64 || D == 128), "16-bit storage, head dim 64 or 128");
  using Smem = DecodeTmaSmem<D, STAGES>;
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long bars[2 * STAGES];   // full[s], then empty[s]
  const unsigned int base = (smem_u32(smem_raw) + 1023u) & ~1023u;   // swizzle atoms: 1 KiB
  unsigned char* ring = smem_raw + (base - smem_u32(smem_raw));

  if (pdl & 2) pdl_wait();
  if (pdl & 1) pdl_launch_dependents();
  const DecodeRingBlock blk(row_chunks, hkv);
  const int b = blk.b, kvh = blk.kvh, rchunk = blk.rchunk, split = blk.split;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const unsigned int full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[STAGES]);
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, kDtConsumers);
    }
    mbar_fence_init();
  }
  int len = seqlens[b * seq_stride], start, end;
  __syncthreads();
  blk.keys(len, s_max, sq, win_left, chunk, start, end);
  // boxes of box_rows keys; the stages from first (start rounded down to whole boxes)
  const int box_rows = PAGED ? (page_size < kDtKeys ? page_size : kDtKeys) : kDtKeys;
  const int first = PAGED ? start - start % box_rows : start;
  const int steps = end > start ? (end - first + kDtKeys - 1) / kDtKeys : 0;

  if (warp == kDtConsumers) {                              // the producer
    if (PAGED && steps > 0) {
      const int nb = kDtKeys / box_rows;                   // page boxes per stage
      const int max_pages = s_max / page_size;
      if (lane == 0) {
        tma_prefetch_desc(&tma_k);
        tma_prefetch_desc(&tma_v);
      }
      for (int st = 0; st < steps; ++st) {
        const int s = st % STAGES;
        int page = 0, prow = 0;
        if (lane < nb) {                                   // box lane: keys j .. j + box_rows
          const int j = first + st * kDtKeys + lane * box_rows;
          const int pi = j / page_size;
          prow = j - pi * page_size;
          // past the table: keys past the length (masked, V zeroed): any page in the pool
          page = pi < max_pages ? block_table[b * table_s0 + pi * table_s1] : 0;
          page = page < 0 ? 0 : (page >= num_pages ? num_pages - 1 : page);
        }
        if (lane == 0) {
          if (st >= STAGES) mbar_wait(empty0 + 8 * s, (unsigned int)((st / STAGES) & 1) ^ 1u);
          mbar_arrive_expect_tx(full0 + 8 * s, Smem::kStageBytes);
        }
        __syncwarp();
        if (lane < nb) {
          const unsigned int dst = base + s * Smem::kStageBytes + lane * box_rows * 128;
#pragma unroll
          for (int x = 0; x < Smem::kBoxes; ++x) {
            tma_load_4d(dst + x * Smem::kBoxBytes, &tma_k, full0 + 8 * s, 64 * x, prow, kvh, page);
            tma_load_4d(dst + (Smem::kBoxes + x) * Smem::kBoxBytes, &tma_v, full0 + 8 * s,
                        64 * x, prow, kvh, page);
          }
        }
      }
    } else if (!PAGED && lane == 0 && steps > 0) {
      tma_prefetch_desc(&tma_k);
      tma_prefetch_desc(&tma_v);
      for (int st = 0; st < steps; ++st) {
        const int s = st % STAGES;
        if (st >= STAGES) mbar_wait(empty0 + 8 * s, (unsigned int)((st / STAGES) & 1) ^ 1u);
        mbar_arrive_expect_tx(full0 + 8 * s, Smem::kStageBytes);
        const unsigned int dst = base + s * Smem::kStageBytes;
        const int j0 = first + st * kDtKeys;
#pragma unroll
        for (int x = 0; x < Smem::kBoxes; ++x) {
          tma_load_4d(dst + x * Smem::kBoxBytes, &tma_k, full0 + 8 * s, 64 * x, j0, kvh, b);
          tma_load_4d(dst + (Smem::kBoxes + x) * Smem::kBoxBytes, &tma_v, full0 + 8 * s, 64 * x,
                      j0, kvh, b);
        }
      }
    }
    return;
  }

  // the consumers
  DecodeRingWarp<T, D> cw;
  cw.start(q, q_sb, q_ss, q_sh, q_sd, b, kvh, rchunk, rows, sq, hq, hkv, len, win_left, lane);
  const int krow = 16 * warp;                              // this warp's first key of a stage
  for (int st = 0; st < steps; ++st) {
    const int s = st % STAGES;
    mbar_wait(full0 + 8 * s, (unsigned int)((st / STAGES) & 1));
    const unsigned int kslot = base + s * Smem::kStageBytes;
    const unsigned int vslot = kslot + Smem::kTensorBytes;
    const int j0 = first + st * kDtKeys + krow;            // key of this warp's row 0
#if GPUOPS_DTMA_NOMATH   // experiments: the ring's streaming rate alone (results are garbage)
    if (j0 < 0) DecodeRingWarp<T, D>::zero_v_past(vslot, krow, j0, len, lane);
#else
    // keys at or past the length: V rows to zeros (TMA copies whatever the cache holds there)
    if (j0 + 16 > len) DecodeRingWarp<T, D>::zero_v_past(vslot, krow, j0, len, lane);
    cw.stage(kslot, vslot, krow, j0, start, end, scale_log2, lane);
#endif
#if GPUOPS_DTMA_FENCES
    fence_proxy_async_smem();                              // our reads before the next fill
#endif
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * s);            // this warp is done with the slot
  }
  // the ring is free: every box the producer issued has been waited for and read
  cw.template write_partial<DecodeTmaConsumersSync>(ring, ws_o, ws_lse, out, lse_out, b, kvh,
                                                    rchunk, rows, sq, hq, hkv, split, nsplit,
                                                    warp, lane, tid);
#if GPUOPS_DTMA_FENCES
  // the merge's writes before any later TMA fill of this shared memory (the next block here);
  // the barriers' memory handed back (mbarrier.inval: PTX requires it before the memory is
  // used otherwise; every TMA and wait on them is done once the consumers are here)
  fence_proxy_async_smem();
  named_bar_sync(1, kDtConsumers * 32);
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < 2 * STAGES; ++s)
      asm volatile("mbarrier.inval.shared::cta.b64 [%0];" :: "r"(full0 + 8 * s) : "memory");
  }
#endif
#else
  __trap();   // not reached: the module is built for sm_90 only
#endif
}

}  // namespace gpuops
