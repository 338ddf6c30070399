"""Decode attention's two ring kernels side by side: decode_split_tma (K/V by TMA from a producer
warp) and decode_split_async (K/V by cp.async from the 4 consumer warps, whole key rows), against
the register kernel (decode_split) and torch SDPA, in one process.

Per shape (B, S, Hq, Hkv, Sq, D; bf16, full caches [B, S, Hkv, D]), CUDA-graph replay of 20
calls over caches rotated through > 3x the L2 (decode_b1_floor.py's method): the op on the
register kernel (TMA 'off'), on each ring (TMA 'on', RING 'tma' / 'async'), each ring also split
only (the combine a no-op; with one split the ring writes the output itself and there is no
combine); the async ring with other stage counts (--stages, D 128, a module built here per count)
and split rules (--variants, blocks per SM[:waves]); the async ring without its math (--nomath:
GPUOPS_DASYNC_NOMATH, results garbage: its streaming rate alone); torch SDPA; the largest
difference from the register kernel's output. --paged P: also paged_attention over the same
caches cut into pages of P keys in a random order (the register kernel, both rings, torch with
its gather).

    python benchmarks/experiments/decode_ring.py [--json out.json] [--shapes 16x4096,1x8192]
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
from decode_b1_floor import _without, rotated_caches, start_results  # noqa: E402

_VARIANT_MODULES: dict = {}


def _async_module(dim, stages, nomath):
    """decode_split_async built with `stages` ring slots (head dim `dim`, bf16, contiguous), or
    None for the library's own module."""
    if stages == AD.ASYNC_STAGES[dim] and not nomath:
        return None
    key = (dim, stages, nomath)
    if key not in _VARIANT_MODULES:
        expr = AD._async_expr(AD.dt.bfloat16, dim, False, stages)
        _VARIANT_MODULES[key] = KernelModule(
            f"attention.decode_split_async_d{dim}s{stages}{'_nomath' if nomath else ''}",
            "attention/decode_split_async.cu", {expr: AD.ASYNC_ARGS},
            options=("-DGPUOPS_DASYNC_NOMATH=1",) if nomath else (), archs=AD.ASYNC_MODULE.archs)
    return _VARIANT_MODULES[key]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--shapes", default="16x4096,1x8192,1x8192x64x8,16x4096x64x8,4x8192x32x8x4",
                    help="BxS[xHqxHkvxSq[xD]] list (default Hq 16, Hkv 8, Sq 1, D 128)")
    ap.add_argument("--paged", default="", help="page sizes: also paged_attention")
    ap.add_argument("--stages", default="2,4", help="other ring depths of the async kernel")
    ap.add_argument("--variants", default="2", help="async split rules blocks_per_sm[:waves]")
    ap.add_argument("--nomath", action="store_true", help="also the async ring without math")
    args = ap.parse_args()
    copy, res, record = start_results("shape", (22, 44))
    saved_kernel = AD._kernel
    td = torch.bfloat16
    for spec in args.shapes.split(","):
        given = [int(x) for x in spec.split("x")]
        b, s, hq, hkv, sq, dim = (given + [16, 8, 1, 128][len(given) - 2:])[:6]
        name = (f"B{b} S{s} {hq}/{hkv}" + (f" Sq{sq}" if sq != 1 else "")
                + (f" D{dim}" if dim != 128 else ""))
        kv_bytes, caches, gen = rotated_caches(b, s, hkv, dim, td)
        q = torch.randn(b, sq, hq, dim, device="cuda", dtype=td, generator=gen)
        lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        print(f"{name}: {kv_bytes / 1e6:.1f} MB of K/V, floor {kv_bytes / copy / 1e3:.2f} us, "
              f"{len(caches)} caches rotated", flush=True)
        dec = rotating(lambda k, v: go.decode_attention(q, k, v, lens), caches)
        AD.RING = "off"
        ref = go.decode_attention(q, *caches[0], lens).float()
        record(name, "register kernel", graph_replay_us(dec), kv_bytes, kernel="register")
        runs = [("tma", AD.ASYNC_STAGES[dim], "default", False),
                ("async", AD.ASYNC_STAGES[dim], "default", False)]
        runs += [("async", int(x), "default", False) for x in args.stages.split(",")
                 if x and dim == 128]
        runs += [("async", AD.ASYNC_STAGES[dim], v, False) for v in args.variants.split(",") if v]
        if args.nomath:
            runs.append(("async", AD.ASYNC_STAGES[dim], "default", True))
        for ring, stages, var, nomath in runs:
            saved = (dict(AD.RING_SPLIT), dict(AD.ASYNC_STAGES))
            AD.RING, AD.RING_KERNEL = "on", ring
            mod = _async_module(dim, stages, nomath) if ring == "async" else None
            if mod is not None:
                AD.ASYNC_STAGES[dim] = stages
                AD._kernel = (lambda m, dev, e, mod=mod:
                              saved_kernel(mod if m is AD.ASYNC_MODULE else m, dev, e))
            if var != "default":
                per, _, waves = var.partition(":")
                AD.RING_SPLIT.update(blocks_per_sm=int(per), waves=int(waves or 1))
            AD._plans.clear()
            try:
                got = go.decode_attention(q, *caches[0], lens).float()
                diff = float((got - ref).abs().max())
                plan = next(p for key, p in AD._plans.items() if key[0] == ring)
                what = (f"{ring} {stages}st {var} ({plan[3]}x{plan[4]})"
                        + (" NO MATH" if nomath else ""))
                extra = dict(kernel=ring, stages=stages, split_rule=var, splits=plan[3],
                             chunk=plan[4], nomath=nomath, max_diff_vs_register=diff)
                if not nomath:
                    record(name, what, graph_replay_us(dec), kv_bytes, **extra)
                AD._kernel = _without(AD.COMBINE_MODULE, AD._kernel)
                record(name, what + ", split only", graph_replay_us(dec), kv_bytes,
                       split_only=True, **extra)
            finally:
                AD._kernel = saved_kernel
                AD.RING_SPLIT.clear()
                AD.RING_SPLIT.update(saved[0])
                AD.ASYNC_STAGES.clear()
                AD.ASYNC_STAGES.update(saved[1])
                AD.RING, AD.RING_KERNEL = "auto", "tma"
                AD._plans.clear()
        sdpa = rotating(lambda k, v: AD._sdpa(q, k, v), caches)
        record(name, "torch SDPA", graph_replay_us(sdpa), kv_bytes, kernel="torch")
        for ps in [int(x) for x in args.paged.split(",") if x]:
            _paged(record, name, q, lens, caches, ps, gen, kv_bytes)
        del caches, dec, sdpa
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def _paged(record, name, q, lens, caches, ps, gen, kv_bytes):
    """paged_attention over the caches cut into pages of ps keys, a random page order per cache
    (the pool is the cache's own memory): register kernel, both rings, torch with its gather."""
    b, s, hkv, dim = caches[0][0].shape
    n = b * s // ps
    pools = [(k.view(n, ps, hkv, dim), v.view(n, ps, hkv, dim),
              torch.randperm(n, device="cuda", generator=gen).to(torch.int32).view(b, s // ps))
             for k, v in caches]
    # table[b, p] names the pool page holding keys p*ps.. of sequence b: a shuffled view of the
    # same bytes, so the reference is the register kernel on the gathered cache
    k0, v0, t0 = pools[0]
    want = go.decode_attention(q, k0[t0.reshape(-1).long()].reshape(b, s, hkv, dim),
                               v0[t0.reshape(-1).long()].reshape(b, s, hkv, dim), lens).float()
    tag = f"{name} paged {ps}"
    for ring in ("off", "tma", "async"):
        AD.RING, AD.RING_KERNEL = ("off", "tma") if ring == "off" else ("on", ring)
        AD._plans.clear()
        try:
            got = go.paged_attention(q, k0, v0, t0, lens).float()
            fn = rotating(lambda kp, vp, t: go.paged_attention(q, kp, vp, t, lens), pools)
            record(tag, "register kernel" if ring == "off" else f"{ring} ring",
                   graph_replay_us(fn), kv_bytes, kernel=ring, page_size=ps,
                   max_diff_vs_gathered=float((got - want).abs().max()))
        finally:
            AD.RING, AD.RING_KERNEL = "auto", "tma"
            AD._plans.clear()
    fn = rotating(lambda kp, vp, t: AD._sdpa_paged(q, kp, vp, t, lens), pools)
    record(tag, "torch SDPA + gather", graph_replay_us(fn), kv_bytes, kernel="torch",
           page_size=ps)


if __name__ == "__main__":
    main()
