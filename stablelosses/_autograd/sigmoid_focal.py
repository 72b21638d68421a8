"""Sigmoid (binary) focal loss as one fused Function with an analytic backward.

Notation, per element, for logit ``x`` and target ``t``:

* ``a = |x|``, ``e = exp(-a)``, ``big = σ(a) = 1/(1+e)``, ``small = σ(-a) = e·big``;
* ``w`` = the target mass on the side the logit does *not* favour: ``1 - t`` for ``x >= 0``,
  ``t`` for ``x < 0``;
* ``ce = BCE(x, t) = t·softplus(-x) + (1-t)·softplus(x) = log1p(e) + w·a`` (a sum of
  non-negative terms, so no cancellation);
* ``q = 1 - p_t = t·σ(-x) + (1-t)·σ(x) = w·big + (1-w)·small = big·(w + (1-w)·e)``, again a
  sum of non-negative terms, so ``q`` has full relative precision even when it is tiny;
* ``loss = α_t · ce · q**γ`` with ``α_t = α·t + (1-α)·(1-t)`` (1 when ``α < 0``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stablelosses._utils import MEAN, NONE, reduce, sum_to

# Elements per chunk of the eager, no-autograd paths: the ~10 temporaries of a chunk stay
# in cache instead of each being a full-size tensor.
_CHUNK = 1 << 16


def _parts(x: Tensor, t: Tensor):
    a = x.abs()
    e = torch.exp(-a)
    big = torch.reciprocal(1 + e)
    small = e * big
    pos = x >= 0
    w = torch.where(pos, 1 - t, t)
    ce = torch.addcmul(torch.log1p(e), w, a)
    return a, e, big, small, pos, w, ce


def _alpha_t(t: Tensor, alpha: float):
    # α·t + (1-α)·(1-t) = (1-α) + (2α-1)·t
    return (2 * alpha - 1) * t + (1 - alpha)


def _loss(x: Tensor, t: Tensor, alpha: float, gamma: float) -> Tensor:
    a, e, big, small, pos, w, ce = _parts(x, t)
    loss = ce
    if gamma != 0.0:
        q = big * torch.addcmul(w, 1 - w, e)
        loss = loss * q.pow(gamma)
    if alpha >= 0:
        loss = loss * _alpha_t(t, alpha)
    return loss


def _grads(x: Tensor, t: Tensor, alpha: float, gamma: float, need_x: bool, need_t: bool):
    """d loss / d x and d loss / d t, elementwise, in differentiable torch ops."""
    a, e, big, small, pos, w, ce = _parts(x, t)
    # d ce/dx = σ(x) - t = ±(w - small);  d q/dx = (1-2t)·σ(x)σ(-x) = ±(2w-1)·big·small.
    gx = gt = None
    if gamma != 0.0:
        den = torch.addcmul(w, 1 - w, e)  # q / big
        q = big * den
        mod = q.pow(gamma)
        # (dq/dx)/q = ±(2w-1)·small/den. den == 0 only where q == 0, where mod = 0 and the
        # true ratio is finite: double where with a finite stand-in.
        q0 = den == 0
        ratio = torch.where(q0, 0.0, small / torch.where(q0, 1.0, den))
        if need_x:
            core = (w - small) + gamma * (2 * w - 1) * ce * ratio
            gx = mod * torch.where(pos, core, -core)
        if need_t:
            # d q/dt = σ(-x) - σ(x) = ∓(big - small); ce/q stays finite as q → 0 (ce → q).
            ce_q = torch.where(q0, 0.0, ce / torch.where(q0, 1.0, q))
            d = gamma * (big - small) * ce_q
            gt = mod * (-x - torch.where(pos, d, -d))
            if alpha >= 0:
                gt = gt * _alpha_t(t, alpha) + (2 * alpha - 1) * ce * mod
    else:
        if need_x:
            core = w - small
            gx = torch.where(pos, core, -core)
        if need_t:
            gt = -x
            if alpha >= 0:
                gt = gt * _alpha_t(t, alpha) + (2 * alpha - 1) * ce
    if gx is not None and alpha >= 0:
        gx = gx * _alpha_t(t, alpha)
    return gx, gt


def _chunkable(x: Tensor, t: Tensor) -> bool:
    return (
        x.numel() > _CHUNK
        and x.shape == t.shape
        and x.is_contiguous()
        and t.is_contiguous()
        and not torch.compiler.is_compiling()
        and not torch._C._functorch.is_functorch_wrapped_tensor(x)
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
    )


class _SigmoidFocal(torch.autograd.Function):
    """``reduce(α_t · BCE(x, t) · (1 - p_t)**γ)``; ``mode`` 0 = none, 1 = mean, 2 = sum."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input: Tensor, target: Tensor, alpha: float, gamma: float, mode: int) -> Tensor:
        if _chunkable(input, target):
            xf, tf = input.reshape(-1), target.reshape(-1)
            n = xf.numel()
            if mode == NONE:
                out = torch.empty_like(xf)
                for i in range(0, n, _CHUNK):
                    out[i : i + _CHUNK] = _loss(xf[i : i + _CHUNK], tf[i : i + _CHUNK], alpha, gamma)
                return out.view(input.shape)
            parts = [
                _loss(xf[i : i + _CHUNK], tf[i : i + _CHUNK], alpha, gamma).sum()
                for i in range(0, n, _CHUNK)
            ]
            total = torch.stack(parts).sum()
            return total / n if mode == MEAN else total
        return reduce(_loss(input, target, alpha, gamma), mode)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, target, alpha, gamma, mode = inputs
        ctx.save_for_backward(input, target)
        ctx.alpha, ctx.gamma, ctx.mode = alpha, gamma, mode

    @staticmethod
    def backward(ctx, grad_output):
        input, target = ctx.saved_tensors
        alpha, gamma, mode = ctx.alpha, ctx.gamma, ctx.mode
        need_x, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        shape = torch.broadcast_shapes(input.shape, target.shape)
        n = max(1, shape.numel())
        scale = grad_output / n if mode == MEAN else grad_output
        if not torch.is_grad_enabled() and _chunkable(input, target):
            xf, tf = input.reshape(-1), target.reshape(-1)
            gf = scale.reshape(-1)
            gx = torch.empty_like(xf) if need_x else None
            gt = torch.empty_like(tf) if need_t else None
            for i in range(0, xf.numel(), _CHUNK):
                sl = slice(i, i + _CHUNK)
                g = gf[sl] if mode == NONE else gf
                cx, ct = _grads(xf[sl], tf[sl], alpha, gamma, need_x, need_t)
                if need_x:
                    torch.mul(cx, g, out=gx[sl])
                if need_t:
                    torch.mul(ct, g, out=gt[sl])
            return (
                gx.view(input.shape) if need_x else None,
                gt.view(target.shape) if need_t else None,
                None,
                None,
                None,
            )
        gx, gt = _grads(input, target, alpha, gamma, need_x, need_t)
        grad_input = sum_to(gx * scale, input.shape) if need_x else None
        grad_target = sum_to(gt * scale, target.shape) if need_t else None
        return grad_input, grad_target, None, None, None
