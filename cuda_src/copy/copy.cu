// Strided-to-contiguous copies: the kernels of gpuops.contiguous and gpuops.transpose (host side:
// gpuops/ops/copy.py). Elements are moved as raw bytes (E = 1, 2, 4 or 8 bytes), so every dtype
// of that size shares a kernel. The output is always contiguous; the host merges the dimensions
// that both sides walk contiguously first, then picks one of:
//  * copy_rows: the innermost dimension stays innermost (a strided view of whole rows, e.g.
//    attention's [B, S, H, D] -> [B, H, S, D]): one 16-byte pack per thread, read and written
//    directly, the row's outer coordinates from fast dividers. No shared memory.
//  * copy_transpose: the input's contiguous dimension u is not the output's innermost v: a tile
//    of (P * VEC) x (P * VEC) elements goes through shared memory. Global loads read 16-byte packs
//    along u, global stores write 16-byte packs along v; shared memory holds the tile as 16-byte
//    chunks whose position in a row is XOR-swizzled by the row's pack index, so that both the
//    16-byte chunk stores and the element gathers of the transposed reads are free of bank
//    conflicts (see tests/test_copy.py, which replays both access patterns on a bank model).
//  * copy_transpose_scalar: the same with one element per access and a padded 32 x 33 tile, for
//    extents or strides that do not allow 16-byte packs.
//  * copy_strided: anything else (more than 4 outer dimensions, more than 2^31 elements): one
//    element per thread, 64-bit offsets.
#include "common/fastdiv.cuh"
#include "common/strided.cuh"

namespace gpuops {

template <int E> struct RawElem;
template <> struct RawElem<1> { using type = unsigned char; };
template <> struct RawElem<2> { using type = unsigned short; };
template <> struct RawElem<4> { using type = unsigned int; };
template <> struct RawElem<8> { using type = unsigned long long; };

// VEC = 16 / E raw elements as one 16-byte word, first element in the lowest bytes (the order a
// 16-byte load gives them).
template <int E>
__device__ __forceinline__ uint4 pack16(const typename RawElem<E>::type (&e)[16 / E]) {
  unsigned int w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (E == 8) {
      const unsigned long long v = e[i / 2];
      w[i] = static_cast<unsigned int>(i % 2 ? v >> 32 : v);
    } else {
      constexpr int PER = 4 / E;      // elements per 32-bit word
      unsigned int x = 0;
#pragma unroll
      for (int j = 0; j < PER; ++j) x |= static_cast<unsigned int>(e[i * PER + j]) << (8 * E * j);
      w[i] = x;
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

constexpr int kCopyThreads = 256;
constexpr int kCopyDims = 4;

// Outer (or batch) dimensions of a copy, innermost last, with the input's and the output's
// strides in elements. Passed by value.
struct CopyOuter {
  int ndim;
  FastDiv size[kCopyDims];
  long long in_stride[kCopyDims];
  long long out_stride[kCopyDims];
};

// Offsets of outer index `i` (< 2^31) in the input and the output.
__device__ __forceinline__ void outer_offsets(const CopyOuter& o, unsigned int i, long long& in_off,
                                              long long& out_off) {
  in_off = 0;
  out_off = 0;
#pragma unroll
  for (int d = kCopyDims - 1; d >= 0; --d) {
    if (d < o.ndim) {
      unsigned int idx;
      i = o.size[d].divmod(i, idx);
      in_off += static_cast<long long>(idx) * o.in_stride[d];
      out_off += static_cast<long long>(idx) * o.out_stride[d];
    }
  }
}

// Unit q (VEC elements) of the contiguous output: row q / units_per_row, column q % units_per_row.
// in_stride_inner is 1 when VEC > 1.
template <int E, int VEC>
__global__ void __launch_bounds__(kCopyThreads) copy_rows(
    const void* __restrict__ in, void* __restrict__ out, FastDiv units_per_row, CopyOuter outer,
    long long in_stride_inner, unsigned int total_units) {
  using R = typename RawElem<E>::type;
  const unsigned int q = blockIdx.x * kCopyThreads + threadIdx.x;
  if (q >= total_units) return;
  unsigned int col;
  const unsigned int row = units_per_row.divmod(q, col);
  long long in_off, out_off;
  outer_offsets(outer, row, in_off, out_off);
  in_off += static_cast<long long>(col) * VEC * in_stride_inner;
  if constexpr (VEC * E == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const R*>(in) + in_off);
    *reinterpret_cast<uint4*>(static_cast<R*>(out) + static_cast<long long>(q) * VEC) = v;
  } else {
    static_assert(VEC == 1, "a unit is one element or one 16-byte pack");
    static_cast<R*>(out)[q] = static_cast<const R*>(in)[in_off];
  }
}

// Tile transpose with 16-byte packs (VEC = 16 / E). The tile covers TU = P * VEC elements along u
// (the input's contiguous dimension) and TV = P * VEC along v (the output's contiguous one).
// Shared memory: TV rows of P 16-byte chunks; chunk k of row r is stored at position
// k ^ ((r / VEC) & 7) (P is a multiple of 8, so this permutes within aligned groups of 8 chunks).
//  * loads: unit q -> row v = q / P, chunk q % P: a quarter warp stores 8 chunks of one row, which
//    the XOR keeps in 8 distinct bank quads;
//  * stores: a warp writes VEC output rows u times 32 / VEC packs along v; the element (r, u) it
//    gathers sits in bank quad ((u / VEC) ^ (r / VEC)) & 7 at word (u % VEC) * E / 4: the warp's
//    32 / VEC packs have distinct r / VEC, so its words spread over all banks.
template <int E, int VEC, int P>
__global__ void __launch_bounds__(kCopyThreads) copy_transpose(
    const void* __restrict__ in, void* __restrict__ out, int ext_u, int ext_v,
    long long in_stride_v, long long out_stride_u, FastDiv tiles_u, FastDiv tiles_per_plane,
    CopyOuter batch) {
  static_assert(VEC * E == 16 && P % 8 == 0, "16-byte packs, P a multiple of 8");
  using R = typename RawElem<E>::type;
  constexpr int TU = P * VEC, TV = P * VEC;
  constexpr int ITER = P * TV / kCopyThreads;   // units per thread, each phase
  static_assert(ITER * kCopyThreads == P * TV, "whole tiles per block");
  __shared__ uint4 tile[TV * P];

  unsigned int tile_idx;
  const unsigned int plane = tiles_per_plane.divmod(blockIdx.x, tile_idx);
  unsigned int tu;
  const unsigned int tv = tiles_u.divmod(tile_idx, tu);
  long long in_base, out_base;
  outer_offsets(batch, plane, in_base, out_base);
  const int u0 = static_cast<int>(tu) * TU, v0 = static_cast<int>(tv) * TV;
  const R* src = static_cast<const R*>(in) + in_base + static_cast<long long>(v0) * in_stride_v + u0;
  R* dst = static_cast<R*>(out) + out_base + static_cast<long long>(u0) * out_stride_u + v0;
  const int nu = min(TU, ext_u - u0), nv = min(TV, ext_v - v0);   // multiples of VEC

  uint4 buf[ITER];
#pragma unroll
  for (int k = 0; k < ITER; ++k) {
    const int q = threadIdx.x + k * kCopyThreads;
    const int v = q / P, c = q % P;
    if (v < nv && c * VEC < nu)
      buf[k] = *reinterpret_cast<const uint4*>(src + static_cast<long long>(v) * in_stride_v + c * VEC);
  }
#pragma unroll
  for (int k = 0; k < ITER; ++k) {
    const int q = threadIdx.x + k * kCopyThreads;
    const int v = q / P, c = q % P;
    if (v < nv && c * VEC < nu) tile[v * P + (c ^ ((v / VEC) & 7))] = buf[k];
  }
  __syncthreads();

  const R* t = reinterpret_cast<const R*>(tile);
  constexpr int VPW = 32 / VEC;        // packs along v per warp and output row
  constexpr int VBLOCKS = P / VPW;     // warps side by side along an output row
#pragma unroll
  for (int k = 0; k < ITER; ++k) {
    const int q = threadIdx.x + k * kCopyThreads;
    const int wq = q >> 5, lane = q & 31;
    const int u = (wq / VBLOCKS) * VEC + lane % VEC;
    const int vp = (wq % VBLOCKS) * VPW + lane / VEC;
    if (u < nu && vp * VEC < nv) {
      R e[VEC];
      const int chunk = u / VEC, in_chunk = u % VEC;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const int r = vp * VEC + j;      // r / VEC == vp
        e[j] = t[(r * P + (chunk ^ (vp & 7))) * VEC + in_chunk];
      }
      *reinterpret_cast<uint4*>(dst + static_cast<long long>(u) * out_stride_u + vp * VEC) =
          pack16<E>(e);
    }
  }
}

// Tile transpose one element at a time (any extents and strides): 32 x 32 elements through a
// tile padded to 33 columns. in_stride_u is the input's stride along u (usually 1).
template <int E>
__global__ void __launch_bounds__(kCopyThreads) copy_transpose_scalar(
    const void* __restrict__ in, void* __restrict__ out, int ext_u, int ext_v,
    long long in_stride_u, long long in_stride_v, long long out_stride_u, FastDiv tiles_u,
    FastDiv tiles_per_plane, CopyOuter batch) {
  using R = typename RawElem<E>::type;
  constexpr int T = 32, ITER = T * T / kCopyThreads;
  __shared__ R tile[T][T + 1];

  unsigned int tile_idx;
  const unsigned int plane = tiles_per_plane.divmod(blockIdx.x, tile_idx);
  unsigned int tu;
  const unsigned int tv = tiles_u.divmod(tile_idx, tu);
  long long in_base, out_base;
  outer_offsets(batch, plane, in_base, out_base);
  const int u0 = static_cast<int>(tu) * T, v0 = static_cast<int>(tv) * T;
  const R* src = static_cast<const R*>(in) + in_base + static_cast<long long>(v0) * in_stride_v +
                 static_cast<long long>(u0) * in_stride_u;
  R* dst = static_cast<R*>(out) + out_base + static_cast<long long>(u0) * out_stride_u + v0;
  const int nu = min(T, ext_u - u0), nv = min(T, ext_v - v0);

  R buf[ITER];
#pragma unroll
  for (int k = 0; k < ITER; ++k) {
    const int q = threadIdx.x + k * kCopyThreads;
    const int v = q / T, u = q % T;
    if (v < nv && u < nu)
      buf[k] = src[static_cast<long long>(v) * in_stride_v + static_cast<long long>(u) * in_stride_u];
  }
#pragma unroll
  for (int k = 0; k < ITER; ++k) {
    const int q = threadIdx.x + k * kCopyThreads;
    const int v = q / T, u = q % T;
    if (v < nv && u < nu) tile[v][u] = buf[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < ITER; ++k) {
    const int q = threadIdx.x + k * kCopyThreads;
    const int u = q / T, v = q % T;
    if (u < nu && v < nv) dst[static_cast<long long>(u) * out_stride_u + v] = tile[v][u];
  }
}

// Anything: element i of the contiguous output from the input's strides (operand 0 of L).
template <int E>
__global__ void __launch_bounds__(kCopyThreads) copy_strided(
    const void* __restrict__ in, void* __restrict__ out, StridedLayout L, long long n) {
  using R = typename RawElem<E>::type;
  const long long stride = static_cast<long long>(gridDim.x) * kCopyThreads;
  for (long long i = static_cast<long long>(blockIdx.x) * kCopyThreads + threadIdx.x; i < n;
       i += stride) {
    long long off[1];
    strided_offsets<1>(L, i, off);
    static_cast<R*>(out)[i] = static_cast<const R*>(in)[off[0]];
  }
}

}  // namespace gpuops
