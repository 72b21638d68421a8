"""binary_cross_entropy_with_logits: the limits at ±inf logits (pytorch #102894, #135359) with
pos_weight and weight, the gradient w·((1−t)·σ(x) − pw·t·σ(−x)) there, torch's numbers elsewhere."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import stablelosses as sl
import stablelosses.functional as SF

INF = float("inf")


def _reference(x: float, t: float, pw: float = 1.0, w: float = 1.0) -> float:
    """w·[(1−t)·log(1+e^x) + pw·t·log(1+e^−x)] in float64 math, with its limits at ±inf."""
    def softplus(z):
        if z == INF:
            return INF
        if z == -INF:
            return 0.0
        return max(z, 0.0) + math.log1p(math.exp(-abs(z)))

    def term(c, v):
        return 0.0 if c == 0 else c * v

    return term(w, term(1 - t, softplus(x)) + term(pw * t, softplus(-x)))


def _grad_reference(x: float, t: float, pw: float = 1.0, w: float = 1.0) -> float:
    if abs(x) == INF:
        sig = 1.0 if x > 0 else 0.0
    else:
        sig = 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))
    return w * ((1 - t) * sig - pw * t * (1 - sig))


@pytest.mark.parametrize("x, t, value", [(INF, 1.0, 0.0), (-INF, 0.0, 0.0), (-INF, 0.9, INF)])
def test_the_three_nan_cases_of_torch_give_their_limits(x, t, value):
    xs = torch.tensor([x], requires_grad=True)
    ts = torch.tensor([t])
    assert torch.isnan(F.binary_cross_entropy_with_logits(xs.detach(), ts, reduction="none")).all()
    out = SF.binary_cross_entropy_with_logits(xs, ts, reduction="none")
    assert out.item() == value
    out.sum().backward()
    assert xs.grad.item() == pytest.approx(_grad_reference(x, t), abs=1e-7)


@pytest.mark.parametrize("x", [INF, -INF])
@pytest.mark.parametrize("t", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("pw", [0.0, 0.5, 3.0])
@pytest.mark.parametrize("w", [0.0, 2.0])
def test_limits_and_gradients_with_pos_weight_and_weight(x, t, pw, w):
    xs = torch.tensor([x], dtype=torch.float64, requires_grad=True)
    out = SF.binary_cross_entropy_with_logits(xs, torch.tensor([t], dtype=torch.float64),
                                              weight=torch.tensor([w], dtype=torch.float64),
                                              pos_weight=torch.tensor([pw], dtype=torch.float64), reduction="sum")
    assert out.item() == _reference(x, t, pw, w)
    out.backward()
    # the limit of w·((1−t)·σ(x) − pw·t·σ(−x)): w(1−t) at +inf, −w·pw·t at −inf, also where the value is inf
    expected = w * (1 - t) if x > 0 else -w * pw * t
    assert xs.grad.item() == pytest.approx(expected, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.floats(-1e4, 1e4), st.floats(0, 1), st.floats(0, 10), st.floats(0, 10))
def test_equals_the_float64_reference_and_torch_for_finite_logits(x, t, pw, w):
    xs = torch.tensor([x], dtype=torch.float64, requires_grad=True)
    ts, pws, ws = (torch.tensor([v], dtype=torch.float64) for v in (t, pw, w))
    out = SF.binary_cross_entropy_with_logits(xs, ts, ws, pos_weight=pws, reduction="sum")
    ref = _reference(x, t, pw, w)
    assert out.item() == pytest.approx(ref, rel=1e-12, abs=1e-300)
    torch_out = F.binary_cross_entropy_with_logits(xs.detach(), ts, ws, pos_weight=pws, reduction="sum")
    assert out.item() == pytest.approx(torch_out.item(), rel=1e-9, abs=1e-12)
    out.backward()
    assert xs.grad.item() == pytest.approx(_grad_reference(x, t, pw, w), rel=1e-9, abs=1e-12)


def test_nan_in_nan_out():
    for x, t in [(float("nan"), 0.5), (INF, float("nan")), (0.0, float("nan"))]:
        assert torch.isnan(SF.binary_cross_entropy_with_logits(torch.tensor([x]), torch.tensor([t]))).all()
    out = SF.binary_cross_entropy_with_logits(torch.tensor([-INF]), torch.tensor([1.0]),
                                              pos_weight=torch.tensor([float("nan")]))
    assert torch.isnan(out)


def test_gradcheck_and_gradgradcheck_for_every_argument():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.rand(2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    pw = torch.rand(2, generator=g, dtype=torch.float64, requires_grad=True)

    def f(x, t, w, pw):
        return SF.binary_cross_entropy_with_logits(x, t, w, pos_weight=pw, reduction="none")

    assert torch.autograd.gradcheck(f, (x, t, w, pw), check_batched_grad=True, check_forward_ad=True)
    assert torch.autograd.gradgradcheck(f, (x, t, w, pw))


def test_input_and_target_gradients_equal_torchs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, generator=g, requires_grad=True)
    t = torch.rand(5, 3, generator=g, requires_grad=True)
    pw = torch.rand(3, generator=g)
    for red in ("none", "mean", "sum"):
        ours = SF.binary_cross_entropy_with_logits(x, t, pos_weight=pw, reduction=red)
        theirs = F.binary_cross_entropy_with_logits(x, t, pos_weight=pw, reduction=red)
        torch.testing.assert_close(ours, theirs)
        for a, b in zip(torch.autograd.grad(ours.sum(), (x, t)), torch.autograd.grad(theirs.sum(), (x, t))):
            torch.testing.assert_close(a, b)


def test_module_keeps_torchs_buffers_and_calls_the_function():
    w, pw = torch.rand(3), torch.rand(3)
    m = sl.BCEWithLogitsLoss(weight=w, pos_weight=pw)
    assert list(m.state_dict()) == ["weight", "pos_weight"]
    x = torch.tensor([[INF, -INF, 0.0]])
    torch.testing.assert_close(m(x, torch.tensor([[1.0, 0.0, 0.5]])),
                               SF.binary_cross_entropy_with_logits(x, torch.tensor([[1.0, 0.0, 0.5]]), w,
                                                                   pos_weight=pw))


def test_target_of_another_size_is_torchs_value_error():
    with pytest.raises(ValueError, match="binary_cross_entropy_with_logits: Target size"):
        SF.binary_cross_entropy_with_logits(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError):
        F.binary_cross_entropy_with_logits(torch.zeros(3), torch.zeros(2))


@pytest.mark.parametrize("x", [INF, -INF])
@pytest.mark.parametrize("t", [0.0, 0.5, 1.0])
def test_zero_weight_at_an_infinite_logit_gives_zero_gradients(x, t):
    # the value is 0 for every target there, so every gradient is 0: the outer 0·inf used to
    # reach the inner (1 - t)·softplus(x) product, and the target's gradient was 0·inf = NaN
    xi = torch.tensor([x], requires_grad=True)
    ti = torch.tensor([t], requires_grad=True)
    w = torch.zeros(1, requires_grad=True)
    pw = torch.tensor([2.0], requires_grad=True)
    loss = SF.binary_cross_entropy_with_logits(xi, ti, w, pos_weight=pw, reduction="sum")
    assert loss.item() == 0.0
    for g in torch.autograd.grad(loss, (xi, ti, w, pw)):
        assert torch.equal(g, torch.zeros(1))
    # a NaN target there stays NaN
    nan = SF.binary_cross_entropy_with_logits(xi, torch.tensor([float("nan")]), w, reduction="sum")
    assert torch.isnan(nan)


def test_integer_or_bool_logits_raise_torchs_not_implemented_error():
    for x in (torch.tensor([1, -2]), torch.tensor([True, False])):
        # torch 2.13: NotImplementedError; older: RuntimeError, its base class
        with pytest.raises(RuntimeError) as theirs:
            F.binary_cross_entropy_with_logits(x, torch.rand(2))
        with pytest.raises(type(theirs.value), match="binary_cross_entropy_with_logits"):
            SF.binary_cross_entropy_with_logits(x, torch.rand(2))


def test_bool_pos_weight_is_torchs_runtime_error():
    x, t, pw = torch.randn(3), torch.rand(3), torch.tensor([True, False, True])
    with pytest.raises(RuntimeError):
        F.binary_cross_entropy_with_logits(x, t, pos_weight=pw)
    with pytest.raises(RuntimeError, match="pos_weight"):
        SF.binary_cross_entropy_with_logits(x, t, pos_weight=pw)


@pytest.mark.parametrize("shape, weight, pos_weight", [
    ((3, 4), (2, 3, 4), None),
    ((3, 4), None, (2, 3, 4)),
    ((3, 1), (3, 4), None),
    ((), None, (1,)),
], ids=["weight-adds-a-dimension", "pos_weight-adds-a-dimension", "weight-widens", "pos_weight-on-a-scalar"])
def test_an_argument_that_would_enlarge_input_is_torchs_runtime_error(shape, weight, pos_weight):
    # torch's kernel multiplies in place into input's shape
    x, t = torch.randn(shape), torch.rand(shape)
    w = None if weight is None else torch.ones(weight)
    pw = None if pos_weight is None else torch.full(pos_weight, 2.0)
    name = "weight" if weight is not None else "pos_weight"
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        F.binary_cross_entropy_with_logits(x, t, w, pos_weight=pw, reduction="none")
    with pytest.raises(RuntimeError, match=f"binary_cross_entropy_with_logits: {name} of shape"):
        SF.binary_cross_entropy_with_logits(x, t, w, pos_weight=pw, reduction="none")


def test_weight_and_pos_weight_that_fit_input_broadcast_as_torch():
    x, t = torch.randn(2, 3, 4), torch.rand(2, 3, 4)
    w, pw = torch.rand(3, 1), torch.rand(4)
    torch.testing.assert_close(SF.binary_cross_entropy_with_logits(x, t, w, pos_weight=pw, reduction="none"),
                               F.binary_cross_entropy_with_logits(x, t, w, pos_weight=pw, reduction="none"))
