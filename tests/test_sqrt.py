"""safe_sqrt: the value of torch.sqrt, a gradient of 0 at 0, integer promotion."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import grad_of
from hypothesis import given
from strategies import finite_floats, shaped_tensor

import stablelosses.functional as SF
from stablelosses import naive as naive_formulas

INF = float("inf")
NAN = float("nan")


def test_regression_sqrt_of_mse_of_zero_residual():
    x = torch.randn(8, requires_grad=True)
    naive = naive_formulas.sqrt_mse(x * 0, torch.zeros(8))
    (g_naive,) = torch.autograd.grad(naive, x)
    assert torch.isnan(g_naive).all()  # the bug being fixed
    ours = SF.safe_sqrt(F.mse_loss(x * 0, torch.zeros(8)))
    (g,) = torch.autograd.grad(ours, x)
    assert ours.item() == 0.0
    assert torch.equal(g, torch.zeros(8))


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


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="safe_sqrt: input must be a torch.Tensor"):
        SF.safe_sqrt(4.0)
