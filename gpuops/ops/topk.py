"""Top-k: the k largest (or smallest) values along a dim and their int64 indices.

Kernels: cuda_src/topk/topk.cu. Rows of up to 256 elements with k <= 32 (mixture-of-experts
routing): a warp per row in registers. Anything else: radix select in shared memory by blocks of
512 threads, over chunks of up to C elements (C = 16384 where the device has the shared memory,
8192 on Pascal); rows longer than a chunk take two (or three) launches, each chunk passing its k
best on as candidates.
"""
from __future__ import annotations

import operator

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.ops import _layout as lay
from gpuops.registry import register
from gpuops.runtime import device
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.shapes import contiguous_strides
from gpuops.tensor import Tensor

BLOCK = 512
MAX_K = 1024
MAX_EPT = 64
WARP_MAX_R, WARP_MAX_K = 256, 32
STATIC_SMEM = 8192 + 1024 + 128 + 64         # topk_block's static shared memory (upper bound)

WARP_ARGS = ArgSpec("ptr", "ptr", "ptr", "i64", "i32", "i32", "i64", "i64", "i64", "i64", "i32")
BLOCK_ARGS = ArgSpec("ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "i64", "i64", "i64", "i64",
                     "i64", "i32", "i32", "i32", "i32", "i32", "i32", "i32")
WARP_E = (1, 2, 4, 8)


def _warp_expr(d, e):
    return f"gpuops::topk::topk_warp<{d.ctype}, {e}>"


def _block_expr(d, from_cand, to_cand):
    b = lambda v: "true" if v else "false"  # noqa: E731
    return f"gpuops::topk::topk_block<{d.ctype}, {b(from_cand)}, {b(to_cand)}>"


_STAGES = ((False, False), (False, True), (True, True), (True, False))
_kernels = {}
for _d in dt.FLOATS:
    for _e in WARP_E:
        _kernels[_warp_expr(_d, _e)] = WARP_ARGS
    for _s in _STAGES:
        _kernels[_block_expr(_d, *_s)] = BLOCK_ARGS
MODULE = KernelModule("topk", "topk/topk.cu", _kernels)
_TABLE = lay.KernelTable(MODULE)
_WARP_NAMES = {(d, e): _warp_expr(d, e) for d in dt.FLOATS for e in WARP_E}
_BLOCK_NAMES = {(d, s): _block_expr(d, *s) for d in dt.FLOATS for s in _STAGES}


# ---------------------------------------------------------------------------------------------
# Planning (pure Python: tested on the CPU)

def chunk_capacity(smem_optin: int) -> int:
    """Keys one block holds: 16384 (64 KiB) where the device allows that much shared memory per
    block, else 8192 (32 KiB, within the 48 KiB every arch has)."""
    return 16384 if smem_optin >= 16384 * 4 + STATIC_SMEM else 8192


def block_levels(R: int, k: int, C: int) -> list:
    """The launches of the block path: [(input length per row, chunks, kc), ...], the last one
    with one chunk (the final selection)."""
    levels = []
    n = R
    kc = min(k, C)
    if n > C and 2 * kc > C:
        raise ValueError(f"gpuops.topk: chunks of {C} cannot shrink {n} candidates by k={k}")
    while n > C:
        chunks = -(-n // C)
        levels.append((n, chunks, kc))
        n = chunks * kc
    levels.append((n, 1, k))
    return levels


_capacity: dict = {}


def _chunk(dev) -> int:
    c = _capacity.get(dev)
    if c is None:
        c = _capacity[dev] = chunk_capacity(device.device_info(dev).max_smem_per_block_optin)
    return c


BLOCK_WARP = (256, 1, 1)
BLOCK_SEL = (BLOCK, 1, 1)


def _runner(dtype, shape, strides, k, d, largest, sorted_, dev):
    """run(call, x, vals, idx): the launches of one layout, planned once."""
    vshape, vstrides = (shape, strides) if shape else ((1,), (1,))
    v = lay.view3(vshape, vstrides, d)
    copy = v is None
    if copy:
        v = lay.view3(vshape, contiguous_strides(vshape), d)
    A, sa, R, sr, B, sb = v
    rows = A * B
    if B > 1 and rows >= 1 << 32:
        raise ValueError(f"gpuops.topk: {rows} rows along a non-last dim is more than this "
                         "kernel indexes; move the dim last first")
    lg = 1 if largest else 0
    if R <= WARP_MAX_R and k <= WARP_MAX_K:
        e = next(e for e in WARP_E if 32 * e >= R)
        grid = (-(-rows // 8), 1, 1)
        _check_grid(grid[0])
        name = _WARP_NAMES[(dtype, e)]

        def run(call, x, vals, idx):
            if copy:
                x = lay.contiguous_copy(call, x)
            _TABLE.get(call.device, name).launch(grid, BLOCK_WARP, call.stream, x.ptr, vals.ptr,
                                                 idx.ptr, rows, R, k, B, sa, sb, sr, lg)
        return run
    C = _chunk(dev)
    steps = []
    levels = block_levels(R, k, C)
    for n, (length, chunks, kc) in enumerate(levels):
        from_cand = n > 0
        to_cand = n < len(levels) - 1
        grid = rows * chunks
        _check_grid(grid)
        ept = -(-min(C, length) // BLOCK)
        steps.append((_BLOCK_NAMES[(dtype, (from_cand, to_cand))], (grid, 1, 1),
                      rows * chunks * kc if to_cand else 0,
                      (length, B, sa, sb, sr, C, chunks, k, kc, ept, lg, 1 if sorted_ else 0),
                      4 * ept * BLOCK))

    def run(call, x, vals, idx):
        if copy:
            x = lay.contiguous_copy(call, x)
        # Candidate buffers stay referenced until every launch is queued: a freed one goes back
        # to the caching allocator (torch, CuPy) at once, and the next call.empty of the stream
        # gets the same memory (keys and indices of one level, or the next level's output over
        # the input it reads).
        held = []
        ckey = cidx = 0
        for name, grid, n_out, args, smem in steps:
            okey = oidx = 0
            if n_out:
                bufs = call.empty((n_out,), dt.int32), call.empty((n_out,), dt.int32)
                held.append(bufs)
                okey, oidx = bufs[0].ptr, bufs[1].ptr
            _TABLE.get(call.device, name).launch(
                grid, BLOCK_SEL, call.stream, 0 if ckey else x.ptr, ckey, cidx, okey, oidx,
                0 if n_out else vals.ptr, 0 if n_out else idx.ptr, *args, smem=smem)
            ckey, cidx = okey, oidx
    return run


_RECIPES: dict = {}
_MAX_RECIPES = 4096


def _topk(call, x: Tensor, k: int, d: int, largest: bool, sorted_: bool):
    shape = tuple(x.shape)
    if shape:
        out_shape = shape[:d] + (k,) + shape[d + 1:]
    else:
        out_shape, k = (), 1                     # as torch: the value itself for k = 0 or 1
    vals = call.empty(out_shape, x.dtype)
    idx = call.empty(out_shape, dt.int64)
    if vals.numel == 0:
        return vals, idx
    key = (x.shape, x.strides, k, d, largest, sorted_, x.dtype, call.device)
    run = _RECIPES.get(key)
    if run is None:
        if len(_RECIPES) >= _MAX_RECIPES:
            _RECIPES.clear()
        run = _RECIPES[key] = _runner(x.dtype, shape, tuple(x.strides), k, d, largest, sorted_,
                                      call.device)
    run(call, x, vals, idx)
    return vals, idx


def _check_grid(grid):
    if grid > (1 << 31) - 1:
        raise ValueError(f"gpuops.topk: the input is too large for one launch ({grid} blocks)")


# ---------------------------------------------------------------------------------------------
# Reference (float64 inputs holding fp32/fp16/bf16 values; the order is exact in float64)

def _order_keys(x: np.ndarray) -> np.ndarray:
    """uint64 keys ordering float64 values as torch's radix keys order floats: numbers in order,
    -0 below +0, every NaN above +inf."""
    u = np.ascontiguousarray(x, dtype=np.float64).view(np.uint64)
    sign = np.uint64(1 << 63)
    keys = np.where(u & sign, ~u, u | sign)
    return np.where(np.isnan(x), np.uint64(0xFFFFFFFFFFFFFFFF), keys)


def _check_args(input, k, dim):
    nd = np.ndim(input)
    d = lay.normalize_dim("topk", dim, nd)
    if isinstance(k, bool):
        raise TypeError("gpuops.topk: 'k' must be an int, got a bool")
    try:
        k = operator.index(k)
    except TypeError:
        raise TypeError(f"gpuops.topk: 'k' must be an int, got {type(k).__name__}") from None
    R = np.shape(input)[d] if nd else 1
    if not 0 <= k <= R:
        raise ValueError(f"gpuops.topk: k={k} is out of range for a dimension of size {R}")
    if k > MAX_K:
        raise ValueError(f"gpuops.topk: k={k}; this kernel selects at most k = {MAX_K}")
    return k, d


def ref_topk(input, k, dim=-1, largest=True, sorted=True):  # noqa: A002 (torch's name)
    k, d = _check_args(input, k, dim)
    x = np.asarray(input, dtype=np.float64)
    if x.ndim == 0:                  # as torch: the value itself for k = 0 or 1
        return x.copy(), np.zeros((), np.int64)
    xm = np.moveaxis(x, d, -1)
    keys = _order_keys(xm)
    if not largest:
        keys = np.where(np.isnan(xm), np.uint64(0), ~keys)
    # best key first, equal keys by index: a stable sort of the complemented keys
    order = np.argsort(~keys, axis=-1, kind="stable")[..., :k]
    values = np.take_along_axis(xm, order, axis=-1)
    return np.moveaxis(values, -1, d), np.moveaxis(order.astype(np.int64), -1, d)


# ---------------------------------------------------------------------------------------------
# The op

def _bench_make(shape, d, randn):
    k = 8 if shape[-1] <= 256 else 1024
    return (randn(shape, d), k), {}


def _torch_topk(x, k):
    import torch  # noqa: PLC0415
    return torch.topk(x, k)


@register(family="topk", reference=ref_topk,
          bench=BenchSpec(make_inputs=_bench_make, torch_fn=_torch_topk,
                          default_shape=lambda d: (32768, 128), compile_peer=True,
                          extra_shapes=((64, 131072),)))
def topk(call, input: Tensor, k: int, dim: int = -1, largest: bool = True,
         sorted: bool = True) -> tuple:  # noqa: A002 (torch's name)
    """The k largest (or smallest) elements along ``dim`` and their int64 indices, as torch.topk.

    ``largest=False`` selects the smallest; k <= 1024.

    Order as torch on CUDA: NaN counts as larger than every number (so it is picked first for
    largest=True and last for largest=False), -0.0 as smaller than +0.0, and equal values go to
    the smaller index (a tie at the k-th value selects its lowest indices). ``sorted=True`` lists
    the results from best to worst, equal values by index; ``sorted=False`` returns the same set
    in index order (a warp-per-row row of <= 256 elements is always sorted). A non-last ``dim`` is
    read with strided loads.
    """
    k, d = _check_args(input, k, dim)
    return _topk(call, input, k, d, bool(largest), bool(sorted))
