"""Autograd ``scaled_dot_product_attention`` (custom ops ``gpuops::scaled_dot_product_attention``
and ``gpuops::scaled_dot_product_attention_backward``).

    import gpuops.torch as gt
    out = gt.scaled_dot_product_attention(q, k, v, is_causal=True)   # as F.scaled_dot_product_attention
    out.sum().backward()                                             # dq, dk, dv by gpuops' kernels

The forward op returns the output and the per-row log-sum-exp (float32; float64 for float64
inputs), and saves both with the inputs; the backward op recomputes the probabilities from them
(FlashAttention's scheme: nothing of size S x S is stored). CUDA tensors run gpuops' kernels, CPU
tensors the float64 NumPy references. Options beyond torch's: ``window_size``, ``layout='bshd'``,
``return_lse``. Not supported: dropout, a gradient for ``attn_mask`` (an additive mask that
requires grad is refused), double backward.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

import gpuops

__all__ = ["scaled_dot_product_attention"]

Tensor = torch.Tensor


def _stat_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _window(left: int, right: int):
    return None if left == -1 and right == -1 else (left, right)


def _lse_shape(query: Tensor, layout: str):
    B, a, b, _ = query.shape
    return (B, a, b) if layout == "bhsd" else (B, b, a)


@torch.library.custom_op("gpuops::scaled_dot_product_attention", mutates_args=())
def _sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
          is_causal: bool, scale: Optional[float], enable_gqa: bool, window_left: int,
          window_right: int, layout: str) -> Tuple[Tensor, Tensor]:
    out, lse = gpuops.scaled_dot_product_attention(
        query, key, value, attn_mask, is_causal, scale, enable_gqa,
        window_size=_window(window_left, window_right), return_lse=True, layout=layout)
    return out, lse.to(_stat_dtype(query))


@_sdpa.register_fake
def _(query, key, value, attn_mask, is_causal, scale, enable_gqa, window_left, window_right,
      layout):
    return (query.new_empty(query.shape),
            query.new_empty(_lse_shape(query, layout), dtype=_stat_dtype(query)))


@torch.library.custom_op("gpuops::scaled_dot_product_attention_backward", mutates_args=())
def _sdpa_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, output: Tensor,
                   lse: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                   scale: Optional[float], enable_gqa: bool, window_left: int, window_right: int,
                   layout: str) -> Tuple[Tensor, Tensor, Tensor]:
    return gpuops.scaled_dot_product_attention_backward(
        grad_out, query, key, value, output, lse, attn_mask, is_causal, scale, enable_gqa,
        window_size=_window(window_left, window_right), layout=layout)


@_sdpa_backward.register_fake
def _(grad_out, query, key, value, output, lse, attn_mask, is_causal, scale, enable_gqa,
      window_left, window_right, layout):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup(ctx, inputs, output):
    query, key, value, attn_mask, *options = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, attn_mask, out, lse)
    ctx.options = tuple(options)
    ctx.mark_non_differentiable(lse)


def _grad(ctx, grad_out, _grad_lse):
    query, key, value, attn_mask, out, lse = ctx.saved_tensors
    dq, dk, dv = _sdpa_backward(grad_out, query, key, value, out, lse, attn_mask, *ctx.options)
    return (dq, dk, dv) + (None,) * 7


_sdpa.register_autograd(_grad, setup_context=_setup)


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *, window_size=None,
                                 layout: str = "bhsd", return_lse: bool = False):
    """``torch.nn.functional.scaled_dot_product_attention`` on gpuops' flash kernels, with
    autograd (dq, dk, dv from the saved output and lse; see ``gpuops.scaled_dot_product_attention``
    and ``gpuops.scaled_dot_product_attention_backward`` for the semantics and options).

    ``dropout_p`` must be 0 (no dropout). ``window_size=(left, right)``, ``layout`` ('bhsd' or
    'bshd') as in ``gpuops.scaled_dot_product_attention``. ``return_lse=True`` also returns the
    (non-differentiable) lse [B, Hq, Sq]. ``attn_mask`` gets no gradient: a floating mask that
    requires grad is refused rather than silently left without one.
    """
    if dropout_p != 0.0:
        raise ValueError("gpuops.torch.scaled_dot_product_attention: 'dropout_p' must be 0 "
                         f"(dropout is not supported), got {dropout_p!r}")
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("gpuops.torch.scaled_dot_product_attention: 'attn_mask' requires grad, "
                         "but no gradient is computed for the mask; detach it")
    if window_size is None:
        left = right = -1
    elif (isinstance(window_size, (tuple, list)) and len(window_size) == 2
          and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        left, right = window_size
    else:
        raise TypeError("gpuops.torch.scaled_dot_product_attention: 'window_size' must be None or "
                        f"a pair of ints (left, right), got {window_size!r}")
    out, lse = _sdpa(query, key, value, attn_mask, bool(is_causal),
                     None if scale is None else float(scale), bool(enable_gqa), int(left),
                     int(right), layout)
    return (out, lse) if return_lse else out
