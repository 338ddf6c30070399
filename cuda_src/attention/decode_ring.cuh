// The consumer side of the ring decode kernels, written once: decode_split_tma.cu (the ring
// filled by TMA from a producer warp, sm_90) and decode_split_async.cu (filled by cp.async from
// the consumer warps themselves, sm_80+). Both keep decode_split.cu's contract: one block per kv
// head, chunk of keys and up to kDrRows q rows; every split writes its normalised partial output
// and natural log-sum-exp to the fp32 workspace that decode_combine.cu merges.
//
// A stage of the ring holds kDrKeys keys of K and of V, each tensor as D / 64 column blocks of
// kDrKeys rows x 128 bytes in TMA's 128-byte swizzle: 16-byte chunk c of key row r at
// (c ^ r % 8) * 16 within its row, so ldmatrix reads every 8 rows from 8 distinct bank groups.
// Consumer warp w takes keys 16 w .. 16 w + 15 of each stage on the tensor cores (mma.m16n8k16,
// fp32 accumulate; the 16 rows of the mma are the block's q rows, zero past them): S = Q K^T from
// ldmatrix of K, the online softmax in the log2 domain on S's fragments, then P V with P reused
// from S's registers as the A fragment (as two parts in the storage type, so that P is not
// rounded to it) and V read by ldmatrix.trans. At the end the warps' (m, l, o) meet in shared
// memory (the ring, free by then) and the block writes its partial.
#pragma once
#include "attention/decode_common.cuh"
#include "common/mma.cuh"

namespace gpuops {

constexpr int kDrWarps = 4;    // consumer warps
constexpr int kDrKeys = 64;    // keys per stage (TMA_KEYS / RING_KEYS on the host)
constexpr int kDrRows = 16;    // q rows per block (the mma's M)

// One tensor's part of a stage: D / 64 column blocks of kDrKeys rows x 128 bytes, swizzled.
template <int D>
struct DecodeRingTile {
  static constexpr int kBoxBytes = kDrKeys * 128;          // one column block (a TMA box)
  static constexpr int kBoxes = D / 64;
  static constexpr int kBytes = kBoxes * kBoxBytes;        // K (or V) of one stage
  // byte offset of 16-byte chunk c (of D / 8) of key row r
  static __device__ __forceinline__ unsigned int at(int r, int c) {
    return (c >> 3) * kBoxBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4);
  }
};

// A ring kernel's block: (batch, kv head, row chunk) from blockIdx.x, its split from blockIdx.y
// (the host's grid: (B x Hkv x row chunks, splits)).
struct DecodeRingBlock {
  int b, kvh, rchunk, split;
  __device__ __forceinline__ DecodeRingBlock(int row_chunks, int hkv)
      : b(static_cast<int>(blockIdx.x / (static_cast<unsigned>(row_chunks) * hkv))),
        kvh(static_cast<int>((blockIdx.x / row_chunks) % hkv)),
        rchunk(static_cast<int>(blockIdx.x % row_chunks)),
        split(static_cast<int>(blockIdx.y)) {}

  // The keys of this split that some row of the sequence can see, [start, end), from the
  // sequence's length `len` (clamped to [0, s_max] here, in place) and the window.
  __device__ __forceinline__ void keys(int& len, int s_max, int sq, int win_left, int chunk,
                                       int& start, int& end) const {
    len = len < 0 ? 0 : (len > s_max ? s_max : len);
    int kmin = win_left >= 0 ? len - sq - win_left : 0;
    if (kmin < 0) kmin = 0;
    start = split * chunk;
    end = start + chunk;
    if (start < kmin) start = kmin;
    if (end > len) end = len;
  }
};

// The low / high element of a register of two T (pack_b16x2's layout), as fp32.
template <class T>
__device__ __forceinline__ float unpack_lo(unsigned int r) {
  T x;
  x.bits = static_cast<unsigned short>(r & 0xffffu);
  return to_float(x);
}

template <class T>
__device__ __forceinline__ float unpack_hi(unsigned int r) {
  T x;
  x.bits = static_cast<unsigned short>(r >> 16);
  return to_float(x);
}

// One consumer warp's state and work. Rows of the block: row r = rchunk * kDrRows + (g or g + 8)
// -> q head kvh * group + r / sq, query token r % sq (decode_split's numbering).
template <class T, int D>
struct DecodeRingWarp {
  using Tile = DecodeRingTile<D>;
  static constexpr int kChunks = D / 8;                    // 16-byte chunks per row
  unsigned int qa[D / 16][4];                              // Q as the A fragments of D / 16 k-steps
  float m[2], l[2], o[D / 8][4];
  int row_pos[2], row_lo[2];                               // rows g, g + 8: last / first key seen

  __device__ __forceinline__ void start(const T* __restrict__ q, long long q_sb, long long q_ss,
                                        long long q_sh, long long q_sd, int b, int kvh,
                                        int rchunk, int rows, int sq, int hq, int hkv, int len,
                                        int win_left, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const int group = hq / hkv;
    const T* qrow[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rr = rchunk * kDrRows + g + 8 * h;
      const bool valid = rr < rows;
      const int gq = valid ? rr / sq : 0, i = valid ? rr - gq * sq : 0;
      qrow[h] = valid ? q + b * q_sb + i * q_ss + (kvh * group + gq) * q_sh : nullptr;
      row_pos[h] = valid ? len - sq + i : -1;             // an invalid row sees no key
      row_lo[h] = win_left >= 0 ? row_pos[h] - win_left : 0;
      if (row_lo[h] < 0) row_lo[h] = 0;
    }
    // qa[ks] = Q[g][16 ks + 2t, +1], Q[g + 8][...], Q[g][16 ks + 8 + 2t, +1], Q[g + 8][...]
    // (zeros for rows past the block's)
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const T* qr = qrow[f & 1];
        const int d = 16 * ks + 2 * t + 8 * (f >> 1);
        const unsigned int lo = qr ? qr[d * q_sd].bits : 0u;
        const unsigned int hi = qr ? qr[(d + 1) * q_sd].bits : 0u;
        qa[ks][f] = lo | (hi << 16);
      }
    const float kNegInf = -__int_as_float(0x7f800000);
    m[0] = m[1] = kNegInf;
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[n][c] = 0.f;
  }

  // V rows krow + r of the slot whose key j0 + r is at or past len, to zeros (the cache may hold
  // NaN there and 0 x NaN would be NaN); for a ring whose loads do not zero-fill them.
  static __device__ __forceinline__ void zero_v_past(unsigned int vslot, int krow, int j0,
                                                     int len, int lane) {
    for (int e = lane; e < 16 * Tile::kBoxes * 8; e += 32) {
      const int r = e / (Tile::kBoxes * 8), c = e % (Tile::kBoxes * 8);
      if (j0 + r >= len) {
        const unsigned int a = vslot + Tile::at(krow + r, c);
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" :: "r"(a), "r"(0u) : "memory");
      }
    }
    __syncwarp();
  }

  // Keys krow .. krow + 15 of a stage (key j0 + r at row krow + r of the slot's K and V); keys
  // outside [start, end) and outside a row's [row_lo, row_pos] are masked.
  __device__ __forceinline__ void stage(unsigned int kslot, unsigned int vslot, int krow, int j0,
                                        int start, int end, float scale_log2, int lane) {
    const int t = lane & 3;
    const float kNegInf = -__int_as_float(0x7f800000);
    // S = Q K^T for keys krow .. krow + 15 (n-tiles of 8 keys)
    float sc[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) sc[nt][c] = 0.f;
      const int r = krow + 8 * nt + (lane & 7);
#pragma unroll
      for (int c4 = 0; c4 < kChunks / 4; ++c4) {
        const int c = 4 * c4 + (lane >> 3);
        unsigned int kf[4];
        ldmatrix_x4(kf, kslot + Tile::at(r, c));
        Mma<T>::run(sc[nt], qa[2 * c4], kf[0], kf[1]);
        Mma<T>::run(sc[nt], qa[2 * c4 + 1], kf[2], kf[3]);
      }
    }
    // online softmax on the fragments: c0, c1 row g, c2, c3 row g + 8; key j0 + 8 nt + 2t (+1)
    float p[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m[h];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = j0 + 8 * nt + 2 * t + e;
          float v = sc[nt][2 * h + e] * scale_log2;
          if (j >= end || j < start || j < row_lo[h] || j > row_pos[h]) v = kNegInf;
          sc[nt][2 * h + e] = v;
          mx = fmaxf(mx, v);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float bm = mx == kNegInf ? 0.f : mx;           // nothing visible yet: keep the state
      const float corr = exp2f(m[h] - bm);
      float psum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = exp2f(sc[nt][2 * h + e] - bm);
          p[nt][2 * h + e] = pv;
          psum += pv;
        }
      l[h] = l[h] * corr + psum;                           // this thread's columns only
      m[h] = mx;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][2 * h] *= corr;
        o[n][2 * h + 1] *= corr;
      }
    }
    // P as the A fragments of k = the warp's 16 keys, in two parts: hi = P rounded to T and
    // lo = (P - hi) rounded to T, so that P V carries P to ~2^-16 (bf16) instead of the 2^-9 of
    // FlashAttention's single rounding; the tensor cores have time to spare here (the kernel
    // waits on memory), and the results keep the register kernel's accuracy.
    unsigned int pa[4], pl[4];
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      const float x0 = p[f >> 1][2 * (f & 1)], x1 = p[f >> 1][2 * (f & 1) + 1];
      pa[f] = pack_b16x2<T>(x0, x1);
      pl[f] = pack_b16x2<T>(x0 - unpack_lo<T>(pa[f]), x1 - unpack_hi<T>(pa[f]));
    }
    // O += P V: ldmatrix.trans of V (matrices: keys 0-7 / 8-15 of chunk 2 dp, then of 2 dp + 1)
    const int r = krow + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int dp = 0; dp < kChunks / 2; ++dp) {
      const int c = 2 * dp + (lane >> 4);
      unsigned int vf[4];
      ldmatrix_x4_trans(vf, vslot + Tile::at(r, c));
      Mma<T>::run(o[2 * dp], pa, vf[0], vf[1]);
      Mma<T>::run(o[2 * dp], pl, vf[0], vf[1]);
      Mma<T>::run(o[2 * dp + 1], pa, vf[2], vf[3]);
      Mma<T>::run(o[2 * dp + 1], pl, vf[2], vf[3]);
    }
  }

  // The block's partial: l over the 4 threads of a row, the kDrWarps warps' (m, l, o) merged
  // through shared memory at `scratch` (>= kDrWarps * kDrRows * (D + 2) floats, free: the ring
  // after its last stage), written to slot (row, split) of the workspace; or, where the host
  // passes `out` (one split: no combine launch), as the final output [B, Sq, Hq, D] in T and the
  // log-sum-exp [B, Hq, Sq] (lse_out, if not null): what decode_combine makes of one split, bit
  // for bit (weight exp(0) = 1). Sync::run() is a barrier of the kDrWarps consumer warps.
  template <class Sync>
  __device__ __forceinline__ void write_partial(unsigned char* scratch, float* __restrict__ ws_o,
                                                float* __restrict__ ws_lse, T* __restrict__ out,
                                                float* __restrict__ lse_out, int b, int kvh,
                                                int rchunk, int rows, int sq, int hq, int hkv,
                                                int split, int nsplit, int warp, int lane,
                                                int tid) {
    const int g = lane >> 2, t = lane & 3;
    const float kNegInf = -__int_as_float(0x7f800000);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    Sync::run();
    float* sm_m = reinterpret_cast<float*>(scratch);       // [warp][16]
    float* sm_l = sm_m + kDrWarps * kDrRows;               // [warp][16]
    float* sm_o = sm_l + kDrWarps * kDrRows;               // [warp][16][D]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = g + 8 * h;
      if (t == 0) {
        sm_m[warp * kDrRows + r] = m[h];
        sm_l[warp * kDrRows + r] = l[h];
      }
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        float* dst = sm_o + (warp * kDrRows + r) * D + 8 * n + 2 * t;
        dst[0] = o[n][2 * h];
        dst[1] = o[n][2 * h + 1];
      }
    }
    Sync::run();
    const int group = hq / hkv;
    const long long row_base = (static_cast<long long>(b) * hq + kvh * group) * sq;
    for (int e = tid; e < kDrRows * D; e += kDrWarps * 32) {
      const int r = e / D, d = e - r * D;
      const int rr = rchunk * kDrRows + r;
      if (rr >= rows) continue;
      float mx = sm_m[r];
#pragma unroll
      for (int w = 1; w < kDrWarps; ++w) mx = fmaxf(mx, sm_m[w * kDrRows + r]);
      const float bm = mx == kNegInf ? 0.f : mx;
      float lsum = 0.f, osum = 0.f;
#pragma unroll
      for (int w = 0; w < kDrWarps; ++w) {
        const float a = exp2f(sm_m[w * kDrRows + r] - bm);
        lsum += sm_l[w * kDrRows + r] * a;
        osum += sm_o[(w * kDrRows + r) * D + d] * a;
      }
      const float val = lsum > 0.f ? osum / lsum : 0.f;
      const float lse = lsum > 0.f ? (mx + log2f(lsum)) * 0.6931471805599453f : kNegInf;
      if (out != nullptr) {
        const int gq = rr / sq, i = rr - gq * sq;
        const long long bh = static_cast<long long>(b) * hq + kvh * group + gq;
        out[((static_cast<long long>(b) * sq + i) * hq + kvh * group + gq) * D + d] =
            from_float<T>(val);
        if (d == 0 && lse_out != nullptr) lse_out[bh * sq + i] = lse;
      } else {
        const long long slot = (row_base + rr) * nsplit + split;
        ws_o[slot * D + d] = val;
        if (d == 0) ws_lse[slot] = lse;
      }
    }
  }
};

}  // namespace gpuops
