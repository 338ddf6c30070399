// Generic pointwise kernels of the elementwise family: out = Op(in0, in1, in2), fp32 math on
// fp32/fp16/bf16 storage. Each op is a functor with
//     static __device__ float apply(const PointwiseParams& p, float a, float b, float c);
// and is instantiated from Python (gpuops/ops/elementwise.py) as
//     pointwise_flat<Op, T, NIN, VEC>   contiguous operands; VEC = 16-byte packs, or 1
//     pointwise_strided<Op, T, NIN>     any strides (broadcast, transposed, sliced views)
#pragma once
#include "common/dtypes.cuh"
#include "common/vec.cuh"
#include "common/strided.cuh"
#include "common/activations.cuh"
#include "common/pdl.cuh"

namespace gpuops {

constexpr int kPointwiseThreads = 256;
// One 16-byte pack per operand and thread, with a grid that covers the array once, was the
// fastest setting of the H100 sweep (benchmarks/results/2026-11-22-h100-run1/sweep.log: 98-101%
// of the copy bandwidth; 2, 4 and 8 packs per thread within 1-4%, a one-wave grid-stride grid
// 5-15% slower). The macro exists for such sweeps (benchmarks/experiments/pointwise_sweep.py).
#ifndef GPUOPS_POINTWISE_ILP
#define GPUOPS_POINTWISE_ILP 1
#endif

// Every op functor derives from this.
//   kIlp       16-byte packs per operand a thread loads before using any.
//   kMinBlocks blocks of 256 threads per SM the register budget must allow (8: <= 32 registers,
//              full occupancy; 6: <= 40; 4: <= 64). More resident warps overlap the loads of
//              some with the math of others, which matters once an op's math is not free (GELU
//              on 16-bit data). Each op takes the largest value at which no arch from sm_61 to
//              sm_90 spills (checked by tests/test_runtime.py).
struct PointwiseOp {
  static constexpr int kIlp = GPUOPS_POINTWISE_ILP;
  static constexpr int kMinBlocks = 4;
};

// Scalars of an op (alpha, scale, clamp bounds): one struct for every op, so that every
// pointwise kernel has the same signature.
struct PointwiseParams { float a, b, c, d; };

// An operand's `period`: 0 = it has the output's shape; 1 = one value broadcast everywhere;
// k > 1 = a contiguous block of k values repeated along the leading dimensions (a bias row).
// e % period, in 32 bits when e fits (a 64-bit remainder is a long software routine).
__device__ __forceinline__ long long row_offset(long long e, long long period) {
  if (e <= 0xffffffffll) return static_cast<unsigned int>(e) % static_cast<unsigned int>(period);
  return e % period;
}

template <class T>
__device__ __forceinline__ uint4 load_operand16(const T* ptr, long long period, long long e) {
  if (period == 0) return load16(ptr + e);
  if (period == 1) return Vec16<T>::splat(ptr[0]);
  return load16(ptr + row_offset(e, period));  // period % VEC == 0 (host-checked): no straddling
}

template <class T>
__device__ __forceinline__ float load_element(const T* ptr, long long period, long long e) {
  return to_float(period == 0 ? ptr[e] : ptr[row_offset(e, period)]);
}

template <class Op, class T, int NIN>
__device__ __forceinline__ void pointwise_element(const PointwiseParams& p, T* out,
                                                  const T* const (&in)[3],
                                                  const long long (&period)[3], long long e) {
  const float a = load_element(in[0], period[0], e);
  const float b = NIN > 1 ? load_element(in[1], period[1], e) : 0.0f;
  const float c = NIN > 2 ? load_element(in[2], period[2], e) : 0.0f;
  out[e] = from_float<T>(Op::apply(p, a, b, c));
}

// Packs first, first + stride, ..., first + (ILP-1) * stride; GUARD only near the end.
template <class Op, class T, int NIN, bool GUARD>
__device__ __forceinline__ void pointwise_packs(const PointwiseParams& p, T* out,
                                                const T* const (&in)[3],
                                                const long long (&period)[3], long long first,
                                                long long stride, long long n_packs) {
  constexpr int V = Vec16<T>::size;
  constexpr int ILP = Op::kIlp;
  uint4 raw[NIN][ILP];
#pragma unroll
  for (int u = 0; u < ILP; ++u) {
    const long long pk = first + u * stride;
    if (!GUARD || pk < n_packs) {
#pragma unroll
      for (int k = 0; k < NIN; ++k) raw[k][u] = load_operand16(in[k], period[k], pk * V);
    }
  }
#pragma unroll
  for (int u = 0; u < ILP; ++u) {
    const long long pk = first + u * stride;
    if (!GUARD || pk < n_packs) {
      float x[NIN][V], y[V];
#pragma unroll
      for (int k = 0; k < NIN; ++k) Vec16<T>::unpack(raw[k][u], x[k]);
#pragma unroll
      for (int j = 0; j < V; ++j)
        y[j] = Op::apply(p, x[0][j], NIN > 1 ? x[NIN > 1 ? 1 : 0][j] : 0.0f,
                         NIN > 2 ? x[NIN > 2 ? 2 : 0][j] : 0.0f);
      store16(out + pk * V, Vec16<T>::pack(y));
    }
  }
}

// Grid-stride over 16-byte packs (VEC = 16 / sizeof(T)), or over elements when VEC == 1.
// The explicit minimum of blocks per SM matters: with the thread bound alone ptxas picked too
// few registers for some ops and spilled.
template <class Op, class T, int NIN, int VEC>
__global__ void __launch_bounds__(kPointwiseThreads, Op::kMinBlocks)
pointwise_flat(PointwiseParams p, T* __restrict__ out, const T* __restrict__ in0,
               const T* __restrict__ in1, const T* __restrict__ in2, long long period0,
               long long period1, long long period2, long long n) {
  pdl_start();
  const T* const in[3] = {in0, in1, in2};
  const long long period[3] = {period0, period1, period2};
  const long long thread = static_cast<long long>(blockIdx.x) * kPointwiseThreads + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * kPointwiseThreads;
  if constexpr (VEC == 1) {
    // Unaligned or odd-period operands: one element per thread and step.
    for (long long e = thread; e < n; e += stride) pointwise_element<Op, T, NIN>(p, out, in, period, e);
  } else {
    static_assert(VEC == Vec16<T>::size, "VEC must be 16 bytes of T");
    constexpr int ILP = Op::kIlp;
    const long long n_packs = n / VEC;
    long long first = thread;
    for (; first + (ILP - 1) * stride < n_packs; first += ILP * stride)
      pointwise_packs<Op, T, NIN, false>(p, out, in, period, first, stride, n_packs);
    if (first < n_packs) pointwise_packs<Op, T, NIN, true>(p, out, in, period, first, stride, n_packs);
    // The n % VEC elements past the last full pack, one per thread of block 0.
    if (thread < n - n_packs * VEC)
      pointwise_element<Op, T, NIN>(p, out, in, period, n_packs * VEC + thread);
  }
}

// Operand 0 of the layout is the output, 1..NIN the inputs.
template <class Op, class T, int NIN>
__global__ void __launch_bounds__(kPointwiseThreads)
pointwise_strided(PointwiseParams p, T* __restrict__ out, const T* __restrict__ in0,
                  const T* __restrict__ in1, const T* __restrict__ in2, StridedLayout L,
                  long long n) {
  pdl_start();
  const long long step = static_cast<long long>(gridDim.x) * kPointwiseThreads;
  for (long long i = static_cast<long long>(blockIdx.x) * kPointwiseThreads + threadIdx.x; i < n;
       i += step) {
    long long off[NIN + 1];
    strided_offsets<NIN + 1>(L, i, off);
    const float a = to_float(in0[off[1]]);
    const float b = NIN > 1 ? to_float(in1[off[NIN > 1 ? 2 : 1]]) : 0.0f;
    const float c = NIN > 2 ? to_float(in2[off[NIN > 2 ? 3 : 1]]) : 0.0f;
    out[off[0]] = from_float<T>(Op::apply(p, a, b, c));
  }
}

}  // namespace gpuops
