// Split-KV decode attention (flash-decoding): a few query tokens against a long KV cache.
//
// Grid (B * Hkv * row_chunks, nsplit). A block owns one kv head, one chunk of keys
// [split * chunk, (split + 1) * chunk) of its sequence, and RT of the rows (q head of the GQA
// group, query token) that share the kv head, so each K/V byte is read once per row chunk (the
// host picks RT >= G * Sq when registers allow: one chunk). The split writes its normalised
// partial output and log-sum-exp to an fp32 workspace, and the splits are merged by one of:
//   fuse = 0: nothing here; decode_combine.cu (a second launch) merges them;
//   fuse = 1, nsplit = 1: the block writes the final output itself (no workspace);
//   fuse = 1, nsplit > 1: the last block of each (b, kv head, row chunk) to finish merges them
//     ("last block done": every block publishes its partials, then arrives at the counter of its
//     blockIdx.x; the block that sees nsplit - 1 arrivals before its own reads all the partials
//     through L2 and writes the output, and sets the counter back to 0, so the next launch or
//     graph replay needs no memset). Run 15: the second launch cost ~4 us of B1 S8192's 20.3.
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
#include "common/coherent.cuh"
#include "common/pdl.cuh"

namespace gpuops {

// Online log-sum-exp merge of the state (m, l, acc) with (m2, l2, acc2): m are natural-log
// maxima (a split's lse with l = 1 and its normalised o), -inf for nothing; NaN propagates.
__device__ __forceinline__ void lse_merge(float& m, float& l, float4& acc, float m2, float l2,
                                          const float4& acc2) {
  if (m2 == -__int_as_float(0x7f800000)) return;   // an empty split (its o is 0)
  const float mx = fmaxf(m, m2);
  const float a = expf(m - mx), c = expf(m2 - mx);  // m = -inf: a = 0
  l = l * a + l2 * c;
  acc.x = acc.x * a + acc2.x * c;
  acc.y = acc.y * a + acc2.y * c;
  acc.z = acc.z * a + acc2.z * c;
  acc.w = acc.w * a + acc2.w * c;
  m = mx;
}

// The last block of a (b, kv head, row chunk): merges the nsplit partials of its `nr` rows
// (workspace rows row0 .. row0 + nr - 1, row = (b * hq + h) * sq + i) into `out` and `lse_out`.
// Threads: (row, column unit) items (a unit = 4 columns when d is a multiple of 4), and when
// there are fewer items than threads, `groups` threads per item take every groups-th split and
// meet in shared memory. Each thread loads 8 splits' lse and partials before merging them (8
// loads in flight: B1 S8192 has 64 splits, 2 groups, 4 rounds). Every load is ld.global.cg: the
// partials were written by other blocks during this launch and L1 is not coherent across SMs.
template <class T>
__device__ __forceinline__ void decode_merge_splits(
    const float* ws_o, const float* ws_lse, T* out, float* lse_out, long long row0, int nr,
    int nsplit, int d, int sq, int hq) {
  constexpr int kBatch = 8;
  const bool vec4 = (d & 3) == 0;
  const int units = vec4 ? d >> 2 : d;
  const int items = nr * units;
  int groups = items >= kDecodeThreads ? 1 : kDecodeThreads / items;
  if (groups > nsplit) groups = nsplit;
  const int per_pass = groups == 1 ? kDecodeThreads : items;
  const int g = threadIdx.x / per_pass;
  __shared__ float4 sm_acc[kDecodeThreads];
  __shared__ float sm_gm[kDecodeThreads], sm_gl[kDecodeThreads];
  for (int i0 = 0; i0 < items; i0 += per_pass) {   // > 1 pass only when groups == 1
    const int item = i0 + static_cast<int>(threadIdx.x) % per_pass;
    const bool active = g < groups && item < items;
    const int r = item / units, c = item - (item / units) * units;
    const long long row = row0 + r;
    float m = -__int_as_float(0x7f800000), l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (active) {
      const float* lse_row = ws_lse + row * nsplit;
      const float* o_row = ws_o + row * nsplit * static_cast<long long>(d);
      for (int s0 = g; s0 < nsplit; s0 += kBatch * groups) {
        float x[kBatch];
        float4 y[kBatch];
#pragma unroll
        for (int t = 0; t < kBatch; ++t) {
          const int s = s0 + t * groups;
          const bool ok = s < nsplit;
          const float* src = o_row + static_cast<long long>(s) * d;
          x[t] = ok ? load_cg(lse_row + s) : -__int_as_float(0x7f800000);
          y[t] = !ok ? make_float4(0.f, 0.f, 0.f, 0.f)
               : vec4 ? load_cg4(src + 4 * c) : make_float4(load_cg(src + c), 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int t = 0; t < kBatch; ++t) lse_merge(m, l, acc, x[t], 1.f, y[t]);
      }
    }
    if (groups > 1) {                              // block-uniform: one pass
      sm_acc[threadIdx.x] = acc;
      sm_gm[threadIdx.x] = m;
      sm_gl[threadIdx.x] = l;
      __syncthreads();
      if (active && g == 0)
        for (int o = 1; o < groups; ++o) {
          const int t = threadIdx.x + o * items;
          lse_merge(m, l, acc, sm_gm[t], sm_gl[t], sm_acc[t]);
        }
    }
    if (active && g == 0) {
      const int i = static_cast<int>(row % sq);
      const long long bh = row / sq;               // b * hq + h
      const long long b = bh / hq, h = bh - b * hq;
      T* orow = out + ((b * sq + i) * hq + h) * static_cast<long long>(d);
      const float inv = l == 0.f ? 0.f : 1.f / l;  // no visible key: 0; NaN stays NaN
      store_merged<T>(orow, c, acc, inv, vec4);
      if (lse_out != nullptr && c == 0)
        lse_out[row] = l == 0.f ? -__int_as_float(0x7f800000) : m + logf(l);
    }
  }
}

// K/V go through registers, the next step's loads issued before this step's math where
// RT * E <= 32 (DecodeCfg::PREFETCH).
// pdl (programmatic dependent launch, common/pdl.cuh): bit 0: let the next kernel (the combine,
// launched as a PDL secondary) be scheduled at once; bit 1: this launch is itself a PDL secondary:
// wait for the previous kernel before the first memory access (q, lengths, table, K/V may all be
// its outputs, and the workspace may be memory it still reads).
template <class T, int D, int VEC, int RT, bool PAGED>
__global__ void __launch_bounds__(kDecodeThreads, 1) decode_split(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const int* __restrict__ seqlens, const int* __restrict__ block_table,
    float* __restrict__ ws_o, float* __restrict__ ws_lse, unsigned* __restrict__ counters,
    T* __restrict__ out, float* __restrict__ lse_out,
    long long q_sb, long long q_ss, long long q_sh, long long q_sd,
    long long k_s0, long long k_s1, long long k_sh, long long k_sd,
    long long v_s0, long long v_s1, long long v_sh, long long v_sd,
    long long seq_stride, long long table_s0, long long table_s1, int page_size, int num_pages,
    int s_max, int sq, int hq, int hkv, int d_rt, int rows, int row_chunks,
    int chunk, int nsplit, int win_left, int fuse, int pdl, float scale_log2) {
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

  // The first step's K/V loads go out before the sequence length arrives (one memory latency
  // less on every block's critical path: B1 S8192 has only ~8 steps per block): keys of the
  // split's chunk below s_max are inside the cache whatever the length; the ones at or past the
  // length are zeroed below once it is known (they may hold anything, NaN included).
  constexpr int kStep = NG * U;
  const int lane_off = (lane / L) * U;
  const int chunk_start = split * chunk;
  const int chunk_end = chunk_start + chunk < s_max ? chunk_start + chunk : s_max;
  KvRegs kr, vr;
  if (Cfg::PREFETCH) load_keys(chunk_start + warp * KPW * U + lane_off, chunk_end, kr, vr);

  int len = seqlens[b * seq_stride];
  len = len < 0 ? 0 : (len > s_max ? s_max : len);

  // rows of this block: row rr = g * sq + i -> q head kvh * group + g, query token i
  float qf[RT][E];
  int row_pos[RT], row_lo[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    const int rr = rchunk * RT + r;
    const bool valid = rr < rows;
    const int g = valid ? rr / sq : 0, i = valid ? rr - (rr / sq) * sq : 0;
    const int h = kvh * group + g;
    row_pos[r] = valid ? len - sq + i : -1;       // invalid rows see no key
    row_lo[r] = win_left >= 0 ? row_pos[r] - win_left : 0;
    if (row_lo[r] < 0) row_lo[r] = 0;
    const T* qrow = q + b * q_sb + i * q_ss + h * q_sh;
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int d = (n * L + lig) * VEC + e;
        qf[r][n * VEC + e] = (valid && d < d_rt) ? to_float(qrow[d * q_sd]) * scale_log2 : 0.f;
      }
  }

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
  // warp-uniform trip count: the shuffles need every lane of the warp. With PREFETCH the next
  // step's K/V loads are issued before this step's math, so a warp keeps loads in flight while
  // it computes (without it every step waits a full memory latency; run 13 measured B1 S8192
  // bf16 at 41% of copy bandwidth)
  if (Cfg::PREFETCH) {
    if (start != chunk_start) {                   // a window moved the start: load again
      load_keys(jw + lane_off, end, kr, vr);
    } else {                                      // keep the early loads below the length
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (jw + lane_off + u >= end)
#pragma unroll
          for (int n = 0; n < NV; ++n) { kr[u][n] = Ld::zero(); vr[u][n] = Ld::zero(); }
    }
    for (; jw < end; jw += kStep) {
      KvRegs kn, vn;
      load_keys(jw + kStep + lane_off, end, kn, vn);   // past `end`: zeros, no memory access
      attend_keys(jw + lane_off, kr, vr);
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int n = 0; n < NV; ++n) { kr[u][n] = kn[u][n]; vr[u][n] = vn[u][n]; }
    }
  } else {
    for (; jw < end; jw += kStep) {
      load_keys(jw + lane_off, end, kr, vr);
      attend_keys(jw + lane_off, kr, vr);
    }
  }

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
  const bool direct = fuse != 0 && nsplit == 1;   // the only split: write the output itself
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
    if (direct) {            // same values as decode_combine gives for one split (weight 1)
      const int g = rr / sq, i = rr - g * sq;
      out[((static_cast<long long>(b) * sq + i) * hq + kvh * group + g) * d_rt + d] =
          from_float<T>(o_val);
      if (d == 0 && lse_out != nullptr) lse_out[row] = lse_val;
    } else {
      const long long slot = row * nsplit + split;
      ws_o[slot * d_rt + d] = o_val;
      if (d == 0) ws_lse[slot] = lse_val;
    }
  }
  if (fuse == 0 || direct) return;

  // Last block done. Each thread's partial stores are made visible device-wide before the block
  // arrives (__threadfence in every writer: sm_61 has no cumulative release), then thread 0
  // arrives with acquire-release semantics; the last block's threads read the partials after
  // the barrier that follows that acquire, through L2 (decode_merge_splits).
  __threadfence();
  __syncthreads();
  __shared__ unsigned sm_last;
  if (threadIdx.x == 0) {
    const unsigned before = counter_add_acq_rel(counters + blockIdx.x, 1u);
    const bool last = before == static_cast<unsigned>(nsplit - 1);
    // every split of this launch has arrived: reset for the next launch (stream order makes the
    // store visible to it; no block of this launch touches the counter again)
    if (last) *reinterpret_cast<volatile unsigned*>(counters + blockIdx.x) = 0u;
    sm_last = last ? 1u : 0u;
  }
  __syncthreads();
  if (sm_last == 0u) return;
  const int nr = rows - rchunk * RT < RT ? rows - rchunk * RT : RT;
  decode_merge_splits<T>(ws_o, ws_lse, out, lse_out, row_base + rchunk * RT, nr, nsplit, d_rt,
                         sq, hq);
}

}  // namespace gpuops
