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

// The shared::cluster address (for st.shared::cluster and remote mbarrier arrivals) of the
// shared-memory word at shared::cta address `saddr` in block `rank` of this cluster.
__device__ __forceinline__ unsigned int cluster_smem_u32(unsigned int saddr, unsigned int rank) {
  unsigned int out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(saddr), "r"(rank));
  return out;
}

// A store into another block's shared memory (an address from cluster_smem_u32). Ordered before
// a later mbar_arrive_cluster of the same thread (its release), not before anything else.
__device__ __forceinline__ void st_cluster_f32(unsigned int caddr, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(caddr), "f"(v) : "memory");
}

// One arrival on an mbarrier in any block of the cluster (cluster_smem_u32 address), releasing
// this thread's earlier shared-memory writes at cluster scope to whoever waits on that barrier
// with mbar_wait_cluster.
__device__ __forceinline__ void mbar_arrive_cluster(unsigned int caddr) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];"
               :: "r"(caddr) : "memory");
}

// Waits for the phase of parity `parity` of this block's mbarrier at shared::cta address `bar`,
// acquiring at cluster scope (the writes that other blocks released with their arrivals).
__device__ __forceinline__ void mbar_wait_cluster(unsigned int bar, unsigned int parity) {
  unsigned int done = 0;
  while (!done)
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
#else
#define GPUOPS_CLUSTER_DIMS(S)
#endif

}  // namespace gpuops
