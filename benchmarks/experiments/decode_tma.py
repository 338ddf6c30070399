"""Decode attention on Hopper: decode_split_tma (K/V through a TMA-filled shared-memory ring,
tensor-core math) against the register kernel (decode_split) and torch SDPA, in one process.

Per shape (B, S, Hq, Hkv, D), bf16, one query token, full caches in [B, S, Hkv, D] (and, for
B1 S8192, [B, Hkv, S, D] viewed so), CUDA-graph replay of 20 calls over caches rotated through
> 3x the L2 (decode_b1_floor.py's method): the op with attention_decode.RING 'off' and 'on',
each also with the combine a no-op (split kernel only), TMA_SPLIT variants (blocks per SM 1 / 2,
two waves), and torch SDPA; the largest difference from the register kernel's output.

    python benchmarks/experiments/decode_tma.py [--json out.json] [--shapes 1x8192,16x4096]
"""
from __future__ import annotations

import argparse
import json
import sys

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])

import torch  # noqa: E402

import gpuops as go  # noqa: E402
from gpuops.bench import graph_replay_us, rotating  # noqa: E402
from gpuops.ops import attention_decode as AD  # noqa: E402
from gpuops.runtime.modules import KernelModule  # noqa: E402
from decode_b1_floor import L2_BYTES, _without, rotated_caches, start_results  # noqa: E402


_NOMATH: dict = {}   # the module built with GPUOPS_DTMA_NOMATH=1 (--nomath), once


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--shapes", default="1x8192,16x4096,4x8192,1x32768",
                    help="BxS[xHqxHkvxSq] list (default Hq 16, Hkv 8, Sq 1; D 128)")
    ap.add_argument("--variants", default="2,2:2", help="TMA_SPLIT variants blocks_per_sm[:waves]")
    ap.add_argument("--nomath", action="store_true",
                    help="also the ring without the math (GPUOPS_DTMA_NOMATH: the "
                         "streaming rate alone, split kernel only, results garbage)")
    ap.add_argument("--warm", action="store_true",
                    help="also the register and TMA kernels on one L2-resident cache")
    args = ap.parse_args()
    AD.RING_KERNEL = "tma"                  # this script is about decode_split_tma
    copy, res, record = start_results("shape", (14, 52))

    saved = AD._kernel
    split_only = _without(AD.COMBINE_MODULE, saved)
    td = torch.bfloat16
    dim = 128
    for spec in args.shapes.split(","):
        given = [int(x) for x in spec.split("x")]
        b, s, hq, hkv, sq = (given + [16, 8, 1][len(given) - 2:])[:5]
        name = f"B{b} S{s}" + (f" {hq}/{hkv} Sq{sq}" if (hq, hkv, sq) != (16, 8, 1) else "")
        kv_bytes, bshd, gen = rotated_caches(b, s, hkv, dim, td)
        nrot = len(bshd)
        layouts = [("bshd", bshd)]
        if b == 1 and s == 8192:
            layouts.append(("bhsd", [(k.transpose(1, 2).contiguous().transpose(1, 2),
                                      v.transpose(1, 2).contiguous().transpose(1, 2))
                                     for k, v in bshd]))
        q = torch.randn(b, sq, hq, dim, device="cuda", dtype=td, generator=gen)
        lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        print(f"{name}: {kv_bytes / 1e6:.1f} MB of K/V, floor {kv_bytes / copy / 1e3:.2f} us, "
              f"{nrot} caches rotated", flush=True)
        for layout, caches in layouts:
            AD.RING = "off"
            ref = go.decode_attention(q, *caches[0], lens).float()
            dec = rotating(lambda k, v: go.decode_attention(q, k, v, lens), caches)
            tag = f"{name} {layout}"
            record(tag, "register kernel (TMA off)", graph_replay_us(dec), kv_bytes, tma="off")
            AD._kernel = split_only
            try:
                record(tag, "register kernel, split only", graph_replay_us(dec), kv_bytes,
                       tma="off", split_only=True)
            finally:
                AD._kernel = saved
            if args.warm and kv_bytes < 0.8 * L2_BYTES:
                warm = rotating(lambda k, v: go.decode_attention(q, k, v, lens), caches[:1])
                record(tag, "register kernel, L2-warm", graph_replay_us(warm), kv_bytes,
                       tma="off", warm=True)
                AD.RING = "on"
                record(tag, "TMA default, L2-warm", graph_replay_us(warm), kv_bytes,
                       tma="default", warm=True)
            AD.RING = "on"
            variants = [x for x in args.variants.split(",") if x]
            runs = [(v, False) for v in ["default"] + variants] + (
                [("default", True)] if args.nomath else [])
            for var, nomath in runs:
                if nomath:
                    if not _NOMATH:
                        _NOMATH["module"] = KernelModule(
                            "attention.decode_split_tma_nomath", "attention/decode_split_tma.cu",
                            dict(AD.TMA_MODULE.kernels), options=("-DGPUOPS_DTMA_NOMATH=1",),
                            archs=("90",))
                    mod = _NOMATH["module"]
                    AD._kernel = (lambda m, dev, e, mod=mod:
                                  saved(mod if m is AD.TMA_MODULE else m, dev, e))
                saved_split = dict(AD.RING_SPLIT)
                if var != "default":
                    per, _, waves = var.partition(":")
                    AD.RING_SPLIT.update(blocks_per_sm=int(per), waves=int(waves or 1))
                AD._plans.clear()
                try:
                    got = go.decode_attention(q, *caches[0], lens).float()
                    diff = float((got - ref).abs().max())
                    plan = AD._plan_ring("decode_attention", AD.dt.bfloat16, _T(q),
                                         _T(caches[0][0]), s, 0, "tma")
                    what = f"TMA {var} ({plan[3]} x {plan[4]} keys)" + (
                        " NO MATH" if nomath else "")
                    if not nomath:
                        record(tag, what, graph_replay_us(dec), kv_bytes, tma=var,
                               splits=plan[3], chunk=plan[4],
                               max_diff_vs_register=diff)
                    AD._kernel = _without(AD.COMBINE_MODULE, AD._kernel)
                    record(tag, what + ", split only", graph_replay_us(dec), kv_bytes, tma=var,
                           split_only=True, nomath=nomath)
                finally:
                    AD._kernel = saved
                    AD.RING_SPLIT.clear()
                    AD.RING_SPLIT.update(saved_split)
                    AD._plans.clear()
            sdpa = rotating(lambda k, v: AD._sdpa(q, k, v), caches)
            record(tag, "torch SDPA", graph_replay_us(sdpa), kv_bytes)
        del bshd, layouts
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


class _T:
    """The shape of a torch tensor as gpuops' plans read it."""
    def __init__(self, t):
        self.shape = tuple(t.shape)


if __name__ == "__main__":
    main()
