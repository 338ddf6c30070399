// Host stand-in for cuda_src/common/coherent.cuh (same API, no inline PTX). Every CUDA thread is
// a fiber of one OS thread: plain accesses are coherent, and a polling thread must yield so that
// the threads it waits for can run.
#pragma once

namespace gpuops {

inline float load_cg(const float* p) { return *reinterpret_cast<const volatile float*>(p); }
inline float2 load_cg2(const float* p) {
  if (reinterpret_cast<unsigned long long>(p) & 7u) emu::fail("misaligned 8-byte load");
  return {reinterpret_cast<const volatile float*>(p)[0], reinterpret_cast<const volatile float*>(p)[1]};
}
inline void store_cg(float* p, float v) { *reinterpret_cast<volatile float*>(p) = v; }
inline unsigned counter_add_acq_rel(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline void counter_add_release(unsigned* p, unsigned v) { std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline unsigned long long load_word_relaxed(const unsigned long long* p) {
  return std::atomic_ref<unsigned long long>(*const_cast<unsigned long long*>(p)).load(std::memory_order_relaxed);
}
inline void store_word_relaxed(unsigned long long* p, unsigned long long v) {
  std::atomic_ref<unsigned long long>(*p).store(v, std::memory_order_relaxed);
}
inline void store_word_release(unsigned long long* p, unsigned long long v) {
  std::atomic_ref<unsigned long long>(*p).store(v, std::memory_order_release);
}
inline void fence_acquire_gpu() { std::atomic_thread_fence(std::memory_order_acquire); }
inline unsigned load_relaxed(const unsigned* p) {
  return std::atomic_ref<unsigned>(*const_cast<unsigned*>(p)).load(std::memory_order_relaxed);
}
inline void store_relaxed(unsigned* p, unsigned v) { std::atomic_ref<unsigned>(*p).store(v, std::memory_order_relaxed); }
inline unsigned counter_add_relaxed(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v, std::memory_order_relaxed); }
inline uint4 load16_cg(const void* p) {
  uint4 v{0, 0, 0, 0};
  if (reinterpret_cast<unsigned long long>(p) & 15u) { emu::fail("misaligned 16-byte load"); return v; }
  std::memcpy(&v, p, 16);
  return v;
}
inline void poll_pause() { emu::yield(); }
inline void wait_counter(const unsigned* p, unsigned target) {
  while (std::atomic_ref<unsigned>(*const_cast<unsigned*>(p)).load() < target) poll_pause();
}

}  // namespace gpuops
