"""``x · log y`` with the conventions 0 · log 0 = 0 and finite gradients there."""

from __future__ import annotations

import torch
from torch import Tensor

from stablelosses._utils import sum_to


class _XLogY(torch.autograd.Function):
    """``xlogy(x, y)`` as ``torch.special.xlogy``.

    d/dy = ``x / y``, defined 0 where ``x == 0`` (also at ``y == 0``);
    d/dx = ``log y``, defined 0 where ``x == 0`` and ``y == 0``.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, y: Tensor) -> Tensor:
        return torch.special.xlogy(x, y)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y = inputs
        ctx.save_for_backward(x, y)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, y = ctx.saved_tensors
        x_zero = x == 0
        grad_x = grad_y = None
        if ctx.needs_input_grad[0]:
            both_zero = x_zero & (y == 0)
            safe_y = y.masked_fill(both_zero, 1)
            grad_x = (grad * torch.log(safe_y)).masked_fill_(both_zero, 0)
            grad_x = sum_to(grad_x, x.shape)
        if ctx.needs_input_grad[1]:
            safe_y = y.masked_fill(x_zero, 1)
            grad_y = (grad * (x / safe_y)).masked_fill_(x_zero, 0)
            grad_y = sum_to(grad_y, y.shape)
        return grad_x, grad_y
