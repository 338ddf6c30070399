// Prefix scans, written once for every family that needs them (cumsum, top-k compaction, ...).
//
// Warp level: Hillis-Steele with shuffles, lane 0 first (a reversed scan is a scan of the data in
// reversed order: callers map positions, the primitives stay one-directional). Block level: one
// inclusive value per warp through shared memory; every warp then scans those few values itself,
// so a block scan costs two __syncthreads() and no third round trip.
//
// Decoupled look-back (single-pass scans over many blocks, after Merrill & Garland 2016): each
// tile publishes its aggregate, then its inclusive prefix, in one 64-bit word {value, status}, so a
// reader always sees a value and its status together (an aligned 64-bit access is single-copy
// atomic on every arch from sm_61 on; no fence is needed between two words). Readers spin with
// volatile loads, which bypass L1 on every arch. Tiles must be handed out in launch order by an
// atomic counter (not blockIdx: the hardware does not promise to start blocks in order), so a
// tile only ever waits on tiles whose blocks are already running: no deadlock on any arch.
#pragma once
#include "common/reduce.cuh"

namespace gpuops {

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

// Inclusive scan across the warp, lane 0 first. Op::combine(earlier, later).
template <class Op, class T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = lane_id();
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const T u = __shfl_up_sync(kFullMask, v, offset);
    if (lane >= offset) v = Op::combine(u, v);
  }
  return v;
}

// Exclusive scan across the warp: lane 0 gets `identity`; `total` (every lane) the whole warp's.
template <class Op, class T>
__device__ __forceinline__ T warp_exclusive_scan(T v, T identity, T& total) {
  const T incl = warp_inclusive_scan<Op>(v);
  total = __shfl_sync(kFullMask, incl, 31);
  const T prev = __shfl_up_sync(kFullMask, incl, 1);
  return lane_id() == 0 ? identity : prev;
}

// Exclusive scan across the block in thread order; `total` (every thread) is the block's.
// blockDim.x must be a multiple of 32 (1-D blocks); `scratch` holds 32 values of T in shared
// memory. Two __syncthreads(); a block may call it repeatedly with the same scratch.
template <class Op, class T>
__device__ __forceinline__ T block_exclusive_scan(T v, T* scratch, T identity, T& total) {
  const int lane = lane_id();
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const T incl = warp_inclusive_scan<Op>(v);
  __syncthreads();                      // scratch may still be read from a previous call
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  const T w = warp_inclusive_scan<Op>(lane < warps ? scratch[lane] : identity);
  total = __shfl_sync(kFullMask, w, warps - 1);
  const T warp_offset = __shfl_sync(kFullMask, w, (warp + 31) & 31);   // lane warp - 1
  T excl = __shfl_up_sync(kFullMask, incl, 1);
  if (lane == 0) excl = identity;
  return warp == 0 ? excl : Op::combine(warp_offset, excl);
}

// ---------------------------------------------------------------------------------------------
// Decoupled look-back for float sums.

namespace lookback {

constexpr unsigned kInvalid = 0;     // nothing published yet (the status array starts zeroed)
constexpr unsigned kAggregate = 1;   // the tile's own sum
constexpr unsigned kPrefix = 2;      // the sum of the tile and every tile before it

__device__ __forceinline__ void publish(unsigned long long* slot, unsigned status, float value) {
  const unsigned long long word =
      (static_cast<unsigned long long>(__float_as_uint(value)) << 32) | status;
  *reinterpret_cast<volatile unsigned long long*>(slot) = word;
}

// Called by all 32 lanes of one warp, for a tile with `tile` > 0 predecessors in its segment
// whose status words are first[0 .. tile). Returns (on every lane) the sum of the predecessors,
// looking back 32 tiles at a time until one has published its inclusive prefix. The sum is a
// tree within each window of 32 and sequential across windows (nearest window first).
__device__ __forceinline__ float exclusive_prefix(const unsigned long long* first, long long tile) {
  const int lane = lane_id();
  float prefix = 0.0f;
  long long window = tile - 1;         // lane 0 reads the nearest predecessor
  while (true) {
    const long long p = window - lane;
    unsigned long long word;
    do {   // the whole warp re-reads until every lane's predecessor has published something
      word = p >= 0 ? *reinterpret_cast<const volatile unsigned long long*>(first + p)
                    : static_cast<unsigned long long>(kPrefix);   // before the start: prefix 0
    } while (__any_sync(kFullMask, (word & 3u) == kInvalid));
    const unsigned status = static_cast<unsigned>(word & 3u);
    const float value = __uint_as_float(static_cast<unsigned>(word >> 32));
    const unsigned done = __ballot_sync(kFullMask, status == kPrefix);
    const int stop = done ? __ffs(done) - 1 : 32;     // nearest lane holding an inclusive prefix
    prefix += warp_sum(lane <= stop ? value : 0.0f);
    if (done) return prefix;
    window -= 32;
  }
}

}  // namespace lookback
}  // namespace gpuops
