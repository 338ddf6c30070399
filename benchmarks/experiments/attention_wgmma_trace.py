"""A clock64 trace of the Hopper attention forward's k-tile loop (PROBE bit 3 of
cuda_src/attention/flash_fwd_wgmma.cu): thread 0 of each consumer warpgroup of one block (the
middle of the grid) records 7 points per iteration: K ready, turn begun, products issued (turn
handed over), S done, softmax done, P V done, P packed. Printed per iteration as cycles since
the first mark, and as the mean duration of each phase per warpgroup. bf16, B1 H32 S4096.

    python benchmarks/experiments/attention_wgmma_trace.py [--json F] [--dim 128] [--causal]
"""
from __future__ import annotations

import argparse
import json

import torch

import gpuops as go
from gpuops import dtypes as dt
from gpuops.bench import clock_trace_phases
from gpuops.ops import _layout as lay
from gpuops.ops import attention as at
from gpuops.runtime.modules import KernelModule

EVENTS = ("k_ready", "turn", "issued", "s_done", "softmax", "pv_done", "packed")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    bf, D = dt.bfloat16, args.dim
    expr = at.wgmma_expr(bf, D, "pingpong", 8)
    module = KernelModule("attention.flash_wgmma_trace_bf16", "attention/flash_fwd_wgmma.cu",
                          {expr: at.WGMMA_ARGS}, archs=("90a",))
    at._WGMMA_KERNELS[bf] = lay.KernelTable(module)
    at.wgmma_expr = lambda dtype, d, sch: expr
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 32, 4096, D, device="cuda", generator=gen, dtype=torch.bfloat16)
               for _ in range(3))
    for _ in range(3):                      # warm-up; the last call's trace is read
        out, lse = go.scaled_dot_product_attention(q, k, v, is_causal=args.causal,
                                                   return_lse=True, variant="wgmma")
    torch.cuda.synchronize()
    tr = lse.reshape(-1).view(torch.int64)[: 2 * 4096].reshape(2, 512, 8).cpu().tolist()
    # the loop's iterations are 1 .. S / 128 - 1 (tile 0 is the prologue)
    rows = clock_trace_phases(tr, EVENTS, 1, 4096 // 128)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
