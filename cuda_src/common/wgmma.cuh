// Hopper (sm_90a) building blocks, as thin inline-PTX wrappers: TMA tensor loads and stores,
// warpgroup MMA (wgmma.mma_async) with shared-memory matrix descriptors, setmaxnreg. Only
// modules declared for archs ("90a",) include this file.
//
// Facts this file relies on (PTX ISA 8.x, "Asynchronous Warpgroup Level Matrix Instructions",
// "Tensor Copy", "mbarrier"):
//  * wgmma.mma_async.m64nNk16 (f16/bf16 in, f32 accumulate): a warpgroup (4 warps) multiplies a
//    64x16 tile of A by a 16xN tile of B, both read from shared memory through 64-bit matrix
//    descriptors. Accumulator fragment (N/2 fp32 per thread), warp w of the warpgroup, g = lane/4,
//    t = lane%4: d[4j + 0, 1] = D[16w + g][8j + 2t, +1], d[4j + 2, 3] = D[16w + g + 8][8j + 2t, +1].
//  * imm-trans-a / imm-trans-b = 0: the operand is K-major in shared memory (K contiguous);
//    1: M-/N-major (allowed for f16/bf16 only).
//  * Matrix descriptor: bits 0-13 start address >> 4, 16-29 leading byte offset (LBO) >> 4,
//    32-45 stride byte offset (SBO) >> 4, 49-51 base offset (0: swizzle pattern starts on a
//    1024-byte boundary), 62-63 swizzle mode (1 = 128-byte swizzle).
//  * 128-byte swizzle: rows of 128 bytes, 8-row atoms of 1024 bytes; within an atom the 16-byte
//    chunk c of row r sits at chunk position c ^ r (address bits 4-6 ^= bits 7-9). TMA with
//    CU_TENSOR_MAP_SWIZZLE_128B writes a box whose inner extent is 128 bytes in exactly this
//    layout (row r of the box at r * 128 bytes, the swizzle taken from the shared address, so
//    destinations are 1024-byte aligned).
//    K-major canonical layout (in 16-byte units T = 8 elements): ((8, m), (T, 2k)) :
//      ((8T, SBO), (1, T)) -> rows of 128 bytes, SBO = 1024 (next 8 rows), LBO unused (1); the
//      k16 steps inside a 64-element row are start-address offsets of 32 bytes.
//    MN-major canonical layout: ((T, 8, m), (8, k)) : ((1, T, LBO), (8T, SBO)) -> 64 contiguous
//      M/N elements per 128-byte row (one row per k), SBO = 1024 (next 8 k rows), LBO = offset of
//      the next 64 M/N elements (the next TMA box: 64 x 64 elements = 8192 bytes).
//  * mbarrier phases: try_wait.parity(P) succeeds once the phase with parity P has completed; a
//    fresh barrier is in phase 0, so waiting for parity 1 passes at once ("previous phase done").
#pragma once
#include "common/dtypes.cuh"

namespace gpuops {

// A CUtensorMap (cuda.h), opaque: encoded on the host (gpuops/runtime/tma.py) and passed as a
// __grid_constant__ kernel parameter, whose generic address TMA instructions take.
struct __align__(64) TmaDesc {
  unsigned long long opaque[16];
};

__device__ __forceinline__ unsigned int smem_u32(const void* p) {
  return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

// ------------------------------------------------------------------------------------ mbarrier

__device__ __forceinline__ void mbar_init(unsigned int bar, unsigned int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

// Makes the initialized barriers visible to the async proxy (TMA) and the other threads (with
// the __syncthreads that follows). mbarrier.init is a generic-proxy write to shared memory and
// TMA's complete_tx reaches the barrier through the async proxy: besides
// fence.mbarrier_init (whose PTX scope is the cluster's view of the init), a
// fence.proxy.async.shared::cta orders the init before any async-proxy access of this CTA's
// shared memory ("Accessing the same memory location across multiple proxies needs a
// cross-proxy fence", PTX ISA "Async Proxy"); CUTLASS / DeepGEMM issue both.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Orders this thread's earlier generic-proxy writes to shared memory (st.shared) before later
// async-proxy reads of it (wgmma operands, TMA stores): needed where shared memory that wgmma
// reads is filled by ordinary stores instead of TMA (the probes of gemm/wgmma_probe.cu).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// One box of a 3-D tensor map from shared memory at `src` to global memory (coordinates innermost
// first), in this thread's open bulk group. Elements of the box outside the tensor are not
// written: the tensor's extents clip ragged tiles.
__device__ __forceinline__ void tma_store_3d(const TmaDesc* desc, unsigned int src, int c0, int c1,
                                             int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];"
      :: "l"(reinterpret_cast<unsigned long long>(desc)), "r"(src), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// global[dst .. dst + bytes) += shared[src .. src + bytes) as fp32, element by element (one bulk
// reduction, performed at L2), in this thread's open bulk group: both addresses 16-byte aligned,
// bytes a multiple of 16. The source may be rewritten after bulk_wait_read.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, unsigned int src,
                                                    unsigned int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(reinterpret_cast<unsigned long long>(dst)), "r"(src), "r"(bytes)
               : "memory");
}

// Closes this thread's open bulk group (an empty group when it issued nothing).
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until at most N of this thread's committed bulk groups still read their shared source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}

// Waits until at most N of this thread's committed bulk groups are incomplete (writes done).
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}

// The producer's arrival: one arrive, and `bytes` more expected from TMA before the phase ends.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned int bar, unsigned int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned int bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(unsigned int bar, unsigned int parity) {
  unsigned int done;
  asm volatile(
      "{\n .reg .pred p;\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}

// Blocks until the phase of parity `parity` has completed (try_wait suspends in hardware for a
// while before it returns false, so this loop does not hammer the barrier).
__device__ __forceinline__ void mbar_wait(unsigned int bar, unsigned int parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// Named barrier `id` (1..15; 0 is __syncthreads) of `count` threads (a multiple of 32): the
// consumer warpgroups synchronize among themselves while the producer warp runs on.
__device__ __forceinline__ void named_bar_sync(unsigned int id, unsigned int count) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}

// Arrives at named barrier `id` of `count` threads without waiting for it (the other side
// syncs): one warpgroup hands the tensor cores to another (attention's ping-pong schedule).
__device__ __forceinline__ void named_bar_arrive(unsigned int id, unsigned int count) {
  asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");
}

// ------------------------------------------------------------------------------------ TMA

__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* desc) {
  asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<unsigned long long>(desc))
               : "memory");
}

// One box of a 2-D / 5-D tensor map into shared memory at `dst`, completing its bytes on the
// mbarrier `bar`. Coordinates are element indices, innermost first; elements outside the tensor
// are written as zeros (and still count towards the bytes).
__device__ __forceinline__ void tma_load_2d(unsigned int dst, const TmaDesc* desc, unsigned int bar,
                                            int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];"
      :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(desc)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void tma_load_5d(unsigned int dst, const TmaDesc* desc, unsigned int bar,
                                            int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
      :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(desc)), "r"(c0), "r"(c1), "r"(c2),
         "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}

// `bytes` contiguous bytes from global memory at `src` into shared memory at `dst` (a 1-D bulk
// copy, no tensor map), completing on `bar`: both addresses 16-byte aligned, bytes a multiple
// of 16.
__device__ __forceinline__ void bulk_load_1d(unsigned int dst, const void* src, unsigned int bytes,
                                             unsigned int bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(src)), "r"(bytes), "r"(bar)
      : "memory");
}

// One box of a 4-D tensor map (attention's [B, H, S, D] operands, any order of strides) into
// shared memory at `dst`, completing on `bar`; out-of-range elements arrive as zeros.
__device__ __forceinline__ void tma_load_4d(unsigned int dst, const TmaDesc* desc, unsigned int bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];"
      :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(desc)), "r"(c0), "r"(c1), "r"(c2),
         "r"(c3), "r"(bar)
      : "memory");
}

// One box of a 4-D tensor map from shared memory at `src` to global memory, in this thread's
// open bulk group; elements outside the tensor are not written.
__device__ __forceinline__ void tma_store_4d(const TmaDesc* desc, unsigned int src, int c0, int c1,
                                             int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
      :: "l"(reinterpret_cast<unsigned long long>(desc)), "r"(src), "r"(c0), "r"(c1), "r"(c2),
         "r"(c3)
      : "memory");
}

// ------------------------------------------------------------------------------------ registers

// Warpgroup-wide register reallocation (every warp of the warpgroup executes it): the producer
// gives registers back, the consumers take them.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(N));
}

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(N));
}

// ------------------------------------------------------------------------------------ wgmma

// 128-byte-swizzled shared-memory matrix descriptor (see the top of this file); lbo/sbo in bytes.
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned int saddr, unsigned int lbo,
                                                         unsigned int sbo) {
  return static_cast<unsigned long long>((saddr & 0x3FFFFu) >> 4) |
         (static_cast<unsigned long long>((lbo & 0x3FFFFu) >> 4) << 16) |
         (static_cast<unsigned long long>((sbo & 0x3FFFFu) >> 4) << 32) |
         (1ull << 62);
}

// Descriptor constants of one operand tile as TMA lays it out (128-byte swizzle, 64 k-elements
// of 16-bit data per 128-byte row; see the top of this file), in bytes: the kernel and the probes
// of gemm/wgmma_probe.cu use these same values.
//  K-major (MN = false): rows of 128 bytes (one M/N index each), LBO unused by swizzled K-major
//    layouts ("not used, assumed to be 1": the encoded 1 is 16 bytes), SBO = 8 rows x 128 B;
//    k16 step = 16 elements x 2 bytes = 32 bytes along the row (start address offset).
//  M/N-major (MN = true): 64 x 64 boxes, one 128-byte row per k; LBO = the next 64 M/N elements
//    (the next box, 8192 bytes: "offset from the first (swizzle-byte-size/16) rows to the next"),
//    SBO = the next 8 k rows (1024 bytes: "offset from the first 8 columns to the next 8");
//    k16 step = 16 k rows x 128 bytes = 2048 bytes.
template <bool MN>
struct WgOperand {
  static constexpr unsigned int kLbo = MN ? 8192u : 16u;
  static constexpr unsigned int kSbo = 1024u;
  static constexpr unsigned int kStep = MN ? 2048u : 32u;
  __device__ __forceinline__ static unsigned long long desc(unsigned int tile_saddr, int kk) {
    return wgmma_desc(tile_saddr + kk * kStep, kLbo, kSbo);
  }
};

// Orders this warpgroup's earlier register writes (the accumulators) before wgmma reads them.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Waits until at most N committed groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// wgmma_wait<N> that ptxas keeps after the computation of `after`: `after` is first stored to
// the shared-memory word at `scratch` (a slot nobody reads), and ptxas does not move the wait
// above a shared-memory store. With a plain wait between the attention forward's softmax and
// its P V product ptxas schedules the wait first (run 47 SASS); the forward uses this at D64
// (attention/flash_fwd_wgmma.cu, wga_wait_after).
template <int N>
__device__ __forceinline__ void wgmma_wait_after(float after, unsigned int scratch) {
  asm volatile(
      "st.shared.f32 [%0], %1;\n"
      " wgmma.wait_group.sync.aligned %2;"
      :: "r"(scratch), "f"(after), "n"(N) : "memory");
}

// Pins a register at this point of the program: the compiler may not move reads or writes of
// the accumulators across it (they are written asynchronously by wgmma between issue and wait).
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r) :: "memory"); }

template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) reg_fence(r[i]);
}

// The accumulator operands d[i .. i+7] of an inline wgmma ("+f": read and written).
#define GPUOPS_WG_ACC8(i)                                                                  \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]),             \
      "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

// A wrapper struct's two run() overloads, one per 16-bit input type, with the same parameters
// (__VA_ARGS__): BODY(TY) is the inline asm with the PTX type name TY ("bf16" / "f16") pasted
// into its string (an asm string must be a literal: the type cannot be a constexpr string).
#define GPUOPS_WG_RUN_16BIT(BODY, ...)                                                     \
  __device__ __forceinline__ static void run(bfloat16_t, __VA_ARGS__) { BODY("bf16"); }    \
  __device__ __forceinline__ static void run(float16_t, __VA_ARGS__) { BODY("f16"); }

#define GPUOPS_WGMMA_M64N256K16(TY)                                                          \
  asm volatile(                                                                              \
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"                                       \
      " wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {"                       \
      "%0, %1, %2, %3, %4, %5, %6, %7,"                                                      \
      "%8, %9, %10, %11, %12, %13, %14, %15,"                                                \
      "%16, %17, %18, %19, %20, %21, %22, %23,"                                              \
      "%24, %25, %26, %27, %28, %29, %30, %31,"                                              \
      "%32, %33, %34, %35, %36, %37, %38, %39,"                                              \
      "%40, %41, %42, %43, %44, %45, %46, %47,"                                              \
      "%48, %49, %50, %51, %52, %53, %54, %55,"                                              \
      "%56, %57, %58, %59, %60, %61, %62, %63,"                                              \
      "%64, %65, %66, %67, %68, %69, %70, %71,"                                              \
      "%72, %73, %74, %75, %76, %77, %78, %79,"                                              \
      "%80, %81, %82, %83, %84, %85, %86, %87,"                                              \
      "%88, %89, %90, %91, %92, %93, %94, %95,"                                              \
      "%96, %97, %98, %99, %100, %101, %102, %103,"                                          \
      "%104, %105, %106, %107, %108, %109, %110, %111,"                                      \
      "%112, %113, %114, %115, %116, %117, %118, %119,"                                      \
      "%120, %121, %122, %123, %124, %125, %126, %127"                                       \
      "}, %128, %129, p, 1, 1, %131, %132;\n}"                                               \
      : GPUOPS_WG_ACC8(0), GPUOPS_WG_ACC8(8), GPUOPS_WG_ACC8(16), GPUOPS_WG_ACC8(24),        \
        GPUOPS_WG_ACC8(32), GPUOPS_WG_ACC8(40), GPUOPS_WG_ACC8(48), GPUOPS_WG_ACC8(56),      \
        GPUOPS_WG_ACC8(64), GPUOPS_WG_ACC8(72), GPUOPS_WG_ACC8(80), GPUOPS_WG_ACC8(88),      \
        GPUOPS_WG_ACC8(96), GPUOPS_WG_ACC8(104), GPUOPS_WG_ACC8(112), GPUOPS_WG_ACC8(120)    \
      : "l"(desc_a), "l"(desc_b), "r"(1), "n"(TA), "n"(TB))

// D[64 x 256] += A[64 x 16] * B[16 x 256], fp32 accumulators d[128] (layout above), both operands
// from shared memory. TA / TB: A is M-major / B is N-major (else K-major).
template <int TA, int TB>
struct WgmmaM64N256K16 {
  GPUOPS_WG_RUN_16BIT(GPUOPS_WGMMA_M64N256K16, float (&d)[128], unsigned long long desc_a,
                      unsigned long long desc_b)
};

template <class T, int TA, int TB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], unsigned long long desc_a,
                                                 unsigned long long desc_b) {
  WgmmaM64N256K16<TA, TB>::run(T{}, d, desc_a, desc_b);
}

#undef GPUOPS_WGMMA_M64N256K16

// ------------------------------------------------------------------------------------ attention
// wgmma shapes of the flash attention forward (attention/flash_fwd_wgmma.cu); the operand lists
// are written out (generated once). TY: "bf16" or "f16".
//  * SS m64n128k16: D[64 x 128] (+)= A[64 x 16] B[16 x 128], both operands K-major in shared
//    memory (S = Q K^T: Q rows and K rows have the head dim contiguous). scale_d = 0: D = A B
//    (the first k step of a tile needs no zeroed accumulators).
//  * RS m64nNk16: A from registers (4 x .b32 per thread: the m16n8k16 A fragment of warp w's rows
//    16w .. 16w + 15, i.e. the accumulator fragment of two n8 blocks rounded to 16 bits, so
//    P = exp2(S - m) feeds O += P V without shared memory), B N-major (V: keys along k, the
//    head dim contiguous: imm-trans-b = 1).

// The accumulator operands d[0 .. 31] and d[0 .. 63].
#define GPUOPS_WG_ACC32                                                                    \
  GPUOPS_WG_ACC8(0), GPUOPS_WG_ACC8(8), GPUOPS_WG_ACC8(16), GPUOPS_WG_ACC8(24)
#define GPUOPS_WG_ACC64                                                                    \
  GPUOPS_WG_ACC32, GPUOPS_WG_ACC8(32), GPUOPS_WG_ACC8(40), GPUOPS_WG_ACC8(48),               \
      GPUOPS_WG_ACC8(56)

// Their register lists %0 .. %31 and %0 .. %63.
#define GPUOPS_WG_REGS32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18," \
  " %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define GPUOPS_WG_REGS64 \
  GPUOPS_WG_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, " \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

#define GPUOPS_WGMMA_SS_M64N128K16(TY) \
  asm volatile( \
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n" \
      " wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY \
      " {" GPUOPS_WG_REGS64 "}, %64, %65, " \
      " p, 1, 1, %67, %68;\n}" \
      : GPUOPS_WG_ACC64 \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB))

// TA / TB: A is M-major / B is N-major (else K-major); the attention forward's S = Q K^T has
// both K-major, the GEMM's 'pingpong' tiles any of the four layouts
template <int TA, int TB>
struct WgmmaSSM64N128K16 {
  GPUOPS_WG_RUN_16BIT(GPUOPS_WGMMA_SS_M64N128K16, float (&d)[64], unsigned long long desc_a,
                      unsigned long long desc_b, int scale_d)
};
#undef GPUOPS_WGMMA_SS_M64N128K16

// SS m64n64k16 with either operand K-major (0) or M-/N-major (1): the attention backward's
// S^T = K Q^T and dP^T = V dO^T (both K-major) and dQ = dS K (dS from the dS^T tile, M-major;
// K N-major). D += A B; the first k step of a product is the _first form below.
#define GPUOPS_WGMMA_SS_M64N64K16(TY) \
  asm volatile( \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY \
      " {" GPUOPS_WG_REGS32 "}, %32, %33, 1, 1, 1, %34, %35;" \
      : GPUOPS_WG_ACC32 \
      : "l"(desc_a), "l"(desc_b), "n"(TA), "n"(TB))

template <int TA, int TB>
struct WgmmaSSM64N64K16 {
  GPUOPS_WG_RUN_16BIT(GPUOPS_WGMMA_SS_M64N64K16, float (&d)[32], unsigned long long desc_a,
                      unsigned long long desc_b)
};
#undef GPUOPS_WGMMA_SS_M64N64K16

// The first k step of a fresh SS m64n64k16 product (scale-d = 0): the accumulators are outputs
// only ("=f"), so their old values are dead before it (an accumulator carried across a loop
// holds no registers between its last use and the next product).
#define GPUOPS_WG_OUT8(i)                                                                  \
  "=f"(d[i]), "=f"(d[i + 1]), "=f"(d[i + 2]), "=f"(d[i + 3]), "=f"(d[i + 4]),             \
      "=f"(d[i + 5]), "=f"(d[i + 6]), "=f"(d[i + 7])
#define GPUOPS_WGMMA_SS_M64N64K16_FIRST(TY) \
  asm volatile( \
      "{\n .reg .pred p;\n setp.ne.b32 p, 0, 0;\n" \
      " wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY \
      " {" GPUOPS_WG_REGS32 "}, %32, %33, " \
      " p, 1, 1, %34, %35;\n}" \
      : GPUOPS_WG_OUT8(0), GPUOPS_WG_OUT8(8), GPUOPS_WG_OUT8(16), GPUOPS_WG_OUT8(24) \
      : "l"(desc_a), "l"(desc_b), "n"(TA), "n"(TB))

template <int TA, int TB>
struct WgmmaSSM64N64K16First {
  GPUOPS_WG_RUN_16BIT(GPUOPS_WGMMA_SS_M64N64K16_FIRST, float (&d)[32], unsigned long long desc_a,
                      unsigned long long desc_b)
};
#undef GPUOPS_WGMMA_SS_M64N64K16_FIRST
#undef GPUOPS_WG_OUT8

#define GPUOPS_WGMMA_RS_M64N128K16(TY) \
  asm volatile( \
      "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n" \
      " wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY \
      " {" GPUOPS_WG_REGS64 "}, {%64, " \
      " %65, %66, %67}, %68, p, 1, 1, 1;\n}" \
      : GPUOPS_WG_ACC64 \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))

struct WgmmaRSM64N128K16 {
  GPUOPS_WG_RUN_16BIT(GPUOPS_WGMMA_RS_M64N128K16, float (&d)[64], const unsigned int (&a)[4],
                      unsigned long long desc_b, int scale_d)
};
#undef GPUOPS_WGMMA_RS_M64N128K16

#define GPUOPS_WGMMA_RS_M64N64K16(TY) \
  asm volatile( \
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n" \
      " wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY \
      " {" GPUOPS_WG_REGS32 "}, {%32, " \
      " %33, %34, %35}, %36, p, 1, 1, 1;\n}" \
      : GPUOPS_WG_ACC32 \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))

struct WgmmaRSM64N64K16 {
  GPUOPS_WG_RUN_16BIT(GPUOPS_WGMMA_RS_M64N64K16, float (&d)[32], const unsigned int (&a)[4],
                      unsigned long long desc_b, int scale_d)
};
#undef GPUOPS_WGMMA_RS_M64N64K16

#undef GPUOPS_WG_ACC64
#undef GPUOPS_WG_REGS64
#undef GPUOPS_WG_REGS32
#undef GPUOPS_WG_ACC32
#undef GPUOPS_WG_ACC8
#undef GPUOPS_WG_RUN_16BIT

template <class T, int TA = 0, int TB = 0>
__device__ __forceinline__ void wgmma_ss_m64n128k16(float (&d)[64], unsigned long long desc_a,
                                                    unsigned long long desc_b, int scale_d) {
  WgmmaSSM64N128K16<TA, TB>::run(T{}, d, desc_a, desc_b, scale_d);
}

// D[64 x 64] += A B, both from shared memory; TA / TB: A M-major / B N-major (else K-major)
template <class T, int TA, int TB>
__device__ __forceinline__ void wgmma_ss_m64n64k16(float (&d)[32], unsigned long long desc_a,
                                                   unsigned long long desc_b) {
  WgmmaSSM64N64K16<TA, TB>::run(T{}, d, desc_a, desc_b);
}

// D[64 x 64] = A B (the first k step: D's old values are not read)
template <class T, int TA, int TB>
__device__ __forceinline__ void wgmma_ss_m64n64k16_first(float (&d)[32], unsigned long long desc_a,
                                                         unsigned long long desc_b) {
  WgmmaSSM64N64K16First<TA, TB>::run(T{}, d, desc_a, desc_b);
}

// O += P V for a head dim N of 64 or 128 (d: N / 2 accumulators)
template <class T, int N>
__device__ __forceinline__ void wgmma_rs_m64k16(float (&d)[N / 2], const unsigned int (&a)[4],
                                                unsigned long long desc_b, int scale_d) {
  static_assert(N == 64 || N == 128, "O += P V: head dims 64 and 128");
  if constexpr (N == 128) {
    WgmmaRSM64N128K16::run(T{}, d, a, desc_b, scale_d);
  } else {
    WgmmaRSM64N64K16::run(T{}, d, a, desc_b, scale_d);
  }
}

// reg_fence for 32-bit register operands (the A fragments wgmma reads asynchronously)
template <int N>
__device__ __forceinline__ void reg_fence(unsigned int (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i]) :: "memory");
}

}  // namespace gpuops
