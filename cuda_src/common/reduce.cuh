// Warp and block reductions, written once for every op family (softmax, norms, reductions,
// cross-entropy, ...). Warp level: shuffle-xor butterflies, so every lane ends with the result.
// Block level: one value per warp through shared memory, then a warp reduction of those.
//
// The combine functors propagate NaN the way torch's reductions do (amax/amin of a row with a NaN
// is NaN), which fmaxf/fminf do not.
#pragma once

namespace gpuops {

constexpr unsigned kFullMask = 0xffffffffu;

struct SumOp {
  template <class T> __device__ __forceinline__ static T combine(T a, T b) { return a + b; }
  template <class T> __device__ __forceinline__ static T identity() { return T(0); }
};

struct MaxOp {  // NaN wins, as torch.amax
  __device__ __forceinline__ static float combine(float a, float b) {
    return (a > b || a != a) ? a : b;
  }
  template <class T> __device__ __forceinline__ static T identity() { return -__int_as_float(0x7f800000); }
};

struct MinOp {  // NaN wins, as torch.amin
  __device__ __forceinline__ static float combine(float a, float b) {
    return (a < b || a != a) ? a : b;
  }
  template <class T> __device__ __forceinline__ static T identity() { return __int_as_float(0x7f800000); }
};

// Every lane of the warp returns the combination of all 32 lanes' values.
template <class Op, class T>
__device__ __forceinline__ T warp_reduce(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = Op::combine(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

template <class T> __device__ __forceinline__ T warp_sum(T v) { return warp_reduce<SumOp>(v); }
__device__ __forceinline__ float warp_max(float v) { return warp_reduce<MaxOp>(v); }
__device__ __forceinline__ float warp_min(float v) { return warp_reduce<MinOp>(v); }

// Every thread of the block returns the combination of all threads' values. `scratch` must hold
// 32 values of T in shared memory; blockDim.x must be a multiple of 32. Contains two
// __syncthreads(); a block may call it repeatedly with the same scratch.
template <class Op, class T>
__device__ __forceinline__ T block_reduce(T v, T* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = warp_reduce<Op>(v);
  __syncthreads();                       // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : Op::template identity<T>();
  return warp_reduce<Op>(v);
}

// bar.sync id, count: a barrier of `count` threads (whole warps) of the block, id 1..15 (0 is
// __syncthreads): some warps of a block synchronize while the others run on. Host emulation:
// tests/cuda_emu/emu.h (the older tests/cuda_host_emulation.py has none: a kernel that reaches
// one there stops).
__device__ __forceinline__ void named_barrier(unsigned id, unsigned count) {
#if defined(__CUDACC_RTC__)
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
#elif defined(GPUOPS_EMU_H)
  emu::named_bar_sync(id, count);
#else
  (void)id;
  (void)count;
  __builtin_trap();
#endif
}

template <class T> __device__ __forceinline__ T block_sum(T v, T* scratch) {
  return block_reduce<SumOp>(v, scratch);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  return block_reduce<MaxOp>(v, scratch);
}

}  // namespace gpuops
