"""qk_norm_rotary's forward kernels side by side: fwd2 (one row per lane, one-shot blocks), fwd3
(persistent grid, each lane's next row loaded before the current one is reduced and stored) and
fwd4 (fwd2's blocks at 48 registers: weight and table words read after the reduction), with
apply_rotary on the same tensors (same bytes: the calibration), torch eager,
torch.compile and Liger (rms_norm + rope), in one process. GPU time per call from CUDA-graph
replay; % of the copy bandwidth measured here. (benchmarks/notes_rotary.md, "fwd3", "fwd4")

    python benchmarks/experiments/qk_norm_forward.py [--json F] [--no-compile] [--probes]
"""
from __future__ import annotations

import argparse

import torch

import gpuops as go
from gpuops import dtypes as dt
from gpuops.bench import _Framework, graph_replay_us, write_experiment_json
from gpuops.ops import rotary as R
from gpuops.runtime.modules import KernelModule

# Diagnostic builds of fwd3 (wrong results, timing only): kProbe bit 1 = no shuffles, 2 = no
# weights, 4 = no cos/sin loads and rotation. Which part of the row's work the time follows.
PROBES = {"fwd3 no shuffles": 1, "fwd3 no weights": 2, "fwd3 no rotation": 4,
          "fwd3 no shuffles/weights/rotation": 7}
PROBE_MODULE = KernelModule("experiments.qk_norm_probe", "rotary/qk_norm_rope.cu", {
    f"gpuops::qk_norm_rope_fwd3<{d.ctype}, {d.ctype}, {16 // d.itemsize}, {p}>": R.NORM_KERNEL_ARGS
    for d in dt.FLOATS for p in PROBES.values()}, archs=("90",))
_probe = {"bit": 0}
_real_kernel = R._kernel


def _kernel(module, dev, expr):
    if _probe["bit"] and "qk_norm_rope_fwd3<" in expr:
        return _real_kernel(PROBE_MODULE, dev, expr[:-1] + f", {_probe['bit']}>")
    return _real_kernel(module, dev, expr)


R._kernel = _kernel

KINDS = ("fwd2", "fwd3", "fwd4")
SHAPES = [(4, 4096, 32, 8, 128),      # the bench's prefill shape (Qwen3-8B heads)
          (4, 4096, 16, 8, 128),      # Qwen3-1.7B / Qwen3-VL-2B heads
          (16, 1, 32, 8, 128)]        # decode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--probes", action="store_true", help="also fwd3's probe builds (run 64)")
    args = ap.parse_args()
    # the bench's own copy figure: runs 63-64 used a graph-replayed copy of unfilled buffers
    # here and read 2436 GB/s, against 3001-3003 from this one in every run (cause not measured)
    bw = _Framework().copy_bandwidth_gbps()
    print(f"copy {bw:.0f} GB/s (read + write); {torch.cuda.get_device_name()}")
    rows = []
    compiled = torch.compile(R._torch_qk_norm_rope, dynamic=False) if not args.no_compile else None
    try:
        liger = R._liger_qk_norm_rope()["liger (rms_norm + rope)"]
    except ImportError:
        liger = None
    for shape in SHAPES:
        b, s, hq, hk, d = shape
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            q = torch.randn((b, s, hq, d), device="cuda", dtype=dtype)
            k = torch.randn((b, s, hk, d), device="cuda", dtype=dtype)
            wq = (torch.randn(d, device="cuda") * 0.2 + 1).to(dtype)
            wk = (torch.randn(d, device="cuda") * 0.2 + 1).to(dtype)
            ang = torch.randn((s, d // 2), device="cuda", dtype=torch.float64)
            cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)      # HF [S, D] tables
            sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
            nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
            floor = nbytes / (bw * 1e9) * 1e6
            fns = {}
            for kind in KINDS:
                def ours(kind=kind):
                    R.QK_NORM_FORWARD = kind
                    return go.qk_norm_rotary(q, k, wq, wk, cos, sin)
                fns[kind] = ours
            if args.probes and shape[1] > 1:
                for name, bit in PROBES.items():
                    def probe(bit=bit):
                        R.QK_NORM_FORWARD, _probe["bit"] = "fwd3", bit
                        try:
                            return go.qk_norm_rotary(q, k, wq, wk, cos, sin)
                        finally:
                            _probe["bit"] = 0
                    fns[name] = probe
            fns["apply_rotary (same bytes)"] = lambda: go.apply_rotary(q, k, cos, sin)
            fns["torch"] = lambda: R._torch_qk_norm_rope(q, k, wq, wk, cos, sin)
            if compiled is not None:
                fns["torch.compile"] = lambda: compiled(q, k, wq, wk, cos, sin)
            if liger is not None:
                fns["liger"] = lambda: liger(q, k, wq, wk, cos, sin)
            # every kind must agree with fwd2 bit for bit before anything is timed
            outs = {kind: fns[kind]() for kind in KINDS}
            same = all(torch.equal(x, y) for kind in KINDS[1:]
                       for x, y in zip(outs[kind], outs["fwd2"]))
            outs.clear()
            res = {}
            for name, fn in fns.items():
                try:
                    res[name] = graph_replay_us(fn, calls=20, replays=20)
                except Exception as exc:  # a peer that cannot run is reported, not fatal
                    res[name] = f"failed: {type(exc).__name__}: {str(exc)[:100]}"
            R.QK_NORM_FORWARD = "auto"
            dn = str(dtype).replace("torch.", "")
            line = "  ".join(f"{n} {v:.1f} ({100 * floor / v:.1f}%)" if isinstance(v, float)
                             else f"{n} {v}" for n, v in res.items())
            print(f"{str(shape):<24}{dn:<9} floor {floor:.1f} us  {line}  kinds==fwd2 {same}")
            rows.append({"shape": list(shape), "dtype": dn, "bytes": nbytes, "floor_us": floor,
                         "us": res, "kinds_equal_fwd2": same})
            fns.clear()
            torch.cuda.empty_cache()
    if args.json:
        write_experiment_json(args.json, bw, rows)


if __name__ == "__main__":
    main()
