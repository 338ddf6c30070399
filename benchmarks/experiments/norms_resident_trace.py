"""Where the "resident" long-row plan's time goes (notes_norms.md, "resident": run 106 put the
kernel ~4 us beyond its structure's floor at [16, 1M] bf16), and A/Bs of its build options.

For rms_norm and layer_norm at [16, 1048576] bf16 and [8, 393216] fp32 and bf16 (LONG_ROWS="resident"),
the kernel built several ways, each a separate module of norm_ring.cuh's resident_rows, switched
into gpuops' dispatch (norms._MODULE_OF) in one process:
  default         as gpuops builds it
  *_trace         the same with -DGPUOPS_RESIDENT_TRACE=256: thread 0 of each block stamps
                  %globaltimer at entry (0), copies issued (1), tile k's data there (2 + k),
                  tile k published (10 + k), round r's statistics in (18 + 2r), round r's drains
                  issued (19 + 2r), exit (22), tile 0's partial (26), the register tile's
                  partial (27); the block's last warp: its loads issued (24), its tile 0
                  partial (25)
(Run 107 compared a batched landing, one exchange per round, against run 105's per-tile one with
this script, run 108 y stored evict-first (-DGPUOPS_RING_STORE_CS, now the default), run 110 round 0
drained before round 1 lands (-DGPUOPS_RESIDENT_EARLY=0 against it; reverted), runs 111-113
layer_norm's landing, drains and gather and the register tile's issue order, run 115 w / b loaded
once where a block's tiles share a chunk: add a variant's -D
options to VARIANTS, and the switch to the kernel, to A/B another build option; notes_norms.md.)
Each: max |error| against float64, CUDA-graph time per call (20 calls per graph, median of 20
replays; the untraced builds alternate over 3 rounds, median), % of the same run's copy; for
the traced builds, the last call of a replay: each stamp's median / p10 / p90 / max over the
blocks in us after the earliest block's entry, and per-block phase lengths (median, p90).

    python benchmarks/experiments/norms_resident_trace.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import gpuops as go  # noqa: E402
from gpuops import dtypes as dt  # noqa: E402
from gpuops.bench import _Framework, graph_replay_us  # noqa: E402
from gpuops.ops import norms as N  # noqa: E402
from gpuops.runtime import loader  # noqa: E402
from gpuops.runtime.modules import KernelModule  # noqa: E402

SHAPES = (((16, 1 << 20), dt.bfloat16), ((8, 393216), dt.float32), ((8, 393216), dt.bfloat16))
TRACE_BLOCKS = 256
VARIANTS = {"default": (), "default_trace": (f"-DGPUOPS_RESIDENT_TRACE={TRACE_BLOCKS}",)}
STAMPS = {0: "entry", 1: "copies issued", **{2 + k: f"tile {k} there" for k in range(8)},
          **{10 + k: f"published {k}" for k in range(8)}, 18: "round 0 stats in",
          19: "round 0 drains issued", 20: "round 1 stats in", 21: "round 1 drains issued",
          22: "exit", 24: "last warp: loads issued", 25: "last warp: tile 0 partial",
          26: "tile 0 partial", 27: "register tile partial"}
WIDTH = 32
EPS = 1e-5


def variant_module(kind: str, name: str, options) -> KernelModule:
    """The kind's module with only the kernels these shapes launch (fast to build), compiled
    with `options`."""
    base = N._MODULE_OF[kind]
    keys = {(d, 16 // d.itemsize) for _, d in SHAPES}
    tables = (N._EXPRS, N._SPLIT_EXPRS, N._RING_EXPRS, N._RING2_EXPRS, N._RESIDENT_EXPRS)
    exprs = {e for table in tables for key, e in table[kind].items() if key[:2] in keys}
    return KernelModule(f"{base.name}_{name}", base.source,
                        {e: base.kernels[e] for e in exprs}, options=options, pdl=base.pdl)


def summarize(tr: np.ndarray) -> dict:
    """tr: [blocks, WIDTH] stamps (ns; 0 where a stamp was not written)."""
    t0 = tr[:, 0].min()
    out = {}
    for i, what in STAMPS.items():
        col = tr[:, i]
        col = col[col > 0]
        if col.size == 0:
            continue
        rel = (col - t0) / 1e3
        out[what] = dict(median=float(np.median(rel)), p10=float(np.percentile(rel, 10)),
                         p90=float(np.percentile(rel, 90)), max=float(rel.max()),
                         blocks=int(col.size))

    def phase(a, b):
        ok = (tr[:, a] > 0) & (tr[:, b] > 0)
        d = (tr[ok, b] - tr[ok, a]) / 1e3
        return dict(median=float(np.median(d)), p90=float(np.percentile(d, 90))) if d.size else None
    last_pub = max(i for i in range(10, 18) if (tr[:, i] > 0).any())
    out["phases"] = {"issue (0->1)": phase(0, 1), "read+land (1->last publish)": phase(1, last_pub),
                     "gather 0 (last publish->18)": phase(last_pub, 18),
                     "drains 0 (18->19)": phase(18, 19), "gather 1 (19->20)": phase(19, 20),
                     "drains 1 (20->21)": phase(20, 21), "epoch end (21->22)": phase(21, 22),
                     "tile 0 partial (2->26)": phase(2, 26),
                     "tile 0 reduce+publish (26->10)": phase(26, 10),
                     "tile 1 landing (3->11)": phase(3, 11),
                     "whole (0->22)": phase(0, 22)}
    spread = tr[:, 0][tr[:, 0] > 0]
    out["entry spread us"] = float((spread.max() - spread.min()) / 1e3)
    return out


def read_trace(module, fn) -> np.ndarray:
    """[blocks, WIDTH] stamps of the last call of one graph replay of fn (20 calls), as written
    by `module` (a -DGPUOPS_RESIDENT_TRACE build), blocks that wrote none dropped."""
    g = loader.load(module, 0).raw.get_global("gpuops_resident_trace")
    arr = cp.ndarray((TRACE_BLOCKS, WIDTH), cp.uint64, g)
    arr.fill(0)
    graph_replay_us(fn, calls=20, replays=1)
    torch.cuda.synchronize()
    tr = arr.get().astype(np.float64)
    return tr[tr[:, 0] > 0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    fw = _Framework()
    copy = fw.copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s", flush=True)
    saved_modules = dict(N._MODULE_OF)
    saved_long = N.LONG_ROWS
    mods = {(kind, name): variant_module(kind, name, opts)
            for kind in ("rms_norm", "layer_norm") for name, opts in VARIANTS.items()}
    res = dict(copy_gbps=copy, rows=[], traces={})
    N.LONG_ROWS = "resident"
    try:
        for shape, d in SHAPES:
            x = fw.randn(shape, d)
            w, b = fw.randn(shape[-1:], d), fw.randn(shape[-1:], d)
            xd, wd, bd = x.double(), w.double(), b.double()
            refs = {"rms_norm": xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * wd,
                    "layer_norm": torch.nn.functional.layer_norm(xd, shape[-1:], wd, bd, EPS)}
            fns = {"rms_norm": lambda: go.rms_norm(x, shape[-1:], w, eps=EPS),
                   "layer_norm": lambda: go.layer_norm(x, shape[-1:], w, b, eps=EPS)}
            moved = 2 * x.numel() * d.itemsize
            for kind in ("rms_norm", "layer_norm"):
                fn = fns[kind]
                times = {}

                def use(name):
                    N._MODULE_OF[kind] = mods[(kind, name)]
                    N._plans.clear()
                for rnd in range(3):
                    for name in VARIANTS:
                        if name.endswith("_trace") and rnd > 0:
                            continue
                        use(name)
                        if rnd == 0:
                            err = float((fn().double() - refs[kind]).abs().max())
                            ring = N._long_rows_ring(kind, N._plan(kind, d, 16 // d.itemsize,
                                                                   shape[-1], 0),
                                                     d, 16 // d.itemsize, shape[-1], shape[0], 0)
                            desc = ("not resident" if ring is None or ring[0].variant !=
                                    "resident" else f"grid {ring[1]}, {ring[0].depth} slots, "
                                    f"{ring[0].kernel.raw.num_regs} regs")
                            print(f"{kind} {shape} {d.name} {name}: max|err| {err:.2e} ({desc})",
                                  flush=True)
                            res["rows"].append(dict(op=kind, shape=list(shape), dtype=d.name,
                                                    variant=name, max_err=err, launch=desc))
                        times.setdefault(name, []).append(graph_replay_us(fn))
                        if name.endswith("_trace") and rnd == 0:
                            summary = summarize(read_trace(mods[(kind, name)], fn))
                            key = f"{kind} {shape} {d.name} {name}"
                            res["traces"][key] = summary
                            print(f"trace {key}:", flush=True)
                            for what, v in summary.items():
                                print(f"  {what:<32} {json.dumps(v)}", flush=True)
                for name, ts in times.items():
                    us = statistics.median(ts)
                    gbps = moved / (us * 1e-6) / 1e9
                    print(f"{kind:<11}{str(shape):<14}{d.name:<9}{name:<16}{us:8.2f} us "
                          f"{100 * gbps / copy:5.1f}% of copy  rounds {[round(t, 2) for t in ts]}",
                          flush=True)
                    for row in res["rows"]:
                        if (row["op"], row["variant"], tuple(row["shape"])) == (kind, name, shape):
                            row.update(us=us, pct_copy=100 * gbps / copy, rounds=ts)
    finally:
        N._MODULE_OF.clear()
        N._MODULE_OF.update(saved_modules)
        N.LONG_ROWS = saved_long
        N._plans.clear()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
