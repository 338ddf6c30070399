"""``python -m gpuops bench``: check every op against its reference, time it, compare with torch.

For each op and dtype: the op's output at a reduced "check" shape (the default shape with fewer
rows) against the NumPy float64 reference; then the median time of the op at the benchmark shape
(CUDA events around each call, after warm-up), the bytes it must move over that time as GB/s and
as a share of the device-to-device copy bandwidth measured in the same run, and torch eager's time
for the same computation. ``--runtime`` adds host dispatch overhead and module load times.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from math import prod

import numpy as np

from gpuops import dtypes as dt
from gpuops import registry
from gpuops.runtime import device, nvrtc

# relative L2 error a result may have against the float64 reference, by storage dtype
TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}
CHECK_ELEMENTS = 1 << 20


@dataclass
class Row:
    op: str
    dtype: str
    shape: tuple
    check_shape: tuple
    rel_err: float
    max_abs_err: float
    ok: bool
    time_us: float | None = None
    gbps: float | None = None
    pct_copy: float | None = None
    torch_us: float | None = None
    speedup_vs_torch: float | None = None
    bytes: int | None = None
    device: str = "cpu"
    time_spread_us: tuple | None = None     # (fastest, slowest) batch median
    tflops: float | None = None
    peers: dict | None = None                # peer name -> us (or "failed: ...")
    best_peer: str | None = None
    best_peer_us: float | None = None
    speedup_vs_best: float | None = None
    # with --graph: time_us and the peers' times are GPU time per call from CUDA-graph replay (no
    # host overhead); eager_us / peers_eager keep the per-call times from Python
    eager_us: float | None = None
    peers_eager: dict | None = None
    timing: str = "eager"


def _check_shape(shape):
    shape = tuple(shape)
    if prod(shape) <= CHECK_ELEMENTS or len(shape) < 2:
        return shape
    rows = max(1, CHECK_ELEMENTS // prod(shape[1:]))
    return (min(shape[0], rows),) + shape[1:]


class _Framework:
    """Random inputs, host copies and event timing for torch (preferred) or CuPy arrays."""

    def __init__(self):
        self.torch = None
        try:
            import torch  # noqa: PLC0415
            if torch.cuda.is_available():
                self.torch = torch
        except ImportError:
            pass
        self.cp = device.cupy_or_none()
        self.name = "torch" if self.torch is not None else "cupy"

    def randn(self, shape, d):
        if self.torch is not None:
            return self.torch.randn(shape, device="cuda").to(dt.to_torch(d))
        x = self.cp.random.standard_normal(shape, dtype=np.float32)
        return x.astype(dt.to_numpy(d)) if d is not dt.float32 else x

    def to_f64(self, x):
        if self.torch is not None and isinstance(x, self.torch.Tensor):
            return x.double().cpu().numpy()
        if self.cp is not None and isinstance(x, self.cp.ndarray):
            return self.cp.asnumpy(x).astype(np.float64)
        return x

    def nbytes(self, x):
        if self.torch is not None and isinstance(x, self.torch.Tensor):
            return x.numel() * x.element_size()
        return int(getattr(x, "nbytes", 0))

    def sync(self):
        if self.torch is not None:
            self.torch.cuda.synchronize()
        else:
            self.cp.cuda.runtime.deviceSynchronize()

    def time_us(self, fn, warmup=3, iters=20, budget_s=2.0, batches=3):
        """Microseconds per call: CUDA events around each call after warm-up, the median of each
        of ``batches`` batches, and the median of those (one batch disturbed by something else on
        the machine cannot move the result; the spread is in ``self.last_spread``)."""
        for _ in range(warmup):
            fn()
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        once = time.perf_counter() - t0
        iters = int(max(5, min(iters, budget_s / batches / max(once, 1e-6))))
        medians = []
        for _ in range(batches):
            if self.torch is not None:
                ev = self.torch.cuda.Event
                pairs = [(ev(enable_timing=True), ev(enable_timing=True)) for _ in range(iters)]
            else:
                ev = self.cp.cuda.Event
                pairs = [(ev(), ev()) for _ in range(iters)]
            for start, end in pairs:
                start.record()
                fn()
                end.record()
            self.sync()
            if self.torch is not None:
                times = [s.elapsed_time(e) for s, e in pairs]
            else:
                times = [self.cp.cuda.get_elapsed_time(s, e) for s, e in pairs]
            medians.append(statistics.median(times) * 1e3)
        self.last_spread = (min(medians), max(medians))
        return statistics.median(medians)

    def graph_time_us(self, fn, budget_s=1.0):
        """GPU microseconds per call: ``k`` calls captured in one CUDA graph (torch), the graph
        replayed, CUDA events around each replay; the median of the replays over ``k``. The host
        cost of a call is not in it, which is what a model captured in a graph sees. On sm_90+
        the k calls of a gpuops op from a pdl=True module chain by programmatic dependent launch
        (as in a model whose neighbouring kernels are gpuops'); next to foreign kernels a call
        gains nothing from it (benchmarks/experiments/decode_pdl.py times both). Raises if the
        call cannot be captured (a host sync, an allocation outside the graph pool, ...)."""
        torch = self.torch
        once = _host_seconds(torch, fn)
        k = int(max(1, min(100, 2e-3 / max(once, 1e-6))))
        reps = int(max(5, min(50, budget_s / max(once * k, 1e-6))))
        try:
            return graph_replay_us(fn, calls=k, replays=reps)
        finally:
            # the graph's private pool holds k outputs; give it back before the next capture
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def copy_bandwidth_gbps(self, nbytes=1 << 30):
        """Device-to-device copy, bytes read + written per second."""
        if self.torch is not None:
            src = self.torch.empty(nbytes, dtype=self.torch.uint8, device="cuda").random_(0, 255)
            dst = self.torch.empty_like(src)
            us = self.time_us(lambda: dst.copy_(src), iters=30)
        else:
            src = self.cp.ones(nbytes, dtype=np.uint8)
            dst = self.cp.empty_like(src)
            us = self.time_us(lambda: dst.data.copy_from_device_async(src.data, nbytes), iters=30)
        return 2 * nbytes / (us * 1e-6) / 1e9


def _host_seconds(torch, fn) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def capture_graph(fn, calls=1, warmup=3):
    """A torch CUDA graph of ``calls`` calls of fn, after ``warmup`` calls on a side stream (as
    torch's docs require: lazy initialization, module loads and allocator warm-up happen there).
    thread_local capture: a failed capture raises here without breaking other threads' work."""
    import torch  # noqa: PLC0415
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    return graph


def write_experiment_json(path, copy_gbps, rows, **extra):
    """An experiment's record (benchmarks/experiments): the GPU, torch's version, the copy
    bandwidth its percentages use, its rows and anything else it names."""
    import torch  # noqa: PLC0415
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "copy_gbps": copy_gbps,
                   "torch": torch.__version__, "rows": rows, **extra}, f, indent=1)


def write_rows_json(path, copy_gbps, rows):
    """An experiment's JSON (benchmarks/experiments): the run's copy bandwidth, the GPU's name and
    the rows; nothing where path is None (no --json)."""
    if path is None:
        return
    import json  # noqa: PLC0415
    from gpuops.runtime import device  # noqa: PLC0415
    with open(path, "w") as f:
        json.dump({"copy_gbps": copy_gbps, "gpu": device.device_info(0).name, "rows": rows}, f,
                  indent=1)


def add_bandwidth_row(rows, copy_gbps, op, shape, d, config, us, nbytes, what=""):
    """An experiment's row (benchmarks/experiments): ``us`` per call moving ``nbytes``, as GB/s
    and % of the run's copy bandwidth, appended to ``rows`` (write_rows_json's) and printed."""
    gbps = nbytes / (us * 1e-6) / 1e9
    rows.append(dict(op=op, shape=list(shape), dtype=d.name, plan=config, us=us, gbps=gbps,
                     pct_copy=100 * gbps / copy_gbps, launch=what))
    print(f"{op:<13}{str(shape):<15}{d.name:<9} {config:<14}{us:9.1f} us {gbps:7.0f} GB/s "
          f"{100 * gbps / copy_gbps:5.1f}%   {what}", flush=True)


def graph_replay_us(fn, calls=20, replays=20, stat=statistics.median):
    """GPU microseconds per call of fn: ``calls`` calls captured in one graph, replayed
    ``replays`` times with CUDA events around each replay; ``stat`` (median by default) of the
    replay times over ``calls``. Shared by the bench and the experiments."""
    import torch  # noqa: PLC0415
    graph = capture_graph(fn, calls)
    graph.replay()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(replays)]
    for start, end in pairs:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e3 / calls for s, e in pairs]
    del graph
    return stat(times)


def back_to_back_us(fn, calls=200, loops=5, warmup=20):
    """Wall microseconds per call of fn called ``calls`` times back to back from Python and
    synchronized at the end (the best of ``loops`` loops): what a host-bound caller sees."""
    import torch  # noqa: PLC0415
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def _kernel_records(fn, calls):
    """[(kernel name, GPU us)] of ``calls`` eager calls of fn: CUPTI kernel records through
    torch.profiler (memcpy / memset records left out)."""
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]


def kernel_us(fn, calls=50):
    """(GPU microseconds of the kernels of one call of fn, kernels per call), from the CUPTI kernel
    records of ``calls`` eager calls."""
    records = _kernel_records(fn, calls)
    return sum(us for _, us in records) / calls, len(records) / calls


def kernel_times_us(fn, calls=10) -> dict:
    """{kernel name: GPU microseconds per call of fn}, from the CUPTI kernel records of ``calls``
    eager calls: which kernel of a multi-kernel op takes the time."""
    out: dict = {}
    for name, us in _kernel_records(fn, calls):
        out[name] = out.get(name, 0.0) + us / calls
    return out


def graph_and_body_rows(variants: dict, calls=50, replays=20, rounds=3, width=30):
    """Each variant (name -> fn) timed per call in a CUDA graph of ``calls`` calls (median of
    ``rounds`` rounds, the variants alternating within a round, of a median of ``replays``
    replays) and by its kernels' CUPTI time (kernel_us); printed one line each and returned as
    rows {"variant", "graph_us", "body_us", "kernels_per_call", "graph_rounds"}. The decode
    probe experiments' table."""
    graphs = {n: [] for n in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            graphs[name].append(graph_replay_us(fn, calls=calls, replays=replays))
    print(f"{'variant':<{width}}{'graph':>8}{'body':>8}  kernels/call")
    rows = []
    for name, fn in variants.items():
        body, k = kernel_us(fn, calls)
        gr = statistics.median(graphs[name])
        rows.append({"variant": name, "graph_us": gr, "body_us": body, "kernels_per_call": k,
                     "graph_rounds": graphs[name]})
        print(f"{name:<{width}}{gr:8.2f}{body:8.2f}  {k:.0f}", flush=True)
    return rows


def rotating(fn, items):
    """A callable that calls fn(*item) for the next of `items` on each call, round robin: inputs
    rotated through more bytes than the L2 holds, so that a timed call reads them from memory
    (captured in a graph, each replayed call keeps its own item)."""
    state = {"i": 0}

    def call():
        item = items[state["i"] % len(items)]
        state["i"] += 1
        return fn(*item)
    return call


def event_pairs_ms(fn, iters=20, warmup=3):
    """Median ms per call of fn: ``iters`` calls enqueued back to back, each between two CUDA
    events, one synchronize at the end (calls of a millisecond or more: the host stays ahead, so
    this is GPU time). Shared by the attention and group_norm experiments."""
    import torch  # noqa: PLC0415
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(iters)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def clock_trace_phases(trace, events, first, last, show=(1, 2, 3)):
    """Summary of a kernel's clock64 trace (the attention wgmma kernels' PROBE bit 3): trace is
    an int64 array [warpgroup][iteration][len(events)] of SM cycle counts, one mark per event
    per loop iteration; iterations first .. last - 1 are read (the ones the traced block ran).
    Prints the iterations in `show` (cycles since the first mark read) and, per warpgroup, the
    mean cycles of each phase (from the previous mark) and the mean iteration period; returns
    rows {"cg", "it", "t"} for a JSON record. Shared by the attention trace experiments."""
    rows = []
    t0 = min(int(trace[cg][first][0]) for cg in range(len(trace)))
    for cg in range(len(trace)):
        marks = [[int(x) for x in trace[cg][it][:len(events)]] for it in range(first, last)]
        for k, ev in enumerate(marks):
            rows.append({"cg": cg, "it": first + k, "t": [x - t0 for x in ev]})
            if first + k in show:
                print(f"cg{cg} it{first + k:3d}: " +
                      " ".join(f"{e}={x - t0}" for e, x in zip(events, ev)))
        phases = {e: statistics.mean(ev[j] - ev[j - 1] for ev in marks)
                  for j, e in enumerate(events) if j > 0}
        period = (marks[-1][0] - marks[0][0]) / max(len(marks) - 1, 1)
        print(f"cg{cg}: {len(marks)} iterations, period {period:.0f} cycles; mean cycles per "
              "phase: " + ", ".join(f"{e} {v:.0f}" for e, v in phases.items()))
    return rows


def events_ms(fn, budget_s=1.5, min_iters=3, max_iters=200):
    """Median ms per call of fn, each call between two CUDA events (GPU time of one call with
    the host's launch cost in front of it), over 3 batches after 2 warm-up calls; the batch size
    fits ``budget_s`` seconds. Shared by the GEMM experiments."""
    import torch  # noqa: PLC0415
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    iters = int(max(min_iters, min(max_iters, budget_s * 1e3 / 3 / once)))
    meds = []
    for _ in range(3):
        times = []
        for _ in range(iters):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        meds.append(statistics.median(times))
    return statistics.median(meds)


def _errors(out, ref):
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    finite = np.isfinite(ref)
    if not np.array_equal(np.isnan(out), np.isnan(ref)):
        return float("inf"), float("inf")
    diff = np.abs(out[finite] - ref[finite])
    denom = np.linalg.norm(ref[finite])
    rel = float(np.linalg.norm(diff) / denom) if denom > 0 else float(np.linalg.norm(diff))
    return rel, float(diff.max(initial=0.0))


_compiled: dict = {}


def _allow_recompiles(torch) -> None:
    """One torch.compile peer per op serves every shape and dtype the bench times, a recompile
    each (dynamic=False). Past dynamo's recompile limit (8 by default) the compiled function runs
    eager without an error, and the "torch.compile" rows would time torch eager (seen in run
    117's experiment): raise the limits for this benchmarking process."""
    cfg = torch._dynamo.config
    for name, at_least in (("recompile_limit", 1024), ("cache_size_limit", 1024),
                           ("accumulated_recompile_limit", 1 << 16),
                           ("accumulated_cache_size_limit", 1 << 16)):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), at_least))


def _peers(spec, fw, compile_peer: bool) -> dict:
    """name -> callable(*args, **kwargs) of every peer available here."""
    peers = {}
    if fw.torch is None:
        return peers
    if spec.torch_fn is not None:
        peers["torch"] = spec.torch_fn
        if compile_peer and spec.compile_peer:
            key = id(spec)
            if key not in _compiled:
                _allow_recompiles(fw.torch)
                _compiled[key] = fw.torch.compile(spec.torch_fn, dynamic=False)
            peers["torch.compile"] = _compiled[key]
    if spec.extra_peers is not None:
        try:
            peers.update(spec.extra_peers())
        except ImportError:
            pass
    return peers


def bench_op(op, d, shape, fw, copy_gbps, peer=True, compile_peer=False, graph=False) -> Row:
    spec = op.bench
    shape = tuple(shape) if shape else tuple(spec.default_shape(d))
    cshape = spec.check_shape(shape) if spec.check_shape else _check_shape(shape)
    args, kwargs = spec.make_inputs(cshape, d, fw.randn)
    out = op.function(*args, **kwargs)
    ref = op.reference(**_reference_kwargs(op, args, kwargs, fw.to_f64))
    rel, mx = _errors_any(out, ref, fw.to_f64)
    row = Row(op.name, d.name, shape, cshape, rel, mx, _within_tolerance(rel, d, out, ref),
              device=fw.name)
    del args, out
    args, kwargs = spec.make_inputs(shape, d, fw.randn)
    out = op.function(*args, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    moved = (spec.bytes_moved(args, out) if spec.bytes_moved else
             sum(fw.nbytes(a) for a in args) + sum(fw.nbytes(o) for o in outs))
    flops = spec.flops(args, out) if spec.flops else None
    del out, outs
    row.bytes = moved
    ours = lambda: op.function(*args, **kwargs)  # noqa: E731
    row.time_us = fw.time_us(ours)
    row.time_spread_us = fw.last_spread
    # Graph timing only where host time can matter: a row whose bytes alone take >= 200 us at the
    # copy bandwidth (or that takes >= 1 ms eager) is GPU-bound, and its eager time is its GPU time.
    # Capturing those (GBs of graph-pool outputs; a failed capture's pool is never given back)
    # ran the H100 out of memory for every later row in runs 10 and 11.
    gpu_bound = (copy_gbps and moved / (copy_gbps * 1e9) >= 200e-6) or row.time_us >= 1000.0
    if graph and fw.torch is not None and gpu_bound:
        row.eager_us = row.time_us
        row.timing = "eager (GPU-bound row: eager time is GPU time)"
    elif graph and fw.torch is not None:
        row.eager_us = row.time_us
        try:
            row.time_us = fw.graph_time_us(ours)
            row.timing = "graph"
        except Exception as exc:  # reported; the eager time stays the result
            row.timing = f"eager (graph capture failed: {type(exc).__name__}: {str(exc)[:160]})"
    row.gbps = moved / (row.time_us * 1e-6) / 1e9
    row.pct_copy = 100.0 * row.gbps / copy_gbps if copy_gbps else None
    if flops:
        row.tflops = flops / (row.time_us * 1e-6) / 1e12
    if peer:
        row.peers = {}
        graphed = row.timing == "graph"
        if graphed:
            row.peers_eager = {}
        for name, fn in _peers(spec, fw, compile_peer).items():
            call = lambda fn=fn: fn(*args, **kwargs)  # noqa: E731
            try:
                row.peers[name] = fw.time_us(call)
            except Exception as exc:  # a peer that fails is reported, not fatal
                row.peers[name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                continue
            if graphed:   # compared like with like: the peer's GPU time from a graph too
                row.peers_eager[name] = row.peers[name]
                try:
                    row.peers[name] = fw.graph_time_us(call)
                except Exception as exc:
                    row.peers[name] = f"graph capture failed: {type(exc).__name__}: {str(exc)[:160]}"
        timed = {k: v for k, v in row.peers.items() if isinstance(v, float)}
        if "torch" in timed:
            row.torch_us = timed["torch"]
            row.speedup_vs_torch = row.torch_us / row.time_us
        if timed:
            row.best_peer = min(timed, key=timed.get)
            row.best_peer_us = timed[row.best_peer]
            row.speedup_vs_best = row.best_peer_us / row.time_us
    return row


def _reference_kwargs(op, args, kwargs, to_f64):
    names = [n for n in op.param_names if n != "out"]
    ref = {name: to_f64(value) for name, value in zip(names, args)}
    ref.update({name: to_f64(value) for name, value in kwargs.items()})
    return ref


def _errors_any(out, ref, to_f64):
    """Worst relative error over all outputs (tuples compared element by element)."""
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    worst = (0.0, 0.0)
    for o, r in zip(outs, refs):
        e = _errors(to_f64(o), r)
        worst = max(worst, e)
    return worst


def _storage_dtype(o):
    """The NumPy dtype an output is stored in (bfloat16 through ml_dtypes), or None."""
    name = str(getattr(o, "dtype", "")).replace("torch.", "")
    d = dt.BY_NAME.get(name)
    if d is None or d not in dt.FLOATS:
        return None
    try:
        return dt.to_numpy(d)
    except TypeError:                       # bfloat16 without ml_dtypes
        return None


def _rounding_floor(out, ref) -> float:
    """Worst relative error of the float64 reference itself, rounded to each output's storage
    dtype: what a correctly rounded result shows. Normally far below TOLERANCE, but not for
    outputs in fp16's subnormal range (softmax over rows of 393,216 elements: values ~2.5e-6,
    4.1e-3 from the reference after rounding alone)."""
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    worst = 0.0
    for o, r in zip(outs, refs):
        nd = _storage_dtype(o)
        r = np.asarray(r)
        if nd is None or r.dtype.kind != "f":
            continue
        with np.errstate(over="ignore"):
            worst = max(worst, _errors(r.astype(nd).astype(np.float64), r)[0])
    return worst


def _within_tolerance(rel: float, d, out, ref) -> bool:
    """The dtype's tolerance, or twice the storage rounding floor where that is larger (a result
    within one rounding of the correctly rounded one)."""
    return rel <= TOLERANCE[d.name] or rel <= 2.0 * _rounding_floor(out, ref)


def bench_reference_only(op, d, shape) -> Row:
    """No GPU: time the CPU path (the NumPy reference) and check its casting."""
    spec = op.bench
    shape = tuple(shape) if shape else tuple(spec.default_shape(d))
    # the op's own check shape where it has one (a generic row cut can miss: attention's bench
    # shape ends in the causal flag, 0, so its element count is 0)
    shape = spec.check_shape(shape) if spec.check_shape else _check_shape(shape)
    rng = np.random.default_rng(0)

    def randn(s, dd):
        return rng.standard_normal(s).astype(dt.to_numpy(dd))
    args, kwargs = spec.make_inputs(shape, d, randn)
    t0 = time.perf_counter()
    out = op.function(*args, **kwargs)
    us = (time.perf_counter() - t0) * 1e6
    to64 = lambda x: x.astype(np.float64) if isinstance(x, np.ndarray) else x  # noqa: E731
    ref = op.reference(**_reference_kwargs(op, args, kwargs, to64))
    rel, mx = _errors_any(out, ref, to64)
    return Row(op.name, d.name, shape, shape, rel, mx, _within_tolerance(rel, d, out, ref),
               time_us=us)


# --------------------------------------------------------------------------------------------
# runtime costs: host dispatch overhead, module load and compile times

_BARE = r'''
extern "C" __global__ void relu_f32(const float* x, float* y, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] < 0.f ? 0.f : x[i];
}'''


def _host_us(fn, sync, n=2000, batches=5):
    """Host microseconds per call, back to back: the fastest of ``batches`` batch means (host
    timings on a shared machine only ever get slower from interference, so the minimum is the
    estimate of the code's own cost)."""
    for _ in range(50):
        fn()
    sync()
    best = float("inf")
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def dispatch_overhead(fw) -> dict:
    """Host microseconds per call, back to back, of a 1024-element ReLU by several routes."""
    import gpuops  # noqa: PLC0415
    cp = fw.cp
    n = 1024
    res = {}
    if fw.torch is not None:
        fw.torch.cuda.empty_cache()     # the benchmarks before leave GBs of cached blocks behind
    bare = cp.RawKernel(_BARE, "relu_f32")
    xc = cp.random.standard_normal(n, dtype=np.float32)
    yc = cp.empty_like(xc)
    sync = fw.sync
    res["bare_cupy_launch_us"] = _host_us(lambda: bare((4,), (256,), (xc, yc, np.int64(n))), sync)
    res["bare_cupy_alloc_launch_us"] = _host_us(
        lambda: bare((4,), (256,), (xc, cp.empty_like(xc), np.int64(n))), sync)
    res["gpuops_cupy_us"] = _host_us(lambda: gpuops.relu(xc), sync)
    res["gpuops_cupy_out_us"] = _host_us(lambda: gpuops.relu(xc, out=yc), sync)
    if fw.torch is not None:
        torch = fw.torch
        xt = torch.randn(n, device="cuda")
        yt = torch.empty_like(xt)
        res["gpuops_torch_us"] = _host_us(lambda: gpuops.relu(xt), sync)
        res["gpuops_torch_out_us"] = _host_us(lambda: gpuops.relu(xt, out=yt), sync)
        res["torch_relu_us"] = _host_us(lambda: torch.relu(xt), sync)
        res["overhead_vs_bare_cupy_us"] = res["gpuops_torch_us"] - res["bare_cupy_launch_us"]
    res["overhead_cupy_vs_bare_cupy_us"] = res["gpuops_cupy_us"] - res["bare_cupy_alloc_launch_us"]
    return res


_LOAD_SNIPPET = r'''
import json, sys, time
import cupy as cp
cp.cuda.Device(0).use(); cp.empty(1); cp.cuda.runtime.deviceSynchronize()
from gpuops.runtime import device, loader, modules
device.device_info(0)
m = modules.get_module(sys.argv[1])
t = time.perf_counter(); lm = loader.load(m, 0); s = time.perf_counter() - t
print(json.dumps({"seconds": s, "origin": lm.origin, "target": lm.target.label}))
'''


def module_load_times() -> list:
    """Per module, in fresh processes: cold (compile + load, empty cache) and warm (disk cache)."""
    from gpuops.runtime.modules import all_modules  # noqa: PLC0415
    rows = []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for m in all_modules():
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, GPUOPS_CACHE_DIR=cache, GPUOPS_QUIET="1",
                       PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
            env.pop("GPUOPS_KERNEL_BUNDLE", None)
            runs = []
            for _ in range(2):
                p = subprocess.run([sys.executable, "-c", _LOAD_SNIPPET, m.name], env=env,
                                   capture_output=True, text=True, timeout=600)
                if p.returncode != 0:
                    raise RuntimeError(f"module load of {m.name} failed:\n{p.stderr[-2000:]}")
                runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        rows.append({"module": m.name, "kernels": len(m.kernels), "target": runs[0]["target"],
                     "cold_compile_and_load_ms": runs[0]["seconds"] * 1e3,
                     "cold_origin": runs[0]["origin"],
                     "warm_load_ms": runs[1]["seconds"] * 1e3, "warm_origin": runs[1]["origin"]})
    return rows


# --------------------------------------------------------------------------------------------

def context(fw, copy_gbps) -> dict:
    import gpuops  # noqa: PLC0415
    ctx = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "gpuops": gpuops.__version__, "python": platform.python_version(),
           "numpy": np.__version__}
    cp = device.cupy_or_none()
    ctx["cupy"] = cp.__version__ if cp else None
    ctx["nvrtc"] = ".".join(map(str, nvrtc.version())) if nvrtc.available() else None
    if fw is not None:
        info = device.device_info(0)
        ctx.update(gpu=info.name, compute_capability=info.cc, sm_count=info.sm_count,
                   framework=fw.name, copy_gbps=copy_gbps,
                   gpuops_arch=os.environ.get("GPUOPS_ARCH"),
                   kernel_bundle=os.environ.get("GPUOPS_KERNEL_BUNDLE"))
        try:
            ctx["driver"] = cp.cuda.runtime.driverGetVersion()
        except Exception:
            pass
        if fw.torch is not None:
            ctx["torch"] = fw.torch.__version__
    else:
        ctx["gpu"] = None
    return ctx


def fmt_table(rows) -> str:
    head = (f"{'op':<18}{'dtype':<10}{'shape':<18}{'rel err':>9} {'ok':<3}{'time us':>10}"
            f"{'GB/s':>8}{'%copy':>7}{'torch':>7}{'best peer':>24}{'x best':>8}{'eager us':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        def f(v, spec):
            return format(v, spec) if isinstance(v, (int, float)) else "-".rjust(len(format(0.0, spec)))
        best = f"{r.best_peer} {r.best_peer_us:.1f}" if r.best_peer else "-"
        lines.append(f"{r.op:<18}{r.dtype:<10}{'x'.join(map(str, r.shape)):<18}{r.rel_err:9.1e} "
                     f"{'y' if r.ok else 'NO':<3}{f(r.time_us, '10.1f')}{f(r.gbps, '8.0f')}"
                     f"{f(r.pct_copy, '7.1f')}{f(r.speedup_vs_torch, '7.2f')}{best:>24}"
                     f"{f(r.speedup_vs_best, '8.2f')}{f(r.eager_us, '10.1f')}")
    return "\n".join(lines)


def _load_all_modules():
    """Compile (first use) or load every kernel module before timing, with a progress bar."""
    from gpuops.runtime import loader, progress  # noqa: PLC0415
    from gpuops.runtime.modules import all_modules  # noqa: PLC0415
    cc = device.device_info(0).cc
    mods = [m for m in all_modules() if m.supports(cc)]
    bar = progress.Bar(len(mods), "gpuops kernels")
    for m in mods:
        loader.load(m, 0)
        bar.step(m.name)


def run(ops=None, shape=None, dtypes=None, json_path=None, runtime=False, peer=True,
        out=sys.stdout, compile_peer=False, all_shapes=False, families=None, graph=False) -> dict:
    from gpuops.runtime import progress  # noqa: PLC0415
    selected = [o for o in registry.ops() if o.bench is not None and (not ops or o.name in ops)
                and (not families or o.family in families)]
    if ops:
        unknown = set(ops) - {o.name for o in registry.ops()}
        if unknown:
            raise SystemExit(f"gpuops bench: unknown op(s): {', '.join(sorted(unknown))}")
    dts = [dt.BY_NAME[n] for n in dtypes] if dtypes else None
    rows = []
    result = {}
    if not device.gpu_available():
        print("gpuops bench: no GPU found: running the NumPy references on the CPU "
              "(at the check shape) instead of timing kernels", file=out)
        for op in selected:
            for d in (dts or [dt.float32]):
                if d in op.dtypes:
                    rows.append(bench_reference_only(op, d, shape))
        result["context"] = context(None, None)
    else:
        fw = _Framework()
        copy_gbps = fw.copy_bandwidth_gbps()
        print(f"gpuops bench on {device.device_info(0).name}: device-to-device copy "
              f"{copy_gbps:.0f} GB/s (read + write), inputs from {fw.name}", file=out)
        jobs = [(op, d) for op in selected for d in (dts or op.dtypes) if d in op.dtypes]
        if not ops and not families:
            # the whole bench: every module loaded (or compiled) first, with a progress bar; a
            # selection loads only its ops' modules, at their warm-up calls (compiling all ~80
            # modules on a bare device took more than 500 s: run 171)
            _load_all_modules()
        bar = progress.Bar(len(jobs), "gpuops bench")
        for op, d in jobs:
            shapes = [shape] + (list(op.bench.extra_shapes) if all_shapes and not shape else [])
            for s in shapes:
                rows.append(bench_op(op, d, s, fw, copy_gbps, peer=peer, compile_peer=compile_peer,
                                     graph=graph))
            bar.step(f"{op.name} {d.name}")
            if json_path:  # rows so far, so that a run cut off at its time limit keeps them
                _write_json(json_path, {"partial": True, "context": context(fw, copy_gbps),
                                        "rows": [asdict(r) for r in rows]})
        result["context"] = context(fw, copy_gbps)
        if runtime:
            result["dispatch"] = dispatch_overhead(fw)
            result["module_load"] = module_load_times()
    result["rows"] = [asdict(r) for r in rows]
    print(fmt_table(rows), file=out)
    if "dispatch" in result:
        print("\nhost time per call, 1024-element relu, back to back (us):", file=out)
        for k, v in result["dispatch"].items():
            print(f"  {k:<32}{v:8.2f}", file=out)
    if "module_load" in result:
        print("\nmodule load (fresh process): cold = compile + load, warm = disk cache", file=out)
        for m in result["module_load"]:
            print(f"  {m['module']:<26}{m['kernels']:4d} kernels {m['target']:<12}"
                  f"cold {m['cold_compile_and_load_ms']:8.1f} ms   warm {m['warm_load_ms']:6.1f} ms",
                  file=out)
    bad = [r for r in rows if not r.ok]
    if bad:
        print(f"\n{len(bad)} result(s) outside tolerance: "
              + ", ".join(f"{r.op}/{r.dtype}" for r in bad), file=out)
    if json_path:
        _write_json(json_path, result)
    return result


def _write_json(path, result):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)
