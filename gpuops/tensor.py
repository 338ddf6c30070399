"""The view of an array that kernel launchers work with.

Whatever the caller passed (a torch tensor, a CuPy array, a NumPy array staged to the GPU), an op's
GPU implementation sees a :class:`Tensor`: a device pointer, shape, strides in elements, a gpuops
dtype, the device index, and the framework object that owns the memory (kept alive by the view
and handed back to the caller). ``numel`` and ``contiguous`` are read once from the framework when
the view is made, because the launch path asks for them on every call.
"""
from __future__ import annotations

from math import prod


def _contiguous(shape, strides) -> bool:
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


class Tensor:
    __slots__ = ("ptr", "shape", "strides", "dtype", "device", "obj", "numel", "contiguous")

    def __init__(self, ptr: int, shape: tuple, strides: tuple, dtype, device: int, obj,
                 numel: int | None = None, contiguous: bool | None = None):
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.device = device
        self.obj = obj
        self.numel = prod(shape) if numel is None else numel
        self.contiguous = _contiguous(shape, strides) if contiguous is None else contiguous

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def is_contiguous(self) -> bool:
        return self.contiguous

    def span(self):
        """[first, last] byte addresses touched by this view (for overlap checks)."""
        lo = hi = 0
        for size, stride in zip(self.shape, self.strides):
            if size == 0:
                return self.ptr, self.ptr - 1
            if stride > 0:
                hi += (size - 1) * stride
            else:
                lo += (size - 1) * stride
        item = self.dtype.itemsize
        return self.ptr + lo * item, self.ptr + hi * item + item - 1

    def __repr__(self):
        return (f"Tensor(ptr=0x{self.ptr:x}, shape={tuple(self.shape)}, strides={tuple(self.strides)}, "
                f"dtype={self.dtype}, device={self.device})")
