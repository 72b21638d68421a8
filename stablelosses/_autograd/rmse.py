"""Root-mean-square error as one fused Function (scaled against overflow, gradient r/(N·rmse))."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from stablelosses._utils import MEAN, NONE, sum_to


def _common(input: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Broadcast views, as ``F.mse_loss`` expands its operands."""
    if input.shape == target.shape:
        return input, target
    return torch.broadcast_tensors(input, target)


class _RMSE(torch.autograd.Function):
    """``sqrt(reduce((input - target)**2) + eps)``; ``mode`` 0 = none, 1 = mean, 2 = sum.

    Forward: ``sqrt(Σ r²) = s · sqrt(Σ (r/s)²)`` with ``s = max|r|`` (no square overflows).
    Backward: ``(r / rmse) · g / D``, defined 0 where ``rmse == 0``.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(input: Tensor, target: Tensor, mode: int, eps: float) -> Tensor:
        x, y = _common(input, target)
        r = x - y
        root_eps = math.sqrt(eps)
        if mode == NONE:
            if eps == 0.0:
                return r.abs_()
            # sqrt(r² + eps) = hypot(r, sqrt(eps)), which never forms r².
            return torch.hypot(r, torch.full((), root_eps, dtype=r.dtype, device=r.device))
        n = r.numel()
        if n == 0:
            total = r.sum()
            return torch.sqrt(total / n + eps) if mode == MEAN else torch.sqrt(total + eps)
        lo, hi = torch.aminmax(r)
        s = torch.maximum(hi, -lo)  # NaN if any residual is NaN
        s_safe = torch.where((s == 0) | (s == math.inf), 1.0, s)
        u = r.div_(s_safe).reshape(-1)  # r is ours: scale it in place
        ss = torch.dot(u, u)
        if mode == MEAN:
            ss = ss / n
        value = s * torch.sqrt(ss)
        if eps != 0.0:
            # sqrt(m + eps) = hypot(sqrt(m), sqrt(eps)).
            value = torch.hypot(value, torch.full((), root_eps, dtype=value.dtype, device=value.device))
        return value

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, target, mode, _ = inputs
        ctx.save_for_backward(input, target, output)
        ctx.mode = mode

    @staticmethod
    def backward(ctx, grad_output):
        input, target, value = ctx.saved_tensors
        x, y = _common(input, target)
        # d rmse / d r_i = r_i / (D·rmse): the ratio r_i / rmse is bounded (by sqrt(D)), so it
        # is formed first; 1 / rmse alone would overflow for a subnormal rmse. Where
        # rmse == 0 every r_i is 0 and the safe divisor 1 gives the defined gradient 0.
        safe = value.masked_fill(value == 0, 1)
        d = x.numel() if ctx.mode == MEAN else 1
        grad = (x - y) / safe * (grad_output / d if d != 1 else grad_output)
        grad_input = grad_target = None
        if ctx.needs_input_grad[0]:
            grad_input = sum_to(grad, input.shape)
        if ctx.needs_input_grad[1]:
            grad_target = sum_to(-grad, target.shape)
        return grad_input, grad_target, None, None
