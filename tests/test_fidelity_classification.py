"""Drop-in fidelity of the softmax family and the classification losses (design: Drop-in).

Every assertion is against torch or against a float64 / mpmath reference written with plain
torch ops (never against stablelosses' own formula): finite fill values are ordinary numbers,
weights get gradients, forward-mode AD works, tails are exact, bad arguments are refused as
torch refuses them, and dtypes promote as torch's.
"""

from __future__ import annotations

import warnings

import mpmath
import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck

import stablelosses.functional as SF

INF = float("inf")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float16: dict(rtol=2e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}


def _value_and_grad(fn, x, *, seed_shape_like=None):
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    w = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    (g,) = torch.autograd.grad((out * w).sum(), x)
    return out.detach(), g


def _fill_rows(dtype):
    """Rows built with finfo.min, the usual mask fill: all of it, all but one 0, and a mix
    of finfo.min and -inf (the -inf classes are masked, the finfo.min ones are not)."""
    fm = torch.finfo(dtype).min
    return torch.tensor([[fm, fm, fm, fm], [fm, fm, 0.0, fm], [fm, -INF, fm, -INF]], dtype=torch.float64).to(
        dtype
    )


# --- a finfo.min row is an ordinary row --------------------------------------------

CASES = {
    "cross_entropy": (
        lambda x: SF.cross_entropy(x, torch.tensor([0, 1, 2]), reduction="none"),
        lambda x: F.cross_entropy(x, torch.tensor([0, 1, 2]), reduction="none"),
    ),
    "cross_entropy_mean": (
        lambda x: SF.cross_entropy(x, torch.tensor([0, 2, 2])),
        lambda x: F.cross_entropy(x, torch.tensor([0, 2, 2])),
    ),
    "cross_entropy_probs": (
        lambda x: SF.cross_entropy(x, torch.tensor([[0.25] * 4, [0.0, 0.0, 1.0, 0.0]]).to(x.dtype)),
        lambda x: F.cross_entropy(x, torch.tensor([[0.25] * 4, [0.0, 0.0, 1.0, 0.0]]).to(x.dtype)),
    ),
    "focal_gamma0": (
        lambda x: SF.focal_loss(x, torch.tensor([0, 2, 2]), gamma=0.0, reduction="none"),
        lambda x: F.cross_entropy(x, torch.tensor([0, 2, 2]), reduction="none"),
    ),
    "softmax": (lambda x: SF.softmax(x, 1), lambda x: torch.softmax(x, 1)),
    "log_softmax": (lambda x: SF.log_softmax(x, 1), lambda x: torch.log_softmax(x, 1)),
    "logsumexp": (lambda x: SF.logsumexp(x, 1), lambda x: torch.logsumexp(x, 1)),
    "kl_div": (
        lambda x: SF.kl_div(x, torch.full(x.shape, 0.25, dtype=x.dtype), reduction="sum"),
        lambda x: F.kl_div(x, torch.full(x.shape, 0.25, dtype=x.dtype), reduction="sum"),
    ),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name", list(CASES))
def test_finfo_min_rows_are_ordinary_rows(name, dtype):
    ours, theirs = CASES[name]
    x = _fill_rows(dtype)
    if name in ("kl_div", "log_softmax", "cross_entropy_probs"):
        # the finfo.min rows only: on the row with -inf, torch's 0·(-inf) is NaN (probs), and
        # log_softmax defines the gradient through a -inf output as 0 (test_ops checks both)
        x = x[:2]
    v, g = _value_and_grad(ours, x)
    # torch in float64 on the same values is the reference (float16/bfloat16 compute in float32)
    ref_dtype = torch.float64
    v_ref, g_ref = _value_and_grad(theirs, x.to(ref_dtype))
    if name == "logsumexp":
        # torch's own gradient is exp(x - lse) = 1 per entry on a finfo.min row (lse rounds
        # back to finfo.min); the exact gradient is the softmax
        g_ref = (
            torch.softmax(x.to(ref_dtype), 1) * torch.linspace(-1.0, 1.0, len(x), dtype=ref_dtype)[:, None]
        )
    assert v.dtype == dtype
    torch.testing.assert_close(v.double(), v_ref.to(v.dtype).double(), **TOL[dtype])
    torch.testing.assert_close(g.double(), g_ref.to(g.dtype).double(), **TOL[dtype])


def test_only_all_minus_inf_rows_are_masked():
    fm = torch.finfo(torch.float32).min
    x = torch.tensor([[fm, fm, fm], [-INF, -INF, -INF]], requires_grad=True)
    t = torch.tensor([0, 0])
    loss = SF.cross_entropy(x, t, reduction="none")
    torch.testing.assert_close(loss.detach(), torch.tensor([1.0986123, 0.0]))
    # the masked row is not in the mean's denominator; the finfo.min row is
    assert SF.cross_entropy(x, t).item() == pytest.approx(1.0986123)
    SF.cross_entropy(x, t).backward()
    torch.testing.assert_close(x.grad, torch.tensor([[-2 / 3, 1 / 3, 1 / 3], [0.0, 0.0, 0.0]]))


# --- logsumexp's gradient is the exact softmax at every magnitude ---------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 1e4, 1e20, 1e30, 1e38])
def test_logsumexp_gradient_is_the_softmax(dtype, scale):
    x = torch.tensor([[-1.0, -1.0], [-1.0, -0.999], [-1.0, -0.5]], dtype=dtype) * scale
    _, g = _value_and_grad(lambda z: SF.logsumexp(z, 1), x)
    ref = torch.softmax(x.double(), 1) * torch.linspace(-1.0, 1.0, 3, dtype=torch.float64)[:, None]
    torch.testing.assert_close(g.double(), ref, rtol=4 * torch.finfo(dtype).eps, atol=0)


def test_logsumexp_minus_1e30_gives_one_half():
    x = torch.tensor([-1e30, -1e30], requires_grad=True)
    SF.logsumexp(x, 0).backward()
    assert x.grad.tolist() == [0.5, 0.5]


# --- weight that requires grad gets its gradient --------------------------------------


def _ref_index_loss(x, t, w, gamma, eps, ignore_index, reduction):
    """float64 reference written with torch ops: mean = Σ w_t ℓ / Σ w_t."""
    lsm = torch.log_softmax(x, 1)
    keep = t != ignore_index
    ts = torch.where(keep, t, 0)
    lt = lsm.gather(1, ts[:, None])[:, 0]
    wt = w[ts] * keep
    rest = torch.softmax(x, 1).scatter(1, ts[:, None], 0.0).sum(1)  # 1 - p_t from the other classes
    val = rest**gamma * -lt
    loss = (1 - eps) * wt * val - keep * (eps / x.shape[1]) * (lsm * w).sum(1)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / wt.sum()


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize(
    "fn,gamma,eps", [("ce", 0.0, 0.0), ("ce", 0.0, 0.2), ("focal", 2.0, 0.0), ("focal", 0.5, 0.0)]
)
def test_weight_gradient_class_index(fn, gamma, eps, reduction):
    x = torch.randn(6, 5, dtype=torch.float64) * 2
    t = torch.tensor([0, 4, -100, 2, 2, 1])
    w = torch.rand(5, dtype=torch.float64) + 0.3
    if fn == "ce":
        ours = lambda xx, ww: SF.cross_entropy(xx, t, weight=ww, label_smoothing=eps, reduction=reduction)  # noqa: E731
    else:
        ours = lambda xx, ww: SF.focal_loss(xx, t, gamma=gamma, weight=ww, reduction=reduction)  # noqa: E731
    ref = lambda xx, ww: _ref_index_loss(xx, t, ww, gamma, eps, -100, reduction)  # noqa: E731
    grads = []
    for f in (ours, ref):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = f(xx, ww)
        grads.append(
            torch.autograd.grad(
                (out * torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).reshape(out.shape)).sum(),
                (xx, ww),
            )
        )
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("eps", [0.0, 0.3])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_weight_gradient_probabilities_matches_torch(eps, reduction):
    x = torch.randn(4, 5, dtype=torch.float64)
    y = torch.softmax(torch.randn(4, 5, dtype=torch.float64), 1)
    w = torch.rand(5, dtype=torch.float64) + 0.3
    grads = []
    for f in (SF.cross_entropy, F.cross_entropy):
        xx, yy, ww = (v.clone().requires_grad_() for v in (x, y, w))
        out = f(xx, yy, weight=ww, label_smoothing=eps, reduction=reduction)
        grads.append(torch.autograd.grad(out.sum(), (xx, yy, ww)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_weight_gradient_gradcheck():
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(4, dtype=torch.float64) + 0.5).requires_grad_()
    t = torch.tensor([0, 1, 3, -100, 2])
    assert gradcheck(lambda a, b: SF.cross_entropy(a, t, weight=b, label_smoothing=0.1), (x, w))
    assert gradcheck(lambda a, b: SF.focal_loss(a, t, gamma=1.5, weight=b), (x, w))
    assert gradgradcheck(lambda a, b: SF.focal_loss(a, t, gamma=1.5, weight=b), (x, w))


# --- forward-mode AD -------------------------------------------------------------------


def _jvp_pairs():
    t = torch.tensor([0, 2, 1])
    y = torch.softmax(torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), 1)
    return {
        "softmax": (lambda x: SF.softmax(x, 1), lambda x: torch.softmax(x, 1)),
        "log_softmax": (lambda x: SF.log_softmax(x, 1), lambda x: torch.log_softmax(x, 1)),
        "logsumexp": (lambda x: SF.logsumexp(x, (0, 1)), lambda x: torch.logsumexp(x, (0, 1))),
        "cross_entropy": (
            lambda x: SF.cross_entropy(x, t, label_smoothing=0.1),
            lambda x: F.cross_entropy(x, t, label_smoothing=0.1),
        ),
        "cross_entropy_probs": (lambda x: SF.cross_entropy(x, y), lambda x: F.cross_entropy(x, y)),
        "focal_gamma0": (lambda x: SF.focal_loss(x, t, gamma=0.0), lambda x: F.cross_entropy(x, t)),
        "kl_div": (
            lambda x: SF.kl_div(x, y, reduction="batchmean"),
            lambda x: F.kl_div(x, y, reduction="batchmean"),
        ),
    }


@pytest.mark.parametrize("name", list(_jvp_pairs()))
def test_jvp_and_jacfwd_match_torch(name):
    ours, theirs = _jvp_pairs()[name]
    x = torch.randn(3, 4, dtype=torch.float64)
    v = torch.randn(3, 4, dtype=torch.float64)
    a = torch.func.jvp(ours, (x,), (v,))
    b = torch.func.jvp(theirs, (x,), (v,))
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(torch.func.jacfwd(ours)(x), torch.func.jacfwd(theirs)(x))
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        out = ours(fwAD.make_dual(x, v))
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent, b[1])


def test_hessian_of_logsumexp_equals_torch():
    z = torch.randn(6, dtype=torch.float64)
    h = torch.func.hessian(lambda u: SF.logsumexp(u, 0))(z)
    torch.testing.assert_close(h, torch.func.hessian(lambda u: torch.logsumexp(u, 0))(z))


def test_focal_jvp_matches_float64_reference():
    x = torch.randn(4, 3, dtype=torch.float64)
    v = torch.randn(4, 3, dtype=torch.float64)
    t = torch.tensor([0, 1, 2, 1])
    w = torch.rand(3, dtype=torch.float64) + 0.5
    ref = lambda xx: _ref_index_loss(xx, t, w, 2.0, 0.0, -100, "mean")  # noqa: E731
    torch.testing.assert_close(
        torch.func.jvp(lambda xx: SF.focal_loss(xx, t, gamma=2.0, weight=w), (x,), (v,)),
        torch.func.jvp(ref, (x,), (v,)),
    )


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_gradcheck_forward_ad_cross_entropy(soft, eps):
    x = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(4, dtype=torch.float64) + 0.5).requires_grad_()
    if soft:
        y = torch.softmax(torch.randn(3, 4, 2, dtype=torch.float64), 1).requires_grad_()
        assert gradcheck(
            lambda a, b, c: SF.cross_entropy(a, b, weight=c, label_smoothing=eps),
            (x, y, w),
            check_forward_ad=True,
        )
    else:
        t = torch.tensor([[0, 3], [1, -100], [2, 2]])
        assert gradcheck(
            lambda a, c: SF.cross_entropy(a, t, weight=c, label_smoothing=eps), (x, w), check_forward_ad=True
        )


@pytest.mark.parametrize("gamma", [0.5, 2.0])
def test_gradcheck_forward_ad_focal(gamma):
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_()
    t = torch.tensor([0, 1, 2, -100, 1])
    assert gradcheck(lambda a, c: SF.focal_loss(a, t, gamma=gamma, weight=c), (x, w), check_forward_ad=True)


@pytest.mark.parametrize("log_target", [False, True])
def test_gradcheck_forward_ad_softmax_family_and_kl(log_target):
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    for f in (lambda a: SF.softmax(a, 1), lambda a: SF.log_softmax(a, 0), lambda a: SF.logsumexp(a, (0, 1))):
        assert gradcheck(f, (x,), check_forward_ad=True, check_batched_grad=True)
    y = torch.softmax(torch.randn(3, 4, dtype=torch.float64), 1)
    y = (y.log() if log_target else y).requires_grad_()
    assert gradcheck(
        lambda a, b: SF.kl_div(a, b, reduction="sum", log_target=log_target), (x, y), check_forward_ad=True
    )


def test_jvp_at_hazards_is_finite():
    x = torch.tensor([[-INF, -INF, -INF], [INF, 0.0, INF], [1.0, -INF, 2.0]])
    v = torch.ones_like(x)
    for f in (
        lambda z: SF.softmax(z, 1),
        lambda z: SF.log_softmax(z, 1),
        lambda z: SF.logsumexp(z, 1),
        lambda z: SF.cross_entropy(z, torch.tensor([0, 0, 2]), reduction="none"),
        lambda z: SF.focal_loss(z, torch.tensor([0, 0, 2]), gamma=0.5, reduction="none"),
    ):
        _, tangent = torch.func.jvp(f, (x,), (v,))
        finite_out = torch.isfinite(f(x))
        assert torch.isfinite(tangent[finite_out]).all()


@pytest.mark.slow
def test_compiled_fullgraph_with_jvp_functions():
    x = torch.randn(4, 5, requires_grad=True)
    t = torch.tensor([0, 1, 2, 3])

    def f(z):
        return (
            SF.cross_entropy(z, t) + SF.focal_loss(z, t) + SF.logsumexp(z, 1).sum() + SF.softmax(z, 1)[0, 0]
        )

    out = torch.compile(f, fullgraph=True)(x)
    torch.testing.assert_close(out, f(x))


# --- double backward is finite at the hazards and matches float64 ---------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0])
def test_focal_double_backward_at_pt_one(gamma, dtype):
    x = torch.tensor([[20.0, 0.0]], dtype=dtype)
    t = torch.tensor([0])

    def second(f, z):
        z = z.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(f(z), z, create_graph=True)
        (h,) = torch.autograd.grad((g * torch.tensor([[1.0, -2.0]], dtype=z.dtype)).sum(), z)
        return g.detach(), h

    g, h = second(lambda z: SF.focal_loss(z, t, gamma=gamma), x)
    g_ref, h_ref = second(
        lambda z: _ref_index_loss(z, t, torch.ones(2, dtype=z.dtype), gamma, 0.0, -100, "sum"), x.double()
    )
    assert torch.isfinite(g).all() and torch.isfinite(h).all()
    # the first derivative keeps full relative accuracy (the target entry is -a·Σ_{j≠t} p_j)
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=0)
    if dtype == torch.float64:
        torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=0)
    else:
        # float32: the softmax backward inside the second derivative rounds p_t·(1 − p_t);
        # accurate to float32 resolution on the scale of the loss
        torch.testing.assert_close(h.double(), h_ref, rtol=0, atol=1e-7)


@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0])
def test_focal_double_backward_on_posinf_rows(gamma):
    x = torch.tensor([[INF, 0.0, 1.0], [INF, INF, 0.0]], requires_grad=True)
    t = torch.tensor([0, 1])
    (g,) = torch.autograd.grad(SF.focal_loss(x, t, gamma=gamma, reduction="sum"), x, create_graph=True)
    (h,) = torch.autograd.grad((g * torch.arange(6.0).reshape(2, 3)).sum(), x)
    # the limit: the first row is p_t = 1 (every derivative 0); on the second the loss is
    # 0.5^γ·log 2 at fixed mass, its derivatives come from the float64 reference at a large margin
    big = torch.tensor([[200.0, 0.0, 1.0], [200.0, 200.0, 0.0]], dtype=torch.float64, requires_grad=True)
    (g_ref,) = torch.autograd.grad(
        _ref_index_loss(big, t, torch.ones(3, dtype=torch.float64), gamma, 0.0, -100, "sum"),
        big,
        create_graph=True,
    )
    (h_ref,) = torch.autograd.grad((g_ref * torch.arange(6.0, dtype=torch.float64).reshape(2, 3)).sum(), big)
    assert torch.isfinite(g).all() and torch.isfinite(h).all()
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.double(), h_ref, rtol=1e-5, atol=1e-6)


# --- no intermediate overflow ---------------------------------------------------------


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
def test_label_smoothing_near_1e37_is_finite_and_exact(reduction, weighted):
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(8, 100, generator=g) * 2 - 1) * 1e37
    t = torch.randint(0, 100, (8,), generator=g)
    w = torch.rand(100, generator=g) + 0.5 if weighted else None
    out = SF.cross_entropy(x, t, weight=w, label_smoothing=0.1, reduction=reduction)
    ref = F.cross_entropy(
        x.double(), t, weight=None if w is None else w.double(), label_smoothing=0.1, reduction=reduction
    )
    assert torch.isfinite(ref).all() and (ref.abs() < torch.finfo(torch.float32).max).all()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=0)


# --- exact tails (mpmath references) ----------------------------------------------------


def _mp_focal(margin: float, n_other: int, gamma: float) -> float:
    mpmath.mp.dps = 50
    m = mpmath.mpf(margin)
    rest = n_other * mpmath.e ** (-m) / (1 + n_other * mpmath.e ** (-m))
    return float(rest**gamma * -mpmath.log(1 - rest))


@pytest.mark.parametrize("gamma", [0.5, 2.0])
@pytest.mark.parametrize("margin", [15.0, 17.0, 20.0, 25.0, 30.0])
def test_focal_tail_full_relative_accuracy_float32(margin, gamma):
    x = torch.tensor([[margin, 0.0, 0.0]])
    out = SF.focal_loss(x, torch.tensor([0]), gamma=gamma, reduction="sum")
    ref = _mp_focal(margin, 2, gamma)
    assert ref > 0
    assert abs(out.item() - ref) <= 1e-5 * ref


# --- arguments torch rejects are rejected ----------------------------------------------


def test_probability_target_with_nonnegative_ignore_index_raises_like_torch():
    x, y = torch.randn(2, 3), torch.softmax(torch.randn(2, 3), 1)
    with pytest.raises(RuntimeError, match="ignore_index is not supported for floating point target"):
        F.cross_entropy(x, y, ignore_index=0)
    with pytest.raises(
        RuntimeError, match="cross_entropy: ignore_index is not supported for floating point target"
    ):
        SF.cross_entropy(x, y, ignore_index=0)
    # a negative ignore_index is fine, as in torch
    torch.testing.assert_close(
        SF.cross_entropy(x, y, ignore_index=-5), F.cross_entropy(x, y, ignore_index=-5)
    )


@pytest.mark.parametrize("fn", [SF.cross_entropy, SF.focal_loss])
def test_float_ignore_index_is_a_type_error(fn):
    with pytest.raises(TypeError, match="ignore_index must be an int, got float"):
        fn(torch.randn(2, 3), torch.tensor([0, 1]), ignore_index=1.0)


@pytest.mark.parametrize("gamma", [INF, float("nan"), -1.0])
def test_focal_gamma_must_be_finite_and_nonnegative(gamma):
    with pytest.raises(ValueError, match="focal_loss: gamma"):
        SF.focal_loss(torch.randn(2, 3), torch.tensor([0, 1]), gamma=gamma)


@pytest.mark.parametrize("bad", ["0.1", None, [0.1]])
def test_label_smoothing_not_a_number_is_a_type_error(bad):
    with pytest.raises(TypeError, match="cross_entropy: label_smoothing must be a float, got"):
        SF.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), label_smoothing=bad)


@pytest.mark.parametrize("fn", [SF.cross_entropy, lambda x, t: SF.focal_loss(x, t, gamma=0.5)])
@pytest.mark.parametrize("bad", [3, -3, 7])
def test_target_out_of_range_is_an_index_error_naming_it(fn, bad):
    t = torch.tensor([0, bad])
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds."):
        F.cross_entropy(torch.randn(2, 3), t)
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds."):
        fn(torch.randn(2, 3), t)


def test_target_out_of_range_with_smoothing_and_spatial_dims():
    t = torch.tensor([[0, 5]])
    with pytest.raises(IndexError, match="Target 5 is out of bounds."):
        SF.cross_entropy(torch.randn(1, 3, 2), t, label_smoothing=0.1)


# --- type promotion as torch ------------------------------------------------------------


@pytest.mark.parametrize(
    "dt_in,dt_t",
    [
        (torch.float32, torch.float64),
        (torch.float64, torch.float32),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float64),
    ],
)
def test_type_promotion_like_torch(dt_in, dt_t):
    x = torch.randn(3, 4).to(dt_in)
    y = torch.softmax(torch.randn(3, 4), 1).to(dt_t)
    ce, ce_ref = SF.cross_entropy(x, y), F.cross_entropy(x, y)
    assert ce.dtype == ce_ref.dtype
    torch.testing.assert_close(ce.double(), ce_ref.double(), rtol=1e-2, atol=1e-3)
    logq = torch.log_softmax(torch.randn(3, 4), 1).to(dt_in)
    kl, kl_ref = SF.kl_div(logq, y, reduction="batchmean"), F.kl_div(logq, y, reduction="batchmean")
    assert kl.dtype == kl_ref.dtype
    torch.testing.assert_close(kl.double(), kl_ref.double(), rtol=1e-2, atol=1e-3)


# --- kl_div(reduction='mean') warns as torch does --------------------------------------


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


def _mp_logsumexp(values: list[float]) -> float:
    mpmath.mp.dps = 50
    return float(mpmath.log(mpmath.fsum(mpmath.e ** mpmath.mpf(v) for v in values)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "values", [[0.0, -20.0], [0.0, -30.0, -40.0], [1e-3, -17.0], [-0.5, -25.0, -0.5 - 40.0]]
)
def test_logsumexp_rounds_as_torch_and_its_gradient_keeps_the_tail(values, dtype):
    # The bare logsumexp's exact tail would cost two passes over the input more than torch's
    # (1.43x its bytes): its value is torch's own, bit for bit (0 for [0, -20] in float32, where
    # the float64 reference is 2.06e-9); the gradient, a softmax, still carries the small part.
    x = torch.tensor(values, dtype=dtype, requires_grad=True)
    out = SF.logsumexp(x, 0)
    assert torch.equal(out, torch.logsumexp(x.detach(), 0))
    assert abs(out.item() - _mp_logsumexp(values)) <= 4 * torch.finfo(dtype).eps
    out.backward()
    mpmath.mp.dps = 50
    vs = x.detach().tolist()  # the values the tensor holds (1e-3 is not a float32)
    lse = mpmath.log(mpmath.fsum(mpmath.e ** mpmath.mpf(u) for u in vs))
    ref = [float(mpmath.e ** (mpmath.mpf(v) - lse)) for v in vs]
    # a few ulp of each entry (torch's softmax kernel: exp and one division)
    torch.testing.assert_close(x.grad, torch.tensor(ref, dtype=dtype), rtol=8 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("margin", [5.0, 15.0, 17.0, 20.0, 25.0, 30.0])
@pytest.mark.parametrize("classes", [2, 10])
def test_cross_entropy_exact_tail_against_mpmath(margin, classes):
    """Exact tails: a confident correct row keeps its small loss (torch rounds it to 0)."""
    mpmath.mp.dps = 60
    x = torch.zeros(1, classes)
    x[0, 0] = margin
    got = SF.cross_entropy(x, torch.tensor([0])).item()
    ref = float(mpmath.log(1 + (classes - 1) * mpmath.exp(-mpmath.mpf(margin))))
    assert got > 0.0
    assert abs(got - ref) <= 1e-5 * ref


@pytest.mark.parametrize("margin", [5.0, 17.0, 25.0, 40.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_softmax_exact_tail_against_mpmath(margin, dtype):
    """Exact tails: the argmax entry is −log1p(δ), not a rounded 0; the others stay exact."""
    mpmath.mp.dps = 60
    x = torch.tensor([[margin, 0.0, -1.0]], dtype=dtype)
    got = SF.log_softmax(x, 1)[0].double()
    m = mpmath.mpf(margin)
    lse = mpmath.log(mpmath.exp(m) + 1 + mpmath.exp(-1))
    for j, xj in enumerate((m, 0, -1)):
        ref = float(xj - lse)
        assert abs(got[j].item() - ref) <= 4 * torch.finfo(dtype).eps * abs(ref), (j, got[j].item(), ref)
