"""Command line: ``python -m gpuops info | list | bench | build | cache``."""
from __future__ import annotations

import argparse
import os
import sys


def _csv(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def _shape(text):
    try:
        return tuple(int(t) for t in _csv(text.replace("x", ",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants integers like 4096,4096, got {text!r}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="device, arch, NVRTC, cache and bundle")
    sub.add_parser("list", help="every op with its dtypes")

    b = sub.add_parser("bench", help="check every op against its reference and time it")
    b.add_argument("--ops", type=_csv, help="comma-separated op names (default: all)")
    b.add_argument("--shape", type=_shape, help="e.g. 4096,4096 (default: each op's own)")
    b.add_argument("--dtype", type=_csv, help="comma-separated: float32,float16,bfloat16")
    b.add_argument("--json", help="also write the rows (with GPU, date, versions) to this file")
    b.add_argument("--runtime", action="store_true",
                   help="also measure host dispatch overhead and module load/compile times")
    b.add_argument("--no-peer", action="store_true", help="skip the peers (torch, Liger, ...)")
    b.add_argument("--compile", action="store_true",
                   help="also time torch.compile peers (compiles each op/dtype/shape: slow)")
    b.add_argument("--all-shapes", action="store_true",
                   help="also each op's extra shapes (long rows, decode sizes, ...)")
    b.add_argument("--family", type=_csv, help="only these op families, e.g. elementwise")
    b.add_argument("--graph", action="store_true",
                   help="time GPU work per call from CUDA-graph replay (gpuops and peers), the "
                        "per-call eager time beside it: what a captured model sees")

    bl = sub.add_parser("build", help="compile every kernel module without a GPU into a bundle")
    bl.add_argument("--arch", type=_csv, default=["61", "70", "75", "80", "86", "89", "90"],
                    help="archs, e.g. 61,75,80,86,89,90 (90a for arch-specific modules)")
    bl.add_argument("--kind", choices=["ptx", "cubin", "both"], default="both",
                    help="PTX (runs on the arch and newer, JIT by the driver), cubin (exactly that "
                         "arch), or both (default)")
    bl.add_argument("--modules", type=_csv, help="module names (default: all)")
    bl.add_argument("--out", required=True, help="output directory")
    bl.add_argument("--stale", action="store_true",
                    help="keep the images of an existing bundle in --out that are still current "
                         "(same NVRTC, module unchanged); compile only the others")
    bl.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                    help="parallel compile processes (default: all cores)")

    c = sub.add_parser("cache", help="show or clear the disk cache of compiled kernels")
    c.add_argument("action", choices=["show", "clear"])

    args = parser.parse_args(argv)
    if args.command == "info":
        from gpuops import info  # noqa: PLC0415
        print(info())
    elif args.command == "list":
        from gpuops import list_ops  # noqa: PLC0415
        for item in list_ops():
            print(item)
    elif args.command == "bench":
        from gpuops import bench  # noqa: PLC0415
        result = bench.run(ops=args.ops, shape=args.shape, dtypes=args.dtype, json_path=args.json,
                           runtime=args.runtime, peer=not args.no_peer, compile_peer=args.compile,
                           all_shapes=args.all_shapes, families=args.family,
                           graph=args.graph)
        return 0 if all(r["ok"] for r in result["rows"]) else 1
    elif args.command == "build":
        return _build(args)
    elif args.command == "cache":
        from gpuops.runtime.cache import DiskCache  # noqa: PLC0415
        cache = DiskCache()
        if args.action == "clear":
            print(f"removed {cache.clear()} files from {cache.root}")
        else:
            files = sorted(cache.dir.glob("*")) if cache.dir.is_dir() else []
            print(f"{cache.root}: {len(files)} files, "
                  f"{sum(f.stat().st_size for f in files) / 2**20:.1f} MiB")
    return 0


def _build(args) -> int:
    from gpuops.runtime import bundle, modules  # noqa: PLC0415
    from gpuops.runtime.nvrtc import Target  # noqa: PLC0415
    kinds = ["ptx", "cubin"] if args.kind == "both" else [args.kind]
    targets = [Target(Target.parse(a).arch, k, Target.parse(a).suffix)
               for a in args.arch for k in kinds]
    mods = [modules.get_module(n) for n in args.modules] if args.modules else None
    manifest = bundle.build(args.out, targets, mods, jobs=args.jobs, only_stale=args.stale)
    worst = []
    for name, entry in manifest["modules"].items():
        for label, info in entry["targets"].items():
            for kernel, r in info["resources"].items():
                if r["spill_stores"] or r["spill_loads"]:
                    worst.append(f"{name} {label} {kernel}: {r['spill_stores']} B spill stores")
    n = sum(len(e["targets"]) for e in manifest["modules"].values())
    print(f"wrote {n} images of {len(manifest['modules'])} modules to {args.out} "
          f"(NVRTC {manifest['nvrtc_version']})")
    for w in worst:
        print("warning: spills:", w, file=sys.stderr)
    return 0
