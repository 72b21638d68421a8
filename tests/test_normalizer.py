"""The one ``normalizer=`` contract of the token losses: it replaces the denominator of
``'mean'``; a fully masked (or fully ignored) batch gives 0 with gradient 0, with no host sync;
``'none'`` passes exact per-token gradients upstream; the normalizer's own checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sync_helpers import HostSyncError, no_host_sync

import stablelosses.functional as SF
from stablelosses._utils import divide


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _class_inputs(n=6, c=5, seed=0):
    g = _gen(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, c, (n,), generator=g)
    t[1] = -100
    return x, t


def _token_losses():
    """(name, loss(x, ignore_all, **kw)) for every token loss of this branch with a normalizer."""
    s_t = torch.randn(6, 5, generator=_gen(3), dtype=torch.float64)

    def ce(x, t, **kw):
        return SF.cross_entropy(x, t, **kw)

    def ce_smooth(x, t, **kw):
        return SF.cross_entropy(x, t, label_smoothing=0.1, **kw)

    def focal(x, t, **kw):
        return SF.focal_loss(x, t, gamma=1.5, **kw)

    def ce_probs(x, t, **kw):
        mask = (t != -100)
        return SF.cross_entropy(x, torch.softmax(s_t, -1), mask=mask, **kw)

    def distill(x, t, **kw):
        return SF.distillation_loss(x, s_t, kind="jsd", mask=t != -100, **kw)

    return [("cross_entropy", ce), ("cross_entropy_smoothing", ce_smooth), ("focal_loss", focal),
            ("cross_entropy_probs", ce_probs), ("distillation_loss", distill)]


LOSSES = _token_losses()


@pytest.mark.parametrize("name, loss", LOSSES, ids=[n for n, _ in LOSSES])
def test_normalizer_replaces_the_denominator(name, loss):
    x, t = _class_inputs()
    for n in (7, 2.5, torch.tensor(7), torch.tensor(2.5, dtype=torch.float64)):
        total = loss(x, t, reduction="sum")
        out = loss(x, t, normalizer=n)
        torch.testing.assert_close(out, total / float(n), rtol=1e-14, atol=0)
        g, = torch.autograd.grad(out, x)
        g_ref, = torch.autograd.grad(total / float(n), x)
        torch.testing.assert_close(g, g_ref, rtol=1e-14, atol=0)


@pytest.mark.parametrize("name, loss", LOSSES, ids=[n for n, _ in LOSSES])
def test_the_valid_count_as_normalizer_equals_the_mean(name, loss):
    x, t = _class_inputs()
    count = (t != -100).sum()
    torch.testing.assert_close(loss(x, t, normalizer=count), loss(x, t), rtol=1e-15, atol=0)


@pytest.mark.parametrize("name, loss", LOSSES, ids=[n for n, _ in LOSSES])
def test_fully_ignored_batch_gives_zero_with_zero_gradient_and_no_sync(name, loss):
    x, _ = _class_inputs()
    t = torch.full((6,), -100)
    for n in (0, torch.tensor(0), torch.tensor(0.0), 5):
        with no_host_sync():
            out = loss(x, t, normalizer=n)
            g, = torch.autograd.grad(out, x)
        assert out.item() == 0.0 and not out.isnan()
        assert torch.equal(g, torch.zeros_like(g))


def test_torch_all_ignored_mean_is_nan_as_the_reports_say():
    # torch #116349 ("by design"), NeMo Automodel #3796: the reason normalizer exists
    x, _ = _class_inputs()
    t = torch.full((6,), -100)
    assert F.cross_entropy(x, t).isnan()
    assert SF.cross_entropy(x, t).isnan()  # drop-in: without normalizer or mask, torch's value
    assert SF.cross_entropy(x, t, normalizer=0).item() == 0.0


def test_no_classes_with_normalizer():
    x = torch.zeros(0, 0, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long)
    for fn in (SF.cross_entropy, SF.focal_loss):
        out = fn(x, t, normalizer=0)
        assert out.item() == 0.0


@pytest.mark.parametrize("name, loss", LOSSES, ids=[n for n, _ in LOSSES])
def test_reduction_none_upstream_gradients_are_exact(name, loss):
    # an accumulation loop reducing the per-token losses itself: the gradient of Σ w_i ℓ_i is
    # Σ w_i ∇ℓ_i exactly, and an ignored token's gradient is exactly 0 whatever its weight
    x, t = _class_inputs()
    per_token = loss(x, t, reduction="none")
    w = torch.randn(per_token.shape, generator=_gen(5), dtype=torch.float64)
    w[1] = float("inf")  # the ignored token: its loss is 0 and does not move
    g, = torch.autograd.grad(per_token, x, w, retain_graph=True)
    assert torch.isfinite(g).all() and torch.equal(g[1], torch.zeros_like(g[1]))
    w[1] = 0.0
    g, = torch.autograd.grad(per_token, x, w, retain_graph=True)
    ref = sum(torch.autograd.grad(per_token[i], x, retain_graph=True)[0] * w[i] for i in range(6))
    torch.testing.assert_close(g, ref, rtol=1e-13, atol=1e-15)
    total = loss(x, t, reduction="sum")
    torch.testing.assert_close(per_token.sum(), total, rtol=1e-14, atol=0)


def test_accumulation_over_micro_batches_equals_one_big_batch():
    # the recipe of docs/normalizer.md: each micro-batch divides by the global token count
    x, t = _class_inputs(n=12, seed=7)
    parts = [(x[:4], t[:4]), (x[4:8], t[4:8]), (x[8:], torch.full((4,), -100))]
    n_items = sum((tt != -100).sum() for _, tt in parts)
    accumulated = sum(SF.cross_entropy(xx, tt, normalizer=n_items) for xx, tt in parts)
    torch.testing.assert_close(accumulated, SF.cross_entropy(x, torch.cat([t[:8], torch.full((4,), -100)])))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"normalizer": -1}, ValueError, "cross_entropy: normalizer must be finite and >= 0, got -1"),
    ({"normalizer": float("nan")}, ValueError, "normalizer must be finite and >= 0"),
    ({"normalizer": float("inf")}, ValueError, "normalizer must be finite and >= 0"),
    ({"normalizer": "4"}, TypeError, "cross_entropy: normalizer must be a number >= 0, a 0-dim tensor or None"),
    ({"normalizer": True}, TypeError, "normalizer"),
    ({"normalizer": torch.ones(3)}, ValueError, "normalizer must be a number or a 0-dim real tensor"),
    ({"normalizer": 4, "reduction": "sum"}, ValueError, "cross_entropy: normalizer replaces the denominator"),
    ({"normalizer": 4, "reduction": "none"}, ValueError, "reduction='none'"),
])
def test_normalizer_checks(kwargs, error, match):
    x, t = _class_inputs()
    with pytest.raises(error, match=match):
        SF.cross_entropy(x, t, **kwargs)
    with pytest.raises(error, match=match.replace("cross_entropy", "focal_loss")):
        SF.focal_loss(x, t, **kwargs)


def test_divide_is_zero_with_zero_gradient_at_a_zero_denominator():
    total = torch.tensor(0.0, requires_grad=True)
    den = torch.tensor(0.0, requires_grad=True)
    out = divide(total, den)
    gt, gd = torch.autograd.grad(out, (total, den))
    assert out.item() == 0.0 and gt.item() == 0.0 and gd.item() == 0.0
    out = divide(torch.tensor(3.0), torch.tensor(2, dtype=torch.int64))
    assert out.item() == 1.5 and out.dtype == torch.float32


def test_sync_helper_catches_a_host_read():
    x = torch.ones(3)
    with pytest.raises(HostSyncError, match="_local_scalar_dense"):
        with no_host_sync():
            x.sum().item()
    with pytest.raises(HostSyncError):
        with no_host_sync():
            bool((x > 0).any())
    with pytest.raises(HostSyncError, match="nonzero"):
        with no_host_sync():
            torch.nonzero(x)


@pytest.mark.slow
def test_normalizer_compiles_fullgraph():
    x, t = _class_inputs()
    x = x.detach().float().requires_grad_()
    n = torch.tensor(0)

    def f(x, n):
        return SF.cross_entropy(x, torch.full((6,), -100), normalizer=n) + SF.distillation_loss(
            x, x.detach(), mask=torch.zeros(6, dtype=torch.bool), normalizer=n)

    out = torch.compile(f, fullgraph=True)(x, n)
    g, = torch.autograd.grad(out, x)
    assert out.item() == 0.0 and torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("fn", ["linear_cross_entropy", "linear_focal_loss"])
def test_fused_class_losses_keep_the_same_contract(fn):
    # the fused paths (the chunk engine) take the same normalizer: the denominator replaced,
    # and 0 with gradient 0 for a fully ignored batch, with no host sync
    g = _gen(11)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 5, (6,), generator=g)
    f = getattr(SF, fn)
    torch.testing.assert_close(f(x, w, t, normalizer=4), f(x, w, t, reduction="sum") / 4, rtol=1e-14, atol=0)
    ignored = torch.full((6,), -100)
    with no_host_sync():
        out = f(x, w, ignored, normalizer=torch.tensor(0))
        gx, gw = torch.autograd.grad(out, (x, w))
    assert out.item() == 0.0 and torch.equal(gx, torch.zeros_like(gx)) and torch.equal(gw, torch.zeros_like(gw))
