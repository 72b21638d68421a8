"""Division with a defined value and zero gradients where the divisor is 0."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from stablelosses._autograd._base import applier
from stablelosses._utils import sum_to


def _over_b(b: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``(g / b, b == 0)`` with ``g / b`` defined 0 where ``b == 0``.

    Double where: divide by a safe divisor, then select 0 on the singular set, so the
    discarded branch holds no inf whose gradient (double backward) would be NaN.
    """
    zero = b == 0
    return (g / b.masked_fill(zero, 1)).masked_fill_(zero, 0), zero


def _times_quotient(g_over_b: Tensor, out: Tensor, zero: Tensor, fill_finite: bool) -> Tensor:
    """``-(g / b) · (a / b)``, exactly 0 where the quotient is 0.

    ``g / b`` may overflow for a subnormal ``b`` and inf · 0 would be NaN; ``0 - x`` avoids
    ``-0.0``. Where ``b == 0`` the quotient is ``fill``: an infinite fill must not give NaN.
    """
    d = torch.rsub(g_over_b * out, 0).masked_fill_(out == 0, 0)
    return d if fill_finite else d.masked_fill_(zero, 0)


class _SafeDiv(torch.autograd.Function):
    """``a / b``, with ``fill`` where ``b == 0`` (a NaN ``a`` stays NaN there).

    Gradients where ``b == 0`` are 0 for both operands; elsewhere ``g / b`` for ``a`` and
    ``-(g / b) · (a / b)`` for ``b``, the quotient taken from the saved output (``a / b²``
    would overflow first). The forward-mode derivative is ``ta / b - tb · (a / b) / b``,
    0 where ``b == 0``.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(a: Tensor, b: Tensor, fill: float) -> Tensor:
        # clamp(fill, fill) is fill everywhere except where a is NaN, which it keeps.
        return torch.where(b == 0, a.clamp(fill, fill), a / b)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        a, b, fill = inputs
        ctx.save_for_backward(b, output)
        ctx.save_for_forward(b, output)
        ctx.a_shape = a.shape
        ctx.fill_finite = math.isfinite(fill)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        b, out = ctx.saved_tensors
        g_over_b, zero = _over_b(b, grad)
        grad_a: Tensor | None = None
        grad_b: Tensor | None = None
        if ctx.needs_input_grad[0]:
            grad_a = sum_to(g_over_b, ctx.a_shape)
        if ctx.needs_input_grad[1]:
            grad_b = sum_to(_times_quotient(g_over_b, out, zero, ctx.fill_finite), b.shape)
        return grad_a, grad_b, None

    @staticmethod
    def jvp(ctx: Any, ta: Tensor, tb: Tensor, _: None) -> Tensor:
        b, out = ctx.saved_tensors
        ta_over_b, zero = _over_b(b, ta)
        tb_over_b = _over_b(b, tb)[0]
        return ta_over_b + _times_quotient(tb_over_b, out, zero, ctx.fill_finite)


_safe_div = applier(_SafeDiv)
