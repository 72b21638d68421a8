r"""ctc_loss: an impossible alignment is ``inf`` with a gradient of exactly 0 for that sample.

An alignment is impossible when the input is too short for the target (``input_length`` below
the target length plus its repeats) or every path meets a ``-inf`` log-probability. torch then
gives ``inf`` and, unless ``zero_infinity=True``, a gradient that is not 0 for that sample (NaN
on the cuDNN path, pytorch #21680). Here torch's kernel runs with ``zero_infinity=True`` for the
value that autograd sees, the impossible samples' columns of ``log_probs`` enter it detached
(so their gradient is 0 on every backend), and their ``inf`` is added back as a constant.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from stablelosses._spec import check_flag
from stablelosses._utils import cast
from stablelosses.functional._torch_losses import call_torch, check_reduction, check_tensors, out_dtype, up

__all__ = ["ctc_loss"]

_NAMES = ("log_probs", "targets", "input_lengths", "target_lengths")
_INF = float("inf")
_NEG_INF = float("-inf")


# --- the compiled spelling ------------------------------------------------------------------------
# torch's CTC kernel has an output of data-dependent shape (its alpha table), which neither
# torch.compile nor torch.export can trace ("Unsupported Dynamic shape operator"). While
# compiling, the per-sample negative log-likelihood is one opaque op with a shape-only fake and
# a backward op of its own; the hazard logic around it is the eager path's, in traceable ops.


@torch.library.custom_op("stablelosses::ctc_nll", mutates_args=())
def _ctc_nll(log_probs: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor,
             blank: int) -> Tensor:
    """torch's per-sample CTC negative log-likelihood, ``inf`` where the alignment is impossible."""
    return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=blank, reduction="none")


@_ctc_nll.register_fake
def _ctc_nll_fake(log_probs: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor,
                  blank: int) -> Tensor:
    return log_probs.new_empty(log_probs.shape[1:-1])  # (N,), or () for unbatched (T, C)


@torch.library.custom_op("stablelosses::ctc_nll_backward", mutates_args=())
def _ctc_nll_backward(grad: Tensor, log_probs: Tensor, targets: Tensor, input_lengths: Tensor,
                      target_lengths: Tensor, blank: int) -> Tensor:
    """The gradient of ``Σ grad · nll``: torch's backward kernel (no autograd runs inside an
    op), exactly 0 in the columns of the impossible samples (its ``zero_infinity``: the forward
    kernel returns their ``inf`` either way)."""
    batched = log_probs.dim() == 3
    lp = log_probs if batched else log_probs.unsqueeze(1)
    tg, il, tl, g = (targets, input_lengths, target_lengths, grad) if batched else (
        targets.unsqueeze(0), input_lengths.reshape(1), target_lengths.reshape(1), grad.reshape(1))
    tg, il, tl = tg.long(), il.long(), tl.long()  # as F.ctc_loss hands them to the kernel
    nll, alpha = torch.ops.aten._ctc_loss.Tensor(lp, tg, il, tl, blank, False)
    out = torch.ops.aten._ctc_loss_backward.Tensor(g, lp, tg, il, tl, nll, alpha, blank, True)
    # a -inf log-probability: the kernel's exp(log(alpha beta) + nll - lp) is NaN there, the limit 0
    out = torch.where(lp == _NEG_INF, 0.0, out)
    return out if batched else out.squeeze(1)


@_ctc_nll_backward.register_fake
def _ctc_nll_backward_fake(grad: Tensor, log_probs: Tensor, targets: Tensor, input_lengths: Tensor,
                           target_lengths: Tensor, blank: int) -> Tensor:
    return torch.empty_like(log_probs)


def _ctc_nll_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs[:4])
    ctx.blank = inputs[4]


def _ctc_nll_grad(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None, None]:
    lp, targets, il, tl = ctx.saved_tensors
    return _ctc_nll_backward(grad, lp, targets, il, tl, ctx.blank), None, None, None, None


_ctc_nll.register_autograd(_ctc_nll_grad, setup_context=_ctc_nll_setup)


def _lengths(v: Any, device: torch.device) -> Tensor:
    return v if isinstance(v, Tensor) else torch.as_tensor(v, dtype=torch.long, device=device)


def _compiled_ctc(lp: Tensor, targets: Tensor, input_lengths: Any, target_lengths: Any, blank: int,
                  red: str, zero_infinity: bool) -> Tensor:
    """The eager path's values and gradients from `_ctc_nll` (see above): impossible samples are
    0 with gradient 0, their ``inf`` added back as a constant; torch's mean divides each sample
    by its target length (at least 1)."""
    tl = _lengths(target_lengths, lp.device)
    raw = _ctc_nll(lp, targets, _lengths(input_lengths, lp.device), tl, blank)
    impossible = raw == _INF
    per = torch.where(impossible, 0.0, raw)
    if red == "mean":
        loss = (per / tl.clamp_min(1).to(per.dtype)).mean()
    else:
        loss = per.sum() if red == "sum" else per
    if zero_infinity:
        return loss
    return loss + torch.where(impossible if red == "none" else impossible.any(), _INF, 0.0)


def ctc_loss(
    log_probs: Tensor,
    targets: Tensor,
    input_lengths: Tensor,
    target_lengths: Tensor,
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
) -> Tensor:
    r"""Connectionist Temporal Classification loss; an impossible sample has gradient exactly 0.

    $$ \ell_n = -\log \sum_{\pi \in \mathcal{B}^{-1}(y_n)} \prod_t p_{t, \pi_t} $$

    torch's value: ``inf`` for an impossible alignment (0 with ``zero_infinity=True``).
    Reductions: none ``(N,)``; sum; mean $\frac1N\sum_n \ell_n / \max(1, |y_n|)$ (torch's).

    **Gradient.** torch's where the alignment is possible. For an impossible sample it is
    exactly **0** whatever ``zero_infinity`` says (the gradient torch gives with
    ``zero_infinity=True``; with ``False`` torch's is not 0 there, and NaN on cuDNN): the
    ``inf`` is a constant and the sample's columns of ``log_probs`` enter the kernel detached
    (found by one forward without grad, which costs a second CTC forward), so no backend's
    backward can put a NaN there; the other samples' gradients stay finite. The sum or mean is
    ``inf`` then, as torch's, while the gradient of the feasible samples is torch's. A ``-inf``
    log-probability (a masked class) has gradient **0**, the limit (torch's backward computes
    $e^{\log(\alpha\beta) + \text{nll} - \log p}$ there: NaN, which ``log_softmax``'s backward
    spreads over the frame's logits). NaN log-probabilities give NaN. No double backward
    (torch's CTC has none). float16/bfloat16 are computed in float32 (torch's CPU kernel has no
    half precision). It runs under
    ``torch.compile(fullgraph=True)`` and ``torch.export`` (torch's own ``F.ctc_loss`` does
    not: its kernel has an output of data-dependent shape), with the same values and
    gradients: there the per-sample negative log-likelihood is one opaque op.

    Args:
        log_probs: ``(T, N, C)`` or ``(T, C)`` log-probabilities (``log_softmax`` output).
        targets: ``(N, S)`` padded, or the concatenated targets ``(sum(target_lengths),)``
            (read as their values at any strides: torch's CPU kernel misreads non-contiguous
            concatenated targets).
        input_lengths: ``(N,)`` (or a tuple of ints).
        target_lengths: ``(N,)`` (or a tuple of ints).
        blank: the blank label. Default: ``0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        zero_infinity: give 0 (not ``inf``) for an impossible sample. Default: ``False``.

    Returns:
        A scalar, or ``(N,)`` for ``'none'``; ``log_probs``' dtype (float32 for float16/bfloat16
        under autocast, as torch's).

    Raises:
        ValueError: ``reduction`` is not one of the above.
        TypeError: ``zero_infinity`` is not a bool; ``log_probs`` is not a tensor.
        RuntimeError: torch's checks of the shapes, lengths and ``blank`` (the message names
            the arguments).

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> lp = torch.randn(2, 1, 3).log_softmax(2).requires_grad_()
        >>> # 3 labels cannot fit in 2 time steps
        >>> loss = SF.ctc_loss(lp, torch.tensor([[1, 2, 1]]), torch.tensor([2]), torch.tensor([3]))
        >>> loss
        tensor(inf, grad_fn=<AddBackward0>)
        >>> loss.backward()
        >>> bool((lp.grad == 0).all())
        True

    Replaces ``torch.nn.functional.ctc_loss``.
    """
    fn = "ctc_loss"
    red = check_reduction(fn, reduction)
    check_flag(fn, "zero_infinity", zero_infinity)
    check_tensors(fn, log_probs=log_probs)
    dtype = out_dtype(log_probs) or log_probs.dtype  # float32 under autocast, as torch's (its float32 list)
    lp = up(log_probs)
    if isinstance(targets, torch.Tensor):
        # torch's CPU kernel reads non-contiguous concatenated (1-d) targets wrong: a strided
        # slice gave 3.2055 where the same targets contiguous give 2.7191 (torch 2.13)
        targets = targets.contiguous()
    if torch.compiler.is_compiling():
        loss = _compiled_ctc(lp, targets, input_lengths, target_lengths, blank, red, zero_infinity)
        return cast(loss, dtype)
    rest = (targets, input_lengths, target_lengths)
    # which samples are impossible (+inf): one forward without grad (it also runs torch's checks)
    with torch.no_grad():
        raw = call_torch(
            fn, F.ctc_loss, _NAMES, lp, *rest, blank=blank, reduction="none", zero_infinity=False
        )
    impossible = raw == float("inf")
    # their columns of log_probs enter the kernel detached: their gradient is exactly 0 by
    # construction, whatever the backend's backward computes there (NaN on cuDNN, #21680).
    # So do the -inf entries (a masked class): the kernel's backward is exp(log(alpha beta) +
    # nll - lp), NaN at lp = -inf, where the limit is 0 (the paths through it weigh p^2, over p)
    column = impossible.reshape(1, -1, 1) if lp.dim() == 3 else impossible
    lp = torch.where(column | (lp == _NEG_INF), lp.detach(), lp)
    loss = F.ctc_loss(lp, *rest, blank=blank, reduction=red, zero_infinity=True)
    if not zero_infinity:
        # torch's value: inf for an impossible sample, and for a sum or mean over one
        inf = impossible if red == "none" else impossible.any()
        loss = loss + torch.where(inf, float("inf"), 0.0)
    return cast(loss, dtype)
