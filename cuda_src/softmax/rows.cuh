// Shared machinery of the row kernels (softmax, log_softmax, their backward ops, cross-entropy).
//
// A "pack" is what one thread moves per memory instruction: 16 bytes (4 fp32 / 8 fp16 or bf16)
// on the vector path, one element on the scalar path (rows that are not 16-byte aligned). Packs
// travel as raw words and are converted to fp32 only when used, so a thread can keep several
// packs of a row in registers without 16-bit registers (see common/vec.cuh).
//
// A "group" is the set of threads that own one row: blockDim.x threads (a power of two), with
// blockDim.y rows per block when blockDim.x <= 32 (sub-warp or warp groups, reduced by shuffles)
// and one row per block otherwise (reduced through shared memory).
#pragma once
#include "common/dtypes.cuh"
#include "common/online_softmax.cuh"
#include "common/reduce.cuh"
#include "common/vec.cuh"

namespace gpuops {

template <class T, bool V> struct Pack;

template <class T> struct Pack<T, true> {
  static constexpr int N = Vec16<T>::size;
  using Raw = uint4;
  uint4 raw;
  __device__ __forceinline__ void load(const T* p) { raw = load16(p); }
  __device__ __forceinline__ void unpack(float (&f)[N]) const { Vec16<T>::unpack(raw, f); }
  static __device__ __forceinline__ void store(T* p, const float (&f)[N]) {
    store16(p, Vec16<T>::pack(f));
  }
};

template <class T> struct Pack<T, false> {
  static constexpr int N = 1;
  using Raw = float;
  float raw;   // converted at load: a 16-bit value would sit in a 16-bit register
  __device__ __forceinline__ void load(const T* p) { raw = to_float(*p); }
  __device__ __forceinline__ void unpack(float (&f)[1]) const { f[0] = raw; }
  static __device__ __forceinline__ void store(T* p, const float (&f)[1]) { *p = from_float<T>(f[0]); }
};

// (m, s) <- (m, s) merged with the values of U packs, pk[u] where live[u] (a pack past the end
// of the data counts as -inf: exp(-inf) adds nothing); with kSum also sum += each live value, in
// order (cross-entropy's label smoothing needs sum(x)). The streaming loops of softmax_split_stats,
// ce_stats and ce_fused load U packs and then fold them in through this.
template <bool kSum, int U, class PK>
__device__ __forceinline__ void online_add_packs(float& m, float& s, float& sum, const PK (&pk)[U],
                                                 const bool (&live)[U]) {
  constexpr int N = PK::N;
  float f[U * N];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float g[N];
    if (live[u]) {
      pk[u].unpack(g);
      if constexpr (kSum) {
#pragma unroll
        for (int k = 0; k < N; ++k) sum += g[k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) g[k] = neg_inf();
    }
#pragma unroll
    for (int k = 0; k < N; ++k) f[u * N + k] = g[k];
  }
  online_add(m, s, f);
}

// Combination over the calling thread's group (see above); every thread of the group gets it.
// All threads of the block must call it (it may contain __syncthreads).
template <class Op>
__device__ __forceinline__ float group_reduce(float v, float* scratch) {
  const unsigned tx = blockDim.x;
  if (tx > 32) return block_reduce<Op>(v, scratch);
  if (tx == 32) return warp_reduce<Op>(v);
  for (unsigned off = tx >> 1; off > 0; off >>= 1)   // groups are aligned runs of tx lanes
    v = Op::combine(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}

}  // namespace gpuops
