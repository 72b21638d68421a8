"""Fused linear + cross-entropy / focal loss that never holds the ``(N, V)`` logits.

The rows are processed in chunks of ``chunk`` rows (a Python loop over a shape: unrolled by
torch.compile, which specialises on ``N``). Each chunk computes its logits ``x W^T + b`` in the
compute dtype (float32, float64 for float64 inputs), its per-row loss and, when gradients are
wanted, ``d loss / d logits`` in place in the same buffer, which it multiplies straight into the
gradients of the input rows, the weight and the bias. Only ``chunk × V`` numbers exist at once.

Per row, with ``m = max_j l_j`` (0 for an all ``-inf`` row) and ``R = Σ_{j ≠ argmax} e^{l_j - m}``:

    lse = m + log1p(R),   log p_t = (l_t - m) - log1p(R),   p = e^{l - m} / (1 + R),

so ``log p_t`` and ``1 - p_t = -expm1(log p_t)`` keep full relative accuracy as ``p_t → 1``.
The gradient with respect to the logits is ``α p - β onehot(t) - δ [unmasked]`` with row
scales: cross-entropy ``α = 1 + 2 z lse``, ``β = 1 - ε``, ``δ = ε / K``; focal
``α = A + 2 z lse``, ``β = A``, ``A = (1 - p_t)^γ (1 + γ p_t r)``, ``r = -log p_t / (1 - p_t)``.
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


def _focal_scale(lpt: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """``(1 - p_t)^γ`` and the logit-gradient scale ``A = (1 - p_t)^γ (1 + γ p_t r)``.

    ``1 - p_t = -expm1(log p_t)``; ``r = -log p_t / (1 - p_t)`` is 1 at ``p_t = 1`` (its limit)
    and ``p_t r = 0`` at ``log p_t = -inf`` (the clamp keeps ``r`` finite there).
    """
    em = torch.expm1(lpt)
    r = torch.where(em == 0, 1.0, lpt.clamp(min=-torch.finfo(lpt.dtype).max) / em)
    mg = torch.pow(em.neg(), gamma)
    return mg, mg * (1.0 + gamma * torch.exp(lpt) * r)


def chunk_loss(
    x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cfg: LinearLossConfig, row_scale: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Loss of each row of one chunk, its validity and ``row_scale · d loss / d u`` (``u = x W^T + b``).

    ``x`` is ``(n, H)``, ``w`` ``(V, H)``, ``b`` ``(V,)``, all in the compute dtype; ``t`` ``(n,)``
    int64. ``row_scale`` ``(n, 1)`` (``None``: no gradient). Returns the loss ``(n,)`` (0 on
    invalid rows), ``valid`` ``(n,)`` and the ``(n, V)`` gradient, which reuses the logits buffer.

    One function on purpose (about 70 lines): the one ``(n, V)`` buffer goes through every step in
    place (logits, ``exp``, gradient), and a split would pass a dozen per-row intermediates.
    """
    u = x @ w.t() if b is None else torch.addmm(b, x, w.t())
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
    m, idx = logits.max(dim=1, keepdim=True)
    m_safe = torch.where(m == _NEG_INF, 0.0, m)
    kept = t != cfg.ignore_index
    valid = kept & (m.squeeze(1) != _NEG_INF)
    t_safe = torch.where(kept, t, 0).unsqueeze(1)
    lt_shift = logits.gather(1, t_safe) - m_safe
    if eps > 0.0:
        assert masked is not None
        k = (logits.shape[1] - masked.sum(1, keepdim=True)).clamp_(min=1).to(logits.dtype)
        # Σ_{unmasked c} (m - l_c): non-negative terms, no cancellation, no inf - inf.
        smooth = (m_safe - logits).masked_fill_(masked, 0.0).sum(1, keepdim=True)
    e = logits.sub_(m_safe).exp_()
    e.scatter_(1, idx, 0.0)
    rest = e.sum(1, keepdim=True)
    log1p_rest = rest.log1p()
    lpt = lt_shift - log1p_rest
    lse = m + log1p_rest
    if cfg.gamma is None:
        loss = lpt.neg() if eps == 0.0 else eps * (smooth / k + log1p_rest)
        if 0.0 < eps < 1.0:
            loss = loss - (1.0 - eps) * lpt
    else:
        mg, a_focal = _focal_scale(lpt, cfg.gamma)
        loss = mg * lpt.neg()
    if zl > 0.0:
        loss = loss + zl * lse.square()
    vcol = valid.unsqueeze(1)
    loss = torch.where(vcol, loss, 0.0).squeeze(1)
    if row_scale is None:
        return loss, valid, None
    s = torch.where(vcol, row_scale, 0.0)
    if cfg.gamma is None:
        alpha, beta = s, s * (1.0 - eps)
    else:
        alpha = beta = s * a_focal
    if zl > 0.0:
        alpha = alpha + s * (2.0 * zl) * lse
    # lse = -inf on all -inf rows: 0 * -inf would be NaN.
    alpha = torch.where(vcol, alpha, 0.0)
    g = e.scatter_(1, idx, 1.0).mul_(alpha / (1.0 + rest))
    if eps > 0.0:
        assert masked is not None
        g.sub_(s * (eps / k)).masked_fill_(masked, 0.0)
    g.scatter_add_(1, t_safe, beta.neg())
    if th is not None:
        # d c tanh(u / c) / du = 1 - tanh²: 0 at masked (-inf) entries.
        g.mul_(th.square_().neg_().add_(1.0))
    return loss, valid, g


class Grads(NamedTuple):
    """Gradients of the summed loss with respect to input, weight and bias (None: not wanted)."""

    input: Tensor | None
    weight: Tensor | None
    bias: Tensor | None


def run_chunks(
    x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cfg: LinearLossConfig,
    needs: tuple[bool, bool, bool], row_scale: Tensor | None, cd: torch.dtype,
) -> tuple[Tensor, Tensor, Grads]:
    """Loop over row chunks: per-row loss ``(N,)``, valid ``(N,)`` and the accumulated gradients.

    ``row_scale`` ``(N,)`` weighs each row's gradient (``None``: weight 1 when any of ``needs``).
    Gradients are accumulated in the compute dtype ``cd``.
    """
    want = any(needs)
    wc = w.to(cd)
    bc = None if b is None else b.to(cd)
    need_b = needs[2] and bc is not None
    gw: Tensor | None = None
    gb: Tensor | None = None
    losses, valids, gxs = [], [], []
    ones = torch.ones((), dtype=cd, device=x.device)
    # The logits in cd, never in autocast's lower precision.
    with torch.autocast(x.device.type, enabled=False):
        for start in range(0, x.shape[0], cfg.chunk):
            xc = x[start : start + cfg.chunk].to(cd)
            tc = t[start : start + cfg.chunk]
            rs = None
            if want:
                rs = (
                    ones.expand(xc.shape[0], 1) if row_scale is None
                    else row_scale[start : start + cfg.chunk, None]
                )
            loss, valid, g = chunk_loss(xc, wc, bc, tc, cfg, rs)
            losses.append(loss)
            valids.append(valid)
            if g is not None:
                if needs[0]:
                    gxs.append(g @ wc)
                # The first chunk writes the accumulators (no zero fill of a (V, H) buffer).
                if needs[1]:
                    gw = g.t() @ xc if gw is None else gw.addmm_(g.t(), xc)
                if need_b:
                    gb = g.sum(0) if gb is None else gb.add_(g.sum(0))
            del g  # free this chunk's buffer before the next chunk's matmul
    gx = torch.cat(gxs) if gxs else (torch.zeros_like(x, dtype=cd) if needs[0] else None)
    if needs[1] and gw is None:  # no rows
        gw = torch.zeros_like(wc)
    if need_b and gb is None and bc is not None:
        gb = torch.zeros_like(bc)
    loss = torch.cat(losses) if losses else x.new_zeros(0, dtype=cd)
    valid = torch.cat(valids) if valids else t.new_zeros(0, dtype=torch.bool)
    return loss, valid, Grads(gx, gw, gb)


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
    """

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
        x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cfg: LinearLossConfig, mean: bool,
        needs: tuple[bool, bool, bool], cd: torch.dtype,
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        loss, valid, g = run_chunks(x, w, b, t, cfg, needs, None, cd)
        total = loss.sum()
        if mean:
            count = valid.sum().to(cd)
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
        cfg = inputs[4]
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
            return (None,) * 8
        gx, gw, gb, *anchors = ctx.saved_tensors
        dx, dw, db = ctx.dtypes
        a = tuple(anchors)
        return (
            _scaled(gx, grad, dx, ctx.fn, a), _scaled(gw, grad, dw, ctx.fn, a),
            _scaled(gb, grad, db, ctx.fn, a), None, None, None, None, None,
        )


class _LinearLossRows(torch.autograd.Function):
    """Per-row loss (``reduction='none'``); the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(
        x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cfg: LinearLossConfig, cd: torch.dtype
    ) -> Tensor:
        loss, _, _ = run_chunks(x, w, b, t, cfg, (False, False, False), None, cd)
        return loss

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        x, w, b, t, cfg, cd = inputs
        ctx.save_for_backward(x, w, b, t)
        ctx.cfg, ctx.cd = cfg, cd

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        x, w, b, t = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        with torch.no_grad():
            _, _, g = run_chunks(x, w, b, t, ctx.cfg, needs, grad.to(ctx.cd), ctx.cd)
        one = torch.ones((), dtype=ctx.cd, device=x.device)
        fn, a = ctx.cfg.fn, (x, w, b, grad)
        return (
            _scaled(g.input, one, x.dtype, fn, a), _scaled(g.weight, one, w.dtype, fn, a),
            None if b is None else _scaled(g.bias, one, b.dtype, fn, a), None, None, None,
        )
