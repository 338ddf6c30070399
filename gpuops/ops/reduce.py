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
from gpuops.shapes import contiguous_strides
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
# Launch. The plan of a call depends only on (op, shape, strides, dims, keepdim, dtype, the
# input's 16-byte alignment, device): it is computed once into a runner that only allocates and
# launches (host time matters at decode sizes).

BLOCK = (THREADS, 1, 1)
_NONE = object()


def _runner(op, d, shape, strides, dims, aligned, dev, scale):
    """A function run(call, x, out) that launches the kernels for this layout (x may first be
    copied contiguously when no 3-index view describes it)."""
    ordered = op.startswith("arg")
    if not shape:
        shape, strides, dims = (1,), (1,), (0,)
    copy_order = None
    p = plan(shape, strides, dims, ordered)
    if p is not None and p[0] == "rows" and p[2] > 1 and p[1] * p[2] >= 1 << 32:
        p = None                               # the row kernel splits rows in 32 bits
    if p is None:
        kept = [i for i in range(len(shape)) if i not in dims]
        copy_order = kept + list(dims)
        cs = contiguous_strides(tuple(shape[i] for i in copy_order))
        strides = [0] * len(shape)
        for i, k in enumerate(copy_order):
            strides[k] = cs[i]
        p = plan(shape, tuple(strides), dims, ordered)
        aligned = True                          # a fresh allocation
    kind, A, B, R, sa, sb, sr, oa, ob = p
    names = _NAMES[(op, d)]
    sms = lay.sm_count(dev)
    vec = _vec(d)
    arg = ordered
    if kind == "rows":
        vector = R > 1 and sr == 1
        variant, splits, chunk = rows_config(A * B, R, vec if vector else 1, sms)
        grid = (-(-(A * B) // (THREADS // ROW_VARIANTS[variant][1])), splits, 1)
        main, tail_args = names["rows"][variant], (A, B, R, sa, sb, sr, oa, ob, chunk, scale)
        partial_strides = (B * splits, splits, 1)         # pa, pb, ps: partials [A, B, splits]
    else:
        vector = (sb == 1 and B % vec == 0 and (A == 1 or sa % vec == 0)
                  and (R <= 1 or sr % vec == 0) and aligned)
        v = vec if vector else 1
        splits, rchunk = cols_config(A, B, R, v, sms)
        grid = (A * -(-B // (32 * v)), splits, 1)
        main, tail_args = names["cols"][vector], (A, B, R, sa, sb, sr, oa, ob, rchunk, scale)
        partial_strides = (splits * B, 1, B)              # partials [A, splits, B]
    _check_grid(op, grid)
    n_ws = A * B * splits if splits > 1 else 0
    if splits > 1:      # few outputs (else there would be no parts): A * B < 2^32 as it needs
        g = finish_group(kind, splits)
        fgrid = (-(-(A * B * g) // THREADS), 1, 1)
        _check_grid(op, fgrid)
        finish = names["finish"][g]
        finish_args = (A, B, splits, *partial_strides, oa, ob, scale)

    def run(call, x, out):
        if copy_order is not None:
            x = lay.contiguous_copy(call, x, copy_order)
        dev_, stream = call.device, call.stream
        if not n_ws:
            _TABLE.get(dev_, main).launch(grid, BLOCK, stream, x.ptr, out.ptr, 0, 0, *tail_args)
            return
        # The workspaces stay referenced until both launches are queued: a freed one goes back
        # to the caching allocator (torch, CuPy) at once, and the next call.empty of the stream
        # gets the same memory (the index partials then overwrote the value partials).
        ws_v = call.empty((n_ws,), dt.float32)
        ws_i = call.empty((n_ws,), dt.int64) if arg else None
        pv, pi = ws_v.ptr, ws_i.ptr if arg else 0
        _TABLE.get(dev_, main).launch(grid, BLOCK, stream, x.ptr, out.ptr, pv, pi, *tail_args)
        _TABLE.get(dev_, finish).launch(fgrid, BLOCK, stream, pv, pi, out.ptr, *finish_args)

    return run


def _check_grid(op, grid):
    if grid[0] > MAX_GRID_X or grid[1] > MAX_GRID_Y:
        raise ValueError(f"gpuops.{op}: the input is too large for one launch (grid {grid})")


def _out_shape(shape, dims, keepdim):
    if keepdim:
        return tuple(1 if i in dims else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in dims)


_RECIPES: dict = {}
_MAX_RECIPES = 4096


def _recipe(op, input: Tensor, dim, keepdim, allow_tuple, dev):
    """(output shape, output dtype, runner or None when the output is empty)."""
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
    out_dtype = dt.int64 if op.startswith("arg") else input.dtype
    if n_out == 0:
        return out_shape, out_dtype, None
    scale = (1.0 / R if R else float("nan")) if op == "mean" else 1.0
    return out_shape, out_dtype, _runner(op, input.dtype, shape, tuple(input.strides), dims,
                                         input.ptr % 16 == 0, dev, scale)


def _reduce(call, op: str, input: Tensor, dim, keepdim: bool, allow_tuple: bool):
    key = (op, input.shape, input.strides, tuple(dim) if isinstance(dim, list) else dim,
           keepdim, input.dtype, input.ptr % 16 == 0, call.device)
    r = _RECIPES.get(key, _NONE)
    if r is _NONE:
        try:
            hash(key)
        except TypeError:          # an unhashable dim: no caching (the recipe raises or works)
            return _run(call, input, _recipe(op, input, dim, keepdim, allow_tuple, call.device))
        if len(_RECIPES) >= _MAX_RECIPES:
            _RECIPES.clear()
        r = _RECIPES[key] = _recipe(op, input, dim, keepdim, allow_tuple, call.device)
    return _run(call, input, r)


def _run(call, input, recipe):
    out_shape, out_dtype, run = recipe
    out = call.empty(out_shape, out_dtype)
    if run is not None:
        run(call, input, out)
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
    """Maximum over ``dim`` (an int, a tuple of ints, or None), as ``torch.amax``.

    NaN if any element is NaN; an empty reduction raises ValueError."""
    return _reduce(call, "amax", input, dim, keepdim, True)


@register(family="reduce", reference=ref_amin, bench=_bench("amin"), name="amin")
def _amin(call, input: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Minimum over ``dim`` (an int, a tuple of ints, or None), as ``torch.amin``.

    NaN if any element is NaN; an empty reduction raises ValueError."""
    return _reduce(call, "amin", input, dim, keepdim, True)


@register(family="reduce", reference=ref_argmax, bench=_bench("argmax"), name="argmax")
def _argmax(call, input: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Index (int64) of the maximum along ``dim`` (None: of the flattened input), as torch.argmax.

    The first of equal maxima; the first NaN if there is one."""
    return _reduce(call, "argmax", input, dim, keepdim, False)


@register(family="reduce", reference=ref_argmin, bench=_bench("argmin"), name="argmin")
def _argmin(call, input: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Index (int64) of the minimum along ``dim`` (None: of the flattened input), as torch.argmin.

    The first of equal minima; the first NaN if there is one."""
    return _reduce(call, "argmin", input, dim, keepdim, False)
