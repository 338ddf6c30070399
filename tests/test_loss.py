"""cross_entropy (forward, forward with lse, backward) against float64 references: on the CPU (the
references against torch, argument errors, the kernels' index mapping in a bounds-checked
simulation, autograd, the in-place backward's semantics, torch.compile) and on the GPU (every
dtype, int64/int32 targets, reductions, ignore_index, label smoothing, vocabularies up to 151,936,
few and many rows, unaligned and strided logits, NaN/inf rows, in-place gradients, a CUDA graph,
gradients against torch, torch.compile)."""
from __future__ import annotations

import numpy as np
import pytest

import gpuops as go
from gpuops.ops import loss as ls
from conftest import HAS_TORCH, assert_close, gpu, needs_torch, needs_torch_cuda
import softmax_sim as sim

torch = pytest.importorskip("torch") if HAS_TORCH else None
F = torch.nn.functional if HAS_TORCH else None

DTYPES = ["float32", "float16", "bfloat16"]
REDUCTIONS = ["mean", "sum", "none"]


def _targets(rng, n, c, ignore=-100, frac_ignored=0.2):
    t = rng.integers(0, c, n)
    t[rng.random(n) < frac_ignored] = ignore
    return t


# ----------------------------------------------------------------------------- CPU: references

@needs_torch
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_references_match_torch(reduction, eps, rng):
    x = rng.standard_normal((9, 13)) * 3
    t = _targets(rng, 9, 13)
    tx, tt = torch.from_numpy(x).requires_grad_(), torch.from_numpy(t)
    loss = F.cross_entropy(tx, tt, reduction=reduction, label_smoothing=eps)
    ours, lse = ls.ref_cross_entropy_forward(x, t, -100, reduction, eps)
    np.testing.assert_allclose(ours, loss.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(lse, torch.logsumexp(tx, 1).detach().numpy(), rtol=1e-13)
    np.testing.assert_allclose(ls.ref_cross_entropy(x, t, -100, reduction, eps), ours)
    g = rng.standard_normal(loss.shape)
    (dx,) = torch.autograd.grad(loss, tx, torch.from_numpy(np.asarray(g)), retain_graph=True)
    np.testing.assert_allclose(
        ls.ref_cross_entropy_backward(g, x, t, lse, -100, reduction, eps), dx.numpy(),
        rtol=1e-10, atol=1e-15)
    # the gradient through lse too
    gl = rng.standard_normal(9)
    total = (loss * torch.from_numpy(np.asarray(g))).sum() + (torch.logsumexp(tx, 1) *
                                                              torch.from_numpy(gl)).sum()
    (dx,) = torch.autograd.grad(total, tx)
    np.testing.assert_allclose(
        ls.ref_cross_entropy_backward(g, x, t, lse, -100, reduction, eps, gl), dx.numpy(),
        rtol=1e-10, atol=1e-15)


@needs_torch
def test_reference_edge_cases_as_torch(rng):
    x = rng.standard_normal((4, 6))
    t = np.full(4, -100)
    assert np.isnan(ls.ref_cross_entropy(x, t))                         # all ignored: 0 / 0
    assert ls.ref_cross_entropy(x, t, reduction="sum") == 0.0
    x1, t1 = rng.standard_normal(6), np.array(4)
    np.testing.assert_allclose(ls.ref_cross_entropy(x1, t1, reduction="none"),
                               F.cross_entropy(torch.from_numpy(x1), torch.tensor(4),
                                               reduction="none").numpy())
    rows = np.array([[1.0, 2.0, -np.inf], [-np.inf] * 3, [np.nan, 1.0, 2.0], [np.inf, 0.0, 1.0]])
    t = np.array([0, 1, 2, 1])
    exp = F.cross_entropy(torch.from_numpy(rows), torch.from_numpy(t), reduction="none").numpy()
    got = ls.ref_cross_entropy(rows, t, reduction="none")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(exp))
    np.testing.assert_allclose(got[~np.isnan(exp)], exp[~np.isnan(exp)])


def test_argument_errors():
    x = np.zeros((3, 4), np.float32)
    t = np.zeros(3, np.int64)
    with pytest.raises(ValueError, match="reduction='avg'"):
        go.cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="'target' has shape"):
        go.cross_entropy(x, np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="label_smoothing"):
        go.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(TypeError, match="'target' has dtype float32"):
        go.cross_entropy(x, t.astype(np.float32))
    with pytest.raises(ValueError, match="no classes"):
        go.cross_entropy(np.zeros((3, 0), np.float32), t)
    with pytest.raises(ValueError, match="'input' must be"):
        go.cross_entropy(np.zeros((3, 4, 5), np.float32), np.zeros((3, 5), np.int64))
    with pytest.raises(ValueError, match="'lse' has shape"):
        go.cross_entropy_backward(np.ones((), np.float32), x, t, np.zeros(4, np.float32))


# ----------------------------------------------------------------------------- CPU: simulation

SIM_SHAPES = [("tiny", 3, 7), ("one", 1, 1), ("few_rows_long", 2, 20000), ("many_rows", 700, 40),
              ("odd", 5, 1001), ("vec", 4, 2048)]


def _sim_forward(monkeypatch, op, dtype, x, t, tdtype, reduction, eps, view=None):
    from gpuops import dtypes as dt
    d = sim.FLOAT_DTYPES[dtype]

    def build(mem):
        return (sim.upload(mem, x, d, view), sim.upload(mem, t, getattr(dt, tdtype)), -100,
                reduction, eps), {}
    return sim.run_op(monkeypatch, op, d, build)


@pytest.mark.parametrize("case", SIM_SHAPES, ids=[c[0] for c in SIM_SHAPES])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_simulated_forward(monkeypatch, rng, case, reduction):
    _, n, c = case
    x = rng.standard_normal((n, c)) * 3
    t = _targets(rng, n, c)
    for dtype, tdtype, eps in (("float32", "int64", 0.0), ("bfloat16", "int32", 0.1)):
        (loss, lse), launched = _sim_forward(monkeypatch, "cross_entropy_forward", dtype, x, t,
                                             tdtype, reduction, eps)
        rl, rlse = ls.ref_cross_entropy_forward(x, t, -100, reduction, eps)
        np.testing.assert_allclose(sim.values(lse), rlse, rtol=1e-12)
        np.testing.assert_allclose(sim.values(loss), rl, rtol=1e-11, atol=1e-14)


def test_simulated_forward_views_and_empty(monkeypatch, rng):
    big = rng.standard_normal((6, 70))
    t = _targets(rng, 6, 64)
    (loss, lse), _ = _sim_forward(monkeypatch, "cross_entropy_forward", "float32", big, t, "int64",
                                  "none", 0.0,
                                  view=lambda a: sim.strided_view(a, (6, 64), (70, 1), 3))
    np.testing.assert_allclose(sim.values(loss),
                               ls.ref_cross_entropy(big[:, 3:67], t, reduction="none"), rtol=1e-12)
    xt = rng.standard_normal((9, 5))
    t = _targets(rng, 5, 9)
    (loss, _), _ = _sim_forward(monkeypatch, "cross_entropy_forward", "float32", xt, t, "int64",
                                "sum", 0.0, view=lambda a: a.permute(1, 0))   # copied
    np.testing.assert_allclose(sim.values(loss), ls.ref_cross_entropy(xt.T, t, reduction="sum"))
    (loss, lse), _ = _sim_forward(monkeypatch, "cross_entropy_forward", "float32",
                                  rng.standard_normal(11), np.array(3), "int64", "none", 0.0)
    assert loss.shape == () and lse.shape == ()
    (loss, _), launched = _sim_forward(monkeypatch, "cross_entropy_forward", "float32",
                                       np.zeros((0, 5)), np.zeros(0, np.int64), "int64", "mean",
                                       0.0)
    assert np.isnan(sim.values(loss)) and launched == ["gpuops::ce_reduce<float>"]


@pytest.mark.parametrize("case", SIM_SHAPES, ids=[c[0] for c in SIM_SHAPES])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_simulated_backward(monkeypatch, rng, case, reduction):
    from gpuops import dtypes as dt
    _, n, c = case
    x = rng.standard_normal((n, c)) * 3
    t = _targets(rng, n, c)
    _, lse = ls.ref_cross_entropy_forward(x, t, -100, reduction)
    g = rng.standard_normal((n,)) if reduction == "none" else np.array(1.7)
    gl = rng.standard_normal(n)
    for dtype, eps, glse, inplace in (("float32", 0.0, None, False), ("float16", 0.2, gl, True)):
        d = sim.FLOAT_DTYPES[dtype]

        def build(mem):
            xt = sim.upload(mem, x, d)
            args = (sim.upload(mem, g, d), xt, sim.upload(mem, t, dt.int64),
                    sim.upload(mem, lse, dt.float32), -100, reduction, eps,
                    None if glse is None else sim.upload(mem, glse, dt.float32))
            return args, ({"out": xt} if inplace else {})
        dx, _ = sim.run_op(monkeypatch, "cross_entropy_backward", d, build)
        ref = ls.ref_cross_entropy_backward(g, x, t, lse, -100, reduction, eps, glse)
        np.testing.assert_allclose(sim.values(dx), ref, rtol=1e-11, atol=1e-15)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_simulated_with_grad_and_scale(monkeypatch, rng, reduction):
    from gpuops import dtypes as dt
    # (rows, C, dtype, smem budget) on a simulated 8-SM GPU: 8 rows or more take ce_fused, with
    # the whole row cached, part of it, or none; fewer rows take the split forward +
    # ce_backward; odd C the scalar path
    cases = [(12, 64, "bfloat16", 1 << 20), (9, 1000, "float32", 1024), (8, 77, "float16", 64),
             (10, 48, "float32", 0), (5, 3000, "bfloat16", 1 << 20)]
    for n, c, dtype, budget in cases:
        x = rng.standard_normal((n, c)) * 3
        t = _targets(rng, n, c)
        d = sim.FLOAT_DTYPES[dtype]
        ref_grad, ref_loss = ls.ref_cross_entropy_with_grad(x, t, -100, reduction, 0.1)
        for inplace in (False, True):
            def build(mem):
                xt = sim.upload(mem, x, d)
                return ((xt, sim.upload(mem, t, dt.int32), -100, reduction, 0.1),
                        {"out": xt} if inplace else {})
            (grad, loss), launched = sim.run_op(monkeypatch, "cross_entropy_with_grad", d, build,
                                                smem_budget=budget, sms=8)
            assert any("ce_fused" in e for e in launched) == (n >= 8), launched
            np.testing.assert_allclose(sim.values(grad), ref_grad, rtol=1e-11, atol=1e-15)
            np.testing.assert_allclose(sim.values(loss), ref_loss, rtol=1e-11, atol=1e-14)
        g = rng.standard_normal(n) if reduction == "none" else np.array(0.7)
        g1 = np.ones(n) if reduction == "none" else np.array(1.0)
        for go_, inplace in ((g, False), (g, True), (g1, True)):
            def build(mem):
                gt_ = sim.upload(mem, ref_grad, d)
                return (sim.upload(mem, go_, d), gt_, reduction), {"out": gt_} if inplace else {}
            out, _ = sim.run_op(monkeypatch, "cross_entropy_grad_scale", d, build)
            np.testing.assert_allclose(sim.values(out),
                                       ls.ref_cross_entropy_grad_scale(go_, ref_grad, reduction),
                                       rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------------------- CPU: autograd

@needs_torch
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_autograd_cpu_matches_torch(reduction, rng):
    import gpuops.torch as gt
    x = torch.from_numpy(rng.standard_normal((7, 11)) * 2).requires_grad_()
    t = torch.from_numpy(_targets(rng, 7, 11)).to(torch.int32)
    for eps in (0.0, 0.15):
        loss = gt.cross_entropy(x, t, reduction=reduction, label_smoothing=eps)
        ref = F.cross_entropy(x, t.long(), reduction=reduction, label_smoothing=eps)
        assert loss.shape == ref.shape
        w = torch.from_numpy(rng.standard_normal(ref.shape))
        (g,) = torch.autograd.grad((loss * w).sum(), x)
        (g2,) = torch.autograd.grad((ref * w).sum(), x)
        np.testing.assert_allclose(loss.detach().numpy(), ref.detach().numpy(), rtol=1e-12)
        np.testing.assert_allclose(g.numpy(), g2.numpy(), rtol=1e-10, atol=1e-15)
    # through the lse output of the custom op (e.g. a z-loss)
    loss, lse = torch.ops.gpuops.cross_entropy(x, t.long(), -100, reduction, 0.0)
    (g,) = torch.autograd.grad(loss.sum() + (lse ** 2).sum(), x)
    ref = F.cross_entropy(x, t.long(), reduction=reduction).sum() + (
        torch.logsumexp(x, 1) ** 2).sum()
    (g2,) = torch.autograd.grad(ref, x)
    np.testing.assert_allclose(g.numpy(), g2.numpy(), rtol=1e-10, atol=1e-15)


@needs_torch
def test_inplace_backward_semantics_cpu(rng):
    import gpuops.torch as gt
    t = torch.from_numpy(_targets(rng, 5, 9))
    z = torch.from_numpy(rng.standard_normal((5, 9))).requires_grad_()
    logits = z * 2.0
    before = logits.detach().clone()
    loss = gt.cross_entropy(logits, t, inplace_backward=True)
    assert torch.equal(logits.detach(), before)           # the forward changes nothing
    loss.backward(retain_graph=True)
    ref = before.clone().requires_grad_()
    F.cross_entropy(ref, t).backward()
    np.testing.assert_allclose(z.grad.numpy(), 2.0 * ref.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(logits.detach().numpy(), ref.grad.numpy(), rtol=1e-12)  # replaced
    with pytest.raises(RuntimeError, match="backward ran a second time"):
        loss.backward()
    with pytest.raises(ValueError, match="non-leaf"):
        gt.cross_entropy(z, t, inplace_backward=True)
    with pytest.raises(ValueError, match="non-leaf"):
        gt.cross_entropy(z[1:], t[1:], inplace_backward=True)
    capped = torch.tanh(z)                                  # tanh saves its output (the logits)
    loss = gt.cross_entropy(capped, t, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with torch.no_grad():                                   # nothing to do without a backward
        gt.cross_entropy(z, t, inplace_backward=True)


@needs_torch
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_inplace_forward_semantics_cpu(rng, reduction):
    import gpuops.torch as gt
    t = torch.from_numpy(_targets(rng, 5, 9))
    z = torch.from_numpy(rng.standard_normal((5, 9))).requires_grad_()
    for scale in (1.0, 0.25):
        z.grad = None
        logits = z * 2.0
        before = logits.detach().clone()
        loss = gt.cross_entropy(logits, t, reduction=reduction, label_smoothing=0.1,
                                inplace_backward="forward")
        ref = before.clone().requires_grad_()
        ref_loss = F.cross_entropy(ref, t, reduction=reduction, label_smoothing=0.1)
        np.testing.assert_allclose(loss.detach().numpy(), ref_loss.detach().numpy(), rtol=1e-12)
        assert not torch.equal(logits.detach(), before)     # the gradient is there already
        (loss.sum() * scale).backward(retain_graph=True)
        (ref_loss.sum() * scale).backward()
        np.testing.assert_allclose(z.grad.numpy(), 2.0 * ref.grad.numpy(), rtol=1e-12, atol=1e-16)
        with pytest.raises(RuntimeError, match="backward ran a second time"):
            loss.sum().backward()
    loss = gt.cross_entropy(torch.tanh(z), t, inplace_backward="forward")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with pytest.raises(ValueError, match="inplace_backward='sideways'"):
        gt.cross_entropy(z * 1.0, t, inplace_backward="sideways")


@needs_torch
@pytest.mark.parametrize("mode", [True, "forward"])
def test_inplace_modes_gradient_is_detached_cpu(rng, mode):
    # the gradient handed on lives in the logits' memory, but is not the logits' graph node
    import gpuops.torch as gt
    t = torch.from_numpy(_targets(rng, 5, 9))
    z = torch.from_numpy(rng.standard_normal((5, 9))).requires_grad_()
    logits = z * 2.0
    loss = gt.cross_entropy(logits, t, inplace_backward=mode)
    (g,) = torch.autograd.grad(loss * 0.5, logits)
    assert g.data_ptr() == logits.data_ptr()
    assert not g.requires_grad and g.grad_fn is None
    ref = (z * 2.0).detach().requires_grad_()   # z is intact: only logits was overwritten
    (rg,) = torch.autograd.grad(F.cross_entropy(ref, t) * 0.5, ref)
    np.testing.assert_allclose(g.numpy(), rg.numpy(), rtol=1e-12, atol=1e-16)


@needs_torch
def test_torch_compile_fullgraph_cpu(rng):
    import gpuops.torch as gt
    x = torch.from_numpy(rng.standard_normal((6, 10))).requires_grad_()
    t = torch.from_numpy(_targets(rng, 6, 10))

    def f(x, t):
        return gt.cross_entropy(x * 2, t, label_smoothing=0.1)
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(x, t)
    (g,) = torch.autograd.grad(loss, x)
    x2 = x.detach().clone().requires_grad_()
    loss2 = F.cross_entropy(x2 * 2, t, label_smoothing=0.1)
    (g2,) = torch.autograd.grad(loss2, x2)
    np.testing.assert_allclose(loss.item(), loss2.item(), rtol=1e-12)
    np.testing.assert_allclose(g.numpy(), g2.numpy(), rtol=1e-10, atol=1e-15)


# ----------------------------------------------------------------------------- GPU

def _randn(shape, dtype, scale=3.0):
    return (torch.randn(shape, device="cuda") * scale).to(getattr(torch, dtype))


def _host(t):
    return t.double().cpu().numpy()


def _gpu_targets(n, c, tdtype=torch.int64, ignore=-100):
    t = torch.randint(0, c, (n,), device="cuda")
    t[torch.rand(n, device="cuda") < 0.2] = ignore
    return t.to(tdtype)


GPU_SHAPES = [(1, 1), (3, 7), (64, 1000), (5, 4097), (300, 2048), (16, 151936), (2, 32003),
              (700, 128)]


def _check_forward(x, t, dtype, reduction, eps, what):
    loss, lse = go.cross_entropy_forward(x, t, -100, reduction, eps)
    rl, rlse = ls.ref_cross_entropy_forward(_host(x), t.cpu().numpy(), -100, reduction, eps)
    assert lse.dtype == torch.float32 and loss.dtype == x.dtype
    assert_close(_host(lse), rlse, "float32", f"lse {what}")
    assert_close(_host(loss), rl, dtype, f"loss {what}")
    return loss, lse


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gpu_forward_and_backward(dtype, reduction):
    for shape in GPU_SHAPES:
        for tdtype, eps in ((torch.int64, 0.0), (torch.int32, 0.1)):
            what = f"{dtype} {reduction} {shape} {tdtype} eps={eps}"
            x = _randn(shape, dtype)
            t = _gpu_targets(shape[0], shape[1], tdtype)
            loss, lse = _check_forward(x, t, dtype, reduction, eps, what)
            assert_close(_host(go.cross_entropy(x, t, -100, reduction, eps)), _host(loss), dtype,
                         "cross_entropy = cross_entropy_forward[0]")
            g = _randn(loss.shape, dtype, 1.0)
            dx = go.cross_entropy_backward(g, x, t, lse, -100, reduction, eps)
            ref = ls.ref_cross_entropy_backward(_host(g), _host(x), t.cpu().numpy(), _host(lse),
                                                -100, reduction, eps)
            assert_close(_host(dx), ref, dtype, f"grad {what}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_layouts_in_place_and_grad_lse(dtype):
    big = _randn((40, 1030), dtype)
    t = _gpu_targets(40, 1024)
    for x, what in ((big[:, :1024], "strided rows"), (big[:, 3:1027], "unaligned rows"),
                    (_randn((1024, 40), dtype).t(), "transposed (copied)"),
                    (_randn((151936,), dtype)[None, :].expand(40, -1)[:, :1024], "stride-0 rows")):
        loss, lse = _check_forward(x, t, dtype, "none", 0.0, what)
        g = _randn((40,), dtype, 1.0)
        dx = go.cross_entropy_backward(g, x, t, lse, -100, "none")
        ref = ls.ref_cross_entropy_backward(_host(g), _host(x), t.cpu().numpy(), _host(lse),
                                            -100, "none")
        assert_close(_host(dx), ref, dtype, f"grad {what}")
    x1 = _randn((5000,), dtype)
    loss, lse = _check_forward(x1, torch.tensor(17, device="cuda"), dtype, "none", 0.0, "1-d")
    assert loss.shape == () and lse.shape == ()
    # in place: the gradient replaces the logits; with grad_lse
    x = _randn((33, 20000), dtype)
    t = _gpu_targets(33, 20000)
    loss, lse = go.cross_entropy_forward(x, t)
    gl = torch.randn(33, device="cuda")
    ref = ls.ref_cross_entropy_backward(np.array(0.5), _host(x), t.cpu().numpy(), _host(lse),
                                        grad_lse=_host(gl))
    y = go.cross_entropy_backward(torch.tensor(0.5, device="cuda").to(x.dtype), x, t, lse,
                                  grad_lse=gl, out=x)
    assert y is x
    assert_close(_host(x), ref, dtype, "in place with grad_lse")
    out = torch.full((33, 20000), float("nan"), device="cuda", dtype=x.dtype)
    x = _randn((33, 20000), dtype)
    loss, lse = go.cross_entropy_forward(x, t, reduction="sum")
    go.cross_entropy_backward(torch.ones((), device="cuda", dtype=x.dtype), x, t, lse,
                              reduction="sum", out=out)
    assert_close(_host(out), ls.ref_cross_entropy_backward(
        np.array(1.0), _host(x), t.cpu().numpy(), _host(lse), reduction="sum"), dtype, "out=")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_special_values_as_torch(dtype):
    rows = torch.tensor([[1.0, 2.0, -float("inf"), 0.0], [-float("inf")] * 4,
                         [float("nan"), 1.0, 2.0, 3.0], [float("inf"), 0.0, 1.0, 2.0],
                         [5.0, 1.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0]], device="cuda")
    t = torch.tensor([0, 1, 2, 1, -100, 7], device="cuda")
    x = rows.to(getattr(torch, dtype))
    got = _host(go.cross_entropy(x[:5], t[:5], reduction="none"))
    exp = F.cross_entropy(x[:5].float(), t[:5], reduction="none").double().cpu().numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(exp))
    np.testing.assert_allclose(got[~np.isnan(exp)], exp[~np.isnan(exp)], rtol=1e-2)
    assert np.isnan(_host(go.cross_entropy(x, t, reduction="none"))[5])   # target out of range
    assert np.isnan(_host(go.cross_entropy(x[4:5], t[4:5])))              # all ignored: 0 / 0
    assert _host(go.cross_entropy(x[4:5], t[4:5], reduction="sum")) == 0.0


@gpu
@needs_torch_cuda
def test_gpu_cuda_graph():
    x = _randn((16, 151936), "bfloat16")
    t = _gpu_targets(16, 151936)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loss, lse = go.cross_entropy_forward(x, t)
        go.cross_entropy_backward(loss, x, t, lse)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, lse = go.cross_entropy_forward(x, t, label_smoothing=0.1)
        dx = go.cross_entropy_backward(torch.ones_like(loss), x, t, lse, label_smoothing=0.1)
    for _ in range(2):
        x.copy_(_randn((16, 151936), "bfloat16"))
        t.copy_(_gpu_targets(16, 151936))
        graph.replay()
        torch.cuda.synchronize()
        rl, rlse = ls.ref_cross_entropy_forward(_host(x), t.cpu().numpy(), label_smoothing=0.1)
        assert_close(_host(loss), rl, "bfloat16", "graph loss")
        ref = ls.ref_cross_entropy_backward(np.array(1.0), _host(x), t.cpu().numpy(), rlse,
                                            label_smoothing=0.1)
        assert_close(_host(dx), ref, "bfloat16", "graph grad")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_autograd_matches_torch(dtype):
    import gpuops.torch as gt
    for (n, c), reduction in (((64, 1000), "mean"), ((16, 151936), "sum"), ((33, 4097), "none")):
        x = _randn((n, c), dtype).requires_grad_()
        t = _gpu_targets(n, c)
        loss = gt.cross_entropy(x, t, reduction=reduction, label_smoothing=0.05)
        w = torch.randn(loss.shape, device="cuda", dtype=torch.float64)
        (g,) = torch.autograd.grad((loss.double() * w).sum(), x)
        x64 = x.detach().double().cpu().requires_grad_()
        ref = F.cross_entropy(x64, t.cpu(), reduction=reduction, label_smoothing=0.05)
        (g64,) = torch.autograd.grad((ref * w.cpu()).sum(), x64)
        assert_close(_host(loss.detach()), ref.detach().numpy(), dtype, f"loss {reduction}")
        assert_close(_host(g), g64.numpy(), dtype, f"grad {reduction}")


@gpu
@needs_torch_cuda
def test_gpu_inplace_backward():
    import gpuops.torch as gt
    h = _randn((64, 256), "bfloat16", 0.5).requires_grad_()
    w = _randn((8000, 256), "bfloat16", 0.1)
    t = _gpu_targets(64, 8000)
    logits = h @ w.t()
    ref_logits = logits.detach().float().requires_grad_()
    loss = gt.cross_entropy(logits, t, inplace_backward=True)
    loss.backward()
    F.cross_entropy(ref_logits, t).backward()
    assert_close(_host(logits.detach()), _host(ref_logits.grad), "bfloat16", "logits -> grad")
    assert_close(_host(h.grad), _host(ref_logits.grad.to(torch.bfloat16).float() @ w.float()),
                 "bfloat16", "upstream grad")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gpu_with_grad_and_scale(dtype, reduction):
    # >= 132 rows take ce_fused on the H100: fp32 rows of 65,536 are cached in part (256 KB),
    # bf16/fp16 ones whole; 4097 takes the scalar path; 16 rows the split fallback
    for (n, c), tdtype in (((140, 65536), torch.int64), ((1000, 4097), torch.int32),
                           ((200, 2048), torch.int64), ((16, 151936), torch.int32),
                           ((140, 3), torch.int64)):
        what = f"{dtype} {reduction} {(n, c)}"
        x = _randn((n, c), dtype)
        t = _gpu_targets(n, c, tdtype)
        ref_grad, ref_loss = ls.ref_cross_entropy_with_grad(_host(x), t.cpu().numpy(), -100,
                                                            reduction, 0.1)
        grad, loss = go.cross_entropy_with_grad(x, t, -100, reduction, 0.1)
        assert_close(_host(loss), ref_loss, dtype, f"loss {what}")
        assert_close(_host(grad), ref_grad, dtype, f"grad {what}")
        y, loss = go.cross_entropy_with_grad(x, t, -100, reduction, 0.1, out=x)   # in place
        assert y is x
        assert_close(_host(x), ref_grad, dtype, f"in place grad {what}")
        assert_close(_host(loss), ref_loss, dtype, f"in place loss {what}")
        g = _randn(loss.shape, dtype, 1.0)
        expected = ls.ref_cross_entropy_grad_scale(_host(g), _host(x), reduction)
        assert_close(_host(go.cross_entropy_grad_scale(g, x, reduction)), expected, dtype,
                     f"scale {what}")
        before = x.clone()
        go.cross_entropy_grad_scale(torch.ones_like(g), x, reduction, out=x)
        assert torch.equal(x, before)
        go.cross_entropy_grad_scale(g, x, reduction, out=x)
        assert_close(_host(x), expected, dtype, f"scale in place {what}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("mode", [True, "forward"])
def test_gpu_inplace_modes_fwd_bwd(mode):
    import gpuops.torch as gt
    for n, scale in ((140, 1.0), (140, 0.25), (8, 1.0)):     # 140 rows of 297 KB: cached in part
        base = _randn((n, 151936), "bfloat16").requires_grad_()
        t = _gpu_targets(n, 151936)
        logits = base * 1.0
        ref = logits.detach().float().requires_grad_()
        loss = gt.cross_entropy(logits, t, inplace_backward=mode)
        (g,) = torch.autograd.grad(loss * scale, logits)
        ref_loss = F.cross_entropy(ref, t)
        (rg,) = torch.autograd.grad(ref_loss * scale, ref)
        assert g.data_ptr() == logits.data_ptr()
        assert_close(_host(loss.detach()), ref_loss.item(), "bfloat16", f"{mode} loss")
        assert_close(_host(g), _host(rg), "bfloat16", f"{mode} grad n={n} scale={scale}")


@gpu
@needs_torch_cuda
def test_gpu_torch_compile_fullgraph():
    import gpuops.torch as gt
    x = _randn((128, 5000), "float32").requires_grad_()
    t = _gpu_targets(128, 5000)

    def f(x, t):
        return gt.cross_entropy(x * 0.5, t, label_smoothing=0.1) + gt.log_softmax(x, -1).mean()
    loss = torch.compile(f, fullgraph=True)(x, t)
    (g,) = torch.autograd.grad(loss, x)
    x2 = x.detach().clone().requires_grad_()
    loss2 = F.cross_entropy(x2 * 0.5, t, label_smoothing=0.1) + torch.log_softmax(x2, -1).mean()
    (g2,) = torch.autograd.grad(loss2, x2)
    torch.testing.assert_close(loss, loss2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g, g2, rtol=1e-5, atol=1e-6)
