"""Losses: cross-entropy over large vocabularies, forward and backward, never materializing the
softmax (kernels: cuda_src/loss/cross_entropy.cu).

``cross_entropy_forward`` returns the loss and the per-row log-sum-exp (fp32), which is all the
backward needs besides the logits: ``cross_entropy_backward`` reads the logits once more and
writes d input = (softmax - smoothed one-hot) * scale, optionally into the logits' own memory
(``out=input``), which is how ``gpuops.torch.cross_entropy(..., inplace_backward=True)`` avoids
allocating a second [N, C] tensor.
"""
from __future__ import annotations

import numbers

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.ops.softmax import (KERNELS, SPLIT_THREADS, cdiv, check_out, contiguous_copy,
                                copy_into, pow2ceil, sm_count)
from gpuops.registry import register
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.tensor import Tensor

_B = {True: "true", False: "false"}
_TI = {dt.int64: "long long", dt.int32: "int"}
REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}     # CeMode in cross_entropy.cu
TARGET_DTYPES = (dt.int64, dt.int32)
LSE_DTYPES = (dt.float32, dt.float64, dt.float16, dt.bfloat16)   # float32 on the GPU

STATS_ARGS = ArgSpec("ptr", "i64", "i32", "i32", "i32", "ptr")
FINALIZE_ARGS = ArgSpec("ptr", "i64", "ptr", "i64", "i64", "i32", "i32", "ptr", "i64", "f32",
                        "i32", "ptr", "i64", "ptr", "ptr")
REDUCE_ARGS = ArgSpec("ptr", "i32", "i32", "ptr")
COUNT_ARGS = ArgSpec("ptr", "i64", "i64", "i64", "ptr")
BACKWARD_ARGS = ArgSpec("ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "ptr", "i64", "ptr",
                        "i64", "i32", "i32", "i64", "f32", "i32", "ptr")
FUSED_ARGS = ArgSpec("ptr", "i64", "ptr", "i64", "i32", "i32", "i64", "f32", "i32", "ptr", "ptr",
                     "i64", "ptr", "i64", "ptr")
SCALE_ARGS = ArgSpec("ptr", "i64", "i32", "ptr", "i64", "ptr", "i64", "i64", "i32", "i32")

CE_MODULE = KernelModule("loss.cross_entropy", "loss/cross_entropy.cu", {
    **{f"gpuops::ce_stats<{d.ctype}, {_B[v]}>": STATS_ARGS
       for d in dt.FLOATS for v in (True, False)},
    **{f"gpuops::ce_finalize<{d.ctype}, {ti}>": FINALIZE_ARGS
       for d in dt.FLOATS for ti in _TI.values()},
    **{f"gpuops::ce_reduce<{d.ctype}>": REDUCE_ARGS for d in dt.FLOATS},
    **{f"gpuops::ce_count<{ti}>": COUNT_ARGS for ti in _TI.values()},
    **{f"gpuops::ce_backward<{d.ctype}, {ti}, {_B[v]}>": BACKWARD_ARGS
       for d in dt.FLOATS for ti in _TI.values() for v in (True, False)},
    **{f"gpuops::ce_fused<{d.ctype}, {ti}, {_B[v]}>": FUSED_ARGS
       for d in dt.FLOATS for ti in _TI.values() for v in (True, False)},
    **{f"gpuops::ce_scale<{d.ctype}, {_B[v]}>": SCALE_ARGS
       for d in dt.FLOATS for v in (True, False)}})

FINALIZE_THREADS = 256
REDUCE_THREADS = 1024
FUSED_THREADS = 1024            # ce_fused's __launch_bounds__
FUSED_STATIC_SMEM = 1024        # what ce_fused's static shared memory may take, rounded up


# ---------------------------------------------------------------------------------------------
# Argument checks shared by the ops and their references.

def _check_args(op, input_shape, target_shape, ignore_index, reduction, label_smoothing):
    if reduction not in REDUCTIONS:
        raise ValueError(f"gpuops.{op}: reduction={reduction!r}; expected 'none', 'sum' or 'mean'")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"gpuops.{op}: 'ignore_index' must be an int, got "
                        f"{type(ignore_index).__name__}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real) or not (
            0.0 <= float(label_smoothing) <= 1.0):
        raise ValueError(f"gpuops.{op}: label_smoothing={label_smoothing!r}; expected a number "
                         "in [0, 1]")
    input_shape, target_shape = tuple(input_shape), tuple(target_shape)
    if len(input_shape) not in (1, 2):
        raise ValueError(f"gpuops.{op}: 'input' must be [N, C] logits (or [C] with a 0-d target), "
                         f"got shape {input_shape}")
    if target_shape != input_shape[:-1]:
        raise ValueError(f"gpuops.{op}: 'target' has shape {target_shape}; for 'input' of shape "
                         f"{input_shape} it must be {input_shape[:-1]} (class indices)")
    if input_shape[-1] == 0:
        raise ValueError(f"gpuops.{op}: 'input' has no classes (C = 0)")


def _loss_shape(input_shape, reduction):
    return tuple(input_shape[:-1]) if reduction == "none" else ()


# ---------------------------------------------------------------------------------------------
# NumPy references, float64.

def _ref_lse_loss(op, input, target, ignore_index, reduction, label_smoothing):
    x = np.asarray(input, dtype=np.float64)
    t = np.asarray(target)
    _check_args(op, x.shape, t.shape, ignore_index, reduction, label_smoothing)
    x2 = x.reshape(-1, x.shape[-1])
    t1 = t.reshape(-1).astype(np.int64)
    n, c = x2.shape
    with np.errstate(all="ignore"):
        m = np.max(x2, axis=1) if n else np.zeros(0)
        lse = m + np.log(np.sum(np.exp(x2 - m[:, None]), axis=1))
        valid = t1 != ignore_index
        inside = valid & (t1 >= 0) & (t1 < c)
        xt = np.where(inside, x2[np.arange(n), np.clip(t1, 0, c - 1)], np.nan)
        nll = lse - xt
        eps = float(label_smoothing)
        loss = nll if eps == 0 else (1 - eps) * nll + eps * (lse - x2.mean(axis=1))
        loss = np.where(valid, loss, 0.0)
    return loss, lse, valid, x.shape


def _reduce(loss, valid, reduction, shape):
    if reduction == "none":
        return loss.reshape(shape[:-1])
    with np.errstate(all="ignore"):
        total = np.sum(loss)
        return np.float64(total / np.sum(valid)) if reduction == "mean" else np.float64(total)


def ref_cross_entropy(input, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    loss, _, valid, shape = _ref_lse_loss("cross_entropy", input, target, ignore_index, reduction,
                                          label_smoothing)
    return np.asarray(_reduce(loss, valid, reduction, shape))


def ref_cross_entropy_forward(input, target, ignore_index=-100, reduction="mean",
                              label_smoothing=0.0):
    loss, lse, valid, shape = _ref_lse_loss("cross_entropy_forward", input, target, ignore_index,
                                            reduction, label_smoothing)
    return np.asarray(_reduce(loss, valid, reduction, shape)), lse.reshape(shape[:-1])


# the loss in the input's dtype, lse in float32 (as the kernels write it)
ref_cross_entropy_forward.result_dtype = lambda values, found: (
    None, dt.stat_dtype(found.get("input")))


def ref_cross_entropy_backward(grad_output, input, target, lse, ignore_index=-100,
                               reduction="mean", label_smoothing=0.0, grad_lse=None):
    x = np.asarray(input, dtype=np.float64)
    t = np.asarray(target)
    op = "cross_entropy_backward"
    _check_args(op, x.shape, t.shape, ignore_index, reduction, label_smoothing)
    g = np.asarray(grad_output, dtype=np.float64)
    _check_grad_shapes(op, x.shape, g.shape, np.shape(lse), reduction,
                       None if grad_lse is None else np.shape(grad_lse))
    x2 = x.reshape(-1, x.shape[-1])
    n, c = x2.shape
    t1 = t.reshape(-1).astype(np.int64)
    z = np.asarray(lse, dtype=np.float64).reshape(-1)
    valid = t1 != ignore_index
    if reduction == "none":
        a = g.reshape(-1)
    else:
        a = np.full(n, g.reshape(-1)[0])
        if reduction == "mean":
            with np.errstate(divide="ignore", invalid="ignore"):   # all ignored: a is unused
                a = a / np.sum(valid)
    a = np.where(valid, a, 0.0)
    b = np.zeros(n) if grad_lse is None else np.asarray(grad_lse, np.float64).reshape(-1)
    eps = float(label_smoothing)
    with np.errstate(all="ignore"):
        p = np.exp(x2 - z[:, None])
        dx = p * (a + b)[:, None] - (a * eps / c)[:, None]
        hit = valid & (t1 >= 0) & (t1 < c)
        rows = np.nonzero(hit)[0]
        dx[rows, t1[rows]] -= a[rows] * (1 - eps)
        dx = np.where(((a == 0) & (b == 0))[:, None], 0.0, dx)
    return dx.reshape(x.shape)


def ref_cross_entropy_with_grad(input, target, ignore_index=-100, reduction="mean",
                                label_smoothing=0.0):
    loss, lse = ref_cross_entropy_forward(input, target, ignore_index, reduction, label_smoothing)
    grad = ref_cross_entropy_backward(np.ones(np.shape(loss)), input, target, lse, ignore_index,
                                      reduction, label_smoothing)
    return grad, loss


def ref_cross_entropy_grad_scale(grad_output, grad, reduction="mean"):
    if reduction not in REDUCTIONS:
        raise ValueError(f"gpuops.cross_entropy_grad_scale: reduction={reduction!r}; expected "
                         "'none', 'sum' or 'mean'")
    g = np.asarray(grad_output, dtype=np.float64)
    x = np.asarray(grad, dtype=np.float64)
    _check_scale_shapes("cross_entropy_grad_scale", g.shape, x.shape, reduction)
    if reduction == "none":
        return x * g.reshape(g.shape + (1,))
    return x * g.reshape(-1)[0]


def _check_scale_shapes(op, grad_shape, shape, reduction):
    if len(shape) not in (1, 2):
        raise ValueError(f"gpuops.{op}: 'grad' must be [N, C] (or [C]), got shape {tuple(shape)}")
    expected = _loss_shape(shape, reduction)
    if tuple(grad_shape) != expected and not (reduction != "none" and
                                              int(np.prod(grad_shape)) == 1):
        raise ValueError(f"gpuops.{op}: 'grad_output' has shape {tuple(grad_shape)}; for "
                         f"reduction={reduction!r} it must be {expected}")


def _check_grad_shapes(op, input_shape, grad_shape, lse_shape, reduction, grad_lse_shape):
    loss_shape = _loss_shape(input_shape, reduction)
    if tuple(grad_shape) != loss_shape and not (reduction != "none" and
                                                int(np.prod(grad_shape)) == 1):
        raise ValueError(f"gpuops.{op}: 'grad_output' has shape {tuple(grad_shape)}; the loss "
                         f"of reduction={reduction!r} has shape {loss_shape}")
    if tuple(lse_shape) != tuple(input_shape[:-1]):
        raise ValueError(f"gpuops.{op}: 'lse' has shape {tuple(lse_shape)}, expected "
                         f"{tuple(input_shape[:-1])} (one value per row)")
    if grad_lse_shape is not None and tuple(grad_lse_shape) != tuple(input_shape[:-1]):
        raise ValueError(f"gpuops.{op}: 'grad_lse' has shape {tuple(grad_lse_shape)}, expected "
                         f"{tuple(input_shape[:-1])}")


# ---------------------------------------------------------------------------------------------
# Launchers.

def _rows_view(call, x: Tensor):
    """(x, rows, C, row stride) with unit stride along the classes (a copy otherwise)."""
    c = x.shape[-1]
    if c > 1 and x.strides[-1] != 1:
        x = contiguous_copy(call, x)
    rows = x.shape[0] if len(x.shape) == 2 else 1
    xs = x.strides[0] if len(x.shape) == 2 else c
    if rows == 1:
        xs = c
    return x, rows, c, xs


def _target_stride(t: Tensor) -> int:
    return t.strides[0] if len(t.shape) == 1 else 0


def _vec_ok(vec, c, ptrs, strides) -> bool:
    return c % vec == 0 and all(p % 16 == 0 for p in ptrs) and all(s % vec == 0 for s in strides)


def _forward(call, input: Tensor, target: Tensor, ignore_index, reduction, label_smoothing):
    op = call.op.name
    _check_args(op, input.shape, target.shape, ignore_index, reduction, label_smoothing)
    dtype, dev = call.result_dtype, call.device
    x, rows, c, xs = _rows_view(call, input)
    mode = REDUCTIONS[reduction]
    loss = call.empty(_loss_shape(input.shape, reduction), dtype)
    lse = call.empty(tuple(input.shape[:-1]), dt.float32)
    if rows == 0:
        if mode != 0:       # sum of nothing = 0, mean of nothing = 0 / 0 = NaN, as torch
            KERNELS.get(dev, CE_MODULE, f"gpuops::ce_reduce<{dtype.ctype}>").launch(
                (1, 1, 1), (32, 1, 1), call.stream, 0, 0, mode, loss.ptr)
        return loss, lse
    vec = 16 // dtype.itemsize
    v = _vec_ok(vec, c, (x.ptr,), (xs,))
    step = SPLIT_THREADS * (vec if v else 1)
    steps = cdiv(c, step)
    S = min(steps, max(1, cdiv(sm_count(dev) * 8, rows)))
    per = cdiv(steps, S)
    chunk = per * step
    S = cdiv(c, chunk)
    ws = call.empty((rows * S * 3,), dt.float32)
    KERNELS.get(dev, CE_MODULE, f"gpuops::ce_stats<{dtype.ctype}, {_B[v]}>").launch(
        (rows * S, 1, 1), (SPLIT_THREADS, 1, 1), call.stream, x.ptr, xs, c, chunk, S, ws.ptr)
    nblocks = cdiv(rows, FINALIZE_THREADS)
    part = call.empty((2 * nblocks,), dt.float32) if mode != 0 else None
    KERNELS.get(dev, CE_MODULE, f"gpuops::ce_finalize<{dtype.ctype}, {_TI[target.dtype]}>").launch(
        (nblocks, 1, 1), (FINALIZE_THREADS, 1, 1), call.stream, x.ptr, xs, target.ptr,
        _target_stride(target), rows, c, S, ws.ptr, int(ignore_index), float(label_smoothing),
        mode, loss.ptr if mode == 0 else 0, loss.strides[0] if mode == 0 and loss.shape else 0,
        lse.ptr, part.ptr if part is not None else 0)
    if mode != 0:
        KERNELS.get(dev, CE_MODULE, f"gpuops::ce_reduce<{dtype.ctype}>").launch(
            (1, 1, 1), (REDUCE_THREADS, 1, 1), call.stream, part.ptr, nblocks, mode, loss.ptr)
    return loss, lse


def _backward(call, grad_output: Tensor, input: Tensor, target: Tensor, lse: Tensor, ignore_index,
              reduction, label_smoothing, grad_lse, out):
    op = call.op.name
    _check_args(op, input.shape, target.shape, ignore_index, reduction, label_smoothing)
    _check_grad_shapes(op, input.shape, grad_output.shape, lse.shape, reduction,
                       None if grad_lse is None else grad_lse.shape)
    for name, t in (("lse", lse), ("grad_lse", grad_lse)):
        if t is not None and t.dtype is not dt.float32:
            raise TypeError(f"gpuops.{op}: {name!r} has dtype {t.dtype}; on the GPU it must be "
                            "float32 (as cross_entropy_forward returns it)")
    dtype, dev = call.result_dtype, call.device
    if out is None:
        out = call.empty(tuple(input.shape), dtype)
    else:
        check_out(op, out, input.shape, {"grad_output": grad_output, "input": input,
                                         "target": target, "lse": lse,
                                         **({"grad_lse": grad_lse} if grad_lse is not None else {})})
    if out.numel == 0:
        return out
    x, rows, c, xs = _rows_view(call, input)
    # the kernel writes rows with unit stride along the classes; any other `out` gets a copy
    d = out if c == 1 or out.strides[-1] == 1 else call.empty(tuple(input.shape), dtype)
    ds = d.strides[0] if len(d.shape) == 2 and rows > 1 else c
    gs = grad_output.strides[0] if REDUCTIONS[reduction] == 0 and grad_output.shape else 0
    _launch_backward(call, grad_output.ptr, gs, x, rows, c, xs, target, lse,
                     grad_lse.ptr if grad_lse is not None else 0,
                     grad_lse.strides[0] if grad_lse is not None and grad_lse.shape else 0,
                     d, ds, ignore_index, label_smoothing, REDUCTIONS[reduction])
    if d is not out:
        copy_into(call, out, d)
    return out


_smem_budget: dict = {}


def _fused_smem_budget(dev: int) -> int:
    b = _smem_budget.get(dev)
    if b is None:
        from gpuops.runtime import device  # noqa: PLC0415
        b = _smem_budget[dev] = max(0, device.device_info(dev).max_smem_per_block_optin
                                    - FUSED_STATIC_SMEM)
    return b


def _with_grad(call, input: Tensor, target: Tensor, ignore_index, reduction, label_smoothing,
               out):
    op = call.op.name
    _check_args(op, input.shape, target.shape, ignore_index, reduction, label_smoothing)
    dtype, dev = call.result_dtype, call.device
    if out is None:
        out = call.empty(tuple(input.shape), dtype)
    else:
        check_out(op, out, input.shape, {"input": input, "target": target})
    x, rows, c, xs = _rows_view(call, input)
    d = out if c == 1 or out.strides[-1] == 1 else call.empty(tuple(input.shape), dtype)
    ds = d.strides[0] if len(d.shape) == 2 and rows > 1 else c
    mode = REDUCTIONS[reduction]
    ti = _TI[target.dtype]
    if rows < sm_count(dev):
        # few rows: one block per row would leave SMs idle; the split forward, then the
        # gradient with a unit grad_output (x[target] is read by the forward before any write)
        loss, lse = _forward(call, x, target, ignore_index, reduction, label_smoothing)
        if rows:
            _launch_backward(call, 0, 0, x, rows, c, xs, target, lse, 0, 0, d, ds, ignore_index,
                             label_smoothing, mode)
    else:
        loss = call.empty(_loss_shape(input.shape, reduction), dtype)
        count = _launch_count(call, target, rows, ignore_index) if mode == 2 else None
        vec = 16 // dtype.itemsize
        v = _vec_ok(vec, c, (x.ptr, d.ptr), (xs, ds))
        N = vec if v else 1
        packs = c // N
        raw = 16 if v else 4
        cache_packs = min(packs, _fused_smem_budget(dev) // raw)
        part = call.empty((2 * rows,), dt.float32) if mode != 0 else None
        threads = min(FUSED_THREADS, max(32, pow2ceil(cdiv(packs, 2))))
        KERNELS.get(dev, CE_MODULE, f"gpuops::ce_fused<{dtype.ctype}, {ti}, {_B[v]}>").launch(
            (rows, 1, 1), (threads, 1, 1), call.stream, x.ptr, xs, target.ptr,
            _target_stride(target), c, cache_packs, int(ignore_index), float(label_smoothing),
            mode, count.ptr if count is not None else 0, d.ptr, ds, loss.ptr if mode == 0 else 0,
            loss.strides[0] if mode == 0 and loss.shape else 0,
            part.ptr if part is not None else 0, smem=cache_packs * raw)
        if mode != 0:
            KERNELS.get(dev, CE_MODULE, f"gpuops::ce_reduce<{dtype.ctype}>").launch(
                (1, 1, 1), (REDUCE_THREADS, 1, 1), call.stream, part.ptr, rows, mode, loss.ptr)
    if d is not out:
        copy_into(call, out, d)
    return out, loss


def _launch_count(call, target, rows, ignore_index) -> Tensor:
    """The number of non-ignored rows, on the device. The caller must hold the returned Tensor
    until the kernels that read it are enqueued: dropping it frees the memory to the framework's
    caching allocator, and the next ``call.empty`` (e.g. ce_fused's partials) may get the same
    address, which those kernels then overwrite (with GPUOPS_DEBUG_POISON, NaN) before reading
    the count."""
    cnt = call.empty((1,), dt.float32)
    KERNELS.get(call.device, CE_MODULE, f"gpuops::ce_count<{_TI[target.dtype]}>").launch(
        (1, 1, 1), (REDUCE_THREADS, 1, 1), call.stream, target.ptr, _target_stride(target), rows,
        int(ignore_index), cnt.ptr)
    return cnt


def _launch_backward(call, grad_ptr, gs, x, rows, c, xs, target, lse, glse_ptr, glse_stride, d,
                     ds, ignore_index, label_smoothing, mode):
    dtype, dev = call.result_dtype, call.device
    count = _launch_count(call, target, rows, ignore_index) if mode == 2 else None
    vec = 16 // dtype.itemsize
    v = _vec_ok(vec, c, (x.ptr, d.ptr), (xs, ds))
    cpb = cdiv(c, SPLIT_THREADS * (vec if v else 1))
    KERNELS.get(dev, CE_MODULE,
                f"gpuops::ce_backward<{dtype.ctype}, {_TI[target.dtype]}, {_B[v]}>").launch(
        (rows * cpb, 1, 1), (SPLIT_THREADS, 1, 1), call.stream, grad_ptr, gs, x.ptr, xs,
        target.ptr, _target_stride(target), lse.ptr, glse_ptr, glse_stride, d.ptr, ds, c, cpb,
        int(ignore_index), float(label_smoothing), mode, count.ptr if count is not None else 0)


def _grad_scale(call, grad_output: Tensor, grad: Tensor, reduction, out):
    op = call.op.name
    if reduction not in REDUCTIONS:
        raise ValueError(f"gpuops.{op}: reduction={reduction!r}; expected 'none', 'sum' or 'mean'")
    _check_scale_shapes(op, grad_output.shape, grad.shape, reduction)
    dtype, dev = call.result_dtype, call.device
    if out is None:
        out = call.empty(tuple(grad.shape), dtype)
    else:
        check_out(op, out, grad.shape, {"grad_output": grad_output, "grad": grad})
    if out.numel == 0:
        return out
    src, rows, c, ss = _rows_view(call, grad)
    d = out if (c == 1 or out.strides[-1] == 1) and src is grad else call.empty(
        tuple(grad.shape), dtype)
    ds = d.strides[0] if len(d.shape) == 2 and rows > 1 else c
    mode = REDUCTIONS[reduction]
    vec = 16 // dtype.itemsize
    v = _vec_ok(vec, c, (src.ptr, d.ptr), (ss, ds))
    cpb = cdiv(c, SPLIT_THREADS * (vec if v else 1))
    gs = grad_output.strides[0] if mode == 0 and grad_output.shape else 0
    grid = max(1, min(rows * cpb, sm_count(dev) * 16))
    KERNELS.get(dev, CE_MODULE, f"gpuops::ce_scale<{dtype.ctype}, {_B[v]}>").launch(
        (grid, 1, 1), (SPLIT_THREADS, 1, 1), call.stream, grad_output.ptr, gs, mode, src.ptr, ss,
        d.ptr, ds, rows, c, cpb)
    if d is not out:
        copy_into(call, out, d)
    return out


# ---------------------------------------------------------------------------------------------
# Benchmarks: N = 8192 rows of a 151,936-token vocabulary (Qwen2), bf16 logits: 2.49 GB.

def _ce_shape(d):
    return (8192, 151936)


def _int_targets(like, n, c):
    """Random class indices in [0, c) on the device of ``like`` (torch or CuPy)."""
    mod = type(like).__module__.split(".")[0]
    if mod == "torch":
        import torch  # noqa: PLC0415
        return torch.randint(0, c, (n,), device=like.device, dtype=torch.int64)
    if mod == "cupy":
        import cupy  # noqa: PLC0415
        return cupy.random.randint(0, c, (n,)).astype(np.int64)
    return np.random.default_rng(0).integers(0, c, (n,)).astype(np.int64)


def _ce_make(shape, d, randn):
    x = randn(shape, d)
    return (x, _int_targets(x, shape[0], shape[1])), {}


def _torch_ce(x, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    import torch.nn.functional as F  # noqa: PLC0415,N812
    return F.cross_entropy(x, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)


def liger_cross_entropy_fn():
    """Liger-Kernel's cross-entropy as fn(x, target, ignore_index, reduction, label_smoothing) ->
    loss, built from the signature of the installed LigerCrossEntropyFunction.forward (its
    parameter list changed across releases; autograd Functions take no keywords). Note that
    Liger writes the gradient into x during the forward when x requires grad."""
    import inspect  # noqa: PLC0415
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction  # noqa: PLC0415
    params = list(inspect.signature(LigerCrossEntropyFunction.forward).parameters.values())[1:]

    def fn(x, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
        # weight: per-class rescaling, a required positional (no default) in Liger 0.8.x
        known = {"ignore_index": ignore_index, "reduction": reduction,
                 "label_smoothing": label_smoothing, "weight": None}
        args = [x, target]
        for p in params[2:]:
            if p.name in known:
                args.append(known[p.name])
            elif p.default is not inspect.Parameter.empty:
                args.append(p.default)
            else:
                raise TypeError(f"LigerCrossEntropyFunction.forward: no value for {p.name!r}")
        out = LigerCrossEntropyFunction.apply(*args)
        return out[0] if isinstance(out, tuple) else out
    return fn


def _liger_peer():
    return {"liger": liger_cross_entropy_fn()}


def _bwd_make(shape, d, randn):
    x = randn(shape, d)
    t = _int_targets(x, shape[0], shape[1])
    lse = randn((shape[0],), dt.float32) * 0.5 + 12.0
    g = x[0, :1] * 0 + 1                    # a one-element grad_output of x's dtype and framework
    return (g, x, t, lse), {}


def _torch_ce_backward(g, x, target, lse, ignore_index=-100, reduction="mean",
                       label_smoothing=0.0, grad_lse=None):
    """What one writes in torch for the same gradient (reduction='mean', no smoothing)."""
    import torch  # noqa: PLC0415
    p = (x.float() - lse[:, None]).exp_()
    p[torch.arange(x.shape[0], device=x.device), target] -= 1.0
    return (p * (g / x.shape[0])).to(x.dtype)


def _torch_ce_with_grad(x, target, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                        _ce=None):
    """torch's forward + backward of the same loss: (grad, loss)."""
    import torch  # noqa: PLC0415
    xr = x.detach().requires_grad_()
    loss = (_ce or _torch_ce)(xr, target, ignore_index=ignore_index, reduction=reduction,
                              label_smoothing=label_smoothing)
    (grad,) = torch.autograd.grad(loss, xr)
    return grad, loss


def _with_grad_peers():
    import torch  # noqa: PLC0415
    peers = {}
    compiled = torch.compile(_torch_ce, dynamic=False)
    peers["torch.compile"] = lambda *a, **k: _torch_ce_with_grad(*a, **k, _ce=compiled)
    try:
        liger = liger_cross_entropy_fn()
    except ImportError:
        return peers

    def liger_fwd_bwd(x, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
        # Liger writes the gradient into x during the forward (as ours with out=x would)
        xr = x.detach().requires_grad_()
        loss = liger(xr, target, ignore_index, reduction, label_smoothing)
        (grad,) = torch.autograd.grad(loss, xr)
        return grad, loss
    peers["liger"] = liger_fwd_bwd
    return peers


# ---------------------------------------------------------------------------------------------
# The ops.

_CE_PARAMS = {"target": TARGET_DTYPES}


@register(family="loss", reference=ref_cross_entropy, param_dtypes=_CE_PARAMS,
          bench=BenchSpec(make_inputs=_ce_make, torch_fn=_torch_ce, default_shape=_ce_shape,
                          compile_peer=True, extra_peers=_liger_peer,
                          extra_shapes=((16, 151936), (4096, 151936))))
def cross_entropy(call, input: Tensor, target: Tensor, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """Cross-entropy loss of logits against class indices, as ``F.cross_entropy``; no softmax stored.

    ``input`` [N, C] (or [C]) logits, ``target`` [N] (or 0-d) int64 or int32 class indices, the
    arguments of ``torch.nn.functional.cross_entropy`` of the same names.

    Rows whose target is ``ignore_index`` contribute 0 and are left out of the 'mean' denominator
    (all ignored: NaN, as torch); ``label_smoothing`` eps gives (1 - eps) nll + eps (lse - mean x).
    The softmax is never materialized: one read of the logits (online max / sum exp in fp32, the
    vocabulary split across blocks when there are few rows). A target outside [0, C) gives NaN
    (torch raises a device assert). Probability targets, class weights and [N, C, d...] inputs
    are not supported. For autograd use ``gpuops.torch.cross_entropy``.
    """
    return _forward(call, input, target, ignore_index, reduction, label_smoothing)[0]


@register(family="loss", reference=ref_cross_entropy_forward, param_dtypes=_CE_PARAMS)
def cross_entropy_forward(call, input: Tensor, target: Tensor, ignore_index: int = -100,
                          reduction: str = "mean", label_smoothing: float = 0.0):
    """cross_entropy returning ``(loss, lse)``: the per-row logsumexp (fp32) the backward needs.

    lse = logsumexp(input, -1), what :func:`cross_entropy_backward` takes. (On the CPU reference
    path lse has the input's dtype.)"""
    return _forward(call, input, target, ignore_index, reduction, label_smoothing)


@register(family="loss", reference=ref_cross_entropy_backward,
          param_dtypes={**_CE_PARAMS, "lse": LSE_DTYPES, "grad_lse": LSE_DTYPES},
          bench=BenchSpec(make_inputs=_bwd_make, torch_fn=_torch_ce_backward,
                          default_shape=_ce_shape, compile_peer=True))
def cross_entropy_backward(call, grad_output: Tensor, input: Tensor, target: Tensor, lse: Tensor,
                           ignore_index: int = -100, reduction: str = "mean",
                           label_smoothing: float = 0.0, grad_lse: Tensor | None = None, *,
                           out: Tensor | None = None) -> Tensor:
    """Gradient of cross_entropy with respect to the logits, from the forward's per-row lse.

    ``(softmax(input) - (1 - eps) onehot(target) - eps / C) * a`` per row, plus
    ``softmax(input) * grad_lse`` when the row's lse is differentiated too.

    ``a`` is ``grad_output`` (per row for 'none'), divided by the number of non-ignored rows for
    'mean', and 0 for ignored rows. ``lse`` is the fp32 per-row log-sum-exp from
    :func:`cross_entropy_forward`. One pass: reads the logits once, writes the gradient once;
    ``out`` may be ``input`` itself (the gradient then replaces the logits).
    """
    return _backward(call, grad_output, input, target, lse, ignore_index, reduction,
                     label_smoothing, grad_lse, out)


@register(family="loss", reference=ref_cross_entropy_with_grad, param_dtypes=_CE_PARAMS,
          bench=BenchSpec(make_inputs=_ce_make, torch_fn=_torch_ce_with_grad,
                          default_shape=_ce_shape, extra_peers=_with_grad_peers,
                          extra_shapes=((4096, 151936), (16, 151936))))
def cross_entropy_with_grad(call, input: Tensor, target: Tensor, ignore_index: int = -100,
                            reduction: str = "mean", label_smoothing: float = 0.0, *,
                            out: Tensor | None = None):
    """Cross-entropy loss and its gradient (for grad_output = 1) in one pass: ``(grad, loss)``.

    grad = d loss / d input, what :func:`cross_entropy_backward` gives with grad_output = 1. ``out`` receives grad and may be ``input`` itself: the logits are then
    replaced by their gradient (the memory-saving mode of Liger-Kernel and of
    ``gpuops.torch.cross_entropy(..., inplace_backward="forward")``).

    One block per row streams the row once, keeping most of it in shared memory, and writes the
    gradient (DRAM: one read, one write); with fewer rows than SMs the forward is split over
    blocks and the gradient written by a second kernel. Scale by another grad_output with
    :func:`cross_entropy_grad_scale`.
    """
    return _with_grad(call, input, target, ignore_index, reduction, label_smoothing, out)


@register(family="loss", reference=ref_cross_entropy_grad_scale)
def cross_entropy_grad_scale(call, grad_output: Tensor, grad: Tensor, reduction: str = "mean", *,
                             out: Tensor | None = None) -> Tensor:
    """Scale a cross_entropy_with_grad gradient by the actual grad_output: ``grad * grad_output``.

    Per row for reduction 'none', one value otherwise.

    ``out`` may be ``grad`` (in place); in place, rows whose factor is exactly 1 are not touched,
    so the common ``loss.backward()`` costs one launch and no pass over the gradient.
    """
    return _grad_scale(call, grad_output, grad, reduction, out)
