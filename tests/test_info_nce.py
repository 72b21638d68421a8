"""info_nce_loss / InfoNCELoss: CLIP/SimCLR in-batch loss; zero embeddings get gradient 0."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_compiled_matches_eager, tol
from hypothesis import given, settings
from hypothesis import strategies as st
from mask_helpers import D, _gen, _grad
from strategies import finite_floats, tensors, value_and_grads
from torch.autograd import gradcheck, gradgradcheck

import stablelosses as sl
import stablelosses.functional as SF

NAN = float("nan")


def naive_info_nce(q, k, temperature=0.07, symmetric=False, reduction="mean", eps=1e-12):
    """The snippet people write (SimCLR / CLIP): F.normalize + matmul + F.cross_entropy."""
    logits = F.normalize(q, dim=1, eps=eps) @ F.normalize(k, dim=1, eps=eps).T / temperature
    labels = torch.arange(q.shape[0])
    loss = F.cross_entropy(logits, labels, reduction=reduction)
    if symmetric:
        loss = (loss + F.cross_entropy(logits.T, labels, reduction=reduction)) / 2
    return loss


def _ref(q: np.ndarray, k: np.ndarray, tau: float, symmetric: bool) -> np.ndarray:
    """Per-row loss in float64 numpy, a zero vector having cosine 0 with everything."""
    def unit(x):
        n = np.linalg.norm(x, axis=1, keepdims=True)
        return np.where(n == 0, 0.0, x / np.where(n == 0, 1.0, n))

    logits = unit(q) @ unit(k).T / tau

    def ce(z):
        m = z.max(1, keepdims=True)
        return (m[:, 0] + np.log(np.exp(z - m).sum(1))) - np.diag(z)

    return (ce(logits) + ce(logits.T)) / 2 if symmetric else ce(logits)


def test_regression_zero_embedding_gradient():
    q = torch.randn(4, 8)
    k = torch.randn(4, 8)
    q[2] = 0.0  # a collapsed / padded embedding
    _, nq, _ = value_and_grads(naive_info_nce, q, k)
    assert nq[2].abs().max() > 1e9  # F.normalize's 1/eps
    out, gq, gk = value_and_grads(SF.info_nce_loss, q, k, reduction="none")
    assert (gq[2] == 0).all() and torch.isfinite(gk).all()
    assert out[2].item() == pytest.approx(math.log(4))


@pytest.mark.parametrize("symmetric", [False, True])
def test_all_zero_embeddings_give_log_n_and_zero_gradients(symmetric):
    z = torch.zeros(5, 3)
    out, gq, gk = value_and_grads(SF.info_nce_loss, z, z, symmetric=symmetric)
    assert out.item() == pytest.approx(math.log(5))
    assert (gq == 0).all() and (gk == 0).all()


@settings(max_examples=40)
@given(st.integers(1, 5), st.integers(1, 4), st.sampled_from([0.07, 0.5, 1.0]), st.booleans(), st.data())
def test_matches_float64_reference(n, d, tau, symmetric, data):
    q = data.draw(tensors((n, d), torch.float64, elements=finite_floats(torch.float64, max_abs=1e30)))
    k = data.draw(tensors((n, d), torch.float64, elements=finite_floats(torch.float64, max_abs=1e30)))
    out = SF.info_nce_loss(q.float(), k.float(), tau, reduction="none", symmetric=symmetric)
    ref = _ref(q.float().double().numpy(), k.float().double().numpy(), tau, symmetric)
    torch.testing.assert_close(out.double(), torch.from_numpy(ref), rtol=1e-5, atol=1e-4 / tau)
    _, gq, gk = value_and_grads(SF.info_nce_loss, q.float(), k.float(), temperature=tau, symmetric=symmetric)
    assert not torch.isnan(gq).any() and not torch.isnan(gk).any()


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_parity_with_the_torch_snippet(symmetric, reduction):
    q = torch.randn(6, 16)
    k = torch.randn(6, 16)
    ours = value_and_grads(SF.info_nce_loss, q, k, temperature=0.1, symmetric=symmetric, reduction=reduction)
    theirs = value_and_grads(naive_info_nce, q, k, temperature=0.1, symmetric=symmetric, reduction=reduction)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


def test_learnable_temperature_tensor():
    q, k = torch.randn(4, 5), torch.randn(4, 5)
    t1 = torch.tensor(0.2, requires_grad=True)
    t2 = torch.tensor(0.2, requires_grad=True)
    (g1,) = torch.autograd.grad(SF.info_nce_loss(q, k, t1, symmetric=True), t1)
    (g2,) = torch.autograd.grad(naive_info_nce(q, k, t2, symmetric=True), t2)
    torch.testing.assert_close(g1, g2)
    # not read (no host sync): a value <= 0 gives NaN; a tensor without grad is read and refused
    assert torch.isnan(SF.info_nce_loss(q, k, torch.tensor(-0.2, requires_grad=True)))
    with pytest.raises(ValueError, match="info_nce_loss: temperature must be a finite float > 0"):
        SF.info_nce_loss(q, k, torch.tensor(-0.2))


def test_nan_propagates():
    q = torch.randn(3, 4)
    q[1, 2] = NAN
    out = SF.info_nce_loss(q, torch.randn(3, 4), reduction="none")
    assert torch.isnan(out[1])


def test_half_precision(dtype):
    q = torch.randn(8, 32, dtype=dtype) * 100  # float16 squares overflow past 256
    k = torch.randn(8, 32, dtype=dtype) * 100
    out = SF.info_nce_loss(q, k, symmetric=True)
    assert out.dtype == dtype
    ref = _ref(q.double().numpy(), k.double().numpy(), 0.07, True).mean()
    torch.testing.assert_close(out.double(), torch.tensor(ref, dtype=torch.float64),
                               rtol=tol(dtype)["rtol"] * 10, atol=tol(dtype)["atol"] * 10)


def test_gradcheck_gradgradcheck_and_vmap():
    q = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    fn = lambda a, b: SF.info_nce_loss(a, b, 0.5, symmetric=True, reduction="none")  # noqa: E731
    assert gradcheck(fn, (q, k), check_batched_grad=True)
    assert gradgradcheck(fn, (q, k), check_batched_grad=True)
    qs, ks = torch.randn(3, 4, 5, dtype=torch.float64), torch.randn(3, 4, 5, dtype=torch.float64)
    batched = torch.func.vmap(lambda a, b: SF.info_nce_loss(a, b))(qs, ks)
    torch.testing.assert_close(batched, torch.stack([naive_info_nce(a, b, eps=0.0) for a, b in zip(qs, ks)]))


def test_forward_ad():
    # no xfail: cross_entropy has forward-mode AD, so a regression there must fail here
    q = torch.randn(4, 3, dtype=torch.float64)
    k = torch.randn(4, 3, dtype=torch.float64)
    tq, tk = torch.randn_like(q), torch.randn_like(k)
    ours = torch.func.jvp(lambda a, b: SF.info_nce_loss(a, b, symmetric=True), (q, k), (tq, tk))
    theirs = torch.func.jvp(lambda a, b: naive_info_nce(a, b, symmetric=True, eps=0.0), (q, k), (tq, tk))
    torch.testing.assert_close(ours, theirs)
    z = torch.zeros(3, 2, dtype=torch.float64)
    _, t = torch.func.jvp(lambda a: SF.info_nce_loss(a, z), (z,), (torch.ones_like(z),))
    assert t == 0


def test_module_and_errors():
    q, k = torch.randn(3, 4), torch.randn(3, 4)
    mod = sl.InfoNCELoss(temperature=0.2, symmetric=True, reduction="sum")
    torch.testing.assert_close(mod(q, k), SF.info_nce_loss(q, k, 0.2, symmetric=True, reduction="sum"))
    assert "temperature=0.2" in repr(mod) and "symmetric=True" in repr(mod)
    with pytest.raises(ValueError, match=r"info_nce_loss: query and key must both have shape \(N, D\), "
                                         r"got \(3, 4\) and \(2, 4\)"):
        SF.info_nce_loss(q, k[:2])
    with pytest.raises(ValueError, match=r"info_nce_loss: query and key must both have shape \(N, D\)"):
        SF.info_nce_loss(q[0], k[0])
    with pytest.raises(TypeError, match="info_nce_loss: key must be a floating-point tensor"):
        SF.info_nce_loss(q, torch.ones(3, 4, dtype=torch.long))
    for bad in (0.0, -1.0, float("inf"), NAN):
        with pytest.raises(ValueError, match="info_nce_loss: temperature must be a finite float > 0"):
            SF.info_nce_loss(q, k, bad)
    with pytest.raises(TypeError, match="info_nce_loss: temperature must be a float > 0, got str"):
        SF.info_nce_loss(q, k, "0.1")
    with pytest.raises(ValueError, match="info_nce_loss: temperature must be a number or a 0-dim tensor"):
        SF.info_nce_loss(q, k, torch.ones(2))
    with pytest.raises(ValueError, match="info_nce_loss: reduction must be 'none', 'mean' or 'sum', "
                                         "got 'batchmean'"):
        SF.info_nce_loss(q, k, reduction="batchmean")
    with pytest.raises(TypeError, match="info_nce_loss: symmetric must be a bool"):
        SF.info_nce_loss(q, k, symmetric=1)
    with pytest.raises(ValueError, match="InfoNCELoss: temperature must be a finite float > 0"):
        sl.InfoNCELoss(temperature=0.0)
    with pytest.raises(ValueError, match="InfoNCELoss: reduction must be"):
        sl.InfoNCELoss(reduction="avg")
    with pytest.raises(TypeError, match="InfoNCELoss: symmetric must be a bool"):
        sl.InfoNCELoss(symmetric="yes")


@pytest.mark.slow
def test_compile_fullgraph():
    q = torch.randn(4, 3)
    q[1] = 0.0
    k = torch.randn(4, 3)
    g = assert_compiled_matches_eager(lambda a: SF.info_nce_loss(a, k, symmetric=True), q)
    assert (g[1] == 0).all()


def test_export_with_dynamic_batch():
    from torch.export import Dim, export

    n = Dim("N", min=2, max=1024)
    mod = sl.InfoNCELoss(symmetric=True)
    ep = export(mod, (torch.randn(4, 8), torch.randn(4, 8)), dynamic_shapes=({0: n}, {0: n}))
    q, k = torch.randn(7, 8), torch.randn(7, 8)
    q[3] = 0.0
    torch.testing.assert_close(ep.module()(q, k), mod(q, k))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_info_nce_mask_drops_pairs(symmetric, reduction):
    g = _gen(9)
    q = torch.randn(6, 4, generator=g, dtype=D, requires_grad=True)
    k = torch.randn(6, 4, generator=g, dtype=D, requires_grad=True)
    m = torch.tensor([True, True, False, True, False, True])
    got = SF.info_nce_loss(q, k, 0.3, reduction=reduction, symmetric=symmetric, mask=m)
    # reference: torch's formula on the kept pairs only
    qs, ks = F.normalize(q[m]), F.normalize(k[m])
    logits = qs @ ks.T / 0.3
    lab = torch.arange(int(m.sum()))
    want = F.cross_entropy(logits, lab, reduction=reduction)
    if symmetric:
        want = (want + F.cross_entropy(logits.T, lab, reduction=reduction)) / 2
    torch.testing.assert_close(got, want)
    gq, gk = _grad(got, q, k)
    wq, wk = _grad(want, q, k)
    torch.testing.assert_close(gq, wq)
    torch.testing.assert_close(gk, wk)


def test_info_nce_mask_nan_and_none():
    q = torch.randn(4, 3, dtype=D)
    k = torch.randn(4, 3, dtype=D)
    q[1] = NAN
    k[1] = math.inf
    q.requires_grad_()
    m = torch.tensor([True, False, True, True])
    got = SF.info_nce_loss(q, k, mask=m, reduction="none")
    assert got[1] == 0 and torch.isfinite(got).all()
    (gq,) = _grad(got, q)
    assert torch.isfinite(gq).all() and torch.equal(gq[1], torch.zeros(3, dtype=D))
    z = SF.info_nce_loss(q, k, mask=torch.zeros(4, dtype=torch.bool))
    assert z.item() == 0.0
