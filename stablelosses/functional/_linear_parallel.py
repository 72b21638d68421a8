r"""Vocabulary-parallel ``linear_cross_entropy`` / ``linear_focal_loss`` over ``torch.distributed``:
the chunk engine (`_autograd/linear.py`) plus an N-sized combine.

Each rank holds the rows ``[v_0, v_0 + V_r)`` of the output layer's matrix (its vocabulary
shard, possibly empty), the same hidden states ``x`` and the same global class-index targets.

1. The engine runs the shard's statistics head (`ShardStats`): per row the shard's max ``m_r``
   (read before ``+inf → finfo.max``, so that a ``+inf`` row is known after the MAX),
   ``D_r = Σ_{j ≠ t} e^{l_j - m_r}`` (the target's term left out where the shard owns it), the
   target's logit where owned and, for label smoothing, ``A_r = Σ_{c ∈ U_r} w_c (m_r - l_c)``,
   ``K_r = |U_r|``, ``W_r = Σ_{c ∈ U_r} w_c``.
2. One all-reduce (MAX) gives the global max ``M``; one all-reduce (SUM) of the stacked N-sized
   statistics gives ``D = Σ_r e^{m_r - M} D_r``, the target's logit (and the number of owners),
   ``K``, ``W_U``, ``A = Σ_r A_r + W_r (M - m_r)`` (non-negative terms: no cancellation) and,
   with class weights, ``w_t`` (from the shard that owns the target, replicated or sharded
   weights alike).
3. The row core's formula on the combined row (``linear.row_terms``, as one process: the same
   ``w = M - l_t`` (`target_shift`: ``+inf`` at a target of probability 0 on a ``+inf`` row)
   and ``D``), so every rank computes the same loss from the same numbers.
4. The backward runs the engine's gradient head (`ShardGrad`) with the row scales: one more
   pass over the logits; the input gradient is all-reduced (SUM), the weight and bias
   gradients stay local.

Two all-reduces in the forward and one in the backward; no value is read on the host. The shard
layout (plain tensors with ``process_group=``) is checked once per group, shard size and
``vocab_start``: one all-gather of every rank's ``(vocab_start, rows)``, read on the host that
once; the default ``vocab_start`` is the rows of the ranks before (uneven and empty shards
work), and a layout that does not cover the vocabulary exactly once raises ``ValueError``.
A target outside the vocabulary gives a NaN loss on its row (one process: the gather raises).
Every rank must make the same call (same ``N``, reduction, arguments and ``requires_grad``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from stablelosses._autograd.linear import AUTO_CHUNK, _returned, run_chunks
from stablelosses._autograd.linear_index import (
    IndexHead,
    RowTerms,
    ShardGrad,
    ShardStats,
    bounded_max,
    row_scales,
    row_terms,
    target_shift,
)
from stablelosses._autograd.rows import SUM_SCALE
from stablelosses._utils import autocast_to_float32, cast, check_floating, check_tensor, promote_types
from stablelosses.functional._cross_entropy import _INDEX_DTYPES
from stablelosses.functional._linear_options import reduce_rows, resolve_options
from stablelosses.functional._torch_losses import scalar_type

_NEG_INF = -math.inf


def dtensor_class() -> Any:
    """``torch.distributed.tensor.DTensor``, or None where this torch has none."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch builds without it
        return None
    return DTensor


def is_dtensor(t: object) -> bool:
    """True for a DTensor (cheap for plain tensors: no import)."""
    if type(t) is Tensor or type(t) is torch.nn.Parameter or not isinstance(t, Tensor):
        return False
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


class _Combined(NamedTuple):
    """What the backward keeps of the forward: N-sized tensors only."""

    terms: RowTerms
    tl: Tensor  # the target's local column (0 where not owned)
    owned: Tensor  # (N,) the target is in this shard
    m_safe: Tensor  # (N,) the global max, 0 where -inf


def _combine(
    head: IndexHead, chunk: int, cd: torch.dtype, group: Any, x: Tensor, w: Tensor, b: Tensor | None,
    t: Tensor, v0: int, cw_local: Tensor | None,
) -> tuple[Tensor, _Combined]:
    """Steps 1-3 of the module doc: the per-row loss ``(N,)`` (the row weight in ``terms``)."""
    dist = torch.distributed
    kept = t != head.ignore_index
    tl = t - v0
    owned = kept & (tl >= 0) & (tl < w.shape[0])
    tl = torch.where(owned, tl, 0)
    consts = () if cw_local is None else (cw_local,)
    out, _ = run_chunks(ShardStats(head), [x], [w], [b], [tl, owned], chunk, cd, None, True, [False] * 3,
                        consts)
    assert out is not None
    # m_r and lt_r before +inf → finfo.max (+inf on a +inf row), the shifts from the bounded ones
    m_r, d_r, lt_r, smooth_r, k_r, wu_r = out.split(1, dim=1)
    big_m = m_r.clone()
    dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=group)
    m_safe = bounded_max(big_m)
    m_r = m_r.clamp(max=torch.finfo(cd).max)
    # e^{m_r - M}: 1 on the shards at the max, 0 on an all -inf (or empty) shard
    stats = [d_r * torch.exp(m_r - m_safe), lt_r, owned.to(cd).unsqueeze(1)]
    if cw_local is not None:  # w_t from its owner (replicated or sharded weights alike: one layout)
        wt_r = cw_local[tl] if cw_local.shape[0] > 0 else torch.zeros_like(lt_r.squeeze(1))
        stats.append(torch.where(owned, wt_r, 0.0).unsqueeze(1))
    eps = head.label_smoothing
    if eps > 0.0:
        # Σ_{c ∈ U_r} w_c (M - l_c) = A_r + W_r (M - m_r); W_r = 0 on a fully masked shard; A_r is
        # scaled by SUM_SCALE (local_rows), and so is the shift, exactly (no overflow of M - m_r)
        shift = m_safe * SUM_SCALE - torch.where(m_r == _NEG_INF, 0.0, m_r) * SUM_SCALE
        stats += [k_r, smooth_r + wu_r * shift, wu_r]
    summed = torch.cat(stats, 1)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    cols = summed.split(1, dim=1)
    d, lt, owners = cols[0], cols[1], cols[2]
    wt: Tensor | None = None
    if cw_local is not None:
        wt = cols[3]
    k = smooth = wu = None
    if eps > 0.0:
        k, smooth, wu = cols[-3], cols[-2], cols[-1]
    kcol = kept.unsqueeze(1)
    terms = row_terms(head, target_shift(lt, big_m), d, big_m, kcol, wt, smooth, k, wu)
    # a kept target that no shard (or several) holds: out of range, NaN (no host read to raise)
    loss = torch.where(kcol & (owners != 1), math.nan, terms.loss).squeeze(1)
    return loss, _Combined(terms, tl, owned, m_safe.squeeze(1))


class _ParallelRows(torch.autograd.Function):
    """The per-row loss and row weight of a vocabulary shard; the backward runs the gradient
    pass with the incoming per-row gradient (the combined N-sized rows of the forward are kept)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, head: IndexHead, chunk: int, cd: torch.dtype, group: Any, x: Tensor, w: Tensor,
        b: Tensor | None, t: Tensor, v0: int, cw_local: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        loss, comb = _combine(head, chunk, cd, group, x, w, b, t, v0, cw_local)
        ctx.save_for_backward(x, w, b, cw_local)
        ctx.comb, ctx.head, ctx.chunk, ctx.cd, ctx.group = comb, head, chunk, cd, group
        row_w = comb.terms.row_w.squeeze(1)
        ctx.mark_non_differentiable(row_w)
        return loss, row_w

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _: Any) -> Any:  # type: ignore[override]
        x, w, b, cw_local = ctx.saved_tensors
        needs = [ctx.needs_input_grad[4], ctx.needs_input_grad[5], b is not None and ctx.needs_input_grad[6]]
        nothing = (None,) * 10
        if not any(needs):
            return nothing
        comb: _Combined = ctx.comb
        a_over_s, beta, delta = row_scales(ctx.head, comb.terms, grad.to(ctx.cd).unsqueeze(1))
        coeffs = torch.cat([a_over_s, beta, torch.zeros_like(beta) if delta is None else delta], 1)
        consts = () if cw_local is None else (cw_local,)
        with torch.no_grad():
            _, (gx, gw, gb) = run_chunks(
                ShardGrad(ctx.head), [x], [w], [b], [comb.tl, comb.owned, comb.m_safe], ctx.chunk, ctx.cd,
                coeffs, False, needs, consts,
            )
            if gx is not None:
                torch.distributed.all_reduce(gx, op=torch.distributed.ReduceOp.SUM, group=ctx.group)
        fn, anchors = ctx.head.fn, (x, w, b, grad)
        return (None,) * 4 + (
            _returned(gx, None, x, fn, anchors), _returned(gw, None, w, fn, anchors),
            _returned(gb, None, b, fn, anchors),
        ) + (None,) * 3


# shard tensor -> {(group, rows, vocab_start): (v0, vocab)}: the layout checked once per shard
# tensor (one all-gather). Keyed by the tensor, not by this rank's row count alone: two heads on
# one group whose local row counts agree on some ranks and differ on others made those ranks skip
# the all-gather the others waited in (a hang). Every rank runs the same code, so every rank
# meets a new shard tensor at the same call; a Parameter is checked once, a fresh slice per call
# each call.
_LAYOUTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _layout(fn: str, group: Any, shard: Tensor, vocab_start: int | None) -> tuple[int, int]:
    """``(v0, vocab)`` of this rank's ``shard`` (its ``(V_r, H)`` rows), from every rank's
    ``(vocab_start, rows)``: one all-gather and one host read the first time per shard tensor,
    a dictionary look-up after."""
    dist = torch.distributed
    rows, device = shard.shape[0], shard.device
    key = (group if group is not None else dist.group.WORLD, rows, vocab_start)
    known_here = _LAYOUTS.get(shard)
    if known_here is None:
        known_here = _LAYOUTS[shard] = {}
    known = known_here.get(key)
    if known is not None:
        return known
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    mine = torch.tensor([-1 if vocab_start is None else vocab_start, rows], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    pairs = [(int(a), int(n)) for a, n in torch.stack(every).cpu().tolist()]
    given = [a >= 0 for a, _ in pairs]
    if any(given) and not all(given):
        raise ValueError(f"{fn}: vocab_start must be given on every rank or on none, got {pairs}")
    if not any(given):  # the default: the ranks' shards in rank order
        starts = [sum(n for _, n in pairs[:r]) for r in range(world)]
        pairs = [(s, n) for s, (_, n) in zip(starts, pairs)]
    vocab = sum(n for _, n in pairs)
    end = 0
    for s, n in sorted(p for p in pairs if p[1] > 0):
        if s != end:
            raise ValueError(
                f"{fn}: the vocabulary shards (vocab_start, rows) per rank {pairs} do not cover the "
                f"{vocab} classes [0, {vocab}) exactly once"
            )
        end = s + n
    known_here[key] = res = (pairs[rank][0], vocab)
    return res


def _local(fn: str, name: str, t: Any, shard_dim0: bool) -> Tensor:
    """A DTensor argument's local tensor (``Shard(0)`` when ``shard_dim0``, else ``Replicate``)."""
    from torch.distributed.tensor import Replicate, Shard

    want = Shard(0) if shard_dim0 else Replicate()
    if tuple(t.placements) != (want,):
        raise ValueError(
            f"{fn}: {name} as a DTensor must be placed {want} on a 1-D device mesh, got "
            f"{tuple(t.placements)}"
        )
    return t.to_local()


def linear_loss_parallel(
    fn: str, input: Any, weight: Any, target: Any, bias: Any, class_weight: Any, ignore_index: int,
    reduction: str, label_smoothing: float, z_loss: float, softcap: float | None, gamma: float | None,
    chunk: int, mask: Tensor | None, options: object, process_group: Any, vocab_start: int | None,
    normalizer: Tensor | float | None = None,
) -> Tensor:
    """The vocabulary-parallel loss: ``weight`` a ``Shard(0)`` DTensor, or the local shard with
    ``process_group`` (its first row ``vocab_start``, default: the rows of the ranks before)."""
    from stablelosses.functional._masked import check_mask

    dist = torch.distributed
    if not dist.is_available():
        raise RuntimeError(f"{fn}: process_group= needs torch.distributed, which this torch build lacks")
    cw_sharded = False
    if is_dtensor(weight):
        if process_group is not None or vocab_start is not None:
            raise ValueError(f"{fn}: a DTensor linear_weight carries its group and offset: "
                             "pass neither process_group= nor vocab_start=")
        mesh = weight.device_mesh
        if mesh.ndim != 1:
            raise ValueError(f"{fn}: linear_weight's device mesh must be 1-D, got {mesh.ndim}-D")
        group, world, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        vocab = weight.shape[0]
        w = _local(fn, "linear_weight", weight, True)
        per = -(-vocab // world)  # torch's Shard(0): ceil(V / world) rows, the last ones shorter
        v0 = min(rank * per, vocab)
        if w.shape[0] != min(per, vocab - v0):
            raise ValueError(f"{fn}: linear_weight's local shard has {w.shape[0]} rows, expected "
                             f"{min(per, vocab - v0)} (torch's even Shard(0) split)")
        b = None if bias is None else (_local(fn, "linear_bias", bias, True) if is_dtensor(bias) else bias)
        if b is not None and b.shape[0] == vocab and vocab != w.shape[0]:
            b = b[v0 : v0 + w.shape[0]]  # a replicated (plain) bias: this shard's entries
        if is_dtensor(class_weight):
            cw_sharded = class_weight.placements[0].is_shard()
            class_weight = _local(fn, "weight", class_weight, cw_sharded)
        if is_dtensor(input):
            input = _local(fn, "input", input, False)
        if is_dtensor(target):
            target = _local(fn, "target", target, False)
    else:
        group = process_group
        w = check_floating(fn, "linear_weight", weight)
        if w.dim() != 2:
            raise RuntimeError(
                f"{fn}: the local shard of linear_weight must be (V_r, H), got {list(w.shape)}"
            )
        if vocab_start is not None and (
            isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0
        ):
            raise TypeError(f"{fn}: vocab_start must be an int >= 0 or None, got {vocab_start!r}")
        v0, vocab = _layout(fn, group, weight, vocab_start)
        b = bias
        if class_weight is not None:
            cw_sharded = class_weight.shape[0] == w.shape[0] and class_weight.shape[0] != vocab
    x = check_floating(fn, "input", input)
    t = check_tensor(fn, "target", target)
    h = x.shape[-1]
    if w.shape[1] != h:
        raise RuntimeError(f"{fn}: linear_weight's shard must have H = input.shape[-1] = {h} columns, "
                           f"got {list(w.shape)}")
    if t.is_floating_point() or t.shape != x.shape[:-1]:
        raise NotImplementedError(
            f"{fn}: the vocabulary-parallel loss takes class-index targets of shape {list(x.shape[:-1])} "
            f"(probability targets and K-dimensional weights are not sharded), got {t.dtype} "
            f"{list(t.shape)}"
        )
    if t.dtype not in _INDEX_DTYPES:  # the one-process call's check (torch's)
        raise RuntimeError(f"{fn}: target must hold class indices (int64 or uint8), got {t.dtype} (torch: "
                           f"expected target dtype to be Long or Byte, but got {scalar_type(t.dtype)})")
    if b is not None:
        b = check_floating(fn, "linear_bias", b)
        if b.shape != (w.shape[0],):
            raise RuntimeError(f"{fn}: linear_bias must be this shard's ({w.shape[0]},) entries, "
                               f"got {list(b.shape)}")
    cw_local = None
    if class_weight is not None:
        cw = check_floating(fn, "weight", class_weight).detach()
        if cw_sharded:
            cw_local = cw
        elif cw.shape == (vocab,):
            cw_local = cw[v0 : v0 + w.shape[0]]
        else:
            raise RuntimeError(f"{fn}: weight must have shape ({vocab},) (replicated) or this shard's "
                               f"({w.shape[0]},), got {list(cw.shape)}")
    if class_weight is not None and class_weight.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(f"{fn}: a class weight that requires grad is not supported with a "
                                  "sharded vocabulary")
    tensors = (x, w) if b is None else (x, w, b)
    cd = torch.float64 if any(v.dtype == torch.float64 for v in tensors) else torch.float32
    chunk, cd = resolve_options(fn, options, chunk, t.numel(), h, w.shape[0], cd)
    chunk = AUTO_CHUNK if chunk < 0 else chunk
    head = IndexHead(fn, ignore_index, label_smoothing, z_loss, softcap, gamma, cw_local is not None)
    xr = x.reshape(t.numel(), h)
    tr = t.reshape(-1).long()
    if mask is not None:
        m = check_mask(fn, mask, t.shape, "the per-row loss", device=x.device).expand(t.shape).reshape(-1)
        xr = torch.where(m[:, None], xr, 0.0)
        tr = torch.where(m, tr, ignore_index)
    out_dtype = x.dtype
    for v in tensors[1:]:
        out_dtype = promote_types(out_dtype, v.dtype)
    if out_dtype in (torch.float16, torch.bfloat16) and autocast_to_float32(x):
        out_dtype = torch.float32  # torch's loss under autocast, as the one-process call
    cwl = None if cw_local is None else cw_local.to(cd)
    loss, row_w = _ParallelRows.apply(head, chunk, cd, group, xr, w, b, tr, v0, cwl)
    if reduction == "none":
        return cast(loss.reshape(t.shape), out_dtype)
    return cast(reduce_rows(loss.sum(), row_w, reduction, normalizer, mask is not None), out_dtype)
