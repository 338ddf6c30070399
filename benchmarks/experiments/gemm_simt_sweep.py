"""Issue 4's two open GEMM gaps, measured in one run (< ~4 min on an H100):

1. fp32 SIMT `warp_tiled`: every tile configuration of gpuops.ops.gemm.WARP_TILED_CONFIGS
   (PLAN['warp_tiled']) at 4096^3, 2048^3 and 8192x8192x4096, against cuBLAS fp32 through
   torch.matmul with TF32 off, in the same run. Each configuration's result is checked against
   torch first (max relative error printed; a wrong one is not timed). Target: >= 90% of cuBLAS.
2. Decode GEMMs (bf16 `linear`, M = 1, 2, 4, 8, 16, weights [N, K] = [6144, 2048], [2048, 6144],
   [151936, 2048]; --decode-shapes): every variant of --plans and torch F.linear, each as a CUDA graph of
   20 calls over 20 different weights and inputs (rotated: 20 x 25 MB >> the 50 MB L2), checked
   against torch first. Reported: the bytes that must move (weight + x + out) per second, as % of
   the device-to-device copy bandwidth of a 1 GiB copy (pct_copy: issue 4's measure, target >= 85%)
   and as % of a graph of 20 copies of the same weight bytes (pct_copy_same: what a copy reaches
   with the same per-launch costs), and per plan the fixed cost per call and the streaming
   bandwidth fitted over the three weight sizes (t = fixed + bytes / bandwidth).
3. SwiGLU decode (--parts swiglu): swiglu_linear against torch's silu(linear) * linear, the same
   graphs over rotated weight pairs.

    python3 benchmarks/experiments/gemm_simt_sweep.py [--json PATH] [--parts gemm,decode,swiglu]
        [--configs base,k16] [--plans balanced,pipe]

Floors and predictions: benchmarks/notes_gemm.md ("warp_tiled configurations", "Decode GEMV").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402,N812

import gpuops as go  # noqa: E402
from gpuops.bench import capture_graph, events_ms  # noqa: E402
from gpuops.ops import gemm as G  # noqa: E402
from gpuops.runtime import config  # noqa: E402

ROWS: list = []
FAILURES: dict = {}
GEMM_SHAPES = ((4096, 4096, 4096), (2048, 2048, 2048), (8192, 8192, 4096))
DECODE_SHAPES = ((6144, 2048), (2048, 6144), (151936, 2048))   # weight [N, K]
DECODE_M = (1, 2, 4, 8, 16)
GRAPH_CALLS = 20
# max |out - ref| / max |ref| a configuration may show before it counts as wrong (fp32 SIMT
# against cuBLAS fp32: ~1e-6 at K = 4096; bf16 outputs: rounding 2^-8 of the largest value)
GEMM_TOL, DECODE_TOL = 1e-4, 1.5e-2


def time_ms(fn, budget_s=0.6, min_iters=3, max_iters=100):
    return events_ms(fn, budget_s, min_iters, max_iters)


def graph_ms_per_call(fn, calls):
    """ms per call of a CUDA graph of `calls` calls (fn makes all of them), replays timed."""
    graph = capture_graph(fn, calls=1, warmup=2)
    ms = time_ms(graph.replay, budget_s=0.4) / calls
    del graph
    return ms


def record(part, name, shape, ms, **extra):
    row = {"part": part, "name": name, "shape": list(shape), "ms": ms, **extra}
    ROWS.append(row)
    ex = "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in extra.items())
    print(f"  {name:<26}{'x'.join(map(str, shape)):<18}{ms * 1e3:10.1f} us  {ex}", flush=True)
    return row


class plan_set:   # noqa: N801
    """gpuops.ops.gemm.PLAN[key] = value for a block (read when a call is made or captured)."""

    def __init__(self, key, value):
        self.key, self.value = key, value

    def __enter__(self):
        self.old = G.PLAN[self.key]
        G.PLAN[self.key] = self.value

    def __exit__(self, *exc):
        G.PLAN[self.key] = self.old


class decode_variant:   # noqa: N801
    """A decode variant 'PLAN[+pdl][+prefetch[N]][+aN|+aauto][+rN][+sN][+tN][+cNT.U.MINB][+gKEY]':
    PLAN['decode'] = PLAN; GPUOPS_PDL on with '+pdl' (else off); PLAN['gemv_l2_prefetch'] True
    with '+prefetch', N bytes per row with '+prefetchN' (else off); PLAN['gemv_ahead'] = N or
    'auto' with '+aN' / '+aauto' (else 0); PLAN['gemv_rows'] = N (8, 16, 32) with '+rN' (else
    'auto'); PLAN['gemv_simt_max_m'] = N with '+sN' (else 1); '+tN': the pipe plans' single-weight
    configurations cut to those of NT = N (their plan then picks among those only); '+cNT.U.MINB':
    cut to that one configuration; '+gKEY': PLAN['gemv_tma'] = KEY ('tma' only); '+kN':
    PLAN['gemv_tma_split'] = N (1 or a GEMV_TMA_SPLITS entry: the blocks of a cluster that
    split K; else 'auto')."""

    def __init__(self, spec):
        plan, *opts = spec.split("+")
        self.plan, self.pdl, self.prefetch, self.ahead, self.rows = plan, False, False, 0, "auto"
        self.simt, self.nt, self.cfg, self.tma = 1, None, None, G.PLAN["gemv_tma"]
        self.split = "auto"
        ok = plan in G.DECODE_PLANS
        for o in opts:
            if o == "pdl":
                self.pdl = True
            elif o.startswith("prefetch"):
                self.prefetch = int(o[8:]) if o[8:].isdigit() else (o == "prefetch")
                ok = ok and self.prefetch is not False
            elif o == "aauto":
                self.ahead = "auto"
            elif o[:1] == "a" and o[1:].isdigit() and int(o[1:]) in G.GEMV_MMA_AHEAD:
                self.ahead = int(o[1:])
            elif o[:1] == "r" and o[1:] in ("8", "16", "32"):
                self.rows = int(o[1:])
            elif o[:1] == "s" and o[1:].isdigit() and 1 <= int(o[1:]) <= 16:
                self.simt = int(o[1:])
            elif o[:1] == "t" and o[1:].isdigit() and plan in G.GEMV_PIPE and any(
                    c[0] == int(o[1:]) for c in G.GEMV_PIPE[plan][False]):
                self.nt = int(o[1:])
            elif o[:1] == "g" and o[1:] in G.GEMV_TMA_CONFIGS and plan == "tma":
                self.tma = o[1:]
            elif o[:1] == "k" and o[1:].isdigit() and int(o[1:]) in (1, *G.GEMV_TMA_SPLITS):
                self.split = int(o[1:])
            elif o[:1] == "c" and plan in G.GEMV_PIPE and tuple(
                    int(v) for v in o[1:].split(".") if v.isdigit()) in G.GEMV_PIPE[plan][False]:
                self.cfg = tuple(int(v) for v in o[1:].split("."))
            else:
                ok = False
        if not ok:
            raise SystemExit(f"bad decode variant {spec!r}: PLAN[+pdl][+prefetch[N]][+aN|+aauto]"
                             f"[+rN][+sN][+tN], PLAN in {G.DECODE_PLANS}, N in {G.GEMV_MMA_AHEAD} "
                             "for a, 8 / 16 / 32 for r, 1..16 for s, a pipe plan's NT for t, its "
                             "NT.U.MINB for c, a GEMV_TMA_CONFIGS key for g, 1 or a GEMV_TMA_SPLITS for k")

    def __enter__(self):
        self.old = (dict(G.PLAN), os.environ.get("GPUOPS_PDL"))
        self.old_pipe = {k: dict(v) for k, v in G.GEMV_PIPE.items()}
        if self.nt is not None or self.cfg is not None:
            G.GEMV_PIPE[self.plan][False] = tuple(
                c for c in G.GEMV_PIPE[self.plan][False]
                if (self.nt is None or c[0] == self.nt) and (self.cfg is None or c == self.cfg))
        G.PLAN["decode"], G.PLAN["gemv_l2_prefetch"] = self.plan, self.prefetch
        G.PLAN["gemv_ahead"], G.PLAN["gemv_rows"] = self.ahead, self.rows
        G.PLAN["gemv_simt_max_m"] = self.simt
        G.PLAN["gemv_tma"], G.PLAN["gemv_tma_split"] = self.tma, self.split
        os.environ["GPUOPS_PDL"] = "1" if self.pdl else "0"
        config.refresh()

    def __exit__(self, *exc):
        G.PLAN.clear()
        G.PLAN.update(self.old[0])
        for k, v in self.old_pipe.items():
            G.GEMV_PIPE[k].update(v)
        if self.old[1] is None:
            os.environ.pop("GPUOPS_PDL", None)
        else:
            os.environ["GPUOPS_PDL"] = self.old[1]
        config.refresh()


def rel_err(out, ref):
    ref = ref.double()
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------- part 1: GEMM

def gemm_part(configs):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for M, N, K in GEMM_SHAPES:
        print(f"\n== warp_tiled fp32 {M}x{N}x{K} vs cuBLAS fp32 (TF32 off) ==", flush=True)
        a = torch.randn(M, K, device="cuda")
        b = torch.randn(K, N, device="cuda")
        flops = 2.0 * M * N * K
        ref = torch.matmul(a, b)
        peer = time_ms(lambda: torch.matmul(a, b))
        record("gemm", "cublas fp32", (M, N, K), peer, tflops=flops / peer / 1e9)
        for name in configs:
            with plan_set("warp_tiled", name):
                try:
                    out = go.matmul(a, b, variant="warp_tiled")
                    err = rel_err(out, ref)
                    if not err <= GEMM_TOL:
                        raise AssertionError(f"max rel err {err:.3g} > {GEMM_TOL}")
                    ms = time_ms(lambda: go.matmul(a, b, variant="warp_tiled"))
                except Exception as exc:  # report, go on with the other configurations
                    FAILURES[f"gemm {name} {M}x{N}x{K}"] = f"{type(exc).__name__}: {exc}"[:300]
                    print(f"  {name:<26}FAILED: {FAILURES[f'gemm {name} {M}x{N}x{K}']}", flush=True)
                    continue
            record("gemm", f"warp_tiled [{name}]", (M, N, K), ms, tflops=flops / ms / 1e9,
                   pct_cublas=100.0 * peer / ms, max_rel_err=err, config=name,
                   tile=list(G.WARP_TILED_CONFIGS[name]))
        del a, b, ref
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- part 2: decode

def copy_gbps():
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * n / (ms * 1e-3) / 1e9


def launched_kernels(first):
    """first()'s result and the kernel expressions gpuops fetched to run it (for the record: the
    labels follow _launch_gemv's rules by construction)."""
    got, get = [], G._kernels.get

    def recording(module, expr, dev):
        got.append(expr.replace("gpuops::gemm::", ""))
        return get(module, expr, dev)

    G._kernels.get = recording
    try:
        return first(), " + ".join(got)
    finally:
        G._kernels.get = get


def checked_ms(key, plan, first, all_calls, ref):
    """(max relative error of first() against ref, ms per call of a graph of all_calls()) under
    the decode variant `plan` (None: the peer, as is; its error is recorded, not bounded), or
    None after reporting a failure under FAILURES[key]."""
    try:
        if plan is None:
            ms = graph_ms_per_call(all_calls, GRAPH_CALLS)
            return rel_err(first(), ref), ms, "cuBLAS / torch"
        with decode_variant(plan):
            out, kernels = launched_kernels(first)
            err = rel_err(out, ref)
            if not err <= DECODE_TOL:
                raise AssertionError(f"max rel err {err:.3g} > {DECODE_TOL}")
            return err, graph_ms_per_call(all_calls, GRAPH_CALLS), kernels
    except Exception as exc:  # report, go on
        FAILURES[key] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"  {key:<26}FAILED: {FAILURES[key]}", flush=True)
        return None


def decode_part(plans, big_copy):
    fits = {}
    for N, K in DECODE_SHAPES:
        print(f"\n== decode bf16 linear, weight [{N}, {K}], graph of {GRAPH_CALLS} rotated calls ==",
              flush=True)
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(GRAPH_CALLS)]
        wbytes = N * K * 2
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        dst = [torch.empty_like(ws[0]) for _ in range(min(GRAPH_CALLS, max(2, -(-4 * l2 // wbytes))))]
        copy_ms = graph_ms_per_call(
            lambda: [dst[i % len(dst)].copy_(w) for i, w in enumerate(ws)], GRAPH_CALLS)
        del dst
        same_gbps = 2 * wbytes / (copy_ms * 1e-3) / 1e9
        record("decode", "copy (same bytes)", (N, K), copy_ms, gbps=same_gbps,
               pct_big_copy=100.0 * same_gbps / big_copy)
        for M in DECODE_M:
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(GRAPH_CALLS)]
            moved = wbytes + M * K * 2 + M * N * 2
            ref = (xs[0].float() @ ws[0].float().T)
            runs = [("torch F.linear", None)] + [(f"linear [{p}]", p) for p in plans]
            for name, plan in runs:
                lin = F.linear if plan is None else go.linear
                got = checked_ms(f"decode {name} {M}x{N}x{K}", plan, lambda: lin(xs[0], ws[0]),
                                 lambda: [lin(x, w) for x, w in zip(xs, ws)], ref)
                if got is None:
                    continue
                err, ms, kernels = got
                gbps = moved / (ms * 1e-3) / 1e9
                record("decode", name, (M, N, K), ms, gbps=gbps, pct_copy=100.0 * gbps / big_copy,
                       pct_copy_same=100.0 * gbps / same_gbps, max_rel_err=err,
                       plan=plan or "torch", kernel=kernels)
                fits.setdefault((name, M), []).append((moved, ms))
            del xs
        del ws
        torch.cuda.empty_cache()
    print("\n== decode: fixed cost per call and streaming bandwidth (least squares over the "
          "weight sizes: t = fixed + bytes / bw) ==")
    for (name, M), pts in fits.items():
        if len(pts) < 2:
            continue
        n = len(pts)
        mx = sum(b for b, _ in pts) / n
        my = sum(t for _, t in pts) / n
        sxx = sum((b - mx) ** 2 for b, _ in pts)
        slope = sum((b - mx) * (t - my) for b, t in pts) / sxx if sxx else 0.0
        fixed_us = (my - slope * mx) * 1e3
        bw = 1e-9 / (slope * 1e-3) if slope > 0 else float("nan")
        ROWS.append({"part": "decode_fit", "name": name, "M": M, "fixed_us": fixed_us,
                     "stream_gbps": bw, "pct_big_copy": 100.0 * bw / big_copy})
        print(f"  {name:<26}M={M:<3} fixed {fixed_us:6.2f} us  streaming {bw:7.0f} GB/s "
              f"({100.0 * bw / big_copy:5.1f}% of copy)", flush=True)


def torch_swiglu(x, wg, wu):
    return F.silu(F.linear(x, wg)) * F.linear(x, wu)


def swiglu_part(plans, big_copy):
    """swiglu_linear (gemv_mma's dual kernel at M = 2..16, the SIMT dual gemv at M = 1) against
    torch's F.silu(F.linear(x, wg)) * F.linear(x, wu), graphs of GRAPH_CALLS calls over rotated
    weight pairs, at the decode shapes with fewer than 2^16 rows."""
    for N, K in DECODE_SHAPES:
        if N >= 1 << 16:
            continue
        print(f"\n== decode bf16 swiglu_linear, weights 2 x [{N}, {K}], graph of {GRAPH_CALLS} "
              "rotated calls ==", flush=True)
        wg = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(GRAPH_CALLS)]
        wu = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(GRAPH_CALLS)]
        for M in DECODE_M:
            xs = [(torch.randn(M, K, device="cuda") * K ** -0.25).to(torch.bfloat16)
                  for _ in range(GRAPH_CALLS)]
            moved = 2 * N * K * 2 + M * K * 2 + M * N * 2
            ref = F.silu(xs[0].double() @ wg[0].double().T) * (xs[0].double() @ wu[0].double().T)
            runs = [("torch silu(linear)*linear", None)] + [(f"swiglu [{p}]", p) for p in plans]
            for name, plan in runs:
                one = torch_swiglu if plan is None else go.swiglu_linear
                got = checked_ms(f"swiglu {name} {M}x{N}x{K}", plan,
                                 lambda: one(xs[0], wg[0], wu[0]),
                                 lambda: [one(x, g, u) for x, g, u in zip(xs, wg, wu)], ref)
                if got is None:
                    continue
                err, ms, kernels = got
                gbps = moved / (ms * 1e-3) / 1e9
                record("swiglu", name, (M, N, K), ms, gbps=gbps, pct_copy=100.0 * gbps / big_copy,
                       max_rel_err=err, plan=plan or "torch", kernel=kernels)
            del xs
        del wg, wu
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--parts", default="gemm,decode", help="gemm, decode, swiglu (comma-separated)")
    ap.add_argument("--configs", default=",".join(G.WARP_TILED_CONFIGS))
    ap.add_argument("--plans", default=",".join(G.DECODE_PLANS),
                    help="decode variants, PLAN[+pdl][+prefetch[N]][+aN] each (e.g. "
                         "balanced+pdl+a4, balanced+pdl+prefetch1024)")
    ap.add_argument("--decode-shapes", default=None,
                    help="weights NxK,... (default: 6144x2048,2048x6144,151936x2048)")
    args = ap.parse_args()
    if args.decode_shapes:
        global DECODE_SHAPES
        DECODE_SHAPES = tuple(tuple(int(v) for v in sh.split("x"))
                              for sh in args.decode_shapes.split(","))
    for spec in args.plans.split(","):
        decode_variant(spec)                      # rejects a bad spec before any GPU work
    t0 = time.time()
    parts = args.parts.split(",")
    big_copy = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy (1 GiB) {big_copy:.0f} GB/s; "
          f"torch {torch.__version__}", flush=True)
    for part, fn in (("gemm", lambda: gemm_part(args.configs.split(","))),
                     ("decode", lambda: decode_part(args.plans.split(","), big_copy)),
                     ("swiglu", lambda: swiglu_part(args.plans.split(","), big_copy))):
        if part in parts:
            try:
                fn()
            except Exception as exc:  # report and go on with the other part
                FAILURES[part] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"  {part} FAILED: {FAILURES[part]}", flush=True)
    # how many clusters of each cluster kernel the driver said fit at once (the grid's cut)
    resident = [{"kernel": k[1], "smem": k[2], "clusters": v} for k, v in G._resident.items()]
    for r in resident:
        print(f"  resident clusters: {r['clusters']} of {r['kernel']} ({r['smem']} B shared)")
    print(f"\n{time.time() - t0:.0f} s; failures: {FAILURES or 'none'}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_gbps": big_copy, "rows": ROWS,
                       "resident_clusters": resident,
                       "failures": FAILURES, "torch": torch.__version__,
                       "warp_tiled_configs": G.WARP_TILED_CONFIGS}, fh, indent=1)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
