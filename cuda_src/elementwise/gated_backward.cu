// Backward of the gated activations (SwiGLU, GeGLU): out = act(gate) * up, so
//   grad_gate = grad_out * up * act'(gate),   grad_up = grad_out * act(gate)
// in one pass: read grad_out, gate and up once, write grad_gate and grad_up once (torch eager
// runs three kernels and makes two intermediates; the saved act(gate) is recomputed here).
//   gated_backward_flat     same-shape contiguous operands, 16-byte packs, one pack per thread
//                           and a grid covering the array once (as pointwise_flat)
//   gated_backward_strided  any strides, broadcast inputs (stride 0); outputs contiguous
#include "elementwise/pointwise.cuh"
#include "common/activation_grads.cuh"
#include "common/pdl.cuh"

namespace gpuops {

// Blocks of 256 threads per SM the register budget must allow (see PointwiseOp::kMinBlocks): the
// largest value at which no arch from sm_61 to sm_90 spills (checked by tests/test_runtime.py):
// SiLU <= 32 registers (full occupancy on sm_90), GELU <= 40 (75%). Five streams per element
// leave more time per byte for the math than the forward's three.
template <Act A> struct GatedBackwardBudget {
  static constexpr int kMinBlocks = A == Act::kSilu ? 8 : 6;
};

template <Act A>
__device__ __forceinline__ void gated_grads(float go, float gate, float up, float& dgate,
                                            float& dup) {
  float act, grad;
  activate_and_grad<A>(gate, act, grad);
  dup = go * act;
  dgate = (go * up) * grad;      // torch: act_backward(grad_out * up, gate)
}

template <Act A, class T, int VEC>
__global__ void __launch_bounds__(kPointwiseThreads, GatedBackwardBudget<A>::kMinBlocks)
gated_backward_flat(T* __restrict__ grad_gate, T* __restrict__ grad_up,
                    const T* __restrict__ grad_out, const T* __restrict__ gate,
                    const T* __restrict__ up, long long n) {
  pdl_start();
  static_assert(VEC == Vec16<T>::size, "VEC must be 16 bytes of T");
  const long long thread = static_cast<long long>(blockIdx.x) * kPointwiseThreads + threadIdx.x;
  const long long n_packs = n / VEC;
  if (thread < n_packs) {
    const long long e = thread * VEC;
    const uint4 rg = load16(grad_out + e), ra = load16(gate + e), rb = load16(up + e);
    float g[VEC], a[VEC], b[VEC], da[VEC], db[VEC];
    Vec16<T>::unpack(rg, g);
    Vec16<T>::unpack(ra, a);
    Vec16<T>::unpack(rb, b);
#pragma unroll
    for (int j = 0; j < VEC; ++j) gated_grads<A>(g[j], a[j], b[j], da[j], db[j]);
    store16(grad_gate + e, Vec16<T>::pack(da));
    store16(grad_up + e, Vec16<T>::pack(db));
  }
  // The n % VEC elements past the last full pack, one per thread of block 0.
  if (thread < n - n_packs * VEC) {
    const long long e = n_packs * VEC + thread;
    float da, db;
    gated_grads<A>(to_float(grad_out[e]), to_float(gate[e]), to_float(up[e]), da, db);
    grad_gate[e] = from_float<T>(da);
    grad_up[e] = from_float<T>(db);
  }
}

// Operands 0, 1, 2 of the layout are grad_out, gate, up; the outputs are contiguous in the
// layout's (row-major) element order.
template <Act A, class T>
__global__ void __launch_bounds__(kPointwiseThreads)
gated_backward_strided(T* __restrict__ grad_gate, T* __restrict__ grad_up,
                       const T* __restrict__ grad_out, const T* __restrict__ gate,
                       const T* __restrict__ up, StridedLayout L, long long n) {
  pdl_start();
  const long long step = static_cast<long long>(gridDim.x) * kPointwiseThreads;
  for (long long i = static_cast<long long>(blockIdx.x) * kPointwiseThreads + threadIdx.x; i < n;
       i += step) {
    long long off[3];
    strided_offsets<3>(L, i, off);
    float da, db;
    gated_grads<A>(to_float(grad_out[off[0]]), to_float(gate[off[1]]), to_float(up[off[2]]), da,
                   db);
    grad_gate[i] = from_float<T>(da);
    grad_up[i] = from_float<T>(db);
  }
}

}  // namespace gpuops
