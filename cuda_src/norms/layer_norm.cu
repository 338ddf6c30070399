// LayerNorm forward: y = (x - mean) * rstd * w + b over rows of n elements, with the per-row mean
// and rstd = 1 / sqrt(var + eps) (biased variance) kept in fp32 for the backward. Statistics: two
// passes over the registers (the mean, then the sum of squared deviations from it: stable for rows
// far from zero mean, unlike E[x^2] - E[x]^2), and for rows split over blocks, Chan merges of the
// blocks' (count, mean, M2) (common/row_stats.cuh). Per-thread Welford triples merged by
// shuffles instead cost 4-8 more registers (one fewer resident block per SM at 4096-wide rows)
// and spilled on some archs. Row layout and phases: norms/norm_rows.cuh.
#include "norms/norm_rows.cuh"

namespace gpuops {

// x, y: rows of n elements, `x_stride` / `y_stride` elements apart (y may be x: in place).
// w, b: n elements or null. mean_out, rstd_out: one float per row, or null when not wanted (they
// are required for C > 1 with phase kPartials/kApply, where they carry the row statistics).
// partials (rows * C * 3 floats) and counters (rows, zeroed): only for C > 1.
template <class T, int VEC, int PACKS>
__global__ void __launch_bounds__(1024, 1)
layer_norm_fwd(const T* x, long long x_stride, T* y, long long y_stride, const T* __restrict__ w,
               const T* __restrict__ b, float* mean_out, float* rstd_out,
               float* __restrict__ partials, unsigned* __restrict__ counters, long long rows,
               int n, int C, int phase, float eps) {
  __shared__ float scratch[96];   // block_sum_n<1>: 32, merge_welford_partials: 96
  __shared__ unsigned flag;
  const RowMap map(C);
  const int units = n / VEC;
  const int u0 = first_unit<PACKS>(map.chunk);
  const bool block_rows = blockDim.x > 32;
  const int step = static_cast<int>(blockDim.x);
  const int chunk_units = step * PACKS;
  const float inv_n = 1.0f / static_cast<float>(n);   // n = 0: rstd = NaN, as torch

  for (long long row = map.first; row < rows; row += map.step) {
    float v[PACKS][VEC];
    load_tile<T, VEC, PACKS>(x + row * x_stride, u0, units, v);
    float mean, rstd;
    if (phase == kApply) {
      mean = mean_out[row];
      rstd = rstd_out[row];
    } else {
      // Two passes over the registers: the mean of the block's chunk, then M2 about it.
      MeanM2 s;
      s.n = static_cast<float>(VEC * max(0, min(units - map.chunk * chunk_units, chunk_units)));
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
      if (C > 1) {
        float* row_partials = partials + row * C * 3;
        const float mine[3] = {s.n, s.mean, s.m2};
        const unsigned before =
            split_arrive<3>(row_partials + 3 * map.chunk, mine, counters + row, &flag);
        if (phase == kPartials && before != static_cast<unsigned>(C - 1)) continue;
        if (phase == kFused) split_wait(counters + row, static_cast<unsigned>(C));
        s = merge_welford_partials(row_partials, C, scratch);
      }
      mean = s.mean;
      rstd = rsqrtf(s.m2 * inv_n + eps);
      // kPartials: only the last block of the row got here; kFused: chunk 0 writes.
      if (mean_out != nullptr && threadIdx.x == 0 && (phase == kPartials || map.chunk == 0)) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
      }
      if (phase == kPartials) continue;
    }

    T* y_row = y + row * y_stride;
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      const int u = u0 + p * step;
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
}

}  // namespace gpuops
