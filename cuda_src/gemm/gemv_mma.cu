// Decode-sized GEMMs on tensor cores (`variant='gemv_mma'`, sm_80+, fp16/bf16, B with K
// contiguous: a torch Linear weight): what it adds over the SIMT `gemv` is that the
// multiplications cost nothing. At M = 9..16 rows of A the SIMT kernel does 16 FMAs and 16
// conversions per weight element, which on an H100 is more than the FMA units finish while HBM
// delivers the weight; here one mma.sync m16n8k16 multiplies a 16x16 block of A by 16 weight
// elements of 8 rows, and M < 16 just leaves rows of A zero.
//
// The weight is still read once with 16-byte loads: lane (g, t) loads 8 consecutive k of weight
// row g and of A rows g and g + 8, and the k order inside the two mma steps of those 32 k is
// permuted consistently in A and B (the sum does not care): logical k {2t, 2t+1} of step s is
// physical k 8t + 4s + {0, 1}, logical {2t+8, 2t+9} is 8t + 4s + {2, 3}, so fragments are just
// the words of the 16-byte loads. A block of 8 warps owns NT n8 tiles (8 * NT weight rows) of each
// weight and splits K between its warps; sums meet in shared memory. Split-K over grid.y and the
// fp32 workspace as in gemv.cu. NT is a template parameter so that the host can pick the block
// size whose block count fills whole waves (blocks are long: a partly empty last wave idles
// SMs for a whole block's time): blocks of <= 16 weight rows in all fit 3 per SM, bigger ones 2.
#include "gemm/gemm_common.cuh"
#include "common/mma.cuh"

namespace gpuops {
namespace gemm {

constexpr int kGmThreads = 256, kGmWarps = 8;

__device__ __forceinline__ unsigned int gm_bits(float16_t v) { return v.bits; }
__device__ __forceinline__ unsigned int gm_bits(bfloat16_t v) { return v.bits; }

// 8 elements p[0], p[step], ... (zeros past n) as a raw 16-byte pack.
template <class T>
__device__ __forceinline__ uint4 gm_gather(const T* p, long long step, long long n) {
  unsigned int w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < n) w[j / 2] |= gm_bits(p[j * step]) << (16 * (j % 2));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint4 gm_stream16(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ long long gm_ws_index(const GemmArgs& p, int split, int nb, int d,
                                                long long z, long long m, long long n) {
  return ((split * (long long)nb + d) * p.batch + z) * p.M * p.N + m * p.N + n;
}

template <class T, int NT, bool DUAL>
__global__ void __launch_bounds__(kGmThreads, (DUAL ? 2 : 1) * NT <= 2 ? 3 : 2) gemv_mma(GemmArgs p) {
#if __CUDA_ARCH__ >= 800
  constexpr int kNB = DUAL ? 2 : 1;
  constexpr int kNT = NT;                           // n8 tiles of each weight per block
  constexpr int kRows = kNT * 8;                    // weight rows of each weight per block
  constexpr int kVals = kNB * kNT * 4;              // accumulators per lane
  __shared__ float red[kGmWarps][kVals][32];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const long long z = p.z0 + blockIdx.z;
  const BatchOffsets o = batch_offsets(p, z);
  const long long n0 = (long long)blockIdx.x * kRows;
  const long long ks = (long long)blockIdx.y * p.k_split;
  const long long ke = ks + p.k_split < p.K ? ks + p.k_split : p.K;
  const bool w_vec = p.flags & kBVec, x_vec = p.flags & kAVec;
  const bool lo_row = g < p.M, hi_row = g + 8 < p.M;
  const T* x_lo = static_cast<const T*>(p.a) + o.a + g * p.a_sm;
  const T* x_hi = static_cast<const T*>(p.a) + o.a + (g + 8) * p.a_sm;
  const T* wrow[kNB][kNT];
  bool wok[kNT];
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    const long long n = n0 + 8 * j + g;
    wok[j] = n < p.N;
    wrow[0][j] = static_cast<const T*>(p.b) + o.b + n * p.b_sn;
    if constexpr (DUAL) wrow[kNB - 1][j] = static_cast<const T*>(p.b2) + o.b + n * p.b_sn;
  }

  float acc[kNB][kNT][4];
#pragma unroll
  for (int d = 0; d < kNB; ++d)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[d][j][c] = 0.0f;

#pragma unroll 2
  for (long long k0 = ks + warp * 32; k0 < ke; k0 += kGmWarps * 32) {
    const long long k = k0 + 8 * t;
    const long long nk = ke - k;                    // may be <= 0 in the last chunk
    const bool full = nk >= 8;
    uint4 xl = make_uint4(0u, 0u, 0u, 0u), xh = xl;
    if (lo_row) xl = (x_vec && full) ? __ldg(reinterpret_cast<const uint4*>(x_lo + k))
                                     : gm_gather(x_lo + k * p.a_sk, p.a_sk, nk);
    if (hi_row) xh = (x_vec && full) ? __ldg(reinterpret_cast<const uint4*>(x_hi + k))
                                     : gm_gather(x_hi + k * p.a_sk, p.a_sk, nk);
    uint4 w[kNB][kNT];
#pragma unroll
    for (int d = 0; d < kNB; ++d)
#pragma unroll
      for (int j = 0; j < kNT; ++j)
        w[d][j] = (wok[j] && w_vec && full) ? gm_stream16(wrow[d][j] + k)
                                            : gm_gather(wrow[d][j] + k * p.b_sk, p.b_sk,
                                                        wok[j] ? nk : 0);
    const unsigned int a0[4] = {xl.x, xh.x, xl.y, xh.y};   // step 0: words 0, 1
    const unsigned int a1[4] = {xl.z, xh.z, xl.w, xh.w};   // step 1: words 2, 3
#pragma unroll
    for (int d = 0; d < kNB; ++d)
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        Mma<T>::run(acc[d][j], a0, w[d][j].x, w[d][j].y);
        Mma<T>::run(acc[d][j], a1, w[d][j].z, w[d][j].w);
      }
  }

#pragma unroll
  for (int d = 0; d < kNB; ++d)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) red[warp][(d * kNT + j) * 4 + c][lane] = acc[d][j][c];
  __syncthreads();
  // every thread finishes outputs (j, c, lane) of the block: sums over the 8 warps, epilogue
  for (int q = tid; q < kNT * 4 * 32; q += kGmThreads) {
    const int l = q % 32, c = (q / 32) % 4, j = q / 128;
    const long long m = l / 4 + (c >= 2 ? 8 : 0);
    const long long n = n0 + 8 * j + 2 * (l % 4) + (c & 1);
    if (m >= p.M || n >= p.N) continue;
    float s[kNB];
#pragma unroll
    for (int d = 0; d < kNB; ++d) {
      float v = 0.0f;
#pragma unroll
      for (int w = 0; w < kGmWarps; ++w) v += red[w][(d * kNT + j) * 4 + c][l];
      s[d] = v;
    }
    if (p.splits > 1) {
#pragma unroll
      for (int d = 0; d < kNB; ++d) p.ws[gm_ws_index(p, blockIdx.y, kNB, d, z, m, n)] = s[d];
    } else if constexpr (DUAL) {
      const float gv[1] = {s[0]}, uv[1] = {s[kNB - 1]};
      swiglu_run<T, 1>(p, o, m, n, gv, uv);
    } else {
      const float v[1] = {s[0]};
      epilogue_run<T, 1>(p, o, m, n, v);
    }
  }
#else
  __trap();   // not reached: the module is built for sm_80+ only
#endif
}

}  // namespace gemm
}  // namespace gpuops
