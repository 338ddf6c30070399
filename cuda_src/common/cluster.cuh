// Hopper thread-block clusters (sm_90): the cluster barrier and distributed shared memory, so that
// the blocks of one cluster can exchange partial results without a trip through global memory.
// tests/cuda_emu/common/cluster.cuh is the CPU emulator's stand-in (same API): kernels that use
// these helpers keep everything the other blocks read in dynamic shared memory, which the
// emulator gives each block of a cluster separately.
#pragma once

namespace gpuops {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Thread-block clusters (sm_90). A kernel declared with GPUOPS_CLUSTER_DIMS(S) is launched as
// clusters of S consecutive blocks along x (the size is compiled into the kernel, so a plain
// cuLaunchKernel launches it as clusters); on older archs the attribute is left out and the host
// never launches such a kernel.
#define GPUOPS_CLUSTER_DIMS(S) __cluster_dims__(S, 1, 1)

__device__ __forceinline__ unsigned int cluster_ctarank() {
  unsigned int r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ unsigned int cluster_nctarank() {
  unsigned int r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
}

// arrive has release and wait acquire semantics (the defaults): shared-memory writes before
// arrive are visible to the cluster's other blocks after their wait. All threads of every block
// must execute both (.aligned).
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// The address of the same shared variable in block `rank` of this cluster (generic address, so a
// normal load reads the other block's shared memory).
template <class T>
__device__ __forceinline__ const T* cluster_map(const T* p, unsigned int rank) {
  unsigned long long out;
  asm volatile("mapa.u64 %0, %1, %2;"
               : "=l"(out) : "l"(reinterpret_cast<unsigned long long>(p)), "r"(rank));
  return reinterpret_cast<const T*>(out);
}
#else
#define GPUOPS_CLUSTER_DIMS(S)
#endif

}  // namespace gpuops
