"""Profile gpuops' per-call host work without a GPU: the torch path is forced onto CPU tensors,
module loading and the driver launch are stubbed (the argument packing still runs). Prints the
microseconds per call and a cProfile of the hot path.

    python benchmarks/experiments/dispatch_profile.py [--gemm]

--gemm: the linear / matmul launch path on a pretend H100 (sm_90, 132 SMs; tensor maps stubbed)
instead of relu's; on a GPU's host, benchmarks/experiments/gemm_host_overhead.py measures the same
calls for real.
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
        self._smem_limit = 1 << 30     # never raised: no cupy.RawKernel behind it
        self._by_pointers = spec.needs_pointers


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
    loader.kernel = lambda m, dev, expr: loader.load(m, dev).kernel(expr)
    elementwise.loader = types.SimpleNamespace(load=loader.load, generation=0)
    elementwise._strided_blocks[0] = 132 * 8


def per_call_us(fn, n=20000):
    for _ in range(200):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def install_gemm_fakes():
    """A pretend H100 for gpuops.ops.gemm: arch, SM count and properties, tensor maps."""
    from gpuops.ops import gemm  # noqa: PLC0415
    from gpuops.runtime import tma  # noqa: PLC0415
    info = device.DeviceInfo(0, "pretend H100", 90, 132, 80 << 30, 50 << 20, 232448)
    device.device_info = lambda dev: info
    device.sm_count = lambda dev: info.sm_count
    gemm.effective_arch = lambda dev: info.cc
    tma.encode_tiled = lambda *args, **kw: bytes(128)


def profile(fn, n=20000, rows=14):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(rows)


def main_gemm():
    install_gemm_fakes()
    x16 = torch.randn(16, 2048).to(torch.bfloat16)
    w = torch.randn(6144, 2048).to(torch.bfloat16)
    a = torch.randn(256, 256).to(torch.bfloat16)
    bias = torch.randn(256).to(torch.bfloat16)
    print(f"torch.empty (cpu)            {per_call_us(lambda: torch.empty((256, 256), dtype=torch.bfloat16), 5000):6.2f} us")
    print(f"linear 16x6144x2048 (decode) {per_call_us(lambda: go.linear(x16, w), 5000):6.2f} us")
    print(f"linear 256^3 (wgmma)         {per_call_us(lambda: go.linear(a, a), 5000):6.2f} us")
    print(f"linear 256^3 + bias, gelu    {per_call_us(lambda: go.linear(a, a, bias, activation='gelu'), 5000):6.2f} us")
    print(f"matmul 256^3                 {per_call_us(lambda: go.matmul(a, a), 5000):6.2f} us")
    profile(lambda: go.linear(a, a), n=5000, rows=20)


if __name__ == "__main__":
    install_fakes()
    if "--gemm" in sys.argv:
        main_gemm()
        sys.exit(0)
    x = torch.randn(1024)
    y = torch.empty_like(x)
    print(f"torch.empty (cpu)        {per_call_us(lambda: torch.empty((1024,), dtype=torch.float32)):6.2f} us")
    print(f"gpuops.relu(x)           {per_call_us(lambda: go.relu(x)):6.2f} us")
    print(f"gpuops.relu(x, out=y)    {per_call_us(lambda: go.relu(x, out=y)):6.2f} us")
    print(f"gpuops.silu_mul(x, x)    {per_call_us(lambda: go.silu_mul(x, x)):6.2f} us")
    profile(lambda: go.relu(x))
