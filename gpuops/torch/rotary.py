"""Rotary position embeddings as differentiable torch ops: ``gpuops::apply_rotary`` and
``gpuops::qk_norm_rotary`` (with their backward ops ``gpuops::apply_rotary_backward`` and
``gpuops::qk_norm_rotary_backward``), usable in training and inside ``torch.compile`` graphs.

    import gpuops.torch as gt
    q, k = gt.apply_rotary(q, k, cos, sin)                        # q [B, S, Hq, D], k [B, S, Hk, D]
    q, k = gt.qk_norm_rotary(q, k, q_norm.weight, k_norm.weight, cos, sin, eps)   # Qwen3

Arguments and layouts are those of :func:`gpuops.apply_rotary` (see ``gpuops.ops.rotary``).
Gradients flow to q, k and the norm weights; cos, sin and positions get none.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

import gpuops

__all__ = ["apply_rotary", "qk_norm_rotary"]

Tensor = torch.Tensor


def _section(mrope_section):
    return None if mrope_section is None else [int(x) for x in mrope_section]


# --------------------------------------------------------------------------------- apply_rotary

@torch.library.custom_op("gpuops::apply_rotary", mutates_args=())
def _apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool,
                  positions: Optional[Tensor], rotary_dim: Optional[int],
                  mrope_section: Optional[List[int]], mrope_interleaved: bool
                  ) -> Tuple[Tensor, Tensor]:
    return gpuops.apply_rotary(q, k, cos, sin, interleaved, positions=positions,
                               rotary_dim=rotary_dim, mrope_section=mrope_section,
                               mrope_interleaved=mrope_interleaved)


@_apply_rotary.register_fake
def _(q, k, cos, sin, interleaved, positions, rotary_dim, mrope_section, mrope_interleaved):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("gpuops::apply_rotary_backward", mutates_args=())
def _apply_rotary_backward(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor,
                           interleaved: bool, positions: Optional[Tensor],
                           rotary_dim: Optional[int], mrope_section: Optional[List[int]],
                           mrope_interleaved: bool) -> Tuple[Tensor, Tensor]:
    return gpuops.apply_rotary_backward(grad_q, grad_k, cos, sin, interleaved,
                                        positions=positions, rotary_dim=rotary_dim,
                                        mrope_section=mrope_section,
                                        mrope_interleaved=mrope_interleaved)


@_apply_rotary_backward.register_fake
def _(grad_q, grad_k, cos, sin, interleaved, positions, rotary_dim, mrope_section,
      mrope_interleaved):
    return grad_q.new_empty(grad_q.shape), grad_k.new_empty(grad_k.shape)


def _rope_setup(ctx, inputs, output):
    _, _, cos, sin, interleaved, positions, rotary_dim, mrope_section, mrope_interleaved = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.options = (interleaved, rotary_dim, mrope_section, mrope_interleaved)


def _rope_backward(ctx, grad_q, grad_k):
    cos, sin, positions = ctx.saved_tensors
    interleaved, rotary_dim, mrope_section, mrope_interleaved = ctx.options
    dq, dk = torch.ops.gpuops.apply_rotary_backward(grad_q, grad_k, cos, sin, interleaved,
                                                    positions, rotary_dim, mrope_section,
                                                    mrope_interleaved)
    return dq, dk, None, None, None, None, None, None, None


_apply_rotary.register_autograd(_rope_backward, setup_context=_rope_setup)


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, *,
                 positions: Optional[Tensor] = None, rotary_dim: Optional[int] = None,
                 mrope_section=None, mrope_interleaved: bool = False) -> Tuple[Tensor, Tensor]:
    """Differentiable :func:`gpuops.apply_rotary`: returns the rotated ``(q, k)``.

    q ``[B, S, Hq, D]`` / k ``[B, S, Hk, D]`` (or packed ``[T, H, D]``); cos/sin tables per token
    (``[S, R/2]``, HF's ``[B, S, D]``, ...) or ``[P, R/2]`` with ``positions``; GPT-NeoX halves or
    GPT-J pairs (``interleaved``); partial ``rotary_dim``; M-RoPE with ``mrope_section``.
    """
    return torch.ops.gpuops.apply_rotary(q, k, cos, sin, bool(interleaved), positions,
                                         rotary_dim, _section(mrope_section),
                                         bool(mrope_interleaved))


# ------------------------------------------------------------------------------- qk_norm_rotary

@torch.library.custom_op("gpuops::qk_norm_rotary", mutates_args=())
def _qk_norm_rotary(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor,
                    sin: Tensor, eps: float, interleaved: bool, positions: Optional[Tensor],
                    rotary_dim: Optional[int], mrope_section: Optional[List[int]],
                    mrope_interleaved: bool) -> Tuple[Tensor, Tensor]:
    return gpuops.qk_norm_rotary(q, k, q_weight, k_weight, cos, sin, eps, interleaved,
                                 positions=positions, rotary_dim=rotary_dim,
                                 mrope_section=mrope_section, mrope_interleaved=mrope_interleaved)


@_qk_norm_rotary.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps, interleaved, positions, rotary_dim, mrope_section,
      mrope_interleaved):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("gpuops::qk_norm_rotary_backward", mutates_args=())
def _qk_norm_rotary_backward(grad_q: Tensor, grad_k: Tensor, q: Tensor, k: Tensor,
                             q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                             eps: float, interleaved: bool, positions: Optional[Tensor],
                             rotary_dim: Optional[int], mrope_section: Optional[List[int]],
                             mrope_interleaved: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dwq, dwk = gpuops.qk_norm_rotary_backward(
        grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, eps, interleaved,
        positions=positions, rotary_dim=rotary_dim, mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved)
    # (the CPU reference path returns every output in q's dtype)
    return dq, dk, dwq.to(q_weight.dtype), dwk.to(k_weight.dtype)


@_qk_norm_rotary_backward.register_fake
def _(grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, eps, interleaved, positions, rotary_dim,
      mrope_section, mrope_interleaved):
    return (q.new_empty(q.shape), k.new_empty(k.shape), q_weight.new_empty(q_weight.shape),
            k_weight.new_empty(k_weight.shape))


def _norm_setup(ctx, inputs, output):
    (q, k, q_weight, k_weight, cos, sin, eps, interleaved, positions, rotary_dim, mrope_section,
     mrope_interleaved) = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin, positions)
    ctx.options = (eps, interleaved, rotary_dim, mrope_section, mrope_interleaved)


def _norm_backward(ctx, grad_q, grad_k):
    q, k, q_weight, k_weight, cos, sin, positions = ctx.saved_tensors
    eps, interleaved, rotary_dim, mrope_section, mrope_interleaved = ctx.options
    dq, dk, dwq, dwk = torch.ops.gpuops.qk_norm_rotary_backward(
        grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, eps, interleaved, positions,
        rotary_dim, mrope_section, mrope_interleaved)
    return dq, dk, dwq, dwk, None, None, None, None, None, None, None, None


_qk_norm_rotary.register_autograd(_norm_backward, setup_context=_norm_setup)


def qk_norm_rotary(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor,
                   sin: Tensor, eps: float = 1e-6, interleaved: bool = False, *,
                   positions: Optional[Tensor] = None, rotary_dim: Optional[int] = None,
                   mrope_section=None, mrope_interleaved: bool = False) -> Tuple[Tensor, Tensor]:
    """Differentiable :func:`gpuops.qk_norm_rotary` (Qwen3's q_norm/k_norm + RoPE in one pass):
    gradients flow to q, k, q_weight and k_weight."""
    return torch.ops.gpuops.qk_norm_rotary(q, k, q_weight, k_weight, cos, sin, float(eps),
                                           bool(interleaved), positions, rotary_dim,
                                           _section(mrope_section), bool(mrope_interleaved))
