r"""The naive formulas: what people write instead of stablelosses, kept in one place.

These are the snippets and built-in compositions whose hazards stablelosses fixes — written
exactly as they are posted, **not** as they should be. The demo (``python -m stablelosses``),
``stablelosses bench``, the docs figures and the tests import them from here, so every
comparison is made against the same code.

Do not use them for training: each one returns NaN or inf (in the value or the gradient) at
the points listed in its docstring.

| formula | what it stands for | stablelosses replacement |
|---|---|---|
| `sqrt_mse` | `torch.sqrt(F.mse_loss(x, y) + eps)` | `rmse_loss` |
| `log_cosh` | `torch.log(torch.cosh(x - y))` | `log_cosh_loss` |
| `classic_focal` | the classic focal snippet: softmax → log → gather | `focal_loss` |
| `logpt_focal` | the log-space focal snippet: log_softmax → gather → exp | `focal_loss` |
| `torchvision_sigmoid_focal` | `torchvision.ops.sigmoid_focal_loss`, written out | `sigmoid_focal_loss` |
| `exp_softmax`, `exp_log_softmax` | `exp(x) / exp(x).sum()`, its log | `softmax`, `log_softmax` |
| `exp_logsumexp` | `log(exp(x).sum())` | `logsumexp` |
| `masked_softmax`, `masked_log_softmax` | `masked_fill(~mask, -inf)`, then torch | `mask=` |
| `formula_kl_div` | `(t * (log t - x)).sum() / N` | `kl_div(reduction='batchmean')` |
| `where_div`, `double_where_div` | `where(b != 0, a / b, 0)` and the double-`where` idiom | `safe_div` |
| `x_log_y` | `x * log(y)` | `xlogy` |
| `unit_vector` | `x / x.norm(dim=dim, keepdim=True)` | `normalize` |
| `cosine_formula` | `(a * b).sum(dim) / (a.norm(dim) * b.norm(dim))` | `cosine_similarity` |
| `masked_mean_formula` | `(x * mask).sum() / mask.sum()` | `masked_mean` |
| `softmax_entropy` | `-(softmax(x) * log_softmax(x)).sum(dim)` | `entropy` |
| `dice_formula` | `1 - 2 Σpt / (Σp + Σt)` per sample | `dice_loss` |
| `info_nce_formula` | `F.cross_entropy(q̂ @ k̂.T / τ, arange(N))` with `x / x.norm()` | `info_nce_loss` |
| `grpo_policy_loss` | TRL's GRPO surrogate: `exp(logp − old)`, clip, min, masked mean | `policy_loss` |
| `orpo_odds_ratio` | TRL's ORPO term with `log1p(−exp(logp))` | `orpo_loss` |
| `dpo_formula` | `−log(sigmoid(β·margin))` | `dpo_loss` |
| `forward_kl_formula` | `(p * (log p − log q)).sum(-1).mean()` | `distillation_loss` |
| `gather_token_logps` | `log_softmax(x).gather(labels.clamp(min=0))` times the mask | `token_logps` |

Example:
    >>> import torch
    >>> from stablelosses import naive
    >>> x = torch.zeros(3, requires_grad=True)
    >>> naive.sqrt_mse(x, torch.zeros(3)).backward()
    >>> x.grad
    tensor([nan, nan, nan])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "classic_focal",
    "double_where_div",
    "exp_log_softmax",
    "exp_logsumexp",
    "exp_softmax",
    "formula_kl_div",
    "log_cosh",
    "logpt_focal",
    "masked_log_softmax",
    "masked_softmax",
    "sqrt_mse",
    "torchvision_sigmoid_focal",
    "where_div",
    "x_log_y",
    "unit_vector",
    "cosine_formula",
    "masked_mean_formula",
    "softmax_entropy",
    "dice_formula",
    "info_nce_formula",
    "sequence_mean",
    "grpo_policy_loss",
    "orpo_odds_ratio",
    "dpo_formula",
    "forward_kl_formula",
    "gather_token_logps",
]


def _reduce(loss: Tensor, reduction: str) -> Tensor:
    # written out, not _utils.reduce: the references share no code with the library they check
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.mean()
    raise ValueError(f"naive: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")


def sqrt_mse(input: Tensor, target: Tensor, reduction: str = "mean", eps: float = 0.0) -> Tensor:
    """``torch.sqrt(F.mse_loss(input, target, reduction=reduction) + eps)``.

    Hazards: NaN gradient at a zero residual (``sqrt'(0) = inf`` times 0); the square
    overflows for float16 residuals above 256 (inf value, NaN gradient).
    """
    return torch.sqrt(F.mse_loss(input, target, reduction=reduction) + eps)


def log_cosh(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """``torch.log(torch.cosh(input - target))``, reduced.

    Hazard: ``cosh`` overflows for float32 residuals above ~89 (inf value, NaN gradient).
    """
    return _reduce(torch.log(torch.cosh(input - target)), reduction)


def classic_focal(input: Tensor, target: Tensor, gamma: float = 2.0, reduction: str = "mean") -> Tensor:
    """The classic focal-loss snippet: ``p = softmax(x)``, ``log(p)``, gather the target.

    ``-(1 - p_t) ** gamma * log(p_t)`` for ``(N, C)`` logits and class-index targets.
    Hazards: ``p`` underflows to 0 for a logit far below the row's maximum, so ``log p`` is
    ``-inf`` (inf loss) and its gradient ``0/0`` (NaN, also for non-target classes).
    """
    p = torch.softmax(input, dim=1)
    logp = torch.log(p)
    idx = target.unsqueeze(1)
    pt = p.gather(1, idx).squeeze(1)
    logpt = logp.gather(1, idx).squeeze(1)
    return _reduce(-((1 - pt) ** gamma) * logpt, reduction)


def logpt_focal(input: Tensor, target: Tensor, gamma: float = 2.0, reduction: str = "mean") -> Tensor:
    """The log-space focal snippet: ``log_softmax``, gather ``log p_t``, ``p_t = exp(log p_t)``.

    Finite ``log p_t``, but for ``0 < gamma < 1`` the slope of ``(1 - p_t) ** gamma`` is
    infinite at ``p_t = 1``: a confident correct prediction gets a NaN gradient.
    """
    logpt = F.log_softmax(input, dim=1).gather(1, target.unsqueeze(1)).squeeze(1)
    return _reduce(-((1 - logpt.exp()) ** gamma) * logpt, reduction)


def torchvision_sigmoid_focal(input: Tensor, target: Tensor, alpha: float = 0.25, gamma: float = 2.0,
                              reduction: str = "none") -> Tensor:
    """``torchvision.ops.sigmoid_focal_loss``, written out from its published formula.

    Hazard: for ``0 < gamma < 1`` and a saturated logit, ``(1 - p_t) ** gamma`` has an infinite
    slope at ``1 - p_t = 0`` (NaN gradient). It also keeps five full-size temporaries.
    """
    p = torch.sigmoid(input)
    ce_loss = F.binary_cross_entropy_with_logits(input, target, reduction="none")
    p_t = p * target + (1 - p) * (1 - target)
    loss = ce_loss * ((1 - p_t) ** gamma)
    if alpha >= 0:
        alpha_t = alpha * target + (1 - alpha) * (1 - target)
        loss = alpha_t * loss
    return _reduce(loss, reduction)


def exp_softmax(input: Tensor, dim: int = -1) -> Tensor:
    """``exp(x) / exp(x).sum(dim)``. Hazard: ``exp`` overflows above ~88 (inf / inf = NaN)."""
    e = torch.exp(input)
    return e / e.sum(dim=dim, keepdim=True)


def exp_log_softmax(input: Tensor, dim: int = -1) -> Tensor:
    """``log(exp(x) / exp(x).sum(dim))``. Hazards: overflow as `exp_softmax`; ``log 0``."""
    return torch.log(exp_softmax(input, dim))


def exp_logsumexp(input: Tensor, dim: int = -1) -> Tensor:
    """``log(exp(x).sum(dim))``. Hazard: ``exp`` overflows above ~88 (inf, NaN gradient)."""
    return torch.log(torch.exp(input).sum(dim=dim))


def masked_softmax(input: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """``torch.softmax(x.masked_fill(~mask, -inf), dim)``. Hazard: an all-masked slice is NaN."""
    return torch.softmax(input.masked_fill(~mask, float("-inf")), dim=dim)


def masked_log_softmax(input: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """``torch.log_softmax(x.masked_fill(~mask, -inf), dim)``. Hazard: an all-masked slice is NaN."""
    return torch.log_softmax(input.masked_fill(~mask, float("-inf")), dim=dim)


def formula_kl_div(input: Tensor, target: Tensor) -> Tensor:
    """``(t * (log t - x)).sum() / N`` (``'batchmean'``, log-probability input).

    Hazard: a zero target gives ``0 * -inf = NaN`` (and a NaN gradient).
    """
    return (target * (torch.log(target) - input)).sum() / input.shape[0]


def where_div(input: Tensor, other: Tensor) -> Tensor:
    """``torch.where(other != 0, input / other, 0)``.

    Hazard: the value is right, but the gradient of the unselected ``input / 0`` is
    ``0 * inf = NaN`` and reaches both arguments.
    """
    return torch.where(other != 0, input / other, 0.0)


def double_where_div(input: Tensor, other: Tensor) -> Tensor:
    """The double-``where`` idiom: ``where(b == 0, 0, a / where(b == 0, 1, b))`` (no hazard)."""
    zero = other == 0
    return torch.where(zero, 0.0, input / torch.where(zero, 1.0, other))


def x_log_y(input: Tensor, other: Tensor) -> Tensor:
    """``x * log(y)``. Hazard: ``0 * log 0 = 0 * -inf = NaN``."""
    return input * torch.log(other)


def unit_vector(input: Tensor, dim: int = -1) -> Tensor:
    """``x / x.norm(dim=dim, keepdim=True)``. Hazard: a zero vector gives ``0 / 0 = NaN``."""
    return input / input.norm(dim=dim, keepdim=True)


def cosine_formula(x1: Tensor, x2: Tensor, dim: int = -1) -> Tensor:
    """``(a · b) / (‖a‖ ‖b‖)``. Hazard: a zero vector gives ``0 / 0 = NaN``."""
    return (x1 * x2).sum(dim) / (x1.norm(dim=dim) * x2.norm(dim=dim))


def masked_mean_formula(input: Tensor, mask: Tensor) -> Tensor:
    """``(x * mask).sum() / mask.sum()``. Hazard: an empty mask gives ``0 / 0 = NaN``."""
    return (input * mask).sum() / mask.sum()


def softmax_entropy(input: Tensor, dim: int = -1) -> Tensor:
    """``-(softmax(x) * log_softmax(x)).sum(dim)``.

    Hazard: a ``-inf`` (masked) logit gives ``0 * -inf = NaN``.
    """
    return -(torch.softmax(input, dim) * torch.log_softmax(input, dim)).sum(dim)


def dice_formula(input: Tensor, target: Tensor) -> Tensor:
    """``1 - 2 Σ p t / (Σ p + Σ t)`` per sample (all but the batch dim), averaged.

    Hazard: prediction and target both empty give ``0 / 0 = NaN``.
    """
    dims = tuple(range(1, input.dim()))
    return (1 - 2 * (input * target).sum(dims) / (input.sum(dims) + target.sum(dims))).mean()


def info_nce_formula(query: Tensor, key: Tensor, temperature: float = 0.07) -> Tensor:
    """In-batch InfoNCE with ``x / x.norm()``: ``F.cross_entropy(q̂ @ k̂.T / τ, arange(N))``.

    Hazard: a zero embedding gives ``0 / 0 = NaN`` in its row and column of logits.
    """
    q = unit_vector(query, 1)
    k = unit_vector(key, 1)
    return F.cross_entropy(q @ k.T / temperature, torch.arange(query.shape[0], device=query.device))


# --- post-training and distillation (0.4): TRL-style trainer code ------------------------------


def sequence_mean(loss: Tensor, mask: Tensor) -> Tensor:
    """TRL GRPO's per-sequence mean: ``((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()``
    (the clamp makes an empty completion 0; a masked ``inf`` still gives ``inf·0`` = NaN)."""
    m = mask.to(loss.dtype)
    return ((loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


def grpo_policy_loss(logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor,
                     clip_eps: float = 0.2) -> Tensor:
    """TRL GRPOTrainer's clipped surrogate (``loss_type='grpo'``): ``ratio = exp(logp − old)``
    at every position, padding included, then the per-sequence masked mean (`sequence_mean`):
    a masked log-ratio of 200 gives ``exp(200) · 0`` = NaN in the gradient."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    per_token = -torch.min(ratio * adv, clipped * adv)
    return sequence_mean(per_token, mask)


def orpo_odds_ratio(chosen_logps: Tensor, rejected_logps: Tensor, beta: float = 0.1) -> Tensor:
    """TRL ORPOTrainer's odds-ratio term (before trl#4763): ``log_odds = (c − r) − (log1p(−e^c) −
    log1p(−e^r))``, ``−β·logsigmoid(log_odds)`` averaged; ``log1p(−e^c)`` is ``−inf`` (NaN
    gradient) for a log-prob that rounds ``e^c`` to 1 (``c = −1e-9``)."""
    log_odds = (chosen_logps - rejected_logps) - (
        torch.log1p(-torch.exp(chosen_logps)) - torch.log1p(-torch.exp(rejected_logps)))
    return -(beta * F.logsigmoid(log_odds)).mean()


def dpo_formula(chosen: Tensor, rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
                beta: float = 0.1) -> Tensor:
    """DPO as ``−log(sigmoid(β·margin))``, not ``−logsigmoid``: ``inf`` with a NaN gradient once
    ``sigmoid`` rounds to 0 (a margin of −2000 at β = 0.1)."""
    margin = (chosen - rejected) - (ref_chosen - ref_rejected)
    return -torch.log(torch.sigmoid(beta * margin)).mean()


def forward_kl_formula(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """KL(teacher ‖ student) as ``(p * (log p − log q)).sum(-1)``, the token mean: a ``-inf``
    (masked) vocabulary entry gives ``0 · (−inf − (−inf))`` = NaN."""
    p, log_p = teacher_logits.softmax(-1), teacher_logits.log_softmax(-1)
    return (p * (log_p - student_logits.log_softmax(-1))).sum(-1).mean()


def gather_token_logps(logits: Tensor, labels: Tensor) -> Tensor:
    """``log_softmax(x).gather(...)`` with ``-100`` labels clamped to 0, then the mask multiply: an
    ignored row of ``-inf`` logits gives ``NaN · 0`` = NaN."""
    logps = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    return logps * (labels != -100)
