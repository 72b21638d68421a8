"""cross_entropy: parity with F.cross_entropy, masked-class semantics, defined gradients."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_compiled_matches_eager, tol
from hypothesis import given
from hypothesis import strategies as st
from mask_helpers import NAN, D, _ce_inputs, _gen, _grad, _masked_ref, _torch_focal_none
from strategies import logits_with_masks

import stablelosses as sl
import stablelosses.functional as SF

INF = float("inf")
SHAPES = [(5,), (4, 5), (3, 5, 2, 2), (0, 5)]


def _index_target(shape, n_classes, ignore_index=None, gen=None):
    tshape = () if len(shape) == 1 else (shape[0],) + shape[2:]
    t = torch.randint(0, n_classes, tshape)
    if ignore_index is not None and t.numel() > 1:
        t.view(-1)[0] = ignore_index
    return t


def _both(fn_ref, fn_ours, x):
    """Value and gradient (of sum) of both functions at x."""
    out = []
    for fn in (fn_ref, fn_ours):
        xi = x.detach().clone().requires_grad_(True)
        v = fn(xi)
        (g,) = torch.autograd.grad(v.sum(), xi) if v.requires_grad else (torch.zeros_like(xi),)
        out.append((v.detach(), g))
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore_index", [-100, 1])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
def test_parity_class_index(shape, weighted, ignore_index, reduction, label_smoothing):
    x = torch.randn(shape, dtype=torch.float64) * 3
    C = shape[0] if len(shape) == 1 else shape[1]
    t = _index_target(shape, C, ignore_index if ignore_index >= 0 else -100)
    w = torch.rand(C, dtype=torch.float64) + 0.1 if weighted else None
    kw = dict(weight=w, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    (v0, g0), (v1, g1) = _both(lambda z: F.cross_entropy(z, t, **kw), lambda z: SF.cross_entropy(z, t, **kw), x)
    torch.testing.assert_close(v1, v0, equal_nan=True, **tol(torch.float64))
    torch.testing.assert_close(g1, g0, equal_nan=True, **tol(torch.float64))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_parity_probabilities(shape, weighted, reduction, label_smoothing):
    x = torch.randn(shape, dtype=torch.float64) * 3
    cdim = 0 if len(shape) == 1 else 1
    C = shape[cdim]
    y = torch.softmax(torch.randn(shape, dtype=torch.float64), cdim)
    w = torch.rand(C, dtype=torch.float64) + 0.1 if weighted else None
    kw = dict(weight=w, reduction=reduction, label_smoothing=label_smoothing)
    (v0, g0), (v1, g1) = _both(lambda z: F.cross_entropy(z, y, **kw), lambda z: SF.cross_entropy(z, y, **kw), x)
    torch.testing.assert_close(v1, v0, equal_nan=True, **tol(torch.float64))
    torch.testing.assert_close(g1, g0, equal_nan=True, **tol(torch.float64))
    # gradient with respect to the soft target too
    yy = y.clone().requires_grad_(True)
    yr = y.clone().requires_grad_(True)
    (gt1,) = torch.autograd.grad(SF.cross_entropy(x, yy, **kw).sum(), yy)
    (gt0,) = torch.autograd.grad(F.cross_entropy(x, yr, **kw).sum(), yr)
    torch.testing.assert_close(gt1, gt0, **tol(torch.float64))


def test_empty_batch_and_all_ignored_like_torch():
    x = torch.randn(0, 4, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long)
    assert torch.isnan(SF.cross_entropy(x, t)) and torch.isnan(F.cross_entropy(x, t))
    assert SF.cross_entropy(x, t, reduction="sum").item() == 0.0
    assert SF.cross_entropy(x, t, reduction="none").shape == (0,)
    x = torch.randn(3, 4)
    t = torch.full((3,), -100)
    assert torch.isnan(SF.cross_entropy(x, t)) and torch.isnan(F.cross_entropy(x, t))


def test_legacy_size_average_reduce():
    x = torch.randn(4, 3)
    t = torch.tensor([0, 1, 2, 1])
    for sa, rd in itertools.product([None, True, False], repeat=2):
        with pytest.warns(UserWarning) if (sa is not None or rd is not None) else _nullcontext():
            ref = F.cross_entropy(x, t, size_average=sa, reduce=rd)
        torch.testing.assert_close(SF.cross_entropy(x, t, size_average=sa, reduce=rd), ref)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def test_uint8_target_and_module():
    x = torch.randn(4, 3)
    t = torch.tensor([0, 1, 2, 1])
    w = torch.tensor([1.0, 2.0, 0.5])
    ref = F.cross_entropy(x, t, weight=w, label_smoothing=0.1)
    torch.testing.assert_close(SF.cross_entropy(x, t.to(torch.uint8), weight=w, label_smoothing=0.1), ref)
    mod = sl.CrossEntropyLoss(weight=w, label_smoothing=0.1)
    torch.testing.assert_close(mod(x, t), ref)


# ---------------------------------------------------------------- masked classes


def _ref_masked(x, t, eps, w=None):
    """Per-row loss over the unmasked classes, float64, by hand."""
    x = x.double()
    C = x.shape[1]
    w = torch.ones(C, dtype=torch.float64) if w is None else w.double()
    out, den = [], []
    for i in range(x.shape[0]):
        keep = [c for c in range(C) if x[i, c] != -INF]
        if not keep:
            out.append(0.0)
            den.append(0.0)
            continue
        xs = x[i, keep]
        lse = torch.logsumexp(xs, 0)
        logp = {c: (x[i, c] - lse).item() for c in keep}
        nll = -logp.get(int(t[i]), -INF)
        smooth = -sum(w[c].item() * logp[c] for c in keep) / len(keep)
        out.append((1 - eps) * w[t[i]].item() * nll + eps * smooth)
        den.append(w[t[i]].item())
    return torch.tensor(out, dtype=torch.float64), torch.tensor(den, dtype=torch.float64)


@pytest.mark.parametrize("weighted", [False, True])
def test_masked_smoothing_semantics_exact(weighted):
    x = torch.tensor(
        [[2.0, 0.5, -INF, 1.0], [-INF, -INF, 3.0, -1.0], [-INF, -INF, -INF, -INF], [0.1, 0.2, 0.3, 0.4]],
        dtype=torch.float64, requires_grad=True,
    )
    t = torch.tensor([0, 3, 2, 1])
    w = torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64) if weighted else None
    eps = 0.25
    ref, den = _ref_masked(x.detach(), t, eps, w)
    none = SF.cross_entropy(x, t, weight=w, label_smoothing=eps, reduction="none")
    torch.testing.assert_close(none, ref, **tol(torch.float64))
    mean = SF.cross_entropy(x, t, weight=w, label_smoothing=eps)
    torch.testing.assert_close(mean, ref.sum() / den.sum(), **tol(torch.float64))
    mean.backward()
    g = x.grad
    assert torch.isfinite(g).all()
    assert (g[2] == 0).all()  # fully masked row: exactly 0
    assert g[0, 2] == 0 and g[1, 0] == 0 and g[1, 1] == 0  # masked classes: exactly 0
    # unmasked rows: gradient of the hand reference on the unmasked sub-problem
    sub = x.detach()[1, 2:].clone().requires_grad_(True)
    ww = w[2:] if weighted else torch.ones(2, dtype=torch.float64)
    ref_sub = F.cross_entropy(sub[None], torch.tensor([1]), weight=ww, label_smoothing=eps, reduction="sum")
    (gs,) = torch.autograd.grad(ref_sub / den.sum(), sub)
    torch.testing.assert_close(g[1, 2:], gs, **tol(torch.float64))


def test_fully_masked_row_counts_as_ignored():
    x = torch.tensor([[1.0, 2.0, 0.0], [-INF, -INF, -INF]], requires_grad=True)
    t = torch.tensor([1, 0])
    loss = SF.cross_entropy(x, t)
    torch.testing.assert_close(loss, F.cross_entropy(x[:1].detach(), t[:1]))
    loss.backward()
    assert (x.grad[1] == 0).all()
    torch.testing.assert_close(x.grad[0], torch.softmax(x[0].detach(), 0) - torch.tensor([0.0, 1.0, 0.0]))
    assert SF.cross_entropy(x, t, reduction="none")[1].item() == 0.0
    # soft targets: same rule, the mean counts valid rows only
    y = torch.tensor([[0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])
    torch.testing.assert_close(SF.cross_entropy(x.detach(), y), F.cross_entropy(x[:1].detach(), y[:1]))


def test_masked_target_is_inf_with_finite_gradient():
    x = torch.tensor([[-INF, 1.0, 2.0]], requires_grad=True)
    t = torch.tensor([0])
    loss = SF.cross_entropy(x, t)
    assert loss.item() == INF == F.cross_entropy(x.detach(), t).item()
    loss.backward()
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad[0], torch.softmax(x[0].detach(), 0) - torch.tensor([1.0, 0, 0]))


def test_soft_target_zero_mass_on_masked_class():
    x = torch.tensor([[-INF, 1.0, 2.0]], requires_grad=True)
    y = torch.tensor([[0.0, 0.5, 0.5]])
    loss = SF.cross_entropy(x, y)
    assert torch.isnan(F.cross_entropy(x.detach(), y))  # torch: 0 * (-inf)
    ref = -(0.5 * torch.log_softmax(x[0, 1:].detach(), 0)).sum()
    torch.testing.assert_close(loss, ref)
    loss.backward()
    assert x.grad[0, 0] == 0 and torch.isfinite(x.grad).all()


def test_posinf_logits_limit():
    x = torch.tensor([[INF, 1.0, 2.0], [INF, INF, 0.0], [3.0, INF, 0.0]], requires_grad=True)
    t = torch.tensor([0, 0, 0])
    loss = SF.cross_entropy(x, t, reduction="none")
    torch.testing.assert_close(loss[:2], torch.tensor([0.0, 0.6931472]))
    assert loss[2].item() == INF
    loss.sum().backward()
    expect = torch.tensor([[0.0, 0.0, 0.0], [-0.5, 0.5, 0.0], [-1.0, 1.0, 0.0]])
    torch.testing.assert_close(x.grad, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_posinf_row_huge_finite_target_is_infinite(dtype):
    # a finite target just below finfo.max still has probability 0 on a +inf row
    big = torch.finfo(dtype).max
    below = float(torch.nextafter(torch.tensor(big, dtype=dtype), torch.tensor(0.0, dtype=dtype)))
    x = torch.tensor([[INF, below, 1.0]] * 3 + [[INF, INF, -big]], dtype=dtype, requires_grad=True)
    t = torch.tensor([1, 2, 0, 1])
    loss = SF.cross_entropy(x, t, reduction="none")
    assert loss[:2].tolist() == [INF, INF]
    torch.testing.assert_close(loss[2:], torch.tensor([0.0, math.log(2.0)], dtype=dtype))
    loss[[2, 3]].sum().backward()
    expect = torch.tensor([[0.0] * 3] * 3 + [[0.5, -0.5, 0.0]], dtype=dtype)
    torch.testing.assert_close(x.grad, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_posinf_row_smoothing_skips_zero_weight_classes(dtype):
    # +inf rows with label smoothing and class weights [1, 1, 0, 0]: a finite class of weight 1
    # has probability 0 and takes smoothing mass (+inf); a finite class of weight 0 adds
    # 0·(−inf) = 0, never NaN. Reference: torch on the rows with +inf → 1e4 (float64: the same
    # probabilities, exactly 0 and 1/2; the zero-weight terms vanish), where it is finite
    x = torch.tensor([[INF, 0.0, 1.0, 2.0], [INF, INF, 1.0, 2.0], [INF, INF, 1.0, -INF],
                      [INF, 3.0, 0.0, 0.0]], dtype=dtype)
    t = torch.tensor([0, 0, 1, 0])
    w = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=dtype)
    xi = x.clone().requires_grad_(True)
    loss = SF.cross_entropy(xi, t, weight=w, label_smoothing=0.1, reduction="none")
    (g,) = torch.autograd.grad(loss.sum(), xi)
    assert loss[0] == INF and loss[3] == INF
    xs = torch.where(x == INF, 1e4, x).double().requires_grad_(True)
    ref = F.cross_entropy(xs, t, weight=w.double(), label_smoothing=0.1, reduction="none")
    # row 2: the masked class takes no mass (K = 3), which torch's finite stand-in cannot say
    ref2 = 0.9 * math.log(2.0) + 0.1 / 3 * 2 * math.log(2.0)
    torch.testing.assert_close(loss[1:3], torch.tensor([ref[1].item(), ref2], dtype=dtype))
    # the gradient: the limit at every row (the value's +inf adds nothing to it), torch's on
    # the stand-in where no class is masked (row 2: p − q with q's mass ε/3 on the K = 3 classes)
    (gr,) = torch.autograd.grad(ref[[0, 1, 3]].sum(), xs)
    torch.testing.assert_close(g[[0, 1, 3]], gr[[0, 1, 3]].to(dtype))
    torch.testing.assert_close(g[2], torch.tensor([0.45, -0.45, 0.0, 0.0], dtype=dtype))


@given(logits_with_masks(dtype=torch.float32, max_abs=float(torch.tensor(1e30))), st.floats(0.0, 1.0),
       st.booleans(), st.data())
def test_property_no_nan_created(xm, eps, weighted, data):
    x, mask = xm
    x = x.masked_fill(~mask, -INF).requires_grad_(True)
    C = x.shape[1]
    t = torch.tensor(data.draw(st.lists(st.integers(0, C - 1), min_size=x.shape[0], max_size=x.shape[0])))
    w = torch.rand(C) + 0.5 if weighted else None
    loss = SF.cross_entropy(x, t, weight=w, label_smoothing=eps, reduction="sum")
    loss.backward()
    assert not torch.isnan(loss)
    assert torch.isfinite(x.grad).all()
    not_target = torch.ones_like(mask).scatter_(1, t[:, None], False)
    assert (x.grad[~mask & not_target] == 0).all()
    assert (x.grad[~mask.any(1)] == 0).all()
    # where torch is finite, equal
    ref = F.cross_entropy(x.detach().double(), t, weight=None if w is None else w.double(),
                          label_smoothing=eps, reduction="none")
    ours = SF.cross_entropy(x.detach().double(), t, weight=None if w is None else w.double(),
                            label_smoothing=eps, reduction="none")
    fin = torch.isfinite(ref) & mask.all(1)
    torch.testing.assert_close(ours[fin], ref[fin], rtol=1e-9, atol=1e-9)


@given(logits_with_masks(dtype=torch.float32, max_abs=1e4))
def test_property_nan_propagates(xm):
    x, mask = xm
    x = x.masked_fill(~mask, -INF)
    x[0, 0] = float("nan")
    x.requires_grad_(True)
    t = torch.zeros(x.shape[0], dtype=torch.long)
    loss = SF.cross_entropy(x, t, reduction="none")
    assert torch.isnan(loss[0])
    loss.sum().backward()
    assert torch.isnan(x.grad[0]).all()
    assert not torch.isnan(x.grad[1:]).any()


# ---------------------------------------------------------------- autograd machinery


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_gradcheck_gradgradcheck(soft, weighted, eps):
    x = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    w = torch.rand(4, dtype=torch.float64) + 0.5 if weighted else None
    t = torch.softmax(torch.randn(3, 4, 2, dtype=torch.float64), 1) if soft else torch.tensor([[0, 3], [-100, 1], [2, 2]])
    fn = lambda z: SF.cross_entropy(z, t, weight=w, label_smoothing=eps, reduction="none")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,), check_batched_grad=True)
    assert torch.autograd.gradgradcheck(fn, (x,), check_batched_grad=True)


def test_func_grad_and_vmap():
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    t = torch.randint(0, 4, (6, 5))
    w = torch.rand(4, dtype=torch.float64) + 0.5
    ours = torch.func.vmap(torch.func.grad(lambda z, y: SF.cross_entropy(z, y, weight=w, label_smoothing=0.1)))(x, t)
    ref = torch.func.vmap(torch.func.grad(lambda z, y: F.cross_entropy(z, y, weight=w, label_smoothing=0.1)))(x, t)
    torch.testing.assert_close(ours, ref)
    y = torch.softmax(torch.randn(6, 5, 4, dtype=torch.float64), -1)
    ours = torch.func.vmap(lambda z, q: SF.cross_entropy(z, q, reduction="none"))(x, y)
    torch.testing.assert_close(ours, F.cross_entropy(x.reshape(30, 4), y.reshape(30, 4), reduction="none").view(6, 5))


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_low_precision_dtype_and_autocast(dt, device):
    x = (torch.randn(8, 5, device=device) * 4).to(dt).requires_grad_(True)
    t = torch.randint(0, 5, (8,), device=device)
    out = SF.cross_entropy(x, t, label_smoothing=0.1)
    ref = F.cross_entropy(x.float(), t, label_smoothing=0.1)
    assert out.dtype == dt
    torch.testing.assert_close(out.float(), ref, **tol(dt))
    out.backward()
    assert x.grad.dtype == dt
    with torch.autocast(device_type=device, dtype=dt):
        out = SF.cross_entropy(x, t)
        builtin = F.cross_entropy(x, t)
    assert out.dtype == builtin.dtype == torch.float32


def test_parity_on_device(device):
    x = torch.randn(16, 7, 3, device=device, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 7, (16, 3), device=device)
    t[0, 0] = 2
    w = torch.rand(7, device=device, dtype=torch.float64)
    kw = dict(weight=w, ignore_index=2, label_smoothing=0.2)
    (v0, g0), (v1, g1) = _both(lambda z: F.cross_entropy(z, t, **kw), lambda z: SF.cross_entropy(z, t, **kw), x)
    torch.testing.assert_close(v1, v0)
    torch.testing.assert_close(g1, g0)


@pytest.mark.slow
def test_compile_fullgraph():
    x = torch.randn(8, 5)
    x[0, 1] = -INF
    t = torch.randint(0, 5, (8,))
    assert_compiled_matches_eager(lambda z: SF.cross_entropy(z, t, label_smoothing=0.1), x)


# ---------------------------------------------------------------- errors


def test_errors():
    x = torch.randn(4, 3)
    t = torch.tensor([0, 1, 2, 1])
    with pytest.raises(ValueError, match="cross_entropy: reduction must be 'none', 'mean' or 'sum', got 'avg'"):
        SF.cross_entropy(x, t, reduction="avg")
    with pytest.raises(RuntimeError, match="cross_entropy: expected target dtype to be Long or Byte"):
        SF.cross_entropy(x, t.int())
    with pytest.raises(RuntimeError, match="cross_entropy: expected target dtype"):
        SF.cross_entropy(x, t.float())
    with pytest.raises(RuntimeError, match="floating point type for target with class probabilities"):
        SF.cross_entropy(x, torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="cross_entropy: target of class indices must have shape"):
        SF.cross_entropy(x, torch.zeros(5, dtype=torch.long))
    with pytest.raises(RuntimeError, match="cross_entropy: weight tensor should be defined"):
        SF.cross_entropy(x, t, weight=torch.ones(4))
    with pytest.raises(RuntimeError, match="cross_entropy: weight tensor should be defined"):
        SF.cross_entropy(x, t, weight=torch.ones(3, 1))
    with pytest.raises(RuntimeError, match="cross_entropy: label_smoothing must be between 0.0 and 1.0"):
        SF.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises((RuntimeError, IndexError), match="out of bounds"):
        SF.cross_entropy(x, torch.tensor([0, 1, 3, 1]))
    with pytest.raises((RuntimeError, IndexError), match="out of bounds"):
        SF.cross_entropy(x, torch.tensor([0, 1, -1, 1]))
    with pytest.raises(TypeError, match="cross_entropy: input must be a floating-point tensor"):
        SF.cross_entropy(t, t)
    with pytest.raises(ValueError, match="cross_entropy: input must have a class dimension"):
        SF.cross_entropy(torch.tensor(1.0), torch.tensor(0))


@pytest.mark.parametrize(
    "kwargs", [{}, {"label_smoothing": 0.1}, {"gamma": 2.0}], ids=["ce", "smoothing", "focal"]
)
def test_batched_grads_with_a_weight_that_requires_grad(kwargs):
    # autograd.grad(is_grads_batched=True) vmaps the backward over the upstream gradients;
    # the weight's gradient went through a flatten that vmap's fallback cannot take
    torch.manual_seed(0)
    x = torch.randn(4, 5, requires_grad=True)
    w = torch.rand(5, requires_grad=True)
    t = torch.randint(0, 5, (4,))
    fn = SF.focal_loss if "gamma" in kwargs else SF.cross_entropy
    loss = fn(x, t, weight=w, reduction="none", **kwargs)
    batched = torch.autograd.grad(loss, (x, w), torch.eye(4), is_grads_batched=True, retain_graph=True)
    for i, v in enumerate(torch.eye(4)):
        one = torch.autograd.grad(loss, (x, w), v, retain_graph=True)
        torch.testing.assert_close(batched[0][i], one[0])
        torch.testing.assert_close(batched[1][i], one[1])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_weight_second_derivatives_with_smoothing_over_masked_classes(reduction):
    # the smoothing term of the weight's gradient multiplied log p = -inf at a masked class
    # before selecting it away: under 'mean' its factor depends on the weight, so the double
    # backward formed 0·(-inf) (NaN) where forward-over-reverse was finite
    x = torch.tensor([[0.0, -math.inf, 1.0], [-math.inf, 2.0, 0.0]], dtype=torch.float64)
    w = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    t = torch.tensor([0, 1])

    def f(weight):
        return SF.cross_entropy(x, t, weight=weight, label_smoothing=0.2, reduction=reduction)

    reverse = torch.autograd.functional.hessian(f, w)
    assert torch.isfinite(reverse).all()
    torch.testing.assert_close(reverse, torch.func.hessian(f)(w))
    # and against the masked classes dropped by hand (their logits do not enter the value)
    xs = torch.tensor([[0.0, 1.0], [2.0, 0.0]], dtype=torch.float64)

    def by_hand(weight):  # each row's two unmasked classes, its target first; ε/2 on each
        lsm = xs.log_softmax(1)
        num = sum(-(0.8 * ww[0] * row[0] + 0.1 * (ww * row).sum())
                  for ww, row in ((weight[[0, 2]], lsm[0]), (weight[[1, 2]], lsm[1])))
        return num / (weight[0] + weight[1]) if reduction == "mean" else num

    torch.testing.assert_close(reverse, torch.autograd.functional.hessian(by_hand, w))


@pytest.mark.parametrize(
    "row", [[1e38, -1e38, 1.5e38], [1e37, -3e38, 1.5e37]], ids=["near-max", "one-very-negative"]
)
def test_weighted_label_smoothing_near_float_max_does_not_overflow(row):
    # the smoothing terms were multiplied by the class weight before the ε/K scale: w·log p
    # overflowed to inf where the weighted mean over the classes is finite
    x = torch.tensor([row])
    t = torch.tensor([0])
    w = torch.tensor([0.5, 2.0, 1.0])
    ours = SF.cross_entropy(x, t, weight=w, label_smoothing=0.1, reduction="none")
    ref = F.cross_entropy(x.double(), t, weight=w.double(), label_smoothing=0.1, reduction="none")
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_weighted_label_smoothing_target_term_near_float_max_does_not_overflow(reduction):
    # the target's term was multiplied by its class weight before the (1 − ε) scale: w_t·(−log p_t)
    # overflowed to inf where (1 − ε)·w_t·(−log p_t) is finite (3.06e38 here)
    x = torch.tensor([[0.0, torch.finfo(torch.float32).min, 1.0]])
    t = torch.tensor([1])
    w = torch.tensor([1.0, 1.2, 0.5])
    ours = SF.cross_entropy(x, t, weight=w, label_smoothing=0.5, reduction=reduction)
    ref = F.cross_entropy(x.double(), t, weight=w.double(), label_smoothing=0.5, reduction=reduction)
    assert ref.abs().max() < torch.finfo(torch.float32).max
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_index_mask_with_ignore_and_weight(reduction, weighted, smoothing):
    x, t, m, w = _ce_inputs()
    w = w if weighted else None
    got = SF.cross_entropy(x, t, w, reduction=reduction, label_smoothing=smoothing, mask=m)
    if reduction == "none":
        full = F.cross_entropy(x, t, w, reduction="none", label_smoothing=smoothing)
        want = torch.where(m, full, 0.0)
    else:  # torch on the kept rows: the weighted mean over kept, weighted, non-ignored rows
        want = F.cross_entropy(x[m], t[m], w, reduction=reduction, label_smoothing=smoothing)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_grad(got, x)[0], _grad(want, x)[0])


@pytest.mark.parametrize("case", ["ignored +inf row", "probabilities", "masked target", "masked target, smoothing",
                                  "masked target, focal", "masked target, double backward"])
def test_weight_gradient_of_a_row_that_adds_nothing_is_zero_not_nan(case):
    # a row whose loss is infinite, or that holds a +inf logit (log p = -inf at its finite
    # classes), times a row scale of 0 (an ignored target; a row left out of what is
    # differentiated): -inf · 0 made the whole weight gradient NaN although the loss is finite
    x = torch.tensor([[0.5, -1.0, 2.0, 0.0], [1.0, 0.0, -2.0, 3.0], [0.0, INF, 1.0, -1.0]])
    w = torch.tensor([0.7, 1.3, 0.9, 1.1], requires_grad=True)
    kw = {"label_smoothing": 0.1}
    f = SF.cross_entropy
    if case == "ignored +inf row":
        t = torch.tensor([0, 3, -100])
        loss = SF.cross_entropy(x, t, weight=w, **kw)
        want = SF.cross_entropy(x[:2], t[:2], weight=w, **kw)
    else:
        if case == "probabilities":
            t = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5], [0.0, 0.5, 0.5, 0.0]])
        else:  # the target class of the last row is masked: its loss is +inf
            x[2] = torch.tensor([0.0, -INF, 1.0, -1.0])
            t = torch.tensor([0, 3, 1])
            kw = {"label_smoothing": 0.1} if case == "masked target, smoothing" else {}
            if case == "masked target, focal":
                f, kw = SF.focal_loss, {"gamma": 0.5}
        loss = f(x, t, weight=w, reduction="none", **kw)
        assert loss[2] == INF
        loss = loss[:2].sum()
        want = f(x[:2], t[:2], weight=w, reduction="sum", **kw)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, want)
    if case == "masked target, double backward":
        (g,) = torch.autograd.grad(loss, w, create_graph=True)
        (g_want,) = torch.autograd.grad(want, w, create_graph=True)
        torch.testing.assert_close(g, g_want)
        return
    torch.testing.assert_close(_grad(loss, w)[0], _grad(want, w)[0])


def test_probability_target_gradient_of_a_row_that_adds_nothing_is_zero_not_nan():
    # d/dq of -Σ q log p is -log p: -inf at the finite classes of a +inf row, times a row scale
    # of 0 (a row left out of what is differentiated) was NaN; its gradient there is 0
    x = torch.tensor([[0.5, -1.0, 2.0, 0.0], [1.0, 0.0, -2.0, 3.0], [0.0, INF, 1.0, -1.0]])
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5], [0.0, 0.5, 0.5, 0.0]], requires_grad=True)
    loss = SF.cross_entropy(x, q, label_smoothing=0.1, reduction="none")
    assert loss[2] == INF
    (g,) = torch.autograd.grad(loss[:2].sum(), q)
    (g_want,) = torch.autograd.grad(SF.cross_entropy(x[:2], q[:2], label_smoothing=0.1, reduction="sum"), q)
    torch.testing.assert_close(g, g_want)


def test_cross_entropy_weight_gradient_with_mask():
    x, t, m, w = _ce_inputs(2)
    w = w.requires_grad_()
    got = SF.cross_entropy(x, t, w, mask=m)
    terms, wt = _torch_focal_none(x, t, 0.0, w)  # torch refuses weight.requires_grad: by hand
    want = _masked_ref(terms, m, "mean", wt)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_grad(got, w)[0], _grad(want, w)[0])


@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cross_entropy_probability_targets_mask(smoothing, reduction):
    g = _gen(5)
    x = torch.randn(6, 4, 3, generator=g, dtype=D, requires_grad=True)
    p = torch.rand(6, 4, 3, generator=g, dtype=D).softmax(1)
    w = torch.rand(4, generator=g, dtype=D)
    m = torch.rand(6, 3, generator=g) < 0.6
    got = SF.cross_entropy(x, p, w, reduction=reduction, label_smoothing=smoothing, mask=m)
    full = F.cross_entropy(x, p, w, reduction="none", label_smoothing=smoothing)
    want = _masked_ref(full, m, reduction)  # probabilities: the mean is over kept rows
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_grad(got, x)[0], _grad(want, x)[0])


def test_cross_entropy_nan_rows_and_garbage_targets_do_not_leak():
    x, t, m, w = _ce_inputs(3)
    xn = x.detach().clone()
    xn[1] = NAN
    xn[4, 0] = math.inf
    xn.requires_grad_()
    tn = t.clone()
    tn[1] = 999  # out of range, but masked out
    for fn in (
        lambda a, red: SF.cross_entropy(a, tn, w, reduction=red, label_smoothing=0.1, mask=m),
        lambda a, red: SF.focal_loss(a, tn, 2.0, w, reduction=red, mask=m),
    ):
        for red in ("none", "mean", "sum"):
            got = fn(xn, red)
            (gx,) = _grad(got, xn)
            assert torch.isfinite(got).all() and torch.isfinite(gx).all()
            assert torch.equal(gx[~m], torch.zeros_like(gx[~m]))
            torch.testing.assert_close(got, fn(x, red))
    p = torch.rand(7, 5, generator=_gen(6), dtype=D).softmax(1)
    p[1] = NAN
    got = SF.cross_entropy(xn, p, mask=m)
    assert torch.isfinite(got) and torch.isfinite(_grad(got, xn)[0]).all()


def test_cross_entropy_mask_broadcasts_over_spatial_dims():
    g = _gen(7)
    x = torch.randn(3, 4, 2, 5, generator=g, dtype=D, requires_grad=True)
    t = torch.randint(0, 4, (3, 2, 5), generator=g)
    m = torch.tensor([True, False, True, True, False])  # broadcasts to (3, 2, 5)
    got = SF.cross_entropy(x, t, mask=m)
    full = F.cross_entropy(x, t, reduction="none")
    want = full[m.expand(3, 2, 5)].mean()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_grad(got, x)[0], _grad(want, x)[0])


def test_cross_entropy_unbatched_mask():
    x = torch.randn(4, dtype=D, requires_grad=True)
    t = torch.tensor(2)
    got = SF.cross_entropy(x, t, mask=torch.tensor(True))
    torch.testing.assert_close(got, F.cross_entropy(x, t))
    assert SF.cross_entropy(x, t, mask=torch.tensor(False)).item() == 0.0


def test_probability_targets_nan_and_infinite_terms_row_by_row():
    """The probability-target forward takes every NaN term of ``q·log p`` as 0 (``0·log 0``)
    and puts the NaN cases back per row: a NaN target entry or a NaN logit gives that row
    NaN, a masked class without mass gives 0, a masked class with mass gives ``+inf``, and a
    ``+inf`` row puts ``+inf`` where mass sits on a finite class. Other rows are untouched."""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[0.5, -inf, 1.0], [0.5, -inf, 1.0], [0.5, 0.0, 1.0], [0.5, nan, 1.0],
                      [inf, 0.0, 1.0], [inf, 0.0, 1.0], [0.2, 0.1, -0.3]], requires_grad=True)
    q = torch.tensor([[0.3, 0.0, 0.7], [0.3, 0.2, 0.5], [0.3, nan, 0.7], [0.2, 0.3, 0.5],
                      [1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.1, 0.6, 0.3]])
    loss = SF.cross_entropy(x, q, reduction="none")
    ref0 = -(q[0, [0, 2]] * torch.log_softmax(x.detach()[0, [0, 2]], 0)).sum()
    torch.testing.assert_close(loss[0], ref0)
    assert loss[1] == inf and loss[5] == inf
    assert torch.isnan(loss[2]) and torch.isnan(loss[3])
    assert loss[4] == 0
    torch.testing.assert_close(loss[6], F.cross_entropy(x.detach()[6:], q[6:], reduction="none")[0])
    (g,) = torch.autograd.grad(loss[[0, 4, 6]].sum(), x)
    assert torch.isfinite(g[[0, 4, 6]]).all() and g[0, 1] == 0 and g[4].eq(0).all()


@pytest.mark.slow
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_probability_targets_hazard_rows_compiled(label_smoothing):
    """Compiled, the probability-target loss keeps every row's value and gradient of the eager
    call (compiled code skips the extra log-softmax output's materialized zero gradient and
    writes ``0·log 0`` with a select, not ``nansum``), NaN rows and terms included."""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[0.5, -inf, 1.0], [0.5, -inf, 1.0], [0.5, 0.0, 1.0], [0.5, nan, 1.0],
                      [inf, 0.0, 1.0], [inf, 0.0, 1.0], [0.2, 0.1, -0.3], [-inf, -inf, -inf]])
    q = torch.tensor([[0.3, 0.0, 0.7], [0.3, 0.2, 0.5], [0.3, nan, 0.7], [0.2, 0.3, 0.5],
                      [1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.1, 0.6, 0.3], [0.2, 0.3, 0.5]])

    def f(z):
        return SF.cross_entropy(z, q, reduction="none", label_smoothing=label_smoothing)

    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = torch.compile(f, fullgraph=True)(x1), f(x2)
    torch.testing.assert_close(got, want, equal_nan=True)
    rows = [0, 4, 6, 7]  # the rows whose eager gradient is finite
    (g,) = torch.autograd.grad(got[rows].sum(), x1)
    (g_ref,) = torch.autograd.grad(want[rows].sum(), x2)
    assert torch.isfinite(g_ref[rows]).all()
    torch.testing.assert_close(g, g_ref, equal_nan=True)


@pytest.mark.slow
@pytest.mark.parametrize("weighted", [False, True])
def test_label_smoothing_hazard_rows_compiled(weighted):
    """Compiled, label smoothing keeps every row's value and gradient of the eager call: masked
    classes, ``+inf`` rows (target at a ``+inf`` and at a finite class), a fully masked row, a
    NaN row, a ``finfo.min`` row and an ignored row."""
    inf, nan = float("inf"), float("nan")
    fmin = torch.finfo(torch.float32).min
    x = torch.tensor([[0.5, -inf, 2.0, 1.0], [inf, 0.0, inf, 1.0], [inf, 0.0, inf, 1.0],
                      [-inf, -inf, -inf, -inf], [0.5, nan, 1.0, 0.0], [fmin, fmin, -inf, fmin],
                      [0.3, 0.2, 0.1, 0.0], [3e38, -3e38, 0.0, 1e-30]])
    t = torch.tensor([0, 0, 1, 2, 1, 0, -100, 0])
    w = torch.tensor([0.5, 1.0, 1.5, 2.0]) if weighted else None

    def f(z):
        return SF.cross_entropy(z, t, weight=w, reduction="none", label_smoothing=0.2)

    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = torch.compile(f, fullgraph=True)(x1), f(x2)
    torch.testing.assert_close(got, want, equal_nan=True)
    rows = [0, 3, 5, 6]  # finite values (smoothing mass on a class of probability 0 gives +inf)
    (g,) = torch.autograd.grad(got[rows].sum(), x1)
    (g_ref,) = torch.autograd.grad(want[rows].sum(), x2)
    assert torch.isfinite(want[rows]).all() and torch.isfinite(g_ref[rows]).all()
    torch.testing.assert_close(g, g_ref, equal_nan=True)


@pytest.mark.parametrize("fn", [SF.cross_entropy, SF.focal_loss])
def test_class_weight_of_an_unbatched_target_reads_nothing_on_the_host(fn):
    # torch's ModuleInfo samples "no_batch_dim_weights": weight[t] with a 0-d t called .item(),
    # which fails on meta tensors and breaks a fullgraph compile
    w, x, t = torch.tensor([0.2, 0.5, 0.3]), torch.tensor([0.1, -1.0, 2.0]), torch.tensor(1)
    kw = {} if fn is SF.cross_entropy else {"gamma": 0.0}
    out = fn(x.to("meta"), t.to("meta"), weight=w.to("meta"), **kw)
    assert out.device.type == "meta" and out.shape == ()
    want = F.cross_entropy(x, t, w)
    torch.testing.assert_close(fn(x, t, weight=w, **kw), want)
    for ls in ([0.0, 0.1] if fn is SF.cross_entropy else [0.0]):
        extra = {"label_smoothing": ls} if ls else {}
        xm = x.to("meta").requires_grad_()
        fn(xm, t.to("meta"), weight=w.to("meta"), **kw, **extra).backward()
        assert xm.grad is not None and xm.grad.device.type == "meta"
        torch.testing.assert_close(fn(x, t, weight=w, **kw, **extra), F.cross_entropy(x, t, w, **extra))


@pytest.mark.slow
def test_class_weight_of_an_unbatched_target_compiles_fullgraph():
    w, x, t = torch.tensor([0.2, 0.5, 0.3]), torch.tensor([0.1, -1.0, 2.0]), torch.tensor(1)
    out = torch.compile(sl.CrossEntropyLoss(weight=w), fullgraph=True)(x, t)
    torch.testing.assert_close(out, F.cross_entropy(x, t, w))


@pytest.mark.parametrize("kwargs", [dict(), dict(reduction="none"), dict(reduction="sum"),
                                    dict(weight=torch.tensor([0.5, 1.0, 2.0, 1.5])), dict(ignore_index=1)])
def test_one_dimensional_input_takes_a_target_of_shape_one_as_torch(kwargs):
    # torch 2.13's nll_loss reads a (1,) target of a (C,) input as the 0-d one (torch 2.6 raised
    # "size mismatch"); ours raised. Compared with the 0-d target, which every torch takes.
    x, t = torch.tensor([0.3, -1.0, 2.0, 0.5]), torch.tensor([1])
    want = F.cross_entropy(x, t[0], **kwargs)
    got = SF.cross_entropy(x, t, **kwargs)
    assert got.shape == want.shape == ()
    torch.testing.assert_close(got, want, equal_nan=True)
    torch.testing.assert_close(SF.focal_loss(x, t, gamma=0.0, **kwargs), want, equal_nan=True)
    with pytest.raises(ValueError, match="1D target must have size 1, but got target size: 2"):
        SF.cross_entropy(x, torch.tensor([1, 2]))
