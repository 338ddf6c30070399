// What every GEMM kernel of gpuops shares: the parameter block, batch offsets, the order in which
// blocks walk the output tiles, the fused epilogue, and the SIMT tile loader.
//
// Conventions (all kernels): C[z][m][n] = epilogue(sum_k A[z][m][k] * B[z][k][n]) with
//   A[z][m][k] = a[off_a(z) + m * a_sm + k * a_sk],  B[z][k][n] = b[off_b(z) + k * b_sk + n * b_sn],
//   C contiguous [batch][M][N] (allocated by gpuops), strides in elements, any sign, 64-bit.
// Epilogue, in this order and in fp32: v = alpha * acc; v += bias[n]; v = act(v); v += residual[m][n].
// bias and residual have the output's dtype (float when out_f32, else T).
#pragma once
#include "common/activations.cuh"
#include "common/dtypes.cuh"
#include "common/vec.cuh"

namespace gpuops {
namespace gemm {

// Passed by value (a kernel parameter, so launches stay capturable in CUDA graphs). The layout is
// mirrored by gpuops/ops/gemm.py (GEMM_ARGS = ArgSpec("9P25qf4i")); tests/test_gemm.py derives that
// format from the field list below, and the size is pinned here.
struct GemmArgs {
  const void* a;
  const void* b;
  const void* b2;         // second B of the dual (SwiGLU) kernels, same strides as b; else null
  void* c;
  const void* bias;       // [N] with stride bias_s, or null
  const void* residual;   // [batch][M][N] with strides r_sb / r_sm / r_sn, or null
  float* ws;              // split-K partial sums [splits][(2 if dual)][batch][M][N], or null
  const float* scale_a;   // int8: per-row scales of A [M]
  const float* scale_b;   // int8: per-column scales of B [N]
  long long M, N, K;
  long long a_sm, a_sk, b_sk, b_sn;
  long long r_sm, r_sn, bias_s;
  long long batch;        // number of matrices (product of bshape)
  long long bshape[3];    // batch dims after merging, outermost first; unused dims are 1
  long long a_sb[3], b_sb[3], r_sb[3];
  long long k_split;      // K elements per split of a split-K launch (grid.y splits); K otherwise
  long long z0;           // first matrix of this launch: z = z0 + blockIdx.z (grid.z <= 65535)
  float alpha;
  int act;                // gpuops::Act id: 0 none, 1 relu, 2 silu, 3 gelu (erf), 4 gelu (tanh)
  int out_f32;            // 1: C, bias and residual are float; 0: they are T
  int splits;             // grid.y of a split-K launch
  int flags;              // kFlag* below
};

static_assert(sizeof(GemmArgs) == 296, "GemmArgs layout (ops/gemm.py)");

// flags, set by the host from the operands' strides and alignment
constexpr int kAKContig = 1;   // A's K dim has stride 1 (else its M dim has, or neither)
constexpr int kAVec = 2;       // A may be read in aligned vectors along its contiguous dim
constexpr int kBKContig = 4;   // B's K dim has stride 1 (B^T row-major: a torch Linear weight)
constexpr int kBVec = 8;
constexpr int kResVec = 32;     // mma: the residual can be read in 16-byte runs of 8 columns
                                // (unit column stride, aligned rows and pointer, N % 8 == 0)

struct BatchOffsets {
  long long a, b, r, c;
};

__device__ __forceinline__ BatchOffsets batch_offsets(const GemmArgs& p, long long z) {
  BatchOffsets o;
  o.c = z * p.M * p.N;
  if (p.batch == 1) {
    o.a = o.b = o.r = 0;
    return o;
  }
  const long long i2 = z % p.bshape[2];
  const long long t = z / p.bshape[2];
  const long long i1 = t % p.bshape[1];
  const long long i0 = t / p.bshape[1];
  o.a = i0 * p.a_sb[0] + i1 * p.a_sb[1] + i2 * p.a_sb[2];
  o.b = i0 * p.b_sb[0] + i1 * p.b_sb[1] + i2 * p.b_sb[2];
  o.r = i0 * p.r_sb[0] + i1 * p.r_sb[1] + i2 * p.r_sb[2];
  return o;
}

// Output tile of the linear block index `pid`: tiles are visited in groups of kGroupM tile rows,
// column by column inside a group, so that consecutive blocks share A rows and B columns in L2.
constexpr int kGroupM = 8;

__device__ __forceinline__ void tile_coords(int pid, int tiles_m, int tiles_n, int& tm, int& tn) {
  const int per_group = kGroupM * tiles_n;
  const int group = pid / per_group;
  const int first = group * kGroupM;
  const int rows = min(tiles_m - first, kGroupM);
  const int in_group = pid - group * per_group;
  tm = first + in_group % rows;
  tn = in_group / rows;
}

// ------------------------------------------------------------------------------------ epilogue

// act chosen at run time (the SIMT and mma epilogues): silu and gelu_tanh share their sigmoid (one
// copy of its code per element: the register-tiled kernels are at their register limit there)
__device__ __forceinline__ float apply_act(int act, float v) {
  switch (act) {
    case 1: return activate<Act::kRelu>(v);
    case 2:
    case 4: return v * sigmoid_f(act == 4 ? gelu_tanh_arg(v) : v);   // silu_f / gelu_tanh_f
    case 3: return activate<Act::kGeluErf>(v);
    default: return v;
  }
}

// An element of an array of the output's dtype (bias, residual) as fp32.
template <class T>
__device__ __forceinline__ float load_out(const void* p, long long i, int out_f32) {
  return out_f32 ? static_cast<const float*>(p)[i] : to_float(static_cast<const T*>(p)[i]);
}

template <class T>
__device__ __forceinline__ void store_out(void* p, long long i, float v, int out_f32) {
  if (out_f32) static_cast<float*>(p)[i] = v;
  else static_cast<T*>(p)[i] = from_float<T>(v);
}

// The epilogue of one element: act(alpha * acc + bias[n]) + residual[m][n].
template <class T>
__device__ __forceinline__ float epilogue_value(const GemmArgs& p, const BatchOffsets& o, float acc,
                                                long long m, long long n) {
  float v = p.alpha * acc;
  if (p.bias != nullptr) v += load_out<T>(p.bias, n * p.bias_s, p.out_f32);
  v = apply_act(p.act, v);
  if (p.residual != nullptr)
    v += load_out<T>(p.residual, o.r + m * p.r_sm + n * p.r_sn, p.out_f32);
  return v;
}

// Final values of C[m][n .. n+W) (W = 1, 2, 4 or 8 consecutive columns), stored with vector stores
// (8 columns: 16 bytes of a 16-bit C, two of fp32) when all W are inside and C's rows allow it
// (N % W == 0: rows stay aligned), else one by one.
template <class T, int W>
__device__ __forceinline__ void store_run(const GemmArgs& p, const BatchOffsets& o, long long m,
                                          long long n, const float (&v)[W]) {
  const long long base = o.c + m * p.N + n;
  if (W > 1 && p.N % W == 0 && n + W <= p.N) {
    if (p.out_f32 || sizeof(T) == 4) {
      float* c = static_cast<float*>(p.c) + base;
      if constexpr (W == 8) {
        *reinterpret_cast<float4*>(c) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(c + 4) = make_float4(v[4], v[5], v[6], v[7]);
      } else if constexpr (W == 4) {
        *reinterpret_cast<float4*>(c) = make_float4(v[0], v[1], v[2], v[3]);
      } else if constexpr (W == 2) {
        *reinterpret_cast<float2*>(c) = make_float2(v[0], v[1]);
      }
    } else if constexpr (sizeof(T) == 2) {
      T* c = static_cast<T*>(p.c) + base;
      if constexpr (W == 8) {
        *reinterpret_cast<uint4*>(c) = make_uint4(Vec16<T>::pack2(v[0], v[1]),
                                                  Vec16<T>::pack2(v[2], v[3]),
                                                  Vec16<T>::pack2(v[4], v[5]),
                                                  Vec16<T>::pack2(v[6], v[7]));
      } else if constexpr (W == 4) {
        *reinterpret_cast<uint2*>(c) = make_uint2(Vec16<T>::pack2(v[0], v[1]),
                                                  Vec16<T>::pack2(v[2], v[3]));
      } else if constexpr (W == 2) {
        *reinterpret_cast<unsigned int*>(c) = Vec16<T>::pack2(v[0], v[1]);
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < W; ++j)
    if (n + j < p.N) store_out<T>(p.c, base + j, v[j], p.out_f32);
}

// The whole epilogue for W consecutive accumulators of row m starting at column n.
template <class T, int W>
__device__ __forceinline__ void epilogue_run(const GemmArgs& p, const BatchOffsets& o, long long m,
                                             long long n, const float (&acc)[W]) {
  if (m >= p.M) return;
  float v[W];
#pragma unroll
  for (int j = 0; j < W; ++j) v[j] = n + j < p.N ? epilogue_value<T>(p, o, acc[j], m, n + j) : 0.0f;
  store_run<T, W>(p, o, m, n, v);
}

// The bare product (alpha 1, no bias, activation or residual): only the stores. A kernel whose
// threads hold many outputs tests this once and keeps the per-element epilogue (its branches and
// its activation code, thousands of straight-line instructions at 128 outputs per thread: ~10% of
// the fp32 ring kernel's time went to fetching them, ncu run 92) off the bare GEMM's path.
__device__ __forceinline__ bool epilogue_is_plain(const GemmArgs& p) {
  return p.alpha == 1.0f && p.bias == nullptr && p.act == 0 && p.residual == nullptr;
}

template <class T, int W>
__device__ __forceinline__ void plain_run(const GemmArgs& p, const BatchOffsets& o, long long m,
                                          long long n, const float (&acc)[W]) {
  if (m < p.M) store_run<T, W>(p, o, m, n, acc);
}

// SwiGLU epilogue: silu(gate) * up, no alpha/bias/residual.
template <class T, int W>
__device__ __forceinline__ void swiglu_run(const GemmArgs& p, const BatchOffsets& o, long long m,
                                           long long n, const float (&gate)[W],
                                           const float (&up)[W]) {
  if (m >= p.M) return;
  float v[W];
#pragma unroll
  for (int j = 0; j < W; ++j) v[j] = silu_f(gate[j]) * up[j];
  store_run<T, W>(p, o, m, n, v);
}

// prefetch.global.L2 of the block's residual tile (rows m0.., columns n0.., unit column stride):
// one 128-byte line per thread and step.
template <class TO, int BM, int BN, int kThreads>
__device__ __forceinline__ void prefetch_residual_l2(const GemmArgs& p, const BatchOffsets& o,
                                                     long long m0, long long n0, int tid) {
  const int es = p.out_f32 ? 4 : (int)sizeof(TO);
  const int lines = (BN * es + 127) / 128;                // lines per row (the tile's start may
  const char* base = static_cast<const char*>(p.residual);  // straddle one more: harmless)
  for (int q = tid; q < BM * lines; q += kThreads) {
    const long long m = m0 + q / lines, n = n0 + (long long)(q % lines) * (128 / es);
    if (m >= p.M || n >= p.N) continue;
    const char* a = base + (o.r + m * p.r_sm + n) * es;
    asm volatile("prefetch.global.L2 [%0];" :: "l"(a));
  }
}

// ------------------------------------------------------------------------------ SIMT tile loader

// Four consecutive elements as fp32, from an address aligned to four elements: one 16-byte load
// for fp32, one 8-byte load for fp16/bf16.
__device__ __forceinline__ void load4_vec(const float* p, float (&f)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
}

template <class T>
__device__ __forceinline__ void load4_vec(const T* p, float (&f)[4]) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  float e[8];
  Vec16<T>::unpack(make_uint4(v.x, v.y, 0u, 0u), e);
  f[0] = e[0]; f[1] = e[1]; f[2] = e[2]; f[3] = e[3];
}

constexpr int kSimtPad = 4;   // floats of padding per smem row: keeps float4 alignment, spreads banks

// A ROWS x BK tile of an operand seen as X[r][k] = base[r * sr + k * sk] (A: r = m; B: r = n, so X
// is B transposed), staged through registers as fp32 and stored "k-major" in shared memory,
// S[k * (ROWS + kSimtPad) + r], so that the math loop reads 4 consecutive rows with one float4.
// Each of the NT threads moves ROWS * BK / 4 / NT runs of 4 elements along X's contiguous dim:
// along k when `kcontig` (4 scalar stores per run), else along r (one float4 store). Thread t's
// run i is q = t + i * NT of the tile's runs in row-major order, so its runs lie a fixed distance
// apart: kcontig, one k offset and rows kRowStep apart; else one row offset (4 rows) and k
// offsets kKStep apart. A thread therefore keeps one pointer, one step and the K / rows left of
// its first run (not a pointer and limits per run: registers are what the bigger tiles run short
// of). With `vec` a run is one vector load; tiles wholly inside the matrix take a path without
// per-run checks; else (unaligned or arbitrary strides, and at the matrix edges) elements are
// read one by one. Out-of-range elements are zeros. Tiles are loaded in order k0 = 0, BK, ...
template <class T, int ROWS, int BK, int NT>
struct SimtTile {
  static constexpr int kRuns = ROWS * BK / 4 / NT;
  static_assert(ROWS * BK / 4 % NT == 0, "tile must split evenly over the threads");
  static_assert(NT % (BK / 4) == 0 && NT % (ROWS / 4) == 0, "a thread's runs a fixed step apart");
  static constexpr int kRowStep = NT / (BK / 4);    // kcontig: rows between a thread's runs
  static constexpr int kKStep = NT / (ROWS / 4);    // else: k between a thread's runs
  static constexpr int kLd = ROWS + kSimtPad;
  float v[kRuns][4];
  const T* ptr;           // the first run's first element in the next tile
  long long step;         // elements from one run to the next
  long long kl;           // K - (the first run's k in the next tile)
  int rl;                 // R - (the first run's row), clamped to +-2^30
  int sbase;              // the first run's offset in a shared-memory buffer: k * kLd + row

  __device__ __forceinline__ void init(const T* base, long long sr, long long sk, long long R,
                                       long long K, long long r0, bool kcontig, int tid) {
    const int rk = kcontig ? tid / (BK / 4) : (tid % (ROWS / 4)) * 4;
    const int kk = kcontig ? (tid % (BK / 4)) * 4 : tid / (ROWS / 4);
    ptr = base + (r0 + rk) * sr + kk * sk;
    step = kcontig ? kRowStep * sr : kKStep * sk;
    kl = K - kk;
    const long long left = R - r0 - rk;
    rl = (int)(left > (1 << 30) ? (1 << 30) : (left < -(1 << 30) ? -(1 << 30) : left));
    sbase = kk * kLd + rk;
  }

  __device__ __forceinline__ void load(long long sr, long long sk, bool kcontig, bool vec) {
    // every run whole: 4 elements along k (kcontig: the last run's row exists) or 4 rows (the
    // last run's k exists)
    const bool whole = kcontig ? (kl >= 4 && rl - (kRuns - 1) * kRowStep >= 1)
                               : (kl - (kRuns - 1) * kKStep >= 1 && rl >= 4);
    if (vec && whole) {
#pragma unroll
      for (int i = 0; i < kRuns; ++i) load4_vec(ptr + i * step, v[i]);
    } else {
      const long long along = kcontig ? sk : sr;
#pragma unroll
      for (int i = 0; i < kRuns; ++i) {
        long long n;
        if (kcontig) {
          n = rl - i * kRowStep >= 1 ? (kl < 4 ? kl : 4) : 0;
        } else {
          const int rows = rl < 0 ? 0 : (rl > 4 ? 4 : rl);
          n = kl - i * kKStep >= 1 ? rows : 0;
        }
        const T* p = ptr + i * step;
        if (vec && n >= 4) {
          load4_vec(p, v[i]);
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) v[i][j] = j < n ? to_float(p[j * along]) : 0.0f;
        }
      }
    }
    ptr += BK * sk;
    kl -= BK;
  }

  // Stores the loaded runs into S (a shared-memory buffer of BK x kLd floats). Run i lands at
  // sbase + i x (kRowStep or kKStep x kLd): one base per thread, immediates per run.
  __device__ __forceinline__ void store(float* S, bool kcontig) const {
    float* const s = S + sbase;
#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      if (kcontig) {
#pragma unroll
        for (int j = 0; j < 4; ++j) s[i * kRowStep + j * kLd] = v[i][j];
      } else {
        *reinterpret_cast<float4*>(s + i * kKStep * kLd) =
            make_float4(v[i][0], v[i][1], v[i][2], v[i][3]);
      }
    }
  }
};

// The operands of one output tile, as the SIMT loaders see them.
template <class T>
struct SimtOperands {
  const T* a;
  const T* b;
  const T* b2;
  bool a_k, a_vec, b_k, b_vec;

  __device__ __forceinline__ SimtOperands(const GemmArgs& p, const BatchOffsets& o) {
    a = static_cast<const T*>(p.a) + o.a;
    b = static_cast<const T*>(p.b) + o.b;
    b2 = p.b2 != nullptr ? static_cast<const T*>(p.b2) + o.b : nullptr;
    a_k = p.flags & kAKContig;
    a_vec = p.flags & kAVec;
    b_k = p.flags & kBKContig;
    b_vec = p.flags & kBVec;
  }
};

}  // namespace gemm
}  // namespace gpuops
