"""Softmax and log_softmax over any dimension, and their backward ops.

Kernels (cuda_src/softmax/), all fp32 math for fp32/fp16/bf16 storage:

* ``softmax_rows.cu``: the reduced dimension is the innermost one (unit stride) and a row fits in
  one thread group's registers (up to 8 packs of 16 bytes per thread, 1024 threads): one warp or
  sub-warp per short row, one block per medium row; the row is read once and written once.
* ``softmax_split.cu``: rows too long for that (or too few to fill the GPU one block per row):
  each row is split over S blocks; a stats kernel writes per-chunk online (max, sum exp) or
  sum(g * y) partials, an apply kernel merges them and writes its chunk (the re-read hits L2
  when the rows in flight fit there).
* ``softmax_cols.cu``: any other layout (a reduced dimension that is not innermost, e.g. dim=1 of
  [B, C, H, W], or transposed inputs): threads along the fastest other dimension, 16-byte packs
  where the layout allows, the reduction split over blockDim.y threads, two passes over R.

Outputs gpuops allocates have the input's strides when the input is dense (a permutation of a
contiguous layout, like ``torch.empty_like``), otherwise they are contiguous. A layout whose other
dimensions do not merge into two strided dimensions is first copied to a contiguous array (the
only case with a hidden copy).
"""
from __future__ import annotations

import numbers
from math import prod

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.registry import register
from gpuops.runtime import device, loader
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.shapes import contiguous_strides
from gpuops.tensor import Tensor, _contiguous

_B = {True: "true", False: "false"}
# Packs per thread of the row kernels (16-byte packs, or single elements on the scalar path); each
# value is one instantiation per dtype and op, so the lists are kept short.
ROW_P = {True: (2, 4, 8), False: (4, 16)}
# The forward's 16-byte rows: a warp per row holds at most this many packs per thread; longer rows
# take a block of 64+ threads (run 173, H200, rows of 256 packs: fp32 [131072, 1024] softmax
# 254.4 us at 64 threads x 4 packs against 260.6 for a warp of 8 packs, Liger 254.4; bf16
# [65536, 2048] 129.7 against 132.1, Liger 145.5; the warp of 4 packs stays best at 128 packs:
# bf16 [131072, 1024] 130.6 us against 159.1 at 64 x 4 with half the threads idle)
WARP_ROW_MAX_PACKS = 4
ROW_BWD_P = {True: (2, 4), False: (2, 4)}       # backward: two inputs in registers
SPLIT_THREADS = 256             # as in softmax_split.cu (and the CE kernels)
COL_THREADS = 256               # kColThreads in softmax_cols.cu

ROWS_FWD_ARGS = ArgSpec("ptr", "ptr", "i64", "i32", "i64", "i64")
ROWS_BWD_ARGS = ArgSpec("ptr", "ptr", "ptr", "i64", "i32", "i64", "i64", "i64")
SPLIT_STATS_ARGS = ArgSpec("ptr", "i64", "i32", "i32", "i32", "ptr")
SPLIT_APPLY_ARGS = ArgSpec("ptr", "ptr", "i64", "i64", "i32", "i32", "i32", "ptr")
SPLIT_BSTATS_ARGS = ArgSpec("ptr", "ptr", "i64", "i64", "i32", "i32", "i32", "ptr")
SPLIT_BAPPLY_ARGS = ArgSpec("ptr", "ptr", "ptr", "i64", "i64", "i64", "i32", "i32", "i32", "ptr")
COLS_FWD_ARGS = ArgSpec("ptr", "ptr", "i32", "i64", "i32", *["i64"] * 6)
COLS_BWD_ARGS = ArgSpec("ptr", "ptr", "ptr", "i32", "i64", "i32", *["i64"] * 9)


def _rows_expr(d, v, p, log):
    return f"gpuops::softmax_rows<{d.ctype}, {_B[v]}, {p}, {_B[log]}>"


def _rows_bwd_expr(d, v, p, log):
    return f"gpuops::softmax_backward_rows<{d.ctype}, {_B[v]}, {p}, {_B[log]}>"


ROWS_MODULE = KernelModule("softmax.rows", "softmax/softmax_rows.cu", {
    **{_rows_expr(d, v, p, log): ROWS_FWD_ARGS
       for d in dt.FLOATS for v in (True, False) for p in ROW_P[v] for log in (False, True)},
    **{_rows_bwd_expr(d, v, p, log): ROWS_BWD_ARGS
       for d in dt.FLOATS for v in (True, False) for p in ROW_BWD_P[v] for log in (False, True)}},
    pdl=True)

SPLIT_MODULE = KernelModule("softmax.split", "softmax/softmax_split.cu", {
    **{f"gpuops::softmax_split_stats<{d.ctype}, {_B[v]}>": SPLIT_STATS_ARGS
       for d in dt.FLOATS for v in (True, False)},
    **{f"gpuops::softmax_split_apply<{d.ctype}, {_B[v]}, {_B[log]}>": SPLIT_APPLY_ARGS
       for d in dt.FLOATS for v in (True, False) for log in (False, True)},
    **{f"gpuops::softmax_backward_split_stats<{d.ctype}, {_B[v]}, {_B[log]}>": SPLIT_BSTATS_ARGS
       for d in dt.FLOATS for v in (True, False) for log in (False, True)},
    **{f"gpuops::softmax_backward_split_apply<{d.ctype}, {_B[v]}, {_B[log]}>": SPLIT_BAPPLY_ARGS
       for d in dt.FLOATS for v in (True, False) for log in (False, True)}}, pdl=True)

COLS_MODULE = KernelModule("softmax.cols", "softmax/softmax_cols.cu", {
    **{f"gpuops::softmax_cols<{d.ctype}, {_B[v]}, {_B[log]}>": COLS_FWD_ARGS
       for d in dt.FLOATS for v in (True, False) for log in (False, True)},
    **{f"gpuops::softmax_backward_cols<{d.ctype}, {_B[v]}, {_B[log]}>": COLS_BWD_ARGS
       for d in dt.FLOATS for v in (True, False) for log in (False, True)}}, pdl=True)


class KernelCache:
    """Kernel objects by (device, module, name), looked up once (the host path is hot); forgotten
    when the loader forgets its modules."""

    @staticmethod
    def get(dev: int, module, expr: str):
        return loader.kernel(module, dev, expr)


KERNELS = KernelCache()


sm_count = device.sm_count


def pow2ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# Layouts: which kernel, and how it walks the operands.

def norm_dim(op: str, ndim: int, dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"gpuops.{op}: 'dim' must be an int, got {type(dim).__name__}")
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise ValueError(f"gpuops.{op}: dim={dim} is out of range for a {ndim}-d input "
                         f"(expected {-n}..{n - 1})")
    return int(dim) % n


def like_strides(shape, strides) -> tuple:
    """Strides of the output gpuops allocates for an input of this layout: the input's own
    layout when it is dense (a permutation of a contiguous layout), else contiguous. Also used by
    the fake (meta) implementations of the torch layer, so both agree."""
    shape, strides = tuple(shape), tuple(strides)
    perm = dense_order(shape, strides)
    if perm is None:
        return contiguous_strides(shape)
    out = [0] * len(shape)
    acc = 1
    for k in reversed(perm):
        out[k] = acc
        acc *= max(shape[k], 1)
    return tuple(out)


def dense_order(shape, strides):
    """Dimensions from slowest to fastest if the layout is dense but not contiguous, else None."""
    if not shape or prod(shape) == 0 or _contiguous(shape, strides):
        return None
    big = sorted((k for k in range(len(shape)) if shape[k] > 1), key=lambda k: strides[k])
    expected = 1
    for k in big:
        if strides[k] != expected:
            return None
        expected *= shape[k]
    # size-1 dimensions (any stride) go innermost; they do not change the memory order
    return tuple(sorted(range(len(shape)), key=lambda k: (-(strides[k] if shape[k] > 1 else 0), k)))


def empty_like(call, t: Tensor) -> Tensor:
    """A new output with t's shape and the layout of :func:`like_strides`."""
    perm = None if t.contiguous else dense_order(tuple(t.shape), tuple(t.strides))
    if perm is None:
        return call.empty(tuple(t.shape), t.dtype)
    base = call.empty(tuple(t.shape[k] for k in perm), t.dtype)
    inverse = [0] * len(perm)
    for pos, k in enumerate(perm):
        inverse[k] = pos
    obj = base.obj.permute(*inverse) if call.kind == "torch" else base.obj.transpose(inverse)
    strides = like_strides(t.shape, t.strides)
    return Tensor(base.ptr, tuple(t.shape), strides, t.dtype, t.device, obj, base.numel, False)


def contiguous_copy(call, t: Tensor) -> Tensor:
    """A contiguous copy made by the caller's framework (on the call's stream)."""
    if call.kind == "torch":
        c = t.obj.contiguous()
        return Tensor(c.data_ptr(), tuple(c.shape), c.stride(), t.dtype, t.device, c, c.numel(),
                      True)
    cp = device.cupy_or_none()
    c = cp.ascontiguousarray(t.obj)
    return Tensor(c.data.ptr, c.shape, contiguous_strides(c.shape), t.dtype, t.device, c, c.size,
                  True)


def check_out(op: str, out: Tensor, shape, inputs: dict):
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"gpuops.{op}: 'out' has shape {tuple(out.shape)}, the result has "
                         f"{tuple(shape)}")
    if any(st == 0 for st, n in zip(out.strides, out.shape) if n > 1):
        raise ValueError(f"gpuops.{op}: 'out' has overlapping elements (a stride of 0)")
    lo, hi = out.span()
    for name, t in inputs.items():
        a, b = t.span()
        if a <= hi and lo <= b and not (t.ptr == out.ptr and tuple(t.shape) == tuple(out.shape)
                                        and tuple(t.strides) == tuple(out.strides)):
            raise ValueError(f"gpuops.{op}: 'out' overlaps {name!r} without being the same view; "
                             "in-place use must pass the identical array")


def merge_other_dims(shape, d, strides_list):
    """The dimensions other than ``d``, ordered fastest first by the first operand's strides and
    merged where every operand walks them contiguously: [(size, (stride per operand))]."""
    others = [(shape[k], tuple(st[k] for st in strides_list))
              for k in range(len(shape)) if k != d and shape[k] != 1]
    others.sort(key=lambda e: abs(e[1][0]))
    merged = []
    for size, sts in others:
        if merged:
            psize, psts = merged[-1]
            if all(s == psize * p for s, p in zip(sts, psts)):
                merged[-1] = (psize * size, psts)
                continue
        merged.append((size, sts))
    return merged


class Layout:
    """How a softmax-like op walks its operands (in kernel argument order).

    kind 'rows': ``rows`` rows of ``n`` unit-stride elements, row strides ``row_strides``;
    kind 'cols': [O, R, I] with strides (so, sr, si) per operand; None when more than two other
    dimensions remain after merging."""

    __slots__ = ("kind", "n", "rows", "row_strides", "O", "I", "strides")

    @staticmethod
    def of(shape, d, strides_list):
        shape = tuple(shape) or (1,)
        strides_list = [tuple(st) or (1,) for st in strides_list]
        lay = Layout()
        n = shape[d]
        srs = tuple(st[d] for st in strides_list)
        merged = merge_other_dims(shape, d, strides_list)
        lay.n = n
        zeros = tuple(0 for _ in strides_list)
        if len(merged) <= 1 and (n == 1 or all(s == 1 for s in srs)):
            lay.kind = "rows"
            lay.rows, lay.row_strides = merged[0] if merged else (1, zeros)
            return lay
        if len(merged) > 2:
            return None
        lay.kind = "cols"
        I, si = merged[0] if merged else (1, zeros)
        O, so = merged[1] if len(merged) == 2 else (1, zeros)
        lay.I, lay.O = I, O
        lay.strides = tuple((a, b, c) for a, b, c in zip(so, srs, si))
        return lay


def row_config(packs: int, choices: tuple, few_rows: bool = False, warp_max: int | None = None):
    """(threads per row, packs per thread) for a register-resident row, or None if the row is
    longer than 1024 threads x max(choices) packs. Threads: a power of two, up to a warp for
    rows of up to 32 x warp_max packs (default max(choices); then several rows per block), else
    64..1024; packs per thread: the smallest of ``choices`` that covers the row.

    few_rows (fewer rows than SMs: decode-sized calls): rows of at least 64 x min(choices) packs
    take a block of 64..1024 threads with about min(choices) packs each. The GPU is mostly idle
    there and a call lasts as long as one row's chain of loads, exps, adds and reductions, which
    is shorter across more threads (run 65: [16, 2048] bf16 softmax 3.9 us with a warp per row,
    fp32 2.4 us with 128 threads per row)."""
    pmax = choices[-1]
    if few_rows and 64 * choices[0] <= packs <= 1024 * pmax:
        tx = min(1024, pow2ceil(cdiv(packs, choices[0])))
        return tx, next(p for p in choices if p >= cdiv(packs, tx))
    wmax = pmax if warp_max is None else min(warp_max, pmax)
    if packs <= 32 * wmax:
        tx = min(32, pow2ceil(cdiv(packs, 2)))
        if cdiv(packs, tx) > wmax:
            tx = 32
    elif packs <= 1024 * pmax:
        tx = min(1024, max(64, pow2ceil(cdiv(packs, 4))))
        if cdiv(packs, tx) > pmax:
            tx = 1024
    else:
        return None
    need = cdiv(packs, tx)
    return tx, next(p for p in choices if p >= need)


def split_config(rows: int, n: int, vec: int, dev: int):
    """(chunk elements, chunks per row) for the split kernels: about one wave of 256-thread
    blocks, each handling a whole number of 256 x vec steps."""
    step = SPLIT_THREADS * vec
    steps = cdiv(n, step)
    per_block = max(1, cdiv(rows * steps, sm_count(dev) * 8))
    per_block = min(per_block, steps)
    chunk = per_block * step
    return chunk, cdiv(n, chunk)


# Rows at least this many bytes in total, but fewer than one per SM, go to the split kernels even
# when they fit in registers: one block per row would leave most SMs idle.
SPLIT_MIN_BYTES = 8 << 20
# ... and so do rows of at least this many bytes each, whatever the total: one SM streams a
# 768 KB row (8 x 393216 bf16, 6 MB in all) at a few tens of GB/s, 8 blocks took ~70 us on the
# H100 where the two split kernels move the bytes at full bandwidth in a few us
SPLIT_MIN_ROW_BYTES = 256 << 10


def _use_split(rows, n, itemsize, dev, packs_ok) -> bool:
    if not packs_ok:
        return True
    return rows < sm_count(dev) and (rows * n * itemsize >= SPLIT_MIN_BYTES
                                     or n * itemsize >= SPLIT_MIN_ROW_BYTES)


# ---------------------------------------------------------------------------------------------
# Launchers. A call's launches depend only on the operands' shapes, strides, 16-byte alignment,
# dim, dtype and device: they are planned once per such key (the decode-size path is host-bound)
# and replayed with the call's pointers.

class _Ptr:
    """Placeholder for the k-th pointer of a call (operands, then the workspace) in a plan."""
    __slots__ = ("k",)

    def __init__(self, k):
        self.k = k


_P = tuple(_Ptr(k) for k in range(4))


class Plan:
    __slots__ = ("steps", "ws")

    def __init__(self, steps, ws=0):
        self.steps = steps          # [(module, kernel name, grid, block, args with _Ptr slots)]
        self.ws = ws                # fp32 workspace elements

    def run(self, call, ptrs: tuple):
        # the workspace Tensor is held until every launch is enqueued: dropped earlier, its
        # memory could go to another allocation that these kernels then race with
        ws = call.empty((self.ws,), dt.float32) if self.ws else None
        if ws is not None:
            ptrs = ptrs + (ws.ptr,)
        dev, stream = call.device, call.stream
        for module, expr, grid, block, args in self.steps:
            KERNELS.get(dev, module, expr).launch(
                grid, block, stream, *[ptrs[a.k] if type(a) is _Ptr else a for a in args])


_PLANS: dict = {}
_MAX_PLANS = 4096


def _cached_plan(key, build):
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = build()
    return plan


def _forward(call, x: Tensor, dim, out, log: bool) -> Tensor:
    op = call.op.name
    if out is None:
        out = empty_like(call, x)
    else:
        check_out(op, out, x.shape, {"input": x})
    if type(dim) is not int:     # (also keeps 1.0 from sharing the plan of 1)
        dim = norm_dim(op, len(x.shape), dim)
    dtype, dev = call.result_dtype, call.device
    key = (x.shape, x.strides, out.strides, dim, log, dtype, dev, x.ptr % 16 == 0,
           out.ptr % 16 == 0)
    plan = _PLANS.get(key)
    if plan is None:
        d = norm_dim(op, len(x.shape), dim)
        if x.numel == 0:
            return out
        lay = Layout.of(x.shape, d, [x.strides, out.strides])
        if lay is None:
            return _forward_exotic(call, x, d, out, log)
        plan = _cached_plan(key, lambda: _forward_plan(lay, log, dtype, dev, key[-2:]))
    plan.run(call, (x.ptr, out.ptr))
    return out


def _forward_exotic(call, x, d, out, log):
    """Other dims that do not merge into two: a contiguous copy of x first (not cached)."""
    dtype, dev = call.result_dtype, call.device
    x = contiguous_copy(call, x)
    lay = Layout.of(x.shape, d, [x.strides, out.strides])
    y = out
    if lay is None:        # out itself has an exotic layout: compute into a fresh array
        y = call.empty(tuple(x.shape), dtype)
        lay = Layout.of(x.shape, d, [x.strides, y.strides])
    _forward_plan(lay, log, dtype, dev, (x.ptr % 16 == 0, y.ptr % 16 == 0)).run(
        call, (x.ptr, y.ptr))
    if y is not out:
        copy_into(call, out, y)
    return out


def copy_into(call, out: Tensor, src: Tensor):
    if call.kind == "torch":
        out.obj.copy_(src.obj)
    else:
        out.obj[...] = src.obj


def _forward_plan(lay: Layout, log: bool, dtype, dev: int, aligned) -> Plan:
    vec = 16 // dtype.itemsize
    n = lay.n
    X, Y, WS = _P[0], _P[1], _P[2]
    if lay.kind == "rows":
        xs, ys = lay.row_strides
        rows = lay.rows
        v = n % vec == 0 and xs % vec == 0 and ys % vec == 0 and all(aligned)
        N = vec if v else 1
        cfg = row_config(n // N, ROW_P[v], rows < sm_count(dev),
                         WARP_ROW_MAX_PACKS if v else None)
        if not _use_split(rows, n, dtype.itemsize, dev, cfg is not None):
            tx, p = cfg
            ty = max(1, COL_THREADS // tx) if tx <= 32 else 1
            return Plan([(ROWS_MODULE, _rows_expr(dtype, v, p, log), (cdiv(rows, ty), 1, 1),
                          (tx, ty, 1), (X, Y, rows, n, xs, ys))])
        chunk, S = split_config(rows, n, N, dev)
        grid, block = (rows * S, 1, 1), (SPLIT_THREADS, 1, 1)
        return Plan([
            (SPLIT_MODULE, f"gpuops::softmax_split_stats<{dtype.ctype}, {_B[v]}>", grid, block,
             (X, xs, n, chunk, S, WS)),
            (SPLIT_MODULE, f"gpuops::softmax_split_apply<{dtype.ctype}, {_B[v]}, {_B[log]}>",
             grid, block, (X, Y, xs, ys, n, chunk, S, WS))], ws=rows * S * 2)
    (xso, xsr, xsi), (yso, ysr, ysi) = lay.strides
    v = (xsi == 1 and ysi == 1 and lay.I % vec == 0 and all(aligned) and all(
        s % vec == 0 for s in (xso, yso, xsr, ysr)))
    grid, block, nib = _cols_config(lay, vec if v else 1, dev)
    return Plan([(COLS_MODULE, f"gpuops::softmax_cols<{dtype.ctype}, {_B[v]}, {_B[log]}>", grid,
                  block, (X, Y, n, lay.I, nib, xso, xsr, xsi, yso, ysr, ysi))])


def _cols_config(lay: Layout, N: int, dev: int):
    """grid, block, blocks along I for the column kernels: threads along I first (coalesced),
    fewer of them and more along R when there would be too few blocks to fill the GPU."""
    units = cdiv(lay.I, N)
    tx = min(COL_THREADS, pow2ceil(units))
    while tx > 32 and lay.O * cdiv(units, tx) < 4 * sm_count(dev):
        tx //= 2
    ty = min(COL_THREADS // tx, pow2ceil(lay.n))
    nib = cdiv(units, tx)
    return (lay.O * nib, 1, 1), (tx, ty, 1), nib


def _backward(call, grad: Tensor, y: Tensor, dim, out, log: bool) -> Tensor:
    op = call.op.name
    if tuple(grad.shape) != tuple(y.shape):
        raise ValueError(f"gpuops.{op}: 'grad_output' has shape {tuple(grad.shape)} but 'output' "
                         f"has {tuple(y.shape)}; they must match")
    if out is None:
        out = empty_like(call, y)
    else:
        check_out(op, out, y.shape, {"grad_output": grad, "output": y})
    if type(dim) is not int:
        dim = norm_dim(op, len(y.shape), dim)
    dtype, dev = call.result_dtype, call.device
    key = (y.shape, grad.strides, y.strides, out.strides, dim, log, dtype, dev,
           grad.ptr % 16 == 0, y.ptr % 16 == 0, out.ptr % 16 == 0)
    plan = _PLANS.get(key)
    if plan is None:
        d = norm_dim(op, len(y.shape), dim)
        if y.numel == 0:
            return out
        lay = Layout.of(y.shape, d, [grad.strides, y.strides, out.strides])
        if lay is None:
            return _backward_exotic(call, grad, y, d, out, log)
        plan = _cached_plan(key, lambda: _backward_plan(lay, log, dtype, dev, key[-3:]))
    plan.run(call, (grad.ptr, y.ptr, out.ptr))
    return out


def _backward_exotic(call, grad, y, d, out, log):
    dtype, dev = call.result_dtype, call.device
    grad, y = contiguous_copy(call, grad), contiguous_copy(call, y)
    lay = Layout.of(y.shape, d, [grad.strides, y.strides, out.strides])
    dx = out
    if lay is None:
        dx = call.empty(tuple(y.shape), dtype)
        lay = Layout.of(y.shape, d, [grad.strides, y.strides, dx.strides])
    aligned = (grad.ptr % 16 == 0, y.ptr % 16 == 0, dx.ptr % 16 == 0)
    _backward_plan(lay, log, dtype, dev, aligned).run(call, (grad.ptr, y.ptr, dx.ptr))
    if dx is not out:
        copy_into(call, out, dx)
    return out


def _backward_plan(lay: Layout, log: bool, dtype, dev: int, aligned) -> Plan:
    vec = 16 // dtype.itemsize
    n = lay.n
    G, Y, D, WS = _P
    tail = f"<{dtype.ctype}, {{}}, {_B[log]}>"
    if lay.kind == "rows":
        gs, ys, ds = lay.row_strides
        rows = lay.rows
        v = n % vec == 0 and all(s % vec == 0 for s in (gs, ys, ds)) and all(aligned)
        N = vec if v else 1
        cfg = row_config(n // N, ROW_BWD_P[v], rows < sm_count(dev))
        if not _use_split(rows, n, dtype.itemsize, dev, cfg is not None):
            tx, p = cfg
            ty = max(1, COL_THREADS // tx) if tx <= 32 else 1
            return Plan([(ROWS_MODULE, _rows_bwd_expr(dtype, v, p, log), (cdiv(rows, ty), 1, 1),
                          (tx, ty, 1), (G, Y, D, rows, n, gs, ys, ds))])
        chunk, S = split_config(rows, n, N, dev)
        grid, block = (rows * S, 1, 1), (SPLIT_THREADS, 1, 1)
        t = tail.format(_B[v])
        return Plan([
            (SPLIT_MODULE, "gpuops::softmax_backward_split_stats" + t, grid, block,
             (G, Y, gs, ys, n, chunk, S, WS)),
            (SPLIT_MODULE, "gpuops::softmax_backward_split_apply" + t, grid, block,
             (G, Y, D, gs, ys, ds, n, chunk, S, WS))], ws=rows * S)
    (gso, gsr, gsi), (yso, ysr, ysi), (dso, dsr, dsi) = lay.strides
    v = (gsi == 1 and ysi == 1 and dsi == 1 and lay.I % vec == 0 and all(aligned) and all(
        s % vec == 0 for s in (gso, gsr, yso, ysr, dso, dsr)))
    grid, block, nib = _cols_config(lay, vec if v else 1, dev)
    return Plan([(COLS_MODULE, "gpuops::softmax_backward_cols" + tail.format(_B[v]), grid, block,
                  (G, Y, D, n, lay.I, nib, gso, gsr, gsi, yso, ysr, ysi, dso, dsr, dsi))])


# ---------------------------------------------------------------------------------------------
# NumPy references, float64.

def _moved(x, d):
    """x with dimension d last, as a 2-D [rows, n] array, and the way back."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 0:
        return x.reshape(1, 1), lambda r: r.reshape(())
    moved = np.moveaxis(x, d, -1)
    shape = moved.shape
    return moved.reshape(-1, shape[-1]), lambda r: np.moveaxis(r.reshape(shape), -1, d)


def _ref_forward(op, input, dim, log):
    d = norm_dim(op, np.ndim(input), dim)
    x, back = _moved(input, d)
    with np.errstate(all="ignore"):
        m = np.max(x, axis=1, keepdims=True) if x.shape[1] else np.zeros((x.shape[0], 1))
        z = x - m                                   # a row of only -inf: NaN, as torch
        s = np.sum(np.exp(z), axis=1, keepdims=True)
        r = z - np.log(s) if log else np.exp(z) / s
    return back(r)


def ref_softmax(input, dim=-1):
    return _ref_forward("softmax", input, dim, False)


def ref_log_softmax(input, dim=-1):
    return _ref_forward("log_softmax", input, dim, True)


def _ref_backward(op, grad_output, output, dim, log):
    if np.shape(grad_output) != np.shape(output):
        raise ValueError(f"gpuops.{op}: 'grad_output' has shape {np.shape(grad_output)} but "
                         f"'output' has {np.shape(output)}; they must match")
    d = norm_dim(op, np.ndim(output), dim)
    g, back = _moved(grad_output, d)
    y, _ = _moved(output, d)
    with np.errstate(all="ignore"):
        if log:
            r = g - np.exp(y) * np.sum(g, axis=1, keepdims=True)
        else:
            r = y * (g - np.sum(g * y, axis=1, keepdims=True))
    return back(r)


def ref_softmax_backward(grad_output, output, dim=-1):
    return _ref_backward("softmax_backward", grad_output, output, dim, False)


def ref_log_softmax_backward(grad_output, output, dim=-1):
    return _ref_backward("log_softmax_backward", grad_output, output, dim, True)


# ---------------------------------------------------------------------------------------------
# Benchmarks: [32768, 4096] (bf16 256 MiB, fp32 512 MiB per tensor), long rows, decode rows.

EXTRA_SHAPES = ((8, 393216), (16, 2048))


def _default_shape(d):
    return (32768, 4096)


def _liger_softmax():
    from liger_kernel.ops.softmax import LigerSoftmaxFunction  # noqa: PLC0415
    return {"liger": lambda x, dim=-1: LigerSoftmaxFunction.apply(x)}


def _fwd_bench(torch_name, liger=None):
    def make(shape, d, randn):
        return (randn(shape, d),), {}

    def torch_fn(x, dim=-1):
        import torch  # noqa: PLC0415
        return getattr(torch, torch_name)(x, dim)
    return BenchSpec(make_inputs=make, torch_fn=torch_fn, default_shape=_default_shape,
                     compile_peer=True, extra_peers=liger, extra_shapes=EXTRA_SHAPES)


def _bwd_bench(log):
    def make(shape, d, randn):
        import gpuops  # noqa: PLC0415
        g = randn(shape, d)
        # y as the forward gives it: with y ~ N(0, 1) instead, exp(y) * sum(g) over a row of
        # 393,216 exceeds fp16's range and the reference itself is not representable
        y = (gpuops.log_softmax if log else gpuops.softmax)(randn(shape, d))
        return (g, y), {}

    def torch_fn(g, y, dim=-1):
        import torch  # noqa: PLC0415
        f = torch._log_softmax_backward_data if log else torch._softmax_backward_data
        return f(g, y, dim, y.dtype)
    return BenchSpec(make_inputs=make, torch_fn=torch_fn, default_shape=_default_shape,
                     compile_peer=True, extra_shapes=EXTRA_SHAPES)


# ---------------------------------------------------------------------------------------------
# The ops.

@register(family="softmax", reference=ref_softmax, bench=_fwd_bench("softmax", _liger_softmax))
def softmax(call, input: Tensor, dim: int = -1, *, out: Tensor | None = None) -> Tensor:
    """Softmax along ``dim``: ``exp(x - max) / sum(exp(x - max))``, as ``torch.softmax``.

    Any dim and layout (rows of 1 to millions of elements; the innermost dim at full speed, other
    dims by a strided column kernel). fp32 math; exp is MUFU ``ex2`` of ``(x - max) * log2(e)``
    (relative error ~2e-7 + |x - max| * 6e-8). NaN/inf as torch: a row with NaN or +inf, or of
    only -inf, is NaN. ``out`` may be ``input`` (in place).
    """
    return _forward(call, input, dim, out, False)


@register(family="softmax", reference=ref_log_softmax,
          bench=_fwd_bench("log_softmax"))
def log_softmax(call, input: Tensor, dim: int = -1, *, out: Tensor | None = None) -> Tensor:
    """Log-softmax along ``dim``: ``(x - max) - log(sum(exp(x - max)))``, as ``torch.log_softmax``.

    Same kernels, layouts and NaN/inf behaviour as :func:`softmax`; ``out`` may be ``input``.
    """
    return _forward(call, input, dim, out, True)


@register(family="softmax", reference=ref_softmax_backward, bench=_bwd_bench(False))
def softmax_backward(call, grad_output: Tensor, output: Tensor, dim: int = -1, *,
                     out: Tensor | None = None) -> Tensor:
    """Gradient of softmax from its output: ``y * (g - sum(g * y))``, as torch's softmax backward.

    ``g`` = grad_output, ``y`` = output, sums along ``dim`` (``torch._softmax_backward_data``).
    ``out`` may be either input (in place)."""
    return _backward(call, grad_output, output, dim, out, False)


@register(family="softmax", reference=ref_log_softmax_backward, bench=_bwd_bench(True))
def log_softmax_backward(call, grad_output: Tensor, output: Tensor, dim: int = -1, *,
                         out: Tensor | None = None) -> Tensor:
    """Gradient of log_softmax from its output: ``g - exp(y) * sum(g)``, as torch's backward.

    ``g`` = grad_output, ``y`` = output, sums along ``dim``
    (``torch._log_softmax_backward_data``). ``out`` may be either input (in place)."""
    return _backward(call, grad_output, output, dim, out, True)
