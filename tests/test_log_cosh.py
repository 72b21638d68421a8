"""log_cosh_loss / LogCoshLoss: no overflow, gradient tanh(r)."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from conftest import assert_compiled_matches_eager, tol
from hypothesis import given
from hypothesis import strategies as st
from strategies import assert_first_nan_propagates, broadcast_pair, shaped_tensor, value_and_grads

import stablelosses as sl
import stablelosses.functional as SF
from stablelosses import naive as naive_formulas

REDUCTIONS = ["none", "mean", "sum"]


def reduce(loss, reduction):
    return {"none": loss, "mean": loss.mean(), "sum": loss.sum()}[reduction] if loss.numel() or reduction == "none" else {"mean": loss.mean(), "sum": loss.sum()}[reduction]


def reference(x, y, reduction):
    """float64 reference from a different formula: log(cosh r) where cosh is finite, else |r| - log 2."""
    r = (x.double() - y.double())
    a = r.abs()
    big = a > 300
    ref = torch.where(big, a - math.log(2), torch.log(torch.cosh(torch.where(big, 0.0, r))))
    return reduce(ref, reduction)


naive = naive_formulas.log_cosh


SHAPES = [((), ()), ((0,), (0,)), ((5,), (5,)), ((2, 3), (2, 3)), ((2, 3), (3,)), ((3,), (2, 1))]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_parity_with_naive(device, reduction, shapes):
    x = torch.randn(shapes[0], dtype=torch.float64, device=device) * 3
    y = torch.randn(shapes[1], dtype=torch.float64, device=device)
    v, gx, gy = value_and_grads(SF.log_cosh_loss, x, y, reduction=reduction)
    rv, rgx, rgy = value_and_grads(naive, x, y, reduction=reduction)
    torch.testing.assert_close(v, rv, equal_nan=True)
    torch.testing.assert_close(gx, rgx)
    torch.testing.assert_close(gy, rgy)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradient_is_tanh(device, reduction):
    x = torch.tensor([-1e30, -1e4, -100.0, -0.5, 0.0, 1e-45, 2.0, 100.0, 1e4, 1e30], device=device)
    y = torch.zeros_like(x)
    out, gx, gy = value_and_grads(SF.log_cosh_loss, x, y, reduction=reduction)
    expected = torch.tanh(x) / (x.numel() if reduction == "mean" else 1)
    torch.testing.assert_close(gx, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(gy, -expected, rtol=1e-6, atol=0)
    assert gx[4] == 0


@pytest.mark.parametrize("value", [1e30, -1e30, 1e4, -1e4, 89.0, 710.0, 1e-45, 1e-38, 0.0, 1e-3])
def test_extremes_vs_float64(value):
    x = torch.tensor([value])
    out = SF.log_cosh_loss(x, torch.zeros(1), "none")
    ref = reference(x, torch.zeros(1), "none")
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-45)
    assert torch.isfinite(out).all()


def _ulps_from_mpmath(out: torch.Tensor, r: torch.Tensor) -> list[float]:
    """|out - log cosh r| in ulps of the exact value (at least the smallest subnormal)."""
    finfo = torch.finfo(out.dtype)
    errors = []
    for got, v in zip(out.tolist(), r.tolist()):
        exact = mpmath.log(mpmath.cosh(mpmath.mpf(v)))
        near = torch.tensor(float(exact), dtype=out.dtype).abs()
        ulp = max(float(torch.nextafter(near, torch.tensor(math.inf, dtype=out.dtype)) - near),
                  finfo.smallest_normal * finfo.eps)
        errors.append(float(abs(mpmath.mpf(got) - exact) / ulp))
    return errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_value_within_few_ulp_of_mpmath_from_tiny_to_huge_residuals(dtype):
    # |r| + softplus(-2|r|) - log 2 alone cancels at small |r|; log1p(2 sinh^2(r/2)) does not
    magnitudes = torch.logspace(-30, 4, 341, dtype=torch.float64)
    extra = torch.tensor([1e-4, 0.5, 1.0, 1.9999, 2.0, 2.0001, 3.0, 20.0, 88.0, 1e3], dtype=torch.float64)
    r = torch.cat([magnitudes, extra, -magnitudes, -extra]).to(dtype)
    out = SF.log_cosh_loss(r, torch.zeros_like(r), "none")
    with mpmath.workprec(600):  # cosh(1e-30) = 1 + 5e-61 (2^-200) must be held and more
        errors = _ulps_from_mpmath(out, r)
    worst = max(range(len(errors)), key=errors.__getitem__)
    assert errors[worst] <= 3.0, (r[worst].item(), out[worst].item(), errors[worst])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_residual_gradients_and_second_derivative_stay_exact(dtype):
    r = torch.tensor([1e-30, 1e-4, 0.5, 1.999, 2.0, 2.001, 50.0], dtype=dtype, requires_grad=True)
    (g,) = torch.autograd.grad(SF.log_cosh_loss(r, torch.zeros_like(r), "sum"), r, create_graph=True)
    torch.testing.assert_close(g, torch.tanh(r.detach()))
    (h,) = torch.autograd.grad(g.sum(), r)
    torch.testing.assert_close(h, 1 - torch.tanh(r.detach()) ** 2)
    _, t = torch.func.jvp(lambda a: SF.log_cosh_loss(a, torch.zeros_like(a), "none"), (r.detach(),),
                          (torch.ones_like(r),))
    torch.testing.assert_close(t, torch.tanh(r.detach()))


def test_user_regression_overflow():
    x = torch.tensor([100.0, -1000.0], requires_grad=True)
    assert torch.isinf(naive(x.detach(), torch.zeros(2), "none")).all()
    loss = SF.log_cosh_loss(x, torch.zeros(2), "sum")
    torch.testing.assert_close(loss.detach(), torch.tensor(1100.0 - 2 * math.log(2)))
    loss.backward()
    assert x.grad.tolist() == [1.0, -1.0]


@given(pair=broadcast_pair(torch.float32, max_abs=1e30), reduction=st.sampled_from(REDUCTIONS))
def test_property_finite_and_matches_float64(pair, reduction):
    x, y = pair
    out, gx, gy = value_and_grads(SF.log_cosh_loss, x, y, reduction=reduction)
    ref = reference(x, y, reduction)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.isfinite(out).all() or out.numel() == 0 or reduction == "mean"
    assert torch.isfinite(gx).all() and torch.isfinite(gy).all()


@given(x=shaped_tensor(torch.float32, min_dims=1, max_abs=1e4), reduction=st.sampled_from(REDUCTIONS))
def test_property_nan_propagates(x, reduction):
    assert_first_nan_propagates(SF.log_cosh_loss, x, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck(reduction):
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(4, dtype=torch.float64, requires_grad=True)
    f = lambda a, b: SF.log_cosh_loss(a, b, reduction)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, y), check_batched_grad=True)
    assert torch.autograd.gradgradcheck(f, (x, y), check_batched_grad=True)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_func_grad_and_vmap(reduction):
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randn(5, 3, dtype=torch.float64)
    g = torch.func.grad(lambda a: SF.log_cosh_loss(a, y, reduction).sum())(x)
    torch.testing.assert_close(g, torch.tanh(x - y) / (x.numel() if reduction == "mean" else 1))
    v = torch.vmap(lambda a, b: SF.log_cosh_loss(a, b, reduction))(x, y)
    torch.testing.assert_close(v, torch.stack([naive(a, b, reduction) for a, b in zip(x, y)]))
    pg = torch.vmap(torch.func.grad(lambda a, b: SF.log_cosh_loss(a, b, reduction).sum()))(x, y)
    torch.testing.assert_close(pg, torch.tanh(x - y) / (3 if reduction == "mean" else 1))


def test_dtypes_and_autocast(dtype):
    x = torch.randn(6, dtype=dtype, requires_grad=True)
    y = torch.randn(6, dtype=dtype)
    out = SF.log_cosh_loss(x, y)
    assert out.dtype == dtype
    torch.testing.assert_close(out.detach().double(), reference(x.detach(), y, "mean"), **tol(dtype))
    out.backward()
    assert x.grad.dtype == dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.nn.functional.mse_loss(x, y).dtype
        assert SF.log_cosh_loss(x, y).dtype == expected


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float32), (torch.float32, torch.float64),
                                    (torch.float64, torch.bfloat16), (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("mask", [False, True])
def test_mixed_dtypes_follow_torch_type_promotion(dtypes, mask):
    x = torch.randn(5).to(dtypes[0]).requires_grad_()
    y = torch.randn(5).to(dtypes[1])
    expected = torch.log(torch.cosh(x - y)).sum()
    kwargs = {"mask": torch.ones(5, dtype=torch.bool)} if mask else {}
    out = SF.log_cosh_loss(x, y, "sum", **kwargs)
    assert out.dtype == expected.dtype == torch.promote_types(*dtypes)
    torch.testing.assert_close(out.double(), reference(x.detach(), y, "sum"), **tol(out.dtype))
    out.backward()
    assert x.grad.dtype == dtypes[0]


def test_half_large_residual_in_float32():
    x = torch.tensor([60000.0], dtype=torch.float16)
    out = SF.log_cosh_loss(x, -x, "none")  # residual 120000 overflows float16 itself
    assert out.dtype == torch.float16
    assert torch.isinf(out)  # representable only as inf in float16, as the float32 result 119999.3 is


def test_module_matches_function():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(sl.LogCoshLoss("sum")(x, y), SF.log_cosh_loss(x, y, "sum"))


def test_bad_arguments():
    x = torch.randn(3)
    with pytest.raises(ValueError, match=r"log_cosh_loss: reduction must be 'none', 'mean' or 'sum', got 'avg'"):
        SF.log_cosh_loss(x, x, reduction="avg")
    with pytest.raises(TypeError, match=r"log_cosh_loss: input"):
        SF.log_cosh_loss(torch.arange(3), x)
    with pytest.raises(TypeError, match=r"log_cosh_loss: target"):
        SF.log_cosh_loss(x, torch.arange(3))
    with pytest.raises(RuntimeError, match="size"):
        SF.log_cosh_loss(x, torch.randn(4))


@pytest.mark.slow
def test_compile_fullgraph():
    x = torch.tensor([1000.0, 0.5, 0.0])
    g = assert_compiled_matches_eager(lambda a: SF.log_cosh_loss(a, torch.zeros(3)), x)
    torch.testing.assert_close(g, torch.tanh(x) / 3)


def test_broadcast_error_names_the_arguments():
    # torch's words ("The size of tensor a ...") name no argument; ours name both
    with pytest.raises(RuntimeError, match=r"log_cosh_loss: the shapes of input \(3,\) and target \(4,\) do not "
                                           r"broadcast \(The size of tensor a \(3\) must match"):
        SF.log_cosh_loss(torch.randn(3), torch.randn(4))
