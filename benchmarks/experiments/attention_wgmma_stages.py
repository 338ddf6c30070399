"""The Hopper attention forward at head dim 64 with deeper K / V rings than the default 4 stages
(run 50: 4 stages at D64 gave +8-15% over 2): each depth in --depths is compiled as its own
module (the kernel's GPUOPS_WGA_STAGES_D64) and timed beside the default and SDPA's cuDNN
backend in the same process. bf16, H32 S4096, pingpong, median of CUDA events.

    python benchmarks/experiments/attention_wgmma_stages.py [--json F] [--depths 4,6]
"""
from __future__ import annotations

import argparse
import json

import torch

import gpuops as go
from gpuops import dtypes as dt
from gpuops.bench import event_pairs_ms
from gpuops.ops import _layout as lay
from gpuops.ops import attention as at
from gpuops.runtime.modules import KernelModule


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--depths", default="4,6")
    args = ap.parse_args()
    bf, D, H, S = dt.bfloat16, 64, 32, 4096
    expr = at.wgmma_expr(bf, D, "pingpong")
    tables, stages0, kernels0 = {}, at.wgmma_stages, at._WGMMA_KERNELS[bf]
    for n in (int(x) for x in args.depths.split(",")):
        m = KernelModule(f"attention.flash_wgmma_d64_stages{n}", "attention/flash_fwd_wgmma.cu",
                         {expr: at.WGMMA_ARGS}, options=(f"-DGPUOPS_WGA_STAGES_D64={n}",),
                         archs=("90a",))
        tables[n] = lay.KernelTable(m)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    peers = at._bench_peers()
    for B in (1, 4):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=gen, dtype=torch.bfloat16)
                   for _ in range(3))
        for causal in (False, True):
            flops = 4 * B * H * S * S * D / (2 if causal else 1)
            ref = peers["sdpa_flash"](q, k, v, is_causal=causal).float()
            res = {"sdpa_cudnn": event_pairs_ms(lambda: peers["sdpa_cudnn"](q, k, v,
                                                                             is_causal=causal))}
            for n, table in tables.items():
                at._WGMMA_KERNELS[bf] = table
                at.wgmma_stages = lambda d, n=n: n if d == 64 else stages0(d)
                out = go.scaled_dot_product_attention(q, k, v, is_causal=causal, variant="wgmma")
                err = ((out.float() - ref).norm() / ref.norm()).item()
                res[f"stages{n}"] = event_pairs_ms(lambda: go.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, variant="wgmma"))
                print(f"  stages {n}: err vs FLASH {err:.1e}")
            at._WGMMA_KERNELS[bf], at.wgmma_stages = kernels0, stages0
            cudnn = res["sdpa_cudnn"]
            for name, ms in res.items():
                print(f"B{B} H{H} S{S} D{D} causal={int(causal)} {name:10s} {ms:.4f} ms "
                      f"{flops / ms / 1e9:6.1f} TFLOP/s {cudnn / ms:5.2f}x cuDNN", flush=True)
                rows.append(dict(B=B, causal=causal, name=name, ms=ms, tflops=flops / ms / 1e9))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
