"""Kernel modules, declared by data.

A :class:`KernelModule` names one .cu file under cuda_src/, the kernels (C++ name expressions,
usually template instantiations) it must export with each one's parameter layout, extra NVRTC
options, and the architectures it is built for. Modules are compiled lazily, per device, the
first time one of their kernels is launched (:mod:`gpuops.runtime.loader`), or ahead of time into a
bundle (``python -m gpuops build``).

``pdl=True`` declares that every kernel of the module begins with ``gpuops::pdl_start()``
(cuda_src/common/pdl.cuh: wait for the previous kernel of the stream before any memory access,
then let the next one be scheduled). Its kernels are then launched as programmatic dependent
launches where that is real: a device and loaded code of sm_90 or newer, a driver with
cuLaunchKernelEx, and GPUOPS_PDL not 0 (:func:`gpuops.runtime.loader.pdl_active`). A test reads
the sm_90 PTX of one instantiation of every kernel template of such modules and fails where a
memory access comes before the wait.
"""
from __future__ import annotations

import hashlib
import json
from functools import cached_property

from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.sources import AssembledSource, assemble

# Pascal (GTX 10xx, P40) to Hopper. A module that needs arch-specific instructions declares e.g.
# archs=("90a",) instead and is only used on that arch.
DEFAULT_ARCHS = ("61", "70", "75", "80", "86", "89", "90")

# Bumped when the way gpuops compiles changes in a way the source hash cannot see.
COMPILE_FORMAT = 1

_MODULES: dict = {}


class KernelModule:
    def __init__(self, name: str, source: str, kernels: dict, options=(), archs=DEFAULT_ARCHS,
                 pdl: bool = False):
        if name in _MODULES:
            raise ValueError(f"gpuops: kernel module {name!r} is declared twice")
        if not kernels:
            raise ValueError(f"gpuops: kernel module {name!r} declares no kernels")
        for expr, spec in kernels.items():
            if not isinstance(spec, ArgSpec):
                raise TypeError(f"module {name!r}: kernel {expr!r} needs an ArgSpec, got {spec!r}")
        self.name = name
        self.source = source
        self.kernels = dict(kernels)
        self.options = tuple(options)
        self.archs = tuple(str(a) for a in archs)
        self.pdl = bool(pdl)
        _MODULES[name] = self

    def __repr__(self):
        return f"KernelModule({self.name!r}, cuda_src/{self.source}, {len(self.kernels)} kernels)"

    @cached_property
    def assembled(self) -> AssembledSource:
        return assemble(self.source)

    @cached_property
    def identity(self) -> str:
        """Hash of everything in the module that changes the binary apart from the target and
        the NVRTC version: the assembled source (headers included), options, kernel list."""
        payload = json.dumps({"format": COMPILE_FORMAT, "source": self.assembled.sha256,
                              "options": self.options, "kernels": sorted(self.kernels)})
        return hashlib.sha256(payload.encode()).hexdigest()

    @property
    def name_expressions(self) -> list:
        return list(self.kernels)

    @property
    def arch_specific(self) -> bool:
        return any(a.endswith("a") for a in self.archs)

    @property
    def min_arch(self) -> int:
        return min(int(a.rstrip("a")) for a in self.archs)

    def supports(self, cc: int) -> bool:
        """Can this module run on a device of compute capability ``cc`` (e.g. 90)?"""
        if self.arch_specific:
            return f"{cc}a" in self.archs
        return cc >= self.min_arch


def all_modules() -> list:
    """Every declared module (ops register theirs when gpuops.ops is imported)."""
    import gpuops.ops  # noqa: F401,PLC0415  (declares the modules)
    return list(_MODULES.values())


def get_module(name: str) -> KernelModule:
    all_modules()
    try:
        return _MODULES[name]
    except KeyError:
        raise KeyError(f"gpuops: no kernel module named {name!r}; "
                       f"known: {', '.join(sorted(_MODULES))}") from None
