"""logaddexp: torch's value everywhere; gradients 0 where both are -inf, ½ where both are +inf."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tol
from hypothesis import given, settings
from strategies import broadcast_pair, finite_floats
from torch.autograd import gradcheck, gradgradcheck

import stablelosses as sl
import stablelosses.functional as SF

INF = float("inf")


def _ref_grads(a: torch.Tensor, b: torch.Tensor):
    """σ(a − b), σ(b − a) in float64 numpy, written as 1 / (1 + exp(∓d))."""
    d = a.double().numpy() - b.double().numpy()
    with np.errstate(over="ignore"):
        return np.asarray(1.0 / (1.0 + np.exp(-d))), np.asarray(1.0 / (1.0 + np.exp(d)))


def _grads(a, b, fn=SF.logaddexp):
    a = a.detach().clone().requires_grad_()
    b = b.detach().clone().requires_grad_()
    out = fn(a, b)
    ga, gb = torch.autograd.grad(out.sum(), (a, b))
    return out.detach(), ga, gb


def test_regression_torch_gradient_is_nan_at_both_neg_inf():
    a = torch.tensor([-INF], requires_grad=True)
    torch.logaddexp(a, torch.tensor([-INF])).sum().backward()
    assert torch.isnan(a.grad).all()  # the hazard this op exists for
    out, ga, gb = _grads(torch.tensor([-INF]), torch.tensor([-INF]))
    assert out.item() == -INF
    assert ga.item() == 0.0 and gb.item() == 0.0


@pytest.mark.parametrize(
    "a, b, value, ga, gb",
    [
        (-INF, -INF, -INF, 0.0, 0.0),
        (INF, INF, INF, 0.5, 0.5),
        (INF, 1.0, INF, 1.0, 0.0),
        (1.0, INF, INF, 0.0, 1.0),
        (INF, -INF, INF, 1.0, 0.0),
        (-INF, 2.0, 2.0, 0.0, 1.0),
        (3.0, -INF, 3.0, 1.0, 0.0),
    ],
)
def test_defined_values_and_gradients_at_infinities(a, b, value, ga, gb, device):
    out, got_a, got_b = _grads(torch.tensor([a], device=device), torch.tensor([b], device=device))
    assert out.item() == value
    assert got_a.item() == ga and got_b.item() == gb


def test_nan_propagates():
    for a, b in [(float("nan"), 1.0), (float("nan"), -INF), (INF, float("nan"))]:
        out, ga, gb = _grads(torch.tensor([a]), torch.tensor([b]))
        assert torch.isnan(out).all() and torch.isnan(ga).all() and torch.isnan(gb).all()


@settings(max_examples=60)
@given(broadcast_pair(torch.float32))
def test_matches_float64_reference(pair):
    a, b = pair
    out, ga, gb = _grads(a, b)
    ref = np.logaddexp(a.double().numpy(), b.double().numpy())
    ref = torch.from_numpy(np.asarray(ref)).reshape(out.shape)
    torch.testing.assert_close(out.double(), ref, **tol(torch.float32))
    ra, rb = _ref_grads(*torch.broadcast_tensors(a, b))
    torch.testing.assert_close(ga, torch.from_numpy(ra).float().sum_to_size(a.shape), **tol(torch.float32))
    torch.testing.assert_close(gb, torch.from_numpy(rb).float().sum_to_size(b.shape), **tol(torch.float32))


@settings(max_examples=40)
@given(finite_floats(torch.float32), finite_floats(torch.float32))
def test_parity_with_torch_where_finite(a, b):
    ta, tb = torch.tensor([a]), torch.tensor([b])
    ours = _grads(ta, tb)
    theirs = _grads(ta, tb, torch.logaddexp)
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y)


def test_broadcasting_dtypes_and_numbers_like_torch(dtype):
    a = torch.randn(3, 1, dtype=dtype)
    b = torch.randn(4, dtype=dtype)
    out = SF.logaddexp(a, b)
    ref = torch.logaddexp(a.double(), b.double())
    assert out.dtype == torch.logaddexp(a, b).dtype == dtype and out.shape == (3, 4)
    torch.testing.assert_close(out.double(), ref, **tol(dtype))
    mixed = SF.logaddexp(torch.randn(2, dtype=torch.float16), torch.randn(2, dtype=torch.float64))
    assert mixed.dtype == torch.float64
    assert SF.logaddexp(torch.tensor([1, 2]), torch.tensor([1, 2])).dtype == torch.get_default_dtype()


def test_half_precision_computed_in_float32():
    # float16 exp(12) overflows; the value itself (12.0) is representable.
    a = torch.tensor([12.0, -20.0], dtype=torch.float16, requires_grad=True)
    b = torch.tensor([11.0, -20.0], dtype=torch.float16)
    out = SF.logaddexp(a, b)
    ref = np.logaddexp(np.array([12.0, -20.0]), np.array([11.0, -20.0]))
    torch.testing.assert_close(out.double(), torch.from_numpy(ref), **tol(torch.float16))
    out.sum().backward()
    expected = torch.tensor([1 / (1 + np.exp(-1.0)), 0.5], dtype=torch.float64)
    torch.testing.assert_close(a.grad.double(), expected, **tol(torch.float16))


def test_gradcheck_gradgradcheck_forward_ad():
    a = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert gradcheck(SF.logaddexp, (a, b), check_batched_grad=True, check_forward_ad=True)
    assert gradgradcheck(SF.logaddexp, (a, b), check_batched_grad=True)


def test_second_derivative_finite_at_infinities():
    a = torch.tensor([-INF, INF, INF], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([-INF, INF, 1.0], dtype=torch.float64)
    (g,) = torch.autograd.grad(SF.logaddexp(a, b).nan_to_num(0.0, 0.0, 0.0).sum(), a, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), a)
    assert torch.isfinite(h).all()
    assert (h == 0).all()  # σ'(0) · 0 on the same-infinity pairs, σ'(inf) = 0 on the last


def test_jvp_jacfwd_hessian_match_torch_and_are_defined_at_neg_inf():
    a = torch.randn(5, dtype=torch.float64)
    b = torch.randn(5, dtype=torch.float64)
    ta, tb = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    ours = torch.func.jvp(SF.logaddexp, (a, b), (ta, tb))
    theirs = torch.func.jvp(torch.logaddexp, (a, b), (ta, tb))
    torch.testing.assert_close(ours, theirs)
    h = torch.func.hessian(lambda z: SF.logaddexp(z[0], z[1]).sum())(torch.stack([a, b]))
    h_ref = torch.func.hessian(lambda z: torch.logaddexp(z[0], z[1]).sum())(torch.stack([a, b]))
    torch.testing.assert_close(h, h_ref)
    ninf = torch.full((2,), -INF, dtype=torch.float64)
    out, tangent = torch.func.jvp(SF.logaddexp, (ninf, ninf), (torch.ones(2, dtype=torch.float64),) * 2)
    assert (out == -INF).all() and (tangent == 0).all()
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(torch.tensor([INF, INF]), torch.tensor([1.0, 2.0]))
        t = torch.autograd.forward_ad.unpack_dual(SF.logaddexp(dual, torch.tensor([INF, 0.0]))).tangent
    assert t.tolist() == [0.5, 2.0]


def test_vmap_and_per_sample_grad():
    a = torch.randn(6, 4, dtype=torch.float64)
    b = torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(lambda r: SF.logaddexp(r, b))(a), torch.logaddexp(a, b))
    g = torch.func.vmap(torch.func.grad(lambda r: SF.logaddexp(r, b).sum()))(a)
    torch.testing.assert_close(g, torch.sigmoid(a - b))


def test_top_level_export_and_errors():
    assert sl.logaddexp is SF.logaddexp
    with pytest.raises(TypeError, match="logaddexp: input must be a torch.Tensor, got float"):
        SF.logaddexp(1.0, 2.0)
    # torch.logaddexp takes no Python number (OpInfo's error input): neither do we
    for a, b, name in ((torch.tensor([0.0]), 0.0, "other"), (2, torch.tensor([1, 2]), "input")):
        with pytest.raises(TypeError, match=f"logaddexp: {name} must be a torch.Tensor"):
            SF.logaddexp(a, b)
        with pytest.raises(TypeError):
            torch.logaddexp(a, b)
    with pytest.raises(TypeError, match="logaddexp: other must be a real tensor"):
        SF.logaddexp(torch.ones(2), torch.ones(2, dtype=torch.complex64))
    with pytest.raises(RuntimeError, match=r"logaddexp: the shapes of input \(2,\) and other \(3,\)"):
        SF.logaddexp(torch.ones(2), torch.ones(3))


@pytest.mark.slow
def test_compile_fullgraph():
    a = torch.tensor([[-INF, 0.5, INF], [1.0, -2.0, 3.0]])
    b = torch.tensor([[-INF, 0.25, INF], [0.0, -INF, 2.0]])
    fn = torch.compile(lambda x, y: SF.logaddexp(x, y).nan_to_num(0.0, 0.0, 0.0).sum(), fullgraph=True)
    x1, x2 = a.clone().requires_grad_(), a.clone().requires_grad_()
    out = fn(x1, b)
    ref = SF.logaddexp(x2, b).nan_to_num(0.0, 0.0, 0.0).sum()
    torch.testing.assert_close(out, ref)
    out.backward()
    ref.backward()
    torch.testing.assert_close(x1.grad, x2.grad)
