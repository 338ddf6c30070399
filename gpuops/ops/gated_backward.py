"""Backward of the gated activations (SwiGLU's ``silu(gate) * up``, GeGLU's ``gelu(gate) * up``).

Kernels: cuda_src/elementwise/gated_backward.cu (derivatives in
cuda_src/common/activation_grads.cuh).
One pass: grad_output, gate and up are read once, grad_gate and grad_up written once; act(gate)
is recomputed rather than saved. Math is fp32 for fp32/fp16/bf16 storage. The autograd ops of
gpuops.torch (``gpuops.torch.silu_mul``, ``gelu_mul``) call these.
"""
from __future__ import annotations

import math

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.registry import register
from gpuops.runtime import device, loader
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.shapes import broadcast_shapes, broadcast_strides, coalesce, contiguous_strides
from gpuops.tensor import Tensor

THREADS = 256                       # kPointwiseThreads
MAX_DIMS = 8                        # kMaxDims of common/strided.cuh
STRIDED_BLOCKS_PER_SM = 8
FLAT_ARGS = ArgSpec("ptr", "ptr", "ptr", "ptr", "ptr", "i64")
STRIDED_ARGS = ArgSpec("ptr", "ptr", "ptr", "ptr", "ptr", "i8q32q", "i64")
_ACTS = {"silu": "kSilu", "gelu": "kGeluErf", "gelu_tanh": "kGeluTanh"}


def _flat_expr(act, d):
    return f"gpuops::gated_backward_flat<gpuops::Act::{_ACTS[act]}, {d.ctype}, {16 // d.itemsize}>"


def _strided_expr(act, d):
    return f"gpuops::gated_backward_strided<gpuops::Act::{_ACTS[act]}, {d.ctype}>"


MODULE = KernelModule(
    "elementwise.gated_backward", "elementwise/gated_backward.cu",
    {**{_flat_expr(a, d): FLAT_ARGS for a in _ACTS for d in dt.FLOATS},
     **{_strided_expr(a, d): STRIDED_ARGS for a in _ACTS for d in dt.FLOATS}}, pdl=True)

# kernel names built once, not per call
_EXPRS = {(a, d, flat): (_flat_expr(a, d) if flat else _strided_expr(a, d))
          for a in _ACTS for d in dt.FLOATS for flat in (True, False)}
_blocks: dict = {}


def _kernel(dev, act, dtype, flat):
    return loader.kernel(MODULE, dev, _EXPRS[(act, dtype, flat)])


def _gated_backward(call, act, grad_output: Tensor, gate: Tensor, up: Tensor):
    shape = tuple(grad_output.shape)
    if tuple(gate.shape) != shape or tuple(up.shape) != shape:
        shape = broadcast_shapes(grad_output=grad_output.shape, gate=gate.shape, up=up.shape)
    dtype = call.result_dtype
    grad_gate = call.empty(shape, dtype)
    grad_up = call.empty(shape, dtype)
    n = grad_gate.numel
    if n == 0:
        return grad_gate, grad_up
    inputs = (grad_output, gate, up)
    same = (tuple(gate.shape) == shape and tuple(up.shape) == shape
            and tuple(grad_output.shape) == shape)
    if (same and grad_output.contiguous and gate.contiguous and up.contiguous
            and (grad_output.ptr | gate.ptr | up.ptr) % 16 == 0):
        packs = n // (16 // dtype.itemsize)
        grid = max(1, -(-packs // THREADS))
        _kernel(call.device, act, dtype, True).launch(
            (grid, 1, 1), (THREADS, 1, 1), call.stream, grad_gate.ptr, grad_up.ptr,
            grad_output.ptr, gate.ptr, up.ptr, n)
        return grad_gate, grad_up
    strides = [broadcast_strides(t.shape, t.strides, shape) for t in inputs]
    strides.append(contiguous_strides(shape))          # the outputs: keeps their element order
    cshape, cstrides = coalesce(shape, strides)
    if len(cshape) > MAX_DIMS:
        raise ValueError(f"gpuops.{call.op.name}: the operands' layouts need {len(cshape)} "
                         f"dimensions after merging contiguous ones; the strided kernel handles "
                         f"{MAX_DIMS}. Make the inputs contiguous first")
    pad = MAX_DIMS - len(cshape)
    layout = [len(cshape), *cshape, *[1] * pad]
    for k in range(4):
        st = cstrides[k] if k < 3 else (0,) * len(cshape)
        layout += [*st, *[0] * pad]
    blocks = _blocks.get(call.device)
    if blocks is None:
        blocks = _blocks[call.device] = (device.device_info(call.device).sm_count
                                         * STRIDED_BLOCKS_PER_SM)
    grid = max(1, min(-(-n // THREADS), blocks))
    _kernel(call.device, act, dtype, False).launch(
        (grid, 1, 1), (THREADS, 1, 1), call.stream, grad_gate.ptr, grad_up.ptr, grad_output.ptr,
        gate.ptr, up.ptr, *layout, n)
    return grad_gate, grad_up


# ---------------------------------------------------------------------------------------------
# NumPy references, float64: the derivatives as written in torch's backward formulas.

def _erf(x):
    try:
        from scipy.special import erf  # noqa: PLC0415
        return erf(x)
    except ImportError:
        return np.frompyfunc(math.erf, 1, 1)(x).astype(np.float64)


def _broadcast(grad_output, gate, up):
    broadcast_shapes(grad_output=np.shape(grad_output), gate=np.shape(gate), up=np.shape(up))
    return np.broadcast_arrays(np.asarray(grad_output), np.asarray(gate), np.asarray(up))


def _check_approximate(approximate):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gpuops.gelu_mul_backward: approximate={approximate!r}; expected 'none' "
                         "or 'tanh'")


def ref_silu_mul_backward(grad_output, gate, up):
    go, x, u = _broadcast(grad_output, gate, up)
    with np.errstate(all="ignore"):
        s = 1.0 / (1.0 + np.exp(-x))
        return go * u * (s * (1.0 + x * (1.0 - s))), go * (x * s)


def ref_gelu_mul_backward(grad_output, gate, up, approximate="none"):
    _check_approximate(approximate)
    go, x, u = _broadcast(grad_output, gate, up)
    with np.errstate(all="ignore"):
        if approximate == "none":
            cdf = 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))
            pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
            act, grad = x * cdf, cdf + x * pdf
        else:
            beta, kappa = math.sqrt(2.0 / math.pi), 0.044715
            th = np.tanh(beta * (x + kappa * x ** 3))
            act = 0.5 * x * (1.0 + th)
            grad = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * beta * (1.0 + 3.0 * kappa * x * x)
        return go * u * grad, go * act


# ---------------------------------------------------------------------------------------------
# Benchmarks: [32768, 4096]; the floor is 3 reads + 2 writes.

def _bench_shape(d):
    return (32768, 4096)


def _make(shape, d, randn):
    return (randn(shape, d), randn(shape, d), randn(shape, d)), {}


def _make_gelu(shape, d, randn):
    return (randn(shape, d), randn(shape, d), randn(shape, d)), {"approximate": "none"}


def _torch_silu_backward(grad_output, gate, up):
    import torch  # noqa: PLC0415
    # what autograd runs for F.silu(gate) * up
    return (torch.ops.aten.silu_backward(grad_output * up, gate),
            grad_output * torch.nn.functional.silu(gate))


def _torch_gelu_backward(grad_output, gate, up, approximate="none"):
    import torch  # noqa: PLC0415
    return (torch.ops.aten.gelu_backward(grad_output * up, gate, approximate=approximate),
            grad_output * torch.nn.functional.gelu(gate, approximate=approximate))


def _liger_swiglu_backward():
    # LigerSiLUMulFunction.backward is swiglu_backward(a, b, dc): it writes the gradients into a
    # and b (the bench inputs; the values do not change the timing).
    from liger_kernel.ops.swiglu import swiglu_backward  # noqa: PLC0415
    return {"liger": lambda grad_output, gate, up: swiglu_backward(gate, up, grad_output)}


# ---------------------------------------------------------------------------------------------
# The ops.

@register(family="elementwise", reference=ref_silu_mul_backward,
          bench=BenchSpec(make_inputs=_make, torch_fn=_torch_silu_backward,
                          default_shape=_bench_shape, compile_peer=True,
                          extra_peers=_liger_swiglu_backward))
def silu_mul_backward(call, grad_output: Tensor, gate: Tensor, up: Tensor) -> tuple:
    """Backward of ``silu_mul`` (SwiGLU): returns ``(grad_gate, grad_up)`` in one pass.

    ``grad_gate = grad_output * up * s * (1 + gate * (1 - s))`` with ``s = sigmoid(gate)``, and
    ``grad_up = grad_output * silu(gate)``, as torch's autograd of ``F.silu(gate) * up`` (NaN at
    ``gate = +-inf`` as there). The inputs broadcast against each other like the forward's; the
    gradients have the broadcast shape (sum them over broadcast dimensions yourself, as
    ``gpuops.torch.silu_mul`` does).
    """
    return _gated_backward(call, "silu", grad_output, gate, up)


@register(family="elementwise", reference=ref_gelu_mul_backward,
          bench=BenchSpec(make_inputs=_make_gelu, torch_fn=_torch_gelu_backward,
                          default_shape=_bench_shape, compile_peer=True))
def gelu_mul_backward(call, grad_output: Tensor, gate: Tensor, up: Tensor,
                      approximate: str = "none") -> tuple:
    """Backward of ``gelu_mul`` (GeGLU): returns ``(grad_gate, grad_up)`` in one pass.

    ``grad_gate = grad_output * up * gelu'(gate)``, ``grad_up = grad_output * gelu(gate)``; with
    ``approximate='none'`` ``gelu'(x) = Phi(x) + x phi(x)`` (Phi from its lower tail, as the
    forward, so the result keeps its relative precision for x << 0), with ``'tanh'`` the
    derivative of ``x sigmoid(2u)`` written without torch's ``1 + tanh(u)`` cancellation. NaN at
    ``gate = +-inf``, as torch. Broadcasting as ``silu_mul_backward``.
    """
    _check_approximate(approximate)
    return _gated_backward(call, "gelu" if approximate == "none" else "gelu_tanh", grad_output,
                           gate, up)
