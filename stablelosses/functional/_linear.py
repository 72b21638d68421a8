r"""Fused output layer + loss for large vocabularies: ``linear_cross_entropy``, ``linear_focal_loss``."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from stablelosses._autograd.linear import (
    CHUNK_BYTES,
    default_chunk_size,
    linear_chunks,
    linear_chunks_reduced,
    whole_logits_needed,
)
from stablelosses._autograd.linear_index import IndexHead
from stablelosses._spec import (
    check_chunk_size,
    check_finite_nonnegative,
    check_int,
    check_label_smoothing,
    check_normalizer,
    check_reduction,
    check_softcap,
    check_z_loss,
)
from stablelosses._utils import (
    autocast_to_float32,
    cast,
    check_floating,
    check_tensor,
    no_autocast,
    promote_types,
    target_index_errors,
)
from stablelosses.functional._cross_entropy import _INDEX_DTYPES
from stablelosses.functional._linear_options import reduce_rows, resolve_options
from stablelosses.functional._linear_parallel import is_dtensor, linear_loss_parallel
from stablelosses.functional._masked import check_mask
from stablelosses.functional._torch_losses import scalar_type

__all__ = ["CHUNK_BYTES", "default_chunk_size", "linear_cross_entropy", "linear_focal_loss"]


class _Shapes(NamedTuple):
    """What ``_check_args`` read off the shapes: which path the call takes."""

    probabilities: bool  # target holds class probabilities (shape of the logits, floating)
    k_dim: bool  # linear_weight is (V, d_1, ..., d_K, H) with K >= 1


_PLAIN = _Shapes(False, False)  # a 2-D weight and class-index targets: the chunk loop


def _check_args(
    fn: str, input: object, linear_weight: object, target: object, linear_bias: object, weight: object,
    ignore_index: object, reduction: object, z_loss: object, softcap: object, chunk_size: object,
    focal: bool = False,
) -> tuple[int, float, float | None, int, _Shapes]:
    """``(ignore_index, z_loss, softcap, chunk, shapes)`` checked, with every tensor argument.

    The checks run in the order of ``torch.nn.functional.linear_cross_entropy``'s and each
    message ends with torch's own words for the same failure, ``(torch: ...)``, so a regex
    written against torch's message matches ours. An input of more than 2 dimensions is ours
    (``(..., H)`` rows; torch takes 1-D or 2-D input only): when such a call fails, the error is
    torch's (a ``RuntimeError`` saying the dimensionality), with our reason first.
    """
    check_reduction(fn, reduction)
    x = check_floating(fn, "input", input)
    w = check_floating(fn, "linear_weight", linear_weight)
    t = check_tensor(fn, "target", target)
    beyond = x.dim() > 2  # ours: (..., H)

    def fail(kind: type[Exception], ours: str, theirs: str) -> Exception:
        if beyond:
            kind, theirs = RuntimeError, f"expected input with dimensionality 1 or 2, got {x.dim()}"
        return kind(f"{fn}: {ours}" + ("" if theirs == ours else f" (torch: {theirs})"))

    if x.dim() == 0:
        raise fail(ValueError, "input must have shape (..., H), got a 0-d tensor",
                   "expected input with dimensionality 1 or 2, got 0")
    if w.dim() < 2 or w.shape[-1] != x.shape[-1]:
        theirs = (
            f"expected linear_weight with dimensionality at least 2, got {w.dim()}" if w.dim() < 2 else
            "expected equal input and linear_weight last dimensions (in_features), "
            f"got {x.shape[-1]} and {w.shape[-1]}, respectively"
        )
        raise fail(RuntimeError,
                   "linear_weight must have shape (V, H) (or (V, d_1, ..., d_K, H) for a K-dimensional "
                   f"loss) with H = input.shape[-1] = {x.shape[-1]}, got {list(w.shape)}", theirs)
    classes, out = w.shape[0], tuple(w.shape[1:-1])
    if linear_bias is not None:
        b = check_floating(fn, "linear_bias", linear_bias)
        if tuple(b.shape) != (classes, *out):
            raise fail(RuntimeError,
                       f"linear_bias must have shape {(classes, *out)} or be None, got {list(b.shape)}",
                       f"expected linear_bias shape {(classes, *out)}, got {tuple(b.shape)}")
    if out and x.dim() != 2:  # torch's rule: a K-dimensional loss needs a batch (N, H)
        raise fail(RuntimeError,
                   f"a K-dimensional linear_weight of shape {tuple(w.shape)} needs input of shape "
                   f"(N, {x.shape[-1]}), got {tuple(x.shape)}",
                   f"K-dimensional loss defined by linear_weight shape {tuple(w.shape)} requires batched "
                   f"input, (N, {x.shape[-1]}), got unbatched input with shape {tuple(x.shape)}")
    logits_shape = (*x.shape[:-1], classes, *out)
    rows = (*x.shape[:-1], *out)
    # torch's rule: a target with the logits' shape holds probabilities (of any dtype: a
    # non-float one is an error); the focal loss takes class indices only
    same = tuple(t.shape) == logits_shape
    probabilities = same and (not focal or t.is_floating_point())
    if probabilities:
        if focal:
            raise RuntimeError(f"{fn}: target must hold class indices (int64 or uint8), got {t.dtype}")
        if ignore_index is not None:
            raise fail(RuntimeError,
                       "ignore_index cannot be specified when target contains probabilities",
                       "ignore_index cannot be specified when target contains probabilities")
        if not t.is_floating_point():
            raise fail(RuntimeError,
                       f"target of the logits' shape {list(logits_shape)} holds class probabilities and "
                       f"must be floating point, got {t.dtype}",
                       "Expected floating point type for target with class probabilities, got "
                       f"{scalar_type(t.dtype)}")
    else:
        k_dims = ", then d_1, ..., d_K" if out else ""
        want = f"target must have shape {list(rows)} (input's without H{k_dims})"
        if x.dim() == 2 and t.dim() >= 1 and t.shape[0] != x.shape[0]:  # cross_entropy checks it first
            raise fail(ValueError, f"{want}, got {list(t.shape)}",
                       f"Expected input batch_size ({x.shape[0]}) to match target batch_size ({t.shape[0]}).")
        if t.dtype not in _INDEX_DTYPES:
            raise fail(RuntimeError,
                       f"target must hold class indices (int64 or uint8) or class probabilities of "
                       f"shape {list(logits_shape)}, got {t.dtype} of shape {list(t.shape)}",
                       f"expected target dtype to be Long or Byte, but got {scalar_type(t.dtype)}")
        if tuple(t.shape) != rows:
            raise fail(ValueError, f"{want}, got {list(t.shape)}",
                       f"expected target of shape {list(rows)}, got {list(t.shape)}")
    if weight is not None:
        cw = check_floating(fn, "weight", weight)
        if cw.shape != (classes,):
            hint = (
                " (weight is the per-class weight, as in F.cross_entropy; the output layer's matrix"
                " is linear_weight, the second argument)" if cw.dim() == 2 else ""
            )
            raise fail(RuntimeError,
                       f"weight must have shape ({classes},) (one weight per class) or be None, "
                       f"got {list(cw.shape)}{hint}",
                       f"weight tensor should be defined either for all {classes} classes or no classes but "
                       f"got weight tensor of shape: {list(cw.shape)}")
    ii = -100 if ignore_index is None else check_int(fn, "ignore_index", ignore_index)  # None: torch's -100
    z, cap, chunk = check_linear_options(fn, ii, z_loss, softcap, chunk_size)
    assert isinstance(ii, int)  # checked there
    return ii, z, cap, chunk, _Shapes(probabilities, bool(out))


def check_linear_options(
    fn: str, ignore_index: object, z_loss: object, softcap: object, chunk_size: object,
) -> tuple[float, float | None, int]:
    """``(z_loss, softcap, chunk)`` checked (``chunk`` -1 for automatic): the arguments that
    need no tensor, also checked by the modules at construction."""
    check_int(fn, "ignore_index", ignore_index)
    z = check_z_loss(fn, z_loss)
    cap = check_softcap(fn, softcap)
    chunk = check_chunk_size(fn, chunk_size)
    return z, cap, -1 if chunk is None else chunk


def _unfused_loss(
    fn: str, input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, class_weight: Tensor | None,
    ignore_index: int, reduction: str, label_smoothing: float, z_loss: float, softcap: float | None,
    gamma: float | None, mask: Tensor | None, cd: torch.dtype, out_dtype: torch.dtype, probabilities: bool,
) -> Tensor:
    """torch's reference formula on our exact losses: ``cross_entropy`` (``focal_loss``) of
    ``linear(input, W.reshape(V·Πd, H), b.reshape(-1)).reshape(*batch, V, *d)`` in ``cd``.

    The path for what the chunk loop does not do: a K-dimensional ``linear_weight``, probability
    targets, a class ``weight`` that requires grad, forward-mode AD and ``torch.func`` transforms
    (the logits exist whole; every hazard row keeps its defined value, as ``cross_entropy`` gives
    it). Softcap and z-loss are applied as in the fused loss: ``c tanh(u / c)`` with ``-inf``
    kept, ``z w_t lse²`` per kept row (``z lse²`` with probabilities), in the same ``'mean'``
    denominator.
    """
    h, classes, out = input.shape[-1], weight.shape[0], tuple(weight.shape[1:-1])
    batch = tuple(input.shape[:-1])
    x = input if input.dim() <= 2 else input.reshape(-1, h)  # (..., H) with a 2-D weight: rows
    t = target
    if input.dim() > 2:
        t = target.reshape(-1, classes) if probabilities else target.reshape(-1)
    rows = tuple(x.shape[:-1]) + out  # shape of the unreduced loss
    m = None
    if mask is not None:
        m = check_mask(fn, mask, torch.Size((*batch, *out)), "the per-row loss", device=input.device)
        m = m.expand((*batch, *out)).reshape(rows)
        # a hidden state no kept row reads is never multiplied (select, as the chunked path
        # does): a NaN in padding reaches no gradient, the linear weight's included
        kept = m.reshape(*x.shape[:-1], math.prod(out)).any(-1)  # (not -1: 0 rows are fine)
        x = torch.where(kept.unsqueeze(-1), x, 0.0)
    with no_autocast(input.device.type):
        w2 = weight.reshape(-1, h).to(cd)
        u = torch.nn.functional.linear(x.to(cd), w2, None if bias is None else bias.reshape(-1).to(cd))
        u = u.reshape(*x.shape[:-1], classes, *out)
        cw = None if class_weight is None else class_weight.to(cd)
        tt = t.to(cd) if probabilities else t
        ii = -100 if probabilities else ignore_index
        loss = _logits_loss(u, tt, cw, ii, reduction, label_smoothing, z_loss, softcap, gamma, m,
                            probabilities)
    if reduction == "none":
        loss = loss.reshape((*batch, *out))
    return cast(loss, out_dtype)


def _logits_loss(
    u: Tensor, t: Tensor, cw: Tensor | None, ignore_index: int, reduction: str, label_smoothing: float,
    z_loss: float, softcap: float | None, gamma: float | None, mask: Tensor | None, probabilities: bool,
) -> Tensor:
    """The fused loss's value on whole logits ``u`` in differentiable ops: softcap, then
    ``cross_entropy`` (``focal_loss``), then the z-loss, as the chunked head computes them."""
    from stablelosses.functional._cross_entropy import cross_entropy
    from stablelosses.functional._focal import focal_loss

    if softcap is not None:
        # -inf stays -inf as a constant: d c tanh(u / c) / du = 1 - tanh² = 0 there, as in the
        # chunked head (the identity branch gave a target at a -inf logit the gradient -1)
        u = torch.where(u == -math.inf, -math.inf, softcap * torch.tanh(u / softcap))
    inner = reduction if z_loss == 0.0 else "none"
    if gamma is None:
        loss = cross_entropy(u, t, weight=cw, ignore_index=ignore_index, reduction=inner,
                             label_smoothing=label_smoothing, mask=mask)
    else:
        loss = focal_loss(u, t, gamma=gamma, weight=cw, ignore_index=ignore_index, reduction=inner, mask=mask)
    if z_loss > 0.0:
        loss = _add_z_loss(loss, u, t, cw, ignore_index, reduction, z_loss, mask, probabilities)
    return loss


def _dense_index_rows(head: IndexHead) -> Callable[[tuple[Tensor, ...], tuple[Tensor, ...]], Tensor]:
    """The head's two outputs per row (the loss, the row weight) as differentiable ops of the
    whole logits: the chunk engine's double backward (see ``linear_chunks``' ``dense``)."""

    def dense(logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> Tensor:
        (u,), t = logits, rows[0]
        cw = rows[1] if head.weighted else None
        ii = head.ignore_index
        loss = _logits_loss(u, t, cw, ii, "none", head.label_smoothing, head.z_loss, head.softcap,
                            head.gamma, None, False)
        kept = t != ii
        w_t = 1.0 if cw is None else cw[torch.where(kept, t, 0)]
        row_w = torch.where(kept & ~(u == -math.inf).all(1), w_t, 0.0)
        return torch.stack([loss, row_w.to(loss.dtype)], 1)

    return dense


def _add_z_loss(
    loss: Tensor, u: Tensor, t: Tensor, cw: Tensor | None, ignore_index: int, reduction: str, z: float,
    mask: Tensor | None, probabilities: bool,
) -> Tensor:
    """The unreduced ``loss`` plus ``z w_t lse²`` on its kept rows, then reduced as the loss."""
    from stablelosses.functional._softmax import logsumexp

    cdim = 0 if u.dim() == 1 else 1
    all_masked = (u == -math.inf).all(cdim)
    # an all -inf row's lse (-inf) would give 0 · inf in the gradient: such rows read 0 instead
    lse = logsumexp(torch.where(all_masked.unsqueeze(cdim), 0.0, u), cdim)
    valid = ~all_masked
    if mask is not None:
        valid = valid & mask
    wt = None
    if not probabilities:
        kept = t != ignore_index
        valid = valid & kept
        if cw is not None:
            wt = cw[torch.where(kept, t, 0)]
    # a +inf row: the chunked head's lse is of the bounded logits (+inf -> finfo.max), so its
    # z-loss is +inf with the gradient 2 z finfo.max p (p: our logsumexp's limit, uniform over
    # the +inf entries), not 2 z (+inf) p = NaN where p = 0 (double where: lse² only where finite)
    top = lse == math.inf
    z_row = torch.where(top, (2.0 * z * torch.finfo(lse.dtype).max) * lse,
                        z * torch.where(top, 0.0, lse).square())
    if wt is not None:
        # w_t = 0 removes the term, an infinite one too (0 · inf = 0, the chunked head's rule):
        # double where, so that neither gradient reads 0 · inf
        z_row = torch.where(wt == 0, 0.0, z_row) * wt
    loss = loss + torch.where(valid, z_row, 0.0)
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    count = torch.where(valid, 1.0 if wt is None else wt, 0.0).sum()
    if mask is not None:  # masked mean: 0 with gradient 0 when no row is kept
        return torch.where(count > 0, total / torch.where(count > 0, count, 1.0), 0.0)
    return total / count


def _linear_loss(
    fn: str, input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, class_weight: Tensor | None,
    ignore_index: int, reduction: str, label_smoothing: float, z_loss: float, softcap: float | None,
    gamma: float | None, chunk_size: int, mask: Tensor | None = None, options: object = None,
    shapes: _Shapes = _PLAIN, normalizer: Tensor | float | None = None,
) -> Tensor:
    tensors = (input, weight) if bias is None else (input, weight, bias)
    cd = torch.float64 if any(v.dtype == torch.float64 for v in tensors) else torch.float32
    h = input.shape[-1]
    chunk_size, cd = resolve_options(fn, options, chunk_size, target.numel(), h, weight.shape[0], cd)
    out_dtype = input.dtype
    for v in tensors[1:]:
        out_dtype = promote_types(out_dtype, v.dtype)
    if shapes.probabilities:
        out_dtype = promote_types(out_dtype, target.dtype)
        if target.dtype == torch.float64:
            cd = torch.float64
    if out_dtype in (torch.float16, torch.bfloat16) and autocast_to_float32(input):
        out_dtype = torch.float32
    if (
        shapes.probabilities or shapes.k_dim or whole_logits_needed()
        or (class_weight is not None and class_weight.requires_grad and torch.is_grad_enabled())
    ):
        if normalizer is None:
            return _unfused_loss(
                fn, input, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing,
                z_loss, softcap, gamma, mask, cd, out_dtype, shapes.probabilities,
            )
        total = _unfused_loss(
            fn, input, weight, target, bias, class_weight, ignore_index, "sum", label_smoothing, z_loss,
            softcap, gamma, mask, cd, cd, shapes.probabilities,
        )
        return cast(reduce_rows(total, total, "mean", normalizer, True), out_dtype)
    chunk = None if chunk_size < 0 else chunk_size  # None: the engine's default, at run time
    head = IndexHead(fn, int(ignore_index), label_smoothing, z_loss, softcap, gamma, class_weight is not None)
    # target.numel() rows, not -1: a reshape to (-1, 0) is ambiguous when H = 0
    x = input.reshape(target.numel(), h)
    t = target.reshape(-1).long()
    consts = () if class_weight is None else (class_weight.detach().to(cd),)
    if mask is not None:
        # a masked-out row is an ignored row whose hidden state is never read (select, no multiply)
        m = check_mask(fn, mask, target.shape, "the per-row loss", device=x.device).to(x.device)
        m = m.expand(target.shape).reshape(-1)
        x = torch.where(m[:, None], x, 0.0)
        t = torch.where(m, t, int(ignore_index))
    streams = [(x, weight, bias)]
    dense = _dense_index_rows(head)
    if reduction == "none":
        out = linear_chunks(head, streams, [t], chunk_size=chunk, consts=consts, dtype=cd, dense=dense)
        return cast(out[:, 0].reshape(target.shape), out_dtype)
    # 'mean'/'sum': the gradients in the forward, of the loss column (the row weights: none)
    coef = torch.tensor([1.0, 0.0], dtype=cd, device=x.device)
    total, out = linear_chunks_reduced(head, streams, [t], coef, chunk_size=chunk, consts=consts, dtype=cd,
                                       dense=dense)
    return cast(reduce_rows(total, out[:, 1], reduction, normalizer, mask is not None), out_dtype)


def _parallel(
    fn: str, input: Any, linear_weight: Any, target: Any, linear_bias: Any, weight: Any, ignore_index: object,
    reduction: object, label_smoothing: object, z_loss: object, softcap: object, gamma: float | None,
    chunk_size: object, mask: Tensor | None, options: object, process_group: Any, vocab_start: int | None,
    normalizer: object = None,
) -> Tensor:
    """The vocabulary-parallel call, its scalar arguments checked as in the one-process one."""
    check_reduction(fn, reduction)
    norm = check_normalizer(fn, normalizer, reduction)
    ii = -100 if ignore_index is None else check_int(fn, "ignore_index", ignore_index)
    z, cap, chunk = check_linear_options(fn, ii, z_loss, softcap, chunk_size)
    eps = check_label_smoothing(fn, label_smoothing)
    if whole_logits_needed():
        raise NotImplementedError(
            f"{fn}: forward-mode AD and torch.func transforms are not supported with a sharded vocabulary")
    assert isinstance(ii, int) and isinstance(reduction, str)
    run = linear_loss_parallel
    if torch.compiler.is_compiling():
        # not traced: the collectives, the layout's one host read and the ctx-style Function run
        # eagerly (a graph break; fullgraph=True raises). Traced, Dynamo crashed reconstructing
        # the head ("can't reconstruct arbitrary frozen dataclass instances"). Wrapped here, not
        # at import: torch.compiler.disable imports Dynamo (and triton)
        run = torch.compiler.disable(linear_loss_parallel)
    return run(
        fn, input, linear_weight, target, linear_bias, weight, ii, reduction, eps, z, cap, gamma, chunk,
        mask, options, process_group, vocab_start, norm,
    )


_OLD_SPELLING = (
    "{fn}(input, weight, target, bias) is deprecated and will be removed in the next version: "
    "torch.nn.functional.linear_cross_entropy's spelling is {fn}(input, linear_weight, target, *, "
    "linear_bias=None, weight=None, ...), where the output layer's matrix is linear_weight (the "
    "second argument), its bias is linear_bias= (keyword) and weight= means per-class weights. "
    "Write {fn}(input, W, target, linear_bias=b)."
)


def _translate_old_spelling(fn: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The old call ``(input, weight=matrix, target, bias)`` as the new one (with a warning).

    Unambiguous by construction: the new signature has no 4th positional argument and no
    ``bias=``, and it requires ``linear_weight``, so a call that gives ``weight=`` but no
    ``linear_weight`` (by position or by name) can only be the old one. Any other call is left
    as it is (a 2-D ``weight=`` then fails with a message that names ``linear_weight``).
    """
    old = False
    if len(args) > 4:
        raise TypeError(f"{fn}() takes 3 positional arguments but {len(args)} were given")
    if len(args) == 4:
        if "linear_bias" in kwargs or "bias" in kwargs:
            raise TypeError(f"{fn}(): the bias given twice (4th positional argument and keyword)")
        kwargs["linear_bias"], args, old = args[3], args[:3], True
    if "bias" in kwargs:
        if "linear_bias" in kwargs:
            raise TypeError(f"{fn}(): got both bias= (deprecated) and linear_bias=")
        kwargs["linear_bias"], old = kwargs.pop("bias"), True
    if len(args) < 2 and "linear_weight" not in kwargs and "weight" in kwargs:
        kwargs["linear_weight"], old = kwargs.pop("weight"), True
    if old and not torch.compiler.is_compiling():  # Dynamo cannot trace warnings.warn
        warnings.warn(_OLD_SPELLING.format(fn=fn), DeprecationWarning, stacklevel=3)
    return args


def _accepts_old_spelling(impl: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``impl`` (torch's signature) that also takes the old spelling for one version."""
    fn = impl.__name__

    @functools.wraps(impl)
    def wrapper(*args: Any, **kwargs: Any) -> Tensor:
        if len(args) > 3 or "bias" in kwargs or ("weight" in kwargs and len(args) < 2):
            args = _translate_old_spelling(fn, args, kwargs)
        return impl(*args, **kwargs)

    return wrapper


@_accepts_old_spelling
def linear_cross_entropy(
    input: Tensor, linear_weight: Tensor, target: Tensor, *, linear_bias: Tensor | None = None,
    weight: Tensor | None = None, reduction: str = "mean", ignore_index: int | None = None,
    label_smoothing: float = 0.0, options: Any = None, z_loss: float = 0.0, softcap: float | None = None,
    chunk_size: int | None = None, mask: Tensor | None = None, process_group: Any = None,
    vocab_start: int | None = None, normalizer: Tensor | float | None = None,
) -> Tensor:
    r"""Cross-entropy of a linear layer's logits, computed chunk by chunk: the $(N, V)$ logits never exist.

    torch's signature (`torch.nn.functional.linear_cross_entropy`, torch >= 2.13) and its value:
    `linear_weight` is the output layer's matrix, `linear_bias` its bias and `weight` the
    per-class weights of `F.cross_entropy`. With logits $u = x W^\top + b$ (softcapped to
    $l = c \tanh(u / c)$ when `softcap=c`, a $-\infty$ entry staying $-\infty$), the value
    equals `cross_entropy(l, target, weight=w, ignore_index=..., reduction=...,
    label_smoothing=ε)` plus the z-loss: for row $i$ with its $K_i$ unmasked classes $U_i$
    (logit $\ne -\infty$),

    $$
    \ell_i = (1 - \varepsilon) w_{t_i} (-\log p_{i,t_i})
             + \frac{\varepsilon}{K_i} \sum_{c \in U_i} w_c (-\log p_{i,c})
             + z\, w_{t_i} \operatorname{logsumexp}(l_i)^2,
    $$

    ($w = 1$ without `weight`) and $\ell_i = 0$ when $t_i$ is `ignore_index` or every logit of
    row $i$ is $-\infty$ (such a row is not counted). `'mean'` divides $\sum_i \ell_i$ by
    $\sum_i w_{t_i}$ over the kept rows (their number without `weight`; NaN when there is
    none, as torch, with zero gradients; 0 with a `mask`), `'sum'` sums, `'none'` returns
    $\ell$ with the shape of `target`. A finite logit such as `finfo.min` is an ordinary
    logit; only $-\infty$ masks.

    **The old spelling** `linear_cross_entropy(input, W, target, b)` / `bias=b` (and the matrix
    as `weight=`, with no `linear_weight`) still works for this version with a
    `DeprecationWarning`; write `linear_cross_entropy(input, W, target, linear_bias=b)`. A 2-D
    `weight=` next to a `linear_weight` is never reinterpreted: it raises.

    The rows are processed in chunks of $n$ = `chunk_size` rows; each chunk computes its logits,
    loss and gradient in float32 (float64 for float64 inputs). For `'mean'`/`'sum'` the
    gradients are computed during the forward (the backward only scales them: no second matmul
    pass); `'none'` recomputes each chunk in the backward. Eagerly the chunk loop is a Python
    loop; under `torch.compile` it is one opaque custom op, so the graph and its compile time
    do not depend on $N$.

    **Workspace** (bytes, $c$ = 4 for the float32 compute dtype, 8 for float64; $N$ rows, $H$
    features, $V$ classes): one chunk's logits/gradient buffer $c\,nV$, plus $(c + 1)\,nV$
    transient with `label_smoothing` and $2c\,nV$ with `softcap`; the chunk's input
    $c\,nH$; the input gradient $c\,NH$; the weight gradient's accumulator $c\,VH$ (it is
    the returned gradient when `linear_weight` is in the compute dtype, else it is cast once to
    the weight's dtype at the end, $VH$ more elements of that dtype). A `linear_weight` narrower
    than the compute dtype (bfloat16/float16) is **never converted whole**: each chunk converts
    one block of $B = \lfloor 2^{24} / (cH) \rfloor$ vocabulary rows at a time ($c\,BH$ =
    16 MiB), twice per chunk (logits and input gradient). So the dW of a bfloat16 weight is
    accumulated across chunks in float32 in a $4VH$-byte accumulator.

    **Gradient**: $\partial \ell_i / \partial l_{i,c} = (1 + 2 z \operatorname{lse}_i)\, p_{i,c}
    - (1 - \varepsilon)[c = t_i] - \frac{\varepsilon}{K_i}[c \in U_i]$, times
    $1 - \tanh^2(u/c)$ under softcapping; then $\partial/\partial x = g W$,
    $\partial/\partial W = g^\top x$, $\partial/\partial b = \sum_i g_i$. $\log p_t$ and
    $\operatorname{lse}$ are computed as $(l_t - m) - \operatorname{log1p}(\sum_{j \ne \arg\max} e^{l_j - m})$
    (exact as $p_t \to 1$). Defined values: a masked ($-\infty$) class gets gradient exactly 0,
    so a vocabulary entry masked by a $-\infty$ bias gets an exactly zero weight row unless it is
    a target (with `softcap`, a target's too: $1 - \tanh^2 = 0$ at $-\infty$, on every path);
    ignored and fully masked rows get gradient 0. A backward with `create_graph=True`
    (double backward, a gradient penalty) recomputes the loss on the whole logits with the
    unfused formula and returns its gradient as a graph: exact second derivatives, with the
    `(N, V)` logits held for that backward (under `torch.func`, `hessian` included, the logits
    are whole from the forward on: below). The vocabulary-parallel form stays first order: its
    double backward raises `RuntimeError`.

    **Beyond the chunk loop** (torch's reference path takes these, so do we, exactly, on the
    unfused formula `cross_entropy(linear(input, W.reshape(V·Πd, H), b.reshape(-1))
    .reshape(*batch, V, *d))` with the logits whole, softcap and z-loss as above): a
    K-dimensional `linear_weight` $(V, d_1, \dots, d_K, H)$ (with `input` $(N, H)$, target
    $(N, d_1, \dots)$), probability targets (the logits' shape; the z-loss is $z\,\text{lse}^2$
    per row, `'mean'` over the rows), a class `weight` that requires grad (it gets its true
    gradient, `'mean'`'s denominator included; torch's chunked path silently gives it none) and
    forward-mode AD (`torch.func.jvp`, `torch.autograd.forward_ad`, `jacfwd`, `hessian`;
    torch's chunked path has none) and every `torch.func` transform (`grad`, `vmap`, `jacrev`:
    the chunk loop has no batching rule, and a nested transform cannot differentiate its
    hand-written gradient).

    **Mask.** ``mask`` (bool, True = counts) broadcastable to ``target`` drops rows: a False
    row becomes an ignored row (the chunked code's own path) and its hidden state is replaced
    by 0 before the matmul, so a NaN in padding reaches no gradient (``weight``'s included).
    ``'mean'`` divides by the kept rows; with a mask, no row kept by ``mask`` and
    ``ignore_index`` gives **0** with gradient 0 instead of NaN. ``mask=None`` adds nothing.

    Args:
        input: hidden states $(N, H)$ or $(\dots, H)$, any float dtype (float16/bfloat16 are
            computed in float32).
        linear_weight: output-layer matrix $(V, H)$, as `nn.Linear.weight` (for tied
            embeddings, pass the embedding matrix), or $(V, d_1, \dots, d_K, H)$ for a
            K-dimensional loss (unfused).
        target: class indices (int64 or uint8) of shape `input.shape[:-1]` (then $d_1, \dots$),
            or class probabilities of the logits' shape (unfused).
        linear_bias: output-layer bias $(V)$ or `None`. Default: `None`.
        weight: per-class weights $(V)$ as in `F.cross_entropy`, or `None`; one that requires
            grad gets its gradient (unfused). Default: `None`.
        reduction: `'none'` | `'mean'` | `'sum'`. Default: `'mean'`.
        ignore_index: target value that contributes nothing (`None`: -100, as torch; with
            probability targets it must be `None`, as torch). Default: `None`.
        label_smoothing: $\varepsilon \in [0, 1]$, spread over the unmasked classes. Default: `0.0`.
        options: `None` or a `torch.nn.LinearCrossEntropyOptions` (torch >= 2.13): its
            `batch_chunk_size` / `chunking_method` set the rows per chunk as in torch
            (`'auto'` keeps ours), `acc_dtype=torch.float64` computes in float64 (float32 or
            `None`: unchanged; narrower raises `ValueError`); `acc_policy` and
            `allow_retain_graph` change nothing (dW is always accumulated in float32 or wider;
            the backward can always be run twice). Default: `None`.
        z_loss: coefficient $z \ge 0$ of the PaLM auxiliary loss $z \operatorname{lse}^2$ per kept
            row. Default: `0.0`.
        softcap: $c > 0$ for Gemma 2's $c \tanh(l / c)$ logit soft-capping, or `None`.
        chunk_size: rows per chunk, or `None` for a size that keeps one chunk's logits within
            64 MiB (a power of two, from $V$ and the dtype).
        mask: bool tensor, True = counts, broadcastable to ``target`` (keyword-only);
            ``None``: every entry counts. Default: ``None``.
        process_group: vocabulary-parallel: `linear_weight` (and `linear_bias`) are this
            rank's shard of the vocabulary rows, `input` and the global class-index `target`
            are the same on every rank of this `torch.distributed` group; `weight` is either
            replicated $(V)$ or sharded like the matrix. The per-row max, exp-sum and target
            logit are combined in two all-reduces of N-sized tensors; every rank gets the
            identical loss; the input gradient is all-reduced, the weight gradient stays local.
            No value is read on the host; the shard layout is checked on the first call with
            each shard tensor (one all-gather). A target outside the vocabulary gives NaN on its row. A
            `linear_weight` that is a DTensor placed `Shard(0)` on a 1-D mesh takes this path
            by itself (no `process_group`). Not with probability targets, K-dimensional weights,
            a class weight that requires grad, forward mode, `torch.func` transforms or double
            backward; under `torch.compile` it runs eagerly (a graph break: `fullgraph=True`
            raises). Default: `None`.
        vocab_start: with `process_group`, the global index of this shard's first row (on every
            rank or on none). Default: the rows of the ranks before (uneven and empty shards
            work); a layout that does not cover the vocabulary exactly once raises `ValueError`.
        normalizer: a number $\ge 0$ or a 0-d tensor that replaces `'mean'`'s denominator
            (e.g. the token count over gradient accumulation and ranks); `'mean'` only. A
            normalizer of 0 gives 0 with gradient 0 (a fully masked batch); never read on the
            host. Default: `None`.

    Returns:
        The loss: a scalar, or shape of `target` for `'none'`; dtype of `input` and `weight`
        promoted (float32 for float16/bfloat16 inside autocast). Gradients come back in each
        parameter's dtype.

    Raises:
        ValueError: bad `reduction`, `target` shape, negative or infinite `z_loss`, `softcap`
            not $> 0$, `chunk_size < 1`, 0-d `input`, `options` that disagree with
            `chunk_size` or ask for an accumulation below float32, `normalizer` negative,
            infinite, not 0-d or given without `reduction='mean'`, a vocabulary-parallel layout
            that does not cover the vocabulary exactly once.
        TypeError: `normalizer` not a number or tensor; non-float
            `input`/`linear_weight`/`linear_bias`/`weight`, non-int
            `ignore_index`/`chunk_size`, non-number `label_smoothing`/`z_loss`/`softcap`,
            `options` of another type.
        RuntimeError: `linear_weight`/`linear_bias`/`weight` shape, `target` dtype,
            `label_smoothing` outside $[0, 1]$, a K-dimensional `linear_weight` without an $(N, H)$
            input, `ignore_index` given with probability targets (as torch), a target of the
            logits' shape (probabilities, by torch's rule) that is not floating point. The
            checks run in torch's order and each shape/dtype message ends with torch's own
            words, `(torch: ...)`; an input of more than 2 dimensions (ours: torch takes 1-D or
            2-D input) that fails a check raises torch's `RuntimeError` for its dimensionality.
        IndexError: a target index out of range (torch's "Target 7 is out of bounds."; also a
            `RuntimeError`, the type of the gather that finds it).
        ValueError: ``mask`` does not broadcast to the unreduced loss (TypeError: not bool).

    Shape:
        input $(\dots, H)$, linear_weight $(V, H)$, linear_bias $(V)$, weight $(V)$, target
        $(\dots)$ (probabilities: $(\dots, V)$); output $()$ or $(\dots)$. K-dimensional:
        input $(N, H)$, linear_weight $(V, d_1, \dots, d_K, H)$, linear_bias
        $(V, d_1, \dots, d_K)$, target $(N, d_1, \dots, d_K)$ (probabilities:
        $(N, V, d_1, \dots, d_K)$); output $()$ or $(N, d_1, \dots, d_K)$.

    Example:
        >>> import torch, torch.nn.functional as F, stablelosses.functional as SF
        >>> x = torch.randn(6, 4, requires_grad=True)
        >>> W = torch.randn(10, 4, requires_grad=True)
        >>> t = torch.tensor([1, 2, 3, -100, 5, 6])
        >>> loss = SF.linear_cross_entropy(x, W, t, chunk_size=4)
        >>> torch.allclose(loss, F.cross_entropy(x @ W.T, t))
        True
        >>> loss.backward()
        >>> bool(W.grad[0].abs().sum() > 0)
        True

    References:
        Wijmans et al., *Cut Your Losses in Large-Vocabulary Language Models* (2024);
        Hsu et al., *Liger Kernel* (2024); Chowdhery et al., *PaLM* (2022) for the z-loss;
        Gemma Team, *Gemma 2* (2024) for soft-capping.

    Replaces `F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, weight=weight)`
    and `torch.nn.functional.linear_cross_entropy` (same arguments).
    """
    fn = "linear_cross_entropy"
    if process_group is not None or is_dtensor(linear_weight):
        return _parallel(
            fn, input, linear_weight, target, linear_bias, weight, ignore_index, reduction, label_smoothing,
            z_loss, softcap, None, chunk_size, mask, options, process_group, vocab_start, normalizer,
        )
    if vocab_start is not None:
        raise ValueError(f"{fn}: vocab_start= is for a sharded linear_weight (with process_group=)")
    ii, z, cap, chunk, shapes = _check_args(
        fn, input, linear_weight, target, linear_bias, weight, ignore_index, reduction, z_loss, softcap,
        chunk_size,
    )
    eps = check_label_smoothing(fn, label_smoothing)  # cross_entropy's check
    norm = check_normalizer(fn, normalizer, reduction)
    return target_index_errors(fn, lambda: _linear_loss(
        fn, input, linear_weight, target, linear_bias, weight, ii, reduction, eps, z, cap, None, chunk,
        mask, options, shapes, norm,
    ))


@_accepts_old_spelling
def linear_focal_loss(
    input: Tensor, linear_weight: Tensor, target: Tensor, *, linear_bias: Tensor | None = None,
    weight: Tensor | None = None, reduction: str = "mean", ignore_index: int | None = None,
    options: Any = None, gamma: float = 2.0, z_loss: float = 0.0, softcap: float | None = None,
    chunk_size: int | None = None, mask: Tensor | None = None, process_group: Any = None,
    vocab_start: int | None = None, normalizer: Tensor | float | None = None,
) -> Tensor:
    r"""Focal loss of a linear layer's logits, chunked like `linear_cross_entropy`.

    Equals `focal_loss(l, target, gamma=γ, ignore_index=..., reduction=...)` on the logits $l$
    of `linear_cross_entropy` (bias, softcap) plus the same z-loss:

    $$
    \ell_i = w_{t_i} (1 - p_{i,t_i})^{\gamma} (-\log p_{i,t_i}) + z\, w_{t_i} \operatorname{logsumexp}(l_i)^2,
    $$

    with $1 - p_t = -\operatorname{expm1}(\log p_t)$ and $\log p_t$ computed from the other
    classes, so the loss keeps full relative accuracy at large margins. Ignored and fully
    masked rows, the reductions and `'mean'`'s denominator are those of `linear_cross_entropy`;
    `gamma=0` equals it.

    **Gradient**: $\partial \ell_i / \partial l_{i,c} = A_i (p_{i,c} - [c = t_i])
    + 2 z \operatorname{lse}_i\, p_{i,c}$ with
    $A = (1 - p_t)^\gamma (1 + \gamma p_t r)$, $r = -\log p_t / (1 - p_t)$ ($r = 1$ at $p_t = 1$),
    finite for every $\gamma \ge 0$; then through softcap and the linear layer as in
    `linear_cross_entropy`. Double backward recomputes the whole logits, as in
    `linear_cross_entropy`; a K-dimensional `linear_weight`, a class `weight` that requires
    grad, forward-mode AD and `torch.func` transforms take the unfused `focal_loss` formula, as in
    `linear_cross_entropy`; probability targets raise.

    **Mask.** As in `linear_cross_entropy`: a False row of ``mask`` (broadcastable to
    ``target``) is an ignored row that is never read; a masked ``'mean'`` with no kept row is 0.

    The signature is `linear_cross_entropy`'s (torch's) with `gamma` and without
    `label_smoothing`; the old spelling is accepted for this version with a `DeprecationWarning`.

    Args:
        input: hidden states $(\dots, H)$.
        linear_weight: output-layer matrix $(V, H)$.
        target: class indices of shape `input.shape[:-1]`.
        linear_bias: output-layer bias $(V)$ or `None`. Default: `None`.
        weight: per-class weights $(V)$ or `None` (`'mean'` divides by $\sum w_{t_i}$, as
            `focal_loss`). Default: `None`.
        reduction: `'none'` | `'mean'` | `'sum'`. Default: `'mean'`.
        ignore_index: target value that contributes nothing (`None`: -100). Default: `None`.
        options: as in `linear_cross_entropy`. Default: `None`.
        gamma: focusing parameter $\gamma \ge 0$, finite. Default: `2.0`.
        z_loss: z-loss coefficient $\ge 0$. Default: `0.0`.
        softcap: logit soft-capping $c > 0$ or `None`. Default: `None`.
        chunk_size: rows per chunk or `None` (automatic). Default: `None`.
        mask: bool tensor, True = counts, broadcastable to ``target`` (keyword-only);
            ``None``: every entry counts. Default: ``None``.
        process_group: vocabulary-parallel, as in `linear_cross_entropy`. Default: `None`.
        vocab_start: as in `linear_cross_entropy`. Default: `None`.
        normalizer: replaces `'mean'`'s denominator, as in `linear_cross_entropy`. Default: `None`.

    Returns:
        The loss, as `linear_cross_entropy`.

    Raises:
        ValueError: `gamma` negative, infinite or NaN; and as `linear_cross_entropy`.
        TypeError: `gamma` not a number; and as `linear_cross_entropy`.
        RuntimeError: as `linear_cross_entropy`.
        ValueError: ``mask`` does not broadcast to the unreduced loss (TypeError: not bool).

    Shape:
        input $(\dots, H)$, linear_weight $(V, H)$, linear_bias $(V)$, target $(\dots)$; output
        $()$ or $(\dots)$.

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> x = torch.tensor([[30.0, 0.0]], requires_grad=True)
        >>> W = torch.eye(2)
        >>> SF.linear_focal_loss(x, W, torch.tensor([0]), gamma=0.5)  # exact tail; softmax then log: 0
        tensor(2.8625e-20, grad_fn=...)

    References:
        Lin et al., *Focal Loss for Dense Object Detection* (2017).

    Replaces `focal_loss(F.linear(input, linear_weight, linear_bias), target, weight=weight)`.
    """
    fn = "linear_focal_loss"
    if process_group is not None or is_dtensor(linear_weight):
        return _parallel(
            fn, input, linear_weight, target, linear_bias, weight, ignore_index, reduction, 0.0,
            z_loss, softcap, check_finite_nonnegative(fn, "gamma", gamma), chunk_size, mask, options,
            process_group, vocab_start, normalizer,
        )
    if vocab_start is not None:
        raise ValueError(f"{fn}: vocab_start= is for a sharded linear_weight (with process_group=)")
    ii, z, cap, chunk, shapes = _check_args(
        fn, input, linear_weight, target, linear_bias, weight, ignore_index, reduction, z_loss, softcap,
        chunk_size, focal=True,
    )
    g = check_finite_nonnegative(fn, "gamma", gamma)
    norm = check_normalizer(fn, normalizer, reduction)
    return target_index_errors(fn, lambda: _linear_loss(
        fn, input, linear_weight, target, linear_bias, weight, ii, reduction, 0.0, z, cap, g, chunk, mask,
        options, shapes, norm,
    ))

