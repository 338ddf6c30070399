"""Decode attention on the H100: where the time goes and which split plan is best.

decode_attention / paged_attention at the issue's shapes (GQA 16/8, D 128, one query token,
full caches): B1 S8192 and B16 S4096, bf16 (and fp16 with --all), timed by CUDA-graph replay
(gpuops.bench.graph_replay_us) with the KV caches ROTATED through enough copies that they cannot
sit in the 50 MB L2 (a real model reads another layer's cache on every call), next to torch SDPA
on the same rotated caches. For gpuops also: the caches not rotated (L2-resident), the split
kernel alone (the combine replaced by a no-op: what the combine launch costs) and the split rule
swept (SPLIT waves x min_chunk, waves of the split kernel's resident blocks; --no-sweep skips it).
(Runs 15-27 also timed a merge of the splits in the split kernel's last block, one launch:
slower at B1, removed after run 35.)

Floors (KV bytes / 3000 GB/s): B1 S8192 bf16 33.6 MB -> 11.2 us; B16 S4096 268 MB -> 89.5 us.
Run 13 (no rotation, before the combine rewrite and the K/V prefetch): B1 26.9 us (41.5%),
B16 98.7 us (90.5%); torch 11.6 / 90.1 us.
Prediction after prefetch + parallel combine: B1 15-16 us (~72%; combine ~2 us + its launch),
B16 ~95 us (~94%).

    python benchmarks/experiments/decode_attention_plans.py [--all] [--no-sweep] [--json out.json]
"""
from __future__ import annotations

import argparse
import sys

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import torch  # noqa: E402

import gpuops as go  # noqa: E402
from gpuops.bench import (_Framework, graph_replay_us, rotating,  # noqa: E402
                          write_rows_json)
from gpuops.ops import attention_decode as AD  # noqa: E402

L2_BYTES = 50 << 20


class _NoLaunch:
    def launch(self, *a, **k):
        pass


def paged_copies(caches, page=16):
    """(block_table, [(k_pages, v_pages), ...]): each [B, S, Hkv, D] cache pair copied into a
    page pool of `page` tokens per page, the pages in a random order (one table for all)."""
    b, s, hkv, dim = caches[0][0].shape
    per = s // page
    perm = torch.randperm(b * per, device="cuda").reshape(b, per).to(torch.int32)
    order = perm.reshape(-1).argsort()
    pages = [(k.reshape(b * per, page, hkv, dim)[order].contiguous(),
              v.reshape(b * per, page, hkv, dim)[order].contiguous()) for k, v in caches]
    return perm, pages


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--all", action="store_true", help="fp16 too, and the paged op's sweep")
    ap.add_argument("--no-sweep", action="store_true", help="skip the split-rule sweep")
    args = ap.parse_args()
    fw = _Framework()
    copy = fw.copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s", flush=True)
    rows = []
    dtypes = (torch.bfloat16, torch.float16) if args.all else (torch.bfloat16,)

    def record(**row):
        row["gbps"] = row["bytes"] / (row["us"] * 1e-6) / 1e9
        row["pct_copy"] = 100 * row["gbps"] / copy
        rows.append(row)
        print(f"{row['op']:<17}{row['shape']!s:<22}{row['dtype']:<9}{row['what']:<34}"
              f"{row['us']:9.1f} us {row['pct_copy']:6.1f}%", flush=True)

    for (b, s, hq, hkv, dim) in ((1, 8192, 16, 8, 128), (16, 4096, 16, 8, 128)):
        for td in dtypes:
            kv_bytes = 2 * b * s * hkv * dim * td.itemsize
            nrot = max(1, -(-3 * L2_BYTES // kv_bytes))       # > 3x L2 of caches in rotation
            q = torch.randn(b, 1, hq, dim, device="cuda", dtype=td)
            caches = [(torch.randn(b, s, hkv, dim, device="cuda", dtype=td),
                       torch.randn(b, s, hkv, dim, device="cuda", dtype=td)) for _ in range(nrot)]
            lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
            perm, pages = paged_copies(caches)
            shape = (b, s, hq, hkv, dim)
            dname = str(td).split(".")[-1]
            dec = rotating(lambda k, v: go.decode_attention(q, k, v, lens), caches)
            pag = rotating(lambda k, v: go.paged_attention(q, k, v, perm, lens), pages)
            ref = go.decode_attention(q, *caches[0], lens)
            got = go.paged_attention(q, *pages[0], perm, lens)
            assert torch.allclose(ref.float(), got.float(), atol=1e-2), "paged != contiguous"
            sdpa = rotating(lambda k, v: AD._sdpa(q, k, v), caches)
            common = dict(shape=list(shape), dtype=dname, bytes=kv_bytes, rotated=nrot)
            record(op="torch_sdpa", what="rotated", us=graph_replay_us(sdpa), **common)
            for name, fn in (("decode_attention", dec), ("paged_attention", pag)):
                record(op=name, what="rotated", us=graph_replay_us(fn), **common)
            record(op="decode_attention", what="not rotated (L2)",
                   us=graph_replay_us(lambda: go.decode_attention(q, *caches[0], lens)), **common)
            # the split kernel alone: its combine replaced by a no-op
            saved = AD._kernel

            def no_combine(module, dev, expr, _saved=saved):
                return _NoLaunch() if module is AD.COMBINE_MODULE else _saved(module, dev, expr)
            AD._kernel = no_combine
            try:
                record(op="decode_attention", what="split kernel only", us=graph_replay_us(dec),
                       **common)
            finally:
                AD._kernel = saved
            if args.no_sweep:
                del caches, pages
                torch.cuda.empty_cache()
                continue
            saved_split = dict(AD.SPLIT)
            slots = None
            for (op, p) in list(AD._plans.items()):
                if op[0] == "decode_attention" and op[3] == tuple(caches[0][0].shape) and op[4]:
                    slots = AD._split_slots(p[0], 0)
            print(f"split kernel slots (SMs x blocks per SM): {slots}", flush=True)
            for waves in (1, 2, 3):
                for mc in (64, 128, 256):
                    AD.SPLIT.update(waves=waves, min_chunk=mc)
                    try:
                        ns, ch = AD.num_splits(b, hkv, 1, s, slots or 528)
                        record(op="decode_attention", what=f"waves={waves} min_chunk={mc} "
                               f"({ns}x{ch})", us=graph_replay_us(dec), **common, waves=waves,
                               min_chunk=mc, slots=slots)
                    finally:
                        AD.SPLIT.clear()
                        AD.SPLIT.update(saved_split)
            del caches, pages
            torch.cuda.empty_cache()
    write_rows_json(args.json, copy, rows)


if __name__ == "__main__":
    main()
