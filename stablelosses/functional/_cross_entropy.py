r"""cross_entropy, and the class-argument checks, row masks and reduction it shares with ``focal_loss``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from stablelosses import _backend
from stablelosses._autograd.cross_entropy import (
    IndexResult,
    ProbResult,
    _ClassIndexCE,
    _IndexLoss,
    _ProbLoss,
)
from stablelosses._spec import check_int, check_label_smoothing, check_normalizer, check_torch_reduction
from stablelosses._utils import (
    cast,
    check_floating,
    check_tensor,
    divide,
    legacy_reduction,
    loss_out_dtype,
    operand_dtypes,
    take,
    upcast,
)
from stablelosses._utils import reduce as _reduce  # cross_entropy has a parameter named reduce
from stablelosses.functional._masked import check_mask
from stablelosses.functional._torch_losses import scalar_type

_INDEX_DTYPES = (torch.int64, torch.uint8)


def check_cross_entropy_args(
    fn: str, reduction: object, label_smoothing: object, ignore_index: object
) -> tuple[str, float, int]:
    """``(reduction, label_smoothing, ignore_index)`` checked (also by ``CrossEntropyLoss`` at
    construction)."""
    return (check_torch_reduction(fn, reduction), check_label_smoothing(fn, label_smoothing),
            check_int(fn, "ignore_index", ignore_index, tensor=True))


def _class_dim(fn: str, input: Tensor) -> int:
    if input.dim() == 0:
        raise ValueError(f"{fn}: input must have a class dimension, got a 0-d tensor")
    return 0 if input.dim() == 1 else 1


def _check_weight(fn: str, weight: Tensor | None, input: Tensor, dtype: torch.dtype) -> Tensor | None:
    if weight is None:
        return None
    check_floating(fn, "weight", weight)
    n_classes = input.shape[_class_dim(fn, input)]
    if weight.dim() != 1 or weight.shape[0] != n_classes:
        raise RuntimeError(
            f"{fn}: weight tensor should be defined either for all {n_classes} classes or no "
            f"classes but got weight tensor of shape: {list(weight.shape)}"
        )
    return weight.to(dtype)


def _check_index_target(fn: str, input: Tensor, target: Tensor, cdim: int) -> None:
    if target.dtype not in _INDEX_DTYPES:
        raise RuntimeError(
            f"{fn}: expected target dtype to be Long or Byte (class indices) or the input's "
            f"shape (class probabilities), but got {target.dtype} of shape {list(target.shape)}"
        )
    expected = input.shape[:cdim] + input.shape[cdim + 1 :]
    if target.shape != expected:
        # torch: a batch-size mismatch is a ValueError, any other shape a RuntimeError
        batch = cdim == 1 and target.dim() >= 1 and target.shape[0] != input.shape[0]
        error = ValueError if batch else RuntimeError
        # torch's words in parentheses (its tests match them)
        if batch:
            words = (f"Expected input batch_size ({input.shape[0]}) to match target batch_size "
                     f"({target.shape[0]})")
        else:
            words = f"Expected target size {list(expected)}, got {list(target.shape)}"
        raise error(
            f"{fn}: target of class indices must have shape {list(expected)} for input of "
            f"shape {list(input.shape)}, got {list(target.shape)} ({words})"
        )


def _index_loss_reduced(
    x: Tensor, target: Tensor, w: Tensor | None, ignore_index: int, gamma: float, eps: float,
    cdim: int, reduction: str, mask: Tensor | None = None, normalizer: Tensor | float | None = None,
) -> Tensor:
    """Run ``_IndexLoss`` and reduce (``normalizer``, when given, replaces the mean's
    denominator); the mean's denominator ``Σ w_t`` is differentiable in
    ``w``, so ``weight.grad`` is the gradient of the reduced loss. A masked-out row (``mask``
    expanded to the target's shape) is an ignored row."""
    target = cast(target, torch.int64)
    if mask is not None:
        target = torch.where(mask, target, ignore_index)
    if eps == 0.0:
        ignored = target == ignore_index
        # any in-range index serves the ignored targets; the others out of range raise in
        # the Function's nll_loss first, with torch's message
        idx = target.clamp(0, x.shape[cdim] - 1)
        loss, invalid = _ClassIndexCE.call(x, target, idx, ignored, w, ignore_index, gamma, cdim, False)[:2]
        if reduction != "mean":
            return _reduce(loss, reduction)
        denom = ~invalid if w is None else take(w, idx).masked_fill(invalid, 0.0)
        return _reduce(loss, reduction, weight=denom, masked=mask is not None, normalizer=normalizer)
    idx = torch.where(target != ignore_index, target, 0)
    assert gamma == 0.0  # the focal loss has no smoothing
    res = IndexResult(*_IndexLoss.call(x, target, idx, w, ignore_index, eps, cdim))
    if reduction != "mean":
        return _reduce(res.loss, reduction)
    denom = res.valid.to(x.dtype) if w is None else torch.where(res.valid, take(w, idx), 0.0)
    return _reduce(res.loss, reduction, weight=denom, masked=mask is not None, overflow_safe=True,
                   normalizer=normalizer)


def _no_classes(
    input: Tensor, target: Tensor, weight: Tensor | None, mask: Tensor | None,
    ignore_index: int, reduction: str, eps: float,
) -> Tensor:
    """Zero classes: no logit to be stable about, so torch's own kernel gives torch's value,
    NaN or error for every shape (``IndexError`` for any class index, ``nan`` for an empty
    ``'mean'``). A ``mask`` keeps its empty-denominator rule (0, as ``masked_mean``)."""
    if mask is not None and not target.is_floating_point():
        target = torch.where(mask.to(torch.bool), target.long(), ignore_index)
    out = torch.nn.functional.cross_entropy(
        input, target, weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=eps
    )
    if mask is not None and reduction == "mean":
        out = torch.nan_to_num(out, nan=0.0)
    return out


def kernels_or_no_classes(
    fn: str, torch_path: Callable[..., Tensor], input: Tensor, target: Tensor, weight: Tensor | None,
    mask: Tensor | None, ignore_index: int, reduction: str, param: float, eps: float, normalizer: Any,
) -> tuple[int, Tensor | None]:
    """The start shared by the class-index losses (``fn``: ``cross_entropy``, ``focal_loss``),
    after their argument checks: the tensors checked, the class dimension, then the kernels'
    result (``param``: their smoothing or gamma) or, with zero classes, torch's (``eps``: the
    smoothing). Returns the class dimension and that result, ``None`` when the torch path runs."""
    check_floating(fn, "input", input)
    check_tensor(fn, "target", target)
    cdim = _class_dim(fn, input)
    if normalizer is None:  # the kernels know no normalizer
        out = _backend.dispatch(  # the kernels when selected (stablelosses.set_backend), else None
            fn, input, target, weight, ignore_index, reduction, param, mask, torch_path=torch_path)
        if out is not None:
            return cdim, out
    if input.shape[cdim] == 0:
        if normalizer is not None:  # the sum over no classes, divided
            total = _no_classes(input, target, weight, mask, ignore_index, "sum", eps)
            return cdim, divide(total, normalizer)
        return cdim, _no_classes(input, target, weight, mask, ignore_index, reduction, eps)
    return cdim, None


def _mask_rows(fn: str, mask: object, x: Tensor, cdim: int) -> tuple[Tensor, Tensor]:
    """The row mask expanded to the unreduced loss's shape, and ``x`` with its masked-out rows
    replaced by 0 (select, do not multiply: a NaN there is never read)."""
    shape = x.shape[:cdim] + x.shape[cdim + 1 :]
    m = check_mask(fn, mask, shape, "the unreduced loss", device=x.device).to(x.device).expand(shape)
    return m, torch.where(m.unsqueeze(cdim), x, 0.0)


def _index_targets(
    fn: str, input: Tensor, target: Tensor, weight: Tensor | None, mask: Tensor | None,
    ignore_index: int, gamma: float, eps: float, cdim: int, reduction: str,
    normalizer: Tensor | float | None = None,
) -> Tensor:
    """Class-index targets: cross_entropy (``gamma = 0``) and focal_loss (``eps = 0``)."""
    if input.dim() == 1 and target.dim() == 1:
        # torch's nll_loss takes a (1,) target for a (C,) input as the 0-d one (a 0-d loss)
        if target.shape[0] != 1:
            raise ValueError(f"{fn}: target of class indices for a 1-D input must be 0-d or of shape [1] "
                             f"(For 1D input, 1D target must have size 1, but got target size: "
                             f"{target.shape[0]})")
        target = target.reshape(())
    _check_index_target(fn, input, target, cdim)
    x = upcast(input)
    w = _check_weight(fn, weight, input, x.dtype)
    rows: Tensor | None = None
    if mask is not None:
        rows, x = _mask_rows(fn, mask, x, cdim)
    out = _index_loss_reduced(x, target, w, ignore_index, gamma, eps, cdim, reduction, rows, normalizer)
    return cast(out, loss_out_dtype(input))


def cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    size_average: bool | None = None,
    reduce: bool | None = None,
    mask: Tensor | None = None,
    normalizer: float | Tensor | None = None,
) -> Tensor:
    r"""Cross-entropy between logits and class indices or class probabilities, masked-class safe.

    With $\log p = \operatorname{log\_softmax}(x)$ over the class dimension, smoothing
    $\varepsilon$ and, for row $i$, $U_i$ the set of its $K_i$ unmasked classes (logit
    $\neq -\infty$), class-index targets $t_i$ give

    $$
    \ell_i = (1 - \varepsilon)\, w_{t_i} (-\log p_{i,t_i})
             + \frac{\varepsilon}{K_i} \sum_{c \in U_i} w_c (-\log p_{i,c}),
    $$

    and $\ell_i = 0$ when $t_i$ is `ignore_index` or every logit of row $i$ is $-\infty$.
    Class-probability targets $y$ give
    $\ell_i = -\sum_c w_c\, q_{i,c} \log p_{i,c}$ with
    $q_{i,c} = (1 - \varepsilon) y_{i,c} + [c \in U_i]\, \varepsilon / K_i$, a term with
    $q_{i,c} = 0$ counting as 0 (also where $\log p_{i,c} = -\infty$). Without masked classes
    $K_i = C$ and this is exactly `torch.nn.functional.cross_entropy`. Reductions:

    $$
    \text{none}: (\ell_i)_i, \qquad \text{sum}: \sum_i \ell_i, \qquad
    \text{mean}: \frac{\sum_i \ell_i}{\sum_{i\ \text{valid}} w_{t_i}}
    \ \Big(\text{probabilities: } \frac{\sum_i \ell_i}{\#\{i\ \text{valid}\}}\Big),
    $$

    where a row is valid unless it is ignored or fully masked; an empty (or fully ignored)
    batch gives `nan` for `'mean'`, as torch
    (with a `mask`: 0, see **Mask**).

    **Gradient**: $\partial \ell_i / \partial x_{i,c} = p_{i,c} \sum_k q_{i,k} - q_{i,c}$
    (softmax minus the weighted target distribution), computed from the saved
    log-probabilities. Defined values at the singular points:

    - masked class ($x_{i,c} = -\infty$): gradient 0, no smoothing mass;
    - fully masked row (all $-\infty$): loss 0, not counted in the mean, gradient exactly 0;
    - target class masked: the loss is $+\infty$ (as torch), the gradient stays finite
      ($p - q$);
    - $+\infty$ logits: the limit — the row's probability is uniform over its $+\infty$
      entries, every other class gets probability 0 (log-probability $-\infty$); the gradient
      is finite (a class at exactly `finfo.max` in such a row counts as one of them);
    - NaN logits give a NaN loss and gradient for their row.

    Hazard rows are read off the row maximum: only a row whose logits are **all** $-\infty$ is
    fully masked. A finite fill value is an ordinary number — a row of `torch.finfo(dtype).min`
    (the usual `masked_fill` idiom) gives torch's value $\log C$ and torch's gradient.

    **Weight gradient.** A `weight` that requires grad gets the gradient of the returned loss:
    for probability targets torch's; for class-index targets (where torch raises) the true
    gradient of the reduced loss, the `'mean'` denominator $\sum_i w_{t_i}$ included.

    **Overflow.** With smoothing the per-class terms are scaled by $\varepsilon/K_i$ before they
    are summed, and `'mean'` divides each term by the denominator when $\sum_i \ell_i$ itself
    overflows, so logits near $\pm 10^{37}$ give a finite loss whenever the exact value is
    representable (torch: `inf`). Without smoothing `'mean'` is torch's $\sum_i \ell_i / \sum_i
    w_{t_i}$: `inf` where that sum overflows (two rows of loss `2e38` in float32), as torch.

    Forward-mode AD (`torch.func.jvp`, `jacfwd`, `hessian`, `torch.autograd.forward_ad`) is
    supported; mixed dtypes promote as torch (float32 logits with float64 probabilities give
    float64).

    **Mask.** ``mask`` (bool, True = counts) broadcastable to the unreduced loss (``input``
    without its class dimension) drops rows: a False row is an ignored row (loss 0, gradient 0,
    not in the denominator) whose logits and target are never read (an out-of-range index or a
    NaN there does no harm). ``'mean'`` is $\sum_{i \in K} \ell_i / \sum_{i \in K} w_{t_i}$ over
    the kept rows $K$ (mask True, not `ignore_index`, not fully masked), with probability
    targets $\sum_{i \in K} \ell_i / |K|$; with a mask an empty denominator gives **0** with
    gradient 0 (as [`masked_mean`][stablelosses.functional.masked_mean]), not torch's NaN.
    ``mask=None`` adds nothing to the graph.

    Args:
        input: logits of shape $(C)$, $(N, C)$ or $(N, C, d_1, \dots)$; float16 and bfloat16
            are computed in float32.
        target: class indices (int64 or uint8) of shape $()$, $(N)$ or $(N, d_1, \dots)$, or
            class probabilities with the shape of `input`.
        weight: per-class weight of shape $(C)$. Default: `None`.
        ignore_index: class-index target value that contributes nothing (index targets only).
            Default: `-100`.
        reduction: `'none'` | `'mean'` | `'sum'`. Default: `'mean'`.
        label_smoothing: $\varepsilon \in [0, 1]$. Default: `0.0`.
        size_average: deprecated alias (as in torch); overrides `reduction` when given.
        reduce: deprecated alias (as in torch); overrides `reduction` when given.
        mask: bool tensor, True = counts, broadcastable to the unreduced loss's shape (keyword-only);
            ``None``: every entry counts. Default: ``None``.
        normalizer: replaces the denominator of ``'mean'`` (keyword-only): a number $\ge 0$ or a
            0-dim tensor, e.g. the token count over gradient accumulation and ranks; a zero
            normalizer (a fully ignored batch) gives 0 with gradient 0, with no host sync
            (see the normalizer page). Default: ``None``.

    Returns:
        The loss: shape of `target` (index targets) or `input` without its class dimension
        for `'none'`, else a scalar; dtype of `input` (float32 for float16/bfloat16 inside
        autocast, as the built-in).

    Raises:
        ValueError: `reduction` is not `'none'`, `'mean'` or `'sum'`; index target whose
            batch size differs from the input's (as torch).
        RuntimeError: index target of another wrong shape (as torch); `weight` not of shape
            $(C)$; target of the wrong dtype; `label_smoothing`
            outside $[0, 1]$; probability targets with `ignore_index >= 0` (as torch).
        IndexError: a class index out of range, as torch (`Target 3 is out of bounds.`).
        TypeError: `input` not a floating-point tensor; `ignore_index` not an int;
            `label_smoothing` not a real number.
        ValueError: ``mask`` does not broadcast to the unreduced loss (TypeError: not bool);
            ``normalizer`` negative, infinite, NaN or a tensor that is not 0-dim, or given with a
            ``reduction`` other than ``'mean'``.

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> x = torch.tensor([[2.0, 0.5, float("-inf")], [float("-inf")] * 3], requires_grad=True)
        >>> t = torch.tensor([0, 1])
        >>> torch.nn.functional.cross_entropy(x, t, label_smoothing=0.1)  # torch: NaN
        tensor(nan, grad_fn=...)
        >>> loss = SF.cross_entropy(x, t, label_smoothing=0.1)
        >>> loss
        tensor(0.2764, grad_fn=...)
        >>> loss.backward()
        >>> x.grad
        tensor([[-0.1324,  0.1324,  0.0000],
                [ 0.0000,  0.0000,  0.0000]])

    Replaces `torch.nn.functional.cross_entropy` / `torch.nn.CrossEntropyLoss`.
    """
    fn = "cross_entropy"
    if size_average is not None or reduce is not None:
        reduction = legacy_reduction(size_average, reduce, reduction)
    reduction, eps, ignore_index = check_cross_entropy_args(fn, reduction, label_smoothing, ignore_index)
    normalizer = check_normalizer(fn, normalizer, reduction)
    cdim, early = kernels_or_no_classes(fn, cross_entropy, input, target, weight, mask, ignore_index,
                                        reduction, eps, eps, normalizer)
    if early is not None:
        return early
    if target.shape == input.shape:
        if not target.is_floating_point():
            raise RuntimeError(
                f"{fn}: Expected floating point type for target with class probabilities, "
                f"got {scalar_type(target.dtype)}"  # torch's words
            )
        if ignore_index >= 0:
            raise RuntimeError(
                f"{fn}: ignore_index is not supported for floating point target, got "
                f"ignore_index={ignore_index} (use a negative value or class indices)"
            )
        # type promotion as torch: cross_entropy(float32, float64 probabilities) is float64
        work, out_dtype = operand_dtypes(input, target)
        x = input.to(work)
        w = _check_weight(fn, weight, input, x.dtype)
        y = target.to(x.dtype)
        if mask is None:
            res = ProbResult(*_ProbLoss.call(x, y, w, eps, cdim))
            out = _reduce(res.loss, reduction, weight=res.valid.to(x.dtype), overflow_safe=eps > 0.0,
                          normalizer=normalizer)
        else:
            m, x = _mask_rows(fn, mask, x, cdim)
            y = torch.where(m.unsqueeze(cdim), y, 0.0)
            res = ProbResult(*_ProbLoss.call(x, y, w, eps, cdim))
            kept = res.valid & m
            loss = torch.where(m, res.loss, 0.0)
            out = _reduce(loss, reduction, weight=kept.to(x.dtype), masked=True, overflow_safe=eps > 0.0,
                          normalizer=normalizer)
        return cast(out, out_dtype)
    return _index_targets(fn, input, target, weight, mask, ignore_index, 0.0, eps, cdim, reduction,
                          normalizer)
