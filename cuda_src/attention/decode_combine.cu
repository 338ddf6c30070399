// Second pass of split-KV decode attention: merge the splits' partial outputs by log-sum-exp.
// One block per output row (b, q head, query token); every split slot of the workspace was
// written by decode_split (an empty split writes lse = -inf), so the merge needs no length.
#include "attention/decode_common.cuh"
#include "common/pdl.cuh"
#include "common/reduce.cuh"

namespace gpuops {

constexpr int kMaxSplits = 1024;   // MAX_SPLITS in gpuops/ops/attention_decode.py

template <class T>
__global__ void __launch_bounds__(kDecodeThreads) decode_combine(
    const float* __restrict__ ws_o, const float* __restrict__ ws_lse, T* __restrict__ out,
    float* __restrict__ lse_out, int nsplit, int d, int sq, int hq) {
  __shared__ float w[kMaxSplits];
  __shared__ float scratch[32];
  const long long row = blockIdx.x;            // (b * hq + h) * sq + i
  const int i = static_cast<int>(row % sq);
  const long long bh = row / sq;
  const int h = static_cast<int>(bh % hq);
  const long long b = bh / hq;
  // o = sum_s w[s] * o_s / sum_s w[s], w[s] = exp(lse_s - max). The threads split into `groups`
  // that take every groups-th split, each thread one column unit (4 values, or 1); the groups'
  // sums meet in shared memory. The first kPre splits' partial outputs are loaded before the
  // weights are known, so their latency overlaps the lse loads and the two block reductions;
  // later splits are loaded 4 at a time before their FMAs. (Run 13: one thread per column walking
  // all splits one load after the other made this kernel ~8 us of B1 S8192's 27; run 14 with
  // 4-at-a-time loads after the reductions: ~4 us.) kPre 16 covers B1 S8192's 64 splits (4
  // groups at head dim 128) in the one round of loads that overlaps the lse loads (kPre 8 left
  // two more dependent rounds after the reductions; run 60 timed the combine at ~3.3 us).
  constexpr int kPre = 16;
  // Launched as a PDL secondary of the split kernel (attention_decode.PDL): this block may be
  // running before the splits are done; every load below (and the output stores) comes after
  // the wait. A no-op for an ordinary launch.
  pdl_wait();
  T* orow = out + ((b * sq + i) * hq + h) * static_cast<long long>(d);
  const float* po = ws_o + row * nsplit * static_cast<long long>(d);
  const bool vec4 = (d & 3) == 0;                 // ws_o rows are then 16-byte aligned
  const int units = vec4 ? d >> 2 : d;            // column units per split row
  const int per_group = units < kDecodeThreads ? units : kDecodeThreads;
  const int groups = kDecodeThreads / per_group;
  const int g = threadIdx.x / per_group;
  auto load_unit = [&](int s, int c) {
    const float* src = po + static_cast<long long>(s) * d;
    return vec4 ? *reinterpret_cast<const float4*>(src + 4 * c) : make_float4(src[c], 0.f, 0.f, 0.f);
  };
  float4 pre[kPre];
  {
    const int c = threadIdx.x % per_group;
#pragma unroll
    for (int t = 0; t < kPre; ++t) {
      const int s = g + t * groups;
      pre[t] = (c < units && s < nsplit) ? load_unit(s, c) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }

  const float* lse = ws_lse + row * nsplit;
  float mx = -__int_as_float(0x7f800000);
  for (int s = threadIdx.x; s < nsplit; s += kDecodeThreads) {
    w[s] = lse[s];
    mx = fmaxf(mx, w[s]);
  }
  mx = block_max(mx, scratch);                // NaN wins
  const float base = mx == -__int_as_float(0x7f800000) ? 0.f : mx;
  float sum = 0.f;
  for (int s = threadIdx.x; s < nsplit; s += kDecodeThreads) {
    const float e = expf(w[s] - base);
    w[s] = e;
    sum += e;
  }
  sum = block_sum(sum, scratch);              // its barriers also publish w[]
  const float inv = sum > 0.f ? 1.f / sum : 0.f;

  auto fma4 = [](float4& acc, float ws, const float4& x) {
    if (ws != 0.f) {   // an empty split's weight is exactly 0 (and its o is 0 too)
      acc.x = fmaf(ws, x.x, acc.x); acc.y = fmaf(ws, x.y, acc.y);
      acc.z = fmaf(ws, x.z, acc.z); acc.w = fmaf(ws, x.w, acc.w);
    }
  };
  __shared__ float4 part[kDecodeThreads];
  for (int c0 = 0; c0 < units; c0 += kDecodeThreads) {
    const int c = c0 + threadIdx.x % per_group;
    const bool active = g < groups && c < units;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (active) {
      int s = g;
      if (c0 == 0) {                              // the prefetched splits
#pragma unroll
        for (int t = 0; t < kPre; ++t)
          if (g + t * groups < nsplit) fma4(acc, w[g + t * groups], pre[t]);
        s = g + kPre * groups;
      }
      for (; s + 3 * groups < nsplit; s += 4 * groups) {
        float4 x[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) x[t] = load_unit(s + t * groups, c);
#pragma unroll
        for (int t = 0; t < 4; ++t) fma4(acc, w[s + t * groups], x[t]);
      }
      for (; s < nsplit; s += groups) fma4(acc, w[s], load_unit(s, c));
    }
    if (groups > 1) {                             // then units < kDecodeThreads: one c0 pass
      part[threadIdx.x] = acc;
      __syncthreads();
      if (active && g == 0)
        for (int o = 1; o < groups; ++o) {
          const float4 y = part[threadIdx.x + o * units];
          acc.x += y.x; acc.y += y.y; acc.z += y.z; acc.w += y.w;
        }
    }
    if (active && g == 0) {
      store_merged<T>(orow, c, acc, inv, vec4);
    }
  }
  if (lse_out != nullptr && threadIdx.x == 0)
    lse_out[row] = sum > 0.f ? base + logf(sum) : (mx != mx ? mx : -__int_as_float(0x7f800000));
}

}  // namespace gpuops
