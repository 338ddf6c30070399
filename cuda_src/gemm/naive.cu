// GEMM ladder, step 1 (`variant='naive'`): one thread per output element, a plain loop over K
// reading A and B straight from global memory. What it adds: nothing but correctness — the
// baseline every later variant is measured against. Any strides (transposed, broadcast, sliced),
// any dtype, the full fused epilogue. Each A element is read N times and each B element M times
// (through L1/L2), so it runs at a few % of the FMA peak.
#include "gemm/gemm_common.cuh"

namespace gpuops {
namespace gemm {

// block (32, 8): threadIdx.x walks n (coalesced C stores and row-major B loads)
template <class T>
__global__ void __launch_bounds__(256) gemm_naive(GemmArgs p) {
  const long long m = blockIdx.y * 8ll + threadIdx.y;
  const long long n = blockIdx.x * 32ll + threadIdx.x;
  if (m >= p.M || n >= p.N) return;
  const BatchOffsets o = batch_offsets(p, p.z0 + blockIdx.z);
  const T* a = static_cast<const T*>(p.a) + o.a + m * p.a_sm;
  const T* b = static_cast<const T*>(p.b) + o.b + n * p.b_sn;
  float acc = 0.0f;
  for (long long k = 0; k < p.K; ++k) acc = fmaf(to_float(a[k * p.a_sk]), to_float(b[k * p.b_sk]), acc);
  const float v[1] = {acc};
  epilogue_run<T, 1>(p, o, m, n, v);
}

}  // namespace gemm
}  // namespace gpuops
