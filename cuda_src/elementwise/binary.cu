// Binary arithmetic with broadcasting, and act(x + bias).
#include "elementwise/pointwise.cuh"

namespace gpuops {

// a + alpha * b with p.a = alpha (torch.add's alpha), one rounding.
struct AddScaled : PointwiseOp {
  static constexpr int kMinBlocks = 6;
  static __device__ __forceinline__ float apply(const PointwiseParams& p, float a, float b,
                                                float) {
    return fmaf(p.a, b, a);
  }
};

struct Mul : PointwiseOp {
  static constexpr int kMinBlocks = 6;
  static __device__ __forceinline__ float apply(const PointwiseParams&, float a, float b, float) {
    return a * b;
  }
};

template <Act A>
struct BiasAct : PointwiseOp {
  static constexpr int kMinBlocks = 6;
  static __device__ __forceinline__ float apply(const PointwiseParams&, float x, float bias,
                                                float) {
    return activate<A>(x + bias);
  }
};

}  // namespace gpuops
