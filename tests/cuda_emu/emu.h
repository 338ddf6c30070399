// A CPU emulator for gpuops kernels, for tests on machines without a GPU (tests/emu.py).
//
// The kernel sources compile unchanged as host C++20 with this header force-included: every CUDA
// thread of a block is a fiber; __syncthreads() is a barrier of the block, warp intrinsics
// (shuffles, votes, REDUX) exchange values through a barrier of the warp; __shared__ variables are
// function statics (one copy: blocks run one after another, unless the concurrent schedule is
// on), dynamic shared memory (extern __shared__) is one buffer per block. Threads that return
// early drop out of their barriers, as exited threads do on the GPU.
//
// Tensor-core kernels (cuda_src/common/mma.cuh's host branch): ldmatrix and mma.sync exchange
// their operands through a per-warp scratch at the warp barrier (warp_collective); shared
// addresses are offsets into the dynamic shared memory (shared_offset / shared_ptr, bounds and
// alignment checked); cp.async copies wait in the issuing thread's groups until a
// cp.async.wait_group covers them, so reading a tile before waiting for it reads stale data.
//
// Thread-block clusters (emu_set_cluster(S) before a launch; tests/cuda_emu/common/cluster.cuh):
// the S blocks of a cluster run at the same time, each with its own dynamic shared memory (so
// cluster kernels keep everything in dynamic shared memory, none in __shared__ statics), the
// cluster barrier is a split arrive/wait barrier over their threads, and cluster_map translates
// an address in one block's dynamic shared memory to the same offset in another's.
//
// This checks indexing, tiling, shuffles, barriers and the algorithms (and, with the concurrent
// schedule, interleavings of blocks); it does not model memory ordering beyond sequential
// consistency, timing, or the real arch's floating-point contractions (nor the tensor cores'
// accumulation order: an emulated mma sums its 16 products in k order with fp32 FMAs).
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
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
inline float2 make_float2(float a, float b) { return {a, b}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

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
inline unsigned char* dynamic_smem = nullptr;  // of the running fiber's block
inline size_t dynamic_smem_bytes = 0;          // of the launch, per block
inline int cluster_size = 1;                   // blocks per cluster (consecutive along x)
inline std::atomic<int> failed{0};
inline char fail_msg[256] = {0};
inline void fail(const char* msg) {
  if (failed.exchange(1) == 0) std::strncpy(fail_msg, msg, sizeof(fail_msg) - 1);
}
inline int concurrent = 0;
// concurrent only: each pass holds back each block with this probability (percent), so blocks
// fall behind each other by several barriers (without it, every block advances one barrier per
// pass and a poll never finds a word that another block has yet to publish); a pass that makes no
// progress is retried with no block held before it counts as a deadlock.
inline int straggle = 0;
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

inline constexpr int kScratchWords = 16;
struct Warp {
  Barrier bar;
  unsigned long long slot[32];
  unsigned scratch[32][kScratchWords];   // operands of warp-wide instructions (ldmatrix, mma)
};

struct ClusterState {
  Barrier bar;                         // split arrive/wait: Fiber::cluster_phase records the phase
};

struct BlockState {
  dim3 idx;
  Barrier bar;
  Barrier named[16];                   // bar.sync id, count (id 0 is bar); sized at first use
  std::vector<Warp> warps;
  std::vector<unsigned char> smem;     // dynamic shared memory (16-byte aligned data())
  int cluster = 0;                     // index into `clusters`
  int rank = 0;                        // rank in the cluster
  int base = 0;                        // index in `blocks` of the cluster's rank 0
};

// One 16-byte (or shorter) cp.async: performed when a cp.async.wait_group covers its group.
struct AsyncCopy {
  unsigned char* dst;
  const unsigned char* src;
  int src_bytes, bytes;
};

struct Fiber {
  ucontext_t ctx;
  jmp_buf jmp;
  BlockState* block = nullptr;
  int linear = 0;
  bool started = false;
  bool done = false;
  std::vector<AsyncCopy> open_copies;                 // issued, not yet committed
  std::vector<std::vector<AsyncCopy>> copy_groups;    // committed, oldest first
  bool cluster_arrived = false;        // arrived at the cluster barrier, not yet waited
  unsigned cluster_phase = 0;          // the cluster barrier's generation at the arrival
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
inline std::vector<ClusterState> clusters;
inline Fiber* current = nullptr;
inline BlockState* current_block = nullptr;
inline int linear = 0;
inline std::function<void()> body;

inline void yield() {
  if (!_setjmp(current->jmp)) _longjmp(scheduler_jmp, 1);
}
inline Warp& warp() { return current_block->warps[linear / 32]; }

// Warp-wide instructions: every lane publishes n words (mine), then f(scratch, lane) runs when
// the whole warp has published (scratch[l] holds lane l's words); the scratch is reused only after
// every lane is done with it.
template <class F>
inline void warp_collective(const unsigned* mine, int n, F&& f) {
  Warp& w = warp();
  const int lane = linear & 31;
  for (int i = 0; i < n; ++i) w.scratch[lane][i] = mine[i];
  w.bar.arrive_and_wait();
  f(static_cast<const unsigned (*)[kScratchWords]>(w.scratch), lane);
  w.bar.arrive_and_wait();
}

// The shared state space of the emulated kernels: offsets into the block's dynamic shared memory
// (a 32-bit shared address, as cvta.to.shared gives on the GPU). `bytes`: the access size, which
// must be aligned to itself (ldmatrix rows, cp.async).
inline unsigned shared_offset(const void* p) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < dynamic_smem || c > dynamic_smem + dynamic_smem_bytes) {
    fail("shared address outside the dynamic shared memory (static __shared__ arrays have no "
         "shared address in the emulator)");
    return 0;
  }
  return static_cast<unsigned>(c - dynamic_smem);
}
inline unsigned char* shared_ptr(unsigned off, unsigned bytes) {
  static unsigned char sink[16];
  if (off + bytes > dynamic_smem_bytes || off % bytes) {
    fail("shared access out of bounds or misaligned (ldmatrix / cp.async need 16-byte rows)");
    return sink;
  }
  return dynamic_smem + off;
}

// cp.async: the copy is queued in the issuing thread's open group; commit_group closes the group;
// wait_group(n) performs all but the newest n committed groups (so data that a kernel reads
// before waiting for it is stale, as it may be on the GPU).
inline void cp_async(unsigned char* dst, const void* src, int src_bytes, int bytes) {
  if (src_bytes < 0 || src_bytes > bytes) fail("cp.async: src-size out of range");
  current->open_copies.push_back({dst, static_cast<const unsigned char*>(src), src_bytes, bytes});
}
inline void cp_async_commit() {
  current->copy_groups.push_back(std::move(current->open_copies));
  current->open_copies.clear();
}
inline void cp_async_wait(int n) {
  auto& groups = current->copy_groups;
  while (static_cast<int>(groups.size()) > n) {
    for (const AsyncCopy& c : groups.front()) {
      if (c.src_bytes > 0) std::memcpy(c.dst, c.src, c.src_bytes);
      std::memset(c.dst + c.src_bytes, 0, c.bytes - c.src_bytes);
    }
    groups.erase(groups.begin());
  }
}

inline void trampoline() {
  body();
  current->done = true;
  current_block->warps[current->linear / 32].bar.drop();
  current_block->bar.drop();
  if (current->cluster_arrived) fail("a thread exited between cluster_arrive and cluster_wait");
  clusters[current_block->cluster].bar.drop();
  _longjmp(scheduler_jmp, 2);          // never returns: the scheduler's frame is the live one
}

inline void cluster_arrive() {
  Barrier& b = clusters[current_block->cluster].bar;
  if (current->cluster_arrived) fail("cluster_arrive twice without cluster_wait");
  current->cluster_arrived = true;
  current->cluster_phase = b.generation;
  ++progress;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.generation;
  }
}

inline void cluster_wait() {
  Barrier& b = clusters[current_block->cluster].bar;
  if (!current->cluster_arrived) fail("cluster_wait without cluster_arrive");
  current->cluster_arrived = false;
  while (b.generation == current->cluster_phase) yield();
}

inline unsigned cluster_rank() { return static_cast<unsigned>(current_block->rank); }

// The address at p's offset in the dynamic shared memory of block `rank` of this cluster.
inline const void* cluster_map(const void* p, unsigned rank) {
  const unsigned char* q = static_cast<const unsigned char*>(p);
  const unsigned char* mine = current_block->smem.data();
  if (q < mine || q >= mine + dynamic_smem_bytes) {
    fail("cluster_map of an address outside dynamic shared memory");
    return p;
  }
  if (rank >= static_cast<unsigned>(cluster_size)) {
    fail("cluster_map to a rank outside the cluster");
    return p;
  }
  return blocks[current_block->base + rank].smem.data() + (q - mine);
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
  clusters.assign((nblocks + cluster_size - 1) / cluster_size, ClusterState{});
  for (auto& c : clusters) c.bar.expected = 0;
  for (int bi = 0; bi < nblocks; ++bi) {
    const int g = first + bi;
    BlockState& b = blocks[bi];
    b.idx = {static_cast<unsigned>(g) % grid.x, (static_cast<unsigned>(g) / grid.x) % grid.y,
             static_cast<unsigned>(g) / (grid.x * grid.y)};
    b.bar = Barrier{n, 0, 0};
    b.smem.assign(dynamic_smem_bytes + 16, 0xA5);     // garbage, as fresh shared memory
    b.cluster = bi / cluster_size;
    b.rank = static_cast<int>(b.idx.x) % cluster_size;
    b.base = bi - b.rank;
    clusters[b.cluster].bar.expected += n;
    b.warps.assign(n / 32, Warp{});
    for (auto& w : b.warps) w.bar.expected = 32;
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
  std::vector<char> held(nblocks, 0);
  bool stalled = false;
  for (size_t left = total; left > 0;) {
    const unsigned long long before = progress;
    if (concurrent) {                  // a fresh random order each pass
      for (size_t i = total - 1; i > 0; --i) std::swap(order[i], order[next_random() % (i + 1)]);
    }
    bool any_held = false;
    for (int bi = 0; bi < nblocks; ++bi) {
      held[bi] = concurrent && straggle > 0 && !stalled &&
                 static_cast<int>(next_random() % 100) < straggle;
      any_held |= held[bi] != 0;
    }
    left = 0;
    for (size_t oi = 0; oi < total; ++oi) {
      Fiber& f = fibers[order[oi]];
      if (f.done) continue;
      if (held[order[oi] / n]) {
        ++left;
        continue;
      }
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
    if (left > 0 && progress == before) {
      if (!any_held) return false;
      stalled = true;                  // (retried with no block held)
      continue;
    }
    stalled = false;
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
  if (cluster_size < 1 || grid.x % cluster_size) {
    fail("the grid is not a whole number of clusters along x");
    return;
  }
  const int batch = concurrent ? nblocks : cluster_size;   // a cluster's blocks run together
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

#define GPUOPS_EMU_H 1                 // (cuda_src: this emulator, e.g. its named barriers)
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
#define __align__(n) __attribute__((aligned(n)))   // GCC takes it anywhere, as nvcc does

inline void __syncthreads() { emu::current_block->bar.arrive_and_wait(); }
namespace emu {
// bar.sync id, count (id 1..15): a barrier of `count` threads of the block; every use of one id
// must name the same count (the hardware's rule), checked here.
inline void named_bar_sync(unsigned id, unsigned count) {
  if (id == 0 || id > 15 || count % 32 != 0) fail("named barrier: id 1..15, count of warps");
  Barrier& b = current_block->named[id & 15];
  if (b.expected == 0) b.expected = static_cast<int>(count);
  else if (b.expected != static_cast<int>(count)) fail("named barrier: count changed");
  b.arrive_and_wait();
}
}  // namespace emu
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

inline void __trap() { emu::fail("__trap()"); }
// CUDA's global min/max overloads
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
}

inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
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
template <class T> inline T __ldg(const T* p) { return *p; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fmul_rn(float a, float b) { return a * b; }   // (host C++ does not contract)
