"""GEMM family as torch custom ops: ``gpuops.torch.linear`` with autograd.

``torch.ops.gpuops.linear(x, weight, bias, activation)`` runs ``gpuops.linear`` (fused bias and
activation); its backward uses the same GEMM kernels on transposed views, through
``torch.ops.gpuops.mm`` (no copies of the operands):

* grad_input  = grad_pre @ weight          ([*, out] @ [out, in]: B row-major)
* grad_weight = grad_pre.T @ x             (A = a transposed view: M-contiguous)
* grad_bias   = ones[1, tokens] @ grad_pre (a GEMV that streams grad_pre once)

where grad_pre = grad * act'(pre). With an activation the pre-activation is recomputed in the
backward (one more GEMM, as activation checkpointing) instead of being saved by the forward.
Both ops have fake implementations, so they trace in ``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

from typing import Optional

import torch

import gpuops

__all__ = ["linear"]


@torch.library.custom_op("gpuops::mm", mutates_args=())
def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return gpuops.matmul(a.detach(), b.detach())


@_mm.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


@torch.library.custom_op("gpuops::linear", mutates_args=())
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            activation: Optional[str]) -> torch.Tensor:
    return gpuops.linear(x.detach(), weight.detach(), None if bias is None else bias.detach(),
                         activation)


@_linear.register_fake
def _(x, weight, bias, activation):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _act_backward(grad, pre, activation):
    if activation in (None, "none", "identity"):
        return grad
    if activation == "relu":
        return torch.ops.aten.threshold_backward(grad, pre, 0)
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, pre)
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(grad, pre, approximate="none")
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad, pre, approximate="tanh")
    raise ValueError(f"gpuops.torch.linear: activation={activation!r}")


def _setup(ctx, inputs, output):
    x, weight, bias, activation = inputs
    ctx.activation = activation
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, bias)


def _backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    if ctx.activation not in (None, "none", "identity"):
        pre = torch.ops.gpuops.linear(x, weight, bias, None)
        grad = _act_backward(grad, pre, ctx.activation)
    out_f, in_f = weight.shape
    g2 = grad.reshape(-1, out_f)
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.gpuops.mm(g2, weight).reshape(x.shape)
    if ctx.needs_input_grad[1]:
        grad_w = torch.ops.gpuops.mm(g2.t(), x.reshape(-1, in_f))
    if ctx.has_bias and ctx.needs_input_grad[2]:
        ones = torch.ones((1, g2.shape[0]), dtype=g2.dtype, device=g2.device)
        grad_b = torch.ops.gpuops.mm(ones, g2).reshape(bias.shape)
    return grad_x, grad_w, grad_b, None


_linear.register_autograd(_backward, setup_context=_setup)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           activation: Optional[str] = None) -> torch.Tensor:
    """Differentiable ``act(x @ weight.T + bias)`` (``torch.nn.functional.linear`` + activation),
    weight ``[out_features, in_features]``; activation None, 'relu', 'silu', 'gelu', 'gelu_tanh'.
    CUDA tensors run gpuops' kernels, CPU tensors the float64 references."""
    return torch.ops.gpuops.linear(x, weight, bias, activation)
