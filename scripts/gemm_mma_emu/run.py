"""The mma GEMM kernels (cuda_src/gemm/mma.cu) on the CPU: tests/emu.py's kernel emulator with
host stand-ins for the tensor-core wrappers of cuda_src/gemm/mma_common.cuh (this directory:
ldmatrix and mma.sync as warp-collective exchanges, cp.async as an immediate copy), driven by
gpuops.ops.gemm's own host code. This is how the rebuilt mma kernel was checked before any GPU
run: every tile configuration, layout, edge, K tail, partial 16-byte chunk, batch and epilogue,
fp16/bf16, TF32, int8 and the dual (SwiGLU) kernel, against float64 products.

    python scripts/gemm_mma_emu/run.py [TILES] [SECTIONS]
    TILES:    comma-separated keys of gpuops.ops.gemm.MMA_TILES (default: all)
    SECTIONS: layouts,chunks,epi,batch,f16,int8,dual,tf32 (default: all); about 5 minutes

A verification tool, not a test: it goes once the emulator stand-ins of the mma wrappers (issue
5's move of them to cuda_src/common/mma.cuh) let tests/test_gemm.py run these kernels itself.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import emu  # noqa: E402
from gpuops import dtypes as dt  # noqa: E402
from gpuops.ops import gemm as G  # noqa: E402
from gpuops.registry import get as get_op  # noqa: E402
from gpuops.runtime import device  # noqa: E402
from gpuops.runtime.sources import assemble, cuda_src_root  # noqa: E402

_SMEM = re.compile(r"extern\s+__shared__\s+__align__\(\d+\)\s+unsigned char (\w+)\[\];")
_PACK2 = ("  static unsigned pack2(float lo, float hi) {\n"
          "    return from_float<T>(lo).bits | static_cast<unsigned>(from_float<T>(hi).bits) << 16;\n"
          "  }\n")
_PRELUDE = """#include <algorithm>
using std::min; using std::max;
#define __trap() emu::fail("trap")
"""


def build(module):
    """The module as a host shared library (cached by source hash), {expression: index}."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "cuda_src"
        shutil.copytree(cuda_src_root(), root)
        for f in (emu.HERE / "common").iterdir():
            shutil.copy(f, root / "common" / f.name)
        shutil.copy(HERE / "fastmath.cuh", root / "common" / "fastmath.cuh")
        shutil.copy(HERE / "mma_common.cuh", root / "gemm" / "mma_common.cuh")
        vec = (root / "common" / "vec.cuh").read_text()
        if "pack2" not in vec:      # the emulator's vec.cuh predates Vec16::pack2
            anchor = "  static uint4 pack(const float (&f)[8]) {"
            vec = vec.replace(anchor, _PACK2 + anchor)
        (root / "common" / "vec.cuh").write_text(vec)
        text = assemble(module.source, root=root).text
    text = _SMEM.sub(r"unsigned char* \1 = emu::dynamic_smem;", text)
    exprs = list(module.kernels)
    lines = [_PRELUDE, text,
             'extern "C" const char* emu_fail_msg() { return emu::fail_msg; }',
             'extern "C" void emu_set_schedule(int concurrent, unsigned long long seed) '
             '{ emu::concurrent = concurrent; emu::rng_state = seed; }']
    for i, expr in enumerate(exprs):
        lines.append(f'extern "C" int emu_launch_{i}(const unsigned* dims, unsigned long long smem, '
                     f"const unsigned char* buf) {{ emu::failed = 0; "
                     f"emu::launch_packed(&{expr}, dims, smem, buf); return emu::failed.load(); }}")
    text = "\n".join(lines) + "\n"
    key = hashlib.sha256((text + (emu.HERE / "emu.h").read_text()).encode()).hexdigest()[:20]
    emu.CACHE.mkdir(parents=True, exist_ok=True)
    lib_path = emu.CACHE / f"mma-emu-{module.name}-{key}.so"
    if not lib_path.exists():
        src = lib_path.with_suffix(".cpp")
        src.write_text(text)
        cmd = ["g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-w", "-U_FORTIFY_SOURCE",
               "-D__CUDA_ARCH__=900", "-include", str(emu.HERE / "emu.h"), "-o", str(lib_path),
               str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(r.stderr[-8000:])
    lib = ctypes.CDLL(str(lib_path))
    lib.emu_fail_msg.restype = ctypes.c_char_p
    return lib, {e: i for i, e in enumerate(exprs)}


class Dev:
    """Routes gpuops.ops.gemm's launches to the emulator; an H100-like device (132 SMs would
    make the tile choice realistic, but PLAN['mma_tiles'] forces the configuration anyway)."""

    def __init__(self, sms=4, smem_optin=232448):
        self.sms, self.smem = sms, smem_optin
        self.libs = {}
        self.launched = []

    def __enter__(self):
        self.saved = (G._kernels.get, device.device_info, G.effective_arch)
        dev = self

        class Info:
            sm_count = dev.sms
            max_smem_per_block_optin = dev.smem
            cc = 90

        def get(module, expr, _device):
            if module.name not in dev.libs:
                dev.libs[module.name] = build(module)
            lib, index = dev.libs[module.name]
            dev.launched.append(expr)
            return emu.EmuKernel(lib, index[expr], module.kernels[expr], expr)

        G._kernels.get = get
        device.device_info = lambda _device: Info()
        G.effective_arch = lambda _device: 90
        self.emu = emu.Device(sms=self.sms)
        return self

    def __exit__(self, *exc):
        G._kernels.get, device.device_info, G.effective_arch = self.saved
        return False

    def matmul(self, a, b, d, *, bias=None, act=None, residual=None, alpha=1.0, out_dtype=None,
               allow_tf32=False, b2=None):
        e = self.emu
        call = e.call("matmul", d)
        od = G.parse_dtype(out_dtype) or d
        kw = {}
        if bias is not None:
            kw["bias"] = e.tensor(bias, od)
        if residual is not None:
            kw["residual"] = e.tensor(residual, od)
        if b2 is not None:
            out = G.gemm(call, "swiglu_linear", e.tensor(a, d), e.tensor(b, d), variant="mma",
                         b2=e.tensor(b2, d))
        else:
            out = G.gemm(call, "matmul", e.tensor(a, d), e.tensor(b, d), activation=act,
                         alpha=alpha, out_dtype=out_dtype, variant="mma", allow_tf32=allow_tf32,
                         **kw)
        return out.obj


RNG = np.random.default_rng(1)
FAILS: list = []


def rnd(shape, d):
    return RNG.standard_normal(shape).astype(emu.np_dtype(d))


def act_ref(act, y):
    if act is None:
        return y
    if act == "relu":
        return np.maximum(y, 0)
    if act == "silu":
        return y / (1 + np.exp(-y))
    if act == "gelu":
        return 0.5 * y * (1 + np.vectorize(math.erf)(y / math.sqrt(2)))
    return 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))


def check(out, a, b, what, *, bias=None, act=None, res=None, alpha=1.0, u=2.0 ** -8, b2=None):
    """|out - ref| <= 1e-4 sqrt(K) |A||B|-sized terms + u |ref| (u: the output's rounding)."""
    A, B = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if b2 is not None:
        B2 = np.asarray(b2, np.float64)
        g, up = A @ B, A @ B2
        ref = g / (1 + np.exp(-g)) * up
        mag = (np.abs(A) @ np.abs(B)) * (1 + np.abs(up)) + (np.abs(A) @ np.abs(B2)) * (1 + np.abs(g))
    else:
        y = alpha * (A @ B)
        mag = abs(alpha) * (np.abs(A) @ np.abs(B))
        if bias is not None:
            y = y + np.asarray(bias, np.float64)
            mag = mag + np.abs(np.asarray(bias, np.float64))
        y = act_ref(act, y)
        if res is not None:
            y = y + np.asarray(res, np.float64)
            mag = mag + np.abs(np.asarray(res, np.float64))
        ref = y
    o = np.asarray(out, np.float64)
    if o.shape != ref.shape:
        print(f"FAIL {what}: shape {o.shape} != {ref.shape}")
        FAILS.append(what)
        return
    bad = ~(np.abs(o - ref) <= 1e-4 * math.sqrt(A.shape[-1]) * mag + u * np.abs(ref) + 1e-6)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        print(f"FAIL {what}: {int(bad.sum())} of {o.size} off; at {i} got {o[i]} want {ref[i]}")
        FAILS.append(what)
    else:
        print(f"ok   {what}", flush=True)


def layouts(M, N, K, d):
    yield "nn", rnd((M, K), d), rnd((K, N), d)
    yield "tn", np.ascontiguousarray(rnd((K, M), d)).T, rnd((K, N), d)
    yield "nt", rnd((M, K), d), np.ascontiguousarray(rnd((N, K), d)).T
    yield "tt", np.ascontiguousarray(rnd((K, M), d)).T, np.ascontiguousarray(rnd((N, K), d)).T


def run_tiles(dev, tile, sections):
    d = dt.bfloat16
    if "layouts" in sections:
        # aligned (vector path) with M/N edges, K tails, several blocks; then the checked path
        for M, N, K in ((200, 264, 136), (256, 512, 200), (72, 40, 520), (300, 8, 64)):
            for lay, a, b in layouts(M, N, K, d):
                check(dev.matmul(a, b, d), a, b, f"{tile} {lay} {M}x{N}x{K}")
        M, N, K = 131, 97, 136
        a, b = rnd((M, 2 * K), d)[:, ::2], rnd((3 * K, N), d)[::3]
        check(dev.matmul(a, b, d), a, b, f"{tile} sliced")
        a, b = rnd((M * K + 1,), d)[1:].reshape(M, K), rnd((K, N + 1), d)[:, 1:]
        check(dev.matmul(a, b, d), a, b, f"{tile} unaligned")
    if "chunks" in sections:
        # aligned rows, extents ending inside a 16-byte chunk (K tail, N and M edges)
        a, b = rnd((300, 144), d)[:, :139], rnd((139, 304), d)[:, :299]
        check(dev.matmul(a, b, d), a, b, f"{tile} partial chunks")
        a = rnd((139, 136), d)[:, :133].T
        check(dev.matmul(a, b, d), a, b, f"{tile} partial chunks a.T")
        a, b = rnd((256, 272), d)[:, :264], rnd((264, 520), d)[:, :512]
        check(dev.matmul(a, b, d), a, b, f"{tile} strided, aligned, interior")
    if "epi" in sections:
        M, N, K = 136, 272, 72
        a, b = rnd((M, K), d), rnd((K, N), d)
        bias, res = rnd((N,), d), rnd((M, N), d)
        for act in (None, "gelu", "silu", "relu", "gelu_tanh"):
            out = dev.matmul(a, b, d, bias=bias, act=act, residual=res, alpha=0.5)
            check(out, a, b, f"{tile} epilogue {act}", bias=bias, act=act, res=res, alpha=0.5)
        row = rnd((N,), d)
        check(dev.matmul(a, b, d, residual=row), a, b, f"{tile} row residual", res=row)
        res_t = np.ascontiguousarray(rnd((N, M), d)).T
        check(dev.matmul(a, b, d, residual=res_t), a, b, f"{tile} transposed residual", res=res_t)
        b32, r32 = bias.astype(np.float32), res.astype(np.float32)
        out = dev.matmul(a, b, d, bias=b32, residual=r32, act="gelu", out_dtype="float32")
        assert out.dtype == np.float32
        check(out, a, b, f"{tile} fp32 out", bias=b32, res=r32, act="gelu", u=1e-6)
        M, N, K = 70, 67, 300                                   # N % 8: per element
        a, b, bias, res = rnd((M, K), d), rnd((K, N), d), rnd((N,), d), rnd((M, N), d)
        check(dev.matmul(a, b, d, bias=bias, residual=res, act="silu"), a, b,
              f"{tile} ragged epilogue", bias=bias, res=res, act="silu")
    if "batch" in sections:
        cases = {
            "bmm": (rnd((3, 40, 72), d), rnd((3, 72, 24), d)),
            "bmm_t": (np.ascontiguousarray(rnd((2, 72, 40), d)).transpose(0, 2, 1),
                      np.ascontiguousarray(rnd((2, 24, 72), d)).transpose(0, 2, 1)),
            "fold": (rnd((2, 3, 50, 64), d), rnd((64, 136), d)),
            "broadcast": (rnd((3, 1, 33, 64), d), rnd((2, 64, 48), d))}
        for what, (a, b) in cases.items():
            check(dev.matmul(a, b, d), a, b, f"{tile} batched {what}")
    if "f16" in sections:
        for lay, a, b in layouts(136, 264, 136, dt.float16):
            check(dev.matmul(a, b, dt.float16), a, b, f"{tile} f16 {lay}", u=2.0 ** -10)
    if "int8" in sections:
        impl = get_op("int8_matmul").impl
        for M, N, K in ((130, 264, 200), (17, 33, 65), (256, 512, 320)):
            a = RNG.integers(-128, 128, (M, K)).astype(np.int8)
            w = RNG.integers(-128, 128, (N, K)).astype(np.int8)
            sa = ((RNG.random(M) + 0.1) / 128).astype(np.float32)
            sb = ((RNG.random(N) + 0.1) / 128).astype(np.float32)
            for what, b in (("W.T", w.T), ("row-major b", np.ascontiguousarray(w.T))):
                e = dev.emu
                out = impl(e.call("int8_matmul", dt.int8), e.tensor(a), e.tensor(b),
                           e.tensor(sa), e.tensor(sb), "bfloat16", variant="mma")
                ref = (a.astype(np.float64) @ b.astype(np.float64)) * sa[:, None] * sb[None, :]
                ok = np.all(np.abs(np.asarray(out.obj, np.float64) - ref)
                            <= (1e-5 + 2.0 ** -8) * np.abs(ref) + 1e-6)
                print(("ok  " if ok else "FAIL") + f" {tile} int8 {M}x{N}x{K} {what}")
                if not ok:
                    FAILS.append(f"int8 {tile}")


def main():
    tiles = (sys.argv[1] if len(sys.argv) > 1 else ",".join(sorted(G.MMA_TILES))).split(",")
    sections = set((sys.argv[2] if len(sys.argv) > 2 else
                    "layouts,chunks,epi,batch,f16,int8,dual,tf32").split(","))
    d = dt.bfloat16
    with Dev() as dev:
        for tile in tiles:
            G.PLAN["mma_tiles"] = tile
            run_tiles(dev, tile, sections)
        G.PLAN["mma_tiles"] = "auto"
        if "dual" in sections:
            for M, N, K in ((136, 200, 136), (17, 33, 65), (130, 128, 64)):
                a, wg, wu = rnd((M, K), d), rnd((N, K), d), rnd((N, K), d)
                check(dev.matmul(a, wg.T, d, b2=wu.T), a, wg.T, f"dual {M}x{N}x{K}", b2=wu.T)
        if "tf32" in sections:
            for M, N, K in ((136, 130, 72), (70, 67, 33)):
                for lay, a, b in layouts(M, N, K, dt.float32):
                    check(dev.matmul(a, b, dt.float32, allow_tf32=True), a, b,
                          f"tf32 {lay} {M}x{N}x{K}", u=2.0 ** -10)
    print(f"{len(FAILS)} failed" + (f": {FAILS}" if FAILS else ""))
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
