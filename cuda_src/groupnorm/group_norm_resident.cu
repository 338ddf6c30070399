// GroupNorm (+ SiLU) on the norms' "resident" plan (norms/norm_ring.cuh, resident_rows): a group
// of a contiguous NCHW input is a row of cg * hw elements, so groups too large for one block
// (the VAE's [1, 256, 256, 256]: 32 groups of 1 MiB in 16-bit) are split into tiles spread over a
// grid of one 512-thread block per SM. Every tile of a block is copied into shared memory at once
// (cp.async, or bulk copies on sm_90), its partial (count, mean, M2) published as ring2's
// self-validating words, and once all are published each block gathers its tiles' group
// statistics and writes its tiles out. DRAM sees x read once and y written once, where the
// two-pass kernels (group_norm.cu) read x twice: the input must fit on chip (~33 MB on an H100;
// the host checks, gpuops/ops/group_norm.py).
//
// The statistics are layer_norm's (norms/layer_norm_ring.cuh: the same tiles, partials and
// merges); only the output side differs: the affine parameters are per channel, c = group's
// first channel + unit / (hw / VEC) (hw % VEC == 0, so a 16-byte unit never straddles two
// channels), read where used (the channel's two values stay in L1 across a tile's units). SiLU
// by silu_f (two MUFU ops): group_norm.cu's silu_pack, which moves some reciprocals to the FMA
// pipe, measured 0.7 us slower at [1, 256, 256, 256] bf16 (run 125: the drains are issue-bound,
// not MUFU-bound, and Newton's steps add instructions).
#include "norms/layer_norm_ring.cuh"
#include "common/activations.cuh"
#include "common/fastdiv.cuh"

namespace gpuops {

template <class T, int VEC, int PACKS>
struct GroupNormResident : LayerNormRing<T, VEC, PACKS> {
  using Base = LayerNormRing<T, VEC, PACKS>;
  using R = RawUnit<T, VEC>;
  using Raw = typename R::type;
  using Acc = typename Base::Acc;
  int groups, cg, act;
  FastDiv ppc;                      // units per channel (hw / VEC)

  __device__ __forceinline__ GroupNormResident(const T* x_, T* y_, const T* w_, const T* b_,
                                               int n, int groups_, int cg_, FastDiv ppc_,
                                               float eps_, int act_)
      : Base(x_, n, y_, n, w_, b_, nullptr, nullptr, n, eps_),
        groups(groups_), cg(cg_), act(act_), ppc(ppc_) {}

  // resident_rows' w (b) loads ahead of the stores index the row's elements; here the
  // parameters are per channel and are read in store_group.
  template <bool kCg, bool kAhead = false>
  __device__ __forceinline__ void load_group(int, int, int) {}
  __device__ __forceinline__ void load_whole(int, int) {}
  __device__ __forceinline__ void take_ahead() {}

  // 1 / sqrt(var + eps) correctly rounded, as group_norm.cu (rsqrtf's 2 ulp would show in fp32
  // outputs that cancel against the bias).
  __device__ __forceinline__ void stats(const Acc& a, float& mu, float& s) const {
    mu = a.mean;
    s = 1.0f / sqrtf(a.m2 * this->inv_n + this->eps);
  }

  // Units p0 .. p0 + kGroup - 1 of this thread's part of a held tile of row (= n * groups + g):
  // y = act((x - mu) * (s * w[c]) + b[c]). kWhole (the shared-chunk drains): the same here.
  template <bool kRegs, bool kEvictFirst, bool kWhole>
  __device__ __forceinline__ void store_group(const Raw* slot, long long row, int u0, int p0,
                                              int units, float mu, float s) {
    T* y_row = this->y + row * this->ys;
    const int c0 = static_cast<int>(static_cast<unsigned>(row) % static_cast<unsigned>(groups)) *
                   cg;
#pragma unroll
    for (int g = 0; g < Base::kGroup; ++g) {
      const int unit = u0 + (p0 + g) * static_cast<int>(blockDim.x);
      if (unit < units) {
        const int c = c0 + static_cast<int>(ppc.div(static_cast<unsigned>(unit)));
        const float a = this->w != nullptr ? s * to_float(this->w[c]) : s;
        const float sh = this->b != nullptr ? to_float(this->b[c]) : 0.0f;
        float f[VEC];
        R::unpack(slot[kRegs ? p0 + g : (p0 + g) * blockDim.x], f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float v = fmaf(f[j] - mu, a, sh);
          f[j] = act ? silu_f(v) : v;
        }
        if constexpr (kEvictFirst && VEC > 1) {
          store16_evict_first(y_row + static_cast<long long>(unit) * VEC, R::pack(f));
        } else {
          R::store(y_row + static_cast<long long>(unit) * VEC, R::pack(f));
        }
      }
    }
  }
};

// x, y: contiguous [N, C, hw] (16-byte aligned, hw % VEC == 0); rows = N * groups groups of
// n = cg * hw elements, C tiles of blockDim.x * PACKS units each, D shared-memory slots per block
// (kRingHeaderBytes + D * tile bytes of dynamic shared memory), gridDim.x * (D + 1) >= rows * C
// and every block resident at once (the host sizes the grid from the occupancy calculator).
// state: the per-stream ring2 state (gpuops/ops/norms.py, _ring2_state). act: 0 none, 1 SiLU.
template <class T, int VEC, int PACKS>
__global__ void __launch_bounds__(512, 1)
group_norm_resident(const T* x, T* y, const T* __restrict__ w, const T* __restrict__ b,
                    unsigned* state, int rows, int n, int C, int D, int groups, int cg,
                    FastDiv ppc, float eps, int act) {
  extern __shared__ uint4 ring_smem[];
  GroupNormResident<T, VEC, PACKS> pol(x, y, w, b, n, groups, cg, ppc, eps, act);
  resident_rows<2>(pol, rows, n / VEC, C, D, state, reinterpret_cast<unsigned char*>(ring_smem));
}

// ----------------------------------------------------------------------------- channels last
//
// group_norm_nhwc_resident: channels-last GroupNorm (+ SiLU) for inputs that fit in the grid's
// shared memory. A sample's [hw, C] rows are contiguous, so the grid cuts each sample into
// `chunks` runs of `chunk_rows` whole rows (every channel of a row: reads and writes are plain
// contiguous 16-byte streams, where the channels-last spread / two-pass kernels read slabs of a
// group's few channels, 80 bytes of each 640-byte row at [2, 64, 64, 320] bf16). Block (n, p):
//   copy    its run into shared memory, every copy in flight at once (per-thread cp.async, one
//           commit group per unit; plain loads and stores below sm_80); w and b loaded meanwhile;
//   stats   the run's (mean, M2) per group in one pass as the copies land: per channel, sums of
//           d = x - shift and d^2 (the shift one of the channel's values in the run), then Chan's
//           merge of the channels of each group (nhwc_run_stats);
//   publish each group's (mean, M2) of the run, then (after a barrier) the run's flag with
//           release semantics: a 64-bit word tagged with this launch's epoch (ring2's tags,
//           norms/norm_ring.cuh);
//   gather  one warp polls the sample's `chunks` flags; then each group's (mean, M2) pairs are
//           added up as sums shifted by chunk 0's mean, by a few lanes and a butterfly between
//           them (every block gets the same bits);
//   apply   y = act((x - mean) * (rstd * w[c]) + b[c]) from shared memory, stored once.
// DRAM sees x read once and y written once (in place is fine: a block writes only the rows it
// read). Forward progress: every block publishes before it waits, and all blocks are resident at
// once (the host sizes the grid from the occupancy calculator). Thread t < phases * U (U = C / VEC
// 16-byte columns, phases = blockDim.x / U) owns column t % U of rows t / U, t / U + phases, ...:
// its units of the run are t, t + active, t + 2 active, ... (active = phases * U), so the
// channels it sums and normalizes are fixed, and it reads back only what it copied.
// Run 145's first version (a warp per group, each lane re-polling its stale tagged pairs one at
// a time, every thread of every block polling) took 15-16 us at [2, 64, 64, 320] against a model
// of 5.5-7; run 146's stamps put 5 us in that gather and ~4 us in instruction-bound statistics
// (per-thread divisions and w / b loads, 8-way conflicted shared-memory stores): hence the flags,
// one polling warp, the per-channel tables and the vector stores below; run 147's stamps still
// had 2.8 us of two-pass statistics after the landing and 4 us of exchange (fences on both sides):
// hence the one-pass statistics and the release / acquire flag.
//
// Dynamic shared memory (the host's nhwc_resident_smem), floats: channel means [C], per-channel
// tables mu [C] (the shifts, then the channels' M2, then the sample's group means), scale [C] (w,
// then rstd * w), shift [C] (b), per-phase sums of d and of d^2 [2 phases * C], run means
// [groups], per-group pairs [2 groups]; rounded up to 16 bytes; then the run: chunk_rows * U
// 16-byte units.
// State (gpuops/ops/norms.py ring2_state): after ring2's header, the flags (N * chunks words),
// then the pairs (N * groups * chunks (mean, M2) floats, pair ((n * groups + g) * chunks + p)).

constexpr int kNhwcResidentThreads = 512;
constexpr int kNhwcGatherBatch = 8;        // chunks per lane loaded at once
constexpr int kNhwcFlagBatch = 4;          // flags per lane of the polling warp per round trip

// The run's (mean, M2) per group from this thread's shifted sums of its VEC channels (s1 = sum of
// d, s2 = sum of d^2, d = x - shift[c]): summed over the row phases (vector stores: VEC
// consecutive floats per thread), turned into each channel's mean and M2 (M2 = S2 - S1^2 / rows:
// the shift is one of the channel's own values in this run, so what cancels is bounded by the
// run's own spread around it, as the NCHW stats kernel's shifted sums), then merged over each
// group's channels by a warp (Chan's formula for equal counts: the group mean is the channels'
// mean, M2 adds rows * (channel mean - group mean)^2). shift[] is overwritten with the channels'
// M2. Contains __syncthreads (before and after).
template <int VEC>
__device__ __forceinline__ void nhwc_run_stats(const float (&s1)[VEC], const float (&s2)[VEC],
                                               bool active, int col, int phase, int C,
                                               int phases, int groups, int cg, int rows,
                                               float* ps1, float* ps2, float* chan, float* shift,
                                               float* run_mean, float* run_m2) {
  if (active) {
    float4* d1 = reinterpret_cast<float4*>(ps1 + phase * C + col * VEC);
    float4* d2 = reinterpret_cast<float4*>(ps2 + phase * C + col * VEC);
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q) {
      d1[q] = make_float4(s1[4 * q], s1[4 * q + 1], s1[4 * q + 2], s1[4 * q + 3]);
      d2[q] = make_float4(s2[4 * q], s2[4 * q + 1], s2[4 * q + 2], s2[4 * q + 3]);
    }
  }
  __syncthreads();
  const float inv_rows = 1.0f / static_cast<float>(rows);
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float a = 0.0f, q2 = 0.0f;
    for (int q = 0; q < phases; ++q) {
      a += ps1[q * C + c];
      q2 += ps2[q * C + c];
    }
    const float da = a * inv_rows;
    chan[c] = shift[c] + da;
    shift[c] = fmaxf(q2 - a * da, 0.0f);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const float inv_cg = 1.0f / static_cast<float>(cg);
  for (int g = threadIdx.x >> 5; g < groups; g += blockDim.x >> 5) {
    float m = 0.0f;
    for (int c = g * cg + lane; c < (g + 1) * cg; c += 32) m += chan[c];
    m = warp_sum(m) * inv_cg;
    float v = 0.0f;
    for (int c = g * cg + lane; c < (g + 1) * cg; c += 32) {
      const float d = chan[c] - m;
      v += fmaf(static_cast<float>(rows) * d, d, shift[c]);
    }
    v = warp_sum(v);
    if (lane == 0) {
      run_mean[g] = m;
      run_m2[g] = v;
    }
  }
  __syncthreads();
}

// This thread's VEC consecutive floats of a per-channel table (16-byte aligned).
template <int VEC>
__device__ __forceinline__ void nhwc_table(const float* table, int col, float (&v)[VEC]) {
  const float4* src = reinterpret_cast<const float4*>(table + col * VEC);
#pragma unroll
  for (int q = 0; q < VEC / 4; ++q) {
    const float4 t = src[q];
    v[4 * q] = t.x;
    v[4 * q + 1] = t.y;
    v[4 * q + 2] = t.z;
    v[4 * q + 3] = t.w;
  }
}

// Waits until every run of the sample has published (its flag, stored with release semantics
// after the run's pairs, carries this launch's tag): called by one warp, relaxed polls and then an
// acquire fence; the block reads the pairs after a __syncthreads that follows (coherent.cuh,
// store_word_release). kNhwcFlagBatch flags per lane loaded at once and every stale one re-read
// together, so a poll is one L2 round trip (acquire loads would each wait for the one before).
__device__ __forceinline__ void nhwc_wait_flags(const unsigned long long* flags, int chunks,
                                                unsigned tag) {
  constexpr int B = kNhwcFlagBatch;
  const int lane = threadIdx.x & 31;
  for (int c0 = 0; c0 < chunks; c0 += 32 * B) {
    bool stale[B];
#pragma unroll
    for (int i = 0; i < B; ++i) {
      const int c = c0 + 32 * i + lane;
      stale[i] = c < chunks &&
                 static_cast<unsigned>(load_word_relaxed(flags + c) >> 32) != tag;
    }
    for (;;) {
      bool any = false;
#pragma unroll
      for (int i = 0; i < B; ++i) any |= stale[i];
      if (!any) break;
      poll_pause();
#pragma unroll
      for (int i = 0; i < B; ++i)
        if (stale[i])
          stale[i] = static_cast<unsigned>(load_word_relaxed(flags + c0 + 32 * i + lane) >> 32) !=
                     tag;
    }
  }
  fence_acquire_gpu();
}

// One lane's part of a (sample, group)'s statistics: chunks first, first + step, ... of its
// published pairs (chunk c at pairs[2 c], pairs[2 c + 1]; one 8-byte load through L2), as sums
// shifted by chunk 0's mean s (which every lane reads too): sum[0] = sum of n_c (mean_c - s),
// sum[1] = sum of M2_c + n_c (mean_c - s)^2, n_c = rows_c * cg; the group's mean is s + S0 / N
// and its M2 = S1 - S0^2 / N (N = hw * cg) once the lanes' sums are added. Plain sums, not a
// chain of Chan merges (run 149: welford_merge per chunk and per butterfly level); the shift is
// one chunk's mean, so what cancels is bounded by the spread of the chunk means around it.
// kNhwcGatherBatch chunks' loads issued at once. Returns s (loaded once: a second load_cg of it
// for the mean cost another L2 round trip, run 151's stamps).
__device__ __forceinline__ float nhwc_gather_lane(const float* pairs, int chunks, int first,
                                                  int step, int chunk_rows, int hw, float cg,
                                                  float (&sum)[2]) {
  constexpr int B = kNhwcGatherBatch;
  const float s = load_cg(pairs);
  sum[0] = sum[1] = 0.0f;
  for (int c0 = first; c0 < chunks; c0 += B * step) {
    float2 v[B];
#pragma unroll
    for (int i = 0; i < B; ++i) {
      const int c = c0 + i * step;
      v[i] = c < chunks ? load_cg2(pairs + 2 * c) : make_float2(0.0f, 0.0f);
    }
#pragma unroll
    for (int i = 0; i < B; ++i) {
      const int c = c0 + i * step;
      if (c < chunks) {
        const float nc = static_cast<float>(min(chunk_rows, hw - c * chunk_rows)) * cg;
        const float d = v[i].x - s;
        sum[0] = fmaf(nc, d, sum[0]);
        sum[1] += fmaf(nc * d, d, v[i].y);
      }
    }
  }
  return s;
}

// *p loaded where this is written and used later (an asm volatile load stays in place; a plain
// load may be moved down to its first use, which would put its latency there). Host C++ (the CPU
// kernel emulator): a plain load.
template <class T>
__device__ __forceinline__ T load_early(const T* p) {
#ifdef __CUDACC_RTC__
  if constexpr (sizeof(T) == 2) {
    T t;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(t.bits) : "l"(p));
    return t;
  } else {
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
  }
#else
  return *p;
#endif
}

// x, y: contiguous [N, hw, C] (16-byte aligned, C % VEC == 0); grid N * chunks blocks of
// kNhwcResidentThreads, all resident at once; state: the per-stream ring2 state with room for
// N * chunks + N * groups * chunks 64-bit words.
// (One block per SM: runs 145-146 measured two per SM slower at every shape, and at the
// 64 registers two would allow, this kernel spills.)
template <class T>
__global__ void __launch_bounds__(kNhwcResidentThreads, 1)
group_norm_nhwc_resident(const T* x, T* y, const T* __restrict__ w, const T* __restrict__ b,
                         unsigned* state, int hw, int C, int groups, int cg, int chunks,
                         int chunk_rows, float eps, int act) {
  constexpr int VEC = 16 / sizeof(T);
  using R = RawUnit<T, VEC>;
  using Raw = typename R::type;
  extern __shared__ uint4 nhwc_smem[];
  const int U = C / VEC, phases = static_cast<int>(blockDim.x) / U, active_threads = phases * U;
  const int tid = threadIdx.x, col = tid % U, phase = tid / U;
  const bool active = tid < active_threads;
  const int n = blockIdx.x / chunks, p = blockIdx.x - n * chunks;
  const int row0 = p * chunk_rows, rows = min(chunk_rows, hw - row0);
  const int units = rows * U;
  const long long base = (static_cast<long long>(n) * hw + row0) * C;

  float* chan = reinterpret_cast<float*>(nhwc_smem);
  float* cmu = chan + C;
  float* csc = cmu + C;
  float* csh = csc + C;
  float* ps1 = csh + C;
  float* ps2 = ps1 + phases * C;
  float* run_mean = ps2 + phases * C;
  float* grp = run_mean + groups;
  Raw* run = reinterpret_cast<Raw*>(nhwc_smem) + (4 * C + 2 * phases * C + 3 * groups + 3) / 4;

  unsigned long long* flags = reinterpret_cast<unsigned long long*>(state + 4);
  float* pairs = reinterpret_cast<float*>(flags + static_cast<long long>(gridDim.x));
  const unsigned tag = load_relaxed(state) + 1u;

  RESIDENT_MARK(0);   // (stamps: -DGPUOPS_RESIDENT_TRACE, experiments only)
  // copy: every unit of this thread in flight, one commit group each
  int mine = 0;
  if (active) {
    for (int i = tid; i < units; i += active_threads, ++mine) {
      copy16_to_shared(run + i, x + base + static_cast<long long>(i) * VEC);
      copy_async_commit();
    }
  }
  // w and b of channel tid loaded now, used after the statistics (their latency hidden by the
  // landing; run 148's stamps: a load used at once here held back the sums by ~1 us, and in run
  // 149 plain loads were moved down to their use)
  const bool wb_here = tid < C;
  const T w_raw = wb_here && w != nullptr ? load_early(w + tid) : T{};
  const T b_raw = wb_here && b != nullptr ? load_early(b + tid) : T{};
  RESIDENT_MARK(1);
  // stats in one pass as the units land: shifted sums, the shift of channel c its value in the
  // run's first row (the first unit of the threads of row phase 0, into cmu)
  copy_async_wait(mine - 1);
  float k[VEC];
  if (active && phase == 0) {
    R::unpack(run[col], k);
    float4* dst = reinterpret_cast<float4*>(cmu + col * VEC);
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q) dst[q] = make_float4(k[4 * q], k[4 * q + 1], k[4 * q + 2],
                                                           k[4 * q + 3]);
  }
  __syncthreads();
  float s1[VEC], s2[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) s1[j] = s2[j] = 0.0f;
  if (active) {
    nhwc_table<VEC>(cmu, col, k);
    for (int u = 0; u < mine; ++u) {
      copy_async_wait(mine - 1 - u);
      float f[VEC];
      R::unpack(run[tid + u * active_threads], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = f[j] - k[j];
        s1[j] += d;
        s2[j] = fmaf(d, d, s2[j]);
      }
    }
  }
  RESIDENT_MARK(2);
  for (int c = tid; c < C; c += blockDim.x) {     // (read by the apply's table, after barriers)
    const bool first = c == tid;
    csc[c] = w == nullptr ? 1.0f : to_float(first ? w_raw : w[c]);
    csh[c] = b == nullptr ? 0.0f : to_float(first ? b_raw : b[c]);
  }
  nhwc_run_stats<VEC>(s1, s2, active, col, phase, C, phases, groups, cg, rows, ps1, ps2, chan, cmu,
                      run_mean, grp);
  RESIDENT_MARK(4);

  // publish: the pairs, then (after the block's barrier) the run's flag with release semantics
  for (int g = tid; g < groups; g += blockDim.x) {
    float* dst = pairs + ((static_cast<long long>(n) * groups + g) * chunks + p) * 2;
    store_cg(dst, run_mean[g]);
    store_cg(dst + 1, grp[g]);
  }
  __syncthreads();
  if (tid == 0) store_word_release(flags + blockIdx.x, ring_word(0.0f, tag));
  RESIDENT_MARK(5);
  if (tid < 32) nhwc_wait_flags(flags + static_cast<long long>(n) * chunks, chunks, tag);
  __syncthreads();
  RESIDENT_MARK(9);

  // gather: L lanes per group (a power of two, as many as the block has for every group at once),
  // each lane's chunks added up (nhwc_gather_lane), then a butterfly of sums over the L lanes
  int lanes = 32;
  while (lanes > 1 && static_cast<int>(blockDim.x) / lanes < groups) lanes >>= 1;
  const int slots = static_cast<int>(blockDim.x) / lanes;
  for (int g0 = 0; g0 < groups; g0 += slots) {
    const int g = g0 + tid / lanes;
    const float* gp =
        pairs + (static_cast<long long>(n) * groups + min(g, groups - 1)) * chunks * 2;
    float sum[2] = {0.0f, 0.0f}, shift = 0.0f;
    if (g < groups)
      shift = nhwc_gather_lane(gp, chunks, tid % lanes, lanes, chunk_rows, hw,
                               static_cast<float>(cg), sum);
    for (int off = lanes / 2; off > 0; off >>= 1) {   // (a + b == b + a: the same bits everywhere)
      sum[0] += __shfl_xor_sync(0xffffffffu, sum[0], off);
      sum[1] += __shfl_xor_sync(0xffffffffu, sum[1], off);
    }
    if (g < groups && tid % lanes == 0) {
      const float inv_n = 1.0f / (static_cast<float>(hw) * static_cast<float>(cg));
      const float d = sum[0] * inv_n;
      grp[2 * g] = shift + d;
      const float m2 = fmaxf(sum[1] - sum[0] * d, 0.0f);
      grp[2 * g + 1] = 1.0f / sqrtf(m2 * inv_n + eps);   // correctly rounded, as group_norm.cu
    }
  }
  __syncthreads();
  RESIDENT_MARK(10);
  for (int c = tid; c < C; c += blockDim.x) {
    const int g = c / cg;
    cmu[c] = grp[2 * g];
    csc[c] *= grp[2 * g + 1];
  }
  __syncthreads();
  RESIDENT_MARK(6);

  // apply
  if (active) {
    float mu[VEC], sc[VEC], sh[VEC];
    nhwc_table<VEC>(cmu, col, mu);
    nhwc_table<VEC>(csc, col, sc);
    nhwc_table<VEC>(csh, col, sh);
    T* dst = y + base;
    for (int k = 0; k < mine; ++k) {
      const int i = tid + k * active_threads;
      float f[VEC];
      R::unpack(run[i], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float v = fmaf(f[j] - mu[j], sc[j], sh[j]);
        f[j] = act ? silu_f(v) : v;
      }
      R::store(dst + static_cast<long long>(i) * VEC, R::pack(f));
    }
  }
  RESIDENT_MARK(7);
  ring2_epoch_end(state, tag);
  RESIDENT_MARK(8);
}

}  // namespace gpuops
