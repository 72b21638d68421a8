"""The post-training and distillation contract (design: Post-training and distillation),
checked from outside: every reference below is written from the formulas in the contract and in
TRL's trainers, in float64, and imports nothing from the functions under test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from trl_reference import trl_policy

import stablelosses as sl
import stablelosses.functional as SF

D = torch.float64
INF = math.inf


def _grad(fn, *xs):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    out = fn(*xs)
    out.sum().backward()
    return out.detach(), [x.grad for x in xs]


def _logsig(x):
    return F.logsigmoid(x)


# ---------------------------------------------------------------- token log-probs


def test_token_logps_is_log_softmax_at_labels_with_temperature():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 5, 7, generator=g, dtype=D)
    y = torch.randint(0, 7, (3, 5), generator=g)
    for t in (1.0, 0.7, 2.0):
        want = torch.log_softmax(z / t, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        got = SF.token_logps(z, y, temperature=t)
        assert got.shape == y.shape
        torch.testing.assert_close(got, want)


def test_token_logps_ignored_position_is_zero_with_zero_gradient_whatever_its_row():
    z = torch.tensor([[0.0, 1.0, 2.0], [-INF, -INF, -INF], [1e30, -1e30, 0.0]], dtype=D)
    y = torch.tensor([1, -100, -100])
    val, (gz,) = _grad(lambda z: SF.token_logps(z, y), z)
    assert val[1] == 0 and val[2] == 0
    assert torch.isfinite(val[0])
    assert (gz[1:] == 0).all()
    y2 = torch.tensor([1, 7, 7])
    val, (gz,) = _grad(lambda z: SF.token_logps(z, y2, ignore_index=7), z)
    assert val[1] == 0 and (gz[1:] == 0).all()


def test_token_logps_neg_inf_logits_elsewhere_and_at_the_label():
    z = torch.tensor([[0.0, -INF, 1.0], [0.0, -INF, 1.0]], dtype=D)
    y = torch.tensor([0, 1])
    val, (gz,) = _grad(lambda z: SF.token_logps(z, y), z)
    torch.testing.assert_close(val[0], torch.log_softmax(torch.tensor([0.0, 1.0], dtype=D), 0)[0])
    assert val[1] == -INF
    assert torch.isfinite(gz).all()


def test_token_logps_refuses_nonpositive_temperature():
    with pytest.raises(ValueError, match="temperature"):
        SF.token_logps(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), temperature=0.0)


def test_sequence_logps_sum_mean_and_empty_sequence():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 4, 6, generator=g, dtype=D)
    y = torch.randint(0, 6, (3, 4), generator=g)
    y[1] = -100  # an empty sequence
    y[2, 2:] = -100
    tok = torch.log_softmax(z, -1).gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1) * (y != -100)
    n = (y != -100).sum(-1)
    torch.testing.assert_close(SF.sequence_logps(z, y), tok.sum(-1))
    want_mean = torch.where(n > 0, tok.sum(-1) / n.clamp_min(1), 0.0)
    val, (gz,) = _grad(lambda z: SF.sequence_logps(z, y, average=True), z)
    torch.testing.assert_close(val, want_mean)
    assert val[1] == 0 and (gz[1] == 0).all() and torch.isfinite(gz).all()


def test_linear_token_logps_and_entropy_equal_the_unfused_computation():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 5, 8, generator=g, dtype=D)
    w = torch.randn(11, 8, generator=g, dtype=D)
    b = torch.randn(11, generator=g, dtype=D)
    b[3] = -INF  # a masked vocabulary entry
    y = torch.randint(0, 11, (2, 5), generator=g)
    y[y == 3] = 4
    y[0, 0] = -100
    z = h @ w.T + b
    want = torch.log_softmax(z, -1).gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1) * (y != -100)
    p = torch.softmax(z, -1)
    ent = -(p * torch.where(p > 0, torch.log_softmax(z, -1), 0.0)).sum(-1)
    logp, e = SF.linear_token_logps(h, w, y, linear_bias=b, chunk_size=3, return_entropy=True)
    torch.testing.assert_close(logp, want)
    torch.testing.assert_close(e[y != -100], ent[y != -100])
    hh = h.clone().requires_grad_(True)
    ww = w.clone().requires_grad_(True)
    (SF.linear_token_logps(hh, ww, y, linear_bias=b, chunk_size=3).sum()).backward()
    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    (SF.token_logps(h2 @ w2.T + b, y).sum()).backward()
    torch.testing.assert_close(hh.grad, h2.grad)
    torch.testing.assert_close(ww.grad, w2.grad)
    seq = SF.linear_sequence_logps(h, w, y, linear_bias=b, chunk_size=4)
    torch.testing.assert_close(seq, want.sum(-1))


# ---------------------------------------------------------------- preference losses


def _pref_inputs(n=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [-(torch.rand(n, generator=g, dtype=D) * 20 + 0.5) for _ in range(4)]


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "hinge", "ipo", "apo_zero", "apo_down"])
def test_dpo_loss_matches_trl_formulas(loss_type):
    c, r, rc, rr = _pref_inputs()
    beta, eps = 0.3, (0.1 if loss_type in ("sigmoid", "robust") else 0.0)
    m = (c - r) - (rc - rr)
    if loss_type == "sigmoid":
        want = -_logsig(beta * m) * (1 - eps) - _logsig(-beta * m) * eps
    elif loss_type == "robust":
        want = (-(1 - eps) * _logsig(beta * m) + eps * _logsig(-beta * m)) / (1 - 2 * eps)
    elif loss_type == "hinge":
        want = torch.relu(1 - beta * m)
    elif loss_type == "ipo":
        want = (m - 1 / (2 * beta)) ** 2
    elif loss_type == "apo_zero":
        want = (1 - torch.sigmoid(beta * (c - rc))) + torch.sigmoid(beta * (r - rr))
    else:
        want = torch.sigmoid(beta * (c - rc)) + (1 - torch.sigmoid(beta * m))
    got = SF.dpo_loss(c, r, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps, reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        SF.dpo_loss(c, r, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps), want.mean()
    )
    torch.testing.assert_close(
        SF.dpo_loss(c, r, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps, reduction="sum"),
        want.sum(),
    )


@pytest.mark.parametrize("margin", [1e4, -1e4, 1e30, -1e30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dpo_sigmoid_tails_are_exact_and_gradients_finite(margin, dtype):
    c = torch.tensor([margin], dtype=dtype)
    z = torch.zeros(1, dtype=dtype)
    val, grads = _grad(lambda c: SF.dpo_loss(c, z, z, z, beta=1.0, reduction="none"), c)
    assert torch.isfinite(val).all()
    assert all(torch.isfinite(gr).all() for gr in grads)
    # -logsigmoid(m): m for m << 0, e^{-m} for m >> 0 (0 in float)
    want = -margin if margin < 0 else math.exp(-margin)
    assert val.item() == pytest.approx(want, rel=1e-6, abs=0)


def test_orpo_matches_trl_and_is_finite_as_logp_tends_to_zero():
    c = torch.tensor([-0.5, -2.0, -1e-9, -1e-7], dtype=D)
    r = torch.tensor([-1.5, -1.0, -3.0, -2.0], dtype=D)
    beta = 0.2

    def log1mexp(x):  # float64 reference via mpmath-free exact form
        return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))

    lo = (c - r) - (log1mexp(c) - log1mexp(r))
    want = -beta * _logsig(lo)
    val, (gc, gr) = _grad(lambda c, r: SF.orpo_loss(c, r, beta=beta, reduction="none"), c, r)
    torch.testing.assert_close(val, want, rtol=1e-12, atol=0)
    assert torch.isfinite(gc).all() and torch.isfinite(gr).all()
    c32 = torch.tensor([-1e-9, -1e-7, 0.0])
    r32 = torch.tensor([-3.0, -2.0, -2.0])
    val, (gc, gr) = _grad(lambda c, r: SF.orpo_loss(c, r, reduction="none"), c32, r32)
    assert torch.isfinite(val).all() and torch.isfinite(gc).all() and torch.isfinite(gr).all()
    assert val[2] == 0
    want32 = -0.1 * _logsig(
        (c32[:2].double() - r32[:2].double()) - (log1mexp(c32[:2].double()) - log1mexp(r32[:2].double()))
    )
    torch.testing.assert_close(val[:2].double(), want32, rtol=1e-5, atol=0)


def test_simpo_and_cpo_match_trl():
    c, r, _, _ = _pref_inputs(seed=5)
    beta, gbr, eps = 2.0, 0.5, 0.1
    lg = c - r - gbr
    want = -_logsig(beta * lg) * (1 - eps) - _logsig(-beta * lg) * eps
    got = SF.simpo_loss(c, r, beta=beta, gamma_beta_ratio=gbr, label_smoothing=eps, reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    beta = 0.1
    lg = c - r
    want = -_logsig(beta * lg) * (1 - eps) - _logsig(-beta * lg) * eps
    got = SF.cpo_loss(c, r, beta=beta, label_smoothing=eps, reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_kto_matches_trl_and_an_empty_group_adds_zero():
    g = torch.Generator().manual_seed(7)
    pol = -torch.rand(6, generator=g, dtype=D) * 10
    ref = -torch.rand(6, generator=g, dtype=D) * 10
    des = torch.tensor([True, False, True, True, False, False])
    kl, beta, dw, uw = 0.3, 0.2, 1.5, 0.7
    lr = pol - ref
    want = torch.where(
        des, dw * (1 - torch.sigmoid(beta * (lr - kl))), uw * (1 - torch.sigmoid(beta * (kl - lr)))
    )
    got = SF.kto_loss(pol, ref, des, kl=kl, beta=beta, desirable_weight=dw, undesirable_weight=uw,
                      reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        SF.kto_loss(pol, ref, des, kl=kl, beta=beta, desirable_weight=dw, undesirable_weight=uw),
        want.sum() / 6,
    )
    allp = torch.ones(6, dtype=torch.bool)
    val, (gp,) = _grad(lambda p: SF.kto_loss(p, ref, allp, beta=beta).unsqueeze(0), pol)
    assert torch.isfinite(val).all() and torch.isfinite(gp).all()


def test_preference_losses_refuse_bad_arguments():
    c = torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type"):
        SF.dpo_loss(c, c, c, c, loss_type="nope")
    with pytest.raises(ValueError, match="reduction"):
        SF.dpo_loss(c, c, c, c, reduction="avg")
    with pytest.raises(ValueError, match="beta"):
        SF.cpo_loss(c, c, beta=-1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        SF.dpo_loss(c, c, c, c, label_smoothing=1.5)
    with pytest.raises((ValueError, RuntimeError), match="shape"):
        SF.dpo_loss(c, torch.zeros(3), c, c)


def test_preference_half_precision_is_the_float32_value():
    c, r, rc, rr = (x.float() for x in _pref_inputs(seed=9))
    for dt in (torch.float16, torch.bfloat16):
        args = [x.to(dt) for x in (c, r, rc, rr)]
        got = SF.dpo_loss(*args, reduction="none")
        want = SF.dpo_loss(*(a.float() for a in args), reduction="none")
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-3)


# ---------------------------------------------------------------- policy loss and KL penalty


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("importance", ["token", "sequence"])
def test_policy_loss_matches_trl(loss_type, importance):
    g = torch.Generator().manual_seed(11)
    B, T = 4, 6
    logps = -torch.rand(B, T, generator=g, dtype=D) * 3
    old = logps + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    ref = logps + 0.2 * torch.randn(B, T, generator=g, dtype=D)
    adv = torch.randn(B, generator=g, dtype=D)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    want = trl_policy(logps, old, adv, mask, 0.2, 0.28, importance, loss_type, ref, 0.04)
    got = SF.policy_loss(logps, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28, importance=importance,
                         loss_type=loss_type, ref_logps=ref, beta=0.04)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    lp = logps.clone().requires_grad_(True)
    SF.policy_loss(lp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28, importance=importance,
                   loss_type=loss_type, ref_logps=ref, beta=0.04).backward()
    lp2 = logps.clone().requires_grad_(True)
    trl_policy(lp2, old, adv, mask, 0.2, 0.28, importance, loss_type, ref, 0.04).backward()
    torch.testing.assert_close(lp.grad, lp2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("importance", ["token", "sequence"])
def test_policy_loss_padding_with_a_huge_log_ratio_has_exactly_zero_gradient(importance):
    logps = torch.tensor([[-1.0, -0.5, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.4, -200.0, 200.0]])
    mask = torch.tensor([[True, True, False, False]])
    adv = torch.tensor([1.0])
    loss = SF.policy_loss(logps, old, adv, mask, importance=importance)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logps.grad).all()
    assert (logps.grad[0, 2:] == 0).all()


def test_policy_loss_clipped_side_huge_log_ratio_gives_exact_zero_gradient():
    logps = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-200.0, -1.0]])  # ratio e^200 at a real position, A > 0: clipped at 1+eps
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss = SF.policy_loss(logps, old, torch.tensor([1.0]), mask)
    loss.backward()
    assert torch.isfinite(loss)
    assert logps.grad[0, 0] == 0
    assert torch.isfinite(logps.grad).all() and logps.grad[0, 1] != 0
    logps.grad = None
    old = torch.tensor([[200.0, -1.0]])  # ratio e^-200, A < 0: clipped at 1-eps
    loss = SF.policy_loss(logps, old, torch.tensor([-1.0]), mask)
    loss.backward()
    assert torch.isfinite(loss) and logps.grad[0, 0] == 0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_policy_loss_fully_masked_batch_is_zero_with_zero_gradient(loss_type):
    logps = torch.zeros(2, 3, requires_grad=True)
    old = torch.full((2, 3), -200.0)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for normalizer in (None, 0.0, 5.0):
        logps.grad = None
        loss = SF.policy_loss(logps, old, torch.ones(2), mask, loss_type=loss_type, normalizer=normalizer)
        loss.backward()
        assert loss == 0
        assert (logps.grad == 0).all()


def test_policy_loss_normalizer_replaces_the_denominator():
    g = torch.Generator().manual_seed(12)
    logps = -torch.rand(3, 5, generator=g, dtype=D)
    old = logps + 0.1 * torch.randn(3, 5, generator=g, dtype=D)
    adv = torch.randn(3, generator=g, dtype=D)
    mask = torch.rand(3, 5, generator=g) > 0.2
    base = SF.policy_loss(logps, old, adv, mask, loss_type="dapo")
    n = mask.sum()
    got = SF.policy_loss(logps, old, adv, mask, loss_type="dapo", normalizer=torch.tensor(7.0, dtype=D))
    torch.testing.assert_close(got, base * n / 7.0)
    got = SF.policy_loss(logps, old, adv, mask, loss_type="grpo", normalizer=6)
    base = SF.policy_loss(logps, old, adv, mask, loss_type="grpo")
    torch.testing.assert_close(got, base * 3 / 6)


def test_policy_loss_refuses_beta_without_ref_and_unknown_names():
    z = torch.zeros(1, 2)
    m = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="ref_logps"):
        SF.policy_loss(z, z, torch.zeros(1), m, beta=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        SF.policy_loss(z, z, torch.zeros(1), m, loss_type="x")
    with pytest.raises(ValueError, match="importance"):
        SF.policy_loss(z, z, torch.zeros(1), m, importance="x")


def test_kl_penalty_estimators():
    g = torch.Generator().manual_seed(13)
    lp = -torch.rand(10, generator=g, dtype=D) * 5
    ref = -torch.rand(10, generator=g, dtype=D) * 5
    d = ref - lp
    torch.testing.assert_close(SF.kl_penalty(lp, ref, estimator="k1"), lp - ref)
    torch.testing.assert_close(SF.kl_penalty(lp, ref, estimator="k2"), 0.5 * (lp - ref) ** 2)
    torch.testing.assert_close(SF.kl_penalty(lp, ref, estimator="k3"), torch.expm1(d) - d)
    torch.testing.assert_close(SF.kl_penalty(lp, ref), torch.expm1(d) - d)
    with pytest.raises(ValueError, match="estimator"):
        SF.kl_penalty(lp, ref, estimator="k4")


def test_kl_penalty_k3_is_exact_at_small_d_never_negative_and_finite_at_large_d():
    lp = torch.tensor([0.0, 0.0, 0.0, 0.0])
    ref = torch.tensor([1e-6, -1e-6, 80.0, -80.0])
    val, (glp,) = _grad(lambda lp: SF.kl_penalty(lp, ref), lp)
    assert (val >= 0).all()
    assert val[0].item() == pytest.approx(0.5e-12 + 1e-18 / 6, rel=1e-3)
    assert val[1].item() == pytest.approx(0.5e-12 - 1e-18 / 6, rel=1e-3)
    assert torch.isfinite(val).all() and torch.isfinite(glp).all()


# ---------------------------------------------------------------- distillation


def _gjsd(s, t, beta):  # TRL's generalized_jsd_loss per token, summed over V, float64
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    if beta == 0:
        return F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1)
    b = torch.tensor(beta, dtype=s.dtype)
    mix = torch.logsumexp(torch.stack([ls + torch.log(1 - b), lt + torch.log(b)]), 0)
    kt = F.kl_div(mix, lt, reduction="none", log_target=True).sum(-1)
    ks = F.kl_div(mix, ls, reduction="none", log_target=True).sum(-1)
    return b * kt + (1 - b) * ks


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_distillation_jsd_matches_trl_for_every_beta(beta):
    g = torch.Generator().manual_seed(14)
    s = torch.randn(3, 4, 9, generator=g, dtype=D)
    t = torch.randn(3, 4, 9, generator=g, dtype=D)
    want = _gjsd(s, t, beta)
    got = SF.distillation_loss(s, t, kind="jsd", beta=beta, reduction="none")
    assert got.shape == s.shape[:-1]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    got32 = SF.distillation_loss(s.float(), t.float(), kind="jsd", beta=beta, reduction="none")
    torch.testing.assert_close(got32.double(), want, rtol=1e-5, atol=1e-6)


def test_distillation_kinds_match_float64_references_and_temperature_divides():
    g = torch.Generator().manual_seed(15)
    s = torch.randn(5, 7, generator=g, dtype=D)
    t = torch.randn(5, 7, generator=g, dtype=D)
    T = 2.0
    ls, lt = torch.log_softmax(s / T, -1), torch.log_softmax(t / T, -1)
    ps, pt = ls.exp(), lt.exp()
    refs = {
        "forward_kl": (pt * (lt - ls)).sum(-1),
        "reverse_kl": (ps * (ls - lt)).sum(-1),
        "tvd": 0.5 * (ps - pt).abs().sum(-1),
    }
    for kind, want in refs.items():
        got = SF.distillation_loss(s, t, kind=kind, temperature=T, reduction="none")
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(SF.distillation_loss(s, t, kind=kind, temperature=T), want.mean())
        torch.testing.assert_close(
            SF.distillation_loss(s, t, kind=kind, temperature=T, reduction="sum"), want.sum()
        )


def test_distillation_mask_none_shape_mean_over_unmasked_and_normalizer():
    g = torch.Generator().manual_seed(16)
    s = torch.randn(2, 3, 5, generator=g, dtype=D)
    t = torch.randn(2, 3, 5, generator=g, dtype=D)
    m = torch.tensor([[True, False, True], [False, False, True]])
    full = SF.distillation_loss(s, t, reduction="none")
    got = SF.distillation_loss(s, t, mask=m, reduction="none")
    assert got.shape == (2, 3)
    torch.testing.assert_close(got, torch.where(m, full, 0.0))
    torch.testing.assert_close(SF.distillation_loss(s, t, mask=m), full[m].mean())
    torch.testing.assert_close(SF.distillation_loss(s, t, mask=m, normalizer=10.0), full[m].sum() / 10)
    torch.testing.assert_close(
        SF.distillation_loss(s, t, mask=m, normalizer=torch.tensor(4.0, dtype=D)), full[m].sum() / 4
    )


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd", "tvd"])
def test_distillation_fully_masked_batch_is_zero_with_zero_gradient(kind):
    s = torch.randn(2, 3, 5, requires_grad=True)
    t = torch.randn(2, 3, 5)
    loss = SF.distillation_loss(s, t, kind=kind, mask=torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss == 0 and (s.grad == 0).all()


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd", "tvd"])
def test_distillation_shared_neg_inf_entries_contribute_zero_with_zero_gradient(kind):
    s = torch.tensor([[-INF, 0.5, 1.0, -INF]], dtype=D)
    t = torch.tensor([[-INF, 1.0, -0.3, -INF]], dtype=D)
    want = SF.distillation_loss(s[:, 1:3], t[:, 1:3], kind=kind, reduction="none")
    val, (gs, gt) = _grad(lambda s, t: SF.distillation_loss(s, t, kind=kind, reduction="none"), s, t)
    torch.testing.assert_close(val, want)
    assert gs[0, 0] == 0 and gs[0, 3] == 0 and gt[0, 0] == 0 and gt[0, 3] == 0
    assert torch.isfinite(gs).all() and torch.isfinite(gt).all()


def test_distillation_neg_inf_contract_per_kind():
    s = torch.tensor([[-INF, 0.0, 1.0]], dtype=D)  # the student excludes entry 0
    t = torch.tensor([[0.0, 0.0, 1.0]], dtype=D)  # the teacher has mass there
    fwd, (gs, _) = _grad(lambda s, t: SF.distillation_loss(s, t, kind="forward_kl", reduction="none"), s, t)
    assert fwd.item() == INF
    assert not torch.isnan(gs).any()
    for kind in ("jsd", "tvd"):
        for a, b in ((s, t), (t, s)):
            val, (ga, gb) = _grad(lambda a, b, k=kind: SF.distillation_loss(a, b, kind=k, reduction="none"), a, b)
            assert torch.isfinite(val).all() and torch.isfinite(ga).all() and torch.isfinite(gb).all()
    # reverse KL: student mass is 0 where it is -inf, so the term is 0 there
    val, (gs, gt) = _grad(lambda s, t: SF.distillation_loss(s, t, kind="reverse_kl", reduction="none"), s, t)
    assert torch.isfinite(val).all() and torch.isfinite(gs).all() and gs[0, 0] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd", "tvd"])
def test_distillation_low_temperature_has_finite_gradients(kind, dtype):
    g = torch.Generator().manual_seed(17)
    s = (torch.randn(4, 50, generator=g) * 5).to(dtype).requires_grad_(True)
    t = (torch.randn(4, 50, generator=g) * 5).to(dtype)
    loss = SF.distillation_loss(s, t, kind=kind, temperature=0.05)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(s.grad).all() and s.grad.dtype == dtype


def test_distillation_teacher_gets_its_gradient_when_it_requires_it():
    s = torch.randn(3, 6, dtype=D)
    t = torch.randn(3, 6, dtype=D)
    torch.autograd.gradcheck(lambda s, t: SF.distillation_loss(s, t, kind="jsd", beta=0.3),
                             (s.requires_grad_(True), t.requires_grad_(True)))


def test_distillation_refuses_bad_arguments():
    s = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="temperature"):
        SF.distillation_loss(s, s, temperature=0.0)
    with pytest.raises(ValueError, match="beta"):
        SF.distillation_loss(s, s, kind="jsd", beta=1.5)
    with pytest.raises(ValueError, match="kind"):
        SF.distillation_loss(s, s, kind="kl")
    with pytest.raises((ValueError, RuntimeError), match="shape"):
        SF.distillation_loss(s, torch.zeros(3, 3))


def test_linear_distillation_equals_the_unfused_loss_with_vocab_padding():
    g = torch.Generator().manual_seed(18)
    hs, ws = torch.randn(7, 5, generator=g, dtype=D), torch.randn(9, 5, generator=g, dtype=D)
    ht, wt = torch.randn(7, 4, generator=g, dtype=D), torch.randn(11, 4, generator=g, dtype=D)
    zs = torch.cat([hs @ ws.T, torch.full((7, 2), -INF, dtype=D)], 1)  # the smaller side padded with -inf
    zt = ht @ wt.T
    for kind in ("reverse_kl", "jsd", "tvd"):
        want = SF.distillation_loss(zs, zt, kind=kind, beta=0.4, temperature=1.5)
        got = SF.linear_distillation_loss(hs, ws, ht, wt, kind=kind, beta=0.4, temperature=1.5, chunk_size=3)
        torch.testing.assert_close(got, want)
    hsg = hs.clone().requires_grad_(True)
    SF.linear_distillation_loss(hsg, ws, ht, wt, kind="jsd", chunk_size=2).backward()
    hs2 = hs.clone().requires_grad_(True)
    zs2 = torch.cat([hs2 @ ws.T, torch.full((7, 2), -INF, dtype=D)], 1)
    SF.distillation_loss(zs2, zt, kind="jsd").backward()
    torch.testing.assert_close(hsg.grad, hs2.grad)


def test_modules_exist_and_equal_their_functions():
    c, r, rc, rr = _pref_inputs(seed=19)
    torch.testing.assert_close(sl.DPOLoss(beta=0.2)(c, r, rc, rr), SF.dpo_loss(c, r, rc, rr, beta=0.2))
    torch.testing.assert_close(sl.ORPOLoss()(c, r), SF.orpo_loss(c, r))
    torch.testing.assert_close(sl.SimPOLoss()(c, r), SF.simpo_loss(c, r))
    torch.testing.assert_close(sl.CPOLoss()(c, r), SF.cpo_loss(c, r))
    s, t = torch.randn(3, 5), torch.randn(3, 5)
    torch.testing.assert_close(sl.DistillationLoss(kind="tvd")(s, t), SF.distillation_loss(s, t, kind="tvd"))
    for name in ("KTOLoss", "PolicyLoss", "LinearDistillationLoss"):
        assert isinstance(getattr(sl, name), type)
