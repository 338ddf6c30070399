"""The norms family on the host emulator: the ops' real launch code (gpuops/ops/norms.py) drives
the real kernels (cuda_src/norms, emulated on CPU threads) on torch CPU tensors, checked against
the float64 references with the test tolerances. Run from the repository root:

    python3 scripts/host_emulation/run_norms.py            # every case (~25 min on 2 cores)
    python3 scripts/host_emulation/run_norms.py split64    # cases whose name contains split64
    python3 scripts/host_emulation/run_norms.py extras     # strided, out=, NaN, empty, determinism
"""
import ctypes
import dataclasses
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT), str(ROOT / "tests")]
import numpy as np
import torch
import emulate
from gpuops import dtypes as dt, registry
from gpuops.ops import norms as N
from gpuops.tensor import Tensor
from conftest import assert_close

lib, table = emulate.build([N.LAYER_NORM_MODULE, N.RMS_NORM_MODULE, N.BACKWARD_MODULE])


class FakeRuntime:
    @staticmethod
    def memsetAsync(ptr, value, nbytes, stream):
        ctypes.memset(ptr, value, nbytes)


class FakeCupy:
    class cuda:
        runtime = FakeRuntime


class Info:
    sm_count = 4


OCC = [4]
N.loader.load = lambda module, dev: emulate.EmuLoaded(lib, table, module)
N._occupancy = lambda ptr, threads, smem: OCC[0]
N.device.device_info = lambda dev: Info
N.device.cupy_or_none = lambda: FakeCupy


class EmuCall:
    kind = "torch"
    device = 0
    stream = 0

    def __init__(self, dtype, op):
        self.result_dtype = dtype
        self.op = registry.get(op)

    def empty(self, shape, dtype):
        obj = torch.empty(tuple(shape), dtype=dt.to_torch(dtype))
        obj.view(torch.uint8).fill_(0xFF) if obj.numel() else None     # NaN poison
        return Tensor(obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), dtype, 0, obj,
                      obj.numel(), True)


def T(t):
    d = dt.torch_table()[t.dtype]
    return Tensor(t.data_ptr(), tuple(t.shape), tuple(t.stride()), d, 0, t, t.numel(),
                  t.is_contiguous())


def run(op, dtype, *args, **kw):
    call = EmuCall(dt.BY_NAME[dtype], op)
    args = [T(a) if isinstance(a, torch.Tensor) else a for a in args]
    kw = {k: T(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    res = registry.get(op).impl(call, *args, **kw)
    return tuple(r.obj for r in res) if isinstance(res, tuple) else res.obj


def np64(t):
    return t.double().numpy()


def randn(shape, dtype, scale=1.0, offset=0.0):
    return (torch.randn(shape) * scale + offset).to(getattr(torch, dtype))


def grad_like(x):
    return (0.5 * x.float() + 1.0 + 0.3 * torch.randn(x.shape)).to(x.dtype)


def check_all(shape, dtype, what, x=None, affine=True):
    n = shape[-1]
    ns = (n,)
    x = randn(shape, dtype, 2.0, 0.5) if x is None else x
    w = randn((n,), dtype, 0.5, 1.0) if affine else None
    b = randn((n,), dtype) if affine else None
    wn = None if w is None else np64(w)
    bn = None if b is None else np64(b)
    # layer_norm
    y, mean, rstd = run("layer_norm_forward", dtype, x, ns, w, b, 1e-5)
    ry, rm, rr = N.ref_layer_norm_forward(np64(x), ns, wn, bn, 1e-5)
    assert_close(np64(y), ry, dtype, f"ln {what}")
    assert_close(np64(mean), rm, "float32", f"mean {what}")
    assert_close(np64(rstd), rr, "float32", f"rstd {what}")
    y2 = run("layer_norm", dtype, x, ns, w, b, 1e-5)
    assert torch.equal(y2, y) or (torch.isnan(y2) == torch.isnan(y)).all(), what
    dy = grad_like(x)
    dx, dw, db = run("layer_norm_backward", dtype, dy, x, mean, rstd, ns, w)
    rx, rw, rb = N.ref_layer_norm_backward(np64(dy), np64(x), np64(mean), np64(rstd), ns, wn)
    assert_close(np64(dx), rx, dtype, f"ln dx {what}")
    assert_close(np64(dw), rw, dtype, f"ln dw {what}")
    assert_close(np64(db), rb, dtype, f"ln db {what}")
    # rms_norm
    y, rstd = run("rms_norm_forward", dtype, x, ns, w, 1e-6)
    ry, rr = N.ref_rms_norm_forward(np64(x), ns, wn, 1e-6)
    assert_close(np64(y), ry, dtype, f"rms {what}")
    assert_close(np64(rstd), rr, "float32", f"rms rstd {what}")
    assert torch.equal(run("rms_norm", dtype, x, ns, w, 1e-6), y)
    dx, dw = run("rms_norm_backward", dtype, dy, x, rstd, ns, w)
    rx, rw, _ = N._ref_backward("t", False, np64(dy), np64(x), None, np64(rstd), ns, wn)
    assert_close(np64(dx), rx, dtype, f"rms dx {what}")
    assert_close(np64(dw), rw, dtype, f"rms dw {what}")
    if w is None:
        return
    # add_rms_norm
    r = randn(shape, dtype)
    y, h, rstd = run("add_rms_norm_forward", dtype, x, r, w, 1e-6)
    assert torch.equal(h, x + r), f"residual {what}"
    ry, rr = N.ref_rms_norm_forward(np64(h), w.shape, wn, 1e-6)
    assert_close(np64(y), ry, dtype, f"add {what}")
    assert_close(np64(rstd), rr, "float32", f"add rstd {what}")
    y1, h1 = run("add_rms_norm", dtype, x, r, w, 1e-6)
    assert torch.equal(y1, y) and torch.equal(h1, h)
    dh = randn(shape, dtype)
    for g in (dh, None):
        dx, dw = run("add_rms_norm_backward", dtype, dy, g, h, rstd, w)
        rx, rw = N.ref_add_rms_norm_backward(np64(dy), None if g is None else np64(g), np64(h),
                                             np64(rstd), wn)
        assert_close(np64(dx), rx, dtype, f"add dx {what}")
        assert_close(np64(dw), rw, dtype, f"add dw {what}")


DEFAULT_TUNING = dict(N.TUNING)


def tuned(**kw):
    """TUNING with the given fields replaced in every kind (no arguments: the defaults)."""
    for name, kind in DEFAULT_TUNING.items():
        N.TUNING[name] = dataclasses.replace(kind, **kw)
    N._plans.clear()


def main(selected=None):
    """Every op and dtype: rows in one block or one warp, split rows in one launch (pipelined) and
    in two, with tiny blocks (64 threads) to split small rows, and the default split config."""
    cases = []
    for dtype in ("float32", "float16", "bfloat16"):
        for shape in [(5, 1), (7, 3), (11, 128), (9, 1000), (6, 4096), (3, 4097), (2, 3, 40)]:
            cases.append(("rows", dtype, shape, {}, False))
        cases.append(("noaffine", dtype, (9, 1000), {}, False))
        for force in (False, True):
            small = dict(max_rows_threads=64, split_threads=64)
            cases.append(("split64", dtype, (13, 5000), small, force))
            cases.append(("split64-odd", dtype, (5, 3001), small, force))
    cases.append(("default-split", "bfloat16", (3, 20000), {}, False))
    cases.append(("default-split", "float32", (3, 20000), {}, False))
    cases.append(("default-split-2launch", "float32", (3, 20000), {}, True))
    failures = 0
    for name, dtype, shape, kw, force in cases:
        if selected and not any(s in name for s in selected):
            continue
        tuned(**kw)
        N.FORCE_TWO_LAUNCHES = force
        t0 = time.time()
        try:
            check_all(shape, dtype, f"{name} {dtype} {shape} force={force}",
                      affine=(name != "noaffine"))
            status = "ok"
        except Exception as exc:
            failures += 1
            status = "FAIL " + "".join(traceback.format_exception_only(exc)).strip()[:600]
        print(f"{name:22s} {dtype:9s} {str(shape):12s} two={force!s:5s} "
              f"{time.time() - t0:6.1f}s {status}", flush=True)
    tuned()
    N.FORCE_TWO_LAUNCHES = False
    print("failures:", failures)




def extras():
    tuned()
    out = []

    def case(name, fn):
        t0 = time.time()
        try:
            fn()
            s = "ok"
        except Exception as exc:
            s = "FAIL " + "".join(traceback.format_exception_only(exc)).strip()[:800]
        out.append(s)
        print(f"{name:40s} {time.time() - t0:6.1f}s {s}", flush=True)

    def strided():
        for dtype in ("float32", "bfloat16"):
            wide = randn((6, 1040), dtype)
            x = wide[:, 8:8 + 1024]                      # row-strided, aligned: packs
            check_all(x.shape, dtype, "strided", x=x)
            xu = wide[:, 1:1 + 1024]                     # unaligned: elements
            check_all(xu.shape, dtype, "unaligned", x=xu)
            xt = randn((64, 6), dtype).t()               # transposed: copied
            check_all(xt.shape, dtype, "transposed", x=xt)
    case("strided / unaligned / transposed", strided)

    def multi_dim():
        for dtype in ("float32", "float16"):
            x = randn((2, 3, 5, 48), dtype, 1.5, -0.5)
            w, b = randn((5, 48), dtype), randn((5, 48), dtype)
            y, m, r = run("layer_norm_forward", dtype, x, (5, 48), w, b, 1e-5)
            ry, rm, rr = N.ref_layer_norm_forward(np64(x), (5, 48), np64(w), np64(b), 1e-5)
            assert_close(np64(y), ry, dtype, "ln (5,48)")
            assert m.shape == (2, 3)
            dy = grad_like(x)
            dx, dw, db = run("layer_norm_backward", dtype, dy, x, m, r, (5, 48), w)
            rx, rw, rb = N.ref_layer_norm_backward(np64(dy), np64(x), np64(m), np64(r), (5, 48),
                                                   np64(w))
            assert_close(np64(dx), rx, dtype, "ln dx (5,48)")
            assert_close(np64(dw), rw, dtype, "ln dw (5,48)")
            y, r = run("rms_norm_forward", dtype, x, (5, 48), None, None)
            eps = {"float32": 2.0 ** -23, "float16": 2.0 ** -10}[dtype]
            ry, rr = N.ref_rms_norm_forward(np64(x), (5, 48), None, eps)
            assert_close(np64(y), ry, dtype, "rms (5,48) eps=None")
            w1 = randn((48,), dtype)
            yy, hh = run("add_rms_norm", dtype, x, x, w1, 1e-6)
            assert torch.equal(hh, x + x)
    case("multi-dim normalized shape, eps=None", multi_dim)

    def out_and_inplace():
        for dtype in ("float32", "bfloat16"):
            x = randn((7, 512), dtype)
            w = randn((512,), dtype)
            o = torch.full((7, 512), float("nan"), dtype=x.dtype)
            y = run("layer_norm", dtype, x, 512, w, None, 1e-5, out=o)
            assert y is o
            assert_close(np64(o), N.ref_layer_norm(np64(x), 512, np64(w)), dtype, "out=")
            ow = torch.full((7, 600), float("nan"), dtype=x.dtype)
            y = run("rms_norm", dtype, x, 512, w, 1e-6, out=ow[:, :512])
            assert_close(np64(y), N.ref_rms_norm(np64(x), 512, np64(w), 1e-6), dtype, "strided out=")
            assert torch.isnan(ow[:, 512:]).all()
            xc = x.clone()
            exp = N.ref_layer_norm(np64(xc), 512, np64(w), None)
            run("layer_norm", dtype, xc, 512, w, None, 1e-5, out=xc)
            assert_close(np64(xc), exp, dtype, "in place")
            try:
                run("layer_norm", dtype, xc[:, :256], 256, out=xc[:, 1:257])
                raise AssertionError("overlap accepted")
            except ValueError as e:
                assert "overlaps" in str(e)
    case("out= / strided out / in place", out_and_inplace)

    def nan_rows():
        for dtype in ("float32", "bfloat16"):
            x = randn((6, 1024), dtype)
            x[1, 7] = float("nan")
            x[3, 100] = float("inf")
            x[4, 5] = float("-inf")
            w = randn((1024,), dtype)
            y = run("layer_norm", dtype, x, 1024, w, None, 1e-5)
            assert_close(np64(y), N.ref_layer_norm(np64(x), 1024, np64(w)), dtype, "ln nan rows")
            y = run("rms_norm", dtype, x, 1024, w, 1e-6)
            assert_close(np64(y), N.ref_rms_norm(np64(x), 1024, np64(w), 1e-6), dtype, "rms nan rows")
    case("NaN / Inf rows", nan_rows)

    def empty():
        x = torch.empty((0, 64))
        assert run("layer_norm", "float32", x, 64).shape == (0, 64)
        y, m, r = run("layer_norm_forward", "float32", torch.empty((3, 0)), 0)
        assert y.shape == (3, 0) and torch.all(m == 0) and torch.isnan(r).all()
        dx, dw, db = run("layer_norm_backward", "float32", x, x, torch.empty(0), torch.empty(0), 64)
        assert torch.all(dw == 0) and torch.all(db == 0)
    case("empty", empty)

    def expanded_grad():
        x = randn((9, 256), "float32")
        _, m, r = run("layer_norm_forward", "float32", x, 256)
        dy = torch.ones(()).expand(9, 256)
        dx, dw, db = run("layer_norm_backward", "float32", dy, x, m, r, 256, None)
        rx, rw, rb = N.ref_layer_norm_backward(np64(dy), np64(x), np64(m), np64(r), 256, None)
        assert_close(np64(dx), rx, "float32", "expanded dx")
        assert_close(np64(db), rb, "float32", "expanded db")
    case("expanded grad_output", expanded_grad)

    def determinism():
        x = randn((40, 512), "float32")
        w = randn((512,), "float32")
        _, m, r = run("layer_norm_forward", "float32", x, 512, w, w)
        dy = grad_like(x)
        a = run("layer_norm_backward", "float32", dy, x, m, r, 512, w)
        for _ in range(2):
            b = run("layer_norm_backward", "float32", dy, x, m, r, 512, w)
            assert all(torch.equal(p, q) for p, q in zip(a, b))
    case("deterministic weight grads", determinism)
    print("extras failures:", sum(s != "ok" for s in out))


if __name__ == "__main__":
    if sys.argv[1:2] == ["extras"]:
        extras()
    else:
        main(sys.argv[1:])
