"""What every elementwise op and the softmax family share, one table per property: dtypes and
autocast against float64 and torch, NaN propagation, gradcheck and gradgradcheck, finite second
derivatives at the singular points, torch.func and torch.compile (each op's own tests are in
test_sqrt, test_div, test_xlogy and test_softmax)."""

from __future__ import annotations

import pytest
import torch
from conftest import grad_of, tol
from torch.autograd import gradcheck, gradgradcheck

import stablelosses as sl
import stablelosses.functional as SF

INF = float("inf")
NAN = float("nan")


# ----------------------------------------------------------------------------------------
# dtypes and autocast
# ----------------------------------------------------------------------------------------

OPS_UNARY = {
    "safe_sqrt": (lambda t: SF.safe_sqrt(t.abs()), lambda t: torch.sqrt(t.abs())),
    "logsumexp": (lambda t: SF.logsumexp(t, -1), lambda t: torch.logsumexp(t, -1)),
    "softmax": (lambda t: SF.softmax(t, -1), lambda t: torch.softmax(t, -1)),
    "log_softmax": (lambda t: SF.log_softmax(t, -1), lambda t: torch.log_softmax(t, -1)),
    "xlogy": (lambda t: SF.xlogy(t, t.abs()), lambda t: torch.special.xlogy(t, t.abs())),
    "safe_div": (lambda t: SF.safe_div(t, t.abs() + 1), lambda t: t / (t.abs() + 1)),
}


@pytest.mark.parametrize("name", sorted(OPS_UNARY))
def test_dtypes_match_float64_reference(name, dtype, device):
    ours, ref = OPS_UNARY[name]
    x = (torch.randn(3, 7, dtype=torch.float64) * 3).to(dtype).to(device)
    y, (g,) = grad_of(ours, x)
    assert y.dtype == ref(x).dtype and g.dtype == dtype
    y_ref, (g_ref,) = grad_of(ref, x.double())
    torch.testing.assert_close(y.double(), y_ref, **tol(dtype))
    torch.testing.assert_close(g.double(), g_ref, **{k: 4 * v for k, v in tol(dtype).items()})


def test_autocast_output_dtypes_match_builtins():
    x = torch.randn(4, 5, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for name, (ours, ref) in OPS_UNARY.items():
            assert ours(x).dtype == ref(x).dtype, name


# ----------------------------------------------------------------------------------------
# NaN in, NaN out
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPS_UNARY))
def test_nan_propagates(name):
    ours, _ = OPS_UNARY[name]
    x = torch.tensor([[1.0, NAN, 2.0], [0.5, 0.25, 3.0]])
    y, (g,) = grad_of(ours, x)
    assert torch.isnan(y[0]).any()
    assert torch.isnan(g[0]).any()
    assert not torch.isnan(y[1]).any() and not torch.isnan(g[1]).any()


# ----------------------------------------------------------------------------------------
# gradcheck / gradgradcheck, second derivatives at singular points
# ----------------------------------------------------------------------------------------

GENERIC = {
    "safe_sqrt": (lambda x, y: SF.safe_sqrt(x.abs() + 0.1),),
    "safe_div": (lambda x, y: SF.safe_div(x, y.abs() + 0.5),),
    "xlogy": (lambda x, y: SF.xlogy(x, y.abs() + 0.1),),
    "logsumexp": (lambda x, y: SF.logsumexp(x * y, (0, 1)),),
    "softmax": (lambda x, y: SF.softmax(x + y, 0, mask=torch.tensor([True, False, True, True])[:, None]),),
    "log_softmax": (lambda x, y: SF.log_softmax(x * y, -1),),
}


@pytest.mark.parametrize("name", sorted(GENERIC))
def test_gradcheck_and_gradgradcheck(name):
    (fn,) = GENERIC[name]
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    assert gradcheck(fn, (x, y), check_batched_grad=True)
    assert gradgradcheck(fn, (x, y), check_batched_grad=True)


SINGULAR = {
    "safe_sqrt": (lambda t: SF.safe_sqrt(t[0]), torch.tensor([[0.0, 0.0]])),
    "safe_div": (lambda t: SF.safe_div(t[0], t[1]), torch.tensor([[1.0, 2.0], [0.0, 0.0]])),
    "xlogy": (lambda t: SF.xlogy(t[0], t[1]), torch.tensor([[0.0, 0.0], [0.0, 2.0]])),
    "logsumexp": (lambda t: SF.logsumexp(t, 1), torch.tensor([[-INF, -INF], [INF, INF]])),
    "softmax": (lambda t: SF.softmax(t, 1), torch.tensor([[-INF, -INF], [INF, 1.0]])),
    "log_softmax": (lambda t: SF.log_softmax(t, 1), torch.tensor([[-INF, -INF], [INF, 1.0]])),
}


@pytest.mark.parametrize("name", sorted(SINGULAR))
def test_second_derivative_finite_at_singular_points(name):
    fn, point = SINGULAR[name]
    x = point.double().requires_grad_()
    out = fn(x)
    w = torch.linspace(0.5, 1.5, out.numel(), dtype=torch.float64).reshape(out.shape)
    (g,) = torch.autograd.grad((out * w).nan_to_num(0.0, 0.0, 0.0).sum(), x, create_graph=True)
    assert torch.isfinite(g).all()
    v = torch.ones_like(x)
    (hv,) = torch.autograd.grad((g * v).sum(), x, allow_unused=True)
    assert hv is None or torch.isfinite(hv).all()


# ----------------------------------------------------------------------------------------
# torch.func and torch.compile
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GENERIC))
def test_torch_func_grad_and_vmap(name):
    (fn,) = GENERIC[name]
    x = torch.randn(5, 4, 3, dtype=torch.float64)
    y = torch.randn(4, 3, dtype=torch.float64)

    def scalar(xi):
        return fn(xi, y).sum()

    per_sample = torch.func.vmap(torch.func.grad(scalar))(x)
    for i in range(5):
        xi = x[i].clone().requires_grad_()
        (expected,) = torch.autograd.grad(scalar(xi), xi)
        torch.testing.assert_close(per_sample[i], expected)
    batched = torch.func.vmap(lambda xi: fn(xi, y))(x)
    torch.testing.assert_close(batched, torch.stack([fn(x[i], y) for i in range(5)]))


@pytest.mark.slow
def test_compile_fullgraph_all_ops():
    def all_ops(x, b, mask):
        z = x.masked_fill(torch.arange(4)[:, None] == 0, -INF)  # an all -inf row
        return (
            SF.safe_sqrt(x.abs()).sum()
            + SF.safe_div(x, b).sum()
            + SF.xlogy(torch.where(b == 0, 0.0, x.abs()), b.abs()).sum()  # 0·log 0
            + SF.logsumexp(z, -1).exp().sum()
            + (SF.softmax(z, -1, mask=mask) * b).sum()
            + SF.log_softmax(z, -1, mask=mask).nan_to_num(0.0, 0.0, 0.0).sum()
        )

    x = torch.randn(4, 6)
    x[1, 2] = 0.0
    b = torch.randn(4, 6)
    b[2, :3] = 0.0
    mask = torch.rand(4, 6) > 0.3
    mask[3] = False
    compiled = torch.compile(all_ops, fullgraph=True)
    eager_x = x.clone().requires_grad_()
    comp_x = x.clone().requires_grad_()
    eager = all_ops(eager_x, b, mask)
    comp = compiled(comp_x, b, mask)
    torch.testing.assert_close(comp, eager)
    eager.backward()
    comp.backward()
    torch.testing.assert_close(comp_x.grad, eager_x.grad)
    assert torch.isfinite(comp_x.grad).all()


def test_top_level_exports():
    for name in ["safe_sqrt", "safe_div", "logsumexp", "softmax", "log_softmax", "xlogy"]:
        assert getattr(sl, name) is getattr(SF, name)
    assert set(SF.__all__) >= {"rmse_loss", "cross_entropy", "focal_loss", "sigmoid_focal_loss",
                               "kl_div", "log_cosh_loss"}
