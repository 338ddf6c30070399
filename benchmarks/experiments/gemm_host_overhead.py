"""Where the wgmma GEMM's time goes: the kernel, or the host around it.

Run 23's K sweep (linear 4096x6144xK, K = 512..4096, three calls back to back per event pair)
fitted a fixed cost of ~170 us per call for gpuops' wgmma (cuBLAS ~20 us), and the K = 512 call
took 200-250 us where cuBLAS took 52. Either the kernel has a large fixed cost (prologue,
epilogue, tile walk), or the host takes longer per call than the GPU does, so the back-to-back
timing measures the host. This script separates the two, for gpuops (PLAN["wgmma"] configs) and
cuBLAS side by side:

  * events:  three calls back to back per event pair (what wgmma_smoke and the bench time);
  * graph:   20 calls captured in one CUDA graph, replayed: GPU time only, no host;
  * host:    wall time per call of 200 calls enqueued without synchronizing, on a problem small
             enough (256^3) that the GPU never holds the host up: the host cost of one call;
  * profile: cProfile of 300 small calls, the top functions by own time (where the host goes).

    python benchmarks/experiments/gemm_host_overhead.py [--configs direct,base] [--json out.json]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gpuops as go  # noqa: E402
from gpuops.bench import graph_replay_us  # noqa: E402
from gpuops.ops import gemm as G  # noqa: E402

RESULTS: dict = {"rows": []}


def events_us(fn, iters=15, reps=3):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / reps)
    return statistics.median(times)


def host_us(fn, calls=200):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / calls * 1e6)
    return best


def with_config(cfg, fn):
    def call():
        G.PLAN["wgmma"] = cfg
        return fn()
    return call


def row(shape, name, fn, flops):
    r = {"shape": list(shape), "name": name}
    try:
        r["events_us"] = events_us(fn)
        r["graph_us"] = graph_replay_us(fn, calls=20, replays=10)
    except Exception as exc:  # noqa: BLE001 - one failing row must not end the experiment
        r["error"] = f"{type(exc).__name__}: {exc}"
        print(f"{shape} {name}: {r['error']}", flush=True)
        RESULTS["rows"].append(r)
        return r
    r["graph_tflops"] = flops / r["graph_us"] / 1e6
    r["events_tflops"] = flops / r["events_us"] / 1e6
    print(f"{'x'.join(map(str, shape)):16s} {name:22s} events {r['events_us']:8.1f} us "
          f"({r['events_tflops']:6.1f} TFLOP/s)  graph {r['graph_us']:8.1f} us "
          f"({r['graph_tflops']:6.1f} TFLOP/s)", flush=True)
    RESULTS["rows"].append(r)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="tma_store,direct")
    ap.add_argument("--no-host", action="store_true", help="skip the host cost and profile")
    ap.add_argument("--json")
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    bf = torch.bfloat16
    G.PLAN["wgmma"] = configs[0]

    if not args.no_host:
        host_cost(configs)
    shapes = [(4096, 6144, K) for K in (512, 1024, 2048, 4096)] + [(4096, 2048, 6144),
                                                                   (8192, 8192, 8192)]
    for M, N, K in shapes:
        x = torch.randn(M, K, device="cuda", dtype=bf)
        w = torch.randn(N, K, device="cuda", dtype=bf)
        b = torch.randn(K, N, device="cuda", dtype=bf)
        flops = 2.0 * M * N * K
        cub = row((M, N, K), "cublas F.linear", lambda: F.linear(x, w), flops)
        row((M, N, K), "cublas a @ b", lambda: torch.matmul(x, b), flops)
        for cfg in configs:
            r = row((M, N, K), f"wgmma[{cfg}] linear",
                    with_config(cfg, lambda: go.linear(x, w, variant="wgmma")), flops)
            r2 = row((M, N, K), f"wgmma[{cfg}] a @ b",
                     with_config(cfg, lambda: go.matmul(x, b, variant="wgmma")), flops)
            for rr in (r, r2):
                if "graph_us" in rr and "graph_us" in cub:
                    print(f"    {rr['name']}: {100 * cub['graph_us'] / rr['graph_us']:5.1f}% of "
                          f"cuBLAS linear in graphs, "
                          f"{100 * cub['events_us'] / rr['events_us']:5.1f}% back to back",
                          flush=True)
        del x, w, b
        torch.cuda.empty_cache()
    fit_intercepts()
    G.PLAN["wgmma"] = "tma_store"
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)


def fit_intercepts():
    """Least squares over the K sweep (graph times): cost per k-tile and fixed cost per round
    (6 rounds of 128x256 tiles at 4096x6144 on 132 SMs) of every row name."""
    by_name: dict = {}
    for r in RESULTS["rows"]:
        if r["shape"][:2] == [4096, 6144] and "graph_us" in r:
            by_name.setdefault(r["name"], []).append((r["shape"][2] / 64, r["graph_us"]))
    RESULTS["fits"] = {}
    for name, pts in by_name.items():
        if len(pts) < 3:
            continue
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        icpt = my - slope * mx
        RESULTS["fits"][name] = {"us_per_ktile_round": slope / 6, "us_fixed_per_round": icpt / 6}
        print(f"fit {name:28s} per k-tile and round {slope / 6:6.3f} us, fixed per round "
              f"{icpt / 6:6.2f} us (graphs)", flush=True)


def host_cost(configs):
    bf = torch.bfloat16
    # host cost per call at 256^3 (the GPU is idle most of the time: the host sets the pace)
    a = torch.randn(256, 256, device="cuda", dtype=bf)
    w = torch.randn(256, 256, device="cuda", dtype=bf)
    host = {"cublas F.linear": host_us(lambda: F.linear(a, w))}
    for cfg in configs:
        host[f"gpuops linear [{cfg}]"] = host_us(with_config(cfg, lambda: go.linear(a, w,
                                                                                   variant="wgmma")))
    host["gpuops linear (auto)"] = host_us(lambda: go.linear(a, w))
    host["gpuops matmul (auto)"] = host_us(lambda: go.matmul(a, w.t()))
    for k, v in host.items():
        print(f"host per call 256^3 {k:26s} {v:7.1f} us", flush=True)
    RESULTS["host_us"] = host

    prof = cProfile.Profile()
    G.PLAN["wgmma"] = configs[0]
    prof.enable()
    for _ in range(300):
        go.linear(a, w, variant="wgmma")
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    print(s.getvalue(), flush=True)
    RESULTS["profile"] = s.getvalue()


if __name__ == "__main__":
    main()
