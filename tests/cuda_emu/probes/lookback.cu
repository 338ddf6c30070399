// Probe of lookback::exclusive_prefix (common/scan.cuh) for tests/test_scan.py: the host presets
// every tile's status word (aggregates and inclusive prefixes in any mix, as concurrent tiles
// leave them) and warp t (> 0) writes the exclusive prefix it finds for tile t. Exercises the
// windows of 32 that real runs only reach under contention (the emulator runs blocks in order).
#include "common/scan.cuh"

__global__ void lookback_probe(const unsigned long long* states, float* out, int n) {
  const int t = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (t == 0 || t >= n) return;               // whole warps
  const float p = gpuops::lookback::exclusive_prefix(states, t);
  if ((threadIdx.x & 31) == 0) out[t] = p;
}
