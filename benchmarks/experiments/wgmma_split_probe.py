"""Where the time of a split-K wgmma product goes (run 181: split-K made [128, 6144, 2048] bf16
slower, 36.1 us against 23.4 unsplit, where 5 splits of 7 k-tiles were predicted at 12-15 us).
Per variant: graph-replay time per call and each kernel's CUPTI time (kernel_times_us), at the
shapes of run 181. Variants: unsplit under 'tma_fused' (the default epilogue) and 'direct'; the
'direct' kernel writing fp32 (matmul out_dtype='float32': the split kernel's epilogue, unsplit);
split-K with at most 2 / 4 / 8 / 16 splits (WGMMA_SPLIT_MAX).

    python benchmarks/experiments/wgmma_split_probe.py [--json F]
"""
from __future__ import annotations

import argparse
import types

import torch

import gpuops as go
from gpuops.bench import graph_replay_us, kernel_times_us, write_experiment_json
from gpuops.ops import gemm as G


def _with(fn, **knobs):
    def call():
        saved = {k: getattr(G, k) for k in knobs if k != "PLAN_WGMMA"}
        plan = G.PLAN["wgmma"]
        for k, v in knobs.items():
            if k == "PLAN_WGMMA":
                G.PLAN["wgmma"] = v
            else:
                setattr(G, k, v)
        try:
            return fn()
        finally:
            for k, v in saved.items():
                setattr(G, k, v)
            G.PLAN["wgmma"] = plan
    return call


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--shapes", default="128x6144x2048,32x2048x6144")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for spec in args.shapes.split(","):
        M, N, K = (int(v) for v in spec.split("x"))
        x = (torch.randn(M, K, device="cuda", generator=g) * K ** -0.25).to(torch.bfloat16)
        w = torch.randn(N, K, device="cuda", generator=g).to(torch.bfloat16)
        lin = lambda: go.linear(x, w)  # noqa: E731
        variants = {
            "unsplit tma_fused": _with(lin, WGMMA_SPLIT_K=False),
            "unsplit direct": _with(lin, WGMMA_SPLIT_K=False, PLAN_WGMMA="direct"),
            "unsplit direct fp32 out": _with(lambda: go.matmul(x, w.T, out_dtype="float32"),
                                             WGMMA_SPLIT_K=False),
            "cuBLAS": lambda: torch.nn.functional.linear(x, w),
        }
        for mx in (2, 4, 8, 16):
            variants[f"split max {mx}"] = _with(lin, WGMMA_SPLIT_MAX=mx)
        print(f"== {M}x{N}x{K} bf16")
        for name, fn in variants.items():
            us = graph_replay_us(fn, calls=10, replays=10)
            ks = kernel_times_us(fn, calls=10)
            knobs = {}
            if name.startswith("split"):
                saved = G.WGMMA_SPLIT_MAX
                G.WGMMA_SPLIT_MAX = int(name.split()[-1])
                knobs = dict(zip(("splits", "k_split"), G._wgmma_split(
                    types.SimpleNamespace(M=M, N=N, K=K, batch=1), sms)))
                G.WGMMA_SPLIT_MAX = saved
            rows.append(dict(shape=[M, N, K], variant=name, graph_us=us, kernels=ks, **knobs))
            parts = ", ".join(f"{k.split('(')[0][-40:]} {v:.2f}" for k, v in ks.items())
            print(f"  {name:<26} {us:8.2f} us  {knobs}  [{parts}]", flush=True)
    if args.json:
        write_experiment_json(args.json, None, rows)


if __name__ == "__main__":
    main()
