"""The class-index heads of the chunk engine (`linear.py`): cross-entropy and focal loss in one
process (`IndexHead`), and a vocabulary shard's statistics and gradient (`ShardStats`,
`ShardGrad`, combined in ``functional/_linear_parallel.py``).

Per row, with m = max_j l_j (0 for an all -inf row; amax, no index), the target's shift
w = m - l_t and D = Σ_{j ≠ t} e^{l_j - m} (the target's term zeroed before the sum), the row core
(rows.target_nll) gives S - 1 = D + expm1(-w), lse = m + log1p(S - 1), -log p_t = log1p(S - 1) + w,
exact as p_t → 1. The gradient with respect to the logits is α p - β onehot(t) - δ_c [unmasked]
with row scales (w_c the class weights, 1 without; W_U their sum over the K unmasked classes):
cross-entropy α = (1 - ε) w_t + ε W_U / K + 2 z w_t lse, β = (1 - ε) w_t, δ_c = ε w_c / K;
focal α = w_t (A + 2 z lse), β = w_t A, A = (1 - p_t)^γ (1 + γ p_t r), r = -log p_t / (1 - p_t)
(rows.focal_rows). Softcapping l = c tanh(u / c) multiplies it by 1 - tanh².

+inf logits (no softcap): the limit, uniform over the +inf entries. The logits are bounded
(+inf → finfo.max, `capped`) for every shift, but the row max and the target's logit are read
before the bound (the same two reads), so that a +inf row is told from one whose max is a
genuine finfo.max (an ordinary row, torch's finite numbers): on a +inf row a target that is not
+inf has probability 0 (`target_shift`: w = +inf, -log p_t = +inf), and so has every finite
unmasked class, whose smoothing mass makes the loss +inf (`row_terms`: the row core's rule in
rows.smoothing_sum).

One process, a chunk does it all in one (n, V) buffer (`IndexHead`). A vocabulary shard computes
the per-row statistics of its logits (`ShardStats`), the ranks combine them (N-sized, in
functional/_linear_parallel.py) and a second pass forms the gradient (`ShardGrad`); both use the
same three steps, `local_rows`, `row_terms` + `row_scales` and `logit_grad`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from stablelosses import _backend
from stablelosses._autograd.linear import Head
from stablelosses._autograd.rows import SUM_SCALE, focal_rows, target_nll

_INF = float("inf")
_NEG_INF = float("-inf")


def capped(
    u: Tensor, softcap: float | None, need_masked: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(l, tanh(u / c) or None, masked or None)`` from the logits buffer ``u`` (in place): a
    ``-inf`` (masked) logit stays masked; without softcap ``+inf → finfo.max`` (the limit
    distribution, uniform over the ``+inf`` entries)."""
    masked = u == _NEG_INF if (softcap is not None or need_masked) else None
    if softcap is None:
        return u.clamp_(max=torch.finfo(u.dtype).max), None, masked
    assert masked is not None
    th = u.div_(softcap).tanh_()
    return (th * softcap).masked_fill_(masked, _NEG_INF), th, masked


def bounded_max(m: Tensor) -> Tensor:
    """The row max read before the bound as the shifts use it: ``+inf → finfo.max``, ``-inf → 0``
    (an all ``-inf`` row or an empty shard), NaN kept."""
    return torch.nan_to_num(m, nan=math.nan, posinf=torch.finfo(m.dtype).max, neginf=0.0)


class LocalRows(NamedTuple):
    """What one pass over a chunk's logits reads off each row (every field ``(n, 1)`` but ``e``)."""

    e: Tensor  # e^{l - m_safe} (n, V_k), the owned target's entry zeroed (the logits buffer)
    m: Tensor  # the row max before the bound (+inf: a +inf row; -inf: all -inf, or an empty shard)
    dead: Tensor  # m == -inf
    m_safe: Tensor  # m bounded (+inf → finfo.max), 0 where it is -inf
    lt: Tensor  # the target's logit before the bound (0 where not owned)
    d: Tensor  # D = Σ_{j ≠ t} e_j
    masked: Tensor | None  # (n, V_k) the -inf logits (softcap or label smoothing)
    th: Tensor | None  # (n, V_k) tanh(u / c) (softcap)
    smooth: Tensor | None  # Σ_{c ∈ U} w_c (m_safe - l_c) · SUM_SCALE (label smoothing)
    k: Tensor | None  # |U| in the compute dtype, not clamped (label smoothing)
    wu: Tensor | None  # Σ_{c ∈ U} w_c (label smoothing)


def local_rows(
    u: Tensor, t_safe: Tensor, owned: Tensor | None, cw: Tensor | None, eps: float, softcap: float | None
) -> LocalRows:
    """The per-row statistics of one chunk's logits ``u`` (overwritten). ``t_safe`` ``(n, 1)``
    the target's column (0 where there is none), ``owned`` ``(n, 1)`` where the target is in
    this vocabulary (``None``: every row, one process)."""
    n, v = u.shape
    # the max and the target's logit before capped's +inf → finfo.max (with softcap after
    # tanh, which bounds every logit): a +inf row is then told from a finfo.max one
    first = softcap is None and v > 0
    if first:
        # amax, not max with its index: torch's CPU index reduction is not vectorised
        m, lt = u.amax(dim=1, keepdim=True), u.gather(1, t_safe)
    logits, th, masked = capped(u, softcap, eps > 0.0)
    if v == 0:  # an empty shard: no logit, no target (amax and gather need a class)
        m = logits.new_full((n, 1), _NEG_INF)
        lt = logits.new_zeros((n, 1))
    elif not first:
        m, lt = logits.amax(dim=1, keepdim=True), logits.gather(1, t_safe)
    if owned is not None and v > 0:
        lt = torch.where(owned, lt, 0.0)
    dead = m == _NEG_INF
    m_safe = bounded_max(m)
    smooth = k = wu = None
    if eps > 0.0:
        assert masked is not None
        k = (v - masked.sum(1, keepdim=True)).to(logits.dtype)
        # Σ_{unmasked c} w_c (m - l_c) · 2^-64: non-negative terms, no cancellation, no inf - inf;
        # scaled exactly as the row core's smoothing sum (rows.SUM_SCALE), so that no partial sum
        # overflows where the mean does not (a 50k vocabulary at ±1e34 summed to inf unscaled)
        diff = torch.sub(m_safe * SUM_SCALE, logits, alpha=SUM_SCALE).masked_fill_(masked, 0.0)
        if cw is None:
            smooth, wu = diff.sum(1, keepdim=True), k
        else:
            smooth = (diff @ cw).unsqueeze(1)
            wu = (cw.sum() - masked.to(cw.dtype) @ cw).unsqueeze(1)
        del diff
    e = logits.sub_(m_safe).exp_()
    if v > 0:
        e.scatter_(1, t_safe, 0.0 if owned is None else torch.where(owned, 0.0, e.gather(1, t_safe)))
    return LocalRows(e, m, dead, m_safe, lt, e.sum(1, keepdim=True), masked, th, smooth, k, wu)


class RowTerms(NamedTuple):
    """The per-row loss and what its gradient needs (all ``(n, 1)``), from the combined rows."""

    loss: Tensor  # 0 on invalid rows
    row_w: Tensor  # w_t on valid rows, 0 elsewhere: the terms of 'mean''s denominator
    valid: Tensor  # kept and not all -inf
    sm1: Tensor  # S - 1
    lse: Tensor
    a_focal: Tensor | None  # focal's A
    wt: Tensor | None
    k: Tensor | None  # K clamped to 1
    wu: Tensor | None


def target_shift(lt: Tensor, m: Tensor) -> Tensor:
    """``w = m − l_t`` negated, from the target's logit and the row max read before the bound:
    ``-inf`` on a ``+inf`` row whose target is not ``+inf`` (probability 0, the limit:
    ``-log p_t = +inf``); 0 where ``l_t = m = ±inf`` (a ``+inf`` target: the bounded logits
    tie; an all ``-inf`` row, dropped) and on NaN rows (NaN through ``D``): the row core's ``w``
    (rows.index_row)."""
    return torch.nan_to_num(lt - m, nan=0.0, posinf=_INF, neginf=_NEG_INF)


def _weighted(v: Tensor, wt: Tensor | None, w0: Tensor | None) -> Tensor:
    """``w_t v`` with ``0 · inf = 0`` (``w0``: ``w_t == 0``): a class weight of 0 removes the
    term (``-log p_t = +inf`` at a masked target), as in ``cross_entropy``."""
    if wt is None or w0 is None:
        return v
    return (wt * v).masked_fill(w0, 0.0)


def row_terms(
    head: IndexHead, shift: Tensor, d: Tensor, m: Tensor, kept: Tensor, wt: Tensor | None,
    smooth: Tensor | None, k: Tensor | None, wu: Tensor | None, dead: Tensor | None = None,
    out: Tensor | None = None,
) -> RowTerms:
    """The loss of each row from its (combined) statistics: ``shift`` (`target_shift`), ``D``,
    the max ``m`` before the bound (``-inf``: an all ``-inf`` row; ``dead``: ``m == -inf`` when
    known; ``+inf``: a ``+inf`` row), ``kept`` (a target to score). ``out`` ``(n, 2)``: where to
    write the loss and the row weight (the head's output, no concatenation)."""
    eps, zl = head.label_smoothing, head.z_loss
    dead = m == _NEG_INF if dead is None else dead
    # the row core's formula (rows.target_nll): S - 1 = D + expm1(-w), -log p_t = log S + w;
    # on all -inf rows z = -inf and D = 0: S = 1 there (log p_t = -inf, finite scales)
    sm1, log_s, nll = target_nll(shift.neg(), d, dead=dead)
    lse = m.clamp(max=torch.finfo(m.dtype).max) + log_s  # the bounded row's (finite scales)
    a_focal = None
    w0 = None if wt is None else wt == 0
    if head.gamma is None:
        if eps == 0.0:
            loss = _weighted(nll, wt, w0)
        else:
            assert smooth is not None and k is not None and wu is not None
            k = k.clamp(min=1.0)
            # smooth is scaled by SUM_SCALE (local_rows): ε before the unscaling, so that it
            # overflows only where the term itself does
            loss = (smooth / k) * (eps / SUM_SCALE) + eps * (wu / k) * log_s
            # +inf rows: the +inf entries add 0 to smooth (m - l = 0 bounded), a finite unmasked
            # class of nonzero weight adds at least ulp(finfo.max)·w_c·2^-64 > 0: it has
            # probability 0 and its smoothing term is +inf, the limit (rows.smoothing_sum)
            loss = loss.masked_fill((m == _INF) & (smooth != 0.0), _INF)
            if eps < 1.0:
                # (1 − ε)·w_t before it meets −log p_t, which may be near finfo.max: no overflow
                # where the term is finite (as cross_entropy)
                loss = loss + (_weighted(nll, wt * (1.0 - eps), w0) if wt is not None else (1.0 - eps) * nll)
    else:
        # the row core's focal term: 1 - p_t = D / S, p_t = e^{-nll}
        val, a_focal = focal_rows(d / (1.0 + sm1), torch.exp(nll.neg()), nll, head.gamma)
        loss = _weighted(val, wt, w0)
    if zl > 0.0:
        z_row = zl * lse.square()
        loss = loss + _weighted(z_row, wt, w0)
    valid = kept & ~dead
    if out is None:
        loss = torch.where(valid, loss, 0.0)
        row_w = valid.to(loss.dtype) if wt is None else torch.where(valid, wt, 0.0)
    else:
        zero = loss.new_zeros(())  # (where's out= takes no Python scalar)
        loss = torch.where(valid, loss, zero, out=out[:, :1])
        row_w = out[:, 1:].copy_(valid) if wt is None else torch.where(valid, wt, zero, out=out[:, 1:])
    return RowTerms(loss, row_w, valid, sm1, lse, a_focal, wt, k, wu)


def row_scales(head: IndexHead, r: RowTerms, s: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(α / S, β, s ε / K)`` per row for the logit gradient of ``Σ s ℓ``:
    ``(α / S) e^{l - m} - β onehot(t) - δ w_c [unmasked]``."""
    eps, zl = head.label_smoothing, head.z_loss
    s = torch.where(r.valid, s, 0.0)
    sw = s if r.wt is None else s * r.wt
    if head.gamma is None:
        # α = s ((1 - ε) w_t + ε W_U / K): s alone without class weights (W_U = K)
        beta = sw * (1.0 - eps)
        if eps == 0.0:
            alpha = beta
        else:
            assert r.k is not None and r.wu is not None
            alpha = s if r.wt is None else beta + s * (eps * r.wu / r.k)
    else:
        assert r.a_focal is not None
        alpha = beta = sw * r.a_focal
    if zl > 0.0:
        alpha = alpha + sw * (2.0 * zl) * r.lse
    # lse = -inf on all -inf rows: 0 * -inf would be NaN.
    alpha = torch.where(r.valid, alpha, 0.0)
    delta = None
    if eps > 0.0:
        assert r.k is not None
        delta = s * (eps / r.k)
    return alpha / (1.0 + r.sm1), beta, delta


def logit_grad(
    e: Tensor, t_safe: Tensor, a_over_s: Tensor, beta: Tensor, delta: Tensor | None, cw: Tensor | None,
    masked: Tensor | None, th: Tensor | None,
) -> Tensor:
    """``(α / S) e - β onehot(t) - δ w_c [unmasked]`` through softcap, in ``e``'s buffer (``e`` =
    ``e^{l - m}`` with its target entry; ``β`` 0 where the target is not in this vocabulary)."""
    g = e.mul_(a_over_s)
    if delta is not None:
        assert masked is not None
        if cw is None:
            g.sub_(delta)
        else:
            g.addcmul_(delta, cw, value=-1.0)
        g.masked_fill_(masked, 0.0)
    if g.shape[1] > 0:
        g.scatter_add_(1, t_safe, beta.neg())
    if th is not None:
        # d c tanh(u / c) / du = 1 - tanh²: 0 at masked (-inf) entries.
        g.mul_(th.square_().neg_().add_(1.0))
    return g


@dataclass(frozen=True)
class IndexHead(Head):
    """Cross-entropy (``gamma=None``) or focal loss of class-index targets, one process.

    rows: the targets ``(n,)`` int64, then the class weights ``(V,)`` in the compute dtype when
    ``weighted`` (a constant). Outputs: the loss (0 on ignored and all ``-inf`` rows) and the
    row weight (``w_t`` on the rows that count, 0 elsewhere: ``'mean'``'s denominator, no
    gradient).
    """

    fn: str
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float | None
    gamma: float | None
    weighted: bool
    n_out: int = 2
    numeric: ClassVar[tuple[str, ...]] = ("label_smoothing", "z_loss", "softcap", "gamma")

    def _chunk(
        self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...], grad_out: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        (u,) = logits
        t = rows[0]
        cw = rows[1] if self.weighted else None
        # the backend table's row step (the Triton kernels when selected; no softcap, no z-loss)
        kernel = None if self.softcap is not None or self.z_loss > 0.0 else _backend.kernel_for(
            "linear_chunk_head", u)
        if kernel is not None:
            rs = None if grad_out is None else grad_out[:, 0]
            step = kernel(u, t, cw, self.ignore_index, self.label_smoothing, self.gamma, rs)
            if step is not None:
                return torch.stack([step.loss, step.row_w], 1), step.grad
        kept = (t != self.ignore_index).unsqueeze(1)
        t_safe = torch.where(kept, t.unsqueeze(1), 0)
        loc = local_rows(u, t_safe, None, cw, self.label_smoothing, self.softcap)
        wt = None if cw is None else cw.gather(0, t_safe.squeeze(1)).unsqueeze(1)
        shift = target_shift(loc.lt, loc.m)
        out = u.new_empty((u.shape[0], 2))
        r = row_terms(self, shift, loc.d, loc.m, kept, wt, loc.smooth, loc.k, loc.wu, loc.dead, out)
        if grad_out is None:
            return out, None
        a_over_s, beta, delta = row_scales(self, r, grad_out[:, :1])
        e = loc.e.scatter_(1, t_safe, torch.exp(shift))  # the target's own term back
        return out, logit_grad(e, t_safe, a_over_s, beta, delta, cw, loc.masked, loc.th)

    def forward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> Tensor:
        return self._chunk(logits, rows, None)[0]

    def backward(
        self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...], grad_out: Tensor
    ) -> tuple[Tensor | None, ...]:
        return (self._chunk(logits, rows, grad_out)[1],)

    def forward_backward(
        self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...], grad_out: Tensor
    ) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        out, g = self._chunk(logits, rows, grad_out)
        return out, (g,)


# the statistics of a vocabulary shard, one column each (ShardStats' outputs)
SHARD_COLUMNS = ("m", "d", "lt", "smooth", "k", "wu")


@dataclass(frozen=True)
class ShardStats(Head):
    """A vocabulary shard's per-row statistics (`LocalRows`: ``SHARD_COLUMNS``, 0 where a column
    is not used) for the ranks to combine; no gradient. rows: the target's local column, whether
    this shard owns it (bool), then the shard's class weights when ``head.weighted``."""

    head: IndexHead
    n_out: int = len(SHARD_COLUMNS)

    def forward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> Tensor:
        (u,), h = logits, self.head
        owned = rows[1].unsqueeze(1)
        cw = rows[2] if h.weighted else None
        loc = local_rows(u, rows[0].unsqueeze(1), owned, cw, h.label_smoothing, h.softcap)
        zero = torch.zeros_like(loc.m)
        cols = (loc.m, loc.d, loc.lt, loc.smooth, loc.k, loc.wu)
        return torch.cat([zero if c is None else c for c in cols], 1)

    def backward(
        self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...], grad_out: Tensor
    ) -> tuple[Tensor | None, ...]:
        raise NotImplementedError("ShardStats: the statistics are not differentiated (ShardGrad is)")


@dataclass(frozen=True)
class ShardGrad(Head):
    """The gradient pass of a vocabulary shard: ``backward`` gives ``(α / S) e^{l - M} -
    β onehot(t) - δ w_c`` with the combined row max ``M`` and the row scales of `row_scales` as
    ``grad_out``'s three columns. rows: the target's local column, whether this shard owns it,
    ``M`` (0 where ``-inf``), then the shard's class weights when ``head.weighted``."""

    head: IndexHead
    n_out: int = 3

    def forward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> Tensor:
        raise NotImplementedError("ShardGrad: a gradient pass only (ShardStats gives the values)")

    def backward(
        self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...], grad_out: Tensor
    ) -> tuple[Tensor | None, ...]:
        (u,), h = logits, self.head
        t_safe, owned, m_safe = rows[0].unsqueeze(1), rows[1].unsqueeze(1), rows[2].unsqueeze(1)
        cw = rows[3] if h.weighted else None
        lg, th, masked = capped(u, h.softcap, h.label_smoothing > 0.0)
        e = lg.sub_(m_safe).exp_()
        a_over_s, beta, delta = grad_out[:, :1], grad_out[:, 1:2], grad_out[:, 2:]
        beta = torch.where(owned, beta, 0.0)
        return (logit_grad(e, t_safe, a_over_s, beta, None if h.label_smoothing == 0.0 else delta, cw,
                           masked, th),)
