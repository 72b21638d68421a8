r"""policy_loss (PPO's clipped surrogate with GRPO's and GSPO's importance weights, TRL's four
aggregations) and kl_penalty (k1, k2, k3), on per-token tensors ``(B, T)``.

The hazard every hand-written version has: ``exp(log_ratio)`` is evaluated at every position,
also at padding (``0 − (−200)``) and where the clip selects the constant. A mask multiply, a
clamp or a ``torch.where`` after the ``exp`` selects the right value, but ``ExpBackward`` still
multiplies the zero incoming gradient by ``exp(200) = inf``: NaN. Here every ``exp`` sees an
argument made safe by a select *before* it (the double where), so a masked or clipped position
gets the exact gradient 0.

The clipped surrogate never needs ``exp`` above the clip: for ``A > 0``
``−min(rA, clip(r)A) = −A·min(r, 1 + ε_high)``, and for ``A < 0`` it is ``−A·max(r, 1 − ε)``.
The clipped side is a constant; the other side is ``r = exp(log r)``, and there ``r`` is on the
side of the clip where it is representable whenever the loss is.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from stablelosses._autograd.policy import _ExpM1MinusX
from stablelosses._spec import check_choice, check_normalizer, check_real
from stablelosses._utils import divide
from stablelosses.functional._preference import check_beta, operands

IMPORTANCE = ("token", "sequence")
POLICY_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
ESTIMATORS = ("k1", "k2", "k3")


def check_policy_args(fn: str, clip_eps: object, clip_eps_high: object, importance: object,
                      loss_type: object, beta: object, kl_estimator: object, normalizer: object) -> list:
    """The scalar arguments of `policy_loss` checked (also by ``PolicyLoss`` at construction)."""
    return [
        check_real(fn, "clip_eps", clip_eps, (("in [0, 1)", lambda v: 0.0 <= v < 1.0),)),
        check_real(fn, "clip_eps_high", clip_eps_high,
                   ((">= 0 and finite", lambda v: 0.0 <= v < float("inf")),), optional=True),
        check_choice(fn, "importance", importance, IMPORTANCE),
        check_choice(fn, "loss_type", loss_type, POLICY_LOSS_TYPES),
        check_beta(fn, beta),
        check_choice(fn, "kl_estimator", kl_estimator, ESTIMATORS),
        check_normalizer(fn, normalizer, "mean"),
    ]


# (e^d − 1 − d) / d² = Σ_{k≥0} d^k / (k+2)!, |d| ≤ 1: terms to below half an ulp
_SERIES_TERMS = {torch.float64: 18, torch.float32: 10}


def _k3(d: Tensor) -> Tensor:
    """``e^d − 1 − d ≥ 0``: the Taylor series ``d² Σ d^k/(k+2)!`` for ``|d| ≤ 1`` (no
    cancellation: ``expm1(d) − d`` loses every digit at ``d = 1e-6`` in float32) and
    ``expm1(d) − d`` beyond (within a few ulp there). Double where: each branch sees only its
    own arguments, so the discarded one neither overflows nor sends NaN into the gradient; and
    the large branch's gradient is 0 where the incoming one is (a padded token masked after
    the penalty: ``0 · e^200`` would be NaN, see ``_autograd/policy.py``)."""
    small = d.abs() <= 1.0
    ds = torch.where(small, d, 0.0)
    n = _SERIES_TERMS.get(d.dtype, 10)
    acc = torch.full_like(ds, 1.0 / math.factorial(n + 1))
    for k in range(n - 1, -1, -1):
        acc = acc * ds + 1.0 / math.factorial(k + 2)
    dl = torch.where(small, 0.0, d)
    return torch.where(small, ds * ds * acc, _ExpM1MinusX.call(dl))


def _kl_terms(logp: Tensor, ref: Tensor, estimator: str) -> Tensor:
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    return _k3(ref - logp)


def kl_penalty(logps: Tensor, ref_logps: Tensor, *, estimator: str = "k3") -> Tensor:
    r"""Per-token estimators of ``KL(π ‖ π_ref)`` from sampled tokens' log-probabilities.

    With $d = \log\pi_{\text{ref}} - \log\pi$ (``ref_logps − logps``):

    $$ k_1 = -d, \qquad k_2 = \tfrac12 d^2, \qquad k_3 = e^{d} - 1 - d $$

    (Schulman's estimators; TRL's GRPO penalty is $k_3$). The hand-written
    ``exp(d) − d − 1`` cancels in float32: at $d = 10^{-6}$ it gives $-5.96\cdot10^{-8}$ where
    the value is $5\cdot10^{-13}$ (google/tunix #2315), negative although $k_3 \ge 0$. Here
    $k_3$ is the series $d^2\sum_k d^k/(k+2)!$ for $|d| \le 1$ and ``expm1(d) − d`` beyond:
    never negative, within a few ulp everywhere, finite wherever the value is representable.

    **Gradient** with respect to ``logps``: $k_1$: 1; $k_2$: $-d$; $k_3$: $-\operatorname{expm1}(d)$
    (the series' derivative inside $|d| \le 1$); the negatives for ``ref_logps``.

    Args:
        logps: the policy's per-token log-probabilities, any shape.
        ref_logps: the reference model's, same shape.
        estimator: ``'k1'`` | ``'k2'`` | ``'k3'``. Default: ``'k3'``.

    Returns:
        The per-token penalty, ``logps``' shape; float32 for float16/bfloat16 inputs.

    Raises:
        TypeError: an input is not a floating-point tensor.
        ValueError: the shapes differ, or ``estimator`` is unknown.

    Example:
        >>> import torch
        >>> import stablelosses.functional as SF
        >>> logp, ref = torch.tensor([0.0]), torch.tensor([1e-6])
        >>> d = ref - logp
        >>> torch.exp(d) - d - 1
        tensor([-5.9605e-08])
        >>> SF.kl_penalty(logp, ref)
        tensor([5.0000e-13])

    References:
        J. Schulman, "Approximating KL Divergence", 2020. TRL ``trl/trainer/grpo_trainer.py``,
        ``GRPOTrainer._compute_loss`` (``per_token_kl``).

    Replaces ``torch.exp(ref - logp) - (ref - logp) - 1``.
    """
    fn = "kl_penalty"
    estimator = check_choice(fn, "estimator", estimator, ESTIMATORS)
    (lp, ref), _ = operands(fn, False, logps=logps, ref_logps=ref_logps)
    if lp.shape != ref.shape:
        raise ValueError(f"{fn}: ref_logps shape {tuple(ref.shape)} must equal logps shape {tuple(lp.shape)}")
    return _kl_terms(lp, ref, estimator)


def _denominator(value: int | Tensor, normalizer: float | Tensor | None) -> float | Tensor:
    # a size stays a (symbolic) int: float() of it fixed the size in torch.export
    return value if normalizer is None else normalizer


def policy_loss(
    logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, *, clip_eps: float = 0.2,
    clip_eps_high: float | None = None, importance: str = "token", loss_type: str = "grpo",
    ref_logps: Tensor | None = None, beta: float = 0.0, kl_estimator: str = "k3",
    normalizer: float | Tensor | None = None,
) -> Tensor:
    r"""PPO's clipped surrogate with GRPO's (per token) or GSPO's (per sequence) importance
    ratio, TRL GRPOTrainer's aggregations and an optional reference KL.

    With $\log r$ = ``logps − old_logps`` per token (``'token'``), or its masked mean over each
    sequence broadcast to its tokens (``'sequence'``, GSPO), $\varepsilon_h$ = ``clip_eps_high``
    (default ``clip_eps``) and the advantage $A$ (``(B,)`` per sequence or ``(B, T)``):

    $$ \ell_{bt} = -\min\!\big(rA,\ \operatorname{clip}(r, 1-\varepsilon, 1+\varepsilon_h)A\big)
       + \beta\,k(\text{logps}, \text{ref\_logps}) $$

    ($k$ = [`kl_penalty`][stablelosses.functional.kl_penalty] with ``kl_estimator``), then over
    the unmasked tokens $M$: ``'grpo'`` $\frac1B\sum_b \frac{\sum_{t\in M_b}\ell_{bt}}{\max(1,|M_b|)}$;
    ``'bnpo'`` and ``'dapo'`` $\sum_M \ell / \max(1, |M|)$; ``'dr_grpo'`` $\sum_M \ell / (BT)$.
    ``normalizer`` (a number or a 0-d tensor: the token count over gradient accumulation and
    ranks) replaces $B$ for ``'grpo'`` and the denominator for the others; a denominator of 0
    gives 0 (so a fully masked batch with a normalizer of 0 gives 0).

    The ratio is never exponentiated where it is not used: for $A > 0$ the term is
    $-A\min(r, 1+\varepsilon_h)$, for $A < 0$ it is $-A\max(r, 1-\varepsilon)$, so ``exp``
    runs only on the unclipped side, and masked positions never reach it (a select *before*
    the ``exp``); $A = 0$ takes the $A > 0$ side. TRL's ``exp(log_ratio)`` at a padded token with log-ratio
    $0 - (-200)$ gives ``inf``, and the mask multiply turns the gradient into NaN; a
    ``torch.where`` after the ``exp`` does not help (``ExpBackward`` still computes
    ``0 · inf``).

    **Gradient.** With respect to ``logps``: $-A r$ on the unclipped side (times the
    aggregation weight, and through the sequence mean for ``'sequence'``), exactly 0 on the
    clipped side and at masked positions (0 where $A = 0$); plus $\beta\,\partial k$. With
    respect to ``advantages``: $-\min(r, 1+\varepsilon_h)$ for $A \ge 0$ (at $A = 0$ the
    minimal-norm subgradient, and $-r$, the derivative, inside the clip range) and
    $-\max(r, 1-\varepsilon)$ for $A < 0$. ``old_logps`` gets the negative of the ratio's
    gradient.

    Args:
        logps: the policy's per-token log-probabilities, ``(B, T)``.
        old_logps: the sampling policy's, ``(B, T)`` (``logps.detach()`` on-policy).
        advantages: ``(B,)`` or ``(B, T)``.
        mask: bool ``(B, T)``, True = a completion token.
        clip_eps: $\varepsilon \in [0, 1)$, the lower clip. Default: ``0.2``.
        clip_eps_high: $\varepsilon_h \ge 0$, the upper clip (DAPO's clip-higher); ``None``:
            ``clip_eps``. Default: ``None``.
        importance: ``'token'`` (GRPO) | ``'sequence'`` (GSPO). Default: ``'token'``.
        loss_type: ``'grpo'`` | ``'bnpo'`` | ``'dr_grpo'`` | ``'dapo'``. Default: ``'grpo'``.
        ref_logps: the reference model's ``(B, T)``; needed when ``beta > 0``. Default: ``None``.
        beta: the KL coefficient, ``≥ 0``. Default: ``0.0``.
        kl_estimator: ``'k1'`` | ``'k2'`` | ``'k3'``. Default: ``'k3'``.
        normalizer: ``None``, a number ``≥ 0`` or a 0-d tensor. Default: ``None``.

    Returns:
        A 0-d tensor; float32 for float16/bfloat16 inputs.

    Raises:
        TypeError: a tensor has the wrong dtype (``mask`` not bool), or a scalar the wrong type.
        ValueError: shapes differ, ``beta > 0`` without ``ref_logps``, or a scalar argument is
            out of range or unknown.

    Example:
        >>> import torch
        >>> import stablelosses.functional as SF
        >>> logps = torch.tensor([[-1.0, 0.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -200.0]])  # a padded position
        >>> mask, adv = torch.tensor([[True, False]]), torch.tensor([1.0])
        >>> r = torch.exp(logps - old)
        >>> naive = -torch.min(r * adv, r.clamp(0.8, 1.2) * adv)
        >>> (naive * mask).sum().backward(); logps.grad
        tensor([[-1., nan]])
        >>> logps.grad = None
        >>> SF.policy_loss(logps, old, adv, mask).backward(); logps.grad
        tensor([[-1., 0.]])

    References:
        Schulman et al., "Proximal Policy Optimization Algorithms", 2017; Shao et al. (GRPO),
        2024; Zheng et al. (GSPO), 2025; Liu et al. (Dr. GRPO), 2025; Yu et al. (DAPO), 2025.
        TRL ``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._compute_loss``.

    Replaces TRL's GRPO/GSPO loss.
    """
    fn = "policy_loss"
    clip_eps, clip_eps_high, importance, loss_type, beta, kl_estimator, normalizer = check_policy_args(
        fn, clip_eps, clip_eps_high, importance, loss_type, beta, kl_estimator, normalizer
    )
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if beta > 0 and ref_logps is None:
        raise ValueError(f"{fn}: beta > 0 needs ref_logps, got beta={beta} and ref_logps=None")
    tensors = {"logps": logps, "old_logps": old_logps, "advantages": advantages}
    if ref_logps is not None:
        tensors["ref_logps"] = ref_logps
    ops, _ = operands(fn, False, **tensors)
    lp, old, adv = ops[:3]
    if lp.dim() != 2:
        raise ValueError(f"{fn}: logps must be (B, T), got shape {tuple(lp.shape)}")
    for name, t in zip(tensors, ops):
        if name != "advantages" and t.shape != lp.shape:
            raise ValueError(f"{fn}: {name} shape {tuple(t.shape)} must equal logps shape {tuple(lp.shape)}")
    if adv.shape == lp.shape[:1]:
        adv = adv.unsqueeze(-1)
    elif adv.shape != lp.shape:
        raise ValueError(
            f"{fn}: advantages shape {tuple(adv.shape)} must be (B,) or (B, T) = {tuple(lp.shape)}"
        )
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        what = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"{fn}: mask must be a bool tensor, got {what}")
    if mask.shape != lp.shape:
        raise ValueError(f"{fn}: mask shape {tuple(mask.shape)} must equal logps shape {tuple(lp.shape)}")

    # the log-ratio, read only at unmasked positions (a select, never a multiply)
    log_r = torch.where(mask, lp - old, 0.0)
    count = mask.sum(-1, keepdim=True, dtype=lp.dtype)
    if importance == "sequence":
        log_r = (log_r.sum(-1, keepdim=True) / count.clamp(min=1.0)).expand_as(lp)
    # The clipped side in log space: A ≥ 0 is clipped at r ≥ 1 + ε_h, A < 0 at r ≤ 1 − ε. A NaN
    # log-ratio is on neither side, so exp sees it: NaN in, NaN out. A = 0 takes the A > 0 side:
    # its ∂/∂A, −min(r, 1 + ε_h), is the minimal-norm subgradient (−r inside the clip range).
    pos = adv >= 0
    clipped = torch.where(pos, log_r >= math.log1p(eps_high), log_r <= math.log1p(-clip_eps))
    use_r = mask & ~clipped
    # double where: exp sees 0 wherever its value is not used
    r = torch.exp(torch.where(use_r, log_r, 0.0))
    # (a tensor operand: torch.where of two Python floats would be float32)
    bound = torch.where(pos, torch.full_like(adv, 1.0 + eps_high), 1.0 - clip_eps)
    per_token = -adv * torch.where(use_r, r, bound)
    if beta > 0:
        ref = ops[3]
        per_token = per_token + beta * _kl_terms(torch.where(mask, lp, 0.0), torch.where(mask, ref, 0.0),
                                                 kl_estimator)
    masked_out: Tensor | float = 0.0
    if beta == 0 and len(ops) > 3:
        # the reference does not enter the loss: a select that never takes it gives it its
        # gradient, 0, instead of a silent None (the values stay per_token's, bit for bit)
        masked_out = torch.where(mask & ~mask, ops[3], 0.0)
    per_token = torch.where(mask, per_token, masked_out)

    if loss_type == "grpo":
        seq = per_token.sum(-1) / count.squeeze(-1).clamp(min=1.0)
        return divide(seq.sum(), _denominator(lp.shape[0], normalizer))
    total = per_token.sum()
    if loss_type == "dr_grpo":
        return divide(total, _denominator(lp.shape[0] * lp.shape[1], normalizer))
    # bnpo and dapo: the unmasked-token count (TRL's dapo divides by num_items_in_batch / ranks)
    return divide(total, _denominator(count.sum().clamp(min=1.0), normalizer))
