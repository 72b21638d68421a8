"""sigmoid_focal_loss / SigmoidFocalLoss: torchvision's formula, finite gradients for every gamma."""

from __future__ import annotations

import mpmath
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_compiled_matches_eager, tol
from hypothesis import given
from hypothesis import strategies as st
from strategies import finite_floats, saturated_logits, tensors, value_and_grads

import stablelosses as sl
import stablelosses.functional as SF
from stablelosses import naive as naive_formulas

INF, NAN = float("inf"), float("nan")

REDUCTIONS = ["none", "mean", "sum"]


torchvision_formula = naive_formulas.torchvision_sigmoid_focal


def mp_reference(x, t, alpha, gamma):
    """Value, d/dx and d/dt at 60 significant digits (mpmath), independent of both formulas."""
    mpmath.mp.dps = 60

    def f(xv, tv):
        p = 1 / (1 + mpmath.exp(-xv))
        ce = -(tv * mpmath.log(p) + (1 - tv) * mpmath.log(1 - p))
        q = tv * (1 - p) + (1 - tv) * p
        at = alpha * tv + (1 - alpha) * (1 - tv) if alpha >= 0 else 1
        return at * ce * q ** gamma

    X, T = mpmath.mpf(x), mpmath.mpf(t)
    return float(f(X, T)), float(mpmath.diff(lambda v: f(v, T), X)), float(mpmath.diff(lambda v: f(X, v), T))


def mp_value(x, t, alpha, gamma):
    """The loss of one element at 40 significant digits (mpmath): the value only, no derivatives.

    p and 1 - p are each computed directly (no 1 - p subtraction), so a saturated logit keeps
    every digit: log p = -log1p(e^-x), log(1 - p) = -log1p(e^x).
    """
    with mpmath.workdps(40):
        X, T = mpmath.mpf(x), mpmath.mpf(t)
        p, q_ = 1 / (1 + mpmath.exp(-X)), 1 / (1 + mpmath.exp(X))  # sigmoid(x), 1 - sigmoid(x)
        ce = T * mpmath.log1p(mpmath.exp(-X)) + (1 - T) * mpmath.log1p(mpmath.exp(X))
        q = T * q_ + (1 - T) * p
        at = alpha * T + (1 - alpha) * (1 - T) if alpha >= 0 else 1
        return at * ce * q ** gamma


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("alpha", [0.25, 0.5, 1.0, -1.0])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0, 2.0, 3.5])
@pytest.mark.parametrize("soft", [False, True])
def test_parity_with_torchvision(device, reduction, alpha, gamma, soft):
    x = torch.randn(4, 7, dtype=torch.float64, device=device) * 4  # moderate logits: formula is accurate
    t = torch.rand(4, 7, dtype=torch.float64, device=device)
    t = t if soft else (t > 0.5).double()
    kw = dict(alpha=alpha, gamma=gamma, reduction=reduction)
    v, gx, gt = value_and_grads(SF.sigmoid_focal_loss, x, t, **kw)
    rv, rgx, rgt = value_and_grads(torchvision_formula, x, t, **kw)
    torch.testing.assert_close(v, rv, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(gx, rgx, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(gt, rgt, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("shapes", [((), ()), ((0,), (0,)), ((2, 0, 3), (2, 0, 3)), ((1, 4, 1), (1, 4, 1))], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_shapes(shapes, reduction):
    x = torch.randn(shapes[0], dtype=torch.float64)
    t = torch.rand(shapes[1], dtype=torch.float64)
    v, gx, gt = value_and_grads(SF.sigmoid_focal_loss, x, t, reduction=reduction)
    rv, rgx, rgt = value_and_grads(torchvision_formula, x, t, reduction=reduction)
    torch.testing.assert_close(v, rv, equal_nan=True)
    torch.testing.assert_close(gx, rgx)
    torch.testing.assert_close(gt, rgt)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gamma", [0.5, 2.0])
def test_large_input_matches(reduction, gamma):
    n = 2 * 65536 + 123  # past the size where 0.1 switched to a chunked path (one path now)
    x = torch.randn(n, dtype=torch.float64) * 4
    t = torch.rand(n, dtype=torch.float64)
    kw = dict(gamma=gamma, reduction=reduction)
    v, gx, gt = value_and_grads(SF.sigmoid_focal_loss, x, t, **kw)
    rv, rgx, rgt = value_and_grads(torchvision_formula, x, t, **kw)
    torch.testing.assert_close(v, rv, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(gx, rgx, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(gt, rgt, rtol=1e-6, atol=1e-12)


def test_user_regression_logit_20_gamma_half():
    x = torch.tensor([20.0, -20.0], requires_grad=True)
    t = torch.tensor([1.0, 0.0])
    torchvision_formula(x, t, gamma=0.5).sum().backward()
    assert torch.isnan(x.grad).all()
    x.grad = None
    SF.sigmoid_focal_loss(x, t, gamma=0.5).sum().backward()
    assert torch.isfinite(x.grad).all()
    _, dx, _ = mp_reference(20.0, 1.0, 0.25, 0.5)
    torch.testing.assert_close(x.grad[0].double(), torch.tensor(dx, dtype=torch.float64), rtol=1e-5, atol=0)


@pytest.mark.parametrize("x", [0.0, 1e-45, -1e-38, 3.0, -3.0, 20.0, -20.0, 60.0, -60.0, 1e4, -1e4, 1e30, -1e30])
@pytest.mark.parametrize("t", [0.0, 1.0, 0.3])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
def test_extremes_vs_mpmath(x, t, gamma):
    out, gx, gt = value_and_grads(
        SF.sigmoid_focal_loss, torch.tensor([x], dtype=torch.float64), torch.tensor([t], dtype=torch.float64),
        gamma=gamma,
    )
    if gamma == 0.0:
        # γ = 0 is α_t·BCE with torch's own BCE term, bit for bit (design: Drop-in);
        # that term cancels for a logit on the right side (-20 with t = 0), so no mpmath here.
        xt, tt = torch.tensor([x], dtype=torch.float64), torch.tensor([t], dtype=torch.float64)
        bce = F.binary_cross_entropy_with_logits(xt, tt, reduction="none")
        assert torch.equal(out, bce * (0.25 * tt + 0.75 * (1 - tt)))
    if abs(x) <= 60:
        v, dx, dt = mp_reference(x, t, 0.25, gamma)
        if gamma != 0.0:
            torch.testing.assert_close(out[0].item(), v, rtol=1e-9, atol=1e-300)
        torch.testing.assert_close(gx[0].item(), dx, rtol=1e-7, atol=1e-300)
        torch.testing.assert_close(gt[0].item(), dt, rtol=1e-7, atol=1e-300)
    assert torch.isfinite(out).all() and torch.isfinite(gx).all() and torch.isfinite(gt).all()
    # float32 as well: finite value and gradients
    o32, g32, t32 = value_and_grads(
        SF.sigmoid_focal_loss, torch.tensor([x]), torch.tensor([t]), gamma=gamma)
    assert torch.isfinite(o32).all() and torch.isfinite(g32).all() and torch.isfinite(t32).all()


def test_saturated_logits_vs_mpmath():
    # 1 - p_t = e^-200 underflows in float32; (1 - p_t)^0.5 = e^-100 does not. torchvision's
    # gradient is NaN for gamma < 1 here; ours is the exact one, rounded to float32.
    x = torch.tensor([200.0, -200.0], requires_grad=True)
    t = torch.tensor([1.0, 0.0], requires_grad=True)
    loss = SF.sigmoid_focal_loss(x, t, gamma=0.5)
    assert (loss == 0).all()  # e^-300 underflows
    loss.sum().backward()
    mpmath.mp.dps = 300  # 1 - σ(200) needs ~90 digits
    for i, (xi, ti) in enumerate([(200.0, 1.0), (-200.0, 0.0)]):
        # closed form at the hard target (a finite difference in t would leave [0, 1])
        X, T = mpmath.mpf(xi), mpmath.mpf(ti)
        p = 1 / (1 + mpmath.exp(-X))
        ce = -(T * mpmath.log(p) + (1 - T) * mpmath.log(1 - p))
        q = T * (1 - p) + (1 - T) * p
        at = 0.25 * T + 0.75 * (1 - T)
        dx = at * q**0.5 * ((p - T) + 0.5 * ce * (1 - 2 * T) * p * (1 - p) / q)
        dt = float(-0.5 * ce * q**0.5 + at * (-X * q**0.5 + ce * 0.5 * q**-0.5 * (1 - 2 * p)))
        assert abs(float(dx)) < 1e-45 and x.grad[i].item() == 0.0  # the exact value underflows
        # |d/dt| ≈ α_t·200·e^-100 ≈ 2e-42 (torchvision: NaN; 0.1 of this library: 0). The
        # factor e^-100 = 3.7e-44 is itself a float32 subnormal with ~5 significant bits: 3%.
        assert abs(dt) > 1e-42
        torch.testing.assert_close(t.grad[i].double(), torch.tensor(dt, dtype=torch.float64), rtol=0.03, atol=0)


logits = st.one_of(finite_floats(torch.float32, max_abs=1e30), saturated_logits(torch.float32))
targets = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0, width=32))


@given(data=st.data(), gamma=st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 5.0]),
       alpha=st.sampled_from([0.25, -1.0, 0.9]), reduction=st.sampled_from(REDUCTIONS))
def test_property_finite_gradients(data, gamma, alpha, reduction):
    n = data.draw(st.integers(1, 6))
    x = data.draw(tensors((n,), torch.float32, elements=logits))
    t = data.draw(tensors((n,), torch.float32, elements=targets))
    v, gx, gt = value_and_grads(SF.sigmoid_focal_loss, x, t, alpha=alpha, gamma=gamma, reduction=reduction)
    assert torch.isfinite(v).all() and torch.isfinite(gx).all() and torch.isfinite(gt).all()
    if gamma == 0.0:
        # γ = 0 is torch's BCE term bit for bit (design: Drop-in), cancellation included: its
        # (1 - t)·x + max(-x, 0) loses the small t·|x| of a soft target at a large negative x
        # in float32, so the reference is torch's float32 term, not float64
        ref = torchvision_formula(x, t, alpha, gamma, reduction)
        torch.testing.assert_close(v, ref, rtol=1e-6, atol=0)
        return
    # matches the exact value: the formula evaluated term by term in mpmath (40 digits), which
    # shares nothing with our kernel; the float32 inputs are exact binary numbers
    terms = [mp_value(float(xi), float(ti), alpha, gamma) for xi, ti in zip(x.tolist(), t.tolist())]
    if reduction == "none":
        want = torch.tensor([float(v_) for v_ in terms], dtype=torch.float64)
    else:
        total = mpmath.fsum(terms)
        want = torch.tensor(float(total / len(terms) if reduction == "mean" else total), dtype=torch.float64)
    torch.testing.assert_close(v.double(), want, rtol=1e-4, atol=1e-6)


def test_nan_propagates():
    x = torch.tensor([float("nan"), 1.0], requires_grad=True)
    t = torch.tensor([1.0, float("nan")], requires_grad=True)
    out = SF.sigmoid_focal_loss(x, t, gamma=0.5)
    assert torch.isnan(out).all()
    out.sum().backward()
    assert torch.isnan(x.grad).all() and torch.isnan(t.grad).all()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
def test_gradcheck(reduction, gamma):
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    t = (torch.rand(3, 4, dtype=torch.float64) * 0.8 + 0.1).requires_grad_()
    f = lambda a, b: SF.sigmoid_focal_loss(a, b, 0.25, gamma, reduction)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, t), check_batched_grad=True)
    assert torch.autograd.gradgradcheck(f, (x, t), check_batched_grad=True)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_func_grad_and_vmap(reduction):
    x = torch.randn(5, 3, dtype=torch.float64) * 3
    t = torch.rand(5, 3, dtype=torch.float64)
    kw = dict(gamma=0.5, reduction=reduction)
    g = torch.func.grad(lambda a, b: SF.sigmoid_focal_loss(a, b, **kw).sum(), argnums=(0, 1))(x, t)
    r = torch.func.grad(lambda a, b: torchvision_formula(a, b, **kw).sum(), argnums=(0, 1))(x, t)
    torch.testing.assert_close(g, r)
    v = torch.vmap(lambda a, b: SF.sigmoid_focal_loss(a, b, **kw))(x, t)
    torch.testing.assert_close(v, torch.stack([torchvision_formula(a, b, **kw) for a, b in zip(x, t)]))
    pg = torch.vmap(torch.func.grad(lambda a, b: SF.sigmoid_focal_loss(a, b, **kw).sum()))(x, t)
    ref = torch.stack([torch.func.grad(lambda a: torchvision_formula(a, b, **kw).sum())(a) for a, b in zip(x, t)])
    torch.testing.assert_close(pg, ref)


def test_dtypes_and_autocast(dtype):
    x = (torch.randn(8) * 3).to(dtype).requires_grad_()
    t = (torch.rand(8) > 0.5).to(dtype)
    out = SF.sigmoid_focal_loss(x, t, reduction="mean")
    assert out.dtype == dtype
    ref = torchvision_formula(x.detach().double(), t.double(), reduction="mean")
    torch.testing.assert_close(out.detach().double(), ref, **tol(dtype))
    out.backward()
    assert x.grad.dtype == dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.binary_cross_entropy_with_logits(x, t).dtype
        assert SF.sigmoid_focal_loss(x, t).dtype == expected


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float64), (torch.float64, torch.float32),
                                    (torch.float16, torch.float32), (torch.bfloat16, torch.float64)])
@pytest.mark.parametrize("mask", [False, True])
def test_mixed_dtypes_follow_torch_type_promotion(dtypes, mask):
    x_dtype, t_dtype = dtypes
    x = (torch.randn(6) * 3).to(x_dtype).requires_grad_()
    t = torch.rand(6).to(t_dtype)
    expected = torchvision_formula(x, t, reduction="sum")
    kwargs = {"mask": torch.ones(6, dtype=torch.bool)} if mask else {}
    out = SF.sigmoid_focal_loss(x, t, reduction="sum", **kwargs)
    assert out.dtype == expected.dtype == torch.promote_types(x_dtype, t_dtype)
    ref = torchvision_formula(x.detach().double(), t.double(), reduction="sum")
    torch.testing.assert_close(out.double(), ref, **tol(torch.promote_types(x_dtype, t_dtype)))
    out.backward()
    assert x.grad.dtype == x_dtype


def test_defaults_match_torchvision():
    x, t = torch.randn(2, 3), (torch.rand(2, 3) > 0.5).float()
    assert SF.sigmoid_focal_loss(x, t).shape == (2, 3)  # reduction='none' by default
    torch.testing.assert_close(SF.sigmoid_focal_loss(x, t), torchvision_formula(x, t))


def test_module_matches_function():
    x, t = torch.randn(3, 4), torch.rand(3, 4)
    m = sl.SigmoidFocalLoss(alpha=0.5, gamma=1.5)
    assert torch.equal(m(x, t), SF.sigmoid_focal_loss(x, t, 0.5, 1.5, "mean"))


def test_bad_arguments():
    x = torch.randn(3)
    # torchvision's own test matches "Invalid"; the message also names the argument and values
    with pytest.raises(ValueError, match=r"sigmoid_focal_loss: Invalid reduction: "
                                         r"reduction must be 'none', 'mean' or 'sum', got 'avg'"):
        SF.sigmoid_focal_loss(x, x, reduction="avg")
    for gamma in [float("inf"), float("nan")]:
        with pytest.raises(ValueError, match=r"sigmoid_focal_loss: gamma must be"):
            SF.sigmoid_focal_loss(x, x, gamma=gamma)
    with pytest.raises(ValueError, match=r"SigmoidFocalLoss: alpha must be in \[0, 1\], or -1"):
        sl.SigmoidFocalLoss(alpha=float("nan"))
    with pytest.raises(ValueError, match=r"SigmoidFocalLoss: gamma must be finite"):
        sl.SigmoidFocalLoss(gamma=float("inf"))
    with pytest.raises(ValueError, match=r"sigmoid_focal_loss: gamma must be >= 0"):
        SF.sigmoid_focal_loss(x, x, gamma=-1.0)
    with pytest.raises(TypeError, match=r"sigmoid_focal_loss: alpha"):
        SF.sigmoid_focal_loss(x, x, alpha="0.25")
    with pytest.raises(TypeError, match=r"sigmoid_focal_loss: input"):
        SF.sigmoid_focal_loss(torch.arange(3), x)
    with pytest.raises(TypeError, match=r"sigmoid_focal_loss: target"):
        SF.sigmoid_focal_loss(x, torch.arange(3))
    with pytest.raises(ValueError, match=r"sigmoid_focal_loss: target size .* must be the same as input size"):
        SF.sigmoid_focal_loss(x, torch.rand(4))
    with pytest.raises(ValueError, match="must be the same"):  # no broadcasting, as torchvision
        SF.sigmoid_focal_loss(torch.randn(2, 3), torch.rand(3))


@pytest.mark.parametrize("alpha", [1.5, -0.5, -2.0, 1.0 + 1e-9, 1e300, -1e300, float("inf"),
                                   float("-inf"), float("nan")])
def test_alpha_outside_unit_interval_other_than_minus_one_raises(alpha):
    x = torch.randn(3)
    with pytest.raises(ValueError, match=r"sigmoid_focal_loss: alpha must be in \[0, 1\], or -1 for "
                                         r"no weighting, got "):
        SF.sigmoid_focal_loss(x, x.sigmoid(), alpha=alpha)
    with pytest.raises(ValueError, match=r"SigmoidFocalLoss: alpha must be in \[0, 1\]"):
        sl.SigmoidFocalLoss(alpha=alpha)


@pytest.mark.parametrize("alpha", [0, 0.0, 1, 1.0, 0.25, -1, -1.0])
def test_alpha_in_unit_interval_or_minus_one_is_accepted(alpha):
    x, t = torch.randn(4), torch.rand(4)
    torch.testing.assert_close(SF.sigmoid_focal_loss(x, t, alpha=alpha), torchvision_formula(x, t, alpha=alpha))


@pytest.mark.slow
def test_compile_fullgraph():
    t = torch.tensor([1.0, 0.0, 0.3])
    assert_compiled_matches_eager(
        lambda a: SF.sigmoid_focal_loss(a, t, gamma=0.5, reduction="mean"), torch.tensor([20.0, -3.0, 0.5])
    )


def _mp_focal(X, T, alpha, gamma):
    p = 1 / (1 + mpmath.exp(-X))
    ce = -(T * mpmath.log(p) + (1 - T) * mpmath.log(1 - p))
    q = T * (1 - p) + (1 - T) * p
    at = alpha * T + (1 - alpha) * (1 - T)
    return at, p, ce, q


@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("x", [30.0, -30.0, 100.0, -100.0, 200.0, -200.0])
@pytest.mark.parametrize("t", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_double_backward_at_saturated_logits_vs_mpmath(gamma, x, t, dtype):
    """d²/dx² matches mpmath (torchvision: NaN for γ < 1 once 1 - p_t rounds to
    0); the mixed d²/dxdt is finite and right to the rounding of its O(1) terms."""
    mpmath.mp.dps = 300  # 1 - σ(200) needs ~90 digits

    def f(v):
        at, _, ce, q = _mp_focal(v, mpmath.mpf(t), 0.25, gamma)
        return at * ce * q**gamma

    def dfdt(v):  # closed form at the hard target (a difference in t would leave [0, 1])
        at, p, ce, q = _mp_focal(v, mpmath.mpf(t), 0.25, gamma)
        return -0.5 * ce * q**gamma + at * (-v * q**gamma + ce * gamma * q ** (gamma - 1) * (1 - 2 * p))

    hxx_ref = float(mpmath.diff(f, mpmath.mpf(x), 2))
    hxt_ref = float(mpmath.diff(dfdt, mpmath.mpf(x)))
    xv = torch.tensor([x], dtype=dtype, requires_grad=True)
    tv = torch.tensor([t], dtype=dtype, requires_grad=True)
    (gx,) = torch.autograd.grad(SF.sigmoid_focal_loss(xv, tv, gamma=gamma, reduction="sum"), xv, create_graph=True)
    hxx, hxt = torch.autograd.grad(gx, (xv, tv))
    assert torch.isfinite(hxx).all() and torch.isfinite(hxt).all()
    # float32: the reference rounded to float32; values below 1e-38 are subnormals with few bits
    hxx_tol = {"rtol": 1e-5, "atol": 2e-43} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-300}
    torch.testing.assert_close(hxx.double(), torch.tensor([hxx_ref], dtype=torch.float64), **hxx_tol)
    hxt_atol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(hxt.double(), torch.tensor([hxt_ref], dtype=torch.float64), rtol=1e-5, atol=hxt_atol)


def _torchvision_test_inputs(shape=(5, 2), dtype=torch.float32):
    """torchvision's TestFocalLoss._generate_diverse_input_target_pair, written out."""
    def logit(p):
        return torch.log(p / (1 - p))

    ranges = {"small": (0.0, 0.2), "big": (0.8, 1.0), "zeros": (0.0, 0.0), "ones": (1.0, 1.0),
              "random": (0.0, 1.0)}

    def make(kind):
        if kind == "random_binary":
            return torch.randint(0, 2, shape).to(dtype)
        low, high = ranges[kind]
        return torch.testing.make_tensor(shape, low=low, high=high, dtype=dtype, device="cpu")

    inputs, targets = [], []
    for i_kind in ["small", "big", "random"]:
        for t_kind in ["zeros", "ones", "random_binary"]:
            inputs.append(logit(make(i_kind)))
            targets.append(make(t_kind))
    return torch.cat(inputs), torch.cat(targets)


@pytest.mark.parametrize("alpha", [-1.0, 0.0, 0.58, 1.0])
@pytest.mark.parametrize("gamma", [0, 2])
@pytest.mark.parametrize("seed", range(10))
def test_torchvision_correct_ratio(alpha, gamma, seed):
    """torchvision's own test_correct_ratio/test_equal_ce_loss hold, with
    focal <= BCE bit for bit and, at γ = 0 and α < 0, focal == BCE exactly."""
    torch.manual_seed(seed)
    inputs, targets = _torchvision_test_inputs()
    focal = SF.sigmoid_focal_loss(inputs, targets, gamma=gamma, alpha=alpha)
    ce = F.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    assert torch.all(focal <= ce)
    if gamma == 0 and alpha < 0:
        assert torch.equal(focal, ce)
    prob = torch.sigmoid(inputs)
    p_t = prob * targets + (1 - prob) * (1 - targets)
    correct_ratio = (1.0 - p_t) ** gamma
    if alpha >= 0:
        correct_ratio = correct_ratio * (alpha * targets + (1 - alpha) * (1 - targets))
    torch.testing.assert_close(correct_ratio, (focal / ce).squeeze(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("x", [0.0, 1e-45, -1e-38, 3.0, -3.0, 20.0, -20.0, 60.0, -60.0])
@pytest.mark.parametrize("t", [0.0, 1.0, 0.3])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
def test_input_gradient_alone_vs_mpmath(x, t, gamma):
    """The eager backward for a target that does not require grad (the common case, its own
    few-pass formula) against mpmath, in float64 and float32."""
    _, dx, _ = mp_reference(x, t, 0.25, gamma)
    for dtype, rtol in [(torch.float64, 1e-7), (torch.float32, 1e-4)]:
        xv = torch.tensor([x], dtype=dtype, requires_grad=True)
        SF.sigmoid_focal_loss(xv, torch.tensor([t], dtype=dtype), gamma=gamma, reduction="sum").backward()
        atol = 1e-300 if dtype == torch.float64 else 1e-44
        torch.testing.assert_close(xv.grad.double(), torch.tensor([dx], dtype=torch.float64), rtol=rtol, atol=atol)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("alpha", [0.25, -1.0, 1.0])
def test_infinite_logits_give_the_limits(gamma, alpha):
    # x = ±inf: the loss is 0 where the target sits at that end (w = 0) or α_t = 0, else +inf;
    # the input gradient is its limit ±α_t·w^(1+γ), finite, with a finite second derivative
    # (torchvision's formula and the lerp of two softpluses give NaN there)
    x0 = torch.tensor([INF, -INF, INF, -INF, INF, -INF, 3.0, NAN])
    t = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.4, 0.5])
    x = x0.clone().requires_grad_()
    out = SF.sigmoid_focal_loss(x, t, alpha=alpha, gamma=gamma)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    w = torch.where(x0 > 0, 1 - t, t)[:6]
    a_t = alpha * t[:6] + (1 - alpha) * (1 - t[:6]) if alpha >= 0 else torch.ones(6)
    want = torch.where((w == 0) | (a_t == 0), 0.0, INF)
    assert torch.equal(out[:6], want)
    torch.testing.assert_close(g[:6], torch.sign(x0[:6]) * a_t * w ** (1 + gamma))
    assert torch.isfinite(g[:7]).all() and torch.isfinite(gg[:7]).all()
    assert torch.isnan(out[7]) and torch.isnan(g[7])
    # the first-order backward (no graph) gives the same limits
    x2 = x0.clone().requires_grad_()
    (g2,) = torch.autograd.grad(SF.sigmoid_focal_loss(x2, t, alpha=alpha, gamma=gamma).sum(), x2)
    torch.testing.assert_close(g2[:7], g[:7].detach())


@pytest.mark.parametrize("gamma", [0.5, 2.0])
def test_target_gradient_at_infinite_logits_with_the_target_at_that_end(gamma):
    # x = ±inf with t at that end (w = 0): the target gradient is the limit of its value at
    # large finite x, -x·α_t·σ(-|x|)^γ → 0 (it was -inf·0 = NaN); and the mixed second
    # derivative d²ℓ/dx dt is finite there (w·w^γ formed 0·inf for γ < 1)
    x = torch.tensor([INF, -INF], requires_grad=True)
    t = torch.tensor([1.0, 0.0], requires_grad=True)
    out = SF.sigmoid_focal_loss(x, t, gamma=gamma, reduction="sum")
    gx, gt = torch.autograd.grad(out, (x, t), create_graph=True)
    assert torch.equal(gt.detach(), torch.zeros(2))
    big = torch.tensor([1e30, -1e30], requires_grad=True)
    (gt_big,) = torch.autograd.grad(SF.sigmoid_focal_loss(big, t, gamma=gamma, reduction="sum"), t)
    assert torch.equal(gt_big, torch.zeros(2))
    (mixed,) = torch.autograd.grad(gx.sum(), t)
    assert torch.isfinite(mixed).all()


@pytest.mark.slow
def test_compiled_infinite_logits_give_the_eager_limits():
    # compiled, the first-order formulas run on x itself (the inf·0 product selected to 0)
    x0 = torch.tensor([INF, -INF, INF, -INF, INF, -INF, 30.0, -30.0, 1.0])
    t = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 1.0, 0.0, 0.4])
    f = torch.compile(lambda x, t: SF.sigmoid_focal_loss(x, t, alpha=0.25, gamma=0.5), fullgraph=True)
    x = x0.clone().requires_grad_()
    out = f(x, t)
    (g,) = torch.autograd.grad(out.sum(), x)
    x2 = x0.clone().requires_grad_()
    want = SF.sigmoid_focal_loss(x2, t, alpha=0.25, gamma=0.5)
    (g2,) = torch.autograd.grad(want.sum(), x2)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(g, g2)
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("gamma", [0.5, 2.0])
@pytest.mark.parametrize("alpha", [0.25, 0.0, 1.0, -1.0])
def test_reduced_loss_is_the_unreduced_one_reduced_at_the_limits(gamma, alpha):
    # eager 'mean'/'sum' sum the product without the select at a zero factor (nansum, and a NaN
    # factor put back): the same bits as reducing the 'none' loss, at ±inf (0 and +inf limits),
    # saturated logits, a NaN input, and with every subset of them
    xs = [INF, -INF, 89.0, -104.0, 200.0, 1e30, 0.0, 3.0, NAN]
    ts = [1.0, 0.0, 0.3, 0.999]
    x = torch.tensor([v for v in xs for _ in ts])
    t = torch.tensor([v for _ in xs for v in ts])
    for lo in range(0, x.numel(), 3):
        for hi in (lo, lo + 1, lo + 4, x.numel()):
            xx, tt = x[lo:hi], t[lo:hi]
            none = SF.sigmoid_focal_loss(xx, tt, alpha, gamma, "none")
            for reduction, want in (("mean", none.mean()), ("sum", none.sum())):
                got = SF.sigmoid_focal_loss(xx, tt, alpha, gamma, reduction)
                assert torch.equal(got, want) or (got.isnan() and want.isnan()), (lo, hi, reduction, got, want)
    assert torch.isnan(SF.sigmoid_focal_loss(x, t, alpha, gamma, "mean"))  # the NaN input
    assert torch.isinf(SF.sigmoid_focal_loss(x[:-4], t[:-4], alpha, gamma, "sum"))


def test_mean_gradient_with_alpha_at_an_end_and_a_target_near_one_keeps_its_digits():
    # α = 0 and t = 0.999: α_t·s = s·(1 − t) is formed by lerp, exact at its ends; the former
    # s − s·t cancelled (2.7e-5 relative error against float64, 6e-6 now)
    torch.manual_seed(0)
    x = torch.randn(1000) * 4
    t = torch.full((1000,), 0.999)
    xd = x.double().requires_grad_()
    SF.sigmoid_focal_loss(xd, t.double(), 0.0, 2.0, "mean").backward()
    xf = x.clone().requires_grad_()
    SF.sigmoid_focal_loss(xf, t, 0.0, 2.0, "mean").backward()
    torch.testing.assert_close(xf.grad.double(), xd.grad, rtol=1.5e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize(("alpha", "gamma"), [(0.25, 2.0), (-1.0, 0.5), (0.0, 2.0), (1.0, 0.5)])
def test_compiled_forward_matches_eager_on_extreme_inputs(alpha, gamma):
    """Compiled, the forward takes the backward's quantities (one ``exp(-|x|)``) instead of
    σ(±x) and softplus(±x): eager's values and gradients on saturated, tiny, infinite and NaN
    logits and on soft, hard and NaN targets."""
    nan = float("nan")
    x0 = torch.tensor([1e4, -1e4, 30.0, -30.0, 1e-30, 0.0, -0.0, 2.5, -0.7, INF, -INF, INF, nan, 3.0])
    t = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.3, 1.0, 0.0, 0.6, 1.0, 0.0, 0.0, 1.0, 0.5, nan])

    def f(z):
        return SF.sigmoid_focal_loss(z, t, alpha=alpha, gamma=gamma, reduction="none")

    x1, x2 = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    got, want = torch.compile(f, fullgraph=True)(x1), f(x2)
    torch.testing.assert_close(got, want, equal_nan=True)
    finite = torch.isfinite(want)
    (g,) = torch.autograd.grad(got[finite].sum(), x1)
    (g_ref,) = torch.autograd.grad(want[finite].sum(), x2)
    torch.testing.assert_close(g, g_ref, equal_nan=True)
    mean = torch.compile(lambda z: SF.sigmoid_focal_loss(z, t[:12], alpha=alpha, gamma=gamma, reduction="mean"),
                         fullgraph=True)(x0[:12])
    torch.testing.assert_close(mean, SF.sigmoid_focal_loss(x0[:12], t[:12], alpha=alpha, gamma=gamma,
                                                           reduction="mean"))


@pytest.mark.parametrize("x", [21.0, 25.0, 30.0, 34.0, -25.0, -30.0])
@pytest.mark.parametrize("t", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("gamma", [0.5, 2.0])
def test_float64_logits_between_20_and_36_keep_every_digit(x, t, gamma):
    """softplus(|x|) = |x| + log1p(e^-|x|): the small part is below half an ulp of |x| past 20
    in float32 (torch's softplus threshold) but only past about 34 in float64, so the value and
    both gradients are correctly rounded there too (torchvision's formula is; 1e-11 off before)."""
    v, dx, dt = mp_reference(x, t, 0.25, gamma)
    out, gx, gt = value_and_grads(
        SF.sigmoid_focal_loss, torch.tensor([x], dtype=torch.float64), torch.tensor([t], dtype=torch.float64),
        gamma=gamma,
    )
    torch.testing.assert_close(out[0].item(), v, rtol=1e-14, atol=0.0)
    torch.testing.assert_close(gx[0].item(), dx, rtol=1e-13, atol=0.0)
    torch.testing.assert_close(gt[0].item(), dt, rtol=1e-13, atol=0.0)
    xv = torch.tensor([x], dtype=torch.float64, requires_grad=True)  # the input-only backward
    SF.sigmoid_focal_loss(xv, torch.tensor([t], dtype=torch.float64), gamma=gamma, reduction="sum").backward()
    torch.testing.assert_close(xv.grad[0].item(), dx, rtol=1e-13, atol=0.0)
