// Host stand-in for cuda_src/common/coherent.cuh (same API, no inline PTX). Every CUDA thread is
// a fiber of one OS thread: plain accesses are coherent, and a polling thread must yield so that
// the threads it waits for can run.
#pragma once

namespace gpuops {

inline float load_cg(const float* p) { return *reinterpret_cast<const volatile float*>(p); }
inline float4 load_cg4(const float* p) {
  const volatile float* q = p;
  return make_float4(q[0], q[1], q[2], q[3]);
}
inline void store_cg(float* p, float v) { *reinterpret_cast<volatile float*>(p) = v; }
inline unsigned counter_add_acq_rel(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline void counter_add_release(unsigned* p, unsigned v) { std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline void poll_pause() { emu::yield(); }
inline void wait_counter(const unsigned* p, unsigned target) {
  while (std::atomic_ref<unsigned>(*const_cast<unsigned*>(p)).load() < target) poll_pause();
}

}  // namespace gpuops
