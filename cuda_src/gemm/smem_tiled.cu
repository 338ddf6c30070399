// GEMM ladder, step 2 (`variant='smem_tiled'`): 32x32 output tiles, one per block of 32x32 threads,
// one output per thread. What it adds over `naive`: A and B tiles of 32x32 staged in shared memory,
// so each global element is read once per tile instead of once per output (global traffic / 32).
// The math loop still does one shared-memory load per FMA, which caps it far below the FMA peak.
#include "gemm/gemm_common.cuh"

namespace gpuops {
namespace gemm {

constexpr int kTile = 32;

template <class T>
__global__ void __launch_bounds__(1024) gemm_smem_tiled(GemmArgs p) {
  __shared__ float As[kTile][kTile + 1];   // [m][k]; +1: the column reads of the loads below
  __shared__ float Bs[kTile][kTile + 1];   // [k][n]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const long long m0 = blockIdx.y * (long long)kTile, n0 = blockIdx.x * (long long)kTile;
  {
    const BatchOffsets o = batch_offsets(p, p.z0 + blockIdx.z);
    const T* a = static_cast<const T*>(p.a) + o.a;
    const T* b = static_cast<const T*>(p.b) + o.b;
    // Which thread loads which element: along the operand's contiguous dim for coalescing.
    const bool a_k = p.flags & kAKContig, b_k = p.flags & kBKContig;
    float acc = 0.0f;
    for (long long k0 = 0; k0 < p.K; k0 += kTile) {
      {
        const int mi = a_k ? ty : tx, ki = a_k ? tx : ty;
        const long long m = m0 + mi, k = k0 + ki;
        As[mi][ki] = (m < p.M && k < p.K) ? to_float(a[m * p.a_sm + k * p.a_sk]) : 0.0f;
      }
      {
        const int ki = b_k ? tx : ty, ni = b_k ? ty : tx;
        const long long k = k0 + ki, n = n0 + ni;
        Bs[ki][ni] = (k < p.K && n < p.N) ? to_float(b[k * p.b_sk + n * p.b_sn]) : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int k = 0; k < kTile; ++k) acc = fmaf(As[ty][k], Bs[k][tx], acc);
      __syncthreads();
    }
    const float v[1] = {acc};
    epilogue_run<T, 1>(p, o, m0 + ty, n0 + tx, v);
  }
}

}  // namespace gemm
}  // namespace gpuops
