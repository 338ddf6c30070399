"""Norms over long rows: every long-row plan of the forward ops, CUDA-graph timed, against the
same run's copy bandwidth and the peers (torch eager, torch.compile, Liger where it runs the
shape); softmax / log_softmax on the same long rows against torch eager / torch.compile; and
layer_norm / rms_norm at [32768, 4096] against Liger. Every time is CUDA-graph replay (20 calls
per graph, median of 20 replays).

Plans (gpuops.ops.norms module switches, see benchmarks/notes_norms.md):
  auto          LONG_ROWS="auto" (the default since run 34): ring2 (16-byte units) where each
                block of its grid holds one tile, or for rms_norm with C <= 64; else ring
  resident      LONG_ROWS="resident": every tile of a block held at once (all copies issued at
                the start by cp.async, 7 slots + 1 tile in registers, one exchange per launch:
                norm_ring.cuh resident_rows) where the rows fit on chip (layer_norm, rms_norm);
                elsewhere "auto"'s plan. Prediction (notes_norms.md, "resident"): [16, 1M] bf16
                rms_norm 24-26.5 us (85-93% of copy), layer_norm 25-28 us
  ring2         LONG_ROWS="ring2": the ring's tiles, each tile's partial published as
                self-validating 64-bit words (tag = a launch epoch kept on the device): no
                memset, no atomics, no merger, no statistics read back (norm_ring.cuh ring2_rows)
  ring2_t256    the same with 256-thread tiles
  ring          LONG_ROWS="ring": one launch (+ the counters' memset), the grid resident, each
                block holding its tiles of the rows in a ring of shared memory until their rows'
                statistics are in: x read once (norm_ring.cuh)
  ring_t256     the same with 256-thread tiles (half the bytes per tile, twice the tiles)
  one_launch    LONG_ROWS="split", ONE_LAUNCH_MAX_WAVES=None: run 6's pipelined split kernel
  two_launches  LONG_ROWS="split", FORCE_TWO_LAUNCHES: partials, then a reverse-order re-read
                (run 13's default for these shapes: ONE_LAUNCH_MAX_WAVES=1)
Peers (--peers, default all; long rows): torch (F.rms_norm, F.layer_norm, x + r then
F.rms_norm), torch.compile of the same (dynamic=False), liger (Liger's RMSNorm / LayerNorm /
FusedAddRMSNorm functions; they refuse rows over 64 KB: reported as failed).

Floors (bytes / 3000 GB/s): [16, 1048576] bf16 in + out 67 MB -> 22.4 us, fp32 134 MB -> 44.7 us,
add_rms_norm twice those; [8, 393216] bf16 12.6 MB -> 4.2 us, fp32 25.2 MB -> 8.4 us.
Predictions for ring2 (notes_norms.md, "ring2"): [16, 1M] bf16 rms_norm 26-29 us (77-86% of
copy), fp32 48-53 us; [8, 393216] bf16 6.5-7.5 us.
Predictions (notes_norms.md, "Run 13 follow-up"; ring measured 35.1 us in run 20): ring [16, 1M] bf16 rms_norm 24-28 us
(80-93% of copy), fp32 47-52 us (86-95%); [8, 393216] bf16 6-8.5 us (50-70%), fp32 9.5-11 us
(76-88%); layer_norm [32768, 4096] bf16 >= 1.0x Liger.
[32768, 4096] bf16 and fp32: layer_norm under every WHOLE_ROWS option (gpuops.ops.norms), each
line naming the kernel that ran and its resident blocks per SM; rms_norm; Liger.
  per_row      layer_norm_fwd (w, b loaded with x, one exchange; 56 regs, 4 blocks/SM): run 21
               205.9 us bf16
  two_pass     layer_norm_two_pass (runs 11-14's algorithm: floats, two block sums, w, b after;
               48 regs, 5 blocks/SM): predicted 184-190 us bf16 (runs 11/14: ~185-189)
  compact      layer_norm_compact (raw x, one exchange, w, b pack by pack after; 32 regs,
               8 blocks/SM): predicted 178-186 us bf16 (notes_norms.md, "Whole rows: two_pass and
               compact")
Liger 179.4 us (run 21). fp32 (4 packs per thread): compact does not apply (layer_norm_fwd runs).

(Run 34 also timed ring2's exchange with the tiles copied into the ring by cp.async several
tiles ahead: slower at every shape, removed; notes_norms.md.)
--backward: only the backward ops on split rows (BACKWARD_SHAPES) under each
BACKWARD_LONG_ROWS plan (notes_norms.md, "The backward's long rows by columns").
Quick runs: `--plans two_pass,compact,per_row --skip-long` (whole rows only), `--plans
auto,ring2,ring --skip-4096 --peers torch` (long rows only). --plans takes long-row plans
and WHOLE_ROWS options; --skip-softmax leaves out the softmax rows.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

sys.path.insert(0, ".")

import gpuops as go  # noqa: E402
from gpuops import dtypes as dt  # noqa: E402
from gpuops.bench import _Framework, graph_replay_us, write_rows_json  # noqa: E402
from gpuops.ops import norms as N  # noqa: E402
from gpuops.runtime import device  # noqa: E402

PLANS = {
    "auto": dict(LONG_ROWS="auto"),
    "resident": dict(LONG_ROWS="resident"),
    "ring2": dict(LONG_ROWS="ring2"),
    "ring2_t256": dict(LONG_ROWS="ring2", ring_threads=256),
    "ring": dict(LONG_ROWS="ring"),
    "ring_t256": dict(LONG_ROWS="ring", ring_threads=256),
    "one_launch": dict(LONG_ROWS="split", ONE_LAUNCH_MAX_WAVES=None),
    "two_launches": dict(LONG_ROWS="split", FORCE_TWO_LAUNCHES=True),
}


class _Plan:
    """Sets one plan's module switches (and TUNING fields) for the duration of a block."""

    def __init__(self, settings):
        self.settings = dict(settings)

    def __enter__(self):
        self.saved = {k: getattr(N, k) for k in ("LONG_ROWS", "ONE_LAUNCH_MAX_WAVES",
                                                 "FORCE_TWO_LAUNCHES", "WHOLE_ROWS",
                                                 "STREAM_ROWS")}
        self.tuning = dict(N.TUNING)
        for k, v in self.settings.items():
            if hasattr(N, k):
                setattr(N, k, v)
            else:
                for name, kind in self.tuning.items():
                    N.TUNING[name] = dataclasses.replace(kind, **{k: v})
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(N, k, v)
        N.TUNING.clear()
        N.TUNING.update(self.tuning)
        return False


def _describe(op, d, shape):
    """What the current plan launches for this op and shape (grid, block, C, slots)."""
    kind = {"rms_norm": "rms_norm", "layer_norm": "layer_norm", "add_rms_norm": "add_rms_norm"}[op]
    n = shape[-1]
    vec = 16 // d.itemsize if n % (16 // d.itemsize) == 0 else 1
    plan = N._plan(kind, d, vec, n, 0)
    ring = N._long_rows_ring(kind, plan, d, vec, n, shape[0], 0)
    if ring is not None:
        r, grid = ring
        regs = getattr(getattr(r.kernel, "raw", None), "num_regs", "?")
        return (f"{r.variant} grid {grid} x {r.threads} thr, C {r.C}, {r.depth} slots, "
                f"{r.smem // 1024} KiB smem, capacity {r.capacity}, {regs} regs")
    used, grid, phases = N._grid(plan, shape[0], False)
    return (f"{len(phases)} launch(es) of {used.kernel.name.split('::')[-1]}: grid {grid} x "
            f"{used.block[0]} thr, C {used.C}, capacity {used.capacity}")


def _record(rows, copy, name, shape, d, plan, fn, nbytes, what=""):
    """Times fn by graph replay and prints / records one row; a peer that fails (Liger's row
    limit, a compile error) is recorded with its error instead."""
    try:
        us = graph_replay_us(fn)
    except Exception as e:  # noqa: BLE001  (a peer that does not run this shape)
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
        rows.append(dict(op=name, shape=list(shape), dtype=d.name, plan=plan, us=None,
                         error=msg))
        print(f"{name:<13}{str(shape):<14}{d.name:<9} {plan:<16}   failed: {msg}", flush=True)
        return
    gbps = nbytes / (us * 1e-6) / 1e9
    rows.append(dict(op=name, shape=list(shape), dtype=d.name, plan=plan, us=us, gbps=gbps,
                     pct_copy=100 * gbps / copy, launch=what))
    print(f"{name:<13}{str(shape):<14}{d.name:<9} {plan:<16}{us:9.1f} us {gbps:7.0f} GB/s "
          f"{100 * gbps / copy:5.1f}%   {what}", flush=True)


def _norm_peers(fw, peers, x, r, w, b, shape):
    """{(op, peer): fn} of the peers that import here (a failing call is reported by _record)."""
    torch = fw.torch
    F = torch.nn.functional
    n = shape[-1:]
    eager = {"rms_norm": lambda: F.rms_norm(x, n, w, 1e-6),
             "layer_norm": lambda: F.layer_norm(x, n, w, b, 1e-5),
             "add_rms_norm": lambda: (lambda h: (F.rms_norm(h, n, w, 1e-6), h))(x + r)}
    out = {}
    if "torch" in peers:
        out.update({(op, "torch"): fn for op, fn in eager.items()})
    if "torch.compile" in peers:
        comp = {"rms_norm": torch.compile(lambda a, c: F.rms_norm(a, n, c, 1e-6), dynamic=False),
                "layer_norm": torch.compile(lambda a, c, e: F.layer_norm(a, n, c, e, 1e-5),
                                            dynamic=False),
                "add_rms_norm": torch.compile(lambda a, q, c: (F.rms_norm(a + q, n, c, 1e-6),
                                                               a + q), dynamic=False)}
        out[("rms_norm", "torch.compile")] = lambda: comp["rms_norm"](x, w)
        out[("layer_norm", "torch.compile")] = lambda: comp["layer_norm"](x, w, b)
        out[("add_rms_norm", "torch.compile")] = lambda: comp["add_rms_norm"](x, r, w)
    if "liger" in peers:
        try:
            from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        except ImportError:
            pass
        else:
            out[("rms_norm", "liger")] = lambda: LigerRMSNormFunction.apply(
                x, w, 1e-6, 0.0, "llama", False)
            out[("layer_norm", "liger")] = lambda: LigerLayerNormFunction.apply(x, w, b, 1e-5)
            out[("add_rms_norm", "liger")] = lambda: LigerFusedAddRMSNormFunction.apply(
                x, r, w, 1e-6, 0.0, "llama", False)
    return out


LONG_SHAPES = ((16, 1048576), (8, 393216))


def _long_rows(fw, copy, rows, plans, peers):
    for shape in LONG_SHAPES:
        for d in (dt.bfloat16, dt.float32):
            x = fw.randn(shape, d)
            r = fw.randn(shape, d)
            w, b = fw.randn(shape[-1:], d), fw.randn(shape[-1:], d)
            moved = 2 * x.numel() * d.itemsize
            cases = {"rms_norm": (lambda: go.rms_norm(x, shape[-1:], w), moved),
                     "layer_norm": (lambda: go.layer_norm(x, shape[-1:], w, b), moved),
                     "add_rms_norm": (lambda: go.add_rms_norm(x, r, w), 2 * moved)}
            peer_fns = _norm_peers(fw, peers, x, r, w, b, shape) if peers else {}
            for name, (fn, nbytes) in cases.items():
                for plan in plans:
                    with _Plan(PLANS[plan]):
                        fn()
                        what = _describe(name, d, shape)
                        _record(rows, copy, name, shape, d, plan, fn, nbytes, what)
                for (op, peer), pfn in peer_fns.items():
                    if op == name:
                        _record(rows, copy, name, shape, d, peer, pfn, nbytes)


BACKWARD_SHAPES = ((16, 1048576), (8, 393216), (64, 65536), (4096, 16384))


def _backward_rows(fw, copy, rows):
    """The backward ops on split rows under each BACKWARD_LONG_ROWS plan (columns: blocks own
    column chunks over the rows of their group; split: norm_bwd's C blocks per row). Bytes: dy
    and x read, dx written (add_rms_norm: dres read too), w read, dw (db) written."""
    for shape in BACKWARD_SHAPES:
        ns = shape[-1:]
        for d in (dt.bfloat16, dt.float32):
            x, dy, dres = fw.randn(shape, d), fw.randn(shape, d), fw.randn(shape, d)
            w, b = fw.randn(ns, d), fw.randn(ns, d)
            _, mean, rstd = go.layer_norm_forward(x, ns, w, b, 1e-5)
            _, rms_rstd = go.rms_norm_forward(x, ns, w, 1e-6)
            body, vec = 3 * x.numel() * d.itemsize, 2 * shape[-1] * d.itemsize
            cases = {
                "ln_bwd": (lambda: go.layer_norm_backward(dy, x, mean, rstd, ns, w),
                           body + vec + vec // 2),
                "rms_bwd": (lambda: go.rms_norm_backward(dy, x, rms_rstd, ns, w), body + vec),
                "add_rms_bwd": (lambda: go.add_rms_norm_backward(dy, dres, x, rms_rstd, w),
                                body + x.numel() * d.itemsize + vec)}
            for name, (fn, nbytes) in cases.items():
                for plan in N.BACKWARD_LONG_ROWS_PLANS:
                    saved = N.BACKWARD_LONG_ROWS
                    N.BACKWARD_LONG_ROWS = plan
                    try:
                        fn()
                        what = ""
                        if plan == "columns":
                            n = shape[-1]
                            vec_w = 16 // d.itemsize if n % (16 // d.itemsize) == 0 else 1
                            cp = N._cols_plan(name == "ln_bwd", d, vec_w, n, shape[0], 0)
                            what = (f"chunks {cp.chunks}, grid {cp.grid_x} x {cp.groups}, "
                                    f"{cp.rows_per_group} rows/group")
                        _record(rows, copy, name, shape, d, plan, fn, nbytes, what)
                    finally:
                        N.BACKWARD_LONG_ROWS = saved


def _softmax_rows(fw, copy, rows, peers):
    """softmax / log_softmax on the long rows (gpuops' default plan; notes_softmax.md: two
    kernels, per-chunk partials then a merge-and-apply re-reading the chunk from L2)."""
    torch = fw.torch
    for shape in LONG_SHAPES:
        for d in (dt.bfloat16, dt.float32):
            x = fw.randn(shape, d)
            nbytes = 2 * x.numel() * d.itemsize
            for name, ours, eager in (("softmax", go.softmax, torch.softmax),
                                      ("log_softmax", go.log_softmax, torch.log_softmax)):
                _record(rows, copy, name, shape, d, "gpuops", lambda: ours(x, -1), nbytes)
                if "torch" in peers:
                    _record(rows, copy, name, shape, d, "torch", lambda: eager(x, -1), nbytes)
                if "torch.compile" in peers:
                    comp = torch.compile(lambda a: eager(a, -1), dynamic=False)
                    _record(rows, copy, name, shape, d, "torch.compile", lambda: comp(x),
                            nbytes)


def _describe_whole(d, n, rows):
    """The kernel layer_norm runs for whole rows of n under the current WHOLE_ROWS, and its
    resident blocks per SM."""
    vec = 16 // d.itemsize if n % (16 // d.itemsize) == 0 else 1
    plan = N._plan("layer_norm", d, vec, n, 0)
    whole = N._whole_rows_plan(plan, d, vec, 0, rows, n) or plan
    sms = device.device_info(0).sm_count
    regs = getattr(getattr(whole.kernel, "raw", None), "num_regs", "?")
    return (f"{whole.kernel.name.split('::')[-1]}: {whole.block[0]} thr x {whole.packs} packs, "
            f"{regs} regs, {whole.capacity // sms} blocks/SM")


def _rows_4096(fw, copy, rows, whole_options):
    """[32768, 4096]: layer_norm under each WHOLE_ROWS option, rms_norm, and Liger (when
    installed), same inputs, same run, each in its own graph."""
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        LigerLayerNormFunction = LigerRMSNormFunction = None
    shape = (32768, 4096)
    for d in (dt.bfloat16, dt.float32):
        x = fw.randn(shape, d)
        w, b = fw.randn(shape[-1:], d), fw.randn(shape[-1:], d)
        moved = 2 * x.numel() * d.itemsize
        cases = {f"layer_norm {opt}": (lambda: go.layer_norm(x, shape[-1:], w, b), opt)
                 for opt in whole_options}
        cases["rms_norm"] = (lambda: go.rms_norm(x, shape[-1:], w), None)
        if LigerLayerNormFunction is not None:
            cases["liger layer_norm"] = (lambda: LigerLayerNormFunction.apply(x, w, b, 1e-5),
                                         "-")
            cases["liger rms_norm"] = (lambda: LigerRMSNormFunction.apply(
                x, w, 1e-6, 0.0, "llama", False), "-")
        for name, (fn, whole_rows) in cases.items():
            # (STREAM_ROWS off: the stream plan, norms_stream.py, would take these rows first)
            with _Plan({"WHOLE_ROWS": whole_rows, "STREAM_ROWS": "off"}
                       if whole_rows not in (None, "-") else {}):
                fn()
                what = (_describe_whole(d, shape[-1], shape[0]) if whole_rows not in (None, "-")
                        else "")
                us = graph_replay_us(fn, calls=5)
            gbps = moved / (us * 1e-6) / 1e9
            rows.append(dict(op=name, shape=list(shape), dtype=d.name, plan=whole_rows or "-",
                             us=us, gbps=gbps, pct_copy=100 * gbps / copy, launch=what))
            print(f"{name:<22}{str(shape):<14}{d.name:<9}{us:9.1f} us {gbps:7.0f} GB/s "
                  f"{100 * gbps / copy:5.1f}%   {what}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--plans", default=",".join([*PLANS, *N.WHOLE_ROWS_PLANS]),
                    help="comma-separated long-row plans and WHOLE_ROWS options to time "
                         f"(default: all of {list(PLANS)} and {list(N.WHOLE_ROWS_PLANS)})")
    ap.add_argument("--skip-4096", action="store_true", help="only the long-row shapes")
    ap.add_argument("--skip-long", action="store_true", help="only [32768, 4096]")
    ap.add_argument("--skip-softmax", action="store_true", help="no softmax rows")
    ap.add_argument("--backward", action="store_true",
                    help="only the backward ops on split rows, every BACKWARD_LONG_ROWS plan")
    ap.add_argument("--peers", default="torch,torch.compile,liger",
                    help="long-row peers: comma-separated of torch, torch.compile, liger")
    args = ap.parse_args()
    chosen = [p for p in args.plans.split(",") if p]
    unknown = [p for p in chosen if p not in PLANS and p not in N.WHOLE_ROWS_PLANS]
    if unknown:
        ap.error(f"unknown plans {unknown}; known: {list(PLANS)}, {list(N.WHOLE_ROWS_PLANS)}")
    plans = [p for p in chosen if p in PLANS]
    whole_options = [p for p in chosen if p in N.WHOLE_ROWS_PLANS]
    fw = _Framework()
    copy = fw.copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s", flush=True)
    rows = []
    peers = [p for p in args.peers.split(",") if p]
    if args.backward:
        _backward_rows(fw, copy, rows)
    elif not args.skip_long:
        _long_rows(fw, copy, rows, plans, peers)
        if not args.skip_softmax:
            _softmax_rows(fw, copy, rows, peers)
    if not args.skip_4096 and not args.backward:
        _rows_4096(fw, copy, rows, whole_options)
    write_rows_json(args.json, copy, rows)


if __name__ == "__main__":
    main()
