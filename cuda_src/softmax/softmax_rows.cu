// Softmax / log_softmax over rows that fit in one thread group's registers, forward and backward.
//
// Each thread loads up to P packs of its row (pack p of thread t is pack p * blockDim.x + t of
// the row, so each load instruction of the group is one coalesced run), keeps them in registers,
// and the row is read exactly once and written exactly once:
//   forward:  m = max(x); s = sum exp(x - m); y = exp(x - m) / s   or   y = (x - m) - log(s)
//   backward: softmax      dx = y * (g - sum(g * y))
//             log_softmax  dx = g - exp(y) * sum(g)
// Group size (blockDim.x, a power of two up to 1024) and rows per block (blockDim.y, with
// blockDim.x * blockDim.y a multiple of 32) are chosen per shape on the host
// (gpuops/ops/softmax.py); longer rows go to softmax_split.cu.
#include "softmax/rows.cuh"
#include "common/pdl.cuh"

namespace gpuops {

template <class T, bool V, int P, bool LOG>
__global__ void __launch_bounds__(1024)
softmax_rows(const T* x, T* y, long long rows, int n, long long xs,
             long long ys) {
  pdl_start();
  using PK = Pack<T, V>;
  constexpr int N = PK::N;
  __shared__ float scratch[32];
  const int tx = threadIdx.x, TX = blockDim.x;
  const long long row = static_cast<long long>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool row_ok = row < rows;
  const int packs = n / N;                   // the vector path is only taken when N divides n
  const T* xr = x + (row_ok ? row : 0) * xs;

  PK pk[P];
  float m = neg_inf();
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int i = p * TX + tx;
    if (row_ok && i < packs) pk[p].load(xr + static_cast<long long>(i) * N);
  }
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if (row_ok && p * TX + tx < packs) {
      float f[N];
      pk[p].unpack(f);
#pragma unroll
      for (int k = 0; k < N; ++k) m = MaxOp::combine(m, f[k]);
    }
  }
  m = group_reduce<MaxOp>(m, scratch);

  float s = 0.0f;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if (row_ok && p * TX + tx < packs) {
      float f[N];
      pk[p].unpack(f);
#pragma unroll
      for (int k = 0; k < N; ++k) s += exp_fast(f[k] - m);
    }
  }
  s = group_reduce<SumOp>(s, scratch);
  if (!row_ok) return;

  // exp(x - m) with the raw max: a row of only -inf gives (-inf) - (-inf) = NaN, as torch.
  const float scale = LOG ? logf(s) : 1.0f / s;
  T* yr = y + row * ys;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int i = p * TX + tx;
    if (i < packs) {
      float f[N];
      pk[p].unpack(f);
#pragma unroll
      for (int k = 0; k < N; ++k) f[k] = LOG ? (f[k] - m) - scale : exp_fast(f[k] - m) * scale;
      PK::store(yr + static_cast<long long>(i) * N, f);
    }
  }
}

// Backward from the forward's output y and the incoming gradient g. dx may be g or y itself (in
// place): every element is loaded before any is stored. (No __restrict__ for the same reason,
// also in the forward, where y may be x.)
template <class T, bool V, int P, bool LOG>
__global__ void __launch_bounds__(1024)
softmax_backward_rows(const T* g, const T* y, T* dx, long long rows, int n, long long gs,
                      long long ys, long long dxs) {
  pdl_start();
  using PK = Pack<T, V>;
  constexpr int N = PK::N;
  __shared__ float scratch[32];
  const int tx = threadIdx.x, TX = blockDim.x;
  const long long row = static_cast<long long>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool row_ok = row < rows;
  const int packs = n / N;
  const long long r = row_ok ? row : 0;
  const T* gr = g + r * gs;
  const T* yr = y + r * ys;

  PK pg[P], py[P];
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int i = p * TX + tx;
    if (row_ok && i < packs) {
      pg[p].load(gr + static_cast<long long>(i) * N);
      py[p].load(yr + static_cast<long long>(i) * N);
    }
  }
  float acc = 0.0f;           // sum(g * y) for softmax, sum(g) for log_softmax
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if (row_ok && p * TX + tx < packs) {
      float fg[N];
      pg[p].unpack(fg);
      if constexpr (LOG) {
#pragma unroll
        for (int k = 0; k < N; ++k) acc += fg[k];
      } else {
        float fy[N];
        py[p].unpack(fy);
#pragma unroll
        for (int k = 0; k < N; ++k) acc = fmaf(fg[k], fy[k], acc);
      }
    }
  }
  acc = group_reduce<SumOp>(acc, scratch);
  if (!row_ok) return;

  T* dr = dx + row * dxs;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int i = p * TX + tx;
    if (i < packs) {
      float fg[N], fy[N];
      pg[p].unpack(fg);
      py[p].unpack(fy);
#pragma unroll
      for (int k = 0; k < N; ++k)
        fg[k] = LOG ? fmaf(-exp_accurate(fy[k]), acc, fg[k]) : fy[k] * (fg[k] - acc);
      PK::store(dr + static_cast<long long>(i) * N, fg);
    }
  }
}

}  // namespace gpuops
