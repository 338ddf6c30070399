"""Decode attention, change 3 (notes_attention_decode.md): programmatic dependent launch (PDL) of
the combine (and of the split kernel), A/B against the current default in one run. (The
cp.async-staged split kernel and the merge in the split kernel's last block that this experiment
also timed lost in runs 34-35 and were removed; the file keeps its name, which the notes cite.)

Shapes: GQA 16/8, D 128, one query token, full caches, bf16: B1 S8192 (floor 11.2 us at
3000 GB/s, target <= 13.2 us) and B16 S4096 (floor 89.5 us; 90.4% in run 27, must stay >= 85%).
Timing as decode_attention_plans.py: CUDA-graph replay (gpuops.bench.graph_replay_us: 20 calls
per graph, medians of 20 replays) with the KV caches ROTATED through > 3x the 50 MB L2, next to
torch SDPA on the same rotated caches; paged (page 16, random page order) for the same variants.

Variants (attention_decode knobs, restored after each):
  default          the module's defaults (run 34 on: PDL combine)
  pdl=off          plain launches (run 27: B1 20.4 us, B16 98.8 us; run 34: 20.37 / 99.01)
  pdl=combine      the combine launched as a PDL secondary (run 34: 19.50 / 98.44)
  pdl=all          also the split kernel a PDL secondary of the previous call's combine
Also "split kernel only" (combine replaced by a no-op), the plan of each variant (splits x keys
per split) and each variant's max |diff| from the default's output on the same inputs (same
splits: a few bf16 ulps at most).

    python benchmarks/experiments/decode_attention_pdl_staged.py [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import torch  # noqa: E402

import gpuops as go  # noqa: E402
from gpuops.bench import _Framework, graph_replay_us, rotating  # noqa: E402
from gpuops.ops import attention_decode as AD  # noqa: E402
from gpuops.runtime import device, launch  # noqa: E402

from decode_attention_plans import paged_copies  # noqa: E402  (this folder is on sys.path)

L2_BYTES = 50 << 20
VARIANTS = [
    ("default", {}),
    ("pdl=off", {"PDL": "off"}),
    ("pdl=combine", {"PDL": "combine"}),
    ("pdl=all", {"PDL": "all"}),
]
# (run 34: PDL "combine" became the default)
QUICK = ("default", "pdl=off", "pdl=all")
PAGED = ("default", "pdl=off", "pdl=all")


@contextlib.contextmanager
def knobs(**kw):
    saved = {k: getattr(AD, k) for k in ("PDL",)}
    try:
        for k, v in kw.items():
            setattr(AD, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(AD, k, v)


class _NoLaunch:
    def launch(self, *a, **k):
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="fewer variants")
    args = ap.parse_args()
    fw = _Framework()
    copy = fw.copy_bandwidth_gbps()
    info = device.device_info(0)
    print(f"copy {copy:.0f} GB/s, {info.name} cc {info.cc}, cuLaunchKernelEx "
          f"{launch.launch_ex_available()}, PDL used: {AD._pdl_ok(0)}", flush=True)
    rows, checks = [], []
    variants = [v for v in VARIANTS if not args.quick or v[0] in QUICK]

    def record(**row):
        row["gbps"] = row["bytes"] / (row["us"] * 1e-6) / 1e9
        row["pct_copy"] = 100 * row["gbps"] / copy
        rows.append(row)
        print(f"{row['op']:<17}{row['shape']!s:<22}{row['what']:<34}"
              f"{row['us']:9.2f} us {row['pct_copy']:6.1f}%  {row.get('plan', '')}", flush=True)

    def plan_of(op, shape_k):
        for key, p in AD._plans.items():
            if key[0] == op and key[3] == shape_k:
                nsplit, chunk = p[3], p[4]
                return f"{nsplit}x{chunk}"
        return ""

    td, dname = torch.bfloat16, "bfloat16"
    for (b, s, hq, hkv, dim) in ((1, 8192, 16, 8, 128), (16, 4096, 16, 8, 128)):
        kv_bytes = 2 * b * s * hkv * dim * td.itemsize
        nrot = max(1, -(-3 * L2_BYTES // kv_bytes))
        torch.manual_seed(0)
        q = torch.randn(b, 1, hq, dim, device="cuda", dtype=td)
        caches = [(torch.randn(b, s, hkv, dim, device="cuda", dtype=td),
                   torch.randn(b, s, hkv, dim, device="cuda", dtype=td)) for _ in range(nrot)]
        lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        perm, pages = paged_copies(caches)
        shape = (b, s, hq, hkv, dim)
        common = dict(shape=list(shape), dtype=dname, bytes=kv_bytes, rotated=nrot)
        dec = rotating(lambda k, v: go.decode_attention(q, k, v, lens), caches)
        pag = rotating(lambda k, v: go.paged_attention(q, k, v, perm, lens), pages)
        sdpa = rotating(lambda k, v: AD._sdpa(q, k, v), caches)
        record(op="torch_sdpa", what="rotated", us=graph_replay_us(sdpa), **common)
        base = go.decode_attention(q, *caches[0], lens).float()
        kshape = tuple(caches[0][0].shape)
        for name, kw in variants:
            with knobs(**kw):
                out = go.decode_attention(q, *caches[0], lens).float()
                diff = (out - base).abs().max().item()
                checks.append(dict(shape=list(shape), variant=name, max_abs_diff=diff))
                plan = plan_of("decode_attention", kshape)
                record(op="decode_attention", what=name, us=graph_replay_us(dec), variant=name,
                       plan=plan, max_abs_diff=diff, **common)
                if name in PAGED:
                    pout = go.paged_attention(q, *pages[0], perm, lens).float()
                    assert torch.allclose(pout, out, atol=1e-2), f"paged != contiguous ({name})"
                    record(op="paged_attention", what=name, us=graph_replay_us(pag),
                           variant=name,
                           plan=plan_of("paged_attention", tuple(pages[0][0].shape)), **common)
        print("max |diff| from default: " + ", ".join(
            f"{c['variant']} {c['max_abs_diff']:.3g}" for c in checks if c["shape"] == list(shape)),
            flush=True)
        # the split kernel alone: its combine launch replaced by a no-op
        saved = AD._kernel

        def no_combine(module, dev, expr, _saved=saved):
            return _NoLaunch() if module is AD.COMBINE_MODULE else _saved(module, dev, expr)
        AD._kernel = no_combine
        try:
            with knobs(PDL="off"):
                record(op="decode_attention", what="split kernel only", us=graph_replay_us(dec),
                       variant="split_only", plan=plan_of("decode_attention", kshape), **common)
        finally:
            AD._kernel = saved
        del caches, pages
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy, "gpu": info.name, "rows": rows, "checks": checks}, f,
                      indent=1)


if __name__ == "__main__":
    main()
