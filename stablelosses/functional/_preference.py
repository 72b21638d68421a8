r"""Preference losses on per-sequence log-probabilities: dpo_loss, orpo_loss, simpo_loss,
cpo_loss and kto_loss, with TRL's formulas on ordinary inputs.

What they share: every ``log σ`` is ``F.logsigmoid`` (``min(z, 0) − log1p(e^{−|z|})``: exact
at both tails, ±1e4 and ±1e30, never ``log(σ(z))`` = ``log 0``); every ``1 − σ(z)`` is
``σ(−z)`` (no cancellation as ``σ → 1``); a label-smoothing term whose weight is 0 is left out,
not multiplied by 0 (``0 · log σ(−inf)`` is NaN); float16/bfloat16 are computed and returned in
float32; ``'mean'`` divides by ``max(N, 1)``, so an empty batch is 0 with gradient 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from stablelosses._autograd.preference import _OddsRatio
from stablelosses._spec import (
    check_choice,
    check_finite_nonnegative_real,
    check_real,
    check_reduction,
)
from stablelosses._utils import broadcasts_to, cast, check_floating, promote_types

DPO_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo", "apo_zero", "apo_down")


def check_beta(fn: str, beta: object) -> float:
    """``beta`` of the preference and policy losses: a finite number ``>= 0``."""
    return check_finite_nonnegative_real(fn, "beta", beta)


def check_smoothing(fn: str, label_smoothing: object) -> float:
    """cDPO's, robust DPO's and SimPO's label smoothing: a probability."""
    return check_real(fn, "label_smoothing", label_smoothing, (("in [0, 1]", lambda v: 0.0 <= v <= 1.0),))


def check_orpo_args(fn: str, beta: object, reduction: object) -> list:
    return [check_beta(fn, beta), check_reduction(fn, reduction)]


def check_simpo_args(fn: str, beta: object, gamma_beta_ratio: object, label_smoothing: object,
                     reduction: object) -> list:
    # a finite number: NaN or ±inf would make every loss NaN or infinite
    ratio = check_real(fn, "gamma_beta_ratio", gamma_beta_ratio,
                       (("finite", lambda v: -float("inf") < v < float("inf")),))
    return [check_beta(fn, beta), ratio, check_smoothing(fn, label_smoothing), check_reduction(fn, reduction)]


def check_cpo_args(fn: str, beta: object, label_smoothing: object, reduction: object) -> list:
    return [check_beta(fn, beta), check_smoothing(fn, label_smoothing), check_reduction(fn, reduction)]


def check_kto_args(fn: str, beta: object, desirable_weight: object, undesirable_weight: object,
                   reduction: object) -> list:
    return [check_beta(fn, beta), check_finite_nonnegative_real(fn, "desirable_weight", desirable_weight),
            check_finite_nonnegative_real(fn, "undesirable_weight", undesirable_weight),
            check_reduction(fn, reduction)]


def operands(fn: str, same_shape: bool = True, **tensors: Tensor) -> tuple[list[Tensor], torch.dtype]:
    """The named tensors checked (floating point, one shape, one device) and cast to their
    promoted dtype (float32 for float16/bfloat16), and that dtype. ``same_shape=False``: shapes
    are the caller's to check."""
    items = [(name, check_floating(fn, name, t)) for name, t in tensors.items()]
    name0, first = items[0]
    dtype = first.dtype
    for name, t in items[1:]:
        if same_shape and t.shape != first.shape:
            raise ValueError(
                f"{fn}: {name} shape {tuple(t.shape)} must equal {name0} shape {tuple(first.shape)}"
            )
        if t.device != first.device:
            raise RuntimeError(f"{fn}: {name} is on {t.device} and {name0} on {first.device}")
        dtype = promote_types(dtype, t.dtype)
    if dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    return [cast(t, dtype) for _, t in items], dtype


def reduced(loss: Tensor, reduction: str) -> Tensor:
    """``'none'``: ``loss``; ``'sum'``; ``'mean'``: the sum over ``max(N, 1)`` (an empty batch
    is 0 with gradient 0)."""
    if reduction == "none":
        return loss
    total = loss.sum()
    return total if reduction == "sum" else total / max(loss.numel(), 1)


def check_dpo_options(fn: str, beta: object, loss_type: object, label_smoothing: object,
                      reduction: object) -> list:
    """Each argument checked, and the two checks that join arguments: ``'ipo'`` divides by
    ``beta``, and robust DPO divides by ``1 − 2ε``."""
    beta = check_beta(fn, beta)
    loss_type = check_choice(fn, "loss_type", loss_type, DPO_LOSS_TYPES)
    eps = check_smoothing(fn, label_smoothing)
    reduction = check_reduction(fn, reduction)
    if loss_type == "ipo" and beta == 0.0:
        raise ValueError(f"{fn}: beta must be > 0 with loss_type='ipo' (1/(2 beta)), got {beta}")
    if loss_type == "robust" and eps >= 0.5:
        raise ValueError(f"{fn}: label_smoothing must be < 0.5 with loss_type='robust', got {eps}")
    return [beta, loss_type, eps, reduction]


def logistic(z: Tensor, eps: float) -> Tensor:
    """``−(1 − ε)·log σ(z) − ε·log σ(−z)`` (cDPO); a term whose weight is 0 is left out, so
    that ``z = ±inf`` gives ``inf`` or 0, never ``0 · inf``."""
    if eps == 0.0:
        return torch.rsub(F.logsigmoid(z), 0.0)
    if eps == 1.0:
        return torch.rsub(F.logsigmoid(-z), 0.0)
    return -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def dpo_loss(
    chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor,
    *, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    r"""Direct Preference Optimization and its variants, on per-sequence log-probabilities.

    With $\rho_c = c - c_{\text{ref}}$, $\rho_r = r - r_{\text{ref}}$ and the margin
    $m = \rho_c - \rho_r$ and $z = \beta m$:

    | ``loss_type`` | per pair |
    |---|---|
    | ``'sigmoid'`` | $-(1-\varepsilon)\log\sigma(\beta m) - \varepsilon\log\sigma(-\beta m)$ (cDPO) |
    | ``'robust'`` | $\frac{-(1-\varepsilon)\log\sigma(z) + \varepsilon\log\sigma(-z)}{1-2\varepsilon}$ |
    | ``'hinge'`` | $\max(0, 1 - \beta m)$ |
    | ``'ipo'`` | $(m - \tfrac{1}{2\beta})^2$ (pass length-averaged log-probs, as TRL does) |
    | ``'apo_zero'`` | $\sigma(-\beta\rho_c) + \sigma(\beta\rho_r)$ |
    | ``'apo_down'`` | $\sigma(\beta\rho_c) + \sigma(-\beta m)$ |

    ($\varepsilon$ = ``label_smoothing``.) ``log σ`` is ``F.logsigmoid``, exact at any margin
    (the hand-written ``log(sigmoid(z))`` is ``-inf`` with a NaN gradient below ``z ≈ −104``
    in float32); APO's ``1 − σ(z)`` is ``σ(−z)``; a smoothing term of weight 0 is left out
    (``0 · log σ(−inf)`` would be NaN at an infinite margin).

    **Gradient.** $\partial/\partial m$ of the row above: $-\beta(1-\varepsilon)\sigma(-\beta m)
    + \beta\varepsilon\sigma(\beta m)$ for ``'sigmoid'``, finite at every margin; ``'hinge'``:
    $-\beta$ below the hinge, 0 at and above it; the four inputs get $\pm$ of it.

    Args:
        chosen_logps: policy log-probabilities of the chosen completions, ``(N,)``.
        rejected_logps: of the rejected completions, same shape.
        ref_chosen_logps: reference model's, same shape.
        ref_rejected_logps: reference model's, same shape.
        beta: the KL coefficient $\beta \ge 0$ (``> 0`` for ``'ipo'``). Default: ``0.1``.
        loss_type: one of the rows above. Default: ``'sigmoid'``.
        label_smoothing: $\varepsilon \in [0, 1]$ for ``'sigmoid'``, $[0, 0.5)$ for
            ``'robust'``; unused by the others. Default: ``0.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Returns:
        ``(N,)`` for ``'none'``, else 0-d; the inputs' dtype (float32 for float16/bfloat16,
        which are computed in float32).

    Raises:
        TypeError: an input is not a floating-point tensor, or a scalar argument has the wrong type.
        ValueError: shapes differ, ``beta`` is negative (or 0 with ``'ipo'``), ``loss_type`` or
            ``reduction`` is unknown, ``label_smoothing`` is outside $[0, 1]$ (or $\ge 0.5$ with
            ``'robust'``).

    Example:
        >>> import torch
        >>> import stablelosses.functional as SF
        >>> c = torch.tensor([-1e30], requires_grad=True)
        >>> zero = torch.zeros(1)
        >>> torch.log(torch.sigmoid(0.1 * (c - zero))).neg().backward(); c.grad
        tensor([nan])
        >>> c.grad = None
        >>> SF.dpo_loss(c, zero, zero, zero).backward(); c.grad
        tensor([-0.1000])

    References:
        Rafailov et al., "Direct Preference Optimization", 2023; Azar et al. (IPO), 2023;
        Chowdhury et al. (robust DPO), 2024; D'Oosterlinck et al. (APO), 2024. TRL
        ``trl/trainer/dpo_trainer.py``, ``DPOTrainer._compute_loss`` (``DPOTrainer.dpo_loss`` in
        earlier releases, with cDPO's ``label_smoothing`` for ``'sigmoid'``).

    Replaces TRL's per-sequence DPO losses.
    """
    fn = "dpo_loss"
    beta, loss_type, eps, reduction = check_dpo_options(fn, beta, loss_type, label_smoothing, reduction)
    (c, r, rc, rr), _ = operands(fn, chosen_logps=chosen_logps, rejected_logps=rejected_logps,
                                 ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    rho_c, rho_r = c - rc, r - rr
    m = rho_c - rho_r
    if loss_type == "sigmoid":
        loss = logistic(beta * m, eps)
    elif loss_type == "robust":
        z = beta * m
        loss = torch.rsub(F.logsigmoid(z), 0.0)
        if eps != 0.0:
            loss = ((1.0 - eps) * loss + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)
    elif loss_type == "hinge":
        loss = torch.relu(1.0 - beta * m)
    elif loss_type == "ipo":
        loss = (m - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "apo_zero":
        loss = torch.sigmoid(-beta * rho_c) + torch.sigmoid(beta * rho_r)
    else:  # apo_down
        loss = torch.sigmoid(beta * rho_c) + torch.sigmoid(-beta * m)
    return reduced(loss, reduction)


def orpo_loss(
    chosen_logps: Tensor, rejected_logps: Tensor, *, beta: float = 0.1, reduction: str = "mean"
) -> Tensor:
    r"""ORPO's odds-ratio term on length-averaged log-probabilities (the NLL term is
    `cross_entropy`).

    $$ L = \log\frac{\operatorname{odds}(c)}{\operatorname{odds}(r)}
         = (c - r) - \big(\operatorname{log1mexp}(c) - \operatorname{log1mexp}(r)\big), \qquad
       \ell = -\beta \log\sigma(L) $$

    with $\operatorname{log1mexp}(x) = \log(1 - e^x)$ computed exactly: $\log(-\operatorname{expm1}(x))$
    above $-\log 2$, $\operatorname{log1p}(-e^x)$ below. The hand-written ``log1p(-exp(x))``
    gives ``-inf`` (value and gradient) at $c = -10^{-9}$ in float32 and is 1% off at
    $-10^{-7}$: a confident model (average log-prob near 0) NaNs the run. At $c = 0$ exactly the
    loss is 0.

    **Gradient.** $\partial\ell/\partial c = -\beta\,\sigma(-L)/(1 - e^c)$ and
    $\partial\ell/\partial r = \beta\,\sigma(-L)/(1 - e^r)$, computed in log space; at $c = 0$
    they are the limits $-\beta\,e^r/(1 - e^r)$ and 0 (the chain rule gives $0 \cdot \infty$).

    Args:
        chosen_logps: length-averaged log-probabilities of the chosen completions, ``(N,)``, ``≤ 0``.
        rejected_logps: of the rejected completions, same shape, ``< 0``.
        beta: the weight $\beta \ge 0$ of the term. Default: ``0.1``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Returns:
        ``(N,)`` for ``'none'``, else 0-d; float32 for float16/bfloat16 inputs.

    Raises:
        TypeError: an input is not a floating-point tensor, or ``beta`` is not a number.
        ValueError: shapes differ, ``beta`` is negative, or ``reduction`` is unknown.

    Example:
        >>> import torch
        >>> import stablelosses.functional as SF
        >>> c = torch.tensor([-1e-9], requires_grad=True)
        >>> r = torch.tensor([-1.0])
        >>> naive = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        >>> naive
        tensor([inf], grad_fn=<SubBackward0>)
        >>> loss = SF.orpo_loss(c, r); loss.backward()
        >>> bool(torch.isfinite(c.grad).all()), loss.item() < 1e-9
        (True, True)

    References:
        Hong et al., "ORPO: Monolithic Preference Optimization without Reference Model", 2024;
        Mächler, "Accurately Computing log(1 − exp(−|a|))", 2012. TRL
        ``trl/experimental/orpo/orpo_trainer.py``, ``ORPOTrainer.odds_ratio_loss`` (its
        ``log1mexp`` since TRL #4763).

    Replaces ORPO's ``−β·logsigmoid(log_odds)`` with ``log1p(−exp(logp))``.
    """
    fn = "orpo_loss"
    beta, reduction = check_orpo_args("orpo_loss", beta, reduction)
    (c, r), _ = operands(fn, chosen_logps=chosen_logps, rejected_logps=rejected_logps)
    return reduced(beta * _OddsRatio.call(c, r), reduction)


def simpo_loss(
    chosen_logps: Tensor, rejected_logps: Tensor, *, beta: float = 2.0, gamma_beta_ratio: float = 0.5,
    label_smoothing: float = 0.0, reduction: str = "mean",
) -> Tensor:
    r"""SimPO on length-averaged log-probabilities (the reference-free margin loss).

    $$ z = \beta\,(c - r - \gamma/\beta), \qquad
       \ell = -(1-\varepsilon)\log\sigma(z) - \varepsilon\log\sigma(-z) $$

    ``γ/β`` = ``gamma_beta_ratio``. Exact ``log σ`` at every margin; a smoothing term of
    weight 0 is left out. The length-averaged inputs should come from
    [`sequence_logps(..., average=True)`][stablelosses.functional.sequence_logps], whose empty
    completion is 0 with gradient 0 (TRL #3339: ``sum / 0`` = NaN).

    **Gradient.** $\partial\ell/\partial c = -\partial\ell/\partial r =
    -\beta(1-\varepsilon)\sigma(-z) + \beta\varepsilon\sigma(z)$, finite at every margin.

    Args:
        chosen_logps: length-averaged log-probabilities of the chosen completions, ``(N,)``.
        rejected_logps: of the rejected completions, same shape.
        beta: $\beta \ge 0$, the scale of the length-averaged margin. Default: ``2.0``.
        gamma_beta_ratio: the target margin over $\beta$, $\gamma/\beta$. Default: ``0.5``.
        label_smoothing: $\varepsilon \in [0, 1]$. Default: ``0.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'`` over the ``N`` pairs. Default: ``'mean'``.

    Returns:
        One loss per pair, ``(N,)``, for ``'none'``; else 0-d. Float32 for float16/bfloat16
        inputs.

    Raises:
        TypeError: an input is not a floating-point tensor, or ``beta``, ``gamma_beta_ratio`` or
            ``label_smoothing`` is not a real number.
        ValueError: shapes differ, ``beta`` is negative, ``gamma_beta_ratio`` is NaN or
            infinite, ``label_smoothing`` is outside $[0, 1]$, or ``reduction`` is unknown.

    Example:
        >>> import torch
        >>> import stablelosses.functional as SF
        >>> x = torch.zeros(2, 3, 5, requires_grad=True)
        >>> labels = torch.tensor([[1, 2, 3], [-100, -100, -100]])  # an empty completion
        >>> logps = SF.sequence_logps(x, labels, average=True)
        >>> SF.simpo_loss(logps[:1], logps[1:]).backward()
        >>> bool(torch.isfinite(x.grad).all()), x.grad[1].abs().sum().item()
        (True, 0.0)

    References:
        Meng et al., "SimPO: Simple Preference Optimization with a Reference-Free Reward", 2024.
        TRL ``trl/experimental/cpo/cpo_trainer.py``, ``CPOTrainer.cpo_loss`` (``loss_type='simpo'``).

    Replaces TRL's SimPO loss.
    """
    fn = "simpo_loss"
    beta, ratio, eps, reduction = check_simpo_args("simpo_loss", beta, gamma_beta_ratio, label_smoothing,
                                                   reduction)
    (c, r), _ = operands(fn, chosen_logps=chosen_logps, rejected_logps=rejected_logps)
    return reduced(logistic(beta * ((c - r) - ratio), eps), reduction)


def cpo_loss(
    chosen_logps: Tensor, rejected_logps: Tensor, *, beta: float = 0.1, label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    r"""CPO's preference term (the NLL term is `cross_entropy`).

    $$ z = \beta\,(c - r), \qquad \ell = -(1-\varepsilon)\log\sigma(z) - \varepsilon\log\sigma(-z) $$

    Exact ``log σ`` at every margin; a smoothing term of weight 0 is left out.

    **Gradient.** $\partial\ell/\partial c = -\partial\ell/\partial r =
    -\beta(1-\varepsilon)\sigma(-z) + \beta\varepsilon\sigma(z)$, finite at every margin.

    Args:
        chosen_logps: log-probabilities of the chosen completions, ``(N,)``.
        rejected_logps: of the rejected completions, same shape.
        beta: $\beta \ge 0$. Default: ``0.1``.
        label_smoothing: $\varepsilon \in [0, 1]$. Default: ``0.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Returns:
        ``(N,)`` for ``'none'``, else 0-d; float32 for float16/bfloat16 inputs.

    Raises:
        TypeError: an input is not a floating-point tensor, or a scalar argument has the wrong type.
        ValueError: shapes differ, ``beta`` is negative, ``label_smoothing`` is outside $[0, 1]$,
            or ``reduction`` is unknown.

    Example:
        >>> import torch
        >>> import stablelosses.functional as SF
        >>> c = torch.tensor([-2e4], requires_grad=True)
        >>> SF.cpo_loss(c, torch.zeros(1), beta=1.0).backward(); c.grad
        tensor([-1.])

    References:
        Xu et al., "Contrastive Preference Optimization", 2024. TRL
        ``trl/experimental/cpo/cpo_trainer.py``, ``CPOTrainer.cpo_loss`` (``loss_type='sigmoid'``).

    Replaces TRL's CPO preference loss.
    """
    fn = "cpo_loss"
    beta, eps, reduction = check_cpo_args("cpo_loss", beta, label_smoothing, reduction)
    (c, r), _ = operands(fn, chosen_logps=chosen_logps, rejected_logps=rejected_logps)
    return reduced(logistic(beta * (c - r), eps), reduction)


def kto_loss(
    policy_logps: Tensor, ref_logps: Tensor, desirable: Tensor, *, kl: float | Tensor = 0.0,
    beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
    reduction: str = "mean",
) -> Tensor:
    r"""KTO on per-sequence log-probabilities of unpaired examples.

    With $\rho = \text{policy} - \text{ref}$ and the reference point $z_0$ = ``kl``:

    $$ \ell_i = \begin{cases}
         \lambda_D\,\big(1 - \sigma(\beta(\rho_i - z_0))\big) = \lambda_D\,\sigma(-\beta(\rho_i - z_0))
         & \text{desirable} \\
         \lambda_U\,\big(1 - \sigma(\beta(z_0 - \rho_i))\big) = \lambda_U\,\sigma(\beta(\rho_i - z_0))
         & \text{undesirable} \end{cases} $$

    ``'mean'`` divides by $N$ (every example, as TRL's mean over the concatenated losses).
    ``1 − σ`` is computed as ``σ(−·)``: exact tails. Each example picks its branch by a
    select, so a batch with no undesirable (or no desirable) example adds nothing for that
    group: no empty mean, no NaN (TRL PR #1380, #2554). ``kl`` is used as given: pass TRL's
    detached, clamped batch estimate (``(policy_KL − ref_KL).mean().clamp(min=0)``).

    **Gradient.** $\partial\ell_i/\partial\rho_i = \mp\lambda\beta\,\sigma(z)\sigma(-z)$,
    finite at every margin.

    Args:
        policy_logps: policy log-probabilities, ``(N,)``.
        ref_logps: reference model's, same shape.
        desirable: bool, same shape (True = desirable).
        kl: the reference point $z_0$, a number or a tensor broadcastable to ``(N,)``.
            Default: ``0.0``.
        beta: $\beta \ge 0$. Default: ``0.1``.
        desirable_weight: $\lambda_D \ge 0$. Default: ``1.0``.
        undesirable_weight: $\lambda_U \ge 0$. Default: ``1.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Returns:
        ``(N,)`` for ``'none'``, else 0-d; float32 for float16/bfloat16 inputs.

    Raises:
        TypeError: an input is not a floating-point tensor, ``desirable`` is not bool, or a
            scalar argument has the wrong type.
        ValueError: shapes differ, a weight or ``beta`` is negative, or ``reduction`` is unknown.

    Example:
        >>> import torch
        >>> import stablelosses.functional as SF
        >>> p = torch.tensor([-3.0, -2.0], requires_grad=True)
        >>> desirable = torch.tensor([True, True])  # no undesirable example in this batch
        >>> SF.kto_loss(p, torch.full((2,), -2.5), desirable, beta=1.0)
        tensor(0.5000, grad_fn=<DivBackward0>)

    References:
        Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization", 2024. TRL
        ``trl/trainer/kto_trainer.py``, ``KTOTrainer._compute_loss`` (``kto_loss`` in earlier
        releases).

    Replaces TRL's KTO loss.
    """
    fn = "kto_loss"
    beta, w_d, w_u, reduction = check_kto_args("kto_loss", beta, desirable_weight, undesirable_weight,
                                               reduction)
    (p, ref), dtype = operands(fn, policy_logps=policy_logps, ref_logps=ref_logps)
    if not isinstance(desirable, Tensor) or desirable.dtype != torch.bool:
        what = desirable.dtype if isinstance(desirable, Tensor) else type(desirable).__name__
        raise TypeError(f"{fn}: desirable must be a bool tensor, got {what}")
    if desirable.shape != p.shape:
        raise ValueError(
            f"{fn}: desirable shape {tuple(desirable.shape)} must equal policy_logps shape {tuple(p.shape)}"
        )
    if isinstance(kl, Tensor):
        z0 = cast(check_floating(fn, "kl", kl), dtype)
        if not broadcasts_to(z0.shape, p.shape):
            raise ValueError(f"{fn}: kl shape {tuple(z0.shape)} does not broadcast to {tuple(p.shape)}")
    else:
        z0 = check_real(fn, "kl", kl)
    z = beta * ((p - ref) - z0)
    loss = torch.where(desirable, w_d * torch.sigmoid(-z), w_u * torch.sigmoid(z))
    return reduced(loss, reduction)
