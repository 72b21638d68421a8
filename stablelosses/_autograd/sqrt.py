"""Square root with a finite gradient at 0."""

from __future__ import annotations

import torch
from torch import Tensor


class _SafeSqrt(torch.autograd.Function):
    """``sqrt(x)``; d/dx is ``1 / (2 sqrt(x))`` and 0 (the minimal-norm subgradient) at ``x == 0``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return torch.sqrt(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (y,) = ctx.saved_tensors
        singular = y == 0
        # Double where: the unselected branch never divides by zero, so its own gradient
        # (for double backward) stays finite too.
        safe_y = torch.where(singular, torch.ones_like(y), y)
        return torch.where(singular, torch.zeros_like(grad), grad / (2 * safe_y))
