// Helpers of the O(N) and structured attention variants (linear_attention, kernelized_attention,
// multiscale_attention; gpuops/ops/attention_variants.py): feature maps, argument structs and the
// fp32 tile loads their SIMT kernels share. Math in fp32 for fp32/fp16/bf16 storage.
#pragma once
#include "attention/attn_common.cuh"

namespace gpuops {

// Feature maps phi of linear attention, applied to every element of q and k.
enum LinFeature : int {
  kLinIdentity = 0,   // phi(x) = x
  kLinElu = 1,        // phi(x) = elu(x) + 1 = x + 1 (x > 0), exp(x) (x <= 0): positive
  kLinRelu = 2,       // phi(x) = max(x, 0)
};

template <int FM>
__device__ __forceinline__ float lin_feature(float x) {
  if (FM == kLinElu) return x > 0.0f ? x + 1.0f : expf(x);   // accurate expf (< 2 ulp)
  if (FM == kLinRelu) return x > 0.0f ? x : 0.0f;
  return x;
}

constexpr int kLinThreads = 128;   // every kernel of linear_attention.cu / favor_features.cu
constexpr int kLinRows = 64;       // rows (queries or keys) per tile: the chunk of causal mode
constexpr int kLinDt = 32;         // feature columns per step of the output kernel's loop
constexpr int kLinCols = 64;       // value columns (and state rows) per block

// One launch of the linear-attention kernels, passed by value (graph capturable). Layout
// mirrored by LIN_ARGS in gpuops/ops/attention_variants.py ("5P16q9if").
//
// The state records: for every (batch, kv head) `nchunks` records of `dk * (dv + 1)` floats,
// record c = [S_c (dk x dv, row-major), z_c (dk)] with S_c = sum phi(k_j) v_j^T and
// z_c = sum phi(k_j) over the keys j of chunk c (rows [c * chunk_rows, (c + 1) * chunk_rows)).
struct LinAttnArgs {
  const void* q;          // [B, Hq, Sq, dk] (features: phi is applied on load)
  const void* k;          // [B, Hkv, Sk, dk]
  const void* v;          // [B, Hkv, Sk, dv]
  void* o;                // [B, Hq, Sq, dv]
  float* state;           // [B * Hkv, nchunks, dk * (dv + 1)] fp32 workspace
  long long qs[4], ks[4], vs[4], os[4];   // strides (b, h, s, d) in elements
  int hq, hkv;            // query heads, key/value heads
  int group;              // query heads per key/value head (GQA)
  int sq, sk;             // query and key lengths
  int dk, dv;             // feature (key) dim, value dim
  int nchunks;            // state records per (batch, kv head)
  int chunk_rows;         // key rows per record (a multiple of kLinRows)
  float eps;              // added to the denominator
};

static_assert(sizeof(LinAttnArgs) == 5 * 8 + 16 * 8 + 9 * 4 + 4, "LinAttnArgs layout");

// rows [r0, r0 + ROWS) x columns [c0, c0 + COLS) of a [rows, cols] operand (strides rs, cs)
// -> shared [ROWS][LD] fp32 with phi applied; zeros outside the operand (after phi: elu's
// phi(0) = 1 must not leak into sums through padding).
template <int FM, int ROWS, int COLS, int LD, class T>
__device__ __forceinline__ void lin_load_tile(float* dst, const T* src, int r0, int rows,
                                              long long rs, int c0, int cols, long long cs) {
  static_assert((COLS & (COLS - 1)) == 0, "COLS is a power of two");
  for (int idx = threadIdx.x; idx < ROWS * COLS; idx += kLinThreads) {
    const int r = idx / COLS, c = idx & (COLS - 1);
    const int gr = r0 + r, gc = c0 + c;
    float val = 0.0f;
    if (gr < rows && gc < cols)
      val = lin_feature<FM>(to_float(src[static_cast<long long>(gr) * rs +
                                         static_cast<long long>(gc) * cs]));
    dst[r * LD + c] = val;
  }
}

__device__ __forceinline__ AttnF4 lin_ld4(const float* p) {
  return *reinterpret_cast<const AttnF4*>(p);
}

__device__ __forceinline__ float lin_dot4(const AttnF4& a, const AttnF4& b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

__device__ __forceinline__ float lin_comp(const AttnF4& a, int e) {
  return e == 0 ? a.x : e == 1 ? a.y : e == 2 ? a.z : a.w;
}

// acc[0..3] += p * (b.x, b.y, b.z, b.w)
__device__ __forceinline__ void lin_axpy4(float (&acc)[4], float p, const AttnF4& b) {
  acc[0] = fmaf(p, b.x, acc[0]);
  acc[1] = fmaf(p, b.y, acc[1]);
  acc[2] = fmaf(p, b.z, acc[2]);
  acc[3] = fmaf(p, b.w, acc[3]);
}

// ---------------------------------------------------------------------------------------------
// kernelized_attention's random features (favor_features.cu). Layout mirrored by FAVOR_ARGS
// ("4P4q6i2f").
struct FavorArgs {
  const void* x;          // [B, H, S, D] queries or keys
  const float* w;         // [m, D] random directions, contiguous
  float* f;               // [B * H, S, nf] features (nf = m softmax, 2m rbf), contiguous
  float* tile_max;        // [B * H, ceil(S / kLinRows)] per-tile max of the log-features (keys)
  long long xs[4];        // strides of x (b, h, s, d) in elements
  int h, s, d, m;         // heads, rows, head dim, random features
  int nf;                 // features per row written
  int per_row;            // 1: stabilize each row by its own max (queries); 0: per-tile max out
  float xscale;           // x' = x * xscale (sqrt(scale))
  float inv_sqrt_m;       // 1 / sqrt(m)
};

static_assert(sizeof(FavorArgs) == 4 * 8 + 4 * 8 + 6 * 4 + 2 * 4, "FavorArgs layout");

// ---------------------------------------------------------------------------------------------
// multiscale_attention (multiscale_attention.cu). Layout mirrored by MS_ARGS ("4P16q8i32if").
constexpr int kMsMaxScales = 16;

struct MultiscaleArgs {
  const void* q;          // [B, Hq, Sq, D]
  const void* k;          // [B, Hkv, Sk, D]
  const void* v;          // [B, Hkv, Sk, D]
  void* o;                // [B, Hq, Sq, D]
  long long qs[4], ks[4], vs[4], os[4];
  int hq;                 // query heads
  int group;              // query heads per key/value head (GQA)
  int heads_per_scale;    // Hq / len(windows): head h uses scale h / heads_per_scale
  int sq, sk, hd;         // lengths, head dim
  int causal;             // 1: keys j <= i only
  int pad_;
  int window[kMsMaxScales];     // w_g: keys i - w d .. i + w d
  int dilation[kMsMaxScales];   // d_g: every d-th key
  float scale_log2;       // softmax scale * log2(e)
};

static_assert(sizeof(MultiscaleArgs) == 4 * 8 + 16 * 8 + 8 * 4 + 32 * 4 + 4 + 4,
              "MultiscaleArgs layout");

}  // namespace gpuops
