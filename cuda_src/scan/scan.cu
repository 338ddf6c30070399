// Prefix sums (cumsum) along one dimension, inclusive or exclusive, forward or reversed.
//
// Rows (the scanned index contiguous, or strided with VEC = 1): row `row` is x[row * sx_row +
// q * sx] and y[row * R + q] (y is contiguous). A warp scans a tile of 32 * K packs (VEC elements
// each): each lane owns one pack per sub-tile k, scanned as
//   lane: sequential scan of its pack  ->  warp: shuffle scan of pack totals  ->
//   tile: the sub-tiles in order  ->  row: the tile's prefix,
// the prefix being a running carry when a warp walks a whole row (many rows), or decoupled
// look-back between the warps holding a long row's tiles (common/scan.cuh): one read and one
// write of the data either way.
// A row start that is not 16-byte aligned (same offset in x and y, checked by the host) has up to
// VEC - 1 "head" elements, and a row end up to VEC - 1 "tail" elements: one lane handles them
// (the first tile those first in scan order, the last tile those last). A reversed scan is the
// forward scan of the row read backwards: packs in reverse order, elements in a pack reversed.
//
// Columns (the scanned index r of x[a, r, b] strided, b contiguous): scan_cols gives each thread
// a pack of columns and a chunk of rows, walked sequentially; the chunks' column sums come first
// from the reduce family's column kernel (reduce_cols<Sum>), scan_carries turns them into
// exclusive prefixes over the chunks in place.
//
// Accumulation is fp32; y has x's dtype.
#include "common/dtypes.cuh"
#include "common/vec.cuh"
#include "common/scan.cuh"
#include "common/opaque.cuh"

namespace gpuops {
namespace scan {

constexpr int kThreads = 256;
// Blocks per SM the register budget must allow (<= 64 registers): with the thread bound alone
// ptxas picked 32 registers for some of these kernels and spilled.
constexpr int kMinBlocks = 4;
constexpr int kWarps = kThreads / 32;
constexpr int kColUnroll = 8;        // rows in flight per thread in scan_cols

// Where a row's pieces are, physically. Scan order: prologue, body packs, epilogue.
template <class T, int VEC, bool REV>
struct RowGeom {
  long long R, head, packs, tail;      // head: [0, head); packs from head; tail: [tail, R)
  __device__ __forceinline__ RowGeom(const T* px, long long R_) : R(R_) {
    if constexpr (VEC == 1) {
      head = 0;
    } else {
      const int mis = static_cast<int>((reinterpret_cast<unsigned long long>(px) & 15u) / sizeof(T));
      head = mis == 0 ? 0 : (VEC - mis < R ? VEC - mis : R);
    }
    packs = (R - head) / VEC;
    tail = head + packs * VEC;
  }
  __device__ __forceinline__ int n_prologue() const { return static_cast<int>(REV ? R - tail : head); }
  __device__ __forceinline__ int n_epilogue() const { return static_cast<int>(REV ? head : R - tail); }
  __device__ __forceinline__ long long prologue(int i) const { return REV ? R - 1 - i : i; }
  __device__ __forceinline__ long long epilogue(int i) const { return REV ? head - 1 - i : tail + i; }
  __device__ __forceinline__ long long pack(long long lv) const {   // first physical element
    return head + (REV ? packs - 1 - lv : lv) * VEC;
  }
};

// Lane-serial scan of the few scalar elements at a row end (fewer than VEC): writes y with
// `base` added and returns their sum.
template <class T, int VEC, bool REV>
__device__ __forceinline__ float scan_scalars(const T* px, long long sx, T* py, const RowGeom<T, VEC, REV>& g,
                                              bool prologue, float base, int exclusive) {
  const int n = prologue ? g.n_prologue() : g.n_epilogue();
  float run = 0.0f;
  for (int i = 0; i < n; ++i) {
    const long long q = prologue ? g.prologue(i) : g.epilogue(i);
    const float v = to_float(px[q * sx]);
    const float before = run;
    run += v;
    py[q] = from_float<T>(base + (exclusive ? before : run));
  }
  return run;
}

// A pack as loaded: the raw 16-byte word (VEC > 1) or the element. Packs stay raw while a tile
// waits for its prefix (half the registers of floats for 16-bit types), and are unpacked and
// scanned again when stored: the same additions in the same order, so the same values.
template <int VEC> struct RawPack { uint4 w; };
template <> struct RawPack<1> { float w; };

// The pack's elements in scan order, scanned in place.
template <class T, int VEC, bool REV>
__device__ __forceinline__ void unpack_scan(const RawPack<VEC>& raw, float (&v)[VEC]) {
  if constexpr (VEC == 1) {
    v[0] = raw.w;
  } else {
    float f[VEC];
    Vec16<T>::unpack(raw.w, f);
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[e] = f[REV ? VEC - 1 - e : e];
  }
#pragma unroll
  for (int e = 1; e < VEC; ++e) v[e] += v[e - 1];
}

// The pack of logical index lv (zeros past the body).
template <class T, int VEC, bool REV>
__device__ __forceinline__ RawPack<VEC> load_pack(const T* px, long long sx,
                                                  const RowGeom<T, VEC, REV>& g, long long lv) {
  RawPack<VEC> raw;
  if constexpr (VEC == 1) {
    raw.w = lv < g.packs ? to_float(px[g.pack(lv) * sx]) : 0.0f;
  } else {
    raw.w = lv < g.packs ? load16(px + g.pack(lv)) : make_uint4(0u, 0u, 0u, 0u);
  }
  return raw;
}

template <class T, int VEC, bool REV>
__device__ __forceinline__ float pack_total(const RawPack<VEC>& raw) {
  float v[VEC];
  unpack_scan<T, VEC, REV>(raw, v);
  return v[VEC - 1];
}

template <class T, int VEC, bool REV>
__device__ __forceinline__ void store_pack(T* py, const RowGeom<T, VEC, REV>& g, long long lv,
                                           const RawPack<VEC>& raw, float base, int exclusive) {
  if (lv >= g.packs) return;
  // Opaque: the scan is recomputed here rather than the one of pack_total kept alive across the
  // look-back (which took up to twice the registers).
  RawPack<VEC> r = raw;
  opaque(r.w);
  float v[VEC];
  unpack_scan<T, VEC, REV>(r, v);
  const long long p = g.pack(lv);
  float out[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float s = exclusive ? (e == 0 ? 0.0f : v[e - 1]) : v[e];
    out[REV ? VEC - 1 - e : e] = base + s;
  }
  if constexpr (VEC == 1) {
    py[p] = from_float<T>(out[0]);
  } else {
    store16(py + p, Vec16<T>::pack(out));
  }
}

// A warp scans tiles of 32 * K packs (1024 elements for fp32 with K = 8 and 16-bit types with
// K = 4). Two modes:
//   tiles == 1   a warp per row, walking the row's tiles in order with a running carry (rows
//                many enough to fill the GPU, or short);
//   tiles > 1    a warp per tile: tiles are handed out in start order by an atomic counter, and
//                the tiles of a row chain through decoupled look-back (long rows, few of them).
// No block-wide barrier anywhere: warps are independent.
// A lane holds K packs while its tile waits for the prefix: 70-120 registers (2-3 blocks per SM,
// 16-24 warps with 2-4 KiB in flight each).
template <class T, int VEC, int K, bool REV>
__global__ void __launch_bounds__(kThreads, 2)
scan_rows(const T* __restrict__ x, T* __restrict__ y, long long rows, long long R,
          long long sx_row, long long sx, int exclusive, long long tiles,
          unsigned long long* __restrict__ states, unsigned int* __restrict__ counter) {
  static_assert(VEC == 1 || VEC == Vec16<T>::size, "VEC must be 1 or one 16-byte pack of T");
  constexpr long long kTile = static_cast<long long>(K) * 32;
  const int lane = lane_id();
  const int warp = threadIdx.x >> 5;

  if (tiles == 1) {
    const long long row = static_cast<long long>(blockIdx.x) * kWarps + warp;
    if (row >= rows) return;                        // whole warps
    const T* px = x + row * sx_row;
    T* py = y + row * R;
    const RowGeom<T, VEC, REV> g(px, R);
    float carry = 0.0f;
    if (lane == 0) carry = scan_scalars<T, VEC, REV>(px, sx, py, g, true, 0.0f, exclusive);
    carry = __shfl_sync(kFullMask, carry, 0);
    for (long long t0 = 0; t0 < g.packs; t0 += kTile) {
      RawPack<VEC> raw[K];
#pragma unroll
      for (int k = 0; k < K; ++k) raw[k] = load_pack<T, VEC, REV>(px, sx, g, t0 + k * 32 + lane);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        float total;
        const float excl = warp_exclusive_scan<SumOp>(pack_total<T, VEC, REV>(raw[k]), 0.0f, total);
        store_pack<T, VEC, REV>(py, g, t0 + k * 32 + lane, raw[k], carry + excl, exclusive);
        carry += total;
      }
    }
    if (lane == 0) scan_scalars<T, VEC, REV>(px, sx, py, g, false, carry, exclusive);
    return;
  }

  // A warp per tile. rows * tiles < 2^32 (the host checks): 32-bit division.
  unsigned tile_id = 0;
  if (lane == 0) tile_id = atomicAdd(counter, 1u);
  tile_id = __shfl_sync(kFullMask, tile_id, 0);
  if (tile_id >= rows * tiles) return;              // the grid rounds up to whole blocks
  const long long row = tile_id / static_cast<unsigned>(tiles);
  const long long j = tile_id - row * tiles;
  const T* px = x + row * sx_row;
  T* py = y + row * R;
  const RowGeom<T, VEC, REV> g(px, R);
  const long long t0 = j * kTile;

  RawPack<VEC> raw[K];
  float excl[K];
  float body = 0.0f;                                // sub-tile k's base within the tile, then the sum
#pragma unroll
  for (int k = 0; k < K; ++k) raw[k] = load_pack<T, VEC, REV>(px, sx, g, t0 + k * 32 + lane);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float total;
    excl[k] = body + warp_exclusive_scan<SumOp>(pack_total<T, VEC, REV>(raw[k]), 0.0f, total);
    body += total;
  }
  // The row's scalar ends: the first tile's prologue (prefix 0: written now), the last tile's
  // epilogue (written once the tile's prefix is known).
  float pro = 0.0f, epi = 0.0f;
  if (lane == 0 && j == 0) pro = scan_scalars<T, VEC, REV>(px, sx, py, g, true, 0.0f, exclusive);
  if (lane == 0 && j == tiles - 1) {
    for (int i = 0; i < g.n_epilogue(); ++i) epi += to_float(px[g.epilogue(i) * sx]);
  }
  pro = __shfl_sync(kFullMask, pro, 0);
  epi = __shfl_sync(kFullMask, epi, 0);
  const float aggregate = pro + body + epi;
  unsigned long long* row_states = states + row * tiles;
  float prefix = 0.0f;
  if (j == 0) {
    if (lane == 0) lookback::publish(row_states, lookback::kPrefix, aggregate);
  } else {
    if (lane == 0) lookback::publish(row_states + j, lookback::kAggregate, aggregate);
    prefix = lookback::exclusive_prefix(row_states, j);
    if (lane == 0) lookback::publish(row_states + j, lookback::kPrefix, prefix + aggregate);
  }
  const float base = prefix + pro;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    store_pack<T, VEC, REV>(py, g, t0 + k * 32 + lane, raw[k], base + excl[k], exclusive);
  }
  if (lane == 0 && j == tiles - 1) scan_scalars<T, VEC, REV>(px, sx, py, g, false, base + body, exclusive);
}

// Zeroes the look-back status words and the tile counter (the workspace is fresh memory).
__global__ void __launch_bounds__(kThreads, kMinBlocks)
scan_init(unsigned long long* __restrict__ states, long long n, unsigned int* __restrict__ counter) {
  const long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) states[i] = 0ull;
  if (i == 0) *counter = 0u;
}

// ---------------------------------------------------------------------------------------------
// Columns.

// sums[(a * parts + p) * B + b]: chunk p's column sums -> the sum of the chunks before p in scan
// order (after p when reversed). One thread per column, sequential over the parts.
template <bool REV>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
scan_carries(float* __restrict__ sums, long long A, long long B, int parts) {
  const long long c = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= A * B) return;
  const long long a = static_cast<unsigned>(c) / static_cast<unsigned>(B);   // A * B < 2^32
  const long long b = c - a * B;
  float* s = sums + a * parts * B + b;
  float run = 0.0f;
  constexpr int kBatch = 8;            // loads of a batch issued before its stores
  for (int i = 0; i < parts; i += kBatch) {
    float t[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int p = REV ? parts - 1 - (i + u) : i + u;
      if (i + u < parts) t[u] = s[p * B];
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int p = REV ? parts - 1 - (i + u) : i + u;
      if (i + u < parts) {
        s[p * B] = run;
        run += t[u];
      }
    }
  }
}

// blockIdx.x = a * tiles + tile (tile: 256 packs of columns), blockIdx.y = chunk of `rchunk` rows.
// kColUnroll packs in flight per thread need up to ~100 registers: 2 blocks per SM.
template <class T, int VEC, bool REV>
__global__ void __launch_bounds__(kThreads, 2)
scan_cols(const T* __restrict__ x, T* __restrict__ y, long long A, long long B, long long R,
          long long sa, long long sb, long long sr, long long rchunk,
          const float* __restrict__ carries, int exclusive) {
  constexpr int kCols = kThreads * VEC;
  const unsigned tiles = static_cast<unsigned>((B + kCols - 1) / kCols);
  const long long tile = blockIdx.x % tiles;
  const long long a = blockIdx.x / tiles;
  const long long part = blockIdx.y;
  const long long b0 = tile * kCols + static_cast<long long>(threadIdx.x) * VEC;
  if (b0 >= B) return;
  const long long begin = part * rchunk;
  const long long n = (begin + rchunk < R ? begin + rchunk : R) - begin;
  float acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    acc[e] = carries ? carries[(a * gridDim.y + part) * B + b0 + e] : 0.0f;
  }
  const T* px = x + a * sa + b0 * sb;
  T* py = y + a * R * B + b0;
  long long i = 0;
  for (; i < n; i += kColUnroll) {
    const int m = n - i < kColUnroll ? static_cast<int>(n - i) : kColUnroll;
    long long rr[kColUnroll];
    float f[kColUnroll][VEC];
#pragma unroll
    for (int u = 0; u < kColUnroll; ++u) {
      rr[u] = begin + (REV ? n - 1 - (i + u) : i + u);
      if (u < m) {
        if constexpr (VEC == 1) {
          f[u][0] = to_float(px[rr[u] * sr]);
        } else {
          Vec16<T>::unpack(load16(px + rr[u] * sr), f[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kColUnroll; ++u) {
      if (u < m) {
        float out[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float before = acc[e];
          acc[e] += f[u][e];
          out[e] = exclusive ? before : acc[e];
        }
        if constexpr (VEC == 1) {
          py[rr[u] * B] = from_float<T>(out[0]);
        } else {
          store16(py + rr[u] * B, Vec16<T>::pack(out));
        }
      }
    }
  }
}

}  // namespace scan
}  // namespace gpuops
