"""ctc_loss: an impossible alignment is inf (0 with zero_infinity) with a gradient exactly 0
for that sample, never NaN; the feasible samples' values and gradients are torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import stablelosses as sl
import stablelosses.functional as SF


def _batch(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(5, 3, 4, generator=g, dtype=dtype).log_softmax(2).requires_grad_()
    targets = torch.tensor([[1, 2, 0, 0], [1, 1, 2, 3], [3, 0, 0, 0]])
    # sample 1: 4 labels with a repeat need 5 frames, it has 3: impossible
    input_lengths = torch.tensor([5, 3, 4])
    target_lengths = torch.tensor([2, 4, 1])
    return lp, targets, input_lengths, target_lengths


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_value_is_torchs_and_gradient_is_torchs_zero_infinity_one(reduction, zero_infinity):
    lp, t, il, tl = _batch()
    ours = SF.ctc_loss(lp, t, il, tl, reduction=reduction, zero_infinity=zero_infinity)
    theirs = F.ctc_loss(lp, t, il, tl, reduction=reduction, zero_infinity=zero_infinity)
    torch.testing.assert_close(ours, theirs)
    if reduction == "none":
        assert ours[1].item() == (0.0 if zero_infinity else float("inf"))
        w = torch.tensor([0.3, 1.0, -0.7], dtype=lp.dtype)
        (g,) = torch.autograd.grad((torch.where(torch.isinf(ours), 0.0, ours) * w).sum(), lp)
        ref = F.ctc_loss(lp, t, il, tl, reduction="none", zero_infinity=True)
        (g_ref,) = torch.autograd.grad((ref * w).sum(), lp)
    else:
        (g,) = torch.autograd.grad(ours, lp)
        ref = F.ctc_loss(lp, t, il, tl, reduction=reduction, zero_infinity=True)
        (g_ref,) = torch.autograd.grad(ref, lp)
    assert torch.isfinite(g).all()
    assert (g[:, 1] == 0).all()  # the impossible sample
    torch.testing.assert_close(g, g_ref)


def test_inf_sample_in_a_sum_keeps_finite_gradients():
    lp, t, il, tl = _batch()
    loss = SF.ctc_loss(lp, t, il, tl, reduction="sum")
    assert loss.item() == float("inf")
    loss.backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[:, 1] == 0).all() and lp.grad[:, 0].abs().sum() > 0


def test_minus_inf_log_probs_make_an_impossible_sample_with_gradient_zero():
    lp, t, il, tl = _batch()
    lp = lp.detach().clone()
    lp[:, 2, 3] = float("-inf")  # label 3 can never be emitted: sample 2 is impossible
    lp.requires_grad_()
    out = SF.ctc_loss(lp, t, il, tl, reduction="none")
    assert out[2].item() == float("inf")
    torch.where(torch.isinf(out), 0.0, out).sum().backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[:, 2] == 0).all()


def _masked_class_batch():
    # class 3 is masked (-inf) at frames 0 and 1 of every sample; sample 0 (labels 1, 2) and
    # sample 2 (label 3 from frame 2 on) stay possible, sample 1 is impossible
    lp, t, il, tl = _batch()
    lp = lp.detach().clone()
    lp[:2, :, 3] = float("-inf")
    return lp, t, il, tl


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_a_masked_class_of_a_possible_sample_gets_gradient_zero_not_nan(reduction, zero_infinity):
    # torch's backward reads exp(log(alpha beta) + nll - lp) at lp = -inf: -inf + inf = NaN,
    # which log_softmax's backward spreads over the whole row of logits. The limit is 0 (the
    # paths through the entry weigh p^2, divided by p), as with -1e4 there
    lp, t, il, tl = _masked_class_batch()
    x = lp.clone().requires_grad_()
    out = SF.ctc_loss(x, t, il, tl, reduction=reduction, zero_infinity=zero_infinity)
    torch.testing.assert_close(out, F.ctc_loss(lp, t, il, tl, reduction=reduction, zero_infinity=zero_infinity))
    (g,) = torch.autograd.grad(out.sum(), x)  # an inf value (sample 1) has gradient 0
    near = lp.clone().requires_grad_()
    ref = F.ctc_loss(near.nan_to_num(neginf=-1e4), t, il, tl, reduction=reduction, zero_infinity=True)
    (g_ref,) = torch.autograd.grad(ref.sum(), near)
    assert torch.isfinite(g).all()
    assert torch.equal(g[:2, :, 3], torch.zeros_like(g[:2, :, 3]))
    torch.testing.assert_close(g, g_ref)


@pytest.mark.slow
def test_a_masked_class_compiled_gets_gradient_zero_not_nan():
    lp, t, il, tl = _masked_class_batch()
    torch._dynamo.reset()
    f = torch.compile(lambda x: SF.ctc_loss(x, t, il, tl, reduction="sum", zero_infinity=True), fullgraph=True)
    a, b = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    (g_got,) = torch.autograd.grad(f(a), a)
    (g_want,) = torch.autograd.grad(SF.ctc_loss(b, t, il, tl, reduction="sum", zero_infinity=True), b)
    assert torch.isfinite(g_got).all()
    torch.testing.assert_close(g_got, g_want)


def test_gradcheck_at_a_generic_point():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    t, il, tl = torch.tensor([[1, 2], [2, 0]]), torch.tensor([4, 3]), torch.tensor([2, 1])
    # through log_softmax, as torch's own CTC gradcheck (its kernel's gradient is the one of
    # normalised log-probabilities)
    assert torch.autograd.gradcheck(lambda x: SF.ctc_loss(x.log_softmax(2), t, il, tl, reduction="none"), (logits,))


def test_half_precision_is_computed_in_float32():
    lp, t, il, tl = _batch(torch.float32)
    out = SF.ctc_loss(lp.detach().half(), t, il, tl, reduction="none")
    assert out.dtype == torch.float16
    ref = F.ctc_loss(lp.detach().half().float(), t, il, tl, reduction="none").half()
    torch.testing.assert_close(out, ref)


def test_nan_in_nan_out():
    lp, t, il, tl = _batch()
    lp = lp.detach().clone()
    lp[0, 0, 1] = float("nan")
    assert torch.isnan(SF.ctc_loss(lp, t, il, tl, reduction="none")[0])


def test_errors():
    lp, t, il, tl = _batch()
    with pytest.raises(TypeError, match="ctc_loss: zero_infinity must be a bool"):
        SF.ctc_loss(lp, t, il, tl, zero_infinity=1)
    with pytest.raises(RuntimeError, match="ctc_loss: .*log_probs"):
        SF.ctc_loss(lp, t, il, tl, blank=7)
    with pytest.raises(RuntimeError):
        F.ctc_loss(lp, t, il, tl, blank=7)


def test_module():
    lp, t, il, tl = _batch()
    m = sl.CTCLoss(blank=0, reduction="sum", zero_infinity=False)
    m(lp, t, il, tl).backward()
    assert torch.isfinite(lp.grad).all()


class _NaNBackwardCTC(torch.autograd.Function):
    """torch's CTC value with a backward that is NaN everywhere: a stand-in for a backend whose
    kernel writes NaN into the gradient (cuDNN, pytorch #21680)."""

    @staticmethod
    def forward(lp, targets, input_lengths, target_lengths, blank, reduction, zero_infinity):
        return F.ctc_loss(lp, targets, input_lengths, target_lengths, blank=blank, reduction=reduction,
                          zero_infinity=zero_infinity)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.shape = inputs[0].shape

    @staticmethod
    def backward(ctx, grad):
        return torch.full(ctx.shape, float("nan"), dtype=grad.dtype), None, None, None, None, None, None


def test_impossible_sample_gradient_is_zero_even_if_the_kernel_backward_is_nan(monkeypatch):
    from types import SimpleNamespace

    import stablelosses.functional._ctc as ctc_module

    def nan_ctc(lp, targets, il, tl, blank=0, reduction="mean", zero_infinity=False):
        return _NaNBackwardCTC.apply(lp, targets, il, tl, blank, reduction, zero_infinity)

    monkeypatch.setattr(ctc_module, "F", SimpleNamespace(ctc_loss=nan_ctc))
    lp, t, il, tl = _batch()
    SF.ctc_loss(lp, t, il, tl, reduction="sum", zero_infinity=True).backward()
    assert (lp.grad[:, 1] == 0).all()  # the impossible sample: detached before the kernel
    assert torch.isnan(lp.grad[:, 0]).all()  # the feasible ones carry the kernel's gradient


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_non_contiguous_concatenated_targets_give_the_contiguous_value(reduction):
    """Concatenated (1-d) targets as a strided slice: the value and gradient of the same targets
    contiguous (torch 2.13's CPU kernel reads such targets wrong: 3.2055 for 2.7191)."""
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(8, 2, 5, generator=g, dtype=torch.float64).log_softmax(2).requires_grad_()
    targets = torch.randint(1, 5, (6,), generator=g)
    strided = torch.zeros(12, dtype=torch.long)
    strided[::2] = targets
    strided = strided[::2]
    assert not strided.is_contiguous() and torch.equal(strided, targets)
    lengths, target_lengths = torch.full((2,), 8), torch.tensor([3, 3])
    want = SF.ctc_loss(lp, targets, lengths, target_lengths, reduction=reduction)
    got = SF.ctc_loss(lp, strided, lengths, target_lengths, reduction=reduction)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (g_want,) = torch.autograd.grad(want, lp, w)
    (g_got,) = torch.autograd.grad(got, lp, w)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_compiled_fullgraph_gives_the_eager_value_and_gradient(reduction, zero_infinity):
    """torch.compile(fullgraph=True) runs (torch's F.ctc_loss does not: its kernel's output
    shape depends on the data), with an impossible sample's inf value and 0 gradient."""
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(8, 3, 5, generator=g, dtype=torch.float64).log_softmax(2)
    targets = torch.randint(1, 5, (3, 4), generator=g)
    lengths, target_lengths = torch.tensor([8, 8, 2]), torch.tensor([3, 4, 3])  # the last: impossible
    torch._dynamo.reset()
    f = torch.compile(lambda x: SF.ctc_loss(x, targets, lengths, target_lengths, reduction=reduction,
                                            zero_infinity=zero_infinity), fullgraph=True)
    a, b = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    got = f(a)
    want = SF.ctc_loss(b, targets, lengths, target_lengths, reduction=reduction, zero_infinity=zero_infinity)
    torch.testing.assert_close(got, want)
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (g_got,), (g_want,) = torch.autograd.grad(got, a, w), torch.autograd.grad(want, b, w)
    torch.testing.assert_close(g_got, g_want)
    assert torch.equal(g_got[:, 2], torch.zeros_like(g_got[:, 2]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_log_probs_under_autocast_give_float32_as_torch(dtype):
    # torch's ctc_loss is on autocast's float32 list: a half input gives a float32 loss there
    lp = torch.randn(6, 2, 4, generator=torch.Generator().manual_seed(0)).log_softmax(2).to(dtype)
    args = (torch.tensor([[1, 2], [3, 3]]), torch.tensor([6, 5]), torch.tensor([2, 2]))
    with torch.autocast("cpu", dtype=dtype):
        want = F.ctc_loss(lp, *args)
        got = SF.ctc_loss(lp, *args)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want)
    assert SF.ctc_loss(lp, *args).dtype == dtype  # outside autocast: the input's dtype
