"""The torch.nn catalog contract (design: Every torch.nn loss), checked from outside:
every torch.nn loss class and functional loss has its stablelosses twin with torch's signature,
equal to torch wherever torch is finite, and the hazards torch still has are fixed as stated.
"""

from __future__ import annotations

import copy
import inspect
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stablelosses as sl
import stablelosses.functional as SF

D = torch.float64
INF = math.inf
CLASSES = sorted(n for n in dir(nn) if n.endswith("Loss") and n != "AdaptiveLogSoftmaxWithLoss")
FUNCTIONS = sorted(
    n for n in dir(F)
    if n.endswith("_loss") or n in ("binary_cross_entropy", "binary_cross_entropy_with_logits",
                                    "cross_entropy", "kl_div", "nll_loss")
)


@pytest.mark.parametrize("name", CLASSES)
def test_every_torch_loss_class_has_a_twin(name):
    ours = getattr(sl, name)
    assert issubclass(ours, nn.modules.loss._Loss)
    theirs = getattr(nn, name)
    tp = list(inspect.signature(theirs.__init__).parameters)
    op = list(inspect.signature(ours.__init__).parameters)
    positional = [p for p in tp if p not in ("size_average", "reduce")]
    assert op[: len(positional)] == positional or all(p in op for p in positional), (tp, op)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_every_torch_loss_function_has_a_twin_with_its_signature(name):
    ours = getattr(SF, name)
    tsig = inspect.signature(getattr(F, name))
    osig = inspect.signature(ours)
    for p in tsig.parameters.values():
        assert p.name in osig.parameters, (name, p.name)
        q = osig.parameters[p.name]
        if p.default is not inspect.Parameter.empty:
            assert q.default == p.default or (q.default is None and p.default is None), (name, p.name)
    tpos = [p.name for p in tsig.parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in ("size_average", "reduce")]
    opos = [p.name for p in osig.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert opos[: len(tpos)] == tpos or [n for n in opos if n in tpos] == tpos, (name, tpos, opos)


def _samples(dtype):
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=dtype)

    N, C = 4, 5
    x, y = r(N, C), r(N, C)
    prob = torch.rand(N, C, generator=g, dtype=dtype) * 0.98 + 0.01
    lab01 = (torch.rand(N, C, generator=g) > 0.5).to(dtype)
    sign = torch.where(torch.rand(N, generator=g) > 0.5, 1.0, -1.0).to(dtype)
    signNC = torch.where(torch.rand(N, C, generator=g) > 0.5, 1.0, -1.0).to(dtype)
    cls = torch.randint(0, C, (N,), generator=g)
    ml = torch.tensor([[1, 3, -1, 0, 0], [0, -1, 2, 2, 2], [4, 2, 1, 0, -1], [-1, 0, 0, 0, 0]])
    logp = torch.log_softmax(r(N, C), 1)
    var = torch.rand(N, C, generator=g, dtype=dtype) + 0.1
    return [
        ("l1_loss", (x, y), {}),
        ("l1_loss", (x, y), {"weight": torch.rand(N, C, generator=g, dtype=dtype)}),
        ("mse_loss", (x, y), {}),
        ("huber_loss", (x, y), {"delta": 0.7}),
        ("smooth_l1_loss", (x, y), {"beta": 0.5}),
        ("nll_loss", (logp, cls), {"weight": torch.rand(C, generator=g, dtype=dtype) + 0.1}),
        ("nll_loss", (logp, cls), {"ignore_index": 2}),
        ("poisson_nll_loss", (x, prob * 3), {}),
        ("poisson_nll_loss", (prob * 2, prob * 3), {"log_input": False, "full": True}),
        ("gaussian_nll_loss", (x, y, var), {}),
        ("gaussian_nll_loss", (x, y, var[:, :1]), {"full": True}),
        ("binary_cross_entropy", (prob, lab01), {}),
        ("binary_cross_entropy", (prob, prob.flip(0)), {"weight": var}),
        ("binary_cross_entropy_with_logits", (x, lab01), {}),
        ("binary_cross_entropy_with_logits", (x, prob), {"weight": var, "pos_weight": var[0] + 0.5}),
        ("cosine_embedding_loss", (x, y, sign), {"margin": 0.2}),
        ("hinge_embedding_loss", (x, signNC), {"margin": 0.5}),
        ("margin_ranking_loss", (x[:, 0], y[:, 0], sign), {"margin": 0.1}),
        ("multi_margin_loss", (x, cls), {}),
        ("multi_margin_loss", (x, cls), {"p": 2, "margin": 0.5, "weight": var[0]}),
        ("multilabel_margin_loss", (x, ml), {}),
        ("multilabel_soft_margin_loss", (x, lab01), {}),
        ("multilabel_soft_margin_loss", (x, lab01), {"weight": var[0]}),
        ("soft_margin_loss", (x, signNC), {}),
        ("triplet_margin_loss", (x, y, r(N, C)), {"margin": 0.5, "p": 2.0}),
        ("triplet_margin_loss", (x, y, r(N, C)), {"swap": True, "p": 1.0}),
        ("triplet_margin_with_distance_loss", (x, y, r(N, C)), {"margin": 0.3}),
        ("kl_div", (logp, prob), {}),
        ("cross_entropy", (x, cls), {}),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_every_function_equals_torch_on_valid_inputs(dtype, reduction):
    for name, args, kw in _samples(dtype):
        kw = dict(kw, reduction=reduction)
        # the input takes a gradient (targets are compared in the family tests)
        a1 = [args[0].clone().requires_grad_(True), *args[1:]]
        a2 = [args[0].clone().requires_grad_(True), *args[1:]]
        want = getattr(F, name)(*a1, **kw)
        got = getattr(SF, name)(*a2, **kw)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        torch.testing.assert_close(got, want, msg=name)
        want.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(a2[0].grad, a1[0].grad, msg=name)


def test_ctc_equals_torch_on_feasible_samples():
    g = torch.Generator().manual_seed(1)
    T, N, C, S = 12, 3, 6, 4
    lp = torch.log_softmax(torch.randn(T, N, C, generator=g, dtype=D), 2)
    tg = torch.randint(1, C, (N, S), generator=g)
    il = torch.tensor([12, 10, 9])
    tl = torch.tensor([4, 3, 2])
    for red in ("none", "mean", "sum"):
        a = lp.clone().requires_grad_(True)
        b = lp.clone().requires_grad_(True)
        want = F.ctc_loss(a, tg, il, tl, reduction=red)
        got = SF.ctc_loss(b, tg, il, tl, reduction=red)
        torch.testing.assert_close(got, want)
        want.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(b.grad, a.grad)


def test_ctc_impossible_sample_is_inf_with_exactly_zero_gradient():
    g = torch.Generator().manual_seed(2)
    T, C = 3, 5
    lp = torch.log_softmax(torch.randn(T, 2, C, generator=g, dtype=D), 2).requires_grad_(True)
    tg = torch.tensor([[1, 1, 1, 1], [2, 3, 0, 0]])  # sample 0 needs 7 frames (repeats), has 3
    il = torch.tensor([3, 3])
    tl = torch.tensor([4, 2])
    val = SF.ctc_loss(lp, tg, il, tl, reduction="none")
    assert val[0] == INF and torch.isfinite(val[1])
    out = SF.ctc_loss(lp, tg, il, tl, reduction="sum")
    out.backward()
    assert not torch.isnan(lp.grad).any()
    assert (lp.grad[:, 0] == 0).all()
    lp2 = lp.detach().clone().requires_grad_(True)
    F.ctc_loss(lp2, tg, il, tl, reduction="sum", zero_infinity=True).backward()
    torch.testing.assert_close(lp.grad[:, 1], lp2.grad[:, 1])
    z = SF.ctc_loss(lp.detach(), tg, il, tl, reduction="none", zero_infinity=True)
    assert z[0] == 0


@pytest.mark.parametrize("x,t,want", [(INF, 1.0, 0.0), (-INF, 0.0, 0.0), (-INF, 0.9, INF), (INF, 0.0, INF)])
def test_bce_with_logits_limits_at_infinite_logits(x, t, want):
    xi = torch.tensor([x], dtype=D, requires_grad=True)
    ti = torch.tensor([t], dtype=D)
    pw = torch.tensor([2.0], dtype=D)
    w = torch.tensor([1.5], dtype=D)
    val = SF.binary_cross_entropy_with_logits(xi, ti, weight=w, pos_weight=pw, reduction="none")
    assert val.item() == want
    val.sum().backward()
    # the limit of w·((1−t)·σ(x) − pw·t·σ(−x)): w·(1−t) at +inf, −w·pw·t at −inf
    g = 1.5 * (1 - t) if x > 0 else -1.5 * 2.0 * t
    assert xi.grad.item() == pytest.approx(g)


def test_bce_with_logits_gradients_for_weight_pos_weight_and_target():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, generator=g, dtype=D, requires_grad=True)
    t = torch.rand(3, 4, generator=g, dtype=D, requires_grad=True)
    w = (torch.rand(3, 4, generator=g, dtype=D) + 0.5).requires_grad_(True)
    pw = (torch.rand(4, generator=g, dtype=D) + 0.5).requires_grad_(True)
    torch.autograd.gradcheck(
        lambda x, t, w, pw: SF.binary_cross_entropy_with_logits(x, t, weight=w, pos_weight=pw), (x, t, w, pw)
    )


def test_gaussian_nll_variance_floor_gradient_is_the_derivative_of_the_value():
    x = torch.tensor([1.0, 1.0], dtype=D)
    y = torch.tensor([0.0, 0.0], dtype=D)
    var = torch.tensor([1e-12, 0.5], dtype=D, requires_grad=True)
    val = SF.gaussian_nll_loss(x, y, var, reduction="none")
    want = F.gaussian_nll_loss(x, y, var.detach(), reduction="none")
    torch.testing.assert_close(val, want)
    val.sum().backward()
    assert var.grad[0] == 0
    v2 = var.detach().clone().requires_grad_(True)
    F.gaussian_nll_loss(x, y, v2, reduction="none").sum().backward()
    torch.testing.assert_close(var.grad[1], v2.grad[1])


def test_cosine_embedding_zero_vector_has_zero_gradient():
    a = torch.zeros(2, 3, requires_grad=True)
    b = torch.randn(2, 3, requires_grad=True)
    y = torch.tensor([1.0, -1.0])
    SF.cosine_embedding_loss(a, b, y).backward()
    assert (a.grad == 0).all() and torch.isfinite(b.grad).all()


@pytest.mark.parametrize("m", [1e4, -1e4, 1e30, -1e30])
def test_soft_margin_losses_do_not_overflow(m):
    x = torch.tensor([[m, -m]], requires_grad=True)
    y = torch.tensor([[1.0, 1.0]])
    val = SF.soft_margin_loss(x, y, reduction="none")
    want = F.softplus(-x.detach().double())  # log(1 + e^{-x}) at y = 1, linear past its threshold
    torch.testing.assert_close(val.detach().double(), want, rtol=1e-6, atol=0)
    val.sum().backward()
    assert torch.isfinite(x.grad).all()
    x2 = x.detach().clone().requires_grad_(True)
    v2 = SF.multilabel_soft_margin_loss(x2, torch.tensor([[1.0, 0.0]]))
    v2.backward()
    assert torch.isfinite(v2) and torch.isfinite(x2.grad).all()


def test_nll_loss_neg_inf_at_ignored_or_zero_weight_positions_contributes_zero():
    lp = torch.tensor([[-INF, -0.5, -1.0], [-0.2, -0.7, -3.0], [-1.0, -1.0, -INF]], dtype=D,
                      requires_grad=True)
    t = torch.tensor([0, 1, 2])  # row 0 ignored at a -inf, row 2 of weight 0 at a -inf
    w = torch.tensor([1.0, 2.0, 0.0], dtype=D)
    for red, want in (("sum", 1.4), ("mean", 0.7)):
        lp.grad = None
        val = SF.nll_loss(lp, t, weight=w, ignore_index=0, reduction=red)
        assert val.item() == pytest.approx(want)
        val.backward()
        assert torch.isfinite(lp.grad).all() and lp.grad[0].eq(0).all() and lp.grad[2].eq(0).all()
    val = SF.nll_loss(lp.detach(), torch.tensor([0, 1, 0]), weight=w, ignore_index=2, reduction="none")
    assert val[0].item() == INF  # a real -inf log-prob at a weighted target is +inf


def test_nan_in_nan_out_wins_over_parity_for_the_margin_losses():
    x = torch.tensor([[0.1, float("nan"), 0.3], [0.2, 0.1, 0.0]])
    out = SF.multi_margin_loss(x, torch.tensor([0, 1]), reduction="none")
    assert torch.isnan(out[0]) and torch.isfinite(out[1])
    out = SF.multilabel_margin_loss(x, torch.tensor([[0, -1, 0], [1, -1, 0]]), reduction="none")
    assert torch.isnan(out[0]) and torch.isfinite(out[1])


@pytest.mark.parametrize("name", CLASSES)
def test_modules_state_dict_repr_deepcopy_pickle(name):
    args = (8, 10) if name == "LinearCrossEntropyLoss" else ()
    theirs = getattr(nn, name)(*args)
    ours = getattr(sl, name)(*args)
    assert repr(ours).startswith(f"{name}(")
    assert set(ours.state_dict()) == set(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    copy.deepcopy(ours)
    pickle.loads(pickle.dumps(ours))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_torch_float32_rounded(dtype):
    for name, args, kw in _samples(torch.float32):
        if name in ("cross_entropy", "kl_div"):
            continue
        ah = [a.to(dtype) if a.is_floating_point() else a for a in args]
        kh = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()}
        kf = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kh.items()}
        got = getattr(SF, name)(*ah, **kh)
        want = getattr(F, name)(*[a.float() if a.is_floating_point() else a for a in ah], **kf)
        assert got.dtype == dtype, name
        torch.testing.assert_close(got, want.to(dtype), msg=name)
