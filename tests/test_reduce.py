"""Reductions (sum, mean, amax, amin, argmax, argmin) against float64 references: on the CPU
(references against torch, argument errors, the CPU path, the planner, and the kernels themselves
run by the CPU emulator of tests/emu.py) and on the GPU (every op and dtype, rows of 1..4097 and
long split rows, columns, middle dims, full reductions, tuple dims, strided / transposed /
misaligned / broadcast views, NaN and ties as torch, CuPy and NumPy inputs, CUDA graphs)."""
from __future__ import annotations

import numpy as np
import pytest

import gpuops as go
from gpuops import dtypes as dt
from gpuops.ops import reduce as red
from conftest import HAS_TORCH, assert_close, gpu, needs_torch, needs_torch_cuda

import emu
from emu import needs_emu  # noqa: E402
import emu_pool

torch = pytest.importorskip("torch") if HAS_TORCH else None

OPS = ["sum", "mean", "amax", "amin", "argmax", "argmin"]
VALUE_OPS = ["sum", "mean", "amax", "amin"]
ARG_OPS = ["argmax", "argmin"]
DTYPES = ["float32", "float16", "bfloat16"]


def _ref(op, x64, dim=None, keepdim=False):
    return getattr(red, f"ref_{op}")(x64, dim, keepdim)


def _check(op, out, ref, dtype, what):
    if op in ARG_OPS:
        out = np.asarray(out)
        assert out.dtype == np.int64, f"{what}: index dtype {out.dtype}"
        np.testing.assert_array_equal(out, ref, err_msg=what)
    else:
        assert_close(out, ref, dtype, what)


# ----------------------------------------------------------------------------- CPU: references

@needs_torch
@pytest.mark.parametrize("op", OPS)
def test_references_match_torch_float64(op, rng):
    x = rng.standard_normal((4, 5, 6))
    t = torch.from_numpy(x)
    fn = getattr(torch, op)
    dims = [None, 0, 1, -1] + ([(0, 2), (1, 2), (-1, 0)] if op in VALUE_OPS else [])
    for dim in dims:
        for keepdim in (False, True):
            ref = _ref(op, x, dim, keepdim)
            if dim is None and op in VALUE_OPS:
                expected = fn(t, dim=tuple(range(3)), keepdim=keepdim) if keepdim else fn(t)
            else:
                expected = fn(t, dim=dim, keepdim=keepdim)
            assert ref.shape == tuple(expected.shape), (op, dim, keepdim)
            np.testing.assert_allclose(ref, expected.numpy(), rtol=1e-13, atol=1e-13)


@needs_torch
@pytest.mark.parametrize("op", OPS)
def test_references_nan_ties_and_signed_zero_as_torch(op):
    x = np.array([[1.0, np.nan, 3.0, np.nan], [2.0, 5.0, 5.0, -1.0], [-0.0, 0.0, 0.0, -0.0],
                  [-np.inf, -np.inf, np.inf, np.inf]])
    ref = _ref(op, x, 1)
    expected = getattr(torch, op)(torch.from_numpy(x), 1).numpy()
    np.testing.assert_array_equal(ref, expected)


def test_reference_empty_reductions():
    x = np.zeros((0, 3))
    np.testing.assert_array_equal(red.ref_sum(x, 0), np.zeros(3))
    assert np.all(np.isnan(red.ref_mean(x, 0)))
    for op in ("amax", "amin", "argmax", "argmin"):
        with pytest.raises(ValueError, match="empty"):
            _ref(op, x, 0)
    assert red.ref_amax(x, 1).shape == (0,)          # nothing to reduce: an empty result


def test_argument_errors():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="dim=2 is out of range"):
        go.sum(x, 2)
    with pytest.raises(ValueError, match="twice"):
        go.sum(x, (1, -1))
    with pytest.raises(TypeError, match="'dim' must be an int or None"):
        go.argmax(x, (0,))
    with pytest.raises(TypeError, match="'dim' must be an int"):
        go.amax(x, 1.0)
    with pytest.raises(TypeError, match="'dim' must be an int"):
        go.mean(x, True)


@needs_torch
@pytest.mark.parametrize("op", OPS)
def test_cpu_path_dtypes(op, rng):
    x = torch.from_numpy(rng.standard_normal((6, 10)).astype(np.float32)).to(torch.bfloat16)
    y = getattr(go, op)(x, 1)
    assert y.dtype == (torch.int64 if op in ARG_OPS else torch.bfloat16)
    _check(op, y.double().numpy() if op in VALUE_OPS else y.numpy(),
           _ref(op, x.double().numpy(), 1), "bfloat16", f"{op} cpu bf16")
    h = rng.standard_normal((3, 7)).astype(np.float16)
    yh = getattr(go, op)(h, dim=0, keepdim=True)
    assert yh.dtype == (np.int64 if op in ARG_OPS else np.float16) and yh.shape == (1, 7)


# ----------------------------------------------------------------------------- CPU: the planner

def test_plan_picks_rows_and_columns():
    # [32768, 4096] contiguous: last dim -> rows; dim 0 -> columns (b contiguous)
    assert red.plan((32768, 4096), (4096, 1), (1,), False) == ("rows", 32768, 1, 4096, 4096, 0, 1, 1, 0)
    assert red.plan((32768, 4096), (4096, 1), (0,), False) == ("cols", 1, 4096, 32768, 0, 1, 4096, 0, 1)
    # middle dim of [A, R, B]: columns over B with A outer
    assert red.plan((4, 6, 130), (780, 130, 1), (1,), False) == ("cols", 4, 130, 6, 780, 1, 130, 130, 1)
    # everything: one row; a transposed input reduces in memory order
    assert red.plan((3, 5), (5, 1), (0, 1), False)[:4] == ("rows", 1, 1, 15)
    assert red.plan((5, 3), (1, 5), (0, 1), False)[:4] == ("rows", 1, 1, 15)
    # ...but argmax needs the logical order: a copy
    assert red.plan((5, 3), (1, 5), (0, 1), True) is None
    # last dim of a transposed matrix: the kept dim is contiguous -> columns, roles swapped
    assert red.plan((5, 3), (1, 5), (1,), False) == ("cols", 1, 5, 3, 0, 1, 5, 0, 1)
    # reduced dims that do not merge (0 and 2 of a contiguous [2, 3, 4]): a copy
    assert red.plan((2, 3, 4), (12, 4, 1), (0, 2), False) is None
    # three separate kept dims: a copy
    assert red.plan((2, 3, 4, 5), (60, 5, 15, 1), (3,), False) is None


def test_rows_config_covers_every_pack():
    for rows, R, vec in [(32768, 4096, 8), (1, 1 << 27, 8), (16, 1 << 20, 4), (3, 37, 8),
                         (5, 1, 1), (7, 100000, 1)]:
        variant, splits, chunk = red.rows_config(rows, R, vec, 132)
        tpr = red.ROW_VARIANTS[variant][1]
        units = R // vec
        assert splits * chunk >= units and (splits - 1) * chunk < max(units, 1)
        assert 1 <= splits <= red.MAX_GRID_Y
        if rows * tpr >= 2 * 132 * 2048:
            assert splits == 1


def test_cols_config_chunks_cover_the_rows():
    for A, B, R, vec in [(1, 4096, 32768, 8), (4, 130, 6, 1), (1, 3, 100000, 1), (100, 64, 64, 4)]:
        splits, rchunk = red.cols_config(A, B, R, vec, 132)
        assert splits * rchunk >= R and (splits - 1) * rchunk < R and splits <= 128


# ----------------------------------------------------------------------------- CPU: kernels, emulated

def _np_dtype(name):
    return dt.to_numpy(dt.BY_NAME[name])


def _data(rng, shape, dtype, kind="positive"):
    x = rng.standard_normal(shape)
    if kind == "positive":                   # sums with condition number ~1: assert_close applies
        x = x + 3.0
    if dtype == "float16":
        x = x * 2.0 ** -8                    # sums of thousands stay far below 65504
    return x.astype(_np_dtype(dtype))


def _emu_run(dev, op, x, dim=None, keepdim=False):
    call = dev.call(op, dt.from_numpy(x.dtype))
    return red._reduce(call, op, dev.tensor(x), dim, keepdim, op in VALUE_OPS).obj


EMU_CASES = [   # (shape, dim, layout)
    ((5, 1000), -1, "contig"),      # rows, warp per row
    ((3, 37), -1, "offset"),        # odd, misaligned rows: head and tail elements
    ((4, 1), -1, "contig"),         # rows of 1
    ((2, 9000), -1, "contig"),      # rows split over several blocks (+ finish)
    ((64, 40), 0, "contig"),        # columns, 16-byte packs, split rows (+ finish)
    ((33, 7), 0, "contig"),         # columns, one element per lane
    ((3, 20, 16), 1, "contig"),     # middle dim
    ((2, 3, 700), None, "offset"),  # everything, split (+ finish)
    ((6, 50), -1, "transposed"),    # last dim of a transposed view: columns
    ((50, 6), 0, "transposed"),     # dim 0 of a transposed view: rows
    ((5, 60), -1, "sliced"),        # strided rows
    ((3, 4, 5), (0, 2), "contig"),  # dims that do not merge: a copy first
]


@needs_emu
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_kernels_layouts(dtype, rng):
    with emu.Device(sms=2) as dev:
        for shape, dim, layout in EMU_CASES:
            x = emu.strided(_data(rng, shape, dtype), layout)
            x64 = x.astype(np.float64)
            for op in OPS:
                if op in ARG_OPS and isinstance(dim, tuple):
                    continue
                y = _emu_run(dev, op, x, dim)
                _check(op, y.astype(np.float64) if op in VALUE_OPS else y, _ref(op, x64, dim),
                       dtype, f"{op} {shape} dim={dim} {layout}")


@needs_emu
def test_emulated_nan_ties_signed_zero_and_broadcast(rng):
    with emu.Device(sms=2) as dev:
        x = rng.standard_normal((6, 300)).astype(np.float32)
        x[1, 17] = x[1, 200] = np.nan
        x[2, :] = 1.5                              # all tied: index 0
        x[3, ::7] = np.inf
        x[4, :] = -0.0
        x[4, 100] = 0.0
        x[5, 250:] = -np.inf
        for dim in (1, 0, None):
            for op in OPS:
                y = _emu_run(dev, op, x, dim)
                _check(op, y, _ref(op, x.astype(np.float64), dim), "float32", f"{op} dim={dim}")
        b = np.broadcast_to(rng.standard_normal((1, 300)).astype(np.float32), (5, 300))
        for dim in (0, 1):
            for op in OPS:
                y = _emu_run(dev, op, b, dim)
                _check(op, y, _ref(op, b.astype(np.float64), dim), "float32", f"broadcast {op} {dim}")


@needs_emu
def test_emulated_workspaces_outlive_the_launches(rng):
    # Freed memory is handed out again at once, as by torch's caching allocator and CuPy's pool:
    # a workspace the host stops referencing before its kernels run shares memory with the next
    # one (the value and index partials of argmax overwrote each other on the GPU).
    with emu_pool.CachingDevice(sms=2) as dev:
        for shape, dim in (((2, 9000), -1), ((64, 40), 0), ((2, 3, 700), None)):
            x = _data(rng, shape, "float32")
            for op in OPS:
                y = np.asarray(_emu_run(dev, op, x, dim))
                _check(op, y, _ref(op, x.astype(np.float64), dim), "float32",
                       f"{op} {shape} dim={dim} (caching allocator)")
        assert dev.reused


@needs_emu
def test_emulated_keepdim_0d_and_empty(rng):
    with emu.Device(sms=2) as dev:
        x = _data(rng, (3, 4), "float32")
        for op in OPS:
            y = _emu_run(dev, op, x, 1, True)
            assert y.shape == (3, 1)
            y = _emu_run(dev, op, x, None, True)
            assert y.shape == (1, 1)
            s = np.array(2.5, np.float32)
            assert _emu_run(dev, op, s, None).shape == ()
        e = np.zeros((0, 5), np.float32)
        np.testing.assert_array_equal(_emu_run(dev, "sum", e, 0), np.zeros(5))
        assert np.all(np.isnan(_emu_run(dev, "mean", e, 0)))
        assert _emu_run(dev, "amax", e, 1).shape == (0,)
        with pytest.raises(ValueError, match="empty"):
            _emu_run(dev, "argmax", e, 0)


@needs_emu
def test_emulated_sum_error_scales_with_abs_sum(rng):
    # mixed signs (cancellation): the fp32 error is bounded by a small multiple of eps * sum|x|
    with emu.Device(sms=2) as dev:
        x = rng.standard_normal((3, 20000)).astype(np.float32)
        y = _emu_run(dev, "sum", x, 1).astype(np.float64)
        x64 = x.astype(np.float64)
        bound = 64 * 2.0 ** -24 * np.abs(x64).sum(1)
        assert np.all(np.abs(y - x64.sum(1)) <= bound)


# ----------------------------------------------------------------------------- GPU

def _randn(shape, dtype, shift=3.0):
    # positive mean: sums are well conditioned (assert_close applies); float16 scaled by 2^-8 so
    # that sums of millions stay below its 65504
    scale = 2.0 ** -8 if dtype == "float16" else 1.0
    return ((torch.randn(shape, device="cuda") + shift) * scale).to(getattr(torch, dtype))


def _host(t):
    return t.double().cpu().numpy() if t.is_floating_point() else t.cpu().numpy()


def _gpu_check(op, x, dim=None, keepdim=False, what=""):
    y = getattr(go, op)(x, dim, keepdim)
    dtype = str(x.dtype).split(".")[-1]
    assert y.dtype == (torch.int64 if op in ARG_OPS else x.dtype), what
    assert y.device == x.device
    _check(op, _host(y), _ref(op, _host(x), dim, keepdim), dtype, f"{op} {dtype} {what}")
    return y


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_gpu_rows(op, dtype):
    for n in (1, 3, 1000, 4097, 32768):
        _gpu_check(op, _randn((257, n), dtype), -1, what=f"rows of {n}")
    _gpu_check(op, _randn((3, 1 << 20), dtype), -1, what="long rows (split)")
    _gpu_check(op, _randn((1 << 22,), dtype), None, what="everything (split)")
    _gpu_check(op, _randn((4097,), dtype)[1:], 0, what="misaligned row")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_gpu_columns_and_middle_dims(op, dtype):
    _gpu_check(op, _randn((4096, 2048), dtype), 0, what="dim 0 (columns, split)")
    _gpu_check(op, _randn((1000, 37), dtype), 0, what="odd columns")
    _gpu_check(op, _randn((16, 300, 64), dtype), 1, what="middle dim")
    _gpu_check(op, _randn((3, 1, 5, 7), dtype), 2, keepdim=True, what="keepdim")
    if op in VALUE_OPS:
        _gpu_check(op, _randn((6, 40, 50), dtype), (0, 2), what="dims (0, 2): copy")
        _gpu_check(op, _randn((6, 40, 50), dtype), (1, 2), what="dims (1, 2): merged")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_gpu_strided_views(op, dtype):
    base = _randn((300, 200), dtype)
    _gpu_check(op, base.t(), -1, what="transposed, last dim")
    _gpu_check(op, base.t(), 0, what="transposed, dim 0")
    _gpu_check(op, base[:, 1::3], -1, what="sliced")
    _gpu_check(op, base[:, 1::3], None, what="sliced, everything")
    _gpu_check(op, base[1:, 1:], 1, what="offset")
    _gpu_check(op, _randn((1, 200), dtype).expand(50, 200), 0, what="expanded")
    _gpu_check(op, _randn((4, 5, 6, 7), dtype).permute(2, 0, 3, 1), 1, what="permuted 4-d")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_nan_inf_ties_as_torch(dtype):
    x = torch.randn(64, 999, device="cuda").to(getattr(torch, dtype))
    x[1, 17] = x[1, 400] = float("nan")
    x[2] = 1.5
    x[3, ::7] = float("inf")
    x[4] = -0.0
    x[5, 500:] = -float("inf")
    x[6, 998] = float("nan")
    for op in OPS:
        for dim in (1, 0, None):
            y = getattr(go, op)(x, dim)
            expected = getattr(torch, op)(x.float(), dim) if dim is not None else getattr(torch, op)(x.float())
            got = _host(y)
            exp = expected.double().cpu().numpy() if expected.is_floating_point() else expected.cpu().numpy()
            if op in ARG_OPS:
                np.testing.assert_array_equal(got, exp, err_msg=f"{op} {dim}")
            elif op in ("amax", "amin"):
                np.testing.assert_array_equal(np.isnan(got), np.isnan(exp))
                ok = ~np.isnan(exp)
                np.testing.assert_array_equal(got[ok], exp[ok].astype(got.dtype))


@gpu
@needs_torch_cuda
def test_gpu_empty_and_0d():
    e = torch.empty(0, 5, device="cuda")
    assert torch.equal(go.sum(e, 0), torch.zeros(5, device="cuda"))
    assert torch.isnan(go.mean(e, 0)).all()
    with pytest.raises(ValueError, match="empty"):
        go.amax(e, 0)
    s = torch.tensor(2.5, device="cuda")
    assert go.sum(s).item() == 2.5 and go.argmax(s, 0).item() == 0


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_cupy_and_numpy(dtype):
    import cupy as cp
    npdt = _np_dtype(dtype)
    try:
        x = (cp.random.standard_normal((129, 65), dtype=np.float32) + 3).astype(npdt)
    except Exception:
        pytest.skip(f"this CuPy cannot make {dtype} arrays")
    for op in OPS:
        y = getattr(go, op)(x, 1)
        assert isinstance(y, cp.ndarray)
        _check(op, cp.asnumpy(y).astype(np.float64) if op in VALUE_OPS else cp.asnumpy(y),
               _ref(op, cp.asnumpy(x).astype(np.float64), 1), dtype, f"cupy {op}")
    h = cp.asnumpy(x)
    m = go.mean(h, 0)
    assert isinstance(m, np.ndarray) and m.dtype == h.dtype
    assert_close(m.astype(np.float64), red.ref_mean(h.astype(np.float64), 0), dtype, "numpy mean")


@gpu
@needs_torch_cuda
def test_gpu_cuda_graph_and_side_stream():
    side = torch.cuda.Stream()
    x = _randn((4, 4096), "bfloat16")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for op in OPS:                       # warm-up (loads the module) outside the capture
            getattr(go, op)(x, -1)
        go.sum(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = {op: getattr(go, op)(x, -1) for op in OPS}
        total = go.sum(x)                    # split: partials and a finishing kernel
    for _ in range(2):
        x.copy_(_randn((4, 4096), "bfloat16"))
        graph.replay()
        torch.cuda.synchronize()
        for op, y in outs.items():
            _check(op, _host(y), _ref(op, _host(x), -1), "bfloat16", f"graph {op}")
        assert_close(_host(total), red.ref_sum(_host(x)), "bfloat16", "graph total")


@gpu
@needs_torch_cuda
def test_gpu_results_are_deterministic():
    x = torch.randn(1 << 22, device="cuda")
    a, b = go.sum(x), go.sum(x)
    assert torch.equal(a, b)
    c, d = go.sum(x.view(1024, 4096), 0), go.sum(x.view(1024, 4096), 0)
    assert torch.equal(c, d)
