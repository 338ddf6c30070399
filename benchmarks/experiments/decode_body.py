"""Why gpuops' decode-sized kernels take 0.3-0.6 us longer than Liger's and torch's (run 71,
benchmarks/NOTES.md "Decode-sized calls"): CUPTI kernel time of one call and per-call time in a
CUDA graph of 50 calls, for the same trivial work done by
- probe kernels compiled by NVRTC (cupy.RawModule, -std=c++17 as gpuops compiles) and launched
  (a) through gpuops' Kernel.launch (one packed parameter buffer, cuLaunchKernel `extra`) and
  (b) through CuPy's own RawKernel call (kernelParams);
- the same work in Triton (the peers' compiler), in torch (add_, copy_), and gpuops' own op.
Work, fp32 [16, 2048] (128 KB in, 128 KB out): nothing (empty kernels: the launch floor), a copy,
silu(g) * u. If the probes launched by gpuops match Triton's / CuPy's, the launch path is not the
cost and the kernels' code is; if they do not, it is the launch path.

    python benchmarks/experiments/decode_body.py [--json F]
"""
from __future__ import annotations

import argparse
import sys

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import cupy  # noqa: E402
import torch  # noqa: E402

import gpuops as go  # noqa: E402
from gpuops.bench import graph_and_body_rows, write_experiment_json  # noqa: E402
from gpuops.runtime.launch import ArgSpec, Kernel  # noqa: E402

SRC = r"""
extern "C" __global__ void empty_k() {}
extern "C" __global__ void copy4(const float4* __restrict__ x, float4* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i];
}
__device__ __forceinline__ float silu_f(float g) { return g / (1.0f + __expf(-g)); }
extern "C" __global__ void silu_mul4(const float4* __restrict__ g, const float4* __restrict__ u,
                                     float4* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const float4 a = g[i], b = u[i];
    y[i] = make_float4(silu_f(a.x) * b.x, silu_f(a.y) * b.y, silu_f(a.z) * b.z, silu_f(a.w) * b.w);
  }
}
"""
CALLS, REPLAYS, ROUNDS = 50, 20, 3
THREADS = 256


def triton_variants(g, u, y, n4):
    try:
        import triton  # noqa: PLC0415
        import triton.language as tl  # noqa: PLC0415
    except ImportError:
        return {}

    @triton.jit
    def tr_empty(x):
        pass

    @triton.jit
    def tr_copy(x, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out + offs, tl.load(x + offs, mask=m), mask=m)

    @triton.jit
    def tr_silu_mul(a, b, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        ga = tl.load(a + offs, mask=m)
        ub = tl.load(b + offs, mask=m)
        tl.store(out + offs, ga * tl.sigmoid(ga) * ub, mask=m)

    n = g.numel()
    block = 1024
    grid = (triton.cdiv(n, block),)
    return {
        "empty: triton": lambda: tr_empty[(16,)](g),
        "copy: triton": lambda: tr_copy[grid](g, y, n, BLOCK=block, num_warps=4),
        "silu_mul: triton": lambda: tr_silu_mul[grid](g, u, y, n, BLOCK=block, num_warps=4),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    g = torch.randn(16, 2048, device="cuda")
    u = torch.randn(16, 2048, device="cuda")
    y = torch.empty_like(g)
    n4 = g.numel() // 4
    grid = ((n4 + THREADS - 1) // THREADS, 1, 1)
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",), backend="nvrtc")
    raw = {name: mod.get_function(name) for name in ("empty_k", "copy4", "silu_mul4")}
    ours = {"empty_k": Kernel("empty_k", raw["empty_k"], ArgSpec()),
            "copy4": Kernel("copy4", raw["copy4"], ArgSpec("ptr", "ptr", "i32")),
            "silu_mul4": Kernel("silu_mul4", raw["silu_mul4"], ArgSpec("ptr", "ptr", "ptr", "i32"))}

    def stream():
        return torch.cuda.current_stream().cuda_stream

    def cupy_call(k, args):
        with cupy.cuda.ExternalStream(stream()):
            k(grid[:1], (THREADS,), args)

    gp, up, yp = g.data_ptr(), u.data_ptr(), y.data_ptr()
    cg, cu, cy = (cupy.from_dlpack(t) for t in (g, u, y))
    variants = {
        "empty: gpuops launch": lambda: ours["empty_k"].launch((16, 1, 1), (THREADS, 1, 1), stream()),
        "empty: cupy launch": lambda: cupy_call(raw["empty_k"], ()),
        "copy: gpuops launch": lambda: ours["copy4"].launch(grid, (THREADS, 1, 1), stream(), gp, yp, n4),
        "copy: cupy launch": lambda: cupy_call(raw["copy4"], (cg, cy, cupy.int32(n4))),
        "copy: torch copy_": lambda: y.copy_(g),
        "add_: torch": lambda: y.add_(1.0),
        "silu_mul: gpuops launch": lambda: ours["silu_mul4"].launch(grid, (THREADS, 1, 1), stream(),
                                                                    gp, up, yp, n4),
        "silu_mul: cupy launch": lambda: cupy_call(raw["silu_mul4"], (cg, cu, cy, cupy.int32(n4))),
        "silu_mul: gpuops op": lambda: go.silu_mul(g, u),
        "silu_mul: gpuops op, out=": lambda: go.silu_mul(g, u, out=y),
        "rms_norm: gpuops op": lambda: go.rms_norm(g, (2048,)),
    }
    variants.update(triton_variants(g, u, y, n4))
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction  # noqa: PLC0415
        variants["silu_mul: liger"] = lambda: LigerSiLUMulFunction.apply(g, u)
    except ImportError:
        pass
    # correctness of the probes (they are timed; a wrong probe would time the wrong work)
    ours["silu_mul4"].launch(grid, (THREADS, 1, 1), stream(), gp, up, yp, n4)
    torch.cuda.synchronize()
    ref = torch.nn.functional.silu(g) * u
    print(f"probe silu_mul max abs err {float((y - ref).abs().max()):.2e}")
    print(f"{torch.cuda.get_device_name()}; fp32 [16, 2048]; us per call")
    rows = graph_and_body_rows(variants, calls=CALLS, replays=REPLAYS, rounds=ROUNDS, width=30)
    if a.json:
        write_experiment_json(a.json, None, rows, calls=CALLS, replays=REPLAYS, rounds=ROUNDS)


if __name__ == "__main__":
    main()
