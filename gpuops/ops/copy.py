"""Layout copies: ``transpose(input, dim0, dim1)`` into a contiguous result and ``contiguous(input)``.

Kernels: cuda_src/copy/copy.cu. Elements move as raw 1/2/4/8-byte words, so every dtype gpuops
knows is accepted (float64, integers and bool included) and no value is ever converted. The result
is always a new C-contiguous array (or ``out=``, which must be C-contiguous and must not overlap
the input).

How a copy is done: the output's and the input's strides are merged wherever both walk memory
contiguously (``gpuops.shapes.coalesce``), then

* the input's innermost dimension is also the output's (e.g. [B, S, H, D] -> [B, H, S, D], or an
  already contiguous input): a direct copy of rows, one 16-byte pack per thread, the row's
  coordinates from multiply-shift dividers (``copy_rows``);
* the input's contiguous dimension is another one (a real transpose): tiles through shared memory,
  16-byte global loads and stores, XOR-swizzled 16-byte chunks in shared memory (no bank conflicts)
  (``copy_transpose``), or a padded 32 x 33 tile of single elements where extents, strides or
  alignment rule out 16-byte packs (``copy_transpose_scalar``);
* anything else (more than 4 other dimensions, 2^31 or more elements): one element per thread with
  64-bit offsets (``copy_strided``).
"""
from __future__ import annotations

from math import prod

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.registry import register
from gpuops.runtime import device, loader
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.shapes import coalesce, contiguous_strides
from gpuops.tensor import Tensor

THREADS = 256                          # kCopyThreads
MAX_OUTER = 4                          # kCopyDims
MAX_STRIDED_DIMS = 8                   # kMaxDims of common/strided.cuh
STRIDED_BLOCKS_PER_SM = 8
INT32_LIMIT = 1 << 31
# chunks per tile row (P) of copy_transpose, by element size: tiles of 128x128 (1-byte),
# 64x64 (2- and 4-byte) and 32x32 (8-byte) elements, 8-16 KiB of shared memory
TILE_P = {1: 8, 2: 8, 4: 16, 8: 16}
SCALAR_TILE = 32

# every dtype, by element size
COPY_DTYPES = (dt.float32, dt.float16, dt.bfloat16, dt.float64, dt.int64, dt.int32, dt.int16,
               dt.int8, dt.uint8, dt.bool_)

_FASTDIV = "3I"                                        # struct FastDiv {unsigned d, mul, shift;}
_OUTER = "i" + "12I" + f"{MAX_OUTER}q" + f"{MAX_OUTER}q"   # struct CopyOuter
ROWS_ARGS = ArgSpec("ptr", "ptr", _FASTDIV, _OUTER, "i64", "u32")
TRANSPOSE_ARGS = ArgSpec("ptr", "ptr", "i32", "i32", "i64", "i64", _FASTDIV, _FASTDIV, _OUTER)
SCALAR_TRANSPOSE_ARGS = ArgSpec("ptr", "ptr", "i32", "i32", "i64", "i64", "i64", _FASTDIV,
                                _FASTDIV, _OUTER)
STRIDED_ARGS = ArgSpec("ptr", "ptr", "i8q32q", "i64")

_SIZES = (1, 2, 4, 8)


def _rows_expr(e, vec):
    return f"gpuops::copy_rows<{e}, {vec}>"


def _transpose_expr(e):
    return f"gpuops::copy_transpose<{e}, {16 // e}, {TILE_P[e]}>"


def _scalar_transpose_expr(e):
    return f"gpuops::copy_transpose_scalar<{e}>"


def _strided_expr(e):
    return f"gpuops::copy_strided<{e}>"


MODULE = KernelModule("copy.copy", "copy/copy.cu", {
    **{_rows_expr(e, v): ROWS_ARGS for e in _SIZES for v in (1, 16 // e)},
    **{_transpose_expr(e): TRANSPOSE_ARGS for e in _SIZES},
    **{_scalar_transpose_expr(e): SCALAR_TRANSPOSE_ARGS for e in _SIZES},
    **{_strided_expr(e): STRIDED_ARGS for e in _SIZES},
})


class KernelCache:
    """Kernel objects of one module per (device, name expression), looked up once (the launch
    path is host-bound at small sizes), forgotten when the loader forgets its modules."""

    def __init__(self, module: KernelModule):
        self.module = module

    def get(self, dev: int, expr: str):
        return loader.kernel(self.module, dev, expr)

    def target_arch(self, dev: int) -> int:
        """The arch the module was built for on this device (GPUOPS_ARCH=61 gives 61 on an H100)."""
        return loader.load(self.module, dev).target.arch


KERNELS = KernelCache(MODULE)


sm_count = device.sm_count


def fast_divider(d: int) -> tuple:
    """(d, mul, shift) of common/fastdiv.cuh for a divisor 1 <= d < 2^31:
    n // d == (umulhi(n, mul) + n) >> shift for every 0 <= n < 2^31."""
    if not 1 <= d < INT32_LIMIT:
        raise ValueError(f"fast_divider: divisor {d} outside [1, 2^31)")
    shift = (d - 1).bit_length()
    mul = (((1 << 32) * ((1 << shift) - d)) // d + 1) & 0xFFFFFFFF
    return d, mul, shift


def _outer(shape, in_strides, out_strides) -> tuple:
    """Flat launch values of a CopyOuter (dims innermost last; unused trailing slots)."""
    n = len(shape)
    divs = []
    for s in shape:
        divs += fast_divider(s)
    divs += [1, 0, 0] * (MAX_OUTER - n)   # never read
    pad = [0] * (MAX_OUTER - n)
    return (n, *divs, *in_strides, *pad, *out_strides, *pad)


def _aligned(t: Tensor) -> bool:
    return t.ptr % 16 == 0


_plans: dict = {}
MAX_CACHED_PLANS = 4096


def strided_copy(call, src: Tensor, dst: Tensor) -> None:
    """dst[...] = src[...] for a C-contiguous ``dst`` of src's shape and dtype (src: any strides,
    including 0 and negative ones). Plans are cached per shape, strides and alignment: the launch
    path does no planning work."""
    if src.numel == 0:
        return
    key = (call.device, loader.generation, src.dtype.itemsize, tuple(src.shape),
           tuple(src.strides), src.ptr % 16 == 0, dst.ptr % 16 == 0)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= MAX_CACHED_PLANS:
            _plans.clear()
        plan = _plans[key] = _plan_copy(call, src.dtype.itemsize, tuple(src.shape),
                                        tuple(src.strides), src.ptr % 16 == 0, dst.ptr % 16 == 0)
    expr, grid, tail = plan
    KERNELS.get(call.device, expr).launch(grid, (THREADS, 1, 1), call.stream, src.ptr, dst.ptr,
                                          *tail)


def _plan_copy(call, e, src_shape, src_strides, src_aligned, dst_aligned):
    """(kernel name, grid, launch arguments after the two pointers)."""
    n = prod(src_shape)
    vec = 16 // e
    shape, (ost, ist) = coalesce(src_shape, [contiguous_strides(src_shape), src_strides])
    nd = len(shape)
    aligned = src_aligned and dst_aligned
    # u: the input's fastest dimension other than the innermost; a transpose when it is faster
    # than the innermost (the copy then runs along u on the input side, along v on the output's)
    u = min(range(nd - 1), key=lambda d: abs(ist[d])) if nd > 1 else None
    transposed = u is not None and abs(ist[-1]) != 1 and (
        abs(ist[u]) == 1 or abs(ist[u]) < abs(ist[-1]))

    if n < INT32_LIMIT and not transposed and nd - 1 <= MAX_OUTER:
        length = shape[-1]
        use_vec = (ist[-1] == 1 and length % vec == 0 and aligned
                   and all(s % vec == 0 for s in ist[:-1]))
        v = vec if use_vec else 1
        units = n // v
        return _rows_expr(e, v), (-(-units // THREADS), 1, 1), (
            *fast_divider(length // v), *_outer(shape[:-1], ist[:-1], ost[:-1]),
            1 if use_vec else ist[-1], units)
    if n < INT32_LIMIT and transposed and nd - 2 <= MAX_OUTER:
        v = nd - 1
        batch = [d for d in range(nd) if d not in (u, v)]
        ext_u, ext_v = shape[u], shape[v]
        use_vec = (ist[u] == 1 and ext_u % vec == 0 and ext_v % vec == 0 and ist[v] % vec == 0
                   and all(ist[d] % vec == 0 for d in batch) and aligned)
        tile = TILE_P[e] * vec if use_vec else SCALAR_TILE
        tiles_u, tiles_v = -(-ext_u // tile), -(-ext_v // tile)
        blocks = tiles_u * tiles_v * prod(shape[d] for d in batch)
        if blocks < INT32_LIMIT:
            outer = _outer([shape[d] for d in batch], [ist[d] for d in batch],
                           [ost[d] for d in batch])
            divs = (*fast_divider(tiles_u), *fast_divider(tiles_u * tiles_v))
            if use_vec:
                return _transpose_expr(e), (blocks, 1, 1), (ext_u, ext_v, ist[v], ost[u], *divs,
                                                            *outer)
            return _scalar_transpose_expr(e), (blocks, 1, 1), (ext_u, ext_v, ist[u], ist[v],
                                                               ost[u], *divs, *outer)

    # everything else: one element per thread, 64-bit offsets
    if nd > MAX_STRIDED_DIMS:
        raise ValueError(f"gpuops.{call.op.name}: the input's layout needs {nd} dimensions after "
                         f"merging contiguous ones; at most {MAX_STRIDED_DIMS} are supported")
    pad = MAX_STRIDED_DIMS - nd
    layout = [nd, *shape, *[1] * pad, *ist, *[0] * pad, *[0] * (3 * MAX_STRIDED_DIMS)]
    grid = max(1, min(-(-n // THREADS), sm_count(call.device) * STRIDED_BLOCKS_PER_SM))
    return _strided_expr(e), (grid, 1, 1), (*layout, n)


def _check_out(op, out: Tensor, shape, src: Tensor):
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"gpuops.{op}: 'out' has shape {tuple(out.shape)}, the result has "
                         f"{tuple(shape)}")
    if not out.contiguous:
        raise ValueError(f"gpuops.{op}: 'out' must be C-contiguous")
    lo, hi = out.span()
    a, b = src.span()
    if out.numel and src.numel and a <= hi and lo <= b:
        raise ValueError(f"gpuops.{op}: 'out' overlaps 'input'; a layout copy cannot be done in "
                         "place")


def _dim(op, d, ndim, name):
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
        raise TypeError(f"gpuops.{op}: {name!r} must be an int, got {type(d).__name__}")
    if ndim == 0 or not -ndim <= d < ndim:
        raise ValueError(f"gpuops.{op}: {name}={d} is out of range for an input of {ndim} "
                         f"dimension(s)")
    return int(d) % ndim


# ---------------------------------------------------------------------------------------------
# References

def ref_transpose(input, dim0, dim1):
    x = np.asarray(input)
    a, b = _dim("transpose", dim0, x.ndim, "dim0"), _dim("transpose", dim1, x.ndim, "dim1")
    return np.ascontiguousarray(np.swapaxes(x, a, b))


def ref_contiguous(input):
    return np.array(input, copy=True, order="C")


# ---------------------------------------------------------------------------------------------
# Benchmarks. A 4-d shape is attention's [B, S, H, D] (transpose(1, 2) -> [B, H, S, D]); 2-d
# shapes are matrices (transpose(0, 1)). Dtypes other than the float ones are timed at a small
# shape only (their kernels are the float ones of the same size).

def _swap(x, a, b):
    return x.transpose(a, b) if hasattr(x, "permute") else x.swapaxes(a, b)


def _transpose_dims(shape):
    return (1, 2) if len(shape) == 4 else (len(shape) - 2, len(shape) - 1)


def _bench_shape(big):
    return lambda d: big if d in dt.FLOATS else (1024, 1024)


def _make_transpose(shape, d, randn):
    return (randn(tuple(shape), d), *_transpose_dims(shape)), {}


def _make_contiguous(shape, d, randn):
    return (_swap(randn(tuple(shape), d), *_transpose_dims(shape)),), {}


# ---------------------------------------------------------------------------------------------
# Ops

@register(family="copy", reference=ref_transpose, dtypes=COPY_DTYPES,
          bench=BenchSpec(make_inputs=_make_transpose,
                          torch_fn=lambda x, d0, d1: x.transpose(d0, d1).contiguous(),
                          default_shape=_bench_shape((8192, 8192)), compile_peer=True,
                          extra_shapes=((8, 4096, 32, 128),)))
def transpose(call, input: Tensor, dim0: int, dim1: int, *, out: Tensor | None = None) -> Tensor:
    """``input`` with dimensions ``dim0`` and ``dim1`` swapped, as a new C-contiguous array: torch's
    ``input.transpose(dim0, dim1).contiguous()``, NumPy's ``ascontiguousarray(swapaxes(...))``.

    Any dtype (elements are copied as raw bytes) and any input strides. Swapping two outer
    dimensions (e.g. attention's [B, S, H, D] -> [B, H, S, D]) copies whole rows with 16-byte
    vectors; swapping the innermost dimension goes through bank-conflict-free shared-memory
    tiles with 16-byte loads and stores.
    """
    nd = len(input.shape)
    a, b = _dim("transpose", dim0, nd, "dim0"), _dim("transpose", dim1, nd, "dim1")
    shape, strides = list(input.shape), list(input.strides)
    shape[a], shape[b] = shape[b], shape[a]
    strides[a], strides[b] = strides[b], strides[a]
    shape = tuple(shape)
    view = Tensor(input.ptr, shape, tuple(strides), input.dtype, input.device, input.obj,
                  input.numel)
    if out is None:
        out = call.empty(shape, input.dtype)
    else:
        _check_out("transpose", out, shape, input)
    strided_copy(call, view, out)
    return out


@register(family="copy", reference=ref_contiguous, dtypes=COPY_DTYPES,
          bench=BenchSpec(make_inputs=_make_contiguous, torch_fn=lambda x: x.contiguous(),
                          default_shape=_bench_shape((8, 4096, 32, 128)), compile_peer=True,
                          extra_shapes=((8192, 8192),)))
def contiguous(call, input: Tensor, *, out: Tensor | None = None) -> Tensor:
    """A C-contiguous copy of ``input`` (any strides: transposed, sliced, broadcast views), as
    ``torch.Tensor.contiguous`` but always a new array (an already contiguous input is copied with
    16-byte vectors).

    Any dtype, copied as raw bytes. The copy is planned from the strides: rows that stay rows are
    copied directly, transposed layouts go through shared-memory tiles (see ``gpuops.transpose``).
    """
    shape = tuple(input.shape)
    if out is None:
        out = call.empty(shape, input.dtype)
    else:
        _check_out("contiguous", out, shape, input)
    strided_copy(call, input, out)
    return out
