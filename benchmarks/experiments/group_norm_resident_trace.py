"""Where group_norm_resident's time goes (round 4; notes_groupnorm_copy.md), and A/Bs of its
build options, in one process: the norms' resident trace (norms_resident_trace.py) applied to
group_norm's kernel.

Variants, each a separate build of groupnorm/group_norm_resident.cu switched into gpuops'
dispatch (group_norm.RESIDENT_KERNELS) with force_path = "resident":
  default         as gpuops builds it
  default_trace   -DGPUOPS_RESIDENT_TRACE=256: %globaltimer stamps per block and phase
(Run 125 also A/B'd a build whose SiLU took group_norm.cu's silu_pack against silu_f: 0.7 us
slower at [1, 256, 256, 256] bf16, equal elsewhere; add a variant's -D options to VARIANTS, and
the switch to the kernel, to A/B another build option.)
Shapes: [1, 256, 256, 256] bf16 (the VAE's; 33.5 MB on chip), [4, 1280, 32, 32] fp32 and bf16,
[2, 320, 64, 64] bf16; each with SiLU and without. Each: max |error| against float64, CUDA-graph
time per call (20 calls per graph, median of 20 replays; the untraced builds alternate over 3
rounds, median), % of a copy of the same bytes in the same method; for the traced build the
stamps' medians and the per-block phase lengths (norms_resident_trace.summarize).

--nhwc: the same for group_norm_nhwc_resident (round 6, channels-last runs of whole rows) at
channels-last [2, 320, 64, 64] bf16 / fp32 and [4, 1280, 32, 32] bf16 / fp32, PER_SM blocks per
SM (nhwc_resident_per_sm), SiLU on; its stamps: NHWC_STAMPS.

    python benchmarks/experiments/group_norm_resident_trace.py [--json out.json] [--nhwc]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402,N812

import gpuops as go  # noqa: E402
from gpuops.bench import graph_replay_us  # noqa: E402
from gpuops.ops import copy as _copy  # noqa: E402
from gpuops.ops import group_norm as GN  # noqa: E402
from gpuops.runtime.modules import KernelModule  # noqa: E402
from norms_resident_trace import TRACE_BLOCKS, read_trace, summarize  # noqa: E402

SHAPES = (((1, 256, 256, 256), torch.bfloat16), ((4, 1280, 32, 32), torch.float32),
          ((4, 1280, 32, 32), torch.bfloat16), ((2, 320, 64, 64), torch.bfloat16))
VARIANTS = {"default": (), "default_trace": (f"-DGPUOPS_RESIDENT_TRACE={TRACE_BLOCKS}",)}


NHWC_SHAPES = (((2, 320, 64, 64), torch.bfloat16), ((2, 320, 64, 64), torch.float32),
               ((4, 1280, 32, 32), torch.bfloat16), ((4, 1280, 32, 32), torch.float32))
PER_SM = (1,)        # (runs 145-146 also timed 2 per SM; the kernel is now built for 1)
# group_norm_nhwc_resident's RESIDENT_MARK indices (thread 0 of each block)
NHWC_STAMPS = {0: "entry", 1: "copies issued", 2: "landed, summed", 4: "run stats",
               5: "published", 9: "flags seen", 10: "pairs merged", 6: "tables",
               7: "stores issued", 8: "exit"}
# (runs 146-147, two-pass statistics: 2 "pass 1 landed", 3 "run means", 4 "run M2"; runs 146-148:
# 6 "gathered" = flags, pairs and tables, without 9 and 10)


def summarize_nhwc(tr) -> dict:
    """tr: [blocks, 32] stamps (ns; 0 where not written): each stamp's time from the grid's first
    entry (median / p10 / p90 / max over blocks) and each phase's length (median / p90)."""
    t0 = tr[:, 0].min()
    out = {}
    for i, what in NHWC_STAMPS.items():
        col = tr[:, i][tr[:, i] > 0]
        if col.size:
            rel = (col - t0) / 1e3
            out[what] = {k: round(float(f(rel)), 3) for k, f in (
                ("median", statistics.median), ("p10", lambda r: sorted(r)[len(r) // 10]),
                ("p90", lambda r: sorted(r)[(9 * len(r)) // 10]), ("max", max))}
    phases = {}
    for a, b in zip(NHWC_STAMPS, list(NHWC_STAMPS)[1:]):
        ok = (tr[:, a] > 0) & (tr[:, b] > 0)
        d = sorted(((tr[ok, b] - tr[ok, a]) / 1e3).tolist())
        if d:
            phases[f"{NHWC_STAMPS[a]} -> {NHWC_STAMPS[b]}"] = dict(
                median=round(statistics.median(d), 3), p90=round(d[(9 * len(d)) // 10], 3))
    out["phases"] = phases
    return out


def time_rounds(mods, fn, ref, key, summarize_fn, res, width):
    """Each module of mods switched into group_norm's dispatch in turn, over 3 rounds: max |error|
    against ref (round 0), CUDA-graph time per call, and for a traced build (round 0 only) its
    stamps summarized into res["traces"][key]. Returns {name: [us per round]}."""
    times = {}
    for rnd in range(3):
        for name, mod in mods.items():
            if name.endswith("_trace") and rnd > 0:
                continue
            GN.RESIDENT_KERNELS = _copy.KernelCache(mod)
            GN._plans.clear()
            if rnd == 0:
                err = float((fn().double() - ref).abs().max())
                print(f"{key} {name}: max|err| {err:.2e}", flush=True)
            times.setdefault(name, []).append(graph_replay_us(fn))
            if name.endswith("_trace") and rnd == 0:
                summary = summarize_fn(read_trace(mod, fn))
                res["traces"][key] = summary
                print(f"trace {key}:", flush=True)
                for what, v in summary.items():
                    print(f"  {what:<{width}} {json.dumps(v)}", flush=True)
    return times


def report(label, times, copy_us, row, res):
    """One line and one res["rows"] entry (row plus the times) per module: the rounds' median."""
    for name, ts in times.items():
        us = statistics.median(ts)
        print(f"{label} {name:<14}{us:8.2f} us  copy {copy_us:6.2f} us ({100 * copy_us / us:5.1f}%)"
              f"  rounds {[round(t, 2) for t in ts]}", flush=True)
        res["rows"].append(dict(row, variant=name, us=us, copy_us=copy_us, rounds=ts))


def nhwc_main(mods, res):
    """--nhwc: group_norm_nhwc_resident forced, PER_SM blocks per SM, untraced (3 rounds, median)
    and traced."""
    saved = GN.RESIDENT_KERNELS, GN.force_path, GN.nhwc_resident_per_sm
    GN.force_path = "nhwc_resident"
    try:
        for shape, td in NHWC_SHAPES:
            x = torch.randn(shape, device="cuda", dtype=td).contiguous(
                memory_format=torch.channels_last)
            w = torch.randn(shape[1], device="cuda", dtype=td)
            b = torch.randn(shape[1], device="cuda", dtype=td)
            copy_us = graph_replay_us(lambda: x.clone())
            ref = F.silu(F.group_norm(x.double(), 32, w.double(), b.double()))
            fn = lambda: go.group_norm(x, 32, w, b, activation="silu")  # noqa: E731
            for per_sm in PER_SM:
                GN.nhwc_resident_per_sm = per_sm
                key = f"cl {tuple(shape)} {td} per_sm={per_sm}"
                times = time_rounds(mods, fn, ref, key, summarize_nhwc, res, 16)
                report(f"cl {str(shape):<20}{str(td):<16}per_sm={per_sm}", times, copy_us,
                       dict(shape=list(shape), dtype=str(td), layout="nhwc", per_sm=per_sm), res)
    finally:
        GN.RESIDENT_KERNELS, GN.force_path, GN.nhwc_resident_per_sm = saved
        GN._plans.clear()


def variant_module(name, options) -> KernelModule:
    base = GN.RESIDENT_MODULE
    return KernelModule(f"{base.name}_{name}", base.source, dict(base.kernels), options=options)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--nhwc", action="store_true", help="group_norm_nhwc_resident instead")
    args = ap.parse_args()
    mods = {name: variant_module(name, opts) for name, opts in VARIANTS.items()}
    res = dict(rows=[], traces={})
    if args.nhwc:
        nhwc_main(mods, res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    saved = GN.RESIDENT_KERNELS, GN.force_path
    GN.force_path = "resident"
    try:
        for shape, td in SHAPES:
            x = torch.randn(shape, device="cuda", dtype=td)
            w = torch.randn(shape[1], device="cuda", dtype=td)
            b = torch.randn(shape[1], device="cuda", dtype=td)
            copy_us = graph_replay_us(lambda: x.clone())
            for act in ("silu", None):
                ref = F.group_norm(x.double(), 32, w.double(), b.double())
                if act:
                    ref = F.silu(ref)
                fn = lambda: go.group_norm(x, 32, w, b, activation=act)  # noqa: E731
                times = time_rounds(mods, fn, ref, f"{tuple(shape)} {td} act={act}", summarize,
                                    res, 32)
                report(f"{str(shape):<20}{str(td):<16}act={str(act):<5}", times, copy_us,
                       dict(shape=list(shape), dtype=str(td), act=act), res)
    finally:
        GN.RESIDENT_KERNELS, GN.force_path = saved
        GN._plans.clear()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
