"""The registry and dispatch: every input kind, every error path, the CPU reference path."""
from __future__ import annotations

import numpy as np
import pytest

import gpuops as go
from gpuops import registry
from gpuops.runtime import config
from conftest import HAS_GPU, HAS_TORCH, assert_close, needs_torch

torch = pytest.importorskip("torch") if HAS_TORCH else None
cpu_only = pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU behaviour")


@pytest.fixture
def fallback(monkeypatch):
    def set_mode(mode):
        monkeypatch.setenv("GPUOPS_FALLBACK", mode)
        config.refresh()
    yield set_mode
    monkeypatch.undo()
    config.refresh()


def test_list_ops_names_every_op_with_dtypes():
    ops = {o.name: o for o in go.list_ops()}
    for name in ("silu", "gelu", "relu", "silu_mul", "gelu_mul", "bias_act", "silu_add_mul", "add",
                 "mul", "scale_clamp"):
        assert name in ops, name
        assert ops[name].dtypes == ("float32", "float16", "bfloat16")
        assert ops[name].summary
        assert getattr(go, name).__doc__


def test_info_reports_the_runtime():
    info = go.info()
    for key in ("gpuops", "cupy", "nvrtc", "gpus", "cache dir", "bundle", "fallback"):
        assert key in info
    assert str(config.settings.cache_dir) == info["cache dir"]
    assert "gpuops:" in str(info)


def test_generated_signature_matches_torch_style():
    import inspect
    sig = inspect.signature(go.gelu_mul)
    assert list(sig.parameters) == ["gate", "up", "approximate", "out"]
    assert sig.parameters["out"].kind is inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["approximate"].default == "none"


def test_numpy_in_numpy_out(rng):
    x = rng.standard_normal((3, 5)).astype(np.float32)
    y = go.silu(x)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == (3, 5)
    assert_close(y, x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64))), "float32", "silu")


def test_numpy_float64_runs_the_reference_exactly(rng):
    x = rng.standard_normal(100)
    y = go.gelu(x, approximate="tanh")
    assert y.dtype == np.float64
    u = np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)
    np.testing.assert_allclose(y, 0.5 * x * (1 + np.tanh(u)), rtol=1e-14)


def test_numpy_float16_and_bfloat16(rng):
    x = rng.standard_normal(64).astype(np.float16)
    assert go.relu(x).dtype == np.float16
    ml_dtypes = pytest.importorskip("ml_dtypes")
    xb = rng.standard_normal(64).astype(ml_dtypes.bfloat16)
    yb = go.silu_mul(xb, xb)
    assert yb.dtype == ml_dtypes.bfloat16
    xf = xb.astype(np.float64)
    assert_close(yb, xf / (1 + np.exp(-xf)) * xf, "bfloat16", "silu_mul bf16")


@needs_torch
def test_torch_cpu_in_torch_cpu_out(rng):
    g = torch.from_numpy(rng.standard_normal((4, 8)).astype(np.float32)).to(torch.bfloat16)
    u = torch.from_numpy(rng.standard_normal((4, 8)).astype(np.float32)).to(torch.bfloat16)
    y = go.silu_mul(g, u)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.device.type == "cpu"
    ref = torch.nn.functional.silu(g.double()) * u.double()
    assert_close(y.double().numpy(), ref.numpy(), "bfloat16")


@needs_torch
def test_mixed_frameworks_are_an_error(rng):
    x = rng.standard_normal(4).astype(np.float32)
    with pytest.raises(TypeError, match=r"'gate' is a numpy array but 'up' is a torch array"):
        go.silu_mul(x, torch.from_numpy(x))


@needs_torch
def test_unsupported_torch_device_is_an_error():
    with pytest.raises(TypeError, match="'input' is on torch device meta"):
        go.silu(torch.empty(3, device="meta"))


def test_dtype_errors_name_the_argument(rng):
    x = rng.standard_normal(4).astype(np.float32)
    with pytest.raises(TypeError, match=r"gpuops.silu: 'input' has dtype int32; expected one of"):
        go.silu(np.arange(4, dtype=np.int32))
    with pytest.raises(TypeError, match=r"'up' is float16 but 'gate' is float32.*does not promote"):
        go.silu_mul(x, x.astype(np.float16))
    with pytest.raises(TypeError, match=r"'out' is float16 but 'input' is float32"):
        go.relu(x, out=np.empty(4, np.float16))


def test_shape_errors_name_the_arguments(rng):
    a = rng.standard_normal((2, 3)).astype(np.float32)
    b = rng.standard_normal((4, 3)).astype(np.float32)
    with pytest.raises(ValueError, match=r"'gate' has \(2, 3\) and 'up' has \(4, 3\)"):
        go.silu_mul(a, b)
    with pytest.raises(ValueError, match=r"'out' has shape \(3,\)"):
        go.relu(a, out=np.empty(3, np.float32))


def test_non_array_arguments_are_an_error():
    with pytest.raises(TypeError, match=r"'input' must be an array"):
        go.silu([1.0, 2.0])
    with pytest.raises(TypeError, match=r"'gate' is required, got None"):
        go.silu_mul(None, np.ones(2, np.float32))
    with pytest.raises(TypeError, match=r"gpuops.add: 'input' must be an array"):
        go.add(1.0, 2.0)


def test_bad_option_values_name_the_argument():
    x = np.ones(3, np.float32)
    with pytest.raises(ValueError, match=r"approximate='fast'"):
        go.gelu(x, approximate="fast")
    with pytest.raises(ValueError, match=r"activation='swish'"):
        go.bias_act(x, x, "swish")


def test_empty_inputs_give_empty_outputs():
    x = np.empty((0, 7), np.float32)
    for fn in (go.silu, go.relu, lambda t: go.silu_mul(t, t), lambda t: go.add(t, 1.0)):
        y = fn(x)
        assert y.shape == (0, 7) and y.dtype == np.float32


def test_out_is_written_and_returned(rng):
    x = rng.standard_normal(10).astype(np.float32)
    out = np.full(10, np.nan, np.float32)
    y = go.relu(x, out=out)
    assert y is out
    np.testing.assert_array_equal(out, np.maximum(x, 0))


def test_scalars_for_add_and_mul(rng):
    x = rng.standard_normal(6).astype(np.float32)
    np.testing.assert_allclose(go.add(x, 2.5, alpha=2.0), x + 5.0, rtol=1e-6)
    np.testing.assert_allclose(go.mul(x, np.float32(3.0)), x * 3.0, rtol=1e-6)
    with pytest.raises(TypeError, match=r"'other' must be an array or a number"):
        go.mul(x, "3")


@needs_torch
def test_requires_grad_is_refused_not_dropped():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"'input' requires grad.*does not record autograd"):
        go.silu(x)
    with torch.no_grad():
        assert go.silu(x).shape == (3,)


@cpu_only
def test_fallback_error_refuses_the_cpu_path(fallback):
    fallback("error")
    with pytest.raises(go.NoGPUError, match="GPUOPS_FALLBACK=error"):
        go.silu(np.ones(3, np.float32))


def test_fallback_setting_is_validated(fallback):
    with pytest.raises(ValueError, match="GPUOPS_FALLBACK"):
        fallback("sometimes")


def test_registration_checks():
    from gpuops.tensor import Tensor  # noqa: F401

    def ref(x):
        return x

    with pytest.raises(ValueError, match="needs a docstring"):
        @registry.register(family="t", reference=ref, name="t_nodoc")
        def t_nodoc(call, x: "Tensor") -> "Tensor":
            return x

    with pytest.raises(TypeError, match="the reference of 't_badref' takes"):
        @registry.register(family="t", reference=ref, name="t_badref")
        def t_badref(call, x: "Tensor", y: "Tensor") -> "Tensor":
            """doc"""
            return x

    with pytest.raises(ValueError, match="registered twice"):
        @registry.register(family="t", reference=lambda input: input, name="silu")
        def silu_again(call, input: "Tensor") -> "Tensor":
            """doc"""
            return input


def test_import_and_cpu_fallback_without_cupy():
    """gpuops must import and run its references where CuPy is not installed at all."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    code = (
        "import sys; sys.modules['cupy'] = None; sys.modules['cupy_backends'] = None\n"
        "import numpy as np, gpuops as go\n"
        "x = np.linspace(-3, 3, 7, dtype=np.float32)\n"
        "y = go.silu_mul(x, x)\n"
        "assert np.allclose(y, x / (1 + np.exp(-x)) * x, rtol=1e-6)\n"
        "info = go.info()\n"
        "assert info['cupy'] == 'not installed' and info['gpus'] == [], info\n"
        "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=root, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


@cpu_only
@pytest.mark.parametrize("storage", [np.float16, np.float32, np.float64])
def test_cpu_path_returns_statistics_in_float32(storage):
    """Ops that return float32 statistics beside their result (lse, rstd, mean) return them in
    float32 on the CPU path too, as their kernels do (float64 for float64 input): the registry's
    per-output result dtypes, not one cast of every output to the input's dtype."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(storage)
    stat = np.float64 if storage is np.float64 else np.float32
    y, rstd = registry.get("rms_norm_forward").function(x, (64,))
    assert y.dtype == storage and rstd.dtype == stat
    w = np.ones(64, storage)
    y, mean, rstd = registry.get("layer_norm_forward").function(x, (64,), w, None)
    assert y.dtype == storage and mean.dtype == stat and rstd.dtype == stat
    target = rng.integers(0, 64, 4).astype(np.int64)
    loss, lse = registry.get("cross_entropy_forward").function(x, target)
    assert loss.dtype == storage and lse.dtype == stat
    np.testing.assert_allclose(lse, np.log(np.exp(x.astype(np.float64)).sum(-1)),
                               rtol=1e-3 if storage is np.float16 else 1e-6)
    q = rng.standard_normal((1, 2, 5, 32)).astype(storage)
    out, lse = registry.get("scaled_dot_product_attention").function(q, q, q, return_lse=True)
    assert out.dtype == storage and lse.dtype == stat
    assert registry.get("scaled_dot_product_attention").function(q, q, q).dtype == storage
