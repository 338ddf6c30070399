"""Where the NCHW two-pass stats kernel's time goes (group_norm_nchw_stats; run 128: 31.3 us at
fp32 [1, 256, 256, 256], 67 MB, where Inductor's reduction takes 24.8 and a read-only pass would
take ~21): its own speed, or the write-back of the y lines the previous call's apply kernel left
dirty in L2?

Per case, each timed as CUDA-graph replays (20 calls per graph, median of 20 replays; the rows
alternate over 3 rounds, median of the rounds):
  - probes, each kernel launched alone with the arguments group_norm gave it:
      stats alone (20 stats launches back to back: nothing dirty in L2),
      apply alone (20 apply launches),
      copy then stats (x.clone() before each stats launch: 67 MB of dirty lines first),
      sum (torch.sum(x): a read-only pass over the same bytes), copy (x.clone());
  - whole calls, default plan, under build variants of the NCHW stats / apply kernels:
      default, ycs (-DGPUOPS_GN_APPLY_STORE_CS: apply stores y evict-first) (run 129 also had
      builds with and without L2 eviction hints on x, since removed: commit 7ed5729);
  - whole calls under host variants: onewave (STATS_CHUNK_ROUNDS = None: one wave of at most
      STATS_BLOCKS_PER_SM blocks per SM, the default before run 131), rounds2 / rounds4 (chunks of
      that many rounds of loads; the default is 1); runs 129-130 also timed 2 and 3 blocks per
      SM in one wave (slower);
  - torch.compile, the peer.
Per-kernel device time (torch.profiler, 10 eager calls) for the build variants and compile.
Every whole-call variant checked against float64 first (outputs poisoned).

    python benchmarks/experiments/group_norm_stats_probe.py [--json F] [--no-compile]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import gpuops as go  # noqa: E402
from gpuops.ops import copy as _copy  # noqa: E402
from gpuops.ops import group_norm as GN  # noqa: E402
from gpuops.runtime.modules import KernelModule  # noqa: E402
from group_norm_two_pass import (kernel_times, print_kernels, report, time_rounds,  # noqa: E402
                                 torch_gn)

CASES = (((1, 256, 256, 256), "float32"), ((8, 640, 64, 64), "float32"),
         ((1, 256, 256, 256), "bfloat16"))
BUILDS = {"default": (), "ycs": ("-DGPUOPS_GN_APPLY_STORE_CS",)}
HOST = {"onewave": ("STATS_CHUNK_ROUNDS", None), "rounds2": ("STATS_CHUNK_ROUNDS", 2),
        "rounds4": ("STATS_CHUNK_ROUNDS", 4)}


def build_caches():
    """{build name: KernelCache} of module variants with the two-pass design-2 kernels only."""
    exprs = {e: s for e, s in GN.MODULE.kernels.items() if "nchw_stats<" in e or "nchw_apply<" in e}
    out = {"default": GN.KERNELS}
    for name, opts in BUILDS.items():
        if opts:
            out[name] = _copy.KernelCache(KernelModule(f"{GN.MODULE.name}_{name}",
                                                       GN.MODULE.source, exprs, options=opts))
    return out


class Recorder:
    """The two launches of one group_norm call: [(expr, grid, block, args, smem)]."""

    def __init__(self):
        self.launches = []

    def __enter__(self):
        get, log = GN.KERNELS.get, self.launches
        self._get = get

        class Spy:
            def __init__(self, k, expr):
                self.k, self.expr = k, expr

            def launch(self, grid, block, stream, *args, smem=0):
                log.append((self.expr, grid, block, args, smem))
                return self.k.launch(grid, block, stream, *args, smem=smem)
        GN.KERNELS.get = lambda dev, expr: Spy(get(dev, expr), expr)
        return self

    def __exit__(self, *exc):
        GN.KERNELS.get = self._get
        return False


def run_case(shape, dtype, caches, res, compile_peer, defaults):
    dev = torch.cuda.current_device()
    GN.force_path = "twopass"
    td = getattr(torch, dtype)
    torch.manual_seed(7)
    x = torch.randn(shape, device="cuda", dtype=td)
    w = torch.randn(shape[1], device="cuda", dtype=td)
    b = torch.randn(shape[1], device="cuda", dtype=td)
    ref = torch_gn(x.double(), w.double(), b.double())
    name = f"{tuple(shape)} {dtype}"
    print(f"\n{name}: x {x.numel() * x.element_size() / 1e6:.1f} MB", flush=True)
    y = torch.empty_like(x)

    def call():
        return go.group_norm(x, 32, w, b, activation="silu", out=y)

    def setup(v):
        GN.KERNELS = caches.get(v, caches["default"])
        GN.STATS_CHUNK_ROUNDS, GN.STATS_BLOCKS_PER_SM = defaults
        if v in HOST:
            setattr(GN, *HOST[v])
    variants = []
    for v in [*caches, *HOST]:
        setup(v)
        y.fill_(float("nan"))
        call()
        err = (y.double() - ref).abs().max().item()
        ok = err <= (2e-4 if dtype == "float32" else 0.1)
        print(f"  {v:<10} max |err| {err:.2e}{'' if ok else '  WRONG'}", flush=True)
        if ok:
            variants.append(v)
    setup("default")
    with Recorder() as rec:
        call()
    (s_expr, s_grid, s_block, s_args, _), (a_expr, a_grid, a_block, a_args, _) = rec.launches
    stats_k, apply_k = GN.KERNELS.get(dev, s_expr), GN.KERNELS.get(dev, a_expr)
    part = torch.empty(4 * s_grid[0], device="cuda", dtype=torch.float32)
    s_args = (s_args[0], part.data_ptr(), *s_args[2:])
    a_args = (*a_args[:4], part.data_ptr(), *a_args[5:])
    print(f"  stats {s_expr.split('::')[-1]} grid {s_grid[0]}; apply {a_expr.split('::')[-1]}"
          f" grid {a_grid[0]}", flush=True)

    def stream():
        return torch.cuda.current_stream().cuda_stream

    def stats_alone():
        stats_k.launch(s_grid, s_block, stream(), *s_args)

    def apply_alone():
        apply_k.launch(a_grid, a_block, stream(), *a_args)

    def copy_then_stats():
        x.clone()
        stats_k.launch(s_grid, s_block, stream(), *s_args)
    stats_alone()
    rows = {"stats alone": stats_alone, "apply alone": apply_alone,
            "copy then stats": copy_then_stats, "sum": lambda: torch.sum(x),
            "copy": lambda: x.clone()}
    if compile_peer:
        torch._dynamo.reset()
        cfn = torch.compile(torch_gn, dynamic=False)
        cfn(x, w, b)
        rows["torch.compile"] = lambda: cfn(x, w, b)
    entries = {v: (lambda v=v: setup(v), call) for v in variants}
    entries.update({r: (lambda: setup("default"), fn) for r, fn in rows.items()})
    report(res, name, time_rounds(entries), width=16)
    kt = {}
    for v in [c for c in caches if c in variants]:
        setup(v)
        kt[v] = kernel_times(call)
    setup("default")
    if "torch.compile" in rows:
        kt["torch.compile"] = kernel_times(rows["torch.compile"])
    print_kernels(kt, width=40)
    res["kernels"][name] = kt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    caches = build_caches()
    res = dict(rows=[], kernels={})
    saved = GN.KERNELS, GN.force_path, GN.STATS_CHUNK_ROUNDS, GN.STATS_BLOCKS_PER_SM
    try:
        for shape, dtype in CASES:
            run_case(shape, dtype, caches, res, not args.no_compile, saved[2:])
            torch.cuda.empty_cache()
    finally:
        GN.KERNELS, GN.force_path, GN.STATS_CHUNK_ROUNDS, GN.STATS_BLOCKS_PER_SM = saved
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
