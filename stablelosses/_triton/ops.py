"""The kernel path's autograd Functions (imports triton through ``_kernels``).

First order only: the backward is one kernel call, not differentiable again. A backward run
with grad mode on (double backward, ``create_graph=True``) recomputes the first derivative as
a graph on the saved inputs — the losses through ``rows_fn``, the public function's torch path
that the dispatch hands in (this module imports nothing from ``stablelosses.functional``), the
softmax family with torch ops here — so a second backward still works.

A target class index out of range raises torch's ``IndexError`` on the CPU (the interpreter;
reading the targets there costs no device sync) and is a device-side assert on CUDA (the
forward kernels are launched with ``debug=True``, which keeps their ``tl.device_assert``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
from torch import Tensor

from stablelosses._autograd.rows import focal_terms
from stablelosses._triton import _kernels
from stablelosses._utils import take

# The widest block one program reads at a time (a power of two). Rows wider than this take
# several blocks; tests lower it to exercise multi-block rows at small widths.
MAX_BLOCK = {"cuda": 8192, "cpu": 32768}


def block_size(n_cols: int, device: torch.device) -> int:
    """The block width for rows of ``n_cols`` entries: a launch parameter, not a branch."""
    return max(16, min(triton.next_power_of_2(n_cols), MAX_BLOCK.get(device.type, 8192)))


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


# Launch options of the kernels that assert on their targets: ``debug`` keeps the device-side
# assert on CUDA (the interpreter ignores both); integer-overflow checks stay off.
_ASSERTS = {"debug": True, "sanitize_overflow": False}


def check_targets(target: Tensor, ignore_index: int, n_classes: int, keep: Tensor | None) -> None:
    """torch's ``IndexError`` for a class index out of ``[0, n_classes)`` on a kept row (not
    ``ignore_index``), on CPU tensors only (there it costs no device sync; CUDA asserts in the
    kernel)."""
    if target.device.type != "cpu":
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
    if keep is not None:
        bad &= keep
    if bool(bad.any()):
        raise IndexError(f"Target {int(target[bad][0])} is out of bounds.")


class RowStats(NamedTuple):
    """What the forward kernel leaves per row: the loss (fp32), ``log p_t``, the clamped row
    max, the sum ``S`` of ``exp(x − max)``, ``rest = Σ_{j≠t} p_j``, the ``+inf`` count, and with
    label smoothing the unmasked class count K and their weight sum; the valid mask and the
    mean's denominator term (``w_t`` or 1 on valid rows)."""

    loss: Tensor
    lt: Tensor
    m: Tensor
    s: Tensor
    rest: Tensor
    kinf: Tensor
    cnt: Tensor
    wsum: Tensor
    valid: Tensor
    den: Tensor


def _forward_stats(
    x: Tensor, target: Tensor, weight: Tensor | None, keep: Tensor | None, ignore_index: int, eps: float
) -> RowStats:
    n, v = x.shape
    check_targets(target, ignore_index, v, keep)

    def f32(size: int = n) -> Tensor:
        return torch.empty(size, device=x.device, dtype=torch.float32)

    ns = n if eps > 0.0 else 0  # the smoothing sums: only with smoothing
    kinf = torch.empty(n, device=x.device, dtype=torch.int32)
    valid = torch.empty(n, device=x.device, dtype=torch.bool)
    stats = RowStats(f32(), f32(), f32(), f32(), f32(), kinf, f32(ns), f32(ns), valid, f32())
    block = block_size(v, x.device)
    _kernels._ce_forward_kernel[(n,)](
        x, x.stride(0), target, x if weight is None else weight, target if keep is None else keep,
        *stats, v, ignore_index, eps, eps / v,
        HAS_W=weight is not None, HAS_KEEP=keep is not None, SMOOTH=eps > 0.0, BLOCK=block,
        num_warps=_num_warps(block), **_ASSERTS,
    )
    return stats


class IndexRows(NamedTuple):
    """The per-row class-index loss (fp32, 0 on invalid rows), the valid mask, the mean's
    denominator term and the focal backward row scale (empty without focal)."""

    loss: Tensor
    valid: Tensor
    den: Tensor
    scale: Tensor


def _index_rows(st: RowStats, target: Tensor, weight: Tensor | None, ignore_index: int,
                gamma: float) -> IndexRows:
    """The loss of each row from the forward kernel's statistics: cross-entropy's is the
    kernel's own; focal's is the row core's focal term (N-sized torch ops)."""
    if gamma == 0.0:
        return IndexRows(st.loss, st.valid, st.den, st.loss.new_empty(0))
    val, scale = focal_terms(st.rest, st.lt, gamma)
    if weight is not None:
        w_t = take(weight, torch.where(target != ignore_index, target, 0).clamp(0, weight.shape[0] - 1))
        val = torch.where(w_t == 0, 0.0, w_t * val)
    return IndexRows(torch.where(st.valid, val, 0.0), st.valid, st.den, scale)


def _backward_kernel(x: Tensor, target: Tensor, weight: Tensor | None, keep: Tensor | None,
                     grad: Tensor, rows: IndexRows, st: RowStats, ignore_index: int, gamma: float,
                     eps: float, out: Tensor) -> None:
    """``grad[i] · d loss_i / d x`` into ``out`` (which may be ``x`` itself: each program reads a
    block of its row before it writes it)."""
    n, v = x.shape
    block = block_size(v, x.device)
    focal = gamma != 0.0
    _kernels._ce_backward_kernel[(n,)](
        x, x.stride(0), target, x if weight is None else weight, target if keep is None else keep,
        grad, grad.stride(0), rows.valid, rows.scale if focal else st.lt, st.lt, st.m, st.s, st.rest,
        st.kinf, st.cnt, st.wsum, out, out.stride(0), v, ignore_index, eps,
        HAS_W=weight is not None, HAS_KEEP=keep is not None, FOCAL=focal, SMOOTH=eps > 0.0,
        BLOCK=block, num_warps=_num_warps(block),
    )


class _TritonIndexLoss(torch.autograd.Function):
    """Class-index cross-entropy (``gamma == 0``) and focal loss on ``(N, V)`` logits, in two
    kernels: the forward reads the logits once, the backward reads them once and writes the
    gradient once. Same values as the torch path to a few ulp.

    Returns the per-row loss (fp32, 0 on invalid rows), the valid mask (target not
    ``ignore_index``, row kept and not fully masked) and the mean's denominator term; the rest
    is saved for the backward. ``rows_fn(x, keep)``: the torch path's per-row loss, for a
    double backward.
    """

    @staticmethod
    def forward(x, target, weight, keep, ignore_index, gamma, eps, rows_fn):
        st = _forward_stats(x, target, weight, keep, ignore_index, eps)
        rows = _index_rows(st, target, weight, ignore_index, gamma)
        return rows.loss, rows.valid, rows.den, rows.scale, *st[1:8]

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, target, weight, keep, ignore_index, gamma, eps, rows_fn = inputs
        _, valid, den, scale, *stats = output
        ctx.mark_non_differentiable(valid, den, scale, *stats)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, target, weight, keep, valid, den, scale, *stats)
        ctx.ignore_index, ctx.gamma, ctx.eps, ctx.rows_fn = ignore_index, gamma, eps, rows_fn

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        x, target, weight, keep, valid, den, scale, lt, m, s, rest, kinf, cnt, wsum = ctx.saved_tensors
        none = (None,) * 8
        if grad_loss is None or not ctx.needs_input_grad[0]:
            return none
        if torch.is_grad_enabled():
            # double backward: the torch path's first derivative, as a graph, on the saved
            # logits (the graph's own input here: a second backward reaches it)
            (gx,) = torch.autograd.grad(ctx.rows_fn(x, keep), x, grad_loss, create_graph=True)
            return (gx, *none[1:])
        st = RowStats(x.new_empty(0), lt, m, s, rest, kinf, cnt, wsum, valid, den)
        rows = IndexRows(x.new_empty(0), valid, den, scale)
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        _backward_kernel(x, target, weight, keep, grad_loss, rows, st, ctx.ignore_index, ctx.gamma,
                         ctx.eps, dx)
        return (dx, *none[1:])


def index_loss(
    x: Tensor, target: Tensor, weight: Tensor | None, keep: Tensor | None, ignore_index: int,
    gamma: float, eps: float, reduction: str, rows_fn: Callable[[Tensor, Tensor | None], Tensor],
) -> Tensor:
    """The reduced class-index loss (fp32) as the torch path reduces it: ``'mean'`` divides by
    ``Σ_{valid} w_t`` (with ``keep`` given, an empty denominator gives 0; with smoothing, where
    ``Σ ℓ`` overflows but the mean does not, ``Σ (ℓ / denominator)``)."""
    loss, _valid, den = _TritonIndexLoss.apply(x, target, weight, keep, ignore_index, gamma, eps, rows_fn)[:3]
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    total = den.sum()
    if keep is not None:
        total = torch.where(total == 0, 1.0, total)
    out = loss.sum() / total
    if eps == 0.0:
        return out
    scaled = (loss / torch.where(total == 0, 1.0, total)).sum()
    return torch.where(torch.isinf(out) & (total != 0), scaled, out)


class RowStep(NamedTuple):
    """What `row_step` returns: the per-row loss (fp32, 0 on invalid rows), the row weight
    (``w_t``, or 1, on valid rows, else 0: the ``'mean'`` denominator) and the logit gradient
    (the logits buffer itself) or ``None``."""

    loss: Tensor
    row_w: Tensor
    grad: Tensor | None


def row_step(
    logits: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, eps: float,
    gamma: float, row_scale: Tensor | None,
) -> RowStep:
    """The fused linear losses' row step: a chunk of fp32 logits → per-row loss and row weight,
    and with ``row_scale`` given ``row_scale[i] · d loss_i / d logits`` **written in place into**
    ``logits`` (a buffer the library owns, never a user's tensor).

    Passes: one read of the chunk (the forward kernel), then one read and one write of the same
    buffer (the backward kernel). No autograd.
    """
    st = _forward_stats(logits, target, weight, None, ignore_index, eps)
    rows = _index_rows(st, target, weight, ignore_index, gamma)
    if row_scale is None:
        return RowStep(rows.loss, rows.den, None)
    _backward_kernel(logits, target, weight, None, row_scale, rows, st, ignore_index, gamma, eps, logits)
    return RowStep(rows.loss, rows.den, logits)


SOFTMAX, LOG_SOFTMAX, LOGSUMEXP = 0, 1, 2


class _TritonSoftmaxFamily(torch.autograd.Function):
    """softmax / log_softmax / logsumexp over the last dimension of a ``(R, C)`` matrix.

    Forward: the row statistics (one read) and, for softmax and log_softmax, a second read and
    one write of the output. Backward: from the saved input and row statistics (the softmax
    recomputed in fp32, so a half-precision gradient is rounded once): softmax and log_softmax
    read the input and the incoming gradient twice and write the gradient once; logsumexp reads
    the input once and writes once. With grad mode on in the backward (double backward) the
    gradient is written with torch ops on the saved input, so it is differentiable again.
    """

    @staticmethod
    def forward(x, mode):
        r, c = x.shape
        m = torch.empty(r, device=x.device, dtype=torch.float32)
        d = torch.empty_like(m)
        k = torch.empty(r, device=x.device, dtype=torch.int32)
        y = torch.empty(r if mode == LOGSUMEXP else (r, c), device=x.device, dtype=x.dtype)
        block = block_size(c, x.device)
        _kernels._softmax_forward_kernel[(r,)](
            x, x.stride(0), y, y.stride(0) if mode != LOGSUMEXP else 1, m, d, k, c,
            MODE=mode, BLOCK=block, num_warps=_num_warps(block),
        )
        return y, m, d, k

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, mode = inputs
        _y, m, d, k = output
        ctx.mark_non_differentiable(m, d, k)
        ctx.set_materialize_grads(False)
        ctx.mode = mode
        ctx.save_for_backward(x, m, d, k)

    @staticmethod
    def backward(ctx, grad, *_unused):
        x, m, d, k = ctx.saved_tensors
        if grad is None:
            return None, None
        mode = ctx.mode
        if torch.is_grad_enabled():
            return _softmax_family_graph(mode, x, grad), None
        r, c = x.shape
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        block = block_size(c, x.device)
        if mode == LOGSUMEXP:
            _kernels._logsumexp_backward_kernel[(r,)](
                x, x.stride(0), grad.contiguous(), m, d, k, dx, dx.stride(0), c,
                BLOCK=block, num_warps=_num_warps(block),
            )
            return dx, None
        g = grad if grad.stride(-1) == 1 else grad.contiguous()
        _kernels._softmax_backward_kernel[(r,)](
            x, x.stride(0), g, g.stride(0), m, d, k, dx, dx.stride(0), c,
            LOG=mode == LOG_SOFTMAX, BLOCK=block, num_warps=_num_warps(block),
        )
        return dx, None


_FMAX = torch.finfo(torch.float32).max


def _softmax_graph(xf: Tensor) -> tuple[Tensor, Tensor]:
    """The kernels' softmax of fp32 rows as differentiable torch ops (double backward only), and
    the mask of entries whose log-softmax is ``-inf``: ``+inf`` → ``finfo.max`` (uniform over
    the ``+inf`` entries), the shift 0 on all-``-inf`` rows (their softmax 0)."""
    xb = torch.where(xf > _FMAX, _FMAX, xf)
    m = xb.detach().amax(-1, keepdim=True)
    dead = m == -float("inf")
    e = torch.exp(xb - torch.where(dead, 0.0, m))
    s = e.sum(-1, keepdim=True)
    pinf = (xf == float("inf")).any(-1, keepdim=True)
    ninf = (xf == -float("inf")) | dead | (pinf & (xf != float("inf")))
    return e / torch.where(s == 0, 1.0, s), ninf


def _softmax_family_graph(mode: int, x: Tensor, grad: Tensor) -> Tensor:
    """The first derivative as differentiable torch ops on the saved input (double backward)."""
    p, ninf = _softmax_graph(x.float())
    g = grad.float()
    if mode == SOFTMAX:
        return (p * (g - (g * p).sum(-1, keepdim=True))).to(x.dtype)
    if mode == LOG_SOFTMAX:
        g = g.masked_fill(ninf, 0.0)
        return (g - p * g.sum(-1, keepdim=True)).to(x.dtype)
    return (p * g.unsqueeze(-1)).to(x.dtype)


def softmax_family(x: Tensor, mode: int) -> Tensor:
    """``softmax`` / ``log_softmax`` of a ``(R, C)`` matrix (``(R, C)`` out) or its
    ``logsumexp`` (``(R,)`` out), in ``x``'s dtype."""
    return _TritonSoftmaxFamily.apply(x, mode)[0]


_ELEMENTWISE_BLOCK = 1024


class _TritonSigmoidFocal(torch.autograd.Function):
    """Elementwise sigmoid focal loss (fp32 out, 0 where ``keep`` is False): one kernel forward,
    one kernel backward (``target`` gets no gradient: a target that requires grad takes the
    torch path). ``rows_fn(x)``: the torch path's unreduced loss, for a double backward."""

    @staticmethod
    def forward(x, t, keep, alpha, gamma, rows_fn):
        loss = torch.empty(x.shape, device=x.device, dtype=torch.float32)
        n = x.numel()
        _kernels._sigmoid_focal_forward_kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](
            x, t, t if keep is None else keep, loss, n, alpha, gamma, HAS_ALPHA=alpha >= 0,
            FOCAL=gamma != 0.0, HAS_KEEP=keep is not None, BLOCK=_ELEMENTWISE_BLOCK,
        )
        return loss

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, t, keep, alpha, gamma, rows_fn = inputs
        ctx.save_for_backward(x, t, keep)
        ctx.alpha, ctx.gamma, ctx.rows_fn = alpha, gamma, rows_fn

    @staticmethod
    def backward(ctx, grad):
        x, t, keep = ctx.saved_tensors
        none = (None,) * 6
        if torch.is_grad_enabled():  # double backward: the torch path's differentiable form
            (gx,) = torch.autograd.grad(ctx.rows_fn(x), x, grad, create_graph=True)
            return (gx, *none[1:])
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        n = x.numel()
        g = grad.contiguous()
        _kernels._sigmoid_focal_backward_kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](
            x, t, t if keep is None else keep, g, 1, dx, n, 1.0, ctx.alpha, ctx.gamma,
            HAS_ALPHA=ctx.alpha >= 0, FOCAL=ctx.gamma != 0.0, HAS_KEEP=keep is not None,
            BLOCK=_ELEMENTWISE_BLOCK,
        )
        return (dx, *none[1:])


def sigmoid_focal(x: Tensor, t: Tensor, keep: Tensor | None, alpha: float, gamma: float, reduction: str,
                  rows_fn: Callable[[Tensor], Tensor]) -> Tensor:
    """The reduced sigmoid focal loss (fp32) of contiguous ``x`` and ``t`` of one shape; with
    ``keep`` (bool, ``x``'s shape) the entries not kept count 0 and ``'mean'`` divides by the
    kept count (0 when none is kept), as the torch path's masked reduction."""
    loss = _TritonSigmoidFocal.apply(x, t, keep, alpha, gamma, rows_fn)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if keep is None:
        return loss.mean()
    return loss.sum() / keep.sum().clamp(min=1)
