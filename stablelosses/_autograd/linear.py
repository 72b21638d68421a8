r"""The one chunk engine of the fused linear losses: the ``(N, V)`` logits never exist.

A fused linear loss is a *head* on this engine. The engine owns the chunk loop: for each chunk of
``n`` rows and each *stream* ``k`` (stream 0 the model, stream 1 e.g. a teacher) it computes the
logits ``u_k = x_k W_k^T + b_k`` ``(n, V_k)`` in the compute dtype (float32; float64 when any
stream tensor is float64), hands them to the head with the chunk's slices of the per-row tensors
(labels, masks, per-row scalars), and multiplies the head's logit gradients ``g_k`` into
``dx_k = g_k W_k``, ``dW_k = Σ_chunks g_k^T x_k`` and ``db_k = Σ_rows g_k``. The head owns the
math of one chunk (:class:`Head`): ``forward`` gives the ``(n, n_out)`` per-row outputs,
``backward`` the logit gradients of ``Σ out · grad_out``.

Only ``n × Σ V_k`` logits exist at once. A weight narrower than the compute dtype (bf16/fp16) is
converted one vocabulary block of ``W_BLOCK_BYTES`` at a time, never whole; its gradient is
accumulated across chunks in a ``(V, H)`` accumulator in the compute dtype. Eagerly the loop is a
Python loop; while compiling it runs inside the custom op ``stablelosses::linear_chunks`` (the
head passed as a registry key), so the compiled graph does not depend on ``N``.

Two Functions: :func:`linear_chunks` returns the per-row outputs and its backward recomputes each
chunk's logits, where ``grad_out`` is known; :func:`linear_chunks_reduced` (the fast path of a
``'mean'``/``'sum'``) is given the output weights ``coef`` in the forward, computes the gradients
there (one pass over the logits instead of two) and its backward scales them by the incoming
scalar. Neither is differentiable twice: the gradient they return raises on a second backward
instead of giving a wrong second derivative.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from stablelosses._utils import no_autocast

# Logits of one chunk (all streams): at most this many bytes (64 MiB) in the compute dtype.
CHUNK_BYTES = 64 * 2**20

# Bytes of one vocabulary block of the weight converted to the compute dtype (16 MiB): a weight
# narrower than the compute dtype (bf16/fp16 with float32 compute) is never converted whole.
W_BLOCK_BYTES = 16 * 2**20


class Head:
    """Per-chunk math of one fused linear loss.

    Subclasses are frozen dataclasses (hashable, constant under ``torch.compile``): the engine
    passes the head itself through ``autograd.Function`` and, while compiling, a registry key to
    its custom op. ``n_out``: the number of per-row outputs.
    """

    n_out: int = 1

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


Stream = tuple[Tensor, Tensor, "Tensor | None"]


def default_chunk_size(vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk for ``chunk_size=None``: the chunk's logits fit in ``CHUNK_BYTES``.

    The largest power of two that fits (at least 1 row); it depends on the vocabulary (summed
    over the streams) and the compute dtype only, so any problem whose logits exceed 64 MiB is
    split.
    """
    rows = max(1, CHUNK_BYTES // (max(vocab, 1) * (torch.finfo(dtype).bits // 8)))
    return 1 << (rows.bit_length() - 1)


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
    head: Head, xs: Sequence[Tensor], ws: Sequence[Tensor], bs: Sequence[Tensor | None],
    rows: Sequence[Tensor], chunk: int, cd: torch.dtype, grad_out: Tensor | None, want_out: bool,
    needs: Sequence[bool],
) -> tuple[Tensor | None, list[Tensor | None]]:
    """The chunk loop: the ``(N, n_out)`` outputs (when ``want_out``) and the gradients.

    ``grad_out`` ``(N, n_out)`` (or broadcastable to it) in ``cd``, or ``None`` for a forward
    only. ``needs``: three flags per stream (input, weight, bias). The gradients come back as a
    flat list (``dx_0, dW_0, db_0, dx_1, ...``) in ``cd``, ``None`` where not needed. While
    compiling, the loop runs inside one opaque custom op (:func:`_chunks_op`).
    """
    if torch.compiler.is_compiling():
        res = torch.ops.stablelosses.linear_chunks(
            head_key(head), chunk, cd, list(xs), list(ws), list(bs), list(rows), grad_out, want_out,
            list(needs),
        )
        return (res[0] if want_out else None), [g if need else None for g, need in zip(res[1:], needs)]
    return _run_chunks_eager(head, xs, ws, bs, rows, chunk, cd, grad_out, want_out, needs)


def _run_chunks_eager(
    head: Head, xs: Sequence[Tensor], ws: Sequence[Tensor], bs: Sequence[Tensor | None],
    rows: Sequence[Tensor], chunk: int, cd: torch.dtype, grad_out: Tensor | None, want_out: bool,
    needs: Sequence[bool],
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
            rc = tuple(r[sl] for r in rows)
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


@torch.compiler.assume_constant_result
def head_key(head: Head) -> int:
    """The registry key of ``head`` (equal heads share one): a constant of the compiled graph."""
    key = _HEAD_KEYS.get(head)
    if key is None:
        key = _HEAD_KEYS[head] = len(_HEADS)
        _HEADS.append(head)
    return key


_SCHEMA = (
    "(int head, int chunk, ScalarType cd, Tensor[] xs, Tensor[] ws, Tensor?[] bs, Tensor[] rows, "
    "Tensor? grad_out, bool want_out, bool[] needs) -> Tensor[]"
)


@torch.library.custom_op("stablelosses::linear_chunks", mutates_args=(), schema=_SCHEMA)
def _chunks_op(
    head: int, chunk: int, cd: torch.dtype, xs: list[Tensor], ws: list[Tensor], bs: list[Tensor | None],
    rows: list[Tensor], grad_out: Tensor | None, want_out: bool, needs: list[bool],
) -> list[Tensor]:
    """The chunk loop as one op for ``torch.compile``: ``[out, dx_0, dW_0, db_0, dx_1, ...]`` (a
    fresh empty tensor for an output that is not wanted: the outputs of a custom op may not alias)."""
    out, grads = _run_chunks_eager(_HEADS[head], xs, ws, bs, rows, chunk, cd, grad_out, want_out, needs)
    empty = xs[0].new_empty
    return [empty(0, dtype=cd) if v is None else v for v in (out, *grads)]


@_chunks_op.register_fake
def _chunks_op_fake(
    head: int, chunk: int, cd: torch.dtype, xs: list[Tensor], ws: list[Tensor], bs: list[Tensor | None],
    rows: list[Tensor], grad_out: Tensor | None, want_out: bool, needs: list[bool],
) -> list[Tensor]:
    x0 = xs[0]
    res = [x0.new_empty((x0.shape[0], _HEADS[head].n_out) if want_out else (0,), dtype=cd)]
    for k, (x, w, b) in enumerate(zip(xs, ws, bs)):
        shapes = (x.shape, w.shape, (0,) if b is None else b.shape)
        res += [x0.new_empty(s if needs[3 * k + j] else (0,), dtype=cd) for j, s in enumerate(shapes)]
    return res


# --- the Functions -------------------------------------------------------------------------------


def _double_backward_error(fn: str) -> RuntimeError:
    return RuntimeError(
        f"{fn}: differentiating its gradient (double backward, torch.func.hessian, a gradient "
        "penalty) is not supported: the gradient is computed chunk by chunk and is not itself "
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


def _name(head: Head) -> str:
    return str(getattr(head, "fn", type(head).__name__))


def _needs(flags: Sequence[bool], bs: Sequence[Tensor | None]) -> list[bool]:
    out = list(flags)
    for k, b in enumerate(bs):
        out[3 * k + 2] = out[3 * k + 2] and b is not None
    return out


class _LinearChunks(torch.autograd.Function):
    """Per-row outputs; the backward recomputes each chunk's logits. Arguments: the head, the
    chunk, the compute dtype, the number of streams ``S``, then ``x_k, W_k, b_k`` per stream and
    the per-row tensors."""

    @staticmethod
    def forward(head: Head, chunk: int, cd: torch.dtype, n_streams: int, *tensors: Any) -> Tensor:
        st, rows = tensors[: 3 * n_streams], tensors[3 * n_streams :]
        out, _ = run_chunks(head, st[0::3], st[1::3], st[2::3], rows, chunk, cd, None, True,
                            [False] * (3 * n_streams))
        assert out is not None
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        head, chunk, cd, n_streams, *tensors = inputs
        ctx.save_for_backward(*tensors)
        ctx.head, ctx.chunk, ctx.cd, ctx.n_streams = head, chunk, cd, n_streams

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        tensors = ctx.saved_tensors
        s3 = 3 * ctx.n_streams
        st, rows = tensors[:s3], tensors[s3:]
        needs = _needs(ctx.needs_input_grad[4 : 4 + s3], st[2::3])
        nothing = (None,) * (4 + len(tensors))
        if not any(needs):
            return nothing
        with torch.no_grad():
            _, grads = run_chunks(ctx.head, st[0::3], st[1::3], st[2::3], rows, ctx.chunk, ctx.cd,
                                  grad.to(ctx.cd), False, needs)
        fn, anchors = _name(ctx.head), (*st, grad)
        res = [_returned(g, None, like, fn, anchors) for g, like in zip(grads, st)]
        return (None,) * 4 + tuple(res) + (None,) * len(rows)


class _LinearChunksReduced(torch.autograd.Function):
    """``Σ coef · out`` with the gradients computed in the forward; outputs: the scalar, the
    per-row outputs (non-differentiable) and the gradients (non-differentiable, saved for the
    backward, which scales them by the incoming gradient)."""

    @staticmethod
    def forward(
        head: Head, chunk: int, cd: torch.dtype, n_streams: int, needs: tuple[bool, ...], coef: Tensor,
        *tensors: Any,
    ) -> tuple[Tensor, ...]:
        st, rows = tensors[: 3 * n_streams], tensors[3 * n_streams :]
        coef = coef.to(cd)
        go = coef if any(needs) else None  # no gradient wanted: the forward alone
        out, grads = run_chunks(head, st[0::3], st[1::3], st[2::3], rows, chunk, cd, go, True, needs)
        assert out is not None
        # a zero weight drops its output (an inf output with weight 0 adds 0, not NaN)
        total = torch.where(coef == 0, 0.0, out * coef).sum()
        empty = out.new_empty(0)
        return (total, out, *(empty if g is None else g for g in grads))

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        head, _, cd, n_streams, needs, _, *tensors = inputs
        _, out, *grads = output
        ctx.mark_non_differentiable(out, *grads)
        ctx.set_materialize_grads(False)
        # the inputs are saved as anchors for the double-backward guard (references, no copy)
        ctx.save_for_backward(*grads, *tensors[: 3 * n_streams])
        ctx.head, ctx.needs, ctx.n_grads = head, needs, len(grads)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, *_: Any) -> Any:
        saved = ctx.saved_tensors
        grads, st = saved[: ctx.n_grads], saved[ctx.n_grads :]
        n_in = len(ctx.needs_input_grad)
        if grad is None:
            return (None,) * n_in
        fn, anchors = _name(ctx.head), tuple(st)
        res = [
            _returned(g, grad, like, fn, anchors) if need else None
            for g, like, need in zip(grads, st, ctx.needs)
        ]
        return (None,) * 6 + tuple(res) + (None,) * (n_in - 6 - len(res))


def _flatten(
    fn: str, streams: Sequence[tuple[Tensor, Tensor, Tensor | None]], rows: Sequence[Tensor],
    chunk_size: int | None,
) -> tuple[list[Tensor | None], int, torch.dtype, int]:
    """The streams as a flat list, the rows per chunk, the compute dtype and ``N``."""
    if not streams:
        raise ValueError(f"{fn}: streams must hold at least one (input, weight, bias) stream")
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
    cd = compute_dtype(flat)
    if chunk_size is None:
        chunk = default_chunk_size(sum(w.shape[0] for _, w, _ in streams), cd)
    elif chunk_size < 1:
        raise ValueError(f"{fn}: chunk_size must be a positive int or None, got {chunk_size}")
    else:
        chunk = chunk_size
    return flat, chunk, cd, n


def linear_chunks(
    head: Head, streams: Sequence[tuple[Tensor, Tensor, Tensor | None]], rows: Sequence[Tensor], *,
    chunk_size: int | None = None,
) -> Tensor:
    """``(N, n_out)`` head outputs in the compute dtype, chunk by chunk.

    ``streams``: ``(input (N, H_k), weight (V_k, H_k), bias (V_k,) | None)`` per stream (stream 0
    the model, stream 1 e.g. a teacher). ``rows``: tensors whose first dim is ``N`` (labels,
    masks, per-row scalars), sliced per chunk and treated as constants (no gradient).
    Differentiable with respect to every input, weight and bias that requires grad (first
    order); a stream with nothing requiring grad gets no backward work. The backward recomputes
    each chunk's logits; bf16/fp16 weights are never copied to float32 whole.
    """
    flat, chunk, cd, _ = _flatten("linear_chunks", streams, rows, chunk_size)
    return _LinearChunks.apply(head, chunk, cd, len(streams), *flat, *rows)


def linear_chunks_reduced(
    head: Head, streams: Sequence[tuple[Tensor, Tensor, Tensor | None]], rows: Sequence[Tensor],
    coef: Tensor, *, chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The fast path of a reduction known in the forward: ``(Σ coef · out, out)``.

    ``coef`` (broadcastable to ``(N, n_out)``, a constant) weighs the outputs; the gradients of
    the 0-d sum are computed in the forward, chunk by chunk with the outputs (one matmul pass
    over the logits fewer than :func:`linear_chunks` and a backward), and its backward scales
    them by the incoming gradient. ``out`` ``(N, n_out)`` is not differentiable (read counts and
    denominators off it). A zero ``coef`` entry drops its output, an infinite one included.
    """
    flat, chunk, cd, _ = _flatten("linear_chunks_reduced", streams, rows, chunk_size)
    grad_on = torch.is_grad_enabled()
    needs = tuple(_needs([grad_on and t is not None and t.requires_grad for t in flat], flat[2::3]))
    total, out, *_ = _LinearChunksReduced.apply(
        head, chunk, cd, len(streams), needs, coef.detach(), *flat, *rows
    )
    return total, out


# --- legacy: the CE/focal Functions of the previous chunk loop (removed once CE and focal are
# heads on the engine above) ----------------------------------------------------------------------

from typing import NamedTuple  # noqa: E402

from stablelosses._autograd.rows import focal_rows, target_nll  # noqa: E402

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


def _old_run_chunks(
    x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cw: Tensor | None, cfg: LinearLossConfig,
    needs: tuple[bool, bool, bool], row_scale: Tensor | None, cd: torch.dtype,
) -> tuple[Tensor, Tensor, Grads]:
    """Loop over row chunks: per-row loss ``(N,)``, row weight ``(N,)`` and the summed gradients.

    ``row_scale`` ``(N,)`` weighs each row's gradient (``None``: weight 1 when any of ``needs``).
    Gradients are accumulated in the compute dtype ``cd`` (the weight's in a ``(V, H)``
    accumulator in ``cd``, which is the returned gradient itself when ``w`` is in ``cd``).
    While compiling, the loop runs inside one opaque custom op (:func:`_old_chunks_op`): the graph
    does not depend on ``N`` and the loop is not unrolled.
    """
    if torch.compiler.is_compiling():
        loss, row_w, gx, gw, gb = torch.ops.stablelosses.linear_loss_chunks(
            x, w, b, t, cw, row_scale, cfg.ignore_index, cfg.label_smoothing, cfg.z_loss, cfg.softcap,
            cfg.gamma, cfg.chunk, needs[0], needs[1], needs[2] and b is not None, cd,
        )
        return loss, row_w, Grads(gx if needs[0] else None, gw if needs[1] else None,
                                  gb if needs[2] and b is not None else None)
    return _old_run_chunks_eager(x, w, b, t, cw, cfg, needs, row_scale, cd)


def _old_run_chunks_eager(
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


_old_SCHEMA = (
    "(Tensor x, Tensor w, Tensor? b, Tensor t, Tensor? cw, Tensor? row_scale, int ignore_index, "
    "float label_smoothing, float z_loss, float? softcap, float? gamma, int chunk, bool need_x, "
    "bool need_w, bool need_b, ScalarType cd) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)


@torch.library.custom_op("stablelosses::linear_loss_chunks", mutates_args=(), schema=_old_SCHEMA)
def _old_chunks_op(
    x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cw: Tensor | None, row_scale: Tensor | None,
    ignore_index: int, label_smoothing: float, z_loss: float, softcap: float | None, gamma: float | None,
    chunk: int, need_x: bool, need_w: bool, need_b: bool, cd: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The chunk loop as one op for ``torch.compile``: loss, row weight and the three gradients
    (an empty tensor for a gradient that is not wanted)."""
    cfg = LinearLossConfig("linear_loss", ignore_index, label_smoothing, z_loss, softcap, gamma, chunk)
    loss, row_w, g = _old_run_chunks_eager(x, w, b, t, cw, cfg, (need_x, need_w, need_b), row_scale, cd)
    # a fresh empty tensor for each missing gradient: the outputs of a custom op may not alias
    gx, gw, gb = (x.new_empty(0, dtype=cd) if v is None else v for v in g)
    return loss, row_w, gx, gw, gb


@_old_chunks_op.register_fake
def _old_chunks_op_fake(
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
        loss, row_w, g = _old_run_chunks(x, w, b, t, cw, cfg, needs, None, cd)
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
        loss, _, _ = _old_run_chunks(x, w, b, t, cw, cfg, (False, False, False), None, cd)
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
            _, _, g = _old_run_chunks(x, w, b, t, cw, ctx.cfg, needs, grad.to(ctx.cd), ctx.cd)
        one = torch.ones((), dtype=ctx.cd, device=x.device)
        fn, a = ctx.cfg.fn, (x, w, b, grad)
        return (
            _scaled(g.input, one, x.dtype, fn, a), _scaled(g.weight, one, w.dtype, fn, a),
            None if b is None else _scaled(g.bias, one, b.dtype, fn, a), None, None, None, None,
        )
