"""focal_loss: gamma=0 equals cross_entropy, float64 reference, finite gradients for all gamma."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_compiled_matches_eager, tol
from hypothesis import given
from hypothesis import strategies as st
from strategies import logits_with_masks

import stablelosses as sl
import stablelosses.functional as SF
from stablelosses import naive as naive_formulas

INF = float("inf")


def _ref(x, t, gamma, weight=None, ignore_index=-100, reduction="mean"):
    """float64 reference written directly from the formula (no expm1 grouping)."""
    x = x.double()
    cdim = 0 if x.dim() == 1 else 1
    logp = torch.log_softmax(x, cdim)
    keep = t != ignore_index
    ts = torch.where(keep, t, 0)
    lt = logp.gather(cdim, ts.unsqueeze(cdim)).squeeze(cdim)
    pt = lt.exp()
    w = torch.ones(x.shape[cdim], dtype=torch.float64) if weight is None else weight.double()
    wt = w[ts] * keep
    loss = wt * (1 - pt) ** gamma * (-lt)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / wt.sum()


@pytest.mark.parametrize("shape", [(5,), (6, 5), (3, 5, 2, 2)], ids=str)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore_index", [-100, 2])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_gamma0_equals_cross_entropy(shape, weighted, ignore_index, reduction):
    x = torch.randn(shape, dtype=torch.float64) * 3
    C = shape[0] if len(shape) == 1 else shape[1]
    t = torch.randint(0, C, () if len(shape) == 1 else (shape[0],) + shape[2:])
    w = torch.rand(C, dtype=torch.float64) + 0.1 if weighted else None
    kw = dict(weight=w, ignore_index=ignore_index, reduction=reduction)
    xa = x.clone().requires_grad_(True)
    xb = x.clone().requires_grad_(True)
    a = SF.focal_loss(xa, t, gamma=0.0, **kw)
    b = SF.cross_entropy(xb, t, **kw)
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(a, F.cross_entropy(x, t, **kw), equal_nan=True)
    if a.numel() and not a.isnan().any():
        a.sum().backward()
        b.sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad, rtol=0, atol=0)


@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0, 3.7])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_matches_float64_reference(gamma, weighted, reduction):
    x = torch.randn(7, 4, 3) * 4
    t = torch.randint(0, 4, (7, 3))
    t[0, 0] = -100
    w = torch.rand(4) + 0.2 if weighted else None
    xa = x.clone().requires_grad_(True)
    out = SF.focal_loss(xa, t, gamma=gamma, weight=w, reduction=reduction)
    xr = x.double().requires_grad_(True)
    ref = _ref(xr, t, gamma, w, reduction=reduction)
    torch.testing.assert_close(out.double(), ref, **tol(torch.float32))
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(xa.grad.double(), xr.grad, rtol=1e-4, atol=1e-6)


def test_classic_snippet_regression():
    x = torch.tensor([[10.0, -200.0]], requires_grad=True)
    naive = naive_formulas.classic_focal(x, torch.tensor([0]), 0.5, "sum")
    naive.backward()
    assert not torch.isfinite(x.grad).all()  # the snippet fails here
    for gamma in (0.0, 0.5, 1.0, 2.0):
        x.grad = None
        SF.focal_loss(x, torch.tensor([0]), gamma=gamma).backward()
        assert torch.isfinite(x.grad).all()
        if gamma > 0:
            assert (x.grad == 0).all()  # p_t == 1 exactly: the defined limit 0


@pytest.mark.parametrize("gamma", [0.25, 0.5, 0.9])
def test_small_gamma_pt_to_one(gamma):
    # p_t -> 1 from below: (1-p)^(gamma-1) blows up alone; the product tends to 0
    for margin in (5.0, 15.0, 30.0, 80.0, 200.0, 800.0):
        x = torch.tensor([[margin, 0.0, -1.0]], dtype=torch.float64, requires_grad=True)
        SF.focal_loss(x, torch.tensor([0]), gamma=gamma).backward()
        assert torch.isfinite(x.grad).all()
        assert x.grad[0, 0] <= 0 and (x.grad[0, 1:] >= 0).all()
        if margin <= 15:  # where the naive float64 reference has no cancellation in 1 - p
            xr = x.detach().clone().requires_grad_(True)
            _ref(xr, torch.tensor([0]), gamma).backward()
            torch.testing.assert_close(x.grad, xr.grad, rtol=1e-6, atol=0)
    x = torch.tensor([[200.0, 0.0]], requires_grad=True)  # float32: p_t rounds to 1
    SF.focal_loss(x, torch.tensor([0]), gamma=gamma).backward()
    assert torch.isfinite(x.grad).all()


def test_masked_rows_and_target():
    x = torch.tensor([[1.0, -INF, 0.0], [-INF, -INF, -INF], [-INF, 2.0, 1.0]], requires_grad=True)
    t = torch.tensor([0, 1, 0])
    loss = SF.focal_loss(x, t, gamma=0.5, reduction="none")
    assert loss[1] == 0 and loss[2] == INF
    mean = SF.focal_loss(x[:2], t[:2], gamma=0.5)
    torch.testing.assert_close(mean, loss[0])  # fully masked row not in the denominator
    loss.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[1] == 0).all() and x.grad[0, 1] == 0


@given(logits_with_masks(dtype=torch.float32, max_abs=float(torch.tensor(1e30))),
       st.sampled_from([0.0, 0.3, 1.0, 2.0]), st.data())
def test_property_finite_gradient(xm, gamma, data):
    x, mask = xm
    x = x.masked_fill(~mask, -INF).requires_grad_(True)
    C = x.shape[1]
    t = torch.tensor(data.draw(st.lists(st.integers(0, C - 1), min_size=x.shape[0], max_size=x.shape[0])))
    loss = SF.focal_loss(x, t, gamma=gamma, reduction="sum")
    assert not torch.isnan(loss)
    loss.backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[~mask.any(1)] == 0).all()


@given(logits_with_masks(dtype=torch.float32, max_abs=1e4), st.sampled_from([0.0, 0.5, 2.0]))
def test_property_nan_propagates(xm, gamma):
    x, mask = xm
    x = x.clone()
    x[0, 0] = float("nan")
    x.requires_grad_(True)
    loss = SF.focal_loss(x, torch.zeros(x.shape[0], dtype=torch.long), gamma=gamma, reduction="none")
    assert torch.isnan(loss[0])
    loss.sum().backward()
    assert torch.isnan(x.grad[0]).all()


@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("weighted", [False, True])
def test_gradcheck_gradgradcheck(gamma, weighted):
    x = torch.randn(4, 3, 2, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([[0, 2], [-100, 1], [2, 2], [1, 0]])
    w = torch.rand(3, dtype=torch.float64) + 0.5 if weighted else None
    fn = lambda z: SF.focal_loss(z, t, gamma=gamma, weight=w, reduction="none")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,), check_batched_grad=True)
    assert torch.autograd.gradgradcheck(fn, (x,), check_batched_grad=True)


def test_func_grad_and_vmap():
    x = torch.randn(5, 6, 4, dtype=torch.float64)
    t = torch.randint(0, 4, (5, 6))
    ours = torch.func.vmap(torch.func.grad(lambda z, y: SF.focal_loss(z, y, gamma=1.5)))(x, t)
    ref = torch.func.vmap(torch.func.grad(lambda z, y: _ref(z, y, 1.5)))(x, t)
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_low_precision_dtype_and_autocast(dt, device):
    x = (torch.randn(8, 5, device=device) * 4).to(dt).requires_grad_(True)
    t = torch.randint(0, 5, (8,), device=device)
    out = SF.focal_loss(x, t)
    assert out.dtype == dt
    torch.testing.assert_close(out.double(), _ref(x.detach().cpu(), t.cpu(), 2.0).to(device), **tol(dt))
    out.backward()
    assert x.grad.dtype == dt and torch.isfinite(x.grad).all()
    with torch.autocast(device_type=device, dtype=dt):
        assert SF.focal_loss(x, t).dtype == F.cross_entropy(x, t).dtype == torch.float32


def test_module_equals_function():
    x = torch.randn(6, 3)
    t = torch.randint(0, 3, (6,))
    w = torch.tensor([1.0, 0.5, 2.0])
    torch.testing.assert_close(sl.FocalLoss(gamma=0.5, weight=w)(x, t), SF.focal_loss(x, t, gamma=0.5, weight=w))


@pytest.mark.slow
def test_compile_fullgraph():
    x = torch.randn(8, 5)
    t = torch.randint(0, 5, (8,))
    assert_compiled_matches_eager(lambda z: SF.focal_loss(z, t, gamma=0.5), x)


def test_errors():
    x = torch.randn(4, 3)
    t = torch.tensor([0, 1, 2, 1])
    with pytest.raises(ValueError, match="focal_loss: reduction must be 'none', 'mean' or 'sum', got 'avg'"):
        SF.focal_loss(x, t, reduction="avg")
    with pytest.raises(ValueError, match="focal_loss: gamma must be >= 0, got -1.0"):
        SF.focal_loss(x, t, gamma=-1.0)
    with pytest.raises(ValueError, match="focal_loss: gamma must be >= 0, got nan"):
        SF.focal_loss(x, t, gamma=float("nan"))
    with pytest.raises(TypeError, match="focal_loss: gamma must be a float, got Tensor"):
        SF.focal_loss(x, t, gamma=torch.tensor(2.0))
    with pytest.raises(RuntimeError, match="focal_loss: weight tensor should be defined"):
        SF.focal_loss(x, t, weight=torch.ones(2))
    with pytest.raises(RuntimeError, match="focal_loss: expected target dtype"):
        SF.focal_loss(x, t.float())
    with pytest.raises(ValueError, match="focal_loss: target of class indices must have shape"):
        SF.focal_loss(x, torch.zeros(3, dtype=torch.long))
    with pytest.raises((RuntimeError, IndexError), match="out of bounds"):
        SF.focal_loss(x, torch.tensor([0, 1, 3, 1]))
