"""Norms over long rows: the one-launch plan against the two-launch plan (statistics by column
blocks, then a reverse-order second pass that finds the row's tail still in L2), chosen by
``gpuops.ops.norms.ONE_LAUNCH_MAX_WAVES`` (None: the old rule, one launch whenever it fits;
1: two launches once the rows do not fill one wave). rms_norm and layer_norm at [16, 1048576]
(and [8, 393216]) in bf16 and fp32, CUDA-graph timed, against the same run's copy bandwidth.

Floors (bytes / 3000 GB/s): [16, 1048576] bf16 in + out 67 MB -> 22 us; fp32 134 MB -> 45 us.
Prediction (benchmarks/notes_norms.md): two-launch bf16 rms_norm 26-30 us (run 11, one launch:
91 us), i.e. >= 75% of copy; fp32 52-58 us.
"""
from __future__ import annotations

import argparse
import json
import sys

sys.path.insert(0, ".")

import gpuops as go  # noqa: E402
from gpuops import dtypes as dt  # noqa: E402
from gpuops.bench import _Framework, graph_replay_us  # noqa: E402
from gpuops.ops import norms as N  # noqa: E402
from gpuops.runtime import device  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    fw = _Framework()
    copy = fw.copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s", flush=True)
    rows = []
    for shape in ((16, 1048576), (8, 393216)):
        for d in (dt.bfloat16, dt.float32):
            x = fw.randn(shape, d)
            w, b = fw.randn(shape[-1:], d), fw.randn(shape[-1:], d)
            moved = 2 * x.numel() * d.itemsize
            cases = {"rms_norm": lambda: go.rms_norm(x, shape[-1:], w),
                     "layer_norm": lambda: go.layer_norm(x, shape[-1:], w, b)}
            for name, fn in cases.items():
                for rule in (None, 1):
                    saved = N.ONE_LAUNCH_MAX_WAVES
                    N.ONE_LAUNCH_MAX_WAVES = rule
                    try:
                        fn()
                        us = graph_replay_us(fn)
                    finally:
                        N.ONE_LAUNCH_MAX_WAVES = saved
                    gbps = moved / (us * 1e-6) / 1e9
                    row = dict(op=name, shape=list(shape), dtype=d.name, one_launch_max_waves=rule,
                               us=us, gbps=gbps, pct_copy=100 * gbps / copy)
                    rows.append(row)
                    print(f"{name:<11}{str(shape):<14}{d.name:<9} max_waves={rule!s:<5}"
                          f"{us:9.1f} us {gbps:7.0f} GB/s {100 * gbps / copy:5.1f}%", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy, "gpu": device.device_info(0).name, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
