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

}  // namespace gpuops
