"""Where the Hopper attention forward's time goes: the wgmma kernel (variant 'wgmma', the
ping-pong schedule) timed against probe builds of the same source that leave one part out
(PROBE bits of cuda_src/attention/flash_fwd_wgmma.cu; their outputs are wrong by design, only
their time counts): 1 the softmax (visibility, max, exp2, sums), 2 the O += P V products, 4 the
O rescale. bf16, H32 S4096, kernel time = median of CUDA events after warm-up.

    python benchmarks/experiments/attention_wgmma_probe.py [--json F]
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

SHAPES = ((1, 128, False), (1, 128, True), (4, 128, False), (1, 64, False))   # (B, D, causal)
PROBES = (0, 1, 2, 4, 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    bf = dt.bfloat16
    kernels = {at.wgmma_expr(bf, d, "pingpong", pr): at.WGMMA_ARGS for d in at.WGMMA_DIMS
               for pr in PROBES}
    module = KernelModule("attention.flash_wgmma_probe_bf16", "attention/flash_fwd_wgmma.cu",
                          kernels, archs=("90a",))
    at._WGMMA_KERNELS[bf] = lay.KernelTable(module)
    expr0 = at.wgmma_expr
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    H, S = 32, 4096
    for B, D, causal in SHAPES:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=gen, dtype=torch.bfloat16)
                   for _ in range(3))
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        base = None
        for probe in PROBES:
            at.wgmma_expr = lambda dtype, d, sch, probe=probe: expr0(dtype, d, sch, probe)
            ms = event_pairs_ms(lambda: go.scaled_dot_product_attention(
                q, k, v, is_causal=causal, variant="wgmma"), 20)
            base = base or ms
            print(f"B{B} H{H} S{S} D{D} causal={int(causal)} probe {probe}: {ms:.4f} ms "
                  f"({flops / ms / 1e9:.0f} TFLOP/s-equivalent, {100 * (ms / base - 1):+.1f}%)",
                  flush=True)
            rows.append(dict(B=B, H=H, S=S, D=D, causal=causal, probe=probe, ms=ms))
        at.wgmma_expr = expr0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
