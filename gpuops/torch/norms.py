"""layer_norm, rms_norm and add_rms_norm as torch custom ops with autograd.

    import gpuops.torch as gt
    y = gt.layer_norm(x, (4096,), w, b)          # as F.layer_norm, differentiable
    y = gt.rms_norm(x, (4096,), w)               # as F.rms_norm
    y, residual = gt.add_rms_norm(x, residual, w, eps=1e-6)   # residual <- x + residual;
                                                              # y = RMSNorm(residual) * w

The forward ops (``torch.ops.gpuops.layer_norm`` / ``rms_norm`` / ``add_rms_norm``) also return
the per-row statistics (float32; float64 for float64 inputs) that their backward ops
(``torch.ops.gpuops.*_backward``) take, so nothing is recomputed; the functions above return only
what torch's do. CUDA tensors run gpuops' kernels, CPU tensors the float64 NumPy references.
"""
from typing import List, Optional, Tuple

import torch

import gpuops

__all__ = ["layer_norm", "rms_norm", "add_rms_norm"]

Tensor = torch.Tensor


def _stat_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _lead(x: Tensor, k: int) -> List[int]:
    return list(x.shape[:x.dim() - k])


def _stats(x: Tensor, *stats: Tensor) -> Tuple[Tensor, ...]:
    # the CPU reference path returns statistics in the input's dtype
    return tuple(s.to(_stat_dtype(x)) for s in stats)


# ------------------------------------------------------------------------------- layer_norm

@torch.library.custom_op("gpuops::layer_norm", mutates_args=())
def _layer_norm(x: Tensor, normalized_shape: List[int], weight: Optional[Tensor],
                bias: Optional[Tensor], eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    y, mean, rstd = gpuops.layer_norm_forward(x, tuple(normalized_shape), weight, bias, eps)
    return (y,) + _stats(x, mean, rstd)


@_layer_norm.register_fake
def _(x, normalized_shape, weight, bias, eps):
    lead = _lead(x, len(normalized_shape))
    return (x.new_empty(x.shape), x.new_empty(lead, dtype=_stat_dtype(x)),
            x.new_empty(lead, dtype=_stat_dtype(x)))


@torch.library.custom_op("gpuops::layer_norm_backward", mutates_args=())
def _layer_norm_backward(grad_output: Tensor, x: Tensor, mean: Tensor, rstd: Tensor,
                         normalized_shape: List[int],
                         weight: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    return gpuops.layer_norm_backward(grad_output, x, mean, rstd, tuple(normalized_shape), weight)


@_layer_norm_backward.register_fake
def _(grad_output, x, mean, rstd, normalized_shape, weight):
    return (x.new_empty(x.shape), x.new_empty(normalized_shape), x.new_empty(normalized_shape))


def _layer_norm_setup(ctx, inputs, output):
    x, normalized_shape, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.normalized_shape = normalized_shape
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(mean, rstd)


def _layer_norm_grad(ctx, grad_y, _grad_mean, _grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    gx, gw, gb = torch.ops.gpuops.layer_norm_backward(grad_y, x, mean, rstd,
                                                      ctx.normalized_shape, weight)
    return (gx, None, gw if weight is not None else None, gb if ctx.has_bias else None, None)


_layer_norm.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


# ------------------------------------------------------------------------------- rms_norm

@torch.library.custom_op("gpuops::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, normalized_shape: List[int], weight: Optional[Tensor],
              eps: float) -> Tuple[Tensor, Tensor]:
    y, rstd = gpuops.rms_norm_forward(x, tuple(normalized_shape), weight, eps)
    return (y,) + _stats(x, rstd)


@_rms_norm.register_fake
def _(x, normalized_shape, weight, eps):
    return x.new_empty(x.shape), x.new_empty(_lead(x, len(normalized_shape)),
                                             dtype=_stat_dtype(x))


@torch.library.custom_op("gpuops::rms_norm_backward", mutates_args=())
def _rms_norm_backward(grad_output: Tensor, x: Tensor, rstd: Tensor, normalized_shape: List[int],
                       weight: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    return gpuops.rms_norm_backward(grad_output, x, rstd, tuple(normalized_shape), weight)


@_rms_norm_backward.register_fake
def _(grad_output, x, rstd, normalized_shape, weight):
    return x.new_empty(x.shape), x.new_empty(normalized_shape)


def _rms_norm_setup(ctx, inputs, output):
    x, normalized_shape, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.normalized_shape = normalized_shape
    ctx.mark_non_differentiable(output[1])


def _rms_norm_grad(ctx, grad_y, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    gx, gw = torch.ops.gpuops.rms_norm_backward(grad_y, x, rstd, ctx.normalized_shape, weight)
    return gx, None, gw if weight is not None else None, None


_rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


# ------------------------------------------------------------------------------- add_rms_norm

@torch.library.custom_op("gpuops::add_rms_norm", mutates_args=())
def _add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                  eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    y, h, rstd = gpuops.add_rms_norm_forward(x, residual, weight, eps)
    return (y, h) + _stats(x, rstd)


@_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return (x.new_empty(x.shape), x.new_empty(x.shape),
            x.new_empty(_lead(x, weight.dim()), dtype=_stat_dtype(x)))


@torch.library.custom_op("gpuops::add_rms_norm_backward", mutates_args=())
def _add_rms_norm_backward(grad_normed: Tensor, grad_residual: Optional[Tensor],
                           residual_out: Tensor, rstd: Tensor,
                           weight: Tensor) -> Tuple[Tensor, Tensor]:
    return gpuops.add_rms_norm_backward(grad_normed, grad_residual, residual_out, rstd, weight)


@_add_rms_norm_backward.register_fake
def _(grad_normed, grad_residual, residual_out, rstd, weight):
    return residual_out.new_empty(residual_out.shape), weight.new_empty(weight.shape)


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, _ = inputs
    _, h, rstd = output
    ctx.save_for_backward(h, weight, rstd)
    ctx.mark_non_differentiable(rstd)


def _add_rms_norm_grad(ctx, grad_y, grad_h, _grad_rstd):
    h, weight, rstd = ctx.saved_tensors
    gx, gw = torch.ops.gpuops.add_rms_norm_backward(grad_y, grad_h, h, rstd, weight)
    return gx, gx, gw, None    # d(x + residual)/dx = d(x + residual)/dresidual = 1


_add_rms_norm.register_autograd(_add_rms_norm_grad, setup_context=_add_rms_norm_setup)


# ------------------------------------------------------------------------------- public API

def _shape_list(normalized_shape) -> List[int]:
    if isinstance(normalized_shape, int):
        return [normalized_shape]
    return [int(s) for s in normalized_shape]


def layer_norm(input: Tensor, normalized_shape, weight: Optional[Tensor] = None,
               bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """``torch.nn.functional.layer_norm`` on gpuops' kernels, with autograd."""
    return torch.ops.gpuops.layer_norm(input, _shape_list(normalized_shape), weight, bias,
                                       float(eps))[0]


def rms_norm(input: Tensor, normalized_shape, weight: Optional[Tensor] = None,
             eps: Optional[float] = None) -> Tensor:
    """``torch.nn.functional.rms_norm`` on gpuops' kernels, with autograd (eps=None: the
    machine epsilon of the input's dtype, as torch)."""
    if eps is None:
        eps = torch.finfo(input.dtype).eps
    return torch.ops.gpuops.rms_norm(input, _shape_list(normalized_shape), weight, float(eps))[0]


def add_rms_norm(input: Tensor, residual: Tensor, weight: Tensor,
                 eps: float = 1e-6) -> Tuple[Tensor, Tensor]:
    """``(rms_norm(input + residual) * weight, input + residual)`` in one pass, with autograd
    (the pre-norm residual step of LLM decoder layers; see ``gpuops.add_rms_norm``)."""
    y, h, _ = torch.ops.gpuops.add_rms_norm(input, residual, weight, float(eps))
    return y, h
