"""safe_div: fill where the divisor is 0, zero gradients there, no overflow in the discarded
branch, broadcasting and promotion as torch.div."""

from __future__ import annotations

import pytest
import torch
from conftest import grad_of
from hypothesis import given
from strategies import broadcast_pair

import stablelosses.functional as SF
from stablelosses import naive as naive_formulas

INF = float("inf")
NAN = float("nan")


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


def test_safe_div_divisor_gradient_sums_before_dividing():
    """d/db Σ a_i / b = -Σ a_i / b² is exactly 0 for a = [x, -x]; with the quotient terms
    divided first, 1/b overflows for a subnormal b and inf - inf gave NaN."""
    a = torch.tensor([1.4013e-45, -1.4013e-45])
    b = torch.tensor([1.4013e-45])
    _, (ga, gb) = grad_of(SF.safe_div, a, b)
    assert torch.equal(gb, torch.zeros(1))
    assert torch.isinf(ga).all()  # 1 / b overflows float32: each term is inf, as torch's


def test_errors_name_the_argument():
    x = torch.randn(2, 3)
    with pytest.raises(TypeError, match="safe_div: fill must be a real number"):
        SF.safe_div(x, x, fill="0")
    with pytest.raises(RuntimeError, match="safe_div: the shapes of input"):
        SF.safe_div(torch.ones(2), torch.ones(3))


@pytest.mark.parametrize("needs", [(True, False), (False, True), (True, True)])
def test_result_edited_in_place_as_torch_div_allows(needs):
    # torch's a / b saves its inputs, so its result may be edited in place before backward;
    # safe_div saves its output only for b's gradient, and then hands back a copy
    a0 = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    b0 = torch.tensor([2.0, 0.0, -4.0], dtype=torch.float64)
    a, b = a0.clone().requires_grad_(needs[0]), b0.clone().requires_grad_(needs[1])
    q = SF.safe_div(a, b)
    q.mul_(3.0)
    (q * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum().backward()
    if needs[0]:
        torch.testing.assert_close(a.grad, torch.tensor([1.5, 0.0, -2.25], dtype=torch.float64))
    if needs[1]:
        torch.testing.assert_close(b.grad, torch.tensor([-0.75, 0.0, -1.6875], dtype=torch.float64))
    torch.testing.assert_close(q.detach(), torch.tensor([1.5, 0.0, -2.25], dtype=torch.float64))


def test_gradient_of_a_alone_saves_no_output_and_copies_nothing():
    # b constant (a normalisation by a count): the backward reads b only, so the result is not
    # saved and the wrapper makes no protective copy (one full pass fewer)
    from stablelosses.bench.traffic import bytes_moved

    a = torch.randn(1000, requires_grad=True)
    b = torch.rand(1000) + 0.5
    names = bytes_moved(lambda: SF.safe_div(a, b)).per_op
    assert "clone" not in names


def test_forward_mode_with_one_tangent_has_no_nan_where_the_quotient_is_infinite():
    # a Function's absent tangent arrives as zeros: 0 · (a / b) was NaN where a / b is infinite
    # (a = inf; b subnormal), where torch's jvp gives the derivative of the operand it has
    x = torch.tensor([float("inf"), 1.0, 2.0], dtype=torch.float64)
    y = torch.tensor([1e308, 1e-320, 4.0], dtype=torch.float64)
    ones = torch.ones(3, dtype=torch.float64)
    _, t = torch.func.jvp(lambda v: SF.safe_div(v, y), (x,), (ones,))
    _, t_ref = torch.func.jvp(lambda v: torch.div(v, y), (x,), (ones,))
    torch.testing.assert_close(t, t_ref)
    _, t = torch.func.jvp(lambda w: SF.safe_div(x[1:], w), (y[1:],), (ones[1:],))
    _, t_ref = torch.func.jvp(lambda w: torch.div(x[1:], w), (y[1:],), (ones[1:],))
    torch.testing.assert_close(t, t_ref)
