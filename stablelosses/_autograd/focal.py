"""Multi-class focal loss on logits as one fused autograd Function.

With ``l = log p_t`` and ``m = 1 - p_t = -expm1(l)`` the loss is ``f(l) = m^γ (-l)`` and

    -f'(l) = m^γ (1 + γ p_t r),   r = (-log p_t) / (1 - p_t)  (r → 1 as p_t → 1).

Grouping ``(1 - p)^(γ-1) (-log p)`` as ``m^γ · r`` keeps every factor finite for all γ ≥ 0,
including 0 < γ < 1 where ``(1 - p)^(γ-1)`` alone blows up as ``p_t → 1``. Since
``d l / d x = onehot(t) - softmax(x)``, the logit gradient is ``a · (softmax - onehot)`` with
``a = w_t m^γ (1 + γ p_t r)``: the cross-entropy backward with a per-row scale.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stablelosses._autograd.cross_entropy import _add_lsm_grad, index_forward, softmax_minus_target


def _modulator_and_factor(lt: Tensor, gamma: float):
    """``m^γ`` and ``1 + γ p r``, ``m = 1 - p = -expm1(l)``, ``r = (-l)/m`` with its limits.

    ``r = 1`` at ``m = 0`` (``p = 1``); at ``l = -inf`` the clamp makes ``r`` finite so that
    ``p·r = 0·r = 0``, the limit of ``-p log p / (1 - p)``.
    """
    em = torch.expm1(lt)
    r = torch.where(em == 0, 1.0, lt.clamp(min=-torch.finfo(lt.dtype).max) / em)
    one = torch.ones((), dtype=lt.dtype, device=lt.device)
    return torch.pow(em.neg(), gamma), torch.addcmul(one, torch.exp(lt), r, value=gamma)


def focal_row_scale(lt: Tensor, gamma: float) -> Tensor:
    """The backward's row scale ``m^γ (1 + γ p r)``."""
    mg, factor = _modulator_and_factor(lt, gamma)
    return mg * factor


def focal_value_and_scale(lt: Tensor, gamma: float):
    """``m^γ (-l)`` and the backward row scale ``m^γ (1 + γ p r)``, sharing ``m^γ``."""
    if gamma == 0.0:
        return -lt, None
    mg, factor = _modulator_and_factor(lt, gamma)
    return mg * lt.neg(), mg * factor


class _FocalLoss(torch.autograd.Function):
    """Focal loss, class-index targets.

    Outputs: loss (0 on invalid rows); log-probabilities and the target's log-probability
    (extra outputs, so that double backward differentiates the backward exactly); the
    mean's per-row denominator weight; the valid-row mask.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x, target, weight, gamma, ignore_index, cdim):
        lsm, lt, valid, idx = index_forward(x, target, ignore_index, cdim)
        val, scale = focal_value_and_scale(lt, gamma)
        if scale is None:
            scale = torch.ones_like(lt)
        if weight is not None:
            w_t = weight[idx.squeeze(cdim)]
            # 0 * inf = 0: a zero class weight removes the term.
            val = torch.where(w_t == 0, 0.0, w_t * val)
            denom = torch.where(valid, w_t, 0.0)
        else:
            denom = valid.to(x.dtype)
        loss = torch.where(valid, val, 0.0)
        # scale: the backward's row scale for first-order use (double backward recomputes it).
        return loss, lsm, lt, denom, valid, idx, scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, target, weight, gamma, ignore_index, cdim = inputs
        _, lsm, lt, denom, valid, idx, scale = output
        ctx.mark_non_differentiable(denom, valid, idx, scale)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(weight, lsm, lt, valid, idx, scale)
        ctx.gamma = gamma
        ctx.ignore_index = ignore_index
        ctx.cdim = cdim

    @staticmethod
    def backward(ctx, grad_loss, grad_lsm, grad_lt, _gd, _gv, _gi, _gs):
        weight, lsm, lt, valid, idx, scale = ctx.saved_tensors
        cdim = ctx.cdim
        if grad_loss is None and grad_lt is None and grad_lsm is None:
            return None, None, None, None, None, None
        a = None
        if grad_loss is not None:
            if weight is not None:
                grad_loss = grad_loss * weight[idx.squeeze(cdim)]
            if ctx.gamma != 0.0:
                if torch.is_grad_enabled():  # double backward: the scale's own derivative
                    scale = focal_row_scale(lt, ctx.gamma)
                grad_loss = grad_loss * scale
            # a = 0 on invalid rows, also where the row's scale or grad_loss is not finite.
            a = torch.where(valid, grad_loss, 0.0)
        if grad_lt is not None:
            # d log p_t / dx = onehot(t) - softmax
            a = -grad_lt if a is None else a - grad_lt
        if a is None:
            g = torch.zeros_like(lsm)
        else:
            g = softmax_minus_target(lsm, a, idx, a, cdim)
        g = _add_lsm_grad(g, lsm, grad_lsm, cdim)
        return g, None, None, None, None, None
