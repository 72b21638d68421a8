"""log_cosh_loss: ``log(cosh(input - target))`` without overflow."""

from __future__ import annotations

from torch import Tensor

from stablelosses._autograd.log_cosh import _LogCosh
from stablelosses._spec import check_reduction
from stablelosses._utils import cast, check_floating, operand_dtypes, reduce
from stablelosses.functional._masked import masked_residual
from stablelosses.functional._operands import _check_broadcast


def log_cosh_loss(
    input: Tensor, target: Tensor, reduction: str = "mean", *, mask: Tensor | None = None
) -> Tensor:
    r"""Log-cosh loss $\log\cosh(\text{input} - \text{target})$ without overflow.

    With $r = \text{input} - \text{target}$ (broadcast):

    $$
    \ell_i = \log\cosh r_i = \operatorname{log1p}\big(2\sinh^2(c_i/2)\big) + (|r_i| - c_i),
    \qquad c_i = \min(|r_i|, 20),
    $$

    one formula for every $r$: $\cosh c = 1 + 2\sinh^2(c/2)$ keeps the small part near 0
    ($r^2/2$ down to subnormals, where $|r| + \operatorname{softplus}(-2|r|) - \log 2$ has no
    digit right at $|r| = 10^{-4}$), and above 20 $\log\cosh r$ and $|r| - \log 2$ agree to
    below half an ulp, so the clamped part plus the rest is exact. Within about 2 ulp of the
    exact value for every $r$ and finite for every finite $r$ (the naive ``log(cosh(r))``
    overflows to ``inf`` for $|r| > 89$ in float32). Reductions: none
    $\ell$; mean $\tfrac{1}{N}\sum_i \ell_i$; sum $\sum_i \ell_i$.
    float16/bfloat16 inputs are computed in float32.

    **Gradient**

    $$
    \frac{\partial \ell_i}{\partial r_i} = \tanh r_i
    $$

    (times $1/N$ for ``'mean'``), evaluated directly: bounded by 1, never the
    ``inf/inf`` = NaN of $\sinh r / \cosh r$. The function is smooth, so there is no singular
    point. The gradient with respect to ``target`` is the negative. Forward mode
    (``torch.func.jvp``/``jacfwd``/``hessian``) uses the same derivative.

    **Mask.** ``mask`` (bool, True = counts), broadcastable to the unreduced loss $\ell$,
    reduces over its True entries $M$ as every loss does ([the `mask=`
    argument](../migration.md#the-mask-argument)): ``'mean'`` is $\sum_M \ell_i / \max(1, |M|)$.
    ``mask=None`` adds nothing to the graph.

    Args:
        input: predictions, any shape, floating point.
        target: targets, broadcastable with ``input``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        mask: bool tensor, True = counts, broadcastable to the loss's shape (keyword-only);
            ``None``: every entry counts. Default: ``None``.

    Returns:
        A scalar for ``'mean'``/``'sum'``, else the broadcast shape; dtype ``input`` and
        ``target`` promoted as torch (``(float16, float32)`` is float32), float32 for half
        input under autocast.

    Raises:
        ValueError: ``reduction`` is not ``'none'``, ``'mean'`` or ``'sum'``, or ``mask`` does
            not broadcast to the unreduced loss.
        TypeError: ``input`` or ``target`` is not floating point, or ``mask`` is not bool.
        RuntimeError: ``input`` and ``target`` do not broadcast (the message names both).

    Example:
        >>> import torch
        >>> import stablelosses.functional as SF
        >>> x = torch.tensor([100.0], requires_grad=True)
        >>> torch.log(torch.cosh(x)).sum().backward()
        >>> x.grad
        tensor([nan])
        >>> x.grad = None
        >>> SF.log_cosh_loss(x, torch.zeros(1), reduction="sum").backward()
        >>> x.grad
        tensor([1.])

    Replaces ``torch.log(torch.cosh(input - target))`` followed by the reduction.
    """
    fn = "log_cosh_loss"
    check_floating(fn, "input", input)
    check_floating(fn, "target", target)
    reduction = check_reduction(fn, reduction)
    _check_broadcast(fn, input, target, ("input", "target"))
    # type promotion as torch.log(torch.cosh(input - target)): (float16, float32) is float32
    work, out_dtype = operand_dtypes(input, target)
    x, y = input.to(work), target.to(work)
    if mask is not None:
        r, m = masked_residual(fn, x, y, mask)
        return cast(reduce(_LogCosh.call(r, r.new_zeros(()), "none")[0], reduction, m), out_dtype)
    return cast(_LogCosh.call(x, y, reduction)[0], out_dtype)
