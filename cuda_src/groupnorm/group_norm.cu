// GroupNorm forward with an optional fused SiLU: y = act((x - mean_g) * rstd_g * w[c] + b[c]),
// statistics over each (sample, group): Cg = C / G channels times all spatial positions. fp32 math
// for every storage type; the biased variance, as torch.
//
// The designs (the host, gpuops/ops/group_norm.py, picks one per call):
//  * group_norm_onchip[_cluster]: NCHW, a group (or, with a Hopper cluster of S blocks, 1/S of a
//    group per block) held in registers as 16-byte packs. Read once, exact two-pass statistics on
//    the registers (sum, then sum of squared deviations), the S blocks' (n, mean, M2) exchanged
//    through distributed shared memory and merged (Chan), then normalized and written once.
//  * group_norm_nchw_stats + _apply: NCHW groups too large for the chip (or unaligned rows):
//    chunks of a group reduce to (n, mean, M2) partials in a workspace, then each chunk merges its
//    group's partials and normalizes; reads x twice (the second read mostly from L2).
//  * group_norm_nhwc_stats + _apply: channels-last [N, HW, C]. A block covers a tile of rows times
//    a slab of whole groups' channels, so its loads are rows of contiguous channels; per-channel
//    Welford over the rows, merged per group into (n, mean, M2) partials per tile; the apply kernel
//    merges the tiles' partials of its slab's groups and normalizes.
//  * group_norm_spread / group_norm_nhwc_spread (round 2, the end of this file): one launch, x
//    read once, for NCHW and channels-last; the grid and the blocks per SM sized by the host so
//    that the blocks really occupy all SMs, and the per-element work trimmed (see there).
#include "common/fastmath.cuh"
#include "common/activations.cuh"
#include "common/dtypes.cuh"
#include "common/fastdiv.cuh"
#include "common/group_stats.cuh"
#include "common/mma.cuh"         // copy16_to_shared: group_norm_stream's prefetch
#include "common/reduce.cuh"
#include "common/vec.cuh"

namespace gpuops {

template <class T>
__device__ __forceinline__ float gn_param(const T* p, int c, float absent) {
  return p != nullptr ? to_float(p[c]) : absent;
}

// 1 / sqrt(var + eps), correctly rounded steps (rsqrtf's 2 ulp would show in fp32 outputs that
// cancel against the bias); once per block, so the cost does not matter.
__device__ __forceinline__ float inv_std(float var, float eps) { return 1.0f / sqrtf(var + eps); }

// act: 0 none, 1 SiLU (silu_f: one MUFU.EX2 and one MUFU.RCP; a uniform branch: the same for
// the whole launch)
__device__ __forceinline__ float gn_act(float v, int act) { return act ? silu_f(v) : v; }

// Raw storage of one unit of VEC elements (a 16-byte pack, or one element), to fp32 and back.
template <class T, int VEC>
struct Unit {
  static_assert(VEC == Vec16<T>::size, "a unit is one element or one 16-byte pack");
  using Raw = uint4;
  static __device__ __forceinline__ Raw load(const T* p) { return load16(p); }
  static __device__ __forceinline__ void store(T* p, const Raw& r) { store16(p, r); }
  static __device__ __forceinline__ void store_evict_first(T* p, const Raw& r) {
    store16_evict_first(p, r);
  }
  static __device__ __forceinline__ void unpack(const Raw& r, float (&f)[VEC]) {
    Vec16<T>::unpack(r, f);
  }
  static __device__ __forceinline__ Raw pack(const float (&f)[VEC]) { return Vec16<T>::pack(f); }
};

template <class T>
struct Unit<T, 1> {
  using Raw = T;
  static __device__ __forceinline__ Raw load(const T* p) { return *p; }
  static __device__ __forceinline__ void store(T* p, const Raw& r) { *p = r; }
  static __device__ __forceinline__ void store_evict_first(T* p, const Raw& r) { *p = r; }
  static __device__ __forceinline__ void unpack(const Raw& r, float (&f)[1]) { f[0] = to_float(r); }
  static __device__ __forceinline__ Raw pack(const float (&f)[1]) { return from_float<T>(f[0]); }
};

// Sum of a pack, and sum of its squared deviations from `mean`, as balanced trees (short
// dependency chains; the thread's running sums add one value per pack).
template <int VEC>
__device__ __forceinline__ float pack_sum(const float (&f)[VEC]) {
  float s[VEC / 2];
#pragma unroll
  for (int j = 0; j < VEC / 2; ++j) s[j] = f[2 * j] + f[2 * j + 1];
  if constexpr (VEC == 8) return (s[0] + s[1]) + (s[2] + s[3]);
  else return s[0] + s[1];
}

template <int VEC>
__device__ __forceinline__ float pack_m2(const float (&f)[VEC], float mean) {
  float s[VEC / 2];
#pragma unroll
  for (int j = 0; j < VEC / 2; ++j) {
    const float d0 = f[2 * j] - mean, d1 = f[2 * j + 1] - mean;
    s[j] = fmaf(d1, d1, d0 * d0);
  }
  if constexpr (VEC == 8) return (s[0] + s[1]) + (s[2] + s[3]);
  else return s[0] + s[1];
}

// Exact two-pass statistics of a block's slice held in registers: packs p0 + threadIdx.x + k *
// blockDim.x < p1 (k < PACKS); `count` elements, their mean and M2 (block_sum: every thread gets
// them; `scratch` holds 32 floats of shared memory).
// after_read(sum) runs once this thread's first pass has consumed every pack it holds (sum
// depends on them all): group_norm_stream reuses their shared-memory source from there on.
struct NoHook {
  __device__ __forceinline__ void operator()(float) const {}
};

template <class T, int PACKS, class Hook = NoHook>
__device__ __forceinline__ void slice_stats(const uint4 (&raw)[PACKS], int p0, int p1,
                                            float* scratch, int& count, float& mean, float& m2,
                                            Hook after_read = Hook()) {
  using V = Vec16<T>;
  constexpr int VEC = V::size;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    if (p0 + tid + k * nthreads < p1) {
      float f[VEC];
      V::unpack(raw[k], f);
      sum += pack_sum<VEC>(f);
    }
  }
  after_read(sum);
  count = max(p1 - p0, 0) * VEC;
  sum = block_sum(sum, scratch);
  mean = count > 0 ? sum / static_cast<float>(count) : 0.0f;
  float s2 = 0.0f;
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    if (p0 + tid + k * nthreads < p1) {
      float f[VEC];
      V::unpack(raw[k], f);
      s2 += pack_m2<VEC>(f, mean);
    }
  }
  m2 = block_sum(s2, scratch);
}

// The group's (mean, rstd) from the (n, mean, M2) of the CLUSTER blocks that hold it (sm_90):
// each block stores its own in *part (shared memory), the cluster barrier makes them visible,
// lane r of warp 0 reads block r's through distributed shared memory and the warp merges them in
// rank order (identical statistics in every block); thread 0 writes out[0] = mean, out[1] = rstd.
// Ends with cluster_arrive (done reading the others' part): the caller must cluster_wait before
// exiting, and __syncthreads before reading out. kWaitFirst (a loop's later rounds): first the
// cluster_wait that pairs with the previous round's arrive, so that no block overwrites its part
// while another may still read it.
template <int CLUSTER, bool kWaitFirst = false>
__device__ __forceinline__ void cluster_mean_rstd(float4* part, float count, float mean, float m2,
                                                  float eps, float* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int tid = threadIdx.x;
  if constexpr (kWaitFirst) cluster_wait();
  if (tid == 0) *part = make_float4(count, mean, m2, 0.0f);
  cluster_sync();
  if (tid < 32) {
    MeanM2 st = {0.0f, 0.0f, 0.0f};
    if (tid < CLUSTER) {
      const float4 o = *cluster_map(part, static_cast<unsigned int>(tid));
      st = {o.x, o.y, o.z};
    }
    st = warp_merge(st);
    if (tid == 0) {
      out[0] = st.mean;
      out[1] = inv_std(st.m2 / st.n, eps);
    }
  }
  cluster_arrive();
#endif
}

// ------------------------------------------------------------------------------------------------
// On-chip NCHW kernel. Block `rank` of group `group` holds packs [rank * slice_packs, ... +
// slice_packs) of the group's group_packs 16-byte packs (hw % VEC == 0, so a pack never straddles
// two channels), PACKS per thread, strided by blockDim.x so that every load instruction of a warp
// is one contiguous 512-byte run.

constexpr int kOnchipThreads = 1024;

template <class T, int PACKS, int CLUSTER>
__device__ __forceinline__ void group_norm_onchip_body(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
    int hw, int cg, int groups, int group_packs, int slice_packs, float eps, int act, int group,
    int rank) {
  using V = Vec16<T>;
  constexpr int VEC = V::size;
  __shared__ float scratch[32];
  __shared__ float4 part;   // this block's (n, mean, M2), read by the cluster's other blocks
  __shared__ float stats[2];   // the group's mean and rstd
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const long long base = static_cast<long long>(group) * group_packs * VEC;
  const T* xg = x + base;
  T* yg = y + base;
  const int p0 = rank * slice_packs;
  const int p1 = min(p0 + slice_packs, group_packs);

  uint4 raw[PACKS];
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    const int p = p0 + tid + k * nthreads;
    if (p < p1) raw[k] = load16(xg + p * VEC);
  }

  int count;
  float block_mean, m2;
  slice_stats<T, PACKS>(raw, p0, p1, scratch, count, block_mean, m2);

  // Group statistics to every thread through shared memory. With a cluster, the blocks' (n,
  // mean, M2) first go through distributed shared memory: lane r of warp 0 reads block r's, and
  // the warp merges them in a fixed order, so that every block gets identical statistics.
  if constexpr (CLUSTER > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cluster_mean_rstd<CLUSTER>(&part, static_cast<float>(count), block_mean, m2, eps, stats);
#else
    __trap();           // never launched below sm_90 (the host checks the loaded target)
#endif
  } else {
    if (tid == 0) {
      stats[0] = block_mean;
      stats[1] = inv_std(m2 / static_cast<float>(count), eps);
    }
  }
  __syncthreads();
  const float mean = stats[0], rstd = stats[1];
  const int c0 = (group % groups) * cg;
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    const int p = p0 + tid + k * nthreads;
    if (p < p1) {
      const int c = c0 + (p * VEC) / hw;
      const float a = rstd * gn_param(w, c, 1.0f);
      const float s = gn_param(b, c, 0.0f);
      float f[VEC];
      V::unpack(raw[k], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = gn_act(fmaf(f[j] - mean, a, s), act);
      store16(yg + p * VEC, V::pack(f));
    }
  }

  if constexpr (CLUSTER > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cluster_wait();     // no block may exit while another still reads its `part`
#endif
  }
}

// One block per group (grid = N * G blocks).
template <class T, int PACKS>
__global__ void __launch_bounds__(kOnchipThreads) group_norm_onchip(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
    int hw, int cg, int groups, int group_packs, int slice_packs, float eps, int act) {
  group_norm_onchip_body<T, PACKS, 1>(x, w, b, y, hw, cg, groups, group_packs, slice_packs, eps,
                                      act, blockIdx.x, 0);
}

// A cluster of CLUSTER blocks per group (grid = N * G * CLUSTER blocks), sm_90 only.
template <class T, int PACKS, int CLUSTER>
__global__ void GPUOPS_CLUSTER_DIMS(CLUSTER) __launch_bounds__(kOnchipThreads)
group_norm_onchip_cluster(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
    int hw, int cg, int groups, int group_packs, int slice_packs, float eps, int act) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster_nctarank() != CLUSTER) {
    // Not launched as clusters of CLUSTER blocks (which the compiled-in cluster size should make
    // impossible): the partials would be garbage. Write NaN over this block's slice instead (a
    // visible failure that, unlike __trap, leaves the context usable) and skip every barrier.
    const int p0 = static_cast<int>(blockIdx.x % CLUSTER) * slice_packs;
    const int p1 = min(p0 + slice_packs, group_packs);
    T* yg = y + static_cast<long long>(blockIdx.x / CLUSTER) * group_packs * Vec16<T>::size;
    for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x)
      store16(yg + p * Vec16<T>::size, make_uint4(~0u, ~0u, ~0u, ~0u));
    return;
  }
  group_norm_onchip_body<T, PACKS, CLUSTER>(x, w, b, y, hw, cg, groups, group_packs, slice_packs,
                                            eps, act, blockIdx.x / CLUSTER,
                                            static_cast<int>(cluster_ctarank()));
#else
  __trap();
#endif
}

// ------------------------------------------------------------------------------------------------
// Two-pass NCHW kernels. A group is group_units units of VEC elements (VEC = 16 bytes when hw and
// the pointers allow it, else 1). The stats kernel cuts it into `chunks` chunks of chunk_units
// (block b: chunk b % chunks of group b / chunks; part[b] = (n, mean, M2, 0) of that chunk); the
// apply kernel into tiles of kTwoPassThreads * kUnroll units (block b: tile b % tiles of group
// b / tiles), each merging its group's partials first. Runs 127-131 (fp32 [1, 256, 256, 256]:
// 86.4 -> 70.0 us against an earlier pair of these kernels, torch.compile 72.6):
//  * stats: kStatsUnroll units in flight per thread, and shifted sums instead of a Chan merge (and
//    its division) per unit: a thread sums d = x - s and d * d, s the mean of its first unit, then
//    forms (n, mean, M2) once. The shift removes any common offset, and the cancellation left in
//    M2 = S2 - S1^2 / n is bounded by the thread's own spread around one of its own units. Chunks
//    of one round of loads each, over many waves (the host's plan).
//  * apply: one tile per block (many short blocks, as a pointwise kernel: no loop), its loads
//    issued before the block merges its group's partials (sm_70+) so that their latency hides the
//    merge; a unit's channel by a multiply-shift divider.

constexpr int kTwoPassThreads = 256;
constexpr int kUnroll = 4;   // units loaded before any is used: bytes in flight per thread

// The data block of an apply kernel (data blocks numbered in memory order, as its stats kernel's
// blocks are). reverse: the last block's data first. Blocks start roughly in index order, so the
// stats kernel leaves the highest-numbered blocks' data in L2, least recently used first evicted:
// a forward apply pass over data larger than L2 evicts each line just before it is needed (no
// hits at all), a reverse pass reads the most recently cached lines first (run 131: 70.0 against
// 76.6 us forward at fp32 [1, 256, 256, 256]).
__device__ __forceinline__ int apply_block(int reverse) {
  return reverse ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
}

// The lanes of one full warp merge `count` partials (float4 (n, mean, M2, -)) at p[0..count).
__device__ __forceinline__ MeanM2 warp_merge_partials(const float4* __restrict__ p, int count) {
  MeanM2 st = {0.0f, 0.0f, 0.0f};
  for (int i = threadIdx.x & 31; i < count; i += 32) {
    const float4 v = p[i];
    chan_merge(st, v.x, v.y, v.z);
  }
  return warp_merge(st);
}

constexpr int kStatsUnroll = 8;

template <class T, int VEC>
__global__ void __launch_bounds__(kTwoPassThreads, 4) group_norm_nchw_stats(
    const T* __restrict__ x, float4* __restrict__ part, int group_units, int chunk_units,
    int chunks) {
  using U = Unit<T, VEC>;
  __shared__ float4 scratch[32];
  const int group = blockIdx.x / chunks, chunk = blockIdx.x - group * chunks;
  const T* xg = x + static_cast<long long>(group) * group_units * VEC;
  const int u0 = chunk * chunk_units;
  const int u1 = min(u0 + chunk_units, group_units);
  float shift = 0.0f, s1 = 0.0f, s2 = 0.0f;
  int count = 0;
  for (int u = u0 + threadIdx.x; u < u1; u += kStatsUnroll * kTwoPassThreads) {
    typename U::Raw raw[kStatsUnroll];
#pragma unroll
    for (int k = 0; k < kStatsUnroll; ++k) {
      const int uk = u + k * kTwoPassThreads;
      if (uk < u1) raw[k] = U::load(xg + static_cast<long long>(uk) * VEC);
    }
    if (count == 0) {                    // the first iteration: raw[0] exists (u < u1)
      float f[VEC];
      U::unpack(raw[0], f);
      float m = 0.0f;
#pragma unroll
      for (int j = 0; j < VEC; ++j) m += f[j];
      shift = m * (1.0f / VEC);
    }
#pragma unroll
    for (int k = 0; k < kStatsUnroll; ++k) {
      if (u + k * kTwoPassThreads < u1) {
        float f[VEC];
        U::unpack(raw[k], f);
        float a = 0.0f, q = 0.0f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = f[j] - shift;
          a += d;
          q = fmaf(d, d, q);
        }
        s1 += a;
        s2 += q;
        count += VEC;
      }
    }
  }
  MeanM2 st = {static_cast<float>(count), 0.0f, 0.0f};
  if (count > 0) {
    const float m = s1 / st.n;
    st.mean = shift + m;
    st.m2 = fmaxf(fmaf(-s1, m, s2), 0.0f);
  }
  st = block_merge_to_thread0(st, scratch);
  if (threadIdx.x == 0) part[blockIdx.x] = make_float4(st.n, st.mean, st.m2, 0.0f);
}

template <class T, int VEC>
__global__ void __launch_bounds__(kTwoPassThreads) group_norm_nchw_apply(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
    const float4* __restrict__ part, int cg, int groups, int group_units, int tiles, int chunks,
    float eps, int act, int reverse, unsigned int hw_mul, unsigned int hw_shift) {
  using U = Unit<T, VEC>;
  __shared__ float stats[2];
  const int blk = apply_block(reverse);
  const int group = blk / tiles, tile = blk - group * tiles;
  const long long base = static_cast<long long>(group) * group_units * VEC;
  const T* xg = x + base;
  T* yg = y + base;
  const int u = tile * (kTwoPassThreads * kUnroll) + threadIdx.x;
  typename U::Raw raw[kUnroll];
  auto load_tile = [&]() {
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int uk = u + k * kTwoPassThreads;
      if (uk < group_units) raw[k] = U::load(xg + static_cast<long long>(uk) * VEC);
    }
  };
#if __CUDA_ARCH__ >= 700
  load_tile();
#endif
  if (threadIdx.x < 32) {
    const MeanM2 st = warp_merge_partials(part + static_cast<long long>(group) * chunks, chunks);
    if (threadIdx.x == 0) {
      stats[0] = st.mean;
      stats[1] = inv_std(st.m2 / st.n, eps);
    }
  }
  __syncthreads();
#if __CUDA_ARCH__ < 700
  load_tile();   // (sm_61: ptxas spilled the tile held across the merge's division)
#endif
  const float mean = stats[0], rstd = stats[1];
  const FastDiv per_channel = {0u, hw_mul, hw_shift};   // element index in the group -> channel
  const int c0 = (group % groups) * cg;
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int uk = u + k * kTwoPassThreads;
    if (uk < group_units) {
      // VEC > 1 only when hw % VEC == 0: a unit lies in one channel
      const int c = c0 + static_cast<int>(per_channel.div(static_cast<unsigned int>(uk * VEC)));
      const float a = rstd * gn_param(w, c, 1.0f);
      const float s = gn_param(b, c, 0.0f);
      float f[VEC];
      U::unpack(raw[k], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = gn_act(fmaf(f[j] - mean, a, s), act);
#ifdef GPUOPS_GN_APPLY_STORE_CS   // (A/B build option, group_norm_stats_probe.py: y evict-first)
      U::store_evict_first(yg + static_cast<long long>(uk) * VEC, U::pack(f));
#else
      U::store(yg + static_cast<long long>(uk) * VEC, U::pack(f));
#endif
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Channels-last kernels: x is [N, hw, c] in memory. Slab = sc consecutive channels (whole groups;
// sc % VEC == 0), P = sc / VEC units per slab row; a block has P * RS threads: thread t owns unit
// column t % P (VEC fixed channels) and rows ty = t / P, ty + RS, ... of its tile of tile_rows
// rows. Block b: slab b % slabs, tile (b / slabs) % tiles, sample b / (slabs * tiles) (slabs
// fastest, so that blocks running together read whole rows). Partials are part[(n * G + g) *
// tiles + tile].

constexpr int kNhwcMaxThreads = 512;

// Rows of a tile each phase ty sees: ty, ty + RS, ... < rows.
__device__ __forceinline__ float phase_rows(int rows, int ty, int rs) {
  return ty < rows ? static_cast<float>((rows - ty + rs - 1) / rs) : 0.0f;
}

template <class T, int VEC>
__global__ void __launch_bounds__(kNhwcMaxThreads, 1) group_norm_nhwc_stats(
    const T* __restrict__ x, float4* __restrict__ part, int hw, int c, int cg, int sc, int slabs,
    int tiles, int tile_rows) {
  using U = Unit<T, VEC>;
  extern __shared__ float4 smem4[];
  float* s_mean = reinterpret_cast<float*>(smem4);   // [RS][sc]: per channel and row phase
  float* s_m2 = s_mean + blockDim.x * VEC;
  const int P = sc / VEC, rs = blockDim.x / P;
  const int slab = blockIdx.x % slabs;
  const int rest = blockIdx.x / slabs;
  const int tile = rest % tiles, n = rest / tiles;
  const int col = threadIdx.x % P, ty = threadIdx.x / P;
  const int r0 = tile * tile_rows;
  const int rows = min(tile_rows, hw - r0);
  const T* xp = x + (static_cast<long long>(n) * hw + r0 + ty) * c + slab * sc + col * VEC;
  const long long step = static_cast<long long>(rs) * c;

  // Welford per channel over this thread's rows (all VEC channels share the count).
  float mean[VEC], m2[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) mean[j] = m2[j] = 0.0f;
  int k = 0;
  for (int r = ty; r < rows; r += kUnroll * rs) {
    typename U::Raw raw[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      if (r + i * rs < rows) raw[i] = U::load(xp + (static_cast<long long>(k) + i) * step);
    }
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      if (r + i * rs < rows) {
        float f[VEC];
        U::unpack(raw[i], f);
        const float inv = 1.0f / static_cast<float>(k + i + 1);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = f[j] - mean[j];
          mean[j] = fmaf(d, inv, mean[j]);
          m2[j] = fmaf(d, f[j] - mean[j], m2[j]);
        }
      }
    }
    k += kUnroll;
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    s_mean[threadIdx.x * VEC + j] = mean[j];
    s_m2[threadIdx.x * VEC + j] = m2[j];
  }
  __syncthreads();

  // One full warp per group of the slab: merge its cg channels x RS row phases.
  // (blockDim.x = P * RS need not be a multiple of 32: a trailing partial warp sits out.)
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int kg = sc / cg, entries = rs * cg;
  const int groups = c / cg;
  for (int gl = warp; warp < warps && gl < kg; gl += warps) {
    MeanM2 st = {0.0f, 0.0f, 0.0f};
    for (int e = threadIdx.x & 31; e < entries; e += 32) {
      const int ph = e / cg;
      const int idx = ph * sc + gl * cg + (e - ph * cg);
      chan_merge(st, phase_rows(rows, ph, rs), s_mean[idx], s_m2[idx]);
    }
    st = warp_merge(st);
    if ((threadIdx.x & 31) == 0) {
      const long long g = static_cast<long long>(n) * groups + slab * kg + gl;
      part[g * tiles + tile] = make_float4(st.n, st.mean, st.m2, 0.0f);
    }
  }
}

template <class T, int VEC>
__global__ void __launch_bounds__(kNhwcMaxThreads, 1) group_norm_nhwc_apply(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
    const float4* __restrict__ part, int hw, int c, int cg, int sc, int slabs, int tiles,
    int tile_rows, float eps, int act, int reverse) {
  using U = Unit<T, VEC>;
  extern __shared__ float4 smem4[];
  float* s_mean = reinterpret_cast<float*>(smem4);   // [kg]
  const int kg = sc / cg;
  float* s_rstd = s_mean + kg;
  const int P = sc / VEC, rs = blockDim.x / P;
  const int blk = apply_block(reverse);
  const int slab = blk % slabs;
  const int rest = blk / slabs;
  const int tile = rest % tiles, n = rest / tiles;
  const int groups = c / cg;

  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;   // full warps only
  for (int gl = warp; warp < warps && gl < kg; gl += warps) {
    const long long g = static_cast<long long>(n) * groups + slab * kg + gl;
    const MeanM2 st = warp_merge_partials(part + g * tiles, tiles);
    if ((threadIdx.x & 31) == 0) {
      s_mean[gl] = st.mean;
      s_rstd[gl] = inv_std(st.m2 / st.n, eps);
    }
  }
  __syncthreads();

  const int col = threadIdx.x % P, ty = threadIdx.x / P;
  float mean[VEC], scale[VEC], shift[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const int cl = col * VEC + j;           // channel within the slab
    const int ch = slab * sc + cl;
    const int gl = cl / cg;
    mean[j] = s_mean[gl];
    scale[j] = s_rstd[gl] * gn_param(w, ch, 1.0f);
    shift[j] = gn_param(b, ch, 0.0f);
  }
  const int r0 = tile * tile_rows;
  const int rows = min(tile_rows, hw - r0);
  const long long off = (static_cast<long long>(n) * hw + r0 + ty) * c + slab * sc + col * VEC;
  const T* xp = x + off;
  T* yp = y + off;
  const long long step = static_cast<long long>(rs) * c;
  int k = 0;
  for (int r = ty; r < rows; r += kUnroll * rs) {
    typename U::Raw raw[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      if (r + i * rs < rows) raw[i] = U::load(xp + (static_cast<long long>(k) + i) * step);
    }
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      if (r + i * rs < rows) {
        float f[VEC];
        U::unpack(raw[i], f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] = gn_act(fmaf(f[j] - mean[j], scale[j], shift[j]), act);
        U::store(yp + (static_cast<long long>(k) + i) * step, U::pack(f));
      }
    }
    k += kUnroll;
  }
}

// ------------------------------------------------------------------------------------------------
// Spread kernels (round 2). Why: at [2, 320, 64, 64] the on-chip kernels above used 64 of 132 SMs
// (one block per group; cluster blocks share SMs when the registers allow), and their per-element
// work was MUFU-bound (SiLU = ex2 + rcp, 16 MUFU lanes per clock per SM) with an integer division,
// two dependent weight/bias loads and the activation branch in every pack
// (benchmarks/notes_groupnorm_copy.md, round 2). Here:
//  * the host sizes the grid and reserves dynamic shared memory so that exactly one (one wave) or
//    two (several waves: one block loads while the other computes) blocks share an SM;
//  * a slice's per-channel (rstd * w, b) are computed once per block into shared memory, from
//    weight/bias values loaded together with x; a pack's channel is a multiply-shift division;
//  * y = (x - mean) * (rstd * w) + b: one FADD more than torch's x * scale + (b - mean * scale),
//    whose rounding of mean * scale costs ~ulp(mean) / std relative (4e-3 at mean / std = 3e4);
//  * SiLU takes some of its reciprocals from Newton-Raphson on the FMA pipe instead of MUFU, which
//    balances the two pipes (silu_pack);
//  * everything the cluster's other blocks read lives in dynamic shared memory (the CPU emulator
//    gives each block its own).

constexpr int kSpreadPacks = 7;       // 16-byte packs per thread (NCHW; 8 spill at 64 registers)
constexpr int kSpreadThreads = 1024;

// 1 / d for 1 <= d <= 2^126 on the FMA pipe: a bit-trick seed (relative error < 0.13) and three
// Newton-Raphson steps (error squared each: < 4e-8, plus rounding).
__device__ __forceinline__ float rcp_newton(float d) {
  float r = __int_as_float(0x7ef311c3 - __float_as_int(d));
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    const float e = fmaf(-d, r, 1.0f);
    r = fmaf(r, e, r);
  }
  return r;
}

// silu_f with the reciprocal by rcp_newton: 1 + 2^t > 2^126 gives 0, as rcp.approx.ftz does
// (so -inf -> NaN and v << 0 -> -0, as torch); NaN stays NaN.
__device__ __forceinline__ float silu_newton(float v) {
  const float t = -1.4426950408889634f * v;
  const float r = rcp_newton(1.0f + fast_exp2(t));
  return v * (t > 126.0f ? 0.0f : r);
}

// SiLU of a pack, some reciprocals by Newton-Raphson instead of MUFU.RCP. Per warp and element a
// MUFU op occupies its pipe for 8 clocks, an issue slot 1; silu_f issues 5 instructions (2 of
// them MUFU), silu_newton 13 (1 MUFU), and the pack's unpack / scale / store add ~5 per element.
// 16-bit (8 per pack): 3 Newton elements give ~13 issue clocks and 13 MUFU clocks per element
// (all MUFU: 16 MUFU-bound; half and half: 14.4 issue-bound); fp32 (4 per pack): 1 of 4, ~14.5.
template <int VEC>
__device__ __forceinline__ void silu_pack(float (&f)[VEC]) {
  constexpr unsigned int newton = VEC == 8 ? 0x49u : 0x2u;   // elements {0, 3, 6} / {1}
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = ((newton >> j) & 1u) ? silu_newton(f[j]) : silu_f(f[j]);
}

// NCHW. Block `rank` of group `group` holds packs [rank * slice_packs, ... + slice_packs) of the
// group's group_packs 16-byte packs (hw % VEC == 0: a pack lies in one channel), kSpreadPacks per
// thread, strided by blockDim.x (each load instruction of a warp is one 512-byte run). Grid =
// N * G * CLUSTER blocks. ppc divides by the packs per channel (hw / VEC). Offsets within a group
// are 32-bit (the host keeps groups below 2^31 elements; with 64-bit ones NVVM lost the 16-byte
// alignment of the stores and split each into four).
// Dynamic shared memory, float4 units: [0, 8) block-reduction scratch (32 floats); [8] this
// block's (n, mean, M2), read by the cluster's other blocks; [9] the group's (mean, rstd);
// [10, ...) (rstd * w, b) per channel of the slice, as float2 (the host sizes it, and may add a
// reservation that keeps other blocks off the SM).
constexpr int kSpreadCoef = 10;

// A cluster kernel that finds itself launched without clusters (the host never does that; a
// driver might): NaN over packs [p0, p1) of groups g0, g0 + step, ... < items, a visible failure
// that leaves the context usable (no barrier, no __trap).
template <class T>
__device__ __forceinline__ void poison_slices(T* __restrict__ y, int g0, int step, int items,
                                              int group_packs, int p0, int p1) {
  constexpr int VEC = Vec16<T>::size;
  for (int g = g0; g < items; g += step) {
    T* yg = y + static_cast<long long>(g) * group_packs * VEC;
    for (int p = p0 + static_cast<int>(threadIdx.x); p < p1; p += blockDim.x)
      store16(yg + static_cast<long long>(p) * VEC, make_uint4(~0u, ~0u, ~0u, ~0u));
  }
}

template <class T, int ACT>
__device__ __forceinline__ void spread_apply(const uint4 (&raw)[kSpreadPacks], T* __restrict__ yg,
                                             int p0, int p1, const FastDiv& ppc, int cf,
                                             const float2* coef, float mean) {
  using V = Vec16<T>;
  constexpr int VEC = V::size;
  const int tid = threadIdx.x, nthreads = blockDim.x;
#pragma unroll
  for (int k = 0; k < kSpreadPacks; ++k) {
    const int p = p0 + tid + k * nthreads;
    if (p < p1) {
      const float2 ab = coef[static_cast<int>(ppc.div(static_cast<unsigned int>(p))) - cf];
      float f[VEC];
      V::unpack(raw[k], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = fmaf(f[j] - mean, ab.x, ab.y);
      if constexpr (ACT != 0) silu_pack<VEC>(f);
      store16(yg + p * VEC, V::pack(f));
    }
  }
}

template <class T, int CLUSTER>
__global__ void GPUOPS_CLUSTER_DIMS(CLUSTER) __launch_bounds__(kSpreadThreads, 1)
group_norm_spread(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                  T* __restrict__ y, int groups, int cg, int group_packs, int slice_packs,
                  FastDiv ppc, float eps, int act) {
  using V = Vec16<T>;
  constexpr int VEC = V::size;
  extern __shared__ float4 gn_smem[];
  float* scratch = reinterpret_cast<float*>(gn_smem);
  float4* part = gn_smem + 8;
  float4* stats = gn_smem + 9;
  float2* coef = reinterpret_cast<float2*>(gn_smem + kSpreadCoef);
  const int tid = threadIdx.x, nthreads = blockDim.x;
  int group = blockIdx.x, rank = 0;
  if constexpr (CLUSTER > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // clusters are CLUSTER consecutive blocks along x: the rank from blockIdx stays in uniform
    // registers (cluster_ctarank's special register does not, which cost ~20 registers)
    group = blockIdx.x / CLUSTER;
    rank = static_cast<int>(blockIdx.x % CLUSTER);
    if (cluster_nctarank() != CLUSTER) {
      const int p0 = rank * slice_packs;
      poison_slices(y, group, 1, group + 1, group_packs, p0, min(p0 + slice_packs, group_packs));
      return;
    }
#else
    __trap();           // never launched below sm_90 (the host checks the loaded target)
#endif
  }
  const long long base = static_cast<long long>(group) * group_packs * VEC;
  const T* xg = x + base;
  T* yg = y + base;
  const int p0 = rank * slice_packs;
  const int p1 = min(p0 + slice_packs, group_packs);
  const int c0 = (group % groups) * cg;                  // the group's first channel
  const int cf = p1 > p0 ? static_cast<int>(ppc.div(static_cast<unsigned int>(p0))) : 0;
  const int nch = p1 > p0 ? static_cast<int>(ppc.div(static_cast<unsigned int>(p1 - 1))) - cf + 1
                          : 0;                           // channels of this slice: cf, cf + 1, ...
  uint4 raw[kSpreadPacks];
#pragma unroll
  for (int k = 0; k < kSpreadPacks; ++k) {
    const int p = p0 + tid + k * nthreads;
    if (p < p1) raw[k] = load16(xg + p * VEC);
  }
  // the slice's weight and bias into shared memory while x is in flight (weight made rstd *
  // weight in place once the statistics are known; block_sum's barriers order the writes)
  for (int i = tid; i < nch; i += nthreads)
    coef[i] = make_float2(gn_param(w, c0 + cf + i, 1.0f), gn_param(b, c0 + cf + i, 0.0f));

  int count;
  float block_mean, m2;
  slice_stats<T, kSpreadPacks>(raw, p0, p1, scratch, count, block_mean, m2);

  // the group's statistics: with a cluster, Chan's merge of the blocks' (n, mean, M2) read
  // through distributed shared memory by warp 0, in rank order (identical in every block)
  if constexpr (CLUSTER > 1) {
    cluster_mean_rstd<CLUSTER>(part, static_cast<float>(count), block_mean, m2, eps,
                               reinterpret_cast<float*>(stats));
  } else {
    if (tid == 0)
      *stats = make_float4(block_mean, inv_std(m2 / static_cast<float>(count), eps), 0.0f, 0.0f);
  }
  __syncthreads();
  const float mean = stats->x, rstd = stats->y;
  for (int i = tid; i < nch; i += nthreads) coef[i].x *= rstd;
  __syncthreads();
  if (act) spread_apply<T, 1>(raw, yg, p0, p1, ppc, cf, coef, mean);
  else spread_apply<T, 0>(raw, yg, p0, p1, ppc, cf, coef, mean);

  if constexpr (CLUSTER > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cluster_wait();     // no block may exit while another still reads its `part`
#endif
  }
}

// ------------------------------------------------------------------------------------------------
// Streaming NCHW kernel (round 3). Why: when the groups take several waves of one-shot blocks
// (the on-chip and spread kernels above), each wave loads, then waits on its statistics with
// DRAM idle, then stores, and a partial last wave leaves SMs idle (run 116: [8, 640, 64, 64] 16-bit
// at 43.6 us against a 30.0 us copy of the same bytes). Here the grid is persistent, two blocks
// per SM: cluster c (CLUSTER blocks, or one block) takes the groups c, c + clusters, ..., block
// `rank` holding the same slice of each (packs [rank * slice_packs, ...), kSpreadPacks per thread
// in registers, as group_norm_spread). While a group's statistics, SiLU and stores run, the next
// group's slice is already on its way into shared memory (cp.async); it moves to the registers
// when the stores have been issued. Each thread copies and reads back only its own packs, so the
// buffer needs no barrier; it is refilled only after the thread's first statistics pass has
// consumed every pack it read from it (slice_stats' hook: the copies are issued after an empty
// asm that takes that pass's sum, which depends on all of them).
// Dynamic shared memory, float4 units: [0, 10) as group_norm_spread (scratch, part, stats);
// [10, 10 + kSpreadPacks * blockDim.x) the prefetch buffer (pack k of thread t at k * blockDim.x
// + t); then the slice's per-channel coefficients (float2), as group_norm_spread's.
constexpr int kStreamThreads = 384;   // 80 registers (at 448 or 512 threads ptxas spilled 4-8 B)

template <class T, int CLUSTER>
__global__ void GPUOPS_CLUSTER_DIMS(CLUSTER) __launch_bounds__(kStreamThreads, 2)
group_norm_stream(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                  T* __restrict__ y, int groups, int cg, int group_packs, int slice_packs,
                  int items, FastDiv ppc, float eps, int act) {
  using V = Vec16<T>;
  constexpr int VEC = V::size;
  extern __shared__ float4 gn_smem[];
  float* scratch = reinterpret_cast<float*>(gn_smem);
  float4* part = gn_smem + 8;
  float4* stats = gn_smem + 9;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  uint4* ahead = reinterpret_cast<uint4*>(gn_smem + kSpreadCoef);
  float2* coef = reinterpret_cast<float2*>(gn_smem + kSpreadCoef + kSpreadPacks * nthreads);
  int item = blockIdx.x, rank = 0;
  const int clusters = static_cast<int>(gridDim.x) / CLUSTER;
  if constexpr (CLUSTER > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    item = blockIdx.x / CLUSTER;
    rank = static_cast<int>(blockIdx.x % CLUSTER);
    if (cluster_nctarank() != CLUSTER) {
      const int p0 = rank * slice_packs;
      poison_slices(y, item, clusters, items, group_packs, p0, min(p0 + slice_packs, group_packs));
      return;
    }
#else
    __trap();           // never launched below sm_90 (the host checks the loaded target)
#endif
  }
  if (item >= items) return;                      // (the host launches at most items clusters)
  const int p0 = rank * slice_packs;              // the same slice of every group
  const int p1 = min(p0 + slice_packs, group_packs);
  const int cf = p1 > p0 ? static_cast<int>(ppc.div(static_cast<unsigned int>(p0))) : 0;
  const int nch = p1 > p0 ? static_cast<int>(ppc.div(static_cast<unsigned int>(p1 - 1))) - cf + 1
                          : 0;
  uint4 raw[kSpreadPacks];
  {
    const T* xg = x + static_cast<long long>(item) * group_packs * VEC;
#pragma unroll
    for (int k = 0; k < kSpreadPacks; ++k) {
      const int p = p0 + tid + k * nthreads;
      if (p < p1) raw[k] = load16(xg + p * VEC);
    }
  }
  for (bool first = true;; first = false) {
    const int next = item + clusters;
    if (!first) __syncthreads();                  // every thread's apply has read coef
    const int c0 = (item % groups) * cg;
    for (int i = tid; i < nch; i += nthreads)
      coef[i] = make_float2(gn_param(w, c0 + cf + i, 1.0f), gn_param(b, c0 + cf + i, 0.0f));
    int count;
    float block_mean, m2;
    slice_stats<T, kSpreadPacks>(raw, p0, p1, scratch, count, block_mean, m2, [&](float sum) {
#ifdef __CUDACC_RTC__
      asm volatile("" :: "f"(sum));               // every pack read: the buffer may be refilled
#else
      (void)sum;
#endif
      if (next < items) {
        const T* xn = x + static_cast<long long>(next) * group_packs * VEC;
#pragma unroll
        for (int k = 0; k < kSpreadPacks; ++k) {
          const int p = p0 + tid + k * nthreads;
          if (p < p1) copy16_to_shared(ahead + k * nthreads + tid, xn + p * VEC);
        }
        copy_async_commit();
      }
    });
    if constexpr (CLUSTER > 1) {         // (CLUSTER 1: block_sum gave every thread the stats)
      if (first) {
        cluster_mean_rstd<CLUSTER>(part, static_cast<float>(count), block_mean, m2, eps,
                                   reinterpret_cast<float*>(stats));
      } else {
        cluster_mean_rstd<CLUSTER, true>(part, static_cast<float>(count), block_mean, m2, eps,
                                         reinterpret_cast<float*>(stats));
      }
    }
    float mean = block_mean, rstd;
    if constexpr (CLUSTER > 1) {
      __syncthreads();
      mean = stats->x;
      rstd = stats->y;
    } else {
      rstd = inv_std(m2 / static_cast<float>(count), eps);   // (block_sum: the same everywhere)
    }
    for (int i = tid; i < nch; i += nthreads) coef[i].x *= rstd;
    __syncthreads();
    T* yg = y + static_cast<long long>(item) * group_packs * VEC;
    if (act) spread_apply<T, 1>(raw, yg, p0, p1, ppc, cf, coef, mean);
    else spread_apply<T, 0>(raw, yg, p0, p1, ppc, cf, coef, mean);
    if (next >= items) break;
    item = next;
    copy_async_wait(0);                            // this thread's copies of the next slice
#pragma unroll
    for (int k = 0; k < kSpreadPacks; ++k) {
      if (p0 + tid + k * nthreads < p1) raw[k] = ahead[k * nthreads + tid];
    }
  }
  if constexpr (CLUSTER > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cluster_wait();     // no block may exit while another still reads its `part`
#endif
  }
}

// Channels-last. Item = (sample n, slab): rows [0, hw) of sc consecutive channels (whole groups,
// a multiple of VEC); the cluster's blocks split the rows, block `rank` taking [rank * rpb, ...
// + rpb). Thread t < P * R (P = sc / VEC): 16-byte column t % P, rows t / P + k * R, k <
// kNhwcRows. Grid = N * slabs * CLUSTER blocks.
// Block totals of each of the slab's kg groups from red[ph * stride + channel] (ph < R): warps
// split the groups (several warps per group when there are fewer groups than warps), lanes stride
// over a group's (phase, channel) entries; fixed order, so every block and run adds alike. The
// totals land in out[0, kg), visible to the block on return.
__device__ __forceinline__ void slab_group_totals(const float* red, int stride, int rphases, int cg,
                                                  int kg, float* wpart, float* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int wpg = kg >= warps ? 1 : warps / kg;          // warps per group
  const int entries = rphases * cg;
  const int step = 32 * wpg;
  const int qstep = step / cg, rstep = step - qstep * cg;
  for (int item = warp; item < kg * wpg; item += warps) {
    const int gl = item / wpg, q = item - gl * wpg;
    const float* base = red + gl * cg;
    float acc = 0.0f;
    int e = q * 32 + lane;
    int ph = e / cg, cc = e - ph * cg;
    for (; e < entries; e += step) {
      acc += base[ph * stride + cc];
      ph += qstep;
      cc += rstep;
      if (cc >= cg) {
        cc -= cg;
        ++ph;
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) wpart[item] = acc;
  }
  __syncthreads();
  for (int gl = threadIdx.x; gl < kg; gl += blockDim.x) {
    float t = 0.0f;
    for (int q = 0; q < wpg; ++q) t += wpart[gl * wpg + q];
    out[gl] = t;
  }
  __syncthreads();
}

// The group totals of the whole cluster (rank order, the same in every block): out[gl] =
// scale * the sum over the cluster's blocks of their part[gl]. With CLUSTER > 1 the cluster
// barrier first makes every block's part visible; thread t < kg * CLUSTER then reads one remote
// value (all DSMEM reads in flight at once) into xfer[t], and thread gl adds its CLUSTER values in
// rank order. Ends with out visible to the block.
template <int CLUSTER>
__device__ __forceinline__ void cluster_group_totals(const float* part, int kg, float* xfer,
                                                     float* out, float scale) {
  if constexpr (CLUSTER > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cluster_sync();
    for (int t = threadIdx.x; t < kg * CLUSTER; t += blockDim.x)
      xfer[t] = cluster_map(part, static_cast<unsigned int>(t % CLUSTER))[t / CLUSTER];
    __syncthreads();
    for (int gl = threadIdx.x; gl < kg; gl += blockDim.x) {
      float t = 0.0f;
#pragma unroll
      for (int r = 0; r < CLUSTER; ++r) t += xfer[gl * CLUSTER + r];
      out[gl] = t * scale;
    }
#endif
  } else {
    for (int gl = threadIdx.x; gl < kg; gl += blockDim.x) out[gl] = part[gl] * scale;
  }
  __syncthreads();
}

constexpr int kNhwcRows = 6;          // rows per thread

// Per-channel sums over a thread's rows (k * rphases < nrows) of x (SQUARE = 0) or of (x - m)^2
// (SQUARE = 1), m the channel's group mean.
template <class T, int SQUARE>
__device__ __forceinline__ void column_moments(const uint4 (&raw)[kNhwcRows], bool active,
                                               int nrows, int rphases,
                                               const float (&m)[Vec16<T>::size],
                                               float (&acc)[Vec16<T>::size]) {
  using V = Vec16<T>;
#pragma unroll
  for (int j = 0; j < V::size; ++j) acc[j] = 0.0f;
#pragma unroll
  for (int k = 0; k < kNhwcRows; ++k) {
    if (active && k * rphases < nrows) {
      float f[V::size];
      V::unpack(raw[k], f);
#pragma unroll
      for (int j = 0; j < V::size; ++j) {
        if constexpr (SQUARE) {
          const float d = f[j] - m[j];
          acc[j] = fmaf(d, d, acc[j]);
        } else {
          acc[j] += f[j];
        }
      }
    }
  }
}

// The cluster's group totals of the threads' per-channel values acc (thread: row phase ph,
// 16-byte column col), times `scale`, into out[0, kg): through red, the block's totals in part
// (read by the cluster's other blocks) and xfer. Ends with out visible to the block.
template <int CLUSTER, int VEC>
__device__ __forceinline__ void nhwc_group_totals(const float (&acc)[VEC], bool active, int ph,
                                                  int col, float* red, int stride, int rphases,
                                                  int cg, int kg, float* wpart, float* part,
                                                  float* xfer, float* out, float scale) {
  if (active) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) red[ph * stride + col * VEC + j] = acc[j];
  }
  __syncthreads();
  slab_group_totals(red, stride, rphases, cg, kg, wpart, part);
  cluster_group_totals<CLUSTER>(part, kg, xfer, out, scale);
}

// y = act((x - m) * a + bias) per channel over a thread's rows, stored at yt + k * step.
template <class T, int ACT>
__device__ __forceinline__ void nhwc_apply(const uint4 (&raw)[kNhwcRows], T* __restrict__ yt,
                                           int step, int nrows, int rphases,
                                           const float (&m)[Vec16<T>::size],
                                           const float (&a)[Vec16<T>::size],
                                           const float (&bias)[Vec16<T>::size]) {
  using V = Vec16<T>;
  constexpr int VEC = V::size;
#pragma unroll
  for (int k = 0; k < kNhwcRows; ++k) {
    if (k * rphases < nrows) {
      float f[VEC];
      V::unpack(raw[k], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = fmaf(f[j] - m[j], a[j], bias[j]);
      if constexpr (ACT != 0) silu_pack<VEC>(f);
      store16(yt + k * step, V::pack(f));
    }
  }
}

// Dynamic shared memory, floats: red [R][sc + 1] (per row phase and channel; the odd stride keeps
// a warp's lanes on distinct banks), wpart [max(kg, warps)], sum1 [kg] and sum2 [kg] (read by the
// cluster's other blocks), gmean [kg], grstd [kg], xfer [kg * CLUSTER]. The host keeps rpb * c <
// 2^31 (32-bit offsets within a block's rows).
// 72 registers per thread (64 spilled): at most 896 threads alone on an SM, or 2 x 448
constexpr int kNhwcSpreadThreads = 896;

template <class T, int CLUSTER>
__global__ void GPUOPS_CLUSTER_DIMS(CLUSTER) __launch_bounds__(kNhwcSpreadThreads, 1)
group_norm_nhwc_spread(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                       T* __restrict__ y, int hw, int c, int cg, int sc, int slabs, int rpb,
                       int rphases, float eps, int act) {
  using V = Vec16<T>;
  constexpr int VEC = V::size;
  extern __shared__ float4 gn_smem[];
  const int tid = threadIdx.x, warps = blockDim.x >> 5;
  const int P = sc / VEC, kg = sc / cg, stride = sc + 1;
  float* red = reinterpret_cast<float*>(gn_smem);
  float* wpart = red + rphases * stride;
  float* sum1 = wpart + max(kg, warps);
  float* sum2 = sum1 + kg;
  float* gmean = sum2 + kg;
  float* grstd = gmean + kg;
  float* xfer = grstd + kg;
  int item = blockIdx.x, rank = 0;
  if constexpr (CLUSTER > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    item = blockIdx.x / CLUSTER;
    rank = static_cast<int>(blockIdx.x % CLUSTER);     // (as in group_norm_spread)
    if (cluster_nctarank() != CLUSTER) {
      // not launched as clusters (see group_norm_spread): NaN over this block's rows, no barrier
      const int n = item / slabs, slab = item - n * slabs;
      const int r0 = rank * rpb, r1 = min(r0 + rpb, hw);
      for (int i = tid; i < (r1 > r0 ? (r1 - r0) * P : 0); i += blockDim.x)
        store16(y + (static_cast<long long>(n) * hw + r0 + i / P) * c + slab * sc + (i % P) * VEC,
                make_uint4(~0u, ~0u, ~0u, ~0u));
      return;
    }
#else
    __trap();
#endif
  }
  const int n = item / slabs, slab = item - n * slabs;
  const int r0 = rank * rpb, r1 = min(r0 + rpb, hw);
  const bool active = tid < P * rphases;
  const int col = tid % P, ph = tid / P;
  // this block's rows, and the thread's column in them (32-bit offsets from here)
  const long long block_base = (static_cast<long long>(n) * hw + r0) * c + slab * sc;
  const T* xb = x + block_base;
  T* yb = y + block_base;
  const int toff = ph * c + col * VEC, step = rphases * c;
  const int nrows = r1 - r0 - ph;                     // rows k * rphases < nrows are the thread's
  uint4 raw[kNhwcRows];
#pragma unroll
  for (int k = 0; k < kNhwcRows; ++k) {
    if (active && k * rphases < nrows) raw[k] = load16(xb + toff + k * step);
  }
  const float n_group = static_cast<float>(hw) * static_cast<float>(cg);
  // the local group of the thread's first channel, and its position in that group
  const int g_first = (col * VEC) / cg, r_first = col * VEC - g_first * cg;

  // pass 1: per-channel sums -> group sums -> the group means
  float mj[VEC], acc[VEC];
  column_moments<T, 0>(raw, active, nrows, rphases, mj, acc);
  nhwc_group_totals<CLUSTER>(acc, active, ph, col, red, stride, rphases, cg, kg, wpart, sum1, xfer,
                             gmean, 1.0f / n_group);

  // pass 2: squared deviations from the group means -> M2 -> rstd
  {
    int gl = g_first, r = r_first;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      mj[j] = active ? gmean[gl] : 0.0f;
      if (++r == cg) {
        r = 0;
        ++gl;
      }
    }
  }
  column_moments<T, 1>(raw, active, nrows, rphases, mj, acc);
  nhwc_group_totals<CLUSTER>(acc, active, ph, col, red, stride, rphases, cg, kg, wpart, sum2, xfer,
                             grstd, 1.0f / n_group);
  for (int gl = tid; gl < kg; gl += blockDim.x) grstd[gl] = inv_std(grstd[gl], eps);
  __syncthreads();
  if constexpr (CLUSTER > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cluster_arrive();   // done reading the others' sums; waited for before exiting
#endif
  }

  // apply: per-thread per-channel mean, scale (in acc) and bias (as group_norm_spread)
  if (active) {
    float bj[VEC];
    int gl = g_first, r = r_first;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const int ch = slab * sc + col * VEC + j;
      acc[j] = grstd[gl] * gn_param(w, ch, 1.0f);
      bj[j] = gn_param(b, ch, 0.0f);
      if (++r == cg) {
        r = 0;
        ++gl;
      }
    }
    if (act) nhwc_apply<T, 1>(raw, yb + toff, step, nrows, rphases, mj, acc, bj);
    else nhwc_apply<T, 0>(raw, yb + toff, step, nrows, rphases, mj, acc, bj);
  }

  if constexpr (CLUSTER > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cluster_wait();
#endif
  }
}

}  // namespace gpuops
