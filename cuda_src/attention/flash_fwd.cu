// Flash attention forward, SIMT fp32 (runs on sm_61 and up; fp16/bf16/fp32 storage, fp32 math).
//
// FlashAttention-2's schedule without tensor cores: a block of 128 threads owns BR query rows of
// one (batch, head); it walks the keys in tiles of BC rows staged through shared memory, keeps a
// running row max m and sum l (online softmax in the log2 domain) and the BR x D output
// accumulator in registers, and never forms more than a BR x BC tile of scores. Memory is
// O(B * H * S * D): the S x S matrix is never written.
//
// Threads: tx = tid % 8 (column group), ty = tid / 8 (row group, 16 of them). A thread owns
// rows ty + 16 r (r < BR / 16), score columns tx + 8 c (c < BC / 8) and output columns
// 4 tx + 32 k .. + 3 (k < D / 32). The 8 threads of a row group are 8 consecutive lanes, so row
// maxima and sums are 3 shuffles. Shared rows are padded by 4 floats: the 8 lanes of a quarter
// warp then read 8 different K rows (or 8 consecutive 16-byte words of one V row) without bank
// conflicts.
//
// Per key tile: K -> shared; S = Q K^T (registers); scale, window / causal / mask -> -inf;
// online softmax (new max, rescale of l and O, P = exp2(S - m)) with P -> shared; V -> the same
// shared buffer; O += P V. A row that sees no key at all ends with l = 0 and gets output 0 and
// lse = -inf (torch's math backend also gives 0 there since 2.5).
//
// GENERAL = false: head dim == D (32, 64, 96, 128), Q loaded once. GENERAL = true: any head dim;
// D = 32 is a chunk width, Q K^T loops over the head dim in chunks (Q and K chunks through
// shared memory), and blockIdx.z picks the 32 output columns this block accumulates (the scores
// are recomputed per output chunk: correct for any head dim, not fast).
//
// Options carried by the appended FlashFwdArgs fields (each off when null / 0; none touches the
// Q K^T or P V loops):
// * varlen: blockIdx.x = (sequence, head); the sequence's rows come from cu_q / cu_k on the
//   device (the grid is sized by the longest), and a block past its sequence's end exits at once.
//   bottom_right puts row i's causal / window diagonal at key i + sk - sq.
// * block sparsity (SPARSE = true): before each key tile every thread reads the block_mask
//   entries the tile covers (one byte when block_size is a multiple of BR and BC); a tile whose
//   entries are all off is skipped (no loads, no math); in a tile that covers on and off blocks
//   each thread gathers one bit per score it owns (blocks_on) and masks with it.
// * rotary: q and k are rotated as they are loaded into shared memory (element c with its pair's
//   partner, cos / sin of the row's sequence index); v is not.
//
// Tensor-core variants (mma.sync for sm_80+, wgmma for sm_90a) are separate kernels selected by
// `variant=` in gpuops/ops/attention.py; this one is the SIMT variant.
#include "attention/attn_common.cuh"
#include "common/vec.cuh"

namespace gpuops {

constexpr int kFlashThreads = 128;

// rows [r0, r0 + ROWS) x columns [c0, c0 + D) of a [rows_total, cols_total] operand (strides rs,
// cs) -> shared [ROWS][D + 4] in fp32, zeros outside the operand. vec: 16-byte loads (the host
// guarantees c0 = 0, cols_total = D, cs = 1 and 16-byte aligned rows, and with rotary that a
// 16-byte pack and its partner pack line up). rotate: RoPE of row r0 + r at position r0 + r (the
// rows are sequence indices), its partner elements read from global memory (L1).
template <class T, int ROWS, int D>
__device__ __forceinline__ void flash_load_tile(float* dst, const T* src, int r0, int rows_total,
                                                long long rs, int c0, int cols_total,
                                                long long cs, bool vec,
                                                const FlashFwdArgs& a, bool rotate) {
  constexpr int kLd = D + 4;
  if (vec) {
    constexpr int N = Vec16<T>::size, kPer = D / N;   // values per 16 bytes, packs per row
    static_assert(D % N == 0, "packs per row");
    for (int idx = threadIdx.x; idx < ROWS * kPer; idx += kFlashThreads) {
      const int r = idx / kPer, c = (idx - (idx / kPer) * kPer) * N;
      const int gr = r0 + r;
      float f[N];
      if (gr < rows_total) {
        const T* row = src + gr * rs;
        Vec16<T>::unpack(load16(row + c), f);
        if (rotate && c < 2 * a.rot_half) {
          float g[N];                                   // the partners of f
          int f0, pc;
          float sign;
          attn_rope_pair(a, c, f0, pc, sign);
          if (a.rot_interleaved) {
#pragma unroll
            for (int e = 0; e < N; ++e) g[e] = f[e ^ 1];
          } else {
            Vec16<T>::unpack(load16(row + pc), g);
          }
#pragma unroll
          for (int e = 0; e < N; ++e) {
            const int fe = a.rot_interleaved ? f0 + (e >> 1) : f0 + e;
            const float se = a.rot_interleaved ? ((e & 1) ? 1.0f : -1.0f) : sign;
            float cv, sv;
            attn_rope_cs<T>(a, gr, fe, cv, sv);
            f[e] = fmaf(f[e], cv, se * (g[e] * sv));
          }
        }
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) f[e] = 0.0f;
      }
#pragma unroll
      for (int e = 0; e < N; e += 4)
        *reinterpret_cast<AttnF4*>(dst + r * kLd + c + e) =
            AttnF4{f[e], f[e + 1], f[e + 2], f[e + 3]};
    }
    return;
  }
  for (int idx = threadIdx.x; idx < ROWS * D; idx += kFlashThreads) {
    const int r = idx / D, c = idx - (idx / D) * D;
    const int gr = r0 + r, gc = c0 + c;
    float val = 0.0f;
    if (gr < rows_total && gc < cols_total) {
      const T* row = src + gr * rs;
      val = to_float(row[gc * cs]);
      if (rotate && gc < 2 * a.rot_half) {
        int f, pc;
        float sign, cv, sv;
        attn_rope_pair(a, gc, f, pc, sign);
        attn_rope_cs<T>(a, gr, f, cv, sv);
        val = fmaf(val, cv, sign * (to_float(row[pc * cs]) * sv));
      }
    }
    dst[r * kLd + c] = val;
  }
}

// Bit r * CN + c: is score (row i0 + 16 r, key j0 + 8 c) in a block that is on? Rows and keys
// past ilast / jlast (invisible anyway) read the last ones' entries, inside the mask. A rolled
// loop (few registers), run only for tiles that mix on and off blocks.
template <int RM, int CN>
__device__ __forceinline__ unsigned flash_blocks_on(const unsigned char* bm, long long sqb,
                                                   long long skb, int bs, int i0, int ilast,
                                                   int j0, int jlast) {
  static_assert(RM * CN <= 32, "one bit per score of the thread");
  unsigned bits = 0;
#pragma unroll 1
  for (int e = 0; e < RM * CN; ++e) {
    const int r = e / CN, c = e - (e / CN) * CN;
    const long long o = (attn_imin(i0 + 16 * r, ilast) / bs) * sqb +
                        (attn_imin(j0 + 8 * c, jlast) / bs) * skb;
    bits |= static_cast<unsigned>(bm[o] != 0) << e;
  }
  return bits;
}

// Blocks per SM the register allocation must allow: 3 for head dims up to 64 (their 64 x 64 tiles
// leave shared memory for 3-4 blocks on sm_70+; ptxas would otherwise take up to 224 registers
// and fit only 2), else 1 (ptxas may use up to 255 registers; shared memory allows 2 blocks).
// The block-sparse instantiations do not fit 168 registers without spills: 2 blocks for them.
template <int D, bool GENERAL, bool SPARSE>
struct FlashMinBlocks {
  static constexpr int value = (!GENERAL && !SPARSE && D <= 64) ? 3 : 1;
};

// SPARSE: block_mask is read (block-sparse attention); a separate instantiation (in its own
// kernel module) so that the dense kernels keep their registers and compile time.
template <class T, int D, int BR, int BC, bool GENERAL, bool SPARSE = false>
__global__ void __launch_bounds__(kFlashThreads, FlashMinBlocks<D, GENERAL, SPARSE>::value)
    flash_fwd(const FlashFwdArgs a) {
  constexpr int RM = BR / 16, CN = BC / 8, DK = D / 32;
  constexpr int kLd = D + 4, kLdp = BC + 4;
  static_assert(BR % 16 == 0 && BC % 8 == 0 && D % 32 == 0 && BC % 4 == 0, "tile shape");
  extern __shared__ AttnF4 flash_smem[];
  float* Qs = reinterpret_cast<float*>(flash_smem);   // [BR][D + 4]
  float* KVs = Qs + BR * kLd;                          // [BC][D + 4]: K, then V
  float* Ps = KVs + BC * kLd;                          // [BR][BC + 4]

  const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3;
  const int bh = blockIdx.x;
  const int b = bh / a.hq, h = bh - b * a.hq, hk = h / a.group;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * BR;   // the longest causal rows start first
  const int dv0 = GENERAL ? blockIdx.z * D : 0;       // first output column of this block

  // this block's sequence: dense, or rows [cu[b], cu[b + 1]) of the packed tensors (varlen)
  int sq = a.sq, sk = a.sk;
  long long qrow0 = 0, krow0 = 0;
  if (a.cu_q != nullptr) {
    const int qs0 = a.cu_q[b], ks0 = a.cu_k[b];
    sq = a.cu_q[b + 1] - qs0;
    sk = a.cu_k[b + 1] - ks0;
    qrow0 = qs0;
    krow0 = ks0;
  }
  if (q0 >= sq) return;   // past the end of its sequence (varlen): the whole block leaves
  const int diag = a.bottom_right ? sk - sq : 0;   // row i's diagonal is key i + diag

  const T* q = static_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1] + qrow0 * a.qs[2];
  const T* k = static_cast<const T*>(a.k) + b * a.ks[0] + hk * a.ks[1] + krow0 * a.ks[2];
  const T* v = static_cast<const T*>(a.v) + b * a.vs[0] + hk * a.vs[1] + krow0 * a.vs[2];
  const long long mbase = b * a.ms[0] + h * a.ms[1];
  const unsigned char* bm = SPARSE ? a.block_mask + b * a.bms[0] + h * a.bms[1] : nullptr;
  const bool rot = a.rot_half > 0;

  // keys any row of this block may see
  const int qlast = attn_imin(q0 + BR, sq) - 1;
  int jlo = 0, jhi = sk;
  if (a.left >= 0) jlo = attn_imax(0, q0 + diag - a.left);
  if (a.right >= 0) jhi = attn_imin(sk, qlast + diag + a.right + 1);

  float o[RM][DK][4];
  float m[RM], l[RM];
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    m[r] = attn_neg_inf();
    l[r] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) o[r][kk][0] = o[r][kk][1] = o[r][kk][2] = o[r][kk][3] = 0.0f;
  }

  if (!GENERAL) {
    flash_load_tile<T, BR, D>(Qs, q, q0, sq, a.qs[2], 0, a.hd, a.qs[3], a.vec != 0, a, rot);
  }

  for (int k0 = jlo; k0 < jhi; k0 += BC) {
    // block sparsity: bit r * CN + c of `blocks_on` says whether score (r, c) of this thread
    // lies in a block that is on (all ones unless the tile mixes on and off blocks)
    unsigned blocks_on = ~0u;
    if (SPARSE) {
      bool mixed;
      if (!attn_tile_on(bm, a.bms[2], a.bms[3], a.block_size, q0, qlast, k0,
                        attn_imin(k0 + BC, jhi), &mixed))
        continue;         // every block of the tile is off: no loads, no math
      if (mixed)
        blocks_on = flash_blocks_on<RM, CN>(bm, a.bms[2], a.bms[3], a.block_size, q0 + ty,
                                            qlast, k0 + tx, attn_imin(k0 + BC, jhi) - 1);
    }
    float s[RM][CN];
#pragma unroll
    for (int r = 0; r < RM; ++r)
#pragma unroll
      for (int c = 0; c < CN; ++c) s[r][c] = 0.0f;

    // S = Q K^T over the head dim (one chunk of D columns on the fast path)
    const int nchunks = GENERAL ? (a.hd + D - 1) / D : 1;
    for (int dc = 0; dc < nchunks; ++dc) {
      __syncthreads();   // the previous P V (or chunk) is done with KVs / Qs
      if (GENERAL)
        flash_load_tile<T, BR, D>(Qs, q, q0, sq, a.qs[2], dc * D, a.hd, a.qs[3], false, a,
                                  rot);
      flash_load_tile<T, BC, D>(KVs, k, k0, sk, a.ks[2], dc * D, a.hd, a.ks[3],
                                !GENERAL && a.vec != 0, a, rot);
      __syncthreads();
#pragma unroll 4
      for (int d = 0; d < D; d += 4) {
        AttnF4 qa[RM];
#pragma unroll
        for (int r = 0; r < RM; ++r)
          qa[r] = *reinterpret_cast<const AttnF4*>(Qs + (ty + 16 * r) * kLd + d);
#pragma unroll
        for (int c = 0; c < CN; ++c) {
          const AttnF4 kb = *reinterpret_cast<const AttnF4*>(KVs + (tx + 8 * c) * kLd + d);
#pragma unroll
          for (int r = 0; r < RM; ++r) {
            float acc = s[r][c];
            acc = fmaf(qa[r].x, kb.x, acc);
            acc = fmaf(qa[r].y, kb.y, acc);
            acc = fmaf(qa[r].z, kb.z, acc);
            acc = fmaf(qa[r].w, kb.w, acc);
            s[r][c] = acc;
          }
        }
      }
    }

    // scale, visibility, mask; online softmax; P -> shared
#pragma unroll
    for (int r = 0; r < RM; ++r) {
      const int row = ty + 16 * r, i = q0 + row;
      float tmax = attn_neg_inf();
#pragma unroll
      for (int c = 0; c < CN; ++c) {
        const int j = k0 + tx + 8 * c;
        bool keep = i < sq && j < sk && (a.left < 0 || j >= i + diag - a.left) &&
                    (a.right < 0 || j <= i + diag + a.right);
        if (SPARSE) keep = keep && ((blocks_on >> (r * CN + c)) & 1u);
        float x = s[r][c] * a.scale_log2;
        if (keep && a.mask_kind != 0) {
          const long long mo = mbase + i * a.ms[2] + j * a.ms[3];
          if (a.mask_kind == 1)
            keep = static_cast<const unsigned char*>(a.mask)[mo] != 0;
          else
            x = fmaf(to_float(static_cast<const T*>(a.mask)[mo]), kAttnLog2e, x);
        }
        x = keep ? x : attn_neg_inf();
        s[r][c] = x;
        tmax = attn_max(tmax, x);
      }
      tmax = attn_max(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
      tmax = attn_max(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
      tmax = attn_max(tmax, __shfl_xor_sync(0xffffffffu, tmax, 4));
      const float mnew = attn_max(m[r], tmax);
      // a row that has seen only -inf keeps m = -inf: subtract 0 instead (exp2(-inf) = 0)
      const float base = mnew == attn_neg_inf() ? 0.0f : mnew;
      const float alpha = attn_exp2(m[r] - base);
      m[r] = mnew;
      float psum = 0.0f;
#pragma unroll
      for (int c = 0; c < CN; ++c) {
        const float p = attn_exp2(s[r][c] - base);
        psum += p;
        Ps[row * kLdp + tx + 8 * c] = p;
      }
      l[r] = fmaf(l[r], alpha, psum);   // per-thread partial sum; the 8 lanes are added at the end
#pragma unroll
      for (int kk = 0; kk < DK; ++kk) {
        o[r][kk][0] *= alpha;
        o[r][kk][1] *= alpha;
        o[r][kk][2] *= alpha;
        o[r][kk][3] *= alpha;
      }
    }

    __syncthreads();   // everyone is done with K; P is complete
    flash_load_tile<T, BC, D>(KVs, v, k0, sk, a.vs[2], dv0, a.hd, a.vs[3],
                              !GENERAL && a.vec != 0, a, false);
    __syncthreads();

    // O += P V
#pragma unroll 2
    for (int j = 0; j < BC; j += 4) {
      AttnF4 p4[RM];
#pragma unroll
      for (int r = 0; r < RM; ++r)
        p4[r] = *reinterpret_cast<const AttnF4*>(Ps + (ty + 16 * r) * kLdp + j);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
          const AttnF4 vv =
              *reinterpret_cast<const AttnF4*>(KVs + (j + jj) * kLd + 4 * tx + 32 * kk);
#pragma unroll
          for (int r = 0; r < RM; ++r) {
            const float p = jj == 0 ? p4[r].x : jj == 1 ? p4[r].y : jj == 2 ? p4[r].z : p4[r].w;
            o[r][kk][0] = fmaf(p, vv.x, o[r][kk][0]);
            o[r][kk][1] = fmaf(p, vv.y, o[r][kk][1]);
            o[r][kk][2] = fmaf(p, vv.z, o[r][kk][2]);
            o[r][kk][3] = fmaf(p, vv.w, o[r][kk][3]);
          }
        }
      }
    }
  }

  // O / l; lse = (m + log2 l) ln 2; rows that saw no key: 0 and -inf
  T* out = static_cast<T*>(a.o) + b * a.os[0] + h * a.os[1] + qrow0 * a.os[2];
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    float lt = l[r];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    lt += __shfl_xor_sync(0xffffffffu, lt, 4);
    const int i = q0 + ty + 16 * r;
    if (i >= sq) continue;
    const float inv = lt == 0.0f ? 0.0f : 1.0f / lt;
    T* orow = out + i * a.os[2];
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) {
      const int c = dv0 + 4 * tx + 32 * kk;
      const float vals[4] = {o[r][kk][0], o[r][kk][1], o[r][kk][2], o[r][kk][3]};
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (c + e < a.hd) orow[(c + e) * a.os[3]] = from_float<T>(vals[e] * inv);
    }
    if (a.lse != nullptr && tx == 0 && (!GENERAL || blockIdx.z == 0)) {
      const float lse = m[r] == attn_neg_inf() ? attn_neg_inf() : (m[r] + log2f(lt)) * kAttnLn2;
      a.lse[b * a.ls[0] + h * a.ls[1] + (qrow0 + i) * a.ls[2]] = lse;
    }
  }
}

}  // namespace gpuops
