r"""The naive post-training formulas, transcribed: what the public trainers compute, written as
they are posted, **not** as they should be. The hazard matrix (``hazard_matrix.py``) and the
distillation tests import them from here, so every comparison is made against the same code.

Each is a reference spelling of public code (the sources are named per function), reduced to
the loss itself; none of them is used by stablelosses' losses. ``sequence_mean``,
``grpo_policy_loss`` and ``orpo_odds_ratio`` live in ``stablelosses.naive`` (the demo shows them)
and are imported from there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from stablelosses.naive import grpo_policy_loss, orpo_odds_ratio, sequence_mean

__all__ = [
    "trl_generalized_jsd_loss",
    "trl_entropy_from_logits",
    "prob_target_reverse_kl",
    "prob_mixture_js",
    "token_mean",
    "sequence_mean",
    "grpo_policy_loss",
    "k3_kl",
    "orpo_odds_ratio",
]


def trl_generalized_jsd_loss(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor | None = None,
                             beta: float = 0.5, temperature: float = 1.0,
                             reduction: str = "batchmean") -> Tensor:
    """TRL's ``GKDTrainer.generalized_jsd_loss``: ``beta=0`` the forward KL
    ``F.kl_div(log q, log p, log_target=True)``, ``beta=1`` the reverse, otherwise
    ``β KL(p‖m) + (1−β) KL(q‖m)`` with the log mixture from ``torch.logsumexp`` of the stacked
    ``log q + log(1−β)`` and ``log p + log β``; tokens with label ``-100`` are dropped;
    ``'batchmean'`` divides by the kept token count (by ``B·T`` without labels)."""
    ls = F.log_softmax(student_logits / temperature, dim=-1)
    lt = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(ls, lt, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(lt, ls, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=ls.dtype)
        mix = torch.logsumexp(torch.stack([ls + torch.log(1 - b), lt + torch.log(b)]), dim=0)
        jsd = b * F.kl_div(mix, lt, reduction="none", log_target=True) + (1 - b) * F.kl_div(
            mix, ls, reduction="none", log_target=True)
    keep = None
    if labels is not None:
        keep = labels != -100
        jsd = jsd[keep]
    if reduction == "batchmean":
        if keep is not None:
            return jsd.sum() / keep.sum()
        return jsd.sum() / (jsd.size(0) * jsd.size(1))
    if reduction == "sum":
        return jsd.sum()
    if reduction == "mean":
        return jsd.mean()
    return jsd


def trl_entropy_from_logits(logits: Tensor) -> Tensor:
    """TRL's ``entropy_from_logits`` (before the fix of huggingface/trl#7221):
    ``−Σ exp(log p)·log p``; a ``-inf`` logit is ``0·(−inf)`` = NaN."""
    logp = F.log_softmax(logits, dim=-1)
    return -(torch.exp(logp) * logp).sum(-1)


def prob_target_reverse_kl(student_logits: Tensor, teacher_logits: Tensor,
                           temperature: float = 1.0) -> Tensor:
    """Reverse KL with the student's probabilities as ``F.kl_div``'s target (the spelling of the
    report "Reverse-KL and JS distillation can return finite losses with NaN gradients",
    MakazhanAlpamys/Soup#719): per token ``Σ q (log q − log p)``."""
    lt = F.log_softmax(teacher_logits / temperature, dim=-1)
    q = F.softmax(student_logits / temperature, dim=-1)
    return F.kl_div(lt, q, reduction="none").sum(-1)


def prob_mixture_js(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Jensen-Shannon with the mixture in probability space and a ``1e-12`` clamp (the same
    report): ``½ KL(p‖m) + ½ KL(q‖m)``, ``log m = log(max(½(p + q), 1e-12))``."""
    p = F.softmax(teacher_logits / temperature, dim=-1)
    q = F.softmax(student_logits / temperature, dim=-1)
    log_m = (0.5 * (p + q)).clamp_min(1e-12).log()
    return 0.5 * (F.kl_div(log_m, p, reduction="none") + F.kl_div(log_m, q, reduction="none")).sum(-1)


def token_mean(loss: Tensor, mask: Tensor) -> Tensor:
    """``(loss * mask).sum() / mask.sum()``: 0/0 on an all-masked batch, ``inf·0`` at a masked inf."""
    m = mask.to(loss.dtype)
    return (loss * m).sum() / m.sum()


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """TRL's k3 estimator: ``exp(ref − logp) − (ref − logp) − 1`` (cancels at small ``d``)."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1

