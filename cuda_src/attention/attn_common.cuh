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
// gpuops/ops/attention.py ("6P20q8if"); strides in elements, logical [batch, head, seq, dim].
struct FlashFwdArgs {
  const void* q;          // [B, Hq, Sq, hd]
  const void* k;          // [B, Hkv, Sk, hd]
  const void* v;          // [B, Hkv, Sk, hd]
  const void* mask;       // broadcast to [B, Hq, Sq, Sk]: bool (1 byte) or T (additive); or null
  void* o;                // [B, Hq, Sq, hd]
  float* lse;             // [B * Hq, Sq] contiguous, natural log; or null (not wanted)
  // strides (b, h, s, d); ms: (b, h, i, j) with 0 where the mask broadcasts
  long long qs[4], ks[4], vs[4], os[4], ms[4];
  int hq;                 // query heads
  int group;              // query heads per key/value head (GQA); 1 = MHA
  int sq, sk;             // query and key lengths
  int hd;                 // head dim
  int left, right;        // row i sees key j iff i - left <= j <= i + right; -1 = unbounded
  int mask_kind;          // 0 none, 1 bool (keep where true), 2 additive (T)
  int vec;                // 1: q, k, v rows are 16-byte aligned with unit d stride (16-byte loads)
  float scale_log2;       // softmax scale * log2(e)
};

static_assert(sizeof(FlashFwdArgs) == 6 * 8 + 20 * 8 + 9 * 4 + 4, "FlashFwdArgs layout");

__device__ __forceinline__ int attn_imin(int x, int y) { return x < y ? x : y; }
__device__ __forceinline__ int attn_imax(int x, int y) { return x > y ? x : y; }

__device__ __forceinline__ float attn_neg_inf() { return -__int_as_float(0x7f800000); }

// max that keeps NaN (a NaN score makes its row NaN, as torch's softmax)
__device__ __forceinline__ float attn_max(float a, float b) { return (a > b || a != a) ? a : b; }

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

}  // namespace gpuops
