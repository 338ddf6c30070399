"""Attention: ``scaled_dot_product_attention``, ``varlen_attention``, ``block_sparse_attention``
(flash forward; RoPE of q and k fused into the loads of all three on request).

Kernels (cuda_src/attention/flash_fwd.cu), fp32 math for fp32/fp16/bf16 storage:

* variant ``'simt'``: a FlashAttention-2-style tiled forward on CUDA cores (sm_61 and up). A block
  of 128 threads per (batch x head, BR query rows), K/V tiles of BC rows through shared memory,
  online softmax in the log2 domain, the BR x D output in registers; the S x S matrix is never
  formed. Head dims 32/64/96/128 have their own instantiations (two tile sizes each: one within
  the 48 KB every arch has, one larger where the device lets a block opt in to more shared
  memory); any other head dim goes through the general instantiation, which loops over the head
  dim in chunks of 32 and gives each block 32 output columns (scores recomputed per chunk).
* variant ``'mma'`` (cuda_src/attention/flash_fwd_mma.cu, sm_80+, fp16/bf16): FlashAttention-2's
  forward on tensor cores (mma.sync m16n8k16, fp32 accumulators): Q fragments in registers or
  re-read from shared memory, K/V tiles through XOR-swizzled shared memory by cp.async (one stage:
  V_j loads during Q K_j^T, K_{j+1} during P V_j; two stages: tile j+1 during tile j), online
  softmax on the accumulator fragments, P reused in registers as the A operand of P V. Head dims in ``MMA_TILES`` (32, 64, 96, 128, 256) with q, k, v (and out) rows 16-byte
  aligned with unit d stride; anything else takes the SIMT kernel. ``'auto'`` = ``'mma'`` where
  it applies, else ``'simt'``.
* variant ``'wgmma'`` (cuda_src/attention/flash_fwd_wgmma.cu, sm_90a, fp16/bf16, head dims 64 and
  128): FlashAttention-3's structure: one producer warpgroup issues TMA loads of Q and of K/V
  tiles into a 2-stage mbarrier ring, two consumer warpgroups of 64 query rows run S = Q K^T and
  O += P V as warpgroup MMAs (P from registers), S of the next tile issued before P V of this
  one. Calls without attn_mask whose q, k, v and out TMA can describe, dense or block-sparse
  with block sizes that are multiples of 64 (a sparse instance in its own module,
  ``attention.flash_wgmma_sparse_{f16,bf16}``: the block walks the key tiles on for its rows);
  ``'auto'`` takes it on sm_90 where it applies (``WGMMA_AUTO``), else as ``'mma'``.

The three ops share the kernel and its one argument struct (FlashFwdArgs): packed sequences
(varlen), block sparsity and rotary tables are fields that are null / 0 when unused, filled by one
builder (``flash_launch_args``). 'simt' and 'mma' read them all (``_EXTRAS_VARIANTS``; 'wgmma'
reads only the block mask, and ``'auto'`` sends the other calls that use them to ``'mma'``). Block
sparsity is a template flag of the SIMT kernel, instantiated in its own module
(``attention.flash_fwd_sparse``) so the dense kernels keep their register budget; the mma kernel
likewise has EXTRAS bits (varlen, block sparsity, rotary) instantiated in
``attention.flash_mma_extras_{f16,bf16}`` (cuda_src/attention/flash_mma_extras.cuh); its fused
rotary rotates K once per call beforehand (``attention.rope_k``, cuda_src/attention/rope_k.cu)
and Q in the kernel (``PLAN["rotary"]``).

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
from gpuops.runtime import device, tma
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.tensor import Tensor

OP = "scaled_dot_product_attention"
VARLEN_OP = "varlen_attention"
SPARSE_OP = "block_sparse_attention"
LAYOUTS = ("bhsd", "bshd")
VARIANTS = ("auto", "simt", "mma", "wgmma")

# ---------------------------------------------------------------------------------------------
# Kernel module. One FlashFwdArgs struct per launch (cuda_src/attention/attn_common.cuh).

FLASH_ARGS = ArgSpec("6P20q9if5P11q6i")
FLASH_THREADS = 128                  # kFlashThreads
GENERAL_D, GENERAL_TILE = 32, (64, 64)
# head dim -> ((BR, BC) within 48 KB, (BR, BC) for devices that opt in to more shared memory)
FAST_TILES = {32: ((64, 64), (64, 64)), 64: ((64, 32), (64, 64)),
              96: ((64, 32), (64, 64)), 128: ((32, 32), (64, 64))}
_B = {True: "true", False: "false"}


def flash_smem(d: int, br: int, bc: int) -> int:
    """Bytes of dynamic shared memory: Q [BR][D+4], K/V [BC][D+4], P [BR][BC+4], fp32."""
    return 4 * (br * (d + 4) + bc * (d + 4) + br * (bc + 4))


def flash_expr(dtype, d: int, br: int, bc: int, general: bool, sparse: bool = False) -> str:
    """Name of a flash_fwd instantiation; sparse: the block-mask reading one (SPARSE = true)."""
    tail = ", true" if sparse else ""
    return f"gpuops::flash_fwd<{dtype.ctype}, {d}, {br}, {bc}, {_B[general]}{tail}>"


def _flash_kernels(sparse: bool = False):
    out = {}
    for dtype in dt.FLOATS:
        for d, tiles in FAST_TILES.items():
            for br, bc in dict.fromkeys(tiles):
                out[flash_expr(dtype, d, br, bc, False, sparse)] = FLASH_ARGS
        out[flash_expr(dtype, GENERAL_D, *GENERAL_TILE, True, sparse)] = FLASH_ARGS
    return out


FLASH_MODULE = KernelModule("attention.flash_fwd", "attention/flash_fwd.cu", _flash_kernels())
# The block-sparse instantiations of the same source: their own module, so that dense attention
# does not compile (or load) them, and they theirs only on first use.
FLASH_SPARSE_MODULE = KernelModule("attention.flash_fwd_sparse", "attention/flash_fwd.cu",
                                   _flash_kernels(sparse=True))
_KERNELS = lay.KernelTable(FLASH_MODULE)
_SPARSE_KERNELS = lay.KernelTable(FLASH_SPARSE_MODULE)

for _d, (_small, _big) in FAST_TILES.items():
    assert flash_smem(_d, *_small) <= 48 * 1024, (_d, _small)
assert flash_smem(GENERAL_D, *GENERAL_TILE) <= 48 * 1024

# Tensor-core kernel (flash_fwd_mma.cu): one module per 16-bit dtype, built for sm_80+ only.
# head dim -> (warps, m16 tiles per warp (MT), BC, Q fragments kept in registers, min blocks per
# SM for __launch_bounds__, K/V stages); BR = 16 * warps * MT. Stages 1: one K and one V buffer,
# two barriers per key tile; 2: K and V double-buffered, one barrier per key tile, the next tile's
# loads in flight during the whole current one. Chosen for no spills at the most blocks per SM
# (ptxas -v, NVRTC 12.9, sm_80/sm_90; benchmarks/notes_attention.md).
MMA_TILES = {32: (8, 1, 64, True, 2, 1), 64: (4, 1, 64, True, 3, 1), 96: (4, 1, 64, True, 2, 1),
             128: (4, 2, 64, False, 2, 1), 256: (4, 1, 64, False, 2, 1)}
# D = 128: FlashAttention-2's own tile (4 warps x 32 rows, BC 64, Q re-read from shared memory,
# one K/V stage) measured fastest after the softmax rework (run 22, B4 H32 S4096 bf16: 0.91x /
# 1.02x SDPA-FLASH non-causal / causal; 4 x 32 rows BC 32: 0.78x / 0.86x; two stages: 0.89x /
# 1.00x). Other schedules compiled too, so one GPU session can time them against MMA_TILES
# (benchmarks/experiments/attention_mma_schedules.py; swap one in with MMA_TILES[128] = cfg):
# 4 x 32 rows BC 32, each with two K/V stages, and the 16-rows-per-warp schedules of run 18
# (8 x 16: BR 128, one block per SM; 4 x 16, BC 64: Q in registers).
MMA_ALTERNATES = {128: ((4, 2, 32, False, 2, 1), (4, 2, 32, False, 2, 2), (4, 2, 64, False, 2, 2),
                        (8, 1, 64, True, 1, 1), (4, 1, 64, True, 2, 1))}
# Calls with an attn_mask take an instantiation with the mask code compiled in (MASK = true; the
# others leave it out and ignore mask_kind) and, where the fast schedule has no registers to spare
# for it (32 rows x 64 keys per warp sits at 254-255), a lighter schedule.
MMA_MASK_TILES = {128: (4, 2, 32, False, 2, 1)}
_MMA_ARCHS = ("80", "86", "89", "90")
_SHORT = {dt.float16: "f16", dt.bfloat16: "bf16"}


# EXTRAS template argument of flash_fwd_mma (cuda_src/attention/flash_mma_extras.cuh), bits:
# block mask, rotary tables (Q and each K tile in shared memory), packed sequences (and the
# bottom-right diagonal), rotary of Q only (K rotated beforehand by the pre-pass, rope_k.cu).
# Instantiated: 0 (dense), MMA_SPARSE, MMA_VARLEN, MMA_VARLEN | MMA_ROTARY (the in-loop rotary
# form; it also runs dense rotary calls: its varlen part costs a few scalar instructions per
# block), MMA_ROTARY_Q and MMA_VARLEN | MMA_ROTARY_Q (the pre-pass form, PLAN["rotary"]). The
# extras instantiations are unmasked (MASK = false): a call with both an attn_mask and rotary
# tables takes the SIMT kernel.
MMA_PLAIN, MMA_SPARSE, MMA_ROTARY, MMA_VARLEN, MMA_ROTARY_Q = 0, 1, 2, 4, 8
MMA_EXTRAS = (MMA_SPARSE, MMA_VARLEN, MMA_VARLEN | MMA_ROTARY, MMA_ROTARY_Q,
              MMA_VARLEN | MMA_ROTARY_Q)
# How the tensor-core kernel applies rotary tables (the SIMT kernel always rotates in its tile
# loads, in fp32 without rounding K: benchmarks/notes_attention.md):
#   "prepass" (default since run 34): K rotated once per call into a scratch array the size of K
#             (attn_rope_k, cuda_src/attention/rope_k.cu; call.empty, freed when the call
#             returns), then the mma kernel rotates only Q, before its key loop (MMA_ROTARY_Q).
#             Run 34 (H100, B1 H32 S4096 D128 causal bf16, events): 0.561 ms (predicted
#             0.56-0.58), in_loop 1.091, plain 0.483, apply_rotary + SDPA 0.519 (0.93x of it);
#   "in_loop" every K tile rotated in shared memory as it lands, once per query block
#             (MMA_VARLEN | MMA_ROTARY; run 34: 1.09 ms, interleaved 1.55).
# Same bits either way (the pre-pass uses the in-loop form's math and rounding).
PLAN = {"rotary": "prepass"}
ROTARY_FORMS = ("prepass", "in_loop")
# Schedules of the extras instantiations (head dim, EXTRAS) where MMA_TILES' has no registers to
# spare for them (ptxas, NVRTC 12.9 and PTX -> ptxas 13.0, sm_80/86/89/90: 0 spills with these;
# at MMA_TILES' D = 128 sparse spilled 8-32 bytes on sm_80..90 and varlen 4 on sm_80, while
# varlen + rotary fits (255 registers); D = 256 rotary at BC 64 spilled 20 bytes on sm_80..89;
# benchmarks/notes_attention.md). Q-only rotary (the pre-pass form) fits FA2's D = 128 tile
# (255 registers, dense and varlen). D = 128's is MMA_MASK_TILES[128] (compiled in the dense
# module too: the GPU test comparing varlen with per-sequence SDPA bit for bit times both on it).
MMA_EXTRAS_TILES = {(128, MMA_SPARSE): (4, 2, 32, False, 2, 1),
                    (128, MMA_VARLEN): (4, 2, 32, False, 2, 1),
                    (256, MMA_VARLEN | MMA_ROTARY): (4, 1, 32, False, 2, 1)}
# Extras not instantiated for a head dim. Such calls take the SIMT kernel, except the Q-only
# rotary ones, which fall back to the in-loop form (mma_extras). D = 256: Q-only rotary spilled
# on sm_90 (ptxas, NVRTC 12.9) at BC 64 (24 / 32 bytes, dense / varlen) and, oddly, at BC 32
# (16 / 20 bytes, where the in-loop form fits at 253 registers); 0 on sm_80/86/89.
MMA_EXTRAS_MISSING: dict = {256: (MMA_ROTARY_Q, MMA_VARLEN | MMA_ROTARY_Q)}


def mma_expr(dtype, d: int, cfg, masked: bool = False, extras: int = MMA_PLAIN) -> str:
    warps, mt, bc, qreg, minb, stages = cfg
    tail = f", {extras}" if extras else ""
    return (f"gpuops::flash_fwd_mma<{dtype.ctype}, {d}, {warps}, {mt}, {bc}, {_B[qreg]}, "
            f"{minb}, {stages}, {_B[masked]}{tail}>")


def mma_config(d: int, masked: bool, extras: int = MMA_PLAIN):
    """The schedule of a call: MMA_TILES[d]; MMA_MASK_TILES[d] (if any) for masked calls;
    MMA_EXTRAS_TILES[(d, extras)] (if any) for an extras instantiation (those are unmasked:
    mma_has)."""
    if extras:
        return MMA_EXTRAS_TILES.get((d, extras), MMA_TILES[d])
    return MMA_MASK_TILES.get(d, MMA_TILES[d]) if masked else MMA_TILES[d]


def mma_has(d: int, extras: int, masked: bool = False) -> bool:
    """Head dim d has an mma instantiation with these EXTRAS bits (and attn_mask: the extras
    instantiations have none)."""
    if extras and masked:
        return False
    return d in MMA_TILES and extras not in MMA_EXTRAS_MISSING.get(d, ())


def mma_smem(d: int, cfg) -> int:
    """Bytes of dynamic shared memory: Q [BR][D], K and V [BC][D] per stage, in the 16-bit storage
    dtype."""
    warps, mt, bc, stages = cfg[0], cfg[1], cfg[2], cfg[5]
    return (16 * warps * mt + 2 * bc * stages) * d * 2


def _mma_configs():
    return [(d, (cfg, *MMA_ALTERNATES.get(d, ()), MMA_MASK_TILES.get(d, cfg)))
            for d, cfg in MMA_TILES.items()]


def _mma_exprs(dtype):
    """Unmasked: MMA_TILES and MMA_ALTERNATES; masked: mma_config(d, True)."""
    out = [mma_expr(dtype, d, cfg) for d, cfg in MMA_TILES.items()]
    out += [mma_expr(dtype, d, cfg) for d, cfgs in MMA_ALTERNATES.items() for cfg in cfgs]
    out += [mma_expr(dtype, d, mma_config(d, True), True) for d in MMA_TILES]
    return out


MMA_MODULES = {
    dtype: KernelModule(f"attention.flash_mma_{short}", "attention/flash_fwd_mma.cu",
                        dict.fromkeys(_mma_exprs(dtype), FLASH_ARGS), archs=_MMA_ARCHS)
    for dtype, short in _SHORT.items()}
_MMA_KERNELS = {dtype: lay.KernelTable(m) for dtype, m in MMA_MODULES.items()}
# The block-sparse, varlen and rotary instantiations (mma_config's schedules): their own modules,
# compiled and loaded only when a call uses them (as the SIMT kernel's attention.flash_fwd_sparse).
MMA_EXTRAS_MODULES = {
    dtype: KernelModule(f"attention.flash_mma_extras_{short}", "attention/flash_fwd_mma.cu",
                        {mma_expr(dtype, d, mma_config(d, False, x), False, x): FLASH_ARGS
                         for d in MMA_TILES for x in MMA_EXTRAS if mma_has(d, x)},
                        archs=_MMA_ARCHS)
    for dtype, short in _SHORT.items()}
_MMA_EXTRAS_KERNELS = {dtype: lay.KernelTable(m) for dtype, m in MMA_EXTRAS_MODULES.items()}

# The rotary pre-pass of the tensor-core kernel (PLAN["rotary"] = "prepass"): K rotated once per
# call into a scratch array. Reads FlashFwdArgs (k, its strides, cu_k, the rotary fields), then
# the scratch pointer and its (b, h, s) strides. V: 16-byte packs, or one element (partial
# rotary whose packs straddle the rotated part). Tiny kernels: compiled for every arch.
ROPE_K_THREADS, ROPE_K_ROWS = 256, 64       # kRopeKThreads, kRopeKRows
ROPE_K_ARGS = ArgSpec(FLASH_ARGS.params[0], "ptr", "i64", "i64", "i64")


def rope_k_expr(dtype, v: int) -> str:
    return f"gpuops::attn_rope_k<{dtype.ctype}, {v}>"


ROPE_K_MODULE = KernelModule("attention.rope_k", "attention/rope_k.cu", {
    rope_k_expr(dtype, v): ROPE_K_ARGS for dtype in _SHORT for v in (16 // dtype.itemsize, 1)})
_ROPE_K_KERNELS = lay.KernelTable(ROPE_K_MODULE)

# 'wgmma' (sm_90a, cuda_src/attention/flash_fwd_wgmma.cu): FlashAttention-3's structure, a
# producer warpgroup issuing TMA loads and two consumer warpgroups of 64 query rows each
# (wgmma S = Q K^T from shared memory, O += P V with P in registers). Four tensor maps (q, k, v,
# out as 4-D [B, H, S, D], any strides) and FlashFwdArgs. Tile and shared memory mirror the
# kernel's kWgaBM / kWgaBN / WgaLayout.
WGMMA_DIMS = (64, 128)
WGMMA_THREADS, WGMMA_BM, WGMMA_BN = 384, 128, 128


def wgmma_stages(d: int) -> int:
    """K / V ring depth (the kernel's wga_stages): run 49's trace had 2 stages starve the
    consumers (the next tile's K landed ~1400 cycles after the stage two tiles back was
    released)."""
    return 3 if d == 128 else 4


WGMMA_ARGS = ArgSpec("tensormap", "tensormap", "tensormap", "tensormap", FLASH_ARGS.params[0],
                     "i32")
# Causal / windowed calls: the grid walks (b x h) rows in chunks whose K / V fit this many bytes
# (about half of an H100's 50 MB L2), each chunk's query tiles heaviest first
# (cuda_src/attention/flash_fwd_wgmma.cu, WgaWork): a head's K / V is read from DRAM about once,
# and the grid ends on light tiles (wgmma_head_chunk).
WGMMA_L2_BUDGET = 24 << 20
# False keeps 'auto' on 'mma' on sm_90 (A/B switch of benchmarks/experiments)
WGMMA_AUTO = True
# "overlap": each consumer warpgroup issues its products when ready (S_{j+1} before P_j V_j,
# the softmax under P_j V_j); "pingpong": besides, the two warpgroups take turns on the tensor
# cores (named barriers), so one's softmax runs under the other's products (FlashAttention-3).
WGMMA_SCHEDULES = ("overlap", "pingpong")
WGMMA_SCHEDULE = "pingpong"     # run 39: +3.5-9.1% over "overlap" at all 8 bench shapes


def wgmma_smem(d: int) -> int:
    q = WGMMA_BM * d * 2
    stage = 2 * WGMMA_BN * d * 2                   # K and V tiles
    # + the barriers, the scratch word of the kernel's wga_wait_after (D64), alignment slack
    return (q + wgmma_stages(d) * stage + (1 + 3 * wgmma_stages(d)) * 8 + (8 if d == 64 else 0)
            + 1024)


def wgmma_expr(dtype, d: int, schedule: str, probe: int = 0, sparse: bool = False) -> str:
    """probe != 0: a timing probe of benchmarks/experiments/attention_wgmma_probe.py (not
    compiled into the module; wrong results by design). sparse: block_sparse_attention's
    instance (its own module, WGMMA_SPARSE_MODULES: dense callers never compile it)."""
    return (f"gpuops::flash_fwd_wgmma<{dtype.ctype}, {d}, {_B[schedule == 'pingpong']}, "
            f"{probe}, {_B[sparse]}>")


def wgmma_schedule() -> str:
    """WGMMA_SCHEDULE, checked."""
    if WGMMA_SCHEDULE not in WGMMA_SCHEDULES:
        raise ValueError(f"gpuops: attention.WGMMA_SCHEDULE must be one of {list(WGMMA_SCHEDULES)},"
                         f" got {WGMMA_SCHEDULE!r}")
    return WGMMA_SCHEDULE


WGMMA_MODULES = {
    dtype: KernelModule(f"attention.flash_wgmma_{short}", "attention/flash_fwd_wgmma.cu",
                        {wgmma_expr(dtype, d, sch): WGMMA_ARGS for d in WGMMA_DIMS
                         for sch in WGMMA_SCHEDULES}, archs=("90a",))
    for dtype, short in _SHORT.items()}
_WGMMA_KERNELS = {dtype: lay.KernelTable(m) for dtype, m in WGMMA_MODULES.items()}
WGMMA_SPARSE_MODULES = {
    dtype: KernelModule(f"attention.flash_wgmma_sparse_{short}", "attention/flash_fwd_wgmma.cu",
                        {wgmma_expr(dtype, d, sch, sparse=True): WGMMA_ARGS for d in WGMMA_DIMS
                         for sch in WGMMA_SCHEDULES}, archs=("90a",))
    for dtype, short in _SHORT.items()}
_WGMMA_SPARSE_KERNELS = {dtype: lay.KernelTable(m) for dtype, m in WGMMA_SPARSE_MODULES.items()}
# block_sparse_attention on the wgmma kernel: block sizes that are multiples of this (a consumer
# warpgroup's 64 rows in one query block, each 64-key half of a tile in one key block); others
# run 'mma', which tests mixed tiles score by score
WGMMA_SPARSE_BLOCK = 64
for _d in WGMMA_DIMS:
    assert wgmma_smem(_d) <= 227 * 1024, _d

for _d, _cfgs in _mma_configs():
    for _cfg in (*_cfgs, *(mma_config(_d, False, _x) for _x in MMA_EXTRAS)):
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
    """Sizes in the logical [B, H, S, D] order (varlen: B sequences, Sq / Sk the longest), the
    scale, the window (-1 = unbounded) and the diagonal's alignment."""
    __slots__ = ("B", "Hq", "Hkv", "Sq", "Sk", "D", "group", "scale", "left", "right",
                 "bottom_right")

    def __init__(self, B, Hq, Hkv, Sq, Sk, D, scale, left, right, bottom_right):
        self.B, self.Hq, self.Hkv, self.Sq, self.Sk, self.D = B, Hq, Hkv, Sq, Sk, D
        self.group = Hq // Hkv if Hkv else 1
        self.scale, self.left, self.right, self.bottom_right = scale, left, right, bottom_right


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_flags(op, **flags):
    for name, flag in flags.items():
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"gpuops.{op}: {name!r} must be a bool, got {type(flag).__name__}")


def _check_variant(op, variant):
    if variant not in VARIANTS:
        raise ValueError(f"gpuops.{op}: 'variant' must be one of {VARIANTS}, got {variant!r}")


def _scale(op, scale, D) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"gpuops.{op}: 'scale' must be a float or None, got {type(scale).__name__}")
    return float(scale)


def _window(op, window_size, is_causal) -> tuple:
    """(left, right) of window_size with is_causal folded in; -1 = unbounded."""
    left = right = -1
    if window_size is not None:
        if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
                or not all(_is_int(w) for w in window_size)):
            raise TypeError(f"gpuops.{op}: 'window_size' must be None or a pair of ints "
                            f"(left, right), got {window_size!r}")
        left, right = (int(w) for w in window_size)
        if left < -1 or right < -1:
            raise ValueError(f"gpuops.{op}: 'window_size' entries must be >= 0, or -1 for "
                             f"unbounded; got {tuple(window_size)}")
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _heads(op, q_name, k_name, Hq, Hkv):
    """Hq a multiple of Hkv (GQA); the ops without enable_gqa take that as the GQA request."""
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"gpuops.{op}: {q_name!r} heads ({Hq}) must be a multiple of {k_name!r} "
                         f"heads ({Hkv})")


def check_args(q_shape, k_shape, v_shape, m_shape, is_causal, scale, enable_gqa, window_size,
               return_lse, layout, variant) -> Problem:
    """Validate everything but dtypes; return the problem in the logical [B, H, S, D] order."""
    if layout not in LAYOUTS:
        raise ValueError(f"gpuops.{OP}: 'layout' must be one of {LAYOUTS}, got {layout!r}")
    _check_variant(OP, variant)
    _check_flags(OP, is_causal=is_causal, enable_gqa=enable_gqa, return_lse=return_lse)
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
    scale = _scale(OP, scale, D)
    left, right = _window(OP, window_size, is_causal)
    # bounds that every row satisfies anyway are unbounded (keeps the kernel's int math small)
    if left >= Sq:
        left = -1
    if right >= Sk:
        right = -1
    return Problem(B, Hq, Hkv, Sq, Sk, D, scale, left, right, bottom_right=False)


def check_varlen_args(q_shape, k_shape, v_shape, cq_shape, ck_shape, max_seqlen_q, max_seqlen_k,
                      is_causal, scale, window_size, return_lse, variant) -> Problem:
    """Validate varlen_attention's shapes and options (not the cu_seqlens values: they live on
    the device); B = sequences, Sq / Sk = max_seqlen_q / _k, diagonal bottom-right."""
    op = VARLEN_OP
    _check_variant(op, variant)
    _check_flags(op, is_causal=is_causal, return_lse=return_lse)
    shapes = {}
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        shape = tuple(int(s) for s in shape)
        if len(shape) != 3:
            raise ValueError(f"gpuops.{op}: {name!r} must be 3-d [total, heads, head dim] (the "
                             f"sequences packed one after another), got shape {shape}")
        shapes[name] = shape
    Tq, Hq, D = shapes["q"]
    Tk, Hkv, Dk = shapes["k"]
    if shapes["v"] != shapes["k"]:
        raise ValueError(f"gpuops.{op}: 'v' has shape {shapes['v']} but 'k' has {shapes['k']}; "
                         "they must match")
    if Dk != D:
        raise ValueError(f"gpuops.{op}: 'k' has head dim {Dk} but 'q' has {D}; they must match")
    if D == 0:
        raise ValueError(f"gpuops.{op}: 'q' has head dim 0; the softmax scale 1/sqrt(D) is "
                         "undefined")
    _heads(op, "q", "k", Hq, Hkv)
    cq, ck = tuple(int(s) for s in cq_shape), tuple(int(s) for s in ck_shape)
    for name, shape in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
        if len(shape) != 1 or shape[0] < 1:
            raise ValueError(f"gpuops.{op}: {name!r} must be 1-d [B + 1] (sequence starts and the "
                             f"total), got shape {shape}")
    if cq != ck:
        raise ValueError(f"gpuops.{op}: 'cu_seqlens_q' has shape {cq} but 'cu_seqlens_k' has "
                         f"{ck}; both are [B + 1]")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(n):
            raise TypeError(f"gpuops.{op}: {name!r} must be a Python int (it sizes the grid), got "
                            f"{type(n).__name__}")
        if n < 0:
            raise ValueError(f"gpuops.{op}: {name!r} must be >= 0, got {n}")
    for name, t in (("q", Tq), ("k", Tk)):
        if t >= 2**31:
            raise ValueError(f"gpuops.{op}: {name!r} has {t} rows; the kernel indexes rows with "
                             "int32 (cu_seqlens), at most 2**31 - 1")
    left, right = _window(op, window_size, is_causal)
    # row i of a sequence sees keys i + (sk - sq) - left .. i + (sk - sq) + right: left >= sk or
    # right >= sq - 1 bound nothing
    if left >= max_seqlen_k:
        left = -1
    if right >= max_seqlen_q:
        right = -1
    return Problem(cq[0] - 1, Hq, Hkv, int(max_seqlen_q), int(max_seqlen_k), D,
                   _scale(op, scale, D), left, right, bottom_right=True)


def check_sparse_args(q_shape, k_shape, v_shape, bm_shape, block_size, is_causal, scale,
                      return_lse, variant) -> Problem:
    """Validate block_sparse_attention's shapes and options."""
    op = SPARSE_OP
    _check_variant(op, variant)
    _check_flags(op, is_causal=is_causal, return_lse=return_lse)
    shapes = {}
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        shape = tuple(int(s) for s in shape)
        if len(shape) != 4:
            raise ValueError(f"gpuops.{op}: {name!r} must be 4-d [B, H, S, D], got shape {shape}")
        shapes[name] = shape
    B, Hq, Sq, D = shapes["q"]
    Bk, Hkv, Sk, Dk = shapes["k"]
    if shapes["v"] != shapes["k"]:
        raise ValueError(f"gpuops.{op}: 'v' has shape {shapes['v']} but 'k' has {shapes['k']}; "
                         "they must match")
    if Bk != B:
        raise ValueError(f"gpuops.{op}: 'k' has batch {Bk} but 'q' has {B}; they must match")
    if Dk != D:
        raise ValueError(f"gpuops.{op}: 'k' has head dim {Dk} but 'q' has {D}; they must match")
    if D == 0:
        raise ValueError(f"gpuops.{op}: 'q' has head dim 0; the softmax scale 1/sqrt(D) is "
                         "undefined")
    _heads(op, "q", "k", Hq, Hkv)
    if not _is_int(block_size):
        raise TypeError(f"gpuops.{op}: 'block_size' must be an int, got "
                        f"{type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"gpuops.{op}: 'block_size' must be >= 1, got {block_size}")
    nq, nk = -(-Sq // block_size), -(-Sk // block_size)
    bm = tuple(int(s) for s in bm_shape)
    if (len(bm) != 4 or bm[0] not in (1, B) or bm[1] not in (1, Hq) or bm[2:] != (nq, nk)):
        raise ValueError(f"gpuops.{op}: 'block_mask' has shape {bm}; expected [B or 1, H or 1, "
                         f"ceil(Sq / block_size), ceil(Sk / block_size)] = [{B} or 1, {Hq} or 1, "
                         f"{nq}, {nk}]")
    left, right = _window(op, None, is_causal)
    if right >= Sk:
        right = -1
    return Problem(B, Hq, Hkv, Sq, Sk, D, _scale(op, scale, D), left, right,
                   bottom_right=False)


def check_rotary(op, cos_shape, sin_shape, D, rows_needed, interleaved) -> int:
    """rotary_dim / 2 of the tables rotary_cos / rotary_sin ([rows, rotary_dim / 2]); 0 = none."""
    _check_flags(op, rotary_interleaved=interleaved)
    if cos_shape is None and sin_shape is None:
        return 0
    if cos_shape is None or sin_shape is None:
        given, missing = ("rotary_cos", "rotary_sin") if sin_shape is None else \
            ("rotary_sin", "rotary_cos")
        raise ValueError(f"gpuops.{op}: {given!r} given without {missing!r}; pass both or neither")
    cos, sin = tuple(int(s) for s in cos_shape), tuple(int(s) for s in sin_shape)
    if cos != sin:
        raise ValueError(f"gpuops.{op}: 'rotary_cos' has shape {cos} but 'rotary_sin' has {sin}; "
                         "they must match")
    if len(cos) != 2:
        raise ValueError(f"gpuops.{op}: 'rotary_cos' must be 2-d [positions, rotary_dim / 2] (one "
                         f"column per frequency), got shape {cos}")
    half = cos[1]
    if half < 1 or 2 * half > D:
        raise ValueError(f"gpuops.{op}: 'rotary_cos' has {half} columns; the rotary dim 2 x "
                         f"{half} must be in [2, {D}] (the head dim)")
    if cos[0] < rows_needed:
        raise ValueError(f"gpuops.{op}: 'rotary_cos' has {cos[0]} rows but positions go up to "
                         f"{rows_needed - 1} (token s of a sequence uses row s)")
    return half


# ---------------------------------------------------------------------------------------------
# The NumPy references (float64): the textbook formula, head by head.

def visible(sq: int, sk: int, left: int, right: int, diag: int = 0) -> np.ndarray:
    """[sq, sk] bool: key j visible from query i, i.e. i + diag - left <= j <= i + diag + right
    (diag = 0: top-left aligned, as torch's is_causal; diag = sk - sq: bottom-right)."""
    i = np.arange(sq)[:, None] + diag
    j = np.arange(sk)[None, :]
    ok = np.ones((sq, sk), bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def ref_rotate(x, cos, sin, interleaved=False):
    """RoPE of x [..., S, D] at positions 0 .. S - 1: pair (a, b) of frequency f -> (a cos - b sin,
    b cos + a sin), pairs (f, f + R/2) (GPT-NeoX) or (2f, 2f + 1) (GPT-J), R = 2 cos.shape[-1];
    the last D - R elements pass through. The formula of apply_rotary, written out."""
    x = np.array(x, np.float64)
    S = x.shape[-2]
    c, s = (np.asarray(t, np.float64)[:S] for t in (cos, sin))
    half = c.shape[-1]
    if interleaved:
        a, b = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half], x[..., half:2 * half] = a * c - b * s, b * c + a * s
    return x


def _ref_core(q, k, v, p, mask=None, ok=None):
    """out [B, Hq, Sq, D] and lse [B, Hq, Sq] of float64 q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D];
    mask bool or additive [B, Hq, Sq, Sk] (or None); ok [Sq, Sk] visibility (or None)."""
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    out = np.zeros((B, Hq, Sq, D))
    lse = np.full((B, Hq, Sq), -np.inf)
    if Sk == 0:
        return out, lse
    with np.errstate(all="ignore"):
        for b in range(B):
            for h in range(Hq):
                s = (q[b, h] @ k[b, h // p.group].T) * p.scale
                if mask is not None:
                    s = np.where(mask[b, h], s, -np.inf) if mask.dtype == bool else s + mask[b, h]
                if ok is not None:
                    s = np.where(ok, s, -np.inf)
                m = np.max(s, axis=1, keepdims=True)
                dead = np.isneginf(m)                  # no visible key: output 0, lse -inf
                e = np.exp(s - np.where(dead, 0.0, m))
                den = e.sum(axis=1, keepdims=True)
                out[b, h] = np.where(dead, 0.0, (e @ v[b, h // p.group]) / den)
                lse[b, h] = np.where(dead, -np.inf, m + np.log(den))[:, 0]
    return out, lse


def ref_scaled_dot_product_attention(query, key, value, attn_mask=None, is_causal=False,
                                     scale=None, enable_gqa=False, window_size=None,
                                     return_lse=False, layout="bhsd", variant="auto",
                                     rotary_cos=None, rotary_sin=None, rotary_interleaved=False):
    p = check_args(np.shape(query), np.shape(key), np.shape(value),
                   None if attn_mask is None else np.shape(attn_mask), is_causal, scale,
                   enable_gqa, window_size, return_lse, layout, variant)
    check_rotary(OP, None if rotary_cos is None else np.shape(rotary_cos),
                 None if rotary_sin is None else np.shape(rotary_sin), p.D, max(p.Sq, p.Sk),
                 rotary_interleaved)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (query, key, value))
    if layout == "bshd":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    if rotary_cos is not None:
        q, k = (ref_rotate(x, rotary_cos, rotary_sin, rotary_interleaved) for x in (q, k))
    mask = None
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        mask = np.broadcast_to(m.astype(bool) if m.dtype == bool else m.astype(np.float64),
                               (p.B, p.Hq, p.Sq, p.Sk))
    out, lse = _ref_core(q, k, v, p, mask, visible(p.Sq, p.Sk, p.left, p.right))
    if layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    return (out, lse) if return_lse else out


def _host_offsets(op, name, cu, total, exact):
    """cu_seqlens as host ints, checked (the CPU path can read them; the GPU path cannot)."""
    a = np.asarray(cu)
    if a.dtype.kind == "f":                         # float64 copies made by benchmark checks
        if not np.all(a == np.round(a)):
            raise ValueError(f"gpuops.{op}: {name!r} must hold integers")
    a = a.astype(np.int64)
    if np.any(np.diff(a) < 0) or (a.size and (a[0] < 0 or a[-1] > total)):
        raise ValueError(f"gpuops.{op}: {name!r} = {a.tolist()} must be non-decreasing offsets "
                         f"into the {total} packed rows")
    if exact and a.size and (a[0] != 0 or a[-1] != total):
        raise ValueError(f"gpuops.{op}: {name!r} = {a.tolist()} must start at 0 and end at the "
                         f"{total} rows of the packed tensor (the kernel writes only rows that "
                         "belong to a sequence)")
    return a


def ref_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         is_causal=False, scale=None, window_size=None, return_lse=False,
                         rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                         variant="auto"):
    p = check_varlen_args(np.shape(q), np.shape(k), np.shape(v), np.shape(cu_seqlens_q),
                          np.shape(cu_seqlens_k), max_seqlen_q, max_seqlen_k, is_causal, scale,
                          window_size, return_lse, variant)
    check_rotary(VARLEN_OP, None if rotary_cos is None else np.shape(rotary_cos),
                 None if rotary_sin is None else np.shape(rotary_sin), p.D,
                 max(p.Sq, p.Sk), rotary_interleaved)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    cq = _host_offsets(VARLEN_OP, "cu_seqlens_q", cu_seqlens_q, q.shape[0], True)
    ck = _host_offsets(VARLEN_OP, "cu_seqlens_k", cu_seqlens_k, k.shape[0], False)
    for name, cu, most in (("q", cq, p.Sq), ("k", ck, p.Sk)):
        longest = int(np.diff(cu).max(initial=0))
        if longest > most:
            raise ValueError(f"gpuops.{VARLEN_OP}: a sequence has {longest} rows of {name!r} but "
                             f"max_seqlen_{name} = {most}")
    out = np.zeros(q.shape)
    lse = np.full((p.Hq, q.shape[0]), -np.inf)
    for b in range(p.B):
        qb, kb, vb = (x[lo:hi].transpose(1, 0, 2)[None] for x, lo, hi in (
            (q, cq[b], cq[b + 1]), (k, ck[b], ck[b + 1]), (v, ck[b], ck[b + 1])))
        if rotary_cos is not None:
            qb, kb = (ref_rotate(x, rotary_cos, rotary_sin, rotary_interleaved) for x in (qb, kb))
        sq, sk = qb.shape[2], kb.shape[2]
        o, l = _ref_core(qb, kb, vb, p, None, visible(sq, sk, p.left, p.right, sk - sq))
        out[cq[b]:cq[b + 1]] = o[0].transpose(1, 0, 2)
        lse[:, cq[b]:cq[b + 1]] = l[0]
    return (out, lse) if return_lse else out


def expand_block_mask(block_mask, block_size, sq, sk) -> np.ndarray:
    """[B|1, H|1, nq, nk] block mask -> [B|1, H|1, sq, sk] element mask."""
    m = np.asarray(block_mask).astype(bool)
    return np.repeat(np.repeat(m, block_size, axis=2), block_size, axis=3)[:, :, :sq, :sk]


def ref_block_sparse_attention(q, k, v, block_mask, block_size, is_causal=False, scale=None,
                               return_lse=False, variant="auto"):
    p = check_sparse_args(np.shape(q), np.shape(k), np.shape(v), np.shape(block_mask),
                          block_size, is_causal, scale, return_lse, variant)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    mask = np.broadcast_to(expand_block_mask(block_mask, block_size, p.Sq, p.Sk),
                           (p.B, p.Hq, p.Sq, p.Sk))
    out, lse = _ref_core(q, k, v, p, mask, visible(p.Sq, p.Sk, p.left, p.right))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# GPU path.

def _bhsd_strides(t: Tensor, layout: str) -> tuple:
    """(b, h, s, d) strides of a 'bhsd' / 'bshd' tensor, or of a packed 'thd' one ([T, H, D]: the
    batch stride is 0, the kernel adds each sequence's first row itself)."""
    s = tuple(t.strides)
    if layout == "thd":
        return (0, s[1], s[0], s[2])
    return s if layout == "bhsd" else (s[0], s[2], s[1], s[3])


def _mask_strides(m: Tensor) -> tuple:
    """Strides of the mask broadcast to [B, Hq, Sq, Sk] (0 where it broadcasts)."""
    shape = (1,) * (4 - len(m.shape)) + tuple(m.shape)
    strides = (0,) * (4 - len(m.strides)) + tuple(m.strides)
    return tuple(0 if n == 1 else st for n, st in zip(shape, strides))


_NULL_STRIDES = (0, 0, 0, 0)


def _vec_ok(t: Tensor, layout: str, shape: tuple) -> bool:
    """16-byte loads of whole rows: unit d stride, 16-byte aligned base and row starts (shape in
    the logical (b, h, s, d) order)."""
    n = 16 // t.dtype.itemsize
    st = _bhsd_strides(t, layout)
    return (t.ptr % 16 == 0 and (st[3] == 1 or shape[3] == 1) and shape[3] % n == 0
            and all(s % n == 0 or size == 1 for s, size in zip(st[:3], shape[:3])))


class FlashExtras:
    """The options carried by FlashFwdArgs' appended fields (None / 0 = off): packed sequences
    (cu_q, cu_k: int32 [B + 1] device tensors), a block mask (bool, broadcast to
    [B, Hq, nq, nk] of block_size), rotary tables (rot_cos, rot_sin: [rows, rot_half])."""
    __slots__ = ("cu_q", "cu_k", "block_mask", "block_size", "rot_cos", "rot_sin", "rot_half",
                 "rot_interleaved")

    def __init__(self, cu_q=None, cu_k=None, block_mask=None, block_size=0, rot_cos=None,
                 rot_sin=None, rot_half=0, rot_interleaved=False):
        self.cu_q, self.cu_k = cu_q, cu_k
        self.block_mask, self.block_size = block_mask, block_size
        self.rot_cos, self.rot_sin = rot_cos, rot_sin
        self.rot_half, self.rot_interleaved = rot_half, rot_interleaved

    @property
    def used(self) -> bool:
        return self.cu_q is not None or self.block_mask is not None or self.rot_half > 0


NO_EXTRAS = FlashExtras()


def _rotary_vec_ok(dtype, ext: FlashExtras) -> bool:
    """16-byte loads with rotary: a pack must not straddle the rotated part, and (GPT-NeoX) its
    partner pack, rot_half columns away, must start on a pack boundary."""
    if ext.rot_half == 0:
        return True
    n = 16 // dtype.itemsize
    return (2 * ext.rot_half) % n == 0 if ext.rot_interleaved else ext.rot_half % n == 0


def flash_launch_args(p: Problem, query, key, value, attn_mask, mask_kind, out, lse, layout, vec,
                      ext: FlashExtras = NO_EXTRAS) -> tuple:
    """The fields of FlashFwdArgs (cuda_src/attention/attn_common.cuh) for one launch, flat and in
    the struct's order (FLASH_ARGS). layout: 'bhsd' / 'bshd' (dense, out and lse [B, Hq, Sq]) or
    'thd' (packed varlen: q/k/v/out [T, H, D], lse [Hq, T])."""
    if layout == "thd":
        lse_strides = (0, out.shape[0], 1)
    else:
        lse_strides = (p.Hq * p.Sq, p.Sq, 1)
    bm = ext.block_mask
    bm_strides = _mask_strides(bm) if bm is not None else _NULL_STRIDES
    rot = ext.rot_half > 0
    return (query.ptr, key.ptr, value.ptr, attn_mask.ptr if attn_mask is not None else 0,
            out.ptr, lse.ptr if lse is not None else 0,
            *_bhsd_strides(query, layout), *_bhsd_strides(key, layout),
            *_bhsd_strides(value, layout), *_bhsd_strides(out, layout),
            *(_mask_strides(attn_mask) if attn_mask is not None else _NULL_STRIDES),
            p.Hq, p.group, p.Sq, p.Sk, p.D, p.left, p.right, mask_kind, int(vec),
            p.scale * math.log2(math.e),
            # appended fields: varlen, block mask, rotary
            ext.cu_q.ptr if ext.cu_q is not None else 0,
            ext.cu_k.ptr if ext.cu_k is not None else 0,
            bm.ptr if bm is not None else 0,
            ext.rot_cos.ptr if rot else 0, ext.rot_sin.ptr if rot else 0,
            *lse_strides, *bm_strides,
            *(tuple(ext.rot_cos.strides) if rot else (0, 0)),
            *(tuple(ext.rot_sin.strides) if rot else (0, 0)),
            int(p.bottom_right), ext.block_size if bm is not None else 0,
            ext.rot_half, int(ext.rot_interleaved),
            int(rot and ext.rot_cos.dtype is dt.float32),
            ext.rot_cos.shape[0] if rot else 0)


def _launch_simt(call, p, query, key, value, attn_mask, mask_kind, out, lse, layout,
                 ext: FlashExtras = NO_EXTRAS):
    dev = call.device
    d, br, bc, general = simt_config(p.D, smem_limit(dev))
    grid = (p.B * p.Hq, -(-p.Sq // br), -(-p.D // d) if general else 1)
    _check_grid(call.op.name, grid)
    if 0 in grid:
        return
    sparse = ext.block_mask is not None
    kernel = (_SPARSE_KERNELS if sparse else _KERNELS).get(
        dev, flash_expr(call.result_dtype, d, br, bc, general, sparse))
    if layout == "thd":   # packed rows are stepped by device offsets: every row stride counts
        q_shape, kv_shape = (1, p.Hq, query.shape[0], p.D), (1, p.Hkv, key.shape[0], p.D)
    else:
        q_shape, kv_shape = (p.B, p.Hq, p.Sq, p.D), (p.B, p.Hkv, p.Sk, p.D)
    vec = not general and _vec_ok(query, layout, q_shape) and _vec_ok(key, layout, kv_shape) \
        and _vec_ok(value, layout, kv_shape) and _rotary_vec_ok(call.result_dtype, ext)
    kernel.launch(grid, (FLASH_THREADS, 1, 1), call.stream,
                  *flash_launch_args(p, query, key, value, attn_mask, mask_kind, out, lse, layout,
                                     vec, ext),
                  smem=flash_smem(d, br, bc))


# variants whose kernels read FlashFwdArgs' appended fields (varlen, block mask, rotary); 'auto'
# would route calls that use them to 'simt' for a variant not listed ('mma' reads them all:
# varlen in every instantiation, block mask and rotary in their own, MMA_EXTRAS_MODULES;
# 'wgmma' reads the block mask in its sparse instance and refuses the others with the reason,
# wgmma_unsupported, where 'auto' goes on as 'mma')
_EXTRAS_VARIANTS = {"simt", "mma", "wgmma"}


# the variants 'auto' chooses among (_launch_auto)
_AUTO_PICKS = ("wgmma", "mma", "simt")


def _variant_launcher(op, variant, ext: FlashExtras):
    if not ext.used:
        return _VARIANTS[variant]
    if variant == "auto":
        # 'auto' keeps its choice when every variant it may pick reads the appended fields; else
        # the best of those that do ('mma' = the tensor-core kernel where it applies, else SIMT)
        if set(_AUTO_PICKS) <= _EXTRAS_VARIANTS:
            return _VARIANTS["auto"]
        return _VARIANTS["mma"] if "mma" in _EXTRAS_VARIANTS else _launch_simt
    if variant not in _EXTRAS_VARIANTS:
        raise ValueError(f"gpuops.{op}: variant={variant!r} does not support varlen, block "
                         f"sparsity or rotary yet; use one of {sorted(_EXTRAS_VARIANTS)} or "
                         "'auto'")
    return _VARIANTS[variant]


def _rotary_extras(op, dtype, rotary_cos, rotary_sin, rot_half, interleaved, ext: FlashExtras):
    if rot_half == 0:
        return
    if rotary_cos.dtype is not dtype and rotary_cos.dtype is not dt.float32:
        raise TypeError(f"gpuops.{op}: 'rotary_cos' has dtype {rotary_cos.dtype}; the tables must "
                        f"be in the query's dtype ({dtype}) or float32")
    if rotary_sin.dtype is not rotary_cos.dtype:
        raise TypeError(f"gpuops.{op}: 'rotary_sin' is {rotary_sin.dtype} but 'rotary_cos' is "
                        f"{rotary_cos.dtype}; they must share one dtype")
    ext.rot_cos, ext.rot_sin = rotary_cos, rotary_sin
    ext.rot_half, ext.rot_interleaved = rot_half, bool(interleaved)


def _forward(call, query, key, value, attn_mask, is_causal, scale, enable_gqa, window_size,
             return_lse, layout, variant, rotary_cos=None, rotary_sin=None,
             rotary_interleaved=False):
    p = check_args(query.shape, key.shape, value.shape,
                   None if attn_mask is None else attn_mask.shape, is_causal, scale, enable_gqa,
                   window_size, return_lse, layout, variant)
    rot_half = check_rotary(OP, None if rotary_cos is None else rotary_cos.shape,
                            None if rotary_sin is None else rotary_sin.shape, p.D,
                            max(p.Sq, p.Sk), rotary_interleaved)
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
    ext = NO_EXTRAS
    if rot_half:
        ext = FlashExtras()
        _rotary_extras(OP, dtype, rotary_cos, rotary_sin, rot_half, rotary_interleaved, ext)
    launch = _variant_launcher(OP, variant, ext)
    out_shape = (p.B, p.Hq, p.Sq, p.D) if layout == "bhsd" else (p.B, p.Sq, p.Hq, p.D)
    out = call.empty(out_shape, dtype)
    lse = call.empty((p.B, p.Hq, p.Sq), dt.float32) if return_lse else None
    if out.numel:
        launch(call, p, query, key, value, attn_mask, mask_kind, out, lse, layout, ext)
    return (out, lse) if return_lse else out


def _check_grid(op, grid):
    if grid[0] >= 2**31 or grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"gpuops.{op}: too large for one launch (batch x heads = {grid[0]}, "
                         f"query tiles = {grid[1]}, head-dim chunks = {grid[2]})")


def tensor_cores(dev: int) -> bool:
    """mma.sync/ldmatrix/cp.async available: sm_80+ (and not GPUOPS_ARCH asking for older)."""
    return effective_arch(dev) >= 80


def mma_applies(call, p, query, key, value, out, layout) -> bool:
    """The tensor-core kernel takes the call: fp16/bf16, sm_80+, a head dim in MMA_TILES, and
    16-byte aligned rows with unit d stride for q, k, v and out (cp.async / 16-byte stores).
    Packed ('thd') rows start at device offsets: every row stride must keep them aligned."""
    if call.result_dtype not in _MMA_KERNELS or p.D not in MMA_TILES:
        return False
    if layout == "thd":
        q_shape, kv_shape = (1, p.Hq, query.shape[0], p.D), (1, p.Hkv, key.shape[0], p.D)
    else:
        q_shape, kv_shape = (p.B, p.Hq, p.Sq, p.D), (p.B, p.Hkv, p.Sk, p.D)
    return (all(_bhsd_strides(t, layout)[3] == 1 for t in (query, key, value, out))
            and _vec_ok(query, layout, q_shape) and _vec_ok(key, layout, kv_shape)
            and _vec_ok(value, layout, kv_shape) and _vec_ok(out, layout, q_shape)
            and tensor_cores(call.device))


def rotary_form() -> str:
    """PLAN["rotary"], checked."""
    form = PLAN["rotary"]
    if form not in ROTARY_FORMS:
        raise ValueError(f"gpuops: PLAN['rotary'] must be one of {list(ROTARY_FORMS)}, got "
                         f"{form!r}")
    return form


def mma_extras(p, ext: FlashExtras) -> int:
    """The EXTRAS instantiation (one of MMA_EXTRAS, or 0) a call needs (rotary: by
    PLAN["rotary"])."""
    if ext.block_mask is not None:
        if ext.rot_half or ext.cu_q is not None or p.bottom_right:
            raise ValueError("gpuops: the block-sparse tensor-core kernel takes neither rotary "
                             "tables nor packed sequences")
        return MMA_SPARSE
    varlen = MMA_VARLEN if ext.cu_q is not None or p.bottom_right else MMA_PLAIN
    if ext.rot_half:
        q_only = varlen | MMA_ROTARY_Q
        if rotary_form() == "prepass" and q_only not in MMA_EXTRAS_MISSING.get(p.D, ()):
            return q_only
        return MMA_VARLEN | MMA_ROTARY       # in-loop (also where Q-only is not instantiated)
    return varlen


def rope_k_scratch(call, p, query, key, value, out, layout, ext: FlashExtras):
    """The pre-pass of PLAN["rotary"] = "prepass": K rotated (positions = sequence index, as the
    in-loop form) into a new array of K's shape in the caller's framework (call.empty: contiguous
    and 16-byte aligned; its cost is the size of K: B x Hkv x Sk x D, varlen Tk x Hkv x D), which
    the mma kernel then reads as its k. q and k are not written. Graph-capturable: no host sync,
    the device reads cu_seqlens_k itself."""
    scratch = call.empty(tuple(key.shape), call.result_dtype)
    if scratch.numel == 0:
        return scratch
    assert scratch.ptr % 16 == 0, "call.empty gives 16-byte aligned arrays"
    # the caller (mma_applies) checked K's 16-byte rows with unit d stride; whole packs also need
    # the rotated part to split into packs (and, GPT-NeoX, the partner pack to start on one)
    v = 16 // call.result_dtype.itemsize if _rotary_vec_ok(call.result_dtype, ext) else 1
    ob, oh, os_, _ = _bhsd_strides(scratch, layout)
    grid = (p.B * p.Hkv, min(65535, max(1, -(-p.Sk // ROPE_K_ROWS))), 1)
    _check_grid(call.op.name, grid)
    kernel = _ROPE_K_KERNELS.get(call.device, rope_k_expr(call.result_dtype, v))
    kernel.launch(grid, (ROPE_K_THREADS, 1, 1), call.stream,
                  *flash_launch_args(p, query, key, value, None, 0, out, None, layout, True, ext),
                  scratch.ptr, ob, oh, os_)
    return scratch


def _launch_mma(call, p, query, key, value, attn_mask, mask_kind, out, lse, layout,
                ext: FlashExtras = NO_EXTRAS):
    masked = mask_kind != 0
    extras = mma_extras(p, ext)
    cfg = mma_config(p.D, masked, extras)
    warps, mt = cfg[:2]
    grid = (p.B * p.Hq, -(-p.Sq // (16 * warps * mt)), 1)
    _check_grid(call.op.name, grid)
    if 0 in grid:
        return
    table = (_MMA_EXTRAS_KERNELS if extras else _MMA_KERNELS)[call.result_dtype]
    kernel = table.get(call.device, mma_expr(call.result_dtype, p.D, cfg, masked, extras))
    if extras & MMA_ROTARY_Q:     # the kernel rotates Q only: K rotated once, beforehand
        key = rope_k_scratch(call, p, query, key, value, out, layout, ext)
    kernel.launch(grid, (32 * warps, 1, 1), call.stream,
                  *flash_launch_args(p, query, key, value, attn_mask, mask_kind, out, lse, layout,
                                     True, ext),
                  smem=mma_smem(p.D, cfg))


def _launch_best(call, p, query, key, value, attn_mask, mask_kind, out, lse, layout,
                 ext: FlashExtras = NO_EXTRAS):
    """'mma': the tensor-core kernel where it applies, else the SIMT kernel."""
    launch = _launch_mma if (mma_applies(call, p, query, key, value, out, layout)
                             and mma_has(p.D, mma_extras(p, ext), mask_kind != 0)) \
        else _launch_simt
    launch(call, p, query, key, value, attn_mask, mask_kind, out, lse, layout, ext)


# ---------------------------------------------------------------------------------------------
# 'wgmma' (sm_90a)

def _tma_map(t: Tensor, layout: str, shape: tuple, box_rows: int):
    """The 4-D tensor map (d, s, h, b innermost first) of a 16-bit [B, H, S, D] operand in
    'bhsd' / 'bshd' order, with boxes of 64 head-dim columns x box_rows rows in the 128-byte
    swizzle; None where TMA cannot describe it (unit d stride, 16-byte aligned base and byte
    strides). A dim of extent 1 is never stepped: its stride is replaced by a valid one."""
    B, H, S, D = shape
    sb, sh, ss, sd = _bhsd_strides(t, layout)
    if sd != 1:                       # D is 64 or 128 here
        return None
    item = t.dtype.itemsize
    strides = []
    for extent, st in ((S, ss), (H, sh), (B, sb)):
        nbytes = st * item
        if extent == 1 and (nbytes <= 0 or nbytes % 16):
            nbytes = 16 * max(1, -(-D * item // 16))
        strides.append(nbytes)
    dims, box = (D, S, H, B), (64, box_rows, 1, 1)
    if tma.check_tiled(t.ptr, tma.DTYPE_UINT16, dims, strides, box, tma.SWIZZLE_128B):
        return None
    return tma.encode_tiled(t.ptr, tma.DTYPE_UINT16, dims, strides, box)


def wgmma_device(dev: int) -> bool:
    """The wgmma kernel can run here: an sm_90 GPU with GPUOPS_ARCH not asking for older."""
    return effective_arch(dev) == 90


def wgmma_unsupported(call, p, attn_mask, ext: FlashExtras):
    """Why the wgmma kernel does not take this call (a phrase), or None. Layout checks that need
    the tensors (what TMA can describe) come later, in _wgmma_maps."""
    if call.result_dtype not in _WGMMA_KERNELS:
        return f"dtype {call.result_dtype} (float16 and bfloat16 only)"
    if p.D not in WGMMA_DIMS:
        return f"head dim {p.D} (only {list(WGMMA_DIMS)})"
    if attn_mask is not None:
        return "an attn_mask"
    if ext.cu_q is not None or ext.rot_half or p.bottom_right:
        return "varlen or rotary"
    if ext.block_mask is not None and (ext.block_size % WGMMA_SPARSE_BLOCK or p.left >= 0):
        return (f"block_size {ext.block_size} (block sparsity: multiples of "
                f"{WGMMA_SPARSE_BLOCK} only)")
    if not p.scale > 0:
        return f"scale {p.scale} (positive only)"
    if p.Sk == 0:
        return "an empty key sequence"
    if -(-p.Sq // WGMMA_BM) * p.B * p.Hq >= 2 ** 31:
        return f"{p.B * p.Hq} x {p.Sq} query rows (grid: below 2^31 blocks of 128 rows)"
    if not wgmma_device(call.device):
        return "this device (sm_90 only)"
    return None


def _wgmma_maps(p, query, key, value, out, layout):
    """Tensor maps of q, k, v and out, or None where one of them cannot be described."""
    maps = (_tma_map(query, layout, (p.B, p.Hq, p.Sq, p.D), WGMMA_BM),
            _tma_map(key, layout, (p.B, p.Hkv, p.Sk, p.D), WGMMA_BN),
            _tma_map(value, layout, (p.B, p.Hkv, p.Sk, p.D), 64),
            _tma_map(out, layout, (p.B, p.Hq, p.Sq, p.D), 64))
    return None if any(m is None for m in maps) else maps


def wgmma_head_chunk(p) -> int:
    """(b x h) rows per chunk of the wgmma grid. Causal / windowed calls: as many query heads as
    keep their K / V (shared by `group` consecutive heads) within WGMMA_L2_BUDGET, so the grid
    runs the heavy query tiles of several waves' worth of heads first and ends on light ones
    (run 40: B1 H32 S4096 D128 causal 435 -> 487 TFLOP/s over one head at a time). Full rows:
    1 (every tile costs the same, and a head's tiles in one wave read its K / V from DRAM once:
    run 39's order; 12-head chunks lost 6% at B4 in run 40)."""
    if p.left < 0 and p.right < 0:
        return 1
    kv_head_bytes = 2 * p.Sk * p.D * 2
    return max(1, min(p.B * p.Hq, WGMMA_L2_BUDGET // max(kv_head_bytes, 1) * p.group))


def _launch_wgmma_maps(call, p, query, key, value, out, lse, layout, maps,
                       ext: FlashExtras = NO_EXTRAS):
    grid = (-(-p.Sq // WGMMA_BM) * p.B * p.Hq, 1, 1)
    if 0 in grid:
        return
    if ext.block_mask is not None:      # wgmma_unsupported let only the block mask through
        kernel = _WGMMA_SPARSE_KERNELS[call.result_dtype].get(
            call.device, wgmma_expr(call.result_dtype, p.D, wgmma_schedule(), sparse=True))
    else:
        kernel = _WGMMA_KERNELS[call.result_dtype].get(
            call.device, wgmma_expr(call.result_dtype, p.D, wgmma_schedule()))
    kernel.launch(grid, (WGMMA_THREADS, 1, 1), call.stream, *maps,
                  *flash_launch_args(p, query, key, value, None, 0, out, lse, layout, True, ext),
                  wgmma_head_chunk(p), smem=wgmma_smem(p.D))


def _launch_wgmma(call, p, query, key, value, attn_mask, mask_kind, out, lse, layout,
                  ext: FlashExtras = NO_EXTRAS):
    """variant='wgmma': the Hopper kernel, or an error saying why it cannot take the call."""
    why = wgmma_unsupported(call, p, attn_mask, ext)
    maps = None if why else _wgmma_maps(p, query, key, value, out, layout)
    if why is None and maps is None:
        why = ("q, k, v or out in a layout TMA cannot read (unit head-dim stride, 16-byte aligned "
               "base and strides needed)")
    if why:
        raise ValueError(f"gpuops.{call.op.name}: variant='wgmma' does not take {why}; use "
                         "variant='auto'")
    _launch_wgmma_maps(call, p, query, key, value, out, lse, layout, maps, ext)


def _launch_auto(call, p, query, key, value, attn_mask, mask_kind, out, lse, layout,
                 ext: FlashExtras = NO_EXTRAS):
    """'auto': the wgmma kernel where it applies (sm_90, WGMMA_AUTO), else as 'mma'."""
    if WGMMA_AUTO and wgmma_unsupported(call, p, attn_mask, ext) is None:
        maps = _wgmma_maps(p, query, key, value, out, layout)
        if maps is not None:
            _launch_wgmma_maps(call, p, query, key, value, out, lse, layout, maps, ext)
            return
    _launch_best(call, p, query, key, value, attn_mask, mask_kind, out, lse, layout, ext)


# 'auto' -> the best variant for the device and inputs.
_VARIANTS = {"auto": _launch_auto, "simt": _launch_simt, "mma": _launch_best,
             "wgmma": _launch_wgmma}


def _varlen_forward(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    is_causal, scale, window_size, return_lse, rotary_cos, rotary_sin,
                    rotary_interleaved, variant):
    p = check_varlen_args(q.shape, k.shape, v.shape, cu_seqlens_q.shape, cu_seqlens_k.shape,
                          max_seqlen_q, max_seqlen_k, is_causal, scale, window_size, return_lse,
                          variant)
    rot_half = check_rotary(VARLEN_OP, None if rotary_cos is None else rotary_cos.shape,
                            None if rotary_sin is None else rotary_sin.shape, p.D,
                            max(p.Sq, p.Sk), rotary_interleaved)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.shape[0] > 1 and cu.strides[0] != 1:
            raise ValueError(f"gpuops.{VARLEN_OP}: {name!r} must be contiguous (stride 1), got "
                             f"stride {cu.strides[0]}")
    dtype = call.result_dtype
    ext = FlashExtras(cu_q=cu_seqlens_q, cu_k=cu_seqlens_k)
    _rotary_extras(VARLEN_OP, dtype, rotary_cos, rotary_sin, rot_half, rotary_interleaved, ext)
    launch = _variant_launcher(VARLEN_OP, variant, ext)
    out = call.empty(tuple(q.shape), dtype)
    lse = call.empty((p.Hq, q.shape[0]), dt.float32) if return_lse else None
    if out.numel:
        launch(call, p, q, k, v, None, 0, out, lse, "thd", ext)
    return (out, lse) if return_lse else out


def _sparse_forward(call, q, k, v, block_mask, block_size, is_causal, scale, return_lse,
                    variant):
    p = check_sparse_args(q.shape, k.shape, v.shape, block_mask.shape, block_size, is_causal,
                          scale, return_lse, variant)
    ext = FlashExtras(block_mask=block_mask, block_size=int(block_size))
    launch = _variant_launcher(SPARSE_OP, variant, ext)
    out = call.empty((p.B, p.Hq, p.Sq, p.D), call.result_dtype)
    lse = call.empty((p.B, p.Hq, p.Sq), dt.float32) if return_lse else None
    if out.numel:
        launch(call, p, q, k, v, None, 0, out, lse, "bhsd", ext)
    return (out, lse) if return_lse else out


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
# Benchmarks of varlen_attention and block_sparse_attention. A peer is called with our own
# arguments, so what it needs besides them (host lengths, the padded batch, the element mask) is
# built once by make_inputs, outside the timing, and kept here for the latest inputs.

_BENCH_SIDE: dict = {}


def _device_ints(like, values, dtype_name):
    """A device array of ints in the framework of `like` (torch, CuPy or NumPy)."""
    values = np.asarray(values)
    mod = type(like).__module__.split(".")[0]
    if mod == "torch":
        import torch  # noqa: PLC0415
        return torch.as_tensor(values, dtype=getattr(torch, dtype_name), device=like.device)
    if mod == "cupy":
        return device.cupy_or_none().asarray(values.astype(dtype_name))
    return values.astype(dtype_name)


def _varlen_lengths(total, n):
    """n deterministic, uneven lengths >= 1 summing to total (shares drawn from a fixed seed);
    fewer sequences when total < n."""
    n = max(1, min(n, total))
    w = np.random.default_rng(1234).gamma(1.0, size=n) + 0.05
    lengths = np.maximum(1, np.floor(w / w.sum() * total)).astype(np.int64)
    lengths[np.argmax(lengths)] += total - lengths.sum()
    return lengths


def _varlen_bench_make(shape, d, randn):
    total, n, H, D, causal = shape
    lengths = _varlen_lengths(total, n)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (randn((total, H, D), d) for _ in range(3))
    cu_dev = _device_ints(q, cu, "int32")
    _BENCH_SIDE.clear()
    if type(q).__module__.split(".")[0] == "torch":
        import torch  # noqa: PLC0415
        smax = int(lengths.max())
        padded = []
        for x in (q, k, v):
            pad = torch.zeros(n, H, smax, D, dtype=x.dtype, device=x.device)
            for b in range(n):
                pad[b, :, :lengths[b]] = x[cu[b]:cu[b + 1]].transpose(0, 1)
            padded.append(pad)
        keep = torch.arange(smax, device=q.device)[None, :] < torch.as_tensor(
            lengths, device=q.device)[:, None]
        _BENCH_SIDE["varlen"] = (id(q), cu.tolist(), padded, keep[:, None, None, :])
    return (q, k, v, cu_dev, cu_dev, int(lengths.max()), int(lengths.max()), bool(causal)), {}


def _varlen_side(q):
    side = _BENCH_SIDE.get("varlen")
    if side is None or side[0] != id(q):
        raise RuntimeError("varlen bench peer called without its prepared inputs")
    return side[1:]


def _varlen_torch_padded(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         is_causal=False):
    """torch SDPA on the zero-padded batch [B, H, max_len, D] (causal: padded keys come after
    every valid query, so no mask and the flash backend; else a key-padding mask)."""
    import torch.nn.functional as F  # noqa: PLC0415,N812
    _, (pq, pk, pv), keep = _varlen_side(q)
    if is_causal:
        return F.scaled_dot_product_attention(pq, pk, pv, is_causal=True)
    return F.scaled_dot_product_attention(pq, pk, pv, attn_mask=keep)


def _varlen_bench_peers():
    import torch.nn.functional as F  # noqa: PLC0415,N812
    import gpuops  # noqa: PLC0415

    def torch_per_seq(q, k, v, cu_q, cu_k, mq, mk, is_causal=False):
        cu = _varlen_side(q)[0]
        return [F.scaled_dot_product_attention(
            *(x[cu[b]:cu[b + 1]].transpose(0, 1)[None] for x in (q, k, v)), is_causal=is_causal)
            for b in range(len(cu) - 1)]

    def gpuops_per_seq(q, k, v, cu_q, cu_k, mq, mk, is_causal=False):
        cu = _varlen_side(q)[0]
        return [gpuops.scaled_dot_product_attention(
            *(x[cu[b]:cu[b + 1]][None] for x in (q, k, v)), is_causal=is_causal, layout="bshd",
            enable_gqa=k.shape[1] != q.shape[1]) for b in range(len(cu) - 1)]
    return {"torch_per_seq": torch_per_seq, "gpuops_per_seq": gpuops_per_seq}


def _varlen_bench_flops(args, out):
    q = args[0]
    cu = np.asarray(_varlen_side(q)[0])
    L = np.diff(cu).astype(np.float64)
    f = 4.0 * q.shape[1] * q.shape[2] * float((L * L).sum())
    return int(f // 2 if args[7] else f)


VARLEN_BENCH = BenchSpec(
    make_inputs=_varlen_bench_make, torch_fn=_varlen_torch_padded,
    extra_peers=_varlen_bench_peers,
    default_shape=lambda d: (16384, 16, 32, 128, 1), flops=_varlen_bench_flops,
    bytes_moved=_bench_bytes,
    check_shape=lambda s: (min(s[0], 2048), min(s[1], 8), 2, s[3], s[4]),
    extra_shapes=((16384, 16, 32, 128, 0), (16384, 64, 32, 128, 1)))


def _sparse_bench_make(shape, d, randn):
    B, H, S, D, bs, density = shape
    q, k, v = (randn((B, H, S, D), d) for _ in range(3))
    n = -(-S // bs)
    rng = np.random.default_rng(4321)
    bm = rng.random((1, H, n, n)) < density / 100.0
    bm[..., np.arange(n), np.arange(n)] = True          # every query row sees a block
    bm_dev = _device_ints(q, bm, "bool")
    _BENCH_SIDE.clear()
    if type(q).__module__.split(".")[0] == "torch":
        _BENCH_SIDE["sparse"] = (id(q), _device_ints(q, expand_block_mask(bm, bs, S, S), "bool"))
    return (q, k, v, bm_dev, bs), {}


def _sparse_torch_masked(q, k, v, block_mask, block_size):
    """torch SDPA with the block mask expanded to an element mask (its masked backends)."""
    import torch.nn.functional as F  # noqa: PLC0415,N812
    side = _BENCH_SIDE.get("sparse")
    if side is None or side[0] != id(q):
        raise RuntimeError("block-sparse bench peer called without its prepared inputs")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=side[1])


def _sparse_bench_peers():
    import torch.nn.functional as F  # noqa: PLC0415,N812
    import gpuops  # noqa: PLC0415
    return {"gpuops_dense": lambda q, k, v, bm, bs: gpuops.scaled_dot_product_attention(q, k, v),
            "sdpa_dense": lambda q, k, v, bm, bs: F.scaled_dot_product_attention(q, k, v)}


def _sparse_bench_flops(args, out):
    q, bm, bs = args[0], args[3], args[4]
    B, H, S, D = q.shape
    on = expand_block_mask(np.asarray(bm.cpu() if hasattr(bm, "cpu") else bm), bs, S,
                           args[1].shape[2]).sum()
    return int(4 * D * int(on) * (B // bm.shape[0]) * (H // bm.shape[1]))


SPARSE_BENCH = BenchSpec(
    make_inputs=_sparse_bench_make, torch_fn=_sparse_torch_masked,
    extra_peers=_sparse_bench_peers,
    default_shape=lambda d: (2, 32, 4096, 128, 64, 50), flops=_sparse_bench_flops,
    bytes_moved=_bench_bytes,
    check_shape=lambda s: (1, 2, min(s[2], 1024), s[3], s[4], s[5]),
    extra_shapes=((2, 32, 4096, 128, 64, 25), (2, 32, 4096, 128, 128, 50),
                  (2, 32, 4096, 128, 64, 100)))


# ---------------------------------------------------------------------------------------------
# The op.

def _sdpa_result_dtype(values, found):
    # with return_lse: lse in float32 (as the kernel writes it), float64 for float64 input
    if not values.get("return_lse"):
        return None
    return (None, dt.stat_dtype(found.get("query")))


ref_scaled_dot_product_attention.result_dtype = _sdpa_result_dtype


_TABLE_DTYPES = (dt.float32, dt.float16, dt.bfloat16, dt.float64)   # float64: CPU path only
_ROTARY_PARAMS = {"rotary_cos": _TABLE_DTYPES, "rotary_sin": _TABLE_DTYPES}


@register(family="attention", reference=ref_scaled_dot_product_attention,
          param_dtypes={"attn_mask": (dt.bool_, dt.float32, dt.float16, dt.bfloat16, dt.float64),
                        **_ROTARY_PARAMS},
          bench=BENCH)
def scaled_dot_product_attention(call, query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Tensor | None = None, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False, *,
                                 window_size=None, return_lse: bool = False,
                                 layout: str = "bhsd", variant: str = "auto",
                                 rotary_cos: Tensor | None = None,
                                 rotary_sin: Tensor | None = None,
                                 rotary_interleaved: bool = False):
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
    * ``rotary_cos``, ``rotary_sin`` ([P, R/2], one column per frequency; the query's dtype or
      float32; any strides): RoPE applied to q and k inside the kernel as they are loaded, the
      same as ``gpuops.apply_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved,
      rotary_dim=R)`` (in 'bshd' order) followed by attention, without the round trip through
      memory. The rotation is fp32 math; the SIMT kernel keeps the rotated q and k in fp32, the
      tensor-core kernel ('mma') rounds them to the storage dtype once (its operands are
      fp16/bf16: the rounding apply_rotary does, up to 2^-8 relative for bf16). Token s (query or
      key) uses row s: positions are sequence indices, P >= max(Sq, Sk) (a KV cache whose keys
      start elsewhere needs rotary_positions offsets: not yet). The first R = 2 x cos.shape[-1]
      <= D elements of each head rotate; ``rotary_interleaved=False`` pairs (f, f + R/2)
      (GPT-NeoX / Llama / HF ``rotate_half``), ``True`` pairs (2f, 2f + 1) (GPT-J). q and k
      are never written. The tensor-core kernel first rotates K once into a temporary array of
      K's size (B x Hkv x Sk x D elements, from the caller's allocator, freed on return; with
      GQA smaller than q) and rotates Q inside the kernel (``PLAN["rotary"] = "prepass"``, the
      default); ``"in_loop"`` rotates each K tile in shared memory as it lands instead (no
      temporary, but once per query block: 1.9x slower on an H100 at S = 4096). Both give
      the same bits.
    * ``variant``: 'auto' (the best kernel for the device and inputs), 'wgmma', 'mma' or
      'simt'. 'wgmma' (Hopper, sm_90): FlashAttention-3's structure (TMA loads by a producer
      warpgroup, warpgroup MMA, P kept in registers; same rounding as 'mma'), for fp16/bf16,
      head dims 64 and 128, no attn_mask / rotary, a positive scale, and q, k, v, out that
      TMA can read (unit d stride, 16-byte aligned base and strides); naming it for another
      call is an error. 'auto' takes it on sm_90 where it applies.
      'mma': FlashAttention-2's forward on tensor cores (mma.sync, fp32 accumulators), taken
      for fp16/bf16 on sm_80+ when the head dim is 32, 64, 96, 128 or 256 and q, k, v rows are
      16-byte aligned with unit d stride (any 'bhsd'/'bshd' strides otherwise); the softmax
      probabilities are rounded to the input dtype for the P V product (as FlashAttention
      does: up to 2^-8 relative for bf16, 2^-11 for fp16, on top of the output's rounding).
      'simt': the FlashAttention-2-style tiled kernel in fp32 on CUDA cores, every arch from
      sm_61, any head dim, dtype and strides. 'auto' (after 'wgmma') and 'mma' pick 'mma' where
      it applies and 'simt' otherwise (fp32, sm_61/70/75, other head dims, unaligned rows).
      Calls with rotary tables take the same choice (their own mma instantiation), except
      with an attn_mask as well: those take 'simt' (the rotary instantiation has no mask code).

    fp32 math (accumulation, softmax) for fp16/bf16/fp32 storage; exp is MUFU ``ex2`` of
    log2(e)-folded scores (relative error ~2e-7). Memory O(B H S D): the S x S matrix is never
    formed.
    """
    return _forward(call, query, key, value, attn_mask, is_causal, scale, enable_gqa,
                    window_size, return_lse, layout, variant, rotary_cos, rotary_sin,
                    rotary_interleaved)


def _lse_result_dtype(first):
    def hook(values, found):
        # with return_lse: lse in float32 (as the kernel writes it), float64 for float64 input
        if not values.get("return_lse"):
            return None
        return (None, dt.stat_dtype(found.get(first)))
    return hook


ref_varlen_attention.result_dtype = _lse_result_dtype("q")
ref_block_sparse_attention.result_dtype = _lse_result_dtype("q")


@register(family="attention", reference=ref_varlen_attention,
          param_dtypes={"cu_seqlens_q": (dt.int32,), "cu_seqlens_k": (dt.int32,),
                        **_ROTARY_PARAMS},
          bench=VARLEN_BENCH)
def varlen_attention(call, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     is_causal: bool = False, scale: float | None = None, *, window_size=None,
                     return_lse: bool = False, rotary_cos: Tensor | None = None,
                     rotary_sin: Tensor | None = None, rotary_interleaved: bool = False,
                     variant: str = "auto"):
    """Attention over a packed batch of sequences of different lengths (FlashAttention's varlen).

    ``q`` [total_q, Hq, D], ``k``/``v`` [total_k, Hkv, D] (any strides): sequence b is rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of
    k/v, and attends only to itself. GQA when Hq is a multiple of Hkv (query head h reads
    key/value head h // (Hq / Hkv)). Returns out [total_q, Hq, D] (and, with ``return_lse``, lse
    [Hq, total_q] float32, natural log, FlashAttention-2's varlen layout).

    * ``cu_seqlens_q``, ``cu_seqlens_k``: int32 [B + 1], contiguous, on the device; never read
      on the host (the call can be captured in a CUDA graph and replayed with new lengths).
      ``max_seqlen_q`` / ``max_seqlen_k`` (Python ints) size the grid: a sequence longer than
      them is not fully computed (unchecked on the GPU; the CPU path raises), shorter ones cost
      nothing past their end. ``cu_seqlens_q`` must run from 0 to total_q: rows of q outside
      every sequence are not written. Empty sequences are fine (a query sequence without keys
      gives 0 and lse -inf).
    * ``is_causal``: **bottom-right aligned**, as FlashAttention's varlen: query i of a sequence
      with sq queries and sk keys sees keys j <= i + sk - sq (the queries are the last sq tokens,
      e.g. a chunk of new tokens against its cached prefix). With sq == sk this is the usual
      causal mask; with sq > sk the first sq - sk queries see no key and give 0 (lse -inf).
      (``scaled_dot_product_attention``'s ``is_causal`` is top-left, as torch's.)
    * ``window_size=(left, right)``: query i sees keys i + sk - sq - left .. i + sk - sq + right
      (-1 = unbounded), the same alignment; with ``is_causal`` right is min(right, 0).
    * ``rotary_cos`` / ``rotary_sin`` / ``rotary_interleaved``: RoPE of q and k fused into the
      loads, as in ``scaled_dot_product_attention``; the position of a row is its index within
      its sequence (query i -> table row i, key j -> row j, also when sq != sk), so the tables
      need max(max_seqlen_q, max_seqlen_k) rows.
    * ``scale``: default 1 / sqrt(D). ``variant``: 'auto', 'mma' or 'simt', as in
      ``scaled_dot_product_attention`` ('mma' for fp16/bf16 on sm_80+ with its head dims and
      packed rows 16-byte aligned; with rotary tables it rounds the rotated q and k to the
      storage dtype).

    One launch: blocks are (sequence x head, query tile of the longest sequence); a block past its
    sequence's end exits at once. fp32 math for fp16/bf16/fp32 storage.
    """
    return _varlen_forward(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           is_causal, scale, window_size, return_lse, rotary_cos, rotary_sin,
                           rotary_interleaved, variant)


@register(family="attention", reference=ref_block_sparse_attention,
          param_dtypes={"block_mask": (dt.bool_,)}, bench=SPARSE_BENCH)
def block_sparse_attention(call, q: Tensor, k: Tensor, v: Tensor, block_mask: Tensor,
                           block_size: int, *, is_causal: bool = False,
                           scale: float | None = None, return_lse: bool = False,
                           variant: str = "auto"):
    """Attention where query block i only sees key block j when ``block_mask[..., i, j]`` is True.

    ``q`` [B, Hq, Sq, D], ``k``/``v`` [B, Hkv, Sk, D] (any strides, so [B, S, H, D] tensors pass
    as ``.transpose(1, 2)`` views); GQA when Hq is a multiple of Hkv. ``block_mask`` bool
    [B or 1, Hq or 1, ceil(Sq / block_size), ceil(Sk / block_size)]: block (i, j) covers queries
    ``i * block_size ..`` and keys ``j * block_size ..`` (the last blocks may be partial).
    Equivalent to ``scaled_dot_product_attention`` with the block mask expanded to an element
    mask, but key tiles whose blocks are all off are skipped (no loads, no math): time scales
    with the density.

    * ``block_size``: any size >= 1 is correct. A multiple of 64 (the SIMT kernel's query and
      key tiles are 64 or 32 rows; the mma kernel's key tiles 64 or 32, its query tiles 64 or
      128 rows of 16-row warps, each of which skips tiles off for its own rows) makes every tile
      one block: one mask byte per tile and no per-score test. Smaller blocks make the kernel
      read every block entry a tile covers and test tiles that mix on and off blocks score by
      score. On Hopper (sm_90) the 'wgmma' kernel takes multiples of 64 (fp16 / bf16, head
      dims 64 and 128): its tiles are 128 queries x 128 keys, so a tile is skipped only where
      all of the (up to 2 x 2) blocks it covers are off; a multiple of 128 skips block by
      block.
    * ``is_causal``: top-left aligned, as ``scaled_dot_product_attention`` (applied on top of the
      block mask; blocks above the diagonal cost nothing either way).
    * A query row whose blocks are all off gives 0 (lse -inf). ``return_lse``: lse [B, Hq, Sq]
      float32. ``scale``: default 1 / sqrt(D). ``variant``: 'auto', 'wgmma', 'mma' or 'simt',
      as in ``scaled_dot_product_attention``.
    """
    return _sparse_forward(call, q, k, v, block_mask, block_size, is_causal, scale, return_lse,
                           variant)
