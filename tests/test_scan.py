"""cumsum (inclusive/exclusive, forward/reversed) against float64 references: on the CPU
(reference against torch, errors, the CPU path, the planner, the kernels run by the emulator of
tests/emu.py: warp rows, block tiles chained by look-back, misaligned and strided rows, columns)
and on the GPU (every dtype, rows of 1..32768 and millions, non-last dims, strided views, NaN/inf,
CUDA graphs).

Tolerance: conftest.TOLERANCE (fp32 rtol 1e-5) on data with a positive mean, so that every prefix
sum is about as large as the sum of its absolute values (condition number ~1). The kernels' fp32
error is then a few eps from each pack and warp tree plus one rounding per preceding tile of the
row (tiles of 1024 elements, chained sequentially; random-signed roundings grow like the square
root of their number): ~2e-6 at 2M elements, inside 1e-5.
For mixed signs the check is the forward error bound eps * (tiles + 64) * cumsum(|x|).
"""
from __future__ import annotations

import numpy as np
import pytest

import gpuops as go
from gpuops import dtypes as dt
from gpuops.ops import scan
from conftest import HAS_TORCH, TOLERANCE, assert_close, gpu, needs_torch, needs_torch_cuda

import emu
from emu import needs_emu  # noqa: E402

torch = pytest.importorskip("torch") if HAS_TORCH else None

DTYPES = ["float32", "float16", "bfloat16"]
MODES = [(False, False), (True, False), (False, True), (True, True)]   # (exclusive, reverse)
MODE_IDS = ["incl", "excl", "rev", "excl_rev"]


def _np_dtype(name):
    return dt.to_numpy(dt.BY_NAME[name])


# ----------------------------------------------------------------------------- CPU: reference

@needs_torch
def test_reference_matches_torch(rng):
    x = rng.standard_normal((4, 5, 6))
    t = torch.from_numpy(x)
    for d in (0, 1, 2, -1):
        inc = torch.cumsum(t, d)
        np.testing.assert_allclose(scan.ref_cumsum(x, d), inc.numpy(), rtol=1e-14)
        np.testing.assert_allclose(scan.ref_cumsum(x, d, exclusive=True), (inc - t).numpy(),
                                   rtol=1e-12, atol=1e-12)
        rev = torch.flip(torch.cumsum(torch.flip(t, [d]), d), [d])
        np.testing.assert_allclose(scan.ref_cumsum(x, d, reverse=True), rev.numpy(), rtol=1e-14)
        np.testing.assert_allclose(scan.ref_cumsum(x, d, exclusive=True, reverse=True),
                                   (rev - t).numpy(), rtol=1e-12, atol=1e-12)
    s = np.array(2.5)
    assert scan.ref_cumsum(s, 0) == 2.5 and scan.ref_cumsum(s, -1, exclusive=True) == 0.0
    assert scan.ref_cumsum(np.zeros((3, 0)), 1, exclusive=True).shape == (3, 0)


def test_argument_errors():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="dim=2 is out of range"):
        go.cumsum(x, 2)
    with pytest.raises(TypeError, match="'dim' must be an int"):
        go.cumsum(x, (1,))


@needs_torch
def test_cpu_path_keeps_the_dtype(rng):
    x = torch.from_numpy(rng.random((6, 10)).astype(np.float32)).to(torch.bfloat16)
    y = go.cumsum(x, 1, reverse=True)
    assert y.dtype == torch.bfloat16
    assert_close(y.double().numpy(), scan.ref_cumsum(x.double().numpy(), 1, reverse=True),
                 "bfloat16", "cpu bf16")


def test_rows_config():
    # [32768, 4096]: a warp per row (rows fill the GPU); [16, 1M]: warps per tile, look-back
    assert scan.rows_config(32768, 4096, 8, 132) == ((True, 4), 1)
    assert scan.rows_config(16, 1 << 20, 8, 132) == ((True, 4), 1024)
    assert scan.rows_config(16, 1 << 20, 4, 132) == ((True, 8), 1024)
    assert scan.rows_config(4, 2000, 8, 132) == ((True, 4), 1)          # short rows
    assert scan.rows_config(4, 200, 8, 132) == ((True, 1), 1)
    assert scan.rows_config(4, 3000, 4, 132) == ((True, 8), 3)
    assert scan.rows_config(4, 5000, 1, 132) == ((False, 8), 20)
    for rows, R, vec in [(1, 12345, 8), (3, 10 ** 6 + 3, 4), (1, 7, 1), (2, 100000, 1)]:
        (vector, k), tiles = scan.rows_config(rows, R, vec, 132)
        if tiles > 1:
            assert tiles * k * 32 * vec >= R - vec + 1


# ----------------------------------------------------------------------------- CPU: kernels, emulated

def _data(rng, shape, dtype, positive=True):
    x = rng.random(shape) + 0.5 if positive else rng.standard_normal(shape)
    if dtype == "float16":
        x = x * 2.0 ** -6
    return x.astype(_np_dtype(dtype))


def _emu_run(dev, x, dim, exclusive=False, reverse=False):
    call = dev.call("cumsum", dt.from_numpy(x.dtype))
    return scan._cumsum(call, dev.tensor(x), dim % max(x.ndim, 1), exclusive, reverse).obj


EMU_CASES = [   # (shape, dim, layout)
    ((5, 1000), -1, "contig"),      # a warp per row, one tile
    ((3, 37), -1, "offset"),        # misaligned rows: head and tail elements
    ((4, 1), -1, "contig"),         # rows of 1
    ((70, 3000), -1, "offset"),     # a warp per row walking several tiles (many rows)
    ((2, 9000), -1, "contig"),      # warp tiles chained by look-back
    ((1, 20001), -1, "offset"),     # one long misaligned row
    ((5, 300), -1, "sliced"),       # strided rows: one element per lane
    ((2, 1500), -1, "sliced"),      # strided rows, tiles with look-back
    ((64, 40), 0, "contig"),        # columns, chunks of rows with carries
    ((3, 300, 16), 1, "contig"),    # middle dim
    ((40, 50), 0, "transposed"),    # dim 0 of a transposed view
]


@needs_emu
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_kernels(dtype, rng):
    with emu.Device(sms=2) as dev:
        for shape, dim, layout in EMU_CASES:
            x = emu.strided(_data(rng, shape, dtype), layout)
            x64 = x.astype(np.float64)
            for exclusive, reverse in MODES:
                y = _emu_run(dev, x, dim, exclusive, reverse)
                assert y.dtype == x.dtype and y.shape == x.shape
                assert_close(y.astype(np.float64), scan.ref_cumsum(x64, dim, exclusive, reverse),
                             dtype, f"{shape} dim={dim} {layout} excl={exclusive} rev={reverse}")


@needs_emu
def test_emulated_nan_inf_0d_and_empty(rng):
    with emu.Device(sms=2) as dev:
        x = _data(rng, (3, 5000), "float32")
        x[0, 100] = np.nan
        x[1, 4000] = np.inf
        x[2, 10] = -np.inf
        for exclusive, reverse in MODES:
            y = _emu_run(dev, x, 1, exclusive, reverse)
            assert_close(y, scan.ref_cumsum(x.astype(np.float64), 1, exclusive, reverse),
                         "float32", f"nan/inf excl={exclusive} rev={reverse}")
        s = np.array(2.5, np.float32)
        assert _emu_run(dev, s, 0) == 2.5 and _emu_run(dev, s, 0, exclusive=True) == 0.0
        assert _emu_run(dev, np.zeros((3, 0), np.float32), 1).shape == (3, 0)


@needs_emu
def test_emulated_error_bound_with_cancellation(rng):
    with emu.Device(sms=2) as dev:
        x = _data(rng, (2, 30000), "float32", positive=False)
        x64 = x.astype(np.float64)
        for exclusive, reverse in MODES:
            y = _emu_run(dev, x, 1, exclusive, reverse).astype(np.float64)
            ref = scan.ref_cumsum(x64, 1, exclusive, reverse)
            bound = 2.0 ** -24 * (30000 / 1024 + 64) * scan.ref_cumsum(np.abs(x64), 1, exclusive, reverse)
            assert np.all(np.abs(y - ref) <= bound + 1e-30)


@needs_emu
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_emulated_lookback_with_blocks_interleaved(seed, rng):
    """All blocks at once, warps resumed in a random order at every warp intrinsic: tiles find
    predecessors that published nothing yet, or only their aggregate."""
    with emu.Device(sms=2, concurrent=True, seed=seed) as dev:
        for dtype, shape in (("float32", (2, 20000)), ("bfloat16", (1, 30001))):
            x = emu.strided(_data(rng, shape, dtype), "offset")
            for exclusive, reverse in MODES:
                y = _emu_run(dev, x, -1, exclusive, reverse)
                assert_close(y.astype(np.float64),
                             scan.ref_cumsum(x.astype(np.float64), -1, exclusive, reverse), dtype,
                             f"interleaved {dtype} excl={exclusive} rev={reverse}")
        assert any("scan_rows" in name and grid[0] > 1 for name, grid, _, _ in emu.Device.launches)


@needs_emu
def test_emulated_lookback_windows(rng):
    """exclusive_prefix over status words in any mix of aggregates and prefixes (integers: exact
    sums), including runs of more than 32 tiles with no prefix published."""
    from gpuops.runtime.launch import ArgSpec
    probe = emu.Probe("lookback_probe", "probes/lookback.cu",
                      {"lookback_probe": ArgSpec("ptr", "ptr", "i32")})
    lib, index = emu.build(probe)
    n = 300
    agg = rng.integers(-50, 50, n).astype(np.float32)
    incl = np.cumsum(agg.astype(np.float64)).astype(np.float32)
    for prefix_prob in (0.0, 0.02, 0.3, 1.0):
        status = np.where(rng.random(n) < prefix_prob, 2, 1).astype(np.uint64)
        status[0] = 2 if prefix_prob > 0 else 1
        value = np.where(status == 2, incl, agg).astype(np.float32)
        words = (value.view(np.uint32).astype(np.uint64) << np.uint64(32)) | status
        out = np.full(n, np.nan, np.float32)
        k = emu.EmuKernel(lib, index["lookback_probe"], probe.kernels["lookback_probe"], "probe")
        k.launch((-(-n // 8), 1, 1), (256, 1, 1), 0, words.ctypes.data, out.ctypes.data, n)
        np.testing.assert_array_equal(out[1:], incl[:-1], err_msg=f"prefix_prob={prefix_prob}")


# ----------------------------------------------------------------------------- GPU

def _rand(shape, dtype, positive=True):
    x = torch.rand(shape, device="cuda") + 0.5 if positive else torch.randn(shape, device="cuda")
    if dtype == "float16":
        x = x * 2.0 ** -6                    # prefix sums of a million stay below 65504
    return x.to(getattr(torch, dtype))


def _host(t):
    return t.double().cpu().numpy()


def _gpu_check(x, dim, exclusive=False, reverse=False, what=""):
    y = go.cumsum(x, dim, exclusive=exclusive, reverse=reverse)
    assert y.dtype == x.dtype and y.shape == x.shape and y.device == x.device
    dtype = str(x.dtype).split(".")[-1]
    assert_close(_host(y), scan.ref_cumsum(_host(x), dim, exclusive, reverse), dtype,
                 f"{dtype} {what} excl={exclusive} rev={reverse}")
    return y


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_rows(dtype, mode):
    for n in (1, 3, 1000, 4097, 32768):
        _gpu_check(_rand((300, n), dtype), -1, *mode, what=f"rows of {n}")
    _gpu_check(_rand((4500, 4096), dtype), -1, *mode, what="many rows (a warp per row)")
    _gpu_check(_rand((4, 1 << 20), dtype), -1, *mode, what="long rows (look-back)")
    _gpu_check(_rand((1, (1 << 21) + 7), dtype)[:, 1:], -1, *mode, what="one misaligned long row")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_other_dims_and_views(dtype, mode):
    _gpu_check(_rand((4096, 1024), dtype), 0, *mode, what="dim 0")
    _gpu_check(_rand((8, 500, 72), dtype), 1, *mode, what="middle dim")
    _gpu_check(_rand((1000, 37), dtype), 0, *mode, what="odd columns")
    base = _rand((300, 200), dtype)
    _gpu_check(base.t(), 1, *mode, what="transposed, last dim")
    _gpu_check(base.t(), 0, *mode, what="transposed, dim 0")
    _gpu_check(base[:, 1::3], 1, *mode, what="sliced")
    _gpu_check(base[1:, 1:], 1, *mode, what="offset")
    _gpu_check(_rand((4, 5, 6, 7), dtype).permute(2, 0, 3, 1), 1, *mode, what="permuted 4-d")


@gpu
@needs_torch_cuda
def test_gpu_long_row_error_bound():
    x = _rand((2, 1 << 22), "float32", positive=False)
    y = _host(go.cumsum(x, 1))
    x64 = _host(x)
    tiles = (1 << 22) / 1024
    bound = 2.0 ** -24 * (tiles + 64) * np.cumsum(np.abs(x64), 1)
    assert np.all(np.abs(y - np.cumsum(x64, 1)) <= bound)


@gpu
@needs_torch_cuda
def test_gpu_nan_inf_empty_0d():
    x = _rand((3, 100000), "float32")
    x[0, 50000] = float("nan")
    x[1, 99999] = float("inf")
    x[2, 0] = -float("inf")
    for mode in MODES:
        _gpu_check(x, 1, *mode, what="nan/inf")
    assert go.cumsum(torch.empty(3, 0, device="cuda"), 1).shape == (3, 0)
    s = torch.tensor(2.5, device="cuda")
    assert go.cumsum(s, 0).item() == 2.5 and go.cumsum(s, 0, exclusive=True).item() == 0.0


@gpu
@needs_torch_cuda
def test_gpu_matches_torch_cumsum():
    """Both against the float64 reference. torch's CUDA cumsum accumulates in the storage type
    (aten/src/ATen/native/cuda/CumsumKernel.cu: scan_dim<scalar_t> with std::plus<scalar_t>;
    ScanUtils.cuh tensor_kernel_scan_innermost_dim keeps its Sklansky tree in a shared scalar_t
    buffer and carries block_total in scalar_t): for fp16/bf16 every partial sum is rounded to
    16 bits, some tens of roundings deep for 5000 elements, and it lands several ulps off (its
    algorithm, replayed on the CPU: up to ~4 ulps, 0.3% in fp16, 2.3% in bf16). gpuops
    accumulates in fp32 and rounds once (within half an ulp). So conftest's 16-bit tolerances,
    which bound one final rounding, hold for gpuops against float64 but not against torch. The
    comparison with torch is bounded by the triangle inequality with torch's own error:
    |ours - torch| <= |ours - ref| + |torch - ref| <= tol(ref) + |torch - ref|."""
    for dtype in DTYPES:
        x = _rand((64, 5000), dtype)
        y = go.cumsum(x, -1)
        t = torch.cumsum(x, -1)
        assert y.dtype == t.dtype
        ref = scan.ref_cumsum(_host(x), -1)
        assert_close(_host(y), ref, dtype, f"vs float64 {dtype}")
        tol = TOLERANCE[dtype]
        err_torch = np.abs(_host(t) - ref)
        diff = np.abs(_host(y) - _host(t))
        bound = tol["atol"] + tol["rtol"] * np.abs(ref) + err_torch
        assert np.all(diff <= bound), (
            f"vs torch {dtype}: {int(np.sum(diff > bound))} elements differ by more than "
            f"torch's own error + ours; worst {float(np.max(diff - bound)):.3g} over")
        if dtype != "float32":     # one rounding is never less accurate than many
            err = np.abs(_host(y) - ref)
            assert err.max() <= err_torch.max() + 2.0 ** -20 * np.abs(ref).max(), (
                f"{dtype}: gpuops max error {err.max():.3g} > torch's {err_torch.max():.3g}")


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_cupy_and_numpy(dtype):
    import cupy as cp
    try:
        x = (cp.random.random((129, 650), dtype=np.float32) + 0.5).astype(_np_dtype(dtype))
    except Exception:
        pytest.skip(f"this CuPy cannot make {dtype} arrays")
    y = go.cumsum(x, 1, reverse=True)
    assert isinstance(y, cp.ndarray) and y.dtype == x.dtype
    assert_close(cp.asnumpy(y).astype(np.float64),
                 scan.ref_cumsum(cp.asnumpy(x).astype(np.float64), 1, reverse=True), dtype, "cupy")
    h = cp.asnumpy(x)
    yh = go.cumsum(h, 0, exclusive=True)
    assert isinstance(yh, np.ndarray)
    assert_close(yh.astype(np.float64), scan.ref_cumsum(h.astype(np.float64), 0, True), dtype, "numpy")


@gpu
@needs_torch_cuda
def test_gpu_cuda_graph():
    x = _rand((4, 4096), "bfloat16")
    long = _rand((2, 300000), "float32")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        go.cumsum(x, -1)
        go.cumsum(long, -1)
        go.cumsum(x, 0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = go.cumsum(x, -1, exclusive=True)
        z = go.cumsum(long, -1)                   # look-back: status words zeroed in the graph
        c = go.cumsum(x, 0, reverse=True)
    for _ in range(3):
        x.copy_(_rand((4, 4096), "bfloat16"))
        long.copy_(_rand((2, 300000), "float32"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(_host(y), scan.ref_cumsum(_host(x), -1, True), "bfloat16", "graph rows")
        assert_close(_host(z), scan.ref_cumsum(_host(long), -1), "float32", "graph look-back")
        assert_close(_host(c), scan.ref_cumsum(_host(x), 0, reverse=True), "bfloat16", "graph cols")
