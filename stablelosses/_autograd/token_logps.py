r"""The token log-prob head on the chunk engine (`_autograd/linear.py`): each row's ``log p_t``
under ``softmax(u / T)`` and, with ``entropy``, the row's entropy, from one chunk of logits ``u``.

Without the entropy the head is blockwise: the engine hands it each chunk in vocabulary blocks
``u_b``. Per block: a max with its index (one read, ``+inf`` kept), the block bounded
(``+inf → finfo.max``, one pass: the ``+inf`` entries then share the mass, the limit) and torch's
``log_softmax`` written over it (one pass), whose value at the max is ``−log s_b``,
``s_b = Σ e^{u − m_b}``; a gather gives the label's logit if the block holds it. ``combine``
takes the row max ``M`` and ``log S = log Σ_b e^{m_b − M} s_b``, and ``log p_t = (u_t − M) −
log S``: torch's log-softmax formula (a row of one block gives its bits), never ``u_t − lse``,
which rounds to ``ulp(M)`` (``0`` for four equal ``1e8`` logits, where ``−log 4`` is right).
Equal maxima shift by exactly 0, so ``+inf`` rows never form ``inf − inf``: a label at ``+inf``
gets ``−log`` of their count, a finite one ``-inf``. The state is ``(M bounded, S)``
(``S = +inf`` on invalid rows). The backward block is ``g (onehot − e^{u − M} / S)`` on the
bounded block: a bound, a subtraction, an ``exp`` and a scale, each in place. The bound costs one
pass each way (``linear_token_logps`` 1024x32000 fwd+bwd: 88 → 106 aten ops, 1.85 → 2.37 GB
besides the matmuls' own; it was NaN at a ``+inf`` logit without it). ``log p_t`` rounds as
``log_softmax`` does (the logits form, `token_logps`, keeps the exact tail as ``p_t → 1``).

With the entropy the head takes whole rows: the row core's exact log-softmax (``-inf`` exactly
at probability 0), so ``H = −Σ_j p_j log p_j`` drops the ``p_j = 0`` terms by a select, finite
with ``-inf`` logits, and the gradient ``g₀ (onehot − p) − g₁ p (log p + H)`` is 0 wherever
``p = 0``.

Invalid rows (ignored labels, rows of all ``-inf`` logits) give 0 and the gradient 0; the caller
zeroes the hidden state of ignored rows, so that whatever they hold never reaches ``dW``. Every
gradient is divided by ``T`` for the scaled heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from stablelosses._autograd.linear import Head
from stablelosses._autograd.rows import exact_log_softmax, log_softmax_over, put

_INF = float("inf")


class _Row(NamedTuple):
    """One chunk's rows (entropy heads): the log-softmax, the label index ``(n, 1)``, the valid
    rows, ``log p_t`` and the entropy (0 on invalid rows)."""

    lsm: Tensor
    idx: Tensor
    valid: Tensor
    logp: Tensor
    h: Tensor


def _in_block(t: Tensor, v0: int, width: int) -> tuple[Tensor, Tensor]:
    """The labels' column in the block ``v0 : v0 + width`` (clamped into it) ``(n, 1)`` and
    whether the block holds the label ``(n, 1)``."""
    loc = (t - v0).unsqueeze(1)
    idx = loc.clamp(0, width - 1)
    return idx, idx == loc


@dataclass(frozen=True)
class TokenLogpsHead(Head):
    """``rows``: ``(labels, valid)``, and ``1/T`` per row when ``scaled``. Outputs: ``log p_t``,
    and the entropy as a second column when ``entropy`` (``n_out = 2``).

    The configuration lives in four subclasses' defaults, built once (`token_logps_head`), never
    in constructor arguments: torch.compile (2.13) rebuilds a frozen-dataclass head from its
    field defaults when it turns it into the engine's registry key, so a field given to the
    constructor would be lost there. ``ignore_index`` is therefore applied by the caller, who
    passes the ``valid`` rows.
    """

    entropy: bool = False
    scaled: bool = False
    n_out: int = 1
    fn: str = "linear_token_logps"
    blockwise: ClassVar[bool] = True
    n_state: ClassVar[int] = 2  # the row max (bounded) and S (+inf on invalid rows)

    def _scale(self, u: Tensor, rows: tuple[Tensor, ...]) -> Tensor:
        """``u / T`` in place (the engine's own buffer), or ``u``."""
        return u.mul_(rows[2].to(u.dtype).unsqueeze(1)) if self.scaled else u

    # --- blockwise (no entropy) ---------------------------------------------------------------

    def block_forward(self, u: Tensor, rows: tuple[Tensor, ...], v0: int) -> Tensor:
        """``(m_b, log s_b, u_t or 0)`` of the block: its max (``+inf`` kept), the log of its
        sum ``s_b = Σ e^{u − m_b}`` over the block bounded (``+inf → finfo.max``: the ``+inf``
        entries share the mass) and the label's logit as computed."""
        u = self._scale(u, rows)
        idx, held = _in_block(rows[0], v0, u.shape[1])
        u_t = torch.where(held, u.gather(1, idx), 0.0)
        m, at = u.max(1, keepdim=True)
        # torch's log-softmax of the bounded block is (u − m_b) − log s_b, so at the max it is
        # −log s_b exactly (lse_b = m_b + log s_b would round to ulp(m_b): 0 for 1e8 logits)
        lsm = log_softmax_over(u.clamp_(max=torch.finfo(u.dtype).max), 1)
        return torch.cat([m, lsm.gather(1, at).neg(), u_t], 1)

    def combine(self, parts: list[Tensor], rows: tuple[Tensor, ...], vocab: int) -> tuple[Tensor, Tensor]:
        """``log p_t = (u_t − M) − log S`` with the row max ``M`` and ``S = Σ_b e^{m_b − M} s_b``
        (torch's log-softmax on a single block); the state ``(clamp(M), S)``, ``S = +inf`` on
        invalid rows. Equal maxima shift by exactly 0 (``+inf`` rows: ``inf − inf`` never
        formed), a NaN max gives NaN."""
        # a label out of range raises as torch's gather does (a gather from a broadcast 0)
        p = parts[0]
        p.new_zeros(()).expand(p.shape[0], vocab).gather(1, torch.where(rows[1], rows[0], 0).unsqueeze(1))
        p = torch.stack(parts, 2)  # (n, 3, blocks)
        m_b, log_s, u_t = p[:, 0], p[:, 1], p[:, 2].sum(1)
        big_m = m_b.amax(1, keepdim=True)
        # an all -inf block adds nothing (its log s_b is NaN)
        terms = torch.where(m_b == -_INF, -_INF, torch.where(m_b == big_m, 0.0, m_b - big_m) + log_s)
        log_big_s, big_m = torch.logsumexp(terms, 1), big_m.squeeze(1)
        valid = rows[1] & (log_big_s != -_INF)
        shift = torch.where(u_t == big_m, 0.0, u_t - big_m)
        logp = torch.where(valid, shift - log_big_s, 0.0)
        fmax = torch.finfo(p.dtype).max
        state = torch.stack([big_m.clamp(-fmax, fmax), torch.where(valid, log_big_s.exp(), _INF)], 1)
        return logp.unsqueeze(1), state

    def block_backward(self, u: Tensor, rows: tuple[Tensor, ...], v0: int, state: Tensor,
                       grad_out: Tensor) -> Tensor:
        """``c (onehot − e^{u − M} / S)``, ``c = g / T``, on the bounded block; 0 on invalid rows
        (``S = +inf``)."""
        u = self._scale(u, rows)
        big_s = state[:, 1:]
        c = torch.where(big_s == _INF, 0.0, grad_out[:, :1])
        if self.scaled:
            c = c * rows[2].to(c.dtype).unsqueeze(1)
        g = u.clamp_(max=torch.finfo(u.dtype).max).sub_(state[:, :1]).exp_().mul_(c.neg() / big_s)
        idx, held = _in_block(rows[0], v0, u.shape[1])
        return g.scatter_add_(1, idx, torch.where(held, c, 0.0))

    # --- whole rows (entropy) -----------------------------------------------------------------

    def _rows(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> _Row:
        (u,) = logits
        t, valid = rows[0], rows[1]
        u = self._scale(u, rows)
        lsm, m = exact_log_softmax(u, 1)
        valid = valid & (m.squeeze(1) != -_INF)
        p = torch.exp(lsm)
        # −Σ p log p over the entries with p > 0 (0 · log 0 = 0: a select, not a product)
        h = torch.rsub((p * torch.where(torch.isneginf(lsm), 0.0, lsm)).sum(1), 0.0)
        h = torch.where(valid, h, 0.0)
        idx = torch.where(valid, t, 0).unsqueeze(1)
        logp = torch.where(valid, lsm.gather(1, idx).squeeze(1), 0.0)
        return _Row(lsm, idx, valid, logp, h)

    def _grad(self, row: _Row, rows: tuple[Tensor, ...], grad_out: Tensor) -> Tensor:
        """``g₀ (onehot − p) − g₁ p (log p + H)``, over ``T``; 0 on invalid rows."""
        g0, g1, h = grad_out[:, :1], grad_out[:, 1:], row.h.unsqueeze(1)
        lsm0 = torch.where(torch.isneginf(row.lsm), 0.0, row.lsm)
        g = torch.exp(row.lsm).mul_(lsm0.add_(h).mul_(g1).add_(g0)).neg_()
        g = put(g, 1, row.idx, g0, add=True)
        if self.scaled:
            g = g.mul_(rows[2].to(g.dtype).unsqueeze(1))
        # invalid rows: 0 whatever they hold (NaN included)
        return g.masked_fill_(~row.valid.unsqueeze(1), 0.0)

    def forward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> Tensor:
        row = self._rows(logits, rows)
        return torch.stack([row.logp, row.h], 1)

    def backward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...],
                 grad_out: Tensor) -> tuple[Tensor | None, ...]:
        return (self._grad(self._rows(logits, rows), rows, grad_out),)

    def forward_backward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...],
                         grad_out: Tensor) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        row = self._rows(logits, rows)
        return torch.stack([row.logp, row.h], 1), (self._grad(row, rows, grad_out),)


@dataclass(frozen=True)
class _EntropyHead(TokenLogpsHead):
    entropy: bool = True
    n_out: int = 2
    blockwise: ClassVar[bool] = False
    n_state: ClassVar[int] = 0


@dataclass(frozen=True)
class _ScaledHead(TokenLogpsHead):
    scaled: bool = True


@dataclass(frozen=True)
class _ScaledEntropyHead(TokenLogpsHead):
    entropy: bool = True
    scaled: bool = True
    n_out: int = 2
    blockwise: ClassVar[bool] = False
    n_state: ClassVar[int] = 0


_HEADS = {
    (False, False): TokenLogpsHead(), (True, False): _EntropyHead(),
    (False, True): _ScaledHead(), (True, True): _ScaledEntropyHead(),
}


def token_logps_head(entropy: bool, scaled: bool) -> TokenLogpsHead:
    """The head with the entropy column and with the ``1/T`` row, or without."""
    return _HEADS[(entropy, scaled)]
