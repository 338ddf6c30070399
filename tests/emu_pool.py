"""An emulated device whose allocations behave like the GPU's caching allocators.

emu.Device keeps every array it hands out alive until the device is closed, so a host path that
launches a kernel with the pointer of a workspace it no longer references (``call.empty(...).ptr``:
the array is freed right away) works in the emulator, while on the GPU torch's caching allocator
and CuPy's memory pool hand that memory to the next ``call.empty`` of the same stream: two
workspaces then share memory and the kernels overwrite each other's results.

CachingDevice frees an allocation as soon as nothing references its array (or any view of it) and
gives the freed block to the next allocation that fits, most recently freed first, as those
allocators do; the emulated kernels then see the same aliasing as the GPU.
"""
from __future__ import annotations

import weakref
from math import prod

import numpy as np

import emu
from gpuops.tensor import Tensor

_GRAIN = 512          # torch and CuPy round device allocations up to 512 bytes


class _Owned(np.ndarray):
    """The first view of a pooled block: NumPy stops collapsing view chains at a change of type,
    so every view made from the array handed out keeps this object (and the block) referenced."""


class CachingDevice(emu.Device):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._free: list = []        # freed blocks (uint8 arrays), most recently freed last
        self.reused = 0              # allocations served from a freed block

    def empty(self, shape, dtype) -> Tensor:
        npd = emu.np_dtype(dtype)
        n = prod(shape)
        nbytes = n * npd.itemsize
        size = max(_GRAIN, -(-nbytes // _GRAIN) * _GRAIN)
        fits = [j for j, b in enumerate(self._free) if b.nbytes >= size]
        if fits:
            raw = self._free.pop(min(fits, key=lambda j: (self._free[j].nbytes, -j)))
            self.reused += 1
        else:
            big = np.empty(size + 256, np.uint8)
            off = -big.ctypes.data % 256
            raw = big[off:off + size]
        raw[:] = 0xFF                                    # poisoned, as the tests' outputs
        owner = raw[:nbytes].view(_Owned)
        weakref.finalize(owner, self._free.append, raw)  # freed when nothing views it any more
        a = owner.view(npd).reshape(tuple(shape))
        return Tensor(a.ctypes.data, tuple(a.shape), tuple(s // a.itemsize for s in a.strides),
                      dtype, 0, a)
