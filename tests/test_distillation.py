"""distillation_loss / linear_distillation_loss: float64 references, TRL's generalized JSD for
every beta, the ``-inf`` contract (value and gradient, exactly), the public NaN reports as
regressions, argument checks, transforms and compile.

TRL's ``generalized_jsd_loss`` and the other naive spellings are transcribed once, in
``benchmarks/naive_post_training.py`` (the hazard matrix uses the same code); loaded here by path.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from sync_helpers import no_host_sync

import stablelosses as sl
import stablelosses.functional as SF

INF = float("inf")
KINDS = ["forward_kl", "reverse_kl", "jsd", "tvd"]
BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]

_spec = importlib.util.spec_from_file_location(
    "naive_post_training",
    pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "naive_post_training.py")
assert _spec is not None and _spec.loader is not None
naive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(naive)

D = torch.float64


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference_rows(kind: str, beta: float, s: torch.Tensor, t: torch.Tensor, temperature: float = 1.0):
    """Per-token divergence in float64 from the probabilities (``xlogy`` terms, the mixture in
    probability space): another formula than the library's log-space one."""
    s, t = s.double() / temperature, t.double() / temperature
    q, p = torch.softmax(s, -1), torch.softmax(t, -1)

    def kl(a, b):  # KL(a‖b) = Σ a log a − a log b
        return (torch.special.xlogy(a, a) - torch.special.xlogy(a, b)).sum(-1)

    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return kl(p, q)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return kl(q, p)
    if kind == "jsd":
        m = beta * p + (1 - beta) * q
        return beta * kl(p, m) + (1 - beta) * kl(q, m)
    return 0.5 * (p - q).abs().sum(-1)


def _inputs(shape=(2, 3, 7), seed=0, dtype=torch.float64, scale=2.0):
    g = _gen(seed)
    s = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    mask = torch.rand(shape[:-1], generator=g) > 0.3
    return s, t, mask


def _grads(loss, *xs):
    return torch.autograd.grad(loss, xs, allow_unused=True)


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_float64_reference_value_and_gradients(kind, reduction):
    for beta, temperature in ((0.5, 1.0), (0.2, 0.7), (0.0, 2.0), (1.0, 1.0)):
        s, t, mask = _inputs(seed=int(beta * 10))
        s.requires_grad_(), t.requires_grad_()
        out = SF.distillation_loss(s, t, kind=kind, beta=beta, temperature=temperature, mask=mask,
                                   reduction=reduction)
        rows = torch.where(mask, reference_rows(kind, beta, s, t, temperature), 0.0)
        ref = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / mask.sum()}[reduction]
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
        w = torch.randn(out.shape, generator=_gen(1), dtype=torch.float64)
        for g, r in zip(_grads((out * w).sum(), s, t), _grads((ref * w).sum(), s, t)):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_float32_within_1e6_relative_of_float64(kind):
    s, t, mask = _inputs((4, 5, 50), seed=3)
    out = SF.distillation_loss(s.float(), t.float(), kind=kind, beta=0.3, mask=mask, reduction="none")
    ref = torch.where(mask, reference_rows(kind, 0.3, s, t), 0.0)
    assert out.dtype == torch.float32
    rel = ((out.double() - ref).abs() / ref.abs().clamp_min(1e-30))[mask]
    assert rel.max() < 1e-6, rel.max()


@pytest.mark.parametrize("beta", BETAS)
def test_equals_trl_generalized_jsd_for_every_beta(beta):
    s, t, mask = _inputs((3, 4, 11), seed=5)
    labels = torch.where(mask, 1, -100)
    for temperature in (1.0, 0.5):
        trl64 = naive.trl_generalized_jsd_loss(s, t, labels, beta=beta, temperature=temperature)
        ours32 = SF.distillation_loss(s.float(), t.float(), kind="jsd", beta=beta, temperature=temperature,
                                      mask=mask)
        assert abs(ours32.double() - trl64) / trl64.abs() < 1e-6
        ours64 = SF.distillation_loss(s, t, kind="jsd", beta=beta, temperature=temperature, mask=mask)
        torch.testing.assert_close(ours64, trl64, rtol=1e-12, atol=0)
        # per token: TRL's 'none' summed over the vocabulary
        trl_rows = naive.trl_generalized_jsd_loss(s, t, None, beta=beta, temperature=temperature,
                                                  reduction="none").sum(-1)
        torch.testing.assert_close(
            SF.distillation_loss(s, t, kind="jsd", beta=beta, temperature=temperature, reduction="none"),
            trl_rows, rtol=1e-12, atol=1e-15)


def test_trl_endpoints_are_forward_and_reverse_kl():
    s, t, _ = _inputs(seed=7)
    for beta, kind in ((0.0, "forward_kl"), (1.0, "reverse_kl")):
        assert torch.equal(SF.distillation_loss(s, t, kind="jsd", beta=beta),
                           SF.distillation_loss(s, t, kind=kind))


def test_temperature_divides_the_logits_without_t_squared():
    s, t, _ = _inputs(seed=8)
    for kind in KINDS:
        torch.testing.assert_close(SF.distillation_loss(s, t, kind=kind, temperature=4.0),
                                   SF.distillation_loss(s / 4.0, t / 4.0, kind=kind), rtol=1e-14, atol=0)


# ----------------------------------------------------------------------------- the -inf contract


def _with_masked_column(kind, beta, cols):
    """Logits with ``-inf`` at ``cols`` on both sides: the value and the gradients elsewhere are
    those of the reduced vocabulary, and the masked columns' gradients are exactly 0."""
    s, t, _ = _inputs((3, 6), seed=11)
    s[:, cols], t[:, cols] = -INF, -INF
    keep = [c for c in range(6) if c not in cols]
    s1, t1 = s.clone().requires_grad_(), t.clone().requires_grad_()
    s2, t2 = s[:, keep].clone().requires_grad_(), t[:, keep].clone().requires_grad_()
    out = SF.distillation_loss(s1, t1, kind=kind, beta=beta, reduction="none")
    ref = SF.distillation_loss(s2, t2, kind=kind, beta=beta, reduction="none")
    return out, ref, _grads(out.sum(), s1, t1), _grads(ref.sum(), s2, t2), keep


@pytest.mark.parametrize("kind", KINDS)
def test_masked_vocabulary_entries_contribute_zero_with_zero_gradient(kind):
    for cols in ([0], [0, 4]):
        out, ref, (gs, gt), (rs, rt), keep = _with_masked_column(kind, 0.4, cols)
        # the same value up to the summation order (a sum over one more, zero, term)
        torch.testing.assert_close(out, ref, rtol=1e-14, atol=0)
        torch.testing.assert_close(gs[:, keep], rs, rtol=1e-14, atol=1e-16)
        torch.testing.assert_close(gt[:, keep], rt, rtol=1e-14, atol=1e-16)
        assert torch.equal(gs[:, cols], torch.zeros_like(gs[:, cols]))
        assert torch.equal(gt[:, cols], torch.zeros_like(gt[:, cols]))


def test_forward_kl_with_teacher_mass_on_a_student_minus_inf_is_plus_inf_with_finite_gradient():
    s = torch.tensor([[1.0, 0.0, -INF]], requires_grad=True)
    t = torch.tensor([[0.5, 0.0, 1.0]], requires_grad=True)
    out = SF.distillation_loss(s, t, kind="forward_kl", reduction="none")
    assert out.item() == INF
    gs, gt = _grads(out.sum(), s, t)
    q, p = torch.softmax(s.detach(), -1), torch.softmax(t.detach(), -1)
    torch.testing.assert_close(gs, q - p)  # the finite student gradient, q Σp − p
    assert torch.equal(gt, torch.zeros_like(gt))  # the diverging side: 0 (documented)
    # the reverse KL, sides swapped
    out = SF.distillation_loss(t, s, kind="reverse_kl", reduction="none")
    assert out.item() == INF
    gs2, gt2 = _grads(out.sum(), t, s)
    assert torch.equal(gs2, torch.zeros_like(gs2))
    torch.testing.assert_close(gt2, q - p)


def test_teacher_minus_inf_where_student_has_mass_is_finite_in_forward_kl():
    # the other direction is the zero-weight limit: p = 0 there
    s = torch.tensor([[1.0, 0.0, 3.0]], requires_grad=True)
    t = torch.tensor([[0.5, 0.0, -INF]])
    out = SF.distillation_loss(s, t, kind="forward_kl", reduction="none")
    ref = reference_rows("forward_kl", 0.0, s.detach(), t)
    torch.testing.assert_close(out.double(), ref)
    (gs,) = _grads(out.sum(), s)
    assert torch.isfinite(gs).all()


def _hazard_logits():
    value = st.one_of(st.floats(-1e4, 1e4, width=32), st.sampled_from([-INF, INF, 0.0, 1e30, -1e30, 88.0]))
    return st.lists(value, min_size=2 * 5, max_size=2 * 5).map(lambda v: torch.tensor(v).reshape(2, 5))


@settings(max_examples=30, deadline=None)
@given(s=_hazard_logits(), t=_hazard_logits(), beta=st.sampled_from([0.1, 0.5, 0.9]),
       temperature=st.sampled_from([1.0, 0.05]))
def test_jsd_and_tvd_are_finite_for_every_input(s, t, beta, temperature):
    for kind in ("jsd", "tvd"):
        s1, t1 = s.clone().requires_grad_(), t.clone().requires_grad_()
        out = SF.distillation_loss(s1, t1, kind=kind, beta=beta, temperature=temperature, reduction="none")
        gs, gt = _grads(out.sum(), s1, t1)
        assert torch.isfinite(out).all() and torch.isfinite(gs).all() and torch.isfinite(gt).all()
        bound = 1.0 if kind == "tvd" else -(beta * math.log(beta) + (1 - beta) * math.log(1 - beta))
        assert (out >= 0).all() and (out <= bound * (1 + 1e-5)).all()


@settings(max_examples=30, deadline=None)
@given(s=_hazard_logits(), t=_hazard_logits())
def test_kl_is_never_nan_and_its_student_gradient_is_finite(s, t):
    for kind in ("forward_kl", "reverse_kl"):
        s1, t1 = s.clone().requires_grad_(), t.clone().requires_grad_()
        out = SF.distillation_loss(s1, t1, kind=kind, reduction="none")
        gs, gt = _grads(out.sum(), s1, t1)
        assert not out.isnan().any() and (out >= 0).all()
        assert torch.isfinite(gs).all() and torch.isfinite(gt).all()


@pytest.mark.parametrize("kind, beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.0), ("jsd", 1.0)])
def test_kl_gradient_is_finite_where_the_log_ratio_minus_the_kl_overflows(kind, beta):
    # found by fuzzing: near-finfo.max logits give a KL of ~3.4e38 and, at an entry of
    # probability 0, a log-ratio of ~-3.4e38; d − KL overflowed to -inf and p · (d − KL) = 0 · inf
    # gave NaN to the side weighting the KL (the teacher's for the forward KL)
    big = torch.finfo(torch.float32).max
    s = torch.tensor([[1.4, -4.4, 1e8, big, big]])
    t = torch.tensor([[-0.5, 5.9, big, -1e30, -0.5]])
    if kind == "reverse_kl" or beta == 1.0:
        s, t = t, s
    s1, t1 = s.clone().requires_grad_(), t.clone().requires_grad_()
    out = SF.distillation_loss(s1, t1, kind=kind, beta=beta, reduction="none")
    gs, gt = _grads(out.sum(), s1, t1)
    assert torch.isfinite(out).all() and torch.isfinite(gs).all() and torch.isfinite(gt).all()
    # the weighting side has all its mass on one entry: its gradient p (d − KL) is 0 everywhere
    assert ((gt if kind == "forward_kl" or beta == 0.0 else gs) == 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_a_divergence_that_rounds_below_zero_is_zero(kind):
    # found by hypothesis: p ≈ q on the second row; float32 JSD summed to -1.8e-9 (float64: +6.7e-9)
    s = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [-1.0, -7.0, 10.0, -6.0, 0.0]])
    t = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [-1.0, -INF, 10.0, -7.0, 0.0]])
    near = torch.tensor([[0.3, -1.2, 2.0, 0.7, 5.0]])
    for a, b in ((s, t), (near, near + 1e-7), (near + 1e-7, near)):
        out = SF.distillation_loss(a, b, kind=kind, beta=0.1, reduction="none")
        ref = SF.distillation_loss(a.double(), b.double(), kind=kind, beta=0.1, reduction="none")
        assert (out >= 0).all(), (kind, out)
        assert torch.allclose(out.double(), ref, rtol=0, atol=1e-7), (kind, out, ref)
    x = torch.tensor([[0.0, float("nan"), 1.0]])
    assert SF.distillation_loss(x, x.clone(), kind=kind, reduction="none").isnan().all()  # NaN in, NaN out


def test_nan_in_nan_out():
    s, t, _ = _inputs((2, 5), seed=2)
    s[0, 1] = float("nan")
    for kind in KINDS:
        out = SF.distillation_loss(s, t, kind=kind, reduction="none")
        assert out[0].isnan() and out[1].isfinite()
    t2 = t.clone()
    t2[1, 0] = float("nan")
    s2 = s.clone()
    s2[1, 0] = -INF  # a NaN teacher beside a -inf student stays NaN, not +inf
    assert SF.distillation_loss(s2, t2, reduction="none")[1].isnan()


def test_masked_tokens_are_never_read():
    s, t, mask = _inputs(seed=4)
    s2, t2 = s.clone(), t.clone()
    s2[~mask], t2[~mask] = float("nan"), INF
    s2.requires_grad_(), t2.requires_grad_()
    for kind in KINDS:
        out = SF.distillation_loss(s2, t2, kind=kind, mask=mask, reduction="none")
        assert torch.equal(out, SF.distillation_loss(s, t, kind=kind, mask=mask, reduction="none"))
        assert (out[~mask] == 0).all()
        gs, gt = _grads(out.sum(), s2, t2)
        assert (gs[~mask] == 0).all() and (gt[~mask] == 0).all() and torch.isfinite(gs).all()


# ----------------------------------------------------------------------------- public NaN reports


def test_trl_7221_entropy_and_kl_at_minus_inf_logits():
    x = torch.tensor([[0.0, 0.0, -INF]], requires_grad=True)
    naive_h = naive.trl_entropy_from_logits(x)
    assert naive_h.isnan().all()  # the report: NaN at a -inf logit
    h = SF.entropy(x)
    torch.testing.assert_close(h, torch.tensor([math.log(2.0)]))
    (g,) = _grads(h.sum(), x)
    assert torch.equal(g, torch.zeros_like(g))  # nan_to_num on the naive value keeps a NaN gradient
    t = torch.tensor([[1.0, 0.0, -INF]])
    loss = SF.distillation_loss(x, t)
    (g,) = _grads(loss, x)
    assert loss.isfinite() and torch.isfinite(g).all() and g[0, 2] == 0


def test_kl_div_log_target_with_both_entries_minus_inf():
    lq = torch.tensor([[0.0, -INF]], requires_grad=True)
    lp = torch.tensor([[0.0, -INF]])
    assert F.kl_div(lq, lp, log_target=True, reduction="sum").isnan()
    s = torch.tensor([[3.0, -INF]], requires_grad=True)
    loss = SF.distillation_loss(s, torch.tensor([[1.0, -INF]]))
    (g,) = _grads(loss, s)
    assert loss.item() == 0.0 and torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_temperature_reverse_kl_and_js_gradients(dtype):
    # MakazhanAlpamys/Soup#719: finite losses, non-finite student gradients at T = 0.05
    g = _gen(0)
    s = (torch.randn(4, 32, generator=g) * 4).to(dtype)
    t = (torch.randn(4, 32, generator=g) * 4).to(dtype)
    sn = s.float().clone().requires_grad_()
    naive_rev = naive.prob_target_reverse_kl(sn, t.float(), 0.05).sum()
    (gn,) = _grads(naive_rev, sn)
    assert naive_rev.isfinite() and not torch.isfinite(gn).all()  # the report reproduced
    for kind in ("reverse_kl", "jsd", "forward_kl", "tvd"):
        s1 = s.clone().requires_grad_()
        loss = SF.distillation_loss(s1, t, kind=kind, temperature=0.05)
        (g1,) = _grads(loss, s1)
        assert loss.isfinite() and torch.isfinite(g1).all() and g1.dtype == dtype
        ref = reference_rows(kind, 0.5, s.double(), t.double(), 0.05).mean()
        torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)


def test_all_ignored_batch_gives_zero_with_zero_gradient_and_no_sync():
    # NeMo Automodel #3796, torch #116349: an all-ignored mean is NaN
    s, t, _ = _inputs(seed=6)
    mask = torch.zeros(s.shape[:-1], dtype=torch.bool)
    labels = torch.full(s.shape[:-1], -100)
    assert naive.trl_generalized_jsd_loss(s, t, labels).isnan()
    s.requires_grad_(), t.requires_grad_()
    for kind in KINDS:
        for normalizer in (None, 0, torch.tensor(0)):
            with no_host_sync():
                loss = SF.distillation_loss(s, t, kind=kind, mask=mask, normalizer=normalizer)
                gs, gt = _grads(loss, s, t)
            assert loss.item() == 0.0
            assert torch.equal(gs, torch.zeros_like(gs)) and torch.equal(gt, torch.zeros_like(gt))


def test_empty_batch():
    s = torch.zeros(0, 5, requires_grad=True)
    loss = SF.distillation_loss(s, torch.zeros(0, 5))
    (g,) = _grads(loss, s)
    assert loss.item() == 0.0 and g.shape == (0, 5)


# ----------------------------------------------------------------------------- reductions, teacher


def test_normalizer_replaces_the_token_count():
    s, t, mask = _inputs(seed=9)
    total = SF.distillation_loss(s, t, mask=mask, reduction="sum")
    torch.testing.assert_close(SF.distillation_loss(s, t, mask=mask, normalizer=17), total / 17)
    torch.testing.assert_close(SF.distillation_loss(s, t, mask=mask, normalizer=torch.tensor(17)), total / 17)
    torch.testing.assert_close(SF.distillation_loss(s, t, mask=mask),
                               total / mask.sum())


def test_none_returns_the_token_shape_with_masked_tokens_zero():
    s, t, mask = _inputs(seed=10)
    out = SF.distillation_loss(s, t, mask=mask[0], reduction="none")  # broadcast over the batch
    assert out.shape == s.shape[:-1]
    assert (out[:, ~mask[0]] == 0).all() and (out[:, mask[0]] > 0).all()


def test_teacher_gets_its_gradient_only_when_it_requires_grad():
    s, t, _ = _inputs(seed=12)
    s.requires_grad_()
    loss = SF.distillation_loss(s, t, kind="jsd")
    loss.backward()
    assert t.grad is None and s.grad is not None
    for kind in KINDS:
        s1, t1 = s.detach().clone().requires_grad_(), t.clone().requires_grad_()
        s2, t2 = s.detach().clone().requires_grad_(), t.clone().requires_grad_()
        ours = SF.distillation_loss(s1, t1, kind=kind, beta=0.3)
        ref = reference_rows(kind, 0.3, s2, t2).mean()
        for a, b in zip(_grads(ours, s1, t1), _grads(ref, s2, t2)):
            torch.testing.assert_close(a, b)


def test_half_precision_computes_in_float32():
    s, t, _ = _inputs(seed=13, dtype=torch.float16)
    out = SF.distillation_loss(s, t, kind="jsd")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, SF.distillation_loss(s.float(), t.float(), kind="jsd"))


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("kwargs, error, match", [
    ({"temperature": 0.0}, ValueError, "distillation_loss: temperature must be a finite float > 0"),
    ({"temperature": -1.0}, ValueError, "temperature"),
    ({"beta": 1.5}, ValueError, r"distillation_loss: beta must be in \[0, 1\]"),
    ({"beta": -0.1}, ValueError, "beta"),
    ({"kind": "kl"}, ValueError, "distillation_loss: kind must be 'forward_kl', 'reverse_kl', 'jsd' or 'tvd'"),
    ({"reduction": "batchmean"}, ValueError, "reduction"),
    ({"normalizer": -1}, ValueError, "normalizer must be finite and >= 0"),
    ({"normalizer": 3, "reduction": "sum"}, ValueError, "normalizer replaces the denominator"),
    ({"normalizer": torch.ones(2)}, ValueError, "normalizer must be a number or a 0-dim real tensor"),
    ({"mask": torch.ones(5, dtype=torch.bool)}, ValueError, "mask of shape"),
    ({"mask": torch.ones(2, 3)}, TypeError, "mask must have dtype torch.bool"),
])
def test_argument_checks(kwargs, error, match):
    s, t, _ = _inputs()
    with pytest.raises(error, match=match):
        SF.distillation_loss(s, t, **kwargs)


def test_shape_and_dtype_checks():
    s, t, _ = _inputs()
    with pytest.raises(ValueError, match="distillation_loss: student_logits and teacher_logits must have the same shape"):
        SF.distillation_loss(s, t[..., :-1])
    with pytest.raises(TypeError, match="teacher_logits must be a floating-point tensor"):
        SF.distillation_loss(s, t.long())
    with pytest.raises(ValueError, match="vocabulary dimension"):
        SF.distillation_loss(torch.tensor(1.0), torch.tensor(1.0))


# ----------------------------------------------------------------------------- autograd, transforms


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_and_gradgradcheck_float64(kind):
    s, t, mask = _inputs((3, 4), seed=14)
    mask = torch.tensor([True, False, True])
    s.requires_grad_(), t.requires_grad_()
    if kind == "tvd":  # keep away from p = q, where |p − q| has a kink
        t = (t + 0.5).detach().requires_grad_()

    def f(s, t):
        return SF.distillation_loss(s, t, kind=kind, beta=0.3, temperature=0.8, mask=mask, reduction="none")

    assert torch.autograd.gradcheck(f, (s, t), check_batched_grad=True)
    assert torch.autograd.gradgradcheck(f, (s, t), check_batched_grad=False)
    assert torch.autograd.gradcheck(f, (s, t), check_forward_ad=True, check_backward_ad=False,
                                    check_undefined_grad=False, check_batched_grad=False)


def test_double_backward_is_finite_at_the_hazards():
    s = torch.tensor([[1.0, 0.0, -INF, 2.0], [-INF] * 4], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([[2.0, -INF, -INF, 0.0], [0.0, 1.0, -INF, 0.0]], dtype=torch.float64, requires_grad=True)
    for kind in KINDS:
        loss = SF.distillation_loss(s, t, kind=kind)
        gs, gt = torch.autograd.grad(loss, (s, t), create_graph=True)
        hs, ht = torch.autograd.grad((gs.pow(2).sum() + gt.pow(2).sum()), (s, t))
        assert torch.isfinite(hs).all() and torch.isfinite(ht).all(), kind


def test_vmap_and_func_grad():
    s, t, _ = _inputs((3, 2, 6), seed=15)
    f = lambda s, t: SF.distillation_loss(s, t, kind="jsd", reduction="sum")  # noqa: E731
    torch.testing.assert_close(torch.func.vmap(f)(s, t), torch.stack([f(a, b) for a, b in zip(s, t)]))
    g = torch.func.grad(f)(s[0], t[0])
    s0 = s[0].clone().requires_grad_()
    torch.testing.assert_close(g, torch.autograd.grad(f(s0, t[0]), s0)[0])


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd", "tvd"])
def test_linear_form_under_vmap_and_forward_mode_equals_the_logits_form(kind):
    # the chunk engine has no batching rule and no tangent: vmap and forward mode take both
    # logits whole, the narrower vocabulary padded with -inf as the engine pads it
    g = torch.Generator().manual_seed(4)
    hs, ws = torch.randn(3, 5, 6, generator=g, dtype=torch.float64), torch.randn(7, 6, generator=g, dtype=torch.float64)
    ht, wt = torch.randn(3, 5, 4, generator=g, dtype=torch.float64), torch.randn(9, 4, generator=g, dtype=torch.float64)
    wt[7:] = 0.0  # the teacher's two extra classes: finite, so a forward KL is +inf (the true value)
    mask = torch.tensor([True, True, False, True, True])
    kw = {"kind": kind, "temperature": 1.5, "mask": mask, "beta": 0.3}

    def fused(a, c):
        return SF.linear_distillation_loss(a, ws, c, wt, **kw)

    def plain(a, c):
        return SF.distillation_loss(F.pad(a @ ws.T, (0, 2), value=-math.inf), c @ wt.T, **kw)

    torch.testing.assert_close(torch.func.vmap(fused)(hs, ht), torch.func.vmap(plain)(hs, ht))
    if kind != "forward_kl":  # its value is +inf (teacher mass beyond the student's vocabulary)
        v = torch.randn(hs[0].shape, generator=g, dtype=torch.float64)
        torch.testing.assert_close(torch.func.jvp(lambda a: fused(a, ht[0]), (hs[0],), (v,)),
                                   torch.func.jvp(lambda a: plain(a, ht[0]), (hs[0],), (v,)))
    else:
        assert torch.isinf(fused(hs[0], ht[0]))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd", "tvd"])
def test_linear_form_double_backward(kind, reduction):
    # a backward with create_graph=True recomputes both logits whole: gradgradcheck passes (it
    # raised), student and teacher sides, vocabularies of different sizes, a mask
    g = torch.Generator().manual_seed(7)
    hs, ws = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((5, 4), (6, 4)))
    ht, wt = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((5, 3), (7, 3)))
    mask = torch.tensor([True, True, False, True, True])
    kw = {"kind": kind, "mask": mask, "reduction": reduction, "temperature": 1.3, "beta": 0.4}
    if kind == "forward_kl":  # the teacher's extra class would make it +inf: same vocabularies
        wt = wt[:6].detach().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda a, b, c, d: SF.linear_distillation_loss(a, b, c, d, **kw),
                                        (hs, ws, ht, wt))


@pytest.mark.parametrize("path", ["chunked", "create_graph", "torch.func"])
def test_linear_form_never_reads_masked_hidden_states(path):
    # a NaN in a masked token's hidden state (padding) reaches neither the value nor a gradient,
    # the linear weights' included (it gave a NaN dW on every path: 0·NaN in the matmul)
    g = torch.Generator().manual_seed(8)
    hs, ht = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
    hs[2], ht[2] = math.nan, math.nan
    ws, wt = torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)
    mask = torch.tensor([True, True, False, True, True])

    def f(w):
        return SF.linear_distillation_loss(hs, w, ht, wt, kind="jsd", mask=mask)

    if path == "torch.func":
        gw = torch.func.grad(f)(ws)
    else:
        w = ws.clone().requires_grad_()
        (gw,) = torch.autograd.grad(f(w), w, create_graph=path == "create_graph")
    ref_w = ws.clone().requires_grad_()
    ref = SF.distillation_loss(hs[mask] @ ref_w.T, ht[mask] @ wt.T, kind="jsd")
    (gref,) = torch.autograd.grad(ref, ref_w)
    assert torch.isfinite(gw).all()
    torch.testing.assert_close(gw.detach(), gref, rtol=1e-5, atol=1e-6)


def test_module_equals_function():
    s, t, mask = _inputs(seed=16)
    m = sl.DistillationLoss(kind="tvd", temperature=2.0, reduction="sum")
    assert torch.equal(m(s, t, mask), SF.distillation_loss(s, t, kind="tvd", temperature=2.0, mask=mask,
                                                            reduction="sum"))
    assert repr(m).startswith("DistillationLoss(") and "tvd" in repr(m)
    with pytest.raises(ValueError, match="DistillationLoss: kind must be"):
        sl.DistillationLoss(kind="x")


def test_modules_keep_the_checked_numbers():
    # a 0-d tensor or NumPy scalar is read once, at construction: forward reads no tensor on the
    # host, and the module compiles (it raised a data-dependent guard error under torch.compile)
    for cls in (sl.DistillationLoss, sl.LinearDistillationLoss):
        m = cls("jsd", np.float32(0.25), temperature=torch.tensor(2.0))
        assert type(m.beta) is float and type(m.temperature) is float
        assert m.beta == 0.25 and m.temperature == 2.0
    s, t, mask = _inputs((2, 3, 9), seed=18, dtype=torch.float32)
    m = sl.DistillationLoss("jsd", 0.3, temperature=torch.tensor(2.0))
    want = SF.distillation_loss(s, t, kind="jsd", beta=0.3, temperature=2.0)
    torch.testing.assert_close(m(s, t), want)
    torch.testing.assert_close(torch.compile(m, fullgraph=True, backend="aot_eager")(s, t), want)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_compiles_fullgraph(kind):
    s, t, mask = _inputs((2, 3, 9), seed=17, dtype=torch.float32)
    s[..., 0] = -INF
    t[..., 0] = -INF

    def f(s, t):
        return SF.distillation_loss(s, t, kind=kind, temperature=0.5, mask=mask)

    s1, t1 = s.clone().requires_grad_(), t.clone().requires_grad_()
    s2, t2 = s.clone().requires_grad_(), t.clone().requires_grad_()
    out = torch.compile(f, fullgraph=True)(s1, t1)
    ref = f(s2, t2)
    torch.testing.assert_close(out, ref)
    for a, b in zip(_grads(out, s1, t1), _grads(ref, s2, t2)):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- linear_distillation_loss


def _linear_inputs(vs=13, vt=17, seed=20, dtype=torch.float64):
    g = _gen(seed)
    hs = torch.randn(2, 5, 6, generator=g, dtype=dtype, requires_grad=True)
    ht = torch.randn(2, 5, 4, generator=g, dtype=dtype, requires_grad=True)
    ws = torch.randn(vs, 6, generator=g, dtype=dtype, requires_grad=True)
    wt = torch.randn(vt, 4, generator=g, dtype=dtype, requires_grad=True)
    bs = torch.randn(vs, generator=g, dtype=dtype, requires_grad=True)
    bt = torch.randn(vt, generator=g, dtype=dtype, requires_grad=True)
    mask = torch.rand(2, 5, generator=g) > 0.3
    return hs, ws, bs, ht, wt, bt, mask


def _unfused(hs, ws, bs, ht, wt, bt, **kw):
    s, t = F.linear(hs, ws, bs), F.linear(ht, wt, bt)
    v = max(s.shape[-1], t.shape[-1])
    s = F.pad(s, (0, v - s.shape[-1]), value=-INF)
    t = F.pad(t, (0, v - t.shape[-1]), value=-INF)
    return SF.distillation_loss(s, t, **kw)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("kind", KINDS)
def test_linear_equals_unfused_with_minus_inf_padding(kind, reduction):
    vs, vt = (17, 13) if kind == "forward_kl" else (13, 17)  # forward KL: teacher mass stays inside
    hs, ws, bs, ht, wt, bt, mask = _linear_inputs(vs, vt)
    kw = dict(kind=kind, beta=0.3, temperature=0.7, mask=mask, reduction=reduction)
    out = SF.linear_distillation_loss(hs, ws, ht, wt, student_bias=bs, teacher_bias=bt, chunk_size=3, **kw)
    ref = _unfused(hs, ws, bs, ht, wt, bt, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    w = torch.randn(out.shape, generator=_gen(2), dtype=out.dtype)
    leaves = (hs, ws, bs, ht, wt, bt)
    for a, b in zip(_grads((out * w).sum(), *leaves), _grads((ref * w).sum(), *leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_linear_teacher_vocabulary_beyond_the_student_is_plus_inf_in_forward_kl():
    hs, ws, bs, ht, wt, bt, _ = _linear_inputs(13, 17)
    out = SF.linear_distillation_loss(hs, ws, ht, wt, reduction="none")
    assert (out == INF).all()
    (g,) = _grads(out.sum(), ws)
    assert torch.isfinite(g).all()
    out = SF.linear_distillation_loss(hs, ws, ht, wt, kind="jsd")
    assert out.isfinite()


def test_linear_teacher_takes_no_gradient_unless_asked():
    hs, ws, bs, ht, wt, bt, mask = _linear_inputs()
    ht, wt = ht.detach(), wt.detach()
    loss = SF.linear_distillation_loss(hs, ws, ht, wt, kind="jsd", mask=mask)
    loss.backward()
    assert ws.grad is not None and hs.grad is not None and wt.grad is None


@pytest.mark.parametrize("value", [4.0, 0.0])
def test_linear_normalizer_tensor_gets_its_gradient(value):
    # as distillation_loss: loss = total / n, d loss / d n = −total / n² (0 at n = 0)
    g = torch.Generator().manual_seed(3)
    hs, ht = torch.randn(3, 4, generator=g, dtype=D), torch.randn(3, 4, generator=g, dtype=D)
    ws, wt = torch.randn(5, 4, generator=g, dtype=D), torch.randn(6, 4, generator=g, dtype=D)
    n1 = torch.tensor(value, dtype=D, requires_grad=True)
    fused = SF.linear_distillation_loss(hs, ws, ht, wt, normalizer=n1)
    (g1,) = torch.autograd.grad(fused, n1)
    total = SF.linear_distillation_loss(hs, ws, ht, wt, reduction="sum")
    want = 0.0 if value == 0 else -total.item() / value**2
    assert g1.item() == pytest.approx(want, rel=1e-12)
    assert fused.item() == pytest.approx(0.0 if value == 0 else total.item() / value, rel=1e-12)


def test_linear_all_ignored_and_normalizer_no_sync():
    hs, ws, bs, ht, wt, bt, mask = _linear_inputs(dtype=torch.float32)
    none = torch.zeros_like(mask)
    with no_host_sync():
        loss = SF.linear_distillation_loss(hs, ws, ht, wt, kind="reverse_kl", mask=none, normalizer=0)
        g = _grads(loss, hs, ws, ht, wt)
    assert loss.item() == 0.0 and all(torch.equal(x, torch.zeros_like(x)) for x in g)
    total = SF.linear_distillation_loss(hs, ws, ht, wt, mask=mask, reduction="sum")
    torch.testing.assert_close(SF.linear_distillation_loss(hs, ws, ht, wt, mask=mask, normalizer=torch.tensor(9.0)),
                               total / 9)


def test_linear_argument_checks():
    hs, ws, bs, ht, wt, bt, _ = _linear_inputs()
    with pytest.raises(ValueError, match="linear_distillation_loss: student_input and teacher_input must have the same token shape"):
        SF.linear_distillation_loss(hs, ws, ht[:1], wt)
    with pytest.raises(ValueError, match=r"teacher_weight must have shape \(V, 4\)"):
        SF.linear_distillation_loss(hs, ws, ht, wt.t())
    with pytest.raises(ValueError, match="student_bias must have shape"):
        SF.linear_distillation_loss(hs, ws, ht, wt, student_bias=bt)
    with pytest.raises(ValueError, match="linear_distillation_loss: chunk_size must be >= 1"):
        SF.linear_distillation_loss(hs, ws, ht, wt, chunk_size=0)
    with pytest.raises(ValueError, match="linear_distillation_loss: kind must be"):
        SF.linear_distillation_loss(hs, ws, ht, wt, kind="kl")


def test_linear_module_equals_function():
    hs, ws, bs, ht, wt, bt, mask = _linear_inputs()
    m = sl.LinearDistillationLoss(kind="jsd", beta=0.2, chunk_size=4)
    assert torch.equal(m(hs, ws, ht, wt, bs, bt, mask),
                       SF.linear_distillation_loss(hs, ws, ht, wt, student_bias=bs, teacher_bias=bt, kind="jsd",
                                                   beta=0.2, mask=mask, chunk_size=4))


@pytest.mark.slow
def test_linear_compiles_fullgraph():
    hs, ws, bs, ht, wt, bt, mask = _linear_inputs(dtype=torch.float32)

    def f(hs, ws):
        return SF.linear_distillation_loss(hs, ws, ht.detach(), wt.detach(), kind="jsd", mask=mask, chunk_size=4)

    h1, w1 = hs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
    h2, w2 = hs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
    out = torch.compile(f, fullgraph=True)(h1, w1)
    ref = f(h2, w2)
    torch.testing.assert_close(out, ref)
    for a, b in zip(_grads(out, h1, w1), _grads(ref, h2, w2)):
        torch.testing.assert_close(a, b)


def test_hazard_matrix_stablelosses_cells_are_finite():
    # benchmarks/hazard_matrix.py (the generator of docs/hazard-matrix.md): every distillation
    # and normalizer cell of stablelosses is finite in value and gradient
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "hazard_matrix.py"
    spec = importlib.util.spec_from_file_location("hazard_matrix", path)
    assert spec is not None and spec.loader is not None
    hm = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("hazard_matrix", hm)  # its dataclass looks its module up
    spec.loader.exec_module(hm)
    columns, results, _, _ = hm.run()
    ours = [c[0] for c in columns if c[1] == "stablelosses" and ("distillation" in c[0] or "normalizer" in c[0])]
    assert len(ours) >= 6
    bad = {(col, row): v for (col, row), v in results.items() if col in ours and v not in ("✓ / ✓", "·")}
    assert bad == {}
    naive_cells = [v for (col, _), v in results.items() if col.startswith("TRL generalized_jsd_loss")]
    assert any("NaN" in v for v in naive_cells)  # the matrix shows the hazards it is about


@pytest.mark.slow
def test_linear_compiles_with_dynamic_beta_and_temperature():
    # beta and temperature are the head's numeric fields: symbolic under dynamic=True
    hs, ws, bs, ht, wt, bt, mask = _linear_inputs(dtype=torch.float32)
    ht, wt = ht.detach(), wt.detach()

    def f(hs, temperature, beta):
        return SF.linear_distillation_loss(hs, ws.detach(), ht, wt, kind="jsd", beta=beta,
                                           temperature=temperature, mask=mask, chunk_size=4)

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    for temperature, beta in ((0.5, 0.3), (0.7, 0.4)):
        h1, h2 = hs.detach().clone().requires_grad_(), hs.detach().clone().requires_grad_()
        out, ref = cf(h1, temperature, beta), f(h2, temperature, beta)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(_grads(out, h1)[0], _grads(ref, h2)[0])
