"""policy_loss and kl_penalty: TRL GRPOTrainer's formulas (transcribed below in float64) on
ordinary inputs, the public failing inputs (a padded log-ratio 0 − (−200), k3 at d = 1e-6),
exact zero gradients at masked and clipped positions, gradcheck, compile, the module, the
argument checks."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from conftest import assert_compiled_matches_eager
from hypothesis import given, settings
from hypothesis import strategies as st
from trl_reference import trl_policy

import stablelosses as sl
import stablelosses.functional as SF

mpmath.mp.dps = 50
D = torch.float64
INF = float("inf")


def _batch(b=3, t=5, dtype=D, seed=0, adv_per_token=False):
    g = torch.Generator().manual_seed(seed)
    logps = (-2 * torch.rand(b, t, generator=g, dtype=D)).to(dtype).requires_grad_()
    old = (logps.detach().double() + 0.4 * torch.randn(b, t, generator=g, dtype=D)).to(dtype)
    ref = (logps.detach().double() + 0.3 * torch.randn(b, t, generator=g, dtype=D)).to(dtype)
    adv = torch.randn((b, t) if adv_per_token else (b,), generator=g, dtype=D).to(dtype)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[0, 0] = True
    return logps, old, adv, mask, ref


@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float64, 1e-12, 1e-13), (torch.float32, 1e-6, 1e-6)])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("beta, adv_tok, eps_high, normalizer", [
    (0.0, False, None, None), (0.04, True, 0.28, None), (0.1, False, None, 7.0)])
def test_policy_loss_matches_trl(dtype, rtol, atol, loss_type, importance, beta, adv_tok, eps_high, normalizer):
    logps, old, adv, mask, ref = _batch(dtype=dtype, adv_per_token=adv_tok)
    out = SF.policy_loss(logps, old, adv, mask, clip_eps=0.2, clip_eps_high=eps_high, importance=importance,
                         loss_type=loss_type, ref_logps=ref if beta else None, beta=beta, normalizer=normalizer)
    assert out.dtype == dtype
    lp64 = logps.detach().double().requires_grad_()
    want = trl_policy(lp64, old.double(), adv.double(), mask, 0.2, 0.2 if eps_high is None else eps_high,
                      importance, loss_type, ref.double(), beta, normalizer)
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol)
    (g,) = torch.autograd.grad(out, logps)
    (g_ref,) = torch.autograd.grad(want, lp64)
    torch.testing.assert_close(g.double(), g_ref, rtol=rtol, atol=atol)


def test_padded_log_ratio_200_gives_zero_gradient():
    # the GRPO report: log-ratio 0 − (−200) at a padded token; TRL's exp overflows, 0·inf = NaN
    logps = torch.tensor([[-1.0, -0.5, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.4, -200.0]])
    mask = torch.tensor([[True, True, False]])
    for adv in (torch.tensor([1.0]), torch.tensor([-1.0])):
        naive = trl_policy(logps, old, adv, mask, 0.2, 0.2, "token", "grpo")
        (g_naive,) = torch.autograd.grad(naive, logps)
        assert torch.isnan(g_naive[0, 2])  # the public failure
        for importance in ("token", "sequence"):
            out = SF.policy_loss(logps, old, adv, mask, importance=importance)
            (g,) = torch.autograd.grad(out, logps)
            assert torch.isfinite(out) and torch.isfinite(g).all()
            assert g[0, 2].item() == 0.0
            want = trl_policy(logps.detach().double()[:, :2], old.double()[:, :2], adv.double(), mask[:, :2],
                              0.2, 0.2, importance, "grpo")
            assert out.item() == pytest.approx(want.item() * 2 / 2, rel=1e-6)


@pytest.mark.parametrize("log_ratio, adv", [(200.0, 1.0), (-200.0, -1.0), (1e4, 2.0), (-1e4, -0.5)])
def test_real_position_on_the_clipped_side_has_exact_zero_gradient(log_ratio, adv):
    logps = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-log_ratio, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = SF.policy_loss(logps, old, torch.tensor([adv]), mask, loss_type="bnpo")
    (g,) = torch.autograd.grad(out, logps)
    assert torch.isfinite(out)
    assert g[0, 0].item() == 0.0
    bound = 1.2 if adv > 0 else 0.8
    assert out.item() == pytest.approx((-adv * bound - adv * 1.0) / 2, rel=1e-6)


def test_zero_advantage_with_huge_log_ratio_is_finite():
    logps = torch.tensor([[0.0]], requires_grad=True)
    out = SF.policy_loss(logps, torch.tensor([[-200.0]]), torch.tensor([0.0]), torch.ones(1, 1, dtype=torch.bool))
    (g,) = torch.autograd.grad(out, logps)
    assert out.item() == 0.0 and g.item() == 0.0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("normalizer", [None, 0.0, torch.tensor(0.0)])
def test_fully_masked_batch_is_zero_with_zero_gradient(loss_type, normalizer):
    logps = torch.tensor([[0.0, float("nan")], [float("inf"), -1.0]], requires_grad=True)
    old = torch.tensor([[-200.0, 0.0], [0.0, float("-inf")]])
    ref = torch.tensor([[-300.0, 0.0], [0.0, 0.0]])
    mask = torch.zeros(2, 2, dtype=torch.bool)
    out = SF.policy_loss(logps, old, torch.tensor([1.0, -1.0]), mask, loss_type=loss_type, ref_logps=ref,
                         beta=0.1, normalizer=normalizer)
    (g,) = torch.autograd.grad(out, logps)
    assert out.item() == 0.0
    assert torch.all(g == 0)


def test_nan_in_an_unmasked_position_gives_nan():
    logps = torch.tensor([[float("nan"), -1.0]], requires_grad=True)
    out = SF.policy_loss(logps, torch.full((1, 2), -1.0), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool))
    assert torch.isnan(out)


@settings(max_examples=30, deadline=None)
@given(lr=st.lists(st.sampled_from([-1e4, -200.0, -1.0, 0.0, 0.1, 1.0, 200.0, 1e4]) | st.floats(-300, 300),
                   min_size=4, max_size=4),
       adv=st.lists(st.floats(-5, 5), min_size=2, max_size=2),
       mask=st.lists(st.booleans(), min_size=4, max_size=4),
       importance=st.sampled_from(["token", "sequence"]), loss_type=st.sampled_from(["grpo", "dapo", "dr_grpo"]))
def test_finite_loss_and_gradient_for_any_log_ratio_and_mask(lr, adv, mask, importance, loss_type):
    logps = torch.zeros(2, 2, requires_grad=True)
    old = -torch.tensor(lr).view(2, 2)
    m = torch.tensor(mask).view(2, 2)
    a = torch.tensor(adv)
    out = SF.policy_loss(logps, old, a, m, importance=importance, loss_type=loss_type)
    (g,) = torch.autograd.grad(out, logps)
    assert torch.all(g[~m] == 0)  # masked: exactly 0, never 0·inf
    # finite wherever the true value is: r overflows only unclipped with A < 0 and log r > 88
    log_r = torch.where(m, torch.tensor(lr).view(2, 2), 0.0)
    if importance == "sequence":
        log_r = (log_r.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand(2, 2)
    unclipped_overflow = m & (a[:, None] < 0) & (log_r > 88.0)
    if not unclipped_overflow.any():
        assert torch.isfinite(out)
        assert torch.isfinite(g).all()


# --- kl_penalty ---------------------------------------------------------------------------------


def _mp_k3(d: float) -> float:
    d = mpmath.mpf(d)
    return float(mpmath.expm1(d) - d)


def test_k3_at_small_d_does_not_cancel():
    # google/tunix #2315: exp(d) − d − 1 at d = 1e-6 gives −5.96e-8 in float32
    logp, ref = torch.tensor([0.0]), torch.tensor([1e-6])
    d = ref - logp
    assert (torch.exp(d) - d - 1).item() < 0  # the public failure
    out = SF.kl_penalty(logp, ref)
    want = _mp_k3(d.item())
    assert out.item() == pytest.approx(want, rel=4 * torch.finfo(torch.float32).eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d", [1e-30, -1e-30, 1e-12, 1e-6, -1e-6, 3e-3, -0.3, 0.5, 0.999, -1.0, 1.0, 1.001,
                               -2.0, 5.0, 30.0, 80.0, -80.0, -1e4, -1e30, 700.0])
def test_k3_is_within_a_few_ulp_and_never_negative(d, dtype):
    if dtype == torch.float32 and d == 700.0:
        d = 88.0  # the largest representable region
    ref = torch.tensor([d], dtype=dtype)
    logp = torch.zeros(1, dtype=dtype, requires_grad=True)
    out = SF.kl_penalty(logp, ref)
    want = _mp_k3(ref.item())
    assert out.item() >= 0
    assert out.item() == pytest.approx(want, rel=6 * torch.finfo(dtype).eps, abs=torch.finfo(dtype).tiny)
    (g,) = torch.autograd.grad(out.sum(), logp)
    want_g = -float(mpmath.expm1(mpmath.mpf(ref.item())))
    assert torch.isfinite(g).all()
    assert g.item() == pytest.approx(want_g, rel=8 * torch.finfo(dtype).eps, abs=torch.finfo(dtype).tiny)


def test_k3_no_overflow_where_representable_and_inf_beyond():
    logp = torch.zeros(2, requires_grad=True)
    ref = torch.tensor([88.5, 100.0])
    out = SF.kl_penalty(logp, ref)
    assert math.isfinite(out[0].item()) and out[0].item() == pytest.approx(_mp_k3(88.5), rel=1e-6)
    assert out[1].item() == math.inf  # e^100 is not a float32


def test_k1_k2_match_their_formulas():
    logp, ref = torch.randn(4, dtype=D), torch.randn(4, dtype=D)
    torch.testing.assert_close(SF.kl_penalty(logp, ref, estimator="k1"), logp - ref)
    torch.testing.assert_close(SF.kl_penalty(logp, ref, estimator="k2"), 0.5 * (logp - ref) ** 2)
    torch.testing.assert_close(SF.kl_penalty(logp, ref), torch.exp(ref - logp) - (ref - logp) - 1)


def test_gradcheck_float64():
    logps, old, adv, mask, ref = _batch(b=2, t=3, seed=3)
    for importance in ("token", "sequence"):
        assert torch.autograd.gradcheck(
            lambda lp, o, a, r: SF.policy_loss(lp, o, a, mask, importance=importance, ref_logps=r, beta=0.1,
                                               loss_type="dr_grpo"),
            (logps, old.requires_grad_(), adv.requires_grad_(), ref.requires_grad_()))
    x = torch.tensor([-0.5, 1e-3, 0.9, 1.5, -3.0], dtype=D, requires_grad=True)
    y = torch.zeros(5, dtype=D, requires_grad=True)
    for est in ("k1", "k2", "k3"):
        assert torch.autograd.gradcheck(lambda a, b: SF.kl_penalty(a, b, estimator=est), (x, y))
        assert torch.autograd.gradgradcheck(lambda a, b: SF.kl_penalty(a, b, estimator=est), (x, y))


def test_half_inputs_are_computed_in_float32():
    logps, old, adv, mask, ref = _batch(dtype=torch.bfloat16)
    out = SF.policy_loss(logps, old, adv, mask, ref_logps=ref, beta=0.1)
    assert out.dtype == torch.float32
    (g,) = torch.autograd.grad(out, logps)
    assert g.dtype == torch.bfloat16
    want = trl_policy(logps.detach().float(), old.float(), adv.float(), mask, 0.2, 0.2, "token", "grpo",
                      ref.float(), 0.1)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert SF.kl_penalty(logps, ref).dtype == torch.float32


def test_vmap_and_func_grad():
    logps, old, adv, mask, _ = _batch(seed=4)
    f = lambda lp: SF.policy_loss(lp, old, adv, mask, importance="sequence")  # noqa: E731
    g = torch.func.grad(f)(logps.detach())
    (g_ref,) = torch.autograd.grad(f(logps), logps)
    torch.testing.assert_close(g, g_ref)
    out = torch.vmap(f)(torch.stack([logps.detach(), logps.detach() - 0.1]))
    torch.testing.assert_close(out[0], f(logps.detach()))


def test_module_equals_function():
    logps, old, adv, mask, ref = _batch(seed=5)
    module = sl.PolicyLoss(clip_eps_high=0.28, importance="sequence", loss_type="dapo", beta=0.05)
    out_m = module(logps, old, adv, mask, ref_logps=ref, normalizer=11.0)
    out_f = SF.policy_loss(logps, old, adv, mask, clip_eps_high=0.28, importance="sequence", loss_type="dapo",
                           ref_logps=ref, beta=0.05, normalizer=11.0)
    assert torch.equal(out_m, out_f)
    assert "loss_type='dapo'" in repr(module)


def _call(**kw):
    logps, old, adv, mask, _ = _batch(b=2, t=2)
    args = {"logps": logps, "old_logps": old, "advantages": adv, "mask": mask}
    args.update(kw)
    return SF.policy_loss(args.pop("logps"), args.pop("old_logps"), args.pop("advantages"), args.pop("mask"),
                          **args)


@pytest.mark.parametrize("bad, error, match", [
    (lambda: _call(beta=0.1), ValueError, "policy_loss: beta > 0 needs ref_logps"),
    (lambda: _call(clip_eps=1.0), ValueError, "policy_loss: clip_eps must be in"),
    (lambda: _call(clip_eps_high=-0.1), ValueError, "policy_loss: clip_eps_high must be"),
    (lambda: _call(importance="seq"), ValueError, "policy_loss: importance must be"),
    (lambda: _call(loss_type="ppo"), ValueError, "policy_loss: loss_type must be"),
    (lambda: _call(kl_estimator="k4"), ValueError, "policy_loss: kl_estimator must be"),
    (lambda: _call(normalizer=-1.0), ValueError, "policy_loss: normalizer must be"),
    (lambda: _call(normalizer=torch.ones(2)), ValueError, "policy_loss: normalizer must be a number or a 0-dim"),
    (lambda: _call(mask=torch.ones(2, 2)), TypeError, "policy_loss: mask must be a bool"),
    (lambda: _call(mask=torch.ones(2, 3, dtype=torch.bool)), ValueError, "mask shape"),
    (lambda: _call(advantages=torch.ones(3)), ValueError, "advantages shape"),
    (lambda: _call(old_logps=torch.ones(2, 3)), ValueError, "old_logps shape"),
    (lambda: _call(logps=torch.ones(4), old_logps=torch.ones(4), mask=torch.ones(4, dtype=torch.bool)),
     ValueError, "must be \\(B, T\\)"),
    (lambda: SF.kl_penalty(torch.zeros(2), torch.zeros(3)), ValueError, "kl_penalty: ref_logps shape"),
    (lambda: SF.kl_penalty(torch.zeros(2), torch.zeros(2), estimator="k5"), ValueError,
     "kl_penalty: estimator must be"),
    (lambda: sl.PolicyLoss(loss_type="x"), ValueError, "PolicyLoss: loss_type must be"),
])
def test_argument_checks(bad, error, match):
    with pytest.raises(error, match=match):
        bad()


@pytest.mark.slow
@pytest.mark.parametrize("importance", ["token", "sequence"])
def test_compiles_fullgraph(importance):
    logps, old, adv, mask, ref = (t.float() if t.is_floating_point() else t for t in _batch(seed=6))
    old = old.clone()
    old[0, 1] = -200.0
    torch._dynamo.reset()
    g = assert_compiled_matches_eager(
        lambda lp: SF.policy_loss(lp, old, adv, mask, importance=importance, ref_logps=ref, beta=0.1)
        + SF.kl_penalty(lp, ref).sum(), logps.detach())
    assert torch.isfinite(g).all()


def test_forward_mode_matches_reverse_mode():
    x = torch.randn(4, dtype=D)
    mask = torch.ones(2, 2, dtype=torch.bool)
    for f in (lambda a: SF.kl_penalty(a, a * 0.3).sum(),
              lambda a: SF.policy_loss(a.view(2, 2), a.view(2, 2) * 0.9, a[:2], mask, importance="sequence")):
        torch.testing.assert_close(torch.func.jacfwd(f)(x), torch.func.jacrev(f)(x))


def test_kl_penalty_masked_after_it_at_a_padded_token_has_a_zero_gradient():
    # found by the hazard matrix: masked_mean after kl_penalty at a padded log-ratio of 200 sent
    # 0 · e^200 = NaN back through torch's Expm1Backward
    lp = torch.tensor([0.0, -200.0], requires_grad=True)
    loss = SF.masked_mean(SF.kl_penalty(lp, torch.zeros(2)), torch.tensor([True, False]))
    loss.backward()
    assert loss == 0 and torch.equal(lp.grad, torch.zeros(2))
    # forward mode: the tangent of a masked-out entry is 0 too
    _, tangent = torch.func.jvp(lambda x: SF.kl_penalty(x, torch.zeros(2)) * torch.tensor([1.0, 0.0]),
                                (lp.detach(),), (torch.tensor([1.0, 0.0]),))
    assert torch.isfinite(tangent).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_penalty_masked_after_it_has_a_zero_second_derivative(dtype):
    # the double backward of the masked 0 · e^200: expm1 sees 0 there, not d
    lp = torch.zeros(2, dtype=dtype, requires_grad=True)
    kl = SF.kl_penalty(lp, torch.tensor([800.0 if dtype == D else 200.0, 0.5], dtype=dtype))
    (g,) = torch.autograd.grad(torch.where(torch.tensor([False, True]), kl, 0.0).sum(), lp, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), lp)
    assert gg[0] == 0 and gg[1].item() == pytest.approx(math.exp(0.5))


def test_k3_at_a_neg_inf_log_prob_is_inf():
    # d = ref − (−inf) = +inf: expm1(d) − d is inf − inf; the value is +inf, as k1's −inf and k2's +inf
    logps = torch.tensor([-INF, -1.0])
    out = SF.kl_penalty(logps, torch.tensor([-1.0, -1.0]))
    assert out[0].item() == math.inf and out[1].item() == 0.0
    out = SF.policy_loss(logps[None, :1], torch.tensor([[-1.0]]), torch.tensor([1.0]),
                         torch.ones(1, 1, dtype=torch.bool), ref_logps=torch.tensor([[-1.0]]), beta=0.04)
    assert out.item() == math.inf


@pytest.mark.parametrize("log_ratio", [0.0, 0.1, -0.1, 0.5, -0.5, 200.0, -200.0])
def test_zero_advantage_gradient_is_the_derivative_inside_the_clip_range(log_ratio):
    # at A = 0 the loss is 0 for every r: ∂/∂logps = 0, and ∂/∂A is −r inside [1 − ε, 1 + ε_h]
    # (both one-sided derivatives agree; TRL's formula gives it too), else the minimal-norm
    # subgradient −min(r, 1 + ε_h)
    logps = torch.tensor([[log_ratio]], dtype=D, requires_grad=True)
    adv = torch.zeros(1, dtype=D, requires_grad=True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    out = SF.policy_loss(logps, torch.zeros(1, 1, dtype=D), adv, mask, clip_eps=0.2)
    g_lp, g_adv = torch.autograd.grad(out, (logps, adv))
    r = math.exp(log_ratio)
    assert out.item() == 0.0 and g_lp.item() == 0.0
    assert g_adv.item() == pytest.approx(-min(r, 1.2), rel=1e-12)
    if 0.8 <= r <= 1.2:  # smooth there: the one-sided difference quotients agree with it
        for h in (1e-7, -1e-7):
            f = SF.policy_loss(logps.detach(), torch.zeros(1, 1, dtype=D), torch.tensor([h], dtype=D), mask)
            assert (f.item() / h) == pytest.approx(g_adv.item(), rel=1e-6)


def test_nan_log_prob_at_an_unmasked_zero_advantage_gives_nan():
    out = SF.policy_loss(torch.tensor([[float("nan")]]), torch.zeros(1, 1), torch.zeros(1),
                         torch.ones(1, 1, dtype=torch.bool))
    assert torch.isnan(out)


def test_ref_logps_at_beta_zero_gets_a_zero_gradient_not_none():
    # the design: every tensor argument that can require grad gets its gradient, never a silent
    # None; at beta = 0 the reference does not enter the loss, so its gradient is 0, and the value
    # is the one without ref_logps, bit for bit (inf and NaN references at masked positions too)
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(2, 3, generator=g, requires_grad=True)
    old, adv = torch.randn(2, 3, generator=g), torch.randn(2, generator=g)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    ref = torch.randn(2, 3, generator=g)
    ref[0, 2], ref[1, 1] = float("inf"), float("nan")
    ref.requires_grad_()
    out = SF.policy_loss(lp, old, adv, mask, ref_logps=ref)
    want = SF.policy_loss(lp, old, adv, mask)
    assert torch.equal(out, want)
    g_lp, g_ref = torch.autograd.grad(out, (lp, ref))
    assert torch.equal(g_lp, torch.autograd.grad(want, lp)[0])
    assert torch.equal(g_ref, torch.zeros_like(ref))
