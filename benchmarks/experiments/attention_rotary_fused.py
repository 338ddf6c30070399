"""Cost of RoPE fused into the flash forward: gpuops.scaled_dot_product_attention with
rotary_cos / rotary_sin, against gpuops.apply_rotary followed by the same attention, and
against attention without rotary (the floor of the fused form). 'auto' takes the tensor-core
kernel's rotary instantiation (bf16, sm_80+); `fused_simt_ms` times the SIMT kernel's fused
form for comparison with run 20 (where every rotary call took it). The rotary instantiation may
run on another schedule than dense calls (MMA_EXTRAS_TILES; at D = 128 it is MMA_TILES' own):
`plain_same_tile_ms` times attention without rotary on the rotary schedule, so `rope_cost_pct`
(fused against it) is the cost of the rotation itself, and `fused_overhead_pct` (against
`plain_ms`, the dense default) adds the schedule's where they differ.

    python benchmarks/experiments/attention_rotary_fused.py [--json rope_attn.json]

Shapes: [B, S, H, D] ('bshd', as a projection writes them), bf16, H = 32, D = 128, S = 4096,
B = 1 and 2, causal; full rotary (R = 128) and partial (R = 64), NeoX and GPT-J pairs; tables
[S, R/2] in float32. Timing: CUDA events around each call, median of 20 after 3 warm-ups.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

import gpuops
from gpuops.ops import attention as at


def time_ms(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    H, D, S = 32, 128, 4096
    for B in (1, 2):
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for half in (64, 32):
            inv = 10000.0 ** (-torch.arange(half, device="cuda") / half)
            ang = torch.arange(S, device="cuda")[:, None] * inv[None, :]
            cos, sin = ang.cos(), ang.sin()
            for inter in (False, True):
                kw = dict(is_causal=True, layout="bshd")
                plain = lambda: gpuops.scaled_dot_product_attention(q, k, v, **kw)  # noqa: E731
                fused = lambda: gpuops.scaled_dot_product_attention(  # noqa: E731
                    q, k, v, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=inter, **kw)
                fused_simt = lambda: gpuops.scaled_dot_product_attention(  # noqa: E731
                    q, k, v, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=inter,
                    variant="simt", **kw)

                def plain_same_tile():
                    # the dense kernel on the rotary instantiation's schedule (an alternate
                    # compiled in the dense module when it differs from MMA_TILES)
                    saved = at.MMA_TILES[D]
                    at.MMA_TILES[D] = at.mma_config(D, False, at.MMA_VARLEN | at.MMA_ROTARY)
                    try:
                        return plain()
                    finally:
                        at.MMA_TILES[D] = saved

                def two_step():
                    qr, kr = gpuops.apply_rotary(q, k, cos, sin, inter, rotary_dim=2 * half)
                    return gpuops.scaled_dot_product_attention(qr, kr, v, **kw)
                row = {"B": B, "rotary_dim": 2 * half, "interleaved": inter,
                       "plain_ms": time_ms(plain), "plain_same_tile_ms": time_ms(plain_same_tile),
                       "fused_ms": time_ms(fused),
                       "fused_simt_ms": time_ms(fused_simt, iters=5),
                       "apply_rotary_then_sdpa_ms": time_ms(two_step)}
                row["fused_overhead_pct"] = 100 * (row["fused_ms"] / row["plain_ms"] - 1)
                row["rope_cost_pct"] = 100 * (row["fused_ms"] / row["plain_same_tile_ms"] - 1)
                print(row)
                rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
