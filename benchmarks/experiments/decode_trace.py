"""Where a decode-sized RMSNorm call spends its time (benchmarks/NOTES.md, "Run 73": gpuops'
rms_norm body is ~0.75 us past a copy of the same bytes, Liger's ~0.3).

fp32 [16, 2048] with a weight, one block per row. Probe kernels (NVRTC through cupy.RawModule,
launched by gpuops' Kernel.launch) of the same structure as rms_norm_fwd, each in variants:
  late_256x2   256 threads x 2 float4, w read after the block reduction (rms_norm_fwd's order)
  ahead_256x2  w read with x, before the reduction (Liger's order)
  late_128x4   128 threads x 4 float4 (4 warps in the block reduction instead of 8)
  late_512x1   512 threads x 1 float4
  warp_32x16   one warp per row, 16 float4 per lane: shuffles only, no shared memory, no barrier
For each: CUPTI body and graph-chain time per call (50 calls), against gpuops' rms_norm and
Liger's (and a plain copy of the bytes) in the same run. Then a traced launch of each probe: thread
0 of every block writes clock64 deltas between entry, x landed (its squares summed), the block
reduction done, w landed (y computed) and the stores issued, plus %globaltimer at entry and exit;
medians over blocks and launches, in SM cycles (and the block start spread in ns).
Then the same for probes built from gpuops' own code (cuda_src/norms/rms_norm.cu included, fp32,
256 threads x 2 float4 as rms_norm_fwd runs at this shape): the real rms_norm_fwd kernel launched
directly, and its steps in order with stamps between them (pdl_start, the row loop, load_tile,
sum_squares, block_sum_n, the rstd store, scale_store), alone and with one change each: no
pdl_start, w loaded before the row (held), the block reduction's second stage done by every thread
reading the warps' partials from shared memory (no second shuffle chain).

    python benchmarks/experiments/decode_trace.py [--json F]
"""
from __future__ import annotations

import argparse
import sys

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import cupy  # noqa: E402
import torch  # noqa: E402

import gpuops as go  # noqa: E402
from gpuops.bench import graph_and_body_rows, write_experiment_json  # noqa: E402
from gpuops.runtime.launch import ArgSpec, Kernel  # noqa: E402

ROWS, N = 16, 2048
UNITS = N // 4
EPS = 1e-6
CALLS, REPLAYS, ROUNDS, TRACES = 50, 20, 3, 20
STAMPS = 8          # per block: g_entry, d_load, d_reduce, d_weight, d_store, g_exit, smid, 0

SRC = r"""
__device__ __forceinline__ long long clk() { return clock64(); }
__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
// keeps v computed before the next clock read (an empty volatile asm that consumes it)
__device__ __forceinline__ void after(float v) { asm volatile("" :: "f"(v)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int PACKS, bool AHEAD>
__device__ __forceinline__ void rms_probe(const float4* __restrict__ x, const float4* __restrict__ w,
                                          float4* __restrict__ y, int units, float eps,
                                          long long* __restrict__ trace) {
  __shared__ float scratch[32];
  const unsigned long long g0 = gtime();
  const long long c0 = clk();
  const long long row = blockIdx.x;
  const float4* xr = x + row * units;
  float4* yr = y + row * units;
  float4 v[PACKS], wv[PACKS];
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
    const int u = threadIdx.x + p * blockDim.x;
    v[p] = u < units ? xr[u] : make_float4(0.f, 0.f, 0.f, 0.f);
    if (AHEAD) wv[p] = u < units ? w[u] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float ss = 0.0f;
#pragma unroll
  for (int p = 0; p < PACKS; ++p)
    ss += v[p].x * v[p].x + v[p].y * v[p].y + v[p].z * v[p].z + v[p].w * v[p].w;
  after(ss);
  const long long c1 = clk();
  ss = warp_sum(ss);
  if (blockDim.x > 32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) scratch[warp] = ss;
    __syncthreads();
    ss = lane < (blockDim.x >> 5) ? scratch[lane] : 0.0f;
    ss = warp_sum(ss);
  }
  after(ss);
  const long long c2 = clk();
  const float rstd = rsqrtf(ss / (4.0f * units) + eps);
  float last = 0.0f;
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
    const int u = threadIdx.x + p * blockDim.x;
    if (!AHEAD) wv[p] = u < units ? w[u] : make_float4(0.f, 0.f, 0.f, 0.f);
    v[p] = make_float4(v[p].x * rstd * wv[p].x, v[p].y * rstd * wv[p].y,
                       v[p].z * rstd * wv[p].z, v[p].w * rstd * wv[p].w);
    last += v[p].w;
  }
  after(last);
  const long long c3 = clk();
#pragma unroll
  for (int p = 0; p < PACKS; ++p) {
    const int u = threadIdx.x + p * blockDim.x;
    if (u < units) yr[u] = v[p];
  }
  const long long c4 = clk();
  if (trace != nullptr && threadIdx.x == 0) {
    long long* t = trace + row * 8;
    t[0] = static_cast<long long>(g0);
    t[1] = c1 - c0;
    t[2] = c2 - c1;
    t[3] = c3 - c2;
    t[4] = c4 - c3;
    t[5] = static_cast<long long>(gtime());
    t[6] = smid();
  }
}

#define PROBE(NAME, PACKS, AHEAD)                                                            \
  extern "C" __global__ void NAME(const float4* x, const float4* w, float4* y, int units,    \
                                  float eps, long long* trace) {                             \
    rms_probe<PACKS, AHEAD>(x, w, y, units, eps, trace);                                     \
  }
PROBE(late_256x2, 2, false)
PROBE(ahead_256x2, 2, true)
PROBE(late_128x4, 4, false)
PROBE(late_512x1, 1, false)
PROBE(warp_32x16, 16, false)

extern "C" __global__ void copy4(const float4* __restrict__ x, float4* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i];
}
"""
OURS_SRC = r"""
#include "norms/rms_norm.cu"
namespace gpuops {
__device__ __forceinline__ long long oclk() { return clock64(); }
__device__ __forceinline__ void oafter(float v) { asm volatile("" :: "f"(v)); }

// block_sum_n without its second shuffle chain: after the barrier every thread adds the warps'
// partials itself (broadcast shared-memory reads), in warp order.
template <int K>
__device__ __forceinline__ void block_sum_lds(float (&v)[K], float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  warp_sum_n<K>(v);
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) scratch[32 * k + warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float t = 0.0f;
    for (int i = 0; i < warps; ++i) t += scratch[32 * k + i];
    v[k] = t;
  }
}

template <bool kPdl, bool kAhead, bool kLds>
__device__ __forceinline__ void ours_steps(const float* x, const float* w, float* y,
                                           float* rstd_out, long long rows, int n, float eps,
                                           long long* trace) {
  const long long c0 = oclk();
  if (kPdl) pdl_start();
  const long long c1 = oclk();
  __shared__ float scratch[32];
  const RowMap map(1, false);
  const int units = n / 4;
  const int u0 = first_unit<2>(map.chunk);
  const float inv_n = 1.0f / static_cast<float>(n);
  typename RawUnit<float, 4>::type held[2];
  if (kAhead) load_params<float, 4, 2>(w, u0, 0, units, held);
  long long c2 = 0, c3 = 0, c4 = 0;
  for (long long row = map.first; row < rows; row += map.step) {
    float v[2][4];
    load_tile<float, 4, 2>(x + row * n, u0, units, v);
    float ss[1] = {sum_squares<4, 2>(v)};
    oafter(ss[0]);
    c2 = oclk();
    if (kLds) block_sum_lds<1>(ss, scratch);
    else block_sum_n<1>(ss, scratch);
    oafter(ss[0]);
    c3 = oclk();
    const float rstd = rsqrtf(ss[0] * inv_n + eps);
    if (rstd_out != nullptr && threadIdx.x == 0) rstd_out[row] = rstd;
    if (kAhead) {
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        float wv[4];
        RawUnit<float, 4>::unpack(held[p], wv);
#pragma unroll
        for (int j = 0; j < 4; ++j) v[p][j] = v[p][j] * rstd * wv[j];
        const int u = u0 + p * static_cast<int>(blockDim.x);
        if (u < units) Unit<float, 4>::store(y + row * n + static_cast<long long>(u) * 4, v[p]);
      }
    } else {
      scale_store<float, 4, 2>(v, rstd, w, y + row * n, u0, units);
    }
    c4 = oclk();
  }
  if (trace != nullptr && threadIdx.x == 0) {
    long long* t = trace + static_cast<long long>(blockIdx.x) * 8;
    t[0] = 0;
    t[1] = c1 - c0;     // pdl_start
    t[2] = c2 - c1;     // x landed (its squares summed)
    t[3] = c3 - c2;     // block reduction
    t[4] = c4 - c3;     // rstd, w, y computed and stored
    t[5] = c4 - c0;
  }
}
}  // namespace gpuops

#define OURS(NAME, PDL, AHEAD, LDS)                                                          \
  extern "C" __global__ void __launch_bounds__(1024, 1)                                      \
  NAME(const float* x, const float* w, float* y, float* rstd, long long rows, int n,         \
       float eps, long long* trace) {                                                        \
    gpuops::ours_steps<PDL, AHEAD, LDS>(x, w, y, rstd, rows, n, eps, trace);                 \
  }
OURS(ours_steps, true, false, false)
OURS(ours_no_pdl, false, false, false)
OURS(ours_w_ahead, true, true, false)
OURS(ours_lds_reduce, true, false, true)
OURS(ours_ahead_lds, true, true, true)
"""
OURS_PROBES = ("ours_steps", "ours_no_pdl", "ours_w_ahead", "ours_lds_reduce", "ours_ahead_lds")
REAL = "gpuops::rms_norm_fwd<float, 4, 2, false>"
PROBES = {"late_256x2": 256, "ahead_256x2": 256, "late_128x4": 128, "late_512x1": 512,
          "warp_32x16": 32}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    x = torch.randn(ROWS, N, device="cuda")
    w = torch.randn(N, device="cuda")
    y = torch.empty_like(x)
    trace = torch.zeros(ROWS, STAMPS, dtype=torch.int64, device="cuda")
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",), backend="nvrtc")
    spec = ArgSpec("ptr", "ptr", "ptr", "i32", "f32", "ptr")
    kernels = {n: Kernel(n, mod.get_function(n), spec) for n in PROBES}
    copy4 = Kernel("copy4", mod.get_function("copy4"), ArgSpec("ptr", "ptr", "i32"))
    root = __file__.rsplit("/benchmarks/", 1)[0]
    omod = cupy.RawModule(code=OURS_SRC, options=("-std=c++17", f"-I{root}/cuda_src"),
                          backend="nvrtc", name_expressions=[REAL])
    ospec = ArgSpec("ptr", "ptr", "ptr", "ptr", "i64", "i32", "f32", "ptr")
    ours = {n: Kernel(n, omod.get_function(n), ospec) for n in OURS_PROBES}
    # rms_norm_fwd(x, xs, r, rs, y, ys, h, hs, w, rstd, partials, counters, rows, n, C, phase, eps)
    real = Kernel("rms_norm_fwd", omod.get_function(REAL),
                  ArgSpec("ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "ptr",
                          "ptr", "ptr", "i64", "i32", "i32", "i32", "f32"))
    rstd = torch.empty(ROWS, device="cuda")

    def stream():
        return torch.cuda.current_stream().cuda_stream

    def probe(name, traced=False):
        return lambda: kernels[name].launch((ROWS, 1, 1), (PROBES[name], 1, 1), stream(),
                                            x.data_ptr(), w.data_ptr(), y.data_ptr(), UNITS,
                                            EPS, trace.data_ptr() if traced else 0)

    def ours_probe(name, traced=False):
        return lambda: ours[name].launch((ROWS, 1, 1), (256, 1, 1), stream(), x.data_ptr(),
                                         w.data_ptr(), y.data_ptr(), rstd.data_ptr(), ROWS, N,
                                         EPS, trace.data_ptr() if traced else 0)

    def real_fwd():
        real.launch((ROWS, 1, 1), (256, 1, 1), stream(), x.data_ptr(), N, 0, 0, y.data_ptr(), N,
                    0, 0, w.data_ptr(), rstd.data_ptr(), 0, 0, ROWS, N, 1, 0, EPS)

    ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS)
           * w.double())
    errors = {}
    for name in PROBES:
        y.fill_(float("nan"))
        probe(name)()
        torch.cuda.synchronize()
        errors[name] = float((y.double() - ref).abs().max())
    for name, fn in [(n, ours_probe(n)) for n in OURS_PROBES] + [("rms_norm_fwd direct", real_fwd)]:
        y.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        errors[name] = float((y.double() - ref).abs().max())
    print("probe max abs err vs float64:", {k: f"{v:.1e}" for k, v in errors.items()})
    variants = {f"probe {n}": probe(n) for n in PROBES}
    variants.update({f"probe {n}": ours_probe(n) for n in OURS_PROBES})
    variants["rms_norm_fwd direct"] = real_fwd
    variants["copy (probe)"] = lambda: copy4.launch((ROWS * UNITS // 256, 1, 1), (256, 1, 1),
                                                    stream(), x.data_ptr(), y.data_ptr(),
                                                    ROWS * UNITS)
    variants["gpuops rms_norm"] = lambda: go.rms_norm(x, (N,), w, eps=EPS)
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction  # noqa: PLC0415
        variants["liger rms_norm"] = lambda: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama",
                                                                        False)
    except ImportError:
        pass
    print(f"{torch.cuda.get_device_name()}; fp32 [{ROWS}, {N}] with weight; us per call "
          f"(graph: chain of {CALLS}, median of {ROUNDS} x {REPLAYS}; body: CUPTI)")
    rows = graph_and_body_rows(variants, calls=CALLS, replays=REPLAYS, rounds=ROUNDS, width=22)
    print("traced probes (thread 0 of each block; SM cycles, median over blocks x launches): "
          "load / reduce / weight+scale / store issue; block start spread and duration in ns")
    def traced(launch):
        """[TRACES, ROWS, STAMPS] float64: the trace buffer after each of TRACES launches."""
        samples = []
        for _ in range(TRACES):
            trace.zero_()
            launch()
            torch.cuda.synchronize()
            samples.append(trace.cpu())
        return torch.stack(samples).double()

    for name in PROBES:
        t = traced(probe(name, traced=True))
        med = {k: float(t[:, :, i].median()) for i, k in
               ((1, "load_cyc"), (2, "reduce_cyc"), (3, "weight_cyc"), (4, "store_cyc"))}
        spread = float((t[:, :, 0].amax(1) - t[:, :, 0].amin(1)).median())
        duration = float((t[:, :, 5] - t[:, :, 0]).median())
        sms = int(t[0, :, 6].unique().numel())
        rows.append({"variant": f"trace {name}", **med, "start_spread_ns": spread,
                     "block_ns": duration, "distinct_sms": sms})
        print(f"{name:<14} load {med['load_cyc']:6.0f}  reduce {med['reduce_cyc']:5.0f}  "
              f"weight {med['weight_cyc']:5.0f}  store {med['store_cyc']:4.0f}  | start spread "
              f"{spread:5.0f} ns, block {duration:5.0f} ns, {sms} SMs", flush=True)
    print("traced probes of gpuops' code (SM cycles, medians): pdl_start / x landed / block "
          "reduction / rstd+w+y stored / total")
    for name in OURS_PROBES:
        t = traced(ours_probe(name, traced=True))
        med = {k: float(t[:, :, i].median()) for i, k in
               ((1, "pdl_cyc"), (2, "load_cyc"), (3, "reduce_cyc"), (4, "weight_store_cyc"),
                (5, "total_cyc"))}
        rows.append({"variant": f"trace {name}", **med})
        print(f"{name:<16} pdl {med['pdl_cyc']:5.0f}  load {med['load_cyc']:5.0f}  reduce "
              f"{med['reduce_cyc']:5.0f}  w+store {med['weight_store_cyc']:5.0f}  total "
              f"{med['total_cyc']:5.0f}", flush=True)
    if a.json:
        write_experiment_json(a.json, None, rows, calls=CALLS, replays=REPLAYS, rounds=ROUNDS,
                              probe_errors=errors)


if __name__ == "__main__":
    main()
