"""normalize and cosine_similarity: exact unit vectors, zero vectors give 0 with gradient 0."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_compiled_matches_eager, tol
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import finite_floats, tensors
from torch.autograd import gradcheck, gradgradcheck

import stablelosses as sl
import stablelosses.functional as SF

INF = float("inf")
NAN = float("nan")
PS = [1.0, 2.0, 3.0, INF]


def _grad(fn, x, *args, w=None, **kw):
    x = x.detach().clone().requires_grad_()
    out = fn(x, *args, **kw)
    w = torch.ones_like(out) if w is None else w
    (g,) = torch.autograd.grad((out * w).sum(), x)
    return out.detach(), g


def _ref_unit(x: np.ndarray, p: float, axis: int) -> np.ndarray:
    """x / ‖x‖_p in float64 numpy (no scaling needed at float32 magnitudes); 0 for 0."""
    n = np.linalg.norm(x, ord=p, axis=axis, keepdims=True)
    return np.where(n == 0, 0.0, x / np.where(n == 0, 1.0, n))


# ----------------------------------------------------------------------------------------
# normalize
# ----------------------------------------------------------------------------------------


def test_regression_zero_vector_gradient():
    x = torch.zeros(2, 3, requires_grad=True)
    F.normalize(x)[:, 0].sum().backward()
    assert x.grad.abs().max() == 1e12  # torch's 1/eps
    out, g = _grad(SF.normalize, torch.zeros(2, 3))
    assert (out == 0).all() and (g == 0).all()


@pytest.mark.parametrize("scale", [1e20, 3e38 / 2, 1e-30, 1e-40])
@pytest.mark.parametrize("p", PS)
def test_exact_unit_vector_at_extreme_magnitudes(scale, p):
    base = np.array([[1.0, 2.0, -2.0], [0.5, 0.0, 1.0]])
    x = torch.tensor(base * scale, dtype=torch.float32)
    ref = _ref_unit(x.double().numpy(), p, 1)
    out, g = _grad(SF.normalize, x, p, 1)
    torch.testing.assert_close(out.double(), torch.from_numpy(ref), rtol=3e-7, atol=0.0)
    # the gradient is of order 1/‖x‖: at 1e-40 that (1e40) is past float32's range
    assert torch.isfinite(g).all() if scale > 1e-38 else not torch.isnan(g).any()
    # the unit vectors do not depend on the magnitude
    torch.testing.assert_close(out, SF.normalize(torch.tensor(base, dtype=torch.float32), p, 1))


@settings(max_examples=60)
@given(st.sampled_from(PS), st.integers(1, 4), st.integers(1, 5), st.data())
def test_matches_float64_reference(p, rows, cols, data):
    x = data.draw(tensors((rows, cols), torch.float32))
    out = SF.normalize(x, p, 1)
    ref = torch.from_numpy(_ref_unit(x.double().numpy(), p, 1))
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    # gradient of Σ w·y against torch's own float64 F.normalize (eps = 0) on the nonzero rows
    w = torch.linspace(-1, 1, rows * cols).reshape(rows, cols)
    _, g = _grad(SF.normalize, x, p, 1, w=w)
    xd = x.double()
    # rows whose gradient scale 1/‖x‖ is a normal float32 (elsewhere the gradient is 0 or
    # ±inf, the rounding of a value float32 cannot hold, never NaN)
    n_all = torch.linalg.vector_norm(xd, p, 1)
    nz = (n_all > 1e-38) & (n_all < 1e38)
    assert not torch.isnan(g).any()
    _, g_ref = _grad(lambda t: F.normalize(t, p, 1, eps=0.0), xd[nz], w=w[nz].double())
    n = torch.linalg.vector_norm(xd[nz], p, 1, keepdim=True)
    torch.testing.assert_close((g[nz].double() * n), g_ref * n, rtol=1e-4, atol=1e-4)
    assert (g[n_all == 0] == 0).all()


@settings(max_examples=40)
@given(st.sampled_from([1.0, 2.0, INF]), st.sampled_from([1e-12, 1e-3, 1.0, 5.0]),
       tensors((3, 4), torch.float32, elements=finite_floats(torch.float32, max_abs=1e6)))
def test_equals_torch_with_positive_eps(p, eps, x):
    ours = _grad(SF.normalize, x, p, 1, eps, w=torch.arange(12.0).reshape(3, 4))
    theirs = _grad(F.normalize, x, p, 1, eps, w=torch.arange(12.0).reshape(3, 4))
    torch.testing.assert_close(ours[0], theirs[0])
    n = torch.linalg.vector_norm(x.double(), p, 1, keepdim=True).clamp_min(eps)
    torch.testing.assert_close(ours[1] * n, theirs[1] * n, rtol=1e-5, atol=1e-4)


def test_nan_and_inf_propagate_per_vector():
    x = torch.tensor([[NAN, 1.0], [INF, 1.0], [3.0, 4.0]])
    out, g = _grad(SF.normalize, x)
    assert torch.isnan(out[:2]).all() and torch.isnan(g[:2]).all()
    torch.testing.assert_close(out[2], torch.tensor([0.6, 0.8]))
    for eps in (1e-12, 10.0):  # the eps clamp does not hide the NaN either (F.normalize: all NaN)
        out, g = _grad(SF.normalize, x, 2.0, 1, eps)
        assert torch.isnan(out[0]).all() and torch.isnan(g[0]).all()
        assert torch.isnan(F.normalize(x, eps=eps)[0]).all()


def test_dims_scalar_empty_and_dtypes(dtype):
    x = torch.randn(2, 3, 4, dtype=dtype) * 300  # float16 squares overflow past 256
    for dim in (0, 1, -1):
        out = SF.normalize(x, dim=dim)
        assert out.dtype == dtype
        ref = _ref_unit(x.double().numpy(), 2.0, dim)
        torch.testing.assert_close(out.double(), torch.from_numpy(ref), **tol(dtype))
    assert SF.normalize(torch.tensor(-2.0), dim=0).item() == -1.0
    assert SF.normalize(torch.empty(2, 0)).shape == (2, 0)


def test_gradcheck_gradgradcheck_forward_ad():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    for p in PS:
        for eps in (0.0, 1.5):
            fn = lambda t, p=p, eps=eps: SF.normalize(t, p, 1, eps)  # noqa: E731
            assert gradcheck(fn, (x,), check_batched_grad=True, check_forward_ad=True)
            assert gradgradcheck(fn, (x,), check_batched_grad=True)


def test_jacfwd_matches_torch_and_jvp_defined_at_zero():
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(torch.func.jacfwd(SF.normalize)(x),
                               torch.func.jacfwd(lambda t: F.normalize(t, eps=0.0))(x))
    z = torch.zeros(2, 3, dtype=torch.float64)
    out, tangent = torch.func.jvp(SF.normalize, (z,), (torch.ones_like(z),))
    assert (out == 0).all() and (tangent == 0).all()
    hess = torch.func.hessian(lambda t: SF.normalize(t, dim=0).sum())(torch.zeros(3, dtype=torch.float64))
    assert (hess == 0).all()


def test_second_derivative_finite_at_zero_vector():
    x = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.arange(6.0).reshape(2, 3)
    (g,) = torch.autograd.grad((SF.normalize(x) * w).sum(), x, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), x)
    assert (g == 0).all() and torch.isfinite(h).all()


def test_vmap():
    x = torch.randn(5, 4, dtype=torch.float64)
    batched = torch.func.vmap(lambda r: SF.normalize(r, dim=0))(x)
    torch.testing.assert_close(batched, F.normalize(x, dim=1, eps=0))
    x[2] = 0
    g = torch.func.vmap(torch.func.grad(lambda r: SF.normalize(r, dim=0)[0]))(x)
    assert (g[2] == 0).all() and torch.isfinite(g).all()


# ----------------------------------------------------------------------------------------
# cosine_similarity
# ----------------------------------------------------------------------------------------


def _ref_cos(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    a, b = np.broadcast_arrays(a.double().numpy(), b.double().numpy())
    na = np.linalg.norm(a, axis=dim)
    nb = np.linalg.norm(b, axis=dim)
    dot = (a * b).sum(axis=dim)
    zero = (na == 0) | (nb == 0)
    return torch.from_numpy(np.asarray(np.where(zero, 0.0, dot / np.where(zero, 1.0, na * nb))))


def test_regression_cosine_zero_vector_gradient():
    x = torch.zeros(1, 2, requires_grad=True)
    y = torch.tensor([[1.0, 0.0]], requires_grad=True)
    F.cosine_similarity(x, y).backward()
    assert x.grad.abs().max() == pytest.approx(1e8)
    out = SF.cosine_similarity(x, y)
    gx, gy = torch.autograd.grad(out, (x, y))
    assert out.item() == 0.0 and (gx == 0).all() and (gy == 0).all()
    both = torch.zeros(1, 2, requires_grad=True)
    (g,) = torch.autograd.grad(SF.cosine_similarity(both, both), both)
    assert (g == 0).all()


@pytest.mark.parametrize("scale", [1e20, 6e37, 1e-30])
def test_cosine_exact_at_extreme_magnitudes(scale):
    a = torch.tensor([[3.0, 4.0, 0.0]]) * scale
    b = torch.tensor([[4.0, 3.0, 5.0]]) * scale
    expected = 24.0 / (5.0 * math.sqrt(50.0))
    assert SF.cosine_similarity(a, b).item() == pytest.approx(expected, rel=1e-6)
    rescaled = b * 1e-10 if scale > 1 else b * 1e10
    assert SF.cosine_similarity(a, rescaled).item() == pytest.approx(expected, rel=1e-6)


@settings(max_examples=60)
@given(st.data())
def test_cosine_matches_float64_reference(data):
    shape = data.draw(st.sampled_from([(3, 4), (2, 3, 5), (1, 4)]))
    oshape = data.draw(st.sampled_from([shape, (1,) + shape[1:], shape[1:]]))
    a = data.draw(tensors(shape, torch.float32))
    b = data.draw(tensors(oshape, torch.float32))
    dim = data.draw(st.integers(-1, -1) if len(oshape) < len(shape) else st.integers(0, len(shape) - 1))
    out = SF.cosine_similarity(a, b, dim)
    torch.testing.assert_close(out.double(), _ref_cos(a, b, dim), rtol=1e-5, atol=1e-6)
    x = a.clone().requires_grad_()
    (g,) = torch.autograd.grad(SF.cosine_similarity(x, b, dim).sum(), x)
    assert not torch.isnan(g).any()  # of order 1/‖x‖: ±inf only where that overflows float32


def test_cosine_parity_with_torch_default_eps(dtype):
    a = torch.randn(3, 1, 6, dtype=dtype)
    b = torch.randn(4, 6, dtype=dtype)
    ours = SF.cosine_similarity(a, b, -1, 1e-8)
    theirs = F.cosine_similarity(a, b, -1, 1e-8)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape == (3, 4)
    torch.testing.assert_close(ours.double(), _ref_cos(a, b, -1).reshape(3, 4), **tol(dtype))
    if dtype in (torch.float32, torch.float64):
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        x2, y2 = a.clone().requires_grad_(), b.clone().requires_grad_()
        gx, gy = torch.autograd.grad(SF.cosine_similarity(x, y, -1, 1e-8).sum(), (x, y))
        rx, ry = torch.autograd.grad(F.cosine_similarity(x2, y2, -1, 1e-8).sum(), (x2, y2))
        torch.testing.assert_close(theirs, ours)
        torch.testing.assert_close(gx, rx)
        torch.testing.assert_close(gy, ry)
    assert SF.cosine_similarity(a.half(), b.float()).dtype == F.cosine_similarity(a.half(), b.float()).dtype


def test_cosine_nan_propagates():
    a = torch.tensor([[NAN, 1.0], [1.0, 2.0]])
    b = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    out = SF.cosine_similarity(a, b)
    assert torch.isnan(out[0]) and out[1] == 0


def test_cosine_gradcheck_jvp_vmap():
    a = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    fn = lambda x, y: SF.cosine_similarity(x, y, -1)  # noqa: E731
    assert gradcheck(fn, (a, b), check_batched_grad=True, check_forward_ad=True)
    assert gradgradcheck(fn, (a, b), check_batched_grad=True)
    tangents = (torch.randn(3, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64))
    ours = torch.func.jvp(fn, (a.detach(), b.detach()), tangents)
    primals = (a.detach(), b.detach())
    theirs = torch.func.jvp(lambda x, y: F.cosine_similarity(x, y, -1, 0.0), primals, tangents)
    torch.testing.assert_close(ours, theirs)
    batched = torch.func.vmap(lambda r: fn(r, b.detach()))(a.detach())
    torch.testing.assert_close(batched, F.cosine_similarity(a.detach(), b.detach(), -1))


def test_errors_name_function_and_argument():
    x = torch.randn(2, 3)
    with pytest.raises(TypeError, match="normalize: input must be a floating-point tensor"):
        SF.normalize(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="normalize: p must be a number or inf, got nan"):
        SF.normalize(x, p=NAN)
    with pytest.raises(TypeError, match="normalize: p must be a float"):
        SF.normalize(x, p="fro")
    with pytest.raises(ValueError, match="normalize: eps must be >= 0, got -1"):
        SF.normalize(x, eps=-1.0)
    with pytest.raises(IndexError, match="normalize: dim out of range"):
        SF.normalize(x, dim=2)
    with pytest.raises(TypeError, match="cosine_similarity: x2 must be a torch.Tensor, got list"):
        SF.cosine_similarity(x, [1.0])
    with pytest.raises(ValueError, match="cosine_similarity: eps must be >= 0"):
        SF.cosine_similarity(x, x, eps=-1e-8)
    with pytest.raises(RuntimeError, match=r"cosine_similarity: the shapes of x1 \(2, 3\) and x2 \(4,\)"):
        SF.cosine_similarity(x, torch.ones(4))
    with pytest.raises(IndexError, match="cosine_similarity: dim out of range"):
        SF.cosine_similarity(x, x, dim=-3)
    assert sl.normalize is SF.normalize and sl.cosine_similarity is SF.cosine_similarity


@pytest.mark.slow
def test_compile_fullgraph():
    a = torch.tensor([[0.0, 0.0, 0.0], [1e20, 2e20, 0.0], [1.0, -2.0, 0.5]])
    b = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [0.5, 0.5, 1.0]])

    def f(x):
        return SF.normalize(x).sum() + SF.cosine_similarity(x, b).sum()

    assert (assert_compiled_matches_eager(f, a)[0] == 0).all()


@pytest.mark.parametrize("p", [0.5, 0.0, -1.0])
def test_exponents_below_one_are_torchs_formula(p):
    # F.normalize accepts them (OpInfo samples use p = 0.5, 0, -1); 0.2 raised ValueError
    x = torch.randn(1, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    ours = SF.normalize(x, p=p, dim=1, eps=1e-12)
    ref = torch.nn.functional.normalize(x, p=p, dim=1)
    torch.testing.assert_close(ours, ref)
    w = torch.randn_like(ref)
    (g,) = torch.autograd.grad((ours * w).sum(), x)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
    torch.testing.assert_close(g, g_ref)
    # eps = 0 (the default): the zero vector is 0 with gradient 0, as for p >= 1
    z = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    out = SF.normalize(z, p=p)
    (gz,) = torch.autograd.grad(out.sum(), z)
    assert (out == 0).all() and (gz == 0).all()


@pytest.mark.parametrize("p", [0.0, -1.0])
def test_exponents_at_most_zero_with_a_zero_entry_are_torchs(p):
    # the norm is 0 although the vector is not: torch divides by its eps (1e-12); the torch-2.6
    # OpInfo bfloat16 sample has such an entry
    x = torch.tensor([[0.0, 2.0, -1.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(SF.normalize(x, p=p), torch.nn.functional.normalize(x, p=p))
