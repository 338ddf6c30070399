"""Scans: cumsum (inclusive or exclusive, forward or reversed) along one dim.

Kernels: cuda_src/scan/scan.cu with the warp scan and decoupled look-back primitives of
cuda_src/common/scan.cuh. The last dim (or any dim whose elements are adjacent in memory) is
scanned as rows: a warp per row when rows are many or short, else a warp per tile of 1024
elements, the tiles of a row chained by decoupled look-back (one read and one write of the data). Other dims are scanned as columns:
each thread walks a chunk of rows for a pack of adjacent columns, after the chunks' column sums
(the reduce family's column kernel) and their prefixes.
"""
from __future__ import annotations

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.ops import _layout as lay
from gpuops.ops import reduce as red
from gpuops.registry import register
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.shapes import contiguous_strides
from gpuops.tensor import Tensor

THREADS = 256
MAX_COL_PARTS = 128

ROW_ARGS = ArgSpec("ptr", "ptr", "i64", "i64", "i64", "i64", "i32", "i64", "ptr", "ptr")
INIT_ARGS = ArgSpec("ptr", "i64", "ptr")
CARRY_ARGS = ArgSpec("ptr", "i64", "i64", "i32")
COL_ARGS = ArgSpec("ptr", "ptr", "i64", "i64", "i64", "i64", "i64", "i64", "i64", "ptr", "i32")

# row variants: (16-byte packs, K packs per lane and tile); K = 8 only for fp32 (tiles of 1024)
ROW_VARIANTS = [(True, k) for k in (1, 2, 4, 8)] + [(False, 8)]


def _row_variants(d):
    return [v for v in ROW_VARIANTS if not (v[0] and v[1] == 8 and d.itemsize == 2)]


def _vec(d) -> int:
    return 16 // d.itemsize


def _row_expr(d, vector, k, rev):
    return (f"gpuops::scan::scan_rows<{d.ctype}, {_vec(d) if vector else 1}, {k}, "
            f"{'true' if rev else 'false'}>")


def _col_expr(d, vector, rev):
    return f"gpuops::scan::scan_cols<{d.ctype}, {_vec(d) if vector else 1}, {'true' if rev else 'false'}>"


_kernels = {"gpuops::scan::scan_init": INIT_ARGS}
for _rev in (False, True):
    _kernels[f"gpuops::scan::scan_carries<{'true' if _rev else 'false'}>"] = CARRY_ARGS
    for _d in dt.FLOATS:
        for _v in _row_variants(_d):
            _kernels[_row_expr(_d, *_v, _rev)] = ROW_ARGS
        for _vector in (True, False):
            _kernels[_col_expr(_d, _vector, _rev)] = COL_ARGS
MODULE = KernelModule("scan", "scan/scan.cu", _kernels)
_TABLE = lay.KernelTable(MODULE)
_ROW_NAMES = {(d, v, rev): _row_expr(d, *v, rev) for d in dt.FLOATS for v in _row_variants(d)
              for rev in (False, True)}
_COL_NAMES = {(d, vector, rev): _col_expr(d, vector, rev) for d in dt.FLOATS
              for vector in (True, False) for rev in (False, True)}
_CARRY_NAMES = {rev: f"gpuops::scan::scan_carries<{'true' if rev else 'false'}>" for rev in (False, True)}


# ---------------------------------------------------------------------------------------------
# Planning (pure Python: tested on the CPU)

def rows_config(rows: int, R: int, vec: int, sms: int):
    """(variant, tiles per row). A warp per row (tiles = 1) when rows are many enough to fill the
    GPU (32 warps per SM) or short (two tiles or less); else a warp per tile of a long row, the
    tiles chained by look-back. Long-row tiles are 32 * K packs of 1024 elements (fp32 K = 8,
    16-bit K = 4; 256 elements without packs)."""
    vector = vec > 1
    packs = R // vec
    k_long = 4 if vec == 8 else 8
    if rows >= sms * 32 or packs <= 2 * 32 * k_long:
        k = next((k for k in (1, 2, 4) if k < k_long and 32 * k >= packs), k_long)
        return (vector, k if vector else 8), 1
    return (vector, k_long), -(-packs // (32 * k_long))


def cols_config(A: int, B: int, R: int, vec: int, sms: int):
    """(parts, rchunk): chunks of rows per column when the columns alone do not fill the GPU
    (one wave of 2048 threads per SM, >= 32 rows per chunk, <= MAX_COL_PARTS chunks)."""
    threads = A * -(-B // vec)
    parts = 1
    target = sms * 2048
    if threads < target:
        parts = max(1, min(-(-target // threads), R // 32, MAX_COL_PARTS))
    rchunk = -(-R // parts)
    return -(-R // rchunk), rchunk


# ---------------------------------------------------------------------------------------------
# Launch

_MAX_GRID = (1 << 31) - 1
BLOCK = (THREADS, 1, 1)


def _runner(dtype, shape, strides, d, x_mis, exclusive, reverse, dev):
    """run(call, x, y): the launches of one layout (x's misalignment x_mis = x.ptr % 16; y is a
    fresh, aligned allocation), planned once."""
    vshape, vstrides = (shape, strides) if shape else ((1,), (1,))
    v = lay.view3(vshape, vstrides, d)
    copy = v is None
    if copy:
        v = lay.view3(vshape, contiguous_strides(vshape), d)
        x_mis = 0
    A, sa, R, sr, B, sb = v
    vec = _vec(dtype)
    excl = 1 if exclusive else 0
    if B == 1:
        vector = (sr == 1 and R > 1 and x_mis == 0 and (A == 1 or (sa - R) % vec == 0))
        variant, tiles = rows_config(A, R, vec if vector else 1, lay.sm_count(dev))
        warps = A * tiles
        if warps >= 1 << 32:
            raise ValueError(f"gpuops.cumsum: {A} rows of {R} are more tiles than this kernel "
                             "counts; split the input")
        grid = (-(-warps // (THREADS // 32)), 1, 1)
        _check_grid(grid[0])
        name = _ROW_NAMES[(dtype, variant, reverse)]
        init_grid = (-(-warps // THREADS), 1, 1)

        def run(call, x, y):
            if copy:
                x = lay.contiguous_copy(call, x)
            ws = 0
            if tiles > 1:
                ws = call.empty((warps + 1,), dt.int64).ptr     # status words, then the counter
                _TABLE.get(call.device, "gpuops::scan::scan_init").launch(
                    init_grid, BLOCK, call.stream, ws, warps, ws + 8 * warps)
            _TABLE.get(call.device, name).launch(
                grid, BLOCK, call.stream, x.ptr, y.ptr, A, R, sa, sr, excl, tiles,
                ws, ws + 8 * warps if ws else 0)
        return run

    vector = (sb == 1 and B % vec == 0 and (A == 1 or sa % vec == 0) and (R <= 1 or sr % vec == 0)
              and x_mis == 0)
    v_ = vec if vector else 1
    parts, rchunk = cols_config(A, B, R, v_, lay.sm_count(dev))
    sum_name = red._NAMES[("sum", dtype)]["cols"][vector]
    sum_grid = (A * -(-B // (32 * v_)), parts, 1)
    carry_grid = (-(-(A * B) // THREADS), 1, 1)
    grid = (A * -(-B // (THREADS * v_)), parts, 1)
    _check_grid(grid[0])
    col_name = _COL_NAMES[(dtype, vector, reverse)]

    def run(call, x, y):
        if copy:
            x = lay.contiguous_copy(call, x)
        carries = 0
        if parts > 1:
            # the chunks' column sums (reduce_cols<Sum> with the same chunks), then their prefixes
            carries = call.empty((A * parts * B,), dt.float32).ptr
            red._TABLE.get(call.device, sum_name).launch(
                sum_grid, BLOCK, call.stream, x.ptr, 0, carries, 0,
                A, B, R, sa, sb, sr, 0, 0, rchunk, 1.0)
            _TABLE.get(call.device, _CARRY_NAMES[reverse]).launch(
                carry_grid, BLOCK, call.stream, carries, A, B, parts)
        _TABLE.get(call.device, col_name).launch(
            grid, BLOCK, call.stream, x.ptr, y.ptr, A, B, R, sa, sb, sr, rchunk, carries, excl)
    return run


_RECIPES: dict = {}
_MAX_RECIPES = 4096


def _cumsum(call, x: Tensor, d: int, exclusive: bool, reverse: bool) -> Tensor:
    dtype = x.dtype
    y = call.empty(x.shape, dtype)
    if y.numel == 0:
        return y
    key = (x.shape, x.strides, d, exclusive, reverse, dtype, x.ptr % 16, call.device)
    run = _RECIPES.get(key)
    if run is None:
        if len(_RECIPES) >= _MAX_RECIPES:
            _RECIPES.clear()
        run = _RECIPES[key] = _runner(dtype, tuple(x.shape), tuple(x.strides), d, x.ptr % 16,
                                      exclusive, reverse, call.device)
    if y.ptr % 16:                 # never for gpuops' allocations; plan without packs then
        run = _runner(dtype, tuple(x.shape), tuple(x.strides), d, 1, exclusive, reverse, call.device)
    run(call, x, y)
    return y


def _check_grid(grid):
    if grid > _MAX_GRID:
        raise ValueError(f"gpuops.cumsum: the input is too large for one launch ({grid} blocks)")


# ---------------------------------------------------------------------------------------------
# Reference (float64)

def ref_cumsum(input, dim, exclusive=False, reverse=False):
    x = np.asarray(input)
    d = lay.normalize_dim("cumsum", dim, x.ndim)
    if x.ndim == 0:
        return np.zeros_like(x) if exclusive else x + 0.0
    if reverse:
        x = np.flip(x, d)
    y = np.cumsum(x, axis=d)
    if exclusive and x.shape[d]:
        first = list(x.shape)
        first[d] = 1
        keep = [slice(None)] * x.ndim
        keep[d] = slice(0, -1)
        y = np.concatenate([np.zeros(first, dtype=y.dtype), y[tuple(keep)]], axis=d)
    if reverse:
        y = np.flip(y, d)
    return np.ascontiguousarray(y)


# ---------------------------------------------------------------------------------------------
# The op

def _bench_make(shape, d, randn):
    return (randn(shape, d),), {"dim": -1}


def _torch_cumsum(x, dim=-1):
    import torch  # noqa: PLC0415
    return torch.cumsum(x, dim)


@register(family="scan", reference=ref_cumsum,
          bench=BenchSpec(make_inputs=_bench_make, torch_fn=_torch_cumsum,
                          default_shape=lambda d: (32768, 4096), compile_peer=True,
                          extra_shapes=((16, 1048576),)))
def cumsum(call, input: Tensor, dim: int, *, exclusive: bool = False,
           reverse: bool = False) -> Tensor:
    """Cumulative sum along ``dim``, as ``torch.cumsum`` (same dtype out, fp32 accumulation).

    ``exclusive=True`` leaves each element out of its own sum (the first is 0);
    ``reverse=True`` sums from the end (``flip(cumsum(flip(x)))``). Each element of the result is
    one rounding of an fp32 sum computed as: a pack of 4-8 elements in order, a warp tree, and
    the sum of the preceding tiles of the row (sequential over tiles of 1024 elements): the fp32
    error grows with the number of tiles, at most about eps * (tiles + 16) * cumsum(|x|). Non-last dims are scanned in chunks of rows (sequential within a chunk); a
    layout whose leading (or trailing) dims do not merge is copied contiguously first.
    """
    d = lay.normalize_dim("cumsum", dim, len(input.shape))
    return _cumsum(call, input, d, bool(exclusive), bool(reverse))
