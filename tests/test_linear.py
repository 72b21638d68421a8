"""linear_cross_entropy / linear_focal_loss: parity with the unfused torch path, masks, z-loss,
softcap, reductions, gradcheck, low precision, transforms, argument errors, no (N, V) tensor."""

from __future__ import annotations

import functools
import math

import mpmath
import pytest
import torch
import torch.nn.functional as F
from mask_helpers import NAN, D, _gen, _grad, _masked_ref, _torch_focal_none
from torch.utils._python_dispatch import TorchDispatchMode

import stablelosses as sl
import stablelosses.functional as SF
from stablelosses.functional._linear import CHUNK_BYTES, default_chunk_size

INF = float("inf")
N, H, V = 32, 6, 11
CHUNKS = [None, 1, 7, 32, 50]  # 7 does not divide N; 50 > N


def _data(n=N, h=H, v=V, dtype=torch.float64, bias=True, scale=1.5):
    x = torch.randn(n, h, dtype=dtype) * scale
    w = torch.randn(v, h, dtype=dtype)
    b = torch.randn(v, dtype=dtype) if bias else None
    t = torch.randint(0, v, (n,))
    return x, w, b, t


def _grads(loss, tensors, go=None):
    tensors = [t for t in tensors if t is not None]
    return torch.autograd.grad(loss, tensors, go if go is not None else torch.ones_like(loss))


def _leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in ts]


def ref_loss(x, w, t, b=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
             z_loss=0.0, softcap=None, gamma=None):
    """float64 reference from torch ops, written from the definition (not from our kernel).

    Masked (-inf) logits get no smoothing mass; rows whose logits are all -inf or whose target
    is ignore_index count as ignored. Rows that are ignored are replaced by zeros before the
    log-softmax so that their (unused) NaN does not reach the gradient.
    """
    u = F.linear(x.double(), w.double(), None if b is None else b.double())
    if softcap is not None:
        u = torch.where(u == -INF, -INF, softcap * torch.tanh(u / softcap))
    kept = t != ignore_index
    all_masked = (u == -INF).all(1)
    valid = kept & ~all_masked
    u = torch.where(all_masked[:, None], torch.zeros_like(u), u)
    logp = torch.log_softmax(u, 1)
    ts = torch.where(kept, t, 0)
    lpt = logp.gather(1, ts[:, None]).squeeze(1)
    if gamma is None:
        unmasked = u != -INF
        k = unmasked.sum(1)
        smooth = -torch.where(unmasked, logp, torch.zeros_like(logp)).sum(1) / k
        loss = (1 - label_smoothing) * (-lpt) + label_smoothing * smooth
    else:
        loss = (1 - lpt.exp()) ** gamma * (-lpt)
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(u, 1) ** 2
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


def _assert_parity(ours_fn, ref_fn, tensors, reduction, rtol=1e-10, atol=1e-12):
    a, b = _leaves(*tensors), _leaves(*tensors)
    la, lb = ours_fn(*a), ref_fn(*b)
    torch.testing.assert_close(la, lb.to(la.dtype), rtol=rtol, atol=atol, equal_nan=True)
    go = torch.randn_like(lb) if reduction == "none" else None
    ga = _grads(la, a, None if go is None else go.to(la.dtype))
    gb = _grads(lb, b, go)
    for p, q in zip(ga, gb):
        torch.testing.assert_close(p, q.to(p.dtype), rtol=rtol, atol=atol)


# --- parity with torch's unfused path ------------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_unfused_torch(chunk, reduction, bias):
    x, w, b, t = _data(bias=bias)
    t[[2, 9]] = -100
    _assert_parity(
        lambda x, w, b: SF.linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction, chunk_size=chunk),
        lambda x, w, b: F.cross_entropy(F.linear(x, w, b), t, reduction=reduction),
        (x, w, b), reduction,
    )


@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("eps", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_label_smoothing_and_ignore_index_match_torch(chunk, eps, ignore_index):
    x, w, b, t = _data()
    t[::5] = ignore_index
    _assert_parity(
        lambda x, w, b: SF.linear_cross_entropy(
            x, w, t, linear_bias=b, ignore_index=ignore_index, label_smoothing=eps, chunk_size=chunk),
        lambda x, w, b: F.cross_entropy(F.linear(x, w, b), t, ignore_index=ignore_index, label_smoothing=eps),
        (x, w, b), "mean",
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_softcap_matches_torch(reduction):
    x, w, b, t = _data(scale=4.0)
    c = 3.0
    _assert_parity(
        lambda x, w, b: SF.linear_cross_entropy(x, w, t, linear_bias=b, softcap=c, reduction=reduction, chunk_size=6),
        lambda x, w, b: F.cross_entropy(c * torch.tanh(F.linear(x, w, b) / c), t, reduction=reduction),
        (x, w, b), reduction,
    )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_z_loss_matches_torch(reduction):
    x, w, b, t = _data()
    t[4] = -100
    z = 1e-2

    def torch_path(x, w, b):
        logits = F.linear(x, w, b)
        kept = (t != -100).to(x.dtype)
        rows = F.cross_entropy(logits, t, reduction="none") + z * torch.logsumexp(logits, 1) ** 2 * kept
        if reduction == "none":
            return rows
        return rows.sum() if reduction == "sum" else rows.sum() / kept.sum()

    _assert_parity(
        lambda x, w, b: SF.linear_cross_entropy(x, w, t, linear_bias=b, z_loss=z, reduction=reduction, chunk_size=5),
        torch_path, (x, w, b), reduction,
    )


def test_float32_against_float64_torch():
    x, w, b, t = _data(n=40, h=16, v=300, dtype=torch.float32)
    a = _leaves(x, w, b)
    loss = SF.linear_cross_entropy(*a[:2], t, linear_bias=a[2], chunk_size=16, label_smoothing=0.1)
    r = _leaves(x.double(), w.double(), b.double())
    ref = F.cross_entropy(F.linear(*r), t, label_smoothing=0.1)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, rtol=2e-6, atol=1e-6)
    for p, q in zip(_grads(loss, a), _grads(ref, r)):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.double(), q, rtol=1e-4, atol=1e-6)


def test_leading_dims_flatten():
    x, w, b, t = _data(n=12)
    x3, t3 = x.reshape(3, 4, H), t.reshape(3, 4)
    out = SF.linear_cross_entropy(x3, w, t3, linear_bias=b, reduction="none", chunk_size=5)
    assert out.shape == (3, 4)
    torch.testing.assert_close(out, F.cross_entropy(F.linear(x3, w, b).transpose(1, 2), t3, reduction="none"))
    torch.testing.assert_close(
        SF.linear_cross_entropy(x3, w, t3, linear_bias=b), F.cross_entropy(F.linear(x, w, b), t))


def test_uint8_target():
    x, w, b, t = _data()
    torch.testing.assert_close(
        SF.linear_cross_entropy(x, w, t.to(torch.uint8), linear_bias=b), F.cross_entropy(F.linear(x, w, b), t))


# --- masks, ignored rows, the defined values ----------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_batch(reduction):
    x, w, b, t = _data()
    t[:] = -100
    a = _leaves(x, w, b)
    loss = SF.linear_cross_entropy(a[0], a[1], t, linear_bias=a[2], reduction=reduction, z_loss=0.1, label_smoothing=0.1)
    expected = F.cross_entropy(F.linear(x, w, b), t, reduction=reduction)
    torch.testing.assert_close(loss, expected, equal_nan=True)  # 'mean': NaN, as torch
    for g in _grads(loss, a):
        assert torch.equal(g, torch.zeros_like(g))  # zero gradients, not NaN


@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("z", [0.0, 1e-2])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_inf_bias_masks_vocab_entries(eps, z, softcap):
    x, w, b, t = _data()
    masked = torch.tensor([1, 4, 8])
    b[masked] = -INF
    t = torch.where(torch.isin(t, masked), 0, t)  # no target is masked
    kw = dict(label_smoothing=eps, z_loss=z, softcap=softcap)
    _assert_parity(
        lambda x, w, b: SF.linear_cross_entropy(x, w, t, linear_bias=b, chunk_size=7, **kw),
        lambda x, w, b: ref_loss(x, w, t, b, **kw),
        (x, w, b), "mean",
    )
    a = _leaves(x, w, b)
    gx, gw, gb = _grads(SF.linear_cross_entropy(a[0], a[1], t, linear_bias=a[2], chunk_size=7, **kw), a)
    assert torch.equal(gw[masked], torch.zeros_like(gw[masked]))  # exactly 0, not tiny
    assert torch.equal(gb[masked], torch.zeros_like(gb[masked]))
    assert torch.isfinite(gx).all() and torch.isfinite(gw).all()


def test_masked_without_smoothing_matches_torch():
    x, w, b, t = _data()
    b[[0, 5]] = -INF
    t = torch.where((t == 0) | (t == 5), 1, t)
    _assert_parity(
        lambda x, w, b: SF.linear_cross_entropy(x, w, t, linear_bias=b, chunk_size=4),
        lambda x, w, b: F.cross_entropy(F.linear(x, w, b), t),
        (x, w, b), "mean",
    )


@pytest.mark.parametrize("kw", [{}, {"z_loss": 1e-3}, {"gamma": 2.0}])
def test_all_masked_vocabulary_gives_zero_gradients_without_smoothing(kw):
    # every logit -inf (bias -inf): every row is fully masked, so every gradient is 0 (no
    # smoothing, whose masked fill would hide a NaN); the mean over no valid row is NaN
    x, w, b, t = _data()
    b[:] = -INF
    a = _leaves(x, w, b)
    fn = SF.linear_focal_loss if "gamma" in kw else SF.linear_cross_entropy
    loss = fn(a[0], a[1], t, linear_bias=a[2], chunk_size=5, reduction="sum", **kw)
    assert loss.item() == 0.0
    for g in _grads(loss, a):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fully_masked_rows_are_ignored(reduction):
    # Row 3 has logits all -inf: x_3 = (-inf, 0, ...) against a positive first column of W.
    x, w, b, t = _data(bias=False)
    w[:, 0] = w[:, 0].abs() + 0.1
    x[3] = 0.0
    x[3, 0] = -INF
    xa, xr = _leaves(x, x)
    kw = dict(label_smoothing=0.1, z_loss=1e-3, reduction=reduction)
    loss = SF.linear_cross_entropy(xa, w, t, chunk_size=5, **kw)
    ref = ref_loss(xr, w, t, label_smoothing=0.1, z_loss=1e-3, reduction=reduction)
    torch.testing.assert_close(loss, ref)
    (ga,), (gr,) = _grads(loss, [xa]), _grads(ref, [xr])
    torch.testing.assert_close(ga, gr)
    assert torch.equal(ga[3], torch.zeros(H, dtype=ga.dtype))
    if reduction == "mean":  # the denominator is the 31 other rows
        rows = ref_loss(xr, w, t, label_smoothing=0.1, z_loss=1e-3, reduction="none")
        torch.testing.assert_close(loss, rows.sum() / (N - 1))


def test_all_masked_vocab_gives_nan_mean_and_zero_grads():
    x, w, b, t = _data()
    b[:] = -INF
    a = _leaves(x, w, b)
    loss = SF.linear_cross_entropy(a[0], a[1], t, linear_bias=a[2], label_smoothing=0.1)
    assert loss.isnan()  # no valid row: 0 / 0, as torch's empty mean
    for g in _grads(loss, a):
        assert torch.equal(g, torch.zeros_like(g))


def test_finfo_min_is_an_ordinary_logit():
    x, w, _, t = _data(dtype=torch.float32, scale=0.1)
    b = torch.full((V,), torch.finfo(torch.float32).min)
    loss = SF.linear_cross_entropy(x, w, t, linear_bias=b)
    expected = F.cross_entropy(F.linear(x, w, b), t)  # every logit rounds to finfo.min: log V
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(loss, torch.tensor(math.log(V)))


def test_plus_inf_bias_gives_the_limit():
    x, w, _, _ = _data(dtype=torch.float32)
    b = torch.zeros(V)
    b[:2] = INF
    t = torch.zeros(N, dtype=torch.long)
    a = _leaves(x, w)
    loss = SF.linear_cross_entropy(a[0], a[1], t, linear_bias=b)
    torch.testing.assert_close(loss, torch.tensor(math.log(2.0)))  # uniform over the +inf entries
    assert all(torch.isfinite(g).all() for g in _grads(loss, a))


@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.1}, {"gamma": 2.0}, {"gamma": 0.5}], ids=str)
def test_zero_weight_target_at_a_masked_logit_adds_zero(kw):
    # -log p_t = +inf at a masked target; a class weight of 0 removes the term (0·inf = 0, as
    # cross_entropy), never NaN
    x, w, b, t = _data()
    b[1] = -INF
    t[:4] = 1
    cw = torch.rand(V, dtype=torch.float64) + 0.5
    cw[1] = 0.0
    a, r = _leaves(x, w, b), _leaves(x, w, b)
    gamma = kw.get("gamma")
    if gamma is None:
        la = SF.linear_cross_entropy(*a[:2], t, linear_bias=a[2], weight=cw, reduction="none", chunk_size=5, **kw)
        lr = SF.cross_entropy(F.linear(*r), t, weight=cw, reduction="none", **kw)
    else:
        la = SF.linear_focal_loss(*a[:2], t, linear_bias=a[2], weight=cw, reduction="none", chunk_size=5, **kw)
        lr = SF.focal_loss(F.linear(*r), t, gamma, weight=cw, reduction="none")
    torch.testing.assert_close(la, lr, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(la).all()
    go = torch.linspace(0.5, 1.5, N, dtype=torch.float64)
    for p, q in zip(_grads(la, a, go), _grads(lr, r, go)):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


# Rows with +inf logits (the limit: uniform over the +inf entries, probability 0 elsewhere) and
# rows with a genuine finfo.max logit (an ordinary row: torch's finite numbers), against the row
# core on the materialized logits. "max" stands for the dtype's finfo.max.
LIMIT_BIASES = {
    "one +inf": [INF, 0.0, 1.0, -2.0, 0.5],
    "two +inf": [INF, 0.0, INF, -2.0, 0.5],
    "+inf, the rest masked": [INF, -INF, INF, -INF, -INF],
    "finfo.max only": ["max", 0.0, 1.0, -2.0, 0.5],
    "+inf beside finfo.max": [INF, "max", 1.0, -2.0, 0.5],
}
LIMIT_KWARGS = [
    {}, {"label_smoothing": 0.1}, {"weight": True}, {"weight": True, "label_smoothing": 0.1},
    {"ignore_index": 1, "label_smoothing": 1.0}, {"gamma": 2.0}, {"gamma": 0.5, "weight": True},
]


def _limit_problem(bias, dtype, weighted, ignore_index=-100):
    g = torch.Generator().manual_seed(3)
    fmax = torch.finfo(dtype).max
    v = len(bias)
    x = torch.randn(12, 4, generator=g, dtype=dtype)
    w = torch.randn(v, 4, generator=g, dtype=dtype)
    b = torch.tensor([fmax if c == "max" else c for c in bias], dtype=dtype)
    t = torch.arange(12) % v  # every class a target, the +inf ones included
    t[5] = ignore_index
    cw = None
    if weighted:  # class 1 weighs 0: its terms (+inf or not) are 0, never NaN
        cw = torch.rand(v, generator=g, dtype=dtype) + 0.5
        cw[1] = 0.0
    return x, w, b, t, cw


def _limit_call(x, w, b, t, cw, kw, fused):
    kw = {k: v for k, v in kw.items() if k != "weight"}
    gamma = kw.pop("gamma", None)
    if fused:
        fn = SF.linear_cross_entropy if gamma is None else functools.partial(SF.linear_focal_loss, gamma=gamma)
        return fn(x, w, t, linear_bias=b, weight=cw, reduction="none", chunk_size=5, **kw)
    u = F.linear(x, w, b)
    if gamma is None:
        return SF.cross_entropy(u, t, weight=cw, reduction="none", **kw)
    return SF.focal_loss(u, t, gamma, weight=cw, reduction="none", **kw)


def test_plus_inf_logit_at_another_class_gives_inf_not_finfo_max():
    x, w, t = torch.ones(1, 1), torch.zeros(3, 1), torch.tensor([1])
    fmax = torch.finfo(torch.float32).max
    b = torch.tensor([INF, 0.0, 1.0])  # the target's probability is 0 in the limit
    assert SF.linear_cross_entropy(x, w, t, linear_bias=b) == INF
    assert SF.linear_focal_loss(x, w, t, linear_bias=b) == INF
    assert SF.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1) == INF
    b = torch.tensor([INF, INF, 1.0])  # a +inf target: log 2; with smoothing class 2 takes mass
    torch.testing.assert_close(SF.linear_cross_entropy(x, w, t, linear_bias=b), torch.tensor(math.log(2.0)))
    assert SF.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1) == INF
    b = torch.tensor([INF, INF, -INF])  # ... unless every other class is masked: log 2
    torch.testing.assert_close(SF.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1),
                               torch.tensor(math.log(2.0)))
    b = torch.tensor([fmax, 0.0, 1.0])  # finfo.max is a number: torch's finite value
    got = SF.linear_cross_entropy(x, w, t, linear_bias=b)
    assert torch.isfinite(got) and got == F.cross_entropy(b[None], t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kw", LIMIT_KWARGS, ids=str)
@pytest.mark.parametrize("case", list(LIMIT_BIASES))
def test_plus_inf_and_finfo_max_logits_match_the_row_core(case, kw, dtype):
    x, w, b, t, cw = _limit_problem(LIMIT_BIASES[case], dtype, "weight" in kw, kw.get("ignore_index", -100))
    if case == "+inf beside finfo.max" and kw.get("label_smoothing"):
        # a finfo.max target on a +inf row: probability 0 here and in cross_entropy's
        # class-index path, the limit; its smoothing path's gradient ties finfo.max with the
        # +inf entries (rows.bounded: "all but finfo.max itself"), so that target is left out
        t = torch.where(t == 1, 2, t)
    a, r = _leaves(x, w, b), _leaves(x, w, b)
    la, lr = _limit_call(*a, t, cw, kw, True), _limit_call(*r, t, cw, kw, False)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(la, lr, rtol=rtol, atol=rtol)
    if case == "finfo.max only" and cw is None:  # an ordinary logit: torch's finite value
        assert torch.isfinite(la).all()
    go = torch.linspace(0.5, 1.5, 12, dtype=dtype)
    for p, q in zip(_grads(la, a, go), _grads(lr, r, go)):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, q, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(LIMIT_BIASES))
def test_plus_inf_logits_with_z_loss(case, dtype):
    # z-loss adds z·lse² per row: +inf on a +inf row (lse = +inf), else the finite row's value
    x, w, b, t, _ = _limit_problem(LIMIT_BIASES[case], dtype, False)
    z = 1e-3
    got = SF.linear_cross_entropy(x, w, t, linear_bias=b, reduction="none", label_smoothing=0.1, z_loss=z,
                                  chunk_size=5)
    u = F.linear(x, w, b)
    ref = SF.cross_entropy(u, t, reduction="none", label_smoothing=0.1) + z * torch.logsumexp(u, 1).square()
    ref = torch.where(t == -100, 0.0, ref)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_nan_in_nan_out():
    x, w, b, t = _data()
    x[5, 1] = float("nan")
    assert SF.linear_cross_entropy(x, w, t, linear_bias=b).isnan()
    out = SF.linear_cross_entropy(x, w, t, linear_bias=b, reduction="none")
    assert out[5].isnan() and not out[:5].isnan().any()


# --- focal -------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_focal_matches_reference(gamma, reduction, softcap):
    x, w, b, t = _data()
    t[[0, 7]] = -100
    b[3] = -INF
    t = torch.where(t == 3, 2, t)
    kw = dict(gamma=gamma, reduction=reduction, softcap=softcap, z_loss=1e-2)
    _assert_parity(
        lambda x, w, b: SF.linear_focal_loss(x, w, t, linear_bias=b, chunk_size=9, **kw),
        lambda x, w, b: ref_loss(x, w, t, b, **kw),
        (x, w, b), reduction,
    )


def test_focal_gamma0_equals_cross_entropy():
    x, w, b, t = _data()
    torch.testing.assert_close(
        SF.linear_focal_loss(x, w, t, linear_bias=b, gamma=0.0, reduction="none"),
        SF.linear_cross_entropy(x, w, t, linear_bias=b, reduction="none"), rtol=0, atol=0)


@pytest.mark.parametrize("margin", [15.0, 17.0, 25.0, 30.0])
def test_focal_exact_tail_float32(margin):
    x = torch.tensor([[margin, 0.0]])
    loss = SF.linear_focal_loss(x, torch.eye(2), torch.tensor([0]), gamma=2.0)
    mpmath.mp.dps = 50
    p = 1 / (1 + mpmath.e ** (-margin))
    exact = float((1 - p) ** 2 * (-mpmath.log(p)))
    assert abs(loss.item() - exact) <= 1e-5 * exact


@pytest.mark.parametrize("margin", [20.0, 40.0])
def test_cross_entropy_exact_tail_float32(margin):
    x = torch.tensor([[margin, 0.0, -1.0]])
    loss = SF.linear_cross_entropy(x, torch.eye(3), torch.tensor([0]))
    exact = float(mpmath.log1p(mpmath.e ** (-margin) + mpmath.e ** (-margin - 1)))
    assert abs(loss.item() - exact) <= 1e-6 * exact


# --- gradcheck, dtypes, transforms ----------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("focal", [False, True])
def test_gradcheck(reduction, focal):
    x, w, b, t = _data(n=7, h=3, v=5)
    t[2] = -100
    kw = dict(reduction=reduction, z_loss=0.05, softcap=2.5, chunk_size=3)
    if focal:
        fn = lambda x, w, b: SF.linear_focal_loss(x, w, t, linear_bias=b, gamma=1.5, **kw)  # noqa: E731
    else:
        fn = lambda x, w, b: SF.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.2, **kw)  # noqa: E731
    assert torch.autograd.gradcheck(fn, tuple(_leaves(x, w, b)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_computed_in_float32(dtype):
    x, w, b, t = _data(n=24, h=16, v=200, dtype=dtype, scale=0.5)
    a = _leaves(x, w, b)
    loss = SF.linear_cross_entropy(a[0], a[1], t, linear_bias=a[2], chunk_size=5, z_loss=1e-3)
    assert loss.dtype == dtype
    # float32 reference on the same (rounded) numbers.
    r = _leaves(x.float(), w.float(), b.float())
    ref = ref_loss(*r[:2], t, r[2], z_loss=1e-3)
    rtol = torch.finfo(dtype).eps  # one rounding of a float32 result to dtype: half an ulp
    torch.testing.assert_close(loss.float(), ref.float(), rtol=rtol, atol=0)
    for g, q in zip(_grads(loss, a), _grads(ref, r)):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), q.double(), rtol=rtol, atol=1e-7)


def test_autocast_returns_float32_and_param_dtype_grads():
    x, w, b, t = _data(n=16, h=8, v=40, dtype=torch.float32)
    a = _leaves(x, w.bfloat16(), b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = SF.linear_cross_entropy(a[0], a[1], t, linear_bias=a[2])
    assert loss.dtype == torch.float32
    ref = F.cross_entropy(F.linear(x.double(), w.bfloat16().double(), b.double()), t)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)  # logits not in bf16
    gx, gw, gb = _grads(loss, a)
    assert gx.dtype == torch.float32 and gw.dtype == torch.bfloat16 and gb.dtype == torch.float32


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_func_grad_matches_autograd(reduction):
    x, w, b, t = _data()
    kw = dict(z_loss=1e-2, reduction=reduction)
    got = torch.func.grad(lambda x, w: SF.linear_cross_entropy(x, w, t, linear_bias=b, chunk_size=5, **kw).sum(),
                          argnums=(0, 1))(x, w)
    expected = torch.func.grad(lambda x, w: ref_loss(x, w, t, b, **kw).sum(), argnums=(0, 1))(x, w)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_double_backward_equals_torchs(reduction):
    # create_graph=True: the gradient as a graph of the unfused formula on the whole logits
    # (torch's OpInfo marks linear_cross_entropy supports_gradgrad; it used to raise here)
    x, w, b, t = _data()
    a = _leaves(x, w, b)
    loss = SF.linear_cross_entropy(a[0], a[1], t, linear_bias=a[2], reduction=reduction, chunk_size=3).sum()
    gx, gw, _ = torch.autograd.grad(loss, a, create_graph=True)
    second = torch.autograd.grad(gw.square().sum() + gx.sum(), a)
    r = _leaves(x, w, b)
    rx, rw, _ = torch.autograd.grad(F.cross_entropy(F.linear(*r), t, reduction=reduction).sum(), r, create_graph=True)
    torch.testing.assert_close(gx.detach(), rx.detach())
    ref = torch.autograd.grad(rw.square().sum() + rx.sum(), r)
    for g, e in zip(second, ref):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.2, "weighted": True}, {"z_loss": 1e-2, "softcap": 5.0},
                                {"gamma": 2.0}], ids=["plain", "smoothing-weight", "zloss-softcap", "focal"])
def test_gradgradcheck(kw):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([1, 0, -100, 3, 2])
    kw = dict(kw)
    if kw.pop("weighted", False):
        kw["weight"] = torch.tensor([0.5, 2.0, 1.0, 1.5], dtype=torch.float64)
    if "gamma" in kw:
        def f(x, w, b):
            return SF.linear_focal_loss(x, w, t, linear_bias=b, chunk_size=2, **kw)
    else:
        def f(x, w, b):
            return SF.linear_cross_entropy(x, w, t, linear_bias=b, chunk_size=2, **kw)
    assert torch.autograd.gradgradcheck(f, (x, w, b))


@pytest.mark.parametrize("fn", ["linear_cross_entropy", "linear_focal_loss"])
def test_torch_func_never_reads_masked_hidden_states(fn):
    # under torch.func the logits are formed whole; a masked row's hidden state is selected to
    # 0 first, as the chunked path does (a NaN in padding gave a NaN weight gradient)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 4, generator=g)
    x[1] = math.nan
    m = torch.ones(6, dtype=torch.bool)
    m[1] = False
    t = torch.tensor([0, 1, 2, 3, 4, 0])
    w = torch.randn(5, 4, generator=g)

    def f(w):
        return getattr(SF, fn)(x, w, t, mask=m)

    got = torch.func.grad(f)(w)
    leaf = w.clone().requires_grad_()
    f(leaf).backward()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, leaf.grad)


def test_unfused_path_takes_an_empty_batch_with_a_mask():
    # the rows a mask keeps were found by reshape(0, -1), ambiguous for 0 rows
    w, wk = torch.randn(6, 4), torch.randn(6, 3, 4)
    x, m = torch.randn(0, 4), torch.zeros(0, dtype=torch.bool)
    g = torch.func.grad(lambda w: SF.linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.long), mask=m,
                                                          reduction="sum"))(w)
    assert torch.equal(g, torch.zeros_like(w))
    out = SF.linear_cross_entropy(x, wk, torch.zeros(0, 3, dtype=torch.long), mask=torch.zeros(0, 3, dtype=torch.bool),
                                  reduction="sum")
    assert out.item() == 0.0


def test_retain_graph_backward_twice():
    x, w, b, t = _data()
    a = _leaves(x, w, b)
    loss = SF.linear_cross_entropy(a[0], a[1], t, linear_bias=a[2])
    g1 = torch.autograd.grad(loss, a, retain_graph=True)
    g2 = torch.autograd.grad(loss * 2, a)
    for p, q in zip(g1, g2):
        torch.testing.assert_close(2 * p, q)


def test_only_weight_requires_grad():
    x, w, b, t = _data()
    (wa,) = _leaves(w)
    (gw,) = _grads(SF.linear_cross_entropy(x, wa, t, linear_bias=b, chunk_size=3), [wa])
    (wr,) = _leaves(w)
    (ref,) = _grads(F.cross_entropy(F.linear(x, wr, b), t), [wr])
    torch.testing.assert_close(gw, ref)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_fullgraph(reduction):
    x, w, b, t = _data(dtype=torch.float32)
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3, softcap=5.0, chunk_size=12)
    f = torch.compile(lambda x, w, b: SF.linear_cross_entropy(x, w, t, linear_bias=b, **kw), fullgraph=True)
    a, e = _leaves(x, w, b), _leaves(x, w, b)
    la, le = f(*a), SF.linear_cross_entropy(*e[:2], t, linear_bias=e[2], **kw)
    torch.testing.assert_close(la, le)
    for p, q in zip(_grads(la, a), _grads(le, e)):
        torch.testing.assert_close(p, q)


# --- memory: no (N, V) tensor ---------------------------------------------------------------------


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel())
        return out


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("focal", [False, True])
def test_no_n_by_v_tensor_is_created(reduction, focal):
    n, h, v, chunk = 64, 3, 50, 16
    x, w, b, t = _data(n=n, h=h, v=v, dtype=torch.float32)
    a = _leaves(x, w, b)
    fn = SF.linear_focal_loss if focal else SF.linear_cross_entropy
    kw = {} if focal else {"label_smoothing": 0.1}
    with _LargestTensor() as mode:
        loss = fn(a[0], a[1], t, linear_bias=a[2], reduction=reduction, chunk_size=chunk, z_loss=1e-3, softcap=3.0, **kw)
        _grads(loss, a)
    assert mode.largest == chunk * v  # one chunk's logits, never n * v
    with _LargestTensor() as mode:  # the unfused path does allocate it (the check can fail)
        _grads(F.cross_entropy(F.linear(*a), t), a)
    assert mode.largest >= n * v


def test_default_chunk_size_splits_large_problems():
    for v in (32000, 128256, 262144):
        for dt in (torch.float32, torch.float64):
            rows = default_chunk_size(v, dt)
            assert rows >= 1 and rows * v * torch.finfo(dt).bits // 8 <= CHUNK_BYTES < 100 * 2**20
    assert default_chunk_size(32000, torch.float32) == 512
    assert default_chunk_size(128256, torch.float32) == 128
    assert default_chunk_size(2**40, torch.float32) == 1


# --- modules and argument errors ----------------------------------------------------------------


def test_modules_equal_functions():
    x, w, b, t = _data()
    m = sl.LinearCrossEntropyLoss(H, V, bias=True, dtype=torch.float64, label_smoothing=0.1, z_loss=1e-3,
                                  softcap=4.0, chunk_size=5)
    assert isinstance(m.linear, torch.nn.Linear) and m.linear.weight.shape == (V, H)
    with torch.no_grad():
        m.linear.weight.copy_(w)
        m.linear.bias.copy_(b)
    assert torch.equal(m(x, t), SF.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1, z_loss=1e-3,
                                                         softcap=4.0, chunk_size=5))
    f = sl.LinearFocalLoss(H, V, gamma=0.5, reduction="sum", dtype=torch.float64)
    assert f.linear.bias is None
    assert torch.equal(f(x, t), SF.linear_focal_loss(x, f.linear.weight, t, gamma=0.5, reduction="sum"))
    assert "z_loss=0.001" in repr(m) and "gamma=0.5" in repr(f) and "num_classes=11" in repr(m)
    with pytest.raises(ValueError, match="LinearCrossEntropyLoss: reduction"):
        sl.LinearCrossEntropyLoss(H, V, reduction="avg")
    with pytest.raises(ValueError, match="LinearFocalLoss: gamma"):
        sl.LinearFocalLoss(H, V, gamma=-1.0)
    with pytest.raises(RuntimeError, match=r"LinearCrossEntropyLoss: weight must have shape \(11,\)"):
        sl.LinearCrossEntropyLoss(H, V, weight=torch.ones(3))


_X, _W, _B, _T = _data(n=4, h=3, v=5, dtype=torch.float32)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(reduction="avg"), ValueError, "reduction must be 'none', 'mean' or 'sum', got 'avg'"),
        (dict(input=_X.long()), TypeError, "input must be a floating-point tensor"),
        (dict(linear_weight=_W.long()), TypeError, "linear_weight must be a floating-point tensor"),
        (dict(linear_bias=_B.long()), TypeError, "linear_bias must be a floating-point tensor"),
        (dict(weight=torch.ones(5, dtype=torch.long)), TypeError, "weight must be a floating-point tensor"),
        (dict(weight=torch.ones(4)), RuntimeError, r"weight must have shape \(5,\) \(one weight per class\)"),
        (dict(weight=_W), RuntimeError, r"weight must have shape \(5,\) .*the output layer's matrix is linear_weight"),
        (dict(target=[0, 1]), TypeError, "target must be a torch.Tensor"),
        (dict(input=torch.tensor(1.0)), ValueError, "input must have shape"),
        (dict(linear_weight=_W[:, :2]), RuntimeError, r"linear_weight must have shape \(V, H\)"),
        (dict(linear_weight=_W[0]), RuntimeError, r"linear_weight must have shape \(V, H\)"),
        (dict(linear_bias=_B[:3]), RuntimeError, r"linear_bias must have shape \(5,\)"),
        (dict(target=_T.float()), RuntimeError, "target must hold class indices"),
        (dict(target=_T[:3]), ValueError, r"target must have shape \[4\]"),
        (dict(ignore_index=-100.0), TypeError, "ignore_index must be an int"),
        (dict(z_loss=-1.0), ValueError, "z_loss must be >= 0"),
        (dict(z_loss=INF), ValueError, "z_loss must be finite"),
        (dict(z_loss="a"), TypeError, "z_loss must be a float"),
        (dict(softcap=0.0), ValueError, "softcap must be None or a finite number > 0"),
        (dict(softcap=INF), ValueError, "softcap must be None or a finite number > 0"),
        (dict(softcap=1e300), ValueError, "softcap must be None or a finite number > 0 and at most float32's max"),
        (dict(softcap="1"), TypeError, "softcap must be a float"),
        (dict(chunk_size=0), ValueError, "chunk_size must be >= 1"),
        (dict(chunk_size=2.0), TypeError, "chunk_size must be an int or None"),
        (dict(label_smoothing=1.5), RuntimeError, "label_smoothing must be between 0.0 and 1.0"),
        (dict(label_smoothing="x"), TypeError, "label_smoothing must be a float"),
        (dict(target=torch.tensor([0, 1, 7, 2])), IndexError, "Target 7 is out of bounds"),
    ],
)
def test_argument_errors(kwargs, exc, match):
    args = dict(input=_X, linear_weight=_W, target=_T, linear_bias=_B)
    args.update(kwargs)
    with pytest.raises(exc, match="linear_cross_entropy: " + match if "bounds" not in match else match):
        SF.linear_cross_entropy(**args)


@pytest.mark.parametrize("eps", [True, 1, 0])
def test_label_smoothing_takes_what_cross_entropy_takes(eps):
    # F.cross_entropy takes a bool or an int label_smoothing as a float; so does the fused loss
    loss = SF.linear_cross_entropy(_X, _W, _T, linear_bias=_B, label_smoothing=eps)
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(_X, _W, _B), _T, label_smoothing=eps))


@pytest.mark.parametrize("gamma, exc", [(-1.0, ValueError), (INF, ValueError), (float("nan"), ValueError),
                                        ("2", TypeError)])
def test_focal_gamma_errors(gamma, exc):
    with pytest.raises(exc, match="linear_focal_loss: gamma"):
        SF.linear_focal_loss(_X, _W, _T, gamma=gamma)


def test_single_row_and_empty_batch():
    x, w, b, t = _data(n=1)
    out = SF.linear_cross_entropy(x[0], w, t[0], linear_bias=b, reduction="none")
    assert out.shape == ()
    torch.testing.assert_close(out, F.cross_entropy(F.linear(x[0], w, b), t[0], reduction="none"))
    xe = torch.zeros(0, H, dtype=torch.float64, requires_grad=True)
    empty_t = torch.zeros(0, dtype=torch.long)
    loss = SF.linear_cross_entropy(xe, w, empty_t, linear_bias=b)
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(xe, w, b), empty_t), equal_nan=True)  # NaN
    assert SF.linear_cross_entropy(xe, w, empty_t, linear_bias=b, reduction="sum").item() == 0.0
    assert SF.linear_cross_entropy(xe, w, empty_t, linear_bias=b, reduction="none").shape == (0,)


def test_smoothing_no_intermediate_overflow_float32():
    # Logits near ±1e37 (design: No avoidable overflow): the exact smoothed loss is representable in float32.
    x, w, _, _ = _data(n=4, dtype=torch.float32, scale=0.1)
    b = torch.zeros(V)
    b[0], b[1] = 1e37, -1e37
    t = torch.tensor([0, 2, 3, 0])
    loss = SF.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1, reduction="none")
    ref = ref_loss(x, w, t, b, label_smoothing=0.1, reduction="none")
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=0)


def test_forward_mode_and_vmap_match_torch():
    # Forward mode and vmap (torch's reference path has both; the chunk loop has neither a
    # tangent nor a batching rule) take the unfused exact path: torch's tangent and values.
    x, w, b, t = _data(n=4)
    tx, tw = torch.randn_like(x), torch.randn_like(w)
    _, got = torch.func.jvp(lambda x, w: SF.linear_cross_entropy(x, w, t, linear_bias=b), (x, w), (tx, tw))
    _, expected = torch.func.jvp(lambda x, w: F.cross_entropy(F.linear(x, w, b), t), (x, w), (tx, tw))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    got = torch.func.vmap(lambda x: SF.linear_cross_entropy(x, w, t[:1], linear_bias=b))(x[:, None])
    expected = torch.func.vmap(lambda x: F.cross_entropy(F.linear(x, w, b), t[:1]))(x[:, None])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    g = torch.func.vmap(torch.func.grad(lambda x: SF.linear_focal_loss(x, w, t[:1], gamma=2.0)))(x[:, None])
    ref = torch.func.vmap(torch.func.grad(lambda x: SF.focal_loss(F.linear(x, w), t[:1], gamma=2.0)))(x[:, None])
    torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-12)
    # reverse over reverse: a nested transform cannot differentiate the chunked gradient (it
    # raised); under torch.func the logits are whole
    h = torch.func.jacrev(torch.func.jacrev(lambda x: SF.linear_cross_entropy(x, w, t, linear_bias=b)))(x)
    h_ref = torch.func.hessian(lambda x: F.cross_entropy(F.linear(x, w, b), t))(x)
    torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("fn", ["linear_cross_entropy", "linear_focal_loss"])
def test_linear_losses_row_mask(reduction, fn):
    g = _gen(10)
    x = torch.randn(2, 5, 4, generator=g, dtype=D, requires_grad=True)
    W = torch.randn(7, 4, generator=g, dtype=D, requires_grad=True)
    t = torch.randint(0, 7, (2, 5), generator=g)
    t[0, 1] = -100
    m = torch.rand(2, 5, generator=g) < 0.6
    m[0, 0] = True
    xn = x.detach().clone()
    xn[~m] = NAN
    xn.requires_grad_()
    got = getattr(SF, fn)(xn, W, t, reduction=reduction, chunk_size=3, mask=m)
    logits = x @ W.T
    if fn == "linear_cross_entropy":
        full = F.cross_entropy(logits.reshape(-1, 7), t.reshape(-1), reduction="none").reshape(2, 5)
        w_rows = (t != -100).to(D)
    else:
        full, w_rows = _torch_focal_none(logits.reshape(-1, 7), t.reshape(-1), 2.0, None)
        full, w_rows = full.reshape(2, 5), w_rows.reshape(2, 5)
    want = _masked_ref(full, m, reduction, w_rows)
    torch.testing.assert_close(got, want)
    gx, gw = _grad(got, xn, W)
    wx, ww = _grad(want, x, W)
    assert torch.isfinite(gx).all() and torch.isfinite(gw).all()
    torch.testing.assert_close(gx, wx)
    torch.testing.assert_close(gw, ww)


def test_linear_all_false_mask_gives_zero():
    x = torch.randn(4, 3, dtype=D, requires_grad=True)
    W = torch.randn(5, 3, dtype=D, requires_grad=True)
    t = torch.tensor([0, 1, 2, 3])
    for red in ("mean", "sum"):
        got = SF.linear_cross_entropy(x, W, t, reduction=red, mask=torch.zeros(4, dtype=torch.bool))
        assert got.item() == 0.0
        gx, gw = _grad(got, x, W)
        assert torch.equal(gx, torch.zeros_like(x)) and torch.equal(gw, torch.zeros_like(W))


# --- normalizer: replaces 'mean''s denominator -----------------------------------------------------


@pytest.mark.parametrize("fn", [SF.linear_cross_entropy, SF.linear_focal_loss])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_normalizer_replaces_the_mean_denominator(fn, as_tensor):
    x, w, b, t = _data()
    t[::4] = -100
    a, e = _leaves(x, w, b), _leaves(x, w, b)
    norm = torch.tensor(37.0, dtype=torch.float64) if as_tensor else 37
    got = fn(a[0], a[1], t, linear_bias=a[2], normalizer=norm, chunk_size=7)
    want = fn(e[0], e[1], t, linear_bias=e[2], reduction="sum", chunk_size=7) / 37.0
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    for p, q in zip(_grads(got, a), _grads(want, e)):
        torch.testing.assert_close(p, q, rtol=1e-14, atol=1e-16)


def test_normalizer_zero_with_a_fully_masked_batch_gives_zero_and_zero_gradients():
    x, w, b, t = _data()
    a = _leaves(x, w, b)
    mask = torch.zeros(N, dtype=torch.bool)
    loss = SF.linear_cross_entropy(a[0], a[1], t, linear_bias=a[2], mask=mask, normalizer=torch.tensor(0.0))
    assert loss.item() == 0.0
    assert all(bool((g == 0).all()) for g in _grads(loss, a))


def test_normalizer_on_the_unfused_path():
    x, w, b, t = _data()
    probs = torch.softmax(torch.randn(N, V, dtype=torch.float64), 1)
    got = SF.linear_cross_entropy(x, w, probs, linear_bias=b, normalizer=5.0)
    want = SF.linear_cross_entropy(x, w, probs, linear_bias=b, reduction="sum") / 5.0
    torch.testing.assert_close(got, want)


class _NoHostRead(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a value was read on the host (.item())")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kw", [dict(normalizer=torch.tensor(12.0)), dict(), dict(reduction="sum"),
                                dict(reduction="none"), dict(weight="cw", label_smoothing=0.1)])
@pytest.mark.parametrize("fn", [SF.linear_cross_entropy, SF.linear_focal_loss])
def test_no_host_read(kw, fn):
    x, w, b, t = _data()
    kw = dict(kw)
    if kw.get("weight") == "cw":
        if fn is SF.linear_focal_loss:
            kw.pop("label_smoothing")
        kw["weight"] = torch.rand(V, dtype=torch.float64) + 0.5
    mask = torch.arange(N) % 3 != 0
    a = _leaves(x, w, b)
    with _NoHostRead():
        loss = fn(a[0], a[1], t, linear_bias=a[2], mask=mask, chunk_size=5, **kw)
        _grads(loss, a)
    # the mode does raise on a host read (the check can fail)
    with pytest.raises(AssertionError, match="read on the host"), _NoHostRead():
        loss.sum().item()


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(normalizer=2.0, reduction="sum"), ValueError, "normalizer replaces the denominator of reduction='mean'"),
        (dict(normalizer=-1.0), ValueError, "normalizer must be finite and >= 0, got -1.0"),
        (dict(normalizer=math.inf), ValueError, "normalizer must be finite and >= 0"),
        (dict(normalizer="3"), TypeError, "normalizer must be a number >= 0, a 0-dim tensor or None, got str"),
        (dict(normalizer=True), TypeError, "normalizer must be a number"),
        (dict(normalizer=torch.ones(2)), ValueError, "normalizer must be a number or a 0-dim real tensor"),
    ],
)
def test_normalizer_errors(kwargs, exc, match):
    x, w, b, t = _data()
    for fn in (SF.linear_cross_entropy, SF.linear_focal_loss):
        with pytest.raises(exc, match=f"{fn.__name__}: {match}"):
            fn(x, w, t, **kwargs)


@pytest.mark.parametrize("weight_grad", [False, True])
@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_weighted_smoothing_target_term_near_float_max_does_not_overflow(reduction, weight_grad):
    # the target's term was w_t·(−log p_t) before the (1 − ε) scale: inf where cross_entropy
    # (and float64) give 2.72e38 (a class weight above 1 at a logit of finfo.min)
    x = torch.tensor([[0.0, torch.finfo(torch.float32).min, 1.0]])
    w = torch.tensor([1.0, 1.2, 0.5], requires_grad=weight_grad)  # requires grad: the unfused route
    t = torch.tensor([1])
    got = SF.linear_cross_entropy(x, torch.eye(3), t, weight=w, label_smoothing=0.5, reduction=reduction)
    want = SF.cross_entropy(x, t, weight=w.detach(), label_smoothing=0.5, reduction=reduction)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_label_smoothing_sum_does_not_overflow_where_cross_entropy_does_not(weighted, reduction):
    # 1000 classes at ±1e36 (a 50k vocabulary at ±1e34 alike): the smoothing terms sum past
    # float32's max unscaled (it gave inf); scaled exactly by 2^-64 as the row core's sum, the
    # fused value is cross_entropy's
    g = torch.Generator().manual_seed(0)
    v = 1000
    x, t = torch.randn(2, v, generator=g) * 1e36, torch.tensor([0, 1])
    w = torch.rand(v, generator=g) if weighted else None
    got = SF.linear_cross_entropy(x, torch.eye(v), t, weight=w, label_smoothing=0.1, reduction=reduction)
    want = SF.cross_entropy(x, t, weight=w, label_smoothing=0.1, reduction=reduction)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    x = torch.tensor([[1.5e38, -1.5e38, 0.0]])  # each difference from the max fits, their sum not
    got = SF.linear_cross_entropy(x, torch.eye(3), torch.tensor([0]), label_smoothing=0.1, reduction=reduction)
    torch.testing.assert_close(got.reshape(()), torch.tensor(1.5e37))
