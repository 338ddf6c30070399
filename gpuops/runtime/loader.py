"""Getting a module's kernels onto a device: bundle, disk cache, or NVRTC — once per process.

``load(module, device)`` returns a :class:`LoadedModule`, memoized per (module, device). The
first call in a process looks, in order, in the kernel bundle (GPUOPS_KERNEL_BUNDLE), in the disk
cache, and otherwise compiles with NVRTC (printing progress) and stores the result in the disk
cache. The image is loaded with ``cupy.RawModule(path=...)`` in the device's context.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from gpuops.runtime import config, device, nvrtc, progress
from gpuops.runtime.bundle import open_bundle
from gpuops.runtime.cache import DiskCache, cache_key
from gpuops.runtime.errors import NVRTCUnavailableError
from gpuops.runtime.launch import PDL, Kernel, launch_ex_available
from gpuops.runtime.nvrtc import Target

_memory: dict = {}
_kernels: dict = {}      # (module name, device, name expression) -> Kernel: see kernel()
_lock = threading.RLock()
# Bumped whenever loaded modules are forgotten, so that launchers caching Kernel objects (for
# speed) know to look them up again.
generation = 0


def clear_memory_cache() -> None:
    global generation
    with _lock:
        _memory.clear()
        _kernels.clear()
        generation += 1


@dataclass
class LoadedModule:
    module: object
    device: int
    target: Target
    origin: str              # 'bundle' | 'disk cache' | 'compiled'
    path: str
    lowered: dict
    raw: object              # cupy.RawModule
    load_seconds: float
    _kernels: dict = field(default_factory=dict)

    def kernel(self, expr: str) -> Kernel:
        k = self._kernels.get(expr)
        if k is None:
            spec = self.module.kernels.get(expr)
            if spec is None:
                raise KeyError(f"gpuops: module {self.module.name!r} declares no kernel {expr!r}")
            with device.cupy_or_none().cuda.Device(self.device):
                raw_kernel = self.raw.get_function(self.lowered[expr])
                attrs = PDL if pdl_active(self) else ()
                k = self._kernels[expr] = Kernel(expr, raw_kernel, spec, attrs=attrs)
        return k


def pdl_active(loaded: LoadedModule) -> bool:
    """Whether the kernels of a loaded module are launched as programmatic dependent launches
    (modules.KernelModule's ``pdl``): the module declares it, the code loaded is for sm_90 or
    newer (compute_61 PTX run on an H100 under GPUOPS_ARCH has no griddepcontrol: its kernels
    would not wait), the device is sm_90+, the driver has cuLaunchKernelEx, GPUOPS_PDL is not 0."""
    return (loaded.module.pdl and config.settings.pdl and loaded.target.arch >= 90
            and device.device_info(loaded.device).cc >= 90 and launch_ex_available())


def runtime_target(module, cc: int) -> Target:
    """The target to load ``module`` for on a device of compute capability ``cc``, honouring
    GPUOPS_ARCH (an older arch gives PTX that the driver JIT-compiles for the device)."""
    requested = config.settings.arch
    if module.arch_specific:
        if f"{cc}a" not in module.archs:
            raise RuntimeError(f"gpuops: module {module.name!r} is built only for "
                               f"{', '.join('sm_' + a for a in module.archs)}, not sm_{cc}")
        if requested and Target.parse(requested).arch != cc:
            raise RuntimeError(f"gpuops: module {module.name!r} needs sm_{cc}a; "
                               f"GPUOPS_ARCH={requested} cannot be honoured for it")
        return Target(cc, "cubin", "a")
    if requested:
        t = Target.parse(requested)
        if t.arch > cc:
            raise ValueError(f"gpuops: GPUOPS_ARCH={requested} is newer than the device "
                             f"(sm_{cc}); kernels built for it cannot run here")
        kind = t.kind if requested.strip().lower().startswith(("sm_", "compute_")) else (
            "cubin" if t.arch == cc else "ptx")
        if kind == "cubin" and t.arch != cc:
            raise ValueError(f"gpuops: GPUOPS_ARCH={requested} asks for machine code of another "
                             f"GPU (sm_{t.arch}) than this one (sm_{cc}); use compute_{t.arch}")
        target = Target(t.arch, kind)
    else:
        target = Target(cc, "cubin")
    if target.arch < module.min_arch:
        raise RuntimeError(f"gpuops: module {module.name!r} needs sm_{module.min_arch} or newer")
    return target


def _compile_target(target: Target) -> Target:
    """Adjust a target to what the installed NVRTC can produce: a GPU newer than NVRTC knows gets
    PTX for the newest arch NVRTC has (the driver compiles it)."""
    archs = nvrtc.supported_archs()
    if target.arch in archs:
        return target
    newest = max((a for a in archs if a <= target.arch), default=None)
    if newest is None or target.arch < min(archs):
        nvrtc.check_target(target)   # raises with an explanation (e.g. sm_61 on CUDA 13)
    return Target(newest, "ptx")


def _locate(module, target: Target, cc: int):
    """(path, lowered names, origin, target actually used)."""
    s = config.settings
    if s.bundle is not None:
        entry = open_bundle(s.bundle).find(module, target.arch, target.suffix,
                                           exact_cubin=(target.kind == "cubin" and target.arch == cc))
        if entry is not None:
            return entry.path, entry.lowered, "bundle", entry.target
    try:
        target = _compile_target(target)
        version = nvrtc.version()
    except NVRTCUnavailableError as exc:
        hint = "" if s.bundle else " or set GPUOPS_KERNEL_BUNDLE to a prebuilt bundle"
        raise NVRTCUnavailableError(f"{exc}{hint}") from None
    cache = DiskCache()
    key = cache_key(module.identity, target, version)
    hit = cache.lookup(key, target)
    if hit is not None:
        return hit[0], hit[1]["lowered"], "disk cache", target
    with cache.lock(key):
        hit = cache.lookup(key, target)   # another process may have compiled it meanwhile
        if hit is not None:
            return hit[0], hit[1]["lowered"], "disk cache", target
        with progress.compiling(module.name, target.label):
            compiled = nvrtc.compile_source(module.assembled.text, module.assembled.main_file,
                                            module.name, target, module.options,
                                            module.name_expressions)
        path = cache.store(key, compiled, {"module": module.name, "identity": module.identity,
                                           "nvrtc": ".".join(map(str, version))})
    return path, compiled.lowered, "compiled", target


def load(module, device_index: int) -> LoadedModule:
    key = (module.name, device_index)
    hit = _memory.get(key)
    if hit is not None:
        return hit
    with _lock:
        hit = _memory.get(key)
        if hit is not None:
            return hit
        cp = device.cupy_or_none()
        cc = device.device_info(device_index).cc
        target = runtime_target(module, cc)
        start = time.perf_counter()
        path, lowered, origin, used = _locate(module, target, cc)
        with cp.cuda.Device(device_index):
            raw = cp.RawModule(path=str(path))
            raw.get_function(lowered[module.name_expressions[0]])   # load now, fail early
        loaded = LoadedModule(module=module, device=device_index, target=used, origin=origin,
                              path=str(path), lowered=lowered, raw=raw,
                              load_seconds=time.perf_counter() - start)
        _memory[key] = loaded
        return loaded


def kernel(module, device_index: int, expr: str):
    """The kernel ``expr`` of ``module`` on a device, looked up once and remembered until the
    loaded modules are forgotten: the one kernel-handle cache every launcher uses (the launch
    path is host-bound at decode sizes, so it is a single dict lookup)."""
    key = (module.name, device_index, expr)
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = load(module, device_index).kernel(expr)
    return k


_occupancies: dict = {}


def blocks_per_sm(kernel, threads: int, smem: int = 0) -> int:
    """Blocks of ``threads`` threads (and ``smem`` bytes of dynamic shared memory) of ``kernel``
    that one SM holds at once (the driver's occupancy calculator: registers, shared memory,
    block limits), remembered per kernel handle. Plans use it to size grids in whole waves."""
    key = (id(kernel), threads, smem)
    n = _occupancies.get(key)
    if n is None:
        from cupy.cuda import driver  # noqa: PLC0415
        n = int(driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, threads, smem))
        if n < 1:
            raise RuntimeError(f"gpuops: {kernel.name} cannot run blocks of {threads} threads "
                               f"with {smem} bytes of shared memory on this device")
        _occupancies[key] = n
    return n


def loaded_modules() -> list:
    return list(_memory.values())
