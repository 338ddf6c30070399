// Per-thread asynchronous 16-byte copies global -> shared (cp.async, sm_80+) for kernels that keep
// many loads in flight without holding them in registers. The pattern these helpers serve: each
// thread copies into shared memory slots that only it reads back, so ordering needs only the
// thread's own cp.async.wait_group (no __syncthreads). Every helper carries a "memory" clobber:
// with no barrier in between, the compiler must not move the thread's shared loads across the
// wait (reading a slot before its copy landed) or a slot's next copy above the loads of its
// current contents.
//
// Before sm_80 there is no cp.async: the copy is a plain 16-byte load and shared store
// (synchronous; the waits are no-ops), so the same source compiles for sm_61. Host C++ (the CPU
// emulators, tests/cuda_emu/emu.h and tests/cuda_host_emulation.py, both provide emu::cp_async*)
// defers copies to the covering wait instead, as the GPU may, so a kernel that reads a slot too
// early reads stale data there (host C++ is told apart by __CUDACC_RTC__: the cuda_emu emulator
// defines __CUDA_ARCH__ for the arch it emulates). (common/mma.cuh's cp_async16 / cp_async_wait, without the
// "memory" clobbers, serve the tensor-core kernels, whose block barriers order their tiles.)
#pragma once
#include "common/vec.cuh"

namespace gpuops {

// 16 bytes from src (16-byte aligned) to dst (shared, 16-byte aligned); ok = false writes zeros
// and reads nothing (cp.async with src-size 0).
__device__ __forceinline__ void async_copy16(uint4* dst, const void* src, bool ok) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 800
  unsigned int addr;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
               : "=r"(addr) : "l"(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(addr), "l"(src), "r"(ok ? 16 : 0) : "memory");
#elif defined(__CUDACC_RTC__)
  *dst = ok ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
#else
  emu::cp_async(reinterpret_cast<unsigned char*>(dst), src, ok ? 16 : 0, 16);
#endif
}

// Close the thread's current group of copies (an empty group is fine: it keeps counts uniform).
__device__ __forceinline__ void async_copy_commit() {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#elif !defined(__CUDACC_RTC__)
  emu::cp_async_commit();
#endif
}

// Wait until at most N of the thread's committed groups are still pending.
template <int N>
__device__ __forceinline__ void async_copy_wait() {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#elif !defined(__CUDACC_RTC__)
  emu::cp_async_wait(N);
#endif
}

}  // namespace gpuops
