// Top-k along one dimension: values and int64 indices.
//
// Order (torch's, on CUDA): elements compare by a 32-bit key that orders floats as numbers with
// -0 below +0 and every NaN above +inf (the float bits with the sign bit flipped for positives,
// all bits flipped for negatives; 16-bit types use the upper half). largest=False flips every
// key, NaN included, except that a NaN stays the worst for it too (~max = 0: taken last, as torch
// does). Equal keys go to the smaller index: the selected set of a tie at the k-th value is its
// lowest indices, and sorted output lists equal values by index.
//
// A row is x[a * sa + r * sr + b * sb], r < R; values and indices are written to [A, k, B]
// (contiguous). Candidates are [rows, n] (contiguous) with rows in the order a * B + b, so a
// launch reading candidates still takes B (to place its outputs) and ignores sa, sb, sr.
//
//   topk_warp<T, E>  rows of up to 32 * E (<= 256) elements and k <= 32 (mixture-of-experts
//       routing): a warp per row, E keys per lane in registers; k rounds of a warp-wide arg-max
//       (REDUX on sm_80+, shuffles before), the winner's lane retiring it. Output is sorted.
//   topk_block<T, FROM_CAND, TO_CAND>  a block of 512 threads selects the k best of a chunk of up
//       to C <= 32768 elements (or candidates) held as keys in shared memory: radix select of
//       the k-th key, 8 bits per pass over shared memory (2 passes for 16-bit types, 4 for
//       fp32, stopping early once the k-th key's bin is wholly taken), then an ordered
//       compaction (each thread owns EPT consecutive positions, as a bit mask; two block scans)
//       that writes the selected elements in position order: with chunks and candidates in index
//       order, position order is index order, so ties resolve to the lowest indices at every
//       level. Long rows: each chunk writes its k best as candidates (keys + int32 indices), and
//       a second (or third) launch selects among the candidates. The last launch writes values
//       and int64 indices, sorted by a bitonic sort of the k survivors (k <= 1024) when asked.
#include "common/dtypes.cuh"
#include "common/scan.cuh"

namespace gpuops {
namespace topk {

constexpr int kBlock = 512;
constexpr int kMaxK = 1024;
constexpr int kMaxEpt = 64;                 // positions per thread: one 64-bit mask
constexpr unsigned kSentinelIdx = 0x7fffffffu;
constexpr int kLoadBatch = 8;               // global loads in flight per thread

// ---------------------------------------------------------------------------------------------
// Keys

template <class T> struct KeyOf;

template <> struct KeyOf<float> {
  static constexpr int kBits = 32;
  static __device__ __forceinline__ unsigned key(float v) {
    const unsigned u = __float_as_uint(v);
    if (v != v) return 0xffffffffu;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
  static __device__ __forceinline__ float value(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
  }
};

template <class T, unsigned kNanAbove>      // kNanAbove: |bits| above this are NaN
struct Key16 {
  static constexpr int kBits = 16;
  static __device__ __forceinline__ unsigned key(T v) {
    const unsigned u = v.bits;
    unsigned k;
    if ((u & 0x7fffu) > kNanAbove) k = 0xffffu;
    else k = (u & 0x8000u) ? (~u & 0xffffu) : (u | 0x8000u);
    return k << 16;
  }
  static __device__ __forceinline__ T value(unsigned key) {
    const unsigned k = key >> 16;
    T t;
    t.bits = static_cast<unsigned short>((k & 0x8000u) ? (k & 0x7fffu) : (~k & 0xffffu));
    return t;
  }
};
template <> struct KeyOf<bfloat16_t> : Key16<bfloat16_t, 0x7f80u> {};
template <> struct KeyOf<float16_t> : Key16<float16_t, 0x7c00u> {};

// The key in "larger is better" space for this call.
template <class T>
__device__ __forceinline__ unsigned select_key(T v, int largest) {
  const unsigned k = KeyOf<T>::key(v);
  if (largest) return k;
  return KeyOf<T>::kBits == 32 ? ~k : (~k & 0xffff0000u);
}

template <class T>
__device__ __forceinline__ T key_value(unsigned k, int largest) {
  if (!largest) k = KeyOf<T>::kBits == 32 ? ~k : (~k & 0xffff0000u);
  return KeyOf<T>::value(k);
}

// ---------------------------------------------------------------------------------------------
// Warp per row

__device__ __forceinline__ unsigned warp_max_u32(unsigned v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_max_sync(kFullMask, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned u = __shfl_xor_sync(kFullMask, v, o);
    v = u > v ? u : v;
  }
  return v;
#endif
}

__device__ __forceinline__ unsigned warp_min_u32(unsigned v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_min_sync(kFullMask, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned u = __shfl_xor_sync(kFullMask, v, o);
    v = u < v ? u : v;
  }
  return v;
#endif
}

template <class T, int E>
__global__ void __launch_bounds__(256, 4)
topk_warp(const T* __restrict__ x, T* __restrict__ vals, long long* __restrict__ idx,
          long long rows, int R, int k, long long B, long long sa, long long sb, long long sr,
          int largest) {
  const int lane = threadIdx.x & 31;
  const long long row = static_cast<long long>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (row >= rows) return;                  // whole warps
  long long a = row, b = 0;
  if (B > 1) {                              // rows < 2^32 (host)
    a = static_cast<unsigned>(row) / static_cast<unsigned>(B);
    b = row - a * B;
  }
  const T* px = x + a * sa + b * sb;
  unsigned key[E];
  unsigned alive = 0;                       // bit e: element e * 32 + lane is still a candidate
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int r = e * 32 + lane;
    key[e] = 0;
    if (r < R) {
      key[e] = select_key(px[r * sr], largest);
      alive |= 1u << e;
    }
  }
  unsigned my_key = 0, my_idx = 0;          // lane j keeps the j-th result
  for (int j = 0; j < k; ++j) {
    unsigned best = 0, best_e = 0xffffffffu;   // this lane's best: highest key, lowest index
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if (((alive >> e) & 1u) && (best_e == 0xffffffffu || key[e] > best)) {
        best = key[e];
        best_e = e;
      }
    }
    const unsigned top = warp_max_u32(best_e == 0xffffffffu ? 0u : best);
    const unsigned mine = (best_e != 0xffffffffu && best == top) ? best_e * 32 + lane : 0xffffffffu;
    const unsigned win = warp_min_u32(mine);       // lowest index among the best keys
    if ((win & 31u) == static_cast<unsigned>(lane)) alive &= ~(1u << (win >> 5));
    if (lane == j) {
      my_key = top;
      my_idx = win;
    }
  }
  if (lane < k) {
    const long long o = (a * k + lane) * B + b;
    vals[o] = key_value<T>(my_key, largest);
    idx[o] = my_idx;
  }
}

// ---------------------------------------------------------------------------------------------
// Block per chunk

// Adds 1 to hist[digit] for each lane with `valid`. Called by whole warps. Real keys cluster
// (logits: a few exponents), so lanes of a warp often share a digit: on sm_70+ the lanes of one
// digit add their count once (same-address shared atomics serialize).
__device__ __forceinline__ void hist_add(int* hist, unsigned digit, bool valid) {
#if __CUDA_ARCH__ >= 700
  const unsigned peers = __match_any_sync(kFullMask, valid ? digit : 0x100u + lane_id());
  if (valid && lane_id() == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
#else
  if (valid) atomicAdd(&hist[digit], 1);
#endif
}

template <class T, bool FROM_CAND, bool TO_CAND>
__global__ void __launch_bounds__(kBlock, 1)
topk_block(const T* __restrict__ x, const unsigned* __restrict__ cand_key,
           const int* __restrict__ cand_idx, unsigned* __restrict__ out_key,
           int* __restrict__ out_idx, T* __restrict__ vals, long long* __restrict__ idx,
           long long R, long long B, long long sa, long long sb, long long sr, int chunk,
           int chunks, int k, int kc, int ept, int largest, int sorted) {
  extern __shared__ unsigned keys[];                     // ept * kBlock keys
  __shared__ int hist[256];
  __shared__ int scratch[32];
  __shared__ unsigned long long sel[TO_CAND ? 1 : kMaxK];   // composite keys for the sort
  __shared__ int s_bin, s_above, s_count;

  const int tid = threadIdx.x;
  // blockIdx.x = row * chunks + c (fewer than 2^31 blocks: 32-bit division)
  const long long row = blockIdx.x / static_cast<unsigned>(chunks);
  const long long c = blockIdx.x - row * chunks;
  const long long start = c * chunk;
  const int len = static_cast<int>((start + chunk < R ? start + chunk : R) - start);
  long long a = row, b = 0;
  if (B > 1) {                                            // rows < 2^32 (host)
    a = static_cast<unsigned>(row) / static_cast<unsigned>(B);
    b = row - a * B;
  }
  const int want = TO_CAND ? kc : k;
  const int nsel = want < len ? want : len;              // final launches always have len >= k

  for (int i = tid; i < 256; i += kBlock) hist[i] = 0;
  __syncthreads();
  // Load the chunk's keys (kLoadBatch loads in flight per thread before any is used) and count
  // the first digit on the way.
  {
    const unsigned* src = FROM_CAND ? cand_key + row * R + start : nullptr;
    const T* px = FROM_CAND ? nullptr : x + a * sa + b * sb + start * sr;
    const int lane = lane_id();
    for (int w0 = tid - lane; w0 < len; w0 += kBlock * kLoadBatch) {   // warp-uniform trip count
      unsigned kk[kLoadBatch];
#pragma unroll
      for (int u = 0; u < kLoadBatch; ++u) {
        const int i = w0 + u * kBlock + lane;
        kk[u] = 0u;
        if (i < len) {
          if constexpr (FROM_CAND) kk[u] = src[i];
          else kk[u] = select_key(px[i * sr], largest);
        }
      }
#pragma unroll
      for (int u = 0; u < kLoadBatch; ++u) {
        const int i = w0 + u * kBlock + lane;
        if (i < len) keys[i] = kk[u];
        hist_add(hist, kk[u] >> 24, i < len);
      }
    }
  }
  __syncthreads();

  // Radix select of the nsel-th key: prefix/mask grow 8 bits per pass.
  unsigned prefix = 0, mask = 0;
  int krem = nsel;
  constexpr int kLowest = KeyOf<T>::kBits == 32 ? 0 : 16;
  for (int shift = 24; shift >= kLowest; shift -= 8) {
    if (shift != 24) {
      for (int i = tid; i < 256; i += kBlock) hist[i] = 0;
      __syncthreads();
      for (int w0 = tid - lane_id(); w0 < len; w0 += kBlock) {            // warp-uniform
        const int i = w0 + lane_id();
        const unsigned kk = i < len ? keys[i] : 0u;
        hist_add(hist, (kk >> shift) & 255u, i < len && (kk & mask) == prefix);
      }
      __syncthreads();
    }
    // Bins from the top: thread t looks at bin 255 - t, with the count of all bins above it.
    const int count = tid < 256 ? hist[255 - tid] : 0;
    int total;
    const int above = block_exclusive_scan<SumOp>(count, scratch, 0, total);
    if (tid < 256 && above < krem && krem <= above + count) {
      s_bin = 255 - tid;
      s_above = above;
      s_count = count;
    }
    __syncthreads();
    prefix |= static_cast<unsigned>(s_bin) << shift;
    mask |= 255u << shift;
    krem -= s_above;
    const bool whole = s_count == krem;          // the bin is taken entirely: stop splitting it
    __syncthreads();                             // s_* are rewritten by the next pass
    if (whole) break;
  }

  // Ordered compaction: thread t owns positions [t * ept, t * ept + ept). Reads rotate so that a
  // warp's lanes hit distinct banks.
  const int first = tid * ept;
  unsigned long long gt = 0, eq = 0;
  {
    const int group = ept < 32 ? 32 / ept : 1;
    int r = (tid / group) % ept;
    for (int jj = 0; jj < ept; ++jj) {
      const int pos = first + r;
      if (pos < len) {
        const unsigned top = keys[pos] & mask;
        if (top > prefix) gt |= 1ull << r;
        else if (top == prefix) eq |= 1ull << r;
      }
      if (++r == ept) r = 0;
    }
  }
  int total;
  const int eq_before = block_exclusive_scan<SumOp>(__popcll(eq), scratch, 0, total);
  int take = krem - eq_before;
  take = take < 0 ? 0 : take;
  unsigned long long keep = eq;
  for (int n = __popcll(eq); n > take; --n) keep &= ~(1ull << (63 - __clzll(keep)));   // drop the last
  const unsigned long long chosen = gt | keep;
  const int slot0 = block_exclusive_scan<SumOp>(__popcll(chosen), scratch, 0, total);

  const long long out_row = (a * k) * B + b;              // final: [A, k, B]
  int slot = slot0;
  for (unsigned long long m = chosen; m; m &= m - 1, ++slot) {
    const int pos = first + (__ffsll(m) - 1);
    const unsigned kk = keys[pos];
    const long long where = start + pos;
    const unsigned index = FROM_CAND ? static_cast<unsigned>(cand_idx[row * R + where])
                                     : static_cast<unsigned>(where);
    if constexpr (TO_CAND) {
      const long long o = (row * chunks + c) * kc + slot;
      out_key[o] = kk;
      out_idx[o] = static_cast<int>(index);
    } else if (sorted) {
      sel[slot] = (static_cast<unsigned long long>(kk) << 32) | (0xffffffffu - index);
    } else {
      vals[out_row + slot * B] = key_value<T>(kk, largest);
      idx[out_row + slot * B] = index;
    }
  }
  if constexpr (TO_CAND) {
    // A chunk shorter than kc (only a row's last) pads with candidates that lose to everything.
    for (int s = nsel + tid; s < kc; s += kBlock) {
      const long long o = (row * chunks + c) * kc + s;
      out_key[o] = 0u;
      out_idx[o] = static_cast<int>(kSentinelIdx);
    }
  } else if (sorted) {
    int n2 = 1;
    while (n2 < k) n2 <<= 1;
    for (int s = k + tid; s < n2; s += kBlock) sel[s] = 0ull;      // below every real entry
    __syncthreads();
    // Bitonic sort, descending.
    for (int size = 2; size <= n2; size <<= 1) {
      for (int stride = size >> 1; stride > 0; stride >>= 1) {
        for (int t = tid; t < (n2 >> 1); t += kBlock) {
          const int i = 2 * t - (t & (stride - 1));
          const int j = i + stride;
          const unsigned long long u = sel[i], v = sel[j];
          const bool descending = (i & size) == 0;
          if (descending ? (u < v) : (u > v)) {
            sel[i] = v;
            sel[j] = u;
          }
        }
        __syncthreads();
      }
    }
    for (int s = tid; s < k; s += kBlock) {
      const unsigned long long comp = sel[s];
      vals[out_row + s * B] = key_value<T>(static_cast<unsigned>(comp >> 32), largest);
      idx[out_row + s * B] = 0xffffffffu - static_cast<unsigned>(comp);
    }
  }
}

}  // namespace topk
}  // namespace gpuops
