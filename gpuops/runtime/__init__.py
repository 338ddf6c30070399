"""The gpuops runtime: kernel sources, NVRTC compilation, caches, bundles, loading, launching.

Nothing here knows about ops or array frameworks; the registry (:mod:`gpuops.registry`) and the
dispatch layer (:mod:`gpuops.dispatch`) sit on top of it.
"""
from gpuops.runtime.errors import (  # noqa: F401
    BundleError, CompileError, GpuopsError, NoGPUError, NVRTCUnavailableError)
from gpuops.runtime.modules import KernelModule, all_modules  # noqa: F401
