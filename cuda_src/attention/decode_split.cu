// Split-KV decode attention (flash-decoding): a few query tokens against a long KV cache.
//
// Grid (B * Hkv * row_chunks, nsplit). A block owns one kv head, one chunk of keys
// [split * chunk, (split + 1) * chunk) of its sequence, and RT of the rows (q head of the GQA
// group, query token) that share the kv head, so each K/V byte is read once per row chunk (the
// host picks RT >= G * Sq when registers allow: one chunk). The split writes its normalised
// partial output and log-sum-exp to an fp32 workspace; decode_combine.cu (a second launch, a PDL
// secondary on sm_90) merges the splits.
//
// Threads: L lanes hold one key row (16-byte packs of VEC elements, NV packs per lane), so a warp
// walks 32 / L keys at a time and the block 4 * 32 / L; each group keeps U keys' loads in flight,
// its own online-softmax state (m, l, o) per row, in registers; groups merge by shuffles, warps
// through shared memory at the end. Lengths are read on the device (cache_seqlens), never the
// host, so the launch is capturable in a CUDA graph with lengths that change between replays.
//
// Masking: query token i of Sq sits at position pos = len - Sq + i and sees keys
// max(0, pos - left) <= j <= pos (causal among the new tokens; left < 0: no window). A row with
// no visible key in the split writes lse = -inf and o = 0.
#include "attention/decode_common.cuh"
#include "common/pdl.cuh"

#ifdef GPUOPS_DECODE_TRACE
// Experiments only (benchmarks/experiments/decode_b1_floor.py builds a module with
// -DGPUOPS_DECODE_TRACE=N): for the first N blocks (linear index y * gridDim.x + x), thread 0
// stores %globaltimer (ns, one clock for all SMs) at entry, after the q / length loads, after its
// first step's math, after its key loop and at exit, and the SM id; the experiment reads the
// array by name
// (global namespace: an unmangled symbol).
__device__ unsigned long long gpuops_decode_trace[GPUOPS_DECODE_TRACE][6];
#define DECODE_MARK(i)                                                                        \
  do {                                                                                        \
    const unsigned blk = blockIdx.y * gridDim.x + blockIdx.x;                                 \
    if (threadIdx.x == 0 && blk < GPUOPS_DECODE_TRACE) {                                      \
      unsigned long long t;                                                                   \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : : "memory");                      \
      gpuops_decode_trace[blk][i] = t;                                                        \
      if (i == 0) {                                                                           \
        unsigned sm;                                                                          \
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));                                       \
        gpuops_decode_trace[blk][5] = sm;                                                     \
      }                                                                                       \
    }                                                                                         \
  } while (0)
#else
#define DECODE_MARK(i) do {} while (0)
#endif

namespace gpuops {

// K/V go through registers, each step's loads issued DecodeCfg::DEPTH steps before its math.
// pdl (programmatic dependent launch, common/pdl.cuh): bit 0: let the next kernel (the combine,
// launched as a PDL secondary) be scheduled at once; bit 1: this launch is itself a PDL secondary:
// wait for the previous kernel before the first memory access (q, lengths, table, K/V may all be
// its outputs, and the workspace may be memory it still reads).
template <class T, int D, int VEC, int RT, bool PAGED>
__global__ void __launch_bounds__(kDecodeThreads, 1) decode_split(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const int* __restrict__ seqlens, const int* __restrict__ block_table,
    float* __restrict__ ws_o, float* __restrict__ ws_lse,
    long long q_sb, long long q_ss, long long q_sh, long long q_sd,
    long long k_s0, long long k_s1, long long k_sh, long long k_sd,
    long long v_s0, long long v_s1, long long v_sh, long long v_sd,
    long long seq_stride, long long table_s0, long long table_s1, int page_size, int num_pages,
    int s_max, int sq, int hq, int hkv, int d_rt, int rows, int row_chunks,
    int chunk, int nsplit, int win_left, int pdl, float scale_log2) {
  DECODE_MARK(0);
  if (pdl & 2) pdl_wait();
  if (pdl & 1) pdl_launch_dependents();
  using Cfg = DecodeCfg<T, D, VEC, RT>;
  constexpr int L = Cfg::L, NV = Cfg::NV, E = Cfg::E, U = Cfg::U, KPW = 32 / L;
  constexpr int NG = (kDecodeThreads / 32) * KPW;   // key groups per block
  using Ld = KvLoad<T, VEC>;
  using Raw = typename Ld::Raw;

  const int split = blockIdx.y;
  const int rchunk = static_cast<int>(blockIdx.x % row_chunks);
  const int kvh = static_cast<int>((blockIdx.x / row_chunks) % hkv);
  const int b = static_cast<int>(blockIdx.x / (static_cast<unsigned>(row_chunks) * hkv));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int lig = lane % L;                       // lane in the key group (L divides 32)
  const int group = hq / hkv;

  // Element offsets of key j's K and V rows (this kv head): through the block table when PAGED
  auto kv_rows = [&](int j, long long& kb, long long& vb) {
    if (PAGED) {
      const int pi = j / page_size;
      int page = block_table[b * table_s0 + pi * table_s1];
      page = page < 0 ? 0 : (page >= num_pages ? num_pages - 1 : page);  // never out of bounds
      const int row = j - pi * page_size;
      kb = page * k_s0 + row * k_s1 + kvh * k_sh;
      vb = page * v_s0 + row * v_s1 + kvh * v_sh;
    } else {
      kb = b * k_s0 + j * k_s1 + kvh * k_sh;
      vb = b * v_s0 + j * v_s1 + kvh * v_sh;
    }
  };

  // K/V rows of keys j0 .. j0 + U - 1 of this lane's key group -> registers (zeros from `bound`)
  using KvRegs = Raw[U][NV];
  auto load_keys = [&](int j0, int bound, KvRegs& kr, KvRegs& vr) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u;
      if (j < bound) {
        long long kb, vb;
        kv_rows(j, kb, vb);
#pragma unroll
        for (int n = 0; n < NV; ++n) {
          const int d = (n * L + lig) * VEC;
          kr[u][n] = Ld::load(k + kb + d * k_sd, d < d_rt);
          vr[u][n] = Ld::load(v + vb + d * v_sd, d < d_rt);
        }
      } else {
#pragma unroll
        for (int n = 0; n < NV; ++n) { kr[u][n] = Ld::zero(); vr[u][n] = Ld::zero(); }
      }
    }
  };

  // The first DEPTH steps' K/V loads go out before the sequence length arrives (B1 S8192 has
  // only ~8 steps per block, so each latency on a block's critical path counts): keys of the
  // split's chunk below s_max are inside the cache whatever the length; the ones at or past the
  // length are zeroed below once it is known (they may hold anything, NaN included).
  // kr[0] / vr[0]: the step being attended; kr[1..DEPTH]: the steps in flight behind it.
  constexpr int kStep = NG * U;
  constexpr int DEPTH = Cfg::DEPTH;
  const int lane_off = (lane / L) * U;
  const int chunk_start = split * chunk;
  const int chunk_end = chunk_start + chunk < s_max ? chunk_start + chunk : s_max;
  const int jfirst = chunk_start + warp * KPW * U;   // the warp's first key of the chunk
  KvRegs kr[DEPTH + 1], vr[DEPTH + 1];
#pragma unroll
  for (int t = 0; t < DEPTH; ++t) load_keys(jfirst + t * kStep + lane_off, chunk_end, kr[t], vr[t]);
  // q of this block's rows (storage values, all loads issued before the conversion below) and
  // the sequence length, after the K/V loads: loading them first (or two K/V steps ahead)
  // delayed every block's first step in run 60 (the loads' issue stalls once the SM's memory
  // pipeline is full; the key loop already streams at the DRAM rate).
  // rows of this block: row rr = g * sq + i -> q head kvh * group + g, query token i
  int len = seqlens[b * seq_stride];
  T qraw[RT][E];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    const int rr = rchunk * RT + r;
    const bool valid = rr < rows;
    const int g = valid ? rr / sq : 0, i = valid ? rr - (rr / sq) * sq : 0;
    const T* qrow = q + b * q_sb + i * q_ss + (kvh * group + g) * q_sh;
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int d = (n * L + lig) * VEC + e;
        qraw[r][n * VEC + e] = (valid && d < d_rt) ? qrow[d * q_sd] : from_float<T>(0.f);
      }
  }

  len = len < 0 ? 0 : (len > s_max ? s_max : len);
  float qf[RT][E];
  int row_pos[RT], row_lo[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    const int rr = rchunk * RT + r;
    const bool valid = rr < rows;
    const int i = valid ? rr - (rr / sq) * sq : 0;
    row_pos[r] = valid ? len - sq + i : -1;       // invalid rows see no key
    row_lo[r] = win_left >= 0 ? row_pos[r] - win_left : 0;
    if (row_lo[r] < 0) row_lo[r] = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) qf[r][e] = to_float(qraw[r][e]) * scale_log2;
  }

  DECODE_MARK(1);
  // keys of this split that some row of the sequence can see
  int kmin = win_left >= 0 ? len - sq - win_left : 0;
  if (kmin < 0) kmin = 0;
  int start = split * chunk, end = start + chunk;
  if (start < kmin) start = kmin;
  if (end > len) end = len;

  float m[RT], l[RT], o[RT][E];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    m[r] = -__int_as_float(0x7f800000);
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) o[r][e] = 0.f;
  }

  // one step: scores of the group's U keys for every row, online softmax, o += p v
  auto attend_keys = [&](int j0, const KvRegs& kr, const KvRegs& vr) {
    // scores (log2 domain: q carries scale * log2(e))
    float s[RT][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[E];
#pragma unroll
      for (int n = 0; n < NV; ++n) Ld::unpack(kr[u][n], kf + n * VEC);
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        float acc = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) acc = fmaf(qf[r][e], kf[e], acc);
        s[r][u] = acc;
      }
    }
#pragma unroll
    for (int off = L / 2; off > 0; off >>= 1)
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int u = 0; u < U; ++u) s[r][u] += __shfl_xor_sync(0xffffffffu, s[r][u], off);

    float p[RT][U];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      float mx = m[r];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int j = j0 + u;
        if (j >= end || j < row_lo[r] || j > row_pos[r]) s[r][u] = -__int_as_float(0x7f800000);
        mx = fmaxf(mx, s[r][u]);
      }
      // mx = -inf: nothing visible yet; keep the state (p = 0, corr = 1)
      const float base = mx == -__int_as_float(0x7f800000) ? 0.f : mx;
      const float corr = exp2f(m[r] - base);
      float psum = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) { p[r][u] = exp2f(s[r][u] - base); psum += p[r][u]; }
      l[r] = l[r] * corr + psum;
      m[r] = mx;
#pragma unroll
      for (int e = 0; e < E; ++e) o[r][e] *= corr;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[E];
#pragma unroll
      for (int n = 0; n < NV; ++n) Ld::unpack(vr[u][n], vf + n * VEC);
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int e = 0; e < E; ++e) o[r][e] = fmaf(p[r][u], vf[e], o[r][e]);
    }
  };

  int jw = start + warp * KPW * U;
  // warp-uniform trip count: the shuffles need every lane of the warp. Each step's K/V loads go
  // out DEPTH steps before its math, so a warp keeps loads in flight while it computes (without
  // it every step waits a full memory latency; run 13 measured B1 S8192 bf16 at 41% of copy)
  if (start != chunk_start) {                     // a window moved the start: load again
#pragma unroll
    for (int t = 0; t < DEPTH; ++t) load_keys(jw + t * kStep + lane_off, end, kr[t], vr[t]);
  } else {                                        // keep the early loads below the length
#pragma unroll
    for (int t = 0; t < DEPTH; ++t)
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (jw + t * kStep + lane_off + u >= end)
#pragma unroll
          for (int n = 0; n < NV; ++n) { kr[t][u][n] = Ld::zero(); vr[t][u][n] = Ld::zero(); }
  }
  for (; jw < end; jw += kStep) {
    // past `end`: zeros, no memory access
    load_keys(jw + DEPTH * kStep + lane_off, end, kr[DEPTH], vr[DEPTH]);
    attend_keys(jw + lane_off, kr[0], vr[0]);
    if (jw == start + warp * KPW * U) DECODE_MARK(2);
#pragma unroll
    for (int t = 0; t < DEPTH; ++t)
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int n = 0; n < NV; ++n) { kr[t][u][n] = kr[t + 1][u][n]; vr[t][u][n] = vr[t + 1][u][n]; }
  }

  DECODE_MARK(3);
  // merge the key groups of the warp (lanes lig, lig + L, ...)
#pragma unroll
  for (int off = L; off < 32; off <<= 1)
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[r], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[r], off);
      const float mx = fmaxf(m[r], mo);
      const float base = mx == -__int_as_float(0x7f800000) ? 0.f : mx;
      const float a = exp2f(m[r] - base), c = exp2f(mo - base);
      l[r] = l[r] * a + lo * c;
      m[r] = mx;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float oo = __shfl_xor_sync(0xffffffffu, o[r][e], off);
        o[r][e] = o[r][e] * a + oo * c;
      }
    }

  // merge the warps through shared memory, normalise, write the partials
  constexpr int W = kDecodeThreads / 32;
  __shared__ float sm_m[W][RT], sm_l[W][RT];
  __shared__ float sm_o[W][RT][D];
  if (lane < L) {
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      if (lane == 0) { sm_m[warp][r] = m[r]; sm_l[warp][r] = l[r]; }
#pragma unroll
      for (int n = 0; n < NV; ++n)
#pragma unroll
        for (int e = 0; e < VEC; ++e) sm_o[warp][r][(n * L + lig) * VEC + e] = o[r][n * VEC + e];
    }
  }
  __syncthreads();
  // rows rr of this block are workspace rows row_base + rr (rr = g * sq + i)
  const long long row_base = (static_cast<long long>(b) * hq + kvh * group) * sq;
  for (int t = threadIdx.x; t < RT * d_rt; t += kDecodeThreads) {
    const int r = t / d_rt, d = t - r * d_rt;
    const int rr = rchunk * RT + r;
    if (rr >= rows) continue;
    float mx = sm_m[0][r];
#pragma unroll
    for (int w = 1; w < W; ++w) mx = fmaxf(mx, sm_m[w][r]);
    const float base = mx == -__int_as_float(0x7f800000) ? 0.f : mx;
    float lsum = 0.f, osum = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float a = exp2f(sm_m[w][r] - base);
      lsum += sm_l[w][r] * a;
      osum += sm_o[w][r][d] * a;
    }
    const long long row = row_base + rr;
    const float o_val = lsum > 0.f ? osum / lsum : 0.f;
    // natural-log LSE of the split: (m + log2 l) * ln 2
    const float lse_val = lsum > 0.f ? (mx + log2f(lsum)) * 0.6931471805599453f
                                     : -__int_as_float(0x7f800000);
    const long long slot = row * nsplit + split;
    ws_o[slot * d_rt + d] = o_val;
    if (d == 0) ws_lse[slot] = lse_val;
  }
  DECODE_MARK(4);
}

}  // namespace gpuops
