r"""safe_div: ``torch.div`` that gives ``fill`` where the divisor is 0, with zero gradients there."""

from __future__ import annotations

import math

from torch import Tensor

from stablelosses._autograd.div import _SafeDiv
from stablelosses._spec import check_fill
from stablelosses._utils import cast
from stablelosses.functional._operands import _binary_operands


def safe_div(input: Tensor | float, other: Tensor | float, *, fill: float = 0.0,
             rounding_mode: str | None = None) -> Tensor:
    r"""Division that returns ``fill`` where the divisor is 0, with zero gradients there.

    $$ \operatorname{safe\_div}(a, b) = \begin{cases} a / b & b \ne 0 \\ \text{fill} & b = 0 \end{cases} $$

    Like TensorFlow's ``divide_no_nan`` (with a configurable ``fill``), except that a NaN
    ``input`` stays NaN even where ``other == 0`` (a NaN is an upstream bug and is not hidden).
    Broadcasting and type promotion as ``torch.div``.

    **Gradient.** Where ``other == 0`` both gradients are defined as $0$ (for a finite incoming
    gradient). Elsewhere
    $\partial/\partial a = g / b$ and $\partial/\partial b = -(g/b)\cdot(a/b)$, with the quotient
    reused from the output (never $a/b^2$, which overflows first). The popular idiom
    ``torch.where(b != 0, a / b, 0)`` has the right value but a NaN gradient, because the
    discarded branch's ``inf`` meets a zero gradient in ``DivBackward``. Forward mode uses the
    same partial derivatives (tangent $\dot a / b - \dot b\,(a/b)/b$, $0$ where $b = 0$).

    Args:
        input: dividend (tensor or number).
        other: divisor (tensor or number), broadcastable with ``input``.
        fill: value where ``other == 0``. Default: ``0.0``.
        rounding_mode: only ``None`` (true division). ``torch.div``'s ``'trunc'`` and
            ``'floor'`` are refused: a rounded quotient has gradient 0 everywhere in torch, so
            it has no unsafe gradient to replace; write
            ``torch.div(a, b.masked_fill(b == 0, 1), rounding_mode=...).masked_fill(b == 0, fill)``.

    Returns:
        Tensor of the broadcast shape, in the dtype ``torch.div`` returns; two Python numbers
        give a 0-dim tensor of the default dtype, as ``torch.div(1, 2)``.

    Raises:
        TypeError: an operand is neither a tensor nor a real number, or ``fill`` is not a real
            number.
        NotImplementedError: ``rounding_mode`` is not ``None``.
        RuntimeError: the shapes do not broadcast.

    Example:
        >>> import torch
        >>> from stablelosses.functional import safe_div
        >>> a = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> b = torch.tensor([0.0, 4.0], requires_grad=True)
        >>> torch.where(b != 0, a / b, 0).sum().backward(); a.grad
        tensor([   nan, 0.2500])
        >>> a.grad = b.grad = None
        >>> safe_div(a, b).sum().backward(); a.grad, b.grad
        (tensor([0.0000, 0.2500]), tensor([ 0.0000, -0.1250]))

    Replaces ``torch.div`` and ``torch.where(b != 0, a / b, fill)``.
    """
    if rounding_mode is not None:
        raise NotImplementedError(
            f"safe_div: rounding_mode={rounding_mode!r} is not supported: a rounded quotient has "
            "gradient 0 everywhere (torch's), so there is no unsafe gradient to replace; use "
            "torch.div(a, b.masked_fill(b == 0, 1), rounding_mode=...).masked_fill(b == 0, fill)"
        )
    fill = check_fill("safe_div", fill)
    a, b, out_dtype = _binary_operands("safe_div", input, other, ("input", "other"), two_numbers=True)
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) fill is symbolic
    q = _SafeDiv.call(a, b, float(fill), bool(-math.inf < fill < math.inf))
    if q.requires_grad and q.dtype == out_dtype and b.requires_grad:
        q = q.clone()  # backward saved q (for b's gradient): the caller edits a copy in place
    return cast(q, out_dtype)
