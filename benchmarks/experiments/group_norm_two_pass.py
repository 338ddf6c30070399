"""group_norm's two-pass kernel pairs (NCHW and channels-last) at inputs larger than the chip
holds, beside auto's plan and torch.compile, with per-kernel times.

Per case (shape, dtype, layout, forced path) and variant ("twopass": the forced two-pass pair;
"fwd": the same with the old forward apply order; "auto": the default plan, whatever kernel it
picks):
  - max |error| against float64 (torch's group_norm + SiLU in float64, fresh random data,
    outputs poisoned);
  - graph replay time per call (20 calls per graph, median of 20 replays; the variants alternate
    over 3 rounds, median of the rounds), as % of a copy of the same bytes in the same method;
  - per-kernel device time (torch.profiler over 10 eager calls after warm-up) of the pair and of
    torch.compile's kernels.
Peers in the same run: torch eager, torch.compile (dynamic=False), the copy x -> y (x.clone()).
(Runs 127-128 ran this script's earlier form, which also swept L2 eviction hints: commit f6b1cd9;
runs 130-131 one with "d1" / "d2", an earlier NCHW pair and this one: commit 5e37897.)

    python benchmarks/experiments/group_norm_two_pass.py [--json F] [--cases 0,2] [--no-compile]
        [--shapes 1x256x224x224:bfloat16,4x1280x32x32:float32]   (NCHW shapes instead of CASES)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402,N812

import gpuops as go  # noqa: E402
from gpuops.bench import graph_replay_us, kernel_times_us  # noqa: E402
from gpuops.ops import group_norm as GN  # noqa: E402

# (shape as NCHW, dtype, channels_last, forced path of the twopass / fwd variants)
CASES = (((1, 256, 256, 256), "float32", False, "twopass"),     # auto: two-pass (67 MB)
         ((1, 256, 256, 256), "bfloat16", False, "twopass"),    # auto: resident (33.5 MB)
         ((8, 640, 64, 64), "float32", False, "twopass"),       # auto: stream / spread (84 MB)
         ((16, 640, 32, 32), "float32", False, "twopass"),      # 42 MB
         ((8, 640, 64, 64), "bfloat16", True, "nhwc"),          # auto: nhwc two-pass (42 MB)
         ((8, 640, 64, 64), "float32", True, "nhwc"))           # 84 MB
ROUNDS = 3


def torch_gn(x, w, b):
    return F.silu(F.group_norm(x, 32, w, b))


def set_variant(force, v):
    """v: "auto" (the default plan), "twopass" (the forced pair), "fwd" (forward apply order)."""
    GN.force_path, GN.apply_order = force, "reverse"
    if v == "auto":
        GN.force_path = None
    elif v == "fwd":
        GN.apply_order = "forward"


def kernel_times(fn, calls=10):
    """{kernel name (90 characters): mean device us per call} over `calls` eager calls."""
    return {k[:90]: t for k, t in kernel_times_us(fn, calls).items()}


def time_rounds(entries: dict, rounds=ROUNDS) -> dict:
    """{name: [graph replay us per call, one per round]} of entries {name: (prepare, fn)}: each
    round times every entry once (prepare() first), so that the variants alternate."""
    times = defaultdict(list)
    for _ in range(rounds):
        for name, (prepare, fn) in entries.items():
            prepare()
            times[name].append(graph_replay_us(fn, calls=20, replays=20))
    return times


def report(res, case, times, copy_us=None, width=14):
    """Print each entry's median over the rounds (and % of copy_us) and add the rows to res."""
    for v, ts in times.items():
        t = statistics.median(ts)
        pct = f"  {100 * copy_us / t:5.1f}% of copy" if copy_us else ""
        print(f"  {v:<{width}} {t:7.1f} us{pct}  (rounds {', '.join(f'{u:.1f}' for u in ts)})",
              flush=True)
        row = dict(case=case, variant=v, us=t, rounds=ts)
        if copy_us:
            row["pct_copy"] = 100 * copy_us / t
        res["rows"].append(row)


def print_kernels(kt: dict, width=48):
    for label, ks in kt.items():
        print(f"  kernels, {label}: " + "; ".join(
            f"{k.split('(')[0][-width:]} {t:.1f}" for k, t in ks.items()), flush=True)


def run_case(shape, dtype, cl, force, variants, res, compile_peer):
    td = getattr(torch, dtype)
    torch.manual_seed(len(res["rows"]))
    x = torch.randn(shape, device="cuda", dtype=td)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(shape[1], device="cuda", dtype=td)
    b = torch.randn(shape[1], device="cuda", dtype=td)
    ref = torch_gn(x.double(), w.double(), b.double())
    xb = x.numel() * x.element_size()
    name = f"{tuple(shape)} {dtype}{' channels_last' if cl else ''}"
    print(f"\n{name}: x {xb / 1e6:.1f} MB", flush=True)

    def call():
        return go.group_norm(x, 32, w, b, activation="silu")
    fns = {}
    for v in variants:
        set_variant(force, v)
        y = call()
        y.fill_(float("nan"))                      # poisoned, then recomputed
        y = go.group_norm(x, 32, w, b, activation="silu", out=y)
        err = (y.double() - ref).abs().max().item()
        tol = 2e-4 if dtype == "float32" else 0.1
        print(f"  {v:<8} max |err| {err:.2e}{'' if err <= tol else '  WRONG'}", flush=True)
        if not err <= tol:
            res["rows"].append(dict(case=name, variant=v, error=err))
            continue
        fns[v] = (force, v)
    peers = {"torch": lambda: torch_gn(x, w, b), "copy x": lambda: x.clone()}
    if compile_peer:
        torch._dynamo.reset()
        cfn = torch.compile(torch_gn, dynamic=False)
        cfn(x, w, b)
        peers["torch.compile"] = lambda: cfn(x, w, b)
    entries = {v: (lambda fv=fv: set_variant(*fv), call) for v, fv in fns.items()}
    entries.update({p: (lambda: None, fn) for p, fn in peers.items()})
    times = time_rounds(entries)
    report(res, name, times, statistics.median(times["copy x"]))
    kt = {}
    for v in ("twopass",):
        if v in fns:
            set_variant(*fns[v])
            kt[v] = kernel_times(call)
    if "torch.compile" in peers:
        kt["torch.compile"] = kernel_times(peers["torch.compile"])
    print_kernels(kt)
    res["kernels"][name] = kt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--cases", default=None, help="comma-separated indices into CASES")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated NxCxHxW:dtype NCHW cases (forced path: twopass)")
    args = ap.parse_args()
    cases = CASES if not args.cases else [CASES[int(i)] for i in args.cases.split(",")]
    if args.shapes:
        cases = [(tuple(int(n) for n in dims.split("x")), dtype, False, "twopass")
                 for dims, dtype in (item.split(":") for item in args.shapes.split(","))]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"L2 {l2 / 2**20:.0f} MiB", flush=True)
    res = dict(l2_bytes=l2, rows=[], kernels={})
    variants = ["auto", "twopass", "fwd"]
    try:
        for shape, dtype, cl, force in cases:
            run_case(shape, dtype, cl, force, variants, res, not args.no_compile)
            torch.cuda.empty_cache()
    finally:
        set_variant(None, "auto")
        GN.force_path = None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
