"""soft_margin_loss and multilabel_soft_margin_loss: no overflow at large margins (torch's
soft_margin_loss is inf once −y·x > 88.7 in float32), exact limits at ±inf scores."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import stablelosses.functional as SF

INF = float("inf")


def _softplus_mp(z: float) -> float:
    return float(mpmath.log1p(mpmath.exp(mpmath.mpf(z))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("margin", [-100.0, -1e4, -3e4])
def test_large_negative_margins_give_the_exact_value(margin, dtype):
    x = torch.tensor([margin], dtype=dtype, requires_grad=True)
    y = torch.tensor([1.0], dtype=dtype)
    out = SF.soft_margin_loss(x, y)
    expected = torch.tensor(_softplus_mp(-float(x.detach().double())), dtype=torch.float64).to(dtype)
    assert out.item() == expected.item() and math.isfinite(out.item())
    out.backward()
    assert x.grad.item() == -1.0
    if dtype == torch.float32 and margin == -100.0:
        assert F.soft_margin_loss(x.detach(), y).item() == INF  # torch overflows
        xt = x.detach().requires_grad_(True)
        F.soft_margin_loss(xt, y).backward()
        assert math.isnan(xt.grad.item())  # and its gradient is NaN there (the docstring says so)


@settings(max_examples=30, deadline=None)
@given(st.floats(-1e30, 1e30), st.sampled_from([-1.0, 1.0]))
def test_float32_value_matches_mpmath(x, y):
    x32 = float(torch.tensor(x, dtype=torch.float32))
    out = SF.soft_margin_loss(torch.tensor([x32]), torch.tensor([y]))
    expected = float(torch.tensor(_softplus_mp(-y * x32), dtype=torch.float64).float())
    assert out.item() == pytest.approx(expected, rel=2e-7, abs=1e-38)


def test_equals_torch_where_torch_is_finite_and_gradients_too():
    g = torch.Generator().manual_seed(0)
    x = (5 * torch.randn(4, 3, generator=g, dtype=torch.float64)).requires_grad_()
    y = torch.randn(4, 3, generator=g, dtype=torch.float64).sign()
    for red in ("none", "mean", "sum"):
        ours, theirs = SF.soft_margin_loss(x, y, reduction=red), F.soft_margin_loss(x, y, reduction=red)
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(torch.autograd.grad(ours.sum(), x)[0], torch.autograd.grad(theirs.sum(), x)[0])


def test_gradcheck_and_gradgradcheck():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(2, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.rand(2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: SF.soft_margin_loss(a, b, reduction="none"), (x, y),
                                    check_forward_ad=True)
    assert torch.autograd.gradgradcheck(lambda a, b: SF.soft_margin_loss(a, b, reduction="none"), (x, y))
    f = lambda a, b, c: SF.multilabel_soft_margin_loss(a, b, c, reduction="none")  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, t, w))
    assert torch.autograd.gradgradcheck(f, (x, t, w))


@pytest.mark.parametrize("x, y", [(INF, 1.0), (-INF, 0.0), (INF, 0.0), (-INF, 0.3)])
def test_multilabel_limits_at_infinite_scores(x, y):
    xs = torch.tensor([[x, 0.5]], requires_grad=True)
    ys = torch.tensor([[y, 1.0]])
    out = SF.multilabel_soft_margin_loss(xs, ys, reduction="none")
    rest = _softplus_mp(-0.5)
    first = 0.0 if (x == INF and y == 1.0) or (x == -INF and y == 0.0) else INF
    assert out.item() == pytest.approx((first + rest) / 2)
    out.sum().backward()
    sig = 1.0 if x > 0 else 0.0
    assert xs.grad[0, 0].item() == pytest.approx((sig - y) / 2)
    if first == 0.0:
        assert torch.isnan(F.multilabel_soft_margin_loss(xs.detach(), ys))  # torch


def test_multilabel_equals_torch_for_finite_scores():
    g = torch.Generator().manual_seed(2)
    x = (4 * torch.randn(4, 3, generator=g)).requires_grad_()
    y = torch.rand(4, 3, generator=g)
    w = torch.rand(3, generator=g)
    for red in ("none", "mean", "sum"):
        ours = SF.multilabel_soft_margin_loss(x, y, w, reduction=red)
        theirs = F.multilabel_soft_margin_loss(x, y, w, reduction=red)
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(torch.autograd.grad(ours.sum(), x)[0], torch.autograd.grad(theirs.sum(), x)[0])


def test_nan_in_nan_out():
    assert torch.isnan(SF.soft_margin_loss(torch.tensor([float("nan")]), torch.tensor([1.0])))
    assert torch.isnan(SF.multilabel_soft_margin_loss(torch.tensor([[float("nan"), 0.0]]), torch.ones(1, 2)))


def test_errors():
    with pytest.raises(RuntimeError, match="soft_margin_loss: .*input.*target"):
        SF.soft_margin_loss(torch.zeros(2, 3), torch.zeros(4))
    with pytest.raises(IndexError, match="multilabel_soft_margin_loss"):
        SF.multilabel_soft_margin_loss(torch.tensor(0.5), torch.tensor(1.0))


@pytest.mark.parametrize("x", [float("inf"), float("-inf")])
def test_multilabel_zero_weight_at_an_infinite_score_gives_zero_gradients(x):
    # 0 for every target there: the target's gradient was 0·inf = NaN
    xi = torch.tensor([[x, 1.0]], requires_grad=True)
    t = torch.tensor([[0.5, 0.5]], requires_grad=True)
    w = torch.tensor([0.0, 1.0], requires_grad=True)
    loss = SF.multilabel_soft_margin_loss(xi, t, weight=w, reduction="sum")
    gx, gt, gw = torch.autograd.grad(loss, (xi, t, w))
    assert torch.isfinite(loss)
    assert gx[0, 0] == 0 and gt[0, 0] == 0 and gw[0] == 0
    ref = F.multilabel_soft_margin_loss(xi[:, 1:], t[:, 1:], weight=w[1:], reduction="sum") / 2
    torch.testing.assert_close(loss, ref)


def test_broadcast_error_names_the_sizes_in_torchs_order():
    # torch computes input·target: tensor a is input's size
    x, y = torch.randn(5, 4), torch.randn(5)
    with pytest.raises(RuntimeError, match=r"tensor a \(4\) must match the size of tensor b \(5\)"):
        F.soft_margin_loss(x, y)
    with pytest.raises(RuntimeError, match=r"soft_margin_loss: The size of tensor a \(4\) must match the size of tensor b \(5\)"):
        SF.soft_margin_loss(x, y)


@pytest.mark.parametrize("x", [torch.tensor([1, -2, 3]), torch.tensor([True, False, True])])
def test_integer_or_bool_input_is_refused_as_torch(x):
    y = torch.tensor([1.0, -1.0, 1.0])
    # soft_margin: torch writes the loss in input's dtype (RuntimeError)
    with pytest.raises(RuntimeError):
        F.soft_margin_loss(x, y)
    with pytest.raises(RuntimeError, match="soft_margin_loss: input"):
        SF.soft_margin_loss(x, y)
    # multilabel_soft_margin: torch's logsigmoid has no integer kernel (NotImplementedError in
    # torch 2.13, a RuntimeError, its base class, before)
    with pytest.raises(RuntimeError) as theirs:
        F.multilabel_soft_margin_loss(x[None], y[None])
    with pytest.raises(type(theirs.value), match="multilabel_soft_margin_loss"):
        SF.multilabel_soft_margin_loss(x[None], y[None])


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("shapes", [((4,), (3, 4)), ((1, 4), (3, 4)), ((3, 1), (3, 4)), ((), (2,))], ids=str)
def test_a_target_that_would_enlarge_input_is_torchs_runtime_error(shapes, reduction):
    # torch's kernel writes the loss in input's shape; a target that broadcasts to it is fine
    small, large = shapes
    x, y = torch.randn(small), torch.ones(large)
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        F.soft_margin_loss(x, y, reduction=reduction)
    with pytest.raises(RuntimeError, match="soft_margin_loss: target of shape"):
        SF.soft_margin_loss(x, y, reduction=reduction)
    x, y = torch.randn(large), torch.ones(small)
    torch.testing.assert_close(SF.soft_margin_loss(x, y, reduction=reduction),
                               F.soft_margin_loss(x, y, reduction=reduction))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("x_shape, y_shape, w_shape", [
    ((4,), (3, 4), None), ((3, 4), (2, 3, 4), None), ((4,), (1, 4), None), ((4,), (3, 1), None),
    ((1,), (3, 4), None), ((3, 1), (2, 3, 4), None), ((3, 4), (3, 4), (2, 3, 4)), ((4,), (4,), (3, 4)),
], ids=str)
def test_multilabel_sums_over_torchs_class_dimension_of_the_broadcast_terms(x_shape, y_shape, w_shape, reduction):
    # torch sums the broadcast terms over dim input.dim() - 1 and divides by input.size(-1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(x_shape, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.rand(y_shape, generator=g, dtype=torch.float64, requires_grad=True)
    w = None if w_shape is None else torch.rand(w_shape, generator=g, dtype=torch.float64, requires_grad=True)
    inputs = (x, y) if w is None else (x, y, w)
    got = SF.multilabel_soft_margin_loss(x, y, weight=w, reduction=reduction)
    want = F.multilabel_soft_margin_loss(x, y, weight=w, reduction=reduction)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    seed = torch.randn(want.shape, generator=g, dtype=torch.float64)
    for ours, theirs in zip(torch.autograd.grad(got, inputs, seed), torch.autograd.grad(want, inputs, seed)):
        torch.testing.assert_close(ours, theirs)
