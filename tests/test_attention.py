"""scaled_dot_product_attention (flash forward) against float64 references.

Also varlen_attention, block_sparse_attention and RoPE fused into the loads (rotary_cos /
rotary_sin): references against dense attention per sequence / with the expanded mask / after
apply_rotary, argument errors, the kernel in the emulator (random lengths incl. 0 and 1, sq != sk,
block sizes that do and do not match the tiles, NaN in skipped tiles, vector and element loads
with rotary, the general head-dim path), and GPU tests (CUDA graph replay with new lengths).

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
ceil(Sk / 16) mma steps: + 36 u ceil(Sk / 16) (P|V|). With rotary tables it also rounds the
rotated q and k to the input dtype: + (2 u_in + u_in^2) scale max_ij sum_d |q'_d||k'_d| on e_s.

The mma kernel's varlen, block-sparse and rotary instantiations (EXTRAS) run in the emulator on
small shapes with the same bound; the rotary one is also bit-equal to the kernel run on q and k
rotated beforehand by a NumPy model of its fp32 rotation.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import gpuops as go
from gpuops import dtypes as dt
from gpuops.ops import attention as at
from conftest import HAS_TORCH, gpu, needs_torch, needs_torch_cuda

torch = pytest.importorskip("torch") if HAS_TORCH else None
import emu  # noqa: E402
from emu import needs_emu  # noqa: E402
from attention_testing import (  # noqa: E402  (shared by the attention test files)
    DTYPES, TINY, U32, U_OUT, bhsd as _bhsd, check, np_dtype as _np_dtype, rand as _rand, FakeCall)

ref = at.ref_scaled_dot_product_attention


def _rot_magnitude(x, half, interleaved):
    """|x_d| + |x_partner(d)| on the rotated part, |x_d| on the rest: bounds the rotated value
    (|cos|, |sin| <= 1) and, times 2u, its fp32 rounding error."""
    a = np.abs(x)
    if not half:
        return a
    out = a.copy()
    if interleaved:
        out[..., 0:2 * half:2] += a[..., 1:2 * half:2]
        out[..., 1:2 * half:2] += a[..., 0:2 * half:2]
    else:
        out[..., :half] += a[..., half:2 * half]
        out[..., half:2 * half] += a[..., :half]
    return out


def attn_bound(q, k, v, mask=None, *, dtype, layout="bhsd", enable_gqa=False, mma=False, **kw):
    """(reference out, reference lse, elementwise bound on |out - ref|, bound on |lse - ref|).
    mma: the bound of the tensor-core kernel (module docstring); it also covers the SIMT one.

    With rotary tables (rotary_cos=..., real cos / sin values): the kernel rotates q and k in
    fp32 (fma(x, c, +-p s): error <= 2u (|x| + |p|) per element), so the score bound uses the
    magnitudes |x| + |partner| and adds 4u scale sum_d (|q|+|q'|)(|k|+|k'|); the mma kernel
    then rounds them to the input dtype (u_in each): + (2 u_in + u_in^2) scale sum_d (...)(...)."""
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
    half = 0 if kw.get("rotary_cos") is None else np.shape(kw["rotary_cos"])[-1]
    qa = _rot_magnitude(qb, half, kw.get("rotary_interleaved", False))
    ka = _rot_magnitude(kb, half, kw.get("rotary_interleaved", False))
    g = 0.0
    for h in range(Hq):
        a = qa[:, h] @ ka[:, h // group].transpose(0, 2, 1)
        g = max(g, float(np.nanmax(a, initial=0.0)))      # NaN rows are checked as NaN
    smax = abs(scale) * g
    if m64 is not None and m64.dtype != bool:
        smax += float(np.abs(m64[np.isfinite(m64)]).max(initial=0.0))
    e_s = abs(scale) * (2 * math.sqrt(D) + 4) * U32 * g + 4 * U32 * smax
    if half:
        e_s += 4 * U32 * abs(scale) * g
    rel = 2 * e_s + 2.0**-21 + 3 * math.sqrt(Sk + 1) * U32
    tiny = TINY[dtype]
    if mma:
        e_s = max(e_s, abs(scale) * (D / 16 + 1) * 34 * U32 * g + 4 * U32 * smax)
        if half:   # the rotated q and k are rounded to the input dtype (the mma operands)
            e_s += abs(scale) * (2 * U_OUT[dtype] + U_OUT[dtype] ** 2) * g
        rel = (2 * e_s + 2.0**-21 + 3 * math.sqrt(Sk + 1) * U32 + U_OUT[dtype]
               + 36 * U32 * math.ceil(Sk / 16))
        if dtype == "float16":
            tiny += 2.0**-25 * Sk * float(np.nanmax(np.abs(v64), initial=0.0))
    with np.errstate(invalid="ignore"):
        bound = rel * pv + 2 * U_OUT[dtype] * np.abs(out) + tiny
        lse_bound = e_s + 2.0**-21 + 3 * math.sqrt(Sk + 1) * U32 + 2 * U32 * np.abs(lse)
    return out, lse, bound, lse_bound


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
        f(q, kv, kv, enable_gqa=True, variant="fast")
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
        m = re.match(r"(const void\*|void\*|float\*|const int\*|const unsigned char\*|"
                     r"long long|int|float)\s+(.*);", line)
        code = {"const void*": "P", "void*": "P", "float*": "P", "const int*": "P",
                "const unsigned char*": "P", "long long": "q", "int": "i", "float": "f"}[m.group(1)]
        for name in m.group(2).split(","):
            n = re.search(r"\[(\d+)\]", name)
            fmt.append((code, int(n.group(1)) if n else 1))
    merged = []
    for code, n in fmt:
        if merged and merged[-1][0] == code:
            merged[-1] = (code, merged[-1][1] + n)
        else:
            merged.append((code, n))
    assert "".join(f"{n}{c}" for c, n in merged) == "6P20q9i1f5P11q6i"
    assert at.FLASH_ARGS.params == ("6P20q9if5P11q6i",) and at.FLASH_ARGS.size == 400
    # the builder fills every field, in order
    from gpuops.tensor import Tensor  # noqa: PLC0415
    t = Tensor(0x1000, (1, 2, 3, 32), (192, 96, 32, 1), dt.float16, 0, None)
    p = at.check_args(t.shape, t.shape, t.shape, None, False, None, False, None, True, "bhsd",
                      "auto")
    args = at.flash_launch_args(p, t, t, t, None, 0, t, t, "bhsd", True)
    assert len(args) == sum(n for _, n in merged)
    at.FLASH_ARGS.struct.pack(*args)


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
    """The schedules compiled for timing next to MMA_TILES[128] (32 rows x 64 keys per warp, two
    K/V stages, 8 warps, Q in registers) are correct too: causal + GQA over 3-9 key tiles (both
    stages reused), window + key tail, a negative scale (no folded scale). Masked calls take
    the masked instantiation of MMA_MASK_TILES[128] whatever MMA_TILES says."""
    monkeypatch.setitem(at.MMA_TILES, 128, cfg)
    for case in ((1, 2, 1, 130, 260, 128, {"enable_gqa": True, "is_causal": True}),
                 (1, 1, 1, 17, 70, 128, {"window_size": (9, 3), "layout": "bshd"}),
                 (1, 1, 1, 70, 130, 128, {"scale": -0.1})):
        names = _emu_mma_case(case, "bfloat16", rng, monkeypatch)
        assert names == [at.mma_expr(dt.bfloat16, 128, cfg)]
    names = _emu_mma_case((1, 1, 1, 17, 70, 128, {"mask": "bool", "window_size": (9, 3)}),
                          "bfloat16", rng, monkeypatch)
    assert names == [at.mma_expr(dt.bfloat16, 128, at.MMA_MASK_TILES[128], True)]


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
        warps, mt, bc, qreg, minb, stages = cfg
        assert d % 32 == 0 and bc % 16 == 0 and warps * 32 * minb <= 2048 and stages in (1, 2)
        assert at.mma_smem(d, cfg) <= 99 * 1024
    for cfg in (*at.MMA_ALTERNATES[128], *at.MMA_MASK_TILES.values()):
        assert at.mma_smem(128, cfg) <= 99 * 1024
    for d in at.MMA_TILES:      # every schedule a call can take is compiled
        exprs = set(at.MMA_MODULES[dt.bfloat16].kernels)
        assert at.mma_expr(dt.bfloat16, d, at.mma_config(d, False)) in exprs
        assert at.mma_expr(dt.bfloat16, d, at.mma_config(d, True), True) in exprs
    assert at.mma_smem(128, (4, 2, 64, False, 2, 2)) == (128 + 2 * 2 * 64) * 128 * 2
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


def _kernel_only(monkeypatch, available, needs, fallbacks):
    """Skip unless `available` on the current device; make each launcher in `fallbacks` fail
    the test if a call reaches it."""
    if not available(torch.cuda.current_device()):
        pytest.skip(f"no such path on this device/GPUOPS_ARCH ({needs} needed)")

    def fell_back(*args, **kw):
        raise AssertionError(f"fell back to {fallbacks}")
    for name in fallbacks:
        monkeypatch.setattr(at, name, fell_back)


@pytest.fixture
def mma_only(monkeypatch):
    """The tensor-core kernel must take the call (a fallback to SIMT fails the test)."""
    _kernel_only(monkeypatch, at.tensor_cores, "sm_80+", ("_launch_simt",))


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_MMA_CASES, ids=lambda c: f"{c[:6]}-{sorted(c[6])}")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_mma_against_reference(case, dtype, rng, mma_only):
    _gpu_case(case, dtype, rng, "mma", True)


# The Hopper kernel ('wgmma', sm_90): both head dims, query / key tails of one tile and beyond
# (1, 17, 100, 300, 1000, 4097), causal with Sq <, =, > Sk, windows (rows that see no key: 0 and
# lse -inf), GQA 2 / 8, 'bshd', a custom scale, lse; outputs poisoned (NaN) before each call.
GPU_WGMMA_CASES = [
    (1, 2, 2, 1, 1, 128, {}),
    (2, 4, 2, 17, 17, 64, {"is_causal": True}),
    (1, 8, 1, 128, 128, 128, {}),
    (1, 2, 2, 4097, 4097, 128, {"is_causal": True}),
    (1, 2, 2, 4097, 4097, 128, {}),
    (1, 2, 1, 4097, 4097, 64, {"window_size": (256, 0)}),
    (2, 4, 2, 128, 4097, 128, {"window_size": (-1, 300)}),
    (1, 4, 4, 1000, 1000, 128, {"layout": "bshd", "scale": 0.05}),
    (2, 2, 2, 4097, 17, 64, {"layout": "bshd", "is_causal": True}),
    (1, 2, 2, 1000, 4097, 64, {"window_size": (100, 100)}),
    (1, 2, 2, 600, 1000, 128, {"is_causal": True}),
    (1, 2, 2, 300, 100, 64, {"window_size": (0, 0)}),
]


@pytest.fixture
def wgmma_only(monkeypatch):
    """The Hopper kernel must take the call (a fallback to 'mma' or SIMT fails the test)."""
    _kernel_only(monkeypatch, at.wgmma_device, "sm_90", ("_launch_simt", "_launch_best"))


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_WGMMA_CASES, ids=lambda c: f"{c[:6]}-{sorted(c[6])}")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", ["auto", "wgmma"])
def test_gpu_wgmma_against_reference(case, dtype, variant, rng, wgmma_only):
    _gpu_case(case, dtype, rng, variant, True)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("schedule", at.WGMMA_SCHEDULES)
def test_gpu_wgmma_schedules_agree(schedule, rng, wgmma_only, monkeypatch):
    """Each schedule meets the reference, and the schedules give the same bits (the same
    products in the same order per warpgroup; only their timing differs)."""
    monkeypatch.setattr(at, "WGMMA_SCHEDULE", schedule)
    for case in ((1, 4, 2, 4097, 4097, 128, {"is_causal": True}),
                 (2, 2, 2, 1000, 777, 64, {"layout": "bshd"})):
        _gpu_case(case, "bfloat16", rng, "wgmma", True)
    q, k, v = (_cuda(_rand(rng, (1, 4, 1500, 128), "bfloat16"), "bfloat16") for _ in range(3))
    got = go.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    monkeypatch.setattr(at, "WGMMA_SCHEDULE", "overlap")
    base = go.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("kv_heads_in_l2", [1, 3])
def test_gpu_wgmma_head_chunks(kv_heads_in_l2, rng, wgmma_only, monkeypatch):
    """The grid's walk over (b x h) chunks (a short last chunk: 10 rows in chunks of 3, GQA
    chunks of 2 x 2 heads) covers every block once: every output row written (outputs are
    poisoned) and right."""
    D, S = 64, 300
    monkeypatch.setattr(at, "WGMMA_L2_BUDGET", kv_heads_in_l2 * 2 * S * D * 2)
    for case in ((2, 5, 5, S, S, D, {"is_causal": True}),
                 (2, 4, 2, S, S, D, {"layout": "bshd", "window_size": (-1, 50)}),
                 (2, 4, 2, S, S, D, {})):
        _gpu_case(case, "bfloat16", rng, "wgmma", True)


@gpu
@needs_torch_cuda
def test_gpu_wgmma_nan_rows_strided_views_and_graph(rng, wgmma_only):
    """NaN in one query row gives NaN in that row only; q as a transposed view ([B, S, H, D]
    memory read as 'bhsd') and k / v as column slices of wider rows; the call replays in a CUDA
    graph with new values."""
    q = _cuda(_rand(rng, (2, 300, 4, 128), "bfloat16"), "bfloat16").transpose(1, 2)
    kv = _cuda(_rand(rng, (2, 4, 500, 256), "bfloat16"), "bfloat16")
    k, v = kv[..., :128], kv[..., 128:]
    q[1, 2, 7, 3] = float("nan")
    out = go.scaled_dot_product_attention(q, k, v, is_causal=True, variant="wgmma")
    exp, _, bound, _ = attn_bound(_host(q), _host(k), _host(v), dtype="bfloat16", is_causal=True,
                                  mma=True)
    check(_host(out), exp, bound, "wgmma strided")
    assert torch.isnan(out[1, 2, 7]).all() and not torch.isnan(out[1, 2, 8]).any()
    assert not torch.isnan(out[0]).any()
    q[1, 2, 7, 3] = 0.0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = go.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True,
                                                       variant="wgmma")
    q.copy_(q * 0.5)
    graph.replay()
    torch.cuda.synchronize()
    exp2, exp2_lse = go.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True,
                                                     variant="wgmma")
    assert torch.equal(g_out, exp2) and torch.equal(g_lse, exp2_lse)
    ref2, ref2_lse, bound2, lbound2 = attn_bound(_host(q), _host(k), _host(v), dtype="bfloat16",
                                                 is_causal=True, mma=True)
    check(_host(g_out), ref2, bound2, "wgmma graph")
    check(_host(g_lse), ref2_lse, lbound2, "wgmma graph lse")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("cfg", at.MMA_ALTERNATES[128], ids=str)
def test_gpu_mma_alternate_schedules(cfg, rng, mma_only, monkeypatch):
    monkeypatch.setitem(at.MMA_TILES, 128, cfg)
    for case in ((1, 4, 2, 4097, 4097, 128, {"is_causal": True}),
                 (2, 2, 2, 1000, 777, 128, {"layout": "bshd"}),
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


# =============================================================================================
# varlen_attention, block_sparse_attention, rotary tables (issue 5)

from gpuops.ops import rotary as ro  # noqa: E402

ref_varlen = at.ref_varlen_attention
ref_sparse = at.ref_block_sparse_attention


def _tables(P, half, dtype="float32", base=10000.0):
    """Real RoPE tables [P, half] (|cos|, |sin| <= 1), rounded to the table dtype."""
    inv = base ** (-np.arange(half) / half)
    ang = np.arange(P)[:, None] * inv[None, :]
    return (np.cos(ang).astype(np.float32).astype(_np_dtype(dtype)),
            np.sin(ang).astype(np.float32).astype(_np_dtype(dtype)))


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _bottom_right_mask(sq, sk, is_causal, window):
    """Visibility of FlashAttention's varlen, written out with loops (independent of the op)."""
    left, right = window if window is not None else (-1, -1)
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    m = np.ones((sq, sk), bool)
    for i in range(sq):
        for j in range(sk):
            d = i + sk - sq
            if (left >= 0 and j < d - left) or (right >= 0 and j > d + right):
                m[i, j] = False
    return m


def _seq(x, cu, b):
    """Sequence b of a packed [T, H, D] array as [1, H, L, D]."""
    return np.asarray(x)[cu[b]:cu[b + 1]].transpose(1, 0, 2)[None]


# ----------------------------------------------------------------------------- CPU: references

@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("half", [8, 5])                  # full rotary (D = 16), partial
def test_reference_rotary_is_apply_rotary_then_attention(interleaved, layout, half, rng):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 9, 13, 16
    q, k, v = (rng.standard_normal(s) for s in ((B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D)))
    cos, sin = (rng.standard_normal((20, half)) for _ in range(2))   # any table values
    if layout == "bshd":
        q, k, v = (x.transpose(0, 2, 1, 3).copy() for x in (q, k, v))
    got, lse = ref(q, k, v, is_causal=True, enable_gqa=True, layout=layout, return_lse=True,
                   rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    qs, ks = (x if layout == "bshd" else x.transpose(0, 2, 1, 3) for x in (q, k))
    # apply_rotary takes q and k with the same heads: rotate k's heads on their own
    qr, _ = ro.ref_apply_rotary(qs, qs, cos, sin, interleaved, rotary_dim=2 * half)
    kr, _ = ro.ref_apply_rotary(ks, ks, cos, sin, interleaved, rotary_dim=2 * half)
    if layout == "bhsd":
        qr, kr = (x.transpose(0, 2, 1, 3) for x in (qr, kr))
    exp, exp_lse = ref(qr, kr, v, is_causal=True, enable_gqa=True, layout=layout,
                       return_lse=True)
    np.testing.assert_allclose(got, exp, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, exp_lse, rtol=1e-12, atol=1e-13)
    plain = ref(q, k, v, is_causal=True, enable_gqa=True, layout=layout)
    assert not np.allclose(got, plain)                        # the rotation did something


VARLEN_REF_CASES = [
    # (lengths q, lengths k, Hq, Hkv, options)
    ([5, 0, 1, 17, 3], None, 2, 2, {}),
    ([5, 0, 1, 17, 3], None, 4, 2, {"is_causal": True}),
    ([4, 9, 1, 6], [10, 3, 1, 0], 2, 1, {"is_causal": True}),     # sq > sk and sq < sk
    ([7, 12], [12, 7], 2, 2, {"window_size": (3, 1)}),
    ([7, 12, 2], [9, 12, 5], 4, 4, {"window_size": (2, -1), "is_causal": True, "scale": 0.4}),
    ([6, 11], None, 4, 2, {"rotary": (4, False), "is_causal": True}),
    ([6, 1, 11], [8, 4, 11], 2, 2, {"rotary": (3, True)}),
]


@pytest.mark.parametrize("case", VARLEN_REF_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{sorted(c[4])}")
def test_varlen_reference_is_dense_attention_per_sequence(case, rng):
    lq, lk, Hq, Hkv, opt = case
    lk = lq if lk is None else lk
    opt = dict(opt)
    D = 8
    cq, ck = _cu(lq), _cu(lk)
    q = rng.standard_normal((cq[-1], Hq, D))
    k, v = (rng.standard_normal((ck[-1], Hkv, D)) for _ in range(2))
    rot = opt.pop("rotary", None)
    rkw = {}
    if rot is not None:
        cos, sin = (rng.standard_normal((max(lq + lk), rot[0])) for _ in range(2))
        rkw = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rot[1])
    got, lse = ref_varlen(q, k, v, cq, ck, max(lq), max(lk), return_lse=True, **opt, **rkw)
    assert got.shape == q.shape and lse.shape == (Hq, cq[-1])
    if rot is not None:
        # apply_rotary on the packed tensors with positions = index within the sequence
        pos_q = np.concatenate([np.arange(n) for n in lq]).astype(np.int64)
        pos_k = np.concatenate([np.arange(n) for n in lk]).astype(np.int64)
        q, _ = ro.ref_apply_rotary(q, q, cos, sin, rot[1], positions=pos_q, rotary_dim=2 * rot[0])
        k, _ = ro.ref_apply_rotary(k, k, cos, sin, rot[1], positions=pos_k, rotary_dim=2 * rot[0])
    for b in range(len(lq)):
        mask = _bottom_right_mask(lq[b], lk[b], opt.get("is_causal", False),
                                  opt.get("window_size"))
        exp, exp_lse = ref(_seq(q, cq, b), _seq(k, ck, b), _seq(v, ck, b), mask,
                           scale=opt.get("scale"), enable_gqa=True, return_lse=True)
        np.testing.assert_allclose(got[cq[b]:cq[b + 1]], exp[0].transpose(1, 0, 2), rtol=1e-12,
                                   atol=1e-13)
        np.testing.assert_array_equal(lse[:, cq[b]:cq[b + 1]], exp_lse[0])
    if opt.get("is_causal"):
        # bottom-right: a sequence with more queries than keys has rows that see nothing
        for b in (i for i in range(len(lq)) if lq[i] > lk[i]):
            assert np.all(got[cq[b]:cq[b] + lq[b] - lk[b]] == 0)
            assert np.all(np.isneginf(lse[:, cq[b]:cq[b] + lq[b] - lk[b]]))


@needs_torch
def test_varlen_and_block_sparse_references_match_torch_math(rng):
    lengths = [3, 1, 30]
    cu = _cu(lengths)
    q, k, v = (rng.standard_normal((cu[-1], 4, 8)) for _ in range(3))
    got = ref_varlen(q, k, v, cu, cu, 30, 30, True)
    for b in range(3):
        exp = torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(_seq(x, cu, b).copy()) for x in (q, k, v)), is_causal=True)
        np.testing.assert_allclose(got[cu[b]:cu[b + 1]], exp[0].numpy().transpose(1, 0, 2),
                                   rtol=1e-11, atol=1e-12)
    q, k, v = (rng.standard_normal((2, 4, 37, 8)) for _ in range(3))
    bm = rng.random((2, 1, 5, 5)) > 0.4
    bm[..., 0, :] = True                                  # no empty rows (torch gives NaN there
    got = ref_sparse(q, k, v, bm, 8, is_causal=True)      # before 2.5, 0 after)
    emask = torch.from_numpy(np.repeat(np.repeat(bm, 8, 2), 8, 3)[:, :, :37, :37]).tril()
    emask |= ~emask.any(-1, keepdim=True)                 # rows with no key: compared below
    exp = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)), attn_mask=emask)
    seen = np.asarray(at.expand_block_mask(bm, 8, 37, 37) & np.tril(np.ones((37, 37), bool)))
    rows = np.broadcast_to(seen.any(-1, keepdims=True), got.shape)
    np.testing.assert_allclose(got[rows], exp.numpy()[rows], rtol=1e-11, atol=1e-12)
    assert np.all(got[~rows] == 0)


def test_block_sparse_reference_is_dense_with_the_expanded_mask(rng):
    q = rng.standard_normal((2, 4, 21, 8))
    k, v = (rng.standard_normal((2, 2, 30, 8)) for _ in range(2))
    for bs, shape in ((4, (1, 1, 6, 8)), (7, (2, 4, 3, 5)), (64, (2, 1, 1, 1))):
        bm = rng.random(shape) > 0.5
        got, lse = ref_sparse(q, k, v, bm, bs, is_causal=True, return_lse=True)
        full = np.zeros((shape[0], shape[1], 21, 30), bool)
        for i in range(21):
            for j in range(30):
                full[:, :, i, j] = bm[:, :, i // bs, j // bs]
        exp, exp_lse = ref(q, k, v, full, is_causal=True, enable_gqa=True, return_lse=True)
        np.testing.assert_array_equal(got, exp)
        np.testing.assert_array_equal(lse, exp_lse)


def test_varlen_and_block_sparse_argument_errors():
    f = go.varlen_attention
    q = np.zeros((10, 4, 8), np.float32)
    kv = np.zeros((12, 2, 8), np.float32)
    cq, ck = np.array([0, 4, 10], np.int32), np.array([0, 5, 12], np.int32)
    with pytest.raises(ValueError, match="'q' must be 3-d"):
        f(q[None], kv, kv, cq, ck, 6, 7)
    with pytest.raises(ValueError, match="'q' heads \\(4\\) must be a multiple of 'k' heads"):
        f(q, kv[:, :1].repeat(3, 1), kv[:, :1].repeat(3, 1), cq, ck, 6, 7)
    with pytest.raises(ValueError, match="'v' has shape"):
        f(q, kv, kv[:, :, :4], cq, ck, 6, 7)
    with pytest.raises(ValueError, match="'cu_seqlens_q' has shape \\(3,\\) but 'cu_seqlens_k'"):
        f(q, kv, kv, cq, np.array([0, 12], np.int32), 6, 12)
    with pytest.raises(ValueError, match="'cu_seqlens_k' must be 1-d"):
        f(q, kv, kv, cq, ck[None], 6, 7)
    with pytest.raises(TypeError, match="'cu_seqlens_q' has dtype int64"):
        f(q, kv, kv, cq.astype(np.int64), ck, 6, 7)
    with pytest.raises(TypeError, match="'max_seqlen_q' must be a Python int"):
        f(q, kv, kv, cq, ck, 6.0, 7)
    with pytest.raises(ValueError, match="'max_seqlen_k' must be >= 0"):
        f(q, kv, kv, cq, ck, 6, -1)
    with pytest.raises(ValueError, match="max_seqlen_q = 5"):
        f(q, kv, kv, cq, ck, 5, 7)
    with pytest.raises(ValueError, match="'cu_seqlens_q' = \\[0, 4, 9\\] must start at 0 and end"):
        f(q, kv, kv, np.array([0, 4, 9], np.int32), ck, 6, 7)
    with pytest.raises(ValueError, match="'cu_seqlens_k' = \\[0, 13, 12\\] must be non-decreasing"):
        f(q, kv, kv, cq, np.array([0, 13, 12], np.int32), 6, 13)
    with pytest.raises(ValueError, match="'rotary_cos' given without 'rotary_sin'"):
        f(q, kv, kv, cq, ck, 6, 7, rotary_cos=np.zeros((7, 4), np.float32))
    with pytest.raises(ValueError, match="'rotary_cos' has 6 rows but positions go up to 6"):
        f(q, kv, kv, cq, ck, 6, 7, rotary_cos=np.zeros((6, 4), np.float32),
          rotary_sin=np.zeros((6, 4), np.float32))
    with pytest.raises(ValueError, match="the rotary dim 2 x 5 must be in \\[2, 8\\]"):
        f(q, kv, kv, cq, ck, 6, 7, rotary_cos=np.zeros((7, 5), np.float32),
          rotary_sin=np.zeros((7, 5), np.float32))
    with pytest.raises(TypeError, match="'rotary_interleaved' must be a bool"):
        f(q, kv, kv, cq, ck, 6, 7, rotary_interleaved=1)
    with pytest.raises(ValueError, match="'variant' must be one of"):
        f(q, kv, kv, cq, ck, 6, 7, variant="fast")
    g = go.block_sparse_attention
    q4 = np.zeros((2, 4, 10, 8), np.float32)
    kv4 = np.zeros((2, 2, 12, 8), np.float32)
    bm = np.ones((1, 4, 3, 3), bool)
    with pytest.raises(ValueError, match="'block_mask' has shape \\(1, 4, 3, 2\\); expected"):
        g(q4, kv4, kv4, bm[..., :2], 4)
    with pytest.raises(ValueError, match="'block_mask' has shape"):
        g(q4, kv4, kv4, np.ones((1, 2, 3, 3), bool), 4)
    with pytest.raises(TypeError, match="'block_mask' has dtype float32"):
        g(q4, kv4, kv4, bm.astype(np.float32), 4)
    with pytest.raises(ValueError, match="'block_size' must be >= 1"):
        g(q4, kv4, kv4, bm, 0)
    with pytest.raises(TypeError, match="'block_size' must be an int"):
        g(q4, kv4, kv4, bm, 4.0)
    with pytest.raises(ValueError, match="'k' has batch 1"):
        g(q4, kv4[:1], kv4[:1], bm, 4)
    with pytest.raises(TypeError, match="'is_causal' must be a bool"):
        g(q4, kv4, kv4, bm, 4, is_causal=None)
    s = go.scaled_dot_product_attention
    with pytest.raises(ValueError, match="'rotary_cos' has shape \\(12, 4\\) but 'rotary_sin'"):
        s(q4, kv4, kv4, enable_gqa=True, rotary_cos=np.zeros((12, 4), np.float32),
          rotary_sin=np.zeros((12, 3), np.float32))
    with pytest.raises(ValueError, match="'rotary_cos' must be 2-d"):
        s(q4, kv4, kv4, enable_gqa=True, rotary_cos=np.zeros((1, 12, 4), np.float32),
          rotary_sin=np.zeros((1, 12, 4), np.float32))


@needs_torch
def test_cpu_fallback_varlen_and_block_sparse_torch(rng):
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    q, k, v = (torch.randn(10, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    out, lse = go.varlen_attention(q, k, v, cu, cu, 7, 7, is_causal=True, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (2, 10)
    exp = ref_varlen(q.double().numpy(), k.double().numpy(), v.double().numpy(), cu.numpy(),
                     cu.numpy(), 7, 7, True)
    np.testing.assert_allclose(out.double().numpy(), exp, rtol=8e-3, atol=1e-5)
    q4, k4, v4 = (torch.randn(1, 2, 20, 16) for _ in range(3))
    bm = torch.rand(1, 1, 3, 3) > 0.5
    out = go.block_sparse_attention(q4, k4, v4, bm, 8)
    exp = ref_sparse(q4.double().numpy(), k4.double().numpy(), v4.double().numpy(), bm.numpy(), 8)
    np.testing.assert_allclose(out.double().numpy(), exp, rtol=1e-5, atol=1e-6)


def test_variants_without_extras_send_auto_to_mma_and_refuse_them(monkeypatch):
    """'simt' and 'mma' read the appended fields (varlen, block mask, rotary); 'wgmma' reads the
    block mask and refuses the others in its launcher (wgmma_unsupported). So 'auto' reaches its
    own launcher (wgmma first, then 'mma') for every call, and an explicit variant is its own
    launcher. Were a variant to lose that support, 'auto' would go to the best of those left and
    naming it would be an error."""
    exts = (at.FlashExtras(cu_q=1, cu_k=1), at.FlashExtras(block_mask=1, block_size=64),
            at.FlashExtras(rot_half=4))
    assert "wgmma" in at._AUTO_PICKS and "wgmma" in at._EXTRAS_VARIANTS
    assert at._variant_launcher(at.OP, "auto", at.NO_EXTRAS) is at._launch_auto
    assert at._variant_launcher(at.OP, "wgmma", at.NO_EXTRAS) is at._launch_wgmma
    for ext in exts:
        assert at._variant_launcher(at.OP, "auto", ext) is at._launch_auto
        assert at._variant_launcher(at.OP, "wgmma", ext) is at._launch_wgmma
        assert at._variant_launcher(at.OP, "mma", ext) is at._launch_best
        assert at._variant_launcher(at.OP, "simt", ext) is at._launch_simt
    monkeypatch.setattr(at, "_EXTRAS_VARIANTS", {"simt", "mma"})
    for ext in exts:
        assert at._variant_launcher(at.OP, "auto", ext) is at._launch_best
        with pytest.raises(ValueError, match="variant='wgmma' does not support varlen"):
            at._variant_launcher(at.VARLEN_OP, "wgmma", ext)
    monkeypatch.setattr(at, "_EXTRAS_VARIANTS", {"simt"})
    for ext in exts:
        assert at._variant_launcher(at.OP, "auto", ext) is at._launch_simt
        with pytest.raises(ValueError, match="variant='mma' does not support varlen"):
            at._variant_launcher(at.VARLEN_OP, "mma", ext)


def _problem(B=1, Hq=2, Hkv=2, Sq=300, Sk=300, D=128, scale=0.1, left=-1, right=0,
             bottom_right=False):
    return at.Problem(B, Hq, Hkv, Sq, Sk, D, scale, left, right, bottom_right)


def test_wgmma_takes_only_what_its_kernel_has(monkeypatch):
    """wgmma_unsupported names why the Hopper kernel cannot take a call (None: it can): 16-bit
    dtypes, head dims 64 / 128, no attn_mask, no varlen / rotary / bottom-right diagonal, block
    sparsity only with blocks a multiple of 64 (and no window: the sparse op has only causal),
    a positive scale, keys present, an sm_90 device."""
    monkeypatch.setattr(at, "wgmma_device", lambda dev: True)
    bf, f16 = dt.bfloat16, dt.float16
    assert at.wgmma_unsupported(FakeCall(bf), _problem(), None, at.NO_EXTRAS) is None
    assert at.wgmma_unsupported(FakeCall(f16), _problem(D=64), None, at.NO_EXTRAS) is None
    for bs in (64, 128, 192, 512):
        sparse = at.FlashExtras(block_mask=1, block_size=bs)
        assert at.wgmma_unsupported(FakeCall(bf), _problem(), None, sparse) is None
        assert at.wgmma_unsupported(FakeCall(bf), _problem(right=-1), None, sparse) is None
    cases = [((dt.float32, _problem(), None, at.NO_EXTRAS), "dtype"),
             ((bf, _problem(), None, at.FlashExtras(block_mask=1, block_size=32)),
              "block_size 32"),
             ((bf, _problem(), None, at.FlashExtras(block_mask=1, block_size=96)),
              "block_size 96"),
             ((bf, _problem(left=100), None, at.FlashExtras(block_mask=1, block_size=64)),
              "block_size 64"),
             ((bf, _problem(), None, at.FlashExtras(cu_q=1, cu_k=1)), "varlen"),
             ((bf, _problem(D=96), None, at.NO_EXTRAS), "head dim 96"),
             ((bf, _problem(D=256), None, at.NO_EXTRAS), "head dim 256"),
             ((bf, _problem(), object(), at.NO_EXTRAS), "attn_mask"),
             ((bf, _problem(), None, at.FlashExtras(rot_half=4)), "rotary"),
             ((bf, _problem(bottom_right=True), None, at.NO_EXTRAS), "varlen"),
             ((bf, _problem(scale=0.0), None, at.NO_EXTRAS), "scale"),
             ((bf, _problem(scale=-1.0), None, at.NO_EXTRAS), "scale"),
             ((bf, _problem(Sk=0), None, at.NO_EXTRAS), "empty key"),
             ((bf, _problem(B=2, Hq=2 ** 16, Hkv=2 ** 16, Sq=2 ** 21), None, at.NO_EXTRAS),
              "2^31"),
             ]
    for (dtype, p, mask, ext), why in cases:
        got = at.wgmma_unsupported(FakeCall(dtype), p, mask, ext)
        assert got is not None and why in got, (why, got)
    monkeypatch.setattr(at, "wgmma_device", lambda dev: False)
    assert "sm_90" in at.wgmma_unsupported(FakeCall(bf), _problem(), None, at.NO_EXTRAS)


def test_wgmma_routing(monkeypatch):
    """'auto' launches the wgmma kernel when it applies and its tensor maps exist (WGMMA_AUTO),
    else goes on as 'mma'; an explicit 'wgmma' raises with the reason instead of falling back."""
    log = []
    monkeypatch.setattr(at, "wgmma_device", lambda dev: True)
    monkeypatch.setattr(at, "_launch_wgmma_maps", lambda *a: log.append("wgmma"))
    monkeypatch.setattr(at, "_launch_best", lambda *a: log.append("mma"))
    maps = ["maps"]
    monkeypatch.setattr(at, "_wgmma_maps", lambda *a: maps[0])
    call, p = FakeCall(dt.bfloat16), _problem()
    args = (None, None, None, None, 0, None, None, "bhsd")
    at._launch_auto(call, p, *args)
    at._launch_auto(call, _problem(D=96), *args)
    maps[0] = None                           # e.g. a stride TMA cannot take
    at._launch_auto(call, p, *args)
    monkeypatch.setattr(at, "WGMMA_AUTO", False)
    maps[0] = "maps"
    at._launch_auto(call, p, *args)
    assert log == ["wgmma", "mma", "mma", "mma"]
    log.clear()
    at._launch_wgmma(call, p, *args)         # explicit: WGMMA_AUTO does not matter
    assert log == ["wgmma"]
    with pytest.raises(ValueError, match="variant='wgmma' does not take head dim 96"):
        at._launch_wgmma(call, _problem(D=96), *args)
    maps[0] = None
    with pytest.raises(ValueError, match="variant='wgmma' does not take q, k, v or out in a "
                                         "layout TMA cannot read"):
        at._launch_wgmma(call, p, *args)
    assert log == ["wgmma"]


def test_wgmma_head_chunks_fit_the_l2_budget():
    """The grid's (b x h) chunks, causal / windowed: K / V of a chunk's heads within
    WGMMA_L2_BUDGET (GQA: group query heads share one K / V), at least one head, at most all of
    them; full rows: one head at a time."""
    kv = 2 * 4096 * 128 * 2                                 # one kv head, S 4096, D 128: 2 MiB
    assert at.wgmma_head_chunk(_problem(B=4, Hq=32, Hkv=32, Sk=4096, right=-1)) == 1
    assert at.wgmma_head_chunk(_problem(B=4, Hq=32, Hkv=32, Sk=4096, left=100, right=-1)) > 1
    assert at.wgmma_head_chunk(_problem(B=1, Hq=32, Hkv=32, Sk=4096)) == at.WGMMA_L2_BUDGET // kv
    assert at.wgmma_head_chunk(_problem(B=1, Hq=32, Hkv=8, Sk=4096)) == 32     # capped: B x Hq
    assert at.wgmma_head_chunk(_problem(B=4, Hq=32, Hkv=8, Sk=4096)) == \
        at.WGMMA_L2_BUDGET // kv * 4
    assert at.wgmma_head_chunk(_problem(B=1, Hq=8, Hkv=8, Sk=2 ** 20)) == 1    # huge heads
    assert at.wgmma_head_chunk(_problem(B=1, Hq=1, Hkv=1, Sk=1, D=64)) == 1


def test_wgmma_tensor_maps(monkeypatch):
    """_tma_map's 4-D description (d, s, h, b) of 'bhsd' and 'bshd' operands: extents, byte
    strides (a dim of extent 1 gets a valid stride), the box; None for what TMA cannot read."""
    from gpuops.runtime import tma  # noqa: PLC0415
    got = []
    monkeypatch.setattr(tma, "encode_tiled", lambda *a: got.append(a) or "map")

    class T:
        def __init__(self, shape, strides, ptr=4096, dtype=dt.bfloat16):
            self.shape, self.strides, self.ptr, self.dtype = shape, strides, ptr, dtype
    B, H, S, D = 2, 3, 100, 128
    bhsd = T((B, H, S, D), (H * S * D, S * D, D, 1))
    assert at._tma_map(bhsd, "bhsd", (B, H, S, D), 128) == "map"
    assert got[-1] == (4096, tma.DTYPE_UINT16, (D, S, H, B), [2 * D, 2 * S * D, 2 * H * S * D],
                       (64, 128, 1, 1))
    bshd = T((B, S, H, D), (S * H * D, H * D, D, 1))
    assert at._tma_map(bshd, "bshd", (B, H, S, D), 64) == "map"
    assert got[-1][3:] == ([2 * H * D, 2 * D, 2 * S * H * D], (64, 64, 1, 1))
    one = T((1, 1, S, D), (0, 0, D, 1))      # broadcast batch / head: strides replaced
    assert at._tma_map(one, "bhsd", (1, 1, S, D), 64) == "map"
    assert got[-1][3] == [2 * D, 2 * D, 2 * D]
    n = len(got)
    assert at._tma_map(T((B, H, S, D), (H * S * D, S * D, D, 1), ptr=4104), "bhsd",
                       (B, H, S, D), 64) is None                        # base not 16-aligned
    assert at._tma_map(T((B, H, S, D), (H * S * D, S * D, 1, S)), "bhsd",
                       (B, H, S, D), 64) is None                        # d not contiguous
    assert at._tma_map(T((B, H, S, 64), (H * S * 68, S * 68, 68, 1)), "bhsd",
                       (B, H, S, 64), 64) is None                       # 136-byte rows
    assert len(got) == n


def test_vec_flag_with_rotary_needs_whole_packs():
    ext = at.FlashExtras(rot_half=8)
    assert at._rotary_vec_ok(dt.bfloat16, ext) and at._rotary_vec_ok(dt.float32, ext)
    assert not at._rotary_vec_ok(dt.bfloat16, at.FlashExtras(rot_half=4))     # partner off a pack
    assert at._rotary_vec_ok(dt.bfloat16, at.FlashExtras(rot_half=4, rot_interleaved=True))
    assert not at._rotary_vec_ok(dt.bfloat16, at.FlashExtras(rot_half=6, rot_interleaved=True))
    assert at._rotary_vec_ok(dt.float32, at.FlashExtras(rot_half=6, rot_interleaved=True))
    assert at._rotary_vec_ok(dt.float16, at.NO_EXTRAS)


# ----------------------------------------------------------------------------- CPU: the kernel

def _emu_call(dev, op, dtype):
    from emu import Call as EmuCall  # noqa: PLC0415
    return EmuCall(dev, op, dt.BY_NAME[dtype])


def _emu_varlen(dev, q, k, v, cq, ck, mq, mk, *, dtype, is_causal=False, scale=None,
                window_size=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                variant="simt"):
    t = [dev.tensor(x) for x in (q, k, v)]
    rc = None if rotary_cos is None else dev.tensor(rotary_cos)
    rs = None if rotary_sin is None else dev.tensor(rotary_sin)
    out, lse = at._varlen_forward(_emu_call(dev, at.VARLEN_OP, dtype), *t,
                                  dev.tensor(np.asarray(cq, np.int32)),
                                  dev.tensor(np.asarray(ck, np.int32)), mq, mk, is_causal, scale,
                                  window_size, True, rc, rs, rotary_interleaved, variant)
    return out.obj, lse.obj


def varlen_bound(q, k, v, cq, ck, *, dtype, is_causal=False, window_size=None, **kw):
    """Reference and error bounds of a packed batch: attn_bound per sequence, with the
    bottom-right visibility as an explicit mask."""
    T, Hq, D = q.shape
    exp, bound = np.zeros((T, Hq, D)), np.zeros((T, Hq, D))
    lse, lbound = np.full((Hq, T), -np.inf), np.zeros((Hq, T))
    for b in range(len(cq) - 1):
        sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if sq == 0:
            continue
        mask = _bottom_right_mask(sq, sk, is_causal, window_size)
        o, l, bo, bl = attn_bound(_seq(q, cq, b), _seq(k, ck, b), _seq(v, ck, b), mask,
                                  dtype=dtype, enable_gqa=True, **kw)
        exp[cq[b]:cq[b + 1]] = o[0].transpose(1, 0, 2)
        bound[cq[b]:cq[b + 1]] = np.broadcast_to(bo, o.shape)[0].transpose(1, 0, 2)
        lse[:, cq[b]:cq[b + 1]] = l[0]
        lbound[:, cq[b]:cq[b + 1]] = np.broadcast_to(bl, l.shape)[0]
    return exp, lse, bound, lbound


# (lengths q, lengths k or None (= q), Hq, Hkv, D, smem KB, max_seqlen extra, options)
EMU_VARLEN_CASES = [
    ([70, 0, 1, 33, 64, 5], None, 2, 2, 64, 227, 0, {"is_causal": True}),
    ([17, 90, 1], [40, 12, 0], 4, 2, 64, 48, 30, {"is_causal": True}),      # sq != sk, grid > max
    ([40, 7], [40, 55], 2, 1, 128, 227, 0, {"window_size": (9, 3)}),
    ([33, 20, 0, 2], None, 2, 2, 32, 227, 0, {"window_size": (5, -1), "is_causal": True,
                                              "scale": 0.3}),
    ([30, 45], [50, 45], 4, 2, 40, 48, 0, {"is_causal": True}),             # general head dim
    ([65, 3, 12], None, 2, 1, 64, 227, 0, {"is_causal": True, "rotary": (32, False, "same")}),
    ([20, 41], [41, 41], 2, 2, 96, 48, 0, {"rotary": (16, True, "float32")}),
    ([36, 9], None, 2, 2, 40, 48, 0, {"rotary": (20, False, "same"), "is_causal": True}),
]


@needs_emu
@pytest.mark.parametrize("case", EMU_VARLEN_CASES,
                         ids=lambda c: f"D{c[4]}-{c[5]}k-{c[0]}-{c[1]}-{sorted(c[7])}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_varlen(case, dtype, rng, monkeypatch):
    lq, lk, Hq, Hkv, D, kb, extra, opt = case
    lk = lq if lk is None else lk
    opt = dict(opt)
    monkeypatch.setattr(at, "smem_limit", lambda dev: kb * 1024)
    cq, ck = _cu(lq), _cu(lk)
    q = _rand(rng, (cq[-1], Hq, D), dtype)
    k, v = (_rand(rng, (ck[-1], Hkv, D), dtype) for _ in range(2))
    rot = opt.pop("rotary", None)
    if rot is not None:
        cos, sin = _tables(max(lq + lk) + 3, rot[0], dtype if rot[2] == "same" else rot[2])
        opt.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rot[1])
    with emu.Device(sms=2) as dev:
        out, lse = _emu_varlen(dev, q, k, v, cq, ck, max(lq) + extra, max(lk) + extra,
                               dtype=dtype, **opt)
    exp, exp_lse, bound, lbound = varlen_bound(q, k, v, cq, ck, dtype=dtype, **opt)
    check(out, exp, bound, f"out {case} {dtype}")
    check(lse, exp_lse, lbound, f"lse {case} {dtype}")


# (B, Hq, Hkv, Sq, Sk, D, smem KB, block_size, mask batch, mask heads, options)
EMU_SPARSE_CASES = [
    (1, 2, 2, 130, 130, 64, 227, 64, 1, 2, {}),                 # tile = block: skip per tile
    (2, 4, 2, 70, 100, 64, 227, 16, 2, 1, {"is_causal": True}),  # 16 blocks per tile: mixed
    (1, 2, 1, 77, 90, 128, 48, 48, 1, 1, {}),                   # tiles 32: straddle blocks
    (1, 2, 2, 50, 140, 32, 227, 100, 1, 2, {"is_causal": True}),
    (1, 1, 1, 40, 75, 40, 48, 8, 1, 1, {}),                      # general head dim
]


@needs_emu
@pytest.mark.parametrize("case", EMU_SPARSE_CASES,
                         ids=lambda c: f"D{c[5]}-bs{c[7]}-{sorted(c[10])}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_block_sparse(case, dtype, rng, monkeypatch):
    B, Hq, Hkv, Sq, Sk, D, kb, bs, mb, mh, opt = case
    monkeypatch.setattr(at, "smem_limit", lambda dev: kb * 1024)
    q = _rand(rng, (B, Hq, Sq, D), dtype)
    k, v = (_rand(rng, (B, Hkv, Sk, D), dtype) for _ in range(2))
    nq, nk = -(-Sq // bs), -(-Sk // bs)
    bm = rng.random((mb, mh, nq, nk)) > 0.5
    bm[..., nq // 2, :] = False                                # a block row that sees nothing
    with emu.Device(sms=2) as dev:
        out, lse = at._sparse_forward(_emu_call(dev, at.SPARSE_OP, dtype),
                                      *(dev.tensor(x) for x in (q, k, v, bm)), bs,
                                      opt.get("is_causal", False), None, True, "simt")
        out, lse = out.obj, lse.obj
    mask = at.expand_block_mask(bm, bs, Sq, Sk)
    exp, exp_lse, bound, lbound = attn_bound(q, k, v, mask, dtype=dtype, enable_gqa=True, **opt)
    check(out, exp, bound, f"out {case} {dtype}")
    check(lse, exp_lse, lbound, f"lse {case} {dtype}")
    dead = nq // 2 * bs
    assert np.all(out[:, :, dead:dead + bs] == 0) and np.all(np.isneginf(lse[:, :, dead:dead + bs]))


@needs_emu
@pytest.mark.parametrize("bs", [64, 32])
def test_emulated_block_sparse_skips_tiles_without_loading_them(bs, rng, monkeypatch):
    """NaN in the keys and values of a key block that is off everywhere: a tile that were loaded
    would spread it (0 x NaN in P V); skipped tiles leave every output finite."""
    monkeypatch.setattr(at, "smem_limit", lambda dev: 227 * 1024)      # 64 x 64 tiles
    q, k, v = (_rand(rng, (1, 2, 128, 64), "float32") for _ in range(3))
    bm = np.ones((1, 1, 128 // bs, 128 // bs), bool)
    off = slice(64, 128)                                    # the second 64-key tile
    bm[..., off.start // bs:] = False
    k[:, :, off], v[:, :, off] = np.nan, np.nan
    with emu.Device(sms=2) as dev:
        out = at._sparse_forward(_emu_call(dev, at.SPARSE_OP, "float32"),
                                 *(dev.tensor(x) for x in (q, k, v, bm)), bs, False, None, False,
                                 "auto").obj
    exp, _, bound, _ = attn_bound(q, k[:, :, :64], v[:, :, :64], dtype="float32")
    check(out, exp, bound, "skipped tiles")


EMU_ROTARY_CASES = [
    # (Sq, Sk, Hq, Hkv, D, smem KB, half, interleaved, table dtype, layout / view)
    (37, 37, 2, 2, 64, 227, 32, False, "same", "bhsd"),          # vector loads, partner pack
    (20, 45, 4, 2, 128, 48, 32, True, "float32", "bshd"),         # partial rotary, GPT-J
    (33, 33, 2, 2, 64, 227, 12, False, "same", "bhsd"),           # half % 8 != 0: element loads
    (29, 40, 2, 1, 96, 227, 24, False, "float32", "offset"),      # misaligned rows
    (21, 30, 2, 2, 40, 48, 20, False, "same", "bhsd"),            # general: partner in other chunk
    (21, 30, 2, 2, 40, 48, 16, True, "same", "bhsd"),
]


@needs_emu
@pytest.mark.parametrize("case", EMU_ROTARY_CASES,
                         ids=lambda c: f"D{c[4]}-R{2 * c[6]}-{c[7]}-{c[9]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_sdpa_with_rotary(case, dtype, rng, monkeypatch):
    Sq, Sk, Hq, Hkv, D, kb, half, interleaved, tdt, view = case
    monkeypatch.setattr(at, "smem_limit", lambda dev: kb * 1024)
    layout = "bshd" if view == "bshd" else "bhsd"
    shp = (lambda h, s: (1, h, s, D)) if layout == "bhsd" else (lambda h, s: (1, s, h, D))
    q, k, v = _rand(rng, shp(Hq, Sq), dtype), _rand(rng, shp(Hkv, Sk), dtype), \
        _rand(rng, shp(Hkv, Sk), dtype)
    if view == "offset":
        q, k, v = (emu.strided(x, "offset") for x in (q, k, v))
    cos, sin = _tables(max(Sq, Sk) + 5, half, dtype if tdt == "same" else tdt)
    kw = dict(is_causal=True, enable_gqa=Hq != Hkv, layout=layout, rotary_cos=cos,
              rotary_sin=sin, rotary_interleaved=interleaved)
    with emu.Device(sms=2) as dev:
        t = [dev.tensor(x) for x in (q, k, v)]
        out, lse = at._forward(_emu_call(dev, at.OP, dtype), *t, None, True, None,
                               kw["enable_gqa"], None, True, layout, "simt", dev.tensor(cos),
                               dev.tensor(sin), interleaved)
        out, lse = out.obj, lse.obj
        vec = dev.launches[-1]
    exp, exp_lse, bound, lbound = attn_bound(q, k, v, dtype=dtype, **kw)
    check(out, exp, bound, f"out {case} {dtype}")
    check(lse, exp_lse, lbound, f"lse {case} {dtype}")
    plain, _, _, _ = attn_bound(q, k, v, dtype=dtype, is_causal=True, enable_gqa=Hq != Hkv,
                                layout=layout)
    assert np.abs(plain - exp).max() > 1e-2                  # the tables mattered
    assert vec[0].startswith("gpuops::flash_fwd<")


@needs_emu
def test_emulated_varlen_odd_row_stride_takes_element_loads(rng, monkeypatch):
    """Packed rows start at device offsets times the row stride: with an odd row stride no row
    but the first is 16-byte aligned, even when max_seqlen_q = 1 (one row per sequence)."""
    monkeypatch.setattr(at, "smem_limit", lambda dev: 227 * 1024)
    seen = []
    builder = at.flash_launch_args
    monkeypatch.setattr(at, "flash_launch_args", lambda *a, **k: (seen.append(a[9]),
                                                                  builder(*a, **k))[1])
    T, H, D = 5, 2, 64
    buf = _rand(rng, (T * (H * D + 1),), "float16")
    q = np.lib.stride_tricks.as_strided(buf, (T, H, D), ((H * D + 1) * 2, D * 2, 2))
    k, v = (_rand(rng, (T, H, D), "float16") for _ in range(2))
    cu = _cu([1] * T)
    with emu.Device(sms=2) as dev:
        out, lse = _emu_varlen(dev, q, k, v, cu, cu, 1, 1, dtype="float16")
        assert seen == [False]
        _emu_varlen(dev, np.ascontiguousarray(q), k, v, cu, cu, 1, 1, dtype="float16")
        assert seen == [False, True]
    exp, exp_lse, bound, lbound = varlen_bound(q, k, v, cu, cu, dtype="float16")
    check(out, exp, bound, "odd row stride")


@needs_emu
def test_emulated_varlen_rotary_past_the_table_reads_nan(rng, monkeypatch):
    """A key sequence longer than max_seqlen_k (a broken precondition the GPU cannot see) runs
    past the rotary table: those keys' rotated elements are NaN, so the rows that see them are
    NaN, not silently wrong; rows that see only keys inside the table are unaffected."""
    monkeypatch.setattr(at, "smem_limit", lambda dev: 227 * 1024)
    q = _rand(rng, (8, 2, 32), "float32")
    k, v = (_rand(rng, (12, 2, 32), "float32") for _ in range(2))
    cq, ck = _cu([8]), _cu([12])
    cos, sin = _tables(8, 16)                              # rows 0..7: keys 8..11 are past it
    with emu.Device(sms=2) as dev:
        out, _ = _emu_varlen(dev, q, k, v, cq, ck, 8, 8, dtype="float32", is_causal=True,
                             rotary_cos=cos, rotary_sin=sin)
    # bottom-right causal with sq = 8, sk = 12: row i sees keys j <= i + 4, i.e. key 8 from row 4
    assert np.all(np.isfinite(out[:4])) and np.all(np.isnan(out[4:]))


# ----------------------------------------------------------------------------- CPU: mma + extras
# The tensor-core kernel with packed sequences, block sparsity and rotary (its EXTRAS
# instantiations: MMA_VARLEN, MMA_SPARSE, MMA_VARLEN | MMA_ROTARY): small shapes in the emulator
# against the float64 reference with the mma bound; each case names its dtype (fp16 and bf16
# alternate).

def _rope_like_mma(x, cos, sin, interleaved, dtype):
    """x [..., S, D] (row s at position s) rotated as the mma kernel rotates its shared tiles:
    the SIMT kernel's fp32 fmas (x c - fl(y s), y c + fl(x s), one rounding each: the products
    of a 16-bit value and an fp32 table entry are exact in float64), then rounded to the
    storage dtype."""
    x = np.asarray(x, np.float64)
    S = x.shape[-2]
    c, s = (np.asarray(t, np.float64)[:S] for t in (cos, sin))
    half = c.shape[-1]
    ia, ib = ((slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved
              else (slice(0, half), slice(half, 2 * half)))
    f32 = lambda t: t.astype(np.float32).astype(np.float64)  # noqa: E731
    a, b = x[..., ia].copy(), x[..., ib].copy()
    x[..., ia] = f32(a * c - f32(b * s))
    x[..., ib] = f32(b * c + f32(a * s))
    return x.astype(np.float32).astype(_np_dtype(dtype))


def _kernel_names():
    return [name for name, *_ in emu.Device.launches]


def _mma_name(dtype, D, extras, masked=False):
    return at.mma_expr(dt.BY_NAME[dtype], D, at.mma_config(D, masked, extras), masked, extras)


def _rotary_names(dtype, D, half, interleaved, form, varlen=False):
    """The launches of an mma call with rotary tables under PLAN["rotary"] = form: the in-loop
    instantiation (varlen + rotary, also for dense calls), or the K pre-pass (16-byte packs
    where the rotated part splits into whole packs, else one element) and the Q-only one
    (where instantiated: MMA_EXTRAS_MISSING, else the in-loop one)."""
    q_only = (at.MMA_VARLEN if varlen else 0) | at.MMA_ROTARY_Q
    if form == "in_loop" or q_only in at.MMA_EXTRAS_MISSING.get(D, ()):
        return [_mma_name(dtype, D, at.MMA_VARLEN | at.MMA_ROTARY)]
    d = dt.BY_NAME[dtype]
    v = 8 if at._rotary_vec_ok(d, at.FlashExtras(rot_half=half,
                                                 rot_interleaved=interleaved)) else 1
    return [at.rope_k_expr(d, v), _mma_name(dtype, D, q_only)]


# (lengths q, lengths k or None (= q), Hq, Hkv, D, max_seqlen extra, options, dtype)
EMU_MMA_VARLEN_CASES = [
    ([70, 0, 1, 33, 5], None, 2, 2, 64, 0, {"is_causal": True}, "bfloat16"),
    # sq < sk and sq > sk (the diagonal's shift both ways), grid past the longest
    ([17, 90, 1], [40, 12, 0], 4, 2, 64, 30, {"is_causal": True}, "float16"),
    ([40, 7], [40, 70], 2, 1, 128, 0, {"window_size": (9, 3)}, "bfloat16"),
    ([33, 20, 0, 2], None, 2, 2, 32, 0, {"window_size": (5, -1), "is_causal": True,
                                         "scale": 0.3}, "float16"),
    ([65, 3, 12], None, 2, 1, 64, 0, {"is_causal": True, "rotary": (32, False, "same")},
     "bfloat16"),
    ([20, 41], [41, 41], 2, 2, 96, 0, {"rotary": (16, True, "float32")}, "float16"),
    # rotary half 18: one pair per item (GPT-NeoX partner not 8-byte aligned); sq <> sk
    ([36, 9], [20, 30], 2, 2, 128, 0, {"rotary": (18, False, "same"), "is_causal": True},
     "bfloat16"),
    # D = 256: varlen on MMA_TILES' BC 64, varlen + rotary on MMA_EXTRAS_TILES' BC 32
    ([40, 7], [20, 70], 2, 1, 256, 0, {"is_causal": True}, "float16"),
    ([45, 5], None, 2, 2, 256, 0, {"rotary": (64, True, "float32"), "is_causal": True},
     "bfloat16"),
]


@needs_emu
@pytest.mark.parametrize("case", EMU_MMA_VARLEN_CASES,
                         ids=lambda c: f"D{c[4]}-{c[0]}-{c[1]}-{sorted(c[6])}-{c[7]}")
def test_emulated_mma_varlen(case, rng, monkeypatch):
    lq, lk, Hq, Hkv, D, extra, opt, dtype = case
    lk = lq if lk is None else lk
    opt = dict(opt)
    monkeypatch.setattr(at, "tensor_cores", lambda dev: True)
    cq, ck = _cu(lq), _cu(lk)
    q = _rand(rng, (cq[-1], Hq, D), dtype)
    k, v = (_rand(rng, (ck[-1], Hkv, D), dtype) for _ in range(2))
    rot = opt.pop("rotary", None)
    if rot is not None:
        cos, sin = _tables(max(lq + lk) + 3, rot[0], dtype if rot[2] == "same" else rot[2])
        opt.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rot[1])
    q0, k0 = q.copy(), k.copy()
    with emu.Device(sms=2) as dev:
        out, lse = _emu_varlen(dev, q, k, v, cq, ck, max(lq) + extra, max(lk) + extra,
                               dtype=dtype, variant="auto", **opt)
        names = _kernel_names()
        if rot is not None:       # the other rotary form: the same bits
            other = "in_loop" if at.PLAN["rotary"] == "prepass" else "prepass"
            forms = {at.PLAN["rotary"]: names}
            monkeypatch.setitem(at.PLAN, "rotary", other)
            emu.Device.launches.clear()
            out2, lse2 = _emu_varlen(dev, q, k, v, cq, ck, max(lq) + extra, max(lk) + extra,
                                     dtype=dtype, variant="auto", **opt)
            forms[other] = _kernel_names()
            np.testing.assert_array_equal(out, out2)
            np.testing.assert_array_equal(lse, lse2)
    if rot is None:
        assert names == [_mma_name(dtype, D, at.MMA_VARLEN)]
    else:
        for form, seen in forms.items():
            assert seen == _rotary_names(dtype, D, rot[0], rot[1], form, varlen=True), form
    np.testing.assert_array_equal(q, q0)      # q and k are never written (rotated or not)
    np.testing.assert_array_equal(k, k0)
    exp, exp_lse, bound, lbound = varlen_bound(q, k, v, cq, ck, dtype=dtype, mma=True, **opt)
    check(out, exp, bound, f"out {case}")
    check(lse, exp_lse, lbound, f"lse {case}")


@needs_emu
def test_emulated_mma_varlen_matches_dense_per_sequence(rng, monkeypatch):
    """With sq == sk the packed call computes what the dense kernel computes per sequence (the
    varlen instantiation: same tiles, same order): bit-equal outputs and lse; rows of one
    sequence never see another's keys."""
    monkeypatch.setattr(at, "tensor_cores", lambda dev: True)
    lengths = [70, 1, 33]
    cu = _cu(lengths)
    q, k, v = (_rand(rng, (cu[-1], 2, 64), "bfloat16") for _ in range(3))
    with emu.Device(sms=2) as dev:
        out, lse = _emu_varlen(dev, q, k, v, cu, cu, 70, 70, dtype="bfloat16", is_causal=True,
                               variant="mma")
        for b in range(3):
            o, l_ = _emu_run(dev, *(x[cu[b]:cu[b + 1]][None] for x in (q, k, v)),
                             dtype="bfloat16", is_causal=True, layout="bshd", variant="mma")
            np.testing.assert_array_equal(out[cu[b]:cu[b + 1]], o[0])
            np.testing.assert_array_equal(lse[:, cu[b]:cu[b + 1]], l_[0])
        assert _kernel_names() == [_mma_name("bfloat16", 64, at.MMA_VARLEN)] + \
            [_mma_name("bfloat16", 64, at.MMA_PLAIN)] * 3


# (B, Hkv, Sk, D, half, interleaved, table dtype, layout, dtype): the K pre-pass alone
EMU_ROPE_K_CASES = [
    (2, 3, 70, 64, 32, False, "same", "bhsd", "bfloat16"),       # 16-byte packs + partner
    (1, 2, 65, 128, 32, True, "float32", "bshd", "float16"),     # partial, GPT-J packs
    (1, 2, 33, 64, 10, False, "float32", "bhsd", "bfloat16"),    # one element: partner unaligned
    (2, 1, 40, 32, 5, True, "same", "bshd", "float16"),          # GPT-J single pairs, partial
    (1, 1, 130, 96, 48, False, "float32", "bshd", "bfloat16"),   # full rotary, 3 row blocks
]


@needs_emu
@pytest.mark.parametrize("case", EMU_ROPE_K_CASES,
                         ids=lambda c: f"D{c[3]}-R{2 * c[4]}-{c[5]}-{c[7]}")
def test_emulated_rope_k_prepass(case, rng):
    """The pre-pass writes K rotated exactly as the in-loop form rotates a K tile (fp32 math,
    one rounding: _rope_like_mma), pass-through columns copied, into a new array of K's shape;
    k itself is untouched (the rows of k are a strided view here: every other kv head)."""
    B, Hkv, Sk, D, half, interleaved, tdt, layout, dtype = case
    shp = _shapes(layout, D)
    big = _rand(rng, shp(B, 2 * Hkv, Sk), dtype)
    k = big[:, ::2] if layout == "bhsd" else big[:, :, ::2]
    k0 = k.copy()
    cos, sin = _tables(Sk + 3, half, dtype if tdt == "same" else tdt)
    p = at.Problem(B, Hkv, Hkv, Sk, Sk, D, 1.0, -1, -1, False)
    ext = at.FlashExtras()
    with emu.Device(sms=2) as dev:
        call = _emu_call(dev, at.OP, dtype)
        at._rotary_extras(at.OP, dt.BY_NAME[dtype], dev.tensor(cos), dev.tensor(sin), half,
                          interleaved, ext)
        kt = dev.tensor(k)
        got = at.rope_k_scratch(call, p, kt, kt, kt, kt, layout, ext).obj
        assert _kernel_names() == [_rotary_names(dtype, D, half, interleaved, "prepass")[0]]
    exp = _bhsd(_rope_like_mma(_bhsd(k, layout), cos, sin, interleaved, dtype), layout) \
        .astype(np.float32).astype(_np_dtype(dtype))
    assert got.shape == k.shape and got.flags.c_contiguous
    np.testing.assert_array_equal(got.view(np.uint16), exp.view(np.uint16))
    np.testing.assert_array_equal(k, k0)
    assert np.any(got != k)


@needs_emu
def test_emulated_rope_k_prepass_varlen_positions_and_long_sequence(rng):
    """Packed keys: positions restart at every sequence (cu_seqlens_k, read on the device); a
    sequence longer than max_seqlen_k (a broken precondition) is still rotated to its end (the
    row-block loop strides past the grid), past the table reading NaN as the in-loop form."""
    lengths = [70, 0, 5, 140]
    cu = _cu(lengths)
    Hkv, D, half, dtype = 2, 64, 24, "bfloat16"   # partial: columns 48.. pass through
    k = _rand(rng, (cu[-1], Hkv, D), dtype)
    cos, sin = _tables(100, half)                # rows 0..99: the last sequence runs past
    p = at.Problem(len(lengths), Hkv, Hkv, 64, 64, D, 1.0, -1, -1, True)   # max_seqlen 64
    with emu.Device(sms=2) as dev:
        ext = at.FlashExtras(cu_q=dev.tensor(cu), cu_k=dev.tensor(cu))
        at._rotary_extras(at.VARLEN_OP, dt.bfloat16, dev.tensor(cos), dev.tensor(sin), half,
                          False, ext)
        kt = dev.tensor(k)
        got = at.rope_k_scratch(_emu_call(dev, at.VARLEN_OP, dtype), p, kt, kt, kt, kt, "thd",
                                ext).obj
        assert emu.Device.launches[-1][1] == (4 * Hkv, 1, 1)
    tab_c = np.concatenate([cos, np.full((200, half), np.nan, np.float32)])
    tab_s = np.concatenate([sin, np.full((200, half), np.nan, np.float32)])
    for b in range(len(lengths)):
        seq = k[cu[b]:cu[b + 1]].transpose(1, 0, 2)          # [Hkv, L, D], row l at position l
        exp = _rope_like_mma(seq, tab_c, tab_s, False, dtype).transpose(1, 0, 2) \
            .astype(np.float32).astype(_np_dtype(dtype))
        np.testing.assert_array_equal(got[cu[b]:cu[b + 1]].view(np.uint16) if b < 3 else
                                      got[cu[b]:cu[b] + 100].view(np.uint16),
                                      exp.view(np.uint16) if b < 3 else exp[:100].view(np.uint16))
    tail = got[cu[3] + 100:cu[4]]
    assert np.all(np.isnan(tail[..., :2 * half].astype(np.float32)))
    np.testing.assert_array_equal(tail[..., 2 * half:], k[cu[3] + 100:cu[4], :, 2 * half:])


# (B, Hq, Hkv, Sq, Sk, D, block_size, mask batch, mask heads, options, dtype)
EMU_MMA_SPARSE_CASES = [
    (1, 2, 2, 130, 130, 64, 64, 1, 2, {}, "bfloat16"),             # tile = block: per tile
    (2, 4, 2, 70, 100, 64, 16, 2, 1, {"is_causal": True}, "float16"),  # mixed: per score
    (1, 2, 1, 77, 90, 128, 48, 1, 1, {}, "bfloat16"),             # BR 128, BC 32: straddle
    (1, 2, 2, 50, 140, 32, 100, 1, 2, {"is_causal": True}, "float16"),
    (1, 1, 1, 40, 75, 96, 8, 1, 1, {}, "bfloat16"),
    (1, 1, 1, 70, 45, 256, 20, 1, 1, {"is_causal": True}, "float16"),
]


@needs_emu
@pytest.mark.parametrize("case", EMU_MMA_SPARSE_CASES,
                         ids=lambda c: f"D{c[5]}-bs{c[6]}-{sorted(c[9])}-{c[10]}")
def test_emulated_mma_block_sparse(case, rng, monkeypatch):
    B, Hq, Hkv, Sq, Sk, D, bs, mb, mh, opt, dtype = case
    monkeypatch.setattr(at, "tensor_cores", lambda dev: True)
    q = _rand(rng, (B, Hq, Sq, D), dtype)
    k, v = (_rand(rng, (B, Hkv, Sk, D), dtype) for _ in range(2))
    nq, nk = -(-Sq // bs), -(-Sk // bs)
    bm = rng.random((mb, mh, nq, nk)) > 0.5
    bm[..., nq // 2, :] = False                                # a block row that sees nothing
    with emu.Device(sms=2) as dev:
        out, lse = at._sparse_forward(_emu_call(dev, at.SPARSE_OP, dtype),
                                      *(dev.tensor(x) for x in (q, k, v, bm)), bs,
                                      opt.get("is_causal", False), None, True, "auto")
        out, lse = out.obj, lse.obj
        names = _kernel_names()
    assert names == [_mma_name(dtype, D, at.MMA_SPARSE)]
    mask = at.expand_block_mask(bm, bs, Sq, Sk)
    exp, exp_lse, bound, lbound = attn_bound(q, k, v, mask, dtype=dtype, enable_gqa=True,
                                             mma=True, **opt)
    check(out, exp, bound, f"out {case}")
    check(lse, exp_lse, lbound, f"lse {case}")
    dead = nq // 2 * bs
    assert np.all(out[:, :, dead:dead + bs] == 0) and np.all(np.isneginf(lse[:, :, dead:dead + bs]))


@needs_emu
@pytest.mark.parametrize("bs", [64, 16])
def test_emulated_mma_block_sparse_skips_tiles_without_loading_them(bs, rng, monkeypatch):
    """NaN in keys and values 64 .. 127 (the second key tile of D = 64), which are off for the
    first query block row: with bs = 64 no row sees them, the block never loads that tile and
    every output is finite; with bs = 16 the rows of warps 1 .. 3 (rows 16 .. 63) see them (NaN,
    as the reference), the block loads the tile, and warp 0 (rows 0 .. 15) skips its math there:
    its rows stay finite and equal attention over keys 0 .. 63."""
    monkeypatch.setattr(at, "tensor_cores", lambda dev: True)
    q = _rand(rng, (1, 2, 64, 64), "bfloat16")
    k, v = (_rand(rng, (1, 2, 128, 64), "bfloat16") for _ in range(2))
    bm = np.ones((1, 1, 64 // bs, 128 // bs), bool)
    bm[..., 0, 64 // bs:] = False
    k[:, :, 64:], v[:, :, 64:] = np.nan, np.nan
    with emu.Device(sms=2) as dev:
        out = at._sparse_forward(_emu_call(dev, at.SPARSE_OP, "bfloat16"),
                                 *(dev.tensor(x) for x in (q, k, v, bm)), bs, False, None, False,
                                 "mma").obj
        assert _kernel_names() == [_mma_name("bfloat16", 64, at.MMA_SPARSE)]
    rows = slice(0, 64) if bs == 64 else slice(0, 16)
    exp, _, bound, _ = attn_bound(q[:, :, rows], k[:, :, :64], v[:, :, :64], dtype="bfloat16",
                                  mma=True)
    check(out[:, :, rows], exp, bound, "skipped tiles")
    if bs == 16:
        assert np.all(np.isnan(out[:, :, 16:]))


# (Sq, Sk, Hq, Hkv, D, half, interleaved, table dtype, layout, dtype)
EMU_MMA_ROTARY_CASES = [
    (37, 37, 2, 2, 64, 32, False, "same", "bhsd", "bfloat16"),     # full rotary, 8-byte items
    (20, 45, 4, 2, 128, 32, True, "float32", "bshd", "float16"),   # partial, GPT-J
    (33, 33, 2, 2, 64, 10, False, "same", "bhsd", "float16"),      # one pair per item
    (29, 70, 2, 1, 32, 5, True, "float32", "bhsd", "bfloat16"),    # GPT-J, one pair per item
    (70, 40, 1, 1, 96, 12, False, "float32", "bshd", "bfloat16"),  # Sq > Sk, partial, 8 bytes
]


@needs_emu
@pytest.mark.parametrize("form", at.ROTARY_FORMS)
@pytest.mark.parametrize("case", EMU_MMA_ROTARY_CASES,
                         ids=lambda c: f"D{c[4]}-R{2 * c[5]}-{c[6]}-{c[8]}-{c[9]}")
def test_emulated_mma_sdpa_with_rotary(case, form, rng, monkeypatch):
    """Against the float64 reference (mma bound plus the rounding of the rotated q and k), and
    bit-equal to the mma kernel of the same schedule run on q and k rotated the same way
    beforehand (so the rotation, in shared memory or by the K pre-pass, is exactly fp32 RoPE
    rounded once to the storage dtype); q and k are left as they were."""
    Sq, Sk, Hq, Hkv, D, half, interleaved, tdt, layout, dtype = case
    monkeypatch.setattr(at, "tensor_cores", lambda dev: True)
    monkeypatch.setitem(at.PLAN, "rotary", form)
    shp = _shapes(layout, D)
    q, k, v = _rand(rng, shp(1, Hq, Sq), dtype), _rand(rng, shp(1, Hkv, Sk), dtype), \
        _rand(rng, shp(1, Hkv, Sk), dtype)
    cos, sin = _tables(max(Sq, Sk) + 5, half, dtype if tdt == "same" else tdt)
    kw = dict(is_causal=True, enable_gqa=Hq != Hkv, layout=layout, rotary_cos=cos,
              rotary_sin=sin, rotary_interleaved=interleaved)
    q0, k0 = q.copy(), k.copy()
    with emu.Device(sms=2) as dev:
        t = [dev.tensor(x) for x in (q, k, v)]
        out, lse = at._forward(_emu_call(dev, at.OP, dtype), *t, None, True, None,
                               kw["enable_gqa"], None, True, layout, "auto", dev.tensor(cos),
                               dev.tensor(sin), interleaved)
        out, lse = out.obj, lse.obj
        names = _rotary_names(dtype, D, half, interleaved, form)
        assert _kernel_names() == names
        np.testing.assert_array_equal(q, q0)
        np.testing.assert_array_equal(k, k0)
        qr, kr = (_bhsd(_rope_like_mma(_bhsd(x, layout), cos, sin, interleaved, dtype), layout)
                  .astype(np.float32).astype(_np_dtype(dtype)) for x in (q, k))
        # the same schedule without rotary: the dense kernel, or the varlen instantiation (with
        # dense arguments) where the rotary one runs on MMA_EXTRAS_TILES' schedule
        rot_cfg = at.mma_config(D, False, at.MMA_ROTARY_Q if form == "prepass"
                                else at.MMA_VARLEN | at.MMA_ROTARY)
        same = at.MMA_PLAIN if rot_cfg == at.MMA_TILES[D] else at.MMA_VARLEN
        assert at.mma_config(D, False, same) == rot_cfg
        monkeypatch.setattr(at, "mma_extras", lambda p, ext: same)
        plain, plain_lse = _emu_run(dev, qr, kr, v, dtype=dtype, is_causal=True,
                                    enable_gqa=Hq != Hkv, layout=layout, variant="mma")
        assert _kernel_names()[-1] == _mma_name(dtype, D, same)
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(lse, plain_lse)
    exp, exp_lse, bound, lbound = attn_bound(q, k, v, dtype=dtype, mma=True, **kw)
    check(out, exp, bound, f"out {case}")
    check(lse, exp_lse, lbound, f"lse {case}")
    unrotated, _, _, _ = attn_bound(q, k, v, dtype=dtype, is_causal=True, enable_gqa=Hq != Hkv,
                                    layout=layout)
    assert np.abs(unrotated - exp).max() > 1e-2               # the tables mattered


@needs_emu
def test_emulated_mma_extras_two_stages(rng, monkeypatch):
    """The extras hooks on a two-stage schedule (K/V double-buffered; no extras schedule uses
    it yet, a later MMA_TILES change may): block-sparse key tiles skipped between visited ones
    (the buffers alternate per visited tile, not per tile index; the first tile off), varlen
    and varlen + rotary (both forms) give bit for bit what the one-stage schedule of the same
    tile gives (same tiles, same order), and the block-sparse output meets the reference."""
    from gpuops.ops import _layout as lay  # noqa: PLC0415
    from gpuops.runtime.modules import KernelModule  # noqa: PLC0415
    monkeypatch.setattr(at, "tensor_cores", lambda dev: True)
    D, dtype = 64, "bfloat16"
    one = at.MMA_TILES[D]
    two = (*one[:5], 2)
    test_module = KernelModule(
        "attention.flash_mma_extras_stages_test", "attention/flash_fwd_mma.cu",
        {at.mma_expr(dt.bfloat16, D, cfg, False, x): at.FLASH_ARGS
         for cfg in (one, two) for x in at.MMA_EXTRAS}, archs=at._MMA_ARCHS)
    monkeypatch.setitem(at._MMA_EXTRAS_KERNELS, dt.bfloat16, lay.KernelTable(test_module))

    # block-sparse: 7 key tiles of 64, the first query block row sees tiles 2, 3, 5 (skips 0, 1,
    # 4, 6), the second 0, 1, 6; bs = 16 below mixes on and off blocks inside a warp's tile
    q = _rand(rng, (1, 2, 128, D), dtype)
    k, v = (_rand(rng, (1, 2, 448, D), dtype) for _ in range(2))
    bm64 = np.zeros((1, 1, 2, 7), bool)
    bm64[0, 0, 0, [2, 3, 5]] = True
    bm64[0, 0, 1, [0, 1, 6]] = True
    bm16 = np.repeat(np.repeat(bm64, 4, axis=2), 4, axis=3) & (rng.random((1, 1, 8, 28)) > 0.3)
    lq = [150, 3, 70]
    cu = _cu(lq)
    qv, kv_, vv = (_rand(rng, (cu[-1], 2, D), dtype) for _ in range(3))
    cos, sin = _tables(160, 16)

    def run(cfg):
        for x in at.MMA_EXTRAS:
            monkeypatch.setitem(at.MMA_EXTRAS_TILES, (D, x), cfg)
        outs = []
        with emu.Device(sms=2) as dev:
            for bm, bs in ((bm64, 64), (bm16, 16)):
                o, l_ = at._sparse_forward(_emu_call(dev, at.SPARSE_OP, dtype),
                                           *(dev.tensor(x) for x in (q, k, v, bm)), bs, False,
                                           None, True, "mma")
                outs += [o.obj, l_.obj]
            outs += _emu_varlen(dev, qv, kv_, vv, cu, cu, 150, 150, dtype=dtype, is_causal=True,
                                variant="mma")
            for form in at.ROTARY_FORMS:
                monkeypatch.setitem(at.PLAN, "rotary", form)
                outs += _emu_varlen(dev, qv, kv_, vv, cu, cu, 150, 150, dtype=dtype,
                                    is_causal=True, rotary_cos=cos, rotary_sin=sin,
                                    variant="mma")
            names = _kernel_names()
        assert [n for n in names if "attn_rope_k" not in n] == [
            at.mma_expr(dt.bfloat16, D, cfg, False, x) for x in
            (at.MMA_SPARSE, at.MMA_SPARSE, at.MMA_VARLEN, at.MMA_VARLEN | at.MMA_ROTARY_Q,
             at.MMA_VARLEN | at.MMA_ROTARY)]
        return outs

    got, base = run(two), run(one)
    for i, (a, b) in enumerate(zip(got, base)):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}")
    for a, b in zip(got[-4:-2], got[-2:]):    # the rotary forms: the same bits
        np.testing.assert_array_equal(a, b)
    for (bm, bs), o, l_ in zip(((bm64, 64), (bm16, 16)), got[0:4:2], got[1:4:2]):
        mask = at.expand_block_mask(bm, bs, 128, 448)
        exp, exp_lse, bound, lbound = attn_bound(q, k, v, mask, dtype=dtype, mma=True)
        check(o, exp, bound, f"out bs {bs}")
        check(l_, exp_lse, lbound, f"lse bs {bs}")


@pytest.mark.parametrize("form", at.ROTARY_FORMS)
def test_auto_takes_mma_for_varlen_sparse_and_rotary(form, rng, monkeypatch):
    """'auto' and 'mma' send varlen, block-sparse and rotary calls to the tensor-core kernel
    (EXTRAS = MMA_VARLEN, MMA_SPARSE; rotary: MMA_ROTARY_Q, with MMA_VARLEN for packed
    sequences, under PLAN["rotary"] = "prepass", MMA_VARLEN | MMA_ROTARY for both under
    "in_loop") where it applies; fp32, head dims without an mma instantiation, packed rows the
    row stride misaligns and devices below sm_80 take 'simt'. (Routing only: the launchers are
    replaced by recorders.)"""
    monkeypatch.setitem(at.PLAN, "rotary", form)
    rot_dense = at.MMA_ROTARY_Q if form == "prepass" else at.MMA_VARLEN | at.MMA_ROTARY
    rot_varlen = at.MMA_VARLEN | (at.MMA_ROTARY_Q if form == "prepass" else at.MMA_ROTARY)
    tc = {"on": True}
    monkeypatch.setattr(at, "tensor_cores", lambda dev: tc["on"])
    seen = []

    def mma(call, p, *args):
        seen.append(_mma_name(call.result_dtype.name, p.D, at.mma_extras(p, args[-1])))

    def simt(call, p, *args):
        seen.append("simt")
    monkeypatch.setattr(at, "_launch_mma", mma)
    monkeypatch.setattr(at, "_launch_simt", simt)
    monkeypatch.setitem(at._VARIANTS, "simt", simt)
    dev = emu.Device(sms=2)

    def varlen(dtype, D=64, rot=False, variant="auto", odd_rows=False):
        T, H = 5, 2
        q, k, v = (_rand(rng, (T, H, D), dtype) for _ in range(3))
        if odd_rows:   # row stride H D + 1: only the first packed row is 16-byte aligned
            buf = _rand(rng, (T * (H * D + 1),), dtype)
            q = np.lib.stride_tricks.as_strided(buf, (T, H, D), ((H * D + 1) * buf.itemsize,
                                                                 D * buf.itemsize, buf.itemsize))
        cu = dev.tensor(_cu([1] * T))       # max_seqlen 1: one row per sequence
        tabs = [dev.tensor(t) for t in _tables(8, 8)] if rot else [None, None]
        at._varlen_forward(_emu_call(dev, at.VARLEN_OP, dtype),
                           *(dev.tensor(x) for x in (q, k, v)), cu, cu, 1, 1, True, None, None,
                           False, *tabs, False, variant)
        return seen.pop()

    def sparse(dtype, D=64, variant="auto"):
        q, k, v = (_rand(rng, (1, 2, 20, D), dtype) for _ in range(3))
        at._sparse_forward(_emu_call(dev, at.SPARSE_OP, dtype),
                           *(dev.tensor(x) for x in (q, k, v, np.ones((1, 1, 2, 2), bool))), 16,
                           False, None, False, variant)
        return seen.pop()

    def rotary(dtype, D=64, variant="auto", mask=False):
        q, k, v = (_rand(rng, (1, 2, 20, D), dtype) for _ in range(3))
        tabs = [dev.tensor(t) for t in _tables(20, 8)]
        m = dev.tensor(np.ones((20, 20), bool)) if mask else None
        at._forward(_emu_call(dev, at.OP, dtype), *(dev.tensor(x) for x in (q, k, v)), m,
                    False, None, False, None, False, "bhsd", variant, *tabs, False)
        return seen.pop()

    for variant in ("auto", "mma"):
        assert varlen("bfloat16", variant=variant) == _mma_name("bfloat16", 64, at.MMA_VARLEN)
        assert varlen("float16", D=128, rot=True, variant=variant) == _mma_name(
            "float16", 128, rot_varlen)
        assert sparse("bfloat16", D=32, variant=variant) == _mma_name("bfloat16", 32,
                                                                      at.MMA_SPARSE)
        assert rotary("bfloat16", D=96, variant=variant) == _mma_name("bfloat16", 96, rot_dense)
    assert varlen("bfloat16", variant="simt") == "simt"
    assert sparse("bfloat16", variant="simt") == "simt"
    assert rotary("bfloat16", variant="simt") == "simt"
    assert varlen("float32") == sparse("float32") == rotary("float32") == "simt"
    assert varlen("bfloat16", D=80) == sparse("float16", D=80) == rotary("bfloat16", D=48) \
        == "simt"
    assert varlen("bfloat16", odd_rows=True) == "simt"
    # D = 256: every extras instantiation (rotary on its own schedule, MMA_EXTRAS_TILES)
    assert sparse("float16", D=256) == _mma_name("float16", 256, at.MMA_SPARSE)
    assert varlen("bfloat16", D=256) == _mma_name("bfloat16", 256, at.MMA_VARLEN)
    # D = 256 has no Q-only instantiation (MMA_EXTRAS_MISSING): the in-loop one either way
    assert (at.MMA_ROTARY_Q in at.MMA_EXTRAS_MISSING[256]) and rotary("bfloat16", D=256) == \
        _mma_name("bfloat16", 256, at.MMA_VARLEN | at.MMA_ROTARY)
    # the extras instantiations have no attn_mask code: rotary + attn_mask takes SIMT
    assert rotary("bfloat16", mask=True) == rotary("bfloat16", mask=True, variant="mma") == "simt"
    # an extras instantiation a head dim lacks (MMA_EXTRAS_MISSING) sends its calls to SIMT
    monkeypatch.setitem(at.MMA_EXTRAS_MISSING, 256,
                        (at.MMA_VARLEN, at.MMA_VARLEN | at.MMA_ROTARY, at.MMA_ROTARY_Q,
                         at.MMA_VARLEN | at.MMA_ROTARY_Q))
    assert varlen("bfloat16", D=256) == rotary("bfloat16", D=256) == "simt"
    assert sparse("float16", D=256) == _mma_name("float16", 256, at.MMA_SPARSE)
    tc["on"] = False                                        # sm_75 and older
    assert varlen("bfloat16") == sparse("bfloat16") == rotary("bfloat16") == "simt"


def test_mma_extras_configs_and_modules():
    """The extras instantiations: one per (head dim, MMA_EXTRAS) less MMA_EXTRAS_MISSING, in
    their own modules (sm_80+), unmasked, with MMA_TILES' schedules except MMA_EXTRAS_TILES;
    calls that combine a block mask with packed sequences or rotary have no instantiation."""
    missing = sum(len(x) for x in at.MMA_EXTRAS_MISSING.values())
    for dtype, m in at.MMA_EXTRAS_MODULES.items():
        assert m.min_arch == 80 and not m.supports(75)
        assert set(m.kernels) == {at.mma_expr(dtype, d, at.mma_config(d, False, x), False, x)
                                  for d in at.MMA_TILES for x in at.MMA_EXTRAS
                                  if at.mma_has(d, x)}
        assert len(m.kernels) == len(at.MMA_EXTRAS) * len(at.MMA_TILES) - missing
        assert not set(m.kernels) & set(at.MMA_MODULES[dtype].kernels)
        assert all(", false, " in e and not e.endswith(", false>") for e in m.kernels)
    for d in at.MMA_TILES:
        assert at.mma_config(d, False, at.MMA_PLAIN) == at.MMA_TILES[d]
        for x in at.MMA_EXTRAS:
            cfg = at.mma_config(d, False, x)
            assert cfg == at.MMA_EXTRAS_TILES.get((d, x), at.MMA_TILES[d])
            assert at.mma_smem(d, cfg) <= 99 * 1024 and len(cfg) == 6
            assert at.mma_config(d, True, x) == cfg          # EXTRAS decides, not the mask
            assert not at.mma_has(d, x, masked=True)
    assert set(at.MMA_EXTRAS_TILES) <= {(d, x) for d in at.MMA_TILES for x in at.MMA_EXTRAS}
    # the GPU test of varlen against per-sequence SDPA times the dense kernel on this schedule
    assert at.mma_expr(dt.bfloat16, 128, at.mma_config(128, False, at.MMA_VARLEN)) in \
        at.MMA_MODULES[dt.bfloat16].kernels
    p = at.check_sparse_args((1, 2, 8, 64), (1, 2, 8, 64), (1, 2, 8, 64), (1, 1, 1, 1), 8, False,
                             None, False, "auto")
    assert at.mma_extras(p, at.FlashExtras(block_mask=1, block_size=8)) == at.MMA_SPARSE
    with pytest.raises(ValueError, match="block-sparse tensor-core kernel"):
        at.mma_extras(p, at.FlashExtras(block_mask=1, block_size=8, rot_half=4))
    assert at.mma_extras(p, at.NO_EXTRAS) == at.MMA_PLAIN
    p.bottom_right = True                                 # a dense bottom-right diagonal
    assert at.mma_extras(p, at.NO_EXTRAS) == at.MMA_VARLEN


def test_rotary_plan_routes_the_mma_instantiations(monkeypatch):
    """PLAN["rotary"]: 'prepass' (the default since run 34) -> the Q-only instantiation (with
    MMA_VARLEN for packed sequences or a bottom-right diagonal) after the K pre-pass; 'in_loop'
    -> varlen + rotary; anything else raises. The pre-pass module exists for both 16-bit dtypes,
    16-byte packs and single elements, on every arch (it has no tensor-core code)."""
    ext = at.FlashExtras(rot_half=8)
    dense = at.check_args((1, 2, 8, 64), (1, 2, 8, 64), (1, 2, 8, 64), None, True, None, False,
                          None, False, "bhsd", "auto")
    assert at.PLAN["rotary"] == "prepass"
    assert at.mma_extras(dense, ext) == at.MMA_ROTARY_Q
    dense.bottom_right = True
    assert at.mma_extras(dense, ext) == at.MMA_VARLEN | at.MMA_ROTARY_Q
    assert at.mma_extras(dense, at.FlashExtras(cu_q=1, cu_k=1, rot_half=8)) == \
        at.MMA_VARLEN | at.MMA_ROTARY_Q
    monkeypatch.setitem(at.PLAN, "rotary", "in_loop")
    assert at.mma_extras(dense, ext) == at.MMA_VARLEN | at.MMA_ROTARY
    dense.bottom_right = False
    assert at.mma_extras(dense, ext) == at.MMA_VARLEN | at.MMA_ROTARY
    assert at.mma_extras(dense, at.NO_EXTRAS) == at.MMA_PLAIN
    monkeypatch.setitem(at.PLAN, "rotary", "fused")
    with pytest.raises(ValueError, match="PLAN\\['rotary'\\]"):
        at.mma_extras(dense, ext)
    assert set(at.ROPE_K_MODULE.kernels) == {at.rope_k_expr(d, v) for d in (dt.float16,
                                             dt.bfloat16) for v in (8, 1)}
    assert at.ROPE_K_MODULE.supports(61)


# ----------------------------------------------------------------------------- GPU

GPU_VARLEN_CASES = [
    # (lengths q, lengths k or None, Hq, Hkv, D, options)
    ([1, 0, 513, 2000, 64, 17, 1200], None, 8, 2, 128, {"is_causal": True}),
    ([300, 1, 0, 4097], [900, 5, 7, 4097], 4, 4, 64, {"is_causal": True}),
    ([1000, 20, 333], None, 4, 1, 96, {"window_size": (128, 0)}),
    ([700, 65], [1000, 64], 2, 2, 80, {}),
    ([513, 1000, 1], None, 8, 2, 128, {"is_causal": True, "rotary": (64, False)}),
    ([257, 900], [300, 900], 4, 4, 64, {"rotary": (16, True)}),
]


def _gpu_varlen_case(case, dtype, rng, variant, mma):
    lq, lk, Hq, Hkv, D, opt = case
    lk = lq if lk is None else lk
    opt = dict(opt)
    cq, ck = _cu(lq), _cu(lk)
    q = _rand(rng, (cq[-1], Hq, D), dtype)
    k, v = (_rand(rng, (ck[-1], Hkv, D), dtype) for _ in range(2))
    rot = opt.pop("rotary", None)
    targs = {}
    if rot is not None:
        cos, sin = _tables(max(lq + lk), rot[0], "float32")
        opt.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rot[1])
        targs = dict(rotary_cos=_cuda(cos, "float32"), rotary_sin=_cuda(sin, "float32"),
                     rotary_interleaved=rot[1])
    dev_cu = [torch.from_numpy(c).cuda() for c in (cq, ck)]
    out, lse = go.varlen_attention(_cuda(q, dtype), _cuda(k, dtype), _cuda(v, dtype), *dev_cu,
                                   max(lq), max(lk), return_lse=True, variant=variant,
                                   **{k_: v_ for k_, v_ in opt.items() if not k_.startswith("rot")},
                                   **targs)
    exp, exp_lse, bound, lbound = varlen_bound(q, k, v, cq, ck, dtype=dtype, mma=mma, **opt)
    check(_host(out), exp, bound, f"out {case} {dtype}")
    assert lse.dtype == torch.float32 and lse.shape == (Hq, cq[-1])
    check(_host(lse), exp_lse, lbound, f"lse {case} {dtype}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_VARLEN_CASES,
                         ids=lambda c: f"D{c[4]}-{sorted(c[5])}-{len(c[0])}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_varlen_against_reference(case, dtype, rng):
    """The SIMT kernel."""
    _gpu_varlen_case(case, dtype, rng, "simt", False)


# The tensor-core kernel: GPU_VARLEN_CASES' head dims it has varlen for, 32 and 256 (varlen on
# MMA_TILES' BC 64, varlen + rotary on MMA_EXTRAS_TILES' BC 32).
GPU_MMA_VARLEN_CASES = [c for c in GPU_VARLEN_CASES if at.mma_has(c[4], at.MMA_VARLEN)] + [
    ([1, 0, 700, 129, 64], [3, 5, 700, 200, 64], 4, 2, 32, {"is_causal": True}),
    ([2000, 17, 333], None, 8, 8, 32, {"window_size": (64, 16), "rotary": (16, False)}),
    ([600, 1, 130], [700, 3, 130], 4, 2, 256, {"is_causal": True}),
    ([333, 1000], None, 2, 2, 256, {"is_causal": True, "rotary": (64, True)}),
]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_MMA_VARLEN_CASES,
                         ids=lambda c: f"D{c[4]}-{sorted(c[5])}-{len(c[0])}")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_mma_varlen_against_reference(case, dtype, rng, mma_only):
    """'auto' takes the tensor-core kernel (mma_only: a fallback to SIMT fails)."""
    _gpu_varlen_case(case, dtype, rng, "auto", True)


@gpu
@needs_torch_cuda
def test_gpu_varlen_matches_per_sequence_sdpa_and_graph_replays_new_lengths(rng, monkeypatch):
    """One packed call equals gpuops SDPA per sequence on the same variant, bit for bit: for
    'simt', and for 'mma' (what 'auto' takes here: bf16, D = 128, sm_80+; SDPA is run on the
    varlen instantiation's schedule, MMA_EXTRAS_TILES, one of the dense module's: the same
    tiles in the same order); a captured call replayed after the lengths changed in place
    (same total) follows the new lengths."""
    varlen_cfg = at.mma_config(128, False, at.MMA_VARLEN)
    assert at.mma_expr(dt.bfloat16, 128, varlen_cfg) in at.MMA_MODULES[dt.bfloat16].kernels
    monkeypatch.setitem(at.MMA_TILES, 128, varlen_cfg)
    lengths = [300, 1, 77, 1024]
    cu = torch.from_numpy(_cu(lengths)).cuda()
    q, k, v = (torch.randn(sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    c = _cu(lengths)
    for variant in ("simt", "mma"):
        out = go.varlen_attention(q, k, v, cu, cu, 1024, 1024, is_causal=True, variant=variant)
        for b in range(4):
            one = go.scaled_dot_product_attention(*(x[c[b]:c[b + 1]][None] for x in (q, k, v)),
                                                  is_causal=True, layout="bshd", variant=variant)
            assert torch.equal(out[c[b]:c[b + 1]], one[0]), (variant, b)
    out = go.varlen_attention(q, k, v, cu, cu, 1024, 1024, is_causal=True)
    go.varlen_attention(q, k, v, cu, cu, 1024, 1024, is_causal=True)       # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = go.varlen_attention(q, k, v, cu, cu, 1024, 1024, is_causal=True)
    new = [700, 702]
    cu.copy_(torch.from_numpy(_cu(new + [0, 0])).cuda())
    graph.replay()
    torch.cuda.synchronize()
    exp = go.varlen_attention(q, k, v, cu, cu, 1024, 1024, is_causal=True)
    assert torch.equal(g_out, exp) and not torch.equal(g_out, out)


GPU_SPARSE_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, block_size, density, options)
    (2, 8, 8, 1024, 1024, 128, 64, 0.5, {}),
    (1, 8, 2, 2000, 2000, 64, 128, 0.3, {"is_causal": True}),
    (1, 4, 4, 777, 1500, 96, 32, 0.5, {}),
    (1, 4, 4, 600, 600, 80, 16, 0.2, {"is_causal": True}),
]


def _sparse_id(case):
    return f"D{case[5]}-bs{case[6]}-{sorted(case[8])}"


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_SPARSE_CASES, ids=_sparse_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_block_sparse_against_reference(case, dtype, rng):
    """The SIMT kernel."""
    _gpu_sparse_case(case, dtype, rng, "simt", False)


def _gpu_sparse_case(case, dtype, rng, variant, mma):
    B, Hq, Hkv, Sq, Sk, D, bs, density, opt = case
    q = _rand(rng, (B, Hq, Sq, D), dtype)
    k, v = (_rand(rng, (B, Hkv, Sk, D), dtype) for _ in range(2))
    bm = rng.random((1, Hq, -(-Sq // bs), -(-Sk // bs))) < density
    out, lse = go.block_sparse_attention(_cuda(q, dtype), _cuda(k, dtype), _cuda(v, dtype),
                                         torch.from_numpy(bm).cuda(), bs, return_lse=True,
                                         variant=variant, **opt)
    exp, exp_lse, bound, lbound = attn_bound(q, k, v, at.expand_block_mask(bm, bs, Sq, Sk),
                                             dtype=dtype, enable_gqa=Hq != Hkv, mma=mma, **opt)
    check(_host(out), exp, bound, f"out {case} {dtype}")
    check(_host(lse), exp_lse, lbound, f"lse {case} {dtype}")


# The tensor-core kernel: GPU_SPARSE_CASES' head dims it has, and 32 / 256 (blocks that do not
# line up with its tiles: per-score masking).
GPU_MMA_SPARSE_CASES = [c for c in GPU_SPARSE_CASES if c[5] in at.MMA_TILES] + [
    (1, 4, 4, 1000, 1000, 256, 16, 0.3, {"is_causal": True}),
    (2, 8, 4, 1500, 1200, 32, 48, 0.5, {}),
]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_MMA_SPARSE_CASES, ids=_sparse_id)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_mma_block_sparse_against_reference(case, dtype, rng, mma_only):
    """'auto' takes the tensor-core kernel (mma_only: a fallback to SIMT fails)."""
    _gpu_sparse_case(case, dtype, rng, "auto", True)


# The Hopper kernel's sparse instance (block sizes that are multiples of 64): blocks of 64 (a
# tile covers 2 x 2 blocks: halves hidden per warpgroup), 128 (one block per tile), 192 and 256
# (tiles straddle block edges), causal, GQA, ragged tails, query blocks with every block off
# (density 0.2 without the diagonal: rows of 0 and lse -inf).
GPU_WGMMA_SPARSE_CASES = [
    (2, 8, 8, 1024, 1024, 128, 64, 0.5, {}),
    (1, 8, 2, 2000, 2000, 64, 128, 0.3, {"is_causal": True}),
    (1, 4, 4, 777, 1500, 128, 192, 0.5, {}),
    (2, 4, 2, 1000, 1000, 64, 64, 0.2, {"is_causal": True}),
    (1, 2, 2, 300, 4097, 128, 256, 0.4, {}),
    (1, 4, 1, 4097, 700, 64, 64, 0.3, {}),
]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_WGMMA_SPARSE_CASES, ids=_sparse_id)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", ["auto", "wgmma"])
def test_gpu_wgmma_block_sparse_against_reference(case, dtype, variant, rng, wgmma_only):
    """'auto' and 'wgmma' run the sparse wgmma instance (wgmma_only: a fallback fails)."""
    _gpu_sparse_case(case, dtype, rng, variant, True)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("bs", [64, 128])
def test_gpu_wgmma_block_sparse_skips_tiles_and_takes_strided_views(bs, rng, wgmma_only):
    """Key tiles whose blocks are off for every query row are never read: their K and V are NaN
    here, and the output matches the reference on zeros there (a tile that were read would turn
    a row NaN: p = 0 times V = NaN). Also: a per-batch mask (broadcast over heads), [B, S, H, D]
    tensors as .transpose(1, 2) views, a CUDA graph replayed on a new mask."""
    B, H, S, D = 2, 4, 1000, 128
    n = -(-S // bs)
    per_tile = max(1, 128 // bs)                 # mask columns per 128-key tile
    q, k, v = (_rand(rng, (B, S, H, D), "bfloat16") for _ in range(3))
    bm = rng.random((B, 1, n, n)) < 0.5
    dead = [c for c in range(n) if (c // per_tile) % 3 == 1]    # whole tiles of keys
    bm[..., dead] = False
    bm[..., 0] = True
    k0, v0 = k.copy(), v.copy()
    for c in dead:
        k0[:, c * bs:(c + 1) * bs] = 0
        v0[:, c * bs:(c + 1) * bs] = 0
        k[:, c * bs:(c + 1) * bs] = np.nan
        v[:, c * bs:(c + 1) * bs] = np.nan
    tq, tk, tv = (_cuda(x, "bfloat16").transpose(1, 2) for x in (q, k, v))
    tbm = torch.from_numpy(bm).cuda()
    out = go.block_sparse_attention(tq, tk, tv, tbm, bs, variant="wgmma")
    mask = at.expand_block_mask(bm, bs, S, S)
    exp, _, bound, _ = attn_bound(*(x.transpose(0, 2, 1, 3) for x in (q, k0, v0)), mask,
                                  dtype="bfloat16", mma=True)
    got = _host(out)
    assert np.isfinite(got).all()
    check(got, exp, bound, f"skipped tiles bs {bs}")
    # graph capture, replayed after the mask changed on the device
    g_bm = tbm.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = go.block_sparse_attention(tq, tk, tv, g_bm, bs, variant="wgmma")
    bm2 = bm.copy()
    bm2[..., 1:] = False                       # only the first key block: no NaN read either
    g_bm.copy_(torch.from_numpy(bm2).cuda())
    graph.replay()
    torch.cuda.synchronize()
    exp2, _, bound2, _ = attn_bound(*(x.transpose(0, 2, 1, 3) for x in (q, k0, v0)),
                                    at.expand_block_mask(bm2, bs, S, S), dtype="bfloat16",
                                    mma=True)
    check(_host(g_out), exp2, bound2, f"graph bs {bs}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_gpu_sdpa_rotary_matches_apply_rotary_then_sdpa(dtype, interleaved, rng):
    """Fused RoPE on the SIMT kernel against the float64 reference (derived bound), and against
    gpuops.apply_rotary followed by gpuops SDPA, which rounds the rotated q and k to the storage
    dtype once: the fused form, which does not round them, is closer to the reference."""
    B, S, Hq, Hkv, D, half = 2, 1000, 8, 2, 128, 32         # partial rotary (R = 64)
    q = _rand(rng, (B, S, Hq, D), dtype)
    k, v = (_rand(rng, (B, S, Hkv, D), dtype) for _ in range(2))
    cos, sin = _tables(S, half, dtype)
    tq, tk, tv, tc, ts = (_cuda(x, dtype) for x in (q, k, v, cos, sin))
    out = go.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True,
                                          layout="bshd", rotary_cos=tc, rotary_sin=ts,
                                          rotary_interleaved=interleaved, variant="simt")
    exp, _, bound, _ = attn_bound(q, k, v, dtype=dtype, is_causal=True, enable_gqa=True,
                                  layout="bshd", rotary_cos=cos, rotary_sin=sin,
                                  rotary_interleaved=interleaved)
    check(_host(out), exp, bound, f"rotary {dtype} {interleaved}")
    qr, _ = go.apply_rotary(tq, tq, tc, ts, interleaved, rotary_dim=2 * half)
    kr, _ = go.apply_rotary(tk, tk, tc, ts, interleaved, rotary_dim=2 * half)
    two_step = go.scaled_dot_product_attention(qr, kr, tv, is_causal=True, enable_gqa=True,
                                               layout="bshd")
    exp_t = torch.from_numpy(exp).cuda()
    e_fused = float((out.double() - exp_t).norm() / exp_t.norm())
    e_two = float((two_step.double() - exp_t).norm() / exp_t.norm())
    if dtype == "float32":          # the same roundings up to order: both at fp32 level
        assert e_fused < 1e-5 and e_two < 1e-5, (e_fused, e_two)
    else:                           # apply_rotary's storage rounding of q and k shows
        assert e_fused < e_two, (e_fused, e_two)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("half,D", [(32, 128), (64, 128), (48, 96), (10, 64), (16, 32),
                                    (128, 256)])
@pytest.mark.parametrize("form", at.ROTARY_FORMS)
def test_gpu_mma_sdpa_rotary_against_reference_and_apply_rotary(dtype, interleaved, half, D, form,
                                                               rng, mma_only, monkeypatch):
    """Fused RoPE on the tensor-core kernel ('auto'; partial and full rotary, 8-byte and
    one-pair items; K pre-pass or in-loop, PLAN["rotary"]): against the float64 reference with
    the mma bound (which counts the rounding of the rotated q and k to the storage dtype), and
    against gpuops.apply_rotary followed by the mma kernel, which rounds them the same way: the
    same error level."""
    monkeypatch.setitem(at.PLAN, "rotary", form)
    B, S, Hq, Hkv = 2, 1000, 8, 2
    q = _rand(rng, (B, S, Hq, D), dtype)
    k, v = (_rand(rng, (B, S, Hkv, D), dtype) for _ in range(2))
    cos, sin = _tables(S, half, "float32")
    tq, tk, tv = (_cuda(x, dtype) for x in (q, k, v))
    tc, ts = (_cuda(x, "float32") for x in (cos, sin))
    out = go.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True,
                                          layout="bshd", rotary_cos=tc, rotary_sin=ts,
                                          rotary_interleaved=interleaved)
    exp, _, bound, _ = attn_bound(q, k, v, dtype=dtype, is_causal=True, enable_gqa=True,
                                  layout="bshd", rotary_cos=cos, rotary_sin=sin,
                                  rotary_interleaved=interleaved, mma=True)
    check(_host(out), exp, bound, f"rotary mma {dtype} {interleaved} R{2 * half}")
    qr, _ = go.apply_rotary(tq, tq, tc, ts, interleaved, rotary_dim=2 * half)
    kr, _ = go.apply_rotary(tk, tk, tc, ts, interleaved, rotary_dim=2 * half)
    two_step = go.scaled_dot_product_attention(qr, kr, tv, is_causal=True, enable_gqa=True,
                                               layout="bshd")
    exp_t = torch.from_numpy(exp).cuda()
    e_fused = float((out.double() - exp_t).norm() / exp_t.norm())
    e_two = float((two_step.double() - exp_t).norm() / exp_t.norm())
    assert e_fused < 1.25 * e_two, (e_fused, e_two)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_mma_rotary_forms_agree_and_prepass_graph_replays(dtype, rng, mma_only, monkeypatch):
    """The K pre-pass form and the in-loop form give the same bits (dense 'bshd' with GQA and
    partial GPT-J rotary, 'bhsd' full NeoX, packed sequences); q and k are left as they were;
    a CUDA graph captured around a pre-pass call (scratch from torch's graph pool) replays new
    q / k / v copied in place to what an eager call gives."""
    tdt = getattr(torch, dtype)
    cases = []
    q = torch.randn(2, 700, 8, 128, device="cuda", dtype=tdt)
    k, v = (torch.randn(2, 700, 2, 128, device="cuda", dtype=tdt) for _ in range(2))
    cos, sin = (_cuda(x, "float32") for x in _tables(700, 32))
    cases.append(lambda: go.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True, layout="bshd", rotary_cos=cos,
        rotary_sin=sin, rotary_interleaved=True))
    qb, kb, vb = (torch.randn(1, 4, 1000, 64, device="cuda", dtype=tdt) for _ in range(3))
    cb, sb = (_cuda(x, dtype) for x in _tables(1000, 32, dtype))
    cases.append(lambda: go.scaled_dot_product_attention(qb, kb, vb, rotary_cos=cb,
                                                         rotary_sin=sb))
    lengths = [300, 1, 0, 1025]
    cu = torch.from_numpy(_cu(lengths)).cuda()
    qv, kv_, vv = (torch.randn(sum(lengths), 4, 128, device="cuda", dtype=tdt) for _ in range(3))
    cv, sv = (_cuda(x, "float32") for x in _tables(1025, 64))
    cases.append(lambda: go.varlen_attention(qv, kv_, vv, cu, cu, 1025, 1025, is_causal=True,
                                             rotary_cos=cv, rotary_sin=sv))
    saved = [x.clone() for x in (q, k, qb, kb, qv, kv_)]
    for i, fn in enumerate(cases):
        monkeypatch.setitem(at.PLAN, "rotary", "in_loop")
        a = fn()
        monkeypatch.setitem(at.PLAN, "rotary", "prepass")
        b = fn()
        assert torch.equal(a, b), i
    for x, y in zip((q, k, qb, kb, qv, kv_), saved):
        assert torch.equal(x, y)
    fn = cases[0]
    fn()                                                     # warm (compiles, loads)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = fn()
    for x in (q, k, v):
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, fn())
