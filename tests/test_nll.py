"""nll_loss: -inf log-probabilities at ignored or zero-weight positions contribute 0 (torch:
NaN for a zero weight); torch's kernel, value and gradient everywhere else; weight gets the
derivative of the value."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import stablelosses as sl
import stablelosses.functional as SF

NEG = float("-inf")


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_minus_inf_at_zero_weight_classes_adds_zero(reduction):
    logp = torch.tensor([[0.0, NEG, -1.0], [-2.0, NEG, -0.5]], requires_grad=True)
    t, w = torch.tensor([0, 1]), torch.tensor([1.0, 0.0, 2.0])
    out = SF.nll_loss(logp, t, weight=w, reduction=reduction)
    assert torch.isfinite(out).all()
    # the reference: the same loss with the weightless row left out of the sum
    ref = F.nll_loss(logp[:1], t[:1], weight=w, reduction=reduction)
    if reduction == "none":
        torch.testing.assert_close(out, torch.cat([ref, torch.zeros(1)]))
    else:
        torch.testing.assert_close(out, ref)
    assert torch.isnan(F.nll_loss(logp, t, weight=w, reduction=reduction)).any()  # torch
    out.sum().backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[1] == 0).all()


def test_spatial_input_with_ignored_and_zero_weight_positions():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(2, 3, 4, generator=g).log_softmax(1)
    logp[0, 1, :] = NEG
    logp.requires_grad_()
    t = torch.tensor([[1, 0, 2, 1], [0, 2, 2, 1]])
    t[0, 0] = -100  # ignored, and its class has -inf
    w = torch.tensor([1.0, 0.0, 0.5])
    out = SF.nll_loss(logp, t, weight=w)
    assert torch.isnan(F.nll_loss(logp, t, weight=w))
    keep = (t != -100) & (t != 1)
    picked = logp.detach().gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
    wt = w[t.clamp(min=0)]
    expected = -(wt * picked)[keep].sum() / wt[keep].sum()
    torch.testing.assert_close(out, expected)
    out.backward()
    assert torch.isfinite(logp.grad).all()


def test_nan_at_a_counted_entry_stays_nan():
    logp = torch.tensor([[float("nan"), 0.0]])
    assert torch.isnan(SF.nll_loss(logp, torch.tensor([0])))


def test_weight_gets_the_gradient_of_the_value():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(5, 3, generator=g, dtype=torch.float64).log_softmax(1)
    t = torch.tensor([0, 2, -100, 1, 2])
    w = (torch.rand(3, generator=g, dtype=torch.float64) + 0.1).requires_grad_()
    for red in ("none", "mean", "sum"):
        assert torch.autograd.gradcheck(lambda v, red=red: SF.nll_loss(logp, t, weight=v, reduction=red), (w,))
        torch.testing.assert_close(SF.nll_loss(logp, t, weight=w, reduction=red),
                                   F.nll_loss(logp, t, weight=w.detach(), reduction=red))


def test_input_gradient_and_double_backward_are_torchs():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 2, 1, -100])
    w = torch.rand(3, generator=g, dtype=torch.float64)
    ours, theirs = SF.nll_loss(x, t, w), F.nll_loss(x, t, w)
    torch.testing.assert_close(torch.autograd.grad(ours, x)[0], torch.autograd.grad(theirs, x)[0])
    assert torch.autograd.gradgradcheck(lambda v: SF.nll_loss(v, t, w, reduction="none"), (x,))


def test_errors_name_the_argument():
    with pytest.raises(RuntimeError, match="nll_loss: target must be an integer tensor"):
        SF.nll_loss(torch.zeros(2, 3), torch.zeros(2))
    with pytest.raises(TypeError, match="nll_loss: ignore_index must be an int"):
        SF.nll_loss(torch.zeros(2, 3), torch.tensor([0, 1]), ignore_index=True)
    with pytest.raises(IndexError, match="nll_loss: .*input.*target"):
        SF.nll_loss(torch.zeros(2, 3), torch.tensor([0, 5]))


def test_module():
    m = sl.NLLLoss(weight=torch.tensor([1.0, 0.0]))
    logp = torch.tensor([[0.0, NEG], [0.0, NEG]], requires_grad=True)
    m(logp, torch.tensor([0, 1])).backward()
    assert torch.isfinite(logp.grad).all()
