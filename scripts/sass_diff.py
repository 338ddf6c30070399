"""Compare the SASS of two kernel bundles built off-device (`gpuops build --kind cubin`), kernel by
kernel: identical machine code means a kernel verified on a GPU in one tree stays verified in the
other (a refactor, a new template branch compiled out, a new sibling instantiation).

    python scripts/sass_diff.py BEFORE_BUNDLE AFTER_BUNDLE [--modules a,b] [--show N] [--loose]

Kernels are paired by their source-level name (``gpuops::f<T, 128, ...>``), so a kernel whose
mangled name changed (a defaulted template parameter added) is still compared. Per module and
target: kernels identical / changed / only in one side. Branch targets are compared as resolved
addresses, so a change anywhere in a function shows up as changed; the numbering of the compiler's
internal helpers (``__internal_12_$__cuda_sm20_rcp...``) and the kernel's own mangled name where
its code mentions it (``RET.REL.NODEC R10 `(_ZN6gpuops...)``) are ignored. --loose also ignores the
offsets of kernel-parameter (constant bank 0) reads: a kernel that gained a parameter but runs
the same instructions compares equal.
Needs nvdisasm (pip: nvidia-cuda-nvdisasm; 13.x no longer reads sm_61 cubins).
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_sass import disassemble  # noqa: E402


_INTERNAL = re.compile(r"__internal_\d+_")
_PARAM = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")


def _kernels(root: Path, entry_target: dict, loose: bool) -> dict:
    """{source-level name: [normalized instruction text]}"""
    image = (root / entry_target["file"]).read_bytes()
    by_mangled = {m: e for e, m in entry_target["lowered"].items()}
    out = {}
    for name, insns in disassemble(image).items():
        # (a kernel's own mangled name appears in its code, e.g. RET.REL.NODEC `(name): a
        # renamed kernel compares equal when only that differs)
        texts = [_INTERNAL.sub("__internal_", t).replace(name, "<self>") for _, t in insns]
        if loose:
            texts = [_PARAM.sub("c[0x0][param]", t) for t in texts]
        out[by_mangled.get(name, name)] = texts
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--modules", help="comma-separated module names (default: all in both)")
    ap.add_argument("--show", type=int, default=0, help="print up to N differing lines per kernel")
    ap.add_argument("--loose", action="store_true", help="ignore kernel-parameter offsets")
    ap.add_argument("--rename", nargs=2, metavar=("REGEX", "REPL"),
                    help="rewrite the after bundle's kernel names (re.sub) before matching, for a "
                         "change that only renamed kernels (e.g. a template parameter added)")
    args = ap.parse_args(argv)
    roots = Path(args.before), Path(args.after)
    mans = [json.loads((r / "manifest.json").read_text())["modules"] for r in roots]
    names = args.modules.split(",") if args.modules else sorted(set(mans[0]) & set(mans[1]))
    changed_any = False
    for name in names:
        if name not in mans[0] or name not in mans[1]:
            print(f"{name}: not in {'before' if name not in mans[0] else 'after'}")
            continue
        for label in sorted(set(mans[0][name]["targets"]) | set(mans[1][name]["targets"])):
            targets = [m[name]["targets"].get(label) for m in mans]
            if None in targets or not targets[0]["file"].endswith(".cubin"):
                continue
            before, after = (_kernels(r, t, args.loose) for r, t in zip(roots, targets))
            if args.rename:
                after = {re.sub(args.rename[0], args.rename[1], k): v for k, v in after.items()}
            same = sorted(k for k in before if k in after and before[k] == after[k])
            diff = sorted(k for k in before if k in after and before[k] != after[k])
            gone = sorted(set(before) - set(after))
            new = sorted(set(after) - set(before))
            changed_any |= bool(diff or gone)
            print(f"{name} {label}: {len(same)} identical, {len(diff)} changed, "
                  f"{len(gone)} removed, {len(new)} new")
            for k in diff:
                a, b = before[k], after[k]
                print(f"  changed {k}: {len(a)} -> {len(b)} instructions")
                if args.show:
                    lines = [ln for ln in difflib.unified_diff(a, b, lineterm="", n=0)
                             if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
                    for ln in lines[:args.show]:
                        print("    " + ln)
            for k in gone:
                print(f"  removed {k}")
    return 1 if changed_any else 0


if __name__ == "__main__":
    sys.exit(main())
