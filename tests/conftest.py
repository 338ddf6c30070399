"""Shared test fixtures.

GPU tests carry the ``gpu`` marker and are skipped where no GPU is usable. Every output gpuops
allocates in a test run is poisoned first (GPUOPS_DEBUG_POISON=1: NaN bytes), so an element a
kernel fails to write shows up as NaN. Random data is fresh each run; the seed is printed on
failure (set GPUOPS_TEST_SEED to replay it).
"""
from __future__ import annotations

import os
import secrets

os.environ.setdefault("GPUOPS_DEBUG_POISON", "1")
os.environ.setdefault("GPUOPS_QUIET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from gpuops.runtime import device  # noqa: E402

HAS_GPU = device.gpu_available()

try:
    import torch  # noqa: F401
    HAS_TORCH = True
    HAS_TORCH_CUDA = torch.cuda.is_available()
except ImportError:
    HAS_TORCH = HAS_TORCH_CUDA = False

# Markers the test files import from here: the GPU tests (skipped without a GPU: see
# pytest_collection_modifyitems) and the torch-dependent ones.
gpu = pytest.mark.gpu
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
needs_torch_cuda = pytest.mark.skipif(not HAS_TORCH_CUDA, reason="torch without CUDA")

# Allowed |out - ref| <= atol + rtol * |ref| against the float64 reference, by storage dtype:
# rtol covers rounding the fp32 result to the storage type (half an ulp: 2^-24, 2^-11, 2^-8) and
# a few ulp of fp32 math; atol covers cancellation in sums like a + b * c near zero.
TOLERANCE = {
    "float32": dict(rtol=1e-5, atol=1e-6),
    "float16": dict(rtol=1.5e-3, atol=1e-5),
    "bfloat16": dict(rtol=8e-3, atol=1e-5),
    "float64": dict(rtol=1e-12, atol=1e-14),
}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "large: allocates many GB on the GPU")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_wgmma_attention_off_gpu(request, monkeypatch):
    """Host-emulated kernel runs (tests/emu.py: kernels compiled as C++, no GPU) have no wgmma /
    TMA, so outside GPU tests the attention forward's 'auto' must not pick its sm_90a kernel
    (its device check would ask the absent driver for the compute capability)."""
    if request.node.get_closest_marker("gpu") is None:
        import gpuops.ops.attention as attention  # noqa: PLC0415
        monkeypatch.setattr(attention, "wgmma_device", lambda dev: False)


@pytest.fixture
def seed():
    return int(os.environ.get("GPUOPS_TEST_SEED") or secrets.randbits(32))


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and "seed" in getattr(item, "funcargs", {}):
        rep.sections.append(("random seed", f"replay with GPUOPS_TEST_SEED={item.funcargs['seed']}"))


def assert_close(out, ref, dtype_name, what="", scale=None):
    """Elementwise check against a float64 reference; NaN must match NaN exactly. scale: per
    element, the magnitude the relative tolerance applies to where it exceeds |ref| (a result
    formed by cancelling terms is only as accurate as its terms: pass the sum of their
    magnitudes)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != reference {ref.shape}"
    nan_out, nan_ref = np.isnan(out), np.isnan(ref)
    assert np.array_equal(nan_out, nan_ref), (
        f"{what}: NaN where the reference has none at {np.argwhere(nan_out & ~nan_ref)[:5].tolist()}"
        f", or a value where the reference is NaN at {np.argwhere(nan_ref & ~nan_out)[:5].tolist()}")
    tol = TOLERANCE[dtype_name]
    finite = ~nan_ref
    inf_ref = np.isinf(ref)
    assert np.array_equal(out[inf_ref], ref[inf_ref]), f"{what}: infinities differ"
    ok = finite & ~inf_ref
    err = np.abs(out[ok] - ref[ok])
    mag = np.abs(ref[ok])
    if scale is not None:
        mag = np.maximum(mag, np.broadcast_to(np.asarray(scale, np.float64), ref.shape)[ok])
    bound = tol["atol"] + tol["rtol"] * mag
    if err.size and not np.all(err <= bound):
        i = int(np.argmax(err - bound))
        raise AssertionError(
            f"{what}: {int(np.sum(err > bound))} of {err.size} elements off; worst "
            f"out={out[ok][i]!r} ref={ref[ok][i]!r} err={err[i]:.3g} > bound {bound[i]:.3g}")
