// Cross-entropy over logits [rows, C] with integer targets, without materializing the softmax.
//
// Forward (three small launches around one streaming pass):
//   ce_stats     one block per (row, chunk of the vocabulary): online (max, sum exp) and sum(x)
//                of the chunk, fp32, into a workspace. Large C is split into S chunks per row
//                so that even 16 rows fill the GPU; with many rows S = 1.
//   ce_finalize  one thread per row: merges the row's S partials (fixed order), lse = m + log s,
//                loss = (1 - eps) (lse - x[target]) + eps (lse - sum(x) / C), 0 for ignored rows;
//                writes lse (fp32) and either the per-row loss or per-block partial sums.
//   ce_reduce    one block: the sum (or mean over non-ignored rows) of the per-block partials.
// Backward (one streaming pass, reading the logits once more):
//   ce_backward  dx = softmax(x) (a + b) - a ((1 - eps) onehot(target) + eps / C) per row, with
//                a = d loss / d loss_row (grad_output, / count for 'mean', 0 if ignored) and
//                b = d loss / d lse_row (0 unless the caller differentiates through lse).
//                dx may be x itself (the caller's opt-in in-place mode).
//                grad may be null: a unit grad_output (the gradient computed with the loss).
//   ce_count     one block: the number of non-ignored rows, for 'mean'.
// Loss and gradient in one pass (the gradient for a unit grad_output, e.g. written over the
// logits, as gpuops.torch.cross_entropy(..., inplace_backward="forward") does):
//   ce_fused     one block of 1024 threads per row: pass 1 streams the row (online max / sum exp
//                / sum x) keeping its first `cache_packs` packs in shared memory (up to 227 KB on
//                the H100: 3/4 of a 151,936-entry bf16 row), pass 2 writes the gradient from
//                the cache and the rest of the row, which is re-read while still in L2. DRAM:
//                one read and one write of the logits.
//   ce_scale     the gradient times grad_output, per row; rows whose factor is exactly 1 are
//                skipped when scaling in place (then the whole launch is a few reads).
#include "softmax/rows.cuh"

namespace gpuops {

constexpr int kCeUnroll = 4;
enum CeMode { kCeNone = 0, kCeSum = 1, kCeMean = 2 };

template <class T, bool V>
__global__ void __launch_bounds__(256)
ce_stats(const T* x, long long xs, int C, int chunk, int S, float* ws) {
  using PK = Pack<T, V>;
  constexpr int N = PK::N, U = kCeUnroll;
  __shared__ float scratch[32];
  const unsigned row = blockIdx.x / S, part = blockIdx.x - row * S;
  const int begin = part * chunk, end = min(C, begin + chunk);
  const int step = blockDim.x * N;
  const T* xr = x + static_cast<long long>(row) * xs;

  float m = neg_inf(), s = 0.0f, sx = 0.0f;
  for (int base = begin + threadIdx.x * N; base < end; base += U * step) {
    PK pk[U];
    bool live[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      live[u] = base + u * step < end;
      if (live[u]) pk[u].load(xr + base + u * step);
    }
    online_add_packs<true>(m, s, sx, pk, live);
  }
  const float M = block_max(m, scratch);
  const float total = block_sum(s * online_rescale(m, M), scratch);
  sx = block_sum(sx, scratch);
  if (threadIdx.x == 0) {
    float* w = ws + 3 * static_cast<long long>(blockIdx.x);
    w[0] = M;
    w[1] = total;
    w[2] = sx;
  }
}

template <class T, class TI>
__global__ void __launch_bounds__(256)
ce_finalize(const T* x, long long xs, const TI* target, long long ts, long long rows, int C, int S,
            const float* ws, long long ignore_index, float eps, int mode, T* loss,
            long long loss_stride, float* lse, float* partial) {
  __shared__ float scratch[32];
  const long long row = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  float l = 0.0f, valid = 0.0f;
  if (row < rows) {
    const float* w = ws + 3 * row * S;
    float m = neg_inf(), s = 0.0f, sx = 0.0f;
    for (int j = 0; j < S; ++j) {
      online_merge(m, s, w[3 * j], w[3 * j + 1]);
      sx += w[3 * j + 2];
    }
    const float z = m + logf(s);            // a row of only -inf: -inf + log 0 = -inf
    lse[row] = z;
    const long long t = static_cast<long long>(target[row * ts]);
    if (t != ignore_index) {
      valid = 1.0f;
      if (t < 0 || t >= C) {
        l = __int_as_float(0x7fffffff);     // out-of-range target: NaN (torch raises an assert)
      } else {
        const float xt = to_float(x[row * xs + t]);
        l = z - xt;
        if (eps != 0.0f) l = (1.0f - eps) * l + eps * (z - sx / static_cast<float>(C));
      }
    }
    if (mode == kCeNone) loss[row * loss_stride] = from_float<T>(l);
  }
  if (mode != kCeNone) {
    l = block_sum(l, scratch);
    valid = block_sum(valid, scratch);
    if (threadIdx.x == 0) {
      partial[2 * blockIdx.x] = l;
      partial[2 * blockIdx.x + 1] = valid;
    }
  }
}

template <class T>
__global__ void __launch_bounds__(1024)
ce_reduce(const float* partial, int nparts, int mode, T* out) {
  __shared__ float scratch[32];
  float l = 0.0f, c = 0.0f;
  for (int j = threadIdx.x; j < nparts; j += blockDim.x) {
    l += partial[2 * j];
    c += partial[2 * j + 1];
  }
  l = block_sum(l, scratch);
  c = block_sum(c, scratch);
  if (threadIdx.x == 0) out[0] = from_float<T>(mode == kCeMean ? l / c : l);   // 0 / 0 = NaN, as torch
}

template <class TI>
__global__ void __launch_bounds__(1024)
ce_count(const TI* target, long long ts, long long rows, long long ignore_index, float* count) {
  __shared__ float scratch[32];
  float c = 0.0f;
  for (long long r = threadIdx.x; r < rows; r += blockDim.x)
    c += static_cast<long long>(target[r * ts]) != ignore_index ? 1.0f : 0.0f;
  c = block_sum(c, scratch);
  if (threadIdx.x == 0) count[0] = c;
}

// grid: rows * cpb blocks of 256 threads, one pack per thread (the grid covers the data once).
template <class T, class TI, bool V>
__global__ void __launch_bounds__(256)
ce_backward(const T* grad, long long gs, const T* x, long long xs, const TI* target, long long ts,
            const float* lse, const float* glse, long long glse_stride, T* dx, long long dxs,
            int C, int cpb, long long ignore_index, float eps, int mode, const float* count) {
  using PK = Pack<T, V>;
  constexpr int N = PK::N;
  const unsigned row = blockIdx.x / cpb, part = blockIdx.x - row * cpb;
  const int j0 = (part * blockDim.x + threadIdx.x) * N;
  if (j0 >= C) return;
  const long long t = static_cast<long long>(target[row * ts]);
  float a = 0.0f;
  if (t != ignore_index) {
    a = grad != nullptr ? to_float(grad[mode == kCeNone ? row * gs : 0]) : 1.0f;
    if (mode == kCeMean) a /= count[0];
  }
  const float b = glse != nullptr ? glse[row * glse_stride] : 0.0f;
  float f[N];
  T* d = dx + static_cast<long long>(row) * dxs + j0;
  if (a == 0.0f && b == 0.0f) {     // ignored row (or zero gradient): no need to read x
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = 0.0f;
    PK::store(d, f);
    return;
  }
  const float z = lse[row], ab = a + b, smooth = a * eps / static_cast<float>(C);
  const float hit = a * (1.0f - eps);
  PK pk;
  pk.load(x + static_cast<long long>(row) * xs + j0);
  pk.unpack(f);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float v = fmaf(exp_fast(f[k] - z), ab, -smooth);
    if (j0 + k == t) v -= hit;
    f[k] = v;
  }
  PK::store(d, f);
}

template <class T, class TI, bool V>
__global__ void __launch_bounds__(1024)
ce_fused(const T* x, long long xs, const TI* target, long long ts, int C, int cache_packs,
         long long ignore_index, float eps, int mode, const float* count, T* dx, long long dxs,
         T* loss, long long loss_stride, float* partial) {
  using PK = Pack<T, V>;
  using Raw = typename PK::Raw;
  constexpr int N = PK::N, U = 2;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Raw* cache = reinterpret_cast<Raw*>(smem_raw);
  __shared__ float scratch[32];
  __shared__ float xt_shared;
  const long long row = blockIdx.x;
  const int TX = blockDim.x, packs = C / N;
  const T* xr = x + row * xs;
  const long long t = static_cast<long long>(target[row * ts]);
  const bool valid = t != ignore_index, inside = t >= 0 && t < C;
  if (threadIdx.x == 0) xt_shared = valid && inside ? to_float(xr[t]) : 0.0f;

  float m = neg_inf(), s = 0.0f, sx = 0.0f;
  for (int i0 = threadIdx.x; i0 < packs; i0 += U * TX) {
    PK pk[U];
    bool live[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * TX;
      live[u] = i < packs;
      if (live[u]) {
        pk[u].load(xr + static_cast<long long>(i) * N);
        if (i < cache_packs) cache[i] = pk[u].raw;
      }
    }
    online_add_packs<true>(m, s, sx, pk, live);
  }
  const float M = block_max(m, scratch);
  const float S = block_sum(s * online_rescale(m, M), scratch);
  sx = block_sum(sx, scratch);              // (its barriers also publish xt_shared)
  const float z = M + logf(S);
  float l = 0.0f;
  if (valid) {
    l = inside ? z - xt_shared : __int_as_float(0x7fffffff);
    if (inside && eps != 0.0f) l = (1.0f - eps) * l + eps * (z - sx / static_cast<float>(C));
  }
  if (threadIdx.x == 0) {
    if (mode == kCeNone) {
      loss[row * loss_stride] = from_float<T>(l);
    } else {
      partial[2 * row] = l;
      partial[2 * row + 1] = valid ? 1.0f : 0.0f;
    }
  }
  // every read of x (also x[target]) is done: dx may be x
  __syncthreads();
  const float a = valid ? (mode == kCeMean ? 1.0f / count[0] : 1.0f) : 0.0f;
  const float smooth = a * eps / static_cast<float>(C), hit = a * (1.0f - eps);
  T* dr = dx + row * dxs;
  for (int i = threadIdx.x; i < packs; i += TX) {
    float f[N];
    if (a == 0.0f) {
#pragma unroll
      for (int k = 0; k < N; ++k) f[k] = 0.0f;
    } else {
      PK pk;
      if (i < cache_packs) pk.raw = cache[i];
      else pk.load(xr + static_cast<long long>(i) * N);
      pk.unpack(f);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        float v = fmaf(exp_fast(f[k] - z), a, -smooth);
        if (i * N + k == t) v -= hit;
        f[k] = v;
      }
    }
    PK::store(dr + static_cast<long long>(i) * N, f);
  }
}

// dst = src * grad_output (per row for 'none'); grid-stride over (row, chunk of 256 packs).
template <class T, bool V>
__global__ void __launch_bounds__(256)
ce_scale(const T* grad, long long gs, int mode, const T* src, long long ss, T* dst, long long ds,
         long long rows, int C, int cpb) {
  using PK = Pack<T, V>;
  constexpr int N = PK::N;
  const bool in_place = src == dst;
  if (mode != kCeNone && in_place && to_float(grad[0]) == 1.0f) return;
  const long long work = rows * cpb;
  for (long long w = blockIdx.x; w < work; w += gridDim.x) {
    const long long row = w / cpb;
    const int j0 = (static_cast<int>(w - row * cpb) * blockDim.x + threadIdx.x) * N;
    const float a = to_float(grad[mode == kCeNone ? row * gs : 0]);
    if ((in_place && a == 1.0f) || j0 >= C) continue;
    PK pk;
    pk.load(src + row * ss + j0);
    float f[N];
    pk.unpack(f);
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] *= a;
    PK::store(dst + row * ds + j0, f);
  }
}

}  // namespace gpuops
