r"""ORPO's odds-ratio term ``−log σ(L)`` with ``L = logodds(c) − logodds(r)``, as a Function
with the limit gradients at ``c → 0⁻``, and the exact ``log1mexp`` it needs.

``logodds(x) = log(e^x / (1 − e^x)) = x − log1mexp(x)`` for a log-probability ``x ≤ 0``. The
hand-written ``log1p(−exp(x))`` rounds ``exp(x)`` to 1 for ``x`` above about ``−6e-8`` in
float32 (``−1.1e-16`` in float64) and gives ``-inf`` (and 1% error at ``x = −1e-7``);
``log(−expm1(x))`` is exact there (Mächler 2012: above ``−log 2``, below it ``log1p(−exp(x))``).

At ``c = 0`` (a chosen completion of probability 1) ``L = +inf`` and the loss is 0, but its
chain-rule gradient is ``σ(−L) · 1/(1 − e^c) = 0 · inf``. The limits are finite:

$$ \frac{\partial\ell}{\partial c} = -\frac{\sigma(-L)}{1-e^{c}}
   = -\exp\!\big(\log\sigma(L) + \operatorname{logodds}(r) - c\big), \qquad
   \frac{\partial\ell}{\partial r} = \exp\!\big(\log\sigma(-L) - \operatorname{log1mexp}(r)\big), $$

the first written with ``log σ(L)`` where ``L > 0`` (finite at ``c = 0``: ``−odds(r)``) and
with ``log σ(−L) − log1mexp(c)`` elsewhere (finite at ``r = 0``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from stablelosses._autograd._base import applier, tangent_sum

_LN2 = math.log(2.0)


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 − e^x)`` for ``x ≤ 0``, exact at both ends: ``log(−expm1(x))`` above ``−log 2``,
    ``log1p(−exp(x))`` below (double where: neither branch sees the other's arguments).
    ``-inf`` at ``x = 0``; NaN for ``x > 0`` and for NaN."""
    near = x > -_LN2
    return torch.where(
        near,
        torch.log(-torch.expm1(torch.where(near, x, -1.0))),
        torch.log1p(-torch.exp(torch.where(near, -1.0, x))),
    )


def _log_odds_ratio(c: Tensor, r: Tensor) -> Tensor:
    """``L = logodds(c) − logodds(r) = (c − r) − (log1mexp(c) − log1mexp(r))``."""
    return (c - r) - (log1mexp(c) - log1mexp(r))


def _odds_grads(c: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    """``(∂ℓ/∂c, ∂ℓ/∂r)`` of ``ℓ = −log σ(L)`` in the forms of the module docstring, from
    ``c`` and ``r`` in differentiable ops (double backward differentiates them)."""
    big_l = _log_odds_ratio(c, r)
    pos = big_l > 0
    lo_r = r - log1mexp(r)
    # exponent of −∂ℓ/∂c: log σ(L) + logodds(r) − c where L > 0, log σ(−L) − log1mexp(c) else
    e_pos = F.logsigmoid(torch.where(pos, big_l, 1.0)) + torch.where(pos, lo_r - c, 0.0)
    e_neg = F.logsigmoid(-torch.where(pos, -1.0, big_l)) - log1mexp(torch.where(pos, -1.0, c))
    gc = -torch.exp(torch.where(pos, e_pos, e_neg))
    gr = torch.exp(F.logsigmoid(-big_l) - log1mexp(r))
    return gc, gr


class _OddsRatio(torch.autograd.Function):
    """ORPO's ``ℓ = −log σ(L)``, ``L = (c − r) − (log1mexp(c) − log1mexp(r))``, per element of the
    length-averaged log-probabilities ``c`` (chosen) and ``r`` (rejected).

    Backward and jvp: the gradients of the module docstring, recomputed from the saved inputs
    in differentiable ops (N-sized; double backward differentiates them), finite at ``c = 0``.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(c: Tensor, r: Tensor) -> Tensor:
        return torch.rsub(F.logsigmoid(_log_odds_ratio(c, r)), 0.0)  # 0 − log σ: +0.0 at L = +inf

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        c, r = ctx.saved_tensors
        gc, gr = _odds_grads(c, r)
        return grad * gc, grad * gr

    @staticmethod
    def jvp(ctx, c_t: Tensor | None, r_t: Tensor | None):
        c, r = ctx.saved_tensors
        return tangent_sum(_odds_grads(c, r), (c_t, r_t))


_odds_ratio = applier(_OddsRatio)
