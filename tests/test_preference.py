"""dpo_loss, orpo_loss, simpo_loss, cpo_loss, kto_loss: TRL's formulas (transcribed below in
float64, never importing the code under test) on ordinary inputs, the exact log-sigmoid tails
against mpmath, the public failing inputs, gradcheck, the modules, the argument checks."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_compiled_matches_eager
from hypothesis import given, settings
from hypothesis import strategies as st

import stablelosses as sl
import stablelosses.functional as SF

mpmath.mp.dps = 60
D = torch.float64


# --- TRL's formulas, transcribed (float64) ------------------------------------------------------
# trl/trainer/dpo_trainer.py DPOTrainer._compute_loss (cDPO's smoothing: DPOTrainer.dpo_loss of
# earlier releases); trl/experimental/orpo/orpo_trainer.py ORPOTrainer.odds_ratio_loss;
# trl/experimental/cpo/cpo_trainer.py CPOTrainer.cpo_loss; trl/trainer/kto_trainer.py
# KTOTrainer._compute_loss.


def trl_dpo(c, r, rc, rr, beta, loss_type, ls):
    clr, rlr = c - rc, r - rr
    delta = clr - rlr
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta) * (1 - ls) - F.logsigmoid(-beta * delta) * ls
    if loss_type == "robust":
        clean = -(1 - ls) * F.logsigmoid(beta * delta)
        flipped = -ls * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * ls)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type == "ipo":
        return (delta - 1 / (2 * beta)) ** 2
    if loss_type == "apo_zero":
        return (1 - torch.sigmoid(beta * clr)) + torch.sigmoid(beta * rlr)
    return torch.sigmoid(beta * clr) + (1 - torch.sigmoid(beta * delta))  # apo_down


def trl_log1mexp(x):
    # TRL's log1mexp (Mächler): log(-expm1(x)) above -log 2, log1p(-exp(x)) below
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def trl_orpo(c, r, beta):
    log_odds = (c - r) - (trl_log1mexp(c) - trl_log1mexp(r))
    return -beta * F.logsigmoid(log_odds)


def trl_cpo(c, r, beta, ls, simpo_gamma=None):
    logits = c - r
    if simpo_gamma is not None:
        logits = logits - simpo_gamma / beta
    return -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls


def trl_kto(p, ref, desirable, kl, beta, wd, wu):
    lr = p - ref
    chosen = 1 - torch.sigmoid(beta * (lr[desirable] - kl))
    rejected = 1 - torch.sigmoid(beta * (kl - lr[~desirable]))
    return torch.cat((wd * chosen, wu * rejected), 0)


def _logps(n, seed, dtype=D, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return [(-scale * torch.rand(n, generator=g, dtype=D) - 0.05).to(dtype).requires_grad_() for _ in range(4)]


def _check(ours, ref, inputs, rtol, atol):
    """``ours(*inputs)`` against ``ref`` on float64 copies: value and every input's gradient."""
    copies = [x.detach().double().requires_grad_() for x in inputs]
    out, want = ours(*inputs), ref(*copies)
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol)
    g = torch.autograd.grad(out.sum(), inputs)
    g_ref = torch.autograd.grad(want.sum(), copies)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=atol)


# --- values and gradients on ordinary inputs ----------------------------------------------------

DPO_CASES = [("sigmoid", 0.0), ("sigmoid", 0.1), ("robust", 0.0), ("robust", 0.2), ("hinge", 0.0),
             ("ipo", 0.0), ("apo_zero", 0.0), ("apo_down", 0.0)]


@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float64, 1e-12, 1e-13), (torch.float32, 1e-6, 1e-6)])
@pytest.mark.parametrize("loss_type, ls", DPO_CASES)
def test_dpo_matches_trl(loss_type, ls, dtype, rtol, atol):
    xs = _logps(7, 1, dtype)
    ref_in = [x.detach().double().requires_grad_() for x in xs]
    out = SF.dpo_loss(*xs, beta=0.3, loss_type=loss_type, label_smoothing=ls, reduction="none")
    ref = trl_dpo(*ref_in, 0.3, loss_type, ls)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)
    g = torch.autograd.grad(out.sum(), xs)
    g_ref = torch.autograd.grad(ref.sum(), ref_in)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float64, 1e-12, 1e-13), (torch.float32, 1e-6, 1e-6)])
def test_orpo_simpo_cpo_kto_match_trl(dtype, rtol, atol):
    c, r, rc, rr = _logps(9, 2, dtype, scale=1.0)
    _check(lambda a, b: SF.orpo_loss(a, b, beta=0.2, reduction="none"), lambda a, b: trl_orpo(a, b, 0.2),
           (c, r), rtol, atol)
    _check(lambda a, b: SF.simpo_loss(a, b, beta=2.0, gamma_beta_ratio=0.25, label_smoothing=0.1, reduction="none"),
           lambda a, b: trl_cpo(a, b, 2.0, 0.1, simpo_gamma=0.5), (c, r), rtol, atol)
    _check(lambda a, b: SF.cpo_loss(a, b, beta=0.5, label_smoothing=0.2, reduction="none"),
           lambda a, b: trl_cpo(a, b, 0.5, 0.2), (c, r), rtol, atol)
    rc64, rr64 = rc.detach().double(), rr.detach().double()
    desirable = torch.tensor([True, False, True, True, False, False, True, False, True])
    out = SF.kto_loss(rc, rr, desirable, kl=0.3, beta=0.7, desirable_weight=1.5, undesirable_weight=0.5,
                      reduction="none")
    ref = trl_kto(rc64, rr64, desirable, 0.3, 0.7, 1.5, 0.5)
    order = torch.cat([torch.nonzero(desirable).squeeze(1), torch.nonzero(~desirable).squeeze(1)])
    torch.testing.assert_close(out[order].double(), ref, rtol=rtol, atol=atol)
    # TRL's loss is the mean over the concatenated losses
    mean = SF.kto_loss(rc, rr, desirable, kl=0.3, beta=0.7, desirable_weight=1.5, undesirable_weight=0.5)
    torch.testing.assert_close(mean.double(), ref.mean(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_reductions(reduction):
    c, r, rc, rr = _logps(5, 3)
    per = SF.dpo_loss(c, r, rc, rr, reduction="none")
    out = SF.dpo_loss(c, r, rc, rr, reduction=reduction)
    want = {"none": per, "mean": per.mean(), "sum": per.sum()}[reduction]
    torch.testing.assert_close(out, want)


def test_empty_batch_mean_is_zero_with_zero_gradient():
    e = torch.zeros(0, dtype=D, requires_grad=True)
    for out in (SF.dpo_loss(e, e, e, e), SF.orpo_loss(e, e), SF.simpo_loss(e, e), SF.cpo_loss(e, e),
                SF.kto_loss(e, e, torch.zeros(0, dtype=torch.bool))):
        assert out.item() == 0.0
        (g,) = torch.autograd.grad(out, e)
        assert g.shape == (0,)


# --- exact log-sigmoid tails ------------------------------------------------------------------


def _mp_logsigmoid(z: float) -> float:
    return float(-mpmath.log1p(mpmath.exp(-mpmath.mpf(z))))


def _ulps(a: float, b: float, dtype: torch.dtype) -> float:
    if a == b:
        return 0.0
    spacing = abs(torch.nextafter(torch.tensor(b, dtype=dtype), torch.tensor(math.inf, dtype=dtype)).item() - b)
    return abs(a - b) / max(spacing, torch.finfo(dtype).tiny)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("z", [1e4, -1e4, 1e30, -1e30, 30.0, -30.0, 17.0, -0.5, 1e-3])
def test_logsigmoid_tails_within_4_ulp_of_mpmath(z, dtype):
    zero = torch.zeros(1, dtype=dtype)
    c = torch.tensor([z], dtype=dtype, requires_grad=True)
    # beta = 1: the loss is -log σ(c)
    out = SF.dpo_loss(c, zero, zero, zero, beta=1.0, reduction="sum")
    want = -_mp_logsigmoid(z)
    assert _ulps(out.item(), torch.tensor(want, dtype=dtype).item(), dtype) <= 4
    (g,) = torch.autograd.grad(out, c)
    want_g = -float(1 / (1 + mpmath.exp(mpmath.mpf(z))))  # -σ(-z)
    assert torch.isfinite(g).all()
    assert _ulps(g.item(), torch.tensor(want_g, dtype=dtype).item(), dtype) <= 4 or abs(want_g) < 1e-300


@settings(max_examples=30, deadline=None)
@given(m=st.sampled_from([1e4, -1e4, 1e30, -1e30, 0.0, 88.0, -88.0]) | st.floats(-1e30, 1e30),
       beta=st.sampled_from([0.1, 1.0, 2.0]), ls=st.sampled_from([0.0, 0.1, 0.4]),
       loss_type=st.sampled_from(["sigmoid", "robust", "hinge", "apo_zero", "apo_down"]))
def test_finite_value_and_gradient_at_any_margin(m, beta, ls, loss_type):
    c = torch.tensor([m / 2], requires_grad=True)
    r = torch.tensor([-m / 2], requires_grad=True)
    zero = torch.zeros(1)
    out = SF.dpo_loss(c, r, zero, zero, beta=beta, loss_type=loss_type, label_smoothing=ls)
    g = torch.autograd.grad(out, (c, r))
    assert torch.isfinite(out)
    assert all(torch.isfinite(x).all() for x in g)
    for fn in (lambda: SF.simpo_loss(c, r, beta=beta, label_smoothing=ls),
               lambda: SF.cpo_loss(c, r, beta=beta, label_smoothing=ls),
               lambda: SF.kto_loss(c, r, torch.tensor([m > 0]), beta=beta)):
        out = fn()
        g = torch.autograd.grad(out, (c, r))
        assert torch.isfinite(out) and all(torch.isfinite(x).all() for x in g)


def test_infinite_margin_with_zero_smoothing_is_not_nan():
    # 0 · log σ(−inf) would be NaN: the zero-weight term is left out
    c = torch.tensor([float("inf")], requires_grad=True)
    zero = torch.zeros(1)
    out = SF.dpo_loss(c, zero, zero, zero)
    assert out.item() == 0.0
    (g,) = torch.autograd.grad(out, c)
    assert g.item() == 0.0


# --- ORPO and log1mexp --------------------------------------------------------------------------


def _mp_orpo(c: float, r: float) -> float:
    c, r = mpmath.mpf(c), mpmath.mpf(r)
    lo = (c - r) - (mpmath.log(-mpmath.expm1(c)) - mpmath.log(-mpmath.expm1(r)))
    return float(mpmath.log1p(mpmath.exp(-lo)))


@pytest.mark.parametrize("c", [-1e-9, -1e-7, -1e-20, -0.3, -0.7, -5.0])
def test_orpo_near_zero_log_prob_is_exact(c):
    # ORPO at a chosen log-prob of -1e-9 (naive log1p(-exp) gives -inf) and -1e-7 (1% off)
    ct = torch.tensor([c], requires_grad=True)
    r = torch.tensor([-0.5], requires_grad=True)
    out = SF.orpo_loss(ct, r, beta=1.0, reduction="sum")
    want = _mp_orpo(c, -0.5)
    assert out.item() == pytest.approx(want, rel=2e-6, abs=1e-30)
    g = torch.autograd.grad(out, (ct, r))
    assert all(torch.isfinite(x).all() for x in g)
    naive = (ct - r) - (torch.log1p(-torch.exp(ct)) - torch.log1p(-torch.exp(r)))
    if c == -1e-9:
        assert torch.isinf(naive).all()  # the public failure this replaces


def test_orpo_gradient_matches_mpmath_near_zero():
    c, r = -1e-6, -0.5
    ct = torch.tensor([c], dtype=D, requires_grad=True)
    rt = torch.tensor([r], dtype=D, requires_grad=True)
    gc, gr = torch.autograd.grad(SF.orpo_loss(ct, rt, beta=1.0, reduction="sum"), (ct, rt))
    want_c = mpmath.diff(lambda x: mpmath.log1p(mpmath.exp(-((x - r) - (mpmath.log(-mpmath.expm1(x))
                                                                    - mpmath.log(-mpmath.expm1(r)))))), c)
    want_r = mpmath.diff(lambda y: mpmath.log1p(mpmath.exp(-((c - y) - (mpmath.log(-mpmath.expm1(c))
                                                                    - mpmath.log(-mpmath.expm1(y)))))), r)
    assert gc.item() == pytest.approx(float(want_c), rel=1e-10)
    assert gr.item() == pytest.approx(float(want_r), rel=1e-10)


def test_orpo_at_zero_log_prob_is_zero_with_the_limit_gradients():
    r = -0.5
    ct = torch.tensor([0.0], dtype=D, requires_grad=True)
    rt = torch.tensor([r], dtype=D, requires_grad=True)
    out = SF.orpo_loss(ct, rt, beta=0.5, reduction="sum")
    assert out.item() == 0.0
    gc, gr = torch.autograd.grad(out, (ct, rt))
    odds_r = math.exp(r) / -math.expm1(r)
    assert gc.item() == pytest.approx(-0.5 * odds_r, rel=1e-12)
    assert gr.item() == 0.0


@pytest.mark.parametrize("r", [-1.0, -0.5, -3.0])
def test_orpo_second_derivatives_at_zero_log_prob_are_the_limits(r):
    # ∂ℓ/∂c = −odds(r) / (e^c + (1 − e^c) odds(r)) is smooth through c = 0: its derivatives
    # there are odds(r)(1 − odds(r)) and −odds(r)/(1 − e^r); ∂ℓ/∂r is 0 along c = 0
    ct = torch.tensor([0.0], dtype=D, requires_grad=True)
    rt = torch.tensor([r], dtype=D, requires_grad=True)
    gc, gr = torch.autograd.grad(SF.orpo_loss(ct, rt, beta=1.0), (ct, rt), create_graph=True)
    hcc, hcr = torch.autograd.grad(gc.sum(), (ct, rt), retain_graph=True)
    hrc, hrr = torch.autograd.grad(gr.sum(), (ct, rt))
    o = math.exp(r) / -math.expm1(r)
    assert hcc.item() == pytest.approx(o * (1 - o), rel=1e-9)
    assert hcr.item() == pytest.approx(hrc.item(), rel=1e-12)
    assert hcr.item() == pytest.approx(-o / -math.expm1(r), rel=1e-9)
    assert hrr.item() == 0.0
    # continuous with the derivative just below 0, and the same from forward mode
    c2 = torch.tensor([-1e-9], dtype=D, requires_grad=True)
    (g2,) = torch.autograd.grad(SF.orpo_loss(c2, rt.detach(), beta=1.0), c2, create_graph=True)
    assert torch.autograd.grad(g2.sum(), c2)[0].item() == pytest.approx(hcc.item(), rel=1e-6)
    hess = torch.func.hessian(lambda a: SF.orpo_loss(a, rt.detach(), beta=1.0))(ct.detach())
    assert hess.item() == pytest.approx(hcc.item(), rel=1e-12)


@pytest.mark.parametrize("pair", [(-2.2695e-40, -2.4779e-40), (-2.4779e-40, -2.2695e-40), (-1e-39, -3.0)],
                         ids=["L>0", "L<0", "one-tiny"])
def test_orpo_float32_gradients_within_1e38_of_zero_are_representable(pair):
    # log-probs within 1e-38 of 0: the raw gradient (≈ 1/|c|) overflows float32, the gradient
    # of β·mean does not; it was -0 and NaN (e^t overflowed to inf, then inf/inf)
    c = torch.tensor([pair[0]], requires_grad=True)
    r = torch.tensor([pair[1]], requires_grad=True)
    got = torch.autograd.grad(SF.orpo_loss(c, r), (c, r))
    c64, r64 = (v.detach().double().requires_grad_() for v in (c, r))
    want = torch.autograd.grad(SF.orpo_loss(c64, r64), (c64, r64))
    for g, w in zip(got, want):
        assert torch.isfinite(w).all() and w.abs().max() < torch.finfo(torch.float32).max
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=0.0)


def test_orpo_float32_tangent_within_1e38_of_zero():
    # forward mode: each tangent inside its own product; ∂ℓ/∂r alone overflows float32 where r
    # is within 1e-38 of 0, and a zero r-tangent gave inf·0 = NaN
    def f(c, r):
        return SF.orpo_loss(c, r, beta=0.1, reduction="sum")

    c, r = torch.tensor([-1.0, -0.5]), torch.tensor([-1e-39, -1e-39])
    got = torch.func.jvp(f, (c, r), (torch.ones(2), torch.zeros(2)))[1]
    want = torch.func.jvp(f, (c.double(), r.double()), (torch.ones(2).double(), torch.zeros(2).double()))[1]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0.0)


def test_orpo_both_log_probs_zero_is_zero_with_zero_gradient():
    # two completions of probability 1 (two empty ones from sequence_logps(average=True)):
    # c = 0 gives 0 whatever r ≤ 0; the limit gradient −odds(r) has no finite limit at r = 0
    ct = torch.zeros(2, requires_grad=True)
    rt = torch.tensor([0.0, -1.0], requires_grad=True)
    out = SF.orpo_loss(ct, rt, reduction="none")
    assert torch.equal(out, torch.zeros(2))
    gc, gr = torch.autograd.grad(out.sum(), (ct, rt), create_graph=True)
    assert gc[0] == 0 and gr[0] == 0 and torch.isfinite(gc).all()
    assert all(torch.isfinite(h).all() for h in torch.autograd.grad(gc.sum(), (ct, rt)))
    assert torch.isnan(SF.orpo_loss(torch.zeros(1), torch.tensor([float("nan")])))


def test_orpo_nan_in_nan_out():
    c = torch.tensor([float("nan"), -0.5], requires_grad=True)
    out = SF.orpo_loss(c, torch.full((2,), -1.0), reduction="none")
    assert torch.isnan(out[0]) and torch.isfinite(out[1])


# --- empty groups and completions ----------------------------------------------------------------


def test_kto_batch_without_undesirable_example_is_finite():
    # TRL PR #1380 / #2554: an empty undesirable group made the KL term and the mean NaN
    p = torch.tensor([-3.0, -2.0, -1.0], requires_grad=True)
    ref = torch.tensor([-2.5, -2.5, -2.5])
    for desirable in (torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.bool)):
        out = SF.kto_loss(p, ref, desirable, kl=0.0)
        (g,) = torch.autograd.grad(out, p)
        assert torch.isfinite(out) and torch.isfinite(g).all()
        want = trl_kto(p.detach().double(), ref.double(), desirable, 0.0, 0.1, 1.0, 1.0).mean()
        assert out.item() == pytest.approx(want.item(), rel=1e-6)


def test_simpo_empty_completion_adds_zero_gradient():
    # TRL #3339: the length-normalised mean of an empty completion was 0/0
    x = torch.randn(2, 4, 7, requires_grad=True)
    labels = torch.tensor([[1, 2, 3, -100], [-100, -100, -100, -100]])
    logps = SF.sequence_logps(x, labels, average=True)
    out = SF.simpo_loss(logps[:1], logps[1:])
    out.backward()
    assert torch.isfinite(out)
    assert torch.isfinite(x.grad).all()
    assert torch.all(x.grad[1] == 0)


# --- dtypes, gradcheck, compile, modules, arguments ---------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_are_computed_in_float32(dtype):
    c, r, rc, rr = (x.detach().to(dtype).requires_grad_() for x in _logps(6, 4))
    out = SF.dpo_loss(c, r, rc, rr, reduction="none")
    assert out.dtype == torch.float32
    ref = trl_dpo(*(x.detach().float() for x in (c, r, rc, rr)), 0.1, "sigmoid", 0.0)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    (g,) = torch.autograd.grad(out.sum(), c)
    assert g.dtype == dtype
    out = SF.orpo_loss(c, r)
    assert out.dtype == torch.float32


def test_gradcheck_float64():
    c, r, rc, rr = _logps(4, 5)
    for loss_type in ("sigmoid", "robust", "ipo", "apo_zero", "apo_down"):
        assert torch.autograd.gradcheck(
            lambda *a: SF.dpo_loss(*a, loss_type=loss_type, label_smoothing=0.1 if loss_type == "robust" else 0.0,
                                   reduction="none"), (c, r, rc, rr))
    assert torch.autograd.gradcheck(lambda a, b: SF.orpo_loss(a, b, reduction="none"), (c, r))
    assert torch.autograd.gradgradcheck(lambda a, b: SF.orpo_loss(a, b, reduction="none"), (c, r))
    assert torch.autograd.gradcheck(lambda a, b: SF.simpo_loss(a, b, label_smoothing=0.1), (c, r))
    assert torch.autograd.gradcheck(lambda a, b: SF.cpo_loss(a, b), (c, r))
    desirable = torch.tensor([True, False, True, False])
    assert torch.autograd.gradcheck(lambda a, b: SF.kto_loss(a, b, desirable, kl=0.1), (c, r))


def test_orpo_forward_mode_and_vmap():
    c, r = _logps(4, 6)[:2]
    f = lambda a, b: SF.orpo_loss(a, b, reduction="sum")  # noqa: E731
    jac_f = torch.func.jacfwd(f, argnums=(0, 1))(c.detach(), r.detach())
    jac_r = torch.func.jacrev(f, argnums=(0, 1))(c.detach(), r.detach())
    for a, b in zip(jac_f, jac_r):
        torch.testing.assert_close(a, b)
    out = torch.vmap(lambda a, b: SF.orpo_loss(a, b, reduction="none"))(c.detach()[None], r.detach()[None])
    torch.testing.assert_close(out[0], SF.orpo_loss(c.detach(), r.detach(), reduction="none"))


def _module_cases():
    c, r, rc, rr = (x.detach() for x in _logps(5, 7))
    d = torch.tensor([True, False, True, True, False])
    return [
        (sl.DPOLoss(beta=0.2, loss_type="robust", label_smoothing=0.1), (c, r, rc, rr),
         lambda *a: SF.dpo_loss(*a, beta=0.2, loss_type="robust", label_smoothing=0.1)),
        (sl.ORPOLoss(beta=0.3, reduction="sum"), (c, r), lambda *a: SF.orpo_loss(*a, beta=0.3, reduction="sum")),
        (sl.SimPOLoss(gamma_beta_ratio=0.3), (c, r), lambda *a: SF.simpo_loss(*a, gamma_beta_ratio=0.3)),
        (sl.CPOLoss(label_smoothing=0.1), (c, r), lambda *a: SF.cpo_loss(*a, label_smoothing=0.1)),
        (sl.KTOLoss(undesirable_weight=1.3), (c, r, d), lambda *a: SF.kto_loss(*a, undesirable_weight=1.3)),
    ]


@pytest.mark.parametrize("case", range(5))
def test_module_equals_function(case):
    module, args, fn = _module_cases()[case]
    assert torch.equal(module(*args), fn(*args))
    assert type(module).__name__ in repr(module) and "beta=" in repr(module)


@pytest.mark.parametrize("bad, error, match", [
    (lambda: SF.dpo_loss(*_logps(2, 0), beta=-0.1), ValueError, "dpo_loss: beta must be >= 0"),
    (lambda: SF.dpo_loss(*_logps(2, 0), loss_type="exo"), ValueError, "dpo_loss: loss_type must be"),
    (lambda: SF.dpo_loss(*_logps(2, 0), loss_type="ipo", beta=0.0), ValueError, "beta must be > 0"),
    (lambda: SF.dpo_loss(*_logps(2, 0), loss_type="robust", label_smoothing=0.5), ValueError, "< 0.5"),
    (lambda: SF.dpo_loss(*_logps(2, 0), label_smoothing=1.5), ValueError, "label_smoothing must be in"),
    (lambda: SF.dpo_loss(*_logps(2, 0), reduction="avg"), ValueError, "reduction must be"),
    (lambda: SF.dpo_loss(torch.zeros(3), *_logps(2, 0)[1:]), ValueError, "shape"),
    (lambda: SF.orpo_loss(torch.zeros(2, dtype=torch.long), torch.zeros(2)), TypeError, "chosen_logps"),
    (lambda: SF.kto_loss(torch.zeros(2), torch.zeros(2), torch.ones(2)), TypeError, "desirable must be a bool"),
    (lambda: SF.kto_loss(torch.zeros(2), torch.zeros(2), torch.ones(3, dtype=torch.bool)), ValueError,
     "desirable shape"),
    (lambda: SF.kto_loss(torch.zeros(2), torch.zeros(2), torch.ones(2, dtype=torch.bool), desirable_weight=-1.0),
     ValueError, "desirable_weight must be >= 0"),
    (lambda: SF.kto_loss(torch.zeros(2), torch.zeros(2), torch.ones(2, dtype=torch.bool), kl=torch.zeros(3)),
     ValueError, "kl shape"),
    (lambda: sl.DPOLoss(loss_type="ipo", beta=0.0), ValueError, "DPOLoss: beta must be > 0"),
    (lambda: sl.SimPOLoss(beta=-1.0), ValueError, "SimPOLoss: beta must be >= 0"),
    (lambda: sl.KTOLoss(reduction="avg"), ValueError, "KTOLoss: reduction must be"),
    (lambda: sl.ORPOLoss(beta="1"), TypeError, "ORPOLoss: beta must be a float"),
    (lambda: sl.CPOLoss(label_smoothing=2.0), ValueError, "CPOLoss: label_smoothing must be in"),
])
def test_argument_checks(bad, error, match):
    with pytest.raises(error, match=match):
        bad()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dpo", "orpo", "simpo", "cpo", "kto"])
def test_compiles_fullgraph(name):
    c, r, rc, rr = (x.detach().float() for x in _logps(6, 8))
    d = torch.tensor([True, False] * 3)
    fns = {
        "dpo": lambda a: SF.dpo_loss(a, r, rc, rr, loss_type="robust", label_smoothing=0.1),
        "orpo": lambda a: SF.orpo_loss(a, r),
        "simpo": lambda a: SF.simpo_loss(a, r),
        "cpo": lambda a: SF.cpo_loss(a, r, label_smoothing=0.1),
        "kto": lambda a: SF.kto_loss(a, rc, d, kl=0.2),
    }
    torch._dynamo.reset()
    assert_compiled_matches_eager(fns[name], c)
