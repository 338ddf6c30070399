"""Layout copies (transpose, contiguous): references, the host's copy plans run against a CPU
emulation of cuda_src/copy/copy.cu (index arithmetic, fast dividers, alignment, the swizzled tile
and its bank-conflict freedom), and on the GPU every dtype, layout and path bit-exactly against
NumPy / torch, with poisoned outputs, CuPy and NumPy inputs, a side stream and a CUDA graph.

The emulation harness here (``Arena``, ``FakeCall``, ``Emulator``, ``emulated``) is shared with
tests/test_group_norm.py: it replaces kernel launches with NumPy transliterations of the kernels
working on a byte arena, so the real host code (plans, launch arguments) runs without a GPU.
"""
from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest

import gpuops as go
from gpuops import dtypes as dt
from gpuops.ops import copy as C
from gpuops.shapes import contiguous_strides
from gpuops.tensor import Tensor
from conftest import HAS_GPU, HAS_TORCH, gpu, needs_torch, needs_torch_cuda

torch = pytest.importorskip("torch") if HAS_TORCH else None

ALL = ["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
       "bool"]


# ------------------------------------------------------------------------------ emulation harness

def np_storage(d):
    if d is dt.bfloat16:
        return dt.to_numpy(dt.bfloat16)
    return np.dtype(d.name)


class FakeObj:
    """Stands for a framework array (gpuops only permutes it)."""

    def permute(self, *perm):
        return self

    def transpose(self, *perm):
        return self


class Arena:
    """Device memory: a byte array at a fake 2^40 base address."""
    BASE = 1 << 40

    def __init__(self, nbytes=1 << 25):
        self.mem = np.zeros(nbytes, np.uint8)
        self.top = 0

    def alloc(self, nbytes, misalign=0):
        ptr = self.BASE + self.top + misalign
        self.top = (self.top + misalign + nbytes + 255) // 256 * 256 + 256
        assert self.top <= self.mem.size, "arena full"
        return ptr

    def _span(self, ptr, nbytes):
        off = ptr - self.BASE
        assert 0 <= off and off + nbytes <= self.mem.size, "access outside the arena"
        return self.mem[off:off + nbytes]

    def put(self, host, d, misalign_elems=0) -> Tensor:
        a = np.ascontiguousarray(np.asarray(host).astype(np_storage(d)))
        ptr = self.alloc(a.nbytes, misalign_elems * d.itemsize)
        self._span(ptr, a.nbytes)[:] = a.reshape(-1).view(np.uint8)
        return Tensor(ptr, a.shape, contiguous_strides(a.shape), d, 0, FakeObj(), a.size, True)

    def empty(self, shape, d) -> Tensor:
        shape = tuple(shape)
        n = int(np.prod(shape, dtype=np.int64))
        ptr = self.alloc(n * d.itemsize)
        self._span(ptr, n * d.itemsize)[:] = 0xFF          # poison
        return Tensor(ptr, shape, contiguous_strides(shape), d, 0, FakeObj(), n, True)

    def _window(self, ptr, d, offsets):
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
        lo, hi = int(offsets.min()), int(offsets.max())
        return self._span(ptr + lo * d.itemsize, (hi - lo + 1) * d.itemsize).view(np_storage(d)), \
            offsets - lo

    def load(self, ptr, d, offsets):
        if np.size(offsets) == 0:
            return np.zeros(0, np_storage(d))
        w, idx = self._window(ptr, d, offsets)
        return w[idx]

    def store(self, ptr, d, offsets, values):
        if np.size(offsets) == 0:
            return
        w, idx = self._window(ptr, d, offsets)
        w[idx] = np.asarray(values).reshape(-1).astype(np_storage(d))

    def read(self, t: Tensor):
        """The logical contents of a view (storage dtype)."""
        if t.numel == 0:
            return np.zeros(t.shape, np_storage(t.dtype))
        if not t.shape:
            return self.load(t.ptr, t.dtype, [0]).reshape(())
        idx = np.indices(t.shape).reshape(len(t.shape), -1)
        off = (np.asarray(t.strides, np.int64)[:, None] * idx).sum(0)
        return self.load(t.ptr, t.dtype, off).reshape(t.shape)

    def view_of(self, base: Tensor, index_fn):
        """The view index_fn makes of base's elements (index_fn acts on a NumPy array)."""
        idx = np.arange(base.numel, dtype=np.int64).reshape(base.shape)
        v = index_fn(idx)
        first = int(v.reshape(-1)[0]) if v.size else 0
        return Tensor(base.ptr + first * base.dtype.itemsize, v.shape,
                      tuple(s // 8 for s in v.strides), base.dtype, 0, FakeObj(), v.size,
                      bool(v.flags.c_contiguous))


class FakeCall:
    def __init__(self, arena, name):
        self.arena, self.device, self.stream = arena, 0, 0
        self.op = types.SimpleNamespace(name=name)

    def empty(self, shape, d):
        return self.arena.empty(shape, d)


def fastdiv(n, div):
    """common/fastdiv.cuh on uint32 values, checked against exact division."""
    d, mul, shift = div
    n = np.asarray(n, dtype=np.uint64)
    assert (n < (1 << 31)).all(), "fast division needs n < 2^31"
    s = ((n * np.uint64(mul)) >> np.uint64(32)) + n
    assert (s < (1 << 32)).all()
    q = (s >> np.uint64(shift)).astype(np.int64)
    assert (q == (n // np.uint64(d)).astype(np.int64)).all(), "fast divider disagrees"
    return q


class Emulator:
    """NumPy transliterations of the kernels, one method per kernel template (k_<name>)."""

    def __init__(self, arena, cc=90, target_arch=90, sms=132):
        self.arena, self.cc, self.target_arch, self.sms = arena, cc, target_arch, sms
        self.launches = []

    def kernel(self, expr):
        emu = self

        class _Kernel:
            @staticmethod
            def launch(grid, block, stream, *args, smem=0):
                name = expr.split("<")[0].split("::")[-1]
                targs = [a.strip() for a in expr[expr.index("<") + 1:-1].split(",")]
                emu.launches.append((name, tuple(targs), grid, block, smem))
                assert block[0] <= 1024 and grid[0] < 1 << 31 and smem <= 48 * 1024
                getattr(emu, "k_" + name)(targs, grid, block, list(args), smem)
        return _Kernel

    def names(self):
        return [f"{n}<{', '.join(t)}>" for n, t, *_ in self.launches]

    # ---- copy.cu
    @staticmethod
    def _take(args, n):
        out = args[:n]
        del args[:n]
        return out

    def _outer(self, args):
        ndim = args.pop(0)
        divs = [tuple(self._take(args, 3)) for _ in range(C.MAX_OUTER)]
        return ndim, divs, self._take(args, C.MAX_OUTER), self._take(args, C.MAX_OUTER)

    @staticmethod
    def _outer_offsets(outer, i):
        ndim, divs, ins, outs = outer
        i = np.asarray(i, dtype=np.int64)
        in_off, out_off = np.zeros_like(i), np.zeros_like(i)
        for d in range(ndim - 1, -1, -1):
            q = fastdiv(i, divs[d])
            idx = i - q * divs[d][0]
            in_off += idx * ins[d]
            out_off += idx * outs[d]
            i = q
        return in_off, out_off

    @staticmethod
    def _raw(e):
        return {1: dt.uint8, 2: dt.int16, 4: dt.int32, 8: dt.int64}[e]

    def k_copy_rows(self, targs, grid, block, args, smem):
        e, vec = int(targs[0]), int(targs[1])
        src, dst = args.pop(0), args.pop(0)
        per_row = tuple(self._take(args, 3))
        outer = self._outer(args)
        inner, total = args
        assert block[0] == 256 and grid[0] * 256 >= total > (grid[0] - 1) * 256
        q = np.arange(total, dtype=np.int64)
        row = fastdiv(q, per_row)
        col = q - row * per_row[0]
        in_off, _ = self._outer_offsets(outer, row)
        in_off += col * vec * inner
        if vec > 1:
            assert vec * e == 16 and inner == 1 and dst % 16 == 0
            assert ((src + in_off * e) % 16 == 0).all(), "unaligned 16-byte load"
        r = self._raw(e)
        self.arena.store(dst, r, np.arange(total * vec),
                         self.arena.load(src, r, (in_off[:, None] + np.arange(vec)).reshape(-1)))

    def _tiles(self, args, grid):
        tu_div, tpp_div = tuple(self._take(args, 3)), tuple(self._take(args, 3))
        outer = self._outer(args)
        assert not args, "launch arguments left over"
        b = np.arange(grid[0], dtype=np.int64)
        plane = fastdiv(b, tpp_div)
        tile = b - plane * tpp_div[0]
        tv = fastdiv(tile, tu_div)
        in_base, out_base = self._outer_offsets(outer, plane)
        return tile - tv * tu_div[0], tv, in_base, out_base

    def k_copy_transpose(self, targs, grid, block, args, smem):
        e, vec, p = map(int, targs)
        src, dst, ext_u, ext_v, in_stride_v, out_stride_u = self._take(args, 6)
        tu, tv, in_base, out_base = self._tiles(args, grid)
        t = p * vec
        iters = p * t // 256
        r = self._raw(e)
        q = (np.arange(256)[:, None] + np.arange(iters)[None, :] * 256).reshape(-1)
        for blk in range(grid[0]):
            u0, v0 = int(tu[blk]) * t, int(tv[blk]) * t
            nu, nv = min(t, ext_u - u0), min(t, ext_v - v0)
            assert nu > 0 and nv > 0 and nu % vec == 0 and nv % vec == 0
            sb = src + (int(in_base[blk]) + v0 * in_stride_v + u0) * e
            db = dst + (int(out_base[blk]) + u0 * out_stride_u + v0) * e
            # loads -> swizzled chunks
            v, c = q // p, q % p
            ok = (v < nv) & (c * vec < nu)
            offs = v[ok] * in_stride_v + c[ok] * vec
            assert ((sb + offs * e) % 16 == 0).all(), "unaligned 16-byte load"
            chunks = np.zeros((t * p, vec), np.int64)
            loaded = np.zeros(t * p, bool)
            pos = v[ok] * p + (c[ok] ^ ((v[ok] // vec) & 7))
            assert len(np.unique(pos)) == len(pos)
            chunks[pos] = self.arena.load(sb, r, (offs[:, None] + np.arange(vec)).reshape(-1)) \
                .reshape(-1, vec).astype(np.int64)
            loaded[pos] = True
            # transposed gathers -> 16-byte stores
            wq, lane = q >> 5, q & 31
            vpw = 32 // vec
            vb = p // vpw
            u = (wq // vb) * vec + lane % vec
            vp = (wq % vb) * vpw + lane // vec
            ok = (u < nu) & (vp * vec < nv)
            u, vp = u[ok], vp[ok]
            rows = vp[:, None] * vec + np.arange(vec)[None, :]
            idx = (rows * p + ((u // vec)[:, None] ^ (vp[:, None] & 7))) * vec + (u % vec)[:, None]
            assert loaded[idx // vec].all(), "gathered an element that was never loaded"
            doff = u * out_stride_u + vp * vec
            assert ((db + doff * e) % 16 == 0).all(), "unaligned 16-byte store"
            self.arena.store(db, r, (doff[:, None] + np.arange(vec)).reshape(-1),
                             chunks.reshape(-1)[idx].reshape(-1))

    def k_copy_transpose_scalar(self, targs, grid, block, args, smem):
        e = int(targs[0])
        src, dst, ext_u, ext_v, in_stride_u, in_stride_v, out_stride_u = self._take(args, 7)
        tu, tv, in_base, out_base = self._tiles(args, grid)
        t, r = 32, self._raw(e)
        q = (np.arange(256)[:, None] + np.arange(4)[None, :] * 256).reshape(-1)
        for blk in range(grid[0]):
            u0, v0 = int(tu[blk]) * t, int(tv[blk]) * t
            nu, nv = min(t, ext_u - u0), min(t, ext_v - v0)
            assert nu > 0 and nv > 0
            sb = src + (int(in_base[blk]) + v0 * in_stride_v + u0 * in_stride_u) * e
            db = dst + (int(out_base[blk]) + u0 * out_stride_u + v0) * e
            tile = np.zeros((t, t + 1), np.int64)
            v, u = q // t, q % t
            ok = (v < nv) & (u < nu)
            tile[v[ok], u[ok]] = self.arena.load(sb, r, v[ok] * in_stride_v + u[ok] * in_stride_u)
            u, v = q // t, q % t
            ok = (u < nu) & (v < nv)
            self.arena.store(db, r, u[ok] * out_stride_u + v[ok], tile[v[ok], u[ok]])

    def k_copy_strided(self, targs, grid, block, args, smem):
        e = int(targs[0])
        src, dst, nd = args[0], args[1], args[2]
        shape, strides, n = args[3:3 + nd], args[11:11 + nd], args[-1]
        i = np.arange(n, dtype=np.int64)
        off, rem = np.zeros_like(i), i.copy()
        for d in range(nd - 1, -1, -1):
            off += (rem % shape[d]) * strides[d]
            rem //= shape[d]
        r = self._raw(e)
        self.arena.store(dst, r, i, self.arena.load(src, r, off))


@contextlib.contextmanager
def emulated(monkeypatch, emulator_cls=Emulator, **kw):
    """Route every gpuops kernel launch of the copy and group-norm ops to an emulator."""
    from gpuops.ops import group_norm as GN  # noqa: PLC0415
    arena = Arena(kw.pop("arena_bytes", 1 << 25))
    emu = emulator_cls(arena, **kw)
    # plans made here (fake device properties) must not outlive the emulation
    monkeypatch.setattr(C, "_plans", {})
    monkeypatch.setattr(GN, "_plans", {})
    monkeypatch.setattr(C.KernelCache, "get", lambda self, dev, expr: emu.kernel(expr))
    monkeypatch.setattr(C.KernelCache, "target_arch", lambda self, dev: emu.target_arch)
    monkeypatch.setattr(C, "sm_count", lambda dev: emu.sms)
    yield emu


# ------------------------------------------------------------------------------ CPU tests

def test_fast_divider_is_exact(rng):
    ds = list(range(1, 600)) + [2 ** k for k in range(31)] + [2 ** k - 1 for k in range(1, 32)] \
        + [2 ** k + 1 for k in range(1, 31)] + [int(v) for v in rng.integers(1, 2 ** 31, 500)]
    for d in ds:
        if d >= 2 ** 31:
            continue
        _, mul, shift = C.fast_divider(d)
        ns = [0, 1, d - 1, d, d + 1, 2 ** 31 - 1, (2 ** 31 - 1) // d * d, (2 ** 31 - 1) // d * d - 1]
        ns += [int(v) for v in rng.integers(0, 2 ** 31, 64)]
        for n in ns:
            if 0 <= n < 2 ** 31:
                assert ((n * mul >> 32) + n) >> shift == n // d, (n, d)
    with pytest.raises(ValueError):
        C.fast_divider(0)


def _bank_wavefronts(byte_addrs, access_bytes):
    """Shared-memory wavefronts of one warp access (32 banks of 4 bytes; 16-byte accesses go by
    quarter warps, 8-byte ones by half warps); 1 per phase is conflict-free."""
    lanes = {16: 8, 8: 16}.get(access_bytes, 32)
    total = 0
    for p0 in range(0, 32, lanes):
        banks = {}
        for a in byte_addrs[p0:p0 + lanes]:
            for k in range(max(1, access_bytes // 4)):
                w = int(a) // 4 + k
                banks.setdefault(w % 32, set()).add(w)
        total += max(len(s) for s in banks.values())
    return total / (32 // lanes)


@pytest.mark.parametrize("e", [1, 2, 4, 8])
def test_transpose_tile_has_no_bank_conflicts(e):
    """Replays copy_transpose's shared-memory accesses (chunk stores, element gathers)."""
    vec, p = 16 // e, C.TILE_P[e]
    t = p * vec
    for k in range(p * t // 256):
        for w in range(8):
            q = np.arange(32) + 32 * w + 256 * k
            v, c = q // p, q % p
            assert _bank_wavefronts((v * p + (c ^ ((v // vec) & 7))) * 16, 16) == 1
            wq, lane = q >> 5, q & 31
            vb = p // (32 // vec)
            u = (wq // vb) * vec + lane % vec
            vp = (wq % vb) * (32 // vec) + lane // vec
            for j in range(vec):
                r = vp * vec + j
                addr = ((r * p + ((u // vec) ^ (vp & 7))) * vec + u % vec) * e
                assert _bank_wavefronts(addr, e) == 1, (e, k, w, j)


# (base shape, view, what) -> the copy the view's contiguous() needs
VIEWS = [
    ((64, 48), lambda x: x.T, "2-d transpose"),
    ((130, 70), lambda x: x.T, "2-d transpose, odd extents"),
    ((200, 72), lambda x: x.T, "partial tiles"),
    ((3, 16, 272), lambda x: x.swapaxes(1, 2), "batched transpose"),
    ((2, 5, 64, 32), lambda x: x.swapaxes(2, 3), "4-d batched transpose"),
    ((3, 40, 5, 16), lambda x: x.transpose(0, 2, 1, 3), "BSHD -> BHSD"),
    ((2, 33, 4, 24), lambda x: x.transpose(0, 2, 1, 3), "BSHD -> BHSD, odd S"),
    ((4, 7, 9), lambda x: x.swapaxes(0, 2), "outer <-> inner"),
    ((4, 7, 9), lambda x: x[:, ::2, 1:], "sliced"),
    ((40, 64), lambda x: x[:, ::2], "inner stride 2"),
    ((40, 64), lambda x: x[::-1], "negative row stride"),
    ((40, 64), lambda x: x[:, ::-1], "negative inner stride"),
    ((1000,), lambda x: x, "contiguous"),
    ((1003,), lambda x: x[1:], "contiguous, unaligned"),
    ((5, 1, 7), lambda x: np.broadcast_to(x, (3, 5, 4, 7)), "broadcast"),
    ((5, 1), lambda x: np.broadcast_to(x, (5, 64)), "broadcast inner"),
    ((48, 136, 3), lambda x: x.transpose(1, 0, 2)[:, :, 0], "strided transpose"),
    ((2, 3, 4, 5, 6, 7), lambda x: x.transpose(5, 4, 3, 2, 1, 0), "6-d reversed"),
    ((2, 3, 4, 5, 6, 7), lambda x: x.transpose(0, 2, 4, 1, 3, 5), "6-d shuffled (strided)"),
    ((96, 128), lambda x: x[8:, 16:].T, "offset view"),
    ((64, 64), lambda x: x[1:, :].T, "unaligned transpose"),
    ((), lambda x: x, "0-d"),
    ((0, 4), lambda x: x.T, "empty"),
]


@pytest.mark.parametrize("dtype", ALL)
def test_copy_plans_on_the_emulated_kernels(monkeypatch, rng, dtype):
    d = dt.BY_NAME[dtype]
    with emulated(monkeypatch) as emu:
        for base_shape, fn, what in VIEWS:
            for misalign in (0, 1):
                host = (rng.standard_normal(base_shape) * 50).astype(np_storage(d)) \
                    if d.is_floating else rng.integers(-100, 100, base_shape).astype(np_storage(d))
                base = emu.arena.put(host, d, misalign)
                src = emu.arena.view_of(base, fn)
                out = emu.arena.empty(src.shape, d)
                C.strided_copy(FakeCall(emu.arena, "contiguous"), src, out)
                got, want = emu.arena.read(out), np.ascontiguousarray(fn(host))
                assert got.tobytes() == want.tobytes(), f"{what} {dtype} misalign={misalign}"


def test_copy_picks_the_expected_kernels(monkeypatch):
    with emulated(monkeypatch) as emu:
        def kind(shape, fn, d=dt.float16):
            emu.launches.clear()
            base = emu.arena.put(np.zeros(shape), d)
            src = emu.arena.view_of(base, fn)
            C.strided_copy(FakeCall(emu.arena, "contiguous"), src, emu.arena.empty(src.shape, d))
            return emu.names()
        assert kind((64, 64), lambda x: x.T) == ["copy_transpose<2, 8, 8>"]
        assert kind((64, 64), lambda x: x.T, dt.float32) == ["copy_transpose<4, 4, 16>"]
        assert kind((2, 16, 4, 128), lambda x: x.transpose(0, 2, 1, 3)) == ["copy_rows<2, 8>"]
        assert kind((1024,), lambda x: x) == ["copy_rows<2, 8>"]
        assert kind((63, 65), lambda x: x.T) == ["copy_transpose_scalar<2>"]
        assert kind((2, 3, 4, 5, 6, 7), lambda x: x.transpose(0, 2, 4, 1, 3, 5)) == \
            ["copy_strided<2>"]


def test_references():
    x = np.arange(24).reshape(2, 3, 4)
    y = go.ops.copy.ref_transpose(x, 0, -1)
    assert y.shape == (4, 3, 2) and y.flags.c_contiguous and np.array_equal(y, x.swapaxes(0, 2))
    z = go.ops.copy.ref_contiguous(x.T)
    assert z.flags.c_contiguous and np.array_equal(z, x.T)
    with pytest.raises(ValueError, match="dim1"):
        go.ops.copy.ref_transpose(x, 0, 3)
    with pytest.raises(TypeError, match="dim0"):
        go.ops.copy.ref_transpose(x, 0.5, 1)


@needs_torch
def test_cpu_path_matches_torch(rng):
    x = torch.from_numpy(rng.standard_normal((3, 4, 5)).astype(np.float32)).to(torch.bfloat16)
    assert torch.equal(go.transpose(x, 0, 2), x.transpose(0, 2).contiguous())
    assert torch.equal(go.contiguous(x.transpose(1, 2)), x.transpose(1, 2).contiguous())
    i = torch.arange(60, dtype=torch.int64).reshape(3, 4, 5)
    y = go.transpose(i, -1, 1)
    assert y.dtype == torch.int64 and torch.equal(y, i.transpose(-1, 1).contiguous())
    b = torch.tensor([[True, False], [False, False]])
    assert torch.equal(go.transpose(b, 0, 1), b.t().contiguous())


def test_cpu_path_numpy_any_dtype(rng):
    x = rng.integers(0, 255, (5, 7)).astype(np.uint8)
    if not HAS_GPU:
        y = go.transpose(x, 0, 1)
        assert y.dtype == np.uint8 and np.array_equal(y, x.T)
    with pytest.raises(ValueError, match="out of range"):
        go.transpose(x, 0, 2)
    with pytest.raises(TypeError, match="int"):
        go.transpose(x, "0", 1)


# ------------------------------------------------------------------------------ GPU tests

def _torch_dtype(name):
    return getattr(torch, name)


def _rand(shape, dtype):
    if dtype in ("float32", "float16", "bfloat16", "float64"):
        return (torch.randn(shape, device="cuda", dtype=torch.float32) * 3).to(_torch_dtype(dtype))
    if dtype == "bool":
        return torch.rand(shape, device="cuda") > 0.5
    info = torch.iinfo(_torch_dtype(dtype))
    return torch.randint(max(info.min, -2 ** 62), min(info.max, 2 ** 62), shape, device="cuda",
                         dtype=_torch_dtype(dtype))


def _same_bits(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert a.is_contiguous(), f"{what}: result not contiguous"
    if a.dtype == torch.bool:
        assert torch.equal(a, b), what
    else:
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        assert torch.equal(a.view(bits), b.contiguous().view(bits)), what


TRANSPOSES = [
    ((1, 1), 0, 1), ((1, 7), 0, 1), ((3, 5), 0, 1), ((64, 64), 0, 1), ((257, 129), 0, 1),
    ((4096, 33), 0, 1), ((33, 4096), 1, 0), ((8, 128, 4, 128), 1, 2), ((2, 77, 12, 64), 1, 2),
    ((2, 64, 12, 80), 1, 2), ((3, 5, 7, 3), 1, 2), ((4, 96, 160), 1, 2), ((4, 96, 160), 0, 2),
    ((2, 3, 64, 48), -1, -2), ((2, 3, 4, 5, 6), 0, 4), ((6, 10), 0, 0), ((0, 5), 0, 1),
]


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ALL)
def test_gpu_transpose_every_dtype_and_shape(dtype):
    for shape, a, b in TRANSPOSES:
        x = _rand(shape, dtype)
        _same_bits(go.transpose(x, a, b), x.transpose(a, b), f"{dtype} {shape} ({a}, {b})")
        xs = _rand((shape[0] + 1,) + tuple(shape[1:]), dtype)[1:]     # unaligned start
        if xs.numel():
            _same_bits(go.transpose(xs, a, b), xs.transpose(a, b), f"{dtype} {shape} unaligned")


@gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "float64"])
def test_gpu_contiguous_of_views(dtype):
    base = _rand((6, 40, 8, 64), dtype)
    views = {
        "contiguous": base, "bshd->bhsd": base.transpose(1, 2), "t": base[0, :, 0].t(),
        "inner t": base.transpose(-1, -2), "sliced": base[:, 1:, ::2, 3:],
        "stepped": base[::2, ::3], "expanded": base[:, :1].expand(6, 5, 8, 64),
        "expanded inner": base[..., :1].expand(6, 40, 8, 16), "0-d": base[1, 2, 3, 4],
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "5-d shuffle": base.reshape(6, 5, 8, 8, 64).permute(4, 0, 3, 1, 2),
        "6-d strided": base.reshape(2, 3, 5, 8, 8, 64).permute(5, 0, 3, 1, 4, 2)[:, :, ::2],
        "empty": base[:, :0],
    }
    for what, v in views.items():
        _same_bits(go.contiguous(v), v.contiguous(), f"{dtype} {what}")


@gpu
@needs_torch_cuda
def test_gpu_out_poisoned_and_errors():
    x = _rand((300, 200), "bfloat16")
    out = torch.full((200, 300), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = go.transpose(x, 0, 1, out=out)
    assert y is out
    _same_bits(out, x.t(), "out=")
    with pytest.raises(ValueError, match="shape"):
        go.transpose(x, 0, 1, out=torch.empty(300, 200, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        go.contiguous(x, out=torch.empty(200, 300, device="cuda", dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="overlaps"):
        go.contiguous(x[:, :100], out=x.view(-1)[:30000].view(300, 100))


@gpu
@needs_torch_cuda
def test_gpu_attention_layouts_round_trip():
    q = _rand((4, 1024, 16, 128), "bfloat16")           # [B, S, H, D]
    bhsd = go.transpose(q, 1, 2)
    _same_bits(bhsd, q.transpose(1, 2), "BSHD -> BHSD")
    _same_bits(go.transpose(bhsd, 1, 2), q, "BHSD -> BSHD")
    kt = go.transpose(bhsd, -1, -2)                      # K^T for a matmul
    _same_bits(kt, bhsd.transpose(-1, -2), "BHSD -> BHDS")


@gpu
def test_gpu_cupy_and_numpy_inputs(rng):
    import cupy as cp
    x = cp.asarray(rng.standard_normal((65, 130)).astype(np.float32))
    y = go.transpose(x, 0, 1)
    assert isinstance(y, cp.ndarray) and y.flags.c_contiguous
    assert np.array_equal(cp.asnumpy(y), cp.asnumpy(x).T)
    v = x[::-1, ::-2]                                    # negative strides
    assert np.array_equal(cp.asnumpy(go.contiguous(v)), cp.asnumpy(x)[::-1, ::-2])
    h = rng.integers(0, 1000, (33, 17, 5)).astype(np.int32)
    out = np.full((5, 17, 33), -1, np.int32)
    assert go.transpose(h, 0, 2, out=out) is out and np.array_equal(out, h.transpose(2, 1, 0))


@gpu
@needs_torch_cuda
def test_gpu_side_stream_and_cuda_graph():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = _rand((8, 256, 16, 64), "float16")
        y = go.transpose(x, 1, 2)
    side.synchronize()
    _same_bits(y, x.transpose(1, 2), "side stream")
    static = _rand((512, 384), "float32")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        go.transpose(static, 0, 1)
        go.contiguous(static[:, ::2])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_t = go.transpose(static, 0, 1)
        out_c = go.contiguous(static[:, ::2])
    for _ in range(2):
        static.copy_(_rand((512, 384), "float32"))
        graph.replay()
        torch.cuda.synchronize()
        _same_bits(out_t, static.t(), "graph transpose")
        _same_bits(out_c, static[:, ::2], "graph contiguous")


@gpu
@needs_torch_cuda
@pytest.mark.large
def test_gpu_more_than_2_31_elements():
    n = (1 << 31) + 4096
    free, _ = torch.cuda.mem_get_info()
    if free < 2 * n + (1 << 30):
        pytest.skip("needs ~5 GB of free GPU memory")
    x = torch.randint(0, 100, (n // 4096, 4096), device="cuda", dtype=torch.uint8)
    y = go.transpose(x, 0, 1)                    # 64-bit strided path
    for sl in (slice(0, 7), slice(4090, 4096)):
        assert torch.equal(y[sl], x[:, sl].t())
    idx = torch.randint(0, n // 4096, (1000,), device="cuda")
    assert torch.equal(y[:, idx], x[idx].t())
