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
// read through L2 only (.cg): L1 is not coherent between SMs.
#pragma once

namespace gpuops {

__device__ __forceinline__ float load_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ void store_cg(float* p, float v) {
  asm volatile("st.global.cg.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}

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
    __threadfence();
    *flag = atomicAdd(counter, 1u);
    __threadfence();
  }
  __syncthreads();
  const unsigned before = *flag;
  __syncthreads();
  return before;
}

// The last block of a row: after thread 0 has stored the row's result (store_cg), release the
// row to the blocks waiting for it (split_wait(counter, C + 1)).
__device__ __forceinline__ void split_release(unsigned* counter) {
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
  }
}

// Returns once `counter` has reached `target`; every thread may then read what was published
// before with load_cg. Only thread 0 polls. Contains one __syncthreads().
__device__ __forceinline__ void split_wait(const unsigned* counter, unsigned target) {
  if (threadIdx.x == 0) {
    while (*reinterpret_cast<const volatile unsigned*>(counter) < target) {
#if __CUDA_ARCH__ >= 700
      asm volatile("nanosleep.u32 %0;" ::"r"(64u));
#endif
    }
    __threadfence();
  }
  __syncthreads();
}

}  // namespace gpuops
