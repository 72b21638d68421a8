r"""The token log-prob head on the chunk engine (`_autograd/linear.py`): each row's ``log p_t``
under ``softmax(u / T)`` and, with ``entropy``, the row's entropy, from one chunk of logits ``u``.

Without the entropy the head is blockwise: the engine hands it each chunk in vocabulary blocks
``u_b``. Per block, a max with its index (one read) and torch's ``log_softmax`` written over the
block (one pass) give ``lse_b = m_b + log Σ e^{u − m_b}`` (``m_b`` minus the log-softmax at the
max), and a gather the label's logit if the block holds it. ``combine`` takes ``lse`` over the
blocks, ``log p_t = u_t − lse``, and keeps ``lse`` as the state (``+inf`` on invalid rows). The
backward block is ``g (onehot − p)`` with ``p = exp(u − lse)``: a subtraction, an ``exp`` and a
scale, each in place. ``log p_t`` therefore rounds as ``u_t − lse`` does, within a few ulp of
``log_softmax`` (the logits form, `token_logps`, keeps the exact tail as ``p_t → 1``).

With the entropy the head takes whole rows: the row core's exact log-softmax (``-inf`` exactly
at probability 0), so ``H = −Σ_j p_j log p_j`` drops the ``p_j = 0`` terms by a select, finite
with ``-inf`` logits, and the gradient ``g₀ (onehot − p) − g₁ p (log p + H)`` is 0 wherever
``p = 0``.

Invalid rows (ignored labels, rows of all ``-inf`` logits) give 0 and the gradient 0; the caller
zeroes the hidden state of ignored rows, so that whatever they hold never reaches ``dW``. Every
gradient is divided by ``T`` for the scaled heads. A row with a ``+inf`` logit (an infinite
bias) is NaN here.
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
    n_state: ClassVar[int] = 1  # lse (+inf on invalid rows)

    def _scale(self, u: Tensor, rows: tuple[Tensor, ...]) -> Tensor:
        """``u / T`` in place (the engine's own buffer), or ``u``."""
        return u.mul_(rows[2].to(u.dtype).unsqueeze(1)) if self.scaled else u

    # --- blockwise (no entropy) ---------------------------------------------------------------

    def block_forward(self, u: Tensor, rows: tuple[Tensor, ...], v0: int) -> Tensor:
        """``(lse_b, u_t or 0)`` of the block."""
        u = self._scale(u, rows)
        idx, held = _in_block(rows[0], v0, u.shape[1])
        u_t = torch.where(held, u.gather(1, idx), 0.0)
        m, at = u.max(1, keepdim=True)
        lsm = log_softmax_over(u, 1)
        # −log Σ e^{u − m} is the log-softmax at the max; an all -inf block adds nothing
        lse = torch.where(m == -_INF, m, m - lsm.gather(1, at))
        return torch.cat([lse, u_t], 1)

    def combine(self, parts: list[Tensor], rows: tuple[Tensor, ...], vocab: int) -> tuple[Tensor, Tensor]:
        # a label out of range raises as torch's gather does (a gather from a broadcast 0)
        p = parts[0]
        p.new_zeros(()).expand(p.shape[0], vocab).gather(1, torch.where(rows[1], rows[0], 0).unsqueeze(1))
        p = torch.stack(parts, 2)  # (n, 2, blocks)
        lse, u_t = torch.logsumexp(p[:, 0], 1), p[:, 1].sum(1)
        valid = rows[1] & (lse != -_INF)
        logp = torch.where(valid, u_t - lse, 0.0)
        return logp.unsqueeze(1), torch.where(valid, lse, _INF).unsqueeze(1)

    def block_backward(self, u: Tensor, rows: tuple[Tensor, ...], v0: int, state: Tensor,
                       grad_out: Tensor) -> Tensor:
        """``c (onehot − e^{u − lse})``, ``c = g / T``, 0 on invalid rows (``lse = +inf``)."""
        u = self._scale(u, rows)
        c = torch.where(state == _INF, 0.0, grad_out[:, :1])
        if self.scaled:
            c = c * rows[2].to(c.dtype).unsqueeze(1)
        g = u.sub_(state).exp_().mul_(c.neg())
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
