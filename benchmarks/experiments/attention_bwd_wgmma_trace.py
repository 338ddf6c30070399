"""A clock64 trace of the Hopper attention backward's query-tile loop (PROBE bit 3 of
cuda_src/attention/flash_bwd_wgmma.cu): thread 0 of each consumer warpgroup of one block (the
middle of the grid) records 8 points per iteration: loop top, Q / dO landed, S^T / dP^T issued
(and the previous tile's dq reduction), S^T / dP^T done, P^T / dS^T packed, dS^T exchanged
(barrier), dV / dK / dQ done, dq staged. Printed as mean cycles per phase per warpgroup and the
iteration period. bf16 B2 H16 S4096 (the gradients of this build are garbage).

    python benchmarks/experiments/attention_bwd_wgmma_trace.py [--json F] [--dim 128] [--causal]
"""
from __future__ import annotations

import argparse
import json

import torch

import gpuops as go
from gpuops import dtypes as dt
from gpuops.bench import clock_trace_phases
from gpuops.ops import _layout as lay
from gpuops.ops import attention_backward as ab
from gpuops.runtime.modules import KernelModule

EVENTS = ("top", "data", "issued", "sdp_done", "packed", "ds_barrier", "products_done", "staged")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tiles", type=int, default=64,
                    help="query tiles of the traced block (64 for S4096 without causal; fewer "
                         "rows are read past the trace)")
    args = ap.parse_args()
    bf, D = dt.bfloat16, args.dim
    kernels = {ab.wgmma_expr(bf, D, 8): ab.WGMMA_ARGS}
    kernels.update({f(bf, D): ab.FLASH_BWD_ARGS
                    for f in (ab.wgmma_prep_expr, ab.wgmma_convert_expr)})
    module = KernelModule("attention.flash_bwd_wgmma_trace_bf16", "attention/flash_bwd_wgmma.cu",
                          kernels, archs=("90a",))
    ab._WGMMA_KERNELS[bf] = lay.KernelTable(module)
    expr0 = ab.wgmma_expr
    ab.wgmma_expr = lambda dtype, d, probe=0: expr0(dtype, d, 8)
    captured = {}

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, g = (torch.randn(2, 16, 4096, D, device="cuda", generator=gen, dtype=torch.bfloat16)
                  for _ in range(4))
    out, lse = go.scaled_dot_product_attention(q, k, v, is_causal=args.causal, return_lse=True)
    # the statistics workspace is the first float32 buffer _launch_wgmma_maps allocates
    import gpuops.ops.attention_backward as mod  # noqa: PLC0415
    orig = mod._launch_args

    def spy(*a, **kw):
        captured["stats"] = a[13].obj         # FlashBwdArgs' stats: the framework's tensor
        return orig(*a, **kw)
    mod._launch_args = spy
    for _ in range(3):
        go.scaled_dot_product_attention_backward(g, q, k, v, out, lse, is_causal=args.causal,
                                                 variant="wgmma")
    torch.cuda.synchronize()
    stats = captured["stats"]
    n = 2 * 4096
    tr = stats.reshape(-1)[: 2 * n].view(torch.int64)[:n].reshape(2, 512, 8).cpu().tolist()
    # the traced block (the grid's middle: a first key block, all 64 query tiles when not causal)
    rows = clock_trace_phases(tr, EVENTS, 0, args.tiles)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
