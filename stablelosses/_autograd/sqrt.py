"""Square root with a finite gradient at 0."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from stablelosses._autograd._base import StableFunction, save_output, times_saved


def _half_over(y: Tensor, t: Tensor) -> Tensor:
    """``t / (2 y)``, defined 0 where ``y == 0`` (for a finite ``t``).

    ``y`` is taken as ``inf`` where it is 0, so the quotient is 0 there and its own derivatives
    (double backward) are 0 too, never a discarded ``t / 0``. One ``addcdiv`` forms
    ``0 + ½·t / y``: two reads and a write, where ``t / (2 y)`` would add a pass for ``2 y``.
    """
    safe_y = y.masked_fill(y == 0, math.inf)
    return torch.addcdiv(torch.zeros((), dtype=y.dtype, device=y.device), t, safe_y, value=0.5)


class _SafeSqrt(StableFunction):
    """``sqrt(x)``; d/dx is ``1 / (2 sqrt(x))`` and 0 (the minimal-norm subgradient) at ``x == 0``.

    The forward-mode derivative is the same: the tangent ``t / (2 sqrt(x))``, 0 at ``x == 0``.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return torch.sqrt(x)

    setup_context = staticmethod(save_output)
    backward = jvp = staticmethod(times_saved(_half_over))
