r"""nll_loss whose ``-inf`` log-probabilities at ignored or zero-weight positions contribute 0.

torch multiplies the picked log-probability by its class weight: a zero weight meets a ``-inf``
log-probability (a masked class) as $0\cdot(-\infty)$ = NaN, in the value and, for
``(N, C, d1, ...)`` inputs, in the gradient. Here such an entry is replaced by 0 before torch's
kernel runs, so the kernel, its reductions and its gradients are torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from stablelosses._spec import check_int
from stablelosses._utils import cast, take
from stablelosses.functional._bce_logits import times
from stablelosses.functional._torch_losses import (
    NOT_IMPLEMENTED,
    call_torch,
    check_floating_input,
    check_reduction,
    check_same_dtype,
    check_tensors,
    needs_grad,
    out_dtype,
    up,
    with_grad_only,
)

__all__ = ["nll_loss"]

_INTEGER_TARGETS = (torch.int64, torch.uint8, torch.int32, torch.int16, torch.int8)


def _no_weight_mask(input: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int) -> Tensor:
    """True at the entries of ``input`` whose term has weight 0: the whole class slice of an
    ignored position, and the classes whose ``weight`` is 0."""
    cdim = 1 if input.dim() > 1 else 0
    ignored = (target == ignore_index).unsqueeze(cdim)
    if weight is None:
        return ignored
    shape = [1] * input.dim()
    shape[cdim] = -1
    return ignored | (weight == 0).reshape(shape)


def nll_loss(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
) -> Tensor:
    r"""Negative log-likelihood of class indices; ``-inf`` at a weightless entry contributes 0.

    $$ \ell_n = -w_{t_n}\,x_{n, t_n}, \qquad w_{t_n} = 0 \text{ where } t_n = \text{ignore\_index}, $$

    with $0\cdot(-\infty) = 0$: a ``-inf`` log-probability (a masked class) at an ignored
    position or in a class of weight 0 adds 0 (torch: NaN). Reductions as torch: none;
    sum; mean $\sum_n \ell_n / \sum_n w_{t_n}$ (NaN when every position is ignored, as torch).
    Elsewhere the value is torch's.

    **Gradient.** torch's: $-w_{t_n}$ at $x_{n,t_n}$ (over the weight sum for ``'mean'``), 0
    elsewhere, and 0 (not NaN) at the weightless ``-inf`` entries. ``weight`` gets the
    derivative of the value (torch raises when it requires one). A NaN at a counted entry gives NaN;
    an ignored position is not read, as in torch. A non-contiguous ``(N, C, d1, ...)`` input
    (``channels_last`` included), where torch's backward raises, is copied to a contiguous one.

    Args:
        input: log-probabilities ``(N, C)``, ``(C,)`` or ``(N, C, d1, ...)``.
        target: class indices ``(N)``, ``()`` or ``(N, d1, ...)``, int64 (or uint8, as torch).
        weight: per-class weight ``(C,)``, or ``None``. Default: ``None``.
        size_average: deprecated (as in torch); with ``reduce`` it overrides ``reduction``.
        ignore_index: target value that adds nothing. Default: ``-100``.
        reduce: deprecated (as in torch), see ``size_average``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Returns:
        A scalar, or ``target``'s shape for ``'none'``; ``input``'s dtype (half computed in
        float32).

    Raises:
        ValueError: ``reduction`` is not one of the above.
        TypeError: an argument is not a tensor; ``ignore_index`` is not an int.
        RuntimeError: ``target`` is not an integer tensor (naming it), shapes that do not fit,
            a target out of range (torch's checks, naming the arguments).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import stablelosses.functional as SF
        >>> logp = torch.tensor([[0.0, float("-inf")], [0.0, float("-inf")]], requires_grad=True)
        >>> t, w = torch.tensor([0, 1]), torch.tensor([1.0, 0.0])  # class 1 is masked and weightless
        >>> F.nll_loss(logp, t, weight=w)
        tensor(nan, grad_fn=<NllLossBackward0>)
        >>> loss = SF.nll_loss(logp, t, weight=w)
        >>> loss
        tensor(0., grad_fn=<NllLossBackward0>)
        >>> loss.backward()
        >>> logp.grad
        tensor([[-1.,  0.],
                [ 0.,  0.]])

    Replaces ``torch.nn.functional.nll_loss``.
    """
    fn = "nll_loss"
    red = check_reduction(fn, reduction, size_average, reduce)
    check_tensors(fn, input=input, target=target, weight=weight)
    # torch's kernel has no integer or bool version
    check_floating_input(fn, "input", input, NotImplementedError, NOT_IMPLEMENTED.format(kernel="nll_loss"))
    ignore_index = check_int(fn, "ignore_index", ignore_index, tensor=True)
    if target.dtype not in _INTEGER_TARGETS:
        raise RuntimeError(
            f"{fn}: target must be an integer tensor (int64) of class indices, got {target.dtype}"
        )
    check_same_dtype(fn, input, weight)
    dtype = out_dtype(input)
    x = up(input)
    cdim = 1 if input.dim() > 1 else 0
    fits = input.dim() >= 1 and tuple(target.shape) == tuple(input.shape[:cdim] + input.shape[cdim + 1 :])
    if fits and (weight is None or tuple(weight.shape) == (input.shape[cdim],)):
        # the sanitised copy: -inf at a weightless entry is 0 (selected only on -inf, so NaN stays)
        bad = _no_weight_mask(x, target, weight, ignore_index) & (x == float("-inf"))
        x = x.masked_fill(bad, 0.0)  # x's layout (a select took a non-contiguous target's)
    if x.dim() > 2:
        # torch's (N, C, d1, ...) backward refuses a non-contiguous input ("grad_input must be
        # contiguous"), channels_last included: a copy there (none for a contiguous input)
        x = x.contiguous()
    w = up(weight)
    res = call_torch(
        fn,
        F.nll_loss,
        ("input", "target"),
        x,
        target,
        weight=None if w is None else w.detach(),
        ignore_index=ignore_index,
        reduction=red,
    )
    if w is not None and needs_grad(w):
        # the weight's gradient (torch's kernel gives none) from a term of value 0: the loss as a
        # function of weight, less the same with weight detached. The input tangent of the term
        # is 0 (no doubled jvp); its input gradient, 0 in value, depends on weight, so the mixed
        # second derivative input×weight exists (double backward, hessian)
        res = res + with_grad_only(_weighted_nll(x, target, w, ignore_index, red)
                                   - _weighted_nll(x, target, w.detach(), ignore_index, red))
    return res if dtype is None else cast(res, dtype)


def _weighted_nll(x: Tensor, target: Tensor, w: Tensor, ignore_index: int, red: str) -> Tensor:
    r"""The loss as a function of ``weight`` alone (torch's kernel gives weight no gradient):
    $-\sum_n w_{t_n} x_{n,t_n}$, over $\sum_n w_{t_n}$ for ``'mean'``; ``x`` is the sanitised copy."""
    cdim = 1 if x.dim() > 1 else 0
    valid = target != ignore_index
    safe_t = torch.where(valid, target, 0)
    picked = x.gather(cdim, safe_t.unsqueeze(cdim)).squeeze(cdim)
    wt = torch.where(valid, take(w, safe_t), 0.0)
    per = times(wt, -picked)  # 0 · (-inf) = 0 at a weightless entry
    if red == "mean":
        return per.sum() / wt.sum()
    return per.sum() if red == "sum" else per
