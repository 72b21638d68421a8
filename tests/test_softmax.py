"""The softmax family (softmax, log_softmax, logsumexp): limits on ±inf and masked slices,
parity with torch and float64 references, the mask= argument, scalars and the dtype argument."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from conftest import grad_of, tol, value_and_grad
from hypothesis import given
from hypothesis import strategies as st
from strategies import logits_with_masks

import stablelosses.functional as SF
from stablelosses import naive as naive_formulas

INF = float("inf")
NAN = float("nan")


def test_regression_exp_over_sum_of_exp():
    z = torch.tensor([92.0, 1.0], requires_grad=True)
    naive = naive_formulas.exp_softmax(z, 0)
    assert torch.isnan(naive).any()
    ours = SF.softmax(z, 0)
    ref = torch.softmax(z.detach().double(), 0)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=1e-44)  # exp(-91) is subnormal in float32
    (g,) = torch.autograd.grad(ours[0], z)
    assert torch.isfinite(g).all()


@pytest.mark.parametrize(
    "row, expected",
    [([1000.0, 500.0, 500.0], [1.0, 0.0, 0.0]), ([-1000.0, -1000.0, -1000.0], [1 / 3] * 3)],
)
def test_regression_softmax_large_logits(row, expected):
    x = torch.tensor(row, requires_grad=True)
    y = SF.softmax(x, 0)
    torch.testing.assert_close(y, torch.tensor(expected))
    (g,) = torch.autograd.grad((y * torch.tensor([1.0, 2.0, 3.0])).sum(), x)
    assert torch.isfinite(g).all()


def test_regression_fully_neg_inf_row():
    x = torch.tensor([[0.5, -1.0, 2.0], [-INF, -INF, -INF]], requires_grad=True)
    assert torch.isnan(torch.softmax(x, -1)[1]).all()
    y = SF.softmax(x, -1)
    assert torch.equal(y[1], torch.zeros(3))
    torch.testing.assert_close(y[0], torch.softmax(x[0].detach(), -1))
    (g,) = torch.autograd.grad((y * torch.randn(2, 3)).sum(), x)
    assert torch.equal(g[1], torch.zeros(3))
    assert torch.isfinite(g).all()


def test_logsumexp_limits(device):
    x = torch.tensor(
        [[1.0, 2.0, 3.0], [-INF, -INF, -INF], [INF, 0.0, INF], [INF, -INF, 5.0], [NAN, 1.0, 2.0]],
        device=device,
    )
    y, (g,) = grad_of(lambda t: SF.logsumexp(t, 1), x)
    torch.testing.assert_close(y, torch.logsumexp(x, 1), equal_nan=True)
    torch.testing.assert_close(g[0], torch.softmax(x[0], 0))
    assert torch.equal(g[1], torch.zeros(3, device=device))
    assert torch.equal(g[2], torch.tensor([0.5, 0.0, 0.5], device=device))
    assert torch.equal(g[3], torch.tensor([1.0, 0.0, 0.0], device=device))
    assert torch.isnan(g[4]).all()


@given(logits_with_masks(torch.float32, max_abs=1e30), st.booleans())
def test_logsumexp_matches_torch_and_reference(xm, keepdim):
    x, mask = xm
    x = x.masked_fill(~mask, -INF)
    y, (g,) = grad_of(lambda t: SF.logsumexp(t, -1, keepdim), x)
    torch.testing.assert_close(y, torch.logsumexp(x, -1, keepdim))
    assert torch.isfinite(g).all()
    # torch's gradient exp(x - lse) carries lse's rounding error, |lse|·2⁻²⁴; ours is the
    # softmax normalised by its computed sum
    _, (g_torch,) = grad_of(lambda t: torch.logsumexp(t, -1, keepdim), x)
    rows = torch.isfinite(g_torch).all(-1)
    ref = torch.softmax(x.double(), -1).nan_to_num(0.0)
    scale = x.double().abs().masked_fill(~torch.isfinite(x), 0).amax(-1, keepdim=True)
    assert ((g.double() - g_torch.double()).abs()[rows] <= (1e-5 + 4 * 2.0**-24 * scale).expand_as(g)[rows]).all()
    assert ((g.double() - ref).abs() <= 1e-6 + 4 * 2.0**-24 * scale).all()


def test_logsumexp_multiple_dims_and_scalar():
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(SF.logsumexp(x, (0, 2)), torch.logsumexp(x, (0, 2)))
    torch.testing.assert_close(SF.logsumexp(x, [-1, 0], keepdim=True), torch.logsumexp(x, [-1, 0], keepdim=True))
    s = torch.tensor(2.0, requires_grad=True)
    out = SF.logsumexp(s, 0)
    assert out.shape == torch.logsumexp(s, 0).shape
    out.backward()
    assert s.grad.item() == 1.0
    empty = SF.logsumexp(torch.empty(2, 0), 1)
    assert torch.equal(empty, torch.logsumexp(torch.empty(2, 0), 1))


@pytest.mark.parametrize("fn, ref", [(SF.softmax, torch.softmax), (SF.log_softmax, torch.log_softmax)])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_family_parity_with_torch(fn, ref, dim, device):
    x = (torch.randn(4, 5, 6, device=device) * 10).requires_grad_()
    w = torch.randn(4, 5, 6, device=device)
    y, (g,) = grad_of(lambda t: fn(t, dim), x, weight=w)
    y_ref, (g_ref,) = grad_of(lambda t: ref(t, dim), x, weight=w)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(g, g_ref)


def test_softmax_limits(device):
    x = torch.tensor([[INF, 1.0, INF, -INF], [-INF] * 4, [NAN, 0.0, 1.0, 2.0], [3e38, INF, 1.0, 0.0]],
                     device=device)
    y, (g,) = grad_of(lambda t: SF.softmax(t, -1), x, weight=torch.randn(4, 4, device=device))
    assert torch.equal(y[0], torch.tensor([0.5, 0.0, 0.5, 0.0], device=device))
    assert torch.equal(y[1], torch.zeros(4, device=device))
    assert torch.isnan(y[2]).all()
    assert torch.equal(y[3], torch.tensor([0.0, 1.0, 0.0, 0.0], device=device))
    assert torch.isfinite(g[[0, 1, 3]]).all()
    assert torch.equal(g[1], torch.zeros(4, device=device))
    assert torch.isnan(g[2]).all()


def test_log_softmax_limits(device):
    x = torch.tensor([[INF, 1.0, INF], [-INF, -INF, -INF], [0.0, -INF, 1.0]], device=device)
    y, (g,) = grad_of(lambda t: SF.log_softmax(t, -1), x, weight=torch.randn(3, 3, device=device))
    torch.testing.assert_close(y[0], torch.tensor([-math.log(2), -INF, -math.log(2)], device=device))
    assert torch.equal(y[1], torch.full((3,), -INF, device=device))
    torch.testing.assert_close(y[2], torch.log_softmax(x[2], 0))
    assert torch.isfinite(g).all()
    assert torch.equal(g[1], torch.zeros(3, device=device))
    assert g[2, 1].item() == 0.0  # the -inf entry does not move
    # and its incoming gradient does not leak into the others
    w = torch.tensor([0.0, 5.0, 1.0], device=device)
    _, (g2,) = grad_of(lambda t: SF.log_softmax(t, -1), x[2:], weight=w[None])
    _, (g3,) = grad_of(lambda t: SF.log_softmax(t, -1), x[2:], weight=w.masked_fill(w == 5.0, 0)[None])
    assert torch.equal(g2, g3)


@pytest.mark.parametrize("fn, fill", [(SF.softmax, 0.0), (SF.log_softmax, -INF)])
@given(xm=logits_with_masks(torch.float32, max_abs=1e30))
def test_masked_softmax_family_properties(fn, fill, xm):
    x, mask = xm
    w = torch.linspace(-1, 1, x.numel()).reshape(x.shape)
    y, (g,) = grad_of(lambda t: fn(t, -1, mask=mask), x, weight=w)
    assert not torch.isnan(y).any()
    assert torch.isfinite(g).all()
    assert (y[~mask] == fill).all()
    assert (g[~mask] == 0).all()  # masked entries get gradient 0
    rows = mask.any(-1)
    x64 = x.double().masked_fill(~mask, -INF)[rows]
    ref = (torch.softmax if fn is SF.softmax else torch.log_softmax)(x64, -1)
    torch.testing.assert_close(y[rows].double(), ref, rtol=1e-5, atol=1e-6)
    # gradient against the float64 reference, on rows that take part
    xr = x64.clone().requires_grad_()
    # reference: masked outputs are constant, so only unmasked outputs carry the weight
    w_ref = w[rows].double().masked_fill(~mask[rows], 0)
    (gr,) = torch.autograd.grad(((torch.softmax if fn is SF.softmax else torch.log_softmax)(xr, -1)
                                 * w_ref).nan_to_num(0.0).sum(), xr)
    torch.testing.assert_close(g[rows].double(), gr.masked_fill(~mask[rows], 0), rtol=1e-4, atol=1e-5)


def test_mask_equals_masked_fill_and_broadcasts():
    x = torch.randn(2, 3, 4)
    mask = torch.tensor([True, False, True, True])  # broadcast over the leading dims
    torch.testing.assert_close(SF.softmax(x, -1, mask=mask), torch.softmax(x.masked_fill(~mask, -INF), -1))
    torch.testing.assert_close(SF.log_softmax(x, -1, mask=mask),
                               torch.log_softmax(x.masked_fill(~mask, -INF), -1))


def test_softmax_scalar_empty_and_dtype_argument():
    s = torch.tensor(3.0)
    assert torch.equal(SF.softmax(s, 0), torch.softmax(s, 0))
    assert torch.equal(SF.log_softmax(s, -1), torch.log_softmax(s, -1))
    assert SF.softmax(torch.empty(2, 0), 1).shape == (2, 0)
    x = torch.randn(3, 4)
    assert SF.softmax(x, 1, dtype=torch.float64).dtype == torch.float64
    torch.testing.assert_close(SF.log_softmax(x, 1, dtype=torch.float64), torch.log_softmax(x, 1, dtype=torch.float64))


def test_half_precision_softmax_computed_in_float32():
    # float16 logits whose exp overflows float16 (> 65504) but whose softmax is exact
    x = torch.tensor([12.0, 11.0, -3.0], dtype=torch.float16)
    y = SF.softmax(x, 0)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), 0), **tol(torch.float16))


def test_errors_name_the_argument():
    x = torch.randn(2, 3)
    with pytest.raises(TypeError, match="softmax: mask must have dtype torch.bool"):
        SF.softmax(x, -1, mask=torch.ones(2, 3))
    with pytest.raises(TypeError, match="log_softmax: mask must be a bool torch.Tensor"):
        SF.log_softmax(x, -1, mask=[[True] * 3] * 2)
    with pytest.raises(ValueError, match="softmax: mask of shape \\(4,\\) does not broadcast"):
        SF.softmax(x, -1, mask=torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        SF.softmax(x, -1, mask=torch.ones(5, 2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="softmax: input must be a floating-point tensor"):
        SF.softmax(torch.tensor([1, 2]), 0)
    with pytest.raises(TypeError, match="log_softmax: input must be a floating-point tensor"):
        SF.log_softmax(torch.tensor([1, 2]), 0)
    with pytest.raises(IndexError, match="softmax: dim out of range"):
        SF.softmax(x, 2)
    with pytest.raises(IndexError, match="logsumexp: dim out of range"):
        SF.logsumexp(x, -3)
    with pytest.raises(TypeError, match="logsumexp: dim must be an int"):
        SF.logsumexp(x, 1.0)
    with pytest.raises(ValueError, match="logsumexp: dim has repeated"):
        SF.logsumexp(x, (1, -1))


@pytest.mark.parametrize("dim", [(1, -1), [0, 0], ()], ids=str)
def test_logsumexp_repeated_or_empty_dims_raise_torchs_runtime_error(dim):
    x = torch.randn(2, 3)
    with pytest.raises(RuntimeError):
        torch.logsumexp(x, dim)
    with pytest.raises(RuntimeError, match="logsumexp: dim "):
        SF.logsumexp(x, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 1e4, 1e20, 1e30, 1e38])
def test_logsumexp_gradient_is_the_softmax(dtype, scale):
    x = torch.tensor([[-1.0, -1.0], [-1.0, -0.999], [-1.0, -0.5]], dtype=dtype) * scale
    _, g = value_and_grad(lambda z: SF.logsumexp(z, 1), x)
    ref = torch.softmax(x.double(), 1) * torch.linspace(-1.0, 1.0, 3, dtype=torch.float64)[:, None]
    torch.testing.assert_close(g.double(), ref, rtol=4 * torch.finfo(dtype).eps, atol=0)


def test_logsumexp_minus_1e30_gives_one_half():
    x = torch.tensor([-1e30, -1e30], requires_grad=True)
    SF.logsumexp(x, 0).backward()
    assert x.grad.tolist() == [0.5, 0.5]


def test_hessian_of_logsumexp_equals_torch():
    z = torch.randn(6, dtype=torch.float64)
    h = torch.func.hessian(lambda u: SF.logsumexp(u, 0))(z)
    torch.testing.assert_close(h, torch.func.hessian(lambda u: torch.logsumexp(u, 0))(z))


def _mp_logsumexp(values: list[float]) -> float:
    mpmath.mp.dps = 50
    return float(mpmath.log(mpmath.fsum(mpmath.e ** mpmath.mpf(v) for v in values)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "values", [[0.0, -20.0], [0.0, -30.0, -40.0], [1e-3, -17.0], [-0.5, -25.0, -0.5 - 40.0]]
)
def test_logsumexp_rounds_as_torch_and_its_gradient_keeps_the_tail(values, dtype):
    # The bare logsumexp's exact tail would cost two passes over the input more than torch's
    # (1.43x its bytes): its value is torch's own, bit for bit (0 for [0, -20] in float32, where
    # the float64 reference is 2.06e-9); the gradient, a softmax, still carries the small part.
    x = torch.tensor(values, dtype=dtype, requires_grad=True)
    out = SF.logsumexp(x, 0)
    assert torch.equal(out, torch.logsumexp(x.detach(), 0))
    assert abs(out.item() - _mp_logsumexp(values)) <= 4 * torch.finfo(dtype).eps
    out.backward()
    mpmath.mp.dps = 50
    vs = x.detach().tolist()  # the values the tensor holds (1e-3 is not a float32)
    lse = mpmath.log(mpmath.fsum(mpmath.e ** mpmath.mpf(u) for u in vs))
    ref = [float(mpmath.e ** (mpmath.mpf(v) - lse)) for v in vs]
    # a few ulp of each entry (torch's softmax kernel: exp and one division)
    torch.testing.assert_close(x.grad, torch.tensor(ref, dtype=dtype), rtol=8 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("margin", [5.0, 17.0, 25.0, 40.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_softmax_rounds_as_torch_against_mpmath(margin, dtype):
    """The bare log_softmax rounds as torch does (docs/design.md, "Exact tails": the argmax entry's
    ``-log1p(δ)`` would cost a pass over the input more than the budget): torch's bits on a
    finite row; the argmax entry within half an ulp of the rounded shift ``m + log S`` of the
    60-digit reference (0 where ``log(1 + δ)`` rounds to 0), the others within a few ulp."""
    mpmath.mp.dps = 60
    x = torch.tensor([[margin, 0.0, -1.0]], dtype=dtype)
    got = SF.log_softmax(x, 1)
    assert torch.equal(got, torch.log_softmax(x, 1))
    m = mpmath.mpf(margin)
    lse = mpmath.log(mpmath.exp(m) + 1 + mpmath.exp(-1))
    eps = torch.finfo(dtype).eps
    for j, xj in enumerate((m, 0, -1)):
        ref = float(xj - lse)
        bound = eps * margin if j == 0 else 4 * eps * abs(ref)
        assert abs(got[0, j].item() - ref) <= bound, (j, got[0, j].item(), ref)


def test_softmax_forward_is_the_kernel_plus_the_slice_max_and_two_fixes():
    # amax, the constant +inf bound, torch's kernel, and the all-(-inf) slices set to 0 from the
    # max: no per-slice bound (the same bytes; every operator is a kernel launch on a GPU)
    from stablelosses.bench.traffic import bytes_moved

    x = torch.randn(8, 10)
    assert bytes_moved(lambda: SF.softmax(x, -1)).ops <= 5


@pytest.mark.slow
def test_log_softmax_entropy_and_logsumexp_hazard_rows_compiled():
    """Compiled (log-sum-exp of the exact shift, whose row max is 0; logsumexp's softmax from its
    output), the public log-softmax, entropy and logsumexp keep eager's values on every hazard
    row and its gradient where that is finite."""
    inf, nan = float("inf"), float("nan")
    fmin = torch.finfo(torch.float32).min
    x = torch.tensor([[0.5, -inf, 2.0, 1.0], [inf, 0.0, inf, 1.0], [-inf, -inf, -inf, -inf],
                      [0.5, nan, 1.0, 0.0], [fmin, fmin, -inf, fmin], [3e38, -3e38, 0.0, 1e-30]])
    w, v = torch.linspace(-1.0, 2.0, 4), torch.linspace(0.5, 1.5, 5)

    def f(z):
        return SF.log_softmax(z, 1), SF.entropy(z), SF.logsumexp(z, 1)

    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = torch.compile(f, fullgraph=True)(x1), f(x2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, equal_nan=True)
    rows = [0, 1, 2, 4, 5]  # not the NaN row

    def total(y, h, lse):
        return (y[rows].nan_to_num(0.0, 0.0, 0.0) * w).sum() + h[rows].sum() + (lse[rows] * v).sum()

    (g,) = torch.autograd.grad(total(*got), x1)
    (g_ref,) = torch.autograd.grad(total(*want), x2)
    assert torch.isfinite(g_ref[rows]).all()
    torch.testing.assert_close(g, g_ref, equal_nan=True)
    # logsumexp's own gradient: the softmax with its limits, exact on the finfo.min row
    (gl,) = torch.autograd.grad(torch.compile(lambda z: SF.logsumexp(z, 1)[rows].sum(), fullgraph=True)(x1), x1)
    want_gl = torch.tensor([[0.0, 0, 0, 0], [0.5, 0, 0.5, 0], [0, 0, 0, 0], [1 / 3, 1 / 3, 0, 1 / 3], [1, 0, 0, 0]])
    want_gl[0] = torch.softmax(x[0], 0)
    torch.testing.assert_close(gl[rows], want_gl)
