r"""info_nce_loss: the in-batch contrastive loss of SimCLR/CLIP, finite for zero embeddings."""

from __future__ import annotations

import torch
from torch import Tensor

import stablelosses.functional as _functional
from stablelosses._autograd.vector import _Normalize
from stablelosses._spec import check_flag, check_reduction, check_temperature
from stablelosses._utils import cast, check_floating, operand_dtypes
from stablelosses.functional._masked import check_mask

_FN = "info_nce_loss"


def check_info_nce_args(fn: str, temperature: object, reduction: object, symmetric: object) -> tuple:
    """``(temperature, reduction, symmetric)`` checked (also by ``InfoNCELoss`` at construction)."""
    return (check_temperature(fn, temperature), check_reduction(fn, reduction),
            check_flag(fn, "symmetric", symmetric))


def info_nce_loss(
    query: Tensor,
    key: Tensor,
    temperature: float | Tensor = 0.07,
    *,
    reduction: str = "mean",
    symmetric: bool = False,
    mask: Tensor | None = None,
) -> Tensor:
    r"""In-batch InfoNCE (NT-Xent) loss on cosine similarities; zero embeddings stay finite.

    Row $i$ of ``query`` and row $i$ of ``key`` are a positive pair; the other rows of ``key``
    are the negatives. With $\hat q = q/\lVert q\rVert$, $\hat k = k/\lVert k\rVert$ and
    $L = \hat q \hat k^{\top} / \tau$,

    $$ \ell_i = -\log \frac{\exp L_{ii}}{\sum_j \exp L_{ij}}
       = \operatorname{cross\_entropy}(L, [0, 1, \dots, N-1])_i , $$

    and with ``symmetric=True`` (CLIP) $\tfrac12\big(\ell_i(L) + \ell_i(L^{\top})\big)$.
    The unit vectors come from [`normalize`][stablelosses.functional.normalize] (scaled norms,
    zero vector → 0) and the loss from [`cross_entropy`][stablelosses.functional.cross_entropy].

    A zero embedding (collapse, a padded row) has no direction: its row of logits is 0, its
    loss is $\log N$, and it gets gradient **0**. All-zero embeddings give $\log N$ with zero
    gradients. The hand-written ``F.normalize(q) @ F.normalize(k).T`` gives such a row a
    gradient of order $10^{12}$; ``q @ k.T / (q.norm() * k.norm())`` gives NaN.

    **Gradient.** Autograd of the formula through the defined gradients of ``normalize`` and
    ``cross_entropy``; 0 for a zero embedding.

    **Mask.** ``mask`` (bool, True = counts) broadcastable to $(N)$ drops pairs: a False pair
    $i$ leaves the batch — it is no anchor, and its key (and query) is no negative for the
    others — so ``'mean'``/``'sum'`` equal the loss of ``query[mask], key[mask]`` (0 with
    gradient 0 for an all-False mask) and ``'none'`` is 0 at dropped pairs. Dropped rows are
    never read: a NaN or zero embedding there does no harm. ``mask=None`` adds nothing.

    Args:
        query: embeddings $(N, D)$.
        key: embeddings $(N, D)$; ``key[i]`` is the positive of ``query[i]``.
        temperature: $\tau > 0$, a float or a 0-dim tensor. A learnable one
            (``requires_grad``) is not read (no host sync): a value that is not finite and
            $> 0$ gives NaN. Default: ``0.07``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'`` over the $N$ rows. Default: ``'mean'``.
        symmetric: average the query→key and key→query losses (CLIP). Default: ``False``.
        mask: bool tensor, True = counts, broadcastable to ``(N,)`` (keyword-only);
            ``None``: every entry counts. Default: ``None``.

    Returns:
        ``'none'``: shape $(N,)$; else a scalar. In the inputs' dtype (float16/bfloat16
        computed in float32).

    Raises:
        TypeError: an input is not floating point, or ``temperature``/``symmetric`` has the
            wrong type.
        ValueError: shapes other than two equal $(N, D)$, ``temperature <= 0``, or a bad
            ``reduction``.
        ValueError: ``mask`` does not broadcast to the unreduced loss (TypeError: not bool).

    Shape:
        ``query``, ``key``: $(N, D)$; output: $(N,)$ or $()$.

    Example:
        >>> import torch
        >>> from stablelosses.functional import info_nce_loss
        >>> q = torch.zeros(4, 8, requires_grad=True)
        >>> k = torch.randn(4, 8)
        >>> loss = info_nce_loss(q, k); loss
        tensor(1.3863, grad_fn=<...>)
        >>> loss.backward(); bool((q.grad == 0).all())
        True

    References:
        van den Oord et al., "Representation Learning with Contrastive Predictive Coding", 2018;
        Chen et al., "A Simple Framework for Contrastive Learning" (SimCLR), 2020; Radford et
        al., "Learning Transferable Visual Models From Natural Language Supervision" (CLIP), 2021.

    Replaces the hand-written ``F.cross_entropy(F.normalize(q) @ F.normalize(k).T / τ,
    torch.arange(N))`` (and its CLIP average over both directions).
    """
    q = check_floating(_FN, "query", query)
    k = check_floating(_FN, "key", key)
    if q.ndim != 2 or k.shape != q.shape:
        raise ValueError(
            f"{_FN}: query and key must both have shape (N, D), got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    tau, reduction, symmetric = check_info_nce_args(_FN, temperature, reduction, symmetric)
    work, out_dtype = operand_dtypes(q, k)
    qw, kw = q.to(work), k.to(device=q.device, dtype=work)
    m = None
    if mask is not None:
        # a masked-out pair leaves the batch: not an anchor, not a negative, never read
        m = check_mask(_FN, mask, q.shape[:1], "the per-sample loss", device=q.device)
        m = m.to(q.device).expand(q.shape[:1])
        qw, kw = torch.where(m[:, None], qw, 0.0), torch.where(m[:, None], kw, 0.0)
    uq, _ = _Normalize.call(qw, 2.0, 1, 0.0)
    uk, _ = _Normalize.call(kw, 2.0, 1, 0.0)
    logits = (uq @ uk.T) / tau
    if m is not None:
        logits = torch.where(m[:, None] & m[None, :], logits, float("-inf"))
    labels = torch.arange(q.shape[0], device=q.device)
    loss = _functional.cross_entropy(logits, labels, reduction=reduction, mask=m)
    if symmetric:
        loss = (loss + _functional.cross_entropy(logits.T, labels, reduction=reduction, mask=m)) / 2
    return cast(loss, out_dtype)
