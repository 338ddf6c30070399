// Second pass of split-KV decode attention: merge the splits' partial outputs by log-sum-exp.
// One block per output row (b, q head, query token); every split slot of the workspace was
// written by decode_split (an empty split writes lse = -inf), so the merge needs no length.
#include "attention/decode_common.cuh"
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
  T* orow = out + ((b * sq + i) * hq + h) * static_cast<long long>(d);
  const float* po = ws_o + row * nsplit * static_cast<long long>(d);
  for (int c = threadIdx.x; c < d; c += kDecodeThreads) {
    float acc = 0.f;
    for (int s = 0; s < nsplit; ++s) {
      const float ws = w[s];
      if (ws != 0.f) acc = fmaf(ws, po[static_cast<long long>(s) * d + c], acc);
    }
    orow[c] = from_float<T>(acc * inv);
  }
  if (lse_out != nullptr && threadIdx.x == 0)
    lse_out[row] = sum > 0.f ? base + logf(sum) : (mx != mx ? mx : -__int_as_float(0x7f800000));
}

}  // namespace gpuops
