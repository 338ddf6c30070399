"""Which GPUs are there, what they are, and making one current.

CuPy is imported lazily: ``import gpuops`` works with no CuPy, no driver and no GPU.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache

_tls = threading.local()


@lru_cache(maxsize=None)
def cupy_or_none():
    """The cupy module, or None when it is not installed or cannot initialize."""
    try:
        import cupy  # noqa: PLC0415
        return cupy
    except Exception:  # ImportError, or a broken CUDA install
        return None


@lru_cache(maxsize=None)
def gpu_count() -> int:
    cp = cupy_or_none()
    if cp is None:
        return 0
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:  # no driver, or no device
        return 0


def gpu_available() -> bool:
    return gpu_count() > 0


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    cc: int                   # compute capability as an int: 61, 86, 90
    sm_count: int
    total_memory: int
    l2_bytes: int
    max_smem_per_block_optin: int


@lru_cache(maxsize=None)
def device_info(index: int) -> DeviceInfo:
    cp = cupy_or_none()
    props = cp.cuda.runtime.getDeviceProperties(index)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return DeviceInfo(
        index=index, name=name, cc=int(props["major"]) * 10 + int(props["minor"]),
        sm_count=int(props["multiProcessorCount"]), total_memory=int(props["totalGlobalMem"]),
        l2_bytes=int(props.get("l2CacheSize", 0)),
        max_smem_per_block_optin=int(props.get("sharedMemPerBlockOptin", 0)))


def sm_count(index: int) -> int:
    """Multiprocessors of a device (cached with device_info): what launch plans size grids by."""
    return device_info(index).sm_count


_runtime = None


def make_current(index: int):
    """Make ``index`` the current device of this thread, and its primary context current (the raw
    cuLaunchKernel in :mod:`gpuops.runtime.launch` needs one). Returns the device to restore
    afterwards, or None when nothing changed. On every GPU call: kept to two C calls."""
    global _runtime
    runtime = _runtime
    if runtime is None:
        runtime = _runtime = cupy_or_none().cuda.runtime
    previous = runtime.getDevice()
    if not getattr(_tls, "initialized", False):
        runtime.setDevice(index)   # binds the context in a fresh thread even when index == previous
        _tls.initialized = True
    elif previous != index:
        runtime.setDevice(index)
    return previous if previous != index else None


def default_device() -> int:
    return int(cupy_or_none().cuda.runtime.getDevice())
