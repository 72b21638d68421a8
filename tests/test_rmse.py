"""rmse_loss / RMSELoss: parity with sqrt(F.mse_loss + eps), defined gradient at 0, no overflow."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_compiled_matches_eager, tol
from hypothesis import given
from hypothesis import strategies as st
from mask_helpers import NAN, D, _gen, _grad
from strategies import assert_first_nan_propagates, broadcast_pair, shaped_tensor, value_and_grads

import stablelosses as sl
import stablelosses.functional as SF
from stablelosses import naive as naive_formulas

REDUCTIONS = ["none", "mean", "sum"]


def naive(x, y, reduction="mean", eps=0.0):
    """``torch.sqrt(F.mse_loss(...) + eps)`` from stablelosses.naive, without its broadcast warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return naive_formulas.sqrt_mse(x, y, reduction, eps)


SHAPES = [((), ()), ((0,), (0,)), ((5,), (5,)), ((2, 3), (2, 3)), ((2, 3), (3,)), ((3,), (2, 1))]


@pytest.mark.filterwarnings("ignore:Using a target size")
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_parity_with_torch(device, reduction, eps, shapes):
    x = torch.randn(shapes[0], dtype=torch.float64, device=device)
    y = torch.randn(shapes[1], dtype=torch.float64, device=device)
    v, gx, gy = value_and_grads(SF.rmse_loss, x, y, reduction=reduction, eps=eps)
    rv, rgx, rgy = value_and_grads(naive, x, y, reduction=reduction, eps=eps)
    torch.testing.assert_close(v, rv, equal_nan=True)
    if v.numel() and torch.isfinite(rv).all():
        torch.testing.assert_close(gx, rgx)
        torch.testing.assert_close(gy, rgy)


def test_empty():
    x = torch.empty(0)
    assert torch.isnan(SF.rmse_loss(x, x))
    assert SF.rmse_loss(x, x, reduction="sum") == 0
    assert SF.rmse_loss(x, x, reduction="sum", eps=4.0) == 2
    assert SF.rmse_loss(x, x, reduction="none").shape == (0,)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_zero_residual_gradient_is_zero(device, reduction):
    # the user snippet: torch.sqrt(F.mse_loss(x * 0, 0)) turns the model's gradient into NaN
    x = torch.randn(4, 3, device=device, requires_grad=True)
    naive(x * 0, torch.zeros(4, 3, device=device), reduction).sum().backward()
    assert torch.isnan(x.grad).all()
    x.grad = None
    loss = SF.rmse_loss(x * 0, torch.zeros(4, 3, device=device), reduction)
    assert (loss == 0).all()
    loss.sum().backward()
    assert (x.grad == 0).all()


def test_partial_zero_residual_none():
    x = torch.tensor([0.0, 2.0, -3.0], requires_grad=True)
    SF.rmse_loss(x, torch.zeros(3), "none").sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, -1.0]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_overflow_float32_1e20(reduction):
    x = torch.tensor([1e20, 0.0], requires_grad=True)
    loss = SF.rmse_loss(x, torch.zeros(2), reduction)
    expected = {"mean": 1e20 / math.sqrt(2), "sum": 1e20, "none": [1e20, 0.0]}[reduction]
    torch.testing.assert_close(loss.detach(), torch.tensor(expected, dtype=torch.float32))
    assert not torch.isfinite(naive(x.detach(), torch.zeros(2), reduction)).all()
    loss.sum().backward()
    g = {"mean": [1 / math.sqrt(2), 0.0], "sum": [1.0, 0.0], "none": [1.0, 0.0]}[reduction]
    torch.testing.assert_close(x.grad, torch.tensor(g))


def test_overflow_single_1e20_exact():
    assert SF.rmse_loss(torch.tensor([1e20]), torch.tensor([0.0])).item() == torch.tensor(1e20).item()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_overflow_float16_300(reduction):
    x = torch.full((3,), 300.0, dtype=torch.float16, requires_grad=True)
    y = torch.zeros(3, dtype=torch.float16)
    assert torch.isinf(naive(x.detach(), y, reduction)).all()  # 300² > 65504
    loss = SF.rmse_loss(x, y, reduction)
    assert loss.dtype == torch.float16
    expected = {"mean": 300.0, "sum": 300.0 * math.sqrt(3), "none": [300.0] * 3}[reduction]
    torch.testing.assert_close(loss.detach().float(), torch.tensor(expected), **tol(torch.float16))
    loss.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_eps_gradient_formula():
    x = torch.tensor([0.0, 3.0], dtype=torch.float64, requires_grad=True)
    SF.rmse_loss(x, torch.zeros(2, dtype=torch.float64), eps=0.5).backward()
    torch.testing.assert_close(x.grad, x.detach() / (2 * math.sqrt(4.5 + 0.5)))


@pytest.mark.parametrize("value", [1e30, -1e30, 1e4, 1e-45, 1e-38, 0.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_extremes_vs_float64(value, reduction):
    x = torch.tensor([value, value / 2, 0.0], requires_grad=True)
    y = torch.zeros(3)
    loss = SF.rmse_loss(x, y, reduction)
    x64 = x.detach().double().requires_grad_()
    ref = naive(x64, y.double(), reduction)  # r² fits in float64
    torch.testing.assert_close(loss.detach().double(), ref.detach(), rtol=1e-6, atol=1e-45)
    loss.sum().backward()
    assert torch.isfinite(x.grad).all()
    ref.sum().backward()
    ok = torch.isfinite(x64.grad)
    if abs(value) < 1.2e-38 and reduction != "none":
        # a subnormal result carries few bits, so r / (N·rmse) is only finite and bounded there
        assert (x.grad.abs() <= 1).all()
        return
    torch.testing.assert_close(x.grad.double()[ok], x64.grad[ok], rtol=1e-5, atol=1e-7)
    if reduction == "none" or value == 0:
        assert (x.grad[~ok] == 0).all()


@pytest.mark.filterwarnings("ignore:Using a target size")
@given(pair=broadcast_pair(torch.float32, max_abs=1e30), reduction=st.sampled_from(REDUCTIONS),
       eps=st.sampled_from([0.0, 1e-6, 1.0]))
def test_property_finite_and_matches_float64(pair, reduction, eps):
    x, y = pair
    out, gx, gy = value_and_grads(SF.rmse_loss, x, y, reduction=reduction, eps=eps)
    ref = naive(x.double(), y.double(), reduction, eps)
    if ref.numel() and torch.isfinite(ref).all():
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-30)
    assert torch.isfinite(gx).all() and torch.isfinite(gy).all()
    torch.testing.assert_close(gx, -gy) if x.shape == y.shape else None


@given(x=shaped_tensor(torch.float32, min_dims=1, max_abs=1e4), reduction=st.sampled_from(REDUCTIONS))
def test_property_nan_propagates(x, reduction):
    assert_first_nan_propagates(SF.rmse_loss, x, reduction)


def test_inf_input_gives_inf():
    x = torch.tensor([float("inf"), 1.0])
    assert SF.rmse_loss(x, torch.zeros(2)) == float("inf")
    assert SF.rmse_loss(x, torch.zeros(2), "sum") == float("inf")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_gradcheck(reduction, eps):
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(4, dtype=torch.float64, requires_grad=True)
    f = lambda a, b: SF.rmse_loss(a, b, reduction, eps)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.autograd.gradcheck(f, (x, y), check_batched_grad=True)
        assert torch.autograd.gradgradcheck(f, (x, y), check_batched_grad=True)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_func_grad_and_vmap(reduction):
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randn(5, 3, dtype=torch.float64)
    g = torch.func.grad(lambda a: SF.rmse_loss(a, y, reduction).sum())(x)
    rx = x.clone().requires_grad_()
    naive(rx, y, reduction).sum().backward()
    torch.testing.assert_close(g, rx.grad)
    v = torch.vmap(lambda a, b: SF.rmse_loss(a, b, reduction))(x, y)
    torch.testing.assert_close(v, torch.stack([naive(a, b, reduction) for a, b in zip(x, y)]))
    pg = torch.vmap(torch.func.grad(lambda a, b: SF.rmse_loss(a, b, reduction).sum()))(x, y)
    ref = torch.stack([torch.func.grad(lambda a: naive(a, b, reduction).sum())(a) for a, b in zip(x, y)])
    torch.testing.assert_close(pg, ref)


def test_dtypes_and_autocast(dtype):
    x = torch.randn(6, dtype=dtype, requires_grad=True)
    y = torch.randn(6, dtype=dtype)
    out = SF.rmse_loss(x, y)
    assert out.dtype == naive(x, y).dtype == dtype
    ref = naive(x.detach().double(), y.double())
    torch.testing.assert_close(out.detach().double(), ref, **tol(dtype))
    out.backward()
    assert x.grad.dtype == dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert SF.rmse_loss(x, y).dtype == naive(x, y).dtype


def test_half_computed_in_float32():
    # float16 sum of squares would overflow: 100 values of 100 -> 1e6 > 65504
    x = torch.full((100,), 100.0, dtype=torch.float16)
    assert SF.rmse_loss(x, torch.zeros_like(x), "sum").item() == 1000.0


def test_module_matches_function():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    m = sl.RMSELoss(reduction="sum", eps=0.1)
    assert torch.equal(m(x, y), SF.rmse_loss(x, y, "sum", 0.1))


def test_broadcast_warns_like_mse_loss():
    with pytest.warns(UserWarning, match="target size"):
        out = SF.rmse_loss(torch.randn(3, 1), torch.randn(3))
    assert out.shape == ()


def test_bad_arguments():
    x = torch.randn(3)
    with pytest.raises(ValueError, match=r"rmse_loss: reduction must be 'none', 'mean' or 'sum', got 'avg'"):
        SF.rmse_loss(x, x, reduction="avg")
    with pytest.raises(ValueError, match=r"rmse_loss: eps must be >= 0"):
        SF.rmse_loss(x, x, eps=-1.0)
    with pytest.raises(ValueError, match=r"eps"):
        SF.rmse_loss(x, x, eps=float("nan"))
    with pytest.raises(TypeError, match=r"rmse_loss: eps"):
        SF.rmse_loss(x, x, eps=torch.tensor([1.0]))  # a 0-d tensor is a float, as torch's eps
    assert torch.equal(SF.rmse_loss(x, x, eps=torch.tensor(1.0)), SF.rmse_loss(x, x, eps=1.0))
    with pytest.raises(TypeError, match=r"rmse_loss: input must be a torch.Tensor, got list"):
        SF.rmse_loss([0.0, 1.0, 2.0], x)
    with pytest.raises(TypeError, match=r"rmse_loss: target must be a torch.Tensor, got float"):
        SF.rmse_loss(x, 1.0)
    # two integer tensors: F.mse_loss raises RuntimeError ("not implemented for 'Long'")
    with pytest.raises(RuntimeError, match=r"rmse_loss: input or target must be a floating-point tensor, "
                                           r"got torch.int64 and torch.int64"):
        SF.rmse_loss(torch.arange(3), torch.arange(3))
    with pytest.raises(RuntimeError, match="size"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        SF.rmse_loss(x, torch.randn(4))
    with pytest.raises(ValueError, match="RMSELoss: reduction"):
        sl.RMSELoss(reduction="avg")


@pytest.mark.slow
def test_compile_fullgraph():
    g = assert_compiled_matches_eager(lambda a: SF.rmse_loss(a, torch.zeros(3)), torch.tensor([1e20, 3.0, 0.0]))
    torch.testing.assert_close(g, torch.tensor([1 / math.sqrt(3), 0.0, 0.0]))


@pytest.mark.filterwarnings("ignore:Using a target size")
@pytest.mark.parametrize("x_dtype, y_dtype, y_shape", [
    (torch.float16, torch.float32, (4, 3)),
    (torch.float32, torch.float16, (4, 3)),
    (torch.bfloat16, torch.float64, (4, 3)),
    (torch.float32, torch.int64, (4, 3)),
    (torch.float32, torch.bool, (4, 3)),
    (torch.int64, torch.float32, (4, 3)),
    (torch.float32, torch.float64, ()),  # F.mse_loss broadcasts first: a 0-dim float64 wins
])
def test_mixed_dtypes_promote_as_mse_loss(x_dtype, y_dtype, y_shape):
    """rmse_loss(x, y) has the dtype, value and gradients of sqrt(F.mse_loss(x, y))."""
    x = (torch.randn(4, 3) * 3).to(x_dtype)
    y = (torch.randn(y_shape) * 3).to(y_dtype)

    try:  # torch 2.6's mse_loss backward refuses mixed dtypes; later versions promote
        probe = x.clone().requires_grad_(x.is_floating_point())
        out = F.mse_loss(probe, y)
        if probe.requires_grad:
            out.backward()
        promote_first = False
    except RuntimeError:
        promote_first = True

    def torch_rmse(a, b, reduction="mean"):
        if promote_first:
            dt = torch.promote_types(a.dtype, b.dtype)
            a, b = a.to(dt), b.to(dt)
        return torch.sqrt(F.mse_loss(a, b, reduction=reduction))

    for reduction in REDUCTIONS:
        expected = torch_rmse(x, y, reduction)
        got = SF.rmse_loss(x, y, reduction=reduction)
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected)
    if x_dtype.is_floating_point:
        xr = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(SF.rmse_loss(xr, y), xr)
        xt = x.clone().requires_grad_()
        (g_torch,) = torch.autograd.grad(torch_rmse(xt, y), xt)
        assert g.dtype == g_torch.dtype
        torch.testing.assert_close(g, g_torch)


@pytest.mark.slow
def test_compiled_zero_residual_is_positive_zero():
    """sqrt(0) is +0.0, compiled as eager (the scaled 0.1 kernel gave -0.0)."""
    f = torch.compile(lambda a, b: SF.rmse_loss(a, b), fullgraph=True)
    for x in [torch.zeros(5), torch.full((5,), -2.5)]:
        for out in [f(x, x.clone()), SF.rmse_loss(x, x.clone())]:
            assert out.item() == 0.0 and not torch.signbit(out)


@pytest.mark.slow
def test_compiled_float32_extremes_vs_float64():
    """The compiled float32 spelling (three fused sums) has no overflow or underflow either."""
    f = torch.compile(lambda a, b: SF.rmse_loss(a, b), fullgraph=True)
    for v in [1e30, 1e20, 3.0, 1e-20, 1e-30, 1e-44]:
        x = torch.full((100,), v)
        x[::2] = -v
        expected = torch.sqrt((x.double() ** 2).mean())
        torch.testing.assert_close(f(x, torch.zeros(100)).double(), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_rmse_masked_selects_residuals(reduction, eps):
    g = _gen(3)
    x = torch.randn(3, 4, generator=g, dtype=D, requires_grad=True)
    t = torch.randn(4, generator=g, dtype=D)  # broadcast target (no warning: sizes differ only by broadcast)
    m = torch.tensor([[True], [False], [True]])
    r = (x - t)[m.expand(3, 4)]
    if reduction == "mean":
        want = torch.sqrt((r**2).mean() + eps)
    elif reduction == "sum":
        want = torch.sqrt((r**2).sum() + eps)
    else:
        want = torch.where(m, torch.sqrt((x - t) ** 2 + eps), 0.0)
    with pytest.warns(UserWarning, match="target size"):
        got = SF.rmse_loss(x, t, reduction, eps, mask=m)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_grad(got, x)[0], _grad(want, x)[0])


def test_rmse_masked_nan_and_zero_residual():
    x = torch.tensor([1.0, NAN, 3.0, 5.0], requires_grad=True)
    t = torch.tensor([1.0, 0.0, 3.0, 0.0])
    m = torch.tensor([True, False, True, False])
    got = SF.rmse_loss(x, t, mask=m)  # kept residuals are all 0: value 0, defined gradient 0
    (gx,) = _grad(got, x)
    assert got.item() == 0.0 and torch.equal(gx, torch.zeros(4))
    got = SF.rmse_loss(x, torch.zeros(4), "sum", mask=m)
    torch.testing.assert_close(got, torch.tensor(math.sqrt(10.0)))
    assert torch.isfinite(_grad(got, x)[0]).all()


def test_float64_tiny_residuals_do_not_underflow():
    # float64 squares lose their digits below 1.5e-154: the norm is taken again scaled by 2**600
    x = torch.tensor([1e-170, 1e-170, 0.0], dtype=torch.float64, requires_grad=True)
    out = SF.rmse_loss(x, torch.zeros(3, dtype=torch.float64))
    (g,) = torch.autograd.grad(out, x)
    want = math.sqrt(2 / 3) * 1e-170
    assert out.item() == pytest.approx(want, rel=1e-15)
    torch.testing.assert_close(g, torch.tensor([1e-170, 1e-170, 0.0], dtype=torch.float64) / (3 * want))
    # and at the float32 analogue, float32's own result
    out32 = SF.rmse_loss((x.detach() * 1e140).float(), torch.zeros(3))
    assert out32.item() == pytest.approx(want * 1e140, rel=1e-6)
    # ordinary and overflowing float64 residuals keep their values
    for v in (1.0, 1e200):
        r = torch.tensor([v, -v, 0.0], dtype=torch.float64)
        assert SF.rmse_loss(r, torch.zeros(3, dtype=torch.float64)).item() == pytest.approx(v * math.sqrt(2 / 3))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("values", [[1e-30, 1e-30], [1e-30, 0.0], [1e20, 0.0], [3.0, -4.0]])
def test_double_backward_at_tiny_and_huge_residuals(reduction, values):
    # the Hessian of sqrt(Σ r² / D): (I − u uᵀ) / (D · rmse), u = r / (sqrt(D) · rmse); the
    # backward is (r / rmse) · (g / D), so its derivative forms no rmse² (float32 under- and
    # overflows there)
    x = torch.tensor(values, requires_grad=True)
    (g,) = torch.autograd.grad(SF.rmse_loss(x, torch.zeros(2), reduction), x, create_graph=True)
    hess = torch.stack([torch.autograd.grad(g[i], x, retain_graph=True)[0] for i in range(2)])
    r = torch.tensor(values, dtype=torch.float64)
    d = 2.0 if reduction == "mean" else 1.0
    rmse = torch.linalg.vector_norm(r) / math.sqrt(d)
    u = r / (math.sqrt(d) * rmse)
    want = (torch.eye(2, dtype=torch.float64) - torch.outer(u, u)) / (d * rmse)
    torch.testing.assert_close(hess.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    fwd = torch.func.hessian(lambda a: SF.rmse_loss(a, torch.zeros(2), reduction))(x.detach())
    torch.testing.assert_close(fwd.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("value", [1e-40, -1e-40, 2.0, float("inf")])
def test_none_reduction_double_backward_is_zero(value):
    # |r| has derivative sign(r) and second derivative 0 (r ≠ 0); r / |r| would give inf − inf
    # at a subnormal r
    x = torch.tensor([value], requires_grad=True)
    (g,) = torch.autograd.grad(SF.rmse_loss(x, torch.zeros(1), "none").sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    assert g.item() == math.copysign(1.0, value) and gg.item() == 0.0


@pytest.mark.parametrize("value", [float("inf"), -float("inf")])
def test_none_reduction_with_eps_at_infinite_residuals_gives_the_limit(value):
    # d sqrt(r² + eps)/dr = r / sqrt(r² + eps) → sign(r), second derivative → 0, as without eps
    # (r / value was inf / inf = NaN there)
    x = torch.tensor([value, 3.0], requires_grad=True)
    out = SF.rmse_loss(x, torch.zeros(2), "none", eps=16.0)
    assert out[0].item() == math.inf
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    assert g.tolist() == [math.copysign(1.0, value), pytest.approx(0.6)]
    assert gg[0].item() == 0.0 and math.isfinite(gg[1].item())
    _, tangent = torch.func.jvp(lambda a: SF.rmse_loss(a, torch.zeros(2), "none", eps=16.0),
                                (x.detach(),), (torch.ones(2),))
    assert tangent.tolist() == [math.copysign(1.0, value), pytest.approx(0.6)]


def test_broadcast_error_names_the_arguments():
    # torch's words ("The size of tensor a ...") name no argument; ours name both
    with pytest.raises(RuntimeError, match=r"rmse_loss: the shapes of input \(2, 3\) and target \(4,\) do not "
                                           r"broadcast \(The size of tensor a \(3\) must match the size of "
                                           r"tensor b \(4\) at non-singleton dimension 1\)"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        SF.rmse_loss(torch.randn(2, 3), torch.randn(4))


@pytest.mark.slow
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_compile_fullgraph_with_broadcast_target(reduction):
    # F.mse_loss's size-mismatch warning is eager only: Dynamo cannot trace warnings.warn, and
    # torch.compile(fullgraph=True) of sqrt(F.mse_loss) with these shapes compiles
    target = torch.tensor([0.5, -1.0, 2.0, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_compiled_matches_eager(lambda a: SF.rmse_loss(a, target, reduction).sum(),
                                      torch.tensor([[1.0], [3.0], [-2.0]]))
