"""Cross-entropy on logits as fused autograd Functions with an analytic backward.

The forward runs torch's ``log_softmax`` on the logits clamped to ``±finfo.max``. The clamp
is the identity on every finite logit; it maps ``+inf`` to the largest float (so a row with
``+inf`` logits gives the limit distribution, uniform over the ``+inf`` entries, instead of
``inf - inf = NaN``) and ``-inf`` to the most negative float (so a fully masked row gives a
finite, uniform row that the loss then ignores). A log-probability at or below ``-finfo.max``
is read back as ``-inf``: its probability is ``exp(-finfo.max) = 0`` either way.

Backward of ``-sum_c q_c log p_c`` with respect to the logits is ``p * sum(q) - q``
(softmax minus the target distribution). ``p`` is ``exp`` of the saved log-probabilities,
which the Function returns as an extra output so that double backward is exact.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from stablelosses._utils import inplace_ok


def _lsm_prelude(x: Tensor, cdim: int) -> Tuple[Tensor, Tensor, float]:
    """``log_softmax`` of the logits clamped to ``±finfo.max``, the logsumexp read off class 0."""
    fmax = torch.finfo(x.dtype).max
    # clamp(±inf) = ±finfo.max; the identity on finite logits and NaN.
    xc = x.clamp(-fmax, fmax)
    lsm = torch.log_softmax(xc, cdim)
    # log p_c = x_c - lse for every c; class 0 is a view, no gather.
    lse = (xc.narrow(cdim, 0, 1) - lsm.narrow(cdim, 0, 1)).squeeze(cdim)
    return lsm, lse, fmax


def _exact_log_prob(lp: Tensor) -> Tensor:
    """Read a log-probability at or below ``-finfo.max`` back as ``-inf``: its probability
    ``exp(-finfo.max)`` is 0 either way."""
    return torch.where(lp <= -torch.finfo(lp.dtype).max, -float("inf"), lp)


def index_forward(
    x: Tensor, target: Tensor, ignore_index: int, cdim: int
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """log-softmax, the target's log-probability, the valid-row mask and the safe index.

    A row is valid when its target is not ``ignore_index`` and its logits are not all
    ``-inf``. A fully masked row is constant ``-fmax`` after the clamp, so its logsumexp,
    read off any class as ``x_c - log p_c``, rounds to ``-fmax`` (``log C`` is far below one
    ulp there); a row with a finite logit has a logsumexp above ``-fmax``.
    """
    lsm, lse, fmax = _lsm_prelude(x, cdim)
    kept = target != ignore_index
    idx = torch.where(kept, target, 0).unsqueeze(cdim)
    lt = lsm.gather(cdim, idx).squeeze(cdim)
    valid = (lse != -fmax) & kept
    # log p_t <= -finfo.max means p_t underflowed to exactly 0: log p_t = -inf.
    lt = _exact_log_prob(lt)
    return lsm, lt, valid, idx


def smoothing_terms(
    x: Tensor, lsm: Tensor, weight: Optional[Tensor], cdim: int, wshape
) -> Tuple[Tensor, Tensor, Tensor]:
    """``masked`` (logit is -inf), the unmasked-class count K (>= 1) and sum_c w_c over them."""
    masked = x == -float("inf")
    unmasked = (~masked).to(x.dtype)
    k = unmasked.sum(cdim).clamp(min=1.0)
    if weight is None:
        wsum = k
    else:
        wsum = (unmasked * weight.view(wshape)).sum(cdim)
    return masked, k, wsum


def _wshape(ndim: int, cdim: int):
    shape = [1] * ndim
    shape[cdim] = -1
    return shape


def _add_lsm_grad(g: Tensor, lsm: Tensor, grad_lsm: Optional[Tensor], cdim: int) -> Tensor:
    """Gradient through the extra log-softmax output: ``dl - p * sum(dl)``."""
    if grad_lsm is None:
        return g
    return g + grad_lsm - torch.exp(lsm) * grad_lsm.sum(cdim, keepdim=True)


def softmax_minus_target(
    lsm: Tensor, row_scale: Tensor, idx: Tensor, t_scale: Tensor, cdim: int,
    dense: Optional[Tensor] = None,
) -> Tensor:
    """``exp(lsm) * row_scale - dense - onehot(idx) * t_scale`` in few full passes."""
    row_scale = row_scale.unsqueeze(cdim)
    t_scale = t_scale.unsqueeze(cdim)
    if not inplace_ok(lsm, row_scale, t_scale, dense):
        # Double backward needs exp's saved result intact: out-of-place.
        g = torch.exp(lsm) * row_scale
        if dense is not None:
            g = g - dense
        return g.scatter_add(cdim, idx, -t_scale)
    g = torch.exp(lsm)
    g.mul_(row_scale)
    if dense is not None:
        g.sub_(dense)
    return g.scatter_add_(cdim, idx, -t_scale)


class _CrossEntropyIndex(torch.autograd.Function):
    """Cross-entropy with class-index targets, optional weight and label smoothing.

    Outputs: per-element loss (0 on invalid rows), log-probabilities (extra output for
    double backward), the mean's per-row denominator weight and the valid-row mask.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x, target, weight, ignore_index, label_smoothing, cdim):
        lsm, lt, valid, idx = index_forward(x, target, ignore_index, cdim)
        nll = -lt
        w_t = None
        if weight is not None:
            w_t = weight[idx.squeeze(cdim)]
        coef = w_t if label_smoothing == 0.0 else (1.0 - label_smoothing) * (1.0 if w_t is None else w_t)
        if isinstance(coef, Tensor):
            # 0 * (-log 0) = 0: a target term with zero weight contributes nothing.
            nll = torch.where(coef == 0, 0.0, coef * nll)
        elif coef == 0.0:
            nll = torch.zeros_like(nll)
        elif coef is not None:
            nll = coef * nll
        if label_smoothing > 0.0:
            wshape = _wshape(x.dim(), cdim)
            masked, k, _ = smoothing_terms(x, lsm, weight, cdim, wshape)
            # masked classes carry no smoothing mass: 0 * (-inf) = 0.
            term = torch.where(masked, torch.zeros_like(lsm), lsm)
            if weight is not None:
                term = term * weight.view(wshape)
            smooth = -term.sum(cdim)
            nll = nll + (label_smoothing / k) * smooth
        loss = torch.where(valid, nll, 0.0)
        denom = valid.to(x.dtype) if w_t is None else torch.where(valid, w_t, 0.0)
        return loss, lsm, denom, valid, idx

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, target, weight, ignore_index, label_smoothing, cdim = inputs
        _, lsm, denom, valid, idx = output
        ctx.mark_non_differentiable(denom, valid, idx)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, lsm, valid, idx)
        ctx.ignore_index = ignore_index
        ctx.label_smoothing = label_smoothing
        ctx.cdim = cdim

    @staticmethod
    def backward(ctx, grad_loss, grad_lsm, _gd, _gv, _gi):
        x, weight, lsm, valid, idx = ctx.saved_tensors
        cdim, eps = ctx.cdim, ctx.label_smoothing
        if grad_loss is None and grad_lsm is None:
            return None, None, None, None, None, None
        if grad_loss is None:
            g = _add_lsm_grad(torch.zeros_like(lsm), lsm, grad_lsm, cdim)
            return g, None, None, None, None, None
        s = torch.where(valid, grad_loss, 0.0)
        t_scale = s if weight is None else s * weight[idx.squeeze(cdim)]
        if eps > 0.0:
            wshape = _wshape(x.dim(), cdim)
            masked, k, wsum = smoothing_terms(x, lsm, weight, cdim, wshape)
            t_scale = (1.0 - eps) * t_scale
            smooth_scale = s * (eps / k)
            # sum_c q_c = (1 - eps) w_t + eps / K * sum_{unmasked} w_c
            row_scale = t_scale + smooth_scale * wsum
            dense = smooth_scale.unsqueeze(cdim)
            if weight is not None:
                dense = dense * weight.view(wshape)
            dense = torch.where(masked, torch.zeros_like(lsm), dense.expand_as(lsm))
            g = softmax_minus_target(lsm, row_scale, idx, t_scale, cdim, dense)
        else:
            g = softmax_minus_target(lsm, t_scale, idx, t_scale, cdim)
        g = _add_lsm_grad(g, lsm, grad_lsm, cdim)
        return g, None, None, None, None, None


class _CrossEntropyProb(torch.autograd.Function):
    """Cross-entropy with class-probability targets, optional weight and label smoothing.

    Outputs: per-element loss (0 on fully masked rows), log-probabilities (extra output)
    and the valid-row mask (the mean divides by the number of valid rows).
    """

    generate_vmap_rule = True

    @staticmethod
    def _target_dist(x, lsm, target, weight, label_smoothing, cdim):
        q = target
        masked = None
        if label_smoothing > 0.0:
            wshape = _wshape(x.dim(), cdim)
            masked, k, _ = smoothing_terms(x, lsm, weight, cdim, wshape)
            # eps / K on each unmasked class, nothing on masked ones.
            spread = torch.where(masked, torch.zeros_like(lsm), (label_smoothing / k).unsqueeze(cdim).expand_as(lsm))
            q = (1.0 - label_smoothing) * target + spread
        if weight is not None:
            q = q * weight.view(_wshape(x.dim(), cdim))
        return q

    @staticmethod
    def forward(x, target, weight, label_smoothing, cdim):
        lsm, lse, fmax = _lsm_prelude(x, cdim)
        q = _CrossEntropyProb._target_dist(x, lsm, target, weight, label_smoothing, cdim)
        logp = _exact_log_prob(lsm)
        # 0 * log 0 = 0: classes without target mass contribute nothing.
        terms = torch.where(q == 0, torch.zeros_like(lsm), q * logp)
        loss = -terms.sum(cdim)
        valid = lse != -fmax
        loss = torch.where(valid, loss, 0.0)
        return loss, lsm, valid

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, target, weight, label_smoothing, cdim = inputs
        _, lsm, valid = output
        ctx.mark_non_differentiable(valid)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, target, weight, lsm, valid)
        ctx.label_smoothing = label_smoothing
        ctx.cdim = cdim

    @staticmethod
    def backward(ctx, grad_loss, grad_lsm, _gv):
        x, target, weight, lsm, valid = ctx.saved_tensors
        cdim, eps = ctx.cdim, ctx.label_smoothing
        gx = gt = None
        if grad_loss is not None:
            s = torch.where(valid, grad_loss, torch.zeros_like(grad_loss)).unsqueeze(cdim)
            q = _CrossEntropyProb._target_dist(x, lsm, target, weight, eps, cdim)
            if ctx.needs_input_grad[0]:
                gx = torch.exp(lsm) * (q.sum(cdim, keepdim=True) * s) - q * s
            if ctx.needs_input_grad[1]:
                gt = -(1.0 - eps) * _exact_log_prob(lsm) * s
                if weight is not None:
                    gt = gt * weight.view(_wshape(x.dim(), cdim))
        if grad_lsm is not None:
            base = gx if gx is not None else torch.zeros_like(lsm)
            gx = _add_lsm_grad(base, lsm, grad_lsm, cdim)
        return gx, gt, None, None, None
