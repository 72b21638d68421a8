r"""Distillation divergences between a student's and a teacher's distribution over the last
dimension, with the ``-inf`` limits of a masked or top-k vocabulary.

Per row, with ``a`` the student's and ``b`` the teacher's logits already divided by the
temperature, ``ls = log_softmax(a)``, ``lt = log_softmax(b)``, ``q = e^{ls}``, ``p = e^{lt}``:

* forward KL ``KL(p‖q) = Σ p (lt − ls)``: ``∂/∂a = q Σp − p``, ``∂/∂b = p (lt − ls − KL)``;
* reverse KL ``KL(q‖p)``: the same with the two sides swapped;
* generalised JSD (TRL's ``generalized_jsd_loss``, ``0 < β < 1``) with the log mixture
  ``m = logaddexp(ls + log(1−β), lt + log β)`` (the log of ``M = (1−β) q + β p``):
  ``J = β Σ p (lt − m) + (1−β) Σ q (ls − m)``, ``∂J/∂a = (1−β) q (r − Σ q r)`` with
  ``r = ls − m``, ``∂J/∂b = β p (u − Σ p u)`` with ``u = lt − m`` (the ``−Σ M log M`` part's
  derivative cancels the ``+1`` of the entropy parts);
* total variation ``½ Σ |p − q|``: ``∂/∂a = ½ q (σ − Σ σ q)``, ``∂/∂b = ½ p (Σ σ p − σ)`` with
  ``σ = sign(q − p)`` (0 where ``p = q``: the minimal-norm subgradient).

The ``-inf`` limits: a term with zero probability on the side that weights it (``p`` in
``Σ p (·)``) is 0, and its gradient 0, also where the other side is ``-inf``; a KL term with
mass against a ``-inf`` log-probability makes the row ``+inf`` (the true value), and the
gradient with respect to the side whose derivative diverges there (the teacher for the
forward KL, the student for the reverse) is 0 on that row, the other side's stays the finite
``q Σp − p``. JSD's ``lt − m ≤ −log β`` and ``ls − m ≤ −log(1−β)`` where their weights are
nonzero, and TVD is bounded by 1: both are finite for every finite or infinite input.

Every singular operand is made safe before it is multiplied (double ``where``), and the
gradients are written in differentiable ops on the saved inputs (recomputing the two
log-softmaxes through the stable `_log_softmax` and `_logaddexp`): double backward and ``jvp``
come from the same code. The row functions (`row_loss`, `row_grads`) also serve the fused
linear head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from stablelosses._autograd._base import StableFunction
from stablelosses._autograd.linear import Head
from stablelosses._autograd.logaddexp import _LogAddExp
from stablelosses._autograd.softmax import _LogSoftmax, _Softmax

_INF = float("inf")
KINDS = ("forward_kl", "reverse_kl", "jsd", "tvd")


class Grads(NamedTuple):
    """``d row_loss / d a`` (student) and ``/ d b`` (teacher), per entry; ``None`` where not asked."""

    student: Tensor | None
    teacher: Tensor | None


def _kl_parts(lq: Tensor, lp: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``KL(p‖q)`` per row from the log-probabilities, with the safe log-ratio ``d`` and the
    rows whose value is ``+inf``.

    ``d = lp − lq`` is 0 where ``lp = −inf`` (no mass: the term is 0, also against ``lq =
    −inf``) and where ``lq = −inf < lp`` (those rows are ``+inf``, set after the sum): no
    ``0·inf`` or ``inf − inf`` is ever formed, and a NaN in either stays NaN (the comparisons
    are False on NaN)."""
    p = torch.exp(lp)
    dead = torch.isneginf(lp)
    against = torch.isneginf(lq) & (lp > -_INF)
    d = torch.where(dead | against, 0.0, lp - lq)
    inf_row = against.any(-1)
    kl = torch.where(inf_row, _INF, (p * d).sum(-1))
    return kl, d, inf_row


def _kl_q_grad(q: Tensor, p: Tensor) -> Tensor:
    """``d KL(p‖q) / d`` (the logits of ``q``) ``= q Σp − p``; ``Σp = 0`` on an all ``-inf`` p
    row (the value is 0 there, and stays 0)."""
    return q * p.sum(-1, keepdim=True) - p


def _kl_grads(lq: Tensor, lp: Tensor, need_q: bool, need_p: bool) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of ``KL(p‖q)`` with respect to the logits behind ``lq`` and behind ``lp``."""
    p = torch.exp(lp)
    g_q = g_p = None
    if need_q:
        g_q = _kl_q_grad(torch.exp(lq), p)
    if need_p:  # p (d − KL) as p d − p KL, 0 on the +inf rows
        kl, d, inf_row = _kl_parts(lq, lp)
        kl_safe = torch.where(inf_row, 0.0, kl).unsqueeze(-1)
        # d − KL alone overflows where both are near finfo.max (a log-ratio of −3.4e38 at an entry
        # of p = 0 against a KL of 3.4e38: 0 · inf = NaN); each product is at most its factor
        g_p = torch.where(inf_row.unsqueeze(-1), 0.0, torch.addcmul(p * d, p, kl_safe, value=-1.0))
    return g_q, g_p


def _jsd_parts(ls: Tensor, lt: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """``r = ls − m`` and ``u = lt − m`` with the log mixture ``m``, each 0 where its own
    log-probability is ``-inf`` (zero weight; ``m`` is ``-inf`` only where both are)."""
    m = _LogAddExp.call(ls + math.log1p(-beta), lt + math.log(beta))
    r = torch.where(torch.isneginf(ls), 0.0, ls - m)
    u = torch.where(torch.isneginf(lt), 0.0, lt - m)
    return r, u


def _spread(w: Tensor, v: Tensor) -> Tensor:
    """``w (v − Σ w v)`` over the last dimension: the softmax chain rule of ``Σ w v``-type sums."""
    return w * (v - (w * v).sum(-1, keepdim=True))


def _logps(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    return _LogSoftmax.call(a, a.dim() - 1), _LogSoftmax.call(b, b.dim() - 1)


def _is_forward(kind: str, beta: float) -> bool:
    return kind == "forward_kl" or (kind == "jsd" and beta == 0.0)


def _is_reverse(kind: str, beta: float) -> bool:
    return kind == "reverse_kl" or (kind == "jsd" and beta == 1.0)


def _loss_of(kind: str, beta: float, ls: Tensor, lt: Tensor) -> Tensor:
    """The divergence of each row. KL and JSD are sums of terms of both signs that cancel to
    about 0 where ``p ≈ q``; a sum rounded below 0 is 0, nearer the true value (never negative).
    NaN stays NaN; the gradients come from `_grads_of`, never through this."""
    if _is_forward(kind, beta):
        return _kl_parts(ls, lt)[0].clamp_min(0.0)
    if _is_reverse(kind, beta):
        return _kl_parts(lt, ls)[0].clamp_min(0.0)
    if kind == "jsd":
        r, u = _jsd_parts(ls, lt, beta)
        return (beta * torch.exp(lt) * u + (1.0 - beta) * torch.exp(ls) * r).sum(-1).clamp_min(0.0)
    return 0.5 * (torch.exp(ls) - torch.exp(lt)).abs().sum(-1)


def _grads_of(kind: str, beta: float, ls: Tensor, lt: Tensor, need_a: bool, need_b: bool) -> Grads:
    if _is_forward(kind, beta):
        return Grads(*_kl_grads(ls, lt, need_a, need_b))
    if _is_reverse(kind, beta):
        g_t, g_s = _kl_grads(lt, ls, need_b, need_a)
        return Grads(g_s, g_t)
    q, p = torch.exp(ls), torch.exp(lt)
    if kind == "jsd":
        r, u = _jsd_parts(ls, lt, beta)
        return Grads((1.0 - beta) * _spread(q, r) if need_a else None,
                     beta * _spread(p, u) if need_b else None)
    sigma = torch.sign(q - p)
    return Grads(0.5 * _spread(q, sigma) if need_a else None,
                 -0.5 * _spread(p, sigma) if need_b else None)


def row_loss(kind: str, beta: float, a: Tensor, b: Tensor) -> Tensor:
    """The divergence of each row (the last dimension summed) of student ``a`` and teacher
    ``b`` scaled logits of one shape."""
    return _loss_of(kind, beta, *_logps(a, b))


def row_grads(kind: str, beta: float, a: Tensor, b: Tensor, need_a: bool, need_b: bool) -> Grads:
    """``d row_loss / d a`` and ``d row_loss / d b`` (``None`` where not needed), in
    differentiable ops."""
    # A KL's gradient on the side of its log-ratio's subtrahend is q Σp − p: the two softmaxes
    # suffice (the same limits as exp of the log-softmaxes, 0.56x their bytes each)
    if _is_forward(kind, beta) and not need_b:
        return Grads(_kl_q_grad(_Softmax.call(a, a.dim() - 1), _Softmax.call(b, b.dim() - 1))
                     if need_a else None, None)
    if _is_reverse(kind, beta) and not need_a:
        return Grads(None, _kl_q_grad(_Softmax.call(b, b.dim() - 1), _Softmax.call(a, a.dim() - 1))
                     if need_b else None)
    return _grads_of(kind, beta, *_logps(a, b), need_a, need_b)


def row_loss_grads(kind: str, beta: float, a: Tensor, b: Tensor, need_a: bool,
                   need_b: bool) -> tuple[Tensor, Grads]:
    """`row_loss` and `row_grads` from one pair of log-softmaxes."""
    ls, lt = _logps(a, b)
    return _loss_of(kind, beta, ls, lt), _grads_of(kind, beta, ls, lt, need_a, need_b)


def _inputs(s: Tensor, t: Tensor, mask: Tensor | None, temperature: float) -> tuple[Tensor, Tensor]:
    """The scaled logits; the rows of a False ``mask`` read as 0 (select: a NaN there is never
    read, in the forward or in any derivative)."""
    if mask is not None:
        keep = mask.unsqueeze(-1)
        s, t = torch.where(keep, s, 0.0), torch.where(keep, t, 0.0)
    if temperature != 1.0:
        s, t = s / temperature, t / temperature
    return s, t


class _Distillation(StableFunction):
    """Per-row divergence of ``(..., V)`` student and teacher logits, 0 on the False rows of
    ``mask`` (shape ``(...)``, or ``None``). Backward and jvp from `row_grads`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(s: Tensor, t: Tensor, mask: Tensor | None, kind: str, beta: float,
                temperature: float) -> Tensor:
        a, b = _inputs(s, t, mask, temperature)
        out = row_loss(kind, beta, a, b)
        return out if mask is None else torch.where(mask, out, 0.0)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        s, t, mask, kind, beta, temperature = inputs
        ctx.cfg = (kind, beta, temperature)
        ctx.save_for_backward(s, t, mask)
        ctx.save_for_forward(s, t, mask)

    @staticmethod
    def _grads(ctx: Any, need_s: bool, need_t: bool) -> tuple[Grads, Tensor | None, float]:
        s, t, mask = ctx.saved_tensors
        kind, beta, temperature = ctx.cfg
        a, b = _inputs(s, t, mask, temperature)
        return row_grads(kind, beta, a, b, need_s, need_t), mask, temperature

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        need_s, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g, mask, temperature = _Distillation._grads(ctx, need_s, need_t)
        scale = grad / temperature
        if mask is not None:
            scale = torch.where(mask, scale, 0.0)
        scale = scale.unsqueeze(-1)
        g_s = None if g.student is None else g.student * scale
        g_t = None if g.teacher is None else g.teacher * scale
        return g_s, g_t, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, ts: Tensor | None, tt: Tensor | None, *_: Any) -> Tensor:
        g, mask, temperature = _Distillation._grads(ctx, ts is not None, tt is not None)
        out = None
        for gi, ti in ((g.student, ts), (g.teacher, tt)):
            if gi is not None and ti is not None:
                term = (gi * ti).sum(-1)
                out = term if out is None else out + term
        assert out is not None
        out = out / temperature
        return out if mask is None else torch.where(mask, out, 0.0)


# --- the fused form: a head on the chunk engine (stablelosses/_autograd/linear.py) ---------------


def pad_vocab(u: Tensor, v: int) -> Tensor:
    """Logits ``u`` ``(..., V_k)`` widened to ``v`` classes with ``-inf`` (classes this model
    cannot produce: probability 0, exactly)."""
    if u.shape[-1] == v:
        return u
    return torch.nn.functional.pad(u, (0, v - u.shape[-1]), value=-_INF)


@dataclass(frozen=True)
class DistillationHead(Head):
    """Stream 0 the student, stream 1 the teacher; ``rows`` holds the token mask when
    ``masked``. The narrower vocabulary is padded with ``-inf`` to the wider one; the padded
    columns' gradients are dropped. ``student_grad``/``teacher_grad``: which logit gradients
    `backward` returns (``None`` for the other)."""

    kind: str
    beta: float
    temperature: float
    masked: bool
    student_grad: bool
    teacher_grad: bool
    fn: str = "linear_distillation_loss"
    n_out: int = 1
    # may be symbolic under torch.compile(dynamic=True): passed to the engine's op as arguments
    numeric: ClassVar[tuple[str, ...]] = ("beta", "temperature")

    def _scaled(self, logits: tuple[Tensor, ...],
                rows: tuple[Tensor, ...]) -> tuple[Tensor, Tensor, Tensor | None]:
        s, t = logits
        v = max(s.shape[1], t.shape[1])
        mask = rows[0] if self.masked else None
        a, b = _inputs(pad_vocab(s, v), pad_vocab(t, v), mask, self.temperature)
        return a, b, mask

    def _out(self, loss: Tensor, mask: Tensor | None) -> Tensor:
        return (loss if mask is None else torch.where(mask, loss, 0.0)).unsqueeze(1)

    def _logit_grads(self, g: Grads, logits: tuple[Tensor, ...], mask: Tensor | None,
                     grad_out: Tensor) -> tuple[Tensor | None, Tensor | None]:
        scale = grad_out[:, :1] / self.temperature
        if mask is not None:
            scale = torch.where(mask.unsqueeze(1), scale, 0.0)
        s, t = logits
        g_s = None if g.student is None else (g.student[:, : s.shape[1]] * scale)
        g_t = None if g.teacher is None else (g.teacher[:, : t.shape[1]] * scale)
        return g_s, g_t

    def forward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> Tensor:
        a, b, mask = self._scaled(logits, rows)
        return self._out(row_loss(self.kind, self.beta, a, b), mask)

    def backward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...],
                 grad_out: Tensor) -> tuple[Tensor | None, ...]:
        a, b, mask = self._scaled(logits, rows)
        g = row_grads(self.kind, self.beta, a, b, self.student_grad, self.teacher_grad)
        return self._logit_grads(g, logits, mask, grad_out)

    def forward_backward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...],
                         grad_out: Tensor) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        a, b, mask = self._scaled(logits, rows)
        loss, g = row_loss_grads(self.kind, self.beta, a, b, self.student_grad, self.teacher_grad)
        return self._out(loss, mask), self._logit_grads(g, logits, mask, grad_out)
