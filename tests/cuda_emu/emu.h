// A CPU emulator for gpuops kernels, for tests on machines without a GPU (tests/emu.py).
//
// The kernel sources compile unchanged as host C++20 with this header force-included: every CUDA
// thread of a block is a fiber; __syncthreads() is a barrier of the block, warp intrinsics
// (shuffles, votes, REDUX) exchange values through a barrier of the warp; __shared__ variables are
// function statics (one copy: blocks run one after another, unless the concurrent schedule is
// on), dynamic shared memory (extern __shared__) is one buffer per block. Threads that return
// early drop out of their barriers, as exited threads do on the GPU.
//
// This checks indexing, tiling, shuffles, barriers and the algorithms (and, with the concurrent
// schedule, interleavings of blocks); it does not model memory ordering beyond sequential
// consistency, timing, or the real arch's floating-point contractions.
// dtypes.cuh and vec.cuh are replaced by asm-free host versions (tests/cuda_emu/common/).
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <csetjmp>
#include <sys/mman.h>
#include <ucontext.h>
#include <tuple>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

namespace emu {
// Every CUDA thread is a fiber on one OS thread; a fiber runs until it waits at a barrier (warp
// intrinsics wait at their warp's) or returns. A fiber starts on its own stack through
// makecontext/swapcontext, and later switches are _setjmp/_longjmp (no signal-mask system call
// per switch). Stacks are mmap'ed with a guard page (an overflow faults instead of corrupting).
//
// Two schedules:
//   in order (default): the blocks of a grid run one after another, in blockIdx order;
//   concurrent (emu_set_schedule(1, seed)): all blocks at once, fibers resumed in a random order
//     each pass, so warps of different blocks interleave at every warp intrinsic: look-back then
//     meets predecessors that published only their aggregate, or nothing yet; blocks that poll
//     for each other (co-resident grids) need it. Only for kernels without static __shared__
//     variables (a function static is one copy for all blocks); dynamic shared memory is per
//     block.
inline dim3 grid_dim, block_dim;
inline dim3 thread_idx, block_idx;           // of the running fiber
inline unsigned char* dynamic_smem = nullptr;   // of the running fiber's block
inline size_t dynamic_smem_bytes = 0;
inline std::atomic<int> failed{0};
inline char fail_msg[256] = {0};
inline void fail(const char* msg) {
  if (failed.exchange(1) == 0) std::strncpy(fail_msg, msg, sizeof(fail_msg) - 1);
}
inline int concurrent = 0;
inline unsigned long long rng_state = 1;
inline unsigned long long next_random() {     // splitmix64
  unsigned long long z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline ucontext_t scheduler;
inline jmp_buf scheduler_jmp;
inline void yield();
inline unsigned long long progress = 0;     // arrivals and exits: a pass without any = deadlock

struct Barrier {
  int expected = 0, arrived = 0;
  unsigned generation = 0;
  void arrive_and_wait() {
    const unsigned g = generation;
    ++progress;
    if (++arrived == expected) {
      arrived = 0;
      ++generation;
      return;
    }
    while (generation == g) yield();
  }
  void drop() {                        // a thread that returned no longer takes part
    --expected;
    if (arrived > 0 && arrived == expected) {
      arrived = 0;
      ++generation;
    }
  }
};

struct Warp {
  Barrier bar;
  unsigned long long slot[32];
};

struct BlockState {
  dim3 idx;
  Barrier bar;
  std::vector<Warp> warps;
  std::vector<unsigned char> smem;   // dynamic shared memory (kernels take its address on entry)
};

struct Fiber {
  ucontext_t ctx;
  jmp_buf jmp;
  BlockState* block = nullptr;
  int linear = 0;
  bool started = false;
  bool done = false;
};

inline constexpr size_t kStack = 256 * 1024;  // virtual; pages are committed when touched
inline constexpr size_t kGuard = 4096;
struct Stack {
  char* base = nullptr;
  Stack() {
    void* p = mmap(nullptr, kStack + kGuard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("emu: cannot map a fiber stack");
    mprotect(p, kGuard, PROT_NONE);          // stacks grow down onto the guard page
    base = static_cast<char*>(p);
  }
  Stack(const Stack&) = delete;
  ~Stack() { munmap(base, kStack + kGuard); }
  char* top() const { return base + kGuard; }
};
inline std::vector<std::unique_ptr<Stack>> stacks;
inline std::vector<Fiber> fibers;
inline std::vector<BlockState> blocks;
inline Fiber* current = nullptr;
inline BlockState* current_block = nullptr;
inline int linear = 0;
inline std::function<void()> body;

inline void yield() {
  if (!_setjmp(current->jmp)) _longjmp(scheduler_jmp, 1);
}
inline Warp& warp() { return current_block->warps[linear / 32]; }

inline void trampoline() {
  body();
  current->done = true;
  current_block->warps[current->linear / 32].bar.drop();
  current_block->bar.drop();
  _longjmp(scheduler_jmp, 2);          // never returns: the scheduler's frame is the live one
}

template <class T>
inline unsigned long long to_bits(T v) {
  unsigned long long u = 0;
  static_assert(sizeof(T) <= 8, "up to 8-byte shuffles");
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
inline T from_bits(unsigned long long u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

// Every lane publishes `v`; returns the value published by lane src(lane).
template <class T, class F>
inline T exchange(T v, F src) {
  Warp& w = warp();
  const int lane = linear & 31;
  w.slot[lane] = to_bits(v);
  w.bar.arrive_and_wait();
  const T r = from_bits<T>(w.slot[src(lane) & 31]);
  w.bar.arrive_and_wait();
  return r;
}

inline unsigned ballot(bool p) {
  Warp& w = warp();
  const int lane = linear & 31;
  w.slot[lane] = p ? 1 : 0;
  w.bar.arrive_and_wait();
  unsigned m = 0;
  for (int i = 0; i < 32; ++i) m |= static_cast<unsigned>(w.slot[i] & 1) << i;
  w.bar.arrive_and_wait();
  return m;
}

// Runs the fibers of `nblocks` blocks (from `first`) until all return; false on a deadlock.
inline bool run_blocks(dim3 grid, int first, int nblocks, int n, dim3 blk) {
  const size_t total = static_cast<size_t>(nblocks) * n;
  while (stacks.size() < total) stacks.emplace_back(new Stack());
  blocks.assign(nblocks, BlockState{});
  fibers.assign(total, Fiber{});
  for (int bi = 0; bi < nblocks; ++bi) {
    const int g = first + bi;
    BlockState& b = blocks[bi];
    b.idx = {static_cast<unsigned>(g) % grid.x, (static_cast<unsigned>(g) / grid.x) % grid.y,
             static_cast<unsigned>(g) / (grid.x * grid.y)};
    b.bar = Barrier{n, 0, 0};
    b.warps.assign(n / 32, Warp{});
    for (auto& w : b.warps) w.bar.expected = 32;
    b.smem.assign(dynamic_smem_bytes + 16, 0xA5);   // garbage, as on the GPU
    for (int t = 0; t < n; ++t) {
      Fiber& f = fibers[static_cast<size_t>(bi) * n + t];
      f.block = &b;
      f.linear = t;
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = stacks[static_cast<size_t>(bi) * n + t]->top();
      f.ctx.uc_stack.ss_size = kStack;
      f.ctx.uc_link = &scheduler;
      makecontext(&f.ctx, trampoline, 0);
    }
  }
  std::vector<size_t> order(total);
  for (size_t i = 0; i < total; ++i) order[i] = i;
  for (size_t left = total; left > 0;) {
    const unsigned long long before = progress;
    if (concurrent) {                  // a fresh random order each pass
      for (size_t i = total - 1; i > 0; --i) std::swap(order[i], order[next_random() % (i + 1)]);
    }
    left = 0;
    for (size_t oi = 0; oi < total; ++oi) {
      Fiber& f = fibers[order[oi]];
      if (f.done) continue;
      current = &f;
      current_block = f.block;
      linear = f.linear;
      block_idx = f.block->idx;
      dynamic_smem = f.block->smem.data();
      thread_idx = {f.linear % blk.x, (f.linear / blk.x) % blk.y, f.linear / (blk.x * blk.y)};
      if (!_setjmp(scheduler_jmp)) {
        if (!f.started) {
          f.started = true;
          swapcontext(&scheduler, &f.ctx);
        } else {
          _longjmp(f.jmp, 1);
        }
      }
      if (!f.done) ++left;
      else ++progress;
    }
    if (left > 0 && progress == before) return false;
  }
  return true;
}

template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 blk, size_t smem, A... args) {
  grid_dim = grid;
  block_dim = blk;
  const int n = static_cast<int>(blk.x * blk.y * blk.z);
  if (n % 32) {
    fail("block size must be a multiple of 32");
    return;
  }
  dynamic_smem_bytes = smem;
  body = [&] { kernel(args...); };
  const int nblocks = static_cast<int>(grid.x * grid.y * grid.z);
  const int batch = concurrent ? nblocks : 1;
  for (int first = 0; first < nblocks; first += batch) {
    if (!run_blocks(grid, first, batch < nblocks - first ? batch : nblocks - first, n, blk)) {
      fail("deadlock: every live thread waits at a barrier that cannot complete");
      return;
    }
  }
}

// Unpacks a CUDA parameter buffer (natural alignment, as gpuops' ArgSpec packs it).
template <class T>
inline T take(const unsigned char* buf, size_t& off) {
  off = (off + alignof(T) - 1) / alignof(T) * alignof(T);
  T v;
  std::memcpy(&v, buf + off, sizeof(T));
  off += sizeof(T);
  return v;
}

template <class... P>
void launch_packed(void (*kernel)(P...), const unsigned* dims, size_t smem, const unsigned char* buf) {
  size_t off = 0;
  std::tuple<std::decay_t<P>...> args{take<std::decay_t<P>>(buf, off)...};
  std::apply([&](auto... a) {
    launch(kernel, dim3{dims[0], dims[1], dims[2]}, dim3{dims[3], dims[4], dims[5]}, smem, a...);
  }, args);
}
}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)

inline void __syncthreads() { emu::current_block->bar.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp().bar.arrive_and_wait(); }

template <class T> inline T __shfl_sync(unsigned, T v, int src) {
  return emu::exchange(v, [src](int) { return src; });
}
template <class T> inline T __shfl_up_sync(unsigned, T v, unsigned d) {
  return emu::exchange(v, [d](int lane) { return lane >= static_cast<int>(d) ? lane - static_cast<int>(d) : lane; });
}
template <class T> inline T __shfl_down_sync(unsigned, T v, unsigned d) {
  return emu::exchange(v, [d](int lane) { return lane + static_cast<int>(d) < 32 ? lane + static_cast<int>(d) : lane; });
}
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m) {
  return emu::exchange(v, [m](int lane) { return lane ^ m; });
}
inline unsigned __ballot_sync(unsigned, int p) { return emu::ballot(p != 0); }
inline int __any_sync(unsigned, int p) { return emu::ballot(p != 0) != 0; }
inline int __all_sync(unsigned, int p) { return emu::ballot(p != 0) == 0xffffffffu; }
inline unsigned __match_any_sync(unsigned, unsigned v) {
  emu::Warp& w = emu::warp();
  const int lane = emu::linear & 31;
  w.slot[lane] = v;
  w.bar.arrive_and_wait();
  unsigned m = 0;
  for (int i = 0; i < 32; ++i) m |= static_cast<unsigned>(w.slot[i] == v) << i;
  w.bar.arrive_and_wait();
  return m;
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) {
  unsigned r = v;
  for (int i = 16; i > 0; i >>= 1) { const unsigned u = __shfl_xor_sync(0xffffffffu, r, i); r = u > r ? u : r; }
  return r;
}
inline unsigned __reduce_min_sync(unsigned, unsigned v) {
  unsigned r = v;
  for (int i = 16; i > 0; i >>= 1) { const unsigned u = __shfl_xor_sync(0xffffffffu, r, i); r = u < r ? u : r; }
  return r;
}

inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(unsigned v) { return v ? __builtin_clz(v) : 32; }
inline int __clzll(unsigned long long v) { return v ? __builtin_clzll(v) : 64; }
inline int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }
inline int __ffsll(unsigned long long v) { return __builtin_ffsll(static_cast<long long>(v)); }
inline float fmaf(float a, float b, float c) { return std::fma(a, b, c); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// CUDA's global min/max overloads (device code calls them unqualified)
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a < b ? b : a; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a < b ? b : a; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a < b ? b : a; }
inline float __fmul_rn(float a, float b) { return a * b; }   // (host C++ does not contract)
