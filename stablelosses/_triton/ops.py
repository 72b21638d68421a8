"""The kernel path's autograd Functions (imports triton through ``_kernels``).

First order only: the backward is one kernel call, not differentiable again. A backward run
with grad mode on (double backward, ``create_graph=True``) recomputes the first derivative
with the torch path on the saved logits, so a second backward still works.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from torch import Tensor

from stablelosses._autograd.rows import focal_terms
from stablelosses._triton import _kernels

# The widest block one program reads at a time (a power of two). Rows wider than this take
# several blocks; tests lower it to exercise multi-block rows at small widths.
MAX_BLOCK = {"cuda": 8192, "cpu": 32768}


def block_size(n_cols: int, device: torch.device) -> int:
    """The block width for rows of ``n_cols`` entries: a launch parameter, not a branch."""
    return max(16, min(triton.next_power_of_2(n_cols), MAX_BLOCK.get(device.type, 8192)))


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


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
        num_warps=_num_warps(block),
    )
    return stats


class _TritonIndexLoss(torch.autograd.Function):
    """Class-index cross-entropy (``gamma == 0``) and focal loss on ``(N, V)`` logits, in two
    kernels: the forward reads the logits once, the backward reads them once and writes the
    gradient once. Same values as ``_ClassIndexCE`` (the torch path) to a few ulp.

    Returns the per-row loss (fp32, 0 on invalid rows) and the valid mask (target not
    ``ignore_index``, row kept and not fully masked); the rest is saved for the backward.
    """

    @staticmethod
    def forward(x, target, weight, keep, ignore_index, gamma, eps):
        st = _forward_stats(x, target, weight, keep, ignore_index, eps)
        valid = st.valid
        loss, scale = st.loss, st.loss.new_empty(0)
        if gamma != 0.0:
            # the focal value and backward row scale, N-sized (the torch path's focal_terms)
            val, scale = focal_terms(st.rest, st.lt, gamma)
            if weight is not None:
                w_t = weight[torch.where(target != ignore_index, target, 0).clamp(0, x.shape[1] - 1)]
                val = torch.where(w_t == 0, 0.0, w_t * val)
            loss = torch.where(valid, val, 0.0)
        return loss, valid, st.den, scale, *st[1:8]

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, target, weight, keep, ignore_index, gamma, eps = inputs
        _, valid, den, scale, *stats = output
        ctx.mark_non_differentiable(valid, den, scale, *stats)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, target, weight, keep, valid, scale, *stats)
        ctx.ignore_index, ctx.gamma, ctx.eps = ignore_index, gamma, eps

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        x, target, weight, keep, valid, scale, lt, m, s, rest, kinf, cnt, wsum = ctx.saved_tensors
        if grad_loss is None or not ctx.needs_input_grad[0]:
            return (None,) * 7
        if torch.is_grad_enabled():
            return _differentiable_grad(ctx, x, target, weight, keep, grad_loss)
        n, v = x.shape
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        block = block_size(v, x.device)
        focal = ctx.gamma != 0.0
        _kernels._ce_backward_kernel[(n,)](
            x, x.stride(0), target, x if weight is None else weight, target if keep is None else keep,
            grad_loss, grad_loss.stride(0), valid, scale if focal else lt, lt, m, s, rest, kinf, cnt, wsum,
            dx, dx.stride(0), v, ctx.ignore_index, ctx.eps,
            HAS_W=weight is not None, HAS_KEEP=keep is not None, FOCAL=focal, SMOOTH=ctx.eps > 0.0,
            BLOCK=block, num_warps=_num_warps(block),
        )
        return dx, None, None, None, None, None, None


def _differentiable_grad(ctx, x, target, weight, keep, grad_loss):
    """Double backward: the torch path's first derivative, as a graph, on the saved logits."""
    from stablelosses import _backend
    from stablelosses.functional import cross_entropy, focal_loss

    with _backend.backend("torch"):
        args = dict(weight=weight, ignore_index=ctx.ignore_index, reduction="none", mask=keep)
        if ctx.gamma == 0.0:
            loss = cross_entropy(x.float(), target, label_smoothing=ctx.eps, **args)
        else:
            loss = focal_loss(x.float(), target, ctx.gamma, **args)
    # the saved x is the graph's own input here: a second backward reaches it
    (gx,) = torch.autograd.grad(loss, x, grad_loss, create_graph=True)
    return gx, None, None, None, None, None, None


def index_loss(
    x: Tensor, target: Tensor, weight: Tensor | None, keep: Tensor | None, ignore_index: int,
    gamma: float, eps: float, reduction: str,
) -> Tensor:
    """The reduced class-index loss (fp32) as the torch path reduces it: ``'mean'`` divides by
    ``Σ_{valid} w_t`` (with ``keep`` given, an empty denominator gives 0; with smoothing, where
    ``Σ ℓ`` overflows but the mean does not, ``Σ (ℓ / denominator)``)."""
    loss, _valid, den = _TritonIndexLoss.apply(x, target, weight, keep, ignore_index, gamma, eps)[:3]
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


SOFTMAX, LOG_SOFTMAX, LOGSUMEXP = 0, 1, 2


class _TritonSoftmaxFamily(torch.autograd.Function):
    """softmax / log_softmax / logsumexp over the last dimension of a ``(R, C)`` matrix.

    Forward: the row statistics (one read) and, for softmax and log_softmax, a second read and
    one write of the output. Backward: softmax and log_softmax from the saved output (two reads
    of the output and the incoming gradient, one write); logsumexp from the saved statistics
    (one read of the input, one write). With grad mode on in the backward (double backward) the
    gradient is written with torch ops on the saved tensors, so it is differentiable again.
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
        y, m, d, k = output
        ctx.mark_non_differentiable(m, d, k)
        ctx.set_materialize_grads(False)
        ctx.mode = mode
        ctx.save_for_backward(x if mode == LOGSUMEXP else None, y, m, d, k)

    @staticmethod
    def backward(ctx, grad, *_unused):
        x, y, m, d, k = ctx.saved_tensors
        if grad is None:
            return None, None
        mode = ctx.mode
        if torch.is_grad_enabled():
            return _softmax_family_graph(mode, x, y, grad), None
        if mode == LOGSUMEXP:
            r, c = x.shape
            dx = torch.empty_like(x, memory_format=torch.contiguous_format)
            block = block_size(c, x.device)
            _kernels._logsumexp_backward_kernel[(r,)](
                x, x.stride(0), grad.contiguous(), m, d, k, dx, dx.stride(0), c,
                BLOCK=block, num_warps=_num_warps(block),
            )
            return dx, None
        r, c = y.shape
        g = grad if grad.stride(-1) == 1 else grad.contiguous()
        dx = torch.empty_like(y, memory_format=torch.contiguous_format)
        block = block_size(c, y.device)
        _kernels._softmax_backward_kernel[(r,)](
            y, y.stride(0), g, g.stride(0), dx, dx.stride(0), c,
            LOG=mode == LOG_SOFTMAX, BLOCK=block, num_warps=_num_warps(block),
        )
        return dx, None


def _softmax_family_graph(mode: int, x: Tensor | None, y: Tensor, grad: Tensor) -> Tensor:
    """The first derivative as differentiable torch ops (double backward)."""
    if mode == SOFTMAX:
        yf, g = y.float(), grad.float()
        return (yf * (g - (g * yf).sum(-1, keepdim=True))).to(y.dtype)
    if mode == LOG_SOFTMAX:
        yf = y.float()
        g = grad.float().masked_fill(yf == -float("inf"), 0.0)
        return (g - torch.exp(yf) * g.sum(-1, keepdim=True)).to(y.dtype)
    from stablelosses import _backend
    from stablelosses.functional import softmax

    assert x is not None
    with _backend.backend("torch"):
        p = softmax(x.float(), -1)
    return (p * grad.float().unsqueeze(-1)).to(x.dtype)


def softmax_family(x: Tensor, mode: int) -> Tensor:
    """``softmax`` / ``log_softmax`` of a ``(R, C)`` matrix (``(R, C)`` out) or its
    ``logsumexp`` (``(R,)`` out), in ``x``'s dtype."""
    return _TritonSoftmaxFamily.apply(x, mode)[0]


_ELEMENTWISE_BLOCK = 1024


class _TritonSigmoidFocal(torch.autograd.Function):
    """Elementwise sigmoid focal loss (fp32 out): one kernel forward, one kernel backward
    (``target`` gets no gradient: a target that requires grad takes the torch path)."""

    @staticmethod
    def forward(x, t, alpha, gamma):
        loss = torch.empty(x.shape, device=x.device, dtype=torch.float32)
        n = x.numel()
        _kernels._sigmoid_focal_forward_kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](
            x, t, loss, n, alpha, gamma, HAS_ALPHA=alpha >= 0, FOCAL=gamma != 0.0,
            BLOCK=_ELEMENTWISE_BLOCK,
        )
        return loss

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, t, alpha, gamma = inputs
        ctx.save_for_backward(x, t)
        ctx.alpha, ctx.gamma = alpha, gamma

    @staticmethod
    def backward(ctx, grad):
        x, t = ctx.saved_tensors
        if torch.is_grad_enabled():  # double backward: the torch path's differentiable form
            from stablelosses import _backend
            from stablelosses.functional import sigmoid_focal_loss

            with _backend.backend("torch"):
                loss = sigmoid_focal_loss(x.float(), t.float(), ctx.alpha, ctx.gamma, "none")
            (gx,) = torch.autograd.grad(loss, x, grad, create_graph=True)
            return gx, None, None, None
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        n = x.numel()
        g = grad.contiguous()
        _kernels._sigmoid_focal_backward_kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](
            x, t, g, 1, dx, n, 1.0, ctx.alpha, ctx.gamma, HAS_ALPHA=ctx.alpha >= 0,
            FOCAL=ctx.gamma != 0.0, BLOCK=_ELEMENTWISE_BLOCK,
        )
        return dx, None, None, None


def sigmoid_focal(x: Tensor, t: Tensor, alpha: float, gamma: float, reduction: str) -> Tensor:
    """The reduced sigmoid focal loss (fp32) of contiguous ``x`` and ``t`` of one shape."""
    loss = _TritonSigmoidFocal.apply(x, t, alpha, gamma)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.mean()


class ChunkStep(NamedTuple):
    """What `linear_chunk_step` returns per row: the loss (fp32, 0 on invalid rows), the
    log-sum-exp of the (clamped) logits, and the valid mask."""

    loss: Tensor
    lse: Tensor
    valid: Tensor


def linear_chunk_step(
    logits: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, gamma: float = 0.0,
    eps: float = 0.0, keep: Tensor | None = None,
) -> ChunkStep:
    """The per-chunk step of the linear losses: a chunk of logits → per-row loss and lse, and
    ``d Σ_i loss_i / d logits`` **written in place into** ``logits``.

    ``logits`` must be a buffer the library owns (the chunk's matmul output), never a user's
    tensor: its values are gone afterwards. Passes: one read (the forward kernel), then one read
    and one write of the same buffer (the backward kernel with a unit incoming gradient; each
    program reads a block of its row before it writes it). No autograd: the caller scales the
    gradient by the loss's incoming gradient when it forms the input and weight gradients.
    """
    st = _forward_stats(logits, target, weight, keep, ignore_index, eps)
    valid = st.valid
    loss, scale = st.loss, st.loss.new_empty(0)
    if gamma != 0.0:
        val, scale = focal_terms(st.rest, st.lt, gamma)
        if weight is not None:
            w_t = weight[torch.where(target != ignore_index, target, 0).clamp(0, logits.shape[1] - 1)]
            val = torch.where(w_t == 0, 0.0, w_t * val)
        loss = torch.where(valid, val, 0.0)
    n, v = logits.shape
    ones = torch.ones(1, device=logits.device, dtype=torch.float32)
    block = block_size(v, logits.device)
    _kernels._ce_backward_kernel[(n,)](
        logits, logits.stride(0), target, logits if weight is None else weight,
        target if keep is None else keep, ones, 0, valid, scale if gamma != 0.0 else st.lt, st.lt, st.m,
        st.s, st.rest, st.kinf, st.cnt, st.wsum, logits, logits.stride(0), v, ignore_index, eps,
        HAS_W=weight is not None, HAS_KEEP=keep is not None, FOCAL=gamma != 0.0, SMOOTH=eps > 0.0,
        BLOCK=block, num_warps=_num_warps(block),
    )
    pinf = st.kinf > 0
    lse = torch.where(pinf, float("inf"), torch.where(st.m == -float("inf"), st.m, st.m + torch.log(st.s)))
    return ChunkStep(loss, lse, valid)
