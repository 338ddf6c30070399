// Global-memory accesses for values that blocks of one running grid hand to each other (partial
// statistics, per-row results, arrival counters): data written and read through L2 only (.cg),
// since L1 is not coherent between SMs, and counters with release/acquire semantics. The data a
// counter publishes is written by the thread that releases it, and read by the acquiring
// thread's block after a __syncthreads() that follows the acquire (the pattern of CUTLASS's
// semaphore). sm_70+: the PTX memory model's .acq_rel / .release / .acquire operations (a
// MEMBAR.ALL or an L1 invalidate, not the full fence.sc of __threadfence() on either side);
// sm_61, which has none: full fences. Kept apart from the protocols that use them
// (row_split.cuh) so that the CPU emulator (tests/emu.py) can replace the PTX here and run those
// protocols unchanged (its stand-in yields the polling fiber instead of sleeping).
#pragma once

namespace gpuops {

__device__ __forceinline__ float load_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// Two floats at an 8-byte aligned p, through L2 (one request where two load_cg would make two).
__device__ __forceinline__ float2 load_cg2(const float* p) {
  float2 v;
  asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ void store_cg(float* p, float v) {
  asm volatile("st.global.cg.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}

// Adds v to *p and returns the old value: the caller's earlier writes are visible to whoever
// acquires the counter after this, and the writes released before the values it passed are
// visible to the caller.
__device__ __forceinline__ unsigned counter_add_acq_rel(unsigned* p, unsigned v) {
#if __CUDA_ARCH__ >= 700
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v)
               : "memory");
  return old;
#else
  __threadfence();
  const unsigned old = atomicAdd(p, v);
  __threadfence();
  return old;
#endif
}

// Adds v to *p; the caller's earlier writes are visible to whoever acquires the new value.
__device__ __forceinline__ void counter_add_release(unsigned* p, unsigned v) {
#if __CUDA_ARCH__ >= 700
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
  __threadfence();
  atomicAdd(p, v);
#endif
}

// 64-bit words that carry their own validity (norm_ring.cuh's ring2: a partial and the tag of
// the launch that wrote it): an aligned 64-bit access is single-copy atomic, so a reader sees
// the whole word of one writer or an older one, never half of each. Relaxed, through L2: the
// word is the only thing published, so no fence orders anything around it.
__device__ __forceinline__ unsigned long long load_word_relaxed(const unsigned long long* p) {
  unsigned long long v;
#if __CUDA_ARCH__ >= 700
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
#else
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
#endif
  return v;
}

__device__ __forceinline__ void store_word_relaxed(unsigned long long* p, unsigned long long v) {
#if __CUDA_ARCH__ >= 700
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// A word published for the whole block that wrote data before it: the writing block's threads
// store, __syncthreads(), then one thread stores the word with release semantics; a reader
// observes the word (relaxed polls, then fence_acquire_gpu), and its block reads the data after a
// __syncthreads() that follows (the pattern of CUTLASS's semaphore). sm_61: full fences.
__device__ __forceinline__ void store_word_release(unsigned long long* p, unsigned long long v) {
#if __CUDA_ARCH__ >= 700
  asm volatile("st.release.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
  __threadfence();
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

// After relaxed polls that observed words stored with release semantics: makes what was released
// before them visible to this thread (a fence-based acquire: the polls' loads stay independent of
// each other, where acquire loads would be ordered one after the other).
__device__ __forceinline__ void fence_acquire_gpu() {
#if __CUDA_ARCH__ >= 700
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
#else
  __threadfence();
#endif
}

__device__ __forceinline__ unsigned load_relaxed(const unsigned* p) {
  unsigned v;
#if __CUDA_ARCH__ >= 700
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#else
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#endif
  return v;
}

__device__ __forceinline__ void store_relaxed(unsigned* p, unsigned v) {
#if __CUDA_ARCH__ >= 700
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
  asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
}

// Adds v to *p and returns the old value; orders nothing else (no fence).
__device__ __forceinline__ unsigned counter_add_relaxed(unsigned* p, unsigned v) {
  unsigned old;
#if __CUDA_ARCH__ >= 700
  asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v)
               : "memory");
#else
  old = atomicAdd(p, v);
#endif
  return old;
}

// A 16-byte load through L2 only (ld.global.cg): read-only data (w, b) whose loads should not
// share the non-coherent path (and, in ptxas' allocation, the scoreboard) of the tile loads.
__device__ __forceinline__ uint4 load16_cg(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// One step of a polling loop: a short sleep (sm_70+) that leaves the issue slots to the SM's
// other warps; a plain re-poll before.
__device__ __forceinline__ void poll_pause() {
#if __CUDA_ARCH__ >= 700
  asm volatile("nanosleep.u32 %0;" ::"r"(64u));
#endif
}

// Polls until *counter >= target; then what was released before that value is visible to this
// thread (sm_70+: acquire loads, which cost no fence; sm_61: volatile loads, then a full fence).
__device__ __forceinline__ void wait_counter(const unsigned* counter, unsigned target) {
#if __CUDA_ARCH__ >= 700
  for (;;) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
    if (v >= target) break;
    poll_pause();
  }
#else
  while (*reinterpret_cast<const volatile unsigned*>(counter) < target) {
  }
  __threadfence();
#endif
}

}  // namespace gpuops
