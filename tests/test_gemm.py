"""The GEMM family: matmul (every variant), linear, swiglu_linear, int8_matmul, gpuops.torch.linear.

CPU: the NumPy references against torch in float64, argument errors, the CPU path's dtypes, the
host-side planning (batch folding/merging, layouts and alignment flags, variant choice), the
GemmArgs layout against gemm_common.cuh, autograd through the references (gradcheck) and
torch.compile tracing. GPU: every variant and dtype against float64 products computed on the GPU
(cuBLAS DGEMM: fast even at 4097 x 4095 x 1000), with odd shapes, K up to 65536, transposed,
sliced and unaligned operands, batches, fused epilogues, split-K decode shapes in CUDA graphs,
gradients against torch.

Accuracy model (never loosened to make a test pass). With u_acc = 2^-24 (fp32 accumulation),
u_in = 2^-11 for TF32 inputs (0 otherwise: fp16/bf16/fp32 inputs are exact in the reference) and
u_out = 2^-24 / 2^-11 / 2^-8 the output's unit roundoff, every element must satisfy

    |out - ref| <= 1.2 |alpha| (2 sqrt(K) u_acc + 2.1 u_in) (|A| |B|)     accumulation (x1.2: act')
                   + 2 u_acc (|alpha A B| + |bias|) + 1e-5 |act(pre)|      epilogue in fp32
                   + 2 u_acc |act(pre) + residual| + 2 u_out |ref| + tiny  adds, output rounding

(sqrt(K) u (|A||B|) bounds rounding errors of a K-term sum that behave like a random walk; the
activations are accurate to 1e-5 relative), and the error relative to the norm of the output
must stay below NORM_TOL (fp32 SIMT 1e-5, TF32 1e-3, fp16/bf16 1e-2), scaled by sqrt(K / 4096)
for K > 4096.
"""
from __future__ import annotations

import ctypes
import math
import re
import types
from pathlib import Path

import numpy as np
import pytest

import gpuops as go
from gpuops import dtypes as dt
from gpuops.ops import gemm as G
from gpuops.runtime import launch, nvrtc
from gpuops.tensor import Tensor
from conftest import HAS_TORCH, gpu, needs_torch, needs_torch_cuda

torch = pytest.importorskip("torch") if HAS_TORCH else None
import emu  # noqa: E402
from emu import needs_emu  # noqa: E402
F = torch.nn.functional if HAS_TORCH else None
ROOT = Path(__file__).resolve().parent.parent

U_ACC = 2.0 ** -24
U_OUT = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
TINY = {"float32": 1e-38, "float16": 2.0 ** -24, "bfloat16": 1e-38}
NORM_TOL = {"float32": 1e-5, "tf32": 1e-3, "float16": 1e-2, "bfloat16": 1e-2}
ACTS = [None, "relu", "silu", "gelu", "gelu_tanh"]
DTYPES = ["float32", "float16", "bfloat16"]


# ----------------------------------------------------------------------------- CPU: layout

def test_gemmargs_struct_matches_the_argspec():
    """The ArgSpec of every GEMM kernel is derived from the C++ struct's field list."""
    text = (ROOT / "cuda_src/gemm/gemm_common.cuh").read_text()
    body = re.search(r"struct GemmArgs \{(.*?)\n\};", text, re.S).group(1)
    codes = {"void*": "P", "float*": "P", "long long": "q", "float": "f", "int": "i"}
    fmt = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(const )?(void\*|float\*|long long|float|int) (.+);", line)
        assert m, line
        code = codes[m.group(2)]
        for name in m.group(3).split(","):
            arr = re.search(r"\[(\d+)\]", name)
            fmt += [code] * (int(arr.group(1)) if arr else 1)
    compact = re.sub(r"(\w)\1*", lambda m: f"{len(m.group(0))}{m.group(1)}" if len(m.group(0)) > 1
                     else m.group(1), "".join(fmt))
    assert compact == G.GEMM_ARGS.params[0] == "9P25qf4i"
    assert G.GEMM_ARGS.size == 296 and "sizeof(GemmArgs) == 296" in text


def test_every_gemm_module_declares_its_archs():
    for m in (*G.MMA.values(), *G.GEMV_MMA.values()):
        assert m.archs == ("80", "86", "89", "90"), m.name
    for m in (G.NAIVE, G.SMEM_TILED, *G.REGISTER_TILED.values(), *G.WARP_TILED.values(),
              *G.GEMV.values(), G.INT8):
        assert "61" in m.archs, m.name
    assert set(G.GEMV) == set(dt.FLOATS) and set(G.MMA) == set(dt.FLOATS) | {dt.int8}
    assert set(G.GEMV_MMA) == {dt.float16, dt.bfloat16}
    for mods in G.WGMMA_MODULES.values():
        assert set(mods) == {dt.float16, dt.bfloat16}
        for m in mods.values():
            assert m.archs == ("90a",) and m.arch_specific and m.supports(90) \
                and not m.supports(80)
    assert G.WGMMA_MODULES["base"] is G.WGMMA
    for f in sorted((ROOT / "cuda_src/gemm").glob("*.cu")):
        assert f.read_text().startswith("// "), f"{f.name} must open with what it adds"


# ----------------------------------------------------------------------------- CPU: references

def _t64(x):
    return torch.from_numpy(np.asarray(x, np.float64))


def _torch_act(act, y):
    if act is None:
        return y
    if act == "relu":
        return torch.relu(y)
    if act == "silu":
        return F.silu(y)
    if act == "gelu":
        return F.gelu(y)
    return F.gelu(y, approximate="tanh")


@needs_torch
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shapes", [((5, 7), (7, 3)), ((7,), (7, 3)), ((5, 7), (7,)), ((7,), (7,)),
                                    ((2, 1, 5, 7), (3, 7, 4)), ((4, 5, 7), (7, 2))])
def test_matmul_reference_matches_torch(shapes, act, rng):
    a = rng.standard_normal(shapes[0])
    b = rng.standard_normal(shapes[1])
    out_shape = torch.matmul(_t64(a), _t64(b)).shape
    n = shapes[1][-1] if len(shapes[1]) > 1 else 1
    bias = rng.standard_normal((n,)) if len(shapes[1]) > 1 else None
    res = rng.standard_normal(out_shape[-1:] if out_shape else ())
    got = G.ref_matmul(a, b, bias=bias, activation=act, residual=res, alpha=0.7)
    exp = 0.7 * torch.matmul(_t64(a), _t64(b))
    if bias is not None:
        exp = exp + _t64(bias)
    exp = _torch_act(act, exp) + _t64(res)
    np.testing.assert_allclose(got, exp.numpy(), rtol=1e-12, atol=1e-12)


@needs_torch
def test_linear_swiglu_int8_references_match_torch(rng):
    x, w, w2, bias = (rng.standard_normal(s) for s in ((2, 3, 8), (5, 8), (5, 8), (5,)))
    np.testing.assert_allclose(G.ref_linear(x, w, bias, "gelu_tanh"),
                               F.gelu(F.linear(_t64(x), _t64(w), _t64(bias)), approximate="tanh"),
                               rtol=1e-12, atol=1e-14)   # torch's 1 + tanh cancels for x << 0
    np.testing.assert_allclose(G.ref_swiglu_linear(x, w, w2),
                               (F.silu(_t64(x) @ _t64(w).T) * (_t64(x) @ _t64(w2).T)).numpy(),
                               rtol=1e-12)
    a = rng.integers(-128, 128, (6, 40)).astype(np.int8)
    b = rng.integers(-128, 128, (40, 7)).astype(np.int8)
    sa, sb = rng.random(6), rng.random(7)
    exp = (torch.from_numpy(a).long() @ torch.from_numpy(b).long()).double()
    np.testing.assert_allclose(G.ref_int8_matmul(a, b, sa, sb),
                               (exp * _t64(sa)[:, None] * _t64(sb)[None, :]).numpy(), rtol=1e-13)


@pytest.mark.parametrize("call,match", [
    (lambda: go.matmul(np.ones((2, 3)), np.ones((4, 5))), "cannot be multiplied"),
    (lambda: go.matmul(np.ones(()), np.ones((4, 5))), "at least one dimension"),
    (lambda: go.matmul(np.ones((2, 3, 4)), np.ones((5, 4, 2))), "cannot be broadcast"),
    (lambda: go.matmul(np.ones((2, 3)), np.ones((3, 4)), bias=np.ones(3)), "one value per output"),
    (lambda: go.matmul(np.ones((2, 3)), np.ones((3, 4)), residual=np.ones((3, 4))), "residual"),
    (lambda: go.matmul(np.ones((2, 3)), np.ones((3, 4)), activation="tanh"), "activation"),
    (lambda: go.matmul(np.ones((2, 3)), np.ones((3, 4)), variant="cublas"), "variant"),
    (lambda: go.matmul(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32),
                       out_dtype="float16"), "out_dtype"),
    (lambda: go.matmul(np.ones((2, 3)), np.ones((3, 4)), out_dtype="float16"), "out_dtype"),
    (lambda: go.linear(np.ones((2, 3)), np.ones((4, 5))), "in_features"),
    (lambda: go.linear(np.ones((2, 3)), np.ones((4, 3, 1))), "2-D"),
    (lambda: go.swiglu_linear(np.ones((2, 3)), np.ones((4, 3)), np.ones((5, 3))), "differ"),
    (lambda: go.swiglu_linear(np.ones((2, 3)), np.ones((4, 3)), np.ones((4, 3)), variant="naive"),
     "variant"),
    (lambda: go.int8_matmul(np.ones((2, 3), np.int8), np.ones((3, 4), np.int8),
                            np.ones(3, np.float32), np.ones(4, np.float32)), "scale_a"),
    (lambda: go.int8_matmul(np.ones((2, 3), np.int8), np.ones((3, 4), np.int8),
                            np.ones(2, np.float32), np.ones(4, np.float32), variant="wmma"),
     "variant"),
])
def test_argument_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@needs_torch
def test_cpu_path_dtypes(rng):
    a = torch.randn(3, 8, dtype=torch.bfloat16)
    b = torch.randn(8, 5, dtype=torch.bfloat16)
    assert go.matmul(a, b).dtype == torch.bfloat16
    y = go.matmul(a, b, out_dtype=torch.float32, bias=torch.ones(5))
    assert y.dtype == torch.float32
    np.testing.assert_allclose(y.numpy(), (a.double() @ b.double() + 1).numpy(), rtol=1e-6)
    with pytest.raises(TypeError, match="output's dtype"):
        go.matmul(a, b, out_dtype="float32", bias=torch.ones(5, dtype=torch.bfloat16))
    ai = torch.randint(-128, 128, (3, 16), dtype=torch.int8)
    bi = torch.randint(-128, 128, (5, 16), dtype=torch.int8)
    for od in (None, "bfloat16", torch.float16):
        y = go.int8_matmul(ai, bi.T, torch.rand(3), torch.rand(5), od)
        assert y.dtype == dt.to_torch(G.parse_dtype(od) or dt.float32)
    assert go.swiglu_linear(a, b.T, b.T).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- CPU: planning

def _view(shape, strides=None, ptr=1 << 20, dtype=dt.float32):
    from gpuops.shapes import contiguous_strides
    strides = tuple(strides) if strides is not None else contiguous_strides(tuple(shape))
    return Tensor(ptr, tuple(shape), strides, dtype, 0, None)


def test_plan_folds_batch_into_m_when_b_is_shared():
    p = G._plan("t", _view((4, 6, 5, 8)), _view((8, 3)), None)
    assert (p.M, p.N, p.K, p.batch, p.a_sm, p.a_sk) == (120, 3, 8, 1, 8, 1)
    assert p.out_shape == (4, 6, 5, 3)
    # a transposed per batch cannot fold: batch of 4 merged to one dim
    a = _view((4, 8, 5)).__class__(1 << 20, (4, 5, 8), (40, 1, 5), dt.float32, 0, None)
    p = G._plan("t", a, _view((8, 3)), None)
    assert (p.M, p.batch, p.bshape, p.a_sb, p.b_sb, p.a_sm, p.a_sk) == \
        (5, 4, (1, 1, 4), (0, 0, 40), (0, 0, 0), 1, 5)
    # an explicit gemv folds only up to its 16 rows: 6 matrices of 5 rows stay a batch of 6
    p = G._plan("t", _view((3, 2, 5, 45)), _view((45, 29)), None, G.GEMV_MAX_M)
    assert (p.M, p.batch, p.bshape, p.a_sb, p.b_sb) == (5, 6, (1, 1, 6), (0, 0, 225), (0, 0, 0))
    p = G._plan("t", _view((3, 5, 45)), _view((45, 29)), None, G.GEMV_MAX_M)   # 15 rows: folds
    assert (p.M, p.batch, p.a_sm) == (15, 1, 45)


def test_plan_broadcast_batch_and_residual_strides():
    a = _view((2, 1, 5, 7))
    b = _view((3, 7, 4))
    res = _view((4,))
    p = G._plan("t", a, b, res)
    assert p.out_shape == (2, 3, 5, 4) and p.batch == 6
    assert p.bshape == (1, 2, 3) and p.a_sb == (0, 35, 0) and p.b_sb == (0, 0, 28)
    assert (p.r_sm, p.r_sn, p.r_sb) == (0, 1, (0, 0, 0))
    p = G._plan("t", _view((7,)), _view((7, 4)), _view((4,)))      # 1-D a: M = 1, squeezed
    assert (p.M, p.out_shape, p.r_sn) == (1, (4,), 1)
    p = G._plan("t", _view((5, 7)), _view((7,)), _view((5,)))      # 1-D b: N = 1
    assert (p.N, p.out_shape, p.r_sm, p.r_sn, p.b_sk) == (1, (5,), 1, 0, 1)


def test_operand_layouts_and_alignment():
    lay = G._operand_layout
    assert lay(64, 32, 32, 1, (), 256, 4, 4) == (True, True)        # row-major A
    assert lay(64, 32, 1, 64, (), 256, 4, 4) == (False, True)       # a.T view
    assert lay(64, 33, 33, 1, (), 256, 4, 4) == (True, False)       # odd leading dim
    assert lay(64, 32, 32, 1, (), 260, 4, 4) == (True, False)       # unaligned pointer
    assert lay(64, 32, 64, 2, (), 256, 4, 4) == (True, False)       # sliced: element path
    assert lay(1, 32, 7, 1, (), 256, 2, 8) == (True, True)          # one row: its stride is moot
    assert lay(64, 32, 32, 1, (2048, 6), 256, 4, 4) == (True, False)  # batch stride breaks runs


def test_variant_choice():
    c = G._choose
    assert c("t", None, dt.float32, 90, 4096, False, True) == "warp_tiled"
    assert c("t", None, dt.float32, 90, 4096, True, True) == "mma"
    assert c("t", None, dt.float32, 75, 4096, True, True) == "warp_tiled"
    assert c("t", None, dt.bfloat16, 90, 4096, False, True) == ("wgmma" if G.WGMMA_AUTO else "mma")
    # SwiGLU: wgmma too (gemm() takes the dual 'mma' kernel where the pair would not fill the GPU)
    assert c("t", None, dt.bfloat16, 90, 4096, False, True, dual=True) == (
        "wgmma" if G.WGMMA_AUTO else "mma")
    assert c("t", None, dt.bfloat16, 89, 4096, False, True) == "mma"
    assert c("t", None, dt.bfloat16, 61, 4096, False, True) == "warp_tiled"
    assert c("t", None, dt.bfloat16, 90, 1, False, True) == "gemv"
    assert c("t", None, dt.bfloat16, 90, 16, False, True) == "gemv_mma"
    assert c("t", None, dt.bfloat16, 90, 16, False, False) == "gemv"
    assert c("t", None, dt.bfloat16, 75, 16, False, True) == "gemv"
    assert c("t", "wgmma", dt.bfloat16, 90, 4096, False, True) == "wgmma"
    assert c("t", "wgmma", dt.float16, 90, 3, False, True) == "wgmma"     # explicit: any M
    with pytest.raises(RuntimeError, match="sm_90a"):
        c("t", "wgmma", dt.bfloat16, 89, 4096, False, True)
    with pytest.raises(RuntimeError, match="sm_90a"):
        c("t", "wgmma", dt.bfloat16, 100, 4096, False, True)
    with pytest.raises(TypeError, match="float16/bfloat16"):
        c("t", "wgmma", dt.float32, 90, 4096, True, True)
    with pytest.raises(RuntimeError, match="sm_80"):
        c("t", "mma", dt.bfloat16, 61, 4096, False, True)
    with pytest.raises(ValueError, match="allow_tf32"):
        c("t", "mma", dt.float32, 90, 4096, False, True)
    with pytest.raises(ValueError, match="M <= 16"):
        c("t", "gemv", dt.float32, 90, 17, False, True)


def test_decode_plans():
    """gemv_mma's block size and split fill whole waves; the SIMT gemv splits K so that a split's
    slice of A fits in L1 (the plan functions, no GPU)."""
    assert G._gemv_mma_plan(132, 6144, 4096, 1, False) == (2, 1, 0)     # 384 blocks, 396 slots
    assert G._gemv_mma_plan(132, 11008, 4096, 1, True) == (1, 2, 2048)
    for sms in (28, 46, 82, 108, 132):
        for N, K, dual in ((4096, 4096, False), (14336, 4096, False), (4096, 14336, False),
                           (11008, 4096, True), (33, 65, False), (1, 1, True)):
            nt, splits, k_split = G._gemv_mma_plan(sms, N, K, 1, dual)
            assert nt in G.GEMV_MMA_NT[dual]
            if splits > 1:
                assert k_split % 256 == 0 and k_split >= 1024 and G._cdiv(K, k_split) == splits
            else:
                assert k_split == 0
    assert G._l1_split(16, 4096, 4, 1, 0) == (4, 1024)
    assert G._l1_split(8, 4096, 4, 1, 0) == (2, 2048)
    assert G._l1_split(4, 4096, 4, 1, 0) == (1, 0)             # 64 KB: fits already
    assert G._l1_split(16, 4096, 4, 8, 512) == (8, 512)        # already split finer
    assert set(G.PLAN) == {"decode", "mma_tiles", "wgmma", "warp_tiled", "gemv_l2_prefetch",
                           "gemv_ahead", "gemv_rows", "gemv_simt_max_m", "gemv_tma",
                           "gemv_tma_split"}
    # the 'tma' plan's K split (KS, clusters): whole tiles for >= 90% of the 264 block slots of
    # an H200 / H100 with the fewest blocks per cluster; each rank >= 2 chunks of 512 k
    split = lambda *a, **k: G._gemv_tma_split(*a, **k)[:2]  # noqa: E731  (KS, clusters)
    assert split(132, 14336, 4096, "n4k512b2") == (1, 264)      # 448 tiles
    assert split(132, 8192, 28672, "n4k512b2") == (1, 256)      # 256 tiles: 97%
    assert split(132, 4096, 14336, "n4k512b2") == (2, 128)      # 128 tiles: KS 1 fills 48%
    assert split(132, 2048, 14336, "n4k512b2") == (2, 64)       # the best fill, 48%
    assert split(132, 2048, 1536, "n4k512b2") == (1, 64)        # 3 chunks: KS 2 needs 4
    assert split(132, 4096, 14336, "n4k512") == (1, 128)        # not built split
    # 192 tiles: KS 1 fills 73%; KS 2 fills the slots but leaves clusters 1-2 tiles (73%)
    assert split(132, 6144, 4096, "n4k512b2") == (1, 192)
    assert split(132, 14336, 4096, "n4k512b2", 2) == (2, 132)   # forced
    assert split(132, 4096, 14336, "n4k512b2", 1) == (1, 128)
    # SwiGLU: 2 groups of each weight per tile, never split; the score is the slots' fill
    assert G._gemv_tma_split(132, 14336, 4096, "n4k512b2", dual=True) == (1, 264, 1.0)
    assert G._gemv_tma_split(132, 3792, 4096, "n4k512b2", dual=True)[:2] == (1, 237)
    assert split(132, 4096, 512, "n4k512b2", 2) == (1, 128)     # 1 chunk: fewer than KS
    with pytest.raises(ValueError, match="gemv_tma_split"):
        split(132, 4096, 14336, "n4k512b2", 4)
    # fp16/bf16 decode rows above PLAN['gemv_simt_max_m'] go to gemv_mma (sm_80+)
    choose = lambda M: G._choose("matmul", None, dt.bfloat16, 90, M, False, True)  # noqa: E731
    assert [choose(M) for M in (1, 2, 3, 16)] == ["gemv", "gemv_mma", "gemv_mma", "gemv_mma"]
    saved = G.PLAN["gemv_simt_max_m"]
    try:
        G.PLAN["gemv_simt_max_m"] = 4
        assert [choose(M) for M in (1, 2, 4, 5)] == ["gemv", "gemv", "gemv", "gemv_mma"]
    finally:
        G.PLAN["gemv_simt_max_m"] = saved
    # equal fill: the larger block up to two waves, the smaller beyond (non-dual; runs 138-139);
    # forced rows give that NT; AHEAD 2 only past two waves
    assert G._gemv_mma_plan(132, 6144, 2048, 1, False) == (2, 1, 0)       # fill decides
    assert G._gemv_mma_plan(132, 2048, 6144, 1, False) == (4, 4, 1536)    # tie, one wave
    assert G._gemv_mma_plan(132, 4096, 4096, 1, False) == (4, 2, 2048)
    assert G._gemv_mma_plan(132, 151936, 2048, 1, False) == (2, 1, 0)     # tie, 24 waves
    assert G._gemv_mma_plan(132, 2048, 6144, 1, True) == (1, 3, 2048)     # dual: first listed
    assert G._gemv_mma_plan(132, 6144, 2048, 1, False, 8) == (1, 1, 0)
    with pytest.raises(ValueError, match="gemv_rows"):
        G._gemv_mma_plan(132, 6144, 2048, 1, True, 32)
    assert G._gemv_mma_ahead("auto", 9496, 396) == 2 and G._gemv_mma_ahead("auto", 384, 396) == 0
    assert G._gemv_mma_ahead("auto", 792, 396) == 0 and G._gemv_mma_ahead(2, 384, 396) == 2
    with pytest.raises(ValueError, match="gemv_ahead"):
        G._gemv_mma_ahead(4, 384, 396)


class _Info:
    def __init__(self, sms, smem):
        self.sm_count, self.max_smem_per_block_optin = sms, smem


@pytest.mark.parametrize("smem, large", [(232448, G.MMA_LARGE), (166912, G.MMA_LARGE),
                                          (101376, G.MMA_LARGE_K32)])
def test_mma_tile_choice(monkeypatch, smem, large):
    """128x256 tiles when they fill the SMs, in the 144 KiB version where the device allows it
    (H100 227 KiB, A100 163 KiB per block; sm_86/89 99 KiB take the 96 KiB one), else 128x128;
    PLAN['mma_tiles'] forces a configuration unless the device lacks its shared memory."""
    monkeypatch.setattr(G.device, "device_info", lambda dev: _Info(132, smem))
    assert G._mma_config(0, 8192, 8192, 1) == large
    assert G._mma_config(0, 4096, 2048, 1) == large            # 256 tiles >= 132 SMs
    assert G._mma_config(0, 1024, 2048, 1) == G.MMA_SMALL      # 64 tiles: 128x128 gives 128
    assert G._mma_config(0, 1024, 2048, 4) == large            # a batch fills the SMs
    for name, cfg in G.MMA_TILES.items():
        monkeypatch.setitem(G.PLAN, "mma_tiles", name)
        want = cfg if G._mma_smem(cfg) <= smem else G.MMA_SMALL    # else the rule's choice
        assert G._mma_config(0, 100, 100, 1) == want, name
    monkeypatch.setitem(G.PLAN, "mma_tiles", "auto")
    assert G._mma_config(0, 100, 100, 1) == G.MMA_SMALL


def test_mma_tile_configurations_are_consistent():
    """What cuda_src/gemm/mma.cu static_asserts, checked here too: 8 or 4 warps of 64x64 (64x32
    dual), 64/128-byte K tiles with an even number of mma k steps, shared memory per block within
    what the configuration is meant for; every configuration is compiled for every dtype."""
    for cfg in (*G.MMA_TILES.values(), G.MMA_DUAL):
        bm, bn, wm, wn, stages, bkb = cfg
        assert bkb in (64, 128) and (bkb // 32) % 2 == 0 and stages >= 3
        assert bm // wm == 64 and bn // wn in (32, 64)
    assert G._mma_smem(G.MMA_LARGE) == 144 * 1024
    assert G._mma_smem(G.MMA_LARGE_K32) == G._mma_smem(G.MMA_SMALL) * 3 // 2 == 96 * 1024
    assert G._mma_smem(G.MMA_DUAL, dual=True) == 64 * 1024
    for d in (dt.float16, dt.bfloat16, dt.int8):
        names = set(G.MMA[d].kernels)
        for cfg in G.MMA_TILES.values():
            assert any(f", {', '.join(map(str, cfg))}, " in n for n in names), (d, cfg)


def _res_plan(N, r_sm, r_sn, r_sb=(0, 0, 0)):
    p = G._Plan()
    p.N, p.r_sm, p.r_sn, p.r_sb = N, r_sm, r_sn, r_sb
    return p


def _res_launch(ptr):
    L = G._Launch()
    L.residual = ptr
    return L


def test_mma_residual_vector_flag():
    """The mma epilogue reads the residual in 16-byte runs of 8 columns only when every run is
    one aligned, contiguous, in-row piece."""
    ok = G._residual_vec
    assert ok(_res_plan(64, 64, 1), _res_launch(4096), 2)
    assert ok(_res_plan(64, 0, 1), _res_launch(4096), 2)                # a row broadcast
    assert ok(_res_plan(64, 64, 1), _res_launch(4096), 4)                # fp32: 2 x 16 bytes
    assert not ok(_res_plan(67, 67, 1), _res_launch(4096), 2)            # N % 8
    assert not ok(_res_plan(64, 68, 1), _res_launch(4096), 2)            # rows not 16-byte apart
    assert ok(_res_plan(64, 68, 1), _res_launch(4096), 4)                # ... they are in fp32
    assert not ok(_res_plan(64, 1, 64), _res_launch(4096), 2)            # transposed residual
    assert not ok(_res_plan(64, 64, 1), _res_launch(4098), 2)            # unaligned pointer
    assert not ok(_res_plan(64, 64, 1, (0, 0, 4100)), _res_launch(4096), 2)   # batch stride


def test_wgmma_auto_is_behind_its_flag(monkeypatch):
    """variant=None picks wgmma only with WGMMA_AUTO (on since run 21 proved it on the GPU),
    only on sm_90, for fp16/bf16 beyond decode sizes."""
    c = G._choose
    monkeypatch.setattr(G, "WGMMA_AUTO", False)
    assert c("t", None, dt.bfloat16, 90, 4096, False, True) == "mma"
    monkeypatch.setattr(G, "WGMMA_AUTO", True)
    assert c("t", None, dt.bfloat16, 90, 4096, False, True) == "wgmma"
    assert c("t", None, dt.float16, 90, 17, False, False) == "wgmma"
    assert c("t", None, dt.bfloat16, 90, 16, False, True) == "gemv_mma"
    # the dual (SwiGLU) product too: gemm() then runs the two wgmma products where they fill
    # the GPU (SWIGLU_WGMMA_MIN_WAVES), else the dual 'mma' kernel
    assert c("t", None, dt.bfloat16, 90, 4096, False, True, dual=True) == "wgmma"
    assert c("t", None, dt.bfloat16, 90, 16, False, True, dual=True) == "gemv_mma"
    assert c("t", None, dt.bfloat16, 89, 4096, False, True) == "mma"
    assert c("t", None, dt.bfloat16, 89, 4096, False, True, dual=True) == "mma"
    assert c("t", None, dt.float32, 90, 4096, True, True) == "mma"
    assert "wgmma" in G._DUAL_VARIANTS


# ----------------------------------------------------------------------------- CPU: wgmma

def _wg_op(shape, strides, ptr=1 << 20, rows_box=None, batch=((1, 1, 1), (0, 0, 0))):
    """_wgmma_operand of an operand X[r][k] given as (R, K), (sr, sk)."""
    return G._wgmma_operand(shape[0], shape[1], strides[0], strides[1], batch[0], batch[1], ptr, 2,
                            rows_box or G.WGMMA_BM)


def test_wgmma_operand_layouts():
    """Which layout and tensor map the wgmma kernel gets for each operand layout; what TMA cannot
    read is refused with the reason (the rules of cuTensorMapEncodeTiled)."""
    # row-major A [M, K]: K-major, one 64 x 128 box per stage
    assert _wg_op((4096, 2048), (2048, 1)) == (False, (2048, 4096), (4096,), (64, 128))
    # a.T view: M-major, 64 x 64 boxes
    assert _wg_op((4096, 2048), (1, 4096)) == (True, (4096, 2048), (8192,), (64, 64))
    # B row-major [K, N] seen as B^T [N][K]: N-major; a Linear weight [N, K]: K-major, 256 rows
    assert _wg_op((6144, 2048), (1, 6144), rows_box=G.WGMMA_BN) == \
        (True, (6144, 2048), (12288,), (64, 64))
    assert _wg_op((6144, 2048), (2048, 1), rows_box=G.WGMMA_BN) == \
        (False, (2048, 6144), (4096,), (64, 256))
    # ragged extents are fine (TMA zero-fills), strides must be multiples of 16 bytes
    assert _wg_op((17, 65), (72, 1))[0] is False
    none, why = _wg_op((17, 65), (65, 1))
    assert none is None and "multiple of 16" in why
    none, why = _wg_op((64, 64), (64, 1), ptr=(1 << 20) + 2)
    assert none is None and "16-byte aligned" in why
    none, why = _wg_op((64, 64), (128, 2))                     # sliced: no unit stride
    assert none is None and "unit stride" in why
    none, why = _wg_op((64, 64), (-64, 1))                     # negative stride
    assert none is None and "positive" in why
    # one row / one k: that dim's stride is moot (a valid dummy is encoded)
    assert _wg_op((1, 64), (3, 1)) == (False, (64, 1), (128,), (64, 128))
    assert _wg_op((64, 1), (1, 3)) == (True, (64, 1), (128,), (64, 64))   # K-major needs sr % 8
    # batch dims go after the matrix dims, innermost first; broadcast dims get extent 1
    assert _wg_op((40, 48), (48, 1), batch=((1, 2, 3), (0, 0, 1920))) == \
        (False, (48, 40, 3, 1, 1), (96, 3840, 11520, 11520), (64, 128, 1, 1, 1))
    assert _wg_op((40, 48), (48, 1), batch=((1, 2, 3), (0, 1920, 0))) == \
        (False, (48, 40, 1, 2, 1), (96, 3840, 3840, 7680), (64, 128, 1, 1, 1))
    none, why = _wg_op((40, 48), (48, 1), batch=((1, 1, 3), (0, 0, 1924)))
    assert none is None and "multiple of 16" in why


def test_wgmma_refuses_what_tma_cannot_read_naming_the_operand():
    """variant='wgmma' raises ValueError naming the user's argument (checked before any device
    call); variant=None falls back to 'mma' on the same error (gemm())."""
    M, N, K = 64, 64, 65
    for op, a, b, name in (
            ("matmul", _view((M, K), dtype=dt.bfloat16), _view((K, 64), dtype=dt.bfloat16), "a"),
            ("matmul", _view((M, 64), dtype=dt.bfloat16),
             _view((64, N), (N + 1, 1), dtype=dt.bfloat16), "b"),
            ("linear", _view((M, 64), dtype=dt.bfloat16),
             G._transposed(_view((N, 64), ptr=(1 << 20) + 2, dtype=dt.bfloat16)), "weight")):
        p = G._plan(op, a, b, None)
        L = G._Launch()
        L.a, L.b = a.ptr, b.ptr
        with pytest.raises(ValueError, match=f"cannot read '{name}' with TMA"):
            G._wgmma_maps(op, p, L, dt.bfloat16)


def test_wgmma_launch_packs_its_arguments(monkeypatch):
    """The host path of a wgmma call down to cuLaunchKernel, without a GPU: the driver's encoder
    and the kernel are stand-ins; the arguments must pack into the kernel's ArgSpec (two 128-byte
    maps, then GemmArgs), with the persistent grid, 384 threads and the kernel's shared memory."""
    launches, encoded = [], []

    class FakeKernel:
        def launch(self, grid, block, stream, *args, smem=0):
            buf = bytearray(G.WGMMA_ARGS.size)
            G.WGMMA_ARGS.struct.pack_into(buf, 0, *args)
            launches.append((grid, block, stream, args, smem))

    def fake_encode(ptr, dtype, dims, strides, box, *rest):
        encoded.append((ptr, dims, strides, box))
        return bytes([len(encoded)]) * 128

    class FakeCall:
        result_dtype, device, stream = dt.bfloat16, 0, 1234

        def empty(self, shape, dtype):
            return _view(shape, ptr=1 << 30, dtype=dtype)

    monkeypatch.setattr(G.tma, "encode_tiled", fake_encode)
    monkeypatch.setattr(G, "effective_arch", lambda dev: 90)
    monkeypatch.setattr(G.device, "sm_count", lambda dev: 132)
    monkeypatch.setattr(G, "PLAN", {**G.PLAN, "wgmma": "base"})   # the packing of one module
    monkeypatch.setattr(G._kernels, "get", lambda module, expr, dev: (
        launches.append(("kernel", module.name, expr)), FakeKernel())[1])
    G._wgmma_map_cache.clear()
    a = _view((4096, 2048), dtype=dt.bfloat16)
    b = _view((2048, 6144), ptr=1 << 24, dtype=dt.bfloat16)
    bias = _view((6144,), ptr=1 << 28, dtype=dt.bfloat16)
    out = G.gemm(FakeCall(), "matmul", a, b, bias=bias, activation="gelu", variant="wgmma")
    assert out.shape == (4096, 6144)
    (_, name, expr), (grid, block, stream, args, smem) = launches
    assert name == "gemm.wgmma_bf16"
    assert expr == "gpuops::gemm::gemm_wgmma<gpuops::bfloat16_t, false, true, 0>"   # B N-major
    assert grid == (132, 1, 1) and block == (384, 1, 1) and stream == 1234
    assert smem == G.WGMMA_SMEM
    assert args[0] == b"\x01" * 128 and args[1] == b"\x02" * 128
    assert encoded == [(1 << 20, (2048, 4096), (4096,), (64, 128)),
                       (1 << 24, (6144, 2048), (12288,), (64, 64))]
    assert args[2:6] == (1 << 20, 1 << 24, 0, 1 << 30) and args[6] == 1 << 28
    # a repeated call takes the maps from the cache
    G.gemm(FakeCall(), "matmul", a, b, variant="wgmma")
    assert len(encoded) == 2
    # fewer tiles than SMs: one block per tile (2 x 2 tiles of 128 x 256)
    launches.clear()
    G.gemm(FakeCall(), "matmul", _view((200, 64), dtype=dt.bfloat16),
           _view((64, 264), ptr=1 << 24, dtype=dt.bfloat16), variant="wgmma")
    assert launches[1][0] == (4, 1, 1)
    G._wgmma_map_cache.clear()


def test_wgmma_grid_is_one_block_per_sm_at_most():
    """Persistent grid: at most one CTA per SM, never more than the tiles of the batch."""
    from types import SimpleNamespace
    p = SimpleNamespace(M=4096, N=6144, batch=1)               # 32 x 24 tiles
    assert G._wgmma_grid(p, 132) == 132
    small = SimpleNamespace(M=300, N=520, batch=2)             # 3 x 3 tiles, 2 matrices
    assert G._wgmma_grid(small, 132) == 18
    assert G._wgmma_grid(small, 132, bn=G.WGMMA_PP_BN) == 30   # 3 x 5 tiles of 128 x 128
    assert G._wgmma_grid(small, 132, splits=4) == 72           # 18 tiles x 4 K splits
    assert G._wgmma_grid(small, 132, splits=8) == 132


def test_wgmma_split_k_plan(monkeypatch):
    """Split-K only where the tiles fill at most WGMMA_SPLIT_MAX_FILL of the SMs, each split at
    least WGMMA_SPLIT_MIN_KTILES k-tiles, splits x tiles within the SMs, whole k-tiles per split
    and every k-tile in exactly one split; not where the estimated reduce outweighs the saving."""
    from types import SimpleNamespace as P
    for M, N, K, batch in ((128, 6144, 2048, 1), (256, 6144, 2048, 1), (64, 80, 65536, 1),
                           (300, 520, 1024, 1), (100, 264, 1024, 3), (17, 33, 65, 1),
                           (512, 6144, 2048, 1), (4096, 4096, 4096, 1), (128, 256, 64, 1),
                           (128, 6143, 2048, 1)):
        p = P(M=M, N=N, K=K, batch=batch)
        tiles = -(-M // G.WGMMA_BM) * -(-N // G.WGMMA_BN) * batch
        ktiles = -(-K // G.WGMMA_BK)
        splits, k_split = G._wgmma_split(p, 132)
        if splits == 1:
            assert k_split == 0
            continue
        assert tiles <= G.WGMMA_SPLIT_MAX_FILL * 132 and 2 <= splits <= G.WGMMA_SPLIT_MAX
        assert splits * tiles <= 132 and k_split % G.WGMMA_BK == 0
        assert k_split // G.WGMMA_BK >= G.WGMMA_SPLIT_MIN_KTILES
        assert (splits - 1) * k_split < K <= splits * k_split, (M, N, K, splits, k_split)
    # run 183's measured cases: long K splits 16 ways; [128, 6144, 2048]'s 5 splits measured no
    # faster than the unsplit product (24.3 against 23.4 us): the estimate keeps it whole
    assert G._wgmma_split(P(M=32, N=2048, K=6144, batch=1), 132) == (16, 384)
    assert G._wgmma_split(P(M=32, N=6144, K=2048, batch=1), 132) == (5, 448)
    assert G._wgmma_split(P(M=128, N=6144, K=2048, batch=1), 132) == (1, 0)
    assert G._wgmma_split(P(M=32, N=6143, K=2048, batch=1), 132) == (1, 0)    # odd N
    assert G._wgmma_split(P(M=4096, N=2048, K=6144, batch=1), 132) == (1, 0)  # tiles fill it
    # SwiGLU (two products, gain SWIGLU_SPLIT_GAIN against the dual kernel)
    two = dict(products=2, gain=G.SWIGLU_SPLIT_GAIN)
    assert G._wgmma_split(P(M=32, N=6144, K=2048, batch=1), 132, **two) == (5, 448)
    assert G._wgmma_split(P(M=300, N=520, K=1024, batch=1), 132, **two) == (1, 0)
    monkeypatch.setattr(G, "WGMMA_SPLIT_K", False)
    assert G._wgmma_split(P(M=32, N=2048, K=6144, batch=1), 132) == (1, 0)


@pytest.mark.parametrize("config", sorted(G.WGMMA_CONFIGS))
def test_wgmma_configs_launch_their_kernels(config, monkeypatch):
    """PLAN['wgmma'] picks the module, kernel, grid, maps and shared memory of each
    configuration."""
    launches, encoded, maps = [], [], []

    class FakeKernel:
        def launch(self, grid, block, stream, *args, smem=0):
            spec = {3: G.WGMMA_TMASTORE_ARGS, 4: G.WGMMA_TMAFUSED_ARGS,
                    6: G.WGMMA_TMAFUSED_ARGS}.get(epi, G.WGMMA_ARGS)
            spec.struct.pack_into(bytearray(spec.size), 0, *args)
            launches.append((grid, block, smem))
            maps.append(args[:4])

    class FakeCall:
        result_dtype, device, stream = dt.bfloat16, 0, 1

        def empty(self, shape, dtype):
            return _view(shape, ptr=1 << 30, dtype=dtype)

    monkeypatch.setattr(G.tma, "encode_tiled", lambda ptr, dtype, dims, strides, box, *r: (
        encoded.append(box), bytes([len(encoded)]) * 128)[1])
    monkeypatch.setattr(G, "effective_arch", lambda dev: 90)
    monkeypatch.setattr(G.device, "sm_count", lambda dev: 132)
    monkeypatch.setattr(G._kernels, "get", lambda module, expr, dev: (
        launches.append((module.name, expr)), FakeKernel())[1])
    monkeypatch.setitem(G.PLAN, "wgmma", config)
    G._wgmma_map_cache.clear()
    epi = G.WGMMA_CONFIGS[config]
    x, w = _view((4096, 2048), dtype=dt.bfloat16), _view((6144, 2048), ptr=1 << 24,
                                                           dtype=dt.bfloat16)
    G.gemm(FakeCall(), "linear", x, G._transposed(w), variant="wgmma")
    (name, expr), (grid, block, smem) = launches
    assert name == ("gemm.wgmma_bf16" if config == "base" else f"gemm.wgmma_{config}_bf16")
    if epi == 3:   # the tensor-store epilogue: its own kernel, a third map (C) with 16 x 32 boxes
        assert expr == "gpuops::gemm::gemm_wgmma_tmastore<gpuops::bfloat16_t, false, false>"
        assert encoded == [(64, 128), (64, 256), (32, 16, 1)]
    elif epi == 4:  # and a fourth (the residual's): C's map again without a residual
        assert expr == "gpuops::gemm::gemm_wgmma_tmafused<gpuops::bfloat16_t, false, false>"
        assert encoded == [(64, 128), (64, 256), (32, 16, 1)]
        assert maps[0][3] == maps[0][2] == bytes([3]) * 128
    elif epi == 6:  # tma_fused's maps, B in 128-row boxes (128 x 128 tiles)
        assert expr == "gpuops::gemm::gemm_wgmma_pingpong<gpuops::bfloat16_t, false, false>"
        assert encoded == [(64, 128), (64, 128), (32, 16, 1)]
        assert maps[0][3] == maps[0][2] == bytes([3]) * 128
    else:
        assert expr == f"gpuops::gemm::gemm_wgmma<gpuops::bfloat16_t, false, false, {epi}>"
        assert encoded == [(64, 128), (64, 256)]
    assert expr in G.WGMMA_MODULES[config][dt.bfloat16].kernels
    assert grid == (132, 1, 1) and block == (384, 1, 1)
    assert smem == {4: G.WGMMA_SMEM_FUSED, 6: G.WGMMA_SMEM_PINGPONG}.get(epi, G.WGMMA_SMEM)
    # 3 x 3 tiles (3 x 5 of 128 x 128): one block each
    launches.clear()
    G.gemm(FakeCall(), "matmul", _view((300, 64), dtype=dt.bfloat16),
           _view((64, 520), ptr=1 << 24, dtype=dt.bfloat16), variant="wgmma")
    assert launches[1][0] == ((15 if epi == 6 else 9), 1, 1)
    monkeypatch.setitem(G.PLAN, "wgmma", "nope")
    with pytest.raises(ValueError, match="PLAN\\['wgmma'\\]"):
        G.gemm(FakeCall(), "matmul", x, G._transposed(w), variant="wgmma")
    G._wgmma_map_cache.clear()


def test_tma_store_gives_way_to_direct_where_it_cannot_or_should_not(monkeypatch):
    """'tma_store' writes C through a tensor map: fp32 outputs, N % 8 != 0 and a misaligned C
    go to 'direct' (TMA cannot), and so do fused epilogues (measured slower, run 30)."""
    monkeypatch.setitem(G.PLAN, "wgmma", "tma_store")

    def config(N=64, **launch):
        p, L = types.SimpleNamespace(N=N, batch=1), G._Launch()
        L.c = 1 << 20
        for k, v in launch.items():
            setattr(L, k, v)
        return G._wgmma_call_config(p, L)

    assert config() == "tma_store"
    assert config(N=60) == "direct"
    assert config(c=(1 << 20) + 8) == "direct"
    assert config(out_f32=1) == "direct"
    assert config(bias=1 << 22) == "direct"
    assert config(residual=1 << 22) == "direct"
    assert config(act=3) == "direct"
    monkeypatch.setattr(G, "_TMA_STORE_GENERIC_FUSED", True)     # the experiment's A/B switch
    assert config(bias=1 << 22) == "tma_store"
    monkeypatch.setattr(G, "_TMA_STORE_GENERIC_FUSED", False)
    monkeypatch.setitem(G.PLAN, "wgmma", "base")
    assert config(bias=1 << 22) == "base"


@pytest.mark.parametrize("cfg", ["pingpong", "tma_fused"])
def test_tma_fused_routing_and_residual_maps(cfg, monkeypatch):
    """'tma_fused' keeps bare and fused calls (bias, activation, residual) while TMA can write C
    and read the residual; fp32 outputs, N % 8 != 0, a misaligned C and residuals TMA cannot
    read (row broadcast, transposed, misaligned rows) go to 'direct'. The residual's map has C's
    geometry: (N, M[, batch dims innermost first]), 32 x 16 boxes, 64-byte swizzle. 'pingpong'
    (tma_fused's epilogue on 128 x 128 tiles) routes alike."""
    monkeypatch.setitem(G.PLAN, "wgmma", cfg)

    def plan(M=300, N=520, r_sm=520, r_sn=1, batch=1, bshape=(1, 1, 1), r_sb=(0, 0, 0)):
        return types.SimpleNamespace(M=M, N=N, r_sm=r_sm, r_sn=r_sn, batch=batch, bshape=bshape,
                                     r_sb=r_sb)

    def config(p=None, **launch):
        p, L = p or plan(), G._Launch()
        L.c = 1 << 20
        for k, v in launch.items():
            setattr(L, k, v)
        return G._wgmma_call_config(p, L)

    res = 1 << 22
    assert config() == cfg
    assert config(bias=1 << 21, bias_s=1) == cfg
    assert config(act=3) == cfg
    assert config(bias=1 << 21, bias_s=1, act=2, residual=res) == cfg
    assert config(bias=1 << 21, bias_s=0) == "direct"               # a broadcast bias
    assert config(bias=1 << 21, bias_s=2) == "direct"               # a strided bias
    assert config(bias=(1 << 21) + 2, bias_s=1) == "direct"         # not 4-byte aligned
    assert config(plan(N=60, r_sm=60)) == "direct"                  # N % 8: C
    assert config(c=(1 << 20) + 8, bias=1 << 21) == "direct"
    assert config(out_f32=1, residual=res) == "direct"
    assert config(plan(r_sm=0), residual=res) == "direct"           # row residual (broadcast)
    assert config(plan(r_sm=1, r_sn=300), residual=res) == "direct"  # transposed residual
    assert config(plan(r_sm=524), residual=res) == "direct"         # rows 1048 B apart
    assert config(residual=res + 2) == "direct"                     # misaligned base
    assert config(plan(M=1, r_sm=0), residual=res) == cfg   # one row: no row stride
    L = G._Launch()
    L.residual = res
    assert G._wgmma_residual_plan(plan(), L, 2) == ((520, 300), (1040,), (32, 16))
    # batch 2 x 3 (bshape outermost first), residual broadcast over the outer dim
    p = plan(batch=6, bshape=(1, 2, 3), r_sb=(0, 0, 300 * 520))
    assert G._wgmma_residual_plan(p, L, 2) == (
        (520, 300, 3, 1, 1), (1040, 312000, 936000, 936000), (32, 16, 1, 1, 1))
    p = plan(batch=6, bshape=(1, 2, 3), r_sb=(0, 3 * 300 * 520, 300 * 520))
    assert G._wgmma_residual_plan(p, L, 2) == (
        (520, 300, 3, 2, 1), (1040, 312000, 936000, 1872000), (32, 16, 1, 1, 1))
    assert config(p, residual=res) == cfg

    # the launch: a fourth map for the residual, tma_fused's shared memory
    launches, encoded = [], []

    class FakeKernel:
        def launch(self, grid, block, stream, *args, smem=0):
            G.WGMMA_TMAFUSED_ARGS.struct.pack_into(bytearray(G.WGMMA_TMAFUSED_ARGS.size), 0,
                                                   *args)
            launches.append((args, smem))

    class FakeCall:
        result_dtype, device, stream = dt.bfloat16, 0, 1

        def empty(self, shape, dtype):
            return _view(shape, ptr=1 << 30, dtype=dtype)

    monkeypatch.setattr(G.tma, "encode_tiled", lambda ptr, dtype, dims, strides, box, *r: (
        encoded.append((ptr, dims, strides, box, r)), bytes([len(encoded)]) * 128)[1])
    monkeypatch.setattr(G, "effective_arch", lambda dev: 90)
    monkeypatch.setattr(G.device, "sm_count", lambda dev: 132)
    monkeypatch.setattr(G._kernels, "get", lambda module, expr, dev: (
        launches.append((module.name, expr)), FakeKernel())[1])
    G._wgmma_map_cache.clear()
    x, w = _view((4096, 2048), dtype=dt.bfloat16), _view((6144, 2048), ptr=1 << 24,
                                                           dtype=dt.bfloat16)
    r = _view((4096, 6144), ptr=1 << 28, dtype=dt.bfloat16)
    G.gemm(FakeCall(), "linear", x, G._transposed(w), residual=r, activation="gelu",
           variant="wgmma")
    (name, expr), (args, smem) = launches
    kernel = "tmafused" if cfg == "tma_fused" else cfg
    assert name == f"gemm.wgmma_{cfg}_bf16"
    assert expr == f"gpuops::gemm::gemm_wgmma_{kernel}<gpuops::bfloat16_t, false, false>"
    assert smem == (G.WGMMA_SMEM_FUSED if cfg == "tma_fused" else G.WGMMA_SMEM_PINGPONG)
    assert encoded[3] == (1 << 28, (6144, 4096), (12288,), (32, 16), (G.tma.SWIZZLE_64B,))
    assert args[3] == bytes([4]) * 128 and args[2] == bytes([3]) * 128
    G._wgmma_map_cache.clear()


def _tma_fused_schedule(tiles, has_res, refill_wait=1, chunk_wait=3, boxes=4):
    """A model of one warp's lane 0 in 'tma_fused' (cuda_src/gemm/wgmma.cu,
    wg_fused_residual_prologue / wg_epilogue_tma_fused) over a sequence of tiles, each given as
    its count of live 32-column chunks (0: the warp's rows lie past M): which box holds what, and
    which store groups may still read a box (cp.async.bulk.wait_group.read N completes all but the
    N most recent groups). refill_wait / chunk_wait: the kernel's N before a residual refill /
    before the math of chunk c >= 4 without a residual. Returns the violations: a TMA load or
    the math writing a box that a store may still read, or a chunk's math finding another
    chunk's residual in its box."""
    bad, pending, content = [], [], [None] * boxes

    def wait_read(n):
        del pending[:max(0, len(pending) - n)]

    def load(box, tile, chunk):
        if box in pending:
            bad.append(f"tile {tile}: residual of chunk {chunk} loaded into box {box} while a "
                       "store reads it")
        content[box] = ("res", tile, chunk)

    for ti, live in enumerate(tiles):
        if has_res and live:                       # main loop, k-tile pf_kt
            wait_read(0)
            for b in range(min(boxes, live)):
                load(b, ti, b)
        if not live:
            continue
        if not has_res:
            wait_read(0)
        for c in range(live):
            box = c % boxes
            if has_res:
                if content[box] != ("res", ti, c):
                    bad.append(f"tile {ti} chunk {c}: box {box} holds {content[box]}")
            elif c >= boxes:
                wait_read(chunk_wait)
            if box in pending:
                bad.append(f"tile {ti} chunk {c}: writes box {box} while a store reads it")
            content[box] = ("out", ti, c)
            pending.append(box)                    # the chunk's tensor store
            cn = c + boxes - 1
            if has_res and c >= 1 and cn < live:
                wait_read(refill_wait)
                load(cn % boxes, ti, cn)
    return bad


def test_tma_fused_box_schedule():
    """The box reuse of 'tma_fused' (4 boxes per warp; the residual of chunk c + 3 goes into
    chunk c - 1's box after wait_group.read 1; without a residual, chunk c >= 4 waits with
    wait_group.read 3) over tiles with every count of live chunks, warps past M among them; the
    model must catch one wait too lax in either place."""
    import random
    rng = random.Random(0)
    seqs = [[8] * 5, list(range(9)), [1, 8, 3, 0, 8, 5]] + [
        [rng.randint(0, 8) for _ in range(12)] for _ in range(200)]
    for seq in seqs:
        for has_res in (False, True):
            assert _tma_fused_schedule(seq, has_res) == [], (seq, has_res)
    assert _tma_fused_schedule([8, 8], True, refill_wait=2)
    assert _tma_fused_schedule([8, 8], False, chunk_wait=4)


def test_wgmma_constants_match_the_kernel():
    """ops/gemm.py's tile, threads and shared-memory size mirror cuda_src/gemm/wgmma.cu."""
    text = (ROOT / "cuda_src/gemm/wgmma.cu").read_text()
    consts = {k: int(v) for k, v in re.findall(r"\b(kWg\w+) = (\d+)", text)}
    assert (consts["kWgBM"], consts["kWgBN"], consts["kWgBK"], consts["kWgStages"]) == \
        (G.WGMMA_BM, G.WGMMA_BN, G.WGMMA_BK, G.WGMMA_STAGES)
    assert consts["kWgThreads"] == G.WGMMA_THREADS == 384
    stage = (G.WGMMA_BM + G.WGMMA_BN) * G.WGMMA_BK * 2
    epi = 8 * 16 * consts["kWgEpiLd"] * 4
    assert G.WGMMA_SMEM == G.WGMMA_STAGES * stage + epi + 2 * G.WGMMA_STAGES * 8 + 1024
    # tma_fused: boxes of 1 KiB per consumer warp, two bias rows, one barrier per box
    boxes = consts["kWgFusedBoxes"]
    assert boxes == G.WGMMA_FUSED_BOXES
    assert G.WGMMA_SMEM_FUSED == (G.WGMMA_STAGES * stage + 8 * boxes * 1024 + 2 * G.WGMMA_BN * 2
                                  + 2 * G.WGMMA_STAGES * 8 + 8 * boxes * 8 + 1024)
    assert "kWgFusedSmemBytes =\n    kWgFusedBarOffset + 2 * kWgStages * 8 + 8 * kWgFusedBoxes * 8 + 1024" in text
    assert G.WGMMA_SMEM_FUSED <= 227 * 1024
    assert "kWgSmemBytes = kWgBarOffset + 2 * kWgStages * 8 + 1024" in text
    assert G.WGMMA_SMEM <= 227 * 1024
    # pingpong: 128 x 128 tiles, its own ring, tma_fused's boxes, two bias rows per warpgroup
    pp = {k: int(v) for k, v in re.findall(r"\b(kPp\w+) = (\d+)", text)}
    assert (pp["kPpBN"], pp["kPpStages"]) == (G.WGMMA_PP_BN, G.WGMMA_PP_STAGES)
    pp_stage = (G.WGMMA_BM + G.WGMMA_PP_BN) * G.WGMMA_BK * 2
    assert G.WGMMA_SMEM_PINGPONG == (G.WGMMA_PP_STAGES * pp_stage + 8 * boxes * 1024
                                     + 2 * 2 * G.WGMMA_PP_BN * 2 + 2 * G.WGMMA_PP_STAGES * 8
                                     + 2 * 8 + 8 * boxes * 8 + 1024)
    assert ("kPpSmemBytes =\n    kPpBarOffset + 2 * kPpStages * 8 + 2 * 8 + 8 * kWgFusedBoxes * 8"
            " + 1024") in text
    assert G.WGMMA_SMEM_PINGPONG <= 227 * 1024


def test_wgmma_layout_simulation():
    """scripts/wgmma_layout_sim.py: TMA's swizzled boxes read back through the kernel's wgmma
    descriptors give the right operand elements for all four layouts (ragged edges included),
    and the epilogue writes every element of a tile once, without bank conflicts."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("wgmma_layout_sim",
                                                  ROOT / "scripts/wgmma_layout_sim.py")
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    assert sim.check_layouts() == []
    assert sim.check_epilogue() == []
    sim.lbo = lambda mn_major: 1024 if mn_major else 16      # a wrong LBO must be caught
    assert sim.check_layouts()


@pytest.mark.skipif(not nvrtc.available(), reason="NVRTC not installed")
@pytest.mark.parametrize("config", sorted(G.WGMMA_CONFIGS))
@pytest.mark.parametrize("dtype", [dt.bfloat16, dt.float16], ids=["bfloat16", "float16"])
def test_wgmma_module_compiles_for_sm90a(dtype, config):
    """The wgmma module of each configuration for sm_90a: no spills, no 'wgmma serialized'
    warning from ptxas, the register split (setmaxnreg) and, in the SASS when nvdisasm is
    installed, HGMMA.64x256x16 fed by TMA (UTMALDG) and mbarriers."""
    if config != "base" and dtype is dt.float16:
        pytest.skip("configurations are compiled for bf16 here (the kernel is the same code)")
    m = G.WGMMA_MODULES[config][dtype]
    c = nvrtc.compile_source(m.assembled.text, m.assembled.main_file, m.name,
                             nvrtc.Target(90, "cubin", "a"), m.options, m.name_expressions,
                             verbose=True)
    assert set(c.resources) == set(c.lowered.values()) and len(c.resources) == 4
    for name, r in c.resources.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, (name, r)
        assert r["registers"] <= 168, (name, r)         # 384 threads x 1 block at launch
    assert "serializ" not in c.log.lower() and "performance loss" not in c.log.lower(), c.log
    # the parameter block as the driver sees it (run 15/16's bug: the maps are 64-byte aligned in
    # constant-bank terms, so the block starts with padding and a flat launch buffer packed by the
    # PTX offsets arrived 48 bytes off; the launch goes through kernelParams instead)
    for expr, spec in m.kernels.items():
        _, params = launch.cubin_params(c.image, c.lowered[expr])
        assert [o - params[0][0] for o, _ in params] == [o for o, _, _ in spec.layout], expr
        assert [s for _, s in params] == [s for _, s, _ in spec.layout], expr
        assert spec.needs_pointers
    sass = _sass(c.image)
    if sass is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    # nvdisasm prints fp16 inputs as the default type (no suffix), bf16 as .BF16; 'pingpong'
    # multiplies 128 x 128 tiles as two m64n128k16 products per k16 step
    n, per_k16 = (128, 2) if G.WGMMA_CONFIGS[config] == 6 else (256, 1)
    hgmma = f"HGMMA.64x{n}x16.F32.BF16 " if dtype is dt.bfloat16 else f"HGMMA.64x{n}x16.F32 "
    assert sass.count(hgmma) == 4 * 4 * per_k16, hgmma        # 4 k16 steps x 4 kernels
    # the transpose bits: A M-major in 2 of the 4 kernels, B N-major in 2
    assert sass.count(".tnspA") == 8 * per_k16 and sass.count(".tnspB") == 8 * per_k16
    for op in ("UTMALDG.2D", "UTMALDG.5D", "SYNCS.ARRIVE", "USETMAXREG.DEALLOC",
               "USETMAXREG.TRY_ALLOC", "WARPGROUP.ARRIVE"):
        assert op in sass, op
    assert "LDL" not in sass and "STL" not in sass


@pytest.mark.skipif(not nvrtc.available(), reason="NVRTC not installed")
def test_wgmma_probe_module_compiles_for_sm90a():
    """The probes of benchmarks/experiments/wgmma_bisect.py (cuda_src/gemm/wgmma_probe.cu): no
    spills, the parameter probe has the GEMM's exact parameter list, and the mma probes issue the
    GEMM's HGMMA with its transpose bits."""
    m = G.WGMMA_PROBE
    assert m.kernels["gpuops::gemm::wgmma_probe_params"] is G.WGMMA_ARGS
    c = nvrtc.compile_source(m.assembled.text, m.assembled.main_file, m.name,
                             nvrtc.Target(90, "cubin", "a"), m.options, m.name_expressions,
                             verbose=True)
    assert set(c.resources) == set(c.lowered.values())
    for name, r in c.resources.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, (name, r)
    for expr, spec in m.kernels.items():
        _, params = launch.cubin_params(c.image, c.lowered[expr])
        assert [o - params[0][0] for o, _ in params] == [o for o, _, _ in spec.layout], expr
    sass = _sass(c.image)
    if sass is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    for op in ("HGMMA.64x256x16.F32.BF16 ", "HGMMA.64x256x16.F32 ", ".tnspA", ".tnspB"):
        assert op in sass, op
    assert "UTMALDG.2D" in sass and "LDL" not in sass and "STL" not in sass


def _sass(cubin: bytes):
    """SASS text of every .text section of a cubin (nvdisasm -b SM90a on the raw sections), or
    None without nvdisasm."""
    import shutil
    import struct
    import subprocess
    import tempfile
    tool = shutil.which("nvdisasm")
    if tool is None:
        try:
            import nvidia.cu13  # noqa: PLC0415  (the nvidia-cuda-nvdisasm wheel)
            cand = Path(list(nvidia.cu13.__path__)[0]) / "bin" / "nvdisasm"
            tool = str(cand) if cand.exists() else None
        except ImportError:
            tool = None
    if tool is None:
        return None
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab = secs[shstrndx][4]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, _typ, _flags, _addr, off, size in secs:
            sname = cubin[strtab + name:cubin.index(b"\0", strtab + name)].decode()
            if not sname.startswith(".text."):
                continue
            path = Path(tmp) / "text.bin"
            path.write_bytes(cubin[off:off + size])
            out.append(subprocess.run([tool, "-b", "SM90a", str(path)], check=True,
                                      capture_output=True, text=True).stdout)
    return "\n".join(out)


# ----------------------------------------------------------------------------- CPU: autograd

@needs_torch
@pytest.mark.parametrize("act", ACTS)
def test_linear_autograd_gradcheck_on_the_references(act):
    import gpuops.torch as gt
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: gt.linear(x, w, b, act), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: gt.linear(x, w, None, act), (x, w))


@needs_torch
def test_linear_traces_in_torch_compile():
    import gpuops.torch as gt
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    f = torch.compile(lambda x, w, b: gt.linear(x, w, b, "silu"), fullgraph=True,
                      backend="aot_eager")
    f(x, w, b).sum().backward()
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    F.silu(F.linear(x2, w2, b2)).sum().backward()
    for got, exp in ((x.grad, x2.grad), (w.grad, w2.grad), (b.grad, b2.grad)):
        torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-12)


# ============================================================================ CPU: the SIMT kernels
# in the kernel emulator (tests/emu.py), driven by gemm.py's own host code (plans, flags, tile
# configurations), checked with the GPU tests' accuracy model (_check, on CPU tensors).

class _Emu:
    """gemm.py's launches routed to the CPU kernel emulator, on an H100-like device (`sms` SMs,
    227 KiB of shared memory per block, sm_90 unless `cc` says otherwise)."""

    def __init__(self, monkeypatch, sms=4, cc=90, smem=232448):
        self.dev = emu.Device(sms=sms)
        self.launched = []
        libs = self.libs = {}

        def get(module, expr, _device):
            if module.name not in libs:
                libs[module.name] = emu.build(module, cc * 10)
            lib, index = libs[module.name]
            self.launched.append(expr)
            return emu.EmuKernel(lib, index[expr], module.kernels[expr], expr)

        info = _Info(sms, smem)
        info.cc = cc
        monkeypatch.setattr(G._kernels, "get", get)
        monkeypatch.setattr(G.device, "device_info", lambda _dev: info)
        monkeypatch.setattr(G, "effective_arch", lambda _dev: cc)

    def arr(self, x, dtype):
        """A NumPy array of `dtype` holding x (float32 values, rounded once)."""
        return np.asarray(x, np.float32).astype(emu.np_dtype(dt.BY_NAME[dtype]))

    def run(self, op, dtype, *arrays, **kw):
        call = self.dev.call(op, dt.BY_NAME[dtype])
        tensors = [None if a is None else self.dev.tensor(a) for a in arrays]
        kw = {k: self.dev.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
        return G.gemm(call, op, *tensors, **kw).obj


def _cpu(x):
    """A float64 CPU tensor of a NumPy array of any float dtype (bfloat16 included)."""
    return torch.from_numpy(np.asarray(x, np.float32).astype(np.float64))


def _emu_rand(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _emu_layouts(rng, e, M, N, K, dtype):
    """a and b (NumPy, `dtype`) in every layout the GPU layout test uses."""
    def r(*shape):
        return e.arr(_emu_rand(rng, shape), dtype)
    yield "nn", r(M, K), r(K, N)
    yield "tn", r(K, M).T, r(K, N)
    yield "nt", r(M, K), r(N, K).T
    yield "tt", r(K, M).T, r(N, K).T
    yield "sliced", r(M, 2 * K)[:, ::2], r(3 * K, N)[::3]
    yield "unaligned", r(M * K + 1)[1:].reshape(M, K), r(K, N + 1)[:, 1:]


WT_CONFIGS = sorted(G.WARP_TILED_CONFIGS)
# (M, N, K): two tile rows and columns with ragged edges and a K tail, element loads (odd leading
# dims); aligned leading dims (vector loads, the whole-tile path) with edges and a tail at BK = 16;
# a single row and column
WT_SHAPES = [(133, 137, 37), (136, 136, 40), (1, 5, 3)]


@needs_emu
@needs_torch
@pytest.mark.parametrize("config", WT_CONFIGS)
def test_emulated_warp_tiled_configs(config, monkeypatch, rng):
    """Every warp_tiled tile configuration (PLAN['warp_tiled']), every operand layout, ragged
    tiles and K tails, fp32, in the emulator."""
    e = _Emu(monkeypatch)
    monkeypatch.setitem(G.PLAN, "warp_tiled", config)
    cfg = G.WARP_TILED_CONFIGS[config]
    # a cp.async ring (PIPE > 0) copies tiles wholly inside aligned operands in a loop of its own:
    # one interior tile, aligned leading dims and K tiles past the prologue's reach it
    shapes = WT_SHAPES + ([(cfg[0] + 1, cfg[1] + 4, 6 * cfg[2])] if cfg[6] else [])
    for M, N, K in shapes:
        for name, a, b in _emu_layouts(rng, e, M, N, K, "float32"):
            out = e.run("matmul", "float32", a, b, variant="warp_tiled")
            _check(_cpu(out), _cpu(a), _cpu(b), "float32", what=f"{config} {name} {(M, N, K)}",
                   tile=cfg[:2])
    assert e.launched and all(x == G._wt_expr(dt.float32, cfg, False) for x in e.launched)


@needs_emu
@needs_torch
@pytest.mark.parametrize("config", WT_CONFIGS)
def test_emulated_warp_tiled_dual_epilogue_batch(config, monkeypatch, rng):
    """Per configuration: the dual (SwiGLU) kernel, the fused epilogue (alpha, bias, gelu,
    residual), a batch with broadcast B (folded into M) and one with its own B per matrix."""
    e = _Emu(monkeypatch)
    monkeypatch.setitem(G.PLAN, "warp_tiled", config)
    cfg = G.WARP_TILED_CONFIGS[config]
    f = "float32"
    x, wg, wu = (e.arr(_emu_rand(rng, s), f) for s in ((70, 36), (75, 36), (75, 36)))
    out = e.run("swiglu_linear", f, x, wg.T, b2=wu.T, variant="warp_tiled")
    _check(_cpu(out), _cpu(x), _cpu(wg).T, f, b2=_cpu(wu).T, what=f"{config} swiglu")
    assert G._wt_expr(dt.float32, cfg, True) in e.launched
    a, b = e.arr(_emu_rand(rng, (67, 41)), f), e.arr(_emu_rand(rng, (41, 130)), f)
    bias, res = e.arr(_emu_rand(rng, (130,)), f), e.arr(_emu_rand(rng, (67, 130)), f)
    out = e.run("matmul", f, a, b, bias=bias, activation="gelu", residual=res, alpha=0.5,
                variant="warp_tiled")
    _check(_cpu(out), _cpu(a), _cpu(b), f, bias=_cpu(bias), act="gelu", residual=_cpu(res),
           alpha=0.5, what=f"{config} epilogue")
    a3 = e.arr(_emu_rand(rng, (3, 9, 20)), f)
    out = e.run("matmul", f, a3, b[:20], variant="warp_tiled")
    _check(_cpu(out), _cpu(a3), _cpu(b[:20]), f, what=f"{config} batch, shared b")
    b3 = e.arr(_emu_rand(rng, (3, 20, 33)), f)
    out = e.run("matmul", f, a3, b3, variant="warp_tiled")
    _check(_cpu(out), _cpu(a3), _cpu(b3), f, what=f"{config} batch")


@needs_emu
@needs_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", ["warp_tiled", "register_tiled_vec4"])
def test_emulated_simt_tiles_16bit(variant, dtype, monkeypatch, rng):
    """The SIMT loader's 16-bit paths (8-byte vector loads, conversions) in both kernels that use
    it; warp_tiled runs 'base' for 16-bit inputs whatever PLAN['warp_tiled'] says."""
    e = _Emu(monkeypatch, cc=61)
    monkeypatch.setitem(G.PLAN, "warp_tiled", "w64x64")
    for name, a, b in _emu_layouts(rng, e, 133, 136, 40, dtype):
        out = e.run("matmul", dtype, a, b, variant=variant)
        _check(_cpu(out), _cpu(a), _cpu(b), dtype, what=f"{variant} {dtype} {name}")
    if variant == "warp_tiled":
        base = G.WARP_TILED_CONFIGS["base"]
        assert set(e.launched) == {G._wt_expr(dt.BY_NAME[dtype], base, False)}


@needs_emu
@needs_torch
def test_emulated_register_tiled_vec4(monkeypatch, rng):
    e = _Emu(monkeypatch)
    for M, N, K in ((133, 137, 37), (136, 136, 40)):
        for name, a, b in _emu_layouts(rng, e, M, N, K, "float32"):
            out = e.run("matmul", "float32", a, b, variant="register_tiled_vec4")
            _check(_cpu(out), _cpu(a), _cpu(b), "float32", what=f"{name} {(M, N, K)}")


def _check_linear_in_graph(dtype, what, swiglu=False):
    """go.linear x [8, 4096] @ w [6144, 4096].T (swiglu: go.swiglu_linear with a second weight,
    x scaled by K^-1/4) under the current PLAN, warmed up on a side stream, captured in a CUDA
    graph and replayed after x is overwritten: the replay reads the new x."""
    scale = 4096 ** -0.25 if swiglu else 1.0
    x, w = _randn((8, 4096), dtype, scale=scale), _randn((6144, 4096), dtype)
    w2 = _randn((6144, 4096), dtype) if swiglu else None
    call = (lambda: go.swiglu_linear(x, w, w2)) if swiglu else (lambda: go.linear(x, w))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = call()
    x.copy_(_randn((8, 4096), dtype, scale=scale))
    graph.replay()
    torch.cuda.synchronize()
    _check(y, x, w.T, dtype, b2=None if w2 is None else w2.T, what=what)


PIPE_CASES = [(plan, dual, cfg) for plan, per in G.GEMV_PIPE.items() for dual, cfgs in per.items()
              for cfg in cfgs]


@needs_emu
@needs_torch
@pytest.mark.parametrize("case", PIPE_CASES, ids=lambda c: f"{c[0]}-{'dual' if c[1] else 'single'}"
                         f"-nt{c[2][0]}u{c[2][1]}")
def test_emulated_gemv_mma_pipe(case, monkeypatch, rng):
    """Every gemv_mma_pipe instantiation (PLAN['decode'] 'pipe' / 'pipe_deep', the configuration
    forced): persistent blocks walking 1 or 2 row tiles, a ragged last tile, K tails inside a
    16-byte pack and past some warps' chunks, tile ends in the middle of a ring group, M = 2, 13,
    16, the fused epilogue, a batch of weights, SwiGLU for the dual kernels."""
    plan, dual, cfg = case
    nt, u, minb = cfg
    e = _Emu(monkeypatch, sms=2)
    monkeypatch.setitem(G.PLAN, "decode", plan)
    monkeypatch.setitem(G.GEMV_PIPE[plan], dual, (cfg,))
    monkeypatch.setattr(G, "GEMV_PIPE_INFLIGHT", 0)
    f = "bfloat16"
    K = 256 * u + 20                      # u + 1 steps per tile: tiles end inside ring groups
    N = 8 * nt * (2 * minb * 2 - 1) + 3   # tiles: 2 per block but the last (ragged, 3 rows)
    if dual:
        x = e.arr(_emu_rand(rng, (13, K)), f)
        wg, wu = (e.arr(_emu_rand(rng, (N, K)), f) for _ in range(2))
        out = e.run("swiglu_linear", f, x, wg.T, b2=wu.T)
        _check(_cpu(out), _cpu(x), _cpu(wg).T, f, b2=_cpu(wu).T, what=f"{case} swiglu")
    else:
        for M in (2, 13, 16):
            x, w = e.arr(_emu_rand(rng, (M, K)), f), e.arr(_emu_rand(rng, (N, K)), f)
            bias, res = e.arr(_emu_rand(rng, (N,)), f), e.arr(_emu_rand(rng, (M, N)), f)
            out = e.run("matmul", f, x, w.T, bias=bias, activation="gelu", residual=res)
            _check(_cpu(out), _cpu(x), _cpu(w).T, f, bias=_cpu(bias), act="gelu",
                   residual=_cpu(res), what=f"{case} M={M}")
        x3, w3 = e.arr(_emu_rand(rng, (3, 5, K)), f), e.arr(_emu_rand(rng, (3, N, K)), f)
        out = e.run("matmul", f, x3, w3.transpose(0, 2, 1), variant="gemv_mma")
        _check(_cpu(out), _cpu(x3), _cpu(w3).transpose(1, 2), f, what=f"{case} batch")
        xs = e.arr(_emu_rand(rng, (4, 2 * K)), f)[:, ::2]         # strided x
        ws = e.arr(_emu_rand(rng, (N, K + 1)), f)[:, 1:]          # unaligned rows: gathers
        out = e.run("matmul", f, xs, ws.T)
        _check(_cpu(out), _cpu(xs), _cpu(ws).T, f, what=f"{case} gathers")
    assert set(e.launched) == {G._pipe_expr(dt.bfloat16, nt, u, minb, dual)}, e.launched


@needs_emu
def test_emulated_gemv_tma_routing(monkeypatch, rng):
    """PLAN['decode'] = 'tma': on sm_80 the 'balanced' plan runs (checked in the emulator); on
    sm_90 gemv_mma_tma is launched (not run: the emulator has no TMA) with one block of 8
    consumer warps and a producer per SM, at most one per tile of 8-row groups, the weight's
    tensor map ([N, K], boxes of 256 k x 8 rows, no swizzle) and its shared memory (every
    configuration within the 227 KiB of an H100 / H200 block); batched weights, SwiGLU pairs,
    unaligned weight rows and row strides TMA cannot take run the other kernels."""
    f, M, N, K = "bfloat16", 4, 70, 1000
    e = _Emu(monkeypatch, sms=2, cc=80)
    monkeypatch.setitem(G.PLAN, "decode", "tma")
    x, w = e.arr(_emu_rand(rng, (M, K)), f), e.arr(_emu_rand(rng, (N, K)), f)
    out = e.run("matmul", f, x, w.T)
    _check(_cpu(out), _cpu(x), _cpu(w).T, f, what="sm_80 fallback")
    assert e.launched and not any("tma" in k for k in e.launched), e.launched

    e = _Emu(monkeypatch, sms=132, cc=90)
    got, maps = [], []

    class Fake:
        def __init__(self, name, expr):
            self.name, self.expr = name, expr

        def launch(self, grid, block, stream, *args, smem=0):
            got.append((self.name, self.expr, grid, block, smem, args))

    monkeypatch.setattr(G._kernels, "get", lambda m, expr, d: Fake(m.name, expr))
    monkeypatch.setattr(G.tma, "encode_tiled", lambda *a: maps.append(a) or b"m" * 128)
    for key, cfg in G.GEMV_TMA_CONFIGS.items():
        monkeypatch.setitem(G.PLAN, "gemv_tma", key)
        for n_rows in (14336, 70, 1):
            got.clear()
            maps.clear()
            wn = e.arr(_emu_rand(rng, (n_rows, K)), f)
            e.run("matmul", f, x, wn.T)
            mod, expr, grid, block, smem, args = got[0]
            assert mod == "gemm.gemv_mma_tma_bf16" and expr == G._kname(
                "gemv_mma_tma", dt.bfloat16.ctype, *cfg), (mod, expr)
            assert grid == (max(1, min(132 * cfg[3], -(-n_rows // 8) // cfg[0])), 1, 1), grid
            assert smem * cfg[3] <= 233472 - 1024 * cfg[3]          # the blocks fit the SM
            assert block == (288, 1, 1) and smem == G._gemv_tma_smem(*cfg) <= 232448
            assert args[0] == b"m" * 128 and len(maps) == 1
            _, dtype_id, dims, strides, box, swizzle = maps[0]
            assert (dims, strides, box, swizzle) == ((K, n_rows), (2 * K,), (256, 8),
                                                     G.tma.SWIZZLE_NONE)
    monkeypatch.setitem(G.PLAN, "gemv_tma", "n4k512b2")
    # SwiGLU: the dual kernel, one tensor map per weight, 2 groups of each per tile
    got.clear()
    maps.clear()
    w2 = e.arr(_emu_rand(rng, (N, K)), f)
    e.run("swiglu_linear", f, x, w.T, b2=w2.T)
    dual = G._kname("gemv_mma_tma_dual", dt.bfloat16.ctype, *G.GEMV_TMA_CONFIGS["n4k512b2"])
    assert [g[1:3] for g in got] == [(dual, (4, 1, 1))], got
    assert len(maps) == 2 and maps[0][0] != maps[1][0] and got[0][5][:2] == (b"m" * 128,) * 2
    # 'balanced' takes it for pairs of >= GEMV_TMA_DUAL_MIN_BYTES together with whole tiles for
    # >= 90% of the 264 block slots (3792 rows: 237 tiles of 2 groups, 89.8%)
    monkeypatch.setitem(G.PLAN, "decode", "balanced")
    for n_rows, min_bytes, want in ((7616, 2 * 7616 * K * 2, True),
                                    (7616, 2 * 7616 * K * 2 + 1, False), (3792, 1, False)):
        monkeypatch.setattr(G, "GEMV_TMA_DUAL_MIN_BYTES", min_bytes)
        got.clear()
        wg, wu = (e.arr(_emu_rand(rng, (n_rows, K)), f) for _ in range(2))
        e.run("swiglu_linear", f, x, wg.T, b2=wu.T)
        assert any(g[1] == dual for g in got) == want, (n_rows, min_bytes, got)
    monkeypatch.setitem(G.PLAN, "decode", "tma")
    for what, run in (
            ("batched", lambda: e.run("matmul", f, e.arr(_emu_rand(rng, (2, M, K)), f),
                                      e.arr(_emu_rand(rng, (2, N, K)), f).transpose(0, 2, 1))),
            ("swiglu unaligned", lambda: e.run("swiglu_linear", f, x, w.T, b2=e.arr(
                _emu_rand(rng, (N, K + 1)), f)[:, 1:].T)),
            ("unaligned rows", lambda: e.run("matmul", f, x, e.arr(
                _emu_rand(rng, (N, K + 1)), f)[:, 1:].T)),
            ("row stride", lambda: e.run("matmul", f, e.arr(_emu_rand(rng, (M, 999)), f),
                                         e.arr(_emu_rand(rng, (N, 999)), f).T))):
        got.clear()
        run()
        assert got and not any("tma" in k[1] for k in got), (what, got)
    # 'balanced' takes 'tma' from GEMV_TMA_MIN_BYTES where every block has a whole tile
    # (ceil(N / 8) >= NT x blocks per SM x SMs: 4 x 2 x 132 = 1056 groups for n4k512b2)
    monkeypatch.setitem(G.PLAN, "decode", "balanced")
    # (K = 1000: 2 chunks, too few to split): 7584 rows = 237 tiles of 4 groups, 89.8% of the
    # 264 block slots; 7616 rows: 238 tiles, 90.2%
    for n_rows, min_bytes, want in ((8448, 8448 * K * 2, True), (8448, 8448 * K * 2 + 1, False),
                                    (7616, 1, True), (7584, 1, False)):
        monkeypatch.setattr(G, "GEMV_TMA_MIN_BYTES", min_bytes)
        got.clear()
        e.run("matmul", f, x, e.arr(_emu_rand(rng, (n_rows, K)), f).T)
        assert any("gemv_mma_tma" in k[1] for k in got) == want, (n_rows, min_bytes, got)
    # too few rows for whole tiles: K split over clusters of 2 blocks where K has >= 2 chunks
    # per rank (of 4 where GEMV_TMA_SPLITS has it); the grid is clusters x KS (the emulator's
    # kernels cannot say how many clusters are resident: no cut)
    monkeypatch.setattr(G, "GEMV_TMA_MIN_BYTES", 1)
    for n_rows, k, want in ((4096, 2048, (2, 128)), (2048, 8192, None), (2048, 2048, None),
                            (4096, 1536, None)):
        got.clear()
        xk = e.arr(_emu_rand(rng, (M, k)), f)
        out = e.run("matmul", f, xk, e.arr(_emu_rand(rng, (n_rows, k)), f).T)
        tma_runs = [g for g in got if "gemv_mma_tma" in g[1]]
        if want is None:   # (2048 rows: KS 2 fills 48%; 4096 x 1536: 3 chunks)
            assert not tma_runs, (n_rows, k, got)
            continue
        ks, clusters = want
        assert len(tma_runs) == 1 and tma_runs[0][1] == G._kname(
            "gemv_mma_tma_split", dt.bfloat16.ctype, *G.GEMV_TMA_CONFIGS["n4k512b2"], ks), got
        assert tma_runs[0][2] == (clusters * ks, 1, 1), tma_runs[0][2]
        assert tma_runs[0][4] == G._gemv_tma_smem(*G.GEMV_TMA_CONFIGS["n4k512b2"], ks)
        assert tma_runs[0][4] * 2 <= 233472 - 2048             # two blocks still fit the SM
    monkeypatch.setattr(G, "GEMV_TMA_SPLITS", (2, 4))
    got.clear()
    e.run("matmul", f, e.arr(_emu_rand(rng, (M, 8192)), f),
          e.arr(_emu_rand(rng, (2048, 8192)), f).T)
    assert [g[1:3] for g in got] == [(G._kname("gemv_mma_tma_split", dt.bfloat16.ctype,
                                               *G.GEMV_TMA_CONFIGS["n4k512b2"], 4), (256, 1, 1))]


@needs_emu
@needs_torch
def test_emulated_balanced_takes_pipe_for_large_weights(monkeypatch, rng):
    """PLAN['decode'] 'balanced' runs the 'pipe' plan where the weight has at least
    GEMV_PIPE_MIN_BYTES (SwiGLU: its two weights together) and that plan picks tiles of
    GEMV_PIPE_BALANCED_NT[dual] (runs 188-194, 211), not below the size and not at narrower
    tiles."""
    e = _Emu(monkeypatch, sms=2)
    monkeypatch.setitem(G.PLAN, "decode", "balanced")
    monkeypatch.setattr(G, "GEMV_PIPE_INFLIGHT", 0)
    f, M, N, K = "bfloat16", 4, 70, 1000
    for dual in (False, True):
        assert G._gemv_pipe_plan(2, N, K, 1, dual, "pipe")[0] == G.GEMV_PIPE_BALANCED_NT[dual]
    x, w, w2 = (e.arr(_emu_rand(rng, shape), f) for shape in ((M, K), (N, K), (N, K)))

    def run(what, dual, pipe):
        e.launched.clear()
        if dual:
            out = e.run("swiglu_linear", f, x, w.T, b2=w2.T)
            _check(_cpu(out), _cpu(x), _cpu(w).T, f, b2=_cpu(w2).T, what=what)
        else:
            out = e.run("matmul", f, x, w.T)
            _check(_cpu(out), _cpu(x), _cpu(w).T, f, what=what)
        is_pipe = [k.startswith("gpuops::gemm::gemv_mma_pipe<") for k in e.launched]
        assert e.launched and (all(is_pipe) if pipe else not any(is_pipe)), (what, e.launched)

    monkeypatch.setattr(G, "GEMV_PIPE_MIN_BYTES", N * K * 2)
    run("at the size", False, True)
    run("swiglu at twice the size", True, True)
    monkeypatch.setattr(G, "GEMV_PIPE_MIN_BYTES", N * K * 2 + 1)
    run("below the size", False, False)
    run("swiglu above twice the size", True, True)
    monkeypatch.setattr(G, "GEMV_PIPE_MIN_BYTES", 2 * N * K * 2 + 1)
    run("swiglu below the size", True, False)
    monkeypatch.setattr(G, "GEMV_PIPE_MIN_BYTES", N * K * 2)
    # a tile width the plan never picks
    monkeypatch.setattr(G, "GEMV_PIPE_BALANCED_NT", {False: 8, True: 8})
    run("narrower tiles", False, False)
    run("swiglu narrower tiles", True, False)


@needs_emu
@needs_torch
@pytest.mark.parametrize("plan,ahead,rows", [("balanced", 0, "auto"), ("balanced", 2, 8),
                                             ("legacy", "auto", "auto")])
def test_emulated_gemv_and_gemv_mma(plan, ahead, rows, monkeypatch, rng):
    """The decode kernels of the 'balanced' and 'legacy' plans in the emulator: gemv_mma (both
    block sizes and 8-row blocks, split-K with gemv_splitk_reduce, dual; weight loads one step or
    AHEAD steps at a time, with steps left over and partial row blocks), the SIMT gemv (K- and
    N-contiguous B,
    MT = 1, 4, 16, fp32 and bf16), odd shapes and K tails."""
    e = _Emu(monkeypatch, sms=2)
    monkeypatch.setitem(G.PLAN, "decode", plan)
    monkeypatch.setitem(G.PLAN, "gemv_ahead", ahead)
    monkeypatch.setitem(G.PLAN, "gemv_rows", rows)
    for f, M, N, K in (("bfloat16", 2, 77, 300), ("bfloat16", 16, 40, 4100),
                       ("float16", 9, 150, 2056), ("float32", 1, 70, 333),
                       ("float32", 4, 33, 1030), ("float32", 16, 20, 2100),
                       ("bfloat16", 1, 90, 1000), ("bfloat16", 5, 48, 3328)):
        x, w = e.arr(_emu_rand(rng, (M, K)), f), e.arr(_emu_rand(rng, (N, K)), f)
        out = e.run("matmul", f, x, w.T)
        _check(_cpu(out), _cpu(x), _cpu(w).T, f, what=f"{plan} {f} {(M, N, K)} linear")
        b = e.arr(_emu_rand(rng, (K, N)), f)
        out = e.run("matmul", f, x, b, variant="gemv")
        _check(_cpu(out), _cpu(x), _cpu(b), f, what=f"{plan} {f} {(M, N, K)} b[K, N]")
        if f != "float32":
            w2 = e.arr(_emu_rand(rng, (N, K)), f)
            out = e.run("swiglu_linear", f, x, w.T, b2=w2.T)
            _check(_cpu(out), _cpu(x), _cpu(w).T, f, b2=_cpu(w2).T, what=f"{plan} {f} swiglu")
    names = " ".join(e.launched)
    for kernel in ("gemv_mma<", "gemv_splitk_reduce", "gemv_kcontig", "gemv_ncontig"):
        assert kernel in names, kernel


@needs_emu
@needs_torch
def test_emulated_gemv_weight_prefetch_ranges(monkeypatch, rng):
    """PLAN['gemv_l2_prefetch']: what the K-contiguous GEMV kernels ask into L2 before the PDL wait
    (the emulator records every l2_prefetch_bulk) is 16-byte aligned, 16-byte multiple pieces of
    the weights' rows, none past its row, none twice, together every row but < 16 bytes per split
    (SIMT gemv at M = 1 and 4, gemv_mma, its dual form, split-K, rows longer than K whose ends
    are not 16-byte multiples); nothing where the rows are not 16-byte aligned, and nothing with
    the plan off."""
    e = _Emu(monkeypatch, sms=2)
    cases = (("float32", 1, 70, 1032, 0, False, True), ("float32", 4, 33, 2056, 0, False, True),
             ("bfloat16", 2, 90, 2056, 0, False, True), ("float16", 16, 40, 4096, 0, False, True),
             ("bfloat16", 3, 30, 3000, 0, True, True), ("bfloat16", 2, 40, 2050, 14, False, True),
             ("float32", 1, 20, 1027, 5, False, True), ("bfloat16", 2, 50, 4100, 0, False, False))
    for f, M, N, K, pad, dual, aligned in cases:
        x = e.arr(_emu_rand(rng, (M, K)), f)
        ws = [e.arr(_emu_rand(rng, (N, K + pad)), f)[:, :K] for _ in range(2 if dual else 1)]
        for on in (False, True):
            monkeypatch.setitem(G.PLAN, "gemv_l2_prefetch", on)
            for lib, _ in e.libs.values():
                lib.emu_prefetch_clear()
            if dual:
                out = e.run("swiglu_linear", f, x, ws[0].T, b2=ws[1].T)
                _check(_cpu(out), _cpu(x), _cpu(ws[0]).T, f, b2=_cpu(ws[1]).T, what=f"{f} dual")
            else:
                out = e.run("matmul", f, x, ws[0].T)
                _check(_cpu(out), _cpu(x), _cpu(ws[0]).T, f, what=f"{f} {(M, N, K)}")
            ranges = []
            for lib, _ in e.libs.values():
                if hasattr(lib, "emu_prefetch_count"):
                    a, n = ctypes.c_ulonglong(), ctypes.c_ulonglong()
                    for i in range(lib.emu_prefetch_count()):
                        lib.emu_prefetch_range(ctypes.c_longlong(i), ctypes.byref(a),
                                               ctypes.byref(n))
                        ranges.append((a.value, n.value))
            what = f"{f} {(M, N, K)} dual={dual} prefetch={on}"
            if not (on and aligned):
                assert ranges == [], what
                continue
            row_bytes, stride = K * ws[0].itemsize, ws[0].strides[0]
            per_row = {}
            for addr, n in ranges:
                assert addr % 16 == 0 and n % 16 == 0 and n > 0, what
                w = next((w for w in ws if w.ctypes.data <= addr < w.ctypes.data + N * stride),
                         None)
                assert w is not None, f"{what}: {addr:#x} is in no weight"
                row, start = divmod(addr - w.ctypes.data, stride)
                assert start + n <= row_bytes, f"{what}: past the end of row {row}"
                per_row.setdefault((id(w), row), []).append((start, start + n))
            assert len(per_row) == N * len(ws), what
            for key, pieces in per_row.items():
                pieces.sort()
                assert all(a[1] <= b[0] for a, b in zip(pieces, pieces[1:])), f"{what}: overlap"
                covered = sum(b - a for a, b in pieces)
                assert row_bytes - covered < 16 * len(pieces), f"{what}: row {key[1]} short"


def test_gemv_pipe_plans():
    """gemv_mma_pipe's configuration choice: enough loads in flight, the largest tiles first (run
    194), then tiles spread evenly over persistent blocks, U <= steps; None (the 'balanced' plan)
    otherwise."""
    pp = G._gemv_pipe_plan
    assert pp(132, 6144, 2048, 1, False, "pipe") == (4, 2, 2, 192)       # 192 tiles of 32 rows
    assert pp(132, 2048, 6144, 1, False, "pipe") == (1, 8, 2, 256)       # 256 tiles of 8 rows
    assert pp(132, 14336, 4096, 1, False, "pipe") == (4, 2, 2, 264)      # not NT 1's fuller tail
    assert pp(132, 4096, 14336, 1, False, "pipe") == (2, 4, 2, 256)      # NT 4: too few tiles
    assert pp(132, 151936, 2048, 1, False, "pipe") == (4, 2, 2, 264)     # 4748 tiles, 18 each
    assert pp(132, 256, 4096, 1, False, "pipe") is None                  # 32 tiles: split-K
    assert pp(132, 6144, 512, 1, False, "pipe_deep") is None             # 2 steps < U = 8, 16
    assert pp(132, 11008, 4096, 1, True, "pipe") == (2, 2, 2, 264)
    for plan, per in G.GEMV_PIPE.items():
        for dual, cfgs in per.items():
            for N, K in ((6144, 2048), (2048, 6144), (151936, 2048), (14336, 4096), (4096, 14336)):
                got = pp(132, N, K, 1, dual, plan)
                if got is not None:
                    nt, u, minb, gx = got
                    assert (nt, u, minb) in cfgs and u <= G._cdiv(K, 256)
                    assert gx <= minb * 132 and gx <= G._cdiv(N, 8 * nt)
    assert set(G.DECODE_PLANS) == {"balanced", "legacy", "pipe", "pipe_deep", "tma"}


def test_warp_tiled_configurations(monkeypatch):
    """The table's shapes are consistent (threads, warps, tiles split evenly over the loaders,
    shared memory), PLAN['warp_tiled'] picks the module and kernel, unknown names raise, and a
    configuration the device lacks the shared memory for falls back to 'base'."""
    assert G.WARP_TILED_CONFIGS["base"] == (128, 128, 8, 64, 32, 2, 0)
    assert G.WARP_TILED_MODULES["base"] is G.WARP_TILED and set(G.WARP_TILED) == set(dt.FLOATS)
    for name, cfg in G.WARP_TILED_CONFIGS.items():
        bm, bn, bk, wm, wn, minb, pipe = cfg
        assert pipe == 0 or (pipe >= 3 and set(G.WARP_TILED_MODULES[name]) == {dt.float32}), name
        threads = G._wt_threads(cfg)
        assert bm % wm == 0 and bn % wn == 0 and wm % 32 == 0 and wn % 32 == 0, name
        assert threads % 64 == 0 and threads * minb <= 2048, name
        for rows, nt in ((bm, threads), (bn, threads), (bn // 2, threads // 2)):
            assert rows * bk // 4 % nt == 0 and nt % (bk // 4) == 0 and nt % (rows // 4) == 0, name
        stages = max(2, pipe)
        assert G._wt_smem(cfg) == 4 * stages * bk * (bm + bn + 8)
        assert G._wt_smem(cfg, True) == 4 * stages * bk * (bm + bn + 12)
        assert G._wt_smem(cfg, True) <= 48 * 1024, f"{name}: sm_61 has 48 KiB per block"
        if name != "base":
            assert set(G.WARP_TILED_MODULES[name]) == {dt.float32}
            assert G.WARP_TILED_MODULES[name][dt.float32].archs == ("61", "90")
        exprs = set(G.WARP_TILED_MODULES[name][dt.float32].kernels)
        assert exprs == {G._wt_expr(dt.float32, cfg, d) for d in (False, True)}
        assert f"gemm_warp_tiled<float, false, {bm}, {bn}, {bk}, {wm}, {wn}, {minb}, {pipe}>" \
            in G._wt_expr(dt.float32, cfg, False)
    monkeypatch.setattr(G.device, "device_info", lambda _dev: _Info(132, 232448))
    monkeypatch.setitem(G.PLAN, "warp_tiled", "k16")
    assert G._warp_tiled_config(0, dt.float32, False) == "k16"
    assert G._warp_tiled_config(0, dt.bfloat16, False) == "base"       # fp32 candidates only
    monkeypatch.setattr(G.device, "device_info", lambda _dev: _Info(132, 16 * 1024))
    assert G._warp_tiled_config(0, dt.float32, False) == "base"        # 33 KiB do not fit
    # 'auto' (the default): the cp.async ring from sm_80 on, k16 before (GPUOPS_ARCH=61 too)
    monkeypatch.setattr(G.device, "device_info", lambda _dev: _Info(132, 232448))
    monkeypatch.setitem(G.PLAN, "warp_tiled", "auto")
    for cc, want in ((90, "async"), (80, "async"), (75, "k16"), (61, "k16")):
        monkeypatch.setattr(G, "effective_arch", lambda _dev, cc=cc: cc)
        assert G._warp_tiled_config(0, dt.float32, False) == want, cc
        assert G._warp_tiled_config(0, dt.float16, False) == "base"
    monkeypatch.setitem(G.PLAN, "warp_tiled", "nope")
    with pytest.raises(ValueError, match="PLAN\\['warp_tiled'\\]"):
        G._warp_tiled_config(0, dt.float32, False)


# ============================================================================ GPU

def _arch():
    return G.effective_arch(0)


def _randn(shape, dtype, scale=1.0):
    return (torch.randn(shape, device="cuda") * scale).to(getattr(torch, dtype))


def _check(out, a, b, dtype, *, bias=None, act=None, residual=None, alpha=1.0, tf32=False,
           out_dtype=None, b2=None, gate_rounded=False, what="", tile=None):
    """out against float64 products on the GPU, with the bound of the module docstring.
    gate_rounded (SwiGLU on Hopper: the gate product is stored in the output dtype, then silu'd):
    + 1.1 U_OUT |g| |u| (|silu'| <= 1.1, the gate's relative rounding U_OUT), with the products'
    own errors added to g and u.
    tile=(BM, BN): on failure also name the first output tile (of the last matrix dims) with a
    bad element and how many tiles are bad, to tell a pipeline error from an edge error."""
    A, B = a.double(), b.double()
    K = A.shape[-1]
    out_name = out_dtype or dtype
    if b2 is None:
        ab = torch.matmul(A, B)
        absab = torch.matmul(A.abs(), B.abs())
        pre = alpha * ab + (bias.double() if bias is not None else 0.0)
        post = _torch_act(act, pre)
        ref = post + (residual.double() if residual is not None else 0.0)
        u_in = 2.0 ** -11 if tf32 else 0.0
        acc = 1.2 * abs(alpha) * (2 * math.sqrt(K) * U_ACC + 2.1 * u_in) * absab
        bound = (acc + 2 * U_ACC * (abs(alpha) * ab.abs() + (bias.double().abs() if bias is not None
                                                              else 0.0))
                 + (1e-5 * post.abs() if act else 0.0) + 2 * U_ACC * ref.abs()
                 + 2 * U_OUT[out_name] * ref.abs() + TINY[out_name])
    else:   # silu(A @ B) * (A @ B2)
        B2 = b2.double()
        g, u = torch.matmul(A, B), torch.matmul(A, B2)
        eg = 2 * math.sqrt(K) * U_ACC * torch.matmul(A.abs(), B.abs())
        eu = 2 * math.sqrt(K) * U_ACC * torch.matmul(A.abs(), B2.abs())
        sg = F.silu(g)
        ref = sg * u
        bound = (1.2 * eg * u.abs() + sg.abs() * eu + 1.2 * eg * eu + 1e-5 * ref.abs()
                 + 2 * U_ACC * ref.abs() + 2 * U_OUT[out_name] * ref.abs() + TINY[out_name])
        if gate_rounded:
            bound = bound + 1.1 * U_OUT[out_name] * (g.abs() + eg) * (u.abs() + eu)
    got = out.double()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{what}: NaN in the output (unwritten elements?)"
    err = (got - ref).abs()
    bad = err > bound
    if bad.any():
        i = int(torch.argmax((err - bound).flatten()))
        where = ""
        if tile is not None and bad.dim() >= 2:
            rows, cols = bad.shape[-2:]
            tm, tn = -(-rows // tile[0]), -(-cols // tile[1])
            pad = torch.zeros((*bad.shape[:-2], tm * tile[0], tn * tile[1]), dtype=torch.bool,
                              device=bad.device)
            pad[..., :rows, :cols] = bad
            per_tile = pad.reshape(-1, tm, tile[0], tn, tile[1]).any(dim=(0, 2, 4))
            first = torch.nonzero(bad.reshape(-1, rows, cols).any(dim=0))[0].tolist()
            where = (f"; {int(per_tile.sum())} of {tm * tn} {tile[0]}x{tile[1]} tiles bad, the "
                     f"first bad element at (row, col) {tuple(first)} in tile "
                     f"{(first[0] // tile[0], first[1] // tile[1])}")
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements off; worst out="
            f"{got.flatten()[i].item()!r} ref={ref.flatten()[i].item()!r} err="
            f"{err.flatten()[i].item():.3g} > bound {bound.flatten()[i].item():.3g}{where}")
    norm = ref.norm().item()
    if norm > 0:
        tol = NORM_TOL["tf32" if tf32 else out_name] * max(1.0, math.sqrt(K / 4096))
        # less the output dtype's absolute floor (TINY per element: half of fp16's subnormal
        # spacing): a lone output near 1e-6 in fp16 is off by up to 4% from rounding alone (run
        # 97: swiglu gemv fp16 1x1x1, every element inside its bound above)
        floor = TINY[out_name] * math.sqrt(ref.numel())
        rel = max(0.0, (got - ref).norm().item() - floor) / norm
        assert rel <= tol, f"{what}: error {rel:.3g} relative to the output's norm > {tol:.3g}"


TILED = ["naive", "smem_tiled", "register_tiled_vec4", "warp_tiled", "mma", None]
SHAPES = [(1, 1, 1), (17, 33, 65), (130, 259, 77), (64, 80, 65536)]
GEMV_SHAPES = [(1, 1, 1), (1, 4097, 1000), (5, 33, 65), (16, 1000, 4097), (3, 64, 65536)]


def _skip_unsupported(variant, dtype):
    if variant in ("mma", "gemv_mma") and _arch() < 80:
        pytest.skip(f"{variant} needs sm_80+ (kernels built for sm_{_arch()})")
    if variant == "gemv_mma" and dtype == "float32":
        pytest.skip("gemv_mma takes fp16/bf16")


def _kw(variant, dtype):
    return {"variant": variant, "allow_tf32": variant == "mma" and dtype == "float32"}


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", TILED)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_matmul_variants(shape, variant, dtype):
    _skip_unsupported(variant, dtype)
    M, N, K = shape
    if variant == "naive" and K > 10000:
        M, N = 16, 16
    a, b = _randn((M, K), dtype), _randn((K, N), dtype)
    kw = _kw(variant, dtype)
    out = go.matmul(a, b, **kw)
    assert out.dtype == a.dtype
    _check(out, a, b, dtype, tf32=kw["allow_tf32"], what=f"{variant} {dtype} {shape}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["gemv", "gemv_mma"])
@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_decode_variants(shape, variant, dtype):
    _skip_unsupported(variant, dtype)
    M, N, K = shape
    x, w = _randn((M, K), dtype), _randn((N, K), dtype)
    out = go.linear(x, w, variant=variant)                   # B = w.T: K contiguous
    _check(out, x, w.T, dtype, what=f"{variant} {dtype} {shape} linear")
    if variant == "gemv":                                    # B row-major: N contiguous
        b = _randn((K, N), dtype)
        _check(go.matmul(x, b, variant=variant), x, b, dtype, what=f"gemv {dtype} {shape} b[K,N]")


def _layouts(M, N, K, dtype):
    """a and b in every layout: row-major, transposed views, sliced (no unit stride), unaligned."""
    yield "nn", _randn((M, K), dtype), _randn((K, N), dtype)
    yield "tn", _randn((K, M), dtype).T, _randn((K, N), dtype)
    yield "nt", _randn((M, K), dtype), _randn((N, K), dtype).T
    yield "tt", _randn((K, M), dtype).T, _randn((N, K), dtype).T
    yield "sliced", _randn((M, 2 * K), dtype)[:, ::2], _randn((3 * K, N), dtype)[::3]
    yield "unaligned", _randn((M * K + 1,), dtype)[1:].view(M, K), \
        _randn((K, N + 1), dtype)[:, 1:]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", TILED + ["gemv", "gemv_mma"])
def test_gpu_layouts(variant, dtype):
    _skip_unsupported(variant, dtype)
    M = 7 if variant in ("gemv", "gemv_mma") else 131
    for name, a, b in _layouts(M, 97, 136, dtype):
        kw = _kw(variant, dtype)
        _check(go.matmul(a, b, **kw), a, b, dtype, tf32=kw["allow_tf32"],
               what=f"{variant} {dtype} {name}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", [None, "warp_tiled", "mma"])
def test_gpu_large_odd_shape(variant, dtype):
    _skip_unsupported(variant, dtype)
    a, b = _randn((4097, 1000), dtype), _randn((1000, 4095), dtype)
    kw = _kw(variant, dtype)
    _check(go.matmul(a, b, **kw), a, b, dtype, tf32=kw["allow_tf32"], what=f"{variant} {dtype}")
    if variant == "mma":       # the 128x256 tile configuration (many tiles)
        a, b = _randn((2048, 512), dtype), _randn((512, 4096), dtype)
        _check(go.matmul(a, b, **kw), a, b, dtype, tf32=kw["allow_tf32"], what="mma large tiles")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", [None, "naive", "warp_tiled", "mma", "gemv"])
def test_gpu_batched_and_vectors(variant, dtype):
    _skip_unsupported(variant, dtype)
    kw = _kw(variant, dtype)
    m = 5 if variant == "gemv" else 37
    cases = {
        "fold": (_randn((3, 2, m, 45), dtype), _randn((45, 29), dtype)),
        "broadcast": (_randn((3, 1, m, 45), dtype), _randn((2, 45, 29), dtype)),
        "bmm_t": (_randn((4, 45, m), dtype).transpose(1, 2), _randn((4, 29, 45), dtype).transpose(1, 2)),
        "vec_a": (_randn((45,), dtype), _randn((3, 45, 29), dtype)),
        "vec_b": (_randn((2, m, 45), dtype), _randn((45,), dtype)),
        "expanded": (_randn((1, m, 45), dtype).expand(3, m, 45), _randn((3, 45, 29), dtype)),
    }
    for what, (a, b) in cases.items():
        out = go.matmul(a, b, **kw)
        _check(out, a, b, dtype, tf32=kw["allow_tf32"], what=f"{variant} {dtype} {what}")


@gpu
@needs_torch_cuda
def test_gpu_more_than_65535_matrices():
    a, b = _randn((70001, 3, 5), "float32"), _randn((70001, 5, 2), "float32")
    _check(go.matmul(a, b, variant="warp_tiled"), a, b, "float32", what="grid.z chunks")
    _check(go.matmul(a, b), a, b, "float32", what="gemv grid.z chunks")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("variant", TILED + ["gemv", "gemv_mma"])
def test_gpu_fused_epilogue(variant, act, dtype):
    _skip_unsupported(variant, dtype)
    kw = _kw(variant, dtype)
    M = 9 if variant in ("gemv", "gemv_mma") else 70
    a, b = _randn((M, 300), dtype), _randn((300, 67), dtype)
    bias, res = _randn((67,), dtype), _randn((M, 67), dtype)
    out = go.matmul(a, b, bias=bias, activation=act, residual=res, alpha=0.5, **kw)
    _check(out, a, b, dtype, bias=bias, act=act, residual=res, alpha=0.5, tf32=kw["allow_tf32"],
           what=f"{variant} {dtype} {act}")
    row = _randn((67,), dtype)                    # residual broadcast over rows
    out = go.matmul(a, b, activation=act, residual=row, **kw)
    _check(out, a, b, dtype, act=act, residual=row, tf32=kw["allow_tf32"], what="row residual")
    if dtype != "float32":                        # 16-bit inputs, fp32 output
        bias32, res32 = bias.float(), res.float()
        out = go.matmul(a, b, bias=bias32, activation=act, residual=res32, out_dtype=torch.float32,
                        **kw)
        assert out.dtype == torch.float32
        _check(out, a, b, dtype, bias=bias32, act=act, residual=res32, out_dtype="float32",
               tf32=kw["allow_tf32"], what="out_dtype=float32")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_linear(dtype):
    for M, N, K in ((1, 1, 1), (1, 4096, 4096), (16, 333, 1000), (300, 257, 129)):
        x, w, bias = _randn((M, K), dtype), _randn((N, K), dtype), _randn((N,), dtype)
        for act in ACTS:
            _check(go.linear(x, w, bias, act), x, w.T, dtype, bias=bias, act=act,
                   what=f"linear {dtype} {M}x{N}x{K} {act}")
    x = _randn((2, 3, 64), dtype)
    w_t = _randn((64, 48), dtype).T                   # weight stored transposed: [N, K] view
    out = go.linear(x, w_t)
    assert out.shape == (2, 3, 48)
    _check(out, x, w_t.T, dtype, what="3-D input, transposed weight")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", [None, "warp_tiled", "mma", "gemv", "gemv_mma"])
def test_gpu_swiglu_linear(variant, dtype):
    _skip_unsupported(variant, dtype)
    if variant == "mma" and dtype == "float32":
        pytest.skip("the dual tensor-core kernel is fp16/bf16")
    shapes = ((1, 1, 1), (1, 2048, 1024), (7, 300, 700), (16, 64, 8192)) if variant in (
        "gemv", "gemv_mma") else ((1, 1, 1), (17, 33, 65), (300, 200, 1024), (1000, 1000, 512))
    for M, N, K in shapes:
        # x scaled by K^-1/4: silu(x wg) * (x wu) grows like K and at K = 8192 could pass fp16's
        # 65504 (an inf the float64 reference does not have; seen once in run 31)
        x = _randn((M, K), dtype, scale=K ** -0.25)
        wg, wu = _randn((N, K), dtype), _randn((N, K), dtype)
        out = go.swiglu_linear(x, wg, wu, variant=variant)
        _check(out, x, wg.T, dtype, b2=wu.T, what=f"swiglu {variant} {dtype} {M}x{N}x{K}")


def _q(shape):
    return torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("variant", ["dp4a", "mma", None])
def test_gpu_int8_matmul(variant, out_dtype):
    _skip_unsupported(variant, "int8")
    # (2048, 4096, 256): enough tiles for the 128x256 tensor-core configuration
    for M, N, K in ((1, 1, 1), (17, 33, 65), (256, 512, 1024), (130, 70, 4096), (2048, 4096, 256)):
        a, w = _q((M, K)), _q((N, K))
        # quantization scales are amax / 127: values of magnitude ~1 give scales ~1/128. (Scales
        # of ~1 made |(A @ B) * sa * sb| reach 1e6, beyond float16's 65504: the fp32 epilogue was
        # right and the fp16 output rightly inf.) With these, |out| <= 1.1^2 * K * 128^2 / 128^2
        # = 1.21 K < 5000 for every K here: within float16 for any int8 data.
        sa = (torch.rand(M, device="cuda") + 0.1) / 128
        sb = (torch.rand(N, device="cuda") + 0.1) / 128
        for what, b in (("W.t()", w.T), ("row-major b", w.T.contiguous())):
            out = go.int8_matmul(a, b, sa, sb, out_dtype, variant=variant)
            assert out.dtype == getattr(torch, out_dtype)
            ref = (a.double() @ b.double()) * sa.double()[:, None] * sb.double()[None, :]
            bound = 6 * U_ACC * ref.abs() + 2 * U_OUT[out_dtype] * ref.abs() + TINY[out_dtype]
            err = (out.double() - ref).abs()
            assert (err <= bound).all(), \
                f"int8 {variant} {M}x{N}x{K} {what} {out_dtype}: {err.max().item()}"


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("case", PIPE_CASES, ids=lambda c: f"{c[0]}-{'dual' if c[1] else 'single'}"
                         f"-nt{c[2][0]}u{c[2][1]}")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_gemv_mma_pipe(case, dtype, monkeypatch):
    """Every gemv_mma_pipe instantiation forced (its configuration the only one, no in-flight
    minimum) at decode shapes: M = 1..16, ragged tiles and K tails, persistent blocks with many
    tiles, the epilogue, SwiGLU for the dual kernels, a CUDA graph replayed with new data."""
    _skip_unsupported("gemv_mma", dtype)
    plan, dual, cfg = case
    nt, u, minb = cfg
    monkeypatch.setitem(G.PLAN, "decode", plan)
    monkeypatch.setitem(G.GEMV_PIPE[plan], dual, (cfg,))
    monkeypatch.setattr(G, "GEMV_PIPE_INFLIGHT", 0)
    launched = []
    get = G._kernels.get
    monkeypatch.setattr(G._kernels, "get", lambda m, e, d: launched.append(e) or get(m, e, d))
    K0 = 256 * u
    for M, N, K in ((1, 6144, 2048 + K0), (2, 2048, 6144), (13, 40000, K0 + 8), (16, 777, K0 + 3),
                    (16, 151936 // 4, K0 + 264)):
        # SwiGLU: x scaled by K^-1/4 (as test_gpu_swiglu_linear): unscaled, silu(x wg) * (x wu)
        # grows like K and can pass fp16's 65504 (run 184: -68065 in the float64 reference,
        # rounded to -inf by the kernel, as any fp16 store would)
        x = _randn((M, K), dtype, scale=K ** -0.25 if dual else 1.0)
        w = _randn((N, K), dtype)
        if dual:
            w2 = _randn((N, K), dtype)
            _check(go.swiglu_linear(x, w, w2, variant="gemv_mma"), x, w.T, dtype, b2=w2.T,
                   what=f"{case} swiglu {(M, N, K)}")
        else:   # (M = 1 takes the SIMT gemv unless asked for gemv_mma)
            bias, res = _randn((N,), dtype), _randn((M, N), dtype)
            out = go.matmul(x, w.T, bias=bias, activation="gelu", residual=res,
                            variant="gemv_mma")
            _check(out, x, w.T, dtype, bias=bias, act="gelu", residual=res,
                   what=f"{case} {(M, N, K)}")
    assert set(launched) == {G._pipe_expr(dt.BY_NAME[dtype], nt, u, minb, dual)}, launched
    _check_linear_in_graph(dtype, f"{case} graph")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("cfg", list(G.GEMV_TMA_CONFIGS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_gemv_mma_tma(cfg, dtype, monkeypatch):
    """gemv_mma_tma (PLAN['decode'] 'tma', sm_90) in each configuration, outputs poisoned: M =
    1..16, one row to 40000 rows (ragged tiles, blocks of unequal row ranges), K tails inside a
    chunk, inside a 32-k sub-step and inside a 16-byte pack (TMA's zero fill, A gathered), K = 8,
    the fused epilogue, a CUDA graph replayed with new data; batched weights, unaligned rows and
    row strides TMA cannot take run the other kernels, correctly."""
    if _arch() < 90:
        pytest.skip(f"gemv_mma_tma needs sm_90 (kernels built for sm_{_arch()})")
    monkeypatch.setenv("GPUOPS_DEBUG_POISON", "1")
    monkeypatch.setitem(G.PLAN, "decode", "tma")
    monkeypatch.setitem(G.PLAN, "gemv_tma", cfg)
    monkeypatch.setitem(G.PLAN, "gemv_tma_split", 1)   # (the split kernel: the test below)
    launched = []
    get = G._kernels.get
    monkeypatch.setattr(G._kernels, "get", lambda m, e, d: launched.append(e) or get(m, e, d))
    expr = G._kname("gemv_mma_tma", dt.BY_NAME[dtype].ctype, *G.GEMV_TMA_CONFIGS[cfg])
    for M, N, K, ldw in ((1, 6144, 2048, 2048), (2, 2048, 6144, 6144), (13, 40000, 520, 520),
                         (16, 777, 1032, 1032), (16, 37984, 2312, 2312), (5, 100, 8, 8),
                         (8, 264, 8192, 8192), (3, 1, 4096, 4096), (16, 14336, 4096, 4096),
                         (7, 500, 2001, 2008), (4, 3000, 1000, 1000), (16, 14336, 4096, -1),
                         (13, 40000, 520, -1), (1, 5, 16, -1)):
        # ldw -1: the same with PLAN['gemv_l2_prefetch'] (each block's first chunks into L2
        # before the PDL wait)
        monkeypatch.setitem(G.PLAN, "gemv_l2_prefetch", ldw < 0)
        x, w = _randn((M, K), dtype), _randn((N, max(ldw, K)), dtype)[:, :K]
        bias, res = _randn((N,), dtype), _randn((M, N), dtype)
        launched.clear()
        out = go.matmul(x, w.T, bias=bias, activation="gelu", residual=res, variant="gemv_mma")
        _check(out, x, w.T, dtype, bias=bias, act="gelu", residual=res,
               what=f"{cfg} {(M, N, K)}")
        assert launched == [expr], launched
    monkeypatch.setitem(G.PLAN, "gemv_l2_prefetch", False)
    for what, (x, w) in (
            ("batched", (_randn((2, 4, 1024), dtype), _randn((2, 300, 1024), dtype))),
            ("unaligned rows", (_randn((4, 1024), dtype), _randn((300, 1025), dtype)[:, 1:])),
            ("row stride", (_randn((4, 1001), dtype), _randn((300, 1001), dtype)))):
        launched.clear()
        out = go.matmul(x, w.transpose(-1, -2), variant="gemv_mma")
        _check(out, x, w.transpose(-1, -2), dtype, what=f"{cfg} {what}")
        assert launched and expr not in launched, (what, launched)
    _check_linear_in_graph(dtype, f"{cfg} graph")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("ks", G.GEMV_TMA_SPLITS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_gemv_mma_tma_split(ks, dtype, monkeypatch):
    """gemv_mma_tma_split (K split over clusters of KS blocks, rank 0 adding the others' sums
    through distributed shared memory), KS forced, outputs poisoned: one tile per cluster, many
    (the ranks' 'buffer free' barriers pass through both parities several times), ragged tiles,
    K slices of unequal chunk counts, K tails inside a chunk and a 16-byte pack, M = 1..16, the
    fused epilogue, a CUDA graph replayed with new data; K with fewer chunks than KS runs the
    plain kernel."""
    if _arch() < 90:
        pytest.skip(f"gemv_mma_tma_split needs sm_90 (kernels built for sm_{_arch()})")
    monkeypatch.setenv("GPUOPS_DEBUG_POISON", "1")
    monkeypatch.setitem(G.PLAN, "decode", "tma")
    monkeypatch.setitem(G.PLAN, "gemv_tma_split", ks)
    cfg = G.GEMV_TMA_CONFIGS[G.PLAN["gemv_tma"]]
    launched = []
    get = G._kernels.get
    monkeypatch.setattr(G._kernels, "get", lambda m, e, d: launched.append(e) or get(m, e, d))
    split = G._kname("gemv_mma_tma_split", dt.BY_NAME[dtype].ctype, *cfg, ks)
    plain = G._kname("gemv_mma_tma", dt.BY_NAME[dtype].ctype, *cfg)
    # (K a multiple of 8: TMA's 16-byte row stride)
    for M, N, K in ((2, 4096, 14336), (16, 4096, 14336), (1, 6144, 2048), (13, 40000, 2312),
                    (7, 777, 4104), (16, 264, 8192), (3, 1, 4096), (5, 1000, 3000),
                    (16, 37984, 2056), (4, 300, 1000), (2, 100, 520)):
        x, w = _randn((M, K), dtype), _randn((N, K), dtype)
        bias, res = _randn((N,), dtype), _randn((M, N), dtype)
        launched.clear()
        out = go.matmul(x, w.T, bias=bias, activation="gelu", residual=res, variant="gemv_mma")
        _check(out, x, w.T, dtype, bias=bias, act="gelu", residual=res,
               what=f"ks {ks} {(M, N, K)}")
        assert launched == [split if -(-K // cfg[1]) >= ks else plain], (M, N, K, launched)
    _check_linear_in_graph(dtype, f"ks {ks} graph")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_gemv_mma_tma_dual(dtype, monkeypatch):
    """gemv_mma_tma_dual (swiglu_linear under PLAN['decode'] 'tma', sm_90): silu(x wg^T) *
    (x wu^T) with both weights through one ring, outputs poisoned: M = 1..16, ragged tiles
    (N not a multiple of 16), one row, K tails inside a chunk and a 16-byte pack, a CUDA graph
    replayed with new data; weights TMA cannot take run the other kernels, correctly."""
    if _arch() < 90:
        pytest.skip(f"gemv_mma_tma_dual needs sm_90 (kernels built for sm_{_arch()})")
    monkeypatch.setenv("GPUOPS_DEBUG_POISON", "1")
    monkeypatch.setitem(G.PLAN, "decode", "tma")
    launched = []
    get = G._kernels.get
    monkeypatch.setattr(G._kernels, "get", lambda m, e, d: launched.append(e) or get(m, e, d))
    expr = G._kname("gemv_mma_tma_dual", dt.BY_NAME[dtype].ctype,
                    *G.GEMV_TMA_CONFIGS[G.PLAN["gemv_tma"]])
    for M, N, K in ((2, 14336, 4096), (16, 2000, 2312), (1, 6144, 2048), (7, 777, 1032),
                    (3, 1, 520), (5, 100, 8), (13, 40000, 1000)):
        # (x scaled by K^-1/4 as in test_gpu_swiglu_linear: fp16's range)
        x = _randn((M, K), dtype, scale=K ** -0.25)
        w, w2 = _randn((N, K), dtype), _randn((N, K), dtype)
        launched.clear()
        _check(go.swiglu_linear(x, w, w2, variant="gemv_mma"), x, w.T, dtype, b2=w2.T,
               what=f"dual {(M, N, K)}")
        assert launched == [expr], ((M, N, K), launched)
    x = _randn((4, 1001), dtype, scale=1001 ** -0.25)
    w, w2 = _randn((300, 1001), dtype), _randn((300, 1001), dtype)      # row stride: no TMA
    launched.clear()
    _check(go.swiglu_linear(x, w, w2, variant="gemv_mma"), x, w.T, dtype, b2=w2.T,
           what="dual row stride")
    assert launched and expr not in launched, launched
    _check_linear_in_graph(dtype, "dual graph", swiglu=True)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("plan", G.DECODE_PLANS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_decode_plans(plan, dtype, monkeypatch):
    """Every decode plan (PLAN['decode']) on the default path, M = 2..16, with splits."""
    monkeypatch.setitem(G.PLAN, "decode", plan)
    for M, N, K in ((2, 6144, 4096), (4, 1000, 4097), (8, 264, 8192), (16, 4096, 4096),
                    (13, 77, 3000), (16, 40, 65)):
        x, w = _randn((M, K), dtype), _randn((N, K), dtype)
        bias, res = _randn((N,), dtype), _randn((M, N), dtype)
        out = go.matmul(x, w.T, bias=bias, activation="gelu", residual=res)
        _check(out, x, w.T, dtype, bias=bias, act="gelu", residual=res,
               what=f"{plan} {dtype} {(M, N, K)}")
        if dtype != "float32":
            # silu(x w) * (x w2) grows like K: at K = 8192 a product can pass fp16's 65504 and
            # round to inf (run 31 saw one); inputs scaled by K^-1/4 keep it inside the range
            xs = (x.float() * K ** -0.25).to(x.dtype)
            w2 = _randn((N, K), dtype)
            _check(go.swiglu_linear(xs, w, w2), xs, w.T, dtype, b2=w2.T,
                   what=f"{plan} swiglu {dtype} {(M, N, K)}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_decode_ahead_and_prefetch(dtype, monkeypatch):
    """PLAN['gemv_ahead'] (gemv_mma's weight loads of several steps issued together) and
    PLAN['gemv_l2_prefetch'] (each block's weight rows, or their first bytes, asked into L2 before
    the PDL wait, sm_90) change no bit: M = 1 (SIMT gemv), 2..16 (gemv_mma on sm_80+), split-K
    with its reduce, SwiGLU, K not a multiple of 8, steps left over after the whole groups, rows
    past N, batched weights; the first configuration against the float64 reference, every other
    equal to it, outputs poisoned."""
    monkeypatch.setenv("GPUOPS_DEBUG_POISON", "1")
    configs = ((0, False), (0, True), (2, False), ("auto", False), (2, True), (2, 1024))
    for M, N, K in ((1, 6144, 2048), (2, 2048, 6144), (4, 1000, 4097), (16, 4096, 4096),
                    (13, 77, 3000), (1, 300, 1001), (8, 520, 2312)):
        x, w, w2 = _randn((M, K), dtype), _randn((N, K), dtype), _randn((N, K), dtype)
        xs = (x.float() * K ** -0.25).to(x.dtype)      # silu(x w) * (x w2) inside fp16's range
        got = []
        for ahead, prefetch in configs:
            monkeypatch.setitem(G.PLAN, "gemv_ahead", ahead)
            monkeypatch.setitem(G.PLAN, "gemv_l2_prefetch", prefetch)
            got.append([go.linear(x, w)] + ([go.swiglu_linear(xs, w, w2)]
                                            if dtype != "float32" else []))
        _check(got[0][0], x, w.T, dtype, what=f"{dtype} {(M, N, K)}")
        if dtype != "float32":
            _check(got[0][1], xs, w.T, dtype, b2=w2.T, what=f"swiglu {(M, N, K)}")
        for cfg, outs in zip(configs[1:], got[1:]):
            for a, b in zip(got[0], outs):
                assert torch.equal(a, b), f"{dtype} {(M, N, K)}: {cfg} changed the result"
    xb, wb = _randn((3, 5, 1000), dtype), _randn((3, 300, 1000), dtype)
    _check(go.matmul(xb, wb.transpose(-1, -2)), xb, wb.transpose(-1, -2), dtype,
           what=f"ahead 2, prefetch 1024, batched {dtype}")
    for bad in (100, 65536, -256, 1.5):
        monkeypatch.setitem(G.PLAN, "gemv_l2_prefetch", bad)
        with pytest.raises(ValueError, match="gemv_l2_prefetch"):
            go.linear(x, w)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("config", WT_CONFIGS)
def test_gpu_warp_tiled_configurations(config, monkeypatch):
    """Every warp_tiled tile configuration (PLAN['warp_tiled']) on the GPU, fp32: the six layouts
    at ragged shapes and one large enough for several waves, the dual kernel, the epilogue."""
    monkeypatch.setitem(G.PLAN, "warp_tiled", config)
    cfg = G.WARP_TILED_CONFIGS[config]
    for M, N, K in ((131, 97, 136), (1037, 1500, 600), (256, 256, 4096)):
        for name, a, b in _layouts(M, N, K, "float32"):
            _check(go.matmul(a, b, variant="warp_tiled"), a, b, "float32",
                   what=f"{config} {name} {(M, N, K)}", tile=cfg[:2])
    x, wg, wu = _randn((300, 520), "float32"), _randn((700, 520), "float32"), \
        _randn((700, 520), "float32")
    _check(go.swiglu_linear(x, wg, wu, variant="warp_tiled"), x, wg.T, "float32", b2=wu.T,
           what=f"{config} swiglu")
    a, b = _randn((300, 200), "float32"), _randn((200, 260), "float32")
    bias, res = _randn((260,), "float32"), _randn((300, 260), "float32")
    out = go.matmul(a, b, bias=bias, activation="gelu", residual=res, alpha=0.5,
                    variant="warp_tiled")
    _check(out, a, b, "float32", bias=bias, act="gelu", residual=res, alpha=0.5,
           what=f"{config} epilogue")


MMA_TILE_NAMES = sorted(G.MMA_TILES)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("tiles", MMA_TILE_NAMES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_mma_tile_configurations(tiles, dtype, monkeypatch):
    """Every mma tile configuration (PLAN['mma_tiles'] forces it) through both of its pipelines:
    aligned operands (the vector path: full tiles, then edge blocks and the K tail zero-filled)
    in all four layouts with M, N not multiples of the tile and K tails of 8 and of a partial
    16-byte chunk's worth; unaligned / sliced operands (the checked path); batches; and the
    epilogue (bias, activation, residual by 16-byte runs and element by element, fp32 out)."""
    _skip_unsupported("mma", dtype)
    cfg = G.MMA_TILES[tiles]
    if G._mma_smem(cfg) > torch.cuda.get_device_properties(0).shared_memory_per_block_optin:
        pytest.skip(f"{tiles} needs {G._mma_smem(cfg)} bytes of shared memory per block")
    monkeypatch.setitem(G.PLAN, "mma_tiles", tiles)
    kw = _kw("mma", dtype)
    for M, N, K in ((300, 520, 136), (1037, 8200, 600), (128, 256, 4096), (33, 24, 8)):
        for name, a, b in list(_layouts(M, N, K, dtype))[:4]:
            _check(go.matmul(a, b, **kw), a, b, dtype, what=f"{tiles} {dtype} {name} {(M, N, K)}")
    for name, a, b in list(_layouts(131, 97, 136, dtype))[4:]:
        _check(go.matmul(a, b, **kw), a, b, dtype, what=f"{tiles} {dtype} {name}")
    # aligned rows, extents that end inside a 16-byte chunk: K = 139 of K-major A (the K tail's
    # last chunk is partial), N = 299 of row-major B and M = 133 of a.T (the edge chunks are)
    a, b = _randn((300, 144), dtype)[:, :139], _randn((139, 304), dtype)[:, :299]
    _check(go.matmul(a, b, **kw), a, b, dtype, what=f"{tiles} {dtype} partial chunks")
    a = _randn((139, 136), dtype)[:, :133].T
    _check(go.matmul(a, b, **kw), a, b, dtype, what=f"{tiles} {dtype} partial chunks a.T")
    for what, (a, b) in {
            "bmm": (_randn((3, 200, 72), dtype), _randn((3, 72, 264), dtype)),
            "bmm_t": (_randn((2, 72, 136), dtype).transpose(1, 2),
                      _randn((2, 264, 72), dtype).transpose(1, 2)),
            "fold": (_randn((3, 2, 100, 64), dtype), _randn((64, 136), dtype))}.items():
        _check(go.matmul(a, b, **kw), a, b, dtype, what=f"{tiles} {dtype} {what}")
    for M, N, K in ((1037, 8200, 600), (70, 67, 300)):
        a, b = _randn((M, K), dtype), _randn((K, N), dtype)
        bias, res = _randn((N,), dtype), _randn((M, N), dtype)
        for act in (None, "gelu"):
            out = go.matmul(a, b, bias=bias, activation=act, residual=res, **kw)
            _check(out, a, b, dtype, bias=bias, act=act, residual=res,
                   what=f"{tiles} {dtype} {(M, N, K)} {act}")
        res_t = _randn((N, M), dtype).T                 # column stride M: element by element
        _check(go.matmul(a, b, residual=res_t, alpha=0.5, **kw), a, b, dtype, residual=res_t,
               alpha=0.5, what=f"{tiles} {dtype} transposed residual")
        row = _randn((N,), dtype)                       # broadcast over rows (row stride 0)
        _check(go.matmul(a, b, residual=row, **kw), a, b, dtype, residual=row,
               what=f"{tiles} {dtype} row residual")
        out = go.matmul(a, b, bias=bias.float(), residual=res.float(), activation="silu",
                        out_dtype=torch.float32, **kw)
        _check(out, a, b, dtype, bias=bias.float(), residual=res.float(), act="silu",
               out_dtype="float32", what=f"{tiles} out_dtype=float32")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("tiles", MMA_TILE_NAMES)
def test_gpu_int8_mma_tile_configurations(tiles, monkeypatch):
    """int8_matmul's tensor-core kernel in every tile configuration: aligned operands (vector
    path with edges and a K tail) and unaligned ones (checked path)."""
    _skip_unsupported("mma", "int8")
    cfg = G.MMA_TILES[tiles]
    if G._mma_smem(cfg) > torch.cuda.get_device_properties(0).shared_memory_per_block_optin:
        pytest.skip(f"{tiles} needs {G._mma_smem(cfg)} bytes of shared memory per block")
    monkeypatch.setitem(G.PLAN, "mma_tiles", tiles)
    for M, N, K in ((300, 520, 272), (130, 70, 4100), (2048, 4096, 256)):
        a, w = _q((M, K)), _q((N, K))
        sa = (torch.rand(M, device="cuda") + 0.1) / 128
        sb = (torch.rand(N, device="cuda") + 0.1) / 128
        out = go.int8_matmul(a, w.T, sa, sb, "bfloat16", variant="mma")
        ref = (a.double() @ w.T.double()) * sa.double()[:, None] * sb.double()[None, :]
        bound = 6 * U_ACC * ref.abs() + 2 * U_OUT["bfloat16"] * ref.abs() + TINY["bfloat16"]
        assert ((out.double() - ref).abs() <= bound).all(), f"int8 {tiles} {(M, N, K)}"


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_decode_in_cuda_graph(dtype):
    """Decode shapes (incl. split-K with its workspace) captured and replayed with new data."""
    side = torch.cuda.Stream()
    cases = [(1, 4096, 4096), (4, 256, 16384), (16, 1024, 2048)]
    statics = [(_randn((M, K), dtype), _randn((N, K), dtype), _randn((N, K), dtype))
               for M, N, K in cases]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, w, w2 in statics:                     # warm-up: loads the modules
            go.linear(x, w)
            go.swiglu_linear(x, w, w2)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [(go.linear(x, w), go.swiglu_linear(x, w, w2)) for x, w, w2 in statics]
    for _ in range(2):
        for (x, w, w2), (M, N, K) in zip(statics, cases):
            x.copy_(_randn((M, K), dtype))
            w.copy_(_randn((N, K), dtype))
        graph.replay()
        torch.cuda.synchronize()
        for (x, w, w2), (y, s) in zip(statics, outs):
            _check(y, x, w.T, dtype, what="graph linear")
            _check(s, x, w.T, dtype, b2=w2.T, what="graph swiglu")


@gpu
@needs_torch_cuda
def test_gpu_side_stream_numpy_and_cupy():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        a, b = _randn((300, 200), "bfloat16"), _randn((200, 100), "bfloat16")
        y = go.matmul(a, b)
    side.synchronize()
    _check(y, a, b, "bfloat16", what="side stream")
    an = np.random.default_rng(0).standard_normal((33, 65)).astype(np.float32)
    bn = np.random.default_rng(1).standard_normal((65, 17)).astype(np.float32)
    yn = go.matmul(an, bn)
    assert isinstance(yn, np.ndarray)
    _check(torch.from_numpy(yn).cuda(), torch.from_numpy(an).cuda(), torch.from_numpy(bn).cuda(),
           "float32", what="numpy on the gpu")
    import cupy as cp
    yc = go.matmul(cp.asarray(an), cp.asarray(bn).T.copy().T)
    assert isinstance(yc, cp.ndarray)
    _check(torch.as_tensor(yc, device="cuda"), torch.from_numpy(an).cuda(),
           torch.from_numpy(bn).cuda(), "float32", what="cupy")


@gpu
@needs_torch_cuda
def test_gpu_variant_errors():
    a, b = _randn((64, 64), "bfloat16"), _randn((64, 64), "bfloat16")
    if _arch() != G.WGMMA_ARCH:
        with pytest.raises(RuntimeError, match="sm_90a"):
            go.matmul(a, b, variant="wgmma")
    with pytest.raises(ValueError, match="M <= 16"):
        go.matmul(a, b, variant="gemv")
    if _arch() >= 80:
        with pytest.raises(ValueError, match="allow_tf32"):
            go.matmul(a.float(), b.float(), variant="mma")
    else:
        with pytest.raises(RuntimeError, match="sm_80"):
            go.matmul(a, b, variant="mma")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("act", [None, "gelu", "silu"])
def test_gpu_linear_gradients_match_torch(act, dtype):
    import gpuops.torch as gt
    td = getattr(torch, dtype)
    x = torch.randn(4, 33, 96, device="cuda", dtype=td, requires_grad=True)
    w = torch.randn(80, 96, device="cuda", dtype=td, requires_grad=True)
    b = torch.randn(80, device="cuda", dtype=td, requires_grad=True)
    gy = torch.randn(4, 33, 80, device="cuda", dtype=td)
    gt.linear(x, w, b, act).backward(gy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    _torch_act(act, F.linear(x64, w64, b64)).backward(gy.double())
    tol = 1e-4 if dtype == "float32" else 3e-2           # relative to the gradient's norm
    for name, got, exp in (("x", x.grad, x64.grad), ("w", w.grad, w64.grad), ("b", b.grad, b64.grad)):
        rel = (got.double() - exp).norm() / exp.norm()
        assert rel < tol, f"grad {name} {dtype} {act}: {rel.item():.3g}"
    f = torch.compile(lambda x, w, b: gt.linear(x, w, b, act), fullgraph=True)
    x.grad = None
    f(x, w, b).backward(gy)
    rel = (x.grad.double() - x64.grad).norm() / x64.grad.norm()
    assert rel < tol


# ============================================================================ GPU: wgmma (sm_90a)

WG_TILE = (G.WGMMA_BM, G.WGMMA_BN)
WG_DTYPES = ["bfloat16", "float16"]
# every kernel configuration (PLAN['wgmma']: the epilogues)
WG_CONFIGS = sorted(G.WGMMA_CONFIGS)


def _skip_unless_hopper():
    if _arch() != G.WGMMA_ARCH:
        pytest.skip(f"wgmma needs sm_90a (Hopper); kernels here are built for sm_{_arch()}")


def _padded(rows, cols, dtype):
    """A [rows, cols] view of a [rows, cols rounded up to 8] tensor: odd extents whose row stride
    TMA can take (16-byte multiples); what the padding holds must not leak into the product."""
    full = _randn((rows, -(-cols // 8) * 8), dtype)
    full[:, cols:] = float("nan")
    return full[:, :cols]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", WG_DTYPES)
@pytest.mark.parametrize("shape", [(128, 256, 64), (256, 512, 128), (2048, 4096, 512),
                                   (1, 1, 1), (17, 33, 65), (130, 259, 77), (4097, 4095, 1000),
                                   (64, 80, 65536)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", WG_CONFIGS)
def test_gpu_wgmma_shapes(shape, dtype, config, monkeypatch):
    """Tile multiples, one tile, ragged M / N / K tails (zero-filled by TMA; NaN padding past
    them must not leak in), more tiles than SMs (the persistent loop), K up to 65536."""
    _skip_unless_hopper()
    monkeypatch.setitem(G.PLAN, "wgmma", config)
    M, N, K = shape
    a, b = _padded(M, K, dtype), _padded(K, N, dtype)
    out = go.matmul(a, b, variant="wgmma")
    assert out.dtype == a.dtype
    _check(out, a, b, dtype, what=f"wgmma {dtype} {shape}", tile=WG_TILE)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", WG_DTYPES)
@pytest.mark.parametrize("config", WG_CONFIGS)
def test_gpu_wgmma_layouts(dtype, config, monkeypatch):
    """All four operand layouts (the transpose bits of wgmma); layouts TMA cannot read raise
    ValueError naming the operand, and fall back to 'mma' under WGMMA_AUTO."""
    _skip_unless_hopper()
    monkeypatch.setitem(G.PLAN, "wgmma", config)
    for name, a, b in _layouts(200, 264, 136, dtype):
        if name in ("sliced", "unaligned"):
            with pytest.raises(ValueError, match="cannot read 'a' with TMA"):
                go.matmul(a, b, variant="wgmma")
            continue
        _check(go.matmul(a, b, variant="wgmma"), a, b, dtype, what=f"wgmma {dtype} {name}",
               tile=WG_TILE)
    monkeypatch.setattr(G, "WGMMA_AUTO", True)
    for name, a, b in _layouts(200, 97, 136, dtype):      # N = 97: b has an odd row stride
        _check(go.matmul(a, b), a, b, dtype, what=f"auto {dtype} {name}", tile=WG_TILE)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", WG_DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("config", WG_CONFIGS)
def test_gpu_wgmma_fused_epilogue(act, dtype, config, monkeypatch):
    """act(alpha * acc + bias) + residual in fp32 with ragged edges, residual broadcast over
    rows, a transposed residual (no L2 prefetch), fp32 output of 16-bit inputs."""
    _skip_unless_hopper()
    monkeypatch.setitem(G.PLAN, "wgmma", config)
    for M, N, K in ((70, 72, 304), (300, 520, 320)):
        a, b = _randn((M, K), dtype), _randn((K, N), dtype)
        bias, res = _randn((N,), dtype), _randn((M, N), dtype)
        out = go.matmul(a, b, bias=bias, activation=act, residual=res, alpha=0.5,
                        variant="wgmma")
        _check(out, a, b, dtype, bias=bias, act=act, residual=res, alpha=0.5,
               what=f"wgmma {dtype} {act} {(M, N, K)}", tile=WG_TILE)
        row = _randn((N,), dtype)
        out = go.matmul(a, b, activation=act, residual=row, variant="wgmma")
        _check(out, a, b, dtype, act=act, residual=row, what="row residual", tile=WG_TILE)
        res_t = _randn((N, M), dtype).T
        out = go.matmul(a, b, bias=bias, residual=res_t, variant="wgmma")
        _check(out, a, b, dtype, bias=bias, residual=res_t, what="transposed residual",
               tile=WG_TILE)
        bias32, res32 = bias.float(), res.float()
        out = go.matmul(a, b, bias=bias32, activation=act, residual=res32,
                        out_dtype=torch.float32, variant="wgmma")
        assert out.dtype == torch.float32
        _check(out, a, b, dtype, bias=bias32, act=act, residual=res32, out_dtype="float32",
               what="out_dtype=float32", tile=WG_TILE)


def _spy_wgmma_configs(monkeypatch):
    """The wgmma configuration every following call ran (after _wgmma_call_config's routing)."""
    ran = []
    route = G._wgmma_call_config
    monkeypatch.setattr(G, "_wgmma_call_config", lambda p, L: (ran.append(route(p, L)), ran[-1])[1])
    return ran


# the configurations whose fused epilogues go through tensor stores (tma_fused's epilogue)
WG_FUSED_CONFIGS = ["pingpong", "tma_fused"]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", WG_DTYPES)
@pytest.mark.parametrize("config", WG_FUSED_CONFIGS)
def test_gpu_wgmma_tma_fused(dtype, config, monkeypatch):
    """'tma_fused' and 'pingpong' (residual by TMA into the store boxes, bias row by cp.async):
    every epilogue combination against float64 with NaN-poisoned outputs; M edges inside a warp's
    16 rows, inside a tile and (pingpong) between a warp's two row halves, N edges inside a
    32-column chunk and inside a tile (chunks past N skipped), one k-tile (residual and bias
    issued at k-tile 0) and many (issued 8 before the end), more tiles than SMs (barrier parities,
    pingpong's turns and bias rows across tiles, ragged tiles among them)."""
    _skip_unless_hopper()
    monkeypatch.setitem(G.PLAN, "wgmma", config)
    monkeypatch.setattr(G, "WGMMA_SPLIT_K", False)   # (130, 776, 1000) would split K ('direct')
    ran = _spy_wgmma_configs(monkeypatch)
    for M, N, K in ((200, 264, 136), (70, 72, 64), (130, 776, 1000), (4097, 4104, 640),
                    (100, 200, 72)):
        a, b = _randn((M, K), dtype), _randn((K, N), dtype)
        bias, res = _randn((N,), dtype), _randn((M, N), dtype)
        what = f"{config} {dtype} {(M, N, K)}"
        _check(go.matmul(a, b, bias=bias, variant="wgmma"), a, b, dtype, bias=bias,
               what=f"{what} bias", tile=WG_TILE)
        _check(go.matmul(a, b, residual=res, variant="wgmma"), a, b, dtype, residual=res,
               what=f"{what} residual", tile=WG_TILE)
        _check(go.matmul(a, b, activation="gelu", alpha=0.5, variant="wgmma"), a, b, dtype,
               act="gelu", alpha=0.5, what=f"{what} gelu", tile=WG_TILE)
        for act in ACTS:
            out = go.matmul(a, b, bias=bias, activation=act, residual=res, alpha=-0.75,
                            variant="wgmma")
            _check(out, a, b, dtype, bias=bias, act=act, residual=res, alpha=-0.75,
                   what=f"{what} bias+{act}+residual", tile=WG_TILE)
        assert set(ran) == {config}, ran
        ran.clear()
    # a linear layer (K-major weight) and a residual with a row stride wider than N
    x, w, bias = _randn((300, 512), dtype), _randn((264, 512), dtype), _randn((264,), dtype)
    res = _randn((300, 272), dtype)[:, :264]
    out = go.matmul(x, w.T, bias=bias, activation="silu", residual=res, variant="wgmma")
    _check(out, x, w.T, dtype, bias=bias, act="silu", residual=res, what="padded residual",
           tile=WG_TILE)
    assert ran == [config]
    ran.clear()


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", WG_DTYPES)
@pytest.mark.parametrize("config", WG_FUSED_CONFIGS)
def test_gpu_wgmma_tma_fused_batched_and_fallbacks(dtype, config, monkeypatch):
    """Batched residuals through the 5-D residual map (per matrix, broadcast over a batch dim,
    shared by the batch), in a CUDA graph too; calls 'tma_fused' cannot take run 'direct' and are
    still right: fp32 output, N % 8 != 0, a row or transposed or misaligned residual, a broadcast
    or misaligned bias."""
    _skip_unless_hopper()
    monkeypatch.setitem(G.PLAN, "wgmma", config)
    ran = _spy_wgmma_configs(monkeypatch)
    M, N, K = 37, 136, 72
    a, b = _randn((3, 2, M, K), dtype), _randn((3, 2, K, N), dtype)
    bias = _randn((N,), dtype)
    for what, res in (("per matrix", _randn((3, 2, M, N), dtype)),
                      ("broadcast dim", _randn((3, 1, M, N), dtype)),
                      ("shared", _randn((M, N), dtype))):
        out = go.matmul(a, b, bias=bias, activation="gelu_tanh", residual=res, variant="wgmma")
        _check(out, a, b, dtype, bias=bias, act="gelu_tanh", residual=res,
               what=f"{config} batched residual {what}", tile=WG_TILE)
    assert set(ran) == {config}, ran
    ran.clear()

    x, w = _randn((300, 320), dtype), _randn((320, 520), dtype)
    bias, res = _randn((520,), dtype), _randn((300, 520), dtype)
    cases = {
        "fp32 out": dict(bias=bias.float(), residual=res.float(), out_dtype=torch.float32),
        "row residual": dict(bias=bias, residual=_randn((520,), dtype)),
        "transposed residual": dict(residual=_randn((520, 300), dtype).T),
        "misaligned residual": dict(residual=_randn((300 * 520 + 1,), dtype)[1:].view(300, 520)),
        "broadcast bias": dict(bias=_randn((1,), dtype), residual=res),
        "misaligned bias": dict(bias=_randn((521,), dtype)[1:]),
    }
    for what, kw in cases.items():
        out = go.matmul(x, w, activation="silu", variant="wgmma", **kw)
        kw.pop("out_dtype", None)
        _check(out, x, w, dtype, act="silu", out_dtype="float32" if what == "fp32 out" else None,
               what=f"tma_fused fallback {what}", tile=WG_TILE, **kw)
        assert ran == ["direct"], (what, ran)
        ran.clear()
    x, w, bias = _randn((300, 320), dtype), _padded(320, 100, dtype), _randn((100,), dtype)
    out = go.matmul(x, w, bias=bias, variant="wgmma")                # N % 8 != 0
    _check(out, x, w, dtype, bias=bias, what="tma_fused fallback N % 8", tile=WG_TILE)
    assert ran == ["direct"]
    ran.clear()

    # captured once, replayed with new inputs and a new residual
    a, b = _randn((512, 136), dtype), _randn((136, 776), dtype)
    bias, res = _randn((776,), dtype), _randn((512, 776), dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        go.matmul(a, b, bias=bias, residual=res, variant="wgmma")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = go.matmul(a, b, bias=bias, activation="gelu", residual=res, variant="wgmma")
    for _ in range(2):
        a.copy_(_randn(a.shape, dtype))
        res.copy_(_randn(res.shape, dtype))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, a, b, dtype, bias=bias, act="gelu", residual=res, what=f"graph {config}",
               tile=WG_TILE)
    assert set(ran) == {config}, ran


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", WG_DTYPES)
@pytest.mark.parametrize("config", WG_CONFIGS)
def test_gpu_wgmma_batched_and_linear(dtype, config, monkeypatch):
    """Batches (folded into M, broadcast, transposed per matrix, expanded, many small matrices:
    5-D tensor maps, the persistent loop over the batch) and linear (a K-major weight)."""
    _skip_unless_hopper()
    monkeypatch.setitem(G.PLAN, "wgmma", config)
    cases = {
        "fold": (_randn((3, 2, 37, 48), dtype), _randn((48, 40), dtype)),
        "broadcast": (_randn((3, 1, 37, 48), dtype), _randn((2, 48, 40), dtype)),
        "bmm_t": (_randn((4, 48, 40), dtype).transpose(1, 2),
                  _randn((4, 32, 48), dtype).transpose(1, 2)),
        "expanded": (_randn((1, 40, 48), dtype).expand(3, 40, 48), _randn((3, 48, 32), dtype)),
        "many": (_randn((300, 72, 64), dtype), _randn((300, 64, 136), dtype)),
    }
    for what, (a, b) in cases.items():
        _check(go.matmul(a, b, variant="wgmma"), a, b, dtype, what=f"wgmma {dtype} {what}",
               tile=WG_TILE)
    for M, N, K in ((300, 264, 512), (4096, 2048, 1024)):
        x, w, bias = _randn((M, K), dtype), _randn((N, K), dtype), _randn((N,), dtype)
        _check(go.linear(x, w, bias, "gelu", variant="wgmma"), x, w.T, dtype, bias=bias,
               act="gelu", what=f"wgmma linear {(M, N, K)}", tile=WG_TILE)
    x = _randn((2, 3, 64), dtype)
    out = go.linear(x, _randn((48, 64), dtype), variant="wgmma")
    assert out.shape == (2, 3, 48)
    with pytest.raises(ValueError, match="cannot read 'weight' with TMA"):
        go.linear(_randn((64, 64), dtype), _randn((48, 65), dtype)[:, :64], variant="wgmma")


@gpu
@needs_torch_cuda
def test_gpu_wgmma_errors():
    _skip_unless_hopper()
    with pytest.raises(TypeError, match="float16/bfloat16"):
        go.matmul(_randn((64, 64), "float32"), _randn((64, 64), "float32"), variant="wgmma")
    x, w = _randn((64, 64), "bfloat16"), _randn((60, 64), "bfloat16")
    with pytest.raises(ValueError, match="multiple of 8"):
        go.swiglu_linear(x, w, w, variant="wgmma")        # N = 60: no tensor stores
    with pytest.raises(ValueError, match="cannot read 'w_up' with TMA"):
        w_up = _randn((64 * 65,), "bfloat16")[1:4097].view(64, 64)   # 2-byte aligned
        go.swiglu_linear(x, _randn((64, 64), "bfloat16"), w_up, variant="wgmma")
    a = _randn((64, 65), "bfloat16")                      # row stride 130 bytes
    with pytest.raises(ValueError, match="cannot read 'a' with TMA.*multiple of 16"):
        go.matmul(a, _randn((65, 64), "bfloat16"), variant="wgmma")


def _spy_wgmma_launches(monkeypatch):
    """The configurations of the wgmma launches made from now on (a list that fills up)."""
    seen = []
    real = G._launch_wgmma

    def spy(call, p, L, dtype, maps, config="base"):
        seen.append(config)
        return real(call, p, L, dtype, maps, config)
    monkeypatch.setattr(G, "_launch_wgmma", spy)
    return seen


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", WG_DTYPES)
def test_gpu_wgmma_swiglu(dtype, monkeypatch):
    """swiglu_linear on Hopper as two wgmma products (gate, then up with the gated epilogue that
    reads the gate by TMA): ragged M / N / K, 3-D inputs, NaN padding past K; variant=None takes
    it only where the gate product fills the GPU, else the dual 'mma' kernel; N % 8 != 0 falls
    back. The gate is rounded to the output dtype before silu (as torch rounds F.linear's
    output), which _check(gate_rounded=True) adds to the bound."""
    _skip_unless_hopper()
    seen = _spy_wgmma_launches(monkeypatch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # (64, 264, 2048): few tiles, K split (G._wgmma_split): both products as fp32 partials,
    # silu(gate) * up in the reduce, no rounded gate
    for M, N, K in ((1, 8, 1), (130, 264, 77), (300, 520, 1024), (64, 264, 2048),
                    (4097, 1032, 1000)):
        x = _padded(M, K, dtype).mul_(K ** -0.25)          # in place: the padding stays NaN
        wg, wu = _padded(N, K, dtype), _padded(N, K, dtype)
        split = G._wgmma_split(types.SimpleNamespace(M=M, N=N, K=K, batch=1), sms, products=2,
                               gain=G.SWIGLU_SPLIT_GAIN)[0] > 1
        seen.clear()
        out = go.swiglu_linear(x, wg, wu, variant="wgmma")
        assert seen == (["direct", "direct"] if split else ["tma_store", "tma_fused"]), seen
        _check(out, x, wg.T, dtype, b2=wu.T, gate_rounded=not split,
               what=f"wgmma swiglu {M}x{N}x{K}")
    x3 = _randn((2, 150, 256), dtype, scale=256 ** -0.25)
    wg, wu = _randn((264, 256), dtype), _randn((264, 256), dtype)
    out = go.swiglu_linear(x3, wg, wu, variant="wgmma")
    assert out.shape == (2, 150, 264)
    _check(out, x3, wg.T, dtype, b2=wu.T, gate_rounded=True, what="wgmma swiglu 3-D")
    # variant=None: the two products only where the gate product has a wave of tiles
    M = G.WGMMA_BM * -(-sms // 4)
    x = _randn((M, 128), dtype, scale=128 ** -0.25)
    wg, wu = _randn((4 * G.WGMMA_BN, 128), dtype), _randn((4 * G.WGMMA_BN, 128), dtype)
    seen.clear()
    out = go.swiglu_linear(x, wg, wu)
    assert seen == ["tma_store", "tma_fused"], seen
    _check(out, x, wg.T, dtype, b2=wu.T, gate_rounded=True, what="auto swiglu, one wave")
    seen.clear()
    out = go.swiglu_linear(x[:G.WGMMA_BM], wg, wu)          # 4 tiles: the dual mma kernel
    assert seen == [], seen
    _check(out, x[:G.WGMMA_BM], wg.T, dtype, b2=wu.T, what="auto swiglu, small")
    w = _randn((60 * sms, 128), dtype)                      # N % 8 != 0: the dual mma kernel
    seen.clear()
    out = go.swiglu_linear(x, w[:-4], w[4:])
    assert seen == [], seen
    _check(out, x, w[:-4].T, dtype, b2=w[4:].T, what="auto swiglu, N % 8")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", WG_DTYPES)
def test_gpu_wgmma_split_k(dtype, monkeypatch):
    """Products of few tiles run their K in splits (fp32 partials from the 'direct' kernel, then
    gemv_splitk_reduce's epilogue): bias + gelu + residual, a ragged last split, a folded and a
    real batch, transposed operands, NaN padding past K; variant=None takes it too."""
    _skip_unless_hopper()
    seen = _spy_wgmma_launches(monkeypatch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    M, N, K = 128, 520, 4000                       # 3 tiles; K = 62.5 k-tiles: a short last split
    assert G._wgmma_split(types.SimpleNamespace(M=M, N=N, K=K, batch=1), sms)[0] > 1
    a, b = _padded(M, K, dtype).mul_(K ** -0.5), _padded(K, N, dtype)
    bias, res = _randn((N,), dtype), _randn((M, N), dtype)
    out = go.matmul(a, b, bias=bias, activation="gelu", residual=res, variant="wgmma")
    assert seen == ["direct"], seen
    _check(out, a, b, dtype, bias=bias, act="gelu", residual=res, what="split-K bias gelu res",
           tile=WG_TILE)
    seen.clear()
    x, w = _randn((3, 100, 1024), dtype, scale=1024 ** -0.5), _randn((264, 1024), dtype)
    out = go.linear(x, w)                          # variant=None; batch folded into M = 300
    assert seen == ["direct"], seen
    _check(out, x, w.T, dtype, what="split-K linear, folded batch")
    seen.clear()
    a3, b3 = _randn((3, 100, 1024), dtype, scale=1024 ** -0.5), _randn((3, 264, 1024), dtype)
    out = go.matmul(a3, b3.transpose(1, 2), alpha=0.5, variant="wgmma")   # 3 matrices, B K-major
    assert seen == ["direct"], seen
    _check(out, a3, b3.transpose(1, 2), dtype, alpha=0.5, what="split-K batched")
    monkeypatch.setattr(G, "WGMMA_SPLIT_K", False)
    seen.clear()
    out = go.matmul(a, b, bias=bias, activation="gelu", residual=res, variant="wgmma")
    assert seen == [G.PLAN["wgmma"]], seen         # one launch of the configured epilogue
    _check(out, a, b, dtype, bias=bias, act="gelu", residual=res, what="unsplit", tile=WG_TILE)


@gpu
@needs_torch_cuda
def test_gpu_wgmma_swiglu_in_cuda_graph():
    """The gate workspace comes from the framework's allocator inside the capture; replays with
    new data give the new product."""
    _skip_unless_hopper()
    x, wg, wu = (_randn((512, 256), "bfloat16"), _randn((776, 256), "bfloat16"),
                 _randn((776, 256), "bfloat16"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        go.swiglu_linear(x, wg, wu, variant="wgmma")        # warm-up: loads the modules
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = go.swiglu_linear(x, wg, wu, variant="wgmma")
    for _ in range(2):
        x.copy_(_randn(x.shape, "bfloat16", scale=256 ** -0.25))
        wg.copy_(_randn(wg.shape, "bfloat16"))
        wu.copy_(_randn(wu.shape, "bfloat16"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, x, wg.T, "bfloat16", b2=wu.T, gate_rounded=True, what="graph wgmma swiglu")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("config", WG_CONFIGS)
def test_gpu_wgmma_in_cuda_graph(config, monkeypatch):
    """Tensor maps travel by value in the launch: captured once, replayed with new data."""
    _skip_unless_hopper()
    monkeypatch.setitem(G.PLAN, "wgmma", config)
    a, b = _randn((512, 136), "bfloat16"), _randn((136, 776), "bfloat16")
    bias = _randn((776,), "bfloat16")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        go.matmul(a, b, bias=bias, variant="wgmma")       # warm-up: loads the module
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = go.matmul(a, b, bias=bias, activation="silu", variant="wgmma")
    for _ in range(2):
        a.copy_(_randn(a.shape, "bfloat16"))
        b.copy_(_randn(b.shape, "bfloat16"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, a, b, "bfloat16", bias=bias, act="silu", what="graph wgmma", tile=WG_TILE)
