"""Run gpuops kernels on the CPU: the .cu sources compiled as host C++ with tests/cuda_emu/emu.h
(every CUDA thread a std::thread, warps and blocks synchronized by barriers), driven by the ops'
own host code with NumPy arrays standing in for device memory.

    with emu.Device(sms=2) as dev:            # patches the launch path of gpuops.ops._layout
        call = dev.call("sum", dt.float32)
        y = reduce._reduce(call, "sum", dev.tensor(x), -1, False, True)

Used by the tests of the reduce, scan and top-k families to check kernels (indexing, tiling,
shuffles, barriers, look-back, radix select) on machines without a GPU. Needs g++ with C++20.
Libraries are cached by source hash under $GPUOPS_EMU_CACHE (default ~/.cache/gpuops-emu).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from gpuops import dtypes as dt
from gpuops.ops import _layout as lay
from gpuops.runtime.sources import assemble, cuda_src_root
from gpuops.tensor import Tensor

HERE = Path(__file__).resolve().parent / "cuda_emu"
CACHE = Path(os.environ.get("GPUOPS_EMU_CACHE", Path.home() / ".cache" / "gpuops-emu"))
_EXTERN_SMEM = re.compile(
    r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:<>, ]+?)\s+(\w+)\s*\[\s*\]\s*;")


def available() -> bool:
    return shutil.which("g++") is not None


needs_emu = pytest.mark.skipif(not available(), reason="no g++ for the kernel emulator")


class Probe:
    """A test-only kernel source under tests/cuda_emu/probes (not a gpuops module)."""

    def __init__(self, name: str, source: str, kernels: dict):
        self.name, self.source, self.kernels = name, source, kernels


def _translation_unit(module) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "cuda_src"
        shutil.copytree(cuda_src_root(), root)
        for f in (HERE / "common").iterdir():
            shutil.copy(f, root / "common" / f.name)
        shutil.copytree(HERE / "probes", root / "probes")
        text = assemble(module.source, root=root).text
    text = _EXTERN_SMEM.sub(r"\1* \2 = reinterpret_cast<\1*>(emu::dynamic_smem);", text)
    lines = [text, 'extern "C" const char* emu_fail_msg() { return emu::fail_msg; }',
             'extern "C" void emu_set_schedule(int concurrent, unsigned long long seed) '
             '{ emu::concurrent = concurrent; emu::rng_state = seed; }',
             'extern "C" void emu_set_cluster(int size) { emu::cluster_size = size; }',
             'extern "C" void emu_set_straggle(int percent) { emu::straggle = percent; }']
    for i, expr in enumerate(module.kernels):
        lines.append(
            f'extern "C" int emu_launch_{i}(const unsigned* dims, unsigned long long smem, '
            f"const unsigned char* buf) {{ emu::failed = 0; "
            f"emu::launch_packed(&{expr}, dims, smem, buf); return emu::failed.load(); }}")
    return "\n".join(lines) + "\n"


def build(module, arch: int = 900):
    """The module's kernels as a host shared library (cached), and {name expression: index}."""
    text = _translation_unit(module)
    emu_h = (HERE / "emu.h").read_text()
    key = hashlib.sha256((text + emu_h + str(arch)).encode()).hexdigest()[:20]
    CACHE.mkdir(parents=True, exist_ok=True)
    lib_path = CACHE / f"{module.name}-{arch}-{key}.so"
    if not lib_path.exists():
        src = CACHE / f"{module.name}-{arch}-{key}.cpp"
        src.write_text(text)
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        cmd = ["g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-w", "-U_FORTIFY_SOURCE",
               f"-D__CUDA_ARCH__={arch}", "-include", str(HERE / "emu.h"), "-o", str(tmp), str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"emu build of {module.name} failed:\n{r.stderr[-6000:]}")
        os.replace(tmp, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    lib.emu_fail_msg.restype = ctypes.c_char_p
    return lib, {expr: i for i, expr in enumerate(module.kernels)}


class EmuKernel:
    """One kernel of an emulated module. ``cluster``: blocks per thread-block cluster (the
    kernel's compiled-in cluster size; consecutive blocks along x run together)."""

    def __init__(self, lib, index, spec, name, cluster=1):
        self.fn = getattr(lib, f"emu_launch_{index}")
        self.fn.restype = ctypes.c_int
        self.lib, self.spec, self.name, self.cluster = lib, spec, name, cluster
        self.launches = []

    def launch(self, grid, block, stream, *args, smem=0):
        buf = ctypes.create_string_buffer(max(self.spec.size, 8))
        self.spec.struct.pack_into(buf, 0, *args)
        dims = (ctypes.c_uint * 6)(*grid, *block)
        Device.launches.append((self.name, tuple(grid), tuple(block), smem))
        self.lib.emu_set_schedule(ctypes.c_int(1 if Device.concurrent else 0),
                                  ctypes.c_ulonglong(Device.seed))
        self.lib.emu_set_cluster(ctypes.c_int(self.cluster))
        self.lib.emu_set_straggle(ctypes.c_int(Device.straggle))
        if self.fn(dims, ctypes.c_ulonglong(smem), buf):
            raise RuntimeError(f"emu: {self.name}: {self.lib.emu_fail_msg().decode()}")


class _Op:
    def __init__(self, name):
        self.name = name


class Call:
    """The parts of gpuops.dispatch.Call the ops use, over NumPy memory."""

    def __init__(self, device, op_name, result_dtype):
        self.device, self.stream = 0, 0
        self.op = _Op(op_name)
        self.result_dtype = result_dtype
        self._dev = device

    def empty(self, shape, dtype) -> Tensor:
        return self._dev.empty(shape, dtype)


def np_dtype(d):
    return dt.to_numpy(d) if d is dt.bfloat16 else np.dtype(d.name)


class Device:
    """Patches gpuops' launch path (KernelTable.get, sm_count, contiguous_copy, the top-k chunk
    capacity) to run kernels in the emulator; arrays are NumPy, outputs poisoned with 0xFF."""

    launches: list = []
    _libs: dict = {}
    concurrent = False
    seed = 1
    straggle = 0        # concurrent launches: % of blocks held back each pass (emu.h straggle)

    def __init__(self, sms=2, topk_chunk=None, arch=900, concurrent=False, seed=1):
        """concurrent: run all blocks of a launch at once in a random interleaving (only for
        kernels without shared memory: the scan rows and the top-k warp kernels)."""
        self.sms, self.topk_chunk, self.arch = sms, topk_chunk, arch
        self.concurrent, self.seed = concurrent, seed
        self.keep = []                       # arrays referenced by Tensors (keep them alive)

    def __enter__(self):
        from gpuops.ops import topk  # noqa: PLC0415
        self._saved = (lay.KernelTable.get, lay.sm_count, lay.contiguous_copy, topk._chunk)
        dev = self

        def get(table, _dev, expr):
            key = (table.module.name, dev.arch)
            if key not in Device._libs:
                Device._libs[key] = build(table.module, dev.arch)
            lib, index = Device._libs[key]
            return EmuKernel(lib, index[expr], table.module.kernels[expr], expr)

        lay.KernelTable.get = get
        lay.sm_count = lambda _dev: dev.sms
        lay.contiguous_copy = dev._contiguous_copy
        if self.topk_chunk:
            topk._chunk = lambda _dev: dev.topk_chunk
        Device.launches = []
        Device.concurrent, Device.seed = self.concurrent, self.seed
        self._clear_recipes()
        return self

    @staticmethod
    def _clear_recipes():
        """Plans cached by the ops captured the patched SM count and chunk capacity."""
        from gpuops.ops import reduce, scan, topk  # noqa: PLC0415
        for m in (reduce, scan, topk):
            m._RECIPES.clear()

    def __exit__(self, *exc):
        from gpuops.ops import topk  # noqa: PLC0415
        lay.KernelTable.get, lay.sm_count, lay.contiguous_copy, topk._chunk = self._saved
        Device.concurrent = False
        self._clear_recipes()
        return False

    def call(self, op_name, result_dtype):
        return Call(self, op_name, result_dtype)

    def empty(self, shape, dtype) -> Tensor:
        a = np.empty(tuple(shape), np_dtype(dtype))
        a.reshape(-1).view(np.uint8)[:] = 0xFF
        self.keep.append(a)
        return Tensor(a.ctypes.data, tuple(a.shape), tuple(s // a.itemsize for s in a.strides),
                      dtype, 0, a)

    def tensor(self, a: np.ndarray, dtype=None) -> Tensor:
        """A Tensor view of a NumPy array (any strides, positive or negative, or 0)."""
        d = dtype or dt.from_numpy(a.dtype)
        self.keep.append(a)
        return Tensor(a.ctypes.data, tuple(a.shape), tuple(s // a.itemsize for s in a.strides),
                      d, 0, a)

    def _contiguous_copy(self, call, x: Tensor, order=None) -> Tensor:
        order = tuple(range(len(x.shape))) if order is None else tuple(order)
        src = x.obj
        perm = np.ascontiguousarray(np.transpose(src, order))
        self.keep.append(perm)
        view = np.transpose(perm, np.argsort(order))
        return Tensor(view.ctypes.data, tuple(view.shape),
                      tuple(s // view.itemsize for s in view.strides), x.dtype, 0, view)


def strided(base: np.ndarray, kind: str, rng=None) -> np.ndarray:
    """Views for layout tests: 'contig', 'transposed' (last two dims), 'sliced' (every other
    element of the last dim), 'offset' (starts one element in: misaligned rows)."""
    if kind == "contig":
        return base
    if kind == "transposed":
        return np.ascontiguousarray(np.swapaxes(base, -1, -2)).swapaxes(-1, -2)
    if kind == "sliced":
        wide = np.repeat(base, 2, axis=-1)
        return wide[..., ::2]
    if kind == "offset":
        flat = np.empty(base.size + 1, base.dtype)
        flat[1:] = base.reshape(-1)
        return flat[1:].reshape(base.shape)
    raise ValueError(kind)
