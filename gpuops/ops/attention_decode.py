"""Decode attention: a few query tokens against a long KV cache, contiguous or paged.

Ops: :func:`decode_attention` (cache ``[B, S_max, Hkv, D]``), :func:`paged_attention` (pages
``[num_pages, page_size, Hkv, D]`` and a block table) and :func:`append_paged_kv` (write new tokens
into the pages in place).

Kernels (cuda_src/attention/):

* ``decode_split.cu``: split-KV (flash-decoding). The grid is (splits, Hkv x row chunks, B): each
  block takes one chunk of one sequence's keys for one kv head and all the q rows (GQA group x
  query tokens) that share it, so each K/V byte is read once; the number of splits comes from the
  SM count and ``S_max`` (host-known values only), so even B = 1 fills the GPU. 16-byte loads of
  K/V for head dims 64/128/256 (template), one-element loads for any other head dim or layout.
  fp32 math (online softmax in the log2 domain), fp16/bf16/fp32 storage. Each split writes its
  normalised partial output and log-sum-exp to an fp32 workspace (``call.empty``).
* The ring kernels (fp16/bf16, head dims 64 / 128; ``RING`` below): the same contract, K and V
  staged through a shared-memory ring and multiplied on the tensor cores with up to 16 q rows
  per block. ``decode_split_async.cu`` (sm_80+) fills the ring by cp.async and takes contiguous
  caches from 2 q rows per kv head (and 1 where it needs no splits);
  ``decode_split_tma.cu`` (sm_90) fills it by TMA and takes page pools (pages of 8..64 keys
  dividing 64, or multiples of 64) from 2 rows. With one split they write the output directly.
* ``decode_combine.cu``: one block per output row merges the splits by log-sum-exp (a second
  launch, also for one split of the register kernel; a PDL secondary of the split kernel on
  sm_90). (A merge in the split
  kernel's last block, one launch, was slower at B1 in runs 22, 27 and 35 and was removed:
  notes_attention_decode.md.)
* ``decode_append.cu``: the paged-cache writer.

Knob (read at every call; notes_attention_decode.md, change 3): ``PDL`` (programmatic dependent
launch of the combine, and of the split kernel, sm_90; "combine" by default since run 34: -0.9 us
at B1 S8192). (A cp.async-staged split kernel was slower than the register path at every depth
in run 34 and was removed: notes_attention_decode.md.)

The lengths (``cache_seqlens``, int32 on the device) are read by the kernels, never by the host:
the ops are capturable in a CUDA graph and the graph can be replayed with other lengths. For the
same reason values outside ``[0, S_max]`` cannot raise on the GPU: they are clamped there (and
block-table entries outside ``[0, num_pages)`` clamped to the pool), while the CPU path raises
``ValueError``.
"""
from __future__ import annotations

import math
import sys

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.ops import attention as fwd
from gpuops.ops.copy import fast_divider
from gpuops.registry import get as _get_op, register
from gpuops.runtime import device, loader
from gpuops.runtime.launch import PDL as _PDL_ATTRS, ArgSpec, launch_ex_available
from gpuops.runtime.modules import KernelModule
from gpuops.tensor import Tensor

DECODE_THREADS = 128          # kDecodeThreads (decode_common.cuh)
APPEND_THREADS = 256          # kAppendThreads (decode_append.cu)
MAX_SPLITS = 1024             # kMaxSplits (decode_combine.cu)
FAST_D = (64, 128, 256)       # head dims of the 16-byte path
GENERAL_D = (64, 256, 1024)   # register templates of the one-element path (head dim <= template)
RTS = (1, 2, 4, 8)            # q rows per block on the 16-byte path
# split rule (host-known values only): as many splits as fill WAVES waves of the split kernel's
# resident blocks (its occupancy on the device) without chunks shorter than MIN_CHUNK keys.
# Whole waves matter: run 14 measured B16 S4096 at 640 blocks with 528 resident (1.2 waves)
# 16% slower than at 384 blocks (one wave). Experiments may change these; part of the plan key.
SPLIT = {"waves": 1, "min_chunk": 128}
# Programmatic dependent launch (sm_90 only; notes_attention_decode.md, change 3): "off" (plain
# launches), "combine" (the split kernel lets the combine be scheduled at once; the combine,
# launched as a PDL secondary, waits for the splits before its first load: hides its launch) or
# "all" (also the split kernel is launched as a PDL secondary of whatever precedes it on the
# stream, and waits for it before its first memory access). Read at every call; ignored on other
# archs and drivers without cuLaunchKernelEx. Run 34 (H100, B1 S8192 bf16, graph replay, rotated
# caches): off 20.37 us, "combine" 19.50 (the default since), B16 S4096 99.01 -> 98.44; same bits.
PDL = "combine"

INT_DTYPES = (dt.int32,)
_B = {True: "true", False: "false"}

SPLIT_ARGS = ArgSpec(*["ptr"] * 7, *["i64"] * 4, *["i64"] * 4, *["i64"] * 4, "i64", "i64",
                     "i64", *["i32"] * 13, "f32")
COMBINE_ARGS = ArgSpec("ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32", "i32")
APPEND_ARGS = ArgSpec(*["ptr"] * 6, *["i64"] * 16, "i64", "i64", "i64", "i64", *["i32"] * 7,
                      "i64")


def _vec(d):
    return 16 // d.itemsize


def _cfg(dtype, dim, vec):
    """(L, NV, E) of DecodeCfg in decode_common.cuh."""
    lanes = min(32, dim // vec)
    nv = dim // (vec * lanes)
    return lanes, nv, nv * vec


def _rt_max(dtype, dim, vec):
    if vec == 1:
        return 1
    return min(8, max(1, 64 // _cfg(dtype, dim, vec)[2]))


def _split_expr(d, dim, vec, rt, paged):
    return f"gpuops::decode_split<{d.ctype}, {dim}, {vec}, {rt}, {_B[paged]}>"


SPLIT_MODULE = KernelModule("attention.decode_split", "attention/decode_split.cu", {
    **{_split_expr(d, dim, _vec(d), rt, paged): SPLIT_ARGS
       for d in dt.FLOATS for dim in FAST_D for rt in RTS if rt <= _rt_max(d, dim, _vec(d))
       for paged in (False, True)},
    **{_split_expr(d, dim, 1, 1, paged): SPLIT_ARGS
       for d in dt.FLOATS for dim in GENERAL_D for paged in (False, True)}})
COMBINE_MODULE = KernelModule("attention.decode_combine", "attention/decode_combine.cu", {
    f"gpuops::decode_combine<{d.ctype}>": COMBINE_ARGS for d in dt.FLOATS})
APPEND_MODULE = KernelModule("attention.decode_append", "attention/decode_append.cu", {
    f"gpuops::append_paged_kv<{d.ctype}>": APPEND_ARGS for d in dt.FLOATS})

# The ring kernels (decode_ring.cuh): the same split contract as decode_split, with K and V
# staged through a shared-memory ring of 64-key stages and multiplied on the tensor cores by 4
# consumer warps, 16 q rows per block (mma.sync; P V with P in two 16-bit parts, so the register
# kernel's tolerances hold); fp16/bf16, head dim 64 / 128. Their cost does not grow with the q
# rows up to 16, where the register kernel's does (it holds RT = 4 or 8 rows' q and o in
# registers: fewer keys in flight).
# * decode_split_async.cu (sm_80+): the 4 warps fill the ring themselves by cp.async, whole key
#   rows (cuDNN's way on Hopper); any 16-byte aligned cache or page pool.
# * decode_split_tma.cu (sm_90): a producer warp fills it by TMA boxes; caches TMA can describe
#   (contiguous, or page pools with pages of 8..64 keys dividing 64 or multiples of 64).
# With one split a ring kernel writes the output itself (no combine launch).
# RING (read at every call): "auto", "on" (every row count: tests, experiments) or "off".
# "auto" (H200 runs 228-233, bf16 D 128, CUDA graphs over rotated caches; notes_attention_decode.md
# "Runs 228-233"):
# - contiguous caches: the cp.async ring from RING_MIN_ROWS = 2 q rows per kv head (GQA group x
#   query tokens): GQA 16/8 B16 S4096 71.9 -> 64.3 us (torch SDPA 62.5), B4 S8192 40.5 -> 37.7,
#   B1 S8192 15.7 -> 15.5 (torch 15.2; at D 64 it loses: 11.4 -> 11.6); 64/8 B16 260.6 -> 66.2,
#   B1 44.8 -> 16.7; 32/8 with 4 tokens B4 S8192 254.4 -> 42.3; and at 1 row where its plan has
#   one split (the sequences fill the GPU): 8/8 B16 S4096 65.9 -> 63.6; at 1 row with several
#   splits it loses (8/8 B1 S8192 14.3 against 15.2, B4 36.4 against 37.4) and the register
#   kernel runs. (The TMA ring: 71.2-71.8 at B16 16/8 and 8/8.)
# - page pools: the TMA ring from 2 rows, for the pages it takes: pages of 64, GQA 16/8 B16 S4096
#   88.2 -> 71.4 us, B1 S8192 18.5 -> 17.0; pages of 16 88.2 -> 80.6 / 18.5 -> 18.1. The cp.async
#   ring reads pages no faster than the register kernel (87.7 / 88.5 against 88.2 at B16, 19.0
#   against 18.5 at B1) and is not taken; other page sizes run the register kernel.
# RING_KERNEL: "auto" (the above), "async" or "tma" (tests, experiments). RING_SPLIT: the rings'
# split rule (num_splits_ring): waves of RING_SPLIT["blocks_per_sm"] x SMs blocks, chunks of whole
# stages (one block per SM measured ahead of two, runs 218, 222, 228). Part of the plan key.
RING = "auto"
RING_KERNEL = "auto"
RING_MIN_ROWS = 2
RING_SPLIT = {"waves": 1, "blocks_per_sm": 1}
RING_D = (64, 128)
RING_KEYS = 64                # kDrKeys (decode_ring.cuh): keys per stage
RING_ROWS = 16                # kDrRows: q rows per block (the mma's M)
_HALFS = (dt.float16, dt.bfloat16)

TMA_STAGES = {64: 6, 128: 3}  # ring slots (DecodeTmaSmem): 96 KiB either way, 2 blocks per SM
TMA_THREADS = 160             # kDtThreads (decode_split_tma.cu)
TMA_ARGS = ArgSpec("tensormap", "tensormap", *["ptr"] * 7, *["i64"] * 7, *["i32"] * 12, "f32")


def _tma_expr(d, dim, paged=False):
    return f"gpuops::decode_split_tma<{d.ctype}, {dim}, {TMA_STAGES[dim]}, {_B[paged]}>"


def _tma_page_ok(page_size):
    """Page sizes decode_split_tma reads in whole boxes: divisors of a stage (8..64 keys) or
    multiples of it."""
    return (page_size >= 8 and RING_KEYS % page_size == 0) or page_size % RING_KEYS == 0


def _tma_smem(dim):
    """Dynamic shared memory of decode_split_tma (DecodeTmaSmem::kBytes)."""
    return 1024 + TMA_STAGES[dim] * 2 * (dim // 64) * RING_KEYS * 128


TMA_MODULE = KernelModule("attention.decode_split_tma", "attention/decode_split_tma.cu", {
    _tma_expr(d, dim, paged): TMA_ARGS for d in _HALFS for dim in RING_D
    for paged in (False, True)}, archs=("90",))

ASYNC_STAGES = {64: 6, 128: 3}  # ring slots (DecodeAsyncSmem): 96 KiB either way
ASYNC_THREADS = 128             # kDaThreads (decode_split_async.cu)
ASYNC_ARGS = ArgSpec(*["ptr"] * 9, *["i64"] * 13, *["i32"] * 10, "3I", "i32", "f32")


def _async_expr(d, dim, paged=False, stages=None):
    st = ASYNC_STAGES[dim] if stages is None else stages
    return f"gpuops::decode_split_async<{d.ctype}, {dim}, {st}, {_B[paged]}>"


def _async_smem(dim, paged, stages=None):
    """Dynamic shared memory of decode_split_async (DecodeAsyncSmem: kBytes, + kTableBytes for
    page pools)."""
    st = ASYNC_STAGES[dim] if stages is None else stages
    table = 2 * (st - 1) * (RING_KEYS + 4) * 4 if paged else 0
    return st * 2 * (dim // 64) * RING_KEYS * 128 + table


ASYNC_MODULE = KernelModule("attention.decode_split_async", "attention/decode_split_async.cu", {
    _async_expr(d, dim, paged): ASYNC_ARGS for d in _HALFS for dim in RING_D
    for paged in (False, True)}, archs=fwd._MMA_ARCHS)



def _kernel(module, dev, expr):
    return loader.kernel(module, dev, expr)


_sm_count = device.sm_count


def num_splits(batch, hkv, row_chunks, s_max, slots, waves=None, min_chunk=None):
    """(splits, keys per split) from host-known values: blocks (batch x kv heads x row chunks x
    splits) that fill ``waves`` waves of ``slots`` resident blocks (SMs x blocks per SM) without
    chunks shorter than ``min_chunk`` keys. When the sequences alone fill the slots: 1 split."""
    w = SPLIT["waves"] if waves is None else waves
    mc = SPLIT["min_chunk"] if min_chunk is None else min_chunk
    base = max(1, batch * hkv * row_chunks)
    want = max(1, (w * slots) // base)
    n = max(1, min(want, -(-s_max // mc), MAX_SPLITS))
    chunk = max(1, -(-s_max // n))
    return -(-max(s_max, 1) // chunk), chunk


def num_splits_ring(batch, hkv, row_chunks, s_max, sms, waves=None, blocks_per_sm=None):
    """(splits, keys per split) of the ring kernels: num_splits' rule for ``waves`` waves of
    ``blocks_per_sm`` x ``sms`` blocks, with chunks of whole stages (RING_KEYS): a chunk that ends
    inside a stage would load the next chunk's keys too (the TMA ring)."""
    w = RING_SPLIT["waves"] if waves is None else waves
    per = RING_SPLIT["blocks_per_sm"] if blocks_per_sm is None else blocks_per_sm
    _, chunk = num_splits(batch, hkv, row_chunks, s_max, per * sms, w, RING_KEYS)
    chunk = -(-chunk // RING_KEYS) * RING_KEYS
    return -(-max(s_max, 1) // chunk), chunk


def _split_slots(expr, dev):
    """Resident blocks of the split kernel on the device: SMs x blocks per SM."""
    return _sm_count(dev) * loader.blocks_per_sm(_kernel(SPLIT_MODULE, dev, expr), DECODE_THREADS)


def _cc(dev):
    """The arch the kernels run as on the device: its own, or an older one under GPUOPS_ARCH
    (compute_61 PTX on an H100 has no griddepcontrol: a PDL secondary would not wait, so PDL
    must not be used)."""
    return loader.runtime_target(SPLIT_MODULE, device.device_info(dev).cc).arch


def _pdl_ok(dev) -> bool:
    """Programmatic dependent launch: sm_90+ and a driver with cuLaunchKernelEx."""
    return _cc(dev) >= 90 and launch_ex_available()


# ---------------------------------------------------------------------------------------------
# Argument checks, shared by the GPU path and the references.

def _shape_str(s):
    return "[" + ", ".join(str(x) for x in s) + "]"


def _window_left(op, window_size):
    """-1 (no window) or the number of keys before a query's own position that it sees."""
    if window_size is None:
        return -1
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"gpuops.{op}: window_size={window_size!r}; expected None or "
                         "(left, right)") from None
    if int(left) != left or left < -1 or int(right) != right or right not in (0, -1):
        raise ValueError(f"gpuops.{op}: window_size={window_size!r}; expected (left, right) with "
                         "left >= 0 (or -1: unlimited) and right 0 or -1 (the query tokens are "
                         "the last of the sequence and attend causally)")
    return int(left)


def _scale(op, scale, dim):
    if scale is None:
        return 1.0 / math.sqrt(dim) if dim else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"gpuops.{op}: scale={scale!r}; expected a number or None")
    return float(scale)


def _check_q(op, q):
    if len(q) != 4:
        raise ValueError(f"gpuops.{op}: 'q' has shape {_shape_str(q)}; expected [B, Sq, Hq, D]")


def _check_common(op, q, k, v, seqlens, kname, vname):
    _check_q(op, q)
    if len(k) != 4:
        raise ValueError(f"gpuops.{op}: {kname!r} has shape {_shape_str(k)}; expected 4 dims")
    if tuple(v) != tuple(k):
        raise ValueError(f"gpuops.{op}: {vname!r} has shape {_shape_str(v)} but {kname!r} has "
                         f"{_shape_str(k)}; they must be the same")
    b, sq, hq, d = q
    hkv = k[2]
    if k[3] != d:
        raise ValueError(f"gpuops.{op}: {kname!r} has head dim {k[3]} but 'q' has {d}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"gpuops.{op}: 'q' has {hq} heads and {kname!r} {hkv}; the q heads must "
                         "be a multiple of the kv heads (GQA)")
    if tuple(seqlens) != (b,):
        raise ValueError(f"gpuops.{op}: 'cache_seqlens' has shape {_shape_str(seqlens)}; expected "
                         f"[{b}] (one length per sequence of q)")
    if d > GENERAL_D[-1]:
        raise ValueError(f"gpuops.{op}: head dim {d} is larger than {GENERAL_D[-1]}")


def _check_decode(q, k, v, seqlens):
    _check_common("decode_attention", q, k, v, seqlens, "k_cache", "v_cache")
    if k[0] != q[0]:
        raise ValueError(f"gpuops.decode_attention: 'k_cache' has batch {k[0]} but 'q' has {q[0]}")
    return k[1]                                   # S_max


def _check_paged(q, k, v, table, seqlens):
    op = "paged_attention"
    _check_common(op, q, k, v, seqlens, "k_pages", "v_pages")
    if len(table) != 2 or table[0] != q[0]:
        raise ValueError(f"gpuops.{op}: 'block_table' has shape {_shape_str(table)}; expected "
                         f"[{q[0]}, max_pages]")
    if k[1] < 1:
        raise ValueError(f"gpuops.{op}: 'k_pages' has page size {k[1]}; expected >= 1")
    return table[1] * k[1] if k[0] else 0         # S_max (an empty pool holds no key)


# ---------------------------------------------------------------------------------------------
# References (float64): the textbook formula per sequence, on the keys gathered from the cache.

def _ints(x, name, op):
    a = np.asarray(x)
    if a.dtype.kind == "f":
        if not np.all(np.isfinite(a)) or np.any(a != np.round(a)):
            raise ValueError(f"gpuops.{op}: {name!r} must hold integers")
    return a.astype(np.int64)


def _ref_attend(op, q, keys_of, lens, scale, left, return_lse):
    """q [B, Sq, Hq, D]; keys_of(b, n) -> (K, V) [n, Hkv, D] of the first n positions."""
    q = np.asarray(q, np.float64)
    b_, sq, hq, d = q.shape
    out = np.zeros(q.shape, np.float64)
    lse = np.full((b_, hq, sq), -np.inf)
    for b in range(b_):
        n = int(lens[b])
        if n == 0 or hq == 0 or sq == 0:
            continue
        kk, vv = keys_of(b, n)
        g = hq // kk.shape[1]
        kk = np.repeat(kk, g, axis=1)             # [n, Hq, D]
        vv = np.repeat(vv, g, axis=1)
        s = np.einsum("ihd,jhd->hij", q[b], kk) * scale           # [Hq, Sq, n]
        pos = n - sq + np.arange(sq)
        j = np.arange(n)
        vis = j[None, :] <= pos[:, None]
        if left >= 0:
            vis &= j[None, :] >= pos[:, None] - left
        s = np.where(vis[None], s, -np.inf)
        m = s.max(-1, keepdims=True)
        any_vis = vis.any(-1)                                      # [Sq]
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m)
        tot = p.sum(-1, keepdims=True)
        o = np.einsum("hij,jhd->ihd", p / np.where(tot > 0, tot, 1.0), vv)
        out[b] = np.where(any_vis[:, None, None], o, 0.0)
        with np.errstate(divide="ignore"):
            lse[b] = np.where(any_vis[None, :], (m + np.log(tot))[..., 0], -np.inf)
    return (out, lse) if return_lse else out


def ref_decode_attention(q, k_cache, v_cache, cache_seqlens, scale=None, window_size=None,
                         return_lse=False):
    op = "decode_attention"
    q, k, v = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    s_max = _check_decode(q.shape, k.shape, v.shape, np.shape(cache_seqlens))
    lens = _ints(cache_seqlens, "cache_seqlens", op)
    if lens.size and (lens.min() < 0 or lens.max() > s_max):
        raise ValueError(f"gpuops.{op}: 'cache_seqlens' has values in [{lens.min()}, "
                         f"{lens.max()}]; expected [0, {s_max}] (S_max of the cache)")
    return _ref_attend(op, q, lambda b, n: (k[b, :n], v[b, :n]), lens,
                       _scale(op, scale, q.shape[3]), _window_left(op, window_size), return_lse)


def _page_index(op, table, lens, page_size, num_pages):
    """Per sequence: the pool rows of its first lens[b] positions; checks the table entries."""
    def rows(b, n):
        j = np.arange(n)
        pages = table[b, j // page_size]
        if pages.size and (pages.min() < 0 or pages.max() >= num_pages):
            raise ValueError(f"gpuops.{op}: 'block_table' row {b} has page ids in "
                             f"[{pages.min()}, {pages.max()}] among its first {n} positions; "
                             f"expected [0, {num_pages})")
        return pages, j % page_size
    return rows


def ref_paged_attention(q, k_pages, v_pages, block_table, cache_seqlens, scale=None,
                        window_size=None, return_lse=False):
    op = "paged_attention"
    q, k, v = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    s_max = _check_paged(q.shape, k.shape, v.shape, np.shape(block_table), np.shape(cache_seqlens))
    table = _ints(block_table, "block_table", op)
    lens = _ints(cache_seqlens, "cache_seqlens", op)
    if lens.size and (lens.min() < 0 or lens.max() > s_max):
        raise ValueError(f"gpuops.{op}: 'cache_seqlens' has values in [{lens.min()}, "
                         f"{lens.max()}]; expected [0, {s_max}] (max_pages * page_size)")
    rows = _page_index(op, table, lens, k.shape[1], k.shape[0])

    def keys_of(b, n):
        pages, r = rows(b, n)
        return k[pages, r], v[pages, r]
    return _ref_attend(op, q, keys_of, lens, _scale(op, scale, q.shape[3]),
                       _window_left(op, window_size), return_lse)


def _ref_result_dtype(values, found):
    # lse in float32, as the kernels write it
    return (found["q"], dt.stat_dtype(found["q"])) if values.get("return_lse") else found["q"]


ref_decode_attention.result_dtype = _ref_result_dtype
ref_paged_attention.result_dtype = _ref_result_dtype


def _check_append(k, v, kp, vp, table, positions):
    op = "append_paged_kv"
    if len(k) != 4:
        raise ValueError(f"gpuops.{op}: 'k' has shape {_shape_str(k)}; expected [B, S_new, Hkv, D]")
    if tuple(v) != tuple(k):
        raise ValueError(f"gpuops.{op}: 'v' has shape {_shape_str(v)} but 'k' has "
                         f"{_shape_str(k)}; they must be the same")
    if len(kp) != 4 or tuple(kp[2:]) != tuple(k[2:]):
        raise ValueError(f"gpuops.{op}: 'k_pages' has shape {_shape_str(kp)}; expected "
                         f"[num_pages, page_size, {k[2]}, {k[3]}]")
    if tuple(vp) != tuple(kp):
        raise ValueError(f"gpuops.{op}: 'v_pages' has shape {_shape_str(vp)} but 'k_pages' has "
                         f"{_shape_str(kp)}; they must be the same")
    if kp[1] < 1:
        raise ValueError(f"gpuops.{op}: 'k_pages' has page size {kp[1]}; expected >= 1")
    if len(table) != 2 or table[0] != k[0]:
        raise ValueError(f"gpuops.{op}: 'block_table' has shape {_shape_str(table)}; expected "
                         f"[{k[0]}, max_pages]")
    if tuple(positions) == (k[0],):
        return False
    if tuple(positions) == (k[0], k[1]):
        return True
    raise ValueError(f"gpuops.{op}: 'positions' has shape {_shape_str(positions)}; expected "
                     f"[{k[0]}] (position of each sequence's first new token) or [{k[0]}, {k[1]}] "
                     "(one per token)")


def ref_append_paged_kv(k, v, k_pages, v_pages, block_table, positions):
    op = "append_paged_kv"
    k, v = np.asarray(k, np.float64), np.asarray(v, np.float64)
    kp, vp = np.array(k_pages, np.float64), np.array(v_pages, np.float64)
    per_token = _check_append(k.shape, v.shape, kp.shape, vp.shape, np.shape(block_table),
                              np.shape(positions))
    table = _ints(block_table, "block_table", op)
    pos = _ints(positions, "positions", op)
    ps, npages = kp.shape[1], kp.shape[0]
    for b in range(k.shape[0]):
        for t in range(k.shape[1]):
            p = int(pos[b, t]) if per_token else int(pos[b]) + t
            if p < 0:                            # padding
                continue
            if p // ps >= table.shape[1]:
                raise ValueError(f"gpuops.{op}: 'positions' puts token {t} of sequence {b} at "
                                 f"{p}, past the block table ({table.shape[1]} pages of {ps})")
            page = int(table[b, p // ps])
            if not 0 <= page < npages:
                raise ValueError(f"gpuops.{op}: 'block_table'[{b}, {p // ps}] = {page}; expected "
                                 f"[0, {npages})")
            kp[page, p % ps] = k[b, t]
            vp[page, p % ps] = v[b, t]
    return kp, vp


# ---------------------------------------------------------------------------------------------
# GPU paths.

def _aligned(*tensors) -> bool:
    acc = 0
    for t in tensors:
        acc |= t.ptr
    return acc % 16 == 0


def _fast(dtype, dim, k: Tensor, v: Tensor) -> bool:
    vec = _vec(dtype)
    if dim not in FAST_D or not _aligned(k, v):
        return False
    for t in (k, v):
        st, sh = t.strides, t.shape
        if st[3] != 1 or any(st[i] % vec for i in range(3) if sh[i] != 1):
            return False
    return True


_plans: dict = {}


def _plan(op, dtype, q: Tensor, k: Tensor, v: Tensor, s_max, fast, dev):
    key = (op, dtype, q.shape, k.shape, fast, dev, tuple(SPLIT.values()))
    p = _plans.get(key)
    if p is None:
        b, sq, hq, dim = q.shape
        hkv = k.shape[2]
        if fast:
            vec = _vec(dtype)
            rows = (hq // hkv) * sq
            rt = next((r for r in RTS if r >= rows and r <= _rt_max(dtype, dim, vec)),
                      _rt_max(dtype, dim, vec))
            dt_ = dim
        else:
            vec, rt = 1, 1
            dt_ = next(g for g in GENERAL_D if g >= dim)
        rows = (hq // hkv) * sq
        row_chunks = -(-rows // rt)
        paged = op == "paged_attention"
        expr = _split_expr(dtype, dt_, vec, rt, paged)
        nsplit, chunk = num_splits(b, hkv, row_chunks, s_max, _split_slots(expr, dev))
        p = (expr, rows, row_chunks, nsplit, chunk)
        if len(_plans) > 4096:
            _plans.clear()
        _plans[key] = p
    return p


def _st(t: Tensor, i):
    return t.strides[i] if t.shape[i] != 1 else 0


def _ring(call, op, dtype, q: Tensor, k: Tensor, v: Tensor, s_max, paged):
    """(kind, tensor maps or None) of the ring kernel that takes the call ('async' or 'tma', by
    RING and RING_KERNEL; paged: k and v are page pools), or None (the register kernel)."""
    if RING not in ("auto", "on", "off"):
        raise ValueError(f"gpuops.{op}: attention_decode.RING = {RING!r}; expected 'auto', "
                         "'on' or 'off'")
    if RING_KERNEL not in ("auto", "async", "tma"):
        raise ValueError(f"gpuops.{op}: attention_decode.RING_KERNEL = {RING_KERNEL!r}; "
                         "expected 'auto', 'async' or 'tma'")
    dim = q.shape[3]
    rows = (q.shape[2] // k.shape[2]) * q.shape[1]        # q rows per kv head
    if (RING == "off" or dtype not in _HALFS or dim not in RING_D or min(k.shape[:3]) < 1
            or _cc(call.device) < 80 or (RING == "auto" and rows < RING_MIN_ROWS and paged)):
        return None
    kind = RING_KERNEL if RING_KERNEL != "auto" else ("tma" if paged else "async")
    maps = None
    if kind == "tma":
        maps = _tma_maps(k, v, paged) if _cc(call.device) >= 90 else None
        if maps is None:
            return None
    elif not _fast(dtype, dim, k, v):
        return None
    if RING == "auto" and rows < RING_MIN_ROWS and num_splits_ring(
            q.shape[0], k.shape[2], 1, s_max, _sm_count(call.device))[0] > 1:
        return None                                        # 1 row: only without splits
    return kind, maps


def _tma_maps(k: Tensor, v: Tensor, paged):
    """(K map, V map) of decode_split_tma, or None where TMA cannot describe the caches."""
    if k.shape[1] >= 2 ** 31 or (paged and not _tma_page_ok(k.shape[1])):
        return None
    # [B, S_max, Hkv, D] (a page pool [num_pages, page_size, Hkv, D] alike) is the flash kernels'
    # 'bshd': the same tensor map, boxes of 64 columns x box_rows keys (whole pages up to 64)
    box_rows = min(k.shape[1], RING_KEYS) if paged else RING_KEYS
    b_, s_, h_, d_ = k.shape
    km = fwd._tma_map(k, "bshd", (b_, h_, s_, d_), box_rows)
    vm = fwd._tma_map(v, "bshd", (b_, h_, s_, d_), box_rows) if km is not None else None
    return (km, vm) if vm is not None else None


def _plan_ring(op, dtype, q: Tensor, k: Tensor, s_max, dev, ring):
    """(kernel, rows, row chunks, splits, chunk) of a ring kernel ('tma' or 'async')."""
    key = (ring, op, dtype, q.shape, k.shape, dev, tuple(RING_SPLIT.values()),
           tuple(ASYNC_STAGES.items()))
    p = _plans.get(key)
    if p is None:
        b, sq, hq, dim = q.shape
        hkv = k.shape[2]
        rows = (hq // hkv) * sq
        row_chunks = -(-rows // RING_ROWS)
        nsplit, chunk = num_splits_ring(b, hkv, row_chunks, s_max, _sm_count(dev))
        paged = op == "paged_attention"
        expr = _tma_expr(dtype, dim, paged) if ring == "tma" else _async_expr(dtype, dim, paged)
        p = (expr, rows, row_chunks, nsplit, chunk)
        if len(_plans) > 4096:
            _plans.clear()
        _plans[key] = p
    return p


def _attend(call, op, q, k, v, seqlens, table, s_max, scale, window_size, return_lse):
    dtype = call.result_dtype
    b, sq, hq, dim = q.shape
    hkv = k.shape[2]
    left = _window_left(op, window_size)
    sc = _scale(op, scale, dim)
    out = call.empty((b, sq, hq, dim), dtype)
    lse = call.empty((b, hq, sq), dt.float32) if return_lse else None
    if out.numel == 0:
        return (out, lse) if return_lse else out
    ring = _ring(call, op, dtype, q, k, v, s_max, table is not None)
    if ring is not None:
        expr, rows, row_chunks, nsplit, chunk = _plan_ring(op, dtype, q, k, s_max, call.device,
                                                           ring[0])
    else:
        expr, rows, row_chunks, nsplit, chunk = _plan(
            op, dtype, q, k, v, s_max, _fast(dtype, dim, k, v), call.device)
    nrows = b * hq * sq
    block_rows = b * hkv * row_chunks
    if PDL not in ("off", "combine", "all"):
        raise ValueError(f"gpuops.{op}: attention_decode.PDL = {PDL!r}; expected 'off', "
                         "'combine' or 'all'")
    pdl = PDL != "off" and _pdl_ok(call.device)
    # A ring kernel with one split writes the output itself (what the combine makes of one
    # split, bit for bit): no workspace, no second launch (H200 run 228: the combine cost 2.7 us
    # of B16 S4096 GQA 16/8's 67.8, 6.0 of 64/8's 73.0).
    direct = ring is not None and nsplit == 1
    # bit 0: the combine follows (PDL secondary): let it be scheduled; bit 1: wait for the
    # previous kernel (this launch is a PDL secondary itself)
    pdl_flags = ((0 if direct else 1) | (2 if PDL == "all" else 0)) if pdl else 0
    split_attrs = {"attrs": _PDL_ATTRS} if pdl and PDL == "all" else {}
    if direct:
        ws_ptrs = (0, 0, out.ptr, 0 if lse is None else lse.ptr)
    else:
        ws_o = call.empty((nrows * nsplit * dim,), dt.float32)
        ws_lse = call.empty((nrows * nsplit,), dt.float32)
        ws_ptrs = (ws_o.ptr, ws_lse.ptr, 0, 0)
    if table is None:
        tab_ptr, ts0, ts1, page_size, num_pages = 0, 0, 0, 0, 0
    else:
        tab_ptr, ts0, ts1 = table.ptr, _st(table, 0), _st(table, 1)
        page_size, num_pages = k.shape[1], k.shape[0]
    lse_ptr = 0 if lse is None else lse.ptr
    if ring is not None and ring[0] == "async":
        _kernel(ASYNC_MODULE, call.device, expr).launch(
            (block_rows, nsplit, 1), (ASYNC_THREADS, 1, 1), call.stream,
            q.ptr, k.ptr, v.ptr, seqlens.ptr, tab_ptr, *ws_ptrs,
            *(_st(q, i) for i in range(4)), *(_st(k, i) for i in range(3)),
            *(_st(v, i) for i in range(3)), _st(seqlens, 0), ts0, ts1, s_max, sq, hq, hkv, rows,
            row_chunks, chunk, nsplit, left, pdl_flags, *fast_divider(max(page_size, 1)),
            num_pages, sc * 1.4426950408889634, smem=_async_smem(dim, table is not None),
            **split_attrs)
    elif ring is not None:
        _kernel(TMA_MODULE, call.device, expr).launch(
            (block_rows, nsplit, 1), (TMA_THREADS, 1, 1), call.stream, *ring[1],
            q.ptr, seqlens.ptr, tab_ptr, *ws_ptrs, *(_st(q, i) for i in range(4)),
            _st(seqlens, 0), ts0, ts1, s_max, sq, hq, hkv, rows, row_chunks, chunk, nsplit, left,
            pdl_flags, page_size, num_pages, sc * 1.4426950408889634, smem=_tma_smem(dim),
            **split_attrs)
    else:
        _kernel(SPLIT_MODULE, call.device, expr).launch(
            (block_rows, nsplit, 1), (DECODE_THREADS, 1, 1), call.stream,
            q.ptr, k.ptr, v.ptr, seqlens.ptr, tab_ptr, ws_o.ptr, ws_lse.ptr,
            *(_st(q, i) for i in range(4)), *(_st(k, i) for i in range(4)),
            *(_st(v, i) for i in range(4)), _st(seqlens, 0), ts0, ts1,
            page_size, num_pages, s_max, sq, hq, hkv, dim, rows, row_chunks, chunk, nsplit, left,
            pdl_flags, sc * 1.4426950408889634, **split_attrs)
    if direct:
        return (out, lse) if return_lse else out
    _kernel(COMBINE_MODULE, call.device, f"gpuops::decode_combine<{dtype.ctype}>").launch(
        (nrows, 1, 1), (DECODE_THREADS, 1, 1), call.stream,
        ws_o.ptr, ws_lse.ptr, out.ptr, lse_ptr, nsplit, dim, sq, hq,
        **({"attrs": _PDL_ATTRS} if pdl else {}))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Benchmarks: GQA 16/8, head dim 128, one query token, full caches; bytes = K + V read.
# Shape (B, S, Hq, Hkv, D).

def _default_shape(d):
    return (1, 8192, 16, 8, 128)


def _ints_like(x, values):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch.tensor(values, dtype=torch.int32, device=x.device)
    if type(x).__module__.split(".")[0] == "cupy":
        return device.cupy_or_none().asarray(np.asarray(values, np.int32))
    return np.asarray(values, np.int32)


def _make_contig(shape, d, randn):
    b, s, hq, hkv, dim = shape
    q = randn((b, 1, hq, dim), d)
    return (q, randn((b, s, hkv, dim), d), randn((b, s, hkv, dim), d),
            _ints_like(q, [s] * b)), {}


def _make_paged(shape, d, randn, page_size=16):
    b, s, hq, hkv, dim = shape
    per = -(-s // page_size)
    q = randn((b, 1, hq, dim), d)
    perm = np.random.default_rng(0).permutation(b * per).reshape(b, per)
    return (q, randn((b * per, page_size, hkv, dim), d), randn((b * per, page_size, hkv, dim), d),
            _ints_like(q, perm.tolist()), _ints_like(q, [s] * b)), {}


def _kv_bytes(args, out):
    k, v = args[1], args[2]
    return sum(int(x.numel() * x.element_size()) if hasattr(x, "element_size") else int(x.nbytes)
               for x in (k, v))


def _sdpa(q, k, v):
    import torch  # noqa: PLC0415
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def _sdpa_contig(q, k, v, seqlens):
    return _sdpa(q, k, v)


def _sdpa_paged(q, kp, vp, table, seqlens):
    # the peer reads the same pages gathered to a contiguous cache: the gather is part of its cost
    b = q.shape[0]
    k = kp[table.reshape(-1).long()].reshape(b, -1, kp.shape[2], kp.shape[3])
    v = vp[table.reshape(-1).long()].reshape(b, -1, vp.shape[2], vp.shape[3])
    return _sdpa(q, k, v)


def _check_shape(shape):
    b, s, hq, hkv, dim = shape
    return (min(b, 2), min(s, 2048), hq, hkv, dim)


BENCH_SHAPES = ((16, 4096, 16, 8, 128), (1, 8192, 64, 8, 128))   # + GQA 8

_DECODE_BENCH = BenchSpec(make_inputs=_make_contig, torch_fn=_sdpa_contig,
                          default_shape=_default_shape, bytes_moved=_kv_bytes,
                          check_shape=_check_shape, extra_shapes=BENCH_SHAPES)
_PAGED_BENCH = BenchSpec(make_inputs=_make_paged, torch_fn=_sdpa_paged,
                         default_shape=_default_shape, bytes_moved=_kv_bytes,
                         check_shape=_check_shape, extra_shapes=BENCH_SHAPES)


# ---------------------------------------------------------------------------------------------
# The ops.

@register(family="attention", reference=ref_decode_attention, bench=_DECODE_BENCH,
          param_dtypes={"cache_seqlens": INT_DTYPES})
def decode_attention(call, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, *,
                     scale: float | None = None, window_size=None,
                     return_lse: bool = False) -> Tensor:
    """Attention of a few new query tokens against a KV cache (decode), split-KV.

    ``q`` ``[B, Sq, Hq, D]`` (Sq = 1..8 new tokens), ``k_cache``/``v_cache`` ``[B, S_max, Hkv, D]``
    (the layout a cache is written in; any strides), ``cache_seqlens`` int32 ``[B]`` on the device:
    sequence ``b`` holds ``cache_seqlens[b]`` tokens, the new ones included, and its Sq query
    tokens are its last Sq positions (``pos = len - Sq + i``), attending causally:
    ``out[b, i, h] = softmax(scale * q[b, i, h] . K[b, j, h // (Hq/Hkv)], j <= pos) @ V`` (GQA:
    ``Hq % Hkv == 0``). ``window_size=(left, 0)`` limits each query to keys ``pos - left .. pos``
    (FlashAttention's convention; ``left = -1``: unlimited). ``scale`` defaults to
    ``1/sqrt(D)``. ``return_lse=True`` also returns the natural log-sum-exp of the scores,
    ``[B, Hq, Sq]`` float32 on the GPU (``-inf`` for a row that sees no key, whose output is 0).
    Equivalent to torch's SDPA on the first ``len`` cache rows with the bottom-right causal mask.

    The lengths are read on the device, so the call is capturable in a CUDA graph and can be
    replayed with other lengths; lengths outside ``[0, S_max]`` are clamped on the GPU (ValueError
    on the CPU path). fp32 math for fp16/bf16/fp32 storage; head dims 64/128/256 with 16-byte
    aligned, last-dim-contiguous caches take the 16-byte path, any other head dim (up to 1024)
    or layout the one-element path. On the CPU path the lse comes back in q's dtype.

    Two launches: the split kernel (each split of the keys writes its partial output and
    log-sum-exp to a workspace; on sm_80+ with fp16/bf16, head dim 64 or 128 and 2 or more q rows
    per kv head a tensor-core kernel fed by a cp.async ring, ``attention_decode.RING``) and the
    combine, which merges them (on sm_90 launched as a programmatic dependent of the split kernel:
    ``attention_decode.PDL``); one launch where the ring kernel needs no splits. No state is kept
    between calls: calls on different streams and graphs replayed at the same time are
    independent.
    """
    s_max = _check_decode(q.shape, k_cache.shape, v_cache.shape, cache_seqlens.shape)
    return _attend(call, "decode_attention", q, k_cache, v_cache, cache_seqlens, None, s_max,
                   scale, window_size, return_lse)


@register(family="attention", reference=ref_paged_attention, bench=_PAGED_BENCH,
          param_dtypes={"cache_seqlens": INT_DTYPES, "block_table": INT_DTYPES})
def paged_attention(call, q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                    cache_seqlens: Tensor, *, scale: float | None = None, window_size=None,
                    return_lse: bool = False) -> Tensor:
    """Decode attention on a paged KV cache (vLLM-style block table); same math as
    :func:`decode_attention`.

    ``k_pages``/``v_pages`` ``[num_pages, page_size, Hkv, D]``, ``block_table`` int32
    ``[B, max_pages]``: position ``j`` of sequence ``b`` is row ``j % page_size`` of page
    ``block_table[b, j // page_size]``. ``cache_seqlens`` int32 ``[B]`` (at most
    ``max_pages * page_size``). The kernels of :func:`decode_attention` with a page indirection
    (on sm_90 from 2 q rows per kv head the TMA-fed ring, for pages of 8..64 keys dividing 64 or
    multiples of 64); page ids outside ``[0, num_pages)`` are clamped on the GPU (never read out
    of bounds; ValueError on the CPU path).
    """
    s_max = _check_paged(q.shape, k_pages.shape, v_pages.shape, block_table.shape,
                         cache_seqlens.shape)
    return _attend(call, "paged_attention", q, k_pages, v_pages, cache_seqlens, block_table,
                   s_max, scale, window_size, return_lse)


@register(family="attention", reference=ref_append_paged_kv,
          param_dtypes={"block_table": INT_DTYPES, "positions": INT_DTYPES})
def append_paged_kv(call, k: Tensor, v: Tensor, k_pages: Tensor, v_pages: Tensor,
                    block_table: Tensor, positions: Tensor):
    """Write new tokens' K and V into a paged cache, in place; returns ``(k_pages, v_pages)``.

    ``k``/``v`` ``[B, S_new, Hkv, D]``; ``k_pages``/``v_pages`` ``[num_pages, page_size, Hkv, D]``;
    ``block_table`` int32 ``[B, max_pages]``; ``positions`` int32 ``[B]`` (token ``t`` of sequence
    ``b`` goes to position ``positions[b] + t``, e.g. the cache length before the append) or
    ``[B, S_new]`` (one position per token). Position ``p`` is row ``p % page_size`` of page
    ``block_table[b, p // page_size]``. A negative position writes nothing (padding). On the GPU
    a position past the table or a page id outside the pool also writes nothing (no host check);
    the CPU path raises ValueError for those. The pages are updated in place for every framework
    (NumPy and CPU torch arrays too: the CPU result is copied back into them). Reads the lengths
    and positions on the device: capturable in a CUDA graph.
    """
    per_token = _check_append(k.shape, v.shape, k_pages.shape, v_pages.shape, block_table.shape,
                              positions.shape)
    b, sn, hkv, dim = k.shape
    total = b * sn * hkv * dim
    if total:
        grid = min(-(-total // APPEND_THREADS), 65535 * 8)
        _kernel(APPEND_MODULE, call.device,
                f"gpuops::append_paged_kv<{call.result_dtype.ctype}>").launch(
            (grid, 1, 1), (APPEND_THREADS, 1, 1), call.stream,
            k.ptr, v.ptr, k_pages.ptr, v_pages.ptr, block_table.ptr, positions.ptr,
            *(_st(k, i) for i in range(4)), *(_st(v, i) for i in range(4)),
            *(k_pages.strides[i] for i in range(4)), *(v_pages.strides[i] for i in range(4)),
            _st(block_table, 0), _st(block_table, 1), _st(positions, 0),
            _st(positions, 1) if per_token else 0,
            int(per_token), k_pages.shape[1], k_pages.shape[0], block_table.shape[1], sn, hkv,
            dim, total)
    return k_pages, v_pages


def _in_place(fn):
    """The registry's function returns the pages the kernel wrote (the caller's own arrays for
    CuPy and CUDA torch) or new arrays (CPU reference path; NumPy staged through the GPU): copy
    those back so that the update is in place for every framework."""
    def append_paged_kv(k, v, k_pages, v_pages, block_table, positions):
        kp, vp = fn(k, v, k_pages, v_pages, block_table, positions)
        for new, dst in ((kp, k_pages), (vp, v_pages)):
            if new is not dst:
                if hasattr(dst, "copy_"):
                    dst.copy_(new)
                else:
                    np.copyto(dst, new)
        return k_pages, v_pages
    for attr in ("__doc__", "__signature__", "__qualname__", "__module__", "op"):
        setattr(append_paged_kv, attr, getattr(fn, attr))
    return append_paged_kv


_get_op("append_paged_kv").function = append_paged_kv = _in_place(append_paged_kv)
