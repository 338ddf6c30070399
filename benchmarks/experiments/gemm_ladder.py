"""The GEMM ladder on one GPU, everything measured in the same run (issue 4):

1. every variant (naive .. mma) at 4096^3 fp32, against cuBLAS fp32 through torch with TF32 off
   (and the tf32 mma against cuBLAS with TF32 on);
2. bf16 at 8192^3, M=4096 N=6144 K=2048 and M=4096 N=2048 K=6144: warp_tiled (SIMT), mma,
   wgmma (on sm_90) and the default, against cuBLAS bf16;
3. decode shapes (M = 1, 2, 4, 8, 16 x [6144, 4096] bf16 and fp32 weights) inside a CUDA graph,
   the weight rotated over enough copies to exceed L2 (a 25-50 MB weight otherwise stays in the
   50 MB L2): % of the device-to-device copy bandwidth for the bytes that must move (weight + x +
   out), next to torch F.linear in the same graph setting;
4. the fused epilogue's cost over the bare GEMM (bias, bias+gelu, bias+gelu+residual, alpha);
5. swiglu_linear against two cuBLAS GEMMs + silu * mul (eager, and torch.compile of the same);
6. int8_matmul (dp4a and int8 tensor cores) against torch._int_mm + scaling.

    python benchmarks/experiments/gemm_ladder.py [--json out.json] [--quick]

--quick skips the slowest rungs (naive, smem_tiled on the big bf16 shapes). Rows marked legacy
time run 1's paths (gpuops.ops.gemm.PLAN) next to the new ones; rows marked [large], [small],
[large_k32] force one mma tile configuration (PLAN['mma_tiles']). --sections decode (~60 s) and
--sections epilogue (~35 s) each stay under 90 s on an H100.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402,N812

import gpuops as go  # noqa: E402
from gpuops.ops import gemm as G  # noqa: E402
from gpuops.bench import capture_graph, events_ms  # noqa: E402

ROWS: list = []


def time_ms(fn, budget_s=1.5, min_iters=3, max_iters=200):
    return events_ms(fn, budget_s, min_iters, max_iters)


def copy_gbps():
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e9


def record(section, name, shape, dtype, ms, flops=None, peer_ms=None, extra=None):
    row = {"section": section, "name": name, "shape": shape, "dtype": dtype, "ms": ms}
    if flops:
        row["tflops"] = flops / (ms * 1e-3) / 1e12
    if peer_ms:
        row["peer_ms"] = peer_ms
        row["pct_of_peer"] = 100.0 * peer_ms / ms
    row.update(extra or {})
    ROWS.append(row)
    tf = f"{row['tflops']:8.1f} TFLOP/s" if "tflops" in row else " " * 16
    pp = f"{row['pct_of_peer']:6.1f}% of peer" if "pct_of_peer" in row else ""
    ex = "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                   for k, v in (extra or {}).items())
    print(f"  {name:<30}{'x'.join(map(str, shape)):<18}{dtype:<10}{ms:10.3f} ms{tf}  {pp}  {ex}",
          flush=True)
    return row


def ladder(quick):
    print("\n== ladder: 4096^3 fp32 (cuBLAS fp32, TF32 off) ==")
    M = N = K = 4096
    a = torch.randn(M, K, device="cuda")
    b = torch.randn(K, N, device="cuda")
    flops = 2.0 * M * N * K
    torch.backends.cuda.matmul.allow_tf32 = False
    peer = time_ms(lambda: torch.matmul(a, b))
    record("ladder_fp32", "cublas fp32", (M, N, K), "float32", peer, flops)
    for v in ("naive", "smem_tiled", "register_tiled_vec4", "warp_tiled"):
        ms = time_ms(lambda v=v: go.matmul(a, b, variant=v), budget_s=3.0 if v == "naive" else 1.5)
        record("ladder_fp32", v, (M, N, K), "float32", ms, flops, peer)
    torch.backends.cuda.matmul.allow_tf32 = True
    peer_tf32 = time_ms(lambda: torch.matmul(a, b))
    torch.backends.cuda.matmul.allow_tf32 = False
    record("ladder_fp32", "cublas tf32", (M, N, K), "float32", peer_tf32, flops)
    ms = time_ms(lambda: go.matmul(a, b, variant="mma", allow_tf32=True))
    record("ladder_fp32", "mma (tf32)", (M, N, K), "float32", ms, flops, peer_tf32)

    for (M, N, K) in ((8192, 8192, 8192), (4096, 6144, 2048), (4096, 2048, 6144)):
        print(f"\n== bf16 {M}x{N}x{K} (cuBLAS bf16) ==")
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        wt = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * M * N * K
        peer = time_ms(lambda: torch.matmul(a, b))
        record("bf16", "cublas bf16 (a @ b)", (M, N, K), "bfloat16", peer, flops)
        peer_lin = time_ms(lambda: F.linear(a, wt))
        record("bf16", "cublas bf16 (F.linear)", (M, N, K), "bfloat16", peer_lin, flops)
        variants = ["warp_tiled", "mma", None]
        if not quick and (M, N, K) != (8192, 8192, 8192):
            variants = ["register_tiled_vec4"] + variants
        hopper = G.effective_arch(0) == G.WGMMA_ARCH
        if hopper:
            variants.append("wgmma")
        for v in variants:
            ms = time_ms(lambda v=v: go.matmul(a, b, variant=v))
            record("bf16", f"{v or 'default'} (a @ b)", (M, N, K), "bfloat16", ms, flops, peer)
        ms = time_ms(lambda: go.linear(a, wt))
        record("bf16", "default (linear)", (M, N, K), "bfloat16", ms, flops, peer_lin)
        for tiles in sorted(G.MMA_TILES):    # every mma tile configuration, forced (A/B)
            with decode_plan(tiles, "mma_tiles"):
                ms = time_ms(lambda: go.matmul(a, b, variant="mma"))
                record("bf16", f"mma [{tiles}] (a @ b)", (M, N, K), "bfloat16", ms, flops, peer,
                       extra={"tiles": tiles})
                ms = time_ms(lambda: go.linear(a, wt, variant="mma"))
                record("bf16", f"mma [{tiles}] (linear)", (M, N, K), "bfloat16", ms, flops,
                       peer_lin, extra={"tiles": tiles})
        if hopper:
            ms = time_ms(lambda: go.linear(a, wt, variant="wgmma"))
            record("bf16", "wgmma (linear)", (M, N, K), "bfloat16", ms, flops, peer_lin)


def decode(gbps):
    """Decode GEMMs in a CUDA graph; the weight rotates over copies totalling > 4x L2."""
    print(f"\n== decode in CUDA graphs (copy bandwidth {gbps:.0f} GB/s) ==")
    N, K = 6144, 4096
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for dtype in (torch.bfloat16, torch.float32):
        wbytes = N * K * dtype.itemsize
        copies = max(2, -(-4 * l2 // wbytes))
        ws = [torch.randn(N, K, device="cuda", dtype=dtype) for _ in range(copies)]
        for M in (1, 2, 4, 8, 16):
            xs = [torch.randn(M, K, device="cuda", dtype=dtype) for _ in range(copies)]
            moved = wbytes + M * K * dtype.itemsize + M * N * dtype.itemsize
            res = {}
            res["torch"] = graph_ms(lambda: [F.linear(x, w) for x, w in zip(xs, ws)]) / copies
            pct_t = 100.0 * moved / (res["torch"] * 1e-3) / 1e9 / gbps
            for plan in ("balanced", "legacy"):      # the plan is read when the graph is captured
                with decode_plan(plan):
                    ms = graph_ms(lambda: [go.linear(x, w) for x, w in zip(xs, ws)]) / copies
                pct = 100.0 * moved / (ms * 1e-3) / 1e9 / gbps
                name = "linear (graph)" if plan == "balanced" else "linear legacy (graph)"
                record("decode", name, (M, N, K), str(dtype)[6:], ms, peer_ms=res["torch"],
                       extra={"pct_copy": pct, "torch_pct_copy": pct_t, "plan": plan})
        del ws


@contextlib.contextmanager
def decode_plan(plan, key="decode"):
    """gpuops.ops.gemm.PLAN[key] set for the block (run 1's paths stay selectable)."""
    old = G.PLAN[key]
    G.PLAN[key] = plan
    try:
        yield
    finally:
        G.PLAN[key] = old


def graph_ms(fn):
    return time_ms(capture_graph(fn, calls=1, warmup=2).replay)


def epilogues():
    print("\n== fused epilogue vs bare GEMM ==")
    for dtype, (M, N, K) in ((torch.bfloat16, (4096, 6144, 2048)), (torch.float32, (4096, 4096, 4096))):
        a = torch.randn(M, K, device="cuda", dtype=dtype)
        b = torch.randn(K, N, device="cuda", dtype=dtype)
        bias = torch.randn(N, device="cuda", dtype=dtype)
        res = torch.randn(M, N, device="cuda", dtype=dtype)
        # bf16: the mma kernel with the default tiles and the 2-blocks-per-SM 128x128 ones (whose
        # epilogue overlaps the other block's main loop); fp32 takes warp_tiled
        for tiles in (("auto", "small") if dtype is torch.bfloat16 else ("auto",)):
            tag = "" if tiles == "auto" else f" [{tiles}]"
            with decode_plan(tiles, "mma_tiles"):
                bare = time_ms(lambda: go.matmul(a, b))
                record("epilogue", "bare" + tag, (M, N, K), str(dtype)[6:], bare, 2.0 * M * N * K)
                for name, kw in (("alpha", {"alpha": 0.5}), ("bias", {"bias": bias}),
                                 ("bias+gelu", {"bias": bias, "activation": "gelu"}),
                                 ("residual", {"residual": res}),
                                 ("bias+gelu+residual",
                                  {"bias": bias, "activation": "gelu", "residual": res})):
                    ms = time_ms(lambda kw=kw: go.matmul(a, b, **kw))
                    record("epilogue", name + tag, (M, N, K), str(dtype)[6:], ms,
                           2.0 * M * N * K, extra={"pct_over_bare": 100.0 * (ms / bare - 1)})
        if dtype is torch.bfloat16 and G.effective_arch(0) == G.WGMMA_ARCH:
            bare = time_ms(lambda: go.matmul(a, b, variant="wgmma"))
            record("epilogue", "bare [wgmma]", (M, N, K), "bfloat16", bare, 2.0 * M * N * K)
            for name, kw in (("bias", {"bias": bias}),
                             ("bias+gelu", {"bias": bias, "activation": "gelu"}),
                             ("bias+gelu+residual",
                              {"bias": bias, "activation": "gelu", "residual": res})):
                ms = time_ms(lambda kw=kw: go.matmul(a, b, variant="wgmma", **kw))
                record("epilogue", name + " [wgmma]", (M, N, K), "bfloat16", ms, 2.0 * M * N * K,
                       extra={"pct_over_bare": 100.0 * (ms / bare - 1)})
        if dtype is torch.bfloat16:
            eager = time_ms(lambda: F.gelu(torch.addmm(bias, a, b)) + res)
            record("epilogue", "torch eager bias+gelu+residual", (M, N, K), "bfloat16", eager)


def swiglu():
    print("\n== swiglu_linear vs two cuBLAS GEMMs + silu * mul ==")
    ref = lambda x, wg, wu: F.silu(F.linear(x, wg)) * F.linear(x, wu)  # noqa: E731
    compiled = torch.compile(ref)
    for M, N, K in ((4096, 11008, 4096), (1, 11008, 4096), (16, 11008, 4096)):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        wg = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        wu = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        peer = time_ms(lambda: ref(x, wg, wu))
        comp = time_ms(lambda: compiled(x, wg, wu))
        ms = time_ms(lambda: go.swiglu_linear(x, wg, wu))
        record("swiglu", "swiglu_linear", (M, N, K), "bfloat16", ms, 4.0 * M * N * K, peer,
               extra={"torch_compile_ms": comp})
        if M == 16:
            with decode_plan("legacy"):
                ms = time_ms(lambda: go.swiglu_linear(x, wg, wu))
            record("swiglu", "swiglu_linear legacy", (M, N, K), "bfloat16", ms, 4.0 * M * N * K,
                   peer)


def int8():
    print("\n== int8_matmul vs torch._int_mm (+ scales) ==")
    M = N = K = 4096
    a = torch.randint(-128, 128, (M, K), device="cuda", dtype=torch.int8)
    w = torch.randint(-128, 128, (N, K), device="cuda", dtype=torch.int8)
    sa = torch.rand(M, device="cuda")
    sb = torch.rand(N, device="cuda")
    peer = time_ms(lambda: (torch._int_mm(a, w.T).float() * sa[:, None] * sb[None, :]).to(torch.bfloat16))
    record("int8", "torch._int_mm + scales", (M, N, K), "int8", peer, 2.0 * M * N * K)
    for v in ("dp4a", "mma"):
        ms = time_ms(lambda v=v: go.int8_matmul(a, w.T, sa, sb, "bfloat16", variant=v))
        record("int8", f"int8_matmul {v}", (M, N, K), "int8", ms, 2.0 * M * N * K, peer)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="ladder,decode,epilogue,swiglu,int8")
    args = ap.parse_args()
    sections = args.sections.split(",")
    gbps = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {gbps:.0f} GB/s")
    failures = {}
    for name, fn in (("ladder", lambda: ladder(args.quick)), ("decode", lambda: decode(gbps)),
                     ("epilogue", epilogues), ("swiglu", swiglu), ("int8", int8)):
        if name in sections:
            try:
                fn()
            except Exception as exc:  # report and go on with the other sections
                failures[name] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"  {name} FAILED: {failures[name]}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_gbps": gbps, "rows": ROWS,
                       "failures": failures, "torch": torch.__version__}, fh, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
