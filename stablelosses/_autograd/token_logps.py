r"""The token log-prob head on the chunk engine (`_autograd/linear.py`): each row's ``log p_t``
under ``softmax(u / T)`` and, with ``entropy``, the row's entropy, from one chunk of logits ``u``.

Per row, from the row core's exact log-softmax (``-inf`` exactly at probability 0, so a
``-inf`` logit is read as probability 0 and ``0 · log 0`` terms are dropped by a select):

* ``log p_t`` with its exact tail: ``log1p(−Σ_{j≠t} p_j)`` where the rest is below ½
  (`rows.accurate_log_pt`), the log-softmax entry elsewhere;
* ``H = −Σ_j p_j log p_j`` over the entries with ``p_j > 0``.

Invalid rows (ignored labels, rows of all ``-inf`` logits) give 0 and the gradient 0, whatever
they hold. The logit gradient of ``Σ g₀ log p_t + g₁ H`` is
``(g₀ (onehot − p) − g₁ p (log p + H)) / T``: 0 wherever ``p = 0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from stablelosses._autograd.linear import Head
from stablelosses._autograd.rows import accurate_log_pt, exact_log_softmax, put

_INF = float("inf")


class _Row(NamedTuple):
    """One chunk's rows: the log-softmax, ``p − onehot(t)`` (target entry ``−Σ_{j≠t} p_j``), the
    label index ``(n, 1)``, the valid rows, ``log p_t`` (0 on invalid rows), the log-softmax at
    the label, and the entropy (``None`` without ``entropy``; 0 on invalid rows)."""

    lsm: Tensor
    p: Tensor
    idx: Tensor
    valid: Tensor
    logp: Tensor
    lt: Tensor
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

    def _rows(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> _Row:
        (u,) = logits
        t, valid = rows[0], rows[1]
        if self.scaled:
            u = u.mul_(rows[2].to(u.dtype).unsqueeze(1))  # the engine's own buffer
        lsm, m = exact_log_softmax(u, 1)
        valid = valid & (m.squeeze(1) != -_INF)
        idx = torch.where(valid, t, 0).unsqueeze(1)
        p = torch.exp(lsm)
        h = None
        if self.entropy:
            # −Σ p log p over the entries with p > 0 (0 · log 0 = 0: a select, not a product)
            h = torch.rsub((p * torch.where(torch.isneginf(lsm), 0.0, lsm)).sum(1), 0.0)
            h = torch.where(valid, h, 0.0)
        lt = lsm.gather(1, idx).squeeze(1)
        # rest = Σ_{j≠t} p_j (never 1 − p_t); p becomes p − onehot(t), its target entry −rest
        p = put(p, 1, idx, 0.0)
        rest = p.sum(1)
        p = put(p, 1, idx, rest.neg().unsqueeze(1))
        logp = torch.where(valid, accurate_log_pt(rest, lt), 0.0)
        return _Row(lsm, p, idx, valid, logp, lt, h)

    def _outputs(self, row: _Row) -> Tensor:
        if row.h is None:
            return row.logp.unsqueeze(1)
        return torch.stack([row.logp, row.h], 1)

    def _grad(self, row: _Row, rows: tuple[Tensor, ...], grad_out: Tensor) -> Tensor:
        """``g₀ (onehot − p) − g₁ p (log p + H)``, over ``T``; 0 on invalid rows."""
        g0 = grad_out[:, :1]
        g = row.p.mul_(g0.neg())  # (p − onehot)·(−g₀): the target entry is g₀·rest
        if row.h is not None:
            g1, h = grad_out[:, 1:], row.h.unsqueeze(1)
            lsm0 = torch.where(torch.isneginf(row.lsm), 0.0, row.lsm)
            probs = torch.exp(row.lsm)
            g = g.sub_(probs.mul_(lsm0.add_(h)).mul_(g1))
        if self.scaled:
            g = g.mul_(rows[2].to(g.dtype).unsqueeze(1))
        # invalid rows: 0 whatever they hold (NaN included)
        return g.masked_fill_(~row.valid.unsqueeze(1), 0.0)

    def forward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> Tensor:
        return self._outputs(self._rows(logits, rows))

    def backward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...],
                 grad_out: Tensor) -> tuple[Tensor | None, ...]:
        return (self._grad(self._rows(logits, rows), rows, grad_out),)

    def forward_backward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...],
                         grad_out: Tensor) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        row = self._rows(logits, rows)
        out = self._outputs(row)
        return out, (self._grad(row, rows, grad_out),)


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
