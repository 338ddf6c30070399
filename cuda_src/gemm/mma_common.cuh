// Tensor-core building blocks for sm_80+ (mma.sync, ldmatrix, cp.async), as thin inline-PTX
// wrappers. Only modules declared for archs >= 80 include this file.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 / m16n8k8"), g = lane / 4,
// t = lane % 4:
//   m16n8k16 (f16/bf16): A 16x16 row-major: a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1],
//     a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9];  B 16x8: b0 = B[2t, 2t+1][g],
//     b1 = B[2t+8, 2t+9][g];  C 16x8 fp32: c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1].
//   m16n8k8 (tf32): a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4];
//     b0 = B[t][g], b1 = B[t+4][g]; C as above.
//   m16n8k32 (s8, int32 C): a0 = A[g][4t .. 4t+3], a1 = A[g+8][4t ..], a2 = A[g][4t+16 ..],
//     a3 = A[g+8][4t+16 ..]; b0 = B[4t .. 4t+3][g], b1 = B[4t+16 ..][g]; C as above.
//   With operands stored K-major in rows of 16-byte chunks, one ldmatrix.x4 address pattern gives
//   all three (a 32-bit word of a b16 pair = one fp32 = four int8).
//   ldmatrix.x4: lanes 8i .. 8i+7 give the row addresses of 8x8 b16 matrix i; lane l receives
//     in register i the elements (row l / 4, columns 2 (l % 4), +1) of matrix i, or with .trans
//     the elements (rows 2 (l % 4), +1, column l / 4).
#pragma once

namespace gpuops {
namespace gemm {

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
  unsigned int r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], unsigned int addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int (&r)[4], unsigned int addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// 16 bytes global -> shared without registers; bytes past src_bytes (0..16) are zero-filled.
__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

// D = A * B + D for one 16x8x16 (f16/bf16) or 16x8x8 (tf32) tile, fp32 accumulators.
template <class T>
struct Mma;

template <>
struct Mma<bfloat16_t> {
  static constexpr int kK = 16;
  using Acc = float;
  __device__ __forceinline__ static void run(float (&d)[4], const unsigned int (&a)[4],
                                             unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Mma<float16_t> {
  static constexpr int kK = 16;
  using Acc = float;
  __device__ __forceinline__ static void run(float (&d)[4], const unsigned int (&a)[4],
                                             unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// fp32 storage multiplied as TF32 (only when the caller allows it: allow_tf32=True).
template <>
struct Mma<float> {
  static constexpr int kK = 8;
  using Acc = float;
  __device__ __forceinline__ static void run(float (&d)[4], const unsigned int (&a)[4],
                                             unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// int8 x int8 with exact int32 accumulation (int8_matmul on sm_80+).
template <>
struct Mma<signed char> {
  static constexpr int kK = 32;
  using Acc = int;
  __device__ __forceinline__ static void run(int (&d)[4], const unsigned int (&a)[4],
                                             unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// fp32 bits -> TF32 rounded to nearest (ties away), as cuBLAS does; the tensor core would
// otherwise truncate the low mantissa bits, a biased error.
__device__ __forceinline__ unsigned int to_tf32(unsigned int x) {
  unsigned int r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(__uint_as_float(x)));
  return r;
}

// ---------------------------------------------------------------------------------------------
// Added by the mma main-loop rework (issue 4, branch perf-gemm-mma), kept apart from the generic
// wrappers above so that moving those to common/ stays a plain move.

// Hint: bring the 128-byte line at p into L2 (no register result). Compiled as host C++ (the CPU
// kernel emulator) it is a no-op: there is nothing to emulate.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
  asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
#else
  (void)p;
#endif
}

}  // namespace gemm
}  // namespace gpuops
