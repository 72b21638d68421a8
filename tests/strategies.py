"""Hypothesis strategies: shapes, dtype-matched finite floats and the hazard values.

Hazard values are the points where textbook formulas break: 0, ±inf, ±1e30, ±1e4,
subnormals, all-``-inf`` rows and saturated logits built as logit(p) with p near 0 or 1.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

HAZARDS = [0.0, -0.0, 1e-45, -1e-45, 1e-38, 1e4, -1e4, 1e30, -1e30, 88.0, 89.0, -88.0, 710.0]
INF = float("inf")

_WIDTH = {torch.float16: 16, torch.bfloat16: 32, torch.float32: 32, torch.float64: 64}
_MAX = {torch.float16: 6.0e4, torch.bfloat16: 3.0e38, torch.float32: 3.0e38, torch.float64: 1e300}


def shapes(min_dims: int = 0, max_dims: int = 3, min_side: int = 0, max_side: int = 5):
    """Tensor shapes, scalar and empty included."""
    return st.lists(
        st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims
    ).map(tuple)


def finite_floats(dtype: torch.dtype = torch.float32, max_abs: float | None = None, hazards: bool = True):
    """Finite floats representable in ``dtype``, biased toward the hazard values."""
    bound = _MAX[dtype] if max_abs is None else min(max_abs, _MAX[dtype])
    if _WIDTH[dtype] < 64:  # hypothesis wants bounds exactly representable at this width
        rep = torch.float16 if _WIDTH[dtype] == 16 else torch.float32
        bound = float(torch.tensor(bound, dtype=rep))
    base = st.floats(
        min_value=-bound, max_value=bound, allow_nan=False, allow_infinity=False,
        width=_WIDTH[dtype], allow_subnormal=True,
    )
    if not hazards:
        return base
    hz = [h for h in HAZARDS if abs(h) <= bound]
    return st.one_of(base, st.sampled_from(hz))


def tensors(shape, dtype: torch.dtype = torch.float32, elements=None, max_abs: float | None = None):
    """A tensor of ``shape`` whose entries come from ``elements`` (finite floats by default)."""
    elements = elements if elements is not None else finite_floats(dtype, max_abs)
    n = math.prod(shape)
    return st.lists(elements, min_size=n, max_size=n).map(
        lambda v: torch.tensor(v, dtype=torch.float64).to(dtype).reshape(shape)
    )


@st.composite
def shaped_tensor(draw, dtype: torch.dtype = torch.float32, min_dims: int = 0, max_dims: int = 3,
                  max_abs: float | None = None, elements=None):
    shape = draw(shapes(min_dims, max_dims))
    return draw(tensors(shape, dtype, elements=elements, max_abs=max_abs))


@st.composite
def logits_with_masks(draw, dtype: torch.dtype = torch.float32, max_rows: int = 4, max_cols: int = 6,
                      max_abs: float = 1e4, min_cols: int = 1):
    """(logits, mask): 2-D logits with finite values and hazards, plus a bool mask whose rows
    may be fully False (fully masked rows)."""
    rows = draw(st.integers(1, max_rows))
    cols = draw(st.integers(min_cols, max_cols))
    x = draw(tensors((rows, cols), dtype, max_abs=max_abs))
    mask = draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))
    mask = torch.tensor(mask, dtype=torch.bool).reshape(rows, cols)
    full_masked_row = draw(st.integers(-1, rows - 1))
    if full_masked_row >= 0:
        mask[full_masked_row] = False
    return x, mask


def saturated_logits(dtype: torch.dtype = torch.float32):
    """Logits logit(p) with p extremely close to 0 or 1 (|x| up to 1e4)."""
    return st.one_of(
        st.floats(min_value=15.0, max_value=1e4, width=_WIDTH[dtype]),
        st.floats(min_value=-1e4, max_value=-15.0, width=_WIDTH[dtype]),
    )


@st.composite
def broadcast_pair(draw, dtype: torch.dtype = torch.float32, max_abs: float | None = None, elements=None):
    """Two tensors with broadcast-compatible shapes."""
    shape = draw(shapes(0, 3, 1, 4))
    other = list(shape)
    for i in range(len(other)):
        if draw(st.booleans()):
            other[i] = 1
    drop = draw(st.integers(0, len(other)))
    other = tuple(other[drop:])
    a = draw(tensors(shape, dtype, elements=elements, max_abs=max_abs))
    b = draw(tensors(other, dtype, elements=elements, max_abs=max_abs))
    if draw(st.booleans()):
        a, b = b, a
    return a, b


def assert_first_nan_propagates(fn, x, reduction):
    """A NaN planted at ``x``'s first element makes ``fn(x, 0)``'s first output element and
    the gradient there NaN (NaN in, NaN out)."""
    if x.numel() == 0:
        return
    x = x.clone()
    x.view(-1)[0] = float("nan")
    out, gx, _ = value_and_grads(fn, x, torch.zeros_like(x), reduction=reduction)
    assert torch.isnan(out.view(-1)[0])
    assert torch.isnan(gx.view(-1)[0])


def value_and_grads(fn, x, y, **kw):
    """``fn(x, y, **kw)`` and the gradients of its sum with respect to both operands."""
    x = x.detach().clone().requires_grad_()
    y = y.detach().clone().requires_grad_()
    out = fn(x, y, **kw)
    gx, gy = torch.autograd.grad(out.sum(), (x, y))
    return out.detach(), gx, gy
