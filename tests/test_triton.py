"""The Triton kernels against the torch path, value and gradient: the hazard catalogue, random
inputs in float32/float16/bfloat16, widths that are not a power of two and multi-block rows.

Without CUDA they run under ``TRITON_INTERPRET=1`` (numpy, slow): shapes stay small. With CUDA
the same tests run natively on the GPU (``DEV``), plus a graph-capture and a sync-debug check.
"""

from __future__ import annotations

import os

import pytest
import torch


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("+")[0].split(".")[:2])


if not torch.cuda.is_available():
    # before triton is imported: it fixes the interpreter mode then and at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", minversion="3.6")  # torch 2.6's own triton 3.2: skipped
np = pytest.importorskip("numpy")
if not torch.cuda.is_available() and _version(np.__version__) >= (2, 4) and _version(triton.__version__) < (3, 9):
    # triton's interpreter (before 3.9) turns its 1-element int arrays into Python ints, which
    # numpy 2.4 refuses: CI installs numpy < 2.4 with triton
    pytest.skip("triton's interpreter before 3.9 needs numpy < 2.4", allow_module_level=True)

import stablelosses as sl  # noqa: E402
import stablelosses.functional as SF  # noqa: E402
from stablelosses._triton import ops  # noqa: E402

INF, NAN = float("inf"), float("nan")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the kernels run
# numpy warns where the interpreter evaluates both branches of a where (log 0, 0/0)
# and converts its 1-element arrays to Python ints (deprecated in numpy 1.25)
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]
# agreement with the torch path, in units of the dtype's eps: the kernel and torch's kernels
# round exp/log/sum differently (a few ulp in fp32); half dtypes round the same fp32 gradient
ULP = {torch.float32: 8, torch.float16: 1, torch.bfloat16: 1}


@pytest.fixture(autouse=True)
def _kernels_selected(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    with sl.backend("triton"):
        yield


def _close(a, b, dtype=torch.float32, ulp=None, row_scale=False):
    """Within ``ulp`` eps of the dtype, relative; ``row_scale``: also absolute, relative to the
    largest finite reference entry (a backward ``y (g − Σ g y)`` cancels to ~0 where ``y → 1``:
    there each side is right to one rounding of the row's scale)."""
    eps = torch.finfo(dtype).eps * (ULP[dtype] if ulp is None else ulp)
    atol = eps * 1e-3
    if row_scale:
        finite = b[torch.isfinite(b)].abs()
        atol = eps * float(finite.max()) if finite.numel() else atol
    torch.testing.assert_close(a, b, rtol=eps, atol=atol, equal_nan=True)


def _on_dev(v):
    return v.to(DEV) if isinstance(v, torch.Tensor) else v


def _both(fn, x, *args, **kw):
    """``fn`` on the kernel path and on the torch path (on ``DEV``): (loss, grad) each, grad of
    Σ loss."""
    x, args, kw = _on_dev(x), [_on_dev(a) for a in args], {k: _on_dev(v) for k, v in kw.items()}
    out = []
    for name in ("triton", "torch"):
        xi = x.detach().clone().requires_grad_()
        with sl.backend(name):
            loss = fn(xi, *args, **kw)
        (g,) = torch.autograd.grad(loss.sum(), xi)
        out.append((loss.detach(), g))
    return out


def _hazard_rows(v: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per hazard; the targets say which entry each row is about."""
    fmin = torch.finfo(torch.float32).min
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, v, generator=g)
    t = torch.randint(0, v, (12,), generator=g)
    x[0] = -INF  # fully masked
    x[1, : v // 2] = -INF  # a leading -inf block, then finite
    x[2, 3], x[2, 30], t[2] = INF, INF, 3  # +inf row, target at +inf
    x[3, 5], t[3] = INF, 6  # +inf row, target finite: p_t = 0, loss +inf
    x[4, 7] = NAN  # NaN row
    x[5] = fmin  # finfo.min: an ordinary row (log C)
    x[6] = 0.1 * x[6]
    x[6, 9], t[6] = 25.0, 9  # p_t -> 1: the exact tail (1 - p_t ~ 1e-10)
    x[7, 11], t[7] = 60.0, 11  # p_t rounds to 1 in fp32: log p_t ~ -1e-25, still exact
    x[8, 2], t[8] = -INF, 2  # target class masked: loss +inf, finite gradient
    t[9] = -100  # ignored
    x[10, 1], t[10] = NAN, -100  # ignored NaN row: NaN gradient, as the torch path
    x[11, v - 1], t[11] = 1e30, v - 1  # a huge finite logit
    return x, t


@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
def test_hazard_catalogue(gamma, monkeypatch):
    monkeypatch.setitem(ops.MAX_BLOCK, DEV, 16)  # 40 columns: three blocks, the last ragged
    x, t = _hazard_rows()
    (lk, gk), (lt, gt) = _both(SF.focal_loss, x, t, gamma, reduction="none")
    _close(lk, lt)
    _close(gk, gt)
    assert torch.equal(gk[0], torch.zeros_like(gk[0])) and lk[0] == 0  # fully masked: dropped
    assert torch.isnan(lk[4]) and torch.isnan(gk[4]).all()  # NaN in, NaN out
    assert lk[3] == INF and torch.isfinite(gk[3]).all()
    if gamma == 0.0:  # the exact tail, where lse − x_t rounds to 0: against float64 log1p
        for r in (6, 7):
            x64 = x[r].double().cpu()
            rest = torch.exp(x64 - x64[t[r]]).sum() - 1.0 if r == 6 else torch.exp(
                torch.cat([x64[: t[r]], x64[t[r] + 1 :]]) - x64[t[r]]).sum()
            _close(lk[r].cpu().double(), torch.log1p(rest), ulp=4)
        assert 0 < lk[7] < 1e-20
    assert torch.equal(gk[9], torch.zeros_like(gk[9]))


@pytest.mark.parametrize("eps", [0.1, 1.0])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_label_smoothing_hazards(eps, weighted, monkeypatch):
    monkeypatch.setitem(ops.MAX_BLOCK, DEV, 16)
    x, t = _hazard_rows()
    x[9, :10] = -INF  # masked classes: no smoothing mass (ε/K over the K unmasked ones)
    w = torch.rand(x.shape[1], generator=torch.Generator().manual_seed(7)) if weighted else None
    if weighted:
        w[3] = 0.0  # a zero weight on a +inf row's finite class: a term of 0, as the torch path
    (lk, gk), (lt, gt) = _both(SF.cross_entropy, x, t, weight=w, label_smoothing=eps, reduction="none")
    _close(lk, lt)
    _close(gk, gt, row_scale=True)  # p − q cancels where the target distribution matches p
    assert lk[0] == 0 and torch.equal(gk[0], torch.zeros_like(gk[0]))
    assert torch.isfinite(lk[9 if eps == 1.0 else 5]) and torch.isfinite(gk[1]).all()
    assert lk[3] == INF  # +inf row, finite target: a finite unmasked class takes mass
    (mk, _), (mt, _) = _both(SF.cross_entropy, x[5:8], t[5:8], weight=w, label_smoothing=eps)
    _close(mk, mt)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_weight_mask_ignore_index_reductions(reduction):
    x, t = _hazard_rows()
    x = torch.where(torch.isnan(x), 0.0, x)
    w = torch.rand(x.shape[1], generator=torch.Generator().manual_seed(1))
    w[t[1]] = 0.0  # a zero class weight removes the term
    mask = torch.ones(x.shape[0], dtype=torch.bool)
    mask[[1, 6]] = False
    t4 = torch.where(t == -100, 4, t)  # ignore_index=4: rows 9 and 10 stay ignored
    for tt, kw in ((t, {"weight": w}), (t, {"mask": mask}), (t4, {"weight": w, "mask": mask, "ignore_index": 4})):
        (lk, gk), (lt, gt) = _both(SF.cross_entropy, x, tt, reduction=reduction, **kw)
        _close(lk, lt)
        _close(gk, gt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_inputs_in_every_dtype(dtype):
    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(7, 37, generator=g)).to(dtype)  # 37: not a power of two
    t = torch.randint(0, 37, (7,), generator=g)
    for fn, args in ((SF.cross_entropy, ()), (SF.focal_loss, (2.0,))):
        (lk, gk), (lt, gt) = _both(fn, x, t, *args, reduction="mean")
        assert lk.dtype == lt.dtype == dtype and gk.dtype == dtype
        _close(lk, lt, dtype)
        _close(gk, gt, dtype)


def test_multi_block_rows_vocab_70000():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 70_000, generator=g)
    x[1, :40_000] = -INF  # the first blocks all -inf
    t = torch.tensor([69_999, 50_000])
    (lk, gk), (lt, gt) = _both(SF.cross_entropy, x, t, reduction="none")
    _close(lk, lt)
    _close(gk, gt)


def test_kernel_path_is_taken_and_logits_are_kept():
    x = torch.randn(3, 5, device=DEV, requires_grad=True)
    x0 = x.detach().clone()
    loss = SF.cross_entropy(x, torch.tensor([0, 1, 2], device=DEV), reduction="none")
    assert "Triton" in type(loss.grad_fn).__name__
    loss.sum().backward(retain_graph=True)
    g1 = x.grad.clone()
    loss.sum().backward()  # retain_graph: the saved logits are intact
    assert torch.equal(x.detach(), x0) and torch.equal(x.grad, 2 * g1)


def test_double_backward_falls_back_to_the_torch_path():
    x = torch.randn(3, 6, device=DEV, requires_grad=True)
    t = torch.tensor([0, 5, 2], device=DEV)
    v = torch.randn(3, 6, device=DEV)
    hv = []
    for name in ("triton", "torch"):
        with sl.backend(name):
            (g,) = torch.autograd.grad(SF.focal_loss(x, t, 2.0), x, create_graph=True)
        (h,) = torch.autograd.grad((g * v).sum(), x)
        hv.append(h)
    _close(hv[0], hv[1])


@pytest.mark.skipif(DEV == "cuda", reason="CUDA: a device-side assert (benchmarks/run_cuda.sh checks it)")
@pytest.mark.parametrize("bad", [7, -3, 4])
@pytest.mark.parametrize("fn,kw", [
    (SF.cross_entropy, {}), (SF.cross_entropy, {"label_smoothing": 0.1}),
    (SF.focal_loss, {"gamma": 2.0}), (SF.cross_entropy, {"mask": torch.tensor([False, True])}),
], ids=["ce", "smoothing", "focal", "mask"])
def test_out_of_range_target_raises_as_torch(fn, kw, bad):
    x, t = torch.randn(2, 4), torch.tensor([1, bad])
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        fn(x, t, reduction="none", **kw)
    with sl.backend("torch"), pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        fn(x, t, reduction="none", **kw)


def test_out_of_range_target_on_a_row_not_kept_is_not_read():
    x, t, keep = torch.randn(2, 4), torch.tensor([1, 7]), torch.tensor([True, False])
    (lk, gk), (lt, gt) = _both(SF.cross_entropy, x, t, reduction="none", mask=keep)
    _close(lk, lt)
    _close(gk, gt)
    assert lk[1] == 0 and torch.equal(gk[1], torch.zeros(4))


def test_uncovered_calls_take_the_torch_path():
    x = torch.randn(3, 4, device=DEV, requires_grad=True)
    t = torch.tensor([0, 1, 2], device=DEV)
    for loss in (
        SF.cross_entropy(x.double(), t),
        SF.cross_entropy(x, t, weight=torch.ones(4, device=DEV, requires_grad=True)),
        SF.cross_entropy(x.unsqueeze(-1), t.unsqueeze(-1)),
    ):
        assert "Triton" not in type(loss.grad_fn).__name__
    with pytest.raises(ValueError, match="reduction must be"):
        SF.cross_entropy(x, t, reduction="avg")  # the torch path validates


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_no_host_sync_and_graph_capture():
    x = torch.randn(64, 1000, device="cuda", requires_grad=True)
    t = torch.randint(0, 1000, (64,), device="cuda")
    SF.cross_entropy(x, t).backward()  # compile the kernels first
    torch.cuda.set_sync_debug_mode("error")
    try:
        SF.cross_entropy(x, t).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    xs = torch.randn(64, 1000, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        SF.cross_entropy(xs, t, reduction="sum")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = SF.cross_entropy(xs, t, reduction="sum")
    xs.copy_(torch.randn_like(xs))
    graph.replay()
    with sl.backend("torch"):
        ref = SF.cross_entropy(xs, t, reduction="sum")
    _close(out, ref)


# --- the softmax family --------------------------------------------------------------------

SOFTMAX_FAMILY = [
    (SF.softmax, {}),
    (SF.log_softmax, {}),
    (SF.logsumexp, {}),
    (SF.logsumexp, {"keepdim": True}),
]


def _softmax_hazard_rows(v: int = 37) -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, v, generator=g)
    x[0] = -INF  # all -inf
    x[1, :20] = -INF  # leading -inf blocks
    x[2, 3], x[2, 7] = INF, INF  # two +inf entries
    x[3, 4] = NAN
    x[4] = torch.finfo(torch.float32).min  # ordinary
    x[5, 9] = 40.0  # the argmax's tail: δ ~ 1e-16
    x[6] = 0.0
    x[6, 5] = 20.0
    x[7, 2], x[7, 3] = INF, NAN  # NaN wins over +inf
    x[8, 0] = 1e30
    return x


def _both_any(fn, x, grad, **kw):
    x, grad = x.to(DEV), grad.to(DEV)
    out = []
    for name in ("triton", "torch"):
        xi = x.detach().clone().requires_grad_()
        with sl.backend(name):
            y = fn(xi, -1, **kw)
        (g,) = torch.autograd.grad(y, xi, grad.reshape(y.shape))
        out.append((y.detach(), g))
    return out


@pytest.mark.parametrize("fn,kw", SOFTMAX_FAMILY, ids=["softmax", "log_softmax", "logsumexp", "lse-keepdim"])
def test_softmax_family_hazards(fn, kw, monkeypatch):
    monkeypatch.setitem(ops.MAX_BLOCK, DEV, 16)
    x = _softmax_hazard_rows()
    grad = torch.randn(x.shape if fn is not SF.logsumexp else x.shape[:1])
    (yk, gk), (yt, gt) = _both_any(fn, x, grad, **kw)
    if fn is SF.log_softmax:
        # The fused kernel keeps the argmax entry's exact tail (free there); the torch path
        # rounds it as torch's log_softmax does (0 where log(1 + δ) rounds to 0). Those two
        # entries are checked against float64 log1p, every other entry against the torch path.
        for row, col, top in ((5, 9, 40.0), (6, 5, 20.0)):
            x64 = x[row].double().cpu()
            exact = -torch.log1p(torch.exp(x64 - top).sum() - 1.0)
            _close(yk[row, col].cpu().double(), exact, ulp=4)
            assert yk[row, col] < 0
            assert yt[row, col] == torch.log_softmax(x[row], 0)[col]
        yt = yt.clone()
        yt[5, 9], yt[6, 5] = yk[5, 9], yk[6, 5]
    _close(yk, yt)
    _close(gk, gt, row_scale=True)
    assert torch.equal(gk[0], torch.zeros_like(gk[0]))  # all -inf: gradient exactly 0
    assert torch.isnan(gk[3]).all() and torch.isnan(gk[7]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_softmax_family_random_3d(dtype):
    g = torch.Generator().manual_seed(5)
    x = (4 * torch.randn(2, 3, 37, generator=g)).to(dtype)
    for fn, kw in SOFTMAX_FAMILY:
        shape = x.shape if fn is not SF.logsumexp else x.shape[:-1]
        grad = torch.randn(shape, generator=g).to(dtype)
        (yk, gk), (yt, gt) = _both_any(fn, x, grad, **kw)
        assert yk.dtype == yt.dtype == dtype and yk.shape == yt.shape
        _close(yk, yt, dtype)
        # half dtypes: the kernel's backward reads the rounded saved output (one more rounding)
        _close(gk, gt, dtype, ulp=None if dtype == torch.float32 else 2, row_scale=True)


def test_log_softmax_multi_block_70000():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 70_000, generator=g)
    x[1, :40_000] = -INF
    (yk, gk), (yt, gt) = _both_any(SF.log_softmax, x, torch.randn(2, 70_000, generator=g))
    _close(yk, yt)
    _close(gk, gt, row_scale=True)


@pytest.mark.parametrize("fn", [SF.softmax, SF.log_softmax, SF.logsumexp])
def test_softmax_family_double_backward(fn):
    x = torch.randn(3, 7, device=DEV, requires_grad=True)
    v = torch.randn(3, 7, device=DEV)
    hv = []
    for name in ("triton", "torch"):
        with sl.backend(name):
            y = fn(x, -1)
            (g,) = torch.autograd.grad(y, x, torch.ones_like(y) if y.dim() == 1 else v, create_graph=True)
        (h,) = torch.autograd.grad((g * v).sum(), x)
        hv.append(h)
    _close(hv[0], hv[1], ulp=16, row_scale=True)


def test_softmax_family_uncovered_calls_take_the_torch_path():
    x = torch.randn(3, 4, device=DEV, requires_grad=True)
    assert "Triton" in type(SF.softmax(x, -1).grad_fn.next_functions[0][0]).__name__
    for y in (SF.softmax(x, 0), SF.log_softmax(x, -1, mask=x > 0), SF.logsumexp(x, (0, 1)),
              SF.softmax(x, -1, dtype=torch.float64)):
        assert "Triton" not in type(y.grad_fn).__name__


# --- sigmoid focal loss ----------------------------------------------------------------------


def _sigmoid_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(8)
    sat = torch.tensor([0.0, 20.0, -20.0, 60.0, -60.0, 100.0, -100.0, NAN, INF, -INF, 1e30])
    x = torch.cat([3 * torch.randn(29, generator=g), sat]).reshape(5, 8)
    t = torch.cat([torch.rand(29, generator=g), torch.tensor([1.0, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1])])
    return x.to(dtype), t.reshape(5, 8).to(dtype)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("alpha", [0.25, -1.0])
def test_sigmoid_focal_hazards(gamma, alpha):
    x, t = _sigmoid_inputs()
    for reduction in ("none", "mean", "sum"):
        (lk, gk), (lt, gt) = _both(SF.sigmoid_focal_loss, x, t, alpha, gamma, reduction)
        _close(lk, lt)
        # σ(x) − t and the γ term cancel for soft targets: each side ~10 ulp of the row scale
        _close(gk, gt, row_scale=True)
    assert torch.isnan(gk.flatten()[36]) and torch.isfinite(gk.flatten()[30:36]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sigmoid_focal_half(dtype):
    x, t = _sigmoid_inputs(dtype)
    (lk, gk), (lt, gt) = _both(SF.sigmoid_focal_loss, x, t, 0.25, 2.0, "mean")
    assert lk.dtype == lt.dtype == dtype
    _close(lk, lt, dtype)
    _close(gk, gt, dtype, row_scale=True)


def test_sigmoid_focal_double_backward_and_target_grad():
    x, t = _sigmoid_inputs()
    x, t = x[:3].to(DEV), t[:3].to(DEV)
    xk = x.clone().requires_grad_()
    assert "Triton" in type(SF.sigmoid_focal_loss(xk, t, 0.25, 2.0, "none").grad_fn).__name__
    loss = SF.sigmoid_focal_loss(xk, t, 0.25, 2.0, "sum")
    (g,) = torch.autograd.grad(loss, xk, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), xk)
    with sl.backend("torch"):
        xt = x.clone().requires_grad_()
        (g2,) = torch.autograd.grad(SF.sigmoid_focal_loss(xt, t, 0.25, 2.0, "sum"), xt, create_graph=True)
        (h2,) = torch.autograd.grad(g2.sum(), xt)
    _close(h, h2, ulp=16, row_scale=True)
    tg = t.clone().requires_grad_()
    assert "Triton" not in type(SF.sigmoid_focal_loss(x, tg).grad_fn).__name__  # target grad: torch


# --- half precision: the torch path's error against float64, plus at most one ulp -------------


def _ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` above ``|ref|`` rounded to ``dtype`` (float64)."""
    r = ref.to(dtype).abs()
    return (torch.nextafter(r, torch.full_like(r, INF)) - r).double()


def _three_ways(fn, x, *args, grad=None, **kw):
    """(value, gradient) on the kernel path and the torch path in ``x``'s dtype, and the torch
    path in float64 on the same (upcast) inputs: the reference."""
    out = []
    for name, dt in (("triton", x.dtype), ("torch", x.dtype), ("torch", torch.float64)):
        xi = _on_dev(x).to(dt).detach().requires_grad_()
        a = [_on_dev(v.to(dt) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == x.shape
                     else v) for v in args]
        with sl.backend(name):
            y = fn(xi, *a, **{k: _on_dev(v) for k, v in kw.items()})
        g = torch.ones_like(y) if grad is None else _on_dev(grad).to(y.dtype)
        (gx,) = torch.autograd.grad(y, xi, g)
        out.append((y.detach().double().cpu(), gx.double().cpu()))
    return out


def _no_worse_than_torch(k, t, ref, dtype):
    """Where the float64 reference is finite, elementwise
    ``|k − ref| ≤ max(|t − ref|, ½ ulp(ref)) + 16 fp32 eps · max |ref|``: the kernel rounds its
    float32 result once, to nearest, so it is within half an ulp of the dtype of the float32
    value, which is within a few float32 ulp of the reference; so it is never worse than the
    torch path by more than one rounding (the issue's "+ 1 ulp" holds a fortiori). Elsewhere
    the torch path's own value."""
    fin = torch.isfinite(ref)
    r = ref[fin]
    err_k, err_t = (k[fin] - r).abs(), (t[fin] - r).abs()
    slack = 16 * torch.finfo(torch.float32).eps * (float(r.abs().max()) if r.numel() else 0.0)
    bound = torch.maximum(err_t, _ulp(r, dtype) / 2) + slack
    worst = (err_k - bound).max() if r.numel() else torch.tensor(0.0)
    assert worst <= 0, f"kernel error exceeds max(torch path's, half an ulp) by {float(worst):.3g}"
    assert float(err_k.max() if r.numel() else 0.0) <= float(
        (err_t.max() + _ulp(r, dtype).max()) if r.numel() else 0.0)  # the criterion
    torch.testing.assert_close(k[~fin], t[~fin], equal_nan=True, rtol=0, atol=0)


def _half_cases():
    g = torch.Generator().manual_seed(11)
    n, v = 12, 75
    x = 4 * torch.randn(n, v, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    t[3] = -100
    w = torch.rand(v, generator=g) + 0.5
    keep = torch.rand(n, generator=g) > 0.3
    gy = torch.randn(n, v, generator=g)
    gn = torch.randn(n, generator=g)
    soft = torch.rand(n, v, generator=g)
    emask = torch.rand(n, v, generator=g) > 0.2
    return {
        "softmax": (SF.softmax, x, (-1,), {}, gy),
        "log_softmax": (SF.log_softmax, x, (-1,), {}, gy),
        "logsumexp": (SF.logsumexp, x, (-1,), {}, gn),
        "ce-none": (SF.cross_entropy, x, (t,), {"reduction": "none"}, gn),
        "ce-mean-weight": (SF.cross_entropy, x, (t,), {"weight": w}, None),
        "ce-smoothing-mask": (SF.cross_entropy, x, (t,), {"label_smoothing": 0.2, "mask": keep,
                                                          "reduction": "none"}, gn),
        "ce-smoothing-weight-sum": (SF.cross_entropy, x, (t,), {"label_smoothing": 0.1, "weight": w,
                                                                "reduction": "sum"}, None),
        "focal": (SF.focal_loss, x, (t, 2.0), {"reduction": "none"}, gn),
        "focal-weight-mean": (SF.focal_loss, x, (t, 0.5), {"weight": w}, None),
        "sigmoid-focal": (SF.sigmoid_focal_loss, x, (soft, 0.25, 2.0, "none"), {}, gy),
        "sigmoid-focal-mask-mean": (SF.sigmoid_focal_loss, x, (soft, 0.25, 2.0, "mean"), {"mask": emask}, None),
    }


HALF_CASES = _half_cases()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(HALF_CASES))
def test_half_precision_error_at_most_the_torch_paths_plus_one_ulp(case, dtype):
    fn, x, args, kw, grad = HALF_CASES[case]
    (yk, gk), (yt, gt), (yr, gr) = _three_ways(fn, x.to(dtype), *args, grad=grad, **kw)
    _no_worse_than_torch(yk, yt, yr, dtype)
    _no_worse_than_torch(gk, gt, gr, dtype)


# --- hazard rows: label smoothing at ±1e37, sigmoid focal NaN ---------------------------------


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("kw", [{}, {"weight": True}, {"ignore_index": 2}, {"mask": True},
                                {"weight": True, "mask": True, "ignore_index": 2}],
                         ids=["plain", "weight", "ignore", "mask", "all"])
def test_label_smoothing_at_1e37_logits_is_the_torch_paths_finite_value(kw, reduction, monkeypatch):
    monkeypatch.setitem(ops.MAX_BLOCK, DEV, 16)  # 50 columns: four blocks, the max moves
    g = torch.Generator().manual_seed(12)
    x = torch.randn(5, 50, generator=g)
    x[:, ::2], x[:, 1::2] = 1e37, -1e37
    x[1, :30] = -1e37  # the max in a later block: the rescaled sum
    x[2] *= -1
    t = torch.tensor([0, 1, 2, 3, 49])
    kw = dict(kw)
    if kw.pop("weight", False):
        kw["weight"] = torch.rand(50, generator=g) + 0.1
    if kw.pop("mask", False):
        kw["mask"] = torch.tensor([True, True, False, True, True])
    (lk, gk), (lt, gt) = _both(SF.cross_entropy, x, t, label_smoothing=0.1, reduction=reduction, **kw)
    assert torch.isfinite(lt).all() and torch.isfinite(gt).all()  # the torch path's finite values
    _close(lk, lt)
    _close(gk, gt, row_scale=True)
    assert lk.abs().max() > 1e36  # the value is at the logits' scale, not flushed


@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("alpha", [0.25, -1.0])
@pytest.mark.parametrize("masked", [False, True])
def test_sigmoid_focal_nan_in_nan_out(gamma, alpha, masked):
    x = torch.tensor([NAN, NAN, 0.5, 30.0, -30.0, NAN, 1e37, -1e37])
    t = torch.tensor([1.0, 0.0, NAN, 1.0, 0.0, 0.3, 0.0, 1.0])
    keep = torch.tensor([True, True, True, True, True, False, True, True]) if masked else None
    (lk, gk), (lt, gt) = _both(SF.sigmoid_focal_loss, x, t, alpha, gamma, "none", mask=keep)
    nan_in = (torch.isnan(x) | torch.isnan(t)).to(DEV)
    if masked:
        nan_in[5] = False  # not kept: never read
        assert lk[5] == 0 and gk[5] == 0
    assert torch.equal(torch.isnan(lk), nan_in) and torch.equal(torch.isnan(gk), nan_in)
    _close(lk, lt)
    _close(gk, gt)
    for reduction in ("mean", "sum"):
        (rk, _), _ = _both(SF.sigmoid_focal_loss, x, t, alpha, gamma, reduction, mask=keep)
        assert torch.isnan(rk)


# --- sigmoid focal loss with mask= -------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("mask_shape", [(5, 8), (5, 1), (8,)], ids=["full", "rows", "cols"])
def test_sigmoid_focal_mask_runs_the_kernel(mask_shape, reduction):
    x, t = _sigmoid_inputs()
    x = torch.where(torch.isnan(x), 0.0, x)
    keep = torch.rand(mask_shape, generator=torch.Generator().manual_seed(13)) > 0.4
    xk = x.to(DEV).requires_grad_()
    loss = SF.sigmoid_focal_loss(xk, t.to(DEV), 0.25, 2.0, "none", mask=keep.to(DEV))
    assert "Triton" in type(loss.grad_fn).__name__
    (lk, gk), (lt, gt) = _both(SF.sigmoid_focal_loss, x, t, 0.25, 2.0, reduction, mask=keep)
    _close(lk, lt)
    _close(gk, gt, row_scale=True)
    full = keep.expand(x.shape).to(DEV)
    assert torch.equal(gk[~full], torch.zeros_like(gk[~full]))


def test_sigmoid_focal_all_false_mask_mean_is_zero():
    x, t = _sigmoid_inputs()
    keep = torch.zeros(x.shape, dtype=torch.bool)
    (lk, gk), (lt, gt) = _both(SF.sigmoid_focal_loss, x, t, 0.25, 2.0, "mean", mask=keep)
    assert lk == 0 == lt and torch.equal(gk, torch.zeros_like(gk)) and torch.equal(gt, gk)


# --- random inputs against the torch path (hypothesis) -----------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 6), v=st.integers(2, 70), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    reduction=st.sampled_from(["none", "mean", "sum"]), eps=st.sampled_from([0.0, 0.0, 0.3]),
    gamma=st.sampled_from([0.0, 0.0, 1.5]), weighted=st.booleans(), masked=st.booleans(),
    scale=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 2**16),
)
def test_random_class_index_losses_match_the_torch_path(n, v, dtype, reduction, eps, gamma, weighted,
                                                        masked, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(n, v, generator=g)).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = -100
    kw = {"reduction": reduction}
    if weighted:
        kw["weight"] = torch.rand(v, generator=g)
    if masked:
        kw["mask"] = torch.rand(n, generator=g) > 0.3
    if gamma == 0.0:
        fn, args, kw["label_smoothing"] = SF.cross_entropy, (t,), eps
    else:
        fn, args = SF.focal_loss, (t, gamma)
    (yk, gk), (yt, gt), (yr, gr) = _three_ways(fn, x, *args, **kw)
    if dtype == torch.float32:
        _close(yk, yt, ulp=16, row_scale=True)
        _close(gk, gt, ulp=16, row_scale=True)
    else:
        _no_worse_than_torch(yk, yt, yr, dtype)
        _no_worse_than_torch(gk, gt, gr, dtype)


# --- the fused linear losses' row step (the backend table's "linear_chunk_head") --------------


def _torch_head(logits, t, w, ignore_index, eps, gamma, row_scale):
    x = logits.clone().requires_grad_()
    with sl.backend("torch"):
        if gamma is None:
            loss = SF.cross_entropy(x, t, w, ignore_index=ignore_index, label_smoothing=eps, reduction="none")
        else:
            loss = SF.focal_loss(x, t, gamma, w, ignore_index=ignore_index, reduction="none")
    (g,) = torch.autograd.grad(loss, x, row_scale)
    return loss.detach(), g


@pytest.mark.parametrize("gamma,eps", [(None, 0.0), (None, 0.1), (2.0, 0.0), (0.0, 0.0)],
                         ids=["ce", "smoothing", "focal", "focal-gamma0"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_linear_chunk_head_is_registered_and_matches_the_torch_head(gamma, eps, weighted):
    from stablelosses import _backend

    x, t = (v.to(DEV) for v in _hazard_rows())
    x = torch.where(torch.isnan(x), 0.0, x)
    w = (torch.rand(x.shape[1], generator=torch.Generator().manual_seed(9)) + 0.1).to(DEV) if weighted else None
    rs = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(10)).to(DEV)
    head = _backend.kernel_for("linear_chunk_head", x)
    assert head is not None
    buf = x.clone()  # the engine's own chunk buffer
    out = head(buf, t, w, -100, eps, gamma, rs)
    ref_loss, ref_grad = _torch_head(x, t, w, -100, eps, gamma, rs)
    _close(out.loss, ref_loss)
    assert out.grad is buf  # the gradient, in place of the logits
    _close(buf, ref_grad, row_scale=eps > 0.0)
    valid = (t != -100) & (x.amax(1) > -INF)
    wt = torch.ones_like(rs) if w is None else w[t.clamp(min=0)]
    assert torch.equal(out.row_w, torch.where(valid, wt, 0.0))
    value_only = head(x.clone(), t, w, -100, eps, gamma, None)
    assert value_only.grad is None and torch.equal(value_only.loss, out.loss)


def test_linear_chunk_head_declines_what_it_does_not_cover():
    from stablelosses import _backend

    x, t = torch.randn(3, 5, device=DEV), torch.tensor([0, 1, 2], device=DEV)
    head = _backend.kernel_for("linear_chunk_head", x)
    assert head(x.double(), t, None, -100, 0.0, None, None) is None  # float64: the torch head
    assert head(x, t, None, -100, 0.1, 2.0, None) is None  # focal with smoothing
    with sl.backend("torch"):
        assert _backend.kernel_for("linear_chunk_head", x) is None


# --- the kernels compile for the GPU (the interpreter runs Python: it misses compile errors) ----

_COMPILE_SM90 = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stablelosses._triton import _kernels as K

TYPES = {"stride_x": "i64", "stride_g": "i64", "stride_dx": "i64", "stride_y": "i64", "n_cols": "i32",
         "ignore_index": "i64", "n": "i32", "eps": "fp32", "sm_scale": "fp32", "alpha": "fp32",
         "gamma": "fp32", "scale": "fp32", "T": "*i64", "KEEP": "*i1", "KINF": "*i32", "VALID": "*i1",
         "K": "*i32", "X": "*bf16", "Y": "*bf16", "DX": "*bf16"}
CASES = [
    (K._ce_forward_kernel, {"HAS_W": True, "HAS_KEEP": True, "SMOOTH": True, "BLOCK": 8192}, True),
    (K._ce_forward_kernel, {"HAS_W": False, "HAS_KEEP": False, "SMOOTH": False, "BLOCK": 8192}, True),
    (K._ce_backward_kernel, {"HAS_W": True, "HAS_KEEP": True, "FOCAL": False, "SMOOTH": True, "BLOCK": 8192}, False),
    (K._ce_backward_kernel, {"HAS_W": False, "HAS_KEEP": False, "FOCAL": True, "SMOOTH": False, "BLOCK": 8192}, False),
    *[(K._softmax_forward_kernel, {"MODE": m, "BLOCK": 4096}, False) for m in (0, 1, 2)],
    *[(K._softmax_backward_kernel, {"LOG": b, "BLOCK": 4096}, False) for b in (False, True)],
    (K._logsumexp_backward_kernel, {"BLOCK": 4096}, False),
    *[(f, {"HAS_ALPHA": True, "FOCAL": True, "HAS_KEEP": True, "BLOCK": 1024}, False)
      for f in (K._sigmoid_focal_forward_kernel, K._sigmoid_focal_backward_kernel)],
]
bad = 0
for fn, consts, asserts in CASES:
    sig = {n: "constexpr" if n in consts else TYPES.get(n, "*fp32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    opts = {"num_warps": 8, **({"debug": True, "sanitize_overflow": False} if asserts else {})}
    try:
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    except Exception as e:  # noqa: BLE001
        bad += 1
        print(fn.__name__, consts, type(e).__name__, e)
sys.exit(bad)
'''


def test_every_kernel_compiles_for_sm90():
    """Each kernel (bfloat16, every feature flag on) lowered to an H100 cubin by triton's own
    compiler and ptxas, without a GPU: a global that is not a constexpr, a type the GPU refuses,
    an assert that needs ``debug`` — what the interpreter never sees."""
    import pathlib
    import subprocess
    import sys

    nvidia = pathlib.Path(triton.__file__).parent / "backends" / "nvidia"
    if not (nvidia / "bin" / "ptxas").exists():
        pytest.skip("this triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = pathlib.Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    run = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


# --- double backward through the torch path the dispatch hands in -----------------------------


def _graph_has_kernel(y: torch.Tensor) -> bool:
    """Whether a kernel Function (``_Triton…``) is anywhere in ``y``'s autograd graph."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "Triton" in type(node).__name__:
            return True
        todo.extend(f for f, _ in node.next_functions)
    return False


@pytest.mark.parametrize("case", ["ce-weight-smoothing-mask", "focal-mask-ignore", "sigmoid-focal-mask"])
def test_double_backward_with_weight_mask_and_ignore_index(case):
    g = torch.Generator().manual_seed(14)
    x = torch.randn(5, 9, generator=g, dtype=torch.float32).to(DEV)
    t = torch.tensor([0, 3, 8, 2, 5], device=DEV)
    keep = torch.tensor([True, False, True, True, True], device=DEV)
    w = (torch.rand(9, generator=g) + 0.2).to(DEV)
    soft = torch.rand(5, 9, generator=g).to(DEV)
    calls = {
        "ce-weight-smoothing-mask": lambda xi: SF.cross_entropy(xi, t, w, label_smoothing=0.2, mask=keep),
        "focal-mask-ignore": lambda xi: SF.focal_loss(xi, t, 1.5, ignore_index=2, mask=keep),
        "sigmoid-focal-mask": lambda xi: SF.sigmoid_focal_loss(xi, soft, 0.25, 2.0, "sum", mask=soft > 0.3),
    }
    v = torch.randn(5, 9, generator=g).to(DEV)
    hv = []
    for name in ("triton", "torch"):
        xi = x.clone().requires_grad_()
        with sl.backend(name):
            loss = calls[case](xi)
            assert _graph_has_kernel(loss) == (name == "triton")
            (gx,) = torch.autograd.grad(loss, xi, create_graph=True)
        (h,) = torch.autograd.grad((gx * v).sum(), xi)
        hv.append(h)
    _close(hv[0], hv[1], ulp=16, row_scale=True)


# --- the fused linear losses run the row step kernel on the chunk engine -----------------------


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("case", ["ce", "ce-weight-smoothing", "focal-weight", "ce-bias-chunks"])
def test_linear_losses_run_the_row_step_kernel(case, reduction, monkeypatch):
    g = torch.Generator().manual_seed(15)
    n, h, v = 7, 6, 37
    x = torch.randn(n, h, generator=g).to(DEV)
    lw = torch.randn(v, h, generator=g).to(DEV)
    t = torch.randint(0, v, (n,), generator=g).to(DEV)
    t[2] = -100
    cw = (torch.rand(v, generator=g) + 0.2).to(DEV)
    b = torch.randn(v, generator=g).to(DEV)
    fn, kw = {
        "ce": (SF.linear_cross_entropy, {}),
        "ce-weight-smoothing": (SF.linear_cross_entropy, {"weight": cw, "label_smoothing": 0.2}),
        "focal-weight": (SF.linear_focal_loss, {"weight": cw, "gamma": 1.5}),
        "ce-bias-chunks": (SF.linear_cross_entropy, {"linear_bias": b, "chunk_size": 3}),
    }[case]
    steps = []
    row_step = ops.row_step
    monkeypatch.setattr(ops, "row_step", lambda *a: steps.append(1) or row_step(*a))
    out = []
    for name in ("triton", "torch"):
        xi, wi = x.clone().requires_grad_(), lw.clone().requires_grad_()
        with sl.backend(name):
            loss = fn(xi, wi, t, reduction=reduction, ignore_index=-100, **kw)
        gx, gw = torch.autograd.grad(loss.sum(), (xi, wi))
        out.append((loss.detach(), gx, gw))
        if name == "triton":
            assert steps, "the kernel row step did not run"
    for a, b_ in zip(*out):
        _close(a, b_, ulp=32, row_scale=True)


def test_linear_loss_with_softcap_or_z_loss_takes_the_torch_head(monkeypatch):
    x, lw, t = torch.randn(4, 3), torch.randn(9, 3), torch.tensor([0, 1, 2, 3])
    monkeypatch.setattr(ops, "row_step", lambda *a: pytest.fail("kernel ran"))
    SF.linear_cross_entropy(x.to(DEV), lw.to(DEV), t.to(DEV), softcap=30.0)
    SF.linear_cross_entropy(x.to(DEV), lw.to(DEV), t.to(DEV), z_loss=1e-4)
