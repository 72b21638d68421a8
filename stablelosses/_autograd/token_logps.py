r"""The token log-prob head on the chunk engine (`_autograd/linear.py`): each row's ``log p_t``
under ``softmax(u / T)`` and, with ``entropy``, the row's entropy, from one chunk of logits ``u``.

Without the entropy, the forward is torch's ``log_softmax`` written over the chunk (the engine's
own buffer) and a gather, and the backward torch's ``softmax`` written over it, times ``−g``, with
``g`` added at the label: ``g (onehot − p)``. Each row max (a read) finds the rows of all
``-inf`` logits. Measured on one ``512 × 32000`` float32 chunk (2 CPU threads, 2026-12-07): this
forward 0.15 s and backward 0.25 s, against 0.50 s and 0.70 s for the row core's exact
log-softmax with the exact tail of ``log p_t`` (five more passes); the chunk's matmul is 0.70 s.
So ``log p_t`` rounds as ``log_softmax`` does (the logits form, `token_logps`, keeps the tail).

With the entropy: the row core's exact log-softmax (``-inf`` exactly at probability 0), so
``H = −Σ_j p_j log p_j`` drops the ``p_j = 0`` terms by a select, finite with ``-inf`` logits,
and the gradient ``g₀ (onehot − p) − g₁ p (log p + H)`` is 0 wherever ``p = 0``.

Invalid rows (ignored labels, rows of all ``-inf`` logits) give 0 and the gradient 0, whatever
they hold. Every gradient is divided by ``T`` for the scaled heads. A row with a ``+inf`` logit
(an infinite bias) is NaN here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from stablelosses._autograd.linear import Head
from stablelosses._autograd.rows import exact_log_softmax, log_softmax_over, put, softmax_over

_INF = float("inf")


class _Row(NamedTuple):
    """One chunk's rows: the log-softmax (or the softmax, for the backward without entropy), the
    label index ``(n, 1)``, the valid rows, ``log p_t`` (0 on invalid rows) and the entropy
    (``None`` without ``entropy``; 0 on invalid rows)."""

    lsm: Tensor
    idx: Tensor
    valid: Tensor
    logp: Tensor | None
    h: Tensor | None


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

    def _rows(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...], probs: bool = False) -> _Row:
        """The chunk's rows; ``probs`` (no entropy, backward): the softmax instead of the
        log-softmax, and no outputs."""
        (u,) = logits
        t, valid = rows[0], rows[1]
        if self.scaled:
            u = u.mul_(rows[2].to(u.dtype).unsqueeze(1))  # the engine's own buffer
        h = None
        if self.entropy:
            lsm, m = exact_log_softmax(u, 1)
            valid = valid & (m.squeeze(1) != -_INF)
            p = torch.exp(lsm)
            # −Σ p log p over the entries with p > 0 (0 · log 0 = 0: a select, not a product)
            h = torch.rsub((p * torch.where(torch.isneginf(lsm), 0.0, lsm)).sum(1), 0.0)
            h = torch.where(valid, h, 0.0)
        else:
            valid = valid & (u.amax(1) != -_INF)
            lsm = softmax_over(u, 1) if probs else log_softmax_over(u, 1)
        idx = torch.where(valid, t, 0).unsqueeze(1)
        logp = None if probs else torch.where(valid, lsm.gather(1, idx).squeeze(1), 0.0)
        return _Row(lsm, idx, valid, logp, h)

    def _outputs(self, row: _Row) -> Tensor:
        assert row.logp is not None
        if row.h is None:
            return row.logp.unsqueeze(1)
        return torch.stack([row.logp, row.h], 1)

    def _grad(self, row: _Row, rows: tuple[Tensor, ...], grad_out: Tensor) -> Tensor:
        """``g₀ (onehot − p) − g₁ p (log p + H)``, over ``T``; 0 on invalid rows."""
        g0 = grad_out[:, :1]
        if row.h is None:
            g = row.lsm.mul_(g0.neg())  # the softmax (``probs``), our own buffer
        else:
            g1, h = grad_out[:, 1:], row.h.unsqueeze(1)
            lsm0 = torch.where(torch.isneginf(row.lsm), 0.0, row.lsm)
            g = torch.exp(row.lsm).mul_(lsm0.add_(h).mul_(g1).add_(g0)).neg_()
        g = put(g, 1, row.idx, g0, add=True)
        if self.scaled:
            g = g.mul_(rows[2].to(g.dtype).unsqueeze(1))
        # invalid rows: 0 whatever they hold (NaN included)
        return g.masked_fill_(~row.valid.unsqueeze(1), 0.0)

    def forward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> Tensor:
        return self._outputs(self._rows(logits, rows))

    def backward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...],
                 grad_out: Tensor) -> tuple[Tensor | None, ...]:
        return (self._grad(self._rows(logits, rows, probs=not self.entropy), rows, grad_out),)

    def forward_backward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...],
                         grad_out: Tensor) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        if not self.entropy:  # the forward's log-softmax buffer is not the backward's softmax
            return Head.forward_backward(self, logits, rows, grad_out)
        row = self._rows(logits, rows)
        return self._outputs(row), (self._grad(row, rows, grad_out),)


@dataclass(frozen=True)
class _EntropyHead(TokenLogpsHead):
    entropy: bool = True
    n_out: int = 2


@dataclass(frozen=True)
class _ScaledHead(TokenLogpsHead):
    scaled: bool = True


@dataclass(frozen=True)
class _ScaledEntropyHead(TokenLogpsHead):
    entropy: bool = True
    scaled: bool = True
    n_out: int = 2


_HEADS = {
    (False, False): TokenLogpsHead(), (True, False): _EntropyHead(),
    (False, True): _ScaledHead(), (True, True): _ScaledEntropyHead(),
}


def token_logps_head(entropy: bool, scaled: bool) -> TokenLogpsHead:
    """The head with the entropy column and with the ``1/T`` row, or without."""
    return _HEADS[(entropy, scaled)]
