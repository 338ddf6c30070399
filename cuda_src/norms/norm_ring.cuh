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

namespace gpuops {

// Shared memory before the ring: the block reductions' scratch (96 floats) and the arrival flag.
constexpr int kRingHeaderBytes = 512;

// Where this thread's units of ring slot `s` live: unit p at slot_base[p * blockDim.x].
template <class T, int VEC, int PACKS>
__device__ __forceinline__ typename RawUnit<T, VEC>::type* ring_slot(unsigned char* ring, int s) {
  using Raw = typename RawUnit<T, VEC>::type;
  const size_t slot_units = static_cast<size_t>(blockDim.x) * PACKS;
  return reinterpret_cast<Raw*>(ring) + static_cast<size_t>(s) * slot_units + threadIdx.x;
}

// The loop of the file comment over a policy P (LayerNormRing in layer_norm.cu, RmsNormRing in
// rms_norm.cu), which provides Elem, kVec, kPacks (the tile's T, VEC, PACKS) and
//   K                        floats of a tile's partial statistics
//   issue(row, u0, units)    start the loads of a tile into registers
//   land(slot, row, u0, units, part)   store them into the ring slot; this thread's partial
//   reduce(part, scratch)    the block's partial (every thread gets it)
//   merge(row_partials, C, row, scratch)   the row's last block: statistics from the C partials
//   drain(slot, row, u0, units)   normalize the held tile (after the row's release) and store
// `partials`: rows * C * K floats; `counters`: rows unsigned ints, zeroed before the launch.
template <class P>
__device__ __forceinline__ void ring_rows(P& pol, long long rows, int units, int C, int D,
                                          float* partials, unsigned* counters,
                                          unsigned char* smem) {
  float* scratch = reinterpret_cast<float*>(smem);
  unsigned* flag = reinterpret_cast<unsigned*>(smem + 96 * sizeof(float));
  unsigned char* ring = smem + kRingHeaderBytes;
  const int tile_units = static_cast<int>(blockDim.x) * P::kPacks;
  const long long tiles = rows * C;
  const long long first = blockIdx.x, step = gridDim.x;
  if (first >= tiles) return;                      // (the host launches at most `tiles` blocks)
  const int K = static_cast<int>((tiles - 1 - first) / step) + 1;

  long long row = first / C;
  int chunk = static_cast<int>(first - row * C);
  pol.issue(row, chunk * tile_units + static_cast<int>(threadIdx.x), units);
  for (int k = 0; k < K; ++k) {
    const int u0 = chunk * tile_units + static_cast<int>(threadIdx.x);
    float part[P::K];
    pol.land(ring_slot<typename P::Elem, P::kVec, P::kPacks>(ring, k % D), row, u0, units, part);
    const long long next = first + (k + 1) * step;
    const long long next_row = next / C;
    const int next_chunk = static_cast<int>(next - next_row * C);
    if (k + 1 < K) pol.issue(next_row, next_chunk * tile_units + static_cast<int>(threadIdx.x),
                             units);
    pol.reduce(part, scratch);
    float* row_partials = partials + row * C * P::K;
    if (split_arrive<P::K>(row_partials + chunk * P::K, part, counters + row, flag) ==
        static_cast<unsigned>(C - 1)) {
      pol.merge(row_partials, C, row, scratch);
      split_release(counters + row);
    }
    const int j = k + 1 - D;                       // drain: frees slot (k + 1) % D
    if (j >= 0) {
      const long long t = first + j * step;
      const long long jrow = t / C;
      const int ju0 = static_cast<int>(t - jrow * C) * tile_units + static_cast<int>(threadIdx.x);
      split_wait(counters + jrow, static_cast<unsigned>(C + 1));
      pol.drain(ring_slot<typename P::Elem, P::kVec, P::kPacks>(ring, j % D), jrow, ju0, units);
    }
    row = next_row;
    chunk = next_chunk;
  }
  for (int j = max(0, K + 1 - D); j < K; ++j) {
    const long long t = first + j * step;
    const long long jrow = t / C;
    const int ju0 = static_cast<int>(t - jrow * C) * tile_units + static_cast<int>(threadIdx.x);
    split_wait(counters + jrow, static_cast<unsigned>(C + 1));
    pol.drain(ring_slot<typename P::Elem, P::kVec, P::kPacks>(ring, j % D), jrow, ju0, units);
  }
}

}  // namespace gpuops
