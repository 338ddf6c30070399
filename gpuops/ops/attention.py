"""Attention: ``scaled_dot_product_attention`` (flash forward).

Kernels (cuda_src/attention/flash_fwd.cu), fp32 math for fp32/fp16/bf16 storage:

* variant ``'simt'``: a FlashAttention-2-style tiled forward on CUDA cores (sm_61 and up). A block
  of 128 threads per (batch x head, BR query rows), K/V tiles of BC rows through shared memory,
  online softmax in the log2 domain, the BR x D output in registers; the S x S matrix is never
  formed. Head dims 32/64/96/128 have their own instantiations (two tile sizes each: one within
  the 48 KB every arch has, one larger where the device lets a block opt in to more shared
  memory); any other head dim goes through the general instantiation, which loops over the head
  dim in chunks of 32 and gives each block 32 output columns (scores recomputed per chunk).
* variant ``'mma'`` (cuda_src/attention/flash_fwd_mma.cu, sm_80+, fp16/bf16): FlashAttention-2's
  forward on tensor cores (mma.sync m16n8k16, fp32 accumulators): Q fragments in registers, K/V
  tiles through XOR-swizzled shared memory by cp.async (V_j loads during Q K_j^T, K_{j+1} during
  P V_j), online softmax on the accumulator fragments, P reused in registers as the A operand of
  P V. Head dims in ``MMA_TILES`` (32, 64, 96, 128, 256) with q, k, v (and out) rows 16-byte
  aligned with unit d stride; anything else takes the SIMT kernel. ``'auto'`` = ``'mma'`` where
  it applies, else ``'simt'``.
* ``'wgmma'`` (sm_90a, FlashAttention-3's schedule) is the next step.

Design notes, floors and predictions: benchmarks/notes_attention.md.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.ops import _layout as lay
from gpuops.ops.gemm import effective_arch
from gpuops.registry import register
from gpuops.runtime import device
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.tensor import Tensor

OP = "scaled_dot_product_attention"
LAYOUTS = ("bhsd", "bshd")
VARIANTS = ("auto", "simt", "mma")   # 'wgmma' (sm_90a): next step

# ---------------------------------------------------------------------------------------------
# Kernel module. One FlashFwdArgs struct per launch (cuda_src/attention/attn_common.cuh).

FLASH_ARGS = ArgSpec("6P20q9if")
FLASH_THREADS = 128                  # kFlashThreads
GENERAL_D, GENERAL_TILE = 32, (64, 64)
# head dim -> ((BR, BC) within 48 KB, (BR, BC) for devices that opt in to more shared memory)
FAST_TILES = {32: ((64, 64), (64, 64)), 64: ((64, 32), (64, 64)),
              96: ((64, 32), (64, 64)), 128: ((32, 32), (64, 64))}
_B = {True: "true", False: "false"}


def flash_smem(d: int, br: int, bc: int) -> int:
    """Bytes of dynamic shared memory: Q [BR][D+4], K/V [BC][D+4], P [BR][BC+4], fp32."""
    return 4 * (br * (d + 4) + bc * (d + 4) + br * (bc + 4))


def flash_expr(dtype, d: int, br: int, bc: int, general: bool) -> str:
    return f"gpuops::flash_fwd<{dtype.ctype}, {d}, {br}, {bc}, {_B[general]}>"


def _flash_kernels():
    out = {}
    for dtype in dt.FLOATS:
        for d, tiles in FAST_TILES.items():
            for br, bc in dict.fromkeys(tiles):
                out[flash_expr(dtype, d, br, bc, False)] = FLASH_ARGS
        out[flash_expr(dtype, GENERAL_D, *GENERAL_TILE, True)] = FLASH_ARGS
    return out


FLASH_MODULE = KernelModule("attention.flash_fwd", "attention/flash_fwd.cu", _flash_kernels())
_KERNELS = lay.KernelTable(FLASH_MODULE)

for _d, (_small, _big) in FAST_TILES.items():
    assert flash_smem(_d, *_small) <= 48 * 1024, (_d, _small)
assert flash_smem(GENERAL_D, *GENERAL_TILE) <= 48 * 1024

# Tensor-core kernel (flash_fwd_mma.cu): one module per 16-bit dtype, built for sm_80+ only.
# head dim -> (warps, m16 tiles per warp (MT), BC, Q fragments kept in registers, min blocks per
# SM for __launch_bounds__); BR = 16 * warps * MT. Chosen for no spills at the most blocks per SM
# (ptxas -v, NVRTC 12.9, sm_80/sm_90: D32 ~120 registers, D64 ~158, D96 ~220, D128 ~222,
# D256 255; benchmarks/notes_attention.md).
MMA_TILES = {32: (8, 1, 64, True, 2), 64: (4, 1, 64, True, 3), 96: (4, 1, 64, True, 2),
             128: (4, 1, 64, True, 2), 256: (4, 1, 64, False, 2)}
# Other schedules compiled too, so one GPU session can time them against MMA_TILES (swap one in
# with MMA_TILES[128] = MMA_ALTERNATES[128][i]): 8 warps x 16 rows (BR = 128: half the K/V
# traffic from L2 per FLOP, one block per SM), and FlashAttention-2's own 4 warps x 32 rows with
# Q re-read from shared memory (BC = 32 to stay within 255 registers).
MMA_ALTERNATES = {128: ((8, 1, 64, True, 1), (4, 2, 32, False, 2))}
_MMA_ARCHS = ("80", "86", "89", "90")
_SHORT = {dt.float16: "f16", dt.bfloat16: "bf16"}


def mma_expr(dtype, d: int, cfg) -> str:
    warps, mt, bc, qreg, minb = cfg
    return (f"gpuops::flash_fwd_mma<{dtype.ctype}, {d}, {warps}, {mt}, {bc}, {_B[qreg]}, "
            f"{minb}>")


def mma_smem(d: int, cfg) -> int:
    """Bytes of dynamic shared memory: Q [BR][D], K and V [BC][D] in the 16-bit storage dtype."""
    warps, mt, bc = cfg[:3]
    return (16 * warps * mt + 2 * bc) * d * 2


def _mma_configs():
    return [(d, (cfg, *MMA_ALTERNATES.get(d, ()))) for d, cfg in MMA_TILES.items()]


MMA_MODULES = {
    dtype: KernelModule(f"attention.flash_mma_{short}", "attention/flash_fwd_mma.cu",
                        {mma_expr(dtype, d, cfg): FLASH_ARGS
                         for d, cfgs in _mma_configs() for cfg in cfgs},
                        archs=_MMA_ARCHS)
    for dtype, short in _SHORT.items()}
_MMA_KERNELS = {dtype: lay.KernelTable(m) for dtype, m in MMA_MODULES.items()}

for _d, _cfgs in _mma_configs():
    for _cfg in _cfgs:
        assert mma_smem(_d, _cfg) <= 99 * 1024, (_d, _cfg)     # sm_86/89 opt-in limit (99 KB)

_smem_limits: dict = {}


def smem_limit(dev: int) -> int:
    """Dynamic shared memory one block may use on the device (opt-in limit; 48 KB if unknown)."""
    n = _smem_limits.get(dev)
    if n is None:
        n = _smem_limits[dev] = max(48 * 1024, device.device_info(dev).max_smem_per_block_optin)
    return n


def simt_config(d: int, limit: int):
    """(head-dim template D, BR, BC, general) of the SIMT kernel for head dim d."""
    if d in FAST_TILES:
        small, big = FAST_TILES[d]
        br, bc = big if flash_smem(d, *big) <= limit else small
        return d, br, bc, False
    return GENERAL_D, GENERAL_TILE[0], GENERAL_TILE[1], True


# ---------------------------------------------------------------------------------------------
# Arguments (shared by the GPU path and the reference, which is also the CPU fallback).

class Problem:
    __slots__ = ("B", "Hq", "Hkv", "Sq", "Sk", "D", "group", "scale", "left", "right")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_args(q_shape, k_shape, v_shape, m_shape, is_causal, scale, enable_gqa, window_size,
               return_lse, layout, variant) -> Problem:
    """Validate everything but dtypes; return the problem in the logical [B, H, S, D] order."""
    if layout not in LAYOUTS:
        raise ValueError(f"gpuops.{OP}: 'layout' must be one of {LAYOUTS}, got {layout!r}")
    if variant not in VARIANTS:
        raise ValueError(f"gpuops.{OP}: 'variant' must be one of {VARIANTS}, got {variant!r}")
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa),
                       ("return_lse", return_lse)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"gpuops.{OP}: {name!r} must be a bool, got {type(flag).__name__}")
    want = "[B, H, S, D]" if layout == "bhsd" else "[B, S, H, D]"
    shapes = {}
    for name, shape in (("query", q_shape), ("key", k_shape), ("value", v_shape)):
        shape = tuple(int(s) for s in shape)
        if len(shape) != 4:
            raise ValueError(f"gpuops.{OP}: {name!r} must be 4-d {want} (layout={layout!r}), got "
                             f"shape {shape}")
        shapes[name] = shape if layout == "bhsd" else (shape[0], shape[2], shape[1], shape[3])
    B, Hq, Sq, D = shapes["query"]
    Bk, Hkv, Sk, Dk = shapes["key"]
    if shapes["value"] != shapes["key"]:
        raise ValueError(f"gpuops.{OP}: 'value' has shape {tuple(v_shape)} but 'key' has "
                         f"{tuple(k_shape)}; they must match (a value head dim other than the "
                         "query's is not supported)")
    if Bk != B:
        raise ValueError(f"gpuops.{OP}: 'key' has batch {Bk} but 'query' has {B}; they must match")
    if Dk != D:
        raise ValueError(f"gpuops.{OP}: 'key' has head dim {Dk} but 'query' has {D}; they must "
                         "match")
    if D == 0:
        raise ValueError(f"gpuops.{OP}: 'query' has head dim 0; the softmax scale 1/sqrt(D) is "
                         "undefined")
    if Hkv != Hq:
        if not enable_gqa:
            raise ValueError(f"gpuops.{OP}: 'key' has {Hkv} heads but 'query' has {Hq}; pass "
                             "enable_gqa=True for grouped-query attention")
        if Hkv == 0 or Hq % Hkv:
            raise ValueError(f"gpuops.{OP}: 'query' heads ({Hq}) must be a multiple of 'key' heads "
                             f"({Hkv}) with enable_gqa=True")
    if m_shape is not None:
        m_shape = tuple(int(s) for s in m_shape)
        full = (B, Hq, Sq, Sk)
        if len(m_shape) > 4 or any(
                s not in (1, f) for s, f in zip(reversed(m_shape), reversed(full))):
            raise ValueError(f"gpuops.{OP}: 'attn_mask' has shape {m_shape}, which does not "
                             f"broadcast to [B, Hq, Sq, Sk] = {list(full)}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"gpuops.{OP}: 'scale' must be a float or None, got {type(scale).__name__}")
    left = right = -1
    if window_size is not None:
        if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
                or not all(_is_int(w) for w in window_size)):
            raise TypeError(f"gpuops.{OP}: 'window_size' must be None or a pair of ints "
                            f"(left, right), got {window_size!r}")
        left, right = (int(w) for w in window_size)
        if left < -1 or right < -1:
            raise ValueError(f"gpuops.{OP}: 'window_size' entries must be >= 0, or -1 for "
                             f"unbounded; got {tuple(window_size)}")
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    # bounds that every row satisfies anyway are unbounded (keeps the kernel's int math small)
    if left >= Sq:
        left = -1
    if right >= Sk:
        right = -1
    p = Problem()
    p.B, p.Hq, p.Hkv, p.Sq, p.Sk, p.D = B, Hq, Hkv, Sq, Sk, D
    p.group = Hq // Hkv if Hkv else 1
    p.scale, p.left, p.right = float(scale), left, right
    return p


# ---------------------------------------------------------------------------------------------
# The NumPy reference (float64): the textbook formula, head by head.

def visible(sq: int, sk: int, left: int, right: int) -> np.ndarray:
    """[sq, sk] bool: key j visible from query i (top-left aligned, as torch's is_causal)."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    ok = np.ones((sq, sk), bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def ref_scaled_dot_product_attention(query, key, value, attn_mask=None, is_causal=False,
                                     scale=None, enable_gqa=False, window_size=None,
                                     return_lse=False, layout="bhsd", variant="auto"):
    p = check_args(np.shape(query), np.shape(key), np.shape(value),
                   None if attn_mask is None else np.shape(attn_mask), is_causal, scale,
                   enable_gqa, window_size, return_lse, layout, variant)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (query, key, value))
    if layout == "bshd":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    mask = None
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        mask = np.broadcast_to(m.astype(bool) if m.dtype == bool else m.astype(np.float64),
                               (p.B, p.Hq, p.Sq, p.Sk))
    ok = visible(p.Sq, p.Sk, p.left, p.right)
    out = np.zeros((p.B, p.Hq, p.Sq, p.D))
    lse = np.full((p.B, p.Hq, p.Sq), -np.inf)
    with np.errstate(all="ignore"):
        for b in range(p.B):
            for h in range(p.Hq):
                s = (q[b, h] @ k[b, h // p.group].T) * p.scale
                if mask is not None:
                    s = np.where(mask[b, h], s, -np.inf) if mask.dtype == bool else s + mask[b, h]
                s = np.where(ok, s, -np.inf)
                if p.Sk == 0:
                    continue
                m = np.max(s, axis=1, keepdims=True)
                dead = np.isneginf(m)                  # no visible key: output 0, lse -inf
                e = np.exp(s - np.where(dead, 0.0, m))
                den = e.sum(axis=1, keepdims=True)
                out[b, h] = np.where(dead, 0.0, (e @ v[b, h // p.group]) / den)
                lse[b, h] = np.where(dead, -np.inf, m + np.log(den))[:, 0]
    if layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# GPU path.

def _bhsd_strides(t: Tensor, layout: str) -> tuple:
    s = tuple(t.strides)
    return s if layout == "bhsd" else (s[0], s[2], s[1], s[3])


def _mask_strides(m: Tensor) -> tuple:
    """Strides of the mask broadcast to [B, Hq, Sq, Sk] (0 where it broadcasts)."""
    shape = (1,) * (4 - len(m.shape)) + tuple(m.shape)
    strides = (0,) * (4 - len(m.strides)) + tuple(m.strides)
    return tuple(0 if n == 1 else st for n, st in zip(shape, strides))


_NULL_STRIDES = (0, 0, 0, 0)


def _vec_ok(t: Tensor, layout: str, shape: tuple) -> bool:
    """16-byte loads of whole rows: unit d stride, 16-byte aligned base and row starts."""
    n = 16 // t.dtype.itemsize
    st = _bhsd_strides(t, layout)
    return (t.ptr % 16 == 0 and (st[3] == 1 or shape[3] == 1) and shape[3] % n == 0
            and all(s % n == 0 or size == 1 for s, size in zip(st[:3], shape[:3])))


def _forward(call, query, key, value, attn_mask, is_causal, scale, enable_gqa, window_size,
             return_lse, layout, variant):
    p = check_args(query.shape, key.shape, value.shape,
                   None if attn_mask is None else attn_mask.shape, is_causal, scale, enable_gqa,
                   window_size, return_lse, layout, variant)
    dtype = call.result_dtype
    mask_kind = 0
    if attn_mask is not None:
        if attn_mask.dtype is dt.bool_:
            mask_kind = 1
        elif attn_mask.dtype is dtype:
            mask_kind = 2
        else:
            raise TypeError(f"gpuops.{OP}: 'attn_mask' has dtype {attn_mask.dtype}; expected bool "
                            f"or the query's dtype ({dtype})")
    out_shape = (p.B, p.Hq, p.Sq, p.D) if layout == "bhsd" else (p.B, p.Sq, p.Hq, p.D)
    out = call.empty(out_shape, dtype)
    lse = call.empty((p.B, p.Hq, p.Sq), dt.float32) if return_lse else None
    if out.numel:
        _VARIANTS[variant](call, p, query, key, value, attn_mask, mask_kind, out, lse, layout)
    return (out, lse) if return_lse else out


def flash_launch_args(p, query, key, value, attn_mask, mask_kind, out, lse, layout, vec) -> tuple:
    """The fields of FlashFwdArgs (attn_common.cuh) in order, as FLASH_ARGS packs them: one
    builder for every flash-forward variant."""
    return (query.ptr, key.ptr, value.ptr, attn_mask.ptr if attn_mask is not None else 0,
            out.ptr, lse.ptr if lse is not None else 0,
            *_bhsd_strides(query, layout), *_bhsd_strides(key, layout),
            *_bhsd_strides(value, layout), *_bhsd_strides(out, layout),
            *(_mask_strides(attn_mask) if attn_mask is not None else _NULL_STRIDES),
            p.Hq, p.group, p.Sq, p.Sk, p.D, p.left, p.right, mask_kind, int(vec),
            p.scale * math.log2(math.e))


def _check_grid(grid):
    if grid[0] >= 2**31 or grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"gpuops.{OP}: too large for one launch (batch x heads = {grid[0]}, "
                         f"query tiles = {grid[1]}, head-dim chunks = {grid[2]})")


def _launch_simt(call, p, query, key, value, attn_mask, mask_kind, out, lse, layout):
    dev = call.device
    d, br, bc, general = simt_config(p.D, smem_limit(dev))
    grid = (p.B * p.Hq, -(-p.Sq // br), -(-p.D // d) if general else 1)
    _check_grid(grid)
    kernel = _KERNELS.get(dev, flash_expr(call.result_dtype, d, br, bc, general))
    q_shape = (p.B, p.Hq, p.Sq, p.D)
    kv_shape = (p.B, p.Hkv, p.Sk, p.D)
    vec = not general and _vec_ok(query, layout, q_shape) and _vec_ok(key, layout, kv_shape) \
        and _vec_ok(value, layout, kv_shape)
    kernel.launch(grid, (FLASH_THREADS, 1, 1), call.stream,
                  *flash_launch_args(p, query, key, value, attn_mask, mask_kind, out, lse, layout,
                                     vec),
                  smem=flash_smem(d, br, bc))


def tensor_cores(dev: int) -> bool:
    """mma.sync/ldmatrix/cp.async available: sm_80+ (and not GPUOPS_ARCH asking for older)."""
    return effective_arch(dev) >= 80


def mma_applies(call, p, query, key, value, out, layout) -> bool:
    """The tensor-core kernel takes the call: fp16/bf16, sm_80+, a head dim in MMA_TILES, and
    16-byte aligned rows with unit d stride for q, k, v and out (cp.async / 16-byte stores)."""
    if call.result_dtype not in _MMA_KERNELS or p.D not in MMA_TILES:
        return False
    q_shape = (p.B, p.Hq, p.Sq, p.D)
    kv_shape = (p.B, p.Hkv, p.Sk, p.D)
    return (all(_bhsd_strides(t, layout)[3] == 1 for t in (query, key, value, out))
            and _vec_ok(query, layout, q_shape) and _vec_ok(key, layout, kv_shape)
            and _vec_ok(value, layout, kv_shape) and _vec_ok(out, layout, q_shape)
            and tensor_cores(call.device))


def _launch_mma(call, p, query, key, value, attn_mask, mask_kind, out, lse, layout):
    cfg = MMA_TILES[p.D]
    warps, mt = cfg[:2]
    grid = (p.B * p.Hq, -(-p.Sq // (16 * warps * mt)), 1)
    _check_grid(grid)
    kernel = _MMA_KERNELS[call.result_dtype].get(call.device, mma_expr(call.result_dtype, p.D, cfg))
    kernel.launch(grid, (32 * warps, 1, 1), call.stream,
                  *flash_launch_args(p, query, key, value, attn_mask, mask_kind, out, lse, layout,
                                     True),
                  smem=mma_smem(p.D, cfg))


def _launch_best(call, p, query, key, value, attn_mask, mask_kind, out, lse, layout):
    """'auto' and 'mma': the tensor-core kernel where it applies, else the SIMT kernel."""
    launch = _launch_mma if mma_applies(call, p, query, key, value, out, layout) else _launch_simt
    launch(call, p, query, key, value, attn_mask, mask_kind, out, lse, layout)


# 'auto' -> the best variant for the device and inputs ('wgmma' for sm_90a: next step).
_VARIANTS = {"auto": _launch_best, "simt": _launch_simt, "mma": _launch_best}


# ---------------------------------------------------------------------------------------------
# Benchmark: B = 1..4, H = 32, S = 4096, D = 128 (bf16), causal and not, against torch SDPA
# (its default backend, and the FLASH and CUDNN backends by name). The bench shape is
# (B, H, S, D, causal).

def _bench_make(shape, d, randn):
    B, H, S, D, causal = shape
    q, k, v = (randn((B, H, S, D), d) for _ in range(3))
    return (q, k, v, None, bool(causal)), {}


def _bench_torch(q, k, v, attn_mask=None, is_causal=False):
    import torch.nn.functional as F  # noqa: PLC0415,N812
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)


def _bench_peers():
    import torch.nn.functional as F  # noqa: PLC0415,N812
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    def peer(backend):
        def fn(q, k, v, attn_mask=None, is_causal=False):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                      is_causal=is_causal)
        return fn
    return {"sdpa_flash": peer(SDPBackend.FLASH_ATTENTION),
            "sdpa_cudnn": peer(SDPBackend.CUDNN_ATTENTION)}


def _bench_flops(args, out):
    q, k = args[0], args[1]
    B, H, Sq, D = q.shape
    f = 4 * B * H * Sq * k.shape[2] * D
    return f // 2 if args[4] else f


def _bench_bytes(args, out):
    item = args[0].element_size() if hasattr(args[0], "element_size") else args[0].itemsize
    return 4 * math.prod(args[0].shape) * item       # q, k, v read once, out written once


BENCH = BenchSpec(
    make_inputs=_bench_make, torch_fn=_bench_torch, extra_peers=_bench_peers,
    default_shape=lambda d: (4, 32, 4096, 128, 0), flops=_bench_flops, bytes_moved=_bench_bytes,
    check_shape=lambda s: (1, 2, min(s[2], 1024), s[3], s[4]),
    extra_shapes=((4, 32, 4096, 128, 1), (1, 32, 4096, 128, 0), (1, 32, 4096, 128, 1),
                  (2, 32, 4096, 128, 0), (2, 32, 4096, 128, 1)))


# ---------------------------------------------------------------------------------------------
# The op.

def _sdpa_result_dtype(values, found):
    # with return_lse: lse in float32 (as the kernel writes it), float64 for float64 input
    if not values.get("return_lse"):
        return None
    return (None, dt.stat_dtype(found.get("query")))


ref_scaled_dot_product_attention.result_dtype = _sdpa_result_dtype


@register(family="attention", reference=ref_scaled_dot_product_attention,
          param_dtypes={"attn_mask": (dt.bool_, dt.float32, dt.float16, dt.bfloat16, dt.float64)},
          bench=BENCH)
def scaled_dot_product_attention(call, query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Tensor | None = None, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False, *,
                                 window_size=None, return_lse: bool = False,
                                 layout: str = "bhsd", variant: str = "auto"):
    """softmax(q k^T * scale + mask) v, as ``torch.nn.functional.scaled_dot_product_attention``.

    ``query`` [B, Hq, Sq, D], ``key``/``value`` [B, Hkv, Sk, D] (``layout='bshd'``: [B, S, H, D]
    in and out, e.g. a projection's output without a transpose; any strides). Hkv == Hq, or
    ``enable_gqa=True`` with Hq a multiple of Hkv (query head h reads key/value head
    h // (Hq / Hkv)). The value head dim must equal the query's.

    * ``attn_mask``: bool (True = take part) or additive, of the query's dtype; broadcasts to
      [B, Hq, Sq, Sk]. ``scale``: default 1 / sqrt(D).
    * ``is_causal``: query i sees keys j <= i, aligned top-left as torch's ``is_causal``
      (also when Sq != Sk: with Sq < Sk the last keys are seen by no query; FlashAttention's
      bottom-right alignment is ``window_size=(-1, Sk - Sq)``). Combined with ``attn_mask``,
      both apply (torch's math backend does the same).
    * ``window_size=(left, right)``: query i sees keys i - left <= j <= i + right, -1 =
      unbounded (same alignment); with ``is_causal`` right is min(right, 0).
    * ``return_lse=True``: returns ``(out, lse)``, lse [B, Hq, Sq] float32 = log-sum-exp of the
      row's scaled, masked scores (natural log), as FlashAttention returns it. (On the CPU
      reference path lse has the inputs' dtype.)
    * A row that sees no key (fully masked, or outside every window) gives 0 and lse = -inf,
      as torch's math backend (its output there is 0 since torch 2.5); NaN in the inputs
      propagates as in torch.
    * ``variant``: 'auto' (the best kernel for the device and inputs), 'mma' or 'simt'.
      'mma': FlashAttention-2's forward on tensor cores (mma.sync, fp32 accumulators), taken
      for fp16/bf16 on sm_80+ when the head dim is 32, 64, 96, 128 or 256 and q, k, v rows are
      16-byte aligned with unit d stride (any 'bhsd'/'bshd' strides otherwise); the softmax
      probabilities are rounded to the input dtype for the P V product (as FlashAttention
      does: up to 2^-8 relative for bf16, 2^-11 for fp16, on top of the output's rounding).
      'simt': the FlashAttention-2-style tiled kernel in fp32 on CUDA cores, every arch from
      sm_61, any head dim, dtype and strides. 'auto' and 'mma' pick 'mma' where it applies and
      'simt' otherwise (fp32, sm_61/70/75, other head dims, unaligned rows).

    fp32 math (accumulation, softmax) for fp16/bf16/fp32 storage; exp is MUFU ``ex2`` of
    log2(e)-folded scores (relative error ~2e-7). Memory O(B H S D): the S x S matrix is never
    formed.
    """
    return _forward(call, query, key, value, attn_mask, is_causal, scale, enable_gqa,
                    window_size, return_lse, layout, variant)
