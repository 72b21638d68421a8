"""rmse_loss: the root-mean-square error, finite gradient at a zero residual, no overflow."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from stablelosses._autograd.rmse import _RMSE
from stablelosses._spec import check_nonnegative, check_reduction
from stablelosses._utils import cast, check_tensor, operand_dtypes, reduce
from stablelosses.functional._masked import masked_residual
from stablelosses.functional._operands import _check_broadcast


def check_rmse_args(fn: str, reduction: object, eps: object) -> tuple[str, float]:
    """``(reduction, eps)`` checked: the arguments ``RMSELoss`` also checks at construction."""
    return check_reduction(fn, reduction), check_nonnegative(fn, "eps", eps)


def _warn_broadcast(input: Tensor, target: Tensor) -> None:
    # Mirrors F.mse_loss, which warns and then broadcasts; eager only: Dynamo cannot trace
    # warnings.warn (torch.compile(fullgraph=True) raised Unsupported), torch's own compiles
    if target.size() != input.size() and not torch.compiler.is_compiling():
        warnings.warn(
            f"Using a target size ({target.size()}) that is different to the input size "
            f"({input.size()}). This will likely lead to incorrect results due to "
            "broadcasting. Please ensure they have the same size.",
            stacklevel=3,
        )


def _mse_operands(fn: str, input: object, target: object) -> tuple[Tensor, Tensor, torch.dtype]:
    """Both operands in the compute dtype, and the dtype ``F.mse_loss`` returns.

    ``F.mse_loss`` broadcasts first, so both operands count as dimensioned tensors:
    ``promote_types`` of the two dtypes (an integer target joins a float input).
    """
    x, y = check_tensor(fn, "input", input), check_tensor(fn, "target", target)
    _check_broadcast(fn, x, y, ("input", "target"))
    work, out = operand_dtypes(x, y)
    if not work.is_floating_point:
        raise RuntimeError(
            f"{fn}: input or target must be a floating-point tensor, got {x.dtype} and {y.dtype}"
        )
    return x.to(work), y.to(work), out


def _rmse_masked(r: Tensor, m: Tensor, reduction: str, eps: float) -> Tensor:
    """rmse of the selected residuals ``r`` (0 at False entries of ``m``)."""
    zero = r.new_zeros(())
    if reduction == "none":
        return reduce(_RMSE.call(r, zero, "none", eps)[0], reduction, m)
    if reduction == "mean":
        # sqrt(Σ r² / n + eps) = the 'sum' rmse of r / sqrt(n), n = number of True entries (≥ 1)
        n = m.expand(r.shape).sum().clamp_min(1).to(r.dtype)
        r = r * n.rsqrt()
    return _RMSE.call(r, zero, "sum", eps)[0]


def rmse_loss(
    input: Tensor, target: Tensor, reduction: str = "mean", eps: float = 0.0, *, mask: Tensor | None = None
) -> Tensor:
    r"""Root-mean-square error with a finite gradient at zero residual and no overflow.

    With $r = \text{input} - \text{target}$ (broadcast as in ``F.mse_loss``) and $N$ its
    number of elements:

    $$
    \text{mean: } \sqrt{\tfrac{1}{N}\textstyle\sum_i r_i^2 + \epsilon},\qquad
    \text{sum: } \sqrt{\textstyle\sum_i r_i^2 + \epsilon},\qquad
    \text{none: } \sqrt{r_i^2 + \epsilon} .
    $$

    The norm $\sqrt{\sum_i r_i^2}$ is accumulated in float64 (a float32 square cannot
    overflow there; float64 residuals past $10^{154}$ are scaled by $2^{-600}$), so the result
    is finite whenever it is representable (float32 residual ``1e20`` gives ``1e20``) and a
    zero residual gives $+0.0$, eager and compiled alike. float16/bfloat16 inputs are computed
    in float32. Mixed dtypes promote as ``F.mse_loss`` does (it broadcasts first, so the two
    dtypes promote as dimensioned tensors): float16 with float32 gives float32, an integer or
    bool ``target`` joins a float ``input``.

    **Gradient**

    $$
    \frac{\partial\,\text{rmse}}{\partial r_i} = \frac{r_i}{D\,\text{rmse}},\qquad
    D = N \text{ (mean)},\ 1 \text{ (sum, none)},
    $$

    the well-conditioned form, bounded by $1/\sqrt{D}$ in magnitude (with $\epsilon > 0$ it is
    $r_i / (D\sqrt{m + \epsilon})$). Where the result is 0 (all residuals 0 and
    $\epsilon = 0$) the gradient is defined as **0** (the minimal-norm subgradient), where
    the textbook $\tfrac{1}{2\sqrt{m}} \cdot \tfrac{2r}{N}$ gives NaN. The gradient with
    respect to ``target`` is the negative. NaN in ``input``/``target`` propagates. Forward
    mode (``torch.func.jvp``/``jacfwd``/``hessian``) uses the same derivative (tangent 0 at a
    zero result).

    **Mask.** ``mask`` (bool, True = counts) broadcastable to the residual $r$ selects residuals;
    with $M$ its True entries and $n = \max(1, |M|)$:

    $$
    \text{mean: } \sqrt{\tfrac{1}{n}\textstyle\sum_{i \in M} r_i^2 + \epsilon},\qquad
    \text{sum: } \sqrt{\textstyle\sum_{i \in M} r_i^2 + \epsilon},\qquad
    \text{none: } [i \in M] \sqrt{r_i^2 + \epsilon} .
    $$

    An all-False mask gives $\sqrt{\epsilon}$ (0 for $\epsilon = 0$) with gradient 0.
    ``mask=None`` adds nothing to the graph.

    Args:
        input: predictions, any shape.
        target: targets, broadcastable to ``input`` (a size mismatch warns, as ``F.mse_loss``).
            At least one of the two is floating point.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        eps: a float ``>= 0`` added under the square root. Default: ``0.0``.
        mask: bool tensor, True = counts, broadcastable to the residual's shape (keyword-only);
            ``None``: every entry counts. Default: ``None``.

    Returns:
        A scalar for ``'mean'``/``'sum'``, else the broadcast shape. dtype: the one
        ``F.mse_loss`` returns (the promoted dtype, or float32 for float16/bfloat16 under
        autocast).

    Raises:
        ValueError: ``reduction`` is not one of the above, or ``eps < 0``.
        TypeError: ``input``/``target`` is not a tensor, or ``eps`` is not a number.
        RuntimeError: the shapes do not broadcast (the message names ``input`` and ``target``),
            or neither operand is floating point (``F.mse_loss``: "not implemented for 'Long'").
        ValueError: ``mask`` does not broadcast to the unreduced loss (TypeError: not bool).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import stablelosses.functional as SF
        >>> x = torch.zeros(3, requires_grad=True)
        >>> torch.sqrt(F.mse_loss(x, torch.zeros(3))).backward()
        >>> x.grad
        tensor([nan, nan, nan])
        >>> x.grad = None
        >>> SF.rmse_loss(x, torch.zeros(3)).backward()
        >>> x.grad
        tensor([0., 0., 0.])
        >>> SF.rmse_loss(torch.tensor([1e20]), torch.tensor([0.0]))
        tensor(1.0000e+20)

    Replaces ``torch.sqrt(F.mse_loss(input, target, reduction=reduction) + eps)``.
    """
    fn = "rmse_loss"
    reduction, eps = check_rmse_args(fn, reduction, eps)
    x, y, out_dtype = _mse_operands(fn, input, target)
    _warn_broadcast(x, y)
    if mask is not None:
        r, m = masked_residual(fn, x, y, mask)
        return cast(_rmse_masked(r, m, reduction, eps), out_dtype)
    return cast(_RMSE.call(x, y, reduction, eps)[0], out_dtype)
