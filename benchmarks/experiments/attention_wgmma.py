"""scaled_dot_product_attention forward on Hopper: `variant='wgmma'` (FlashAttention-3's
structure; each of its WGMMA_SCHEDULES) side by side with `variant='mma'` (FlashAttention-2's,
mma.sync) and torch's FLASH (FlashAttention-2) and cuDNN SDPA backends, in one process, bf16,
H = 32, S = 4096.

Shapes: B in --batches, D in --dims (64, 128), causal and not. Kernel time = median of CUDA
events around single calls after warm-up (each call is 0.1+ ms: host time is noise). TFLOP/s =
4 B H S^2 D (halved for causal). Before timing, each gpuops variant's output is compared with
torch's FLASH output (relative Frobenius error; the float64 checks are the GPU tests').
Predictions: benchmarks/notes_attention.md ("wgmma forward").

    python benchmarks/experiments/attention_wgmma.py [--json F] [--batches 1,4] [--dims 128,64]
"""
from __future__ import annotations

import argparse
import json

import torch

import gpuops as go
from gpuops.bench import event_pairs_ms
from gpuops.ops import attention as at


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    H, S = args.heads, args.seq
    schedule0 = at.WGMMA_SCHEDULE
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for D in (int(x) for x in args.dims.split(",")):
        for B in (int(x) for x in args.batches.split(",")):
            q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g, dtype=torch.bfloat16)
                       for _ in range(3))
            for causal in (False, True):
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                results, errors = {}, {}
                peers = at._bench_peers()            # the bench's SDPA FLASH / cuDNN calls
                ref = peers["sdpa_flash"](q, k, v, is_causal=causal).float()
                for name, peer in peers.items():
                    try:
                        results[name] = event_pairs_ms(lambda: peer(q, k, v, is_causal=causal))
                    except RuntimeError as exc:        # backend not available for this build
                        print(f"{name}: {exc}")
                for name in [f"wgmma_{s}" for s in at.WGMMA_SCHEDULES] + ["mma"]:
                    variant = name.split("_")[0]
                    if variant == "wgmma":
                        at.WGMMA_SCHEDULE = name.split("_", 1)[1]
                    out = go.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                          variant=variant)
                    errors[name] = ((out.float() - ref).norm() / ref.norm()).item()
                    results[name] = event_pairs_ms(
                        lambda: go.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                variant=variant))
                at.WGMMA_SCHEDULE = schedule0
                flash, mma = results.get("sdpa_flash"), results["mma"]
                for name, ms in results.items():
                    tf = flops / (ms * 1e-3) / 1e12
                    extra = f" err vs FLASH {errors[name]:.1e}" if name in errors else ""
                    print(f"B{B} H{H} S{S} D{D} causal={int(causal)} {name:15s} {ms:8.4f} ms "
                          f"{tf:6.1f} TFLOP/s  {flash / ms if flash else 0:5.2f}x FLASH  "
                          f"{mma / ms:5.2f}x mma{extra}")
                    rows.append(dict(B=B, H=H, S=S, D=D, causal=causal, name=name, ms=ms,
                                     tflops=tf, err_vs_flash=errors.get(name)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
