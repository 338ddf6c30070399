// int8 GEMM with per-row / per-column scales (`int8_matmul`, sm_61+): C = (A_int8 @ B_int8) *
// scale_a[m] * scale_b[n], exact int32 accumulation (|sum| <= 2^14 K < 2^31 for K <= 131,071),
// then fp32.
// What it adds: __dp4a (sm_61's 4-way int8 dot product with int32 accumulation: 4 multiply-adds
// per instruction) inside the structure of `warp_tiled` — 128x128 block tiles, 8 warps of 64x32,
// 8x8 outputs per thread, double-buffered shared memory — with 32-bit words of 4 consecutive k
// in place of floats: a K step of the tile is 8 words (32 k). Both operands are read with 16-byte
// loads along K (A row-major [M, K], B as B^T row-major, i.e. b = W.t() of a weight W [N, K]);
// other layouts, unaligned data and the K tail are read byte by byte.
#include "gemm/gemm_common.cuh"

namespace gpuops {
namespace gemm {

constexpr int kI8BM = 128, kI8BN = 128, kI8BKW = 8, kI8Threads = 256;

__device__ __forceinline__ int dp4a(int a, int b, int c) {
  int d;
  asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// ROWS x (BKW words = 4 BKW k) tile of X[r][k] = base[r * sr + k * sk] (int8), stored word-wise
// k-major in shared memory, S[kw * (ROWS + 4) + r]. One run = 4 words (16 k) of one row.
template <int ROWS, int BKW, int NT>
struct Int8Tile {
  static constexpr int kRuns = ROWS * BKW / 4 / NT;
  static_assert(ROWS * BKW / 4 % NT == 0, "tile must split evenly over the threads");
  static constexpr int kLd = ROWS + 4;
  int v[kRuns][4];
  const signed char* ptr[kRuns];   // the run's first byte in the next tile
  long long kl[kRuns];             // K - the run's k offset in a tile, or 0 past the last row

  __device__ __forceinline__ void init(const signed char* base, long long sr, long long sk,
                                       long long R, long long K, long long r0, int tid) {
#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      const int q = tid + i * NT;
      const long long r = r0 + q / (BKW / 4);
      const int kk = (q % (BKW / 4)) * 16;
      ptr[i] = base + r * sr + kk * sk;
      kl[i] = r < R ? K - kk : 0;
    }
  }

  __device__ __forceinline__ void load(long long sk, long long k0, bool vec) {
#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      const long long n = kl[i] - k0;              // bytes of this run inside the matrix
      const signed char* p = ptr[i];
      if (vec && n >= 16) {
        const int4 w = *reinterpret_cast<const int4*>(p);
        v[i][0] = w.x; v[i][1] = w.y; v[i][2] = w.z; v[i][3] = w.w;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          unsigned int w = 0u;
#pragma unroll
          for (int b = 0; b < 4; ++b)
            if (4 * j + b < n) w |= (static_cast<unsigned int>(p[(4 * j + b) * sk]) & 0xffu) << (8 * b);
          v[i][j] = static_cast<int>(w);
        }
      }
      ptr[i] = p + 4 * BKW * sk;
    }
  }

  __device__ __forceinline__ void store(int* S, int tid) const {
#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      const int q = tid + i * NT;
      const int r = q / (BKW / 4), kw = (q % (BKW / 4)) * 4;
#pragma unroll
      for (int j = 0; j < 4; ++j) S[(kw + j) * kLd + r] = v[i][j];
    }
  }
};

// TOut: the output's storage type (float, float16_t, bfloat16_t; p.out_f32 says which).
template <class TOut>
__global__ void __launch_bounds__(kI8Threads, 2) gemm_int8_dp4a(GemmArgs p) {
  using Tile = Int8Tile<kI8BM, kI8BKW, kI8Threads>;
  __shared__ __align__(16) int As[2][kI8BKW * Tile::kLd];
  __shared__ __align__(16) int Bs[2][kI8BKW * Tile::kLd];

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int wm = warp / 4, wn = warp % 4;
  const int ty = lane / 4, tx = lane % 4;
  const int a_off = wm * 64 + ty * 4;         // rows a_off + {0..3, 32..35}
  const int b_off = wn * 32 + tx * 4;         // columns b_off + {0..3, 16..19}
  const int tiles_m = (int)((p.M + kI8BM - 1) / kI8BM), tiles_n = (int)((p.N + kI8BN - 1) / kI8BN);
  int tm, tn;
  tile_coords(blockIdx.x, tiles_m, tiles_n, tm, tn);
  const long long m0 = (long long)tm * kI8BM, n0 = (long long)tn * kI8BN;
  const BatchOffsets o = batch_offsets(p, p.z0 + blockIdx.z);
  const signed char* a = static_cast<const signed char*>(p.a) + o.a;
  const signed char* b = static_cast<const signed char*>(p.b) + o.b;
  const bool a_vec = p.flags & kAVec, b_vec = p.flags & kBVec;

  int acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0;

  Tile ta, tb;
  const long long kstep = 4 * kI8BKW;
  const long long ktiles = (p.K + kstep - 1) / kstep;
  ta.init(a, p.a_sm, p.a_sk, p.M, p.K, m0, tid);
  tb.init(b, p.b_sn, p.b_sk, p.N, p.K, n0, tid);
  if (ktiles > 0) {
    ta.load(p.a_sk, 0, a_vec);
    tb.load(p.b_sk, 0, b_vec);
    ta.store(As[0], tid);
    tb.store(Bs[0], tid);
  }
  __syncthreads();
  for (long long kt = 0; kt < ktiles; ++kt) {
    const int cur = (int)(kt & 1);
    const bool more = kt + 1 < ktiles;
    if (more) {
      ta.load(p.a_sk, (kt + 1) * kstep, a_vec);
      tb.load(p.b_sk, (kt + 1) * kstep, b_vec);
    }
#pragma unroll 2
    for (int kw = 0; kw < kI8BKW; ++kw) {
      const int4 a0 = *reinterpret_cast<const int4*>(As[cur] + kw * Tile::kLd + a_off);
      const int4 a1 = *reinterpret_cast<const int4*>(As[cur] + kw * Tile::kLd + a_off + 32);
      const int4 b0 = *reinterpret_cast<const int4*>(Bs[cur] + kw * Tile::kLd + b_off);
      const int4 b1 = *reinterpret_cast<const int4*>(Bs[cur] + kw * Tile::kLd + b_off + 16);
      const int av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const int bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = dp4a(av[i], bv[j], acc[i][j]);
    }
    if (more) {
      ta.store(As[cur ^ 1], tid);
      tb.store(Bs[cur ^ 1], tid);
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const long long m = m0 + a_off + (i / 4) * 32 + i % 4;
    if (m >= p.M) continue;
    const float sa = p.scale_a[m];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const long long n = n0 + b_off + 16 * s;
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        v[j] = n + j < p.N ? static_cast<float>(acc[i][4 * s + j]) * sa * p.scale_b[n + j] : 0.0f;
      store_run<TOut, 4>(p, o, m, n, v);
    }
  }
}

}  // namespace gemm
}  // namespace gpuops
