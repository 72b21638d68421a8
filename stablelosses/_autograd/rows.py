r"""The row core: one row of logits and every quantity the softmax family and the
classification losses read off it.

`softmax`, `log_softmax`, `logsumexp`, `entropy`, `cross_entropy` (every target kind),
`focal_loss`, `info_nce_loss` (through `cross_entropy`) and the per-chunk step of the fused
linear losses all take their rows from here, so one row rounds one way. What it owns:

* **Hazard rows, read off the row max** ``m`` (an N-sized reduction, never a full pass):
  ``m == -inf``: every logit is ``-inf`` (fully masked); ``m == +inf``: the limit, uniform over
  the ``+inf`` entries; NaN: a NaN row, NaN out; any finite ``m`` (``finfo.min`` rows included):
  an ordinary row with torch's numbers. `bounded` makes the infinities of the hazard rows finite
  in one pass so that torch's kernels run on every row.
* **Softmax of a row** (`softmax_limits`). **Log-softmax of a row**: `fast_log_softmax`
  (torch's kernel on the bounded row) and `exact_log_softmax` (torch's kernel on the exact
  shift, ``-inf`` exactly at probability 0).
* **The class-index row** (`index_row`): the softmax the backward needs, ``rest = Σ_{j≠t} p_j``
  and the target's ``−log p_t`` with its exact tail, from torch's passes (`target_nll` is the one
  N-sized formula, shared with the linear losses' chunk step).
* **The focal term** (`focal_rows` first order, `focal_terms` differentiable: the same formula)
  and **the exact tail** of ``log p_t`` (`accurate_log_pt`).
* **The smoothing sum** (`smoothing`, `smoothing_sum`): ``ε/K`` over the unmasked classes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from stablelosses._compat import functorch_transforms_active, under_transform
from stablelosses._utils import inplace_ok, no_autocast

_INF = float("inf")


# --- hazard rows -------------------------------------------------------------------------------

# Each float type's same-width signed integer type, and the bits of its -inf as that integer.
_BITS = {
    dt: (it, int(torch.tensor(-_INF, dtype=dt).view(it)))
    for dt, it in ((torch.float64, torch.int64), (torch.float32, torch.int32),
                   (torch.float16, torch.int16), (torch.bfloat16, torch.int16))
}


def bounded(x: Tensor, m: Tensor, drop: Tensor | None = None) -> Tensor:
    """``x`` with its infinities made finite on the slices where they break torch's kernels,
    from the slice max ``m`` (keepdim): the identity on every slice with a finite max
    (``finfo.min`` slices included); ``+inf → finfo.max`` on ``+inf`` slices (the ``+inf``
    entries then sit far above every other entry but ``finfo.max`` itself, so torch's kernels
    put uniform mass on them); ``finfo.min`` everywhere on all-``-inf`` slices (finite, fixed
    by the caller from ``m``). NaN stays NaN. ``drop`` (bool, ``m``'s shape, optional): slices
    whose value is dropped become a finite constant (``-0.0``; NaN entries included), so that
    a gradient of 0 there stays 0.

    One pass with one per-slice operand: a ``minimum`` on the bits read as signed integers.
    There positive floats keep their order and negative ones reverse it, so ``-inf`` lies
    above every finite negative number. The bound ``c`` is the max's bits, raised to
    ``-inf``'s where the max is negative (no entry moves), and one lower where the max is
    ``±inf`` (``±inf → ±finfo.max``; on an all-``-inf`` slice every entry is the max). A
    ``-0.0`` max counts as ``+0.0``, so that a ``+0.0`` entry beside it stays.
    (torch's CPU clamp with two per-slice bounds does not vectorize its two broadcast
    operands: about 2x slower than this ``minimum`` at 8192x1000.)
    """
    if functorch_transforms_active() or torch.compiler.is_compiling():
        # The same values as a clamp: one constant upper bound (finfo.max moves only +inf
        # entries) and one per-slice lower bound (-finfo.max on all-(-inf) slices, else -inf).
        # Under torch.func: torch < 2.7 has no vmap rule for a dtype view (the slower CPU
        # kernel matters less than working at all there). Compiled: inductor's CPU code
        # bit-casts through memory, one scalar loop per vector each way (softmax 8192x1000
        # fwd+bwd 2.42-2.51x → 1.10-1.16x compiled torch's; benchmarks/spellings.md).
        fmax = torch.finfo(x.dtype).max
        b = torch.maximum(x.clamp(max=fmax), torch.where(m == -_INF, m.clamp(min=-fmax), -_INF))
        return b if drop is None else torch.where(drop, -0.0, b)
    bits, neg_inf = _BITS[x.dtype]
    if x.is_neg():  # a negative-bit view (torch._neg_view) has no dtype view: its values first
        x = x.resolve_neg()
    # m + 0 turns a -0.0 max into +0.0, whose bits are above a +0.0 entry's (-0.0's are not)
    c = torch.add((m + 0.0).view(bits).clamp_min(neg_inf), torch.isinf(m), alpha=-1)
    if drop is not None:  # -0.0's bits are the least integer: every entry moves to them
        c = c.masked_fill(drop, torch.iinfo(bits).min)
    return torch.minimum(x.view(bits), c).view(x.dtype)


# --- log-softmax of a row ---------------------------------------------------------------------


def _log_softmax_max0(z: Tensor, cdim: int) -> Tensor:
    """``log_softmax(z)`` for a ``z`` whose row max is 0 (NaN on NaN rows), compiled:
    ``z − log Σ exp z``, where inductor's log-softmax finds that max again, one read of the row
    more (log_softmax 8192x1000 fwd+bwd 1.16-1.20x → 1.03-1.07x compiled torch's; label
    smoothing's forward 4 → 3 loops over the row; benchmarks/spellings.md)."""
    return z - torch.exp(z).sum(cdim, keepdim=True).log()


def fast_log_softmax(x: Tensor, cdim: int) -> tuple[Tensor, Tensor]:
    """torch's ``log_softmax`` of ``x`` bounded per row (see ``bounded``), and the row max.

    The bounds are the identity on every row with a finite maximum (``finfo.min`` rows
    included); on a ``+inf`` row ``+inf → finfo.max`` leaves the ``+inf`` entries far above
    the rest (all but ``finfo.max`` itself), so their probability is uniform; a fully masked
    row becomes a finite uniform row (the caller reads it off ``m == -inf``).
    """
    m = x.amax(cdim, keepdim=True)
    if torch.compiler.is_compiling():  # the bounded row's max is m bounded
        fmax = torch.finfo(x.dtype).max
        return _log_softmax_max0(bounded(x, m) - m.clamp(-fmax, fmax), cdim), m
    return log_softmax_over(bounded(x, m), cdim), m


def softmax_over(b: Tensor, cdim: int) -> Tensor:
    """torch's ``softmax`` of ``b``, a Function's own fresh buffer: written over ``b`` as in
    `log_softmax_over` (the same bytes moved, one ``(N, C)`` buffer fewer at the peak)."""
    if inplace_ok(b) and b.is_contiguous():
        return torch._softmax(b, cdim, False, out=b)
    return torch.softmax(b, cdim)


def softmax_limits(x: Tensor, dim: int) -> Tensor:
    """``softmax(x)`` with its limits, in torch's kernel: uniform over the ``+inf`` entries of a
    slice (``+inf → finfo.max``, a constant bound: the identity on every slice without
    ``+inf``), 0 on all-``-inf`` slices (NaN from the kernel, set from the slice max), NaN on
    NaN slices. The bytes of `bounded`'s form, 4 N-sized operators fewer: the all-``-inf``
    slices need a fix after the kernel in either form (a softmax sums to 1)."""
    m = x.amax(dim, keepdim=True)
    return softmax_over(x.clamp(max=torch.finfo(x.dtype).max), dim).masked_fill_(m == -_INF, 0.0)


def log_softmax_over(b: Tensor, cdim: int) -> Tensor:
    """torch's ``log_softmax`` of ``b``, a Function's own fresh buffer, written over ``b`` in
    eager first order where ``b`` is contiguous (the kernel's aliased output is wrong with
    other strides). The same bytes moved; a fresh output holds one more ``(N, C)`` buffer at the
    peak (log_softmax 1024x1000 fwd+bwd peak 1.50x → 1.13x torch's)."""
    if inplace_ok(b) and b.is_contiguous():
        return torch._log_softmax(b, cdim, False, out=b)
    return torch.log_softmax(b, cdim)


def exact_log_softmax(
    x: Tensor, cdim: int, masked_rows_inf: bool = False, nan_rows: bool = True
) -> tuple[Tensor, Tensor]:
    """``log_softmax`` that is ``-inf`` exactly where the probability is 0, and the row max.

    ``x - m`` is NaN only where ``x == m == ±inf`` (and on NaN rows); setting those entries
    to 0 gives the limit on ``+inf`` rows (the finite entries are ``-inf``) and a finite
    uniform row on fully masked ones (``-inf`` there with ``masked_rows_inf``: the public
    log-softmax's and entropy's value). NaN rows stay NaN (``x == m`` is false there), except
    with ``nan_rows=False`` in eager first order, where they may come back finite: for a
    caller that restores them from the N-sized max (one full pass fewer).
    """
    m = x.amax(cdim, keepdim=True)
    # the row fix from m: NaN on NaN rows and -inf on fully masked ones, else 0
    masked_fix = m.masked_fill(m > -_INF, 0.0) if masked_rows_inf else None
    if not inplace_ok(x):  # transforms, double backward, compile: the where spelling
        # NaN rows stay NaN here (x == m is false there): only fully masked rows need a fix
        z = torch.where(x == m, 0.0, x - m)
        if masked_rows_inf and torch.compiler.is_compiling():
            # only for the public log-softmax and entropy: the cross-entropy callers'
            # partitioner then recomputed the row (benchmarks/spellings.md)
            lsm = _log_softmax_max0(z, cdim)
        else:
            lsm = torch.log_softmax(z, cdim)
        return (lsm if masked_fix is None else lsm + masked_fix), m
    # eager: in place on our own buffer; nan_to_num also zeroes NaN rows, restored from m.
    # Fewer bytes than the select (the shift and log_softmax at 8192x1000: 279 → 229 MB);
    # compiled keeps the select, which inductor vectorizes and not nan_to_num (3.5-3.9x).
    z = (x - m).nan_to_num_(nan=0.0, posinf=_INF, neginf=-_INF)
    lsm = log_softmax_over(z, cdim)
    if masked_fix is not None:
        return lsm.add_(masked_fix), m
    return (lsm.add_(torch.where(torch.isnan(m), m, 0.0)) if nan_rows else lsm), m


def probs_from(lsm: Tensor, fresh: bool) -> Tensor:
    """``exp(lsm)``; ``lsm`` is finite on fully masked rows (both log-softmaxes above) and
    NaN only on NaN rows. ``fresh``: first order, the caller's own buffer; the plain ``exp``
    (a NaN row's gradient is NaN through its row scale anyway). Otherwise 0 where ``lsm`` is
    NaN."""
    if fresh:
        return lsm.exp()
    # double where: exp never sees the NaN, so double backward stays finite there
    return torch.exp(torch.where(torch.isnan(lsm), -_INF, lsm))


def extra_log_softmax_grad(lsm: Tensor, grad_lsm: Tensor | None, cdim: int) -> Tensor | None:
    """Gradient through the extra log-softmax output: ``g − softmax · Σ g``. None while
    compiling: only a double backward sends it a gradient, and compiled code is first order;
    AOT autograd's materialized zero there cost two passes over the row (benchmarks/spellings.md)."""
    if grad_lsm is None or torch.compiler.is_compiling():
        return None
    return grad_lsm - probs_from(lsm, False) * grad_lsm.sum(cdim, keepdim=True)


# --- the class-index row -----------------------------------------------------------------------


def class_shape(ndim: int, cdim: int) -> list[int]:
    """The shape that broadcasts a per-class vector along ``cdim``."""
    shape = [1] * ndim
    shape[cdim] = -1
    return shape


def is_target(t: Tensor, index: Tensor, cdim: int) -> Tensor:
    """``True`` at the class ``index`` (keepdim, along ``cdim``) of each row of ``t``'s shape: a
    compare that inductor fuses into the row's loop where a scatter or gather is a pass of its
    own (the compiled spellings)."""
    return torch.arange(t.shape[cdim], device=t.device).view(class_shape(t.dim(), cdim)) == index


def put(t: Tensor, dim: int, index: Tensor, src: Tensor | float, add: bool = False) -> Tensor:
    """``t.scatter_(dim, index, src)`` (``scatter_add_`` with ``add``) on a Function's own fresh
    ``t``: N entries written in place. Out of place under a ``torch.func`` transform or with a
    batched ``src`` (a vmap over a backward: gradcheck's batched grad, ``is_grads_batched``),
    and only there: an unbatched ``t`` cannot take a batched ``index`` or ``src`` in place (a
    correctness gate, not a speed twin: the values are the same)."""
    wrapped = under_transform(src if isinstance(src, Tensor) else None)
    if add:
        assert isinstance(src, Tensor)
        return t.scatter_add(dim, index, src) if wrapped else t.scatter_add_(dim, index, src)
    return t.scatter(dim, index, src) if wrapped else t.scatter_(dim, index, src)


def fused_index_row(
    x: Tensor, nll_u: Tensor, v: Tensor, idx_u: Tensor, cdim: int, drop: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """`index_row`'s ``p'`` (target entry ``−r``), ``p'_t = 1 / (1 + D)`` and ``r = D p'_t``
    while compiling: the same quantities with ``D = Σ_{j≠t} e^{b_j − v}`` summed from one ``exp``
    of the bounded logits ``b = min(x, v)`` instead of read off torch's softmax. ``nll_u``:
    ``−x_t`` (keepdim).

    The summing loop has no index compare: it sums the entries below the bound and counts the
    entries at it (float compares), and ``D`` is then ``Σ_below + n_top − 1`` when the target is
    at the bound, else ``(Σ_below − e^{b_t − v}) + n_top`` (``n_top ≥ 1`` keeps the difference's
    rounding below 1 ulp of ``D``). A NaN row is NaN through ``v − v``.

    Why a second spelling, compiled only: inductor splits the softmax into two ``exp`` and the
    partitioner recomputes ``p`` in the backward from ``x`` (a third), while here the forward's
    only ``exp`` feeds the sum and the backward's recomputation is the second, as in compiled
    torch (cross-entropy 8192x1000 fwd+bwd 1.55x → 1.06-1.07x compiled torch's); eager, on the
    CPU, torch's softmax kernel is the faster pass. The history: benchmarks/spellings.md.
    """
    b = torch.minimum(x, v)
    if drop is not None:  # the dropped rows (v = 0 there) as a constant row, as `bounded`
        b = torch.where(drop, 0.0, b)
    below = b < v
    e = torch.exp(b - v)
    # D from the entries below the bound and the count at it, with no index compare in the
    # summing loop: the target is at the bound (one of n_top) or below it (its term removed)
    d_below = torch.where(below, e, 0.0).sum(cdim, keepdim=True)
    n_top = (~below).sum(cdim, keepdim=True, dtype=x.dtype)
    b_t = torch.minimum(-nll_u, v)
    e_t = torch.exp(b_t - v)
    d = torch.where(b_t < v, (d_below - e_t) + n_top, d_below + (n_top - 1.0)) + (v - v)  # NaN rows
    q_t = 1.0 / (d + 1.0)
    r = d * q_t
    return torch.where(is_target(x, idx_u, cdim), -r, e * q_t), q_t, r


def target_nll(
    w: Tensor, d: Tensor, d_den: Tensor | None = None, dead: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``S − 1``, ``log S`` and ``−log p_t`` of a row from two N-sized numbers: the target's
    shift ``w = m − x_t ≥ 0`` and ``D = Σ_{j≠t} e^{x_j − m}`` (``d``, or ``d / d_den``).

    With ``S = Σ_j e^{x_j − m} = e^{−w} + D``: ``S − 1 = D + expm1(−w)`` and
    ``−log p_t = log1p(S − 1) + w``. Where the target is the max (``w = 0``) this is
    ``log1p(D)``, the exact tail that ``lse − x_t`` rounds to 0; elsewhere ``D ≥ 1`` (the max's
    own term) and it is torch's value. ``dead`` (optional, bool): rows whose ``S`` is taken as 1
    (all-``-inf`` rows of the linear losses, which are invalid anyway). The one formula of
    `index_row` and of the linear losses' chunk step.
    """
    e = torch.expm1(w.neg())
    sm1 = e + d if d_den is None else torch.addcdiv(e, d, d_den)
    if dead is not None:
        sm1 = torch.where(dead, 0.0, sm1)
    log_s = torch.log1p(sm1)
    return sm1, log_s, log_s + w


class IndexRow(NamedTuple):
    """A class-index row (`index_row`); every field but ``p`` has the class dim squeezed."""

    p: Tensor  # p' (the softmax of the bounded row), target entry −r: the backward's row
    qs: Tensor | None  # p'_t · S: the backward divides ``p`` by it (None: not asked for)
    r: Tensor  # Σ_{j≠t} p'_j; Σ_{j≠t} p_j = r / qs (exact: from the other entries, never 1 − p_t)
    nll_t: Tensor  # −log p_t, with its exact tail
    m: Tensor  # the row max (−inf: fully masked; +inf: a +inf row; NaN: a NaN row)


def index_row(
    x: Tensor, nll: Tensor, idx: Tensor, cdim: int, fused: bool, grad: bool = True,
    ignored: Tensor | None = None, divisor: bool = True,
) -> IndexRow:
    """The class-index row in torch's passes: the row max ``m`` (``amax``, no index); the
    Function's own copy ``b`` of the logits, ``+inf → finfo.max`` (``min(x, v)``,
    ``v = clamp(m, ±finfo.max)``) with the target's logit set to ``v``; torch's ``softmax`` on
    ``b``, written over it (`softmax_over`: ``p'``); ``p'_t`` zeroed and the row summed:
    ``r = Σ_{j≠t} p'_j``. ``nll``: ``−x_t`` (``nll_loss`` of the logits: torch's gather and its
    out-of-range error).

    Since the target of ``b`` is its row max, ``p'_t = 1/S'`` is never small and
    ``D = r / p'_t = Σ_{j≠t} e^{x_j − v}`` exactly, without the index of the max; `target_nll`
    then gives ``−log p_t``. Hazard rows need no pass of their own: on ``+inf`` rows
    ``v = finfo.max`` and the ``+inf`` entries share the mass (``w = 0`` at a ``+inf`` target,
    ``+inf`` at a finite one: probability 0, the limit); a fully masked row is ``-inf`` but for
    its target (``v = -finfo.max``), so it stays finite (``p' = onehot``; the caller drops it
    from ``m``); a NaN row is NaN through ``v``.

    ``fused``: the compiled spelling of the same quantities (`fused_index_row`), see there.
    ``grad=False``: no backward follows; ``p'`` keeps its 0 at the target.
    ``divisor=False``: ``qs`` is not formed (``None``; a value that reads neither it nor ``p``).
    ``ignored`` (optional, the rows' shape; the token log-probabilities' contract, not torch's
    cross-entropy, which keeps its NaN gradient there): rows whose loss is dropped are a
    constant row in the copy (`bounded` with ``drop``: the same copy on every other row, 4
    N-sized operators more), so their ``p'`` is finite and their gradient ``p' · 0`` is 0
    whatever the row holds, NaN included.
    """
    m = x.amax(cdim, keepdim=True)
    fmax = torch.finfo(x.dtype).max
    v = m.clamp(-fmax, fmax)
    drop = None
    if ignored is not None:
        drop = ignored.unsqueeze(cdim)
        v = v.masked_fill(drop, 0.0)
    idx_u = idx.unsqueeze(cdim)
    if fused:
        p, q_t, r = fused_index_row(x, nll.unsqueeze(cdim), v, idx_u, cdim, drop)
    else:
        b = torch.minimum(x, v) if drop is None else bounded(x, m, drop)
        p = softmax_over(put(b, cdim, idx_u, v), cdim)
        q_t = p.gather(cdim, idx_u)
        # a NaN row's rest and gradient are NaN through q_t (also with one class)
        p = put(p, cdim, idx_u, 0.0)
        r = p.sum(cdim, keepdim=True)
        if grad:
            p = put(p, cdim, idx_u, r.neg())
    q_t, r, m = q_t.squeeze(cdim), r.squeeze(cdim), m.squeeze(cdim)
    # w = m − x_t; 0 where x_t = m = ±inf (the exact shift) and on NaN rows (NaN through r/q_t)
    w = torch.nan_to_num(nll + m, nan=0.0, posinf=_INF)
    sm1, _, nll_t = target_nll(w, r, q_t)
    qs = torch.addcmul(q_t, q_t, sm1) if divisor else None
    return IndexRow(p, qs, r, nll_t, m)


# --- label smoothing ---------------------------------------------------------------------------


def smoothing(x: Tensor, cdim: int) -> tuple[Tensor, Tensor]:
    """The masked classes (logit ``-inf``, no smoothing mass) and the unmasked count K ≥ 1."""
    masked = torch.isneginf(x)  # (about 2x faster than x == -inf on the CPU)
    # an int32 count: a bool sum would first copy the mask to int64
    k = (x.shape[cdim] - masked.sum(cdim, keepdim=True, dtype=torch.int32)).clamp(min=1).to(x.dtype)
    return masked, k


def class_dot(t: Tensor, v: Tensor, cdim: int) -> Tensor:
    """``Σ_c t_c v_c`` over the class dim ``cdim`` of ``t`` (``v``: ``(C,)``): one read of ``t``
    (a BLAS ``gemv``), with autocast off so that it runs in ``t``'s dtype. Class dim last:
    ``t @ v``; else ``v @ t`` with the trailing dims flattened (each layout's contiguous call:
    the other one is 18x slower at 8192x1000)."""
    with no_autocast(t.device.type):
        if cdim == t.dim() - 1:
            return t @ v
        return (v @ t.flatten(cdim + 1)).view(t.shape[:cdim] + t.shape[cdim + 1 :])


SUM_SCALE = 2.0**-64  # the exact scale of a row's smoothing terms before their sum (every head)


def smoothing_sum(
    lsm: Tensor, masked: Tensor, k: Tensor, eps: float, cdim: int, weight: Tensor | None,
    pinf_row: Tensor,
) -> Tensor:
    """``ε/K Σ_{c unmasked} w_c lsm_c`` from torch's log-softmax of the bounded logits.

    Unweighted: one `class_dot` of the row with ``2^-64``, then the N-sized scale
    ``ε 2^64 / K``. The power of two scales every term exactly, so no partial sum of fewer than
    ``2^64`` classes overflows where the terms are finite (terms near ``-1e38``), in the input's
    own dtype; a term it takes below the normal range is below ``2^-126`` in magnitude, while a
    row of two or more unmasked classes sums to at most ``-log 2``. A constant, not the least
    ``2^j ≥ C``: reading ``C``'s bits fixed the class count in ``torch.export`` and in
    ``torch.compile(dynamic=True)``. (The float64 row sum it replaces costs a float64 copy of
    the row on the CPU: 11.5x this at 8192x1000.) Weighted: each term is scaled by ``ε/K``
    before the class weight and the sum (no overflow where the weighted mean over the classes
    is finite).

    ``+inf`` rows (``pinf_row``): the bounded log-softmax is ``-log k`` at the ``+inf``
    entries and at most ``-ulp(finfo.max)/2`` at every finite one (whose probability is 0), so
    a row sum below ``-finfo.max·eps/4`` means an unmasked class of probability 0 takes
    smoothing mass: the term is ``-inf`` there, its limit. Weighted, per class: an entry below
    ``-finfo.max·eps/4`` is ``-inf`` where its class weight is not 0 (a class of weight 0
    takes no mass: its term is 0, as every 0·(−inf) term).
    """
    t = torch.where(masked, 0.0, lsm)
    thr = -torch.finfo(t.dtype).max * torch.finfo(t.dtype).eps / 4
    if weight is None:
        v = torch.full((t.shape[cdim],), SUM_SCALE, dtype=t.dtype, device=t.device)
        plain = class_dot(t, v, cdim)  # the row sum · 2^-64, exactly scaled
        out = plain * (eps / SUM_SCALE / k.squeeze(cdim))
        return torch.where(pinf_row & (plain < thr * SUM_SCALE), -_INF, out)
    # weighted (w·log p may overflow where the weighted mean does not): the zero-probability
    # classes of +inf rows as -inf entries, each term scaled before the class weight and the
    # sum. A class of weight 0 keeps its finite entry (0·(−inf) terms are 0, never NaN): its
    # threshold is -inf, a (C,) operand of the same compare
    thr_c = torch.full_like(weight, thr, dtype=t.dtype).masked_fill_(weight == 0, -_INF)
    t = torch.where(pinf_row.unsqueeze(cdim) & (t < thr_c.view(class_shape(t.dim(), cdim))), -_INF, t)
    t = t.mul_(eps / k)  # our own buffer (the select above)
    t = t * weight.view(class_shape(t.dim(), cdim))
    return t.sum(cdim)


# --- the exact tail of log p_t and the focal term ----------------------------------------------


def accurate_log_pt(rest: Tensor, lt: Tensor) -> Tensor:
    """``log p_t`` with full relative accuracy as ``p_t → 1``: ``log1p(−Σ_{j≠t} p_j)``."""
    near_one = (rest < 0.5) & ~torch.isnan(lt)  # a NaN row stays NaN (also with one class)
    # double where: log1p(-1) = -inf is never formed on the discarded branch
    return torch.where(near_one, torch.log1p(-torch.where(near_one, rest, 0.0)), lt)


def focal_terms(m: Tensor, lt: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """``m^γ (−l)`` and the backward row scale ``m^γ (1 + γ p_t r)``, ``m = Σ_{j≠t} p_j``.

    ``r = 1`` at ``m = 0`` (``p_t = 1``), its limit; ``p_t r = 0`` at ``l = −inf``
    (``p_t = 0``), the limit of ``−p log p / (1 − p)``. Every singular operand is made safe
    before use (double where), so double backward stays finite.
    """
    zero = m == 0
    dead = lt == -float("inf")
    m_safe = torch.where(zero, 1.0, m)
    mg = torch.where(zero, 0.0, torch.pow(m_safe, gamma))
    l_safe = torch.where(dead, 0.0, lt)
    r = torch.where(zero, 1.0, -l_safe / m_safe)
    pr = torch.where(dead, 0.0, torch.exp(l_safe) * r)
    return mg * lt.neg(), mg * (1.0 + gamma * pr)


def focal_rows(rest: Tensor, p_t: Tensor | None, nll_t: Tensor, gamma: float) -> tuple[Tensor, Tensor | None]:
    """`focal_terms` for first-order code (no autograd through it), in N-sized operators:
    ``m^γ (−l)`` and ``m^γ (1 + γ p_t r)`` with ``m = rest``, ``−l = nll_t``; the value only
    (the scale ``None``) without ``p_t``, for a forward that no backward follows.

    The two singular points are 0/0 and 0·inf, each mapped to its limit by one ``nan_to_num``
    (a NaN row is NaN through ``m^γ`` all the same): ``r = −l / m → 1`` at ``p_t = 1``, and
    ``p_t r → 0`` at ``p_t = 0``.
    """
    mg = rest.pow(gamma)
    if p_t is None:
        return mg * nll_t, None
    r = torch.nan_to_num(nll_t / rest, nan=1.0)
    pr = torch.nan_to_num(p_t * r, nan=0.0)
    return mg * nll_t, torch.addcmul(mg, mg, pr, value=gamma)
