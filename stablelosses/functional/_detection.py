"""sigmoid_focal_loss."""

from __future__ import annotations

import math

from torch import Tensor

from stablelosses._autograd.sigmoid_focal import _sigmoid_focal
from stablelosses._utils import (
    REDUCTION_MODE,
    REDUCTIONS,
    check_floating,
    check_nonnegative,
    loss_out_dtype,
    upcast,
)


def check_focal_args(fn: str, alpha: object, gamma: object, reduction: object) -> tuple[float, float]:
    """``(alpha, gamma)`` as floats, or ``TypeError``/``ValueError`` naming ``fn`` and the argument.

    The reduction message carries the word ``Invalid`` as torchvision's does (its tests match it).
    """
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(
            f"{fn}: Invalid reduction: reduction must be 'none', 'mean' or 'sum', got {reduction!r}"
        )
    gamma_f = check_nonnegative(fn, "gamma", gamma)
    if gamma_f == math.inf:  # comparisons, not math.isinf: Dynamo traces them on a SymFloat
        raise ValueError(f"{fn}: gamma must be finite and >= 0, got {gamma_f}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"{fn}: alpha must be a float, got {type(alpha).__name__}")
    if not -math.inf < alpha < math.inf:  # also NaN
        raise ValueError(f"{fn}: alpha must be a finite number (in [0, 1], or < 0 for no weighting), got {alpha}")
    return float(alpha), gamma_f


def sigmoid_focal_loss(
    input: Tensor,
    target: Tensor,
    alpha: float = 0.25,
    gamma: float = 2.0,
    reduction: str = "none",
) -> Tensor:
    r"""Sigmoid focal loss of RetinaNet, finite for every $\gamma \ge 0$ and every finite logit.

    With logits $x$, targets $t \in [0, 1]$ (hard or soft), $p = \sigma(x)$,
    $p_t = p\,t + (1-p)(1-t)$ and $\alpha_t = \alpha t + (1-\alpha)(1-t)$
    ($\alpha_t = 1$ when $\alpha < 0$):

    $$
    \ell_i = \alpha_t\,\mathrm{BCE}(x_i, t_i)\,(1 - p_t)^{\gamma},\qquad
    1 - p_t = t\,\sigma(-x) + (1-t)\,\sigma(x),
    $$

    where both $1 - p_t$ and $\mathrm{BCE} = t\operatorname{softplus}(-x) +
    (1-t)\operatorname{softplus}(x)$ are evaluated as sums of non-negative terms, so they keep
    full relative precision when tiny (torchvision's $1 - p_t$ cancels to 0 for saturated
    logits). Reductions: none $\ell$; mean $\tfrac{1}{N}\sum_i \ell_i$; sum $\sum_i \ell_i$.
    float16/bfloat16 inputs are computed in float32.

    **Gradient**

    $$
    \frac{\partial \ell}{\partial x} = \alpha_t (1-p_t)^{\gamma}\Big[(\sigma(x) - t)
    + \gamma\,\mathrm{BCE}\,\frac{(1-2t)\,\sigma(x)\sigma(-x)}{1-p_t}\Big],
    $$

    with the ratio $\sigma(x)\sigma(-x)/(1-p_t)$ (bounded by 1) computed without dividing by a
    vanishing $1-p_t$. Where $1 - p_t$ underflows to 0 (saturated logit on the right side)
    the factor $(1-p_t)^\gamma$ is 0 and the gradient is **0** for $\gamma > 0$; for
    $\gamma < 1$ this is where torchvision's formula gives NaN. The gradient with respect to
    ``target`` is analytic as well ($\mathrm{BCE}/(1-p_t)$ stays finite); NaN propagates.

    Args:
        input: logits, any shape, floating point.
        target: targets of the same shape as ``input``, 0/1 labels or probabilities.
        alpha: weight of the positive class in ``[0, 1]``; ``< 0`` disables weighting.
            Default: ``0.25``.
        gamma: focusing parameter, ``>= 0``. Default: ``2.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'none'`` (as torchvision).

    Returns:
        A scalar for ``'mean'``/``'sum'``, else ``input``'s shape; dtype the input's
        (float32 for half input under autocast).

    Raises:
        ValueError: ``reduction`` is not one of the above, or ``gamma < 0``.
        TypeError: ``input``/``target`` is not a floating-point tensor, or ``alpha``/``gamma``
            is not a number.
        ValueError: ``target`` and ``input`` differ in shape (as torchvision).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import stablelosses.functional as SF
        >>> x = torch.tensor([20.0], requires_grad=True)
        >>> t = torch.tensor([1.0])
        >>> p = torch.sigmoid(x)
        >>> ce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
        >>> p_t = p * t + (1 - p) * (1 - t)
        >>> (0.25 * ce * (1 - p_t) ** 0.5).sum().backward()  # torchvision's formula
        >>> x.grad
        tensor([nan])
        >>> x.grad = None
        >>> SF.sigmoid_focal_loss(x, t, gamma=0.5, reduction="sum").backward()
        >>> x.grad
        tensor([-3.5091e-14])

    Replaces ``torchvision.ops.sigmoid_focal_loss``.
    """
    fn = "sigmoid_focal_loss"
    check_floating(fn, "input", input)
    check_floating(fn, "target", target)
    alpha_f, gamma_f = check_focal_args(fn, alpha, gamma, reduction)
    if target.size() != input.size():
        # as torchvision, whose binary_cross_entropy_with_logits refuses to broadcast
        raise ValueError(
            f"{fn}: target size ({target.size()}) must be the same as input size ({input.size()})"
        )
    out_dtype = loss_out_dtype(input)
    loss = _sigmoid_focal(upcast(input), upcast(target), alpha_f, gamma_f, REDUCTION_MODE[reduction])
    return loss.to(out_dtype)
