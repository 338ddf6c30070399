// Host stand-in for cuda_src/common/pdl.cuh (no inline PTX). The emulator runs one launch at a
// time, in stream order, so waiting for the previous grid and releasing the next are no-ops here.
// l2_prefetch_bulk changes nothing either, but the emulator records each range it is asked for
// (emu_prefetch_count / emu_prefetch_range) so that a test can check what a kernel would prefetch.
#pragma once
#include <mutex>
#include <vector>

namespace gpuops {

inline void pdl_launch_dependents() {}
inline void pdl_wait() {}
inline void pdl_start() {}
inline void pdl_start_untriggered() {}

struct EmuPrefetch {
  unsigned long long address;
  unsigned int bytes;
};
// static, not inline: an inline variable is a GNU unique symbol, one object for every library
// loaded in the process, and each module's library must keep its own record
static std::vector<EmuPrefetch> emu_prefetches;
static std::mutex emu_prefetch_lock;

inline void l2_prefetch_bulk(const void* p, unsigned int bytes) {
  const std::lock_guard<std::mutex> hold(emu_prefetch_lock);
  emu_prefetches.push_back({reinterpret_cast<unsigned long long>(p), bytes});
}

}  // namespace gpuops

// Read and clear the record (one shared library per module: defined once per library).
extern "C" long long emu_prefetch_count() {
  return static_cast<long long>(gpuops::emu_prefetches.size());
}
extern "C" void emu_prefetch_range(long long i, unsigned long long* address,
                                   unsigned long long* bytes) {
  *address = gpuops::emu_prefetches[static_cast<size_t>(i)].address;
  *bytes = gpuops::emu_prefetches[static_cast<size_t>(i)].bytes;
}
extern "C" void emu_prefetch_clear() { gpuops::emu_prefetches.clear(); }
