// Host emulation of the CUDA features the gpuops kernels use: every CUDA thread of a launch is an
// OS thread; __syncthreads is a per-block std::barrier; warp shuffles go through a per-warp buffer
// and barrier; __shared__ variables are per-block storage; atomics and fences are C++ atomics.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

struct emu_uint3 { unsigned x, y, z; };
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

struct EmuWarp {
  std::barrier<> bar{32};
  alignas(8) unsigned long long buf[32];
};
struct EmuBlock {
  std::unique_ptr<std::barrier<>> bar;
  std::vector<std::unique_ptr<EmuWarp>> warps;
  std::mutex m;
  std::map<int, std::vector<unsigned char>> shared;
};

inline thread_local emu_uint3 threadIdx, blockIdx, blockDim, gridDim;
inline thread_local EmuBlock* emu_block = nullptr;
inline thread_local int emu_linear = 0;

template <class T>
inline T* emu_shared(int id) {
  std::lock_guard<std::mutex> g(emu_block->m);
  auto& v = emu_block->shared[id];
  if (v.empty()) v.assign(sizeof(T), 0);
  return reinterpret_cast<T*>(v.data());
}

inline void __syncthreads() { emu_block->bar->arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int offset) {
  EmuWarp& w = *emu_block->warps[emu_linear / 32];
  const int lane = emu_linear % 32;
  std::memcpy(&w.buf[lane], &v, sizeof(T));
  w.bar.arrive_and_wait();
  T r;
  std::memcpy(&r, &w.buf[lane ^ offset], sizeof(T));
  w.bar.arrive_and_wait();
  return r;
}

inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::min;
using std::max;

inline float emu_half_to_float(unsigned short b) { return (float)std::bit_cast<_Float16>(b); }
inline unsigned short emu_float_to_half(float f) { return std::bit_cast<unsigned short>((_Float16)f); }
inline float emu_load_cg(const float* p) { return std::atomic_ref<float>(*const_cast<float*>(p)).load(); }
inline void emu_store_cg(float* p, float v) { std::atomic_ref<float>(*p).store(v); }
inline unsigned emu_load_counter(const unsigned* p) {
  return std::atomic_ref<unsigned>(*const_cast<unsigned*>(p)).load();
}

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
