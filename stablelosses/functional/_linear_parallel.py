r"""Vocabulary-parallel ``linear_cross_entropy`` / ``linear_focal_loss`` over ``torch.distributed``.

Each rank holds the rows ``[v_0, v_0 + V_r)`` of the output layer's matrix (its vocabulary
shard), the same hidden states ``x`` and the same global class-index targets. Per row, with
``l`` the (softcapped) logits of the rank's shard:

1. every rank computes, chunk by chunk, its shard's row max ``m_r``, ``R_r = Σ_{j ≠ argmax}
   e^{l_j - m_r}``, the target logit where it owns the target (0 elsewhere) and, for label
   smoothing, ``A_r = Σ_{c ∈ U_r} w_c (m_r - l_c)``, ``K_r = |U_r|``, ``W_r = Σ_{c ∈ U_r} w_c``;
2. one all-reduce (MAX) gives the global max ``M``; one all-reduce (SUM) of the stacked
   N-sized statistics gives ``R = Σ_{r: m_r = M} R_r + Σ_{r: m_r < M} e^{m_r - M} (1 + R_r)``
   plus the number of extra ranks at the max (each an exact 1), the target logit, ``K``,
   ``W_U`` and ``A = Σ_r A_r + W_r (M - m_r)`` (non-negative terms: no cancellation);
3. ``log p_t = (l_t - M) - log1p(R)`` and ``lse = M + log1p(R)`` as in the one-process loss
   (exact as ``p_t → 1``), so every rank computes the same loss from the same numbers;
4. the gradient with respect to the shard's logits, ``α p - β onehot(t) - δ``, is formed by a
   second pass over the chunks (the logits recomputed: one matmul more than one process);
   the input gradient is all-reduced (SUM), the weight and bias gradients stay local.

``'mean'``/``'sum'`` run step 4 in the forward (three all-reduces in all); ``'none'`` runs it
in the backward, with the incoming per-row gradient (two in the forward, one in the backward).
With ``process_group=`` one more all-reduce of one number gives the vocabulary's size.
Every rank must make the same call (same ``N``, reduction, arguments and ``requires_grad``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from stablelosses._autograd.linear import (
    LinearLossConfig,
    _input_grad,
    _scaled,
    logits_of,
)
from stablelosses._autograd.rows import focal_rows
from stablelosses._utils import cast, check_floating, check_tensor, no_autocast, promote_types

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


class _Shard(NamedTuple):
    """A rank's view: its rows ``[v0, v0 + rows)`` of the ``vocab`` classes, and its group."""

    group: Any
    v0: int
    vocab: int


def _capped(u: Tensor, cap: float | None, need_masked: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(l, tanh(u / c) or None, masked or None)`` from the logits buffer ``u`` (in place)."""
    masked = u == _NEG_INF if (cap is not None or need_masked) else None
    if cap is None:
        return u.clamp_(max=torch.finfo(u.dtype).max), None, masked
    assert masked is not None
    th = u.div_(cap).tanh_()
    return (th * cap).masked_fill_(masked, _NEG_INF), th, masked


class _Rows(NamedTuple):
    """Per-row numbers every rank shares after the combine (all ``(N,)``)."""

    m: Tensor  # global max M, 0 where the whole row is -inf
    rest: Tensor  # R
    log1p_rest: Tensor  # log1p(R)
    lpt: Tensor  # log p_t
    shift: Tensor  # l_t - M (-w: the target's shift)
    lse: Tensor  # M + log1p(R) (-inf on an all -inf row)
    valid: Tensor  # kept and not fully masked
    wt: Tensor | None  # class weight of the target (None without class weights)
    k: Tensor | None  # unmasked classes (label smoothing only)
    wu: Tensor | None  # their summed class weight (label smoothing with class weights)
    smooth: Tensor | None  # Σ_{c ∈ U} w_c (M - l_c)


def _local_target(t: Tensor, shard: _Shard, rows: int, ignore_index: int) -> tuple[Tensor, Tensor]:
    """``(index into this shard, owned)``: the target's local row where this rank holds it."""
    tl = t - shard.v0
    owned = (t != ignore_index) & (tl >= 0) & (tl < rows)
    return torch.where(owned, tl, 0), owned


def _combine(
    x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cw_local: Tensor | None, cw_full: Tensor | None,
    cfg: LinearLossConfig, shard: _Shard, cd: torch.dtype,
) -> _Rows:
    """Steps 1-3 of the module doc: the shared per-row numbers, in two all-reduces."""
    dist = torch.distributed
    eps = cfg.label_smoothing
    n = x.shape[0]
    tl, owned = _local_target(t, shard, w.shape[0], cfg.ignore_index)
    ms, rests, lts = [], [], []
    ks, as_, ws = [], [], []
    bc = None if b is None else b.to(cd)
    with no_autocast(x.device.type):
        for s0 in range(0, n, cfg.chunk):
            xc = x[s0 : s0 + cfg.chunk].to(cd)
            lg, _, masked = _capped(logits_of(xc, w, bc), cfg.softcap, eps > 0.0)
            m, idx = lg.max(dim=1, keepdim=True)
            m_safe = torch.where(m == _NEG_INF, 0.0, m)
            lts.append(lg.gather(1, tl[s0 : s0 + cfg.chunk, None]).squeeze(1))
            if eps > 0.0:
                assert masked is not None
                k_c = lg.shape[1] - masked.sum(1)
                diff = (m_safe - lg).masked_fill_(masked, 0.0)
                if cw_local is None:
                    as_.append(diff.sum(1))
                    ws.append(k_c.to(cd))
                else:
                    as_.append(diff @ cw_local)
                    ws.append(cw_local.sum() - masked.to(cd) @ cw_local)
                ks.append(k_c.to(cd))
                del diff
            e = lg.sub_(m_safe).exp_()
            e.scatter_(1, idx, 0.0)
            rests.append(e.sum(1))
            ms.append(m.squeeze(1))
            del e, lg
    m_r = torch.cat(ms) if ms else x.new_zeros(0, dtype=cd)
    rest_r = torch.cat(rests) if rests else x.new_zeros(0, dtype=cd)
    lt = torch.where(owned, torch.cat(lts), 0.0) if lts else x.new_zeros(0, dtype=cd)
    big_m = m_r.clone()
    dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=shard.group)
    all_masked = big_m == _NEG_INF
    m_safe = torch.where(all_masked, 0.0, big_m)
    at_max = (m_r == big_m) & ~all_masked
    # a shard below the max contributes e^{m_r - M} (1 + R_r); one at the max contributes R_r and
    # its 1 is counted (every rank at the max but one is an exact 1 of R)
    contrib = torch.where(at_max, rest_r, torch.exp(m_r - m_safe) * (1.0 + rest_r))
    stats = [contrib, at_max.to(cd), lt, owned.to(cd)]
    sharded_cw = cw_local is not None and cw_full is None
    if sharded_cw:
        assert cw_local is not None
        stats.append(torch.where(owned, cw_local[tl], 0.0))
    if eps > 0.0:
        k_r, a_r, w_r = torch.cat(ks), torch.cat(as_), torch.cat(ws)
        # Σ_{c ∈ U_r} w_c (M - l_c) = A_r + W_r (M - m_r); nothing from a fully masked shard
        gap = torch.where(k_r > 0, m_safe - torch.where(m_r == _NEG_INF, 0.0, m_r), 0.0)
        stats += [k_r, a_r + w_r * gap, w_r]
    summed = torch.stack(stats)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=shard.group)
    rest = summed[0] + (summed[1] - 1.0).clamp(min=0.0)
    lt_all, owners = summed[2], summed[3]
    kept = t != cfg.ignore_index
    bad = kept & (owners != 1)
    if bool(bad.any()):  # the same numbers on every rank: every rank raises
        i = int(bad.nonzero()[0, 0])
        raise IndexError(
            f"{cfg.fn}: target {int(t[i])} (row {i}) is out of range for {shard.vocab} classes "
            "(or the shards do not cover the vocabulary once)"
        )
    wt: Tensor | None = None
    if sharded_cw:
        wt = summed[4]
    elif cw_full is not None:
        wt = cw_full[torch.where(kept, t, 0)]
    k: Tensor | None = None
    wu: Tensor | None = None
    smooth: Tensor | None = None
    if eps > 0.0:
        k, smooth, wu = summed[-3].clamp(min=1.0), summed[-2], summed[-1]
    # the second half of rows.target_nll's formula, on the combined R = S - 1:
    # -log p_t = log1p(R) + w
    shift = lt_all - m_safe
    log1p_rest = rest.log1p()
    lpt = shift - log1p_rest
    return _Rows(m_safe, rest, log1p_rest, lpt, shift, big_m + log1p_rest, kept & ~all_masked, wt, k, wu,
                 smooth)


def _focal(r: _Rows, gamma: float) -> tuple[Tensor, Tensor]:
    """The row core's focal term (`rows.focal_rows`) of the combined rows, with
    ``1 − p_t = D / S`` and ``D = R − expm1(−w)`` (the other classes' terms)."""
    other = (r.rest - torch.expm1(r.shift)) / (1.0 + r.rest)
    return focal_rows(other, torch.exp(r.lpt), r.lpt.neg(), gamma)


def _row_loss(r: _Rows, cfg: LinearLossConfig) -> tuple[Tensor, Tensor]:
    """The per-row loss (0 on invalid rows) and row weight (the ``'mean'`` denominator's terms)."""
    eps, zl = cfg.label_smoothing, cfg.z_loss
    nlpt = r.lpt.neg() if r.wt is None else r.wt * r.lpt.neg()
    if cfg.gamma is None:
        if eps == 0.0:
            loss = nlpt
        else:
            assert r.k is not None and r.wu is not None and r.smooth is not None
            loss = eps * (r.smooth / r.k + (r.wu / r.k) * r.log1p_rest)
            if eps < 1.0:
                loss = loss + (1.0 - eps) * nlpt
    else:
        val = _focal(r, cfg.gamma)[0]
        loss = val if r.wt is None else r.wt * val
    if zl > 0.0:
        z_row = zl * r.lse.square()
        loss = loss + (z_row if r.wt is None else r.wt * z_row)
    loss = torch.where(r.valid, loss, 0.0)
    row_w = r.valid.to(loss.dtype) if r.wt is None else torch.where(r.valid, r.wt, 0.0)
    return loss, row_w


def _scales(r: _Rows, cfg: LinearLossConfig, s: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(α, β, s ε / K)`` per row for the logit gradient ``α p - β onehot(t) - δ``."""
    eps, zl = cfg.label_smoothing, cfg.z_loss
    s = torch.where(r.valid, s, 0.0)
    sw = s if r.wt is None else s * r.wt
    if cfg.gamma is None:
        beta = sw * (1.0 - eps)
        if eps == 0.0:
            alpha = beta
        else:
            assert r.k is not None and r.wu is not None
            alpha = s if r.wt is None else beta + s * (eps * r.wu / r.k)
    else:
        alpha = beta = sw * _focal(r, cfg.gamma)[1]
    if zl > 0.0:
        alpha = alpha + sw * (2.0 * zl) * r.lse
    alpha = torch.where(r.valid, alpha, 0.0)
    delta = None
    if eps > 0.0:
        assert r.k is not None
        delta = s * (eps / r.k)
    return alpha, beta, delta


def _grad_pass(
    x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cw_local: Tensor | None, cfg: LinearLossConfig,
    shard: _Shard, r: _Rows, s: Tensor, needs: tuple[bool, bool, bool], cd: torch.dtype,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Step 4: the gradients of ``Σ_i s_i ℓ_i``; the input's all-reduced over the group."""
    alpha, beta, delta = _scales(r, cfg, s)
    tl, owned = _local_target(t, shard, w.shape[0], cfg.ignore_index)
    beta_local = torch.where(owned, beta, 0.0)
    inv = alpha / (1.0 + r.rest)
    bc = None if b is None else b.to(cd)
    gxs: list[Tensor] = []
    gw = gb = None
    with no_autocast(x.device.type):
        for s0 in range(0, x.shape[0], cfg.chunk):
            sl = slice(s0, s0 + cfg.chunk)
            xc = x[sl].to(cd)
            lg, th, masked = _capped(logits_of(xc, w, bc), cfg.softcap, delta is not None)
            g = lg.sub_(r.m[sl, None]).exp_().mul_(inv[sl, None])
            if delta is not None:
                assert masked is not None
                if cw_local is None:
                    g.sub_(delta[sl, None])
                else:
                    g.addcmul_(delta[sl, None], cw_local, value=-1.0)
                g.masked_fill_(masked, 0.0)
            g.scatter_add_(1, tl[sl, None], beta_local[sl, None].neg())
            if th is not None:
                g.mul_(th.square_().neg_().add_(1.0))
            if needs[0]:
                gxs.append(_input_grad(g, w))
            if needs[1]:
                gw = g.t() @ xc if gw is None else gw.addmm_(g.t(), xc)
            if needs[2] and bc is not None:
                gb = g.sum(0) if gb is None else gb.add_(g.sum(0))
            del g, lg
    gx = None
    if needs[0]:
        gx = torch.cat(gxs) if gxs else torch.zeros(x.shape, dtype=cd, device=x.device)
        torch.distributed.all_reduce(gx, op=torch.distributed.ReduceOp.SUM, group=shard.group)
    if needs[1] and gw is None:
        gw = torch.zeros(w.shape, dtype=cd, device=w.device)
    if needs[2] and bc is not None and gb is None:
        gb = torch.zeros_like(bc)
    return gx, gw, gb


class _ParallelReduced(torch.autograd.Function):
    """``'mean'``/``'sum'``: the loss and its gradients in the forward, scaled in the backward."""

    @staticmethod
    def forward(
        x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cw_local: Tensor | None, cw_full: Tensor | None,
        cfg: LinearLossConfig, mean: bool, needs: tuple[bool, bool, bool], cd: torch.dtype, shard: _Shard,
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        r = _combine(x, w, b, t, cw_local, cw_full, cfg, shard, cd)
        loss, row_w = _row_loss(r, cfg)
        total = loss.sum()
        scale = torch.ones((), dtype=cd, device=x.device)
        if mean:
            count = row_w.sum()
            total = total / count  # NaN for no kept row, as torch; its gradient is 0
            scale = torch.where(count > 0, count.reciprocal(), 0.0)
        gx: Tensor | None = None
        gw: Tensor | None = None
        gb: Tensor | None = None
        if any(needs):
            gx, gw, gb = _grad_pass(x, w, b, t, cw_local, cfg, shard, r, scale.expand(x.shape[0]), needs, cd)
        return (
            total, None if gx is None else gx.to(x.dtype), None if gw is None else gw.to(w.dtype),
            None if gb is None or b is None else gb.to(b.dtype),
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        _, gx, gw, gb = output
        ctx.mark_non_differentiable(*(v for v in (gx, gw, gb) if v is not None))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(gx, gw, gb, *inputs[:3])
        ctx.fn = inputs[6].fn
        ctx.dtypes = tuple(None if v is None else v.dtype for v in inputs[:3])

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, *_: Any) -> Any:
        if grad is None:
            return (None,) * 11
        gx, gw, gb, *anchors = ctx.saved_tensors
        dx, dw, db = ctx.dtypes
        a = tuple(anchors)
        return (
            _scaled(gx, grad, dx, ctx.fn, a), _scaled(gw, grad, dw, ctx.fn, a),
            _scaled(gb, grad, db, ctx.fn, a), *(None,) * 8,
        )


class _ParallelRows(torch.autograd.Function):
    """``'none'``: the per-row losses; the backward runs the gradient pass with the row weights
    (the shared per-row numbers of the forward are kept: a few ``(N,)`` tensors)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, cw_local: Tensor | None,
        cfg: LinearLossConfig, cd: torch.dtype, shard: _Shard, rows_cw_full: Tensor | None,
    ) -> Tensor:
        r = _combine(x, w, b, t, cw_local, rows_cw_full, cfg, shard, cd)
        ctx.save_for_backward(x, w, b, t, cw_local)
        ctx.rows, ctx.cfg, ctx.cd, ctx.shard = r, cfg, cd, shard
        return _row_loss(r, cfg)[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        x, w, b, t, cw_local = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        with torch.no_grad():
            gx, gw, gb = _grad_pass(x, w, b, t, cw_local, ctx.cfg, ctx.shard, ctx.rows, grad.to(ctx.cd),
                                    needs, ctx.cd)
        one = torch.ones((), dtype=ctx.cd, device=x.device)
        fn, a = ctx.cfg.fn, (x, w, b, grad)
        return (
            _scaled(gx, one, x.dtype, fn, a), _scaled(gw, one, w.dtype, fn, a),
            None if b is None else _scaled(gb, one, b.dtype, fn, a), *(None,) * 6,
        )


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
) -> Tensor:
    """The vocabulary-parallel loss: ``weight`` a ``Shard(0)`` DTensor, or the local shard with
    ``process_group`` (its first row ``vocab_start``, default rank × local rows)."""
    from stablelosses.functional._linear import default_chunk_size, resolve_options
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
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if vocab_start is None:
            v0 = rank * w.shape[0]
        elif isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
            raise TypeError(f"{fn}: vocab_start must be an int >= 0 or None, got {vocab_start!r}")
        else:
            v0 = vocab_start
        sizes = torch.tensor([w.shape[0]], dtype=torch.int64)
        dist.all_reduce(sizes, group=group)  # the vocabulary's size, for the class weight and checks
        vocab = int(sizes.item())
        b = bias
        if class_weight is not None:
            cw_sharded = class_weight.shape[0] == w.shape[0] and class_weight.shape[0] != vocab
    del world
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
    if b is not None:
        b = check_floating(fn, "linear_bias", b)
        if b.shape != (w.shape[0],):
            raise RuntimeError(f"{fn}: linear_bias must be this shard's ({w.shape[0]},) entries, "
                               f"got {list(b.shape)}")
    cw_local = cw_full = None
    if class_weight is not None:
        cw = check_floating(fn, "weight", class_weight).detach()
        if cw_sharded:
            cw_local = cw
        elif cw.shape == (vocab,):
            cw_full, cw_local = cw, cw[v0 : v0 + w.shape[0]]
        else:
            raise RuntimeError(f"{fn}: weight must have shape ({vocab},) (replicated) or this shard's "
                               f"({w.shape[0]},), got {list(cw.shape)}")
    if class_weight is not None and class_weight.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(f"{fn}: a class weight that requires grad is not supported with a "
                                  "sharded vocabulary")
    tensors = (x, w) if b is None else (x, w, b)
    cd = torch.float64 if any(v.dtype == torch.float64 for v in tensors) else torch.float32
    chunk, cd = resolve_options(fn, options, chunk, t.numel(), h, w.shape[0], cd)
    chunk = default_chunk_size(w.shape[0], cd) if chunk < 0 else chunk
    cfg = LinearLossConfig(fn, ignore_index, label_smoothing, z_loss, softcap, gamma, chunk)
    xr = x.reshape(t.numel(), h)
    tr = t.reshape(-1).long()
    kept = None
    if mask is not None:
        m = check_mask(fn, mask, t.shape, "the per-row loss", device=x.device).expand(t.shape).reshape(-1)
        xr = torch.where(m[:, None], xr, 0.0)
        tr = torch.where(m, tr, ignore_index)
        kept = (tr != ignore_index).any() if reduction == "mean" else None
    shard = _Shard(group, v0, vocab)
    out_dtype = x.dtype
    for v in tensors[1:]:
        out_dtype = promote_types(out_dtype, v.dtype)
    if reduction == "none":
        rows = _ParallelRows.apply(xr, w, b, tr, cw_local, cfg, cd, shard, cw_full)
        return cast(rows.reshape(t.shape), out_dtype)
    grad_on = torch.is_grad_enabled()
    needs = (grad_on and x.requires_grad, grad_on and w.requires_grad,
             grad_on and b is not None and b.requires_grad)
    mean = reduction == "mean"
    loss = _ParallelReduced.apply(xr, w, b, tr, cw_local, cw_full, cfg, mean, needs, cd, shard)[0]
    if kept is not None:
        loss = torch.where(kept, loss, 0.0)
    return cast(loss, out_dtype)
