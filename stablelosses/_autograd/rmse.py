"""Root-mean-square error as one Function (no overflow of r², gradient r/(D·rmse))."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from stablelosses._autograd._base import applier
from stablelosses._autograd._residual import residual_grads, residual_tangent

# 2**-600: float64 residuals up to the largest double square to at most 2**-176 times it.
_DOWN, _UP = 2.0**-600, 2.0**600


def _norm(r: Tensor) -> Tensor:
    """``sqrt(Σ r²)`` in float64 without overflow of the squares (0 for an empty ``r``).

    A float32 square fits float64. Eager torch's ``vector_norm(dtype=float64)`` makes a float64
    copy of ``r`` first (``_to_copy``: the peak and most of the eager time on CPU); compiled,
    inductor casts inside the one reduction. A float64 square overflows past 1.3e154, so the
    norm of ``r · 2**-600`` (scaled back) is taken there. One spelling, eager and compiled.
    """
    if r.dtype != torch.float64:
        return torch.linalg.vector_norm(r, dtype=torch.float64)
    direct = torch.linalg.vector_norm(r)
    return torch.where(direct == math.inf, torch.linalg.vector_norm(r * _DOWN) * _UP, direct)


def _sensitivity(r: Tensor, value: Tensor, mode: str, g: Tensor) -> Tensor:
    """``g · r / (D·rmse)`` elementwise, 0 where ``rmse == 0``.

    ``r_i / rmse`` is bounded by ``sqrt(D)``; dividing ``r`` by ``rmse · D / g`` keeps that
    order (``1 / rmse`` alone would overflow for a subnormal rmse). Where rmse == 0 every
    ``r_i`` is 0 and the safe divisor 1 gives the defined value 0.
    """
    safe = value.masked_fill(value == 0, 1)
    if mode == "none":
        return r / safe * g
    return r / (safe * (r.numel() if mode == "mean" else 1) / g)


class _RMSE(torch.autograd.Function):
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
        value = _norm(r)
        if mode == "mean":
            value = value / r.numel() ** 0.5  # 0 / 0 = NaN for an empty input, as torch
        if eps != 0.0:
            value = torch.hypot(value, value.new_full((), math.sqrt(eps)))
        return value.to(r.dtype), r

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        input, target, mode, _ = inputs
        value, r = output
        ctx.save_for_backward(r, value)
        ctx.save_for_forward(r, value)
        ctx.mode = mode
        ctx.shapes = input.shape, target.shape
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, grad_r: Tensor | None
                 ) -> tuple[Tensor | None, Tensor | None, None, None]:
        r, value = ctx.saved_tensors
        g = None if grad is None else _sensitivity(r, value, ctx.mode, grad)
        return *residual_grads(ctx, g, grad_r), None, None

    @staticmethod
    def jvp(ctx: Any, t_input: Tensor | None, t_target: Tensor | None, _m: None, _e: None
            ) -> tuple[Tensor, Tensor]:
        r, value = ctx.saved_tensors
        t_r = residual_tangent(r, t_input, t_target)
        g = _sensitivity(r, value, ctx.mode, torch.ones_like(value))
        return (g * t_r if ctx.mode == "none" else (g * t_r).sum()), t_r


_rmse = applier(_RMSE)
