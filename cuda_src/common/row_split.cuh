// Rows split over several blocks of one grid (rows too long for one block's registers): each
// block reduces its chunk of a row to a partial (K floats), publishes it in global memory and
// arrives at the row's counter; the last block to arrive (the one that sees C - 1 arrivals
// before its own) reads the row's C partials, combines them in a fixed order, writes the row's
// result and releases the row (counter = C + 1). In one launch, the other blocks of the row wait
// for the release and read the result: every block of the grid must then be resident at once,
// which the host guarantees by sizing the grid from the occupancy calculator. In two launches,
// nobody waits: the second launch reads the results.
//
// Counters are unsigned ints that the host zeroes before the launch (cudaMemsetAsync, which a CUDA
// graph captures like a kernel). Partials and results written during the launch are written and
// read through L2 only (.cg, common/coherent.cuh): L1 is not coherent between SMs.
#pragma once
#include "common/coherent.cuh"

namespace gpuops {

// Thread 0 stores the block's partial `v` at `slot`, makes it visible device-wide, and arrives
// at `counter`. Every thread returns how many blocks of the row had arrived before this one.
// `flag`: one unsigned of shared memory. Contains two __syncthreads() (the second lets the next
// call rewrite `flag`).
template <int K>
__device__ __forceinline__ unsigned split_arrive(float* slot, const float (&v)[K],
                                                 unsigned* counter, unsigned* flag) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) store_cg(slot + k, v[k]);
    *flag = counter_add_acq_rel(counter, 1u);   // the last arrival sees every partial
  }
  __syncthreads();
  const unsigned before = *flag;
  __syncthreads();
  return before;
}

// The last block of a row: after thread 0 has stored the row's result (store_cg), release the
// row to the blocks waiting for it (split_wait(counter, C + 1)).
__device__ __forceinline__ void split_release(unsigned* counter) {
  if (threadIdx.x == 0) counter_add_release(counter, 1u);
}

// Returns once `counter` has reached `target`; every thread may then read what was published
// before with load_cg. Only thread 0 polls. Contains one __syncthreads().
__device__ __forceinline__ void split_wait(const unsigned* counter, unsigned target) {
  if (threadIdx.x == 0) wait_counter(counter, target);
  __syncthreads();
}

}  // namespace gpuops
