"""The normalization family (layer_norm, rms_norm, add_rms_norm; forward, *_forward with
statistics, and backward) against float64 references.

CPU: the references against torch in float64 (values and autograd gradients), argument errors,
the CPU path, eps=None, the launch plans and row/chunk/slot/tile mappings of the kernels
(simulated), the ring plan's forward-progress rule (its protocol replayed), every launch's
arguments against its kernel's signature with a recording loader (including the split-row paths
a small GPU takes), an fp32 model of the statistics, autograd and torch.compile(fullgraph=True)
through gpuops.torch; the forward kernels themselves on the CPU emulator (tests/emu.py): whole
rows, and split rows on the ring (blocks running at once, waiting for each other) and in two
launches, with tiny tiles.

GPU: every op and dtype against the references, rows of 1 .. 2^20 elements (one block, one warp
per row, rows split over blocks on the ring, in one launch and in two: every long-row plan at
262144, 393216, 393217 and 2^20 elements), unaligned and strided inputs,
expanded gradients, out= (NaN-filled, in place), NaN/Inf rows, HF transformers' RMSNorm for
add_rms_norm, bitwise determinism of the weight gradients, autograd against torch, a side
stream and CUDA graph capture at decode size, CuPy and NumPy inputs.
"""
from __future__ import annotations

import dataclasses
import types
from math import prod

import numpy as np
import pytest

import gpuops as go
from gpuops import dtypes as dt
from gpuops.ops import norms as N
from gpuops.runtime.launch import ArgSpec
from gpuops.tensor import Tensor
from conftest import HAS_TORCH, TOLERANCE, assert_close, gpu, needs_torch, needs_torch_cuda

import emu
from emu import needs_emu  # noqa: E402

torch = pytest.importorskip("torch") if HAS_TORCH else None
F = torch.nn.functional if HAS_TORCH else None
DTYPES = ["float32", "float16", "bfloat16"]
EPS = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float64": 2.0 ** -52}


def _t64(a):
    return torch.from_numpy(np.asarray(a, dtype=np.float64))


# ============================================================================ CPU: references

@needs_torch
@pytest.mark.parametrize("ns", [(7,), (3, 5)])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_reference_matches_torch(ns, affine, rng):
    x = rng.standard_normal((4, 2) + ns) * 3 + 1.5
    w = rng.standard_normal(ns) if affine else None
    b = rng.standard_normal(ns) if affine else None
    y, mean, rstd = N.ref_layer_norm_forward(x, ns, w, b, 1e-5)
    ty, tm, tr = torch.native_layer_norm(_t64(x), list(ns), None if w is None else _t64(w),
                                         None if b is None else _t64(b), 1e-5)
    np.testing.assert_allclose(y, ty.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(mean, tm.numpy().reshape(mean.shape), rtol=1e-12)
    np.testing.assert_allclose(rstd, tr.numpy().reshape(rstd.shape), rtol=1e-12)
    assert mean.shape == rstd.shape == (4, 2)
    np.testing.assert_allclose(N.ref_layer_norm(x, ns, w, b), y)


@needs_torch
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rms_norm_reference_matches_torch(eps, rng):
    x = rng.standard_normal((3, 4, 16)) * 2
    w = rng.standard_normal(16)
    y, rstd = N.ref_rms_norm_forward(x, 16, w, eps)
    np.testing.assert_allclose(y, F.rms_norm(_t64(x), [16], _t64(w), eps).numpy(), rtol=1e-12)
    np.testing.assert_allclose(rstd, 1 / np.sqrt((x * x).mean(-1) + (eps or EPS["float64"])))
    y2 = N.ref_rms_norm(x, (4, 16), None, eps)
    np.testing.assert_allclose(y2, F.rms_norm(_t64(x), [4, 16], None, eps).numpy(), rtol=1e-12)


@needs_torch
def test_add_rms_norm_reference(rng):
    x, r = rng.standard_normal((2, 2, 8, 32))
    w = rng.standard_normal(32)
    y, h, rstd = N.ref_add_rms_norm_forward(x, r, w, 1e-6)
    np.testing.assert_array_equal(h, x + r)
    np.testing.assert_allclose(y, F.rms_norm(_t64(x + r), [32], _t64(w), 1e-6).numpy(),
                               rtol=1e-12)
    assert rstd.shape == (2, 8)
    y1, h1 = N.ref_add_rms_norm(x, r, w, 1e-6)
    np.testing.assert_array_equal(y1, y)


@needs_torch
def test_backward_references_match_torch_autograd(rng):
    shape, ns = (3, 4, 10), (10,)
    x, dy, dh = (rng.standard_normal(shape) for _ in range(3))
    w, b = rng.standard_normal(ns), rng.standard_normal(ns)
    tx, tw, tb = (_t64(a).requires_grad_() for a in (x, w, b))
    _, mean, rstd = N.ref_layer_norm_forward(x, ns, w, b, 1e-5)
    gx, gw, gb = torch.autograd.grad(F.layer_norm(tx, ns, tw, tb, 1e-5), (tx, tw, tb), _t64(dy))
    rx, rw, rb = N.ref_layer_norm_backward(dy, x, mean, rstd, ns, w)
    for got, want in ((rx, gx), (rw, gw), (rb, gb)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)
    rx0, _, _ = N.ref_layer_norm_backward(dy, x, mean, rstd, ns, None)
    gx0, = torch.autograd.grad(F.layer_norm(tx, ns, None, None, 1e-5), (tx,), _t64(dy))
    np.testing.assert_allclose(rx0, gx0.numpy(), rtol=1e-10, atol=1e-12)

    _, rstd = N.ref_rms_norm_forward(x, ns, w, 1e-6)
    gx, gw = torch.autograd.grad(F.rms_norm(tx, ns, tw, 1e-6), (tx, tw), _t64(dy))
    rx, rw = N.ref_rms_norm_backward(dy, x, rstd, ns, w)
    np.testing.assert_allclose(rx, gx.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(rw, gw.numpy(), rtol=1e-10, atol=1e-12)

    r = rng.standard_normal(shape)
    tr = _t64(r).requires_grad_()
    th = tx + tr
    gx, gr, gw = torch.autograd.grad((F.rms_norm(th, ns, tw, 1e-6), th), (tx, tr, tw),
                                     (_t64(dy), _t64(dh)))
    _, h, rstd = N.ref_add_rms_norm_forward(x, r, w, 1e-6)
    rx, rw = N.ref_add_rms_norm_backward(dy, dh, h, rstd, w)
    np.testing.assert_allclose(rx, gx.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(rx, gr.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(rw, gw.numpy(), rtol=1e-10, atol=1e-12)
    rx2, _ = N.ref_add_rms_norm_backward(dy, None, h, rstd, w)
    np.testing.assert_allclose(rx2 + dh, rx, rtol=1e-12, atol=1e-12)


def test_empty_rows_reference_matches_torch_convention():
    y, mean, rstd = N.ref_layer_norm_forward(np.zeros((3, 0)), 0, None, None, 1e-5)
    assert y.shape == (3, 0) and np.all(mean == 0) and np.all(np.isnan(rstd))
    dx, dw, db = N.ref_layer_norm_backward(np.zeros((0, 4)), np.zeros((0, 4)), np.zeros(0),
                                           np.zeros(0), 4, None)
    assert dx.shape == (0, 4) and np.all(dw == 0) and np.all(db == 0) and dw.shape == (4,)


# ============================================================================ CPU: arguments

def test_argument_errors(rng):
    x = rng.standard_normal((4, 6)).astype(np.float32)
    w6 = np.ones(6, np.float32)
    with pytest.raises(ValueError, match="normalized_shape"):
        go.layer_norm(x, 5)
    with pytest.raises(ValueError, match="normalized_shape"):
        go.rms_norm(x, (4, 6, 1))
    with pytest.raises(ValueError, match="at least one"):
        go.layer_norm(x, ())
    with pytest.raises(TypeError, match="normalized_shape"):
        go.layer_norm(x, 6.0)
    with pytest.raises(ValueError, match="'weight'"):
        go.layer_norm(x, 6, np.ones(5, np.float32))
    with pytest.raises(ValueError, match="'bias'"):
        go.layer_norm(x, 6, w6, np.ones((1, 6), np.float32))
    with pytest.raises(ValueError, match="'residual'"):
        go.add_rms_norm(x, x[:2], w6)
    with pytest.raises(ValueError, match="normalized_shape"):
        go.add_rms_norm(x, x, np.ones(4, np.float32))
    with pytest.raises(TypeError, match="promote"):
        go.rms_norm(x, 6, np.ones(6, np.float16))
    with pytest.raises(ValueError, match="'rstd'"):
        go.rms_norm_backward(x, x, np.ones(3, np.float32), 6, w6)
    with pytest.raises(ValueError, match="'grad_output'"):
        go.layer_norm_backward(x[:2], x, np.zeros(4, np.float32), np.ones(4, np.float32), 6)
    with pytest.raises(ValueError, match="'grad_residual'"):
        go.add_rms_norm_backward(x, x[:1], x, np.ones(4, np.float32), w6)


def test_row_view():
    assert N.row_view((4, 6), (6, 1), 1) == (4, 6)
    assert N.row_view((4, 6), (10, 1), 1) == (4, 10)              # rows of a wider array
    assert N.row_view((2, 3, 6), (30, 10, 1), 1) == (6, 10)       # leading dims merge
    assert N.row_view((2, 3, 6), (40, 10, 1), 1) is None          # they do not
    assert N.row_view((4, 6), (1, 4), 1) is None                  # transposed
    assert N.row_view((4, 2, 3), (6, 3, 1), 2) == (4, 6)
    assert N.row_view((4, 2, 3), (12, 3, 1), 2) == (4, 12)
    assert N.row_view((4, 2, 3), (6, 1, 2), 2) is None
    assert N.row_view((1, 6), (99, 1), 1) == (1, 6)
    assert N.row_view((5, 1, 6), (6, 77, 1), 1) == (5, 6)         # size-1 dims ignored
    assert N.row_view((4, 6), (0, 1), 1) == (4, 0)                # expanded rows (inputs only)


# ============================================================================ CPU path

@needs_torch
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_path_torch_tensors_and_eps_none(dtype, rng):
    td = getattr(torch, dtype)
    x = torch.from_numpy(rng.standard_normal((5, 12)).astype(np.float32) * 0.1).to(td)
    w = torch.from_numpy(rng.standard_normal(12).astype(np.float32)).to(td)
    y = go.rms_norm(x, 12, w)                      # eps=None: the dtype's eps, as torch
    assert y.dtype == td and y.shape == x.shape
    ref = N.ref_rms_norm(x.double().numpy(), 12, w.double().numpy(), EPS[dtype])
    assert_close(y.double().numpy(), ref, dtype, "rms_norm cpu eps=None")
    y2, rstd = go.rms_norm_forward(x, 12, w)
    assert_close(rstd.double().numpy(), N.ref_rms_norm_forward(
        x.double().numpy(), 12, None, EPS[dtype])[1], dtype, "rstd cpu")
    expected = F.rms_norm(x.float(), [12], w.float(), torch.finfo(td).eps)
    assert_close(y.double().numpy(), expected.double().numpy(), dtype, "vs torch")
    yl, mean, rstd = go.layer_norm_forward(x, (12,), w, w)
    assert yl.shape == x.shape and mean.shape == rstd.shape == (5,)


def test_numpy_in_numpy_out(rng):
    x = rng.standard_normal((3, 5, 8)).astype(np.float32)
    w = rng.standard_normal((5, 8)).astype(np.float32)
    y = go.layer_norm(x, (5, 8), w)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32
    assert_close(y, N.ref_layer_norm(x.astype(np.float64), (5, 8), w.astype(np.float64)),
                 "float32", "numpy layer_norm")
    yr, h = go.add_rms_norm(x, x, w[0])
    assert_close(h, 2 * x.astype(np.float64), "float32", "numpy add_rms_norm residual")


# ============================================================================ planning (no GPU)

def _vecs():
    return (1, 4, 8)


@pytest.mark.parametrize("kind", list(N.TUNING))
def test_plans_cover_every_unit_exactly_once(kind):
    k = N.TUNING[kind]
    for vec in _vecs():
        for n in (0, 1, 3, 8, 64, 100, 1000, 4096, 4097, 8192, 12288, 16384, 20000, 65536,
                  262147, 1 << 20):
            if vec > 1 and n % vec:
                continue
            units = n // vec
            threads, ty, packs, C = N.plan_shape(k, vec, n)
            assert threads % 32 == 0 and 32 <= threads * ty <= 1024
            assert packs in N.packs_options(k, vec) and packs * vec <= k.cap
            assert (ty == 1) or (threads == 32 and k.warp_rows)
            assert C == 1 or (ty == 1 and threads == k.split_threads)
            assert threads * packs * C >= units and (C == 1 or threads * packs * (C - 1) < units)
            if n <= (8192 if k.persistent else 16384) and vec > 1:
                assert C == 1, (kind, vec, n)   # rows up to 8-16K elements: one block
            # the kernels' mapping: block chunk c, thread t, pack p -> unit
            u = (np.arange(C)[:, None, None] * threads * packs
                 + np.arange(packs)[None, :, None] * threads + np.arange(threads)[None, None, :])
            u = u.ravel()
            assert np.array_equal(np.sort(u[u < units]), np.arange(units))


def test_target_shape_plans():
    # [32768, 4096]: one row per block, no split, 256 threads forward, 512 backward
    assert N.plan_shape(N.LAYER_NORM, 8, 4096) == (256, 1, 2, 1)
    assert N.plan_shape(N.LAYER_NORM, 4, 4096) == (256, 1, 4, 1)
    assert N.plan_shape(N.RMS_NORM, 8, 2048) == (256, 1, 1, 1)
    assert N.plan_shape(N.LAYER_NORM_BWD, 8, 4096) == (512, 1, 1, 1)
    assert N.plan_shape(N.RMS_NORM_BWD, 4, 4096) == (512, 1, 2, 1)
    assert N.plan_shape(N.RMS_NORM, 8, 128) == (32, 8, 1, 1)        # warp rows
    threads, _, packs, C = N.plan_shape(N.LAYER_NORM, 4, 1 << 20)  # the long row: split
    assert C > 1 and threads * packs * 4 * C == 1 << 20


@pytest.mark.parametrize("persistent", [False, True])
def test_grids_cover_every_row_once_and_fit_when_fused(persistent, monkeypatch):
    for C in (1, 3, 7, 64, 300):
        for capacity in (8, 264, 1056):
            for rows in (1, 2, 5, 16, 1000):
                for force, waves in ((False, None), (True, None), (False, 1), (False, 3)):
                    monkeypatch.setattr(N, "FORCE_TWO_LAUNCHES", force)
                    monkeypatch.setattr(N, "ONE_LAUNCH_MAX_WAVES", waves)
                    fallback = N.Plan("generic", (256, 1, 1), 4, max(1, C // 2), capacity)
                    plan = N.Plan("split", (256, 1, 1), 1, C, capacity,
                                  fallback if C > 1 and persistent else None)
                    used, grid, phases = N._grid(plan, rows, persistent)
                    C_used = used.C
                    assert grid % C_used == 0 and grid >= C_used
                    if C == 1:
                        assert used is plan and phases == (N.FUSED,)
                        assert grid <= capacity if persistent else grid * 1 >= rows
                    elif C <= capacity and not force and (
                            waves is None or rows <= waves * (capacity // C)):
                        assert used is plan and phases == (N.FUSED,)
                        assert grid <= capacity      # every block of a row resident at once
                    else:
                        assert used is (plan.fallback or plan)
                        assert phases == (N.PARTIALS, N.APPLY)
                    slots = grid // C_used
                    seen = np.concatenate([np.arange(s, rows, slots) for s in range(slots)])
                    assert np.array_equal(np.sort(seen), np.arange(rows))


@pytest.mark.parametrize("kind", [k for k in N.TUNING if N.TUNING[k].split_template])
def test_split_kernel_plans(kind):
    k = N.TUNING[kind]
    for vec in _vecs():
        for n in (4097, 20000, 262147, 1 << 20, 1 << 24):
            if vec > 1 and n % vec:
                continue
            threads, packs, C = N.split_shape(k, vec, n)
            assert packs * vec <= k.split_cap and threads == k.split_threads
            units = n // vec
            assert threads * packs * C >= units > threads * packs * (C - 1)
            assert (vec, packs) in {(v, p) for (_, v), e in N._SPLIT_EXPRS[kind].items()
                                    for p in [int(e.split(",")[2].strip(" >"))]}


@pytest.mark.parametrize("kind", [k for k in N.TUNING if N.TUNING[k].ring_template])
def test_ring_tiles_cover_every_unit_once(kind):
    k = N.TUNING[kind]
    for vec, itemsize in ((1, 2), (1, 4), (4, 4), (8, 2)):
        for n in (16392, 20000, 262144, 262147, 393216, 393217, 1 << 20, 5 << 20):
            if vec > 1 and n % vec:
                continue
            units = n // vec
            threads, packs, C, tile_bytes = N.ring_shape(k, vec, n, itemsize)
            assert threads % 32 == 0 and 32 <= threads <= k.ring_threads
            assert packs == N.ring_packs(k, vec)
            assert threads * packs * (C - 1) < units <= threads * packs * C
            assert C == -(-units // (k.ring_threads * packs))     # no more tiles than needed
            assert tile_bytes == threads * packs * (16 if vec > 1 else itemsize)
            # the kernel's mapping: tile (chunk) c, pack p, thread t -> unit
            u = (np.arange(C)[:, None, None] * threads * packs
                 + np.arange(packs)[None, :, None] * threads + np.arange(threads)[None, None, :])
            u = u.ravel()
            assert np.array_equal(np.sort(u[u < units]), np.arange(units))
    # the long rows of the benchmarks: 16-byte packs, 512 threads, 32 KiB tiles
    assert N.ring_shape(N.RMS_NORM, 8, 1 << 20, 2) == (512, 4, 64, 32768)
    assert N.ring_shape(N.LAYER_NORM, 4, 393216, 4) == (512, 4, 48, 32768)
    assert N.ring_shape(N.ADD_RMS_NORM, 8, 1 << 20, 2) == (512, 2, 128, 16384)


def _ring_schedule(rows, C, grid, depth):
    """Replays norm_ring.cuh's loop for every block of a resident grid, in rounds; True when all
    blocks finish, False on a deadlock (a round in which no block moves). Block b's step k < K:
    land and publish its tile k (never waits), then drain its tile k + 1 - D, which waits until
    that tile's row has all C tiles published; steps K .. K + D - 2 only drain."""
    tiles = rows * C
    mine = [range(b, tiles, grid) for b in range(grid)]
    published = [0] * rows
    step = [0] * grid
    landed = [False] * grid      # the tile of the current step is published already
    while any(step[b] < len(own) + depth - 1 for b, own in enumerate(mine)):
        moved = False
        for b, own in enumerate(mine):
            K, k = len(own), step[b]
            if k >= K + depth - 1:
                continue
            if k < K and not landed[b]:
                published[own[k] // C] += 1
                landed[b] = moved = True
            j = k + 1 - depth
            if 0 <= j < K and published[own[j] // C] < C:
                continue
            step[b] += 1
            landed[b] = False
            moved = True
        if not moved:
            return False
    return True


def test_ring_grid_keeps_blocks_progressing():
    """ring_grid: at most `capacity` blocks (all resident), at most as many as tiles, tiles
    spread evenly, and no block holding more than `depth` tiles of a row; under that rule the
    protocol finishes for every shape (replayed), and breaking it can deadlock."""
    for C in (1, 2, 3, 7, 24, 64, 130):
        for capacity in (1, 4, 5, 264):
            for depth in (2, 3, 8):
                for rows in (1, 2, 3, 16, 40):
                    ring = N.RingPlan(None, 512, 4, C, depth, 0, capacity)
                    grid = N.ring_grid(ring, rows)
                    tiles = rows * C
                    if grid is None:            # the evenly spread grid would break the rule
                        per_block = -(-tiles // capacity)
                        assert -(-C // -(-tiles // per_block)) > depth
                        continue
                    assert 1 <= grid <= min(capacity, tiles) and -(-C // grid) <= depth
                    counts = [len(range(b, tiles, grid)) for b in range(grid)]
                    assert max(counts) - min(counts) <= 1
                    if tiles <= 400:
                        assert _ring_schedule(rows, C, grid, depth), (C, capacity, depth, rows)
    assert not _ring_schedule(2, 10, 4, 2)        # 3 tiles of a row in a block, 2 slots
    ring = N.RingPlan(None, 512, 4, 24, 3, 0, 8)
    assert N.ring_grid(ring, 1) == 8                            # 3 tiles of the row per block
    assert N.ring_grid(N.RingPlan(None, 512, 4, 25, 3, 0, 8), 1) is None             # 4
    assert _ring_schedule(1, 24, 8, 3) and not _ring_schedule(1, 25, 8, 3)
    # tile indices are 32-bit in the kernels (norm_ring.cuh, RingTile): 2^31 tiles or more run
    # the split plans
    ring = N.RingPlan(None, 512, 4, 64, 8, 0, 264)
    assert N.ring_grid(ring, (1 << 31) // 64 - 1) is not None
    assert N.ring_grid(ring, (1 << 31) // 64) is None


# ---------------------------------------------------------------- launches with a recording loader

class _Recorder:
    def __init__(self, name, spec: ArgSpec, log):
        self.name, self.spec, self.log, self.ptr = name, spec, log, hash(name) & 0xffff

    def launch(self, grid, block, stream, *args, smem=0):
        self.spec.struct.pack(*args)          # the argument list fits the kernel's signature
        self.log.append((self.name, grid, block, args))


class _FakeLoaded:
    def __init__(self, module, log):
        self.module, self.log = module, log

    def kernel(self, expr):
        return _Recorder(expr, self.module.kernels[expr], self.log)


class _FakeCall:
    kind = "torch"
    device = 0
    stream = 0

    def __init__(self, dtype):
        self.result_dtype = dtype
        self.next = 1 << 20
        self.allocs = []

    def empty(self, shape, dtype):
        t = Tensor(self.next, tuple(shape), _cstrides(shape), dtype, 0, None)
        self.next += -(-max(t.nbytes, 1) // 256) * 256
        self.allocs.append(t)
        return t


def _cstrides(shape):
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


@pytest.fixture
def recording(monkeypatch, request):
    """Launches go to a log; the device has 4 blocks on each of `param` SMs (2: long rows take
    two launches; 64: rows of 20000 elements run split in one launch)."""
    log, memsets = [], []

    class _Runtime:
        @staticmethod
        def memsetAsync(ptr, value, nbytes, stream):  # noqa: N802
            memsets.append((ptr, value, nbytes))

    class _Cupy:
        class cuda:  # noqa: N801
            runtime = _Runtime

    class _Info:
        sm_count = getattr(request, "param", 2)
        max_smem_per_block_optin = 227 * 1024
        cc = 90

    monkeypatch.setattr(N.loader, "load", lambda module, dev: _FakeLoaded(module, log))
    monkeypatch.setattr(N.loader, "blocks_per_sm", lambda kernel, threads, smem=0: 4)
    monkeypatch.setattr(N.device, "device_info", lambda dev: _Info)
    monkeypatch.setattr(N.device, "cupy_or_none", lambda: _Cupy)
    monkeypatch.setattr(N, "_plans", {})
    monkeypatch.setattr(N, "_ring2_states", {})
    monkeypatch.setattr(N, "_ring2_retired", [])
    return log, memsets, 4 * _Info.sm_count


def _input(call, shape, dtype, strides=None):
    t = Tensor(call.next, tuple(shape), strides or _cstrides(shape), dtype, 0, None)
    call.next += -(-max(prod(shape) * dtype.itemsize, 1) // 256) * 256 + 4096
    return t


def _within(call, ptr, nbytes):
    return any(a.ptr <= ptr and ptr + nbytes <= a.ptr + a.nbytes for a in call.allocs)


@pytest.mark.parametrize("recording", [2, 64], indirect=True, ids=["2sm", "64sm"])
@pytest.mark.parametrize("dtype", [dt.float32, dt.bfloat16])
@pytest.mark.parametrize("n", [1, 4096, 4097, 20000, 1 << 20])
@pytest.mark.parametrize("long_rows", ["auto", "resident", "ring2", "ring", "split"])
def test_forward_launch_arguments(recording, dtype, n, long_rows, monkeypatch):
    log, memsets, capacity = recording
    monkeypatch.setattr(N, "LONG_ROWS", long_rows)
    rows = 3
    for op in ("layer_norm", "rms_norm", "add_rms_norm"):
        vec = 16 // dtype.itemsize if n % (16 // dtype.itemsize) == 0 else 1
        res_plan = N._ring_plan(op, dtype, vec, n, 0, "resident")
        resident = N.ring_grid(res_plan, rows)
        # "resident" without a resident kernel or with too many tiles: "auto"'s plan; "auto"
        # takes "resident" wherever it fits (the fake device: cc 90)
        plan = "auto" if long_rows == "resident" and resident is None else long_rows
        if plan == "auto" and resident is not None and vec > 1:
            plan = "resident"
        log.clear()
        memsets.clear()
        call = _FakeCall(dtype)
        x = _input(call, (rows, n), dtype)
        w = _input(call, (n,), dtype)
        if op == "layer_norm":
            y, mean, rstd = N._layer_norm_launch(call, op, x, (n,), w, w, 1e-5, None, True)
            K = 3
        else:
            r = _input(call, (rows, n), dtype) if op == "add_rms_norm" else None
            y, h, rstd = N._rms_norm_launch(call, op, x, r, (n,), w, 1e-6, None, True)
            K = 1
        expected = {"layer_norm": "layer_norm_", "rms_norm": "rms_norm_",
                    "add_rms_norm": "rms_norm_"}[op]
        assert log and all(expected in name for name, *_ in log)
        if op != "layer_norm":       # (kAdd: the fourth template argument)
            assert all("_resident<" in name or name[name.index("<") + 1:].split(",")[3].strip(" >")
                       == ("true" if op == "add_rms_norm" else "false") for name, *_ in log), log
        name, grid, block, args = log[0]
        C = args[-3]
        vec = int(name.split(",")[1])
        assert vec == (16 // dtype.itemsize if n % (16 // dtype.itemsize) == 0 else 1)
        assert ("_resident<" in name) == (plan == "resident" and n > 16384)
        if "_resident<" in name:     # every tile of a block held at once (the rows fit on chip)
            assert vec > 1 and op != "add_rms_norm" and len(log) == 1 and grid == (resident, 1, 1)
            D, packs = args[-2], int(name.split(",")[2].strip(" >"))
            assert grid[0] <= capacity and -(-(rows * C) // grid[0]) <= D + 1
        if "_ring2<" in name or "_resident<" in name:   # split rows, one pass, ring2's words
            assert plan in ("ring2", "auto", "resident") and len(log) == 1 and n > 16384
            D, packs = args[-2], int(name.split(",")[2].strip(" >"))
            if plan == "auto":      # one tile per block, or rms_norm with few partials
                assert vec > 1 and (grid[0] == rows * C
                                    or (op != "layer_norm" and C <= N.AUTO_RING2_MAX_C))
            threads, packs_, C_, tile_bytes = N.ring_shape(N.TUNING[op], vec, n, dtype.itemsize)
            assert (block, C, packs) == ((threads, 1, 1), C_, packs_) and D >= 2
            assert grid[0] <= capacity and grid[0] <= rows * C
            assert -(-C // grid[0]) <= D or "_resident<" in name
            words = rows * C * (2 if op == "layer_norm" else 1)
            state = args[-6]                 # zeroed once, when first allocated for the stream
            if memsets:
                assert len(memsets) == 1 and memsets[0][:2] == (state, 0)
                assert memsets[0][2] >= 4 * N.RING2_HEADER_WORDS + 8 * words
            held, held_words = N._ring2_states[(0, 0)]
            assert held.ptr == state and held_words >= words
            stat_ptrs = args[6:8] if op == "layer_norm" else args[9:10]
            assert all(p != 0 and _within(call, p, rows * 4) for p in stat_ptrs)
            assert args[-5] == rows and args[-4] == n
            log.clear()                      # stats not wanted: null pointers; same state
            memsets.clear()
            if op == "layer_norm":
                N._layer_norm_launch(call, op, x, (n,), w, w, 1e-5, None, False)
                assert log[0][3][6:8] == (0, 0)
            else:
                N._rms_norm_launch(call, op, x, r, (n,), w, 1e-6, None, False)
                assert log[0][3][9] == 0
            assert not memsets and log[0][3][-6] == state
            continue
        if "_ring<" in name:         # split rows, one pass: grid resident, tiles of a ring
            assert plan in ("ring", "auto") and len(log) == 1 and n > 16384
            if plan == "auto" and vec > 1:     # ring2 would leave a block several tiles
                assert grid[0] < rows * C and not (op != "layer_norm"
                                                   and C <= N.AUTO_RING2_MAX_C)
            D, packs = args[-2], int(name.split(",")[2].strip(" >"))
            kind = N.TUNING[op]
            threads, packs_, C_, tile_bytes = N.ring_shape(kind, vec, n, dtype.itemsize)
            assert (block, C, packs) == ((threads, 1, 1), C_, packs_)
            assert threads % 32 == 0 and threads <= kind.ring_threads and D >= 2
            assert grid[0] <= capacity and grid[0] <= rows * C and -(-C // grid[0]) <= D
            assert len(memsets) == 1 and memsets[0][1:] == (0, rows * 4)
            counters, partials = args[-6], args[-7]
            assert counters == memsets[0][0] and _within(call, partials, rows * C * K * 4)
            stat_ptrs = args[6:8] if op == "layer_norm" else args[9:10]
            assert all(p != 0 and _within(call, p, rows * 4) for p in stat_ptrs)
            assert args[-5] == rows and args[-4] == n
            continue
        assert grid[0] % C == 0
        if C == 1:
            assert not memsets and [a[-2] for *_, a in log] == [N.FUSED]
            assert grid[0] * block[1] >= rows
        else:
            assert [a[-2] for *_, a in log] in ([N.FUSED], [N.PARTIALS, N.APPLY])
            assert len(memsets) == 1 and memsets[0][1] == 0 and memsets[0][2] == rows * 4
            counters, partials = args[-6], args[-7]
            assert counters == memsets[0][0] and _within(call, counters, rows * 4)
            assert _within(call, partials, rows * C * K * 4)
            assert partials >= counters + rows * 4
            stat_ptrs = args[6:8] if op == "layer_norm" else args[9:10]
            assert all(p != 0 and _within(call, p, rows * 4) for p in stat_ptrs)
            if len(log) == 2:
                assert "_fwd<" in name and log[1][0] == name
                assert grid[0] // C >= 1 and log[1][1] == grid and log[1][3][:-2] == args[:-2]
            else:
                assert "_split<" in name     # one launch: the pipelined kernel
                assert grid[0] <= capacity   # every block resident at once
                assert (capacity, n) == (256, 20000)
        assert args[-5] == rows and args[-4] == n
        stats = [a for a in (mean if op == "layer_norm" else None, rstd) if a is not None]
        assert all(s.shape == (rows,) and s.dtype is dt.float32 for s in stats)


def test_ring_plans_fit_the_device(monkeypatch):
    """Two blocks per SM with the most slots that fit (an occupancy calculator of shared memory
    and threads), else one; on a 48 KiB-per-block Pascal, 256-thread blocks (16 KiB tiles)."""
    from types import SimpleNamespace  # noqa: PLC0415
    dev = {}
    monkeypatch.setattr(N.loader, "load", lambda module, d: _FakeLoaded(module, []))
    monkeypatch.setattr(N.loader, "blocks_per_sm", lambda kernel, threads, smem=0: min(
        2048 // threads, dev["smem_per_sm"] // (smem + 1024)))
    monkeypatch.setattr(N.device, "device_info", lambda d: SimpleNamespace(
        sm_count=dev["sms"], max_smem_per_block_optin=dev["optin"]))
    monkeypatch.setattr(N, "_plans", {})

    def plan(kind, d, vec, n, sms, smem_per_sm, optin, variant="ring"):
        dev.update(sms=sms, smem_per_sm=smem_per_sm, optin=optin)
        N._plans.clear()
        p = N._ring_plan(kind, d, vec, n, 0, variant)
        return p and (p.threads, p.packs, p.C, p.depth, p.smem, p.capacity)

    h100 = (132, 228 * 1024, 227 * 1024)
    assert plan("rms_norm", dt.bfloat16, 8, 1 << 20, *h100) == (512, 4, 64, 3, 512 + 3 * 32768,
                                                                264)
    assert plan("add_rms_norm", dt.bfloat16, 8, 1 << 20, *h100)[:4] == (512, 2, 128, 7)
    assert plan("layer_norm", dt.float32, 4, 393216, *h100)[:4] == (512, 4, 48, 3)
    pascal = (20, 96 * 1024, 48 * 1024)
    assert plan("rms_norm", dt.bfloat16, 8, 1 << 20, *pascal) == (256, 4, 128, 2,
                                                                  512 + 2 * 16384, 40)
    assert plan("rms_norm", dt.bfloat16, 8, 1 << 20, 56, 64 * 1024, 48 * 1024)[3:] == (
        2, 512 + 2 * 16384, 56)                  # P100: one block per SM
    assert plan("rms_norm", dt.bfloat16, 8, 1 << 20, 8, 8 * 1024, 48 * 1024) is None


@pytest.mark.parametrize("recording", [2, 64], indirect=True, ids=["2sm", "64sm"])
@pytest.mark.parametrize("layer", [True, False])
@pytest.mark.parametrize("n", [7, 4096, 9000, 1 << 20])
@pytest.mark.parametrize("plan", N.BACKWARD_LONG_ROWS_PLANS)
def test_backward_launch_arguments(recording, layer, n, plan, monkeypatch):
    log, memsets, capacity = recording
    monkeypatch.setattr(N, "BACKWARD_LONG_ROWS", plan)
    dtype = dt.bfloat16
    rows = 5
    call = _FakeCall(dtype)
    dy, x = _input(call, (rows, n), dtype), _input(call, (rows, n), dtype)
    mean, rstd = _input(call, (rows,), dt.float32), _input(call, (rows,), dt.float32)
    w = _input(call, (n,), dtype)
    dres = None if layer else _input(call, (rows, n), dtype)
    dx, dw, db = N._backward_launch(call, "t", layer, dy, x, mean if layer else None, rstd,
                                    (n,), w, dres)
    assert dx.shape == (rows, n) and dw.shape == (n,) and (db is not None) == layer
    vec = 8 if n % 8 == 0 else 1
    if plan == "columns" and N.plan_shape(N.TUNING["rms_norm_bwd"], vec, n)[3] > 1:
        _check_columns_launches(call, log, memsets, capacity, layer, rows, n, vec,
                                (dy, x, mean, rstd, w, dres, dx, dw, db))
        return
    main = [e for e in log if "norm_bwd" in e[0]]
    final = [e for e in log if "norm_weight_grad" in e[0]]
    assert len(final) == 1 and log[-1] is final[0]
    name, grid, block, args = main[0]
    C = args[-2]
    slots = grid[0] // C
    assert grid[0] % C == 0 and slots <= rows
    part_a, part_b = args[11], args[12]
    assert _within(call, part_a, slots * n * 4)
    assert (part_b != 0) == layer and (not layer or _within(call, part_b, slots * n * 4))
    assert args[0] == dy.ptr and args[2] == x.ptr and args[9] == dx.ptr
    assert args[4] == (0 if layer else dres.ptr) and args[6] == (mean.ptr if layer else 0)
    fa = final[0][3]
    assert fa[:4] == (part_a, part_b, dw.ptr, db.ptr if layer else 0) and fa[4:] == (slots, n)
    assert final[0][1][0] * 32 >= n
    if C > 1:
        assert len(memsets) == 1 and memsets[0][2] == rows * 4
        K = 2 if layer else 1
        assert _within(call, args[14], rows * 4) and _within(call, args[13], rows * C * K * 4)
        assert _within(call, args[15], rows * K * 4)
        one = C <= capacity and rows <= N.ONE_LAUNCH_MAX_WAVES * (capacity // C)
        assert [a[-1] for *_, a in main] == ([N.FUSED] if one else [N.PARTIALS, N.APPLY])
        assert len(main) == 2 or grid[0] <= capacity
    else:
        assert not memsets and len(main) == 1 and grid[0] == min(rows, capacity)


def _check_columns_launches(call, log, memsets, capacity, layer, rows, n, vec, tensors):
    """The column plan's launches: stats, row sums, apply (and norm_weight_grad over the groups'
    [groups, n] workspace where there are several), no memset; every pointer inside its
    allocation, the workspace's dw / db 16-byte aligned."""
    dy, x, mean, rstd, w, dres, dx, dw, db = tensors
    K = 2 if layer else 1
    chunks, grid_x, groups, rpg = N.cols_grid(n // vec, rows, capacity)
    assert groups * rpg >= rows and (groups - 1) * rpg < rows
    assert groups == 1 or rpg % N.COLS_ROWS == 0
    names = [e[0] for e in log]
    assert ["cols_stats" in names[0], "row_sums" in names[1], "cols_apply" in names[2]] == [True] * 3
    assert len(log) == (4 if groups > 1 else 3) and not memsets
    (_, g1, b1, sa), (_, g2, b2, ra), (_, g3, b3, aa) = log[:3]
    assert g1 == g3 == (grid_x, groups, 1) and b1 == b3 == (N.COLS_THREADS, 1, 1)
    assert g2[0] == min(rows, 1 << 16) and ra[2:] == (rows, chunks)
    assert sa[:7] == (dy.ptr, n, x.ptr, n, mean.ptr if layer else 0, rstd.ptr, w.ptr)
    assert sa[12:] == (rows, n, chunks, rpg)
    partials, sums = sa[7], aa[9]
    assert ra[:2] == (partials, sums)
    assert _within(call, partials, rows * chunks * K * 4) and _within(call, sums, rows * K * 4)
    assert aa[:9] == (dy.ptr, n, x.ptr, n, 0 if layer else dres.ptr, 0 if layer else n,
                      mean.ptr if layer else 0, rstd.ptr, w.ptr)
    assert aa[10:] == (dx.ptr, n, rows, n, chunks, rpg)
    if groups > 1:
        dw_part, db_part = sa[8], sa[9]
        assert dw_part % 16 == 0 and _within(call, dw_part, groups * n * 4)
        assert (db_part != 0) == layer and (not layer or _within(call, db_part, groups * n * 4))
        assert sa[10:12] == (dw.ptr, db.ptr if layer else 0)
        assert log[3][3] == (dw_part, db_part, dw.ptr, db.ptr if layer else 0, groups, n)
    else:
        assert sa[8:12] == (0, 0, dw.ptr, db.ptr if layer else 0)


def test_cols_grid():
    """The column plan covers every chunk and row, fills the capacity without a short last
    wave: blocks take equal numbers of chunks (all but the last ones)."""
    for units in (1, 255, 256, 257, 5000, 131072, 262144):
        for rows in (1, 3, 4, 5, 16, 37, 1000, 32768):
            for target in (4, 264, 396):
                chunks, grid_x, groups, rpg = N.cols_grid(units, rows, target)
                assert chunks * N.COLS_THREADS >= units > (chunks - 1) * N.COLS_THREADS
                assert grid_x <= max(chunks, 1) and groups * rpg >= rows
                per_block = -(-chunks // grid_x)
                assert (grid_x - 1) * per_block < chunks       # no block without a chunk
                if chunks >= target:
                    assert groups == 1 and grid_x <= target
                else:
                    assert grid_x == chunks and grid_x * groups <= max(target, chunks)


def test_strided_and_unaligned_launches(recording):
    log, _, _ = recording
    call = _FakeCall(dt.float32)
    base = _input(call, (6, 40), dt.float32)
    x = Tensor(base.ptr, (6, 32), (40, 1), dt.float32, 0, None)   # rows 160 B apart: packs
    y, _, _ = N._layer_norm_launch(call, "layer_norm", x, (32,), None, None, 1e-5, None, False)
    args = log[-1][3]
    assert args[0] == x.ptr and args[1] == 40 and args[3] == 32
    assert ",4," in log[-1][0].replace(" ", "")
    x = Tensor(base.ptr + 4, (6, 32), (40, 1), dt.float32, 0, None)   # unaligned: elements
    N._layer_norm_launch(call, "layer_norm", x, (32,), None, None, 1e-5, None, False)
    assert ",1," in log[-1][0].replace(" ", "")
    x = Tensor(base.ptr, (6, 32), (34, 1), dt.float32, 0, None)   # 136 B rows: elements
    N._layer_norm_launch(call, "layer_norm", x, (32,), None, None, 1e-5, None, False)
    assert ",1," in log[-1][0].replace(" ", "")


# ============================================================================ fp32 statistics model

def _model_stats(x, chunk, per_thread):
    """fp32 model of the forward's statistics: per-thread sums, a block sum, two passes per
    block chunk, Chan merges of the chunks (the symmetric form of row_stats.cuh)."""
    f = np.float32
    parts = []
    for c0 in range(0, x.size, chunk):
        v = x[c0:c0 + chunk]
        s = f(0)
        for t in range(0, v.size, per_thread):
            s = f(s + v[t:t + per_thread].sum(dtype=f))
        mean = f(s / f(v.size))
        m2 = f(0)
        for t in range(0, v.size, per_thread):
            d = v[t:t + per_thread] - mean
            m2 = f(m2 + (d * d).sum(dtype=f))
        parts.append((f(v.size), mean, m2))
    acc = parts[0]
    for nb, mb, qb in parts[1:]:
        na, ma, qa = acc
        n = f(na + nb)
        inv = f(1) / n
        d = f(mb - ma)
        acc = (n, f((f(na * ma) + f(nb * mb)) * inv),
               f(f(qa + qb) + f(d * d) * f(f(na * nb) * inv)))
    return acc[1], acc[2] / acc[0]


def test_fp32_statistics_are_stable_far_from_zero(rng):
    x = (1e4 + rng.standard_normal(1 << 16)).astype(np.float32)
    x64 = x.astype(np.float64)
    mean, var = _model_stats(x, 4096, 16)
    assert abs(mean - x64.mean()) / x64.mean() < 1e-6
    assert abs(var / x64.var() - 1) < 1e-4
    naive = np.float32((x * x).mean(dtype=np.float32) - np.float32(x.mean(dtype=np.float32)) ** 2)
    assert abs(naive / x64.var() - 1) > 1e-2      # what E[x^2] - E[x]^2 would give


# ======================================================================= CPU: kernels, emulated

class _EmuKernel:
    """An emulated kernel with the attributes norms' planning reads. The ring and resident
    kernels, whose blocks wait for each other, run with every block at once (the emulator's
    concurrent schedule); the others, which keep static shared memory, block after block."""

    def __init__(self, inner):
        self.inner, self.name, self.ptr = inner, inner.name, 0

    def launch(self, grid, block, stream, *args, smem=0):
        emu.Device.concurrent = "_ring" in self.name or "_resident<" in self.name
        try:
            self.inner.launch(grid, block, stream, *args, smem=smem)
        finally:
            emu.Device.concurrent = False


class _EmuLoaded:
    def __init__(self, module):
        self.module = module

    def kernel(self, expr):
        from gpuops.ops import _layout as lay  # noqa: PLC0415   (patched by emu.Device)
        return _EmuKernel(lay.KernelTable(self.module).get(0, expr))


@pytest.fixture
def emulated(monkeypatch):
    """norms' launch path on the kernel emulator: a device of 2 SMs, 2 blocks each, tiny blocks
    (rows over 64 threads' worth are split; ring tiles of 64 threads), memsets done at once.
    Yields (device, launches): launches lists the kernel names run."""
    import ctypes  # noqa: PLC0415
    from types import SimpleNamespace  # noqa: PLC0415

    class _Runtime:
        @staticmethod
        def memsetAsync(ptr, value, nbytes, stream):  # noqa: N802
            ctypes.memset(ptr, value, nbytes)

    with emu.Device(sms=2) as dev:
        monkeypatch.setattr(N.loader, "load", lambda module, d: _EmuLoaded(module))
        monkeypatch.setattr(N.loader, "blocks_per_sm", lambda kernel, threads, smem=0: 2)
        monkeypatch.setattr(N.device, "device_info", lambda d: SimpleNamespace(
            sm_count=2, max_smem_per_block_optin=227 * 1024, cc=90))
        monkeypatch.setattr(N.device, "cupy_or_none", lambda: SimpleNamespace(
            cuda=SimpleNamespace(runtime=_Runtime)))
        monkeypatch.setattr(N, "_plans", {})
        monkeypatch.setattr(N, "_ring2_states", {})     # (buffers of this emulated device)
        monkeypatch.setattr(N, "_ring2_retired", [])
        monkeypatch.setattr(N, "FORCE_TWO_LAUNCHES", True)  # (one-launch split kernels: static
        yield dev                                           #  shared memory, not emulated)


def _small_blocks(monkeypatch):
    for name, kind in list(N.TUNING.items()):
        monkeypatch.setitem(N.TUNING, name, dataclasses.replace(
            kind, max_rows_threads=64, split_threads=64, ring_threads=64))


def _np_dtype(name):
    return dt.to_numpy(dt.BY_NAME[name])


def _emu_run(dev, op, dtype, *args, **kw):
    """registry impl of `op` on emulator arrays; NumPy results (float64 for the values)."""
    from gpuops import registry  # noqa: PLC0415
    call = dev.call(op, dt.BY_NAME[dtype])
    args = [dev.tensor(a) if isinstance(a, np.ndarray) else a for a in args]
    kw = {k: dev.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    out = registry.get(op).impl(call, *args, **kw)
    out = out if isinstance(out, tuple) else (out,)
    return [o.obj for o in out]


def _f64(a):
    return np.asarray(a).astype(np.float64)


def _emu_check_all(dev, x, w, b, r, dtype, what):
    """Every forward op (with and without statistics / affine params) against the references."""
    n = x.shape[-1]
    ns = (n,)
    y, mean, rstd = _emu_run(dev, "layer_norm_forward", dtype, x, ns, w, b, 1e-5)
    ry, rm, rr = N.ref_layer_norm_forward(_f64(x), ns, _f64(w), _f64(b), 1e-5)
    assert_close(_f64(y), ry, dtype, f"layer_norm {what}")
    assert_close(_f64(mean), rm, "float32", f"mean {what}")
    assert_close(_f64(rstd), rr, "float32", f"rstd {what}")
    (y,) = _emu_run(dev, "layer_norm", dtype, x, ns)             # no stats wanted, no affine
    assert_close(_f64(y), N.ref_layer_norm(_f64(x), ns), dtype, f"layer_norm plain {what}")
    y, rstd = _emu_run(dev, "rms_norm_forward", dtype, x, ns, w, 1e-6)
    ry, rr = N.ref_rms_norm_forward(_f64(x), ns, _f64(w), 1e-6)
    assert_close(_f64(y), ry, dtype, f"rms_norm {what}")
    assert_close(_f64(rstd), rr, "float32", f"rms rstd {what}")
    (y,) = _emu_run(dev, "rms_norm", dtype, x, ns, None, 1e-6)
    assert_close(_f64(y), N.ref_rms_norm(_f64(x), ns, None, 1e-6), dtype, f"rms plain {what}")
    y, h, rstd = _emu_run(dev, "add_rms_norm_forward", dtype, x, r, w, 1e-6)
    exact_h = (x.astype(np.float32) + r.astype(np.float32)).astype(x.dtype)
    assert np.array_equal(np.asarray(h).view(np.uint8), exact_h.view(np.uint8)), f"h {what}"
    ry, rr = N.ref_rms_norm_forward(_f64(exact_h), ns, _f64(w), 1e-6)
    assert_close(_f64(y), ry, dtype, f"add_rms_norm {what}")
    assert_close(_f64(rstd), rr, "float32", f"add rstd {what}")


def _ring_launches(x, dtype):
    """(ring launches, all launches) that _emu_check_all makes on x: an op whose ring plan
    breaks ring_grid's rule (too many tiles of a row per block: add_rms_norm's tiles are half
    as long) takes two launches instead."""
    d = dt.BY_NAME[dtype]
    vec = _vec_width_of(x, d)
    ring = total = 0
    for kind in ("layer_norm", "layer_norm", "rms_norm", "rms_norm", "add_rms_norm"):
        fits = N.ring_grid(N._ring_plan(kind, d, vec, x.shape[-1], 0), x.shape[0]) is not None
        ring += fits
        total += 1 if fits else 2
    return ring, total


def _vec_width_of(x, d):
    aligned = x.ctypes.data % 16 == 0 and (x.strides[0] % 16 == 0 or x.shape[0] == 1)
    return 16 // d.itemsize if aligned and x.shape[-1] % (16 // d.itemsize) == 0 else 1


def _emu_case(rng, shape, dtype, offset=0.5):
    npd = _np_dtype(dtype)
    n = shape[-1]
    x = (rng.standard_normal(shape) * 2.0 + offset).astype(npd)
    w = (rng.standard_normal(n) * 0.5 + 1.0).astype(npd)
    b = rng.standard_normal(n).astype(npd)
    r = rng.standard_normal(shape).astype(npd)
    return x, w, b, r


@needs_emu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("depth", [2, 3, 8])
@pytest.mark.parametrize("long_rows", ["ring", "ring2"])
def test_emulated_long_rows_ring(emulated, dtype, depth, long_rows, rng, monkeypatch):
    """Split rows on the ring (both exchanges), every block running at once and waiting for its
    rows: tiles of 64 threads; blocks holding more tiles than slots (the ring wraps: 13 x 5000),
    one tile of a row per block or several (3 x 20000: 3 per block, as many as the slots at
    depth 3), single elements (odd and unaligned rows)."""
    _small_blocks(monkeypatch)
    monkeypatch.setattr(N, "RING_MAX_DEPTH", depth)
    monkeypatch.setattr(N, "LONG_ROWS", long_rows)
    dev = emulated
    cases = [((13, 5000), "contig"), ((5, 3001), "contig"), ((4, 2056), "offset")]
    if depth > 2:
        cases.append(((3, 20000), "contig"))
    rings = 0
    for shape, layout in cases:
        x, w, b, r = _emu_case(rng, shape, dtype)
        x = emu.strided(x, layout)
        emu.Device.launches = []
        _emu_check_all(dev, x, w, b, r, dtype, f"{shape} {layout} depth {depth}")
        ring = [launch for launch in emu.Device.launches if f"_{long_rows}<" in launch[0]]
        assert (len(ring), len(emu.Device.launches)) == _ring_launches(x, dtype)
        assert all(launch[3] > N.RING_HEADER_BYTES for launch in ring)
        rings += len(ring)
    assert rings >= 3 * len(cases)


@needs_emu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("depth", [2, 3])
def test_emulated_long_rows_resident(emulated, dtype, depth, rng, monkeypatch):
    """LONG_ROWS = "resident" (norm_ring.cuh, resident_rows): every tile of a block held at once,
    copied in by cp.async (the emulator lands a copy only at the wait that covers it: a
    miscounted wait reads the slot's stale bytes), tile depth + 1 of a block in registers;
    blocks of uneven tile counts; padded rows (a row stride past n, 16-byte aligned); a last
    tile partly past the row's end. add_rms_norm (no resident kernel), unaligned rows and rows
    that do not fit on chip take "auto"'s plan."""
    _small_blocks(monkeypatch)
    monkeypatch.setattr(N, "RING_MAX_DEPTH", depth)
    monkeypatch.setattr(N, "LONG_ROWS", "resident")
    dev = emulated
    d = dt.BY_NAME[dtype]
    vec = 16 // d.itemsize
    tile = 64 * 4 * vec                 # elements of a tile: 64 threads x 4 packs of 16 bytes
    # (rows, tiles per row C, layout, fits): 4 x (depth + 1) tiles on the emulator's 4 blocks:
    # every block holds depth + 1 (one in registers); 5 x depth: uneven (e.g. 3, 3, 2, 2);
    # 2 x 2 (depth + 1): rows longer than the grid's stride (C > 4 blocks; run 110's "round 0
    # drained before round 1 lands" would deadlock there); 5 x (depth + 1):
    # too many; offset rows: single elements, no resident kernel
    for rows, C, layout, fits in ((4, depth + 1, "contig", True), (5, depth, "padded", True),
                                  (2, 2 * (depth + 1), "contig", True),
                                  (5, depth + 1, "contig", False), (4, depth + 1, "offset", False)):
        n = C * tile - 5 * vec          # the last tile ragged
        x, w, b, r = _emu_case(rng, (rows, n), dtype)
        if layout == "padded":
            wide = np.zeros((rows, n + 8 * vec), x.dtype)
            wide[:, :n] = x
            x = wide[:, :n]
        else:
            x = emu.strided(x, layout)
        ring = N._ring_plan("rms_norm", d, vec, n, 0, "resident")
        grid = N.ring_grid(ring, rows)
        assert (ring.C, ring.depth) == (C, depth)
        if layout != "offset":          # (offset rows run single elements: no resident kernel)
            assert (grid is not None) == fits
        if fits:
            per_block = -(-(rows * C) // grid)
            assert per_block == depth + 1                     # K = D + 1: a register tile
            assert (rows * C % grid != 0) == (rows == 5)      # uneven blocks
        emu.Device.launches = []
        _emu_check_all(dev, x, w, b, r, dtype, f"{(rows, n)} {layout} depth {depth}")
        resident = [launch for launch in emu.Device.launches if "_resident<" in launch[0]]
        assert len(resident) == (4 if fits else 0), (rows, layout)      # layer_norm, rms_norm x 2
        assert all(launch[3] == N.RING_HEADER_BYTES + depth * 64 * 4 * 16 for launch in resident)


def _ring2_state_words(dev_key=(0, 0)):
    """(launch counter and exit counter, the 64-bit words) of ring2's state buffer, as views."""
    buf, words = N._ring2_states[dev_key]
    raw = np.asarray(buf.obj).view(np.uint32)
    return raw[:N.RING2_HEADER_WORDS], raw[N.RING2_HEADER_WORDS:].view(np.uint64)[:words]


@needs_emu
def test_emulated_ring2_epochs(emulated, rng, monkeypatch):
    """ring2 keeps its epoch on the device (norm_ring.cuh): one launch counter step per launch,
    the exit counter back at 0 after each; repeated calls of one shape on new data (a word of
    the previous call, which carries the previous tag, would give the previous statistics),
    shapes that share the words, words left with every tag but this launch's (stale or never
    written) rejected, and the counter's wrap (tag 2^32 - 1, then 1, never 0)."""
    _small_blocks(monkeypatch)
    monkeypatch.setattr(N, "LONG_ROWS", "ring2")
    dev = emulated
    launches = 0

    def check(shape, what):
        nonlocal launches
        x, w, b, _ = _emu_case(rng, shape, "float32", offset=0.5 + 0.1 * launches)
        emu.Device.launches = []
        y, mean, rstd = _emu_run(dev, "layer_norm_forward", "float32", x, shape[-1], w, b, 1e-5)
        ry, rm, rr = N.ref_layer_norm_forward(_f64(x), shape[-1], _f64(w), _f64(b), 1e-5)
        assert_close(_f64(y), ry, "float32", f"layer_norm {what}")
        assert_close(_f64(mean), rm, "float32", f"mean {what}")
        assert_close(_f64(rstd), rr, "float32", f"rstd {what}")
        y, rstd = _emu_run(dev, "rms_norm_forward", "float32", x, shape[-1], w, 1e-6)
        ry, rr = N.ref_rms_norm_forward(_f64(x), shape[-1], _f64(w), 1e-6)
        assert_close(_f64(y), ry, "float32", f"rms {what}")
        assert_close(_f64(rstd), rr, "float32", f"rms rstd {what}")
        names = [name for name, *_ in emu.Device.launches]
        assert len(names) == 2 and all("_ring2<" in name for name in names), names
        launches += 2

    start = None
    for i, shape in enumerate([(2, 9000), (5, 3000), (5, 3000), (3, 5000), (5, 3000)]):
        check(shape, f"call {i} {shape}")
        head, _ = _ring2_state_words()
        if start is None:
            start = int(head[0]) - 2
        assert head[0] == start + launches and head[1] == 0, (i, head)
    assert start == 0                       # a new buffer: zeroed, first tag 1
    assert not N._ring2_retired              # (the first call allocated the most words)
    head, words = _ring2_state_words()
    nan_bits = np.uint64(np.float32(np.nan).view(np.uint32))
    for tag in (int(head[0]), int(head[0]) + 2, 0):   # the last launch's, a later one, never
        words[:] = (np.uint64(tag) << np.uint64(32)) | nan_bits
        check((5, 3000), f"words left with tag {tag}")
        head, words = _ring2_state_words()
    head[0] = 0xFFFFFFFE                    # this launch's tag: 2^32 - 1
    x, w, _, _ = _emu_case(rng, (5, 3000), "float32")
    (y,) = _emu_run(dev, "rms_norm", "float32", x, 3000, w, 1e-6)
    assert_close(_f64(y), N.ref_rms_norm(_f64(x), 3000, _f64(w), 1e-6), "float32", "tag 2^32-1")
    head, words = _ring2_state_words()
    assert head[0] == 0 and head[1] == 0     # next tag: 1
    words[:] = nan_bits                      # tag 0: never valid
    (y,) = _emu_run(dev, "rms_norm", "float32", x, 3000, w, 1e-6)
    assert_close(_f64(y), N.ref_rms_norm(_f64(x), 3000, _f64(w), 1e-6), "float32", "tag 1")
    head, _ = _ring2_state_words()
    assert head[0] == 1


@needs_emu
def test_emulated_ring_nan_rows_in_place_and_falls_back(emulated, rng, monkeypatch):
    _small_blocks(monkeypatch)
    dev = emulated
    x, w, b, r = _emu_case(rng, (6, 5000), "float32")
    x[1, 4000] = np.nan
    x[3, 7] = np.inf
    (y,) = _emu_run(dev, "layer_norm", "float32", x, 5000, w, b)
    assert_close(_f64(y), N.ref_layer_norm(_f64(x), 5000, _f64(w), _f64(b)), "float32", "NaN rows")
    assert np.isnan(y[[1, 3]]).all() and not np.isnan(y[[0, 2, 4, 5]]).any()
    xc = x.copy()
    (y,) = _emu_run(dev, "rms_norm", "float32", xc, 5000, w, 1e-6, out=xc)
    assert np.shares_memory(y, xc)
    assert_close(_f64(xc), N.ref_rms_norm(_f64(x), 5000, _f64(w), 1e-6), "float32", "in place")
    # 3 x 20000 at 2 slots: a block would hold 3 tiles of a row -> the two-launch plan
    monkeypatch.setattr(N, "RING_MAX_DEPTH", 2)
    x, w, b, r = _emu_case(rng, (3, 20000), "bfloat16")
    emu.Device.launches = []
    _emu_check_all(dev, x, w, b, r, "bfloat16", "(3, 20000) two launches")
    names = [name for name, *_ in emu.Device.launches]
    assert names and not any("_ring<" in name for name in names)
    assert all("_fwd<" in name for name in names) and len(names) == 2 * 5   # 5 ops, 2 each


# The kernel each WHOLE_ROWS option runs where it applies (else layer_norm_fwd).
WHOLE_ROWS_KERNELS = {"per_row": "layer_norm_fwd<", "two_pass": "layer_norm_two_pass<",
                      "compact": "layer_norm_compact<", "lean": "layer_norm_lean<",
                      "lean_two": "layer_norm_lean<"}


def _whole_rows_applies(option: str, vec: int, threads: int, ty: int, packs: int, C: int) -> bool:
    if option == "per_row" or vec == 1 or threads <= 32 or ty != 1 or C != 1:
        return False
    if option == "compact":
        return packs <= 2 and threads <= N.COMPACT_MAX_THREADS
    if option in ("lean", "lean_two"):
        return packs <= 2
    return True


def test_whole_rows_options_are_listed_and_checked(monkeypatch):
    assert set(WHOLE_ROWS_KERNELS) | {"auto"} == set(N.WHOLE_ROWS_PLANS)
    assert N.WHOLE_ROWS in N.WHOLE_ROWS_PLANS
    monkeypatch.setattr(N, "WHOLE_ROWS", "per-row")
    plan = N.Plan(None, (256, 1, 1), 2, 1, 1)
    with pytest.raises(ValueError, match="WHOLE_ROWS"):
        N._whole_rows_plan(plan, dt.bfloat16, 8, 0)


@needs_emu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("whole_rows", list(WHOLE_ROWS_KERNELS))
def test_emulated_whole_rows(emulated, dtype, whole_rows, rng, monkeypatch):
    """Rows in one block under every WHOLE_ROWS option (per_row: w and b loaded ahead, one
    exchange; two_pass: two block sums, w and b after them;
    compact: one block per row, raw x, one exchange, w and b after it), in one warp, odd rows of
    single elements; rows far from zero mean."""
    monkeypatch.setattr(N, "WHOLE_ROWS", whole_rows)
    monkeypatch.setattr(N, "DECODE_ROWS", False)         # (rms_norm's own decode kernel: below)
    dev = emulated
    chosen = 0
    marker = WHOLE_ROWS_KERNELS[whole_rows]
    for shape in ((5, 4096), (3, 4097), (33, 128), (9, 1000), (4, 24), (11, 2048), (1, 4096),
                  (3, 8192)):
        x, w, b, r = _emu_case(rng, shape, dtype)
        emu.Device.launches = []
        _emu_check_all(dev, x, w, b, r, dtype, f"{shape} {whole_rows}")
        names = [name for name, *_ in emu.Device.launches]
        option_kernels = [name for name in names if marker in name]
        if whole_rows != "per_row":
            assert len(option_kernels) + sum("_fwd<" in name for name in names) == len(names)
        # layer_norm and layer_norm_forward take the option's kernel where it applies
        vec = _vec_width_of(x, dt.BY_NAME[dtype])
        threads, ty, packs, C = N.plan_shape(N.TUNING["layer_norm"], vec, shape[-1])
        applies = _whole_rows_applies(whole_rows, vec, threads, ty, packs, C)
        if whole_rows != "per_row":
            assert len(option_kernels) == (2 if applies else 0), (shape, names)
            chosen += len(option_kernels)
        grids = [launch[1][0] for launch in emu.Device.launches if marker in launch[0]]
        if whole_rows != "per_row":
            assert all(g == shape[0] for g in grids), grids             # a block per row
    assert chosen >= (0 if whole_rows == "per_row" else 4)
    far = (rng.standard_normal((4, 4096)) + 300.0).astype(_np_dtype(dtype))
    y, mean, rstd = _emu_run(dev, "layer_norm_forward", dtype, far, 4096)
    _, rm, rr = N.ref_layer_norm_forward(_f64(far), 4096, None, None, 1e-5)
    assert_close(_f64(mean), rm, "float32", "mean of rows at 300")
    assert_close(_f64(rstd), rr, "float32", "rstd of rows at 300")


@needs_emu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", ["lean", "lean_two"])
def test_emulated_lean_full_rows_and_partial_affine(emulated, dtype, option, rng, monkeypatch):
    """layer_norm_lean: the bounds-free instance exactly where every thread's packs lie inside
    the row (else the checked one), w without b and b without w (a missing one reads the row in
    its place: never used), and in place (y = x, the row also read as the missing w); "lean"
    takes the one-exchange instance (shifted sums) in 16-bit at two packs per thread (both
    instances run), "lean_two", fp32 and one pack the two block sums. Rows at mean 3 (far from
    the shift of 0 that E[x^2] - E[x]^2 would be)."""
    monkeypatch.setattr(N, "WHOLE_ROWS", option)
    monkeypatch.setattr(N, "STREAM_ROWS", "off")
    monkeypatch.setattr(N, "DECODE_ROWS", False)
    dev = emulated
    d = dt.BY_NAME[dtype]
    kinds, exchanges = set(), set()
    for shape in ((5, 4096), (3, 2048), (6, 1024), (9, 1000), (4, 2056), (7, 520)):
        n = shape[-1]
        x, w, b, _ = _emu_case(rng, shape, dtype, offset=3.0)
        vec = _vec_width_of(x, d)
        threads, ty, packs, C = N.plan_shape(N.TUNING["layer_norm"], vec, n)
        if not _whole_rows_applies("lean", vec, threads, ty, packs, C):
            continue                                   # (e.g. fp32 4096: 4 packs)
        threads, packs = N.wide_rows_shape(threads, packs)   # (one pack: two in half the threads)
        full = n == vec * threads * packs
        kinds.add(full)
        exchanges.add(N.lean_one_exchange(option, d.itemsize, packs, threads))
        for wi, bi in ((w, None), (None, b), (w, b)):
            emu.Device.launches = []
            (y,) = _emu_run(dev, "layer_norm", dtype, x, (n,), wi, bi)
            names = [name for name, *_ in emu.Device.launches]
            assert len(names) == 1 and "layer_norm_lean<" in names[0], names
            one = N.lean_one_exchange(option, d.itemsize, packs, threads)
            assert names[0].replace(" ", "").endswith(
                f"{'true' if full else 'false'},{'true' if one else 'false'}>"), names
            ref = N.ref_layer_norm(_f64(x), (n,), None if wi is None else _f64(wi),
                                   None if bi is None else _f64(bi))
            assert_close(_f64(y), ref, dtype, f"lean {shape} w={wi is not None}")
        xc = x.copy()
        (y,) = _emu_run(dev, "layer_norm", dtype, xc, (n,), None, b, out=xc)
        assert np.shares_memory(y, xc)
        assert_close(_f64(xc), N.ref_layer_norm(_f64(x), (n,), None, _f64(b)), dtype,
                     f"lean in place {shape}")
    assert kinds == {False, True}, kinds              # both instances ran
    assert exchanges == ({False, True} if option == "lean" and d.itemsize == 2 else {False})


@needs_emu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_emulated_lean_shift_on_massive_values(emulated, dtype, rng, monkeypatch):
    """layer_norm_lean's one exchange (block_shifted_stats) where every warp's shift, its lane 0's
    first value, is a massive activation (1000 among N(0, 1) values, as LLMs' outlier channels):
    the shifted-data M2 of such a warp cancels ~510x its own size, i.e. ~510 * 2^-24 ~ 3e-5 of
    rstd per rounding of the sums (emulated: 3-5e-6); asserted: y to the dtype's tolerance, mean
    and rstd within 5e-5 relative, and the same rows through lean_two (two block sums) to fp32's."""
    monkeypatch.setattr(N, "STREAM_ROWS", "off")
    monkeypatch.setattr(N, "DECODE_ROWS", False)
    dev = emulated
    n = 4096
    x = rng.standard_normal((5, n))
    x[:, ::256] = 1000.0                  # every warp's first unit of 8 (bf16 / fp16: 16 bytes)
    x[2, ::256] = -1000.0
    x = x.astype(_np_dtype(dtype))
    w = (1.0 + 0.1 * rng.standard_normal(n)).astype(_np_dtype(dtype))
    b = (0.1 * rng.standard_normal(n)).astype(_np_dtype(dtype))
    ry, rm, rr = N.ref_layer_norm_forward(_f64(x), (n,), _f64(w), _f64(b), 1e-5)
    for option in ("lean", "lean_two"):
        monkeypatch.setattr(N, "WHOLE_ROWS", option)
        emu.Device.launches = []
        y, mean, rstd = _emu_run(dev, "layer_norm_forward", dtype, x, (n,), w, b, 1e-5)
        (name,) = [launch[0] for launch in emu.Device.launches]
        assert "layer_norm_lean<" in name and name.replace(" ", "").endswith(
            "true>" if option == "lean" else "false>"), name
        assert_close(_f64(y), ry, dtype, f"{option} massive shifts")
        if option == "lean":
            np.testing.assert_allclose(_f64(mean), rm, rtol=5e-5, err_msg="mean, lean")
            np.testing.assert_allclose(_f64(rstd), rr, rtol=5e-5, err_msg="rstd, lean")
        else:
            assert_close(_f64(mean), rm, "float32", "mean, lean_two")
            assert_close(_f64(rstd), rr, "float32", "rstd, lean_two")


@needs_emu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("team", [1, 2])
@pytest.mark.parametrize("depth", [2, 3, 8])
def test_emulated_stream_rows(emulated, dtype, team, depth, rng, monkeypatch):
    """STREAM_ROWS = "on" (norm_stream.cuh: a team of warps per row, rows landing in a ring of
    `depth` shared-memory stages by cp.async; the emulator lands a copy only at the wait that
    covers it, so a miscounted wait reads a stage's stale row; teams of 2 warps add their
    partials after a named barrier, the emulator's checks the count): 2 teams per block on the
    emulated 4 blocks, so teams walk several rows and the ring wraps (37 rows); fewer rows than
    teams (3); rows of one unit (fp32 n = 8: two, fewer than a team's lanes); rows of one warp's
    plan (24); rows padded past n (16-byte aligned stride); single elements (offset rows), and
    rows whose stages do not fit (fp32 4096 at depth 8), keep the per-block kernels."""
    monkeypatch.setattr(N, "STREAM_ROWS", "on")
    monkeypatch.setattr(N, "STREAM_TEAM", team)
    monkeypatch.setattr(N, "STREAM_TEAMS", 2)
    monkeypatch.setattr(N, "STREAM_DEPTH", depth)
    dev = emulated
    d = dt.BY_NAME[dtype]
    vec = 16 // d.itemsize
    kinds = ((2, 1), (2, 1), (1, 1), (1, 1), (1, 2))    # (params, sources) of _emu_check_all's ops
    for shape, layout in (((37, 1000), "contig"), ((3, 4096), "contig"), ((9, 8), "contig"),
                          ((6, 24), "contig"), ((7, 520), "padded"), ((5, 2056), "offset")):
        x, w, b, r = _emu_case(rng, shape, dtype)
        if layout == "padded":
            wide = np.zeros((shape[0], shape[1] + 3 * vec), x.dtype)
            wide[:, :shape[1]] = x
            x = wide[:, :shape[1]]
        else:
            x = emu.strided(x, layout)
        emu.Device.launches = []
        _emu_check_all(dev, x, w, b, r, dtype, f"{shape} {layout} stream {team} x 2 x {depth}")
        stream = [launch for launch in emu.Device.launches if "_stream<" in launch[0]]
        fits = [N.stream_smem(shape[1] // vec, p, src, team, 2, depth) <= 227 * 1024
                for p, src in kinds]
        streams = layout != "offset" and shape[1] % vec == 0
        assert len(stream) == (sum(fits) if streams else 0), (shape, layout)
        for name, grid, block, smem in ((lt[0], lt[1], lt[2], lt[3]) for lt in stream):
            assert block[0] == 64 * team and grid[0] == min(4, -(-shape[0] // 2)), (name, grid)
            p, src = (2, 1) if "layer_norm" in name else (1, 2 if "true>" in name else 1)
            assert smem == N.stream_smem(shape[1] // vec, p, src, team, 2, depth), name
    # in place: y over x (the rows ahead of each team are other rows)
    x, w, _, _ = _emu_case(rng, (11, 256), dtype)
    want = N.ref_rms_norm(_f64(x), (256,), _f64(w), 1e-6)
    xt = dev.tensor(x.copy())
    from gpuops import registry  # noqa: PLC0415
    registry.get("rms_norm").impl(dev.call("rms_norm", d), xt, (256,), dev.tensor(w), 1e-6,
                                  out=xt)
    assert_close(_f64(np.asarray(xt.obj)), want, dtype, "rms_norm stream in place")


@needs_emu
def test_emulated_stream_rows_auto(emulated, rng, monkeypatch):
    """STREAM_ROWS = "auto" takes the stream kernel from STREAM_MIN_ROWS rows per team of its
    grid on (its plan's teams on the emulated 4 blocks), never for rows of one warp's plan or on
    a device without cp.async (cc 75)."""
    monkeypatch.setattr(N, "STREAM_ROWS", "auto")
    monkeypatch.setattr(N, "STREAM_MIN_ROWS", 1)
    dev = emulated
    d = dt.bfloat16
    stream = N._stream_plan("layer_norm", N._plan("layer_norm", d, 8, 512, 0), d, 8, 512,
                            1 << 20, 0)
    full = stream.capacity * stream.teams
    for rows, n, cc, expected in ((full, 512, 90, True), (full - 1, 512, 90, False),
                                  (full, 512, 75, False), (400, 16, 90, False),
                                  (full, 1024, 90, False)):          # (1024: layer_norm_lean)
        monkeypatch.setattr(N.device, "device_info", lambda dv, cc=cc: types.SimpleNamespace(
            sm_count=2, max_smem_per_block_optin=227 * 1024, cc=cc))
        monkeypatch.setattr(N, "_plans", {})
        x, w, b, _ = _emu_case(rng, (rows, n), "bfloat16")
        emu.Device.launches = []
        (y,) = _emu_run(dev, "layer_norm", "bfloat16", x, (n,), w, b)
        ry, _, _ = N.ref_layer_norm_forward(_f64(x), (n,), _f64(w), _f64(b), 1e-5)
        assert_close(_f64(y), ry, "bfloat16", f"layer_norm auto {rows} x {n}")
        (name,) = [launch[0] for launch in emu.Device.launches]
        assert ("_stream<" in name) == expected, (rows, n, cc, name)


def test_stream_auto_and_rows_kernel_follow_the_measured_tables():
    """stream_auto_applies, lean_auto_applies and rows_kernel_applies: runs 156-168's fastest
    kernel per op, dtype and width (16-bit layer_norm streams but at 768-4096, where
    layer_norm_lean runs (768: run 186); fp32 streams below 384 and runs layer_norm_lean at
    384-2048 (runs 172, 187, 188); 16-bit rms_norm streams below 768 and takes rms_norm_rows from 768;
    fp32 rms_norm takes rms_norm_rows to 1024); add_rms_norm keeps rms_norm_fwd (its per-block
    kernel ran at 96-100% of copy) but for 16-bit rows of 384-1023 (runs 186, 188), fp32 rows
    of 256-384 (run 188) and rows of 1025-2048 (run 176), which take rms_norm_rows."""
    stream, rows, lean = N.stream_auto_applies, N.rows_kernel_applies, N.lean_auto_applies
    widths = (256, 512, 760, 768, 1016, 1024, 1032, 2048, 4096, 4104, 5120, 8192)
    assert [stream("layer_norm", 2, n) for n in widths] == [
        True, True, True, False, False, False, False, False, False, True, True, True]
    assert [lean(2, n) for n in widths] == [
        False, False, False, True, True, True, True, True, True, False, False, False]
    assert [lean(4, n) for n in widths] == [
        False, True, True, True, True, True, True, True, False, False, False, False]
    assert [stream("layer_norm", 4, n) for n in (256, 376, 384, 512, 768, 1024, 2048, 4096)] == [
        True, True, False, False, False, False, False, False]
    assert [lean(4, n) for n in (256, 376, 384, 504)] == [False, False, True, True]
    assert [stream("rms_norm", 2, n) for n in (512, 760, 768, 1016, 1024, 2048, 4096)] == [
        True, True, False, False, False, False, False]
    assert [rows("rms_norm", 2, n) for n in (512, 760, 768, 1016, 1024, 2048, 4096, 8192)] == [
        False, False, True, True, True, True, True, True]
    assert [rows("rms_norm", 4, n) for n in (1024, 2048, 4096)] == [True, False, False]
    assert not stream("rms_norm", 4, 1024)
    assert not any(stream("add_rms_norm", i, n) or rows("add_rms_norm", i, n)
                   or rows("layer_norm", i, n) for i in (2, 4) for n in (1024, 4096))
    assert all(rows("add_rms_norm", i, n) for i in (2, 4) for n in (1032, 2048))   # (run 176)
    assert [rows("add_rms_norm", 2, n) for n in (256, 376, 384, 504, 512, 768, 1016)] == [
        False, False, True, True, True, True, True]                         # (runs 186, 188)
    assert [rows("add_rms_norm", 4, n) for n in (128, 248, 256, 384, 392, 512, 768, 1016)] == [
        False, False, True, True, False, False, False, False]                      # (run 188)


def test_stream_config_fills_shared_memory_to_the_aims():
    """stream_config on an H100/H200-like SM (227 KiB per block, 228 KiB and 64 warps per SM):
    16-bit layer_norm at 4096 takes teams of 4 warps, 4 per block, 3 stages, 2 blocks per SM
    (128 KiB in flight, 32 warps per SM); fp32 one such block; fp32 add_rms_norm (two rows per
    stage) 2 teams of 4; small rows keep a warp per row; rows too long for two stages: None."""
    def per_sm(threads, smem):
        return min(228 * 1024 // (smem + 1024), 2048 // threads, 32)
    limit = 227 * 1024
    assert N.stream_config(512, 2, 1, limit, per_sm) == (4, 4, 3, 114816, 2)   # bf16 layer_norm
    assert N.stream_config(1024, 2, 1, limit, per_sm)[:3] == (4, 4, 3)          # fp32 layer_norm
    assert N.stream_config(1024, 1, 2, limit, per_sm)[:3] == (4, 2, 3)          # fp32 add
    team, teams, depth, smem, blocks = N.stream_config(128, 2, 1, limit, per_sm)  # 2 KB rows
    assert team == 1 and blocks * teams * (depth - 1) * 2048 >= N.STREAM_INFLIGHT
    assert blocks * teams * team >= 16 and smem <= limit
    assert N.stream_config(8192, 2, 1, limit, per_sm) is None                   # 128 KB rows
    assert N.stream_smem(512, 2, 1, 4, 4, 3) == 16 * 512 * 14 + 128            # + partials


@needs_emu
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_whole_rows_auto(emulated, dtype, rng, monkeypatch):
    """WHOLE_ROWS = "auto": layer_norm_two_pass where the rows fit in one wave of its blocks (the
    emulated device holds 4), else layer_norm_lean where lean_auto_applies (16-bit rows of
    768-4096, fp32 1024-2048), else two_pass for fp32, else layer_norm_compact where that
    applies, else layer_norm_fwd."""
    monkeypatch.setattr(N, "WHOLE_ROWS", "auto")
    monkeypatch.setattr(N, "STREAM_ROWS", "off")
    dev = emulated
    seen = set()
    for shape in ((3, 4096), (4, 2048), (5, 2048), (9, 4096), (2, 4097), (6, 64), (7, 1000),
                  (8, 520)):
        x, w, b, r = _emu_case(rng, shape, dtype)
        emu.Device.launches = []
        (y,) = _emu_run(dev, "layer_norm", dtype, x, (shape[-1],), w, b)
        ry, _, _ = N.ref_layer_norm_forward(_f64(x), (shape[-1],), _f64(w), _f64(b), 1e-5)
        assert_close(_f64(y), ry, dtype, f"layer_norm {shape} auto")
        (name,) = [launch[0] for launch in emu.Device.launches]
        vec = _vec_width_of(x, dt.BY_NAME[dtype])
        threads, ty, packs, C = N.plan_shape(N.TUNING["layer_norm"], vec, shape[-1])
        if not _whole_rows_applies("two_pass", vec, threads, ty, packs, C):
            expected = "layer_norm_fwd<"
        elif shape[0] <= 4:
            expected = "layer_norm_two_pass<"
        elif (N.lean_auto_applies(x.dtype.itemsize, shape[-1])
              and _whole_rows_applies("lean", vec, threads, ty, packs, C)):
            expected = "layer_norm_lean<"
        elif dtype == "float32":
            expected = "layer_norm_two_pass<"
        elif _whole_rows_applies("compact", vec, threads, ty, packs, C):
            expected = "layer_norm_compact<"
        else:
            expected = "layer_norm_fwd<"
        assert expected in name, (shape, name)
        seen.add(expected)
    assert seen == ({"layer_norm_two_pass<", "layer_norm_lean<", "layer_norm_fwd<"}
                    if dtype == "float32" else
                    {"layer_norm_two_pass<", "layer_norm_lean<", "layer_norm_compact<",
                     "layer_norm_fwd<"})


@needs_emu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1000, 1024, 2048])
def test_emulated_wide_rows_past_one_wave(emulated, dtype, n, rng, monkeypatch):
    """WIDE_ROWS: layer_norm_lean (which "auto" runs only past one wave) and rms_norm_rows past
    one wave (9 rows on the emulated 4 blocks) take two packs per thread in half the plan's
    threads where the plan gives one pack to 128+ threads (fp32 1024: 128 x 2 instead of
    256 x 1; 16-bit 1024: 64 x 2 instead of 128 x 1; 16-bit 2048: 128 x 2; rows of 1000: the
    same shapes with the last packs past the row); rms_norm_rows' one-wave instance keeps the
    plan's shape; every shape gives the float64 reference."""
    monkeypatch.setattr(N, "STREAM_ROWS", "off")
    monkeypatch.setattr(N, "ROWS_MAX_WAVES", None)
    monkeypatch.setattr(N, "WHOLE_ROWS", "lean")
    dev = emulated
    d = dt.BY_NAME[dtype]
    threads, _, packs, _ = N.plan_shape(N.TUNING["layer_norm"], 16 // d.itemsize, n)
    if packs != 1:
        pytest.skip(f"{dtype} rows of {n}: the plan has {packs} packs per thread already")
    assert threads in (128, 256)
    for wide, rows in ((True, 9), (False, 9), (True, 3)):
        monkeypatch.setattr(N, "WIDE_ROWS", wide)
        x, w, b, _ = _emu_case(rng, (rows, n), dtype)
        emu.Device.launches = []
        (y,) = _emu_run(dev, "layer_norm", dtype, x, (n,), w, b)
        (r,) = _emu_run(dev, "rms_norm", dtype, x, (n,), w, 1e-6)
        (ln, rms) = emu.Device.launches
        assert "layer_norm_lean<" in ln[0] and "rms_norm_rows<" in rms[0], (ln, rms)
        for (name, _, block, _), widened in ((ln, wide), (rms, wide and rows > 4)):
            got = (block[0], int(name.replace(" ", "").split(",")[2]))
            assert got == ((threads // 2, 2) if widened else (threads, 1)), (wide, rows, name)
        ry, _, _ = N.ref_layer_norm_forward(_f64(x), (n,), _f64(w), _f64(b), 1e-5)
        assert_close(_f64(y), ry, dtype, f"layer_norm_lean wide={wide} {rows} x {n}")
        assert_close(_f64(r), N.ref_rms_norm(_f64(x), (n,), _f64(w), 1e-6), dtype,
                     f"rms_norm_rows wide={wide} {rows} x {n}")


@needs_emu
def test_emulated_rows_kernel_triggers_only_in_one_wave(emulated, rng, monkeypatch):
    """rms_norm_rows: the instance with PDL's trigger for grids of one wave (decode-sized calls),
    the one without it past that (common/pdl.cuh pdl_start_untriggered: a trigger's code cost
    grids of many waves 1-5%); both give the reference."""
    monkeypatch.setattr(N, "ROWS_MAX_WAVES", None)
    dev = emulated
    d = dt.bfloat16
    plan = N._plan("rms_norm", d, 8, 2048, 0)
    one = N._decode_rows_plan("rms_norm", plan, d, 8, 1, 0)
    cap = one.capacity
    assert one.kernel.name.replace(" ", "").endswith("false,true>"), one.kernel.name
    assert N._decode_rows_plan("rms_norm", plan, d, 8, cap, 0) is one
    many = N._decode_rows_plan("rms_norm", plan, d, 8, cap + 1, 0)
    assert many.kernel.name.replace(" ", "").endswith("false,false>"), many.kernel.name
    for rows, trigger in ((cap, "true>"), (cap + 1, "false>")):
        x, w, _, _ = _emu_case(rng, (rows, 2048), "bfloat16")
        emu.Device.launches = []
        (y,) = _emu_run(dev, "rms_norm", "bfloat16", x, (2048,), w, 1e-6)
        (name,) = [launch[0] for launch in emu.Device.launches]
        assert "rms_norm_rows<" in name and name.endswith(trigger), name
        assert_close(_f64(y), N.ref_rms_norm(_f64(x), (2048,), _f64(w), 1e-6), "bfloat16",
                     f"rms_norm_rows {rows} rows")


@needs_emu
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_decode_rows_equal_rms_norm_fwd(emulated, dtype, rng, monkeypatch):
    """rms_norm_rows (DECODE_ROWS: whole rows of a one-wave grid on 16-byte units, w loaded with
    x) gives rms_norm_fwd's bits for rms_norm / add_rms_norm (y, h, rstd), with and without a
    weight; single elements and rows past one wave (4 blocks here) keep rms_norm_fwd
    (ROWS_MAX_WAVES 1: the decode rule)."""
    monkeypatch.setattr(N, "ROWS_MAX_WAVES", 1)
    dev = emulated
    for shape in ((3, 2048), (4, 1000), (2, 1001), (1, 64), (6, 2048)):
        x, w, _, r = _emu_case(rng, shape, dtype)
        ns = (shape[-1],)
        got = {}
        for rows_kernel in (True, False):
            monkeypatch.setattr(N, "DECODE_ROWS", rows_kernel)
            emu.Device.launches = []
            got[rows_kernel] = (_emu_run(dev, "rms_norm_forward", dtype, x, ns, w, 1e-6)
                                + _emu_run(dev, "rms_norm", dtype, x, ns, None, 1e-6)
                                + _emu_run(dev, "add_rms_norm_forward", dtype, x, r, w, 1e-6))
            names = [launch[0] for launch in emu.Device.launches]
            vec = _vec_width_of(x, dt.BY_NAME[dtype])
            threads, ty, _, C = N.plan_shape(N.TUNING["rms_norm"], vec, shape[-1])
            lean = (rows_kernel and shape[0] <= 4 and vec > 1 and ty == 1 and threads > 32
                    and C == 1)
            assert all(("rms_norm_rows<" in n) == lean for n in names), (shape, names)
        for a, b in zip(got[True], got[False]):
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), shape
        ry, rr = N.ref_rms_norm_forward(_f64(x), ns, _f64(w), 1e-6)
        assert_close(_f64(got[True][0]), ry, dtype, f"rms_norm_rows {shape}")


@needs_emu
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_rows_kernel_at_every_row_count(emulated, dtype, rng, monkeypatch):
    """ROWS_MAX_WAVES = None: rms_norm_rows (a block per row, w loaded with x) past one wave of
    its blocks too (9 rows on the emulated 4 blocks), bit-equal to rms_norm_fwd (y, h, rstd) at
    the plan's shape (WIDE_ROWS off: two packs per thread sum in another order)."""
    monkeypatch.setattr(N, "WIDE_ROWS", False)
    dev = emulated
    x, w, _, r = _emu_case(rng, (9, 2048), dtype)
    got = {}
    for waves in (None, 1):
        monkeypatch.setattr(N, "ROWS_MAX_WAVES", waves)
        emu.Device.launches = []
        got[waves] = (_emu_run(dev, "rms_norm_forward", dtype, x, (2048,), w, 1e-6)
                      + _emu_run(dev, "add_rms_norm_forward", dtype, x, r, w, 1e-6))
        names = [launch[0] for launch in emu.Device.launches]
        assert all(("rms_norm_rows<" in n) == (waves is None) for n in names), names
    for a, b in zip(got[None], got[1]):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    # "auto": rms_norm_rows past one wave where rows_kernel_applies (rms_norm 16-bit from 1024,
    # fp32 to 1024; add_rms_norm above 1024 to 2048), rms_norm_fwd elsewhere
    monkeypatch.setattr(N, "ROWS_MAX_WAVES", "auto")
    monkeypatch.setattr(N, "STREAM_ROWS", "off")
    for n in (1024, 2048):
        x, w, _, r = _emu_case(rng, (9, n), dtype)
        emu.Device.launches = []
        _emu_run(dev, "rms_norm", dtype, x, (n,), w, 1e-6)
        _emu_run(dev, "add_rms_norm", dtype, x, r, w, 1e-6)
        (rms, add) = [launch[0] for launch in emu.Device.launches]
        assert ("rms_norm_rows<" in rms) == N.rows_kernel_applies(
            "rms_norm", dt.BY_NAME[dtype].itemsize, n), (n, rms)
        assert ("rms_norm_rows<" in add) == N.rows_kernel_applies(
            "add_rms_norm", dt.BY_NAME[dtype].itemsize, n), (n, add)


def _emu_backward_all(dev, x, w, r, dtype, what):
    """Every backward op on x (stats from the float64 references) against the references; dx
    tolerances scale with the magnitudes of its terms (they cancel), dw / db with sum |terms|."""
    n = x.shape[-1]
    ns = (n,)
    x64 = _f64(x)
    dy = (0.5 * x64 + 1.0 + 0.3 * np.random.default_rng(n).standard_normal(x.shape)).astype(x.dtype)
    _, mean, rstd = N.ref_layer_norm_forward(x64, ns, None, None, 1e-5)
    mean, rstd = mean.astype(np.float32), rstd.astype(np.float32)
    dx, dw, db = _emu_run(dev, "layer_norm_backward", dtype, dy, x, mean, rstd, ns, w)
    rx, rw, rb = N.ref_layer_norm_backward(_f64(dy), x64, _f64(mean), _f64(rstd), ns, _f64(w))
    xhat = (x64 - mean[:, None]) * rstd[:, None]
    gw = _f64(dy) * _f64(w)
    terms = np.abs(rstd[:, None]) * (np.abs(gw) + np.abs(gw).mean(1, keepdims=True)
                                     + np.abs(xhat) * np.abs(gw * xhat).mean(1, keepdims=True))
    assert_close(_f64(dx), rx, dtype, f"layer_norm dx {what}", scale=terms)
    rows_err = (x.shape[0] + 19) * 2.0 ** -24
    assert_close(_f64(dw), rw, dtype, f"layer_norm dw {what}",
                 scale=np.abs(_f64(dy) * xhat).sum(0) * (1 + rows_err))
    assert_close(_f64(db), rb, dtype, f"layer_norm db {what}", scale=np.abs(_f64(dy)).sum(0))
    _, rstd = N.ref_rms_norm_forward(x64, ns, None, 1e-6)
    rstd = rstd.astype(np.float32)
    xhat = x64 * rstd[:, None]
    terms = np.abs(rstd[:, None]) * (np.abs(gw) + np.abs(xhat) * np.abs(gw * xhat).mean(
        1, keepdims=True))
    dx, dw = _emu_run(dev, "rms_norm_backward", dtype, dy, x, rstd, ns, w)
    rx, rw = N.ref_rms_norm_backward(_f64(dy), x64, _f64(rstd), ns, _f64(w))
    assert_close(_f64(dx), rx, dtype, f"rms_norm dx {what}", scale=terms)
    assert_close(_f64(dw), rw, dtype, f"rms_norm dw {what}",
                 scale=np.abs(_f64(dy) * xhat).sum(0))
    dx, dw = _emu_run(dev, "add_rms_norm_backward", dtype, dy, r, x, rstd, w)
    rx, rw = N.ref_add_rms_norm_backward(_f64(dy), _f64(r), x64, _f64(rstd), _f64(w))
    assert_close(_f64(dx), rx, dtype, f"add_rms_norm dx {what}", scale=terms + np.abs(_f64(r)))
    assert_close(_f64(dw), rw, dtype, f"add_rms_norm dw {what}",
                 scale=np.abs(_f64(dy) * xhat).sum(0))


@needs_emu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plan", N.BACKWARD_LONG_ROWS_PLANS)
def test_emulated_backward_long_rows(emulated, dtype, plan, rng, monkeypatch):
    """The backward's split rows (blocks of 64 threads: rows over 64 units split) under both
    BACKWARD_LONG_ROWS plans. columns on a device of 4 blocks: blocks taking 2 chunks each
    (37 x 10000), one chunk each with 2 groups of rows and the [groups, n] workspace (9 x 4096 /
    2048), single elements (3 x 3001); split: kPartials then kApply."""
    monkeypatch.setattr(N, "BACKWARD_LONG_ROWS", plan)
    _small_blocks(monkeypatch)
    dev = emulated
    shapes = ((37, 10000), (9, 2048 if dtype == "float32" else 4096), (3, 3001))
    for shape in shapes:
        x, w, _, r = _emu_case(rng, shape, dtype)
        emu.Device.launches = []
        _emu_backward_all(dev, x, w, r, dtype, f"{shape} {plan}")
        names = [launch[0] for launch in emu.Device.launches]
        stats = [launch for launch in emu.Device.launches if "norm_bwd_cols_stats" in launch[0]]
        assert len(stats) == (3 if plan == "columns" else 0), names
        assert all(("norm_bwd<" in name) == (plan == "split") for name in names
                   if "norm_weight_grad" not in name), names
        if plan == "columns":
            vec = _vec_width_of(x, dt.BY_NAME[dtype])
            chunks, grid_x, groups, rpg = N.cols_grid(shape[-1] // vec, shape[0], 4)
            assert all(launch[1][:2] == (grid_x, groups) for launch in stats), stats
            assert sum("norm_weight_grad" in name for name in names) == (3 if groups > 1 else 0)
            if shape[0] == 37:
                assert grid_x < chunks                  # blocks walking several chunks
            if shape[0] == 9:
                assert groups == 2


# ============================================================================ autograd, compile

@needs_torch
def test_autograd_cpu_float64_matches_torch():
    import gpuops.torch as gt
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    r = torch.randn(3, 5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    dy, dh = torch.randn(2, 3, 5, 6, dtype=torch.float64, generator=g)
    cases = [
        (lambda: gt.layer_norm(x, (5, 6), w, b), lambda: F.layer_norm(x, (5, 6), w, b), (x, w, b)),
        (lambda: gt.layer_norm(x, 6), lambda: F.layer_norm(x, (6,)), (x,)),
        (lambda: gt.rms_norm(x, [6], w[0]), lambda: F.rms_norm(x, [6], w[0]), (x, w)),
        (lambda: gt.rms_norm(x, (5, 6), None, 1e-3), lambda: F.rms_norm(x, (5, 6), None, 1e-3),
         (x,)),
    ]
    for ours, theirs, leaves in cases:
        a, e = ours(), theirs()
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
        for ga, ge in zip(torch.autograd.grad(a, leaves, dy), torch.autograd.grad(e, leaves, dy)):
            torch.testing.assert_close(ga, ge, rtol=1e-10, atol=1e-12)
    y, h = gt.add_rms_norm(x, r, w[1], 1e-6)
    hh = x + r
    yy = F.rms_norm(hh, [6], w[1], 1e-6)
    torch.testing.assert_close(h, hh, rtol=0, atol=0)
    for ga, ge in zip(torch.autograd.grad((y, h), (x, r, w), (dy, dh)),
                      torch.autograd.grad((yy, hh), (x, r, w), (dy, dh))):
        torch.testing.assert_close(ga, ge, rtol=1e-10, atol=1e-12)
    # only the normalized output used: no gradient arrives for the residual output
    ga = torch.autograd.grad(gt.add_rms_norm(x, r, w[1])[0].sum(), (x, r))
    ge = torch.autograd.grad(F.rms_norm(x + r, [6], w[1], 1e-6).sum(), (x, r))
    torch.testing.assert_close(ga, ge, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, w, b: gt.layer_norm(x, 6, w, b),
                                    (x[0].detach().requires_grad_(), w[0], b[0]))


def _compile_case(device, dtype):
    import gpuops.torch as gt

    def step(x, r, w, b):
        y = gt.layer_norm(x, x.shape[-1:], w, b)
        z = gt.rms_norm(y, [x.shape[-1]], w)
        a, h = gt.add_rms_norm(z, r, w, 1e-6)
        return (a.float() * h.float()).sum()

    def eager(x, r, w, b):
        y = F.layer_norm(x, x.shape[-1:], w, b)
        z = F.rms_norm(y, [x.shape[-1]], w)
        h = z + r
        return (F.rms_norm(h, [x.shape[-1]], w, 1e-6).float() * h.float()).sum()
    g = torch.Generator(device=device).manual_seed(1)
    def mk(*s):
        return torch.randn(*s, device=device, dtype=dtype, generator=g).requires_grad_()
    args = (mk(4, 64), mk(4, 64), mk(64), mk(64))
    return step, eager, args


@needs_torch
def test_torch_compile_fullgraph_cpu():
    step, eager, args = _compile_case("cpu", torch.float64)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(*args)
    torch.testing.assert_close(out, eager(*args), rtol=1e-10, atol=1e-10)
    for ga, ge in zip(torch.autograd.grad(out, args), torch.autograd.grad(eager(*args), args)):
        torch.testing.assert_close(ga, ge, rtol=1e-9, atol=1e-10)


# ============================================================================ GPU

def _randn(shape, dtype, scale=1.0, offset=0.0):
    return (torch.randn(shape, device="cuda") * scale + offset).to(getattr(torch, dtype))


def _np(t):
    return t.double().cpu().numpy()


# (rows, n): one element; one warp per row (scalar and packs); the 4096 target; odd 4097 (one
# block of elements); rows split over blocks (20000: 5 blocks of packs; 70001: elements).
SHAPES = [(5, 1), (7, 3), (33, 128), (9, 1000), (33, 4096), (3, 4097), (4, 20000), (2, 70001)]
LONG = [(2, 1 << 20), (3, 262147)]


def _ln_case(shape, dtype, affine=True):
    n = shape[-1]
    x = _randn(shape, dtype, 2.0, 0.5)
    w = _randn((n,), dtype, 0.5, 1.0) if affine else None
    b = _randn((n,), dtype) if affine else None
    return x, w, b


def _check_ln(x, w, b, dtype, what, ns=None, out=None):
    ns = ns or (x.shape[-1],)
    y, mean, rstd = go.layer_norm_forward(x, ns, w, b, 1e-5)
    ry, rm, rr = N.ref_layer_norm_forward(_np(x), ns, None if w is None else _np(w),
                                          None if b is None else _np(b), 1e-5)
    assert mean.dtype == rstd.dtype == torch.float32 and y.dtype == x.dtype
    assert_close(_np(y), ry, dtype, f"layer_norm {what}")
    assert_close(_np(mean), rm, "float32", f"mean {what}")
    assert_close(_np(rstd), rr, "float32", f"rstd {what}")
    y2 = go.layer_norm(x, ns, w, b, 1e-5, **({} if out is None else {"out": out}))
    assert torch.equal(y2, y) or (torch.isnan(y2) == torch.isnan(y)).all()
    return y, mean, rstd


def _check_rms(x, w, dtype, what, ns=None, eps=1e-6):
    ns = ns or (x.shape[-1],)
    y, rstd = go.rms_norm_forward(x, ns, w, eps)
    ry, rr = N.ref_rms_norm_forward(_np(x), ns, None if w is None else _np(w),
                                    EPS[dtype] if eps is None else eps)
    assert_close(_np(y), ry, dtype, f"rms_norm {what}")
    assert_close(_np(rstd), rr, "float32", f"rstd {what}")
    assert torch.equal(go.rms_norm(x, ns, w, eps), y)
    return y, rstd


def _check_add(x, r, w, dtype, what):
    y, h, rstd = go.add_rms_norm_forward(x, r, w, 1e-6)
    assert torch.equal(h, x + r), f"residual {what}: not torch's x + r"
    ry, rr = N.ref_rms_norm_forward(_np(h), w.shape, _np(w), 1e-6)   # statistics of h as stored
    assert_close(_np(y), ry, dtype, f"add_rms_norm {what}")
    assert_close(_np(rstd), rr, "float32", f"rstd {what}")
    y1, h1 = go.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(y1, y) and torch.equal(h1, h)
    return y, h, rstd


def _grad_like(x, scale=0.3):
    # correlated with x: weight gradients without cancellation, so that elementwise tolerances
    # measure the kernels rather than the conditioning of the sums
    return (0.5 * x.float() + 1.0 + scale * torch.randn_like(x, dtype=torch.float32)).to(x.dtype)


def _assert_column_sum(got, ref, abs_terms, dtype, what):
    """grad_weight / grad_bias: sums over the rows of terms whose absolute values abs_terms
    ([rows, ...]) may cancel. Error analysis of the kernels' fp32 order: a term is
    dy * xhat with xhat = fl(fl(x - mean) * rstd) (relative error <= 2u, u = 2^-24), fused into its
    slot's accumulator (one rounding per add); a slot sums ceil(rows / slots) rows,
    norm_weight_grad ceil(slots / 16) slots per lane, then its 16 lanes in sequence: at most
    rows + 17 roundings of partial sums for any number of slots. So |err| <= (rows + 19) u
    sum|terms| (first order), on top of conftest's bound for the output's rounding. conftest's
    rtol * |ref| alone assumes |ref| ~ sum|terms|, which _grad_like's dy gives; an uncorrelated
    dy (an expanded scalar: dw = sum of xhat over the rows) cancels, and a replay of this
    order on the CPU ([40, 4096], 200 runs) exceeded it in 17% of runs, by up to
    2.9 u sum|terms|: the native run passed and the compute_61 one failed by that chance alone."""
    tol = TOLERANCE[dtype]
    rows = abs_terms.shape[0]
    err = np.abs(got - ref)
    bound = (tol["atol"] + tol["rtol"] * np.abs(ref)
             + (rows + 19) * 2.0 ** -24 * abs_terms.sum(axis=0))
    assert np.all(err <= bound), (
        f"{what}: {int(np.sum(err > bound))} of {err.size} elements off; worst "
        f"{float(np.max(err - bound)):.3g} over the bound")


def _check_ln_bwd(x, w, mean, rstd, dtype, what, dy=None, ns=None):
    ns = ns or (x.shape[-1],)
    dy = _grad_like(x) if dy is None else dy
    dx, dw, db = go.layer_norm_backward(dy, x, mean, rstd, ns, w)
    rx, rw, rb = N.ref_layer_norm_backward(_np(dy), _np(x), _np(mean), _np(rstd), ns,
                                           None if w is None else _np(w))
    assert dx.dtype == dw.dtype == db.dtype == x.dtype
    assert_close(_np(dx), rx, dtype, f"layer_norm grad_input {what}")
    lead = x.shape[:x.ndim - len(ns)]
    bshape = tuple(lead) + (1,) * len(ns)
    xhat = (_np(x) - _np(mean).reshape(bshape)) * _np(rstd).reshape(bshape)
    g = _np(dy).reshape((-1,) + tuple(ns))
    _assert_column_sum(_np(dw), rw, np.abs(g * xhat.reshape(g.shape)), dtype,
                       f"layer_norm grad_weight {what}")
    _assert_column_sum(_np(db), rb, np.abs(g), dtype, f"layer_norm grad_bias {what}")
    return dx, dw, db


def _rms_dx_terms(dy, h, rstd, w, k=1, dh=None):
    """Per element, the magnitudes of the terms of the rms_norm input gradient, dx = rstd w dy
    - h rstd^3 mean(w dy h) (+ dh): what dx's rounding scales with. They cancel where h^2
    rstd^2 is near 1 (e.g. rows of one element: dx = rstd w dy eps / (h^2 + eps)), so there dx
    is far smaller than its terms and a tolerance relative to dx alone does not hold."""
    dy, h, rstd = _np(dy), _np(h), _np(rstd).reshape(_np(rstd).shape + (1,) * k)
    wdy = dy * (1.0 if w is None else _np(w))
    axes = tuple(range(h.ndim - k, h.ndim))
    terms = np.abs(rstd * wdy) + np.abs(h) * rstd ** 3 * np.abs(wdy * h).mean(axes, keepdims=True)
    return terms if dh is None else terms + np.abs(_np(dh))


def _check_rms_bwd(x, w, rstd, dtype, what, ns=None):
    ns = ns or (x.shape[-1],)
    dy = _grad_like(x)
    dx, dw = go.rms_norm_backward(dy, x, rstd, ns, w)
    rx, rw, _ = N._ref_backward("t", False, _np(dy), _np(x), None, _np(rstd), ns,
                                None if w is None else _np(w))
    assert_close(_np(dx), rx, dtype, f"rms_norm grad_input {what}",
                 scale=_rms_dx_terms(dy, x, rstd, w, len(ns)))
    assert_close(_np(dw), rw, dtype, f"rms_norm grad_weight {what}")
    return dx, dw


def _check_add_bwd(h, w, rstd, dtype, what, with_residual_grad=True):
    dy = _grad_like(h)
    dh = _randn(h.shape, dtype) if with_residual_grad else None
    dx, dw = go.add_rms_norm_backward(dy, dh, h, rstd, w)
    rx, rw = N.ref_add_rms_norm_backward(_np(dy), None if dh is None else _np(dh), _np(h),
                                         _np(rstd), _np(w))
    assert_close(_np(dx), rx, dtype, f"add_rms_norm grad_input {what}",
                 scale=_rms_dx_terms(dy, h, rstd, w, 1, dh))
    assert_close(_np(dw), rw, dtype, f"add_rms_norm grad_weight {what}")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + LONG, ids=lambda s: "x".join(map(str, s)))
def test_gpu_forward_and_backward(shape, dtype):
    x, w, b = _ln_case(shape, dtype)
    what = f"{shape} {dtype}"
    _, mean, rstd = _check_ln(x, w, b, dtype, what)
    _check_ln_bwd(x, w, mean, rstd, dtype, what)
    _, rstd = _check_rms(x, w, dtype, what)
    _check_rms_bwd(x, w, rstd, dtype, what)
    r = _randn(shape, dtype)
    _, h, rstd = _check_add(x, r, w, dtype, what)
    _check_add_bwd(h, w, rstd, dtype, what)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("long_rows", ["split", "ring"])
def test_gpu_split_rows_in_two_launches_and_small_blocks(dtype, long_rows, monkeypatch):
    """Split rows the way a small GPU runs them (blocks of 64 threads, two launches; ring tiles
    of 64 threads), at sizes a test can afford: every phase of every kernel."""
    for name, kind in list(N.TUNING.items()):
        monkeypatch.setitem(N.TUNING, name, dataclasses.replace(
            kind, max_rows_threads=64, split_threads=64, ring_threads=64))
    monkeypatch.setattr(N, "LONG_ROWS", long_rows)
    for force in ((False, True) if long_rows == "split" else (False,)):
        monkeypatch.setattr(N, "FORCE_TWO_LAUNCHES", force)
        for shape in ((37, 5000), (3, 2 * 4096 + 8), (4, 3001)):
            what = f"{shape} {dtype} two launches={force}"
            x, w, b = _ln_case(shape, dtype)
            _, mean, rstd = _check_ln(x, w, b, dtype, what)
            _check_ln_bwd(x, w, mean, rstd, dtype, what)
            _check_ln(x, None, None, dtype, what + " no affine")
            _, rstd = _check_rms(x, w, dtype, what)
            _check_rms_bwd(x, w, rstd, dtype, what)
            _, h, rstd = _check_add(x, _randn(shape, dtype), w, dtype, what)
            _check_add_bwd(h, w, rstd, dtype, what, with_residual_grad=force)
            y = go.layer_norm(x, shape[-1:], w, b)     # no statistics wanted: workspace ones
            assert_close(_np(y), N.ref_layer_norm(_np(x), shape[-1:], _np(w), _np(b)), dtype,
                         what + " layer_norm")


# The long-row plans, selectable for A/B runs (benchmarks/experiments/norms_long_rows.py).
LONG_ROW_PLANS = {"auto": dict(LONG_ROWS="auto"),
                  "resident": dict(LONG_ROWS="resident"),
                  "ring2": dict(LONG_ROWS="ring2"),
                  "ring": dict(LONG_ROWS="ring"),
                  "one_launch": dict(LONG_ROWS="split", ONE_LAUNCH_MAX_WAVES=None),
                  "two_launches": dict(LONG_ROWS="split", FORCE_TWO_LAUNCHES=True)}


def _poison_allocator(*likes):
    """Leaves NaN-filled blocks of these sizes in torch's caching allocator, so that outputs
    allocated next start as NaN rather than as an earlier (correct) result of the same size."""
    for t in likes:
        torch.full_like(t, float("nan"))


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("plan", list(LONG_ROW_PLANS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 262144), (3, 262147), (2, 262152), (3, 393216),
                                   (3, 393217), (2, 1 << 20)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_long_rows_every_plan(plan, dtype, shape, monkeypatch):
    """Every long-row plan of the forward ops, rows of 262144 .. 2^20 elements (262147, 393217:
    single elements; 262152: a last tile mostly past the end),
    outputs NaN-poisoned (out=, and the allocator's blocks)."""
    for name, value in LONG_ROW_PLANS[plan].items():
        monkeypatch.setattr(N, name, value)
    d = dt.BY_NAME[dtype]
    n = shape[-1]
    vec = 16 // d.itemsize if n % (16 // d.itemsize) == 0 else 1
    for kind in ("layer_norm", "rms_norm", "add_rms_norm"):
        split = N._plan(kind, d, vec, n, torch.cuda.current_device())
        ring = N._long_rows_ring(kind, split, d, vec, n, shape[0], torch.cuda.current_device())
        assert (ring is not None) == (plan not in ("one_launch", "two_launches")), (kind, plan)
    x, w, b = _ln_case(shape, dtype)
    what = f"{shape} {dtype} {plan}"
    stats = torch.empty(shape[:1], device="cuda")
    _poison_allocator(x, stats, stats)
    _check_ln(x, w, b, dtype, what, out=torch.full_like(x, float("nan")))
    _poison_allocator(x, stats)
    _check_rms(x, w, dtype, what)
    out = torch.full_like(x, float("nan"))
    assert_close(_np(go.rms_norm(x, shape[-1:], w, 1e-6, out=out)),
                 N.ref_rms_norm(_np(x), shape[-1:], _np(w), 1e-6), dtype, what + " out=")
    r = _randn(shape, dtype)
    _poison_allocator(x, x, stats)
    _check_add(x, r, w, dtype, what)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("plan", N.BACKWARD_LONG_ROWS_PLANS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 262144), (3, 393217), (300, 16400), (5, 9000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_backward_long_rows_every_plan(plan, dtype, shape, monkeypatch):
    """The backward's split rows under both BACKWARD_LONG_ROWS plans: rows of 262144 (columns:
    one group, blocks over chunks), single elements (393217), many rows (300 x 16400: groups of
    rows and the [groups, n] workspace), a few short split rows; outputs NaN-poisoned; the weight
    gradients bitwise the same on a second call."""
    monkeypatch.setattr(N, "BACKWARD_LONG_ROWS", plan)
    x, w, b = _ln_case(shape, dtype)
    what = f"{shape} {dtype} backward {plan}"
    _, mean, rstd = _check_ln(x, w, b, dtype, what)
    _poison_allocator(x, x, w, w, w)
    dx, dw, db = _check_ln_bwd(x, w, mean, rstd, dtype, what)
    dy = _grad_like(x)
    first = go.layer_norm_backward(dy, x, mean, rstd, shape[-1:], w)
    _poison_allocator(x, w, w)
    again = go.layer_norm_backward(dy, x, mean, rstd, shape[-1:], w)
    for a, c in zip(first, again):
        assert torch.equal(a, c), what + " bitwise"
    _, rstd = _check_rms(x, w, dtype, what)
    _poison_allocator(x, w)
    _check_rms_bwd(x, w, rstd, dtype, what)
    _, h, rstd = _check_add(x, _randn(shape, dtype), w, dtype, what)
    _poison_allocator(x, w)
    _check_add_bwd(h, w, rstd, dtype, what)


def _check_ln_far(x, w, b, dtype, what):
    """Rows far from zero mean: the statistics must not cancel (mean and rstd to float32
    accuracy); y is checked given them, since fp32 holds a mean of ~300 only to ~2e-5 absolute
    and a sum of n such values rounds by ~log2(n) u |x| n: y's own error against the exact mean
    is that conditioning, not the kernel's (as in the multi-dim test's rows at 100)."""
    y, mean, rstd = go.layer_norm_forward(x, x.shape[-1:], w, b, 1e-5)
    _, rm, rr = N.ref_layer_norm_forward(_np(x), x.shape[-1:], _np(w), _np(b), 1e-5)
    assert_close(_np(mean), rm, "float32", f"mean {what}")
    assert_close(_np(rstd), rr, "float32", f"rstd {what}")
    expected = (_np(x) - _np(mean)[:, None]) * _np(rstd)[:, None] * _np(w) + _np(b)
    assert_close(_np(y), expected, dtype, f"{what}, given the statistics")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("whole_rows", list(WHOLE_ROWS_KERNELS))
def test_gpu_whole_rows_every_option(whole_rows, dtype, monkeypatch):
    """layer_norm's whole-row kernels (WHOLE_ROWS, for A/B runs): the option's kernel where it
    applies ([*, 4096], [*, 2048], [*, 8192] rows), layer_norm_fwd elsewhere; affine and not,
    out=, rows far from zero mean; outputs NaN-poisoned."""
    monkeypatch.setattr(N, "WHOLE_ROWS", whole_rows)
    dev = torch.cuda.current_device()
    d = dt.BY_NAME[dtype]
    used = 0
    for shape in ((300, 4096), (37, 2048), (9, 8192), (5, 1000), (70, 64)):
        n = shape[-1]
        vec = 16 // d.itemsize if n % (16 // d.itemsize) == 0 else 1
        plan = N._plan("layer_norm", d, vec, n, dev)
        whole = N._whole_rows_plan(plan, d, vec, dev, shape[0], n)
        threads, ty, packs, C = N.plan_shape(N.TUNING["layer_norm"], vec, n)
        assert (whole is not None) == _whole_rows_applies(whole_rows, vec, threads, ty, packs, C)
        if whole is not None:
            assert WHOLE_ROWS_KERNELS[whole_rows].rstrip("<") in whole.kernel.name, whole.kernel
            assert whole.capacity >= N.device.device_info(dev).sm_count
            used += 1
        what = f"{shape} {dtype} {whole_rows}"
        x, w, b = _ln_case(shape, dtype)
        _poison_allocator(x, x)
        _check_ln(x, w, b, dtype, what, out=torch.full_like(x, float("nan")))
        _check_ln(x, None, None, dtype, what + " no affine")
        _check_ln_far(_randn(shape, dtype, 1.0, 300.0), w, b, dtype, what + " mean 300")
    assert used >= (0 if whole_rows == "per_row" else 1)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, (1, 2, 2), (1, 16, 2), (2, 4, 5), (4, 4, 3)],
                         ids=lambda c: "auto" if c is None else "t{}k{}d{}".format(*c))
def test_gpu_stream_rows(config, dtype, monkeypatch):
    """The stream plan (norm_stream.cuh) on this device under STREAM_ROWS = "on", at
    stream_config's pick and forced (warps per row, teams per block, depth): every forward op;
    more rows than the grid's teams x depth (the ring wraps), fewer rows than teams, 16-byte
    units of odd counts and fewer than a team's lanes, a row-strided input, out=, in place, rows
    at mean 300; outputs NaN-poisoned. Under "auto", [8192, 8192] takes it where the module
    copies asynchronously (an sm_80+ build) and the dtype is 16-bit (stream_auto_applies)."""
    monkeypatch.setattr(N, "STREAM_ROWS", "on")
    for knob, value in zip(("STREAM_TEAM", "STREAM_TEAMS", "STREAM_DEPTH"), config or (None,) * 3):
        monkeypatch.setattr(N, knob, value)
    dev = torch.cuda.current_device()
    d = dt.BY_NAME[dtype]
    vec = 16 // d.itemsize
    ran = 0
    for shape in ((3000, 4096), (5, 4096), (300, 1000), (77, 24), (40, 8192)):
        n = shape[-1]
        plans = {k: N._stream_plan(k, N._plan(k, d, vec, n, dev), d, vec, n, shape[0], dev)
                 for k in ("layer_norm", "rms_norm", "add_rms_norm")}
        ran += sum(p is not None for p in plans.values())
        if config is not None:
            assert all(p is None or (p.team, p.teams, p.depth) == config for p in plans.values())
        what = f"{shape} {dtype} stream {config}"
        x, w, b = _ln_case(shape, dtype)
        r = _randn(shape, dtype, 1.0, 0.0)
        _poison_allocator(x, x, x)
        _check_ln(x, w, b, dtype, what, out=torch.full_like(x, float("nan")))
        _check_ln(x, None, None, dtype, what + " no affine")
        _check_ln_far(_randn(shape, dtype, 1.0, 300.0), w, b, dtype, what + " mean 300")
        _poison_allocator(x, x, x)
        _check_rms(x, w, dtype, what)
        _check_rms(x, None, dtype, what + " no weight")
        _check_add(x, r, w, dtype, what)
    assert ran >= 5              # (t1k16d2 fits rows of 1000 and 24 only, not fp32 add at 1000)
    wide = _randn((700, 4104), dtype)
    x = wide[:, 8:8 + 4096]                      # row-strided view, 16-byte aligned
    w, b = _randn((4096,), dtype), _randn((4096,), dtype)
    _check_ln(x, w, b, dtype, "row-strided stream")
    _check_add(x, _randn((700, 4096), dtype), w, dtype, "row-strided stream")
    xc = x.contiguous()
    expected = N.ref_rms_norm(_np(xc), 4096, _np(w), 1e-6)
    assert go.rms_norm(xc, 4096, w, 1e-6, out=xc) is xc
    assert_close(_np(xc), expected, dtype, "stream in place")
    monkeypatch.setattr(N, "STREAM_ROWS", "auto")
    plan = N._plan("layer_norm", d, vec, 8192, dev)
    auto = N._stream_plan("layer_norm", plan, d, vec, 8192, 8192, dev)
    if config is None:        # (auto: 16-bit layer_norm streams at 8192, fp32 does not)
        assert (auto is not None) == (N.copies_async(N.LAYER_NORM_MODULE, dev)
                                      and d.itemsize == 2)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_whole_rows_auto_and_decode_rows(dtype, monkeypatch):
    """Decode-sized whole rows: layer_norm under WHOLE_ROWS = "auto" takes layer_norm_two_pass
    where the grid fits in one wave ([16, 2048]) and layer_norm_lean past it (lean_auto_applies;
    compact for 16-bit and two_pass for fp32 where the row length is not given); rms_norm /
    add_rms_norm take rms_norm_rows there on 16-byte units (DECODE_ROWS), bit-equal to
    rms_norm_fwd (y, h, rstd; with and without weight; single elements keep rms_norm_fwd) where
    it runs the plan's shape, and rms_norm / add_rms_norm past one wave at 1024 / 2048 at two
    packs per thread against the references, outputs NaN-poisoned."""
    dev = torch.cuda.current_device()
    d = dt.BY_NAME[dtype]
    vec = 16 // d.itemsize
    plan = N._plan("layer_norm", d, vec, 2048, dev)
    assert "layer_norm_two_pass<" in N._whole_rows_plan(plan, d, vec, dev, 16).kernel.name
    many = N._whole_rows_option("two_pass", plan, d, vec, dev, 1).capacity + 1
    assert ("layer_norm_compact<" if d.itemsize == 2 else "layer_norm_two_pass<") in \
        N._whole_rows_plan(plan, d, vec, dev, many).kernel.name
    # (the row length known: 16-bit rows of 1024-4096 and fp32 rows of 1024-2048 take
    # layer_norm_lean, lean_auto_applies; fp32 at two packs per thread where the plan has one)
    assert "layer_norm_lean<" in N._whole_rows_plan(plan, d, vec, dev, many, 2048).kernel.name
    # (at 1024 the plan has one pack per thread: lean runs two in half the threads,
    # wide_rows_shape)
    plan1024 = N._plan("layer_norm", d, vec, 1024, dev)
    many1024 = N._whole_rows_option("two_pass", plan1024, d, vec, dev, 1).capacity + 1
    lean1024 = N._whole_rows_plan(plan1024, d, vec, dev, many1024, 1024)
    assert "layer_norm_lean<" in lean1024.kernel.name
    assert (lean1024.block[0], lean1024.packs) == ((128, 2) if d.itemsize == 4 else (64, 2))
    for shape in ((16, 2048), (1, 4096), (7, 1000), (5, 1001), (3, 128), (many, 2048),
                  (many1024, 1024)):
        x, w, b = _ln_case(shape, dtype)
        r = _randn(shape, dtype, 1.0, 0.0)
        _check_ln(x, w, b, dtype, f"{shape} {dtype} auto", out=torch.full_like(x, float("nan")))
        v = 16 // d.itemsize if shape[-1] % (16 // d.itemsize) == 0 else 1
        rms_plan = N._plan("rms_norm", d, v, shape[-1], dev)
        monkeypatch.setattr(N, "DECODE_ROWS", True)

        def widened(kind):
            # rms_norm_rows past one wave at two packs where the plan has one (wide_rows_shape):
            # the sums' order differs from rms_norm_fwd's, so those outputs are checked against
            # the reference instead of bit for bit
            plan_k = N._plan(kind, d, v, shape[-1], dev)
            used = N._decode_rows_plan(kind, plan_k, d, v, shape[0], dev, shape[-1])
            return used is not None and (used.block[0], used.packs) != (plan_k.block[0],
                                                                         plan_k.packs)
        wide, wide_add = widened("rms_norm"), widened("add_rms_norm")
        got = {}
        for rows_kernel in (True, False):
            monkeypatch.setattr(N, "DECODE_ROWS", rows_kernel)
            _poison_allocator(x, x)
            y, rstd = go.rms_norm_forward(x, (shape[-1],), w, 1e-6)
            plain = go.rms_norm(x, (shape[-1],), None, 1e-6, out=torch.full_like(x, float("nan")))
            normed, h, arstd = go.add_rms_norm_forward(x, r, w, 1e-6)
            got[rows_kernel] = (y, rstd, plain, normed, h, arstd)
        exact = ([] if wide else [0, 1, 2]) + ([4] if wide_add else [3, 4, 5])   # (h: x + r)
        for i in exact:
            assert torch.equal(got[True][i], got[False][i]), (shape, i)
        ry, rr = N.ref_rms_norm_forward(_np(x), (shape[-1],), _np(w), 1e-6)
        assert_close(_np(got[True][0]), ry, dtype, f"rms_norm {shape} {dtype}")
        if wide:
            assert_close(_np(got[True][1]), rr, "float32", f"rms_norm rstd {shape} {dtype}")
            assert_close(_np(got[True][2]), N.ref_rms_norm(_np(x), (shape[-1],), None, 1e-6),
                         dtype, f"rms_norm without weight {shape} {dtype}")
        if wide_add:
            h64 = _np(got[True][4]).astype(np.float64)       # (the sum as stored, then normed)
            ay, ar = N.ref_rms_norm_forward(h64, (shape[-1],), _np(w), 1e-6)
            assert_close(_np(got[True][3]), ay, dtype, f"add_rms_norm {shape} {dtype}")
            assert_close(_np(got[True][5]), ar, "float32", f"add_rms_norm rstd {shape} {dtype}")
        monkeypatch.setattr(N, "DECODE_ROWS", True)
        lean = N._decode_rows_plan("rms_norm", rms_plan, d, v, shape[0], dev)
        if v > 1 and rms_plan.block[0] > 32 and rms_plan.block[1] == 1 and rms_plan.C == 1:
            cap = N._decode_rows_plan("rms_norm", rms_plan, d, v, 1, dev).capacity
            assert (lean is not None) == (shape[0] <= cap), shape
            assert N._decode_rows_plan("rms_norm", rms_plan, d, v, cap + 1, dev) is None
        else:
            assert lean is None, shape


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("long_rows", ["ring2", "auto", "resident"])
def test_gpu_ring2_cuda_graph_replays_and_eager_calls(long_rows, monkeypatch):
    """ring2 under CUDA graph replay: the epoch lives on the device (norm_ring.cuh), so a graph
    of such launches replayed 5 times on new inputs, with eager calls of other shapes on the same
    stream in between (sharing the state buffer), gives fresh statistics every time; the launch
    counter moves by exactly one per launch and the exit counter is back at 0. [16, 2^20] bf16
    on an H100: 4 (add_rms_norm 8) tiles per block, more than its slots: the ring wraps."""
    monkeypatch.setattr(N, "LONG_ROWS", long_rows)
    shape, other = (16, 1 << 20), (3, 393216)
    x, w, b = _ln_case(shape, "bfloat16")
    r = _randn(shape, "bfloat16")
    xo, wo, bo = _ln_case(other, "float32")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):          # warm-up outside capture: modules, state buffer
        go.rms_norm(x, shape[-1:], w)
        go.layer_norm(x, shape[-1:], w, b)
        go.add_rms_norm(x, r, w)
        go.layer_norm(xo, other[-1:], wo, bo)
    stream.synchronize()
    key = (torch.cuda.current_device(), stream.cuda_stream)
    assert key in N._ring2_states
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        gy = go.rms_norm(x, shape[-1:], w)
        ly, lm, lr = go.layer_norm_forward(x, shape[-1:], w, b)
        ay, ah = go.add_rms_norm(x, r, w)
    state = N._ring2_states[key][0].obj
    # launches that use the state buffer: ring2 (3), or those "auto" sends there
    dev = torch.cuda.current_device()
    stateful = sum(N._long_rows_ring(kind, N._plan(kind, dt.bfloat16, 8, shape[-1], dev),
                                     dt.bfloat16, 8, shape[-1], shape[0], dev)[0].variant != "ring"
                   for kind in ("rms_norm", "layer_norm", "add_rms_norm"))
    assert stateful == 3 or long_rows != "ring2"

    def counters():
        torch.cuda.synchronize()
        return [int(v) for v in state[:2].view(torch.int32).cpu()]

    for i in range(5):
        x.copy_(_randn(shape, "bfloat16") + 0.5 * i)
        r.copy_(_randn(shape, "bfloat16"))
        before = counters()
        with torch.cuda.stream(stream):
            graph.replay()
        assert counters() == [before[0] + stateful, 0], (i, before, counters())
        what = f"graph replay {i}"
        assert_close(_np(gy), N.ref_rms_norm(_np(x), shape[-1:], _np(w), EPS["bfloat16"]),
                     "bfloat16", what + " rms_norm")
        ry, rm, rr = N.ref_layer_norm_forward(_np(x), shape[-1:], _np(w), _np(b), 1e-5)
        assert_close(_np(ly), ry, "bfloat16", what + " layer_norm")
        assert_close(_np(lm), rm, "float32", what + " mean")
        assert_close(_np(lr), rr, "float32", what + " rstd")
        assert torch.equal(ah, x + r)
        assert_close(_np(ay), N.ref_rms_norm(_np(ah), shape[-1:], _np(w), 1e-6), "bfloat16",
                     what + " add_rms_norm")
        xo.copy_(_randn(other, "float32"))
        with torch.cuda.stream(stream):      # eager, between replays, on the same buffer
            yo = go.layer_norm(xo, other[-1:], wo, bo)
        stream.synchronize()
        assert_close(_np(yo), N.ref_layer_norm(_np(xo), other[-1:], _np(wo), _np(bo)),
                     "float32", what + " eager layer_norm")


@gpu
@needs_torch_cuda
def test_gpu_ring_on_this_device(monkeypatch):
    """The ring's plan here: every block resident (occupancy with its shared memory), at least two
    slots; at [16, 2^20] bf16 (the benchmark) blocks hold more tiles than slots: the ring wraps."""
    dev = torch.cuda.current_device()
    info = N.device.device_info(dev)
    for kind in ("layer_norm", "rms_norm", "add_rms_norm"):
        for d, vec in ((dt.bfloat16, 8), (dt.float32, 4), (dt.float16, 1)):
            ring = N._ring_plan(kind, d, vec, 1 << 20, dev)
            assert ring is not None and ring.depth >= 2 and ring.capacity >= info.sm_count
            ring2 = N._ring_plan(kind, d, vec, 1 << 20, dev, "ring2")
            assert ring2 is not None and ring2.depth >= 2 and ring2.capacity >= info.sm_count
            assert ring.smem <= max(48 * 1024, info.max_smem_per_block_optin)
            grid = N.ring_grid(ring, 16)
            assert grid is not None and grid <= ring.capacity
    # "auto" at the bench shapes of notes_norms.md
    # (resident where the rows fit on chip and the module runs cp.async (run 102); else run
    # 34's best plan at each shape: ring2 at one tile per block and for
    # rms_norm with C <= 64; the tiles per block and C are this device's, so the expectation is
    # computed from them)
    monkeypatch.setattr(N, "LONG_ROWS", "auto")
    seen = set()
    for kind in ("layer_norm", "rms_norm", "add_rms_norm"):
        for d, vec in ((dt.bfloat16, 8), (dt.float32, 4)):
            for n, rows in ((1 << 20, 16), (393216, 8)):
                plan = N._plan(kind, d, vec, n, dev)
                chosen = N._long_rows_ring(kind, plan, d, vec, n, rows, dev)
                r2 = N._ring_plan(kind, d, vec, n, dev, "ring2")
                one_tile = rows * r2.C <= N.ring_grid(r2, rows)
                want = "ring2" if one_tile or (kind != "layer_norm" and r2.C <= 64) else "ring"
                res = N._ring_plan(kind, d, vec, n, dev, "resident")
                res_grid = N.ring_grid(res, rows)
                if res_grid is not None and N.copies_async(N._MODULE_OF[kind], dev):
                    want = "resident"
                assert chosen is not None and chosen[0].variant == want, (kind, d, n)
                seen.add(want)
    if info.sm_count >= 100:           # an H100-sized grid: every plan occurs; the resident plan
        # ([16, 1M] bf16, [8, 393216]) on sm_80+ builds
        assert seen == ({"ring", "ring2", "resident"} if N.copies_async(N.RMS_NORM_MODULE, dev)
                        else {"ring", "ring2"})
    # "resident" at [16, 2^20] bf16: the rows fit in an H100's shared memory (+ a register tile)
    for kind in ("layer_norm", "rms_norm"):
        res = N._ring_plan(kind, dt.bfloat16, 8, 1 << 20, dev, "resident")
        assert res is not None and res.capacity >= info.sm_count
        if info.sm_count >= 128 and info.max_smem_per_block_optin >= 227 * 1024:
            grid = N.ring_grid(res, 16)
            assert res.depth == 7 and grid == 128 and 16 * res.C == grid * (res.depth + 1)
    ring = N._ring_plan("rms_norm", dt.bfloat16, 8, 1 << 20, dev)
    grid = N.ring_grid(ring, 16)
    if ring.capacity * ring.depth < 16 * ring.C:
        assert -(-16 * ring.C // grid) > ring.depth         # K > D: slots are reused
    # resident's bulk copies (sm_90, 4+ slot tiles per block) with a ragged last tile per row:
    # the copy stops at the row's end and the slot's tail stays stale (skipped by the partials)
    ragged = (16, (1 << 20) - 8)
    chosen = N._long_rows_ring("rms_norm", N._plan("rms_norm", dt.bfloat16, 8, ragged[1], dev),
                               dt.bfloat16, 8, ragged[1], ragged[0], dev)
    if N.copies_async(N.RMS_NORM_MODULE, dev):
        res, grid = chosen
        assert res.variant == "resident" and min(res.depth, 16 * res.C // grid) >= 4
        assert (ragged[1] // 8) % (res.threads * res.packs) != 0          # a ragged last tile
    x, w, b = _ln_case(ragged, "bfloat16")
    _check_rms(x, w, "bfloat16", "[16, 2^20 - 8] auto")
    _check_ln(x, w, b, "bfloat16", "[16, 2^20 - 8] auto", out=torch.full_like(x, float("nan")))
    x = _randn((16, 1 << 20), "bfloat16")
    w = _randn((1 << 20,), "bfloat16")
    _check_rms(x, w, "bfloat16", "[16, 2^20] ring")
    r = _randn((16, 1 << 20), "bfloat16")
    _check_add(x, r, w, "bfloat16", "[16, 2^20] ring")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_multi_dim_no_affine_eps_none_and_offsets(dtype):
    x = _randn((2, 3, 8, 48), dtype, 1.0, 0.0)
    _, mean, rstd = _check_ln(x, None, None, dtype, "(8, 48) no affine", ns=(8, 48))
    _check_ln_bwd(x, None, mean, rstd, dtype, "(8, 48) no weight", ns=(8, 48))
    w = _randn((8, 48), dtype)
    _check_ln(x, w, None, dtype, "(8, 48) weight only", ns=(8, 48))
    _, rstd = _check_rms(x, None, dtype, "eps=None", ns=(8, 48), eps=None)
    _check_rms_bwd(x, None, rstd, dtype, "(8, 48) no weight", ns=(8, 48))
    # rows far from zero mean: the statistics must not cancel (y itself is then as exact as
    # fp32 can hold the mean, ~1e-5 absolute at 100, so it is checked given the statistics)
    far = _randn((16, 4096), dtype, 1.0, 100.0)
    y, mean, rstd = go.layer_norm_forward(far, 4096)
    _, rm, rr = N.ref_layer_norm_forward(_np(far), 4096, None, None, 1e-5)
    assert_close(_np(mean), rm, "float32", "mean of rows at 100")
    assert_close(_np(rstd), rr, "float32", "rstd of rows at 100")
    expected = (_np(far) - _np(mean)[:, None]) * _np(rstd)[:, None]
    assert_close(_np(y), expected, dtype, "rows at 100, given the statistics")
    small = _randn((8, 256), dtype, 1e-3)       # mean square ~ eps: eps matters
    _check_rms(small, None, dtype, "eps=None small", eps=None)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_strided_inputs_and_out(dtype):
    wide = _randn((40, 4104), dtype)
    x = wide[:, 8:8 + 4096]                      # row-strided view, 16-byte aligned
    w, b = _randn((4096,), dtype), _randn((4096,), dtype)
    _, mean, rstd = _check_ln(x, w, b, dtype, "row-strided")
    xu = wide[:, 1:1 + 4096]                     # unaligned rows: the element path
    _check_ln(xu, w, b, dtype, "unaligned")
    _check_rms(xu, w, dtype, "unaligned")
    xt = _randn((64, 40), dtype).t()             # transposed: copied
    _check_ln(xt, None, None, dtype, "transposed")
    _check_rms(xt, _randn((64,), dtype), dtype, "transposed")
    _check_add(xt, _randn((40, 64), dtype), _randn((64,), dtype), dtype, "transposed")
    # strided weight (copied) and a gradient that is an expanded scalar (stride 0)
    w2 = _randn((4096 * 2,), dtype)[::2]
    _check_ln(x, w2, None, dtype, "strided weight")
    dy = torch.ones((), device="cuda", dtype=x.dtype).expand(x.shape)
    _check_ln_bwd(x, w, mean, rstd, dtype, "expanded grad", dy=dy)
    # out=: NaN-filled, contiguous and row-strided, then in place
    out = torch.full((40, 4096), float("nan"), device="cuda", dtype=x.dtype)
    y = go.layer_norm(x, 4096, w, b, out=out)
    assert y is out
    assert_close(_np(out), N.ref_layer_norm(_np(x), 4096, _np(w), _np(b)), dtype, "out=")
    out_wide = torch.full((40, 4200), float("nan"), device="cuda", dtype=x.dtype)
    yw = go.rms_norm(x, 4096, w, 1e-6, out=out_wide[:, :4096])
    assert_close(_np(yw), N.ref_rms_norm(_np(x), 4096, _np(w), 1e-6), dtype, "strided out=")
    assert torch.isnan(out_wide[:, 4096:]).all()
    xc = x.contiguous()
    expected = N.ref_rms_norm(_np(xc), 4096, _np(w), 1e-6)
    assert go.rms_norm(xc, 4096, w, 1e-6, out=xc) is xc
    assert_close(_np(xc), expected, dtype, "in place")
    with pytest.raises(ValueError, match="overlaps"):
        go.layer_norm(xc[:, :2048], 2048, out=xc[:, 1:2049])
    with pytest.raises(ValueError, match="'out'"):
        go.layer_norm(xc, 4096, out=torch.empty((4096, 40), device="cuda",
                                                dtype=xc.dtype).t())
    with pytest.raises(TypeError, match="float32"):
        go.rms_norm_backward(xc, xc, rstd.double(), 4096, w)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_nan_and_inf_rows(dtype):
    x = _randn((6, 4096), dtype)
    x[1, 7] = float("nan")
    x[3, 100] = float("inf")
    x[4, 5] = float("-inf")
    w = _randn((4096,), dtype)
    y = go.layer_norm(x, 4096, w)
    ref = N.ref_layer_norm(_np(x), 4096, _np(w))
    assert_close(_np(y), ref, dtype, "layer_norm NaN/Inf rows")
    assert torch.isnan(y[[1, 3, 4]]).all() and not torch.isnan(y[[0, 2, 5]]).any()
    y = go.rms_norm(x, 4096, w, 1e-6)
    assert_close(_np(y), N.ref_rms_norm(_np(x), 4096, _np(w), 1e-6), dtype, "rms NaN/Inf rows")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_gpu_add_rms_norm_matches_hf_transformers(dtype):
    """HF's decoder layer in bf16: residual = residual + hidden (rounded), then LlamaRMSNorm."""
    td = getattr(torch, dtype)
    hidden, residual = _randn((64, 2048), dtype), _randn((64, 2048), dtype, 4.0)
    w = _randn((2048,), dtype, 0.1, 1.0)
    new_residual = residual + hidden
    var = new_residual.float().pow(2).mean(-1, keepdim=True)
    hf = w * (new_residual.float() * torch.rsqrt(var + 1e-6)).to(td)
    y, h = go.add_rms_norm(hidden, residual, w, 1e-6)
    assert torch.equal(h, new_residual)
    assert_close(_np(y), _np(hf), dtype, "vs HF RMSNorm")


@gpu
@needs_torch_cuda
def test_gpu_weight_gradients_are_deterministic():
    x = _randn((3000, 1024), "float32")
    w = _randn((1024,), "float32")
    _, mean, rstd = go.layer_norm_forward(x, 1024, w, w)
    dy = _grad_like(x)
    first = go.layer_norm_backward(dy, x, mean, rstd, 1024, w)
    for _ in range(3):
        again = go.layer_norm_backward(dy, x, mean, rstd, 1024, w)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_autograd_matches_torch(dtype):
    """gpuops.torch against torch's own ops run in fp32 on the same (rounded) inputs."""
    import gpuops.torch as gt
    td = getattr(torch, dtype)
    x0 = _randn((64, 1536), dtype)
    w0, b0 = _randn((1536,), dtype, 0.5, 1.0), _randn((1536,), dtype)
    r0 = _randn((64, 1536), dtype)
    dy = _grad_like(x0)

    def grads(fn, leaves, grad):
        leaves = [t.detach().clone().requires_grad_() for t in leaves]
        out = fn(*leaves)
        out = out if isinstance(out, tuple) else (out,)
        return [o.detach() for o in out] + list(torch.autograd.grad(out, leaves,
                                                                    [grad] * len(out)))

    def add_then_norm(x, r, w):      # the sum rounded to the storage dtype, as gpuops and HF
        h = (x + r).to(td).float()
        return F.rms_norm(h, [1536], w, 1e-6), h
    pairs = [
        (lambda x, w, b: gt.layer_norm(x, 1536, w, b),
         lambda x, w, b: F.layer_norm(x, (1536,), w, b), (x0, w0, b0)),
        (lambda x, w: gt.rms_norm(x, [1536], w, 1e-6), lambda x, w: F.rms_norm(x, [1536], w, 1e-6),
         (x0, w0)),
        (lambda x, r, w: gt.add_rms_norm(x, r, w, 1e-6), add_then_norm, (x0, r0, w0)),
    ]
    for ours, theirs, leaves in pairs:
        got = grads(ours, leaves, dy)
        want = grads(theirs, [t.float() for t in leaves], dy.float())
        for a, e in zip(got, want):
            assert a.dtype == td
            if dtype == "float32":
                torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
            else:
                assert_close(_np(a), _np(e), dtype, "vs torch in fp32")


@gpu
@needs_torch_cuda
def test_gpu_torch_compile_fullgraph():
    step, eager, args = _compile_case("cuda", torch.float32)
    compiled = torch.compile(step, fullgraph=True)
    out = compiled(*args)
    torch.testing.assert_close(out, eager(*args), rtol=1e-4, atol=1e-3)
    for ga, ge in zip(torch.autograd.grad(out, args), torch.autograd.grad(eager(*args), args)):
        torch.testing.assert_close(ga, ge, rtol=1e-4, atol=1e-4)


@gpu
@needs_torch_cuda
def test_gpu_side_stream_and_cuda_graph_at_decode_size():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = _randn((16, 2048), "bfloat16")
        r = _randn((16, 2048), "bfloat16")
        w = _randn((2048,), "bfloat16")
        y, h = go.add_rms_norm(x, r, w)
    side.synchronize()
    assert torch.equal(h, x + r)
    assert_close(_np(y), N.ref_rms_norm(_np(h), 2048, _np(w), 1e-6), "bfloat16", "side stream")

    sx, sr, sw = _randn((16, 2048), "bfloat16"), _randn((16, 2048), "bfloat16"), w
    long_x = _randn((2, 1 << 18), "float32")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):          # warm-up outside capture (loads the modules)
        go.add_rms_norm(sx, sr, sw)
        go.layer_norm_forward(sx, 2048, sw, sw)
        go.rms_norm(long_x, 1 << 18)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):          # no host sync, every launch on the capture stream
        gy, gh = go.add_rms_norm(sx, sr, sw)
        ly, lm, lr = go.layer_norm_forward(gy, 2048, sw, sw)
        gdx, gdw, gdb = go.layer_norm_backward(gh, gy, lm, lr, 2048, sw)
        long_y = go.rms_norm(long_x, 1 << 18)     # split rows: memset + kernel in the graph
    for _ in range(2):
        sx.copy_(_randn((16, 2048), "bfloat16"))
        sr.copy_(_randn((16, 2048), "bfloat16"))
        long_x.copy_(_randn((2, 1 << 18), "float32"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gh, sx + sr)
        assert_close(_np(gy), N.ref_rms_norm(_np(gh), 2048, _np(sw), 1e-6), "bfloat16", "graph")
        ry, rm, rr = N.ref_layer_norm_forward(_np(gy), 2048, _np(sw), _np(sw), 1e-5)
        assert_close(_np(ly), ry, "bfloat16", "graph layer_norm")
        rx, rw, rb = N.ref_layer_norm_backward(_np(gh), _np(gy), _np(lm), _np(lr), 2048, _np(sw))
        assert_close(_np(gdx), rx, "bfloat16", "graph backward")
        assert_close(_np(gdw), rw, "bfloat16", "graph grad_weight")
        assert_close(_np(gdb), rb, "bfloat16", "graph grad_bias")
        assert_close(_np(long_y), N.ref_rms_norm(_np(long_x), 1 << 18, None, EPS["float32"]),
                     "float32", "graph long rows")


@gpu
def test_gpu_cupy_and_numpy_inputs(rng):
    import cupy as cp
    x = cp.asarray(rng.standard_normal((33, 640)).astype(np.float32))
    w = cp.asarray(rng.standard_normal(640).astype(np.float32))
    y, mean, rstd = go.layer_norm_forward(x, 640, w, w)
    assert isinstance(y, cp.ndarray) and mean.dtype == np.float32
    ry, rm, rr = N.ref_layer_norm_forward(cp.asnumpy(x).astype(np.float64), 640,
                                          cp.asnumpy(w).astype(np.float64),
                                          cp.asnumpy(w).astype(np.float64), 1e-5)
    assert_close(cp.asnumpy(y), ry, "float32", "cupy")
    assert_close(cp.asnumpy(rstd), rr, "float32", "cupy rstd")
    xt = x.T                                   # non-contiguous CuPy: copied
    yt = go.rms_norm(xt, 33, None, 1e-6)
    assert_close(cp.asnumpy(yt), N.ref_rms_norm(cp.asnumpy(xt).astype(np.float64), 33, None,
                                                1e-6), "float32", "cupy transposed")
    xh = rng.standard_normal((7, 4096)).astype(np.float32)
    out = np.full_like(xh, np.nan)
    assert go.rms_norm(xh, 4096, None, 1e-6, out=out) is out
    assert_close(out, N.ref_rms_norm(xh.astype(np.float64), 4096, None, 1e-6), "float32",
                 "numpy on gpu")


@gpu
@needs_torch_cuda
def test_gpu_empty_inputs():
    x = torch.empty((0, 64), device="cuda")
    assert go.layer_norm(x, 64).shape == (0, 64)
    y, mean, rstd = go.layer_norm_forward(torch.empty((3, 0), device="cuda"), 0)
    assert y.shape == (3, 0) and torch.all(mean == 0) and torch.isnan(rstd).all()
    dx, dw, db = go.layer_norm_backward(x, x, torch.empty(0, device="cuda"),
                                        torch.empty(0, device="cuda"), 64)
    assert dx.shape == (0, 64) and torch.all(dw == 0) and torch.all(db == 0)
    dx, dw = go.rms_norm_backward(x, x, torch.empty(0, device="cuda"), 64)
    assert torch.all(dw == 0)
