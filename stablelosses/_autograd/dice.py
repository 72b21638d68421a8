"""The per-sample soft Dice ratio as a Function whose gradient is formed in its bounded form.

``ℓ = Σ(p(1 − t) + t(1 − p)) / D`` with ``D = Σp + Σt + s`` (0 where ``D = 0``: both empty). Its
partial derivatives are ``∂ℓ/∂p_i = ((1 − 2t_i) − ℓ) / D`` and ``∂ℓ/∂t_i = ((1 − 2p_i) − ℓ) / D``.
Autograd of the quotient forms the two terms ``(1 − 2t_i)/D`` and ``−ℓ/D`` apart: for a subnormal
``D`` (float32 probabilities below 1e-38 and an empty target) each is ``±inf`` and their sum NaN,
where the derivative is 0. Here the numerator is formed first and divided once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stablelosses._autograd._base import StableFunction


def _ratio(p: Tensor, t: Tensor, dims: tuple[int, ...], smooth: float) -> Tensor:
    # Σ(p(1−t) + t(1−p)) = Σp + Σt − 2Σpt, term by term, without the cancellation
    diff = (p * (1 - t) + t * (1 - p)).sum(dims)
    denom = (p.sum(dims) + t.sum(dims)) + smooth
    empty = denom == 0
    # double where: a safe divisor, then the defined 0 on both-empty samples
    return torch.where(empty, 0.0, diff / torch.where(empty, 1.0, denom))


def _grads(p: Tensor, t: Tensor, loss: Tensor, g: Tensor, dims: tuple[int, ...], smooth: float,
           need: tuple[bool, bool]) -> tuple[Tensor | None, Tensor | None]:
    """``g · ∂ℓ/∂p`` and ``g · ∂ℓ/∂t`` (each where ``need`` asks) in differentiable ops
    (``loss``: the saved output, part of the graph), 0 on both-empty samples: the incoming
    gradient is selected to 0 there and the divisor to 1 (double where, on per-sample tensors)."""
    denom = (p.sum(dims, keepdim=True) + t.sum(dims, keepdim=True)) + smooth
    empty = denom == 0
    safe = torch.where(empty, 1.0, denom)
    g_kept = torch.where(empty, 0.0, g.reshape(denom.shape))
    one_minus = 1 - loss.reshape(denom.shape)
    # (1 − ℓ − 2·other) · g, then one division: the product is formed before it (a subnormal D)
    return tuple(  # type: ignore[return-value]
        torch.add(one_minus, other, alpha=-2.0).mul(g_kept).div(safe) if n else None
        for other, n in ((t, need[0]), (p, need[1]))
    )


class _Dice(StableFunction):
    """``(ℓ, ℓ)`` per sample of probabilities ``p`` and targets ``t`` (one shape), summed over
    ``dims``; ``smooth`` as in `dice_loss`. The second output is the copy the backward reads (an
    output, so that a double backward differentiates through it; a copy, so that an in-place
    edit of the returned loss does not touch it, as with torch's own ops)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(p: Tensor, t: Tensor, dims: tuple[int, ...], smooth: float) -> tuple[Tensor, Tensor]:
        loss = _ratio(p, t, dims, smooth)
        return loss, loss.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        p, t, dims, smooth = inputs
        ctx.save_for_backward(p, t, output[1])
        ctx.save_for_forward(p, t, output[1])
        ctx.dims, ctx.smooth = dims, smooth
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, g: Tensor | None, g_copy: Tensor | None
                 ) -> tuple[Tensor | None, Tensor | None, None, None]:
        p, t, loss = ctx.saved_tensors
        g = g_copy if g is None else (g if g_copy is None else g + g_copy)
        if g is None:
            return None, None, None, None
        gp, gt = _grads(p, t, loss, g, ctx.dims, ctx.smooth, ctx.needs_input_grad[:2])
        return gp, gt, None, None

    @staticmethod
    def jvp(ctx: Any, tp: Tensor | None, tt: Tensor | None, _d: None, _s: None) -> tuple[Tensor, Tensor]:
        p, t, loss = ctx.saved_tensors
        need = (tp is not None, tt is not None)
        gp, gt = _grads(p, t, loss, torch.ones_like(loss), ctx.dims, ctx.smooth, need)
        out = torch.zeros_like(loss)
        for grad, tangent in ((gp, tp), (gt, tt)):
            if grad is not None and tangent is not None:
                out = out + (grad * tangent).sum(ctx.dims)
        return out, out.clone()
