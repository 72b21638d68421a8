"""logsumexp, softmax and log_softmax with defined values on all-``-inf`` and ``+inf`` slices.

The textbook kernels subtract the slice maximum ``m``. When ``m`` is infinite that
subtraction is ``inf - inf`` = NaN, which is where ``torch.softmax`` and the gradient of
``torch.logsumexp`` go NaN. The limits are:

* all entries ``-inf``: ``logsumexp = -inf``, ``softmax = 0``, ``log_softmax = -inf``,
  and every gradient 0 (the output does not move when any input moves);
* some entries ``+inf``: ``logsumexp = +inf`` and the probability mass is uniform over the
  ``+inf`` entries (``softmax → 1/k`` there, 0 elsewhere), with finite gradients.

A NaN anywhere in a slice makes the whole slice NaN, value and gradient, as in torch.

The rows themselves (the bound of the hazard rows, the exact shift) come from the row core
(``rows.py``), which the class losses share.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from stablelosses._autograd._base import StableFunction
from stablelosses._autograd.rows import bounded, exact_log_softmax, softmax_limits, softmax_over
from stablelosses._compat import log_softmax_backward as _log_softmax_kernel_bwd
from stablelosses._compat import softmax_backward as _softmax_kernel_bwd
from stablelosses._utils import inplace_ok

_INF = float("inf")


def _save_output(ctx, inputs, output):
    """setup_context of softmax and log_softmax: both differentiate from their output."""
    ctx.dim = inputs[1]
    ctx.save_for_backward(output)
    ctx.save_for_forward(output)


class _Softmax(StableFunction):
    """Softmax; 0 on all-``-inf`` slices; uniform over ``+inf`` entries (an entry equal to
    ``finfo.max`` on such a slice counts with them: `rows.softmax_limits`).

    Backward ``y · (g − Σ g·y)`` from the saved output: 0 wherever ``y`` is 0, so masked
    entries and all-masked slices get gradient 0.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, dim: int) -> Tensor:
        if x.shape[dim] == 0:  # the wrapper makes scalars 1-d
            return torch.softmax(x, dim)
        return softmax_limits(x, dim)

    setup_context = staticmethod(_save_output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (y,) = ctx.saved_tensors
        return _softmax_kernel_bwd(grad, y, ctx.dim), None

    @staticmethod
    def jvp(ctx, x_t: Tensor, _dim_t):
        # y ⊙ (ẋ − Σ y·ẋ): 0 where y is 0 (masked entries, all-masked slices); the tangent
        # of an entry with y = 0 is dropped before the sum (double where: 0·inf never forms)
        (y,) = ctx.saved_tensors
        x_t = torch.where(y == 0, 0.0, x_t)
        return y * (x_t - (y * x_t).sum(ctx.dim, keepdim=True))


class _LogSoftmax(StableFunction):
    """Log-softmax; ``-inf`` on all-``-inf`` slices; ``-log k`` on the ``k`` ``+inf`` entries and
    ``-inf`` on the finite entries of such a slice.

    Forward: torch's kernel on the exact shift ``x − max`` (`exact_log_softmax`; on a finite
    slice torch's kernel makes the same shift, so the value is torch's — the argmax entry
    rounds as torch's does, ``0`` where ``log(1 + δ)`` rounds to 0: its exact tail
    ``−log1p(δ)`` would need every ``exp`` again, one pass more than the budget), the slices
    with an infinite max fixed from the N-sized max. (Not the bounded logits with a select:
    that form made ``-(q * log_softmax(x)).sum()`` 3.9x slower compiled, 8192x1000 fwd+bwd.)
    Backward ``g − softmax · Σ g`` from the saved output, with the incoming gradient of every
    ``-inf`` output (masked entries, all-masked slices, entries dominated by ``+inf``) taken as
    0: those outputs do not move when any input moves. Their own gradient is then 0 too.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, dim: int) -> Tensor:
        if x.shape[dim] == 0:  # the wrapper makes scalars 1-d
            return torch.log_softmax(x, dim)
        return exact_log_softmax(x, dim, masked_rows_inf=True)[0]

    setup_context = staticmethod(_save_output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (y,) = ctx.saved_tensors
        # A -inf output does not move, so its incoming gradient is dropped before the sum
        # (e.g. label smoothing's -ε/C on a masked class); its own gradient is then
        # g - exp(-inf)·Σg = 0.
        g = torch.where(torch.isneginf(y), 0.0, grad)
        return _log_softmax_kernel_bwd(g, y, ctx.dim, inplace_ok(g)), None

    @staticmethod
    def jvp(ctx, x_t: Tensor, _dim_t):
        # ẋ − Σ softmax·ẋ; a -inf output does not move (tangent 0), and its input's tangent
        # does not enter the sum (its probability is 0)
        (y,) = ctx.saved_tensors
        dead = torch.isneginf(y)
        x_t = torch.where(dead, 0.0, x_t)
        out = x_t - (torch.exp(y) * x_t).sum(ctx.dim, keepdim=True)
        return torch.where(dead, 0.0, out)


def _lse_softmax(
    x: Tensor, out: Tensor, dims: tuple[int, ...], keepdim: bool, grad: Tensor | None = None
) -> Tensor:
    """The softmax of ``x`` over ``dims`` from logsumexp's output, normalised by its own sum,
    times ``grad`` (broadcast over ``dims``) when given.

    ``exp(x - out)`` alone sums to 1 only where ``out`` rounds well: on a ``finfo.min`` slice
    ``out`` rounds back to ``finfo.min`` and every term is 1. Dividing by the computed sum
    gives the exact softmax at every magnitude. ``out = -inf``: shift by 0, every term is 0
    (sum 1 by fiat, gradient 0). ``out = +inf``: the ``+inf`` entries equal the shift (their
    ``x - out`` is NaN), those terms become 1, and the sum counts them. NaN slices stay NaN.
    Also the compiled first-order backward: two fused passes over the slice (a sum and the
    output), where bounded + softmax found the max again (benchmarks/spellings.md).
    """
    if not keepdim:  # the wrapper makes scalars 1-d
        for d in sorted(dims):
            out = out.unsqueeze(d)
            grad = None if grad is None else grad.unsqueeze(d)
    neg_inf = out == -_INF
    shift = out.masked_fill(neg_inf, 0)
    # Double where (the NaN exponents become 0 before exp), so double backward never
    # multiplies a zero gradient by NaN; a compare, which inductor vectorizes, not isnan.
    e = torch.exp(torch.where(x == shift, 0.0, x - shift))
    p = e / torch.where(neg_inf, 1.0, e.sum(dims, keepdim=True))
    return p if grad is None else p * grad


class _LogSumExp(StableFunction):
    """``log Σ exp x`` over ``dims``: torch's kernel forward (its rounding, and its ``±inf``
    and NaN values); the gradient is the softmax of ``x`` with the limits above.

    One dimension, first order: torch's ``softmax`` kernel on `bounded` x (bounded from the
    output: ``out ≥ max``, infinite exactly where the max is), times the incoming gradient
    with 0 on all-``-inf`` slices. One bound pass, the softmax's read and write and the
    multiply: torch's own backward (``grad · exp(x − out)``) makes as many passes. Compiled,
    double backward and several dimensions: the differentiable `_lse_softmax`.

    The argmax entry's exact tail (``log1p`` of the other terms, where ``1 + δ`` rounds to 1)
    is not kept here: it needs every ``exp`` in the forward, two passes over the input more
    than torch's (1.43x torch's bytes, measured) for a rounding torch makes too.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, dims: Sequence[int], keepdim: bool) -> Tensor:
        return torch.logsumexp(x, tuple(dims), keepdim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, dims, keepdim = inputs
        ctx.dims = tuple(dims)
        ctx.keepdim = keepdim
        ctx.save_for_backward(x, output)
        ctx.save_for_forward(x, output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, out = ctx.saved_tensors
        if (len(ctx.dims) != 1 or x.shape[ctx.dims[0]] == 0 or torch.is_grad_enabled()
                or torch.compiler.is_compiling()):
            # NaN slices: the NaN in the softmax carries through
            return _lse_softmax(x, out, ctx.dims, ctx.keepdim, grad), None, None
        dim = ctx.dims[0]
        if not ctx.keepdim:
            out, grad = out.unsqueeze(dim), grad.unsqueeze(dim)
        g = grad.masked_fill(out == -_INF, 0.0)
        p = softmax_over(bounded(x, out), dim)
        # written over p, the backward's own buffer: one (N, C) buffer fewer at the peak
        # (logsumexp 1024x1000 fwd+bwd peak 0.67x → 0.33x torch's); not when g is batched
        # (a vmap over the backward: gradcheck's batched grad, jacobian(vectorize=True)),
        # where the unbatched p cannot take it in place
        return (p.mul_(g) if inplace_ok(p, g) else p * g), None, None

    @staticmethod
    def jvp(ctx, x_t: Tensor, _dims_t, _keepdim_t):
        x, out = ctx.saved_tensors
        p = _lse_softmax(x, out, ctx.dims, ctx.keepdim)
        # entries of zero probability do not move the sum (double where: 0·inf never forms)
        return (p * torch.where(p == 0, 0.0, x_t)).sum(ctx.dims, keepdim=ctx.keepdim)
