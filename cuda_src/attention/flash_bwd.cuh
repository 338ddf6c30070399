// Flash attention backward: launch arguments, the SIMT tile shapes and tile loader
// (cuda_src/attention/flash_bwd.cu) and the dQ atomics shared with the tensor-core kernel
// (flash_bwd_mma.cu).
#pragma once
#include "attention/attn_common.cuh"
#include "common/vec.cuh"

namespace gpuops {

// Everything one backward launch needs, passed by value (graph-capturable: no device-side
// argument buffer). Layout mirrored by FLASH_BWD_ARGS in gpuops/ops/attention_backward.py
// ("12P43q10i2f"); strides in elements, logical [batch, head, seq, dim].
struct FlashBwdArgs {
  const void* q;          // [B, Hq, Sq, hd]
  const void* k;          // [B, Hkv, Sk, hd]
  const void* v;          // [B, Hkv, Sk, hd]
  const void* o;          // the forward's output [B, Hq, Sq, hd]
  const void* dout;       // gradient of o [B, Hq, Sq, hd]
  const float* lse;       // the forward's lse [B, Hq, Sq] (natural log, -inf: row saw no key)
  const void* mask;       // broadcast to [B, Hq, Sq, Sk]: bool (1 byte) or T (additive); or null
  void* dq;               // outputs, storage type T
  void* dk;
  void* dv;
  float* dq_acc;          // fp32 dq accumulator, zeroed by flash_bwd_prep (== dq when T is float)
  float* stats;           // fp32 workspace [2][B * Hq * Sq]: D_i = rowsum(dO_i * O_i), lse2_i
  // strides (b, h, s, d); ms: (b, h, i, j) with 0 where the mask broadcasts; lses: (b, h, s)
  long long qs[4], ks[4], vs[4], os[4], dos[4], ms[4], dqs[4], dks[4], dvs[4], dqas[4];
  long long lses[3];
  int batch;              // B
  int hq;                 // query heads
  int group;              // query heads per key/value head (GQA); 1 = MHA
  int sq, sk;             // query and key lengths
  int hd;                 // head dim
  int left, right;        // row i sees key j iff i - left <= j <= i + right; -1 = unbounded
  int mask_kind;          // 0 none, 1 bool (keep where true), 2 additive (T)
  int vec;                // bit 0: q, k, v, dout rows 16-byte aligned with unit d stride (16-byte
                          // loads); bit 1: dq_acc rows 16-byte aligned with unit d stride
  float scale;            // softmax scale
  float scale_log2;       // softmax scale * log2(e)
};

static_assert(sizeof(FlashBwdArgs) == 12 * 8 + 43 * 8 + 10 * 4 + 2 * 4, "FlashBwdArgs layout");

// Tile shape of the SIMT backward: BR query rows x BC key rows, head-dim width D (the head dim
// on the fast path, a chunk width on the general path), NT threads, and the thread mappings
// derived from them (tx = tid % 8, ty = tid / 8, TY = NT / 8 row groups):
//   scores S, dP [BR x BC]:  rows ty + TY r (r < RM), columns tx + 8 c (c < CN)
//   dK, dV       [BC x D]:   keys ty + TY c (c < KC), columns 4 tx + 32 k .. + 3 (k < DK)
//   dQ           [BR x D]:   rows ty + TY r (r < RM), columns 4 tx + 32 k .. + 3 (k < DK)
// Shared rows are padded by 4 floats so that the 8 lanes of a quarter warp read 8 different
// rows (or 8 consecutive 16-byte words of one row) without bank conflicts.
template <int D_, int BR_, int BC_, int NT_>
struct BwdTile {
  static constexpr int D = D_, BR = BR_, BC = BC_, NT = NT_;
  static constexpr int TY = NT / 8;
  static constexpr int RM = BR / TY, CN = BC / 8, KC = BC / TY, DK = D / 32;
  static constexpr int kLd = D + 4;      // row stride of the Q, dO, K, V tiles (floats)
  static constexpr int kLdt = BR + 4;    // row stride of the transposed P^T, dS^T tiles
  static_assert(NT % 32 == 0 && BR % TY == 0 && BC % TY == 0 && BC % 8 == 0 && D % 32 == 0 &&
                BR % 4 == 0, "tile shape");
};

// rows [r0, r0 + ROWS) x columns [c0, c0 + D) of a [rows_total, cols_total] operand (strides rs,
// cs) -> shared [ROWS][D + 4] in fp32, zeros outside the operand, by NT threads. vec: 16-byte
// loads (the host guarantees c0 = 0, cols_total = D, cs = 1 and 16-byte aligned rows).
template <class T, int ROWS, int D, int NT>
__device__ __forceinline__ void attn_load_tile(float* dst, const T* src, int r0, int rows_total,
                                               long long rs, int c0, int cols_total,
                                               long long cs, bool vec) {
  constexpr int kLd = D + 4;
  if (vec) {
    constexpr int N = Vec16<T>::size, kPer = D / N;   // values per 16 bytes, packs per row
    static_assert(D % N == 0, "packs per row");
    for (int idx = threadIdx.x; idx < ROWS * kPer; idx += NT) {
      const int r = idx / kPer, c = (idx - (idx / kPer) * kPer) * N;
      const int gr = r0 + r;
      float f[N];
      if (gr < rows_total) {
        Vec16<T>::unpack(load16(src + gr * rs + c), f);
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) f[e] = 0.0f;
      }
#pragma unroll
      for (int e = 0; e < N; e += 4)
        *reinterpret_cast<AttnF4*>(dst + r * kLd + c + e) =
            AttnF4{f[e], f[e + 1], f[e + 2], f[e + 3]};
    }
    return;
  }
  for (int idx = threadIdx.x; idx < ROWS * D; idx += NT) {
    const int r = idx / D, c = idx - (idx / D) * D;
    const int gr = r0 + r, gc = c0 + c;
    float val = 0.0f;
    if (gr < rows_total && gc < cols_total) val = to_float(src[gr * rs + gc * cs]);
    dst[r * kLd + c] = val;
  }
}

__device__ __forceinline__ float attn_f4_get(const AttnF4& v, int e) {
  return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

// The row (b, h, i) of the 16-byte-access preprocess / dq conversion: D / 8 lanes per row,
// 8 elements each, 128 / (D / 8) rows per block of 128 threads; `seq` rows per (b, h) (the
// statistics' row length: sq, or the wgmma kernel's padded length).
template <int D>
__device__ __forceinline__ long long bwd_vec_row(const FlashBwdArgs& a, int seq, int& b, int& h,
                                                 int& i) {
  constexpr int L = D / 8;
  const long long row = static_cast<long long>(blockIdx.x) * (128 / L) + threadIdx.x / L;
  const long long bh = row / seq;
  i = static_cast<int>(row - bh * seq);
  b = static_cast<int>(bh / a.hq);
  h = static_cast<int>(bh - static_cast<long long>(b) * a.hq);
  return row;
}

// The preprocess with 16-byte accesses (o, dout and dq_acc rows aligned, unit d stride): D_i =
// rowsum(dO_i O_i) and lse2_i (+inf for lse = -inf) into stats as [2][B Hq][seq] (seq >= sq;
// rows i >= sq of a padded layout get D = 0, lse2 = +inf), the dq accumulator zeroed: by its
// strides (dqas), or FLAT: as [B Hq seq][D] dense, the padding rows too (the wgmma kernel's
// tile-major accumulator).
template <class T, int D, bool FLAT = false>
__device__ __forceinline__ void bwd_prep_vec(const FlashBwdArgs& a, int seq) {
  constexpr int L = D / 8;
  static_assert(32 % L == 0, "a row's lanes within one warp");
  const long long rows = static_cast<long long>(a.batch) * a.hq * seq;
  int b, h, i;
  const long long row = bwd_vec_row<D>(a, seq, b, h, i);
  const bool live = row < rows && i < a.sq;
  const int c = (threadIdx.x % L) * 8;
  float acc = 0.0f;
  if (live) {
    float o[8], g[8];
    Vec16<T>::unpack(load16(static_cast<const T*>(a.o) + b * a.os[0] + h * a.os[1] +
                            i * a.os[2] + c), o);
    Vec16<T>::unpack(load16(static_cast<const T*>(a.dout) + b * a.dos[0] + h * a.dos[1] +
                            i * a.dos[2] + c), g);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(g[e], o[e], acc);
    if (!FLAT) {
      float* z = a.dq_acc + b * a.dqas[0] + h * a.dqas[1] + i * a.dqas[2] + c;
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      store16(z, zero);
      store16(z + 4, zero);
    }
  }
  if (FLAT && row < rows) {
    float* z = a.dq_acc + row * D + c;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    store16(z, zero);
    store16(z + 4, zero);
  }
#pragma unroll
  for (int m = L / 2; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (row < rows && threadIdx.x % L == 0) {
    a.stats[row] = acc;
    const float lse = live ? a.lse[b * a.lses[0] + h * a.lses[1] + i * a.lses[2]]
                           : attn_neg_inf();
    a.stats[rows + row] = lse == attn_neg_inf() ? -attn_neg_inf() : lse * kAttnLog2e;
  }
}

// dst[0 .. 7] = src[0 .. 7] in the storage type (16-byte loads and store: both aligned): the dq
// conversions of the tensor-core backwards.
template <class T>
__device__ __forceinline__ void bwd_convert8(T* dst, const float* src) {
  float lo[4], hi[4], f[8];
  Vec16<float>::unpack(load16(src), lo);
  Vec16<float>::unpack(load16(src + 4), hi);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    f[e] = lo[e];
    f[e + 4] = hi[e];
  }
  store16(dst, Vec16<T>::pack(f));
}

// dst[0..3] += v[0..3] (fp32 atomics; one vector reduction on sm_90, whose L2 adds 16 bytes at
// once, when vec4: the host guarantees 16-byte alignment then).
__device__ __forceinline__ void bwd_atomic_add4(float* dst, const float (&v)[4], bool vec4) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
  if (vec4) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(v[0]),
                 "f"(v[1]), "f"(v[2]), "f"(v[3])
                 : "memory");
    return;
  }
#endif
  (void)vec4;
  atomicAdd(dst, v[0]);
  atomicAdd(dst + 1, v[1]);
  atomicAdd(dst + 2, v[2]);
  atomicAdd(dst + 3, v[3]);
}

// dst[0..1] += (x, y) (fp32 atomics; one 8-byte vector reduction on sm_90 when vec2: the host
// guarantees 8-byte alignment then).
__device__ __forceinline__ void bwd_atomic_add2(float* dst, float x, float y, bool vec2) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
  if (vec2) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(x), "f"(y) : "memory");
    return;
  }
#endif
  (void)vec2;
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
}

}  // namespace gpuops
