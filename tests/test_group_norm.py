"""GroupNorm (+ fused SiLU): the float64 reference against torch, argument errors, the launch plans,
the host code run against a CPU emulation of cuda_src/groupnorm/group_norm.cu (every kernel and
layout, clusters included), and on the GPU every dtype, layout, design and odd size against the
float64 reference, poisoned outputs, in-place use, CuPy/NumPy channels-last arrays, NaN
propagation, a side stream and a CUDA graph."""
from __future__ import annotations

import contextlib
import types
from math import prod

import numpy as np
import pytest

import gpuops as go
from gpuops.ops.gemm import effective_arch
from gpuops import dtypes as dt
from gpuops import registry
from gpuops.ops import group_norm as GN
from gpuops.tensor import Tensor
from conftest import HAS_TORCH, assert_close, gpu, needs_torch, needs_torch_cuda
from test_copy import Emulator, FakeCall, FakeObj, emulated, np_storage

torch = pytest.importorskip("torch") if HAS_TORCH else None
F = torch.nn.functional if HAS_TORCH else None
DTYPES = ["float32", "float16", "bfloat16"]


# ------------------------------------------------------------------------------ CPU: reference

@needs_torch
@pytest.mark.parametrize("shape,groups", [((2, 6, 5, 4), 3), ((3, 8), 4), ((2, 4, 7), 1),
                                          ((1, 6, 2, 3, 4), 6)])
def test_reference_matches_torch_in_float64(rng, shape, groups):
    x = rng.standard_normal(shape) * 3 + 1
    c = shape[1]
    w, b = rng.standard_normal(c), rng.standard_normal(c)
    tx = torch.from_numpy(x)
    expected = F.group_norm(tx, groups, torch.from_numpy(w), torch.from_numpy(b), eps=1e-5)
    np.testing.assert_allclose(GN.ref_group_norm(x, groups, w, b), expected.numpy(), rtol=1e-12,
                               atol=1e-12)
    np.testing.assert_allclose(GN.ref_group_norm(x, groups, w, b, activation="silu"),
                               F.silu(expected).numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(GN.ref_group_norm(x, groups, eps=0.1),
                               F.group_norm(tx, groups, eps=0.1).numpy(), rtol=1e-12, atol=1e-12)
    last = np.moveaxis(x, 1, -1)
    np.testing.assert_allclose(GN.ref_group_norm(last, groups, w, b, channels_last=True),
                               np.moveaxis(expected.numpy(), 1, -1), rtol=1e-12, atol=1e-12)


def test_argument_errors(rng):
    x = rng.standard_normal((2, 6, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="divisible by num_groups=4"):
        go.group_norm(x, 4)
    with pytest.raises(ValueError, match="num_groups"):
        go.group_norm(x, 0)
    with pytest.raises(ValueError, match="'weight' must have shape \\(6,\\)"):
        go.group_norm(x, 3, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="'bias'"):
        go.group_norm(x, 3, None, np.ones((6, 1), np.float32))
    with pytest.raises(ValueError, match="activation"):
        go.group_norm(x, 3, activation="gelu")
    with pytest.raises(ValueError, match="at least 2"):
        go.group_norm(x[0, 0], 1)
    with pytest.raises(ValueError, match="divisible"):
        go.group_norm(x, 3, channels_last=True)          # 4 channels last
    with pytest.raises(TypeError, match="float16"):
        go.group_norm(x, 3, np.ones(6, np.float16))


@needs_torch
def test_cpu_path_torch_and_numpy(rng):
    x = rng.standard_normal((2, 8, 3, 3)).astype(np.float32)
    w, b = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    ref = GN.ref_group_norm(x.astype(np.float64), 4, w, b, activation="silu")
    tx = torch.from_numpy(x).to(torch.bfloat16)
    y = go.group_norm(tx, 4, torch.from_numpy(w).to(torch.bfloat16),
                      torch.from_numpy(b).to(torch.bfloat16), activation="silu")
    assert y.dtype == torch.bfloat16 and y.shape == tx.shape
    ref16 = GN.ref_group_norm(tx.double().numpy(), 4, torch.from_numpy(w).to(torch.bfloat16)
                              .double().numpy(), torch.from_numpy(b).to(torch.bfloat16).double()
                              .numpy(), activation="silu")
    assert_close(y.double().numpy(), ref16, "bfloat16", "cpu torch")
    yn = go.group_norm(x, 4, w, b, activation="silu")
    assert yn.dtype == np.float32
    assert_close(yn, ref, "float32", "numpy")


# ------------------------------------------------------------------------------ CPU: plans

@pytest.mark.parametrize("clusters", [False, True])
def test_onchip_plan_covers_each_group(clusters):
    for groups in (1, 2, 7, 64, 132, 1000):
        for gp in (1, 5, 31, 128, 1000, 1280, 5120, 8192, 10240, 32768, 65536, 70000):
            plan = GN.plan_onchip(groups, gp, 132, clusters)
            if plan is None:
                assert gp > (8 if clusters else 1) * GN.ONCHIP_MAX_PACKS
                continue
            s, slice_packs, packs, threads = plan
            assert s == 1 or (clusters and s in GN.CLUSTERS)
            assert s * slice_packs >= gp and (s - 1) * slice_packs < gp   # no empty rank
            assert threads % 32 == 0 and 32 <= threads <= GN.ONCHIP_MAX_THREADS
            assert threads * packs >= slice_packs and packs == GN.ONCHIP_PACKS
    # the measured winners at [2, 320, 64, 64] (run 13): 16-bit, 64 groups of 5120 packs: one
    # block per group (onchip); fp32, 10240 packs: clusters of 2 (the smallest that fits)
    assert GN.plan_onchip(64, 5120, 132, True) == (1, 5120, 8, 640)
    assert GN.plan_onchip(64, 10240, 132, True) == (2, 5120, 8, 640)
    assert GN.plan_onchip(64, 5120, 132, False) == (1, 5120, 8, 640)
    assert GN.plan_onchip(64, 100, 132, True) == (1, 100, 8, 32)
    # several waves ([8, 640, 64, 64]: 256 groups): slices of <= 64 KB, as before
    assert GN.plan_onchip(256, 10240, 132, True) == (4, 2560, 8, 320)
    assert GN.plan_onchip(256, 20480, 132, True) == (8, 2560, 8, 320)


def test_two_pass_and_nhwc_plans():
    for groups in (1, 3, 64, 4096):
        for gu in (1, 7, 1024, 40960, 1 << 20):
            chunks, cu = GN.plan_two_pass(groups, gu, 132)
            assert chunks >= 1 and chunks * cu >= gu and (chunks - 1) * cu < gu
    for n, hw, c, g, vec in [(2, 4096, 320, 32, 8), (8, 4096, 640, 32, 8), (1, 49, 12, 3, 1),
                             (4, 1024, 1280, 32, 4), (1, 7, 4096, 1, 8), (1, 5, 8192, 2, 8),
                             (3, 100, 96, 96, 8), (1, 1, 8, 1, 8)]:
        cg = c // g
        plan = GN.plan_nhwc(n, hw, c, cg, vec, 2, 132)
        if plan is None:
            assert (cg * vec // np.gcd(cg, vec)) // vec > GN.NHWC_MAX_THREADS
            continue
        sc, threads, slabs, tiles, rows = plan
        p = sc // vec
        assert sc % cg == 0 and sc % vec == 0 and c == sc * slabs
        assert threads % p == 0 and 128 <= threads <= GN.NHWC_MAX_THREADS
        assert 2 * threads * vec * 4 <= GN.NHWC_SMEM_LIMIT
        assert tiles * rows >= hw and (tiles - 1) * rows < hw
    assert GN.plan_nhwc(1, 5, 8192, 8192, 8, 2, 132) is None    # one group of 1024 packs


# ------------------------------------------------------------------------------ CPU: emulation

def _merge(a, b):
    n = a[0] + b[0]
    if n == 0:
        return (0.0, 0.0, 0.0)
    f, delta = b[0] / n, b[1] - a[1]
    return (n, a[1] + delta * f, a[2] + b[2] + delta * delta * a[0] * f)


def _stats(vals):
    if vals.size == 0:
        return (0.0, 0.0, 0.0)
    m = vals.mean()
    return (float(vals.size), float(m), float(((vals - m) ** 2).sum()))


class GroupNormEmulator(Emulator):
    """The group-norm kernels in float64 (index arithmetic, coverage, alignment, statistics
    merges; the fp32 rounding is the GPU tests' business)."""

    def _f(self, ptr, d, offsets):
        return self.arena.load(ptr, d, offsets).astype(np.float64)

    def _affine(self, vals, mean, rstd, w, b, d, c, act):
        wv = self._f(w, d, c) if w else 1.0
        bv = self._f(b, d, c) if b else 0.0
        y = (vals - mean) * rstd * wv + bv
        return y / (1 + np.exp(-y)) if act else y

    def _part(self, part, i):
        return tuple(self._f(part, dt.float32, 4 * i + np.arange(3)))

    def _onchip(self, targs, grid, block, args, cluster):
        d, packs = GN_DTYPES[targs[0]], int(targs[1])
        x, w, b, y, hw, cg, groups, group_packs, slice_packs, eps, act = args
        vec, nth = 16 // d.itemsize, block[0]
        assert nth % 32 == 0 and grid[0] % cluster == 0
        assert x % 16 == 0 and y % 16 == 0 and hw % vec == 0 and group_packs * vec < 2 ** 31
        for g in range(grid[0] // cluster):
            base, st, pieces = g * group_packs * vec, (0.0, 0.0, 0.0), []
            for rank in range(cluster):
                p0 = rank * slice_packs
                p1 = min(p0 + slice_packs, group_packs)
                ps = (np.arange(nth)[:, None] + np.arange(packs)[None, :] * nth + p0).reshape(-1)
                ps = ps[ps < p1]
                assert len(ps) == max(p1 - p0, 0), "the block's threads miss packs of its slice"
                offs = base + (ps[:, None] * vec + np.arange(vec)).reshape(-1)
                vals = self._f(x, d, offs)
                st = _merge(st, _stats(vals))
                pieces.append((offs, vals))
            assert st[0] == group_packs * vec
            rstd = 1 / np.sqrt(st[2] / st[0] + eps)
            for offs, vals in pieces:
                c = (g % groups) * cg + (offs - base) // hw
                self.arena.store(y, d, offs, self._affine(vals, st[1], rstd, w, b, d, c, act))

    def k_group_norm_onchip(self, targs, grid, block, args, smem):
        self._onchip(targs, grid, block, args, 1)

    def k_group_norm_onchip_cluster(self, targs, grid, block, args, smem):
        assert self.cc >= 90 and self.target_arch >= 90, "cluster kernel launched below sm_90"
        self._onchip(targs, grid, block, args, int(targs[2]))

    def k_group_norm_nchw_stats(self, targs, grid, block, args, smem):
        """Shifted sums per thread (its first unit's mean as the shift), as the kernel forms
        them, then Chan merges over the block's threads."""
        d, vec = GN_DTYPES[targs[0]], int(targs[1])
        x, part, group_units, chunk_units, chunks = args
        nth = block[0]
        assert nth == GN.TWO_PASS_THREADS and (vec == 1 or x % 16 == 0)
        assert grid[0] % chunks == 0 and chunk_units * (chunks - 1) < group_units
        for blk in range(grid[0]):
            g, chunk = divmod(blk, chunks)
            u0, u1 = chunk * chunk_units, min((chunk + 1) * chunk_units, group_units)
            st = (0.0, 0.0, 0.0)
            for t in range(nth):
                u = np.arange(u0 + t, u1, nth)
                if len(u) == 0:
                    continue
                vals = self._f(x, d, g * group_units * vec + (u[:, None] * vec + np.arange(vec)))
                shift = vals[0].mean()
                dv = vals.reshape(-1) - shift
                n, s1, s2 = float(dv.size), dv.sum(), (dv * dv).sum()
                m = s1 / n
                st = _merge(st, (n, shift + m, max(s2 - s1 * m, 0.0)))
            self.arena.store(part, dt.float32, 4 * blk + np.arange(4), [*st, 0.0])

    def k_group_norm_nchw_apply(self, targs, grid, block, args, smem):
        d, vec = GN_DTYPES[targs[0]], int(targs[1])
        x, w, b, y, part, cg, groups, group_units, tiles, chunks, eps, act, rev, mul, shift = args
        assert vec == 1 or (x % 16 == 0 and y % 16 == 0)
        assert rev in (0, 1)
        tile_units = block[0] * GN.UNROLL
        assert grid[0] % tiles == 0 and tiles == -(-group_units // tile_units)
        for blk in _apply_blocks(grid[0], rev):
            g, tile = divmod(blk, tiles)
            st = (0.0, 0.0, 0.0)
            for i in range(chunks):
                st = _merge(st, self._part(part, g * chunks + i))
            assert st[0] == group_units * vec, "a group's partials do not add up"
            u = np.arange(tile * tile_units, min((tile + 1) * tile_units, group_units))
            offs = g * group_units * vec + (u[:, None] * vec + np.arange(vec)).reshape(-1)
            e = (u * vec).astype(np.uint64)            # the kernel's multiply-shift divider
            within = ((((e * mul) >> np.uint64(32)) + e) >> np.uint64(shift)).astype(np.int64)
            c = (g % groups) * cg + np.repeat(within, vec)
            self.arena.store(y, d, offs, self._affine(self._f(x, d, offs), st[1],
                                                      1 / np.sqrt(st[2] / st[0] + eps), w, b, d,
                                                      c, act))

    def _nhwc_block(self, x, d, blk, slabs, tiles, tile_rows, hw, c, sc, bd, p):
        """Block `blk`'s tile [rows, sc] and the element offsets, with the rows each of the
        block's row phases (threads t // p) visits."""
        assert bd % p == 0 and 32 <= bd <= GN.NHWC_MAX_THREADS
        rs = bd // p
        rest, slab = divmod(blk, slabs)
        n, tile = divmod(rest, tiles)
        r0 = tile * tile_rows
        rows = min(tile_rows, hw - r0)
        assert rows >= 1, "empty tile"
        phase_rows = [np.arange(ty, rows, rs) for ty in range(rs)]
        assert np.array_equal(np.sort(np.concatenate(phase_rows)), np.arange(rows))
        offs = (n * hw + r0 + np.arange(rows))[:, None] * c + slab * sc + np.arange(sc)[None, :]
        return n, slab, tile, rows, rs, phase_rows, offs, self._f(x, d, offs).reshape(offs.shape)

    def k_group_norm_nhwc_stats(self, targs, grid, block, args, smem):
        d, vec = GN_DTYPES[targs[0]], int(targs[1])
        x, part, hw, c, cg, sc, slabs, tiles, tile_rows = args
        bd, p, kg = block[0], sc // vec, sc // cg
        assert smem >= 2 * bd * vec * 4 and sc % vec == 0 and sc % cg == 0 and c == sc * slabs
        assert vec == 1 or (x % 16 == 0 and c % vec == 0)
        for blk in range(grid[0]):
            n, slab, tile, rows, rs, phase_rows, _, v = self._nhwc_block(
                x, d, blk, slabs, tiles, tile_rows, hw, c, sc, bd, p)
            # shared memory entry ty * sc + channel: Welford of that channel over phase ty's rows
            cnt = np.array([len(r) for r in phase_rows], dtype=np.float64)
            sums = np.stack([v[r].sum(0) for r in phase_rows])
            mean = np.divide(sums, cnt[:, None], out=np.zeros_like(sums), where=cnt[:, None] > 0)
            m2 = np.stack([((v[r] - mean[ty]) ** 2).sum(0) for ty, r in enumerate(phase_rows)])
            s_n, s_mean, s_m2 = np.repeat(cnt, sc), mean.reshape(-1), m2.reshape(-1)
            # the kernel's merge: group gl takes entries ph * sc + gl * cg + (e % cg), e < rs * cg
            e = np.arange(rs * cg)
            ph = e // cg
            for gl in range(kg):
                idx = ph * sc + gl * cg + e % cg
                counts = np.where(ph < rows, (rows - ph + rs - 1) // rs, 0)
                assert np.array_equal(s_n[idx], counts), "phase_rows disagrees with the loop"
                tot = s_n[idx].sum()
                gm = (s_n[idx] * s_mean[idx]).sum() / tot
                gm2 = s_m2[idx].sum() + (s_n[idx] * (s_mean[idx] - gm) ** 2).sum()
                g = n * (c // cg) + slab * kg + gl
                self.arena.store(part, dt.float32, 4 * (g * tiles + tile) + np.arange(4),
                                 [tot, gm, gm2, 0.0])

    def k_group_norm_nhwc_apply(self, targs, grid, block, args, smem):
        d, vec = GN_DTYPES[targs[0]], int(targs[1])
        x, w, b, y, part, hw, c, cg, sc, slabs, tiles, tile_rows, eps, act, rev = args
        bd, p, kg = block[0], sc // vec, sc // cg
        assert smem >= 8 * kg and rev in (0, 1)
        for blk in _apply_blocks(grid[0], rev):
            n, slab, tile, rows, rs, _, offs, v = self._nhwc_block(
                x, d, blk, slabs, tiles, tile_rows, hw, c, sc, bd, p)
            mean, rstd = np.zeros(kg), np.zeros(kg)
            for gl in range(kg):
                g = n * (c // cg) + slab * kg + gl
                st = (0.0, 0.0, 0.0)
                for i in range(tiles):
                    st = _merge(st, self._part(part, g * tiles + i))
                assert st[0] == hw * cg, "a group's partials do not add up"
                mean[gl], rstd[gl] = st[1], 1 / np.sqrt(st[2] / st[0] + eps)
            ch = slab * sc + np.arange(sc)
            gl = np.arange(sc) // cg
            self.arena.store(y, d, offs, self._affine(v, mean[gl], rstd[gl], w, b, d, ch, act))


def _apply_blocks(grid, reverse):
    """The data blocks of an apply kernel in launch order (apply_block in the kernel)."""
    blocks = [grid - 1 - i if reverse else i for i in range(grid)]
    assert sorted(blocks) == list(range(grid))
    return blocks


GN_DTYPES = {"float": dt.float32, "gpuops::float16_t": dt.float16,
             "gpuops::bfloat16_t": dt.bfloat16}
TOL64 = {"float32": dict(rtol=1e-6, atol=1e-7), "float16": dict(rtol=1e-3, atol=1e-5),
         "bfloat16": dict(rtol=8e-3, atol=1e-5)}

# (shape, groups, layout, forced design)
EMULATED = [
    ((2, 320, 8, 8), 32, "nchw", None), ((1, 4, 3, 3), 2, "nchw", None), ((3, 6, 5), 3, "nchw", None),
    ((2, 8), 2, "nchw", None), ((1, 32, 32, 32), 4, "nchw", None), ((1, 8, 128, 128), 1, "nchw", None),
    ((1, 8, 64, 64), 2, "nchw", "twopass"), ((2, 16, 8, 8), 4, "nchw", "onchip"),
    ((2, 16, 16, 16), 4, "nchw", "cluster2"), ((1, 16, 16, 16), 2, "nchw", "cluster8"),
    ((2, 8, 8, 320), 32, "nhwc", None), ((2, 5, 7, 12), 3, "nhwc", "nhwc"),
    ((1, 4, 4, 64), 64, "nhwc", "nhwc"), ((2, 320, 8, 8), 32, "strided_nhwc", None),
    ((2, 40, 3, 5), 4, "strided_nhwc", "nhwc"), ((2, 16, 6, 10), 4, "other", None),
    ((2, 8, 8, 320), 32, "nhwc", "nhwc"), ((2, 320, 8, 8), 32, "strided_nhwc", "nhwc"),
    ((2, 8, 8, 320), 32, "nhwc", "nhwc_copy"), ((2, 320, 8, 8), 32, "strided_nhwc", "nhwc_copy"),
    ((1, 3, 1024), 1, "strided_nhwc", "nhwc"), ((4, 512, 2, 2), 2, "nhwc", "nhwc"),
]


def _emulated_input(arena, rng, shape, d, layout, misalign):
    host = (rng.standard_normal(shape) * 2 + 0.5).astype(np_storage(d))
    if layout in ("nchw", "nhwc"):
        return host, arena.put(host, d, misalign)
    perm = (0, *range(2, len(shape)), 1) if layout == "strided_nhwc" else (0, 1, 3, 2)
    mem = arena.put(np.ascontiguousarray(host.transpose(perm)), d, misalign)
    inv = [int(i) for i in np.argsort(perm)]
    return host, Tensor(mem.ptr, tuple(shape), tuple(mem.strides[i] for i in inv), d, 0, FakeObj(),
                        mem.numel, False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_norm_on_the_emulated_kernels(monkeypatch, rng, dtype):
    d = dt.BY_NAME[dtype]
    impl = registry.get("group_norm").impl
    # round 2's auto rule: the designs this NumPy emulator models (AUTO_RULE 3's kernels run in
    # the C++ emulator: test_auto_rule3_routes, test_stream_kernels_on_the_cpu_emulator)
    monkeypatch.setattr(GN, "AUTO_RULE", 2)
    with emulated(monkeypatch, GroupNormEmulator, arena_bytes=1 << 26) as emu:
        monkeypatch.setattr(GN, "device", types.SimpleNamespace(
            device_info=lambda dev: types.SimpleNamespace(cc=emu.cc, sm_count=emu.sms)))
        for arch in ((90, 61) if dtype == "float16" else (90,)):
            emu.cc = emu.target_arch = arch
            GN._plans.clear()                  # plans depend on the device's arch
            for shape, groups, layout, force in EMULATED:
                if arch < 90 and force and force.startswith("cluster"):
                    continue
                monkeypatch.setattr(GN, "force_path", force)   # (part of the plans' key)
                for misalign, affine, act in ((0, True, "silu"), (1, False, None)):
                    emu.arena.top = 0
                    host, x = _emulated_input(emu.arena, rng, shape, d, layout, misalign)
                    cl = layout == "nhwc"
                    c = shape[-1] if cl else shape[1]
                    w = emu.arena.put(rng.standard_normal(c), d) if affine else None
                    b = emu.arena.put(rng.standard_normal(c), d) if affine else None
                    emu.launches.clear()
                    y = impl(FakeCall(emu.arena, "group_norm"), x, groups, w, b, 1e-5, act, cl)
                    ref = GN.ref_group_norm(host.astype(np.float64), groups,
                                            None if w is None else emu.arena.read(w),
                                            None if b is None else emu.arena.read(b), 1e-5, act, cl)
                    got = emu.arena.read(y).astype(np.float64)
                    what = f"{shape} G={groups} {layout} {force} misalign={misalign} sm_{arch}: " \
                           f"{emu.names()}"
                    assert got.shape == ref.shape, what
                    np.testing.assert_allclose(got, ref, **TOL64[dtype], err_msg=what)


def test_emulated_designs(monkeypatch, rng):
    """Which kernels each case takes under round 2's auto rule (the H100 path of the benchmark
    shapes, scaled down; rule 3: test_auto_rule3_routes)."""
    impl = registry.get("group_norm").impl
    monkeypatch.setattr(GN, "AUTO_RULE", 2)
    with emulated(monkeypatch, GroupNormEmulator, arena_bytes=1 << 26) as emu:
        monkeypatch.setattr(GN, "device", types.SimpleNamespace(
            device_info=lambda dev: types.SimpleNamespace(cc=emu.cc, sm_count=emu.sms)))

        def kernels(shape, groups, layout="nchw"):
            emu.arena.top = 0
            emu.launches.clear()
            _, x = _emulated_input(emu.arena, rng, shape, dt.float16, layout, 0)
            impl(FakeCall(emu.arena, "group_norm"), x, groups, None, None, 1e-5, "silu",
                 layout == "nhwc")
            return [n for n, *_ in emu.launches]
        # 64 groups that fit one block each: one block per group (the measured winner)
        assert kernels((2, 320, 16, 16), 32) == ["group_norm_onchip"]
        assert emu.launches[0][2][0] == 64
        # groups too large for one block: the smallest cluster that holds them
        assert kernels((2, 4, 128, 256), 1) == ["group_norm_onchip_cluster"]
        assert emu.launches[0][1][2] == "2" and emu.launches[0][2][0] == 4
        assert kernels((8, 64, 8, 8), 32) == ["group_norm_onchip"]
        # small channels-last inputs: through NCHW copies (measured faster at 5 MB) ...
        assert "group_norm_onchip" in kernels((2, 16, 8, 8), 4, "strided_nhwc")
        # ... larger ones: the two-pass NHWC kernels
        monkeypatch.setattr(GN, "NHWC_COPY_MAX_BYTES", 1024)
        GN._plans.clear()                      # (the threshold is not part of the plans' key)
        assert kernels((2, 16, 8, 8), 4, "strided_nhwc") == ["group_norm_nhwc_stats",
                                                           "group_norm_nhwc_apply"]
        assert kernels((1, 4, 7, 7), 2) == ["group_norm_nchw_stats", "group_norm_nchw_apply"]


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_emulated_apply_orders(monkeypatch, rng, order):
    """Both block orders of the two-pass apply kernels cover every block once (A/B knob)."""
    impl = registry.get("group_norm").impl
    monkeypatch.setattr(GN, "apply_order", order)
    with emulated(monkeypatch, GroupNormEmulator, arena_bytes=1 << 26) as emu:
        monkeypatch.setattr(GN, "device", types.SimpleNamespace(
            device_info=lambda dev: types.SimpleNamespace(cc=emu.cc, sm_count=emu.sms)))
        for shape, groups, layout, force in [((1, 8, 64, 64), 2, "nchw", "twopass"),
                                             ((2, 8, 8, 320), 32, "nhwc", "nhwc")]:
            monkeypatch.setattr(GN, "force_path", force)
            emu.arena.top = 0
            host, x = _emulated_input(emu.arena, rng, shape, dt.float16, layout, 0)
            emu.launches.clear()
            y = impl(FakeCall(emu.arena, "group_norm"), x, groups, None, None, 1e-5, "silu",
                     layout == "nhwc")
            assert len(emu.launches) == 2 and emu.launches[1][2][0] > 1   # several apply blocks
            ref = GN.ref_group_norm(host.astype(np.float64), groups, activation="silu",
                                    channels_last=layout == "nhwc")
            np.testing.assert_allclose(emu.arena.read(y).astype(np.float64), ref,
                                       **TOL64["float16"])


def test_refused_cluster_launch_falls_back(monkeypatch, rng):
    impl = registry.get("group_norm").impl
    with emulated(monkeypatch, GroupNormEmulator) as emu:
        monkeypatch.setattr(GN, "device", types.SimpleNamespace(
            device_info=lambda dev: types.SimpleNamespace(cc=emu.cc, sm_count=emu.sms)))
        monkeypatch.setattr(GN, "_clusters_refused", {})
        monkeypatch.setattr(GN, "AUTO_RULE", 3)     # (this NumPy emulator has no resident kernel)

        def refuse(*args):
            raise RuntimeError("CUDA_ERROR_CLUSTER_OUT_OF_RESOURCES")
        monkeypatch.setattr(emu, "k_group_norm_onchip_cluster", refuse)
        # one group of 256 KB: clusters of 2, or (refused) the two-pass kernels
        host, x = _emulated_input(emu.arena, rng, (1, 4, 128, 256), dt.float16, "nchw", 0)
        ref = GN.ref_group_norm(host.astype(np.float64), 1, activation="silu")
        for attempt in range(2):
            emu.launches.clear()
            with pytest.warns(RuntimeWarning, match="refused") if attempt == 0 else \
                    contextlib.nullcontext():
                y = impl(FakeCall(emu.arena, "group_norm"), x, 1, None, None, 1e-5, "silu", False)
            np.testing.assert_allclose(emu.arena.read(y).astype(np.float64), ref, **TOL64["float16"])
            assert [n for n, *_ in emu.launches[-2:]] == ["group_norm_nchw_stats",
                                                          "group_norm_nchw_apply"]
        assert len(emu.launches) == 2        # the second call does not try clusters again


# ------------------------------------------------------------------------------ CPU: round 2 plans

def test_spread_plans():
    """group_norm_spread: every slice of a group lands in one block of at most the allowed threads;
    one wave (one block per SM) where groups * S fit the SMs, else two blocks per SM."""
    for clusters in (False, True):
        for groups in (1, 3, 64, 132, 256, 1000):
            for gp in (1, 7, 100, 256, 1280, 2560, 5120, 7168, 10240, 20480, 57344, 70000):
                plan = GN.plan_spread(groups, gp, 132, clusters)
                if plan is None:
                    assert gp > (8 if clusters else 1) * GN.SPREAD_MAX_THREADS * GN.SPREAD_PACKS
                    continue
                s, slice_packs, threads, res = plan
                assert s == 1 or (clusters and s in GN.CLUSTERS)
                assert s * slice_packs >= gp and (s - 1) * slice_packs < gp
                assert threads % 32 == 0 and threads * GN.SPREAD_PACKS >= slice_packs
                assert threads <= (GN.SPREAD_MAX_THREADS if res == 1 else GN.SPREAD_PAIR_THREADS)
                if groups * s <= 132 and res == 1:
                    continue
                assert res == 2 or slice_packs > GN.SPREAD_PAIR_THREADS * GN.SPREAD_PACKS
    # [2, 320, 64, 64]: 64 groups of 80 KB (16-bit) / 160 KB (fp32): clusters of 2, 128 SMs
    assert GN.plan_spread(64, 5120, 132, True) == (2, 2560, 384, 1)
    assert GN.plan_spread(64, 10240, 132, True) == (2, 5120, 736, 1)
    assert GN.plan_spread(64, 5120, 132, False) == (1, 5120, 736, 1)
    # [8, 640, 64, 64]: 256 groups; several waves, two blocks per SM
    assert GN.plan_spread(256, 10240, 132, True) == (4, 2560, 384, 2)
    assert GN.plan_spread(256, 20480, 132, True) == (8, 2560, 384, 2)
    # forced cluster sizes and residency (the A/B knobs)
    assert GN.plan_spread(64, 5120, 132, True, cluster=4) == (4, 1280, 192, 2)
    assert GN.plan_spread(64, 5120, 132, True, cluster=1, residency=1) == (1, 5120, 736, 1)
    with pytest.raises(RuntimeError, match="cluster size 2"):
        GN.plan_spread(64, 5120, 132, False, cluster=2)


def test_nhwc_spread_plans():
    for n, hw, c, g, vec in [(2, 4096, 320, 32, 8), (8, 4096, 640, 32, 8), (2, 4096, 320, 32, 4),
                             (1, 49, 12, 3, 4), (3, 37, 24, 8, 8), (1, 1, 8, 1, 8),
                             (4, 1024, 1280, 32, 8), (1, 7, 4096, 1, 8), (2, 100, 96, 96, 8)]:
        cg = c // g
        for clusters in (False, True):
            plan = GN.plan_nhwc_spread(n, hw, c, cg, vec, 132, clusters)
            if plan is None:
                continue
            sc, s, rpb, r, threads, res = plan
            p = sc // vec
            assert sc % cg == 0 and sc % vec == 0 and c % sc == 0
            assert s == 1 or (clusters and s in GN.CLUSTERS)
            assert s * rpb >= hw and r * GN.NHWC_SPREAD_ROWS >= rpb
            assert threads % 32 == 0 and threads >= p * r
            assert threads <= (GN.NHWC_SPREAD_THREADS if res == 1 else GN.NHWC_SPREAD_PAIR_THREADS)
    # [2, 64, 64, 320] bf16 channels-last: 16 (sample, 40-channel slab) items x 8 blocks of 512 rows
    assert GN.plan_nhwc_spread(2, 4096, 320, 10, 8, 132, True) == (40, 8, 512, 128, 640, 1)
    # [8, 64, 64, 640] bf16: 128 items; several waves of 2 blocks per SM
    assert GN.plan_nhwc_spread(8, 4096, 640, 20, 8, 132, True) == (40, 8, 512, 89, 448, 2)
    assert GN.plan_nhwc_spread(1, 7, 4096, 4096, 8, 132, True) == (4096, 8, 1, 1, 512, 1)
    assert GN.plan_nhwc_spread(1, 7, 8192, 8192, 8, 132, True) is None   # 1024 columns: too wide


def test_spread_smem_reservation():
    h100 = 227 * 1024
    one, two = GN.spread_smem(1000, 1, h100), GN.spread_smem(1000, 2, h100)
    # with the 1 KB per block the driver keeps: `res` blocks fit in 228 KB, res + 1 do not
    for res, m in ((1, one), (2, two)):
        assert res * (m + 1024) <= 228 * 1024 < (res + 1) * (m + 1024)
    assert GN.spread_smem(200 * 1024, 2, h100) == 200 * 1024          # the kernel's own need wins
    assert GN.spread_smem(300 * 1024, 1, h100) == 0                   # too much: no launch
    assert GN.spread_smem(1000, 1, 48 * 1024) == 1000                 # Pascal: no reservation


def _f32(v):
    return np.float32(v)


def _rcp_newton_model(d):
    """rcp_newton of common/activations.cuh in float32 steps (each fma rounded once, as on the GPU)."""
    d = np.asarray(d, np.float32)
    r = (np.int32(0x7EF311C3) - d.view(np.int32)).view(np.float32)
    for _ in range(3):
        e = (1.0 - d.astype(np.float64) * r.astype(np.float64)).astype(np.float32)
        r = (r.astype(np.float64) * e + r).astype(np.float32)
    return r


def test_newton_reciprocal_accuracy(rng):
    """SiLU's FMA-pipe reciprocal: < 3e-7 relative on 1 <= d <= 2^126 (its whole domain)."""
    d = np.concatenate([np.linspace(1, 2, 100001), 2.0 ** rng.uniform(0, 126, 200000),
                        [1.0, 2.0 ** 126, 1.5, 3.0]]).astype(np.float32)
    r = _rcp_newton_model(d)
    rel = np.abs(r.astype(np.float64) * d.astype(np.float64) - 1.0)
    assert rel.max() < 3e-7, rel.max()


class SpreadEmu:
    """gpuops.ops.group_norm's host code on the C++ CPU emulation of its kernels (tests/emu.py:
    every CUDA thread a fiber, a cluster's blocks run together with their own dynamic shared
    memory). For the round-2 kernels, which keep all shared data in dynamic shared memory."""

    def __init__(self, monkeypatch, arch=90, sms=132, optin=227 * 1024):
        import emu  # noqa: PLC0415  (tests/emu.py)
        if not emu.available():
            pytest.skip("the CPU emulator needs g++")
        self.emu, self.arch = emu, arch
        lib, index = emu.build(GN.MODULE, arch * 10)      # emu: __CUDA_ARCH__ = 900

        def get(_dev, expr):
            return emu.EmuKernel(lib, index[expr], GN.MODULE.kernels[expr], expr,
                                 GN.CLUSTER_OF.get(expr, 1))
        monkeypatch.setattr(GN.KERNELS, "get", get)
        monkeypatch.setattr(GN.KERNELS, "target_arch", lambda _dev: arch)
        monkeypatch.setattr(GN, "device", types.SimpleNamespace(
            device_info=lambda _dev: types.SimpleNamespace(cc=arch, sm_count=sms,
                                                           max_smem_per_block_optin=optin)))
        monkeypatch.setattr(GN._copy, "sm_count", lambda _dev: sms)
        monkeypatch.setattr(GN, "_clusters_refused", {})
        # (no resident kernels here: auto does not take them; ResidentEmu emulates them)
        monkeypatch.setattr(GN._norms, "copies_async", lambda _module, _dev: False)
        GN._plans.clear()
        self.dev = emu.Device(sms=sms, arch=arch)
        self.impl = registry.get("group_norm").impl

    def tensor(self, a, d, misalign=False):
        if misalign:
            flat = np.empty(a.size + 1, a.dtype)
            flat[1:] = a.reshape(-1)
            a = flat[1:].reshape(a.shape)
        return self.dev.tensor(a, d)

    def run(self, x, groups, w, b, act, channels_last=False, eps=1e-5):
        self.emu.Device.launches = []
        y = self.impl(self.dev.call("group_norm", x.dtype), x, groups, w, b, eps, act,
                      channels_last)
        return y, [name for name, *_ in self.emu.Device.launches]


def _spread_case(rng, se, shape, groups, dtype, affine, act, layout, misalign=False):
    """Random input of `shape` ([N, C, *sp]) in `layout`, through the emulated kernels against
    the float64 reference; returns the kernels launched."""
    d = dt.BY_NAME[dtype]
    host = (rng.standard_normal(shape) * 2 + 0.5).astype(np_storage(d))
    c = shape[1]
    w = (rng.standard_normal(c)).astype(np_storage(d)) if affine else None
    b = (rng.standard_normal(c)).astype(np_storage(d)) if affine else None
    wt = None if w is None else se.tensor(w, d)
    bt = None if b is None else se.tensor(b, d)
    perm = (0, *range(2, len(shape)), 1)
    if layout == "nchw":
        x = se.tensor(host, d, misalign)
        cl = False
    elif layout == "nhwc":                           # channels_last=True: [N, *sp, C] arrays
        x = se.tensor(np.ascontiguousarray(host.transpose(perm)), d, misalign)
        cl = True
    else:                                            # "strided": an NCHW view of NHWC memory
        mem = np.ascontiguousarray(host.transpose(perm))
        view = mem.transpose(np.argsort(perm))
        x = se.tensor(view, d)
        cl = False
    y, names = se.run(x, groups, wt, bt, act, cl)
    ref = GN.ref_group_norm(host.astype(np.float64), groups,
                            None if w is None else w.astype(np.float64),
                            None if b is None else b.astype(np.float64), 1e-5, act)
    got = np.asarray(y.obj).astype(np.float64)
    if layout == "nhwc":
        got = np.moveaxis(got, -1, 1)
    assert_close(got, ref, dtype, f"{shape} G={groups} {layout} affine={affine} act={act} "
                                  f"{names}")
    return names


# (shape, groups, layout, forced cluster size): odd C / G, spatial sizes that do not divide into
# the blocks' slices or rows, 1-3 spatial dims, one channel per group, one group.
SPREAD_CASES = [
    ((2, 32, 8, 8), 8, "nchw", None), ((2, 12, 16, 6), 4, "nchw", None),
    ((1, 10, 8, 12), 5, "nchw", 2), ((3, 6, 40), 3, "nchw", 4), ((1, 8, 4, 4, 8), 1, "nchw", 8),
    ((2, 16, 24), 16, "nchw", None), ((1, 4, 64, 64), 2, "nchw", 8),
    ((2, 40, 5, 7), 4, "nhwc", None), ((1, 24, 37), 8, "nhwc", 4), ((2, 64, 3, 3), 32, "nhwc", 2),
    ((1, 16, 9, 9), 1, "nhwc", 8), ((2, 48, 4, 5), 16, "strided", None),
    ((1, 320, 4, 4), 32, "strided", 8), ((1, 8, 33), 8, "nhwc", None),
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_spread_kernels_on_the_cpu_emulator(monkeypatch, rng, dtype):
    """Every round-2 kernel (NCHW and channels-last, no cluster and clusters of 2 / 4 / 8), silu
    on and off, weight/bias present and absent, outputs poisoned (the emulator fills them with
    0xFF), against the float64 reference."""
    se = SpreadEmu(monkeypatch)
    for shape, groups, layout, cluster in SPREAD_CASES:
        monkeypatch.setattr(GN, "force_path", "spread" if layout == "nchw" else "nhwc_spread")
        monkeypatch.setattr(GN, "spread_cluster", cluster)
        for affine, act in ((True, "silu"), (False, None), (True, None), (False, "silu")):
            names = _spread_case(rng, se, shape, groups, dtype, affine, act, layout)
            kind = "spread" if layout == "nchw" else "nhwc_spread"
            assert names and names[0].startswith(f"gpuops::group_norm_{kind}<"), names
            if cluster is not None:
                assert names[0].endswith(f", {cluster}>"), names


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_spread_kernels_several_waves(monkeypatch, rng, dtype):
    """Plans for more groups than SMs (two blocks per SM), and auto with AUTO_SPREAD; on sm_61
    (no clusters) the same calls take the one-block-per-group kernels."""
    for arch, sms in ((90, 4), (90, 132), (61, 4)):
        se = SpreadEmu(monkeypatch, arch=arch, sms=sms,
                       optin=227 * 1024 if arch >= 90 else 48 * 1024)
        monkeypatch.setattr(GN, "AUTO_SPREAD", True)
        monkeypatch.setattr(GN, "AUTO_RULE", 2)         # (rule 3 takes the stream kernel first)
        monkeypatch.setattr(GN, "force_path", None)
        for shape, groups, layout in [((4, 16, 32, 32), 4, "nchw"), ((2, 4, 64, 64), 1, "nchw"),
                                      ((3, 64, 16, 16), 8, "nhwc"), ((2, 32, 8, 40), 4, "strided")]:
            names = _spread_case(rng, se, shape, groups, dtype, True, "silu", layout)
            assert len(names) == 1 and "spread" in names[0], names
            if arch < 90:
                assert names[0].endswith(", 1>"), names


def test_spread_kernels_decline_what_they_cannot_do(monkeypatch, rng):
    """Unaligned inputs and hw not a multiple of 16 bytes (NCHW) take the older kernels, with the
    same results; so do channels-last inputs with C not a multiple of 16 bytes, or unaligned."""
    se = SpreadEmu(monkeypatch, arch=61, optin=48 * 1024)
    monkeypatch.setattr(GN, "AUTO_SPREAD", True)
    for shape, groups, misalign in [((2, 8, 6, 6), 4, False), ((2, 8, 8, 8), 4, True)]:
        names = _spread_case(rng, se, shape, groups, "float16", True, "silu", "nchw", misalign)
        assert not any("spread" in n for n in names), names
    monkeypatch.setattr(GN, "NHWC_COPY_MAX_BYTES", 0)
    d = dt.float16
    for c, aligned in ((12, True), (16, False), (16, True)):
        run = GN._nhwc_launcher(0, d, 2, c, 25, 4, aligned, 1)
        assert run.__name__ == ("run_nhwc_spread" if (c, aligned) == (16, True) else "run_nhwc")


def test_spread_statistics_are_stable_and_nan_stays_in_its_group(monkeypatch, rng):
    """Through the clustered (and unclustered) NCHW and channels-last kernels: (1) a mean of 1000
    against a spread of 1 (exact two-pass statistics: E[x^2] - E[x]^2 would be off by ~1e6 * 6e-8
    of the variance, 3% of the output; what is left is fp32's rounding of the mean, ulp(1000) *
    rstd = 6e-5); (2) extreme biases through SiLU (-inf -> NaN, -100 -> -0, +inf -> inf, as
    torch) and a NaN that poisons its own group only."""
    se = SpreadEmu(monkeypatch)
    d = dt.float32
    for layout, force, cluster in (("nchw", "spread", 4), ("nhwc", "nhwc_spread", 4),
                                   ("nchw", "spread", 1), ("nhwc", "nhwc_spread", 1)):
        monkeypatch.setattr(GN, "force_path", force)
        monkeypatch.setattr(GN, "spread_cluster", cluster)

        def run(host, w, b, act):
            x = np.ascontiguousarray(np.moveaxis(host, 1, -1)) if layout == "nhwc" else host
            y, names = se.run(se.tensor(x, d), 4, se.tensor(w, d), se.tensor(b, d), act,
                              layout == "nhwc")
            got = np.asarray(y.obj).astype(np.float64)
            return (np.moveaxis(got, -1, 1) if layout == "nhwc" else got), names

        host = (rng.standard_normal((2, 8, 16, 16)) + 1000.0).astype(np.float32)
        ones, zeros = np.ones(8, np.float32), np.zeros(8, np.float32)
        got, names = run(host, ones, zeros, None)
        ref = GN.ref_group_norm(host.astype(np.float64), 4)
        err = np.abs(got - ref)
        assert np.all(err <= 1e-5 * np.abs(ref) + 1.5e-4), f"{layout} {names}: {err.max()}"

        host = (rng.standard_normal((2, 8, 16, 16)) * 2 + 0.5).astype(np.float32)
        host[1, 5, 3, 7] = np.nan                                # sample 1, group 2 (ch 4, 5)
        b = np.array([0, -100, -np.inf, np.inf, 0, 0, 1, 2], np.float32)
        got, names = run(host, ones, b, "silu")
        ref = GN.ref_group_norm(host.astype(np.float64), 4, ones, b, 1e-5, "silu")
        # the NaN fills its own group (sample 1, channels 4-5) only; channel 2 is NaN through
        # silu(-inf) everywhere, as in the reference (assert_close compares the NaN positions)
        assert np.isnan(got[1, 4:6]).all() and not np.isnan(got[:, [0, 1, 3, 6, 7]]).any(), names
        assert np.isnan(got[:, 2]).all() and not np.isnan(got[0, 4:6]).any()
        assert np.all(got[:, 1] == 0) and np.all(got[:, 3] == np.inf)
        assert_close(got, ref, "float32", f"{layout} cluster={cluster} {names}")


def test_stream_plans():
    """group_norm_stream: the smallest cluster whose slice fits a block of STREAM_THREADS, as many
    clusters as two blocks per SM allow (at most one per group); None past 8 blocks' slices."""
    for groups in (1, 7, 64, 256, 5000):
        for gp in (1, 5, 100, 2688, 2689, 10240, 20480, 21504, 21505):
            for clusters in (True, False):
                plan = GN.plan_stream(groups, gp, 132, clusters)
                sizes = (1, 2, 4, 8) if clusters else (1,)
                fit = [s for s in sizes if -(-gp // s) <= GN.STREAM_MAX_PACKS]
                if not fit:
                    assert plan is None, (groups, gp, clusters)
                    continue
                s, slice_packs, threads, launched = plan
                assert s == fit[0] and slice_packs * s >= gp > slice_packs * (s - 1) - s
                assert threads % 32 == 0 and threads * GN.SPREAD_PACKS >= slice_packs
                assert threads <= GN.STREAM_THREADS
                assert launched == max(1, min(groups, 264 // s))
    # the bench's multi-wave shapes: [8, 640, 64, 64] 16-bit and fp32, [4, 1280, 32, 32] fp32
    assert GN.plan_stream(256, 10240, 132, True) == (4, 2560, 384, 66)
    assert GN.plan_stream(256, 20480, 132, True) == (8, 2560, 384, 33)
    assert GN.plan_stream(128, 10240, 132, True) == (4, 2560, 384, 66)
    assert GN.plan_stream(32, 65536, 132, True) is None        # [1, 256, 256, 256]: 1 MiB groups
    assert GN.plan_stream(64, 5120, 132, True, cluster=8) == (8, 640, 96, 33)
    with pytest.raises(RuntimeError, match="cluster size 2"):
        GN.plan_stream(64, 5120, 132, False, cluster=2)


# (shape, groups, forced cluster size): more groups than the emulated grid's clusters (every
# block loops), odd C / G, 1-3 spatial dims, clusters whose last slices are empty
STREAM_CASES = [((3, 12, 8, 8), 6, None), ((2, 10, 5, 8), 5, 1), ((5, 6, 16), 3, 2),
                ((1, 8, 4, 4, 8), 4, 4), ((2, 4, 8), 2, 4), ((4, 16, 8, 8), 4, 8),
                ((3, 32, 24), 16, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_stream_kernels_on_the_cpu_emulator(monkeypatch, rng, dtype):
    """group_norm_stream (no cluster and clusters of 2 / 4 / 8) on an emulated GPU of 2 SMs, so
    that each block takes several groups in turn through its shared-memory prefetch: silu on and
    off, weight / bias present and absent, outputs poisoned, against the float64 reference."""
    se = SpreadEmu(monkeypatch, sms=2)
    monkeypatch.setattr(GN, "force_path", "stream")
    for shape, groups, cluster in STREAM_CASES:
        monkeypatch.setattr(GN, "spread_cluster", cluster)
        for affine, act in ((True, "silu"), (False, None), (True, None), (False, "silu")):
            names = _spread_case(rng, se, shape, groups, dtype, affine, act, "nchw")
            assert len(names) == 1 and names[0].startswith("gpuops::group_norm_stream<"), names
            if cluster is not None:
                assert names[0].endswith(f", {cluster}>"), names


def _stable_and_nan_in_its_group(se, shape, rng, what=""):
    """Through se's forced kernel, [N >= 2, 8, ...] fp32 in 4 groups: (1) a mean of 1000 against a
    spread of 1: what is left is fp32's rounding of the mean, which goes through a tree of merges
    (thread, warp, block, grid), each rounding it by up to half an ulp: at most 8 ulps of 1000
    allowed (25 seeds measured up to 2.3 for the resident kernel, 1.3 for the two-pass ones; an
    earlier bound of 2.5 ulps failed one seed in ~7); statistics by sum and sum of squares would
    be off by 1e-2 or more; (2) a NaN (sample 1, channel 5: group 2) that poisons its own group
    only, through SiLU."""
    d = dt.float32
    host = (rng.standard_normal(shape) + 1000.0).astype(np.float32)
    y, names = se.run(se.tensor(host, d), 4, None, None, None)
    ref = GN.ref_group_norm(host.astype(np.float64), 4)
    err = np.abs(np.asarray(y.obj).astype(np.float64) - ref)
    mean_ulps = 8 * float(np.spacing(np.float32(1000.0)))
    assert np.all(err <= 1e-5 * np.abs(ref) + mean_ulps), f"{what} {names}: {err.max()}"
    host = (rng.standard_normal(shape) * 2 + 0.5).astype(np.float32)
    host[1, 5, 3, 7] = np.nan                                    # sample 1, group 2 (ch 4, 5)
    y, names = se.run(se.tensor(host, d), 4, None, None, "silu")
    got = np.asarray(y.obj).astype(np.float64)
    nan = np.zeros(got.shape, bool)
    nan[1, 4:6] = True
    assert np.array_equal(np.isnan(got), nan), names
    ref = GN.ref_group_norm(host.astype(np.float64), 4, None, None, 1e-5, "silu")
    assert_close(got, ref, "float32", f"{what} {names}")


def test_stream_kernel_statistics_are_stable_and_nan_stays_in_its_group(monkeypatch, rng):
    """As the spread kernels' test, through group_norm_stream with and without clusters: a mean
    of 1000 against a spread of 1, and a NaN that poisons its own group only (here the groups
    also pass through each block's prefetch buffer one after the other)."""
    se = SpreadEmu(monkeypatch, sms=1)
    monkeypatch.setattr(GN, "force_path", "stream")
    for cluster in (1, 4):
        monkeypatch.setattr(GN, "spread_cluster", cluster)
        _stable_and_nan_in_its_group(se, (3, 8, 16, 16), rng, f"cluster={cluster}")


@pytest.mark.parametrize("rounds", [1, None])
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_pass_kernels_on_the_cpu_emulator(monkeypatch, rng, dtype, rounds):
    """The NCHW two-pass kernels' own code (stats chunks of one round, and the one-wave plan) on
    the C++ emulation: several chunks and apply tiles per group (4 SMs), channel boundaries inside
    tiles, 16-byte and one-element units (hw not a multiple of 16 bytes), affine and SiLU on and
    off; in fp32 also a mean of 1000 against a spread of 1, and a NaN that stays in its group."""
    se = SpreadEmu(monkeypatch, sms=4)
    monkeypatch.setattr(GN, "force_path", "twopass")
    monkeypatch.setattr(GN, "STATS_CHUNK_ROUNDS", rounds)
    for shape, groups in [((1, 8, 64, 64), 2), ((2, 6, 20, 40), 3), ((1, 4, 7, 7), 2),
                          ((2, 3, 96, 65), 1)]:
        for affine, act in ((True, "silu"), (False, None)):
            names = _spread_case(rng, se, shape, groups, dtype, affine, act, "nchw")
            assert [n.split("<")[0] for n in names] == ["gpuops::group_norm_nchw_stats",
                                                        "gpuops::group_norm_nchw_apply"]
    if dtype == "float32":
        _stable_and_nan_in_its_group(se, (2, 8, 40, 40), rng, f"rounds {rounds}")


def test_two_pass_stats_plans(monkeypatch):
    """group_norm_nchw_stats' chunks cover each group exactly: chunks of STATS_CHUNK_ROUNDS
    rounds (at most STATS_MAX_CHUNKS per group), or with None one wave of at most
    STATS_BLOCKS_PER_SM blocks per SM unless the groups alone take more."""
    per_round = GN.TWO_PASS_THREADS * GN.STATS_UNROLL
    for rounds in (None, 1, 2):
        monkeypatch.setattr(GN, "STATS_CHUNK_ROUNDS", rounds)
        for groups in (1, 3, 32, 256, 5000):
            for gu in (1, 100, per_round, per_round + 1, 131072, 10 ** 7):
                chunks, cu = GN.plan_two_pass(groups, gu, 132)
                assert chunks >= 1 and (chunks - 1) * cu < gu <= chunks * cu, (rounds, groups, gu)
                if rounds:
                    assert chunks <= GN.STATS_MAX_CHUNKS
                    assert cu == -(-gu // chunks)
                    if chunks < GN.STATS_MAX_CHUNKS:
                        assert cu <= rounds * per_round
                else:
                    assert groups * chunks <= max(groups, GN.STATS_BLOCKS_PER_SM * 132)
                    assert chunks == 1 or cu >= per_round // 2
    monkeypatch.setattr(GN, "STATS_CHUNK_ROUNDS", 1)
    assert GN.plan_two_pass(32, 131072, 132) == (64, 2048)     # fp32 [1, 256, 256, 256]


def test_auto_rule3_routes(monkeypatch, rng):
    """AUTO_RULE = 3 on an emulated sm_90 of 4 SMs: groups that need several rounds of the grid
    take group_norm_stream, groups that fit one wave group_norm_spread, small channels-last
    inputs group_norm_nhwc_spread with two blocks per SM, and (on 132 SMs) 1 MiB groups, whose
    on-chip blocks would take a whole SM over several waves, the two-pass kernels (round 2's rule
    keeps the on-chip cluster there); results against the float64 reference."""
    se = SpreadEmu(monkeypatch, sms=4)
    monkeypatch.setattr(GN, "AUTO_RULE", 3)
    for shape, groups, kernel in [((4, 16, 8, 8), 4, "stream"), ((1, 8, 8, 8), 2, "spread"),
                                  ((3, 12, 16), 6, "stream")]:
        names = _spread_case(rng, se, shape, groups, "bfloat16", True, "silu", "nchw")
        assert len(names) == 1 and names[0].startswith(f"gpuops::group_norm_{kernel}<"), names
    se = SpreadEmu(monkeypatch, sms=132)
    for rule, name in ((3, "run_two_pass"), (2, "run_cluster")):
        monkeypatch.setattr(GN, "AUTO_RULE", rule)
        run = GN._nchw_launcher(0, dt.bfloat16, 1, 256, 65536, 32, True, 1)
        assert run.__name__ == name, rule
    # small channels-last inputs: the channels-last spread kernel with two blocks per SM
    se = SpreadEmu(monkeypatch, sms=4)
    monkeypatch.setattr(GN, "AUTO_RULE", 3)
    for dtype in ("bfloat16", "float32"):
        names = _spread_case(rng, se, (2, 40, 5, 7), 4, dtype, True, "silu", "nhwc")
        assert names == [f"gpuops::group_norm_nhwc_spread<{dt.BY_NAME[dtype].ctype}, 1>"], names
    assert GN.plan_nhwc_spread(2, 4096, 320, 10, 8, 132, True, pair=True) == (
        40, 8, 512, 89, 448, 2)                      # run 116's nhwc_spread_r2 at the bench shape
    assert GN.plan_nhwc_spread(2, 4096, 320, 10, 4, 132, True, pair=True) == (
        20, 8, 512, 89, 448, 2)                      # fp32: run 116's nhwc_spread_c8
    se = SpreadEmu(monkeypatch, sms=132)
    # the stream kernel only where a group fits one block ([16, 640, 32, 32] 16-bit); with
    # clusters ([8, 640, 64, 64], clusters of 4) the one-shot on-chip clusters stay
    monkeypatch.setattr(GN, "AUTO_RULE", 3)
    assert GN._nchw_launcher(0, dt.bfloat16, 16, 640, 1024, 32, True, 1).__name__ == "run_stream"
    assert GN._nchw_launcher(0, dt.bfloat16, 8, 640, 4096, 32, True, 1).__name__ == "run_cluster"


# ------------------------------------------------------------------------------ resident (round 4)

class ResidentEmu(SpreadEmu):
    """SpreadEmu with group_norm_resident (its own module) emulated too: every block of a launch
    at once (the blocks poll for each other's published statistics), the occupancy calculator
    replaced by one block per SM, and one ring2 state buffer kept across launches, as on the GPU
    (each launch must ignore the words of the launches before it)."""

    def __init__(self, monkeypatch, sms=4, optin=227 * 1024, straggle=0):
        super().__init__(monkeypatch, sms=sms, optin=optin)
        self.straggle = straggle     # (emu.h: blocks held back, so that polls meet stale words)
        monkeypatch.setattr(self.emu.Device, "straggle", straggle)
        lib, index = self.emu.build(GN.RESIDENT_MODULE, self.arch * 10)

        def get(_dev, expr):
            return self.emu.EmuKernel(lib, index[expr], GN.RESIDENT_MODULE.kernels[expr], expr)
        monkeypatch.setattr(GN.RESIDENT_KERNELS, "get", get)
        monkeypatch.setattr(GN._norms, "copies_async", lambda _module, _dev: self.arch >= 80)
        monkeypatch.setattr(GN._norms, "device", GN.device)
        monkeypatch.setattr(GN._norms, "_resident_per_sm", lambda kernel, threads, smem: 1)
        self.state = np.zeros(1 << 16, np.uint32)

        def ring2_state(call, words):
            assert GN._norms.RING2_HEADER_WORDS + 2 * words <= self.state.size
            return self.state.ctypes.data
        monkeypatch.setattr(GN._norms, "ring2_state", ring2_state)
        self.concurrent = True       # (False for kernels with static shared memory: onchip)

    def run(self, *args, **kw):
        self.emu.Device.concurrent = self.concurrent
        try:
            return super().run(*args, **kw)
        finally:
            self.emu.Device.concurrent = False


# (shape, groups, shared memory per block): groups split into several tiles (C > 1) with a ragged
# last tile, channel boundaries inside tiles and packs of a tile in different channels, blocks
# holding D + 1 tiles (the last in registers) where the shared memory allows only D = 2 slots,
# whole groups in one tile (C = 1), one channel per group, 1 and 3 spatial dims; a case that does
# not fit (the forced path falls back to auto's kernels).
RESIDENT_CASES = [((2, 6, 40, 136), 3, 48 * 1024), ((1, 4, 64, 64), 2, 227 * 1024),
                  ((3, 8, 8, 8), 4, 227 * 1024), ((2, 4, 2048), 4, 40 * 1024),
                  ((1, 6, 4, 8, 24), 2, 227 * 1024), ((2, 4, 128, 130), 2, 48 * 1024)]


def _resident_plan(shape, groups, dtype, sms):
    d = dt.BY_NAME[dtype]
    vec = 16 // d.itemsize
    elems = shape[1] // groups * prod(shape[2:])
    ring = GN._norms.fit_ring_plan(None, GN._norms.LAYER_NORM, vec, elems, d.itemsize, 0,
                                   "resident")
    return ring, GN._norms.ring_grid(ring, shape[0] * groups)


@pytest.mark.parametrize("dtype", DTYPES)
def test_resident_kernel_on_the_cpu_emulator(monkeypatch, rng, dtype):
    """group_norm_resident forced, on an emulated sm_90 of 4 SMs (per-thread cp.async copies; the
    bulk copies are sm_90 GPU code): silu on and off, weight / bias present and absent, outputs
    poisoned, against the float64 reference; several launches on one ring2 state; in place."""
    seen_split = seen_regs = False
    for shape, groups, optin in RESIDENT_CASES:
        se = ResidentEmu(monkeypatch, optin=optin)
        monkeypatch.setattr(GN, "force_path", "resident")
        ring, grid = _resident_plan(shape, groups, dtype, se.dev.sms)
        if grid is None:            # (fp32 [2, 4, 128, 130]: 9 tiles a group, 3 per block at most)
            se.concurrent = False
            names = _spread_case(rng, se, shape, groups, dtype, True, "silu", "nchw")
            assert not any("resident" in n for n in names), names
            continue
        tiles = shape[0] * groups * ring.C
        seen_split |= ring.C > 1
        seen_regs |= -(-tiles // grid) == ring.depth + 1
        for affine, act in ((True, "silu"), (False, None), (True, None), (False, "silu")):
            names = _spread_case(rng, se, shape, groups, dtype, affine, act, "nchw")
            assert names == [GN._resident_expr(dt.BY_NAME[dtype])], names
        d = dt.BY_NAME[dtype]
        host = (rng.standard_normal(shape) * 3 - 1).astype(np_storage(d))
        x = se.tensor(host.copy(), d)
        se.emu.Device.launches = []
        se.emu.Device.concurrent = True
        try:
            y = se.impl(se.dev.call("group_norm", d), x, groups, None, None, 1e-5, "silu", False,
                        out=x)
        finally:
            se.emu.Device.concurrent = False
        assert y is x and len(se.emu.Device.launches) == 1
        ref = GN.ref_group_norm(host.astype(np.float64), groups, activation="silu")
        assert_close(np.asarray(x.obj).astype(np.float64), ref, dtype, f"in place {shape}")
    assert seen_split and seen_regs


def test_resident_statistics_are_stable_and_nan_stays_in_its_group(monkeypatch, rng):
    """As the spread kernels' test, through group_norm_resident with groups split over tiles of
    several blocks: a mean of 1000 against a spread of 1, and a NaN that poisons its own group."""
    se = ResidentEmu(monkeypatch, optin=48 * 1024)
    monkeypatch.setattr(GN, "force_path", "resident")
    shape = (2, 8, 48, 64)
    ring, _ = _resident_plan(shape, 4, "float32", 4)
    assert ring.C > 1
    _stable_and_nan_in_its_group(se, shape, rng)


def test_resident_plan_and_routes(monkeypatch, rng):
    """On 132 SMs of 227 KiB: the VAE shape's 16-bit groups fit on chip (32 tiles of 32 KiB per
    group, 7 slots and one register tile per block, 128 blocks); its fp32 groups (67 MB) do
    not, so "resident" falls back to auto's plan there; auto (rule 4) takes it where no spread or
    stream plan does and it fits, and only where the module copies asynchronously (sm_80+)."""
    ResidentEmu(monkeypatch, sms=132)               # (patches the plan's device and kernels)
    ring, grid = _resident_plan((1, 256, 256, 256), 32, "bfloat16", 132)
    assert (ring.threads, ring.C, ring.depth, grid) == (512, 32, 7, 128)
    assert _resident_plan((1, 256, 256, 256), 32, "float32", 132)[1] is None
    monkeypatch.setattr(GN, "force_path", "resident")
    assert GN._nchw_launcher(0, dt.bfloat16, 1, 256, 65536, 32, True, 1).__name__ == \
        "run_resident"
    assert GN._nchw_launcher(0, dt.float32, 1, 256, 65536, 32, True, 1).__name__ != \
        "run_resident"
    assert GN._nchw_launcher(0, dt.bfloat16, 1, 256, 65536, 32, False, 1).__name__ != \
        "run_resident"                                     # (unaligned: no 16-byte units)
    monkeypatch.setattr(GN, "force_path", None)
    # rule 4 (the default): resident where neither one-wave spread nor multi-round stream plans
    # exist and the input fits; rule 3 keeps the two-pass / on-chip kernels there
    assert GN.AUTO_RULE == 4
    for args, name in [((dt.bfloat16, 1, 256, 65536), "run_resident"),
                       ((dt.float32, 4, 1280, 1024), "run_resident"),
                       ((dt.float32, 1, 256, 65536), "run_two_pass"),     # (67 MB: no fit)
                       ((dt.bfloat16, 2, 320, 4096), "run_cluster"),      # (spread, 2 / group)
                       ((dt.bfloat16, 16, 640, 1024), "run_stream")]:
        assert GN._nchw_launcher(0, *args, 32, True, 1).__name__ == name, args
    monkeypatch.setattr(GN, "AUTO_RULE", 3)
    assert GN._nchw_launcher(0, dt.bfloat16, 1, 256, 65536, 32, True, 1).__name__ == \
        "run_two_pass"
    monkeypatch.setattr(GN, "AUTO_RESIDENT", True)                # (before spread and stream)
    assert GN._nchw_launcher(0, dt.bfloat16, 2, 320, 4096, 32, True, 1).__name__ == \
        "run_resident"
    monkeypatch.setattr(GN._norms, "copies_async", lambda _module, _dev: False)   # (compute_61)
    assert GN._nchw_launcher(0, dt.float32, 4, 1280, 1024, 32, True, 1).__name__ != \
        "run_resident"


# (shape [N, C, *sp], groups): samples cut into runs with a ragged last run, a group's channels
# across 16-byte columns (cg = 10, 3, 6) and several groups in one column (cg = 1, 2), idle
# threads (512 not a multiple of C / VEC), more groups than warps, one column (C = VEC), fewer
# rows than blocks, one run per sample (N = 3 on 4 SMs), 1 and 3 spatial dims, one group.
NHWC_RESIDENT_CASES = [((2, 40, 9, 7), 4), ((2, 320, 6, 5), 32), ((1, 96, 5, 5), 32),
                       ((3, 8, 11), 4), ((1, 24, 2, 3, 4), 4), ((1, 16, 3), 1),
                       ((2, 64, 4, 4), 64)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_nhwc_resident_kernel_on_the_cpu_emulator(monkeypatch, rng, dtype):
    """group_norm_nhwc_resident forced, on an emulated sm_90 of 4 SMs (its blocks all at once,
    some held back at random: they poll for each other's published statistics and meet words not
    published yet), channels-last arrays and torch-style
    strided views, silu on and off, weight / bias present and absent, outputs poisoned, against the
    float64 reference; several launches on one ring2 state; in place."""
    se = ResidentEmu(monkeypatch, straggle=50)
    monkeypatch.setattr(GN, "force_path", "nhwc_resident")
    expr = GN._nhwc_resident_expr(dt.BY_NAME[dtype])
    seen_ragged = seen_idle = False
    for shape, groups in NHWC_RESIDENT_CASES:
        vec = 16 // dt.BY_NAME[dtype].itemsize
        hw = prod(shape[2:])
        plan = GN.plan_nhwc_resident(shape[0], hw, shape[1], groups, vec,
                                     dt.BY_NAME[dtype].itemsize, 4, lambda smem: 1, 227 * 1024)
        chunks, rows, _ = plan
        seen_ragged |= hw % rows != 0 and chunks > 1
        seen_idle |= GN.NHWC_RESIDENT_THREADS % (shape[1] // vec) != 0
        for layout in ("nhwc", "strided"):
            for affine, act in ((True, "silu"), (False, None), (True, None), (False, "silu")):
                names = _spread_case(rng, se, shape, groups, dtype, affine, act, layout)
                assert names == [expr], names
        d = dt.BY_NAME[dtype]
        host = (rng.standard_normal(shape) * 3 - 1).astype(np_storage(d))
        mem = np.ascontiguousarray(np.moveaxis(host, 1, -1))
        x = se.tensor(mem.copy(), d)
        se.emu.Device.launches = []
        se.emu.Device.concurrent = True
        try:
            y = se.impl(se.dev.call("group_norm", d), x, groups, None, None, 1e-5, "silu", True,
                        out=x)
        finally:
            se.emu.Device.concurrent = False
        assert y is x and len(se.emu.Device.launches) == 1
        ref = GN.ref_group_norm(host.astype(np.float64), groups, activation="silu")
        assert_close(np.moveaxis(np.asarray(x.obj).astype(np.float64), -1, 1), ref, dtype,
                     f"in place {shape}")
    assert seen_ragged and seen_idle


def test_nhwc_resident_statistics_are_stable_and_nan_stays_in_its_group(monkeypatch, rng):
    """Through group_norm_nhwc_resident with each sample's groups over two blocks' runs: a mean of
    1000 against a spread of 1 (at most 8 ulps of 1000: the bound of _stable_and_nan_in_its_group)
    and a NaN that poisons its own group only, through SiLU."""
    se = ResidentEmu(monkeypatch, straggle=50)
    monkeypatch.setattr(GN, "force_path", "nhwc_resident")
    shape, d = (2, 8, 12, 10), dt.float32
    host = (rng.standard_normal(shape) + 1000.0).astype(np.float32)
    x = se.tensor(np.ascontiguousarray(np.moveaxis(host, 1, -1)), d)
    y, names = se.run(x, 4, None, None, None, channels_last=True)
    assert names == [GN._nhwc_resident_expr(d)], names
    ref = GN.ref_group_norm(host.astype(np.float64), 4)
    err = np.abs(np.moveaxis(np.asarray(y.obj).astype(np.float64), -1, 1) - ref)
    assert np.all(err <= 1e-5 * np.abs(ref) + 8 * float(np.spacing(np.float32(1000.0)))), \
        err.max()
    host = (rng.standard_normal(shape) * 2 + 0.5).astype(np.float32)
    host[1, 5, 3, 7] = np.nan                                    # sample 1, group 2 (ch 4, 5)
    x = se.tensor(np.ascontiguousarray(np.moveaxis(host, 1, -1)), d)
    y, _ = se.run(x, 4, None, None, "silu", channels_last=True)
    got = np.moveaxis(np.asarray(y.obj).astype(np.float64), -1, 1)
    nan = np.zeros(got.shape, bool)
    nan[1, 4:6] = True
    assert np.array_equal(np.isnan(got), nan)
    assert_close(got, GN.ref_group_norm(host.astype(np.float64), 4, None, None, 1e-5, "silu"),
                 "float32", "nan")


def test_nhwc_resident_plan_and_routes(monkeypatch):
    """The bench's channels-last shape on 132 SMs of 227 KiB: one block per SM (66 runs of 63 rows
    per sample), 2 when asked (128 runs of 32), none where that does not fit or 8 x 42 MB does
    not fit at all; auto takes it for
    aligned channels-last inputs where it fits and the module copies asynchronously (sm_80+), fp32
    and 16-bit above NHWC_COPY_MAX_BYTES, and AUTO_NHWC_RESIDENT = False keeps rule 4's choice."""
    two, one = (lambda smem: 2 if smem <= 113 * 1024 else 1), (lambda smem: 1)
    plan = GN.plan_nhwc_resident(2, 4096, 320, 32, 8, 2, 132, two, 227 * 1024)
    assert plan[:2] == (66, 63) and plan[2] == GN.nhwc_resident_smem(320, 32, 8, 2, 63)
    assert GN.plan_nhwc_resident(2, 4096, 320, 32, 8, 2, 132, two, 227 * 1024, 2)[:2] == (128, 32)
    assert GN.plan_nhwc_resident(2, 4096, 320, 32, 8, 2, 132, one, 227 * 1024, 2) is None
    assert GN.plan_nhwc_resident(2, 4096, 320, 32, 4, 4, 132, one, 227 * 1024)[:2] == (66, 63)
    assert GN.plan_nhwc_resident(8, 4096, 640, 32, 8, 2, 132, two, 227 * 1024) is None
    assert GN.plan_nhwc_resident(2, 4096, 8192, 32, 8, 2, 132, two, 227 * 1024) is None  # C/VEC
    assert GN.plan_nhwc_resident(300, 16, 64, 32, 8, 2, 132, two, 227 * 1024) is None   # N > grid
    for n, hw, c in [(1, 7, 16), (3, 4096, 320), (2, 1000, 64), (5, 33, 128)]:
        chunks, rows, smem = GN.plan_nhwc_resident(n, hw, c, 4, 8, 2, 132, one, 227 * 1024)
        assert chunks * rows >= hw > (chunks - 1) * rows and n * chunks <= 132
    se = ResidentEmu(monkeypatch, sms=132)
    monkeypatch.setattr(GN._norms, "_resident_per_sm",
                        lambda kernel, threads, smem: two(smem) if smem <= 227 * 1024 else 0)
    spread = ("run_cluster", "run_nhwc_spread")          # (clusters of the spread kernel)
    # fp32, and 16-bit above NHWC_COPY_MAX_BYTES; 16-bit at most that keeps nhwc_spread
    for args, name in [((dt.float32, 2, 320, 4096), "run_nhwc_resident"),
                       ((dt.bfloat16, 16, 640, 1024), "run_nhwc_resident"),     # (21 MB)
                       ((dt.float32, 4, 1280, 1024), "run_nhwc_resident"),
                       ((dt.bfloat16, 2, 320, 4096), spread),
                       ((dt.float16, 4, 1280, 1024), spread),                   # (10.5 MB)
                       ((dt.bfloat16, 8, 640, 4096), "run_nhwc"),               # (no fit)
                       ((dt.float32, 16, 640, 1024), "run_nhwc")]:
        got = GN._nhwc_launcher(0, *args, 32, True, 1).__name__
        assert got in (name if isinstance(name, tuple) else (name,)), (args, got)
    assert GN._nhwc_launcher(0, dt.float32, 2, 320, 4096, 32, False, 1) is None   # (unaligned)
    monkeypatch.setattr(GN, "AUTO_NHWC_RESIDENT", False)
    assert GN._nhwc_launcher(0, dt.float32, 2, 320, 4096, 32, True, 1).__name__ in spread
    monkeypatch.setattr(GN, "AUTO_NHWC_RESIDENT", True)
    monkeypatch.setattr(GN._norms, "copies_async", lambda _module, _dev: False)   # (compute_61)
    assert GN._nhwc_launcher(0, dt.float32, 2, 320, 4096, 32, True, 1).__name__ in spread
    monkeypatch.setattr(GN, "force_path", "nhwc_resident")                       # (any arch)
    assert GN._nhwc_launcher(0, dt.bfloat16, 2, 320, 4096, 32, True, 1).__name__ == \
        "run_nhwc_resident"
    del se


# ------------------------------------------------------------------------------ GPU

def _randn(shape, dtype, scale=2.0, offset=0.5):
    return (torch.randn(shape, device="cuda") * scale + offset).to(getattr(torch, dtype))


def _host(t):
    return t.double().cpu().numpy()


def _check(x, groups, dtype, w=None, b=None, act="silu", what="", **kw):
    y = go.group_norm(x, groups, w, b, activation=act, **kw)
    ref = GN.ref_group_norm(_host(x), groups, None if w is None else _host(w),
                            None if b is None else _host(b), 1e-5, act,
                            kw.get("channels_last", False))
    assert_close(_host(y), ref, dtype, what)
    return y


@pytest.fixture
def force(monkeypatch):
    def set_path(path):
        monkeypatch.setattr(GN, "force_path", path)
    return set_path


def _clusters():
    return GN._clusters_available(torch.cuda.current_device())


SHAPES = [((2, 320, 64, 64), 32), ((1, 32, 8, 8), 8), ((3, 12, 7, 7), 4), ((2, 6, 5), 3),
          ((4, 8), 2), ((1, 1, 1, 1), 1), ((2, 64, 1, 1000), 32), ((1, 4, 3, 4097), 2),
          ((2, 128, 32, 32), 32), ((1, 32, 128, 128), 32), ((2, 16, 2, 3, 5), 8),
          ((1, 8, 256, 256), 2)]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_shapes(dtype):
    for shape, groups in SHAPES:
        x = _randn(shape, dtype)
        c = shape[1]
        w, b = _randn((c,), dtype, 1.0, 0.0), _randn((c,), dtype, 1.0, 0.0)
        _check(x, groups, dtype, w, b, "silu", f"{shape} G={groups}")
        _check(x, groups, dtype, None, None, None, f"{shape} G={groups} plain")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["onchip", "cluster2", "cluster4", "cluster8", "cluster2_1sm",
                                  "twopass", "spread"])
def test_gpu_each_nchw_design(dtype, path, force):
    if path.startswith("cluster") and not _clusters():
        pytest.skip("thread-block clusters need sm_90 kernels")
    force(path)
    for shape, groups in [((2, 320, 32, 32), 32), ((1, 16, 64, 64), 2), ((3, 8, 4, 8), 4),
                          ((1, 2, 128, 128), 1)]:
        x = _randn(shape, dtype)
        w, b = _randn((shape[1],), dtype, 1.0, 0.0), _randn((shape[1],), dtype, 1.0, 0.0)
        _check(x, groups, dtype, w, b, "silu", f"{path} {shape}")


SPREAD_KNOBS = [(None, None), (1, None), (2, None), (4, None), (8, None), (None, 1), (None, 2)]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "nhwc"])
def test_gpu_spread_kernels(dtype, layout, force, monkeypatch):
    """group_norm_spread / group_norm_nhwc_spread with their own plan, each cluster size and each
    residency: odd C / G, spatial sizes that do not divide into slices or rows, silu on and off,
    weight / bias absent, outputs poisoned with NaN; the launched kernel is the spread one."""
    force("spread" if layout == "nchw" else "nhwc_spread")
    shapes = [((2, 320, 64, 64), 32), ((2, 12, 16, 6), 4), ((1, 10, 8, 12), 5), ((3, 48, 37), 8),
              ((1, 64, 3, 3), 32), ((2, 16, 40, 40), 1), ((1, 24, 5, 5, 8), 3)]
    for cluster, residency in SPREAD_KNOBS:
        if cluster not in (None, 1) and not _clusters():
            continue
        monkeypatch.setattr(GN, "spread_cluster", cluster)
        monkeypatch.setattr(GN, "spread_residency", residency)
        for shape, groups in shapes:
            x = _randn(shape, dtype)
            c = shape[1]
            w, b = _randn((c,), dtype, 1.0, 0.0), _randn((c,), dtype, 1.0, 0.0)
            perm = (0, *range(2, len(shape)), 1)
            if layout == "channels_last":
                x = x.permute(*perm).contiguous().permute(*[perm.index(i) for i in range(len(shape))])
            elif layout == "nhwc":
                x = x.permute(*perm).contiguous()
            cl = layout == "nhwc"
            what = f"{layout} {shape} G={groups} cluster={cluster} residency={residency}"
            for wb, act in (((w, b), "silu"), ((None, None), None), ((w, None), "silu")):
                out = torch.full_like(x, float("nan"))
                y = go.group_norm(x, groups, *wb, activation=act, channels_last=cl, out=out)
                assert y is out
                ref = GN.ref_group_norm(_host(x), groups, *(None if t is None else _host(t)
                                                             for t in wb), 1e-5, act, cl)
                assert_close(_host(y), ref, dtype, what)


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_stream_kernels(dtype, force, monkeypatch):
    """group_norm_stream with its own plan and each cluster size: the bench's multi-wave shapes
    and small odd ones (the grid of two blocks per SM takes the groups in several rounds where
    there are more than 264 / S of them), silu on and off, weight / bias absent, outputs
    poisoned with NaN; the launched kernel is the stream one (a spy on the kernel cache)."""
    force("stream")
    shapes = [((8, 640, 64, 64), 32), ((4, 1280, 32, 32), 32), ((16, 64, 8, 8), 32),
              ((40, 12, 16, 6), 4), ((64, 10, 8, 12), 5), ((300, 48, 40), 8),
              ((33, 24, 5, 5, 8), 3)]
    seen = []
    get = GN.KERNELS.get

    def spy(dev, expr):
        seen.append(expr)
        return get(dev, expr)
    monkeypatch.setattr(GN.KERNELS, "get", spy)
    for cluster in (None, 1, 2, 4, 8):
        if cluster not in (None, 1) and not _clusters():
            continue
        monkeypatch.setattr(GN, "spread_cluster", cluster)
        for shape, groups in shapes:
            x = _randn(shape, dtype)
            group_packs = shape[1] // groups * prod(shape[2:]) * x.element_size() // 16
            if -(-group_packs // (cluster or (8 if _clusters() else 1))) > GN.STREAM_MAX_PACKS:
                continue                         # (no plan: a slice larger than one block's)
            c = shape[1]
            w, b = _randn((c,), dtype, 1.0, 0.0), _randn((c,), dtype, 1.0, 0.0)
            what = f"{shape} G={groups} cluster={cluster}"
            for wb, act in (((w, b), "silu"), ((None, None), None), ((w, None), "silu")):
                seen.clear()
                out = torch.full_like(x, float("nan"))
                y = go.group_norm(x, groups, *wb, activation=act, out=out)
                assert y is out
                assert seen and all("group_norm_stream<" in e for e in seen), (what, seen)
                ref = GN.ref_group_norm(_host(x), groups, *(None if t is None else _host(t)
                                                             for t in wb), 1e-5, act)
                assert_close(_host(y), ref, dtype, what)


def _forced_resident_case(monkeypatch, dtype, launcher, shapes, layout, on_chip_bytes,
                          graph_shape):
    """Through GN.<launcher> (forced by the caller): each shape ([N, C, *sp], groups; laid out by
    layout(x)) with silu on and off, weight / bias absent, outputs poisoned with NaN, against the
    float64 reference; the launcher built a run for every call of a shape or for none, and did
    for inputs of at most 1 MiB (on chip on any GPU) and, on an H100-sized GPU, exactly for those
    of at most on_chip_bytes; in place; then a CUDA graph of graph_shape replayed on new data
    (each replay a new epoch of the ring2 state's words)."""
    monkeypatch.setattr(GN, "_plans", {})
    made = []
    build = getattr(GN, launcher)

    def spy(*args):
        run = build(*args)
        made.append(run is not None)
        return run
    monkeypatch.setattr(GN, launcher, spy)
    dev = torch.cuda.current_device()
    big = torch.cuda.get_device_properties(dev).multi_processor_count >= 128 and \
        GN._smem_optin(dev) >= 227 * 1024
    for shape, groups in shapes:
        x = layout(_randn(shape, dtype))
        c = shape[1]
        w, b = _randn((c,), dtype, 1.0, 0.0), _randn((c,), dtype, 1.0, 0.0)
        made.clear()
        for wb, act in (((w, b), "silu"), ((None, None), None), ((w, None), "silu")):
            out = torch.full_like(x, float("nan"))
            y = go.group_norm(x, groups, *wb, activation=act, out=out)
            assert y is out and y.stride() == x.stride()
            ref = GN.ref_group_norm(_host(x), groups, *(None if t is None else _host(t)
                                                         for t in wb), 1e-5, act)
            assert_close(_host(y), ref, dtype, f"{shape} G={groups} act={act}")
        assert made and len(set(made)) == 1, made
        if x.numel() * x.element_size() <= 1 << 20:
            assert made[0], shape
        elif big:
            assert made[0] == (x.numel() * x.element_size() <= on_chip_bytes), shape
        ref = GN.ref_group_norm(_host(x), groups, activation="silu")
        y = go.group_norm(x, groups, activation="silu", out=x)          # in place
        assert y is x
        assert_close(_host(x), ref, dtype, f"in place {shape}")
    x = layout(_randn(graph_shape, dtype))
    go.group_norm(x, 32, activation="silu")                 # (warm-up outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = go.group_norm(x, 32, activation="silu")
    for _ in range(3):
        x.copy_(_randn(graph_shape, dtype))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(_host(y), GN.ref_group_norm(_host(x), 32, activation="silu"), dtype, "graph")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_resident_kernel(dtype, force, monkeypatch):
    """group_norm_resident forced (_forced_resident_case): the VAE shape (its 32 groups of 1 MiB
    held on chip in 16-bit; fp32, 67 MB, does not fit and takes auto's plan; an H100 holds 33 MB),
    the bench's smaller shapes and odd ones."""
    force("resident")
    shapes = [((1, 256, 256, 256), 32), ((4, 1280, 32, 32), 32), ((2, 320, 64, 64), 32),
              ((16, 640, 32, 32), 32), ((3, 12, 16, 8), 4), ((2, 6, 40, 136), 3),
              ((1, 24, 5, 5, 8), 3), ((2, 64, 1, 1000), 32)]
    _forced_resident_case(monkeypatch, dtype, "_resident_launcher", shapes, lambda x: x,
                          32 << 20, (4, 1280, 32, 32))


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_nhwc_resident_kernel(dtype, force, monkeypatch):
    """group_norm_nhwc_resident forced (_forced_resident_case) on torch channels_last tensors (the
    result keeps the memory format): the bench's channels-last shapes (an H100 holds ~29 MB: up to
    21 MB fit, [8, 640, 64, 64] does not and takes auto's plan), a ragged last run, groups across
    16-byte columns, one column, 3 spatial dims, 512 columns (fp32 C = 2048, the most)."""
    force("nhwc_resident")
    shapes = [((2, 320, 64, 64), 32), ((8, 640, 64, 64), 32), ((4, 1280, 32, 32), 32),
              ((3, 40, 9, 7), 4), ((2, 96, 5, 33), 32), ((1, 8, 3, 5), 2), ((2, 24, 3, 4, 5), 4),
              ((1, 2048, 2, 2), 1)]

    def channels_last(x):
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        return x.contiguous(memory_format=fmt)
    _forced_resident_case(monkeypatch, dtype, "_nhwc_resident_launcher", shapes, channels_last,
                          24 << 20, (2, 320, 64, 64))


@gpu
@needs_torch_cuda
def test_gpu_spread_kernels_are_the_ones_launched(force):
    """The forced spread paths really launch the spread kernels at the benchmark shapes (and
    AUTO_SPREAD does), through a CUDA graph."""
    seen = []
    get = GN.KERNELS.get

    def spy(dev, expr):
        seen.append(expr)
        return get(dev, expr)
    GN.KERNELS.get = spy
    try:
        for shape, path, cl in [((2, 320, 64, 64), "spread", False),
                                ((2, 320, 64, 64), "nhwc_spread", True),
                                ((8, 640, 64, 64), "spread", False),
                                ((8, 640, 64, 64), "nhwc_spread", True)]:
            if effective_arch(0) < 90 and (cl or shape != (2, 320, 64, 64)):
                # runs 16-17, compute_61 bundle: without clusters only the NCHW diffusion shape
                # (a group fits one block) has a spread plan; the others take the two-pass
                # kernels (correct, tested above)
                continue
            x = _randn(shape, "bfloat16")
            if cl:
                x = x.contiguous(memory_format=torch.channels_last)
            for p in (path, None):
                force(p)
                GN.AUTO_SPREAD = p is None
                seen.clear()
                graph = torch.cuda.CUDAGraph()
                go.group_norm(x, 32, activation="silu")          # (warm-up outside the capture)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    y = go.group_norm(x, 32, activation="silu")
                graph.replay()
                torch.cuda.synchronize()
                assert seen and all("spread" in e for e in seen), (shape, p, seen)
                assert_close(_host(y), GN.ref_group_norm(_host(x), 32, activation="silu"),
                             "bfloat16", f"graph {shape} {p}")
    finally:
        GN.KERNELS.get = get
        GN.AUTO_SPREAD = False


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_apply_orders_agree(dtype, force, monkeypatch):
    """The two-pass apply kernels give bit-identical results in either block order."""
    for shape, groups, nhwc in [((2, 64, 64, 64), 32, False), ((2, 320, 32, 32), 32, True)]:
        x = _randn(shape, dtype)
        if nhwc:
            x = x.contiguous(memory_format=torch.channels_last)
        w, b = _randn((shape[1],), dtype, 1.0, 0.0), _randn((shape[1],), dtype, 1.0, 0.0)
        force("nhwc" if nhwc else "twopass")
        ys = []
        for order in ("forward", "reverse"):
            monkeypatch.setattr(GN, "apply_order", order)
            ys.append(_check(x, groups, dtype, w, b, "silu", f"{order} {shape} nhwc={nhwc}"))
        assert torch.equal(ys[0], ys[1])


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_channels_last(dtype, force):
    for shape, groups in [((2, 320, 32, 32), 32), ((2, 640, 16, 16), 32), ((3, 12, 5, 7), 3),
                          ((1, 64, 4, 4), 64), ((2, 24, 3, 4, 5), 4), ((1, 4096, 2, 2), 1)]:
        x = _randn(shape, dtype)
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        xl = x.contiguous(memory_format=fmt)
        w, b = _randn((shape[1],), dtype, 1.0, 0.0), _randn((shape[1],), dtype, 1.0, 0.0)
        for path in (None, "nhwc", "nhwc_copy", "nhwc_spread", "nhwc_resident"):
            force(path)
            y = _check(xl, groups, dtype, w, b, "silu", f"channels_last {shape} {path}")
            assert y.is_contiguous(memory_format=fmt), "the result keeps the memory format"
        force(None)
        perm = (0, *range(2, len(shape)), 1)
        nhwc = x.permute(*perm).contiguous()               # [N, *sp, C] with channels_last=True
        y = _check(nhwc, groups, dtype, w, b, "silu", f"channels_last=True {shape}",
                   channels_last=True)
        assert y.shape == nhwc.shape and y.is_contiguous()


@gpu
@needs_torch_cuda
def test_gpu_unaligned_and_strided_inputs():
    base = _randn((2 * 64 * 16 * 16 + 1,), "float16")
    x = base[1:].view(2, 64, 16, 16)                       # 2-byte aligned: one element per unit
    w = _randn((128,), "float16", 1.0, 0.0)[::2]          # a strided weight
    _check(x, 32, "float16", w, None, "silu", "unaligned")
    y = _randn((2, 32, 12, 10), "bfloat16").transpose(2, 3)    # neither NCHW nor NHWC
    out = _check(y, 8, "bfloat16", what="transposed spatial")
    assert out.is_contiguous()
    xl = _randn((2, 16, 8, 8), "float32").contiguous(memory_format=torch.channels_last)[..., 1:]
    _check(xl, 4, "float32", what="sliced channels_last")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_out_poisoned_and_in_place(dtype):
    x = _randn((2, 64, 16, 16), dtype)
    w, b = _randn((64,), dtype, 1.0, 0.0), _randn((64,), dtype, 1.0, 0.0)
    ref = GN.ref_group_norm(_host(x), 32, _host(w), _host(b), 1e-5, "silu")
    out = torch.full_like(x, float("nan"))
    y = go.group_norm(x, 32, w, b, activation="silu", out=out)
    assert y is out
    assert_close(_host(out), ref, dtype, "out=")
    xl = x.contiguous(memory_format=torch.channels_last)
    outl = torch.full_like(xl, float("nan"))
    assert go.group_norm(xl, 32, w, b, activation="silu", out=outl) is outl
    assert_close(_host(outl), ref, dtype, "channels_last out=")
    with pytest.raises(ValueError, match="layout|channels-last"):
        go.group_norm(xl, 32, w, b, out=torch.empty_like(x))
    for path in (None, "twopass"):
        GN.force_path = path
        try:
            xi = x.clone()
            assert go.group_norm(xi, 32, w, b, activation="silu", out=xi) is xi
            assert_close(_host(xi), ref, dtype, f"in place {path}")
        finally:
            GN.force_path = None


@gpu
@needs_torch_cuda
def test_gpu_nan_stays_in_its_group():
    x = _randn((2, 8, 4, 4), "float32")
    x[1, 3, 2, 2] = float("nan")                          # sample 1, group 1 (channels 2, 3)
    y = go.group_norm(x, 4)
    expected = F.group_norm(x, 4)
    assert torch.equal(torch.isnan(y), torch.isnan(expected))
    assert torch.isnan(y[1, 2:4]).all() and not torch.isnan(y[1, :2]).any()


@gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gpu_cupy_and_numpy_channels_last(dtype, rng):
    import cupy as cp
    h = (rng.standard_normal((2, 6, 10, 64)) * 2).astype(dtype)          # [N, H, W, C]
    w = rng.standard_normal(64).astype(dtype)
    ref = GN.ref_group_norm(h.astype(np.float64), 16, w.astype(np.float64), None, 1e-5, "silu",
                            True)
    y = go.group_norm(cp.asarray(h), 16, cp.asarray(w), activation="silu", channels_last=True)
    assert isinstance(y, cp.ndarray) and y.shape == h.shape
    assert_close(cp.asnumpy(y).astype(np.float64), ref, dtype, "cupy nhwc")
    yn = go.group_norm(h, 16, w, activation="silu", channels_last=True)
    assert isinstance(yn, np.ndarray)
    assert_close(yn.astype(np.float64), ref, dtype, "numpy nhwc")
    view = cp.asarray(h).transpose(0, 3, 1, 2)                          # NCHW view of NHWC memory
    yv = go.group_norm(view, 16, cp.asarray(w), activation="silu")
    assert_close(cp.asnumpy(yv).astype(np.float64), np.moveaxis(ref, -1, 1), dtype, "cupy view")


@gpu
@needs_torch_cuda
def test_gpu_side_stream_and_cuda_graph():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = _randn((2, 320, 32, 32), "float16")
        y = go.group_norm(x, 32, activation="silu")
    side.synchronize()
    assert_close(_host(y), GN.ref_group_norm(_host(x), 32, activation="silu"), "float16", "side")
    sx = _randn((2, 320, 32, 32), "float16")
    sl = _randn((2, 64, 16, 16), "bfloat16").contiguous(memory_format=torch.channels_last)
    w = _randn((64,), "bfloat16", 1.0, 0.0)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        go.group_norm(sx, 32, activation="silu")
        go.group_norm(sl, 32, w, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        oy = go.group_norm(sx, 32, activation="silu")
        ol = go.group_norm(sl, 32, w, w)
    for _ in range(2):
        sx.copy_(_randn((2, 320, 32, 32), "float16"))
        sl.copy_(_randn((2, 64, 16, 16), "bfloat16"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(_host(oy), GN.ref_group_norm(_host(sx), 32, activation="silu"), "float16",
                     "graph")
        assert_close(_host(ol), GN.ref_group_norm(_host(sl), 32, _host(w), _host(w)), "bfloat16",
                     "graph channels_last")


@gpu
@needs_torch_cuda
def test_gpu_matches_torch_on_the_benchmark_shapes():
    for shape in [(8, 640, 64, 64), (4, 1280, 32, 32)]:
        x = _randn(shape, "float16")
        w, b = _randn((shape[1],), "float16", 1.0, 0.0), _randn((shape[1],), "float16", 1.0, 0.0)
        _check(x, 32, "float16", w, b, "silu", f"{shape}")
        _check(x.contiguous(memory_format=torch.channels_last), 32, "float16", w, b, "silu",
               f"{shape} channels_last")
