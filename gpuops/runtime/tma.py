"""TMA tensor maps (Hopper, sm_90+): ``cuTensorMapEncodeTiled`` through ctypes on the driver.

A tensor map (CUtensorMap, 128 opaque bytes) describes a strided tensor in global memory and the
box that one ``cp.async.bulk.tensor`` instruction copies into shared memory. It is encoded on the
host from the pointer, extents and strides, and passed to the kernel by value as a
``__grid_constant__`` parameter (ArgSpec ``"tensormap"``), so a launch that uses one stays
capturable in a CUDA graph: encoding is pure host work (no device call, no sync).

CuPy does not wrap this driver function, so it is called through ctypes on ``libcuda.so.1``
(the driver CuPy itself runs on). Encoded maps are remembered per argument tuple: a model calls
the same GEMM with the same buffers over and over, and the ctypes call costs a few microseconds.
"""
from __future__ import annotations

import ctypes
import threading

# CUtensorMapDataType / CUtensorMapSwizzle / CUtensorMapL2promotion values (cuda.h)
DTYPE_UINT8, DTYPE_UINT16, DTYPE_UINT32 = 0, 1, 2
SWIZZLE_NONE, SWIZZLE_32B, SWIZZLE_64B, SWIZZLE_128B = 0, 1, 2, 3
L2_PROMOTION_NONE, L2_PROMOTION_64B, L2_PROMOTION_128B, L2_PROMOTION_256B = 0, 1, 2, 3
MAX_RANK = 5
MAX_BOX = 256
MAX_STRIDE = 1 << 40
_ELEMENT_SIZE = {DTYPE_UINT8: 1, DTYPE_UINT16: 2, DTYPE_UINT32: 4}

_lock = threading.Lock()
_encode = None
_cache: dict = {}
_CACHE_LIMIT = 4096


class TensorMapError(ValueError):
    """The driver rejected a tensor map (or the arguments break a documented TMA rule)."""


def _driver_encode():
    global _encode
    if _encode is None:
        with _lock:
            if _encode is None:
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                except OSError as exc:
                    raise TensorMapError(f"gpuops: cannot load the CUDA driver (libcuda.so.1) "
                                         f"for cuTensorMapEncodeTiled: {exc}") from None
                fn = lib.cuTensorMapEncodeTiled
                u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                               u64p, u64p, u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int]
                fn.restype = ctypes.c_int
                _encode = fn
    return _encode


def check_tiled(ptr: int, dtype: int, dims, strides, box, swizzle: int) -> str | None:
    """Why the driver would reject these arguments (its documented rules), or None.

    dims: extents, innermost first (the innermost has unit stride); strides: byte strides of
    dims[1:]; box: the copied box, innermost first."""
    es = _ELEMENT_SIZE[dtype]
    if not 1 <= len(dims) <= MAX_RANK or len(box) != len(dims) or len(strides) != len(dims) - 1:
        return f"rank {len(dims)} with {len(strides)} strides and a box of rank {len(box)}"
    if ptr % 16:
        return f"the base address {ptr:#x} is not 16-byte aligned"
    for i, d in enumerate(dims):
        if not 1 <= d <= 1 << 32:
            return f"extent {d} of dim {i} is outside 1..2^32"
    for i, s in enumerate(strides):
        if s <= 0 or s % 16 or s >= MAX_STRIDE:
            return (f"the byte stride {s} of dim {i + 1} is not a positive multiple of 16 "
                    "below 2^40")
    for i, b in enumerate(box):
        if not 1 <= b <= MAX_BOX:
            return f"box extent {b} of dim {i} is outside 1..256"
    inner = box[0] * es
    if inner % 16:
        return f"the box's inner extent ({inner} bytes) is not a multiple of 16 bytes"
    limit = {SWIZZLE_32B: 32, SWIZZLE_64B: 64, SWIZZLE_128B: 128}.get(swizzle)
    if limit is not None and inner > limit:
        return f"the box's inner extent ({inner} bytes) exceeds the {limit}-byte swizzle"
    return None


def encode_tiled(ptr: int, dtype: int, dims, strides, box, swizzle: int = SWIZZLE_128B,
                 l2_promotion: int = L2_PROMOTION_256B) -> bytes:
    """The 128 bytes of a tiled tensor map (see check_tiled for the arguments). Element strides
    are 1, no interleave, out-of-range elements read as zeros. Raises TensorMapError."""
    key = (ptr, dtype, tuple(dims), tuple(strides), tuple(box), swizzle, l2_promotion)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    why = check_tiled(ptr, dtype, dims, strides, box, swizzle)
    if why is not None:
        raise TensorMapError(f"gpuops: cannot describe this tensor to TMA: {why}")
    rank = len(dims)
    storage = ctypes.create_string_buffer(128 + 64)          # CUtensorMap needs 64-byte alignment
    addr = (ctypes.addressof(storage) + 63) // 64 * 64
    c_dims = (ctypes.c_uint64 * rank)(*dims)
    c_strides = (ctypes.c_uint64 * max(rank - 1, 1))(*(strides or (0,)))
    c_box = (ctypes.c_uint32 * rank)(*box)
    c_elem = (ctypes.c_uint32 * rank)(*([1] * rank))
    rc = _driver_encode()(addr, dtype, rank, ctypes.c_void_p(ptr), c_dims, c_strides, c_box,
                          c_elem, 0, swizzle, l2_promotion, 0)
    if rc != 0:
        raise TensorMapError(
            f"gpuops: cuTensorMapEncodeTiled failed (CUresult {rc}) for dims {tuple(dims)}, byte "
            f"strides {tuple(strides)}, box {tuple(box)}, base {ptr:#x}")
    value = ctypes.string_at(addr, 128)
    if len(_cache) >= _CACHE_LIMIT:
        _cache.clear()
    _cache[key] = value
    return value
