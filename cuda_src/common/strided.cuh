// Offsets of an element in up to kMaxDims-dimensional strided operands.
// The host coalesces dimensions first (gpuops/shapes.py), so kMaxDims covers nearly every
// real layout; the host refuses the rest with a clear error.
#pragma once

namespace gpuops {

constexpr int kMaxDims = 8;
constexpr int kMaxOperands = 4;

// Passed by value as a kernel parameter (328 bytes), so a launch needs no device buffer and
// stays capturable in a CUDA graph. Strides are in elements and may be 0 (broadcast) or negative.
struct StridedLayout {
  int ndim;
  long long shape[kMaxDims];
  long long stride[kMaxOperands][kMaxDims];
};

// Element offsets of linear (row-major) index `i` for the first `NOPS` operands.
template <int NOPS>
__device__ __forceinline__ void strided_offsets(const StridedLayout& L, long long i,
                                                long long (&off)[NOPS]) {
#pragma unroll
  for (int k = 0; k < NOPS; ++k) off[k] = 0;
#pragma unroll
  for (int d = kMaxDims - 1; d >= 0; --d) {
    if (d < L.ndim) {
      const long long n = L.shape[d];
      const long long c = i % n;
      i /= n;
#pragma unroll
      for (int k = 0; k < NOPS; ++k) off[k] += c * L.stride[k][d];
    }
  }
}

}  // namespace gpuops
