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
* variant ``'mma'`` (cuda_src/attention/flash_bwd_mma.cu, sm_80+, fp16/bf16, head dims 64 and
  128): FlashAttention-2's backward on tensor cores (mma.sync m16n8k16, fp32 accumulators). The
  same preprocess and dq conversion kernels; the main kernel gives each warp 16 keys of the
  block, computes S^T = K Q^T and dP^T = V dO^T per query tile so that P^T and dS^T are directly
  the A operands of dV += P^T dO and dK += dS^T Q (registers), and dQ = dS K (dS^T through shared
  memory) goes to the fp32 accumulator by atomics. Tiles in ``MMA_TILES`` (and the tables beside
  it). ``'auto'`` takes it for fp16/bf16 on sm_80+ at head dims 64 and 128 when q, k, v and
  grad_out rows are 16-byte aligned with unit d stride; everything else (fp32, other head dims,
  sm_61-sm_75, strided or unaligned rows) takes ``'simt'``. ``variant='mma'`` raises ValueError
  for a call it cannot take, saying why.

* variant ``'wgmma'`` (cuda_src/attention/flash_bwd_wgmma.cu, sm_90a, fp16/bf16, head dims 64
  and 128): the same algorithm on warpgroup MMA with the wgmma forward's structure (a producer
  warpgroup issuing TMA loads, two consumer warpgroups of 64 keys each; S^T and dP^T from shared
  memory, dV += P^T dO and dK += dS^T Q with P^T / dS^T in registers, dQ = dS K from a dS^T tile
  in shared memory, staged in shared memory and added with one bulk reduce-add per warpgroup
  and tile into a tile-major fp32 accumulator). Its own preprocess writes the statistics with
  rows padded to 64 and zeroes that accumulator; its own conversion writes dq. ``'auto'`` takes it
  on sm_90 for calls without attn_mask at the head dims in ``WGMMA_AUTO_DIMS`` (64 and 128:
  measured faster than 'mma') whose q, k, v, grad_out TMA can describe;
  ``variant='wgmma'`` raises ValueError for a call it cannot take, saying why.

The launch arguments are a FlashBwdArgs struct (cuda_src/attention/flash_bwd.cuh), separate from
the forward's. Design notes, floors and predictions: benchmarks/notes_attention.md (backward,
and "Tensor-core backward").
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
VARIANTS = ("auto", "simt", "mma", "wgmma")

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

# Tensor-core kernel (flash_bwd_mma.cu): one module per 16-bit dtype, built for sm_80+ only.
# A tile is (warps, MT, BR, stages, min blocks per SM): a block owns BC = 16 MT warps keys (each
# warp 16 MT of them, its dK and dV in registers) and walks the query tiles of BR rows; stages 2:
# Q, dO (and their lse, D) double-buffered, loaded a whole tile ahead; 1: loaded during dQ.
# Chosen for no spills (ptxas -v, NVRTC 12.9, sm_80/86/90) at the largest tile: 16 keys x 64
# queries per warp is FlashAttention-2's per-warp register budget at D = 128 (dK, dV: 128
# registers; S^T, dP^T: 64); BR = 128 (FA2's D = 64 tile) spills here (~200 bytes);
# benchmarks/notes_attention.md, "Tensor-core backward".
# Run 31 (H100, bf16, fwd+bwd vs SDPA FLASH): D = 128 (8, 1, 64, 2, 1) 0.87x non-causal, 1.04x
# causal (BR = 32: 0.78x / 0.91x); D = 64 causal (4, 2, 32, 2, 1) 1.11x, (8, 1, 64, 2, 1) 0.98x,
# (4, 1, 64, 2, 2) 0.99x.
MMA_TILES = {64: (4, 2, 32, 2, 1), 128: (8, 1, 64, 2, 1)}
# Calls with an attn_mask take an instantiation with the mask code compiled in (MASK = true) and,
# where the default tile has no registers to spare (D = 128: 255 registers, 20 bytes of spills
# with the mask code), a lighter one (BR = 32; D = 64: the 32-keys-per-warp default spills 8
# bytes with the mask code on sm_80, f16, so masked calls keep 16 keys per warp).
MMA_MASK_TILES = {64: (8, 1, 64, 2, 1), 128: (8, 1, 32, 2, 1)}
# Devices whose blocks cannot have the default tile's shared memory (sm_86/89: 99 KB; the default
# D = 128 tile needs 145 KB): this tile (D = 128: 88 KB), masked calls too.
MMA_SMALL_TILES = {128: (8, 1, 32, 1, 1)}
# Compiled too, so one GPU session can time them against MMA_TILES
# (benchmarks/experiments/attention_bwd_mma.py --tiles; swap one in with MMA_TILES[d] = cfg):
# D = 64: 32 keys per warp (half the Q / dO shared-memory reads per FLOP), and 4-warp blocks
# two per SM (BC = 64: twice the dQ atomics); D = 128: BR = 32 (the mask tile, unmasked).
MMA_ALTERNATES = {64: ((8, 1, 64, 2, 1), (4, 1, 64, 2, 2)), 128: ((8, 1, 32, 2, 1),)}
_MMA_ARCHS = ("80", "86", "89", "90")
_SHORT = {dt.float16: "f16", dt.bfloat16: "bf16"}


def mma_expr(dtype, d: int, cfg, masked: bool = False) -> str:
    warps, mt, br, stages, minb = cfg
    return (f"gpuops::flash_bwd_mma<{dtype.ctype}, {d}, {warps}, {mt}, {br}, {stages}, {minb}, "
            f"{_B[masked]}>")


def prep_vec_expr(dtype, d: int) -> str:
    return f"gpuops::flash_bwd_prep_vec<{dtype.ctype}, {d}>"


def convert_vec_expr(dtype, d: int) -> str:
    return f"gpuops::flash_bwd_dq_convert_vec<{dtype.ctype}, {d}>"


def mma_smem(d: int, cfg) -> int:
    """Bytes of dynamic shared memory: K, V [BC][D] and dS^T [BC][BR] in the 16-bit dtype, and per
    stage Q, dO [BR][D] (16-bit) and lse2, D [BR] (fp32)."""
    warps, mt, br, stages = cfg[:4]
    bc = 16 * mt * warps
    return 4 * bc * d + 2 * bc * br + stages * (4 * br * d + 8 * br)


def mma_candidates(d: int, masked: bool) -> list:
    """The tiles a call may take, best first (the host takes the first that fits the device)."""
    first = MMA_MASK_TILES.get(d, MMA_TILES[d]) if masked else MMA_TILES[d]
    return [first] + ([MMA_SMALL_TILES[d]] if d in MMA_SMALL_TILES else [])


def mma_config(d: int, masked: bool, limit: int):
    """The tile of a call on a device whose blocks may use ``limit`` bytes of shared memory, or
    None (no tensor-core tile fits)."""
    for cfg in mma_candidates(d, masked):
        if mma_smem(d, cfg) <= limit:
            return cfg
    return None


def _mma_exprs(dtype):
    out = []
    for d in MMA_TILES:
        for masked in (False, True):
            out += [mma_expr(dtype, d, cfg, masked) for cfg in mma_candidates(d, masked)]
        out += [mma_expr(dtype, d, cfg) for cfg in MMA_ALTERNATES.get(d, ())]
        out += [prep_vec_expr(dtype, d), convert_vec_expr(dtype, d)]
    return list(dict.fromkeys(out))


MMA_MODULES = {
    dtype: KernelModule(f"attention.flash_bwd_mma_{short}", "attention/flash_bwd_mma.cu",
                        dict.fromkeys(_mma_exprs(dtype), FLASH_BWD_ARGS), archs=_MMA_ARCHS)
    for dtype, short in _SHORT.items()}
_MMA_KERNELS = {dtype: lay.KernelTable(m) for dtype, m in MMA_MODULES.items()}

for _d in MMA_TILES:
    for _cfg in (*mma_candidates(_d, False), *mma_candidates(_d, True),
                 *MMA_ALTERNATES.get(_d, ())):
        assert mma_smem(_d, _cfg) <= 227 * 1024, (_d, _cfg)       # sm_90 opt-in limit
    for _masked in (False, True):
        assert mma_smem(_d, mma_candidates(_d, _masked)[-1]) <= 99 * 1024   # sm_86/89


# Hopper kernel (flash_bwd_wgmma.cu, sm_90a): a producer warpgroup (TMA) and two consumer
# warpgroups of 64 keys each, 128 keys per block, query tiles of 64 rows; four tensor maps (q,
# k, v, grad_out as 4-D [B, H, S, D]) and FlashBwdArgs. Its own preprocess writes the statistics
# with rows padded to a multiple of WGMMA_BR (one aligned bulk copy per tile) and zeroes a
# tile-major fp32 dq accumulator (one bulk reduce-add per warpgroup and tile), which its own
# conversion turns into dq. Tile and shared memory mirror the kernel's kWgbBC / kWgbBR /
# WgbLayout.
WGMMA_DIMS = (64, 128)
WGMMA_THREADS, WGMMA_BC, WGMMA_BR, WGMMA_STAGES = 384, 128, 64, 2
WGMMA_ARGS = ArgSpec("tensormap", "tensormap", "tensormap", "tensormap", FLASH_BWD_ARGS.params[0])
# False keeps 'auto' on 'mma' on sm_90 (A/B switch of benchmarks/experiments)
WGMMA_AUTO = True
# The two consumer warpgroups take turns issuing their S^T / dP^T products (the kernel's
# PINGPONG; False: both issue when ready, run 44-47's schedule).
WGMMA_PINGPONG = True
# Head dims 'auto' takes it for. Run 45 (H100, bf16, dq by bulk reduce-add): B2 H16 S4096
# D = 128 1.69x / 1.72x SDPA FLASH (non-causal / causal; 'mma' 0.85x / 0.94x); B4 H16 S2048
# D = 64 causal 0.361 ms against 'mma' (4, 2, 32, 2, 1) 0.428 ms (run 44, dq by fp32 atomics:
# 0.441 ms, when D = 64 stayed on 'mma').
WGMMA_AUTO_DIMS = (64, 128)


def wgmma_smem(d: int) -> int:
    """Bytes of dynamic shared memory: K, V [128][D], per stage Q, dO [64][D] (16-bit), two dS^T
    buffers [128][64], two dQ partials [64][64] (fp32), per stage lse2 and D [64] (fp32),
    5 mbarriers, 1 KiB of alignment slack."""
    kv = 2 * WGMMA_BC * d * 2
    stage = 2 * WGMMA_BR * d * 2 + 2 * WGMMA_BR * 4
    ds, dq = 2 * WGMMA_BC * WGMMA_BR * 2, 2 * 64 * 64 * 4
    return kv + WGMMA_STAGES * stage + ds + dq + (1 + 2 * WGMMA_STAGES) * 8 + 1024


def wgmma_expr(dtype, d: int, probe: int = 0, pingpong: bool | None = None) -> str:
    """pingpong: the turn-taking schedule (None: WGMMA_PINGPONG). probe != 0: a timing probe of
    benchmarks/experiments/attention_bwd_wgmma_probe.py (not compiled into the module; wrong
    results by design)."""
    pp = WGMMA_PINGPONG if pingpong is None else pingpong
    return f"gpuops::flash_bwd_wgmma<{dtype.ctype}, {d}, {_B[bool(pp)]}, {probe}>"


def wgmma_prep_expr(dtype, d: int) -> str:
    return f"gpuops::flash_bwd_wgmma_prep<{dtype.ctype}, {d}>"


def wgmma_convert_expr(dtype, d: int) -> str:
    return f"gpuops::flash_bwd_wgmma_dq_convert<{dtype.ctype}, {d}>"


WGMMA_MODULES = {
    dtype: KernelModule(f"attention.flash_bwd_wgmma_{short}", "attention/flash_bwd_wgmma.cu",
                        {**{wgmma_expr(dtype, d, 0, pp): WGMMA_ARGS for d in WGMMA_DIMS
                            for pp in (False, True)},
                         **{f(dtype, d): FLASH_BWD_ARGS for d in WGMMA_DIMS
                            for f in (wgmma_prep_expr, wgmma_convert_expr)}},
                        archs=("90a",))
    for dtype, short in _SHORT.items()}
_WGMMA_KERNELS = {dtype: lay.KernelTable(m) for dtype, m in WGMMA_MODULES.items()}
for _d in WGMMA_DIMS:
    assert wgmma_smem(_d) <= 227 * 1024, _d


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


def _launch_args(p, grad_out, query, key, value, output, lse, attn_mask, mask_kind, dq, dk, dv,
                 acc, stats, layout, vec) -> tuple:
    """The fields of FlashBwdArgs (cuda_src/attention/flash_bwd.cuh), flat and in the struct's
    order (FLASH_BWD_ARGS). acc: the fp32 dq accumulator ('bhsd' workspace, or dq itself)."""
    acc_strides = fwd._bhsd_strides(acc, layout) if acc is dq else tuple(acc.strides)
    return (query.ptr, key.ptr, value.ptr, output.ptr, grad_out.ptr, lse.ptr,
            attn_mask.ptr if attn_mask is not None else 0, dq.ptr, dk.ptr, dv.ptr, acc.ptr,
            stats.ptr if stats is not None else 0,
            *fwd._bhsd_strides(query, layout), *fwd._bhsd_strides(key, layout),
            *fwd._bhsd_strides(value, layout), *fwd._bhsd_strides(output, layout),
            *fwd._bhsd_strides(grad_out, layout),
            *(fwd._mask_strides(attn_mask) if attn_mask is not None else fwd._NULL_STRIDES),
            *fwd._bhsd_strides(dq, layout), *fwd._bhsd_strides(dk, layout),
            *fwd._bhsd_strides(dv, layout), *acc_strides, *tuple(lse.strides),
            p.B, p.Hq, p.group, p.Sq, p.Sk, p.D, p.left, p.right, mask_kind, vec, p.scale,
            p.scale * math.log2(math.e))


def _workspaces(call, p, dq, layout):
    """(fp32 dq accumulator, vec bit 1 if its rows suit 16-byte reductions, stats [2 B Hq Sq]):
    the accumulator is dq itself for fp32 storage; the preprocess kernel zeroes it."""
    rows = p.B * p.Hq * p.Sq
    stats = call.empty((2 * rows,), dt.float32) if rows else None
    if call.result_dtype is dt.float32:
        return dq, (2 if _aligned_rows(dq, layout, p.D) else 0), stats
    acc = call.empty((p.B, p.Hq, p.Sq, p.D), dt.float32)
    return acc, (2 if _aligned_rows(acc, "bhsd", p.D) else 0), stats


def _launch_prep(call, p, args):
    rows = p.B * p.Hq * p.Sq
    if rows:
        _KERNELS.get(call.device, prep_expr(call.result_dtype)).launch(
            (-(-rows // 4), 1, 1), (PREP_THREADS, 1, 1), call.stream, *args)


def _launch_convert(call, p, args):
    rows = p.B * p.Hq * p.Sq
    if rows and call.result_dtype is not dt.float32:
        _KERNELS.get(call.device, convert_expr(call.result_dtype)).launch(
            (-(-rows // 4), 1, 1), (PREP_THREADS, 1, 1), call.stream, *args)


def _check_grid(grid):
    if grid[0] >= 2**31 or grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"gpuops.{OP}: too large for one launch (batch x kv heads = {grid[0]}, "
                         f"key tiles = {grid[1]}, head-dim chunks = {grid[2]})")


def _launch_simt(call, p, grad_out, query, key, value, output, lse, attn_mask, mask_kind, dq, dk,
                 dv, layout):
    dev, dtype = call.device, call.result_dtype
    d, br, bc, nt, general = simt_config(p.D, fwd.smem_limit(dev))
    nz = -(-p.D // d) if general else 1
    grid = (p.B * p.Hkv, -(-p.Sk // bc), nz)
    _check_grid(grid)
    # fp32 workspace: D_i and lse * log2(e) per query row; the dq accumulator (dq itself for
    # fp32 storage), zeroed by the preprocess kernel
    acc, acc_vec, stats = _workspaces(call, p, dq, layout)
    q_shape, kv_shape = (p.B, p.Hq, p.Sq, p.D), (p.B, p.Hkv, p.Sk, p.D)
    vec = (not general and fwd._vec_ok(query, layout, q_shape)
           and fwd._vec_ok(grad_out, layout, q_shape) and fwd._vec_ok(key, layout, kv_shape)
           and fwd._vec_ok(value, layout, kv_shape))
    args = _launch_args(p, grad_out, query, key, value, output, lse, attn_mask, mask_kind, dq, dk,
                        dv, acc, stats, layout, int(vec) | acc_vec)
    _launch_prep(call, p, args)
    if grid[1]:
        _KERNELS.get(dev, dkdv_expr(dtype, d, br, bc, nt, general)).launch(
            grid, (nt, 1, 1), call.stream, *args, smem=bwd_smem(d, br, bc))
    _launch_convert(call, p, args)


def _pair_stores_ok(dk, dv, layout) -> bool:
    """dk / dv rows take the tensor-core kernels' 32-bit stores of element pairs: unit head-dim
    stride, 4-byte aligned base, even strides (empty tensors are never written)."""
    for t in (dk, dv):
        st = fwd._bhsd_strides(t, layout)
        if t.numel and (st[3] != 1 or t.ptr % 4 or any(x % 2 for x in st[:3])):
            return False
    return True


def mma_unsupported(call, p, grad_out, query, key, value, dk, dv, layout, mask_kind):
    """Why the tensor-core kernel cannot take the call, or None if it can: fp16/bf16, a head dim
    in MMA_TILES, sm_80+, query / key / value / grad_out rows 16-byte aligned with unit d stride
    (cp.async), dk / dv rows with unit d stride and even strides (pair stores), and a tile that
    fits the device's shared memory."""
    dtype = call.result_dtype
    if dtype not in _MMA_KERNELS:
        return f"it takes float16 / bfloat16, not {dtype}"
    if p.D not in MMA_TILES:
        return f"head dim {p.D} has no tensor-core tile (head dims {sorted(MMA_TILES)})"
    q_shape, kv_shape = (p.B, p.Hq, p.Sq, p.D), (p.B, p.Hkv, p.Sk, p.D)
    for name, t, shape in (("query", query, q_shape), ("grad_out", grad_out, q_shape),
                           ("key", key, kv_shape), ("value", value, kv_shape)):
        if fwd._bhsd_strides(t, layout)[3] != 1 or not fwd._vec_ok(t, layout, shape):
            return (f"{name!r} rows are not 16-byte aligned with unit head-dim stride "
                    "(contiguous tensors are)")
    if not _pair_stores_ok(dk, dv, layout):
        return "the outputs' rows are not 4-byte aligned"           # call.empty: never
    if not fwd.tensor_cores(call.device):
        return "it needs a GPU of compute capability 8.0 or newer (mma.sync)"
    if mma_config(p.D, mask_kind != 0, fwd.smem_limit(call.device)) is None:
        return "no tensor-core tile fits the device's shared memory"
    return None


def _launch_mma(call, p, grad_out, query, key, value, output, lse, attn_mask, mask_kind, dq, dk,
                dv, layout):
    dev, dtype = call.device, call.result_dtype
    masked = mask_kind != 0
    cfg = mma_config(p.D, masked, fwd.smem_limit(dev))
    warps, mt = cfg[:2]
    grid = (p.B * p.Hkv, -(-p.Sk // (16 * mt * warps)), 1)
    _check_grid(grid)
    acc, acc_vec, stats = _workspaces(call, p, dq, layout)
    args = _launch_args(p, grad_out, query, key, value, output, lse, attn_mask, mask_kind, dq, dk,
                        dv, acc, stats, layout, 1 | acc_vec)
    # preprocess / conversion with 16-byte accesses where output / dq rows allow (dq_acc: the
    # dense workspace, aligned when acc_vec)
    q_shape, rows = (p.B, p.Hq, p.Sq, p.D), p.B * p.Hq * p.Sq
    grid_rows = (-(-rows // (128 // (p.D // 8))), 1, 1)
    kernels = _MMA_KERNELS[dtype]
    if rows and acc_vec and fwd._vec_ok(output, layout, q_shape):
        kernels.get(dev, prep_vec_expr(dtype, p.D)).launch(grid_rows, (128, 1, 1), call.stream,
                                                           *args)
    else:
        _launch_prep(call, p, args)
    if grid[1]:
        kernels.get(dev, mma_expr(dtype, p.D, cfg, masked)).launch(
            grid, (32 * warps, 1, 1), call.stream, *args, smem=mma_smem(p.D, cfg))
    if rows and acc_vec and fwd._vec_ok(dq, layout, q_shape):
        kernels.get(dev, convert_vec_expr(dtype, p.D)).launch(grid_rows, (128, 1, 1),
                                                              call.stream, *args)
    else:
        _launch_convert(call, p, args)


def _launch_best(call, p, grad_out, query, key, value, output, lse, attn_mask, mask_kind, dq, dk,
                 dv, layout):
    """'auto': the tensor-core kernel where it applies, else the SIMT kernels."""
    use_mma = mma_unsupported(call, p, grad_out, query, key, value, dk, dv, layout,
                              mask_kind) is None
    (_launch_mma if use_mma else _launch_simt)(call, p, grad_out, query, key, value, output, lse,
                                               attn_mask, mask_kind, dq, dk, dv, layout)


def _launch_mma_only(call, p, grad_out, query, key, value, output, lse, attn_mask, mask_kind, dq,
                     dk, dv, layout):
    """variant='mma': the tensor-core kernel, or an error saying why it cannot take the call."""
    why = mma_unsupported(call, p, grad_out, query, key, value, dk, dv, layout, mask_kind)
    if why is not None:
        raise ValueError(f"gpuops.{OP}: variant='mma' cannot take this call: {why}; "
                         "variant='auto' falls back to 'simt'")
    _launch_mma(call, p, grad_out, query, key, value, output, lse, attn_mask, mask_kind, dq, dk,
                dv, layout)


def wgmma_unsupported(call, p, output, dk, dv, layout, mask_kind):
    """Why the Hopper kernel cannot take the call (a phrase), or None. What TMA can describe (q,
    k, v, grad_out) is checked later, in _wgmma_maps."""
    dtype = call.result_dtype
    if dtype not in _WGMMA_KERNELS:
        return f"dtype {dtype} (float16 and bfloat16 only)"
    if p.D not in WGMMA_DIMS:
        return f"head dim {p.D} (only {list(WGMMA_DIMS)})"
    if mask_kind != 0:
        return "an attn_mask"
    if p.Sq == 0 or p.Sk == 0:
        return "an empty sequence"
    if p.B * p.Hkv * -(-p.Sk // WGMMA_BC) >= 2 ** 31:
        return f"{p.B * p.Hkv} x {p.Sk} keys (grid: below 2^31 blocks of {WGMMA_BC} keys)"
    if not fwd._vec_ok(output, layout, (p.B, p.Hq, p.Sq, p.D)):
        return "'output' rows that are not 16-byte aligned with unit head-dim stride"
    if not _pair_stores_ok(dk, dv, layout):
        return "the outputs' rows are not 4-byte aligned"           # call.empty: never
    if not fwd.wgmma_device(call.device):
        return "this device (sm_90 only)"
    return None


def _wgmma_maps(p, query, key, value, grad_out, layout):
    """Tensor maps of q, k, v and grad_out, or None where one of them cannot be described."""
    maps = (fwd._tma_map(query, layout, (p.B, p.Hq, p.Sq, p.D), WGMMA_BR),
            fwd._tma_map(key, layout, (p.B, p.Hkv, p.Sk, p.D), WGMMA_BC),
            fwd._tma_map(value, layout, (p.B, p.Hkv, p.Sk, p.D), WGMMA_BC),
            fwd._tma_map(grad_out, layout, (p.B, p.Hq, p.Sq, p.D), WGMMA_BR))
    return None if any(m is None for m in maps) else maps


def _launch_wgmma_maps(call, p, grad_out, query, key, value, output, lse, dq, dk, dv, layout,
                       maps):
    dev, dtype = call.device, call.result_dtype
    # fp32 workspaces, rows padded to WGMMA_BR: the statistics (flash_bwd_wgmma_prep writes D = 0,
    # lse2 = +inf past Sq) and the tile-major dq accumulator (zeroed by the same kernel)
    seq_pad = -(-p.Sq // WGMMA_BR) * WGMMA_BR
    rows_pad = p.B * p.Hq * seq_pad
    stats = call.empty((2 * rows_pad,), dt.float32)
    acc = call.empty((p.B, p.Hq, seq_pad, p.D), dt.float32)
    if stats.ptr % 16 or acc.ptr % 16:
        raise RuntimeError(f"gpuops.{OP}: the framework returned workspaces that are not "
                           "16-byte aligned")
    if not fwd._vec_ok(dq, layout, (p.B, p.Hq, p.Sq, p.D)):
        raise RuntimeError(f"gpuops.{OP}: dq rows are not 16-byte aligned")   # call.empty: never
    args = _launch_args(p, grad_out, query, key, value, output, lse, None, 0, dq, dk, dv, acc,
                        stats, layout, 3)
    kernels = _WGMMA_KERNELS[dtype]
    per_block = 128 // (p.D // 8)            # rows per 128-thread block of prep / conversion
    kernels.get(dev, wgmma_prep_expr(dtype, p.D)).launch(
        (-(-rows_pad // per_block), 1, 1), (128, 1, 1), call.stream, *args)
    kernels.get(dev, wgmma_expr(dtype, p.D)).launch(
        (p.B * p.Hkv * -(-p.Sk // WGMMA_BC), 1, 1), (WGMMA_THREADS, 1, 1), call.stream, *maps,
        *args, smem=wgmma_smem(p.D))
    kernels.get(dev, wgmma_convert_expr(dtype, p.D)).launch(
        (-(-(p.B * p.Hq * p.Sq) // per_block), 1, 1), (128, 1, 1), call.stream, *args)


def _wgmma_plan(call, p, grad_out, query, key, value, output, dk, dv, layout, mask_kind):
    """(None, tensor maps) when the Hopper kernel takes the call, else (why, None)."""
    why = wgmma_unsupported(call, p, output, dk, dv, layout, mask_kind)
    if why:
        return why, None
    maps = _wgmma_maps(p, query, key, value, grad_out, layout)
    if maps is None:
        return ("q, k, v or grad_out in a layout TMA cannot read (unit head-dim stride, 16-byte "
                "aligned base and strides needed)"), None
    return None, maps


def _launch_wgmma(call, p, grad_out, query, key, value, output, lse, attn_mask, mask_kind, dq, dk,
                  dv, layout):
    """variant='wgmma': the Hopper kernel, or an error saying why it cannot take the call."""
    why, maps = _wgmma_plan(call, p, grad_out, query, key, value, output, dk, dv, layout,
                            mask_kind)
    if why:
        raise ValueError(f"gpuops.{OP}: variant='wgmma' does not take {why}; use "
                         "variant='auto'")
    _launch_wgmma_maps(call, p, grad_out, query, key, value, output, lse, dq, dk, dv, layout,
                       maps)


def _launch_auto(call, p, grad_out, query, key, value, output, lse, attn_mask, mask_kind, dq, dk,
                 dv, layout):
    """'auto': the Hopper kernel where it applies (sm_90, WGMMA_AUTO), else as 'mma' / 'simt'."""
    if WGMMA_AUTO and p.D in WGMMA_AUTO_DIMS:
        why, maps = _wgmma_plan(call, p, grad_out, query, key, value, output, dk, dv, layout,
                                mask_kind)
        if why is None:
            _launch_wgmma_maps(call, p, grad_out, query, key, value, output, lse, dq, dk, dv,
                               layout, maps)
            return
    _launch_best(call, p, grad_out, query, key, value, output, lse, attn_mask, mask_kind, dq, dk,
                 dv, layout)


_VARIANTS = {"auto": _launch_auto, "simt": _launch_simt, "mma": _launch_mma_only,
             "wgmma": _launch_wgmma}


# ---------------------------------------------------------------------------------------------
# Benchmark: B = 4, H = 32, S = 4096, D = 128 (bf16), causal and not. Ours: the backward alone
# (its inputs made by gpuops' forward). Peers: torch's FlashAttention-2 and cuDNN backward
# kernels (the aten ops behind SDPA's autograd, fed by their own forward once per input set),
# and torch SDPA forward + backward through autograd for scale. FLOPs: 2.5 x the forward's
# (FlashAttention's convention: the five tile products of the backward against the forward's
# two), halved for causal. Bench shape (B, H, S, D, causal[, variant]): the optional sixth entry
# picks ours, an index into BENCH_VARIANTS (`--shape 2,16,4096,128,1,2` times 'simt'; 'auto' is
# 'mma' on sm_80+ for fp16/bf16 at head dims 64 and 128). Peer `gpuops_fwd_bwd`: gpuops' forward
# + this backward (the time to compare with `sdpa_fwd_bwd_autograd`; FLOP/s against this op's
# FLOPs, so its TFLOP/s column is not the fwd+bwd rate).
BENCH_VARIANTS = ("auto", "mma", "simt")


def _bench_make(shape, d, randn):
    B, H, S, D, causal = shape[:5]
    q, k, v, g = (randn((B, H, S, D), d) for _ in range(4))
    out, lse = fwd.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), return_lse=True)
    kwargs = {"variant": BENCH_VARIANTS[shape[5]]} if len(shape) > 5 else {}
    return (g, q, k, v, out, lse, None, bool(causal)), kwargs


_TORCH_FWD: dict = {}


def _torch_aten_backward(kind):
    def fn(g, q, k, v, out, lse, attn_mask=None, is_causal=False, variant=None):
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


def _bench_fwd_bwd(g, q, k, v, out, lse, attn_mask=None, is_causal=False, variant=None):
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415,N812
    qr, kr, vr = (x.detach().requires_grad_() for x in (q, k, v))
    o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=bool(is_causal))
    return torch.autograd.grad(o, (qr, kr, vr), g)


def _bench_gpuops_fwd_bwd(g, q, k, v, out, lse, attn_mask=None, is_causal=False, variant="auto"):
    o, lse2 = fwd.scaled_dot_product_attention(q, k, v, is_causal=bool(is_causal),
                                                return_lse=True)
    return scaled_dot_product_attention_backward(g, q, k, v, o, lse2, is_causal=bool(is_causal),
                                                 variant=variant)


def _bench_peers():
    return {"sdpa_cudnn_bwd": _torch_aten_backward("cudnn"),
            "sdpa_fwd_bwd_autograd": _bench_fwd_bwd,
            "gpuops_fwd_bwd": _bench_gpuops_fwd_bwd}


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
    check_shape=lambda s: (1, 2, min(s[2], 1024), *s[3:]),
    # issue 5's comparison shapes (benchmarks/experiments/attention_bwd_mma.py times them too)
    extra_shapes=((4, 32, 4096, 128, 1), (2, 16, 4096, 128, 0), (2, 16, 4096, 128, 1),
                  (4, 16, 2048, 64, 1)))


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
    * ``variant``: 'auto', 'wgmma', 'mma' or 'simt'. 'simt': FlashAttention-2's backward in
      fp32 on CUDA cores, every arch from sm_61, any head dim, dtype and strides. 'mma': the
      same algorithm on tensor cores (sm_80+, float16/bfloat16, head dims 64 and 128,
      q/k/v/grad_out rows 16-byte aligned with unit head-dim stride; P and dS are rounded to
      the input dtype before the products that take them, as FlashAttention-2 does, everything
      else accumulates in fp32). 'wgmma': the same on Hopper's warpgroup MMA (sm_90,
      float16/bfloat16, head dims 64 and 128, no attn_mask, q/k/v/grad_out that TMA can read:
      unit head-dim stride, 16-byte aligned base and strides). 'mma' and 'wgmma' raise
      ValueError for a call they cannot take, saying why. 'auto': 'wgmma' where it applies,
      else 'mma' where it applies, else 'simt'. All recompute S and P per tile
      from ``lse`` (never stored) and accumulate dq with fp32 atomic adds ('wgmma': bulk
      reduce-adds of whole tiles), so dq may differ in the last bits from run to run, as with
      FlashAttention-2; dk and dv are deterministic.

    fp32 math for fp16/bf16/fp32 storage. Workspace: fp32 dq [B, Hq, Sq, D] (none for fp32)
    and 2 x B Hq Sq floats. For autograd use ``gpuops.torch.scaled_dot_product_attention``.
    """
    return _backward(call, grad_out, query, key, value, output, lse, attn_mask, is_causal,
                     scale, enable_gqa, window_size, layout, variant)
