"""Division with a defined value and zero gradients where the divisor is 0."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from stablelosses._utils import sum_to


class _SafeDiv(torch.autograd.Function):
    """``a / b``, with ``fill`` where ``b == 0`` (a NaN ``a`` stays NaN there).

    Gradients where ``b == 0`` are 0 for both operands; elsewhere ``g / b`` for ``a`` and
    ``-(g / b) · (a / b)`` for ``b``, the quotient taken from the saved output (``a / b²``
    would overflow first).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(a: Tensor, b: Tensor, fill: float) -> Tensor:
        zero = b == 0
        # clamp(fill, fill) is fill everywhere except where a is NaN, which it keeps.
        return torch.where(zero, a.clamp(fill, fill), a / b)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, fill = inputs
        ctx.save_for_backward(b, output)
        ctx.a_shape = a.shape
        ctx.fill_finite = math.isfinite(fill)

    @staticmethod
    def backward(ctx, grad: Tensor):
        b, out = ctx.saved_tensors
        zero = b == 0
        # Double where: divide by a safe divisor, then select 0 on the singular set, so the
        # discarded branch holds no inf whose gradient (double backward) would be NaN.
        safe_b = b.masked_fill(zero, 1)
        g_over_b = (grad / safe_b).masked_fill_(zero, 0)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = sum_to(g_over_b, ctx.a_shape)
        if ctx.needs_input_grad[1]:
            # -(g / b) · (a / b); exactly 0 where the quotient is 0 (g / b may overflow for a
            # subnormal b, and inf · 0 would be NaN). 0 - x avoids -0.0.
            grad_b = torch.rsub(g_over_b * out, 0).masked_fill_(out == 0, 0)
            if not ctx.fill_finite:  # 0 · (±inf fill) must not become NaN
                grad_b = grad_b.masked_fill_(zero, 0)
            grad_b = sum_to(grad_b, b.shape)
        return grad_a, grad_b, None
