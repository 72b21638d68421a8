"""Drop-in fidelity of cross_entropy (and focal_loss where the two share a path: weights,
forward-mode AD, the argument checks), with the other class-row ops on the same finfo.min and
forward-mode tables (design: Drop-in).

Every assertion is against torch or against a float64 / mpmath reference written with plain
torch ops (never against stablelosses' own formula): finite fill values are ordinary numbers,
weights get gradients, forward-mode AD works, tails are exact, bad arguments are refused as
torch refuses them, and dtypes promote as torch's.
"""

from __future__ import annotations

import mpmath
import pytest
import torch
import torch.nn.functional as F
from conftest import ref_index_loss, value_and_grad
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
        # log_softmax defines the gradient through a -inf output as 0 (test_softmax checks both)
        x = x[:2]
    v, g = value_and_grad(ours, x)
    # torch in float64 on the same values is the reference (float16/bfloat16 compute in float32)
    ref_dtype = torch.float64
    v_ref, g_ref = value_and_grad(theirs, x.to(ref_dtype))
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


# --- weight that requires grad gets its gradient --------------------------------------


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
    ref = lambda xx, ww: ref_index_loss(xx, t, ww, gamma, eps, -100, reduction)  # noqa: E731
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
