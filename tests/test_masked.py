"""masked_mean, entropy and the masked reduction: empty masks give 0 with gradient 0."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import assert_compiled_matches_eager, tol
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import logits_with_masks, shapes, tensors
from torch.autograd import gradcheck, gradgradcheck

import stablelosses as sl
import stablelosses.functional as SF
from stablelosses._utils import reduce
from stablelosses.functional._masked import check_mask

INF = float("inf")
NAN = float("nan")


def _grad(fn, x, *args, **kw):
    x = x.detach().clone().requires_grad_()
    out = fn(x, *args, **kw)
    (g,) = torch.autograd.grad(out.sum(), x)
    return out.detach(), g


# ----------------------------------------------------------------------------------------
# masked_mean
# ----------------------------------------------------------------------------------------


def test_regression_empty_mask_is_nan_in_the_idiom():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    mask = torch.tensor([False, False])
    assert torch.isnan((x * mask).sum() / mask.sum())
    out, g = _grad(SF.masked_mean, x, mask)
    assert out.item() == 0.0 and math.copysign(1, out.item()) == 1.0
    assert (g == 0).all()


@st.composite
def _masked_input(draw):
    shape = draw(shapes(1, 3, 1, 4))
    x = draw(tensors(shape, torch.float64, max_abs=1e6))
    mshape = tuple(s if draw(st.booleans()) else 1 for s in shape)
    bits = draw(st.lists(st.booleans(), min_size=math.prod(mshape), max_size=math.prod(mshape)))
    mask = torch.tensor(bits, dtype=torch.bool).reshape(mshape)
    dim = draw(st.one_of(st.none(), st.integers(-len(shape), len(shape) - 1),
                         st.just(tuple(range(len(shape))))))
    keepdim = draw(st.booleans())
    return x, mask, dim, keepdim


@settings(max_examples=60)
@given(_masked_input())
def test_masked_mean_matches_a_loop_over_slices(case):
    x, mask, dim, keepdim = case
    out, g = _grad(SF.masked_mean, x, mask, dim, keepdim)
    xn = x.numpy()
    mn = np.broadcast_to(mask.numpy(), xn.shape)
    axes = tuple(range(xn.ndim)) if dim is None else ((dim,) if isinstance(dim, int) else dim)
    axes = tuple(a % xn.ndim for a in axes)
    total = np.where(mn, xn, 0.0).sum(axis=axes, keepdims=True)
    count = mn.sum(axis=axes, keepdims=True)
    ref = np.where(count > 0, total / np.maximum(count, 1), 0.0)
    ref_g = np.where(mn, 1.0 / np.maximum(count, 1), 0.0)
    if not keepdim:
        ref = ref.squeeze(axes) if axes else ref
    ref = torch.from_numpy(np.asarray(ref)).reshape(out.shape)
    torch.testing.assert_close(out, ref, **tol(torch.float64))
    torch.testing.assert_close(g, torch.from_numpy(np.broadcast_to(ref_g, xn.shape).copy()))


def test_masked_mean_equals_torch_mean_and_indexing():
    x = torch.randn(4, 5)
    full = torch.ones(4, 5, dtype=torch.bool)
    for dim in (None, 0, 1, (0, 1)):
        ours = _grad(SF.masked_mean, x, full, dim)
        theirs = _grad(lambda t, d=dim: t.mean() if d is None else t.mean(d), x)
        torch.testing.assert_close(ours, theirs)
    mask = torch.rand(4, 5) > 0.4
    mask[0, 0] = True
    torch.testing.assert_close(_grad(SF.masked_mean, x, mask), _grad(lambda t: t[mask].mean(), x))


def test_masked_mean_defined_gradient_and_nan_rules():
    x = torch.tensor([[1.0, NAN, 3.0], [NAN, NAN, 5.0]])
    mask = torch.tensor([[True, False, True], [False, False, False]])
    out, g = _grad(SF.masked_mean, x, mask, 1)
    assert out.tolist() == [2.0, 0.0]  # the NaN in a False entry is not read
    assert g.tolist() == [[0.5, 0.0, 0.5], [0.0, 0.0, 0.0]]
    out, g = _grad(SF.masked_mean, x, ~mask, 1)
    assert torch.isnan(out).all()  # a NaN that takes part propagates
    assert g[0].tolist() == [0.0, 1.0, 0.0]  # d mean / d x is 1/count whatever x is


def test_masked_mean_half_precision_and_empty(dtype):
    x = torch.full((3, 300), 100.0, dtype=dtype)  # Σ = 30000·… overflows float16 when summed in it
    x[:, 0] = 60000.0 if dtype == torch.float16 else 1e30
    mask = torch.ones(3, 300, dtype=torch.bool)
    out = SF.masked_mean(x, mask, 1)
    ref = x.double().mean(1)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, **tol(dtype))
    empty = SF.masked_mean(torch.empty(0, 3, dtype=dtype), torch.empty(0, 3, dtype=torch.bool))
    assert empty.item() == 0.0


def test_masked_mean_gradcheck_jvp_vmap():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False, True, True], [False] * 4, [True] * 4])
    fn = lambda t: SF.masked_mean(t, mask, 1)  # noqa: E731
    assert gradcheck(fn, (x,), check_batched_grad=True, check_forward_ad=True)
    assert gradgradcheck(fn, (x,), check_batched_grad=True)
    t = torch.randn(3, 4, dtype=torch.float64)
    _, tangent = torch.func.jvp(fn, (x.detach(),), (t,))
    assert tangent[1] == 0
    torch.testing.assert_close(tangent[0], t[0, [0, 2, 3]].mean())
    batched = torch.func.vmap(lambda r: SF.masked_mean(r, mask[0]))(x.detach())
    torch.testing.assert_close(batched, x.detach()[:, [0, 2, 3]].mean(1))


# ----------------------------------------------------------------------------------------
# entropy
# ----------------------------------------------------------------------------------------


def _ref_entropy(x: torch.Tensor, mask: torch.Tensor | None):
    """Float64 numpy entropy and gradient −p(log p + H), loop over rows, 0·log 0 = 0."""
    xn = x.double().numpy().reshape(-1, x.shape[-1])
    mn = np.ones_like(xn, bool) if mask is None else np.broadcast_to(mask.numpy(), x.shape).reshape(xn.shape)
    hs, gs = [], []
    for row, m in zip(xn, mn):
        keep = m & (row > -np.inf)
        g = np.zeros_like(row)
        if not keep.any():
            hs.append(0.0)
            gs.append(g)
            continue
        z = row[keep] - row[keep].max()
        logp = z - np.log(np.exp(z).sum())
        p = np.exp(logp)
        h = -(p * np.where(p > 0, logp, 0.0)).sum()
        g[keep] = -p * (np.where(p > 0, logp, 0.0) + h)
        hs.append(h)
        gs.append(g)
    return np.array(hs).reshape(x.shape[:-1]), np.stack(gs).reshape(x.shape)


def test_regression_hand_written_entropy_is_nan_with_masked_action():
    x = torch.tensor([[1.0, 2.0, -INF]], requires_grad=True)
    naive = -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)
    assert torch.isnan(naive).all()
    h, g = _grad(SF.entropy, x)
    ref_h, ref_g = _ref_entropy(x.detach(), None)
    torch.testing.assert_close(h.double(), torch.from_numpy(ref_h))
    torch.testing.assert_close(g.double(), torch.from_numpy(ref_g))
    assert g[0, 2] == 0


@settings(max_examples=60)
@given(logits_with_masks(torch.float64, max_abs=1e4))
def test_entropy_matches_float64_reference(case):
    x, mask = case
    h, g = _grad(SF.entropy, x, mask=mask)
    ref_h, ref_g = _ref_entropy(x, mask)
    torch.testing.assert_close(h, torch.from_numpy(ref_h), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(g, torch.from_numpy(ref_g), rtol=1e-9, atol=1e-12)
    assert (g[~mask.expand(x.shape)] == 0).all()


def test_entropy_defined_values_at_hazards():
    x = torch.tensor([[-INF, -INF, -INF], [INF, INF, 0.0], [INF, -INF, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([True, True, True])
    h, g = _grad(SF.entropy, x, mask=mask)
    assert h[0].item() == 0.0 and math.copysign(1, h[0].item()) == 1.0
    assert h[1].item() == pytest.approx(math.log(2))
    assert h[2].item() == 0.0
    assert torch.isfinite(g).all() and (g[:3] == 0).all()
    h, g = _grad(SF.entropy, torch.randn(2, 4), mask=torch.zeros(4, dtype=torch.bool))
    assert (h == 0).all() and (g == 0).all()


def test_entropy_nan_propagates_but_masked_nan_does_not():
    x = torch.tensor([[NAN, 1.0, 2.0]])
    h, g = _grad(SF.entropy, x)
    assert torch.isnan(h).all() and torch.isnan(g).all()
    h, g = _grad(SF.entropy, x, mask=torch.tensor([False, True, True]))
    assert torch.isfinite(h).all() and g[0, 0] == 0


def test_entropy_parity_with_torch_distributions(dtype):
    x = torch.randn(5, 6, dtype=dtype) * 3
    ours = _grad(SF.entropy, x)
    ref = _grad(lambda t: torch.distributions.Categorical(logits=t.double()).entropy(), x.double())
    assert ours[0].dtype == dtype
    torch.testing.assert_close(ours[0].double(), ref[0], **tol(dtype))
    torch.testing.assert_close(ours[1].double(), ref[1], **tol(dtype))
    theirs = _grad(lambda t: torch.distributions.Categorical(logits=t).entropy(), x.float())
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs)


def test_entropy_dim_scalar_and_broadcast_mask():
    x = torch.randn(3, 4, 2)
    torch.testing.assert_close(SF.entropy(x, 1), SF.entropy(x.transpose(1, 2), -1))
    assert SF.entropy(torch.tensor(5.0)).item() == 0.0
    mask = torch.tensor([[True], [False], [True], [True]])
    torch.testing.assert_close(SF.entropy(x, 1, mask=mask), SF.entropy(x[:, [0, 2, 3]], 1))


def test_entropy_gradcheck_forward_ad_and_hessian():
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([True, False, True, True, False])
    for fn in (SF.entropy, lambda t: SF.entropy(t, mask=mask)):
        assert gradcheck(fn, (x,), check_batched_grad=True, check_forward_ad=True)
        assert gradgradcheck(fn, (x,), check_batched_grad=True)
    naive = lambda t: -(torch.softmax(t, -1) * torch.log_softmax(t, -1)).sum()  # noqa: E731
    torch.testing.assert_close(torch.func.hessian(lambda t: SF.entropy(t).sum())(x.detach()),
                               torch.func.hessian(naive)(x.detach()))
    z = torch.tensor([[0.5, -INF, INF, 1.0], [-INF] * 4], dtype=torch.float64)
    out, tangent = torch.func.jvp(SF.entropy, (z,), (torch.ones_like(z),))
    assert torch.isfinite(tangent).all() and (tangent == 0).all()
    (g,) = torch.autograd.grad(SF.entropy(z.requires_grad_()).sum(), z, create_graph=True)
    (hv,) = torch.autograd.grad(g.sum(), z)
    assert torch.isfinite(hv).all()


def test_entropy_vmap_grad():
    x = torch.randn(4, 6, dtype=torch.float64)
    per = torch.func.vmap(torch.func.grad(lambda r: SF.entropy(r)))(x)
    ref = torch.stack([_grad(SF.entropy, r)[1] for r in x])
    torch.testing.assert_close(per, ref)


# ----------------------------------------------------------------------------------------
# reduce (the one reduction of every loss, behind the losses' mask= argument)
# ----------------------------------------------------------------------------------------


def _reduce_masked(loss, mask, reduction):
    return reduce(loss, reduction, mask)


def test_reduce_with_a_mask_each_reduction():
    loss = torch.tensor([[1.0, 2.0, NAN], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, True, False], [False, True, True]])
    for red, expected in (("mean", 14.0 / 4), ("sum", 14.0)):
        out, g = _grad(_reduce_masked, loss, mask, red)
        assert out.item() == expected
        assert (g[~mask] == 0).all() and torch.isfinite(g).all()
    out, g = _grad(_reduce_masked, loss, mask, "none")
    assert out.tolist() == [[1.0, 2.0, 0.0], [0.0, 5.0, 6.0]]
    assert g.tolist() == mask.float().tolist()
    out, g = _grad(_reduce_masked, loss, torch.zeros(3, dtype=torch.bool), "mean")
    assert out.item() == 0.0 and (g == 0).all()
    x = torch.randn(2, 3)
    assert reduce(x, "mean") == x.mean()
    assert reduce(x, "sum") == x.sum()


def test_reduce_weighted_mean_is_zero_over_nothing_only_when_masked():
    ignored = torch.zeros(2)  # every row ignored: loss 0, weight 0
    assert reduce(ignored, "mean", weight=ignored).isnan()  # torch's 0 / 0 for an unmasked mean
    assert reduce(ignored, "mean", weight=ignored, masked=True).item() == 0.0
    loss = torch.tensor([1.0, 2.0])
    assert reduce(loss, "mean", weight=torch.tensor([1.0, 3.0])).item() == 3.0 / 4.0


def test_errors_name_function_and_argument():
    x = torch.randn(2, 3)
    with pytest.raises(TypeError, match="masked_mean: input must be a floating-point tensor"):
        SF.masked_mean(torch.ones(2, dtype=torch.long), torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="masked_mean: mask must have dtype torch.bool"):
        SF.masked_mean(x, torch.ones(2, 3))
    with pytest.raises(TypeError, match="masked_mean: mask must be a bool torch.Tensor"):
        SF.masked_mean(x, [True, False])
    with pytest.raises(ValueError, match=r"masked_mean: mask of shape \(4, 2, 3\) does not broadcast"):
        SF.masked_mean(x, torch.ones(4, 2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="masked_mean: dim has repeated dimensions"):
        SF.masked_mean(x, torch.ones(2, 3, dtype=torch.bool), (0, -2))
    with pytest.raises(IndexError, match="masked_mean: dim out of range"):
        SF.masked_mean(x, torch.ones(2, 3, dtype=torch.bool), 2)
    with pytest.raises(TypeError, match="masked_mean: keepdim must be a bool"):
        SF.masked_mean(x, torch.ones(2, 3, dtype=torch.bool), 0, 1)
    with pytest.raises(TypeError, match="entropy: logits must be a floating-point tensor"):
        SF.entropy(torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"entropy: mask of shape \(3, 1\) does not broadcast to logits"):
        SF.entropy(x, mask=torch.ones(3, dtype=torch.bool).reshape(3, 1))
    with pytest.raises(IndexError, match="entropy: dim out of range"):
        SF.entropy(x, 2)
    with pytest.raises(ValueError, match="my_loss: mask of shape"):
        check_mask("my_loss", torch.ones(3, dtype=torch.bool), torch.Size([2]), "the unreduced loss")
    assert sl.masked_mean is SF.masked_mean and sl.entropy is SF.entropy


@pytest.mark.slow
def test_compile_fullgraph():
    x = torch.tensor([[0.5, -INF, 2.0], [-INF, -INF, -INF]])
    mask = torch.tensor([[True, True, False], [False, False, False]])

    def f(t):
        return SF.entropy(t).sum() + SF.masked_mean(t.nan_to_num(0.0, 0.0, 0.0), mask) \
            + reduce(t.clamp(-5, 5), "sum", mask)

    assert torch.isfinite(assert_compiled_matches_eager(f, x)).all()
