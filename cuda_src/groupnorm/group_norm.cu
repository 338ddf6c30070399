// GroupNorm forward with an optional fused SiLU: y = act((x - mean_g) * rstd_g * w[c] + b[c]),
// statistics over each (sample, group): Cg = C / G channels times all spatial positions. fp32 math
// for every storage type; the biased variance, as torch.
//
// Three designs (the host, gpuops/ops/group_norm.py, picks one per call):
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
#include "common/fastmath.cuh"
#include "common/dtypes.cuh"
#include "common/group_stats.cuh"
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

// v * sigmoid(v) with one MUFU.EX2 and one MUFU.RCP: relative error below 1e-6 (the rounding of
// -v log2(e) dominates), far under the fp16/bf16 storage rounding and within fp32's tolerance; as
// torch for v = -inf (NaN), v << 0 (-0), +inf and NaN. The IEEE division of activations.cuh's
// silu_f costs a long instruction sequence per element (and per unrolled copy, compile time).
__device__ __forceinline__ float silu_fast(float v) {
  return v * fast_rcp(1.0f + fast_exp2(-1.4426950408889634f * v));
}

// act: 0 none, 1 SiLU (a uniform branch: the same for the whole launch)
__device__ __forceinline__ float gn_act(float v, int act) { return act ? silu_fast(v) : v; }

// Raw storage of one unit of VEC elements (a 16-byte pack, or one element), to fp32 and back.
template <class T, int VEC>
struct Unit {
  static_assert(VEC == Vec16<T>::size, "a unit is one element or one 16-byte pack");
  using Raw = uint4;
  static __device__ __forceinline__ Raw load(const T* p) { return load16(p); }
  static __device__ __forceinline__ void store(T* p, const Raw& r) { store16(p, r); }
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
  static __device__ __forceinline__ void unpack(const Raw& r, float (&f)[1]) { f[0] = to_float(r); }
  static __device__ __forceinline__ Raw pack(const float (&f)[1]) { return from_float<T>(f[0]); }
};

// (n, mean, M2) of one unit of VEC values, merged into a thread's running statistics: the unit's
// own two-pass statistics, then Chan's formula (one division per unit, not per element).
template <int VEC>
__device__ __forceinline__ void merge_unit(MeanM2& s, const float (&f)[VEC]) {
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) sum += f[j];
  const float mean = sum * (1.0f / VEC);
  float m2 = 0.0f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float d = f[j] - mean;
    m2 = fmaf(d, d, m2);
  }
  chan_merge(s, static_cast<float>(VEC), mean, m2);
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

  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    if (p0 + tid + k * nthreads < p1) {
      float f[VEC];
      V::unpack(raw[k], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum += f[j];
    }
  }
  const int count = max(p1 - p0, 0) * VEC;
  sum = block_sum(sum, scratch);
  const float block_mean = count > 0 ? sum / static_cast<float>(count) : 0.0f;
  float m2 = 0.0f;
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    if (p0 + tid + k * nthreads < p1) {
      float f[VEC];
      V::unpack(raw[k], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = f[j] - block_mean;
        m2 = fmaf(d, d, m2);
      }
    }
  }
  m2 = block_sum(m2, scratch);

  // Group statistics to every thread through shared memory. With a cluster, the blocks' (n,
  // mean, M2) first go through distributed shared memory: lane r of warp 0 reads block r's, and
  // the warp merges them in a fixed order, so that every block gets identical statistics.
  if constexpr (CLUSTER > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (tid == 0) part = make_float4(static_cast<float>(count), block_mean, m2, 0.0f);
    cluster_sync();
    if (tid < 32) {
      MeanM2 st = {0.0f, 0.0f, 0.0f};
      if (tid < CLUSTER) {
        const float4 o = *cluster_map(&part, static_cast<unsigned int>(tid));
        st = {o.x, o.y, o.z};
      }
      st = warp_merge(st);
      if (tid == 0) {
        stats[0] = st.mean;
        stats[1] = inv_std(st.m2 / st.n, eps);
      }
    }
    cluster_arrive();   // done reading the others' `part`; waited for before exiting
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
// the pointers allow it, else 1), cut into `chunks` chunks of chunk_units; block b handles chunk
// b % chunks of group b / chunks in both kernels. part[b] = (n, mean, M2, 0) of that chunk.

constexpr int kTwoPassThreads = 256;
constexpr int kUnroll = 4;   // units loaded before any is used: bytes in flight per thread

template <class T, int VEC>
__global__ void __launch_bounds__(kTwoPassThreads) group_norm_nchw_stats(
    const T* __restrict__ x, float4* __restrict__ part, int group_units, int chunk_units,
    int chunks) {
  using U = Unit<T, VEC>;
  __shared__ float4 scratch[32];
  const int group = blockIdx.x / chunks, chunk = blockIdx.x - group * chunks;
  const T* xg = x + static_cast<long long>(group) * group_units * VEC;
  const int u0 = chunk * chunk_units;
  const int u1 = min(u0 + chunk_units, group_units);
  MeanM2 st = {0.0f, 0.0f, 0.0f};
  for (int u = u0 + threadIdx.x; u < u1; u += kUnroll * kTwoPassThreads) {
    typename U::Raw raw[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int uk = u + k * kTwoPassThreads;
      if (uk < u1) raw[k] = U::load(xg + static_cast<long long>(uk) * VEC);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (u + k * kTwoPassThreads < u1) {
        float f[VEC];
        U::unpack(raw[k], f);
        merge_unit<VEC>(st, f);
      }
    }
  }
  st = block_merge_to_thread0(st, scratch);
  if (threadIdx.x == 0) part[blockIdx.x] = make_float4(st.n, st.mean, st.m2, 0.0f);
}

// The data block of an apply kernel (the same numbering as its stats kernel's blocks). reverse:
// the last block's data first. Blocks start roughly in index order, so the stats kernel leaves the
// highest-numbered blocks' data in L2, least recently used first evicted: a forward apply pass
// over data larger than L2 evicts each line just before it is needed (no hits at all), a reverse
// pass reads the most recently cached lines first.
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

template <class T, int VEC>
__global__ void __launch_bounds__(kTwoPassThreads, 2) group_norm_nchw_apply(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
    const float4* __restrict__ part, int hw, int cg, int groups, int group_units,
    int chunk_units, int chunks, float eps, int act, int reverse) {
  using U = Unit<T, VEC>;
  __shared__ float stats[2];
  const int blk = apply_block(reverse);
  const int group = blk / chunks, chunk = blk - group * chunks;
  if (threadIdx.x < 32) {
    const MeanM2 st = warp_merge_partials(part + static_cast<long long>(group) * chunks, chunks);
    if (threadIdx.x == 0) {
      stats[0] = st.mean;
      stats[1] = inv_std(st.m2 / st.n, eps);
    }
  }
  __syncthreads();
  const float mean = stats[0], rstd = stats[1];
  const long long base = static_cast<long long>(group) * group_units * VEC;
  const T* xg = x + base;
  T* yg = y + base;
  const int c0 = (group % groups) * cg;
  const int u0 = chunk * chunk_units;
  const int u1 = min(u0 + chunk_units, group_units);
  for (int u = u0 + threadIdx.x; u < u1; u += kUnroll * kTwoPassThreads) {
    typename U::Raw raw[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int uk = u + k * kTwoPassThreads;
      if (uk < u1) raw[k] = U::load(xg + static_cast<long long>(uk) * VEC);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int uk = u + k * kTwoPassThreads;
      if (uk < u1) {
        // VEC > 1 only when hw % VEC == 0: a unit lies in one channel
        const int c = c0 + (uk * VEC) / hw;
        const float a = rstd * gn_param(w, c, 1.0f);
        const float s = gn_param(b, c, 0.0f);
        float f[VEC];
        U::unpack(raw[k], f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] = gn_act(fmaf(f[j] - mean, a, s), act);
        U::store(yg + static_cast<long long>(uk) * VEC, U::pack(f));
      }
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

}  // namespace gpuops
