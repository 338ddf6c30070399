"""group_norm(+SiLU): kernel time of each design (old vs new) and per-call host time, per dtype.

Answers two questions the per-call bench cannot: (1) what the kernels take on the GPU (each
variant called REPS times inside one CUDA graph, replays timed with CUDA events), and (2) what a
call costs on the host (CUDA events around single eager calls, as `python -m gpuops bench` times
them, next to the graph time: when "eager" >> "graph" the bench row measures the host).

Variants (gpuops.ops.group_norm knobs): auto = the default plan; onchip = no clusters (one block per
group); cluster2/4/8 = forced cluster size; twopass = the two-kernel NCHW path; twopass_fwd = the
same with the old forward apply order; nhwc / nhwc_fwd = channels-last with the reverse / old
forward apply order. Peers: torch eager (F.silu(F.group_norm)), Liger when installed,
torch.compile with --compile (slow to compile: leave it off to stay under 90 s).

    python benchmarks/experiments/group_norm_variants.py [--json F] [--compile] [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F  # noqa: N812

import gpuops as go
from gpuops.ops import group_norm as GN
from gpuops.bench import graph_replay_us

REPS = 20


def graph_us(fn, reps=REPS, replays=20):
    return graph_replay_us(fn, calls=reps, replays=replays)


def eager_us(fn, iters=30):
    """As gpuops.bench: CUDA events around each call (host-bound calls measure the host)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(iters)]
    for s, e in pairs:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs)


def host_us(fn, iters=200):
    """Wall time per call, back to back, no sync inside (the host's share)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6


def copy_gbps():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_us(lambda: dst.copy_(src), reps=5, replays=10)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def set_variant(v):
    GN.force_path = None
    GN.apply_order = "reverse"
    if v in ("onchip", "cluster2", "cluster4", "cluster8", "twopass", "nhwc", "nhwc_copy"):
        GN.force_path = v
    elif v == "twopass_fwd":
        GN.force_path, GN.apply_order = "twopass", "forward"
    elif v == "nhwc_fwd":
        GN.force_path, GN.apply_order = "nhwc", "forward"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the default shape only")
    args = ap.parse_args()
    bw = copy_gbps()
    print(f"copy {bw:.0f} GB/s (read + write)", flush=True)
    try:
        from liger_kernel.ops.group_norm import LigerGroupNormFunction  # noqa: PLC0415
    except ImportError:
        LigerGroupNormFunction = None  # noqa: N806
    rows = []

    def torch_gn(x, w, b):
        return F.silu(F.group_norm(x, 32, w, b))

    nchw_variants = ("auto", "onchip", "cluster2", "cluster4", "cluster8", "twopass", "twopass_fwd")
    cases = [((2, 320, 64, 64), ("bfloat16", "float16", "float32"), False, nchw_variants),
             ((2, 320, 64, 64), ("bfloat16",), True, ("auto", "nhwc", "nhwc_fwd", "nhwc_copy"))]
    if not args.quick:
        cases += [((8, 640, 64, 64), ("bfloat16", "float32"), False,
                   ("auto", "cluster4", "cluster8", "twopass", "twopass_fwd")),
                  ((8, 640, 64, 64), ("bfloat16",), True, ("auto", "nhwc_fwd")),
                  ((4, 1280, 32, 32), ("bfloat16",), False, ("auto", "cluster4", "twopass")),
                  ((1, 256, 256, 256), ("bfloat16", "float32"), False,
                   ("auto", "twopass", "twopass_fwd"))]
    for shape, dtypes, nhwc, variants in cases:
        for dtype in dtypes:
            td = getattr(torch, dtype)
            x = torch.randn(shape, device="cuda", dtype=td)
            if nhwc:
                x = x.contiguous(memory_format=torch.channels_last)
            w = torch.randn(shape[1], device="cuda", dtype=td)
            b = torch.randn(shape[1], device="cuda", dtype=td)
            nbytes = 2 * x.numel() * x.element_size()
            floor = nbytes / (bw * 1e9) * 1e6
            ref = torch_gn(x.float(), w.float(), b.float())
            name = f"group_norm{'/cl' if nhwc else ''} {tuple(shape)} {dtype}"
            print(f"{name}: floor {floor:.1f} us ({nbytes / 1e6:.1f} MB)", flush=True)

            def line(label, fn, eager=False):
                try:
                    g = graph_us(fn)
                    extra = ""
                    if eager:
                        extra = f"  eager(bench-style) {eager_us(fn):7.1f} us  host {host_us(fn):6.1f} us"
                    print(f"  {label:<14} graph {g:7.1f} us  {100 * floor / g:5.1f}% copy{extra}",
                          flush=True)
                    rows.append({"case": name, "variant": label, "graph_us": g,
                                 "pct_copy": 100 * floor / g, "floor_us": floor})
                except Exception as exc:  # noqa: BLE001  (a variant that cannot run is reported)
                    print(f"  {label:<14} failed: {type(exc).__name__}: {str(exc)[:150]}",
                          flush=True)
                    rows.append({"case": name, "variant": label, "error": str(exc)[:300]})

            for v in variants:
                set_variant(v)
                try:
                    y = go.group_norm(x, 32, w, b, activation="silu")
                    err = (y.float() - ref).abs().max().item()
                    tol = 1e-4 if dtype == "float32" else 0.1
                    if not err <= tol:
                        print(f"  {v:<14} WRONG: max abs err {err:.3g}", flush=True)
                        continue
                except Exception as exc:  # noqa: BLE001
                    print(f"  {v:<14} failed: {type(exc).__name__}: {str(exc)[:150]}", flush=True)
                    continue
                line(v, lambda: go.group_norm(x, 32, w, b, activation="silu"), eager=v == "auto")
            set_variant("auto")
            line("torch", lambda: torch_gn(x, w, b), eager=True)
            if LigerGroupNormFunction is not None and not nhwc:
                line("liger", lambda: F.silu(LigerGroupNormFunction.apply(
                    x, w, b, shape[1], 32, 1e-5)))
            if args.compile:
                cfn = torch.compile(torch_gn, dynamic=False)
                line("torch.compile", lambda: cfn(x, w, b))
            del x, w, b, ref
    set_variant("auto")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
