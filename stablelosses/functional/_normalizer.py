r"""The one ``normalizer=`` contract of the token losses (see ``docs/normalizer.md``).

``normalizer`` (a Python number or a 0-dim tensor: the token count over gradient accumulation
and ranks) replaces the denominator of ``reduction='mean'``. Every division by a count goes
through `divide`: a zero denominator gives **0 with gradient 0** (the sum over no tokens is 0;
there is nothing to average), a select on the tensor's value, never a host sync.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stablelosses._spec import Real

__all__ = ["NORMALIZER", "check_normalizer", "divide"]


def _nonneg(v: float) -> bool:
    return v >= 0  # False for NaN


def _finite(v: float) -> bool:
    return v != float("inf")


NORMALIZER = Real(
    ((">= 0", _nonneg), ("finite and >= 0", _finite)),
    type_words="a number >= 0, a 0-dim tensor or None",
    optional=True,
    tensor0d=True,
    good=(None, 0, 3, 7.5, torch.tensor(4.0), torch.tensor(0), torch.tensor(6)),
    bad=((-1, ValueError), (-0.5, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
         ("4", TypeError), (True, TypeError), (torch.ones(2), ValueError)),
)


def check_normalizer(fn: str, normalizer: Any, reduction: str) -> Any:
    """``normalizer`` checked; refused with ``reduction`` other than ``'mean'`` (there is no
    denominator to replace)."""
    if normalizer is not None and reduction != "mean":
        raise ValueError(
            f"{fn}: normalizer replaces the denominator of reduction='mean', got reduction={reduction!r}"
        )
    return NORMALIZER.check(fn, "normalizer", normalizer)


def divide(total: Tensor, denominator: Tensor | float) -> Tensor:
    """``total / denominator``, and 0 with gradient 0 (for ``total`` and the denominator)
    where the denominator is 0. A tensor denominator is cast to ``total``'s dtype and device."""
    if not isinstance(denominator, Tensor):
        if denominator == 0:  # a Python number: the branch reads no tensor
            return torch.where(torch.ones_like(total, dtype=torch.bool), 0.0, total)
        return total / denominator
    den = denominator.to(device=total.device, dtype=total.dtype)
    zero = den == 0
    # double where: the division never sees the 0, so no inf·0 reaches a gradient
    return torch.where(zero, 0.0, total / torch.where(zero, 1.0, den))
