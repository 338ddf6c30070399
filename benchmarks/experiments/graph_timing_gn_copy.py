"""GPU time per call of group_norm(+SiLU) / transpose / contiguous and their torch peers, without
host overhead: each function is called `REPS` times inside one CUDA graph, and the graph replays
are timed with CUDA events. At the diffusion shapes (10-20 MB) a kernel takes a few microseconds,
less than a call's host time, so `python -m gpuops bench` (events around each call) measures the
host there; this measures the kernels.

    python benchmarks/experiments/graph_timing_gn_copy.py [--json F] [--no-compile]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F  # noqa: N812

import gpuops as go
from gpuops.bench import graph_replay_us

REPS = 20


def graph_us(fn, reps=REPS, replays=30):
    return graph_replay_us(fn, calls=reps, replays=replays)


def copy_gbps():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_us(lambda: dst.copy_(src), reps=5, replays=10)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    bw = copy_gbps()
    print(f"copy {bw:.0f} GB/s (read + write)")
    rows = []

    def report(name, shape, dtype, nbytes, fns):
        res = {}
        for peer, fn in fns.items():
            try:
                res[peer] = graph_us(fn)
            except Exception as exc:  # a peer that cannot be captured is reported, not fatal
                res[peer] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
        ours = res["gpuops"]
        floor = nbytes / (bw * 1e9) * 1e6
        peers = " ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in res.items() if k != "gpuops")
        print(f"{name:<12}{str(tuple(shape)):<22}{dtype:<9} gpuops {ours:7.1f} us "
              f"({100 * floor / ours:5.1f}% copy)  {peers}")
        rows.append({"op": name, "shape": list(shape), "dtype": dtype, "us": res,
                     "floor_us": floor, "pct_copy": 100 * floor / ours})

    compiled = {}

    def compile_peer(key, fn):
        if args.no_compile:
            return {}
        if key not in compiled:
            compiled[key] = torch.compile(fn, dynamic=False)
        return {"torch.compile": compiled[key]}

    def torch_gn(x, w, b):
        return F.silu(F.group_norm(x, 32, w, b))

    for shape, dtypes, nhwc in [((2, 320, 64, 64), ("float16", "bfloat16", "float32"), False),
                                ((8, 640, 64, 64), ("float16", "bfloat16", "float32"), False),
                                ((4, 1280, 32, 32), ("float16",), False),
                                ((2, 320, 64, 64), ("float16",), True),
                                ((8, 640, 64, 64), ("float16",), True),
                                ((1, 256, 256, 256), ("float16", "float32"), False)]:
        for dtype in dtypes:
            td = getattr(torch, dtype)
            x = torch.randn(shape, device="cuda", dtype=td)
            if nhwc:
                x = x.contiguous(memory_format=torch.channels_last)
            w = torch.randn(shape[1], device="cuda", dtype=td)
            b = torch.randn(shape[1], device="cuda", dtype=td)
            fns = {"gpuops": lambda: go.group_norm(x, 32, w, b, activation="silu"),
                   "torch": lambda: torch_gn(x, w, b),
                   **{k: (lambda f=f: f(x, w, b))
                      for k, f in compile_peer(("gn", shape, dtype, nhwc), torch_gn).items()}}
            report("group_norm" + ("/cl" if nhwc else ""), shape, dtype, 2 * x.numel() *
                   x.element_size(), fns)

    for shape, dims, dtypes in [((8192, 8192), (0, 1), ("float32", "bfloat16")),
                                ((8, 4096, 32, 128), (1, 2), ("bfloat16",))]:
        for dtype in dtypes:
            x = torch.randn(shape, device="cuda", dtype=getattr(torch, dtype))

            def torch_t(t, d=dims):
                return t.transpose(*d).contiguous()
            fns = {"gpuops": lambda: go.transpose(x, *dims), "torch": lambda: torch_t(x),
                   **{k: (lambda f=f: f(x))
                      for k, f in compile_peer(("t", shape, dtype), torch_t).items()}}
            report("transpose", shape, dtype, 2 * x.numel() * x.element_size(), fns)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
