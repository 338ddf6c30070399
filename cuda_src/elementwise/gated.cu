// Gated activations of transformer MLPs (SwiGLU, GeGLU) and silu(a + b * c): one read of each
// input and one write, where torch eager makes an intermediate tensor for every step.
#include "elementwise/pointwise.cuh"

namespace gpuops {

// act(gate) * up.
template <Act A>
struct GatedMul : PointwiseOp {
  static __device__ __forceinline__ float apply(const PointwiseParams&, float gate, float up,
                                                float) {
    return activate<A>(gate) * up;
  }
};

// silu(a + b * c), with one rounding for b * c + a.
struct SiluAddMul : PointwiseOp {
  static __device__ __forceinline__ float apply(const PointwiseParams&, float a, float b,
                                                float c) {
    return silu_f(fmaf(b, c, a));
  }
};

}  // namespace gpuops
