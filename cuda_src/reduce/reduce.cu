// Reductions over one (merged) dimension: sum, mean, amax, amin, argmax, argmin.
//
// The host (gpuops/ops/reduce.py) describes the input as a 3-index view
//     x[a, r, b] = x[a * sa + r * sr + b * sb],   a < A, r < R (reduced), b < B,
// and the output as out[a * oa + b * ob]. Three kernels cover every layout:
//
//   reduce_rows<P, T, VEC, TPR>  the reduced index is contiguous (sr == 1; VEC = 16-byte packs)
//       or strided (VEC = 1). A group of TPR threads (8, 32 or the whole block of 256) reduces a
//       row; a misaligned row start and an odd row end are handled by scalar loads, so every
//       contiguous row is read with 16-byte packs. Rows too few for the GPU are split into
//       gridDim.y parts of `chunk` elements (or packs), each writing a partial to a workspace.
//   reduce_cols<P, T, VEC>  the kept index b is contiguous (sb == 1): 32 lanes walk 32 packs of
//       adjacent columns (coalesced), the 8 warps of a block take every 8th row of a chunk of
//       `rchunk` rows, and combine through shared memory. gridDim.y chunks of R per column give
//       the GPU enough blocks; each writes a partial.
//   reduce_finish<P, T, G>  combines the partials of each output (G threads per output: 32 when
//       they are contiguous, 1 when adjacent outputs' partials are) and writes the result.
//
// Partials live in a workspace the host allocates per call (no float atomics: results are
// deterministic for a given shape and device). Accumulation is fp32; outputs are T (values) or
// int64 (indices). NaN propagates as in torch: amax/amin give NaN, argmax/argmin the first NaN.
#include "common/dtypes.cuh"
#include "common/vec.cuh"
#include "common/reduce.cuh"

namespace gpuops {
namespace red {

constexpr int kThreads = 256;
// Blocks per SM the register budget must allow (<= 64 registers): with the thread bound alone
// ptxas picked 32 registers for some of these kernels and spilled.
constexpr int kMinBlocks = 4;
constexpr int kUnroll = 4;            // 16-byte loads in flight per thread before any is used
constexpr long long kNoIndex = 0x7fffffffffffffffll;

// ---------------------------------------------------------------------------------------------
// Policies: the state a thread carries, how an element enters it, how two states combine, and
// how the final state is stored.

struct ScalarOps {           // states that are one float
  using State = float;
  static constexpr bool kIndexed = false;
  static __device__ __forceinline__ float value(State s) { return s; }
  static __device__ __forceinline__ long long index(State) { return 0; }
  static __device__ __forceinline__ State make(float v, long long) { return v; }
  static __device__ __forceinline__ State shfl_xor(State s, int offset) {
    return __shfl_xor_sync(kFullMask, s, offset);
  }
  static __device__ __forceinline__ void to_ws(float* v, long long*, long long off, State s) {
    v[off] = s;
  }
  static __device__ __forceinline__ State from_ws(const float* v, const long long*, long long off) {
    return v[off];
  }
};

struct Sum : ScalarOps {     // sum and mean (scale = 1 / R)
  static __device__ __forceinline__ State init() { return 0.0f; }
  static __device__ __forceinline__ State add(State s, float x, long long) { return s + x; }
  template <int N>
  static __device__ __forceinline__ State add_pack(State s, const float (&f)[N], long long) {
    // a pairwise tree per pack: one dependent add per pack in the loop, and smaller rounding
    float t[N];
#pragma unroll
    for (int j = 0; j < N; ++j) t[j] = f[j];
#pragma unroll
    for (int w = N / 2; w > 0; w >>= 1) {
#pragma unroll
      for (int j = 0; j < w; ++j) t[j] += t[j + w];
    }
    return s + t[0];
  }
  static __device__ __forceinline__ State combine(State a, State b) { return a + b; }
  template <class T>
  static __device__ __forceinline__ void store(void* out, long long off, State s, float scale) {
    static_cast<T*>(out)[off] = from_float<T>(s * scale);
  }
};

template <class Op>
struct Extremum : ScalarOps {   // amax (MaxOp) and amin (MinOp): NaN wins
  static __device__ __forceinline__ State init() { return Op::template identity<float>(); }
  static __device__ __forceinline__ State add(State s, float x, long long) {
    return Op::combine(s, x);
  }
  template <int N>
  static __device__ __forceinline__ State add_pack(State s, const float (&f)[N], long long) {
#pragma unroll
    for (int j = 0; j < N; ++j) s = Op::combine(s, f[j]);
    return s;
  }
  static __device__ __forceinline__ State combine(State a, State b) { return Op::combine(a, b); }
  template <class T>
  static __device__ __forceinline__ void store(void* out, long long off, State s, float) {
    static_cast<T*>(out)[off] = from_float<T>(s);
  }
};
using Max = Extremum<MaxOp>;
using Min = Extremum<MinOp>;

// argmax (kMax) / argmin: the value and index of the winner. The order is total: a NaN beats
// every number, equal values (and two NaNs) go to the smaller index, as torch.argmax.
// add / add_pack see a thread's elements in increasing index order (the kernels guarantee it), so
// a later element wins only if strictly better; combine (across threads) compares indices too.
template <bool kMax>
struct Arg {
  struct State { float v; long long i; };
  static constexpr bool kIndexed = true;
  static __device__ __forceinline__ float value(State s) { return s.v; }
  static __device__ __forceinline__ long long index(State s) { return s.i; }
  static __device__ __forceinline__ State make(float v, long long i) { return {v, i}; }
  static __device__ __forceinline__ State init() {
    return {kMax ? -__int_as_float(0x7f800000) : __int_as_float(0x7f800000), kNoIndex};
  }
  // b strictly better than a: b is a NaN and a is not, or b beats a as a number
  static __device__ __forceinline__ bool strictly_better(float a, float b) {
    return (b != b && a == a) || (kMax ? b > a : b < a);
  }
  static __device__ __forceinline__ State add(State s, float x, long long i) {
    return (s.i == kNoIndex || strictly_better(s.v, x)) ? State{x, i} : s;
  }
  template <int N>
  static __device__ __forceinline__ State add_pack(State s, const float (&f)[N], long long i0) {
    // a tree over the pack (left operands have the smaller positions), then one update
    float v[N];
    int j[N];
#pragma unroll
    for (int e = 0; e < N; ++e) {
      v[e] = f[e];
      j[e] = e;
    }
#pragma unroll
    for (int w = 1; w < N; w <<= 1) {
#pragma unroll
      for (int e = 0; e + w < N; e += 2 * w) {
        if (strictly_better(v[e], v[e + w])) {
          v[e] = v[e + w];
          j[e] = j[e + w];
        }
      }
    }
    return (s.i == kNoIndex || strictly_better(s.v, v[0])) ? State{v[0], i0 + j[0]} : s;
  }
  static __device__ __forceinline__ State combine(State a, State b) {
    if (a.i == kNoIndex) return b;
    if (b.i == kNoIndex) return a;
    const bool an = a.v != a.v, bn = b.v != b.v;
    const bool take_b = (an | bn) ? (bn && (!an || b.i < a.i))
                                  : ((kMax ? b.v > a.v : b.v < a.v) || (b.v == a.v && b.i < a.i));
    return take_b ? b : a;
  }
  static __device__ __forceinline__ State shfl_xor(State s, int offset) {
    return {__shfl_xor_sync(kFullMask, s.v, offset), __shfl_xor_sync(kFullMask, s.i, offset)};
  }
  static __device__ __forceinline__ void to_ws(float* v, long long* i, long long off, State s) {
    v[off] = s.v;
    i[off] = s.i;
  }
  static __device__ __forceinline__ State from_ws(const float* v, const long long* i,
                                                  long long off) {
    return {v[off], i[off]};
  }
  template <class T>
  static __device__ __forceinline__ void store(void* out, long long off, State s, float) {
    static_cast<long long*>(out)[off] = s.i;
  }
};
using ArgMax = Arg<true>;
using ArgMin = Arg<false>;

// Combination over aligned groups of G lanes (G <= 32, a power of two); every lane of the warp
// must call it. Every lane of a group returns the group's result.
template <class P, int G>
__device__ __forceinline__ typename P::State group_reduce(typename P::State s) {
#pragma unroll
  for (int offset = G / 2; offset > 0; offset >>= 1) s = P::combine(s, P::shfl_xor(s, offset));
  return s;
}

// Combination over the whole block (kThreads); thread 0 returns the result.
template <class P>
__device__ __forceinline__ typename P::State block_combine(typename P::State s) {
  __shared__ typename P::State scratch[kThreads / 32];
  s = group_reduce<P, 32>(s);
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) scratch[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) s = P::combine(s, scratch[w]);
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Rows: a group of TPR threads reduces part blockIdx.y of a row.

template <class P, class T, int VEC, int TPR>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
reduce_rows(const T* __restrict__ x, void* __restrict__ out, float* __restrict__ ws_v,
            long long* __restrict__ ws_i, long long A, long long B, long long R, long long sa,
            long long sb, long long sr, long long oa, long long ob, long long chunk, float scale) {
  static_assert(TPR == kThreads || TPR <= 32, "a group is a warp or less, or the whole block");
  using State = typename P::State;
  constexpr int kGroups = kThreads / TPR;
  const int t = threadIdx.x % TPR;
  // blockIdx.y is the part of the row (gridDim.y parts of `chunk` elements or packs each): no
  // 64-bit division anywhere (it is a subroutine call, and spills around it)
  const long long row = static_cast<long long>(blockIdx.x) * kGroups + threadIdx.x / TPR;
  const long long part = blockIdx.y;
  const bool active = row < A * B;
  long long a = row, b = 0;
  if (B > 1) {                    // the host keeps A * B < 2^32 when B > 1
    a = static_cast<unsigned>(row) / static_cast<unsigned>(B);
    b = row - a * B;
  }
  const T* px = x + a * sa + b * sb;
  State st = P::init();
  if (active) {
    if constexpr (VEC == 1) {
      const long long begin = part * chunk;
      const long long end = begin + chunk < R ? begin + chunk : R;
      long long r = begin + t;
      for (; r + (kUnroll - 1) * TPR < end; r += kUnroll * TPR) {
        float v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = to_float(px[(r + u * TPR) * sr]);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) st = P::add(st, v[u], r + u * TPR);
      }
      for (; r < end; r += TPR) st = P::add(st, to_float(px[r * sr]), r);
    } else {
      static_assert(VEC == Vec16<T>::size, "VEC must be one 16-byte pack of T");
      // Elements before the first 16-byte boundary (head) and after the last whole pack (tail)
      // are read one by one by the first and the last part (fewer than VEC <= TPR of each), so
      // that each thread sees its elements in increasing order.
      const int mis = static_cast<int>((reinterpret_cast<unsigned long long>(px) & 15u) / sizeof(T));
      const long long head = mis == 0 ? 0 : (VEC - mis < R ? VEC - mis : R);
      const long long packs = (R - head) / VEC;
      const long long tail = head + packs * VEC;
      if (part == 0 && t < head) st = P::add(st, to_float(px[t]), t);
      const long long begin = part * chunk;   // chunk >= ceil(packs / parts) for every row
      const long long end = begin + chunk < packs ? begin + chunk : packs;
      const T* body = px + head;
      long long v = begin + t;
      for (; v + (kUnroll - 1) * TPR < end; v += kUnroll * TPR) {
        uint4 raw[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) raw[u] = load16(body + (v + u * TPR) * VEC);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          float f[VEC];
          Vec16<T>::unpack(raw[u], f);
          st = P::add_pack(st, f, head + (v + u * TPR) * VEC);
        }
      }
      for (; v < end; v += TPR) {
        float f[VEC];
        Vec16<T>::unpack(load16(body + v * VEC), f);
        st = P::add_pack(st, f, head + v * VEC);
      }
      if (part == gridDim.y - 1 && tail + t < R) st = P::add(st, to_float(px[tail + t]), tail + t);
    }
  }
  if constexpr (TPR == kThreads) {
    st = block_combine<P>(st);
  } else {
    st = group_reduce<P, TPR>(st);
  }
  if (active && t == 0) {
    if (gridDim.y == 1) {
      P::template store<T>(out, a * oa + b * ob, st, scale);
    } else {
      P::to_ws(ws_v, ws_i, row * gridDim.y + part, st);     // partials laid out [rows, parts]
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Columns: block = (a, tile of 32 * VEC columns, chunk of rows). Lane -> pack of VEC adjacent
// columns, warp -> every 8th row of the chunk.

// argmax/argmin keep VEC (value, int64 index) states per thread: up to ~80 registers.
template <class P, class T, int VEC>
__global__ void __launch_bounds__(kThreads, P::kIndexed ? 3 : kMinBlocks)
reduce_cols(const T* __restrict__ x, void* __restrict__ out, float* __restrict__ ws_v,
            long long* __restrict__ ws_i, long long A, long long B, long long R, long long sa,
            long long sb, long long sr, long long oa, long long ob, long long rchunk, float scale) {
  using State = typename P::State;
  constexpr int kWarps = kThreads / 32;
  constexpr int kCols = 32 * VEC;
  // the warps' states, with indices relative to the chunk (int: the host keeps rchunk < 2^31)
  __shared__ float partial_v[kWarps][kCols];
  __shared__ int partial_i[P::kIndexed ? kWarps : 1][P::kIndexed ? kCols : 1];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // blockIdx.x = a * tiles + tile (32-bit division: fewer than 2^31 blocks), blockIdx.y = part
  const unsigned tiles = static_cast<unsigned>((B + kCols - 1) / kCols);
  const long long tile = blockIdx.x % tiles;
  const long long a = blockIdx.x / tiles;
  const long long part = blockIdx.y;
  const long long splits = gridDim.y;
  const long long b0 = tile * kCols + lane * VEC;
  const long long begin = part * rchunk;
  const long long end = begin + rchunk < R ? begin + rchunk : R;

  State st[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) st[j] = P::init();
  if (b0 < B) {
    const T* p = x + a * sa + b0 * sb;
    long long r = begin + warp;
    if constexpr (VEC == 1) {
      for (; r + (kUnroll - 1) * kWarps < end; r += kUnroll * kWarps) {
        float v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = to_float(p[(r + u * kWarps) * sr]);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) st[0] = P::add(st[0], v[u], r + u * kWarps);
      }
      for (; r < end; r += kWarps) st[0] = P::add(st[0], to_float(p[r * sr]), r);
    } else {
      static_assert(VEC == Vec16<T>::size, "VEC must be one 16-byte pack of T");
      for (; r + (kUnroll - 1) * kWarps < end; r += kUnroll * kWarps) {
        uint4 raw[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) raw[u] = load16(p + (r + u * kWarps) * sr);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          float f[VEC];
          Vec16<T>::unpack(raw[u], f);
#pragma unroll
          for (int j = 0; j < VEC; ++j) st[j] = P::add(st[j], f[j], r + u * kWarps);
        }
      }
      for (; r < end; r += kWarps) {
        float f[VEC];
        Vec16<T>::unpack(load16(p + r * sr), f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) st[j] = P::add(st[j], f[j], r);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    partial_v[warp][lane * VEC + j] = P::value(st[j]);
    if constexpr (P::kIndexed) {   // the identity's index (no element seen) stays out of range
      const long long i = P::index(st[j]);
      partial_i[warp][lane * VEC + j] = i == kNoIndex ? -1 : static_cast<int>(i - begin);
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < kCols; c += kThreads) {
    State s = P::init();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      long long i = 0;
      if constexpr (P::kIndexed) {
        const int rel = partial_i[w][c];
        i = rel < 0 ? kNoIndex : begin + rel;
      }
      s = P::combine(s, P::make(partial_v[w][c], i));
    }
    const long long b = tile * kCols + c;
    if (b < B) {
      if (splits == 1) {
        P::template store<T>(out, a * oa + b * ob, s, scale);
      } else {
        P::to_ws(ws_v, ws_i, (a * splits + part) * B + b, s);   // partials laid out [A, splits, B]
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Finish: output (a, b) combines the partials at a * pa + b * pb + s * ps, s < splits. G threads
// per output (8 or 32 lanes, or the whole block for G = 256) take every G-th partial, then
// combine in a fixed tree.

template <class P, class T, int G>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
reduce_finish(const float* __restrict__ ws_v, const long long* __restrict__ ws_i,
              void* __restrict__ out, long long A, long long B, int splits, long long pa,
              long long pb, long long ps, long long oa, long long ob, float scale) {
  static_assert(G == kThreads || G <= 32, "a group is a warp or less, or the whole block");
  using State = typename P::State;
  const long long group = (static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x) / G;
  const int t = threadIdx.x % G;
  const bool active = group < A * B;
  long long a = group, b = 0;
  if (B > 1) {                    // the host keeps A * B < 2^32
    a = static_cast<unsigned>(group) / static_cast<unsigned>(B);
    b = group - a * B;
  }
  State st = P::init();
  if (active) {
    const long long base = a * pa + b * pb;
#pragma unroll 4
    for (int s = t; s < splits; s += G) st = P::combine(st, P::from_ws(ws_v, ws_i, base + s * ps));
  }
  if constexpr (G == kThreads) {
    st = block_combine<P>(st);
  } else {
    st = group_reduce<P, G>(st);
  }
  if (active && t == 0) P::template store<T>(out, a * oa + b * ob, st, scale);
}

}  // namespace red
}  // namespace gpuops
