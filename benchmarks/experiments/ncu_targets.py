"""One call of each named target inside a profiler range, for Nsight Compute (ncu) to read the
hardware counters of exactly those kernels (issue-slot use, warp stall reasons, shared-memory
wavefronts, DRAM / L2 traffic, per-instruction stall samples in the SASS).

Each target builds its inputs, runs twice outside the range (compiles, warms the caches and
the allocator), then once between cudaProfilerStart / cudaProfilerStop. Under
`ncu --profile-from-start off` only the kernels of those single calls are profiled; run without
ncu, the script just checks that every target runs (and prints its output's checksum).

    ncu --clock-control none --profile-from-start off --set full -o REPORT \\
        python3 benchmarks/experiments/ncu_targets.py --targets sgemm_cublas,sgemm_k16
    bash scripts/device_run.sh ncu      # the same with NCU_TARGETS, and the CSV exports

Targets (issue 4's fp32 SIMT gap, issue 3's long rows, issue 4's fused epilogue):
  sgemm_cublas        torch.matmul fp32 4096^3, TF32 off (cuBLAS: the kernel to compare with)
  sgemm_<config>      go.matmul(variant='warp_tiled') at 4096^3 under PLAN['warp_tiled'] = config
  rms_long_bf16       go.rms_norm [16, 1048576] bf16 (LONG_ROWS 'auto')
  ln_long_bf16        go.layer_norm [16, 1048576] bf16
  rms_long_bf16_resident, ln_long_bf16_resident   the same under LONG_ROWS 'resident'
  copy_long_bf16      torch copy of the same bytes (the DRAM reference)
  rows_{ln,rms}_{stream,off,lean,lean_two,liger}, rows_copy
                      [32768, 4096] bf16: the stream plan, the per-block kernels, Liger, a copy
  rows_{ln,rms}_{stream,lean,liger}_1k
                      the same at [131072, 1024] bf16
  wgmma_bare / wgmma_bias_gelu / wgmma_bias_gelu_tanh / wgmma_residual
                      go.linear bf16 4096x6144x2048 (M x N x K) under PLAN['wgmma'] 'tma_fused'
                      (bare: 'tma_store')
  hgemm_mma_<M>x<N>x<K> / hgemm_cublas_<M>x<N>x<K>
                      bf16 linear x [M, K] @ w [N, K].T by variant 'mma' (mma.sync, the tile of
                      _mma_config) or torch F.linear, at 8192^3 and the two LLM shapes (issue 4:
                      mma >= 50% of cuBLAS; the K = 2048 / 6144 shapes ran 38-49%, 8192^3 55%)
  decode_m1 / decode_m2 / decode_m2_ahead2 / decode_m2_cublas
                      bf16 linear x [M, 2048] @ w [6144, 2048].T: SIMT gemv (M = 1), gemv_mma
                      (PLAN['gemv_ahead'] 'auto' = 0 here, or 2), cuBLAS
  decode117_m1 / decode117_m8 / decode117_m8_ahead2 / decode117_m8_cublas / decode117_m8_pipe /
  decode117_m8_tma    the same at w [14336, 4096] (117 MB; M = 8; _pipe / _tma: PLAN['decode']
                      'pipe' / 'tma')
  decode117t_m8       M = 8 at w [4096, 14336], the default plan (K over clusters of 2)
  rms_bwd_bf16 / rms_bwd_fp32 / ln_bwd_bf16
                      rms_norm_backward / layer_norm_backward at [32768, 4096] (both launches)
  dattn_b16_tma / dattn_b16_async / dattn_b16_reg / dattn_b1_tma / dattn_b1_async /
  dattn_b16_sdpa / dattn_b1_sdpa
                      decode_attention B16 S4096 / B1 S8192 (Hq 16, Hkv 8, D 128, bf16) on
                      decode_split_tma, decode_split_async or the register kernel
                      (attention_decode.RING 'off'), or torch SDPA on the same caches
"""
from __future__ import annotations

import argparse
import json
import sys

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import torch  # noqa: E402

import gpuops as go  # noqa: E402
from gpuops.ops import gemm as G  # noqa: E402
from gpuops.ops import norms as N  # noqa: E402

LONG_ROWS = (16, 1 << 20)
EPI_SHAPE = (4096, 6144, 2048)   # M, N, K


def _sgemm(config):
    def build():
        a = torch.randn(4096, 4096, device="cuda")
        b = torch.randn(4096, 4096, device="cuda")
        if config is None:
            return lambda: torch.matmul(a, b)

        def call():
            saved = G.PLAN["warp_tiled"]
            G.PLAN["warp_tiled"] = config
            try:
                return go.matmul(a, b, variant="warp_tiled")
            finally:
                G.PLAN["warp_tiled"] = saved
        return call
    return build


def _long(op, long_rows="auto"):
    def build():
        x = torch.randn(*LONG_ROWS, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(LONG_ROWS[1], device="cuda", dtype=torch.bfloat16)
        b = torch.randn(LONG_ROWS[1], device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)

        def call():
            saved = N.LONG_ROWS
            N.LONG_ROWS = long_rows
            try:
                if op == "rms":
                    return go.rms_norm(x, LONG_ROWS[1:], w)
                if op == "ln":
                    return go.layer_norm(x, LONG_ROWS[1:], w, b)
                return out.copy_(x)
            finally:
                N.LONG_ROWS = saved
        return call
    return build


ROWS = (32768, 4096)


def _rows(op, impl, shape=ROWS):
    """[32768, 4096] bf16 layer_norm / rms_norm (or a copy of the same bytes): gpuops' stream plan
    (STREAM_ROWS 'on'), its per-block kernels ('off'; 'lean': WHOLE_ROWS 'lean', rms_norm_rows on
    every row), or Liger (issue 3's H200 gap, runs 155-157: the stream plan plateaus at 81-92% of
    copy; Liger's rms_norm reaches 97%; run 160: layer_norm_lean, Liger's structure and occupancy,
    still 5% slower than Liger's layer_norm)."""
    def build():
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(shape[1], device="cuda", dtype=torch.bfloat16)
        b = torch.randn(shape[1], device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        if impl == "liger":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction  # noqa: PLC0415
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction  # noqa: PLC0415
            if op == "rms":
                return lambda: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)
            return lambda: LigerLayerNormFunction.apply(x, w, b, 1e-5)
        if op == "copy":
            return lambda: out.copy_(x)

        def call():
            knobs = {"stream": dict(STREAM_ROWS="on"),
                     "off": dict(STREAM_ROWS="off", WHOLE_ROWS="auto", ROWS_MAX_WAVES=1),
                     "lean": dict(STREAM_ROWS="off", WHOLE_ROWS="lean", ROWS_MAX_WAVES=None),
                     "lean_two": dict(STREAM_ROWS="off", WHOLE_ROWS="lean_two",
                                      ROWS_MAX_WAVES=None)}[impl]
            saved = {k: getattr(N, k) for k in knobs}
            for k, v in knobs.items():
                setattr(N, k, v)
            try:
                if op == "rms":
                    return go.rms_norm(x, shape[1:], w)
                return go.layer_norm(x, shape[1:], w, b)
            finally:
                for k, v in saved.items():
                    setattr(N, k, v)
        return call
    return build


def _wgmma(epi):
    def build():
        M, N, K = EPI_SHAPE
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        cfg = "tma_store" if epi == "bare" else "tma_fused"

        def call():
            saved = G.PLAN["wgmma"]
            G.PLAN["wgmma"] = cfg
            try:
                if epi == "bare":
                    return go.linear(x, w, variant="wgmma")
                if epi == "residual":
                    return go.matmul(x, w.T, residual=res, variant="wgmma")
                act = {"bias_gelu": "gelu", "bias_gelu_tanh": "gelu_tanh"}[epi]
                return go.linear(x, w, bias, act, variant="wgmma")
            finally:
                G.PLAN["wgmma"] = saved
        return call
    return build


def _hgemm(shape, variant):
    def build():
        M, N, K = shape
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        if variant is None:
            return lambda: torch.nn.functional.linear(x, w)
        return lambda: go.linear(x, w, variant=variant)
    return build


HGEMM_SHAPES = ((8192, 8192, 8192), (4096, 6144, 2048), (4096, 2048, 6144))


def _decode(M, ahead="auto", peer=False, weight=(6144, 2048), plan=None, split="auto"):
    """A decode linear, bf16 x [M, K] @ w [N, K].T (weight [N, K]; the weight is cold: ncu
    flushes the caches before each pass): the SIMT gemv at M = 1, gemv_mma above (at [6144,
    2048] one wave of 384 blocks), or torch F.linear (cuBLAS)."""
    def build():
        N, K = weight
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        if peer:
            return lambda: torch.nn.functional.linear(x, w)

        def call():
            saved = G.PLAN["gemv_ahead"], G.PLAN["decode"], G.PLAN["gemv_tma_split"]
            G.PLAN["gemv_ahead"], G.PLAN["gemv_tma_split"] = ahead, split
            G.PLAN["decode"] = plan or saved[1]
            try:
                return go.linear(x, w)
            finally:
                G.PLAN["gemv_ahead"], G.PLAN["decode"], G.PLAN["gemv_tma_split"] = saved
        return call
    return build


def _norm_bwd(op, dtype, shape=ROWS):
    """rms_norm_backward / layer_norm_backward at `shape` (issue 3, run 234: bf16 at [32768, 4096]
    73.9-77.9% of copy, fp32 88.5-89.7%): both launches (the row kernel and the weight
    gradient's sum)."""
    def build():
        td = getattr(torch, dtype)
        x = torch.randn(*shape, device="cuda", dtype=td)
        g = torch.randn(*shape, device="cuda", dtype=td)
        w = torch.randn(shape[1], device="cuda", dtype=td)
        if op == "rms":
            _, rstd = go.rms_norm_forward(x, (shape[1],), w)
            return lambda: go.rms_norm_backward(g, x, rstd, (shape[1],), w)[0]
        _, mean, rstd = go.layer_norm_forward(x, (shape[1],), w)
        return lambda: go.layer_norm_backward(g, x, mean, rstd, (shape[1],), w)[0]
    return build


def _decode_attn(b, s, ring, kernel="auto", peer=False):
    """decode_attention, B x S (Hq 16, Hkv 8, D 128, bf16, one query token, full caches), with
    attention_decode.RING = ring ('on': a ring kernel, 'off': the register kernel) and
    RING_KERNEL = kernel ('async', 'tma')."""
    def build():
        from gpuops.ops import attention_decode as AD  # noqa: PLC0415
        q = torch.randn(b, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, s, 8, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, s, 8, 128, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((b,), s, dtype=torch.int32, device="cuda")

        if peer:
            return lambda: AD._sdpa(q, k, v)

        def call():
            saved = AD.RING, AD.RING_KERNEL
            AD.RING, AD.RING_KERNEL = ring, kernel
            try:
                return go.decode_attention(q, k, v, lens)
            finally:
                AD.RING, AD.RING_KERNEL = saved
        return call
    return build


TARGETS = {
    "sgemm_cublas": _sgemm(None),
    **{f"sgemm_{c}": _sgemm(c) for c in G.WARP_TILED_CONFIGS},
    "rms_long_bf16": _long("rms"),
    "ln_long_bf16": _long("ln"),
    "rms_long_bf16_resident": _long("rms", "resident"),
    "ln_long_bf16_resident": _long("ln", "resident"),
    "copy_long_bf16": _long("copy"),
    **{f"rows_{op}_{impl}": _rows(op, impl) for op in ("ln", "rms")
       for impl in ("stream", "off", "lean", "lean_two", "liger")},
    # [131072, 1024] bf16 (run 162: rms_norm_rows 159.6 us, Liger's rms_norm 134.2, same block
    # of 128 threads; layer_norm_lean 160.8, Liger's 142.5)
    **{f"rows_{op}_{impl}_1k": _rows(op, impl, (131072, 1024)) for op in ("ln", "rms")
       for impl in ("stream", "lean", "liger")},
    "rows_copy": _rows("copy", None),
    **{f"wgmma_{e}": _wgmma(e) for e in ("bare", "bias_gelu", "bias_gelu_tanh", "residual")},
    **{f"hgemm_{v or 'cublas'}_{'x'.join(map(str, sh))}": _hgemm(sh, v)
       for sh in HGEMM_SHAPES for v in ("mma", None)},
    "decode_m1": _decode(1),
    "decode_m2": _decode(2),
    "decode_m2_ahead2": _decode(2, 2),
    "decode_m2_cublas": _decode(2, peer=True),
    # [14336, 4096] (117 MB; runs 190-192: M = 8 on gemv_mma 64% of copy, M = 1 on the SIMT gemv
    # 93%, cuBLAS 91-95%)
    "decode117_m1": _decode(1, weight=(14336, 4096)),
    "decode117_m8": _decode(8, weight=(14336, 4096)),
    "decode117_m8_ahead2": _decode(8, 2, weight=(14336, 4096)),
    "decode117_m8_cublas": _decode(8, peer=True, weight=(14336, 4096)),
    # the 'pipe' plan there (NT = 4 since run 194: 74-77% of copy; the default from 96 MB)
    "decode117_m8_pipe": _decode(8, weight=(14336, 4096), plan="pipe"),
    # the TMA ring (gemv_mma_tma, PLAN['decode'] 'tma', sm_90)
    "decode117_m8_tma": _decode(8, weight=(14336, 4096), plan="tma"),
    # the transposed weight [4096, 14336] under the default plan (since the thirty-fourth
    # session: gemv_mma_tma_split, K over clusters of 2)
    "decode117t_m8": _decode(8, weight=(4096, 14336)),
    # decode attention (issue 5): the TMA ring kernel and the register kernel
    "rms_bwd_bf16": _norm_bwd("rms", "bfloat16"),
    "rms_bwd_fp32": _norm_bwd("rms", "float32"),
    "ln_bwd_bf16": _norm_bwd("ln", "bfloat16"),
    "dattn_b16_tma": _decode_attn(16, 4096, "on", "tma"),
    "dattn_b16_async": _decode_attn(16, 4096, "on", "async"),
    "dattn_b16_reg": _decode_attn(16, 4096, "off"),
    "dattn_b1_tma": _decode_attn(1, 8192, "on", "tma"),
    "dattn_b1_async": _decode_attn(1, 8192, "on", "async"),
    "dattn_b16_sdpa": _decode_attn(16, 4096, "auto", peer=True),
    "dattn_b1_sdpa": _decode_attn(1, 8192, "auto", peer=True),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="sgemm_cublas,sgemm_k16",
                    help="comma-separated, from: " + ", ".join(TARGETS))
    ap.add_argument("--json", help="where to write each target's output checksum")
    args = ap.parse_args()
    names = [t for t in args.targets.split(",") if t]
    unknown = [t for t in names if t not in TARGETS]
    if unknown:
        ap.error(f"--targets: unknown {unknown}; known: {list(TARGETS)}")
    torch.backends.cuda.matmul.allow_tf32 = False
    cudart = torch.cuda.cudart()
    sums = {}
    for name in names:
        torch.manual_seed(0)
        call = TARGETS[name]()
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        cudart.cudaProfilerStart()
        out = call()
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()
        sums[name] = float(out.float().abs().sum())
        print(f"{name:<24} |out| sum {sums[name]:.6g}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"targets": sums}, f, indent=1)


if __name__ == "__main__":
    main()
