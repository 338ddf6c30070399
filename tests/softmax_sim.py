"""A CPU simulation of the softmax-family and cross-entropy kernels, for checking the host side
(layouts, configs, launch arguments) and the kernels' index mapping without a GPU.

Each simulated kernel follows its CUDA source's mapping literally -- which block and thread
touches which element, loop bounds, chunk boundaries, pack sizes -- over a flat simulated memory
where every access is bounds-checked, 16-byte packs must be 16-byte aligned, and outputs start
as NaN. The arithmetic is float64 (what is checked is where values go, not fp32 rounding).
"""
from __future__ import annotations

import bisect
import re
import weakref
from math import prod

import numpy as np

from gpuops import dtypes as dt
from gpuops.shapes import contiguous_strides
from gpuops.tensor import Tensor

_ALIGN = 256
SMEM_OPTIN = 232448            # H100: 227 KiB per block
_ITEM = {"float": 4, "gpuops::float16_t": 2, "gpuops::bfloat16_t": 2, "long long": 8, "int": 4}


class Memory:
    """Flat simulated device memory: buffers at 256-byte aligned addresses. A buffer lives as long
    as some Python object holds its array (as a framework tensor holds its memory): an access
    after every holder is gone is an error (on a GPU the caching allocator may already have
    handed the address to the next allocation)."""

    def __init__(self):
        self.buffers = []          # (base address, item size, weak reference to the array, size)
        self.bases = []
        self.next = 1 << 20

    def alloc(self, nelem, item, integer=False, fill=np.nan):
        base = self.next
        self.next += (max(nelem, 1) * item + 2 * _ALIGN) // _ALIGN * _ALIGN
        arr = np.zeros(max(nelem, 1), np.int64) if integer else np.full(max(nelem, 1), fill)
        self.buffers.append((base, item, weakref.ref(arr), arr.size))
        self.bases.append(base)
        return base, arr

    def _find(self, addr, item):
        k = bisect.bisect_right(self.bases, addr) - 1
        if k >= 0:
            base, bitem, ref, size = self.buffers[k]
            if addr < base + size * bitem:
                arr = ref()
                assert arr is not None, (f"access to 0x{addr:x} in a buffer already freed (its "
                                         "tensor was dropped before the kernel ran)")
                assert bitem == item, f"access of {item}-byte elements to a {bitem}-byte buffer"
                off = addr - base
                assert off % item == 0, "misaligned element access"
                return arr, off // item
        raise AssertionError(f"access to unallocated address 0x{addr:x}")

    def load(self, addr, count, item):
        if count > 1:
            assert addr % 16 == 0, f"16-byte pack load from unaligned address 0x{addr:x}"
        arr, i = self._find(addr, item)
        assert i + count <= arr.size, "load past the end of a buffer"
        return arr[i:i + count].copy()

    def store(self, addr, values, item):
        values = np.atleast_1d(values)
        if values.size > 1:
            assert addr % 16 == 0, f"16-byte pack store to unaligned address 0x{addr:x}"
        arr, i = self._find(addr, item)
        assert i + values.size <= arr.size, "store past the end of a buffer"
        arr[i:i + values.size] = values


class SimArray:
    """The framework object behind a simulated Tensor: a strided view of a Memory buffer, with
    the few torch-like methods the ops use (permute, contiguous, copy_)."""

    def __init__(self, mem, base, arr, item, shape, strides, offset=0):
        self.mem, self.base, self.arr, self.item = mem, base, arr, item
        self.shape, self.strides_, self.offset = tuple(shape), tuple(strides), offset

    def data_ptr(self):
        return self.base + self.offset * self.item

    def stride(self):
        return self.strides_

    def numel(self):
        return prod(self.shape)

    def index_array(self):
        idx = np.full(self.shape, self.offset, np.int64)
        for k, (n, s) in enumerate(zip(self.shape, self.strides_)):
            sh = [1] * len(self.shape)
            sh[k] = n
            idx = idx + (np.arange(n) * s).reshape(sh)
        return idx

    def values(self):
        return self.arr[self.index_array()] if self.shape else self.arr[self.offset]

    def permute(self, *dims):
        return SimArray(self.mem, self.base, self.arr, self.item, [self.shape[d] for d in dims],
                        [self.strides_[d] for d in dims], self.offset)

    def contiguous(self):
        c = new_array(self.mem, self.shape, self.item)
        c.arr[:max(1, c.numel())] = np.asarray(self.values()).reshape(-1) if c.numel() else c.arr
        return c

    def copy_(self, src):
        self.arr[self.index_array()] = np.asarray(src.values())
        return self


def new_array(mem, shape, item, integer=False, fill=np.nan):
    base, arr = mem.alloc(prod(shape), item, integer, fill)
    return SimArray(mem, base, arr, item, shape, contiguous_strides(tuple(shape)))


def tensor_of(a: SimArray, dtype) -> Tensor:
    return Tensor(a.data_ptr(), tuple(a.shape), tuple(a.stride()), dtype, 0, a, a.numel(), None)


def upload(mem, values, dtype, view=None):
    """A simulated tensor holding ``values`` (float64 or int), optionally as a view:
    view(SimArray) -> SimArray (e.g. a transpose or a slice made by the caller)."""
    values = np.asarray(values)
    integer = values.dtype.kind in "iu"
    a = new_array(mem, values.shape, dtype.itemsize, integer)
    if values.size:
        a.arr[:values.size] = values.reshape(-1)
    if view is not None:
        a = view(a)
    return tensor_of(a, dtype)


def strided_view(a: SimArray, shape, strides, offset=0):
    return SimArray(a.mem, a.base, a.arr, a.item, shape, strides, a.offset + offset)


class FakeOp:
    def __init__(self, name):
        self.name = name


class FakeCall:
    """What the ops' launchers use of gpuops.dispatch.Call."""

    def __init__(self, mem, op_name, dtype):
        self.mem, self.op = mem, FakeOp(op_name)
        self.kind, self.device, self.stream, self.result_dtype = "torch", 0, 0, dtype

    def empty(self, shape, dtype):
        a = new_array(self.mem, tuple(shape), dtype.itemsize, dtype.kind in "iu")
        return tensor_of(a, dtype)


# ---------------------------------------------------------------------------------------------
# The kernels.

def _targs(expr):
    name, args = re.match(r"gpuops::(\w+)<(.*)>$", expr).groups()
    parts = [p.strip() for p in args.split(",")]
    return name, parts


def _flag(s):
    return {"true": True, "false": False}[s]


class SimKernel:
    def __init__(self, mem, expr):
        self.mem, self.expr = mem, expr
        self.name, self.targs = _targs(expr)

    def launch(self, grid, block, stream, *args, smem=0):
        assert block[0] * block[1] * block[2] <= 1024, "more than 1024 threads per block"
        assert all(g >= 1 for g in grid) and grid[0] < 2 ** 31, f"bad grid {grid}"
        assert smem <= SMEM_OPTIN, "more dynamic shared memory than the device allows"
        self.smem = smem
        getattr(self, "_" + self.name)(grid, block, *args)

    # ---- helpers
    def _T(self):
        return _ITEM[self.targs[0]]

    def _N(self, v):
        return 16 // self._T() if v else 1

    def ld(self, ptr, elem, count):
        return self.mem.load(ptr + elem * self._T(), count, self._T())

    def st(self, ptr, elem, values):
        self.mem.store(ptr + elem * self._T(), values, self._T())

    def ldf(self, ptr, elem, count=1):     # fp32 workspace words, each a scalar access
        return np.array([self.mem.load(ptr + (elem + k) * 4, 1, 4)[0] for k in range(count)])

    def stf(self, ptr, elem, values):
        for k, v in enumerate(np.atleast_1d(values)):
            self.mem.store(ptr + (elem + k) * 4, v, 4)

    @staticmethod
    def _check_group(tx, ty):
        assert tx & (tx - 1) == 0 and tx <= 1024, f"group size {tx} is not a power of two <= 1024"
        if tx > 32:
            assert ty == 1, "block-level groups need blockDim.y == 1"
            assert tx % 32 == 0
        else:
            assert (tx * ty) % 32 == 0, "sub-warp groups need whole warps"

    # ---- softmax_rows.cu
    def _softmax_rows(self, grid, block, x, y, rows, n, xs, ys):
        v, P, log = _flag(self.targs[1]), int(self.targs[2]), _flag(self.targs[3])
        N = self._N(v)
        tx_, ty_ = block[0], block[1]
        self._check_group(tx_, ty_)
        assert n % N == 0
        packs = n // N
        assert packs <= P * tx_, "row longer than the group's registers"
        for bx in range(grid[0]):
            for ty in range(ty_):
                row = bx * ty_ + ty
                if row >= rows:
                    continue
                loaded = {}
                for tx in range(tx_):
                    for p in range(P):
                        i = p * tx_ + tx
                        if i < packs:
                            loaded[i] = self.ld(x, row * xs + i * N, N)
                assert sorted(loaded) == list(range(packs))
                f = np.concatenate([loaded[i] for i in range(packs)])
                with np.errstate(all="ignore"):
                    m = np.max(f)
                    s = np.sum(np.exp(f - m))
                    out = (f - m) - np.log(s) if log else np.exp(f - m) / s
                for i in range(packs):
                    self.st(y, row * ys + i * N, out[i * N:(i + 1) * N])

    def _softmax_backward_rows(self, grid, block, g, y, dx, rows, n, gs, ys, ds):
        v, P, log = _flag(self.targs[1]), int(self.targs[2]), _flag(self.targs[3])
        N = self._N(v)
        tx_, ty_ = block[0], block[1]
        self._check_group(tx_, ty_)
        assert n % N == 0
        packs = n // N
        assert packs <= P * tx_
        for bx in range(grid[0]):
            for ty in range(ty_):
                row = bx * ty_ + ty
                if row >= rows:
                    continue
                idx = sorted(p * tx_ + tx for tx in range(tx_) for p in range(P)
                             if p * tx_ + tx < packs)
                assert idx == list(range(packs))
                fg = np.concatenate([self.ld(g, row * gs + i * N, N) for i in idx])
                fy = np.concatenate([self.ld(y, row * ys + i * N, N) for i in idx])
                with np.errstate(all="ignore"):
                    out = fg - np.exp(fy) * fg.sum() if log else fy * (fg - np.sum(fg * fy))
                for i in idx:
                    self.st(dx, row * ds + i * N, out[i * N:(i + 1) * N])

    # ---- softmax_split.cu
    def _chunks(self, grid, block, n, chunk, S, N, U=4):
        """For each block: (row, [element offsets of the packs its threads touch])."""
        assert block == (256, 1, 1)
        assert chunk % N == 0
        step = block[0] * N
        for b in range(grid[0]):
            row, part = divmod(b, S)
            begin, end = part * chunk, min(n, part * chunk + chunk)
            offs = []
            for tx in range(block[0]):
                for base in range(begin + tx * N, end, U * step):
                    for u in range(U):
                        if base + u * step < end:
                            assert base + u * step + N <= end, "pack straddles the chunk end"
                            offs.append(base + u * step)
            yield b, row, sorted(offs)

    def _softmax_split_stats(self, grid, block, x, xs, n, chunk, S, ws):
        N = self._N(_flag(self.targs[1]))
        seen = {}
        for b, row, offs in self._chunks(grid, block, n, chunk, S, N):
            f = np.concatenate([self.ld(x, row * xs + o, N) for o in offs]) if offs else np.array([])
            for o in offs:
                seen[(row, o)] = seen.get((row, o), 0) + 1
            with np.errstate(all="ignore"):
                m = np.max(f) if f.size else -np.inf
                s = np.sum(np.exp(f - (0.0 if m == -np.inf else m))) if f.size else 0.0
            self.stf(ws, 2 * b, [m, s])
        rows = grid[0] // S
        assert all(seen.get((r, o)) == 1 for r in range(rows) for o in range(0, n, N)), \
            "the chunks do not cover every row exactly once"

    def _merged(self, ws, row, S):
        m = np.array([self.ldf(ws, 2 * (row * S + j))[0] for j in range(S)])
        s = np.array([self.ldf(ws, 2 * (row * S + j) + 1)[0] for j in range(S)])
        with np.errstate(all="ignore"):
            M = np.max(m)
            scale = np.where(m == M, 1.0, np.exp(m - M))
        return M, np.sum(s * scale)

    def _softmax_split_apply(self, grid, block, x, y, xs, ys, n, chunk, S, ws):
        N, log = self._N(_flag(self.targs[1])), _flag(self.targs[2])
        for b, row, offs in self._chunks(grid, block, n, chunk, S, N):
            M, s = self._merged(ws, row, S)
            for o in offs:
                f = self.ld(x, row * xs + o, N)
                with np.errstate(all="ignore"):
                    out = (f - M) - np.log(s) if log else np.exp(f - M) / s
                self.st(y, row * ys + o, out)

    def _softmax_backward_split_stats(self, grid, block, g, y, gs, ys, n, chunk, S, ws):
        N, log = self._N(_flag(self.targs[1])), _flag(self.targs[2])
        for b, row, offs in self._chunks(grid, block, n, chunk, S, N):
            acc = 0.0
            for o in offs:
                fg = self.ld(g, row * gs + o, N)
                acc += fg.sum() if log else np.sum(fg * self.ld(y, row * ys + o, N))
            self.stf(ws, b, acc)

    def _softmax_backward_split_apply(self, grid, block, g, y, dx, gs, ys, ds, n, chunk, S, ws):
        N, log = self._N(_flag(self.targs[1])), _flag(self.targs[2])
        for b, row, offs in self._chunks(grid, block, n, chunk, S, N):
            acc = sum(self.ldf(ws, row * S + j)[0] for j in range(S))
            for o in offs:
                fg, fy = self.ld(g, row * gs + o, N), self.ld(y, row * ys + o, N)
                with np.errstate(all="ignore"):
                    out = fg - np.exp(fy) * acc if log else fy * (fg - acc)
                self.st(dx, row * ds + o, out)

    # ---- softmax_cols.cu
    def _cols(self, grid, block, R, I, nib, N):
        tx_, ty_ = block[0], block[1]
        assert tx_ * ty_ <= 256, "the column kernels' shared memory holds 256 threads"
        for b in range(grid[0]):
            o, ib = divmod(b, nib)
            for tx in range(tx_):
                i0 = (ib * tx_ + tx) * N
                if i0 < I:
                    assert i0 + N <= I
                    yield o, i0, [list(range(ty, R, ty_)) for ty in range(ty_)]

    def _softmax_cols(self, grid, block, x, y, R, I, nib, xso, xsr, xsi, yso, ysr, ysi):
        v, log = _flag(self.targs[1]), _flag(self.targs[2])
        N = self._N(v)
        if v:
            assert xsi == 1 and ysi == 1
        cols = 0
        for o, i0, rs in self._cols(grid, block, R, I, nib, N):
            cols += N
            assert sorted(r for part in rs for r in part) == list(range(R))
            f = np.stack([self.ld(x, o * xso + r * xsr + i0 * xsi, N) for r in range(R)])
            with np.errstate(all="ignore"):
                m = f.max(axis=0)
                s = np.exp(f - m).sum(axis=0)
                out = (f - m) - np.log(s) if log else np.exp(f - m) / s
            for r in range(R):
                self.st(y, o * yso + r * ysr + i0 * ysi, out[r])
        assert cols == (grid[0] // nib) * I, "the blocks do not cover every column once"

    def _softmax_backward_cols(self, grid, block, g, y, dx, R, I, nib, gso, gsr, gsi, yso, ysr,
                               ysi, dso, dsr, dsi):
        v, log = _flag(self.targs[1]), _flag(self.targs[2])
        N = self._N(v)
        if v:
            assert gsi == 1 and ysi == 1 and dsi == 1
        for o, i0, rs in self._cols(grid, block, R, I, nib, N):
            fg = np.stack([self.ld(g, o * gso + r * gsr + i0 * gsi, N) for r in range(R)])
            fy = np.stack([self.ld(y, o * yso + r * ysr + i0 * ysi, N) for r in range(R)])
            with np.errstate(all="ignore"):
                out = fg - np.exp(fy) * fg.sum(axis=0) if log else fy * (fg - (fg * fy).sum(axis=0))
            for r in range(R):
                self.st(dx, o * dso + r * dsr + i0 * dsi, out[r])

    # ---- cross_entropy.cu
    def _ti(self, k):
        return _ITEM[self.targs[k]]

    def _ce_stats(self, grid, block, x, xs, C, chunk, S, ws):
        N = self._N(_flag(self.targs[1]))
        for b, row, offs in self._chunks(grid, block, C, chunk, S, N):
            f = np.concatenate([self.ld(x, row * xs + o, N) for o in offs]) if offs else np.array([])
            with np.errstate(all="ignore"):
                m = np.max(f) if f.size else -np.inf
                s = np.sum(np.exp(f - (0.0 if m == -np.inf else m))) if f.size else 0.0
            self.stf(ws, 3 * b, [m, s, f.sum()])

    def _ce_finalize(self, grid, block, x, xs, target, ts, rows, C, S, ws, ignore, eps, mode,
                     loss, loss_stride, lse, partial):
        ti = self._ti(1)
        for b in range(grid[0]):
            tot, cnt = 0.0, 0.0
            for t_ in range(block[0]):
                row = b * block[0] + t_
                if row >= rows:
                    continue
                w = [self.ldf(ws, 3 * (row * S + j), 3) for j in range(S)]
                m = np.array([e[0] for e in w])
                with np.errstate(all="ignore"):
                    M = np.max(m)
                    s = np.sum(np.array([e[1] for e in w]) * np.where(m == M, 1.0, np.exp(m - M)))
                    z = M + np.log(s)
                sx = sum(e[2] for e in w)
                self.stf(lse, row, z)
                t = int(self.mem.load(target + row * ts * ti, 1, ti)[0])
                l_ = 0.0
                if t != ignore:
                    cnt += 1
                    if not 0 <= t < C:
                        l_ = np.nan
                    else:
                        l_ = z - self.ld(x, row * xs + t, 1)[0]
                        if eps:
                            l_ = (1 - eps) * l_ + eps * (z - sx / C)
                tot += l_
                if mode == 0:
                    self.st(loss, row * loss_stride, l_)
            if mode != 0:
                self.stf(partial, 2 * b, [tot, cnt])

    def _ce_reduce(self, grid, block, partial, nparts, mode, out):
        assert grid == (1, 1, 1)
        p = [self.ldf(partial, 2 * j, 2) for j in range(nparts)]
        tot, cnt = sum(e[0] for e in p), sum(e[1] for e in p)
        with np.errstate(all="ignore"):
            self.st(out, 0, np.float64(tot) / cnt if mode == 2 else tot)

    def _ce_count(self, grid, block, target, ts, rows, ignore, count):
        ti = self._ti(0)
        c = sum(int(self.mem.load(target + r * ts * ti, 1, ti)[0]) != ignore for r in range(rows))
        self.stf(count, 0, float(c))

    def _ce_backward(self, grid, block, grad, gs, x, xs, target, ts, lse, glse, glse_stride, dx,
                     ds, C, cpb, ignore, eps, mode, count):
        N, ti = self._N(_flag(self.targs[2])), self._ti(1)
        assert block == (256, 1, 1)
        written = set()
        for b in range(grid[0]):
            row, part = divmod(b, cpb)
            t = int(self.mem.load(target + row * ts * ti, 1, ti)[0])
            for tx in range(block[0]):
                j0 = (part * block[0] + tx) * N
                if j0 >= C:
                    continue
                assert j0 + N <= C
                a = 0.0
                if t != ignore:
                    a = self.ld(grad, row * gs if mode == 0 else 0, 1)[0] if grad else 1.0
                    if mode == 2:
                        a /= self.ldf(count, 0)[0]
                bb = self.ldf(glse, row * glse_stride)[0] if glse else 0.0
                if a == 0 and bb == 0:
                    self.st(dx, row * ds + j0, np.zeros(N))
                else:
                    z = self.ldf(lse, row)[0]
                    f = self.ld(x, row * xs + j0, N)
                    with np.errstate(all="ignore"):
                        v = np.exp(f - z) * (a + bb) - a * eps / C
                    for k in range(N):
                        if j0 + k == t:
                            v[k] -= a * (1 - eps)
                    self.st(dx, row * ds + j0, v)
                written.update((row, j0 + k) for k in range(N))
        rows = grid[0] // cpb
        assert len(written) == rows * C, "the backward grid does not cover the input once"


    def _ce_fused(self, grid, block, x, xs, target, ts, C, cache_packs, ignore, eps, mode, count,
                  dx, ds, loss, loss_stride, partial, smem=0):
        N, ti = self._N(_flag(self.targs[2])), self._ti(1)
        TX = block[0]
        assert block[1] == block[2] == 1 and TX % 32 == 0 and TX <= 1024
        assert C % N == 0
        packs = C // N
        raw = 16 if N > 1 else 4
        assert cache_packs <= packs and self.smem == cache_packs * raw, "cache/smem mismatch"
        for row in range(grid[0]):
            t = int(self.mem.load(target + row * ts * ti, 1, ti)[0])
            valid, inside = t != ignore, 0 <= t < C
            xt = self.ld(x, row * xs + t, 1)[0] if valid and inside else 0.0
            idx = [i for tx in range(TX) for i0 in range(tx, packs, 2 * TX) for i in (i0, i0 + TX)
                   if i < packs]
            assert sorted(idx) == list(range(packs)), "pass 1 does not cover the row once"
            cache = {i: self.ld(x, row * xs + i * N, N) for i in idx if i < cache_packs}
            f = np.concatenate([self.ld(x, row * xs + i * N, N) for i in range(packs)])
            with np.errstate(all="ignore"):
                M = np.max(f)
                z = M + np.log(np.sum(np.exp(f - M)))
                l_ = 0.0
                if valid:
                    l_ = z - xt if inside else np.nan
                    if inside and eps:
                        l_ = (1 - eps) * l_ + eps * (z - f.sum() / C)
            if mode == 0:
                self.st(loss, row * loss_stride, l_)
            else:
                self.stf(partial, 2 * row, [l_, float(valid)])
            a = (1.0 / self.ldf(count, 0)[0] if mode == 2 else 1.0) if valid else 0.0
            for tx in range(TX):
                for i in range(tx, packs, TX):
                    if a == 0:
                        v = np.zeros(N)
                    else:
                        g = cache[i] if i < cache_packs else self.ld(x, row * xs + i * N, N)
                        with np.errstate(all="ignore"):
                            v = np.exp(g - z) * a - a * eps / C
                        for k in range(N):
                            if i * N + k == t:
                                v[k] -= a * (1 - eps)
                    self.st(dx, row * ds + i * N, v)

    def _ce_scale(self, grid, block, grad, gs, mode, src, ss, dst, ds, rows, C, cpb):
        N = self._N(_flag(self.targs[1]))
        assert block == (256, 1, 1)
        in_place = src == dst
        if mode != 0 and in_place and self.ld(grad, 0, 1)[0] == 1.0:
            return
        done = set()
        for b in range(grid[0]):
            for w in range(b, rows * cpb, grid[0]):
                row, part = divmod(w, cpb)
                a = self.ld(grad, row * gs if mode == 0 else 0, 1)[0]
                for tx in range(256):
                    j0 = (part * 256 + tx) * N
                    if (in_place and a == 1.0) or j0 >= C:
                        continue
                    assert j0 + N <= C
                    self.st(dst, row * ds + j0, self.ld(src, row * ss + j0, N) * a)
                    done.add((row, j0))
        assert all((r, j) in done for r in range(rows) for j in range(0, C, N)
                   if not (in_place and self.ld(grad, r * gs if mode == 0 else 0, 1)[0] == 1.0))


class SimKernels:
    """Stands in for gpuops.ops.softmax.KERNELS."""

    def __init__(self, mem):
        self.mem = mem
        self.launched = []

    def get(self, dev, module, expr):
        assert expr in module.kernels, f"{expr} is not declared in {module.name}"
        self.launched.append(expr)
        return SimKernel(self.mem, expr)


def run_op(monkeypatch, op_name, dtype, build, smem_budget=SMEM_OPTIN - 1024, sms=132):
    """Run op ``op_name``'s GPU implementation on simulated memory. ``build(mem)`` returns the
    op's arguments (simulated Tensors and Python values) as (args, kwargs)."""
    from gpuops import registry  # noqa: PLC0415
    from gpuops.ops import softmax as sm  # noqa: PLC0415
    mem = Memory()
    kernels = SimKernels(mem)
    monkeypatch.setattr(sm, "KERNELS", kernels)
    monkeypatch.setattr(sm, "_PLANS", {})
    import gpuops.ops.loss as loss_mod  # noqa: PLC0415
    monkeypatch.setattr(loss_mod, "KERNELS", kernels)
    monkeypatch.setattr(sm, "sm_count", lambda dev: sms)
    monkeypatch.setattr(loss_mod, "sm_count", lambda dev: sms)
    monkeypatch.setitem(loss_mod._smem_budget, 0, smem_budget)
    args, kwargs = build(mem)
    call = FakeCall(mem, op_name, dtype)
    out = registry.get(op_name).impl(call, *args, **kwargs)
    return out, kernels.launched


def values(t):
    """Host values of a simulated Tensor (or tuple of them)."""
    if isinstance(t, tuple):
        return tuple(values(e) for e in t)
    return np.asarray(t.obj.values(), dtype=np.float64)


FLOAT_DTYPES = {"float32": dt.float32, "float16": dt.float16, "bfloat16": dt.bfloat16}
