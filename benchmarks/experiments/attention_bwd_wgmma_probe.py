"""Where the Hopper attention backward's time goes: the wgmma kernel (variant 'wgmma') timed
against probe builds of the same source that leave one part out (PROBE bits of
cuda_src/attention/flash_bwd_wgmma.cu; their gradients are wrong by design, only their time
counts): 1 the dq reduction (run 44: fp32 atomics; since: the staging and bulk reduce-add), 2
the whole dQ phase (dS^T store, the barrier of the two consumer
warpgroups, dQ = dS K, the atomics), 4 the elementwise P^T / dS^T math. The difference to the
full kernel bounds what each part costs where it is not overlapped. bf16, kernel time = median
of CUDA events (single calls after warm-up; the preprocess and dq conversion included).

    python benchmarks/experiments/attention_bwd_wgmma_probe.py [--json F]
"""
from __future__ import annotations

import argparse
import json

import torch

import gpuops as go
from gpuops import dtypes as dt
from gpuops.bench import event_pairs_ms
from gpuops.ops import _layout as lay
from gpuops.ops import attention_backward as ab
from gpuops.runtime.modules import KernelModule

SHAPES = ((2, 16, 4096, 128, False), (2, 16, 4096, 128, True), (4, 16, 2048, 64, True))
PROBES = (0, 1, 2, 4, 6)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    bf = dt.bfloat16
    kernels = {ab.wgmma_expr(bf, d, pr): ab.WGMMA_ARGS for d in ab.WGMMA_DIMS for pr in PROBES}
    kernels.update({f(bf, d): ab.FLASH_BWD_ARGS for d in ab.WGMMA_DIMS
                    for f in (ab.wgmma_prep_expr, ab.wgmma_convert_expr)})
    module = KernelModule("attention.flash_bwd_wgmma_probe_bf16", "attention/flash_bwd_wgmma.cu",
                          kernels, archs=("90a",))
    ab._WGMMA_KERNELS[bf] = lay.KernelTable(module)
    expr0 = ab.wgmma_expr
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for B, H, S, D, causal in SHAPES:
        q, k, v, g = (torch.randn(B, H, S, D, device="cuda", generator=gen, dtype=torch.bfloat16)
                      for _ in range(4))
        out, lse = go.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True)
        flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
        base = None
        for probe in PROBES:
            ab.wgmma_expr = lambda dtype, d, probe=probe: expr0(dtype, d, probe)
            ms = event_pairs_ms(lambda: go.scaled_dot_product_attention_backward(
                g, q, k, v, out, lse, is_causal=causal, variant="wgmma"), 20)
            base = base or ms
            print(f"B{B} H{H} S{S} D{D} causal={int(causal)} probe {probe}: {ms:.3f} ms "
                  f"({flops / ms / 1e9:.0f} TFLOP/s-equivalent, {100 * (ms / base - 1):+.1f}%)",
                  flush=True)
            rows.append(dict(B=B, H=H, S=S, D=D, causal=causal, probe=probe, ms=ms))
        ab.wgmma_expr = expr0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
