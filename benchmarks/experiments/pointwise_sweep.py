"""Tuning sweep for the pointwise kernels: packs in flight per thread (GPUOPS_POINTWISE_ILP),
and grid size (the register budget, swept in run 1, is now fixed per functor), on the two shapes of the performance
target (256 MiB per tensor, fp32 and bf16), against the device-to-device copy in the same run.

Prediction before the first run (2026-11-22): all variants within a few % of each other at
256 MiB, around 90% of the copy bandwidth; a one-wave grid (SMs x 8 blocks) as fast as a grid
covering the array once.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from gpuops import dtypes as dt  # noqa: E402
from gpuops.bench import _Framework, write_rows_json  # noqa: E402
from gpuops.ops import elementwise as ew  # noqa: E402
from gpuops.runtime import device, loader  # noqa: E402
from gpuops.runtime.modules import KernelModule  # noqa: E402

CASES = [("GatedMul<gpuops::Act::kSilu>", 2, "elementwise/gated.cu"),
         ("Activation<gpuops::Act::kSilu>", 1, "elementwise/activations.cu")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    fw = _Framework()
    torch = fw.torch
    copy = fw.copy_bandwidth_gbps()
    sms = device.device_info(0).sm_count
    rows = []
    print(f"copy {copy:.0f} GB/s")
    # (min blocks per SM is now each functor's kMinBlocks; this sweep varies the packs per thread)
    for ilp, minb in [(1, 0), (2, 0), (4, 0)]:
        for functor, nin, src in CASES:
            for d in (dt.float32, dt.bfloat16):
                vec = 16 // d.itemsize
                expr = ew._flat_expr(functor, d, nin, vec)
                m = KernelModule(f"sweep.{functor[:8]}.{nin}.{ilp}.{minb}.{d.name}", src,
                                 {expr: ew.FLAT_ARGS},
                                 options=(f"-DGPUOPS_POINTWISE_ILP={ilp}",))
                k = loader.load(m, 0).kernel(expr)
                shape = ew._rows_shape(d)
                n = int(np.prod(shape))
                ins = [fw.randn(shape, d) for _ in range(nin)]
                out = torch.empty(shape, dtype=dt.to_torch(d), device="cuda")
                ptrs = [t.data_ptr() for t in ins] + [0] * (3 - nin)
                stream = torch.cuda.current_stream().cuda_stream
                for grid_name, grid in [("wave8", sms * 8), ("wave4", sms * 4),
                                        ("cover", -(-(n // vec) // (256 * ilp)))]:
                    def launch():
                        k.launch((grid, 1, 1), (256, 1, 1), stream, 0.0, 0.0, 0.0, 0.0,
                                 out.data_ptr(), *ptrs, 0, 0, 0, n)
                    us = fw.time_us(launch, iters=30)
                    gbps = (nin + 1) * n * d.itemsize / (us * 1e-6) / 1e9
                    regs = k.raw.num_regs
                    row = dict(functor=functor, dtype=d.name, ilp=ilp, min_blocks=minb,
                               grid=grid_name, us=us, gbps=gbps, pct_copy=100 * gbps / copy,
                               registers=regs)
                    rows.append(row)
                    print(f"{functor:<32}{d.name:<10} ilp={ilp} minb={minb} {grid_name:<6}"
                          f"{us:9.1f} us {gbps:7.0f} GB/s {100 * gbps / copy:5.1f}% regs {regs}",
                          flush=True)
    write_rows_json(args.json, copy, rows)


if __name__ == "__main__":
    main()
