"""Device-free compilation with NVRTC.

gpuops calls NVRTC through CuPy's thin binding (``cupy_backends.cuda.libs.nvrtc``), which loads
NVRTC from the ``nvidia-cuda-nvrtc-cu12`` / CUDA 13 wheels or a system toolkit and needs neither a
GPU nor a driver. The same function builds kernel bundles on a CPU-only machine and JIT-compiles
modules at first use on a GPU machine, so both paths produce identical binaries.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from gpuops.runtime.errors import CompileError, NVRTCUnavailableError

# Options every module is compiled with. No -ftz / --use_fast_math: denormals and IEEE division
# behave as in torch, so results do not silently lose precision.
BASE_OPTIONS = ("-std=c++17",)

_DEPRECATION = re.compile(r"^nvrtc: warning: Architectures prior to .* are deprecated.*$", re.M)


@dataclass(frozen=True)
class Target:
    """What NVRTC produces: machine code for one GPU (``sm_90``, ``sm_90a``) or PTX for a virtual
    arch (``compute_61``) that the driver compiles for whatever newer GPU loads it."""
    arch: int
    kind: str = "cubin"      # 'cubin' | 'ptx'
    suffix: str = ""         # 'a' for arch-specific features (wgmma, setmaxnreg on sm_90a)

    @property
    def label(self) -> str:
        return f"{'sm' if self.kind == 'cubin' else 'compute'}_{self.arch}{self.suffix}"

    @property
    def arch_label(self) -> str:
        return f"{self.arch}{self.suffix}"

    @property
    def extension(self) -> str:
        return ".cubin" if self.kind == "cubin" else ".ptx"

    @classmethod
    def parse(cls, text: str) -> "Target":
        """'sm_90', 'sm_90a', 'compute_61' (PTX), or a bare '86' / '90a' (cubin)."""
        t = text.strip().lower()
        kind = "cubin"
        if t.startswith("compute_"):
            kind, t = "ptx", t[len("compute_"):]
        elif t.startswith("sm_"):
            t = t[len("sm_"):]
        m = re.fullmatch(r"(\d+)([a-z]?)", t)
        if not m:
            raise ValueError(f"not a CUDA arch: {text!r} (expected e.g. 61, 90a, sm_86, compute_61)")
        return cls(int(m.group(1)), kind, m.group(2))


@dataclass
class Compiled:
    image: bytes                 # cubin or PTX (NUL-terminated text)
    target: Target
    lowered: dict                # name expression -> mangled kernel name
    log: str                     # NVRTC's log without the sm<75 deprecation notice
    seconds: float
    resources: dict = field(default_factory=dict)   # mangled name -> ptxas resource usage


def _binding():
    try:
        from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415
        nvrtc.getVersion()
    except Exception as exc:  # ImportError, or the shared library is missing
        raise NVRTCUnavailableError(
            "gpuops: NVRTC is not available. Install the CUDA extra, e.g. "
            "`pip install gpuops[cuda12]` (cupy-cuda12x + nvidia-cuda-nvrtc-cu12; needed for "
            f"Pascal/sm_61) or `gpuops[cuda13]`. Cause: {exc!r}") from exc
    return nvrtc


def available() -> bool:
    try:
        _binding()
        return True
    except NVRTCUnavailableError:
        return False


def version() -> tuple:
    return tuple(_binding().getVersion())


def supported_archs() -> tuple:
    return tuple(_binding().getSupportedArchs())


def check_target(target: Target) -> None:
    if target.arch not in supported_archs():
        v = ".".join(map(str, version()))
        hint = (" CUDA 13's NVRTC dropped sm_61..sm_72: install gpuops[cuda12] (NVRTC 12), or "
                "load a bundle built with it (GPUOPS_KERNEL_BUNDLE)." if target.arch < 75 else "")
        raise NVRTCUnavailableError(
            f"gpuops: NVRTC {v} cannot compile for {target.label} "
            f"(it supports {', '.join(map(str, supported_archs()))}).{hint}")


def compile_source(text: str, filename: str, module: str, target: Target,
                   options=(), name_expressions=(), verbose: bool = False) -> Compiled:
    """Compile one translation unit. Raises CompileError (NVRTC's log, file:line) on failure."""
    nvrtc = _binding()
    check_target(target)
    opts = [f"--gpu-architecture={target.label}", *BASE_OPTIONS, *options]
    if verbose and target.kind == "cubin":
        opts.append("--ptxas-options=-v")
    start = time.perf_counter()
    prog = nvrtc.createProgram(text, filename, [], [])
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(module, target.label, _DEPRECATION.sub("", log).strip() or str(exc)) \
                from None
        log = _DEPRECATION.sub("", nvrtc.getProgramLog(prog)).strip()
        image = nvrtc.getCUBIN(prog) if target.kind == "cubin" else nvrtc.getPTX(prog)
        lowered = {expr: nvrtc.getLoweredName(prog, expr) for expr in name_expressions}
    finally:
        nvrtc.destroyProgram(prog)
    return Compiled(image=bytes(image), target=target, lowered=lowered, log=log,
                    seconds=time.perf_counter() - start, resources=parse_ptxas_log(log))


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict:
    """Per kernel: registers, stack frame, spill stores/loads, static shared memory, from
    ``--ptxas-options=-v`` output."""
    usage: dict = {}
    current = None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = usage.setdefault(m.group(1), {"registers": 0, "stack": 0, "spill_stores": 0,
                                                    "spill_loads": 0, "smem": 0})
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        m = _REGS.search(line)
        if m:
            current["registers"] = int(m.group(1))
            s = _SMEM.search(line)
            current["smem"] = int(s.group(1)) if s else 0
    return usage
