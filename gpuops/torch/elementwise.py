"""The gated activations as differentiable torch ops: ``gpuops::silu_mul`` (SwiGLU) and
``gpuops::gelu_mul`` (GeGLU), whose backward is one pass of ``gpuops.silu_mul_backward`` /
``gpuops.gelu_mul_backward`` (ops ``gpuops::silu_mul_backward``, ``gpuops::gelu_mul_backward``).

    import gpuops.torch as gt
    h = gt.silu_mul(gate, up)          # = F.silu(gate) * up, with torch's broadcasting
"""
from __future__ import annotations

from typing import Tuple

import torch

import gpuops

__all__ = ["silu_mul", "gelu_mul"]

Tensor = torch.Tensor


def _reduce_to(grad: Tensor, like: Tensor) -> Tensor:
    """The gradient of a broadcast input: summed over the dims it was broadcast along."""
    return grad if grad.shape == like.shape else grad.sum_to_size(like.shape)


def _broadcast_empty(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty(torch.broadcast_shapes(a.shape, b.shape))


# ------------------------------------------------------------------------------------ silu_mul

@torch.library.custom_op("gpuops::silu_mul", mutates_args=())
def _silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return gpuops.silu_mul(gate, up)


@_silu_mul.register_fake
def _(gate, up):
    return _broadcast_empty(gate, up)


@torch.library.custom_op("gpuops::silu_mul_backward", mutates_args=())
def _silu_mul_backward(grad_output: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    return gpuops.silu_mul_backward(grad_output, gate, up)


@_silu_mul_backward.register_fake
def _(grad_output, gate, up):
    shape = torch.broadcast_shapes(grad_output.shape, gate.shape, up.shape)
    return grad_output.new_empty(shape), grad_output.new_empty(shape)


def _gated_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.approximate = inputs[2] if len(inputs) > 2 else None


def _silu_mul_grad(ctx, grad_output):
    gate, up = ctx.saved_tensors
    dg, du = torch.ops.gpuops.silu_mul_backward(grad_output, gate, up)
    return _reduce_to(dg, gate), _reduce_to(du, up)


_silu_mul.register_autograd(_silu_mul_grad, setup_context=_gated_setup)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """Differentiable :func:`gpuops.silu_mul`: ``F.silu(gate) * up`` (SwiGLU) in one pass, and its
    backward in one pass."""
    return torch.ops.gpuops.silu_mul(gate, up)


# ------------------------------------------------------------------------------------ gelu_mul

@torch.library.custom_op("gpuops::gelu_mul", mutates_args=())
def _gelu_mul(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    return gpuops.gelu_mul(gate, up, approximate)


@_gelu_mul.register_fake
def _(gate, up, approximate):
    return _broadcast_empty(gate, up)


@torch.library.custom_op("gpuops::gelu_mul_backward", mutates_args=())
def _gelu_mul_backward(grad_output: Tensor, gate: Tensor, up: Tensor,
                       approximate: str) -> Tuple[Tensor, Tensor]:
    return gpuops.gelu_mul_backward(grad_output, gate, up, approximate)


@_gelu_mul_backward.register_fake
def _(grad_output, gate, up, approximate):
    shape = torch.broadcast_shapes(grad_output.shape, gate.shape, up.shape)
    return grad_output.new_empty(shape), grad_output.new_empty(shape)


def _gelu_mul_grad(ctx, grad_output):
    gate, up = ctx.saved_tensors
    dg, du = torch.ops.gpuops.gelu_mul_backward(grad_output, gate, up, ctx.approximate)
    return _reduce_to(dg, gate), _reduce_to(du, up), None


_gelu_mul.register_autograd(_gelu_mul_grad, setup_context=_gated_setup)


def gelu_mul(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """Differentiable :func:`gpuops.gelu_mul`: ``F.gelu(gate, approximate) * up`` (GeGLU) in one
    pass, and its backward in one pass."""
    return torch.ops.gpuops.gelu_mul(gate, up, approximate)
