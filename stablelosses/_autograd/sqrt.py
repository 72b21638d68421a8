"""Square root with a finite gradient at 0."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stablelosses._autograd._base import applier


def _half_over(y: Tensor, t: Tensor) -> Tensor:
    """``t / (2 y)``, defined 0 where ``y == 0`` (double where: the discarded branch divides by 1)."""
    singular = y == 0
    safe_y = torch.where(singular, torch.ones_like(y), y)
    return torch.where(singular, torch.zeros_like(t), t / (2 * safe_y))


class _SafeSqrt(torch.autograd.Function):
    """``sqrt(x)``; d/dx is ``1 / (2 sqrt(x))`` and 0 (the minimal-norm subgradient) at ``x == 0``.

    The forward-mode derivative is the same: the tangent ``t / (2 sqrt(x))``, 0 at ``x == 0``.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return torch.sqrt(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return _half_over(y, grad)

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return _half_over(y, tangent)


_safe_sqrt = applier(_SafeSqrt)
