"""The fused elementwise family against float64 references, on the CPU (references, CPU path) and
on the GPU (every op and dtype, sizes 1..2^20+3, broadcasting, strided and unaligned views,
poisoned outputs, in-place, CuPy and NumPy inputs, a side torch stream, CUDA graphs, NaN/Inf as
torch, and more than 2^31 elements)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import gpuops as go
from gpuops import registry
from gpuops.runtime import loader
from conftest import HAS_TORCH, assert_close, gpu, needs_torch, needs_torch_cuda

torch = pytest.importorskip("torch") if HAS_TORCH else None
F = torch.nn.functional if HAS_TORCH else None

# (case id, op, number of array inputs, extra kwargs, scalar second operand or None)
CASES = [
    ("silu", "silu", 1, {}, None),
    ("gelu", "gelu", 1, {}, None),
    ("gelu_tanh", "gelu", 1, {"approximate": "tanh"}, None),
    ("relu", "relu", 1, {}, None),
    ("silu_mul", "silu_mul", 2, {}, None),
    ("gelu_mul", "gelu_mul", 2, {}, None),
    ("gelu_mul_tanh", "gelu_mul", 2, {"approximate": "tanh"}, None),
    *[(f"bias_{a}", "bias_act", 2, {"activation": a}, None)
      for a in (None, "relu", "silu", "gelu", "gelu_tanh")],
    ("silu_add_mul", "silu_add_mul", 3, {}, None),
    ("add", "add", 2, {"alpha": 0.5}, None),
    ("add_scalar", "add", 1, {"alpha": -2.0}, 1.5),
    ("mul", "mul", 2, {}, None),
    ("mul_scalar", "mul", 1, {}, -2.0),
    ("scale_clamp", "scale_clamp", 1, {"scale": 1.5, "min": -1.0, "max": 2.0}, None),
    ("scale_only", "scale_clamp", 1, {"scale": -0.5}, None),
]
IDS = [c[0] for c in CASES]
DTYPES = ["float32", "float16", "bfloat16"]


def _reference(op_name, arrays, scalar, kwargs):
    op = registry.get(op_name)
    names = [n for n in op.param_names if n != "out"]
    values = [np.asarray(a, dtype=np.float64) for a in arrays]
    if scalar is not None:
        values.append(scalar)
    return op.reference(**dict(zip(names, values)), **kwargs)


def _call(op_name, arrays, scalar, kwargs, **extra):
    args = list(arrays) + ([scalar] if scalar is not None else [])
    return getattr(go, op_name)(*args, **kwargs, **extra)


# ----------------------------------------------------------------------------- CPU: references

SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 1e30, -1e30, 100.0,
                    -100.0, 88.8, -88.8, 20.0, -20.0, 5.0, -5.0, 1.0, -1.0, 0.5, -0.5])


@needs_torch
@pytest.mark.parametrize("name,torch_fn", [
    ("silu", lambda t: F.silu(t)), ("relu", lambda t: torch.relu(t)),
    ("gelu", lambda t: F.gelu(t)), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))])
def test_activation_references_match_torch_in_float64(name, torch_fn, rng):
    x = np.concatenate([SPECIAL, rng.standard_normal(1000) * 4])
    ref = go.ops.elementwise._act_ref(name, x)
    expected = torch_fn(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(np.isnan(ref), np.isnan(expected))
    np.testing.assert_allclose(ref, expected, rtol=1e-12, atol=1e-14)  # both cancel near 0


def test_gelu_reference_against_math_erf(rng):
    x = rng.standard_normal(200) * 3
    expected = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    np.testing.assert_allclose(go.ops.elementwise._act_ref("gelu", x), expected, rtol=1e-13)


@needs_torch
def test_arith_references_match_torch(rng):
    a, b = rng.standard_normal((2, 50))
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    el = go.ops.elementwise
    np.testing.assert_allclose(el.ref_add(a, b, alpha=0.3), torch.add(ta, tb, alpha=0.3).numpy())
    np.testing.assert_allclose(el.ref_mul(a, b), (ta * tb).numpy())
    np.testing.assert_allclose(el.ref_scale_clamp(a, 2.0, -0.5, 0.7),
                               torch.clamp(ta * 2.0, -0.5, 0.7).numpy())
    nan = np.array([np.nan, 1.0])
    assert np.isnan(el.ref_scale_clamp(nan, 1.0, 0.0, 0.5)[0])        # clamp keeps NaN, as torch
    assert el.ref_scale_clamp(np.array([0.3]), 1.0, 2.0, 1.0)[0] == 1.0  # min > max gives max


@needs_torch
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cpu_path_torch_bfloat16(case, rng):
    cid, op_name, n_arrays, kwargs, scalar = case
    arrays = [torch.from_numpy(rng.standard_normal((6, 10)).astype(np.float32)).to(torch.bfloat16)
              for _ in range(n_arrays)]
    out = _call(op_name, arrays, scalar, kwargs)
    assert out.dtype == torch.bfloat16
    ref = _reference(op_name, [a.double().numpy() for a in arrays], scalar, kwargs)
    assert_close(out.double().numpy(), ref, "bfloat16", cid)


# ----------------------------------------------------------------------------- GPU

def _randn(shape, dtype, scale=3.0):
    return (torch.randn(shape, device="cuda") * scale).to(getattr(torch, dtype))


def _host(t):
    return t.double().cpu().numpy()


def _check(case, arrays, dtype, out=None, what=""):
    cid, op_name, _, kwargs, scalar = case
    y = _call(op_name, arrays, scalar, kwargs, **({"out": out} if out is not None else {}))
    ref = _reference(op_name, [_host(a) for a in arrays], scalar, kwargs)
    assert_close(_host(y), ref, dtype, f"{cid} {dtype} {what}")
    return y


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("n", [1, 7, 4097, (1 << 20) + 3])
def test_gpu_sizes(case, dtype, n):
    arrays = [_randn((n,), dtype) for _ in range(case[2])]
    y = _check(case, arrays, dtype, what=f"n={n}")
    assert y.dtype == arrays[0].dtype and y.device == arrays[0].device


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gpu_broadcast_strided_and_unaligned(case, dtype):
    n_arrays = case[2]
    if n_arrays == 1:
        views = {"transposed": [_randn((96, 37), dtype).t()],
                 "sliced": [_randn((40, 130), dtype)[:, 1:128:2]],
                 "unaligned": [_randn((4098,), dtype)[1:]]}
    else:
        rest = n_arrays - 1
        views = {
            "row_bias": [_randn((37, 96), dtype)] + [_randn((96,), dtype) for _ in range(rest)],
            "odd_row": [_randn((5, 4097), dtype)] + [_randn((4097,), dtype) for _ in range(rest)],
            "scalar_tensor": [_randn((33, 64), dtype)] + [_randn((1,), dtype) for _ in range(rest)],
            "outer": [_randn((6, 1, 40), dtype)] + [_randn((7, 1), dtype) for _ in range(rest)],
            "transposed": [_randn((64, 48), dtype).t()] + [_randn((48, 64), dtype)
                                                           for _ in range(rest)],
            "unaligned": [_randn((1001,), dtype)[1:]] + [_randn((1000,), dtype)
                                                         for _ in range(rest)],
        }
    for what, arrays in views.items():
        _check(case, arrays, dtype, what=what)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gpu_out_poisoned_and_in_place(case, dtype):
    arrays = [_randn((3, 1000), dtype) for _ in range(case[2])]
    out = torch.full((3, 1000), float("nan"), device="cuda", dtype=arrays[0].dtype)
    y = _check(case, arrays, dtype, out=out, what="out=")
    assert y is out
    strided_out = torch.full((1000, 6), float("nan"), device="cuda", dtype=arrays[0].dtype)[:, ::2].t()
    _check(case, arrays, dtype, out=strided_out, what="strided out=")
    expected = _reference(case[1], [_host(a) for a in arrays], case[4], case[3])
    y = _call(case[1], arrays, case[4], case[3], out=arrays[0])      # in place
    assert y is arrays[0]
    assert_close(_host(y), expected, dtype, "in place")


@gpu
@needs_torch_cuda
def test_gpu_partial_overlap_is_refused():
    x = _randn((100,), "float32")
    with pytest.raises(ValueError, match="overlaps 'input'"):
        go.relu(x[:50], out=x[10:60])


@gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gpu_cupy_arrays(dtype):
    import cupy as cp
    try:
        npdt = np.dtype(dtype) if dtype != "bfloat16" else np.dtype(__import__("ml_dtypes").bfloat16)
        g = (cp.random.standard_normal((257, 33), dtype=np.float32) * 3).astype(npdt)
        u = (cp.random.standard_normal((33,), dtype=np.float32)).astype(npdt)
    except Exception:
        pytest.skip(f"this CuPy cannot make {dtype} arrays")
    y = go.silu_mul(g, u)
    assert isinstance(y, cp.ndarray) and y.dtype == g.dtype and y.device == g.device
    gh, uh = cp.asnumpy(g).astype(np.float64), cp.asnumpy(u).astype(np.float64)
    assert_close(cp.asnumpy(y).astype(np.float64), gh / (1 + np.exp(-gh)) * uh, dtype, "cupy")
    yt = go.gelu(g[:, ::3].T)
    ref = go.ops.elementwise._act_ref("gelu", gh[:, ::3].T)
    assert_close(cp.asnumpy(yt).astype(np.float64), ref, dtype, "cupy strided")


@gpu
def test_gpu_numpy_inputs_run_on_the_gpu(rng):
    loader.clear_memory_cache()             # also makes the ops look their kernels up again
    x = rng.standard_normal((129, 65)).astype(np.float32)
    out = np.full((129, 65), np.nan, np.float32)
    y = go.gelu_mul(x, x, approximate="tanh", out=out)
    assert y is out and any(m.module.name == "elementwise.gated" for m in loader.loaded_modules())
    xd = x.astype(np.float64)
    assert_close(y, go.ops.elementwise._act_ref("gelu_tanh", xd) * xd, "float32", "numpy on gpu")


@gpu
@needs_torch_cuda
def test_gpu_side_stream_and_cuda_graph():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        g = _randn((64, 2048), "bfloat16")
        u = _randn((64, 2048), "bfloat16")
        y = go.silu_mul(g, u)              # must run on `side`, after g and u are written there
    side.synchronize()
    ref = _reference("silu_mul", [_host(g), _host(u)], None, {})
    assert_close(_host(y), ref, "bfloat16", "side stream")

    static_g = _randn((16, 2048), "bfloat16")
    static_u = _randn((16, 2048), "bfloat16")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        go.silu_mul(static_g, static_u)    # warm-up outside capture (loads the module)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):          # fails if a launch went to another stream or synced
        static_out = go.silu_mul(static_g, static_u)
        static_out2 = go.add(static_out, static_g, alpha=2.0)
    for _ in range(2):
        static_g.copy_(_randn((16, 2048), "bfloat16"))
        static_u.copy_(_randn((16, 2048), "bfloat16"))
        graph.replay()
        torch.cuda.synchronize()
        ref = _reference("silu_mul", [_host(static_g), _host(static_u)], None, {})
        assert_close(_host(static_out), ref, "bfloat16", "graph replay")
        assert_close(_host(static_out2), _host(static_out) + 2 * _host(static_g), "bfloat16",
                     "graph replay add")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("name,torch_fn", [
    ("silu", lambda t: F.silu(t)), ("relu", lambda t: torch.relu(t)),
    ("gelu", lambda t: F.gelu(t)), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_nan_and_inf_as_torch(name, torch_fn, dtype):
    x = torch.tensor(SPECIAL, device="cuda").to(getattr(torch, dtype))
    y = go.gelu(x, approximate="tanh") if name == "gelu_tanh" else getattr(go, name)(x)
    expected = torch_fn(x.float()).double().cpu().numpy()
    got = _host(y)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    inf = np.isinf(expected)
    np.testing.assert_array_equal(got[inf], expected[inf])
    ok = np.isfinite(expected)
    np.testing.assert_allclose(got[ok], expected[ok], rtol=1e-2, atol=1e-6)
    gated = go.silu_mul(x, x)
    expected = (F.silu(x.float()) * x.float()).double().cpu().numpy()
    np.testing.assert_array_equal(np.isnan(_host(gated)), np.isnan(expected))


@gpu
@needs_torch_cuda
@pytest.mark.large
def test_gpu_more_than_2_31_elements():
    n = (1 << 31) + 4099
    free, _ = torch.cuda.mem_get_info()
    if free < 3 * n * 2:
        pytest.skip("needs ~13 GB of free GPU memory")
    x = torch.empty(n, device="cuda", dtype=torch.bfloat16).uniform_(-2, 2)
    y = go.relu(x)
    for sl in (slice(0, 4096), slice(n - 70000, n), slice((1 << 31) - 2048, (1 << 31) + 2048)):
        assert torch.equal(y[sl], torch.relu(x[sl]))
    idx = torch.randint(0, n, (100000,), device="cuda")
    assert torch.equal(y[idx], torch.relu(x[idx]))
    del y
    y = go.scale_clamp(x[1:], 2.0, -1.0, 1.0)        # unaligned: the one-element path
    tail = slice(n - 1 - 50000, n - 1)
    assert torch.equal(y[tail], torch.clamp(x[1:][tail].float() * 2.0, -1.0, 1.0).to(torch.bfloat16))
