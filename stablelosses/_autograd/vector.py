"""Normalising a vector: ``x / max(‖x‖_p, eps)`` with a defined gradient at the zero vector.

The norm is computed from ``x / max|x|`` and scaled back, so entries of 1e20 or 3e38 (whose
squares overflow) and of 1e-30 (whose squares underflow to 0) still give the exact unit
vector. ``torch.nn.functional.normalize`` of a zero vector with its default ``eps=1e-12``
has gradient ``1/eps = 1e12``; with ``eps = 0`` here the zero vector maps to 0 with gradient 0
(the minimal-norm choice; the direction of 0 is undefined).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from stablelosses._autograd._base import StableFunction


def _norm_direction(x: Tensor, y: Tensor, n: Tensor, p: float, dim: int, eps: float) -> Tensor:
    """``∂‖x‖_p/∂x``: ``sign(u)·|u|^(p−1)`` with ``u = x/‖x‖``; 0 at the zero vector.

    ``u`` is the output ``y`` where the ``eps`` clamp is off (exact even when ``‖x‖``
    overflows). For ``p = inf`` the derivative is split evenly over the entries that reach the
    maximum (as ``torch.amax``'s backward does).
    """
    u = y if eps == 0.0 else torch.where(n < eps, x / n.masked_fill(n == 0, 1.0), y)
    if p == 2.0:
        return u
    if p == 1.0:
        return torch.sign(x)  # not sign(u): x/‖x‖ can underflow to 0 for a subnormal entry
    if math.isinf(p):
        hit = (u.abs() == 1) & (n != 0)
        count = hit.sum(dim, keepdim=True).clamp_min(1)
        return torch.sign(u) * hit / count
    return torch.sign(x) * u.abs().pow(p - 1.0)


def _denominator(n: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``d = max(n, eps)`` and whether ``d`` moves with the norm (``c = 1``) or is ``eps``."""
    if eps == 0.0:
        return n, torch.ones((), dtype=n.dtype, device=n.device)
    return n.clamp_min(eps), (n >= eps).to(n.dtype)  # clamp_min's own backward rule


class _Normalize(StableFunction):
    """``(y, n) = (x / max(n, eps), ‖x‖_p)`` over ``dim`` (``n`` kept as an extra output).

    Backward: ``(g_y − c·⟨g_y, y⟩·w) / d + g_n·w`` with ``w = ∂n/∂x`` and ``c = 0`` where the
    ``eps`` clamp is active; defined 0 where ``d == 0`` (zero vector with ``eps = 0``).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, p: float, dim: int, eps: float) -> tuple[Tensor, Tensor]:
        if x.shape[dim] == 0:  # nothing to scale: torch's empty norm is 0
            n = torch.linalg.vector_norm(x, p, dim, keepdim=True)
            return x.clone(), n
        # ‖x‖ = s·‖x/s‖ with s = max|x|: no square overflows or underflows to 0, and the unit
        # vector (x/s)/‖x/s‖ is exact even where ‖x‖ itself overflows.
        s = x.abs().amax(dim, keepdim=True)
        s = s.masked_fill(s == 0, 1.0)
        u = x / s
        t = torch.linalg.vector_norm(u, p, dim, keepdim=True)
        n = t * s
        y = u / t.masked_fill(t == 0, 1.0)  # u is 0 where t is 0
        if eps == 0.0:
            return y, n
        # select on the clamped set, so a NaN norm keeps the all-NaN y (NaN in, NaN out)
        return torch.where(n < eps, x / eps, y), n

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, p, dim, eps = inputs
        y, n = output
        ctx.p, ctx.dim, ctx.eps = p, dim, eps
        ctx.save_for_backward(x, y, n)
        ctx.save_for_forward(x, y, n)

    @staticmethod
    def backward(ctx, grad_y: Tensor, grad_n: Tensor):
        x, y, n = ctx.saved_tensors
        w = _norm_direction(x, y, n, ctx.p, ctx.dim, ctx.eps)
        d, c = _denominator(n, ctx.eps)
        zero = d == 0
        inner = (grad_y * y).sum(ctx.dim, keepdim=True)
        # Double where: a safe divisor, then the defined 0 on the zero vector.
        gx = (grad_y - (c * inner) * w) / d.masked_fill(zero, 1.0) + grad_n * w
        return gx.masked_fill(zero, 0.0), None, None, None

    @staticmethod
    def jvp(ctx, tx: Tensor, _p, _dim, _eps):
        x, y, n = ctx.saved_tensors
        w = _norm_direction(x, y, n, ctx.p, ctx.dim, ctx.eps)
        d, c = _denominator(n, ctx.eps)
        zero = d == 0
        tn = (w * tx).sum(ctx.dim, keepdim=True)
        ty = (tx - y * (c * tn)) / d.masked_fill(zero, 1.0)
        return ty.masked_fill(zero, 0.0), tn
