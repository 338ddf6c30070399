"""qk_norm_rotary and its backward, old kernels (NORM_VARIANT 1: qk_norm_rope_fwd / _bwd) against
variant 2 (qk_norm_rope_fwd2 / _bwd2: all loads of a row before its reduction, 16-byte
weight/table words; backward: weights once per block, next row prefetched, 2 blocks per SM), at
the bench's prefill shape (q [4, 4096, 32, 128], k [4, 4096, 8, 128], HF [S, 128] tables in the
data dtype), with apply_rotary at the same shape as the reference point, against the copy
bandwidth of the same run. One line per measurement; --json F writes them all.

Floors (bytes / 3000 GB/s): forward bf16 336 MB -> 112 us, fp32 671 MB -> 224 us; backward
(g, x in, dx out) bf16 503 MB -> 168 us, fp32 1007 MB -> 336 us.
Predictions (benchmarks/notes_rotary.md, "Run 4 follow-up"): forward v2 90-94% (bf16 and fp32),
backward v2 bf16 84-90%, fp32 90-94%.
"""
from __future__ import annotations

import argparse
import json
import sys

sys.path.insert(0, ".")

import gpuops as go  # noqa: E402
from gpuops import dtypes as dt  # noqa: E402
from gpuops.bench import _Framework  # noqa: E402
from gpuops.ops import rotary as R  # noqa: E402
from gpuops.runtime import device  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    fw = _Framework()
    copy = fw.copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s", flush=True)
    rows = []
    shape = R._PREFILL
    for d in (dt.bfloat16, dt.float32):
        (q, k, wq, wk, c, s), _ = R._norm_inputs(shape, d, fw.randn)
        gq, gk = fw.randn(tuple(q.shape), d), fw.randn(tuple(k.shape), d)
        nbytes = (q.numel() + k.numel()) * d.itemsize
        cases = [("apply_rotary", None, lambda: go.apply_rotary(q, k, c, s), 2 * nbytes)]
        for variant in (1, 2):
            cases.append(("qk_norm_rotary", ("fwd", variant),
                          lambda: go.qk_norm_rotary(q, k, wq, wk, c, s), 2 * nbytes))
            cases.append(("qk_norm_rotary_backward", ("bwd", variant),
                          lambda: go.qk_norm_rotary_backward(gq, gk, q, k, wq, wk, c, s),
                          3 * nbytes))
        for name, var, fn, moved in cases:
            saved = dict(R.NORM_VARIANT)
            if var is not None:
                R.NORM_VARIANT[var[0]] = var[1]
            try:
                us = fw.time_us(fn, iters=30)
            finally:
                R.NORM_VARIANT.update(saved)
            gbps = moved / (us * 1e-6) / 1e9
            v = "-" if var is None else var[1]
            row = dict(op=name, dtype=d.name, variant=v, us=us, gbps=gbps,
                       pct_copy=100 * gbps / copy)
            rows.append(row)
            print(f"{name:<26}{d.name:<10} variant={v} {us:9.1f} us {gbps:7.0f} GB/s "
                  f"{100 * gbps / copy:5.1f}%", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy, "gpu": device.device_info(0).name, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
