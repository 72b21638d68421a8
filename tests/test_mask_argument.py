"""The ``mask=`` argument of every loss with a reduction.

References are independent of the masked code path: torch's loss on the selected entries
(``loss[mask]``, or the rows ``input[mask]``) in float64, or torch's ``reduction='none'`` loss
reduced by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from mask_helpers import (
    NAN,
    D,
    _ce_inputs,
    _elementwise_inputs,
    _gen,
    _grad,
    _masked_ref,
    _torch_sigmoid_focal,
)
from strategies import shapes, tensors

import stablelosses as sl
import stablelosses.functional as SF

# kl_div(reduction='mean') warns as torch does; the masked 'mean' is tested on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:reduction. 'mean' divides the total loss:UserWarning")


# --------------------------------------------------------------------------- elementwise losses


ELEMENTWISE = {
    "log_cosh_loss": (
        lambda x, t, red, m: SF.log_cosh_loss(x, t, red, mask=m),
        lambda x, t: torch.log(torch.cosh(x - t)),
    ),
    "sigmoid_focal_loss": (
        lambda x, t, red, m: SF.sigmoid_focal_loss(x, t, reduction=red, mask=m),
        _torch_sigmoid_focal,
    ),
    "kl_div": (
        lambda x, t, red, m: SF.kl_div(x, t, red, mask=m),
        lambda x, t: F.kl_div(x, t, reduction="none"),
    ),
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("mask_shape", [(4, 5), (4, 1), (5,)])
def test_elementwise_value_and_grad(name, reduction, mask_shape):
    ours, ref = ELEMENTWISE[name]
    x, t = _elementwise_inputs(name)
    m = torch.rand(mask_shape, generator=_gen(1)) < 0.6
    got = ours(x, t, reduction, m)
    want = _masked_ref(ref(x, t), m, reduction)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_grad(got, x)[0], _grad(want, x)[0])


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_nan_at_false_entry_does_not_leak(name):
    ours, ref = ELEMENTWISE[name]
    x, t = _elementwise_inputs(name)
    m = torch.ones(4, 5, dtype=torch.bool)
    m[1, 2] = m[3, 0] = False
    xn = x.detach().clone()
    xn[1, 2] = NAN
    xn[3, 0] = math.inf
    xn.requires_grad_()
    tn = t.clone()
    tn[3, 0] = NAN
    for red in ("none", "mean", "sum"):
        got = ours(xn, tn, red, m)
        (gx,) = _grad(got, xn)
        assert torch.isfinite(got).all() and torch.isfinite(gx).all()
        assert gx[1, 2] == 0 and gx[3, 0] == 0
        torch.testing.assert_close(got, _masked_ref(ref(x, t), m, red))
        torch.testing.assert_close(gx, _grad(_masked_ref(ref(x, t), m, red), x)[0])


@pytest.mark.parametrize("name", list(ELEMENTWISE) + ["rmse_loss"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_false_mask_gives_zero_with_zero_grad(name, reduction):
    x, t = _elementwise_inputs(name if name != "rmse_loss" else "log_cosh_loss")
    m = torch.zeros(4, 5, dtype=torch.bool)
    if name == "rmse_loss":
        got = SF.rmse_loss(x, t, reduction, mask=m)
    else:
        got = ELEMENTWISE[name][0](x, t, reduction, m)
    (gx,) = _grad(got, x)
    assert got.item() == 0.0
    assert torch.equal(gx, torch.zeros_like(x))


@pytest.mark.parametrize("name", list(ELEMENTWISE) + ["rmse_loss"])
def test_none_reduction_zero_at_false(name):
    x, t = _elementwise_inputs(name if name != "rmse_loss" else "log_cosh_loss")
    m = torch.rand(4, 5, generator=_gen(2)) < 0.5
    if name == "rmse_loss":
        got = SF.rmse_loss(x, t, "none", eps=0.5, mask=m)
    else:
        got = ELEMENTWISE[name][0](x, t, "none", m)
    assert got.shape == (4, 5)
    assert torch.equal(got[~m], torch.zeros_like(got[~m]))
    (gx,) = _grad(got, x)
    assert torch.equal(gx[~m], torch.zeros_like(gx[~m]))


# --------------------------------------------------------------------------- cross_entropy / focal


@pytest.mark.parametrize("fn", ["cross_entropy", "focal_loss"])
def test_class_all_false_mask_gives_zero(fn):
    x, t, m, w = _ce_inputs(4)
    f = getattr(SF, fn)
    for red in ("mean", "sum"):
        got = f(x, t, weight=w, reduction=red, mask=torch.zeros(7, dtype=torch.bool))
        assert got.item() == 0.0
        assert torch.equal(_grad(got, x)[0], torch.zeros_like(x))
    # only ignored rows kept: 0 with a mask (torch's NaN is for the mask-free call)
    got = f(x, torch.full((7,), -100), reduction="mean", mask=m)
    assert got.item() == 0.0


# --------------------------------------------------------------------------- gradcheck, modules

def test_gradcheck_masked():
    g = _gen(11)
    x = torch.randn(3, 4, generator=g, dtype=D, requires_grad=True)
    y = torch.randn(3, 4, generator=g, dtype=D)
    t = torch.randint(0, 4, (3,), generator=g)
    m = torch.tensor([[True, False, True, True], [False, False, False, False], [True, True, False, True]])
    rows = torch.tensor([True, False, True])
    assert torch.autograd.gradcheck(lambda a: SF.rmse_loss(a, y, eps=0.1, mask=m), (x,))
    assert torch.autograd.gradcheck(lambda a: SF.log_cosh_loss(a, y, "sum", mask=m), (x,))
    assert torch.autograd.gradcheck(lambda a: SF.sigmoid_focal_loss(a, y.sigmoid(), mask=m), (x,))
    assert torch.autograd.gradcheck(lambda a: SF.cross_entropy(a, t, label_smoothing=0.1, mask=rows), (x,))
    assert torch.autograd.gradcheck(lambda a: SF.focal_loss(a, t, mask=rows), (x,))


def _with_layer(cls, w):
    """A fused-loss module whose own output layer holds ``w``."""
    m = cls(w.shape[1], w.shape[0], dtype=w.dtype)
    with torch.no_grad():
        m.linear.weight.copy_(w)
    return m


def test_module_forward_with_mask():
    g = _gen(12)
    x = torch.randn(3, 4, generator=g, dtype=D)
    y = torch.randn(3, 4, generator=g, dtype=D)
    m = torch.rand(3, 4, generator=g) < 0.5
    rows = torch.tensor([True, False, True])
    t = torch.randint(0, 4, (3,), generator=g)
    pairs = [
        (sl.RMSELoss()(x, y, m), SF.rmse_loss(x, y, mask=m)),
        (sl.LogCoshLoss()(x, y, mask=m), SF.log_cosh_loss(x, y, mask=m)),
        (sl.SigmoidFocalLoss(reduction="sum")(x, y.sigmoid(), m),
         SF.sigmoid_focal_loss(x, y.sigmoid(), reduction="sum", mask=m)),
        (sl.KLDivLoss(reduction="batchmean")(x.log_softmax(1), y.softmax(1), m),
         SF.kl_div(x.log_softmax(1), y.softmax(1), "batchmean", mask=m)),
        (sl.CrossEntropyLoss(label_smoothing=0.1)(x, t, rows),
         SF.cross_entropy(x, t, label_smoothing=0.1, mask=rows)),
        (sl.FocalLoss(gamma=1.0)(x, t, mask=rows), SF.focal_loss(x, t, 1.0, mask=rows)),
        (sl.DiceLoss()(x.sigmoid(), (y > 0).to(D), rows),
         SF.dice_loss(x.sigmoid(), (y > 0).to(D), mask=rows)),
        (sl.InfoNCELoss()(x, y, rows), SF.info_nce_loss(x, y, mask=rows)),
        (_with_layer(sl.LinearCrossEntropyLoss, y)(x, t, mask=rows), SF.linear_cross_entropy(x, y, t, mask=rows)),
        (_with_layer(sl.LinearFocalLoss, y)(x, t, rows), SF.linear_focal_loss(x, y, t, mask=rows)),
    ]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the masked module call differs from the unmasked one
    assert not torch.equal(sl.CrossEntropyLoss()(x, t, rows), sl.CrossEntropyLoss()(x, t))


def test_full_mask_equals_no_mask():
    x, t, m, w = _ce_inputs(13)
    ones = torch.ones(7, dtype=torch.bool)
    torch.testing.assert_close(SF.cross_entropy(x, t, w, mask=ones), SF.cross_entropy(x, t, w))
    torch.testing.assert_close(SF.focal_loss(x, t, weight=w, mask=ones), SF.focal_loss(x, t, weight=w))
    y = torch.randn(7, 5, dtype=D)
    for red in ("mean", "sum", "none"):
        torch.testing.assert_close(SF.rmse_loss(x, y, red, mask=ones[:, None]), SF.rmse_loss(x, y, red))


# --------------------------------------------------------------------------- argument errors

Z23 = torch.zeros(2, 3)
I23 = torch.zeros(2, 3, dtype=torch.long)
CALLS = {
    "rmse_loss": (lambda m: SF.rmse_loss(Z23, Z23, mask=m), (2, 3)),
    "log_cosh_loss": (lambda m: SF.log_cosh_loss(Z23, Z23, mask=m), (2, 3)),
    "sigmoid_focal_loss": (lambda m: SF.sigmoid_focal_loss(Z23, Z23, mask=m), (2, 3)),
    "kl_div": (lambda m: SF.kl_div(Z23, Z23, "sum", mask=m), (2, 3)),
    "cross_entropy": (lambda m: SF.cross_entropy(torch.zeros(2, 3, 3), I23, mask=m), (2, 3)),
    "focal_loss": (lambda m: SF.focal_loss(torch.zeros(2, 3, 3), I23, mask=m), (2, 3)),
    "dice_loss": (lambda m: SF.dice_loss(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), dims=2, mask=m), (2, 3)),
    "info_nce_loss": (lambda m: SF.info_nce_loss(torch.ones(2, 3), torch.ones(2, 3), mask=m), (2,)),
    "linear_cross_entropy": (
        lambda m: SF.linear_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(5, 4), I23, mask=m), (2, 3)),
    "linear_focal_loss": (
        lambda m: SF.linear_focal_loss(torch.zeros(2, 3, 4), torch.zeros(5, 4), I23, mask=m), (2, 3)),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_mask_errors(name):
    call, shape = CALLS[name]
    assert torch.isfinite(call(torch.ones(shape, dtype=torch.bool))).all()  # the right mask works
    with pytest.raises(TypeError, match=rf"{name}: mask must have dtype torch.bool .*got torch.float32"):
        call(torch.ones(shape))
    with pytest.raises(TypeError, match=rf"{name}: mask must be a bool torch.Tensor, got list"):
        call([True])
    bad = shape[:-1] + (shape[-1] + 1,)
    with pytest.raises(ValueError, match=rf"{name}: mask of shape \({bad[0]}, ?.*does not broadcast"):
        call(torch.ones(bad, dtype=torch.bool))
    with pytest.raises(ValueError, match=rf"{name}: mask of shape \(7, .*does not broadcast"):
        call(torch.ones((7, *shape), dtype=torch.bool))  # a mask may not grow the loss


def test_mask_is_keyword_only():
    with pytest.raises(TypeError):
        SF.log_cosh_loss(torch.zeros(2), torch.zeros(2), "mean", torch.ones(2, dtype=torch.bool))


# --------------------------------------------------------------------------- compile

@pytest.mark.slow
def test_masked_losses_compile_fullgraph():
    x = torch.randn(4, 3, requires_grad=True)
    y = torch.randn(4, 3)
    y[1] = float("nan")  # masked out
    t = torch.tensor([0, 2, 1, 0])
    m = torch.tensor([True, False, True, True])

    def f(x, y, t, m):
        return (SF.rmse_loss(x, y, mask=m[:, None]) + SF.cross_entropy(x, t, label_smoothing=0.1, mask=m)
                + SF.log_cosh_loss(x, y, "sum", mask=m[:, None]))

    compiled = torch.compile(f, fullgraph=True)
    got, want = compiled(x, y, t, m), f(x, y, t, m)
    torch.testing.assert_close(got, want)
    assert torch.isfinite(want)
    torch.testing.assert_close(_grad(got, x)[0], _grad(want, x)[0])


# --------------------------------------------------------------------------- transforms, dtypes, property

def test_forward_mode_and_vmap_with_mask():
    g = _gen(14)
    x = torch.randn(3, 4, generator=g, dtype=D)
    y = torch.randn(3, 4, generator=g, dtype=D)
    v = torch.randn(3, 4, generator=g, dtype=D)
    m = torch.rand(3, 4, generator=g) < 0.5
    t = torch.tensor([0, 1, 3])
    for f in (
        lambda a: SF.rmse_loss(a, y, mask=m),
        lambda a: SF.log_cosh_loss(a, y, mask=m),
        lambda a: SF.cross_entropy(a, t, mask=m[:, 0]),
        lambda a: SF.kl_div(a, y.softmax(1), "batchmean", mask=m),
    ):
        _, tangent = torch.func.jvp(f, (x,), (v,))
        (gx,) = _grad(f(x.requires_grad_()), x)
        x = x.detach()
        torch.testing.assert_close(tangent, (gx * v).sum())
    got = torch.vmap(lambda a, mm: SF.rmse_loss(a, y[0], mask=mm))(x, m)
    rows = [((x[i] - y[0])[m[i]] ** 2) for i in range(3)]
    want = torch.stack([r.mean().sqrt() if r.numel() else torch.zeros((), dtype=D) for r in rows])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_with_mask(dtype):
    g = _gen(15)
    x = torch.randn(6, 4, generator=g)
    y = torch.randn(6, 4, generator=g)
    t = torch.randint(0, 4, (6,), generator=g)
    m = torch.tensor([True, False, True, True, False, True])
    xh, yh = x.to(dtype), y.to(dtype)
    got = SF.cross_entropy(xh, t, mask=m)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), F.cross_entropy(xh.float()[m], t[m]), atol=1e-2, rtol=1e-2)
    got = SF.rmse_loss(xh, yh, mask=m[:, None])
    assert got.dtype == dtype
    want = torch.sqrt(((xh.float() - yh.float())[m] ** 2).mean())
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


@settings(max_examples=40)
@given(data=st.data())
def test_property_masked_reductions_match_indexing(data):
    shape = data.draw(shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    x = data.draw(tensors(shape, D, max_abs=1e3))
    y = data.draw(tensors(shape, D, max_abs=1e3))
    m = data.draw(tensors(shape, torch.bool, elements=st.booleans()))
    red = data.draw(st.sampled_from(["none", "mean", "sum"]))
    got = SF.log_cosh_loss(x, y, red, mask=m)
    r = (x - y).abs()
    ref_terms = r + torch.log1p(torch.exp(-2 * r)) - math.log(2)  # log cosh, a second formula
    torch.testing.assert_close(got, _masked_ref(ref_terms, m, red))
    got = SF.rmse_loss(x, y, red, mask=m)
    if red == "none":
        want = torch.where(m, (x - y).abs(), 0.0)
    else:
        s = ((x - y)[m] ** 2).sum()
        want = torch.sqrt(s / max(1, int(m.sum())) if red == "mean" else s)
    torch.testing.assert_close(got, want)
