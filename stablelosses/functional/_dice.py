r"""dice_loss: the soft Dice loss, 0 with gradient 0 when prediction and target are both empty."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from stablelosses._autograd.dice import _Dice
from stablelosses._spec import check_dims, check_finite_nonnegative, check_reduction
from stablelosses._utils import (
    broadcasts_to,
    cast,
    check_floating,
    check_tensor,
    operand_dtypes,
    reduce,
    wrap_dims,
)
from stablelosses.functional._masked import check_mask

_FN = "dice_loss"


def check_dice_args(fn: str, dims: object, reduction: object, smooth: object) -> tuple[str, float]:
    """``(reduction, smooth)`` checked, and what of ``dims`` needs no input (ints, not an empty
    list; its range is checked against the input): also by ``DiceLoss`` at construction."""
    check_dims(fn, "dims", dims, empty=False, optional=True)
    return check_reduction(fn, reduction), check_finite_nonnegative(fn, "smooth", smooth)


def _dice_dims(dims: object, ndim: int) -> tuple[int, ...]:
    if dims is None:
        if ndim < 2:
            raise ValueError(
                f"{_FN}: input must have a batch dimension and at least one more, (N, *), got "
                f"{ndim} dimension(s); pass dims= to choose the dimensions to sum over"
            )
        return tuple(range(1, ndim))
    return wrap_dims(_FN, dims, ndim, "dims", allow_empty=False)


def _mask_samples(
    mask: object, p: Tensor, t: Tensor, reduce_dims: tuple[int, ...]
) -> tuple[Tensor, Tensor, Tensor]:
    """The sample mask (checked against the per-sample loss's shape) and ``p``, ``t`` with the
    masked-out samples replaced by 0 (select, do not multiply: a NaN there is never read)."""
    shape = torch.Size(n for d, n in enumerate(p.shape) if d not in reduce_dims)
    m = check_mask(_FN, mask, shape, "the per-sample loss", device=p.device).to(p.device).expand(shape)
    m_in = m
    for d in sorted(reduce_dims):
        m_in = m_in.unsqueeze(d)
    return m, torch.where(m_in, p, 0.0), torch.where(m_in, t, 0.0)


def dice_loss(
    input: Tensor,
    target: Tensor,
    *,
    dims: int | Sequence[int] | None = None,
    smooth: float = 0.0,
    reduction: str = "mean",
    mask: Tensor | None = None,
) -> Tensor:
    r"""Soft Dice loss on probabilities; prediction and target both empty gives 0 with gradient 0.

    Per sample, summing over ``dims`` (default: every dimension but the first, the batch):

    $$
    \ell = 1 - \frac{2\sum p\,t + s}{\sum p + \sum t + s}
         = \frac{\sum \big(p(1 - t) + t(1 - p)\big)}{\sum p + \sum t + s},
    $$

    evaluated in the second form, so a near-perfect prediction keeps its small loss to full
    relative precision (``1 − ratio`` would round it to 0). ``'mean'``/``'sum'`` then reduce over
    the samples, ``'none'`` returns them.

    With ``smooth = 0`` (the default, the exact Dice loss) a sample whose prediction and target
    are both empty ($\sum p + \sum t = 0$) gives **0**: both are the empty set, a perfect match
    (``1 − 0/0`` is NaN in the hand-written formula). With ``smooth > 0`` it is the smoothed
    formula above everywhere (both empty: $s/s$, loss 0), MONAI's convention (``smooth_nr =
    smooth_dr = s``).

    **segmentation_models_pytorch.** smp's ``DiceLoss`` differs in three ways. It scores
    each class over the whole batch (sums over the batch and the pixels, ``dims=(0, 2)`` on
    ``(N, C, H·W)``), where this scores each sample. Its ``smooth`` enters as
    $(I + s)/(\tfrac12(\sum p + \sum t) + s)$ since smp 0.4 (a Tversky score with
    $\alpha = \beta = \tfrac12$), which is ``smooth=2s`` here ($I = \sum p\,t$ for a 0/1
    target). And it zeroes the loss of a class with no target pixel, then averages over all the
    classes. With probabilities ``p`` and a 0/1 target ``t`` of shape $(N, C, *)$, smp's
    ``DiceLoss(mode, from_logits=False, smooth=s)(p, t)`` is (up to its ``eps = 1e-7``
    floor on the denominator):

    ```python
    (dice_loss(p.movedim(1, 0), t.movedim(1, 0), smooth=2 * s, reduction="none")
     * (t.movedim(1, 0).flatten(1).sum(1) > 0)).mean()
    ```

    **Gradient.** $\partial\ell/\partial p_i = \big((1 - 2t_i) - \ell\big)/D$ with
    $D = \sum p + \sum t + s$ (and the same with $p$ and $t$ swapped for ``target``), formed as
    one quotient (autograd of the ratio forms $(1 - 2t_i)/D$ and $-\ell/D$ apart: each overflows
    for a subnormal $D$, and their sum is NaN where the gradient is 0); on a both-empty sample
    with ``smooth = 0`` both gradients are defined as **0** (a double ``where``, so double
    backward is finite too). NaN propagates.

    **Mask.** ``mask`` (bool, True = counts) broadcastable to the per-sample loss (``input``
    without ``dims``) selects samples: ``'mean'`` averages the kept samples' losses (0 with
    gradient 0 when none is kept), ``'sum'`` sums them, ``'none'`` is 0 at dropped samples.
    A dropped sample's ``input`` and ``target`` are never read (selected away, not multiplied
    by 0), so a NaN there reaches neither value nor gradient. ``mask=None`` adds nothing.

    Args:
        input: predicted probabilities (e.g. ``sigmoid`` / ``softmax`` outputs), $(N, *)$.
        target: target probabilities or a 0/1 mask (bool or integer is cast), broadcastable
            to ``input``.
        dims: dimension(s) summed per sample. Default: all but dim 0.
        smooth: added to numerator and denominator. Default: ``0.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        mask: bool tensor, True = counts, broadcastable to the per-sample loss's shape (keyword-only);
            ``None``: every entry counts. Default: ``None``.

    Returns:
        ``'none'``: ``input``'s shape without ``dims``; else a scalar. In the promoted dtype of
        ``input`` and ``target`` (float16/bfloat16 computed in float32).

    Raises:
        TypeError: ``input`` is not floating point or ``target`` is not a tensor.
        ValueError: bad ``reduction``, ``smooth`` negative, infinite or NaN, ``dims`` empty or
            repeated, input without a batch dimension, or ``target`` does not broadcast to
            ``input``.
        IndexError: a dimension in ``dims`` is out of range.
        ValueError: ``mask`` does not broadcast to the unreduced loss (TypeError: not bool).

    Shape:
        ``input``: $(N, *)$; ``target``: broadcastable to it; output: $(N,)$ for ``'none'``
        with the default ``dims``, else $()$.

    Example:
        >>> import torch
        >>> from stablelosses.functional import dice_loss
        >>> p = torch.zeros(1, 4, requires_grad=True)
        >>> t = torch.zeros(1, 4)
        >>> 1 - 2 * (p * t).sum() / (p.sum() + t.sum())
        tensor(nan, grad_fn=<RsubBackward1>)
        >>> dice_loss(p, t).backward(); p.grad
        tensor([[0., 0., 0., 0.]])

    References:
        Milletari et al., "V-Net", 2016; Sudre et al., "Generalised Dice overlap as a deep
        learning loss function", 2017.

    Replaces ``segmentation_models_pytorch.losses.DiceLoss`` / ``monai.losses.DiceLoss``
    (probability inputs, per-sample) and the hand-written ``1 − 2Σpt/(Σp + Σt)``.
    """
    x = check_floating(_FN, "input", input)
    t = check_tensor(_FN, "target", target)
    reduction, s = check_dice_args(_FN, dims, reduction, smooth)
    reduce_dims = _dice_dims(dims, x.ndim)
    if not broadcasts_to(t.shape, x.shape):
        raise ValueError(
            f"{_FN}: target of shape {tuple(t.shape)} does not broadcast to input of shape {tuple(x.shape)}"
        )
    # a bool/integer target takes the input's dtype; a float one joins it
    work, out_dtype = operand_dtypes(x, t if t.is_floating_point() else x)
    p = x.to(work)
    tt = t.to(device=x.device, dtype=work).expand(x.shape)
    m = None
    if mask is not None:
        m, p, tt = _mask_samples(mask, p, tt, reduce_dims)
    loss = _Dice.call(p, tt, reduce_dims, s)[0]
    return cast(reduce(loss, reduction, m), out_dtype)
