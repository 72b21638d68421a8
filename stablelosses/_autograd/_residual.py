"""What the losses of a residual ``r = input − target`` (rmse, log-cosh) share: the gradients
and tangent of the subtraction, given the loss's own gradient with respect to ``r``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stablelosses._utils import sum_to


def residual_grads(ctx: Any, g: Tensor | None, grad_r: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of ``input`` and ``target`` from ``g`` (the loss's, with respect to ``r``, or
    None) plus ``grad_r`` (the incoming gradient of ``r`` itself, or None), each summed to its
    operand's shape (``ctx.shapes``): ``+`` for ``input``, ``−`` for ``target``."""
    if grad_r is not None:
        g = grad_r if g is None else g + grad_r
    if g is None:
        return None, None
    grad_input = sum_to(g, ctx.shapes[0]) if ctx.needs_input_grad[0] else None
    grad_target = sum_to(-g, ctx.shapes[1]) if ctx.needs_input_grad[1] else None
    return grad_input, grad_target


def residual_tangent(r: Tensor, t_input: Tensor | None, t_target: Tensor | None) -> Tensor:
    """``ṫ_input − ṫ_target`` in ``r``'s shape (tangents are not materialized: a missing one is None)."""
    if t_input is None:
        t = torch.zeros_like(r) if t_target is None else -t_target
    else:
        t = t_input if t_target is None else t_input - t_target
    return t.expand(r.shape)
