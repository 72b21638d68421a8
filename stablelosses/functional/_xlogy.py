r"""xlogy: ``torch.special.xlogy`` with finite gradients at ``0 · log 0``."""

from __future__ import annotations

from torch import Tensor

from stablelosses._autograd.xlogy import _XLogY
from stablelosses._utils import cast
from stablelosses.functional._operands import _binary_operands


def xlogy(input: Tensor | float, other: Tensor | float) -> Tensor:
    r"""``input · log(other)``, 0 where ``input == 0``, with finite gradients at 0 · log 0.

    $$
    \operatorname{xlogy}(x, y) =
    \begin{cases} 0 & x = 0,\ y \text{ not NaN} \\ x \log y & \text{otherwise} \end{cases}
    $$

    The forward value is exactly ``torch.special.xlogy`` (broadcasting, type promotion, NaN
    ``other`` gives NaN).

    **Gradient.** $\partial/\partial y = x / y$, defined $0$ where $x = 0$ (also at $y = 0$,
    where torch gives $0/0$ = NaN). $\partial/\partial x = \log y$, defined $0$ where $x = 0$
    and $y \le 0$, exactly torch's value (for $x = 0$, $y > 0$ it is $\log y$, as torch).
    Forward mode (``jvp``, ``jacfwd``, ``hessian``) uses the same partial derivatives.

    Args:
        input: the factor ``x`` (tensor or number).
        other: the argument of the log ``y`` (tensor or number), broadcastable with ``input``.

    Returns:
        Tensor of the broadcast shape, in the dtype ``torch.special.xlogy`` returns.

    Raises:
        TypeError: neither operand is a tensor.
        RuntimeError: the shapes do not broadcast.

    Example:
        >>> import torch
        >>> from stablelosses.functional import xlogy
        >>> p = torch.tensor([0.0, 0.5], requires_grad=True)
        >>> (p * torch.log(p)).sum().backward(); p.grad
        tensor([   nan, 0.3069])
        >>> p.grad = None
        >>> xlogy(p, p).sum().backward(); p.grad
        tensor([0.0000, 0.3069])

    Replaces ``torch.special.xlogy`` and ``x * torch.log(y)``.
    """
    x, y, out_dtype = _binary_operands("xlogy", input, other, ("input", "other"))
    return cast(_XLogY.call(x, y), out_dtype)
