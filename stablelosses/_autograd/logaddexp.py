"""``log(exp a + exp b)`` with defined gradients where ``a`` and ``b`` are the same infinity.

The gradient is ``(σ(a − b), σ(b − a))``. ``torch.logaddexp`` gets the value right everywhere
but computes ``a − b = inf − inf`` = NaN for the gradient when both are ``-inf`` (e.g. two
masked log-probabilities) or both ``+inf``. The limits: both ``-inf`` gives ``-inf`` that
does not move, gradients ``(0, 0)``; both ``+inf`` gives ``(½, ½)`` (σ(0), the symmetric
limit); one ``+inf`` gives 1 to it and 0 to the other.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stablelosses._autograd._base import StableFunction, tangent_sum
from stablelosses._utils import sum_to

_INF = float("inf")


def _weights(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(σ(a−b), σ(b−a))`` with ``(0, 0)`` where both are ``-inf`` and ``(½, ½)`` where both
    are ``+inf``; NaN where either is NaN."""
    same_inf = torch.isinf(a) & (a == b)
    # Double where: the difference is made finite before sigmoid, so no NaN is differentiated.
    diff = (a - b).masked_fill(same_inf, 0.0)
    dead = same_inf & (a == -_INF)
    wa = torch.sigmoid(diff).masked_fill(dead, 0.0)
    wb = torch.sigmoid(-diff).masked_fill(dead, 0.0)
    return wa, wb


class _LogAddExp(StableFunction):
    """``torch.logaddexp(a, b)``; gradients ``σ(a−b)``, ``σ(b−a)`` with the limits above."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a: Tensor, b: Tensor) -> Tensor:
        return torch.logaddexp(a, b)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b = inputs
        ctx.save_for_backward(a, b)
        ctx.save_for_forward(a, b)

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, b = ctx.saved_tensors
        wa, wb = _weights(a, b)
        grad_a = sum_to(grad * wa, a.shape) if ctx.needs_input_grad[0] else None
        grad_b = sum_to(grad * wb, b.shape) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b

    @staticmethod
    def jvp(ctx, ta, tb):
        a, b = ctx.saved_tensors
        return tangent_sum(_weights(a, b), (ta, tb))
