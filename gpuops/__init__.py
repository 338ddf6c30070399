"""gpuops: hand-written CUDA kernels for transformer and diffusion workloads, compiled at first use
with NVRTC for the GPU in hand (Pascal sm_61 to Hopper sm_90), for NumPy, CuPy and torch arrays.

    import gpuops as go
    y = go.silu_mul(gate, up)     # same framework and device as the inputs
    go.info()                     # device, arch, NVRTC, cache, bundle
    go.list_ops()                 # every op with its dtypes
"""
from __future__ import annotations

__version__ = "0.1.0"

from gpuops import registry as _registry
from gpuops.runtime.errors import (  # noqa: F401
    BundleError, CompileError, GpuopsError, NoGPUError, NVRTCUnavailableError)
from gpuops.registry import list_ops  # noqa: F401
from gpuops.info import info  # noqa: F401
import gpuops.ops as _ops  # noqa: F401,E402  (registers every op)

for _op in _registry.ops():
    globals()[_op.name] = _op.function

__all__ = ["info", "list_ops", "GpuopsError", "CompileError", "NoGPUError",
           "NVRTCUnavailableError", "BundleError"] + [_op.name for _op in _registry.ops()]
del _op
