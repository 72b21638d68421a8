"""Fused Triton kernels behind the public functions (``stablelosses.set_backend("triton")``).

This package's ``__init__`` never imports triton: the dispatch below answers ``None`` ("take the
torch path") unless ``stablelosses._backend.use_triton`` selects the kernels, and only then
imports ``stablelosses._triton.ops`` (which imports triton).

A dispatch function takes the public function's arguments and returns the result, or ``None``
for every call outside what the kernels cover; the torch path then runs, validates and raises
as usual. The selection looks at the backend, device, dtype, shapes and argument types only,
never at tensor values.

Kernels cover now (float32, float16, bfloat16):

* class-index ``cross_entropy`` and ``focal_loss`` on ``(N, C)`` logits with ``weight`` (not
  requiring grad), ``ignore_index``, ``label_smoothing``, ``mask=`` and every reduction;
* ``softmax``, ``log_softmax`` and ``logsumexp`` over the last dimension, without ``mask=`` or
  ``dtype=``;
* ``sigmoid_focal_loss`` with input and target of one shape and dtype (the target not
  requiring grad), every reduction, without ``mask=``.
"""

from __future__ import annotations

from numbers import Real

import torch
from torch import Tensor

from stablelosses._backend import use_triton
from stablelosses._spec import REDUCTIONS
from stablelosses._utils import broadcasts_to, loss_out_dtype, operand_dtypes

_INDEX_DTYPES = (torch.int64, torch.uint8)


def _real(v: object) -> float | None:
    """``v`` as a float when it is a real number (not a bool), else ``None``."""
    return None if isinstance(v, bool) or not isinstance(v, Real) else float(v)


def class_index_loss(
    input: object, target: object, weight: object, ignore_index: object, reduction: object,
    label_smoothing: object = 0.0, gamma: object = 0.0, mask: object = None,
    legacy: bool = False,
) -> Tensor | None:
    """``cross_entropy`` (``gamma = 0``) or ``focal_loss`` through the kernels, or ``None``.

    ``legacy``: ``size_average``/``reduce`` were given (the torch path maps them).
    """
    if legacy or not isinstance(input, Tensor) or not isinstance(target, Tensor):
        return None
    if not use_triton(input) or input.dim() != 2 or input.numel() == 0:
        return None
    if target.dtype not in _INDEX_DTYPES or target.shape != input.shape[:1]:
        return None
    if target.device != input.device or not isinstance(reduction, str) or reduction not in REDUCTIONS:
        return None
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        return None
    g, eps = _real(gamma), _real(label_smoothing)
    if g is None or not 0.0 <= g < float("inf") or eps is None or not 0.0 <= eps <= 1.0:
        return None
    w = None
    if weight is not None:
        if not isinstance(weight, Tensor) or not weight.is_floating_point() or weight.requires_grad:
            return None  # weight's own gradient: the torch path
        if weight.shape != input.shape[1:] or weight.device != input.device:
            return None
        w = weight.to(torch.float32).contiguous()
    keep = None
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.device != input.device:
            return None
        if not broadcasts_to(mask.shape, input.shape[:1]):
            return None
        keep = mask.expand(input.shape[:1]).contiguous()
    from stablelosses._triton import ops

    x = input if input.stride(-1) == 1 else input.contiguous()
    out = ops.index_loss(x, target.long().contiguous(), w, keep, ignore_index, g, eps, reduction)
    return out.to(loss_out_dtype(input))


def _last_dim(input: Tensor, dim: object) -> bool:
    """``dim`` (an int, or for logsumexp a one-element sequence of ints) names the last dim."""
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if isinstance(dim, bool) or not isinstance(dim, int):
        return False
    return dim in (-1, input.dim() - 1)


def softmax_like(kind: str, input: object, dim: object, mask: object = None, dtype: object = None,
                 keepdim: object = False) -> Tensor | None:
    """``softmax``, ``log_softmax`` or ``logsumexp`` (``kind``) through the kernels, or ``None``."""
    if mask is not None or dtype is not None or not isinstance(input, Tensor) or input.dim() == 0:
        return None
    if not use_triton(input) or input.numel() == 0 or not _last_dim(input, dim):
        return None
    if not isinstance(keepdim, bool) or (input.device.type == "cuda" and torch.is_autocast_enabled("cuda")):
        return None  # CUDA autocast returns float32 softmax: the torch path
    from stablelosses._triton import ops

    x = input.reshape(-1, input.shape[-1])
    x = x if x.stride(-1) == 1 else x.contiguous()
    if kind == "logsumexp":
        shape = input.shape[:-1] + ((1,) if keepdim else ())
        return ops.softmax_family(x, ops.LOGSUMEXP).reshape(shape)
    mode = ops.SOFTMAX if kind == "softmax" else ops.LOG_SOFTMAX
    return ops.softmax_family(x, mode).reshape(input.shape)


def sigmoid_focal_loss(input: object, target: object, alpha: object, gamma: object, reduction: object,
                       mask: object = None) -> Tensor | None:
    """``sigmoid_focal_loss`` through the kernels, or ``None``."""
    if mask is not None or not isinstance(input, Tensor) or not isinstance(target, Tensor):
        return None
    if not use_triton(input) or target.dtype != input.dtype or target.shape != input.shape:
        return None
    if target.requires_grad or target.device != input.device or input.numel() == 0:
        return None
    a, g = _real(alpha), _real(gamma)
    if a is None or not (0.0 <= a <= 1.0 or a == -1.0) or g is None or not 0.0 <= g < float("inf"):
        return None
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        return None
    from stablelosses._triton import ops

    out = ops.sigmoid_focal(input.contiguous(), target.contiguous(), a, g, reduction)
    return out.to(operand_dtypes(input, target)[1])
