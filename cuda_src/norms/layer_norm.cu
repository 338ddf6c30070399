// LayerNorm forward: y = (x - mean) * rstd * w + b over rows of n elements, with the per-row mean
// and rstd = 1 / sqrt(var + eps) (biased variance) kept in fp32 for the backward. Statistics: two
// passes over the registers (the mean, then the sum of squared deviations from it: stable for rows
// far from zero mean, unlike E[x^2] - E[x]^2), and for rows split over blocks, Chan merges of the
// blocks' (count, mean, M2) (common/row_stats.cuh). Per-thread Welford triples merged by
// shuffles instead cost 4-8 more registers (one fewer resident block per SM at 4096-wide rows)
// and spilled on some archs. Row layout and phases: norms/norm_rows.cuh.
#include "norms/norm_rows.cuh"

namespace gpuops {

// Count, mean and M2 of the block's chunk (of a warp's row when !block_rows): two passes.
template <int VEC, int PACKS>
__device__ __forceinline__ MeanM2 chunk_stats(const float (&v)[PACKS][VEC], int u0, int units,
                                              int chunk, bool block_rows, float* scratch) {
  const int step = static_cast<int>(blockDim.x);
  const int chunk_units = step * PACKS;
  MeanM2 s;
  s.n = static_cast<float>(VEC * max(0, min(units - chunk * chunk_units, chunk_units)));
  float t[1] = {0.0f};
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) t[0] += v[p][j];   // past the end: 0
  }
  if (block_rows) block_sum_n<1>(t, scratch);
  else warp_sum_n<1>(t);
  s.mean = s.n > 0.0f ? t[0] / s.n : 0.0f;
  t[0] = 0.0f;
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
    if (u0 + p * step < units) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = v[p][j] - s.mean;
        t[0] = fmaf(d, d, t[0]);
      }
    }
  }
  if (block_rows) block_sum_n<1>(t, scratch);
  else warp_sum_n<1>(t);
  s.m2 = t[0];
  return s;
}

// y = (v - mean) * rstd * w + b for this thread's units of the row.
template <class T, int VEC, int PACKS>
__device__ __forceinline__ void normalize_store(float (&v)[PACKS][VEC], float mean, float rstd,
                                                const T* w, const T* b, T* y_row, int u0,
                                                int units) {
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
    const int u = u0 + p * static_cast<int>(blockDim.x);
    if (u < units) {
      const long long e = static_cast<long long>(u) * VEC;
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[p][j] = (v[p][j] - mean) * rstd;
      if (w != nullptr) {
        float wv[VEC];
        Unit<T, VEC>::load(w + e, wv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[p][j] *= wv[j];
      }
      if (b != nullptr) {
        float bv[VEC];
        Unit<T, VEC>::load(b + e, bv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[p][j] += bv[j];
      }
      Unit<T, VEC>::store(y_row + e, v[p]);
    }
  }
}

// The last block of a split row: merge the row's partials, store mean and rstd (through L2).
__device__ __forceinline__ void merge_row_stats(const float* row_partials, int C, float inv_n,
                                                float eps, float* mean_out, float* rstd_out,
                                                float* scratch) {
  const MeanM2 s = merge_welford_partials(row_partials, C, scratch);
  if (threadIdx.x == 0) {
    store_cg(mean_out, s.mean);
    store_cg(rstd_out, rsqrtf(s.m2 * inv_n + eps));
  }
}

// Whole rows (C == 1, phase kFused) or the two launches of split rows (C > 1: kPartials, then
// kApply). x, y: rows of n elements, `x_stride` / `y_stride` elements apart (y may be x: in
// place). w, b: n elements or null. mean_out, rstd_out: one float per row, or null when not
// wanted with C == 1 (for C > 1 they carry the row statistics from kPartials to kApply).
// partials (rows * C * 3 floats) and counters (rows, zeroed): only for C > 1.
template <class T, int VEC, int PACKS>
__global__ void __launch_bounds__(1024, 1)
layer_norm_fwd(const T* x, long long x_stride, T* y, long long y_stride, const T* __restrict__ w,
               const T* __restrict__ b, float* mean_out, float* rstd_out,
               float* __restrict__ partials, unsigned* __restrict__ counters, long long rows,
               int n, int C, int phase, float eps) {
  __shared__ float scratch[96];   // block_sum_n<1>: 32, merge_welford_partials: 96
  __shared__ unsigned flag;
  const RowMap map(C, phase == kApply);
  const int units = n / VEC;
  const int u0 = first_unit<PACKS>(map.chunk);
  const bool block_rows = blockDim.x > 32;
  const float inv_n = 1.0f / static_cast<float>(n);   // n = 0: rstd = NaN, as torch

  for (long long row = map.first; row < rows; row += map.step) {
    float v[PACKS][VEC];
    load_tile<T, VEC, PACKS>(x + row * x_stride, u0, units, v);
    float mean, rstd;
    if (phase == kApply) {
      mean = mean_out[row];
      rstd = rstd_out[row];
    } else {
      const MeanM2 s = chunk_stats<VEC, PACKS>(v, u0, units, map.chunk, block_rows, scratch);
      if (C > 1) {   // kPartials
        float* row_partials = partials + row * C * 3;
        const float mine[3] = {s.n, s.mean, s.m2};
        if (split_arrive<3>(row_partials + 3 * map.chunk, mine, counters + row, &flag) ==
            static_cast<unsigned>(C - 1))
          merge_row_stats(row_partials, C, inv_n, eps, mean_out + row, rstd_out + row, scratch);
        continue;
      }
      mean = s.mean;
      rstd = rsqrtf(s.m2 * inv_n + eps);
      if (mean_out != nullptr && threadIdx.x == 0) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
      }
    }
    normalize_store<T, VEC, PACKS>(v, mean, rstd, w, b, y + row * y_stride, u0, units);
  }
}

// One row of a split launch in one pass: publish the chunk's statistics, prefetch the chunk of
// this block's next row into `next` (it streams in while the row's blocks wait for each other),
// merge if last, wait for the row's statistics, apply.
template <class T, int VEC, int PACKS>
__device__ __forceinline__ void layer_norm_split_row(
    float (&cur)[PACKS][VEC], float (&next)[PACKS][VEC], long long row, long long next_row,
    const T* x, long long x_stride, T* y, long long y_stride, const T* w, const T* b,
    float* mean_out, float* rstd_out, float* partials, unsigned* counters, long long rows,
    int C, int chunk, int u0, int units, float inv_n, float eps, float* scratch,
    unsigned* flag) {
  const MeanM2 s = chunk_stats<VEC, PACKS>(cur, u0, units, chunk, true, scratch);
  float* row_partials = partials + row * C * 3;
  const float mine[3] = {s.n, s.mean, s.m2};
  const unsigned before = split_arrive<3>(row_partials + 3 * chunk, mine, counters + row, flag);
  if (next_row < rows) load_tile<T, VEC, PACKS>(x + next_row * x_stride, u0, units, next);
  if (before == static_cast<unsigned>(C - 1)) {
    merge_row_stats(row_partials, C, inv_n, eps, mean_out + row, rstd_out + row, scratch);
    split_release(counters + row);
  }
  split_wait(counters + row, static_cast<unsigned>(C + 1));
  const float mean = load_cg(mean_out + row);
  const float rstd = load_cg(rstd_out + row);
  normalize_store<T, VEC, PACKS>(cur, mean, rstd, w, b, y + row * y_stride, u0, units);
}

// Split rows in one launch (C > 1, every block of the grid resident; arguments as
// layer_norm_fwd, with mean_out and rstd_out required and `phase` ignored). Two register buffers
// alternate between the row being finished and the next row being loaded.
template <class T, int VEC, int PACKS>
__global__ void __launch_bounds__(1024, 1)
layer_norm_split(const T* x, long long x_stride, T* y, long long y_stride,
                 const T* __restrict__ w, const T* __restrict__ b, float* mean_out,
                 float* rstd_out, float* __restrict__ partials, unsigned* __restrict__ counters,
                 long long rows, int n, int C, int phase, float eps) {
  __shared__ float scratch[96];
  __shared__ unsigned flag;
  const RowMap map(C);
  const int units = n / VEC;
  const int u0 = first_unit<PACKS>(map.chunk);
  const float inv_n = 1.0f / static_cast<float>(n);
  float va[PACKS][VEC], vb[PACKS][VEC];
  long long row = map.first;
  if (row < rows) load_tile<T, VEC, PACKS>(x + row * x_stride, u0, units, va);
  while (row < rows) {
    layer_norm_split_row<T, VEC, PACKS>(va, vb, row, row + map.step, x, x_stride, y, y_stride,
                                        w, b, mean_out, rstd_out, partials, counters, rows, C,
                                        map.chunk, u0, units, inv_n, eps, scratch, &flag);
    row += map.step;
    if (row >= rows) break;
    layer_norm_split_row<T, VEC, PACKS>(vb, va, row, row + map.step, x, x_stride, y, y_stride,
                                        w, b, mean_out, rstd_out, partials, counters, rows, C,
                                        map.chunk, u0, units, inv_n, eps, scratch, &flag);
    row += map.step;
  }
}

}  // namespace gpuops
