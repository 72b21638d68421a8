"""Fused linear + cross-entropy / focal loss that never holds the ``(N, V)`` logits.

The rows are processed in chunks of ``chunk`` rows. Each chunk computes its logits ``x W^T + b``
in the compute dtype (float32, float64 for float64 inputs), its per-row loss and, when gradients
are wanted, ``d loss / d logits`` in place in the same buffer, which it multiplies straight into
the gradients of the input rows, the weight and the bias. Only ``chunk × V`` numbers exist at
once. A weight narrower than the compute dtype (bf16/fp16) is converted one vocabulary block of
``W_BLOCK_BYTES`` at a time, never whole; its gradient is accumulated across chunks in a
``(V, H)`` accumulator in the compute dtype. Eagerly the chunk loop is a Python loop; while
compiling it runs inside the custom op ``stablelosses::linear_loss_chunks``, so the compiled
graph (and its compile time) does not depend on ``N``.

Per row, with ``m = max_j l_j`` (0 for an all ``-inf`` row; ``amax``, no index), ``z = l_t - m``
and ``D = Σ_{j ≠ t} e^{l_j - m}`` (the target's term zeroed before the sum), ``S - 1 = D + expm1(z)``:

    lse = m + log1p(S - 1),   log p_t = z - log1p(S - 1),   p = e^{l - m} / S,

so ``log p_t`` and ``1 - p_t = -expm1(log p_t)`` keep full relative accuracy as ``p_t → 1``
(there ``z = 0`` and ``S - 1 = D``; elsewhere ``D ≥ 1``, the max's own term).
The gradient with respect to the logits is ``α p - β onehot(t) - δ_c [unmasked]`` with row
scales (``w`` the class weights, 1 without; ``W_U`` their sum over the ``K`` unmasked classes):
cross-entropy ``α = (1 - ε) w_t + ε W_U / K + 2 z w_t lse``, ``β = (1 - ε) w_t``,
``δ_c = ε w_c / K``; focal ``α = w_t (A + 2 z lse)``, ``β = w_t A``,
``A = (1 - p_t)^γ (1 + γ p_t r)``, ``r = -log p_t / (1 - p_t)``.
Softcapping ``l = c tanh(u / c)`` multiplies it by ``1 - tanh²``.

Two Functions: :class:`_LinearLossReduced` ('mean'/'sum') computes the gradients in its forward
and its backward scales them by the incoming (scalar) gradient; :class:`_LinearLossRows`
('none') returns the per-row losses and recomputes the chunks in its backward, where the row
weights (the incoming gradient) are known. Neither can be differentiated twice: the gradient
they return raises on a second backward instead of giving a wrong second derivative.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from stablelosses._autograd.rows import focal_rows, target_nll
from stablelosses._utils import no_autocast

_NEG_INF = float("-inf")


class LinearLossConfig(NamedTuple):
    """Python-level settings shared by both Functions (hashable, constant under compile)."""

    fn: str
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float | None
    gamma: float | None  # None: cross-entropy; a number: focal loss
    chunk: int


def chunk_loss(
    x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cw: Tensor | None, cfg: LinearLossConfig,
    row_scale: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Loss of each row of one chunk, its row weight and ``row_scale · d loss / d u`` (``u = x W^T + b``).

    ``x`` is ``(n, H)`` and ``b`` ``(V,)`` in the compute dtype, ``w`` ``(V, H)`` in its own dtype
    (converted one vocabulary block at a time when that is narrower), ``t`` ``(n,)`` int64,
    ``cw`` the class weights ``(V,)`` in the compute dtype or ``None``. ``row_scale`` ``(n, 1)``
    (``None``: no gradient). Returns the loss ``(n,)`` (0 on invalid rows), the row weight
    ``(n,)`` (``w_{t_i}`` on valid rows, 0 elsewhere: the denominator of ``'mean'``) and the
    ``(n, V)`` gradient, which reuses the logits buffer.

    One function on purpose (about 80 lines): the one ``(n, V)`` buffer goes through every step in
    place (logits, ``exp``, gradient), and a split would pass a dozen per-row intermediates.
    """
    u = logits_of(x, w, b)
    eps, zl = cfg.label_smoothing, cfg.z_loss
    masked = u == _NEG_INF if (cfg.softcap is not None or eps > 0.0) else None
    th = None
    if cfg.softcap is not None:
        assert masked is not None
        # l = c tanh(u / c); a -inf (masked) logit stays masked.
        th = u.div_(cfg.softcap).tanh_()
        logits = (th * cfg.softcap).masked_fill_(masked, _NEG_INF)
    else:
        # +inf -> finfo.max: the limit distribution, uniform over the +inf entries.
        logits = u.clamp_(max=torch.finfo(u.dtype).max)
    # amax, not max with its index: torch's CPU index reduction is not vectorised
    m = logits.amax(dim=1, keepdim=True)
    dead = m == _NEG_INF  # all -inf rows
    m_safe = torch.where(dead, 0.0, m)
    kept = t != cfg.ignore_index
    valid = kept & ~dead.squeeze(1)
    t_safe = torch.where(kept, t, 0).unsqueeze(1)
    lt_shift = logits.gather(1, t_safe) - m_safe
    # the target class's weight w_t (n, 1); None: every weight is 1
    wt = None if cw is None else cw.gather(0, t_safe.squeeze(1)).unsqueeze(1)
    if eps > 0.0:
        assert masked is not None
        k = (logits.shape[1] - masked.sum(1, keepdim=True)).clamp_(min=1).to(logits.dtype)
        # Σ_{unmasked c} w_c (m - l_c): non-negative terms, no cancellation, no inf - inf.
        diff = (m_safe - logits).masked_fill_(masked, 0.0)
        if cw is None:
            smooth, wu = diff.sum(1, keepdim=True), k
        else:
            smooth = (diff @ cw).unsqueeze(1)
            # W_U = Σ_{unmasked c} w_c
            wu = (cw.sum() - masked.to(cw.dtype) @ cw).unsqueeze(1)
        del diff
    e = logits.sub_(m_safe).exp_()
    e.scatter_(1, t_safe, 0.0)
    d = e.sum(1, keepdim=True)
    # the row core's formula (rows.target_nll): S - 1 = D + expm1(-w), -log p_t = log S + w;
    # on all -inf rows z = -inf and D = 0: S = 1 there (log p_t = -inf, finite scales)
    sm1, log_s, nll = target_nll(lt_shift.neg(), d, dead=dead)
    lse = m + log_s
    if cfg.gamma is None:
        nlpt = nll if wt is None else wt * nll
        loss = nlpt if eps == 0.0 else eps * (smooth / k + (wu / k) * log_s)
        if 0.0 < eps < 1.0:
            loss = loss + (1.0 - eps) * nlpt
    else:
        # the row core's focal term: 1 - p_t = D / S, p_t = e^{-nll}
        val, a_focal = focal_rows(d / (1.0 + sm1), torch.exp(nll.neg()), nll, cfg.gamma)
        loss = val if wt is None else wt * val
    if zl > 0.0:
        z_row = zl * lse.square()
        loss = loss + (z_row if wt is None else wt * z_row)
    vcol = valid.unsqueeze(1)
    loss = torch.where(vcol, loss, 0.0).squeeze(1)
    row_w = valid.to(loss.dtype) if wt is None else torch.where(vcol, wt, 0.0).squeeze(1)
    if row_scale is None:
        return loss, row_w, None
    s = torch.where(vcol, row_scale, 0.0)
    sw = s if wt is None else s * wt
    if cfg.gamma is None:
        # α = s ((1 - ε) w_t + ε W_U / K): s alone without class weights (W_U = K)
        beta = sw * (1.0 - eps)
        if eps == 0.0:
            alpha = beta
        else:
            alpha = s if wt is None else beta + s * (eps * wu / k)
    else:
        alpha = beta = sw * a_focal
    if zl > 0.0:
        alpha = alpha + sw * (2.0 * zl) * lse
    # lse = -inf on all -inf rows: 0 * -inf would be NaN.
    alpha = torch.where(vcol, alpha, 0.0)
    g = e.scatter_(1, t_safe, torch.exp(lt_shift)).mul_(alpha / (1.0 + sm1))
    if eps > 0.0:
        assert masked is not None
        if cw is None:
            g.sub_(s * (eps / k))
        else:
            g.addcmul_(s * (eps / k), cw, value=-1.0)
        g.masked_fill_(masked, 0.0)
    g.scatter_add_(1, t_safe, beta.neg())
    if th is not None:
        # d c tanh(u / c) / du = 1 - tanh²: 0 at masked (-inf) entries.
        g.mul_(th.square_().neg_().add_(1.0))
    return loss, row_w, g


class Grads(NamedTuple):
    """Gradients of the summed loss with respect to input, weight and bias (None: not wanted)."""

    input: Tensor | None
    weight: Tensor | None
    bias: Tensor | None


# Bytes of one vocabulary block of the weight converted to the compute dtype (16 MiB): a weight
# narrower than the compute dtype (bf16/fp16 with float32 compute) is never converted whole.
W_BLOCK_BYTES = 16 * 2**20


def block_rows(w: Tensor, cd: torch.dtype) -> int:
    """Vocabulary rows per converted block of ``w`` (all of them when ``w`` is already in ``cd``)."""
    if w.dtype == cd:
        return max(w.shape[0], 1)
    return max(1, W_BLOCK_BYTES // (max(w.shape[1], 1) * (torch.finfo(cd).bits // 8)))


def logits_of(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``x W^T + b`` ``(n, V)`` in ``x``'s dtype; a narrower ``w`` is converted block by block."""
    cd = x.dtype
    if w.dtype == cd:
        return x @ w.t() if b is None else torch.addmm(b, x, w.t())
    rows = block_rows(w, cd)
    u = torch.empty((x.shape[0], w.shape[0]), dtype=cd, device=x.device)
    for v0 in range(0, w.shape[0], rows):
        blk = slice(v0, v0 + rows)
        if b is None:
            u[:, blk].addmm_(x, w[blk].to(cd).t(), beta=0.0)  # beta 0: the empty buffer is not read
        else:
            u[:, blk].copy_(b[blk]).addmm_(x, w[blk].to(cd).t())
    return u


def _input_grad(g: Tensor, w: Tensor) -> Tensor:
    """``g W`` ``(n, H)`` in ``g``'s dtype; a narrower ``w`` is converted block by block."""
    cd = g.dtype
    if w.dtype == cd:
        return g @ w
    rows = block_rows(w, cd)
    out = torch.zeros((g.shape[0], w.shape[1]), dtype=cd, device=g.device)
    for v0 in range(0, w.shape[0], rows):
        out.addmm_(g[:, v0 : v0 + rows], w[v0 : v0 + rows].to(cd))
    return out


def run_chunks(
    x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cw: Tensor | None, cfg: LinearLossConfig,
    needs: tuple[bool, bool, bool], row_scale: Tensor | None, cd: torch.dtype,
) -> tuple[Tensor, Tensor, Grads]:
    """Loop over row chunks: per-row loss ``(N,)``, row weight ``(N,)`` and the summed gradients.

    ``row_scale`` ``(N,)`` weighs each row's gradient (``None``: weight 1 when any of ``needs``).
    Gradients are accumulated in the compute dtype ``cd`` (the weight's in a ``(V, H)``
    accumulator in ``cd``, which is the returned gradient itself when ``w`` is in ``cd``).
    While compiling, the loop runs inside one opaque custom op (:func:`_chunks_op`): the graph
    does not depend on ``N`` and the loop is not unrolled.
    """
    if torch.compiler.is_compiling():
        loss, row_w, gx, gw, gb = torch.ops.stablelosses.linear_loss_chunks(
            x, w, b, t, cw, row_scale, cfg.ignore_index, cfg.label_smoothing, cfg.z_loss, cfg.softcap,
            cfg.gamma, cfg.chunk, needs[0], needs[1], needs[2] and b is not None, cd,
        )
        return loss, row_w, Grads(gx if needs[0] else None, gw if needs[1] else None,
                                  gb if needs[2] and b is not None else None)
    return _run_chunks_eager(x, w, b, t, cw, cfg, needs, row_scale, cd)


def _run_chunks_eager(
    x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cw: Tensor | None, cfg: LinearLossConfig,
    needs: tuple[bool, bool, bool], row_scale: Tensor | None, cd: torch.dtype,
) -> tuple[Tensor, Tensor, Grads]:
    want = any(needs)
    bc = None if b is None else b.to(cd)
    cwc = None if cw is None else cw.to(cd)
    need_b = needs[2] and bc is not None
    gw: Tensor | None = None
    gb: Tensor | None = None
    losses, row_ws, gxs = [], [], []
    ones = torch.ones((), dtype=cd, device=x.device)
    # The logits in cd, never in autocast's lower precision.
    with no_autocast(x.device.type):
        for start in range(0, x.shape[0], cfg.chunk):
            xc = x[start : start + cfg.chunk].to(cd)
            tc = t[start : start + cfg.chunk]
            rs = None
            if want:
                rs = (
                    ones.expand(xc.shape[0], 1) if row_scale is None
                    else row_scale[start : start + cfg.chunk, None]
                )
            loss, row_w, g = chunk_loss(xc, w, bc, tc, cwc, cfg, rs)
            losses.append(loss)
            row_ws.append(row_w)
            if g is not None:
                if needs[0]:
                    gxs.append(_input_grad(g, w))
                # The first chunk writes the accumulators (no zero fill of a (V, H) buffer).
                if needs[1]:
                    gw = g.t() @ xc if gw is None else gw.addmm_(g.t(), xc)
                if need_b:
                    gb = g.sum(0) if gb is None else gb.add_(g.sum(0))
            del g  # free this chunk's buffer before the next chunk's matmul
    gx = torch.cat(gxs) if gxs else (torch.zeros(x.shape, dtype=cd, device=x.device) if needs[0] else None)
    if needs[1] and gw is None:  # no rows
        gw = torch.zeros(w.shape, dtype=cd, device=w.device)
    if need_b and gb is None and bc is not None:
        gb = torch.zeros_like(bc)
    loss = torch.cat(losses) if losses else x.new_zeros(0, dtype=cd)
    row_weight = torch.cat(row_ws) if row_ws else x.new_zeros(0, dtype=cd)
    return loss, row_weight, Grads(gx, gw, gb)


_SCHEMA = (
    "(Tensor x, Tensor w, Tensor? b, Tensor t, Tensor? cw, Tensor? row_scale, int ignore_index, "
    "float label_smoothing, float z_loss, float? softcap, float? gamma, int chunk, bool need_x, "
    "bool need_w, bool need_b, ScalarType cd) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)


@torch.library.custom_op("stablelosses::linear_loss_chunks", mutates_args=(), schema=_SCHEMA)
def _chunks_op(
    x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cw: Tensor | None, row_scale: Tensor | None,
    ignore_index: int, label_smoothing: float, z_loss: float, softcap: float | None, gamma: float | None,
    chunk: int, need_x: bool, need_w: bool, need_b: bool, cd: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The chunk loop as one op for ``torch.compile``: loss, row weight and the three gradients
    (an empty tensor for a gradient that is not wanted)."""
    cfg = LinearLossConfig("linear_loss", ignore_index, label_smoothing, z_loss, softcap, gamma, chunk)
    loss, row_w, g = _run_chunks_eager(x, w, b, t, cw, cfg, (need_x, need_w, need_b), row_scale, cd)
    # a fresh empty tensor for each missing gradient: the outputs of a custom op may not alias
    gx, gw, gb = (x.new_empty(0, dtype=cd) if v is None else v for v in g)
    return loss, row_w, gx, gw, gb


@_chunks_op.register_fake
def _chunks_op_fake(
    x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cw: Tensor | None, row_scale: Tensor | None,
    ignore_index: int, label_smoothing: float, z_loss: float, softcap: float | None, gamma: float | None,
    chunk: int, need_x: bool, need_w: bool, need_b: bool, cd: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    n = x.shape[0]
    return (
        x.new_empty((n,), dtype=cd), x.new_empty((n,), dtype=cd),
        x.new_empty(x.shape if need_x else (0,), dtype=cd),
        x.new_empty(w.shape if need_w else (0,), dtype=cd),
        x.new_empty((w.shape[0],) if need_b else (0,), dtype=cd),
    )


def _double_backward_error(cfg_fn: str) -> RuntimeError:
    return RuntimeError(
        f"{cfg_fn}: differentiating its gradient (double backward, torch.func.hessian, a gradient "
        "penalty) is not supported: the gradient is computed in the forward pass, chunk by chunk, "
        "and is not itself differentiable. Use the unfused cross_entropy(F.linear(...)) for "
        "higher-order derivatives."
    )


class _ScaledGrad(torch.autograd.Function):
    """``grad * scale`` whose own backward raises: first order only, never a wrong second order.

    ``anchors`` are the loss's inputs: the result depends on them (through ``grad``, which
    autograd cannot see), so differentiating it with respect to them must reach this backward.
    A vmap rule, because ``torch.func.jacrev`` runs the loss's backward under ``vmap`` with
    grad mode on.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(grad: Tensor, scale: Tensor, fn: str, *anchors: Tensor | None) -> Tensor:
        return grad * scale

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.fn = inputs[2]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise _double_backward_error(ctx.fn)


def _scaled(
    grad: Tensor | None, scale: Tensor, dtype: torch.dtype, fn: str, anchors: tuple[Tensor | None, ...]
) -> Tensor | None:
    """The returned gradient ``grad * scale`` in ``dtype``; guarded against double backward."""
    if grad is None:
        return None
    if torch.is_grad_enabled():  # create_graph=True, torch.func.grad
        return _ScaledGrad.apply(grad, scale, fn, *anchors).to(dtype)
    return (grad * scale).to(dtype)


class _LinearLossReduced(torch.autograd.Function):
    """Summed (``mean=False``) or mean loss; the gradients are computed in the forward.

    Outputs: the loss (a scalar in the compute dtype) and the gradients of that loss with
    respect to input, weight and bias in their dtypes (non-differentiable, saved for backward).
    """

    @staticmethod
    def forward(
        x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cw: Tensor | None, cfg: LinearLossConfig,
        mean: bool, needs: tuple[bool, bool, bool], cd: torch.dtype,
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        loss, row_w, g = run_chunks(x, w, b, t, cw, cfg, needs, None, cd)
        total = loss.sum()
        if mean:
            count = row_w.sum()  # Σ w_t over the valid rows (their number without class weights)
            total = total / count  # 0 / 0 = NaN for an all-ignored batch, as torch
            # ... but its gradient is 0, not 0 * inf.
            scale = torch.where(count > 0, count.reciprocal(), 0.0)
            g = Grads(*(None if t_ is None else t_.mul_(scale) for t_ in g))
        gx = None if g.input is None else g.input.to(x.dtype)
        gw = None if g.weight is None else g.weight.to(w.dtype)
        gb = None if g.bias is None or b is None else g.bias.to(b.dtype)
        return total, gx, gw, gb

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        cfg = inputs[5]
        _, gx, gw, gb = output
        ctx.mark_non_differentiable(*(t for t in (gx, gw, gb) if t is not None))
        # No zero-filled (V, H) gradients for the non-differentiable outputs.
        ctx.set_materialize_grads(False)
        # The inputs are saved as anchors for the double-backward guard (references, no copy).
        ctx.save_for_backward(gx, gw, gb, *inputs[:3])
        ctx.fn = cfg.fn
        ctx.dtypes = tuple(None if v is None else v.dtype for v in inputs[:3])

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, *_: Any) -> Any:
        if grad is None:
            return (None,) * 9
        gx, gw, gb, *anchors = ctx.saved_tensors
        dx, dw, db = ctx.dtypes
        a = tuple(anchors)
        return (
            _scaled(gx, grad, dx, ctx.fn, a), _scaled(gw, grad, dw, ctx.fn, a),
            _scaled(gb, grad, db, ctx.fn, a), None, None, None, None, None, None,
        )


class _LinearLossRows(torch.autograd.Function):
    """Per-row loss (``reduction='none'``); the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(
        x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cw: Tensor | None, cfg: LinearLossConfig,
        cd: torch.dtype,
    ) -> Tensor:
        loss, _, _ = run_chunks(x, w, b, t, cw, cfg, (False, False, False), None, cd)
        return loss

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        x, w, b, t, cw, cfg, cd = inputs
        ctx.save_for_backward(x, w, b, t, cw)
        ctx.cfg, ctx.cd = cfg, cd

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        x, w, b, t, cw = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        with torch.no_grad():
            _, _, g = run_chunks(x, w, b, t, cw, ctx.cfg, needs, grad.to(ctx.cd), ctx.cd)
        one = torch.ones((), dtype=ctx.cd, device=x.device)
        fn, a = ctx.cfg.fn, (x, w, b, grad)
        return (
            _scaled(g.input, one, x.dtype, fn, a), _scaled(g.weight, one, w.dtype, fn, a),
            None if b is None else _scaled(g.bias, one, b.dtype, fn, a), None, None, None, None,
        )
