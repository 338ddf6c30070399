"""Shape arithmetic shared by ops: torch-style broadcasting with errors that name arguments,
and dimension coalescing for strided kernels."""
from __future__ import annotations

from math import prod


def broadcast_shapes(**named) -> tuple:
    """Broadcast the named shapes (torch/NumPy rules); ValueError naming the two arguments that
    disagree. ``broadcast_shapes(gate=(4, 8), up=(8,)) == (4, 8)``."""
    ndim = max((len(s) for s in named.values()), default=0)
    out = [1] * ndim
    owner = [None] * ndim
    for name, shape in named.items():
        shape = tuple(shape)
        for i, size in enumerate(shape):
            d = ndim - len(shape) + i
            if size == 1:
                continue
            if out[d] == 1:
                out[d], owner[d] = size, name
            elif out[d] != size:
                raise ValueError(
                    f"shapes cannot be broadcast: {owner[d]!r} has {named[owner[d]]} and {name!r} "
                    f"has {shape} (size {out[d]} vs {size} at dimension {d - ndim})")
    return tuple(out)


def broadcast_strides(shape: tuple, strides: tuple, out_shape: tuple) -> tuple:
    """Strides of a view of ``shape`` broadcast to ``out_shape`` (0 where it is repeated)."""
    lead = len(out_shape) - len(shape)
    result = [0] * lead
    for size, stride in zip(shape, strides):
        result.append(0 if size == 1 else stride)
    return tuple(result)


def coalesce(shape: tuple, strides_list: list):
    """Merge adjacent dimensions that every operand walks contiguously, and drop size-1 ones.

    Returns (shape, [strides per operand]) describing the same elements in the same row-major
    order with as few dimensions as possible.
    """
    dims = [i for i, s in enumerate(shape) if s != 1]
    if not dims:
        return (1,), [(0,) for _ in strides_list]
    new_shape = [shape[dims[0]]]
    new_strides = [[st[dims[0]]] for st in strides_list]
    for d in dims[1:]:
        size = shape[d]
        if all(ns[-1] == st[d] * size for ns, st in zip(new_strides, strides_list)):
            new_shape[-1] *= size
            for ns, st in zip(new_strides, strides_list):
                ns[-1] = st[d]
        else:
            new_shape.append(size)
            for ns, st in zip(new_strides, strides_list):
                ns.append(st[d])
    return tuple(new_shape), [tuple(ns) for ns in new_strides]


def contiguous_strides(shape: tuple) -> tuple:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def numel(shape) -> int:
    return prod(shape)
