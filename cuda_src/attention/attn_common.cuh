// Helpers of the attention kernels (flash forward; later the backward and the tensor-core forms).
//
// Scores live in the log2 domain: s2 = (q . k) * scale * log2(e) (+ mask * log2(e)), so the
// softmax needs one MUFU.EX2 per score and the log-sum-exp is (m2 + log2(l)) * ln(2).
#pragma once
#include "common/dtypes.cuh"

namespace gpuops {

constexpr float kAttnLog2e = 1.4426950408889634f;
constexpr float kAttnLn2 = 0.69314718055994531f;

// 16-byte shared-memory word (LDS.128): four fp32 values of one tile row.
struct __align__(16) AttnF4 {
  float x, y, z, w;
};

// Everything one flash-forward launch needs, passed by value (no device-side argument buffer,
// so the launch can be captured in a CUDA graph). Layout mirrored by FLASH_ARGS in
// gpuops/ops/attention.py ("6P20q9if5P11q6i"); strides in elements, logical [batch, head, seq,
// dim]. Fields after scale_log2 were appended for varlen, block-sparse and rotary attention
// (issue 5); null / 0 switches each off, and a kernel that does not support one leaves it alone.
struct FlashFwdArgs {
  const void* q;          // [B, Hq, Sq, hd]
  const void* k;          // [B, Hkv, Sk, hd]
  const void* v;          // [B, Hkv, Sk, hd]
  const void* mask;       // broadcast to [B, Hq, Sq, Sk]: bool (1 byte) or T (additive); or null
  void* o;                // [B, Hq, Sq, hd]
  float* lse;             // natural log, strides ls; or null (not wanted)
  // strides (b, h, s, d); ms: (b, h, i, j) with 0 where the mask broadcasts
  long long qs[4], ks[4], vs[4], os[4], ms[4];
  int hq;                 // query heads
  int group;              // query heads per key/value head (GQA); 1 = MHA
  int sq, sk;             // query and key lengths (varlen: the maxima, for information)
  int hd;                 // head dim
  int left, right;        // row i sees key j iff d - left <= j <= d + right (d: the row's
                          // diagonal, see bottom_right); -1 = unbounded
  int mask_kind;          // 0 none, 1 bool (keep where true), 2 additive (T)
  int vec;                // 1: q, k, v rows are 16-byte aligned with unit d stride (16-byte loads)
  float scale_log2;       // softmax scale * log2(e)
  // --- varlen: packed sequences. Sequence b is rows [cu_q[b], cu_q[b + 1]) of q / o / lse and
  // [cu_k[b], cu_k[b + 1]) of k / v (the b strides are then 0); blocks past its end exit.
  const int* cu_q;        // [B + 1] on the device, or null (dense)
  const int* cu_k;        // [B + 1], or null
  // --- block sparsity: key tiles whose (query block, key block) entries are all off are skipped
  const unsigned char* block_mask;  // bool [B|1, H|1, ceil(Sq/bs), ceil(Sk/bs)], or null
  // --- rotary embedding of q and k as they are loaded (positions = sequence index)
  const void* rot_cos;    // [rows, rot_half] in T or float32, or null
  const void* rot_sin;    // same shape and dtype
  long long ls[3];        // lse strides (b, h, i)
  long long bms[4];       // block_mask strides (b, h, query block, key block), 0 = broadcast
  long long rcs[2], rss[2];  // cos / sin strides (row, frequency)
  int bottom_right;       // 1: row i's diagonal is i + sk - sq (FlashAttention's varlen); 0: i
  int block_size;         // block edge of block_mask in rows and keys (> 0 when block_mask set)
  int rot_half;           // rotary_dim / 2 (pairs per head); 0 = no rotary
  int rot_interleaved;    // 0: GPT-NeoX pairs (f, f + rot_half); 1: GPT-J pairs (2f, 2f + 1)
  int rot_f32;            // 1: the tables are float32; 0: they are T
  int rot_rows;           // rows of the tables (a position past them reads NaN)
};

static_assert(sizeof(FlashFwdArgs) == 6 * 8 + 20 * 8 + 9 * 4 + 4 + 5 * 8 + 11 * 8 + 6 * 4,
              "FlashFwdArgs layout");

__device__ __forceinline__ int attn_imin(int x, int y) { return x < y ? x : y; }
__device__ __forceinline__ int attn_imax(int x, int y) { return x > y ? x : y; }

__device__ __forceinline__ float attn_neg_inf() { return -__int_as_float(0x7f800000); }

// max that keeps NaN (a NaN score makes its row NaN, as torch's softmax). sm_80+: max.NaN.f32,
// one FMNMX.NAN instead of FSETP + FSETP.NAN + FSEL, a 3-deep chain per step of a row max.
__device__ __forceinline__ float attn_max(float a, float b) {
#if defined(__CUDACC_RTC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a > b || a != a) ? a : b;
#endif
}

// 2^x: MUFU.EX2 (relative error < 2^-22, -inf -> 0, results below 2^-126 flush to 0: those
// probabilities are below fp32's resolution next to the row's maximum, which is 1).
__device__ __forceinline__ float attn_exp2(float x) {
#ifdef __CUDACC_RTC__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);   // host C++ (the CPU emulator of tests/emu.py has no PTX)
#endif
}

// Block sparsity (the SIMT and the mma forward): does key tile [k0, k1) of query rows [q0, q1]
// touch a block that is on? *mixed: it also touches one that is off (then the scores are masked
// one by one). Every thread reads the same bytes.
__device__ __forceinline__ bool attn_tile_on(const unsigned char* bm, long long sqb,
                                             long long skb, int bs, int q0, int q1, int k0,
                                             int k1, bool* mixed) {
  const int qb0 = q0 / bs, qb1 = q1 / bs, kb0 = k0 / bs, kb1 = (k1 - 1) / bs;
  bool any = false, all = true;
  for (int qb = qb0; qb <= qb1; ++qb)
    for (int kb = kb0; kb <= kb1; ++kb) {
      const bool on = bm[qb * sqb + kb * skb] != 0;
      any = any || on;
      all = all && on;
    }
  *mixed = !all;
  return any;
}

// cos and sin of frequency f at position pos, from the launch's rotary tables (read straight
// from the kernel parameters: no registers held for them); NaN past the table (the host cannot
// check varlen lengths against it without reading them: a bad position shows in the output, as
// in apply_rotary)
template <class T>
__device__ __forceinline__ void attn_rope_cs(const FlashFwdArgs& a, int pos, int f, float& c,
                                             float& s) {
  if (pos >= a.rot_rows) {
    c = s = __int_as_float(0x7fc00000);
    return;
  }
  const long long oc = pos * a.rcs[0] + f * a.rcs[1], os = pos * a.rss[0] + f * a.rss[1];
  if (a.rot_f32) {
    c = static_cast<const float*>(a.rot_cos)[oc];
    s = static_cast<const float*>(a.rot_sin)[os];
  } else {
    c = to_float(static_cast<const T*>(a.rot_cos)[oc]);
    s = to_float(static_cast<const T*>(a.rot_sin)[os]);
  }
}

// Pair (x, y) of one frequency rotated by (c, s): (x c - y s, y c + x s), each with one fmaf (the
// rounding that apply_rotary, the K pre-rotation and the in-tile rotations share, so a rotated
// value is bit for bit the same whichever path computed it).
__device__ __forceinline__ void attn_rope_rotate(float& x, float& y, float c, float s) {
  const float x0 = x, y0 = y;
  x = fmaf(x0, c, -(y0 * s));
  y = fmaf(y0, c, x0 * s);
}

// Frequency, partner column and sign of element col (< 2 rot_half) of a rotated row: pair (x, y)
// of frequency f becomes (x cos - y sin, y cos + x sin), as gpuops.apply_rotary.
__device__ __forceinline__ void attn_rope_pair(const FlashFwdArgs& a, int col, int& f,
                                               int& partner, float& sign) {
  if (a.rot_interleaved) {
    f = col >> 1;
    partner = col ^ 1;
    sign = (col & 1) ? 1.0f : -1.0f;
  } else if (col < a.rot_half) {
    f = col;
    partner = col + a.rot_half;
    sign = -1.0f;
  } else {
    f = col - a.rot_half;
    partner = f;
    sign = 1.0f;
  }
}

}  // namespace gpuops
