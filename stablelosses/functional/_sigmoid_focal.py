"""sigmoid_focal_loss."""

from __future__ import annotations

import torch
from torch import Tensor

from stablelosses import _backend
from stablelosses._autograd.sigmoid_focal import _SigmoidFocal
from stablelosses._spec import check_alpha, check_finite_nonnegative, check_reduction
from stablelosses._utils import cast, check_floating, operand_dtypes, reduce
from stablelosses.functional._masked import check_mask


def check_focal_args(fn: str, alpha: object, gamma: object, reduction: object) -> tuple[str, float, float]:
    """``(reduction, alpha, gamma)`` checked, or ``TypeError``/``ValueError`` naming ``fn`` and the
    argument (also by ``SigmoidFocalLoss`` at construction).

    The reduction message carries the word ``Invalid`` as torchvision's does (its tests match it).
    """
    r = check_reduction(fn, reduction, prefix="Invalid reduction: ")
    return r, check_alpha(fn, alpha), check_finite_nonnegative(fn, "gamma", gamma)


def sigmoid_focal_loss(
    input: Tensor,
    target: Tensor,
    alpha: float = 0.25,
    gamma: float = 2.0,
    reduction: str = "none",
    *,
    mask: Tensor | None = None,
) -> Tensor:
    r"""Sigmoid focal loss of RetinaNet, finite for every $\gamma \ge 0$ and every finite logit.

    With logits $x$, targets $t \in [0, 1]$ (hard or soft), $p = \sigma(x)$,
    $p_t = p\,t + (1-p)(1-t)$ and $\alpha_t = \alpha t + (1-\alpha)(1-t)$
    ($\alpha_t = 1$ when $\alpha = -1$):

    $$
    \ell_i = \alpha_t\,\mathrm{BCE}(x_i, t_i)\,(1 - p_t)^{\gamma},\qquad
    1 - p_t = t\,\sigma(-x) + (1-t)\,\sigma(x),
    $$

    where both $1 - p_t$ and $\mathrm{BCE} = t\operatorname{softplus}(-x) +
    (1-t)\operatorname{softplus}(x)$ are evaluated as sums of non-negative terms, so they keep
    full relative precision when tiny (torchvision's $1 - p_t$ cancels to 0 for saturated
    logits), and $(1-p_t)^\gamma = \exp(\gamma \log(1-p_t))$ with $\log(1-p_t)$ exact, so it
    does not round to 0 before the product does. At $\gamma = 0$ the value is
    $\alpha_t$ times torch's own ``binary_cross_entropy_with_logits`` term, bit for bit
    (torchvision's tests compare ``focal <= BCE`` and ``focal == BCE`` at $\alpha = -1$ exactly).
    Reductions: none $\ell$; mean $\tfrac{1}{N}\sum_i \ell_i$; sum $\sum_i \ell_i$.
    float16/bfloat16 inputs are computed in float32. One code path for every size (no
    size-dependent branch), so ``torch.export`` with a dynamic batch dimension works.

    **Gradient**

    $$
    \frac{\partial \ell}{\partial x} = \alpha_t (1-p_t)^{\gamma}\Big[(\sigma(x) - t)
    + \gamma\,\mathrm{BCE}\,\frac{(1-2t)\,\sigma(x)\sigma(-x)}{1-p_t}\Big],
    $$

    where $\mathrm{BCE}\,\sigma(x)\sigma(-x)/(1-p_t)$ is evaluated as $C\,\sigma(-|x|)$ with
    $C = \mathrm{BCE}\,/\,\big((1-p_t)(1+e^{-|x|})\big)$, which is bounded by $|x| + 2$: no
    factor divides by a vanishing $1 - p_t$. For a saturated logit on the right side the
    gradient is the exact tiny value (0 once it underflows) where torchvision's formula gives
    NaN for $\gamma < 1$. The gradient with respect to ``target`` is analytic as well; NaN
    propagates. Forward mode (``torch.func.jvp``/``jacfwd``/``hessian``) uses the same
    derivatives, and the second derivative in $x$ (double backward, ``hessian``) is finite and
    accurate at saturated logits (e.g. $\pm 30, \pm 100, \pm 200$, any $\gamma > 0$). The mixed
    second derivative in $x$ and $t$ is finite everywhere; at a hard target with
    $|x| > 66$ (float32) it omits terms of the size of $(1-p_t)^\gamma |x|$.

    **Infinite logits.** At $x = \pm\infty$ the loss is its limit: 0 where the target sits at
    that end ($t = 1$ at $+\infty$, $t = 0$ at $-\infty$) or $\alpha_t = 0$, else $+\infty$
    (torchvision's formula gives NaN); the gradient in $x$ is the limit $\pm\alpha_t w^{1+\gamma}$
    ($w$ the target mass on the other side), with second derivative 0. The gradient in ``t``
    is infinite there, as the loss is around it.

    **Mask.** ``mask`` (bool, True = counts), broadcastable to the unreduced loss $\ell$,
    reduces over its True entries $M$ as every loss does ([the `mask=`
    argument](../migration.md#the-mask-argument)): ``'mean'`` is $\sum_M \ell_i / \max(1, |M|)$.
    ``mask=None`` adds nothing to the graph.

    Args:
        input: logits, any shape, floating point.
        target: targets of the same shape as ``input``, 0/1 labels or probabilities.
        alpha: weight of the positive class in ``[0, 1]``; ``-1`` disables weighting.
            Default: ``0.25``.
        gamma: focusing parameter, ``>= 0``. Default: ``2.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'none'`` (as torchvision).
        mask: bool tensor, True = counts, broadcastable to ``input`` (keyword-only);
            ``None``: every entry counts. Default: ``None``.

    Returns:
        A scalar for ``'mean'``/``'sum'``, else ``input``'s shape; dtype ``input`` and
        ``target`` promoted as torch (``(float32, float64)`` is float64), float32 for half
        input under autocast.

    Raises:
        ValueError: ``reduction`` is not one of the above (the message says ``Invalid``, as
            torchvision's), ``gamma`` is negative, infinite or NaN, ``alpha`` is neither in
            ``[0, 1]`` nor ``-1``, or ``target`` and ``input`` differ in shape (as torchvision).
        TypeError: ``input``/``target`` is not a floating-point tensor, or ``alpha``/``gamma``
            is not a number.
        ValueError: ``mask`` does not broadcast to the unreduced loss (TypeError: not bool).

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
    reduction, alpha_f, gamma_f = check_focal_args(fn, alpha, gamma, reduction)
    if target.size() != input.size():
        # as torchvision, whose binary_cross_entropy_with_logits refuses to broadcast
        raise ValueError(
            f"{fn}: target size ({target.size()}) must be the same as input size ({input.size()})"
        )
    out = _backend.dispatch(  # the kernels when selected (stablelosses.set_backend), else None
        "sigmoid_focal_loss", input, target, alpha_f, gamma_f, reduction, mask, torch_path=sigmoid_focal_loss)
    if out is not None:
        return out
    # type promotion as torchvision's formula: (float32, float64) is float64 (half in float32)
    work, out_dtype = operand_dtypes(input, target)
    x, t = input.to(work), target.to(work)
    if mask is not None:
        m = check_mask(fn, mask, input.shape, device=input.device).to(input.device)
        # select, do not multiply: a NaN at a False entry is never read
        x, t = torch.where(m, x, 0.0), torch.where(m, t, 0.0)
        return cast(reduce(_SigmoidFocal.call(x, t, alpha_f, gamma_f, "none"), reduction, m), out_dtype)
    loss = _SigmoidFocal.call(x, t, alpha_f, gamma_f, reduction)
    return cast(loss, out_dtype)
