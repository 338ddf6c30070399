// Host stand-in for cuda_src/common/cluster.cuh (same API): the blocks of a cluster run at the
// same time in the emulator (tests/cuda_emu/emu.h, emu::cluster_size), each with its own dynamic
// shared memory; the cluster barrier is a split arrive/wait barrier over all their threads, and
// cluster_map translates an address in this block's dynamic shared memory to the same offset in
// another block's.
#pragma once

#define GPUOPS_CLUSTER_DIMS(S)

namespace gpuops {

inline unsigned int cluster_ctarank() { return emu::cluster_rank(); }
inline unsigned int cluster_nctarank() { return static_cast<unsigned int>(emu::cluster_size); }
inline void cluster_arrive() { emu::cluster_arrive(); }
inline void cluster_wait() { emu::cluster_wait(); }
inline void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}
template <class T>
inline const T* cluster_map(const T* p, unsigned int rank) {
  return static_cast<const T*>(emu::cluster_map(p, rank));
}

}  // namespace gpuops
