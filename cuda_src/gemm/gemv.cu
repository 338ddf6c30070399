// Decode-sized GEMMs (`variant='gemv'`: M = 1..16 rows of A against a large B, the weight): the
// weight is streamed from HBM exactly once with 16-byte loads, so the kernel is bandwidth-bound.
// What it adds over the tiled kernels (which would use 1/8 of a 128-row tile and too few blocks):
//  * B with K contiguous (a torch Linear weight [N, K]): a block of 8 warps owns 4 rows of B
//    (2 per B for the dual/SwiGLU kernel) and splits K between its warps; each lane reads 16
//    bytes of each row per step (a warp reads 512 contiguous bytes) and multiplies them with the
//    same 16 bytes of up to MT rows of A (read through L1, where they stay: the weight bypasses
//    L1). The MT x 4 sums of a lane are combined across the warp with a reduce-scatter (each
//    shuffle step halves the values a lane holds: 62 shuffles for 64 sums instead of 320), then
//    across the 8 warps through shared memory.
//  * B with N contiguous: a warp reads one row of B per step (16 or 8 bytes per lane), the 8 warps
//    take rows k = w, w + 8, ...; sums are combined across warps by a tree in shared memory.
//  * Split-K over grid.y when the columns alone give too few blocks to fill the GPU: each split
//    writes fp32 partial sums to a workspace, and gemv_splitk_reduce adds them in a fixed order
//    (deterministic) and applies the epilogue.
#include "gemm/gemv_common.cuh"

namespace gpuops {
namespace gemm {

constexpr int kGvThreads = 256, kGvWarps = 8;

// In-place reduce-scatter of N values across the 32 lanes of a warp: after it, lane l holds in
// v[0 .. max(1, N / 32)) the warp sums of the values with original indices
// i + (l >> (5 - H)) * max(1, N / 32), H = min(5, log2 N). Each step exchanges half of what a lane
// holds with the lane O apart and keeps the other half (upper half if lane & O).
template <int N, int O>
struct ReduceScatter {
  __device__ __forceinline__ static void run(float* v, int lane) {
    constexpr int H = N / 2;
    const bool upper = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < H; ++i) {
      const float send = upper ? v[i] : v[i + H];
      const float keep = upper ? v[i + H] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    ReduceScatter<H, O / 2>::run(v, lane);
  }
};
template <int O>
struct ReduceScatter<1, O> {
  __device__ __forceinline__ static void run(float* v, int lane) {
    v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
    ReduceScatter<1, O / 2>::run(v, lane);
  }
};
template <int N>
struct ReduceScatter<N, 0> {
  __device__ __forceinline__ static void run(float*, int) {}
};
template <>
struct ReduceScatter<1, 0> {
  __device__ __forceinline__ static void run(float*, int) {}
};

__host__ __device__ constexpr int log2_int(int n) { return n <= 1 ? 0 : 1 + log2_int(n / 2); }

// ------------------------------------------------------------------------- B with K contiguous

// Rows of each B per block: 4 (2 per B when dual), halved for 16-bit data with MT = 16, where the
// converted rows are held in registers (see the loop order below).
template <class T, int MT, bool DUAL>
struct GemvRows {
  static constexpr int value = ((sizeof(T) == 2 && MT > 4) ? 2 : 4) / (DUAL ? 2 : 1);
};

template <class T, int MT, bool DUAL>
__global__ void __launch_bounds__(kGvThreads, MT >= 4 ? 2 : 4) gemv_kcontig(GemmArgs p) {
  constexpr int kVec = 16 / sizeof(T);              // elements per 16-byte load
  constexpr int kNB = DUAL ? 2 : 1;
  constexpr int kR = GemvRows<T, MT, DUAL>::value;  // rows of each B per block
  constexpr int kV = MT * kR * kNB;                 // sums per lane: index (m * kR + r) * kNB + d
  constexpr int kH = log2_int(kV) < 5 ? log2_int(kV) : 5;
  constexpr int kNF = kV >= 32 ? kV / 32 : 1;       // sums a lane holds after the reduce-scatter
  __shared__ float red[kGvWarps][kNF][32];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const long long z = p.z0 + blockIdx.z;
  const BatchOffsets o = batch_offsets(p, z);
  const long long n0 = (long long)blockIdx.x * kR;
  const long long ks = (long long)blockIdx.y * p.k_split;
  const long long ke = ks + p.k_split < p.K ? ks + p.k_split : p.K;
  const long long M = p.M < MT ? p.M : MT;
  const bool w_vec = p.flags & kBVec, x_vec = p.flags & kAVec;
  const T* a = static_cast<const T*>(p.a) + o.a;
  const T* bsrc[kNB];
  bsrc[0] = static_cast<const T*>(p.b) + o.b;
  if constexpr (DUAL) bsrc[kNB - 1] = static_cast<const T*>(p.b2) + o.b;
  prefetch_weight_rows<T, kNB>(bsrc, p, n0, kR, ks, ke, tid);
  pdl_start();

  float acc[kV];
#pragma unroll
  for (int e = 0; e < kV; ++e) acc[e] = 0.0f;

  // two steps' loads in flight per warp where registers allow (>= 32 KB per SM for HBM latency)
#pragma unroll (MT <= 4 ? 2 : 1)
  for (long long k = ks + (long long)(warp * 32 + lane) * kVec; k < ke; k += kGvWarps * 32 * kVec) {
    const long long nk = ke - k;                    // elements left in this split (>= 1)
    uint4 wraw[kR][kNB];
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      const bool row = n0 + r < p.N;
#pragma unroll
      for (int d = 0; d < kNB; ++d) {
        const T* wp = bsrc[d] + (n0 + r) * p.b_sn + k * p.b_sk;
        if (row && w_vec && nk >= kVec) wraw[r][d] = load_stream16(wp);
        else wraw[r][d] = gather16(wp, p.b_sk, row ? nk : 0);
      }
    }
    if constexpr (MT <= 4) {
      // few rows of A: hold them converted, convert one row of B at a time
      float x[MT][kVec];
      const T* xp = a + k * p.a_sk;
#pragma unroll
      for (int m = 0; m < MT; ++m, xp += p.a_sm) {
        if (m >= M) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) x[m][j] = 0.0f;
        } else if (x_vec && nk >= kVec) {
          Vec16<T>::unpack(load_cached16(xp), x[m]);
        } else {
          Vec16<T>::unpack(gather16(xp, p.a_sk, nk), x[m]);
        }
      }
#pragma unroll
      for (int r = 0; r < kR; ++r)
#pragma unroll
        for (int d = 0; d < kNB; ++d) {
          float w[kVec];
          Vec16<T>::unpack(wraw[r][d], w);
#pragma unroll
          for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int j = 0; j < kVec; ++j)
              acc[(m * kR + r) * kNB + d] = fmaf(x[m][j], w[j], acc[(m * kR + r) * kNB + d]);
        }
    } else {
      // many rows of A: hold the rows of B converted, stream the rows of A
      float w[kR][kNB][kVec];
#pragma unroll
      for (int r = 0; r < kR; ++r)
#pragma unroll
        for (int d = 0; d < kNB; ++d) Vec16<T>::unpack(wraw[r][d], w[r][d]);
      const T* xp = a + k * p.a_sk;
#pragma unroll
      for (int m = 0; m < MT; ++m, xp += p.a_sm) {
        if (m < M) {
          float x[kVec];
          if (x_vec && nk >= kVec) Vec16<T>::unpack(load_cached16(xp), x);
          else Vec16<T>::unpack(gather16(xp, p.a_sk, nk), x);
#pragma unroll
          for (int r = 0; r < kR; ++r)
#pragma unroll
            for (int d = 0; d < kNB; ++d)
#pragma unroll
              for (int j = 0; j < kVec; ++j)
                acc[(m * kR + r) * kNB + d] = fmaf(x[j], w[r][d][j], acc[(m * kR + r) * kNB + d]);
        }
      }
    }
  }

  ReduceScatter<kV, 16>::run(acc, lane);
#pragma unroll
  for (int i = 0; i < kNF; ++i) red[warp][i][lane] = acc[i];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int i = 0; i < kNF; ++i) {
    float s = red[0][i][lane];
#pragma unroll
    for (int w = 1; w < kGvWarps; ++w) s += red[w][i][lane];
    acc[i] = s;
  }
  constexpr int kShift = 5 - kH;
  const int first = (lane >> kShift) * kNF;         // original index of acc[0]
  float partner = 0.0f;                             // dual with one sum per lane: the "up" sum
  if constexpr (DUAL && kNF == 1) partner = __shfl_down_sync(0xffffffffu, acc[0], 1 << kShift);
  if ((lane & ((1 << kShift) - 1)) != 0) return;    // lanes holding copies of the same sums
#pragma unroll
  for (int i = 0; i < kNF; ++i) {
    const int e = first + i;
    const int d = e % kNB, r = (e / kNB) % kR;
    const long long m = e / (kNB * kR), n = n0 + r;
    if (m >= p.M || n >= p.N) continue;
    if (p.splits > 1) {
      p.ws[ws_index(p, blockIdx.y, kNB, d, z, m, n)] = acc[i];
    } else if constexpr (DUAL) {
      if (d != 0) continue;
      const float up = kNF == 1 ? partner : acc[(i + 1) % kNF];
      const float g[1] = {acc[i]}, u[1] = {up};
      swiglu_run<T, 1>(p, o, m, n, g, u);
    } else {
      const float v[1] = {acc[i]};
      epilogue_run<T, 1>(p, o, m, n, v);
    }
  }
}

// ------------------------------------------------------------------------- B with N contiguous

template <class T, int MT>
__global__ void __launch_bounds__(kGvThreads, MT >= 4 ? 2 : 4) gemv_ncontig(GemmArgs p) {
  constexpr int kCols = (sizeof(T) == 2 && MT == 1) ? 8 : 4;   // columns per lane
  constexpr int kV = MT * kCols;
  __shared__ float red[kGvWarps / 2][kV][32];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const long long z = p.z0 + blockIdx.z;
  const BatchOffsets o = batch_offsets(p, z);
  const long long n = (long long)blockIdx.x * (32 * kCols) + lane * kCols;
  const long long ks = (long long)blockIdx.y * p.k_split;
  const long long ke = ks + p.k_split < p.K ? ks + p.k_split : p.K;
  const long long M = p.M < MT ? p.M : MT;
  const bool b_vec = (p.flags & kBVec) && n + kCols <= p.N;
  const long long ncols = p.N - n;
  const T* xrow = static_cast<const T*>(p.a) + o.a + (lane < M ? lane : 0) * p.a_sm;
  const T* b = static_cast<const T*>(p.b) + o.b + n * p.b_sn;
  pdl_start();

  float acc[MT][kCols];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < kCols; ++j) acc[m][j] = 0.0f;

#pragma unroll 2
  for (long long k = ks + warp; k < ke; k += kGvWarps) {
    const T* bp = b + k * p.b_sk;
    float bv[kCols];
    if (b_vec) {
      if constexpr (kCols * sizeof(T) == 16) {
        Vec16<T>::unpack(load_stream16(bp), bv);
      } else {
        float q[4];
        load4_vec(bp, q);
#pragma unroll
        for (int j = 0; j < kCols; ++j) bv[j] = q[j % 4];
      }
    } else {
#pragma unroll
      for (int j = 0; j < kCols; ++j) bv[j] = j < ncols ? to_float(bp[j * p.b_sn]) : 0.0f;
    }
    // lane m < M reads A[m][k]; the warp shares the values by shuffles (no per-row addresses)
    const float xl = lane < M ? to_float(xrow[k * p.a_sk]) : 0.0f;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const float x = __shfl_sync(0xffffffffu, xl, m);
#pragma unroll
      for (int j = 0; j < kCols; ++j) acc[m][j] = fmaf(x, bv[j], acc[m][j]);
    }
  }

  // warps [h, 2h) hand their sums to warps [0, h), for h = 4, 2, 1
#pragma unroll
  for (int h = kGvWarps / 2; h >= 1; h /= 2) {
    if (warp >= h && warp < 2 * h) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < kCols; ++j) red[warp - h][m * kCols + j][lane] = acc[m][j];
    }
    __syncthreads();
    if (warp < h) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < kCols; ++j) acc[m][j] += red[warp][m * kCols + j][lane];
    }
    __syncthreads();
  }
  if (warp != 0 || n >= p.N) return;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    if (m >= p.M) break;
    if (p.splits > 1) {
#pragma unroll
      for (int j = 0; j < kCols; ++j)
        if (n + j < p.N) p.ws[ws_index(p, blockIdx.y, 1, 0, z, m, n + j)] = acc[m][j];
    } else {
#pragma unroll
      for (int h = 0; h < kCols / 4; ++h) {
        const float v[4] = {acc[m][4 * h], acc[m][4 * h + 1], acc[m][4 * h + 2], acc[m][4 * h + 3]};
        epilogue_run<T, 4>(p, o, m, n + 4 * h, v);
      }
    }
  }
}

// --------------------------------------------------------------------------------- split-K sum

// One thread per output element: the splits' partial sums added in split order, then the
// epilogue (or silu(gate) * up for the dual kernel, whose workspace holds both products).
template <class T>
__global__ void __launch_bounds__(256) gemv_splitk_reduce(GemmArgs p) {
  pdl_start();
  const long long i = blockIdx.x * 256ll + threadIdx.x;
  const long long mn = p.M * p.N;
  if (i >= p.batch * mn) return;
  const long long z = i / mn, rest = i - z * mn, m = rest / p.N, n = rest - m * p.N;
  const BatchOffsets o = batch_offsets(p, z);
  if (p.b2 != nullptr) {
    float g = 0.0f, u = 0.0f;
    for (int split = 0; split < p.splits; ++split) {
      g += p.ws[ws_index(p, split, 2, 0, z, m, n)];
      u += p.ws[ws_index(p, split, 2, 1, z, m, n)];
    }
    const float gv[1] = {g}, uv[1] = {u};
    swiglu_run<T, 1>(p, o, m, n, gv, uv);
  } else {
    float s = 0.0f;
    for (int split = 0; split < p.splits; ++split) s += p.ws[ws_index(p, split, 1, 0, z, m, n)];
    const float v[1] = {s};
    epilogue_run<T, 1>(p, o, m, n, v);
  }
}

}  // namespace gemm
}  // namespace gpuops
