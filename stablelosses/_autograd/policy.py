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

import torch
from torch import Tensor

from stablelosses._autograd._base import StableFunction, save_input, times_saved


def _scaled(d: Tensor, g: Tensor) -> Tensor:
    """``g · expm1(d)``, 0 where ``g == 0`` (also where ``expm1(d)`` is ``inf``). Double where:
    ``expm1`` never sees the ``d`` of a zero ``g``, so the double backward is 0 there too."""
    zero = g == 0
    return torch.where(zero, 0.0, g * torch.expm1(torch.where(zero, 0.0, d)))


class _ExpM1MinusX(StableFunction):
    """``expm1(d) − d`` (``+inf`` at ``d = +inf``); the gradient and the tangent ``g · expm1(d)``
    are 0 where ``g == 0``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(d: Tensor) -> Tensor:
        # d = +inf (a -inf log-prob): expm1(d) − d is inf − inf; the value is +inf
        return torch.where(d == float("inf"), d, torch.expm1(d) - d)

    setup_context = staticmethod(save_input)
    backward = jvp = staticmethod(times_saved(_scaled))
