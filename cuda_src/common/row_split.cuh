// Rows split over several blocks of one grid (rows too long for one block's registers): each
// block reduces its chunk of a row to a partial (K floats), publishes it in global memory and
// arrives at the row's counter; the partials are then read back either by every block of the row
// after all have arrived (one launch: every block of the grid must be resident at once, which
// the host guarantees by sizing the grid from the occupancy calculator) or by the last block to
// arrive (two launches, any grid size).
//
// Counters are unsigned ints that the host zeroes before the launch (cudaMemsetAsync, which a CUDA
// graph captures like a kernel). Partials are written and read through L2 only (.cg): L1 is not
// coherent between SMs.
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
// `flag`: one unsigned of shared memory, rewritten by the next call, so a __syncthreads() must
// separate the return from the next call (every block reduction contains one). Contains one
// __syncthreads().
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
  return *flag;
}

// Returns once `target` blocks have arrived at `counter`; every thread may then read their
// partials with load_cg. Only thread 0 polls. Contains one __syncthreads().
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
