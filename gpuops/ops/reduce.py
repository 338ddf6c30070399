"""Reductions: sum, mean, amax, amin, argmax, argmin over one dim, several dims, or everything.

Kernels: cuda_src/reduce/reduce.cu. The input is described as x[a, r, b] (kept a and b, reduced
r; see gpuops/ops/_layout.py). A contiguous reduced index takes the row kernel (a group of 8, 32
or 256 threads per row, 16-byte loads, rows split over several blocks when there are too few of
them); a contiguous kept index takes the column kernel (lanes walk adjacent columns, warps split
the rows). Outputs too few for the GPU are computed in two steps: per-block partials in a
workspace, then a finishing kernel; no atomics, so results are deterministic. Accumulation is
fp32; sum and mean return the input's dtype, argmax and argmin int64, as torch.
"""
from __future__ import annotations

from math import prod

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.ops import _layout as lay
from gpuops.registry import register
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.tensor import Tensor

THREADS = 256
MAX_GRID_X, MAX_GRID_Y = (1 << 31) - 1, 65535
POLICIES = {"sum": "Sum", "mean": "Sum", "amax": "Max", "amin": "Min", "argmax": "ArgMax",
            "argmin": "ArgMin"}
# row kernel variants: name -> (16-byte packs, threads per row)
ROW_VARIANTS = {"vec8": (True, 8), "vec32": (True, 32), "vec256": (True, 256),
                "scalar32": (False, 32)}
WARPS = THREADS // 32
FINISH_GROUPS = (8, 32, 256)     # threads per output of the finishing kernel

ROW_ARGS = ArgSpec("ptr", "ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "i64", "i64", "i64",
                   "i64", "i64", "f32")
COL_ARGS = ROW_ARGS
FINISH_ARGS = ArgSpec("ptr", "ptr", "ptr", "i64", "i64", "i32", "i64", "i64", "i64", "i64", "i64",
                      "f32")


def _vec(d) -> int:
    return 16 // d.itemsize


def _row_expr(policy, d, variant):
    vector, tpr = ROW_VARIANTS[variant]
    vec = _vec(d) if vector else 1
    return f"gpuops::red::reduce_rows<gpuops::red::{policy}, {d.ctype}, {vec}, {tpr}>"


def _col_expr(policy, d, vector):
    return f"gpuops::red::reduce_cols<gpuops::red::{policy}, {d.ctype}, {_vec(d) if vector else 1}>"


def _finish_expr(policy, d, g):
    return f"gpuops::red::reduce_finish<gpuops::red::{policy}, {d.ctype}, {g}>"


_POLICY_SET = sorted(set(POLICIES.values()))
_kernels = {}
for _p in _POLICY_SET:
    for _d in dt.FLOATS:
        for _v in ROW_VARIANTS:
            _kernels[_row_expr(_p, _d, _v)] = ROW_ARGS
        for _vector in (True, False):
            _kernels[_col_expr(_p, _d, _vector)] = COL_ARGS
        for _g in FINISH_GROUPS:
            _kernels[_finish_expr(_p, _d, _g)] = FINISH_ARGS
MODULE = KernelModule("reduce", "reduce/reduce.cu", _kernels)
_TABLE = lay.KernelTable(MODULE)
# (op, dtype) -> names, computed once
_NAMES = {(op, d): {"rows": {v: _row_expr(p, d, v) for v in ROW_VARIANTS},
                    "cols": {True: _col_expr(p, d, True), False: _col_expr(p, d, False)},
                    "finish": {g: _finish_expr(p, d, g) for g in FINISH_GROUPS}}
          for op, p in POLICIES.items() for d in dt.FLOATS}


# ---------------------------------------------------------------------------------------------
# Planning (pure Python: tested on the CPU)

def plan(shape, strides, dims, ordered: bool):
    """The kernel view of reducing ``dims`` of an operand: (kind, A, B, R, sa, sb, sr, oa, ob)
    with kind 'rows' (reduced index contiguous, or strided with no better choice) or 'cols' (a
    kept index contiguous), or None when the reduced dims (in logical order if ``ordered``: the
    flat index of argmax) or the kept dims do not merge into one and two dims."""
    red = [(shape[d], strides[d]) for d in dims]
    if any(n == 0 for n, _ in red):
        R, sr = 0, 1
    else:
        if not ordered:
            red.sort(key=lambda p: -abs(p[1]))
        g = lay.one_group(red)
        if g is None:
            return None
        R, sr = g
    kept = lay.merge((shape[d], strides[d]) for d in range(len(shape)) if d not in dims)
    if len(kept) > 2:
        return None
    if len(kept) == 2:
        (A, sa), (B, sb) = kept
        oa, ob = B, 1
    elif len(kept) == 1:
        (A, sa), (B, sb) = kept[0], (1, 0)
        oa, ob = 1, 0
    else:
        A = B = 1
        sa = sb = oa = ob = 0
    if R == 0 or (R > 1 and sr == 1):
        return "rows", A, B, R, sa, sb, sr, oa, ob
    if B > 1 and sb == 1:
        return "cols", A, B, R, sa, sb, sr, oa, ob
    if A > 1 and sa == 1:
        return "cols", B, A, R, sb, sa, sr, ob, oa
    return "rows", A, B, R, sa, sb, sr, oa, ob


def rows_config(rows: int, R: int, vec: int, sms: int):
    """(variant, splits, chunk): threads per row by row length, and rows split into parts of
    `chunk` packs (elements when vec == 1) when there are too few rows for two waves of the GPU
    (each part keeps >= 8 packs per thread)."""
    if vec == 1:
        variant, tpr, units = "scalar32", 32, R
    else:
        units = R // vec
        tpr = 256 if units >= 4096 else 32 if units >= 64 else 8
        variant = f"vec{tpr}"
    splits = 1
    target = sms * 2048 * 2                   # threads of two full waves
    if rows * tpr < target:
        splits = max(1, min(-(-target // (rows * tpr)), units // (tpr * 8), MAX_GRID_Y))
    chunk = -(-units // splits)        # packs of a row are units or fewer (a misaligned head)
    if chunk:
        splits = -(-units // chunk)
    return variant, splits, chunk


def cols_config(A: int, B: int, R: int, vec: int, sms: int):
    """(splits, rchunk): chunks of rows per column tile when the tiles alone do not fill the GPU
    (two waves of 8 blocks per SM; >= 16 rows per thread; <= 128 partials per output)."""
    tiles = -(-B // (32 * vec))
    base = A * tiles
    splits = 1
    target = sms * 8 * 2
    if base < target and R > 0:
        splits = max(1, min(-(-target // base), R // (WARPS * 16), 128))
    rchunk = -(-R // splits) if R else 0
    if rchunk:
        splits = -(-R // rchunk)
    return splits, rchunk


def finish_group(kind: str, splits: int) -> int:
    """Threads per output of the finishing kernel: 8 adjacent outputs' partials are adjacent in
    the column layout [A, splits, B]; a row's are contiguous ([rows, splits]): a warp, or a block
    when there are many."""
    if kind == "cols":
        return 8
    return 32 if splits <= 256 else 256


# ---------------------------------------------------------------------------------------------
# Launch



def _launch(call, x: Tensor, out: Tensor, op: str, dims: tuple, ordered: bool, scale: float):
    d = x.dtype
    shape, strides = tuple(x.shape), tuple(x.strides)
    if not shape:
        shape, strides = (1,), (1,)
        dims = (0,)
    p = plan(shape, strides, dims, ordered)
    if p is None:
        kept = [i for i in range(len(shape)) if i not in dims]
        x = lay.contiguous_copy(call, x, kept + list(dims))
        p = plan(shape, tuple(x.strides), dims, ordered)
    kind, A, B, R, sa, sb, sr, oa, ob = p
    if kind == "rows" and B > 1 and A * B >= 1 << 32:     # the kernel splits rows in 32 bits
        kept = [i for i in range(len(shape)) if i not in dims]
        x = lay.contiguous_copy(call, x, kept + list(dims))
        kind, A, B, R, sa, sb, sr, oa, ob = plan(shape, tuple(x.strides), dims, ordered)
    names = _NAMES[(op, d)]
    dev, stream, sms = call.device, call.stream, lay.sm_count(call.device)
    vec = _vec(d)
    arg = op.startswith("arg")
    ws_v = ws_i = None
    if kind == "rows":
        vector = R > 1 and sr == 1
        variant, splits, chunk = rows_config(A * B, R, vec if vector else 1, sms)
        tpr = ROW_VARIANTS[variant][1]
        grid = (-(-(A * B) // (THREADS // tpr)), splits, 1)
        if splits > 1:
            ws_v = call.empty((A * B * splits,), dt.float32)
            if arg:
                ws_i = call.empty((A * B * splits,), dt.int64)
        _check_grid(op, grid)
        _TABLE.get(dev, names["rows"][variant]).launch(
            grid, (THREADS, 1, 1), stream, x.ptr, out.ptr,
            ws_v.ptr if ws_v else 0, ws_i.ptr if ws_i else 0,
            A, B, R, sa, sb, sr, oa, ob, chunk, scale)
        partial_strides = (B * splits, splits, 1)         # pa, pb, ps: partials [A, B, splits]
    else:
        vector = (sb == 1 and B % vec == 0 and (A == 1 or sa % vec == 0)
                  and (R <= 1 or sr % vec == 0) and x.ptr % 16 == 0)
        v = vec if vector else 1
        splits, rchunk = cols_config(A, B, R, v, sms)
        grid = (A * -(-B // (32 * v)), splits, 1)
        if splits > 1:
            ws_v = call.empty((A * splits * B,), dt.float32)
            if arg:
                ws_i = call.empty((A * splits * B,), dt.int64)
        _check_grid(op, grid)
        _TABLE.get(dev, names["cols"][vector]).launch(
            grid, (THREADS, 1, 1), stream, x.ptr, out.ptr,
            ws_v.ptr if ws_v else 0, ws_i.ptr if ws_i else 0,
            A, B, R, sa, sb, sr, oa, ob, rchunk, scale)
        partial_strides = (splits * B, 1, B)              # partials [A, splits, B]
    if splits > 1:      # few outputs (else there would be no parts): A * B < 2^32 as it needs
        g = finish_group(kind, splits)
        grid = (-(-(A * B * g) // THREADS), 1, 1)
        _check_grid(op, grid)
        _TABLE.get(dev, names["finish"][g]).launch(
            grid, (THREADS, 1, 1), stream, ws_v.ptr, ws_i.ptr if ws_i else 0, out.ptr,
            A, B, splits, *partial_strides, oa, ob, scale)


def _check_grid(op, grid):
    if grid[0] > MAX_GRID_X or grid[1] > MAX_GRID_Y:
        raise ValueError(f"gpuops.{op}: the input is too large for one launch (grid {grid})")


def _out_shape(shape, dims, keepdim):
    if keepdim:
        return tuple(1 if i in dims else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in dims)


def _reduce(call, op: str, input: Tensor, dim, keepdim: bool, allow_tuple: bool):
    shape = tuple(input.shape)
    if op.startswith("arg"):
        dims = lay.normalize_dims(op, dim, len(shape), allow_tuple=False)
        if dim is None:
            out_shape = (1,) * len(shape) if keepdim else ()
        else:
            out_shape = _out_shape(shape, dims, keepdim)
    else:
        dims = lay.normalize_dims(op, dim, len(shape), allow_tuple)
        out_shape = _out_shape(shape, dims, keepdim)
    R = prod(shape[i] for i in dims)
    n_out = prod(out_shape)
    if R == 0 and n_out and op in ("amax", "amin", "argmax", "argmin"):
        raise ValueError(f"gpuops.{op}: the reduced dimension(s) {dims} of shape {shape} are "
                         "empty; the reduction has no identity")
    out = call.empty(out_shape, dt.int64 if op.startswith("arg") else call.result_dtype)
    if n_out == 0:
        return out
    scale = (1.0 / R if R else float("nan")) if op == "mean" else 1.0
    _launch(call, input, out, op, dims, ordered=op.startswith("arg"), scale=scale)
    return out


# ---------------------------------------------------------------------------------------------
# NumPy references (float64)

def _ref_dims(op, input, dim, allow_tuple):
    return lay.normalize_dims(op, dim, np.ndim(input), allow_tuple)


def _ref_empty_check(op, input, axes):
    shape = np.shape(input)
    if prod(shape[i] for i in axes) == 0 and prod(n for i, n in enumerate(shape) if i not in axes):
        raise ValueError(f"gpuops.{op}: the reduced dimension(s) {axes} of shape {shape} are "
                         "empty; the reduction has no identity")


def ref_sum(input, dim=None, keepdim=False):
    axes = _ref_dims("sum", input, dim, True)
    with np.errstate(invalid="ignore"):
        return np.sum(input, axis=axes, keepdims=keepdim)


def ref_mean(input, dim=None, keepdim=False):
    axes = _ref_dims("mean", input, dim, True)
    n = prod(np.shape(input)[i] for i in axes)
    with np.errstate(all="ignore"):
        return np.sum(input, axis=axes, keepdims=keepdim) / n if n else (
            np.sum(input, axis=axes, keepdims=keepdim) * np.nan)


def ref_amax(input, dim=None, keepdim=False):
    axes = _ref_dims("amax", input, dim, True)
    _ref_empty_check("amax", input, axes)
    with np.errstate(invalid="ignore"):
        return np.max(input, axis=axes, keepdims=keepdim)


def ref_amin(input, dim=None, keepdim=False):
    axes = _ref_dims("amin", input, dim, True)
    _ref_empty_check("amin", input, axes)
    with np.errstate(invalid="ignore"):
        return np.min(input, axis=axes, keepdims=keepdim)


def _ref_arg(op, fn, input, dim, keepdim):
    axes = _ref_dims(op, input, dim, False)
    _ref_empty_check(op, input, axes)
    x = np.asarray(input)
    if dim is None or x.ndim == 0:
        i = np.asarray(fn(x.reshape(-1)), dtype=np.int64)
        return i.reshape((1,) * x.ndim) if keepdim else i
    return np.asarray(fn(x, axis=axes[0], keepdims=keepdim), dtype=np.int64)


def ref_argmax(input, dim=None, keepdim=False):
    return _ref_arg("argmax", np.argmax, input, dim, keepdim)   # NaN counts as the maximum


def ref_argmin(input, dim=None, keepdim=False):
    return _ref_arg("argmin", np.argmin, input, dim, keepdim)   # and np.argmin picks NaN too


# ---------------------------------------------------------------------------------------------
# Benchmarks. Shape convention: 2-d [rows, R] reduces the last dim, 3-d [A, R, B] the middle one
# (so [1, 32768, 4096] is dim 0 of [32768, 4096]), 1-d everything.

def _bench_dim(shape):
    return {1: None, 2: -1, 3: 1}[len(shape)]


def _check_shape(shape):
    shape = tuple(shape)
    if len(shape) == 1:
        return (min(shape[0], 1 << 20),)
    if len(shape) == 3:
        return (shape[0], min(shape[1], max(1, (1 << 20) // (shape[0] * shape[2]))), shape[2])
    return (min(shape[0], max(1, (1 << 20) // shape[1])), shape[1])


def _bench(torch_name):
    def make(shape, d, randn):
        return (randn(shape, d),), {"dim": _bench_dim(shape)}

    def torch_fn(x, dim=-1):
        import torch  # noqa: PLC0415
        fn = getattr(torch, torch_name)
        return fn(x) if dim is None else fn(x, dim)

    return BenchSpec(make_inputs=make, torch_fn=torch_fn, default_shape=lambda d: (32768, 4096),
                     compile_peer=True, check_shape=_check_shape,
                     extra_shapes=((1, 32768, 4096), (16, 1048576), (1 << 27,)))


# ---------------------------------------------------------------------------------------------
# The ops

@register(family="reduce", reference=ref_sum, bench=_bench("sum"), name="sum")
def _sum(call, input: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Sum over ``dim`` (an int, a tuple of ints, or None for every dim), as ``torch.sum``.

    fp32 accumulation; the result has the input's dtype. Each thread sums its elements in order
    (a pairwise tree within each 16-byte pack), then threads and blocks combine in a fixed tree:
    results are deterministic. Layouts that no 3-index view describes (reduced dims that do not
    merge, more than two separate kept dims) are first copied contiguously.
    """
    return _reduce(call, "sum", input, dim, keepdim, True)


@register(family="reduce", reference=ref_mean, bench=_bench("mean"), name="mean")
def _mean(call, input: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Mean over ``dim`` (an int, a tuple of ints, or None), as ``torch.mean``.

    The fp32 sum times 1/n, rounded once to the input's dtype (float16 in, float16 out). An empty
    reduction gives NaN, as torch.
    """
    return _reduce(call, "mean", input, dim, keepdim, True)


@register(family="reduce", reference=ref_amax, bench=_bench("amax"), name="amax")
def _amax(call, input: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Maximum over ``dim`` (an int, a tuple of ints, or None), as ``torch.amax``: NaN if any
    element is NaN. An empty reduction raises ValueError."""
    return _reduce(call, "amax", input, dim, keepdim, True)


@register(family="reduce", reference=ref_amin, bench=_bench("amin"), name="amin")
def _amin(call, input: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Minimum over ``dim`` (an int, a tuple of ints, or None), as ``torch.amin``: NaN if any
    element is NaN. An empty reduction raises ValueError."""
    return _reduce(call, "amin", input, dim, keepdim, True)


@register(family="reduce", reference=ref_argmax, bench=_bench("argmax"), name="argmax")
def _argmax(call, input: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Index (int64) of the maximum along ``dim`` (an int), or in the flattened input for None,
    as ``torch.argmax``: the first of equal maxima; the first NaN if there is one."""
    return _reduce(call, "argmax", input, dim, keepdim, False)


@register(family="reduce", reference=ref_argmin, bench=_bench("argmin"), name="argmin")
def _argmin(call, input: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Index (int64) of the minimum along ``dim`` (an int), or in the flattened input for None,
    as ``torch.argmin``: the first of equal minima; the first NaN if there is one."""
    return _reduce(call, "argmin", input, dim, keepdim, False)
