"""Attention variants (issue 5): O(S) and structured forms of attention.

* ``linear_attention``: phi(q) (sum_j phi(k_j) v_j^T) / (phi(q) sum_j phi(k_j) + eps), causal by
  prefix sums over chunks of 64 rows (cuda_src/attention/linear_attention.cu).
* ``kernelized_attention``: Performer's FAVOR+ random features (softmax or Gaussian-RBF kernel)
  followed by linear attention on the features (cuda_src/attention/favor_features.cu, then the
  linear-attention kernels).
* ``multiscale_attention``: dilated sliding windows, one (window, dilation) per group of heads;
  softmax attention that visits only the visible keys (cuda_src/attention/multiscale_attention.cu).

Layout [B, H, S, D] (any strides), as torch's SDPA; GQA with ``enable_gqa=True``. Every kernel
is SIMT fp32 (sm_61 and up) for fp32/fp16/bf16 storage, with fp32 state. Floors, design and
predictions: benchmarks/notes_attention_variants.md.
"""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.ops import _layout as lay
from gpuops.registry import register
from gpuops.runtime import device
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.tensor import Tensor

FEATURE_MAPS = {"identity": 0, "elu": 1, "relu": 2}     # LinFeature in variants_common.cuh
KERNELS = {"softmax": 0, "rbf": 1}                       # kFavorSoftmax, kFavorRbf
CHUNK = 64            # kLinRows: rows per tile; the chunk length of causal linear attention
COLS = 64             # kLinCols: value columns (and state rows) per block
SCAN_THREADS = 256    # kLinScanThreads
MS_ROWS = 32          # kMsRows: decimated query rows per multiscale block
MS_THREADS = 256
MS_MAX_SCALES = 16    # kMsMaxScales
MS_MAX_D = 256        # largest head dim of multiscale_attention (8 lanes x 32 columns)
_B = {True: "true", False: "false"}

# ---------------------------------------------------------------------------------------------
# Kernel modules. Structs mirrored from cuda_src/attention/variants_common.cuh.

LIN_ARGS = ArgSpec("5P16q9if")
SCAN_ARGS = ArgSpec("ptr", "i64", "i32", "i32")
FAVOR_ARGS = ArgSpec("4P4q6i2f")
MS_ARGS = ArgSpec("4P16q40if")


def lin_state_expr(tk, tv, fm: int) -> str:
    return f"gpuops::linattn_state<{tk.ctype}, {tv.ctype}, {fm}>"


def lin_out_expr(tqk, tv, fm: int, causal: bool) -> str:
    return f"gpuops::linattn_out<{tqk.ctype}, {tv.ctype}, {fm}, {_B[causal]}>"


def _linear_kernels():
    out = {"gpuops::linattn_scan": SCAN_ARGS}
    # (q/k storage, v storage, feature map): the dtype's own three maps, and fp32 features
    # (kernelized_attention's) with every value dtype
    combos = [(d, d, fm) for d in dt.FLOATS for fm in FEATURE_MAPS.values()]
    combos += [(dt.float32, d, FEATURE_MAPS["identity"]) for d in dt.FLOATS]
    for tqk, tv, fm in dict.fromkeys(combos):
        out[lin_state_expr(tqk, tv, fm)] = LIN_ARGS
        for causal in (False, True):
            out[lin_out_expr(tqk, tv, fm, causal)] = LIN_ARGS
    return out


def favor_expr(t, kind: int) -> str:
    return f"gpuops::favor_logits<{t.ctype}, {kind}>"


def ms_config(d: int):
    """(columns per lane DPL, key tile BC) of the multiscale kernel for head dim d (<= 256)."""
    for dpl in (4, 8, 16):
        if d <= 8 * dpl:
            return dpl, 32
    return 32, 16     # 2 x 16 x 260 fp32 words of shared memory (33 KB)


def ms_expr(t, dpl: int, bc: int) -> str:
    return f"gpuops::multiscale_attn<{t.ctype}, {dpl}, {bc}>"


LINEAR_MODULE = KernelModule("attention.linear", "attention/linear_attention.cu",
                             _linear_kernels())
FAVOR_MODULE = KernelModule(
    "attention.favor", "attention/favor_features.cu",
    {**{favor_expr(d, k): FAVOR_ARGS for d in dt.FLOATS for k in KERNELS.values()},
     "gpuops::favor_key_exp": FAVOR_ARGS})
MS_MODULE = KernelModule(
    "attention.multiscale", "attention/multiscale_attention.cu",
    {ms_expr(d, *ms_config(hd), ): MS_ARGS for d in dt.FLOATS for hd in (32, 64, 128, 256)})
_LIN = lay.KernelTable(LINEAR_MODULE)
_FAVOR = lay.KernelTable(FAVOR_MODULE)
_MS = lay.KernelTable(MS_MODULE)


# ---------------------------------------------------------------------------------------------
# Arguments (shared by the GPU paths and the references, which are also the CPU fallbacks).

class Problem:
    __slots__ = ("B", "Hq", "Hkv", "Sq", "Sk", "D", "Dv", "group")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_flag(op, name, flag):
    if not isinstance(flag, (bool, np.bool_)):
        raise TypeError(f"gpuops.{op}: {name!r} must be a bool, got {type(flag).__name__}")


def _check_qkv(op, q_shape, k_shape, v_shape, enable_gqa, same_dv: bool) -> Problem:
    """Shapes [B, H, S, D]; key/value share B, H, S; value head dim free unless same_dv."""
    _check_flag(op, "enable_gqa", enable_gqa)
    shapes = {}
    for name, shape in (("query", q_shape), ("key", k_shape), ("value", v_shape)):
        shape = tuple(int(s) for s in shape)
        if len(shape) != 4:
            raise ValueError(f"gpuops.{op}: {name!r} must be 4-d [B, H, S, D], got shape {shape}")
        shapes[name] = shape
    B, Hq, Sq, D = shapes["query"]
    Bk, Hkv, Sk, Dk = shapes["key"]
    Bv, Hv, Sv, Dv = shapes["value"]
    if Bk != B or Bv != B:
        raise ValueError(f"gpuops.{op}: 'key'/'value' have batch {Bk}/{Bv} but 'query' has {B}; "
                         "they must match")
    if Dk != D:
        raise ValueError(f"gpuops.{op}: 'key' has head dim {Dk} but 'query' has {D}; they must "
                         "match")
    if (Hv, Sv) != (Hkv, Sk):
        raise ValueError(f"gpuops.{op}: 'value' has shape {shapes['value']} but 'key' has "
                         f"{shapes['key']}; heads and length must match")
    if same_dv and Dv != D:
        raise ValueError(f"gpuops.{op}: 'value' has head dim {Dv} but 'query' has {D}; they must "
                         "match")
    if D == 0:
        raise ValueError(f"gpuops.{op}: 'query' has head dim 0")
    if Hkv != Hq:
        if not enable_gqa:
            raise ValueError(f"gpuops.{op}: 'key' has {Hkv} heads but 'query' has {Hq}; pass "
                             "enable_gqa=True for grouped-query attention")
        if Hkv == 0 or Hq % Hkv:
            raise ValueError(f"gpuops.{op}: 'query' heads ({Hq}) must be a multiple of 'key' "
                             f"heads ({Hkv}) with enable_gqa=True")
    p = Problem()
    p.B, p.Hq, p.Hkv, p.Sq, p.Sk, p.D, p.Dv = B, Hq, Hkv, Sq, Sk, D, Dv
    p.group = Hq // Hkv if Hkv else 1
    return p


def _check_eps(op, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"gpuops.{op}: 'eps' must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"gpuops.{op}: 'eps' must be finite and >= 0, got {eps!r}")
    return float(eps)


def _check_scale(op, scale, D: int, positive: bool) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"gpuops.{op}: 'scale' must be a float or None, got {type(scale).__name__}")
    if positive and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"gpuops.{op}: 'scale' must be finite and > 0 (the features use "
                         f"sqrt(scale)), got {scale!r}")
    return float(scale)


def check_linear(q_shape, k_shape, v_shape, feature_map, causal, eps, enable_gqa) -> Problem:
    op = "linear_attention"
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"gpuops.{op}: 'feature_map' must be one of {tuple(FEATURE_MAPS)}, got "
                         f"{feature_map!r}")
    _check_flag(op, "causal", causal)
    _check_eps(op, eps)
    return _check_qkv(op, q_shape, k_shape, v_shape, enable_gqa, same_dv=False)


def check_kernelized(q_shape, k_shape, v_shape, num_features, kernel, seed, causal, scale,
                     orthogonal, eps, enable_gqa):
    op = "kernelized_attention"
    if not _is_int(num_features):
        raise TypeError(f"gpuops.{op}: 'num_features' must be an int, got "
                        f"{type(num_features).__name__}")
    if num_features < 1:
        raise ValueError(f"gpuops.{op}: 'num_features' must be >= 1, got {num_features}")
    if kernel not in KERNELS:
        raise ValueError(f"gpuops.{op}: 'kernel' must be one of {tuple(KERNELS)}, got {kernel!r}")
    if not _is_int(seed) or seed < 0:
        raise TypeError(f"gpuops.{op}: 'seed' must be an int >= 0, got {seed!r}")
    _check_flag(op, "causal", causal)
    _check_flag(op, "orthogonal", orthogonal)
    _check_eps(op, eps)
    p = _check_qkv(op, q_shape, k_shape, v_shape, enable_gqa, same_dv=False)
    return p, _check_scale(op, scale, p.D, positive=True)


def check_multiscale(q_shape, k_shape, v_shape, windows, dilations, scale, causal, enable_gqa):
    """(problem, scale, windows, dilations) with windows and dilations clamped to the lengths
    (a window or dilation >= max(Sq, Sk) selects the same keys as max(Sq, Sk))."""
    op = "multiscale_attention"
    p = _check_qkv(op, q_shape, k_shape, v_shape, enable_gqa, same_dv=True)
    _check_flag(op, "causal", causal)
    seqs = {}
    for name, seq in (("windows", windows), ("dilations", dilations)):
        if isinstance(seq, (str, bytes)) or not hasattr(seq, "__len__") or \
                not all(_is_int(x) for x in seq):
            raise TypeError(f"gpuops.{op}: {name!r} must be a sequence of ints, got {seq!r}")
        seqs[name] = [int(x) for x in seq]
    w, d = seqs["windows"], seqs["dilations"]
    if not 1 <= len(w) <= MS_MAX_SCALES:
        raise ValueError(f"gpuops.{op}: 'windows' must have 1..{MS_MAX_SCALES} entries, got "
                         f"{len(w)}")
    if len(d) != len(w):
        raise ValueError(f"gpuops.{op}: 'dilations' has {len(d)} entries but 'windows' has "
                         f"{len(w)}; they must match")
    if any(x < 0 for x in w):
        raise ValueError(f"gpuops.{op}: 'windows' entries must be >= 0, got {tuple(w)}")
    if any(x < 1 for x in d):
        raise ValueError(f"gpuops.{op}: 'dilations' entries must be >= 1, got {tuple(d)}")
    if p.Hq % len(w):
        raise ValueError(f"gpuops.{op}: 'query' heads ({p.Hq}) must split into len(windows) = "
                         f"{len(w)} equal groups")
    if p.D > MS_MAX_D:
        raise ValueError(f"gpuops.{op}: 'query' has head dim {p.D}; at most {MS_MAX_D} is "
                         "supported")
    cap = max(p.Sq, p.Sk, 1)
    w = [min(x, cap) for x in w]
    d = [min(x, cap) for x in d]
    return p, _check_scale(op, scale, p.D, positive=False), w, d


# ---------------------------------------------------------------------------------------------
# float64 references.

def phi(x: np.ndarray, feature_map: str) -> np.ndarray:
    """The feature map of linear_attention, elementwise."""
    if feature_map == "elu":
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    if feature_map == "relu":
        return np.maximum(x, 0.0)
    return x


def linear_core(fq: np.ndarray, fk: np.ndarray, v: np.ndarray, causal: bool, eps: float,
                chunk: int = 256) -> np.ndarray:
    """One head of linear attention on features: fq [Sq, F], fk [Sk, F], v [Sk, Dv] (float64).
    Causal (query i sees keys j <= i, top-left aligned as torch's is_causal) by prefix sums
    over chunks of ``chunk`` rows; exact in float64, memory O(chunk^2 + F Dv)."""
    Sq, F = fq.shape
    Sk, Dv = v.shape
    with np.errstate(divide="ignore", invalid="ignore"):
        if not causal:
            S = fk.T @ v
            z = fk.sum(axis=0)
            return (fq @ S) / (fq @ z + eps)[:, None]
        out = np.empty((Sq, Dv))
        S = np.zeros((F, Dv))
        z = np.zeros(F)
        for c0 in range(0, Sq, chunk):
            c1 = min(c0 + chunk, Sq)
            kk, vv = fk[c0:min(c1, Sk)], v[c0:min(c1, Sk)]
            a = np.tril(fq[c0:c1] @ kk.T)          # keys c0 + j seen by rows c0 + i, j <= i
            num = fq[c0:c1] @ S + a @ vv
            den = fq[c0:c1] @ z + a.sum(axis=1)
            out[c0:c1] = num / (den + eps)[:, None]
            S += kk.T @ vv
            z += kk.sum(axis=0)
        return out


def ref_linear_attention(query, key, value, feature_map="elu", causal=False, eps=1e-6,
                         enable_gqa=False):
    p = check_linear(np.shape(query), np.shape(key), np.shape(value), feature_map, causal, eps,
                     enable_gqa)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (query, key, value))
    out = np.zeros((p.B, p.Hq, p.Sq, p.Dv))
    for b in range(p.B):
        for hk in range(p.Hkv):
            fk = phi(k[b, hk], feature_map)
            for h in range(hk * p.group, (hk + 1) * p.group):
                out[b, h] = linear_core(phi(q[b, h], feature_map), fk, v[b, hk], causal,
                                        float(eps))
    return out


@functools.lru_cache(maxsize=64)
def random_features(num_features: int, dim: int, seed: int, orthogonal: bool) -> np.ndarray:
    """W [num_features, dim] of kernelized_attention, float64 values exactly representable in
    float32 (what the kernels use). Drawn from ``numpy.random.default_rng(seed)``:
    orthogonal=False: i.i.d. N(0, 1) entries. orthogonal=True (Performer's default): blocks of
    ``dim`` orthonormal rows (Q of the QR decomposition of a dim x dim Gaussian matrix, one
    block after the other, the last one cut), each row then scaled by the norm of an independent
    N(0, I_dim) vector, so that every row is still N(0, I) distributed. Reproducible for a given
    NumPy (and LAPACK, for the QR) build. Read-only (cached)."""
    rng = np.random.default_rng(seed)
    if orthogonal:
        blocks = []
        for _ in range(-(-num_features // dim)):
            qm, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
            blocks.append(qm.T)
        norms = np.linalg.norm(rng.standard_normal((num_features, dim)), axis=1)
        w = np.concatenate(blocks, axis=0)[:num_features] * norms[:, None]
    else:
        w = rng.standard_normal((num_features, dim))
    w = w.astype(np.float32).astype(np.float64)
    w.setflags(write=False)
    return w


def favor_features(x: np.ndarray, w: np.ndarray, kernel: str, scale: float,
                   is_query: bool) -> np.ndarray:
    """Features of one head's rows x [S, D] (float64), as the kernels define them (module
    docstring of cuda_src/attention/favor_features.cu)."""
    m = w.shape[0]
    xs = x * math.sqrt(scale)
    u = xs @ w.T
    if kernel == "rbf":
        return np.concatenate([np.cos(u), np.sin(u)], axis=1) / math.sqrt(m)
    logits = u - 0.5 * np.sum(xs * xs, axis=1, keepdims=True)
    if logits.size == 0:
        return logits
    stab = logits.max(axis=1, keepdims=True) if is_query else logits.max()
    return np.exp(logits - stab) / math.sqrt(m)


def ref_kernelized_attention(query, key, value, num_features=256, kernel="softmax", seed=0,
                             causal=False, scale=None, orthogonal=True, eps=0.0,
                             enable_gqa=False):
    p, sc = check_kernelized(np.shape(query), np.shape(key), np.shape(value), num_features,
                             kernel, seed, causal, scale, orthogonal, eps, enable_gqa)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (query, key, value))
    w = random_features(num_features, p.D, seed, bool(orthogonal))
    out = np.zeros((p.B, p.Hq, p.Sq, p.Dv))
    for b in range(p.B):
        for hk in range(p.Hkv):
            fk = favor_features(k[b, hk], w, kernel, sc, False)
            for h in range(hk * p.group, (hk + 1) * p.group):
                fq = favor_features(q[b, h], w, kernel, sc, True)
                out[b, h] = linear_core(fq, fk, v[b, hk], causal, float(eps))
    return out


def multiscale_offsets(window: int, dilation: int, sq: int, sk: int, causal: bool):
    """(j [Sq, T], visible [Sq, T]): the keys j = i + t * dilation, |t| <= window (t <= 0 when
    causal), of every query row i, and which of them exist (0 <= j < Sk)."""
    t = np.arange(-window, (0 if causal else window) + 1)
    j = np.arange(sq)[:, None] + t[None, :] * dilation
    return j, (j >= 0) & (j < sk)


def ref_multiscale_attention(query, key, value, windows, dilations, scale=None, causal=False,
                             enable_gqa=False):
    p, sc, ws, ds = check_multiscale(np.shape(query), np.shape(key), np.shape(value), windows,
                                     dilations, scale, causal, enable_gqa)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (query, key, value))
    out = np.zeros((p.B, p.Hq, p.Sq, p.D))
    per = p.Hq // len(ws)
    if p.Sk == 0:
        return out
    with np.errstate(all="ignore"):
        for h in range(p.Hq):
            j, ok = multiscale_offsets(ws[h // per], ds[h // per], p.Sq, p.Sk, causal)
            jc = np.clip(j, 0, p.Sk - 1)
            for b in range(p.B):
                kk, vv = k[b, h // p.group][jc], v[b, h // p.group][jc]     # [Sq, T, D]
                s = np.einsum("id,itd->it", q[b, h], kk) * sc
                s = np.where(ok, s, -np.inf)
                mx = s.max(axis=1, keepdims=True)
                dead = np.isneginf(mx)                     # no visible key: output 0
                e = np.exp(s - np.where(dead, 0.0, mx))
                o = np.einsum("it,itd->id", e, vv) / e.sum(axis=1, keepdims=True)
                out[b, h] = np.where(dead, 0.0, o)
    return out


# ---------------------------------------------------------------------------------------------
# GPU paths.

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _bhsd(t: Tensor) -> tuple:
    return tuple(t.strides)


def _check_grid(op, **dims):
    for name, (n, limit) in dims.items():
        if n > limit:
            raise ValueError(f"gpuops.{op}: too large for one launch ({name} = {n} > {limit})")


def _linear_launch(call, op, p, q, k, v, out, q_strides, k_strides, tqk, fm, causal, eps, dk):
    """The three linear-attention kernels on q/k of storage tqk with feature map fm (features
    already computed: fm = identity), value/out of the call's dtype; dk = feature dim."""
    dev = call.device
    tv = call.result_dtype
    rec = dk * (p.Dv + 1)
    bhk = p.B * p.Hkv
    col_blocks = -(-dk // COLS) * -(-p.Dv // COLS)
    if causal:
        chunk_rows, nchunks = CHUNK, -(-p.Sq // CHUNK)
    else:
        tiles = max(1, -(-p.Sk // CHUNK))
        want = -(-2 * lay.sm_count(dev) // max(1, bhk * col_blocks))
        nsplit = max(1, min(want, tiles))
        chunk_rows = -(-tiles // nsplit) * CHUNK
        nchunks = max(1, -(-p.Sk // chunk_rows))
    _check_grid(op, **{"batch x kv heads": (bhk, 65535), "batch x heads": (p.B * p.Hq, 65535),
                       "state blocks": (bhk * nchunks, 2**31 - 1),
                       "feature tiles": (-(-dk // COLS), 65535)})
    state = call.empty((bhk * nchunks * rec,), dt.float32)
    args = (q.ptr, k.ptr, v.ptr, out.ptr, state.ptr, *q_strides, *k_strides, *_bhsd(v),
            *_bhsd(out), p.Hq, p.Hkv, p.group, p.Sq, p.Sk, dk, p.Dv, nchunks, chunk_rows, eps)
    _LIN.get(dev, lin_state_expr(tqk, tv, fm)).launch(
        (bhk * nchunks, -(-dk // COLS), -(-p.Dv // COLS)), (128, 1, 1), call.stream, *args)
    if causal or nchunks > 1:
        _LIN.get(dev, "gpuops::linattn_scan").launch(
            (-(-rec // SCAN_THREADS), bhk, 1), (SCAN_THREADS, 1, 1), call.stream,
            state.ptr, rec, nchunks, 0 if causal else 1)
    _LIN.get(dev, lin_out_expr(tqk, tv, fm, causal)).launch(
        (-(-p.Sq // CHUNK), p.B * p.Hq, -(-p.Dv // COLS)), (128, 1, 1), call.stream, *args)


def _linear_forward(call, query, key, value, feature_map, causal, eps, enable_gqa):
    op = "linear_attention"
    p = check_linear(query.shape, key.shape, value.shape, feature_map, causal, eps, enable_gqa)
    out = call.empty((p.B, p.Hq, p.Sq, p.Dv), call.result_dtype)
    if out.numel:
        _linear_launch(call, op, p, query, key, value, out, _bhsd(query), _bhsd(key),
                       call.result_dtype, FEATURE_MAPS[feature_map], bool(causal), float(eps), p.D)
    return out


_device_w: dict = {}


def device_features(call, w: np.ndarray, key) -> Tensor:
    """The random features as an fp32 device array, uploaded once per (device, key) and kept:
    a host-to-device copy cannot be captured in a CUDA graph, so (as a module load) the first
    call with new features must happen outside a capture."""
    dev = call.device
    t = _device_w.get((dev, key))
    if t is None:
        cp = device.cupy_or_none()
        with cp.cuda.Device(dev):
            arr = cp.asarray(np.ascontiguousarray(w, dtype=np.float32))
            cp.cuda.Device(dev).synchronize()      # once per key: the copy is done before use
        t = _device_w[(dev, key)] = Tensor(arr.data.ptr, arr.shape, (arr.shape[1], 1),
                                           dt.float32, dev, arr)
    return t


def _kernelized_forward(call, query, key, value, num_features, kernel, seed, causal, scale,
                        orthogonal, eps, enable_gqa):
    op = "kernelized_attention"
    p, sc = check_kernelized(query.shape, key.shape, value.shape, num_features, kernel, seed,
                             causal, scale, orthogonal, eps, enable_gqa)
    dtype = call.result_dtype
    out = call.empty((p.B, p.Hq, p.Sq, p.Dv), dtype)
    if not out.numel:
        return out
    m = num_features
    nf = 2 * m if kernel == "rbf" else m
    kind = KERNELS[kernel]
    w = device_features(call, random_features(m, p.D, seed, bool(orthogonal)),
                        (m, p.D, seed, bool(orthogonal)))
    dev = call.device
    _check_grid(op, **{"batch x heads": (p.B * p.Hq, 65535)})
    xscale, inv_sqrt_m = math.sqrt(sc), 1.0 / math.sqrt(m)
    fq = call.empty((p.B * p.Hq, p.Sq, nf), dt.float32)
    fk = call.empty((p.B * p.Hkv, p.Sk, nf), dt.float32)
    logits = _FAVOR.get(dev, favor_expr(dtype, kind))
    logits.launch((-(-p.Sq // CHUNK), p.B * p.Hq, 1), (128, 1, 1), call.stream,
                  query.ptr, w.ptr, fq.ptr, 0, *_bhsd(query), p.Hq, p.Sq, p.D, m, nf, 1,
                  xscale, inv_sqrt_m)
    if p.Sk:
        ktiles = -(-p.Sk // CHUNK)
        tile_max = call.empty((p.B * p.Hkv * ktiles,), dt.float32) if kind == 0 else None
        kargs = (key.ptr, w.ptr, fk.ptr, tile_max.ptr if tile_max is not None else 0,
                 *_bhsd(key), p.Hkv, p.Sk, p.D, m, nf, 0, xscale, inv_sqrt_m)
        logits.launch((ktiles, p.B * p.Hkv, 1), (128, 1, 1), call.stream, *kargs)
        if kind == 0:
            _FAVOR.get(dev, "gpuops::favor_key_exp").launch(
                (ktiles, p.B * p.Hkv, 1), (128, 1, 1), call.stream, *kargs)
    # [B * H, S, nf] contiguous as [B, H, S, nf] strides
    fq_strides = (p.Hq * p.Sq * nf, p.Sq * nf, nf, 1)
    fk_strides = (p.Hkv * p.Sk * nf, p.Sk * nf, nf, 1)
    _linear_launch(call, op, p, fq, fk, value, out, fq_strides, fk_strides, dt.float32,
                   FEATURE_MAPS["identity"], bool(causal), float(eps), nf)
    return out


def _multiscale_forward(call, query, key, value, windows, dilations, scale, causal, enable_gqa):
    op = "multiscale_attention"
    p, sc, ws, ds = check_multiscale(query.shape, key.shape, value.shape, windows, dilations,
                                     scale, causal, enable_gqa)
    out = call.empty((p.B, p.Hq, p.Sq, p.D), call.result_dtype)
    if not out.numel:
        return out
    blocks_x = max(d * _cdiv(_cdiv(p.Sq, d), MS_ROWS) for d in ds)
    _check_grid(op, **{"batch x heads": (p.B * p.Hq, 65535), "query tiles": (blocks_x, 2**31 - 1)})
    pad = MS_MAX_SCALES - len(ws)
    dpl, bc = ms_config(p.D)
    _MS.get(call.device, ms_expr(call.result_dtype, dpl, bc)).launch(
        (blocks_x, p.B * p.Hq, 1), (MS_THREADS, 1, 1), call.stream,
        query.ptr, key.ptr, value.ptr, out.ptr, *_bhsd(query), *_bhsd(key), *_bhsd(value),
        *_bhsd(out), p.Hq, p.group, p.Hq // len(ws), p.Sq, p.Sk, p.D, int(bool(causal)), 0,
        *ws, *([0] * pad), *ds, *([1] * pad), sc * math.log2(math.e))
    return out


# ---------------------------------------------------------------------------------------------
# Benchmarks. Shapes (B, H, S, D, causal), bf16 by default.

def _bench_qkv(shape, d, randn):
    B, H, S, D, causal = shape
    return [randn((B, H, S, D), d) for _ in range(3)], bool(causal)


def _itemsize(x):
    return x.element_size() if hasattr(x, "element_size") else x.itemsize


def _qkvo_bytes(args, out):
    """q, k, v read once and out written once (the state workspace is not counted)."""
    return 4 * math.prod(args[0].shape) * _itemsize(args[0])


def _lin_make(shape, d, randn):
    (q, k, v), causal = _bench_qkv(shape, d, randn)
    return (q, k, v, "elu", causal), {}


def _lin_flops(args, out):
    """Multiply-adds x 2 of the algorithm: state phi(K)^T V and output phi(Q) S, 2 S D Dv each;
    causal adds the chunk's own keys, 2 S C (D + Dv) / 2 with C = 64 (the unmasked half)."""
    B, H, S, D = args[0].shape
    Dv = args[2].shape[-1]
    f = 4 * B * H * S * D * Dv
    if args[4]:
        f += B * H * S * CHUNK * (D + Dv)
    return f


def torch_linear_attention(q, k, v, feature_map="elu", causal=False, eps=1e-6):
    """The same computation in torch (fp32 math, float64 for float64 input; chunks of 64 rows for
    the causal form): the benchmark's peer, and the tests' independent check."""
    import torch  # noqa: PLC0415
    fn = {"elu": lambda x: torch.nn.functional.elu(x) + 1, "relu": torch.relu,
          "identity": lambda x: x}[feature_map]
    math_dtype = torch.promote_types(q.dtype, torch.float32)     # float64 stays float64
    fq, fk, vf = fn(q.to(math_dtype)), fn(k.to(math_dtype)), v.to(math_dtype)
    if not causal:
        s = torch.einsum("bhsd,bhse->bhde", fk, vf)
        num = torch.einsum("bhsd,bhde->bhse", fq, s)
        den = torch.einsum("bhsd,bhd->bhs", fq, fk.sum(2))
        return (num / (den + eps)[..., None]).to(v.dtype)
    B, H, S, D = fq.shape
    Sk = fk.shape[2]
    n = -(-S // CHUNK)
    pad = n * CHUNK
    # keys past Sq are never seen (top-left causal); padded keys come after every real row
    fq, fk, vf = (torch.nn.functional.pad(x[:, :, :min(x.shape[2], S)],
                                          (0, 0, 0, pad - min(x.shape[2], S))) for x in (fq, fk, vf))
    if Sk < S:   # keys past Sk do not exist: their features are 0, not phi(0)
        fk[:, :, Sk:] = 0
    fq, fk, vf = (x.reshape(B, H, n, CHUNK, x.shape[-1]) for x in (fq, fk, vf))
    st = torch.einsum("bhncd,bhnce->bhnde", fk, vf)
    z = fk.sum(3)
    st = st.cumsum(2) - st
    z = z.cumsum(2) - z
    a = torch.einsum("bhncd,bhnkd->bhnck", fq, fk).tril()
    num = torch.einsum("bhncd,bhnde->bhnce", fq, st) + torch.einsum("bhnck,bhnke->bhnce", a, vf)
    den = torch.einsum("bhncd,bhnd->bhnc", fq, z) + a.sum(-1)
    out = (num / (den + eps)[..., None]).reshape(B, H, pad, -1)[:, :, :S]
    return out.to(v.dtype)


def _lin_torch(q, k, v, feature_map="elu", causal=False):
    return torch_linear_attention(q, k, v, feature_map, causal)


def _sdpa_peer(q, k, v, *args, causal=False, **kwargs):
    import torch.nn.functional as F  # noqa: PLC0415,N812
    return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))


LINEAR_BENCH = BenchSpec(
    make_inputs=_lin_make, torch_fn=_lin_torch,
    extra_peers=lambda: {"sdpa": lambda q, k, v, fm, causal: _sdpa_peer(q, k, v, causal=causal)},
    default_shape=lambda d: (1, 16, 4096, 64, 0), flops=_lin_flops, bytes_moved=_qkvo_bytes,
    check_shape=lambda s: (1, 2, min(s[2], 1024), s[3], s[4]),
    extra_shapes=tuple((1, 16, s, 64, c) for s in (1024, 4096, 16384, 65536) for c in (0, 1)))

KERNELIZED_FEATURES = 256


def _ker_make(shape, d, randn):
    (q, k, v), causal = _bench_qkv(shape, d, randn)
    return (q, k, v, KERNELIZED_FEATURES, "softmax", 0), {"causal": causal}


def _ker_flops(args, out, m=KERNELIZED_FEATURES):
    """Features: 2 S m D for q and for k; then linear attention on m features (see _lin_flops)."""
    B, H, S, D = args[0].shape
    f = 4 * B * H * S * m * D + 4 * B * H * S * m * D
    return f


KERNELIZED_BENCH = BenchSpec(
    make_inputs=_ker_make,
    torch_fn=lambda q, k, v, m, kernel, seed, causal=False: _sdpa_peer(q, k, v, causal=causal),
    default_shape=lambda d: (1, 16, 4096, 64, 0), flops=_ker_flops, bytes_moved=_qkvo_bytes,
    check_shape=lambda s: (1, 2, min(s[2], 1024), s[3], s[4]),
    extra_shapes=((1, 16, 16384, 64, 0), (1, 16, 16384, 64, 1)))

MS_BENCH_WINDOWS, MS_BENCH_DILATIONS = (32, 32, 32, 32), (1, 2, 4, 8)


class _BenchWindows(tuple):
    """The bench's windows, marked with ``causal`` (a keyword argument, which the bench's
    flops(args, out) does not see)."""
    causal = False


def _ms_make(shape, d, randn):
    (q, k, v), causal = _bench_qkv(shape, d, randn)
    windows = _BenchWindows(MS_BENCH_WINDOWS)
    windows.causal = causal
    return (q, k, v, windows, MS_BENCH_DILATIONS), {"causal": causal}


def _ms_flops(args, out):
    """4 D per visible (query, key) pair, with 2w + 1 keys per row (w + 1 causal); edges ignored."""
    B, H, S, D = args[0].shape
    causal = getattr(args[3], "causal", False)
    keys = sum((w + 1) if causal else (2 * w + 1) for w in args[3]) / len(args[3])
    return int(4 * B * H * S * keys * D)


MULTISCALE_BENCH = BenchSpec(
    make_inputs=_ms_make,
    torch_fn=lambda q, k, v, w, d, causal=False: _sdpa_peer(q, k, v, causal=causal),
    default_shape=lambda d: (1, 16, 4096, 64, 0), flops=_ms_flops, bytes_moved=_qkvo_bytes,
    check_shape=lambda s: (1, 4, min(s[2], 1024), s[3], s[4]),
    extra_shapes=((1, 16, 4096, 64, 1), (1, 16, 16384, 64, 0), (1, 16, 16384, 64, 1),
                  (1, 16, 4096, 128, 0)))


# ---------------------------------------------------------------------------------------------
# The ops.

@register(family="attention", reference=ref_linear_attention, bench=LINEAR_BENCH)
def linear_attention(call, query: Tensor, key: Tensor, value: Tensor, feature_map: str = "elu",
                     causal: bool = False, *, eps: float = 1e-6, enable_gqa: bool = False):
    """Linear attention: phi(q_i)^T S_i / (phi(q_i)^T z_i + eps), O(S) time and memory.

    ``query`` [B, Hq, Sq, D], ``key`` [B, Hkv, Sk, D], ``value`` [B, Hkv, Sk, Dv] (any strides;
    Dv may differ from D). Hkv == Hq, or ``enable_gqa=True`` with Hq a multiple of Hkv (query
    head h reads key/value head h // (Hq / Hkv)). Returns [B, Hq, Sq, Dv]. With
    S_i = sum_j phi(k_j) v_j^T ([D, Dv]) and z_i = sum_j phi(k_j) ([D]):

        out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps)

    * ``feature_map`` phi, elementwise: 'elu' (elu(x) + 1, positive: Katharopoulos et al.),
      'relu' (max(x, 0)), 'identity' (x; the denominator may then be 0 or negative, and the
      result is what the formula gives).
    * ``causal=False``: j over all Sk keys. ``causal=True``: j <= i, aligned top-left as torch's
      ``is_causal`` (with Sk < Sq the rows past Sk see every key; keys past Sq are never seen).
    * ``eps`` (default 1e-6, >= 0) is added to the denominator: a row whose features are all 0
      (possible with 'relu') gives 0 instead of 0 / 0.

    GPU: chunks of 64 rows. Per chunk the state S_c, z_c of its keys (fp32), exclusive prefix
    sums over the chunks (causal) or their total (not causal), then per 64-row query tile
    phi(Q) S + the chunk's own masked phi(Q) phi(K)^T V. fp32 math and state for every storage
    dtype; the workspace is B Hkv ceil(Sq / 64) D (Dv + 1) floats when causal (a few records
    otherwise). Time and memory grow linearly in S.
    """
    return _linear_forward(call, query, key, value, feature_map, causal, eps, enable_gqa)


@register(family="attention", reference=ref_kernelized_attention, bench=KERNELIZED_BENCH)
def kernelized_attention(call, query: Tensor, key: Tensor, value: Tensor,
                         num_features: int = 256, kernel: str = "softmax", seed: int = 0, *,
                         causal: bool = False, scale: float | None = None,
                         orthogonal: bool = True, eps: float = 0.0, enable_gqa: bool = False):
    """Kernelized (Performer FAVOR+) attention: random features, then linear attention, O(S).

    Shapes as ``linear_attention``. With x' = x sqrt(scale) (``scale`` default 1 / sqrt(D), so
    x' = x D^(-1/4)) and m = ``num_features`` random directions w_r, the rows of
    W = ``random_features(m, D, seed, orthogonal)`` (drawn on the host from
    ``numpy.random.default_rng(seed)``, rounded to float32; ``orthogonal=True``: blocks of D
    orthonormal rows with Gaussian-vector norms, Performer's default; False: i.i.d. N(0, 1)):

    * ``kernel='softmax'`` (positive random features, approximates softmax(q k^T scale) v):
      phi(x)_r = exp(w_r . x' - |x'|^2 / 2 - stab) / sqrt(m), r < m. E[phi(q) . phi(k)] =
      exp(q' . k' - stab_q - stab_k). Stabilizers: for a query row the max over r of
      w_r . x' - |x'|^2 / 2 (per row: cancels between numerator and denominator); for keys the
      max of the same over all keys and features of the (batch, kv head) (one constant).
    * ``kernel='rbf'`` (trigonometric features of the Gaussian kernel): phi(x) =
      [cos(W x'), sin(W x')] / sqrt(m) (2m features), phi(q) . phi(k) approximates
      exp(-|q' - k'|^2 / 2): this is attention with Gaussian-kernel weights normalized over the
      keys (not softmax). Features are signed: the denominator can come close to 0.

    Then ``out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps)`` exactly as ``linear_attention``
    (``causal`` top-left; ``eps`` default 0: with stabilized features its size relative to the
    denominator is arbitrary). The error against exact attention decreases as 1/sqrt(m).

    GPU: the features in fp32 by favor_logits (X' W^T through shared memory; queries
    stabilized per row in the same kernel, keys by favor_key_exp after a max over the tiles),
    then the linear-attention kernels on fp32 features. W is uploaded once per (m, D, seed,
    orthogonal) and device and kept: make the first such call outside CUDA-graph capture.
    """
    return _kernelized_forward(call, query, key, value, num_features, kernel, seed, causal,
                               scale, orthogonal, eps, enable_gqa)


@register(family="attention", reference=ref_multiscale_attention, bench=MULTISCALE_BENCH)
def multiscale_attention(call, query: Tensor, key: Tensor, value: Tensor, windows, dilations, *,
                         scale: float | None = None, causal: bool = False,
                         enable_gqa: bool = False):
    """Multiscale attention: dilated sliding windows, one (window, dilation) per group of heads.

    ``query`` [B, Hq, Sq, D], ``key``/``value`` [B, Hkv, Sk, D] (D <= 256, any strides; GQA as
    ``linear_attention``). The Hq heads split into G = len(windows) equal groups (1 <= G <= 16;
    head h is in group h // (Hq / G)). In group g with w = windows[g] >= 0, d = dilations[g] >= 1,
    query i sees the keys j with

        |i - j| <= w * d  and  (i - j) % d == 0   (and j <= i when ``causal``), 0 <= j < Sk,

    i.e. j = i + t d for |t| <= w: at most 2w + 1 keys (w + 1 causal). Softmax attention over
    them with scores q . k * ``scale`` (default 1 / sqrt(D)); a row that sees no key (possible
    only with Sq > Sk) gives 0, as SDPA. Dense equivalent: SDPA with that boolean mask.

    GPU: cost O(S w D), not O(S^2). Rows of one residue i mod d form a sliding window of radius
    w over the keys of the same residue; a block takes 32 such rows, gathers the union of their
    keys (32 + 2w rows, stride d) through shared memory in tiles, and each row runs an online
    softmax (fp32, exp2) over exactly its own keys.
    """
    return _multiscale_forward(call, query, key, value, windows, dilations, scale, causal,
                               enable_gqa)
