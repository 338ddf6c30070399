"""Cost of RoPE fused into the flash forward: gpuops.scaled_dot_product_attention with
rotary_cos / rotary_sin, in both forms of the tensor-core kernel (PLAN["rotary"]):

* `fused_ms`: "prepass", the default: K rotated once per call into a scratch array
  (attention.rope_k), then the mma kernel rotating only Q, before its key loop;
* `fused_in_loop_ms`: "in_loop", the form of run 31: every K tile rotated in shared memory as it
  lands, once per query block;

against `plain_ms` (attention without rotary: the floor of the fused form) and
`apply_rotary_then_sdpa_ms` (gpuops.apply_rotary of q and k, then SDPA). `q_only_ms` runs the
prepass form's kernel without the pre-pass (K unrotated: a wrong result, timed only), so
`q_only_ms - plain_ms` is the cost of rotating Q in the kernel and `fused_ms - q_only_ms` the
pre-pass's. `*_graph_ms`: the same calls replayed from a CUDA graph (no host launch gaps
between the pre-pass and the kernel). `fused_simt_ms` / `plain_simt_ms` (B1 only): the SIMT
kernel's in-loop rotation cost (it has no pre-pass form: benchmarks/notes_attention.md).

    python benchmarks/experiments/attention_rotary_fused.py [--json rope_attn.json]

Shapes: [B, S, H, D] ('bshd', as a projection writes them), bf16, H = 32, D = 128, S = 4096,
B = 1 and 2, causal; full rotary (R = 128) and partial (R = 64), NeoX and GPT-J pairs; tables
[S, R/2] in float32. Timing: gpuops.bench.events_ms (CUDA events per call, medians).
"""
from __future__ import annotations

import argparse
import json

import torch

import gpuops
from gpuops.bench import events_ms
from gpuops.ops import attention as at


def graph_ms(fn):
    """events_ms of a CUDA graph replay of fn (captured after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return events_ms(graph.replay)


def with_form(form, fn):
    def run():
        saved = at.PLAN["rotary"]
        at.PLAN["rotary"] = form
        try:
            return fn()
        finally:
            at.PLAN["rotary"] = saved
    return run


def without_prepass(fn):
    """fn with the pre-pass skipped (the Q-only kernel reads K unrotated): timing only."""
    def run():
        saved = at.rope_k_scratch
        at.rope_k_scratch = lambda call, p, query, key, *rest: key
        try:
            return fn()
        finally:
            at.rope_k_scratch = saved
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true",
                    help="B = 1, full rotary dim only, no SIMT rows (a short device call)")
    args = ap.parse_args()
    rows = []
    H, D, S = 32, 128, 4096
    print("schedules: plain", at.MMA_TILES[D], "prepass", at.mma_config(D, False, at.MMA_ROTARY_Q),
          "in_loop", at.mma_config(D, False, at.MMA_VARLEN | at.MMA_ROTARY))
    for B in ((1,) if args.quick else (1, 2)):
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        kw = dict(is_causal=True, layout="bshd")
        plain = lambda: gpuops.scaled_dot_product_attention(q, k, v, **kw)  # noqa: E731
        plain_ms, plain_graph = events_ms(plain), graph_ms(plain)
        plain_simt = None
        if B == 1 and not args.quick:
            plain_simt = events_ms(lambda: gpuops.scaled_dot_product_attention(
                q, k, v, variant="simt", **kw), budget_s=0.5)
        for half in ((64,) if args.quick else (64, 32)):
            inv = 10000.0 ** (-torch.arange(half, device="cuda") / half)
            ang = torch.arange(S, device="cuda")[:, None] * inv[None, :]
            cos, sin = ang.cos(), ang.sin()
            for inter in (False, True):
                rkw = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=inter, **kw)
                fused = lambda: gpuops.scaled_dot_product_attention(q, k, v, **rkw)  # noqa: E731

                def two_step():
                    qr, kr = gpuops.apply_rotary(q, k, cos, sin, inter, rotary_dim=2 * half)
                    return gpuops.scaled_dot_product_attention(qr, kr, v, **kw)
                prepass, in_loop = with_form("prepass", fused), with_form("in_loop", fused)
                row = {"B": B, "rotary_dim": 2 * half, "interleaved": inter,
                       "plain_ms": plain_ms,
                       "fused_ms": events_ms(prepass),
                       "fused_in_loop_ms": events_ms(in_loop),
                       "q_only_ms": events_ms(without_prepass(prepass)),
                       "apply_rotary_then_sdpa_ms": events_ms(two_step),
                       "plain_graph_ms": plain_graph,
                       "fused_graph_ms": graph_ms(prepass),
                       "fused_in_loop_graph_ms": graph_ms(in_loop),
                       "apply_rotary_then_sdpa_graph_ms": graph_ms(two_step)}
                if plain_simt is not None:
                    row["plain_simt_ms"] = plain_simt
                    row["fused_simt_ms"] = events_ms(lambda: gpuops.scaled_dot_product_attention(
                        q, k, v, variant="simt", **rkw), budget_s=0.5)
                    row["simt_rope_cost_pct"] = 100 * (row["fused_simt_ms"] / plain_simt - 1)
                row["fused_overhead_pct"] = 100 * (row["fused_ms"] / row["plain_ms"] - 1)
                row["fused_graph_overhead_pct"] = 100 * (row["fused_graph_ms"] / plain_graph - 1)
                row["in_loop_overhead_pct"] = 100 * (row["fused_in_loop_ms"] / row["plain_ms"] - 1)
                row["q_rotation_pct"] = 100 * (row["q_only_ms"] / row["plain_ms"] - 1)
                row["prepass_est_ms"] = row["fused_ms"] - row["q_only_ms"]
                row["vs_two_step"] = row["apply_rotary_then_sdpa_ms"] / row["fused_ms"]
                print({x: round(y, 4) if isinstance(y, float) else y for x, y in row.items()})
                rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "plan": dict(at.PLAN),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
