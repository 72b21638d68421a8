"""kl_div / KLDivLoss: F.kl_div parity, zero-probability terms give 0 with 0 gradient."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_compiled_matches_eager, tol
from hypothesis import given
from hypothesis import strategies as st
from mask_helpers import _elementwise_inputs, _gen, _grad
from strategies import finite_floats, tensors, value_and_grads

import stablelosses as sl
import stablelosses.functional as SF

REDUCTIONS = ["none", "batchmean", "mean", "sum"]
INF = float("inf")

pytestmark = pytest.mark.filterwarnings("ignore:reduction. 'mean'", "ignore:size_average and reduce")


def make(shape_x, shape_t, log_target, device="cpu", dtype=torch.float64):
    x = torch.log_softmax(torch.randn(shape_x, dtype=dtype, device=device), -1) if len(shape_x) else torch.randn((), dtype=dtype, device=device)
    p = torch.rand(shape_t, dtype=dtype, device=device) + 0.05
    return x, (p.log() if log_target else p)


SHAPES = [((), ()), ((0, 3), (0, 3)), ((4,), (4,)), ((2, 3), (2, 3)), ((2, 3), (3,)), ((3,), (2, 3))]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_parity_with_torch(device, reduction, log_target, shapes):
    x, t = make(*shapes, log_target, device)
    v, gx, gt = value_and_grads(SF.kl_div, x, t, reduction=reduction, log_target=log_target)
    rv, rgx, rgt = value_and_grads(F.kl_div, x, t, reduction=reduction, log_target=log_target)
    torch.testing.assert_close(v, rv, equal_nan=True)
    torch.testing.assert_close(gx, rgx, equal_nan=True)
    torch.testing.assert_close(gt, rgt, equal_nan=True)


def test_batchmean_scalar_divides_by_one():
    x, t = torch.tensor(3.0), torch.tensor(0.5)
    assert SF.kl_div(x, t, reduction="batchmean") == F.kl_div(x, t, reduction="batchmean")


@pytest.mark.parametrize("legacy", [dict(size_average=False), dict(reduce=False), dict(size_average=True, reduce=True),
                                    dict(size_average=False, reduce=True)], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_legacy_arguments(legacy, reduction):
    x, t = make((2, 3), (2, 3), False)
    torch.testing.assert_close(SF.kl_div(x, t, reduction=reduction, **legacy), F.kl_div(x, t, reduction=reduction, **legacy))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("log_target", [False, True])
def test_zero_target_terms_are_zero_with_zero_gradient(device, reduction, log_target):
    x = torch.tensor([[-0.5, -INF, -2.0, 3.0], [-1.0, -1e30, -INF, -0.1]], dtype=torch.float64, device=device)
    p = torch.tensor([[0.7, 0.0, 0.0, 0.3], [0.5, 0.0, 0.0, 0.5]], dtype=torch.float64, device=device)
    t = torch.log(p) if log_target else p
    zero = p == 0
    v, gx, gt = value_and_grads(SF.kl_div, x, t, reduction=reduction, log_target=log_target)
    naive_v = F.kl_div(x, t, reduction=reduction, log_target=log_target)
    assert not torch.isfinite(naive_v).all()  # 0·(-inf) = NaN in torch
    # reference: torch elementwise with the zero-probability entries replaced by harmless ones
    xs = torch.where(zero, 0.0, x).requires_grad_()
    ts = torch.where(zero, 0.0 if log_target else 1.0, t).requires_grad_()
    ref = torch.where(zero, 0.0, F.kl_div(xs, ts, reduction="none", log_target=log_target))
    ref = {"none": ref, "sum": ref.sum(), "mean": ref.mean(), "batchmean": ref.sum() / 2}[reduction]
    rgx, rgt = torch.autograd.grad(ref.sum(), (xs, ts))
    torch.testing.assert_close(v, ref.detach())
    assert (gx[zero] == 0).all() and (gt[zero] == 0).all()
    assert not torch.signbit(gx[zero]).any()
    torch.testing.assert_close(gx[~zero], rgx[~zero])
    torch.testing.assert_close(gt[~zero], rgt[~zero])


def test_positive_target_with_minus_inf_input_is_inf():
    x = torch.tensor([0.0, -INF])
    p = torch.tensor([0.5, 0.5])
    assert SF.kl_div(x, p, reduction="sum") == INF == F.kl_div(x, p, reduction="sum")


@pytest.mark.parametrize("log_target", [False, True])
def test_nan_propagates(log_target):
    zero = -INF if log_target else 0.0
    x = torch.tensor([float("nan"), -1.0, float("nan")])
    t = torch.tensor([0.5 if not log_target else -0.7, float("nan"), zero])
    x.requires_grad_()
    t.requires_grad_()
    out = SF.kl_div(x, t, reduction="none", log_target=log_target)
    assert torch.isnan(out).all()
    out.sum().backward()
    assert torch.isnan(t.grad[1]) and torch.isnan(x.grad[1])


def test_user_regression_masked_log_probs():
    logits = torch.tensor([[2.0, 1.0, -INF]], requires_grad=True)
    logq = torch.log_softmax(logits, -1)
    p = torch.tensor([[0.6, 0.4, 0.0]])
    assert torch.isnan(F.kl_div(logq, p, reduction="batchmean"))
    loss = SF.kl_div(torch.log_softmax(logits, -1), p, reduction="batchmean")
    torch.testing.assert_close(loss.detach(), F.kl_div(logq[:, :2].detach(), p[:, :2], reduction="batchmean"))
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 2] == 0


probs = st.one_of(st.just(0.0), st.floats(0.0, 1.0, width=32))
logps = st.one_of(st.just(-INF), finite_floats(torch.float32, max_abs=1e30), st.just(-1e30))


@given(data=st.data(), reduction=st.sampled_from(REDUCTIONS), log_target=st.booleans())
def test_property_no_nan_from_valid_input(data, reduction, log_target):
    n = data.draw(st.integers(1, 6))
    x = data.draw(tensors((n,), torch.float32, elements=logps))
    p = data.draw(tensors((n,), torch.float32, elements=probs))
    t = p.log() if log_target else p
    v, gx, gt = value_and_grads(SF.kl_div, x, t, reduction=reduction, log_target=log_target)
    assert not torch.isnan(v).any()
    assert not torch.isnan(gx).any()
    assert (gx[p == 0] == 0).all() and (gt[p == 0] == 0).all()
    # equal to torch wherever torch is finite
    rv, rgx, rgt = value_and_grads(F.kl_div, x.double(), t.double(), reduction="none", log_target=log_target)
    fin = torch.isfinite(rv)
    ours = SF.kl_div(x, t, reduction="none", log_target=log_target)
    torch.testing.assert_close(ours[fin].double(), rv[fin], rtol=1e-5, atol=1e-6)
    ok = torch.isfinite(rgx) & torch.isfinite(rgt) & (p > 0)
    _, ogx, ogt = value_and_grads(SF.kl_div, x, t, reduction="none", log_target=log_target)
    torch.testing.assert_close(ogx[ok].double(), rgx[ok], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ogt[ok].double(), rgt[ok], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("log_target", [False, True])
def test_gradcheck(reduction, log_target):
    x, t = make((3, 4), (4,), log_target)
    x.requires_grad_()
    t.requires_grad_()
    f = lambda a, b: SF.kl_div(a, b, reduction=reduction, log_target=log_target)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, t), check_batched_grad=True)
    assert torch.autograd.gradgradcheck(f, (x, t), check_batched_grad=True)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("log_target", [False, True])
def test_func_grad_and_vmap(reduction, log_target):
    x, t = make((5, 3), (5, 3), log_target)
    kw = dict(reduction=reduction, log_target=log_target)
    g = torch.func.grad(lambda a, b: SF.kl_div(a, b, **kw).sum(), argnums=(0, 1))(x, t)
    r = torch.func.grad(lambda a, b: F.kl_div(a, b, **kw).sum(), argnums=(0, 1))(x, t)
    torch.testing.assert_close(g, r)
    v = torch.vmap(lambda a, b: SF.kl_div(a, b, **kw))(x, t)
    torch.testing.assert_close(v, torch.stack([F.kl_div(a, b, **kw) for a, b in zip(x, t)]))
    pg = torch.vmap(torch.func.grad(lambda a, b: SF.kl_div(a, b, **kw).sum()))(x, t)
    ref = torch.stack([torch.func.grad(lambda a: F.kl_div(a, b, **kw).sum())(a) for a, b in zip(x, t)])
    torch.testing.assert_close(pg, ref)


def test_dtypes_and_autocast(dtype):
    x, t = make((3, 4), (3, 4), False, dtype=dtype)
    x.requires_grad_()
    out = SF.kl_div(x, t, reduction="batchmean")
    assert out.dtype == F.kl_div(x, t, reduction="batchmean").dtype == dtype
    ref = F.kl_div(x.detach().double(), t.double(), reduction="batchmean")
    torch.testing.assert_close(out.detach().double(), ref, **tol(dtype))
    out.backward()
    assert x.grad.dtype == dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert SF.kl_div(x, t).dtype == F.kl_div(x, t).dtype


def test_module_matches_function():
    x, t = make((3, 4), (3, 4), True)
    m = sl.KLDivLoss(reduction="batchmean", log_target=True)
    assert torch.equal(m(x, t), SF.kl_div(x, t, reduction="batchmean", log_target=True))


@pytest.mark.parametrize("log_target", [False, True])
def test_target_gradient_with_zero_upstream_gradient_matches_torch(log_target):
    # a negative (or otherwise off-support) target under a zero upstream gradient: torch's
    # target gradient is 0 there (its log term is xlogy(grad, target)), not 0 * NaN
    x = torch.tensor([0.0, 1.0, -2.0, 0.5])
    t_values = [-0.5, -2.0, 0.25, 3.0]
    g = torch.tensor([0.0, 0.0, 1.0, 0.0])
    grads = []
    for f in (F.kl_div, SF.kl_div):
        t = torch.tensor(t_values, requires_grad=True)
        f(x, t, reduction="none", log_target=log_target).backward(g)
        grads.append(t.grad)
    torch.testing.assert_close(grads[1], grads[0], equal_nan=True)
    assert not grads[1].isnan().any()


def test_target_gradient_forward_mode_with_zero_tangent_is_zero():
    x, t = torch.zeros(2), torch.tensor([-0.5, 0.5])
    _, out_t = torch.func.jvp(lambda tt: SF.kl_div(x, tt, reduction="none"), (t,), (torch.tensor([0.0, 1.0]),))
    torch.testing.assert_close(out_t, torch.tensor([0.0, 1.0 + torch.log(torch.tensor(0.5)).item()]))


def test_bad_arguments():
    x = torch.randn(3)
    with pytest.raises(ValueError, match=r"kl_div: reduction must be 'none', 'batchmean', 'mean' or 'sum', got 'avg'"):
        SF.kl_div(x, x, reduction="avg")
    with pytest.raises(TypeError, match=r"kl_div: input must be a torch.Tensor"):
        SF.kl_div([0.0, 1.0, 2.0], x)


@pytest.mark.parametrize("dtype, words", [(torch.int64, "Integral"), (torch.bool, "Integral"),
                                          (torch.complex64, "Complex")], ids=str)
def test_a_non_real_argument_is_torchs_runtime_error_naming_it(dtype, words):
    # torch: RuntimeError "kl_div: Integral inputs not supported." (not a TypeError)
    x, bad = torch.randn(3), torch.ones(3, dtype=dtype)
    with pytest.raises(RuntimeError, match=words):
        F.kl_div(bad, x, reduction="sum")
    with pytest.raises(RuntimeError, match=rf"kl_div: input must be a floating-point tensor.*{words}"):
        SF.kl_div(bad, x, reduction="sum")
    with pytest.raises(RuntimeError, match=rf"kl_div: target must be a floating-point tensor.*{words}"):
        SF.kl_div(x, bad, reduction="sum")


def test_shapes_that_do_not_broadcast_are_named():
    # torch's message names no argument ("The size of tensor a (3) must match ...")
    with pytest.raises(RuntimeError, match=r"kl_div: the shapes of input \(3,\) and target \(4,\) do not broadcast"):
        SF.kl_div(torch.randn(3), torch.rand(4), reduction="sum")


@pytest.mark.parametrize("log_target", ["False", 1, None, torch.tensor(True)])
def test_log_target_must_be_a_bool_as_torch(log_target):
    x = torch.zeros(2)
    with pytest.raises(TypeError):
        F.kl_div(x, x, reduction="sum", log_target=log_target)
    with pytest.raises(TypeError, match=r"kl_div: log_target must be a bool, got "):
        SF.kl_div(x, x, reduction="sum", log_target=log_target)


@pytest.mark.slow
def test_compile_fullgraph():
    t = torch.tensor([[1.0, 0.0]])
    g = assert_compiled_matches_eager(lambda a: SF.kl_div(a, t, reduction="batchmean"), torch.tensor([[0.0, -INF]]))
    assert g.tolist() == [[-1.0, 0.0]]


def test_kl_div_mean_warns_like_torch():
    x, y = torch.log_softmax(torch.randn(2, 3), 1), torch.softmax(torch.randn(2, 3), 1)
    with pytest.warns(UserWarning, match="'batchmean' divides only by the batch size") as theirs:
        F.kl_div(x, y, reduction="mean")
    with pytest.warns(UserWarning, match="'batchmean' divides only by the batch size") as ours:
        SF.kl_div(x, y, reduction="mean")
    assert str(ours[0].message) == str(theirs[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SF.kl_div(x, y, reduction="batchmean")


def test_kl_div_batchmean_divides_by_kept_rows():
    x, t = _elementwise_inputs("kl_div", shape=(4, 3, 5))
    rows = torch.tensor([True, False, True, False])[:, None, None]
    m = rows & (torch.rand(1, 3, 5, generator=_gen(4)) < 0.7)
    got = SF.kl_div(x, t, "batchmean", mask=m)
    terms = F.kl_div(x, t, reduction="none")[m.expand(4, 3, 5)]
    want = terms.sum() / 2  # two batch rows have a True entry
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_grad(got, x)[0], _grad(want, x)[0])
    empty = SF.kl_div(x, t, "batchmean", mask=torch.zeros(1, dtype=torch.bool))
    assert empty.item() == 0.0 and torch.equal(_grad(empty, x)[0], torch.zeros_like(x))


def test_kl_div_full_mask_equals_torch():
    x, t = _elementwise_inputs("kl_div", shape=(3, 4))
    for red in ("batchmean", "sum", "none"):
        got = SF.kl_div(x, t, red, mask=torch.ones(3, 4, dtype=torch.bool))
        torch.testing.assert_close(got, F.kl_div(x, t, reduction=red))


@pytest.mark.parametrize("log_target", [False, True])
def test_broadcast_error_names_the_arguments(log_target):
    # torch's words ("The size of tensor a ...") name no argument; ours name both
    with pytest.raises(RuntimeError, match=r"kl_div: the shapes of input \(3,\) and target \(2, 4\) do not "
                                           r"broadcast \(The size of tensor a \(3\) must match"):
        SF.kl_div(torch.randn(3), torch.rand(2, 4), reduction="sum", log_target=log_target)


@pytest.mark.parametrize("log_target", [False, True])
def test_target_gradient_of_an_infinite_term_that_adds_nothing_is_zero_not_nan(log_target):
    # d/dt of an infinite term (target mass where input is -inf) times an incoming gradient or
    # tangent of 0 was 0·inf = NaN; that term adds nothing to what is differentiated
    x = torch.tensor([-INF, -1.0])
    t = torch.tensor([0.5, 0.5])
    t = t.log() if log_target else t
    tt = t.clone().requires_grad_()
    loss = SF.kl_div(x, tt, reduction="none", log_target=log_target)
    assert loss[0] == INF
    (g,) = torch.autograd.grad(loss[1], tt)
    (g_want,) = torch.autograd.grad(SF.kl_div(x[1:], tt[1:], reduction="sum", log_target=log_target), tt)
    torch.testing.assert_close(g, g_want)
    _, tangent = torch.func.jvp(lambda u: SF.kl_div(x, u, reduction="none", log_target=log_target),
                                (t,), (torch.tensor([0.0, 1.0]),))
    assert tangent[0].item() == 0.0 and tangent[1].item() == g[1].item()
