"""scaled_dot_product_attention_backward and the autograd op gpuops.torch.scaled_dot_product_attention
against float64 references.

CPU: the NumPy reference backward against torch autograd through torch's math SDPA in float64
(dense, causal with Sq == Sk and Sq != Sk, windows, GQA 1/2/8, bool and additive masks with rows
that see no key, scale, 'bshd', lengths 1, 17, 128); argument errors naming the argument; the CPU
fallback for NumPy and CPU torch inputs; gpuops.torch's autograd in float64 against torch's and
through torch.compile(fullgraph=True); the kernels (every instantiation: head dims 32/64/96/128 at
both tile sizes, the general path with chunks of 64 and of 32) run by the CPU emulator of
tests/emu.py on small shapes, strided / unaligned inputs, empty sequences and NaN; the tensor-core
kernel ('mma': head dims 64 and 128, every tile of its tables) in the emulator on causal (Sq <, =,
> Sk), windows, GQA, masks, tails, 'bshd', NaN, empty sequences, and its fallback / refusal rules.
GPU (``gpu`` marker): every dtype against the reference at lengths up to 4097 with poisoned
outputs, 'mma' for fp16/bf16 x D 64/128 x causal/window/GQA/mask against the reference and
against torch's own SDPA backward, autograd against float64 and against torch's own SDPA
backward, torch.compile, a CUDA graph.

Tolerance of the kernels (derived, not tuned; the reference runs on the same rounded inputs,
output and lse). With u = 2^-24 (fp32 math), c = 2 sqrt(D) + 4 (dot products over the head dim):
each probability P = exp(x - lse) carries a relative error
e_P = c u (|q||k|^T) scale + 4 u (|x| + |lse|) + 2^-21 (MUFU ex2); dP = dO V^T and D = rowsum(dO O)
are off by c u (|dO||V|^T) and c u (|dO|.|O|); so dS = P (dP - D) is off by
e_dS = e_P |P| |dP - D| + |P| c u (|dO||V|^T + |dO|.|O|) + 2 u |dS|. The sums over query rows
(dV, dK: n = group x Sq terms) and key rows (dQ: n = Sk) add 3 sqrt(n + 1) u of the sums of
absolute values: |dV - ref| <= (e_P |P|)^T |dO| + 3 sqrt(n+1) u |P|^T |dO|,
|dK - ref| <= scale (e_dS^T |Q| + 3 sqrt(n+1) u |dS|^T |Q|), |dQ - ref| likewise with K; plus
2 u_out |ref| for the rounding to the output dtype and a tiny absolute term.

The tensor-core kernel ('mma', fp16/bf16) adds, worst case (the tensor cores' fp32 accumulation
aligns addends to the largest one and may truncate: up to 2u per addend of the magnitudes summed
in one mma of 16 products + the accumulator, 34 u per mma step, as in test_attention.py): S and
dP by c_s = 34 (D / 16 + 1) instead of c; P rounded to the input dtype before dV += P^T dO and
dS before dK += dS^T Q and dQ += dS K: + u_in of the sums of absolute values; the sums over
n rows in ceil(n / 16) + 1 mma steps: 36 (ceil(n / 16) + 1) u instead of 3 sqrt(n + 1) u (dQ: the
per-tile mma sums and the atomics across key tiles together stay under that); for fp16, P and
dS below 2^-14 are subnormal: + 2^-25 n max|dO| (dV), scale 2^-25 n max|Q| (dK), max|K| (dQ).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import gpuops as go
from gpuops import dtypes as dt
from gpuops.ops import attention as at
from gpuops.ops import attention_backward as ab
from conftest import HAS_TORCH, gpu, needs_torch, needs_torch_cuda

torch = pytest.importorskip("torch") if HAS_TORCH else None
import emu  # noqa: E402
from emu import needs_emu  # noqa: E402
from attention_testing import (  # noqa: E402  (shared by the attention test files)
    DTYPES, TINY, U32, U_OUT, bhsd as _bhsd, check, np_dtype as _np_dtype, rand as _rand, FakeCall)

ref_fwd = at.ref_scaled_dot_product_attention
ref_bwd = ab.ref_scaled_dot_product_attention_backward


def _mask64(mask):
    if mask is None:
        return None
    m = np.asarray(mask)
    return m if m.dtype == bool else m.astype(np.float64)


def forward_for(q, k, v, mask, *, dtype, **kw):
    """The forward's (output rounded to the storage dtype, float32 lse), as the GPU forward
    hands them to the backward, from the float64 reference."""
    out, lse = ref_fwd(*(np.asarray(x, np.float64) for x in (q, k, v)), _mask64(mask),
                       return_lse=True, **kw)
    return out.astype(np.float32).astype(_np_dtype(dtype)), lse.astype(np.float32)


def bwd_bound(g, q, k, v, out, lse, mask=None, *, dtype, layout="bhsd", enable_gqa=False,
              mma=False, **kw):
    """(reference dq, dk, dv, and elementwise bounds on |kernel - reference| for each); see the
    module docstring. NaN inputs count as 0 in the bounds (NaN outputs are checked as NaN).
    mma: the bound of the tensor-core kernel (module docstring); it also covers the SIMT one."""
    g64, q64, k64, v64, o64 = (np.asarray(x, np.float64) for x in (g, q, k, v, out))
    L64 = np.asarray(lse, np.float64)
    m64 = _mask64(mask)
    args = dict(enable_gqa=enable_gqa, layout=layout, **kw)
    refs = ref_bwd(g64, q64, k64, v64, o64, L64, m64, **args)
    G, Q, K, V, O = (np.nan_to_num(_bhsd(x, layout)) for x in (g64, q64, k64, v64, o64))
    L = np.nan_to_num(L64, nan=0.0, neginf=-np.inf)
    p = ab.check_args(g64.shape, q64.shape, k64.shape, v64.shape, o64.shape, L64.shape,
                      None if m64 is None else m64.shape, kw.get("is_causal", False),
                      kw.get("scale"), enable_gqa, kw.get("window_size"), layout, "auto")
    B, Hq, Sq, D = Q.shape
    c = 2 * math.sqrt(D) + 4
    cq = 3 * math.sqrt(p.group * Sq + 1)
    ck = 3 * math.sqrt(p.Sk + 1)
    cs, u_in = c, 0.0                   # score / dP dot products; rounding of P and dS
    if mma:
        cs = max(c, 34 * (D / 16 + 1))
        cq = max(cq, 36 * p.group * (math.ceil(Sq / 16) + 1))
        ck = max(ck, 36 * (math.ceil(p.Sk / 16) + 1))
        u_in = U_OUT[dtype]
    sc = abs(p.scale)
    ok = at.visible(p.Sq, p.Sk, p.left, p.right)
    mask = None if m64 is None else np.broadcast_to(m64, (B, Hq, p.Sq, p.Sk))
    bq, bk, bv = np.zeros(Q.shape), np.zeros(K.shape), np.zeros(V.shape)
    with np.errstate(all="ignore"):
        for b in range(B):
            for h in range(Hq):
                hk = h // p.group
                x = (Q[b, h] @ K[b, hk].T) * p.scale
                a = (np.abs(Q[b, h]) @ np.abs(K[b, hk]).T) * sc
                keep = ok
                if mask is not None:
                    if mask.dtype == bool:
                        keep = ok & mask[b, h]
                    else:
                        x = x + mask[b, h]
                lrow = L[b, h][:, None]
                live = keep & ~np.isneginf(lrow) & ~np.isneginf(x)   # P = 0 exactly elsewhere
                prob = np.where(live, np.exp(x - lrow), 0.0)
                e_p = np.where(live, cs * U32 * a + 4 * U32 * (np.abs(x) + np.abs(lrow)) + 2.0**-21,
                               0.0)
                dp = G[b, h] @ V[b, hk].T
                adp = np.abs(G[b, h]) @ np.abs(V[b, hk]).T
                d_row = np.sum(G[b, h] * O[b, h], axis=1, keepdims=True)
                ad_row = np.sum(np.abs(G[b, h] * O[b, h]), axis=1, keepdims=True)
                ds = np.where(live, prob * (dp - d_row), 0.0)
                e_ds = np.where(live, e_p * prob * np.abs(dp - d_row)
                                + prob * U32 * (cs * adp + c * ad_row) + 2 * U32 * np.abs(ds), 0.0)
                ag = np.abs(G[b, h])
                rq, rk = cq * U32 + u_in, ck * U32 + u_in
                bv[b, hk] += (e_p * prob).T @ ag + rq * (prob.T @ ag)
                bk[b, hk] += sc * (e_ds.T @ np.abs(Q[b, h]) + rq * (np.abs(ds).T @ np.abs(Q[b, h])))
                bq[b, h] = sc * (e_ds @ np.abs(K[b, hk]) + rk * (np.abs(ds) @ np.abs(K[b, hk])))
    if mma and dtype == "float16":
        # P and dS below 2^-14 round to fp16 subnormals: 2^-25 absolute each
        n = p.group * Sq
        bv += 2.0**-25 * n * float(np.max(np.abs(G), initial=0.0))
        bk += sc * 2.0**-25 * n * float(np.max(np.abs(Q), initial=0.0))
        bq += sc * 2.0**-25 * p.Sk * float(np.max(np.abs(K), initial=0.0))
    bounds = []
    for r, bd in zip(refs, (bq, bk, bv)):
        bd = bd if layout == "bhsd" else bd.transpose(0, 2, 1, 3)
        with np.errstate(invalid="ignore"):
            bounds.append(bd + 2 * U_OUT[dtype] * np.abs(r) + TINY[dtype])
    return refs, bounds


def _make_mask(rng, kind, B, Hq, Sq, Sk, dtype="float32"):
    if kind == "bool":
        mask = rng.random((Sq, Sk)) > 0.3
        mask[Sq // 2] = False                                   # a row that sees no key
        return mask
    if kind == "float":
        mask = _rand(rng, (B, 1, Sq, Sk), dtype, 2.0)
        mask[..., 0, :] = -np.inf                               # fully masked by -inf
        mask[..., 1:, 1] = -np.inf                              # a key masked for most rows
        return mask
    return None


# ----------------------------------------------------------------------------- CPU: reference

def _torch_grads(q, k, v, g, mask=None, is_causal=False, scale=None, enable_gqa=False,
                 window=None, layout="bhsd"):
    """torch autograd through its math SDPA in float64 (window_size as an explicit bool mask)."""
    t = [torch.from_numpy(_bhsd(x, layout).copy()).requires_grad_() for x in (q, k, v)]
    tm = None if mask is None else torch.from_numpy(np.asarray(mask).copy())
    if tm is not None and tm.dtype != torch.bool:
        tm = tm.double()
    Sq, Sk = t[0].shape[2], t[1].shape[2]
    if window is not None:
        left, right = window
        i, j = torch.arange(Sq)[:, None], torch.arange(Sk)[None, :]
        w = torch.ones(Sq, Sk, dtype=torch.bool)
        if left >= 0:
            w &= j >= i - left
        if right >= 0:
            w &= j <= i + right
        tm = w if tm is None else (tm & w if tm.dtype == torch.bool
                                   else tm.masked_fill(~w, -math.inf))
    out = torch.nn.functional.scaled_dot_product_attention(
        *t, attn_mask=tm, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    grads = torch.autograd.grad(out, t, torch.from_numpy(_bhsd(g, layout).copy()))
    return [x.numpy() if layout == "bhsd" else x.numpy().transpose(0, 2, 1, 3) for x in grads]


REF_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, options)
    (2, 2, 2, 1, 1, 8, {}),
    (1, 2, 2, 17, 17, 16, {"is_causal": True}),
    (1, 4, 2, 17, 33, 16, {"is_causal": True}),            # Sq < Sk: top-left causal, as torch
    (1, 4, 2, 33, 17, 16, {"is_causal": True}),            # Sq > Sk: rows past Sk see all keys
    (2, 8, 1, 128, 128, 32, {"scale": 0.3}),                 # GQA 8
    (1, 4, 2, 128, 128, 16, {"window": (8, 3)}),
    (1, 2, 2, 128, 96, 16, {"window": (4, -1), "is_causal": True}),
    (1, 2, 1, 128, 128, 16, {"window": (-1, 5), "mask": "bool"}),
    (1, 2, 2, 17, 40, 24, {"mask": "bool"}),
    (2, 2, 2, 17, 40, 24, {"mask": "float", "is_causal": True}),
    (1, 2, 2, 1, 17, 16, {"mask": "float"}),
]


@needs_torch
@pytest.mark.parametrize("case", REF_CASES, ids=lambda c: f"{c[:6]}-{sorted(c[6])}")
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_reference_matches_torch_autograd(case, layout, rng):
    B, Hq, Hkv, Sq, Sk, D, opt = case
    opt = dict(opt)
    q, k, v = (rng.standard_normal(s) for s in ((B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D)))
    g = rng.standard_normal((B, Hq, Sq, D))
    if layout == "bshd":
        q, k, v, g = (x.transpose(0, 2, 1, 3).copy() for x in (q, k, v, g))
    kind = opt.pop("mask", None)
    mask = _make_mask(rng, kind, B, Hq, Sq, Sk)
    if kind is not None:
        mask = np.asarray(mask, bool if kind == "bool" else np.float64)
    window = opt.pop("window", None)
    kw = dict(enable_gqa=Hq != Hkv, window_size=window, layout=layout, **opt)
    out, lse = ref_fwd(q, k, v, mask, return_lse=True, **kw)
    got = ref_bwd(g, q, k, v, out, lse, mask, **kw)
    exp = _torch_grads(q, k, v, g, mask, enable_gqa=Hq != Hkv, window=window, layout=layout,
                       **opt)
    for name, a, e in zip(("dq", "dk", "dv"), got, exp):
        assert a.shape == e.shape, name
        np.testing.assert_allclose(a, e, rtol=1e-10, atol=1e-12, err_msg=name)


@needs_torch
def test_reference_rows_that_see_no_key_have_no_gradient(rng):
    q, k, v, g = (rng.standard_normal((1, 2, 6, 8)) for _ in range(4))
    mask = np.ones((6, 6), bool)
    mask[4] = False
    out, lse = ref_fwd(q, k, v, mask, return_lse=True)
    dq, dk, dv = ref_bwd(g, q, k, v, out, lse, mask)
    assert np.all(dq[:, :, 4] == 0)
    exp = _torch_grads(q, k, v, g, mask)                    # torch >= 2.5: 0 there too
    for a, e in zip((dq, dk, dv), exp):
        np.testing.assert_allclose(a, e, rtol=1e-10, atol=1e-12)
    # a row's gradient does not depend on its dO where it saw no key
    g2 = g.copy()
    g2[:, :, 4] = 1e6
    for a, e in zip(ref_bwd(g2, q, k, v, out, lse, mask), (dq, dk, dv)):
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-12)
    # Sk = 0: dq = 0, dk and dv empty
    out0, lse0 = ref_fwd(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    dq0, dk0, dv0 = ref_bwd(g, q, k[:, :, :0], v[:, :, :0], out0, lse0)
    assert np.all(dq0 == 0) and dk0.shape == (1, 2, 0, 8) and dv0.shape == (1, 2, 0, 8)


def test_argument_errors():
    q = np.zeros((1, 4, 5, 8), np.float32)
    kv = np.zeros((1, 2, 6, 8), np.float32)
    lse = np.zeros((1, 4, 5), np.float32)
    f = go.scaled_dot_product_attention_backward
    op = "gpuops.scaled_dot_product_attention_backward"
    with pytest.raises(ValueError, match=f"{op}: 'grad_out' has shape \\(1, 4, 5, 4\\)"):
        f(q[..., :4], q, kv, kv, q, lse, enable_gqa=True)
    with pytest.raises(ValueError, match="'output' has shape"):
        f(q, q, kv, kv, q[:, :, :4], lse, enable_gqa=True)
    with pytest.raises(ValueError, match="'lse' has shape \\(1, 4, 4\\); expected"):
        f(q, q, kv, kv, q, lse[:, :, :4], enable_gqa=True)
    with pytest.raises(ValueError, match=f"{op}: 'key' has 2 heads but 'query' has 4"):
        f(q, q, kv, kv, q, lse)
    with pytest.raises(ValueError, match="'variant' must be one of"):
        f(q, q, kv, kv, q, lse, enable_gqa=True, variant="tensor")
    with pytest.raises(ValueError, match="'layout' must be one of"):
        f(q, q, kv, kv, q, lse, enable_gqa=True, layout="sbhd")
    with pytest.raises(TypeError, match="'window_size' must be None or a pair"):
        f(q, q, kv, kv, q, lse, enable_gqa=True, window_size=3)
    with pytest.raises(TypeError, match="'is_causal' must be a bool"):
        f(q, q, kv, kv, q, lse, None, 1, enable_gqa=True)
    with pytest.raises(ValueError, match="'attn_mask' has shape \\(5, 5\\)"):
        f(q, q, kv, kv, q, lse, np.ones((5, 5), bool), enable_gqa=True)
    with pytest.raises(TypeError, match="'lse' has dtype float16"):
        f(q, q, kv, kv, q, lse.astype(np.float16), enable_gqa=True)
    with pytest.raises(TypeError, match="'output' is float16 but 'grad_out' is float32"):
        f(q, q, kv, kv, q.astype(np.float16), lse, enable_gqa=True)


@needs_torch
def test_cpu_fallback_numpy_and_torch(rng):
    q, g = _rand(rng, (1, 2, 9, 16), "float32"), _rand(rng, (1, 2, 9, 16), "float32")
    k, v = _rand(rng, (1, 2, 11, 16), "float32"), _rand(rng, (1, 2, 11, 16), "float32")
    out, lse = go.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    assert lse.dtype == np.float32
    got = go.scaled_dot_product_attention_backward(g, q, k, v, out, lse, is_causal=True)
    exp = ref_bwd(g, q, k, v, out, lse, is_causal=True)
    for a, e in zip(got, exp):
        assert isinstance(a, np.ndarray) and a.dtype == np.float32
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7)
    tq, tk, tv, tg = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v, g))
    tout, tlse = go.scaled_dot_product_attention(tq, tk, tv, return_lse=True)
    assert tlse.dtype == torch.float32
    res = go.scaled_dot_product_attention_backward(tg, tq, tk, tv, tout, tlse)
    assert all(r.dtype == torch.bfloat16 for r in res)
    assert res[1].shape == (1, 2, 11, 16)


# ----------------------------------------------------------------------------- CPU: autograd

AUTOGRAD_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, options)
    (2, 4, 2, 17, 20, 16, {"is_causal": True}),
    (1, 8, 1, 33, 33, 8, {"mask": "bool", "scale": 0.7}),
    (1, 2, 2, 17, 40, 16, {"mask": "float"}),
    (1, 4, 4, 40, 40, 16, {"window": (5, 2), "layout": "bshd"}),
    (1, 2, 1, 1, 17, 16, {}),
]


@needs_torch
@pytest.mark.parametrize("case", AUTOGRAD_CASES, ids=lambda c: f"{c[:6]}-{sorted(c[6])}")
def test_autograd_cpu_float64_matches_torch(case, rng):
    import gpuops.torch as gt
    B, Hq, Hkv, Sq, Sk, D, opt = case
    opt = dict(opt)
    layout = opt.pop("layout", "bhsd")
    kind = opt.pop("mask", None)
    window = opt.pop("window", None)
    mask = _make_mask(rng, kind, B, Hq, Sq, Sk)
    shp = (lambda b, h, s: (b, h, s, D)) if layout == "bhsd" else (lambda b, h, s: (b, s, h, D))
    q, k, v = (torch.from_numpy(rng.standard_normal(s)).requires_grad_()
               for s in (shp(B, Hq, Sq), shp(B, Hkv, Sk), shp(B, Hkv, Sk)))
    w = torch.from_numpy(rng.standard_normal(shp(B, Hq, Sq)))
    tm = None if mask is None else torch.from_numpy(np.asarray(mask, bool if kind == "bool"
                                                               else np.float64))
    out = gt.scaled_dot_product_attention(q, k, v, tm, enable_gqa=Hq != Hkv, window_size=window,
                                          layout=layout, **opt)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    exp = _torch_grads(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), w.numpy(),
                       None if tm is None else tm.numpy(), enable_gqa=Hq != Hkv, window=window,
                       layout=layout, **opt)
    for a, e in zip(got, exp):
        np.testing.assert_allclose(a.numpy(), e, rtol=1e-10, atol=1e-12)
    # an expanded (stride 0) incoming gradient
    got = torch.autograd.grad(gt.scaled_dot_product_attention(
        q, k, v, tm, enable_gqa=Hq != Hkv, window_size=window, layout=layout, **opt).sum(),
        (q, k, v))
    exp = _torch_grads(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(),
                       np.ones(shp(B, Hq, Sq)), None if tm is None else tm.numpy(),
                       enable_gqa=Hq != Hkv, window=window, layout=layout, **opt)
    for a, e in zip(got, exp):
        np.testing.assert_allclose(a.numpy(), e, rtol=1e-10, atol=1e-12)


@needs_torch
def test_autograd_lse_output_and_argument_errors(rng):
    import gpuops.torch as gt
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, 5, 8))).requires_grad_()
               for _ in range(3))
    out, lse = gt.scaled_dot_product_attention(q, k, v, return_lse=True)
    assert lse.shape == (1, 2, 5) and lse.dtype == torch.float64 and not lse.requires_grad
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    with pytest.raises(ValueError, match="'dropout_p' must be 0"):
        gt.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="'attn_mask' requires grad"):
        gt.scaled_dot_product_attention(q, k, v, torch.zeros(5, 5, dtype=torch.float64,
                                                             requires_grad=True))
    with pytest.raises(TypeError, match="'window_size' must be None or a pair"):
        gt.scaled_dot_product_attention(q, k, v, window_size=(1.5, 2))
    with pytest.raises(ValueError, match="'key' has 1 heads but 'query' has 2"):
        gt.scaled_dot_product_attention(q, k[:, :1], v[:, :1])
    # the plain op refuses tensors that require grad (it records no autograd)
    with pytest.raises(RuntimeError, match="requires grad"):
        go.scaled_dot_product_attention_backward(out, q, k, v, out, lse)


@needs_torch
def test_torch_compile_fullgraph_cpu(rng):
    import gpuops.torch as gt
    q = torch.from_numpy(rng.standard_normal((1, 4, 9, 8))).requires_grad_()
    k, v = (torch.from_numpy(rng.standard_normal((1, 2, 11, 8))).requires_grad_()
            for _ in range(2))
    w = torch.from_numpy(rng.standard_normal((1, 4, 9, 8)))

    def f(q, k, v):
        return (gt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                window_size=(4, 0)) * w).sum()
    y = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    got = torch.autograd.grad(y, (q, k, v))
    exp = _torch_grads(*(x.detach().numpy() for x in (q, k, v)), w.numpy(), is_causal=True,
                       enable_gqa=True, window=(4, 0))
    np.testing.assert_allclose(y.item(), f(q, k, v).item(), rtol=1e-12)
    for a, e in zip(got, exp):
        np.testing.assert_allclose(a.numpy(), e, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- CPU: the kernels

def _emu_backward(dev, g, q, k, v, out, lse, mask=None, *, dtype, **kw):
    call = emu.Call(dev, ab.OP, dt.BY_NAME[dtype])
    t = [dev.tensor(x) for x in (g, q, k, v, out)]
    opts = dict(is_causal=False, scale=None, enable_gqa=False, window_size=None, layout="bhsd",
                variant="auto")
    opts.update(kw)
    res = ab._backward(call, *t, dev.tensor(lse), None if mask is None else dev.tensor(mask),
                       opts["is_causal"], opts["scale"], opts["enable_gqa"], opts["window_size"],
                       opts["layout"], opts["variant"])
    return [r.obj for r in res]


def _case_inputs(rng, case, dtype):
    B, Hq, Hkv, Sq, Sk, D, _, opt = case
    opt = dict(opt)
    layout = opt.get("layout", "bhsd")
    shp = (lambda b, h, s: (b, h, s, D)) if layout == "bhsd" else (lambda b, h, s: (b, s, h, D))
    q, g = _rand(rng, shp(B, Hq, Sq), dtype), _rand(rng, shp(B, Hq, Sq), dtype)
    k, v = _rand(rng, shp(B, Hkv, Sk), dtype), _rand(rng, shp(B, Hkv, Sk), dtype)
    mask = _make_mask(rng, opt.pop("mask", None), B, Hq, Sq, Sk, dtype)
    opt.setdefault("enable_gqa", Hq != Hkv)
    return g, q, k, v, mask, opt


# (B, Hq, Hkv, Sq, Sk, D, smem limit KB, options): every instantiation at least once
EMU_CASES = [
    (1, 2, 2, 17, 17, 32, 48, {"is_causal": True}),                             # D32 small
    (1, 2, 1, 70, 90, 32, 227, {"window_size": (9, 4)}),                        # D32 big
    (1, 2, 2, 45, 70, 64, 48, {"mask": "bool"}),                                # D64 small
    (1, 4, 2, 70, 70, 64, 227, {"mask": "float", "is_causal": True,
                                "layout": "bshd"}),                             # D64 big
    (1, 1, 1, 33, 66, 96, 48, {"mask": "float", "is_causal": True}),            # D96 small
    (1, 2, 2, 9, 70, 96, 227, {"layout": "bshd"}),                              # D96 big
    (1, 2, 2, 70, 40, 128, 227, {"is_causal": True, "scale": 0.2}),             # D128 big
    (1, 8, 1, 20, 36, 128, 48, {"mask": "bool", "window_size": (3, 2)}),        # general, 64
    (1, 2, 2, 19, 23, 17, 48, {"mask": "float"}),                               # general, 1 chunk
    (2, 2, 1, 21, 30, 40, 48, {"is_causal": True}),                             # general, 2 chunks
    (2, 4, 2, 130, 130, 64, 48, {"mask": "float", "is_causal": True, "window_size": (20, -1),
                                 "layout": "bshd"}),                            # many tiles
    (1, 2, 2, 1, 1, 64, 227, {}),
    (1, 2, 2, 1, 17, 128, 227, {"mask": "bool"}),
]


@needs_emu
@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: f"{c[:6]}-{c[6]}k-{sorted(c[7])}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_kernels(case, dtype, rng, monkeypatch):
    monkeypatch.setattr(at, "smem_limit", lambda dev: case[6] * 1024)
    monkeypatch.setattr(at, "tensor_cores", lambda dev: False)      # 'auto' -> the SIMT kernels
    g, q, k, v, mask, opt = _case_inputs(rng, case, dtype)
    out, lse = forward_for(q, k, v, mask, dtype=dtype, **opt)
    with emu.Device(sms=2) as dev:
        got = _emu_backward(dev, g, q, k, v, out, lse, mask, dtype=dtype, **opt)
        launched = [name for name, *_ in emu.Device.launches]
    d, br, bc, nt, general = ab.simt_config(case[5], case[6] * 1024)
    assert ab.dkdv_expr(dt.BY_NAME[dtype], d, br, bc, nt, general) in launched
    refs, bounds = bwd_bound(g, q, k, v, out, lse, mask, dtype=dtype, **opt)
    for name, a, e, bd in zip(("dq", "dk", "dv"), got, refs, bounds):
        assert a.dtype == _np_dtype(dtype)
        check(a, e, bd, f"{name} {case} {dtype}")


@needs_emu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_emulated_kernels_strided_and_unaligned(dtype, rng, monkeypatch):
    """Element-wise tile loads: a head-dim stride of 2, D the slow axis, rows off a 16-byte
    boundary; an expanded (stride 0) grad_out; a strided lse."""
    monkeypatch.setattr(at, "smem_limit", lambda dev: 227 * 1024)
    q = _rand(rng, (1, 2, 20, 128), dtype)[..., ::2]                       # D = 64, stride 2
    k = np.swapaxes(np.ascontiguousarray(np.swapaxes(_rand(rng, (1, 2, 25, 64), dtype), 2, 3)),
                    2, 3)
    v = emu.strided(_rand(rng, (1, 2, 25, 64), dtype), "offset")
    g = np.broadcast_to(_rand(rng, (1, 1, 1, 64), dtype), (1, 2, 20, 64))
    out, lse = forward_for(q, k, v, None, dtype=dtype, window_size=(5, 7))
    lse = np.repeat(lse, 2, axis=-1)[..., ::2]
    with emu.Device(sms=2) as dev:
        got = _emu_backward(dev, g, q, k, v, out, lse, dtype=dtype, window_size=(5, 7))
    refs, bounds = bwd_bound(g, q, k, v, out, lse, dtype=dtype, window_size=(5, 7))
    for name, a, e, bd in zip(("dq", "dk", "dv"), got, refs, bounds):
        check(a, e, bd, f"{name} strided {dtype}")


@needs_emu
def test_emulated_kernels_empty_sequences_and_nan(rng, monkeypatch):
    monkeypatch.setattr(at, "smem_limit", lambda dev: 48 * 1024)
    q, g = _rand(rng, (1, 2, 9, 32), "float32"), _rand(rng, (1, 2, 9, 32), "float32")
    k, v = _rand(rng, (1, 2, 12, 32), "float32"), _rand(rng, (1, 2, 12, 32), "float32")
    with emu.Device(sms=2) as dev:
        # Sk = 0: dq = 0 (written by the preprocess kernel), dk and dv empty
        out, lse = forward_for(q, k[:, :, :0], v[:, :, :0], None, dtype="float32")
        dq, dk, dv = _emu_backward(dev, g, q, k[:, :, :0], v[:, :, :0], out, lse,
                                   dtype="float32")
        assert np.all(dq == 0) and dk.shape == (1, 2, 0, 32)
        # Sq = 0: dk = dv = 0 (the main kernel visits no query tile)
        out, lse = forward_for(q[:, :, :0], k, v, None, dtype="float32")
        dq, dk, dv = _emu_backward(dev, g[:, :, :0], q[:, :, :0], k, v, out, lse,
                                   dtype="float32")
        assert dq.shape == (1, 2, 0, 32) and np.all(dk == 0) and np.all(dv == 0)
        # a NaN query row: its dq row and every dk, dv NaN (all tiles visited); other dq rows not
        qn = q.copy()
        qn[0, 1, 3, 5] = np.nan
        out, lse = forward_for(qn, k, v, None, dtype="float32")
        dq, dk, dv = _emu_backward(dev, g, qn, k, v, out, lse, dtype="float32")
        assert np.all(np.isnan(dq[0, 1, 3])) and not np.isnan(np.delete(dq[0, 1], 3, 0)).any()
        assert np.all(np.isnan(dk[0, 1])) and np.all(np.isnan(dv[0, 1]))
        assert not np.isnan(dq[0, 0]).any() and not np.isnan(dk[0, 0]).any()


# ----------------------------------------------------------------------------- CPU: the mma kernel

def _mma_launches():
    return [name for name, *_ in emu.Device.launches if "flash_bwd_mma" in name]


def _emu_mma_case(rng, monkeypatch, case, dtype, smem_kb=227, variant="mma"):
    """One case on the emulated tensor-core backward against the reference (mma bound); returns
    the names of the tensor-core kernels launched."""
    monkeypatch.setattr(at, "tensor_cores", lambda dev: True)
    monkeypatch.setattr(at, "smem_limit", lambda dev: smem_kb * 1024)
    B, Hq, Hkv, Sq, Sk, D, opt = case
    g, q, k, v, mask, opt = _case_inputs(rng, (B, Hq, Hkv, Sq, Sk, D, 0, opt), dtype)
    out, lse = forward_for(q, k, v, mask, dtype=dtype, **opt)
    with emu.Device(sms=2) as dev:
        got = _emu_backward(dev, g, q, k, v, out, lse, mask, dtype=dtype, variant=variant, **opt)
        names = _mma_launches()
    refs, bounds = bwd_bound(g, q, k, v, out, lse, mask, dtype=dtype, mma=True, **opt)
    for name, a, e, bd in zip(("dq", "dk", "dv"), got, refs, bounds):
        assert a.dtype == _np_dtype(dtype)
        check(a, e, bd, f"{name} {case} {dtype}")
    return names


# (B, Hq, Hkv, Sq, Sk, D, options): both head dims; query and key tails (1, 17, 70, 130, 200: not
# multiples of the tiles); causal with Sq <, =, > Sk (several query tiles per key block, warps
# idle on the diagonal); windows; GQA 2; bool / additive masks (rows that see no key); 'bshd'; a
# negative scale.
EMU_MMA_CASES = [
    (1, 2, 2, 1, 1, 64, {}),
    (1, 2, 2, 17, 17, 64, {"is_causal": True}),
    (1, 2, 2, 130, 130, 128, {"is_causal": True}),
    (1, 2, 2, 200, 140, 128, {"is_causal": True}),
    (1, 4, 2, 70, 200, 64, {"is_causal": True, "layout": "bshd"}),
    (2, 4, 2, 130, 70, 128, {"mask": "bool"}),
    (1, 2, 1, 70, 200, 64, {"window_size": (-1, 5)}),
    (1, 2, 1, 150, 150, 64, {"window_size": (20, 5)}),
    (1, 2, 2, 130, 130, 64, {"mask": "float", "is_causal": True, "layout": "bshd"}),
    (1, 1, 1, 130, 100, 128, {"window_size": (-1, 30), "scale": -0.1}),
    (1, 1, 1, 1, 130, 128, {"mask": "float", "scale": 0.3}),
]


@needs_emu
@pytest.mark.parametrize("case", EMU_MMA_CASES, ids=lambda c: f"{c[:6]}-{sorted(c[6])}")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_emulated_mma_kernel(case, dtype, rng, monkeypatch):
    names = _emu_mma_case(rng, monkeypatch, case, dtype)
    D, masked = case[5], "mask" in case[6]
    assert names == [ab.mma_expr(dt.BY_NAME[dtype], D, ab.mma_config(D, masked, 227 * 1024),
                                 masked)]


@needs_emu
@pytest.mark.parametrize("d,cfg", [(d, c) for d, cs in ab.MMA_ALTERNATES.items() for c in cs]
                         + [(d, c) for d, c in ab.MMA_SMALL_TILES.items()], ids=str)
def test_emulated_mma_alternate_tiles(d, cfg, rng, monkeypatch):
    """The tiles compiled for timing next to MMA_TILES (and the small-shared-memory ones) are
    correct too: causal + GQA over several query tiles per key block (both stages reused), a
    window with key and query tails, a negative scale."""
    monkeypatch.setitem(ab.MMA_TILES, d, cfg)
    for case in ((1, 4, 2, 150, 150, d, {"is_causal": True}),
                 (1, 1, 1, 40, 90, d, {"window_size": (9, 3), "layout": "bshd"}),
                 (1, 1, 1, 70, 130, d, {"scale": -0.1})):
        assert _emu_mma_case(rng, monkeypatch, case, "bfloat16") == [
            ab.mma_expr(dt.bfloat16, d, cfg)]


@needs_emu
def test_emulated_mma_small_shared_memory_and_masked_tiles(rng, monkeypatch):
    """99 KB devices (sm_86/89) take MMA_SMALL_TILES where the default tile does not fit; masked
    calls take MMA_MASK_TILES (or the small tile)."""
    case = (1, 2, 1, 70, 90, 128, {"is_causal": True})
    assert _emu_mma_case(rng, monkeypatch, case, "bfloat16", smem_kb=99) == [
        ab.mma_expr(dt.bfloat16, 128, ab.MMA_SMALL_TILES[128])]
    case = (1, 2, 1, 70, 90, 128, {"mask": "bool", "window_size": (30, 2)})
    assert _emu_mma_case(rng, monkeypatch, case, "float16", smem_kb=99) == [
        ab.mma_expr(dt.float16, 128, ab.MMA_SMALL_TILES[128], True)]
    assert _emu_mma_case(rng, monkeypatch, case, "float16") == [
        ab.mma_expr(dt.float16, 128, ab.MMA_MASK_TILES[128], True)]


@needs_emu
def test_emulated_mma_empty_sequences_nan_and_auto(rng, monkeypatch):
    monkeypatch.setattr(at, "tensor_cores", lambda dev: True)
    monkeypatch.setattr(at, "smem_limit", lambda dev: 227 * 1024)
    q, g = _rand(rng, (1, 2, 40, 64), "bfloat16"), _rand(rng, (1, 2, 40, 64), "bfloat16")
    k, v = _rand(rng, (1, 2, 50, 64), "bfloat16"), _rand(rng, (1, 2, 50, 64), "bfloat16")
    with emu.Device(sms=2) as dev:
        # 'auto' takes the tensor-core kernel; a NaN query row: its dq row and every dk, dv NaN
        qn = q.copy()
        qn[0, 1, 3, 5] = np.nan
        out, lse = forward_for(qn, k, v, None, dtype="bfloat16")
        dq, dk, dv = _emu_backward(dev, g, qn, k, v, out, lse, dtype="bfloat16")
        assert _mma_launches()
        assert np.all(np.isnan(dq[0, 1, 3])) and not np.isnan(np.delete(dq[0, 1], 3, 0)).any()
        assert np.all(np.isnan(dk[0, 1])) and np.all(np.isnan(dv[0, 1]))
        assert not np.isnan(dq[0, 0]).any() and not np.isnan(dk[0, 0]).any()
        # Sk = 0: dq = 0 (preprocess + conversion; no main launch)
        emu.Device.launches.clear()
        out, lse = forward_for(q, k[:, :, :0], v[:, :, :0], None, dtype="bfloat16")
        dq, dk, dv = _emu_backward(dev, g, q, k[:, :, :0], v[:, :, :0], out, lse,
                                   dtype="bfloat16", variant="mma")
        assert np.all(dq == 0) and dk.shape == (1, 2, 0, 64) and not _mma_launches()
        # Sq = 0: dk = dv = 0 (the main kernel visits no query tile)
        out, lse = forward_for(q[:, :, :0], k, v, None, dtype="bfloat16")
        dq, dk, dv = _emu_backward(dev, g[:, :, :0], q[:, :, :0], k, v, out, lse,
                                   dtype="bfloat16", variant="mma")
        assert dq.shape == (1, 2, 0, 64) and np.all(dk == 0) and np.all(dv == 0)
        assert _mma_launches()


@needs_emu
@pytest.mark.parametrize("kind", ["contig", "offset"])
def test_emulated_mma_vector_prep_and_conversion(kind, rng, monkeypatch):
    """The tensor-core path preprocesses and converts with 16-byte accesses (D / 8 lanes per
    row) where output / dq rows are aligned, else with the SIMT module's kernels; both right."""
    monkeypatch.setattr(at, "tensor_cores", lambda dev: True)
    monkeypatch.setattr(at, "smem_limit", lambda dev: 227 * 1024)
    for d, dtype in ((64, "bfloat16"), (128, "float16")):
        q, k, v, g = (_rand(rng, s, dtype) for s in ((1, 3, 45, d), (1, 3, 30, d),
                                                       (1, 3, 30, d), (1, 3, 45, d)))
        out, lse = forward_for(q, k, v, None, dtype=dtype, is_causal=True)
        out = emu.strided(out, kind)                 # 'offset': rows off a 16-byte boundary
        with emu.Device(sms=2) as dev:
            got = _emu_backward(dev, g, q, k, v, out, lse, dtype=dtype, is_causal=True)
            names = [name for name, *_ in emu.Device.launches]
        vec = kind == "contig"
        assert (ab.prep_vec_expr(dt.BY_NAME[dtype], d) in names) == vec
        assert (ab.prep_expr(dt.BY_NAME[dtype]) in names) == (not vec)
        assert ab.convert_vec_expr(dt.BY_NAME[dtype], d) in names
        refs, bounds = bwd_bound(g, q, k, v, out, lse, dtype=dtype, mma=True, is_causal=True)
        for name, a, e, bd in zip(("dq", "dk", "dv"), got, refs, bounds):
            check(a, e, bd, f"{name} {d} {dtype} {kind}")


class _FakeTensor:
    """What the wgmma checks read of a tensor: pointer, strides (elements), dtype, numel."""
    def __init__(self, shape, dtype=dt.bfloat16, ptr=1 << 20, strides=None):
        self.shape, self.dtype, self.ptr = tuple(shape), dtype, ptr
        self.strides = strides or tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        self.numel = int(np.prod(shape))


def test_wgmma_takes_only_what_its_kernel_has(monkeypatch):
    """wgmma_unsupported names why the Hopper backward cannot take a call (None: it can): 16-bit
    dtypes, head dims 64 / 128, no attn_mask, both sequences non-empty, output rows 16-byte
    aligned (the preprocess' vector loads), an sm_90 device."""
    monkeypatch.setattr(at, "wgmma_device", lambda dev: True)
    bf = dt.bfloat16

    def why(dtype=bf, D=128, Sq=300, Sk=300, mask_kind=0, out=None, B=1, H=4):
        p = at.Problem(B, H, H, Sq, Sk, D, 0.1, -1, 0, False)
        o = out or _FakeTensor((B, H, Sq, D), dtype)
        kv = _FakeTensor((B, H, Sk, D), dtype)
        return ab.wgmma_unsupported(FakeCall(dtype), p, o, kv, kv, "bhsd", mask_kind)
    assert why() is None and why(dt.float16, D=64) is None
    for got, expect in ((why(dt.float32), "dtype"), (why(D=96), "head dim 96"),
                        (why(mask_kind=1), "attn_mask"), (why(Sq=0), "empty"),
                        (why(Sk=0), "empty"), (why(B=2 ** 16, H=2 ** 16, Sk=2 ** 10), "2^31"),
                        (why(out=_FakeTensor((1, 4, 300, 128), ptr=(1 << 20) + 8)), "'output'"),
                        (why(out=_FakeTensor((1, 4, 300, 128), strides=(0, 0, 256, 2))),
                         "'output'")):
        assert got is not None and expect in got, (expect, got)
    monkeypatch.setattr(at, "wgmma_device", lambda dev: False)
    assert "sm_90" in why()


def test_wgmma_routing(monkeypatch):
    """'auto' launches the Hopper backward when it applies and its tensor maps exist
    (WGMMA_AUTO), else goes on as before ('mma' / 'simt'); an explicit 'wgmma' raises with the
    reason instead of falling back."""
    log = []
    monkeypatch.setattr(at, "wgmma_device", lambda dev: True)
    monkeypatch.setattr(ab, "_launch_wgmma_maps", lambda *a: log.append("wgmma"))
    monkeypatch.setattr(ab, "_launch_best", lambda *a: log.append("best"))
    maps = ["maps"]
    monkeypatch.setattr(ab, "_wgmma_maps", lambda *a: maps[0])

    def args(D=128, mask_kind=0):
        p = at.Problem(1, 4, 4, 300, 300, D, 0.1, -1, 0, False)
        q, kv = _FakeTensor((1, 4, 300, D)), _FakeTensor((1, 4, 300, D))
        return (FakeCall(dt.bfloat16), p, q, q, kv, kv, q, None, None, mask_kind, q, kv, kv,
                "bhsd")
    ab._launch_auto(*args())
    ab._launch_auto(*args(D=96))
    ab._launch_auto(*args(mask_kind=2))
    monkeypatch.setattr(ab, "WGMMA_AUTO_DIMS", (128,))
    ab._launch_auto(*args(D=64))             # a head dim 'auto' does not take it for
    monkeypatch.setattr(ab, "WGMMA_AUTO_DIMS", (64, 128))
    maps[0] = None                           # e.g. a stride TMA cannot take
    ab._launch_auto(*args())
    monkeypatch.setattr(ab, "WGMMA_AUTO", False)
    maps[0] = "maps"
    ab._launch_auto(*args())
    assert log == ["wgmma", "best", "best", "best", "best", "best"]
    monkeypatch.setattr(ab, "WGMMA_AUTO", True)
    monkeypatch.setattr(ab, "WGMMA_AUTO_DIMS", (64, 128))
    log.clear()
    ab._launch_auto(*args(D=64))
    assert log == ["wgmma"]
    log.clear()
    ab._launch_wgmma(*args())                # explicit: WGMMA_AUTO does not matter
    assert log == ["wgmma"]
    with pytest.raises(ValueError, match="variant='wgmma' does not take head dim 96"):
        ab._launch_wgmma(*args(D=96))
    maps[0] = None
    with pytest.raises(ValueError, match="variant='wgmma' does not take q, k, v or grad_out"):
        ab._launch_wgmma(*args())
    assert log == ["wgmma"]


def test_wgmma_shared_memory_mirrors_the_kernel():
    """wgmma_smem (host) against WgbLayout (flash_bwd_wgmma.cu): K, V, the stages of Q, dO and
    statistics, 2 dS^T buffers, 2 fp32 dQ partials, the barriers, 1 KiB of alignment slack; the
    tile constants; within the sm_90 opt-in limit."""
    import re  # noqa: PLC0415
    src = (Path(__file__).resolve().parents[1] / "cuda_src" / "attention" /
           "flash_bwd_wgmma.cu").read_text()
    consts = dict(re.findall(r"constexpr int (kWgb\w+) = (\d+);", src))
    assert (int(consts["kWgbBC"]), int(consts["kWgbBR"]), int(consts["kWgbStages"]),
            int(consts["kWgbThreads"])) == (ab.WGMMA_BC, ab.WGMMA_BR, ab.WGMMA_STAGES,
                                            ab.WGMMA_THREADS)
    for d in ab.WGMMA_DIMS:
        kv, stage = 2 * 128 * d * 2, 2 * 64 * d * 2 + 2 * 64 * 4
        n = ab.WGMMA_STAGES
        assert ab.wgmma_smem(d) == (kv + n * stage + 2 * 128 * 64 * 2 + 2 * 64 * 64 * 4
                                    + (1 + 2 * n) * 8 + 1024)
        assert ab.wgmma_smem(d) <= 227 * 1024


@needs_emu
def test_mma_falls_back_to_simt_and_explicit_mma_refuses(rng, monkeypatch):
    """'auto' takes the SIMT kernels for fp32, head dims without a tile, unaligned or strided-d
    rows and devices below sm_80; variant='mma' refuses those calls, naming the reason."""
    monkeypatch.setattr(at, "smem_limit", lambda dev: 227 * 1024)
    tc = {"on": True}
    monkeypatch.setattr(at, "tensor_cores", lambda dev: tc["on"])

    def kernels(g, q, k, v, dtype, variant="auto", **kw):
        out, lse = forward_for(q, k, v, None, dtype=dtype, **kw)
        with emu.Device(sms=2) as dev:
            got = _emu_backward(dev, g, q, k, v, out, lse, dtype=dtype, variant=variant, **kw)
            names = [name for name, *_ in emu.Device.launches]
        refs, bounds = bwd_bound(g, q, k, v, out, lse, dtype=dtype, mma=True, **kw)
        for a, e, bd in zip(got, refs, bounds):
            check(a, e, bd, f"fallback {dtype}")
        return [n for n in names if "dq_convert" not in n and "prep" not in n]

    def inputs(dtype, d=64, kind="contig"):
        return [emu.strided(_rand(rng, (1, 2, 20, d), dtype), kind) for _ in range(4)]

    assert "flash_bwd_mma" in kernels(*inputs("bfloat16"), "bfloat16")[0]
    assert "flash_bwd_dkdv" in kernels(*inputs("bfloat16"), "bfloat16", variant="simt")[0]
    for x, dtype, why in ((inputs("float32"), "float32", "float16 / bfloat16"),
                          (inputs("float16", 32), "float16", "head dim 32"),
                          (inputs("float16", 64, "offset"), "float16", "16-byte aligned"),
                          (inputs("bfloat16", 64, "sliced"), "bfloat16", "16-byte aligned")):
        assert "flash_bwd_dkdv" in kernels(*x, dtype)[0]
        out, lse = forward_for(*x[1:], None, dtype=dtype)
        with emu.Device(sms=2) as dev, pytest.raises(ValueError, match=f"variant='mma'.*{why}"):
            _emu_backward(dev, *x, out, lse, dtype=dtype, variant="mma")
    tc["on"] = False
    x = inputs("bfloat16")
    assert "flash_bwd_dkdv" in kernels(*x, "bfloat16")[0]
    out, lse = forward_for(*x[1:], None, dtype="bfloat16")
    with emu.Device(sms=2) as dev, pytest.raises(ValueError, match="compute capability 8.0"):
        _emu_backward(dev, *x, out, lse, dtype="bfloat16", variant="mma")


def test_mma_tiles_fit_and_compile_list():
    for d in ab.MMA_TILES:
        for masked in (False, True):
            cfg = ab.mma_config(d, masked, 227 * 1024)
            assert cfg == ab.mma_candidates(d, masked)[0]
            assert ab.mma_config(d, masked, 99 * 1024) is not None          # sm_86/89
            for dtype in (dt.float16, dt.bfloat16):
                assert ab.mma_expr(dtype, d, cfg, masked) in ab.MMA_MODULES[dtype].kernels
    assert ab.mma_config(128, False, 48 * 1024) is None
    assert ab.mma_smem(128, (8, 1, 64, 2, 1)) == 145 * 1024


def test_tile_configs_fit_shared_memory():
    for d in (32, 64, 96):
        D, br, bc, nt, general = ab.simt_config(d, 48 * 1024)
        assert (D, general) == (d, False) and ab.bwd_smem(D, br, bc) <= 48 * 1024
    assert ab.simt_config(128, 48 * 1024) == (64, 32, 32, 128, True)
    assert ab.simt_config(128, 227 * 1024) == (128, 64, 64, 256, False)
    for d in (32, 64, 96, 128):
        D, br, bc, nt, general = ab.simt_config(d, 227 * 1024)
        assert not general and ab.bwd_smem(D, br, bc) <= 227 * 1024
    for d in (1, 17, 40, 256, 1024):
        assert ab.simt_config(d, 227 * 1024) == (32, 32, 64, 128, True)


def test_flash_bwd_args_struct_matches_the_argspec():
    """FLASH_BWD_ARGS mirrors FlashBwdArgs field by field (cuda_src/attention/flash_bwd.cuh)."""
    import re
    from gpuops.runtime.sources import cuda_src_root
    text = (cuda_src_root() / "attention/flash_bwd.cuh").read_text()
    body = re.search(r"struct FlashBwdArgs \{(.*?)\n\};", text, re.S).group(1)
    fmt = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if not line:
            continue
        m = re.match(r"(const void\*|void\*|const float\*|float\*|long long|int|float)\s+(.*);",
                     line)
        code = {"const void*": "P", "void*": "P", "const float*": "P", "float*": "P",
                "long long": "q", "int": "i", "float": "f"}[m.group(1)]
        for name in m.group(2).split(","):
            n = re.search(r"\[(\d+)\]", name)
            fmt.append((code, int(n.group(1)) if n else 1))
    merged = []
    for code, n in fmt:
        if merged and merged[-1][0] == code:
            merged[-1] = (code, merged[-1][1] + n)
        else:
            merged.append((code, n))
    assert "".join(f"{n}{c}" for c, n in merged) == "12P43q10i2f"
    assert ab.FLASH_BWD_ARGS.params == ("12P43q10i2f",) and ab.FLASH_BWD_ARGS.size == 488


# ----------------------------------------------------------------------------- GPU

def _cuda(x, dtype):
    return torch.from_numpy(np.asarray(x, np.float32)).to("cuda", getattr(torch, dtype))


def _host(x):
    return x.double().cpu().numpy()


GPU_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, options)
    (2, 4, 4, 1, 1, 64, {}),
    (2, 4, 2, 17, 17, 32, {"is_causal": True}),
    (1, 8, 1, 128, 128, 128, {}),
    (1, 4, 4, 1000, 1000, 96, {"is_causal": True}),
    (1, 2, 2, 4097, 4097, 128, {"is_causal": True}),
    (1, 2, 1, 4097, 4097, 64, {"window_size": (256, 0)}),
    (1, 2, 2, 1000, 777, 128, {"mask": "bool"}),
    (1, 2, 2, 600, 1000, 64, {"mask": "float", "is_causal": True}),
    (2, 4, 2, 128, 4097, 128, {"window_size": (-1, 300)}),
    (1, 2, 2, 300, 300, 17, {"is_causal": True}),
    (1, 2, 2, 130, 200, 256, {"mask": "bool"}),
    (1, 4, 4, 1000, 1000, 128, {"layout": "bshd", "scale": 0.05}),
    (1, 8, 1, 1000, 1000, 32, {"is_causal": True}),
]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c[:6]}-{sorted(c[6])}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_against_reference(case, dtype, rng):
    """The kernels on the forward's own output and lse (GPU), against the reference run on the
    same values; outputs poisoned (GPUOPS_DEBUG_POISON=1, the workspaces too)."""
    B, Hq, Hkv, Sq, Sk, D, opt = case
    g, q, k, v, mask, opt = _case_inputs(rng, (B, Hq, Hkv, Sq, Sk, D, 0, opt), dtype)
    tq, tk, tv, tg = (_cuda(x, dtype) for x in (q, k, v, g))
    tm = None if mask is None else (torch.from_numpy(mask).cuda() if mask.dtype == bool
                                    else _cuda(mask, dtype))
    out, lse = go.scaled_dot_product_attention(tq, tk, tv, tm, return_lse=True, **opt)
    got = go.scaled_dot_product_attention_backward(tg, tq, tk, tv, out, lse, tm, **opt)
    # 16-bit storage may take the tensor-core kernel ('auto' on sm_80+): its bound
    refs, bounds = bwd_bound(g, q, k, v, _host(out), _host(lse), mask, dtype=dtype,
                             mma=dtype != "float32", **opt)
    for name, a, e, bd in zip(("dq", "dk", "dv"), got, refs, bounds):
        assert a.dtype == getattr(torch, dtype) and a.is_contiguous()
        check(_host(a), e, bd, f"{name} {case} {dtype}")


def _needs_tensor_cores():
    if not at.tensor_cores(torch.cuda.current_device()):
        pytest.skip("no tensor-core path on this device/GPUOPS_ARCH (sm_80+ needed)")


# (B, Hq, Hkv, Sq, Sk, options) for every head dim of the tensor-core kernel: causal, windows,
# GQA, masks, tails (lengths that are not multiples of the tiles), Sq != Sk, 'bshd'
GPU_MMA_CASES = [
    (2, 8, 8, 1000, 1000, {}),
    (1, 8, 8, 1000, 1000, {"is_causal": True}),
    (1, 4, 4, 4097, 4097, {"is_causal": True}),
    (1, 8, 4, 777, 1500, {"is_causal": True, "enable_gqa": True}),
    (1, 8, 1, 1500, 777, {"is_causal": True, "enable_gqa": True, "layout": "bshd"}),
    (1, 4, 2, 2000, 2000, {"window_size": (256, 0), "enable_gqa": True}),
    (1, 4, 4, 1000, 1300, {"window_size": (100, 50), "scale": 0.05}),
    (1, 4, 4, 600, 1000, {"mask": "bool"}),
    (1, 4, 2, 600, 1000, {"mask": "float", "is_causal": True, "enable_gqa": True}),
]


def _gpu_tc_case(case, d, dtype, rng, variant):
    """A tensor-core variant against the reference on the forward's own output and lse (mma
    bound: P and dS rounded to the dtype), and as close to float64 as torch's own SDPA backward
    in the same dtype (+ slack)."""
    B, Hq, Hkv, Sq, Sk, opt = case
    g, q, k, v, mask, opt = _case_inputs(rng, (B, Hq, Hkv, Sq, Sk, d, 0, opt), dtype)
    tq, tk, tv, tg = (_cuda(x, dtype) for x in (q, k, v, g))
    tm = None if mask is None else (torch.from_numpy(mask).cuda() if mask.dtype == bool
                                    else _cuda(mask, dtype))
    out, lse = go.scaled_dot_product_attention(tq, tk, tv, tm, return_lse=True, **opt)
    got = go.scaled_dot_product_attention_backward(tg, tq, tk, tv, out, lse, tm, variant=variant,
                                                   **opt)
    refs, bounds = bwd_bound(g, q, k, v, _host(out), _host(lse), mask, dtype=dtype, mma=True,
                             **opt)
    for name, a, e, bd in zip(("dq", "dk", "dv"), got, refs, bounds):
        assert a.dtype == getattr(torch, dtype) and a.is_contiguous()
        check(_host(a), e, bd, f"{name} {case} {d} {dtype} {variant}")
    if opt.get("layout", "bhsd") == "bshd" or opt.get("window_size") or mask is not None:
        return        # torch's fused backends take none of these; the reference covers them
    if not opt.get("scale", 1.0) > 0:
        return
    # against float64 autograd on the same rounded inputs: ours vs torch's fused SDPA backward
    t_opt = {k_: v_ for k_, v_ in opt.items() if k_ in ("is_causal", "scale", "enable_gqa")}
    exact = _grads(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
        a, b, c, **t_opt), [x.double() for x in (tq, tk, tv)], tg.double())
    theirs = _grads(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
        a, b, c, **t_opt), [tq, tk, tv], tg)
    for name, a, e, t in zip(("dq", "dk", "dv"), got, exact, theirs):
        e_ours, e_torch = _rel(a, e), _rel(t, e)
        assert e_ours <= 1.5 * e_torch + 2e-3, (name, e_ours, e_torch)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_MMA_CASES, ids=lambda c: f"{c[:5]}-{sorted(c[5])}")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_mma_against_reference_and_torch(case, d, dtype, rng):
    """variant='mma' against the reference and torch (_gpu_tc_case)."""
    _needs_tensor_cores()
    _gpu_tc_case(case, d, dtype, rng, "mma")


# The Hopper kernel ('wgmma', sm_90a): lengths that are not multiples of its tiles (64 queries,
# 128 keys) and of one tile; causal with Sq <, =, > Sk; windows whose query ranges start off a
# tile boundary; rows that see no key; GQA 2 / 8; 'bshd'; a custom and a negative scale.
GPU_WGMMA_CASES = [
    (1, 2, 2, 1, 1, {}),
    (2, 4, 2, 17, 17, {"is_causal": True, "enable_gqa": True}),
    (2, 8, 8, 1000, 1000, {}),
    (1, 4, 4, 4097, 4097, {"is_causal": True}),
    (1, 8, 4, 777, 1500, {"is_causal": True, "enable_gqa": True}),
    (1, 8, 1, 1500, 777, {"is_causal": True, "enable_gqa": True, "layout": "bshd"}),
    (1, 4, 2, 2000, 2000, {"window_size": (256, 0), "enable_gqa": True}),
    (1, 4, 4, 1000, 1300, {"window_size": (100, 50), "scale": 0.05}),
    (2, 4, 2, 128, 4097, {"window_size": (-1, 300), "enable_gqa": True}),
    (1, 2, 2, 300, 100, {"window_size": (0, 0)}),
    (1, 2, 2, 300, 300, {"scale": -0.1}),
]


@pytest.fixture
def wgmma_only(monkeypatch):
    """The Hopper kernel must take the call (a fallback to 'mma' or SIMT fails the test)."""
    if not at.wgmma_device(torch.cuda.current_device()):
        pytest.skip("no wgmma path on this device/GPUOPS_ARCH (sm_90 needed)")

    def fell_back(*args, **kw):
        raise AssertionError("fell back from 'wgmma'")
    for name in ("_launch_best", "_launch_mma", "_launch_simt"):
        monkeypatch.setattr(ab, name, fell_back)
    monkeypatch.setattr(ab, "WGMMA_AUTO_DIMS", ab.WGMMA_DIMS)     # 'auto' takes every head dim


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_WGMMA_CASES, ids=lambda c: f"{c[:5]}-{sorted(c[5])}")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", ["auto", "wgmma"])
def test_gpu_wgmma_against_reference_and_torch(case, d, dtype, variant, rng, wgmma_only):
    """The Hopper kernel ('auto' takes it on sm_90) against the reference and torch."""
    _gpu_tc_case(case, d, dtype, rng, variant)


@gpu
@needs_torch_cuda
def test_gpu_wgmma_refuses_masks_and_strided_rows(rng):
    """variant='wgmma' names what it cannot take; 'auto' takes 'mma' for those calls."""
    if not at.wgmma_device(torch.cuda.current_device()):
        pytest.skip("sm_90 needed")
    g, q, k, v, mask, opt = _case_inputs(rng, (1, 2, 2, 200, 200, 64, 0, {"mask": "bool"}),
                                         "bfloat16")
    tq, tk, tv, tg = (_cuda(x, "bfloat16") for x in (q, k, v, g))
    tm = torch.from_numpy(mask).cuda()
    out, lse = go.scaled_dot_product_attention(tq, tk, tv, tm, return_lse=True)
    with pytest.raises(ValueError, match="variant='wgmma' does not take an attn_mask"):
        go.scaled_dot_product_attention_backward(tg, tq, tk, tv, out, lse, tm, variant="wgmma")
    # rows 16-byte aligned but a head-dim stride of 2: TMA cannot read it
    wide = torch.zeros(1, 2, 200, 128, dtype=torch.bfloat16, device="cuda")
    wide[..., ::2] = tq
    sq = wide[..., ::2]
    out2, lse2 = go.scaled_dot_product_attention(sq, tk, tv, return_lse=True)
    with pytest.raises(ValueError, match="variant='wgmma' does not take"):
        go.scaled_dot_product_attention_backward(tg, sq, tk, tv, out2, lse2, variant="wgmma")
    got = go.scaled_dot_product_attention_backward(tg, sq, tk, tv, out2, lse2)     # 'auto'
    refs, bounds = bwd_bound(g, q, k, v, _host(out2), _host(lse2), dtype="bfloat16", mma=True)
    for name, a, e, bd in zip(("dq", "dk", "dv"), got, refs, bounds):
        check(_host(a), e, bd, f"{name} strided auto")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("d,cfg", [(d, c) for d, cs in ab.MMA_ALTERNATES.items() for c in cs]
                         + [(d, c) for d, c in ab.MMA_SMALL_TILES.items()], ids=str)
def test_gpu_mma_alternate_tiles(d, cfg, rng, monkeypatch):
    """The tiles the experiment script times next to MMA_TILES (and the small-shared-memory ones)
    on the GPU: causal + GQA, a window with tails."""
    _needs_tensor_cores()
    monkeypatch.setitem(ab.MMA_TILES, d, cfg)
    for case in ((1, 8, 2, 1000, 1000, d, 0, {"is_causal": True, "enable_gqa": True}),
                 (1, 4, 4, 777, 1300, d, 0, {"window_size": (200, 3), "layout": "bshd"})):
        g, q, k, v, mask, opt = _case_inputs(rng, case, "bfloat16")
        tq, tk, tv, tg = (_cuda(x, "bfloat16") for x in (q, k, v, g))
        out, lse = go.scaled_dot_product_attention(tq, tk, tv, return_lse=True, **opt)
        got = go.scaled_dot_product_attention_backward(tg, tq, tk, tv, out, lse, variant="mma",
                                                       **opt)
        refs, bounds = bwd_bound(g, q, k, v, _host(out), _host(lse), dtype="bfloat16", mma=True,
                                 **opt)
        for name, a, e, bd in zip(("dq", "dk", "dv"), got, refs, bounds):
            check(_host(a), e, bd, f"{name} {case} {cfg}")


def _grads(fn, leaves, grad):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    return torch.autograd.grad(fn(*leaves), leaves, grad)


def _rel(a, e):
    """Relative Frobenius error; absolute where the exact gradient is 0 (one key: dq = 0)."""
    n = float(e.norm())
    return float((a.double() - e).norm()) / (n if n > 0 else 1.0)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opt", [{"is_causal": True}, {"enable_gqa": True},
                                 {"mask": True, "is_causal": True}],
                         ids=["causal", "gqa", "mask"])
def test_gpu_autograd_against_float64_and_torch(dtype, opt, rng):
    """gpuops.torch on CUDA: gradients against torch's math SDPA in float64 on the same rounded
    inputs, at least as close as torch's own SDPA backward in the same dtype (+ slack)."""
    import gpuops.torch as gt
    opt = dict(opt)
    td = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    hkv = 2 if opt.get("enable_gqa") else 8
    q = torch.randn(2, 8, 1000, 128, device="cuda", generator=gen).to(td)
    k, v = (torch.randn(2, hkv, 1000, 128, device="cuda", generator=gen).to(td) for _ in range(2))
    w = torch.randn(2, 8, 1000, 128, device="cuda", generator=gen).to(td)
    mask = None
    if opt.pop("mask", False):
        # the diagonal stays visible: no row is fully masked under the causal fold (torch's
        # fused backends and its math backend disagree on such rows)
        mask = (torch.rand(1000, 1000, device="cuda", generator=gen) > 0.2) \
            | torch.eye(1000, dtype=torch.bool, device="cuda")
    def run(fn, dt_, opt=opt, mask=mask):
        return _grads(lambda a, b, c: fn(a, b, c, attn_mask=mask, **opt), [q.to(dt_), k.to(dt_),
                                                                            v.to(dt_)], w.to(dt_))
    ours = run(gt.scaled_dot_product_attention, td)
    # torch refuses attn_mask together with is_causal: its side gets the causal mask folded in
    # (gpuops applies both, as torch's math backend would)
    t_opt, t_mask = dict(opt), mask
    if mask is not None and t_opt.pop("is_causal", False):
        t_mask = mask & torch.ones(1000, 1000, dtype=torch.bool, device="cuda").tril()
    exact = run(torch.nn.functional.scaled_dot_product_attention, torch.float64, t_opt, t_mask)
    theirs = run(torch.nn.functional.scaled_dot_product_attention, td, t_opt, t_mask)
    for name, a, e, t in zip(("dq", "dk", "dv"), ours, exact, theirs):
        assert a.dtype == td
        e_ours, e_torch = _rel(a, e), _rel(t, e)
        assert e_ours <= 1.5 * e_torch + (1e-5 if dtype == "float32" else 2e-3), (
            name, e_ours, e_torch)
        if dtype == "float32":
            assert e_ours <= 1e-5, (name, e_ours)


@gpu
@needs_torch_cuda
def test_gpu_dk_dv_deterministic_dq_close(rng):
    q, k, v, g = (_cuda(_rand(rng, (2, 8, 700, 64), "bfloat16"), "bfloat16") for _ in range(4))
    out, lse = go.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    first = go.scaled_dot_product_attention_backward(g, q, k, v, out, lse, is_causal=True)
    for _ in range(3):
        again = go.scaled_dot_product_attention_backward(g, q, k, v, out, lse, is_causal=True)
        assert torch.equal(first[1], again[1]) and torch.equal(first[2], again[2])
        # dq: fp32 atomics in any order, then one rounding to bf16
        torch.testing.assert_close(first[0], again[0], rtol=2.0**-7, atol=1e-6)


@gpu
@needs_torch_cuda
def test_gpu_torch_compile_fullgraph(rng):
    import gpuops.torch as gt
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.float32, requires_grad=True)
               for _ in range(3))

    def f(q, k, v):
        return gt.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()
    y = torch.compile(f, fullgraph=True)(q, k, v)
    got = torch.autograd.grad(y, (q, k, v))
    exp = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, e in zip(got, exp):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


@gpu
@needs_torch_cuda
def test_gpu_cuda_graph_and_side_stream(rng):
    q, k, v, g = (_cuda(_rand(rng, (1, 4, 200, 64), "bfloat16"), "bfloat16") for _ in range(4))
    out, lse = go.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    exp = go.scaled_dot_product_attention_backward(g, q, k, v, out, lse, is_causal=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        go.scaled_dot_product_attention_backward(g, q, k, v, out, lse, is_causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = go.scaled_dot_product_attention_backward(g, q, k, v, out, lse, is_causal=True)
    g.copy_(g * 0.5)
    graph.replay()
    torch.cuda.synchronize()
    exp2 = go.scaled_dot_product_attention_backward(g, q, k, v, out, lse, is_causal=True)
    for a, e, e0 in zip(res, exp2, exp):
        torch.testing.assert_close(a, e, rtol=2.0**-7, atol=1e-6)
        assert not torch.equal(a, e0)


@gpu
@needs_torch_cuda
def test_gpu_empty_sequences_and_fully_masked():
    q = torch.randn(1, 2, 3, 64, device="cuda", dtype=torch.float16)
    kv = torch.randn(1, 2, 5, 64, device="cuda", dtype=torch.float16)
    out, lse = go.scaled_dot_product_attention(q, kv[:, :, :0], kv[:, :, :0], return_lse=True)
    dq, dk, dv = go.scaled_dot_product_attention_backward(q, q, kv[:, :, :0], kv[:, :, :0], out,
                                                          lse)
    assert torch.all(dq == 0) and dk.shape == (1, 2, 0, 64)
    out, lse = go.scaled_dot_product_attention(q[:, :, :0], kv, kv, return_lse=True)
    dq, dk, dv = go.scaled_dot_product_attention_backward(q[:, :, :0], q[:, :, :0], kv, kv, out,
                                                          lse)
    assert dq.shape == (1, 2, 0, 64) and torch.all(dk == 0) and torch.all(dv == 0)
    mask = torch.zeros(3, 5, dtype=torch.bool, device="cuda")
    out, lse = go.scaled_dot_product_attention(q, kv, kv, mask, return_lse=True)
    dq, dk, dv = go.scaled_dot_product_attention_backward(q, q, kv, kv, out, lse, mask)
    assert torch.all(dq == 0) and torch.all(dk == 0) and torch.all(dv == 0)
