"""group_norm(+SiLU): kernel time of every design (old and round 2) and per-call host time.

Answers (1) what the kernels take on the GPU (each variant called REPS times inside one CUDA
graph, replays timed with CUDA events), (2) what a call costs on the host (CUDA events around
single eager calls, as `python -m gpuops bench` times them: when "eager" >> "graph" the bench row
measures the host), (3) which kernels and launch shape each variant ran (grid x block, dynamic
shared memory), and (4) what a plain pass over the same bytes costs in the same graph method
(calibration rows: torch copy of the input, gpuops.silu of it), i.e. the ceiling at this size.

Variants (gpuops.ops.group_norm knobs), NCHW: auto = the default plan; onchip = no clusters (one
block per group); cluster2/4/8 = forced cluster size; cluster2_1sm = cluster2 with a shared-memory
reservation that keeps a second block off each SM (tests the placement hypothesis of
notes_groupnorm_copy.md round 2); twopass / twopass_fwd = the two-kernel path (reverse / old
forward apply order); spread = group_norm_spread (round 2) with its own plan; spread_c1/2/4/8 =
with a forced cluster size; spread_r1/r2 = with a forced number of blocks per SM; auto_spread =
auto with AUTO_SPREAD; stream = group_norm_stream (round 3, persistent) with its own plan;
stream_c1/2/4/8 = with a forced cluster size; stream_n<k> = at most k clusters; auto_stream = auto
with AUTO_STREAM; auto4 / auto3 / auto2 = auto with AUTO_RULE = 4 (the default since run 124) /
3 / 2 (round 2's); resident
= group_norm_resident (round 4: the input held on chip over the whole grid, where it fits; else
auto's plan) and auto_resident = auto with AUTO_RESIDENT. Channels-last:
auto; nhwc / nhwc_fwd = the two-pass NHWC kernels (reverse / forward apply order); nhwc_copy =
through NCHW copies; nhwc_spread (round 2), nhwc_spread_c2/4/8, nhwc_spread_r1/r2; auto_spread;
nhwc_resident (group_norm_nhwc_resident: runs of whole rows held on chip over the grid, where the
input fits), nhwc_resident_r1/r2 (1 / 2 blocks per SM); auto_nhwc4 = auto with
AUTO_NHWC_RESIDENT = False (rule 4's channels-last choice, before the resident kernel).
Peers: torch eager (F.silu(F.group_norm)), Liger when installed (NCHW), torch.compile with
--compile (slow to compile). --variants, --no-nhwc and --nhwc-only narrow the run.

Shapes (the bench's): [2, 320, 64, 64] (the diffusion shape; --quick: this one only),
[8, 640, 64, 64] (84 MB in 16-bit), [4, 1280, 32, 32] and [16, 640, 32, 32], each NCHW and
channels-last; [1, 256, 256, 256] (32 groups of 1 MiB in 16-bit) NCHW only. --shapes picks some
by index.

    python benchmarks/experiments/group_norm_variants.py [--json F] [--compile] [--quick]
        [--shapes 0,2]
"""
from __future__ import annotations

import argparse
import json
import re
import time

import torch
import torch.nn.functional as F  # noqa: N812

import gpuops as go
from gpuops.ops import group_norm as GN
from gpuops.bench import event_pairs_ms, graph_replay_us

REPS = 20
# (NCHW shape, also timed channels-last)
SHAPES = (((2, 320, 64, 64), True), ((8, 640, 64, 64), True), ((4, 1280, 32, 32), True),
          ((1, 256, 256, 256), False), ((16, 640, 32, 32), True))

NCHW_VARIANTS = ("auto", "onchip", "cluster2", "cluster4", "cluster8", "cluster2_1sm", "twopass",
                 "twopass_fwd", "spread", "spread_c1", "spread_c2", "spread_c4", "spread_c8",
                 "spread_r1", "spread_r2", "auto_spread", "stream", "stream_c1", "stream_c2",
                 "stream_c4", "stream_c8", "stream_n16", "stream_n32", "stream_n48",
                 "auto_stream", "auto4", "auto3", "auto2", "resident", "auto_resident")
NHWC_VARIANTS = ("auto", "nhwc", "nhwc_fwd", "nhwc_copy", "nhwc_spread", "nhwc_spread_c2",
                 "nhwc_spread_c4", "nhwc_spread_c8", "nhwc_spread_r1", "nhwc_spread_r2",
                 "auto_spread", "auto2", "nhwc_resident", "nhwc_resident_r1",
                 "nhwc_resident_r2", "auto_nhwc4")


def graph_us(fn, reps=REPS, replays=20):
    return graph_replay_us(fn, calls=reps, replays=replays)


def eager_us(fn, iters=30):
    """As gpuops.bench: CUDA events around each call (host-bound calls measure the host)."""
    return event_pairs_ms(fn, iters=iters) * 1e3


def host_us(fn, iters=200):
    """Wall time per call, back to back, no sync inside (the host's share)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6


def copy_gbps():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_us(lambda: dst.copy_(src), reps=5, replays=10)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def set_variant(v):
    """The module knobs of variant v (every knob reset first)."""
    GN.force_path, GN.apply_order = None, "reverse"
    GN.AUTO_SPREAD, GN.spread_cluster, GN.spread_residency = False, None, None
    GN.AUTO_STREAM, GN.AUTO_RULE, GN.stream_clusters = False, 4, None
    GN.AUTO_RESIDENT, GN.AUTO_NHWC_RESIDENT, GN.nhwc_resident_per_sm = False, True, None
    m = re.fullmatch(r"(.+)_([crn])(\d+)", v)         # spread_c4, nhwc_spread_r2, stream_n32 ...
    base = m.group(1) if m else v
    if base in ("onchip", "cluster2", "cluster4", "cluster8", "cluster2_1sm", "twopass", "nhwc",
                "nhwc_copy", "spread", "nhwc_spread", "stream", "resident", "nhwc_resident"):
        GN.force_path = base
    elif base == "twopass_fwd":
        GN.force_path, GN.apply_order = "twopass", "forward"
    elif base == "nhwc_fwd":
        GN.force_path, GN.apply_order = "nhwc", "forward"
    elif base == "auto_spread":
        GN.AUTO_SPREAD = True
    elif base == "auto_stream":
        GN.AUTO_STREAM = True
    elif base == "auto_resident":
        GN.AUTO_RESIDENT = True
    elif base == "auto_nhwc4":
        GN.AUTO_NHWC_RESIDENT = False
    elif base == "auto4":
        GN.AUTO_RULE = 4
    elif base == "auto3":
        GN.AUTO_RULE = 3
    elif base == "auto2":
        GN.AUTO_RULE = 2
    elif base != "auto":
        raise ValueError(v)
    if m and m.group(2) == "c":
        GN.spread_cluster = int(m.group(3))
    elif m and m.group(2) == "n":
        GN.stream_clusters = int(m.group(3))
    elif m and base == "nhwc_resident":
        GN.nhwc_resident_per_sm = int(m.group(3))
    elif m:
        GN.spread_residency = int(m.group(3))


class LaunchLog:
    """Records the group_norm kernels a call launches (name, grid, block, dynamic smem)."""

    def __init__(self):
        self.launches = []
        self._get = GN.KERNELS.get
        self._get_resident = GN.RESIDENT_KERNELS.get

    def __enter__(self):
        log, get = self.launches, self._get

        class Spy:
            def __init__(self, k, expr):
                self.k, self.expr = k, expr

            def __getattr__(self, name):      # (max_active_clusters, ...: the plan asks)
                return getattr(self.k, name)

            def launch(self, grid, block, stream, *args, smem=0):
                log.append(f"{self.expr.split('::')[-1]} {grid[0]}x{block[0]}"
                           f"{f' smem {smem // 1024}K' if smem else ''}")
                return self.k.launch(grid, block, stream, *args, smem=smem)
        GN.KERNELS.get = lambda dev, expr: Spy(get(dev, expr), expr)
        get_resident = self._get_resident
        GN.RESIDENT_KERNELS.get = lambda dev, expr: Spy(get_resident(dev, expr), expr)
        return self

    def __exit__(self, *exc):
        GN.KERNELS.get = self._get
        GN.RESIDENT_KERNELS.get = self._get_resident
        return False


def resident_clusters(x, td):
    """cuOccupancyMaxActiveClusters of group_norm_stream at each cluster size, as launched (384
    threads, two blocks per SM's shared-memory reservation)."""
    dev = torch.cuda.current_device()
    d = {torch.bfloat16: GN.dt.bfloat16, torch.float16: GN.dt.float16,
         torch.float32: GN.dt.float32}[td]
    smem = GN.spread_smem(16 * (10 + GN.SPREAD_PACKS * 384) + 64, 2, GN._smem_optin(dev))
    got = []
    for s in (2, 4, 8):
        k = GN.KERNELS.get(dev, GN._spread_expr("stream", d, s))
        got.append(f"S={s}: {k.max_active_clusters((264, 1, 1), (384, 1, 1), smem)}")
    return f"resident stream clusters (384 threads, smem {smem // 1024}K): " + ", ".join(got)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the default shape only")
    ap.add_argument("--shapes", help="comma-separated indices into SHAPES")
    ap.add_argument("--variants", help="comma-separated: only these of the variants")
    ap.add_argument("--no-nhwc", action="store_true", help="NCHW inputs only")
    ap.add_argument("--nhwc-only", action="store_true", help="channels-last inputs only")
    args = ap.parse_args()
    bw = copy_gbps()
    print(f"copy {bw:.0f} GB/s (read + write)", flush=True)
    try:
        from liger_kernel.ops.group_norm import LigerGroupNormFunction  # noqa: PLC0415
    except ImportError:
        LigerGroupNormFunction = None  # noqa: N806
    rows = []

    def torch_gn(x, w, b):
        return F.silu(F.group_norm(x, 32, w, b))

    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.shapes:
        shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    cases = []
    for shape, with_nhwc in shapes:
        if not args.nhwc_only:
            cases.append((shape, ("bfloat16", "float16", "float32"), False, NCHW_VARIANTS))
        if with_nhwc and not args.no_nhwc:
            cases.append((shape, ("bfloat16", "float32"), True, NHWC_VARIANTS))
    for shape, dtypes, nhwc, variants in cases:
        for dtype in dtypes:
            td = getattr(torch, dtype)
            x = torch.randn(shape, device="cuda", dtype=td)
            if nhwc:
                x = x.contiguous(memory_format=torch.channels_last)
            w = torch.randn(shape[1], device="cuda", dtype=td)
            b = torch.randn(shape[1], device="cuda", dtype=td)
            nbytes = 2 * x.numel() * x.element_size()
            floor = nbytes / (bw * 1e9) * 1e6
            ref = torch_gn(x.float(), w.float(), b.float())
            name = f"group_norm{'/cl' if nhwc else ''} {tuple(shape)} {dtype}"
            print(f"{name}: floor {floor:.1f} us ({nbytes / 1e6:.1f} MB)", flush=True)

            def line(label, fn, eager=False, plan=""):
                try:
                    g = graph_us(fn)
                    extra = ""
                    if eager:
                        extra = f"  eager(bench-style) {eager_us(fn):7.1f} us  host {host_us(fn):6.1f} us"
                    print(f"  {label:<16} graph {g:7.1f} us  {100 * floor / g:5.1f}% copy{extra}"
                          f"{'  [' + plan + ']' if plan else ''}", flush=True)
                    rows.append({"case": name, "variant": label, "graph_us": g,
                                 "pct_copy": 100 * floor / g, "floor_us": floor, "plan": plan})
                except Exception as exc:  # noqa: BLE001  (a variant that cannot run is reported)
                    print(f"  {label:<16} failed: {type(exc).__name__}: {str(exc)[:150]}",
                          flush=True)
                    rows.append({"case": name, "variant": label, "error": str(exc)[:300]})

            if any(v.startswith("stream") for v in variants):
                print("  " + resident_clusters(x, td), flush=True)
            for v in variants:
                if args.variants and v not in args.variants.split(","):
                    continue
                set_variant(v)
                try:
                    with LaunchLog() as log:
                        y = go.group_norm(x, 32, w, b, activation="silu")
                    err = (y.float() - ref).abs().max().item()
                    tol = 1e-4 if dtype == "float32" else 0.1
                    if not err <= tol:
                        print(f"  {v:<16} WRONG: max abs err {err:.3g}", flush=True)
                        rows.append({"case": name, "variant": v, "error": f"wrong: {err:.3g}"})
                        continue
                except Exception as exc:  # noqa: BLE001
                    print(f"  {v:<16} failed: {type(exc).__name__}: {str(exc)[:150]}", flush=True)
                    rows.append({"case": name, "variant": v, "error": str(exc)[:300]})
                    continue
                line(v, lambda: go.group_norm(x, 32, w, b, activation="silu"), eager=v == "auto",
                     plan="; ".join(log.launches))
            set_variant("auto")
            line("torch", lambda: torch_gn(x, w, b), eager=True)
            if LigerGroupNormFunction is not None and not nhwc:
                line("liger", lambda: F.silu(LigerGroupNormFunction.apply(
                    x, w, b, shape[1], 32, 1e-5)))
            if args.compile:
                torch._dynamo.reset()      # (else the 9th case hits the recompile limit: eager)
                cfn = torch.compile(torch_gn, dynamic=False)
                line("torch.compile", lambda: cfn(x, w, b))
            # calibration: one plain pass over the same bytes in the same graph method
            line("[copy x]", lambda: x.clone())
            if not nhwc:
                line("[gpuops.silu x]", lambda: go.silu(x))
            del x, w, b, ref
            torch.cuda.empty_cache()
    set_variant("auto")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
