r"""binary_cross_entropy_with_logits: exact limits at ±inf logits, with ``pos_weight`` and ``weight``.

torch writes the loss as $(1 - t)\,x + l_w\,(\log(1 + e^{-|x|}) + \max(-x, 0))$: at $x = \pm\infty$
the product $(1 - t)\,x$ meets $\infty - \infty$ or $0\cdot\infty$, and ``(inf, 1)``, ``(-inf, 0)``
and ``(-inf, 0.9)`` give NaN (pytorch #102894, #135359). Here the same loss is written as two
softplus terms, each a product that is 0 where its coefficient is 0:

$$ \ell = w\,\big[(1 - t)\,\operatorname{softplus}(x) + p_w\,t\,\operatorname{softplus}(-x)\big],
   \qquad \operatorname{softplus}(x) = -\log\sigma(-x). $$

The composition is differentiable torch ops (``logsigmoid`` and selects), so double backward,
forward mode, vmap and ``torch.compile`` come from torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stablelosses._utils import cast
from stablelosses._utils import reduce as _reduce
from stablelosses.functional._torch_losses import (
    NOT_IMPLEMENTED,
    call_torch,
    check_fits_input,
    check_floating_input,
    check_reduction,
    check_tensors,
    out_dtype,
    up,
)

__all__ = ["binary_cross_entropy_with_logits", "bce_terms", "times", "weighted_bce_terms"]

_INF = float("inf")


def times(c: Tensor, v: Tensor) -> Tensor:
    """``c · v`` with ``0 · inf = 0``: a zero coefficient of an infinite term is the limit of a
    term that is 0 for every finite argument. Double select (the infinite operand is made 0
    before the product), so neither gradient is NaN there; a NaN in either stays NaN."""
    zero_inf = (c == 0) & (v == _INF)
    return torch.where(zero_inf, 0.0, c * torch.where(zero_inf, 0.0, v))


def bce_terms(x: Tensor, t: Tensor, pos_weight: Tensor | None) -> Tensor:
    r"""The unweighted pointwise loss $(1 - t)\,\mathrm{sp}(x) + p_w\,t\,\mathrm{sp}(-x)$, exact at ±inf.

    Its gradient is $(1 - t)\,\sigma(x) - p_w\,t\,\sigma(-x)$ for $x$ (finite for every $x$:
    $1 - t$ at $+\infty$, $-p_w t$ at $-\infty$), $p_w\,\mathrm{sp}(-x) - \mathrm{sp}(x)$ for $t$
    and $t\,\mathrm{sp}(-x)$ for $p_w$.
    """
    sp_pos = -torch.nn.functional.logsigmoid(-x)  # softplus(x) = log(1 + e^x)
    sp_neg = -torch.nn.functional.logsigmoid(x)  # softplus(-x)
    c_neg = t if pos_weight is None else pos_weight * t
    return times(1 - t, sp_pos) + times(c_neg, sp_neg)


def weighted_bce_terms(x: Tensor, t: Tensor, pos_weight: Tensor | None, w: Tensor | None) -> Tensor:
    r"""$w\cdot$ `bce_terms`, with ``0 · inf = 0`` where the weight is 0 and the logit infinite,
    and every gradient there 0 (not NaN).

    A plain ``times(w, bce_terms(x, ...))`` sends 0 upstream there, and inside ``bce_terms``
    that 0 meets the infinite softplus in the product with ``1 - t`` (or ``p_w t``): the
    gradient of ``t`` (``pos_weight``) is ``0 · inf = NaN``. So at those entries the logit is
    selected to 0 before the terms (finite there) and the terms multiplied by 0 (a NaN target
    or ``pos_weight`` stays NaN): the value is ``0 · ℓ = 0`` and no gradient reaches an
    infinite softplus."""
    if w is None:
        return bce_terms(x, t, pos_weight)
    gone = (w == 0) & torch.isinf(x)  # weight 0 at an infinite logit: the term is 0
    loss = bce_terms(torch.where(gone, 0.0, x), t, pos_weight)
    return times(w, loss * torch.where(gone, 0.0, 1.0))


def binary_cross_entropy_with_logits(
    input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
    reduce: bool | None = None, reduction: str = "mean", pos_weight: Tensor | None = None,
) -> Tensor:
    r"""Binary cross-entropy on logits, exact at $\pm\infty$ where torch gives NaN.

    $$ \ell_i = w_i\,\big[(1 - t_i)\,\operatorname{softplus}(x_i)
       + p_{w}\,t_i\,\operatorname{softplus}(-x_i)\big] $$

    ($p_w$ broadcast along the last, class dimension, as torch). A product whose coefficient is
    0 is 0 also where its softplus is $+\infty$, so the limits hold: ``(+inf, 1)`` and
    ``(-inf, 0)`` give **0**, ``(-inf, 0.9)`` gives ``+inf`` (torch: NaN for all three,
    pytorch #102894, #135359). Reductions: none $\ell$; sum; mean $\frac1N\sum_i \ell_i$.
    Where torch is finite the value is torch's (the same terms, rearranged).

    **Gradient**

    $$ \frac{\partial \ell_i}{\partial x_i} = w_i\,\big((1 - t_i)\,\sigma(x_i)
       - p_w\,t_i\,\sigma(-x_i)\big), $$

    finite for every logit: $w(1 - t)$ at $+\infty$ and $-w\,p_w\,t$ at $-\infty$, also where
    the value is $+\infty$. ``target`` gets $w\,(p_w\operatorname{softplus}(-x) -
    \operatorname{softplus}(x))$ (torch's), ``pos_weight`` $w\,t\,\operatorname{softplus}(-x)$ and
    ``weight`` the unweighted term. Double backward and forward mode are torch's ops'.
    NaN in any argument gives NaN.

    Args:
        input: logits, any shape.
        target: probabilities of the positive class, ``input``'s shape.
        weight: broadcastable to ``input``, or ``None``. Default: ``None``.
        size_average: deprecated (as in torch); with ``reduce`` it overrides ``reduction``.
        reduce: deprecated (as in torch), see ``size_average``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        pos_weight: weight of the positive term, broadcastable along the last dimension
            (``(C,)``), or ``None``. Default: ``None``.

    Returns:
        A scalar, or ``input``'s shape for ``'none'``; ``target``'s dtype, as torch's kernel
        (float16/bfloat16 computed in float32 and rounded back).

    Raises:
        ValueError: ``reduction`` is not one of the above; ``target``'s size differs from
            ``input``'s (torch's check).
        TypeError: an argument is not a tensor.
        RuntimeError: ``target`` is not floating-point; ``weight`` or ``pos_weight`` does not
            broadcast to ``input``'s shape (also where it would enlarge it, as torch).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import stablelosses.functional as SF
        >>> inf = float("inf")
        >>> x = torch.tensor([inf, -inf, -inf], requires_grad=True)
        >>> t = torch.tensor([1.0, 0.0, 0.9])
        >>> F.binary_cross_entropy_with_logits(x, t, reduction="none")
        tensor([nan, nan, nan], grad_fn=<BinaryCrossEntropyWithLogitsBackward0>)
        >>> loss = SF.binary_cross_entropy_with_logits(x, t, reduction="none")
        >>> loss
        tensor([0., 0., inf], grad_fn=<AddBackward0>)
        >>> loss.sum().backward()
        >>> x.grad
        tensor([ 0.0000,  0.0000, -0.9000])

    Replaces ``torch.nn.functional.binary_cross_entropy_with_logits``.
    """
    fn = "binary_cross_entropy_with_logits"
    red = check_reduction(fn, reduction, size_average, reduce)
    check_tensors(fn, input=input, target=target, weight=weight, pos_weight=pos_weight)
    # torch's log_sigmoid has no integer or bool kernel
    no_kernel = NOT_IMPLEMENTED.format(kernel="log_sigmoid")
    check_floating_input(fn, "input", input, NotImplementedError, no_kernel)
    if pos_weight is not None and pos_weight.dtype == torch.bool:  # torch: 1 - pos_weight on a bool
        raise RuntimeError(
            f"{fn}: pos_weight must not be a bool tensor (Subtraction, the `-` operator, with a bool "
            f"tensor is not supported)"
        )
    if target.size() != input.size():
        raise ValueError(
            f"{fn}: Target size ({target.size()}) must be the same as input size ({input.size()})"
        )
    if not target.is_floating_point():  # torch: "result type Float can't be cast to ... Long"
        raise RuntimeError(
            f"{fn}: target must be a floating-point tensor of probabilities, got {target.dtype}"
        )
    # torch's kernel multiplies in place into input's shape (pos_weight meets target, input's shape)
    check_fits_input(fn, input, weight=weight, pos_weight=pos_weight)
    dtype = out_dtype(target)  # torch's kernel writes in target's dtype
    x, t, w, pw = up(input), up(target), up(weight), up(pos_weight)
    loss = call_torch(fn, weighted_bce_terms, ("input", "target", "pos_weight", "weight"), x, t, pw, w)
    res = _reduce(loss, red)
    return res if dtype is None else cast(res, dtype)
