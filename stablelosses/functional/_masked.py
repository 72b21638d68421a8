r"""masked_mean and entropy, and the masked reduction the losses' ``mask=`` argument uses."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from stablelosses._autograd.masked import _Entropy
from stablelosses._spec import check_flag
from stablelosses._utils import (
    broadcasts_to,
    check_floating,
    check_same_device,
    masked_mean_over,
    upcast,
    wrap_dim,
    wrap_dims,
)


def check_mask(
    fn: str, mask: object, shape: torch.Size, what: str = "input", device: torch.device | None = None
) -> Tensor:
    """Raise unless ``mask`` is a bool tensor that broadcasts to ``shape`` (without growing it)
    and, with ``device``, lives there (a 0-dim CPU mask may go with any device, as a CPU scalar
    tensor does in torch's ops): a mask is never moved between devices silently."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{fn}: mask must be a bool torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{fn}: mask must have dtype torch.bool (True = counts), got {mask.dtype}")
    if not broadcasts_to(mask.shape, shape):
        raise ValueError(
            f"{fn}: mask of shape {tuple(mask.shape)} does not broadcast to {what} of shape {tuple(shape)}"
        )
    if device is not None:
        check_same_device(fn, mask, device, what)
    return mask


def _dims(fn: str, dim: object, ndim: int) -> tuple[int, ...]:
    return tuple(range(ndim)) if dim is None else wrap_dims(fn, dim, ndim)


def masked_mean(input: Tensor, mask: Tensor, dim: int | Sequence[int] | None = None,
                keepdim: bool = False) -> Tensor:
    r"""Mean of the entries where ``mask`` is True; a slice with no True entry gives 0.

    $$ \operatorname{masked\_mean}(x, m) = \frac{\sum_i m_i x_i}{\max\!\big(1, \sum_i m_i\big)} $$

    The idiom ``(x * mask).sum() / mask.sum()`` is ``0/0`` = NaN for an empty mask (a batch
    with no valid token, an episode with no valid step) and ``x * mask`` still reads the
    masked entries (``nan * 0`` = NaN from garbage in padding). Here an empty slice gives
    **0**: there is nothing to average, so it adds nothing to a loss. False entries are not
    read: a NaN there does not propagate; a NaN in a True entry does.

    **Gradient.** $g / \sum_i m_i$ for each True entry, 0 for False entries and for every entry
    of an empty slice.

    Args:
        input: floating-point tensor.
        mask: bool tensor broadcastable to ``input`` (True = counts).
        dim: dimension or dimensions to average over; ``None`` = all. Default: ``None``.
        keepdim: keep the reduced dimensions with size 1. Default: ``False``.

    Returns:
        The reduced tensor in ``input``'s dtype (float16/bfloat16 summed in float32).

    Raises:
        TypeError: ``input`` is not floating point or ``mask`` is not a bool tensor.
        ValueError: ``mask`` does not broadcast to ``input``, or ``dim`` repeats a dimension.
        IndexError: ``dim`` is out of range.

    Shape:
        ``input``: any; ``mask``: broadcastable to it; output: ``input`` without ``dim``.

    Example:
        >>> import torch
        >>> from stablelosses.functional import masked_mean
        >>> loss = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> mask = torch.tensor([False, False])
        >>> (loss * mask).sum() / mask.sum()
        tensor(nan, grad_fn=<DivBackward0>)
        >>> masked_mean(loss, mask).backward(); loss.grad
        tensor([0., 0.])

    Replaces ``(x * mask).sum() / mask.sum()`` and ``x[mask].mean()``.
    """
    x = check_floating("masked_mean", "input", input)
    m = check_mask("masked_mean", mask, x.shape, device=x.device).to(x.device)
    dims = _dims("masked_mean", dim, x.ndim)
    check_flag("masked_mean", "keepdim", keepdim)
    return masked_mean_over(upcast(x), m, dims, keepdim).to(x.dtype)


def entropy(logits: Tensor, dim: int = -1, *, mask: Tensor | None = None) -> Tensor:
    r"""Entropy of ``softmax(logits)`` over ``dim``; masked and ``-inf`` entries contribute 0.

    $$ H(x) = -\sum_i p_i \log p_i,\qquad p = \operatorname{softmax}(x),\qquad
       0 \log 0 := 0 $$

    ``mask`` (bool, broadcastable; True = takes part) acts as ``masked_fill(~mask, -inf)``.
    The hand-written ``-(softmax(x) * log_softmax(x)).sum(-1)`` is NaN as soon as one logit is
    ``-inf`` (a masked action): $0 \cdot (-\infty)$. Here those terms are 0, an all-masked
    slice gives **0**, and $k$ ``+inf`` entries give $\log k$. NaN in a taking-part entry
    gives NaN.

    **Gradient.** $\partial H/\partial x_i = -p_i(\log p_i + H)$, computed from the saved
    log-probabilities: **0** for masked / ``-inf`` entries and for an all-masked slice.

    Args:
        logits: floating-point tensor of unnormalised log-probabilities.
        dim: the dimension of the distribution. Default: ``-1``.
        mask: optional bool tensor broadcastable to ``logits``. Default: ``None``.

    Returns:
        ``logits`` without ``dim``, in ``logits``' dtype (float16/bfloat16 computed in float32).

    Raises:
        TypeError: ``logits`` is not floating point, or ``mask`` is not a bool tensor.
        ValueError: ``mask`` does not broadcast to ``logits``.
        IndexError: ``dim`` is out of range.

    Shape:
        ``logits``: $(*, C, *)$ with $C$ at ``dim``; output: $(*, *)$.

    Example:
        >>> import torch
        >>> from stablelosses.functional import entropy
        >>> x = torch.tensor([[0.0, 0.0, float("-inf")]], requires_grad=True)
        >>> -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)
        tensor([nan], grad_fn=<NegBackward0>)
        >>> h = entropy(x); h
        tensor([0.6931], grad_fn=<...>)
        >>> h.sum().backward(); x.grad
        tensor([[0., 0., 0.]])

    References:
        Shannon, "A Mathematical Theory of Communication", 1948; the entropy bonus of
        Mnih et al., "Asynchronous Methods for Deep Reinforcement Learning", 2016.

    Replaces ``torch.distributions.Categorical(logits=x).entropy()`` and
    ``-(softmax(x) * log_softmax(x)).sum(dim)``.
    """
    x = check_floating("entropy", "logits", logits)
    d = wrap_dim("entropy", dim, x.ndim)
    xc = upcast(x)
    if mask is not None:
        m = check_mask("entropy", mask, x.shape, "logits", device=x.device)
        xc = xc.masked_fill(~m.to(x.device), float("-inf"))
    if xc.ndim == 0:
        xc = xc.reshape(1)
    h, _ = _Entropy.call(xc, d)
    # a copy: backward saved h, and the caller may edit the result in place (N values)
    return h.clone() if h.dtype == x.dtype else h.to(x.dtype)


def masked_residual(fn: str, x: Tensor, y: Tensor, mask: object) -> tuple[Tensor, Tensor]:
    """``(where(mask, x - y, 0), mask)``: a NaN/inf residual at a False entry is never read."""
    r = x - y
    m = check_mask(fn, mask, r.shape, device=r.device).to(r.device)
    return torch.where(m, r, 0.0), m
