"""Whole rows of layer_norm / rms_norm / add_rms_norm: the stream plan (norm_stream.cuh, a warp
per row, each warp's next rows landing in shared memory by cp.async) against the per-block kernels
(STREAM_ROWS="off": layer_norm_compact, rms_norm_fwd) and the peers (torch eager, torch.compile,
Liger), same inputs, same run, CUDA-graph replay (5 calls per graph, median of 20 replays).

Configs (--configs): off, auto (stream_config's pick), lean / lean_two / two_pass / compact (the
stream plan off; layer_norm under that WHOLE_ROWS option; "lean*" also puts rms_norm and add_rms_norm on
rms_norm_rows at every row count: Liger's structure), and forced tTkKdD (teams of T warps per
row, K teams per block, D stages per team: STREAM_TEAM, STREAM_TEAMS, STREAM_DEPTH; skipped where
the stages do not fit); any of them with "/wide" or "/narrow" (WIDE_ROWS True / False: two
packs per thread in half the threads for layer_norm_lean and rms_norm_rows, or the plan's shape;
none: "auto"). Each stream row also prints the largest
difference from the "off" output (both rounded to the dtype: 0 or one rounding step expected,
the sums' order differs).

Floors (H200, run 154's copy 4225 GB/s): [32768, 4096] bf16 x in + y out 537 MB -> 127 us, fp32
254 us; add_rms_norm twice. Run 154 (off): layer_norm bf16 164.4 us (Liger 139.9), rms_norm bf16
140.4 (Liger 130.4), fp32 layer_norm 264.2 / rms_norm 264.4 (torch.compile 253.3 / 252.9).
Prediction (benchmarks/notes_norms.md, "The stream plan"): the auto config within 3% of copy
bandwidth for every op and dtype at [32768, 4096]: bf16 layer_norm and rms_norm 128-133 us.
"""
from __future__ import annotations

import argparse
import re
import sys

sys.path.insert(0, ".")

import gpuops as go  # noqa: E402
from gpuops import dtypes as dt  # noqa: E402
from gpuops.bench import (_Framework, add_bandwidth_row, graph_replay_us,  # noqa: E402
                          write_rows_json)
from gpuops.ops import norms as N  # noqa: E402
from gpuops.runtime import device  # noqa: E402

sys.path.insert(0, "benchmarks/experiments")
from norms_long_rows import _norm_peers  # noqa: E402

KNOBS = ("STREAM_ROWS", "STREAM_TEAM", "STREAM_TEAMS", "STREAM_DEPTH", "WHOLE_ROWS",
         "ROWS_MAX_WAVES", "WIDE_ROWS")


class _Config:
    """Sets STREAM_ROWS / STREAM_TEAM / STREAM_TEAMS / STREAM_DEPTH for one config ("off",
    "auto", "tTkKdD": teams of T warps, K teams per block, D stages), WHOLE_ROWS and
    ROWS_MAX_WAVES for the per-block configs, and WIDE_ROWS ("/wide", "/narrow" suffixes)."""

    def __init__(self, name):
        # a suffix "/wide" or "/narrow": WIDE_ROWS True or False under that config (two packs
        # per thread in half the threads for layer_norm_lean / rms_norm_rows, or the plan's)
        name, _, wide = name.partition("/")
        if wide not in ("", "wide", "narrow"):
            raise SystemExit(f"config suffix {wide!r}: /wide or /narrow")
        self._init(name)
        self.values["WIDE_ROWS"] = {"": "auto", "wide": True, "narrow": False}[wide]

    def _init(self, name):
        if name in ("off", "auto"):
            self.values = dict(STREAM_ROWS=name, STREAM_TEAM=None, STREAM_TEAMS=None,
                               STREAM_DEPTH=None, WHOLE_ROWS="auto",
                               ROWS_MAX_WAVES="auto" if name == "auto" else 1)
        elif name in ("lean", "lean_two", "two_pass", "compact"):
            # the per-block kernels: layer_norm under that WHOLE_ROWS option, rms_norm /
            # add_rms_norm on rms_norm_rows at every row count ("lean") or rms_norm_fwd
            self.values = dict(STREAM_ROWS="off", WHOLE_ROWS=name,
                               ROWS_MAX_WAVES=None if name.startswith("lean") else 1)
        else:
            m = re.fullmatch(r"t(\d+)k(\d+)d(\d+)", name)
            if m is None:
                raise SystemExit(f"config {name!r}: off, auto or tTkKdD")
            team, teams, depth = (int(v) for v in m.groups())
            self.values = dict(STREAM_ROWS="on", STREAM_TEAM=team, STREAM_TEAMS=teams,
                               STREAM_DEPTH=depth)

    def __enter__(self):
        self.saved = {k: getattr(N, k) for k in KNOBS}
        for k, v in self.values.items():
            setattr(N, k, v)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(N, k, v)
        return False


def _describe(kind, d, shape):
    """The stream plan the current config takes, or the per-block kernel that runs."""
    n = shape[-1]
    vec = 16 // d.itemsize
    plan = N._plan(kind, d, vec, n, 0)
    s = N._stream_plan(kind, plan, d, vec, n, shape[0], 0)
    if s is None:
        if kind == "layer_norm":
            used = N._whole_rows_plan(plan, d, vec, 0, shape[0], n) or plan
        else:
            used = N._decode_rows_plan(kind, plan, d, vec, shape[0], 0, n) or plan
        regs = getattr(getattr(used.kernel, "raw", None), "num_regs", "?")
        return f"{used.kernel.name.split('::')[-1].split('<')[0]} {regs} regs"
    sms = device.device_info(0).sm_count
    regs = getattr(getattr(s.kernel, "raw", None), "num_regs", "?")
    return (f"stream t{s.team}k{s.teams}d{s.depth}, {s.smem // 1024} KiB, "
            f"{s.capacity // sms} blocks/SM, grid {N.stream_grid(s, shape[0])}, {regs} regs")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--configs", default="off,auto,t1k8d2,t1k8d3,t2k4d3,t2k8d3,t4k2d3,t4k4d2,"
                                          "t4k4d3")
    ap.add_argument("--shapes", default="32768x4096,65536x2048,16384x8192,131072x1024")
    ap.add_argument("--dtypes", default="bfloat16,float32,float16")
    ap.add_argument("--peers", default="torch,torch.compile,liger")
    args = ap.parse_args()
    torch_dtypes = [dt.BY_NAME[s] for s in args.dtypes.split(",") if s]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    configs = [c for c in args.configs.split(",") if c]
    peers = [p for p in args.peers.split(",") if p]
    fw = _Framework()
    torch = fw.torch
    copy = fw.copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s", flush=True)
    rows = []
    for shape in shapes:
        ns = shape[-1:]
        for d in torch_dtypes:
            x, r = fw.randn(shape, d), fw.randn(shape, d)
            w, b = fw.randn(ns, d), fw.randn(ns, d)
            moved = 2 * x.numel() * d.itemsize
            ops = {"layer_norm": (lambda: go.layer_norm(x, ns, w, b), moved),
                   "rms_norm": (lambda: go.rms_norm(x, ns, w), moved),
                   "add_rms_norm": (lambda: go.add_rms_norm(x, r, w), 2 * moved)}
            peer_fns = _norm_peers(fw, peers, x, r, w, b, shape) if peers else {}
            for op, (fn, nbytes) in ops.items():
                reference = None
                for config in configs:
                    with _Config(config):
                        what = _describe(op, d, shape)
                        if re.fullmatch(r"t\d+k\d+d\d+", config) and not what.startswith("stream"):
                            continue                      # (the stages do not fit)
                        out = fn()
                        first = out[0] if isinstance(out, tuple) else out
                        if config == "off":
                            reference = first.clone()
                        diff = ("" if reference is None or config == "off" else
                                f" maxdiff {float((first.float() - reference.float()).abs().max()):.3g}")
                        us = graph_replay_us(fn, calls=5)
                    add_bandwidth_row(rows, copy, op, shape, d, config, us, nbytes, what + diff)
                for (pop, peer), pfn in peer_fns.items():
                    if pop != op:
                        continue
                    try:
                        pfn()
                        us = graph_replay_us(pfn, calls=5)
                    except Exception as e:  # noqa: BLE001  (a peer that does not run this)
                        print(f"{op:<13}{str(shape):<15}{d.name:<9} {peer:<14} failed: "
                              f"{type(e).__name__}: {str(e)[:100]}", flush=True)
                        continue
                    add_bandwidth_row(rows, copy, op, shape, d, peer, us, nbytes, "")
            del x, r
            torch.cuda.empty_cache()
    write_rows_json(args.json, copy, rows)



if __name__ == "__main__":
    main()
