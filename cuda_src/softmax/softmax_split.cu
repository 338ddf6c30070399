// Softmax / log_softmax (and their backward ops) over rows too long for one block's registers, or
// too few to fill the GPU one block per row: each row is cut into S chunks of `chunk` elements
// (a multiple of the pack size), one block per (row, chunk), in two kernels.
//
//   stats:  each block reduces its chunk to partial statistics in a workspace, fp32:
//           forward (max m, sum exp(x - m)) merged online; backward sum(g * y) or sum(g).
//   apply:  each block merges its row's S partials (in a fixed order: deterministic), reads its
//           chunk again and writes it.
//
// DRAM traffic: the chunk is read twice. The second read hits L2 when the data of all blocks in
// flight fits there (a few long rows: 8 x 393,216 fp32 is 12.6 MB of the H100's 50 MB), so the
// long-row case moves close to one read + one write. Blocks are 256 threads; each thread keeps
// U packs in flight per loop step.
#include "softmax/rows.cuh"
#include "common/pdl.cuh"

namespace gpuops {

constexpr int kSplitUnroll = 4;

template <class T, bool V>
__global__ void __launch_bounds__(256)
softmax_split_stats(const T* x, long long xs, int n, int chunk, int S, float* ws) {
  pdl_start();
  using PK = Pack<T, V>;
  constexpr int N = PK::N, U = kSplitUnroll;
  __shared__ float scratch[32];
  const unsigned row = blockIdx.x / S, part = blockIdx.x - row * S;
  const int begin = part * chunk, end = min(n, begin + chunk);
  const int step = blockDim.x * N;
  const T* xr = x + static_cast<long long>(row) * xs;

  float m = neg_inf(), s = 0.0f;
  for (int base = begin + threadIdx.x * N; base < end; base += U * step) {
    PK pk[U];
    bool live[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      live[u] = base + u * step < end;
      if (live[u]) pk[u].load(xr + base + u * step);
    }
    float unused = 0.0f;
    online_add_packs<false>(m, s, unused, pk, live);
  }
  const float M = block_max(m, scratch);
  const float total = block_sum(s * online_rescale(m, M), scratch);
  if (threadIdx.x == 0) {
    ws[2 * static_cast<long long>(blockIdx.x)] = M;
    ws[2 * static_cast<long long>(blockIdx.x) + 1] = total;
  }
}

// y may be x (in place): each element is read, then written, by the same thread.
template <class T, bool V, bool LOG>
__global__ void __launch_bounds__(256)
softmax_split_apply(const T* x, T* y, long long xs, long long ys, int n, int chunk, int S,
                    const float* ws) {
  pdl_start();
  using PK = Pack<T, V>;
  constexpr int N = PK::N, U = kSplitUnroll;
  __shared__ float scratch[32];
  const unsigned row = blockIdx.x / S, part = blockIdx.x - row * S;
  const int begin = part * chunk, end = min(n, begin + chunk);
  const int step = blockDim.x * N;

  const float* wr = ws + 2 * static_cast<long long>(row) * S;
  float m = neg_inf();
  for (int j = threadIdx.x; j < S; j += blockDim.x) m = MaxOp::combine(m, wr[2 * j]);
  const float M = block_max(m, scratch);
  float s = 0.0f;
  for (int j = threadIdx.x; j < S; j += blockDim.x) s += wr[2 * j + 1] * online_rescale(wr[2 * j], M);
  s = block_sum(s, scratch);
  // the raw max M: a row of only -inf gives NaN, as torch
  const float scale = LOG ? logf(s) : 1.0f / s;

  const T* xr = x + static_cast<long long>(row) * xs;
  T* yr = y + static_cast<long long>(row) * ys;
  for (int base = begin + threadIdx.x * N; base < end; base += U * step) {
    PK pk[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (base + u * step < end) pk[u].load(xr + base + u * step);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * step < end) {
        float f[N];
        pk[u].unpack(f);
#pragma unroll
        for (int k = 0; k < N; ++k) f[k] = LOG ? (f[k] - M) - scale : exp_fast(f[k] - M) * scale;
        PK::store(yr + base + u * step, f);
      }
    }
  }
}

// Backward, stats: the chunk's sum(g * y) (softmax) or sum(g) (log_softmax).
template <class T, bool V, bool LOG>
__global__ void __launch_bounds__(256)
softmax_backward_split_stats(const T* g, const T* y, long long gs, long long ys, int n, int chunk,
                             int S, float* ws) {
  pdl_start();
  using PK = Pack<T, V>;
  constexpr int N = PK::N, U = kSplitUnroll;
  __shared__ float scratch[32];
  const unsigned row = blockIdx.x / S, part = blockIdx.x - row * S;
  const int begin = part * chunk, end = min(n, begin + chunk);
  const int step = blockDim.x * N;
  const T* gr = g + static_cast<long long>(row) * gs;
  const T* yr = y + static_cast<long long>(row) * ys;

  float acc = 0.0f;
  for (int base = begin + threadIdx.x * N; base < end; base += U * step) {
    PK pg[U], py[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * step < end) {
        pg[u].load(gr + base + u * step);
        if constexpr (!LOG) py[u].load(yr + base + u * step);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * step < end) {
        float fg[N];
        pg[u].unpack(fg);
        if constexpr (LOG) {
#pragma unroll
          for (int k = 0; k < N; ++k) acc += fg[k];
        } else {
          float fy[N];
          py[u].unpack(fy);
#pragma unroll
          for (int k = 0; k < N; ++k) acc = fmaf(fg[k], fy[k], acc);
        }
      }
    }
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) ws[blockIdx.x] = acc;
}

// Backward, apply: dx = y * (g - total) or g - exp(y) * total. dx may be g or y (in place).
template <class T, bool V, bool LOG>
__global__ void __launch_bounds__(256)
softmax_backward_split_apply(const T* g, const T* y, T* dx, long long gs, long long ys,
                             long long dxs, int n, int chunk, int S, const float* ws) {
  pdl_start();
  using PK = Pack<T, V>;
  constexpr int N = PK::N, U = kSplitUnroll;
  __shared__ float scratch[32];
  const unsigned row = blockIdx.x / S, part = blockIdx.x - row * S;
  const int begin = part * chunk, end = min(n, begin + chunk);
  const int step = blockDim.x * N;

  const float* wr = ws + static_cast<long long>(row) * S;
  float acc = 0.0f;
  for (int j = threadIdx.x; j < S; j += blockDim.x) acc += wr[j];
  acc = block_sum(acc, scratch);

  const T* gr = g + static_cast<long long>(row) * gs;
  const T* yr = y + static_cast<long long>(row) * ys;
  T* dr = dx + static_cast<long long>(row) * dxs;
  for (int base = begin + threadIdx.x * N; base < end; base += U * step) {
    PK pg[U], py[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * step < end) {
        pg[u].load(gr + base + u * step);
        py[u].load(yr + base + u * step);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * step < end) {
        float fg[N], fy[N];
        pg[u].unpack(fg);
        py[u].unpack(fy);
#pragma unroll
        for (int k = 0; k < N; ++k)
          fg[k] = LOG ? fmaf(-exp_accurate(fy[k]), acc, fg[k]) : fy[k] * (fg[k] - acc);
        PK::store(dr + base + u * step, fg);
      }
    }
  }
}

}  // namespace gpuops
