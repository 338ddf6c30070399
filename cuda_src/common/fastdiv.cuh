// Division by a runtime divisor that is the same for a whole launch (a tensor extent), as one
// multiply-high, one add and one shift instead of the ~20-instruction integer division: index
// arithmetic of copy and layout kernels, which decompose a flat index into coordinates for every
// 16-byte pack they move.
//
// For a divisor d in [1, 2^31) the host computes (gpuops/ops/copy.py, `fast_divider`)
//   shift = ceil(log2 d),  mul = floor(2^32 (2^shift - d) / d) + 1   (mod 2^32)
// and then n / d == (umulhi(n, mul) + n) >> shift for every n in [0, 2^31) (Granlund-Montgomery;
// the form PyTorch's IntDivider uses). n < 2^31 keeps the 32-bit sum from overflowing; callers
// guarantee it (the host takes a 64-bit path beyond).
#pragma once

namespace gpuops {

struct FastDiv {
  unsigned int d, mul, shift;

  __device__ __forceinline__ unsigned int div(unsigned int n) const {
    return (__umulhi(n, mul) + n) >> shift;
  }
  // quotient, and n - quotient * d in `rem`
  __device__ __forceinline__ unsigned int divmod(unsigned int n, unsigned int& rem) const {
    const unsigned int q = div(n);
    rem = n - q * d;
    return q;
  }
};

}  // namespace gpuops
