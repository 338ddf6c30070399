"""Does apply_rotary gain from rotating in place, as Liger's rope does? (benchmarks/notes_rotary.md,
"Outcome (runs 67-68)": Liger's in-place rotation measured 111.4-111.8 us against our 115.6 at
[4, 4096, 32, 8, 128] bf16/fp16.) Times, in one process with CUDA-graph replay: apply_rotary as
shipped (new q/k outputs), the same kernel with q/k as their own outputs (rope_kernel reads an
item before writing it, so in place is safe), Liger's in-place rope, and a copy_ of the same
bytes. Diagnostic only: no in-place entry point exists yet.

    python benchmarks/experiments/rope_inplace.py [--json F]
"""
from __future__ import annotations

import argparse

import torch

import gpuops as go
from gpuops.bench import _Framework, graph_replay_us, write_experiment_json
from gpuops.ops import rotary as R

_shipped = R._rotary


def _in_place(call, op, q, k, cos, sin, interleaved, positions, rotary_dim, mrope_section,
              mrope_interleaved, sign):
    R._rope_launch(call, op, q, k, q, k, cos, sin, positions, interleaved, rotary_dim,
                   mrope_section, mrope_interleaved, sign)
    return q, k


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    bw = _Framework().copy_bandwidth_gbps()
    print(f"copy {bw:.0f} GB/s (read + write); {torch.cuda.get_device_name()}")
    try:
        liger = R._liger_rope()["liger"]
    except ImportError:
        liger = None
    rows = []
    for shape in [(4, 4096, 32, 8, 128), (4, 4096, 16, 8, 128)]:
        b, s, hq, hk, d = shape
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            q = torch.randn((b, s, hq, d), device="cuda", dtype=dtype)
            k = torch.randn((b, s, hk, d), device="cuda", dtype=dtype)
            ang = torch.randn((s, d // 2), device="cuda", dtype=torch.float64)
            cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
            sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
            # in place gives the shipped result (checked before timing)
            ref = go.apply_rotary(q, k, cos, sin)
            q2, k2 = q.clone(), k.clone()
            R._rotary = _in_place
            try:
                go.apply_rotary(q2, k2, cos, sin)
            finally:
                R._rotary = _shipped
            same = torch.equal(ref[0], q2) and torch.equal(ref[1], k2)
            qc, kc = torch.empty_like(q), torch.empty_like(k)

            def in_place():
                R._rotary = _in_place
                try:
                    return go.apply_rotary(q2, k2, cos, sin)
                finally:
                    R._rotary = _shipped
            fns = {"shipped": lambda: go.apply_rotary(q, k, cos, sin), "in place": in_place,
                   "copy_": lambda: (qc.copy_(q), kc.copy_(k))}
            if liger is not None:
                lq, lk = q.clone(), k.clone()
                fns["liger (in place)"] = lambda: liger(lq, lk, cos, sin)
            nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
            res = {n: graph_replay_us(f, calls=20, replays=20) for n, f in fns.items()}
            dn = str(dtype).replace("torch.", "")
            print(f"{str(shape):<24}{dn:<9} " + "  ".join(
                f"{n} {v:.1f} ({nbytes / v / 1e3:.0f} GB/s)" for n, v in res.items())
                + f"  in place == shipped {same}")
            rows.append({"shape": list(shape), "dtype": dn, "bytes": nbytes, "us": res,
                         "in_place_equals_shipped": same})
            torch.cuda.empty_cache()
    if args.json:
        write_experiment_json(args.json, bw, rows)


if __name__ == "__main__":
    main()
