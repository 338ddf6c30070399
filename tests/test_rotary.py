"""The rotary family (apply_rotary, qk_norm_rotary and their backward ops) against float64
references.

CPU: the NumPy references against HF transformers' code transcribed in torch float64 (Llama /
GPT-NeoX rotate_half, GPT-J rotate_every_two, Qwen2-VL and Qwen3-VL M-RoPE, Qwen3's q/k RMSNorm)
and the backward references against torch autograd; argument errors; the torch autograd layer and
torch.compile on CPU tensors; and the CUDA kernels themselves, compiled for the host by
tests/cuda_host_emulation.py and launched through the ops' real host code (every layout, dtype,
pack width and M-RoPE mode).
GPU: every dtype and table dtype against the references, odd and decode sizes, strided,
transposed and unaligned views, positions, packed sequences, M-RoPE, poisoned outputs,
deterministic weight gradients, a side stream and a CUDA graph, autograd against torch.
"""
from __future__ import annotations


import numpy as np
import pytest

import gpuops as go
from gpuops import dtypes as dt
from gpuops import registry
from gpuops.ops import rotary as R
from conftest import HAS_TORCH, TOLERANCE, assert_close, gpu, needs_torch, needs_torch_cuda

import cuda_host_emulation as emu

torch = pytest.importorskip("torch") if HAS_TORCH else None
needs_gxx = pytest.mark.skipif(not emu.available(), reason="g++ not installed")
DTYPES = ["float32", "float16", "bfloat16"]


# ------------------------------------------------------------------ HF code, transcribed (torch)

def hf_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers.models.llama.modeling_llama.apply_rotary_pos_emb (q, k: [B, H, S, D])."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (hf_rotate_half(q) * sin), (k * cos) + (hf_rotate_half(k) * sin)


def hf_rope_tables(positions, dim, base=10000.0):
    """LlamaRotaryEmbedding: cos, sin of shape positions.shape + [dim] (duplicated halves)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64,
                                            device=positions.device) / dim))
    freqs = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def gptj_rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def gptj_apply_rotary_pos_emb(tensor, sin, cos):
    """transformers.models.gptj.modeling_gptj.apply_rotary_pos_emb (tensor: [B, S, H, rot])."""
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (gptj_rotate_every_two(tensor) * sin)


def hf_qwen2vl_mrope(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """transformers.models.qwen2_vl.modeling_qwen2_vl.apply_multimodal_rotary_pos_emb
    (cos/sin: [3, B, S, D])."""
    mrope_section = list(mrope_section) * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))],
                    dim=-1).unsqueeze(unsqueeze_dim)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))],
                    dim=-1).unsqueeze(unsqueeze_dim)
    return (q * cos) + (hf_rotate_half(q) * sin), (k * cos) + (hf_rotate_half(k) * sin)


def qwen3vl_tables(position_ids, dim, mrope_section, base=10000.0):
    """Qwen3VLTextRotaryEmbedding.forward with apply_interleaved_mrope: position_ids [3, B, S]
    -> cos, sin [B, S, dim]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64,
                                            device=position_ids.device) / dim))
    freqs = position_ids.to(torch.float64)[..., None] * inv_freq            # [3, B, S, dim/2]
    freqs_t = freqs[0].clone()
    for d, offset in enumerate((1, 2), start=1):
        length = mrope_section[d] * 3
        idx = slice(offset, length, 3)
        freqs_t[..., idx] = freqs[d, ..., idx]
    emb = torch.cat((freqs_t, freqs_t), dim=-1)
    return emb.cos(), emb.sin()


def qwen3_rms_norm(x, weight, eps):
    """Qwen3RMSNorm.forward (in float64 here)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _t(x):
    return torch.from_numpy(np.ascontiguousarray(x))


def _np(x):
    return x.detach().numpy()


# ------------------------------------------------------------------ CPU: references vs HF code

@needs_torch
@pytest.mark.parametrize("table", ["duplicated", "half", "batched", "positions"])
def test_reference_matches_hf_llama(table, rng):
    b, s, hq, hk, d = 2, 7, 4, 2, 16
    q, k = rng.standard_normal((b, s, hq, d)), rng.standard_normal((b, s, hk, d))
    pos = torch.from_numpy(rng.integers(0, 50, (b, s)))
    cos, sin = hf_rope_tables(pos, d)                                   # [B, S, D]
    eq, ek = hf_apply_rotary_pos_emb(_t(q).transpose(1, 2), _t(k).transpose(1, 2), cos, sin)
    eq, ek = _np(eq.transpose(1, 2)), _np(ek.transpose(1, 2))
    if table == "duplicated":                                   # HF's position_embeddings as is
        args, kw = (_np(cos), _np(sin)), {}
    elif table == "half":                                       # one value per frequency
        args, kw = (_np(cos)[..., : d // 2], _np(sin)[..., : d // 2]), {}
    elif table == "batched":
        args, kw = (_np(cos), _np(sin)), {}
    else:                                                       # a table of positions + indices
        tc, ts = hf_rope_tables(torch.arange(64), d)
        args, kw = (_np(tc)[:, : d // 2], _np(ts)[:, : d // 2]), {"positions": pos.numpy()}
    gq, gk = R.ref_apply_rotary(q, k, *args, **kw)
    np.testing.assert_allclose(gq, eq, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(gk, ek, rtol=1e-12, atol=1e-13)


@needs_torch
def test_reference_shared_table_and_1d_positions(rng):
    s, d = 9, 32
    q, k = rng.standard_normal((3, s, 2, d)), rng.standard_normal((3, s, 1, d))
    cos, sin = hf_rope_tables(torch.arange(s), d)                      # [S, D]
    eq, ek = hf_apply_rotary_pos_emb(_t(q).transpose(1, 2), _t(k).transpose(1, 2), cos, sin,
                                     unsqueeze_dim=0)
    gq, gk = R.ref_apply_rotary(q, k, _np(cos), _np(sin))
    np.testing.assert_allclose(gq, _np(eq.transpose(1, 2)), rtol=1e-12, atol=1e-13)
    tc, ts = hf_rope_tables(torch.arange(40), d)
    gq2, gk2 = R.ref_apply_rotary(q, k, _np(tc)[:, : d // 2], _np(ts)[:, : d // 2],
                                  positions=np.arange(s, dtype=np.int32))
    np.testing.assert_allclose(gq2, gq, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(gk2, gk, rtol=1e-12, atol=1e-13)


@needs_torch
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_reference_matches_hf_gptj(rotary_dim, rng):
    """GPT-J: interleaved pairs, partial rotary (the rest of the head passes through)."""
    b, s, h, d = 2, 5, 3, 16
    q, k = rng.standard_normal((b, s, h, d)), rng.standard_normal((b, s, h, d))
    pos = torch.from_numpy(rng.integers(0, 30, (b, s)))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    sinusoid = pos.to(torch.float64)[..., None] * inv_freq
    sin, cos = sinusoid.sin(), sinusoid.cos()                    # [B, S, rot/2]
    expected = []
    for x in (q, k):
        xt = _t(x)
        rot = gptj_apply_rotary_pos_emb(xt[..., :rotary_dim], sin, cos)
        expected.append(_np(torch.cat([rot, xt[..., rotary_dim:]], dim=-1)))
    got = R.ref_apply_rotary(q, k, _np(cos), _np(sin), True, rotary_dim=rotary_dim)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-13)
    # HF GPT-J's duplicated (repeat_interleave) tables read the same frequencies
    dup = R.ref_apply_rotary(q, k, np.repeat(_np(cos), 2, -1), np.repeat(_np(sin), 2, -1), True,
                             rotary_dim=rotary_dim)
    for g, e in zip(dup, expected):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-13)


@needs_torch
def test_reference_matches_hf_gpt_neox_partial_rotary(rng):
    """GPT-NeoX rotary_pct: rotate_half on the first rotary_ndims, the rest passes through."""
    b, s, hq, d, rot = 2, 6, 3, 24, 8
    q, k = rng.standard_normal((b, s, hq, d)), rng.standard_normal((b, s, hq, d))
    cos, sin = hf_rope_tables(torch.arange(s)[None].expand(b, s), rot)
    expected = []
    for x in (q, k):
        xt = _t(x).transpose(1, 2)
        x_rot, x_pass = xt[..., :rot], xt[..., rot:]
        emb = (x_rot * cos.unsqueeze(1)) + (hf_rotate_half(x_rot) * sin.unsqueeze(1))
        expected.append(_np(torch.cat((emb, x_pass), dim=-1).transpose(1, 2)))
    got = R.ref_apply_rotary(q, k, _np(cos), _np(sin), rotary_dim=rot)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-13)


@needs_torch
@pytest.mark.parametrize("section", [(2, 3, 3), (4, 2, 2), (0, 8, 0)])
def test_reference_matches_hf_qwen2vl_mrope(section, rng):
    b, s, hq, hk, d = 2, 6, 2, 1, 16
    q, k = rng.standard_normal((b, s, hq, d)), rng.standard_normal((b, s, hk, d))
    pos = torch.from_numpy(rng.integers(0, 20, (3, b, s)))
    cos, sin = hf_rope_tables(pos, d)                                   # [3, B, S, D]
    eq, ek = hf_qwen2vl_mrope(_t(q).transpose(1, 2), _t(k).transpose(1, 2), cos, sin, section)
    eq, ek = _np(eq.transpose(1, 2)), _np(ek.transpose(1, 2))
    # HF's per-stream tables as they are
    got = R.ref_apply_rotary(q, k, _np(cos), _np(sin), mrope_section=section)
    # a [P, D/2] table and [3, B, S] positions
    tc, ts = hf_rope_tables(torch.arange(32), d)
    got2 = R.ref_apply_rotary(q, k, _np(tc)[:, : d // 2], _np(ts)[:, : d // 2],
                              positions=pos.numpy(), mrope_section=section)
    for g, e in zip(got + got2, (eq, ek, eq, ek)):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-13)


@needs_torch
@pytest.mark.parametrize("section", [(24, 20, 20), (16, 24, 24)])
def test_reference_matches_hf_qwen3vl_interleaved_mrope(section, rng):
    b, s, hq, hk, d = 2, 5, 2, 2, 128
    q, k = rng.standard_normal((b, s, hq, d)), rng.standard_normal((b, s, hk, d))
    pos = torch.from_numpy(rng.integers(0, 40, (3, b, s)))
    cos, sin = qwen3vl_tables(pos, d, section)                           # [B, S, D]
    eq, ek = hf_apply_rotary_pos_emb(_t(q).transpose(1, 2), _t(k).transpose(1, 2), cos, sin)
    tc, ts = hf_rope_tables(torch.arange(48), d)
    got = R.ref_apply_rotary(q, k, _np(tc)[:, : d // 2], _np(ts)[:, : d // 2],
                             positions=pos.numpy(), mrope_section=section, mrope_interleaved=True)
    np.testing.assert_allclose(got[0], _np(eq.transpose(1, 2)), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got[1], _np(ek.transpose(1, 2)), rtol=1e-12, atol=1e-13)
    # the same through per-stream tables [3, B, S, D] without positions
    c3, s3 = hf_rope_tables(pos, d)
    got3 = R.ref_apply_rotary(q, k, _np(c3), _np(s3), mrope_section=section,
                              mrope_interleaved=True)
    np.testing.assert_allclose(got3[0], got[0], rtol=1e-12, atol=1e-13)


@needs_torch
def test_reference_qk_norm_matches_hf_qwen3(rng):
    b, s, hq, hk, d, eps = 2, 5, 4, 2, 32, 1e-6
    q, k = rng.standard_normal((b, s, hq, d)) * 3, rng.standard_normal((b, s, hk, d))
    wq, wk = 1 + 0.1 * rng.standard_normal(d), 1 + 0.1 * rng.standard_normal(d)
    cos, sin = hf_rope_tables(torch.arange(s)[None].expand(b, s), d)
    qn = qwen3_rms_norm(_t(q), _t(wq), eps).transpose(1, 2)     # Qwen3Attention: norm, transpose
    kn = qwen3_rms_norm(_t(k), _t(wk), eps).transpose(1, 2)
    eq, ek = hf_apply_rotary_pos_emb(qn, kn, cos, sin)
    got = R.ref_qk_norm_rotary(q, k, wq, wk, _np(cos), _np(sin), eps)
    np.testing.assert_allclose(got[0], _np(eq.transpose(1, 2)), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got[1], _np(ek.transpose(1, 2)), rtol=1e-12, atol=1e-13)


def _hf_rope_any(x, c, s, interleaved, rot):
    """HF-style rotation of [B, S, H, D] with per-token frequency tables c, s [B, S, rot/2]."""
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if interleaved:
        out = gptj_apply_rotary_pos_emb(x_rot, s, c)
    else:
        cf, sf = torch.cat([c, c], -1)[:, :, None], torch.cat([s, s], -1)[:, :, None]
        out = x_rot * cf + hf_rotate_half(x_rot) * sf
    return torch.cat([out, x_pass], -1)


@needs_torch
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [16, 8])
def test_backward_references_match_autograd(interleaved, rot, rng):
    b, s, hq, hk, d, eps = 2, 4, 3, 2, 16, 1e-5
    q = torch.from_numpy(rng.standard_normal((b, s, hq, d))).requires_grad_()
    k = torch.from_numpy(rng.standard_normal((b, s, hk, d))).requires_grad_()
    wq = torch.from_numpy(1 + 0.2 * rng.standard_normal(d)).requires_grad_()
    wk = torch.from_numpy(1 + 0.2 * rng.standard_normal(d)).requires_grad_()
    ang = torch.from_numpy(rng.standard_normal((b, s, rot // 2)))
    c, sn = ang.cos(), ang.sin()
    gq, gk = rng.standard_normal((b, s, hq, d)), rng.standard_normal((b, s, hk, d))
    kw = dict(rotary_dim=rot)

    oq, ok = _hf_rope_any(q, c, sn, interleaved, rot), _hf_rope_any(k, c, sn, interleaved, rot)
    eq, ek = torch.autograd.grad((oq * _t(gq)).sum() + (ok * _t(gk)).sum(), (q, k))
    got = R.ref_apply_rotary_backward(gq, gk, _np(c), _np(sn), interleaved, **kw)
    np.testing.assert_allclose(got[0], _np(eq), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got[1], _np(ek), rtol=1e-12, atol=1e-13)

    oq = _hf_rope_any(qwen3_rms_norm(q, wq, eps), c, sn, interleaved, rot)
    ok = _hf_rope_any(qwen3_rms_norm(k, wk, eps), c, sn, interleaved, rot)
    expected = torch.autograd.grad((oq * _t(gq)).sum() + (ok * _t(gk)).sum(), (q, k, wq, wk))
    got = R.ref_qk_norm_rotary_backward(gq, gk, _np(q), _np(k), _np(wq), _np(wk), _np(c),
                                        _np(sn), eps, interleaved, **kw)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, _np(e), rtol=1e-11, atol=1e-12)


def test_argument_errors():
    q, k = np.zeros((2, 3, 4, 8)), np.zeros((2, 3, 2, 8))
    c = np.zeros((3, 4))
    with pytest.raises(ValueError, match="'k' has shape"):
        go.apply_rotary(q, np.zeros((2, 4, 2, 8)), c, c)
    with pytest.raises(ValueError, match="rotary_dim"):
        go.apply_rotary(q, k, np.zeros((3, 3)), np.zeros((3, 3)))
    with pytest.raises(ValueError, match="rotary_dim=5"):
        go.apply_rotary(q, k, c, c, rotary_dim=5)
    with pytest.raises(ValueError, match="'cos' has shape.*'sin' has"):
        go.apply_rotary(q, k, c, np.zeros((3, 8)))
    with pytest.raises(ValueError, match="rows but the sequence has 3"):
        go.apply_rotary(q, k, np.zeros((2, 4)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="batch dim 3"):
        go.apply_rotary(q, k, np.zeros((3, 3, 4)), np.zeros((3, 3, 4)))
    with pytest.raises(ValueError, match="'positions' has shape"):
        go.apply_rotary(q, k, c, c, positions=np.zeros((3, 2), np.int64))
    with pytest.raises(TypeError, match="'positions' has dtype float"):
        go.apply_rotary(q, k, c, c, positions=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="mrope_section"):
        go.apply_rotary(q, k, c, c, positions=np.zeros((3, 2, 3), np.int64),
                        mrope_section=(1, 1, 1))
    with pytest.raises(ValueError, match="needs mrope_section"):
        go.apply_rotary(q, k, c, c, mrope_interleaved=True)
    with pytest.raises(ValueError, match="3 streams first"):
        go.apply_rotary(q, k, np.zeros((2, 3, 4)), np.zeros((2, 3, 4)), mrope_section=(2, 1, 1))
    with pytest.raises(ValueError, match="outside the table"):
        go.apply_rotary(q, k, c, c, positions=np.full((2, 3), 3, np.int64))
    with pytest.raises(ValueError, match="'q_weight' has shape"):
        go.qk_norm_rotary(q, k, np.zeros(4), np.zeros(8), c, c)
    with pytest.raises(ValueError, match="'grad_k' has shape"):
        go.qk_norm_rotary_backward(q, q, q, k, np.zeros(8), np.zeros(8), c, c)


@needs_torch
def test_cpu_path_torch_bfloat16_and_packed(rng):
    t, h, d = 11, 3, 16
    q = torch.from_numpy(rng.standard_normal((t, h, d)).astype(np.float32)).to(torch.bfloat16)
    k = torch.from_numpy(rng.standard_normal((t, 1, d)).astype(np.float32)).to(torch.bfloat16)
    cos = torch.from_numpy(rng.standard_normal((20, d // 2)).astype(np.float32))
    sin = torch.from_numpy(rng.standard_normal((20, d // 2)).astype(np.float32))
    pos = torch.from_numpy(rng.integers(0, 20, t))
    oq, ok = go.apply_rotary(q, k, cos, sin, positions=pos)
    assert oq.dtype == torch.bfloat16 and oq.shape == q.shape
    ref = R.ref_apply_rotary(q.double().numpy(), k.double().numpy(), cos.double().numpy(),
                             sin.double().numpy(), positions=pos.numpy())
    assert_close(oq.double().numpy(), ref[0], "bfloat16", "cpu path q")
    assert_close(ok.double().numpy(), ref[1], "bfloat16", "cpu path k")


# ------------------------------------------------------------------ CPU: the torch layer

@needs_torch
@pytest.mark.parametrize("interleaved", [False, True])
def test_torch_autograd_cpu_float64(interleaved, rng):
    import gpuops.torch as gt
    b, s, hq, hk, d = 2, 5, 4, 2, 16
    q = torch.from_numpy(rng.standard_normal((b, s, hq, d))).requires_grad_()
    k = torch.from_numpy(rng.standard_normal((b, s, hk, d))).requires_grad_()
    wq = torch.from_numpy(1 + 0.2 * rng.standard_normal(d)).requires_grad_()
    wk = torch.from_numpy(1 + 0.2 * rng.standard_normal(d)).requires_grad_()
    ang = torch.from_numpy(rng.standard_normal((s, d // 2)))
    c, sn = ang.cos(), ang.sin()
    cb, sb = c[None].expand(b, s, d // 2), sn[None].expand(b, s, d // 2)
    gq, gk = torch.randn(b, s, hq, d, dtype=torch.float64), torch.randn(b, s, hk, d,
                                                                        dtype=torch.float64)

    oq, ok = gt.apply_rotary(q, k, c, sn, interleaved)
    eq, ek = _hf_rope_any(q, cb, sb, interleaved, d), _hf_rope_any(k, cb, sb, interleaved, d)
    torch.testing.assert_close(oq, eq, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad((oq * gq).sum() + (ok * gk).sum(), (q, k))
    exp = torch.autograd.grad((eq * gq).sum() + (ek * gk).sum(), (q, k))
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)

    oq, ok = gt.qk_norm_rotary(q, k, wq, wk, c, sn, 1e-6, interleaved)
    eq = _hf_rope_any(qwen3_rms_norm(q, wq, 1e-6), cb, sb, interleaved, d)
    ek = _hf_rope_any(qwen3_rms_norm(k, wk, 1e-6), cb, sb, interleaved, d)
    torch.testing.assert_close(ok, ek, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad((oq * gq).sum() + (ok * gk).sum(), (q, k, wq, wk))
    exp = torch.autograd.grad((eq * gq).sum() + (ek * gk).sum(), (q, k, wq, wk))
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e, rtol=1e-11, atol=1e-11)


@needs_torch
def test_torch_ops_schemas_and_fake_tensors():
    import gpuops.torch  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k = torch.empty(2, 3, 4, 8, dtype=torch.bfloat16), torch.empty(2, 3, 2, 8,
                                                                          dtype=torch.bfloat16)
        c, w = torch.empty(3, 4), torch.empty(8)
        oq, ok = torch.ops.gpuops.apply_rotary(q, k, c, c, False, None, None, None, False)
        assert oq.shape == q.shape and ok.dtype == torch.bfloat16
        r = torch.ops.gpuops.qk_norm_rotary_backward(q, k, q, k, w, w, c, c, 1e-6, False, None,
                                                     None, None, False)
        assert [x.shape for x in r] == [q.shape, k.shape, (8,), (8,)] and r[2].dtype == w.dtype
    torch.library.opcheck(torch.ops.gpuops.apply_rotary.default,
                          (torch.randn(1, 2, 2, 4, dtype=torch.float64),
                           torch.randn(1, 2, 1, 4, dtype=torch.float64),
                           torch.randn(2, 2, dtype=torch.float64),
                           torch.randn(2, 2, dtype=torch.float64), False, None, None, None,
                           False))


@needs_torch
def test_torch_compile_fullgraph_cpu():
    """The custom ops trace without graph breaks (fake impls, autograd); the CPU run goes
    through the references."""
    import gpuops.torch as gt
    b, s, hq, hk, d = 1, 4, 2, 1, 8
    q = torch.randn(b, s, hq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, s, hk, d, dtype=torch.float64, requires_grad=True)
    wq = torch.ones(d, dtype=torch.float64, requires_grad=True)
    ang = torch.randn(s, d // 2, dtype=torch.float64)
    c, sn = ang.cos(), ang.sin()

    def f(q, k, wq):
        q1, k1 = gt.qk_norm_rotary(q, k, wq, wq, c, sn)
        q2, k2 = gt.apply_rotary(q1, k1, c, sn, True)
        return (gt.silu_mul(q2, q2) * 2).sum() + gt.gelu_mul(k2, k2).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, wq), (q, k, wq))
    exp = torch.autograd.grad(f(q, k, wq), (q, k, wq))
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ CPU: the kernels, emulated

@pytest.fixture(scope="module")
def emulated():
    """The family's kernels compiled for the host (cached by source hash in the gpuops cache)."""
    if not emu.available():
        pytest.skip("g++ not installed")
    from gpuops.runtime import config
    work = config.settings.cache_dir / "host-emulation"
    work.mkdir(parents=True, exist_ok=True)
    return emu.build([R.ROPE_MODULE, R.NORM_MODULE], str(work))


@pytest.fixture
def emu_ops(emulated, monkeypatch):
    """Route the family's launches to the emulated kernels; returns a runner."""
    monkeypatch.setattr(R, "_kernel", lambda module, dev, expr: emulated[module.name].kernel(expr))
    monkeypatch.setitem(R._bwd_grids, 0, 5)
    monkeypatch.setitem(R._fwd3_grids, 0, 5)

    def run(op_name, dtype, *args, **kwargs):
        op = registry.get(op_name)
        call = emu.Call(op_name, dt.BY_NAME[dtype])
        conv = lambda a: emu.view(a) if isinstance(a, np.ndarray) else a  # noqa: E731
        out = op.impl(call, *[conv(a) for a in args], **{n: conv(v) for n, v in kwargs.items()})
        return tuple(np.asarray(o.obj).astype(np.float64) for o in out)
    return run


def _f64(a):
    return a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype.kind not in "iu" else a


def _reference(op_name, *args, **kwargs):
    op = registry.get(op_name)
    names = [n for n in op.param_names if n != "out"]
    kw = {n: _f64(a) for n, a in zip(names, args)}
    kw.update({n: _f64(v) for n, v in kwargs.items()})
    return op.reference(**kw)


def _arr(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dt.to_numpy(dt.BY_NAME[dtype]))


def _tables(rng, rows, r, dtype, layout="half", interleaved=False, lead=()):
    ang = rng.standard_normal(lead + (rows, r // 2)) * 3
    c, s = np.cos(ang), np.sin(ang)
    if layout == "duplicated":
        c, s = ((np.repeat(c, 2, -1), np.repeat(s, 2, -1)) if interleaved else
                (np.concatenate([c, c], -1), np.concatenate([s, s], -1)))
    npd = dt.to_numpy(dt.BY_NAME[dtype])
    return c.astype(npd), s.astype(npd)


def _weight_sum_bound(g, x, w_like, eps, interleaved, kw, cos, sin, dtype):
    """|dw - ref| allowed: the dtype's tolerance plus fp32 summation error of the row terms
    (bounded by 2^-17 = ~128 sequential additions at 2^-24 each, times sum |gy n|)."""
    p, c, s = R._ref_plan("t", x, x, _f64(cos), _f64(sin), kw.get("positions"), interleaved,
                          kw.get("rotary_dim"), kw.get("mrope_section"),
                          kw.get("mrope_interleaved", False))
    gy = R._ref_rope(p, _f64(g), c, s, interleaved, transpose=True)
    xf = _f64(x)
    n = xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + eps)
    return np.abs(gy * n).reshape(-1, xf.shape[-1]).sum(0) * 2.0 ** -17


def _check_weight_grad(got, ref, sum_bound, dtype, what):
    tol = TOLERANCE[dtype]
    err = np.abs(got - ref)
    bound = tol["atol"] + tol["rtol"] * np.abs(ref) + sum_bound
    assert np.all(err <= bound), f"{what}: worst err {np.max(err - bound):.3g} over the bound"


def _record_launches(monkeypatch):
    """The kernel names the family launches from now on (appended as launched)."""
    launched = []
    real = R._kernel
    monkeypatch.setattr(R, "_kernel", lambda m, dev, expr: launched.append(expr) or
                        real(m, dev, expr))
    return launched


EMU_CASES = [
    # (B, S, Hq, Hk, D, rotary_dim or None)
    (2, 5, 3, 1, 16, None),
    (1, 3, 2, 2, 64, 32),
    (2, 2, 1, 3, 128, None),
    (1, 4, 2, 1, 24, 8),
]


@needs_gxx
@pytest.mark.parametrize("dtype,table_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                               ("float16", "float32")])
@pytest.mark.parametrize("interleaved", [False, True])
def test_emulated_apply_rotary(emu_ops, dtype, table_dtype, interleaved, rng):
    for b, s, hq, hk, d, rot in EMU_CASES:
        r = rot or d
        q, k = _arr(rng, (b, s, hq, d), dtype, 2), _arr(rng, (b, s, hk, d), dtype, 2)
        for layout in ("half", "duplicated"):
            c, sn = _tables(rng, s, r, table_dtype, layout, interleaved)
            for op in ("apply_rotary", "apply_rotary_backward"):
                got = emu_ops(op, dtype, q, k, c, sn, interleaved, rotary_dim=rot)
                ref = _reference(op, q, k, c, sn, interleaved, rotary_dim=rot)
                for i in range(2):
                    assert_close(got[i], ref[i], dtype, f"{op} {b, s, hq, hk, d, rot} {layout}")


@needs_gxx
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_emulated_layouts(emu_ops, dtype, rng):
    """Positions (int32/int64, [B, S] and [S]), batched tables, packed tokens, strided and
    unaligned views (the one-element kernel), HF's transposed view, out-of-range positions."""
    b, s, hq, hk, d = 2, 5, 3, 2, 32
    base_q = _arr(rng, (b, s, hq, 2 * d + 1), dtype, 2)
    cases = {
        "strided_last_dim": (base_q[..., : 2 * d : 2], _arr(rng, (b, s, hk, d), dtype)),
        "unaligned": (base_q[..., 1: d + 1], _arr(rng, (b, s, hk, d), dtype)),
        "hf_transposed": (_arr(rng, (b, hq, s, d), dtype).transpose(0, 2, 1, 3),
                          _arr(rng, (b, hk, s, d), dtype).transpose(0, 2, 1, 3)),
        "from_qkv": tuple(np.split(_arr(rng, (b, s, hq + hk, d), dtype), [hq], axis=2)),
    }
    c, sn = _tables(rng, 40, d, dtype)
    for name, (q, k) in cases.items():
        for pos in (None, rng.integers(0, 40, (b, s)).astype(np.int32),
                    rng.integers(0, 40, (s,)).astype(np.int64)):
            kw = {} if pos is None else {"positions": pos}
            got = emu_ops("apply_rotary", dtype, q, k, c, sn, **kw)
            ref = _reference("apply_rotary", q, k, c, sn, **kw)
            for i in range(2):
                assert_close(got[i], ref[i], dtype, f"{name} positions={pos is not None}")
    q, k = _arr(rng, (b, s, hq, d), dtype), _arr(rng, (b, s, hk, d), dtype)
    cb, sb = _tables(rng, s, d, dtype, lead=(b,))
    got = emu_ops("apply_rotary", dtype, q, k, cb, sb)
    ref = _reference("apply_rotary", q, k, cb, sb)
    assert_close(got[0], ref[0], dtype, "batched tables")
    packed_q, packed_k = _arr(rng, (7, hq, d), dtype), _arr(rng, (7, hk, d), dtype)
    pos = rng.integers(0, 40, 7)
    got = emu_ops("apply_rotary", dtype, packed_q, packed_k, c, sn, positions=pos)
    ref = _reference("apply_rotary", packed_q, packed_k, c, sn, positions=pos)
    assert_close(got[1], ref[1], dtype, "packed")
    # out of range: NaN for that token's rotated part, no out-of-bounds read
    bad = np.array([[0, 40, 3, -1, 39], [1, 2, 3, 4, 5]], np.int64)
    got = emu_ops("apply_rotary", dtype, q, k, c, sn, positions=bad)
    assert np.isnan(got[0][0, 1]).all() and np.isnan(got[0][0, 3]).all()
    ok = np.ones((b, s), bool)
    ok[0, 1] = ok[0, 3] = False
    ref = _reference("apply_rotary", q[ok][None], k[ok][None], c, sn, positions=bad[ok][None])
    assert_close(got[0][ok][None], ref[0], dtype, "rows with valid positions")


@needs_gxx
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("section,interleaved_mrope", [((16, 24, 24), False), ((24, 20, 20), True),
                                                       ((10, 30, 24), False)])
def test_emulated_mrope(emu_ops, dtype, section, interleaved_mrope, rng):
    b, s, hq, hk, d = 2, 3, 2, 1, 128
    q, k = _arr(rng, (b, s, hq, d), dtype), _arr(rng, (b, s, hk, d), dtype)
    c, sn = _tables(rng, 30, d, dtype)
    pos = rng.integers(0, 30, (3, b, s))
    kw = dict(mrope_section=section, mrope_interleaved=interleaved_mrope)
    for op in ("apply_rotary", "apply_rotary_backward"):
        got = emu_ops(op, dtype, q, k, c, sn, positions=pos, **kw)
        ref = _reference(op, q, k, c, sn, positions=pos, **kw)
        assert_close(got[0], ref[0], dtype, f"{op} {section}")
        assert_close(got[1], ref[1], dtype, f"{op} {section}")
    c3, s3 = _tables(rng, s, d, dtype, "duplicated", lead=(3, b))      # HF's [3, B, S, D]
    got = emu_ops("apply_rotary", dtype, q, k, c3, s3, **kw)
    ref = _reference("apply_rotary", q, k, c3, s3, **kw)
    assert_close(got[0], ref[0], dtype, "per-stream tables")
    wq, wk = 1 + _arr(rng, (d,), dtype, 0.2), 1 + _arr(rng, (d,), dtype, 0.2)
    got = emu_ops("qk_norm_rotary", dtype, q, k, wq, wk, c, sn, positions=pos, **kw)
    ref = _reference("qk_norm_rotary", q, k, wq, wk, c, sn, positions=pos, **kw)
    assert_close(got[1], ref[1], dtype, "qk_norm M-RoPE")


@needs_gxx
@pytest.mark.parametrize("dtype,table_dtype", [("float32", "float32"), ("bfloat16", "float32"),
                                               ("float16", "float16")])
@pytest.mark.parametrize("interleaved", [False, True])
def test_emulated_qk_norm_rotary(emu_ops, dtype, table_dtype, interleaved, rng):
    eps = 1e-6
    for b, s, hq, hk, d, rot in EMU_CASES[:3]:
        q, k = _arr(rng, (b, s, hq, d), dtype, 2), _arr(rng, (b, s, hk, d), dtype)
        wq = (1 + 0.3 * rng.standard_normal(d)).astype(dt.to_numpy(dt.BY_NAME[table_dtype]))
        wk = (1 + 0.3 * rng.standard_normal(d)).astype(wq.dtype)
        c, sn = _tables(rng, s, rot or d, table_dtype, "half", interleaved)
        kw = dict(rotary_dim=rot)
        got = emu_ops("qk_norm_rotary", dtype, q, k, wq, wk, c, sn, eps, interleaved, **kw)
        ref = _reference("qk_norm_rotary", q, k, wq, wk, c, sn, eps, interleaved, **kw)
        for i in range(2):
            assert_close(got[i], ref[i], dtype, f"qk_norm {b, s, hq, hk, d, rot}")
        gq, gk = _arr(rng, q.shape, dtype), _arr(rng, k.shape, dtype)
        views = {"contiguous": (gq, q), "strided": (gq, _arr(rng, q.shape + (2,), dtype)[..., 0])}
        for name, (g, x) in views.items():
            got = emu_ops("qk_norm_rotary_backward", dtype, g, gk, x, k, wq, wk, c, sn, eps,
                          interleaved, **kw)
            ref = _reference("qk_norm_rotary_backward", g, gk, x, k, wq, wk, c, sn, eps,
                             interleaved, **kw)
            for i in range(2):
                assert_close(got[i], ref[i], dtype, f"grad {i} {name} {b, s, hq, hk, d, rot}")
            for i, (gg, xx) in ((2, (g, x)), (3, (gk, k))):
                bound = _weight_sum_bound(gg, xx, wq, eps, interleaved, kw, c, sn, dtype)
                _check_weight_grad(got[i], ref[i], bound, table_dtype, f"dw {i} {name}")


@needs_gxx
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_emulated_qk_norm_forward_kernels_agree(emu_ops, monkeypatch, dtype, rng):
    """qk_norm_rope_fwd3 (persistent, next row loaded ahead) on grids of 1, 2 and 5 blocks, i.e.
    many rows per lane, a last step where only part of a warp has rows, positions (one out of
    range: NaN in the rotated half), partial rotary and odd head counts: the reference, and
    fwd2's bits."""
    launched = _record_launches(monkeypatch)
    for b, s, hq, hk, d, rot in [(2, 7, 5, 3, 64, None), (1, 9, 3, 2, 128, 64),
                                 (3, 4, 2, 1, 32, None)]:
        q, k = _arr(rng, (b, s, hq, d), dtype, 2), _arr(rng, (b, s, hk, d), dtype)
        wq = (1 + 0.3 * rng.standard_normal(d)).astype(q.dtype)
        wk = (1 + 0.3 * rng.standard_normal(d)).astype(q.dtype)
        c, sn = _tables(rng, 16, rot or d, dtype)
        pos = rng.integers(0, 16, (b, s))
        kw = dict(rotary_dim=rot, positions=pos)
        ref = _reference("qk_norm_rotary", q, k, wq, wk, c, sn, 1e-6, False, **kw)
        outs = {}
        for kind, blocks in (("fwd2", 5), ("fwd3", 1), ("fwd3", 2), ("fwd3", 5), ("fwd4", 5)):
            monkeypatch.setattr(R, "QK_NORM_FORWARD", kind)
            monkeypatch.setitem(R._fwd3_grids, 0, blocks)
            launched.clear()
            got = emu_ops("qk_norm_rotary", dtype, q, k, wq, wk, c, sn, 1e-6, False, **kw)
            assert len(launched) == 1 and f"qk_norm_rope_{kind}<" in launched[0], launched
            for i in range(2):
                assert_close(got[i], ref[i], dtype, f"{kind} grid {blocks} {b, s, hq, hk, d}")
            outs[kind, blocks] = got
        for key, got in outs.items():
            for i in range(2):
                assert np.array_equal(got[i], outs["fwd2", 5][i]), key
        pos_bad = pos.copy()
        pos_bad[0, 1] = 16                                # outside the table: NaN rotated half
        half = (rot or d) // 2
        for kind in ("fwd2", "fwd3", "fwd4"):
            monkeypatch.setattr(R, "QK_NORM_FORWARD", kind)
            got = emu_ops("qk_norm_rotary", dtype, q, k, wq, wk, c, sn, 1e-6, False,
                          rotary_dim=rot, positions=pos_bad)
            assert np.isnan(got[0][0, 1, :, :2 * half]).all(), kind
            assert not np.isnan(got[0][0, 1, :, 2 * half:]).any(), kind
            assert not np.isnan(got[0][0, 0]).any() and not np.isnan(got[1][1:]).any(), kind


@needs_gxx
def test_emulated_qk_norm_forward_auto_rule(emu_ops, monkeypatch, rng):
    """"auto" takes fwd4 where its conditions hold (table words, unit-stride aligned weights),
    else fwd3 for float16 (strided weights), else fwd2 (interleaved pairs, float32 tables with
    16-bit data, strided weights of other dtypes)."""
    launched = _record_launches(monkeypatch)
    monkeypatch.setattr(R, "QK_NORM_FORWARD", "auto")
    for dtype, table_dtype, interleaved, strided_w, kind in [
            ("float16", "float16", False, False, "fwd4"),
            ("bfloat16", "bfloat16", False, False, "fwd4"),
            ("float32", "float32", False, False, "fwd4"),
            ("float16", "float16", False, True, "fwd3"),
            ("bfloat16", "bfloat16", False, True, "fwd2"),
            ("float16", "float16", True, False, "fwd2"),
            ("float16", "float32", False, False, "fwd2")]:
        q, k = _arr(rng, (2, 3, 4, 64), dtype), _arr(rng, (2, 3, 2, 64), dtype)
        w = (1 + 0.3 * rng.standard_normal(128 if strided_w else 64)).astype(
            dt.to_numpy(dt.BY_NAME[table_dtype]))
        w = w[::2] if strided_w else w
        c, sn = _tables(rng, 3, 64, table_dtype)
        launched.clear()
        got = emu_ops("qk_norm_rotary", dtype, q, k, w, w, c, sn, 1e-6, interleaved)
        assert len(launched) == 1 and f"qk_norm_rope_{kind}<" in launched[0], (dtype, launched)
        ref = _reference("qk_norm_rotary", q, k, w, w, c, sn, 1e-6, interleaved)
        for i in range(2):
            assert_close(got[i], ref[i], dtype, f"auto {dtype} {table_dtype} {interleaved}")


@needs_gxx
def test_emulated_weight_grads_deterministic_and_grid_independent(emu_ops, monkeypatch, rng):
    b, s, hq, hk, d = 3, 7, 4, 2, 64
    q, k = _arr(rng, (b, s, hq, d), "float32"), _arr(rng, (b, s, hk, d), "float32")
    g1, g2 = _arr(rng, q.shape, "float32"), _arr(rng, k.shape, "float32")
    w = np.ones(d, np.float32)
    c, sn = _tables(rng, s, d, "float32")
    args = (g1, g2, q, k, w, w, c, sn)
    first = emu_ops("qk_norm_rotary_backward", "float32", *args)
    again = emu_ops("qk_norm_rotary_backward", "float32", *args)
    for a, bb in zip(first, again):
        assert np.array_equal(a, bb)                       # bit for bit
    ref = _reference("qk_norm_rotary_backward", *args)
    for blocks in (1, 2, 64):                              # other persistent grids
        monkeypatch.setitem(R._bwd_grids, 0, blocks)
        got = emu_ops("qk_norm_rotary_backward", "float32", *args)
        for i in range(2):
            assert_close(got[i], ref[i], "float32", f"grid {blocks}")
        for i, (gg, xx) in ((2, (g1, q)), (3, (g2, k))):
            bound = _weight_sum_bound(gg, xx, w, 1e-6, False, {}, c, sn, "float32")
            _check_weight_grad(got[i], ref[i], bound, "float32", f"dw grid {blocks}")


@needs_gxx
def test_emulated_empty_inputs(emu_ops, rng):
    q, k = np.zeros((2, 0, 3, 16), np.float32), np.zeros((2, 0, 1, 16), np.float32)
    c = np.zeros((4, 8), np.float32)
    oq, ok = emu_ops("apply_rotary", "float32", q, k, c, c)
    assert oq.shape == q.shape and ok.shape == k.shape
    dq, dk, dwq, dwk = emu_ops("qk_norm_rotary_backward", "float32", q, k, q, k,
                               np.ones(16, np.float32), np.ones(16, np.float32), c, c)
    assert dq.shape == q.shape and np.array_equal(dwq, np.zeros(16)) and not dwk.any()


# ------------------------------------------------------------------ GPU

def _cuda(x, dtype=None):
    t = torch.from_numpy(np.ascontiguousarray(x)).cuda()
    return t.to(getattr(torch, dtype)) if dtype else t


def _randn(shape, dtype, scale=1.0):
    return (torch.randn(shape, device="cuda") * scale).to(getattr(torch, dtype))


def _host(t):
    return t.detach().double().cpu().numpy() if t.is_floating_point() else t.cpu().numpy()


def _gpu_tables(rows, r, dtype, layout="half", interleaved=False, lead=()):
    ang = torch.randn(lead + (rows, r // 2), device="cuda", dtype=torch.float64) * 3
    c, s = ang.cos(), ang.sin()
    if layout == "duplicated":
        if interleaved:
            c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
        else:
            c, s = torch.cat([c, c], -1), torch.cat([s, s], -1)
    return c.to(getattr(torch, dtype)), s.to(getattr(torch, dtype))


def _gpu_check(op_name, dtype, args, kwargs, what="", dw_dtype=None):
    got = getattr(go, op_name)(*args, **kwargs)
    names = [n for n in registry.get(op_name).param_names if n != "out"]
    ref_kw = {n: (_host(a) if isinstance(a, torch.Tensor) else a) for n, a in zip(names, args)}
    ref_kw.update({n: (_host(v) if isinstance(v, torch.Tensor) else v) for n, v in kwargs.items()})
    ref = registry.get(op_name).reference(**ref_kw)
    for i, (g, r) in enumerate(zip(got, ref)):
        if i < 2:
            assert g.dtype == args[i].dtype and g.shape == args[i].shape
            assert_close(_host(g), r, dtype, f"{op_name} {what} output {i}")
    return got, ref


GPU_SHAPES = [
    # (B, S, Hq, Hk, D, rotary_dim)
    (1, 1, 1, 1, 64, None),
    (2, 3, 4, 2, 128, None),
    (1, 1000, 8, 1, 128, None),
    (3, 17, 5, 3, 80, None),
    (2, 9, 4, 4, 128, 64),
    (1, 33, 2, 1, 256, None),
    (1, 5, 3, 2, 96, 32),
    (16, 1, 32, 8, 128, None),       # decode
]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_dtype", ["same", "float32"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gpu_apply_rotary(dtype, table_dtype, interleaved):
    tdt = dtype if table_dtype == "same" else "float32"
    for b, s, hq, hk, d, rot in GPU_SHAPES:
        q, k = _randn((b, s, hq, d), dtype, 2), _randn((b, s, hk, d), dtype, 2)
        for layout in ("half", "duplicated"):
            c, sn = _gpu_tables(s, rot or d, tdt, layout, interleaved)
            for op in ("apply_rotary", "apply_rotary_backward"):
                _gpu_check(op, dtype, (q, k, c, sn, interleaved), {"rotary_dim": rot},
                           f"{b, s, hq, hk, d, rot} {layout}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_apply_rotary_layouts(dtype):
    b, s, hq, hk, d = 2, 37, 4, 2, 128
    qkv = _randn((b, s, hq + 2 * hk, d), dtype)
    q, k = qkv[:, :, :hq], qkv[:, :, hq: hq + hk]                       # fused projection
    c, sn = _gpu_tables(64, d, dtype)
    pos32 = torch.randint(0, 64, (b, s), device="cuda", dtype=torch.int32)
    pos64 = torch.randint(0, 64, (s,), device="cuda")
    for pos in (None, pos32, pos64):
        kw = {} if pos is None else {"positions": pos}
        _gpu_check("apply_rotary", dtype, (q, k, c, sn), kw, "qkv slices")
    hf_q = _randn((b, hq, s, d), dtype).transpose(1, 2)                  # HF's view
    hf_k = _randn((b, hk, s, d), dtype).transpose(1, 2)
    _gpu_check("apply_rotary", dtype, (hf_q, hf_k, c, sn), {"positions": pos32}, "transposed")
    strided = _randn((b, s, hq, 2 * d), dtype)[..., ::2]                 # one-element kernel
    _gpu_check("apply_rotary", dtype, (strided, k, c, sn), {}, "strided last dim")
    flat = _randn((b * s * hq * d + 1,), dtype)
    unaligned = flat[1:].view(b, s, hq, d)
    _gpu_check("apply_rotary_backward", dtype, (unaligned, k, c, sn), {}, "unaligned")
    cb, sb = _gpu_tables(s, d, dtype, "duplicated", lead=(b,))          # HF [B, S, D]
    _gpu_check("apply_rotary", dtype, (q, k, cb, sb), {}, "HF tables")
    tq, tk = _randn((1000, hq, d), dtype), _randn((1000, hk, d), dtype)   # packed varlen
    pos = torch.randint(0, 64, (1000,), device="cuda")
    _gpu_check("apply_rotary", dtype, (tq, tk, c, sn), {"positions": pos}, "packed")
    bad = pos32.clone()
    bad[0, 3], bad[1, 0] = 64, -5
    oq, _ = go.apply_rotary(q, k, c, sn, positions=bad)
    assert torch.isnan(oq[0, 3]).all() and torch.isnan(oq[1, 0]).all()
    assert not torch.isnan(oq[0, 4]).any()


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("section,interleaved_mrope", [((16, 24, 24), False), ((24, 20, 20), True),
                                                       ((10, 30, 24), False)])
def test_gpu_mrope(dtype, section, interleaved_mrope):
    b, s, hq, hk, d = 2, 50, 4, 2, 128
    q, k = _randn((b, s, hq, d), dtype), _randn((b, s, hk, d), dtype)
    c, sn = _gpu_tables(100, d, dtype)
    pos = torch.randint(0, 100, (3, b, s), device="cuda")
    kw = dict(positions=pos, mrope_section=section, mrope_interleaved=interleaved_mrope)
    for op in ("apply_rotary", "apply_rotary_backward"):
        _gpu_check(op, dtype, (q, k, c, sn), kw, f"M-RoPE {section}")
    c3, s3 = _gpu_tables(s, d, dtype, "duplicated", lead=(3, b))
    _gpu_check("apply_rotary", dtype, (q, k, c3, s3),
               dict(mrope_section=section, mrope_interleaved=interleaved_mrope), "HF [3,B,S,D]")
    w = _randn((d,), dtype) * 0.1 + 1
    _gpu_check("qk_norm_rotary", dtype, (q, k, w, w, c, sn), kw, "qk_norm M-RoPE")


def _gpu_check_norm_backward(dtype, args, kwargs, what):
    (dq, dk, dwq, dwk), ref = _gpu_check("qk_norm_rotary_backward", dtype, args, kwargs, what)
    g1, g2, q, k, wq, wk, c, sn = args[:8]
    eps = args[8] if len(args) > 8 else 1e-6
    inter = args[9] if len(args) > 9 else False
    kw = {n: (_host(v) if isinstance(v, torch.Tensor) else v) for n, v in kwargs.items()}
    wdt = str(wq.dtype).replace("torch.", "")
    for got, r, g, x in ((dwq, ref[2], g1, q), (dwk, ref[3], g2, k)):
        assert got.dtype == wq.dtype and got.shape == wq.shape
        bound = _weight_sum_bound(_host(g), _host(x), None, eps, inter, kw, _host(c), _host(sn),
                                  wdt)
        _check_weight_grad(_host(got), r, bound, wdt, f"{what} dw")
    return dq, dk, dwq, dwk


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_dtype", ["same", "float32"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gpu_qk_norm_rotary(dtype, table_dtype, interleaved):
    tdt = dtype if table_dtype == "same" else "float32"
    for b, s, hq, hk, d, rot in GPU_SHAPES:
        q, k = _randn((b, s, hq, d), dtype, 3), _randn((b, s, hk, d), dtype)
        wq, wk = (_randn((d,), tdt) * 0.3 + 1), (_randn((d,), tdt) * 0.3 + 1)
        c, sn = _gpu_tables(s, rot or d, tdt, "half", interleaved)
        kw = {"rotary_dim": rot}
        _gpu_check("qk_norm_rotary", dtype, (q, k, wq, wk, c, sn, 1e-6, interleaved), kw,
                   f"{b, s, hq, hk, d, rot}")
        g1, g2 = _randn(q.shape, dtype), _randn(k.shape, dtype)
        _gpu_check_norm_backward(dtype, (g1, g2, q, k, wq, wk, c, sn, 1e-6, interleaved), kw,
                                 f"{b, s, hq, hk, d, rot}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_qk_norm_forward_kernels(dtype, monkeypatch):
    """fwd4 (the default), fwd3 (persistent) and fwd2 at sizes where each lane of fwd3's grid
    walks many rows and the last step covers part of a warp: the reference, the same bits, and
    each kernel actually launched."""
    launched = _record_launches(monkeypatch)
    for b, s, hq, hk, d, rot, positions in [(2, 1000, 32, 8, 128, None, False),
                                            (1, 777, 7, 3, 64, None, True),
                                            (3, 129, 16, 2, 192, 128, True)]:
        q, k = _randn((b, s, hq, d), dtype, 3), _randn((b, s, hk, d), dtype)
        wq, wk = (_randn((d,), dtype) * 0.3 + 1), (_randn((d,), dtype) * 0.3 + 1)
        c, sn = _gpu_tables(2048, rot or d, dtype)
        kw = {"rotary_dim": rot}
        if positions:
            kw["positions"] = torch.randint(0, 2048, (b, s), device="cuda")
        outs = {}
        for kind in ("fwd4", "fwd3", "fwd2"):
            monkeypatch.setattr(R, "QK_NORM_FORWARD", kind)
            launched.clear()
            outs[kind], _ = _gpu_check("qk_norm_rotary", dtype, (q, k, wq, wk, c, sn), kw,
                                       f"{kind} {b, s, hq, hk, d, rot}")
            assert any(f"qk_norm_rope_{kind}<" in e for e in launched), launched
        for kind in ("fwd4", "fwd3"):
            for x, y in zip(outs[kind], outs["fwd2"]):
                assert torch.equal(x, y), kind


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_qk_norm_layouts_and_determinism(dtype):
    b, s, hq, hk, d = 2, 300, 8, 2, 128
    qkv = _randn((b, s, hq + 2 * hk, d), dtype, 2)
    q, k = qkv[:, :, :hq], qkv[:, :, hq: hq + hk]
    w = _randn((d,), dtype) * 0.2 + 1
    c, sn = _gpu_tables(512, d, dtype)
    pos = torch.randint(0, 512, (b, s), device="cuda")
    _gpu_check("qk_norm_rotary", dtype, (q, k, w, w, c, sn), {"positions": pos}, "qkv slices")
    g1 = _randn((b, s, hq, 2 * d), dtype)[..., ::2]                      # one-element kernels
    g2 = torch.ones(1, device="cuda", dtype=q.dtype).expand(b, s, hk, d)  # sum().backward()
    args = (g1, g2, q, k, w, w, c, sn)
    first = _gpu_check_norm_backward(dtype, args, {"positions": pos}, "strided grads")
    again = go.qk_norm_rotary_backward(*args, positions=pos)
    for x, y in zip(first, again):
        assert torch.equal(x, y)                                          # deterministic


@gpu
@needs_torch_cuda
def test_gpu_side_stream_and_cuda_graph_decode():
    b, hq, hk, d = 16, 32, 8, 128
    c, sn = _gpu_tables(4096, d, "bfloat16")
    w = _randn((d,), "bfloat16") * 0.1 + 1
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        q, k = _randn((b, 1, hq, d), "bfloat16"), _randn((b, 1, hk, d), "bfloat16")
        pos = torch.randint(0, 4096, (b, 1), device="cuda")
        oq, ok = go.qk_norm_rotary(q, k, w, w, c, sn, positions=pos)
    side.synchronize()
    ref = R.ref_qk_norm_rotary(_host(q), _host(k), _host(w), _host(w), _host(c), _host(sn),
                               positions=_host(pos))
    assert_close(_host(oq), ref[0], "bfloat16", "side stream")

    static_q, static_k = _randn((b, 1, hq, d), "bfloat16"), _randn((b, 1, hk, d), "bfloat16")
    static_pos = torch.zeros((b, 1), device="cuda", dtype=torch.int64)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                       # warm-up (module loads)
        go.apply_rotary(static_q, static_k, c, sn, positions=static_pos)
        go.qk_norm_rotary(static_q, static_k, w, w, c, sn, positions=static_pos)
        go.qk_norm_rotary_backward(static_q, static_k, static_q, static_k, w, w, c, sn,
                                   positions=static_pos)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gq, gk = go.apply_rotary(static_q, static_k, c, sn, positions=static_pos)
        nq, nk = go.qk_norm_rotary(static_q, static_k, w, w, c, sn, positions=static_pos)
        bw = go.qk_norm_rotary_backward(nq, nk, static_q, static_k, w, w, c, sn,
                                        positions=static_pos)
    for step in range(2):
        static_q.copy_(_randn((b, 1, hq, d), "bfloat16"))
        static_k.copy_(_randn((b, 1, hk, d), "bfloat16"))
        static_pos.copy_(torch.randint(0, 4096, (b, 1), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        hq_, hk_, hp = _host(static_q), _host(static_k), _host(static_pos)
        ref = R.ref_apply_rotary(hq_, hk_, _host(c), _host(sn), positions=hp)
        assert_close(_host(gq), ref[0], "bfloat16", f"graph replay {step}")
        ref = R.ref_qk_norm_rotary(hq_, hk_, _host(w), _host(w), _host(c), _host(sn),
                                   positions=hp)
        assert_close(_host(nk), ref[1], "bfloat16", f"graph replay {step}")
        ref = R.ref_qk_norm_rotary_backward(_host(nq), _host(nk), hq_, hk_, _host(w), _host(w),
                                            _host(c), _host(sn), positions=hp)
        assert_close(_host(bw[0]), ref[0], "bfloat16", f"graph replay backward {step}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_torch_autograd_matches_torch(dtype):
    import gpuops.torch as gt
    b, s, hq, hk, d = 2, 64, 8, 2, 128
    td = getattr(torch, dtype)
    q = _randn((b, s, hq, d), dtype, 2).requires_grad_()
    k = _randn((b, s, hk, d), dtype).requires_grad_()
    wq = (torch.randn(d, device="cuda") * 0.2 + 1).to(td).requires_grad_()
    wk = (torch.randn(d, device="cuda") * 0.2 + 1).to(td).requires_grad_()
    pos = torch.arange(s, device="cuda")[None].expand(b, s)
    cos, sin = (t.to(td) for t in hf_rope_tables(pos, d))                # HF [B, S, D]
    gq, gk = _randn(q.shape, dtype), _randn(k.shape, dtype)

    def torch_ref(q, k, wq, wk):
        xq = qwen3_rms_norm(q.double(), wq.double(), 1e-6).transpose(1, 2)
        xk = qwen3_rms_norm(k.double(), wk.double(), 1e-6).transpose(1, 2)
        oq, ok = hf_apply_rotary_pos_emb(xq, xk, cos.double(), sin.double())
        return oq.transpose(1, 2), ok.transpose(1, 2)

    oq, ok = gt.qk_norm_rotary(q, k, wq, wk, cos, sin)
    eq, ek = torch_ref(q, k, wq, wk)
    assert_close(_host(oq), _host(eq), dtype, "forward q")
    got = torch.autograd.grad((oq.double() * gq.double()).sum() + (ok.double() * gk.double()).sum(),
                              (q, k, wq, wk))
    exp = torch.autograd.grad((eq * gq.double()).sum() + (ek * gk.double()).sum(), (q, k, wq, wk))
    assert_close(_host(got[0]), _host(exp[0]), dtype, "grad q")
    assert_close(_host(got[1]), _host(exp[1]), dtype, "grad k")
    for i in (2, 3):
        x = q if i == 2 else k
        g = gq if i == 2 else gk
        n = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        bound = (n.abs() * g.double().abs()).sum((0, 1, 2)) * 2.0 ** -17
        _check_weight_grad(_host(got[i]), _host(exp[i]), _host(bound), dtype, f"grad w {i}")

    ro, rk = gt.apply_rotary(q, k, cos, sin)
    eo, er = hf_apply_rotary_pos_emb(q.double().transpose(1, 2), k.double().transpose(1, 2),
                                     cos.double(), sin.double())
    assert_close(_host(ro), _host(eo.transpose(1, 2)), dtype, "apply_rotary forward")
    got = torch.autograd.grad((ro * gq).sum() + (rk * gk).sum(), (q, k))
    exp = torch.autograd.grad((eo.transpose(1, 2) * gq.double()).sum()
                              + (er.transpose(1, 2) * gk.double()).sum(), (q, k))
    assert_close(_host(got[0]), _host(exp[0]), dtype, "apply_rotary grad q")


@gpu
@needs_torch_cuda
def test_gpu_torch_compile_fullgraph():
    import gpuops.torch as gt
    b, s, hq, hk, d = 2, 16, 4, 2, 64
    q = _randn((b, s, hq, d), "bfloat16").requires_grad_()
    k = _randn((b, s, hk, d), "bfloat16").requires_grad_()
    w = torch.ones(d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    c, sn = _gpu_tables(s, d, "bfloat16")

    def f(q, k, w):
        q1, k1 = gt.qk_norm_rotary(q, k, w, w, c, sn)
        q2, k2 = gt.apply_rotary(q1 * 2, k1, c, sn)
        return gt.silu_mul(q2, q2).float().sum() + gt.gelu_mul(k2, k2).float().sum()

    compiled = torch.compile(f, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, w), (q, k, w))
    exp = torch.autograd.grad(f(q, k, w), (q, k, w))
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e)


@gpu
@needs_torch_cuda
def test_gpu_table_dtype_errors():
    q, k = _randn((1, 2, 2, 16), "bfloat16"), _randn((1, 2, 1, 16), "bfloat16")
    c16 = _randn((2, 8), "float16")
    with pytest.raises(TypeError, match="q's dtype"):
        go.apply_rotary(q, k, c16, c16)
    c32 = _randn((2, 8), "float32")
    with pytest.raises(TypeError, match="must share one dtype"):
        go.apply_rotary(q, k, c32, c32.to(torch.bfloat16))
    w = _randn((16,), "bfloat16")
    with pytest.raises(TypeError, match="must share one dtype"):
        go.qk_norm_rotary(q, k, w, w, c32, c32)
