"""kl_div."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from stablelosses._autograd.kl_div import _KLDiv
from stablelosses._spec import KL_REDUCTIONS, check_flag, check_torch_reduction
from stablelosses._utils import (
    broadcast_shapes,
    cast,
    check_tensor,
    legacy_reduction,
    operand_dtypes,
)
from stablelosses._utils import reduce as _reduce  # kl_div has a parameter named reduce
from stablelosses.functional._masked import check_mask
from stablelosses.functional._operands import _check_broadcast


def check_kl_div_args(fn: str, reduction: object, log_target: object) -> tuple[str, bool]:
    """``(reduction, log_target)`` checked (also by ``KLDivLoss`` at construction)."""
    return check_torch_reduction(fn, reduction, KL_REDUCTIONS), check_flag(fn, "log_target", log_target)


class _FalseByDefault:
    """``log_target``'s default: ``False``, told apart from an explicit ``False``, which in
    torch's positional order is ``reduce=False``."""

    def __repr__(self) -> str:
        return "False"

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:  # equal to False, as torch's default reads
        return other is False or isinstance(other, _FalseByDefault)

    def __hash__(self) -> int:
        return hash(False)


_FALSE = _FalseByDefault()


def _legacy_positional(
    fn: str, reduction: object, log_target: object, legacy: tuple[object, ...],
    size_average: object, reduce: object,
) -> tuple[object, object, object, object]:
    """torch's positional order ``(input, target, size_average, reduce, reduction, log_target)``:
    a ``None`` or a bool where ``reduction`` stands, with a fourth argument, is torch's
    ``size_average``. Gives ``(reduction, log_target, size_average, reduce)``."""
    if not (reduction is None or type(reduction) is bool):
        if legacy:
            raise TypeError(f"{fn}: takes at most 4 positional arguments (input, target, reduction, "
                            f"log_target), or torch's 6 with size_average and reduce first")
        return reduction, log_target, size_average, reduce
    if len(legacy) > 2:
        raise TypeError(f"{fn}: takes at most 6 positional arguments, got {4 + len(legacy)}")
    if size_average is not None or reduce is not None:
        raise TypeError(f"{fn}: size_average or reduce given twice, by position and by keyword")
    rest = (*legacy, *("mean", False)[len(legacy):])
    return rest[0], rest[1], reduction, None if log_target is _FALSE else log_target


def _check_real(fn: str, name: str, value: object) -> None:
    """torch's ``RuntimeError`` (not a ``TypeError``) for an integer, bool or complex tensor, in
    its words (``Integral inputs not supported``), naming the argument."""
    t = check_tensor(fn, name, value)
    if not t.is_floating_point():
        kind = "Complex" if t.is_complex() else "Integral"
        raise RuntimeError(f"{fn}: {name} must be a floating-point tensor (float16, bfloat16, float32 or "
                           f"float64), got {t.dtype} ({kind} inputs not supported)")


def _kl_div_masked(
    input: Tensor, target: Tensor, log_target: bool, mask: object, base: str, reduction: str,
) -> Tensor:
    """The pointwise terms at the True entries of ``mask``, reduced; ``'batchmean'`` divides by
    the number of batch rows (slices along dim 0) with at least one True entry (at least 1)."""
    shape = broadcast_shapes(input.shape, target.shape)
    m = check_mask("kl_div", mask, shape, device=input.device).to(input.device)
    # select, do not multiply: a NaN at a False entry is never read (0 · log 0 terms give 0)
    x = torch.where(m, input, 0.0)
    t = torch.where(m, target, 0.0)
    loss = _reduce(_KLDiv.call(x, t, log_target), base, m)
    if reduction == "batchmean" and len(shape) != 0:
        rows = m.expand(shape).reshape(shape[0], -1).any(1).sum().clamp_min(1)
        loss = loss / rows
    return loss


def kl_div(
    input: Tensor,
    target: Tensor,
    reduction: str = "mean",
    log_target: bool = _FALSE,  # type: ignore[assignment]
    *legacy: object,
    size_average: bool | None = None,
    reduce: bool | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    r"""Kullback-Leibler divergence whose zero-probability targets contribute exactly 0.

    ``input`` holds log-probabilities $x$; ``target`` holds probabilities $p$ (or
    log-probabilities $\log p$ with ``log_target=True``). Pointwise:

    $$
    \ell_i = p_i\,(\log p_i - x_i), \qquad \ell_i = 0 \text{ where } p_i = 0,
    $$

    also when $x_i = -\infty$ (where the textbook $0\cdot(-\infty)$ is NaN). Reductions:
    none $\ell$; sum $\sum_i \ell_i$; mean $\tfrac{1}{N}\sum_i \ell_i$; batchmean
    $\tfrac{1}{B}\sum_i \ell_i$ with $B$ = ``input.size(0)`` (1 for a 0-dim input, as torch).

    **Gradient**

    $$
    \frac{\partial \ell_i}{\partial x_i} = -p_i,\qquad
    \frac{\partial \ell_i}{\partial p_i} = \log p_i + 1 - x_i
    \quad\Big(\text{log\_target: } \frac{\partial \ell_i}{\partial \log p_i}
    = p_i(\log p_i - x_i + 1)\Big),
    $$

    scaled by the reduction. Where $p_i = 0$ (``target == 0``, or ``target == -inf`` with
    ``log_target``) both gradients are defined as **0**, also at $x_i = -\infty$; torch gives
    NaN for the target gradient there. A NaN in ``input`` or ``target`` makes the value NaN
    (at a zero-probability term too); the gradients follow ``F.kl_div`` (a NaN target gives
    NaN gradients).

    **Mask.** ``mask`` (bool, True = counts), broadcastable to the unreduced loss $\ell$,
    reduces over its True entries $M$ as every loss does ([the `mask=`
    argument](../migration.md#the-mask-argument)): ``'mean'`` is $\sum_M \ell_i / \max(1, |M|)$.
    ``'batchmean'`` divides $\sum_{i \in M} \ell_i$ by the number of batch rows (slices along
    dim 0) with at least one True entry (at least 1): a fully padded row counts as a row that
    is not there (torch's batch size when every row has one).
    ``mask=None`` adds nothing to the graph.

    Args:
        input: log-probabilities, any shape; ``'batchmean'`` divides by ``input.size(0)``.
        target: probabilities (or log-probabilities), broadcastable with ``input``.
        reduction: ``'none'`` | ``'batchmean'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        log_target: ``target`` is given as log-probabilities. Default: ``False``.
        size_average: deprecated (as in torch); with ``reduce`` it overrides ``reduction``
            (``'batchmean'`` still divides by ``input.size(0)`` afterwards, as torch does).
        reduce: deprecated (as in torch), see ``size_average``.
        *legacy: torch's positional order, ``kl_div(input, target, size_average, reduce,
            reduction, log_target)``: a ``None`` or bool third argument is ``size_average``, the
            fourth ``reduce`` and the next two ``reduction`` and ``log_target``, as in torch
            (``kl_div(input, target, None, None, 'sum')``). A lone ``None`` or bool third
            argument is refused: pass ``size_average=`` by keyword.
        mask: bool tensor, True = counts, broadcastable to the broadcast shape of ``input``
            and ``target`` (keyword-only); ``None``: every entry counts. Default: ``None``.

    ``'mean'`` warns with torch's ``UserWarning`` (it divides by the number of elements, not
    the batch size). Forward-mode AD (``torch.func.jvp``, ``jacfwd``) is supported.

    Returns:
        A scalar, or the broadcast shape for ``'none'``. dtype as ``F.kl_div`` returns it:
        ``input`` and ``target`` promoted as torch (``kl_div(float32, float64)`` is float64);
        float32 for half input under autocast.

    Raises:
        ValueError: ``reduction`` is not one of the above.
        TypeError: ``input``/``target`` is not a tensor; ``log_target`` is not a bool.
        RuntimeError: ``input``/``target`` is an integer, bool or complex tensor (torch's
            error); the shapes do not broadcast (the message names both).
        ValueError: ``mask`` does not broadcast to the unreduced loss (TypeError: not bool).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import stablelosses.functional as SF
        >>> logq = torch.tensor([[0.0, float("-inf")]], requires_grad=True)
        >>> p = torch.tensor([[1.0, 0.0]])
        >>> F.kl_div(logq, p, reduction="batchmean")
        tensor(nan, grad_fn=<DivBackward0>)
        >>> loss = SF.kl_div(logq, p, reduction="batchmean")
        >>> loss
        tensor(0., grad_fn=<DivBackward0>)
        >>> loss.backward()
        >>> logq.grad
        tensor([[-1., 0.]])

    Replaces ``torch.nn.functional.kl_div``.
    """
    fn = "kl_div"
    _check_real(fn, "input", input)
    _check_real(fn, "target", target)
    _check_broadcast(fn, input, target, ("input", "target"))  # torch's words name no argument
    if legacy or ((reduction is None or type(reduction) is bool) and log_target is not _FALSE):
        reduction, log_target, size_average, reduce = _legacy_positional(  # type: ignore[assignment]
            fn, reduction, log_target, legacy, size_average, reduce)
    if log_target is _FALSE:
        log_target = False
    # As F.kl_div: the deprecated flags pick the base reduction (with torch's warning) and
    # ``reduction`` is not checked then (torch ignores it: reduce=False, reduction="bogus" is
    # 'none'), but 'batchmean' still divides the result by input.size(0) afterwards (torch keeps
    # that quirk).
    if size_average is not None or reduce is not None:
        log_target = check_flag(fn, "log_target", log_target)
        base = legacy_reduction(size_average, reduce, "mean")
        reduction = reduction if isinstance(reduction, str) else "mean"
        warn_mean = False
    else:
        # torch's warning; not for the deprecated 'elementwise_mean'
        warn_mean = isinstance(reduction, str) and reduction == "mean"
        reduction, log_target = check_kl_div_args(fn, reduction, log_target)
        base = "sum" if reduction == "batchmean" else reduction
    if warn_mean and not torch.compiler.is_compiling():
        warnings.warn(
            "reduction: 'mean' divides the total loss by both the batch size and the support size."
            "'batchmean' divides only by the batch size, and aligns with the KL div math definition."
            "'mean' will be changed to behave the same as 'batchmean' in the next major release.",
            stacklevel=2,
        )
    # type promotion as torch: kl_div(float32, float64) is float64 (half precision computed in float32)
    work, out_dtype = operand_dtypes(input, target)
    x, t = input.to(work), target.to(work)
    if mask is not None:
        return cast(_kl_div_masked(x, t, log_target, mask, base, reduction), out_dtype)
    loss = _KLDiv.call(x, t, log_target)
    loss = _reduce(loss, base)
    if reduction == "batchmean" and input.dim() != 0:
        loss = loss / input.size(0)
    return cast(loss, out_dtype)
