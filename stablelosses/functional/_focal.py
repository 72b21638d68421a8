r"""focal_loss: the multi-class focal loss on logits (class-index targets), sharing
``cross_entropy``'s argument checks, row masks and reduction."""

from __future__ import annotations

from torch import Tensor

from stablelosses._spec import check_finite_nonnegative, check_int, check_normalizer, check_reduction
from stablelosses.functional._cross_entropy import _index_targets, kernels_or_no_classes


def check_focal_loss_args(
    fn: str, reduction: object, gamma: object, ignore_index: object
) -> tuple[str, float, int]:
    """``(reduction, gamma, ignore_index)`` checked (also by ``FocalLoss`` at construction)."""
    return (check_reduction(fn, reduction), check_finite_nonnegative(fn, "gamma", gamma),
            check_int(fn, "ignore_index", ignore_index, tensor=True))


def focal_loss(
    input: Tensor,
    target: Tensor,
    gamma: float = 2.0,
    weight: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    mask: Tensor | None = None,
    normalizer: float | Tensor | None = None,
) -> Tensor:
    r"""Multi-class focal loss on logits, with a finite gradient for every $\gamma \ge 0$.

    With $\log p_t = \operatorname{log\_softmax}(x)_t$ at the target class and
    $1 - p_t = \sum_{j \ne t} p_j$ (the other classes' probabilities, summed: no cancellation as
    $p_t \to 1$, where $\log p_t = \operatorname{log1p}(-\sum_{j \ne t} p_j)$),

    $$
    \ell_i = w_{t_i}\, (1 - p_{i,t_i})^{\gamma}\, (-\log p_{i,t_i}),
    $$

    and $\ell_i = 0$ when $t_i$ is `ignore_index` or every logit of row $i$ is $-\infty$.
    Reductions: `'none'` $(\ell_i)_i$; `'sum'` $\sum_i \ell_i$; `'mean'`
    $\sum_i \ell_i / \sum_{i\ \text{valid}} w_{t_i}$ — the same weights and denominator as
    `cross_entropy`, so `gamma=0` equals `cross_entropy` exactly.

    **Gradient**: with $r = -\log p_t / (1 - p_t)$,

    $$
    \frac{\partial \ell_i}{\partial x_{i,c}}
      = w_{t_i} (1 - p_t)^{\gamma} (1 + \gamma\, p_t\, r)\,(p_{i,c} - [c = t_i]),
    $$

    which groups the textbook factor $(1 - p_t)^{\gamma - 1}(-\log p_t)$ as
    $(1 - p_t)^\gamma r$, finite for every $\gamma \ge 0$. Defined values: $r = 1$ at
    $p_t = 1$ (its limit), so the gradient there is 0 for $\gamma > 0$; $p_t r = 0$ at
    $p_t = 0$ (target logit $-\infty$: the loss is $+\infty$, the gradient finite).
    Masked classes, fully masked rows, `finfo.min` rows, $+\infty$ and NaN logits behave as
    in `cross_entropy`.

    **Exact tails.** $1 - p_t$ is computed as $\sum_{j \ne t} p_j$ and
    $\log p_t = \operatorname{log1p}(-\sum_{j \ne t} p_j)$ where $p_t > 1/2$, so the loss and
    its gradient keep full relative accuracy in float32 at margins 15–30 (where the classic
    snippet's $1 - p_t$ rounds to 0). Second derivatives are finite at $p_t = 1$ and on
    $+\infty$ rows (every singular operand behind a double `where`).

    **Weight gradient.** A `weight` that requires grad gets the gradient of the reduced loss,
    the `'mean'` denominator included. Forward-mode AD is supported.

    **Mask.** ``mask`` (bool, True = counts) broadcastable to ``target`` drops rows exactly as in
    `cross_entropy`: a False row is an ignored row whose logits and target are never read;
    ``'mean'`` divides by $\sum_{i \in K} w_{t_i}$ over the kept rows and gives 0 when that is
    empty. ``mask=None`` adds nothing to the graph.

    Args:
        input: logits of shape $(C)$, $(N, C)$ or $(N, C, d_1, \dots)$; float16 and bfloat16
            are computed in float32.
        target: class indices (int64 or uint8) of shape $()$, $(N)$ or $(N, d_1, \dots)$.
        gamma: focusing parameter $\gamma \ge 0$ (a Python number). Default: `2.0`.
        weight: per-class weight of shape $(C)$. Default: `None`.
        ignore_index: target value that contributes nothing. Default: `-100`.
        reduction: `'none'` | `'mean'` | `'sum'`. Default: `'mean'`.
        mask: bool tensor, True = counts, broadcastable to ``target`` (keyword-only);
            ``None``: every entry counts. Default: ``None``.
        normalizer: replaces the denominator of ``'mean'`` (keyword-only), as in
            `cross_entropy`: a number $\ge 0$ or a 0-dim tensor; 0 gives 0 with gradient 0.
            Default: ``None``.

    Returns:
        The loss: shape of `target` for `'none'`, else a scalar; dtype of `input` (float32 for
        float16/bfloat16 inside autocast).

    Raises:
        ValueError: `reduction` not `'none'`, `'mean'` or `'sum'`; `gamma` negative, infinite
            or NaN; target whose batch size differs from the input's.
        TypeError: `gamma` not a number; `ignore_index` not an int; `input` not floating
            point.
        RuntimeError: target of another wrong shape; `weight` not of shape $(C)$; target not
            int64/uint8.
        IndexError: a class index out of range, as torch (`Target 3 is out of bounds.`).
        ValueError: ``mask`` does not broadcast to the unreduced loss (TypeError: not bool);
            ``normalizer`` negative, infinite, NaN or a tensor that is not 0-dim, or given with a
            ``reduction`` other than ``'mean'``.

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> x = torch.tensor([[10.0, -200.0]], requires_grad=True)
        >>> p = torch.softmax(x, dim=1)  # the classic FocalLoss snippet
        >>> (-(1 - p[:, 0]) ** 0.5 * torch.log(p[:, 0])).sum().backward()
        >>> x.grad
        tensor([[nan, nan]])
        >>> x.grad = None
        >>> SF.focal_loss(x, torch.tensor([0]), gamma=0.5).backward()
        >>> x.grad.abs()  # the limit: p_t = 1 exactly in float32
        tensor([[0., 0.]])

    Replaces the hand-written softmax → log `FocalLoss` snippet and `kornia.losses.focal_loss`.
    """
    fn = "focal_loss"
    reduction, gamma, ignore_index = check_focal_loss_args(fn, reduction, gamma, ignore_index)
    normalizer = check_normalizer(fn, normalizer, reduction)
    cdim, early = kernels_or_no_classes(fn, focal_loss, input, target, weight, mask, ignore_index,
                                        reduction, gamma, 0.0, normalizer)
    if early is not None:
        return early
    return _index_targets(fn, input, target, weight, mask, ignore_index, gamma, 0.0, cdim, reduction,
                          normalizer)
