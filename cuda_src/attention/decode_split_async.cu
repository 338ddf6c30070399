// Split-KV decode attention with K and V copied by cp.async into a shared-memory ring (sm_80+,
// fp16/bf16, head dim 64 or 128, caches with 16-byte aligned rows: contiguous or paged, any page
// size). The same contract and the same consumer math as decode_split_tma.cu (decode_ring.cuh),
// a different way to fill the ring.
//
// Why (H200 runs 220 and 224, benchmarks/notes_attention_decode.md): torch's SDPA decode on
// Hopper runs cuDNN's sm80 kernel, one block of 4 warps per (batch, kv head) loading K and V with
// cp.async, and streams B16 S4096 GQA 16/8 at 99.6% of copy; decode_split_tma's ring alone,
// without its math, streams the same bytes ~6% slower (67-69 us against cuDNN's whole op 63.5).
// Here the 4 consumer warps load the stages themselves: whole 256-byte key rows (16 lanes x 16
// bytes per row, coalesced), into the swizzled layout the math reads without bank conflicts
// (decode_ring.cuh; the writes take the 4 wavefronts a warp's 512 bytes need).
// What it measured (H200 runs 228-233, bf16 D 128, CUDA graphs over rotated caches): the ring
// without its math streams B16 S4096 in 64.0 us (the TMA ring 67-69); the op at GQA 16/8 B16
// S4096 64.1-64.3 us (99% of copy; register kernel 71.5-72.0, TMA ring 71.2-74.1, torch SDPA
// 62.3-62.6), B1 S8192 15.4-15.5 (register 15.4-15.8, torch 15.2); 64/8 B16 66.2, B1 16.7-17.0.
//
// Pipeline: STAGES slots; stage st is copied into slot st % STAGES as one cp.async group per
// thread, STAGES - 1 stages ahead of the stage in use. At each step a thread waits for its own
// group of the stage (cp.async.wait_group STAGES - 2) and the block meets at __syncthreads: every
// thread's copies of the stage have landed, and every warp is done with the slot the step then
// refills (used at the step before).
// Keys outside the split's [start, end) (the length, the window, the next split's keys) are not
// read: their 16 bytes are zero-filled (cp.async's src-size 0), which also zeroes the V rows past
// the length that the cache may hold NaN in (0 x NaN would be NaN in P V).
// PAGED (paged_attention): key j of batch b at page block_table[b, j / page_size], row
// j % page_size; k / v are the pools [num_pages, page_size, Hkv, D] (strides k_s0..k_s2). The
// table's entries reach shared memory by cp.async too, well ahead of the copies that need them
// (a table slot per stage, after the ring). Measured no faster than the register kernel on page
// pools (H200 run 232: 87.7 us against 88.2 at B16 S4096 GQA 16/8, pages of 64; the TMA ring
// 71.4), so RING 'auto' takes it for contiguous caches only.
#include "attention/decode_ring.cuh"
#include "common/fastdiv.cuh"
#include "common/pdl.cuh"

namespace gpuops {

constexpr int kDaThreads = kDrWarps * 32;                  // ASYNC_THREADS

// GPUOPS_DASYNC_NOMATH=1 (experiments, benchmarks/experiments/decode_ring.py): the warps copy
// and wait for every stage but skip the math (the ring's streaming rate alone; garbage results).
#ifndef GPUOPS_DASYNC_NOMATH
#define GPUOPS_DASYNC_NOMATH 0
#endif

// Dynamic shared memory: STAGES x (K, V) tiles (DecodeRingTile), 128-byte aligned (the swizzle's
// bank pattern repeats every 128 bytes). Host: _async_smem in gpuops/ops/attention_decode.py.
template <int D, int STAGES>
struct DecodeAsyncSmem {
  using Tile = DecodeRingTile<D>;
  static constexpr int kStageBytes = 2 * Tile::kBytes;
  static constexpr int kBytes = STAGES * kStageBytes;      // + kTableBytes when PAGED
  // PAGED: a ring of block-table slices, one per stage (the pages its 64 keys touch: at most
  // kDrKeys + 1 for pages of one key), fetched 2 (STAGES - 1) steps ahead of the stage's
  // copies (see the kernel), so kTableSlots slots
  static constexpr int kTableSlots = 2 * (STAGES - 1);
  static constexpr int kTableEntries = kDrKeys + 4;
  static constexpr int kTableBytes = kTableSlots * kTableEntries * 4;
  static_assert(kBytes >= kDrWarps * kDrRows * (D + 2) * 4, "the merge's scratch fits the ring");
};

struct DecodeAsyncSync {                                   // every warp of the block consumes
  static __device__ __forceinline__ void run() { __syncthreads(); }
};

// pdl as in decode_split (bit 0: let the combine be scheduled; bit 1: wait for the previous
// kernel before the first memory access).
template <class T, int D, int STAGES, bool PAGED>
__global__ void __launch_bounds__(kDaThreads, 2) decode_split_async(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const int* __restrict__ seqlens, const int* __restrict__ block_table,
    float* __restrict__ ws_o, float* __restrict__ ws_lse, T* __restrict__ out,
    float* __restrict__ lse_out, long long q_sb, long long q_ss,
    long long q_sh, long long q_sd, long long k_s0, long long k_s1, long long k_s2,
    long long v_s0, long long v_s1, long long v_s2, long long seq_stride, long long table_s0,
    long long table_s1, int s_max, int sq, int hq, int hkv, int rows, int row_chunks, int chunk,
    int nsplit, int win_left, int pdl, FastDiv page_size, int num_pages, float scale_log2) {
#if !defined(__CUDACC_RTC__) || __CUDA_ARCH__ >= 800
  static_assert(sizeof(T) == 2 && (D == 64 || D == 128), "16-bit storage, head dim 64 or 128");
  using Smem = DecodeAsyncSmem<D, STAGES>;
  using Tile = DecodeRingTile<D>;
  constexpr int kChunks = D / 8;                           // 16-byte chunks per key row
  constexpr int kRowsPerPass = kDaThreads / kChunks;       // key rows one pass of the block copies
  constexpr int kPasses = kDrKeys / kRowsPerPass;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const unsigned int base = smem_addr(smem_raw);

  if (pdl & 2) pdl_wait();
  if (pdl & 1) pdl_launch_dependents();
  const DecodeRingBlock blk(row_chunks, hkv);
  const int b = blk.b, kvh = blk.kvh, rchunk = blk.rchunk, split = blk.split;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  int len = seqlens[b * seq_stride], start, end;
  blk.keys(len, s_max, sq, win_left, chunk, start, end);
  const int steps = end > start ? (end - start + kDrKeys - 1) / kDrKeys : 0;

  // this thread's copies: chunk `col` of key rows row0 + kRowsPerPass * i of each stage
  const int col = tid % kChunks, row0 = tid / kChunks;
  const T* kbase = k + kvh * k_s2 + col * 8;
  const T* vbase = v + kvh * v_s2 + col * 8;
  if (!PAGED) {
    kbase += b * k_s0;
    vbase += b * v_s0;
  }
  // PAGED: the block table's entries for stage st (pages (start + 64 st) / page_size .. that of
  // its last key) are copied into table slot st % kTableSlots by cp.async, 2 (STAGES - 1) steps
  // before the stage's own copies are issued: the copies issued at step t form the group that
  // wait_group STAGES - 2 covers at step t + STAGES - 1, where the stage whose copies need them is
  // issued. (H200 runs 229-231 at B16 S4096 GQA 16/8, pages of 64: table loads from global
  // memory in the copy loop 135 us, looked up a step ahead 199, this slice ring with a page walk
  // per row 111.7; contiguous 64.) The tables of the first 2 (STAGES - 1) stages are waited for
  // once.
  const unsigned int table0 = base + Smem::kBytes;
  auto fetch_table = [&](int st) {
    const int js = start + st * kDrKeys;
    if (!PAGED || js >= end) return;
    const int last = (js + kDrKeys < end ? js + kDrKeys : end) - 1;
    const int p0 = page_size.div(js), n = page_size.div(last) - p0 + 1;
    if (tid < n) {
      const unsigned int dst =
          table0 + ((st % Smem::kTableSlots) * Smem::kTableEntries + tid) * 4;
      cp_async4(dst, block_table + b * table_s0 + (p0 + tid) * table_s1, 4);
    }
  };
  auto load_stage = [&](int st) {
    const unsigned int kslot = base + (st % STAGES) * Smem::kStageBytes;
    const unsigned int vslot = kslot + Tile::kBytes;
    const int js = start + st * kDrKeys;
    // PAGED: row r's key sits at offset (js % page_size) + r from the start of the stage's first
    // page: page index (into the stage's table slice) and row in it by a multiply-shift division
    // each, independent per row (runs 231-232: a page walk carried from row to row, 111.7 us at
    // B16 S4096 GQA 16/8 pages of 64, -> 87.7 this way; contiguous 64.3, the TMA ring's pages
    // 71.4: the rest of the gap is not understood, and the host takes the TMA ring for pages)
    unsigned int rel0 = 0;
    const int* table = nullptr;
    if (PAGED) {
      page_size.divmod(js, rel0);
      rel0 += row0;
      table = reinterpret_cast<const int*>(smem_raw + Smem::kBytes) +
              (st % Smem::kTableSlots) * Smem::kTableEntries;
    }
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = row0 + kRowsPerPass * i;
      const int j = js + r;
      const bool in = j < end;                             // j >= start by construction
      long long koff = 0, voff = 0;                        // a valid address when not `in`
      if (in) {
        if (PAGED) {
          unsigned int pr;
          const unsigned int pi = page_size.divmod(rel0 + kRowsPerPass * i, pr);
          int page = table[pi];
          page = page < 0 ? 0 : (page >= num_pages ? num_pages - 1 : page);
          koff = page * k_s0 + static_cast<long long>(pr) * k_s1;
          voff = page * v_s0 + static_cast<long long>(pr) * v_s1;
        } else {
          koff = j * k_s1;
          voff = j * v_s1;
        }
      }
      const unsigned int at = Tile::at(r, col);
      cp_async16(kslot + at, kbase + koff, in ? 16 : 0);
      cp_async16(vslot + at, vbase + voff, in ? 16 : 0);
    }
  };
  if (PAGED) {                                             // the first tables, waited for
#pragma unroll
    for (int st = 0; st < Smem::kTableSlots; ++st) fetch_table(st);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
  }
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < steps) load_stage(st);
    cp_async_commit();                                     // (empty groups keep the count)
  }

  DecodeRingWarp<T, D> cw;
  cw.start(q, q_sb, q_ss, q_sh, q_sd, b, kvh, rchunk, rows, sq, hq, hkv, len, win_left, lane);
  const int krow = 16 * warp;                              // this warp's first key of a stage
  for (int st = 0; st < steps; ++st) {
    cp_async_wait<STAGES - 2>();                           // this thread's copies of stage st
    __syncthreads();                                       // everyone's; slot st - 1 free
    if (st + STAGES - 1 < steps) load_stage(st + STAGES - 1);
    fetch_table(st + Smem::kTableSlots);                   // its slot's stage is issued
    cp_async_commit();
    const unsigned int kslot = base + (st % STAGES) * Smem::kStageBytes;
    const int j0 = start + st * kDrKeys + krow;            // key of this warp's row 0
#if !GPUOPS_DASYNC_NOMATH
    cw.stage(kslot, kslot + Tile::kBytes, krow, j0, start, end, scale_log2, lane);
#else
    if (j0 < 0) cw.stage(kslot, kslot + Tile::kBytes, krow, j0, start, end, scale_log2, lane);
#endif
  }
  cp_async_wait<0>();                                      // (only empty groups are left)
  __syncthreads();                                         // every warp's reads of the ring done
  cw.template write_partial<DecodeAsyncSync>(smem_raw, ws_o, ws_lse, out, lse_out, b, kvh, rchunk,
                                             rows, sq, hq, hkv, split, nsplit, warp, lane, tid);
#else
  __trap();   // not reached: the host takes this kernel on sm_80+ only
#endif
}

}  // namespace gpuops
