"""Progress output while kernels compile (the only slow thing gpuops does on first use)."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager

from gpuops.runtime import config


def _stream():
    return sys.stderr


def message(text: str) -> None:
    if not config.settings.quiet:
        print(f"gpuops: {text}", file=_stream(), flush=True)


@contextmanager
def compiling(module: str, target: str, step: str = ""):
    """Say that a module is compiling, then how long it took."""
    quiet = config.settings.quiet
    out = _stream()
    start = time.perf_counter()
    if not quiet:
        print(f"gpuops: {step}compiling {module} for {target} (first use; cached afterwards) ...",
              end="", file=out, flush=True)
    try:
        yield
    except BaseException:
        if not quiet:
            print(" failed", file=out, flush=True)
        raise
    if not quiet:
        print(f" {time.perf_counter() - start:.2f} s", file=out, flush=True)


class Bar:
    """A one-line progress bar for loops over many items (bundle builds, benchmarks)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.done = total, label, 0
        self.enabled = enabled and not config.settings.quiet
        self.tty = _stream().isatty()
        self.start = time.perf_counter()

    def step(self, item: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        line = (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.start:5.1f}s {item}")
        if self.tty:
            print("\r" + line[:120].ljust(120), end="" if self.done < self.total else "\n",
                  file=_stream(), flush=True)
        else:
            print(line, file=_stream(), flush=True)
