"""Kernel bundles: every module compiled ahead of time, on a machine without a GPU.

``python -m gpuops build --arch 61,75,80,86,89,90 --out DIR`` writes one file per module and
target plus ``manifest.json``::

    {"format": 1, "gpuops_version": "...", "nvrtc_version": "12.9", "created": "...",
     "modules": {"elementwise.activations": {
         "source": "elementwise/activations.cu", "identity": "<sha256 of source+options+kernels>",
         "targets": {"compute_61": {"file": "...ptx", "sha256": "...", "lowered": {...},
                                    "resources": {...}}}}}}

``GPUOPS_KERNEL_BUNDLE=DIR`` makes the loader take kernels from the bundle. An entry is used only
if its identity matches the module as it is now and the file's sha256 matches the manifest;
otherwise gpuops warns and compiles the module normally.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from gpuops.runtime import nvrtc, progress
from gpuops.runtime.errors import BundleError
from gpuops.runtime.nvrtc import Target

MANIFEST = "manifest.json"
FORMAT = 1


def _compile_job(module_name: str, target: Target):
    """Worker-process entry of a parallel build: compile one registered module."""
    from gpuops.runtime.modules import get_module  # noqa: PLC0415
    m = get_module(module_name)
    return nvrtc.compile_source(m.assembled.text, m.assembled.main_file, m.name, target,
                                m.options, m.name_expressions, verbose=True)


def _current_entries(out: Path, nvrtc_version: str) -> dict:
    """The manifest entries of an existing bundle in ``out`` that are still current: same format
    and NVRTC, the module's identity unchanged, the image present with its recorded sha256."""
    from gpuops.runtime.modules import all_modules  # noqa: PLC0415
    try:
        old = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    if old.get("format") != FORMAT or old.get("nvrtc_version") != nvrtc_version:
        return {}
    now = {m.name: m.identity for m in all_modules()}
    kept = {}
    for name, entry in old.get("modules", {}).items():
        if now.get(name) != entry.get("identity"):
            continue
        targets = {label: info for label, info in entry.get("targets", {}).items()
                   if (out / info["file"]).is_file() and hashlib.sha256(
                       (out / info["file"]).read_bytes()).hexdigest() == info["sha256"]}
        if targets:
            kept[name] = dict(entry, targets=targets)
    return kept


def build(out_dir, targets, modules=None, show_progress: bool = True, jobs: int = 1,
          only_stale: bool = False) -> dict:
    """Compile ``modules`` (default: all) for every target a module supports; returns the
    manifest. Cubins are compiled with ptxas -v and their register/spill counts recorded.
    ``jobs`` > 1 compiles in that many worker processes (registered modules only).
    ``only_stale``: keep the images of an existing bundle in ``out_dir`` that are still current
    (same NVRTC, module unchanged) and compile only the rest."""
    from gpuops import __version__  # noqa: PLC0415
    from gpuops.runtime.modules import all_modules  # noqa: PLC0415
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    modules = list(modules) if modules is not None else all_modules()
    nvrtc_version = ".".join(map(str, nvrtc.version()))
    kept = _current_entries(out, nvrtc_version) if only_stale else {}
    jobs_list = [(m, t) for m in modules for t in targets if _wants(m, t)
                 and t.label not in kept.get(m.name, {}).get("targets", {})]
    bar = progress.Bar(len(jobs_list), "gpuops build", enabled=show_progress)
    manifest = {"format": FORMAT, "gpuops_version": __version__,
                "nvrtc_version": nvrtc_version,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "modules": kept}

    def record(module, target, compiled):
        fname = f"{module.name}.{target.label}{target.extension}"
        (out / fname).write_bytes(compiled.image)
        entry = manifest["modules"].setdefault(
            module.name, {"source": module.source, "identity": module.identity, "targets": {}})
        entry["targets"][target.label] = {
            "file": fname, "sha256": hashlib.sha256(compiled.image).hexdigest(),
            "lowered": compiled.lowered, "resources": compiled.resources,
            "compile_seconds": round(compiled.seconds, 3)}
        bar.step(f"{module.name} {target.label}")

    if jobs > 1 and len(jobs_list) > 1:
        from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [(m, t, pool.submit(_compile_job, m.name, t)) for m, t in jobs_list]
            for m, t, f in futures:
                record(m, t, f.result())
    else:
        for m, t in jobs_list:
            record(m, t, nvrtc.compile_source(m.assembled.text, m.assembled.main_file, m.name, t,
                                              m.options, m.name_expressions, verbose=True))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def _wants(module, target: Target) -> bool:
    label = target.arch_label
    if module.arch_specific:
        return label in module.archs
    return not target.suffix and target.arch >= module.min_arch


@dataclass
class BundleEntry:
    path: Path
    target: Target
    lowered: dict


class Bundle:
    def __init__(self, root):
        self.root = Path(root)
        path = self.root / MANIFEST
        try:
            self.manifest = json.loads(path.read_text())
        except FileNotFoundError:
            raise BundleError(f"gpuops: GPUOPS_KERNEL_BUNDLE={self.root} has no {MANIFEST}") from None
        except ValueError as exc:
            raise BundleError(f"gpuops: {path} is not valid JSON: {exc}") from None
        if self.manifest.get("format") != FORMAT:
            raise BundleError(f"gpuops: {path} has format {self.manifest.get('format')!r}; "
                              f"this gpuops reads format {FORMAT}")
        self._warned: set = set()

    def _warn(self, key, text):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(text, RuntimeWarning, stacklevel=4)

    def find(self, module, arch: int, suffix: str, exact_cubin: bool):
        """The entry to load for ``module`` on a target arch, or None (caller compiles).

        Preference: a cubin for exactly this arch (only when ``exact_cubin``: the arch is the
        device's own), else PTX for the newest virtual arch not above it.
        """
        entry = self.manifest["modules"].get(module.name)
        if entry is None:
            self._warn(module.name, f"gpuops: bundle {self.root} has no module {module.name!r}; "
                                    "compiling it instead")
            return None
        if entry.get("identity") != module.identity:
            self._warn(module.name,
                       f"gpuops: bundle {self.root} was built from a different source of module "
                       f"{module.name!r} (cuda_src/{module.source} or a header it includes "
                       "changed); compiling it instead")
            return None
        targets = {Target.parse(label): info for label, info in entry["targets"].items()}
        choice = None
        if exact_cubin:
            choice = next((t for t in targets if t.kind == "cubin" and t.arch == arch
                           and t.suffix == suffix), None)
        if choice is None:
            ptx = [t for t in targets if t.kind == "ptx" and t.arch <= arch and t.suffix == suffix]
            choice = max(ptx, key=lambda t: t.arch, default=None)
        if choice is None:
            self._warn((module.name, arch), f"gpuops: bundle {self.root} has no build of "
                       f"{module.name!r} usable on arch {arch}{suffix}; compiling it instead")
            return None
        info = targets[choice]
        path = self.root / info["file"]
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            self._warn((module.name, "io"), f"gpuops: cannot read {path}: {exc}; compiling instead")
            return None
        if digest != info["sha256"]:
            self._warn((module.name, "sha"), f"gpuops: {path} does not match the sha256 in the "
                       "bundle manifest (corrupt or replaced); compiling it instead")
            return None
        return BundleEntry(path=path, target=choice, lowered=dict(info["lowered"]))


_open: dict = {}


def open_bundle(root) -> Bundle:
    key = str(Path(root).resolve())
    if key not in _open:
        _open[key] = Bundle(root)
    return _open[key]
