"""topk against the float64 reference (exact: values are input elements, indices follow the same
order): on the CPU (reference against torch, errors, the CPU path, the level planner, and the
kernels run by the emulator of tests/emu.py: warp-per-row selection, block radix select, two and
three launches over candidates, ties, NaN, -0.0, largest=False, sorted=False, strided rows) and on
the GPU (MoE routing shapes, rows of 4096..262144 with k up to 1024, every dtype, non-last dims,
views, CUDA graphs).

Ties: equal values go to the smaller index (the selected set of a tie at the k-th value is its
lowest indices; sorted output lists equal values by index), NaN is larger than every number, and
-0.0 is smaller than +0.0, as torch.topk on CUDA (whose radix keys are the float bits). With
sorted=False the kernels return a set (compared as a set) in index order.
"""
from __future__ import annotations

import numpy as np
import pytest

import gpuops as go
from gpuops import dtypes as dt
from gpuops.ops import topk as tk
from conftest import HAS_TORCH, gpu, needs_torch, needs_torch_cuda

import emu
from emu import needs_emu  # noqa: E402
import emu_pool

torch = pytest.importorskip("torch") if HAS_TORCH else None

DTYPES = ["float32", "float16", "bfloat16"]


def _np_dtype(name):
    return dt.to_numpy(dt.BY_NAME[name])


def _compare(x, vals, idx, k, dim, largest, sorted_, what):
    """Exact comparison with the reference; as sets (with values matching x) when unsorted."""
    x64 = np.asarray(x, dtype=np.float64)
    rv, ri = tk.ref_topk(x64, k, dim, largest, sorted_)
    vals = np.asarray(vals, dtype=np.float64)
    idx = np.asarray(idx)
    assert idx.dtype == np.int64, what
    assert vals.shape == rv.shape and idx.shape == ri.shape, what
    if sorted_:
        np.testing.assert_array_equal(idx, ri, err_msg=what)
        np.testing.assert_array_equal(vals, rv, err_msg=what)
    else:
        np.testing.assert_array_equal(np.sort(idx, axis=dim), np.sort(ri, axis=dim), err_msg=what)
        np.testing.assert_array_equal(vals, np.take_along_axis(x64, idx, axis=dim), err_msg=what)


# ----------------------------------------------------------------------------- CPU: reference

@needs_torch
def test_reference_matches_torch_without_ties(rng):
    x = rng.permutation(4000).reshape(5, 800).astype(np.float64) - 2000.0
    for dim in (0, 1, -1):
        for largest in (True, False):
            for k in (1, 5, 5 if dim == 0 else 800):
                rv, ri = tk.ref_topk(x, k, dim, largest)
                tv, ti = torch.topk(torch.from_numpy(x), k, dim, largest)
                np.testing.assert_array_equal(rv, tv.numpy())
                np.testing.assert_array_equal(ri, ti.numpy())


def test_reference_order_nan_ties_and_signed_zero():
    x = np.array([1.0, np.nan, 3.0, np.nan, -0.0, 0.0, 3.0, -np.inf, np.inf])
    v, i = tk.ref_topk(x, 9)
    np.testing.assert_array_equal(i, [1, 3, 8, 2, 6, 0, 5, 4, 7])
    v, i = tk.ref_topk(x, 9, largest=False)
    np.testing.assert_array_equal(i, [7, 4, 5, 0, 2, 6, 8, 1, 3])
    v, i = tk.ref_topk(x, 2, largest=False)
    np.testing.assert_array_equal(v, [-np.inf, -0.0])
    assert np.signbit(v[1])


def test_argument_errors():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="k=4 is out of range"):
        go.topk(x, 4)
    with pytest.raises(ValueError, match="k=-1 is out of range"):
        go.topk(x, -1)
    with pytest.raises(ValueError, match="at most k = 1024"):
        go.topk(np.ones((2, 2000), np.float32), 1025)
    with pytest.raises(ValueError, match="dim=2 is out of range"):
        go.topk(x, 1, 2)
    with pytest.raises(TypeError, match="'k' must be an int"):
        go.topk(x, 1.5)


@needs_torch
def test_cpu_path(rng):
    x = torch.from_numpy(rng.standard_normal((6, 50)).astype(np.float32)).to(torch.bfloat16)
    v, i = go.topk(x, 5)
    assert v.dtype == torch.bfloat16 and i.dtype == torch.int64 and v.shape == (6, 5)
    _compare(x.double().numpy(), v.double().numpy(), i.numpy(), 5, -1, True, True, "cpu")
    s = torch.tensor(2.5)
    v, i = go.topk(s, 1)
    assert v.shape == () and v.item() == 2.5 and i.item() == 0


def test_block_levels():
    assert tk.block_levels(4096, 8, 16384) == [(4096, 1, 8)]
    assert tk.block_levels(131072, 1024, 16384) == [(131072, 8, 1024), (8192, 1, 1024)]
    assert tk.block_levels(262144, 1024, 16384) == [(262144, 16, 1024), (16384, 1, 1024)]
    assert tk.block_levels(1 << 20, 1024, 8192) == [(1 << 20, 128, 1024), (131072, 16, 1024),
                                                    (16384, 2, 1024), (2048, 1, 1024)]
    assert tk.chunk_capacity(227 * 1024) == 16384 and tk.chunk_capacity(48 * 1024) == 8192


# ----------------------------------------------------------------------------- CPU: kernels, emulated

def _data(rng, shape, dtype, special=False):
    x = rng.standard_normal(shape)
    if special:
        x = np.round(x * 4) / 4                # many ties
        flat = x.reshape(-1)
        flat[::13] = np.nan
        flat[5::29] = -0.0
        flat[7::31] = 0.0
        flat[11::37] = np.inf
        flat[3::41] = -np.inf
    return x.astype(_np_dtype(dtype))


def _emu_run(dev, x, k, dim=-1, largest=True, sorted_=True):
    call = dev.call("topk", dt.from_numpy(x.dtype))
    v, i = tk._topk(call, dev.tensor(x), k, dim % max(x.ndim, 1), largest, sorted_)
    return v.obj, i.obj


EMU_CASES = [   # (shape, k, dim, layout)
    ((50, 128), 8, -1, "contig"),       # MoE: a warp per row
    ((20, 33), 2, -1, "offset"),        # odd rows, misaligned
    ((9, 256), 32, -1, "contig"),       # warp kernel limits
    ((40, 6), 3, 0, "contig"),          # a non-last dim (strided rows)
    ((3, 700), 700, -1, "contig"),      # block kernel, k = R
    ((4, 1000), 50, -1, "sliced"),      # block kernel, strided rows
    ((2, 9000), 64, -1, "contig"),      # chunks -> candidates -> final
    ((2, 5000), 1000, -1, "offset"),    # three launches (chunk 2048, k = 1000)
    ((3, 3000, 2), 100, 1, "contig"),   # a middle dim through candidates
]


@needs_emu
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_kernels(dtype, rng):
    with emu.Device(sms=2, topk_chunk=2048) as dev:
        for shape, k, dim, layout in EMU_CASES:
            for special in (False, True):
                x = emu.strided(_data(rng, shape, dtype, special), layout)
                for largest, sorted_ in ((True, True), (False, True), (True, False)):
                    v, i = _emu_run(dev, x, k, dim, largest, sorted_)
                    assert v.dtype == x.dtype
                    _compare(x, v, i, k, dim, largest, sorted_,
                             f"{shape} k={k} dim={dim} {layout} special={special} "
                             f"largest={largest} sorted={sorted_}")


@needs_emu
def test_emulated_warp_kernel_before_sm80(rng):
    # sm_61..sm_75 reduce with shuffles instead of REDUX
    with emu.Device(sms=2, arch=610) as dev:
        for dtype in DTYPES:
            x = _data(rng, (30, 160), dtype, special=True)
            for largest in (True, False):
                v, i = _emu_run(dev, x, 8, -1, largest)
                _compare(x, v, i, 8, -1, largest, True, f"sm61 {dtype} largest={largest}")


@needs_emu
def test_emulated_candidates_outlive_the_launches(rng):
    # Freed memory is handed out again at once, as by torch's caching allocator and CuPy's pool:
    # candidate keys and indices the host stops referencing before the next launch reads them
    # share memory (every index came back INT_MAX on the GPU).
    with emu_pool.CachingDevice(sms=2, topk_chunk=2048) as dev:
        for shape, k in (((2, 9000), 64), ((2, 5000), 1000), ((3, 4100), 7)):
            x = _data(rng, shape, "float32", True)
            v, i = _emu_run(dev, x, k)
            _compare(x, np.asarray(v), np.asarray(i), k, -1, True, True,
                     f"{shape} k={k} (caching allocator)")
        assert dev.reused


@needs_emu
def test_emulated_all_equal_rows_and_0d():
    with emu.Device(sms=2, topk_chunk=2048) as dev:
        x = np.full((2, 3000), 1.25, np.float32)
        v, i = _emu_run(dev, x, 100)
        np.testing.assert_array_equal(i, np.tile(np.arange(100), (2, 1)))
        s = np.array(2.5, np.float32)
        v, i = _emu_run(dev, s, 1)
        assert v.shape == () and v == 2.5 and i == 0
        v, i = _emu_run(dev, np.zeros((3, 5), np.float32), 0)
        assert v.shape == (3, 0) and i.shape == (3, 0)


# ----------------------------------------------------------------------------- GPU

def _randn(shape, dtype):
    return torch.randn(shape, device="cuda").to(getattr(torch, dtype))


def _gpu_check(x, k, dim=-1, largest=True, sorted_=True, what=""):
    v, i = go.topk(x, k, dim, largest, sorted_)
    assert v.dtype == x.dtype and i.dtype == torch.int64 and v.device == x.device
    _compare(x.double().cpu().numpy(), v.double().cpu().numpy(), i.cpu().numpy(), k, dim,
             largest, sorted_, f"{x.dtype} {tuple(x.shape)} k={k} {what}")
    return v, i


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_moe_routing(dtype):
    for experts in (8, 60, 64, 128, 160, 256):
        for k in (1, 2, 4, 8):
            _gpu_check(_randn((4099, experts), dtype), k, what="moe")
    _gpu_check(_randn((32768, 128), dtype), 8, what="moe bench shape")
    _gpu_check(_randn((1000, 256), dtype), 32, largest=False, what="moe smallest")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_long_rows(dtype):
    for n, k in [(4096, 1), (4096, 100), (4097, 1024), (16384, 1024), (16385, 7),
                 (131072, 1024), (262144, 1024), (1 << 20, 64)]:
        rows = max(1, (1 << 20) // n)
        x = _randn((min(rows, 64), n), dtype)
        _gpu_check(x, k, what="sorted")
        _gpu_check(x, k, sorted_=False, what="unsorted")
        _gpu_check(x, k, largest=False, what="smallest")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_ties_nan_signed_zero(dtype):
    x = torch.round(torch.randn(16, 50000, device="cuda") * 4) / 4
    x[:, ::13] = float("nan")
    x[:, 5::29] = -0.0
    x[:, 11::37] = float("inf")
    x[3] = 0.5                                  # all equal
    x = x.to(getattr(torch, dtype))
    for k in (1, 10, 1024):
        for largest in (True, False):
            _gpu_check(x, k, largest=largest, what="ties")
    m = torch.round(torch.randn(512, 128, device="cuda")).to(getattr(torch, dtype))
    m[:, 7] = float("nan")
    for largest in (True, False):
        _gpu_check(m, 8, largest=largest, what="moe ties")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_dims_and_views(dtype):
    base = _randn((300, 2000), dtype)
    _gpu_check(base, 5, dim=0, what="dim 0")
    _gpu_check(base.t(), 50, what="transposed")
    _gpu_check(base[:, 1::3], 20, what="sliced")
    _gpu_check(base[1:, 1:], 1024, what="offset")
    _gpu_check(_randn((8, 6, 100), dtype), 3, dim=1, what="middle dim (warp kernel)")
    _gpu_check(_randn((3, 5000, 4), dtype), 600, dim=1, what="middle dim (block kernel)")
    v, i = go.topk(_randn((3, 0), dtype), 0)
    assert v.shape == (3, 0)


@gpu
@needs_torch_cuda
def test_gpu_values_match_torch():
    for shape, k in [((32768, 128), 8), ((64, 131072), 1024)]:
        x = torch.randn(shape, device="cuda")
        v, i = go.topk(x, k)
        tv, ti = torch.topk(x, k)
        assert torch.equal(v, tv)
        assert torch.equal(x.gather(-1, i), v), "indices do not point at the values"
        assert torch.equal(i.sort(-1).values.diff(dim=-1).min() > 0, torch.tensor(True,
                           device="cuda")), "an index repeats within a row"
        # fp32 normals do tie now and then (2^23 mantissas, 131072 draws per row); where the
        # indices differ from torch's, the value must occur more than once in its row
        for r, c in (i != ti).nonzero().tolist():
            assert int((x[r] == v[r, c]).sum()) >= 2, (r, c, float(v[r, c]))


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_cupy(dtype):
    import cupy as cp
    try:
        x = cp.random.standard_normal((129, 5000), dtype=np.float32).astype(_np_dtype(dtype))
    except Exception:
        pytest.skip(f"this CuPy cannot make {dtype} arrays")
    v, i = go.topk(x, 33)
    assert isinstance(v, cp.ndarray) and isinstance(i, cp.ndarray)
    _compare(cp.asnumpy(x).astype(np.float64), cp.asnumpy(v).astype(np.float64), cp.asnumpy(i),
             33, -1, True, True, "cupy")


@gpu
@needs_torch_cuda
def test_gpu_cuda_graph():
    scores = _randn((16, 128), "bfloat16")
    logits = _randn((8, 131072), "float32")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        go.topk(scores, 8)
        go.topk(logits, 1024)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe = go.topk(scores, 8)
        top = go.topk(logits, 1024)                 # candidates in graph-owned workspaces
    for _ in range(3):
        scores.copy_(_randn((16, 128), "bfloat16"))
        logits.copy_(_randn((8, 131072), "float32"))
        graph.replay()
        torch.cuda.synchronize()
        _compare(scores.double().cpu().numpy(), moe[0].double().cpu().numpy(), moe[1].cpu().numpy(),
                 8, -1, True, True, "graph moe")
        _compare(logits.double().cpu().numpy(), top[0].double().cpu().numpy(), top[1].cpu().numpy(),
                 1024, -1, True, True, "graph long")
