"""Exceptions raised by gpuops."""
from __future__ import annotations


class GpuopsError(Exception):
    """Base class of gpuops' own errors."""


class NoGPUError(GpuopsError, RuntimeError):
    """A GPU was required (GPUOPS_FALLBACK=error, or a CuPy/torch CUDA input) but none is usable."""


class NVRTCUnavailableError(GpuopsError, RuntimeError):
    """NVRTC could not be loaded or cannot target the requested architecture."""


class BundleError(GpuopsError, RuntimeError):
    """A kernel bundle is missing, unreadable or malformed."""


class CompileError(GpuopsError, RuntimeError):
    """NVRTC rejected a module. The message names the .cu file and line (via #line) and carries
    NVRTC's whole log."""

    def __init__(self, module: str, target: str, log: str):
        self.module = module
        self.target = target
        self.log = log
        first = next((line for line in log.splitlines() if "error" in line), log.strip()[:300])
        super().__init__(
            f"gpuops: NVRTC failed to compile module '{module}' for {target}: {first.strip()}\n"
            f"--- NVRTC log ---\n{log.rstrip()}")
