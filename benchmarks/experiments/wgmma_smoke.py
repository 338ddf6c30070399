"""First-contact check of the wgmma GEMM on a Hopper GPU, meant to say *what* is wrong when
something is: run it before the test suite.

Steps (each prints one line, or a diagnosis and stops):
1. the device is sm_90 and the wgmma module compiles / loads (NVRTC log on failure);
2. one 256x256x64 bf16 product (A row-major, B row-major): max error against float64; a launch
   error, a hang (the kernel watched for 20 s: a pipeline deadlock means an mbarrier phase or
   transaction-count error) or wrong tiles (which 128x256 output tile differs first, and which
   rows / columns / k blocks look wrong) are reported;
3. the same for all four operand layouts (K- or M/N-major A and B: the transpose bits and the
   M/N-major descriptors), fp16, a ragged 300x520x200, the fused epilogue, a batch;
   Steps 2-3 run for every kernel configuration of gemm.WGMMA_CONFIGS (PLAN['wgmma']: the
   epilogues);
4. timings (CUDA events, median of `REPS` back-to-back calls per event pair, outputs NOT
   poisoned: run 21 timed one call per event pair with the NaN memset of the output included,
   so host time and a memset of up to 128 MiB sat in every gpuops row but not in cuBLAS's):
   a. 8192^3 and the two LLM shapes, a @ b and linear: cuBLAS, mma, every wgmma configuration;
   b. the per-tile cost model: 4096x6144xK for K = 512..4096 (6 rounds of 128x256 tiles on 132
      SMs): a least-squares line per configuration gives the cost per 64-wide k-tile (slope)
      and the fixed cost per round (epilogue, pipeline fill, launch: intercept / 6);
   c. fused epilogues at 4096x6144x2048 (linear: bias, bias+gelu, residual) over the bare GEMM,
      per epilogue configuration.

    python benchmarks/experiments/wgmma_smoke.py [--no-bench] [--json out.json] [--configs a,b]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

# The checks below read NaN as "never written": that needs gpuops to poison its outputs (run 15
# ran without it, and "all zeros" there meant untouched fresh memory, not a zero product).
os.environ.setdefault("GPUOPS_DEBUG_POISON", "1")
sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import torch  # noqa: E402

import gpuops as go  # noqa: E402
from gpuops.ops import gemm as G  # noqa: E402

TILE = (G.WGMMA_BM, G.WGMMA_BN)
RESULTS: dict = {"checks": [], "timings": []}


def fail(msg, code=1):
    print(f"FAIL: {msg}", flush=True)
    RESULTS["failure"] = msg
    _dump()
    os._exit(code)


def _dump():
    path = RESULTS.get("json_path")
    if path:
        with open(path, "w") as f:
            json.dump({k: v for k, v in RESULTS.items() if k != "json_path"}, f, indent=1)


def wait_or_diagnose(what, timeout_s=20.0):
    """Synchronize, but report a hang instead of hanging, and launch errors with their text."""
    ev = torch.cuda.Event()
    ev.record()
    start = time.time()
    try:
        while not ev.query():
            if time.time() - start > timeout_s:
                fail(f"{what}: the kernel has not finished after {timeout_s:.0f} s: a pipeline "
                     "deadlock (mbarrier parity / expect_tx byte count / an arrive count that "
                     "does not match the barrier's init count, or a TMA load that never "
                     "completes)", code=3)
            time.sleep(0.01)
        torch.cuda.synchronize()
    except RuntimeError as exc:
        fail(f"{what}: CUDA error at synchronize: {exc} (an illegal instruction points at "
             "sm_90a features on a non-'a' target; a misaligned address at the 1024-byte smem "
             "alignment or a tensor map; an illegal address at coordinates or the epilogue)",
             code=4)


def diagnose(out, ref, what):
    """Max error; on mismatch, where: tiles, rows, columns."""
    err = (out.double() - ref).abs()
    scale = ref.abs().max().item() or 1.0
    tol = 2e-2 * scale
    nan = torch.isnan(out.double())
    bad = (err > tol) | nan
    line = (f"{what}: max |err| {err.nan_to_num(float('inf')).max().item():.3g} "
            f"(max |ref| {scale:.3g})")
    if not bad.any():
        print(f"ok   {line}", flush=True)
        RESULTS["checks"].append({"what": what, "ok": True, "max_err": err.max().item()})
        return True
    M, N = bad.shape[-2:]
    b2 = bad.reshape(-1, M, N).any(dim=0)
    first = torch.nonzero(b2)[0].tolist()
    rows = torch.nonzero(b2.any(dim=1)).flatten()
    cols = torch.nonzero(b2.any(dim=0)).flatten()
    tm, tn = first[0] // TILE[0], first[1] // TILE[1]
    print(f"BAD  {line}; {int(bad.sum())} of {bad.numel()} elements wrong, {int(nan.sum())} NaN "
          "(NaN = never written: outputs are poisoned)", flush=True)
    print(f"     first bad element (row {first[0]}, col {first[1]}) in output tile ({tm}, {tn}); "
          f"bad rows {rows.numel()} of {M} (first {rows[:8].tolist()}), bad cols {cols.numel()} "
          f"of {N} (first {cols[:8].tolist()})", flush=True)
    halves = [int(b2[h * 64:(h + 1) * 64].sum()) for h in range(min(4, -(-M // 64)))]
    print(f"     bad elements per 64-row block (consumer warpgroup rows): {halves}", flush=True)
    RESULTS["checks"].append({"what": what, "ok": False, "max_err": err.max().item(),
                              "first_bad": first, "bad": int(bad.sum())})
    return False


def guess_pattern(a, b, out):
    """Compare against what common descriptor / pipeline mistakes would produce."""
    A, B, o = a.double(), b.double(), out.double()
    if torch.isnan(o).all():
        print("     the output is untouched (all NaN): the kernel wrote nothing; run "
              "benchmarks/experiments/wgmma_bisect.py (stage params)", flush=True)
        return
    K = A.shape[1]
    cands = {"all zeros (the MMAs read zeros, or nothing was accumulated)":
             torch.zeros_like(o)}
    first16 = torch.zeros_like(A)
    for k0 in range(0, K, 64):
        first16[:, k0:k0 + 16] = A[:, k0:k0 + 16]
    cands["only the first k16 step of each 64-wide k-tile (k-step descriptor offsets)"] = \
        first16 @ B
    cands["a @ b of the last k-tile only (accumulators reset, or stages overwritten)"] = \
        A[:, (K - 1) // 64 * 64:] @ B[(K - 1) // 64 * 64:]
    for name, ref in cands.items():
        if (o - ref).abs().max().item() <= 2e-2 * (ref.abs().max().item() or 1.0):
            print(f"     the output matches: {name}", flush=True)


def run(a, b, what, **kw):
    what = f"[{G.PLAN['wgmma']}] {what}"
    try:
        out = go.matmul(a, b, variant="wgmma", **kw)
    except Exception as exc:  # compile, load or argument errors
        log = getattr(exc, "log", None)
        fail(f"{what}: {type(exc).__name__}: {exc}" + (f"\n{log}" if log else ""), code=2)
    wait_or_diagnose(what)
    return out


def correctness(configs):
    """The configurations whose checks all pass (a wrong one is reported and left out of the
    timings; a hang or a CUDA error stops the script: fail())."""
    good = []
    for cfg in configs:
        G.PLAN["wgmma"] = cfg
        print(f"--- configuration {cfg}: epilogue {G.WGMMA_CONFIGS[cfg]}", flush=True)
        if correctness_one(cfg):
            good.append(cfg)
        else:
            print(f"correctness FAILED for {cfg}: not timed", flush=True)
    G.PLAN["wgmma"] = "base"
    return good


def correctness_one(cfg):
    cc = torch.cuda.get_device_capability()
    print(f"device: {torch.cuda.get_device_name()} sm_{cc[0]}{cc[1]}", flush=True)
    if cc != (9, 0):
        fail("wgmma needs sm_90 (H100/H200)", code=5)
    t0 = time.time()
    from gpuops.runtime import loader, device  # noqa: PLC0415
    from gpuops import dtypes as dt  # noqa: PLC0415
    try:
        # fp16 only for 'base' here (same kernel code; the GPU tests cover fp16 per config):
        # each module costs seconds of NVRTC at first use
        for d in (dt.bfloat16, dt.float16) if cfg == "base" else (dt.bfloat16,):
            lm = loader.load(G.WGMMA_MODULES[cfg][d], 0)
            k = lm.kernel(G._wgmma_expr(d, False, True, cfg))
            print(f"ok   module {G.WGMMA_MODULES[cfg][d].name} ({lm.origin}, {lm.target.label}, "
                  f"{time.time() - t0:.1f} s): {k.raw.num_regs} registers, "
                  f"max dynamic smem {device.device_info(0).max_smem_per_block_optin} B "
                  f"(needs {G._wgmma_smem(cfg)})", flush=True)
    except Exception as exc:
        fail(f"loading the module: {type(exc).__name__}: {exc}\n{getattr(exc, 'log', '')}", 2)

    torch.manual_seed(0)
    ok = True
    bf = torch.bfloat16
    a = torch.randn(256, 64, device="cuda", dtype=bf)
    b = torch.randn(64, 256, device="cuda", dtype=bf)
    for name, args in (("a", (256, 64, a.stride(0), a.stride(1), (1, 1, 1), (0, 0, 0),
                              a.data_ptr(), 2, G.WGMMA_BM)),
                       ("b", (256, 64, b.stride(1), b.stride(0), (1, 1, 1), (0, 0, 0),
                              b.data_ptr(), 2, G.WGMMA_BN))):
        plan = G._wgmma_operand(*args)
        print(f"     tensor map of {name}: M/N-major={plan[0]} dims={plan[1]} byte strides="
              f"{plan[2]} box={plan[3] if len(plan) > 3 else ''}", flush=True)
    print(f"     launch: grid min(tiles, SMs), {G.WGMMA_THREADS} threads, {G.WGMMA_SMEM} B "
          "dynamic shared memory", flush=True)
    out = run(a, b, "256x256x64 bf16 a @ b")
    if not diagnose(out, a.double() @ b.double(), "256x256x64 bf16 a @ b"):
        guess_pattern(a, b, out)
        ok = False
    M, N, K = 256, 256, 128
    for name, (ta, tb) in {"A K-major, B K-major (x @ W.T)": (False, True),
                           "A M-major, B N-major (a.T @ b)": (True, False),
                           "A M-major, B K-major (a.T @ W.T)": (True, True)}.items():
        a = torch.randn(K, M, device="cuda", dtype=bf).T if ta else \
            torch.randn(M, K, device="cuda", dtype=bf)
        b = torch.randn(N, K, device="cuda", dtype=bf).T if tb else \
            torch.randn(K, N, device="cuda", dtype=bf)
        out = run(a, b, name)
        ok &= diagnose(out, a.double() @ b.double(), f"{M}x{N}x{K} {name}")
    if cfg == "base":
        a = torch.randn(256, 128, device="cuda", dtype=torch.float16)
        b = torch.randn(128, 256, device="cuda", dtype=torch.float16)
        ok &= diagnose(run(a, b, "fp16"), a.double() @ b.double(), "256x256x128 fp16")
    a = torch.randn(300, 200, device="cuda", dtype=bf)
    b = torch.randn(200, 520, device="cuda", dtype=bf)
    ok &= diagnose(run(a, b, "ragged"), a.double() @ b.double(), "300x520x200 ragged bf16")
    bias = torch.randn(520, device="cuda", dtype=bf)
    res = torch.randn(300, 520, device="cuda", dtype=bf)
    out = run(a, b, "epilogue", bias=bias, activation="gelu", residual=res, alpha=0.5)
    ref = torch.nn.functional.gelu(0.5 * (a.double() @ b.double()) + bias.double()) + res.double()
    ok &= diagnose(out, ref, "300x520x200 bias+gelu+residual, alpha 0.5")
    a = torch.randn(6, 136, 64, device="cuda", dtype=bf)
    b = torch.randn(6, 64, 264, device="cuda", dtype=bf)
    ok &= diagnose(run(a, b, "batch"), a.double() @ b.double(), "batch 6 x 136x264x64")
    a = torch.randn(2048, 1024, device="cuda", dtype=bf)
    b = torch.randn(1024, 4096, device="cuda", dtype=bf)
    ok &= diagnose(run(a, b, "persistent"), a.double() @ b.double(),
                   "2048x4096x1024 (256 tiles on 132 SMs)")
    # linear: K-major B, 5 tile rows, bias + gelu on whole tiles (direct)
    x = torch.randn(640, 512, device="cuda", dtype=bf)
    w = torch.randn(768, 512, device="cuda", dtype=bf)
    bias = torch.randn(768, device="cuda", dtype=bf)
    what = f"[{cfg}] linear 640x768x512 bias+gelu"
    try:
        out = go.linear(x, w, bias, "gelu", variant="wgmma")
    except Exception as exc:
        fail(f"{what}: {type(exc).__name__}: {exc}", code=2)
    wait_or_diagnose(what)
    ref = torch.nn.functional.gelu(x.double() @ w.double().T + bias.double())
    ok &= diagnose(out, ref, what)
    return ok


REPS = 3      # back-to-back calls per event pair: the host time of one call overlaps the GPU


def time_ms(fn, iters=15, reps=REPS):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / reps)
    return statistics.median(times)


def with_config(cfg, fn):
    def call():
        G.PLAN["wgmma"] = cfg
        return fn()
    return call


def _report(shape, ms, flops):
    M, N, K = shape
    for name, t in ms.items():
        peer = ms.get("cublas F.linear" if "linear" in name else "cublas a @ b")
        pct = f"{100 * peer / t:5.1f}% of cuBLAS" if peer else ""
        print(f"{M}x{N}x{K} {name:26s} {t:8.4f} ms {flops / t / 1e9:7.1f} TFLOP/s {pct}",
              flush=True)
        RESULTS["timings"].append({"shape": [M, N, K], "name": name, "ms": t,
                                   "tflops": flops / t / 1e9})


def _time_rows(rows):
    ms = {}
    for name, fn in rows.items():
        try:
            ms[name] = time_ms(fn)
        except Exception as exc:
            print(f"{name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    return ms


def bench(configs):
    bf = torch.bfloat16
    # (a) the three shapes: cuBLAS, mma, every configuration
    for M, N, K in ((8192, 8192, 8192), (4096, 6144, 2048), (4096, 2048, 6144)):
        a = torch.randn(M, K, device="cuda", dtype=bf)
        b = torch.randn(K, N, device="cuda", dtype=bf)
        w = torch.randn(N, K, device="cuda", dtype=bf)
        rows = {"cublas a @ b": lambda: torch.matmul(a, b),
                "mma a @ b": lambda: go.matmul(a, b, variant="mma"),
                "cublas F.linear": lambda: torch.nn.functional.linear(a, w)}
        for cfg in configs:
            rows[f"wgmma[{cfg}] a @ b"] = with_config(cfg, lambda: go.matmul(a, b, variant="wgmma"))
            rows[f"wgmma[{cfg}] linear"] = with_config(
                cfg, lambda: go.linear(a, w, variant="wgmma"))
        _report((M, N, K), _time_rows(rows), 2.0 * M * N * K)
        del a, b, w
    # (b) per-tile cost model: 6 rounds of tiles at 4096x6144, K varies
    M, N = 4096, 6144
    rounds = -(-(-(-M // 128) * -(-N // 256)) // 132)
    fits = {}
    for cfg in configs + ["cublas"]:
        pts = []
        for K in (512, 1024, 2048, 4096):
            a = torch.randn(M, K, device="cuda", dtype=bf)
            w = torch.randn(N, K, device="cuda", dtype=bf)
            fn = (lambda: torch.nn.functional.linear(a, w)) if cfg == "cublas" else \
                with_config(cfg, lambda: go.linear(a, w, variant="wgmma"))
            pts.append((K / 64, time_ms(fn) * 1e3))
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        icpt = my - slope * mx
        fits[cfg] = (slope / rounds, icpt / rounds)
        print(f"model {cfg:12s} linear {M}x{N}xK: per k-tile {slope / rounds:6.3f} us "
              f"(MMA floor at 989 TFLOP/s: {2 * 128 * 256 * 64 / (989e12 / 132) * 1e6:.3f}), "
              f"fixed per round {icpt / rounds:6.2f} us; points (k-tiles, us) "
              f"{[(int(x), round(y, 1)) for x, y in pts]}", flush=True)
        RESULTS.setdefault("model", {})[cfg] = {"us_per_ktile": slope / rounds,
                                                "us_fixed_per_round": icpt / rounds,
                                                "points": pts}
    # (c) fused epilogues over the bare GEMM (linear 4096x6144x2048)
    M, N, K = 4096, 6144, 2048
    x = torch.randn(M, K, device="cuda", dtype=bf)
    w = torch.randn(N, K, device="cuda", dtype=bf)
    bias = torch.randn(N, device="cuda", dtype=bf)
    res = torch.randn(M, N, device="cuda", dtype=bf)
    for cfg in configs:
        rows = {"bare": lambda: go.linear(x, w, variant="wgmma"),
                "bias": lambda: go.linear(x, w, bias, variant="wgmma"),
                "bias+gelu": lambda: go.linear(x, w, bias, "gelu", variant="wgmma"),
                "residual": lambda: go.matmul(x, w.T, residual=res, variant="wgmma")}
        ms = _time_rows({k: with_config(cfg, f) for k, f in rows.items()})
        base = ms.get("bare")
        line = ", ".join(f"{k} {v * 1e3:.1f} us ({100 * (v / base - 1):+.1f}%)"
                         for k, v in ms.items() if base)
        print(f"epilogue [{cfg}] linear {M}x{N}x{K}: {line}", flush=True)
        RESULTS.setdefault("epilogue", {})[cfg] = ms
    G.PLAN["wgmma"] = "base"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--configs", default=",".join(G.WGMMA_CONFIGS),
                    help="wgmma configurations to check and time (gemm.WGMMA_CONFIGS)")
    args = ap.parse_args()
    RESULTS["json_path"] = args.json
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in G.WGMMA_CONFIGS:
            ap.error(f"unknown configuration {c!r}; known: {sorted(G.WGMMA_CONFIGS)}")
    t0 = time.time()
    from gpuops.runtime import config  # noqa: PLC0415
    os.environ["GPUOPS_DEBUG_POISON"] = "1"       # checks: unwritten outputs read as NaN
    config.refresh()
    good = correctness(configs)
    failed = [c for c in configs if c not in good]
    RESULTS["failed_configs"] = failed
    if good and not args.no_bench:
        # timings without the NaN memset of every output (see the docstring)
        os.environ["GPUOPS_DEBUG_POISON"] = "0"
        config.refresh()
        bench(good)
    print(f"total {time.time() - t0:.1f} s; configurations that failed their checks: "
          f"{failed or 'none'}", flush=True)
    _dump()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
