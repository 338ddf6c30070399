"""Backward of the gated activations (silu_mul_backward, gelu_mul_backward) and the autograd ops
gpuops.torch.silu_mul / gelu_mul.

CPU: the references against torch autograd in float64 (including NaN/inf as torch), the autograd
layer with broadcasting, the kernels compiled for the host (tests/cuda_host_emulation.py).
GPU: every activation and dtype against the references at sizes 1..2^20+3, strided, broadcast
and unaligned inputs, NaN/inf as torch, a CUDA graph, autograd against torch.
"""
from __future__ import annotations

import numpy as np
import pytest

import gpuops as go
from gpuops import dtypes as dt
from gpuops import registry
from gpuops.ops import gated_backward as GB
from conftest import HAS_TORCH, assert_close, gpu, needs_torch, needs_torch_cuda

import cuda_host_emulation as emu

torch = pytest.importorskip("torch") if HAS_TORCH else None
F = torch.nn.functional if HAS_TORCH else None
DTYPES = ["float32", "float16", "bfloat16"]
# (case id, op, kwargs, torch forward)
CASES = [
    ("silu", "silu_mul_backward", {}, lambda g, u: F.silu(g) * u),
    ("gelu", "gelu_mul_backward", {"approximate": "none"}, lambda g, u: F.gelu(g) * u),
    ("gelu_tanh", "gelu_mul_backward", {"approximate": "tanh"},
     lambda g, u: F.gelu(g, approximate="tanh") * u),
]
IDS = [c[0] for c in CASES]
SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, 100.0,
                    -100.0, 88.8, -88.8, 20.0, -20.0, 9.0, -9.0, 5.0, -5.0, 1.0, -1.0, 0.5, -0.5,
                    -0.7518, -1.2785])


def _reference(op_name, grad_output, gate, up, kwargs):
    return registry.get(op_name).reference(grad_output=grad_output, gate=gate, up=up, **kwargs)


# ------------------------------------------------------------------ CPU

@needs_torch
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_references_match_torch_autograd_float64(case, rng):
    _, op_name, kwargs, fwd = case
    x = np.concatenate([SPECIAL, rng.standard_normal(2000) * 4])
    gate = torch.from_numpy(x).requires_grad_()
    up = torch.from_numpy(rng.standard_normal(x.size)).requires_grad_()
    go_ = torch.from_numpy(rng.standard_normal(x.size))
    eg, eu = torch.autograd.grad((fwd(gate, up) * go_).sum(), (gate, up))
    dg, du = _reference(op_name, go_.numpy(), x, up.detach().numpy(), kwargs)
    # Both sides round in float64, and their formulas differ: the derivative's terms reach
    # |x| * |du/dx| ~ |x| (1 + 0.134 x^2) (tanh's argument is 0.798 (x + 0.0447 x^3)) while the
    # result can cancel to ~0 (x << 0: torch's 1 + tanh rounds to exactly 0 where the reference
    # keeps 1e-14). So each element is allowed 16 eps times its terms' size, times |go| |up|.
    finite = np.isfinite(x)
    xf = np.where(finite, x, 0.0)
    # (infinite x: no allowance, the two must agree exactly)
    terms = np.where(finite, (1 + np.abs(xf) * (1 + 0.134 * xf * xf)), 0.0) * np.abs(go_.numpy())
    for got, exp, factor in ((dg, eg.numpy(), np.maximum(1.0, np.abs(up.detach().numpy()))),
                             (du, eu.numpy(), 1.0)):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(exp))
        ok = ~np.isnan(exp)
        g, e = got[ok], exp[ok]
        atol = 16 * np.finfo(np.float64).eps * (terms * factor)[ok]
        same = g == e                                   # also equal infinities
        with np.errstate(invalid="ignore"):
            err = np.where(same, 0.0, np.abs(g - e))
            bad = ~(err <= 1e-12 * np.abs(np.where(np.isfinite(e), e, 0.0)) + atol)
        assert not bad.any(), (f"{op_name}: {bad.sum()} elements off, e.g. at x = "
                               f"{x[ok][bad][:3]}: {g[bad][:3]} vs {e[bad][:3]}")


def test_reference_broadcasts_and_checks():
    dg, du = GB.ref_silu_mul_backward(np.ones((4, 3)), np.zeros(3), np.ones((4, 1)))
    assert dg.shape == du.shape == (4, 3)
    np.testing.assert_allclose(dg, 0.5)            # silu'(0) = 1/2
    with pytest.raises(ValueError, match="broadcast"):
        GB.ref_silu_mul_backward(np.ones((4, 3)), np.ones(2), np.ones(3))
    with pytest.raises(ValueError, match="approximate"):
        go.gelu_mul_backward(np.ones(3), np.ones(3), np.ones(3), approximate="erf")


@needs_torch
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torch_autograd_cpu_float64_with_broadcast(case, rng):
    import gpuops.torch as gt
    cid, _, kwargs, fwd = case
    mine = gt.silu_mul if cid == "silu" else (lambda g, u: gt.gelu_mul(g, u, **kwargs))
    for gshape, ushape in (((5, 7), (5, 7)), ((3, 5, 7), (7,)), ((5, 1), (1, 7))):
        gate = torch.from_numpy(rng.standard_normal(gshape) * 3).requires_grad_()
        up = torch.from_numpy(rng.standard_normal(ushape)).requires_grad_()
        y, e = mine(gate, up), fwd(gate, up)
        torch.testing.assert_close(y, e, rtol=1e-12, atol=1e-14)
        gy = torch.randn_like(e)
        got = torch.autograd.grad((y * gy).sum(), (gate, up))
        exp = torch.autograd.grad((e * gy).sum(), (gate, up))
        for g, x in zip(got, exp):
            assert g.shape == x.shape
            torch.testing.assert_close(g, x, rtol=1e-12, atol=1e-13)


@pytest.fixture(scope="module")
def emulated():
    if not emu.available():
        pytest.skip("g++ not installed")
    from gpuops.runtime import config
    work = config.settings.cache_dir / "host-emulation"
    work.mkdir(parents=True, exist_ok=True)
    return emu.build([GB.MODULE], str(work))[GB.MODULE.name]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_emulated_kernels(emulated, monkeypatch, case, dtype, rng):
    """The kernels compiled for the host (exact exp2/reciprocal instead of MUFU) through the op's
    host code: flat (with a tail), strided, broadcast."""
    _, op_name, kwargs, _ = case
    monkeypatch.setattr(GB, "_kernel", lambda dev, act, d, flat: emulated.kernel(
        GB._flat_expr(act, d) if flat else GB._strided_expr(act, d)))
    monkeypatch.setitem(GB._blocks, 0, 3)
    npd = dt.to_numpy(dt.BY_NAME[dtype])
    op = registry.get(op_name)

    def run(g, a, b):
        call = emu.Call(op_name, dt.BY_NAME[dtype])
        out = op.impl(call, emu.view(g), emu.view(a), emu.view(b), **kwargs)
        ref = _reference(op_name, g.astype(np.float64), a.astype(np.float64),
                         b.astype(np.float64), kwargs)
        for i, (o, r) in enumerate(zip(out, ref)):
            assert o.shape == r.shape
            assert_close(np.asarray(o.obj).astype(np.float64), r, dtype, f"output {i}")

    for n in (1, 7, 1003):
        g, a, b = (rng.standard_normal(n).astype(npd) for _ in range(3))
        a = (a.astype(np.float32) * 3).astype(npd)
        run(g, a, b)
    big = (rng.standard_normal((40, 66)) * 3).astype(npd)
    run(rng.standard_normal((33, 20)).astype(npd), big[:33, 1:41:2],
        rng.standard_normal((20, 33)).astype(npd).T)                        # strided
    run(rng.standard_normal((6, 1, 40)).astype(npd), (rng.standard_normal((7, 1)) * 3).astype(npd),
        rng.standard_normal((40,)).astype(npd))                             # broadcast
    run(np.zeros((0, 4), npd), np.zeros((0, 4), npd), np.zeros((0, 4), npd))  # empty


# ------------------------------------------------------------------ GPU

def _randn(shape, dtype, scale=1.0):
    return (torch.randn(shape, device="cuda") * scale).to(getattr(torch, dtype))


def _host(t):
    return t.detach().double().cpu().numpy()


def _check(case, dtype, g, a, b, what):
    _, op_name, kwargs, _ = case
    dg, du = getattr(go, op_name)(g, a, b, **kwargs)
    ref = _reference(op_name, _host(g), _host(a), _host(b), kwargs)
    assert dg.dtype == a.dtype and dg.shape == ref[0].shape
    assert_close(_host(dg), ref[0], dtype, f"{case[0]} grad_gate {what}")
    assert_close(_host(du), ref[1], dtype, f"{case[0]} grad_up {what}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("n", [1, 7, 4097, (1 << 20) + 3])
def test_gpu_sizes(case, dtype, n):
    # grad_output and up at unit scale: the tolerances' atol covers the cancellation in
    # act'(gate) near its zero (gate ~ -0.75 for GELU, -1.28 for SiLU) for products of O(1)
    _check(case, dtype, _randn((n,), dtype), _randn((n,), dtype, 3), _randn((n,), dtype),
           f"n={n}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gpu_strided_broadcast_unaligned(case, dtype):
    rows, cols = 37, 4096
    _check(case, dtype, _randn((rows, cols), dtype), _randn((rows, 2 * cols), dtype, 3)[:, ::2],
           _randn((cols, rows), dtype).t(), "strided")
    _check(case, dtype, _randn((rows, cols), dtype), _randn((rows, cols), dtype, 3),
           _randn((cols,), dtype), "broadcast up")
    _check(case, dtype, _randn((1001,), dtype)[1:], _randn((1001,), dtype, 3)[1:],
           _randn((1000,), dtype), "unaligned")
    _check(case, dtype, torch.ones(1, device="cuda", dtype=getattr(torch, dtype)).expand(64, 128),
           _randn((64, 128), dtype, 3), _randn((64, 128), dtype), "expanded grad (sum)")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gpu_nan_and_inf_as_torch(case, dtype):
    _, op_name, kwargs, fwd = case
    td = getattr(torch, dtype)
    x = torch.tensor(SPECIAL, device="cuda").to(td)
    up = torch.linspace(-2, 2, x.numel(), device="cuda").to(td)
    grad = torch.ones_like(x)
    dg, du = getattr(go, op_name)(grad, x, up, **kwargs)
    xg = x.float().requires_grad_()
    ug = up.float().requires_grad_()
    eg, eu = torch.autograd.grad(fwd(xg, ug).sum(), (xg, ug))
    for got, exp in ((dg, eg), (du, eu)):
        got, exp = _host(got), _host(exp)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(exp))
        inf = np.isinf(exp)
        np.testing.assert_array_equal(got[inf], exp[inf])
        ok = np.isfinite(exp)
        np.testing.assert_allclose(got[ok], exp[ok], rtol=2e-2, atol=1e-5)


@gpu
@needs_torch_cuda
def test_gpu_cuda_graph():
    g, a, b = (_randn((16, 4096), "bfloat16") for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        go.silu_mul_backward(g, a, b)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dg, du = go.silu_mul_backward(g, a, b)
    for _ in range(2):
        for t in (g, a, b):
            t.copy_(_randn(t.shape, "bfloat16"))
        graph.replay()
        torch.cuda.synchronize()
        ref = GB.ref_silu_mul_backward(_host(g), _host(a), _host(b))
        assert_close(_host(dg), ref[0], "bfloat16", "graph grad_gate")
        assert_close(_host(du), ref[1], "bfloat16", "graph grad_up")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gpu_torch_autograd_matches_torch(case, dtype):
    import gpuops.torch as gt
    cid, _, kwargs, fwd = case
    mine = gt.silu_mul if cid == "silu" else (lambda g, u: gt.gelu_mul(g, u, **kwargs))
    gate = _randn((300, 512), dtype, 3).requires_grad_()
    up = _randn((512,), dtype).requires_grad_()                       # broadcast: reduced grad
    y = mine(gate, up)
    gy = _randn(y.shape, dtype)
    got = torch.autograd.grad((y * gy).sum(), (gate, up))
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    exp = torch.autograd.grad((fwd(g64, u64) * gy.double()).sum(), (g64, u64))
    assert_close(_host(y), _host(fwd(g64, u64)), dtype, "forward")
    assert_close(_host(got[0]), _host(exp[0]), dtype, "grad gate")
    # grad up: torch sums the 300 rows of per-element gradients rounded to the storage dtype
    assert got[1].shape == up.shape
    act = fwd(g64.detach(), torch.ones_like(u64.detach()))
    terms = (gy.double() * act).abs().sum(0)
    half_ulp = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}[dtype]
    bound = 2 * half_ulp * (terms + exp[1].abs()) + 1e-6
    assert torch.all((got[1].double() - exp[1]).abs() <= bound)
