// The policy of the split-row ring / ring2 / resident loops (norms/norm_ring.cuh) for layer_norm,
// in a header of its own: group_norm's resident kernel (groupnorm/group_norm_resident.cu) keeps
// its statistics and replaces only the output side.
#pragma once
#include "norms/norm_ring.cuh"

namespace gpuops {

// The last block of a split row: merge the row's partials, store mean and rstd (through L2).
__device__ __forceinline__ void merge_row_stats(const float* row_partials, int C, float inv_n,
                                                float eps, float* mean_out, float* rstd_out,
                                                float* scratch) {
  const MeanM2 s = merge_welford_partials(row_partials, C, scratch);
  if (threadIdx.x == 0) {
    store_cg(mean_out, s.mean);
    store_cg(rstd_out, rsqrtf(s.m2 * inv_n + eps));
  }
}

// Split rows in one pass over memory, tiles held in a ring of shared memory (norms/norm_ring.cuh):
// the policy of ring_rows / ring2_rows for layer_norm. A tile's partial is its (count, mean,
// M2): two passes over each pack, Chan merges of the packs, of the block's threads, and of the
// row's C tiles in a fixed order (ring: by the row's last block; ring2: by every draining warp,
// from the published (mean, M2) words, the count being known from the chunk).
template <class T, int VEC, int PACKS>
struct LayerNormRing : RingOutput<T, VEC, PACKS, true, (PACKS <= 2 ? PACKS : 2)> {
  using Elem = T;
  using R = RawUnit<T, VEC>;
  using Raw = typename R::type;
  static constexpr int kVec = VEC, kPacks = PACKS, K = 3, kWords = 2, kPollBatch = 1;
  static constexpr bool kPrefetch = true;    // w, b issued before the poll (ring2)
  using Acc = MeanM2;
  const T* x;
  long long xs;
  RawTile<T, VEC, PACKS> xt;

  __device__ __forceinline__ LayerNormRing(const T* x_, long long xs_, T* y_, long long ys_,
                                           const T* w_, const T* b_, float* mean_, float* rstd_,
                                           int n, float eps_) {
    x = x_;
    xs = xs_;
    this->y = y_;
    this->ys = ys_;
    this->w = w_;
    this->b = b_;
    this->mean = mean_;
    this->rstd = rstd_;
    this->inv_n = 1.0f / static_cast<float>(n);
    this->eps = eps_;
  }

  __device__ __forceinline__ void issue(long long row, int u0, int units) {
    xt.load(x + row * xs, u0, units);
  }

  // resident: the copies into the slot (per thread), or the row's start (bulk).
  __device__ __forceinline__ const T* row_ptr(long long row) const { return x + row * xs; }
  __device__ __forceinline__ void issue_async(Raw* slot, long long row, int u0, int units) {
    ring_copy_async<T, VEC, PACKS>(slot, x + row * xs, u0, units);
  }

  // Stores the tile into its slot; this thread's partial as partial() (the same loop, kept
  // inline: calling partial() here moved the ring kernels' register allocation).
  __device__ __forceinline__ void land(Raw* slot, long long, int u0, int units,
                                       float (&part)[3]) {
    MeanM2 acc = {0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      slot[p * blockDim.x] = xt.u[p];
      if (u0 + p * static_cast<int>(blockDim.x) < units) {
        float f[VEC];
        R::unpack(xt.u[p], f);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum += f[j];
        const float m = sum * (1.0f / VEC);          // exact reciprocal: VEC is 1, 4 or 8
        float m2 = 0.0f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = f[j] - m;
          m2 = fmaf(d, d, m2);
        }
        acc = welford_merge(acc, MeanM2{static_cast<float>(VEC), m, m2});
      }
    }
    part[0] = acc.n;
    part[1] = acc.mean;
    part[2] = acc.m2;
  }

  // A held tile's partial, from its slot or (kRegs) from xt ("resident"). A thread whose units
  // are all in the row: two passes over its PACKS * VEC values (their mean, then the squared
  // deviations from it; the second pass reads the slot again). Else each pack: two passes over its
  // VEC values, merged into the thread's triple (Chan): only one pack's values live at a time.
  template <bool kRegs>
  __device__ __forceinline__ void partial(const Raw* src, int u0, int units,
                                          float (&part)[3]) const {
    if (u0 + (PACKS - 1) * static_cast<int>(blockDim.x) < units) {
      float sum = 0.0f;
#pragma unroll
      for (int p = 0; p < PACKS; ++p) {
        float f[VEC];
        R::unpack(src[kRegs ? p : p * blockDim.x], f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum += f[j];
      }
      constexpr float kCount = static_cast<float>(PACKS * VEC);
      const float m = sum / kCount;
      float m2 = 0.0f;
#pragma unroll
      for (int p = 0; p < PACKS; ++p) {
        float f[VEC];
        R::unpack(src[kRegs ? p : p * blockDim.x], f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = f[j] - m;
          m2 = fmaf(d, d, m2);
        }
      }
      part[0] = kCount;
      part[1] = m;
      part[2] = m2;
      return;
    }
    MeanM2 acc = {0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      if (u0 + p * static_cast<int>(blockDim.x) < units) {
        float f[VEC];
        R::unpack(src[kRegs ? p : p * blockDim.x], f);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum += f[j];
        const float m = sum * (1.0f / VEC);          // exact reciprocal: VEC is 1, 4 or 8
        float m2 = 0.0f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = f[j] - m;
          m2 = fmaf(d, d, m2);
        }
        acc = welford_merge(acc, MeanM2{static_cast<float>(VEC), m, m2});
      }
    }
    part[0] = acc.n;
    part[1] = acc.mean;
    part[2] = acc.m2;
  }

  // The block's triple. `full`: every thread's partial has the same count and the block a
  // power-of-two number of warps ("resident"'s full tiles): the merges without reciprocals.
  __device__ __forceinline__ void reduce(float (&part)[3], float* scratch, bool full = false) {
    const MeanM2 t = {part[0], part[1], part[2]};
    const MeanM2 s = full ? block_welford_equal(t, scratch) : block_welford(t, scratch);
    part[0] = s.n;
    part[1] = s.mean;
    part[2] = s.m2;
  }

  // ring: the row's last block merges the partials and stores mean and rstd; drains read them.
  __device__ __forceinline__ void merge(const float* row_partials, int C, long long row,
                                        float* scratch) {
    merge_row_stats(row_partials, C, this->inv_n, this->eps, this->mean + row, this->rstd + row,
                    scratch);
  }
  __device__ __forceinline__ void load_stats(long long row, float& mu, float& s) const {
    mu = load_cg(this->mean + row);
    s = load_cg(this->rstd + row);
  }

  // ring2: (mean, M2) published; the count of a tile is its valid units times VEC (exactly the
  // block_welford count: integers < 2^24 in float).
  __device__ __forceinline__ void words(const float (&part)[3], float (&v)[2]) const {
    v[0] = part[1];
    v[1] = part[2];
  }
  static __device__ __forceinline__ Acc acc_zero() { return MeanM2{0.0f, 0.0f, 0.0f}; }
  __device__ __forceinline__ Acc acc_add(const Acc& a, const float (&v)[2], float count) const {
    return welford_merge(a, MeanM2{count, v[0], v[1]});
  }
  static __device__ __forceinline__ Acc acc_warp(const Acc& a) { return warp_welford(a); }
  __device__ __forceinline__ void stats(const Acc& a, float& mu, float& s) const {
    mu = a.mean;
    s = rsqrtf(a.m2 * this->inv_n + this->eps);
  }
  __device__ __forceinline__ void write_stats(long long row, float mu, float s) const {
    if (this->mean != nullptr) this->mean[row] = mu;
    if (this->rstd != nullptr) this->rstd[row] = s;
  }
};

}  // namespace gpuops
