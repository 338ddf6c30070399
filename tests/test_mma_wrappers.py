"""The tensor-core wrappers of cuda_src/common/mma.cuh (shared by gemm and attention), as the CPU
emulator runs them (tests/cuda_emu/emu.h), against the PTX ISA's fragment layouts written out
here in NumPy ("Matrix Fragments for mma.m16n8k16 / m16n8k8 / m16n8k32", "ldmatrix").

These pin the emulation that the mma kernels' CPU tests rest on (test_attention.py runs the
tensor-core flash forward on it): if a layout here were wrong, the kernels would be tested against
the wrong hardware. Probes: tests/cuda_emu/probes/mma_probe.cu (one warp each). The same tests
run the probes on a GPU (sm_80+; ``gpu`` marker), compiled from the same sources by NVRTC: the
NumPy layouts, the emulator and the hardware then agree three ways. (The deferred-copy check of
cp.async is an emulator property and is skipped there.)
"""
from __future__ import annotations

import numpy as np
import pytest

import emu
from gpuops.runtime.launch import ArgSpec

_P4 = ArgSpec("ptr", "ptr", "ptr", "ptr")
_PROBE = emu.Probe("mma_probe", "probes/mma_probe.cu", {
    "ldmatrix_probe": _P4, "cp_async_probe": _P4, "cp_async4_probe": _P4,
    "mma_probe<gpuops::bfloat16_t>": _P4, "mma_probe<gpuops::float16_t>": _P4,
    "mma_probe<float>": _P4, "mma_probe<signed char>": _P4,
    "pack_probe<gpuops::bfloat16_t>": ArgSpec("ptr", "ptr", "ptr", "ptr", "ptr"),
    "pack_probe<gpuops::float16_t>": ArgSpec("ptr", "ptr", "ptr", "ptr", "ptr")})


def _emu_runner():
    if not emu.available():
        pytest.skip("no g++ for the kernel emulator")
    lib, index = emu.build(_PROBE)

    def run(name, *arrays, smem=0):
        k = emu.EmuKernel(lib, index[name], _PROBE.kernels[name], name)
        k.launch((1, 1, 1), (32, 1, 1), 0, *(a.ctypes.data for a in arrays), smem=smem)
    run.backend = "emu"
    return run


def _gpu_runner():
    """The probes compiled by NVRTC (through CuPy) from the real headers, run on the GPU; the
    NumPy arrays are copied in and back."""
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    import cupy  # noqa: PLC0415

    from gpuops.runtime import device, nvrtc  # noqa: PLC0415
    from gpuops.runtime.sources import assemble, cuda_src_root  # noqa: PLC0415
    if device.device_info(0).cc < 80:
        pytest.skip("mma.sync / ldmatrix / cp.async need sm_80+")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "cuda_src"
        shutil.copytree(cuda_src_root(), root)
        shutil.copytree(emu.HERE / "probes", root / "probes")
        text = assemble(_PROBE.source, root=root).text
    module = cupy.RawModule(code=text, options=nvrtc.BASE_OPTIONS,
                            name_expressions=list(_PROBE.kernels))

    def run(name, *arrays, smem=0):
        dev = [cupy.asarray(a) for a in arrays]
        module.get_function(name)((1,), (32,), tuple(dev), shared_mem=smem)
        for a, d in zip(arrays, dev):
            a[...] = d.get()
    run.backend = "gpu"
    return run


@pytest.fixture(scope="module", params=["emu", pytest.param("gpu", marks=pytest.mark.gpu)])
def probe(request):
    return _emu_runner() if request.param == "emu" else _gpu_runner()


def _lanes():
    lane = np.arange(32)
    return lane // 4, lane % 4           # g, t


def _pairs(lo, hi, bits=16):
    """Two values per 32-bit register, the lower-index one in the low half."""
    return lo.astype(np.uint32) | (hi.astype(np.uint32) << bits)


# ----------------------------------------------------------------------------- ldmatrix

def test_ldmatrix_x4_and_trans_give_the_isa_fragments(probe, rng):
    rows = rng.integers(0, 2**16, (32, 8), dtype=np.uint16)   # shared rows of 8 b16 values
    perm = rng.permutation(32).astype(np.int32)               # lane l points at row perm[l]
    plain = np.zeros((32, 4), np.uint32)
    trans = np.zeros((32, 4), np.uint32)
    probe("ldmatrix_probe", rows, perm, plain, trans, smem=512)
    g, t = _lanes()
    for i in range(4):
        mat = rows[perm[8 * i: 8 * i + 8]]                    # matrix i: rows from lanes 8i..8i+7
        # plain: lane l holds (row l / 4, columns 2 (l % 4), +1)
        np.testing.assert_array_equal(plain[:, i], _pairs(mat[g, 2 * t], mat[g, 2 * t + 1]),
                                      err_msg=f"ldmatrix.x4 register {i}")
        # .trans: lane l holds (rows 2 (l % 4), +1; column l / 4)
        np.testing.assert_array_equal(trans[:, i], _pairs(mat[2 * t, g], mat[2 * t + 1, g]),
                                      err_msg=f"ldmatrix.x4.trans register {i}")


# ----------------------------------------------------------------------------- mma.sync

def _bf16_bits(x):
    import ml_dtypes  # noqa: PLC0415
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _frag_b16(A, B, bits):
    """m16n8k16: A [16, 16], B [16, 8] as b16 bit patterns -> (a [32, 4], b [32, 2]) words."""
    g, t = _lanes()
    a = np.stack([_pairs(bits[A][g, 2 * t], bits[A][g, 2 * t + 1]),
                  _pairs(bits[A][g + 8, 2 * t], bits[A][g + 8, 2 * t + 1]),
                  _pairs(bits[A][g, 2 * t + 8], bits[A][g, 2 * t + 9]),
                  _pairs(bits[A][g + 8, 2 * t + 8], bits[A][g + 8, 2 * t + 9])], 1)
    b = np.stack([_pairs(bits[B][2 * t, g], bits[B][2 * t + 1, g]),
                  _pairs(bits[B][2 * t + 8, g], bits[B][2 * t + 9, g])], 1)
    return a, b


def _frag_c(C):
    g, t = _lanes()
    return np.stack([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]], 1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mma_m16n8k16_matches_the_isa_layout(probe, rng, dtype):
    if dtype == "bfloat16":
        A = rng.standard_normal((16, 16)).astype(np.float32)
        B = rng.standard_normal((16, 8)).astype(np.float32)
        ab = {"A": _bf16_bits(A), "B": _bf16_bits(B)}
        import ml_dtypes  # noqa: PLC0415
        A64 = ab["A"].view(ml_dtypes.bfloat16).astype(np.float64)
        B64 = ab["B"].view(ml_dtypes.bfloat16).astype(np.float64)
        name = "mma_probe<gpuops::bfloat16_t>"
    else:
        A16 = rng.standard_normal((16, 16)).astype(np.float16)
        B16 = rng.standard_normal((16, 8)).astype(np.float16)
        ab = {"A": A16.view(np.uint16), "B": B16.view(np.uint16)}
        A64, B64 = A16.astype(np.float64), B16.astype(np.float64)
        name = "mma_probe<gpuops::float16_t>"
    a, b = _frag_b16("A", "B", ab)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    c = _frag_c(C).astype(np.float32)
    d = np.zeros((32, 4), np.float32)
    probe(name, a, b, c, d)
    exp = _frag_c(A64 @ B64 + C)
    # products are exact in fp32; 16 fp32 additions: |err| <= 17 u (|A| |B| + |C|)
    bound = 17 * 2.0**-24 * _frag_c(np.abs(A64) @ np.abs(B64) + np.abs(C))
    assert np.all(np.abs(d - exp) <= bound)


def test_mma_m16n8k8_tf32_matches_the_isa_layout(probe, rng):
    # TF32 operands (low 13 mantissa bits zero, as to_tf32 leaves them): what the GPU does with
    # other bits is not specified (the emulator drops them)
    tr = lambda x: (x.view(np.uint32) & np.uint32(0xffffe000)).view(np.float32)  # noqa: E731
    A = tr(rng.standard_normal((16, 8)).astype(np.float32))
    B = tr(rng.standard_normal((8, 8)).astype(np.float32))
    g, t = _lanes()
    Ab, Bb = A.view(np.uint32), B.view(np.uint32)
    a = np.stack([Ab[g, t], Ab[g + 8, t], Ab[g, t + 4], Ab[g + 8, t + 4]], 1)
    b = np.stack([Bb[t, g], Bb[t + 4, g]], 1)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.zeros((32, 4), np.float32)
    probe("mma_probe<float>", a, b, _frag_c(C).astype(np.float32), d)
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    exp = _frag_c(A64 @ B64 + C)
    bound = 9 * 2.0**-24 * _frag_c(np.abs(A64) @ np.abs(B64) + np.abs(C))
    assert np.all(np.abs(d - exp) <= bound)


def test_mma_m16n8k32_s8_matches_the_isa_layout(probe, rng):
    A = rng.integers(-128, 128, (16, 32), dtype=np.int8)
    B = rng.integers(-128, 128, (32, 8), dtype=np.int8)
    g, t = _lanes()

    def quad(m, rows, cols):          # four int8 of consecutive k in one word, lowest k lowest
        return np.stack([m[rows, cols + j].view(np.uint8).astype(np.uint32) << (8 * j)
                         for j in range(4)]).sum(0).astype(np.uint32)
    a = np.stack([quad(A, g, 4 * t), quad(A, g + 8, 4 * t), quad(A, g, 4 * t + 16),
                  quad(A, g + 8, 4 * t + 16)], 1)
    Bt = np.ascontiguousarray(B.T)     # b0 = B[4t .. 4t+3][g]: k runs along a column of B
    b = np.stack([quad(Bt, g, 4 * t), quad(Bt, g, 4 * t + 16)], 1)
    C = rng.integers(-1000, 1000, (16, 8)).astype(np.int32)
    d = np.zeros((32, 4), np.int32)
    probe("mma_probe<signed char>", a, b, _frag_c(C), d)
    np.testing.assert_array_equal(d, _frag_c(A.astype(np.int64) @ B.astype(np.int64) + C))


# ----------------------------------------------------------------------------- cp.async, packs

def test_cp_async_zero_fills_and_lands_at_the_wait(probe, rng):
    src = rng.integers(0, 2**32, (32, 4), dtype=np.uint32)
    nbytes = rng.integers(0, 17, 32).astype(np.int32)
    nbytes[:3] = (0, 16, 5)
    before = np.zeros((32, 4), np.uint32)
    after = np.zeros((32, 4), np.uint32)
    probe("cp_async_probe", src, nbytes, before, after, smem=512)
    if probe.backend == "emu":
        assert np.all(before == 0xABABABAB)             # not there before cp.async.wait_group
    exp = src.view(np.uint8).reshape(32, 16).copy()
    exp[np.arange(16)[None, :] >= nbytes[:, None]] = 0  # bytes past src-size are zero-filled
    np.testing.assert_array_equal(after.view(np.uint8).reshape(32, 16), exp)


def test_cp_async4_zero_fills_and_lands_at_the_wait(probe, rng):
    src = rng.integers(0, 2**32, 32, dtype=np.uint32)
    nbytes = np.where(rng.random(32) < 0.5, 4, 0).astype(np.int32)
    nbytes[:2] = (0, 4)
    before = np.zeros(32, np.uint32)
    after = np.zeros(32, np.uint32)
    probe("cp_async4_probe", src, nbytes, before, after, smem=128)
    if probe.backend == "emu":
        assert np.all(before == 0xABABABAB)             # not there before cp.async.wait_group
    np.testing.assert_array_equal(after, np.where(nbytes == 4, src, 0))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_pack_b16x2_and_to_tf32(probe, rng, dtype):
    lo = (rng.standard_normal(32) * 100).astype(np.float32)
    hi = (rng.standard_normal(32) * 1e-3).astype(np.float32)
    lo[0], hi[1] = np.nan, np.inf
    x = rng.standard_normal(32).astype(np.float32).view(np.uint32)
    x[:4] = (0x3f801000, 0x3f803000, 0xbf801000, 0x7fc00001)   # ties (away from zero), NaN
    packed = np.zeros(32, np.uint32)
    tf = np.zeros(32, np.uint32)
    probe(f"pack_probe<gpuops::{dtype}_t>", lo, hi, packed, x, tf)
    if dtype == "bfloat16":
        exp = _pairs(_bf16_bits(lo), _bf16_bits(hi))
    else:
        exp = _pairs(lo.astype(np.float16).view(np.uint16), hi.astype(np.float16).view(np.uint16))
    got_lo, exp_lo = packed & 0xFFFF, exp & 0xFFFF
    expo = 0x7F80 if dtype == "bfloat16" else 0x7C00
    nan = int(got_lo[0])
    assert nan & expo == expo and nan & (0x7FFF ^ expo)            # NaN stays NaN
    np.testing.assert_array_equal(got_lo[1:], exp_lo[1:])
    np.testing.assert_array_equal(packed >> 16, exp >> 16)
    # cvt.rna.tf32.f32: 10 mantissa bits, nearest, ties away from zero; NaN unchanged
    assert list(tf[:3]) == [0x3f802000, 0x3f804000, 0xbf802000]
    assert tf[3] & 0x7f800000 == 0x7f800000 and tf[3] & 0x007fffff   # NaN stays NaN
    f = x[4:].view(np.float32).astype(np.float64)
    t = tf[4:].view(np.float32).astype(np.float64)
    assert np.all(tf[4:] & 0x1fff == 0) and np.all(np.abs(t - f) <= 2.0**-11 * np.abs(f))
