// Mean and M2 (sum of squared deviations from the mean) of pieces of data, combined with Chan's
// parallel formula: numerically stable (no E[x^2] - E[x]^2 cancellation), so partial statistics
// of chunks, threads, warps, blocks and clusters can be merged in any tree.
//   n = na + nb,  delta = mean_b - mean_a,  mean = mean_a + delta nb / n,
//   M2 = M2_a + M2_b + delta^2 na nb / n.
// Counts are floats (exact up to 2^24; beyond, a relative 6e-8 that does not matter here).
// The blocks of a Hopper thread-block cluster exchange such statistics through distributed shared
// memory (common/cluster.cuh).
#pragma once
#include "common/cluster.cuh"

namespace gpuops {

struct MeanM2 {
  float n, mean, m2;
};

// a <- a + b. Either side may be empty (n == 0): the max(n, 1) keeps 0/0 out.
__device__ __forceinline__ void chan_merge(MeanM2& a, float nb, float mean_b, float m2_b) {
  const float n = a.n + nb;
  const float f = nb / fmaxf(n, 1.0f);
  const float delta = mean_b - a.mean;
  a.mean = fmaf(delta, f, a.mean);
  a.m2 = fmaf(delta * delta * a.n, f, a.m2 + m2_b);
  a.n = n;
}

// Every lane of the (full) warp returns lane 0's merge of all 32 lanes' statistics (the butterfly
// merges in a different order on each lane; broadcasting lane 0's makes the result identical).
__device__ __forceinline__ MeanM2 warp_merge(MeanM2 s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float n = __shfl_xor_sync(0xffffffffu, s.n, offset);
    const float mean = __shfl_xor_sync(0xffffffffu, s.mean, offset);
    const float m2 = __shfl_xor_sync(0xffffffffu, s.m2, offset);
    chan_merge(s, n, mean, m2);
  }
  s.n = __shfl_sync(0xffffffffu, s.n, 0);
  s.mean = __shfl_sync(0xffffffffu, s.mean, 0);
  s.m2 = __shfl_sync(0xffffffffu, s.m2, 0);
  return s;
}

// Thread 0 returns the merge over the whole block (blockDim.x a multiple of 32; `scratch` holds
// 32 float4 in shared memory). Contains __syncthreads().
__device__ __forceinline__ MeanM2 block_merge_to_thread0(MeanM2 s, float4* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  s = warp_merge(s);
  __syncthreads();
  if (lane == 0) scratch[warp] = make_float4(s.n, s.mean, s.m2, 0.0f);
  __syncthreads();
  if (warp == 0) {
    MeanM2 t = {0.0f, 0.0f, 0.0f};
    if (lane < warps) {
      const float4 v = scratch[lane];
      t = {v.x, v.y, v.z};
    }
    s = warp_merge(t);
  }
  return s;
}

}  // namespace gpuops
