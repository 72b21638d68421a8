"""Root-mean-square error as one Function (no overflow of r², gradient r/(D·rmse))."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from stablelosses._autograd._base import StableFunction
from stablelosses._autograd._residual import residual_grads, residual_tangent

# 2**-600: float64 residuals up to the largest double square to at most 2**-176 times it;
# 2**600 lifts residuals whose norm is below 2**-450 to squares of at most 2**300.
_DOWN, _UP, _TINY = 2.0**-600, 2.0**600, 2.0**-450


def _norm(r: Tensor) -> Tensor:
    """``sqrt(Σ r²)`` in float64 without overflow or underflow of the squares (0 for an empty
    ``r``).

    A float32 square fits float64. Eager torch's ``vector_norm(dtype=float64)`` makes a float64
    copy of its whole input first (``_to_copy``, on the CPU and on CUDA), so the eager forward
    norms the two halves of ``r`` and joins them with ``hypot``: the copy then holds half of
    ``r`` at a time, and one forward+backward peaks at ``r`` and the gradient, as
    ``sqrt(F.mse_loss)`` does (1e6 and 1e7: peak 3.0 → 2.0 times the gradient, against
    torch's 2.0; the same bytes moved, 2 scalar operators more). Compiled, inductor casts inside
    one reduction (no copy), and a second reduction would be a kernel more: there, and where
    autograd records the norm (the differentiable backward: ``hypot``'s derivative at
    ``(0, 0)`` is NaN), one norm. A float64 square overflows past 1.3e154 and loses its digits
    below 1.5e-154, so float64 residuals are normed again scaled by a power of two (exact):
    ``2**-600`` where the direct norm is ``inf``, ``2**600`` where it is below ``2**-450``
    (every square of ``r · 2**600`` then fits), 1 elsewhere (the same value).
    """
    if r.dtype != torch.float64:
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return torch.linalg.vector_norm(r, dtype=torch.float64)
        head, tail = r.reshape(-1).tensor_split(2)
        return torch.hypot(torch.linalg.vector_norm(head, dtype=torch.float64),
                           torch.linalg.vector_norm(tail, dtype=torch.float64))
    direct = torch.linalg.vector_norm(r)
    s = torch.where(direct == math.inf, _DOWN, torch.where(direct < _TINY, _UP, torch.ones_like(direct)))
    return torch.linalg.vector_norm(r * s) / s


def _value(r: Tensor, mode: str, eps: float) -> Tensor:
    """The reduced rmse of ``r`` (``'mean'``/``'sum'``), in float64: the forward's value before
    its cast, and a differentiable graph of ``r`` for the double backward."""
    value = _norm(r)
    if mode == "mean":
        value = value / r.numel() ** 0.5  # 0 / 0 = NaN for an empty input, as torch
    if eps != 0.0:
        value = torch.hypot(value, value.new_full((), math.sqrt(eps)))
    return value


def _sensitivity(r: Tensor, value: Tensor, mode: str, g: Tensor, eps: float) -> Tensor:
    """``g · r / (D·rmse)`` elementwise, 0 where ``rmse == 0``.

    First order: one pass, ``r / (rmse · D / g)``: ``r_i / rmse`` is bounded by ``sqrt(D)`` and
    the divisor neither over- nor underflows for any ``g`` a loss sends back. Where rmse == 0
    every ``r_i`` is 0 and the safe divisor 1 gives the defined value 0.

    Differentiable (grad mode on: a double backward follows): the same formula, the same
    values, with the rmse recomputed from ``r`` (`_value`, float64 inside) rather than read from
    the saved output, whose own backward would then take that chain's incoming gradient
    (``~1/rmse``): in float32 its divisor underflowed for an rmse of ``1e-30``.

    ``'none'`` without ``eps``: ``sign(r) · g``, the same values (0 at 0), whose derivative is 0
    (``r / |r|`` would differentiate to ``inf − inf`` at a subnormal ``r``). With ``eps``:
    ``r / sqrt(r² + eps)`` on both clamped to ``finfo.max``, so that an infinite ``r`` gives the
    limit ``sign(r)`` (``inf / inf`` was NaN) and, through the clamps, a second derivative of 0.
    """
    if mode == "none":
        if eps == 0.0:  # (sign(NaN) is 0 in torch: the NaN is kept by the select)
            return torch.where(torch.isnan(r), r, torch.sign(r)) * g
        fmax = torch.finfo(r.dtype).max
        return r.clamp(-fmax, fmax) / value.clamp(max=fmax) * g
    if torch.is_grad_enabled():
        value = _value(r, mode, eps).to(r.dtype)  # a graph of r, not the saved output
    safe = value.masked_fill(value == 0, 1)
    return r / ((safe * r.numel() if mode == "mean" else safe) / g)


class _RMSE(StableFunction):
    """``(sqrt(reduce((input - target)**2) + eps), input - target)``; ``mode`` 'none', 'mean'
    or 'sum'.

    Forward: the residual ``r`` (returned as a second output, so that backward reuses the pass
    that made it instead of subtracting again), its norm in float64 (``_norm``), then
    ``/ sqrt(N)`` for the mean, and ``hypot(·, sqrt(eps))`` for ``eps > 0`` (which never forms
    the squares). Backward and forward mode: ``r / (D·rmse)``, defined 0 where ``rmse == 0``,
    plus the incoming gradient of ``r`` itself (none from the public wrapper).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(input: Tensor, target: Tensor, mode: str, eps: float) -> tuple[Tensor, Tensor]:
        r = input - target
        if mode == "none":
            # sqrt(r² + eps) = hypot(r, sqrt(eps)), which never forms r².
            return (r.abs() if eps == 0.0 else torch.hypot(r, r.new_full((), math.sqrt(eps)))), r
        return _value(r, mode, eps).to(r.dtype), r

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        input, target, mode, eps = inputs
        value, r = output
        ctx.save_for_backward(r, value)
        ctx.save_for_forward(r, value)
        ctx.mode, ctx.eps = mode, eps
        ctx.shapes = input.shape, target.shape
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, grad_r: Tensor | None
                 ) -> tuple[Tensor | None, Tensor | None, None, None]:
        r, value = ctx.saved_tensors
        g = None if grad is None else _sensitivity(r, value, ctx.mode, grad, ctx.eps)
        return *residual_grads(ctx, g, grad_r), None, None

    @staticmethod
    def jvp(ctx: Any, t_input: Tensor | None, t_target: Tensor | None, _m: None, _e: None
            ) -> tuple[Tensor, Tensor]:
        r, value = ctx.saved_tensors
        t_r = residual_tangent(r, t_input, t_target)
        g = _sensitivity(r, value, ctx.mode, torch.ones_like(value), ctx.eps)
        return (g * t_r if ctx.mode == "none" else (g * t_r).sum()), t_r
