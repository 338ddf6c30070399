"""Settings read from the environment.

| variable | meaning |
|---|---|
| GPUOPS_ARCH | compile for this arch instead of the device's (e.g. 61: PTX the driver JITs) |
| GPUOPS_KERNEL_BUNDLE | directory of a prebuilt kernel bundle to load kernels from |
| GPUOPS_CACHE_DIR | on-disk cache of compiled kernels (default ~/.cache/gpuops) |
| GPUOPS_FALLBACK | 'auto' (default): no GPU -> NumPy reference on the CPU; 'error': raise instead |
| GPUOPS_DEBUG_POISON | 1: fill every output gpuops allocates with NaN bytes first (finds unwritten elements) |
| GPUOPS_QUIET | 1: no compile progress messages |
| GPUOPS_PDL | 0: launch no kernel as a programmatic dependent launch (default 1: the modules that declare pdl=True do, on sm_90+) |

The hot path reads the cached :data:`settings`; call :func:`refresh` after changing the environment
in a running process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    arch: str | None
    bundle: Path | None
    cache_dir: Path
    fallback: str
    poison: bool
    quiet: bool
    pdl: bool


def _read() -> Settings:
    env = os.environ
    fallback = env.get("GPUOPS_FALLBACK", "auto").strip().lower() or "auto"
    if fallback not in ("auto", "error"):
        raise ValueError(f"GPUOPS_FALLBACK must be 'auto' or 'error', got {fallback!r}")
    arch = env.get("GPUOPS_ARCH", "").strip() or None
    bundle = env.get("GPUOPS_KERNEL_BUNDLE", "").strip()
    cache = env.get("GPUOPS_CACHE_DIR", "").strip()
    default_cache = Path(env.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpuops"
    return Settings(
        arch=arch,
        bundle=Path(bundle).expanduser() if bundle else None,
        cache_dir=Path(cache).expanduser() if cache else default_cache,
        fallback=fallback,
        poison=env.get("GPUOPS_DEBUG_POISON", "") not in ("", "0"),
        quiet=env.get("GPUOPS_QUIET", "") not in ("", "0"),
        pdl=env.get("GPUOPS_PDL", "1").strip().lower() not in ("0", "false", "off"),
    )


settings: Settings = _read()


def refresh() -> Settings:
    """Re-read the environment; loaded modules are forgotten if the arch, bundle, cache or PDL
    setting changed (a loaded kernel keeps the launch attributes it was loaded with)."""
    global settings
    old, settings = settings, _read()
    if ((old.arch, old.bundle, old.cache_dir, old.pdl)
            != (settings.arch, settings.bundle, settings.cache_dir, settings.pdl)):
        from gpuops.runtime import loader  # noqa: PLC0415
        loader.clear_memory_cache()
    return settings
