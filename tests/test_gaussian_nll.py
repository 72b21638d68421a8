"""gaussian_nll_loss: torch's value; the variance gradient is the derivative of that value
(exactly 0 below the floor eps, torch's at or above it), never torch's straight-through −5e11."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import stablelosses as sl
import stablelosses.functional as SF


def test_the_issue_input_var_1e_12_residual_1():
    var = torch.tensor([1e-12], requires_grad=True)
    out = SF.gaussian_nll_loss(torch.tensor([1.0]), torch.tensor([0.0]), var)
    expected = 0.5 * (math.log(1e-6) + 1 / 1e-6)  # the clamped value, eps = 1e-6
    assert out.item() == pytest.approx(expected, rel=1e-6)
    out.backward()
    assert var.grad.item() == 0.0
    var_t = var.detach().clone().requires_grad_()
    F.gaussian_nll_loss(torch.tensor([1.0]), torch.tensor([0.0]), var_t).backward()
    assert var_t.grad.item() == pytest.approx(-5.0e11, rel=1e-3)  # torch's straight-through gradient


@settings(max_examples=30, deadline=None)
@given(st.floats(-10, 10), st.floats(0, 10), st.floats(1e-3, 1.0), st.booleans())
def test_value_and_gradients_where_var_is_above_eps_are_torchs(r, v, eps, full):
    x = torch.tensor([r], dtype=torch.float64, requires_grad=True)
    var = torch.tensor([v], dtype=torch.float64, requires_grad=True)
    y = torch.zeros(1, dtype=torch.float64)
    ours = SF.gaussian_nll_loss(x, y, var, full=full, eps=eps)
    theirs = F.gaussian_nll_loss(x, y, var, full=full, eps=eps)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    g_ours = torch.autograd.grad(ours, (x, var))
    g_theirs = torch.autograd.grad(theirs, (x, var))
    assert g_ours[0].item() == pytest.approx(g_theirs[0].item(), rel=1e-12)
    if v >= eps:
        assert g_ours[1].item() == pytest.approx(g_theirs[1].item(), rel=1e-12)
    else:
        assert g_ours[1].item() == 0.0


def test_gradcheck_and_gradgradcheck_at_generic_points():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    var = (torch.rand(3, 2, generator=g, dtype=torch.float64) + 0.1).requires_grad_()
    f = lambda x, y, v: SF.gaussian_nll_loss(x, y, v, reduction="none")  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, y, var), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(f, (x, y, var))


def test_homoscedastic_shapes_and_float_var_as_torch():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    for var in (torch.rand(4, generator=g) + 0.1, torch.rand(4, 1, generator=g) + 0.1):
        torch.testing.assert_close(SF.gaussian_nll_loss(x, y, var), F.gaussian_nll_loss(x, y, var))
    # a float var is the constant variance (compared with the tensor form: an older torch may take no float)
    torch.testing.assert_close(SF.gaussian_nll_loss(x, y, 0.5), F.gaussian_nll_loss(x, y, torch.full_like(x, 0.5)))


def test_nan_in_nan_out():
    out = SF.gaussian_nll_loss(torch.tensor([float("nan")]), torch.zeros(1), torch.ones(1))
    assert torch.isnan(out)
    assert torch.isnan(SF.gaussian_nll_loss(torch.zeros(1), torch.zeros(1), torch.tensor([float("nan")])))


def test_errors_are_torchs_and_name_the_argument():
    with pytest.raises(ValueError, match="gaussian_nll_loss: var has negative entry"):
        SF.gaussian_nll_loss(torch.zeros(2), torch.zeros(2), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="gaussian_nll_loss: var has negative entry"):
        SF.gaussian_nll_loss(torch.zeros(2), torch.zeros(2), -1.0)
    with pytest.raises(ValueError, match="gaussian_nll_loss: var is of incorrect size"):
        SF.gaussian_nll_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(5))
    with pytest.raises(ValueError, match="gaussian_nll_loss: reduction must be"):
        SF.gaussian_nll_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), reduction="avg")


def test_module():
    var = torch.tensor([1e-12, 2.0], requires_grad=True)
    sl.GaussianNLLLoss(full=True)(torch.ones(2), torch.zeros(2), var).backward()
    assert var.grad[0] == 0 and var.grad[1] != 0


@pytest.mark.parametrize("var", [torch.ones(4, 3, dtype=torch.long), torch.ones(4, 3, dtype=torch.bool)])
def test_integer_or_bool_var_is_torchs_runtime_error(var):
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    with pytest.raises(RuntimeError):
        F.gaussian_nll_loss(x, y, var)
    with pytest.raises(RuntimeError, match="gaussian_nll_loss: var"):
        SF.gaussian_nll_loss(x, y, var)
