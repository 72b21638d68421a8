"""Division with a defined value and zero gradients where the divisor is 0."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from stablelosses._autograd._base import StableFunction
from stablelosses._utils import sum_to


def _inf_where_zero(b: Tensor) -> tuple[Tensor, Tensor]:
    """``b`` with ``inf`` where ``b == 0``, and that mask: ``g / b`` is then 0 there (for a finite
    ``g``), with no discarded ``g / 0`` whose own gradient (double backward) would be NaN."""
    # a select rather than masked_fill: 1.8x faster on the CPU, the same values and bytes
    # (b == 0, not logical_not(b): inductor does not vectorize logical_not on floats)
    zero = b == 0
    return torch.where(zero, math.inf, b), zero


def _partials(b_inf: Tensor, zero: Tensor, out: Tensor | None, g: Tensor, fill_finite: bool,
              need: tuple[bool, bool], backward: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """``g / b`` and ``-(g · (a / b)) / b``, both 0 where ``b == 0``.

    The quotient comes from the saved output (``a / b²`` would overflow first) and multiplies
    ``g`` before the division, so a zero quotient gives exactly 0 even when ``g / b`` overflows
    (no inf · 0). ``0 + (-q) / b`` avoids ``-0.0``. Where ``b == 0`` the output is ``fill``: an
    infinite fill is masked, since inf / inf would be NaN.
    """
    d_a = torch.div(g, b_inf) if need[0] else None
    d_b = None
    if need[1]:
        # summed over the broadcast dimensions before the division: Σ g·(a/b) cancels exactly
        # where the terms do (-Σ a / b² is 0 for a = [x, -x], never inf - inf)
        # (forward mode: g is b's tangent and the result keeps the output's shape)
        assert out is not None
        q = g * out
        q = sum_to(q, b_inf.shape) if backward else q
        # 0 + (-q) / b in one pass (a +0.0 for a zero quotient, never -0.0)
        d_b = torch.addcdiv(torch.zeros((), dtype=q.dtype, device=q.device), q, b_inf, value=-1)
        if not fill_finite:
            d_b = torch.where(zero, 0.0, d_b)
    return d_a, d_b


def _quotient(a: Tensor, b: Tensor, fill: float) -> Tensor:
    # clamp(fill, fill) is fill everywhere except where a is NaN, which it keeps.
    return torch.where(b == 0, a.clamp(fill, fill), a / b)


class _SafeDiv(StableFunction):
    """``a / b``, with ``fill`` where ``b == 0`` (a NaN ``a`` stays NaN there).

    Gradients where ``b == 0`` are 0 for both operands (for a finite incoming gradient);
    elsewhere ``g / b`` for ``a`` and ``-(g · (a / b)) / b`` for ``b``, the quotient taken from
    the saved output (``a / b²`` would overflow first). The forward-mode derivative is
    ``ta / b - tb · (a / b) / b``, 0 where ``b == 0``.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(a: Tensor, b: Tensor, fill: float, fill_finite: bool) -> Tensor:
        return _quotient(a, b, fill)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        a, b, _fill, fill_finite = inputs
        # the output only where b's gradient reads it: otherwise the caller may edit it in
        # place (as a / b's result) without the copy that protects a saved one
        ctx.save_for_backward(*((b, output) if ctx.needs_input_grad[1] else (b,)))
        ctx.save_for_forward(b, output)
        ctx.a_shape = a.shape
        # given by the caller: math.isfinite of a symbolic fill (torch.compile(dynamic=True))
        # cannot be traced inside a Function
        ctx.fill_finite = fill_finite

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        b, *out = ctx.saved_tensors
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        b_inf, zero = _inf_where_zero(b)
        d_a, d_b = _partials(b_inf, zero, out[0] if out else None, grad, ctx.fill_finite, need)
        grad_a = None if d_a is None else sum_to(d_a, ctx.a_shape)
        grad_b = d_b  # already summed to b's shape
        return grad_a, grad_b, None, None

    @staticmethod
    def jvp(ctx: Any, ta: Tensor, tb: Tensor, _f: None, _ff: None) -> Tensor:
        b, out = ctx.saved_tensors
        b_inf, zero = _inf_where_zero(b)
        d_a = _partials(b_inf, zero, out, ta, ctx.fill_finite, (True, False))[0]
        d_b = _partials(b_inf, zero, out, tb, ctx.fill_finite, (False, True), backward=False)[1]
        # a Function's absent tangent arrives as zeros: a zero tangent adds 0, also where the
        # quotient is infinite (0 · inf; torch's jvp skips an operand without a tangent)
        d_b = torch.where(tb == 0, 0.0, d_b)  # type: ignore[arg-type]
        return d_a + d_b  # type: ignore[operator]
