"""The class-index row core: `_bounded`'s bit-level bound, the ±0 rows it must leave alone, and
the operator budget of cross-entropy and focal loss (counted, deterministic)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import stablelosses.functional as SF
from stablelosses._autograd.softmax import _BITS, _bounded
from stablelosses.bench.traffic import bytes_moved

INF = math.inf
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _special(dt: torch.dtype) -> list[float]:
    fi = torch.finfo(dt)
    return [0.0, -0.0, 1.0, -1.0, INF, -INF, fi.max, fi.min, fi.tiny, -fi.tiny]


@pytest.mark.parametrize("dt", _DTYPES)
def test_bounded_is_the_identity_bit_for_bit_on_rows_with_a_finite_max(dt):
    bits = _BITS[dt][0]
    rows = torch.tensor(list(itertools.product(_special(dt), repeat=3)), dtype=dt)
    m = rows.amax(1, keepdim=True)
    out = _bounded(rows, m)
    finite = torch.isfinite(m).squeeze(1)
    # -0.0 beside +0.0 included: the max may be either zero, neither entry moves
    assert torch.equal(out[finite].view(bits), rows[finite].view(bits))
    plus = (m == INF).squeeze(1)
    expected = torch.where(rows[plus] == INF, torch.finfo(dt).max, rows[plus])
    assert torch.equal(out[plus].view(bits), expected.view(bits))
    masked = (m == -INF).squeeze(1)
    assert masked.any() and torch.isfinite(out[masked]).all()


@pytest.mark.parametrize("dt", _DTYPES)
def test_bounded_keeps_nan_rows_nan(dt):
    x = torch.tensor([[float("nan"), 1.0, INF], [2.0, float("nan"), -INF]], dtype=dt)
    out = _bounded(x, x.amax(1, keepdim=True))
    assert torch.isnan(out).any(1).all()


def test_signed_zero_rows_are_ordinary():
    # an all-zero row of logits (zero embeddings in InfoNCE) whose max may come back as -0.0
    x = torch.tensor([[0.0, -0.0], [-0.0, 0.0], [-0.0, -0.0]], requires_grad=True)
    t = torch.tensor([0, 1, 0])
    torch.testing.assert_close(SF.cross_entropy(x, t, reduction="none"),
                               F.cross_entropy(x.detach(), t, reduction="none"))
    SF.cross_entropy(x, t).backward()
    torch.testing.assert_close(x.grad, torch.tensor([[-1.0, 1.0], [1.0, -1.0], [-1.0, 1.0]]) / 6)


def _counted(fn):
    x = torch.randn(64, 10, requires_grad=True)
    t = torch.randint(0, 10, (64,))
    return bytes_moved(lambda: fn(x, t).backward())


@pytest.mark.parametrize(("name", "fn", "budget"), [
    ("cross_entropy", SF.cross_entropy, 36),
    ("focal_loss", lambda x, t: SF.focal_loss(x, t, gamma=2.0), 45),
])
def test_operator_budget(name, fn, budget):
    # every aten operator is a kernel launch on a GPU: forward + backward + the 'mean'
    assert _counted(fn).ops <= budget


def test_bytes_moved_against_torch():
    # fwd+bwd: the row max, the bound, the softmax, the sum of p without p_t, the backward's
    # read and write, against torch's log-softmax, its backward and nll's zero gradient
    x = torch.randn(2048, 1000, requires_grad=True)
    t = torch.randint(0, 1000, (2048,))
    ours = bytes_moved(lambda: SF.cross_entropy(x, t).backward()).total
    ref = bytes_moved(lambda: F.cross_entropy(x, t).backward()).total
    assert ours <= 1.16 * ref
