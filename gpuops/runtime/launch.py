"""Kernel parameter layouts and launches.

A kernel's parameters are declared once, as an :class:`ArgSpec` beside the module that holds the
kernel; tests check every spec against the parameter list NVRTC emits in the PTX, so a Python
launch can never disagree silently with the C++ signature.

Launches go straight to ``cuLaunchKernel`` with all parameters packed into one buffer
(``CU_LAUNCH_PARAM_BUFFER_POINTER``): one ``struct.pack_into`` per launch instead of one Python
object per argument. This keeps gpuops' host overhead at a few microseconds and lets a struct
(shapes and strides) travel by value, with no device buffer, so every launch can be captured in a
CUDA graph.
"""
from __future__ import annotations

import ctypes
import re
import struct
import threading

# size and alignment of struct-module codes, as in a CUDA kernel's parameter space
_SIZE_ALIGN = {"P": 8, "q": 8, "Q": 8, "d": 8, "i": 4, "I": 4, "f": 4,
               "h": 2, "H": 2, "e": 2, "b": 1, "B": 1, "?": 1, "x": 1, "s": 1}
# "tensormap": a CUtensorMap (TMA descriptor, gpuops.runtime.tma) passed by value as a
# __grid_constant__ parameter: 128 opaque bytes (one bytes value), aligned to 64 bytes.
_ALIASES = {"ptr": "P", "i64": "q", "u64": "Q", "i32": "i", "u32": "I", "f32": "f", "f64": "d",
            "tensormap": "@64:128s"}
_ITEM = re.compile(r"(\d*)([PqQdiIfhHebB?xs])")
_ALIGNED = re.compile(r"@(\d+):")
MAX_PARAM_BYTES = 4096


def _layout(fmt: str):
    """Explicitly padded little-endian format, size and alignment of one parameter that is a C
    struct with the given fields (or a single scalar). A leading "@N:" raises the alignment to N
    bytes (alignas(N), e.g. a CUtensorMap's 64); "Ns" is N opaque bytes passed as one bytes value."""
    out, offset, align = [], 0, 1
    pos = 0
    m = _ALIGNED.match(fmt)
    if m:
        align = int(m.group(1))
        if align & (align - 1):
            raise ValueError(f"bad parameter format {fmt!r}: alignment must be a power of two")
        pos = m.end()
    for m in _ITEM.finditer(fmt, pos):
        if m.start() != pos:
            raise ValueError(f"bad parameter format {fmt!r}")
        pos = m.end()
        count, code = int(m.group(1) or 1), m.group(2)
        a = _SIZE_ALIGN[code]
        pad = -offset % a
        if pad:
            out.append(f"{pad}x")
            offset += pad
        out.append(f"{count}{'Q' if code == 'P' else code}")   # 'P' exists only in native mode
        offset += a * count
        align = max(align, a)
    if pos != len(fmt) or not out:
        raise ValueError(f"bad parameter format {fmt!r}")
    tail = -offset % align
    if tail:
        out.append(f"{tail}x")
        offset += tail
    return "".join(out), offset, align


class ArgSpec:
    """The parameter list of a kernel, one entry per C++ parameter.

    Each entry is a scalar ('ptr', 'i64', 'i32', 'f32', 'f64', or a struct code 'P', 'q', ...)
    or the fields of a struct passed by value ('4f' for ``struct {float a, b, c, d;}``,
    'i8q32q' for ``struct {int n; long long s[8]; long long t[32];}``). Launch arguments are
    given flat: a struct parameter takes its fields' values in order.
    """

    def __init__(self, *params: str):
        self.params = tuple(_ALIASES.get(p, p) for p in params)
        parts, offset, self.layout = [], 0, []
        for p in self.params:
            fmt, size, align = _layout(p)
            pad = -offset % align
            if pad:
                parts.append(f"{pad}x")
                offset += pad
            self.layout.append((offset, size, align))
            parts.append(fmt)
            offset += size
        self.size = offset
        if self.size > MAX_PARAM_BYTES:
            raise ValueError(f"kernel parameters take {self.size} bytes, more than {MAX_PARAM_BYTES}")
        self.struct = struct.Struct("<" + "".join(parts))

    def __repr__(self):
        return f"ArgSpec{self.params}"


_PTX_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.([usbf])(\d+)\s+[\w$]+(?:\[(\d+)\])?")


def ptx_params(ptx: str, mangled: str) -> list:
    """(offset, size, align) of each parameter of entry ``mangled`` in PTX text."""
    m = re.search(r"\.entry\s+" + re.escape(mangled) + r"\s*\(([^)]*)\)", ptx)
    if m is None:
        raise KeyError(f"entry {mangled} not in PTX")
    out, offset = [], 0
    for p in _PTX_PARAM.finditer(m.group(1)):
        elem = int(p.group(3)) // 8
        size = elem * int(p.group(4) or 1)
        align = int(p.group(1) or elem)
        offset += -offset % align
        out.append((offset, size, align))
        offset += size
    return out


_tls = threading.local()


def _scratch():
    s = getattr(_tls, "scratch", None)
    if s is None:
        buf = ctypes.create_string_buffer(MAX_PARAM_BYTES)
        size = ctypes.c_size_t(0)
        # CU_LAUNCH_PARAM_BUFFER_POINTER=1, CU_LAUNCH_PARAM_BUFFER_SIZE=2, CU_LAUNCH_PARAM_END=0
        extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 0)
        s = _tls.scratch = (buf, size, ctypes.addressof(extra), extra)
    return s


class Kernel:
    """One loaded kernel function: ``kernel.launch(grid, block, stream, *args)``."""

    __slots__ = ("name", "ptr", "spec", "raw", "_launch", "_smem_limit")

    def __init__(self, name: str, raw_kernel, spec: ArgSpec):
        from cupy.cuda import driver  # noqa: PLC0415
        self.name = name
        self.raw = raw_kernel            # cupy.RawKernel: attributes (registers, smem limits)
        self.ptr = raw_kernel.kernel.ptr
        self.spec = spec
        self._launch = driver.launchKernel
        self._smem_limit = 0             # queried at the first launch with dynamic smem

    def _raise_smem_limit(self, smem: int) -> None:
        # The kernel's own limit, not 48 KiB: by default it is 48 KiB *minus its static shared
        # memory*, so a request just under 48 KiB can already need the attribute raised.
        if self._smem_limit == 0:
            self._smem_limit = int(self.raw.max_dynamic_shared_size_bytes)
            if smem <= self._smem_limit:
                return
        self.raw.max_dynamic_shared_size_bytes = smem
        self._smem_limit = smem

    def launch(self, grid, block, stream: int, *args, smem: int = 0) -> None:
        """Enqueue on the raw CUDA stream handle ``stream`` (an int). ``grid``/``block`` are
        3-tuples; args are flat, as described by the kernel's ArgSpec. ``smem`` is dynamic
        shared memory in bytes; above the kernel's current limit (48 KiB less its static shared
        memory by default) the limit is raised once. ``smem`` plus the static part must stay
        within the device's opt-in maximum (227 KiB per block on sm_90; 48 KiB on sm_61, which
        has no opt-in): callers size it from ``DeviceInfo.max_smem_per_block_optin``."""
        if smem > self._smem_limit:
            self._raise_smem_limit(smem)
        buf, size, extra, _ = _scratch()
        spec = self.spec
        spec.struct.pack_into(buf, 0, *args)
        size.value = spec.size
        self._launch(self.ptr, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                     smem, stream, 0, extra)
