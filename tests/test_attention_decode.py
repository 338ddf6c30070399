"""Decode attention (contiguous and paged KV caches) and append_paged_kv against float64 references.

CPU: the references against torch's SDPA in float64 (bottom-right causal mask, GQA by repeated kv
heads, windows as explicit masks), the log-sum-exp against torch.logsumexp; argument errors; the
CPU fallback for NumPy and CPU torch inputs (append_paged_kv updates them in place); and the CUDA
kernels themselves compiled for the host by tests/cuda_host_emulation.py and launched through the
ops' real host code (16-byte and one-element paths, every dtype, GQA 1/2/8, Sq 1 and 4, several
splits, empty splits, windows, paged with random block tables, poisoned workspaces).
GPU: every dtype against the references for lengths 1, 17, 1000, 4097, GQA 1/2/8, Sq 1 and 4,
head dims 64/128/256 and a general one, windows, strided caches, paged with random block tables
(paged == contiguous bit for bit), append then attend, and a CUDA graph replayed with other
lengths.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import gpuops as go
from gpuops import dtypes as dt
from gpuops import registry
from gpuops.ops import attention_decode as A
from conftest import HAS_TORCH, assert_close, gpu, needs_torch, needs_torch_cuda

import cuda_host_emulation as emu
import emu as kernel_emu

torch = pytest.importorskip("torch") if HAS_TORCH else None
DTYPES = ["float32", "float16", "bfloat16"]


def _np(dtype):
    return dt.to_numpy(dt.BY_NAME[dtype])


def _arr(rng, shape, dtype):
    return rng.standard_normal(shape).astype(_np(dtype))


def _caches_nan_past(rng, lens, s_max, hkv, d, dtype):
    """Random K and V caches [B, s_max, hkv, d] holding NaN at and past each sequence's length
    (what a kernel must never let into P V)."""
    shape = (len(lens), s_max, hkv, d)
    k, v = _arr(rng, shape, dtype), _arr(rng, shape, dtype)
    for i, n in enumerate(lens):
        k[i, n:] = np.nan
        v[i, n:] = np.nan
    return k, v


def _paged_from(rng, k, v, page_size, extra_pages=3):
    """Scatter contiguous caches [B, S, H, D] into a shuffled page pool + block table."""
    b, s, h, d = k.shape
    per = -(-s // page_size)
    n = b * per + extra_pages
    perm = rng.permutation(n)[: b * per].reshape(b, per).astype(np.int32)
    kp = rng.standard_normal((n, page_size, h, d)).astype(k.dtype)   # garbage elsewhere
    vp = rng.standard_normal((n, page_size, h, d)).astype(v.dtype)
    pad = per * page_size - s
    kk = np.concatenate([k, np.zeros((b, pad, h, d), k.dtype)], 1).reshape(b, per, page_size, h, d)
    vv = np.concatenate([v, np.zeros((b, pad, h, d), v.dtype)], 1).reshape(b, per, page_size, h, d)
    kp[perm] = kk
    vp[perm] = vv
    return kp, vp, perm


# ------------------------------------------------------------------ the references vs torch

def _torch_decode(q, k, v, lens, scale=None, left=-1):
    """torch SDPA (math, float64) per sequence on its first len keys, bottom-right causal."""
    q, k, v = (torch.from_numpy(np.asarray(x, np.float64)) for x in (q, k, v))
    b, sq, hq, d = q.shape
    out = torch.zeros(b, sq, hq, d, dtype=torch.float64)
    lse = torch.full((b, hq, sq), -math.inf, dtype=torch.float64)
    sc = scale if scale is not None else 1 / math.sqrt(d)
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            continue
        kk, vv = k[i, :n].transpose(0, 1), v[i, :n].transpose(0, 1)     # [Hkv, n, D]
        g = hq // kk.shape[0]
        kk, vv = kk.repeat_interleave(g, 0), vv.repeat_interleave(g, 0)
        qq = q[i].transpose(0, 1)                                        # [Hq, Sq, D]
        pos = n - sq + torch.arange(sq)
        j = torch.arange(n)
        mask = j[None, :] <= pos[:, None]
        if left >= 0:
            mask &= j[None, :] >= pos[:, None] - left
        rows = mask.any(-1)
        o = torch.nn.functional.scaled_dot_product_attention(
            qq[:, rows], kk, vv, attn_mask=mask[rows], scale=sc)
        out[i, rows] = o.transpose(0, 1)
        s = (qq @ kk.transpose(1, 2)) * sc
        s = s.masked_fill(~mask, -math.inf)
        lse[i] = torch.logsumexp(s, -1)
    return out.numpy(), lse.numpy()


@needs_torch
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("left", [-1, 5])
def test_reference_matches_torch_sdpa(rng, hq, hkv, sq, left):
    b, s_max, d = 3, 40, 16
    q, k, v = (rng.standard_normal(sh) for sh in
               ((b, sq, hq, d), (b, s_max, hkv, d), (b, s_max, hkv, d)))
    lens = np.array([1, 17, 40], np.int32)
    out, lse = A.ref_decode_attention(q, k, v, lens, window_size=(left, 0), return_lse=True)
    ref, ref_lse = _torch_decode(q, k, v, lens, left=left)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-13)
    # paged: the same keys behind a random block table
    kp, vp, table = _paged_from(rng, k, v, page_size=8)
    pout, plse = A.ref_paged_attention(q, kp, vp, table, lens, window_size=(left, 0),
                                       return_lse=True)
    np.testing.assert_allclose(pout, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(plse, ref_lse, rtol=1e-12, atol=1e-13)


def test_reference_rows_without_keys_and_scale(rng):
    q, k, v = (rng.standard_normal(sh) for sh in ((2, 4, 2, 8), (2, 10, 2, 8), (2, 10, 2, 8)))
    lens = np.array([0, 2], np.int32)                 # len < Sq: the first query tokens see nothing
    out, lse = A.ref_decode_attention(q, k, v, lens, scale=0.5, return_lse=True)
    assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)
    assert np.all(out[1, :2] == 0) and np.all(np.isneginf(lse[1, :, :2]))
    # token 3 (pos 1) sees keys 0..1
    s = np.einsum("hd,jhd->hj", q[1, 3], k[1, :2]) * 0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(out[1, 3], np.einsum("hj,jhd->hd", p, v[1, :2]), rtol=1e-12)


def test_reference_append(rng):
    b, sn, h, d, ps = 2, 3, 2, 4, 4
    kp = rng.standard_normal((6, ps, h, d))
    vp = rng.standard_normal((6, ps, h, d))
    table = np.array([[5, 1], [2, 0]], np.int32)
    k, v = rng.standard_normal((b, sn, h, d)), rng.standard_normal((b, sn, h, d))
    nk, nv = A.ref_append_paged_kv(k, v, kp, vp, table, np.array([3, -1], np.int32))
    assert np.array_equal(nk[5, 3], k[0, 0]) and np.array_equal(nk[1, 0], k[0, 1])
    assert np.array_equal(nv[1, 1], v[0, 2])
    # sequence 1 starts at -1: its token 0 is padding, tokens 1, 2 go to positions 0, 1
    assert np.array_equal(nk[2, 0], k[1, 1]) and np.array_equal(nk[2, 1], k[1, 2])
    untouched = np.ones(6 * ps, bool).reshape(6, ps)
    for pg, r in ((5, 3), (1, 0), (1, 1), (2, 0), (2, 1)):
        untouched[pg, r] = False
    assert np.array_equal(nk[untouched], kp[untouched])
    # per-token positions
    pos = np.array([[0, 1, 7], [4, -1, 5]], np.int32)
    nk, _ = A.ref_append_paged_kv(k, v, kp, vp, table, pos)
    assert np.array_equal(nk[1, 3], k[0, 2]) and np.array_equal(nk[0, 1], k[1, 2])
    with pytest.raises(ValueError, match="positions"):
        A.ref_append_paged_kv(k, v, kp, vp, table, np.array([7, 0], np.int32))


# ------------------------------------------------------------------ argument errors, CPU path

def test_argument_errors(rng):
    q = _arr(rng, (2, 1, 4, 8), "float32")
    k = _arr(rng, (2, 10, 2, 8), "float32")
    lens = np.array([3, 4], np.int32)
    with pytest.raises(ValueError, match="'q'"):
        go.decode_attention(q[0], k, k, lens)
    with pytest.raises(ValueError, match="'v_cache'"):
        go.decode_attention(q, k, k[:, :5], lens)
    with pytest.raises(ValueError, match="multiple"):
        go.decode_attention(_arr(rng, (2, 1, 3, 8), "float32"), k, k, lens)
    with pytest.raises(ValueError, match="cache_seqlens"):
        go.decode_attention(q, k, k, np.array([3], np.int32))
    with pytest.raises(ValueError, match="cache_seqlens"):
        go.decode_attention(q, k, k, np.array([3, 11], np.int32))
    with pytest.raises(TypeError, match="cache_seqlens"):
        go.decode_attention(q, k, k, lens.astype(np.int64))
    with pytest.raises(TypeError, match="'k_cache'"):
        go.decode_attention(q, k.astype(np.float16), k, lens)
    with pytest.raises(ValueError, match="window_size"):
        go.decode_attention(q, k, k, lens, window_size=(2, 1))
    kp = _arr(rng, (6, 4, 2, 8), "float32")
    with pytest.raises(ValueError, match="block_table"):
        go.paged_attention(q, kp, kp, np.zeros((2,), np.int32), lens)
    with pytest.raises(ValueError, match="block_table"):
        go.paged_attention(q, kp, kp, np.full((2, 2), 9, np.int32), lens)
    with pytest.raises(ValueError, match="positions"):
        go.append_paged_kv(k[:, :2], k[:, :2], kp, kp, np.zeros((2, 3), np.int32),
                           np.zeros((3,), np.int32))


@needs_torch
def test_cpu_fallback_numpy_and_torch(rng):
    q = _arr(rng, (2, 4, 4, 16), "float32")
    k, v = _arr(rng, (2, 20, 2, 16), "float32"), _arr(rng, (2, 20, 2, 16), "float32")
    lens = np.array([5, 20], np.int32)
    ref, ref_lse = _torch_decode(q, k, v, lens)
    out = go.decode_attention(q, k, v, lens)
    assert out.dtype == np.float32 and out.shape == q.shape
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    tq, tk, tv, tl = (torch.from_numpy(x) for x in (q, k, v, lens))
    o, lse = go.decode_attention(tq, tk, tv, tl, return_lse=True)
    assert isinstance(o, torch.Tensor)
    np.testing.assert_allclose(o.numpy(), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-5, atol=1e-6)
    kp, vp, table = _paged_from(rng, k, v, page_size=8)
    po = go.paged_attention(q, kp, vp, table, lens)
    np.testing.assert_allclose(po, ref, rtol=1e-5, atol=1e-6)


@needs_torch
def test_cpu_append_is_in_place(rng):
    kp = np.zeros((4, 4, 2, 8), np.float32)
    vp = np.zeros((4, 4, 2, 8), np.float32)
    k, v = _arr(rng, (1, 2, 2, 8), "float32"), _arr(rng, (1, 2, 2, 8), "float32")
    table = np.array([[2, 3]], np.int32)
    r = go.append_paged_kv(k, v, kp, vp, table, np.array([3], np.int32))
    assert r[0] is kp and r[1] is vp
    assert np.array_equal(kp[2, 3], k[0, 0]) and np.array_equal(vp[3, 0], v[0, 1])
    tkp, tvp = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    go.append_paged_kv(torch.from_numpy(k), torch.from_numpy(v), tkp, tvp,
                       torch.from_numpy(table), torch.tensor([3], dtype=torch.int32))
    assert torch.equal(tkp[2, 3], torch.from_numpy(k[0, 0]))


def test_num_splits_rule():
    # 132 SMs x 4 resident blocks = 528 slots. B=1, S=8192, Hkv=8: 64 splits of 128 keys (one
    # wave would take 66, but chunks stay >= 128 keys); B=16, S=4096: 4 splits (512 blocks, one
    # wave; 5 splits = 640 blocks ran 1.2 waves and 16% slower on the H100, run 14)
    assert A.num_splits(1, 8, 1, 8192, 528) == (64, 128)
    assert A.num_splits(16, 8, 1, 4096, 528) == (4, 1024)
    assert A.num_splits(16, 8, 1, 4096, 660) == (5, 820)
    assert A.num_splits(16, 8, 1, 4096, 528, waves=2) == (8, 512)
    assert A.num_splits(64, 8, 1, 4096, 528) == (1, 4096)     # the sequences fill the GPU
    assert A.num_splits(1, 1, 1, 0, 528) == (1, 1)
    n, c = A.num_splits(1, 1, 1, 10 ** 6, 528)
    assert n <= A.MAX_SPLITS and n * c >= 10 ** 6
    for b, s, slots in [(1, 8192, 528), (3, 5000, 660), (16, 4096, 264), (2, 100, 528)]:
        n, c = A.num_splits(b, 8, 1, s, slots)
        assert b * 8 * n <= max(slots, b * 8) and n * c >= s and (n - 1) * c < s


def test_num_splits_ring_rule():
    # the ring kernels: one block per SM (RING_SPLIT), chunks of whole 64-key stages. 132 SMs:
    # B1 S8192 Hkv 8: 16 splits of 512 keys; B16 S4096: one split. At 2 blocks per SM, B1 wants
    # 33 splits (249 keys) -> 256-key chunks, 32 splits (256 blocks of 264 slots)
    assert A.num_splits_ring(1, 8, 1, 8192, 132) == (16, 512)
    assert A.num_splits_ring(16, 8, 1, 4096, 132) == (1, 4096)
    assert A.num_splits_ring(64, 8, 1, 4096, 132) == (1, 4096)
    assert A.num_splits_ring(1, 8, 1, 8192, 132, blocks_per_sm=2) == (32, 256)
    assert A.num_splits_ring(16, 8, 1, 4096, 132, blocks_per_sm=2) == (2, 2048)
    assert A.num_splits_ring(1, 1, 1, 0, 132) == (1, 64)
    assert A.num_splits_ring(1, 1, 1, 10, 132) == (1, 64)
    for b, hkv, rc, s, sms in [(1, 8, 1, 8192, 132), (3, 4, 2, 5000, 132), (2, 8, 1, 4100, 78),
                               (1, 1, 1, 10 ** 6, 132), (5, 2, 1, 4100, 132)]:
        n, c = A.num_splits_ring(b, hkv, rc, s, sms)
        assert c % A.RING_KEYS == 0 and n * c >= s and (n - 1) * c < s and n <= A.MAX_SPLITS
        assert b * hkv * rc * n <= max(2 * sms, b * hkv * rc)


def test_ring_auto_rule(monkeypatch):
    """Which kernel RING 'auto' picks (host rule; an sm_90 device of 132 SMs faked): contiguous
    caches the cp.async ring from 2 q rows per kv head and at 1 row only without splits; page
    pools the TMA ring from 2 rows for the pages it takes, else the register kernel; never fp32,
    head dim 256, a misaligned cache or a device before sm_80. RING 'on' / 'off' and RING_KERNEL
    override; bad values raise."""
    monkeypatch.setattr(A, "_sm_count", lambda dev: 132)
    cc = [90]
    monkeypatch.setattr(A, "_cc", lambda dev: cc[0])
    monkeypatch.setattr(A, "_tma_maps", lambda k, v, paged: (
        None if paged and not A._tma_page_ok(k.shape[1]) else ("k map", "v map")))
    call = emu.Call("decode_attention", dt.bfloat16)

    def kind(b, hq, sq, paged=False, ps=64, dtype="bfloat16", d=128, misaligned=False):
        hkv, s = 8, 1024
        q = emu.view(np.zeros((b, sq, hq, d), _np(dtype)))
        shape = (b * s // ps, ps, hkv, d) if paged else (b, s, hkv, d)
        flat = np.zeros(int(np.prod(shape)) + 1, _np(dtype))
        k = emu.view((flat[1:] if misaligned else flat[:-1]).reshape(shape))
        r = A._ring(call, "decode_attention", dt.BY_NAME[dtype], q, k, k, s, paged)
        return None if r is None else r[0]
    assert kind(1, 16, 1) == "async" and kind(1, 64, 1) == "async" and kind(1, 8, 2) == "async"
    assert kind(1, 8, 1) is None and kind(4, 8, 1) is None      # 1 row, several splits
    assert kind(16, 8, 1) == "async" and kind(17, 8, 1) == "async"   # 1 row, one split
    assert kind(1, 16, 1, paged=True) == "tma" and kind(1, 16, 1, paged=True, ps=16) == "tma"
    assert kind(1, 16, 1, paged=True, ps=7) is None and kind(17, 8, 1, paged=True) is None
    assert kind(1, 16, 1, dtype="float32") is None and kind(1, 16, 1, d=256) is None
    assert kind(1, 16, 1, misaligned=True) is None
    cc[0] = 80
    assert kind(1, 16, 1) == "async" and kind(1, 16, 1, paged=True) is None   # no TMA
    cc[0] = 61
    assert kind(1, 16, 1) is None
    cc[0] = 90
    monkeypatch.setattr(A, "RING", "on")
    assert kind(1, 8, 1) == "async" and kind(1, 8, 1, paged=True) == "tma"
    monkeypatch.setattr(A, "RING_KERNEL", "async")
    assert kind(1, 16, 1, paged=True, ps=7) == "async"
    monkeypatch.setattr(A, "RING_KERNEL", "tma")
    assert kind(1, 16, 1) == "tma"
    monkeypatch.setattr(A, "RING", "off")
    assert kind(1, 64, 1) is None
    monkeypatch.setattr(A, "RING", "yes")
    with pytest.raises(ValueError, match="RING"):
        kind(1, 16, 1)
    monkeypatch.setattr(A, "RING", "auto")
    monkeypatch.setattr(A, "RING_KERNEL", "cp.async")
    with pytest.raises(ValueError, match="RING_KERNEL"):
        kind(1, 16, 1)


# ------------------------------------------------------------------ CPU: the kernels, emulated

def _emu_param_types(orig):
    def types_(expr):
        import re
        m = re.search(r"decode_split<([^,]+), ", expr)
        if m:
            t = m.group(1)
            return ([f"const {t}*"] * 3 + ["const int*"] * 2 + ["float*"] * 2
                    + ["long long"] * 15 + ["int"] * 13 + ["float"]), True
        m = re.search(r"decode_combine<(.+)>$", expr)
        if m:
            t = m.group(1)
            return ["const float*", "const float*", f"{t}*", "float*"] + ["int"] * 4, True
        m = re.search(r"append_paged_kv<(.+)>$", expr)
        if m:
            t = m.group(1)
            return ([f"const {t}*"] * 2 + [f"{t}*"] * 2 + ["const int*"] * 2 + ["long long"] * 20
                    + ["int"] * 7 + ["long long"]), False
        return orig(expr)
    return types_


@pytest.fixture(scope="module")
def emulated():
    if not emu.available():
        pytest.skip("g++ not installed")
    from gpuops.runtime import config
    work = config.settings.cache_dir / "host-emulation"
    work.mkdir(parents=True, exist_ok=True)
    mp = pytest.MonkeyPatch()
    mp.setattr(emu, "_param_types", _emu_param_types(emu._param_types))
    try:
        return emu.build([A.SPLIT_MODULE, A.COMBINE_MODULE, A.APPEND_MODULE], str(work))
    finally:
        mp.undo()


@pytest.fixture
def emu_ops(emulated, monkeypatch):
    monkeypatch.setattr(A, "_kernel", lambda module, dev, expr: emulated[module.name].kernel(expr))
    monkeypatch.setattr(A, "_sm_count", lambda dev: 3)
    monkeypatch.setattr(A, "_split_slots", lambda expr, dev, *a: 3 * 4)
    monkeypatch.setattr(A, "_pdl_ok", lambda dev: False)   # an emulated device: no PDL
    monkeypatch.setitem(A.SPLIT, "min_chunk", 16)    # several splits at small lengths
    monkeypatch.setattr(A, "RING", "off")       # the register kernel (the rings: ring_ops below)
    A._plans.clear()

    def run(op_name, dtype, *args, stream=0, **kwargs):
        op = registry.get(op_name)
        call = emu.Call(op_name, dt.BY_NAME[dtype])
        call.stream = stream
        conv = lambda a: emu.view(a) if isinstance(a, np.ndarray) else a  # noqa: E731
        out = op.impl(call, *[conv(a) for a in args], **kwargs)
        out = out if isinstance(out, tuple) else (out,)
        return tuple(np.asarray(o.obj).astype(np.float64) for o in out)
    yield run
    A._plans.clear()
    emulated[A.SPLIT_MODULE.name].set_block_order(0)


def _f64(a):
    return a.astype(np.float64) if a.dtype.kind == "f" else a


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 40])               # 16-byte path, one-element path
@pytest.mark.parametrize("hq,hkv,sq", [(2, 2, 1), (4, 2, 4), (8, 1, 1)])
def test_emulated_decode(emu_ops, rng, dtype, d, hq, hkv, sq):
    b, s_max = 3, 70
    q = _arr(rng, (b, sq, hq, d), dtype)
    k, v = _arr(rng, (b, s_max, hkv, d), dtype), _arr(rng, (b, s_max, hkv, d), dtype)
    lens = np.array([1, 17, 70], np.int32)
    out, lse = emu_ops("decode_attention", dtype, q, k, v, lens, return_lse=True)
    ref, ref_lse = A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens, return_lse=True)
    assert_close(out, ref, dtype, "out")
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_emulated_window_short_lengths_and_strided(emu_ops, rng, dtype):
    b, s_max, hq, hkv, d, sq = 3, 50, 4, 2, 64, 4
    q = _arr(rng, (b, sq, hq, d), dtype)
    big = _arr(rng, (b, s_max, hkv + 1, d), dtype)
    k, v = big[:, :, 1:], _arr(rng, (b, s_max, hkv, d), dtype)      # strided k: head stride
    lens = np.array([0, 2, 50], np.int32)                           # len < Sq: rows without keys
    out, lse = emu_ops("decode_attention", dtype, q, k, v, lens, window_size=(7, 0),
                       return_lse=True, scale=0.3)
    ref, ref_lse = A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens, window_size=(7, 0),
                                          return_lse=True, scale=0.3)
    assert_close(out, ref, dtype, "out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)
    # misaligned k (offset by one element): the one-element path
    flat = _arr(rng, (b * s_max * hkv * d + 1,), dtype)
    k2 = flat[1:].reshape(b, s_max, hkv, d)
    out2 = emu_ops("decode_attention", dtype, q, k2, v, lens)[0]
    assert_close(out2, A.ref_decode_attention(_f64(q), _f64(k2), _f64(v), lens), dtype, "mis")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [16, 5])
def test_emulated_paged_and_append(emu_ops, rng, dtype, page_size):
    b, s_max, hq, hkv, d, sq = 2, 80, 4, 2, 64, 1      # S_max a whole number of pages
    q = _arr(rng, (b, sq, hq, d), dtype)
    k, v = _arr(rng, (b, s_max, hkv, d), dtype), _arr(rng, (b, s_max, hkv, d), dtype)
    kp, vp, table = _paged_from(rng, k, v, page_size)
    lens = np.array([33, 58], np.int32)
    out = emu_ops("paged_attention", dtype, q, kp, vp, table, lens)[0]
    ref = A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens)
    assert_close(out, ref, dtype, "paged")
    # contiguous and paged run the same arithmetic (same S_max: same splits)
    out_c = emu_ops("decode_attention", dtype, q, k, v, lens)[0]
    np.testing.assert_array_equal(out, out_c)
    # append two tokens at the end, then attend over lens + 2
    nk, nv = _arr(rng, (b, 2, hkv, d), dtype), _arr(rng, (b, 2, hkv, d), dtype)
    emu_ops("append_paged_kv", dtype, nk, nv, kp, vp, table, lens)
    k[np.arange(b)[:, None], lens[:, None] + np.arange(2)] = nk
    v[np.arange(b)[:, None], lens[:, None] + np.arange(2)] = nv
    out2 = emu_ops("paged_attention", dtype, q, kp, vp, table, lens + 2)[0]
    assert_close(out2, A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens + 2), dtype, "app")


def _assert_lse(lse, ref_lse):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hq,hkv,sq,d", [(8, 2, 1, 64), (4, 4, 2, 64), (6, 2, 1, 40)])
def test_emulated_merge(emu_ops, emulated, monkeypatch, rng, dtype, hq, hkv, sq, d):
    """Several splits, B = 3, GQA, contiguous and paged, merged by decode_combine. Called three
    times with other lengths and queries (as graph replays are) and other block orders of the
    split kernel: each result right."""
    monkeypatch.setattr(A, "_split_slots", lambda expr, dev, *a: 64)   # 3 .. 6 splits here
    b, s_max, ps = 3, 96, 16
    k, v = _arr(rng, (b, s_max, hkv, d), dtype), _arr(rng, (b, s_max, hkv, d), dtype)
    kp, vp, table = _paged_from(rng, k, v, ps)
    for seed, lens in ((0, [1, 40, 96]), (11, [96, 0, 57]), (12, [17, 96, 2])):
        emulated[A.SPLIT_MODULE.name].set_block_order(seed)
        lens = np.array(lens, np.int32)
        q = _arr(rng, (b, sq, hq, d), dtype)
        out, lse = emu_ops("decode_attention", dtype, q, k, v, lens, return_lse=True)
        nsplit = next(p for key, p in A._plans.items() if key[0] == "decode_attention")[3]
        assert nsplit >= 3
        ref, ref_lse = A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens, return_lse=True)
        assert_close(out, ref, dtype, f"out {lens}")
        _assert_lse(lse, ref_lse)
        pout, plse = emu_ops("paged_attention", dtype, q, kp, vp, table, lens, return_lse=True)
        np.testing.assert_array_equal(pout, out)      # same S_max: same splits, same arithmetic
        np.testing.assert_array_equal(plse, lse)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_emulated_one_split(emu_ops, rng, dtype):
    """One split (the sequences fill the slots): decode_combine merges the single split (weight
    exp(0) = 1), out and lse as the reference."""
    b, s_max, hq, hkv, d, sq = 3, 40, 8, 8, 64, 2
    q = _arr(rng, (b, sq, hq, d), dtype)
    k, v = _arr(rng, (b, s_max, hkv, d), dtype), _arr(rng, (b, s_max, hkv, d), dtype)
    lens = np.array([40, 1, 0], np.int32)
    out, lse = emu_ops("decode_attention", dtype, q, k, v, lens, return_lse=True)
    assert next(p for key, p in A._plans.items() if key[0] == "decode_attention")[3] == 1
    ref, ref_lse = A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens, return_lse=True)
    assert_close(out, ref, dtype, "out")
    _assert_lse(lse, ref_lse)


@pytest.fixture
def pdl_emu(emu_ops, emulated, monkeypatch):
    """emu_ops on an sm_90-like device: PDL may be used."""
    monkeypatch.setattr(A, "_pdl_ok", lambda dev: True)
    for m in emulated.values():
        m.launches.clear()
    return emu_ops


@pytest.mark.parametrize("pdl", ["combine", "all"])
def test_emulated_pdl_launches(pdl_emu, emulated, monkeypatch, rng, pdl):
    """PDL: the combine (and with "all" the split kernel) launched with the PDL attribute, the
    split kernel told to trigger its dependents; the same results as plain launches (the device
    side is a no-op off sm_90). Not on a device without PDL."""
    from gpuops.runtime import launch  # noqa: PLC0415
    split, comb = emulated[A.SPLIT_MODULE.name], emulated[A.COMBINE_MODULE.name]
    b, hq, hkv, d, dtype = 2, 4, 2, 64, "bfloat16"
    q = _arr(rng, (b, 1, hq, d), dtype)
    k, v = _arr(rng, (b, 96, hkv, d), dtype), _arr(rng, (b, 96, hkv, d), dtype)
    lens = np.array([96, 31], np.int32)
    monkeypatch.setattr(A, "PDL", "off")
    base = pdl_emu("decode_attention", dtype, q, k, v, lens)[0]
    assert split.launches[-1][3] == () and comb.launches[-1][3] == ()
    monkeypatch.setattr(A, "PDL", pdl)
    out = pdl_emu("decode_attention", dtype, q, k, v, lens)[0]
    assert comb.launches[-1][3] == launch.PDL
    assert split.launches[-1][3] == (launch.PDL if pdl == "all" else ())
    np.testing.assert_array_equal(out, base)
    monkeypatch.setattr(A, "_pdl_ok", lambda dev: False)
    pdl_emu("decode_attention", dtype, q, k, v, lens)
    assert split.launches[-1][3] == () and comb.launches[-1][3] == ()
    monkeypatch.setattr(A, "_pdl_ok", lambda dev: True)
    monkeypatch.setattr(A, "PDL", "on")
    with pytest.raises(ValueError, match="PDL"):
        pdl_emu("decode_attention", dtype, q, k, v, lens)


# ------------------------------------------------------------- CPU: the cp.async ring (emulated)
# decode_split_async (tensor cores: ldmatrix, mma.sync, cp.async) runs in tests/emu.py's emulator,
# which models those instructions; the combine in the host emulation above.

@pytest.fixture(scope="module")
def ring_emulated():
    if not kernel_emu.available():
        pytest.skip("g++ not installed")
    return kernel_emu.build(A.ASYNC_MODULE, 900)


@pytest.fixture
def ring_ops(emu_ops, emulated, ring_emulated, monkeypatch):
    """emu_ops with the ring switched on and RING 'async' (sm_90-like device, 3 SMs)."""
    lib, index = ring_emulated
    launched = []

    def kernel(module, dev, expr):
        if module is A.ASYNC_MODULE:
            launched.append(expr)
            return kernel_emu.EmuKernel(lib, index[expr], module.kernels[expr], expr)
        return emulated[module.name].kernel(expr)
    monkeypatch.setattr(A, "_kernel", kernel)
    monkeypatch.setattr(A, "_cc", lambda dev: 90)
    monkeypatch.setattr(A, "RING", "on")
    monkeypatch.setattr(A, "RING_KERNEL", "async")
    emu_ops.launched = launched
    return emu_ops


@pytest.mark.parametrize("dtype,d,hq,hkv,sq", [("bfloat16", 64, 4, 2, 1), ("float16", 128, 8, 1, 2),
                                               ("bfloat16", 64, 6, 2, 3),
                                               ("bfloat16", 64, 12, 1, 2)])
def test_emulated_async_ring(ring_ops, emulated, rng, monkeypatch, dtype, d, hq, hkv, sq):
    """decode_split_async against the float64 reference: lengths 0, 1, 63, 65 and 200 of a
    200-key cache holding NaN past each length (the zero-filled copies must keep it out of P V),
    several splits (chunks of one 64-key stage, so the prologue's empty groups and the ring's
    reuse of slots run), 2 .. 24 q rows per kv head (two row chunks of the mma's 16 at 24); one
    split (the output and lse written by the ring kernel, no combine); a window, and pages of 7
    and 64 keys (any page size: rows looked up one by one)."""
    monkeypatch.setattr(A, "RING_SPLIT", {"waves": 1, "blocks_per_sm": 40})  # 64-key chunks
    lens = np.array([0, 1, 63, 65, 200], np.int32)
    b, s_max = len(lens), 200
    q = _arr(rng, (b, sq, hq, d), dtype)
    k, v = _caches_nan_past(rng, lens, s_max, hkv, d, dtype)
    out, lse = ring_ops("decode_attention", dtype, q, k, v, lens, return_lse=True)
    assert ring_ops.launched and "decode_split_async" in ring_ops.launched[-1]
    plan = next(p for key, p in A._plans.items() if key[0] == "async")
    assert plan[3] == 4 and plan[4] == 64, plan      # 4 splits of one stage
    ref, ref_lse = A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens, return_lse=True)
    assert_close(out, ref, dtype, "async")
    _assert_lse(lse, ref_lse)
    # one split: the ring writes out and lse itself, no combine launched
    combine = emulated[A.COMBINE_MODULE.name]
    n_comb = len(combine.launches)
    monkeypatch.setattr(A, "RING_SPLIT", {"waves": 1, "blocks_per_sm": 0})
    A._plans.clear()
    out1, lse1 = ring_ops("decode_attention", dtype, q, k, v, lens, return_lse=True)
    assert next(p for key, p in A._plans.items() if key[0] == "async")[3] == 1
    assert len(combine.launches) == n_comb, "one split must not launch the combine"
    assert_close(out1, ref, dtype, "async, one split")
    _assert_lse(lse1, ref_lse)
    monkeypatch.setattr(A, "RING_SPLIT", {"waves": 1, "blocks_per_sm": 40})
    A._plans.clear()
    out_w = ring_ops("decode_attention", dtype, q, k, v, lens, window_size=(70, 0))[0]
    assert_close(out_w, A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens,
                                               window_size=(70, 0)), dtype, "window")
    for ps in (7, 64):
        kp, vp, table = _paged_from(rng, np.nan_to_num(k, nan=0.0), np.nan_to_num(v, nan=0.0), ps)
        named = np.zeros(kp.shape[0], bool)
        named[table.reshape(-1)] = True
        kp[~named] = np.nan
        vp[~named] = np.nan
        n0 = len(ring_ops.launched)
        pout = ring_ops("paged_attention", dtype, q, kp, vp, table, lens)[0]
        assert len(ring_ops.launched) == n0 + 1
        assert_close(pout, ref, dtype, f"paged {ps}")


# ------------------------------------------------------------------ GPU

def _cuda(x):
    return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(torch.bfloat16) \
        if x.dtype == _np("bfloat16") else torch.from_numpy(np.ascontiguousarray(x)).cuda()


def _host(t):
    return t.float().cpu().numpy().astype(np.float64) if t.is_floating_point() else t.cpu().numpy()


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(8, 8), (16, 8), (16, 2)])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("d", [128, 64, 256, 80])
def test_gpu_decode(rng, dtype, hq, hkv, sq, d):
    lens = np.array([1, 17, 1000, 4097], np.int32)
    b, s_max = 4, 4097 + 3
    q = _arr(rng, (b, sq, hq, d), dtype)
    k, v = _arr(rng, (b, s_max, hkv, d), dtype), _arr(rng, (b, s_max, hkv, d), dtype)
    out, lse = go.decode_attention(_cuda(q), _cuda(k), _cuda(v), _cuda(lens), return_lse=True)
    assert lse.dtype == torch.float32
    ref, ref_lse = A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens, return_lse=True)
    assert_close(_host(out), ref, dtype, "out")
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(_host(lse)[fin], ref_lse[fin], rtol=1e-5, atol=2e-5)
    np.testing.assert_array_equal(np.isneginf(_host(lse)), np.isneginf(ref_lse))


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [16, 256, 7])
@pytest.mark.parametrize("hq,hkv,sq", [(16, 8, 1), (8, 1, 4)])
def test_gpu_paged(rng, monkeypatch, dtype, page_size, hq, hkv, sq):
    lens = np.array([1, 17, 1000, 4097], np.int32)
    b, s_max, d = 4, 4097, 128
    q = _arr(rng, (b, sq, hq, d), dtype)
    k, v = _arr(rng, (b, s_max, hkv, d), dtype), _arr(rng, (b, s_max, hkv, d), dtype)
    kp, vp, table = _paged_from(rng, k, v, page_size)
    out = go.paged_attention(_cuda(q), _cuda(kp), _cuda(vp), _cuda(table), _cuda(lens),
                             window_size=(300, 0))
    ref = A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens, window_size=(300, 0))
    assert_close(_host(out), ref, dtype, "paged")
    pad = -s_max % page_size             # same S_max as the pages: same splits, same arithmetic
    kz, vz = (np.concatenate([x, np.zeros((b, pad, hkv, d), x.dtype)], 1) for x in (k, v))
    # the register kernel for both (the TMA one rounds a split's start down to whole pages)
    monkeypatch.setattr(A, "RING", "off")
    out = go.paged_attention(_cuda(q), _cuda(kp), _cuda(vp), _cuda(table), _cuda(lens),
                             window_size=(300, 0))
    out_c = go.decode_attention(_cuda(q), _cuda(kz), _cuda(vz), _cuda(lens), window_size=(300, 0))
    assert torch.equal(out, out_c)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_strided_and_misaligned(rng, dtype):
    b, s_max, hq, hkv, d = 2, 600, 8, 2, 128
    lens = np.array([599, 33], np.int32)
    q = _arr(rng, (b, 1, hq, d), dtype)
    big = _arr(rng, (b, s_max, 2 * hkv, d), dtype)
    k, v = big[:, :, :hkv], big[:, :, hkv:]                    # one fused KV buffer
    tb = _cuda(big)
    out = go.decode_attention(_cuda(q), tb[:, :, :hkv], tb[:, :, hkv:], _cuda(lens))
    assert_close(_host(out), A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens), dtype, "s")
    flat = _cuda(_arr(rng, (b * s_max * hkv * d + 1,), dtype))
    k2 = flat[1:].view(b, s_max, hkv, d)                       # 2/4-byte offset: one-element path
    out2 = go.decode_attention(_cuda(q), k2, k2, _cuda(lens))
    kk = _host(k2)
    assert_close(_host(out2), A.ref_decode_attention(_f64(q), kk, kk, lens), dtype, "mis")


@gpu
@needs_torch_cuda
def test_gpu_append_then_attend_in_a_cuda_graph(rng):
    """Append one token and attend, captured once, replayed with other lengths and tokens."""
    dtype, b, hq, hkv, d, ps, pages = "bfloat16", 3, 16, 8, 128, 16, 80
    per = pages // b
    table = _cuda(rng.permutation(pages)[: b * per].reshape(b, per).astype(np.int32))
    kp = torch.zeros(pages, ps, hkv, d, dtype=torch.bfloat16, device="cuda")
    vp = torch.zeros_like(kp)
    kp.normal_()
    vp.normal_()
    lens = torch.tensor([5, 100, 300], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, hq, d, device="cuda").bfloat16()
    nk = torch.randn(b, 1, hkv, d, device="cuda").bfloat16()
    nv = torch.randn(b, 1, hkv, d, device="cuda").bfloat16()
    pos = lens - 1                               # the new token's position

    def step():
        go.append_paged_kv(nk, nv, kp, vp, table, pos)
        return go.paged_attention(q, kp, vp, table, lens)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for new_lens in ([6, 101, 301], [1, 17, per * ps]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        pos.copy_(lens - 1)
        q.normal_()
        nk.normal_()
        nv.normal_()
        g.replay()
        torch.cuda.synchronize()
        ref = A.ref_paged_attention(_host(q), _host(kp), _host(vp), _host(table), _host(lens))
        assert_close(_host(out), ref, "bfloat16", f"graph {new_lens}")
        tab = _host(table)
        for i, n in enumerate(new_lens):
            p = n - 1
            assert torch.equal(kp[tab[i, p // ps], p % ps], nk[i, 0])


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("shape", [(1, 8192, 16, 8, 128), (16, 4096, 16, 8, 128),
                                   (3, 5000, 32, 4, 64), (2, 3000, 8, 8, 80)])
def test_gpu_bench_shapes(rng, shape):
    """The bench shapes (and GQA 8, a one-element head dim) against the reference, out and lse;
    one full sequence, the others of random lengths."""
    b, s, hq, hkv, d = shape
    dtype = "bfloat16"
    q = _arr(rng, (b, 1, hq, d), dtype)
    k, v = _arr(rng, (b, s, hkv, d), dtype), _arr(rng, (b, s, hkv, d), dtype)
    lens = np.array(([s] + list(rng.integers(0, s + 1, b - 1)))[:b], np.int32)
    args = (_cuda(q), _cuda(k), _cuda(v), _cuda(lens))
    out, lse = go.decode_attention(*args, return_lse=True)
    ref, ref_lse = A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens, return_lse=True)
    assert_close(_host(out), ref, dtype, f"{shape}")
    _assert_lse(_host(lse), ref_lse)


def _graph_case(b=2, s_max=4096, hq=16, hkv=8, d=128, ps=16):
    """The CUDA-graph tests' problem (bf16): contiguous caches, the same keys in a page pool in
    reversed page order, one query token, lengths (full, 100)."""
    k = torch.randn(b, s_max, hkv, d, device="cuda").bfloat16()
    v = torch.randn(b, s_max, hkv, d, device="cuda").bfloat16()
    table = torch.arange(b * s_max // ps, device="cuda", dtype=torch.int32).flip(0).reshape(b, -1)
    kp = torch.empty(b * s_max // ps, ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    vp = torch.empty_like(kp)
    kp[table.reshape(-1).long()] = k.reshape(-1, ps, hkv, d)
    vp[table.reshape(-1).long()] = v.reshape(-1, ps, hkv, d)
    q = torch.randn(b, 1, hq, d, device="cuda").bfloat16()
    lens = torch.tensor([s_max, 100], dtype=torch.int32, device="cuda")
    return k, v, kp, vp, table, q, lens


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("op", ["decode_attention", "paged_attention"])
def test_gpu_decode_in_a_cuda_graph(rng, op):
    """Captured once, replayed with other lengths (empty splits, an empty sequence, full caches):
    every replay right, out and lse, and equal bit for bit to an eager call on another stream."""
    s_max = 4096
    k, v, kp, vp, table, q, lens = _graph_case(s_max=s_max)

    def step():
        if op == "paged_attention":
            return go.paged_attention(q, kp, vp, table, lens, return_lse=True)
        return go.decode_attention(q, k, v, lens, return_lse=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = step()
    kh, vh = _host(k), _host(v)
    for new_lens in ([s_max, 1], [0, 333], [17, s_max], [4000, 4001], [s_max, s_max], [129, 0]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.normal_()
        g.replay()
        torch.cuda.synchronize()
        ref, ref_lse = A.ref_decode_attention(_host(q), kh, vh, np.array(new_lens),
                                              return_lse=True)
        assert_close(_host(out), ref, "bfloat16", f"graph {new_lens}")
        _assert_lse(_host(lse), ref_lse)
        with torch.cuda.stream(s):
            eager, eager_lse = step()
        s.synchronize()
        assert torch.equal(eager, out) and torch.equal(eager_lse, lse)


def _poison_cache(nbytes=64 << 20):
    """Fill freed memory of torch's caching allocator with NaN so that outputs and workspaces
    allocated next start poisoned (a kernel that leaves an element unwritten fails the test)."""
    x = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del x


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("pdl", ["off", "combine", "all"])
@pytest.mark.parametrize("shape,dtype", [((1, 8192, 16, 8, 128), "bfloat16"),
                                         ((4, 4097, 16, 8, 128), "float16"),
                                         ((3, 3000, 8, 8, 64), "bfloat16"),
                                         ((2, 2000, 16, 4, 256), "bfloat16"),
                                         ((2, 1500, 16, 2, 128), "bfloat16")])   # RT 8
def test_gpu_split_and_pdl(rng, monkeypatch, pdl, shape, dtype):
    """Plain and PDL launches of the split kernel and the combine against the float64
    reference: full and short lengths, an empty sequence, return_lse, a window, and paged (equal
    bit for bit to contiguous)."""
    monkeypatch.setattr(A, "PDL", pdl)
    b, s, hq, hkv, d = shape
    q = _arr(rng, (b, 1, hq, d), dtype)
    k, v = _arr(rng, (b, s, hkv, d), dtype), _arr(rng, (b, s, hkv, d), dtype)
    lens = np.array(([s, 0, 1, 777] + list(rng.integers(0, s + 1, b)))[:b], np.int32)
    args = (_cuda(q), _cuda(k), _cuda(v), _cuda(lens))
    _poison_cache()
    out, lse = go.decode_attention(*args, return_lse=True)
    ref, ref_lse = A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens, return_lse=True)
    assert_close(_host(out), ref, dtype, f"pdl={pdl}")
    _assert_lse(_host(lse), ref_lse)
    _poison_cache()
    out_w = go.decode_attention(*args, window_size=(1000, 0))
    assert_close(_host(out_w), A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens,
                                                      window_size=(1000, 0)), dtype, "window")
    if s % 16 == 0:
        kp, vp, table = _paged_from(rng, k, v, 16)
        _poison_cache()
        monkeypatch.setattr(A, "RING", "off")     # the register kernel for both
        pout = go.paged_attention(_cuda(q), _cuda(kp), _cuda(vp), _cuda(table), _cuda(lens))
        out_r = go.decode_attention(*args)
        assert torch.equal(pout, out_r)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("op", ["decode_attention", "paged_attention"])
@pytest.mark.parametrize("pdl", ["combine", "all"])
def test_gpu_pdl_in_a_cuda_graph(rng, monkeypatch, op, pdl):
    """Three dependent decode calls captured in one graph (each call's q is the previous call's
    output: with PDL "all" each split kernel is a programmatic secondary of the previous combine
    and must wait for it before reading q), replayed with other lengths and queries: every
    output right, equal bit for bit to eager calls with plain launches."""
    monkeypatch.setattr(A, "PDL", pdl)
    s_max = 4096
    k, v, kp, vp, table, q, lens = _graph_case(s_max=s_max)

    def attend(x):
        if op == "paged_attention":
            return go.paged_attention(x, kp, vp, table, lens)
        return go.decode_attention(x, k, v, lens)

    def step():
        o1 = attend(q)
        o2 = attend(o1 * 4)          # an elementwise torch kernel between: q of call 2
        return o1, o2, attend(o2)    # the previous decode's output directly: q of call 3

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    _poison_cache()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    kh, vh = _host(k), _host(v)
    for new_lens in ([s_max, 1], [0, 333], [4000, 4001], [129, s_max]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.normal_()
        g.replay()
        torch.cuda.synchronize()
        x = _host(q)
        for i, o in enumerate(outs):
            ref = A.ref_decode_attention(x, kh, vh, np.array(new_lens))
            assert_close(_host(o), ref, "bfloat16", f"graph {new_lens} call {i}")
            x = _host(o) * (4 if i == 0 else 1)
        monkeypatch.setattr(A, "PDL", "off")
        eager = step()
        torch.cuda.synchronize()
        monkeypatch.setattr(A, "PDL", pdl)
        for e, o in zip(eager, outs):
            assert torch.equal(e, o)


# ------------------------------------------------------------------ GPU: the ring kernels

def _ring_device():
    """The ring kernels' tests run: an sm_90 GPU whose kernels are not built for an older arch
    (GPUOPS_ARCH=61 on the compute_61 bundle takes the register kernel)."""
    return A._cc(torch.cuda.current_device()) >= 90


@pytest.fixture(params=["tma", "async"])
def ring(request, monkeypatch):
    """The ring kernel under test: decode_split_tma (sm_90) or decode_split_async (sm_80+; run
    where the TMA one runs, on the same tests)."""
    if not _ring_device():
        pytest.skip("the ring kernels' tests run on sm_90")
    monkeypatch.setattr(A, "RING_KERNEL", request.param)
    return request.param


def _ring_spy(monkeypatch):
    """The plans the ring kernels were launched with, call by call."""
    used = []
    orig = A._plan_ring

    def spy(*args, **kwargs):
        p = orig(*args, **kwargs)
        used.append(p)
        return p
    monkeypatch.setattr(A, "_plan_ring", spy)
    return used


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("hq,hkv,sq", [(16, 8, 1), (8, 1, 1), (32, 2, 1), (16, 1, 2), (8, 2, 4)])
def test_gpu_decode_ring(rng, monkeypatch, ring, dtype, d, hq, hkv, sq):
    """The ring kernel against the float64 reference (out and lse, the same tolerances as the
    register kernel: P enters P V as two parts, not rounded to the storage type): lengths 0, 1,
    17, 1000 and 4097 of a 4100-key cache holding NaN past each length (the last stage's V rows
    there must be zeroed, 0 x NaN being NaN), 8 / 16 / 32 q rows per kv head (one or two row
    chunks of the mma's 16), poisoned outputs and workspace; then a window."""
    monkeypatch.setattr(A, "RING", "on")        # every row count, not only 'auto''s
    used = _ring_spy(monkeypatch)
    lens = np.array([0, 1, 17, 1000, 4097], np.int32)
    b, s_max = len(lens), 4100
    q = _arr(rng, (b, sq, hq, d), dtype)
    k, v = _caches_nan_past(rng, lens, s_max, hkv, d, dtype)
    args = (_cuda(q), _cuda(k), _cuda(v), _cuda(lens))
    _poison_cache()
    out, lse = go.decode_attention(*args, return_lse=True)
    assert len(used) == 1 and f"decode_split_{ring}<" in used[0][0], "the ring kernel did not run"
    ref, ref_lse = A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens, return_lse=True)
    assert_close(_host(out), ref, dtype, ring)
    _assert_lse(_host(lse), ref_lse)
    _poison_cache()
    out_w = go.decode_attention(*args, window_size=(300, 0))
    assert len(used) == 2
    assert_close(_host(out_w), A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens,
                                                      window_size=(300, 0)), dtype, "window")


@gpu
@needs_torch_cuda
def test_gpu_decode_ring_layouts_splits_and_graph(rng, monkeypatch, ring):
    """The ring kernel on a [B, Hkv, S, D] cache viewed as [B, S, Hkv, D] (other strides in the
    tensor map or the copies), at several split rules (1 split per sequence: the output written
    by the ring kernel itself; chunks of one stage; 2 waves), in a CUDA graph replayed with other
    lengths (equal bit for bit to eager calls), and equal to the register kernel within the
    tolerance; a cache TMA cannot describe (a 2-byte offset) takes the register kernel (the
    cp.async ring too: it needs 16-byte aligned rows)."""
    monkeypatch.setattr(A, "RING", "on")
    used = _ring_spy(monkeypatch)
    b, s_max, hq, hkv, d, dtype = 2, 3000, 16, 4, 128, "bfloat16"
    q = _arr(rng, (b, 3, hq, d), dtype)
    kb, vb = _arr(rng, (b, hkv, s_max, d), dtype), _arr(rng, (b, hkv, s_max, d), dtype)
    k, v = kb.transpose(0, 2, 1, 3), vb.transpose(0, 2, 1, 3)
    tk, tv = _cuda(kb).transpose(1, 2), _cuda(vb).transpose(1, 2)
    tq = _cuda(q)
    lens = torch.tensor([3000, 777], dtype=torch.int32, device="cuda")
    for rule in ({"waves": 1, "blocks_per_sm": 2}, {"waves": 1, "blocks_per_sm": 0},
                 {"waves": 100, "blocks_per_sm": 2}):
        monkeypatch.setattr(A, "RING_SPLIT", rule)
        _poison_cache()
        out = go.decode_attention(tq, tk, tv, lens)
        assert_close(_host(out), A.ref_decode_attention(_f64(q), _f64(k), _f64(v), _host(lens)),
                     dtype, f"split rule {rule}")
    sms = A._sm_count(torch.cuda.current_device())
    assert [p[3] for p in used] == [A.num_splits_ring(b, hkv, 1, s_max, sms, w, per)[0]
                                    for w, per in ((1, 2), (1, 0), (100, 2))]
    assert [p[3] for p in used][1:] == [1, 47]      # one split; 47 chunks of one stage
    monkeypatch.setattr(A, "RING_SPLIT", {"waves": 1, "blocks_per_sm": 2})
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        go.decode_attention(tq, tk, tv, lens, return_lse=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gout, glse = go.decode_attention(tq, tk, tv, lens, return_lse=True)
    for new_lens in ([1, 3000], [0, 64], [2999, 65]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        tq.normal_()
        g.replay()
        torch.cuda.synchronize()
        ref, ref_lse = A.ref_decode_attention(_host(tq), _f64(k), _f64(v), np.array(new_lens),
                                              return_lse=True)
        assert_close(_host(gout), ref, dtype, f"graph {new_lens}")
        _assert_lse(_host(glse), ref_lse)
        eager, eager_lse = go.decode_attention(tq, tk, tv, lens, return_lse=True)
        assert torch.equal(eager, gout) and torch.equal(eager_lse, glse)
        monkeypatch.setattr(A, "RING", "off")
        reg = go.decode_attention(tq, tk, tv, lens)
        monkeypatch.setattr(A, "RING", "on")
        assert_close(_host(reg), ref, dtype, f"register kernel {new_lens}")
    n = len(used)
    flat = _cuda(_arr(rng, (b * s_max * hkv * d + 8,), dtype))
    k2 = flat[1:1 + b * s_max * hkv * d].view(b, s_max, hkv, d)
    go.decode_attention(tq, k2, k2, lens)
    assert len(used) == n, "a misaligned cache must take the register kernel"
    monkeypatch.setattr(A, "RING", "yes")
    with pytest.raises(ValueError, match="RING"):
        go.decode_attention(tq, tk, tv, lens)
    monkeypatch.setattr(A, "RING", "on")
    monkeypatch.setattr(A, "RING_KERNEL", "cp.async")
    with pytest.raises(ValueError, match="RING_KERNEL"):
        go.decode_attention(tq, tk, tv, lens)


@gpu
@needs_torch_cuda
def test_gpu_decode_ring_auto_rule(rng, monkeypatch, ring):
    """RING 'auto' takes the ring kernel from RING_MIN_ROWS q rows per kv head (GQA group x query
    tokens), at 1 row only where it needs no splits (17 x 8 kv heads fill the 132 SMs), and the
    register kernel otherwise; all right."""
    used = _ring_spy(monkeypatch)
    s_max, d, dtype = 1500, 128, "float16"
    sms = A._sm_count(torch.cuda.current_device())
    for b, hq, sq in ((2, 16, 1), (2, 16, 4), (2, 64, 1), (2, 8, 2), (2, 8, 1), (17, 8, 1)):
        lens = rng.integers(1, s_max + 1, b).astype(np.int32)
        k, v = _arr(rng, (b, s_max, 8, d), dtype), _arr(rng, (b, s_max, 8, d), dtype)
        n = len(used)
        q = _arr(rng, (b, sq, hq, d), dtype)
        out = go.decode_attention(_cuda(q), _cuda(k), _cuda(v), _cuda(lens))
        rows = (hq // 8) * sq
        want = rows >= A.RING_MIN_ROWS or A.num_splits_ring(b, 8, 1, s_max, sms)[0] == 1
        assert len(used) - n == int(want), (b, hq, sq)
        assert_close(_host(out), A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens), dtype,
                     f"b={b} hq={hq} sq={sq}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("page_size", [8, 16, 64, 128, 7])
def test_gpu_paged_ring(rng, monkeypatch, ring, dtype, page_size):
    """paged_attention on the ring kernel (GQA 32/8: 4 rows per kv head) for pages that divide a
    64-key stage or are multiples of it (7: the register kernel): against the reference, with NaN
    in every pool row past each sequence's length and in the pages no table names, poisoned
    outputs; a window (the split starts inside a page: keys before it masked) and two tokens.
    The cp.async ring takes every page size (7 too)."""
    used = _ring_spy(monkeypatch)
    lens = np.array([1, 17, 1000, 4097], np.int32)
    b, s_max, hq, hkv, d = 4, 4097, 32, 8, 128
    for sq, window in ((1, None), (2, (300, 0))):
        q = _arr(rng, (b, sq, hq, d), dtype)
        k, v = _arr(rng, (b, s_max, hkv, d), dtype), _arr(rng, (b, s_max, hkv, d), dtype)
        kp, vp, table = _paged_from(rng, k, v, page_size)
        named = np.zeros(kp.shape[0], bool)
        named[table.reshape(-1)] = True
        kp[~named] = np.nan
        vp[~named] = np.nan
        for i, n in enumerate(lens):
            for j in range(n, table.shape[1] * page_size):
                kp[table[i, j // page_size], j % page_size] = np.nan
                vp[table[i, j // page_size], j % page_size] = np.nan
        n0 = len(used)
        _poison_cache()
        out, lse = go.paged_attention(_cuda(q), _cuda(kp), _cuda(vp), _cuda(table), _cuda(lens),
                                      window_size=window, return_lse=True)
        assert len(used) - n0 == (0 if page_size == 7 and ring == "tma" else 1)
        ref, ref_lse = A.ref_decode_attention(_f64(q), _f64(k), _f64(v), lens,
                                              window_size=window, return_lse=True)
        assert_close(_host(out), ref, dtype, f"paged {page_size} sq={sq} window={window}")
        _assert_lse(_host(lse), ref_lse)
