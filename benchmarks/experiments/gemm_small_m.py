"""bf16 linear with few output tiles on Hopper (M = 17..512: short prompts, batched decode): the
wgmma product with split-K (WGMMA_SPLIT_K, the default) and without it, 'mma', and cuBLAS
(torch F.linear), CUDA-graph replay (graph_and_body_rows: the variants alternate within each of
3 rounds). Also swiglu_linear there (auto; the dual 'mma' kernel) against torch's
silu(linear) * linear. Each gpuops output is compared with torch's (relative Frobenius error).

    python benchmarks/experiments/gemm_small_m.py [--json F] [--ms 32,64,128,256,512]
"""
from __future__ import annotations

import argparse
import types

import torch
import torch.nn.functional as F

import gpuops as go
from gpuops.bench import graph_and_body_rows, write_experiment_json
from gpuops.ops import gemm as G


def _no_split(fn):
    def call():
        saved = G.WGMMA_SPLIT_K
        G.WGMMA_SPLIT_K = False
        try:
            return fn()
        finally:
            G.WGMMA_SPLIT_K = saved
    return call


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--ms", default="32,64,128,256,512")
    ap.add_argument("--nk", default="6144x2048,2048x6144", help="NxK pairs")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for nk in args.nk.split(","):
        N, K = (int(v) for v in nk.split("x"))
        w = torch.randn(N, K, device="cuda", generator=g).to(torch.bfloat16)
        w2 = torch.randn(N, K, device="cuda", generator=g).to(torch.bfloat16)
        for M in (int(v) for v in args.ms.split(",")):
            x = (torch.randn(M, K, device="cuda", generator=g) * K ** -0.25).to(torch.bfloat16)
            splits, k_split = G._wgmma_split(types.SimpleNamespace(M=M, N=N, K=K, batch=1),
                                             torch.cuda.get_device_properties(0)
                                             .multi_processor_count)
            print(f"== linear {M}x{N}x{K} bf16 (split-K: {splits} x {k_split})")
            ref = F.linear(x, w).float()
            variants = {
                "gpuops linear (split-K)": lambda: go.linear(x, w),
                "gpuops linear (no split)": _no_split(lambda: go.linear(x, w)),
                "gpuops linear mma": lambda: go.linear(x, w, variant="mma"),
                "cuBLAS F.linear": lambda: F.linear(x, w),
                "gpuops swiglu auto": lambda: go.swiglu_linear(x, w, w2),
                "gpuops swiglu mma dual": lambda: go.swiglu_linear(x, w, w2, variant="mma"),
                "torch silu(linear)*linear": lambda: F.silu(F.linear(x, w)) * F.linear(x, w2),
            }
            for name in ("gpuops linear (split-K)", "gpuops linear (no split)"):
                out = variants[name]().float()
                print(f"  {name:<28} rel. error against torch "
                      f"{float((out - ref).norm() / ref.norm()):.2e}")
            for r in graph_and_body_rows(variants, calls=10, replays=10, rounds=3, width=30):
                r.update(shape=[M, N, K], splits=splits, k_split=k_split,
                         tflops=2.0 * M * N * K * (2 if "swiglu" in r["variant"]
                                                   or "silu" in r["variant"] else 1)
                         / r["graph_us"] / 1e6)
                rows.append(r)
    if args.json:
        write_experiment_json(args.json, None, rows)


if __name__ == "__main__":
    main()
