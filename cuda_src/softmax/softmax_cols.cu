// Softmax / log_softmax (and backward) over a dimension that is not the innermost one, e.g.
// dim=1 of a contiguous [B, C, H, W] tensor, or dim=-1 of a transposed matrix.
//
// The host views each operand as [O, R, I] with strides (so, sr, si): R is the reduced dimension,
// I the fastest-varying other dimension, O the rest. Threads run along I (blockDim.x of them, each
// owning one pack of N consecutive columns when si == 1) so that every load instruction of a warp
// covers a contiguous run of memory, and along R (blockDim.y of them, splitting the reduction
// when there are few columns). Two passes over R: the first keeps online (max, sum exp)
// statistics per column (one exponential per element), the partial statistics of the blockDim.y
// threads of a column are merged through shared memory in a fixed order, the second pass reads
// the column again (mostly from L1/L2: a block's tile is R x blockDim.x packs) and writes it.
#include "softmax/rows.cuh"
#include "common/pdl.cuh"

namespace gpuops {

constexpr int kColThreads = 256;     // blockDim.x * blockDim.y <= kColThreads

template <class T, bool V, bool LOG>
__global__ void __launch_bounds__(kColThreads)
softmax_cols(const T* x, T* y, int R, long long I, int nib, long long xso, long long xsr,
             long long xsi, long long yso, long long ysr, long long ysi) {
  pdl_start();
  using PK = Pack<T, V>;
  constexpr int N = PK::N;
  __shared__ float sm_m[kColThreads * N], sm_s[kColThreads * N];
  const unsigned o = blockIdx.x / nib, ib = blockIdx.x - o * nib;
  const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
  const long long i0 = (static_cast<long long>(ib) * TX + tx) * N;
  const bool ok = i0 < I;
  const T* xc = x + o * xso + (ok ? i0 : 0) * xsi;

  float m[N], s[N];
#pragma unroll
  for (int k = 0; k < N; ++k) { m[k] = neg_inf(); s[k] = 0.0f; }
  if (ok) {
    for (int r = ty; r < R; r += TY) {
      PK pk;
      pk.load(xc + r * xsr);
      float f[N];
      pk.unpack(f);
#pragma unroll
      for (int k = 0; k < N; ++k) online_add1(m[k], s[k], f[k]);
    }
  }
  const int slot = (ty * TX + tx) * N;
#pragma unroll
  for (int k = 0; k < N; ++k) { sm_m[slot + k] = m[k]; sm_s[slot + k] = s[k]; }
  __syncthreads();
  if (!ok) return;
  float scale[N];
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float M = neg_inf(), S = 0.0f;
    for (int j = 0; j < TY; ++j) {
      const int q = (j * TX + tx) * N + k;
      online_merge(M, S, sm_m[q], sm_s[q]);
    }
    m[k] = M;
    scale[k] = LOG ? logf(S) : 1.0f / S;
  }
  T* yc = y + o * yso + i0 * ysi;
  for (int r = ty; r < R; r += TY) {
    PK pk;
    pk.load(xc + r * xsr);            // y may be x: this thread read the element, then writes it
    float f[N];
    pk.unpack(f);
#pragma unroll
    for (int k = 0; k < N; ++k)
      f[k] = LOG ? (f[k] - m[k]) - scale[k] : exp_fast(f[k] - m[k]) * scale[k];
    PK::store(yc + r * ysr, f);
  }
}

template <class T, bool V, bool LOG>
__global__ void __launch_bounds__(kColThreads)
softmax_backward_cols(const T* g, const T* y, T* dx, int R, long long I, int nib, long long gso,
                      long long gsr, long long gsi, long long yso, long long ysr, long long ysi,
                      long long dso, long long dsr, long long dsi) {
  pdl_start();
  using PK = Pack<T, V>;
  constexpr int N = PK::N;
  __shared__ float sm_acc[kColThreads * N];
  const unsigned o = blockIdx.x / nib, ib = blockIdx.x - o * nib;
  const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
  const long long i0 = (static_cast<long long>(ib) * TX + tx) * N;
  const bool ok = i0 < I;
  const long long ic = ok ? i0 : 0;
  const T* gc = g + o * gso + ic * gsi;
  const T* yc = y + o * yso + ic * ysi;

  float acc[N];
#pragma unroll
  for (int k = 0; k < N; ++k) acc[k] = 0.0f;
  if (ok) {
    for (int r = ty; r < R; r += TY) {
      PK pg;
      pg.load(gc + r * gsr);
      float fg[N];
      pg.unpack(fg);
      if constexpr (LOG) {
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] += fg[k];
      } else {
        PK py;
        py.load(yc + r * ysr);
        float fy[N];
        py.unpack(fy);
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] = fmaf(fg[k], fy[k], acc[k]);
      }
    }
  }
  const int slot = (ty * TX + tx) * N;
#pragma unroll
  for (int k = 0; k < N; ++k) sm_acc[slot + k] = acc[k];
  __syncthreads();
  if (!ok) return;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float a = 0.0f;
    for (int j = 0; j < TY; ++j) a += sm_acc[(j * TX + tx) * N + k];
    acc[k] = a;
  }
  T* dc = dx + o * dso + i0 * dsi;
  for (int r = ty; r < R; r += TY) {
    PK pg, py;
    pg.load(gc + r * gsr);
    py.load(yc + r * ysr);
    float fg[N], fy[N];
    pg.unpack(fg);
    py.unpack(fy);
#pragma unroll
    for (int k = 0; k < N; ++k)
      fg[k] = LOG ? fmaf(-exp_accurate(fy[k]), acc[k], fg[k]) : fy[k] * (fg[k] - acc[k]);
    PK::store(dc + r * dsr, fg);
  }
}

}  // namespace gpuops
