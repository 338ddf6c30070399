"""``gpuops.info()``: what gpuops sees and will do on this machine."""
from __future__ import annotations

import platform
import sys

import numpy as np

from gpuops.runtime import config, device, loader, nvrtc


class Info(dict):
    """A dict; ``print(info)`` shows it as aligned lines."""

    def __str__(self):
        lines = []
        for key, value in self.items():
            if isinstance(value, list):
                lines.append(f"{key}:")
                lines.extend(f"  - {item}" for item in value) if value else lines.append("  (none)")
            else:
                lines.append(f"{key + ':':<18}{value}")
        return "\n".join(lines)


def _target_label(cc: int) -> str:
    s = config.settings
    if s.arch:
        t = nvrtc.Target.parse(s.arch)
        kind = "sm" if (t.arch == cc and not s.arch.startswith("compute_")) else "compute"
        return f"{kind}_{t.arch} (GPUOPS_ARCH={s.arch})"
    if nvrtc.available() and cc not in nvrtc.supported_archs():
        newest = max(a for a in nvrtc.supported_archs() if a <= cc)
        return f"compute_{newest} (PTX; this NVRTC does not know sm_{cc})"
    return f"sm_{cc}"


def info() -> Info:
    """Device(s), compute capability, the arch kernels are compiled for, NVRTC, cache, bundle."""
    from gpuops import __version__  # noqa: PLC0415
    s = config.settings
    cp = device.cupy_or_none()
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # noqa: PLC0415
        except ImportError:
            torch = None
    out = Info()
    out["gpuops"] = __version__
    out["python"] = platform.python_version()
    out["numpy"] = np.__version__
    out["cupy"] = cp.__version__ if cp is not None else "not installed"
    out["torch"] = torch.__version__ if torch is not None else "not installed"
    if nvrtc.available():
        out["nvrtc"] = ".".join(map(str, nvrtc.version()))
        out["nvrtc archs"] = " ".join(map(str, nvrtc.supported_archs()))
    else:
        out["nvrtc"] = "not available (pip install gpuops[cuda12])"
    gpus = []
    for i in range(device.gpu_count()):
        d = device.device_info(i)
        gpus.append(f"{i}: {d.name}, compute capability {d.cc // 10}.{d.cc % 10}, {d.sm_count} SMs, "
                    f"{d.total_memory / 2**30:.1f} GiB; kernels for {_target_label(d.cc)}")
    out["gpus"] = gpus
    if not gpus:
        out["mode"] = ("no GPU: ops run their NumPy references on the CPU"
                       if s.fallback == "auto" else "no GPU, and GPUOPS_FALLBACK=error: ops raise")
    out["cache dir"] = str(s.cache_dir)
    if s.bundle is not None:
        try:
            from gpuops.runtime.bundle import open_bundle  # noqa: PLC0415
            b = open_bundle(s.bundle)
            m = b.manifest
            out["bundle"] = (f"{s.bundle} (NVRTC {m.get('nvrtc_version')}, "
                             f"{len(m.get('modules', {}))} modules, built {m.get('created')})")
        except Exception as exc:  # report, don't fail
            out["bundle"] = f"{s.bundle}: unusable ({exc})"
    else:
        out["bundle"] = "none (GPUOPS_KERNEL_BUNDLE unset)"
    out["fallback"] = s.fallback
    out["loaded modules"] = [f"{m.module.name} on GPU {m.device}: {m.target.label} from {m.origin} "
                             f"({m.load_seconds * 1e3:.1f} ms)" for m in loader.loaded_modules()]
    return out
