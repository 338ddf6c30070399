// GEMM ladder, step 5 (`variant='mma'`, sm_80+): tensor cores through mma.sync, gpuops' default for
// fp16/bf16 on Ampere, Ada and Hopper (fp32 inputs use it only with allow_tf32=True, as TF32).
// What it adds over the SIMT `warp_tiled`:
//  * mma.sync.aligned.m16n8k16 (fp16/bf16) or m16n8k8 (tf32) with fp32 accumulators: a warp tile
//    of 64x64 is 4 x 8 mma tiles, 128 fp32 accumulators per thread;
//  * fragments loaded from shared memory with ldmatrix (.trans for operands whose M or N dim is
//    the contiguous one: a.T views, row-major B), so all four layouts read their natural order;
//  * shared memory in 16-byte chunks with an XOR swizzle: every ldmatrix phase (8 rows of 16
//    bytes), every cp.async phase and the scalar TF32 fragment loads of transposed fp32 operands
//    hit 8 distinct 16-byte bank groups (no conflicts, no padding);
//  * a 4-stage cp.async pipeline (global -> shared without registers): the copies of K tile
//    kt + 3 are in flight while tile kt is multiplied; one barrier per K tile of 64 bytes per row.
// Operands that are not 16-byte aligned (odd leading dims, sliced views, arbitrary strides) take a
// per-element load path into the same shared-memory layout. Tiles: 128x256 with 8 warps (2 x 4)
// for large problems, 128x128 with 4 warps where the large tile leaves SMs idle; the dual (SwiGLU)
// kernel shares each 128-row A tile between two 64-column B tiles. Blocks walk the output in
// groups of 8 tile rows (L2 reuse), like every gpuops GEMM.
//
// int8 (int8_matmul on sm_80+): the same kernel with mma.m16n8k32.s8 and int32 accumulators (K-major
// operands; others take the per-element path), the scales applied in the epilogue.
//
// Left for the Hopper step (`variant='wgmma'`, not written yet): wgmma.mma_async from shared
// memory descriptors, TMA loads and a warp-specialized producer/consumer pipeline.
#include "gemm/gemm_common.cuh"
#include "gemm/mma_common.cuh"

namespace gpuops {
namespace gemm {

// Byte offset of 16-byte chunk c of row r in a K-major tile (rows of 64 bytes = 4 chunks):
// chunks XOR (r / 2) % 4, so the 8 rows an ldmatrix phase reads (r0 .. r0 + 7, one chunk) fall
// in 8 distinct 16-byte bank groups of the 128-byte bank window.
__device__ __forceinline__ int kmajor_off(int r, int c) { return r * 64 + ((c ^ ((r >> 1) & 3)) << 4); }

// Byte offset of chunk c of row r (r = k) in an M/N-major tile with `cpr` chunks per row.
// 16-bit: chunks XOR r % 8 (ldmatrix.trans reads 8 consecutive k rows at one chunk);
// fp32: chunks XOR 2 (r % 4) (the scalar TF32 loads read 4 k rows x 2 chunks per warp).
template <int EL>
__device__ __forceinline__ int mnmajor_off(int r, int c, int cpr) {
  const int x = EL == 2 ? (r & 7) : ((r & 3) << 1);
  return r * cpr * 16 + ((c ^ x) << 4);
}

__device__ __forceinline__ unsigned int mma_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ unsigned int mma_bits(float16_t v) { return v.bits; }
__device__ __forceinline__ unsigned int mma_bits(bfloat16_t v) { return v.bits; }
__device__ __forceinline__ unsigned int mma_bits(signed char v) {
  return static_cast<unsigned char>(v);
}

// One operand's tile of a pipeline stage: ROWS rows (m of A, n of B) x BK (64 bytes of k).
// KMAJOR: the operand's K dim is its contiguous one (or it has no unit stride at all; then only
// the per-element path is used). Chunk q of the tile is moved by thread q % NT.
template <class T, int ROWS, int NT, bool KMAJOR>
struct MmaTile {
  static constexpr int kEl = sizeof(T);
  static constexpr int kEPC = 16 / kEl;              // elements per 16-byte chunk
  static constexpr int kBK = 64 / kEl;               // k per stage
  static constexpr int kCPR = KMAJOR ? 4 : ROWS * kEl / 16;   // chunks per smem row
  static constexpr int kChunks = ROWS * 4;
  static constexpr int kPer = kChunks / NT;
  static constexpr int kBytes = ROWS * 64;
  static_assert(kChunks % NT == 0 && NT % kCPR == 0, "chunks must split evenly");
  static_assert(KMAJOR || kEl > 1, "int8 operands are staged K-major only (no byte ldmatrix.trans)");

  // global -> shared for the stage at k0. base: the operand's matrix; (sr, sk): strides of its
  // rows and k; R, K: extents; r0: first row of the tile; dst: the stage's tile in shared memory.
  __device__ __forceinline__ static void load(unsigned char* dst, const T* base, long long sr,
                                              long long sk, long long R, long long K,
                                              long long r0, long long k0, bool aligned, int tid) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int q = tid + i * NT;
      const int r = q / kCPR, c = q % kCPR;
      long long row, k, n;
      long long step;
      int off;
      if (KMAJOR) {
        row = r0 + r;
        k = k0 + c * kEPC;
        n = row < R ? K - k : 0;
        step = sk;
        off = kmajor_off(r, c);
      } else {
        k = k0 + r;
        row = r0 + c * kEPC;
        n = k < K ? R - row : 0;
        step = sr;
        off = mnmajor_off<kEl>(r, c, kCPR);
      }
      n = n < 0 ? 0 : (n > kEPC ? kEPC : n);
      const T* src = base + row * sr + k * sk;
      if (aligned) {
        cp_async16(smem_addr(dst + off), n > 0 ? src : base, (int)n * kEl);
      } else {
        unsigned int w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int j = 0; j < kEPC; ++j)
          if (j < n) w[j * kEl / 4] |= mma_bits(src[j * step]) << (8 * kEl * (j % (4 / kEl)));
        *reinterpret_cast<uint4*>(dst + off) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
};

// A fragments (16 rows x one mma k step) of rows m_base .. m_base + 15 at k step kk of a stage.
template <class T, bool KMAJOR, int ROWS>
__device__ __forceinline__ void load_a_frag(unsigned int (&a)[4], const unsigned char* tile,
                                            int m_base, int kk, int lane) {
  using Tile = MmaTile<T, ROWS, 32, KMAJOR>;
  if constexpr (KMAJOR) {
    // matrix i = lane / 8: rows +8 (i & 1), chunk +1 (i >> 1); 2 chunks per k step (both types)
    const int r = m_base + (lane & 7) + ((lane >> 3) & 1) * 8;
    const int c = kk * 2 + (lane >> 4);
    ldmatrix_x4(a, smem_addr(tile + kmajor_off(r, c)));
    if constexpr (sizeof(T) == 4) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = to_tf32(a[i]);
    }
  } else if constexpr (sizeof(T) == 2) {
    // stored [k][m]; matrix i: m +8 (i & 1), k +8 (i >> 1); .trans gives A[m = g][k = 2t, 2t+1]
    const int r = kk * 16 + (lane & 7) + (lane >> 4) * 8;
    const int c = (m_base + ((lane >> 3) & 1) * 8) / 8;
    ldmatrix_x4_trans(a, smem_addr(tile + mnmajor_off<2>(r, c, Tile::kCPR)));
  } else {
    // tf32, stored [k][m]: a0 = A[g][t], a1 = A[g + 8][t], a2 = A[g][t + 4], a3 = A[g + 8][t + 4]
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = m_base + g + (i & 1) * 8, r = kk * 8 + t + (i >> 1) * 4;
      const float v = *reinterpret_cast<const float*>(
          tile + mnmajor_off<4>(r, m / 4, Tile::kCPR) + (m % 4) * 4);
      a[i] = to_tf32(__float_as_uint(v));
    }
  }
}

// B fragments of two n8 tiles n_base .. n_base + 15: b[0], b[1] of the first, b[2], b[3] of the
// second.
template <class T, bool KMAJOR, int ROWS>
__device__ __forceinline__ void load_b_frag2(unsigned int (&b)[4], const unsigned char* tile,
                                             int n_base, int kk, int lane) {
  using Tile = MmaTile<T, ROWS, 32, KMAJOR>;
  if constexpr (KMAJOR) {
    // stored [n][k]; matrix i: n tile (i >> 1), k half (i & 1)
    const int r = n_base + (lane & 7) + (lane >> 4) * 8;
    const int c = kk * 2 + ((lane >> 3) & 1);
    ldmatrix_x4(b, smem_addr(tile + kmajor_off(r, c)));
    if constexpr (sizeof(T) == 4) {
#pragma unroll
      for (int i = 0; i < 4; ++i) b[i] = to_tf32(b[i]);
    }
  } else if constexpr (sizeof(T) == 2) {
    // stored [k][n]; matrix i: k +8 (i & 1), n tile (i >> 1); .trans gives B[k = 2t, 2t+1][n = g]
    const int r = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
    const int c = (n_base + (lane >> 4) * 8) / 8;
    ldmatrix_x4_trans(b, smem_addr(tile + mnmajor_off<2>(r, c, Tile::kCPR)));
  } else {
    // tf32, stored [k][n]: b0 = B[t][g], b1 = B[t + 4][g] of each n8 tile
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int n = n_base + g + (i >> 1) * 8, r = kk * 8 + t + (i & 1) * 4;
      const float v = *reinterpret_cast<const float*>(
          tile + mnmajor_off<4>(r, n / 4, Tile::kCPR) + (n % 4) * 4);
      b[i] = to_tf32(__float_as_uint(v));
    }
  }
}

// The epilogue of ROWS staged rows (shared memory, ld LDC floats) of BN columns: thread tid owns
// the 4 columns my_c.. of rows tid / (BN / 4) + i * (kThreads / (BN / 4)). Runs go in groups of
// 4 whose residual loads are all issued before the group's math and stores (the loads of a
// rolled loop cannot pass the previous iteration's store, which might alias: one full memory
// latency per run otherwise).
template <class TO, int ROWS, int BN, int kThreads, int LDC>
__device__ __forceinline__ void staged_epilogue(const GemmArgs& p, const BatchOffsets& o,
                                                const float* cs, long long m_base, long long n0,
                                                int my_c, int tid, const float (&bz)[4]) {
  constexpr int kRunsPerRow = BN / 4, kRowStep = kThreads / kRunsPerRow;
  constexpr int kIters = ROWS / kRowStep, kU = 4;
  static_assert(ROWS % kRowStep == 0 && kIters % kU == 0, "epilogue groups");
  const int r0 = tid / kRunsPerRow;
  const long long n = n0 + my_c;
  const bool has_res = p.residual != nullptr, has_bias = p.bias != nullptr;
#pragma unroll 1
  for (int it = 0; it < kIters; it += kU) {
    float res[kU][4];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const long long m = m_base + r0 + (it + u) * kRowStep;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        res[u][j] = (has_res && m < p.M && n + j < p.N)
                        ? load_out<TO>(p.residual, o.r + m * p.r_sm + (n + j) * p.r_sn, p.out_f32)
                        : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int r = r0 + (it + u) * kRowStep;
      const long long m = m_base + r;
      const float4 v4 = *reinterpret_cast<const float4*>(cs + r * LDC + my_c);
      float v[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float x = has_bias ? p.alpha * v[j] + bz[j] : p.alpha * v[j];
        v[j] = apply_act(p.act, x) + res[u][j];
      }
      if (m < p.M) store_run<TO, 4>(p, o, m, n, v);
    }
  }
}

// BM x BN block tile (BN per B operand), WM x WN warps, STAGES-deep cp.async pipeline.
// T: the inputs' storage type; TO: the output's (T, except for int8 inputs).
// AK / BKM: A / B is K-major (K contiguous); DUAL: silu(A @ B) * (A @ B2).
template <class T, class TO, int BM, int BN, int WM, int WN, int STAGES, bool AK, bool BKM,
          bool DUAL>
__global__ void __launch_bounds__(WM * WN * 32, 1) gemm_mma(GemmArgs p) {
#if __CUDA_ARCH__ >= 800
  constexpr int kThreads = WM * WN * 32;
  constexpr int kNB = DUAL ? 2 : 1;
  constexpr int kWTM = BM / WM, kWTN = BN / WN;       // warp tile
  constexpr int kMI = kWTM / 16, kNI = kWTN / 8;      // mma tiles per warp tile
  constexpr int kKS = Mma<T>::kK;                     // k per mma
  constexpr bool kInt8 = sizeof(T) == 1;
  using Acc = typename Mma<T>::Acc;                   // int32 for int8, else fp32
  using TileA = MmaTile<T, BM, kThreads, AK>;
  using TileB = MmaTile<T, BN, kThreads, BKM>;
  constexpr int kBK = TileA::kBK;
  constexpr int kStageBytes = TileA::kBytes + kNB * TileB::kBytes;
  static_assert(kNI % 2 == 0, "B fragments are loaded two n8 tiles at a time");
  extern __shared__ __align__(128) unsigned char smem[];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wm = warp / WN, wn = warp % WN;
  const int tiles_m = (int)((p.M + BM - 1) / BM), tiles_n = (int)((p.N + BN - 1) / BN);
  int tm, tn;
  tile_coords(blockIdx.x, tiles_m, tiles_n, tm, tn);
  const long long m0 = (long long)tm * BM, n0 = (long long)tn * BN;
  const BatchOffsets o = batch_offsets(p, p.z0 + blockIdx.z);
  const T* a = static_cast<const T*>(p.a) + o.a;
  const T* b[kNB];
  b[0] = static_cast<const T*>(p.b) + o.b;
  if constexpr (DUAL) b[kNB - 1] = static_cast<const T*>(p.b2) + o.b;
  const bool a_al = p.flags & kAVec, b_al = p.flags & kBVec;

  auto load_stage = [&](int stage, long long k0) {
    unsigned char* s = smem + stage * kStageBytes;
    TileA::load(s, a, p.a_sm, p.a_sk, p.M, p.K, m0, k0, a_al, tid);
#pragma unroll
    for (int d = 0; d < kNB; ++d)
      TileB::load(s + TileA::kBytes + d * TileB::kBytes, b[d], p.b_sn, p.b_sk, p.N, p.K, n0, k0,
                  b_al, tid);
  };

  Acc acc[kNB][kMI][kNI][4];
#pragma unroll
  for (int d = 0; d < kNB; ++d)
#pragma unroll
    for (int i = 0; i < kMI; ++i)
#pragma unroll
      for (int j = 0; j < kNI; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[d][i][j][c] = Acc(0);

  const long long ktiles = (p.K + kBK - 1) / kBK;
  // The residual tile is read once, by the epilogue; prefetched to L2 a few k-tiles before the
  // main loop ends, its DRAM latency hides behind the last tiles' mma work.
  constexpr bool kStdEpi = !DUAL && !kInt8;
  const bool prefetch_res = kStdEpi && p.residual != nullptr && p.r_sn == 1 &&
                            !(p.flags & kEpiLegacy);
  const long long pf_kt = ktiles > 8 ? ktiles - 8 : 0;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s, s * (long long)kBK);
    cp_async_commit();
  }
  for (long long kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();   // tile kt is in shared memory; every warp is done with tile kt - 1
    {
      const long long nk = kt + STAGES - 1;
      if (nk < ktiles) load_stage((int)(nk % STAGES), nk * kBK);
      cp_async_commit();
    }
    if (prefetch_res && kt == pf_kt) prefetch_residual_l2<TO, BM, BN, kThreads>(p, o, m0, n0, tid);
    const unsigned char* s = smem + (int)(kt % STAGES) * kStageBytes;
#pragma unroll 1
    for (int kk = 0; kk < kBK / kKS; ++kk) {
      unsigned int af[kMI][4];
#pragma unroll
      for (int i = 0; i < kMI; ++i) load_a_frag<T, AK, BM>(af[i], s, wm * kWTM + i * 16, kk, lane);
#pragma unroll
      for (int d = 0; d < kNB; ++d) {
        const unsigned char* sb = s + TileA::kBytes + d * TileB::kBytes;
#pragma unroll
        for (int j = 0; j < kNI; j += 2) {
          unsigned int bf[4];
          load_b_frag2<T, BKM, BN>(bf, sb, wn * kWTN + j * 8, kk, lane);
#pragma unroll
          for (int i = 0; i < kMI; ++i) {
            Mma<T>::run(acc[d][i][j], af[i], bf[0], bf[1]);
            Mma<T>::run(acc[d][i][j + 1], af[i], bf[2], bf[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue through shared memory, in WM passes of kWTM rows: the warps of one warp row write
  // their fp32 accumulators (and the second product's, for the dual kernel) to a padded tile, then
  // all threads apply the epilogue to runs of 4 columns in a rolled loop: one copy of the
  // activation code instead of one per accumulator, and 16/8-byte coalesced stores.
  constexpr int kLdC = BN + 8;          // floats; +8: the float2 writes below are conflict-free
  static_assert(kNB * kWTM * kLdC * 4 <= STAGES * kStageBytes, "C staging must fit");
  float* cs = reinterpret_cast<float*>(smem);
  const int g = lane >> 2, t = lane & 3;
  // Standard epilogue (not legacy): a thread's 4 columns are the same in every iteration
  // (kThreads is a multiple of the BN / 4 runs of a row), so its bias values are loaded once.
  constexpr int kRunsPerRow = BN / 4;
  constexpr bool kHoisted = kStdEpi && kThreads % kRunsPerRow == 0;
  const bool fast_epi = kHoisted && !(p.flags & kEpiLegacy);
  const int my_c = (tid % kRunsPerRow) * 4;
  float bz[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (fast_epi && p.bias != nullptr) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (n0 + my_c + j < p.N) bz[j] = load_out<TO>(p.bias, (n0 + my_c + j) * p.bias_s, p.out_f32);
  }
#pragma unroll 1
  for (int h = 0; h < WM; ++h) {
    __syncthreads();   // the pipeline's (or the previous pass's) shared memory is free
    if (wm == h) {
#pragma unroll
      for (int d = 0; d < kNB; ++d)
#pragma unroll
        for (int i = 0; i < kMI; ++i)
#pragma unroll
          for (int j = 0; j < kNI; ++j)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int r = i * 16 + g + hh * 8, c = wn * kWTN + j * 8 + 2 * t;
              *reinterpret_cast<float2*>(cs + (d * kWTM + r) * kLdC + c) =
                  make_float2(static_cast<float>(acc[d][i][j][2 * hh]),
                              static_cast<float>(acc[d][i][j][2 * hh + 1]));
            }
    }
    __syncthreads();
    if constexpr (kHoisted) {
      if (fast_epi) {
        staged_epilogue<TO, kWTM, BN, kThreads, kLdC>(p, o, cs, m0 + h * kWTM, n0, my_c, tid, bz);
        continue;
      }
    }
#pragma unroll 1
    for (int q = tid; q < kWTM * BN / 4; q += kThreads) {
      const int r = q / (BN / 4), c = (q % (BN / 4)) * 4;
      const long long m = m0 + h * kWTM + r, n = n0 + c;
      const float4 v4 = *reinterpret_cast<const float4*>(cs + r * kLdC + c);
      const float v[4] = {v4.x, v4.y, v4.z, v4.w};
      if constexpr (DUAL) {
        const float4 u4 = *reinterpret_cast<const float4*>(cs + (kWTM + r) * kLdC + c);
        const float u[4] = {u4.x, u4.y, u4.z, u4.w};
        swiglu_run<TO, 4>(p, o, m, n, v, u);
      } else if constexpr (kInt8) {   // (A @ B) * scale_a[m] * scale_b[n]
        if (m < p.M) {
          const float sa = p.scale_a[m];
          float w[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) w[j] = n + j < p.N ? v[j] * sa * p.scale_b[n + j] : 0.0f;
          store_run<TO, 4>(p, o, m, n, w);
        }
      } else {
        epilogue_run<TO, 4>(p, o, m, n, v);
      }
    }
  }
#else
  __trap();   // not reached: the module is built for sm_80+ only
#endif
}

}  // namespace gemm
}  // namespace gpuops
