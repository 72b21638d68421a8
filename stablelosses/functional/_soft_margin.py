r"""soft_margin_loss and multilabel_soft_margin_loss without overflow.

torch's ``soft_margin_loss`` computes $\log(1 + e^{-y x})$ literally: ``exp`` overflows once
$-y x > 88.7$ (float32), and the value is ``inf`` where the exact one is $-y x$, with the
gradient 0 beside it. Here it is $-\log\sigma(y x)$, torch's stable ``logsigmoid``. The
multi-label form is the logistic loss of
[`binary_cross_entropy_with_logits`][stablelosses.functional.binary_cross_entropy_with_logits]
(torch's version is stable for finite scores, but gives NaN at $\pm\infty$ scores).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stablelosses._utils import cast
from stablelosses._utils import reduce as _reduce
from stablelosses.functional import _torch_losses as tl
from stablelosses.functional._bce_logits import weighted_bce_terms

__all__ = ["soft_margin_loss", "multilabel_soft_margin_loss"]


def _soft_margin_terms(x: Tensor, y: Tensor) -> Tensor:
    # log(1 + exp(-y·x)) = -log σ(y·x); x·y in torch's order (its broadcast error names input
    # as tensor a and target as b)
    return -torch.nn.functional.logsigmoid(x * y)


def soft_margin_loss(
    input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
    reduction: str = "mean",
) -> Tensor:
    r"""Two-class logistic loss $\log(1 + e^{-y x})$ that does not overflow at large margins.

    $$ \ell_i = \log\big(1 + e^{-y_i x_i}\big) = -\log\sigma(y_i x_i) $$

    computed as the stable ``logsigmoid``: $-y x = 10^4$ gives $10^4$ (torch: ``inf`` once
    $-y x > 88.7$ in float32). Reductions: none; sum; mean $\frac1N\sum_i \ell_i$. Where torch
    is finite the value is torch's.

    **Gradient.** $\partial\ell/\partial x = -y\,\sigma(-y x)$ and $\partial\ell/\partial y =
    -x\,\sigma(-y x)$: finite for every finite input (torch's is NaN where its value
    overflows: $-y x = 100$ gives ``inf`` and the gradient NaN in float32). NaN gives NaN.

    Args:
        input: scores, any shape.
        target: $\pm 1$ (or any real), broadcastable to ``input``'s shape.
        size_average: deprecated (as in torch); with ``reduce`` it overrides ``reduction``:
            ``False`` sums the logistic terms.
        reduce: deprecated (as in torch); ``False`` keeps one logistic term per element.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'`` over all elements. Default: ``'mean'``.

    Returns:
        A scalar, or the terms $\ell_i$ in ``input``'s shape for ``'none'``; ``input``'s
        dtype, as torch's kernel (float16/bfloat16 computed in float32 and rounded back).

    Raises:
        ValueError: ``reduction`` is not one of the above.
        TypeError: ``input`` or ``target`` is not a tensor.
        RuntimeError: the shapes do not broadcast (the message names both), or ``target``
            would broadcast ``input`` to a larger shape (torch's kernel writes in ``input``'s).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import stablelosses.functional as SF
        >>> x, y = torch.tensor([-100.0]), torch.tensor([1.0])
        >>> F.soft_margin_loss(x, y)
        tensor(inf)
        >>> SF.soft_margin_loss(x, y)
        tensor(100.)
        >>> torch.func.grad(SF.soft_margin_loss)(x, y)  # -y·σ(-y x)
        tensor([-1.])

    Replaces ``torch.nn.functional.soft_margin_loss``.
    """
    fn = "soft_margin_loss"
    red = tl.check_reduction(fn, reduction, size_average, reduce)
    tl.check_tensors(fn, input=input, target=target)
    # torch's kernel writes the loss in input's dtype: an integer or bool input is its RuntimeError
    tl.check_floating_input(fn, "input", input, RuntimeError, tl.CANNOT_CAST)
    tl.check_fits_input(fn, input, target=target)  # torch's kernel writes in input's shape
    dtype = tl.out_dtype(input)  # torch's kernel writes in input's dtype
    loss = tl.call_torch(fn, _soft_margin_terms, ("input", "target"), tl.up(input), tl.up(target))
    res = _reduce(loss, red)
    return res if dtype is None else cast(res, dtype)


def _multilabel_terms(x: Tensor, y: Tensor, w: Tensor | None) -> Tensor:
    # torch's class dimension is input's last, counted from the front of the broadcast terms
    # (a target or weight with more dimensions keeps its leading ones)
    class_dim = x.dim() - 1
    classes = x.size(class_dim)  # torch's IndexError for a 0-dim input
    return weighted_bce_terms(x, y, None, w).sum(class_dim) / classes


def multilabel_soft_margin_loss(
    input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
    reduce: bool | None = None, reduction: str = "mean",
) -> Tensor:
    r"""Multi-label one-versus-all logistic loss, exact at $\pm\infty$ scores.

    $$ \ell_n = \frac1C \sum_c w_c\,\big[(1 - y_{n,c})\operatorname{softplus}(x_{n,c})
       + y_{n,c}\operatorname{softplus}(-x_{n,c})\big] $$

    torch's formula $-(y\log\sigma(x) + (1 - y)\log\sigma(-x))$ with the terms of
    [`binary_cross_entropy_with_logits`][stablelosses.functional.binary_cross_entropy_with_logits]:
    a term whose coefficient is 0 is 0 also at an infinite score (torch: NaN for a score of
    $+\infty$ with $y = 1$, or $-\infty$ with $y = 0$). Reductions over the samples: none
    ``(N,)``; sum; mean $\frac1N\sum_n \ell_n$.

    **Gradient.** $\frac{w_c}{C}\,(\sigma(x) - y)$ for ``input``, finite at $\pm\infty$ too;
    ``target`` and ``weight`` get theirs (see ``binary_cross_entropy_with_logits``).

    Args:
        input: scores ``(N, C)`` or ``(C,)``.
        target: labels in $[0, 1]$, ``input``'s shape. As in torch, any shape that broadcasts
            with ``input`` is taken: the terms are computed in the broadcast shape and summed
            over its dimension ``input.dim() - 1`` (counted from the front), divided by
            ``input.size(-1)``.
        weight: per-class weight ``(C,)`` (broadcast with the terms, as ``target``), or
            ``None``. Default: ``None``.
        size_average: deprecated (as in torch); ``False`` sums the per-sample losses.
        reduce: deprecated (as in torch); ``False`` returns $\ell_n$, one per sample.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'`` over the samples. Default: ``'mean'``.

    Returns:
        A scalar, or ``(N,)`` for ``'none'`` (a scalar for ``(C,)`` scores); the promoted dtype
        of ``input``, ``target`` and ``weight`` (half computed in float32).

    Raises:
        ValueError: ``reduction`` is not one of the above.
        TypeError: ``input``, ``target`` or ``weight`` is not a tensor.
        RuntimeError: the shapes do not broadcast (the message names them).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import stablelosses.functional as SF
        >>> x = torch.tensor([[float("inf"), 0.0]])
        >>> y = torch.tensor([[1.0, 1.0]])
        >>> F.multilabel_soft_margin_loss(x, y)
        tensor(nan)
        >>> SF.multilabel_soft_margin_loss(x, y)
        tensor(0.3466)

    Replaces ``torch.nn.functional.multilabel_soft_margin_loss``.
    """
    fn = "multilabel_soft_margin_loss"
    # torch's checks the three names itself, in its own words
    red = tl.check_reduction(fn, reduction, size_average, reduce, alias=False, invalid="is not valid")
    tl.check_tensors(fn, input=input, target=target, weight=weight)
    # torch's logsigmoid has no integer or bool kernel
    no_kernel = tl.NOT_IMPLEMENTED.format(kernel="log_sigmoid")
    tl.check_floating_input(fn, "input", input, NotImplementedError, no_kernel)
    dtype = tl.out_dtype(input, target, weight)  # torch's formula promotes with weight
    loss = tl.call_torch(fn, _multilabel_terms, ("input", "target", "weight"), tl.up(input), tl.up(target),
                         tl.up(weight))
    res = _reduce(loss, red)
    return res if dtype is None else cast(res, dtype)
