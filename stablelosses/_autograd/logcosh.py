"""log(cosh(r)) without overflow, gradient tanh(r)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from stablelosses._autograd._base import applier
from stablelosses._utils import MEAN, reduce, sum_to

_LOG2 = math.log(2.0)


def _slope(input: Tensor, target: Tensor, mode: int, g: Tensor) -> Tensor:
    """``g · tanh(r)`` (times ``1/N`` for the mean): d log cosh r / d r = tanh r, bounded by 1."""
    r = input - target
    return torch.tanh(r) * (g / r.numel() if mode == MEAN else g)


class _LogCosh(torch.autograd.Function):
    """``log(cosh(input - target))``, reduced by ``mode`` (0 none, 1 mean, 2 sum).

    Backward and forward mode use ``tanh(r)``, never the ``inf/inf`` of ``sinh r / cosh r``.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(input: Tensor, target: Tensor, mode: int) -> Tensor:
        r = input - target
        # log cosh r = log(e^r + e^-r) - log 2 = |r| + softplus(-2|r|) - log 2;
        # logaddexp evaluates max + log1p(exp(-|diff|)), i.e. exactly that identity.
        # "- log 2" per element, in place on our fresh buffer (no cancellation against a
        # summed N·log 2).
        return reduce(torch.logaddexp(r, -r).sub_(_LOG2), mode)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        input, target, mode = inputs
        ctx.save_for_backward(input, target)
        ctx.save_for_forward(input, target)
        ctx.mode = mode

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        input, target = ctx.saved_tensors
        g = _slope(input, target, ctx.mode, grad)
        grad_input = sum_to(g, input.shape) if ctx.needs_input_grad[0] else None
        grad_target = sum_to(-g, target.shape) if ctx.needs_input_grad[1] else None
        return grad_input, grad_target, None

    @staticmethod
    def jvp(ctx: Any, t_input: Tensor, t_target: Tensor, _: None) -> Tensor:
        input, target = ctx.saved_tensors
        # The forward's reduction, applied to the elementwise tangent tanh(r)·(ṫ_input - ṫ_target).
        return reduce(torch.tanh(input - target) * (t_input - t_target), ctx.mode)


_log_cosh = applier(_LogCosh)
