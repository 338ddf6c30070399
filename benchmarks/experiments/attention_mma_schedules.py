"""scaled_dot_product_attention, tensor-core forward: the schedules of `variant='mma'` side by side
with torch's FLASH (FlashAttention-2) and cuDNN backends, bf16, H=32, S=4096, D=128.

Schedules (gpuops.ops.attention): MMA_TILES[128] (the default, what 'auto' runs) and each entry of
MMA_ALTERNATES[128] (compiled in the same module), as (warps, m16 tiles per warp, BC, Q in
registers, min blocks per SM, K/V stages): 4 x 32 rows BC 32 (default), 4 x 32 BC 64 (FA2's
tile), both with two K/V stages, and the 16-rows-per-warp schedules of run 18 (8 x 16, 4 x 16).
Predictions per schedule: benchmarks/notes_attention.md. Kernel time = median of CUDA events
around single calls after warm-up (each call is milliseconds: host time is noise). TFLOP/s =
4 B H S^2 D (halved for causal). One module compile (NVRTC, all schedules) on the first call.

    python benchmarks/experiments/attention_mma_schedules.py [--json F] [--batch 4] [--simt]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.attention import SDPBackend, sdpa_kernel

import gpuops as go
from gpuops.bench import event_pairs_ms
from gpuops.ops import attention as at


time_ms = event_pairs_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--simt", action="store_true", help="also time the SIMT kernel (slow)")
    args = ap.parse_args()
    B, H, S, D = args.batch, args.heads, args.seq, args.dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g, dtype=torch.bfloat16)
               for _ in range(3))
    default = at.MMA_TILES[D]
    schedules = [("mma " + str(default), default)] + [
        ("mma " + str(c), c) for c in at.MMA_ALTERNATES.get(D, ())]
    rows = []
    for causal in (False, True):
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        results = {}
        for backend, name in ((SDPBackend.FLASH_ATTENTION, "sdpa_flash"),
                              (SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn")):
            try:
                with sdpa_kernel(backend):
                    results[name] = time_ms(
                        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            except RuntimeError as exc:            # backend not available for this build
                print(f"{name}: {exc}")
        for name, cfg in schedules:
            at.MMA_TILES[D] = cfg
            out = go.scaled_dot_product_attention(q, k, v, is_causal=causal)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            results[name] = time_ms(lambda: go.scaled_dot_product_attention(q, k, v,
                                                                            is_causal=causal))
            print(f"  {name}: rel. error vs torch {err:.2e}, smem {at.mma_smem(D, cfg) // 1024} KB")
        at.MMA_TILES[D] = default
        if args.simt:
            results["simt"] = time_ms(lambda: go.scaled_dot_product_attention(
                q, k, v, is_causal=causal, variant="simt"), iters=3)
        flash = results.get("sdpa_flash")
        for name, ms in results.items():
            tf = flops / (ms * 1e-3) / 1e12
            ratio = f"{flash / ms:.2f}x FLASH" if flash else ""
            print(f"B{B} H{H} S{S} D{D} causal={int(causal)} {name:32s} {ms:8.3f} ms "
                  f"{tf:7.1f} TFLOP/s {ratio}")
            rows.append(dict(B=B, H=H, S=S, D=D, causal=causal, name=name, ms=ms, tflops=tf))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
