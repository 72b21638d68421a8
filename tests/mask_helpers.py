"""Helpers shared by the tests of the ``mask=`` argument (test_mask_argument.py and each
loss's own mask tests): float64 inputs from a fixed seed, and references that do not take the
masked code path (torch's loss on the kept entries, reduced by hand)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

D = torch.float64


NAN = float("nan")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grad(loss: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(loss.sum(), xs, allow_unused=True)


def _masked_ref(loss_none: torch.Tensor, mask: torch.Tensor, reduction: str,
                weights: torch.Tensor | None = None) -> torch.Tensor:
    """torch's reduction over the kept entries; ``weights``: the per-row weights whose kept sum
    divides the ``'mean'`` (cross_entropy's weighted mean)."""
    m = mask.expand(loss_none.shape)
    if reduction == "none":
        return torch.where(m, loss_none, 0.0)
    kept = loss_none[m]
    if reduction == "sum":
        return kept.sum()
    if weights is not None:
        return kept.sum() / weights[m].sum()
    return kept.mean() if kept.numel() else loss_none.new_zeros(())


def _torch_sigmoid_focal(x, t):
    p = torch.sigmoid(x)
    ce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
    p_t = p * t + (1 - p) * (1 - t)
    return (0.25 * t + 0.75 * (1 - t)) * ce * (1 - p_t) ** 2


def _elementwise_inputs(name: str, shape=(4, 5), seed=0):
    g = _gen(seed)
    x = torch.randn(shape, generator=g, dtype=D)
    if name == "sigmoid_focal_loss":
        t = torch.rand(shape, generator=g, dtype=D)
    elif name == "kl_div":
        x = x.log_softmax(-1)
        t = torch.rand(shape, generator=g, dtype=D).softmax(-1)
    else:
        t = torch.randn(shape, generator=g, dtype=D)
    return x.requires_grad_(), t


def _ce_inputs(seed=0, n=7, c=5):
    g = _gen(seed)
    x = torch.randn(n, c, generator=g, dtype=D, requires_grad=True)
    t = torch.randint(0, c, (n,), generator=g)
    t[2] = -100
    m = torch.tensor([True, False, True, True, False, True, True][:n])
    w = torch.rand(c, generator=g, dtype=D) + 0.1
    return x, t, m, w


def _torch_focal_none(x, t, gamma, w):
    logp = torch.log_softmax(x, 1)
    keep = t != -100
    idx = torch.where(keep, t, 0)
    lp = logp.gather(1, idx[:, None])[:, 0]
    wt = torch.ones_like(lp) if w is None else w[idx]
    return torch.where(keep, -wt * (1 - lp.exp()) ** gamma * lp, 0.0), torch.where(keep, wt, 0.0)
