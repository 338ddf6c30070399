// RMSNorm forward, y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) per row (kept in fp32
// for the backward), and the fused residual add of LLM decoder layers (kAdd):
//     h = x + r  (rounded to T and stored: the next layer's residual)
//     y = h * rstd(h) * w
// The statistics use h as stored (rounded to T), as HF transformers' Llama/Qwen layers and vLLM's
// fused_add_rms_norm do: y is exactly rms_norm(h) of the h returned. y is computed in fp32 and
// rounded once (HF rounds h * rstd to T before multiplying by w: within one rounding of this).
// Row layout and phases: norms/norm_rows.cuh.
#include "norms/norm_rows.cuh"

namespace gpuops {

// x (and r for kAdd), y, h: rows of n elements, each with its own row stride. w: n elements or
// null. rstd_out: a float per row or null (required for C > 1 with kPartials/kApply). h is
// written in kFused/kPartials and read back by kApply. partials (rows * C floats) and counters
// (rows, zeroed): only for C > 1.
template <class T, int VEC, int PACKS, bool kAdd>
__global__ void __launch_bounds__(1024, 1)
rms_norm_fwd(const T* x, long long x_stride, const T* r, long long r_stride, T* y,
             long long y_stride, T* h, long long h_stride, const T* __restrict__ w,
             float* rstd_out, float* __restrict__ partials, unsigned* __restrict__ counters,
             long long rows, int n, int C, int phase, float eps) {
  __shared__ float scratch[32];
  __shared__ unsigned flag;
  const RowMap map(C);
  const int units = n / VEC;
  const int u0 = first_unit<PACKS>(map.chunk);
  const bool block_rows = blockDim.x > 32;
  const int step = static_cast<int>(blockDim.x);
  const float inv_n = 1.0f / static_cast<float>(n);   // n = 0: rstd = NaN

  for (long long row = map.first; row < rows; row += map.step) {
    float v[PACKS][VEC];
    if (kAdd && phase != kApply) {
      float t[PACKS][VEC];
      load_tile<T, VEC, PACKS>(x + row * x_stride, u0, units, v);
      load_tile<T, VEC, PACKS>(r + row * r_stride, u0, units, t);
      T* h_row = h + row * h_stride;
#pragma unroll
      for (int p = 0; p < PACKS; ++p) {
        const int u = u0 + p * step;
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[p][j] += t[p][j];
        if (u < units) Unit<T, VEC>::store_rounded(h_row + static_cast<long long>(u) * VEC, v[p]);
      }
    } else {
      load_tile<T, VEC, PACKS>(kAdd ? h + row * h_stride : x + row * x_stride, u0, units, v);
    }

    float rstd;
    if (phase == kApply) {
      rstd = rstd_out[row];
    } else {
      float ss[1] = {0.0f};
#pragma unroll
      for (int p = 0; p < PACKS; ++p) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) ss[0] = fmaf(v[p][j], v[p][j], ss[0]);  // past the end: 0
      }
      if (block_rows) block_sum_n<1>(ss, scratch);
      else warp_sum_n<1>(ss);
      if (C > 1) {
        float* row_partials = partials + row * C;
        const unsigned before = split_arrive<1>(row_partials + map.chunk, ss, counters + row, &flag);
        if (phase == kPartials && before != static_cast<unsigned>(C - 1)) continue;
        if (phase == kFused) split_wait(counters + row, static_cast<unsigned>(C));
        sum_partials<1>(row_partials, C, ss, scratch);
      }
      rstd = rsqrtf(ss[0] * inv_n + eps);
      if (rstd_out != nullptr && threadIdx.x == 0 && (phase == kPartials || map.chunk == 0))
        rstd_out[row] = rstd;
      if (phase == kPartials) continue;
    }

    T* y_row = y + row * y_stride;
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      const int u = u0 + p * step;
      if (u < units) {
        const long long e = static_cast<long long>(u) * VEC;
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[p][j] *= rstd;
        if (w != nullptr) {
          float wv[VEC];
          Unit<T, VEC>::load(w + e, wv);
#pragma unroll
          for (int j = 0; j < VEC; ++j) v[p][j] *= wv[j];
        }
        Unit<T, VEC>::store(y_row + e, v[p]);
      }
    }
  }
}

}  // namespace gpuops
