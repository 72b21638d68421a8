"""Argument checks and dtype rules shared by the functional API.

Everything here looks at Python-level attributes only (dtype, ndim, shape), never at
tensor values, so it costs no host sync and traces under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from stablelosses._compat import under_transform
from stablelosses._spec import _as_int

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def check_tensor(fn: str, name: str, value: object) -> Tensor:
    """Raise ``TypeError`` unless ``value`` is a tensor."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(value).__name__}")
    return value


class DtypeError(TypeError, RuntimeError):
    """A tensor of a dtype the function does not take: a ``TypeError`` that names the argument,
    and also the ``RuntimeError`` torch raises for it ("... not implemented for 'Long'")."""


def check_floating(fn: str, name: str, value: object) -> Tensor:
    """Raise `DtypeError` (a ``TypeError``) unless ``value`` is a floating-point tensor
    (``TypeError`` for a non-tensor)."""
    t = check_tensor(fn, name, value)
    if not t.is_floating_point():
        raise DtypeError(
            f"{fn}: {name} must be a floating-point tensor "
            f"(float16, bfloat16, float32 or float64), got {t.dtype}"
        )
    return t


def wrap_dim(fn: str, dim: object, ndim: int, name: str = "dim") -> int:
    """Wrap a possibly negative ``dim`` into ``[0, max(ndim, 1))`` or raise ``IndexError``.
    ``dim``: an int as torch's parser takes one (a NumPy integer, a 0-d integer tensor)."""
    d = dim if type(dim) is int else _as_int(dim)
    if d is None:
        raise TypeError(f"{fn}: {name} must be an int, got {type(dim).__name__}")
    dim = d
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise IndexError(
            f"{fn}: {name} out of range (expected to be in range of [{-rank}, {rank - 1}], "
            f"but got {dim})"
        )
    return dim % rank


class DimListError(ValueError, RuntimeError):
    """A list of dimensions that repeats one (or is empty where one is needed): torch's
    reductions raise ``RuntimeError`` ("dim 1 appears multiple times in the list of dims"), and
    ours a ``ValueError`` naming the argument; this is both."""


def wrap_dims(
    fn: str, dims: object, ndim: int, name: str = "dim", allow_empty: bool = True
) -> tuple[int, ...]:
    """An int or a list/tuple of ints, each wrapped by `wrap_dim`; `DimListError` (a
    ``ValueError`` and torch's ``RuntimeError``) on a repeated dimension, and on an empty list
    unless ``allow_empty``."""
    seq = tuple(dims) if isinstance(dims, (list, tuple)) else (dims,)
    if not seq and not allow_empty:
        raise DimListError(f"{fn}: {name} must name at least one dimension, got ()")
    out = tuple(wrap_dim(fn, d, ndim, name) for d in seq)
    if len(set(out)) != len(out):
        raise DimListError(f"{fn}: {name} has repeated dimensions, got {seq}")
    return out


def take(values: Tensor, index: Tensor) -> Tensor:
    """``values[index]`` for a 1-D ``values`` and an integer ``index`` of any shape: an
    ``index_select`` of the flattened index, where ``values[index]`` with a 0-d index reads it on
    the host (``.item()``: a sync, no meta tensors, a graph break) and ``Tensor.take`` has no
    ``vmap`` rule."""
    return values.index_select(0, index.reshape(-1)).view(index.shape)


def compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype the math runs in: float32 for float16/bfloat16, else the input's."""
    return torch.float32 if t.dtype in _LOW_PRECISION else t.dtype


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``, skipped by a Python check when ``t`` already has it (``to`` would return
    ``t`` itself, through the dispatcher: about 1.4 µs, a fixed cost of every tiny call)."""
    return t if t.dtype == dtype else t.to(dtype)


def upcast(t: Tensor) -> Tensor:
    """float16/bfloat16 → float32 (a differentiable cast); other dtypes unchanged."""
    return t.float() if t.dtype in _LOW_PRECISION else t


def autocast_to_float32(t: Tensor) -> bool:
    """True when autocast is on for ``t``'s device and would run a float32-listed op in float32.

    Losses (``mse_loss``, ``cross_entropy``, ``kl_div`` …) are on autocast's float32 list on
    every device, so under autocast the built-ins return float32 for half inputs; outside it
    they return the input's dtype.
    """
    device_type = t.device.type
    if device_type not in ("cpu", "cuda", "xpu", "mps"):
        return False
    return torch.is_autocast_enabled(device_type)


def loss_out_dtype(t: Tensor) -> torch.dtype:
    """The dtype a loss built-in returns for input ``t`` in the current autocast state."""
    if t.dtype in _LOW_PRECISION and autocast_to_float32(t):
        return torch.float32
    return t.dtype


def operand_dtypes(a: Tensor, b: Tensor) -> tuple[torch.dtype, torch.dtype]:
    """``(compute dtype, returned dtype)`` of a loss of two tensors: their promoted dtype, float32
    for the math when that is float16/bfloat16, and float32 for the result under autocast (as
    ``loss_out_dtype``). ``b`` may be an integer tensor that joins a float ``a``."""
    dtype = promote_types(a.dtype, b.dtype)
    if dtype not in _LOW_PRECISION:
        return dtype, dtype
    return torch.float32, torch.float32 if autocast_to_float32(a) else dtype


def divide(total: Tensor, denominator: Tensor | float) -> Tensor:
    """``total / denominator``, and 0 with gradient 0 (for ``total`` and the denominator) where
    the denominator is 0: the sum over no tokens is 0, there is nothing to average. A tensor
    denominator is cast to ``total``'s dtype and device; its value is never read on the host."""
    if not isinstance(denominator, Tensor):
        if denominator == 0:  # a Python number: the branch reads no tensor
            return torch.where(torch.ones_like(total, dtype=torch.bool), 0.0, total)
        return total / denominator
    den = denominator.to(device=total.device, dtype=total.dtype)
    zero = den == 0
    # double where: the division never sees the 0, so no inf·0 reaches a gradient
    return torch.where(zero, 0.0, total / torch.where(zero, 1.0, den))


def reduce(
    loss: Tensor, reduction: str, mask: Tensor | None = None, *, weight: Tensor | None = None,
    masked: bool = False, overflow_safe: bool = False, normalizer: Tensor | float | None = None,
) -> Tensor:
    """The one reduction of every loss: a checked ``'none'``, ``'mean'`` or ``'sum'``.

    ``mask`` (bool, True = counts, broadcastable to ``loss``): its False entries are 0 in
    ``'none'`` and left out of ``'sum'`` and ``'mean'`` (selected, not multiplied: a NaN there
    is never read). ``weight``: the ``'mean'``'s weight per entry instead of 1 (the class
    losses' ``w_t``, 0 on ignored rows), so ``'mean'`` is ``Σ ℓ / Σ weight``. ``masked`` (a
    mask was applied before, as the class losses' ignored rows): a ``'mean'`` over nothing is 0,
    as with ``mask``, where torch's own gives NaN. ``overflow_safe``: where ``Σ ℓ`` overflows
    but the mean does not (label smoothing near ``±1e37``), the mean is ``Σ (ℓ / Σ weight)``
    (N-sized, no sync). ``normalizer`` (checked by ``_spec.check_normalizer``) replaces the
    ``'mean'``'s denominator: ``Σ ℓ / normalizer``, 0 with gradient 0 where it is 0."""
    if mask is not None:
        m = mask.to(loss.device)
        loss = torch.where(m, loss, 0.0)
        masked = True
        if reduction == "mean" and weight is None:
            weight = m.expand(loss.shape)
    if reduction == "sum":
        return loss.sum()
    if reduction != "mean":
        return loss
    if normalizer is not None:
        out = divide(loss.sum(), normalizer)
        if not overflow_safe:
            return out
        return torch.where(torch.isinf(out), divide(loss, normalizer).sum(), out)
    if weight is None:
        return loss.mean()
    total = weight.sum()
    if masked:
        total = torch.where(total == 0, 1.0, total)  # the mean over nothing: 0
    out = loss.sum() / total
    if not overflow_safe:
        return out
    scaled = (loss / torch.where(total == 0, 1.0, total)).sum()
    return torch.where(torch.isinf(out) & (total != 0), scaled, out)


def masked_mean_over(x: Tensor, mask: Tensor, dims: tuple[int, ...], keepdim: bool) -> Tensor:
    """The mean of ``x`` over its ``mask`` (True = counts) along ``dims``; 0 (gradient 0) where
    no entry counts."""
    total = torch.where(mask, x, 0.0).sum(dims, keepdim=keepdim)
    count = mask.expand(x.shape).sum(dims, keepdim=keepdim)
    return total / count.clamp_min(1)


def write_out(fn: str, result: Tensor, out: object, *inputs: object) -> Tensor:
    """torch's ``out=``: ``result`` written into ``out`` (resized, with torch's warning and its
    casting rule, by an aten op that takes ``out=``), and ``out`` returned. As in torch, no
    gradient flows through ``out=``: ``RuntimeError`` when grad mode is on and an input
    requires grad."""
    if not isinstance(out, Tensor):
        raise TypeError(f"{fn}: out must be a torch.Tensor or None, got {type(out).__name__}")
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (*inputs, out)):
        raise RuntimeError(
            f"{fn}(): functions with out=... arguments don't support automatic differentiation, "
            "but one of the arguments requires grad."
        )
    return torch.mul(result.detach(), 1, out=out)  # × 1 keeps -0.0 and NaN bits (+ 0 would not)


def sum_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Undo broadcasting in a backward: sum ``grad`` down to ``shape``."""
    return grad if grad.shape == shape else grad.sum_to_size(shape)


def legacy_reduction(size_average: object, reduce: object, reduction: str) -> str:
    """torch's mapping of the deprecated ``size_average``/``reduce`` pair onto ``reduction``
    (``legacy_get_string``): when either is given, it overrides ``reduction`` (unchecked, as
    torch ignores it then) and torch's deprecation ``UserWarning`` is emitted."""
    if size_average is None and reduce is None:
        return reduction
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    resolved = "none" if not reduce else "mean" if size_average else "sum"
    # torch's deprecation warning, word for word (legacy_get_string's); eager only: Dynamo cannot
    # trace warnings.warn (fullgraph=True raised Unsupported where torch's own call compiles)
    if not torch.compiler.is_compiling():
        warnings.warn(
            f"size_average and reduce args will be deprecated, please use reduction='{resolved}' instead.",
            UserWarning, stacklevel=3,
        )
    return resolved


_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling


def no_autocast(device_type: str) -> Any:
    """Autocast disabled on this device type (a null context where autocast does not exist: meta)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def inplace_ok(*tensors: Tensor | None) -> bool:
    """In-place updates of a fresh tensor are safe: no double backward, no vmap wrappers.

    Under vmap (also the batched-gradient vmap of gradcheck) the row scale may be batched
    while the saved log-probabilities are not; an in-place op cannot grow its target.
    """
    if _grad_enabled() or _compiling():
        return False  # compiled: functionalized and fused anyway
    return not under_transform(*tensors)


def check_same_device(fn: str, mask: Tensor, device: torch.device, what: str = "input") -> None:
    """Raise as torch does when ``mask`` is on another device than ``what`` (a 0-dim CPU mask
    goes with any device, as a CPU scalar tensor does in torch's ops): never moved silently."""
    if mask.device != device and not (mask.dim() == 0 and mask.device.type == "cpu"):
        raise RuntimeError(
            f"{fn}: expected all tensors to be on the same device, but mask is on {mask.device} "
            f"and {what} on {device}"
        )


def broadcast_shapes(*shapes: Sequence[int]) -> torch.Size:
    """``torch.broadcast_shapes`` for concrete shapes, in plain Python.

    torch's version guards every size for symbolic shapes (~30 µs a call, the fixed cost of a
    tiny loss); traced code takes torch's, which handles symbolic sizes. Raises the same
    ``RuntimeError`` as torch's when the shapes do not broadcast.
    """
    if torch.compiler.is_compiling():
        return torch.broadcast_shapes(*shapes)
    first = tuple(shapes[0])
    if all(tuple(s) == first for s in shapes[1:]):
        return torch.Size(first)
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for s in shapes:
        off = ndim - len(s)
        for i, d in enumerate(s):
            o = out[off + i]
            if d != o:
                if o == 1:
                    out[off + i] = d
                elif d != 1:
                    raise RuntimeError(
                        f"Shape mismatch: objects cannot be broadcast to a single shape.  Mismatch is "
                        f"between {o} and {d} at dimension {off + i - ndim}"
                    )
    return torch.Size(out)


def broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without growing it."""
    try:
        return broadcast_shapes(shape, target) == tuple(target)
    except RuntimeError:
        return False


_PROMOTED = {
    (a, b): torch.promote_types(a, b)
    for a in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
              torch.float16, torch.bfloat16, torch.float32, torch.float64)
    for b in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
              torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


def promote_types(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types`` from a table built once (torch's is a dispatcher call)."""
    if torch.compiler.is_compiling():
        return torch.promote_types(a, b)
    found = _PROMOTED.get((a, b))
    return torch.promote_types(a, b) if found is None else found


class TargetIndexError(IndexError, RuntimeError):
    """A class index out of range in a fused linear loss: torch's ``IndexError`` ("Target 7 is
    out of bounds.", as ``nll_loss`` and ``F.linear_cross_entropy`` raise it), and also the
    ``RuntimeError`` of the gather that finds it."""


_OUT_OF_BOUNDS = re.compile(r"index (-?\d+) is out of bounds for dimension")


def target_index_errors(fn: str, call: Callable[[], Any]) -> Any:
    """``call()``, with a gather's out-of-range ``RuntimeError`` raised again as
    `TargetIndexError` in torch's words, and ``nll_loss``'s ``IndexError`` with ``fn`` named.
    Traced code calls it plainly."""
    if torch.compiler.is_compiling():
        return call()
    try:
        return call()
    except IndexError as e:  # nll_loss's own words name no function
        if isinstance(e, TargetIndexError):
            raise
        raise TargetIndexError(f"{fn}: {e}") from None
    except RuntimeError as e:
        found = _OUT_OF_BOUNDS.search(str(e))
        if found is None or isinstance(e, TargetIndexError):
            raise
        raise TargetIndexError(f"{fn}: Target {found.group(1)} is out of bounds.") from None
