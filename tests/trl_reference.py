"""TRL's GRPO policy loss transcribed in float64 (``trl/trainer/grpo_trainer.py``,
``GRPOTrainer._compute_loss``): the reference of tests/test_policy.py and of the post-training
contract tests. It imports nothing from stablelosses."""

from __future__ import annotations

import torch


def trl_policy(logps, old, adv, mask, eps_low, eps_high, importance, loss_type, ref=None, beta=0.0,
               normalizer=None):
    mask = mask.to(logps.dtype)
    log_ratio = logps - old
    if importance == "token":
        liw = log_ratio
    else:
        liw = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(liw)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta != 0.0:
        per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        seq = (per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return seq.mean() if normalizer is None else seq.sum() / normalizer
    if loss_type == "bnpo":
        den = mask.sum().clamp(min=1.0) if normalizer is None else normalizer
        return (per_token_loss * mask).sum() / den
    if loss_type == "dr_grpo":
        # TRL: per_token_loss.size(0) * self.max_completion_length (the padded T here)
        den = per_token_loss.size(0) * mask.size(1) if normalizer is None else normalizer
        return (per_token_loss * mask).sum() / den
    den = mask.sum().clamp(min=1.0) if normalizer is None else normalizer  # dapo: num_items_in_batch
    return (per_token_loss * mask).sum() / den
