r"""The one chunk engine of the fused linear losses: the ``(N, V)`` logits never exist.

A fused linear loss is a *head* on this engine. The engine owns the chunk loop: for each chunk of
``n`` rows and each *stream* ``k`` (stream 0 the model, stream 1 e.g. a teacher) it computes the
logits ``u_k = x_k W_k^T + b_k`` ``(n, V_k)`` in the compute dtype (float32; float64 when any
stream tensor is float64), hands them to the head with the chunk's slices of the per-row tensors
(labels, masks, per-row scalars), and multiplies the head's logit gradients ``g_k`` into
``dx_k = g_k W_k``, ``dW_k = Σ_chunks g_k^T x_k`` and ``db_k = Σ_rows g_k``. The head owns the
math of one chunk (:class:`Head`): ``forward`` gives the ``(n, n_out)`` per-row outputs,
``backward`` the logit gradients of ``Σ out · grad_out``.

A *blockwise* head (one stream, ``Head.blockwise``) is a head whose rows are sums over the
vocabulary (a log-sum-exp, a gathered logit): the engine hands it each chunk in blocks of
columns, ``u_b = x W_b^T + b_b`` ``(n, V_b)``, and it combines their per-row partials, as the
vocabulary-parallel loss combines its shards'. A chunk then holds ``BLOCK_ROWS`` rows, so that
each matmul is large on both sides: the weight is read once per sweep instead of once per
chunk, and each block of ``dW`` is written once instead of read and written per chunk (at
``N = 4096, H = 1024, V = 32000`` float32, ``linear_sequence_logps`` fwd+bwd moves 8.07 GB in
303 aten ops, against 12.52 GB in 203 for 8 chunks of 512 whole rows). Each chunk's blocks share
one logits buffer. Its forward keeps a per-row *state*
(``n_state`` columns after the outputs, e.g. the log-sum-exp) that the backward reads instead
of a second forward sweep.

Only ``n × Σ V_k`` logits exist at once (``n × V_b`` for a blockwise head). A weight narrower
than the compute dtype (bf16/fp16) is converted one vocabulary block of ``W_BLOCK_BYTES`` at a
time, never whole; its gradient is accumulated across chunks in a ``(V, H)`` accumulator in the
compute dtype. Eagerly the loop is a Python loop; while compiling it runs inside the custom op
``stablelosses::linear_chunks`` (the head passed as the registry key of its class and fields,
its ``numeric`` fields as float arguments, which may be symbolic), so the compiled graph does
not depend on ``N``.

Two Functions: :func:`linear_chunks` returns the per-row outputs and its backward recomputes each
chunk's logits, where ``grad_out`` is known; :func:`linear_chunks_reduced` (the fast path of a
``'mean'``/``'sum'``) is given the output weights ``coef`` in the forward, computes the gradients
there (one pass over the logits instead of two) and its backward scales them by the incoming
scalar. The chunked gradient is not differentiable again: given the head's *dense* form (its
outputs as differentiable ops of the whole logits), a backward run with ``create_graph=True``
returns the gradient as a graph of that form, and a backward whose incoming gradient is batched
(a vmap over it: gradcheck's batched grad, ``jacobian(vectorize=True)``) computes it from that
form too; without one, the gradient they return raises on a second backward instead of giving a
wrong second derivative.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from stablelosses._compat import (
    assume_constant_result,
    forward_ad_active,
    functorch_transforms_active,
    under_transform,
)
from stablelosses._utils import no_autocast

# Logits of one chunk (all streams): at most this many bytes (64 MiB) in the compute dtype.
CHUNK_BYTES = 64 * 2**20

# Rows per chunk of a blockwise head (``chunk_size=None``): its logits are split by columns
# instead, each block ``BLOCK_ROWS × V_b`` taking at most CHUNK_BYTES.
BLOCK_ROWS = 4096

# Bytes of one vocabulary block of the weight converted to the compute dtype (16 MiB): a weight
# narrower than the compute dtype (bf16/fp16 with float32 compute) is never converted whole.
W_BLOCK_BYTES = 16 * 2**20


class Head:
    """Per-chunk math of one fused linear loss.

    Subclasses are frozen dataclasses (hashable, constant under ``torch.compile``): the engine
    passes the head itself through ``autograd.Function`` and, while compiling, a registry key to
    its custom op. ``n_out``: the number of per-row outputs. ``numeric``: the names of the float
    fields (``None`` allowed) that a compiled caller may pass as Python floats that vary between
    calls (``dynamic=True`` makes them symbolic): they travel as arguments of the op, the other
    fields must be constants. The head is called on the chunk's tensors only (no autograd: its
    ``backward`` is the gradient, computed by hand); ``rows`` is the chunk's rows of the per-row
    tensors, then the ``consts`` of the call, whole.
    """

    n_out: int = 1
    # float fields that may be symbolic under torch.compile(dynamic=True) (None allowed)
    numeric: ClassVar[tuple[str, ...]] = ()
    # a blockwise head (one stream) implements block_forward, combine and block_backward
    # instead of forward and backward; n_state: its per-row state columns
    blockwise: ClassVar[bool] = False
    n_state: ClassVar[int] = 0

    def forward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> Tensor:
        """``(n, n_out)`` per-row outputs for one chunk. ``logits``: one ``(n, V_k)`` tensor per
        stream, in the compute dtype (float32; float64 for float64 inputs), the engine's own
        buffers: the head may overwrite them. ``rows``: the chunk's rows of the per-row tensors."""
        raise NotImplementedError

    def backward(
        self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...], grad_out: Tensor
    ) -> tuple[Tensor | None, ...]:
        """For each stream, ``d(Σ out · grad_out) / d logits`` ``(n, V_k)``, or ``None`` for a
        stream that needs no gradient (the engine tells the head nothing else; ``None`` counts as
        zero). ``grad_out``: ``(n, n_out)`` in the compute dtype. May reuse the logits buffers."""
        raise NotImplementedError

    def forward_backward(
        self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...], grad_out: Tensor
    ) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        """Optional: ``forward`` and ``backward`` on the same logits (the reduced fast path). The
        default runs ``forward`` on a copy; a head overrides it to share its passes."""
        out = self.forward(tuple(u.clone() for u in logits), rows)
        return out, self.backward(logits, rows, grad_out)

    def block_forward(self, u: Tensor, rows: tuple[Tensor, ...], v0: int) -> Tensor:
        """Blockwise: ``(n, k)`` per-row partials of the logits block ``u`` ``(n, V_b)``, the
        columns ``v0 : v0 + V_b`` (the engine's own buffer: the head may overwrite it)."""
        raise NotImplementedError

    def combine(self, parts: list[Tensor], rows: tuple[Tensor, ...], vocab: int) -> tuple[Tensor, Tensor]:
        """Blockwise: the ``(n, n_out)`` outputs and the ``(n, n_state)`` state from every
        block's partials, in column order; ``vocab``: the number of columns."""
        raise NotImplementedError

    def block_backward(self, u: Tensor, rows: tuple[Tensor, ...], v0: int, state: Tensor,
                       grad_out: Tensor) -> Tensor:
        """Blockwise: ``d(Σ out · grad_out) / d u`` ``(n, V_b)`` for the block ``u`` (as in
        `block_forward`), from the forward's ``state``. May reuse ``u``'s buffer."""
        raise NotImplementedError


def default_chunk_size(vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk for ``chunk_size=None``: the chunk's logits fit in ``CHUNK_BYTES``.

    The largest power of two that fits (at least 1 row); it depends on the vocabulary (summed
    over the streams) and the compute dtype only, so any problem whose logits exceed 64 MiB is
    split.
    """
    rows = max(1, CHUNK_BYTES // (max(vocab, 1) * (torch.finfo(dtype).bits // 8)))
    return 1 << (rows.bit_length() - 1)


# ``chunk`` 0 in the engine's calls: the default (``BLOCK_ROWS`` for a blockwise head, else
# ``default_chunk_size`` of the streams' vocabulary), resolved by `run_chunks` where the loop
# runs (eagerly, or inside the compiled op), where the sizes are numbers: reading a symbolic
# vocabulary's bits would fix it in torch.export and torch.compile(dynamic=True).
AUTO_CHUNK = 0


def compute_dtype(tensors: Sequence[Tensor | None]) -> torch.dtype:
    """float64 when any of ``tensors`` is float64, else float32."""
    wide = any(t is not None and t.dtype == torch.float64 for t in tensors)
    return torch.float64 if wide else torch.float32


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


def _input_grad_into(g: Tensor, w: Tensor, out: Tensor) -> None:
    """``out = g W`` (``out`` a slice of the input gradient); a narrower ``w`` block by block."""
    cd = g.dtype
    if w.dtype == cd:
        torch.mm(g, w, out=out)
        return
    rows = block_rows(w, cd)
    if w.shape[0] == 0:
        out.zero_()
    for v0 in range(0, w.shape[0], rows):
        blk = slice(v0, v0 + rows)
        out.addmm_(g[:, blk], w[blk].to(cd), beta=0.0 if v0 == 0 else 1.0)


def run_chunks(
    head: Head | Packed, xs: Sequence[Tensor], ws: Sequence[Tensor], bs: Sequence[Tensor | None],
    rows: Sequence[Tensor], chunk: int, cd: torch.dtype, grad_out: Tensor | None, want_out: bool,
    needs: Sequence[bool], consts: Sequence[Tensor] = (), state: Tensor | None = None,
) -> tuple[Tensor | None, list[Tensor | None]]:
    """The chunk loop: the ``(N, n_out + n_state)`` outputs (when ``want_out``) and the gradients.

    ``grad_out`` ``(N, n_out)`` (or broadcastable to it) in ``cd``, or ``None`` for a forward
    only. ``needs``: three flags per stream (input, weight, bias). The gradients come back as a
    flat list (``dx_0, dW_0, db_0, dx_1, ...``) in ``cd``, ``None`` where not needed.
    ``state``: a blockwise head's ``(N, n_state)`` state from the forward (its backward then
    makes no forward sweep). While compiling, the loop runs inside one opaque custom op
    (:func:`_chunks_op`).
    """
    if torch.compiler.is_compiling():
        cls, structure, params = head if isinstance(head, tuple) else pack(head)
        # the outputs' width travels as an argument, so that it is in the graph (and in the
        # compile caches' keys): a cached graph of a head whose state changed width was reused
        res = torch.ops.stablelosses.linear_chunks(
            _registered(cls, structure), sum(_widths((cls, structure, params))), list(params), chunk, cd,
            list(xs), list(ws), list(bs), list(rows), list(consts), grad_out, want_out, list(needs), state,
        )
        return (res[0] if want_out else None), [g if need else None for g, need in zip(res[1:], needs)]
    if isinstance(head, tuple):
        head = _with_params(_registered(head[0], head[1]), head[2])
    if chunk == AUTO_CHUNK:  # the sizes are numbers here (eagerly, or inside the compiled op)
        chunk = BLOCK_ROWS if head.blockwise else default_chunk_size(sum(w.shape[0] for w in ws), cd)
    if head.blockwise:
        return _run_blocks_eager(head, xs[0], ws[0], bs[0], rows, chunk, cd, grad_out, want_out, needs,
                                 consts, state)
    return _run_chunks_eager(head, xs, ws, bs, rows, chunk, cd, grad_out, want_out, needs, consts)


def block_columns(rows: int, cd: torch.dtype) -> int:
    """Columns per vocabulary block of a blockwise head's chunk of ``rows`` rows: the block's
    logits fit in ``CHUNK_BYTES``."""
    return max(1, CHUNK_BYTES // (max(rows, 1) * (torch.finfo(cd).bits // 8)))


def _block_logits(
    xc: Tensor, w: Tensor, b: Tensor | None, blk: slice, cd: torch.dtype, buf: Tensor
) -> tuple[Tensor, Tensor]:
    """The block ``blk`` of the weight in ``cd`` and the logits ``xc W_blk^T + b_blk``, written
    into the front of ``buf`` (the chunk's one logits buffer, reused by every block of both
    sweeps: one allocation per chunk, not one per block)."""
    wb = w[blk].to(cd)
    u = buf[: xc.shape[0] * wb.shape[0]].view(xc.shape[0], wb.shape[0])
    if b is None:
        return wb, torch.mm(xc, wb.t(), out=u)
    return wb, torch.addmm(b[blk], xc, wb.t(), out=u)


def _run_blocks_eager(
    head: Head, x: Tensor, w: Tensor, b: Tensor | None, rows: Sequence[Tensor], chunk: int,
    cd: torch.dtype, grad_out: Tensor | None, want_out: bool, needs: Sequence[bool],
    consts: Sequence[Tensor], state: Tensor | None,
) -> tuple[Tensor | None, list[Tensor | None]]:
    """The chunk loop of a blockwise head: each chunk of rows in vocabulary blocks, a forward
    sweep (partials, combined into the outputs and the state) unless ``state`` is given, then a
    backward sweep when ``grad_out`` is. ``dx`` is summed over the blocks, ``dW``'s block over
    the chunks (the first chunk writes it)."""
    n_rows, vocab, dev = x.shape[0], w.shape[0], x.device
    n = max(1, min(chunk, n_rows))
    cols = block_columns(n, cd)
    blocks = [slice(v0, min(v0 + cols, vocab)) for v0 in range(0, vocab, cols)]
    bc = None if b is None else b.to(cd)
    go = None if grad_out is None else grad_out.expand(n_rows, head.n_out)
    shapes = ((x.shape, needs[0]), (w.shape, needs[1]), ((vocab,), needs[2] and b is not None))
    empty = [torch.empty(s, dtype=cd, device=dev) if need else None for s, need in shapes]
    dx, dw, db = empty
    outs: list[Tensor] = []
    with no_autocast(dev.type):
        for start in range(0, n_rows, n):
            sl = slice(start, start + n)
            xc = x[sl].to(cd)
            rc = (*(r[sl] for r in rows), *consts)
            st = None if state is None else state[sl]
            buf = torch.empty(xc.shape[0] * min(cols, vocab), dtype=cd, device=dev)
            if st is None:
                parts = [head.block_forward(_block_logits(xc, w, bc, blk, cd, buf)[1], rc, blk.start)
                         for blk in blocks]
                out, st = head.combine(parts, rc, vocab)
                if want_out:
                    outs.append(torch.cat([out, st], 1))
            if go is None:
                continue
            for j, blk in enumerate(blocks):
                wb, u = _block_logits(xc, w, bc, blk, cd, buf)
                g = head.block_backward(u, rc, blk.start, st, go[sl])
                del u
                if dx is not None:  # the first block writes the chunk's rows (no zero fill)
                    torch.mm(g, wb, out=dx[sl]) if j == 0 else dx[sl].addmm_(g, wb)
                if dw is not None:
                    torch.mm(g.t(), xc, out=dw[blk]) if start == 0 else dw[blk].addmm_(g.t(), xc)
                if db is not None:
                    torch.sum(g, 0, out=db[blk]) if start == 0 else db[blk].add_(g.sum(0))
    if n_rows == 0:
        for t in empty:
            if t is not None:
                t.zero_()
    out_all = None
    if want_out:
        width = head.n_out + head.n_state
        out_all = torch.cat(outs) if outs else torch.zeros((0, width), dtype=cd, device=dev)
    return out_all, [dx, dw, db]


def _run_chunks_eager(
    head: Head, xs: Sequence[Tensor], ws: Sequence[Tensor], bs: Sequence[Tensor | None],
    rows: Sequence[Tensor], chunk: int, cd: torch.dtype, grad_out: Tensor | None, want_out: bool,
    needs: Sequence[bool], consts: Sequence[Tensor] = (),
) -> tuple[Tensor | None, list[Tensor | None]]:
    n_rows, n_streams = xs[0].shape[0], len(xs)
    dev = xs[0].device
    bcs = [None if b is None else b.to(cd) for b in bs]
    go = None if grad_out is None else grad_out.expand(n_rows, head.n_out)
    grads: list[Tensor | None] = [None] * (3 * n_streams)
    for k in range(n_streams):
        if needs[3 * k]:  # each chunk writes its rows (no zero fill)
            grads[3 * k] = torch.empty((n_rows, xs[k].shape[1]), dtype=cd, device=dev)
    outs: list[Tensor] = []
    # The logits in cd, never in autocast's lower precision.
    with no_autocast(dev.type):
        for start in range(0, n_rows, chunk):
            sl = slice(start, start + chunk)
            xcs = [x[sl].to(cd) for x in xs]
            logits = tuple(logits_of(xc, w, b) for xc, w, b in zip(xcs, ws, bcs))
            rc = (*(r[sl] for r in rows), *consts)
            gs: tuple[Tensor | None, ...] = (None,) * n_streams
            if go is None:
                outs.append(head.forward(logits, rc))
            elif want_out:
                out, gs = head.forward_backward(logits, rc, go[sl])
                outs.append(out)
            else:
                gs = head.backward(logits, rc, go[sl])
            del logits
            for k in range(n_streams):
                _accumulate(grads, k, gs[k] if k < len(gs) else None, xcs[k], ws[k], bcs[k], sl, needs)
            del gs  # free this chunk's buffers before the next chunk's matmul
    for k in range(n_streams):  # no rows or no gradient from the head: zeros
        b = bs[k]
        shapes = (xs[k].shape, ws[k].shape, None if b is None else b.shape)
        for j in (1, 2):
            s = shapes[j]
            if needs[3 * k + j] and grads[3 * k + j] is None and s is not None:
                grads[3 * k + j] = torch.zeros(s, dtype=cd, device=dev)
    out_all = None
    if want_out:
        out_all = torch.cat(outs) if outs else torch.zeros((0, head.n_out), dtype=cd, device=dev)
    return out_all, grads


def _accumulate(
    grads: list[Tensor | None], k: int, g: Tensor | None, xc: Tensor, w: Tensor, bc: Tensor | None,
    sl: slice, needs: Sequence[bool],
) -> None:
    """Stream ``k``'s chunk gradient ``g`` into ``dx_k[sl]``, ``dW_k`` and ``db_k``."""
    i = 3 * k
    if needs[i]:
        gx = grads[i]
        assert gx is not None
        if g is None:
            gx[sl].zero_()
        else:
            _input_grad_into(g, w, gx[sl])
    if g is None:
        return
    if needs[i + 1]:  # the first chunk writes the accumulator (no zero fill of a (V, H) buffer)
        gw = grads[i + 1]
        grads[i + 1] = g.t() @ xc if gw is None else gw.addmm_(g.t(), xc)
    if needs[i + 2] and bc is not None:
        gb = grads[i + 2]
        grads[i + 2] = g.sum(0) if gb is None else gb.add_(g.sum(0))


# --- the compiled form: the loop as one custom op, the head as a registry key --------------------

_HEADS: list[Head] = []
_HEAD_KEYS: dict[Head, int] = {}


# A head under torch.compile: its class, its fields with each ``numeric`` one replaced by whether
# it is None (constants), and the values of the numeric ones (symbolic under dynamic=True).
Packed = tuple[type, tuple[Any, ...], tuple[float, ...]]


def pack(head: Head) -> Packed:
    """``head`` as (class, structure, numeric values): what a compiled graph can carry."""
    numeric = type(head).numeric
    structure = tuple(
        (getattr(head, f.name) is None) if f.name in numeric else getattr(head, f.name)
        for f in dataclasses.fields(head)  # type: ignore[arg-type]
    )
    params = tuple(0.0 if getattr(head, n) is None else getattr(head, n) for n in numeric)
    return type(head), structure, params


def _with_params(key: int, params: Sequence[float]) -> Head:
    """The registered template ``key`` with its numeric fields set to ``params``."""
    head = _HEADS[key]
    numeric = type(head).numeric
    return dataclasses.replace(  # type: ignore[type-var]
        head, **{n: None if getattr(head, n) is None else float(v) for n, v in zip(numeric, params)}
    )


@assume_constant_result
def _registered(cls: type, structure: tuple[Any, ...]) -> int:
    numeric = cls.numeric  # type: ignore[attr-defined]
    names = [f.name for f in dataclasses.fields(cls)]
    head = cls(*(((None if v else 0.0) if n in numeric else v) for n, v in zip(names, structure)))
    key = _HEAD_KEYS.get(head)
    if key is None:
        key = _HEAD_KEYS[head] = len(_HEADS)
        _HEADS.append(head)
    return key


_SCHEMA = (
    "(int head, int width, float[] params, int chunk, ScalarType cd, Tensor[] xs, Tensor[] ws, Tensor?[] bs, "
    "Tensor[] rows, Tensor[] consts, Tensor? grad_out, bool want_out, bool[] needs, Tensor? state) "
    "-> Tensor[]"
)


@torch.library.custom_op("stablelosses::linear_chunks", mutates_args=(), schema=_SCHEMA)
def _chunks_op(
    head: int, width: int, params: list[float], chunk: int, cd: torch.dtype, xs: list[Tensor],
    ws: list[Tensor], bs: list[Tensor | None], rows: list[Tensor], consts: list[Tensor],
    grad_out: Tensor | None, want_out: bool, needs: list[bool], state: Tensor | None,
) -> list[Tensor]:
    """The chunk loop as one op for ``torch.compile``: ``[out, dx_0, dW_0, db_0, dx_1, ...]`` (a
    fresh empty tensor for an output that is not wanted: the outputs of a custom op may not alias).
    ``width``: the outputs' columns, read by the fake kernel."""
    out, grads = run_chunks(
        _with_params(head, params), xs, ws, bs, rows, chunk, cd, grad_out, want_out, needs, consts, state
    )
    empty = xs[0].new_empty
    return [empty(0, dtype=cd) if v is None else v for v in (out, *grads)]


@_chunks_op.register_fake
def _chunks_op_fake(
    head: int, width: int, params: list[float], chunk: int, cd: torch.dtype, xs: list[Tensor],
    ws: list[Tensor], bs: list[Tensor | None], rows: list[Tensor], consts: list[Tensor],
    grad_out: Tensor | None, want_out: bool, needs: list[bool], state: Tensor | None,
) -> list[Tensor]:
    x0 = xs[0]
    res = [x0.new_empty((x0.shape[0], width) if want_out else (0,), dtype=cd)]
    for k, (x, w, b) in enumerate(zip(xs, ws, bs)):
        shapes = (x.shape, w.shape, (0,) if b is None else b.shape)
        res += [x0.new_empty(s if needs[3 * k + j] else (0,), dtype=cd) for j, s in enumerate(shapes)]
    return res


# --- the Functions -------------------------------------------------------------------------------


def _double_backward_error(fn: str) -> RuntimeError:
    return RuntimeError(
        f"{fn}: differentiating its gradient (double backward, a gradient penalty) is not "
        "supported here: the gradient is computed chunk by chunk and is not itself "
        "differentiable. Use the unfused loss on F.linear(...) for higher-order derivatives."
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


def _returned(
    grad: Tensor | None, scale: Tensor | None, like: Tensor | None, fn: str,
    anchors: tuple[Tensor | None, ...],
) -> Tensor | None:
    """The returned gradient ``grad * scale`` (``scale`` None: 1) in ``like``'s dtype; guarded
    against double backward where grad mode is on (``create_graph=True``, ``torch.func.grad``)."""
    if grad is None or like is None:
        return None
    if torch.is_grad_enabled():
        one = torch.ones((), dtype=grad.dtype, device=grad.device) if scale is None else scale
        return _ScaledGrad.apply(grad, one, fn, *anchors).to(like.dtype)
    return (grad if scale is None else grad * scale).to(like.dtype)


Dense = Callable[[tuple[Tensor, ...], tuple[Tensor, ...]], Tensor]


def whole_logits_needed() -> bool:
    """The engine cannot serve this call: a forward-AD level is open or a ``torch.func``
    transform runs. Its Functions have no tangent and no vmap rule, and a nested transform
    cannot differentiate their hand-written gradient; the callers then form the logits whole
    (the same values)."""
    return forward_ad_active() or functorch_transforms_active()


def stream_logits(x: Tensor, w: Tensor, b: Tensor | None, cd: torch.dtype) -> Tensor:
    """A stream's whole logits ``x @ w.T + b`` in the compute dtype ``cd``, differentiable."""
    return torch.nn.functional.linear(x.to(cd), w.to(cd), None if b is None else b.to(cd))


def grad_is_batched(grad: Tensor) -> bool:
    """``grad`` is batched by a vmap over the backward that receives it (gradcheck's batched
    grad, ``jacobian(vectorize=True)``, ``is_grads_batched=True``, ``torch.func.vmap`` of
    ``autograd.grad``), or a ``torch.func`` transform runs. Never while compiling (the
    wrapper checks are not traceable; compiled code has no dense form)."""
    return not torch.compiler.is_compiling() and under_transform(grad)


def _dense_grads(
    dense: Dense, st: Sequence[Tensor | None], rows: tuple[Tensor, ...], cd: torch.dtype, n_out: int,
    grad: Tensor, coef: Tensor | None, needs: Sequence[bool],
) -> list[Tensor | None]:
    """The gradients of ``Σ grad · out`` (``coef`` given: ``grad · Σ coef · out``) from the
    head's ``dense`` form (differentiable torch ops on the whole logits, the same values as the
    chunks) recomputed from the saved streams, as a graph where grad mode is on (a double
    backward may follow: ``create_graph=True``). Also for a batched ``grad`` (a vmap over the
    backward); the logits then exist whole."""
    xs, ws, bs = st[0::3], st[1::3], st[2::3]
    graph = torch.is_grad_enabled()
    with torch.enable_grad():
        us = tuple(stream_logits(x, w, b, cd) for x, w, b in zip(xs, ws, bs)
                   if x is not None and w is not None)
        out = dense(us, rows)[:, :n_out]
        # The vjp of out with grad_outputs ``grad`` (``coef · grad``), not the gradient of a sum
        # of out · grad: autograd.grad under vmap takes a batched grad_outputs, not a batched
        # output. ``grad`` itself, unmasked: the result is linear in it, and its derivative with
        # respect to ``grad`` is the Jacobian also where ``grad`` is 0 (torch.autograd.functional
        # .jvp differentiates a vjp at grad_outputs of zeros)
        go = grad if coef is None else coef * grad
        go = go.to(out.dtype).expand(out.shape)
        wanted = [t for t, need in zip(st, needs) if need and t is not None]
        found = iter(torch.autograd.grad(out, wanted, go, create_graph=graph, allow_unused=True))
    res: list[Tensor | None] = []
    for t, need in zip(st, needs):
        g = next(found) if need and t is not None else None
        res.append(None if g is None or t is None else g.to(t.dtype))
    return res


def _name(head: Head | Packed) -> str:
    if isinstance(head, tuple):
        return head[0].__name__
    return str(getattr(head, "fn", type(head).__name__))


def _widths(head: Head | Packed) -> tuple[int, int]:
    """``(n_out, n_state)`` of a head, or of a packed one (its registered template)."""
    h = _HEADS[_registered(head[0], head[1])] if isinstance(head, tuple) else head
    return h.n_out, h.n_state


def _needs(flags: Sequence[bool], bs: Sequence[Tensor | None]) -> list[bool]:
    out = list(flags)
    for k, b in enumerate(bs):
        out[3 * k + 2] = out[3 * k + 2] and b is not None
    return out


def _split(tensors: tuple[Any, ...], layout: tuple[int, int]) -> tuple[tuple[Any, ...], ...]:
    """The Functions' flat tensors as ``(streams, rows, consts)`` from ``layout = (S, n_consts)``."""
    s3, nc = 3 * layout[0], layout[1]
    return tensors[:s3], tensors[s3 : len(tensors) - nc], tensors[len(tensors) - nc :]


class _LinearChunks(torch.autograd.Function):
    """Per-row outputs; the backward recomputes each chunk's logits. Arguments: the head, the
    chunk, the compute dtype, ``(S, n_consts)``, then ``x_k, W_k, b_k`` per stream, the per-row
    tensors and the constants."""

    @staticmethod
    def forward(
        head: Head | Packed, chunk: int, cd: torch.dtype, layout: tuple[int, int], dense: Dense | None,
        *tensors: Any,
    ) -> tuple[Tensor, Tensor]:
        st, rows, consts = _split(tensors, layout)
        out, _ = run_chunks(head, st[0::3], st[1::3], st[2::3], rows, chunk, cd, None, True,
                            [False] * len(st), consts)
        assert out is not None
        # a blockwise head's state (its last columns) as a tensor of its own: saved for the
        # backward, so that an in-place edit of the outputs does not touch it
        n_out, n_state = _widths(head)
        if not n_state:
            return out, out.new_empty((out.shape[0], 0))
        return out[:, :n_out].clone(), out[:, n_out:].clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        head, chunk, cd, layout, dense, *tensors = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors, output[1])
        ctx.head, ctx.chunk, ctx.cd, ctx.layout, ctx.dense = head, chunk, cd, layout, dense

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, _: Any) -> Any:
        *saved, state = ctx.saved_tensors
        st, rows, consts = _split(tuple(saved), ctx.layout)
        needs = _needs(ctx.needs_input_grad[5 : 5 + len(st)], st[2::3])
        if grad is None or not any(needs):
            return (None,) * len(ctx.needs_input_grad)
        tail = (None,) * (len(rows) + len(consts))
        # grad mode on: a double backward may follow. A batched grad (a vmap over this backward:
        # gradcheck's batched grad, jacobian(vectorize=True), is_grads_batched) takes the dense
        # form too: the chunk loop writes into unbatched buffers (out=, in place), and per-row
        # outputs have no one scalar to scale a gradient computed once by.
        if ctx.dense is not None and (torch.is_grad_enabled() or grad_is_batched(grad)):
            n_out = _widths(ctx.head)[0]
            res = _dense_grads(ctx.dense, st, (*rows, *consts), ctx.cd, n_out, grad, None, needs)
            return (None,) * 5 + tuple(res) + tail
        with torch.no_grad():
            _, grads = run_chunks(ctx.head, st[0::3], st[1::3], st[2::3], rows, ctx.chunk, ctx.cd,
                                  grad.to(ctx.cd), False, needs, consts,
                                  state if state.shape[1] else None)
        fn, anchors = _name(ctx.head), (*st, grad)
        res = [_returned(g, None, like, fn, anchors) for g, like in zip(grads, st)]
        return (None,) * 5 + tuple(res) + tail


class _LinearChunksReduced(torch.autograd.Function):
    """``Σ coef · out`` with the gradients computed in the forward; outputs: the scalar, the
    per-row outputs (non-differentiable) and the gradients (non-differentiable, saved for the
    backward, which scales them by the incoming gradient)."""

    @staticmethod
    def forward(
        head: Head | Packed, chunk: int, cd: torch.dtype, layout: tuple[int, int], needs: tuple[bool, ...],
        coef: Tensor, dense: Dense | None, *tensors: Any,
    ) -> tuple[Tensor, ...]:
        st, rows, consts = _split(tensors, layout)
        coef = coef.to(cd)
        go = coef if any(needs) else None  # no gradient wanted: the forward alone
        out, grads = run_chunks(head, st[0::3], st[1::3], st[2::3], rows, chunk, cd, go, True, needs, consts)
        assert out is not None
        out = out[:, : _widths(head)[0]]
        # a zero weight drops its output (an inf output with weight 0 adds 0, not NaN)
        total = torch.where(coef == 0, 0.0, out * coef).sum()
        # a fresh empty tensor per gradient not wanted (one shared object confuses dynamo)
        return (total, out, *(out.new_empty(0) if g is None else g for g in grads))

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        head, _, cd, layout, needs, coef, dense, *tensors = inputs
        _, out, *grads = output
        ctx.mark_non_differentiable(out, *grads)
        ctx.set_materialize_grads(False)
        # the inputs are saved as anchors for the double-backward guard, and with the rows, the
        # constants and coef for the dense double backward (references, no copy)
        ctx.save_for_backward(*grads, *tensors, coef)
        ctx.fn, ctx.needs, ctx.n_grads, ctx.n_st = _name(head), needs, len(grads), 3 * layout[0]
        ctx.dense, ctx.cd, ctx.n_out = dense, cd, _widths(head)[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, *_: Any) -> Any:
        saved = ctx.saved_tensors
        grads, rest, coef = saved[: ctx.n_grads], saved[ctx.n_grads : -1], saved[-1]
        st = rest[: ctx.n_st]
        n_in = len(ctx.needs_input_grad)
        if grad is None:
            return (None,) * n_in
        if ctx.dense is not None and torch.is_grad_enabled():  # a double backward may follow
            res = _dense_grads(ctx.dense, st, tuple(rest[ctx.n_st :]), ctx.cd, ctx.n_out, grad,
                               coef.to(ctx.cd), ctx.needs)
        else:
            fn, anchors = ctx.fn, tuple(st)
            res = [
                _returned(g, grad, like, fn, anchors) if need else None
                for g, like, need in zip(grads, st, ctx.needs)
            ]
        return (None,) * 7 + tuple(res) + (None,) * (n_in - 7 - len(res))


def _flatten(
    fn: str, head: Head, streams: Sequence[tuple[Tensor, Tensor, Tensor | None]], rows: Sequence[Tensor],
    chunk_size: int | None, dtype: torch.dtype | None,
) -> tuple[list[Tensor | None], int, torch.dtype, int]:
    """The streams as a flat list, the rows per chunk, the compute dtype and ``N``."""
    if not streams:
        raise ValueError(f"{fn}: streams must hold at least one (input, weight, bias) stream")
    if head.blockwise and len(streams) != 1:
        raise ValueError(f"{fn}: a blockwise head takes one stream, got {len(streams)}")
    flat: list[Tensor | None] = []
    n = streams[0][0].shape[0]
    for k, (x, w, b) in enumerate(streams):
        if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.shape[0] != n:
            raise ValueError(
                f"{fn}: stream {k} must be input (N, H), weight (V, H) with N = {n}, got "
                f"{tuple(x.shape)} and {tuple(w.shape)}"
            )
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"{fn}: stream {k}'s bias must have shape ({w.shape[0]},), got {tuple(b.shape)}")
        flat += [x, w, b]
    for r in rows:
        if r.dim() == 0 or r.shape[0] != n:
            raise ValueError(f"{fn}: every row tensor's first dim must be N = {n}, got {tuple(r.shape)}")
    cd = compute_dtype(flat) if dtype is None else dtype
    if chunk_size is None:
        chunk = AUTO_CHUNK
    elif chunk_size < 1:
        raise ValueError(f"{fn}: chunk_size must be a positive int or None, got {chunk_size}")
    else:
        chunk = chunk_size
    return flat, chunk, cd, n


def linear_chunks(
    head: Head, streams: Sequence[tuple[Tensor, Tensor, Tensor | None]], rows: Sequence[Tensor], *,
    chunk_size: int | None = None, consts: Sequence[Tensor] = (), dtype: torch.dtype | None = None,
    dense: Dense | None = None,
) -> Tensor:
    """``(N, n_out)`` head outputs in the compute dtype, chunk by chunk.

    ``streams``: ``(input (N, H_k), weight (V_k, H_k), bias (V_k,) | None)`` per stream (stream 0
    the model, stream 1 e.g. a teacher). ``rows``: tensors whose first dim is ``N`` (labels,
    masks, per-row scalars), sliced per chunk and treated as constants (no gradient).
    ``consts``: tensors passed whole to every chunk after the rows (``rows`` of the head ends
    with them), e.g. per-class weights; constants too. ``dtype``: the compute dtype (``None``:
    float32, float64 when a stream tensor is float64). Differentiable with respect to every
    input, weight and bias that requires grad (first order); a stream with nothing requiring
    grad gets no backward work. The backward recomputes each chunk's logits; bf16/fp16 weights
    are never copied to float32 whole. ``dense``: the head's outputs as differentiable torch ops
    of the whole logits ``(logits per stream, rows + consts) -> (N, ≥ n_out)``; given, a backward
    run with grad mode on (``create_graph=True``) returns the gradients as a graph of it, so a
    double backward works (with the logits whole); not given, that raises.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass(frozen=True)
        ... class NegLogProb(Head):  # -log_softmax(u)[t]
        ...     def forward(self, logits, rows):
        ...         return -logits[0].log_softmax(1).gather(1, rows[0][:, None])
        ...     def backward(self, logits, rows, grad_out):
        ...         g = logits[0].softmax(1) * grad_out
        ...         return (g.scatter_add(1, rows[0][:, None], -grad_out),)
        >>> x, w = torch.randn(5, 3, requires_grad=True), torch.randn(7, 3)
        >>> t = torch.tensor([0, 6, 2, 2, 5])
        >>> out = linear_chunks(NegLogProb(), [(x, w, None)], [t], chunk_size=2)
        >>> out.shape
        torch.Size([5, 1])
        >>> ref = torch.nn.functional.cross_entropy(x @ w.T, t, reduction="none")
        >>> torch.allclose(out[:, 0], ref)
        True
        >>> out.sum().backward()
        >>> x.grad.shape
        torch.Size([5, 3])
    """
    flat, chunk, cd, _ = _flatten("linear_chunks", head, streams, rows, chunk_size, dtype)
    wants_grad = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in flat)
    if not wants_grad and not functorch_transforms_active():
        # nothing to differentiate: the forward loop alone, no Function (Dynamo traces a
        # gradient-free Function.apply by calling forward with its arguments shifted)
        out, _ = run_chunks(head, flat[0::3], flat[1::3], flat[2::3], rows, chunk, cd, None, True,  # type: ignore[arg-type]
                            [False] * len(flat), consts)
        assert out is not None
        return out[:, : head.n_out]
    # compiled: the head as constants and its numeric values (see Packed)
    compiling = torch.compiler.is_compiling()  # (compiled code has first order only)
    h, d = (pack(head), None) if compiling else (head, dense)
    return _LinearChunks.apply(h, chunk, cd, (len(streams), len(consts)), d, *flat, *rows, *consts)[0]


def linear_chunks_reduced(
    head: Head, streams: Sequence[tuple[Tensor, Tensor, Tensor | None]], rows: Sequence[Tensor],
    coef: Tensor, *, chunk_size: int | None = None, consts: Sequence[Tensor] = (),
    dtype: torch.dtype | None = None, dense: Dense | None = None,
) -> tuple[Tensor, Tensor]:
    """The fast path of a reduction known in the forward: ``(Σ coef · out, out)``.

    ``coef`` (broadcastable to ``(N, n_out)``, a constant) weighs the outputs; the gradients of
    the 0-d sum are computed in the forward, chunk by chunk with the outputs (one matmul pass
    over the logits fewer than :func:`linear_chunks` and a backward), and its backward scales
    them by the incoming gradient. ``out`` ``(N, n_out)`` is not differentiable (read counts and
    denominators off it). A zero ``coef`` entry drops its output, an infinite one included.
    ``consts``, ``dtype`` and ``dense`` as in :func:`linear_chunks`.
    """
    flat, chunk, cd, _ = _flatten("linear_chunks_reduced", head, streams, rows, chunk_size, dtype)
    grad_on = torch.is_grad_enabled()
    needs = tuple(_needs([grad_on and t is not None and t.requires_grad for t in flat], flat[2::3]))
    if not any(needs) and not functorch_transforms_active():  # the forward loop alone (see linear_chunks)
        out, _ = run_chunks(head, flat[0::3], flat[1::3], flat[2::3], rows, chunk, cd, None, True,  # type: ignore[arg-type]
                            list(needs), consts)
        assert out is not None
        out, c = out[:, : head.n_out], coef.detach().to(cd)
        return torch.where(c == 0, 0.0, out * c).sum(), out
    compiling = torch.compiler.is_compiling()
    h, d = (pack(head), None) if compiling else (head, dense)
    total, out, *_ = _LinearChunksReduced.apply(
        h, chunk, cd, (len(streams), len(consts)), needs, coef.detach(), d, *flat, *rows, *consts
    )
    return total, out


