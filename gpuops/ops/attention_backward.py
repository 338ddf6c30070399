"""Attention backward: ``scaled_dot_product_attention_backward`` (dq, dk, dv from the forward's lse).

Kernels (cuda_src/attention/flash_bwd.cu), fp32 math for fp32/fp16/bf16 storage:

* variant ``'simt'``: FlashAttention-2's backward on CUDA cores (sm_61 and up). A preprocess
  kernel computes D_i = rowsum(dO_i * O_i) and zeroes an fp32 dq accumulator; the main kernel
  runs one block per (batch x kv head, BC keys), keeps that tile's dK and dV in registers, walks
  the query tiles (of every query head of the GQA group) that can see its keys, recomputes
  P = exp2(S * scale log2(e) - lse log2(e)) from the forward's lse, and adds its dQ part with fp32
  atomics; a last kernel converts dq to the storage type (fp32 storage accumulates in dq
  itself). Head dims 32/64/96/128 have their own instantiations (a tile within the 48 KB every
  arch has, and a larger one where the device lets a block opt in to more shared memory); any
  other head dim (and 128 where only 48 KB are available) goes through the general
  instantiation, which splits the head dim into chunks over blocks and recomputes the scores
  per chunk.
* ``'mma'`` (mma.sync, sm_80+) is the next step: it goes into ``_VARIANTS`` below with ``'auto'``
  picking the best one the device has.

The launch arguments are a FlashBwdArgs struct (cuda_src/attention/flash_bwd.cuh), separate from
the forward's. Design notes, floors and predictions: benchmarks/notes_attention.md (backward).
"""
from __future__ import annotations

import math

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.ops import _layout as lay
from gpuops.ops import attention as fwd
from gpuops.registry import register
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.tensor import Tensor

OP = "scaled_dot_product_attention_backward"
VARIANTS = ("auto", "simt")          # 'mma': the tensor-core form, next step

# ---------------------------------------------------------------------------------------------
# Kernel module. One FlashBwdArgs struct per launch.

FLASH_BWD_ARGS = ArgSpec("12P43q10i2f")
PREP_THREADS = 128                   # 4 rows (one warp each) per block: prep and dq conversion
# head dim -> ((BR, BC, threads) within 48 KB or None, (BR, BC, threads) for devices that opt in
# to more shared memory). BR query rows, BC key rows per block.
FAST_TILES = {32: ((32, 64, 128), (64, 64, 128)), 64: ((32, 32, 128), (64, 64, 256)),
              96: ((16, 32, 128), (64, 64, 256)), 128: (None, (64, 64, 256))}
# chunk width -> (BR, BC, threads) of the general instantiations: 32 for any head dim, 64 for
# head dim 128 where its fast tile does not fit (fewer score recomputations than 32)
GENERAL_TILES = {32: (32, 64, 128), 64: (32, 32, 128)}
_B = {True: "true", False: "false"}


def bwd_smem(d: int, br: int, bc: int) -> int:
    """Bytes of dynamic shared memory: K, V [BC][D+4], Q, dO [BR][D+4], P^T, dS^T [BC][BR+4],
    lse and D [BR], fp32."""
    return 4 * (2 * bc * (d + 4) + 2 * br * (d + 4) + 2 * bc * (br + 4) + 2 * br)


def dkdv_expr(dtype, d: int, br: int, bc: int, nt: int, general: bool) -> str:
    return (f"gpuops::flash_bwd_dkdv<{dtype.ctype}, {d}, {br}, {bc}, {nt}, {_B[general]}, "
            "true>")


def prep_expr(dtype) -> str:
    return f"gpuops::flash_bwd_prep<{dtype.ctype}>"


def convert_expr(dtype) -> str:
    return f"gpuops::flash_bwd_dq_convert<{dtype.ctype}>"


def _bwd_kernels():
    out = {}
    for dtype in dt.FLOATS:
        out[prep_expr(dtype)] = FLASH_BWD_ARGS
        if dtype is not dt.float32:
            out[convert_expr(dtype)] = FLASH_BWD_ARGS
        for d, tiles in FAST_TILES.items():
            for tile in tiles:
                if tile is not None:
                    out[dkdv_expr(dtype, d, *tile, False)] = FLASH_BWD_ARGS
        for d, tile in GENERAL_TILES.items():
            out[dkdv_expr(dtype, d, *tile, True)] = FLASH_BWD_ARGS
    return out


FLASH_BWD_MODULE = KernelModule("attention.flash_bwd", "attention/flash_bwd.cu", _bwd_kernels())
_KERNELS = lay.KernelTable(FLASH_BWD_MODULE)

for _d, (_small, _big) in FAST_TILES.items():
    assert _small is None or bwd_smem(_d, *_small[:2]) <= 48 * 1024, (_d, _small)
for _d, _tile in GENERAL_TILES.items():
    assert bwd_smem(_d, *_tile[:2]) <= 48 * 1024, (_d, _tile)


def simt_config(d: int, limit: int):
    """(head-dim template D, BR, BC, threads, general) of the SIMT backward for head dim d on a
    device whose blocks may use ``limit`` bytes of shared memory."""
    if d in FAST_TILES:
        small, big = FAST_TILES[d]
        if bwd_smem(d, *big[:2]) <= limit:
            return (d, *big, False)
        if small is not None:
            return (d, *small, False)
        return (64, *GENERAL_TILES[64], True)
    return (32, *GENERAL_TILES[32], True)


# ---------------------------------------------------------------------------------------------
# Arguments (shared by the GPU path and the reference, which is also the CPU fallback).

def check_args(g_shape, q_shape, k_shape, v_shape, o_shape, lse_shape, m_shape, is_causal, scale,
               enable_gqa, window_size, layout, variant) -> fwd.Problem:
    """The forward's checks, plus grad_out / output / lse shapes and the backward's variants."""
    if variant not in VARIANTS:
        raise ValueError(f"gpuops.{OP}: 'variant' must be one of {VARIANTS}, got {variant!r}")
    try:
        p = fwd.check_args(q_shape, k_shape, v_shape, m_shape, is_causal, scale, enable_gqa,
                           window_size, False, layout, "auto")
    except (TypeError, ValueError) as exc:    # the same message, under this op's name
        raise type(exc)(str(exc).replace(f"gpuops.{fwd.OP}:", f"gpuops.{OP}:", 1)) from None
    q_shape = tuple(int(s) for s in q_shape)
    for name, shape in (("grad_out", g_shape), ("output", o_shape)):
        if tuple(int(s) for s in shape) != q_shape:
            raise ValueError(f"gpuops.{OP}: {name!r} has shape {tuple(shape)}; it must have the "
                             f"query's shape {q_shape}")
    if tuple(int(s) for s in lse_shape) != (p.B, p.Hq, p.Sq):
        raise ValueError(f"gpuops.{OP}: 'lse' has shape {tuple(lse_shape)}; expected [B, Hq, Sq] "
                         f"= {[p.B, p.Hq, p.Sq]} (the forward's return_lse=True output)")
    return p


# ---------------------------------------------------------------------------------------------
# The NumPy reference (float64): the textbook gradient, head by head, with P from the given lse
# and D from the given output (as the kernels do; both come from the forward).

def ref_scaled_dot_product_attention_backward(grad_out, query, key, value, output, lse,
                                              attn_mask=None, is_causal=False, scale=None,
                                              enable_gqa=False, window_size=None, layout="bhsd",
                                              variant="auto"):
    p = check_args(np.shape(grad_out), np.shape(query), np.shape(key), np.shape(value),
                   np.shape(output), np.shape(lse),
                   None if attn_mask is None else np.shape(attn_mask), is_causal, scale,
                   enable_gqa, window_size, layout, variant)
    g, q, k, v, o = (np.asarray(x, dtype=np.float64) for x in (grad_out, query, key, value, output))
    if layout == "bshd":
        g, q, k, v, o = (x.transpose(0, 2, 1, 3) for x in (g, q, k, v, o))
    L = np.asarray(lse, dtype=np.float64)
    mask = None
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        mask = np.broadcast_to(m.astype(bool) if m.dtype == bool else m.astype(np.float64),
                               (p.B, p.Hq, p.Sq, p.Sk))
    ok = fwd.visible(p.Sq, p.Sk, p.left, p.right)
    dq = np.zeros((p.B, p.Hq, p.Sq, p.D))
    dk = np.zeros((p.B, p.Hkv, p.Sk, p.D))
    dv = np.zeros((p.B, p.Hkv, p.Sk, p.D))
    with np.errstate(all="ignore"):
        for b in range(p.B):
            for h in range(p.Hq):
                hk = h // p.group
                s = (q[b, h] @ k[b, hk].T) * p.scale
                keep = ok
                if mask is not None:
                    if mask.dtype == bool:
                        keep = ok & mask[b, h]
                    else:
                        s = s + mask[b, h]
                lrow = L[b, h][:, None]
                # a row that saw no key (lse = -inf) has no probabilities and no gradient
                prob = np.where(keep & ~np.isneginf(lrow), np.exp(s - lrow), 0.0)
                dp = g[b, h] @ v[b, hk].T
                d_row = np.sum(g[b, h] * o[b, h], axis=1, keepdims=True)
                ds = np.where(keep, prob * (dp - d_row), 0.0)
                dv[b, hk] += prob.T @ g[b, h]
                dk[b, hk] += p.scale * (ds.T @ q[b, h])
                dq[b, h] = p.scale * (ds @ k[b, hk])
    if layout == "bshd":
        dq, dk, dv = (x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# GPU path.

def _aligned_rows(t: Tensor, layout: str, d: int) -> bool:
    """fp32 rows of ``t`` start 16-byte aligned with unit d stride (vector atomics)."""
    st = fwd._bhsd_strides(t, layout)
    return t.ptr % 16 == 0 and d % 4 == 0 and st[3] == 1 and all(s % 4 == 0 for s in st[:3])


def _backward(call, grad_out, query, key, value, output, lse, attn_mask, is_causal, scale,
              enable_gqa, window_size, layout, variant):
    p = check_args(grad_out.shape, query.shape, key.shape, value.shape, output.shape, lse.shape,
                   None if attn_mask is None else attn_mask.shape, is_causal, scale, enable_gqa,
                   window_size, layout, variant)
    dtype = call.result_dtype
    if lse.dtype is not dt.float32:
        raise TypeError(f"gpuops.{OP}: 'lse' has dtype {lse.dtype}; the GPU path takes the "
                        "forward's float32 lse")
    mask_kind = 0
    if attn_mask is not None:
        if attn_mask.dtype is dt.bool_:
            mask_kind = 1
        elif attn_mask.dtype is dtype:
            mask_kind = 2
        else:
            raise TypeError(f"gpuops.{OP}: 'attn_mask' has dtype {attn_mask.dtype}; expected bool "
                            f"or the query's dtype ({dtype})")
    q_shape = (p.B, p.Hq, p.Sq, p.D) if layout == "bhsd" else (p.B, p.Sq, p.Hq, p.D)
    kv_shape = (p.B, p.Hkv, p.Sk, p.D) if layout == "bhsd" else (p.B, p.Sk, p.Hkv, p.D)
    dq = call.empty(q_shape, dtype)
    dk = call.empty(kv_shape, dtype)
    dv = call.empty(kv_shape, dtype)
    if dq.numel or dk.numel:
        _VARIANTS[variant](call, p, grad_out, query, key, value, output, lse, attn_mask,
                           mask_kind, dq, dk, dv, layout)
    return dq, dk, dv


def _launch_simt(call, p, grad_out, query, key, value, output, lse, attn_mask, mask_kind, dq, dk,
                 dv, layout):
    dev, dtype = call.device, call.result_dtype
    d, br, bc, nt, general = simt_config(p.D, fwd.smem_limit(dev))
    nz = -(-p.D // d) if general else 1
    grid = (p.B * p.Hkv, -(-p.Sk // bc), nz)
    if grid[0] >= 2**31 or grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"gpuops.{OP}: too large for one launch (batch x kv heads = {grid[0]}, "
                         f"key tiles = {grid[1]}, head-dim chunks = {grid[2]})")
    rows = p.B * p.Hq * p.Sq
    # fp32 workspace: D_i and lse * log2(e) per query row; the dq accumulator (dq itself for
    # fp32 storage), zeroed by the preprocess kernel
    stats = call.empty((2 * rows,), dt.float32) if rows else None
    if dtype is dt.float32:
        acc, acc_strides = dq, fwd._bhsd_strides(dq, layout)
        acc_aligned = _aligned_rows(dq, layout, p.D)
    else:
        acc = call.empty((p.B, p.Hq, p.Sq, p.D), dt.float32)
        acc_strides = tuple(acc.strides)
        acc_aligned = _aligned_rows(acc, "bhsd", p.D)
    q_shape, kv_shape = (p.B, p.Hq, p.Sq, p.D), (p.B, p.Hkv, p.Sk, p.D)
    vec = (not general and fwd._vec_ok(query, layout, q_shape)
           and fwd._vec_ok(grad_out, layout, q_shape) and fwd._vec_ok(key, layout, kv_shape)
           and fwd._vec_ok(value, layout, kv_shape))
    lse_strides = tuple(lse.strides)
    args = (query.ptr, key.ptr, value.ptr, output.ptr, grad_out.ptr, lse.ptr,
            attn_mask.ptr if attn_mask is not None else 0, dq.ptr, dk.ptr, dv.ptr, acc.ptr,
            stats.ptr if stats is not None else 0,
            *fwd._bhsd_strides(query, layout), *fwd._bhsd_strides(key, layout),
            *fwd._bhsd_strides(value, layout), *fwd._bhsd_strides(output, layout),
            *fwd._bhsd_strides(grad_out, layout),
            *(fwd._mask_strides(attn_mask) if attn_mask is not None else fwd._NULL_STRIDES),
            *fwd._bhsd_strides(dq, layout), *fwd._bhsd_strides(dk, layout),
            *fwd._bhsd_strides(dv, layout), *acc_strides, *lse_strides,
            p.B, p.Hq, p.group, p.Sq, p.Sk, p.D, p.left, p.right, mask_kind,
            int(vec) | (2 if acc_aligned else 0), p.scale, p.scale * math.log2(math.e))
    block = (PREP_THREADS, 1, 1)
    if rows:
        _KERNELS.get(dev, prep_expr(dtype)).launch((-(-rows // 4), 1, 1), block, call.stream,
                                                   *args)
    if grid[1]:
        _KERNELS.get(dev, dkdv_expr(dtype, d, br, bc, nt, general)).launch(
            grid, (nt, 1, 1), call.stream, *args, smem=bwd_smem(d, br, bc))
    if rows and dtype is not dt.float32:
        _KERNELS.get(dev, convert_expr(dtype)).launch((-(-rows // 4), 1, 1), block, call.stream,
                                                      *args)


# 'auto' -> the best variant for the device; today that is always the SIMT kernels.
_VARIANTS = {"auto": _launch_simt, "simt": _launch_simt}


# ---------------------------------------------------------------------------------------------
# Benchmark: B = 4, H = 32, S = 4096, D = 128 (bf16), causal and not. Ours: the backward alone
# (its inputs made by gpuops' forward). Peers: torch's FlashAttention-2 and cuDNN backward
# kernels (the aten ops behind SDPA's autograd, fed by their own forward once per input set),
# and torch SDPA forward + backward through autograd for scale. FLOPs: 2.5 x the forward's
# (FlashAttention's convention: the five tile products of the backward against the forward's
# two), halved for causal. Bench shape (B, H, S, D, causal).

def _bench_make(shape, d, randn):
    B, H, S, D, causal = shape
    q, k, v, g = (randn((B, H, S, D), d) for _ in range(4))
    out, lse = fwd.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), return_lse=True)
    return (g, q, k, v, out, lse, None, bool(causal)), {}


_TORCH_FWD: dict = {}


def _torch_aten_backward(kind):
    def fn(g, q, k, v, out, lse, attn_mask=None, is_causal=False):
        import torch  # noqa: PLC0415
        aten = torch.ops.aten
        key = (kind, q.data_ptr(), k.data_ptr(), v.data_ptr(), bool(is_causal))
        saved = _TORCH_FWD.get(key)
        if saved is None:       # torch's own forward state (its lse, rng state), once
            _TORCH_FWD.clear()
            if kind == "flash":
                saved = _TORCH_FWD[key] = aten._scaled_dot_product_flash_attention(
                    q, k, v, 0.0, bool(is_causal))
            else:
                saved = _TORCH_FWD[key] = aten._scaled_dot_product_cudnn_attention(
                    q, k, v, None, True, 0.0, bool(is_causal))
        o, lse_t, cq, ck, mq, mk, s0, s1 = saved[:8]
        if kind == "flash":
            return aten._scaled_dot_product_flash_attention_backward(
                g, q, k, v, o, lse_t, cq, ck, mq, mk, 0.0, bool(is_causal), s0, s1)
        return aten._scaled_dot_product_cudnn_attention_backward(
            g, q, k, v, o, lse_t, s0, s1, None, cq, ck, mq, mk, 0.0, bool(is_causal))
    return fn


def _bench_fwd_bwd(g, q, k, v, out, lse, attn_mask=None, is_causal=False):
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415,N812
    qr, kr, vr = (x.detach().requires_grad_() for x in (q, k, v))
    o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=bool(is_causal))
    return torch.autograd.grad(o, (qr, kr, vr), g)


def _bench_peers():
    return {"sdpa_cudnn_bwd": _torch_aten_backward("cudnn"),
            "sdpa_fwd_bwd_autograd": _bench_fwd_bwd}


def _bench_flops(args, out):
    q, k = args[1], args[2]
    B, H, Sq, D = q.shape
    f = 4 * B * H * Sq * k.shape[2] * D * 5 // 2
    return f // 2 if args[7] else f


def _bench_bytes(args, out):
    item = args[1].element_size() if hasattr(args[1], "element_size") else args[1].itemsize
    # g, q, k, v, out read once, dq, dk, dv written once (lse and D are B H S fp32: small)
    return 8 * math.prod(args[1].shape) * item


BENCH = BenchSpec(
    make_inputs=_bench_make, torch_fn=_torch_aten_backward("flash"), extra_peers=_bench_peers,
    default_shape=lambda d: (4, 32, 4096, 128, 0), flops=_bench_flops, bytes_moved=_bench_bytes,
    check_shape=lambda s: (1, 2, min(s[2], 1024), s[3], s[4]),
    extra_shapes=((4, 32, 4096, 128, 1),))


# ---------------------------------------------------------------------------------------------
# The op.

@register(family="attention", reference=ref_scaled_dot_product_attention_backward,
          param_dtypes={"attn_mask": (dt.bool_, dt.float32, dt.float16, dt.bfloat16, dt.float64),
                        "lse": (dt.float32, dt.float64)},
          bench=BENCH)
def scaled_dot_product_attention_backward(call, grad_out: Tensor, query: Tensor, key: Tensor,
                                          value: Tensor, output: Tensor, lse: Tensor,
                                          attn_mask: Tensor | None = None,
                                          is_causal: bool = False, scale: float | None = None,
                                          enable_gqa: bool = False, *, window_size=None,
                                          layout: str = "bhsd", variant: str = "auto"):
    """Gradients ``(dq, dk, dv)`` of ``scaled_dot_product_attention`` from its output and lse.

    ``grad_out`` is d loss / d output; ``output`` and ``lse`` are what
    ``gpuops.scaled_dot_product_attention(..., return_lse=True)`` returned for the same
    ``query``, ``key``, ``value``, ``attn_mask``, ``is_causal``, ``scale``, ``enable_gqa``,
    ``window_size`` and ``layout`` (same meanings; ``lse`` is [B, Hq, Sq] float32). With
    P = exp(q k^T * scale + mask - lse) (0 where a key is invisible) and D = rowsum(grad_out *
    output): dv = P^T grad_out, dS = P * (grad_out v^T - D), dq = dS k * scale, dk = dS^T q *
    scale; with GQA, dk and dv are summed over the query heads of each group. Results in the
    inputs' dtype and layout (``dk``/``dv`` [B, Hkv, Sk, D], or [B, Sk, Hkv, D] for 'bshd').

    * Rows that saw no key (lse = -inf) contribute nothing; masked keys get no gradient. No
      gradient for ``attn_mask`` (an additive mask is treated as a constant).
    * ``variant``: 'auto' or 'simt' (FlashAttention-2's backward in fp32 on CUDA cores, every
      arch from sm_61): S and P are recomputed per tile from ``lse``, never stored; dq is
      accumulated with fp32 atomics (results may differ in the last bits from run to run, as
      with FlashAttention-2; dk and dv are deterministic).

    fp32 math for fp16/bf16/fp32 storage. Workspace: fp32 dq [B, Hq, Sq, D] (none for fp32)
    and 2 x B Hq Sq floats. For autograd use ``gpuops.torch.scaled_dot_product_attention``.
    """
    return _backward(call, grad_out, query, key, value, output, lse, attn_mask, is_causal,
                     scale, enable_gqa, window_size, layout, variant)
