"""Entropy of a softmax distribution whose masked (``-inf``) entries contribute 0.

``H = −Σ p log p`` with ``p = softmax(x)``. The hand-written
``-(softmax(x) * log_softmax(x)).sum()`` computes ``0 · (−inf)`` = NaN for every ``-inf``
logit (a masked action); the limit ``p log p → 0`` as ``p → 0`` defines those terms as 0.
An all-``-inf`` slice has no distribution and gives 0; ``+inf`` entries take uniform mass
(``H = log k`` over ``k`` such entries), as in `stablelosses.functional.softmax`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stablelosses._autograd._base import StableFunction
from stablelosses._autograd.rows import exact_log_softmax

_INF = float("inf")


def _log_softmax(x: Tensor, dim: int) -> Tensor:
    """log-softmax with ``-inf`` on all-``-inf`` slices and ``-log k`` on ``k`` ``+inf`` entries."""
    if x.shape[dim] == 0:
        return torch.log_softmax(x, dim)
    return exact_log_softmax(x, dim, masked_rows_inf=True)[0]  # the public log_softmax's forward


def _plogp(logp: Tensor) -> tuple[Tensor, Tensor]:
    """``p`` and ``log p`` with ``log p`` replaced by 0 where ``p == 0`` (double where)."""
    return torch.exp(logp), torch.where(torch.isneginf(logp), 0.0, logp)


class _Entropy(StableFunction):
    """``(H, log p)``: the entropy over ``dim`` and the log-probabilities it came from.

    ``log p`` is returned (and dropped by the wrapper) so that backward can differentiate it:
    ``∂H/∂x = −p·(log p + H)``, 0 wherever ``p == 0``.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
        logp = _log_softmax(x, dim)
        p, safe_logp = _plogp(logp)
        return torch.rsub((p * safe_logp).sum(dim), 0), logp  # 0 − Σ: +0.0, not −0.0

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.dim = inputs[1]
        h, logp = output
        ctx.save_for_backward(h, logp)
        ctx.save_for_forward(h, logp)

    @staticmethod
    def backward(ctx, grad_h: Tensor, grad_logp: Tensor):
        h, logp = ctx.saved_tensors
        dim = ctx.dim
        p, safe_logp = _plogp(logp)
        gx = -grad_h.unsqueeze(dim) * p * (safe_logp + h.unsqueeze(dim))
        # log-softmax backward; a -inf output does not move, so its incoming gradient is 0.
        g = torch.where(torch.isneginf(logp), 0.0, grad_logp)
        return gx + (g - p * g.sum(dim, keepdim=True)), None

    @staticmethod
    def jvp(ctx, tx: Tensor, _dim):
        h, logp = ctx.saved_tensors
        dim = ctx.dim
        p, safe_logp = _plogp(logp)
        dead = torch.isneginf(logp)
        t = tx.masked_fill(dead, 0.0)
        t_logp = (t - (p * t).sum(dim, keepdim=True)).masked_fill(dead, 0.0)
        t_h = -(p * t * (safe_logp + h.unsqueeze(dim))).sum(dim)
        return t_h, t_logp
