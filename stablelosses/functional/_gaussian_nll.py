r"""gaussian_nll_loss whose variance floor has the gradient of the value it computes.

torch clamps ``var`` at ``eps`` in place under ``torch.no_grad()``: the value uses
$\max(\mathrm{var}, \epsilon)$, but autograd differentiates $\tfrac12(\log v + r^2/v)$ at the
clamped value as if ``var`` had reached it, so below the floor ``var`` gets
$\tfrac12(1/\epsilon - r^2/\epsilon^2)$ (at ``var = 1e-12`` with ``eps = 1e-6`` and residual 1:
$-5.0\cdot 10^{11}$), a gradient of a value that does not depend on ``var`` there.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from stablelosses._compat import functorch_transforms_active
from stablelosses._utils import cast
from stablelosses._utils import reduce as _reduce
from stablelosses.functional import _torch_losses as tl

__all__ = ["gaussian_nll_loss"]


def _var_shaped(fn: str, input: Tensor, var: Tensor) -> Tensor:
    """torch's shape rules for ``var``: ``input``'s size, one dimension short (unsqueezed), or
    broadcastable with exactly one mismatched dimension; else ``ValueError``."""
    if var.size() == input.size():
        return var
    if input.size()[:-1] == var.size():
        return torch.unsqueeze(var, -1)
    if input.ndim == var.ndim and sum(y for x, y in zip(input.size(), var.size()) if x != y) == 1:
        return var
    raise ValueError(f"{fn}: var is of incorrect size: var {tuple(var.shape)}, input {tuple(input.shape)}")


def _terms(x: Tensor, y: Tensor, v: Tensor, eps: float, full: bool) -> Tensor:
    # clamp's derivative is 1 where var >= eps and 0 below: the derivative of the value
    v = v.clamp(min=eps)
    loss = 0.5 * (torch.log(v) + (x - y) ** 2 / v)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return loss


def gaussian_nll_loss(
    input: Tensor,
    target: Tensor,
    var: Tensor | float,
    full: bool = False,
    eps: float = 1e-6,
    reduction: str = "mean",
) -> Tensor:
    r"""Gaussian negative log-likelihood; below the variance floor ``var`` gets gradient 0.

    $$ \ell_i = \tfrac12\Big(\log\max(v_i, \epsilon) + \frac{(x_i - y_i)^2}{\max(v_i, \epsilon)}\Big)
       \ \big(+ \tfrac12\log 2\pi \text{ with ``full``}\big) $$

    The value is torch's. Reductions: none; sum; mean $\frac1N\sum_i \ell_i$.

    **Gradient.** The derivative of the value computed: for ``var``
    $\tfrac12\big(1/v - r^2/v^2\big)$ where $v \ge \epsilon$ (torch's), and exactly **0** where
    $v < \epsilon$, since the clamped value does not depend on ``var`` there. This departs from
    torch, whose clamp runs under ``no_grad`` and so passes the gradient at $\epsilon$ through:
    at ``var = 1e-12``, residual 1, torch gives $\partial\ell/\partial v = -5.0\cdot 10^{11}$,
    which sends the variance the wrong way with a huge step. ``input`` and ``target`` get
    $\pm r/\max(v, \epsilon)$ (torch's). NaN gives NaN.

    Args:
        input: the predicted mean, any shape.
        target: samples, broadcastable with ``input``.
        var: the predicted variance: ``input``'s size, one dimension short (homoscedastic),
            broadcastable with one mismatched dimension, or a float; non-negative.
        full: add the constant $\tfrac12\log 2\pi$. Default: ``False``.
        eps: the variance floor. Default: ``1e-6``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Returns:
        A scalar, or the broadcast shape for ``'none'``; the promoted dtype (float16/bfloat16
        computed in float32 and rounded back).

    Raises:
        ValueError: ``reduction`` is not one of the above; ``var`` has the wrong size; ``var``
            has a negative entry (checked in eager mode only, as it reads values: under
            ``torch.compile`` and ``torch.func`` a negative variance gives NaN).
        TypeError: an argument is not a tensor.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import stablelosses.functional as SF
        >>> var = torch.tensor([1e-12], requires_grad=True)
        >>> SF.gaussian_nll_loss(torch.tensor([1.0]), torch.tensor([0.0]), var).backward()
        >>> var.grad
        tensor([0.])
        >>> var.grad = None
        >>> F.gaussian_nll_loss(torch.tensor([1.0]), torch.tensor([0.0]), var).backward()
        >>> var.grad
        tensor([-5.0000e+11])

    Replaces ``torch.nn.functional.gaussian_nll_loss``.
    """
    fn = "gaussian_nll_loss"
    # torch's own check and words
    red = tl.check_reduction(fn, reduction, alias=False, invalid="is not valid")
    tl.check_tensors(fn, input=input, target=target)
    if isinstance(var, float):
        if var < 0:
            raise ValueError(f"{fn}: var has negative entry/entries, got {var}")
        var = var * torch.ones_like(input)
    tl.check_tensors(fn, var=var)
    if not torch.compiler.is_compiling() and not functorch_transforms_active() and bool(torch.any(var < 0)):
        raise ValueError(f"{fn}: var has negative entry/entries")
    # torch clamps a copy of var in place at eps: an integer or bool var is its RuntimeError
    tl.check_floating_input(fn, "var", var, RuntimeError, tl.CANNOT_CAST)
    v = _var_shaped(fn, input, var)
    dtype = tl.out_dtype(input, target, v)
    loss = tl.call_torch(fn, _terms, ("input", "target", "var"), tl.up(input), tl.up(target), tl.up(v),
                         eps, full)
    res = _reduce(loss, red)
    return res if dtype is None else cast(res, dtype)
