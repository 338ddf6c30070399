"""scaled_dot_product_attention (flash forward) against float64 references.

CPU: the NumPy reference against torch's math SDPA in float64 for every option (masks bool and
additive with broadcasting, causal with Sq == Sk and Sq != Sk, windows, GQA 1/2/8, scale,
'bshd', lse, rows that see no key, NaN), sequence lengths 1, 17, 128, 1000; argument errors; the
CPU fallback for NumPy and CPU torch inputs; the kernel (every instantiation: head dims
32/64/96/128 at both tile sizes and the general path at 17 and 40) run by the CPU emulator of
tests/emu.py on small shapes. GPU (``gpu`` marker): every dtype and head dim, lengths up to 4097,
the same options, strided and 'bshd' inputs, poisoned outputs, torch's SDPA, a CUDA graph.

Tolerance (derived, not tuned): with u = 2^-24 (fp32 math) and the reference computed from the
same rounded inputs, a score s = q.k * scale (+ mask) carries an error below
e_s = scale * (2 sqrt(D) + 4) u max_j |q||k_j| + 4 u max|s|; each probability is then off by a
relative 2 e_s + 2^-21 (MUFU ex2), and the sums over Sk keys (l and P V) by 3 sqrt(Sk + 1) u
relative to P|V|. So |out - ref| <= (2 e_s + 2^-21 + 3 sqrt(Sk + 1) u) (P|V|) + 2 u_out |ref|
+ tiny, with P|V| the reference run on |v|, and u_out the output dtype's unit roundoff.

The tensor-core kernel ('mma', fp16/bf16) adds, worst case (the tensor cores' fp32 accumulation
aligns addends to the largest one and may truncate: up to 2u per addend of the magnitudes summed
in one mma of 16 products + the accumulator, i.e. 34 u per mma step): scores
e_s = scale (D / 16 + 1) 34 u max_j |q||k_j| + 4 u max|s| (the mma steps of Q K^T); P rounded to
the input dtype before P V: + u_in (P|V|) (l sums the unrounded p, so this is all it costs),
plus for fp16 the subnormal range of P: + 2^-25 Sk max|v| absolute; P V accumulated over
ceil(Sk / 16) mma steps: + 36 u ceil(Sk / 16) (P|V|).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import gpuops as go
from gpuops import dtypes as dt
from gpuops.ops import attention as at
from conftest import HAS_TORCH, HAS_TORCH_CUDA

torch = pytest.importorskip("torch") if HAS_TORCH else None
import emu  # noqa: E402

gpu = pytest.mark.gpu
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
needs_torch_cuda = pytest.mark.skipif(not HAS_TORCH_CUDA, reason="torch without CUDA")
needs_emu = pytest.mark.skipif(not emu.available(), reason="no g++ for the kernel emulator")

DTYPES = ["float32", "float16", "bfloat16"]
U_OUT = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8, "float64": 2.0**-53}
TINY = {"float32": 1e-30, "float16": 2.0**-24, "bfloat16": 1e-30, "float64": 1e-300}
U32 = 2.0**-24
ref = at.ref_scaled_dot_product_attention


def _np_dtype(name):
    return dt.to_numpy(dt.BY_NAME[name])


def _rand(rng, shape, dtype, scale=1.0):
    """Random values rounded to the storage dtype, as that dtype's NumPy array."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(_np_dtype(dtype))


def _bhsd(x, layout):
    x = np.asarray(x, np.float64)
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def attn_bound(q, k, v, mask=None, *, dtype, layout="bhsd", enable_gqa=False, mma=False, **kw):
    """(reference out, reference lse, elementwise bound on |out - ref|, bound on |lse - ref|).
    mma: the bound of the tensor-core kernel (module docstring); it also covers the SIMT one."""
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    m64 = None if mask is None else (np.asarray(mask) if np.asarray(mask).dtype == bool
                                     else np.asarray(mask, np.float64))
    args = dict(enable_gqa=enable_gqa, layout=layout, **kw)
    out, lse = ref(q64, k64, v64, m64, return_lse=True, **args)
    pv = ref(q64, k64, np.abs(v64), m64, **args)
    qb, kb = _bhsd(q64, layout), _bhsd(k64, layout)
    B, Hq, Sq, D = qb.shape
    Sk = kb.shape[2]
    group = Hq // kb.shape[1]
    scale = kw.get("scale") or 1.0 / math.sqrt(D)
    g = 0.0
    for h in range(Hq):
        a = np.abs(qb[:, h]) @ np.abs(kb[:, h // group]).transpose(0, 2, 1)
        g = max(g, float(np.nanmax(a, initial=0.0)))      # NaN rows are checked as NaN
    smax = abs(scale) * g
    if m64 is not None and m64.dtype != bool:
        smax += float(np.abs(m64[np.isfinite(m64)]).max(initial=0.0))
    e_s = abs(scale) * (2 * math.sqrt(D) + 4) * U32 * g + 4 * U32 * smax
    rel = 2 * e_s + 2.0**-21 + 3 * math.sqrt(Sk + 1) * U32
    tiny = TINY[dtype]
    if mma:
        e_s = max(e_s, abs(scale) * (D / 16 + 1) * 34 * U32 * g + 4 * U32 * smax)
        rel = (2 * e_s + 2.0**-21 + 3 * math.sqrt(Sk + 1) * U32 + U_OUT[dtype]
               + 36 * U32 * math.ceil(Sk / 16))
        if dtype == "float16":
            tiny += 2.0**-25 * Sk * float(np.nanmax(np.abs(v64), initial=0.0))
    with np.errstate(invalid="ignore"):
        bound = rel * pv + 2 * U_OUT[dtype] * np.abs(out) + tiny
        lse_bound = e_s + 2.0**-21 + 3 * math.sqrt(Sk + 1) * U32 + 2 * U32 * np.abs(lse)
    return out, lse, bound, lse_bound


def check(got, exp, bound, what=""):
    got = np.asarray(got, np.float64)
    assert got.shape == exp.shape, f"{what}: shape {got.shape} != {exp.shape}"
    nan_g, nan_e = np.isnan(got), np.isnan(exp)
    assert np.array_equal(nan_g, nan_e), (
        f"{what}: NaN mismatch at {np.argwhere(nan_g != nan_e)[:5].tolist()}")
    inf_e = np.isinf(exp)
    assert np.array_equal(got[inf_e], exp[inf_e]), f"{what}: infinities differ"
    ok = ~nan_e & ~inf_e
    b = np.broadcast_to(bound, exp.shape)[ok]
    err = np.abs(got[ok] - exp[ok])
    if err.size and not np.all(err <= b):
        i = int(np.argmax(err - b))
        raise AssertionError(f"{what}: {int(np.sum(err > b))} of {err.size} off; worst got="
                             f"{got[ok][i]!r} ref={exp[ok][i]!r} err={err[i]:.3g} > {b[i]:.3g}")


# ----------------------------------------------------------------------------- CPU: reference

def _torch_sdpa(q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False,
                window=None, layout="bhsd"):
    """torch's math SDPA in float64 (window_size as an explicit bool mask); out and lse."""
    t = [torch.from_numpy(_bhsd(x, layout).copy()) for x in (q, k, v)]
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
    # lse from the same scores, by hand (torch's math SDPA does not return it)
    kk = t[1].repeat_interleave(t[0].shape[1] // t[1].shape[1], dim=1)
    sc = scale if scale is not None else 1 / math.sqrt(t[0].shape[-1])
    s = t[0] @ kk.transpose(-1, -2) * sc
    if is_causal:
        s = s.masked_fill(~torch.ones(Sq, Sk, dtype=torch.bool).tril(), -math.inf)
    if tm is not None:
        s = s.masked_fill(~tm, -math.inf) if tm.dtype == torch.bool else s + tm
    lse = torch.logsumexp(s, dim=-1)
    out = out.numpy()
    return (out if layout == "bhsd" else out.transpose(0, 2, 1, 3)), lse.numpy()


REF_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, options)
    (2, 2, 2, 1, 1, 8, {}),
    (1, 2, 2, 17, 17, 16, {"is_causal": True}),
    (1, 4, 2, 17, 33, 16, {"is_causal": True}),           # Sq < Sk: top-left causal, as torch
    (1, 4, 2, 33, 17, 16, {"is_causal": True}),           # Sq > Sk: rows past Sk see all keys
    (2, 8, 1, 128, 128, 32, {"scale": 0.3}),                # GQA 8
    (1, 4, 2, 128, 128, 16, {"window": (8, 3)}),
    (1, 2, 2, 128, 96, 16, {"window": (4, -1), "is_causal": True}),
    (1, 2, 1, 128, 128, 16, {"window": (-1, 5), "mask": "bool"}),
    (1, 2, 2, 17, 40, 24, {"mask": "bool"}),
    (2, 2, 2, 17, 40, 24, {"mask": "float", "is_causal": True}),
    (1, 2, 2, 1000, 1000, 16, {"is_causal": True}),
    (1, 2, 1, 1000, 1000, 16, {"mask": "bool", "window": (100, 100)}),
]


@needs_torch
@pytest.mark.parametrize("case", REF_CASES, ids=lambda c: f"{c[:6]}-{sorted(c[6])}")
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_reference_matches_torch_math(case, layout, rng):
    B, Hq, Hkv, Sq, Sk, D, opt = case
    opt = dict(opt)
    q, k, v = (rng.standard_normal(s) for s in ((B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D)))
    if layout == "bshd":
        q, k, v = (x.transpose(0, 2, 1, 3).copy() for x in (q, k, v))
    mask = None
    kind = opt.pop("mask", None)
    if kind == "bool":
        mask = rng.random((Sq, Sk)) > 0.3
        mask[min(3, Sq - 1)] = False                      # a row that sees no key
    elif kind == "float":
        mask = rng.standard_normal((B, 1, Sq, Sk)) * 2
        mask[..., 0, :] = -np.inf                          # fully masked by -inf
    window = opt.pop("window", None)
    got, lse = ref(q, k, v, mask, enable_gqa=Hq != Hkv, window_size=window, return_lse=True,
                   layout=layout, **opt)
    exp, exp_lse = _torch_sdpa(q, k, v, mask, enable_gqa=Hq != Hkv, window=window,
                               layout=layout, **opt)
    np.testing.assert_allclose(got, exp, rtol=1e-11, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(exp_lse))
    ok = np.isfinite(exp_lse)
    np.testing.assert_allclose(lse[ok], exp_lse[ok], rtol=1e-12, atol=1e-12)


@needs_torch
def test_reference_fully_masked_rows_and_nan_as_torch(rng):
    q, k, v = (rng.standard_normal((1, 2, 6, 8)) for _ in range(3))
    q[0, 1, 2, 3] = np.nan                                 # NaN query: NaN row
    mask = np.ones((6, 6), bool)
    mask[4] = False                                        # no key: 0 (torch >= 2.5), lse -inf
    got, lse = ref(q, k, v, mask, return_lse=True)
    exp = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)), attn_mask=torch.from_numpy(mask)).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(exp))
    np.testing.assert_allclose(got[~np.isnan(exp)], exp[~np.isnan(exp)], rtol=1e-12, atol=1e-14)
    assert np.all(got[:, :, 4] == 0) and np.all(np.isneginf(lse[:, :, 4]))
    assert np.all(np.isnan(got[0, 1, 2])) and np.isnan(lse[0, 1, 2])
    # every row outside its window: zeros, -inf
    out, lse = ref(q[:, :, :2], k, v, window_size=(0, 0), return_lse=True, layout="bhsd")
    assert np.all(np.isfinite(lse[0, 0]))
    out, lse = ref(q[:, :1, :2], k[:, :1, :0], v[:, :1, :0], return_lse=True)   # Sk = 0
    assert out.shape == (1, 1, 2, 8) and np.all(out == 0) and np.all(np.isneginf(lse))


def test_argument_errors():
    q = np.zeros((1, 4, 5, 8), np.float32)
    kv = np.zeros((1, 2, 6, 8), np.float32)
    f = go.scaled_dot_product_attention
    with pytest.raises(ValueError, match="'key' has 2 heads but 'query' has 4; pass enable_gqa"):
        f(q, kv, kv)
    with pytest.raises(ValueError, match="'query' heads \\(4\\) must be a multiple"):
        f(q, np.zeros((1, 3, 6, 8), np.float32), np.zeros((1, 3, 6, 8), np.float32),
          enable_gqa=True)
    with pytest.raises(ValueError, match="'query' must be 4-d"):
        f(q[0], kv, kv, enable_gqa=True)
    with pytest.raises(ValueError, match="'value' has shape"):
        f(q, kv, kv[..., :4], enable_gqa=True)
    with pytest.raises(ValueError, match="'key' has head dim 4"):
        f(q, kv[..., :4], kv[..., :4], enable_gqa=True)
    with pytest.raises(ValueError, match="'key' has batch 2"):
        f(q, np.zeros((2, 2, 6, 8), np.float32), np.zeros((2, 2, 6, 8), np.float32),
          enable_gqa=True)
    with pytest.raises(ValueError, match="'attn_mask' has shape \\(5, 5\\)"):
        f(q, kv, kv, np.ones((5, 5), bool), enable_gqa=True)
    with pytest.raises(ValueError, match="'layout' must be one of"):
        f(q, kv, kv, enable_gqa=True, layout="sbhd")
    with pytest.raises(ValueError, match="'variant' must be one of"):
        f(q, kv, kv, enable_gqa=True, variant="wgmma")
    with pytest.raises(TypeError, match="'window_size' must be None or a pair"):
        f(q, kv, kv, enable_gqa=True, window_size=3)
    with pytest.raises(ValueError, match="'window_size' entries must be >= 0"):
        f(q, kv, kv, enable_gqa=True, window_size=(-2, 0))
    with pytest.raises(TypeError, match="'is_causal' must be a bool"):
        f(q, kv, kv, None, 1, enable_gqa=True)
    with pytest.raises(TypeError, match="'scale' must be a float"):
        f(q, kv, kv, enable_gqa=True, scale="x")
    with pytest.raises(ValueError, match="head dim 0"):
        f(q[..., :0], kv[..., :0], kv[..., :0], enable_gqa=True)
    with pytest.raises(TypeError, match="'attn_mask' has dtype int32"):
        f(q, kv, kv, np.ones((5, 6), np.int32), enable_gqa=True)
    with pytest.raises(TypeError, match="'key' is float16 but 'query' is float32"):
        f(q, kv.astype(np.float16), kv, enable_gqa=True)


@needs_torch
def test_cpu_fallback_numpy_and_torch(rng):
    q = _rand(rng, (1, 2, 9, 16), "float32")
    k = _rand(rng, (1, 2, 11, 16), "float32")
    v = _rand(rng, (1, 2, 11, 16), "float32")
    out = go.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_allclose(out, ref(q.astype(np.float64), k, v, is_causal=True), rtol=1e-6,
                               atol=1e-7)
    tq, tk, tv = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v))
    res = go.scaled_dot_product_attention(tq, tk, tv, return_lse=True, layout="bhsd")
    assert isinstance(res, tuple) and res[0].dtype == torch.bfloat16 and res[1].shape == (1, 2, 9)
    mask = torch.rand(9, 11) > 0.5
    o = go.scaled_dot_product_attention(tq, tk, tv, mask)
    exp = ref(tq.double().numpy(), tk.double().numpy(), tv.double().numpy(), mask.numpy())
    np.testing.assert_allclose(o.double().numpy(), exp, rtol=8e-3, atol=1e-5)
    q64 = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    o64 = go.scaled_dot_product_attention(q64, q64, q64, scale=0.5)
    exp = torch.nn.functional.scaled_dot_product_attention(q64, q64, q64, scale=0.5)
    torch.testing.assert_close(o64, exp, rtol=1e-12, atol=1e-13)


def test_tile_configs_fit_shared_memory():
    for d in (32, 64, 96, 128):
        D, br, bc, general = at.simt_config(d, 48 * 1024)
        assert (D, general) == (d, False) and at.flash_smem(D, br, bc) <= 48 * 1024
        D2, br2, bc2, _ = at.simt_config(d, 227 * 1024)
        assert (br2, bc2) == (64, 64)
    for d in (1, 17, 40, 256, 1024):
        assert at.simt_config(d, 227 * 1024) == (32, 64, 64, True)


def test_flash_args_struct_matches_the_argspec():
    """FLASH_ARGS mirrors FlashFwdArgs field by field (cuda_src/attention/attn_common.cuh)."""
    import re
    from gpuops.runtime.sources import cuda_src_root
    text = (cuda_src_root() / "attention/attn_common.cuh").read_text()
    body = re.search(r"struct FlashFwdArgs \{(.*?)\n\};", text, re.S).group(1)
    fmt = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if not line:
            continue
        m = re.match(r"(const void\*|void\*|float\*|long long|int|float)\s+(.*);", line)
        code = {"const void*": "P", "void*": "P", "float*": "P", "long long": "q", "int": "i",
                "float": "f"}[m.group(1)]
        for name in m.group(2).split(","):
            n = re.search(r"\[(\d+)\]", name)
            fmt.append((code, int(n.group(1)) if n else 1))
    merged = []
    for code, n in fmt:
        if merged and merged[-1][0] == code:
            merged[-1] = (code, merged[-1][1] + n)
        else:
            merged.append((code, n))
    assert "".join(f"{n}{c}" for c, n in merged) == "6P20q9i1f"
    assert at.FLASH_ARGS.params == ("6P20q9if",) and at.FLASH_ARGS.size == 248


# ----------------------------------------------------------------------------- CPU: the kernel

def _emu_run(dev, q, k, v, mask=None, *, dtype, **kw):
    from emu import Call as EmuCall  # noqa: PLC0415
    call = EmuCall(dev, at.OP, dt.BY_NAME[dtype])
    t = [dev.tensor(x) for x in (q, k, v)]
    tm = None if mask is None else dev.tensor(mask)
    opts = dict(is_causal=False, scale=None, enable_gqa=False, window_size=None,
                return_lse=True, layout="bhsd", variant="simt")
    opts.update(kw)
    out, lse = at._forward(call, *t, tm, opts["is_causal"], opts["scale"], opts["enable_gqa"],
                           opts["window_size"], opts["return_lse"], opts["layout"],
                           opts["variant"])
    return out.obj, lse.obj


# (B, Hq, Hkv, Sq, Sk, D, smem limit, options): every instantiation at least once
EMU_CASES = [
    (1, 2, 2, 17, 17, 32, 48, {"is_causal": True}),
    (1, 2, 1, 70, 70, 64, 48, {"enable_gqa": True, "window_size": (9, 4)}),
    (1, 2, 2, 70, 45, 64, 227, {"mask": "bool"}),
    (1, 1, 1, 33, 66, 96, 48, {"mask": "float", "is_causal": True}),
    (1, 2, 2, 9, 70, 96, 227, {"layout": "bshd"}),
    (1, 2, 2, 40, 40, 128, 48, {"is_causal": True, "scale": 0.2}),
    (1, 1, 1, 1, 70, 128, 227, {"mask": "bool"}),
    (1, 2, 2, 19, 23, 17, 48, {"mask": "float"}),             # general path, one chunk
    (2, 2, 1, 21, 30, 40, 48, {"enable_gqa": True, "is_causal": True}),   # two chunks
    (1, 8, 1, 20, 36, 32, 227, {"enable_gqa": True, "mask": "bool", "window_size": (3, 2)}),
    (2, 4, 2, 70, 70, 64, 48, {"enable_gqa": True, "mask": "float", "is_causal": True,
                               "window_size": (20, -1), "layout": "bshd"}),
]


@needs_emu
@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: f"D{c[5]}-{c[6]}k-{sorted(c[7])}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_kernel(case, dtype, rng, monkeypatch):
    B, Hq, Hkv, Sq, Sk, D, kb, opt = case
    opt = dict(opt)
    monkeypatch.setattr(at, "smem_limit", lambda dev: kb * 1024)
    layout = opt.get("layout", "bhsd")
    shp = (lambda b, h, s: (b, h, s, D)) if layout == "bhsd" else (lambda b, h, s: (b, s, h, D))
    q, k, v = _rand(rng, shp(B, Hq, Sq), dtype), _rand(rng, shp(B, Hkv, Sk), dtype), \
        _rand(rng, shp(B, Hkv, Sk), dtype)
    kind = opt.pop("mask", None)
    mask = None
    if kind == "bool":
        mask = rng.random((Sq, Sk)) > 0.3
        mask[Sq // 2] = False
    elif kind == "float":
        mask = _rand(rng, (B, 1, Sq, Sk), dtype, 2.0)
        mask[..., 0, :] = -np.inf
    with emu.Device(sms=2) as dev:
        out, lse = _emu_run(dev, q, k, v, mask, dtype=dtype, **opt)
    exp, exp_lse, bound, lbound = attn_bound(q, k, v, mask, dtype=dtype, **opt)
    check(out, exp, bound, f"out {case} {dtype}")
    check(lse, exp_lse, lbound, f"lse {case} {dtype}")


@needs_emu
def test_emulated_kernel_strided_nan_and_empty_keys(rng, monkeypatch):
    monkeypatch.setattr(at, "smem_limit", lambda dev: 48 * 1024)
    base = _rand(rng, (1, 2, 20, 64), "float32")
    q = base[:, :, :, ::2]                                   # head-dim stride 2, D = 32
    k = np.swapaxes(np.ascontiguousarray(np.swapaxes(_rand(rng, (1, 2, 25, 32), "float32"), 2, 3)),
                    2, 3)                                    # [B, H, S, D] with D the slow axis
    v = _rand(rng, (1, 2, 25, 32), "float32")
    q[0, 1, 3, 5] = np.nan
    with emu.Device(sms=2) as dev:
        out, lse = _emu_run(dev, q, k, v, dtype="float32", is_causal=True)
        exp, exp_lse, bound, lbound = attn_bound(q, k, v, dtype="float32", is_causal=True)
        check(out, exp, bound, "strided")
        check(lse, exp_lse, lbound, "strided lse")
        assert np.all(np.isnan(out[0, 1, 3]))
        out, lse = _emu_run(dev, q, k[:, :, :0], v[:, :, :0], dtype="float32")   # Sk = 0
        assert np.all(out == 0) and np.all(np.isneginf(lse))


# ----------------------------------------------------------------------------- CPU: the mma kernel

def _mma_launches():
    return [name for name, *_ in emu.Device.launches if "flash_fwd_mma" in name]


def _shapes(layout, D):
    return (lambda b, h, s: (b, h, s, D)) if layout == "bhsd" else (lambda b, h, s: (b, s, h, D))


def _emu_mma_case(case, dtype, rng, monkeypatch):
    """Runs one case on the emulated tensor-core kernel; returns the launched kernel names."""
    B, Hq, Hkv, Sq, Sk, D, opt = case
    opt = dict(opt)
    monkeypatch.setattr(at, "tensor_cores", lambda dev: True)
    layout = opt.get("layout", "bhsd")
    shp = _shapes(layout, D)
    q, k, v = _rand(rng, shp(B, Hq, Sq), dtype), _rand(rng, shp(B, Hkv, Sk), dtype), \
        _rand(rng, shp(B, Hkv, Sk), dtype)
    kind = opt.pop("mask", None)
    mask = None
    if kind == "bool":
        mask = rng.random((Sq, Sk)) > 0.3
        mask[Sq // 2] = False                                  # a row that sees no key
    elif kind == "float":
        mask = _rand(rng, (B, 1, Sq, Sk), dtype, 2.0)
        if Sq > 1:
            mask[..., 0, :] = -np.inf                          # fully masked by -inf
        mask[..., -1, ::3] = -np.inf
    with emu.Device(sms=2) as dev:
        out, lse = _emu_run(dev, q, k, v, mask, dtype=dtype, variant="mma", **opt)
        names = _mma_launches()
    exp, exp_lse, bound, lbound = attn_bound(q, k, v, mask, dtype=dtype, mma=True, **opt)
    check(out, exp, bound, f"out {case} {dtype}")
    check(lse, exp_lse, lbound, f"lse {case} {dtype}")
    return names


# (B, Hq, Hkv, Sq, Sk, D, options): every head dim, query/key tails (1, 17, 130 = 2 tiles + 2),
# causal with Sq <, =, > Sk, windows, GQA, bool/additive masks (fully masked rows), 'bshd', a
# negative scale (the scale is not folded into the exponent then).
EMU_MMA_CASES = [
    (1, 2, 2, 1, 1, 64, {}),
    (1, 2, 2, 17, 17, 64, {"is_causal": True}),
    (1, 2, 2, 130, 130, 128, {"is_causal": True}),
    (2, 4, 2, 130, 17, 128, {"enable_gqa": True, "mask": "bool"}),
    (1, 2, 1, 17, 130, 64, {"enable_gqa": True, "window_size": (-1, 5)}),
    (1, 2, 1, 130, 130, 64, {"enable_gqa": True, "window_size": (20, 5)}),
    (1, 2, 2, 130, 130, 64, {"mask": "float", "is_causal": True, "layout": "bshd"}),
    (1, 1, 1, 130, 130, 128, {"window_size": (-1, 30), "scale": -0.1}),
    (1, 2, 2, 70, 130, 32, {"is_causal": True}),
    (1, 2, 2, 130, 70, 32, {"is_causal": True, "layout": "bshd"}),
    (1, 2, 2, 33, 70, 96, {"mask": "bool"}),
    (1, 1, 1, 130, 100, 256, {"window_size": (50, 0)}),
    (1, 1, 1, 1, 130, 128, {"mask": "float", "scale": 0.3}),
]


@needs_emu
@pytest.mark.parametrize("case", EMU_MMA_CASES, ids=lambda c: f"{c[:6]}-{sorted(c[6])}")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_emulated_mma_kernel(case, dtype, rng, monkeypatch):
    names = _emu_mma_case(case, dtype, rng, monkeypatch)
    assert names and all(f", {case[5]}, " in n for n in names), names


@needs_emu
@pytest.mark.parametrize("cfg", at.MMA_ALTERNATES[128], ids=str)
def test_emulated_mma_alternate_schedules(cfg, rng, monkeypatch):
    """The schedules compiled for timing next to MMA_TILES[128] (8 warps; 2 m16 tiles per warp
    with Q re-read from shared memory) are correct too."""
    monkeypatch.setitem(at.MMA_TILES, 128, cfg)
    for case in ((1, 2, 1, 130, 130, 128, {"enable_gqa": True, "is_causal": True}),
                 (1, 1, 1, 17, 70, 128, {"mask": "bool", "window_size": (9, 3)})):
        names = _emu_mma_case(case, "bfloat16", rng, monkeypatch)
        assert names == [at.mma_expr(dt.bfloat16, 128, cfg)]


@needs_emu
def test_emulated_mma_nan_empty_keys_and_auto(rng, monkeypatch):
    monkeypatch.setattr(at, "tensor_cores", lambda dev: True)
    q, k, v = (_rand(rng, (1, 2, 40, 64), "bfloat16") for _ in range(3))
    q[0, 1, 3, 5] = np.nan
    with emu.Device(sms=2) as dev:
        out, lse = _emu_run(dev, q, k, v, dtype="bfloat16", variant="auto")   # -> mma
        assert _mma_launches()
        exp, exp_lse, bound, lbound = attn_bound(q, k, v, dtype="bfloat16", mma=True)
        check(out, exp, bound, "nan row")
        check(lse, exp_lse, lbound, "nan row lse")
        assert np.all(np.isnan(out[0, 1, 3])) and np.isnan(lse[0, 1, 3])
        assert not np.isnan(out[0, 1, 4]).any()
        emu.Device.launches.clear()
        out, lse = _emu_run(dev, q, k[:, :, :0], v[:, :, :0], dtype="bfloat16",
                            variant="mma")                                     # Sk = 0
        assert _mma_launches()
        assert np.all(out == 0) and np.all(np.isneginf(lse))


@needs_emu
def test_mma_falls_back_to_simt(rng, monkeypatch):
    """fp32, head dims without an mma instantiation, unaligned or strided-d rows, and devices
    below sm_80 take the SIMT kernel (for 'mma' and 'auto')."""
    monkeypatch.setattr(at, "smem_limit", lambda dev: 227 * 1024)
    tc = {"on": True}
    monkeypatch.setattr(at, "tensor_cores", lambda dev: tc["on"])

    def kernels(q, k, v, dtype, variant="mma"):
        with emu.Device(sms=2) as dev:
            out, lse = _emu_run(dev, q, k, v, dtype=dtype, variant=variant)
            names = [name for name, *_ in emu.Device.launches]
        exp, exp_lse, bound, lbound = attn_bound(q, k, v, dtype=dtype, mma=True)
        check(out, exp, bound, f"fallback {dtype}")
        check(lse, exp_lse, lbound, f"fallback {dtype} lse")
        return names

    x = [_rand(rng, (1, 2, 20, 64), "bfloat16") for _ in range(3)]
    assert "flash_fwd_mma" in kernels(*x, "bfloat16")[0]
    assert "flash_fwd<" in kernels(*x, "bfloat16", variant="simt")[0]
    assert "flash_fwd<" in kernels(*(a.astype(np.float32) for a in x), "float32")[0]
    y = [_rand(rng, (1, 2, 20, 80), "float16") for _ in range(3)]               # D = 80
    assert "flash_fwd<" in kernels(*y, "float16")[0]
    off = [emu.strided(a, "offset") for a in x]                                  # misaligned rows
    assert "flash_fwd<" in kernels(*off, "bfloat16", variant="auto")[0]
    sliced = [emu.strided(a, "sliced") for a in x]                               # d stride 2
    assert "flash_fwd<" in kernels(*sliced, "bfloat16")[0]
    tc["on"] = False                                                             # sm_75 and older
    assert "flash_fwd<" in kernels(*x, "bfloat16", variant="auto")[0]


def test_mma_configs_and_modules():
    """Every mma schedule fits the smallest opt-in shared memory of sm_80+ (99 KB on sm_86/89),
    tiles the head dim, and the modules are built for sm_80+ only (no sm_61/70/75 build)."""
    for d, cfg in at.MMA_TILES.items():
        warps, mt, bc, qreg, minb = cfg
        assert d % 32 == 0 and bc % 16 == 0 and warps * 32 * minb <= 2048
        assert at.mma_smem(d, cfg) <= 99 * 1024
    for m in at.MMA_MODULES.values():
        assert m.min_arch == 80 and not m.supports(75) and m.supports(80) and m.supports(90)
        assert set(m.kernels.values()) == {at.FLASH_ARGS}


# ----------------------------------------------------------------------------- GPU

def _cuda(x, dtype):
    return torch.from_numpy(np.asarray(x, np.float32)).to("cuda", getattr(torch, dtype))


def _host(x):
    return x.double().cpu().numpy()


GPU_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, options)
    (2, 4, 4, 1, 1, 64, {}),
    (2, 4, 2, 17, 17, 32, {"is_causal": True}),
    (1, 8, 1, 128, 128, 128, {"enable_gqa": True}),
    (1, 4, 4, 1000, 1000, 96, {"is_causal": True}),
    (1, 2, 2, 4097, 4097, 128, {"is_causal": True}),
    (1, 2, 1, 4097, 4097, 64, {"enable_gqa": True, "window_size": (256, 0)}),
    (1, 2, 2, 1000, 777, 128, {"mask": "bool"}),
    (1, 2, 2, 600, 1000, 64, {"mask": "float", "is_causal": True}),
    (2, 4, 2, 128, 4097, 128, {"enable_gqa": True, "window_size": (-1, 300)}),
    (1, 2, 2, 300, 300, 17, {"is_causal": True}),
    (1, 2, 2, 130, 200, 1024, {"mask": "bool"}),
    (1, 4, 4, 1000, 1000, 128, {"layout": "bshd", "scale": 0.05}),
]


def _gpu_case(case, dtype, rng, variant, mma):
    B, Hq, Hkv, Sq, Sk, D, opt = case
    opt = dict(opt)
    opt.setdefault("enable_gqa", Hq != Hkv)
    layout = opt.get("layout", "bhsd")
    shp = _shapes(layout, D)
    q, k, v = _rand(rng, shp(B, Hq, Sq), dtype), _rand(rng, shp(B, Hkv, Sk), dtype), \
        _rand(rng, shp(B, Hkv, Sk), dtype)
    kind = opt.pop("mask", None)
    mask = tmask = None
    if kind == "bool":
        mask = rng.random((1, Hq, Sq, Sk)) > 0.5
        mask[0, 0, Sq // 2] = False
        tmask = torch.from_numpy(mask).cuda()
    elif kind == "float":
        mask = _rand(rng, (B, 1, 1, Sk), dtype, 3.0)
        mask[..., : Sk // 3] = -np.inf
        tmask = _cuda(mask, dtype)
    out, lse = go.scaled_dot_product_attention(_cuda(q, dtype), _cuda(k, dtype), _cuda(v, dtype),
                                               tmask, return_lse=True, variant=variant, **opt)
    exp, exp_lse, bound, lbound = attn_bound(q, k, v, mask, dtype=dtype, mma=mma, **opt)
    check(_host(out), exp, bound, f"out {case} {dtype}")
    assert lse.dtype == torch.float32
    check(_host(lse), exp_lse, lbound, f"lse {case} {dtype}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c[:6]}-{sorted(c[6])}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_against_reference(case, dtype, rng):
    """The SIMT kernel (every dtype and head dim; 'auto' takes the mma kernel where it can)."""
    _gpu_case(case, dtype, rng, "simt", False)


# The tensor-core kernel: every head dim it has (32, 64, 96, 128, 256), key/query tails (1, 17,
# 777, 1000, 4097), causal (Sq <, =, > Sk), windows, GQA 2/8, masks, 'bshd', lse.
GPU_MMA_CASES = [
    (2, 4, 4, 1, 1, 64, {}),
    (2, 4, 2, 17, 17, 32, {"is_causal": True}),
    (1, 8, 1, 128, 128, 128, {}),
    (1, 4, 4, 1000, 1000, 96, {"is_causal": True}),
    (1, 2, 2, 4097, 4097, 128, {"is_causal": True}),
    (1, 2, 2, 4097, 4097, 128, {}),
    (1, 2, 1, 4097, 4097, 64, {"window_size": (256, 0)}),
    (1, 2, 2, 1000, 777, 128, {"mask": "bool"}),
    (1, 2, 2, 600, 1000, 64, {"mask": "float", "is_causal": True}),
    (2, 4, 2, 128, 4097, 128, {"window_size": (-1, 300)}),
    (1, 4, 4, 1000, 1000, 128, {"layout": "bshd", "scale": 0.05}),
    (1, 2, 2, 1000, 1000, 256, {"is_causal": True}),
    (1, 2, 2, 17, 1000, 256, {"mask": "bool"}),
    (2, 2, 2, 4097, 17, 64, {"layout": "bshd", "is_causal": True}),
    (1, 2, 2, 1000, 4097, 32, {"window_size": (100, 100)}),
]


@pytest.fixture
def mma_only(monkeypatch):
    """The tensor-core kernel must take the call (a fallback to SIMT fails the test)."""
    if not at.tensor_cores(torch.cuda.current_device()):
        pytest.skip("no tensor-core path on this device/GPUOPS_ARCH (sm_80+ needed)")

    def no_simt(*args, **kw):
        raise AssertionError("fell back to the SIMT kernel")
    monkeypatch.setattr(at, "_launch_simt", no_simt)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_MMA_CASES, ids=lambda c: f"{c[:6]}-{sorted(c[6])}")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_mma_against_reference(case, dtype, rng, mma_only):
    _gpu_case(case, dtype, rng, "auto", True)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("cfg", at.MMA_ALTERNATES[128], ids=str)
def test_gpu_mma_alternate_schedules(cfg, rng, mma_only, monkeypatch):
    monkeypatch.setitem(at.MMA_TILES, 128, cfg)
    for case in ((1, 4, 2, 4097, 4097, 128, {"is_causal": True}),
                 (2, 2, 2, 1000, 777, 128, {"mask": "bool", "layout": "bshd"})):
        _gpu_case(case, "bfloat16", rng, "mma", True)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_strided_inputs_nan_and_no_lse(dtype, rng):
    q = _cuda(_rand(rng, (2, 130, 4, 128), dtype), dtype).transpose(1, 2)     # [B, H, S, D] view
    kv = _cuda(_rand(rng, (2, 4, 300, 256), dtype), dtype)
    k, v = kv[..., :128], kv[..., 128:]                                         # row stride 256
    q[1, 2, 7, 3] = float("nan")
    out = go.scaled_dot_product_attention(q, k, v, is_causal=True)   # fp16/bf16: mma
    exp, _, bound, _ = attn_bound(_host(q), _host(k), _host(v), dtype=dtype, is_causal=True,
                                  mma=dtype != "float32")
    check(_host(out), exp, bound, "strided")
    assert torch.isnan(out[1, 2, 7]).all() and not torch.isnan(out[1, 2, 8]).any()


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_against_torch_sdpa(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 8, 1024, 128, device="cuda", generator=g).to(getattr(torch, dtype))
               for _ in range(3))
    for causal in (False, True):
        ours = go.scaled_dot_product_attention(q, k, v, is_causal=causal)
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        exact = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), is_causal=causal)
        # ours is at least as close to the float64 result as torch's own kernel (+ 1 rounding)
        e_ours = (ours.double() - exact).norm() / exact.norm()
        e_torch = (theirs.double() - exact).norm() / exact.norm()
        assert e_ours <= e_torch * 1.5 + 1e-3, (causal, float(e_ours), float(e_torch))


@gpu
@needs_torch_cuda
def test_gpu_cuda_graph_and_side_stream(rng):
    q, k, v = (_cuda(_rand(rng, (1, 4, 200, 64), "bfloat16"), "bfloat16") for _ in range(3))
    exp = go.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        go.scaled_dot_product_attention(q, k, v, is_causal=True)      # warm (loads the module)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = go.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    q.copy_(q * 0.5)
    graph.replay()
    torch.cuda.synchronize()
    exp2 = go.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(out, exp2) and not torch.equal(out, exp)


@gpu
@needs_torch_cuda
def test_gpu_empty_and_fully_masked():
    q = torch.randn(1, 2, 0, 64, device="cuda", dtype=torch.float16)
    kv = torch.randn(1, 2, 5, 64, device="cuda", dtype=torch.float16)
    assert go.scaled_dot_product_attention(q, kv, kv).shape == (1, 2, 0, 64)
    q = torch.randn(1, 2, 3, 64, device="cuda", dtype=torch.float16)
    out, lse = go.scaled_dot_product_attention(q, kv[:, :, :0], kv[:, :, :0], return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    mask = torch.zeros(3, 5, dtype=torch.bool, device="cuda")
    out, lse = go.scaled_dot_product_attention(q, kv, kv, mask, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_vec_flag_follows_layout_and_alignment():
    from gpuops.tensor import Tensor  # noqa: PLC0415

    def t(shape, strides, ptr=0x1000, d=dt.bfloat16):
        return Tensor(ptr, shape, strides, d, 0, None)
    shape = (2, 4, 10, 64)
    assert at._vec_ok(t(shape, (2560, 640, 64, 1)), "bhsd", shape)
    assert not at._vec_ok(t(shape, (2560, 640, 64, 1), ptr=0x1002), "bhsd", shape)
    assert not at._vec_ok(t(shape, (5120, 1280, 128, 2)), "bhsd", shape)
    assert not at._vec_ok(t(shape, (2600, 650, 65, 1)), "bhsd", shape)
    assert at._vec_ok(t((2, 10, 4, 64), (2560, 256, 64, 1)), "bshd", shape)   # [B, S, H, D]


@needs_emu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_emulated_kernel_unaligned_rows(dtype, rng, monkeypatch):
    """Rows that start off a 16-byte boundary take the element-wise tile loads."""
    monkeypatch.setattr(at, "smem_limit", lambda dev: 227 * 1024)
    q, k, v = (emu.strided(_rand(rng, (1, 2, 37, 64), dtype), "offset") for _ in range(3))
    with emu.Device(sms=2) as dev:
        out, lse = _emu_run(dev, q, k, v, dtype=dtype, window_size=(5, 7))
    exp, exp_lse, bound, lbound = attn_bound(q, k, v, dtype=dtype, window_size=(5, 7))
    check(out, exp, bound, "offset")
    check(lse, exp_lse, lbound, "offset lse")


@gpu
@needs_torch_cuda
def test_gpu_long_sequence_memory_stays_linear():
    """S = 65,536: no S x S buffer (peak memory a few times the inputs), rows checked against the
    reference computed for those rows."""
    S, D = 65536, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 2, S, D, device="cuda", generator=g).to(torch.bfloat16)
               for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = go.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= 2 * q.numel() * q.element_size() + (1 << 20)
    rows = np.array([0, 1, 4097, 33333, S - 1])
    qh, kh, vh = _host(q), _host(k), _host(v)
    exp, _, bound, _ = attn_bound(qh[:, :, rows], kh, vh, dtype="bfloat16", mma=True)
    check(_host(out)[:, :, rows], exp, bound, "S=65536")
