"""The KL penalty's large-``d`` branch as one Function: ``expm1(d) − d`` whose gradient is 0
wherever the incoming gradient is 0.

``kl_penalty`` is usually masked after it is computed (``masked_mean(kl, mask)``, a ``where``).
At a padded token ``d = ref − logp`` can be 200: ``expm1(200)`` is ``inf`` in float32, the mask
sends a zero gradient back, and torch's ``Expm1Backward`` multiplies it by ``e^d = inf``: NaN
in a gradient from a value that was discarded. Here the derivative is
``g · expm1(d)`` with the product defined as 0 where ``g == 0`` (the output does not reach the
loss there, whatever its size), and the same in forward mode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stablelosses._autograd._base import applier


def _scaled(g: Tensor, d: Tensor) -> Tensor:
    """``g · expm1(d)``, 0 where ``g == 0`` (also where ``expm1(d)`` is ``inf``)."""
    return torch.where(g == 0, 0.0, g * torch.expm1(d))


class _ExpM1MinusX(torch.autograd.Function):
    """``expm1(d) − d``; the gradient and the tangent ``g · expm1(d)`` are 0 where ``g == 0``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(d: Tensor) -> Tensor:
        return torch.expm1(d) - d

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        (d,) = inputs
        ctx.save_for_backward(d)
        ctx.save_for_forward(d)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (d,) = ctx.saved_tensors
        return _scaled(grad, d)

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor) -> Tensor:
        (d,) = ctx.saved_tensors
        return _scaled(tangent, d)


expm1_minus_x = applier(_ExpM1MinusX)
