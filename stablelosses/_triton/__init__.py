"""Fused Triton kernels behind the public functions (``stablelosses.set_backend("triton")``).

The kernels sit on top of the core. Importing this package (``stablelosses/__init__.py`` does)
registers one function per op into the core's backend table
(``stablelosses._backend.register_kernel``); it never imports triton. A public function, after
its own argument checks, asks the table (``stablelosses._backend.dispatch``); the table answers
``None`` ("take the torch path") unless ``stablelosses._backend.use_triton`` selects the kernels,
and only then is ``stablelosses._triton.ops`` (which imports triton) imported.

A registered function takes the public function's **checked** arguments and returns the result,
or ``None`` for every call outside what the kernels cover. The selection looks at the backend,
device, dtype, shapes and argument types only, never at tensor values. Nothing here imports
``stablelosses.functional``: a double backward reruns the public function that the wrapper
hands in (``torch_path``) under the torch backend.

Kernels cover now (float32, float16, bfloat16):

* class-index ``cross_entropy`` and ``focal_loss`` on ``(N, C)`` logits with ``weight`` (not
  requiring grad), ``ignore_index``, ``label_smoothing``, ``mask=`` and every reduction;
* ``softmax``, ``log_softmax`` and ``logsumexp`` over the last dimension, without ``mask=`` or
  ``dtype=``;
* ``sigmoid_focal_loss`` with input and target of one shape and dtype (the target not
  requiring grad), ``mask=``, every reduction;
* ``linear_chunk_head``: the fused linear losses' row step (a chunk of logits → per-row loss and
  the logit gradient, see `linear_chunk_head`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from stablelosses._backend import backend, register_kernel
from stablelosses._utils import broadcasts_to, loss_out_dtype, operand_dtypes

_INDEX_DTYPES = (torch.int64, torch.uint8)
_REDUCTIONS = ("none", "mean", "sum")


def _index_keep(mask: object, input: Tensor) -> Tensor | None | bool:
    """The row mask expanded to ``(N,)`` (contiguous), ``None`` without one, ``False`` when the
    kernels do not cover it."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.device != input.device:
        return False
    if not broadcasts_to(mask.shape, input.shape[:1]):
        return False
    return mask.expand(input.shape[:1]).contiguous()


def _index_loss(
    input: Tensor, target: object, weight: object, ignore_index: int, reduction: str,
    eps: float, gamma: float, mask: object, rows_fn: Callable[[Tensor, Tensor | None], Tensor],
) -> Tensor | None:
    """Class-index ``cross_entropy`` (``gamma = 0``) or ``focal_loss`` through the kernels, or
    ``None``. ``rows_fn(x, keep)``: the torch path's per-row loss (for a double backward)."""
    if input.dim() != 2 or input.numel() == 0 or not isinstance(target, Tensor):
        return None
    if target.dtype not in _INDEX_DTYPES or target.shape != input.shape[:1] or target.device != input.device:
        return None
    w = None
    if weight is not None:
        if not isinstance(weight, Tensor) or not weight.is_floating_point() or weight.requires_grad:
            return None  # weight's own gradient: the torch path
        if weight.shape != input.shape[1:] or weight.device != input.device:
            return None
        w = weight.to(torch.float32).contiguous()
    keep = _index_keep(mask, input)
    if keep is False:
        return None
    from stablelosses._triton import ops

    x = input if input.stride(-1) == 1 else input.contiguous()
    t = target.long().contiguous()
    out = ops.index_loss(x, t, w, keep, ignore_index, gamma, eps, reduction, rows_fn)  # type: ignore[arg-type]
    return out.to(loss_out_dtype(input))


def _torch_rows(torch_path: Callable[..., Tensor], *args: Any, **kwargs: Any
                ) -> Callable[[Tensor, Tensor | None], Tensor]:
    """``rows_fn`` of `_index_loss`: the torch path's unreduced loss of ``x`` (its other arguments
    ``args``/``kwargs``) with the row mask ``keep``, the kernels off."""

    def rows(x: Tensor, keep: Tensor | None) -> Tensor:
        with backend("torch"):
            return torch_path(x, *args, reduction="none", mask=keep, **kwargs)

    return rows


def cross_entropy(
    input: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, reduction: str,
    label_smoothing: float, mask: Tensor | None, *, torch_path: Callable[..., Tensor],
) -> Tensor | None:
    """The kernel of ``cross_entropy`` (class indices), or ``None``."""
    rows = _torch_rows(torch_path, target, weight, ignore_index=ignore_index, label_smoothing=label_smoothing)
    return _index_loss(input, target, weight, ignore_index, reduction, label_smoothing, 0.0, mask, rows)


def focal_loss(
    input: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, reduction: str,
    gamma: float, mask: Tensor | None, *, torch_path: Callable[..., Tensor],
) -> Tensor | None:
    """The kernel of ``focal_loss``, or ``None``."""
    rows = _torch_rows(torch_path, target, gamma, weight, ignore_index=ignore_index)
    return _index_loss(input, target, weight, ignore_index, reduction, 0.0, gamma, mask, rows)


def _softmax_like(mode_name: str, input: Tensor, dim: int, mask: object, dtype: object) -> Tensor | None:
    if mask is not None or dtype is not None or input.dim() == 0 or input.numel() == 0:
        return None
    if dim != input.dim() - 1:
        return None
    if input.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return None  # CUDA autocast returns float32 softmax: the torch path
    from stablelosses._triton import ops

    x = input.reshape(-1, input.shape[-1])
    x = x if x.stride(-1) == 1 else x.contiguous()
    return ops.softmax_family(x, getattr(ops, mode_name)).reshape(input.shape)


def softmax(input: Tensor, dim: int, mask: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    """The kernel of ``softmax`` (``dim`` wrapped), or ``None``."""
    return _softmax_like("SOFTMAX", input, dim, mask, dtype)


def log_softmax(input: Tensor, dim: int, mask: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    """The kernel of ``log_softmax`` (``dim`` wrapped), or ``None``."""
    return _softmax_like("LOG_SOFTMAX", input, dim, mask, dtype)


def logsumexp(input: Tensor, dims: tuple[int, ...], keepdim: bool) -> Tensor | None:
    """The kernel of ``logsumexp`` (``dims`` wrapped), or ``None``."""
    if input.dim() == 0 or input.numel() == 0 or tuple(dims) != (input.dim() - 1,):
        return None
    if input.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return None
    from stablelosses._triton import ops

    x = input.reshape(-1, input.shape[-1])
    x = x if x.stride(-1) == 1 else x.contiguous()
    shape = input.shape[:-1] + ((1,) if keepdim else ())
    return ops.softmax_family(x, ops.LOGSUMEXP).reshape(shape)


def sigmoid_focal_loss(
    input: Tensor, target: Tensor, alpha: float, gamma: float, reduction: str, mask: Tensor | None,
    *, torch_path: Callable[..., Tensor],
) -> Tensor | None:
    """The kernel of ``sigmoid_focal_loss``, or ``None``."""
    if target.dtype != input.dtype or target.shape != input.shape or target.device != input.device:
        return None
    if target.requires_grad or input.numel() == 0:
        return None
    keep = None
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.device != input.device:
            return None
        if not broadcasts_to(mask.shape, input.shape):
            return None
        keep = mask.expand(input.shape).contiguous()

    def rows(x: Tensor) -> Tensor:
        with backend("torch"):
            return torch_path(x, target, alpha, gamma, "none", mask=keep)

    from stablelosses._triton import ops

    out = ops.sigmoid_focal(input.contiguous(), target.contiguous(), keep, alpha, gamma, reduction, rows)
    return out.to(operand_dtypes(input, target)[1])


def linear_chunk_head(
    logits: Tensor, target: Tensor, class_weight: Tensor | None, ignore_index: int,
    label_smoothing: float, gamma: float | None, row_scale: Tensor | None,
) -> Any:
    """The fused linear losses' row step through the kernels, or ``None`` where they do not
    cover the call (then the engine runs its torch head).

    Args:
        logits: ``(n, V)`` float32 chunk of logits **the library owns** (the chunk's matmul
            output): with ``row_scale`` given the gradient is written into it in place.
        target: ``(n,)`` int64 class indices (``ignore_index`` rows are invalid).
        class_weight: ``(V,)`` class weights, or ``None``.
        ignore_index: the ignored class index.
        label_smoothing: ε in ``[0, 1]`` (cross-entropy only).
        gamma: ``None`` for cross-entropy, the focal γ ≥ 0 for focal loss.
        row_scale: ``(n,)`` or ``(n, 1)`` weight of each row's loss in the gradient, or ``None``
            for the value alone (no gradient is written).

    Returns:
        ``stablelosses._triton.ops.RowStep(loss, row_w, grad)``: the per-row loss ``(n,)``
        float32 (0 on invalid rows), the row weight (``w_t``, or 1, on valid rows, else 0: the
        ``'mean'`` denominator) and ``grad = row_scale · d loss / d logits`` (the ``logits``
        buffer itself) or ``None``; or ``None`` for a call the kernels do not cover.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32:
        return None
    if gamma is not None and label_smoothing != 0.0:
        return None
    if target.shape != logits.shape[:1] or target.dtype not in _INDEX_DTYPES or logits.stride(-1) != 1:
        return None
    from stablelosses._triton import ops

    cw = None if class_weight is None else class_weight.to(torch.float32).contiguous()
    rs = None if row_scale is None else row_scale.reshape(-1).to(torch.float32).contiguous()
    return ops.row_step(logits, target.long().contiguous(), cw, ignore_index, label_smoothing,
                        0.0 if gamma is None else float(gamma), rs)


register_kernel("cross_entropy", cross_entropy)
register_kernel("focal_loss", focal_loss)
register_kernel("softmax", softmax)
register_kernel("log_softmax", log_softmax)
register_kernel("logsumexp", logsumexp)
register_kernel("sigmoid_focal_loss", sigmoid_focal_loss)
register_kernel("linear_chunk_head", linear_chunk_head)
