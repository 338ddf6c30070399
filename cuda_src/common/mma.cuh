// Tensor-core building blocks for sm_80+ (mma.sync, ldmatrix, cp.async) as thin inline-PTX
// wrappers, shared by every family (gemm, attention, norms' resident plan). A module built for
// older archs too (norms) may include it and must keep its calls behind __CUDA_ARCH__ >= 800.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 / m16n8k8"), g = lane / 4,
// t = lane % 4:
//   m16n8k16 (f16/bf16): A 16x16 row-major: a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1],
//     a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9];  B 16x8: b0 = B[2t, 2t+1][g],
//     b1 = B[2t+8, 2t+9][g];  C 16x8 fp32: c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1].
//     (The lower-index element of a pair is the low half of its 32-bit register.)
//   m16n8k8 (tf32): a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4];
//     b0 = B[t][g], b1 = B[t+4][g]; C as above.
//   m16n8k32 (s8, int32 C): a0 = A[g][4t .. 4t+3], a1 = A[g+8][4t ..], a2 = A[g][4t+16 ..],
//     a3 = A[g+8][4t+16 ..]; b0 = B[4t .. 4t+3][g], b1 = B[4t+16 ..][g]; C as above.
//   With operands stored K-major in rows of 16-byte chunks, one ldmatrix.x4 address pattern gives
//   all three (a 32-bit word of a b16 pair = one fp32 = four int8).
//   ldmatrix.x4: lanes 8i .. 8i+7 give the row addresses of 8x8 b16 matrix i; lane l receives
//     in register i the elements (row l / 4, columns 2 (l % 4), +1) of matrix i, or with .trans
//     the elements (rows 2 (l % 4), +1, column l / 4).
//   The C fragment of one m16n8 tile pair (n8 tiles 2j, 2j+1) has exactly the layout of the A
//   fragment of m16n8k16 for k = 16j .. 16j+15: attention reuses S = Q K^T as P for P V in
//   registers (pack_b16x2 packs c0, c1 -> a0 etc.).
//
// Host C++ (no __CUDACC_RTC__): the CPU emulator of tests/emu.py compiles kernels with g++ and
// tests/cuda_emu/emu.h; there every wrapper below is emulated with the PTX semantics: warp-wide
// instructions (ldmatrix, mma) exchange operands through a per-warp scratch at the warp's barrier,
// shared addresses are offsets into the block's dynamic shared memory, and cp.async copies are
// deferred to the cp.async.wait_group that covers them (a kernel that reads a tile too early reads
// stale data there, as it may on the GPU).
#pragma once
#include "common/dtypes.cuh"

namespace gpuops {

// ---------------------------------------------------------------------------------------------
// Device (NVRTC)
#ifdef __CUDACC_RTC__

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

// 4 bytes global -> shared (per-row statistics that are not 16-byte aligned); bytes past
// src_bytes (0 or 4) are zero-filled.
__device__ __forceinline__ void cp_async4(unsigned int dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

// D = A * B + D for one 16x8x16 (f16/bf16), 16x8x8 (tf32) or 16x8x32 (s8) tile: Mma<T>::run
// with kK the tile's K and Acc the accumulator type. The four specializations differ only in the
// instruction's shape and types and in the accumulator's register class, so one macro writes
// them (an asm string must be a literal).
template <class T>
struct Mma;

#define GPUOPS_MMA_16x8(T, K, ACC, ACC_REG, SHAPE_TYPES)                                    \
  template <>                                                                              \
  struct Mma<T> {                                                                          \
    static constexpr int kK = K;                                                           \
    using Acc = ACC;                                                                       \
    __device__ __forceinline__ static void run(ACC (&d)[4], const unsigned int (&a)[4],    \
                                               unsigned int b0, unsigned int b1) {         \
      asm volatile("mma.sync.aligned." SHAPE_TYPES " {%0, %1, %2, %3}, "                   \
                   "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"                          \
                   : "+" ACC_REG(d[0]), "+" ACC_REG(d[1]), "+" ACC_REG(d[2]),              \
                     "+" ACC_REG(d[3])                                                     \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));        \
    }                                                                                      \
  };

GPUOPS_MMA_16x8(bfloat16_t, 16, float, "f", "m16n8k16.row.col.f32.bf16.bf16.f32")
GPUOPS_MMA_16x8(float16_t, 16, float, "f", "m16n8k16.row.col.f32.f16.f16.f32")
// fp32 storage multiplied as TF32 (only when the caller allows it: allow_tf32=True).
GPUOPS_MMA_16x8(float, 8, float, "f", "m16n8k8.row.col.f32.tf32.tf32.f32")
// int8 x int8 with exact int32 accumulation (int8_matmul on sm_80+).
GPUOPS_MMA_16x8(signed char, 32, int, "r", "m16n8k32.row.col.s32.s8.s8.s32")
#undef GPUOPS_MMA_16x8

// fp32 bits -> TF32 rounded to nearest (ties away), as cuBLAS does; the tensor core would
// otherwise truncate the low mantissa bits, a biased error.
__device__ __forceinline__ unsigned int to_tf32(unsigned int x) {
  unsigned int r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(__uint_as_float(x)));
  return r;
}

// Two fp32 -> one register of two f16/bf16 (round to nearest even; lo in the low half): an A or
// B fragment word.
template <class T>
__device__ __forceinline__ unsigned int pack_b16x2(float lo, float hi);

template <>
__device__ __forceinline__ unsigned int pack_b16x2<bfloat16_t>(float lo, float hi) {
  unsigned int r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

template <>
__device__ __forceinline__ unsigned int pack_b16x2<float16_t>(float lo, float hi) {
  unsigned int r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// ---------------------------------------------------------------------------------------------
// Host C++: the CPU emulator (tests/cuda_emu/emu.h provides emu::warp_collective, the shared
// window and the cp.async queues).
#else

inline unsigned int smem_addr(const void* p) { return emu::shared_offset(p); }

namespace mma_host {
// lane l, register i <- matrix i: (row l / 4, columns 2 (l % 4), +1), or with trans
// (rows 2 (l % 4), +1, column l / 4); row addresses from lanes 8i .. 8i + 7.
inline void ldmatrix(unsigned int (&r)[4], unsigned int addr, bool trans) {
  const unsigned int mine[1] = {addr};
  emu::warp_collective(mine, 1, [&](const unsigned int (*s)[emu::kScratchWords], int lane) {
    for (int i = 0; i < 4; ++i) {
      if (!trans) {
        std::memcpy(&r[i], emu::shared_ptr(s[8 * i + lane / 4][0], 16) + 4 * (lane % 4), 4);
      } else {
        unsigned short lo, hi;
        std::memcpy(&lo, emu::shared_ptr(s[8 * i + 2 * (lane % 4)][0], 16) + 2 * (lane / 4), 2);
        std::memcpy(&hi, emu::shared_ptr(s[8 * i + 2 * (lane % 4) + 1][0], 16) + 2 * (lane / 4), 2);
        r[i] = static_cast<unsigned int>(lo) | static_cast<unsigned int>(hi) << 16;
      }
    }
  });
}

// D += A B for one m16n8kK tile; E elements per 32-bit register, decode(word, index) -> value.
// A(r, k): lane (r % 8) * 4 + (k % 4E) / E, register r / 8 + 2 (k / 4E); B(k, n): lane
// n * 4 + (k % 4E) / E, register k / 4E (the layouts in the header comment).
template <int E, class Acc, class Decode>
inline void mma(Acc (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1,
                Decode decode) {
  const unsigned int mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  emu::warp_collective(mine, 6, [&](const unsigned int (*s)[emu::kScratchWords], int lane) {
    constexpr int KB = 4 * E, K = 2 * KB;
    const int g = lane / 4, t = lane % 4;
    for (int idx = 0; idx < 4; ++idx) {
      const int r = g + 8 * (idx / 2), n = 2 * t + idx % 2;
      Acc acc = d[idx];
      for (int k = 0; k < K; ++k) {
        const unsigned int aw = s[(r % 8) * 4 + (k % KB) / E][r / 8 + 2 * (k / KB)];
        const unsigned int bw = s[n * 4 + (k % KB) / E][4 + k / KB];
        if constexpr (std::is_floating_point_v<Acc>)
          acc = std::fma(decode(aw, k % E), decode(bw, k % E), acc);
        else
          acc += decode(aw, k % E) * decode(bw, k % E);
      }
      d[idx] = acc;
    }
  });
}
}  // namespace mma_host

inline void ldmatrix_x4(unsigned int (&r)[4], unsigned int addr) { mma_host::ldmatrix(r, addr, false); }
inline void ldmatrix_x4_trans(unsigned int (&r)[4], unsigned int addr) { mma_host::ldmatrix(r, addr, true); }

inline void cp_async16(unsigned int dst, const void* src, int src_bytes) {
  emu::cp_async(emu::shared_ptr(dst, 16), src, src_bytes, 16);
}
inline void cp_async4(unsigned int dst, const void* src, int src_bytes) {
  emu::cp_async(emu::shared_ptr(dst, 4), src, src_bytes, 4);
}
inline void cp_async_commit() { emu::cp_async_commit(); }
template <int N>
inline void cp_async_wait() { emu::cp_async_wait(N); }

template <class T>
struct Mma;

template <>
struct Mma<bfloat16_t> {
  static constexpr int kK = 16;
  using Acc = float;
  static void run(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    mma_host::mma<2>(d, a, b0, b1, [](unsigned int w, int i) {
      return to_float(bfloat16_t{static_cast<unsigned short>(w >> (16 * i))});
    });
  }
};

template <>
struct Mma<float16_t> {
  static constexpr int kK = 16;
  using Acc = float;
  static void run(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    mma_host::mma<2>(d, a, b0, b1, [](unsigned int w, int i) {
      return to_float(float16_t{static_cast<unsigned short>(w >> (16 * i))});
    });
  }
};

template <>
struct Mma<float> {
  static constexpr int kK = 8;
  using Acc = float;
  static void run(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    // the tensor core reads only the TF32 bits (sign, exponent, 10 mantissa bits)
    mma_host::mma<1>(d, a, b0, b1, [](unsigned int w, int) { return __uint_as_float(w & 0xffffe000u); });
  }
};

template <>
struct Mma<signed char> {
  static constexpr int kK = 32;
  using Acc = int;
  static void run(int (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    mma_host::mma<4>(d, a, b0, b1, [](unsigned int w, int i) {
      return static_cast<int>(static_cast<signed char>(w >> (8 * i)));
    });
  }
};

inline unsigned int to_tf32(unsigned int x) {
  if ((x & 0x7f800000u) == 0x7f800000u) return x;       // inf, NaN: unchanged
  return (x + 0x1000u) & 0xffffe000u;                    // nearest, ties away from zero
}

template <class T>
inline unsigned int pack_b16x2(float lo, float hi) {
  return static_cast<unsigned int>(from_float<T>(lo).bits) |
         static_cast<unsigned int>(from_float<T>(hi).bits) << 16;
}

#endif

// Hint: bring the 128-byte line at p into L2 (no register result). Host C++ (the CPU kernel
// emulator): a no-op, there is nothing to emulate.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef __CUDACC_RTC__
  asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
#else
  (void)p;
#endif
}

// 16 bytes global -> shared for kernels built for every arch (norms' resident plan,
// group_norm_stream): cp.async on sm_80+ (complete at the copy_async_wait that covers it;
// copy_async_commit closes a group), below sm_80 a load and a store through registers (complete
// at once; commit and wait are no-ops). !in: the 16 bytes are zero-filled, nothing is read.
template <class Raw>
__device__ __forceinline__ void copy16_to_shared(Raw* dst, const void* src, bool in = true) {
  static_assert(sizeof(Raw) == 16, "16-byte units");
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ < 800
  *dst = in ? *reinterpret_cast<const Raw*>(src) : Raw{};
#else
  cp_async16(smem_addr(dst), src, in ? 16 : 0);
#endif
}

__device__ __forceinline__ void copy_async_commit() {
#if !defined(__CUDACC_RTC__) || __CUDA_ARCH__ >= 800
  cp_async_commit();
#endif
}

// Waits until at most `pending` of this thread's committed copy groups are outstanding (the
// instruction takes an immediate: pending 0 .. 6, larger waits for at most 7).
__device__ __forceinline__ void copy_async_wait(int pending) {
#if !defined(__CUDACC_RTC__) || __CUDA_ARCH__ >= 800
  switch (pending) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default: cp_async_wait<7>(); break;
  }
#endif
}

}  // namespace gpuops
