"""The torch.nn losses without a hazard are torch's own computation. Why nothing needs fixing:
over extreme finite inputs (±1e4, ±1e30, 0, subnormals) no value and no
gradient is non-finite where the exact one (torch's computation in float64, rounded to float32)
is finite. Also here: weight= on l1/mse/huber, and NaN in → NaN out for the margin kernels."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import stablelosses.functional as SF
from stablelosses.functional._torch_losses import _multilabel_margin_formula

# (not the float32 maximum: a mean of entries near 3e38 overflows in its float32 sum, torch's
# accumulation, which every mean reduction shares)
EXTREMES = [0.0, -0.0, 1e4, -1e4, 1e30, -1e30, 1e-45, -1e-45, 1e-40, 1.0, -2.5]
SIGNS = [1.0, -1.0]


def _tensor(draw, values, shape=(2, 3)):
    n = math.prod(shape)
    return torch.tensor(draw(st.lists(st.sampled_from(values), min_size=n, max_size=n)),
                        dtype=torch.float32).reshape(shape)


NO_HAZARD = [
    "l1_loss", "mse_loss", "huber_loss", "smooth_l1_loss", "poisson_nll_loss", "binary_cross_entropy",
    "hinge_embedding_loss", "margin_ranking_loss", "multi_margin_loss", "multilabel_margin_loss",
    "triplet_margin_loss", "triplet_margin_with_distance_loss",
]


@st.composite
def _call(draw, name):
    x = _tensor(draw, EXTREMES)
    if name in ("l1_loss", "mse_loss", "huber_loss", "smooth_l1_loss"):
        args = (x, _tensor(draw, EXTREMES))
    elif name == "poisson_nll_loss":
        args = (x, _tensor(draw, [0.0, 1.0, 3.0, 1e4, 1e30, 1e-45]))
    elif name == "binary_cross_entropy":
        probs = [0.0, 1.0, 1e-45, 1e-30, 0.5, 1 - 2**-24]
        args = (_tensor(draw, probs), _tensor(draw, [0.0, 1.0, 0.3]))
    elif name == "hinge_embedding_loss":
        args = (x, _tensor(draw, SIGNS))
    elif name == "margin_ranking_loss":
        args = (x[0], _tensor(draw, EXTREMES, (3,)), _tensor(draw, SIGNS, (3,)))
    elif name == "multi_margin_loss":
        args = (x, torch.tensor(draw(st.lists(st.integers(0, 2), min_size=2, max_size=2))))
    elif name == "multilabel_margin_loss":
        args = (x, torch.tensor([[0, 2, -1], [1, -1, 0]]))
    else:  # a user's distance function: its hazards are its own, so an L1 distance here
        args = (x, _tensor(draw, EXTREMES), _tensor(draw, EXTREMES))
    reduction = draw(st.sampled_from(["none", "mean", "sum"]))
    return name, args, reduction


def _kwargs(name):
    if name == "triplet_margin_with_distance_loss":
        return {"distance_function": lambda a, b: (a - b).abs().sum(-1)}
    return {}


@pytest.mark.parametrize("name", NO_HAZARD)
def test_no_nonfinite_value_or_gradient_where_the_exact_one_is_finite(name):
    @settings(max_examples=30, deadline=None, derandomize=True)
    @given(_call(name))
    def check(call):
        _check_finite(*call)

    check()


def _check_finite(name, args, reduction):
    kw = {**_kwargs(name), "reduction": reduction}
    leaves = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
    out = getattr(SF, name)(*leaves, **kw)
    exact64 = [a.double().requires_grad_() if a.is_floating_point() else a for a in args]
    exact = getattr(F, name)(*exact64, **kw)
    representable = torch.isfinite(exact.detach().float())
    assert torch.isfinite(out[representable]).all(), (name, args, out, exact)
    if representable.all() and out.requires_grad:
        w = torch.ones_like(out)
        grads = torch.autograd.grad((out * w).sum(), [a for a in leaves if a.is_floating_point()], allow_unused=True)
        exact_grads = torch.autograd.grad((exact * w.double()).sum(),
                                          [a for a in exact64 if a.is_floating_point()], allow_unused=True)
        for g, e in zip(grads, exact_grads):
            if g is not None and e is not None:
                ok = torch.isfinite(e.float())
                assert torch.isfinite(g[ok]).all(), (name, args, g, e)


@pytest.mark.parametrize("name", ["l1_loss", "mse_loss", "huber_loss"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_weight_is_torch_2_13s(name, reduction):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 4, generator=g, dtype=torch.float64)
    w = torch.rand(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    out = getattr(SF, name)(x, y, reduction=reduction, weight=w)
    unweighted = getattr(F, name)(x, y, reduction="none") * w
    if reduction == "mean":
        expected = unweighted.sum() / w.sum() if name != "huber_loss" else unweighted.mean()
    else:
        expected = unweighted.sum() if reduction == "sum" else unweighted
    torch.testing.assert_close(out, expected)
    assert torch.autograd.gradcheck(lambda a, b: getattr(SF, name)(a, y, reduction=reduction, weight=b), (x, w))
    with pytest.raises(ValueError, match=f"{name}: Weights and input must have the same size"):
        getattr(SF, name)(x, y, weight=torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("name", ["multi_margin_loss", "multilabel_margin_loss"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_a_nan_score_makes_its_sample_nan(name, reduction):
    x = torch.tensor([[0.1, float("nan"), 0.8], [0.1, 0.2, 0.4]])
    t = torch.tensor([2, 0]) if name == "multi_margin_loss" else torch.tensor([[2, -1, 0], [0, 1, -1]])
    out = getattr(SF, name)(x, t, reduction=reduction)
    theirs = getattr(F, name)(x, t, reduction="none")
    assert torch.isfinite(theirs).all()  # torch drops the NaN
    if reduction == "none":
        assert torch.isnan(out[0]) and out[1] == theirs[1]
    else:
        assert torch.isnan(out)


def test_multilabel_margin_formula_equals_torchs_kernel():
    # the spelling traced under torch.compile, where torch's decomposition differs from its kernel
    g = torch.Generator().manual_seed(3)
    for shape, t in [((4, 5), torch.tensor([[0, 2, -1, 1, 1], [4, 3, 2, 1, 0], [-1, 0, 0, 0, 0], [1, 1, -1, 3, 2]])),
                     ((5,), torch.tensor([3, 0, -1, 2, 2]))]:
        x = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
        ours = _multilabel_margin_formula(x, t)
        theirs = F.multilabel_margin_loss(x, t, reduction="none")
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(torch.autograd.grad(ours.sum(), x)[0], torch.autograd.grad(theirs.sum(), x)[0])


@pytest.mark.parametrize("name", ["multi_margin_loss", "multilabel_margin_loss"])
def test_margin_kernels_equal_torch_without_nan(name):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 3, generator=g, requires_grad=True)
    t = torch.tensor([0, 2, 1, 2]) if name == "multi_margin_loss" else torch.tensor([[0, 2, -1]] * 4)
    for red in ("none", "mean", "sum"):
        ours, theirs = getattr(SF, name)(x, t, reduction=red), getattr(F, name)(x, t, reduction=red)
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(torch.autograd.grad(ours.sum(), x)[0], torch.autograd.grad(theirs.sum(), x)[0])


def test_multi_margin_weight_gets_the_gradient_of_the_value():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    t = torch.tensor([0, 2, 1, 2])
    w = torch.rand(3, generator=g, dtype=torch.float64, requires_grad=True)
    for red in ("none", "mean", "sum"):
        assert torch.autograd.gradcheck(lambda v, red=red: SF.multi_margin_loss(x, t, p=2, weight=v, reduction=red),
                                        (w,))


def test_binary_cross_entropy_weight_gets_the_gradient_of_the_value():
    g = torch.Generator().manual_seed(6)
    x = torch.rand(3, 2, generator=g, dtype=torch.float64) * 0.9 + 0.05
    y = torch.rand(3, 2, generator=g, dtype=torch.float64)
    w = torch.rand(3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    for red in ("none", "mean", "sum"):
        torch.testing.assert_close(SF.binary_cross_entropy(x, y, w, reduction=red),
                                   F.binary_cross_entropy(x, y, w.detach(), reduction=red))
        assert torch.autograd.gradcheck(lambda v, red=red: SF.binary_cross_entropy(x, y, v, reduction=red), (w,))


def test_default_distance_of_the_triplet_losses_does_not_overflow():
    import stablelosses as sl

    a, pos, neg = torch.zeros(1, 3), torch.full((1, 3), 1e30), torch.full((1, 3), 3e30)
    assert torch.isnan(F.triplet_margin_with_distance_loss(a, pos, neg))  # torch: inf − inf
    for out in (SF.triplet_margin_with_distance_loss(a, pos, neg), sl.TripletMarginWithDistanceLoss()(a, pos, neg),
                SF.triplet_margin_loss(a, pos, neg), sl.TripletMarginLoss()(a, pos, neg)):
        assert out.item() == 0.0
    a, pos, neg = torch.zeros(1, 3), torch.full((1, 3), 3e30), torch.full((1, 3), 1e30)
    expected = (3e30 - 1e30) * math.sqrt(3) + 1.0  # the exact loss, to float32 rounding
    assert SF.triplet_margin_with_distance_loss(a, pos, neg).item() == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------- dtypes, weight's derivatives, edges


@pytest.mark.parametrize("name", ["l1_loss", "mse_loss", "huber_loss"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float64), (torch.float16, torch.float32),
                                    (torch.bfloat16, torch.float16)], ids=str)
def test_weight_takes_part_in_the_result_dtype(name, dtypes):
    # torch promotes input, target and weight together (float32 input, float64 weight: float64)
    x, y = torch.randn(4, 3).to(dtypes[0]), torch.randn(4, 3).to(dtypes[0])
    w = torch.rand(4, 3).to(dtypes[1])
    for red in ("none", "mean", "sum"):
        expected = getattr(F, name)(x, y, reduction=red, weight=w)
        got = getattr(SF, name)(x, y, reduction=red, weight=w)
        assert got.dtype == expected.dtype
        # the value: torch's on the inputs upcast (torch computes half precision in half)
        exact = getattr(F, name)(x.double(), y.double(), reduction=red, weight=w.double())
        torch.testing.assert_close(got.double(), exact, rtol=1e-2, atol=1e-2)


def test_bce_input_tangent_is_not_doubled_by_a_weight_that_requires_grad():
    # torch.no_grad() does not stop forward AD: the weight's gradient term added its own input tangent
    g = torch.Generator().manual_seed(0)
    p, t = torch.rand(3, generator=g, dtype=torch.float64), torch.rand(3, generator=g, dtype=torch.float64)
    w = torch.rand(3, generator=g, dtype=torch.float64, requires_grad=True)
    for red in ("none", "mean", "sum"):
        def ours(p, red=red):
            return SF.binary_cross_entropy(p, t, w, reduction=red)

        def theirs(p, red=red):
            return F.binary_cross_entropy(p, t, w.detach(), reduction=red)

        _, tan = torch.func.jvp(ours, (p,), (torch.ones_like(p),))
        _, expected = torch.func.jvp(theirs, (p,), (torch.ones_like(p),))
        torch.testing.assert_close(tan, expected)
        torch.testing.assert_close(torch.func.jacfwd(ours)(p), torch.func.jacfwd(theirs)(p))


def _opinfo_gradgradcheck(name):
    """gradgradcheck with every floating tensor of each of torch's OpInfo samples a leaf."""
    pytest.importorskip("expecttest")
    from torch.testing._internal.common_methods_invocations import op_db

    op = next(o for o in op_db if o.name == f"nn.functional.{name}" and o.variant_test_name == "")
    checked = 0
    for s in op.sample_inputs("cpu", torch.float64, requires_grad=True):
        def leaf(v):
            return v.detach().clone().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v

        args = [leaf(v) for v in (s.input, *s.args)]
        kwargs = {k: leaf(v) for k, v in s.kwargs.items()}
        slots = [("a", i) for i, v in enumerate(args) if isinstance(v, torch.Tensor) and v.requires_grad]
        slots += [("k", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]

        def f(*leaves, args=args, kwargs=kwargs, slots=slots):
            a, k = list(args), dict(kwargs)
            for (where, key), v in zip(slots, leaves):
                if where == "a":
                    a[key] = v
                else:
                    k[key] = v
            return getattr(SF, name)(*a, **k)

        leaves = tuple(args[key] if where == "a" else kwargs[key] for where, key in slots)
        assert torch.autograd.gradgradcheck(f, leaves)
        checked += 1
    assert checked > 0


def test_bce_double_backward_has_the_mixed_input_weight_derivative():
    # d/dw (dL/dx) was a silent None (the weight's term was computed under no_grad)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.rand(4, generator=g, dtype=torch.float64)
    w = torch.rand(4, generator=g, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(SF.binary_cross_entropy(x, t, w, reduction="sum"), x, create_graph=True)
    (mixed,) = torch.autograd.grad(gx.sum(), w)
    torch.testing.assert_close(mixed, ((x - t) / (x * (1 - x))).detach())
    _opinfo_gradgradcheck("binary_cross_entropy")


def test_triplet_margin_loss_with_no_features_is_torchs_value():
    a, p, n = (torch.randn(4, 0, requires_grad=True) for _ in range(3))
    for red in ("none", "mean", "sum"):
        expected = F.triplet_margin_loss(a, p, n, reduction=red)
        got = SF.triplet_margin_loss(a, p, n, reduction=red)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(SF.triplet_margin_with_distance_loss(a, p, n, reduction=red), expected)
    SF.triplet_margin_loss(a, p, n).backward()


_L, _H, _B, _F32 = torch.int64, torch.float16, torch.bfloat16, torch.float32


@pytest.mark.parametrize("dtypes", [(_L, _H, _L), (_L, _L, _H), (_L, _H, _H), (_H, _L, _L), (_L, _B, _H), (_B, _L, _L)],
                         ids=str)
@pytest.mark.parametrize("swap", [False, True])
def test_triplet_mixed_integer_and_half_dtype_is_torchs(dtypes, swap):
    # torch's dtype is its distances': an integer pair's difference + eps is the default dtype
    a, p, n = ((torch.rand(4, 3) * 5).to(d) for d in dtypes)
    expected = F.triplet_margin_loss(a, p, n, swap=swap)
    got = SF.triplet_margin_loss(a, p, n, swap=swap)
    assert got.dtype == expected.dtype
    exact = F.triplet_margin_loss(a.double(), p.double(), n.double(), swap=swap)
    torch.testing.assert_close(got.double(), exact, rtol=1e-2, atol=1e-2)
    # the default distance of triplet_margin_with_distance_loss is the same pairwise distance
    expected = F.triplet_margin_with_distance_loss(a, p, n, swap=swap)
    got = SF.triplet_margin_with_distance_loss(a, p, n, swap=swap)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.double(), exact, rtol=1e-2, atol=1e-2)


def _double_distance(a, b):
    return (a - b).double().norm(dim=-1)


def _half_distance(a, b):
    return (a - b).norm(dim=-1).half()


def _float_distance(a, b):
    return (a - b).float().norm(dim=-1)


@pytest.mark.parametrize("dtype", [_F32, torch.float64, _H, _B], ids=str)
@pytest.mark.parametrize("distance", [_double_distance, _half_distance, _float_distance], ids=lambda f: f.__name__)
def test_triplet_with_distance_result_dtype_is_the_distances(dtype, distance):
    # torch's loss has the dtype of the user's distances: float64 ones gave float32 (rounded)
    if distance is _float_distance and dtype in (_H, _B):
        pytest.skip("float32 distances of half inputs: the half rule (the input's dtype) holds")
    g = torch.Generator().manual_seed(2)
    a, p, n = (torch.randn(4, 3, generator=g).to(dtype) for _ in range(3))
    expected = F.triplet_margin_with_distance_loss(a, p, n, distance_function=distance, reduction="none")
    got = SF.triplet_margin_with_distance_loss(a, p, n, distance_function=distance, reduction="none")
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    if dtype in (_F32, torch.float64):  # no upcast: torch's computation
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtypes", [(_L, _H), (_L, _B), (_H, _L), (_L, _F32), (_L, _L)], ids=str)
def test_poisson_nll_integer_input_dtype_is_torchs(dtypes):
    # torch's exp(input) (or input + eps) of an integer input is the default float dtype
    x, y = (torch.rand(4, 3) * 3).to(dtypes[0]), (torch.rand(4, 3) * 3).to(dtypes[1])
    for kw in ({}, {"log_input": False}, {"full": True}):
        expected = F.poisson_nll_loss(x, y, **kw)
        got = SF.poisson_nll_loss(x, y, **kw)
        assert got.dtype == expected.dtype
        exact = F.poisson_nll_loss(x.double(), y.double(), **kw)
        torch.testing.assert_close(got.double(), exact, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_poisson_nll_zero_count_at_a_zero_rate_is_0_not_nan(full, reduction):
    # log_input=False, eps=0: torch's input - target·log(input + eps) is 0·log 0 = NaN at a zero
    # rate with a zero count, whose likelihood is 1 (loss 0, d/d rate = 1); as xlogy it is 0
    x = torch.tensor([0.0, 0.0, 2.0, 0.5], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0.0, 3.0, 0.0, 4.0], dtype=torch.float64)
    kw = {"log_input": False, "eps": 0.0, "full": full, "reduction": reduction}
    got = SF.poisson_nll_loss(x, y, **kw)
    want = F.poisson_nll_loss(x.detach(), y, **{**kw, "reduction": "none"})
    assert torch.isnan(want[0]) and want[1] == math.inf  # torch's; the exact values are 0 and inf
    want = torch.cat([torch.zeros(1, dtype=torch.float64), want[1:]])
    if reduction != "none":
        want = want.sum() / (4 if reduction == "mean" else 1)
    torch.testing.assert_close(got, want)
    (g,) = torch.autograd.grad(SF.poisson_nll_loss(x, y, **{**kw, "reduction": "sum"}), x)
    assert g[0] == 1.0
    rest = x[2:].detach().clone().requires_grad_()
    (want_g,) = torch.autograd.grad(F.poisson_nll_loss(rest, y[2:], **{**kw, "reduction": "sum"}), rest)
    torch.testing.assert_close(g[2:], want_g)  # elsewhere torch's


@pytest.mark.parametrize("shape", [(), (1,), (3,)], ids=str)
@pytest.mark.parametrize("p, swap", [(2.0, False), (2.0, True), (1.0, False), (3.0, True), (math.inf, False)])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_triplet_losses_on_one_triplet_are_torchs(shape, p, swap, reduction):
    # a 0-dim triplet is one feature (torch's norm over dim -1 of a scalar), a 1-dim one one vector
    g = torch.Generator().manual_seed(0)
    ours = [torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    theirs = [t.detach().clone().requires_grad_(True) for t in ours]
    calls = [(SF.triplet_margin_loss, F.triplet_margin_loss, {"p": p, "swap": swap, "margin": 2.0})]
    if p == 2.0:
        calls.append((SF.triplet_margin_with_distance_loss, F.triplet_margin_with_distance_loss,
                      {"swap": swap, "margin": 2.0}))
    for sf, tf, kw in calls:
        got, want = sf(*ours, reduction=reduction, **kw), tf(*theirs, reduction=reduction, **kw)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
        for a, b in zip(torch.autograd.grad(got, ours), torch.autograd.grad(want, theirs)):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("shape", [(2, 3), (3,), ()], ids=str)
def test_triplet_double_backward_is_finite_at_a_zero_distance(p, shape):
    # vector_norm's second derivative at 0 is NaN; the distance's is defined (0 there), while
    # the value and first gradient stay torch's (0 at the zero distance)
    a = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    pos, neg = torch.zeros(shape, dtype=torch.float64), torch.ones(shape, dtype=torch.float64)
    margins = {"inactive": 0.5, "active": 3.0}
    for margin in margins.values():
        calls = [(SF.triplet_margin_loss, F.triplet_margin_loss, (a, pos, neg),
                  {"eps": 0.0, "p": p, "margin": margin})]
        if p == 2.0:  # the default distance adds eps = 1e-6: a positive 1e-6 below a is at 0
            calls.append((SF.triplet_margin_with_distance_loss, F.triplet_margin_with_distance_loss,
                          (a, pos - 1e-6, neg), {"margin": margin}))
        for sf, tf, args, kw in calls:
            loss = sf(*args, **kw)
            torch.testing.assert_close(loss, tf(*args, **kw))
            (g,) = torch.autograd.grad(loss, a, create_graph=True)
            torch.testing.assert_close(g, torch.autograd.grad(tf(*args, **kw), a)[0])
            (h,) = torch.autograd.grad(g.sum(), a)
            assert torch.isfinite(h).all()
            if margin == margins["inactive"] or p in (1.0, math.inf):
                assert torch.equal(h, torch.zeros_like(h))  # no curvature: a flat hinge, or a piecewise-linear norm


@pytest.mark.parametrize("p", [1.0, 0.5, 1.1, 2.0, 3.0])
def test_triplet_distance_keeps_an_entry_far_below_the_largest(p):
    # a float32 row of 1e30 beside 1e-20: divided by the largest entry, 1e-20 underflowed to 0
    # and lost its gradient (p = 1: 0 where the exact one is 1; p = 1.1: 1e-5) or, for p < 1,
    # its share of the value; scaled only as far as the powers need, it keeps both
    a = torch.tensor([[1e30, 1e-20]], requires_grad=True)
    pos, neg = torch.zeros(1, 2), torch.tensor([[1e30, 1.0]])
    a64 = a.detach().double().requires_grad_()
    exact = F.triplet_margin_loss(a64, pos.double(), neg.double(), p=p, eps=0.0)
    (exact_grad,) = torch.autograd.grad(exact, a64)
    distance = torch.nn.PairwiseDistance(p, 0.0)
    for got in (SF.triplet_margin_loss(a, pos, neg, p=p, eps=0.0),
                SF.triplet_margin_with_distance_loss(a, pos, neg, distance_function=distance)):
        torch.testing.assert_close(got, exact.float())
        torch.testing.assert_close(torch.autograd.grad(got, a)[0], exact_grad.float())


@pytest.mark.parametrize("p", [1.0, 1.5, 2.0, 3.0, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triplet_distance_of_representable_powers_is_torchs_to_the_bit(p, dtype):
    # rows whose powers do not overflow are not scaled: torch's float32 value, bit for bit, so
    # its bfloat16 rounding too (scaled by the largest entry, a distance of 59901 was 1 ulp
    # off, and the cancelling bfloat16 loss 0.0352 where torch's is 0.0391)
    g = torch.Generator().manual_seed(5)
    a, pos, neg = (torch.randn(64, 5, generator=g).mul(100).to(dtype) for _ in range(3))
    want = F.triplet_margin_loss(a.float(), pos.float(), neg.float(), p=p, margin=0.001, reduction="none").to(dtype)
    got = SF.triplet_margin_loss(a, pos, neg, p=p, margin=0.001, reduction="none")
    assert torch.equal(got, want)
    a3, pos3, neg3 = (torch.tensor([v]).to(dtype) for v in (
        [0.0796, 0.1001, 3.0], [-1.0, 100.0, 59904.0], [1.0e-7, -70.5, 59904.0]))
    want = F.triplet_margin_with_distance_loss(a3.float(), pos3.float(), neg3.float(), margin=0.001).to(dtype)
    assert torch.equal(SF.triplet_margin_with_distance_loss(a3, pos3, neg3, margin=0.001), want)


def test_triplet_double_backward_is_torchs_away_from_zero():
    g = torch.Generator().manual_seed(3)
    a, pos, neg = (torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(3))
    torch.autograd.gradgradcheck(lambda x: SF.triplet_margin_loss(x, pos, neg, margin=3.0), (a.requires_grad_(),))
    ours = torch.autograd.functional.hessian(lambda x: SF.triplet_margin_loss(x, pos, neg, margin=3.0), a)
    theirs = torch.autograd.functional.hessian(lambda x: F.triplet_margin_loss(x, pos, neg, margin=3.0), a)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_hinge_embedding_nan_target_gives_nan(reduction):
    # torch reads a NaN target as neither 1 nor -1 and adds both terms: 1.0 for input 0.5
    x = torch.tensor([[0.5, 2.0, 0.3]], requires_grad=True)
    y = torch.tensor([[float("nan"), 1.0, -1.0], [1.0, -1.0, 1.0]])
    assert torch.isfinite(F.hinge_embedding_loss(x, y, reduction=reduction)).all()
    out = SF.hinge_embedding_loss(x, y, reduction=reduction)
    if reduction == "none":
        assert torch.isnan(out[0, 0]) and torch.isfinite(out.flatten()[1:]).all()
        ordinary = F.hinge_embedding_loss(x, y.nan_to_num(1.0), reduction="none")
        assert torch.equal(out.flatten()[1:], ordinary.flatten()[1:])
    else:
        assert torch.isnan(out)
    (g,) = torch.autograd.grad(out.nansum(), x)
    assert torch.isfinite(g[0, 1:]).all()


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("target_dtype", [torch.int64, torch.float32], ids=str)
def test_hinge_embedding_integer_input_is_torchs(reduction, target_dtype):
    # torch's loss of an integer input is an integer ('none', 'sum') or its RuntimeError
    # ('mean'); the NaN-target select made ours float32
    x, y = torch.tensor([[1, 2, 0]]), torch.tensor([[1, -1, -1]], dtype=target_dtype)
    try:
        want = F.hinge_embedding_loss(x, y, reduction=reduction)
    except RuntimeError:
        with pytest.raises(RuntimeError, match="hinge_embedding_loss: .*Long"):
            SF.hinge_embedding_loss(x, y, reduction=reduction)
        return
    got = SF.hinge_embedding_loss(x, y, reduction=reduction)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)


@pytest.mark.slow
def test_weighted_l1_loss_compiled_keeps_its_weight():
    # compiled, torch 2.13's F.l1_loss drops weight= (the unweighted value, no weight gradient);
    # ours writes torch's eager formula, so compiled equals eager, gradient included
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    w = (torch.rand(4, 3, generator=g) + 0.5).requires_grad_()
    for reduction in ("none", "mean", "sum"):
        def f(a, b, w, reduction=reduction):
            return SF.l1_loss(a, b, weight=w, reduction=reduction)
        torch._dynamo.reset()
        got, want = torch.compile(f, fullgraph=True)(a, b, w), f(a, b, w)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), w)[0], torch.autograd.grad(want.sum(), w)[0])
    if "weight" in inspect.signature(F.l1_loss).parameters:  # torch >= 2.13: eager parity
        torch.testing.assert_close(SF.l1_loss(a, b, weight=w), F.l1_loss(a, b, weight=w))


@pytest.mark.slow
@pytest.mark.parametrize("target", [0, -1])
def test_multilabel_margin_of_one_score_compiles(target):
    # torch's OpInfo has 0-d samples: the traced formula indexed the class dim of a 0-d input
    x, t = torch.tensor(5.16), torch.tensor(target)
    for reduction in ("none", "mean", "sum"):
        got = torch.compile(lambda a, b: SF.multilabel_margin_loss(a, b, reduction=reduction), fullgraph=True)(x, t)
        want = F.multilabel_margin_loss(x, t, reduction=reduction)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
