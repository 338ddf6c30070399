"""Where the host time of one gpuops call goes, on a GPU: each step of the torch path timed
alone (back to back, 1024-element tensors), then a cProfile of the whole call.

Run 1 (2026-11-22) measured gpuops.relu at 45 us against a bare CuPy launch at 8 us, while the
same Python work with the GPU stubbed out (dispatch_profile.py) took about 20 us on the CPU
machine: this script finds the other ~25 us.
"""
from __future__ import annotations

import cProfile
import json
import pstats
import sys
import time

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import torch  # noqa: E402

import gpuops as go  # noqa: E402
from gpuops.ops import elementwise as ew  # noqa: E402
from gpuops import dtypes as dt  # noqa: E402
from gpuops.runtime import device  # noqa: E402


def per_call_us(fn, n=5000):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)
    go.relu(x)
    k = ew._RELU.kernel(0, dt.float32, True)
    stream = torch.cuda.current_stream().cuda_stream
    import cupy as cp
    rt = cp.cuda.runtime
    res = {
        "torch.empty": per_call_us(lambda: torch.empty((1024,), dtype=torch.float32, device="cuda")),
        "torch.relu": per_call_us(lambda: torch.relu(x)),
        "cupy getDevice": per_call_us(lambda: rt.getDevice()),
        "torch raw stream": per_call_us(lambda: torch._C._cuda_getCurrentRawStream(0)),
        "make_current": per_call_us(lambda: device.make_current(0)),
        "Kernel.launch": per_call_us(lambda: k.launch((1, 1, 1), (256, 1, 1), stream, 0.0, 0.0, 0.0,
                                                       0.0, y.data_ptr(), x.data_ptr(), 0, 0, 0,
                                                       0, 0, 1024)),
        "gpuops.relu(x, out=y)": per_call_us(lambda: go.relu(x, out=y)),
        "gpuops.relu(x)": per_call_us(lambda: go.relu(x)),
        "gpuops.silu_mul(x, x)": per_call_us(lambda: go.silu_mul(x, x)),
    }
    for name, us in res.items():
        print(f"{name:<26}{us:8.2f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5000):
        go.relu(x)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(16)
    if len(sys.argv) > 2 and sys.argv[1] == "--json":
        with open(sys.argv[2], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
