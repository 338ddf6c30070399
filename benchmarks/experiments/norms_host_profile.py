"""Host time per call of the norms ops without a GPU (dispatch_profile.py's fakes: CPU torch
tensors, stubbed module loading and driver launch; argument packing still runs). One line per
op: microseconds per call at [16, 2048] bf16, then a cProfile of the slowest.

    python benchmarks/experiments/norms_host_profile.py [--json out.json]
"""
from __future__ import annotations

import cProfile
import json
import pstats
import sys
import types

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])

import torch  # noqa: E402

import dispatch_profile as dp  # noqa: E402
import gpuops as go  # noqa: E402
from gpuops.ops import norms  # noqa: E402
from gpuops.runtime import device  # noqa: E402


def main():
    dp.install_fakes()
    dp.FakeKernel._smem_limit = 1 << 30
    norms._occupancy = lambda ptr, threads, smem: 4
    device.device_info = lambda dev: types.SimpleNamespace(sm_count=132)
    d = torch.bfloat16
    x, r, g = (torch.randn(16, 2048, dtype=d) for _ in range(3))
    w = torch.randn(2048, dtype=d)
    b = torch.randn(2048, dtype=d)
    st = torch.rand(16, dtype=torch.float32) + 0.5
    cases = {
        "rms_norm": lambda: go.rms_norm(x, (2048,), w, 1e-6),
        "rms_norm eps=None": lambda: go.rms_norm(x, (2048,), w),
        "layer_norm": lambda: go.layer_norm(x, (2048,), w, b, 1e-5),
        "add_rms_norm": lambda: go.add_rms_norm(x, r, w, 1e-6),
        "rms_norm_backward": lambda: go.rms_norm_backward(g, x, st, (2048,), w),
        "layer_norm_backward": lambda: go.layer_norm_backward(g, x, st, st, (2048,), w),
        "add_rms_norm_backward": lambda: go.add_rms_norm_backward(g, g, x, st, w),
        "relu (reference)": lambda: go.relu(x),
    }
    res = {}
    for name, fn in cases.items():
        res[name] = dp.per_call_us(fn, n=5000)
        print(f"{name:24s} {res[name]:7.2f} us/call (host, CPU fakes)")
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(res, f)
    if "--profile" in sys.argv:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3000):
            cases["rms_norm_backward"]()
            cases["rms_norm"]()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
