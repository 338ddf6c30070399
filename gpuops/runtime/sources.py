"""Kernel sources: finding cuda_src/, inlining the project's own #includes, hashing.

CuPy's and NVRTC's caches do not see headers pulled in with -I, so gpuops inlines every
``#include "..."`` that names a file under cuda_src/ into one translation unit. The hash of that
text then changes whenever any header it uses changes, and ``#line`` directives keep compiler
messages pointing at the real file and line (``cuda_src/elementwise/pointwise.cuh(42): error``).
Angle-bracket includes are left to NVRTC.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\b")


def cuda_src_root() -> Path:
    """The directory holding the .cu sources: ``cuda_src/`` beside the package in a source
    tree, ``gpuops/cuda_src/`` in an installed wheel."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package.parent / "cuda_src", package / "cuda_src"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"gpuops: kernel sources not found beside {package}")


@dataclass(frozen=True)
class AssembledSource:
    text: str            # one translation unit, includes inlined, with #line directives
    files: tuple         # relative paths of every file that went into it, in order
    sha256: str          # hash of `text`

    @property
    def main_file(self) -> str:
        return self.files[0]


def _display_name(path: Path, root: Path) -> str:
    return "cuda_src/" + path.relative_to(root).as_posix()


def assemble(relpath: str, root: Path | None = None) -> AssembledSource:
    """Read ``cuda_src/<relpath>`` and inline the project headers it includes, recursively.

    Each header is inlined once per translation unit (all project headers are include-once).
    An include that names no file under cuda_src/ raises FileNotFoundError naming the includer.
    """
    root = root or cuda_src_root()
    done: set[Path] = set()
    order: list[str] = []
    out: list[str] = []

    def resolve(name: str, includer: Path) -> Path | None:
        for base in (includer.parent, root):
            candidate = (base / name).resolve()
            if candidate.is_file():
                return candidate
        return None

    def emit(path: Path) -> None:
        done.add(path)
        shown = _display_name(path, root)
        order.append(path.relative_to(root).as_posix())
        out.append(f'#line 1 "{shown}"')
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            m = _INCLUDE.match(line)
            if m:
                target = resolve(m.group(1), path)
                if target is None:
                    raise FileNotFoundError(
                        f'{shown}:{number}: #include "{m.group(1)}" names no file under {root}')
                if target not in done:
                    emit(target)
                out.append(f'#line {number + 1} "{shown}"')
            elif _PRAGMA_ONCE.match(line):
                out.append("")
            else:
                out.append(line)

    main = (root / relpath).resolve()
    if not main.is_file():
        raise FileNotFoundError(f"gpuops: kernel source cuda_src/{relpath} does not exist")
    emit(main)
    text = "\n".join(out) + "\n"
    return AssembledSource(text=text, files=tuple(order),
                           sha256=hashlib.sha256(text.encode()).hexdigest())


def all_source_files(root: Path | None = None) -> list[str]:
    """Every .cu file under cuda_src/ (headers excluded), as relative paths."""
    root = root or cuda_src_root()
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.cu"))
