"""One markdown table from several `gpuops bench --json` files (newest first): for each op, dtype
and shape, the first CUDA-graph-timed row found, else the first file's eager row, with the best
peer of that row. Used for benchmarks/results/*-summary.md.

    python scripts/bench_summary.py run11/bench.json run10/bench.json > summary_rows.md
"""
from __future__ import annotations

import json
import sys


def main(paths):
    runs = [(p, json.load(open(p))["rows"]) for p in paths]
    best = {}
    for path, rows in runs:                      # graph-timed rows, newest file first
        for r in rows:
            key = (r["op"], r["dtype"], tuple(r["shape"]))
            if r.get("timing") == "graph" and key not in best:
                best[key] = (path, r)
    for r in runs[0][1]:                         # else the newest file's eager row
        best.setdefault((r["op"], r["dtype"], tuple(r["shape"])), (runs[0][0], r))
    print("| op | dtype | shape | gpuops us | % copy | best peer | peer us | speedup | timing | file |")
    print("|---|---|---|---:|---:|---|---:|---:|---|---|")
    for key in sorted(best):
        path, r = best[key]
        timed = {k: v for k, v in (r.get("peers") or {}).items() if isinstance(v, float)}
        peer = min(timed, key=timed.get) if timed else None
        speed = f"{timed[peer] / r['time_us']:.2f}" if peer else "-"
        print(f"| {r['op']} | {r['dtype']} | {'x'.join(map(str, r['shape']))} | {r['time_us']:.1f} | "
              f"{(r['pct_copy'] or 0):.1f} | {peer or '-'} | "
              f"{'-' if peer is None else round(timed[peer], 1)} | {speed} | "
              f"{'graph' if r.get('timing') == 'graph' else 'eager'} | {path} |")


if __name__ == "__main__":
    main(sys.argv[1:])
