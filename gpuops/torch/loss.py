"""Autograd ``cross_entropy`` (custom ops ``gpuops::cross_entropy`` -> (loss, lse),
``gpuops::cross_entropy_backward`` and the in-place ``gpuops::cross_entropy_backward_``).

    import gpuops.torch as gt
    loss = gt.cross_entropy(logits, target)                          # like F.cross_entropy
    loss = gt.cross_entropy(logits, target, inplace_backward=True)   # no second [N, C] buffer

The forward reads the logits once and saves only the per-row log-sum-exp (fp32) besides its
inputs; the backward reads the logits once more and writes the gradient.

``inplace_backward=True`` (opt-in, as Liger-Kernel's cross-entropy does always): the backward
writes the gradient into the memory of ``input`` and hands that memory on as the gradient, so no
second [N, C] tensor is allocated (peak memory: the logits alone). Semantics:

* after ``backward()``, ``input`` (and every view of its memory) holds d loss / d input, not the
  logits; its version counter is bumped, so an op that saved the logits for its own backward
  (e.g. a tanh soft-cap before the loss) makes autograd raise instead of using overwritten data;
* the graph can be backpropagated once (a second backward raises);
* ``input`` must not be a leaf tensor, or a view of one (its ``.grad`` would share memory with
  its data): use it on logits produced by the model (``lm_head(h)``, ``logits.float()``, ...);
* it changes nothing until backward runs, and nothing at all when no gradient is needed.
The default (False) never writes into a tensor the caller holds. Eager mode is what this option
is tested in; under ``torch.compile`` use the default.
"""
from __future__ import annotations

from typing import Optional

import torch

import gpuops
from gpuops.ops.loss import _check_args, _loss_shape

__all__ = ["cross_entropy"]


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("gpuops::cross_entropy", mutates_args=())
def _cross_entropy(input: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                   label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    if input.is_cuda:
        return gpuops.cross_entropy_forward(input, target, ignore_index, reduction,
                                            label_smoothing)
    # CPU: the float64 reference, so that lse keeps full precision for the backward
    loss, lse = gpuops.cross_entropy_forward(input.double(), target, ignore_index, reduction,
                                             label_smoothing)
    # (the CPU path returns 0-d results as shape [1]: restore the shapes the fake reports)
    return (loss.reshape(_loss_shape(tuple(input.shape), reduction)).to(input.dtype),
            lse.reshape(tuple(input.shape[:-1])).to(_lse_dtype(input.dtype)))


@_cross_entropy.register_fake
def _(input, target, ignore_index, reduction, label_smoothing):
    _check_args("cross_entropy", input.shape, target.shape, ignore_index, reduction,
                label_smoothing)
    loss = input.new_empty(_loss_shape(tuple(input.shape), reduction))
    lse = input.new_empty(tuple(input.shape[:-1]), dtype=_lse_dtype(input.dtype))
    return loss, lse


def _grad_cpu(grad_output, input, target, lse, grad_lse, ignore_index, reduction,
              label_smoothing):
    return gpuops.cross_entropy_backward(
        grad_output.double(), input.double(), target, lse.double(), ignore_index, reduction,
        label_smoothing, None if grad_lse is None else grad_lse.double()).to(input.dtype)


@torch.library.custom_op("gpuops::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward(grad_output: torch.Tensor, input: torch.Tensor, target: torch.Tensor,
                            lse: torch.Tensor, grad_lse: Optional[torch.Tensor], ignore_index: int,
                            reduction: str, label_smoothing: float) -> torch.Tensor:
    if input.is_cuda:
        return gpuops.cross_entropy_backward(grad_output, input, target, lse, ignore_index,
                                             reduction, label_smoothing, grad_lse)
    return _grad_cpu(grad_output, input, target, lse, grad_lse, ignore_index, reduction,
                     label_smoothing)


@_cross_entropy_backward.register_fake
def _(grad_output, input, target, lse, grad_lse, ignore_index, reduction, label_smoothing):
    return torch.empty(tuple(input.shape), dtype=input.dtype, device=input.device)


@torch.library.custom_op("gpuops::cross_entropy_backward_", mutates_args=("input",))
def _cross_entropy_backward_(grad_output: torch.Tensor, input: torch.Tensor, target: torch.Tensor,
                             lse: torch.Tensor, ignore_index: int, reduction: str,
                             label_smoothing: float) -> None:
    if input.is_cuda:
        gpuops.cross_entropy_backward(grad_output, input, target, lse, ignore_index, reduction,
                                      label_smoothing, out=input)
    else:
        input.copy_(_grad_cpu(grad_output, input, target, lse, None, ignore_index, reduction,
                              label_smoothing))


@_cross_entropy_backward_.register_fake
def _(grad_output, input, target, lse, ignore_index, reduction, label_smoothing):
    return None


def _setup(ctx, inputs, output):
    input, target, ignore_index, reduction, label_smoothing = inputs
    ctx.save_for_backward(input, target, output[1])
    ctx.args = (ignore_index, reduction, label_smoothing)


def _backward(ctx, grad_loss, grad_lse):
    input, target, lse = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    dx = _cross_entropy_backward(grad_loss, input, target, lse, grad_lse, *ctx.args)
    return dx, None, None, None, None


_cross_entropy.register_autograd(_backward, setup_context=_setup)


class _InplaceBackward(torch.autograd.Function):
    """cross_entropy whose backward writes the gradient over the logits (see the module doc)."""

    @staticmethod
    def forward(ctx, input, target, ignore_index, reduction, label_smoothing):
        loss, lse = _cross_entropy(input, target, ignore_index, reduction, label_smoothing)
        ctx.save_for_backward(input, target, lse)
        ctx.args = (ignore_index, reduction, label_smoothing)
        ctx.spent = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.spent:
            raise RuntimeError(
                "gpuops.torch.cross_entropy(inplace_backward=True): backward ran a second time, "
                "but the first one replaced the logits by their gradient; use the default "
                "inplace_backward=False to backpropagate through the loss more than once")
        input, target, lse = ctx.saved_tensors
        _cross_entropy_backward_(grad_loss, input, target, lse, *ctx.args)
        ctx.spent = True
        return input, None, None, None, None


def cross_entropy(input: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0, *,
                  inplace_backward: bool = False) -> torch.Tensor:
    """Differentiable cross-entropy of logits ``input`` [N, C] (or [C]) against class indices
    ``target`` [N] (or 0-d), int64 or int32, as ``torch.nn.functional.cross_entropy`` with the
    same arguments (see ``gpuops.cross_entropy`` for what is supported).

    ``inplace_backward=True`` lets the backward write the gradient into ``input``'s memory
    (see this module's documentation for the exact semantics); the default never does.
    """
    label_smoothing = float(label_smoothing)
    if inplace_backward and input.requires_grad and torch.is_grad_enabled():
        base = input._base if input._base is not None else input
        if base.is_leaf:
            raise ValueError(
                "gpuops.torch.cross_entropy: inplace_backward=True needs logits computed by the "
                "model (a non-leaf tensor): the gradient would overwrite a leaf's own data and its "
                ".grad would share that memory")
        return _InplaceBackward.apply(input, target, int(ignore_index), reduction,
                                      label_smoothing)
    return _cross_entropy(input, target, int(ignore_index), reduction, label_smoothing)[0]
