// Long rows in one pass over memory: every element is read once into shared memory, held there
// while the row's statistics are gathered from all the blocks that hold parts of it, and written
// once. The forward ops' plan for rows split over blocks (norms/norm_rows.cuh: C > 1).
//
// Work is cut into tiles: a tile is `tile_units = blockDim.x * PACKS` consecutive units of one
// row (thread t holds units base + p * blockDim.x + t, p < PACKS, as in norm_rows.cuh), and a row
// is C tiles. Tile i (= row * C + chunk) goes to block i % gridDim.x, so each block walks its
// tiles in increasing row order, K of them, and every row's tiles are spread over the grid. A
// block keeps its last D tiles in a ring of D slots of dynamic shared memory. Its loop, tile k:
//
//   land k      the loads of tile k (issued one step earlier) arrive: stored raw into slot
//               k % D, reduced to this thread's partial (kAdd: h = x + r is formed and stored)
//   issue k+1   the loads of the next tile go out, and stay in flight during what follows
//   publish k   block reduction of the partials, arrival at the row's counter; the row's last
//               block merges the row's C partials into its statistics and releases the row
//               (common/row_split.cuh)
//   drain k+1-D wait for that tile's row to be released (published D - 1 steps ago, so normally
//               long done), normalize the tile from its slot and store it: the slot is free for
//               tile k+1.
//
// and after the last tile, the D - 1 tiles still held are drained in order. DRAM sees one read
// and one write per element; a block stalls on a row's statistics only at the end, or when the
// grid is so uneven that a row's last tile lands more than D - 1 steps after others.
//
// Two exchanges of the tiles' partials (the statistics of a row = merge of its C tiles'):
//   ring_rows  ("ring") arrival at the row's counter (atomic acq_rel), the row's last block
//              merges the C partials and releases the row; drains poll the counter, then read
//              the statistics it wrote. Counters zeroed by a memset before each launch.
//   ring2_rows ("ring2") each tile's partial is published as self-validating 64-bit words
//              {value, tag} (relaxed stores: no atomic, no fence, no merger); a draining warp
//              reads the row's C words (one L2 round trip, which returns the data as well),
//              re-polling the ones whose tag is not this launch's yet, and merges them itself
//              in a fixed order: every warp of every block gets bit-identical statistics, and
//              nothing is read back but the words. The tag is this launch's epoch (below).
//
// Forward progress: a block that waits on a row has published all its own tiles of that row
// when no block holds more than D tiles of one row (then tiles k+1-D .. k+1, which span D + 1
// steps, are never all in one row); the host checks ceil(C / gridDim.x) <= D. Then the lowest
// row anyone waits on has every tile published or held by a block that is not waiting, so the
// grid progresses, PROVIDED every block is resident at once: the host sizes the grid from the
// occupancy calculator (with this shared memory) and falls back to the two-launch plan when the
// rows do not fit. The per-thread ring is private (a thread reads back only the units it wrote),
// so slots need no barriers of their own.
#pragma once
#include "norms/norm_rows.cuh"
#include "common/mma.cuh"     // cp_async16 / commit / wait, smem_addr: "resident" (sm_80+)
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
#include "common/wgmma.cuh"   // mbarriers and bulk copies: "resident" on sm_90
#define GPUOPS_RESIDENT_BULK 1
#else
#define GPUOPS_RESIDENT_BULK 0
#endif

#ifdef GPUOPS_RESIDENT_TRACE
// Experiments only (benchmarks/experiments/norms_resident_trace.py builds a module with
// -DGPUOPS_RESIDENT_TRACE=N): thread 0 of the first N blocks of a resident launch stores
// %globaltimer (ns, one clock for all SMs; it ticks in 256 ns steps on the H100) at the steps of
// resident_rows (stamp indices there) and its SM id in slot 23; RESIDENT_MARK_LAST stamps from
// lane 0 of the block's last warp (slots 24..); the experiment reads the array by name (an
// unmangled symbol).
__device__ unsigned long long gpuops_resident_trace[GPUOPS_RESIDENT_TRACE][32];
#define RESIDENT_MARK_BY(thread, i)                                                           \
  do {                                                                                        \
    if (threadIdx.x == (thread) && blockIdx.x < GPUOPS_RESIDENT_TRACE) {                      \
      unsigned long long t_;                                                                  \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_) : : "memory");                     \
      gpuops_resident_trace[blockIdx.x][(i)] = t_;                                            \
      if ((i) == 0) {                                                                         \
        unsigned sm_;                                                                         \
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));                                      \
        gpuops_resident_trace[blockIdx.x][23] = sm_;                                          \
      }                                                                                       \
    }                                                                                         \
  } while (0)
#define RESIDENT_MARK(i) RESIDENT_MARK_BY(0u, i)
#define RESIDENT_MARK_LAST(i) RESIDENT_MARK_BY(blockDim.x - 32u, i)
#else
#define RESIDENT_MARK(i) do {} while (0)
#define RESIDENT_MARK_LAST(i) do {} while (0)
#endif

namespace gpuops {

// Shared memory before the ring: the block reductions' scratch (96 floats) and the arrival flag
// ("ring"), or from byte 384 the held tiles' statistics ("resident": 2 floats per tile, up to 8
// tiles: at most 7 slots, norms.py RESIDENT_MAX_DEPTH) and from byte 448 the slots' mbarriers
// (sm_90).
constexpr int kRingHeaderBytes = 512;
constexpr int kResidentStatsOffset = 384;
constexpr int kResidentBarOffset = 448;
constexpr int kResidentBulkMinTiles = 4;   // bulk copies from this many slot tiles (sm_90)

// Resident blocks of 512 threads the ring kernels are compiled for (__launch_bounds__(512,
// GPUOPS_RING_MIN_BLOCKS)): 2 (64 registers) from sm_70. Pascal's plan runs 256-thread tiles (48
// KiB of shared memory per block: norms.py, _ring_plan), where 2 blocks per SM allow 128
// registers; at 64, rms_norm_ring<bf16 / fp32, 4 packs> spilled 8 B on sm_61 (NVRTC 12.9).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#define GPUOPS_RING_MIN_BLOCKS 1
#else
#define GPUOPS_RING_MIN_BLOCKS 2
#endif

// Where this thread's units of ring slot `s` live: unit p at slot_base[p * blockDim.x].
template <class T, int VEC, int PACKS>
__device__ __forceinline__ typename RawUnit<T, VEC>::type* ring_slot(unsigned char* ring, int s) {
  using Raw = typename RawUnit<T, VEC>::type;
  // (32-bit offsets: shared memory; 64-bit math here costs registers the 4-pack kernels lack)
  return reinterpret_cast<Raw*>(ring) + (static_cast<unsigned>(s) * blockDim.x * PACKS +
                                         threadIdx.x);
}

// A tile of a block (tile t = row * C + chunk; a block's are first, first + step, ..., step =
// gridDim.x): its row and chunk, in 32 bits (the host launches a ring only when rows * C < 2^31:
// norms.py, _ring_grid). The landing walks its tiles by advance() (adding step / C, step % C
// with a carry); the drain divides once per tile, from the tile's index, and gets its slot from
// the caller: nothing of the drained tiles is carried through the loop. The 64-bit division,
// 64-bit slot addresses and drain counters of before made the 16-byte 4-pack kernels spill
// under __launch_bounds__(512, 2) (ring2 8-44 B on sm_61 .. sm_90, ring 12 B on sm_70); this
// layout was chosen by ptxas's spill counts on sm_61 .. sm_90 (benchmarks/notes_norms.md).
// Offsets from `row` are formed in 64 bits where used.
struct RingTile {
  int row, chunk;
  __device__ __forceinline__ RingTile(unsigned t, unsigned C) {
    const unsigned r = t / C;
    row = static_cast<int>(r);
    chunk = static_cast<int>(t - r * C);
  }
  __device__ __forceinline__ void advance(const RingTile& step, int C) {
    row += step.row;
    chunk += step.chunk;
    if (chunk >= C) {
      chunk -= C;
      ++row;
    }
  }
  // This thread's first unit of the tile in its row.
  __device__ __forceinline__ int u0(int tile_units) const {
    return chunk * tile_units + static_cast<int>(threadIdx.x);
  }
  // Index of this tile's first partial / word of `per_tile` (64-bit: rows * C * per_tile may
  // pass 2^31).
  __device__ __forceinline__ long long index(int C, int per_tile) const {
    return (static_cast<long long>(row) * C + chunk) * per_tile;
  }
};

// The slot after `s` in a ring of D (k % D counted along, no division per tile).
__device__ __forceinline__ int next_slot(int s, int D) { return s + 1 == D ? 0 : s + 1; }

// The output side of a ring policy, the same for every op: y = (x - mu) * s (kCentered; else
// x * s), times w, plus b (kCentered only), where present. The w (and b) units of G packs at a
// time are loaded before they are used; group 0 by the caller (load_group), before it waits for
// the row's statistics, so that these loads are in flight through the wait.
template <class T, int VEC, int PACKS, bool kCentered, int G>
struct RingOutput {
  using R = RawUnit<T, VEC>;
  using Raw = typename R::type;
  static constexpr int kGroup = G;
  T* y;
  long long ys;
  const T* w;
  const T* b;                          // (kCentered only)
  float* mean;                         // per-row statistics out (kCentered), or null
  float* rstd;                         // or null (ring2 only: ring needs it for the exchange)
  float inv_n, eps;
  Raw wr[G];
  Raw br[kCentered ? G : 1];
  Raw wn[G];                           // "resident": group 0 of the next tile, loaded ahead
  Raw bn[kCentered ? G : 1];
  Raw wt[PACKS];                       // "resident": a whole tile's w (b), loaded once where
  Raw bt[kCentered ? PACKS : 1];       // every tile of the block has the same chunk

  // kCg: through L2 only (ring2: not the tile loads' path); else as the other kernels load w.
  template <bool kCg>
  __device__ __forceinline__ static Raw param(const T* p, int unit, int units) {
    if (unit >= units) return R::zero();
    if constexpr (kCg && VEC > 1) {
      return load16_cg(p + static_cast<long long>(unit) * VEC);
    } else {
      return R::load(p + static_cast<long long>(unit) * VEC);
    }
  }

  // Group p0 / G of w (and b) into wr, br; kAhead: into wn, bn (the next tile's group 0, in
  // flight through this tile's stores; take_ahead() moves it into wr, br).
  template <bool kCg, bool kAhead = false>
  __device__ __forceinline__ void load_group(int u0, int p0, int units) {
    auto& wd = kAhead ? wn : wr;
    auto& bd = kAhead ? bn : br;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int unit = u0 + (p0 + g) * static_cast<int>(blockDim.x);
      if (w != nullptr) wd[g] = param<kCg>(w, unit, units);
      if (kCentered && b != nullptr) bd[kCentered ? g : 0] = param<kCg>(b, unit, units);
    }
  }
  // w (b) of this thread's units of a whole tile into wt, bt.
  __device__ __forceinline__ void load_whole(int u0, int units) {
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      const int unit = u0 + p * static_cast<int>(blockDim.x);
      if (w != nullptr) wt[p] = param<true>(w, unit, units);
      if (kCentered && b != nullptr) bt[kCentered ? p : 0] = param<true>(b, unit, units);
    }
  }
  __device__ __forceinline__ void take_ahead() {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      wr[g] = wn[g];
      if (kCentered) br[kCentered ? g : 0] = bn[kCentered ? g : 0];
    }
  }

  // Normalizes this thread's units of a held tile and stores them (group 0 of w, b loaded). The
  // tile is in a ring slot (unit p at slot[p * blockDim.x]), or with kRegs in registers (an array
  // of PACKS units: "resident"'s last tile). kEvictFirst: y stored evict-first (st.global.cs,
  // 16-byte units; "resident", below).
  template <bool kCg, bool kRegs = false, bool kEvictFirst = false>
  __device__ __forceinline__ void store_tile(const Raw* slot, long long row, int u0, int units,
                                             float mu, float s) {
#pragma unroll
    for (int p0 = 0; p0 < PACKS; p0 += G) {
      if (p0 > 0) load_group<kCg>(u0, p0, units);
      store_group<kRegs, kEvictFirst, false>(slot, row, u0, p0, units, mu, s);
    }
  }

  // Packs p0 .. p0 + G - 1 of store_tile, with the group's w (b) in wr (br), or with kWhole in
  // wt (bt) (p0 a compile-time constant where unrolled).
  template <bool kRegs, bool kEvictFirst, bool kWhole>
  __device__ __forceinline__ void store_group(const Raw* slot, long long row, int u0, int p0,
                                              int units, float mu, float s) {
    T* y_row = y + row * ys;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int unit = u0 + (p0 + g) * static_cast<int>(blockDim.x);
      if (unit < units) {
        float f[VEC];
        R::unpack(slot[kRegs ? p0 + g : (p0 + g) * blockDim.x], f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] = kCentered ? (f[j] - mu) * s : f[j] * s;
        if (w != nullptr) {
          float wf[VEC];
          R::unpack(kWhole ? wt[p0 + g] : wr[g], wf);
#pragma unroll
          for (int j = 0; j < VEC; ++j) f[j] *= wf[j];
        }
        if (kCentered && b != nullptr) {
          float bf[VEC];
          R::unpack(kWhole ? bt[kCentered ? p0 + g : 0] : br[kCentered ? g : 0], bf);
#pragma unroll
          for (int j = 0; j < VEC; ++j) f[j] += bf[j];
        }
        if constexpr (kEvictFirst && VEC > 1) {
          store16_evict_first(y_row + static_cast<long long>(unit) * VEC, R::pack(f));
        } else {
          R::store(y_row + static_cast<long long>(unit) * VEC, R::pack(f));
        }
      }
    }
  }
};

// "ring": the loop of the file comment over a policy P (LayerNormRing in layer_norm.cu,
// RmsNormRing in rms_norm.cu: a RingOutput), which provides Elem, kVec, kPacks (the tile's T,
// VEC, PACKS) and
//   K                        floats of a tile's partial statistics
//   issue(row, u0, units)    start the loads of a tile into registers
//   land(slot, row, u0, units, part)   store them into the ring slot; this thread's partial
//   reduce(part, scratch)    the block's partial (every thread gets it)
//   merge(row_partials, C, row, scratch)   the row's last block: statistics from the C partials
//   load_stats(row, mu, s)   the row's statistics, as merge stored them
// `partials`: rows * C * K floats; `counters`: rows unsigned ints, zeroed before the launch.
template <class P>
__device__ __forceinline__ void ring_rows(P& pol, long long rows, int units, int C, int D,
                                          float* partials, unsigned* counters,
                                          unsigned char* smem) {
  using Elem = typename P::Elem;
  float* scratch = reinterpret_cast<float*>(smem);
  unsigned* flag = reinterpret_cast<unsigned*>(smem + 96 * sizeof(float));
  unsigned char* ring = smem + kRingHeaderBytes;
  const int tile_units = static_cast<int>(blockDim.x) * P::kPacks;
  const unsigned tiles = static_cast<unsigned>(rows) * C;    // < 2^31 (RingTile)
  const unsigned first = blockIdx.x, step = gridDim.x;
  if (first >= tiles) return;                      // (the host launches at most `tiles` blocks)
  const int K = static_cast<int>((tiles - 1 - first) / step) + 1;
  const RingTile stride(step, C);                  // (step / C, step % C)
  auto drain = [&](int j, int dslot) {             // tile j, in slot j % D (as ring2_rows)
    const RingTile dr(first + static_cast<unsigned>(j) * step, C);
    const int u0 = dr.u0(tile_units);
    split_wait(counters + dr.row, static_cast<unsigned>(C + 1));
    float mu, s;
    pol.load_stats(dr.row, mu, s);
    pol.template load_group<false>(u0, 0, units);
    pol.template store_tile<false>(ring_slot<Elem, P::kVec, P::kPacks>(ring, dslot), dr.row, u0,
                                   units, mu, s);
  };

  RingTile cur(first, C);
  int slot = 0;
  pol.issue(cur.row, cur.u0(tile_units), units);
  for (int k = 0; k < K; ++k) {
    float part[P::K];
    pol.land(ring_slot<Elem, P::kVec, P::kPacks>(ring, slot), cur.row, cur.u0(tile_units), units,
             part);
    RingTile next = cur;
    next.advance(stride, C);
    if (k + 1 < K) pol.issue(next.row, next.u0(tile_units), units);
    pol.reduce(part, scratch);
    float* row_partials = partials + static_cast<long long>(cur.row) * C * P::K;
    if (split_arrive<P::K>(row_partials + cur.chunk * P::K, part, counters + cur.row, flag) ==
        static_cast<unsigned>(C - 1)) {
      pol.merge(row_partials, C, cur.row, scratch);
      split_release(counters + cur.row);
    }
    slot = next_slot(slot, D);                     // (k + 1) % D
    if (k + 1 - D >= 0) drain(k + 1 - D, slot);    // frees it for tile k + 1
    cur = next;
  }
  for (int j = max(0, K + 1 - D); j < K; ++j) drain(j, j % D);
}

// ----------------------------------------------------------------------------------- ring2
//
// State (one buffer per device and stream, owned by the host, zeroed once when allocated and
// never reset): state[0] the launch counter c, state[1] the exit counter, then from byte 16 the
// words, rows * C * kWords of them, word (row * C + chunk) * kWords + i.
//
// The epoch. Every thread reads c when its block starts; this launch's tag is c + 1 (1 ..
// 2^32 - 1: a zeroed word, tag 0, is never valid). Each block, at its end, adds 1 to the exit
// counter; the block that sees G - 1 (the grid's last to finish) stores 0 there and c + 1 in
// state[0] (0 instead of 2^32 - 1, so the next tag is 1, never 0). Why this is right:
//  - one tag per launch: c changes only when every block of the launch has added to the exit
//    counter, i.e. after every block has read c (the read's value is consumed: the block's
//    words carry it and its polls compare against it, before its __syncthreads and its add);
//  - a new tag per launch: the next launch on the stream (kernel, graph node, graph replay)
//    starts after this grid has completed, when state[0] = c + 1 is visible; the words of
//    every earlier launch carry tags <= c (or a tag 2^32 - 1 launches old), so a word with
//    tag c + 1 was written by this launch: no stale partial passes, whatever shape the
//    earlier launches had and whatever they left in the words.
//  - CUDA graphs: nothing comes from the host per launch (the kernel reads the counter on the
//    device), so a graph replays correctly any number of times, interleaved with eager calls
//    on the same stream, and replays of one graph are serialized by CUDA.
// The one thing it needs: no two ring2 grids on one state buffer at once. The host keys the
// buffer by stream; a graph replayed on another stream than the one it was captured on, while
// eager ring2 calls run on that stream, would share it (like two rings running concurrently,
// which already risk not being resident together: norm_ring.cuh's forward progress).

__device__ __forceinline__ unsigned long long ring_word(float v, unsigned tag) {
  return (static_cast<unsigned long long>(tag) << 32) | __float_as_uint(v);
}

// The epoch (above), at the end of every block: the grid's last block to get here moves the
// launch counter on.
__device__ __forceinline__ void ring2_epoch_end(unsigned* state, unsigned tag) {
  __syncthreads();
  if (threadIdx.x == 0 && counter_add_relaxed(state + 1, 1u) == gridDim.x - 1) {
    store_relaxed(state + 1, 0u);
    store_relaxed(state, tag == 0xffffffffu ? 0u : tag);
  }
}

// Tile t's partial, published: the block's reduction, then thread 0 stores its words. (The
// words' address is formed after the reduction: live across its barriers, it cost ring2_rows a
// register and rms_norm_ring2<bf16, 8, 4> a spill on sm_90.) `full`: the tile is whole and every
// thread's partial counts the same (P::reduce may take a cheaper merge).
template <class P>
__device__ __forceinline__ void ring2_publish(P& pol, unsigned long long* words,
                                              const RingTile& t, int C, unsigned tag,
                                              float (&part)[P::K], float* scratch,
                                              bool full = false) {
  pol.reduce(part, scratch, full);
  if (threadIdx.x == 0) {
    float v[P::kWords];
    pol.words(part, v);
    unsigned long long* dst = words + t.index(C, P::kWords);
#pragma unroll
    for (int i = 0; i < P::kWords; ++i) store_word_relaxed(dst + i, ring_word(v[i], tag));
  }
}

// This warp's copy of a row's statistics: lane l reads the words of chunks l, l + 32, ... (the
// first 32 * kBatch of them in one round trip), re-polls those not yet written by this launch,
// and merges them in increasing chunk order, then across lanes (a butterfly of merges that are
// symmetric in their arguments): the same bits in every lane, warp and block.
template <int kBatch, class P>
__device__ __forceinline__ typename P::Acc ring2_row_acc(const P& pol,
                                                         const unsigned long long* row_words,
                                                         int C, unsigned tag, int tile_units,
                                                         int units) {
  constexpr int W = P::kWords;
  const int lane = threadIdx.x & 31;
  typename P::Acc acc = P::acc_zero();
  for (int c0 = 0; c0 < C; c0 += 32 * kBatch) {
    unsigned long long word[kBatch][W];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int c = c0 + 32 * i + lane;
#pragma unroll
      for (int k = 0; k < W; ++k)
        word[i][k] = c < C ? load_word_relaxed(row_words + static_cast<size_t>(c) * W + k) : 0ull;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int c = c0 + 32 * i + lane;
      if (c < C) {
#pragma unroll
        for (int k = 0; k < W; ++k) {
          while (static_cast<unsigned>(word[i][k] >> 32) != tag) {
            poll_pause();
            word[i][k] = load_word_relaxed(row_words + static_cast<size_t>(c) * W + k);
          }
        }
        float v[W];
#pragma unroll
        for (int k = 0; k < W; ++k) v[k] = __uint_as_float(static_cast<unsigned>(word[i][k]));
        const int valid = min(tile_units, units - c * tile_units);
        acc = pol.acc_add(acc, v, static_cast<float>(valid * P::kVec));
      }
    }
  }
  return P::acc_warp(acc);
}

// "ring2": the loop of ring_rows with the exchange above. P as for ring_rows, with, instead of
// K's merge / load_stats:
//   kWords                   words (floats) a tile publishes; words(part, v) fills them
//   Acc, acc_zero(), acc_add(acc, v, count), acc_warp(acc)   the row's merge
//   stats(acc, mu, s)        the row's statistics from the merge
//   write_stats(row, mu, s)  into mean / rstd (where wanted; the block holding chunk 0)
// kBatch: chunks per lane per poll round trip (32 * kBatch words at once).
template <int kBatch, class P>
__device__ __forceinline__ void ring2_rows(P& pol, long long rows, int units, int C, int D,
                                           unsigned* state, unsigned char* smem) {
  using Elem = typename P::Elem;
  constexpr int W = P::kWords;
  float* scratch = reinterpret_cast<float*>(smem);
  unsigned char* ring = smem + kRingHeaderBytes;
  unsigned long long* words = reinterpret_cast<unsigned long long*>(state + 4);
  const unsigned tag = load_relaxed(state) + 1u;
  const int tile_units = static_cast<int>(blockDim.x) * P::kPacks;
  const unsigned tiles = static_cast<unsigned>(rows) * C;    // < 2^31 (RingTile)
  const unsigned first = blockIdx.x, step = gridDim.x;
  const int K = first < tiles ? static_cast<int>((tiles - 1 - first) / step) + 1 : 0;
  const RingTile stride(step, C);                  // (step / C, step % C)
  auto slot_of = [&](int s) { return ring_slot<Elem, P::kVec, P::kPacks>(ring, s); };
  // Tile j, held in slot j % D (`dslot`). Its row by a division, not by a second cursor, and
  // no count of drained tiles kept: registers live through the landing and the poll.
  auto drain = [&](int j, int dslot) {
    const RingTile dr(first + static_cast<unsigned>(j) * step, C);
    const int u0 = dr.u0(tile_units);
    if (P::kPrefetch) pol.template load_group<true>(u0, 0, units);   // in flight through the poll
    float mu, s;
    const unsigned long long* row_words = words + static_cast<long long>(dr.row) * C * W;
    pol.stats(ring2_row_acc<kBatch>(pol, row_words, C, tag, tile_units, units), mu, s);
    if (dr.chunk == 0 && threadIdx.x == 0) pol.write_stats(dr.row, mu, s);
    if (!P::kPrefetch) pol.template load_group<true>(u0, 0, units);   // (registers: spills)
    pol.template store_tile<true>(slot_of(dslot), dr.row, u0, units, mu, s);
  };
  auto publish = [&](const RingTile& t, float (&part)[P::K]) {
    ring2_publish(pol, words, t, C, tag, part, scratch);
  };

  if (K > 0) {
    RingTile cur(first, C);
    int slot = 0;
    pol.issue(cur.row, cur.u0(tile_units), units);
    for (int k = 0; k < K; ++k) {
      float part[P::K];
      pol.land(slot_of(slot), cur.row, cur.u0(tile_units), units, part);
      RingTile next = cur;
      next.advance(stride, C);
      if (k + 1 < K) pol.issue(next.row, next.u0(tile_units), units);
      publish(cur, part);
      slot = next_slot(slot, D);                   // (k + 1) % D
      if (k + 1 - D >= 0) drain(k + 1 - D, slot);  // frees it for tile k + 1
      cur = next;
    }
    for (int j = max(0, K + 1 - D); j < K; ++j) drain(j, j % D);
  }
  ring2_epoch_end(state, tag);
}


// ------------------------------------------------------------------------------------ resident
//
// "resident": every block holds ALL its tiles at once, so a launch has one exchange instead of
// one per ring step. Its tiles (K of them, tiles first, first + gridDim.x, ... as above) are
// copied global -> slot, every copy issued at kernel start: per thread by cp.async (one commit
// group per tile), or on sm_90 for 4+ slot tiles one bulk copy per tile on an mbarrier; the
// (D+1)-th tile, where there is one, by plain loads into registers after them. Then the tiles
// land in order, each publishing its partial as ring2's words; only when all are published does
// the block gather the statistics of its tiles' rows (ring2's poll, one warp per tile, in two
// rounds) and drain the tiles in order, each tile's stores issued after the next tile's w (and
// b) loads. DRAM sees the reads, then the writes; a block waits on other blocks only after its
// own reads are done.
// Why (benchmarks/notes_norms.md, "resident"): the ring's steps each expose an exchange (a
// publish and a poll with one tile or none in flight), 4-8 of them per block at [16, 1M], and
// ring_async's deeper copies did not remove that (run 34). Here the copies of all D tiles are in
// flight at once (224 KB per SM) and the exchange's latency is paid once.
// Limits: K <= D + 1 (host: norms.py _ring_grid), i.e. the rows fit in the grid's shared memory and
// one register tile per thread; every block resident at once (as the ring; no block waits before
// it has published all its tiles, so there is no per-row forward-progress rule). A thread reads
// back only the units it copied itself (no barrier). Below sm_80 the copies are synchronous loads
// and stores through registers (correct, not a speed path).
// P as for ring2_rows (no kAdd), plus issue_async(slot, row, u0, units) and
// partial<kRegs>(src, u0, units, part) (a tile's partial from a slot, or with kRegs from the
// registers issue() loaded).

// Copies this thread's units of a tile (PACKS of them, 16 bytes each) into its part of `slot`;
// units past the row's end are zero-filled (nothing read). Complete at the copy_async_wait
// (common/mma.cuh) that covers the group copy_async_commit closes; pending < 7 there =
// norms.py RESIDENT_MAX_DEPTH.
template <class T, int VEC, int PACKS>
__device__ __forceinline__ void ring_copy_async(typename RawUnit<T, VEC>::type* slot,
                                                const T* row, int u0, int units) {
  static_assert(VEC * sizeof(T) == 16, "the resident plan copies 16-byte units");
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
    const int unit = u0 + p * static_cast<int>(blockDim.x);
    const bool in = unit < units;
    const T* src = row + (in ? static_cast<long long>(unit) * VEC : 0);
    copy16_to_shared(slot + p * blockDim.x, src, in);
  }
}

// A resident drain's store of tile j's packs p0 .. p0 + G - 1: from slot j, or tile D from
// registers; kWhole: w (b) from the whole-tile arrays (resident_rows' shared-chunk drains).
template <bool kWhole, class P>
__device__ __forceinline__ void resident_store_group(P& pol, unsigned char* ring, int j, int D,
                                                     const RingTile& dr, int p0, int tile_units,
                                                     int units, float mu, float s) {
  if (j < D) {
    pol.template store_group<false, true, kWhole>(
        ring_slot<typename P::Elem, P::kVec, P::kPacks>(ring, j), dr.row, dr.u0(tile_units), p0,
        units, mu, s);
  } else {
    pol.template store_group<true, true, kWhole>(pol.xt.u, dr.row, dr.u0(tile_units), p0, units,
                                                 mu, s);
  }
}

template <int kBatch, class P>
__device__ __forceinline__ void resident_rows(P& pol, long long rows, int units, int C, int D,
                                              unsigned* state, unsigned char* smem) {
  using Elem = typename P::Elem;
  constexpr int W = P::kWords;
  float* scratch = reinterpret_cast<float*>(smem);
  unsigned char* ring = smem + kRingHeaderBytes;
  unsigned long long* words = reinterpret_cast<unsigned long long*>(state + 4);
  const unsigned tag = load_relaxed(state) + 1u;
  const int tile_units = static_cast<int>(blockDim.x) * P::kPacks;
  const unsigned tiles = static_cast<unsigned>(rows) * C;    // < 2^31 (RingTile)
  const unsigned first = blockIdx.x, step = gridDim.x;
  const int K = first < tiles ? static_cast<int>((tiles - 1 - first) / step) + 1 : 0;
  const int held = min(K, D);                      // in slots; tile D (K = D + 1) in registers
  RESIDENT_MARK(0);   // (stamps: -DGPUOPS_RESIDENT_TRACE, experiments only)
  const RingTile stride(step, C);
  auto slot_of = [&](int s) { return ring_slot<Elem, P::kVec, P::kPacks>(ring, s); };
  // A whole tile (block-uniform) with a block of a power-of-two number of warps: every thread's
  // partial has the same count (partial() of a thread whose units are all in the row).
  const bool pow2_warps = ((blockDim.x >> 5) & ((blockDim.x >> 5) - 1)) == 0;
  auto publish = [&](const RingTile& t, float (&part)[P::K]) {
    const bool full = pow2_warps && units - t.chunk * tile_units >= tile_units;
    ring2_publish(pol, words, t, C, tag, part, scratch, full);
  };

  RingTile t(first, C);
  // sm_90, blocks of kResidentBulkMinTiles slot tiles or more: each slot's tile as one bulk copy
  // of its valid bytes (the TMA unit; thread 0 issues them all), completing on the slot's
  // mbarrier. Run 103 against 102 (graph replay): [16, 1M] bf16 (7 slot tiles) rms_norm 31.4 ->
  // 30.2 us, layer_norm 42.7 -> 37.5; [8, 393216] (2-3 tiles) 0-0.7 us slower than per-thread
  // cp.async (whose copies start at once, without the mbarriers' init and barrier).
  const bool bulk = GPUOPS_RESIDENT_BULK && held >= kResidentBulkMinTiles;   // (block-uniform)
#if GPUOPS_RESIDENT_BULK
  const unsigned bars = smem_u32(smem + kResidentBarOffset);
  if (bulk) {
    if (threadIdx.x == 0) {
      for (int k = 0; k < held; ++k) mbar_init(bars + 8 * k, 1);
      mbar_fence_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      RingTile b = t;
      for (int k = 0; k < held; ++k) {
        const int valid = min(tile_units, units - b.chunk * tile_units);   // (ragged last tile)
        const unsigned bytes = static_cast<unsigned>(valid * sizeof(typename P::Raw));
        mbar_arrive_expect_tx(bars + 8 * k, bytes);
        bulk_load_1d(smem_u32(slot_of(k)),
                     pol.row_ptr(b.row) + static_cast<long long>(b.chunk) * tile_units * P::kVec,
                     bytes, bars + 8 * k);
        b.advance(stride, C);
      }
    }
  }
#endif
  for (int k = 0; k < held; ++k) {                 // every copy in flight at once
    if (!bulk) {
      pol.issue_async(slot_of(k), t.row, t.u0(tile_units), units);
      copy_async_commit();
    }
    t.advance(stride, C);
  }
  if (K > D) pol.issue(t.row, t.u0(tile_units), units);   // tile D, into registers
  RESIDENT_MARK(1);
  RESIDENT_MARK_LAST(24);
  t = RingTile(first, C);
  for (int k = 0; k < held; ++k) {                 // land and publish, in order
#if GPUOPS_RESIDENT_BULK
    if (bulk) mbar_wait(bars + 8 * k, 0);
#endif
    if (!bulk) copy_async_wait(held - 1 - k);
    RESIDENT_MARK(2 + k);
    float part[P::K];
    pol.template partial<false>(slot_of(k), t.u0(tile_units), units, part);
    if (k == 0) {
      RESIDENT_MARK(26);
      RESIDENT_MARK_LAST(25);
    }
    publish(t, part);
    RESIDENT_MARK(10 + k);
    t.advance(stride, C);
  }
  // Tile D after the loop, not in it: every build that landed it inside the loop (runs 107,
  // 110) waited there for its loads, which arrive last, before landing tile 0 (~15 us instead
  // of ~3.7 at [16, 1M] bf16; ~3 us of graph time).
  if (K > D) {
    RESIDENT_MARK(2 + D);
    float part[P::K];
    pol.template partial<true>(pol.xt.u, t.u0(tile_units), units, part);
    RESIDENT_MARK(27);
    publish(t, part);
    RESIDENT_MARK(10 + D);
  }
  // The statistics of the held tiles' rows, one warp per tile, all the polls of a round in
  // flight at once and before any store (run 100: drains that each polled waited an L2 round
  // trip behind the previous drain's stores, 8 in series: a third of the stall samples). Two
  // rounds, the first half of the tiles, then the rest: the rows of a block's early tiles are
  // published early by every block, so their stores start while the grid's slowest blocks still
  // land their last tiles (run 101: one round for all tiles waited ~13% of the kernel at its
  // barrier, i.e. on the skew between blocks' read phases).
  float* tile_stats = reinterpret_cast<float*>(smem + kResidentStatsOffset);   // (mu, s)
  const int half = (K + 1) / 2;
  RingTile dr(first, C);                           // the drains' cursor: tile j
  for (int round = 0; round < 2; ++round) {
    const int j0 = round == 0 ? 0 : half, j1 = round == 0 ? half : K;   // (block-uniform)
    for (int j = j0 + static_cast<int>(threadIdx.x >> 5); j < j1;
         j += static_cast<int>(blockDim.x >> 5)) {
      const RingTile mine(first + static_cast<unsigned>(j) * step, C);
      float mu, s;
      const unsigned long long* row_words = words + static_cast<long long>(mine.row) * C * W;
      pol.stats(ring2_row_acc<kBatch>(pol, row_words, C, tag, tile_units, units), mu, s);
      if ((threadIdx.x & 31) == 0) {
        tile_stats[2 * j] = mu;
        tile_stats[2 * j + 1] = s;
        if (mine.chunk == 0) pol.write_stats(mine.row, mu, s);
      }
    }
    __syncthreads();
    RESIDENT_MARK(18 + 2 * round);
    // Drain, in order, group by group (G packs of w and b at a time: P::kGroup, fewer than
    // kPacks where registers are short, as layer_norm's 2 of 4), each group's loads issued one
    // group ahead of its stores: the tile's next group, or the next tile's first. (Run 111:
    // -0.7 us for layer_norm [16, 1M] bf16 against loading a tile's later groups where they are
    // used, as the ring's store_tile does; run 112: all 4 packs a tile ahead was slower.)
    // The tiles by a cursor (advance), not a division per tile: run 103's drains spent ~7% of
    // the kernel's samples in the two divisions of each step (ncu_sass_summary --phases).
    // Where every tile of the block has the same chunk (gridDim.x a multiple of C, as at
    // [16, 1M] and bf16 [8, 393216]), the tiles share w (b): loaded once, for the whole tile
    // (run 115, graph replay: [16, 1M] bf16 rms_norm 28.9 -> 27.5 us, layer_norm 33.3 -> 30.6;
    // the drains had read 1-2x their stores' bytes of w, b from L2). sm_80+ only, the plan's
    // speed path: below, layer_norm's 16-bit kernels spilled with it.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    if (stride.chunk == 0) {                       // (block-uniform)
      if (j0 == 0 && K > 0) pol.load_whole(dr.u0(tile_units), units);
      for (int j = j0; j < j1; ++j) {
        const float mu = tile_stats[2 * j], s = tile_stats[2 * j + 1];
#pragma unroll
        for (int p0 = 0; p0 < P::kPacks; p0 += P::kGroup) {
          resident_store_group<true>(pol, ring, j, D, dr, p0, tile_units, units, mu, s);
        }
        dr.advance(stride, C);
      }
      RESIDENT_MARK(19 + 2 * round);
      continue;
    }
#endif
    if (j0 == 0 && K > 0) pol.template load_group<true, true>(dr.u0(tile_units), 0, units);
    for (int j = j0; j < j1; ++j) {
      RingTile next = dr;
      next.advance(stride, C);
      float mu, s;
#pragma unroll
      for (int p0 = 0; p0 < P::kPacks; p0 += P::kGroup) {
        pol.take_ahead();
        if (p0 + P::kGroup < P::kPacks) {
          pol.template load_group<true, true>(dr.u0(tile_units), p0 + P::kGroup, units);
        } else if (j + 1 < K) {
          pol.template load_group<true, true>(next.u0(tile_units), 0, units);
        }
        if (p0 == 0) {
          mu = tile_stats[2 * j];
          s = tile_stats[2 * j + 1];
        }
        // y evict-first: the drains' stores then take y's own earlier lines as L2 victims, so
        // DRAM writes y back during the drains, not during the next call's read phase (run 108,
        // graph replay: rms_norm [16, 1M] bf16 29.8 -> 28.9 us, the trace's read phase 1 us
        // shorter; layer_norm 37.8 -> 37.4; [8, 393216] fp32 0.1-0.2 us faster).
        resident_store_group<false>(pol, ring, j, D, dr, p0, tile_units, units, mu, s);
      }
      dr = next;
    }
    RESIDENT_MARK(19 + 2 * round);
  }
  ring2_epoch_end(state, tag);
  RESIDENT_MARK(22);
}

}  // namespace gpuops
