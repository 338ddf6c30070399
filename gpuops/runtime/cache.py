"""On-disk cache of compiled modules, safe when several processes compile at once.

Layout: ``<cache dir>/kernels/<key>.cubin|.ptx`` and ``<key>.json`` (mangled names, target,
NVRTC version). The key hashes everything that changes the binary: the module's assembled source
(every header it includes), options, kernel list, target and NVRTC version. Files are written to
a temporary name and renamed into place, the JSON last, so a reader sees a complete entry or
none; a per-key file lock keeps two processes from compiling the same module at the same time.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: atomic renames still keep the cache consistent
    fcntl = None

from gpuops.runtime import config
from gpuops.runtime.nvrtc import Compiled, Target


def cache_key(module_identity: str, target: Target, nvrtc_version: tuple) -> str:
    text = f"{module_identity}|{target.label}|nvrtc{'.'.join(map(str, nvrtc_version))}"
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class DiskCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root or config.settings.cache_dir)
        self.dir = self.root / "kernels"

    def paths(self, key: str, target: Target):
        return self.dir / f"{key}{target.extension}", self.dir / f"{key}.json"

    def lookup(self, key: str, target: Target):
        """(image path, metadata) of a complete entry, or None."""
        image, meta = self.paths(key, target)
        try:
            info = json.loads(meta.read_text())
        except (OSError, ValueError):
            return None
        if not image.is_file() or image.stat().st_size != info.get("size"):
            return None
        return image, info

    def store(self, key: str, compiled: Compiled, extra: dict) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        image, meta = self.paths(key, compiled.target)
        _atomic_write(image, compiled.image)
        info = dict(extra, target=compiled.target.label, lowered=compiled.lowered,
                    size=len(compiled.image), compile_seconds=round(compiled.seconds, 4))
        _atomic_write(meta, json.dumps(info, indent=1).encode())
        return image

    @contextmanager
    def lock(self, key: str):
        """Hold an exclusive lock on ``key`` across processes (no-op where fcntl is missing)."""
        if fcntl is None:
            yield
            return
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{key}.lock", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def clear(self) -> int:
        """Delete every cached kernel; returns how many files went."""
        n = 0
        for sub in ("kernels", "locks"):
            d = self.root / sub
            if d.is_dir():
                for p in d.iterdir():
                    try:
                        p.unlink()
                        n += 1
                    except OSError:
                        pass
        return n
