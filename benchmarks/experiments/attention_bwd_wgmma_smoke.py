"""First look at the Hopper attention backward (variant 'wgmma'): one small call per head dim and
mode, its gradients against variant 'mma' on the same forward output (relative Frobenius error,
printed), then one timed call per shape. Meant to run under `timeout` before the test files, so a
kernel that hangs costs seconds, not a device call.

    timeout 60 python benchmarks/experiments/attention_bwd_wgmma_smoke.py
"""
from __future__ import annotations

import torch

import gpuops as go
from gpuops.bench import event_pairs_ms

CASES = [  # (B, Hq, Hkv, S, D, options)
    (1, 2, 2, 256, 128, {}),
    (1, 2, 2, 256, 64, {}),
    (1, 4, 2, 300, 128, {"is_causal": True, "enable_gqa": True}),
    (1, 4, 2, 300, 64, {"is_causal": True, "enable_gqa": True}),
    (2, 16, 16, 4096, 128, {}),
    (2, 16, 16, 4096, 128, {"is_causal": True}),
]


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for B, Hq, Hkv, S, D, opt in CASES:
        q, g = (torch.randn(B, Hq, S, D, device="cuda", generator=gen, dtype=torch.bfloat16)
                for _ in range(2))
        k, v = (torch.randn(B, Hkv, S, D, device="cuda", generator=gen, dtype=torch.bfloat16)
                for _ in range(2))
        out, lse = go.scaled_dot_product_attention(q, k, v, return_lse=True, **opt)
        res = {}
        for variant in ("mma", "wgmma"):
            res[variant] = go.scaled_dot_product_attention_backward(g, q, k, v, out, lse,
                                                                    variant=variant, **opt)
        torch.cuda.synchronize()
        errs = [((a.float() - b.float()).norm() / b.float().norm()).item()
                for a, b in zip(res["wgmma"], res["mma"])]
        line = f"B{B} H{Hq}/{Hkv} S{S} D{D} {opt}: wgmma vs mma dq/dk/dv " + \
            "/".join(f"{e:.1e}" for e in errs)
        if S >= 4096:
            flops = 2.5 * 4 * B * Hq * S * S * D / (2 if opt.get("is_causal") else 1)
            for variant in ("mma", "wgmma"):
                ms = event_pairs_ms(lambda variant=variant: go.scaled_dot_product_attention_backward(
                    g, q, k, v, out, lse, variant=variant, **opt), 10)
                line += f"  {variant} {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
