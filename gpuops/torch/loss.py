"""Autograd ``cross_entropy`` (custom ops ``gpuops::cross_entropy`` -> (loss, lse),
``gpuops::cross_entropy_backward`` and the in-place ``gpuops::cross_entropy_backward_``).

    import gpuops.torch as gt
    loss = gt.cross_entropy(logits, target)                          # like F.cross_entropy
    loss = gt.cross_entropy(logits, target, inplace_backward=True)   # no second [N, C] buffer
    loss = gt.cross_entropy(logits, target, inplace_backward="forward")   # ... and one pass less

Default: the forward reads the logits once and saves only the per-row log-sum-exp (fp32) besides
its inputs; the backward reads the logits once more and writes the gradient into a new tensor.
It never writes into a tensor the caller holds.

``inplace_backward`` (opt-in) reuses the memory of ``input`` for its gradient, so no second
[N, C] tensor is allocated (peak memory: the logits alone):

* ``True``: the backward writes the gradient over the logits (same passes as the default). The
  logits are intact until ``backward()`` runs.
* ``"forward"``: the forward computes the loss and the gradient together (for grad_output = 1)
  and writes the gradient over the logits right away, as Liger-Kernel does: one read and one
  write of the logits in all (instead of two reads and a write). The backward then only scales
  the gradient by grad_output -- no pass at all when grad_output is exactly 1 (checked on the
  device, no host sync), one read + write of the logits otherwise (e.g. ``(loss / k).backward()``
  for gradient accumulation: then True is as fast). The logits are gone once the loss is
  computed: read anything else you need from them (argmax, accuracy) before the call.

In both modes:
* ``input`` (and every view of its memory) ends up holding d loss / d input. Its version counter
  is bumped, so an op that saved the logits for its own backward (e.g. a tanh soft-cap before
  the loss) makes autograd raise instead of using overwritten data;
* the graph can be backpropagated once (a second backward raises);
* ``input`` must not be a leaf tensor or a view of one (its ``.grad`` would share memory with its
  data): use it on logits produced by the model (``lm_head(h)``, ``logits.float()``, ...);
* nothing is overwritten when no gradient is needed (``torch.no_grad()``, or an input that does
  not require grad).
The in-place modes are tested in eager mode; under ``torch.compile`` use the default.
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


@torch.library.custom_op("gpuops::cross_entropy_with_grad_", mutates_args=("input",))
def _cross_entropy_with_grad_(input: torch.Tensor, target: torch.Tensor, ignore_index: int,
                              reduction: str, label_smoothing: float) -> torch.Tensor:
    """The loss; ``input`` is replaced by d loss / d input for a unit grad_output."""
    if input.is_cuda:
        _, loss = gpuops.cross_entropy_with_grad(input, target, ignore_index, reduction,
                                                 label_smoothing, out=input)
        return loss
    grad, loss = gpuops.cross_entropy_with_grad(input.double(), target, ignore_index, reduction,
                                                label_smoothing)
    input.copy_(grad)
    return loss.reshape(_loss_shape(tuple(input.shape), reduction)).to(input.dtype)


@_cross_entropy_with_grad_.register_fake
def _(input, target, ignore_index, reduction, label_smoothing):
    _check_args("cross_entropy", input.shape, target.shape, ignore_index, reduction,
                label_smoothing)
    return input.new_empty(_loss_shape(tuple(input.shape), reduction))


@torch.library.custom_op("gpuops::cross_entropy_grad_scale_", mutates_args=("grad",))
def _cross_entropy_grad_scale_(grad_output: torch.Tensor, grad: torch.Tensor,
                               reduction: str) -> None:
    if grad.is_cuda:
        gpuops.cross_entropy_grad_scale(grad_output, grad, reduction, out=grad)
    else:
        grad.copy_(gpuops.cross_entropy_grad_scale(grad_output.double(), grad.double(),
                                                   reduction))


@_cross_entropy_grad_scale_.register_fake
def _(grad_output, grad, reduction):
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
        # the gradient is the logits' memory, but not the logits' graph node: handed on as is,
        # it would carry requires_grad and a grad_fn (autograd.grad would return a tensor that
        # requires grad, and differentiating it would reach back through the model)
        return input.detach(), None, None, None, None


class _InplaceForward(torch.autograd.Function):
    """cross_entropy whose forward writes the gradient over the logits (see the module doc)."""

    @staticmethod
    def forward(ctx, input, target, ignore_index, reduction, label_smoothing):
        loss = _cross_entropy_with_grad_(input, target, ignore_index, reduction, label_smoothing)
        ctx.save_for_backward(input)          # saved after the write: it holds the gradient
        ctx.reduction = reduction
        ctx.spent = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.spent:
            raise RuntimeError(
                "gpuops.torch.cross_entropy(inplace_backward='forward'): backward ran a second "
                "time, but the gradient stored in the logits was already handed on; use the "
                "default inplace_backward=False to backpropagate through the loss more than once")
        (grad,) = ctx.saved_tensors
        _cross_entropy_grad_scale_(grad_loss, grad, ctx.reduction)
        ctx.spent = True
        return grad.detach(), None, None, None, None     # (see _InplaceBackward.backward)


_MODES = {False: None, True: _InplaceBackward, "backward": _InplaceBackward,
          "forward": _InplaceForward}


def cross_entropy(input: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0, *,
                  inplace_backward: bool | str = False) -> torch.Tensor:
    """Differentiable cross-entropy of logits ``input`` [N, C] (or [C]) against class indices
    ``target`` [N] (or 0-d), int64 or int32, as ``torch.nn.functional.cross_entropy`` with the
    same arguments (see ``gpuops.cross_entropy`` for what is supported).

    ``inplace_backward``: False (default: never writes into a tensor the caller holds), True
    (the backward writes the gradient over ``input``) or "forward" (the forward computes the
    gradient with the loss and writes it over ``input`` at once, saving one read of the logits).
    See this module's documentation for the exact semantics.
    """
    try:
        mode = _MODES[inplace_backward]
    except (KeyError, TypeError):
        raise ValueError(f"gpuops.torch.cross_entropy: inplace_backward={inplace_backward!r}; "
                         "expected False, True or 'forward'") from None
    label_smoothing = float(label_smoothing)
    if mode is not None and input.requires_grad and torch.is_grad_enabled():
        base = input._base if input._base is not None else input
        if base.is_leaf:
            raise ValueError(
                "gpuops.torch.cross_entropy: inplace_backward needs logits computed by the "
                "model (a non-leaf tensor): the gradient would overwrite a leaf's own data and its "
                ".grad would share that memory")
        return mode.apply(input, target, int(ignore_index), reduction, label_smoothing)
    return _cross_entropy(input, target, int(ignore_index), reduction, label_smoothing)[0]
