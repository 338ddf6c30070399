"""Profile gpuops' per-call host work without a GPU: the torch path is forced onto CPU tensors,
module loading and the driver launch are stubbed (the argument packing still runs). Prints the
microseconds per call and a cProfile of the hot path.

    python benchmarks/experiments/dispatch_profile.py
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time
import types

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import torch  # noqa: E402

import gpuops as go  # noqa: E402
from gpuops import dispatch  # noqa: E402
from gpuops.ops import elementwise  # noqa: E402
from gpuops.runtime import device, launch, loader  # noqa: E402


class FakeKernel(launch.Kernel):
    def __init__(self, spec):  # noqa: D107  (no cupy)
        self.name, self.ptr, self.spec, self.raw = "fake", 1, spec, None
        self._launch = lambda *a: None


class FakeModule:
    def __init__(self, module):
        self.module = module
        self.kernels = {}

    def kernel(self, expr):
        k = self.kernels.get(expr)
        if k is None:
            k = self.kernels[expr] = FakeKernel(self.module.kernels[expr])
        return k


def install_fakes():
    fakes = {}
    dispatch._device_of = lambda kind, x, op, name: 0 if kind == dispatch.TORCH else -1
    device.make_current = lambda dev: None
    torch._C._cuda_getCurrentRawStream = lambda dev: 0
    dispatch._torch_devices[0] = torch.device("cpu")
    loader.load = lambda m, dev: fakes.setdefault(m.name, FakeModule(m))
    elementwise.loader = types.SimpleNamespace(load=loader.load, generation=0)
    elementwise._strided_blocks[0] = 132 * 8


def per_call_us(fn, n=20000):
    for _ in range(200):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


if __name__ == "__main__":
    install_fakes()
    x = torch.randn(1024)
    y = torch.empty_like(x)
    print(f"torch.empty (cpu)        {per_call_us(lambda: torch.empty((1024,), dtype=torch.float32)):6.2f} us")
    print(f"gpuops.relu(x)           {per_call_us(lambda: go.relu(x)):6.2f} us")
    print(f"gpuops.relu(x, out=y)    {per_call_us(lambda: go.relu(x, out=y)):6.2f} us")
    print(f"gpuops.silu_mul(x, x)    {per_call_us(lambda: go.silu_mul(x, x)):6.2f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20000):
        go.relu(x)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
