"""Cross-entropy and focal loss on logits as fused autograd Functions with an analytic backward.

Hazard rows are read off the row maximum ``m`` (a reduced, N-sized quantity), never off a
value a finite logit can take:

* ``m == -inf``: every logit is ``-inf`` (a fully masked row); the row counts as ignored.
* ``m == +inf``: the limit distribution, uniform over the ``+inf`` entries.
* any finite ``m``, ``finfo.min`` rows included: an ordinary row, exactly torch's numbers.

Class-index targets without smoothing (`_ClassIndexCE`) run torch's ``softmax`` on a copy of
the logits with ``+inf → finfo.max`` and the target's logit set to the row max, which gives
``Σ_{j≠t} e^{x_j − m}`` without the index of the max (fully masked rows stay finite there).
Label smoothing runs torch's ``log_softmax`` on the logits bounded per row (`rows.bounded`).
Probability targets need every log-probability, so they use the exact shift ``x - m`` (0 where
``x == m == ±inf``), whose log-softmax is ``-inf`` exactly at the zero-probability classes.

The backward of ``-Σ_c q_c log p_c`` with respect to the logits is ``p · Σq − q`` (softmax
minus the target distribution). ``p`` is an extra output of the forward (so double backward
differentiates it exactly); its incoming gradient adds the softmax backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from stablelosses._autograd._base import StableFunction
from stablelosses._autograd.rows import (
    accurate_log_pt,
    class_shape,
    exact_log_softmax,
    extra_log_softmax_grad,
    fast_log_softmax,
    focal_rows,
    focal_terms,
    index_row,
    is_target,
    probs_from,
    put,
    smoothing,
    smoothing_sum,
)
from stablelosses._autograd.softmax import _LogSoftmax
from stablelosses._compat import log_softmax_backward
from stablelosses._utils import inplace_ok, take

_INF = float("inf")
_NAN = float("nan")


def _plus(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b


class IndexResult(NamedTuple):
    """What ``_IndexLoss`` returns: the per-element loss (0 on invalid elements); the
    log-softmax and the target's log-probability, extra outputs so that double backward
    differentiates the backward exactly; the valid mask (target not ``ignore_index``, row not
    fully masked); the masked classes and their complement's count ``K`` (saved, so that the
    backward does not read the logits again for them)."""

    loss: Tensor
    lsm: Tensor
    log_pt: Tensor
    valid: Tensor
    masked: Tensor
    k: Tensor


def _scaled_value(s: Tensor, val: Tensor) -> Tensor:
    """``s · val``, a row's part of the class weight's gradient: 0 where the row scale ``s`` is
    0, also at an infinite ``val`` (a masked target in a row left out of what is differentiated),
    where ``0 · inf`` made the whole weight gradient NaN."""
    return torch.where(s == 0, 0.0, s * val)


def _per_class_sum(t: Tensor, cdim: int) -> Tensor:
    """Sum over every dimension but the class dimension."""
    return t.movedim(cdim, -1).reshape(-1, t.shape[cdim]).sum(0)


class _IndexLoss(StableFunction):
    """Class-index cross-entropy with label smoothing ``ε > 0`` and an optional class weight:
    per element ``(1 − ε) w_t (−log p_t) + ε/K Σ_{c unmasked} w_c (−log p_c)``. Without
    smoothing (cross-entropy and the focal loss) `_ClassIndexCE` runs instead.

    Forward: torch's log-softmax of the bounded logits (`fast_log_softmax`), the target term
    gathered by ``nll_loss`` and the smoothing sum (`smoothing_sum`). Backward: the gradient
    ``p·row − dense − onehot(t)·a`` is log-softmax's backward of ``g = −dense − onehot(t)·a``
    (its row sum is ``−row``), so it is torch's kernel on the saved log-softmax.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x, target, idx, weight, ignore_index, eps, cdim):
        # idx: the target with ignore_index replaced by 0 (the wrapper needs it too)
        lsm, m = fast_log_softmax(x, cdim)
        # nll_loss is the gather: 0 on ignored targets and torch's own IndexError
        # ("Target 3 is out of bounds.") for the others out of range.
        lt = F.nll_loss(lsm, target, ignore_index=ignore_index, reduction="none").neg()
        m_row = m.squeeze(cdim)
        masked_row = m_row == -_INF
        # On +inf rows only the +inf entries have probability > 0: their log p_t is -log k
        # (k ≤ C), while a finite target sits at least ulp(finfo.max) below the bounded +inf
        # entries, so its log p_t is below -ulp/2 (read off lt, not off a gather of x). Fully
        # masked rows get log p_t = -inf too: loss and gradient dropped.
        fi = torch.finfo(x.dtype)
        pinf_row = m_row == _INF
        far = pinf_row & (lt < -fi.max * fi.eps / 4)
        lt = torch.where(masked_row | far, -_INF, lt)
        if weight is None:
            # (1 − ε)·(−log p_t) with 0·inf = 0 at ε = 1 (a masked target carries no mass)
            val = lt * -(1.0 - eps) if eps < 1.0 else torch.zeros_like(lt)
        else:
            # (1 − ε)·w_t scaled before it meets −log p_t, which may be near finfo.max (no
            # overflow where the term is finite); 0 · inf = 0: a zero class weight, or ε = 1,
            # removes the term
            w_t = take(weight, idx) * (1.0 - eps)
            val = torch.where(w_t == 0, 0.0, w_t * -lt)
        masked, k = smoothing(x, cdim)
        val = val - smoothing_sum(lsm, masked, k, eps, cdim, weight, pinf_row)
        valid = (target != ignore_index) & ~masked_row
        # a plain tuple: vmap flattens outputs as tuples, not as NamedTuples
        return tuple(IndexResult(torch.where(valid, val, 0.0), lsm, lt, valid, masked, k))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, _target, idx, weight, _ignore_index, eps, cdim = inputs
        _, lsm, lt, valid, masked, k = output
        ctx.mark_non_differentiable(valid, masked, k)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, idx, weight, lsm, lt, valid, masked, k)
        # the same tensors as for backward (one list of batch dims under torch.func's vmap rule)
        ctx.save_for_forward(x, idx, weight, lsm, lt, valid, masked, k)
        ctx.eps, ctx.cdim = eps, cdim

    @staticmethod
    def backward(ctx, grad_loss, grad_lsm, grad_lt, _gv, _gm, _gk):
        x, idx, weight, lsm, lt, valid, masked, k = ctx.saved_tensors
        cdim, eps = ctx.cdim, ctx.eps
        gx = gw = a = ndense = None
        if grad_loss is not None:
            s = torch.where(valid, grad_loss, 0.0)
            a = s if weight is None else s * take(weight, idx)
            a = (1.0 - eps) * a
            # −dense, the negated smoothing mass (N-sized until the weight or the select)
            smooth = s.unsqueeze(cdim) * (-eps / k)
            if weight is not None:
                smooth = smooth * weight.view(class_shape(x.dim(), cdim))
            ndense = torch.where(masked, 0.0, smooth)
            if ctx.needs_input_grad[3]:
                gw = _index_weight_grad(x, weight, idx, valid, s, -lt, eps, cdim, masked, k)
        if grad_lt is not None:
            # d log p_t / dx = onehot(t) − softmax
            a = -grad_lt if a is None else a - grad_lt
        if a is not None:
            # g = −dense − onehot(t)·a; torch's log-softmax backward g − p·Σg is then
            # p·row − dense − onehot(t)·a. ndense is this Function's own buffer: the target
            # entry is added in place (a vmap wrapper cannot grow in place: out of place there).
            # NaN rows: the saved log-softmax is NaN, so is their gradient.
            g = torch.zeros_like(lsm) if ndense is None else ndense
            t_val = a.neg().unsqueeze(cdim)
            idx_u = idx.unsqueeze(cdim)
            if torch.compiler.is_compiling():
                # a select on the class index, which inductor fuses into the log-softmax
                # backward's loop, where the scatter is an extern pass of its own (label
                # smoothing 8192x1000 fwd+bwd 1.41-1.43x → 1.29-1.32x compiled torch's;
                # benchmarks/spellings.md)
                g = torch.where(is_target(g, idx_u, cdim), g + t_val, g)
            else:
                g = put(g, cdim, idx_u, t_val, add=True)
            gx = log_softmax_backward(g, lsm, cdim, inplace_ok(g))
        gx = _plus(gx, extra_log_softmax_grad(lsm, grad_lsm, cdim))
        return gx, None, None, gw, None, None, None

    @staticmethod
    def jvp(ctx, x_t, _target_t, _idx_t, w_t, _ii, _eps, _cdim):
        x, idx, weight, lsm, lt, valid, masked, k = ctx.saved_tensors
        cdim, eps = ctx.cdim, ctx.eps
        p = probs_from(lsm, False)
        # zero-probability entries carry no tangent (double where: 0·inf never forms)
        x_t = torch.zeros_like(p) if x_t is None else torch.where(p == 0, 0.0, x_t)
        lsm_t = x_t - (p * x_t).sum(cdim, keepdim=True)  # tangent of every log p_c
        lt_t = lsm_t.gather(cdim, idx.unsqueeze(cdim)).squeeze(cdim)
        val_t = -lt_t
        if weight is not None:
            val_t = take(weight, idx) * val_t
            if w_t is not None:
                wt = take(w_t, idx)
                val_t = val_t + torch.where(wt == 0, 0.0, wt * -lt)
        terms = lsm_t
        if weight is not None:
            shape = class_shape(x.dim(), cdim)
            terms = weight.view(shape) * lsm_t
            if w_t is not None:
                terms = terms + w_t.view(shape) * torch.where(masked, 0.0, exact_log_softmax(x, cdim)[0])
        val_t = (1.0 - eps) * val_t - torch.where(masked, 0.0, terms * (eps / k)).sum(cdim)
        return torch.where(valid, val_t, 0.0), lsm_t, lt_t, None, None, None


def _index_weight_grad(
    x: Tensor, weight: Tensor, idx: Tensor, valid: Tensor, s: Tensor, val: Tensor, eps: float,
    cdim: int, masked: Tensor, k: Tensor,
) -> Tensor:
    """d/dw_c of Σ g·ℓ: the elements whose target is c, plus every element's smoothing term
    (``masked``, ``k``: the masked classes and the unmasked count, saved by the forward)."""
    contrib = torch.where(valid, _scaled_value((1.0 - eps) * s, val), 0.0)
    gw = torch.zeros_like(weight).index_add(0, idx.reshape(-1), contrib.reshape(-1))
    if eps > 0.0:
        # double where: a -inf never meets a factor (0·inf in double backward): the masked
        # classes', and those of a row that adds nothing (row scale 0: an ignored target,
        # whose +inf logits make its other classes -inf)
        s_u = s.unsqueeze(cdim)
        lsm = torch.where(masked | (s_u == 0), 0.0, exact_log_softmax(x, cdim)[0])
        per = lsm * (s_u * (eps / k))
        gw = gw - _per_class_sum(per, cdim)
    return gw


class ProbResult(NamedTuple):
    """What ``_ProbLoss`` returns: per-row loss (0 on fully masked rows), the log-softmax
    (extra output for double backward; finite on NaN rows in eager), the valid-row mask (the
    mean divides by the number of valid rows) and the row max (NaN on NaN rows: their
    gradients and tangents are made NaN from it)."""

    loss: Tensor
    lsm: Tensor
    valid: Tensor
    m: Tensor


def _target_dist(x: Tensor, target: Tensor, weight: Tensor | None, eps: float, cdim: int) -> Tensor:
    """``w ⊙ q``, ``q = (1 − ε) y + ε/K`` on the unmasked classes (none on masked ones)."""
    q = target
    if eps > 0.0:
        masked, k = smoothing(x, cdim)
        q = (1.0 - eps) * target + torch.where(masked, 0.0, eps / k)
    if weight is not None:
        q = q * weight.view(class_shape(x.dim(), cdim))
    return q


class _ProbLoss(StableFunction):
    """Cross-entropy with class-probability targets, optional weight and label smoothing:
    ``−Σ_c w_c q_c log p_c`` per row, a term with ``q_c = 0`` counting as 0."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, target, weight, eps, cdim):
        # the exact shift (not log_softmax_limits: measured, its bound and select made the
        # compiled fwd+bwd 7x compiled torch's, against 2.2-2.9x with this one)
        # NaN rows may come back finite here: their loss is put back below and their
        # gradient through the row scale (saved `m`)
        lsm, m = exact_log_softmax(x, cdim, nan_rows=False)
        m = m.squeeze(cdim)
        q = _target_dist(x, target, weight, eps, cdim)
        # 0 · log 0 = 0: classes without target mass contribute nothing. q·lsm is NaN only at
        # 0·(−inf), at a NaN target and on NaN rows: nansum takes every NaN term as 0 (one
        # read, where a nan_to_num and a sum were a read, a write and a read), and the two
        # NaN cases are put back from N-sized quantities (Σq is NaN with any NaN target; m is
        # NaN on NaN rows). ±inf terms stay.
        # compiled: a select, which inductor vectorizes, not its scalar isnan loop (with
        # extra_log_softmax_grad's, probability targets 8192x1000 fwd+bwd 2.2x → 1.4-1.7x
        # compiled torch's; benchmarks/spellings.md)
        if torch.compiler.is_compiling():
            loss = -torch.where(q == 0, 0.0, q * lsm).sum(cdim)
        else:
            loss = -(q * lsm).nansum(cdim)
        loss = torch.where(torch.isnan(q.sum(cdim) + m), _NAN, loss)
        valid = m != -_INF
        return tuple(ProbResult(torch.where(valid, loss, 0.0), lsm, valid, m))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, target, weight, eps, cdim = inputs
        _, lsm, valid, m = output
        ctx.mark_non_differentiable(valid, m)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, target, weight, lsm, valid, m)
        ctx.save_for_forward(x, target, weight, lsm, valid, m)
        ctx.eps, ctx.cdim = eps, cdim

    @staticmethod
    def backward(ctx, grad_loss, grad_lsm, _gv, _gm):
        x, target, weight, lsm, valid, m = ctx.saved_tensors
        cdim, eps = ctx.cdim, ctx.eps
        gx = gt = gw = None
        if grad_loss is not None:
            s = torch.where(valid, grad_loss, 0.0)
            if not torch.compiler.is_compiling():
                # NaN rows: a NaN row scale (the eager log-softmax may be finite there).
                # Compiled, the forward's select spelling keeps them NaN, and this select
                # made the partitioner recompute the forward in the backward (8192x1000
                # fwd+bwd 3.0x slower with it).
                s = torch.where(torch.isnan(m), m, s)
            s = s.unsqueeze(cdim)
            q = _target_dist(x, target, weight, eps, cdim)
            if ctx.needs_input_grad[0]:
                # p·Σq·s − q·s is log-softmax's backward of −q·s: torch's kernel, one pass
                g = q * s.neg()
                gx = log_softmax_backward(g, lsm, cdim, inplace_ok(g))
            if ctx.needs_input_grad[1]:
                # -log p times the row scale; 0 where that is 0 also where log p is -inf (a
                # zero-probability class of a +inf row), not 0 · inf = NaN
                gt = torch.where(s == 0, 0.0, lsm * (s * -(1.0 - eps)))
                if weight is not None:
                    gt = gt * weight.view(class_shape(x.dim(), cdim))
            if ctx.needs_input_grad[2]:
                qn = _target_dist(x, target, None, eps, cdim)
                # 0 · log 0 = 0, and a row scale of 0 adds 0 also where log p is -inf (a
                # zero-probability class of a +inf row), not 0 · inf = NaN
                zero = (qn == 0) | (s == 0)
                gw = _per_class_sum(-torch.where(zero, 0.0, qn * lsm) * s, cdim)
        gx = _plus(gx, extra_log_softmax_grad(lsm, grad_lsm, cdim))
        return gx, gt, gw, None, None

    @staticmethod
    def jvp(ctx, x_t, y_t, w_t, _eps, _cdim):
        x, target, weight, lsm, valid, m = ctx.saved_tensors
        cdim, eps = ctx.cdim, ctx.eps
        p = probs_from(lsm, False)
        lsm_t = torch.zeros_like(lsm)
        if x_t is not None:
            x_t = torch.where(p == 0, 0.0, x_t)
            lsm_t = x_t - (p * x_t).sum(cdim, keepdim=True)
        q = _target_dist(x, target, weight, eps, cdim)
        terms = torch.where(q == 0, 0.0, q * lsm_t)
        if y_t is not None:  # d q / d y = (1 − ε) w
            q_t = (1.0 - eps) * y_t
            if weight is not None:
                q_t = q_t * weight.view(class_shape(x.dim(), cdim))
            terms = terms + torch.where(q_t == 0, 0.0, q_t * lsm)
        if w_t is not None:
            qw = _target_dist(x, target, w_t, eps, cdim)
            terms = terms + torch.where(qw == 0, 0.0, qw * lsm)
        loss_t = torch.where(valid, -terms.sum(cdim), 0.0)
        return torch.where(torch.isnan(m), m, loss_t), lsm_t, None, None


def class_index_rows(
    x: Tensor, target: Tensor, idx: Tensor, ignored: Tensor, weight: Tensor | None, ignore_index: int,
    gamma: float, cdim: int, clean: bool, grad: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """`_ClassIndexCE`'s forward: the loss (0 on invalid rows), the invalid rows, the saved row
    ``p'`` (target entry ``−r``), the row divisor and the unweighted value. ``grad=False`` (a
    forward that no backward follows, outside the Function): the value only; ``p'`` keeps a 0
    at the target (2 aten ops fewer), and the row divisor is not formed (``None``; cross-entropy:
    1 aten op fewer). ``clean``: the ignored rows' gradient is 0 whatever they hold
    (`rows.index_row`'s ``ignored``)."""
    # nll_loss on the logits is the gather of −x_t: 0 on ignored targets and torch's own
    # IndexError ("Target 3 is out of bounds.") for the others out of range.
    nll = F.nll_loss(x, target, ignore_index=ignore_index, reduction="none")
    # compiled: the fused spelling of the same row (measured: see rows.fused_index_row)
    p, qs, r, nll_t, m = index_row(x, nll, idx, cdim, torch.compiler.is_compiling(), grad,
                                   ignored if clean else None, divisor=grad or gamma != 0.0)
    # den: the backward's row divisor p'_t S (≥ p'_t ≥ 1/C, NaN on NaN rows: so is their
    # gradient), over the focal row scale for the focal loss (inf where the scale is 0).
    # One saved N-sized divisor: compiled, the partitioner had recomputed the focal scale
    # from the saved rows inside the backward's row loop (expm1, pow and five divisions
    # per vector of the row; focal 8192x1000 fwd+bwd 1.72x → 1.08-1.10x compiled torch's).
    if gamma == 0.0:
        val, den = nll_t, qs  # (qs None without grad: the value reads neither)
    else:
        assert qs is not None
        # p_t = e^{−nll_t}: its relative error is nll_t's absolute one, which only enters
        # the backward's scale, its γ p_t r term (r = nll_t / rest), small where nll_t is large
        p_t = torch.exp(nll_t.neg()) if grad else None
        val, scale = focal_rows(r / qs, p_t, nll_t, gamma)
        den = qs if scale is None else qs / scale
    out = val
    if weight is not None:
        w_t = take(weight, idx)
        out = torch.where(w_t == 0, 0.0, w_t * val)  # 0 · inf = 0
    invalid = ignored | (m == -_INF)
    return out.masked_fill(invalid, 0.0), invalid, p, den, val


class _ClassIndexCE(StableFunction):
    """Class-index cross-entropy ``−w_t log p_t`` and focal loss ``−w_t (1 − p_t)^γ log p_t``
    (no smoothing) in torch's passes plus the two reductions the hazards and the tail need.

    Forward: the row core's class-index row (`rows.index_row`: the row max, one bounded copy
    with the target set to the max, torch's softmax of it, the row sum without the target, and
    the N-sized ``−log p_t`` with its exact tail), then N-sized selects: the class weight, and
    invalid rows (ignored targets, fully masked rows read off ``m == -inf``) set to 0.

    Saved: ``p'`` with the target entry ``−r``, the row divisor ``p'_t S`` (over the focal row
    scale for the focal loss) and the unweighted value (for the class weight's gradient). The
    first-order backward is ``p' · a / (p'_t S)``
    (``p = p' S' / S``; the target entry is ``−rest·a``, ``p_t − 1`` without cancellation): one
    read of the saved ``p'`` and one write of a fresh gradient. The focal row scale (`focal_rows`,
    N-sized) enters that divisor in the forward. Double backward and the jvp recompute the row
    from the saved input in differentiable ops (`_plain_rows`, same values), so that second
    derivatives and ``torch.func`` nestings reach ``x``.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x, target, idx, ignored, weight, ignore_index, gamma, cdim, clean):
        return class_index_rows(x, target, idx, ignored, weight, ignore_index, gamma, cdim, clean)

    @staticmethod
    def value(x, target, idx, ignored, weight, ignore_index, gamma, cdim, clean):
        # what `call` runs where no backward or tangent can follow: the same outputs, without
        # what only the backward reads (p''s target entry −r, the focal row scale)
        return class_index_rows(x, target, idx, ignored, weight, ignore_index, gamma, cdim, clean, False)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, target, idx, _ignored, weight, ignore_index, gamma, cdim, clean = inputs
        _, invalid, p, den, val = output
        ctx.mark_non_differentiable(invalid, p, den, val)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, target, idx, weight, invalid, p, den, val)
        # the same tensors as for backward: torch.func's generated vmap rule keeps one list of
        # their batch dims, and a shorter list breaks jacrev(jacfwd(f))
        ctx.save_for_forward(x, target, idx, weight, invalid, p, den, val)
        ctx.ignore_index, ctx.gamma, ctx.cdim, ctx.clean = ignore_index, gamma, cdim, clean

    @staticmethod
    def backward(ctx, grad_loss, _gi, _gp, _gd, _gval):
        x, target, idx, weight, invalid, p, den, val = ctx.saved_tensors
        cdim = ctx.cdim
        if grad_loss is None:
            return None, None, None, None, None, None, None, None, None
        if torch.is_grad_enabled():
            return _double_backward(ctx, x, idx, weight, invalid, grad_loss)
        # the incoming gradient over the row divisor, 0 on invalid rows (also where the focal
        # scale is not finite there)
        a = (grad_loss / den).masked_fill(invalid, 0.0)
        a = a if weight is None else a * take(weight, idx)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = p * a.unsqueeze(cdim)
        if ctx.needs_input_grad[4]:
            contrib = _scaled_value(grad_loss, val).masked_fill(invalid, 0.0)
            gw = torch.zeros_like(weight).index_add(0, idx.reshape(-1), contrib.reshape(-1))
        return gx, None, None, None, gw, None, None, None, None

    @staticmethod
    def jvp(ctx, x_t, _target_t, _idx_t, _ignored_t, w_t, _ii, _gamma, _cdim, _clean):
        x, _target, idx, weight, invalid = ctx.saved_tensors[:5]
        cdim, gamma = ctx.cdim, ctx.gamma
        # recomputed in plain ops (not the saved softmax): reverse mode over this rule
        # (jacrev of jacfwd) then differentiates it
        rows = _plain_rows(x, idx, gamma, cdim)
        idx_u = idx.unsqueeze(cdim)
        # zero-probability entries carry no tangent (double where: 0·inf never forms)
        x_t = torch.zeros_like(rows.p) if x_t is None else torch.where(rows.p == 0, 0.0, x_t)
        lt_t = x_t.gather(cdim, idx_u).squeeze(cdim) - (rows.p * x_t).sum(cdim)
        val_t = -lt_t if rows.scale is None else -rows.scale * lt_t
        if weight is not None:
            val_t = take(weight, idx) * val_t
            if w_t is not None:
                wt = take(w_t, idx)
                val_t = val_t + torch.where(wt == 0, 0.0, wt * rows.val)
        return val_t.masked_fill(invalid, 0.0), None, None, None, None


class _PlainRows(NamedTuple):
    """A class-index row in plain differentiable ops (see `_plain_rows`)."""

    p: Tensor
    rest: Tensor
    val: Tensor
    scale: Tensor | None


def _plain_rows(x: Tensor, idx: Tensor, gamma: float, cdim: int) -> _PlainRows:
    """``softmax``, ``rest = Σ_{j≠t} p_j``, the unweighted value and the focal row scale
    (``None`` for cross-entropy) as a graph of ``x`` in plain torch ops, for the derivatives
    that differentiate `_ClassIndexCE`'s first-order rules: double backward and the jvp.

    Ops and the library's own log-softmax Function, never ``autograd.grad`` of a re-run
    forward: under a ``torch.func`` transform the saved ``x`` need not require grad at the
    level that runs a backward, so ``torch.func`` nests over these (``hessian``,
    ``jacrev(jacrev(f))``, ``jacrev(jacfwd(f))``) where ``autograd.grad`` is refused. The
    log-softmax's derivatives are the limits on ``+inf`` and fully masked rows (from its
    output); NaN rows stay NaN. Same values as the first-order path.
    """
    idx_u = idx.unsqueeze(cdim)
    lsm = _LogSoftmax.call(x, cdim)
    p = torch.exp(lsm)
    rest = p.scatter(cdim, idx_u, 0.0).sum(cdim)
    lt = accurate_log_pt(rest, lsm.gather(cdim, idx_u).squeeze(cdim))
    if gamma == 0.0:
        return _PlainRows(p, rest, -lt, None)
    val, scale = focal_terms(rest, lt, gamma)
    return _PlainRows(p, rest, val, scale)


def _double_backward(ctx, x, idx, weight, invalid, grad_loss):
    """First derivatives as a differentiable graph of the saved ``x`` and ``weight``
    (`_plain_rows`): ``a·(softmax − onehot)`` with the target entry ``−rest·a``."""
    cdim = ctx.cdim
    # clean: the invalid rows' logits as 0, so their gradient is 0 whatever they hold
    rows = _plain_rows(torch.where(invalid.unsqueeze(cdim), 0.0, x) if ctx.clean else x, idx, ctx.gamma, cdim)
    s = grad_loss.masked_fill(invalid, 0.0)
    a = s if rows.scale is None else (s * rows.scale).masked_fill(invalid, 0.0)
    if weight is not None:
        a = a * take(weight, idx)
    gx = gw = None
    if ctx.needs_input_grad[0]:
        a_u = a.unsqueeze(cdim)
        idx_u = idx.unsqueeze(cdim)
        gx = (rows.p * a_u).scatter(cdim, idx_u, -rows.rest.unsqueeze(cdim) * a_u)
    if ctx.needs_input_grad[4]:
        contrib = _scaled_value(s, rows.val).masked_fill(invalid, 0.0)
        gw = torch.zeros_like(weight).index_add(0, idx.reshape(-1), contrib.reshape(-1))
    return gx, None, None, None, gw, None, None, None, None
