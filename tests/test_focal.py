"""focal_loss: gamma=0 equals cross_entropy, float64 reference, finite gradients for all gamma."""

from __future__ import annotations

import mpmath
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_compiled_matches_eager, ref_index_loss, tol
from hypothesis import given
from hypothesis import strategies as st
from mask_helpers import _ce_inputs, _grad, _masked_ref, _torch_focal_none
from strategies import logits_with_masks
from torch.autograd import gradcheck

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


def test_focal_jvp_matches_float64_reference():
    x = torch.randn(4, 3, dtype=torch.float64)
    v = torch.randn(4, 3, dtype=torch.float64)
    t = torch.tensor([0, 1, 2, 1])
    w = torch.rand(3, dtype=torch.float64) + 0.5
    ref = lambda xx: ref_index_loss(xx, t, w, 2.0, 0.0, -100, "mean")  # noqa: E731
    torch.testing.assert_close(
        torch.func.jvp(lambda xx: SF.focal_loss(xx, t, gamma=2.0, weight=w), (x,), (v,)),
        torch.func.jvp(ref, (x,), (v,)),
    )


@pytest.mark.parametrize("gamma", [0.5, 2.0])
def test_gradcheck_forward_ad_focal(gamma):
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_()
    t = torch.tensor([0, 1, 2, -100, 1])
    assert gradcheck(lambda a, c: SF.focal_loss(a, t, gamma=gamma, weight=c), (x, w), check_forward_ad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0])
def test_focal_double_backward_at_pt_one(gamma, dtype):
    x = torch.tensor([[20.0, 0.0]], dtype=dtype)
    t = torch.tensor([0])

    def second(f, z):
        z = z.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(f(z), z, create_graph=True)
        (h,) = torch.autograd.grad((g * torch.tensor([[1.0, -2.0]], dtype=z.dtype)).sum(), z)
        return g.detach(), h

    g, h = second(lambda z: SF.focal_loss(z, t, gamma=gamma), x)
    g_ref, h_ref = second(
        lambda z: ref_index_loss(z, t, torch.ones(2, dtype=z.dtype), gamma, 0.0, -100, "sum"), x.double()
    )
    assert torch.isfinite(g).all() and torch.isfinite(h).all()
    # the first derivative keeps full relative accuracy (the target entry is -a·Σ_{j≠t} p_j)
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=0)
    if dtype == torch.float64:
        torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=0)
    else:
        # float32: the softmax backward inside the second derivative rounds p_t·(1 − p_t);
        # accurate to float32 resolution on the scale of the loss
        torch.testing.assert_close(h.double(), h_ref, rtol=0, atol=1e-7)


@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0])
def test_focal_double_backward_on_posinf_rows(gamma):
    x = torch.tensor([[INF, 0.0, 1.0], [INF, INF, 0.0]], requires_grad=True)
    t = torch.tensor([0, 1])
    (g,) = torch.autograd.grad(SF.focal_loss(x, t, gamma=gamma, reduction="sum"), x, create_graph=True)
    (h,) = torch.autograd.grad((g * torch.arange(6.0).reshape(2, 3)).sum(), x)
    # the limit: the first row is p_t = 1 (every derivative 0); on the second the loss is
    # 0.5^γ·log 2 at fixed mass, its derivatives come from the float64 reference at a large margin
    big = torch.tensor([[200.0, 0.0, 1.0], [200.0, 200.0, 0.0]], dtype=torch.float64, requires_grad=True)
    (g_ref,) = torch.autograd.grad(
        ref_index_loss(big, t, torch.ones(3, dtype=torch.float64), gamma, 0.0, -100, "sum"),
        big,
        create_graph=True,
    )
    (h_ref,) = torch.autograd.grad((g_ref * torch.arange(6.0, dtype=torch.float64).reshape(2, 3)).sum(), big)
    assert torch.isfinite(g).all() and torch.isfinite(h).all()
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.double(), h_ref, rtol=1e-5, atol=1e-6)


def _mp_focal(margin: float, n_other: int, gamma: float) -> float:
    mpmath.mp.dps = 50
    m = mpmath.mpf(margin)
    rest = n_other * mpmath.e ** (-m) / (1 + n_other * mpmath.e ** (-m))
    return float(rest**gamma * -mpmath.log(1 - rest))


@pytest.mark.parametrize("gamma", [0.5, 2.0])
@pytest.mark.parametrize("margin", [15.0, 17.0, 20.0, 25.0, 30.0])
def test_focal_tail_full_relative_accuracy_float32(margin, gamma):
    x = torch.tensor([[margin, 0.0, 0.0]])
    out = SF.focal_loss(x, torch.tensor([0]), gamma=gamma, reduction="sum")
    ref = _mp_focal(margin, 2, gamma)
    assert ref > 0
    assert abs(out.item() - ref) <= 1e-5 * ref


@pytest.mark.parametrize("gamma", [INF, float("nan"), -1.0])
def test_focal_gamma_must_be_finite_and_nonnegative(gamma):
    with pytest.raises(ValueError, match="focal_loss: gamma"):
        SF.focal_loss(torch.randn(2, 3), torch.tensor([0, 1]), gamma=gamma)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_focal_loss_mask_with_ignore_and_weight(reduction):
    x, t, m, w = _ce_inputs(1)
    got = SF.focal_loss(x, t, 1.5, w, reduction=reduction, mask=m)
    terms, wt = _torch_focal_none(x, t, 1.5, w)
    want = _masked_ref(terms, m, reduction, wt)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_grad(got, x)[0], _grad(want, x)[0])
