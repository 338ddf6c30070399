// Split-KV decode attention on Hopper with K and V streamed by TMA into a shared-memory ring
// (sm_90, fp16/bf16, head dim 64 or 128, caches whose [B, S, Hkv, D] TMA can describe). The same
// contract as decode_split.cu (one block per kv head, chunk of keys and up to 16 q rows; every
// split writes its normalised partial output and natural log-sum-exp to the fp32 workspace that
// decode_combine.cu merges), a different way to move the bytes.
//
// Why (the decode GEMV's lesson, benchmarks/notes_gemm.md, H200 runs 193-216): a kernel that keeps
// its bytes in flight in registers stalled at ~75% of copy; a ring of shared-memory slots filled
// by TMA boxes (one instruction per 8 KiB, a producer warp, consumers waiting on mbarriers)
// reached 88-100%, with two blocks per SM overlapping each other's ends. The register kernel of
// decode_split.cu reads B1 S8192 at 61.7% of copy and B16 S4096 at ~87%.
// What it measured (H200 runs 218-227, notes_attention_decode.md): no faster than the register
// kernel at 2 q rows per kv head (the bare ring streams B16 S4096 in 67-69 us, the register kernel
// 70), but its cost does not grow with the rows up to 16, where the register kernel's does: the
// host takes it from 3 rows per kv head (GQA 64/8 B1 S8192 44.5 -> 18.5 us).
//
// Block: warps 0..3 consume, warp 4 produces. A stage holds KB = 64 keys of K and of V, as boxes
// of 64 keys x 64 head-dim columns (128 bytes) in TMA's 128-byte swizzle: chunk c of key row r at
// (c ^ r % 8) * 16, so ldmatrix reads every 8 rows from 8 distinct bank groups. The producer (one
// lane) waits for a free slot, expects the stage's bytes on the slot's "full" mbarrier and issues
// 2 * D / 64 boxes. Consumer warp w takes keys 16 w .. 16 w + 15 of each stage on the tensor cores
// (mma.m16n8k16, fp32 accumulate; the 16 rows of the mma are the block's q rows, zero past them):
// S = Q K^T from ldmatrix of K, the online softmax in the log2 domain on S's fragments, then
// P V with P reused from S's registers as the A fragment (as two parts in the storage type, so
// that P is not rounded to it) and V read by ldmatrix.trans; then it frees the slot (one
// arrival per warp).
// At the end the 4 warps' (m, l, o) meet in shared memory (the ring, free by then) and the block
// writes its partial as decode_split does.
//
// Paged caches: see PAGED below. Keys at or past the sequence length inside the last box (the
// cache may hold anything there, NaN included) get score -inf and their V rows are zeroed in
// shared memory before P V (0 x NaN would be NaN); keys past S_max arrive as TMA's zeros. The
// producer reads the length before its first box (a split past the length loads nothing).
#include "attention/decode_common.cuh"
#include "common/mma.cuh"
#include "common/pdl.cuh"
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
#include "common/wgmma.cuh"   // mbarriers, TMA
#endif

namespace gpuops {

// Proxy fences (PTX ISA "Memory Consistency Model", proxies): the ring's bytes are written by
// TMA (the async proxy) and read, zeroed and reused for the final merge by ordinary shared-memory
// instructions (the generic proxy); the mbarriers order the two only together with
// fence.proxy.async: after a consumer's last read of a slot and before it hands the slot back
// (else the next TMA fill may land before the read: DeepEP's race, deepseek-ai/DeepEP#642), and
// after the block's last generic writes (the merge), which a later block's TMA fill of the same
// shared memory must not overtake. Experiments build the kernel without them
// (-DGPUOPS_DTMA_FENCES=0, benchmarks/experiments/decode_tma_debug.py).
#ifndef GPUOPS_DTMA_FENCES
#define GPUOPS_DTMA_FENCES 1
#endif

constexpr int kDtConsumers = 4, kDtThreads = (kDtConsumers + 1) * 32;   // TMA_THREADS
constexpr int kDtKeys = 64;                                              // keys per stage
constexpr int kDtRows = 16;                                              // q rows per block

// Dynamic shared memory: 1 KiB of alignment slack, then STAGES x (K boxes, V boxes) of
// kDtKeys x 128 bytes each (host: _tma_smem in gpuops/ops/attention_decode.py).
// (Runs 221 and 224 also measured two other layouts of a stage, one 5-D box per tensor with a key's
// two 128-byte halves adjacent, and whole 256-byte rows without swizzle: no faster, the second
// 36 us slower at B16 S4096 with the math; removed.)
// GPUOPS_DTMA_NOMATH=1 (experiments): the consumers only wait for each stage and hand it back.
#ifndef GPUOPS_DTMA_NOMATH
#define GPUOPS_DTMA_NOMATH 0
#endif

template <int D, int STAGES>
struct DecodeTmaSmem {
  static constexpr int kBoxBytes = kDtKeys * 128;
  static constexpr int kBoxes = D / 64;                    // 64-column halves per tensor
  static constexpr int kTensorBytes = kBoxes * kBoxBytes;  // K (or V) of one stage
  static constexpr int kStageBytes = 2 * kTensorBytes;
  static constexpr int kBytes = 1024 + STAGES * kStageBytes;
  // byte offset of 16-byte chunk c (of D / 8) of key row r within a tensor's part of a stage
  static __device__ __forceinline__ unsigned int at(int r, int c) {
    return (c >> 3) * kBoxBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4);
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

// pdl as in decode_split (bit 0: let the combine be scheduled; bit 1: wait for the previous
// kernel before the first memory access).
// PAGED (paged_attention): the tensor maps describe the page pool [num_pages, page_size, Hkv, D]
// with boxes of min(page_size, 64) rows (the host takes page sizes that divide 64 or are
// multiples of it); a stage's 64 keys are 64 / rows boxes, each from the page the block table
// names (lane i of the producer warp looks up and issues box i), and the stages start at a
// multiple of the box rows (keys before the split's start are masked).
template <class T, int D, int STAGES, bool PAGED>
__global__ void __launch_bounds__(kDtThreads, 2) decode_split_tma(
    const __grid_constant__ TmaDesc tma_k, const __grid_constant__ TmaDesc tma_v,
    const T* __restrict__ q, const int* __restrict__ seqlens, const int* __restrict__ block_table,
    float* __restrict__ ws_o, float* __restrict__ ws_lse, long long q_sb, long long q_ss,
    long long q_sh, long long q_sd, long long seq_stride, long long table_s0, long long table_s1,
    int s_max, int sq, int hq, int hkv, int rows, int row_chunks, int chunk, int nsplit,
    int win_left, int pdl, int page_size, int num_pages, float scale_log2) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
  static_assert(sizeof(T) == 2 && (D == 64 || D == 128), "16-bit storage, head dim 64 or 128");
  using Smem = DecodeTmaSmem<D, STAGES>;
  constexpr int kChunks = D / 8;                           // 16-byte chunks per row
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long bars[2 * STAGES];   // full[s], then empty[s]
  const unsigned int base = (smem_u32(smem_raw) + 1023u) & ~1023u;   // swizzle atoms: 1 KiB
  unsigned char* ring = smem_raw + (base - smem_u32(smem_raw));

  if (pdl & 2) pdl_wait();
  if (pdl & 1) pdl_launch_dependents();
  const int split = blockIdx.y;
  const int rchunk = static_cast<int>(blockIdx.x % row_chunks);
  const int kvh = static_cast<int>((blockIdx.x / row_chunks) % hkv);
  const int b = static_cast<int>(blockIdx.x / (static_cast<unsigned>(row_chunks) * hkv));
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const unsigned int full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[STAGES]);
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, kDtConsumers);
    }
    mbar_fence_init();
  }
  int len = seqlens[b * seq_stride];
  __syncthreads();

  // the keys of this split that some row of the sequence can see: [start, end)
  len = len < 0 ? 0 : (len > s_max ? s_max : len);
  int kmin = win_left >= 0 ? len - sq - win_left : 0;
  if (kmin < 0) kmin = 0;
  int start = split * chunk, end = start + chunk;
  if (start < kmin) start = kmin;
  if (end > len) end = len;
  // boxes of box_rows keys; the stages from first (start rounded down to whole boxes)
  const int box_rows = PAGED ? (page_size < kDtKeys ? page_size : kDtKeys) : kDtKeys;
  const int first = PAGED ? start - start % box_rows : start;
  const int steps = end > start ? (end - first + kDtKeys - 1) / kDtKeys : 0;

  if (warp == kDtConsumers) {                              // the producer
    if (PAGED && steps > 0) {
      const int nb = kDtKeys / box_rows;                   // page boxes per stage
      const int max_pages = s_max / page_size;
      if (lane == 0) {
        tma_prefetch_desc(&tma_k);
        tma_prefetch_desc(&tma_v);
      }
      for (int st = 0; st < steps; ++st) {
        const int s = st % STAGES;
        int page = 0, prow = 0;
        if (lane < nb) {                                   // box lane: keys j .. j + box_rows
          const int j = first + st * kDtKeys + lane * box_rows;
          const int pi = j / page_size;
          prow = j - pi * page_size;
          // past the table: keys past the length (masked, V zeroed): any page in the pool
          page = pi < max_pages ? block_table[b * table_s0 + pi * table_s1] : 0;
          page = page < 0 ? 0 : (page >= num_pages ? num_pages - 1 : page);
        }
        if (lane == 0) {
          if (st >= STAGES) mbar_wait(empty0 + 8 * s, (unsigned int)((st / STAGES) & 1) ^ 1u);
          mbar_arrive_expect_tx(full0 + 8 * s, Smem::kStageBytes);
        }
        __syncwarp();
        if (lane < nb) {
          const unsigned int dst = base + s * Smem::kStageBytes + lane * box_rows * 128;
#pragma unroll
          for (int x = 0; x < Smem::kBoxes; ++x) {
            tma_load_4d(dst + x * Smem::kBoxBytes, &tma_k, full0 + 8 * s, 64 * x, prow, kvh, page);
            tma_load_4d(dst + (Smem::kBoxes + x) * Smem::kBoxBytes, &tma_v, full0 + 8 * s,
                        64 * x, prow, kvh, page);
          }
        }
      }
    } else if (!PAGED && lane == 0 && steps > 0) {
      tma_prefetch_desc(&tma_k);
      tma_prefetch_desc(&tma_v);
      for (int st = 0; st < steps; ++st) {
        const int s = st % STAGES;
        if (st >= STAGES) mbar_wait(empty0 + 8 * s, (unsigned int)((st / STAGES) & 1) ^ 1u);
        mbar_arrive_expect_tx(full0 + 8 * s, Smem::kStageBytes);
        const unsigned int dst = base + s * Smem::kStageBytes;
        const int j0 = first + st * kDtKeys;
#pragma unroll
        for (int x = 0; x < Smem::kBoxes; ++x) {
          tma_load_4d(dst + x * Smem::kBoxBytes, &tma_k, full0 + 8 * s, 64 * x, j0, kvh, b);
          tma_load_4d(dst + (Smem::kBoxes + x) * Smem::kBoxBytes, &tma_v, full0 + 8 * s, 64 * x,
                      j0, kvh, b);
        }
      }
    }
    return;
  }

  // the consumers. Rows of this block: row r = rchunk * 16 + (g or g + 8) -> q head
  // kvh * group + r / sq, query token r % sq (decode_split's numbering).
  const int g = lane >> 2, t = lane & 3;
  const int group = hq / hkv;
  int row_pos[2], row_lo[2];
  const T* qrow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = rchunk * kDtRows + g + 8 * h;
    const bool valid = rr < rows;
    const int gq = valid ? rr / sq : 0, i = valid ? rr - gq * sq : 0;
    qrow[h] = valid ? q + b * q_sb + i * q_ss + (kvh * group + gq) * q_sh : nullptr;
    row_pos[h] = valid ? len - sq + i : -1;               // an invalid row sees no key
    row_lo[h] = win_left >= 0 ? row_pos[h] - win_left : 0;
    if (row_lo[h] < 0) row_lo[h] = 0;
  }
  // Q as the A fragments of the D / 16 k-steps: qa[ks] = Q[g][16 ks + 2t, +1], Q[g + 8][...],
  // Q[g][16 ks + 8 + 2t, +1], Q[g + 8][...] (zeros for rows past the block's)
  unsigned int qa[D / 16][4];
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
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) o[n][c] = 0.f;

  const int krow = 16 * warp;                              // this warp's first key of a stage
  for (int st = 0; st < steps; ++st) {
    const int s = st % STAGES;
    mbar_wait(full0 + 8 * s, (unsigned int)((st / STAGES) & 1));
    const unsigned int kslot = base + s * Smem::kStageBytes;
    const unsigned int vslot = kslot + Smem::kTensorBytes;
    const int j0 = first + st * kDtKeys + krow;            // key of this warp's row 0
#if GPUOPS_DTMA_NOMATH   // experiments: the ring's streaming rate alone (results are garbage)
    if (j0 < 0) {
#else
    if (j0 + 16 > len) {
#endif
      // keys at or past the length: V rows to zeros (the cache may hold NaN there)
      for (int e = lane; e < 16 * Smem::kBoxes * 8; e += 32) {
        const int r = e / (Smem::kBoxes * 8), c = e % (Smem::kBoxes * 8);
        if (j0 + r >= len) {
          const unsigned int a = vslot + Smem::at(krow + r, c);
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" :: "r"(a), "r"(0u) : "memory");
        }
      }
      __syncwarp();
    }
#if !GPUOPS_DTMA_NOMATH
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
        ldmatrix_x4(kf, kslot + Smem::at(r, c));
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
    {
      const int r = krow + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
      for (int dp = 0; dp < kChunks / 2; ++dp) {
        const int c = 2 * dp + (lane >> 4);
        unsigned int vf[4];
        ldmatrix_x4_trans(vf, vslot + Smem::at(r, c));
        Mma<T>::run(o[2 * dp], pa, vf[0], vf[1]);
        Mma<T>::run(o[2 * dp], pl, vf[0], vf[1]);
        Mma<T>::run(o[2 * dp + 1], pa, vf[2], vf[3]);
        Mma<T>::run(o[2 * dp + 1], pl, vf[2], vf[3]);
      }
    }
#endif  // !GPUOPS_DTMA_NOMATH
#if GPUOPS_DTMA_FENCES
    fence_proxy_async_smem();                              // our reads before the next fill
#endif
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * s);            // this warp is done with the slot
  }

  // l over the 4 threads of a row; then the warps meet in shared memory (the ring: every box
  // the producer issued has been waited for and read)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  named_bar_sync(1, kDtConsumers * 32);
  float* sm_m = reinterpret_cast<float*>(ring);            // [warp][16]
  float* sm_l = sm_m + kDtConsumers * kDtRows;             // [warp][16]
  float* sm_o = sm_l + kDtConsumers * kDtRows;             // [warp][16][D]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (t == 0) {
      sm_m[warp * kDtRows + r] = m[h];
      sm_l[warp * kDtRows + r] = l[h];
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      float* dst = sm_o + (warp * kDtRows + r) * D + 8 * n + 2 * t;
      dst[0] = o[n][2 * h];
      dst[1] = o[n][2 * h + 1];
    }
  }
  named_bar_sync(1, kDtConsumers * 32);
  const long long row_base = (static_cast<long long>(b) * hq + kvh * group) * sq;
  for (int e = tid; e < kDtRows * D; e += kDtConsumers * 32) {
    const int r = e / D, d = e - r * D;
    const int rr = rchunk * kDtRows + r;
    if (rr >= rows) continue;
    float mx = sm_m[r];
#pragma unroll
    for (int w = 1; w < kDtConsumers; ++w) mx = fmaxf(mx, sm_m[w * kDtRows + r]);
    const float bm = mx == kNegInf ? 0.f : mx;
    float lsum = 0.f, osum = 0.f;
#pragma unroll
    for (int w = 0; w < kDtConsumers; ++w) {
      const float a = exp2f(sm_m[w * kDtRows + r] - bm);
      lsum += sm_l[w * kDtRows + r] * a;
      osum += sm_o[(w * kDtRows + r) * D + d] * a;
    }
    const long long slot = (row_base + rr) * nsplit + split;
    ws_o[slot * D + d] = lsum > 0.f ? osum / lsum : 0.f;
    if (d == 0)
      ws_lse[slot] = lsum > 0.f ? (mx + log2f(lsum)) * 0.6931471805599453f : kNegInf;
  }
#if GPUOPS_DTMA_FENCES
  // the merge's writes before any later TMA fill of this shared memory (the next block here);
  // the barriers' memory handed back (mbarrier.inval: PTX requires it before the memory is
  // used otherwise; every TMA and wait on them is done once the consumers are here)
  fence_proxy_async_smem();
  named_bar_sync(1, kDtConsumers * 32);
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < 2 * STAGES; ++s)
      asm volatile("mbarrier.inval.shared::cta.b64 [%0];" :: "r"(full0 + 8 * s) : "memory");
  }
#endif
#else
  __trap();   // not reached: the module is built for sm_90 only
#endif
}

}  // namespace gpuops
