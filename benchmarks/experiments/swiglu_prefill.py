"""swiglu_linear at prefill sizes on Hopper: the two wgmma products (gate, then up with the gated
epilogue) against the one-kernel dual 'mma' product, torch's silu(F.linear) * F.linear and the
two cuBLAS products alone (the peer's floor), bf16, CUDA-graph replay (graph_and_body_rows: the
variants alternate within each of 3 rounds). Sets SWIGLU_WGMMA_MIN_WAVES: where the wgmma pair
stops beating the dual kernel as M shrinks.

Before timing, each gpuops variant's output is compared with torch's (relative Frobenius error;
the float64 checks are the GPU tests'). TFLOP/s counts both products (4 M N K).

    python benchmarks/experiments/swiglu_prefill.py [--json F] [--shapes 4096x4096x4096,...]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import gpuops as go
from gpuops.bench import graph_and_body_rows, write_experiment_json

SHAPES = "4096x4096x4096,8192x6144x2048,2048x6144x2048,512x6144x2048,256x6144x2048,128x6144x2048"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--shapes", default=SHAPES, help="MxNxK, comma-separated")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for spec in args.shapes.split(","):
        M, N, K = (int(v) for v in spec.split("x"))
        x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.float32).mul_(K ** -0.25)
        x = x.to(dtype)
        wg, wu = (torch.randn(N, K, device="cuda", generator=g).to(dtype) for _ in range(2))
        ref = F.silu(F.linear(x, wg)) * F.linear(x, wu)
        variants = {
            "gpuops auto": lambda: go.swiglu_linear(x, wg, wu),
            "gpuops wgmma pair": lambda: go.swiglu_linear(x, wg, wu, variant="wgmma"),
            "gpuops mma dual": lambda: go.swiglu_linear(x, wg, wu, variant="mma"),
            "torch silu(linear)*linear": lambda: F.silu(F.linear(x, wg)) * F.linear(x, wu),
            "cuBLAS two linears only": lambda: (F.linear(x, wg), F.linear(x, wu)),
        }
        print(f"== {M}x{N}x{K} {args.dtype}")
        errs = {}
        for name in ("gpuops auto", "gpuops wgmma pair", "gpuops mma dual"):
            out = variants[name]().float()
            errs[name] = float((out - ref.float()).norm() / ref.float().norm())
            print(f"  {name:<28} rel. error against torch {errs[name]:.2e}")
        flops = 4.0 * M * N * K
        for r in graph_and_body_rows(variants, calls=5, replays=10, rounds=3, width=30):
            r.update(shape=[M, N, K], dtype=args.dtype, tflops=flops / r["graph_us"] / 1e6,
                     rel_err_vs_torch=errs.get(r["variant"]))
            rows.append(r)
        base = next(r["graph_us"] for r in rows[-5:] if r["variant"].startswith("torch"))
        for r in rows[-5:]:
            print(f"  {r['variant']:<28} {r['graph_us']:9.1f} us {r['tflops']:7.1f} TFLOP/s "
                  f"{base / r['graph_us']:6.3f}x torch", flush=True)
    if args.json:
        write_experiment_json(args.json, None, rows)


if __name__ == "__main__":
    main()
