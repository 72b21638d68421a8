"""The focal-loss terms of the class-index loss Function (``cross_entropy.py``).

With ``l = log p_t`` and ``m = 1 − p_t`` the loss is ``f(l) = m^γ (−l)`` and

    −f'(l) = m^γ (1 + γ p_t r),   r = (−log p_t) / (1 − p_t)  (r → 1 as p_t → 1).

Grouping ``(1 − p)^(γ−1) (−log p)`` as ``m^γ · r`` keeps every factor finite for all γ ≥ 0,
including 0 < γ < 1 where ``(1 − p)^(γ−1)`` alone blows up as ``p_t → 1``. Since
``d l / d x = onehot(t) − softmax(x)``, the logit gradient is ``a · (softmax − onehot)`` with
``a = w_t m^γ (1 + γ p_t r)``: the cross-entropy backward with a per-row scale.

Exact tails: ``1 − p_t`` is the sum of the other classes' probabilities (each accurate to a
few ulp), never ``1 − p_t`` or ``−expm1(log p_t)`` of a ``log p_t`` whose ``log Σ exp``
rounded the small part away; ``log p_t = log1p(−(1 − p_t))`` where ``p_t > 1/2``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def accurate_log_pt(rest: Tensor, lt: Tensor) -> Tensor:
    """``log p_t`` with full relative accuracy as ``p_t → 1``: ``log1p(−Σ_{j≠t} p_j)``."""
    near_one = (rest < 0.5) & ~torch.isnan(lt)  # a NaN row stays NaN (also with one class)
    # double where: log1p(-1) = -inf is never formed on the discarded branch
    return torch.where(near_one, torch.log1p(-torch.where(near_one, rest, 0.0)), lt)


def focal_terms(m: Tensor, lt: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """``m^γ (−l)`` and the backward row scale ``m^γ (1 + γ p_t r)``, ``m = Σ_{j≠t} p_j``.

    ``r = 1`` at ``m = 0`` (``p_t = 1``), its limit; ``p_t r = 0`` at ``l = −inf``
    (``p_t = 0``), the limit of ``−p log p / (1 − p)``. Every singular operand is made safe
    before use (double where), so double backward stays finite.
    """
    zero = m == 0
    dead = lt == -float("inf")
    m_safe = torch.where(zero, 1.0, m)
    mg = torch.where(zero, 0.0, torch.pow(m_safe, gamma))
    l_safe = torch.where(dead, 0.0, lt)
    r = torch.where(zero, 1.0, -l_safe / m_safe)
    pr = torch.where(dead, 0.0, torch.exp(l_safe) * r)
    return mg * lt.neg(), mg * (1.0 + gamma * pr)


def focal_rows(rest: Tensor, p_t: Tensor, nll_t: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """`focal_terms` for first-order code (no autograd through it), in N-sized operators:
    ``m^γ (−l)`` and ``m^γ (1 + γ p_t r)`` with ``m = rest``, ``−l = nll_t``.

    The two singular points are 0/0 and 0·inf, each mapped to its limit by one ``nan_to_num``
    (a NaN row is NaN through ``m^γ`` all the same): ``r = −l / m → 1`` at ``p_t = 1``, and
    ``p_t r → 0`` at ``p_t = 0``.
    """
    mg = rest.pow(gamma)
    r = torch.nan_to_num(nll_t / rest, nan=1.0)
    pr = torch.nan_to_num(p_t * r, nan=0.0)
    return mg * nll_t, torch.addcmul(mg, mg, pr, value=gamma)
