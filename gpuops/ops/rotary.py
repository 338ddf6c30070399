"""Rotary position embeddings (RoPE) of q and k, and Qwen3's fused q/k RMSNorm + RoPE.

Kernels: cuda_src/rotary/rope.cu (apply_rotary and its backward), cuda_src/rotary/qk_norm_rope.cu
(qk_norm_rotary, its backward and the weight-gradient reduction), shared pieces in
cuda_src/rotary/rope_common.cuh. fp32 math for fp32/fp16/bf16 storage; q and k are read once and
the results written once, in one launch for both.

Layouts (every op of the family):

* ``q`` ``[B, S, Hq, D]`` and ``k`` ``[B, S, Hk, D]`` (the layout before HF's ``transpose(1, 2)``),
  or packed (varlen) ``[T, Hq, D]`` and ``[T, Hk, D]``; ``Hq != Hk`` (GQA/MQA) is fine. Any strides;
  heads whose last dim is contiguous and 16-byte aligned take the vectorized kernels.
* ``rotary_dim`` (default ``D``): the first ``rotary_dim`` elements of each head rotate, the rest
  pass through unchanged (partial rotary: GPT-NeoX ``rotary_pct``, Phi, GLM, ...).
* ``interleaved=False``: GPT-NeoX / Llama / HF ``rotate_half`` pairs ``(x[j], x[j + R/2])``;
  ``interleaved=True``: GPT-J pairs ``(x[2j], x[2j + 1])``. Pair ``j`` turns by the angle of
  frequency ``j``.
* ``cos``/``sin`` (same shape and dtype: q's dtype or float32), last dim ``W``:
  ``W = R/2`` is one value per frequency; ``W = R`` is HF's duplicated layout (NeoX:
  ``cat(freqs, freqs)``, GPT-J: ``repeat_interleave(freqs, 2)``), of which one copy is read.
  Leading dims, by case (the row of token ``(b, s)``):

  - no positions: ``[S', W]`` or ``[B or 1, S', W]`` (``S' >= S``), row ``s``;
  - ``positions`` ``[B, S]`` or ``[S]`` (packed: ``[T]``): a table ``[P, W]``, row
    ``positions[b, s]``;
  - M-RoPE without positions: ``[3, S', W]`` or ``[3, B or 1, S', W]`` (one table per stream),
    row ``s``;
  - M-RoPE with positions ``[3, B, S]`` or ``[3, S]`` (packed: ``[3, T]``): a table ``[P, W]``,
    row ``positions[stream, b, s]``.

  HF's ``position_embeddings`` (``cos, sin`` of shape ``[B, S, D]``, or ``[3, B, S, D]`` for
  Qwen2-VL) are taken as they are (Qwen3-VL's, already merged per frequency by its rotary
  embedding, need no M-RoPE option). Positions are int32 or int64; a position outside ``[0, P)``
  makes that token's rotated elements NaN on the GPU (there is no bounds error without a host
  sync) and raises ValueError on the CPU path.
* Multi-section RoPE (M-RoPE, Qwen2-VL / Qwen2.5-VL / Qwen3-VL): ``mrope_section=(t, h, w)``
  (``t + h + w = R/2``) gives frequency ``f`` the position of stream 0 (temporal), 1 (height) or
  2 (width): with ``mrope_interleaved=False`` (Qwen2-VL's ``apply_multimodal_rotary_pos_emb``) in
  contiguous sections ``f < t``, ``f < t + h``, else; with ``mrope_interleaved=True`` (Qwen3-VL's
  ``apply_interleaved_mrope``) ``f % 3 == 1 and f < 3h`` -> height, ``f % 3 == 2 and f < 3w`` ->
  width, else temporal.
"""
from __future__ import annotations

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.registry import register
from gpuops.runtime import device, loader
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.tensor import Tensor

THREADS = 256                      # kRopeThreads
BWD_MIN_BLOCKS_OLD, BWD_MIN_BLOCKS = 2, 3   # kNormBwdMinBlocks of qk_norm_rope_bwd (< sm_75, later)
BWD2_MIN_BLOCKS = 2                # kNormBwd2MinBlocks of qk_norm_rope_bwd2 (every arch)
BWD_SMEM_FLOATS = 4096             # red[] of qk_norm_rope_bwd: (256 / group) * D must fit
FWD3_MIN_BLOCKS = 4                # __launch_bounds__ of qk_norm_rope_fwd3 (every arch)
# qk_norm_rotary's 16-byte forward: "fwd2" (one row per lane, one-shot blocks, any table /
# weight layout), "fwd3" (persistent grid, each lane's next row loaded ahead, weights in shared
# memory), "fwd4" (fwd2's blocks without its fallback paths, x and cos/sin words read before
# the row's reduction, weight words after it, 48 registers), or "auto": fwd4 where its conditions hold (_fwd4_ok), else fwd3
# for float16 (_fwd3_ok), else fwd2. H100, graph replay, [4, 4096, 32, 8, 128], us, fwd2 / fwd3
# / fwd4 (runs 67-68): bf16 130.4 / 132.7-133.1 / 116.5, fp16 156.4 / 132.6-132.9 / 117.1, fp32
# 243.2-243.3 / 256.7-256.9 / 226.8-227.0 (copy-bound floor 111.8 / 111.8 / 223.7).
QK_NORM_FORWARD = "auto"
TABLE_DTYPES = (dt.float32, dt.float16, dt.bfloat16, dt.float64)   # float64: CPU path only
POSITION_DTYPES = (dt.int64, dt.int32)

# struct RopeQK, RopeTables, NormArgs of cuda_src/rotary/rope_common.cuh
ROPE_QK, ROPE_TABLES, NORM_ARGS = "4P18q5if", "3P12q4i", "5P10qf2i"
ROPE_ARGS = ArgSpec(ROPE_QK, ROPE_TABLES)
NORM_KERNEL_ARGS = ArgSpec(ROPE_QK, ROPE_TABLES, NORM_ARGS)
REDUCE_ARGS = ArgSpec("ptr", "ptr", "ptr", "i32", "i32", "i32")

# (data dtype, table dtype): the table is in the data's dtype or float32
_PAIRS = [(d, d) for d in dt.FLOATS] + [(d, dt.float32) for d in dt.FLOATS if d is not dt.float32]


def _vec(d):
    return 16 // d.itemsize


def _rope_expr(d, c, v):
    return f"gpuops::rope_kernel<{d.ctype}, {c.ctype}, {v}>"


def _norm_expr(kind, d, c, v):
    return f"gpuops::qk_norm_rope_{kind}<{d.ctype}, {c.ctype}, {v}>"


def _reduce_expr(c):
    return f"gpuops::qk_norm_dw_reduce<{c.ctype}>"


ROPE_MODULE = KernelModule("rotary.rope", "rotary/rope.cu", {
    _rope_expr(d, c, v): ROPE_ARGS for d, c in _PAIRS for v in (_vec(d), 1)}, pdl=True)
NORM_MODULE = KernelModule("rotary.qk_norm_rope", "rotary/qk_norm_rope.cu", {
    # element-wise kernels (v = 1: unaligned or odd head dims) and 16-byte-pack kernels (fwd2 /
    # bwd2: loads issued before the row's reduction, 16-byte weight and table words). The first
    # 16-byte versions of fwd / bwd lost to these on all four measurements of run 13 (fwd bf16
    # 163.1 vs 132.8 us, bwd 227.6 vs 192.4 us) and are no longer instantiated.
    **{_norm_expr(kind, d, c, 1): NORM_KERNEL_ARGS for kind in ("fwd", "bwd")
       for d, c in _PAIRS},
    **{_norm_expr(kind, d, c, _vec(d)): NORM_KERNEL_ARGS for kind in ("fwd2", "bwd2")
       for d, c in _PAIRS},
    **{_norm_expr(kind, d, d, _vec(d)): NORM_KERNEL_ARGS for kind in ("fwd3", "fwd4")
       for d in dt.FLOATS},
    **{_reduce_expr(c): REDUCE_ARGS for c in dt.FLOATS}}, pdl=True)

_bwd_grids: dict = {}
_fwd3_grids: dict = {}


def _kernel(module, dev, expr):
    return loader.kernel(module, dev, expr)


def _bwd_grid(dev):
    """Persistent blocks of the fused backward: every block resident at once."""
    n = _bwd_grids.get(dev)
    if n is None:
        info = device.device_info(dev)
        n = _bwd_grids[dev] = info.sm_count * (BWD_MIN_BLOCKS if info.cc >= 75 else
                                               BWD_MIN_BLOCKS_OLD)
    return n


def _fwd3_grid(dev, rows, slots):
    """Persistent blocks of qk_norm_rope_fwd3: at most one resident wave."""
    n = _fwd3_grids.get(dev)
    if n is None:
        n = _fwd3_grids[dev] = device.device_info(dev).sm_count * FWD3_MIN_BLOCKS
    return min(n, -(-rows // slots))


def _table_words_ok(p, interleaved, dtype, tdtype, cos: Tensor, sin: Tensor) -> bool:
    """What fwd3 and fwd4 need beyond fwd2's 16-byte packs: GPT-NeoX halves, tables in q's
    dtype, one stream at unit column stride, cos and sin with the same batch and row strides and
    16-byte aligned rows."""
    if interleaved or tdtype is not dtype or p.mrope_mode:
        return False
    cs, ss = _tab_strides(p, cos), _tab_strides(p, sin)
    v = _vec(dtype)
    return (cs[3] == 1 and ss[3] == 1 and cs[1:3] == ss[1:3] and cs[1] % v == 0
            and cs[2] % v == 0 and (cos.ptr | sin.ptr) % 16 == 0)


def _fwd3_ok(p, interleaved, dtype, tdtype, cos: Tensor, sin: Tensor, rows, step) -> bool:
    """qk_norm_rope_fwd3's conditions: asked for, or "auto" with float16 (where fwd4's weight
    conditions failed: fwd3 reads weights of any stride), the table words', and rows plus one grid
    step (its 32-bit row counter) below 2^31."""
    if not (QK_NORM_FORWARD == "fwd3" or (QK_NORM_FORWARD == "auto" and dtype is dt.float16)):
        return False
    return _table_words_ok(p, interleaved, dtype, tdtype, cos, sin) and rows + step < 2 ** 31


def _fwd4_ok(p, interleaved, dtype, tdtype, cos: Tensor, sin: Tensor, q_weight: Tensor,
             k_weight: Tensor, rows, slots) -> bool:
    """qk_norm_rope_fwd4's conditions: the table words', weights at unit stride with 16-byte
    aligned bases (read as 16-byte words), and the grid's rows (32-bit) below 2^31."""
    if QK_NORM_FORWARD not in ("fwd4", "auto"):
        return False
    return (_table_words_ok(p, interleaved, dtype, tdtype, cos, sin)
            and _weight_stride(q_weight) == 1 and _weight_stride(k_weight) == 1
            and (q_weight.ptr | k_weight.ptr) % 16 == 0 and rows + slots < 2 ** 31)


# ---------------------------------------------------------------------------------------------
# Shapes and options -> a plan (validated once per combination, cached; shared by the GPU path
# and the NumPy references so both raise the same errors).

class _Plan:
    __slots__ = ("batch", "seq", "hq", "hk", "d", "r", "half", "dup", "packed", "tab_dims",
                 "col_mult", "pos_dims", "rows_dim", "mrope_mode", "sec_a", "sec_b", "stream_of")


def _shape_str(s):
    return "[" + ", ".join(str(x) for x in s) + "]"


def _make_plan(op, q, k, cos, sin, positions, interleaved, rotary_dim, mrope_section,
               mrope_interleaved) -> _Plan:
    """q, k, cos, sin, positions: shapes (positions None when absent)."""
    q, k, cos, sin = tuple(q), tuple(k), tuple(cos), tuple(sin)
    if len(q) not in (3, 4):
        raise ValueError(f"gpuops.{op}: 'q' has shape {_shape_str(q)}; expected [B, S, Hq, D] or "
                         "packed [T, Hq, D]")
    if len(k) != len(q) or k[:-2] != q[:-2] or k[-1] != q[-1]:
        raise ValueError(f"gpuops.{op}: 'k' has shape {_shape_str(k)} but 'q' has {_shape_str(q)}; "
                         "they must agree in every dim but the heads")
    p = _Plan()
    p.packed = len(q) == 3
    p.batch, p.seq = (1, q[0]) if p.packed else (q[0], q[1])
    p.hq, p.hk, p.d = q[-2], k[-2], q[-1]
    if cos != sin:
        raise ValueError(f"gpuops.{op}: 'cos' has shape {_shape_str(cos)} but 'sin' has "
                         f"{_shape_str(sin)}; they must be the same")
    if not cos:
        raise ValueError(f"gpuops.{op}: 'cos' must have at least one dim (the frequencies)")
    w = cos[-1]
    if rotary_dim is None:
        if w not in (p.d, p.d // 2) or p.d % 2 or p.d < 2:
            raise ValueError(
                f"gpuops.{op}: 'cos' has {w} columns and the head dim is {p.d}: a full rotary "
                f"table has D/2 = {p.d / 2:g} (one per frequency) or D = {p.d} (HF's duplicated "
                "layout); for partial rotary pass rotary_dim")
        r = p.d
    else:
        r = int(rotary_dim)
        if r != rotary_dim or r < 2 or r % 2 or r > p.d:
            raise ValueError(f"gpuops.{op}: rotary_dim={rotary_dim!r}; expected an even number in "
                             f"[2, {p.d}] (the head dim)")
        if w not in (r, r // 2):
            raise ValueError(f"gpuops.{op}: 'cos' has {w} columns; with rotary_dim={r} expected "
                             f"{r // 2} (one per frequency) or {r} (HF's duplicated layout)")
    p.r, p.half = r, r // 2
    p.dup = w == r and w != r // 2
    p.col_mult = 2 if (p.dup and interleaved) else 1

    # M-RoPE
    if mrope_section is None:
        if mrope_interleaved:
            raise ValueError(f"gpuops.{op}: mrope_interleaved=True needs mrope_section")
        p.mrope_mode, p.sec_a, p.sec_b = 0, 0, 0
        p.stream_of = None
    else:
        sec = tuple(mrope_section)
        if (len(sec) != 3 or any(int(x) != x or x < 0 for x in sec)
                or sum(sec) != p.half):
            raise ValueError(f"gpuops.{op}: mrope_section={mrope_section!r}; expected three "
                             f"non-negative ints (t, h, w) summing to rotary_dim / 2 = {p.half}")
        t, h, ww = (int(x) for x in sec)
        f = np.arange(p.half)
        if mrope_interleaved:
            p.mrope_mode, p.sec_a, p.sec_b = 2, 3 * h, 3 * ww
            p.stream_of = np.where((f % 3 == 1) & (f < 3 * h), 1,
                                   np.where((f % 3 == 2) & (f < 3 * ww), 2, 0))
        else:
            p.mrope_mode, p.sec_a, p.sec_b = 1, t, t + h
            p.stream_of = np.where(f < t, 0, np.where(f < t + h, 1, 2))
    mrope = p.mrope_mode != 0

    lead = cos[:-1]
    bdesc = "[T]" if p.packed else "[B, S] or [S]"
    if positions is None:
        # tables indexed by the sequence index: (stream, batch, row) dims of cos
        want = (1 if mrope else 0)
        if len(lead) == want + 1:
            dims = (0 if mrope else None, None, want)
        elif len(lead) == want + 2:
            nb = lead[want]
            if nb not in (1, p.batch):
                raise ValueError(f"gpuops.{op}: 'cos' has shape {_shape_str(cos)}: its batch dim "
                                 f"{nb} is neither 1 nor the batch of q ({p.batch})")
            dims = (0 if mrope else None, want if nb != 1 else None, want + 1)
        else:
            exp = ("[3, S, W] or [3, B, S, W]" if mrope else "[S, W] or [B, S, W]")
            raise ValueError(f"gpuops.{op}: 'cos' has shape {_shape_str(cos)}; without positions "
                             f"expected {exp}")
        if mrope and lead[0] != 3:
            raise ValueError(f"gpuops.{op}: 'cos' has shape {_shape_str(cos)}; M-RoPE tables "
                             "without positions have 3 streams first: [3, S, W] or [3, B, S, W]")
        if lead[dims[2]] < p.seq:
            raise ValueError(f"gpuops.{op}: 'cos' has {lead[dims[2]]} rows but the sequence has "
                             f"{p.seq} tokens (without positions, token s uses row s)")
        p.tab_dims = dims
        p.pos_dims = None
        p.rows_dim = dims[2]
    else:
        pos = tuple(positions)
        if len(lead) != 1:
            raise ValueError(f"gpuops.{op}: 'cos' has shape {_shape_str(cos)}; with positions "
                             "expected a table [P, W]")
        p.tab_dims = (None, None, 0)
        p.rows_dim = 0
        body = pos[1:] if mrope else pos
        if mrope and (not pos or pos[0] != 3):
            raise ValueError(f"gpuops.{op}: 'positions' has shape {_shape_str(pos)}; M-RoPE "
                             f"expects [3, ...] with {bdesc} after the streams")
        off = 1 if mrope else 0
        if p.packed:
            ok = body == (p.seq,)
            dims = (0 if mrope else None, None, off)
        elif body == (p.batch, p.seq):
            ok = True
            dims = (0 if mrope else None, off if p.batch != 1 else None, off + 1)
        elif body in ((p.seq,), (1, p.seq)):
            ok = True
            dims = (0 if mrope else None, None, off + len(body) - 1)
        else:
            ok = False
        if not ok:
            raise ValueError(f"gpuops.{op}: 'positions' has shape {_shape_str(pos)}; expected "
                             f"{'[3] + ' if mrope else ''}{bdesc} for q of shape {_shape_str(q)}")
        p.pos_dims = dims
    return p


_plans: dict = {}


def _plan(op, q, k, cos, sin, positions, interleaved, rotary_dim, mrope_section,
          mrope_interleaved) -> _Plan:
    sec = tuple(mrope_section) if mrope_section is not None else None
    key = (op, tuple(q), tuple(k), tuple(cos), tuple(sin),
           None if positions is None else tuple(positions), bool(interleaved), rotary_dim, sec,
           bool(mrope_interleaved))
    p = _plans.get(key)
    if p is None:
        p = _make_plan(op, q, k, cos, sin, positions, interleaved, rotary_dim, mrope_section,
                       mrope_interleaved)
        if len(_plans) > 4096:
            _plans.clear()
        _plans[key] = p
    return p


# ---------------------------------------------------------------------------------------------
# Kernel arguments. Everything but the pointers depends only on shapes, strides, dtypes, options
# and the pointers' 16-byte alignment: it is worked out once per combination and cached, so a call
# at decode sizes is a dict lookup, the output allocations and the launch.

def _qk_strides(p, t: Tensor):
    """(b, s, h, d) strides in elements of q/k/output; 0 for dims of size 1 (never stepped)."""
    sh, st = t.shape, t.strides
    if p.packed:
        return (0, st[0] if sh[0] != 1 else 0, st[1] if sh[1] != 1 else 0,
                st[2] if sh[2] != 1 else 0)
    return tuple(s if n != 1 else 0 for n, s in zip(sh, st))


def _tab_strides(p, t: Tensor):
    sm, sb, sr = (t.strides[i] if i is not None and t.shape[i] != 1 else 0 for i in p.tab_dims)
    return (sm, sb, sr, t.strides[-1] * p.col_mult)


def _check_table_dtypes(op, dtype, named: dict):
    """The tables (and weights) share one dtype: q's or float32."""
    first = None
    for name, t in named.items():
        if first is None:
            first = (name, t.dtype)
            if t.dtype is not dtype and t.dtype is not dt.float32:
                raise TypeError(f"gpuops.{op}: {name!r} has dtype {t.dtype}; the tables"
                                f"{' and weights' if len(named) > 2 else ''} must be in q's dtype "
                                f"({dtype}) or float32")
        elif t.dtype is not first[1]:
            raise TypeError(f"gpuops.{op}: {name!r} is {t.dtype} but {first[0]!r} is {first[1]}; "
                            f"{', '.join(repr(n) for n in named)} must share one dtype")
    return first[1]


def _table_static(p, cos: Tensor, sin: Tensor, positions: Tensor | None):
    """The RopeTables fields after its three pointers."""
    cs, ss = _tab_strides(p, cos), _tab_strides(p, sin)
    if positions is None:
        return (*cs, *ss, 0, 0, 0, cos.shape[p.rows_dim], 0, p.mrope_mode, p.sec_a, p.sec_b)
    pst = positions.strides
    psm, psb, pss = (pst[i] if i is not None and positions.shape[i] != 1 else 0
                     for i in p.pos_dims)
    mode = 2 if positions.dtype is dt.int64 else 1
    return (*cs, *ss, psm, psb, pss, cos.shape[0], mode, p.mrope_mode, p.sec_a, p.sec_b)


def _vector_ok(p, v, strides, aligned) -> bool:
    """16-byte packs: last dims contiguous, pointers and other strides multiples of a pack."""
    if not aligned or p.r % (2 * v) or p.d % v:
        return False
    for st in strides:
        if st[3] != 1 or st[0] % v or st[1] % v or st[2] % v:
            return False
    return True


def _aligned(*tensors) -> bool:
    acc = 0
    for t in tensors:
        acc |= t.ptr
    return acc % 16 == 0


def _key(t: Tensor | None):
    return None if t is None else (t.shape, t.strides, t.dtype)


def _options_key(interleaved, rotary_dim, mrope_section, mrope_interleaved):
    return (bool(interleaved), rotary_dim,
            None if mrope_section is None else tuple(mrope_section), bool(mrope_interleaved))


_launches: dict = {}


def _cached(key, build):
    entry = _launches.get(key)
    if entry is None:
        if len(_launches) > 4096:
            _launches.clear()
        entry = _launches[key] = build()
    return entry


def _rope_launch(call, op, q_in, k_in, q_out, k_out, cos, sin, positions, interleaved,
                 rotary_dim, mrope_section, mrope_interleaved, sign):
    aligned = _aligned(q_in, k_in, q_out, k_out)
    key = (op, call.result_dtype, _key(q_in), _key(k_in), _key(cos), _key(sin), _key(positions),
           _options_key(interleaved, rotary_dim, mrope_section, mrope_interleaved), aligned)

    def build():
        p = _plan(op, q_in.shape, k_in.shape, cos.shape, sin.shape,
                  None if positions is None else positions.shape, interleaved, rotary_dim,
                  mrope_section, mrope_interleaved)
        dtype = call.result_dtype
        tdtype = _check_table_dtypes(op, dtype, {"cos": cos, "sin": sin})
        strides = [_qk_strides(p, t) for t in (q_in, k_in, q_out, k_out)]
        v = _vec(dtype) if _vector_ok(p, _vec(dtype), strides, aligned) else 1
        per_head = p.r // (2 * v) + (p.d - p.r) // v
        total = p.batch * p.seq * (p.hq + p.hk) * per_head
        if total == 0:
            return None
        return (_rope_expr(dtype, tdtype, v), (-(-total // THREADS), 1, 1),
                (*strides[0], *strides[1], *strides[2], *strides[3], p.seq, total, p.hq, p.hk,
                 p.d, p.r, int(bool(interleaved)), float(sign)),
                _table_static(p, cos, sin, positions))

    entry = _cached(key, build)
    if entry is not None:
        expr, grid, mid, tab = entry
        _kernel(ROPE_MODULE, call.device, expr).launch(
            grid, (THREADS, 1, 1), call.stream, q_in.ptr, k_in.ptr, q_out.ptr, k_out.ptr, *mid,
            cos.ptr, sin.ptr, 0 if positions is None else positions.ptr, *tab)


def _bwd2_grid(dev):
    """Persistent blocks of qk_norm_rope_bwd2: 2 per SM, at most _bwd_grid's (tests set
    _bwd_grids to vary the grid without a device)."""
    n = _bwd_grid(dev)
    key = ("bwd2", dev)
    if key not in _bwd_grids:
        try:
            _bwd_grids[key] = device.device_info(dev).sm_count * BWD2_MIN_BLOCKS
        except Exception:           # no device (emulated kernels): the test's grid
            return n
    return min(n, _bwd_grids[key])


def _norm_group(p, v):
    """Lanes per head row for the fused norm kernels with packs of v elements, or None when
    16-byte packs cannot hold a row (more items than 32 lanes) or the backward's shared-memory
    table would not fit."""
    per_head = p.r // (2 * v) + (p.d - p.r) // v
    group = 1
    while group < per_head and group < 32:
        group *= 2
    if (v > 1 and per_head > group) or (THREADS // group) * p.d > BWD_SMEM_FLOATS:
        return None
    return group


def _norm_config(op, p, dtype, strides, aligned):
    """(pack width, group) of the fused kernels."""
    v = _vec(dtype)
    if _vector_ok(p, v, strides, aligned):
        group = _norm_group(p, v)
        if group is not None:
            return v, group
    group = _norm_group(p, 1)
    if group is None:
        raise ValueError(f"gpuops.{op}: head dim {p.d} is too large (at most "
                         f"{BWD_SMEM_FLOATS // (THREADS // 32)})")
    return 1, group


def _weight_stride(w: Tensor):
    return w.strides[0] if w.shape[0] != 1 else 0


def _check_weights(op, p, q_weight: Tensor, k_weight: Tensor):
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(w.shape) != (p.d,):
            raise ValueError(f"gpuops.{op}: {name!r} has shape {_shape_str(w.shape)}; expected "
                             f"[{p.d}] (the head dim)")


def _norm_common(call, op, p, qk, xs, q_weight, k_weight, cos, sin, positions, aligned):
    """Checks, strides (of qk then xs), pack width and group of both fused kernels."""
    dtype = call.result_dtype
    tdtype = _check_table_dtypes(op, dtype, {"q_weight": q_weight, "k_weight": k_weight,
                                             "cos": cos, "sin": sin})
    _check_weights(op, p, q_weight, k_weight)
    strides = [_qk_strides(p, t) for t in (*qk, *xs)]
    v, group = _norm_config(op, p, dtype, strides, aligned)
    return dtype, tdtype, strides, v, group


# ---------------------------------------------------------------------------------------------
# NumPy references (float64), written as HF transformers' code: cos/sin expanded to the full
# rotary width, rotate_half / rotate_every_two, elementwise products.

def _ref_cos_sin(op, p, cos, sin, positions, interleaved):
    """cos and sin per token and frequency: [B, S, R/2] float64."""
    cos, sin = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    cols = np.arange(p.half) * p.col_mult
    streams = 3 if p.mrope_mode else 1

    def per_stream(t, m):
        if positions is None:
            sdim, bdim, rdim = p.tab_dims
            x = t[m] if sdim is not None else t
            if x.ndim == 3:                       # [B or 1, S', W]
                x = x[:, :p.seq]
            else:
                x = x[None, :p.seq]
            x = x[..., cols]
            return np.broadcast_to(x, (p.batch, p.seq, p.half))
        pos = np.asarray(positions)
        pos = pos[m] if p.mrope_mode else pos
        pos = np.broadcast_to(pos.reshape((-1, p.seq)), (p.batch, p.seq))
        if pos.size and (pos.min() < 0 or pos.max() >= t.shape[0]):
            raise ValueError(f"gpuops.{op}: 'positions' has values in [{pos.min()}, {pos.max()}], "
                             f"outside the table's rows [0, {t.shape[0]})")
        return t[pos][..., cols]

    cs = [per_stream(cos, m) for m in range(streams)]
    ss = [per_stream(sin, m) for m in range(streams)]
    if not p.mrope_mode:
        return cs[0], ss[0]
    pick = p.stream_of
    c = np.stack(cs)[pick, :, :, np.arange(p.half)].transpose(1, 2, 0)
    s = np.stack(ss)[pick, :, :, np.arange(p.half)].transpose(1, 2, 0)
    return c, s


def _rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def _rotate_half_t(x):          # the transpose of rotate_half
    h = x.shape[-1] // 2
    return np.concatenate([x[..., h:], -x[..., :h]], -1)


def _rotate_every_two(x):       # GPT-J
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = -x[..., 1::2], x[..., 0::2]
    return out


def _rotate_every_two_t(x):
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x[..., 1::2], -x[..., 0::2]
    return out


def _ref_rope(p, x, c, s, interleaved, transpose=False):
    """x: [B, S, H, D] (or packed [T, H, D]) float64; c, s: [B, S, R/2]."""
    shape = x.shape
    x = np.asarray(x, np.float64).reshape(p.batch, p.seq, shape[-2], p.d)
    rot, rest = x[..., :p.r], x[..., p.r:]
    if interleaved:
        cf, sf = np.repeat(c, 2, -1), np.repeat(s, 2, -1)
        turn = _rotate_every_two_t if transpose else _rotate_every_two
    else:
        cf, sf = np.concatenate([c, c], -1), np.concatenate([s, s], -1)
        turn = _rotate_half_t if transpose else _rotate_half
    cf, sf = cf[:, :, None, :], sf[:, :, None, :]
    with np.errstate(all="ignore"):
        out = rot * cf + (turn(rot * sf) if transpose else turn(rot) * sf)
    return np.concatenate([out, rest], -1).reshape(shape)


def _ref_plan(op, q, k, cos, sin, positions, interleaved, rotary_dim, mrope_section,
              mrope_interleaved):
    p = _plan(op, np.shape(q), np.shape(k), np.shape(cos), np.shape(sin),
              None if positions is None else np.shape(positions), interleaved, rotary_dim,
              mrope_section, mrope_interleaved)
    c, s = _ref_cos_sin(op, p, cos, sin, positions, interleaved)
    return p, c, s


def ref_apply_rotary(q, k, cos, sin, interleaved=False, positions=None, rotary_dim=None,
                     mrope_section=None, mrope_interleaved=False):
    p, c, s = _ref_plan("apply_rotary", q, k, cos, sin, positions, interleaved, rotary_dim,
                        mrope_section, mrope_interleaved)
    return _ref_rope(p, q, c, s, interleaved), _ref_rope(p, k, c, s, interleaved)


def ref_apply_rotary_backward(grad_q, grad_k, cos, sin, interleaved=False, positions=None,
                              rotary_dim=None, mrope_section=None, mrope_interleaved=False):
    p, c, s = _ref_plan("apply_rotary_backward", grad_q, grad_k, cos, sin, positions, interleaved,
                        rotary_dim, mrope_section, mrope_interleaved)
    return (_ref_rope(p, grad_q, c, s, interleaved, transpose=True),
            _ref_rope(p, grad_k, c, s, interleaved, transpose=True))


def _ref_rms(x, w, eps):
    with np.errstate(all="ignore"):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _check_ref_weights(op, p, q_weight, k_weight):
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if np.shape(w) != (p.d,):
            raise ValueError(f"gpuops.{op}: {name!r} has shape {_shape_str(np.shape(w))}; expected "
                             f"[{p.d}] (the head dim)")


def ref_qk_norm_rotary(q, k, q_weight, k_weight, cos, sin, eps=1e-6, interleaved=False,
                       positions=None, rotary_dim=None, mrope_section=None,
                       mrope_interleaved=False):
    p, c, s = _ref_plan("qk_norm_rotary", q, k, cos, sin, positions, interleaved, rotary_dim,
                        mrope_section, mrope_interleaved)
    _check_ref_weights("qk_norm_rotary", p, q_weight, k_weight)
    return (_ref_rope(p, _ref_rms(q, q_weight, eps), c, s, interleaved),
            _ref_rope(p, _ref_rms(k, k_weight, eps), c, s, interleaved))


def ref_qk_norm_rotary_backward(grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, eps=1e-6,
                                interleaved=False, positions=None, rotary_dim=None,
                                mrope_section=None, mrope_interleaved=False):
    op = "qk_norm_rotary_backward"
    p, c, s = _ref_plan(op, q, k, cos, sin, positions, interleaved, rotary_dim, mrope_section,
                        mrope_interleaved)
    for name, g, x in (("grad_q", grad_q, q), ("grad_k", grad_k, k)):
        if np.shape(g) != np.shape(x):
            raise ValueError(f"gpuops.{op}: {name!r} has shape {_shape_str(np.shape(g))}; expected "
                             f"{_shape_str(np.shape(x))}")
    _check_ref_weights(op, p, q_weight, k_weight)
    out = []
    with np.errstate(all="ignore"):
        for g, x, w in ((grad_q, q, q_weight), (grad_k, k, k_weight)):
            gy = _ref_rope(p, g, c, s, interleaved, transpose=True)    # dL/d(norm(x) * w)
            rstd = 1.0 / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
            n = x * rstd
            dn = gy * w
            dx = rstd * (dn - n * np.mean(dn * n, -1, keepdims=True))
            out.append((dx, (gy * n).reshape(-1, p.d).sum(0)))
    return out[0][0], out[1][0], out[0][1], out[1][1]


# ---------------------------------------------------------------------------------------------
# Benchmarks: prefill q [4, 4096, 32, 128], k [4, 4096, 8, 128]; decode q [16, 1, 32, 128].
# A bench "shape" is (B, S, Hq, Hk, D); cos/sin are HF's duplicated [S, D] tables (what HF and
# Liger take), from random angles.

_PREFILL, _DECODE = (4, 4096, 32, 8, 128), (16, 1, 32, 8, 128)


def _bench_shape(d):
    return _PREFILL


def _check_shape(shape):
    return (1, min(shape[1], 256), *shape[2:])


def _tables(randn, rows, width, d):
    a = randn((rows, width // 2), dt.float32)
    if type(a).__module__.split(".")[0] == "torch":
        import torch  # noqa: PLC0415
        c, s = a.cos(), a.sin()
        td = dt.to_torch(d)
        return torch.cat([c, c], -1).to(td), torch.cat([s, s], -1).to(td)
    c, s = np.cos(a), np.sin(a)
    nd = dt.to_numpy(d)
    return np.concatenate([c, c], -1).astype(nd), np.concatenate([s, s], -1).astype(nd)


def _rope_inputs(shape, d, randn):
    b, s, hq, hk, hd = shape
    cos, sin = _tables(randn, s, hd, d)
    return (randn((b, s, hq, hd), d), randn((b, s, hk, hd), d), cos, sin), {}


def _norm_inputs(shape, d, randn):
    b, s, hq, hk, hd = shape
    cos, sin = _tables(randn, s, hd, d)
    return (randn((b, s, hq, hd), d), randn((b, s, hk, hd), d), randn((hd,), d),
            randn((hd,), d), cos, sin), {}


def _norm_bwd_inputs(shape, d, randn):
    b, s, hq, hk, hd = shape
    (q, k, wq, wk, cos, sin), _ = _norm_inputs(shape, d, randn)
    return (randn((b, s, hq, hd), d), randn((b, s, hk, hd), d), q, k, wq, wk, cos, sin), {}


def _hf_rotate_half(x):
    import torch  # noqa: PLC0415
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _torch_rope(q, k, cos, sin):
    # HF apply_rotary_pos_emb on the [B, S, H, D] layout (cos/sin [S, D] broadcast over heads)
    c, s = cos[:, None, :], sin[:, None, :]
    return q * c + _hf_rotate_half(q) * s, k * c + _hf_rotate_half(k) * s


def _torch_rope_backward(grad_q, grad_k, cos, sin):
    c, s = cos[:, None, :], sin[:, None, :]
    return (grad_q * c - _hf_rotate_half(grad_q) * s, grad_k * c - _hf_rotate_half(grad_k) * s)


def _torch_rms(x, w, eps):
    # HF Qwen3RMSNorm
    import torch  # noqa: PLC0415
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _torch_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6):
    return _torch_rope(_torch_rms(q, q_weight, eps), _torch_rms(k, k_weight, eps), cos, sin)


def _torch_qk_norm_rope_backward(grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, eps=1e-6):
    import torch  # noqa: PLC0415

    def one(g, x, w):
        gy = (g * cos[:, None, :] - _hf_rotate_half(g) * sin[:, None, :]).float()
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        n = xf * rstd
        dn = gy * w.float()
        dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
        return dx.to(x.dtype), (gy * n).sum((0, 1, 2)).to(w.dtype)
    dq, dwq = one(grad_q, q, q_weight)
    dk, dwk = one(grad_k, k, k_weight)
    return dq, dk, dwq, dwk


def _liger_rope():
    from liger_kernel.ops.rope import LigerRopeFunction  # noqa: PLC0415
    # Liger takes HF's [B, H, S, D] views and [1, S, D] tables, and rotates in place.
    return {"liger": lambda q, k, cos, sin: LigerRopeFunction.apply(
        q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None])}


def _liger_rope_backward():
    from liger_kernel.ops.rope import rope_backward  # noqa: PLC0415
    return {"liger": lambda grad_q, grad_k, cos, sin: rope_backward(
        grad_q.transpose(1, 2), grad_k.transpose(1, 2), cos[None], sin[None])}


def _liger_qk_norm_rope():
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction  # noqa: PLC0415
    from liger_kernel.ops.rope import LigerRopeFunction  # noqa: PLC0415

    def fn(q, k, q_weight, k_weight, cos, sin, eps=1e-6):
        qn = LigerRMSNormFunction.apply(q, q_weight, eps)
        kn = LigerRMSNormFunction.apply(k, k_weight, eps)
        return LigerRopeFunction.apply(qn.transpose(1, 2), kn.transpose(1, 2), cos[None],
                                       sin[None])
    return {"liger (rms_norm + rope)": fn}


def _bench(make, torch_fn, liger=None):
    return BenchSpec(make_inputs=make, torch_fn=torch_fn, default_shape=_bench_shape,
                     compile_peer=True, extra_peers=liger, check_shape=_check_shape,
                     extra_shapes=(_DECODE,))


_ROTARY_DTYPES = {"cos": TABLE_DTYPES, "sin": TABLE_DTYPES, "positions": POSITION_DTYPES}
_NORM_DTYPES = {**_ROTARY_DTYPES, "q_weight": TABLE_DTYPES, "k_weight": TABLE_DTYPES}


# ---------------------------------------------------------------------------------------------
# The ops.

def _rotary(call, op, q, k, cos, sin, interleaved, positions, rotary_dim, mrope_section,
            mrope_interleaved, sign):
    q_out = call.empty(q.shape, call.result_dtype)
    k_out = call.empty(k.shape, call.result_dtype)
    _rope_launch(call, op, q, k, q_out, k_out, cos, sin, positions, interleaved, rotary_dim,
                 mrope_section, mrope_interleaved, sign)
    return q_out, k_out


@register(family="rotary", reference=ref_apply_rotary, param_dtypes=_ROTARY_DTYPES,
          bench=_bench(_rope_inputs, _torch_rope, _liger_rope))
def apply_rotary(call, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False,
                 *, positions: Tensor | None = None, rotary_dim: int | None = None,
                 mrope_section: tuple | None = None, mrope_interleaved: bool = False) -> tuple:
    """Rotary position embedding of q and k in one pass; returns new ``(q_rot, k_rot)``.

    Pair ``(a, b)`` of frequency ``f`` becomes ``(a cos - b sin, b cos + a sin)`` with cos/sin of
    the token's position, as HF's ``apply_rotary_pos_emb`` (``interleaved=False``) or GPT-J's
    ``apply_rotary_pos_emb`` (``interleaved=True``); ``rotary_dim < D`` leaves the rest of each
    head unchanged. Options and accepted layouts (q/k ``[B, S, H, D]`` or packed ``[T, H, D]``,
    GQA, cos/sin tables with or without ``positions``, M-RoPE with ``mrope_section`` /
    ``mrope_interleaved``) are described in ``gpuops.ops.rotary``. Tables are in q's dtype or
    float32; math is fp32.
    """
    return _rotary(call, "apply_rotary", q, k, cos, sin, interleaved, positions, rotary_dim,
                   mrope_section, mrope_interleaved, 1.0)


@register(family="rotary", reference=ref_apply_rotary_backward, param_dtypes=_ROTARY_DTYPES,
          bench=_bench(_rope_inputs, _torch_rope_backward, _liger_rope_backward))
def apply_rotary_backward(call, grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor,
                          interleaved: bool = False, *, positions: Tensor | None = None,
                          rotary_dim: int | None = None, mrope_section: tuple | None = None,
                          mrope_interleaved: bool = False) -> tuple:
    """Backward of ``apply_rotary``: the gradients of q and k, ``(grad_q_in, grad_k_in)``.

    The rotation's transpose is the rotation by the opposite angle, so this is ``apply_rotary``
    of the output gradients with ``-sin`` (pass-through elements copied), in one pass; same
    arguments as the forward. cos/sin get no gradient.
    """
    return _rotary(call, "apply_rotary_backward", grad_q, grad_k, cos, sin, interleaved,
                   positions, rotary_dim, mrope_section, mrope_interleaved, -1.0)


@register(family="rotary", reference=ref_qk_norm_rotary, param_dtypes=_NORM_DTYPES,
          bench=_bench(_norm_inputs, _torch_qk_norm_rope, _liger_qk_norm_rope))
def qk_norm_rotary(call, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor,
                   sin: Tensor, eps: float = 1e-6, interleaved: bool = False, *,
                   positions: Tensor | None = None, rotary_dim: int | None = None,
                   mrope_section: tuple | None = None, mrope_interleaved: bool = False) -> tuple:
    """Per-head RMSNorm of q and k followed by RoPE, in one pass (Qwen3's attention prologue).

    ``q_rot = rope(q / sqrt(mean(q^2, -1) + eps) * q_weight)``, likewise k with ``k_weight``
    (weights ``[D]``), as HF's ``Qwen3Attention``: ``q_norm``/``k_norm`` (Qwen3RMSNorm over the
    head dim) then ``apply_rotary_pos_emb``. fp32 math throughout (HF rounds the normalized value
    to q's dtype before the weight; gpuops does not round in between). Weights and tables share
    one dtype, q's or float32. RoPE arguments as ``apply_rotary``. Head dims up to 512.
    """
    op = "qk_norm_rotary"
    q_out = call.empty(q.shape, call.result_dtype)
    k_out = call.empty(k.shape, call.result_dtype)
    aligned = _aligned(q, k, q_out, k_out)
    key = (op, call.result_dtype, _key(q), _key(k), _key(q_weight), _key(k_weight), _key(cos),
           _key(sin), _key(positions), float(eps),
           _options_key(interleaved, rotary_dim, mrope_section, mrope_interleaved), aligned,
           _aligned(cos, sin), _aligned(q_weight, k_weight), QK_NORM_FORWARD)

    def build():
        p = _plan(op, q.shape, k.shape, cos.shape, sin.shape,
                  None if positions is None else positions.shape, interleaved, rotary_dim,
                  mrope_section, mrope_interleaved)
        dtype, tdtype, st, v, group = _norm_common(call, op, p, (q, k, q_out, k_out), (),
                                                   q_weight, k_weight, cos, sin, positions,
                                                   aligned)
        rows = p.batch * p.seq * (p.hq + p.hk)
        if rows == 0:
            return None
        slots = THREADS // group
        blocks = _fwd3_grid(call.device, rows, slots) if v > 1 else 0
        if v > 1 and _fwd4_ok(p, interleaved, dtype, tdtype, cos, sin, q_weight, k_weight,
                              rows, slots):
            kind, blocks = "fwd4", -(-rows // slots)
        elif v > 1 and _fwd3_ok(p, interleaved, dtype, tdtype, cos, sin, rows, blocks * slots):
            kind = "fwd3"
        else:
            kind, blocks = ("fwd2" if v > 1 else "fwd"), -(-rows // slots)
        return (_norm_expr(kind, dtype, tdtype, v), (blocks, 1, 1),
                (*st[0], *st[1], *st[2], *st[3], p.seq, rows, p.hq, p.hk, p.d, p.r,
                 int(bool(interleaved)), 1.0),
                _table_static(p, cos, sin, positions),
                (*(0,) * 8, _weight_stride(q_weight), _weight_stride(k_weight), float(eps), group,
                 0))

    entry = _cached(key, build)
    if entry is not None:
        expr, grid, mid, tab, norm = entry
        _kernel(NORM_MODULE, call.device, expr).launch(
            grid, (THREADS, 1, 1), call.stream, q.ptr, k.ptr, q_out.ptr, k_out.ptr, *mid,
            cos.ptr, sin.ptr, 0 if positions is None else positions.ptr, *tab,
            q_weight.ptr, k_weight.ptr, 0, 0, 0, *norm)
    return q_out, k_out


@register(family="rotary", reference=ref_qk_norm_rotary_backward, param_dtypes=_NORM_DTYPES,
          bench=_bench(_norm_bwd_inputs, _torch_qk_norm_rope_backward))
def qk_norm_rotary_backward(call, grad_q: Tensor, grad_k: Tensor, q: Tensor, k: Tensor,
                            q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                            eps: float = 1e-6, interleaved: bool = False, *,
                            positions: Tensor | None = None, rotary_dim: int | None = None,
                            mrope_section: tuple | None = None,
                            mrope_interleaved: bool = False) -> tuple:
    """Backward of ``qk_norm_rotary``: ``(grad_q_in, grad_k_in, grad_q_weight, grad_k_weight)``.

    The output gradients are turned back by the inverse rotation, then through the RMSNorm:
    ``dx = rstd (dn - n mean(dn n))`` with ``n = x rstd``, ``dn = gy w``; ``dw = sum(gy n)`` over
    all tokens and heads, in the weights' dtype. q and k are the forward's inputs (the norm is
    recomputed, nothing is saved). The weight gradients are deterministic (fixed-order sums of
    per-block partials, no atomics): the same inputs give the same bits on the same GPU model.
    """
    op = "qk_norm_rotary_backward"
    for name, g, x in (("grad_q", grad_q, q), ("grad_k", grad_k, k)):
        if tuple(g.shape) != tuple(x.shape):
            raise ValueError(f"gpuops.{op}: {name!r} has shape {_shape_str(g.shape)}; expected "
                             f"{_shape_str(x.shape)}")
    dq = call.empty(q.shape, call.result_dtype)
    dk = call.empty(k.shape, call.result_dtype)
    aligned = _aligned(grad_q, grad_k, dq, dk, q, k)
    key = (op, call.device, call.result_dtype, _key(grad_q), _key(grad_k), _key(q), _key(k),
           _key(q_weight), _key(k_weight), _key(cos), _key(sin), _key(positions), float(eps),
           _options_key(interleaved, rotary_dim, mrope_section, mrope_interleaved), aligned)

    def build():
        p = _plan(op, q.shape, k.shape, cos.shape, sin.shape,
                  None if positions is None else positions.shape, interleaved, rotary_dim,
                  mrope_section, mrope_interleaved)
        dtype, tdtype, st, v, group = _norm_common(call, op, p, (grad_q, grad_k, dq, dk), (q, k),
                                                   q_weight, k_weight, cos, sin, positions,
                                                   aligned)
        tokens = p.batch * p.seq
        slots = THREADS // group
        rows_q, rows_k = tokens * p.hq, tokens * p.hk
        v2 = v > 1
        budget = _bwd2_grid(call.device) if v2 else _bwd_grid(call.device)
        share_q = round(budget * rows_q / max(1, rows_q + rows_k))
        nbq = min(-(-rows_q // slots), max(1, share_q)) if rows_q else 0
        nbk = min(-(-rows_k // slots), max(1, budget - nbq)) if rows_k else 0
        main = None
        if nbq + nbk:
            kind = "bwd2" if v2 else "bwd"
            main = (_norm_expr(kind, dtype, tdtype, v), (nbq + nbk, 1, 1),
                    (*st[0], *st[1], *st[2], *st[3], p.seq, tokens, p.hq, p.hk, p.d, p.r,
                     int(bool(interleaved)), -1.0),
                    _table_static(p, cos, sin, positions),
                    (*st[4], *st[5], _weight_stride(q_weight), _weight_stride(k_weight),
                     float(eps), group, nbq))
        return (p.d, tdtype, nbq + nbk, main, _reduce_expr(tdtype), (-(-p.d // 32), 2, 1),
                (nbq, nbk, p.d))

    d, tdtype, blocks, main, reduce_expr, reduce_grid, reduce_args = _cached(key, build)
    dwq = call.empty((d,), tdtype)
    dwk = call.empty((d,), tdtype)
    partial_ptr = 0
    dev = call.device
    if main is not None:
        expr, grid, mid, tab, norm = main
        partial = call.empty((blocks, d), dt.float32)
        partial_ptr = partial.ptr
        _kernel(NORM_MODULE, dev, expr).launch(
            grid, (THREADS, 1, 1), call.stream, grad_q.ptr, grad_k.ptr, dq.ptr, dk.ptr, *mid,
            cos.ptr, sin.ptr, 0 if positions is None else positions.ptr, *tab,
            q_weight.ptr, k_weight.ptr, q.ptr, k.ptr, partial_ptr, *norm)
    _kernel(NORM_MODULE, dev, reduce_expr).launch(
        reduce_grid, (32, 32, 1), call.stream, partial_ptr, dwq.ptr, dwk.ptr, *reduce_args)
    return dq, dk, dwq, dwk
