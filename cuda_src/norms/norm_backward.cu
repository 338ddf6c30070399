// Backward of LayerNorm (kLN) and RMSNorm, with the residual gradient of add_rms_norm.
//
//   xhat = (x - mean) * rstd        (RMSNorm: x * rstd)
//   g    = dy * w                   (w = 1 when the forward had no weight)
//   dx   = rstd * (g - mean(g) - xhat * mean(g * xhat)) [+ dres]   (RMSNorm: no mean(g) term)
//   dw   = sum over rows of dy * xhat,   db = sum over rows of dy   (kLN)
//
// dx needs two row sums (one for RMSNorm), reduced like the forward's statistics (row layout and
// phases: norms/norm_rows.cuh). dw and db are column sums over all rows, made deterministic
// without atomics: the grid is persistent (gridDim.x / C "slots", each taking every slots-th
// row), every thread accumulates its columns over its rows in registers and writes them to row
// `slot` of a [slots, n] fp32 workspace, and norm_weight_grad sums the slots in a fixed order.
#include "norms/norm_rows.cuh"
#include "common/pdl.cuh"

namespace gpuops {

template <int VEC>
__device__ __forceinline__ void store_f32(float* p, const float (&f)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int j = 0; j < VEC; j += 4)
      *reinterpret_cast<float4*>(p + j) = make_float4(f[j], f[j + 1], f[j + 2], f[j + 3]);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) p[j] = f[j];
  }
}

// dy, x, dx (and dres, RMSNorm only, or null): rows of n elements with their own row strides;
// mean (kLN) and rstd: a float per row; w: n elements or null. dw_part, db_part (kLN): [slots, n]
// fp32, written in kFused and kApply. partials (rows * C * K), counters (rows, zeroed) and
// row_sums (rows * K: the rows' sums, written by the last block of each row): only for C > 1.
// n >= 1.
template <class T, int VEC, int PACKS, bool kLN>
__global__ void __launch_bounds__(1024, 1)
norm_bwd(const T* dy, long long dy_stride, const T* x, long long x_stride, const T* dres,
         long long dres_stride, const float* __restrict__ mean, const float* __restrict__ rstd,
         const T* __restrict__ w, T* dx, long long dx_stride, float* __restrict__ dw_part,
         float* __restrict__ db_part, float* __restrict__ partials,
         unsigned* __restrict__ counters, float* row_sums, long long rows, int n, int C,
         int phase) {
  pdl_start();
  constexpr int K = kLN ? 2 : 1;   // s[0] = sum(g * xhat), s[1] = sum(g)
  __shared__ float scratch[32 * K];
  __shared__ unsigned flag;
  const RowMap map(C, phase == kApply);
  const int units = n / VEC;
  const int u0 = first_unit<PACKS>(map.chunk);
  const int step = static_cast<int>(blockDim.x);
  const float inv_n = 1.0f / static_cast<float>(n);
  const bool accumulate = phase != kPartials;

  float dw[PACKS][VEC], db[PACKS][VEC];
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) dw[p][j] = db[p][j] = 0.0f;
  }

  for (long long row = map.first; row < rows; row += map.step) {
    float g[PACKS][VEC], xh[PACKS][VEC];
    load_tile<T, VEC, PACKS>(x + row * x_stride, u0, units, xh);
    load_tile<T, VEC, PACKS>(dy + row * dy_stride, u0, units, g);
    const float r = rstd[row];
    const float m = kLN ? mean[row] : 0.0f;
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      const int u = u0 + p * step;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        xh[p][j] = (xh[p][j] - m) * r;   // past the end: g = 0 there, so no sum sees it
        if (accumulate) {
          dw[p][j] = fmaf(g[p][j], xh[p][j], dw[p][j]);
          if (kLN) db[p][j] += g[p][j];
        }
      }
      if (w != nullptr && u < units) {
        float wv[VEC];
        Unit<T, VEC>::load(w + static_cast<long long>(u) * VEC, wv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) g[p][j] *= wv[j];
      }
    }

    float s[K];
    if (phase == kApply) {
#pragma unroll
      for (int k = 0; k < K; ++k) s[k] = row_sums[row * K + k];
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) s[k] = 0.0f;
#pragma unroll
      for (int p = 0; p < PACKS; ++p) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          s[0] = fmaf(g[p][j], xh[p][j], s[0]);
          if constexpr (kLN) s[1] += g[p][j];
        }
      }
      block_sum_n<K>(s, scratch);
      if (C > 1) {
        // The last block of the row sums the partials and publishes the row's sums; in one
        // launch (kFused) the others wait for them.
        float* row_partials = partials + row * C * K;
        float* sums = row_sums + row * K;
        if (split_arrive<K>(row_partials + K * map.chunk, s, counters + row, &flag) ==
            static_cast<unsigned>(C - 1)) {
          sum_partials<K>(row_partials, C, s, scratch);
          if (threadIdx.x == 0) {
#pragma unroll
            for (int k = 0; k < K; ++k) store_cg(sums + k, s[k]);
          }
          if (phase == kFused) split_release(counters + row);
        }
        if (phase == kPartials) continue;
        split_wait(counters + row, static_cast<unsigned>(C + 1));
#pragma unroll
        for (int k = 0; k < K; ++k) s[k] = load_cg(sums + k);
      }
    }

    const float a = s[0] * inv_n;                  // mean(g * xhat)
    const float c = kLN ? s[K - 1] * inv_n : 0.0f;  // mean(g)
    T* dx_row = dx + row * dx_stride;
    const T* dres_row = kLN || dres == nullptr ? nullptr : dres + row * dres_stride;
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      const int u = u0 + p * step;
      if (u < units) {
        const long long e = static_cast<long long>(u) * VEC;
        float o[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] = r * (g[p][j] - fmaf(xh[p][j], a, c));
        if (dres_row != nullptr) {
          float dv[VEC];
          Unit<T, VEC>::load(dres_row + e, dv);
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] += dv[j];
        }
        Unit<T, VEC>::store(dx_row + e, o);
      }
    }
  }

  if (accumulate && map.first < rows) {
    float* dw_row = dw_part + map.first * n;
    float* db_row = kLN ? db_part + map.first * n : nullptr;
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      const int u = u0 + p * step;
      if (u < units) {
        const long long e = static_cast<long long>(u) * VEC;
        store_f32<VEC>(dw_row + e, dw[p]);
        if (kLN) store_f32<VEC>(db_row + e, db[p]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Long rows by columns (split rows, few of them: e.g. [16, 1048576]). norm_bwd above walks each
// row with C blocks that meet at every row (an arrive/merge chain per row, little in flight) and
// writes a [slots, n] fp32 dw workspace per slot of rows. Here a block owns columns instead: the
// chunk of kColsThreads units it holds lives in the same place of every row, so one block
// accumulates dw (and db) of its columns over all the rows of its group in registers, and no
// row needs all its blocks at once:
//   norm_bwd_cols_stats   dw / db of its columns (rows of its group), and per (row, chunk) the K
//                         partial row sums (sum(g * xhat), sum(g)) into partials[rows, chunks, K]
//   norm_bwd_row_sums     each row's K sums of its chunks' partials, in a fixed order
//   norm_bwd_cols_apply   dx, walking the rows backwards: what the stats pass read last is the
//                         first it reads again, from L2 while it is still there
// kColsRows rows are loaded per step (loads for all of them in flight before the first is used;
// one block reduction for all of them). Grid: (blocks over chunks, row groups); a block takes
// chunks blockIdx.x, blockIdx.x + gridDim.x, ... of rows [group * rows_per_group, ...). dw and
// db go straight to the output when there is one group, else to a [groups, n] fp32 workspace
// that norm_weight_grad sums in a fixed order.
constexpr int kColsThreads = 256;
constexpr int kColsRows = 4;

template <class T, int VEC, bool kLN>
__global__ void __launch_bounds__(kColsThreads, 2)
norm_bwd_cols_stats(const T* dy, long long dy_stride, const T* x, long long x_stride,
                    const float* __restrict__ mean, const float* __restrict__ rstd,
                    const T* __restrict__ w, float* __restrict__ partials,
                    float* __restrict__ dw_part, float* __restrict__ db_part, T* dw_out,
                    T* db_out, long long rows, int n, int chunks, long long rows_per_group) {
  pdl_start();
  using R = RawUnit<T, VEC>;
  constexpr int K = kLN ? 2 : 1;
  constexpr int RR = kColsRows;
  __shared__ float scratch[32 * K * RR];
  const int units = n / VEC;
  const long long r0 = static_cast<long long>(blockIdx.y) * rows_per_group;
  const long long r1 = r0 + rows_per_group < rows ? r0 + rows_per_group : rows;

  for (int chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const int u = chunk * kColsThreads + static_cast<int>(threadIdx.x);
    const bool in = u < units;
    const long long e = static_cast<long long>(u) * VEC;
    float wv[VEC];
    if (w != nullptr && in) {
      Unit<T, VEC>::load(w + e, wv);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) wv[j] = 1.0f;
    }
    float dw[VEC], db[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) dw[j] = db[j] = 0.0f;

    for (long long row = r0; row < r1; row += RR) {
      typename R::type xr[RR], gr[RR];
#pragma unroll
      for (int i = 0; i < RR; ++i) {   // rows past the group's end and units past the row's: 0
        const bool ok = in && row + i < r1;
        xr[i] = ok ? R::load(x + (row + i) * x_stride + e) : R::zero();
        gr[i] = ok ? R::load(dy + (row + i) * dy_stride + e) : R::zero();
      }
      float s[RR * K];
#pragma unroll
      for (int i = 0; i < RR; ++i) {
        const bool ok = row + i < r1;
        const float r = ok ? rstd[row + i] : 0.0f;
        const float m = kLN && ok ? mean[row + i] : 0.0f;
        float xh[VEC], g[VEC];
        R::unpack(xr[i], xh);
        R::unpack(gr[i], g);
#pragma unroll
        for (int k = 0; k < K; ++k) s[i * K + k] = 0.0f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          xh[j] = (xh[j] - m) * r;
          dw[j] = fmaf(g[j], xh[j], dw[j]);
          if (kLN) db[j] += g[j];
          const float gw = g[j] * wv[j];
          s[i * K] = fmaf(gw, xh[j], s[i * K]);
          if (kLN) s[i * K + 1] += gw;
        }
      }
      block_sum_n<RR * K>(s, scratch);
      if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < RR; ++i) {
          if (row + i < r1) {
#pragma unroll
            for (int k = 0; k < K; ++k)
              partials[((row + i) * chunks + chunk) * K + k] = s[i * K + k];
          }
        }
      }
    }

    if (in) {
      if (gridDim.y == 1) {
        Unit<T, VEC>::store(dw_out + e, dw);
        if (kLN) Unit<T, VEC>::store(db_out + e, db);
      } else {
        store_f32<VEC>(dw_part + blockIdx.y * static_cast<long long>(n) + e, dw);
        if (kLN) store_f32<VEC>(db_part + blockIdx.y * static_cast<long long>(n) + e, db);
      }
    }
  }
}

// sums[row * K + k] = sum over chunks of partials[(row * chunks + chunk) * K + k], one block per
// row (grid-stride), in a fixed order (norm_rows.cuh sum_partials): the same sums on every run.
template <int K>
__global__ void __launch_bounds__(256)
norm_bwd_row_sums(const float* __restrict__ partials, float* __restrict__ sums, long long rows,
                  int chunks) {
  pdl_start();
  __shared__ float scratch[32 * K];
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    float v[K];
    sum_partials<K>(partials + row * chunks * K, chunks, v, scratch);
    if (threadIdx.x == 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) sums[row * K + k] = v[k];
    }
  }
}

// dx of the blocks' columns, rows of the group last to first, chunks last to first.
template <class T, int VEC, bool kLN>
__global__ void __launch_bounds__(kColsThreads, 2)
norm_bwd_cols_apply(const T* dy, long long dy_stride, const T* x, long long x_stride,
                    const T* dres, long long dres_stride, const float* __restrict__ mean,
                    const float* __restrict__ rstd, const T* __restrict__ w,
                    const float* __restrict__ sums, T* dx, long long dx_stride, long long rows,
                    int n, int chunks, long long rows_per_group) {
  pdl_start();
  using R = RawUnit<T, VEC>;
  constexpr int K = kLN ? 2 : 1;
  constexpr int RR = kColsRows;
  const int units = n / VEC;
  const float inv_n = 1.0f / static_cast<float>(n);
  const long long r0 = static_cast<long long>(blockIdx.y) * rows_per_group;
  const long long r1 = r0 + rows_per_group < rows ? r0 + rows_per_group : rows;
  const int own = chunks > static_cast<int>(blockIdx.x)
                      ? (chunks - 1 - static_cast<int>(blockIdx.x)) / static_cast<int>(gridDim.x)
                      : -1;   // this block's chunks: blockIdx.x + k * gridDim.x, k <= own

  for (int k_chunk = own; k_chunk >= 0; --k_chunk) {
    const int chunk = static_cast<int>(blockIdx.x) + k_chunk * static_cast<int>(gridDim.x);
    const int u = chunk * kColsThreads + static_cast<int>(threadIdx.x);
    if (u >= units) continue;
    const long long e = static_cast<long long>(u) * VEC;
    float wv[VEC];
    if (w != nullptr) {
      Unit<T, VEC>::load(w + e, wv);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) wv[j] = 1.0f;
    }
    for (long long top = r1; top > r0; top -= RR) {   // rows top - 1, top - 2, ... >= r0
      typename R::type xr[RR], gr[RR], dr[RR];
#pragma unroll
      for (int i = 0; i < RR; ++i) {
        const long long row = top - 1 - i;
        const bool ok = row >= r0;
        xr[i] = ok ? R::load(x + row * x_stride + e) : R::zero();
        gr[i] = ok ? R::load(dy + row * dy_stride + e) : R::zero();
        if (!kLN && dres != nullptr) dr[i] = ok ? R::load(dres + row * dres_stride + e) : R::zero();
      }
#pragma unroll
      for (int i = 0; i < RR; ++i) {
        const long long row = top - 1 - i;
        if (row < r0) continue;
        const float r = rstd[row];
        const float m = kLN ? mean[row] : 0.0f;
        const float a = sums[row * K] * inv_n;                   // mean(g * xhat)
        const float c = kLN ? sums[row * K + 1] * inv_n : 0.0f;  // mean(g)
        float xh[VEC], g[VEC], o[VEC];
        R::unpack(xr[i], xh);
        R::unpack(gr[i], g);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          xh[j] = (xh[j] - m) * r;
          o[j] = r * (g[j] * wv[j] - fmaf(xh[j], a, c));
        }
        if (!kLN && dres != nullptr) {
          float dv[VEC];
          R::unpack(dr[i], dv);
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] += dv[j];
        }
        Unit<T, VEC>::store(dx + row * dx_stride + e, o);
      }
    }
  }
}

// out_a[c] = sum over slots of part_a[slot, c] (and out_b from part_b unless null), in a fixed
// order. blockDim = (32, 16): 32 columns per block, 16 slot lanes each.
template <class T>
__global__ void __launch_bounds__(512)
norm_weight_grad(const float* __restrict__ part_a, const float* __restrict__ part_b,
                 T* __restrict__ out_a, T* __restrict__ out_b, int slots, int n) {
  pdl_start();
  __shared__ float sa[16][33];
  __shared__ float sb[16][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const long long col = static_cast<long long>(blockIdx.x) * 32 + tx;
  float a = 0.0f, b = 0.0f;
  if (col < n) {
    for (int s = ty; s < slots; s += 16) {
      a += part_a[static_cast<long long>(s) * n + col];
      if (part_b != nullptr) b += part_b[static_cast<long long>(s) * n + col];
    }
  }
  sa[ty][tx] = a;
  sb[ty][tx] = b;
  __syncthreads();
  if (ty == 0 && col < n) {
    float ta = 0.0f, tb = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      ta += sa[i][tx];
      tb += sb[i][tx];
    }
    out_a[col] = from_float<T>(ta);
    if (out_b != nullptr) out_b[col] = from_float<T>(tb);
  }
}

}  // namespace gpuops
