// Unary activations and the scale/shift/clamp op (which also serves add/mul by a scalar).
// Instantiated per dtype by gpuops/ops/elementwise.py through pointwise.cuh.
#include "elementwise/pointwise.cuh"

namespace gpuops {

template <Act A>
struct Activation : PointwiseOp {
  static constexpr int kMinBlocks = 8;
  static __device__ __forceinline__ float apply(const PointwiseParams&, float a, float, float) {
    return activate<A>(a);
  }
};

// clamp(a * scale + shift, lo, hi) with p = {scale, shift, lo, hi}. A NaN stays NaN, as in
// torch.clamp; shift is -0.0 for a plain scale so that -0 * s keeps its sign.
struct ScaleShiftClamp : PointwiseOp {
  static constexpr int kMinBlocks = 8;
  static __device__ __forceinline__ float apply(const PointwiseParams& p, float a, float, float) {
    float v = fmaf(a, p.a, p.b);
    v = v < p.c ? p.c : v;
    return v > p.d ? p.d : v;
  }
};

}  // namespace gpuops
