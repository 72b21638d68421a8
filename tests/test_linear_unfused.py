"""linear_cross_entropy's cases beyond the chunk loop, as torch's reference path takes them:
a K-dimensional ``linear_weight`` (V, d_1, ..., d_K, H), probability targets, a class ``weight``
that requires grad and forward-mode AD. They run the unfused exact formula (the logits whole);
the fused loss's semantics (z-loss, softcap, hazard rows, mask) are kept there."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import stablelosses.functional as SF

INF = math.inf


def _torch_reference(x, w, t, b=None, **kw):
    """torch's documented reference for a K-dimensional weight, written out (any torch)."""
    classes, out = w.shape[0], w.shape[1:-1]
    u = F.linear(x, w.reshape(-1, w.shape[-1]), None if b is None else b.reshape(-1))
    return F.cross_entropy(u.reshape(*x.shape[:-1], classes, *out), t, **kw)


def _leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in ts]


def _grads(loss, ts):
    ts = [t for t in ts if t is not None]
    return torch.autograd.grad(loss, ts, torch.randn_like(loss).abs() if loss.dim() else None)


def _parity(ours, ref, tensors, rtol=1e-10, atol=1e-12):
    a, r = _leaves(*tensors), _leaves(*tensors)
    la, lr = ours(*a), ref(*r)
    assert la.shape == lr.shape and la.dtype == lr.dtype
    torch.testing.assert_close(la, lr, rtol=rtol, atol=atol)
    torch.manual_seed(1)
    ga = _grads(la, a)
    torch.manual_seed(1)
    gr = _grads(lr, r)
    for p, q in zip(ga, gr):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kw", [{}, {"ignore_index": 1}, {"label_smoothing": 0.2}, {"weight": True}])
@pytest.mark.parametrize("out", [(3,), (2, 1, 2)])
def test_k_dimensional_weight_matches_torchs_reference(out, kw, reduction):
    x = torch.randn(5, 4, dtype=torch.float64)
    w = torch.randn(3, *out, 4, dtype=torch.float64)
    b = torch.randn(3, *out, dtype=torch.float64)
    t = torch.randint(0, 3, (5, *out))
    kw = dict(kw, reduction=reduction)
    if kw.pop("weight", False):
        kw["weight"] = torch.rand(3, dtype=torch.float64) + 0.5
    _parity(lambda x, w, b: SF.linear_cross_entropy(x, w, t, linear_bias=b, **kw),
            lambda x, w, b: _torch_reference(x, w, t, b, **kw), (x, w, b))
    if hasattr(F, "linear_cross_entropy"):  # torch >= 2.13: the same as torch's own function
        got = SF.linear_cross_entropy(x, w, t, linear_bias=b, **kw)
        torch.testing.assert_close(got, F.linear_cross_entropy(x, w, t, linear_bias=b, **kw))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize("shape", [(), (6,)])
def test_probability_targets_match_torch(shape, smoothing, reduction):
    x = torch.randn(*shape, 4, dtype=torch.float64)
    w = torch.randn(7, 4, dtype=torch.float64)
    b = torch.randn(7, dtype=torch.float64)
    y = torch.softmax(torch.randn(*shape, 7, dtype=torch.float64), -1)
    cw = torch.rand(7, dtype=torch.float64) + 0.5
    kw = dict(reduction=reduction, label_smoothing=smoothing, weight=cw)
    _parity(lambda x, w, b, y: SF.linear_cross_entropy(x, w, y, linear_bias=b, **kw),
            lambda x, w, b, y: F.cross_entropy(F.linear(x, w, b), y, **kw), (x, w, b, y))


def test_probability_targets_refuse_ignore_index_as_torch():
    x, w, y = torch.randn(3, 4), torch.randn(5, 4), torch.softmax(torch.randn(3, 5), -1)
    with pytest.raises(RuntimeError, match="ignore_index cannot be specified when target contains probabilities"):
        SF.linear_cross_entropy(x, w, y, ignore_index=-100)
    with pytest.raises(RuntimeError, match="linear_focal_loss: target must hold class indices"):
        SF.linear_focal_loss(x, w, y)


@pytest.mark.parametrize("x_shape", [(4,), (2, 3, 4)])
def test_k_dimensional_weight_needs_a_batch_as_torch(x_shape):
    w, t = torch.randn(3, 2, 4), torch.zeros(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"a K-dimensional linear_weight of shape \(3, 2, 4\) needs input"):
        SF.linear_cross_entropy(torch.randn(x_shape), w, t)
    with pytest.raises(RuntimeError, match=r"linear_bias must have shape \(3, 2\)"):
        SF.linear_cross_entropy(torch.randn(5, 4), w, torch.zeros(5, 2, dtype=torch.long), linear_bias=torch.zeros(3))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kw", [dict(z_loss=0.1), dict(softcap=2.0, label_smoothing=0.1), dict(z_loss=0.05, softcap=3.0)])
def test_unfused_path_equals_the_fused_one(kw, reduction):
    # A class weight that requires grad routes a 2-D call to the unfused path: it must give the
    # fused loss's value and gradients (z-loss, softcap, smoothing, an ignored and a -inf row).
    x = torch.randn(8, 5, dtype=torch.float64) * 2
    w = torch.randn(9, 5, dtype=torch.float64)
    b = torch.randn(9, dtype=torch.float64)
    b[2] = -INF
    t = torch.randint(0, 9, (8,))
    t[t == 2] = 3
    t[1] = -100
    cw = torch.rand(9, dtype=torch.float64) + 0.5
    args = dict(kw, reduction=reduction, chunk_size=3)
    fused = lambda x, w, b: SF.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, **args)  # noqa: E731
    unfused = lambda x, w, b: SF.linear_cross_entropy(  # noqa: E731
        x, w, t, linear_bias=b, weight=cw.clone().requires_grad_(), **args)
    _parity(unfused, fused, (x, w, b))


def _routes(fn, x, w, b, t, kw):
    """Gradients (x, w, b) of ``fn(...).sum()`` on the fused path and on three unfused routes: a
    class weight that requires grad, ``torch.func.grad`` and a ``create_graph=True`` backward."""
    out = {}
    a = _leaves(x, w, b)
    out["fused"] = torch.autograd.grad(fn(a[0], a[1], t, linear_bias=a[2], **kw).sum(), a)
    a = _leaves(x, w, b)
    cw = torch.ones(w.shape[0], dtype=w.dtype, requires_grad=True)
    out["class weight"] = torch.autograd.grad(fn(*a[:2], t, linear_bias=a[2], weight=cw, **kw).sum(), a)
    out["torch.func"] = torch.func.grad(
        lambda x, w, b: fn(x, w, t, linear_bias=b, **kw).sum(), argnums=(0, 1, 2))(x, w, b)
    a = _leaves(x, w, b)
    out["create_graph"] = torch.autograd.grad(fn(a[0], a[1], t, linear_bias=a[2], **kw).sum(), a,
                                           create_graph=True)
    return out


@pytest.mark.parametrize("fn", [SF.linear_cross_entropy, SF.linear_focal_loss], ids=["ce", "focal"])
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_softcap_target_at_minus_inf_has_one_gradient_on_every_path(fn, reduction):
    # softcap keeps a -inf logit at -inf and its derivative is 1 - tanh²(u / c) = 0 there (the
    # fused loss's formula): a target at a -inf logit gives +inf with the same finite gradient
    # on the unfused routes (they gave the masked class -1: the where's identity branch)
    x = torch.randn(4, 3, dtype=torch.float64)
    w = torch.randn(5, 3, dtype=torch.float64)
    b = torch.zeros(5, dtype=torch.float64)
    b[2] = -INF
    t = torch.tensor([2, 0, 1, 4])
    kw = dict(softcap=3.0, reduction=reduction, chunk_size=2)
    routes = _routes(fn, x, w, b, t, kw)
    assert routes["fused"][2][2] == 0.0 and routes["fused"][1][2].eq(0).all()
    for name, grads in routes.items():
        for g, want in zip(grads, routes["fused"]):
            assert torch.isfinite(g).all(), name
            torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("fn, kw", [
    (SF.linear_cross_entropy, {}),
    (SF.linear_cross_entropy, {"label_smoothing": 0.1}),
    (SF.linear_focal_loss, {"gamma": 0.5}),
], ids=["ce", "ce-smoothing", "focal"])
def test_z_loss_at_plus_inf_logits_has_one_finite_gradient_on_every_path(fn, kw):
    # a +inf logit: the row's lse is +inf and its z-loss +inf; the chunked head bounds the
    # logits (+inf -> finfo.max), so the z-loss gradient is 2 z finfo.max p (p uniform over
    # the +inf entries): finite. The unfused routes squared the +inf lse: inf * 0 = NaN
    x = torch.randn(4, 3, dtype=torch.float64)
    w = torch.randn(5, 3, dtype=torch.float64)
    b = torch.zeros(5, dtype=torch.float64)
    b[2] = INF
    t = torch.tensor([2, 0, 1, 4])
    kw = dict(kw, z_loss=1e-3, reduction="none", chunk_size=2)
    routes = _routes(fn, x, w, b, t, kw)
    for name, grads in routes.items():
        for g, want in zip(grads, routes["fused"]):
            assert torch.isfinite(g).all(), name
            torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_z_loss_of_a_zero_weight_row_at_plus_inf_is_zero_on_the_unfused_path(reduction):
    # w_t = 0 removes the row's terms, its +inf z-loss included (0 · inf = 0, as the fused
    # loss's _weighted): the unfused path (a class weight that requires grad) gave NaN
    x = torch.randn(4, 3, dtype=torch.float64)
    w = torch.randn(5, 3, dtype=torch.float64)
    b = torch.zeros(5, dtype=torch.float64)
    b[2] = INF
    t = torch.tensor([2, 0, 1, 4])
    cw = torch.ones(5, dtype=torch.float64)
    cw[[0, 2]] = 0.0
    kw = dict(linear_bias=b, z_loss=1e-3, reduction=reduction)
    fused = SF.linear_cross_entropy(x, w, t, weight=cw, **kw)
    cwg = cw.clone().requires_grad_()
    unfused = SF.linear_cross_entropy(x, w, t, weight=cwg, **kw)
    torch.testing.assert_close(unfused.detach(), fused, equal_nan=False)
    if reduction == "none":
        assert unfused[:2].eq(0).all() and unfused[2:].eq(INF).all()


def test_all_minus_inf_row_on_the_unfused_path():
    # position d = 1 of a K-dim weight has every class masked by a -inf bias: loss 0 there, not
    # counted in the mean, gradients finite (no NaN), with z-loss and smoothing
    x = torch.randn(3, 2, dtype=torch.float64)
    w = torch.randn(4, 2, 2, dtype=torch.float64)
    b = torch.zeros(4, 2, dtype=torch.float64)
    b[:, 1] = -INF
    t = torch.randint(0, 4, (3, 2))
    xs, ws = _leaves(x, w)
    kw = dict(z_loss=0.1, label_smoothing=0.1)
    rows = SF.linear_cross_entropy(xs, ws, t, linear_bias=b, reduction="none", **kw)
    assert rows[:, 1].eq(0).all() and torch.isfinite(rows).all()
    loss = SF.linear_cross_entropy(xs, ws, t, linear_bias=b, **kw)
    torch.testing.assert_close(loss, rows[:, 0].sum() / 3)
    loss.backward()
    assert torch.isfinite(xs.grad).all() and torch.isfinite(ws.grad).all()
    assert ws.grad[:, 1].eq(0).all()  # the masked position's weights get exactly 0


def test_class_weight_gradient_is_the_true_one():
    # torch refuses it (class indices) or its chunked path silently gives none: ours is numeric-exact
    x, w = torch.randn(6, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    t = torch.tensor([0, 1, 4, -100, 2, 2])
    cw = (torch.rand(5, dtype=torch.float64) + 0.5).requires_grad_()
    for reduction in ("mean", "sum", "none"):
        for kw in ({}, {"label_smoothing": 0.2, "z_loss": 0.1}):
            assert torch.autograd.gradcheck(
                lambda c: SF.linear_cross_entropy(x, w, t, weight=c, reduction=reduction, **kw), (cw,),
                check_forward_ad=True,
            )


def test_forward_ad_api_and_focal():
    import torch.autograd.forward_ad as fwad

    x, w = torch.randn(6, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    t, tx = torch.randint(0, 5, (6,)), torch.randn(6, 3, dtype=torch.float64)
    with fwad.dual_level():
        got = fwad.unpack_dual(SF.linear_focal_loss(fwad.make_dual(x, tx), w, t, gamma=1.5)).tangent
        expected = fwad.unpack_dual(SF.focal_loss(F.linear(fwad.make_dual(x, tx), w), t, gamma=1.5)).tangent
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_mask_on_the_unfused_path():
    x = torch.randn(5, 4, dtype=torch.float64)
    w = torch.randn(3, 2, 4, dtype=torch.float64)
    t = torch.randint(0, 3, (5, 2))
    m = torch.tensor([True, False, True, True, False])[:, None]
    got = SF.linear_cross_entropy(x, w, t, mask=m, z_loss=0.1)
    full = SF.linear_cross_entropy(x[m[:, 0]], w, t[m[:, 0]], z_loss=0.1)
    torch.testing.assert_close(got, full, rtol=1e-12, atol=1e-12)
    none = torch.zeros(5, 1, dtype=torch.bool)
    assert SF.linear_cross_entropy(x, w, t, mask=none).item() == 0.0  # masked mean of nothing: 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unfused_dtypes_follow_torch(dtype):
    x, w = torch.randn(4, 3, dtype=dtype), torch.randn(2, 2, 3, dtype=dtype)
    t = torch.randint(0, 2, (4, 2))
    got = SF.linear_cross_entropy(x, w, t)
    expected = _torch_reference(x.double(), w.double(), t)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, rtol=torch.finfo(dtype).eps, atol=0)  # computed in float32


@pytest.mark.parametrize("name", ["linear_cross_entropy", "linear_focal_loss", "linear_token_logps"])
def test_double_vjp_jvp_at_zero_grad_outputs_is_the_unfused_one(name):
    """torch.autograd.functional.jvp differentiates a vjp taken at grad_outputs of zeros; the dense
    backward masked a zero incoming gradient, so that derivative was 0 on every row ('none')."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    w = torch.randn(5, 3, generator=g, dtype=torch.float64)
    v = torch.randn(4, 3, generator=g, dtype=torch.float64)
    t = torch.tensor([0, 1, 2, 3])
    fused = {
        "linear_cross_entropy": lambda a: SF.linear_cross_entropy(a, w, t, reduction="none"),
        "linear_focal_loss": lambda a: SF.linear_focal_loss(a, w, t, reduction="none"),
        "linear_token_logps": lambda a: SF.linear_token_logps(a, w, t),
    }[name]
    plain = {
        "linear_cross_entropy": lambda a: F.cross_entropy(F.linear(a, w), t, reduction="none"),
        "linear_focal_loss": lambda a: SF.focal_loss(F.linear(a, w), t, reduction="none"),
        "linear_token_logps": lambda a: SF.token_logps(F.linear(a, w), t),
    }[name]
    got = torch.autograd.functional.jvp(fused, x, v)[1]
    want = torch.autograd.functional.jvp(plain, x, v)[1]
    assert want.abs().min() > 0
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
