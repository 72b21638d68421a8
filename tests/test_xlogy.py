"""xlogy: torch.special.xlogy's value everywhere, defined gradients at 0 · log 0."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import grad_of
from hypothesis import given
from hypothesis import strategies as st
from strategies import broadcast_pair

import stablelosses.functional as SF

INF = float("inf")
NAN = float("nan")


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


def test_xlogy_input_gradient_at_zero_matches_torch():
    """d/dx xlogy(x, y) at x == 0 is 0 where y <= 0 and log y where y > 0, as torch."""
    x = torch.zeros(4, dtype=torch.float64)
    y = torch.tensor([-1.0, 0.0, 2.0, -0.0], dtype=torch.float64)
    _, (g, _) = grad_of(SF.xlogy, x, y)
    _, (g_torch, _) = grad_of(torch.special.xlogy, x, y)
    assert torch.equal(g, g_torch)
    assert torch.equal(g, torch.tensor([0.0, 0.0, math.log(2.0), 0.0], dtype=torch.float64))


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="xlogy: input or other must be a torch.Tensor"):
        SF.xlogy(1.0, 2.0)
