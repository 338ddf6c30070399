"""Decode-sized calls: time per call of every benchmarked op at a small shape, back to back from
Python and replayed from a CUDA graph, next to torch eager doing the same (issue 3: "small inputs
such as [16, 2048]: report time per call with and without a CUDA graph").

For each op: the smallest of its bench shapes (or [16, 2048] for row ops), 200 calls captured into
one graph; per-call time = graph replay time / 200. Back to back = host loop of the same calls,
synchronized at the end.

    python benchmarks/experiments/decode_graphs.py [--ops a,b] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from math import prod

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import torch  # noqa: E402

from gpuops import dtypes as dt  # noqa: E402
from gpuops import registry  # noqa: E402
from gpuops.bench import back_to_back_us, graph_replay_us  # noqa: E402

CALLS = 200


def decode_shape(spec, d):
    shapes = [tuple(s) for s in spec.extra_shapes if prod(s) <= (1 << 17)]
    if shapes:
        return min(shapes, key=prod)
    default = tuple(spec.default_shape(d))
    if len(default) == 2:
        return (16, 2048)
    return None


def randn(shape, d):
    return torch.randn(shape, device="cuda").to(dt.to_torch(d))


def eager_us(fn):
    return back_to_back_us(fn, calls=CALLS)


def graph_us(fn):
    """Per-call GPU time: CALLS calls in one graph, the best of 5 replays."""
    return graph_replay_us(fn, calls=CALLS, replays=5, stat=min)


def measure(op, d):
    shape = decode_shape(op.bench, d)
    if shape is None:
        return None
    try:
        a, kw = op.bench.make_inputs(shape, d, randn)
        ours = lambda: op.function(*a, **kw)  # noqa: E731
        row = {"op": op.name, "shape": shape, "eager_us": eager_us(ours), "graph_us": graph_us(ours)}
        if op.bench.torch_fn is not None:
            peer = lambda: op.bench.torch_fn(*a, **kw)  # noqa: E731
            row["torch_eager_us"] = eager_us(peer)
            try:
                row["torch_graph_us"] = graph_us(peer)
            except Exception as exc:  # noqa: BLE001
                row["torch_error"] = f"{type(exc).__name__}: {exc}"[:300]
                row["broken"] = True
    except Exception as exc:  # noqa: BLE001  report and go on
        row = {"op": op.name, "shape": shape, "error": f"{type(exc).__name__}: {exc}"[:300],
               "broken": True}
    return row


def child(names):
    """Measure ops in this process; stop after a failed capture (torch's capture state is not
    reliable afterwards), the parent starts a fresh process for the rest."""
    d = dt.bfloat16
    for name in names:
        row = measure(registry.get(name), d)
        print("ROW " + json.dumps(row), flush=True)
        if row and row.get("broken"):
            return


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child.split(","))
        return
    wanted = set(args.ops.split(",")) if args.ops else None
    d = dt.bfloat16
    todo = [op.name for op in registry.ops() if op.bench is not None and d in op.dtypes
            and (not wanted or op.name in wanted)]
    rows = []
    print(f"{'op':<24}{'shape':<22}{'gpuops us':>10}{'in graph':>10}{'torch us':>10}{'in graph':>10}")
    while todo:
        proc = subprocess.run([sys.executable, __file__, "--child", ",".join(todo)],
                              capture_output=True, text=True)
        done = []
        for line in proc.stdout.splitlines():
            if not line.startswith("ROW "):
                continue
            row = json.loads(line[4:])
            done.append(todo[len(done)])
            if row is None:
                continue
            rows.append(row)

            def f(key, row=row):
                v = row.get(key)
                return f"{v:10.2f}" if isinstance(v, float) else f"{'-':>10}"
            err = row.get("error") or row.get("torch_error")
            print(f"{row['op']:<24}{'x'.join(map(str, row['shape'])):<22}{f('eager_us')}"
                  f"{f('graph_us')}{f('torch_eager_us')}{f('torch_graph_us')}"
                  + (f"  {err}" if err else ""), flush=True)
        if not done:   # the child died before its first row
            rows.append({"op": todo[0], "error": (proc.stderr or "child failed")[-300:]})
            print(f"{todo[0]:<24} child failed: {(proc.stderr or '')[-300:]}", flush=True)
            done = [todo[0]]
        todo = todo[len(done):]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "dtype": d.name, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
