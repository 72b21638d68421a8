"""dice_loss / DiceLoss: both empty gives 0 with gradient 0; exact small losses; smp/MONAI smoothing."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from conftest import assert_compiled_matches_eager, tol
from hypothesis import given, settings
from hypothesis import strategies as st
from mask_helpers import D, _gen, _grad, _masked_ref
from strategies import value_and_grads
from torch.autograd import gradcheck, gradgradcheck

import stablelosses as sl
import stablelosses.functional as SF

NAN = float("nan")


def naive_dice(p, t, dims=None, smooth=0.0):
    """The hand-written soft Dice loss, per sample (the formula people write)."""
    dims = tuple(range(1, p.ndim)) if dims is None else dims
    inter = (p * t).sum(dims)
    return 1 - (2 * inter + smooth) / (p.sum(dims) + t.sum(dims) + smooth)


def _ref(p: np.ndarray, t: np.ndarray, smooth: float) -> np.ndarray:
    """Float64 numpy per-sample Dice loss over all but axis 0; both empty (no smooth) → 0."""
    axes = tuple(range(1, p.ndim))
    num = 2 * (p * t).sum(axes) + smooth
    den = p.sum(axes) + t.sum(axes) + smooth
    return np.where(den == 0, 0.0, 1 - num / np.where(den == 0, 1.0, den))


def test_regression_both_empty():
    p = torch.zeros(2, 1, 3, 3)
    t = torch.zeros(2, 1, 3, 3)
    t[1, 0, 1, 1] = 1.0
    naive = value_and_grads(naive_dice, p, t)
    assert torch.isnan(naive[0][0]) and torch.isnan(naive[1][0]).all()
    out, gp, gt = value_and_grads(SF.dice_loss, p, t, reduction="none")
    assert out.tolist() == [0.0, 1.0]
    assert (gp[0] == 0).all() and (gt[0] == 0).all()
    torch.testing.assert_close(gp[1], naive[1][1])


@st.composite
def _case(draw):
    shape = draw(st.sampled_from([(2, 3), (3, 1, 2, 2), (1, 5), (4, 2, 3)]))
    n = int(np.prod(shape))
    # no value in (0, 1e-30): a float32 denominator that small makes the gradient (≈ 1/den) overflow
    prob = st.one_of(st.just(0.0), st.just(1.0), st.floats(1e-30, 1))
    p = draw(st.lists(prob, min_size=n, max_size=n))
    t = draw(st.lists(prob, min_size=n, max_size=n))
    p = torch.tensor(p, dtype=torch.float64).reshape(shape)
    t = torch.tensor(t, dtype=torch.float64).reshape(shape)
    if draw(st.booleans()):
        p[0] = 0.0
        t[0] = 0.0  # a both-empty sample
    smooth = draw(st.sampled_from([0.0, 0.0, 1e-5, 1.0]))
    return p, t, smooth


@settings(max_examples=60)
@given(_case(), st.sampled_from([torch.float32, torch.float64]))
def test_matches_float64_reference_and_naive_gradient(case, dtype):
    p, t, smooth = case
    p, t = p.to(dtype).double(), t.to(dtype).double()  # the reference sees the rounded inputs
    out, gp, gt = value_and_grads(SF.dice_loss, p.to(dtype), t.to(dtype), smooth=smooth, reduction="none")
    ref = _ref(p.numpy(), t.numpy(), smooth)
    torch.testing.assert_close(out.double(), torch.from_numpy(ref), **tol(dtype))
    _, rp, rt = value_and_grads(naive_dice, p, t, smooth=smooth)
    den = p.sum(tuple(range(1, p.ndim))) + t.sum(tuple(range(1, p.ndim))) + smooth
    live = den > 0
    # gradients are of order 1/den: compare them in units of that scale
    scale = den.reshape((-1,) + (1,) * (p.ndim - 1)).expand(p.shape)[live]
    torch.testing.assert_close(gp[live].double() * scale, rp[live] * scale, **tol(dtype))
    torch.testing.assert_close(gt[live].double() * scale, rt[live] * scale, **tol(dtype))
    assert (gp[~live] == 0).all() and (gt[~live] == 0).all()


@pytest.mark.parametrize("p_t", [
    ([1e-40] * 4, [0.0] * 4),                       # an empty target, subnormal predictions
    ([1e-40, 3e-40, 0.0, 0.0], [0.0, 2e-40, 1e-45, 0.0]),  # both subnormal
    ([1e-39, 0.5, 0.25, 0.0], [0.0, 1.0, 0.0, 1.0]),  # one subnormal entry in an ordinary sample
], ids=["empty-target", "both-subnormal", "ordinary"])
def test_subnormal_inputs_give_the_float64_gradient(p_t):
    # the gradient ((1 − 2t) − ℓ)/D is formed as one quotient: autograd of diff/D formed
    # (1 − 2t)/D and −ℓ/D apart, each ±inf for a subnormal D, and their sum NaN
    p, t = (torch.tensor([v], dtype=torch.float32) for v in p_t)
    a, b = p.clone().requires_grad_(), t.clone().requires_grad_()
    ga, gb = torch.autograd.grad(SF.dice_loss(a, b), (a, b))
    a64, b64 = p.double().requires_grad_(), t.double().requires_grad_()
    ra, rb = torch.autograd.grad(SF.dice_loss(a64, b64), (a64, b64))
    assert torch.isfinite(ra).all() and torch.isfinite(rb).all()
    torch.testing.assert_close(ga.double(), ra, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gb.double(), rb, rtol=1e-5, atol=1e-6)


def test_small_loss_keeps_full_precision():
    p = torch.ones(1, 1000)
    p[0, 0] = 1 - 2.0**-20
    t = torch.ones(1, 1000)
    exact = 2.0**-20 / (2000 - 2.0**-20)
    assert SF.dice_loss(p, t).item() == pytest.approx(exact, rel=1e-6)
    assert abs(naive_dice(p, t).item() - exact) > 0.5 * exact  # 1 − ratio rounds it away


def test_smooth_is_the_smp_monai_formula_everywhere():
    p = torch.zeros(2, 4)
    t = torch.zeros(2, 4)
    p[1] = torch.tensor([0.2, 0.9, 0.0, 0.4])
    t[1] = torch.tensor([0.0, 1.0, 0.0, 1.0])
    for smooth in (1e-5, 1.0):
        ours = value_and_grads(SF.dice_loss, p, t, smooth=smooth, reduction="none")
        theirs = value_and_grads(naive_dice, p, t, smooth=smooth)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b)
        assert ours[0][0] == 0 and (ours[1][0] == 1 / smooth).all()  # the formula's gradient


def test_reductions_dims_broadcast_and_bool_targets():
    p = torch.rand(3, 2, 4, 4)
    t = torch.rand(3, 2, 4, 4) > 0.5
    per = naive_dice(p, t.float())
    torch.testing.assert_close(SF.dice_loss(p, t, reduction="none"), per)
    torch.testing.assert_close(SF.dice_loss(p, t), per.mean())
    torch.testing.assert_close(SF.dice_loss(p, t, reduction="sum"), per.sum())
    per_class = SF.dice_loss(p, t, dims=(0, 2, 3), reduction="none")  # smp's per-class Dice
    assert per_class.shape == (2,)
    torch.testing.assert_close(per_class, naive_dice(p.transpose(0, 1), t.float().transpose(0, 1)))
    torch.testing.assert_close(SF.dice_loss(p, t[:1]), naive_dice(p, t[:1].float().expand_as(p)).mean())
    flat = naive_dice(p.flatten()[None], t.flatten()[None].float())[0]
    torch.testing.assert_close(SF.dice_loss(p.flatten(), t.flatten(), dims=0), flat)


def test_nan_propagates():
    p = torch.tensor([[NAN, 0.5], [0.0, 0.0]])
    t = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    out, gp, _ = value_and_grads(SF.dice_loss, p, t, reduction="none")
    assert torch.isnan(out[0]) and torch.isnan(gp[0]).all()
    assert out[1] == 0 and (gp[1] == 0).all()


def test_half_precision(dtype):
    p = torch.rand(2, 3, 40, 40, dtype=torch.float64)  # Σ over 4800 entries overflows no float16
    t = (torch.rand(2, 3, 40, 40) > 0.3).double()
    out = SF.dice_loss(p.to(dtype), t.to(dtype))
    assert out.dtype == dtype
    ref = _ref(p.to(dtype).double().numpy(), t.numpy(), 0.0).mean()
    torch.testing.assert_close(out.double(), torch.tensor(ref, dtype=torch.float64), **tol(dtype))
    assert SF.dice_loss(p.half(), t.float()).dtype == torch.float32


def test_gradcheck_gradgradcheck_forward_ad_and_transforms():
    p = torch.rand(3, 2, 3, dtype=torch.float64, requires_grad=True)
    t = torch.rand(3, 2, 3, dtype=torch.float64, requires_grad=True)
    for smooth in (0.0, 0.5):
        fn = lambda a, b, s=smooth: SF.dice_loss(a, b, smooth=s, reduction="none")  # noqa: E731
        assert gradcheck(fn, (p, t), check_batched_grad=True, check_forward_ad=True)
        assert gradgradcheck(fn, (p, t), check_batched_grad=True)
    z = torch.zeros(2, 3, dtype=torch.float64)
    out, tangent = torch.func.jvp(lambda a: SF.dice_loss(a, z), (z,), (torch.ones_like(z),))
    assert out == 0 and tangent == 0
    zz = z.clone().requires_grad_()
    (g,) = torch.autograd.grad(SF.dice_loss(zz, z), zz, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), zz, allow_unused=True)
    assert (g == 0).all() and (h is None or torch.isfinite(h).all())
    batched = torch.func.vmap(lambda a, b: SF.dice_loss(a, b))(p.detach(), t.detach())
    torch.testing.assert_close(batched, naive_dice(p.detach().flatten(0, 1), t.detach().flatten(0, 1))
                               .reshape(3, 2).mean(1))


@pytest.mark.parametrize(("smooth", "message"), [
    (float("inf"), r"smooth must be finite and >= 0, got inf"),
    (1e309, r"smooth must be finite and >= 0, got inf"),
    (float("nan"), r"smooth must be >= 0, got nan"),
    (-1e-300, r"smooth must be >= 0, got -1e-300"),
])
def test_smooth_must_be_finite_and_nonnegative(smooth, message):
    p, t = torch.rand(2, 5), torch.rand(2, 5)
    with pytest.raises(ValueError, match="dice_loss: " + message):
        SF.dice_loss(p, t, smooth=smooth)


def test_module_and_errors():
    p, t = torch.rand(2, 5), torch.rand(2, 5)
    mod = sl.DiceLoss(smooth=1.0, reduction="sum")
    torch.testing.assert_close(mod(p, t), SF.dice_loss(p, t, smooth=1.0, reduction="sum"))
    assert "smooth=1.0" in repr(mod) and "reduction='sum'" in repr(mod)
    with pytest.raises(ValueError, match="dice_loss: reduction must be 'none', 'mean' or 'sum', got 'avg'"):
        SF.dice_loss(p, t, reduction="avg")
    with pytest.raises(ValueError, match="DiceLoss: reduction must be"):
        sl.DiceLoss(reduction="batchmean")
    with pytest.raises(ValueError, match="dice_loss: smooth must be >= 0, got -1"):
        SF.dice_loss(p, t, smooth=-1.0)
    with pytest.raises(ValueError, match="DiceLoss: smooth must be >= 0"):
        sl.DiceLoss(smooth=-0.5)
    with pytest.raises(TypeError, match="dice_loss: input must be a floating-point tensor"):
        SF.dice_loss(torch.ones(2, 5, dtype=torch.long), t)
    with pytest.raises(TypeError, match="dice_loss: target must be a torch.Tensor"):
        SF.dice_loss(p, 1.0)
    with pytest.raises(ValueError, match=r"dice_loss: target of shape \(3, 5\) does not broadcast to input"):
        SF.dice_loss(p, torch.rand(3, 5))
    with pytest.raises(ValueError, match=r"dice_loss: input must have a batch dimension .* pass dims="):
        SF.dice_loss(torch.rand(5), torch.rand(5))
    with pytest.raises(ValueError, match="dice_loss: dims must name at least one dimension"):
        SF.dice_loss(p, t, dims=())
    with pytest.raises(ValueError, match="dice_loss: dims has repeated dimensions"):
        SF.dice_loss(p, t, dims=(1, -1))
    with pytest.raises(IndexError, match="dice_loss: dims out of range"):
        SF.dice_loss(p, t, dims=2)


@pytest.mark.slow
def test_compile_fullgraph():
    p = torch.zeros(3, 4)
    p[1] = torch.tensor([0.1, 0.9, 0.3, 0.0])
    t = torch.zeros(3, 4)
    t[1:] = torch.tensor([0.0, 1.0, 1.0, 0.0])
    g = assert_compiled_matches_eager(lambda a: SF.dice_loss(a, t), p)
    assert (g[0] == 0).all()


def test_export_with_dynamic_batch():
    from torch.export import Dim, export

    b = Dim("B", min=1, max=1024)
    mod = sl.DiceLoss()
    ep = export(mod, (torch.rand(3, 1, 4, 4), torch.rand(3, 1, 4, 4)), dynamic_shapes=({0: b}, {0: b}))
    p = torch.rand(9, 1, 4, 4)
    t = (torch.rand(9, 1, 4, 4) > 0.5).float()
    p[2] = 0.0
    t[2] = 0.0
    torch.testing.assert_close(ep.module()(p, t), mod(p, t))


def test_docstring_does_not_claim_smp_smoothing():
    # smp >= 0.4's smooth=s is our 2s and smp scores per class over the batch: the 0.2
    # docstring said "the smoothed formula of segmentation_models_pytorch"
    doc = SF.dice_loss.__doc__
    assert "formula of segmentation_models_pytorch" not in doc
    assert "smooth=2s" in doc and "each class over the whole batch" in doc


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_dice_mask_selects_samples(reduction):
    g = _gen(8)
    p = torch.rand(4, 2, 3, generator=g, dtype=D, requires_grad=True)
    tgt = (torch.rand(4, 2, 3, generator=g) < 0.5).to(D)
    m = torch.tensor([True, False, True, True])
    pn = p.detach().clone()
    pn[1] = NAN
    pn.requires_grad_()
    got = SF.dice_loss(pn, tgt, reduction=reduction, mask=m)
    inter = (p * tgt).sum((1, 2))
    ref = 1 - 2 * inter / (p.sum((1, 2)) + tgt.sum((1, 2)))  # the textbook formula, float64
    want = _masked_ref(ref, m, reduction)
    torch.testing.assert_close(got, want)
    (gp,) = _grad(got, pn)
    assert torch.isfinite(gp).all() and torch.equal(gp[1], torch.zeros(2, 3, dtype=D))
    torch.testing.assert_close(gp, _grad(want, p)[0])


def test_dice_mask_with_dims_and_all_false():
    p = torch.rand(2, 3, 4, dtype=D, requires_grad=True)
    tgt = torch.rand(2, 3, 4, dtype=D)
    m = torch.tensor([[True, False, True]])  # per (N, C) loss with dims=2
    got = SF.dice_loss(p, tgt, dims=2, reduction="none", mask=m)
    want = torch.where(m, SF.dice_loss(p, tgt, dims=2, reduction="none"), 0.0)
    torch.testing.assert_close(got, want)
    z = SF.dice_loss(p, tgt, mask=torch.zeros(2, dtype=torch.bool))
    assert z.item() == 0.0 and torch.equal(_grad(z, p)[0], torch.zeros_like(p))


def _smp_dice_loss(p, t, smooth, eps=1e-7):
    """segmentation_models_pytorch >= 0.4's ``DiceLoss(mode="multilabel", from_logits=False,
    smooth=smooth)``, transcribed: each class over the whole batch, a Tversky score with
    alpha = beta = 1/2 whose intersection is (Σp + Σt − ‖p − t‖₁) / 2, a class without target
    pixels contributing 0, the mean over the classes."""
    n, c = p.shape[:2]
    p, t = p.reshape(n, c, -1), t.reshape(n, c, -1)
    dims = (0, 2)
    ps, ts = p.sum(dims), t.sum(dims)
    inter = (ps + ts - torch.linalg.vector_norm(p - t, ord=1, dim=dims)) / 2
    fp, fn = ps - inter, ts - inter
    score = (inter + smooth) / (inter + 0.5 * fp + 0.5 * fn + smooth).clamp_min(eps)
    return ((1.0 - score) * (ts > 0).to(score.dtype)).mean()


def _docstring_recipe() -> str:
    doc = SF.dice_loss.__doc__
    return textwrap.dedent(doc.split("```python")[1].split("```")[0]).strip()


@pytest.mark.parametrize("smooth", [0.0, 0.5, 1.0, 3.0])
def test_the_docstrings_smp_recipe_gives_smps_loss(smooth):
    g = torch.Generator().manual_seed(4)
    p = torch.rand(3, 4, 5, 6, generator=g, dtype=torch.float64)
    t = (torch.rand(3, 4, 5, 6, generator=g) > 0.6).double()
    t[:, 2] = 0  # a class without target pixels: smp drops it from its mean's numerator
    recipe = _docstring_recipe()
    got = eval(recipe, {"dice_loss": SF.dice_loss, "p": p, "t": t, "s": smooth})  # noqa: S307
    torch.testing.assert_close(got, _smp_dice_loss(p, t, smooth), rtol=1e-12, atol=0)
    # smp's smooth is not ours: the same number without the factor 2 differs
    if smooth > 0:
        ours_as_is = eval(recipe.replace("2 * s", "s"), {"dice_loss": SF.dice_loss, "p": p, "t": t, "s": smooth})
        assert not torch.allclose(ours_as_is, _smp_dice_loss(p, t, smooth))
