"""Autograd ``softmax`` / ``log_softmax`` (custom ops ``gpuops::softmax``, ``gpuops::log_softmax``
and their backward ops ``gpuops::softmax_backward``, ``gpuops::log_softmax_backward``).

    import gpuops.torch as gt
    y = gt.softmax(x, dim=-1)          # like torch.softmax(x, dim); x on CUDA runs gpuops' kernels

The backward uses the saved output only (``y * (g - sum(g * y))``, ``g - exp(y) * sum(g)``), as
torch does. Outputs have the layout gpuops gives them (the input's strides when it is dense,
else contiguous), which the fake implementations report too, so ``torch.compile`` sees the same
strides as eager. CPU tensors run the float64 NumPy references. Double backward is not supported.
"""
from __future__ import annotations

import torch

import gpuops
from gpuops.ops.softmax import like_strides, norm_dim

__all__ = ["softmax", "log_softmax"]


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), like_strides(tuple(t.shape), t.stride()),
                               dtype=t.dtype, device=t.device)


def _forward_op(name: str, fn):
    @torch.library.custom_op(f"gpuops::{name}", mutates_args=())
    def op(input: torch.Tensor, dim: int) -> torch.Tensor:
        out = _empty_like(input)
        return fn(input, dim, out=out)

    @op.register_fake
    def _(input, dim):
        norm_dim(name, input.dim(), dim)
        return _empty_like(input)
    return op


def _backward_op(name: str, fn):
    @torch.library.custom_op(f"gpuops::{name}", mutates_args=())
    def op(grad_output: torch.Tensor, output: torch.Tensor, dim: int) -> torch.Tensor:
        out = _empty_like(output)
        return fn(grad_output, output, dim, out=out)

    @op.register_fake
    def _(grad_output, output, dim):
        norm_dim(name, output.dim(), dim)
        return _empty_like(output)
    return op


_softmax = _forward_op("softmax", gpuops.softmax)
_log_softmax = _forward_op("log_softmax", gpuops.log_softmax)
_softmax_backward = _backward_op("softmax_backward", gpuops.softmax_backward)
_log_softmax_backward = _backward_op("log_softmax_backward", gpuops.log_softmax_backward)


def _setup(ctx, inputs, output):
    ctx.dim = inputs[1]
    ctx.save_for_backward(output)


def _grad_ready(grad: torch.Tensor) -> torch.Tensor:
    # autograd may hand over an expanded gradient (stride 0, e.g. from y.sum()): the row kernels
    # want unit stride along the reduced dim, so such a gradient is materialized first
    if any(st == 0 and n > 1 for st, n in zip(grad.stride(), grad.shape)):
        return grad.contiguous()
    return grad


def _softmax_bwd(ctx, grad):
    (y,) = ctx.saved_tensors
    return _softmax_backward(_grad_ready(grad), y, ctx.dim), None


def _log_softmax_bwd(ctx, grad):
    (y,) = ctx.saved_tensors
    return _log_softmax_backward(_grad_ready(grad), y, ctx.dim), None


_softmax.register_autograd(_softmax_bwd, setup_context=_setup)
_log_softmax.register_autograd(_log_softmax_bwd, setup_context=_setup)


def softmax(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Differentiable softmax along ``dim`` (``torch.softmax``), through gpuops' kernels."""
    return _softmax(input, dim)


def log_softmax(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Differentiable log_softmax along ``dim`` (``torch.log_softmax``), through gpuops' kernels."""
    return _log_softmax(input, dim)
