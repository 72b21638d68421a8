"""The row cores: `bounded`'s bit-level bound (softmax, logsumexp's backward) and the ±0 rows it
must leave alone; the class-index core of cross-entropy and focal loss (the target's logit set to
the row max, so that ``Σ_{j≠t} e^{x_j − m}`` comes out of the softmax without the max's index):
its far rows, ties and hazard rows against float64, its operator budget and bytes (counted,
deterministic), and the one row core behind focal loss, cross-entropy and the linear losses."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import stablelosses.functional as SF
from stablelosses._autograd.rows import _BITS, bounded
from stablelosses.bench.traffic import bytes_moved

INF = math.inf
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _special(dt: torch.dtype) -> list[float]:
    fi = torch.finfo(dt)
    return [0.0, -0.0, 1.0, -1.0, INF, -INF, fi.max, fi.min, fi.tiny, -fi.tiny]


@pytest.mark.parametrize("dt", _DTYPES)
def test_bounded_is_the_identity_bit_for_bit_on_rows_with_a_finite_max(dt):
    bits = _BITS[dt][0]
    rows = torch.tensor(list(itertools.product(_special(dt), repeat=3)), dtype=dt)
    m = rows.amax(1, keepdim=True)
    out = bounded(rows, m)
    finite = torch.isfinite(m).squeeze(1)
    # -0.0 beside +0.0 included: the max may be either zero, neither entry moves
    assert torch.equal(out[finite].view(bits), rows[finite].view(bits))
    plus = (m == INF).squeeze(1)
    expected = torch.where(rows[plus] == INF, torch.finfo(dt).max, rows[plus])
    assert torch.equal(out[plus].view(bits), expected.view(bits))
    masked = (m == -INF).squeeze(1)
    assert masked.any() and torch.isfinite(out[masked]).all()


@pytest.mark.parametrize("dt", _DTYPES)
def test_bounded_under_torch_func_is_the_eager_bound_bit_for_bit(dt):
    # the clamp spelling (torch.func, compiled) against the bit-level minimum, every row of
    # four special values (NaN rows excepted: NaN through every kernel either way)
    bits = _BITS[dt][0]
    rows = torch.tensor(list(itertools.product(_special(dt), repeat=4)), dtype=dt)
    eager = bounded(rows, rows.amax(1, keepdim=True))
    viaf = torch.func.vmap(lambda r: bounded(r[None], r.amax()[None, None])[0])(rows)
    assert torch.equal(eager.view(bits), viaf.view(bits))


@pytest.mark.parametrize("dt", _DTYPES)
def test_bounded_keeps_nan_rows_nan(dt):
    x = torch.tensor([[float("nan"), 1.0, INF], [2.0, float("nan"), -INF]], dtype=dt)
    out = bounded(x, x.amax(1, keepdim=True))
    assert torch.isnan(out).any(1).all()


def test_signed_zero_rows_are_ordinary():
    # an all-zero row of logits (zero embeddings in InfoNCE) whose max may come back as -0.0
    x = torch.tensor([[0.0, -0.0], [-0.0, 0.0], [-0.0, -0.0]], requires_grad=True)
    t = torch.tensor([0, 1, 0])
    torch.testing.assert_close(SF.cross_entropy(x, t, reduction="none"),
                               F.cross_entropy(x.detach(), t, reduction="none"))
    SF.cross_entropy(x, t).backward()
    torch.testing.assert_close(x.grad, torch.tensor([[-1.0, 1.0], [1.0, -1.0], [-1.0, 1.0]]) / 6)


def _exact_nll(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``−log p_t = log1p(Σ_{j≠t} e^{x_j − x_t})`` in float64 with the shift by the row max
    (``(m − x_t) + log Σ e^{x − m}`` where ``e^{x_t − m}`` underflows)."""
    x = x.double()
    m = x.amax(1, keepdim=True)
    z = x.gather(1, t[:, None]) - m
    et = torch.exp(z)
    d = torch.exp(x - m).scatter(1, t[:, None], 0.0).sum(1, keepdim=True)
    far = et < 1e-300
    near = torch.log1p(d / torch.where(far, 1.0, et))
    return torch.where(far, torch.log(d + et) - z, near).squeeze(1)


@pytest.mark.parametrize("gamma", [0.0, 2.0])
def test_far_tied_and_confident_rows_against_float64(gamma):
    # the target 200 below the max (p_t underflows in float32: torch's finite value, not inf),
    # ties at the max (the target is one of several maxima), a target 30 above the rest (the
    # exact tail) and a row of 40000 classes (p'_t = 1/S' stays ≥ 1/C)
    big = torch.zeros(1, 40000)
    big[0, 7] = 3.0
    rows = [
        (torch.tensor([[0.0, -200.0, 1.0]]), 1),
        (torch.tensor([[2.0, 2.0, 2.0, -1.0]]), 1),
        (torch.tensor([[30.0, 0.0, -1.0]]), 0),
        (torch.tensor([[1e30, -1e30, 1e30 * (1 - 2 ** -20)]]), 2),
        (big, 7),
        (big, 3),
    ]
    for x, t in rows:
        tt = torch.tensor([t])
        nll = _exact_nll(x, tt)
        rest = -torch.expm1(-nll)
        expected = (rest ** gamma * nll).float()
        out = SF.focal_loss(x, tt, gamma=gamma, reduction="none")
        torch.testing.assert_close(out, expected, rtol=4 * 2 ** -23, atol=0.0)
        # and the gradient is torch's (softmax − onehot, scaled for focal) where torch is exact
        if gamma == 0.0:
            xr = x.clone().requires_grad_()
            SF.cross_entropy(xr, tt).backward()
            ref = torch.softmax(x.double(), 1) - F.one_hot(tt, x.shape[1]).double()
            torch.testing.assert_close(xr.grad.double(), ref, rtol=1e-5, atol=1e-12)


def test_the_core_reads_the_max_without_its_index():
    # torch's CPU max(dim) with its index is ~10x slower than amax at 8192x1000 (not
    # vectorised): the core must not need the argmax
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.randn(16, 10, requires_grad=True)
    t = torch.randint(0, 10, (16,))
    with Names() as seen:
        SF.focal_loss(x, t, gamma=2.0).backward()
        SF.cross_entropy(x, t).backward()
    assert "amax" in seen.names
    assert not seen.names & {"max", "argmax", "topk", "sort"}


def _counted(fn):
    x = torch.randn(64, 10, requires_grad=True)
    t = torch.randint(0, 10, (64,))
    return bytes_moved(lambda: fn(x, t).backward())


@pytest.mark.parametrize(("name", "fn", "budget"), [
    ("cross_entropy", SF.cross_entropy, 33),
    ("focal_loss", lambda x, t: SF.focal_loss(x, t, gamma=2.0), 46),
])
def test_operator_budget(name, fn, budget):
    # every aten operator is a kernel launch on a GPU: forward + backward + the 'mean'
    assert _counted(fn).ops <= budget


@pytest.mark.parametrize(("name", "fn", "budget"), [
    ("cross_entropy", SF.cross_entropy, 25),
    ("focal_loss", lambda x, t: SF.focal_loss(x, t, gamma=2.0), 29),
])
def test_operator_budget_without_grad(name, fn, budget):
    # a forward that no backward follows forms neither p's target entry −r nor, for
    # cross-entropy, the row divisor p'_t·S: the value's operators only
    x = torch.randn(64, 10)
    t = torch.randint(0, 10, (64,))
    assert bytes_moved(lambda: fn(x, t)).ops <= budget


def test_bytes_moved_against_torch():
    # fwd+bwd: the row max, the bound, the softmax, the sum of p without p_t, the backward's
    # read and write, against torch's log-softmax, its backward and nll's zero gradient
    x = torch.randn(2048, 1000, requires_grad=True)
    t = torch.randint(0, 1000, (2048,))
    ours = bytes_moved(lambda: SF.cross_entropy(x, t).backward()).total
    ref = bytes_moved(lambda: F.cross_entropy(x, t).backward()).total
    assert ours <= 1.16 * ref


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [0.0, 2.0])
def test_compiled_rows_match_eager_on_hazard_rows(gamma):
    # compiled, the core sums one exp instead of reading the softmax (`rows.fused_index_row`: the
    # entries below the bound and a count at it): the
    # same values and gradients on every hazard row, a NaN row of one class included
    fmin = torch.finfo(torch.float32).min
    x = torch.tensor([[1.0, 2, 3], [math.nan, 0, 1], [INF, 0, INF], [-INF, -INF, -INF],
                      [INF, 1, 2], [-INF, fmin, 0], [30.0, 0, -1], [fmin, fmin, -INF],
                      [2.0, 2, -1], [5.0, 5, 5], [2.0, 2, 1.9999]],
                     requires_grad=True)
    # ... ties at the max with the target below them, among them, and just below them
    t = torch.tensor([0, 1, 2, 1, 1, 0, 0, 1, 2, 0, 2])
    x1 = torch.tensor([[math.nan]], requires_grad=True)
    t1 = torch.tensor([0])
    for xs, ts in ((x, t), (x1, t1)):
        def fn(z, ts=ts):
            return SF.focal_loss(z, ts, gamma=gamma, reduction="none")

        eager, compiled = fn(xs), torch.compile(fn, fullgraph=True)(xs)
        torch.testing.assert_close(compiled, eager, equal_nan=True)
        (ge,) = torch.autograd.grad(eager.nan_to_num(0.0, 0.0).sum(), xs)
        (gc,) = torch.autograd.grad(compiled.nan_to_num(0.0, 0.0).sum(), xs)
        torch.testing.assert_close(gc, ge, equal_nan=True)
        # without grad: the value-only row (no Function), compiled and eager
        with torch.no_grad():
            value = torch.compile(fn, fullgraph=True)(xs.detach())
            torch.testing.assert_close(value, eager.detach(), equal_nan=True)
            torch.testing.assert_close(fn(xs.detach()), eager.detach(), equal_nan=True, rtol=0, atol=0)


def _rows_through_every_loss() -> tuple[torch.Tensor, torch.Tensor]:
    # ordinary rows, the exact tail (target 30 above the rest: torch rounds −log p_t to 0),
    # a far target, ties, a finfo.min row and a 1e30 row: one row core for all of them
    fmin = torch.finfo(torch.float32).min
    x = torch.tensor([[1.0, 2, 3], [30.0, 0, -1], [0.0, -200, 1], [2.0, 2, -1],
                      [fmin, fmin, fmin], [1e30, -1e30, 0.5e30], [0.1, 0.2, 0.3]])
    t = torch.tensor([0, 0, 1, 1, 2, 0, 2])
    return x, t


@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
def test_one_row_core_behind_focal_cross_entropy_and_the_linear_losses(gamma):
    # the same N-sized formula (rows.target_nll, rows.focal_rows) behind focal_loss,
    # cross_entropy and the linear losses' chunk step: focal at γ = 0 is cross-entropy bit for
    # bit, and the linear losses on the identity weight (x I = x exactly) keep the same exact
    # tail, within 4 ulp (they sum D with exp instead of reading it off torch's softmax)
    x, t = _rows_through_every_loss()
    eye = torch.eye(x.shape[1])
    focal = SF.focal_loss(x, t, gamma=gamma, reduction="none")
    if gamma == 0.0:
        assert torch.equal(focal, SF.cross_entropy(x, t, reduction="none"))
        linear = SF.linear_cross_entropy(x, eye, t, reduction="none")
    else:
        linear = SF.linear_focal_loss(x, eye, t, gamma=gamma, reduction="none")
    torch.testing.assert_close(linear, focal, rtol=4 * 2 ** -23, atol=0.0)
    # the tail row: torch's log-softmax rounds it to 0, every loss here keeps e^{-30}-ish
    assert focal[1] > 0 and linear[1] > 0


@pytest.mark.slow
def test_compiled_bound_matches_eager_on_hazard_rows():
    # compiled, `bounded` is a clamp with per-row bounds instead of the bit-level minimum
    # (inductor bit-casts through memory): the same values and gradients through softmax,
    # logsumexp's backward and label smoothing, on every hazard row
    fmax = torch.finfo(torch.float32).max
    x = torch.tensor([[1.0, 2, 3], [INF, 0, INF], [INF, fmax, 1], [-INF, -INF, -INF],
                      [-INF, -fmax, 0], [-0.0, 0.0, -1], [math.nan, 0, 1], [fmax, -fmax, 0]],
                     requires_grad=True)
    t = torch.tensor([0, 0, 1, 2, 2, 1, 0, 0])
    w = torch.rand(3, 3)

    def fn(z):
        return (
            (SF.softmax(z, 1) * w.repeat(3, 1)[: z.shape[0]]).nan_to_num(0.0, 0.0, 0.0).sum()
            + SF.logsumexp(z, 1).clamp(-1e3, 1e3).nan_to_num(0.0).sum()
            + SF.cross_entropy(z, t, label_smoothing=0.2, reduction="none").clamp(max=1e3).nan_to_num(0.0).sum()
        )

    eager, compiled = fn(x), torch.compile(fn, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager)
    (ge,) = torch.autograd.grad(eager, x)
    (gc,) = torch.autograd.grad(torch.compile(fn, fullgraph=True)(x), x)
    torch.testing.assert_close(gc, ge, equal_nan=True)


@pytest.mark.parametrize("shape", [(6, 300), (3, 300, 2, 2)], ids=["class-last", "class-dim-1"])
def test_smoothing_sum_is_one_read_in_the_input_dtype_without_overflow(shape):
    # the unweighted smoothing sum is one gemv of the row with 2^-j (no float64 copy of the row):
    # both layouts, and terms near -1e37 whose plain float32 row sum overflows
    g = torch.Generator().manual_seed(3)
    x = ((torch.rand(shape, generator=g) * 2 - 1) * 1e37).requires_grad_()
    t = torch.randint(0, 300, (shape[0],) + shape[2:], generator=g)
    x.detach()[0, 7] = -INF  # a masked class: no smoothing mass
    lsm = torch.log_softmax(x.detach().double(), 1)
    assert torch.isinf(torch.where(torch.isinf(lsm), 0.0, lsm).float().sum(1)).any()
    ours = SF.cross_entropy(x, t, label_smoothing=0.1, reduction="none")
    lsm_t = lsm.gather(1, t.unsqueeze(1)).squeeze(1)
    unmasked = torch.isfinite(x.detach()).double()
    k = unmasked.sum(1)
    ref = -0.9 * lsm_t - 0.1 / k * torch.where(unmasked > 0, lsm, 0.0).sum(1)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=0)
    # no float64 pass over the row (the CPU makes a float64 copy of it for that)
    with _Float64Ops() as seen:
        SF.cross_entropy(x, t, label_smoothing=0.1).backward()
    assert seen.names == []


class _Float64Ops(TorchDispatchMode):
    """The aten ops asked to compute in float64 (``dtype=`` keyword) on float32 tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("dtype") == torch.float64 and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args
        ):
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **kwargs)


@pytest.mark.parametrize("gamma", [0.0, 2.0])
def test_the_in_place_gradient_survives_a_retained_graph(gamma):
    # the first-order backward scales the saved softmax in place into the gradient; a second
    # backward through the retained graph makes the row again from x (the same bits)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 11, generator=g).mul_(4).requires_grad_()
    t = torch.randint(0, 11, (7,), generator=g)
    x.detach()[0] = torch.tensor([INF, 1.0] + [-INF] * 9)  # a +inf row
    x.detach()[1, 3:] = -INF
    fn = (lambda z: SF.focal_loss(z, t, gamma=gamma)) if gamma else (lambda z: SF.cross_entropy(z, t))
    loss = fn(x)
    g1 = torch.autograd.grad(loss, x, retain_graph=True)[0]
    g2 = torch.autograd.grad(loss, x, retain_graph=True)[0]
    assert torch.equal(g1, g2)
    with torch.enable_grad():  # the differentiable recomputation, as a reference
        ref = torch.autograd.grad(fn(x), x, create_graph=True)[0]
    torch.testing.assert_close(g1, ref.detach(), rtol=1e-6, atol=1e-7)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * g1, rtol=0, atol=0)
    # two losses on the same logits: the engine adds the two gradients
    x.grad = None
    (fn(x) + 2 * fn(x)).backward()
    torch.testing.assert_close(x.grad, 3 * g1, rtol=1e-6, atol=1e-7)


_OVER_OWN_BUFFER = {
    "log_softmax": (lambda z, t, y: SF.log_softmax(z, 1), lambda z, t, y: F.log_softmax(z, 1)),
    "softmax": (lambda z, t, y: SF.softmax(z, 1), lambda z, t, y: F.softmax(z, 1)),
    "logsumexp": (lambda z, t, y: SF.logsumexp(z, 1), lambda z, t, y: torch.logsumexp(z, 1)),
    "smoothing": (lambda z, t, y: SF.cross_entropy(z, t, label_smoothing=0.1, reduction="none"),
                  lambda z, t, y: F.cross_entropy(z, t, label_smoothing=0.1, reduction="none")),
    "probabilities": (lambda z, t, y: SF.cross_entropy(z, y, reduction="none"),
                      lambda z, t, y: F.cross_entropy(z, y, reduction="none")),
    "cross_entropy": (lambda z, t, y: SF.cross_entropy(z, t, reduction="none"),
                      lambda z, t, y: F.cross_entropy(z, t, reduction="none")),
}


@pytest.mark.parametrize("name", sorted(_OVER_OWN_BUFFER))
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "class-dim-1"])
def test_kernels_written_over_their_own_buffer_keep_every_layout(name, layout):
    # torch's log-softmax kernels write over the Function's own buffer in eager first order;
    # an aliased output with other strides comes out wrong, so those layouts must not alias
    g = torch.Generator().manual_seed(11)
    if layout == "class-dim-1":
        x = torch.randn(4, 9, 3, generator=g, dtype=torch.float64)
        t = torch.randint(0, 9, (4, 3), generator=g)
    else:
        x = torch.randn(9, 6, generator=g, dtype=torch.float64)
        x = x.T if layout == "transposed" else x.reshape(6, 9)
        t = torch.randint(0, 9, (6,), generator=g)
    y = torch.softmax(torch.randn(x.shape, generator=g, dtype=torch.float64), 1)
    ours, ref = _OVER_OWN_BUFFER[name]
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    if layout == "transposed":
        a, b = x.T.clone().requires_grad_(), x.T.clone().requires_grad_()
        out, want = ours(a.T, t, y), ref(b.T, t, y)
    else:
        out, want = ours(a, t, y), ref(b, t, y)
    torch.testing.assert_close(out, want)
    gout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(gout)
    want.backward(gout)
    torch.testing.assert_close(a.grad, b.grad)
