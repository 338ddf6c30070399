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

    python benchmarks/experiments/group_norm_resident_trace.py [--json out.json]
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


def variant_module(name, options) -> KernelModule:
    base = GN.RESIDENT_MODULE
    return KernelModule(f"{base.name}_{name}", base.source, dict(base.kernels), options=options)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    mods = {name: variant_module(name, opts) for name, opts in VARIANTS.items()}
    saved = GN.RESIDENT_KERNELS, GN.force_path
    res = dict(rows=[], traces={})
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
                times = {}
                for rnd in range(3):
                    for name, mod in mods.items():
                        if name.endswith("_trace") and rnd > 0:
                            continue
                        GN.RESIDENT_KERNELS = _copy.KernelCache(mod)
                        GN._plans.clear()
                        if rnd == 0:
                            err = float((fn().double() - ref).abs().max())
                            print(f"{shape} {td} act={act} {name}: max|err| {err:.2e}",
                                  flush=True)
                        times.setdefault(name, []).append(graph_replay_us(fn))
                        if name.endswith("_trace") and rnd == 0:
                            key = f"{tuple(shape)} {td} act={act}"
                            summary = summarize(read_trace(mod, fn))
                            res["traces"][key] = summary
                            print(f"trace {key}:", flush=True)
                            for what, v in summary.items():
                                print(f"  {what:<32} {json.dumps(v)}", flush=True)
                for name, ts in times.items():
                    us = statistics.median(ts)
                    print(f"{str(shape):<20}{str(td):<16}act={str(act):<5} {name:<14}{us:8.2f} us"
                          f"  copy {copy_us:6.2f} us ({100 * copy_us / us:5.1f}%)  rounds "
                          f"{[round(t, 2) for t in ts]}", flush=True)
                    res["rows"].append(dict(shape=list(shape), dtype=str(td), act=act,
                                            variant=name, us=us, copy_us=copy_us, rounds=ts))
    finally:
        GN.RESIDENT_KERNELS, GN.force_path = saved
        GN._plans.clear()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
