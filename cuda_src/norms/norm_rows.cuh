// Row machinery shared by the normalization kernels (layer_norm, rms_norm, their backward).
//
// A row of n elements is cut into units: 16-byte packs (VEC = 4 fp32 or 8 fp16/bf16 values) when
// every row start is 16-byte aligned and n % VEC == 0, else single elements (VEC = 1). A block of
// blockDim.x threads holds PACKS units per thread in registers: thread t of the block holds units
// base + p * blockDim.x + t, p < PACKS (coalesced: consecutive threads, consecutive units), with
// base = chunk * blockDim.x * PACKS.
//
// How rows map onto blocks (RowMap), for C blocks per row:
//   C == 1  one row per block row: a block of (32, R) threads holds R rows, one per warp, and
//           reduces with warp shuffles only; a block of (>32, 1) holds one row and reduces through
//           shared memory. Rows first, first + step, ... (a grid-stride loop over rows).
//   C > 1   blockDim.y == 1, gridDim.x a multiple of C: block b holds chunk b % C of rows b / C,
//           b / C + gridDim.x / C, ... Each block reduces its chunk to a partial and the row's
//           blocks combine them through global memory (common/row_split.cuh), either in one launch
//           (phase kFused: the whole grid is resident; blocks wait for their row's statistics, so
//           the chunk is read once and stays in registers; the forward ops use separate
//           *_split kernels that also prefetch their next row's chunk while they wait) or in two
//           (kPartials: partials, the last block of each row writes the row's statistics;
//           kApply: every block reads its chunk again and applies them).
#pragma once
#include "common/dtypes.cuh"
#include "common/vec.cuh"
#include "common/row_stats.cuh"
#include "common/row_split.cuh"

namespace gpuops {

constexpr int kFused = 0;
constexpr int kPartials = 1;
constexpr int kApply = 2;

// One unit of a row: a 16-byte pack...
template <class T, int VEC>
struct Unit {
  static_assert(VEC == Vec16<T>::size, "a unit is one element or one 16-byte pack");
  static __device__ __forceinline__ void load(const T* p, float (&f)[VEC]) {
    Vec16<T>::unpack(load16(p), f);
  }
  static __device__ __forceinline__ void store(T* p, const float (&f)[VEC]) {
    store16(p, Vec16<T>::pack(f));
  }
  // Stores f rounded to T and leaves the rounded values in f.
  static __device__ __forceinline__ void store_rounded(T* p, float (&f)[VEC]) {
    const uint4 r = Vec16<T>::pack(f);
    store16(p, r);
    Vec16<T>::unpack(r, f);
  }
};

// ... or a single element.
template <class T>
struct Unit<T, 1> {
  static __device__ __forceinline__ void load(const T* p, float (&f)[1]) { f[0] = to_float(*p); }
  static __device__ __forceinline__ void store(T* p, const float (&f)[1]) {
    *p = from_float<T>(f[0]);
  }
  static __device__ __forceinline__ void store_rounded(T* p, float (&f)[1]) {
    const T r = from_float<T>(f[0]);
    *p = r;
    f[0] = to_float(r);
  }
};

// A unit as raw bits (in flight, or held in shared memory by norm_ring.cuh): the 16-byte pack,
// or the element itself.
template <class T, int VEC>
struct RawUnit {
  using type = uint4;
  static __device__ __forceinline__ uint4 load(const T* p) { return load16(p); }
  static __device__ __forceinline__ uint4 zero() { return make_uint4(0u, 0u, 0u, 0u); }
  static __device__ __forceinline__ void unpack(const uint4& r, float (&f)[VEC]) {
    Vec16<T>::unpack(r, f);
  }
  static __device__ __forceinline__ uint4 pack(const float (&f)[VEC]) { return Vec16<T>::pack(f); }
  static __device__ __forceinline__ void store(T* p, const uint4& r) { store16(p, r); }
};

template <class T>
struct RawUnit<T, 1> {
  using type = T;
  static __device__ __forceinline__ T load(const T* p) { return *p; }
  static __device__ __forceinline__ T zero() { return from_float<T>(0.0f); }
  static __device__ __forceinline__ void unpack(const T& r, float (&f)[1]) { f[0] = to_float(r); }
  static __device__ __forceinline__ T pack(const float (&f)[1]) { return from_float<T>(f[0]); }
  static __device__ __forceinline__ void store(T* p, const T& r) { *p = r; }
};

// Loads of `w` (and `b`) for packs p0 .. p0 + G - 1 of a tile, all issued before the first is
// used: one L2 round trip per group of packs, not one per pack.
template <class T, int VEC, int G>
__device__ __forceinline__ void load_params(const T* w, int u0, int p0, int units,
                                            typename RawUnit<T, VEC>::type (&wr)[G]) {
  using R = RawUnit<T, VEC>;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int unit = u0 + (p0 + g) * static_cast<int>(blockDim.x);
    wr[g] = unit < units ? R::load(w + static_cast<long long>(unit) * VEC) : R::zero();
  }
}

// This thread's units of a row (or of a tile, norm_ring.cuh) as raw bits in registers (loads in
// flight until first used): 16-bit values take half the registers of floats.
template <class T, int VEC, int PACKS>
struct RawTile {
  using R = RawUnit<T, VEC>;
  typename R::type u[PACKS];

  // Units past the row's end read as zero (+0.0: no contribution to sums).
  __device__ __forceinline__ void load(const T* row, int u0, int units) {
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      const int unit = u0 + p * static_cast<int>(blockDim.x);
      u[p] = unit < units ? R::load(row + static_cast<long long>(unit) * VEC) : R::zero();
    }
  }
};

// A thread's packs as floats, pack by pack (get(p, f)): from a float array, or converted from raw
// units on each use (a shift for bf16, cvt for fp16, nothing for fp32).
template <int VEC, int PACKS>
struct FloatPacks {
  const float (&v)[PACKS][VEC];
  __device__ __forceinline__ void get(int p, float (&f)[VEC]) const {
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] = v[p][j];
  }
};

template <class T, int VEC, int PACKS>
struct RawPacks {
  const RawTile<T, VEC, PACKS>& t;
  __device__ __forceinline__ void get(int p, float (&f)[VEC]) const {
    RawUnit<T, VEC>::unpack(t.u[p], f);
  }
};

// The rows of this thread (first, first + step, ...) and its block's chunk of them.
struct RowMap {
  int chunk;
  long long first, step;
  // reverse (C > 1): blocks take their (row, chunk) from the end of the grid, so that the kApply
  // launch, whose blocks start roughly in blockIdx order, first re-reads what kPartials read
  // last (still in L2). Any bijection of blocks covers every (row, chunk) once.
  __device__ __forceinline__ explicit RowMap(int C, bool reverse = false) {
    if (C > 1) {
      const unsigned b = reverse ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
      chunk = static_cast<int>(b % C);
      first = b / C;
      step = gridDim.x / C;
    } else {
      chunk = 0;
      first = static_cast<long long>(blockIdx.x) * blockDim.y + threadIdx.y;
      step = static_cast<long long>(gridDim.x) * blockDim.y;
    }
  }
};

// This thread's first unit of the block's chunk; its others follow every blockDim.x units.
template <int PACKS>
__device__ __forceinline__ int first_unit(int chunk) {
  return chunk * static_cast<int>(blockDim.x) * PACKS + static_cast<int>(threadIdx.x);
}

// Loads this thread's units of `row` (units past `units` read as 0).
template <class T, int VEC, int PACKS>
__device__ __forceinline__ void load_tile(const T* row, int u0, int units, float (&v)[PACKS][VEC]) {
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
    const int u = u0 + p * static_cast<int>(blockDim.x);
    if (u < units) {
      Unit<T, VEC>::load(row + static_cast<long long>(u) * VEC, v[p]);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[p][j] = 0.0f;
    }
  }
}

// Merge of a row's C published (n, mean, m2) partials, in a fixed order (thread t takes
// partials t, t + blockDim.x, ..., then the block merges): the same result in every block.
__device__ __forceinline__ MeanM2 merge_welford_partials(const float* partials, int C,
                                                         float* scratch) {
  MeanM2 acc = {0.0f, 0.0f, 0.0f};
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const MeanM2 part = {load_cg(partials + 3 * c), load_cg(partials + 3 * c + 1),
                         load_cg(partials + 3 * c + 2)};
    acc = welford_merge(acc, part);
  }
  return block_welford(acc, scratch);
}

// Sums of a row's C published partials of K values each, in a fixed order.
template <int K>
__device__ __forceinline__ void sum_partials(const float* partials, int C, float (&v)[K],
                                             float* scratch) {
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += load_cg(partials + K * c + k);
  }
  block_sum_n<K>(v, scratch);
}

}  // namespace gpuops
