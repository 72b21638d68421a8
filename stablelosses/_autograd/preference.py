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

from stablelosses._autograd._base import StableFunction

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


def _times_exp(e: Tensor, scale: Tensor | None) -> Tensor:
    """``scale · exp(e)`` as ``(exp(e/2) · scale) · exp(e/2)``: finite wherever the product is
    (a log-prob within 1e-38 of 0 makes ``exp(e)`` alone overflow float32 where the incoming
    gradient, e.g. ``β/N``, brings the product back into range)."""
    if scale is None:
        return torch.exp(e)
    half = torch.exp(e / 2)
    return half * scale * half


def _odds_grads(c: Tensor, r: Tensor, scale_c: Tensor | None = None, scale_r: Tensor | None = None,
                ) -> tuple[Tensor, Tensor]:
    """``(∂ℓ/∂c, ∂ℓ/∂r)`` of ``ℓ = −log σ(L)`` (times ``scale_c`` and ``scale_r``, the incoming
    gradient or the tangents, when given) from ``c`` and ``r`` in differentiable ops (double
    backward differentiates them), finite with finite derivatives at ``c = 0``.

    Where ``L > 0`` both are written with ``z = e^{−L} = e^{t}·(−expm1(c)) ∈ [0, 1)``,
    ``t = logodds(r) − c``: ``log(−∂ℓ/∂c) = t − log1p(z)`` and ``∂ℓ/∂r = z / (1 + z) / (1 − e^r)``,
    smooth through ``c = 0`` (``L = +inf``, ``z = 0``), where the log-space forms would
    differentiate ``σ(−L)·∂L/∂c = 0·inf``. Elsewhere ``L ≤ 0`` and the log-space forms of the
    module docstring hold. Double where: each branch sees only its own arguments. Each
    exponential is split around its factor (`_times_exp`): alone it overflows float32 for
    log-probs within 1e-38 of 0, where the gradient itself is representable.
    """
    pos = _log_odds_ratio(c, r).detach() > 0
    # L > 0: r < c ≤ 0, so t − c ≤ 0 and z < 1 (the placeholders keep the other rows finite)
    cp, rp = torch.where(pos, c, -1.0), torch.where(pos, r, -2.0)
    t = (rp - log1mexp(rp)) - cp
    z = _times_exp(t, -torch.expm1(cp))  # e^t alone overflows where r is within 1e-38 of 0
    gc_pos = -_times_exp(t - torch.log1p(z), scale_c)
    share = z / (1.0 + z)  # σ(−L), inside the product (its exp alone can overflow)
    gr_pos = _times_exp(-log1mexp(rp), share if scale_r is None else scale_r * share)
    # L ≤ 0: −∂ℓ/∂c = exp(log σ(−L) − log1mexp(c)), ∂ℓ/∂r = exp(log σ(−L) − log1mexp(r))
    cn, rn = torch.where(pos, -1.0, c), torch.where(pos, -1.0, r)
    ln = F.logsigmoid(-_log_odds_ratio(cn, rn))
    gc_neg = -_times_exp(ln - log1mexp(cn), scale_c)
    gr_neg = _times_exp(ln - log1mexp(rn), scale_r)
    return torch.where(pos, gc_pos, gc_neg), torch.where(pos, gr_pos, gr_neg)


class _OddsRatio(StableFunction):
    """ORPO's ``ℓ = −log σ(L)``, ``L = (c − r) − (log1mexp(c) − log1mexp(r))``, per element of the
    length-averaged log-probabilities ``c`` (chosen) and ``r`` (rejected).

    Backward and jvp: the gradients of the module docstring, recomputed from the saved inputs
    in differentiable ops (N-sized; double backward differentiates them), finite at ``c = 0``.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(c: Tensor, r: Tensor) -> Tensor:
        # c = 0 gives 0 whatever r ≤ 0 (L = +inf; at r = 0 too, where L would be inf − inf)
        big_l = torch.where((c == 0) & (r <= 0), float("inf"), _log_odds_ratio(c, r))
        return torch.rsub(F.logsigmoid(big_l), 0.0)  # 0 − log σ: +0.0 at L = +inf

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        c, r = ctx.saved_tensors
        return _pair_grads(c, r, grad, grad)

    @staticmethod
    def jvp(ctx, c_t: Tensor | None, r_t: Tensor | None):
        # each tangent inside its own product (as the incoming gradient in backward): a
        # derivative that overflows alone meets a tangent of 0 as 0, not inf·0
        c, r = ctx.saved_tensors
        if c_t is None and r_t is None:
            return torch.zeros_like(c)
        gc, gr = _pair_grads(c, r, c_t, r_t)
        return gr if c_t is None else gc if r_t is None else gc + gr


def _pair_grads(c: Tensor, r: Tensor, scale_c: Tensor | None = None, scale_r: Tensor | None = None,
                ) -> tuple[Tensor, Tensor]:
    """`_odds_grads`, and 0 for both where ``c = r = 0`` (two completions of probability 1,
    e.g. two empty ones: the limit along ``c = 0`` is ``−odds(r) → −inf``, so no finite limit;
    the loss is 0 there and carries no preference)."""
    both = (c == 0) & (r == 0)
    gc, gr = _odds_grads(torch.where(both, -1.0, c), torch.where(both, -2.0, r), scale_c, scale_r)
    return torch.where(both, 0.0, gc), torch.where(both, 0.0, gr)
