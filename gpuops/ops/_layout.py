"""Shared host code of the reduction, scan and top-k families: dims arguments, describing an
N-d operand as the 3-index view the kernels take, a cached kernel table, and the one-copy fallback
for layouts no view describes.

The kernels of these families take an input as ``x[a, r, b] = x[a * sa + r * sr + b * sb]``
(``a < A`` and ``b < B`` kept, ``r < R`` reduced or scanned, strides in elements). Merging
adjacent dimensions whose strides compose covers contiguous tensors, slices, most transposes and
broadcast (stride-0) views without a copy; anything else is first copied into a contiguous
buffer by the elementwise family's strided kernel (one extra read and write, said in each op's
docstring).
"""
from __future__ import annotations

import operator

from gpuops.runtime import device, loader
from gpuops.shapes import contiguous_strides
from gpuops.tensor import Tensor

_INF = float("inf")


def normalize_dim(op: str, dim, ndim: int, name: str = "dim") -> int:
    """A dims index in [0, max(ndim, 1)); 0-d tensors accept 0 and -1, as torch."""
    if isinstance(dim, bool):
        raise TypeError(f"gpuops.{op}: {name!r} must be an int, got {dim!r}")
    try:
        d = operator.index(dim)
    except TypeError:
        raise TypeError(f"gpuops.{op}: {name!r} must be an int, got {type(dim).__name__}") from None
    n = max(ndim, 1)
    if not -n <= d < n:
        raise ValueError(f"gpuops.{op}: {name}={dim} is out of range for a tensor with {ndim} "
                         f"dimension(s) (expected {-n}..{n - 1})")
    return d % n


def normalize_dims(op: str, dim, ndim: int, allow_tuple: bool) -> tuple:
    """Sorted reduced dims. None (and, as torch, an empty tuple) means every dim."""
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, (tuple, list)):
        if not allow_tuple:
            raise TypeError(f"gpuops.{op}: 'dim' must be an int or None, got {dim!r}")
        if len(dim) == 0:
            return tuple(range(ndim))
        dims = [normalize_dim(op, d, ndim) for d in dim]
        if len(set(dims)) != len(dims):
            raise ValueError(f"gpuops.{op}: 'dim' {tuple(dim)!r} names a dimension twice")
        return tuple(sorted(dims)) if ndim else ()
    d = normalize_dim(op, dim, ndim)
    return (d,) if ndim else ()


def merge(pairs) -> list:
    """Merge consecutive (size, stride) pairs where the outer stride is the inner one times the
    inner size; size-1 dims are dropped. Returns [(size, stride), ...] outer to inner."""
    out = []
    for n, s in pairs:
        if n == 1:
            continue
        if out and out[-1][1] == s * n:
            out[-1] = (out[-1][0] * n, s)
        else:
            out.append((n, s))
    return out


def one_group(pairs):
    """(size, stride) of pairs that merge into one dimension, (1, 0) for none, else None."""
    g = merge(pairs)
    if not g:
        return 1, 0
    return g[0] if len(g) == 1 else None


def view3(shape, strides, d: int):
    """The logical split [before d, d, after d] as (A, sa, R, sr, B, sb), or None when the dims
    before (or after) d do not merge into one in memory."""
    before = one_group(zip(shape[:d], strides[:d]))
    after = one_group(zip(shape[d + 1:], strides[d + 1:]))
    if before is None or after is None:
        return None
    return before[0], before[1], shape[d], strides[d], after[0], after[1]


def contiguous_copy(call, x: Tensor, order=None) -> Tensor:
    """A copy of ``x`` laid out contiguously in dimension order ``order`` (default: x's own), as a
    Tensor view with x's shape. Uses the elementwise family's strided kernel (fma(x, 1, -0) and an
    open clamp: the identity, NaN and signed zeros included)."""
    from gpuops.ops.elementwise import ACTIVATION_OPS, pointwise  # noqa: PLC0415

    order = tuple(range(len(x.shape))) if order is None else tuple(order)
    perm_shape = tuple(x.shape[d] for d in order)
    buf = call.empty(perm_shape, x.dtype)
    cs = contiguous_strides(perm_shape)
    strides = [0] * len(order)
    for i, d in enumerate(order):
        strides[d] = cs[i]
    view = Tensor(buf.ptr, tuple(x.shape), tuple(strides), x.dtype, x.device, buf.obj)
    pointwise(call, ACTIVATION_OPS["ScaleShiftClamp"], (x,), ("input",), view,
              (1.0, -0.0, -_INF, _INF))
    return view


class KernelTable:
    """Kernels of one module looked up once per (device, name expression): the launch path only
    does a dict lookup (kernel names are built once, at import)."""

    def __init__(self, module):
        self.module = module

    def get(self, dev: int, expr: str):
        return loader.kernel(self.module, dev, expr)




sm_count = device.sm_count
