"""The six stable ops: values, defined gradients at singular points, parity with torch,
float64 references, NaN propagation, dtypes, devices and composability."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tol
from hypothesis import given
from hypothesis import strategies as st
from strategies import broadcast_pair, finite_floats, logits_with_masks, shaped_tensor
from torch.autograd import gradcheck, gradgradcheck

import stablelosses as sl
import stablelosses.functional as SF
from stablelosses import naive as naive_formulas

INF = float("inf")
NAN = float("nan")


def grad_of(fn, *inputs, weight=None):
    """Gradient of ``sum(weight * fn(*inputs))`` w.r.t. every input (weights fixed, random)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    w = torch.ones_like(out) if weight is None else weight
    grads = torch.autograd.grad((out * w).sum(), leaves, allow_unused=True)
    return out.detach(), [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


# ----------------------------------------------------------------------------------------
# The exact snippets users post (regression tests)
# ----------------------------------------------------------------------------------------


def test_regression_sqrt_of_mse_of_zero_residual():
    x = torch.randn(8, requires_grad=True)
    naive = naive_formulas.sqrt_mse(x * 0, torch.zeros(8))
    (g_naive,) = torch.autograd.grad(naive, x)
    assert torch.isnan(g_naive).all()  # the bug being fixed
    ours = SF.safe_sqrt(F.mse_loss(x * 0, torch.zeros(8)))
    (g,) = torch.autograd.grad(ours, x)
    assert ours.item() == 0.0
    assert torch.equal(g, torch.zeros(8))


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


def test_regression_where_division_idiom():
    a = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    b = torch.tensor([0.0, 4.0, 0.0], requires_grad=True)
    naive = naive_formulas.where_div(a, b)
    g_naive = torch.autograd.grad(naive.sum(), (a, b))
    assert torch.isnan(g_naive[0]).any()
    out = SF.safe_div(a, b)
    torch.testing.assert_close(out, naive.detach())
    ga, gb = torch.autograd.grad(out.sum(), (a, b))
    assert torch.equal(ga, torch.tensor([0.0, 0.25, 0.0]))
    assert torch.equal(gb, torch.tensor([0.0, -2.0 / 16.0, 0.0]))


# ----------------------------------------------------------------------------------------
# safe_sqrt
# ----------------------------------------------------------------------------------------


def test_safe_sqrt_value_and_defined_gradient(device):
    x = torch.tensor([0.0, 0.25, 4.0, INF, -1.0, NAN], device=device)
    y, (g,) = grad_of(SF.safe_sqrt, x)
    torch.testing.assert_close(y, torch.sqrt(x), equal_nan=True)
    assert g[0].item() == 0.0  # sqrt'(0) defined as 0
    torch.testing.assert_close(g[1:3], 0.5 / torch.sqrt(x[1:3]))
    assert g[3].item() == 0.0  # 1 / (2 sqrt(inf))
    assert torch.isnan(g[4]) and torch.isnan(g[5])  # outside the domain / NaN in: NaN


def test_safe_sqrt_negative_zero():
    y, (g,) = grad_of(SF.safe_sqrt, torch.tensor([-0.0]))
    assert y.item() == 0.0 and g.item() == 0.0


@given(shaped_tensor(torch.float32, elements=finite_floats(torch.float32).map(abs)))
def test_safe_sqrt_no_nan_gradient_from_nonneg_input(x):
    y, (g,) = grad_of(SF.safe_sqrt, x)
    assert torch.isfinite(y).all()
    assert torch.isfinite(g).all()
    ref = 0.5 / torch.sqrt(x.double())
    ref[x == 0] = 0
    finite = torch.isfinite(ref.float())
    torch.testing.assert_close(g[finite].double(), ref[finite], rtol=1e-6, atol=0)


def test_safe_sqrt_integer_input_promotes_like_torch():
    x = torch.tensor([4, 9])
    assert SF.safe_sqrt(x).dtype == torch.sqrt(x).dtype
    torch.testing.assert_close(SF.safe_sqrt(x), torch.sqrt(x))


# ----------------------------------------------------------------------------------------
# safe_div
# ----------------------------------------------------------------------------------------


def test_safe_div_value_fill_and_nan(device):
    a = torch.tensor([1.0, -2.0, 0.0, NAN, INF, 6.0], device=device)
    b = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 3.0], device=device)
    out = SF.safe_div(a, b, fill=7.0)
    assert out[:3].tolist() == [7.0, 7.0, 7.0]
    assert torch.isnan(out[3])  # a NaN input is never hidden
    assert out[4].item() == 7.0
    assert out[5].item() == 2.0


def test_safe_div_gradients_zero_where_divisor_zero(device):
    a = torch.tensor([1.0, 0.0, 5.0, -3.0], device=device)
    b = torch.tensor([0.0, 0.0, 2.0, -0.0], device=device)
    _, (ga, gb) = grad_of(SF.safe_div, a, b)
    assert ga[[0, 1, 3]].eq(0).all() and gb[[0, 1, 3]].eq(0).all()
    assert ga[2].item() == 0.5 and gb[2].item() == -5.0 / 4.0


def test_safe_div_gradient_of_discarded_branch_no_overflow():
    # a / b² overflows float32 here; the quotient form does not.
    a = torch.tensor([1e20])
    b = torch.tensor([1e-10])
    _, (ga, gb) = grad_of(SF.safe_div, a, b, weight=torch.tensor([1e-30]))
    assert torch.isfinite(gb).all()
    expected = -1e-30 * (1e20 / 1e-10) / 1e-10
    torch.testing.assert_close(gb.double(), torch.tensor([expected], dtype=torch.float64), rtol=1e-6, atol=0)


@given(broadcast_pair(torch.float32, max_abs=1e30))
def test_safe_div_matches_float64_reference(pair):
    a, b = pair
    out, (ga, gb) = grad_of(SF.safe_div, a, b)
    a64, b64 = a.double(), b.double()
    zero = b64 == 0
    q = torch.where(zero, torch.zeros_like(b64), a64 / torch.where(zero, 1.0, b64))
    ref_out = torch.broadcast_to(q, out.shape)
    finite = torch.isfinite(ref_out.float())
    torch.testing.assert_close(out[finite].double(), ref_out[finite], rtol=1e-6, atol=1e-30)
    assert not torch.isnan(out).any()
    # gradients: g/b summed over broadcasting; defined 0 where b == 0
    ref_terms = torch.where(zero, 0.0, 1 / torch.where(zero, 1.0, b64))
    ref_ga = torch.broadcast_to(ref_terms, out.shape).sum_to_size(a.shape)
    if torch.isfinite(out).all():  # once a / b overflows, +inf and -inf terms may meet in the sum
        assert not torch.isnan(gb).any()
    if torch.isfinite(ref_terms.float()).all():  # else 1/b overflows float32 and ±inf may meet
        assert not torch.isnan(ga).any()
        ok = torch.isfinite(ref_ga.float())
        # a float32 sum of k terms of mixed sign is exact to ~k·eps·Σ|terms|, not to eps·|Σ|:
        # the bound scales with the terms' magnitude where they cancel
        ref_abs = torch.broadcast_to(ref_terms.abs(), out.shape).sum_to_size(a.shape)
        k = out.numel() // max(a.numel(), 1)
        bound = 1e-5 * ref_ga.abs() + (k + 1) * 2.0**-23 * ref_abs + 1e-30
        assert ((ga.double() - ref_ga).abs()[ok] <= bound[ok]).all()


def test_safe_div_broadcasting_and_scalars():
    a = torch.randn(3, 1, requires_grad=True)
    b = torch.tensor([0.0, 2.0, 4.0], requires_grad=True)
    out = SF.safe_div(a, b)
    assert out.shape == (3, 3)
    ga, gb = torch.autograd.grad(out.sum(), (a, b))
    assert ga.shape == a.shape and gb.shape == b.shape
    torch.testing.assert_close(SF.safe_div(a, 2.0), a / 2.0)
    torch.testing.assert_close(SF.safe_div(1.0, b), torch.tensor([0.0, 0.5, 0.25]))
    # integers promote as torch.div does
    assert SF.safe_div(torch.tensor([3]), torch.tensor([2])).dtype == torch.div(torch.tensor([3]), torch.tensor([2])).dtype
    assert SF.safe_div(torch.ones(2, dtype=torch.float16), 2.0).dtype == torch.float16


# ----------------------------------------------------------------------------------------
# xlogy
# ----------------------------------------------------------------------------------------


def test_xlogy_value_matches_torch_everywhere(device):
    vals = torch.tensor([0.0, 1e-45, 0.5, 1.0, 3.0, INF, -1.0, NAN], device=device)
    x, y = torch.meshgrid(vals, vals, indexing="ij")
    torch.testing.assert_close(SF.xlogy(x, y), torch.special.xlogy(x, y), equal_nan=True)


def test_xlogy_defined_gradients(device):
    x = torch.tensor([0.0, 0.0, 2.0, 0.0], device=device)
    y = torch.tensor([0.0, 3.0, 0.5, NAN], device=device)
    _, (gx, gy) = grad_of(SF.xlogy, x, y)
    assert gx[0].item() == 0.0 and gy[0].item() == 0.0  # 0·log 0
    torch.testing.assert_close(gx[1], torch.log(y[1]))  # log y where only x == 0
    assert gy[1].item() == 0.0
    torch.testing.assert_close(gx[2], torch.log(y[2]))
    torch.testing.assert_close(gy[2], x[2] / y[2])
    assert torch.isnan(gx[3])  # NaN in, NaN out


@given(broadcast_pair(torch.float64, elements=st.one_of(st.just(0.0), st.floats(1e-30, 1e4))))
def test_xlogy_probability_gradients_finite(pair):
    x, y = pair
    out, (gx, gy) = grad_of(SF.xlogy, x, y)
    assert not torch.isnan(out).any()
    assert not torch.isnan(gx).any() and not torch.isnan(gy).any()
    # where the value is finite (y > 0, or x == 0) both gradients are finite
    xb, yb = torch.broadcast_tensors(x, y)
    if ((yb > 0) | (xb == 0)).all():
        assert torch.isfinite(gx).all() and torch.isfinite(gy).all()


# ----------------------------------------------------------------------------------------
# logsumexp
# ----------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------
# softmax / log_softmax
# ----------------------------------------------------------------------------------------


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


def test_half_precision_softmax_computed_in_float32():
    # float16 logits whose exp overflows float16 (> 65504) but whose softmax is exact
    x = torch.tensor([12.0, 11.0, -3.0], dtype=torch.float16)
    y = SF.softmax(x, 0)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), 0), **tol(torch.float16))


def test_autocast_output_dtypes_match_builtins():
    x = torch.randn(4, 5, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for name, (ours, ref) in OPS_UNARY.items():
            assert ours(x).dtype == ref(x).dtype, name


# ----------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------


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
    with pytest.raises(TypeError, match="safe_div: fill must be a real number"):
        SF.safe_div(x, x, fill="0")
    with pytest.raises(TypeError, match="safe_sqrt: input must be a torch.Tensor"):
        SF.safe_sqrt(4.0)
    with pytest.raises(RuntimeError, match="safe_div: the shapes of input"):
        SF.safe_div(torch.ones(2), torch.ones(3))
    with pytest.raises(TypeError, match="xlogy: input or other must be a torch.Tensor"):
        SF.xlogy(1.0, 2.0)


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


def test_safe_div_of_two_numbers_returns_a_tensor_like_torch_div():
    """torch.div(number, number) is a tensor of the default dtype; so is ours."""
    for a, b in [(1, 2), (3.0, 4), (True, 2), (-1, 8.0)]:
        got, expected = SF.safe_div(a, b), torch.div(a, b)
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and got.device == expected.device
        torch.testing.assert_close(got, expected)
    assert torch.equal(SF.safe_div(1, 0), torch.tensor(0.0))
    assert torch.equal(SF.safe_div(1.0, 0, fill=7.0), torch.tensor(7.0))
    with pytest.raises(TypeError, match="xlogy: input or other must be a torch.Tensor"):
        SF.xlogy(2, 3)  # as torch.special.xlogy, which has no (Number, Number) overload


def test_xlogy_input_gradient_at_zero_matches_torch():
    """d/dx xlogy(x, y) at x == 0 is 0 where y <= 0 and log y where y > 0, as torch."""
    x = torch.zeros(4, dtype=torch.float64)
    y = torch.tensor([-1.0, 0.0, 2.0, -0.0], dtype=torch.float64)
    _, (g, _) = grad_of(SF.xlogy, x, y)
    _, (g_torch, _) = grad_of(torch.special.xlogy, x, y)
    assert torch.equal(g, g_torch)
    assert torch.equal(g, torch.tensor([0.0, 0.0, math.log(2.0), 0.0], dtype=torch.float64))


def test_safe_div_divisor_gradient_sums_before_dividing():
    """d/db Σ a_i / b = -Σ a_i / b² is exactly 0 for a = [x, -x]; with the quotient terms
    divided first, 1/b overflows for a subnormal b and inf - inf gave NaN."""
    a = torch.tensor([1.4013e-45, -1.4013e-45])
    b = torch.tensor([1.4013e-45])
    _, (ga, gb) = grad_of(SF.safe_div, a, b)
    assert torch.equal(gb, torch.zeros(1))
    assert torch.isinf(ga).all()  # 1 / b overflows float32: each term is inf, as torch's

