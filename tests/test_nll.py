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


@pytest.mark.parametrize("x", [torch.tensor([[0, -1]]), torch.tensor([[True, False]])])
def test_integer_or_bool_input_is_torchs_not_implemented_error(x):
    # torch 2.13 raises NotImplementedError, older ones a RuntimeError (its base class): ours is
    # torch's type or the subclass
    with pytest.raises(RuntimeError) as theirs:
        F.nll_loss(x, torch.tensor([1]))
    with pytest.raises(type(theirs.value), match="nll_loss: input"):
        SF.nll_loss(x, torch.tensor([1]))


def test_weight_dtype_message_has_torchs_scalar_type_names():
    x, t, w = torch.randn(2, 3), torch.tensor([0, 1]), torch.ones(3, dtype=torch.half)
    with pytest.raises(RuntimeError, match="expected scalar type Float but found Half"):
        F.nll_loss(x, t, weight=w)
    with pytest.raises(RuntimeError, match="nll_loss: .*expected scalar type Float but found Half"):
        SF.nll_loss(x, t, weight=w)


def test_double_backward_has_the_mixed_input_weight_derivative():
    # d/dw (dL/dx) was a silent None (the weight's term saw a detached input)
    lp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 1, 3])
    w = torch.rand(4, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(SF.nll_loss(lp, t, w, reduction="sum"), lp, create_graph=True)
    (mixed,) = torch.autograd.grad(gx.sum(), w)
    torch.testing.assert_close(mixed, -torch.bincount(t, minlength=4).double())
    for red in ("none", "mean", "sum"):
        assert torch.autograd.gradgradcheck(lambda x, w, red=red: SF.nll_loss(x, t, w, reduction=red), (lp, w))
    # and on torch's own samples, every floating tensor a leaf
    from test_torch_losses import _opinfo_gradgradcheck

    _opinfo_gradgradcheck("nll_loss")


def test_weight_that_requires_grad_does_not_double_the_input_tangent():
    lp = torch.randn(3, 4, dtype=torch.float64)
    t = torch.tensor([0, 1, 3])
    w = torch.rand(4, dtype=torch.float64, requires_grad=True)
    for red in ("none", "mean", "sum"):
        got = torch.func.jacfwd(lambda x, red=red: SF.nll_loss(x, t, w, reduction=red))(lp)
        expected = torch.func.jacfwd(lambda x, red=red: F.nll_loss(x, t, w.detach(), reduction=red))(lp)
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("layout", ["channels_last", "transposed_input", "transposed_target"])
def test_non_contiguous_image_inputs_give_torchs_contiguous_value_and_gradient(layout):
    """(N, C, H, W) log-probabilities: torch's backward raises "grad_input must be contiguous"
    for a non-contiguous input (channels_last included); ours gives the contiguous value and
    gradient, also for a non-contiguous target (whose layout a select had passed on)."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 4, 3, 3, generator=g, dtype=torch.float64).log_softmax(1)
    t = torch.randint(0, 4, (2, 3, 3), generator=g)
    ref = x0.clone().requires_grad_()
    want = F.nll_loss(ref, t)
    (g_want,) = torch.autograd.grad(want, ref)
    x, target = x0, t
    if layout == "channels_last":
        x = x0.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed_input":
        x = x0.transpose(2, 3).contiguous().transpose(2, 3)
    else:
        target = t.transpose(1, 2).contiguous().transpose(1, 2)
    x = x.clone(memory_format=torch.preserve_format).requires_grad_()
    got = SF.nll_loss(x, target)
    (g_got,) = torch.autograd.grad(got, x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("fn", [SF.nll_loss, SF.cross_entropy])
def test_unbatched_target_with_a_learnable_weight_compiles_fullgraph(fn):
    # w[t] with a 0-d t read t on the host: a data-dependent graph break under fullgraph
    x = torch.randn(8)
    w = torch.rand(8, requires_grad=True)
    t = torch.tensor(5)
    want = fn(x, t, weight=w, reduction="sum")
    (g_want,) = torch.autograd.grad(want, w)
    got = torch.compile(lambda a: fn(a, t, weight=w, reduction="sum"), fullgraph=True)(x)
    (g_got,) = torch.autograd.grad(got, w)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want)
