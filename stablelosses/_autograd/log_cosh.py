"""log(cosh(r)) without overflow, gradient tanh(r)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from stablelosses._autograd._base import applier
from stablelosses._autograd._residual import residual_grads, residual_tangent
from stablelosses._utils import MEAN, reduce

_LOG2 = math.log(2.0)
# Below it log1p(2 sinh²(r/2)) is the accurate form, above it |r| + softplus(-2|r|) - log 2; at 2
# both are within about 1.4 ulp of log cosh r (measured against mpmath, float32 and float64).
_CROSSOVER = 2.0


def _log_cosh_values(r: Tensor) -> Tensor:
    """``log(cosh(r))`` elementwise, within about 1.5 ulp for every ``r`` (float32 and float64).

    * ``|r| < _CROSSOVER``: ``cosh r = 1 + 2 sinh²(r/2)``, so ``log1p(2 sinh²(r/2))``: no
      cancellation, and ``r²/2`` (down to subnormals) for tiny ``r``; ``2 sinh²`` is formed as
      ``s · 2s``, one rounding.
    * above: ``log(e^r + e^-r) - log 2 = |r| + softplus(-2|r|) - log 2`` (``logaddexp``), finite
      for every finite ``r``; it cancels below the crossover (no digit right at ``|r| = 1e-4``).

    Both branches are computed and selected with ``where``; the small branch sees 0 where it is
    not selected (double where), so ``sinh`` never overflows there. NaN takes the large branch
    and stays NaN.
    """
    small = r.abs() < _CROSSOVER
    s = torch.sinh(torch.where(small, r, 0.0).mul_(0.5))
    near = torch.log1p(s.mul(2.0).mul_(s))
    # "- log 2" per element, in place on our fresh buffer (no cancellation against a summed N·log 2)
    far = torch.logaddexp(r, -r).sub_(_LOG2)
    return torch.where(small, near, far)


def _slope(r: Tensor, mode: int, g: Tensor) -> Tensor:
    """``g · tanh(r)`` (times ``1/N`` for the mean): d log cosh r / d r = tanh r, bounded by 1."""
    return torch.tanh(r) * (g / r.numel() if mode == MEAN else g)


class _LogCosh(torch.autograd.Function):
    """``(log(cosh(input - target)) reduced by mode, input - target)``; ``mode`` 0 none, 1 mean,
    2 sum.

    The residual is a second output, so that backward reuses the pass that made it instead of
    subtracting again. Backward and forward mode use ``tanh(r)``, never the ``inf/inf`` of
    ``sinh r / cosh r``, plus the incoming gradient of ``r`` itself (none from the public
    wrapper).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(input: Tensor, target: Tensor, mode: int) -> tuple[Tensor, Tensor]:
        r = input - target
        return reduce(_log_cosh_values(r), mode), r

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, target, mode = inputs
        _, r = output
        ctx.save_for_backward(r)
        ctx.save_for_forward(r)
        ctx.mode = mode
        ctx.shapes = input.shape, target.shape
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad: Tensor | None, grad_r: Tensor | None):
        (r,) = ctx.saved_tensors
        g = None if grad is None else _slope(r, ctx.mode, grad)
        return *residual_grads(ctx, g, grad_r), None

    @staticmethod
    def jvp(ctx, t_input: Tensor | None, t_target: Tensor | None, _: None):
        (r,) = ctx.saved_tensors
        t_r = residual_tangent(r, t_input, t_target)
        # The forward's reduction, applied to the elementwise tangent tanh(r)·ṙ.
        return reduce(torch.tanh(r) * t_r, ctx.mode), t_r


_log_cosh = applier(_LogCosh)
