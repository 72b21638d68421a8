"""Sigmoid (binary) focal loss as one Function with an analytic backward and forward mode.

Notation, per element, for logit ``x`` and target ``t``:

* ``a = |x|``, ``e = exp(-a)``, ``big = σ(a) = 1/(1+e)``, ``small = σ(-a) = e·big``,
  ``s = ±1`` the sign of ``x`` (``+1`` at 0);
* ``w`` = the target mass on the side the logit does *not* favour: ``1 - t`` for ``x >= 0``,
  ``t`` for ``x < 0``;
* ``ce = BCE(x, t) = log1p(e) + w·a``, a sum of non-negative terms (no cancellation); at
  ``γ = 0`` the forward takes torch's own ``binary_cross_entropy_with_logits`` term instead,
  bit for bit, so that ``α_t·BCE`` is exactly what torchvision computes;
* ``q = 1 - p_t = t·σ(-x) + (1-t)·σ(x) = big·den`` with ``den = w + (1-w)·e``, and
  ``log q = log(den) - log1p(e)``, where ``log(den) = -a`` once ``den`` is below ``_tiny``
  (then ``w == 0``): ``(1-p_t)**γ = exp(γ·log q)`` never meets ``0**γ`` and has a finite
  derivative for every ``γ > 0``;
* ``C = ce / (q·(1+e)) = ce / den`` (bounded by ``a + 2``; ``log1p(e)/e → 1 - e/2`` below ``_tiny``);
* ``loss = α_t · ce · q**γ`` with ``α_t = α·t + (1-α)·(1-t)`` (1 when ``α < 0``).

Derivatives, with ``mod = q**γ``:

* ``d loss/dx = s·α_t·mod·[(w - small) + γ(2w-1)·C·small]``;
* ``d loss/dt = α_t·mod·[-x - γ·s·(1-e)·C] + (2α-1)·ce·mod``.

No factor divides by a vanishing quantity, so the second derivatives (double backward,
forward over reverse) stay finite for saturated logits as well.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from stablelosses._autograd._base import StableFunction
from stablelosses._utils import inplace_ok, reduce


def _tiny(dtype: torch.dtype) -> float:
    # Below this den (only when w == 0), C / den would overflow in a second derivative.
    return torch.finfo(dtype).tiny ** 0.75


def _lerp_t(t: Tensor, start: float | Tensor, end: float | Tensor) -> Tensor:
    """``start + t·(end − start)``, exact at ``t = 0`` and ``t = 1``, in one pass over ``t``
    (``α_t = lerp(1 − α, α, t)``): the two ends are 0-dimensional tensors on ``t``'s device."""
    ends = [e if isinstance(e, Tensor) else torch.full((), e, dtype=t.dtype, device=t.device)
            for e in (start, end)]
    return torch.lerp(ends[0], ends[1], t)


def _parts(x: Tensor, t: Tensor) -> dict[str, Tensor]:
    a = x.abs()
    e = torch.exp(-a)
    pos = x >= 0
    w = torch.where(pos, 1 - t, t)
    den = torch.addcmul(w, 1 - w, e)
    under = den < _tiny(x.dtype)
    # Double where: log and division see 1 where the selected branch is the limit form.
    safe_den = torch.where(under, 1.0, den)
    log1p_e = torch.log1p(e)
    log_q = torch.where(under, -a, torch.log(safe_den)) - log1p_e
    return {"a": a, "e": e, "pos": pos, "w": w, "den": safe_den, "under": under,
            "log1p_e": log1p_e, "log_q": log_q}


def _softplus_threshold(dtype: torch.dtype) -> float:
    """Where ``softplus(z)`` may return ``z`` itself: ``log1p(e^-z)`` is below half an ulp of
    ``z`` past ``-log(eps)`` (16 in float32, 36 in float64), so torch's default 20 is exact in
    float32 only; float64 takes 38 (at 25 the default lost ``e^-25``, 5.6e-13 of the value)."""
    return max(20.0, math.ceil(-math.log(torch.finfo(dtype).eps)) + 1.0)


def _ce_and_sides(x: Tensor, t: Tensor, need_ce: bool = True) -> tuple[Tensor | None, Tensor, Tensor]:
    """``ce`` (``None`` unless ``need_ce``), ``σ(-x)`` and ``σ(x)``, in an order that keeps at
    most four elementwise tensors alive at once (each temporary is freed before the next).

    ``ce = t·softplus(-x) + (1-t)·softplus(x) = lerp(softplus(x), softplus(-x), t)``: two
    non-negative terms, each ``log1p(exp(·))`` below the threshold where it rounds to its
    argument (`_softplus_threshold`: its small part kept, ``e^-30`` at ``x = 30, t = 1``), and
    ``lerp`` is exact at the end points (it evaluates from the nearer one). ``-x`` is formed once
    for both of its uses.
    """
    threshold = _softplus_threshold(x.dtype)
    nx = x.neg()
    sn = torch.sigmoid(nx)
    spn = F.softplus(nx, threshold=threshold) if need_ce else None
    del nx
    ce = None if spn is None else torch.lerp(F.softplus(x, threshold=threshold), spn, t)
    del spn
    return ce, sn, torch.sigmoid(x)


def _loss(x: Tensor, t: Tensor, alpha: float, gamma: float, mode: str) -> Tensor:
    if gamma == 0.0:
        # α_t·BCE: torch's own term, bit for bit (torchvision's tests compare with it), but at
        # x = ±inf, where torch's (1 − t)·x meets 0·inf and inf − inf: there the limit, +inf,
        # or 0 where the target sits at that end (w = 0); a NaN target stays NaN (w·0)
        loss = F.binary_cross_entropy_with_logits(x, t, reduction="none")
        w = torch.where(x > 0, 1 - t, t)
        loss = torch.where(torch.isinf(x), torch.where(w == 0, 0.0, w * 0.0 + math.inf), loss)
        if alpha >= 0:
            a_t = alpha * t + (1 - alpha) * (1 - t)  # torchvision's spelling: bitwise parity
            loss = torch.where(a_t == 0, 0.0, a_t * loss)  # α_t = 0: 0 also where loss is inf
        return reduce(loss, mode)
    if torch.compiler.is_compiling():
        # the backward's quantities (`_parts`: one exp(-|x|), its log1p, log den), which
        # inductor computes once for both, where the eager spelling's σ(±x) and softplus(±x)
        # are four more exp and two more log1p per element (65536x80 fwd+bwd 1.61-1.69x →
        # 0.87-0.94x compiled torchvision's; benchmarks/spellings.md)
        p = _parts(x, t)
        factor = torch.exp(gamma * p["log_q"])
        if alpha >= 0:
            factor = factor * _lerp_t(t, 1 - alpha, alpha)
        # x = ±inf with the target at that end: ce is 0·inf (NaN), the factor 0: the limit 0
        loss = torch.where(factor == 0, 0.0, torch.addcmul(p["log1p_e"], p["w"], p["a"]) * factor)
        return reduce(loss, mode)
    ce, sn, sp = _ce_and_sides(x, t)
    assert ce is not None
    # q = lerp(σ(x), σ(-x), t): σ(∓x) itself for a hard target; the factor α_t·q^γ in one
    # buffer. In place only on tensors made from both x and t (a vmap over one of them
    # batches both)
    factor = torch.lerp(sp, sn, t).pow_(gamma)
    del sn, sp  # freed before the next buffer: the peak
    if alpha >= 0:
        factor = factor.mul_(_lerp_t(t, 1 - alpha, alpha))
    # x = ±inf: the lerp of an infinite softplus is NaN (inf·0, inf − inf) where the limit is
    # +inf, or 0 where the factor is 0 (the target at that end, or α_t = 0). A NaN input stays
    # NaN through q. (In-place passes over our own buffers.)
    loss = ce.nan_to_num_(nan=math.inf, posinf=math.inf).mul_(factor)
    if mode == "none":
        return loss.masked_fill_(factor == 0, 0.0)
    # Eager 'mean'/'sum': the select's elements summed without it (2 passes where the select
    # and the sum are 4.5): the only NaN terms left are the 0·inf ones (dropped by nansum,
    # the same cascade sum as sum) and a NaN factor's, put back from the factor's sum
    total = torch.where(torch.isnan(factor.sum()), math.nan, loss.nansum())
    return total / loss.numel() if mode == "mean" else total


def _grad_x_lean(x: Tensor, t: Tensor, alpha: float, gamma: float, scale: Tensor, reduced: bool
                 ) -> Tensor:
    """``scale · d loss/d x`` for the eager first-order backward (in place on fresh buffers, no
    autograd, no transforms; ``scale``: the incoming gradient, 0-dimensional when ``reduced``).

    ``α_t·[(σ(x) - t)·q^γ + γ·(ce/q)·(1-2t)·σ(x)σ(-x)·q^γ]``: ``ce/q`` is bounded; where ``q``
    underflows to 0 (``ce/q`` is 0/0 or inf there) the term is 0, its limit.
    Every step after the three inputs writes into a buffer it has read: at most four
    elementwise tensors are alive at once (the peak).
    """
    ce, sn, sp = _ce_and_sides(x, t, need_ce=gamma != 0.0)
    q = torch.lerp(sp, sn, t)
    if gamma != 0.0:
        pn = sp.mul_(sn)  # σ(x)σ(-x)
    # σ(x) - t = q - 2t·σ(-x) (σ(x) + σ(-x) = 1): σ(x) itself at t = 0, exactly -σ(-x) at t = 1
    d = torch.addcmul(q, t, sn, value=-2.0, out=sn)  # into σ(-x)'s buffer (read elementwise)
    if gamma != 0.0:
        assert ce is not None
        dq = pn.addcmul_(pn, t, value=-2.0)  # σ(x)σ(-x)(1 - 2t)
        # ce/q is bounded where σ(x)σ(-x) is not 0; at x = ±inf (NaN or inf there) the term
        # is 0 (a NaN input stays NaN through σ(x) − t)
        ratio = ce.div_(q).nan_to_num_(nan=0.0, posinf=0.0)
        d = d.addcmul_(ratio, dq, value=gamma).mul_(q.pow_(gamma))
    if alpha < 0:
        return d.mul_(scale)
    if not reduced:
        return d.mul_(_lerp_t(t, 1 - alpha, alpha)).mul_(scale)
    # a scalar incoming gradient folded into α_t: lerp((1-α)·s, α·s, t), one pass fewer
    return d.mul_(_lerp_t(t, scale * (1 - alpha), scale * alpha))


def _grads(x: Tensor, t: Tensor, alpha: float, gamma: float,
           need_x: bool, need_t: bool) -> tuple[Tensor | None, Tensor | None]:
    """d loss / d x and d loss / d t, elementwise, in differentiable torch ops.

    At ``x = ±inf`` d/dx is its limit ``±α_t w^{1+γ}`` (constant in ``x``: second derivative
    0) and d/dt is ``−x α_t w^γ``, infinite as the loss is around it, and 0 where ``w = 0``
    and ``γ > 0`` (its limit along x: ``x·σ(-|x|)^γ → 0``).
    Eager (double backward may follow), those entries are computed at 0 and replaced (double
    where). Compiled (first order only), the formulas run on ``x`` itself, whose one singular
    product there, ``C·σ(-|x|) = inf·0``, is selected to its limit 0: the same first-order
    values in fewer operations (65536x80 fwd+bwd compiled: 26.3 → 20.9 ms).
    """
    compiled = torch.compiler.is_compiling()
    a_t = _lerp_t(t, 1 - alpha, alpha) if alpha >= 0 else None  # α_t as the other paths form it
    inf_x = None if compiled else torch.isinf(x)
    xs = x if inf_x is None else torch.where(inf_x, 0.0, x)
    p = _parts(xs, t)
    a, e, pos, w = p["a"], p["e"], p["pos"], p["w"]
    small = e / (1 + e)
    ce = torch.addcmul(p["log1p_e"], w, a)
    gx = gt = None
    if gamma != 0.0:
        mod = torch.exp(gamma * p["log_q"])
        c = torch.where(p["under"], 1 - e / 2, ce / p["den"])
        if need_x:
            cs = torch.where(small == 0, 0.0, c * small)  # inf·0 at x = ±inf (compiled): 0
            core = mod * ((w - small) + gamma * (2 * w - 1) * cs)
            gx = torch.where(pos, core, -core)
        if need_t:
            d = gamma * (1 - e) * c
            gt = mod * (-xs - torch.where(pos, d, -d))
            if a_t is not None:
                gt = gt * a_t + (2 * alpha - 1) * ce * mod
    else:
        if need_x:
            core = w - small
            gx = torch.where(pos, core, -core)
        if need_t:
            gt = -xs
            if a_t is not None:
                gt = gt * a_t + (2 * alpha - 1) * ce
    if inf_x is None:  # compiled
        if gx is not None and a_t is not None:
            gx = gx * a_t
        return gx, gt
    # the target mass on the side x does not favour; 1 at finite x (double where: pow's
    # derivative at 0 is inf for γ < 1)
    w_inf = torch.where(inf_x, torch.where(x > 0, 1 - t, t), 1.0)
    mod_inf = w_inf**gamma if gamma != 0.0 else torch.ones_like(w_inf)
    if gx is not None:
        # w^(1+γ) in one power: its derivative (1+γ)·w^γ is 0 at w = 0, where the product
        # w·w^γ would form 0·inf for γ < 1 in a second derivative
        w_pow = w_inf ** (1 + gamma)
        gx = torch.where(inf_x, torch.where(x > 0, w_pow, -w_pow), gx)
        if a_t is not None:
            gx = gx * a_t
    if gt is not None:
        # where the target sits at x's end (w = 0, γ > 0) the limit of −x·q^γ is 0, not −inf·0
        # (double where: the selected-away product sees x = 0)
        neg_x = torch.where(mod_inf == 0, 0.0, -x)
        gt = torch.where(inf_x, neg_x * mod_inf * (1.0 if a_t is None else a_t), gt)
    return gx, gt


class _SigmoidFocal(StableFunction):
    """``reduce(α_t · BCE(x, t) · (1 - p_t)**γ)``; ``mode`` 'none', 'mean' or 'sum'."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input: Tensor, target: Tensor, alpha: float, gamma: float, mode: str) -> Tensor:
        return _loss(input, target, alpha, gamma, mode)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        input, target, alpha, gamma, mode = inputs
        ctx.save_for_backward(input, target)
        ctx.save_for_forward(input, target)
        ctx.alpha, ctx.gamma, ctx.mode = alpha, gamma, mode

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        input, target = ctx.saved_tensors
        need_x, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        scale = grad / input.numel() if ctx.mode == "mean" else grad
        if need_x and not need_t and inplace_ok(input, target, scale):
            # First order, no transforms: the few-pass formula, in place on its own buffers
            # (65536x80 fwd+bwd: 1.57x → 0.98x torchvision's bytes with it).
            lean = _grad_x_lean(input, target, ctx.alpha, ctx.gamma, scale, ctx.mode != "none")
            return lean, None, None, None, None
        gx, gt = _grads(input, target, ctx.alpha, ctx.gamma, need_x, need_t)
        grad_input = gx * scale if gx is not None else None
        grad_target = gt * scale if gt is not None else None
        return grad_input, grad_target, None, None, None

    @staticmethod
    def jvp(ctx: Any, t_input: Tensor, t_target: Tensor, _a: None, _g: None, _m: None) -> Tensor:
        input, target = ctx.saved_tensors
        gx, gt = _grads(input, target, ctx.alpha, ctx.gamma, True, True)
        assert gx is not None and gt is not None
        # The forward's reduction, applied to the elementwise tangent.
        return reduce(gx * t_input + gt * t_target, ctx.mode)
