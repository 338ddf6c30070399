"""Kernel parameter layouts and launches.

A kernel's parameters are declared once, as an :class:`ArgSpec` beside the module that holds the
kernel; tests check every spec against the parameter list NVRTC emits in the PTX, so a Python
launch can never disagree silently with the C++ signature.

Launches go straight to ``cuLaunchKernel`` with all parameters packed into one buffer
(``CU_LAUNCH_PARAM_BUFFER_POINTER``): one ``struct.pack_into`` per launch instead of one Python
object per argument. This keeps gpuops' host overhead at a few microseconds and lets a struct
(shapes and strides) travel by value, with no device buffer, so every launch can be captured in a
CUDA graph.

Over-aligned parameters (a CUtensorMap: ``.align 64``) are the exception: they go through
``kernelParams`` (an array of pointers into the same packed buffer, built once per thread and
spec), never through the flat buffer. The flat buffer is copied to the start of the kernel's
parameter bank, but ptxas aligns an over-aligned parameter to its *absolute* constant-bank
address, and the bank starts at c[0x0][0x210] on sm_90 (16-byte aligned only): in the cubin the
first CUtensorMap sits at offset 48, not 0 (``.nv.info`` KPARAM_INFO: 48, 176, 304 for the wgmma
GEMM's (map, map, GemmArgs) where the PTX says 0, 128, 256). A flat buffer packed by the PTX
offsets reaches the kernel shifted by 48 bytes: the wgmma GEMM read batch = 0 and returned
without writing anything, with no error (H100 run 15/16: outputs all NaN/untouched). With
``kernelParams`` the driver places each parameter at the offset the cubin records.
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
        # launched through kernelParams, not the flat buffer (see the module docstring)
        self.needs_pointers = any(align > 8 for _, _, align in self.layout)
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


def cubin_params(cubin: bytes, mangled: str):
    """Where the cubin itself puts the parameters of kernel ``mangled`` (what the driver goes
    by): ``(bank_offset, [(offset, size) per parameter, in order])`` from the ELF section
    ``.nv.info.<mangled>`` (EIATTR_PARAM_CBANK: the parameter block's start in constant bank 0;
    EIATTR_KPARAM_INFO: each parameter's offset in that block and its size). Offsets can differ
    from the PTX's: ptxas aligns an over-aligned parameter to its absolute bank address (see the
    module docstring). Raises KeyError if the kernel or its records are not there."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab = secs[shstrndx][4]
    want = (".nv.info." + mangled).encode()
    for name, _typ, _flags, _addr, off, size in secs:
        start = strtab + name
        if cubin[start:cubin.index(b"\0", start)] != want:
            continue
        bank, params, p = None, {}, off
        while p + 2 <= off + size:
            fmt, attr = cubin[p], cubin[p + 1]
            if fmt == 4:              # EIFMT_SVAL: 2-byte length, then the payload
                length = struct.unpack_from("<H", cubin, p + 2)[0]
                if attr == 0x17:      # EIATTR_KPARAM_INFO: index, ordinal, offset, size << 18
                    _, ordinal, offset, bits = struct.unpack_from("<IHHI", cubin, p + 4)
                    params[ordinal] = (offset, (bits >> 18) & 0x3FFF)
                elif attr == 0x0A:    # EIATTR_PARAM_CBANK: symbol, bank offset, block size
                    bank = struct.unpack_from("<IHH", cubin, p + 4)[1]
                p += 4 + length
            elif fmt in (2, 3):       # EIFMT_BVAL / EIFMT_HVAL: a 2-byte value
                p += 4
            else:                     # EIFMT_NVAL: no value
                p += 2
        if bank is None or not params:
            break
        return bank, [params[i] for i in sorted(params)]
    raise KeyError(f"no parameter records for {mangled} in the cubin")


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


def _param_pointers(spec: ArgSpec) -> int:
    """Address of a ``void*[]`` with one pointer per parameter of ``spec`` into this thread's
    scratch buffer (at the parameter's offset in the packed struct): ``kernelParams`` for a
    launch whose parameters the flat buffer cannot carry (see the module docstring). Built once
    per thread and spec; the packed values change, the pointers do not."""
    buf, _, _, _ = _scratch()
    table = getattr(_tls, "pointers", None)
    if table is None:
        table = _tls.pointers = {}
    hit = table.get(spec.params)
    if hit is None:
        base = ctypes.addressof(buf)
        arr = (ctypes.c_void_p * len(spec.layout))(*(base + off for off, _, _ in spec.layout))
        hit = table[spec.params] = (ctypes.addressof(arr), arr)
    return hit[0]


# CUlaunchConfig (cuda.h): gridDim x/y/z, blockDim x/y/z, sharedMemBytes, (4 bytes of padding),
# hStream, attrs (a pointer to CUlaunchAttribute[numAttrs]), numAttrs: 56 bytes, packed in one
# struct call per launch (the launch path is host-bound at decode sizes).
_LAUNCH_CONFIG = struct.Struct("<7I4xQQI4x")

# Launch attributes (cuLaunchKernelEx; CUlaunchAttributeID in cuda.h). An attribute is given to
# Kernel.launch as (id, int value); the int sits at the start of CUlaunchAttributeValue (64 bytes).
ATTR_COOPERATIVE = 2
ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
# Programmatic dependent launch (sm_90+; device side: cuda_src/common/pdl.cuh): the launched kernel
# may start while the previous kernel of the stream runs, once that kernel's blocks have all
# executed griddepcontrol.launch_dependents; it must execute griddepcontrol.wait before touching
# memory the previous kernel uses. Captured into CUDA graphs as programmatic edges (CUDA 12.3+).
PDL = ((ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, 1),)
MAX_ATTRS = 4


class _CuLaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute (cuda.h): id, 4 bytes of padding, a 64-byte value union (8-aligned)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int64 * 8)]


_launch_ex = None             # cuLaunchKernelEx from libcuda, False where the driver lacks it
_max_active_clusters = None   # cuOccupancyMaxActiveClusters, likewise


def _driver_function(name: str, nargs: int):
    """libcuda's entry point `name` (all arguments pointers or handles, CUresult returned), or
    False where the driver lacks it."""
    try:
        fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_void_p] * nargs
    fn.restype = ctypes.c_int
    return fn


def launch_ex_available() -> bool:
    """Whether the driver has cuLaunchKernelEx (CUDA 11.8+), the entry point for launches with
    attributes. Without it Kernel.launch ignores attributes (plain cuLaunchKernel)."""
    global _launch_ex
    if _launch_ex is None:
        _launch_ex = _driver_function("cuLaunchKernelEx", 4)
    return _launch_ex is not False


_attr_tables: dict = {}


def _attr_table(attrs: tuple) -> int:
    """Address of a CUlaunchAttribute array holding ``attrs`` ((id, int value) pairs), built once
    per distinct tuple and kept for the process (the driver reads it during the launch call)."""
    hit = _attr_tables.get(attrs)
    if hit is None:
        if len(attrs) > MAX_ATTRS:
            raise ValueError(f"gpuops: at most {MAX_ATTRS} launch attributes, got {len(attrs)}")
        table = (_CuLaunchAttribute * len(attrs))()
        for i, (attr_id, value) in enumerate(attrs):
            table[i].id = attr_id
            table[i].value[0] = int(value) & 0xFFFFFFFF    # the union's leading int
        hit = _attr_tables[attrs] = (ctypes.addressof(table), table)
    return hit[0]


def _ex_scratch():
    """This thread's CUlaunchConfig buffer: (buffer, its address)."""
    s = getattr(_tls, "ex", None)
    if s is None:
        buf = ctypes.create_string_buffer(_LAUNCH_CONFIG.size)
        s = _tls.ex = (buf, ctypes.addressof(buf))
    return s


class Kernel:
    """One loaded kernel function: ``kernel.launch(grid, block, stream, *args)``."""

    __slots__ = ("name", "ptr", "spec", "raw", "attrs", "_launch", "_smem_limit", "_by_pointers")

    def __init__(self, name: str, raw_kernel, spec: ArgSpec, attrs: tuple = ()):
        from cupy.cuda import driver  # noqa: PLC0415
        self.name = name
        self.raw = raw_kernel            # cupy.RawKernel: attributes (registers, smem limits)
        self.ptr = raw_kernel.kernel.ptr
        self.spec = spec
        # launch attributes of every launch that passes none (the loader gives PDL to the
        # kernels of pdl=True modules where it is active: loader.pdl_active)
        self.attrs = tuple(attrs)
        self._launch = driver.launchKernel
        self._smem_limit = 0             # queried at the first launch with dynamic smem
        # a parameter aligned beyond 8 bytes (CUtensorMap: 64) may sit at another offset in the
        # cubin than in the packed struct: kernelParams (see the module docstring)
        self._by_pointers = spec.needs_pointers

    def _raise_smem_limit(self, smem: int) -> None:
        # The kernel's own limit, not 48 KiB: by default it is 48 KiB *minus its static shared
        # memory*, so a request just under 48 KiB can already need the attribute raised.
        if self._smem_limit == 0:
            self._smem_limit = int(self.raw.max_dynamic_shared_size_bytes)
            if smem <= self._smem_limit:
                return
        self.raw.max_dynamic_shared_size_bytes = smem
        self._smem_limit = smem

    def launch(self, grid, block, stream: int, *args, smem: int = 0, attrs=()) -> None:
        """Enqueue on the raw CUDA stream handle ``stream`` (an int). ``grid``/``block`` are
        3-tuples; args are flat, as described by the kernel's ArgSpec. ``smem`` is dynamic
        shared memory in bytes; above the kernel's current limit (48 KiB less its static shared
        memory by default) the limit is raised once. ``smem`` plus the static part must stay
        within the device's opt-in maximum (227 KiB per block on sm_90; 48 KiB on sm_61, which
        has no opt-in): callers size it from ``DeviceInfo.max_smem_per_block_optin``.
        ``attrs``: launch attributes, (id, int value) pairs (e.g. ``PDL``), launched through
        cuLaunchKernelEx (default: the kernel's own ``attrs``); where the driver has no
        cuLaunchKernelEx they are dropped (the plain launch keeps full stream order, which every
        attribute used here only relaxes). Callers pass only attributes the device supports
        (PDL: compute capability 9.0+)."""
        if smem > self._smem_limit:
            self._raise_smem_limit(smem)
        buf, size, extra, _ = _scratch()
        spec = self.spec
        spec.struct.pack_into(buf, 0, *args)
        attrs = attrs or self.attrs
        if attrs and launch_ex_available():
            self._launch_with_attrs(grid, block, stream, smem, attrs, buf, size, extra)
            return
        if self._by_pointers:
            self._launch(self.ptr, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                         smem, stream, _param_pointers(spec), 0)
            return
        size.value = spec.size
        self._launch(self.ptr, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                     smem, stream, 0, extra)

    def max_active_clusters(self, grid, block, smem: int = 0) -> int | None:
        """How many clusters of this kernel (its compiled-in cluster size) can be resident on the
        device at once with this launch shape (cuOccupancyMaxActiveClusters, CUDA 11.8+), or
        None where the driver cannot say. A persistent grid of clusters larger than this runs
        its last clusters only after others have finished (GPC placement makes it smaller than
        SMs x blocks per SM / cluster size)."""
        global _max_active_clusters
        if _max_active_clusters is None:
            _max_active_clusters = _driver_function("cuOccupancyMaxActiveClusters", 3)
        if _max_active_clusters is False:
            return None
        if smem > self._smem_limit:
            self._raise_smem_limit(smem)
        config = ctypes.create_string_buffer(_LAUNCH_CONFIG.size)
        _LAUNCH_CONFIG.pack_into(config, 0, grid[0], grid[1], grid[2], block[0], block[1],
                                 block[2], smem, 0, 0, 0)
        count = ctypes.c_int(0)
        rc = _max_active_clusters(ctypes.addressof(count), self.ptr, ctypes.addressof(config))
        return int(count.value) if rc == 0 and count.value > 0 else None

    def _launch_with_attrs(self, grid, block, stream, smem, attrs, buf, size, extra) -> None:
        config, config_addr = _ex_scratch()
        _LAUNCH_CONFIG.pack_into(config, 0, grid[0], grid[1], grid[2], block[0], block[1],
                                 block[2], smem, stream or 0, _attr_table(attrs), len(attrs))
        if self._by_pointers:
            rc = _launch_ex(config_addr, self.ptr, _param_pointers(self.spec), None)
        else:
            size.value = self.spec.size
            rc = _launch_ex(config_addr, self.ptr, None, extra)
        if rc != 0:
            raise RuntimeError(f"gpuops: cuLaunchKernelEx of {self.name} failed: CUresult {rc} "
                               f"(attributes {tuple(attrs)})")
