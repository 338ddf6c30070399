"""scaled_dot_product_attention_backward, tensor-core variants ('mma'; 'wgmma' with --wgmma):
backward alone and forward + backward, side by side with torch SDPA's FLASH (FlashAttention-2) and cuDNN backends, bf16.

Shapes (issue 5; baselines in ../shared/notes/baselines-h100.md): B2 H16 S4096 D128 non-causal
and causal, B4 H16 S2048 D64 causal. Ours: gpuops' forward (variant 'auto': wgmma on sm_90) +
the backward at each tile (MMA_TILES[d], what 'auto' runs; with --tiles also the other compiled
tiles: MMA_ALTERNATES, MMA_SMALL_TILES, the mask tile run unmasked). Peers, each backend forced
with sdpa_kernel: backward alone = the aten backward op behind SDPA's autograd, fed once by its
own forward; forward + backward = F.scaled_dot_product_attention + torch.autograd.grad. Kernel
time = median of CUDA events around single calls after warm-up (each call is milliseconds: host
time is noise). TFLOP/s: forward 4 B H S^2 D, backward 2.5x that, forward + backward 3.5x
(FlashAttention's convention), halved for causal. Each gpuops result is checked against the FLASH
backend's gradients (relative Frobenius error, printed) before it is timed.

    python benchmarks/experiments/attention_bwd_mma.py [--json F] [--tiles default|all|LIST]
        [--simt] [--wgmma] [--iters 20]

LIST: tiles as warps,MT,BR,stages,minB separated by ';' (e.g. "8,1,64,2,1;8,1,32,2,1"); each
must be compiled for the head dim (gpuops.ops.attention_backward.MMA_MODULES), else it is skipped
with a message. Predictions and floors: benchmarks/notes_attention.md ("Tensor-core backward").
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.attention import SDPBackend, sdpa_kernel

import gpuops as go
from gpuops import dtypes as dt
from gpuops.bench import event_pairs_ms
from gpuops.ops import attention_backward as ab

SHAPES = ((2, 16, 4096, 128, False), (2, 16, 4096, 128, True), (4, 16, 2048, 64, True))
BACKENDS = (("sdpa_flash", SDPBackend.FLASH_ATTENTION, "flash"),
            ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION, "cudnn"))


time_ms = event_pairs_ms


def tiles_for(d, spec):
    default = ab.MMA_TILES[d]
    if spec == "default":
        return [default]
    if spec == "all":
        cands = [default, *ab.MMA_ALTERNATES.get(d, ()), ab.MMA_SMALL_TILES.get(d),
                 ab.MMA_MASK_TILES.get(d)]
    else:
        cands = [tuple(int(x) for x in item.split(",")) for item in spec.split(";") if item]
    out = []
    compiled = ab.MMA_MODULES[dt.bfloat16].kernels
    for cfg in cands:
        if cfg is None or cfg in out:
            continue
        if ab.mma_expr(dt.bfloat16, d, cfg) not in compiled:
            print(f"  tile {cfg} is not compiled for D={d}: skipped")
            continue
        out.append(cfg)
    return out


def rel(a, e):
    return ((a.float() - e.float()).norm() / e.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--tiles", default="all")
    ap.add_argument("--simt", action="store_true", help="also time the SIMT backward (slow)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--wgmma", action="store_true",
                    help="also time variant='wgmma' (the Hopper backward, sm_90)")
    args = ap.parse_args()
    dev = torch.cuda.current_device()
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for B, H, S, D, causal in SHAPES:
        q, k, v, g = (torch.randn(B, H, S, D, device="cuda", generator=gen, dtype=torch.bfloat16)
                      for _ in range(4))
        fwd_flops = 4 * B * H * S * S * D / (2 if causal else 1)
        flops = {"bwd": 2.5 * fwd_flops, "fwd_bwd": 3.5 * fwd_flops}
        name = f"B{B} H{H} S{S} D{D}{' causal' if causal else ''}"
        print(f"{name}:")
        times = {}
        ref = None
        for peer, backend, kind in BACKENDS:
            try:
                with sdpa_kernel(backend):
                    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                    grads = torch.autograd.grad(
                        F.scaled_dot_product_attention(*leaves, is_causal=causal), leaves, g)
                    if ref is None:
                        ref = grads

                    def fwd_bwd():
                        lv = [x.detach().requires_grad_() for x in (q, k, v)]
                        o = F.scaled_dot_product_attention(*lv, is_causal=causal)
                        return torch.autograd.grad(o, lv, g)
                    times[(peer, "fwd_bwd")] = time_ms(fwd_bwd, args.iters)
                ab._TORCH_FWD.clear()
                bwd = ab._torch_aten_backward(kind)
                bwd(g, q, k, v, None, None, is_causal=causal)
                times[(peer, "bwd")] = time_ms(
                    lambda bwd=bwd: bwd(g, q, k, v, None, None, is_causal=causal), args.iters)
            except RuntimeError as exc:                   # backend not available for this build
                print(f"  {peer}: {exc}")
        out, lse = go.scaled_dot_product_attention(q, k, v, is_causal=causal, return_lse=True)
        default = ab.MMA_TILES[D]
        variants = ([("wgmma pingpong", "wgmma", None), ("wgmma overlap", "wgmma", None)]
                    if args.wgmma else [])
        variants += [(f"mma {cfg}", "mma", cfg) for cfg in tiles_for(D, args.tiles)]
        if args.simt:
            variants.append(("simt", "simt", None))
        pingpong0 = ab.WGMMA_PINGPONG
        for label, variant, cfg in variants:
            if cfg is not None:
                ab.MMA_TILES[D] = cfg
            ab.WGMMA_PINGPONG = label != "wgmma overlap"      # its two schedules

            def ours_bwd(variant=variant):
                return go.scaled_dot_product_attention_backward(g, q, k, v, out, lse,
                                                                is_causal=causal, variant=variant)

            def ours_fwd_bwd(variant=variant):
                o, lse2 = go.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                          return_lse=True)
                return go.scaled_dot_product_attention_backward(g, q, k, v, o, lse2,
                                                                is_causal=causal, variant=variant)
            try:
                got = ours_bwd()
                errs = [rel(a, e) for a, e in zip(got, ref)] if ref is not None else []
                times[(label, "bwd")] = time_ms(ours_bwd, args.iters)
                times[(label, "fwd_bwd")] = time_ms(ours_fwd_bwd, args.iters)
                smem = "" if cfg is None else f", smem {ab.mma_smem(D, cfg) // 1024} KB"
                smem = f", smem {ab.wgmma_smem(D) // 1024} KB" if variant == "wgmma" else smem
                print(f"  {label}: rel. error dq/dk/dv vs FLASH "
                      f"{'/'.join(f'{x:.1e}' for x in errs)}{smem}")
            finally:
                ab.MMA_TILES[D] = default
                ab.WGMMA_PINGPONG = pingpong0
        for what in ("bwd", "fwd_bwd"):
            flash = times.get(("sdpa_flash", what))
            cudnn = times.get(("sdpa_cudnn", what))
            for (label, w), ms in times.items():
                if w != what:
                    continue
                tf = flops[what] / ms / 1e9
                ratio = "".join(f"  {x / ms:5.2f}x {n}" for x, n in ((flash, "FLASH"),
                                                                    (cudnn, "cuDNN")) if x)
                print(f"  {what:8s} {label:28s} {ms:8.3f} ms {tf:7.1f} TFLOP/s{ratio}")
                result["rows"].append({"shape": [B, H, S, D, causal], "what": what,
                                       "impl": label, "ms": ms, "tflops": tf,
                                       "vs_flash": flash / ms if flash else None,
                                       "vs_cudnn": cudnn / ms if cudnn else None})
        del q, k, v, g, out, lse, ref
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
