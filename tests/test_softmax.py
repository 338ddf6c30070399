"""softmax, log_softmax and their backward ops against float64 references: on the CPU (the
references against torch, argument errors, layouts and configs, every kernel's index mapping in
a bounds-checked simulation, autograd and torch.compile through the references) and on the GPU
(every dtype, rows of 1 to 393,216 elements, inner dims, transposed / sliced / channels-last /
unaligned inputs, poisoned and in-place outputs, NaN/inf as torch, a CUDA graph, a side stream,
gradients against torch, torch.compile)."""
from __future__ import annotations

import numpy as np
import pytest

import gpuops as go
from gpuops.ops import softmax as sm
from conftest import HAS_TORCH, TOLERANCE, assert_close, gpu, needs_torch, needs_torch_cuda
import softmax_sim as sim

torch = pytest.importorskip("torch") if HAS_TORCH else None

DTYPES = ["float32", "float16", "bfloat16"]
FWD = [("softmax", False), ("log_softmax", True)]
BWD = [("softmax_backward", False), ("log_softmax_backward", True)]


def _ref(name, *arrays, **kw):
    return getattr(sm, f"ref_{name}")(*arrays, **kw)


# ----------------------------------------------------------------------------- CPU: references

@needs_torch
@pytest.mark.parametrize("shape,dim", [((5, 7), -1), ((5, 7), 0), ((2, 3, 4, 5), 1), ((6,), 0),
                                       ((), 0), ((3, 1), -1), ((4, 0), 0)])
def test_references_match_torch(shape, dim, rng):
    x = rng.standard_normal(shape) * 4
    tx = torch.from_numpy(np.asarray(x))
    np.testing.assert_allclose(sm.ref_softmax(x, dim), torch.softmax(tx, dim).numpy(), rtol=1e-13)
    np.testing.assert_allclose(sm.ref_log_softmax(x, dim), torch.log_softmax(tx, dim).numpy(),
                               rtol=1e-13, atol=1e-15)
    g = rng.standard_normal(shape)
    y = torch.softmax(tx, dim)
    tg = torch.from_numpy(np.asarray(g))
    np.testing.assert_allclose(sm.ref_softmax_backward(g, y.numpy(), dim),
                               torch._softmax_backward_data(tg, y, dim, y.dtype).numpy(),
                               rtol=1e-12, atol=1e-15)
    ly = torch.log_softmax(tx, dim)
    np.testing.assert_allclose(sm.ref_log_softmax_backward(g, ly.numpy(), dim),
                               torch._log_softmax_backward_data(tg, ly, dim, ly.dtype).numpy(),
                               rtol=1e-12, atol=1e-15)


SPECIAL_ROWS = np.array([
    [1.0, 2.0, 3.0, -np.inf],          # -inf is 0 / -inf
    [np.inf, 1.0, 2.0, 3.0],           # +inf: NaN row (torch)
    [-np.inf] * 4,                     # all -inf: NaN row (torch)
    [np.nan, 1.0, 2.0, 3.0],           # NaN row
    [1e30, -1e30, 0.0, 5.0],
    [88.0, 89.0, -100.0, 0.0],
])


@needs_torch
def test_references_nan_and_inf_as_torch():
    t = torch.from_numpy(SPECIAL_ROWS)
    for name, fn in (("softmax", torch.softmax), ("log_softmax", torch.log_softmax)):
        ref = _ref(name, SPECIAL_ROWS, dim=-1)
        exp = fn(t, -1).numpy()
        np.testing.assert_array_equal(np.isnan(ref), np.isnan(exp))
        ok = np.isfinite(exp)
        np.testing.assert_array_equal(ref[~ok & ~np.isnan(exp)], exp[~ok & ~np.isnan(exp)])
        np.testing.assert_allclose(ref[ok], exp[ok], rtol=1e-13)


def test_argument_errors():
    x = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match="dim=2 is out of range"):
        go.softmax(x, 2)
    with pytest.raises(TypeError, match="'dim' must be an int"):
        go.log_softmax(x, 1.0)
    with pytest.raises(ValueError, match="'grad_output' has shape"):
        go.softmax_backward(np.zeros((3, 5), np.float32), x)


@needs_torch
def test_cpu_path_keeps_dtype_and_framework(rng):
    x = torch.from_numpy(rng.standard_normal((6, 10)).astype(np.float32)).to(torch.bfloat16)
    y = go.softmax(x, 0)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert_close(y.double().numpy(), sm.ref_softmax(x.double().numpy(), 0), "bfloat16", "cpu")


# ----------------------------------------------------------------------------- CPU: layouts

def test_layouts():
    L = sm.Layout.of
    lay = L((8, 16), 1, [(16, 1), (16, 1)])
    assert (lay.kind, lay.rows, lay.n, lay.row_strides) == ("rows", 8, 16, (16, 16))
    lay = L((8, 16), 1, [(32, 1), (16, 1)])                      # sliced rows
    assert (lay.kind, lay.row_strides) == ("rows", (32, 16))
    lay = L((2, 3, 4, 5), 1, [(60, 20, 5, 1)] * 2)               # inner dim
    assert (lay.kind, lay.O, lay.n, lay.I) == ("cols", 2, 3, 20)
    assert lay.strides[0] == (60, 20, 1)
    lay = L((2, 3, 4, 5), 1, [(60, 1, 15, 3)] * 2)               # channels last: rows along C
    assert (lay.kind, lay.rows, lay.n, lay.row_strides) == ("rows", 40, 3, (3, 3))
    lay = L((5, 7), 1, [(1, 5)] * 2)                             # transposed
    assert (lay.kind, lay.O, lay.I, lay.strides[0]) == ("cols", 1, 5, (0, 5, 1))
    assert L((2, 3, 4, 5), 1, [(120, 20, 10, 1)] * 2) is None    # sliced in two other dims
    assert L((), 0, [(), ()]).kind == "rows"
    assert sm.like_strides((5, 7), (1, 5)) == (1, 5)
    assert sm.like_strides((2, 3, 4, 5), (60, 1, 15, 3)) == (60, 1, 15, 3)
    assert sm.like_strides((8, 16), (32, 1)) == (16, 1)           # not dense: contiguous
    assert sm.like_strides((8, 1, 16), (16, 99, 1)) == (16, 16, 1)


def test_row_and_split_configs(monkeypatch):
    monkeypatch.setattr(sm, "sm_count", lambda dev: 132)
    for packs in list(range(1, 300)) + [512, 1000, 1024, 4095, 4096, 8191, 8192, 16384]:
        for choices in (sm.ROW_P[True], sm.ROW_P[False], sm.ROW_BWD_P[True], sm.ROW_BWD_P[False]):
            for few_rows in (False, True):
                cfg = sm.row_config(packs, choices, few_rows)
                if packs > 1024 * choices[-1]:
                    assert cfg is None
                    continue
                tx, p = cfg
                assert tx & (tx - 1) == 0 and p in choices and tx * p >= packs
                assert tx <= 32 or tx >= 64
                if few_rows and packs >= 64 * choices[0]:
                    assert tx >= 64 and tx <= packs        # every thread holds a pack
                elif few_rows:
                    assert cfg == sm.row_config(packs, choices)
    assert sm.row_config(512, sm.ROW_P[True]) == (128, 4)        # [*, 4096] bf16
    assert sm.row_config(1024, sm.ROW_P[True]) == (256, 4)       # [*, 4096] fp32
    assert sm.row_config(256, sm.ROW_P[True]) == (32, 8)         # [*, 2048] bf16: a warp per row
    # the forward's 16-byte rows: a warp holds at most WARP_ROW_MAX_PACKS (4) packs per thread
    # (run 173): rows of 256 packs ([*, 2048] bf16, [*, 1024] fp32) take 64 threads x 4 packs
    warp4 = sm.WARP_ROW_MAX_PACKS
    assert sm.row_config(256, sm.ROW_P[True], False, warp4) == (64, 4)
    assert sm.row_config(128, sm.ROW_P[True], False, warp4) == (32, 4)   # [*, 1024] bf16
    assert sm.row_config(129, sm.ROW_P[True], False, warp4) == (64, 4)
    assert sm.row_config(512, sm.ROW_P[True], False, warp4) == (128, 4)
    for packs in list(range(1, 300)) + [1024, 8192]:
        tx, p = sm.row_config(packs, sm.ROW_P[True], False, warp4)
        assert tx * p >= packs and (tx >= 64 or p <= warp4), packs
    assert sm.row_config(256, sm.ROW_P[True], True) == (128, 2)  # [16, 2048] bf16: 128 threads
    assert sm.row_config(512, sm.ROW_P[True], True) == (256, 2)  # [16, 2048] fp32
    assert sm.row_config(256, sm.ROW_BWD_P[True], True) == (128, 2)
    for rows, n, vec in [(8, 393216, 4), (1, 10 ** 6, 8), (16, 151936, 8), (5000, 70000, 1)]:
        chunk, S = sm.split_config(rows, n, vec, 0)
        assert chunk % (256 * vec) == 0 and (S - 1) * chunk < n <= S * chunk
    assert sm.split_config(8, 393216, 4, 0) == (3072, 128)


# ----------------------------------------------------------------------------- CPU: simulated kernels

def _sim_forward(monkeypatch, name, dtype, x, dim, view=None, out_view=None):
    d = sim.FLOAT_DTYPES[dtype]

    def build(mem):
        xt = sim.upload(mem, x, d, view)
        kw = {}
        if out_view is not None:
            kw["out"] = sim.upload(mem, np.full(out_view[0], np.nan), d, out_view[1])
        return (xt, dim), kw
    out, launched = sim.run_op(monkeypatch, name, d, build)
    return out, launched


SIM_CASES = [   # (id, shape, dim, view, expected kernel)
    ("rows_short", (37, 5), -1, None, "softmax_rows<"),
    ("rows_warp", (9, 96), -1, None, "softmax_rows<"),
    ("rows_block", (3, 1000), 1, None, "softmax_rows<"),
    ("rows_odd", (3, 4097), -1, None, "softmax_rows<"),
    ("rows_one", (4, 1), -1, None, "softmax_rows<"),
    ("scalar", (), 0, None, "softmax_rows<"),
    ("split", (2, 17001), -1, None, "softmax_split_apply<"),
    ("split_vec", (3, 66560), -1, None, "softmax_split_apply<"),
    ("cols_inner", (2, 5, 3, 8), 1, None, "softmax_cols<"),
    ("cols_dim0", (7, 16), 0, None, "softmax_cols<"),
    ("cols_wide", (2, 3, 4096), 1, None, "softmax_cols<"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", SIM_CASES, ids=[c[0] for c in SIM_CASES])
@pytest.mark.parametrize("name,log", FWD)
def test_simulated_forward(monkeypatch, rng, name, log, case, dtype):
    cid, shape, dim, view, expect = case
    x = rng.standard_normal(shape) * 3
    out, launched = _sim_forward(monkeypatch, name, dtype, x, dim, view)
    assert any(expect in e for e in launched), launched
    np.testing.assert_allclose(sim.values(out), _ref(name, x, dim=dim), rtol=1e-12, atol=1e-14)


def test_simulated_layouts(monkeypatch, rng):
    # transposed input: the output takes its layout and the column kernel walks both coalesced
    x = rng.standard_normal((40, 24))
    out, launched = _sim_forward(monkeypatch, "softmax", "float32", x.T.copy(), -1,
                                 view=lambda a: a.permute(1, 0).contiguous().permute(1, 0))
    assert out.strides == (1, 24) and "softmax_cols<float, true" in launched[-1]
    np.testing.assert_allclose(sim.values(out), sm.ref_softmax(x.T, -1), rtol=1e-12)
    # channels-last 4-D tensor, softmax over C: rows, vectorized
    x = rng.standard_normal((2, 16, 3, 5))
    out, launched = _sim_forward(monkeypatch, "log_softmax", "bfloat16", x, 1,
                                 view=lambda a: a.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2))
    assert "softmax_rows<gpuops::bfloat16_t, true" in launched[-1]
    np.testing.assert_allclose(sim.values(out), sm.ref_log_softmax(x, 1), rtol=1e-12)
    # sliced rows, unaligned start: scalar rows
    big = rng.standard_normal((6, 70))
    out, launched = _sim_forward(monkeypatch, "softmax", "float32", big, -1,
                                 view=lambda a: sim.strided_view(a, (6, 64), (70, 1), 3))
    assert "softmax_rows<float, false" in launched[-1]
    np.testing.assert_allclose(sim.values(out), sm.ref_softmax(big[:, 3:67], -1), rtol=1e-12)
    # sliced in two other dims: copied to a contiguous array first
    big = rng.standard_normal((2, 3, 8, 5))
    out, launched = _sim_forward(monkeypatch, "softmax", "float32", big, 1,
                                 view=lambda a: sim.strided_view(a, (2, 3, 4, 5), (120, 40, 10, 1)))
    np.testing.assert_allclose(sim.values(out), sm.ref_softmax(big[:, :, ::2], 1), rtol=1e-12)
    # out= with its own strides, and in place
    x = rng.standard_normal((5, 33))
    out, _ = _sim_forward(monkeypatch, "softmax", "float32", x, -1,
                          out_view=((33, 5), lambda a: a.permute(1, 0)))
    np.testing.assert_allclose(sim.values(out), sm.ref_softmax(x, -1), rtol=1e-12)

    def build(mem):
        xt = sim.upload(mem, x, sim.FLOAT_DTYPES["float16"])
        return (xt, 0), {"out": xt}
    out, _ = sim.run_op(monkeypatch, "log_softmax", sim.FLOAT_DTYPES["float16"], build)
    np.testing.assert_allclose(sim.values(out), sm.ref_log_softmax(x, 0), rtol=1e-12)


BWD_SIM = [("rows", (6, 200), -1), ("rows_odd", (2, 4097), -1), ("split", (2, 33000), -1),
           ("cols", (3, 9, 16), 1), ("dim0", (33, 8), 0)]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", BWD_SIM, ids=[c[0] for c in BWD_SIM])
@pytest.mark.parametrize("name,log", BWD)
def test_simulated_backward(monkeypatch, rng, name, log, case, dtype):
    _, shape, dim = case
    g = rng.standard_normal(shape)
    y = rng.standard_normal(shape) if log else rng.random(shape)
    d = sim.FLOAT_DTYPES[dtype]

    def build(mem):
        return (sim.upload(mem, g, d), sim.upload(mem, y, d), dim), {}
    out, _ = sim.run_op(monkeypatch, name, d, build)
    ref = _ref(name, g, y, dim=dim)
    # (float64 sums in another order: the cancellation in g - sum(g * y) needs an absolute term)
    tol = dict(rtol=1e-10, atol=1e-12 * np.abs(ref).max())
    np.testing.assert_allclose(sim.values(out), ref, **tol)

    def build_inplace(mem):
        gt_ = sim.upload(mem, g, d)
        return (gt_, sim.upload(mem, y, d), dim), {"out": gt_}
    out, _ = sim.run_op(monkeypatch, name, d, build_inplace)
    np.testing.assert_allclose(sim.values(out), ref, **tol)


# ----------------------------------------------------------------------------- CPU: autograd

@needs_torch
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_autograd_cpu_matches_torch(dim, rng):
    import gpuops.torch as gt
    x = torch.from_numpy(rng.standard_normal((4, 6, 5))).requires_grad_()
    for ours, theirs in ((gt.softmax, torch.softmax), (gt.log_softmax, torch.log_softmax)):
        w = torch.from_numpy(rng.standard_normal((4, 6, 5)))
        y = ours(x, dim)
        (g,) = torch.autograd.grad((y * w).sum(), x)
        y2 = theirs(x, dim)
        (g2,) = torch.autograd.grad((y2 * w).sum(), x)
        np.testing.assert_allclose(y.detach().numpy(), y2.detach().numpy(), rtol=1e-12)
        np.testing.assert_allclose(g.numpy(), g2.numpy(), rtol=1e-10, atol=1e-14)
        # an expanded (stride 0) incoming gradient
        (g,) = torch.autograd.grad(ours(x, dim).sum(), x)
        (g2,) = torch.autograd.grad(theirs(x, dim).sum(), x)
        np.testing.assert_allclose(g.numpy(), g2.numpy(), atol=1e-12)


@needs_torch
def test_torch_compile_fullgraph_cpu(rng):
    import gpuops.torch as gt
    x = torch.from_numpy(rng.standard_normal((4, 7))).requires_grad_()

    def f(x):
        return (gt.log_softmax(x, -1) * gt.softmax(x.t(), 0).t()).sum()
    y = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    (g,) = torch.autograd.grad(y, x)
    x2 = x.detach().clone().requires_grad_()
    y2 = (torch.log_softmax(x2, -1) * torch.softmax(x2.t(), 0).t()).sum()
    (g2,) = torch.autograd.grad(y2, x2)
    np.testing.assert_allclose(y.item(), y2.item(), rtol=1e-12)
    np.testing.assert_allclose(g.numpy(), g2.numpy(), rtol=1e-10, atol=1e-14)


# ----------------------------------------------------------------------------- GPU

def _randn(shape, dtype, scale=3.0):
    return (torch.randn(shape, device="cuda") * scale).to(getattr(torch, dtype))


def _host(t):
    return t.double().cpu().numpy()


# Unit roundoff of the stored operands: half an ulp of the storage type; for float32, 2^-22
# (4 units), the relative error of the forward kernels' y (MUFU exp, fp32 sums) that the
# backward then reads.
_U_STORED = {"float32": 2.0 ** -22, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def _backward_conditioning(log, g, y, dim, u_y):
    """Per-element error that the backward's formula itself gives to perturbations of its inputs,
    beyond what rtol * |dx| covers; added to assert_close's bound by _assert_close_cond.

    log_softmax: dx = g - p S, p = exp(y), S = sum(g). An error e of p (relative) or d of S
    changes dx by p |S| e + p d, however small dx is (cancellation of g against p S). With
    e <= 2^-23 (exp_accurate: < 1 ulp) + u_y |y| (y itself off by u_y |y|: rounding to the
    storage type, or the forward's fp32 error) and d <= 2^-23 sum|g| (fp32 sums: their worst
    case grows as depth * u * sum|g|, their random error as sqrt(depth) u |partial sums|, which
    for these data is far below 2^-23 sum|g|):
        p (|S| (2^-23 + u_y |y|) + 2^-23 sum|g|).
    softmax: dx = y (g - T), T = sum(g y). y off by u_y y changes T by up to u_y sum|g y|, and
    dx by y u_y sum|g y| (+ u_y |dx|, within rtol); T's fp32 sum adds y 2^-23 sum|g y|:
        y (u_y + 2^-23) sum|g y|.
    The old bound (atol + rtol |dx|) had neither term: with |S| ~ 10 and |dx| ~ 1e-3 an exact
    fp32 computation (0.5 ulp for exp and product) can already be 1e-6 off."""
    g = np.moveaxis(np.asarray(g, np.float64), dim, -1)
    y = np.moveaxis(np.asarray(y, np.float64), dim, -1)
    u = 2.0 ** -23
    with np.errstate(all="ignore"):
        if log:
            p = np.exp(y)
            S = np.abs(np.sum(g, -1, keepdims=True))
            A = np.sum(np.abs(g), -1, keepdims=True)
            c = p * (S * (u + u_y * np.abs(y)) + u * A)
        else:
            c = np.abs(y) * (u_y + u) * np.sum(np.abs(g * y), -1, keepdims=True)
    return np.moveaxis(np.nan_to_num(c, nan=0.0, posinf=0.0), -1, dim)


def _assert_close_cond(out, ref, dtype, what, extra):
    """assert_close with the per-element allowance ``extra`` added to its bound."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    tol = TOLERANCE[dtype]
    with np.errstate(invalid="ignore"):
        within = np.abs(out - ref) <= tol["atol"] + tol["rtol"] * np.abs(ref) + extra
    assert_close(np.where(within, ref, out), ref, dtype, what)


def _check_fwd(name, x, dim, dtype, what, **kw):
    y = getattr(go, name)(x, dim, **kw)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(_host(y), _ref(name, _host(x), dim=dim), dtype, f"{name} {dtype} {what}")
    return y


ROW_SHAPES = [(1, 1), (7, 3), (64, 5), (33, 64), (5, 1000), (3, 2048), (4, 4096), (3, 4097),
              (2, 8192), (2, 32768), (2, 65536 + 8), (8, 393216), (3, 100003)]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,log", FWD)
def test_gpu_rows(name, log, dtype):
    for shape in ROW_SHAPES:
        _check_fwd(name, _randn(shape, dtype), -1, dtype, f"rows {shape}")
    _check_fwd(name, _randn((4097, 512), dtype), -1, dtype, "many rows")
    _check_fwd(name, _randn((2, 5, 300), dtype), -1, dtype, "3-d")
    _check_fwd(name, _randn((1000,), dtype), 0, dtype, "1-d")
    _check_fwd(name, _randn((), dtype), 0, dtype, "0-d")
    _check_fwd(name, _randn((160, 16384), dtype), -1, dtype, "medium rows, many")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,log", FWD)
def test_gpu_other_dims_and_layouts(name, log, dtype):
    x = _randn((4, 19, 8, 12), dtype)
    for dim in (0, 1, 2, -1):
        _check_fwd(name, x, dim, dtype, f"4-d dim={dim}")
    _check_fwd(name, _randn((3, 1024, 64), dtype), 1, dtype, "long inner reduction")
    _check_fwd(name, _randn((300, 2, 5), dtype), 0, dtype, "dim 0, few columns")
    t = _randn((96, 37), dtype).t()
    y = _check_fwd(name, t, -1, dtype, "transposed")
    assert y.stride() == t.stride()
    cl = _randn((2, 24, 7, 9), dtype).to(memory_format=torch.channels_last)
    y = _check_fwd(name, cl, 1, dtype, "channels last, dim=1")
    assert y.stride() == cl.stride()
    _check_fwd(name, _randn((6, 1030), dtype)[:, 3:1027], -1, dtype, "sliced, unaligned rows")
    _check_fwd(name, _randn((6, 1040), dtype)[:, :1024], -1, dtype, "sliced, aligned rows")
    _check_fwd(name, _randn((5, 8, 16), dtype)[:, ::2, :3], 1, dtype, "sliced twice (copied)")
    _check_fwd(name, _randn((1, 4096), dtype).expand(6, 4096), -1, dtype, "expanded rows")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,log", FWD)
def test_gpu_out_poisoned_and_in_place(name, log, dtype):
    x = _randn((37, 3000), dtype)
    out = torch.full_like(x, float("nan"))
    y = _check_fwd(name, x, -1, dtype, "out=", out=out)
    assert y is out
    out = torch.full((3000, 37), float("nan"), device="cuda", dtype=x.dtype).t()
    _check_fwd(name, x, -1, dtype, "strided out=", out=out)
    expected = _ref(name, _host(x), dim=0)
    y = getattr(go, name)(x, 0, out=x)
    assert y is x
    assert_close(_host(x), expected, dtype, "in place")
    x = _randn((4, 200000), dtype)
    expected = _ref(name, _host(x), dim=-1)
    getattr(go, name)(x, -1, out=x)
    assert_close(_host(x), expected, dtype, "in place, split rows")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,log", FWD)
def test_gpu_nan_and_inf_as_torch(name, log, dtype):
    rows = torch.tensor(SPECIAL_ROWS, device="cuda").to(getattr(torch, dtype))
    fn = getattr(torch, name)
    for x, dim in ((rows, -1), (rows.t().contiguous(), 0),
                   (torch.cat([rows, torch.zeros(6, 70000, device="cuda", dtype=rows.dtype)], 1), -1)):
        got = _host(getattr(go, name)(x, dim))
        exp = fn(x.float(), dim).double().cpu().numpy()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(exp))
        inf = np.isinf(exp)
        np.testing.assert_array_equal(got[inf], exp[inf])


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,log", BWD)
def test_gpu_backward(name, log, dtype):
    def check(g, y, dim, what, **kw):
        dx = getattr(go, name)(g, y, dim, **kw)
        ref = _ref(name, _host(g), _host(y), dim=dim)
        # g and y are the op's exact inputs (u_y = 0): only the fp32 terms of the conditioning
        extra = _backward_conditioning(log, _host(g), _host(y), dim, 0.0)
        _assert_close_cond(_host(dx), ref, dtype, f"{name} {dtype} {what}", extra)
        return dx

    def forward(x, dim):     # y in the op's domain: log_softmax_backward takes log-probabilities
        return (torch.log_softmax if log else torch.softmax)(x.float(), dim).to(x.dtype)

    for shape in [(7, 3), (33, 64), (5, 1000), (4, 4096), (3, 4097), (2, 16384), (3, 40000),
                  (8, 393216)]:
        x = _randn(shape, dtype)
        y = torch.softmax(x.float(), -1).to(x.dtype) if not log else torch.log_softmax(
            x.float(), -1).to(x.dtype)
        check(_randn(shape, dtype, 1.0), y, -1, f"rows {shape}")
    x = _randn((4, 19, 8, 12), dtype)
    for dim in (0, 1, 3):
        y = (torch.log_softmax if log else torch.softmax)(x.float(), dim).to(x.dtype)
        check(_randn(x.shape, dtype, 1.0), y, dim, f"4-d dim={dim}")
    y = forward(_randn((96, 37), dtype), 0).t()
    check(_randn((37, 96), dtype, 1.0), y, -1, "transposed output, contiguous grad")
    g = _randn((9, 1500), dtype, 1.0)
    y = forward(_randn((9, 1500), dtype), -1)
    ref = _ref(name, _host(g), _host(y), dim=-1)
    extra = _backward_conditioning(log, _host(g), _host(y), -1, 0.0)
    out = torch.full_like(g, float("nan"))
    assert check(g, y, -1, "out=", out=out) is out
    getattr(go, name)(g, y, -1, out=g)
    _assert_close_cond(_host(g), ref, dtype, "in place", extra)


@gpu
@needs_torch_cuda
def test_gpu_cuda_graph_and_side_stream():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = _randn((16, 2048), "bfloat16")
        y = go.softmax(x)
    side.synchronize()
    assert_close(_host(y), sm.ref_softmax(_host(x)), "bfloat16", "side stream")

    static_x = _randn((16, 2048), "bfloat16")
    static_long = _randn((2, 393216), "float32")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        go.log_softmax(static_x)
        go.softmax(static_long)
        go.softmax_backward(static_x, static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = go.log_softmax(static_x)
        out_long = go.softmax(static_long)
        dx = go.softmax_backward(static_x, out)
    for _ in range(2):
        static_x.copy_(_randn((16, 2048), "bfloat16"))
        static_long.copy_(_randn((2, 393216), "float32"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(_host(out), sm.ref_log_softmax(_host(static_x)), "bfloat16", "graph")
        assert_close(_host(out_long), sm.ref_softmax(_host(static_long)), "float32", "graph long")
        assert_close(_host(dx), sm.ref_softmax_backward(_host(static_x), _host(out)), "bfloat16",
                     "graph backward")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_autograd_matches_torch(dtype):
    import gpuops.torch as gt
    for shape, dim in (((64, 1000), -1), ((4, 19, 8, 12), 1), ((3, 200000), -1)):
        x = _randn(shape, dtype).requires_grad_()
        for ours, theirs in ((gt.softmax, torch.softmax), (gt.log_softmax, torch.log_softmax)):
            w = _randn(shape, dtype, 1.0)
            y = ours(x, dim)
            (g,) = torch.autograd.grad((y.float() * w.float()).sum(), x)
            x64 = x.detach().double().cpu().requires_grad_()
            y64 = theirs(x64, dim)
            (g64,) = torch.autograd.grad((y64 * w.double().cpu()).sum(), x64)
            assert_close(_host(y.detach()), y64.detach().numpy(), dtype, f"{ours.__name__} {shape}")
            # the backward reads y as stored (as torch's does): its rounding, amplified by the
            # formula's conditioning, is part of the difference to the float64 gradient
            extra = _backward_conditioning(ours is gt.log_softmax, _host(w), _host(y.detach()),
                                           dim, _U_STORED[dtype])
            _assert_close_cond(_host(g), g64.numpy(), dtype, f"grad {ours.__name__} {shape}",
                               extra)


@gpu
@needs_torch_cuda
def test_gpu_torch_compile_fullgraph():
    import gpuops.torch as gt
    x = _randn((128, 1000), "float32").requires_grad_()

    def f(x):
        return (gt.log_softmax(x, -1) * gt.softmax(x, 0)).sum()
    y = torch.compile(f, fullgraph=True)(x)
    (g,) = torch.autograd.grad(y, x)
    x2 = x.detach().clone().requires_grad_()
    y2 = (torch.log_softmax(x2, -1) * torch.softmax(x2, 0)).sum()
    (g2,) = torch.autograd.grad(y2, x2)
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g, g2, rtol=1e-5, atol=1e-5)
