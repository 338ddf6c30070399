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
//  * a multi-stage cp.async pipeline (global -> shared without registers): the copies of K tile
//    kt + STAGES - 1 are in flight while tile kt is multiplied; one barrier per K tile.
//
// The main loop is (nearly) only ldmatrix + mma (the first version issued ~9 instructions per mma,
// most of them recomputing cp.async addresses and bounds; scripts/gemm_sass.py counts them):
//  * each thread's cp.async chunks are fixed: one global pointer per operand, computed once and
//    advanced by a constant per K tile, chunk i at a fixed distance from it; shared-memory
//    destinations are the stage's base + a per-thread constant (immediate offsets);
//  * full tiles of interior blocks take that predicate-free path; the K tail (a partial last
//    tile), blocks on the M/N edges and operands that are not 16-byte aligned take a checked path
//    (bounds, zero fill, per-element loads) chosen by a block-uniform branch;
//  * ldmatrix addresses: a per-lane offset computed once; the stage is a rotating register; the
//    k step and the m/n tile within a stage are an XOR / immediate on it (the swizzles are built
//    so that both are);
//  * fragments are double-buffered across the k steps of a stage (the loads of step kk + 1 are
//    issued before the mma of step kk), and the barrier of the next stage sits before the last
//    step's mma, so its latency overlaps tensor work.
// The epilogue stages the fp32 accumulators in shared memory (one pass when the whole tile fits
// in the pipeline's memory, else two, each with half of every warp's tiles), then every thread
// applies the epilogue to runs of 8 columns: bias hoisted to registers, the residual read with 16-byte loads issued one group
// ahead (and prefetched to L2 during the last K tiles), 16-byte coalesced stores.
// Tiles (gpuops/ops/gemm.py picks): 128x256 with 8 warps (2 x 4) and 128-byte K tiles in 3 stages
// (144 KiB: sm_80, sm_90) or 64-byte K tiles in 4 stages (96 KiB: sm_86/89), 128x128 with 4 warps
// (64 KiB, 2 blocks per SM) where the large tile leaves SMs idle; the dual (SwiGLU) kernel shares
// each 128-row A tile between two 64-column B tiles. Blocks walk the output in groups of 8 tile
// rows (L2 reuse), like every gpuops GEMM.
//
// int8 (int8_matmul on sm_80+): the same kernel with mma.m16n8k32.s8 and int32 accumulators (K-major
// operands; others take the per-element path), the scales applied in the epilogue.
//
// Left for the Hopper step (`variant='wgmma'`): wgmma.mma_async from shared memory descriptors, TMA
// loads and a warp-specialized producer/consumer pipeline.
#include "common/opaque.cuh"
#include "gemm/gemm_common.cuh"
#include "gemm/mma_common.cuh"

namespace gpuops {
namespace gemm {

// Swizzle of a K-major tile with rows of RB = 64 or 128 bytes (4 or 8 chunks of 16 bytes): the
// 8 rows an ldmatrix phase reads (r0 .. r0 + 7, one chunk each) fall in 8 distinct 16-byte bank
// groups of the 128-byte bank window. 64-byte rows: two rows per window, chunks XOR (r / 2) % 4;
// 128-byte rows: chunks XOR r % 8. Both repeat every 8 rows, and the XOR acts on the chunk bits
// only, so the k step within a stage is an XOR of the byte address (see MmaFrags).
template <int RB>
__device__ __forceinline__ int kmajor_swz(int r) { return RB == 64 ? ((r >> 1) & 3) : (r & 7); }

template <int RB>
__device__ __forceinline__ int kmajor_off(int r, int c) {
  return r * RB + ((c ^ kmajor_swz<RB>(r)) << 4);
}

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

// One operand's tile of a pipeline stage: ROWS rows (m of A, n of B) x BKB bytes of k, loaded by
// NT threads. KMAJOR: the operand's K dim is its contiguous one (or it has no unit stride at all;
// then only the checked path runs). In shared memory the tile is K-major ([ROWS][BKB bytes]) or
// M/N-major ([k][ROWS elements]); chunk q of it is moved by thread q % NT, so a thread's chunks
// are one column of chunks, kRowStep smem rows apart.
template <class T, int ROWS, int NT, bool KMAJOR, int BKB>
struct MmaOperand {
  static constexpr bool kKMajor = KMAJOR;
  static constexpr int kEl = sizeof(T);
  static constexpr int kEPC = 16 / kEl;                     // elements per 16-byte chunk
  static constexpr int kBK = BKB / kEl;                     // k per stage
  static constexpr int kRB = KMAJOR ? BKB : ROWS * kEl;     // bytes per smem row
  static constexpr int kCPR = kRB / 16;                     // chunks per smem row
  static constexpr int kBytes = ROWS * BKB;
  static constexpr int kPer = kBytes / 16 / NT;             // chunks per thread and stage
  static constexpr int kRowStep = NT / kCPR;                // smem rows between a thread's chunks
  static constexpr int kSwzPeriod = (KMAJOR || kEl == 2) ? 8 : 4;
  static_assert(kBytes / 16 % NT == 0 && NT % kCPR == 0, "chunks must split evenly");
  static_assert(kRowStep % kSwzPeriod == 0, "a thread's chunks must share one swizzle phase");
  static_assert(KMAJOR || kEl > 1, "int8 operands are staged K-major only (no byte ldmatrix.trans)");
  static_assert(BKB == 64 || BKB == 128, "K tiles of 64 or 128 bytes");

  // Vector path state (16-byte aligned operands): the global address of the thread's first chunk
  // in the next K tile; its chunks are g_step bytes apart, consecutive K tiles g_adv bytes;
  // s_off: its first chunk in the smem tile. lim (fixed for the block): K-major, how many of its
  // chunks have a row < R; M/N-major, how many bytes of its chunk (its columns) are < R.
  // c_k: K-major, the k offset of its chunk in a tile; M/N-major, its first k row.
  const char* g;
  long long g_step, g_adv;
  int s_off, lim, c_k;

  // How many of a thread's chunks (kRowStep smem rows apart) lie within `left` rows of its first.
  __device__ __forceinline__ static int chunks_within(long long left) {
    if (left <= 0) return 0;
    return left >= (long long)kPer * kRowStep ? kPer : (int)((left + kRowStep - 1) / kRowStep);
  }

  // base: the operand's matrix X[r][k] = base[r * sr + k * sk], R rows; r0: the tile's first row.
  // Unit stride along the contiguous dim (sk == 1 K-major, sr == 1 otherwise).
  __device__ __forceinline__ void init(const T* base, long long sr, long long sk, long long R,
                                       long long r0, int tid) {
    const int c = tid % kCPR, r = tid / kCPR;
    if constexpr (KMAJOR) {
      g = reinterpret_cast<const char*>(base + (r0 + r) * sr + c * kEPC);
      g_step = (long long)kRowStep * sr * kEl;
      g_adv = BKB;
      s_off = kmajor_off<kRB>(r, c);
      lim = chunks_within(R - r0 - r);      // rows from the thread's first one to the end
      c_k = c * kEPC;
    } else {
      g = reinterpret_cast<const char*>(base + (long long)r * sk + r0 + c * kEPC);
      g_step = (long long)kRowStep * sk * kEl;
      g_adv = (long long)kBK * sk * kEl;
      s_off = mnmajor_off<kEl>(r, c, kCPR);
      const long long left = R - r0 - (long long)c * kEPC;
      lim = left <= 0 ? 0 : (left >= kEPC ? 16 : (int)left * kEl);
      c_k = r;
    }
  }

  // The K tile at k0 into the smem tile at shared address `tile`. full: an interior block's
  // whole tile (k0 + kBK <= K): kPer cp.async, no bounds, no index math. Else zero fill of rows
  // beyond R and k beyond K (src-size 0..16 bytes; `safe`: a valid address for empty chunks).
  __device__ __forceinline__ void load_vec(unsigned int tile, bool full, long long k0,
                                           long long K, const void* safe) {
    if (full) {
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        cp_async16(tile + s_off + i * kRowStep * kRB, g + i * g_step, 16);
    } else {
      int bytes, n_ok;
      if constexpr (KMAJOR) {   // the chunk's k run is the same for all of a thread's chunks
        const long long kl = K - k0 - c_k;
        bytes = kl <= 0 ? 0 : (kl >= kEPC ? 16 : (int)kl * kEl);
        n_ok = lim;
      } else {                  // its columns are fixed; chunk i is k row c_k + i * kRowStep
        bytes = lim;
        n_ok = chunks_within(K - k0 - c_k);
      }
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int nb = i < n_ok ? bytes : 0;
        cp_async16(tile + s_off + i * kRowStep * kRB, nb ? g + i * g_step : safe, nb);
      }
    }
    g += KMAJOR ? (long long)BKB : g_adv;
  }

  // Any tile: rows beyond R and k beyond K are zero-filled; operands that are not 16-byte
  // aligned (aligned == false) are read element by element. dst: the tile in shared memory.
  __device__ __forceinline__ static void load_checked(unsigned char* dst, const T* base,
                                                      long long sr, long long sk, long long R,
                                                      long long K, long long r0, long long k0,
                                                      bool aligned, int tid) {
    // Recomputed per call (opaque: not hoisted out of the K loop, where 2 x kPer 64-bit row
    // offsets would stay live next to the accumulators and spill).
    unsigned int ut = tid;
    opaque(ut);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int q = (int)ut + i * NT;
      const int r = q / kCPR, c = q % kCPR;
      long long row, k, n, step;
      int off;
      if constexpr (KMAJOR) {
        row = r0 + r;
        k = k0 + c * kEPC;
        n = row < R ? K - k : 0;
        step = sk;
        off = kmajor_off<kRB>(r, c);
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

// Fragments of one operand for one warp (A: IS_A, m16 tiles; B: pairs of n8 tiles), from an
// operand tile described by Op. ldmatrix (.trans for 16-bit M/N-major tiles) reads at
// lane_off + the stage's tile address, then:
//   K-major: k step kk = XOR (kk << 5) (chunk 2 kk + h, h = 0/1, swizzled: the swizzle XORs the
//     chunk bits and 2 kk has bit 0 clear), tile t = + t * 16 rows (same swizzle phase);
//   M/N-major: k step kk = + kk * 16 rows (same phase), tile t = XOR (t << 5) (chunk + 2 t).
// Both need the tile's offset to have bits 4..6 clear (stages and tiles are multiples of 128 bytes
// of the dynamic shared memory; the XOR acts on offsets, not on the window address, so the
// base's alignment does not matter). fp32 M/N-major tiles (TF32) use scalar loads.
template <class T, class Op, bool IS_A>
struct MmaFrags {
  static constexpr bool kKMajor = Op::kKMajor;
  static constexpr bool kTrans = !kKMajor && sizeof(T) == 2;   // else fp32: scalar loads
  int lane_off;

  // wbase: the warp's first row (m of A, n of B) in the tile
  __device__ __forceinline__ void init(int lane, int wbase) {
    if constexpr (kKMajor) {
      // A, matrix i = lane / 8: rows +8 (i & 1), chunk +1 (i >> 1) -> a0..a3 of m16n8k16;
      // B, matrix i: n tile (i >> 1), k half (i & 1) -> b0, b1 of two n8 tiles
      const int r = IS_A ? wbase + (lane & 15) : wbase + (lane & 7) + (lane >> 4) * 8;
      const int h = IS_A ? lane >> 4 : (lane >> 3) & 1;
      lane_off = kmajor_off<Op::kRB>(r, h);
    } else if constexpr (kTrans) {
      // A stored [k][m], matrix i: m +8 (i & 1), k +8 (i >> 1): .trans gives A[m = g][k = 2t, 2t+1]
      // B stored [k][n], matrix i: k +8 (i & 1), n tile (i >> 1): .trans gives
      // B[k = 2t, 2t+1][n = g]
      const int r = IS_A ? (lane & 7) + (lane >> 4) * 8 : (lane & 7) + ((lane >> 3) & 1) * 8;
      const int c = wbase / 8 + (IS_A ? (lane >> 3) & 1 : lane >> 4);
      lane_off = mnmajor_off<2>(r, c, Op::kCPR);
    } else {
      lane_off = 0;
    }
  }

  // Registers of tile t at k step kk. s_base: the shared-memory window address of the dynamic
  // shared memory; off: the tile's offset in it + lane_off; tile: the tile as a generic pointer
  // (scalar TF32 path only).
  __device__ __forceinline__ static void load(unsigned int (&f)[4], unsigned int s_base, int off,
                                              const unsigned char* tile, int wbase, int kk, int t,
                                              int lane) {
    if constexpr (kKMajor) {
      ldmatrix_x4(f, s_base + (off ^ (kk << 5)) + t * 16 * Op::kRB);
      if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int i = 0; i < 4; ++i) f[i] = to_tf32(f[i]);
      }
    } else if constexpr (kTrans) {
      ldmatrix_x4_trans(f, s_base + (off ^ (t << 5)) + kk * 16 * Op::kRB);
    } else {
      // tf32, stored [k][m or n]. A: a0 = A[g][t], a1 = A[g + 8][t], a2 = A[g][t + 4],
      // a3 = A[g + 8][t + 4]; B (two n8 tiles): b0 = B[t][g], b1 = B[t + 4][g] of each
      const int g = lane >> 2, tq = lane & 3;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int x = wbase + t * 16 + g + (IS_A ? (i & 1) : (i >> 1)) * 8;
        const int r = kk * 8 + tq + (IS_A ? (i >> 1) : (i & 1)) * 4;
        const float v = *reinterpret_cast<const float*>(
            tile + mnmajor_off<4>(r, x / 4, Op::kCPR) + (x % 4) * 4);
        f[i] = to_tf32(__float_as_uint(v));
      }
    }
  }
};

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
    prefetch_l2(a);
  }
}

// The residual of one run of 8 columns, loaded early and converted late (res_values). vec (host
// flag kResVec: unit column stride, aligned rows and pointer, N % 8 == 0): the raw 16 bytes of a
// 16-bit residual in r[0], or the 32 bytes of an fp32 one in r[0], r[1]; else loaded element by
// element and kept as fp32 bits in r[0] (columns 0..3) and r[1] (4..7).
struct ResRun {
  uint4 r[2];
};

template <class TO>
__device__ __forceinline__ void load_res_run(ResRun& rr, const GemmArgs& p, const BatchOffsets& o,
                                             long long m, long long n, bool vec) {
  if (p.residual == nullptr || m >= p.M || n >= p.N) {
    rr.r[0] = rr.r[1] = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  if (vec) {
    const long long i = o.r + m * p.r_sm + n;
    if (p.out_f32) {
      const uint4* s = reinterpret_cast<const uint4*>(static_cast<const float*>(p.residual) + i);
      rr.r[0] = s[0];
      rr.r[1] = s[1];
    } else {
      rr.r[0] = *reinterpret_cast<const uint4*>(static_cast<const TO*>(p.residual) + i);
    }
    return;
  }
  // per element, as fp32 bits: r[0] = columns 0..3, r[1] = 4..7
  unsigned int w[8];
#pragma unroll
  for (int j = 0; j < 8; ++j)
    w[j] = __float_as_uint(
        n + j < p.N ? load_out<TO>(p.residual, o.r + m * p.r_sm + (n + j) * p.r_sn, p.out_f32)
                    : 0.0f);
  rr.r[0] = make_uint4(w[0], w[1], w[2], w[3]);
  rr.r[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// The 8 residual values of a run as fp32 (same vec flag as the load).
template <class TO>
__device__ __forceinline__ void res_values(const ResRun& rr, const GemmArgs& p, bool vec,
                                           float (&f)[8]) {
  if (vec && !p.out_f32) {
    if constexpr (sizeof(TO) == 2) {
      Vec16<TO>::unpack(rr.r[0], f);
      return;
    }
  }
  const unsigned int w[8] = {rr.r[0].x, rr.r[0].y, rr.r[0].z, rr.r[0].w,
                             rr.r[1].x, rr.r[1].y, rr.r[1].z, rr.r[1].w};
#pragma unroll
  for (int j = 0; j < 8; ++j) f[j] = __uint_as_float(w[j]);
}

// BM x BN block tile (BN per B operand), WM x WN warps, STAGES-deep cp.async pipeline of K tiles
// of BKB bytes per row. T: the inputs' storage type; TO: the output's (T, except for int8 inputs).
// AK / BKM: A / B is K-major (K contiguous); DUAL: silu(A @ B) * (A @ B2).
template <class T, class TO, int BM, int BN, int WM, int WN, int STAGES, int BKB, bool AK,
          bool BKM, bool DUAL>
struct GemmMma {
  static constexpr int kThreads = WM * WN * 32;
  static constexpr int kNB = DUAL ? 2 : 1;
  static constexpr int kWTM = BM / WM, kWTN = BN / WN;   // warp tile
  static constexpr int kMI = kWTM / 16, kNP = kWTN / 16; // m16 tiles, pairs of n8 tiles per warp
  static constexpr int kKK = BKB / 32;                   // mma k steps per stage (32 bytes of k)
  static constexpr bool kInt8 = sizeof(T) == 1;
  static constexpr bool kStdEpi = !DUAL && !kInt8;       // act(alpha * acc + bias) + residual
  using Acc = typename Mma<T>::Acc;                      // int32 for int8, else fp32
  using OpA = MmaOperand<T, BM, kThreads, AK, BKB>;
  using OpB = MmaOperand<T, BN, kThreads, BKM, BKB>;
  using FragA = MmaFrags<T, OpA, true>;
  using FragB = MmaFrags<T, OpB, false>;
  static constexpr int kBK = OpA::kBK;
  static constexpr int kStageBytes = OpA::kBytes + kNB * OpB::kBytes;
  static constexpr int kPipeBytes = STAGES * kStageBytes;
  static_assert(kKK % 2 == 0, "the fragment double buffer alternates within a stage");
  static_assert(Mma<T>::kK * (int)sizeof(T) == 32, "one mma k step is 32 bytes of k");
  static_assert(kWTN % 16 == 0 && kWTM % 16 == 0 && kWTN <= 64 && kWTM <= 64, "warp tile");

  using Accs = Acc[kNB][kMI][2 * kNP][4];

  // What the main loop and the epilogue share.
  struct Block {
    const GemmArgs& p;
    BatchOffsets o;
    const T* a;
    const T* b[kNB];
    long long m0, n0;
    int tid, lane, wm, wn, ktiles;
    unsigned int s_base;
    unsigned char* smem;
  };

  // The K loop. VEC: both operands 16-byte aligned, loads through MmaOperand::load_vec (whole
  // tiles of interior blocks without predicates); else the checked per-chunk path with
  // per-element loads. The kernel instantiates both (one runs), which keeps each loop's
  // registers apart.
  template <bool VEC>
  __device__ __forceinline__ static void mainloop(const Block& k, Accs& acc) {
    const GemmArgs& p = k.p;
    const int ktiles = k.ktiles;
    const unsigned int s_base = k.s_base;
    unsigned char* smem = k.smem;
    OpA la;
    OpB lb[kNB];
    int kfull = 0;   // K tiles [0, kfull) are whole tiles of an interior block
    if constexpr (VEC) {
      la.init(k.a, p.a_sm, p.a_sk, p.M, k.m0, k.tid);
#pragma unroll
      for (int d = 0; d < kNB; ++d) lb[d].init(k.b[d], p.b_sn, p.b_sk, p.N, k.n0, k.tid);
      kfull = (k.m0 + BM <= p.M && k.n0 + BN <= p.N) ? (int)(p.K / kBK) : 0;
    }
    const bool a_al = p.flags & kAVec, b_al = p.flags & kBVec;
    auto load_tile = [&](int stage_off, int nk) {
      if (nk >= ktiles) return;
      const long long k0 = (long long)nk * kBK;
      if constexpr (VEC) {
        const bool full = nk < kfull;
        la.load_vec(s_base + stage_off, full, k0, p.K, p.a);
#pragma unroll
        for (int d = 0; d < kNB; ++d)
          lb[d].load_vec(s_base + stage_off + OpA::kBytes + d * OpB::kBytes, full, k0, p.K, p.b);
      } else {
        unsigned char* s = smem + stage_off;
        OpA::load_checked(s, k.a, p.a_sm, p.a_sk, p.M, p.K, k.m0, k0, a_al, k.tid);
#pragma unroll
        for (int d = 0; d < kNB; ++d)
          OpB::load_checked(s + OpA::kBytes + d * OpB::kBytes, k.b[d], p.b_sn, p.b_sk, p.N, p.K,
                            k.n0, k0, b_al, k.tid);
      }
    };

    FragA fa;
    FragB fb;
    const int wbase_a = k.wm * kWTM, wbase_b = k.wn * kWTN;
    fa.init(k.lane, wbase_a);
    fb.init(k.lane, wbase_b);
    unsigned int af[2][kMI][4], bf[2][kNB][kNP][4];
    // fragments of k step kk of the stage at byte offset `stage`
    auto load_frags = [&](unsigned int(&fa_)[kMI][4], unsigned int(&fb_)[kNB][kNP][4], int stage,
                          int kk) {
      const int ba = stage + fa.lane_off;
#pragma unroll
      for (int i = 0; i < kMI; ++i)
        FragA::load(fa_[i], s_base, ba, smem + stage, wbase_a, kk, i, k.lane);
#pragma unroll
      for (int d = 0; d < kNB; ++d) {
        const int tb = stage + OpA::kBytes + d * OpB::kBytes;
        const int bb = tb + fb.lane_off;
#pragma unroll
        for (int t = 0; t < kNP; ++t)
          FragB::load(fb_[d][t], s_base, bb, smem + tb, wbase_b, kk, t, k.lane);
      }
    };

    // The residual tile is read once, by the epilogue; prefetched to L2 a few K tiles before
    // the loop ends, its DRAM latency hides behind the last tiles' mma work.
    const bool prefetch_res = kStdEpi && p.residual != nullptr && p.r_sn == 1;
    const int pf_kt = ktiles > 8 ? ktiles - 8 : 0;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      load_tile(s * kStageBytes, s);
      cp_async_commit();
    }
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    int rd = 0;                                // the stage being multiplied (byte offset)
    int wr = (STAGES - 1) * kStageBytes;       // the stage being loaded
    // VEC: fragments double-buffered across k steps, the loads of step kk + 1 issued before the
    // mma of step kk (the last step's: after the next stage's barrier). The checked path loads
    // each step's fragments just before its mma (its loads need the registers), and so does TF32
    // (its fragments take conversions, and scalar loads for M/N-major tiles: spills otherwise).
    constexpr bool kDB = VEC && sizeof(T) != 4;
    if constexpr (kDB) load_frags(af[0], bf[0], rd, 0);
#pragma unroll 1
    for (int kt = 0; kt < ktiles; ++kt) {
#pragma unroll
      for (int kk = 0; kk < kKK; ++kk) {
        if (kDB ? kk == kKK - 1 : kk == 0) {
          // DB: tile kt + 1 has landed (this thread's copies; the barrier: everyone's), and
          // every warp has loaded its last fragments of tile kt - 1's stage, which the loads
          // below overwrite next. Else: the same for tile kt and the stage of tile kt - 1.
          cp_async_wait<STAGES - 2>();
          __syncthreads();
          if (kDB) rd = rd + kStageBytes == kPipeBytes ? 0 : rd + kStageBytes;
        }
        if constexpr (kDB) load_frags(af[(kk + 1) & 1], bf[(kk + 1) & 1], rd, (kk + 1) % kKK);
        else load_frags(af[kk & 1], bf[kk & 1], rd, kk);
        if (kk == 0) {
          load_tile(wr, kt + STAGES - 1);
          cp_async_commit();
          wr = wr + kStageBytes == kPipeBytes ? 0 : wr + kStageBytes;
          if (prefetch_res && kt == pf_kt)
            prefetch_residual_l2<TO, BM, BN, kThreads>(p, k.o, k.m0, k.n0, k.tid);
        }
#pragma unroll
        for (int d = 0; d < kNB; ++d)
#pragma unroll
          for (int i = 0; i < kMI; ++i)
#pragma unroll
            for (int t = 0; t < kNP; ++t) {
              const unsigned int(&bt)[4] = bf[kk & 1][d][t];
              Mma<T>::run(acc[d][i][2 * t], af[kk & 1][i], bt[0], bt[1]);
              Mma<T>::run(acc[d][i][2 * t + 1], af[kk & 1][i], bt[2], bt[3]);
            }
      }
      if (!kDB) rd = rd + kStageBytes == kPipeBytes ? 0 : rd + kStageBytes;
    }
    cp_async_wait<0>();
  }

  // The fp32 accumulators (both products for the dual kernel) are staged in shared memory: the
  // whole tile in one pass when it fits in the pipeline's memory, else in kPasses passes, each
  // taking the same share of every warp's m16 tiles (so that every warp's live accumulators
  // shrink pass by pass and the copy-out of a pass does not sit next to whole warp tiles).
  // Then each thread applies the epilogue to runs of 8 columns (always the same 8: kThreads is a
  // multiple of the BN / 8 runs of a row) in a rolled loop over groups of kU runs: one copy of
  // the activation code per run of a group instead of one per accumulator, 16-byte smem reads
  // and global stores, the next group's residual in flight during a group.
  static constexpr int kLdC = BN + 8;   // floats; +8: the float2 writes below are conflict-free

  // Column c of a staged row is stored at stage_col(c): the 4-float chunks of each pair swap
  // places in every other group of 8 chunks. A copy-out thread reads its run of 8 columns as two
  // 16-byte chunks; unswizzled, the 8 lanes of a quarter warp (runs 32 bytes apart) would hit each
  // bank twice. Swizzled, their first (second) reads take chunks 2L + b (2L + 1 - b), b = bit 2
  // of the lane's run: 8 distinct bank groups. Pairs stay in place, so the float2 writes of the
  // fragments are as conflict-free as before.
  __device__ __forceinline__ static int stage_col(int c) { return c ^ (((c >> 5) & 1) << 2); }
  static constexpr int kRunsPerRow = BN / 8;
  static constexpr int kRowStep = kThreads / kRunsPerRow;
  static constexpr int kPasses = kNB * BM * kLdC * 4 <= kPipeBytes         ? 1
                                 : kNB * BM / 2 * kLdC * 4 <= kPipeBytes ? 2 : 4;
  static constexpr int kPassRows = BM / kPasses;
  static constexpr int kMIP = kMI / kPasses;            // m16 tiles per warp and pass
  static constexpr int kWRP = kWTM / kPasses;           // rows per warp and pass
  static constexpr int kRuns = kPassRows / kRowStep;     // runs per thread and pass
  // runs per group: 4 where the accumulators are all staged before the copy-out (one pass: the
  // registers are free), else 2 (the next pass's accumulators are still live)
  static constexpr int kU = kPasses == 1 ? 4 : 2;
  static_assert(kThreads % kRunsPerRow == 0 && kPassRows % kRowStep == 0 && kRuns % kU == 0 &&
                    kMI % kPasses == 0, "epilogue runs");
  static_assert(kNB * kPassRows * kLdC * 4 <= kPipeBytes, "C staging must fit");

  __device__ __forceinline__ static void epilogue(const Block& k, const Accs& acc) {
    const GemmArgs& p = k.p;
    const BatchOffsets& o = k.o;
    float* cs = reinterpret_cast<float*>(k.smem);
    const int g = k.lane >> 2, t4 = k.lane & 3;
    const int my_c = (k.tid % kRunsPerRow) * 8, r_first = k.tid / kRunsPerRow;
    const long long n = k.n0 + my_c;
    const bool res_vec = (p.flags & kResVec) != 0;
    float bz[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      bz[j] = (kStdEpi && p.bias != nullptr && n + j < p.N)
                  ? load_out<TO>(p.bias, (n + j) * p.bias_s, p.out_f32) : 0.0f;

#pragma unroll 1
    for (int h = 0; h < kPasses; ++h) {
      // staged row r of pass h is tile row (r / kWRP) * kWTM + h * kWRP + r % kWRP
      auto tile_row = [&](int r) { return (long long)((r / kWRP) * kWTM + h * kWRP + r % kWRP); };
      ResRun res[kU];
      if constexpr (kStdEpi) {
#pragma unroll
        for (int u = 0; u < kU; ++u)
          load_res_run<TO>(res[u], p, o, k.m0 + tile_row(r_first + u * kRowStep), n, res_vec);
      }
      __syncthreads();   // the pipeline's (or the previous pass's) shared memory is free
#pragma unroll
      for (int hp = 0; hp < kPasses; ++hp) {   // (compile-time register indices)
        if (hp != h) continue;
#pragma unroll
        for (int d = 0; d < kNB; ++d)
#pragma unroll
          for (int ii = 0; ii < kMIP; ++ii)
#pragma unroll
            for (int j = 0; j < 2 * kNP; ++j)
#pragma unroll
              for (int hh = 0; hh < 2; ++hh) {
                const int i = hp * kMIP + ii;
                const int r = k.wm * kWRP + ii * 16 + g + hh * 8, c = k.wn * kWTN + j * 8 + 2 * t4;
                *reinterpret_cast<float2*>(cs + (d * kPassRows + r) * kLdC + stage_col(c)) =
                    make_float2(static_cast<float>(acc[d][i][j][2 * hh]),
                                static_cast<float>(acc[d][i][j][2 * hh + 1]));
              }
      }
      __syncthreads();
#pragma unroll 1
      for (int it = 0; it < kRuns; it += kU) {
        ResRun nxt[kU];
        if constexpr (kStdEpi) {   // the next group's residual, in flight during this group
          if (it + kU < kRuns) {
#pragma unroll
            for (int u = 0; u < kU; ++u)
              load_res_run<TO>(nxt[u], p, o, k.m0 + tile_row(r_first + (it + kU + u) * kRowStep),
                               n, res_vec);
          }
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int r = r_first + (it + u) * kRowStep;
          const long long m = k.m0 + tile_row(r);
          if (m >= p.M) continue;
          const float* row = cs + r * kLdC;
          const float4 v0 = *reinterpret_cast<const float4*>(row + stage_col(my_c));
          const float4 v1 = *reinterpret_cast<const float4*>(row + stage_col(my_c + 4));
          float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
          if constexpr (DUAL) {
            const float* urow = cs + (kPassRows + r) * kLdC;
            const float4 u0 = *reinterpret_cast<const float4*>(urow + stage_col(my_c));
            const float4 u1 = *reinterpret_cast<const float4*>(urow + stage_col(my_c + 4));
            const float up[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
            swiglu_run<TO, 8>(p, o, m, n, v, up);
          } else if constexpr (kInt8) {   // (A @ B) * scale_a[m] * scale_b[n]
            const float sa = p.scale_a[m];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = n + j < p.N ? v[j] * sa * p.scale_b[n + j] : 0.0f;
            store_run<TO, 8>(p, o, m, n, v);
          } else {
            float rv[8];
            res_values<TO>(res[u], p, res_vec, rv);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = apply_act(p.act, p.alpha * v[j] + bz[j]) + rv[j];
            store_run<TO, 8>(p, o, m, n, v);
          }
        }
        if constexpr (kStdEpi) {
#pragma unroll
          for (int u = 0; u < kU; ++u) res[u] = nxt[u];
        }
      }
    }
  }
};

template <class T, class TO, int BM, int BN, int WM, int WN, int STAGES, int BKB, bool AK,
          bool BKM, bool DUAL>
__global__ void __launch_bounds__(WM * WN * 32, 1) gemm_mma(GemmArgs p) {
#if __CUDA_ARCH__ >= 800
  using G = GemmMma<T, TO, BM, BN, WM, WN, STAGES, BKB, AK, BKM, DUAL>;
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid / 32;
  const int tiles_m = (int)((p.M + BM - 1) / BM), tiles_n = (int)((p.N + BN - 1) / BN);
  int tm, tn;
  tile_coords(blockIdx.x, tiles_m, tiles_n, tm, tn);
  const BatchOffsets o = batch_offsets(p, p.z0 + blockIdx.z);
  typename G::Block k{p, o, static_cast<const T*>(p.a) + o.a, {}, (long long)tm * BM,
                      (long long)tn * BN, tid, tid % 32, warp / WN, warp % WN,
                      (int)((p.K + G::kBK - 1) / G::kBK), smem_addr(smem), smem};
  k.b[0] = static_cast<const T*>(p.b) + o.b;
  if constexpr (DUAL) k.b[G::kNB - 1] = static_cast<const T*>(p.b2) + o.b;
  typename G::Accs acc;
#pragma unroll
  for (int d = 0; d < G::kNB; ++d)
#pragma unroll
    for (int i = 0; i < G::kMI; ++i)
#pragma unroll
      for (int j = 0; j < 2 * G::kNP; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[d][i][j][c] = typename G::Acc(0);
  if ((p.flags & kAVec) && (p.flags & kBVec)) G::template mainloop<true>(k, acc);
  else G::template mainloop<false>(k, acc);
  G::epilogue(k, acc);
#else
  __trap();   // not reached: the module is built for sm_80+ only
#endif
}

}  // namespace gemm
}  // namespace gpuops
