"""The failing snippets users posted about NaN or Inf losses, kept as regression tests: each runs the
user's torch spelling on the user's input and asserts it still gives the NaN or Inf reported, then asserts
that the one-import stablelosses swap gives a finite value and gradient, equal to torch's wherever torch's
is finite and to an independent float64 or closed-form value where it is not, and that a NaN put in still
comes out NaN.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stablelosses as sl
import stablelosses.functional as SF

INF = math.inf
NAN = math.nan
F64 = torch.float64


def _t(data, dtype=F64):
    return torch.tensor(data, dtype=dtype)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def value_and_grads(fn, *inputs):
    """``fn``'s value and the gradient of its sum with respect to each input (fresh leaves)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    value = fn(*leaves)
    return value.detach(), torch.autograd.grad(value.sum(), leaves)


def _finite(*tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def assert_hazard(value, grads):
    """The user's torch spelling still gives a NaN or an Inf, in the value or in a gradient."""
    assert not _finite(value, *grads), (value, grads)


def assert_matches(ours, theirs, exact, **tol):
    """``ours`` equals torch's result where that is finite and the independent ``exact`` one elsewhere."""
    ref = torch.where(torch.isfinite(theirs), theirs, exact.to(theirs.dtype))
    torch.testing.assert_close(ours, ref, **tol)


# discuss.pytorch.org/t/function-mselossbackward-returned-nan-values-in-its-0th-output/94875
def test_sqrt_of_mse_at_zero_residual():
    x, y = _t([[0.7]]), torch.zeros(1, 1, dtype=F64)
    tv, (tg,) = value_and_grads(lambda x: torch.sqrt(nn.MSELoss()(x * 0, y)), x)
    assert tv == 0 and torch.isnan(tg).all()
    sv, (sg,) = value_and_grads(lambda x: sl.RMSELoss()(x * 0, y), x)
    assert _finite(sv, sg)
    # the residual x * 0 is 0 for every x, so the loss is constant: value 0, derivative 0
    assert_matches(sv, tv, torch.zeros(()))
    assert_matches(sg, tg, torch.zeros_like(sg))
    assert torch.isnan(sl.RMSELoss()(_t([NAN, 1.0]), torch.zeros(2, dtype=F64)))


def _classic_focal(logits, t, gamma):
    logpt = F.log_softmax(logits, -1).gather(1, t[:, None]).squeeze(1)
    return (-((1 - logpt.exp()) ** gamma) * logpt).mean()


def _focal_exact(x, t, gamma):
    """The mean of -(1-p_t)^gamma log p_t and its gradient in closed form, 1 - p_t summed from the others."""
    p = torch.softmax(x, -1)
    onehot = F.one_hot(t, x.shape[-1]).bool()
    q = p.masked_fill(onehot, 0).sum(-1)
    pt = p[onehot]
    logpt = torch.log1p(-q)
    value = (-(q**gamma) * logpt).mean()
    dl_dpt = gamma * q ** (gamma - 1) * logpt - q**gamma / pt
    dpt_dx = pt[:, None] * torch.where(onehot, q[:, None], -p)  # p_t (delta_tj - p_j)
    return value, dl_dpt[:, None] * dpt_dx / x.shape[0]


# github.com/clcarwin/focal_loss_pytorch/issues/13, github.com/kaidic/LDAM-DRW/issues/17
@pytest.mark.parametrize("gamma", [0.5, 0.2])
def test_focal_loss_with_gamma_below_one(gamma):
    x, t = _t([[40.0, 0.0, -3.0], [0.0, 1.0, 2.0]]), torch.tensor([0, 1])
    tv, (tg,) = value_and_grads(lambda x: _classic_focal(x, t, gamma), x)
    assert_hazard(tv, [tg])
    sv, (sg,) = value_and_grads(lambda x: SF.focal_loss(x, t, gamma=gamma), x)
    assert _finite(sv, sg)
    ev, eg = _focal_exact(x, t, gamma)
    assert_matches(sv, tv, ev)
    assert_matches(sg, tg, eg)
    torch.testing.assert_close(sg, eg)
    assert torch.isnan(SF.focal_loss(_t([[NAN, 0.0, 1.0]]), torch.tensor([1]), gamma=gamma))


def _torchvision_sigmoid_focal(x, t, alpha, gamma):
    p = torch.sigmoid(x)
    ce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
    p_t = p * t + (1 - p) * (1 - t)
    return (alpha * t + (1 - alpha) * (1 - t)) * ce * ((1 - p_t) ** gamma)


# github.com/kornia/kornia/issues/918
def test_sigmoid_focal_loss_with_saturated_logits():
    x, t = _t([[-100.0, -100.0, 100.0, 100.0]]), _t([[0.0, 1.0, 0.0, 1.0]])
    tv, (tg,) = value_and_grads(lambda x: _torchvision_sigmoid_focal(x, t, 0.25, 0.5).mean(), x)
    assert_hazard(tv, [tg])
    sv, (sg,) = value_and_grads(lambda x: SF.sigmoid_focal_loss(x, t, 0.25, 0.5, "mean"), x)
    assert _finite(sv, sg)

    def exact(x):  # 1 - p_t = sigmoid(z) and the BCE = softplus(z), z the logit signed against the target
        z = torch.where(t == 1, -x, x)
        return ((0.25 * t + 0.75 * (1 - t)) * F.softplus(z) * torch.sigmoid(z) ** 0.5).mean()

    ev, (eg,) = value_and_grads(exact, x)
    assert_matches(sv, tv, ev)
    assert_matches(sg, tg, eg)
    out = SF.sigmoid_focal_loss(_t([NAN, 1.0]), _t([1.0, 0.0]), 0.25, 0.5)
    assert torch.isnan(out[0]) and torch.isfinite(out[1])


# github.com/pytorch/pytorch/issues/41508, github.com/allenai/allennlp/issues/890
@pytest.mark.parametrize(("ours", "theirs", "empty_row"), [
    (SF.softmax, torch.softmax, 0.0),
    (SF.log_softmax, torch.log_softmax, -INF),
], ids=["softmax", "log_softmax"])
def test_fully_masked_softmax_row(ours, theirs, empty_row):
    x = _t([[0.3, -1.2, 2.0, 0.1], [1.5, -0.4, 0.0, 0.9]])
    m = torch.tensor([[True] * 4, [False] * 4])
    w = _t([[0.5, -1.0, 2.0, 0.3], [1.0, 1.0, -2.0, 0.7]])  # a cotangent that is not all ones
    tv, (tg,) = value_and_grads(lambda x: theirs(x.masked_fill(~m, -INF), -1) * w, x)
    assert torch.isnan(tv[1]).all()  # masked_fill stops the gradient, but a NaN row poisons what follows
    sv, (sg,) = value_and_grads(lambda x: ours(x, -1, mask=m) * w, x)
    assert _finite(sv[0], sg)
    # the row with no entry left: softmax 0 and log_softmax -inf, constant in x, so gradient 0
    assert_matches(sv, tv, torch.full_like(sv, empty_row) * w)
    assert_matches(sg, tg, torch.zeros_like(sg))
    assert torch.isnan(ours(_t([[NAN, 1.0, 2.0]]), -1)).all()


# github.com/pytorch/pytorch/issues/31829
def test_logsumexp_of_all_neg_inf():
    x = _t([[-INF, -INF], [0.5, -1.0]])
    tv, (tg,) = value_and_grads(lambda x: torch.logsumexp(x, -1), x)
    assert tv[0] == -INF and torch.isnan(tg[0]).all()
    sv, (sg,) = value_and_grads(lambda x: SF.logsumexp(x, -1), x)
    assert _finite(sg)
    torch.testing.assert_close(sv, tv)  # -inf is the exact value of log(0)
    assert_matches(sg, tg, torch.zeros_like(sg))  # no entry can move it off -inf
    assert torch.isnan(SF.logsumexp(_t([NAN, -INF]), 0))


# github.com/candle-org/MindAct/pull/1633, github.com/sooftware/kospeech/issues/37
def test_cross_entropy_label_smoothing_over_neg_inf_logits():
    x, t, eps = _t([[2.0, -INF, 0.5], [1.0, 0.0, -1.0]]), torch.tensor([0, 2]), 0.1
    tv, (tg,) = value_and_grads(lambda x: F.cross_entropy(x, t, label_smoothing=eps), x)
    assert tv == INF  # the eps/C share of the -inf class's -log p
    sv, (sg,) = value_and_grads(lambda x: SF.cross_entropy(x, t, label_smoothing=eps), x)
    assert _finite(sv, sg)
    # (1 - eps) nll + eps / K sum of -log p over the K classes with a finite logit;
    # gradient p - (1 - eps) 1_t - eps / K on those classes, 0 on the -inf one
    finite = torch.isfinite(x)
    k = finite.sum(-1, keepdim=True)
    lp = torch.log_softmax(x, -1)
    rows = -(1 - eps) * lp.gather(1, t[:, None]).squeeze(1) - eps / k.squeeze(1) * lp.where(finite, 0).sum(-1)
    grad = (torch.softmax(x, -1) - (1 - eps) * F.one_hot(t, 3) - eps / k * finite) / 2
    assert_matches(sv, tv, rows.mean())
    # torch's gradient is finite but belongs to an infinite row loss: compare on the rows whose loss is finite
    row_finite = torch.isfinite(F.cross_entropy(x, t, label_smoothing=eps, reduction="none"))
    assert row_finite.tolist() == [False, True]
    torch.testing.assert_close(sg, torch.where(row_finite[:, None], tg, grad))
    torch.testing.assert_close(sg, grad)
    torch.testing.assert_close(SF.cross_entropy(x[:1], t[:1], label_smoothing=eps), _t(0.2764133), atol=1e-6,
                               rtol=0)
    assert torch.isnan(SF.cross_entropy(_t([[NAN, 0.0, 1.0]]), torch.tensor([1]), label_smoothing=eps))


# github.com/pytorch/pytorch/issues/49844, /issues/102894, /issues/135359
@pytest.mark.parametrize(("logits", "target"), [
    ([-INF], [0.0]),
    ([INF, 1.0], [1.0, 0.0]),
    ([-INF], [0.9]),
], ids=["neg_inf_t0", "pos_inf_t1", "neg_inf_t09"])
def test_bce_with_logits_at_infinite_logits(logits, target):
    x, t = _t(logits), _t(target)
    tv, _ = value_and_grads(lambda x: nn.BCEWithLogitsLoss()(x, t), x)
    assert torch.isnan(tv)
    sv, (sg,) = value_and_grads(lambda x: sl.BCEWithLogitsLoss()(x, t), x)
    assert _finite(sg)
    # t softplus(-x) + (1 - t) softplus(x), a term with a zero factor being 0; gradient (sigmoid(x) - t) / N
    pos = torch.where(t == 0, 0, t * F.softplus(-x))
    neg = torch.where(t == 1, 0, (1 - t) * F.softplus(x))
    assert_matches(sv, tv, (pos + neg).mean())  # inf for the -inf logit with target 0.9, the true value
    torch.testing.assert_close(sg, (torch.sigmoid(x) - t) / x.numel())
    out = sl.BCEWithLogitsLoss(reduction="none")(_t([NAN, 1.0]), _t([1.0, 0.0]))
    assert torch.isnan(out[0]) and torch.isfinite(out[1])


# github.com/pytorch/pytorch/issues/89558, github.com/google-deepmind/optax/pull/1786
@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div_with_zero_targets_against_masked_log_probs(log_target):
    z = _t([[0.5, 1.0, 2.0, -INF]])
    q = _t([[0.0, 0.4, 0.6, 0.0]])
    target = q.log() if log_target else q
    tv, (tg,) = value_and_grads(
        lambda z: F.kl_div(F.log_softmax(z, -1), target, reduction="batchmean", log_target=log_target), z)
    assert_hazard(tv, [tg])
    sv, (sg,) = value_and_grads(
        lambda z: SF.kl_div(F.log_softmax(z, -1), target, reduction="batchmean", log_target=log_target), z)
    assert _finite(sv, sg)
    # KL over the support of q; gradient with respect to the logits softmax(z) - q
    support = q > 0
    kl = (q[support] * (q[support].log() - torch.log_softmax(z, -1)[support])).sum()
    assert_matches(sv, tv, kl)
    assert_matches(sg, tg, torch.softmax(z, -1) - q)
    torch.testing.assert_close(sg, torch.softmax(z, -1) - q)
    assert torch.isnan(SF.kl_div(_t([NAN, -1.0]), _t([0.5, 0.5]), reduction="sum"))


# github.com/pytorch/pytorch/issues/2421, huggingface/sentence-transformers PR 4033
_EMB = _t([[0.3, -1.1, 2.0], [0.0, 0.5, -0.7]])


@pytest.mark.parametrize(("x", "theirs", "ours"), [
    (torch.zeros(3, dtype=F64), lambda x: x.pow(2).sum().sqrt(), lambda x: SF.safe_sqrt(x.pow(2).sum())),
    (_EMB, lambda b: ((_EMB - b) ** 2).sum(-1).sqrt().sum(),
     lambda b: SF.safe_sqrt(((_EMB - b) ** 2).sum(-1)).sum()),
], ids=["norm_of_zero", "identical_embeddings"])
def test_norm_at_zero(x, theirs, ours):
    tv, (tg,) = value_and_grads(theirs, x)
    assert tv == 0 and torch.isnan(tg).all()
    sv, (sg,) = value_and_grads(ours, x)
    assert _finite(sv, sg)
    assert_matches(sv, tv, torch.zeros(()))
    assert_matches(sg, tg, torch.zeros_like(sg))  # 0 at the minimum of the distance
    assert torch.isnan(SF.safe_sqrt(_t(NAN)))


# github.com/google-deepmind/optax/pull/946
def test_cosine_similarity_of_a_zero_embedding():
    a, b = torch.zeros(1, 4, dtype=F64), _t([[0.3, -1.2, 0.5, 2.0]])
    tv, (tg,) = value_and_grads(lambda a: (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)), a)
    assert torch.isnan(tv).all() and torch.isnan(tg).all()
    sv, (sg,) = value_and_grads(lambda a: SF.cosine_similarity(a, b), a)
    assert _finite(sv, sg)
    # 0, the value F.cosine_similarity gives there too, and the library's defined gradient there, 0
    assert_matches(sv, tv, F.cosine_similarity(a, b))
    assert_matches(sg, tg, torch.zeros_like(sg))
    assert torch.isnan(SF.cosine_similarity(_t([[NAN, 1.0]]), _t([[1.0, 1.0]]))).all()


# github.com/pytorch/pytorch/pull/16199, github.com/wenet-e2e/wenet/pull/2299
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_ctc_loss_with_an_impossible_alignment(reduction):
    lp = torch.randn(3, 2, 5, dtype=F64, generator=_gen(0)).log_softmax(-1)
    targets, il, tl = torch.tensor([[1, 2, 3, 4], [1, 2, 0, 0]]), torch.tensor([3, 3]), torch.tensor([4, 2])
    tv, (tg,) = value_and_grads(lambda lp: F.ctc_loss(lp, targets, il, tl, reduction=reduction), lp)
    assert torch.isinf(tv).any() and torch.isnan(tg).any()  # sample 0 has 4 labels in 3 frames
    sv, (sg,) = value_and_grads(lambda lp: SF.ctc_loss(lp, targets, il, tl, reduction=reduction), lp)
    assert _finite(sg)
    torch.testing.assert_close(sv, tv)  # inf, the true value: the alignment has probability 0
    # no change of the log-probs makes sample 0 possible: its gradient is 0, as torch's zero_infinity gives
    _, (zg,) = value_and_grads(
        lambda lp: F.ctc_loss(lp, targets, il, tl, reduction=reduction, zero_infinity=True), lp)
    assert_matches(sg, tg, torch.zeros_like(sg))
    torch.testing.assert_close(sg, zg)
    bad = lp.clone()
    bad[0, 1, 0] = NAN
    assert torch.isnan(SF.ctc_loss(bad, targets, il, tl, reduction="none")[1])


# github.com/pytorch/pytorch/issues/53964
def test_gaussian_nll_variance_below_the_floor():
    x, y, var = _t([0.0, 1.0]), _t([1.0, 1.0]), _t([1e-12, 1e-12])
    tv, (tg,) = value_and_grads(lambda v: F.gaussian_nll_loss(x, y, v, reduction="none"), var)
    # no NaN here: torch clamps var in place under no_grad, so its gradient is (1/eps - r^2/eps^2) / 2
    torch.testing.assert_close(tg, _t([0.5e6 - 0.5e12, 0.5e6]))
    sv, (sg,) = value_and_grads(lambda v: SF.gaussian_nll_loss(x, y, v, reduction="none"), var)
    assert _finite(sv, sg)
    torch.testing.assert_close(sv, tv)
    torch.testing.assert_close(sg, torch.zeros_like(sg))  # the loss is constant in var below eps
    _, (tgx,) = value_and_grads(lambda i: F.gaussian_nll_loss(i, y, var, reduction="none"), x)
    _, (sgx,) = value_and_grads(lambda i: SF.gaussian_nll_loss(i, y, var, reduction="none"), x)
    torch.testing.assert_close(sgx, tgx)
    assert torch.isnan(SF.gaussian_nll_loss(_t([NAN]), _t([1.0]), _t([1.0])))


def _trl_grpo(logps, old, adv, mask, eps=0.2):
    c1 = torch.exp(logps - old)
    c2 = torch.clamp(c1, 1 - eps, 1 + eps)
    ptl = -torch.min(c1 * adv[:, None], c2 * adv[:, None])
    m = mask.to(ptl.dtype)
    return ((ptl * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


# github.com/MakazhanAlpamys/Soup/issues/342, github.com/NVIDIA-NeMo/RL/pull/4120
@pytest.mark.parametrize(("logps", "old", "mask"), [
    ([[-1.0, -2.0, 0.0]], [[-1.1, -1.9, -200.0]], [[True, True, False]]),
    ([[0.0, -1.0]], [[-200.0, -1.0]], [[True, True]]),
], ids=["padding", "clipped"])
def test_grpo_ratio_overflow(logps, old, mask):
    # float32 as in the report: exp(200) overflows there (not in float64)
    logps, old, adv = _t(logps, torch.float32), _t(old, torch.float32), _t([1.0], torch.float32)
    mask = torch.tensor(mask)
    tv, (tg,) = value_and_grads(lambda lp: _trl_grpo(lp, old, adv, mask), logps)
    assert torch.isfinite(tv) and torch.isnan(tg).any()
    sv, (sg,) = value_and_grads(lambda lp: SF.policy_loss(lp, old, adv, mask), logps)
    assert _finite(sv, sg)
    torch.testing.assert_close(sv, tv)
    # the NaN entry is masked out or on the clipped (constant) branch: its derivative is 0
    assert_matches(sg, tg, torch.zeros_like(sg))
    assert torch.isnan(SF.policy_loss(_t([[NAN, -1.0]]), torch.zeros(1, 2, dtype=F64), _t([1.0]),
                                      torch.ones(1, 2, dtype=torch.bool)))


def _trl_entropy(z):
    lp = F.log_softmax(z, -1)
    return -(torch.exp(lp) * lp).sum(-1)


def _trl_entropy_nan_to_num(z):
    lp = F.log_softmax(z, -1)
    return -(torch.exp(lp) * lp).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).sum(-1)


# github.com/huggingface/trl/issues/7221, github.com/huggingface/trl/pull/7252
@pytest.mark.parametrize("z", [
    _t([[0.0, -INF]]), _t([[0.0, 0.0, -INF]]), _t([[65504.0, -65504.0]], torch.float16),
], ids=["one_finite", "two_finite", "fp16_extremes"])
def test_entropy_from_logits(z):
    tv, (tg,) = value_and_grads(_trl_entropy, z)
    assert_hazard(tv, [tg])
    nv, (ng,) = value_and_grads(_trl_entropy_nan_to_num, z)
    assert _finite(nv) and torch.isnan(ng).any()  # the nan_to_num patch: finite value, NaN gradient
    sv, (sg,) = value_and_grads(SF.entropy, z)
    assert _finite(sv, sg)
    # H = -sum p log p over float64, dH/dz_j = -(p_j log p_j + p_j H)
    p = torch.softmax(z.double(), -1)
    plogp = torch.special.xlogy(p, p)
    h = -plogp.sum(-1)
    grad = -(plogp + p * h[:, None])
    torch.testing.assert_close(h, torch.distributions.Categorical(logits=z.double()).entropy())
    assert_matches(sv, tv, h)
    assert_matches(sg, tg, grad)
    torch.testing.assert_close(sg.double(), grad)
    assert torch.isnan(SF.entropy(_t([[NAN, 0.0]]))).all()


def _trl_generalized_jsd(s, t, beta):
    sl_, tl = F.log_softmax(s, -1), F.log_softmax(t, -1)
    if beta == 0:
        j = F.kl_div(sl_, tl, reduction="none", log_target=True)
    else:
        mix = torch.logsumexp(torch.stack([sl_ + math.log(1 - beta), tl + math.log(beta)]), 0)
        j = beta * F.kl_div(mix, tl, reduction="none", log_target=True) \
            + (1 - beta) * F.kl_div(mix, sl_, reduction="none", log_target=True)
    return j.sum(-1)


def _jsd_exact(s, t, beta):
    """beta KL(Q||M) + (1-beta) KL(P||M), M = (1-beta) P + beta Q, with xlogy (0 log 0 = 0); KL(Q||P) at 0."""
    p, q = torch.softmax(s, -1), torch.softmax(t, -1)
    m = (1 - beta) * p + beta * q

    def kl(a, b):
        return (torch.special.xlogy(a, a) - torch.special.xlogy(a, b)).sum(-1)

    return kl(q, p) if beta == 0 else beta * kl(q, m) + (1 - beta) * kl(p, m)


# github.com/linkedin/Liger-Kernel/issues/769 and TRL's generalized_jsd_loss over top-k (-inf) logits
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_jsd_with_neg_inf_logits(beta):
    s, t = _t([[1.0, 0.5, -INF, -0.3]]), _t([[2.0, -INF, -INF, 0.1]])
    tv, (tg,) = value_and_grads(lambda s: _trl_generalized_jsd(s, t, beta), s)
    assert_hazard(tv, [tg])
    sv, (sg,) = value_and_grads(
        lambda s: SF.distillation_loss(s, t, kind="jsd", beta=beta, reduction="none"), s)
    assert _finite(sv, sg)
    # class 2 is -inf for both, so it has no mass anywhere: leave it out (gradient 0 there)
    keep = [0, 1, 3]
    ev, (eg,) = value_and_grads(lambda s: _jsd_exact(s, t[:, keep], beta), s[:, keep])
    full = torch.zeros_like(sg)
    full[:, keep] = eg
    assert_matches(sv, tv, ev)
    assert_matches(sg, tg, full)
    bad = _t([[NAN, 0.5, 0.1, -0.3]])
    assert torch.isnan(SF.distillation_loss(bad, t, kind="jsd", beta=beta, reduction="none")).all()


# github.com/linkedin/Liger-Kernel/issues/1453
def test_jsd_when_both_log_probs_underflow():
    # float32 as reported: exp(-110) is 0 there
    s, t = _t([[0.0, -110.0, -0.5]], torch.float32), _t([[0.0, -110.0, 0.3]], torch.float32)

    def liger_mix(s, beta=0.5):
        sl_, tl = F.log_softmax(s, -1), F.log_softmax(t, -1)
        lm = ((1 - beta) * sl_.exp() + beta * tl.exp()).log()
        return (beta * (tl.exp() * (tl - lm)) + (1 - beta) * (sl_.exp() * (sl_ - lm))).sum(-1)

    tv, (tg,) = value_and_grads(liger_mix, s)
    assert_hazard(tv, [tg])
    sv, (sg,) = value_and_grads(lambda s: SF.distillation_loss(s, t, kind="jsd", reduction="none"), s)
    assert _finite(sv, sg)
    ev, (eg,) = value_and_grads(lambda s: _jsd_exact(s, t.double(), 0.5), s.double())
    assert_matches(sv, tv, ev)
    assert_matches(sg, tg, eg)
    torch.testing.assert_close(sv, _trl_generalized_jsd(s, t, 0.5))
    bad = _t([[NAN, 0.0, 1.0]])
    assert torch.isnan(SF.distillation_loss(bad, t.double(), kind="jsd", reduction="none")).all()


def _trl_orpo(c, r, beta=0.1):
    lo = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    return (-beta * F.logsigmoid(lo)).mean()


def _orpo_exact(c, r, beta=0.1):
    """beta softplus(-log_odds) in float64 with expm1, and its gradient in closed form (finite at c = 0)."""
    c, r = c.double(), r.double()
    a, b = -torch.expm1(c), -torch.expm1(r)  # 1 - e^c, 1 - e^r
    log_odds = (c - r) - torch.log(a) + torch.log(b)
    den = a + torch.exp(c - r) * b  # (1 + e^log_odds)(1 - e^c)
    return beta * F.softplus(-log_odds), -beta / den, beta * a / (b * den)


# github.com/huggingface/trl/issues/3237, github.com/hpcaitech/ColossalAI/pull/6407
@pytest.mark.parametrize(("chosen", "dtype"), [
    (-1e-9, torch.float32), (0.0, torch.float32), (-1e-8, torch.bfloat16),
], ids=["fp32_-1e-9", "fp32_0", "bf16_-1e-8"])
def test_orpo_log1mexp_near_zero(chosen, dtype):
    c, r = _t([chosen], dtype), _t([-0.5], dtype)
    tv, (tgc, tgr) = value_and_grads(_trl_orpo, c, r)
    assert_hazard(tv, [tgc, tgr])
    sv, (sgc, sgr) = value_and_grads(SF.orpo_loss, c, r)
    assert _finite(sv, sgc, sgr)
    ev, egc, egr = _orpo_exact(c, r)
    # the value is float32 for a bfloat16 input (documented), the gradients keep the input's dtype
    assert_matches(sv, tv, ev.squeeze(), check_dtype=False)
    assert_matches(sgc, tgc, egc)
    assert_matches(sgr, tgr, egr)
    tol = {"rtol": 1.6e-2, "atol": 1e-12} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-12}
    torch.testing.assert_close(sv.double(), ev.squeeze(), **tol)  # exact, where torch's 0 is only close
    torch.testing.assert_close(sgc.double(), egc, **tol)
    assert torch.isnan(SF.orpo_loss(_t([NAN]), _t([-1.0])))


# github.com/Lightning-AI/torchmetrics/issues/3488
def test_log_cosh_of_a_large_residual():
    # float32 as reported: exp(100) overflows there
    p, t = _t([100.0, -100.0], torch.float32), torch.zeros(2)
    tv, (tg,) = value_and_grads(lambda p: torch.log((torch.exp(p - t) + torch.exp(-(p - t))) / 2).mean(), p)
    assert tv == INF
    sv, (sg,) = value_and_grads(lambda p: SF.log_cosh_loss(p, t), p)
    assert _finite(sv, sg)
    r = p.double()
    exact = (r.abs() + torch.log1p(torch.exp(-2 * r.abs())) - math.log(2)).mean()  # 100 - log 2
    assert_matches(sv, tv, exact)
    assert_matches(sg, tg, torch.tanh(r) / 2)
    assert torch.isnan(SF.log_cosh_loss(_t([NAN]), torch.zeros(1, dtype=F64)))


# github.com/google-deepmind/optax/issues/896, github.com/OpenBMB/ModelCenter/issues/14
@pytest.mark.parametrize(("logits", "teacher"), [
    ([[-INF, 0.0]], None),
    ([[1.0, 0.5, -INF]], [[2.0, 0.0, -INF]]),
], ids=["soft_target_cross_entropy", "distillation"])
def test_soft_target_cross_entropy_over_neg_inf(logits, teacher):
    x = _t(logits)
    q = _t([[0.0, 1.0]]) if teacher is None else torch.softmax(_t(teacher), -1)
    if teacher is None:
        tv, (tg,) = value_and_grads(lambda x: F.cross_entropy(x, q), x)
    else:
        tv, (tg,) = value_and_grads(lambda x: -(q * F.log_softmax(x, -1)).sum(-1).mean(), x)
    assert_hazard(tv, [tg])
    sv, (sg,) = value_and_grads(lambda x: SF.cross_entropy(x, q), x)
    assert _finite(sv, sg)
    # cross-entropy over the support of q; gradient softmax(x) - q
    support = q > 0
    ce = -(q[support] * torch.log_softmax(x, -1)[support]).sum()
    assert_matches(sv, tv, ce)
    assert_matches(sg, tg, torch.softmax(x, -1) - q)
    assert torch.isnan(SF.cross_entropy(_t([[NAN, 0.0]]), _t([[0.5, 0.5]])))


# github.com/linkedin/Liger-Kernel/issues/512: a fused linear cross-entropy drifting from the unfused loss.
# torch has no NaN here, so only the parity part applies.
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_linear_cross_entropy_equals_the_unfused_loss(reduction, label_smoothing):
    g = _gen(0)
    h, w = torch.randn(10, 8, dtype=F64, generator=g), torch.randn(13, 8, dtype=F64, generator=g)
    t = torch.randint(0, 13, (10,), generator=g)
    t[3] = -100
    tv, tg = value_and_grads(
        lambda h, w: F.cross_entropy(h @ w.T, t, reduction=reduction, label_smoothing=label_smoothing), h, w)
    sv, sg = value_and_grads(lambda h, w: SF.linear_cross_entropy(
        h, w, t, reduction=reduction, label_smoothing=label_smoothing, ignore_index=-100, chunk_size=3), h, w)
    assert _finite(sv, *sg)
    torch.testing.assert_close(sv, tv)
    torch.testing.assert_close(sg, tg)
    if reduction == "mean" and label_smoothing == 0.0 and hasattr(F, "linear_cross_entropy"):
        torch.testing.assert_close(SF.linear_cross_entropy(h, w, t, ignore_index=-100),
                                   F.linear_cross_entropy(h, w, t, ignore_index=-100))
    bad = h[:4].clone()
    bad[0, 0] = NAN
    assert torch.isnan(SF.linear_cross_entropy(bad, w, torch.tensor([1, 2, 3, 4])))
