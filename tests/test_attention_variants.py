"""linear_attention, kernelized_attention, multiscale_attention against float64 references.

CPU: each reference against an independent dense definition (the S x S weight matrix with its
mask, built here: for linear attention W = phi(Q) phi(K)^T masked, for kernelized attention the
same with unstabilized features, for multiscale attention the SDPA reference with the boolean
mask of the windows), the causal linear reference against torch's chunked form in float64 and a
prefix property; the random features; a statistical test that the kernelized approximation
error against exact attention falls with num_features (fixed seeds and data: deterministic, and
it fails if the features are wrong); argument errors; the CPU fallback. The kernels (every
instantiation kind: feature maps, causal or not, fp32 features, D and Dv not multiples of 32 or
above 64, GQA, strides, split non-causal state with its scan, multiscale head dims 32/64/128/256)
run in the CPU emulator (tests/emu.py) on small shapes. GPU (``gpu`` marker): the same checks at
larger shapes and S up to 65,536, torch peers, CUDA graphs; outputs poisoned (conftest).

Tolerances (derived, not tuned), with u = 2^-24 (fp32 math) and inputs exactly representable in
the storage dtype (both sides see the same values):

* linear / kernelized: out = (W v) / (W 1 + eps), W = (phi(Q) phi(K)^T) masked. The kernel's
  features carry absolute errors eq, ek (elu: expf, 2^-21 relative; relu/identity: exact; the
  random features: derived in ``favor_expect``), and every product q_r k_jr v_j passes through
  fp32 sums of depth <= F + Sk + 70, so |dW| <= E + g |W|abs with E = eq |phi_k|^T +
  |phi_q| ek^T + eq ek^T, |W|abs = |phi_q| |phi_k|^T (masked), g = (F + Sk + 70) u; then
  |d out| <= (dE |v| + |out| dE 1) / (|den| - dE 1) + (2u + u_out) |out|, dE = E + g |W|abs.
* multiscale: the flash-attention bound (tests/test_attention.py) with the visible keys: scores
  off by e_s = |scale| (D + 4) u max|q||k| + 4 u max|s|, probabilities by a relative
  2 e_s + 2^-21 (MUFU ex2), sums over <= 2w + 1 keys by (2w + 5) u; so
  |out - ref| <= (4 e_s + 2^-20 + (2w + 5) u) P|V| + 2 u_out |ref|, with P|V| the reference on |v|.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import gpuops as go
from gpuops import dtypes as dt
from gpuops.ops import attention as at
from gpuops.ops import attention_variants as av
from conftest import HAS_TORCH, gpu, needs_torch, needs_torch_cuda

torch = pytest.importorskip("torch") if HAS_TORCH else None
import emu  # noqa: E402
from emu import needs_emu  # noqa: E402
from attention_testing import (  # noqa: E402  (shared by the attention test files)
    DTYPES, TINY, U32, U_OUT, check, np_dtype as _np_dtype, rand as _rand)



def _f64(x):
    return np.asarray(x, np.float64)


# ----------------------------------------------------------------------------- dense definitions

def causal_mask(sq, sk):
    """Top-left aligned, as torch's is_causal: key j visible from query i iff j <= i."""
    return np.arange(sk)[None, :] <= np.arange(sq)[:, None]


def dense_feature_attention(fq, fk, v, mask, eps):
    """out = (W v) / (W 1 + eps) with W = (fq fk^T) masked: the S x S definition."""
    w = (fq @ fk.T) * mask
    with np.errstate(divide="ignore", invalid="ignore"):
        return (w @ v) / (w.sum(axis=1) + eps)[:, None]


def feature_bound(fq, fk, eq, ek, v, mask, eps, dtype):
    """Elementwise bound on |kernel - reference| of one head (module docstring)."""
    F, Sk = fq.shape[1], fk.shape[0]
    aq, ak = np.abs(fq), np.abs(fk)
    w = (fq @ fk.T) * mask
    wabs = (aq @ ak.T) * mask
    de = (eq @ ak.T + aq @ ek.T + eq @ ek.T) * mask + (F + Sk + 70) * U32 * wabs
    den = w.sum(axis=1) + eps
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (w @ v) / den[:, None]
        dd = de.sum(axis=1)
        margin = np.abs(den) - dd
        b = (de @ np.abs(v) + np.abs(out) * dd[:, None]) / margin[:, None]
        b = b + (2 * U32 + U_OUT[dtype]) * np.abs(out) + TINY[dtype]
    return np.where(margin[:, None] > 0, b, np.inf)


def _heads(p_q, p_k, group):
    """(q head, kv head) pairs."""
    return [(h, h // group) for h in range(p_q)]


def linear_expect(q, k, v, feature_map, causal, eps, dtype, enable_gqa=False):
    """(reference, bound) of linear_attention for the stored values q, k, v."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    exp = av.ref_linear_attention(q, k, v, feature_map, causal, eps, enable_gqa)
    B, Hq, Sq, _ = q.shape
    Sk = k.shape[2]
    mask = causal_mask(Sq, Sk) if causal else np.ones((Sq, Sk), bool)
    rel = 2.0**-21 if feature_map == "elu" else 0.0
    bound = np.empty_like(exp)
    for b in range(B):
        for h, hk in _heads(Hq, k.shape[1], Hq // k.shape[1]):
            fq, fk = av.phi(q[b, h], feature_map), av.phi(k[b, hk], feature_map)
            bound[b, h] = feature_bound(fq, fk, rel * np.abs(fq), rel * np.abs(fk), v[b, hk], mask,
                                        eps, dtype)
    return exp, bound


def favor_errors(x, w, kernel, scale, is_query):
    """(features, absolute error bound of the kernel's fp32 features) of one head's rows x.

    u = w . x' is off by du <= (D + 4) u sum|w||x'| (x' = x * fp32(sqrt(scale)), the dot);
    'rbf': cos/sin within 2 ulp, times 1/sqrt(m): (du + 2^-21) / sqrt(m). 'softmax':
    L = u - |x'|^2 / 2 off by dL <= du + (D + 4) u |x'|^2 + u |L|, the stabilizer (a max) by
    max dL, and exp(L - stab) / sqrt(m) adds u |L - stab| + 2^-20 relative (expf, rounding)."""
    m, D = w.shape
    xs = x * math.sqrt(scale)
    f = av.favor_features(x, w, kernel, scale, is_query)
    du = (D + 4) * U32 * (np.abs(xs) @ np.abs(w).T)
    if kernel == "rbf":
        e = (du + 2.0**-21) / math.sqrt(m)
        return f, np.concatenate([e, e], axis=1)
    n2 = np.sum(xs * xs, axis=1, keepdims=True)
    logits = xs @ w.T - 0.5 * n2
    dl = du + (D + 4) * U32 * n2 + U32 * np.abs(logits)
    if is_query:
        stab, dstab = logits.max(axis=1, keepdims=True), dl.max(axis=1, keepdims=True)
    else:
        stab, dstab = logits.max(), dl.max()
    rel = dl + dstab + U32 * np.abs(logits - stab) + 2.0**-20
    return f, 1.01 * rel * f + 1e-37


def kernelized_expect(q, k, v, num_features, kernel, seed, causal, dtype, scale=None,
                      orthogonal=True, eps=0.0, enable_gqa=False):
    q, k, v = _f64(q), _f64(k), _f64(v)
    exp = av.ref_kernelized_attention(q, k, v, num_features, kernel, seed, causal, scale,
                                      orthogonal, eps, enable_gqa)
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    sc = scale if scale is not None else 1 / math.sqrt(D)
    w = av.random_features(num_features, D, seed, orthogonal)
    mask = causal_mask(Sq, Sk) if causal else np.ones((Sq, Sk), bool)
    bound = np.empty_like(exp)
    for b in range(B):
        for h, hk in _heads(Hq, k.shape[1], Hq // k.shape[1]):
            fq, eq = favor_errors(q[b, h], w, kernel, sc, True)
            fk, ek = favor_errors(k[b, hk], w, kernel, sc, False)
            bound[b, h] = feature_bound(fq, fk, eq, ek, v[b, hk], mask, eps, dtype)
    return exp, bound


def multiscale_mask(ws, ds, h, hq, sq, sk, causal):
    """[Sq, Sk] bool: the keys head h sees, straight from the definition."""
    per = hq // len(ws)
    w, d = ws[h // per], ds[h // per]
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    ok = (np.abs(i - j) <= w * d) & ((i - j) % d == 0)
    return ok & (j <= i) if causal else ok


def multiscale_expect(q, k, v, ws, ds, dtype, scale=None, causal=False, enable_gqa=False):
    q, k, v = _f64(q), _f64(k), _f64(v)
    exp = av.ref_multiscale_attention(q, k, v, ws, ds, scale, causal, enable_gqa)
    pv = av.ref_multiscale_attention(q, k, np.abs(v), ws, ds, scale, causal, enable_gqa)
    D = q.shape[-1]
    sc = abs(scale) if scale is not None else 1 / math.sqrt(D)
    group = q.shape[1] // k.shape[1]
    g = max(float((np.abs(q[:, h]) @ np.abs(k[:, h // group]).transpose(0, 2, 1)).max(initial=0))
            for h in range(q.shape[1]))
    e_s = sc * (D + 4) * U32 * g + 4 * U32 * sc * g
    n = 2 * max(ws) + 1
    rel = 4 * e_s + 2.0**-20 + (n + 4) * U32
    return exp, rel * pv + 2 * U_OUT[dtype] * np.abs(exp) + TINY[dtype]


# ----------------------------------------------------------------------------- CPU: references

LIN_REF_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, Dv)
    (1, 2, 2, 1, 1, 4, 4),
    (2, 2, 2, 37, 37, 8, 5),
    (1, 4, 2, 300, 300, 16, 24),      # GQA; causal chunks of 256 in the reference
    (1, 2, 1, 70, 30, 8, 8),          # Sq > Sk: rows past Sk see every key
    (1, 2, 2, 30, 70, 8, 3),          # Sq < Sk: keys past Sq never seen when causal
    (1, 2, 2, 9, 0, 8, 4),            # no keys
]


@pytest.mark.parametrize("case", LIN_REF_CASES, ids=str)
@pytest.mark.parametrize("feature_map", ["elu", "relu", "identity"])
@pytest.mark.parametrize("causal", [False, True])
def test_linear_reference_matches_dense_definition(case, feature_map, causal, rng):
    B, Hq, Hkv, Sq, Sk, D, Dv = case
    q, k = rng.standard_normal((B, Hq, Sq, D)), rng.standard_normal((B, Hkv, Sk, D))
    v = rng.standard_normal((B, Hkv, Sk, Dv))
    eps = 1e-3 if feature_map == "identity" else 1e-6
    got = av.ref_linear_attention(q, k, v, feature_map, causal, eps, Hq != Hkv)
    assert got.shape == (B, Hq, Sq, Dv)
    mask = causal_mask(Sq, Sk) if causal else np.ones((Sq, Sk), bool)
    for b in range(B):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            exp = dense_feature_attention(av.phi(q[b, h], feature_map),
                                          av.phi(k[b, hk], feature_map), v[b, hk], mask, eps)
            np.testing.assert_allclose(got[b, h], exp, rtol=1e-9, atol=1e-9)


def test_linear_reference_feature_maps_and_eps():
    x = np.array([-2.0, -0.5, 0.0, 0.5, 3.0])
    np.testing.assert_allclose(av.phi(x, "elu"), [math.exp(-2), math.exp(-0.5), 1.0, 1.5, 4.0])
    np.testing.assert_array_equal(av.phi(x, "relu"), [0, 0, 0, 0.5, 3.0])
    np.testing.assert_array_equal(av.phi(x, "identity"), x)
    # relu features all 0 (a query of negatives): 0 / (0 + eps) = 0, not NaN
    q = -np.ones((1, 1, 3, 4))
    k = np.ones((1, 1, 5, 4))
    v = np.ones((1, 1, 5, 2))
    assert np.all(av.ref_linear_attention(q, k, v, "relu") == 0)
    # eps enters the denominator exactly once: W 1 = 5 * 4 = 20 per row with phi = x
    out = av.ref_linear_attention(-q, k, v, "identity", eps=0.5)
    np.testing.assert_allclose(out, 20.0 / 20.5)


def test_linear_causal_rows_ignore_later_keys(rng):
    q, k, v = (rng.standard_normal((1, 2, 200, 8)) for _ in range(3))
    out = av.ref_linear_attention(q, k, v, causal=True)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 120:] = rng.standard_normal((1, 2, 80, 8)) * 5
    v2[:, :, 120:] = 100.0
    out2 = av.ref_linear_attention(q, k2, v2, causal=True)
    np.testing.assert_array_equal(out[:, :, :120], out2[:, :, :120])
    assert not np.allclose(out[:, :, 120:], out2[:, :, 120:])


@needs_torch
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("sizes", [(200, 200), (130, 90), (64, 150)])
def test_linear_reference_matches_torch_chunked_form(feature_map, sizes, rng):
    """The bench's torch peer (chunks of 64, cumsum of chunk states), run in float64."""
    Sq, Sk = sizes
    q = rng.standard_normal((2, 3, Sq, 16))
    k, v = rng.standard_normal((2, 3, Sk, 16)), rng.standard_normal((2, 3, Sk, 12))
    for causal in (False, True):
        exp = av.ref_linear_attention(q, k, v, feature_map, causal)
        got = av.torch_linear_attention(*(torch.from_numpy(x) for x in (q, k, v)), feature_map,
                                        causal).numpy()
        np.testing.assert_allclose(got, exp, rtol=1e-10, atol=1e-12)


def test_random_features_are_reproducible_orthogonal_blocks():
    w = av.random_features(40, 16, 7, True)
    assert w.shape == (40, 16) and not w.flags.writeable
    np.testing.assert_array_equal(w, w.astype(np.float32).astype(np.float64))
    np.testing.assert_array_equal(w, av.random_features.__wrapped__(40, 16, 7, True))
    assert not np.array_equal(w, av.random_features(40, 16, 8, True))
    for b0 in (0, 16, 32):                                   # rows of a block are orthogonal
        blk = w[b0:b0 + 16]
        g = blk @ blk.T
        off = g - np.diag(np.diag(g))
        assert np.abs(off).max() < 1e-5 * np.diag(g).max()
    # every row N(0, I): squared norms ~ chi^2_16 (mean 16) over many rows
    big = av.random_features(4096, 16, 1, True)
    assert abs(np.mean(np.sum(big**2, axis=1)) - 16) < 0.5
    iid = av.random_features(4096, 16, 1, False)
    assert abs(iid.mean()) < 0.02 and abs(iid.var() - 1) < 0.03


@pytest.mark.parametrize("kernel", ["softmax", "rbf"])
@pytest.mark.parametrize("causal", [False, True])
def test_kernelized_reference_matches_unstabilized_dense_definition(kernel, causal, rng):
    """Stabilizers cancel (eps = 0): the S x S form with raw features gives the same result."""
    B, Hq, Hkv, Sq, Sk, D, Dv, m = 1, 4, 2, 40, 50, 8, 6, 24
    q, k = rng.standard_normal((B, Hq, Sq, D)) * 0.7, rng.standard_normal((B, Hkv, Sk, D)) * 0.7
    v = rng.standard_normal((B, Hkv, Sk, Dv))
    got = av.ref_kernelized_attention(q, k, v, m, kernel, 5, causal, None, True, 0.0, True)
    w = av.random_features(m, D, 5, True)
    mask = causal_mask(Sq, Sk) if causal else np.ones((Sq, Sk), bool)

    def raw(x):
        xs = x * D**-0.25
        u = xs @ w.T
        if kernel == "rbf":
            return np.hstack([np.cos(u), np.sin(u)]) / math.sqrt(m)
        return np.exp(u - 0.5 * np.sum(xs**2, axis=1, keepdims=True)) / math.sqrt(m)
    for h in range(Hq):
        exp = dense_feature_attention(raw(q[0, h]), raw(k[0, h // 2]), v[0, h // 2], mask, 0.0)
        np.testing.assert_allclose(got[0, h], exp, rtol=1e-9, atol=1e-9)


def _dense_softmax(q, k, v, causal, scale):
    s = q @ k.swapaxes(-1, -2) * scale
    if causal:
        s = np.where(causal_mask(q.shape[-2], k.shape[-2]), s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return (e @ v) / e.sum(axis=-1, keepdims=True)


def _dense_gaussian(q, k, v, causal, scale):
    qs, ks = q * math.sqrt(scale), k * math.sqrt(scale)
    w = np.exp(-0.5 * np.sum((qs[..., :, None, :] - ks[..., None, :, :]) ** 2, axis=-1))
    if causal:
        w = w * causal_mask(q.shape[-2], k.shape[-2])
    return (w @ v) / w.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("kernel", ["softmax", "rbf"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("orthogonal", [True, False])
def test_kernelized_error_falls_with_num_features(kernel, causal, orthogonal):
    """Statistical: the relative L2 error against exact attention (softmax; Gaussian kernel for
    'rbf'), averaged over 8 feature seeds, must fall at every 4x step of m = 16..1024, by at
    least 0.5x from 64 to 1024 (theory: 1/sqrt(m), i.e. 0.25x), and be small at m = 1024.
    Fixed data and seeds: deterministic. Measured (8 configurations): m = 1024 errors 0.023..0.092
    (limits 0.15 softmax, 0.075 rbf: margin >= 1.6x), ratios 1024/64 0.22..0.36 (limit 0.5),
    every 4x step a factor 0.75 or less."""
    rng = np.random.default_rng(20261122)
    S, D = 64, 16
    q, k = rng.standard_normal((1, 2, S, D)) * 0.5, rng.standard_normal((1, 2, S, D)) * 0.5
    v = rng.standard_normal((1, 2, S, D))
    exact = (_dense_softmax if kernel == "softmax" else _dense_gaussian)(q, k, v, causal,
                                                                       1 / math.sqrt(D))
    errs = []
    for m in (16, 64, 256, 1024):
        e = [np.linalg.norm(av.ref_kernelized_attention(q, k, v, m, kernel, seed, causal,
                                                        orthogonal=orthogonal) - exact)
             / np.linalg.norm(exact) for seed in range(8)]
        errs.append(float(np.mean(e)))
    assert errs[0] > errs[1] > errs[2] > errs[3], errs
    assert errs[3] < 0.5 * errs[1], errs
    assert errs[3] < (0.15 if kernel == "softmax" else 0.075), errs


MS_REF_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, windows, dilations, options)
    (1, 2, 2, 1, 1, 8, (0,), (1,), {}),
    (1, 4, 4, 40, 40, 8, (3, 5), (1, 4), {}),
    (2, 6, 3, 70, 70, 16, (2, 0, 9), (3, 7, 1), {"causal": True}),
    (1, 4, 1, 50, 33, 8, (4, 100), (2, 1), {"scale": 0.3}),          # Sq > Sk, window > S
    (1, 2, 2, 33, 50, 8, (6,), (5,), {"causal": True}),               # Sq < Sk
    (1, 2, 2, 30, 30, 4, (2,), (1000,), {}),                          # dilation > S: i only
]


@pytest.mark.parametrize("case", MS_REF_CASES, ids=lambda c: f"{c[:8]}-{sorted(c[8])}")
def test_multiscale_reference_matches_masked_sdpa(case, rng):
    B, Hq, Hkv, Sq, Sk, D, ws, ds, opt = case
    q, k, v = (rng.standard_normal((B, h, s, D)) for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    got = av.ref_multiscale_attention(q, k, v, ws, ds, enable_gqa=Hq != Hkv, **opt)
    causal = opt.get("causal", False)
    for h in range(Hq):
        mask = multiscale_mask(ws, ds, h, Hq, Sq, Sk, causal)
        g = Hq // Hkv
        exp = at.ref_scaled_dot_product_attention(q[:, h:h + 1], k[:, h // g:h // g + 1],
                                                  v[:, h // g:h // g + 1], mask,
                                                  scale=opt.get("scale"))
        np.testing.assert_allclose(got[:, h:h + 1], exp, rtol=1e-11, atol=1e-12)
    if Sq > Sk:       # rows that see no key give 0 (those with i - t d >= Sk for every t)
        dead = ~multiscale_mask(ws, ds, 0, Hq, Sq, Sk, causal).any(axis=1)
        assert np.all(got[:, 0][:, dead] == 0)


def test_multiscale_window_zero_is_the_value_row(rng):
    q, k, v = (rng.standard_normal((1, 2, 20, 8)) for _ in range(3))
    np.testing.assert_allclose(av.ref_multiscale_attention(q, k, v, [0], [3]), v, rtol=1e-15)


def test_argument_errors():
    q = np.zeros((1, 4, 5, 8), np.float32)
    kv = np.zeros((1, 2, 6, 8), np.float32)
    lin, ker, ms = go.linear_attention, go.kernelized_attention, go.multiscale_attention
    for f in (lin, ker, lambda *a, **kw: ms(*a[:3], [1], [1], **kw)):
        with pytest.raises(ValueError, match="'key' has 2 heads but 'query' has 4; pass"):
            f(q, kv, kv)
        with pytest.raises(ValueError, match="'query' must be 4-d"):
            f(q[0], kv, kv, enable_gqa=True)
        with pytest.raises(ValueError, match="'key' has head dim 4"):
            f(q, kv[..., :4], kv[..., :4], enable_gqa=True)
        with pytest.raises(ValueError, match="'value' has shape"):
            f(q, kv, kv[:, :, :5], enable_gqa=True)
        with pytest.raises(ValueError, match="'query' heads \\(4\\) must be a multiple"):
            f(q, np.zeros((1, 3, 6, 8), np.float32), np.zeros((1, 3, 6, 8), np.float32),
              enable_gqa=True)
        with pytest.raises(ValueError, match="head dim 0"):
            f(q[..., :0], kv[..., :0], kv[..., :0], enable_gqa=True)
        with pytest.raises(TypeError, match="'key' is float16 but 'query' is float32"):
            f(q, kv.astype(np.float16), kv, enable_gqa=True)
    with pytest.raises(ValueError, match="'feature_map' must be one of"):
        lin(q, kv, kv, "softplus", enable_gqa=True)
    with pytest.raises(TypeError, match="'causal' must be a bool"):
        lin(q, kv, kv, "elu", 1, enable_gqa=True)
    with pytest.raises(ValueError, match="'eps' must be finite and >= 0"):
        lin(q, kv, kv, eps=-1.0, enable_gqa=True)
    with pytest.raises(TypeError, match="'eps' must be a float"):
        lin(q, kv, kv, eps="x", enable_gqa=True)
    with pytest.raises(TypeError, match="'num_features' must be an int"):
        ker(q, kv, kv, 3.0, enable_gqa=True)
    with pytest.raises(ValueError, match="'num_features' must be >= 1"):
        ker(q, kv, kv, 0, enable_gqa=True)
    with pytest.raises(ValueError, match="'kernel' must be one of"):
        ker(q, kv, kv, 8, "laplace", enable_gqa=True)
    with pytest.raises(TypeError, match="'seed' must be an int >= 0"):
        ker(q, kv, kv, 8, "rbf", -1, enable_gqa=True)
    with pytest.raises(ValueError, match="'scale' must be finite and > 0"):
        ker(q, kv, kv, 8, scale=-1.0, enable_gqa=True)
    with pytest.raises(TypeError, match="'orthogonal' must be a bool"):
        ker(q, kv, kv, 8, orthogonal=None, enable_gqa=True)
    with pytest.raises(TypeError, match="'windows' must be a sequence of ints"):
        ms(q, kv, kv, 3, [1], enable_gqa=True)
    with pytest.raises(TypeError, match="'dilations' must be a sequence of ints"):
        ms(q, kv, kv, [3], [1.5], enable_gqa=True)
    with pytest.raises(ValueError, match="'dilations' has 1 entries but 'windows' has 2"):
        ms(q, kv, kv, [3, 4], [1], enable_gqa=True)
    with pytest.raises(ValueError, match="'windows' must have 1..16 entries"):
        ms(q, kv, kv, [], [], enable_gqa=True)
    with pytest.raises(ValueError, match="'windows' entries must be >= 0"):
        ms(q, kv, kv, [-1, 2], [1, 1], enable_gqa=True)
    with pytest.raises(ValueError, match="'dilations' entries must be >= 1"):
        ms(q, kv, kv, [1, 2], [0, 1], enable_gqa=True)
    with pytest.raises(ValueError, match="must split into len\\(windows\\) = 3 equal groups"):
        ms(q, kv, kv, [1, 2, 3], [1, 1, 1], enable_gqa=True)
    with pytest.raises(ValueError, match="'value' has head dim 4 but 'query' has 8"):
        ms(q, kv, kv[..., :4], [1], [1], enable_gqa=True)
    with pytest.raises(ValueError, match="at most 256"):
        big = np.zeros((1, 1, 2, 300), np.float32)
        ms(big, big, big, [1], [1])
    with pytest.raises(TypeError, match="'causal' must be a bool"):
        ms(q, kv, kv, [1], [1], causal="yes", enable_gqa=True)


@needs_torch
def test_cpu_fallback_numpy_and_torch(rng):
    q = _rand(rng, (1, 2, 9, 16), "float32")
    k, v = _rand(rng, (1, 2, 11, 16), "float32"), _rand(rng, (1, 2, 11, 16), "float32")
    out = go.linear_attention(q, k, v, causal=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (1, 2, 9, 16)
    np.testing.assert_allclose(out, av.ref_linear_attention(_f64(q), k, v, causal=True),
                               rtol=1e-6, atol=1e-7)
    tq, tk, tv = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v))
    for f, extra in ((go.linear_attention, ()), (go.kernelized_attention, (32,)),
                     (go.multiscale_attention, ([2, 3], [1, 2]))):
        o = f(tq, tk, tv, *extra)
        assert o.dtype == torch.bfloat16 and o.shape == (1, 2, 9, 16)
    q64 = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    o64 = go.multiscale_attention(q64, q64, q64, [10], [1])
    exp = torch.nn.functional.scaled_dot_product_attention(q64, q64, q64)
    torch.testing.assert_close(o64, exp, rtol=1e-12, atol=1e-13)


def _struct_format(name: str) -> str:
    """The ArgSpec code of a struct in variants_common.cuh, field by field."""
    import re  # noqa: PLC0415
    from gpuops.runtime.sources import cuda_src_root  # noqa: PLC0415
    text = (cuda_src_root() / "attention/variants_common.cuh").read_text()
    body = re.search(r"struct " + name + r" \{(.*?)\n\};", text, re.S).group(1)
    merged = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if not line:
            continue
        m = re.match(r"(const void\*|void\*|const float\*|float\*|long long|int|float)\s+(.*);",
                     line)
        code = {"const void*": "P", "void*": "P", "const float*": "P", "float*": "P",
                "long long": "q", "int": "i", "float": "f"}[m.group(1)]
        for field in m.group(2).split(","):
            n = re.search(r"\[(\w+)\]", field)
            count = 1 if not n else (av.MS_MAX_SCALES if n.group(1) == "kMsMaxScales"
                                     else int(n.group(1)))
            if merged and merged[-1][0] == code:
                merged[-1] = (code, merged[-1][1] + count)
            else:
                merged.append((code, count))
    return "".join(f"{n}{c}" for c, n in merged)


def test_arg_structs_match_the_argspecs():
    assert _struct_format("LinAttnArgs") == "5P16q9i1f" and av.LIN_ARGS.params == ("5P16q9if",)
    assert _struct_format("FavorArgs") == "4P4q6i2f" and av.FAVOR_ARGS.params == ("4P4q6i2f",)
    assert _struct_format("MultiscaleArgs") == "4P16q40i1f"
    assert av.MS_ARGS.params == ("4P16q40if",)
    assert (av.LIN_ARGS.size, av.FAVOR_ARGS.size, av.MS_ARGS.size) == (208, 96, 328)


def test_multiscale_configs_cover_head_dims_within_48k():
    for d, want in ((1, 4), (32, 4), (33, 8), (64, 8), (65, 16), (128, 16), (129, 32), (256, 32)):
        dpl, bc = av.ms_config(d)
        assert dpl == want and 8 * dpl >= d
        assert 2 * bc * (8 * dpl + 4) * 4 <= 48 * 1024
        assert av.ms_expr(dt.float32, dpl, bc) in av.MS_MODULE.kernels


# ----------------------------------------------------------------------------- CPU: the kernels

def _emu_call(dev, op, dtype):
    from emu import Call as EmuCall  # noqa: PLC0415
    return EmuCall(dev, op, dt.BY_NAME[dtype])


def emu_linear(dev, q, k, v, feature_map, causal, eps, dtype, enable_gqa=False):
    t = [dev.tensor(x) for x in (q, k, v)]
    return av._linear_forward(_emu_call(dev, "linear_attention", dtype), *t, feature_map,
                              causal, eps, enable_gqa).obj


def emu_kernelized(dev, q, k, v, m, kernel, seed, causal, dtype, scale=None, orthogonal=True,
                   eps=0.0, enable_gqa=False, monkeypatch=None):
    # device memory is NumPy here: the features are the host array itself
    monkeypatch.setattr(av, "device_features",
                        lambda call, w, key: dev.tensor(np.ascontiguousarray(w, np.float32)))
    t = [dev.tensor(x) for x in (q, k, v)]
    return av._kernelized_forward(_emu_call(dev, "kernelized_attention", dtype), *t, m, kernel,
                                  seed, causal, scale, orthogonal, eps, enable_gqa).obj


def emu_multiscale(dev, q, k, v, ws, ds, dtype, scale=None, causal=False, enable_gqa=False):
    t = [dev.tensor(x) for x in (q, k, v)]
    return av._multiscale_forward(_emu_call(dev, "multiscale_attention", dtype), *t, ws, ds,
                                  scale, causal, enable_gqa).obj


EMU_LIN_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, Dv, feature_map, causal)
    (1, 2, 2, 70, 70, 32, 32, "elu", True),
    (1, 2, 2, 70, 70, 32, 32, "elu", False),
    (1, 4, 2, 100, 130, 40, 24, "relu", True),        # GQA, D and Dv not multiples of 32
    (2, 2, 1, 130, 100, 64, 70, "elu", False),        # Dv > 64: two column blocks
    (1, 2, 2, 600, 600, 16, 8, "elu", True),          # 10 chunks: the scan's unrolled loop
    (1, 1, 1, 300, 300, 130, 16, "elu", False),       # D > 64: three state row blocks; split
    (1, 2, 2, 45, 45, 24, 20, "identity", True),
    (1, 2, 2, 1, 9, 8, 8, "elu", True),               # one query row
    (1, 2, 2, 17, 0, 8, 8, "elu", False),             # no keys: 0
]


@needs_emu
@pytest.mark.parametrize("case", EMU_LIN_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_linear(case, dtype, rng):
    B, Hq, Hkv, Sq, Sk, D, Dv, fm, causal = case
    q, k = _rand(rng, (B, Hq, Sq, D), dtype), _rand(rng, (B, Hkv, Sk, D), dtype)
    v = _rand(rng, (B, Hkv, Sk, Dv), dtype)
    eps = 1.0 if fm == "identity" else 1e-6
    if fm == "identity":     # keep the signed denominator away from 0
        q, k = np.abs(q), np.abs(k)
    with emu.Device(sms=2) as dev:
        out = emu_linear(dev, q, k, v, fm, causal, eps, dtype, Hq != Hkv)
        names = [n for n, *_ in emu.Device.launches]
    exp, bound = linear_expect(q, k, v, fm, causal, eps, dtype, Hq != Hkv)
    check(out, exp, bound, f"{case} {dtype}")
    assert out.dtype == _np_dtype(dtype)
    assert ("gpuops::linattn_scan" in names) or not causal, names


@needs_emu
@pytest.mark.parametrize("causal", [False, True])
def test_emulated_linear_split_state_and_scan(causal, rng):
    """Many SMs and one head: the non-causal state is split into 11 records summed by the scan
    (its unrolled loop and its tail); causal: 11 chunks, exclusive prefix."""
    q, k, v = (_rand(rng, (1, 1, 700, 16), "float32") for _ in range(3))
    with emu.Device(sms=16) as dev:
        out = emu_linear(dev, q, k, v, "elu", causal, 1e-6, "float32")
        launches = list(emu.Device.launches)
    exp, bound = linear_expect(q, k, v, "elu", causal, 1e-6, "float32")
    check(out, exp, bound, f"split causal={causal}")
    state = [grid for name, grid, *_ in launches if "linattn_state" in name]
    assert state == [(11, 1, 1)] and any(n == "gpuops::linattn_scan" for n, *_ in launches)


@needs_emu
def test_emulated_linear_strided_inputs(rng):
    base = _rand(rng, (1, 2, 90, 64), "float32")
    q = base[:, :, :, ::2]                                            # d stride 2
    k = emu.strided(_rand(rng, (1, 2, 90, 32), "float32"), "transposed")
    v = emu.strided(_rand(rng, (1, 2, 90, 20), "float32"), "offset")
    with emu.Device(sms=2) as dev:
        for causal in (False, True):
            out = emu_linear(dev, q, k, v, "elu", causal, 1e-6, "float32")
            exp, bound = linear_expect(q, k, v, "elu", causal, 1e-6, "float32")
            check(out, exp, bound, f"strided causal={causal}")


EMU_KER_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, Dv, m, kernel, causal)
    (1, 2, 2, 70, 70, 16, 16, 100, "softmax", False),
    (1, 2, 2, 70, 70, 16, 16, 100, "softmax", True),
    (1, 4, 2, 90, 130, 40, 24, 64, "softmax", True),      # GQA, Sq < Sk
    (1, 2, 1, 130, 90, 32, 70, 64, "softmax", False),      # Dv > 64
    (1, 2, 2, 70, 70, 16, 16, 50, "rbf", False),           # 100 features: two feature blocks
    (1, 2, 2, 70, 70, 16, 16, 50, "rbf", True),
]


@needs_emu
@pytest.mark.parametrize("case", EMU_KER_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_kernelized(case, dtype, rng, monkeypatch):
    B, Hq, Hkv, Sq, Sk, D, Dv, m, kernel, causal = case
    q, k = _rand(rng, (B, Hq, Sq, D), dtype, 0.5), _rand(rng, (B, Hkv, Sk, D), dtype, 0.5)
    v = _rand(rng, (B, Hkv, Sk, Dv), dtype)
    with emu.Device(sms=2) as dev:
        out = emu_kernelized(dev, q, k, v, m, kernel, 11, causal, dtype, enable_gqa=Hq != Hkv,
                             monkeypatch=monkeypatch)
    exp, bound = kernelized_expect(q, k, v, m, kernel, 11, causal, dtype, enable_gqa=Hq != Hkv)
    assert np.isfinite(bound).mean() > 0.99        # the check is not vacuous
    check(out, exp, bound, f"{case} {dtype}")


@needs_emu
def test_emulated_kernelized_large_logits_stay_finite(rng, monkeypatch):
    """Inputs with |x'|^2 ~ 60: raw exp(u - |x'|^2 / 2) spans e^+-60 and more; the stabilized
    features keep every value finite (the ratio is what is checked)."""
    q, k = _rand(rng, (1, 1, 64, 16), "float32", 4.0), _rand(rng, (1, 1, 64, 16), "float32", 4.0)
    v = _rand(rng, (1, 1, 64, 8), "float32")
    with emu.Device(sms=2) as dev:
        out = emu_kernelized(dev, q, k, v, 64, "softmax", 0, False, "float32",
                             monkeypatch=monkeypatch)
    exp, bound = kernelized_expect(q, k, v, 64, "softmax", 0, False, "float32")
    assert np.all(np.isfinite(out))
    check(out, exp, bound, "large logits")


EMU_MS_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, windows, dilations, options)
    (1, 4, 2, 70, 70, 16, (3, 5), (1, 4), {}),
    (1, 3, 3, 130, 100, 64, (0, 2, 7), (1, 3, 2), {"causal": True}),
    (1, 2, 2, 90, 90, 128, (4, 40), (2, 1), {}),
    (1, 2, 2, 50, 50, 256, (5,), (3,), {"causal": True, "scale": 0.05}),
    (1, 2, 1, 80, 50, 40, (6,), (4,), {}),                    # Sq > Sk: rows without keys
    (2, 4, 4, 100, 100, 32, (1, 2, 3, 200), (33, 1, 64, 1), {"causal": True}),
]


@needs_emu
@pytest.mark.parametrize("case", EMU_MS_CASES, ids=lambda c: f"{c[:8]}-{sorted(c[8])}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_multiscale(case, dtype, rng):
    B, Hq, Hkv, Sq, Sk, D, ws, ds, opt = case
    q, k = _rand(rng, (B, Hq, Sq, D), dtype), _rand(rng, (B, Hkv, Sk, D), dtype)
    v = _rand(rng, (B, Hkv, Sk, D), dtype)
    with emu.Device(sms=2) as dev:
        out = emu_multiscale(dev, q, k, v, ws, ds, dtype, enable_gqa=Hq != Hkv, **opt)
    exp, bound = multiscale_expect(q, k, v, ws, ds, dtype, enable_gqa=Hq != Hkv, **opt)
    check(out, exp, bound, f"{case} {dtype}")


@needs_emu
def test_emulated_multiscale_strided_inputs(rng):
    q = _rand(rng, (1, 2, 60, 64), "float16")[:, :, :, ::2]
    k = emu.strided(_rand(rng, (1, 2, 60, 32), "float16"), "transposed")
    v = emu.strided(_rand(rng, (1, 2, 60, 32), "float16"), "offset")
    with emu.Device(sms=2) as dev:
        out = emu_multiscale(dev, q, k, v, [3, 2], [2, 5], "float16", causal=True)
    exp, bound = multiscale_expect(q, k, v, [3, 2], [2, 5], "float16", causal=True)
    check(out, exp, bound, "strided")


# ----------------------------------------------------------------------------- GPU

def _cuda(x, dtype):
    return torch.from_numpy(np.asarray(x, np.float32)).to("cuda", getattr(torch, dtype))


def _host(x):
    return x.double().cpu().numpy()


GPU_LIN_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, Dv, feature_map, causal)
    (2, 4, 4, 1, 1, 64, 64, "elu", True),
    (1, 8, 2, 1000, 1000, 64, 64, "elu", True),
    (1, 8, 2, 1000, 1000, 64, 64, "elu", False),
    (2, 4, 4, 4097, 4097, 128, 128, "elu", True),
    (1, 4, 4, 4097, 3000, 128, 64, "relu", False),
    (1, 2, 2, 777, 1500, 96, 200, "elu", True),
    (1, 2, 2, 300, 300, 17, 5, "relu", True),
]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_LIN_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_linear(case, dtype, rng):
    B, Hq, Hkv, Sq, Sk, D, Dv, fm, causal = case
    q, k = _rand(rng, (B, Hq, Sq, D), dtype), _rand(rng, (B, Hkv, Sk, D), dtype)
    v = _rand(rng, (B, Hkv, Sk, Dv), dtype)
    out = go.linear_attention(_cuda(q, dtype), _cuda(k, dtype), _cuda(v, dtype), fm, causal,
                              enable_gqa=Hq != Hkv)
    assert out.dtype == getattr(torch, dtype) and out.shape == (B, Hq, Sq, Dv)
    exp, bound = linear_expect(q, k, v, fm, causal, 1e-6, dtype, Hq != Hkv)
    check(_host(out), exp, bound, f"{case} {dtype}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_linear_against_torch_chunked_peer(causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 16, 4096, 64, device="cuda", generator=g).to(torch.bfloat16)
               for _ in range(3))
    ours = go.linear_attention(q, k, v, causal=causal)
    peer = av.torch_linear_attention(q, k, v, causal=causal)
    exact = av.torch_linear_attention(q.double(), k.double(), v.double(), causal=causal)
    e_ours = (ours.double() - exact).norm() / exact.norm()
    e_peer = (peer.double() - exact).norm() / exact.norm()
    assert e_ours <= e_peer * 1.5 + 1e-3, (float(e_ours), float(e_peer))


@gpu
@needs_torch_cuda
def test_gpu_linear_long_sequence_memory_stays_linear():
    """S = 65,536 causal: workspace ~ ceil(S / 64) states of D (Dv + 1) floats per head, no S^2
    buffer; rows spot-checked against the float64 reference."""
    S, D = 65536, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 2, S, D, device="cuda", generator=g).to(torch.bfloat16)
               for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = go.linear_attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    state = 2 * (S // 64) * D * (D + 1) * 4
    assert torch.cuda.max_memory_allocated() - base <= state + 2 * q.numel() * 2 + (1 << 20)
    rows = np.array([0, 1, 4097, 33333, S - 1])
    exp = av.ref_linear_attention(_host(q), _host(k), _host(v), causal=True)[:, :, rows]
    err = np.abs(_host(out)[:, :, rows] - exp)
    assert np.all(err <= 2 * 2.0**-8 * np.abs(exp) + 1e-3), err.max()


GPU_KER_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, Dv, m, kernel, causal)
    (1, 4, 4, 1000, 1000, 64, 64, 256, "softmax", False),
    (1, 4, 2, 1000, 1000, 64, 64, 256, "softmax", True),
    (1, 2, 2, 4097, 4097, 128, 128, 300, "softmax", True),
    (1, 2, 2, 1000, 700, 32, 48, 128, "rbf", False),
    (1, 2, 2, 1000, 1000, 32, 32, 128, "rbf", True),
]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_KER_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_kernelized(case, dtype, rng):
    B, Hq, Hkv, Sq, Sk, D, Dv, m, kernel, causal = case
    q, k = _rand(rng, (B, Hq, Sq, D), dtype, 0.5), _rand(rng, (B, Hkv, Sk, D), dtype, 0.5)
    v = _rand(rng, (B, Hkv, Sk, Dv), dtype)
    out = go.kernelized_attention(_cuda(q, dtype), _cuda(k, dtype), _cuda(v, dtype), m, kernel, 3,
                                  causal=causal, enable_gqa=Hq != Hkv)
    exp, bound = kernelized_expect(q, k, v, m, kernel, 3, causal, dtype, enable_gqa=Hq != Hkv)
    assert np.isfinite(bound).mean() > 0.99
    check(_host(out), exp, bound, f"{case} {dtype}")


GPU_MS_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, windows, dilations, options)
    (1, 16, 16, 4096, 4096, 64, (32, 32, 32, 32), (1, 2, 4, 8), {}),
    (1, 16, 16, 4096, 4096, 64, (32, 32, 32, 32), (1, 2, 4, 8), {"causal": True}),
    (2, 8, 2, 1000, 1000, 128, (7, 100), (3, 1), {}),
    (1, 4, 4, 1500, 1000, 256, (2, 9), (1, 50), {"causal": True}),
    (1, 2, 2, 777, 777, 17, (500,), (1,), {"scale": 0.3}),
]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_MS_CASES, ids=lambda c: f"{c[:8]}-{sorted(c[8])}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_multiscale(case, dtype, rng):
    B, Hq, Hkv, Sq, Sk, D, ws, ds, opt = case
    q, k = _rand(rng, (B, Hq, Sq, D), dtype), _rand(rng, (B, Hkv, Sk, D), dtype)
    v = _rand(rng, (B, Hkv, Sk, D), dtype)
    out = go.multiscale_attention(_cuda(q, dtype), _cuda(k, dtype), _cuda(v, dtype), ws, ds,
                                  enable_gqa=Hq != Hkv, **opt)
    exp, bound = multiscale_expect(q, k, v, ws, ds, dtype, enable_gqa=Hq != Hkv, **opt)
    check(_host(out), exp, bound, f"{case} {dtype}")


@gpu
@needs_torch_cuda
def test_gpu_multiscale_against_masked_sdpa():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2048, 64, device="cuda", generator=g).to(torch.bfloat16)
               for _ in range(3))
    ws, ds = (16, 16, 64, 8), (1, 4, 2, 16)
    mask = torch.from_numpy(np.stack([multiscale_mask(ws, ds, h, 8, 2048, 2048, True)
                                      for h in range(8)])).cuda()[None]
    ours = go.multiscale_attention(q, k, v, ws, ds, causal=True)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                             attn_mask=mask)
    e_ours = (ours.double() - exact).norm() / exact.norm()
    e_torch = (theirs.double() - exact).norm() / exact.norm()
    assert e_ours <= e_torch * 1.5 + 1e-3, (float(e_ours), float(e_torch))


@gpu
@needs_torch_cuda
def test_gpu_cuda_graphs(rng):
    q, k, v = (_cuda(_rand(rng, (1, 4, 300, 64), "bfloat16"), "bfloat16") for _ in range(3))
    calls = {
        "linear": lambda: go.linear_attention(q, k, v, causal=True),
        "linear_split": lambda: go.linear_attention(q, k, v),
        "kernelized": lambda: go.kernelized_attention(q, k, v, 64, causal=True),
        "multiscale": lambda: go.multiscale_attention(q, k, v, [4, 8], [1, 3]),
    }
    for name, fn in calls.items():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()                                   # warm: modules, random features
        torch.cuda.current_stream().wait_stream(s)
        before = fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        q.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fn()) and not torch.equal(out, before), name


@gpu
@needs_torch_cuda
def test_gpu_empty_inputs():
    q = torch.randn(1, 2, 0, 64, device="cuda", dtype=torch.float16)
    kv = torch.randn(1, 2, 5, 64, device="cuda", dtype=torch.float16)
    assert go.linear_attention(q, kv, kv).shape == (1, 2, 0, 64)
    assert go.kernelized_attention(q, kv, kv, 16).shape == (1, 2, 0, 64)
    assert go.multiscale_attention(q, kv, kv, [1], [1]).shape == (1, 2, 0, 64)
    q = torch.randn(1, 2, 3, 64, device="cuda", dtype=torch.float16)
    assert torch.all(go.linear_attention(q, kv[:, :, :0], kv[:, :, :0]) == 0)
    assert torch.all(go.multiscale_attention(q, kv[:, :, :0], kv[:, :, :0], [1], [1]) == 0)
