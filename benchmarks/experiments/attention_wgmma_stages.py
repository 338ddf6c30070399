"""Build variants of the Hopper attention forward, each compiled as its own module and timed
beside SDPA's cuDNN backend in the same process (bf16, H32 S4096, pingpong, median of CUDA
events): K / V ring depths at head dim 64 (--depths; the kernel's GPUOPS_WGA_STAGES_D64; run 55:
4 stays best), and with --wait-after the default build with the P V wait kept after the softmax
(GPUOPS_WGA_WAIT_AFTER; run 48 measured it slower, with the 2-stage ring).

    python benchmarks/experiments/attention_wgmma_stages.py [--json F] [--dim 64] [--depths 4,6]
        [--wait-after]
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
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--wait-after", action="store_true",
                    help="also time the default depth with the P V wait kept after the softmax "
                         "(GPUOPS_WGA_WAIT_AFTER)")
    args = ap.parse_args()
    bf, D, H, S = dt.bfloat16, args.dim, 32, 4096
    expr = at.wgmma_expr(bf, D, "pingpong")
    tables, stages0, kernels0, smem0 = {}, at.wgmma_stages, at._WGMMA_KERNELS[bf], at.wgmma_smem
    builds = [("default", ())]
    if D == 64:
        builds += [(int(x), (f"-DGPUOPS_WGA_STAGES_D64={x}",)) for x in args.depths.split(",")
                   if x and int(x) != stages0(64)]
    if args.wait_after:
        builds.append(("wait_after", ("-DGPUOPS_WGA_WAIT_AFTER",)))
    for n, opts in builds:
        m = KernelModule(f"attention.flash_wgmma_d{D}_{n}", "attention/flash_fwd_wgmma.cu",
                         {expr: at.WGMMA_ARGS}, options=opts, archs=("90a",))
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
                if n == "wait_after":
                    at.wgmma_smem = lambda d: smem0(d) + (8 if d == 128 else 0)   # scratch
                elif n != "default":
                    at.wgmma_stages = lambda d, n=n: n if d == 64 else stages0(d)
                name = n if isinstance(n, str) else f"stages{n}"
                out = go.scaled_dot_product_attention(q, k, v, is_causal=causal, variant="wgmma")
                err = ((out.float() - ref).norm() / ref.norm()).item()
                res[name] = event_pairs_ms(lambda: go.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, variant="wgmma"))
                print(f"  {name}: err vs FLASH {err:.1e}")
                at.wgmma_stages, at.wgmma_smem = stages0, smem0
            at._WGMMA_KERNELS[bf] = kernels0
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
