"""token_logps, sequence_logps and their linear forms (the token log-prob head on the chunk
engine): the float64 log-softmax gathered at the labels, ignored positions 0 with gradient 0
whatever their row holds, ``-inf`` logits, the exact tail against mpmath, entropy, gradcheck,
transforms, compile, the argument checks."""

from __future__ import annotations

import mpmath
import pytest
import torch
from conftest import assert_compiled_matches_eager
from hypothesis import given, settings
from hypothesis import strategies as st

import stablelosses.functional as SF

mpmath.mp.dps = 50
D = torch.float64
INF = float("inf")


def ref_token_logps(x, labels, ignore_index=-100, temperature=1.0):
    """The float64 log-softmax of the logits over T at the labels; 0 where ignored."""
    lsm = torch.log_softmax(x.double() / temperature, -1)
    valid = labels != ignore_index
    lt = lsm.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, lt, 0.0)


def ref_entropy(x, labels, ignore_index=-100):
    lsm = torch.log_softmax(x.double(), -1)
    p = lsm.exp()
    h = -torch.where(p > 0, p * lsm, 0.0).sum(-1)
    return torch.where(labels != ignore_index, h, 0.0)


def _data(shape=(2, 4, 7), dtype=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(*shape, generator=g, dtype=D)).to(dtype).requires_grad_()
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    labels[0, 1] = -100
    labels[-1, -1] = -100
    return x, labels


# --- token_logps --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float64, 1e-12, 1e-13), (torch.float32, 1e-5, 1e-6)])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_token_logps_matches_float64_reference(dtype, rtol, atol, temperature):
    x, labels = _data(dtype=dtype)
    out = SF.token_logps(x, labels, temperature=temperature)
    assert out.shape == labels.shape and out.dtype == dtype
    x64 = x.detach().double().requires_grad_()
    want = ref_token_logps(x64, labels, temperature=temperature)
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol)
    gout = torch.randn(labels.shape, dtype=D)
    (g,) = torch.autograd.grad((out * gout.to(dtype)).sum(), x)
    (g_ref,) = torch.autograd.grad((want * gout).sum(), x64)
    torch.testing.assert_close(g.double(), g_ref, rtol=rtol, atol=atol)


def test_ignored_position_is_zero_with_zero_gradient_whatever_its_row_holds():
    x = torch.tensor([[0.0, 1.0, 2.0], [-INF, -INF, -INF], [1e30, -1e30, 0.0], [INF, 0.0, -INF]],
                     requires_grad=True)
    labels = torch.tensor([2, -100, -100, -100])
    out = SF.token_logps(x, labels)
    assert torch.equal(out[1:], torch.zeros(3))
    (g,) = torch.autograd.grad(out.sum(), x)
    assert torch.all(g[1:] == 0)
    assert torch.isfinite(g).all()
    # the hand-written masked gather is NaN there
    naive = torch.log_softmax(x, -1).gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1)
    (gn,) = torch.autograd.grad((naive * (labels != -100)).sum(), x)
    assert torch.isnan(gn).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ignored_position_holding_nan_is_zero_with_zero_gradient(dtype):
    # "whatever its row holds" includes NaN: a padded row of garbage (both NaN signs: 0/0 is
    # a negative NaN on x86, float("nan") a positive one)
    nan = torch.tensor(float("nan"), dtype=dtype)
    x = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [INF, 0.0, 0.0]], dtype=dtype)
    x[1, 0], x[2, 1], x[3, 2] = nan, -nan, nan
    x.requires_grad_()
    labels = torch.tensor([2, -100, -100, -100])
    for fn in (lambda x: SF.token_logps(x, labels), lambda x: SF.sequence_logps(x[None], labels[None])):
        out = fn(x)
        (g,) = torch.autograd.grad(out.sum(), x)
        assert torch.isfinite(out).all() and torch.isfinite(g).all()
        assert torch.all(g[1:] == 0)
    torch.testing.assert_close(SF.token_logps(x, labels)[0], torch.log_softmax(x[0], -1)[2])
    # the unignored NaN row stays NaN, value and gradient
    out = SF.token_logps(x, torch.tensor([2, 0, -100, -100]))
    (g,) = torch.autograd.grad(out.sum(), x)
    assert torch.isnan(out[1]) and torch.isnan(g[1]).all() and torch.all(g[2:] == 0)
    # double backward: 0 there too
    (g,) = torch.autograd.grad(SF.token_logps(x, labels).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g[0].sum(), x)
    assert torch.all(gg[1:] == 0)


def test_neg_inf_logits_and_a_label_at_neg_inf():
    x = torch.tensor([[0.0, -INF, 1.0], [0.0, -INF, 1.0]], dtype=D, requires_grad=True)
    labels = torch.tensor([0, 1])
    out = SF.token_logps(x, labels)
    want = ref_token_logps(x.detach(), labels)
    assert out[0].item() == pytest.approx(want[0].item(), rel=1e-14)
    assert out[1].item() == -INF  # the true value
    (g,) = torch.autograd.grad(out[1], x)
    p = torch.softmax(x.detach()[1], -1)
    torch.testing.assert_close(g[1], torch.tensor([0.0, 1.0, 0.0], dtype=D) - p)  # onehot − p, finite
    assert torch.all(g[0] == 0)


def test_fully_masked_row_counts_as_ignored():
    x = torch.full((1, 4), -INF, requires_grad=True)
    out = SF.token_logps(x, torch.tensor([2]))
    (g,) = torch.autograd.grad(out.sum(), x)
    assert out.item() == 0.0 and torch.all(g == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gap", [10.0, 20.0, 30.0, 60.0])
def test_exact_tail_as_p_t_goes_to_one(gap, dtype):
    x = torch.tensor([[gap, 0.0, -1.0, 0.5]], dtype=dtype)
    out = SF.token_logps(x, torch.tensor([0]))
    row = [mpmath.mpf(v) for v in (gap, 0.0, -1.0, 0.5)]
    want = float(row[0] - mpmath.log(sum(mpmath.exp(v) for v in row)))
    assert out.item() == pytest.approx(want, rel=4 * torch.finfo(dtype).eps)
    assert out.item() < 0  # x_t − lse rounds to 0 here; the tail does not


@settings(max_examples=30, deadline=None)
@given(data=st.data(), v=st.integers(1, 6), n=st.integers(0, 5))
def test_masks_and_ignored_rows_never_give_nan(data, v, n):
    vals = st.sampled_from([-INF, 0.0, 1.0, -3.0, 1e30, -1e30, 80.0]) | st.floats(-50, 50)
    x = torch.tensor(data.draw(st.lists(st.lists(vals, min_size=v, max_size=v), min_size=n, max_size=n)),
                     dtype=torch.float32).reshape(n, v).requires_grad_()
    labels = torch.tensor(data.draw(st.lists(st.sampled_from([-100, *range(v)]), min_size=n, max_size=n)),
                          dtype=torch.long).reshape(n)
    out = SF.token_logps(x, labels)
    (g,) = torch.autograd.grad(out.sum(), x)
    assert not torch.isnan(out).any()
    assert torch.isfinite(g).all()
    assert torch.all(g[labels == -100] == 0)
    assert torch.all(out[labels == -100] == 0)
    # against the float64 reference wherever the row is finite and not fully masked
    finite_rows = torch.isfinite(x.detach()).all(-1) & (labels != -100)
    if finite_rows.any():
        want = ref_token_logps(x.detach()[finite_rows], labels[finite_rows])
        torch.testing.assert_close(out.detach()[finite_rows].double(), want, rtol=1e-5, atol=1e-5)


def test_gradcheck_and_gradgradcheck_float64():
    x, labels = _data(shape=(2, 3, 5))
    assert torch.autograd.gradcheck(lambda z: SF.token_logps(z, labels, temperature=0.7), (x,))
    assert torch.autograd.gradgradcheck(lambda z: SF.sequence_logps(z, labels, average=True), (x,))


def test_vmap_and_func_grad():
    x, labels = _data(shape=(3, 4, 5))
    f = lambda z: SF.sequence_logps(z, labels[0], average=True).sum()  # noqa: E731
    out = torch.vmap(f)(x.detach())
    torch.testing.assert_close(out, torch.stack([f(x.detach()[i]) for i in range(3)]))
    g = torch.func.grad(f)(x.detach()[0])
    (g_ref,) = torch.autograd.grad(f(x[0]), x)
    torch.testing.assert_close(g, g_ref[0])


def test_linear_forms_under_vmap_and_forward_mode_equal_the_logits_forms():
    # the chunk engine has no batching rule and no tangent: vmap and forward mode take the
    # logits whole (torch.func.hessian is forward over reverse)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 3, 8, generator=g, dtype=torch.float64)
    w = torch.randn(11, 8, generator=g, dtype=torch.float64)
    b = torch.randn(11, generator=g, dtype=torch.float64)
    b[4] = -float("inf")  # a label at a -inf logit: -inf with a finite gradient
    labels = torch.tensor([[1, 2, -100], [4, -100, 7]])

    def fused(z):
        logp, ent = SF.linear_token_logps(z, w, labels, linear_bias=b, temperature=0.7, return_entropy=True)
        return logp.clamp_min(-1e3) + ent

    def plain(z):
        u = (z @ w.T + b) / 0.7
        ent = torch.where(labels != -100, SF.entropy(u), 0.0)
        return SF.token_logps(u, labels).clamp_min(-1e3) + ent

    batch = h[None].expand(3, 2, 3, 8) + torch.arange(3.0, dtype=torch.float64)[:, None, None, None]
    torch.testing.assert_close(torch.vmap(fused)(batch), torch.vmap(plain)(batch))
    v = torch.randn(h.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(torch.func.jvp(fused, (h,), (v,)), torch.func.jvp(plain, (h,), (v,)))
    seq = lambda z: SF.linear_sequence_logps(z, w[:4], labels.clamp(max=3), average=True).sum()  # noqa: E731
    ref = lambda z: SF.sequence_logps(z @ w[:4].T, labels.clamp(max=3), average=True).sum()  # noqa: E731
    torch.testing.assert_close(torch.func.hessian(seq)(h), torch.func.hessian(ref)(h))


@pytest.mark.parametrize("entropy", [False, True])
def test_linear_forms_double_backward(entropy):
    # a backward with create_graph=True recomputes the logits whole: gradgradcheck passes (it
    # raised), and the second derivatives are the logits forms'
    g = torch.Generator().manual_seed(6)
    h = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[1, 2, -100], [4, -100, 5]])

    def fused(h, w):
        out = SF.linear_token_logps(h, w, labels, temperature=0.7, return_entropy=entropy)
        return out[1] if entropy else SF.linear_sequence_logps(h, w, labels, average=True, temperature=0.7)

    def plain(h, w):
        u = (h @ w.T) / 0.7
        if entropy:
            return torch.where(labels != -100, SF.entropy(u), 0.0)
        return SF.sequence_logps(u, labels, average=True)

    assert torch.autograd.gradgradcheck(fused, (h, w))
    hf = torch.autograd.functional.hessian(lambda z: fused(z, w).sum(), h)
    torch.testing.assert_close(hf, torch.autograd.functional.hessian(lambda z: plain(z, w).sum(), h))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_logits_are_computed_in_float32(dtype):
    x, labels = _data(dtype=dtype)
    out = SF.token_logps(x, labels)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref_token_logps(x.detach().float(), labels).float(), rtol=1e-5, atol=1e-5)
    (g,) = torch.autograd.grad(out.sum(), x)
    assert g.dtype == dtype


# --- sequence_logps -----------------------------------------------------------------------------


@pytest.mark.parametrize("average", [False, True])
def test_sequence_logps_sum_and_mean(average):
    x, labels = _data()
    labels[1] = -100  # an empty sequence
    out = SF.sequence_logps(x, labels, average=average)
    tok = ref_token_logps(x.detach(), labels)
    n = (labels != -100).sum(-1).clamp(min=1)
    want = tok.sum(-1) / n if average else tok.sum(-1)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-13)
    (g,) = torch.autograd.grad(out.sum(), x)
    assert out[1].item() == 0.0 and torch.all(g[1] == 0)


# --- the linear forms ---------------------------------------------------------------------------


def _linear(n_rows=(2, 5), h=6, v=11, dtype=D, bias=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*n_rows, h, generator=g, dtype=D).to(dtype).requires_grad_()
    w = torch.randn(v, h, generator=g, dtype=D).to(dtype).requires_grad_()
    b = torch.randn(v, generator=g, dtype=D).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, n_rows, generator=g)
    labels[0, 1] = -100
    return x, w, b, labels


def _unfused(x, w, b):
    u = x.double() @ w.double().T
    return u if b is None else u + b.double()


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
@pytest.mark.parametrize("temperature", [1.0, 0.6, torch.tensor(1.7)])
def test_linear_token_logps_and_entropy_match_the_unfused_reference(chunk_size, temperature):
    x, w, b, labels = _linear()
    lp, ent = SF.linear_token_logps(x, w, labels, linear_bias=b, temperature=temperature, chunk_size=chunk_size,
                                    return_entropy=True)
    copies = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    u = _unfused(*copies) / temperature
    want_lp, want_h = ref_token_logps(u, labels), ref_entropy(u, labels)
    torch.testing.assert_close(lp, want_lp, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(ent, want_h, rtol=1e-12, atol=1e-13)
    g1, g2 = torch.randn(labels.shape, dtype=D), torch.randn(labels.shape, dtype=D)
    grads = torch.autograd.grad((lp * g1).sum() + (ent * g2).sum(), (x, w, b))
    want = torch.autograd.grad((want_lp * g1).sum() + (want_h * g2).sum(), copies)
    for a, c in zip(grads, want):
        torch.testing.assert_close(a, c, rtol=1e-11, atol=1e-12)


def test_linear_forms_equal_the_logits_forms():
    x, w, b, labels = _linear(dtype=torch.float32)
    u = x @ w.T + b
    torch.testing.assert_close(SF.linear_token_logps(x, w, labels, linear_bias=b), SF.token_logps(u, labels))
    for average in (False, True):
        torch.testing.assert_close(SF.linear_sequence_logps(x, w, labels, linear_bias=b, average=average),
                                   SF.sequence_logps(u, labels, average=average))


def test_linear_entropy_is_finite_with_neg_inf_logits():
    # a -inf bias masks vocabulary entries: the nan_to_num spelling has a NaN gradient (TRL #7221)
    x, w, b, labels = _linear(dtype=torch.float32)
    b = b.detach().clone()
    b[[0, 3, 4]] = -INF
    labels = torch.where((labels == 0) | (labels == 3) | (labels == 4), 2, labels)
    lp, ent = SF.linear_token_logps(x, w, labels, linear_bias=b, return_entropy=True)
    grads = torch.autograd.grad(lp.sum() + ent.sum(), (x, w))
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert all(torch.isfinite(g).all() for g in grads)
    u = (x @ w.T + b).detach()
    torch.testing.assert_close(ent, ref_entropy(u, labels).float(), rtol=1e-5, atol=1e-5)
    # the naive entropy with nan_to_num
    x2 = x.detach().clone().requires_grad_()
    p = torch.softmax(x2 @ w.detach().T + b, -1)
    naive = -(p * torch.log(p)).nan_to_num().sum()
    (gn,) = torch.autograd.grad(naive, x2)
    assert torch.isnan(gn).any()


def test_linear_ignored_rows_and_empty_sequence_have_zero_gradient():
    x, w, b, labels = _linear()
    labels[1] = -100
    out = SF.linear_sequence_logps(x, w, labels, linear_bias=b, average=True)
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert out[1].item() == 0.0
    assert torch.all(gx[1] == 0) and torch.all(gx[0, 1] == 0)


@pytest.mark.parametrize("chunk_bytes", [8, 8 * 4 * 3, 10**9])  # one column, 3-wide blocks, one block
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [None, 1, 5])
def test_linear_vocabulary_blocks_match_the_unfused_reference(monkeypatch, chunk_bytes, temperature, chunk_size):
    # the blockwise head's lse over blocks, the label in any block (the last one narrower), whole
    # blocks of -inf logits, an ignored row whose hidden state is NaN (gradient 0, dW finite),
    # and a fully ignored sequence
    import stablelosses._autograd.linear as engine

    monkeypatch.setattr(engine, "CHUNK_BYTES", chunk_bytes)
    x, w, b, labels = _linear(n_rows=(3, 4), v=11)
    b = b.detach().clone()
    b[[2, 3, 4, 5]] = -INF
    b.requires_grad_()
    labels = torch.where(torch.isin(labels, torch.tensor([2, 3, 4, 5])), 10, labels)
    labels[2] = -100
    with torch.no_grad():
        x[0, 1] = torch.nan  # labels[0, 1] is ignored
    out = SF.linear_sequence_logps(x, w, labels, linear_bias=b, temperature=temperature, chunk_size=chunk_size,
                                   average=True)
    g = torch.randn(3, dtype=D)
    grads = torch.autograd.grad((out * g).sum(), (x, w, b))
    copies = [x.detach().nan_to_num(0.0).requires_grad_(), w.detach().clone().requires_grad_(),
              b.detach().clone().requires_grad_()]
    want = SF.sequence_logps(_unfused(*copies) / temperature, labels, average=True)
    want_grads = torch.autograd.grad((want * g).sum(), copies)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-13)
    for a, c in zip(grads, want_grads):
        torch.testing.assert_close(a, c, rtol=1e-11, atol=1e-12)
    assert out[2].item() == 0.0 and torch.all(grads[0][0, 1] == 0) and torch.all(grads[0][2] == 0)


def test_linear_out_of_range_label_raises_in_any_block(monkeypatch):
    import stablelosses._autograd.linear as engine

    monkeypatch.setattr(engine, "CHUNK_BYTES", 8 * 4 * 3)
    x, w, b, labels = _linear(n_rows=(2, 5), v=11)
    for bad in (11, -3):
        labels[1, 2] = bad
        with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):  # as token_logps
            SF.linear_token_logps(x, w, labels, linear_bias=b)


def test_linear_gradcheck_float64():
    x, w, b, labels = _linear(n_rows=(2, 3), h=4, v=5)
    assert torch.autograd.gradcheck(
        lambda a, c, d: SF.linear_token_logps(a, c, labels, linear_bias=d, return_entropy=True, chunk_size=2),
        (x, w, b))


def test_linear_bfloat16_weight():
    x, w, b, labels = _linear(dtype=torch.bfloat16)
    out = SF.linear_sequence_logps(x, w, labels, linear_bias=b)
    assert out.dtype == torch.float32
    want = ref_token_logps(_unfused(x.detach().float(), w.detach().float(), b.detach().float()), labels).sum(-1)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
    gx, gw = torch.autograd.grad(out.sum(), (x, w))
    assert gx.dtype == gw.dtype == torch.bfloat16


# --- arguments and compile ----------------------------------------------------------------------

_X, _L = torch.randn(2, 3, 5), torch.tensor([[0, 1, 2], [3, 4, -100]])
_H, _W = torch.randn(2, 3, 4), torch.randn(5, 4)


@pytest.mark.parametrize("bad, error, match", [
    (lambda: SF.token_logps(_X, _L.float()), TypeError, "token_logps: labels must be an integer"),
    (lambda: SF.token_logps(_X, _L[:, :2]), ValueError, "token_logps: labels shape"),
    (lambda: SF.token_logps(_X.long(), _L), TypeError, "token_logps: logits must be a floating"),
    (lambda: SF.token_logps(_X, _L, temperature=0.0), ValueError, "token_logps: temperature must be"),
    (lambda: SF.token_logps(_X, _L, temperature=torch.tensor(-1.0)), ValueError, "token_logps: temperature must be"),
    (lambda: SF.sequence_logps(_X, _L, temperature=torch.tensor(0.0)), ValueError, "sequence_logps: temperature must"),
    (lambda: SF.token_logps(_X, _L, ignore_index=True), TypeError, "token_logps: ignore_index must be an int"),
    (lambda: SF.token_logps(torch.randn(2, 0), torch.zeros(2, dtype=torch.long)), ValueError, "at least one"),
    (lambda: SF.token_logps(_X, torch.full((2, 3), 7)), IndexError, "token_logps: Target 7 is out of bounds"),
    (lambda: SF.sequence_logps(_X, torch.full((2, 3), 7)), IndexError, "sequence_logps: Target 7 is out of"),
    (lambda: SF.sequence_logps(_X, _L, average=1), TypeError, "sequence_logps: average must be a bool"),
    (lambda: SF.sequence_logps(torch.randn(5), torch.tensor(1)), ValueError, "sequence_logps: labels must have"),
    (lambda: SF.linear_token_logps(_H, _W.T, _L), ValueError, "linear_token_logps: input's last dimension"),
    (lambda: SF.linear_token_logps(_H, _W[None], _L), ValueError, "linear_token_logps: linear_weight must be"),
    (lambda: SF.linear_token_logps(_H, _W, _L, linear_bias=torch.zeros(4)), ValueError, "linear_bias shape"),
    (lambda: SF.linear_token_logps(_H, _W, _L, chunk_size=0), ValueError, "chunk_size must be >= 1"),
    (lambda: SF.linear_token_logps(_H, _W, _L, return_entropy="yes"), TypeError, "return_entropy must be a bool"),
    (lambda: SF.linear_sequence_logps(_H, _W, _L[:, :1]), ValueError, "linear_sequence_logps: labels shape"),
])
def test_argument_checks(bad, error, match):
    with pytest.raises(error, match=match):
        bad()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["token_logps", "sequence_logps", "linear_token_logps", "linear_sequence_logps"])
def test_compiles_fullgraph(name):
    x, labels = _data(dtype=torch.float32)
    h, w, _, lab = _linear(dtype=torch.float32)
    fns = {
        "token_logps": (lambda z: SF.token_logps(z, labels, temperature=0.5).sum(), x),
        "sequence_logps": (lambda z: SF.sequence_logps(z, labels, average=True).sum(), x),
        "linear_token_logps": (lambda z: sum(t.sum() for t in SF.linear_token_logps(
            z, w.detach(), lab, return_entropy=True, chunk_size=3)), h),
        "linear_sequence_logps": (lambda z: SF.linear_sequence_logps(z, w.detach(), lab, average=True).sum(), h),
    }
    f, arg = fns[name]
    torch._dynamo.reset()
    assert_compiled_matches_eager(f, arg.detach())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["linear_token_logps", "linear_sequence_logps"])
def test_linear_forms_compile_fullgraph_with_a_tensor_temperature(name):
    # a 0-d tensor temperature is documented ("used as a constant"); reading it on the host
    # (float(T)) could not be traced: "Could not guard on data-dependent expression"
    h, w, _, lab = _linear(dtype=torch.float32)
    t = torch.tensor(0.7)
    fn = getattr(SF, name)
    f = lambda z: fn(z, w.detach(), lab, temperature=t, chunk_size=3).sum()  # noqa: E731
    torch._dynamo.reset()
    g = assert_compiled_matches_eager(f, h.detach())
    h2 = h.detach().requires_grad_()
    (want,) = torch.autograd.grad(fn(h2, w.detach(), lab, temperature=0.7).sum(), h2)
    torch.testing.assert_close(g, want)


def test_forward_mode_and_hessian():
    x, labels = _data(shape=(2, 3, 5))
    f = lambda z: SF.sequence_logps(z, labels, average=True).sum()  # noqa: E731
    torch.testing.assert_close(torch.func.jacfwd(f)(x.detach()), torch.func.jacrev(f)(x.detach()))
    torch.testing.assert_close(torch.func.hessian(f)(x.detach()),
                               torch.func.jacrev(torch.func.jacrev(f))(x.detach()))


@pytest.mark.parametrize("fn", [SF.token_logps, SF.sequence_logps], ids=["token_logps", "sequence_logps"])
def test_a_learnable_temperature_is_not_read_and_an_invalid_one_gives_nan(fn):
    # requires_grad: no host read (a sync per step); a value <= 0 or inf is NaN, not a
    # silently wrong log-prob (log_softmax(-x) at T = -1)
    for bad in (0.0, -1.0, float("inf")):
        t = torch.tensor(bad, requires_grad=True)
        assert torch.isnan(fn(_X, _L, temperature=t)[..., 0]).all()
    t = torch.tensor(0.7, requires_grad=True)
    out = fn(_X, _L, temperature=t)
    torch.testing.assert_close(out, fn(_X, _L, temperature=0.7))
    (g,) = torch.autograd.grad(out.sum(), t)
    t64 = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    (want,) = torch.autograd.grad(fn(_X.double(), _L, temperature=t64).sum(), t64)
    torch.testing.assert_close(g, want.float())


@pytest.mark.parametrize("fn", [SF.token_logps, SF.sequence_logps], ids=["token_logps", "sequence_logps"])
def test_a_learnable_temperature_gets_a_finite_gradient_with_neg_inf_logits(fn):
    # ±inf / T is ±inf for every T > 0: those logits do not depend on T (the division's
    # ∂/∂T = −x/T² is inf there, times a zero incoming gradient: NaN). The reference puts a
    # logit of probability 0 in float64 (−1e4 at T = 0.5) where the -inf is: the same numbers.
    x = torch.tensor([[[0.0, 1.0, -INF], [2.0, -INF, -INF], [0.5, 3.0, -INF]]], dtype=D, requires_grad=True)
    labels = torch.tensor([[1, 0, 1]])
    t = torch.tensor(0.5, dtype=D, requires_grad=True)
    g_x, g_t = torch.autograd.grad(fn(x, labels, temperature=t).sum(), (x, t))
    x2 = torch.where(torch.isinf(x), -1e4, x.detach()).requires_grad_()
    t2 = t.detach().clone().requires_grad_()
    want_x, want_t = torch.autograd.grad(fn(x2, labels, temperature=t2).sum(), (x2, t2))
    torch.testing.assert_close(g_t, want_t)
    torch.testing.assert_close(g_x, want_x)
    # a label at a -inf logit: the value is -inf, the gradients finite
    x3 = x.detach().clone().requires_grad_()
    g_x, g_t = torch.autograd.grad(fn(x3, torch.tensor([[2, 0, 1]]), temperature=t).sum(), (x3, t))
    assert torch.isfinite(g_t) and torch.isfinite(g_x).all()


def test_a_plus_inf_logit_from_finite_hidden_states_gives_the_limit():
    # h @ w.T overflows to +inf in row 0: the limit, as token_logps gives, with and without
    # return_entropy (the blockwise head bounds each block before its log-softmax)
    h, w, lab = torch.tensor([[1e20], [1.0]]), torch.tensor([[1e20], [1.0], [-1.0]]), torch.tensor([0, 1])
    want = SF.token_logps(h @ w.T, lab)
    assert want[0] == 0 and want[1] == -1e20
    logp, _ = SF.linear_token_logps(h, w, lab, return_entropy=True)
    torch.testing.assert_close(logp, want)
    torch.testing.assert_close(SF.linear_token_logps(h, w, lab), want)


def _fused_and_unfused(h, w, b, lab, **kw):
    """``linear_token_logps`` and ``token_logps`` of the same logits: values and the gradient
    of their sum with respect to ``h`` (and ``b``)."""
    out = []
    for fused in (True, False):
        hh = h.detach().clone().requires_grad_()
        bb = None if b is None else b.detach().clone().requires_grad_()
        if fused:
            v = SF.linear_token_logps(hh, w, lab, linear_bias=bb, chunk_size=2, **kw)
        else:
            v = SF.token_logps(torch.nn.functional.linear(hh, w, bb), lab, **kw)
        grads = torch.autograd.grad(v.sum(), [t for t in (hh, bb) if t is not None])
        out.append((v.detach(), grads))
    return out


@pytest.mark.parametrize("scale", [1e4, 1e8, 1e30])
def test_blockwise_log_p_t_is_exact_at_large_logits(scale):
    # log p_t = (u_t − M) − log S: the head kept lse = M + log S, which rounds to ulp(M)
    # (0 for four equal 1e8 logits, where −log 4 is right; 2e-4 off at 1e4)
    u = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -1.0, -2.0, -3.0], [-1.0, 0.0, -0.5, -7.0]]) + scale
    lab = torch.tensor([0, 1, 3])
    (v, (g,)), (v_ref, (g_ref,)) = _fused_and_unfused(u, torch.eye(4), None, lab)
    want = torch.log_softmax(u.double() - scale, 1).gather(1, lab[:, None]).squeeze(1).float()
    torch.testing.assert_close(v, want)
    torch.testing.assert_close(v, v_ref)
    torch.testing.assert_close(g, g_ref)
    torch.testing.assert_close(g.sum(1), torch.zeros(3))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_blockwise_plus_inf_logits_give_the_limit(temperature):
    # an infinite bias, and a logit that overflows only once divided by T: uniform over the
    # +inf entries, -inf (gradient finite) for a finite label in such a row, as token_logps
    inf = float("inf")
    h = torch.tensor([[1.0], [1.0], [1.0], [1.0]])
    w = torch.tensor([[0.0], [0.0], [0.0], [3e38]])
    b = torch.tensor([inf, 0.0, 1.0, 0.0])
    lab = torch.tensor([0, 1, 3, 2])
    (v, grads), (v_ref, grads_ref) = _fused_and_unfused(h, w, b, lab, temperature=temperature)
    torch.testing.assert_close(v, v_ref)
    n_inf = 2.0 if temperature == 0.5 else 1.0  # 3e38 / T overflows at T = 0.5
    assert v[1] == -inf and v[0] == -torch.tensor(n_inf).log()
    for g, g_ref in zip(grads, grads_ref):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, g_ref)


def test_blockwise_nan_logit_gives_nan_for_its_row_only():
    h = torch.tensor([[1.0], [1.0]])
    w = torch.tensor([[0.0], [1.0], [2.0]])
    b = torch.tensor([0.0, 0.0, 0.0])
    h[0, 0] = float("nan")
    v = SF.linear_token_logps(h, w, torch.tensor([0, 2]), linear_bias=b)
    assert torch.isnan(v[0]) and torch.isfinite(v[1])
