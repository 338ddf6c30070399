// Random features of kernelized_attention (Performer's FAVOR+), SIMT fp32 (sm_61 and up).
//
// For rows x of q or k (x' = x * xscale) and random directions w_r (r < m, fp32 [m, D]):
//   u_r = w_r . x'
//   kernel 'softmax': log-feature L_r = u_r - |x'|^2 / 2, feature exp(L_r - stab) / sqrt(m)
//   kernel 'rbf'    : features cos(u_r) / sqrt(m) (column r) and sin(u_r) / sqrt(m) (column m + r)
// The stabilizer of a query row is the row's own max_r L_r (it cancels in out = num / den); of a
// key it is the max of L over all keys and features of its (batch, head), which must be the same
// for every key. Queries: favor_logits with per_row = 1 does it all. Keys: favor_logits writes L
// and each tile's max, favor_key_exp reduces those maxima and exponentiates in place.
//
// favor_logits: one block per (64 rows, batch x head); loops over the features in tiles of 64
// and over the head dim in steps of 32 (X' and W tiles through shared memory, U = X' W^T in
// registers: thread (tx = tid % 8, ty = tid / 8) owns rows ty + 16 r and features tx + 8 c).
#include "attention/variants_common.cuh"

namespace gpuops {

constexpr int kFavorSoftmax = 0;
constexpr int kFavorRbf = 1;

template <class T, int KIND>
__global__ void __launch_bounds__(kLinThreads) favor_logits(const FavorArgs a) {
  constexpr int kLd = kLinDt + 4;
  __shared__ AttnF4 Xs4[(kLinRows * kLd) / 4];   // 16-byte aligned (LDS.128)
  float* Xs = reinterpret_cast<float*>(Xs4);
  __shared__ AttnF4 Ws4[(kLinRows * kLd) / 4];   // 16-byte aligned (LDS.128)
  float* Ws = reinterpret_cast<float*>(Ws4);
  __shared__ float red[kLinThreads / 32];

  const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3;
  const int tile = blockIdx.x, bh = blockIdx.y;
  const int b = bh / a.h, hh = bh - b * a.h;
  const int i0 = tile * kLinRows;
  const T* x = static_cast<const T*>(a.x) + b * a.xs[0] + hh * a.xs[1];
  float* f = a.f + (static_cast<long long>(bh) * a.s) * a.nf;

  float n2[4], rmax[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    n2[r] = 0.0f;
    rmax[r] = attn_neg_inf();
  }

  for (int f0 = 0; f0 < a.m; f0 += kLinRows) {
    float u[4][8];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 8; ++c) u[r][c] = 0.0f;
    for (int d0 = 0; d0 < a.d; d0 += kLinDt) {
      __syncthreads();
      for (int idx = tid; idx < kLinRows * kLinDt; idx += kLinThreads) {
        const int r = idx / kLinDt, c = idx & (kLinDt - 1);
        const int gi = i0 + r, gd = d0 + c;
        float xv = 0.0f, wv = 0.0f;
        if (gi < a.s && gd < a.d)
          xv = to_float(x[static_cast<long long>(gi) * a.xs[2] + static_cast<long long>(gd) * a.xs[3]]) *
               a.xscale;
        if (f0 + r < a.m && gd < a.d) wv = a.w[static_cast<long long>(f0 + r) * a.d + gd];
        Xs[r * kLd + c] = xv;
        Ws[r * kLd + c] = wv;
      }
      __syncthreads();
#pragma unroll 2
      for (int dd = 0; dd < kLinDt; dd += 4) {
        AttnF4 xa[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) xa[r] = lin_ld4(Xs + (ty + 16 * r) * kLd + dd);
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const AttnF4 wb = lin_ld4(Ws + (tx + 8 * c) * kLd + dd);
#pragma unroll
          for (int r = 0; r < 4; ++r) u[r][c] = lin_dot4(xa[r], wb, u[r][c]);
        }
      }
      if (KIND == kFavorSoftmax && f0 == 0) {   // |x'|^2: lane tx takes 4 of the 32 columns
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const AttnF4 xa = lin_ld4(Xs + (ty + 16 * r) * kLd + 4 * tx);
          n2[r] = lin_dot4(xa, xa, n2[r]);
        }
      }
    }
    if (KIND == kFavorSoftmax && f0 == 0) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        n2[r] += __shfl_xor_sync(0xffffffffu, n2[r], 1);
        n2[r] += __shfl_xor_sync(0xffffffffu, n2[r], 2);
        n2[r] += __shfl_xor_sync(0xffffffffu, n2[r], 4);
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = i0 + ty + 16 * r;
      if (i >= a.s) continue;
      float* row = f + static_cast<long long>(i) * a.nf;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const int fr = f0 + tx + 8 * c;
        if (fr >= a.m) continue;
        if (KIND == kFavorSoftmax) {
          const float logit = u[r][c] - 0.5f * n2[r];
          row[fr] = logit;
          rmax[r] = attn_max(rmax[r], logit);
        } else {
          row[fr] = cosf(u[r][c]) * a.inv_sqrt_m;
          row[a.m + fr] = sinf(u[r][c]) * a.inv_sqrt_m;
        }
      }
    }
  }
  if (KIND != kFavorSoftmax) return;

#pragma unroll
  for (int r = 0; r < 4; ++r) {
    rmax[r] = attn_max(rmax[r], __shfl_xor_sync(0xffffffffu, rmax[r], 1));
    rmax[r] = attn_max(rmax[r], __shfl_xor_sync(0xffffffffu, rmax[r], 2));
    rmax[r] = attn_max(rmax[r], __shfl_xor_sync(0xffffffffu, rmax[r], 4));
  }
  if (a.per_row) {
    // each thread rewrites exactly the elements it wrote above (no other thread touches them)
    for (int f0 = 0; f0 < a.m; f0 += kLinRows) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = i0 + ty + 16 * r;
        if (i >= a.s) continue;
        float* row = f + static_cast<long long>(i) * a.nf;
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const int fr = f0 + tx + 8 * c;
          if (fr < a.m) row[fr] = expf(row[fr] - rmax[r]) * a.inv_sqrt_m;
        }
      }
    }
    return;
  }
  // keys: the tile's max (rows past the end kept -inf) -> tile_max
  float t = attn_max(attn_max(rmax[0], rmax[1]), attn_max(rmax[2], rmax[3]));
  t = attn_max(t, __shfl_xor_sync(0xffffffffu, t, 8));
  t = attn_max(t, __shfl_xor_sync(0xffffffffu, t, 16));
  if ((tid & 31) == 0) red[tid >> 5] = t;
  __syncthreads();
  if (tid == 0) {
    float mx = red[0];
#pragma unroll
    for (int w = 1; w < kLinThreads / 32; ++w) mx = attn_max(mx, red[w]);
    a.tile_max[static_cast<long long>(bh) * gridDim.x + tile] = mx;
  }
}

// Keys, kernel 'softmax': stab = max of this (batch, head)'s tile maxima; F = exp(L - stab) /
// sqrt(m) in place for the block's 64 rows. Grid as favor_logits.
__global__ void __launch_bounds__(kLinThreads) favor_key_exp(const FavorArgs a) {
  __shared__ float red[kLinThreads / 32];
  const int tid = threadIdx.x, bh = blockIdx.y;
  const int ntiles = gridDim.x;
  const float* tm = a.tile_max + static_cast<long long>(bh) * ntiles;
  float mx = attn_neg_inf();
  for (int t = tid; t < ntiles; t += kLinThreads) mx = attn_max(mx, tm[t]);
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) mx = attn_max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((tid & 31) == 0) red[tid >> 5] = mx;
  __syncthreads();
  float stab = red[0];
#pragma unroll
  for (int w = 1; w < kLinThreads / 32; ++w) stab = attn_max(stab, red[w]);

  const int i0 = blockIdx.x * kLinRows;
  const int rows = attn_imin(kLinRows, a.s - i0);
  float* f = a.f + (static_cast<long long>(bh) * a.s + i0) * a.nf;
  const long long n = static_cast<long long>(rows) * a.nf;
  for (long long idx = tid; idx < n; idx += kLinThreads) f[idx] = expf(f[idx] - stab) * a.inv_sqrt_m;
}

}  // namespace gpuops
