// RMSNorm forward, y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) per row (kept in fp32
// for the backward), and the fused residual add of LLM decoder layers (kAdd):
//     h = x + r  (rounded to T and stored: the next layer's residual)
//     y = h * rstd(h) * w
// The statistics use h as stored (rounded to T), as HF transformers' Llama/Qwen layers and vLLM's
// fused_add_rms_norm do: y is exactly rms_norm(h) of the h returned. y is computed in fp32 and
// rounded once (HF rounds h * rstd to T before multiplying by w: within one rounding of this).
// Row layout and phases: norms/norm_rows.cuh.
#include "norms/norm_rows.cuh"
#include "norms/norm_ring.cuh"
#include "norms/norm_stream.cuh"
#include "common/pdl.cuh"

namespace gpuops {

// kAdd: v += t, h_row = v rounded to T, and v keeps the rounded values.
template <class T, int VEC, int PACKS>
__device__ __forceinline__ void add_store_residual(float (&v)[PACKS][VEC],
                                                   const float (&t)[PACKS][VEC], T* h_row,
                                                   int u0, int units) {
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
    const int u = u0 + p * static_cast<int>(blockDim.x);
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[p][j] += t[p][j];
    if (u < units) Unit<T, VEC>::store_rounded(h_row + static_cast<long long>(u) * VEC, v[p]);
  }
}

template <int VEC, int PACKS>
__device__ __forceinline__ float sum_squares(const float (&v)[PACKS][VEC]) {
  float ss = 0.0f;
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) ss = fmaf(v[p][j], v[p][j], ss);   // past the end: 0
  }
  return ss;
}

// y = v * rstd * w for one unit, w given as its raw unit (has_w false: no weight; wr not read):
// rstd first, then w, the rounding every rms_norm kernel shares.
template <class T, int VEC>
__device__ __forceinline__ void scale_store_unit(float (&v)[VEC], float rstd,
                                                 const typename RawUnit<T, VEC>::type& wr,
                                                 bool has_w, T* y) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) v[j] *= rstd;
  if (has_w) {
    float wv[VEC];
    RawUnit<T, VEC>::unpack(wr, wv);
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] *= wv[j];
  }
  Unit<T, VEC>::store(y, v);
}

// y = v * rstd * w for this thread's units of the row. The loads of w go out in groups of GROUP
// packs (default two), all of a group before the first is used: one L2 round trip per group, not
// one per pack (a pack's branch kept the compiler from hoisting the next pack's load).
template <class T, int VEC, int PACKS, int GROUP = 2>
__device__ __forceinline__ void scale_store(float (&v)[PACKS][VEC], float rstd, const T* w,
                                            T* y_row, int u0, int units) {
  using R = RawUnit<T, VEC>;
  constexpr int G = PACKS < GROUP ? PACKS : GROUP;
#pragma unroll
  for (int p0 = 0; p0 < PACKS; p0 += G) {
    typename R::type wr[G];
    if (w != nullptr) load_params<T, VEC, G>(w, u0, p0, units, wr);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int p = p0 + g;
      const int u = u0 + p * static_cast<int>(blockDim.x);
      if (u < units) {
        scale_store_unit<T, VEC>(v[p], rstd, wr[g], w != nullptr,
                                 y_row + static_cast<long long>(u) * VEC);
      }
    }
  }
}

// The last block of a split row: sum the row's partials, store rstd (through L2).
__device__ __forceinline__ void merge_row_rstd(const float* row_partials, int C, float inv_n,
                                               float eps, float* rstd_out, float* scratch) {
  float ss[1];
  sum_partials<1>(row_partials, C, ss, scratch);
  if (threadIdx.x == 0) store_cg(rstd_out, rsqrtf(ss[0] * inv_n + eps));
}

// Whole rows (C == 1, phase kFused) or the two launches of split rows (C > 1: kPartials, then
// kApply). x (and r for kAdd), y, h: rows of n elements, each with its own row stride (y may be
// x: in place). w: n elements or null. rstd_out: a float per row, or null when not wanted with
// C == 1 (for C > 1 it carries the statistics from kPartials to kApply). h is written by kFused
// and kPartials and read back by kApply. partials (rows * C floats) and counters (rows,
// zeroed): only for C > 1.
template <class T, int VEC, int PACKS, bool kAdd>
__global__ void __launch_bounds__(1024, 1)
rms_norm_fwd(const T* x, long long x_stride, const T* r, long long r_stride, T* y,
             long long y_stride, T* h, long long h_stride, const T* __restrict__ w,
             float* rstd_out, float* __restrict__ partials, unsigned* __restrict__ counters,
             long long rows, int n, int C, int phase, float eps) {
  pdl_start();
  __shared__ float scratch[32];
  __shared__ unsigned flag;
  const RowMap map(C, phase == kApply);
  const int units = n / VEC;
  const int u0 = first_unit<PACKS>(map.chunk);
  const bool block_rows = blockDim.x > 32;
  const float inv_n = 1.0f / static_cast<float>(n);   // n = 0: rstd = NaN

  for (long long row = map.first; row < rows; row += map.step) {
    float v[PACKS][VEC];
    if (kAdd && phase != kApply) {
      float t[PACKS][VEC];
      load_tile<T, VEC, PACKS>(x + row * x_stride, u0, units, v);
      load_tile<T, VEC, PACKS>(r + row * r_stride, u0, units, t);
      add_store_residual<T, VEC, PACKS>(v, t, h + row * h_stride, u0, units);
    } else {
      load_tile<T, VEC, PACKS>(kAdd ? h + row * h_stride : x + row * x_stride, u0, units, v);
    }

    float rstd;
    if (phase == kApply) {
      rstd = rstd_out[row];
    } else {
      float ss[1] = {sum_squares<VEC, PACKS>(v)};
      if (block_rows) block_sum_n<1>(ss, scratch);
      else warp_sum_n<1>(ss);
      if (C > 1) {   // kPartials
        float* row_partials = partials + row * C;
        if (split_arrive<1>(row_partials + map.chunk, ss, counters + row, &flag) ==
            static_cast<unsigned>(C - 1))
          merge_row_rstd(row_partials, C, inv_n, eps, rstd_out + row, scratch);
        continue;
      }
      rstd = rsqrtf(ss[0] * inv_n + eps);
      if (rstd_out != nullptr && threadIdx.x == 0) rstd_out[row] = rstd;
    }
    scale_store<T, VEC, PACKS>(v, rstd, w, y + row * y_stride, u0, units);
  }
}

// Whole rows of a grid that fits in one wave (decode-sized calls: rows <= resident blocks; the
// launch picks it, gpuops.ops.norms.DECODE_ROWS): 16-byte units, one block per row (blockDim.x >
// 32, a multiple of 32), rms_norm_fwd's kFused math to the bit, laid out for one row's latency
// rather than for streaming: w's units are loaded together with x's, before the reduction, and
// held (a block waits for one round trip, not for a second one after the reduction), and there
// is no row loop and no split-row code. An fp32 [16, 2048] probe of these steps ran 0.12 us
// shorter than the same steps with w read after the reduction, and rms_norm_fwd itself 0.17 us
// longer than those (runs 76-77); in a PDL chain rms_norm bf16 1.58 -> 1.46 us (run 78,
// benchmarks/NOTES.md). Arguments as rms_norm_fwd's; partials, counters, C and phase are not read.
// kTrigger: PDL's trigger at the start (the one-wave grids of decode-sized calls); grids of many
// waves (ROWS_MAX_WAVES) run the instance without it (pdl_start_untriggered: 160.0 -> 133.0 us
// at [131072, 1024] bf16, run 165).
template <class T, int VEC, int PACKS, bool kAdd, bool kTrigger>
__global__ void __launch_bounds__(1024, 1)
rms_norm_rows(const T* x, long long x_stride, const T* r, long long r_stride, T* y,
              long long y_stride, T* h, long long h_stride, const T* __restrict__ w,
              float* rstd_out, float* __restrict__ partials, unsigned* __restrict__ counters,
              long long rows, int n, int C, int phase, float eps) {
  if (kTrigger) {
    pdl_start();
  } else {
    pdl_start_untriggered();
  }
  __shared__ float scratch[32];
  const long long row = blockIdx.x;
  if (row >= rows) return;                        // (the grid is one block per row)
  const int units = n / VEC;
  const int u0 = static_cast<int>(threadIdx.x);
  const float inv_n = 1.0f / static_cast<float>(n);   // n = 0: rstd = NaN
  using R = RawUnit<T, VEC>;
  static_assert(VEC > 1, "16-byte units only (single elements: rms_norm_fwd)");
  float v[PACKS][VEC];
  typename R::type held[PACKS];
  if (kAdd) {
    float t[PACKS][VEC];
    load_tile<T, VEC, PACKS>(x + row * x_stride, u0, units, v);
    load_tile<T, VEC, PACKS>(r + row * r_stride, u0, units, t);
    if (w != nullptr) load_params<T, VEC, PACKS>(w, u0, 0, units, held);
    add_store_residual<T, VEC, PACKS>(v, t, h + row * h_stride, u0, units);
  } else {
    load_tile<T, VEC, PACKS>(x + row * x_stride, u0, units, v);
    if (w != nullptr) load_params<T, VEC, PACKS>(w, u0, 0, units, held);
  }
  float ss[1] = {sum_squares<VEC, PACKS>(v)};
  block_sum_n<1>(ss, scratch);
  const float rstd = rsqrtf(ss[0] * inv_n + eps);
  if (rstd_out != nullptr && threadIdx.x == 0) rstd_out[row] = rstd;
  T* y_row = y + row * y_stride;
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
    const int u = u0 + p * static_cast<int>(blockDim.x);
    if (u < units) {
      scale_store_unit<T, VEC>(v[p], rstd, held[p], w != nullptr,
                               y_row + static_cast<long long>(u) * VEC);
    }
  }
}

// One row of a split launch in one pass (see layer_norm_split_row): `t` holds r of the current
// row on entry (kAdd) and is refilled with r of the next row.
template <class T, int VEC, int PACKS, bool kAdd>
__device__ __forceinline__ void rms_norm_split_row(
    float (&cur)[PACKS][VEC], float (&next)[PACKS][VEC], float (&t)[PACKS][VEC], long long row,
    long long next_row, const T* x, long long x_stride, const T* r, long long r_stride, T* y,
    long long y_stride, T* h, long long h_stride, const T* w, float* rstd_out, float* partials,
    unsigned* counters, long long rows, int C, int chunk, int u0, int units, float inv_n,
    float eps, float* scratch, unsigned* flag) {
  if (kAdd) add_store_residual<T, VEC, PACKS>(cur, t, h + row * h_stride, u0, units);
  float ss[1] = {sum_squares<VEC, PACKS>(cur)};
  block_sum_n<1>(ss, scratch);
  float* row_partials = partials + row * C;
  const unsigned before = split_arrive<1>(row_partials + chunk, ss, counters + row, flag);
  if (next_row < rows) {
    load_tile<T, VEC, PACKS>(x + next_row * x_stride, u0, units, next);
    if (kAdd) load_tile<T, VEC, PACKS>(r + next_row * r_stride, u0, units, t);
  }
  if (before == static_cast<unsigned>(C - 1)) {
    merge_row_rstd(row_partials, C, inv_n, eps, rstd_out + row, scratch);
    split_release(counters + row);
  }
  split_wait(counters + row, static_cast<unsigned>(C + 1));
  // (three row buffers live: w pack by pack)
  scale_store<T, VEC, PACKS, 1>(cur, load_cg(rstd_out + row), w, y + row * y_stride, u0, units);
}

// Split rows in one launch (C > 1, every block of the grid resident; arguments as rms_norm_fwd,
// with rstd_out required and `phase` ignored). Two register buffers alternate between the row
// being finished and the next row being loaded (and one for r, kAdd).
template <class T, int VEC, int PACKS, bool kAdd>
__global__ void __launch_bounds__(1024, 1)
rms_norm_split(const T* x, long long x_stride, const T* r, long long r_stride, T* y,
               long long y_stride, T* h, long long h_stride, const T* __restrict__ w,
               float* rstd_out, float* __restrict__ partials, unsigned* __restrict__ counters,
               long long rows, int n, int C, int phase, float eps) {
  pdl_start();
  __shared__ float scratch[32];
  __shared__ unsigned flag;
  const RowMap map(C);
  const int units = n / VEC;
  const int u0 = first_unit<PACKS>(map.chunk);
  const float inv_n = 1.0f / static_cast<float>(n);
  float va[PACKS][VEC], vb[PACKS][VEC], t[PACKS][VEC];
  long long row = map.first;
  if (row < rows) {
    load_tile<T, VEC, PACKS>(x + row * x_stride, u0, units, va);
    if (kAdd) load_tile<T, VEC, PACKS>(r + row * r_stride, u0, units, t);
  }
  while (row < rows) {
    rms_norm_split_row<T, VEC, PACKS, kAdd>(va, vb, t, row, row + map.step, x, x_stride, r,
                                            r_stride, y, y_stride, h, h_stride, w, rstd_out,
                                            partials, counters, rows, C, map.chunk, u0, units,
                                            inv_n, eps, scratch, &flag);
    row += map.step;
    if (row >= rows) break;
    rms_norm_split_row<T, VEC, PACKS, kAdd>(vb, va, t, row, row + map.step, x, x_stride, r,
                                            r_stride, y, y_stride, h, h_stride, w, rstd_out,
                                            partials, counters, rows, C, map.chunk, u0, units,
                                            inv_n, eps, scratch, &flag);
    row += map.step;
  }
}

// Split rows in one pass over memory, tiles held in a ring of shared memory (norms/norm_ring.cuh):
// the policy of ring_rows / ring2_rows for rms_norm (kAdd: add_rms_norm, h formed and stored as
// tiles land). A tile's partial is its sum of squares.
template <class T, int VEC, int PACKS, bool kAdd>
struct RmsNormRing : RingOutput<T, VEC, PACKS, false, (PACKS <= 4 ? PACKS : 4)> {
  using Elem = T;
  using R = RawUnit<T, VEC>;
  using Raw = typename R::type;
  static constexpr int kVec = VEC, kPacks = PACKS, K = 1, kWords = 1, kPollBatch = 2;
  static constexpr bool kPrefetch = true;    // w loads issued before the poll (ring2)
  using Acc = float;
  const T* x;
  long long xs;
  const T* r;
  long long rs;
  T* h;
  long long hs;
  RawTile<T, VEC, PACKS> xt;
  RawTile<T, VEC, kAdd ? PACKS : 1> rt;

  __device__ __forceinline__ RmsNormRing(const T* x_, long long xs_, const T* r_, long long rs_,
                                         T* y_, long long ys_, T* h_, long long hs_, const T* w_,
                                         float* rstd_, int n, float eps_) {
    x = x_;
    xs = xs_;
    r = r_;
    rs = rs_;
    this->y = y_;
    this->ys = ys_;
    h = h_;
    hs = hs_;
    this->w = w_;
    this->b = nullptr;
    this->mean = nullptr;
    this->rstd = rstd_;
    this->inv_n = 1.0f / static_cast<float>(n);
    this->eps = eps_;
  }

  __device__ __forceinline__ void issue(long long row, int u0, int units) {
    xt.load(x + row * xs, u0, units);
    if (kAdd) rt.load(r + row * rs, u0, units);
  }

  // resident (not kAdd): the copies into the slot (per thread), or the row's start (bulk).
  __device__ __forceinline__ const T* row_ptr(long long row) const { return x + row * xs; }
  __device__ __forceinline__ void issue_async(Raw* slot, long long row, int u0, int units) {
    static_assert(!kAdd, "resident: rms_norm only");
    ring_copy_async<T, VEC, PACKS>(slot, x + row * xs, u0, units);
  }

  // A held tile's sum of squares: from its slot (units past the row's end skipped: a bulk
  // copy leaves them stale), or (kRegs) from xt (zeros there).
  template <bool kRegs>
  __device__ __forceinline__ void partial(const Raw* src, int u0, int units,
                                          float (&part)[1]) const {
    float ss = 0.0f;
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      if (!kRegs && u0 + p * static_cast<int>(blockDim.x) >= units) continue;
      float f[VEC];
      R::unpack(src[kRegs ? p : p * blockDim.x], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) ss = fmaf(f[j], f[j], ss);
    }
    part[0] = ss;
  }

  __device__ __forceinline__ void land(Raw* slot, long long row, int u0, int units,
                                       float (&part)[1]) {
    float ss = 0.0f;
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
      float f[VEC];
      Raw keep = xt.u[p];
      R::unpack(keep, f);
      if (kAdd) {                      // h = x + r, rounded to T: stored, held, normalized
        float g[VEC];
        R::unpack(rt.u[kAdd ? p : 0], g);
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] += g[j];
        keep = R::pack(f);
        R::unpack(keep, f);
        const int unit = u0 + p * static_cast<int>(blockDim.x);
        if (unit < units) R::store(h + row * hs + static_cast<long long>(unit) * VEC, keep);
      }
      slot[p * blockDim.x] = keep;
#pragma unroll
      for (int j = 0; j < VEC; ++j) ss = fmaf(f[j], f[j], ss);   // past the end: 0
    }
    part[0] = ss;
  }

  __device__ __forceinline__ void reduce(float (&part)[1], float* scratch, bool = false) {
    block_sum_n<1>(part, scratch);
  }

  // ring: the row's last block sums the partials and stores rstd; drains read it.
  __device__ __forceinline__ void merge(const float* row_partials, int C, long long row,
                                        float* scratch) {
    merge_row_rstd(row_partials, C, this->inv_n, this->eps, this->rstd + row, scratch);
  }
  __device__ __forceinline__ void load_stats(long long row, float& mu, float& s) const {
    mu = 0.0f;
    s = load_cg(this->rstd + row);
  }

  // ring2: every warp sums the row's published sums itself.
  __device__ __forceinline__ void words(const float (&part)[1], float (&v)[1]) const {
    v[0] = part[0];
  }
  static __device__ __forceinline__ Acc acc_zero() { return 0.0f; }
  __device__ __forceinline__ Acc acc_add(Acc a, const float (&v)[1], float) const {
    return a + v[0];
  }
  static __device__ __forceinline__ Acc acc_warp(Acc a) { return warp_sum(a); }
  __device__ __forceinline__ void stats(Acc ss, float& mu, float& s) const {
    mu = 0.0f;
    s = rsqrtf(ss * this->inv_n + this->eps);
  }
  __device__ __forceinline__ void write_stats(long long row, float, float s) const {
    if (this->rstd != nullptr) this->rstd[row] = s;
  }
};

// Split rows, one pass (arguments as rms_norm_fwd; rstd_out required; C tiles of blockDim.x *
// PACKS units per row, D ring slots in the dynamic shared memory of kRingHeaderBytes + D *
// blockDim.x * PACKS * sizeof(unit) bytes). Every block of the grid must be resident at once.
template <class T, int VEC, int PACKS, bool kAdd>
__global__ void __launch_bounds__(512, GPUOPS_RING_MIN_BLOCKS)
rms_norm_ring(const T* x, long long x_stride, const T* r, long long r_stride, T* y,
              long long y_stride, T* h, long long h_stride, const T* __restrict__ w,
              float* rstd_out, float* __restrict__ partials, unsigned* __restrict__ counters,
              long long rows, int n, int C, int D, float eps) {
  pdl_start();
  extern __shared__ uint4 ring_smem[];
  RmsNormRing<T, VEC, PACKS, kAdd> pol(x, x_stride, r, r_stride, y, y_stride, h, h_stride, w,
                                       rstd_out, n, eps);
  ring_rows(pol, rows, n / VEC, C, D, partials, counters,
            reinterpret_cast<unsigned char*>(ring_smem));
}

// The same with ring2's exchange (norm_ring.cuh): rstd_out may be null; `state`: the host's
// per-stream ring2 state (launch counter, exit counter, rows * C words), zeroed once.
template <class T, int VEC, int PACKS, bool kAdd>
__global__ void __launch_bounds__(512, GPUOPS_RING_MIN_BLOCKS)
rms_norm_ring2(const T* x, long long x_stride, const T* r, long long r_stride, T* y,
               long long y_stride, T* h, long long h_stride, const T* __restrict__ w,
               float* rstd_out, unsigned* state, long long rows, int n, int C, int D,
               float eps) {
  pdl_start();
  extern __shared__ uint4 ring_smem[];
  RmsNormRing<T, VEC, PACKS, kAdd> pol(x, x_stride, r, r_stride, y, y_stride, h, h_stride, w,
                                       rstd_out, n, eps);
  ring2_rows<RmsNormRing<T, VEC, PACKS, kAdd>::kPollBatch>(
      pol, rows, n / VEC, C, D, state, reinterpret_cast<unsigned char*>(ring_smem));
}

// Split rows with every tile of a block held at once (norm_ring.cuh, "resident"; 16-byte units,
// sm_80+ for speed): arguments as rms_norm_ring2 (r, h unused: no kAdd); D slots of shared memory
// as the ring's, and gridDim.x * (D + 1) >= rows * C. One block of 512 threads per SM.
template <class T, int VEC, int PACKS>
__global__ void __launch_bounds__(512, 1)
rms_norm_resident(const T* x, long long x_stride, const T* r, long long r_stride, T* y,
                  long long y_stride, T* h, long long h_stride, const T* __restrict__ w,
                  float* rstd_out, unsigned* state, long long rows, int n, int C, int D,
                  float eps) {
  pdl_start();
  extern __shared__ uint4 ring_smem[];
  RmsNormRing<T, VEC, PACKS, false> pol(x, x_stride, r, r_stride, y, y_stride, h, h_stride, w,
                                        rstd_out, n, eps);
  resident_rows<RmsNormRing<T, VEC, PACKS, false>::kPollBatch>(
      pol, rows, n / VEC, C, D, state, reinterpret_cast<unsigned char*>(ring_smem));
}

// rms_norm's (kAdd: add_rms_norm's) rows for stream_rows (norms/norm_stream.cuh): w (when given)
// in shared memory; a stage holds x's row, then (kAdd) r's. kAdd: h = x + r rounded to T is
// stored and written back over x's units of the stage, and the statistics use it as stored (as
// rms_norm_fwd); y = v * rstd * w as scale_store_unit.
template <class T, int VEC, bool kAdd>
struct RmsNormStream {
  static constexpr int kParams = 1;
  static constexpr int kSources = kAdd ? 2 : 1;
  using R = RawUnit<T, VEC>;
  const T* x;
  long long x_stride;
  const T* r;
  long long r_stride;
  T* y;
  long long y_stride;
  T* h;
  long long h_stride;
  const T* w;
  float* rstd_out;
  float inv_n, eps;

  __device__ __forceinline__ void load_params(uint4* smem, int units) const {
    stream_params<T, VEC>(smem, w, units);
  }
  __device__ __forceinline__ void issue(uint4* stage, long long row, const StreamTeam& team,
                                        int units) const {
    stream_issue_row<T, VEC>(stage, x + row * x_stride, team.lane, team.size, units);
    if (kAdd)
      stream_issue_row<T, VEC>(stage + units, r + row * r_stride, team.lane, team.size, units);
  }
  __device__ __forceinline__ void work(uint4* stage, const uint4* params, long long row,
                                       StreamTeam& team, int units) const {
    float acc[VEC] = {};
    T* h_row = kAdd ? h + row * h_stride : nullptr;
#pragma unroll 4
    for (int u = team.lane; u < units; u += team.size) {
      float f[VEC];
      R::unpack(stage[u], f);
      if (kAdd) {
        float t[VEC];
        R::unpack(stage[units + u], t);
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] += t[j];
        const uint4 rounded = R::pack(f);
        store16(h_row + static_cast<long long>(u) * VEC, rounded);
        stage[u] = rounded;
        R::unpack(rounded, f);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] = fmaf(f[j], f[j], acc[j]);
    }
    const float rstd = rsqrtf(team.sum(sum_lanes<VEC>(acc)) * inv_n + eps);
    if (rstd_out != nullptr && team.lane == 0) rstd_out[row] = rstd;
    T* y_row = y + row * y_stride;
#pragma unroll 4
    for (int u = team.lane; u < units; u += team.size) {
      float f[VEC];
      R::unpack(stage[u], f);
      scale_store_unit<T, VEC>(f, rstd, params[u], w != nullptr,
                               y_row + static_cast<long long>(u) * VEC);
    }
  }
};

// Whole rows streamed through shared memory, a team of `team` warps per row (norms/
// norm_stream.cuh; 16-byte units, n >= VEC): arguments as rms_norm_fwd's without the split-row
// ones; blockDim.x / 32 / team teams (at most 15 when team > 1), D stages each: (1 + teams * D *
// (kAdd ? 2 : 1)) * n / VEC * 16 bytes of dynamic shared memory, plus 8 * team * teams when
// team > 1, rounded up to 16. Any grid.
template <class T, int VEC, bool kAdd>
__global__ void __launch_bounds__(512, 1)
rms_norm_stream(const T* x, long long x_stride, const T* r, long long r_stride, T* y,
                long long y_stride, T* h, long long h_stride, const T* __restrict__ w,
                float* rstd_out, long long rows, int n, int D, int team, float eps) {
  static_assert(VEC > 1, "16-byte units");
  pdl_start();
  extern __shared__ uint4 ring_smem[];
  const RmsNormStream<T, VEC, kAdd> pol{x, x_stride, r, r_stride, y, y_stride, h, h_stride, w,
                                        rstd_out, 1.0f / static_cast<float>(n), eps};
  stream_rows(pol, rows, n / VEC, D, team, ring_smem);
}

}  // namespace gpuops
