"""cosine_embedding_loss: a zero vector gets gradient 0 (torch: −5.8e5 per element for D = 3);
torch's value and gradient elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import stablelosses.functional as SF


@pytest.mark.parametrize("target", [1.0, -1.0])
def test_zero_vector_gives_gradient_zero(target):
    x1 = torch.zeros(1, 3, requires_grad=True)
    x2 = torch.ones(1, 3, requires_grad=True)
    y = torch.tensor([target])
    out = SF.cosine_embedding_loss(x1, x2, y, margin=-0.5)
    torch.testing.assert_close(out, F.cosine_embedding_loss(x1, x2, y, margin=-0.5))
    out.backward()
    assert (x1.grad == 0).all() and (x2.grad == 0).all()
    x1t = x1.detach().clone().requires_grad_()
    F.cosine_embedding_loss(x1t, x2.detach(), y, margin=-0.5).backward()
    if target == 1.0:  # torch's: x2/(1e-6·‖x2‖) ≈ −5.8e5 per element
        assert x1t.grad.abs().min() > 5e5


def test_both_zero_and_zero_in_one_row_only():
    x1 = torch.tensor([[0.0, 0.0], [1.0, 2.0]], requires_grad=True)
    x2 = torch.tensor([[0.0, 0.0], [2.0, -1.0]], requires_grad=True)
    y = torch.tensor([1.0, 1.0])
    out = SF.cosine_embedding_loss(x1, x2, y, reduction="none")
    torch.testing.assert_close(out, F.cosine_embedding_loss(x1, x2, y, reduction="none"))
    out.sum().backward()
    assert (x1.grad[0] == 0).all() and (x2.grad[0] == 0).all()
    a, b = x1.detach()[1:].clone().requires_grad_(), x2.detach()[1:].clone().requires_grad_()
    F.cosine_embedding_loss(a, b, y[1:], reduction="sum").backward()
    torch.testing.assert_close(x1.grad[1:], a.grad)
    torch.testing.assert_close(x2.grad[1:], b.grad)


def test_gradcheck_and_gradgradcheck_at_generic_points():
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    f = lambda a, b: SF.cosine_embedding_loss(a, b, y, margin=-0.2, reduction="none")  # noqa: E731
    assert torch.autograd.gradcheck(f, (x1, x2), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(f, (x1, x2))


def test_nan_in_nan_out():
    out = SF.cosine_embedding_loss(torch.tensor([[float("nan"), 0.0]]), torch.ones(1, 2), torch.tensor([1.0]))
    assert torch.isnan(out)


def test_dimension_errors_are_torchs_and_name_the_arguments():
    for a, b, y in [(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.ones(2)),
                    (torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 1))]:
        with pytest.raises(RuntimeError):
            F.cosine_embedding_loss(a, b, y)
        with pytest.raises(RuntimeError, match="cosine_embedding_loss: .*(input1|target)"):
            SF.cosine_embedding_loss(a, b, y)


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.int64), (torch.int64, torch.bfloat16),
                                    (torch.int64, torch.int64), (torch.float16, torch.float16)], ids=str)
@pytest.mark.parametrize("target_dtype", [torch.float32, torch.int64])
def test_mixed_integer_and_half_dtype_is_torchs(dtypes, target_dtype):
    # torch's formula: an integer input's x·x + EPSILON is the default float dtype (float32)
    x1, x2 = ((torch.rand(4, 3) * 4 + 1).to(d) for d in dtypes)
    y = torch.tensor([1, -1, 1, -1]).to(target_dtype)
    expected = F.cosine_embedding_loss(x1, x2, y)
    got = SF.cosine_embedding_loss(x1, x2, y)
    assert got.dtype == expected.dtype
    exact = F.cosine_embedding_loss(x1.double(), x2.double(), y)
    torch.testing.assert_close(got.double(), exact, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("scale", [1e10, 1e17, 1e-20], ids=["1e10", "1e17", "small"])
def test_large_vectors_do_not_overflow(scale):
    # torch's product of the two squared norms overflows float32 from norms of about 1e10: a
    # cosine of 0 (inf in the denominator) or NaN where the cosine is representable; with the
    # roots taken apart it is the float64 value (up to norms of about 1.8e19, torch's Σx²)
    x1 = torch.tensor([[3.0, 4.0], [1.0, -2.0]]) * scale
    x2 = torch.tensor([[4.0, 3.0], [2.0, 2.0]]) * scale
    y = torch.tensor([1.0, -1.0])
    a, b = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    loss = SF.cosine_embedding_loss(a, b, y, margin=-0.5, reduction="none")
    ga, gb = torch.autograd.grad(loss.sum(), (a, b))
    a64, b64 = x1.double().requires_grad_(), x2.double().requires_grad_()
    ref = F.cosine_embedding_loss(a64, b64, y.double(), margin=-0.5, reduction="none")
    ra, rb = torch.autograd.grad(ref.sum(), (a64, b64))
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ga.double(), ra, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(gb.double(), rb, rtol=1e-5, atol=0.0)
    if scale > 1:  # torch's own float32 result is not
        theirs = F.cosine_embedding_loss(x1, x2, y, margin=-0.5, reduction="none").double()
        assert not torch.allclose(theirs, ref, rtol=1e-3, equal_nan=False)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_nan_target_gives_nan(reduction):
    # torch reads a NaN target as neither 1 nor -1: a loss of 0
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(3, 4, generator=g, requires_grad=True)
    x2 = torch.randn(3, 4, generator=g)
    y = torch.tensor([float("nan"), 1.0, -1.0])
    assert torch.isfinite(F.cosine_embedding_loss(x1, x2, y, reduction=reduction)).all()
    out = SF.cosine_embedding_loss(x1, x2, y, reduction=reduction)
    if reduction == "none":
        assert torch.isnan(out[0])
        assert torch.equal(out[1:], SF.cosine_embedding_loss(x1[1:], x2[1:], y[1:], reduction="none"))
    else:
        assert torch.isnan(out)
    (grad,) = torch.autograd.grad(out.nansum(), x1)
    assert torch.isfinite(grad[1:]).all()
    assert torch.isnan(SF.cosine_embedding_loss(x1[0], x2[0], y[0]))  # a 0-dim target too


@pytest.mark.parametrize("target", [1.0, -1.0])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_one_pair_forward_mode_tangent_keeps_the_input_dtype(target, reduction):
    # (D,) vectors and a 0-d target: the 0-d intermediates with Python floats got a float64
    # tangent under forward AD (torch 2.13), torch's own is float32
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, generator=g), torch.randn(5, generator=g)
    y = torch.tensor(target)

    def tangent(f):
        return torch.func.jvp(lambda v: f(v, b, y, margin=0.5, reduction=reduction), (a,), (torch.ones(5),))

    (v, t), (v_ref, t_ref) = tangent(SF.cosine_embedding_loss), tangent(F.cosine_embedding_loss)
    assert t.dtype == t_ref.dtype == torch.float32 and v.dtype == torch.float32
    torch.testing.assert_close(t, t_ref)
    torch.testing.assert_close(v, v_ref)
