"""Bisect the wgmma GEMM (cuda_src/gemm/wgmma.cu) on a Hopper GPU: one building block per stage,
each with its own probe kernel (cuda_src/gemm/wgmma_probe.cu, module gemm.wgmma_probe, compiled
through the same runtime path and arch, sm_90a, as the GEMM), so that a wrong GEMM points at the
first stage that fails:

  params  the GEMM's exact launch arguments (two tensor maps + GemmArgs, captured from a real
          go.matmul call) as a kernel with the GEMM's parameter list sees them, launched the way
          gpuops launches now (kernelParams) and the way it launched before (one flat buffer);
          plus where the cubin puts the parameters (its .nv.info records).
  tma     TMA loads through the host-encoded tensor maps (the GEMM's encoder) and the mbarrier
          path (arrive.expect_tx / complete_tx / parity wait, bounded: no hang), shared memory
          copied out plainly and compared bit for bit with the 128-byte swizzled image expected:
          A K-major (one 64 x 128 box), B N-major (four 64 x 64 boxes), a ragged A (zero fill).
  mma     wgmma.m64n256k16 on shared memory filled by ordinary stores in the layout the
          descriptors claim (no TMA), all four transpose combinations, 1 and 4 k16 steps,
          accumulators stored through the fragment mapping the epilogue assumes; against float64.
  gemm    the full kernel (go.matmul variant='wgmma', outputs poisoned with NaN) at 64x256x16,
          128x256x64, 256x256x64 with readable patterns (A = identity with B = row index / column
          index, ones, small random integers), all four operand layouts at 128x256x64.
  gemm_direct
          the same for the direct epilogue configuration (gemm.WGMMA_CONFIGS), plus 384x512x128
          (3 tile rows) and a linear (K-major B); its own process, so a hang there does not hide
          the other stages.

Each stage prints PASS / FAIL / ERROR with a short diagnosis and runs in its own process (a
sticky CUDA error or a hang in one stage cannot take the others down; --inline runs them in this
process). The whole run takes about a minute and a half (the first use compiles gemm.wgmma_probe
and one gemm.wgmma*_bf16 module per configuration, about 5-10 s each).

    python benchmarks/experiments/wgmma_bisect.py [--json out.json] [--stages params,tma,mma,gemm,...]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.setdefault("GPUOPS_DEBUG_POISON", "1")     # unwritten outputs read as NaN
sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import numpy as np  # noqa: E402

STAGES = ("params", "tma", "mma", "gemm", "gemm_direct")
STAGE_TIMEOUT_S = {"params": 40, "tma": 30, "mma": 30, "gemm": 45, "gemm_direct": 40}
HINTS = {
    "params": "the launch path: kernel parameters do not reach the kernel as packed "
              "(runtime/launch.py: kernelParams for over-aligned parameters)",
    "tma": "tensor maps (runtime/tma.py, ops/gemm.py _wgmma_operand) or the mbarrier / "
           "expect_tx path (common/wgmma.cuh)",
    "mma": "wgmma descriptors (WgOperand: LBO / SBO / k16 step / swizzle bits), transpose "
           "bits, or the accumulator fragment mapping",
    "gemm": "the pipeline of wgmma.cu (stage ring, mbarrier phases, persistent tile loop, "
            "epilogue), given that params / tma / mma pass",
    "gemm_direct": "the direct epilogue of wgmma.cu (wg_epilogue_direct), given that gemm passes",
}


# ------------------------------------------------------------------------------------- helpers

def _torch():
    import torch  # noqa: PLC0415
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    cc = torch.cuda.get_device_capability()
    if cc != (9, 0):
        raise RuntimeError(f"wgmma needs sm_90 (H100/H200); this is sm_{cc[0]}{cc[1]}")
    return torch


def _gemm():
    from gpuops.ops import gemm as G  # noqa: PLC0415
    return G


def _stream(torch):
    return torch.cuda.current_stream().cuda_stream


def _probe(expr):
    from gpuops.runtime import loader  # noqa: PLC0415
    return loader.kernel(_gemm().WGMMA_PROBE, 0, expr)


def _bits(t):
    """uint16 NumPy array of a 16-bit torch tensor's bits."""
    import torch  # noqa: PLC0415
    return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def _tma_image(tile):
    """The shared-memory image TMA writes for a box [rows][64] of 16-bit elements with
    CU_TENSOR_MAP_SWIZZLE_128B into a 1024-aligned destination: row r at r * 128 bytes, its
    16-byte chunk c at chunk position c ^ (r % 8). Returns uint16 [rows * 64]."""
    rows = tile.shape[0]
    t = np.asarray(tile).reshape(rows, 8, 8)
    img = np.zeros_like(t)
    for r in range(rows):
        img[r, np.arange(8) ^ (r % 8)] = t[r]
    return img.reshape(-1)


def _plain_image(tile):
    return np.asarray(tile).reshape(-1)


def _capture_gemm_launch(a, b):
    """The arguments the wgmma GEMM launch of go.matmul(a, b) passes, captured instead of
    launched: (name expression, args, grid, block, smem)."""
    import gpuops as go  # noqa: PLC0415
    G = _gemm()
    seen = []

    class Recorder:
        def __init__(self, expr):
            self.expr = expr

        def launch(self, grid, block, stream, *args, smem=0):
            seen.append((self.expr, args, grid, block, smem))

    real = G._kernels
    G._kernels = type("K", (), {"get": staticmethod(lambda module, expr, dev: Recorder(expr))})()
    try:
        go.matmul(a, b, variant="wgmma")
    finally:
        G._kernels = real
    if not seen:
        raise RuntimeError("go.matmul(variant='wgmma') launched nothing")
    return seen[0]


# ------------------------------------------------------------------------------------- stages

def stage_params(out):
    torch = _torch()
    G = _gemm()
    from cupy.cuda import driver  # noqa: PLC0415
    import cupy  # noqa: PLC0415
    from gpuops.runtime import loader  # noqa: PLC0415
    from gpuops.runtime.launch import cubin_params  # noqa: PLC0415

    a = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    expr, args, grid, block, smem = _capture_gemm_launch(a, b)
    spec = G.WGMMA_ARGS
    packed = spec.struct.pack(*args)
    out["gemm_launch"] = {"kernel": expr, "grid": list(grid), "block": list(block), "smem": smem}

    lm = loader.load(G.WGMMA_PROBE, 0)
    name = "gpuops::gemm::wgmma_probe_params"
    with open(lm.path, "rb") as f:
        image = f.read()
    try:
        bank, params = cubin_params(image, lm.lowered[name])
        out["cubin"] = {"bank_offset": bank, "params": params}
        print(f"     cubin: parameter block at c[0x0][{bank:#x}], (offset, size) {params}; the "
              f"PTX / ArgSpec offsets are {[o for o, _, _ in spec.layout]}", flush=True)
    except Exception as exc:  # noqa: BLE001  (a PTX image from a bundle has no such records)
        out["cubin"] = {"error": f"{type(exc).__name__}: {exc}"}
    mp = lm.raw.get_global("gpuops_wgmma_probe_param_dump")
    dump = cupy.ndarray((576,), dtype=cupy.uint8, memptr=mp)
    kernel = _probe(name)

    def run(launcher):
        dump.fill(0)
        cupy.cuda.runtime.deviceSynchronize()
        launcher()
        torch.cuda.synchronize()
        return dump.get().tobytes()

    got_new = run(lambda: kernel.launch((1, 1, 1), (32, 1, 1), _stream(torch), *args))
    flat = ctypes.create_string_buffer(packed, len(packed))
    size = ctypes.c_size_t(len(packed))
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(flat), 2, ctypes.addressof(size), 0)
    try:
        got_old = run(lambda: driver.launchKernel(kernel.ptr, 1, 1, 1, 32, 1, 1, 0,
                                                  _stream(torch), 0, ctypes.addressof(extra)))
    except Exception as exc:  # noqa: BLE001  (the driver may refuse a buffer of the PTX size)
        print(f"     flat buffer (before the fix): the driver refused it: {exc}", flush=True)
        got_old = None

    def describe(got):
        fields = struct.unpack_from("<9Q25qf4i", got, 256)
        seen = dict(M=fields[9], N=fields[10], K=fields[11], batch=fields[19])
        shift = next((s for s in range(0, 129, 8) if got[:128] == packed[s:s + 128]), None)
        align = struct.unpack_from("<II", got, 552)
        return seen, shift, align

    want = dict(M=256, N=256, K=64, batch=1)
    new_seen, _, new_align = describe(got_new)
    old_seen, old_shift, _ = describe(got_old) if got_old is not None else ("refused", None, None)
    ok_new = got_new[:552] == packed
    ok_old = got_old is not None and got_old[:552] == packed
    out["kernel_params_path"] = {"intact": ok_new, "seen": new_seen, "map_align": new_align}
    out["flat_buffer_path"] = {"intact": ok_old, "seen": old_seen, "shift": old_shift}
    print(f"     kernelParams (now): {'intact' if ok_new else 'WRONG'}; the kernel sees "
          f"{new_seen}, map addresses mod 64 = {new_align}", flush=True)
    print(f"     flat buffer (before the fix): {'intact' if ok_old else 'WRONG'}; the kernel "
          f"sees {old_seen}" + (f", maps shifted by {old_shift} bytes" if old_shift else ""),
          flush=True)
    if ok_new:
        why = "the GEMM's parameters arrive intact through kernelParams"
        if new_align != (0, 0):
            why += (f" (but the maps' generic addresses are {new_align} mod 64: TMA wants 64-byte "
                    "aligned maps; stage tma shows whether it minds)")
        if not ok_old:
            why += (f"; the old flat buffer delivered them {old_shift} bytes off ({old_seen} "
                    f"instead of {want}): with batch or N = 0 the persistent loop has no work "
                    "and the kernel returns without writing (run 15/16's NaN / stale outputs)")
        else:
            why += "; the flat buffer did too on this driver (so that was not the bug here)"
        return True, why
    return False, (f"parameters arrive WRONG through kernelParams ({new_seen} instead of {want}, "
                   f"maps mod 64 {new_align}): the GEMM cannot work; see the cubin offsets")


def stage_tma(out):
    torch = _torch()
    G = _gemm()
    from gpuops.runtime import tma  # noqa: PLC0415
    kernel = _probe("gpuops::gemm::wgmma_probe_tma")
    checks, ok_all = [], True

    def load(t, rows_box, coords, boxes, step0):
        """Encode the map of operand view t = X[r][k] as the GEMM does (A: X = A, r = m; B:
        X = B^T, r = n) and load `boxes` boxes at coords, the first coordinate stepping by
        step0 per box."""
        R, K = t.shape
        plan = G._wgmma_operand(R, K, t.stride(0), t.stride(1), (1, 1, 1), (0, 0, 0),
                                t.data_ptr(), 2, rows_box)
        if plan[0] is None:
            raise RuntimeError(plan[1])
        mn, dims, strides, box = plan
        desc = tma.encode_tiled(t.data_ptr(), tma.DTYPE_UINT16, dims, strides, box)
        box_bytes = box[0] * box[1] * 2
        dst = torch.full((boxes * box_bytes,), 0xAB, device="cuda", dtype=torch.uint8)
        status = torch.zeros(4, device="cuda", dtype=torch.int32)
        kernel.launch((1, 1, 1), (128, 1, 1), _stream(torch), desc, dst.data_ptr(),
                      status.data_ptr(), coords[0], coords[1], boxes, step0, box_bytes,
                      smem=boxes * box_bytes + 1024 + 64)
        torch.cuda.synchronize()
        return (mn, dims, strides, box), dst.cpu().numpy().view(np.uint16), status.cpu().tolist()

    def judge(what, plan, got, status, tiles):
        nonlocal ok_all
        want = np.concatenate([_tma_image(t) for t in tiles])
        plain = np.concatenate([_plain_image(t) for t in tiles])
        line = {"what": what, "map": [plan[0], plan[1], plan[2], plan[3]], "status": status}
        if status[0] != 1:
            line["diagnosis"] = ("the mbarrier phase never completed: expect_tx bytes never "
                                 "delivered (TMA refused the map or the copy faulted silently)")
        elif status[2] != 0:
            line["diagnosis"] = f"destination not 1024-aligned (mod 1024 = {status[2]})"
        elif np.array_equal(got, want):
            line["diagnosis"] = "exact: swizzled 128-byte rows as the descriptors assume"
        elif np.array_equal(got, plain):
            line["diagnosis"] = "data arrived UNSWIZZLED: the map's swizzle mode is not 128B"
        elif not got.any():
            line["diagnosis"] = "all zeros: the box was out of bounds (coordinates / dims order)"
        elif (got == 0xABAB).all():
            line["diagnosis"] = "nothing copied out (probe failed after the wait)"
        else:
            bad = np.nonzero(got != want)[0]
            line["diagnosis"] = (f"{bad.size} of {got.size} elements differ, first at element "
                                 f"{bad[0]} (row {bad[0] // 64}): got {got[bad[0]]:#06x}, want "
                                 f"{want[bad[0]]:#06x}")
        line["ok"] = status[0] == 1 and status[2] == 0 and np.array_equal(got, want)
        ok_all &= line["ok"]
        checks.append(line)
        print(f"     {'ok ' if line['ok'] else 'BAD'} {what}: {line['diagnosis']} "
              f"(map dims {plan[1]}, strides {plan[2]}, box {plan[3]})", flush=True)

    # element (r, c) holds r * 64 + c + 1 as bits: every element distinct, nothing zero
    a_bits = (np.arange(256 * 64, dtype=np.int32).reshape(256, 64) + 1).astype(np.uint16)
    a = torch.from_numpy(a_bits.view(np.int16)).cuda().view(torch.bfloat16)
    plan, got, st = load(a, G.WGMMA_BM, (0, 128), 1, 0)           # K-major A, rows 128..255
    judge("A 256x64 K-major, box (k 0, m 128)", plan, got, st, [a_bits[128:256]])
    b_bits = (np.arange(64 * 256, dtype=np.int32).reshape(64, 256) % 65000 + 1).astype(np.uint16)
    b = torch.from_numpy(b_bits.view(np.int16)).cuda().view(torch.bfloat16)
    plan, got, st = load(b.T, G.WGMMA_BN, (0, 0), 4, 64)           # N-major B: 4 boxes 64 x 64
    judge("B 64x256 N-major, 4 boxes (n 0/64/128/192, k 0)", plan, got, st,
          [b_bits[:, 64 * i:64 * i + 64] for i in range(4)])
    # ragged: M = 200, K = 40 (80-byte rows): rows >= 200 and k >= 40 arrive as zeros
    r_bits = a_bits[:200, :40].copy()
    r = torch.from_numpy(r_bits.view(np.int16)).cuda().view(torch.bfloat16)
    plan, got, st = load(r, G.WGMMA_BM, (0, 128), 1, 0)
    tile = np.zeros((128, 64), np.uint16)
    tile[:72, :40] = r_bits[128:200]
    judge("ragged A 200x40 K-major, box (k 0, m 128): zero fill", plan, got, st, [tile])
    out["checks"] = checks
    if ok_all:
        return True, "TMA + mbarrier deliver the swizzled boxes the descriptors assume"
    return False, "; ".join(c["what"] + ": " + c["diagnosis"] for c in checks if not c["ok"])


def stage_mma(out):
    torch = _torch()
    G = _gemm()
    from gpuops import dtypes as dt  # noqa: PLC0415
    rng = np.random.default_rng(0)
    checks, ok_all = [], True
    combos = [("bfloat16", am, bm) for am in (False, True) for bm in (False, True)]
    combos.append(("float16", False, True))
    for dname, amn, bmn in combos:
        tdt = getattr(torch, dname)
        A = rng.integers(-2, 3, size=(64, 64)).astype(np.float64)     # exact in 16 bits
        B = rng.integers(-2, 3, size=(64, 256)).astype(np.float64)

        def bits(x):
            return _bits(torch.from_numpy(x).to(tdt))

        a_img = _tma_image(bits(A.T.copy()) if amn else bits(A))            # [k][m] or [m][k]
        b_img = (np.concatenate([_tma_image(bits(B[:, 64 * i:64 * i + 64].copy()))
                                 for i in range(4)]) if bmn else _tma_image(bits(B.T.copy())))
        a_dev = torch.from_numpy(a_img.view(np.uint8)).cuda()
        b_dev = torch.from_numpy(b_img.view(np.uint8)).cuda()
        expr = G._kname("wgmma_probe_mma", getattr(dt, dname).ctype, G._b(amn), G._b(bmn))
        kernel = _probe(expr)
        for ksteps in (1, 4):
            res = torch.full((64, 256), float("nan"), device="cuda", dtype=torch.float32)
            kernel.launch((1, 1, 1), (128, 1, 1), _stream(torch), a_dev.data_ptr(),
                          b_dev.data_ptr(), res.data_ptr(), a_img.nbytes, b_img.nbytes, ksteps,
                          smem=a_img.nbytes + b_img.nbytes + 1024)
            torch.cuda.synchronize()
            got = res.cpu().double().numpy()
            k = 16 * ksteps
            want = A[:, :k] @ B[:k]
            what = (f"{dname} A {'M' if amn else 'K'}-major, B {'N' if bmn else 'K'}-major, "
                    f"{ksteps} k16 step{'s' if ksteps > 1 else ''}")
            ok = np.array_equal(got, want)
            if ok:
                diag = "exact"
            elif np.isnan(got).all():
                diag = "nothing stored (probe did not run to the end)"
            elif not got.any():
                diag = "all zeros: wgmma read zeros (descriptor start address / proxy fence)"
            elif ksteps == 4 and np.array_equal(got, A[:, :16] @ B[:16]):
                diag = "only the first k16 step counted (k-step descriptor offset)"
            elif np.array_equal(got, A.T[:, :k] @ B[:k]):
                diag = "A read transposed (A's transpose bit or its layout)"
            elif np.array_equal(np.sort(got, axis=0), np.sort(want, axis=0)):
                diag = "right values in the wrong rows (fragment row mapping / A's SBO)"
            elif np.array_equal(np.sort(got, axis=1), np.sort(want, axis=1)):
                diag = "right values in the wrong columns (fragment columns / B's LBO or SBO)"
            else:
                bad = np.argwhere(got != want)
                m, n = bad[0]
                diag = (f"{len(bad)} of {got.size} wrong, first D[{m}][{n}] = {got[m, n]} "
                        f"(want {want[m, n]})")
            ok_all &= ok
            checks.append({"what": what, "ok": bool(ok), "diagnosis": diag})
            print(f"     {'ok ' if ok else 'BAD'} {what}: {diag}", flush=True)
    out["checks"] = checks
    if ok_all:
        return True, "wgmma with the GEMM's descriptors reads the TMA layout right (all layouts)"
    return False, "; ".join(c["what"] + ": " + c["diagnosis"] for c in checks if not c["ok"])


def stage_gemm(out, config="base"):
    torch = _torch()
    from gpuops.ops import gemm as G  # noqa: PLC0415
    G.PLAN["wgmma"] = config
    import gpuops as go  # noqa: PLC0415
    rng = np.random.default_rng(1)
    checks, ok_all = [], True
    bf = torch.bfloat16

    def patterns(M, N, K):
        eye = np.eye(M, K)
        yield "A=I, B[k][n]=k (C[m][n] = m for m < K)", eye, np.repeat(
            np.arange(K, dtype=np.float64)[:, None], N, axis=1)
        yield "A=I, B[k][n]=n (C[m][n] = n for m < K)", eye, np.repeat(
            np.arange(N, dtype=np.float64)[None, :] % 256, K, axis=0)
        yield "A=1, B=1 (C = K)", np.ones((M, K)), np.ones((K, N))
        yield "small random integers", rng.integers(-2, 3, (M, K)).astype(np.float64), \
            rng.integers(-2, 3, (K, N)).astype(np.float64)

    def layouts(A, B, all_four):
        a = torch.from_numpy(A).to(bf).cuda()
        b = torch.from_numpy(B).to(bf).cuda()
        yield "a @ b (A K-major, B N-major)", a, b
        if all_four:
            yield "x @ W.T (A K-major, B K-major)", a, b.T.contiguous().T
            yield "a.T @ b (A M-major, B N-major)", a.T.contiguous().T, b
            yield "a.T @ W.T (A M-major, B K-major)", a.T.contiguous().T, b.T.contiguous().T

    shapes = ((64, 256, 16), (128, 256, 64), (256, 256, 64))
    if config != "base":
        shapes += ((384, 512, 128),)
    for M, N, K in shapes:
        for pname, A, B in patterns(M, N, K):
            want = A @ B              # integers below 256 in magnitude: exact in bf16
            for lname, a, b in layouts(A, B, (M, N, K) in ((128, 256, 64), (384, 512, 128))
                                       and "random" in pname):
                what = f"{M}x{N}x{K} {pname}, {lname}"
                try:
                    if lname.startswith("x @ W.T") and config != "base":
                        got = go.linear(a, b.T, variant="wgmma")     # the same K-major B
                    else:
                        got = go.matmul(a, b, variant="wgmma")
                    torch.cuda.synchronize()
                except Exception as exc:      # launch / argument errors: report, go on
                    checks.append({"what": what, "ok": False,
                                   "diagnosis": f"{type(exc).__name__}: {exc}"})
                    print(f"     ERR {what}: {type(exc).__name__}: {exc}", flush=True)
                    ok_all = False
                    if "CUDA" in type(exc).__name__ or "cuda" in str(exc).lower():
                        raise             # a sticky device error: the rest cannot run
                    continue
                g = got.double().cpu().numpy()
                nan = np.isnan(g)
                ok = not nan.any() and np.array_equal(g, want)
                if ok:
                    diag = "exact"
                elif nan.all():
                    diag = ("NOTHING written (outputs poisoned with NaN): the kernel had no work "
                            "(M / N / batch read wrong: stage params) or returned early")
                elif nan.any():
                    rows = np.nonzero(nan.any(axis=1))[0]
                    diag = (f"{int(nan.sum())} elements never written, rows {rows[:4].tolist()}"
                            f"..{rows[-1]} (a consumer warpgroup or tile skipped)")
                elif not g.any():
                    diag = "all zeros (the MMAs saw zeros: TMA data not in the ring)"
                else:
                    bad = np.argwhere(g != want)
                    m, n = bad[0]
                    rows = np.unique(bad[:, 0])
                    diag = (f"{len(bad)} of {g.size} wrong, first C[{m}][{n}] = {g[m, n]:g} "
                            f"(want {want[m, n]:g}); wrong rows {len(rows)} (first "
                            f"{rows[:6].tolist()}), per 64-row block "
                            f"{[int(((bad[:, 0] // 64) == i).sum()) for i in range(-(-M // 64))]}")
                ok_all &= ok
                checks.append({"what": what, "ok": bool(ok), "diagnosis": diag})
                print(f"     {'ok ' if ok else 'BAD'} {what}: {diag}", flush=True)
    out["checks"] = checks
    if ok_all:
        return True, "the full kernel is exact on every pattern, shape and layout"
    return False, "; ".join(c["what"] + ": " + c["diagnosis"] for c in checks if not c["ok"])[:600]


RUNNERS = {"params": stage_params, "tma": stage_tma, "mma": stage_mma, "gemm": stage_gemm,
           "gemm_direct": lambda out: stage_gemm(out, "direct")}


def run_stage(name):
    """Run one stage here; its result dict (status PASS / FAIL / ERROR, diagnosis, details)."""
    out = {}
    start = time.time()
    try:
        ok, why = RUNNERS[name](out)
        result = {"status": "PASS" if ok else "FAIL", "diagnosis": why}
    except Exception as exc:   # any failure of the stage itself is reported, not raised
        result = {"status": "ERROR", "diagnosis": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-3000:]}
        log = getattr(exc, "log", None)
        if log:
            result["log"] = str(log)[-3000:]
    result["details"] = out
    result["seconds"] = round(time.time() - start, 2)
    return result


def _print_stage(name, r):
    print(f"{r['status']:5s} [{name}] {r['diagnosis']} ({r.get('seconds', 0):.1f} s)", flush=True)
    if r["status"] == "ERROR" and "traceback" in r:
        print("      " + r["traceback"].strip().splitlines()[-1], flush=True)
    if r["status"] != "PASS":
        print(f"      -> look at: {HINTS[name]}", flush=True)


def run_in_subprocess(name, budget_s):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--stage", name,
                               "--stage-json", path], timeout=budget_s, capture_output=True,
                              text=True)
        sys.stdout.write(proc.stdout)
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"status": "ERROR", "diagnosis": f"the stage process died (rc "
                    f"{proc.returncode}): {proc.stderr.strip()[-800:]}"}
    except subprocess.TimeoutExpired as exc:
        sys.stdout.write(exc.stdout.decode() if isinstance(exc.stdout, bytes) else
                         (exc.stdout or ""))
        return {"status": "TIMEOUT", "diagnosis": f"no result after {budget_s:.0f} s: a hang "
                "(mbarrier parity / expect_tx count / arrive count) or a slow compile"}
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--inline", action="store_true", help="run the stages in this process")
    ap.add_argument("--budget", type=float, default=110.0, help="seconds for all stages")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--stage-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage:                      # child process: one stage
        r = run_stage(args.stage)
        with open(args.stage_json, "w") as f:
            json.dump(r, f, default=str)
        return
    start = time.time()
    report = {"stages": {}}
    try:
        import torch  # noqa: PLC0415
        report["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        print(f"device: {report['device']}", flush=True)
    except Exception as exc:  # noqa: BLE001
        report["device"] = f"unknown ({exc})"
    names = [s for s in args.stages.split(",") if s]
    for i, name in enumerate(names):
        if name not in RUNNERS:
            print(f"unknown stage {name!r} (stages: {', '.join(STAGES)})")
            continue
        print(f"--- stage {name}", flush=True)
        if args.inline:
            r = run_stage(name)
        else:
            left = args.budget - (time.time() - start)
            r = run_in_subprocess(name, max(5.0, min(STAGE_TIMEOUT_S[name], left)))
        report["stages"][name] = r
        _print_stage(name, r)
    failed = [n for n, r in report["stages"].items() if r["status"] != "PASS"]
    report["first_failing_stage"] = failed[0] if failed else None
    report["seconds"] = round(time.time() - start, 1)
    print(f"=== {'all stages PASS' if not failed else 'first failing stage: ' + failed[0]} "
          f"({report['seconds']} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
