"""What a fused linear loss call settles around its chunk loop, shared by the one-process and
the vocabulary-parallel forms: torch's ``options`` (rows per chunk, compute dtype) and the
reduction of the per-row outputs."""

from __future__ import annotations

import math

import torch
from torch import Tensor

# torch >= 2.13's options class (None on older torch, where ``options`` must be None)
_OPTIONS_CLASS = getattr(torch.nn, "LinearCrossEntropyOptions", None)


def _aspect_ratio_rows(rows: int, h: int, v: int, factor: int) -> int:
    """torch's documented ``chunking_method='aspect_ratio:k'``: a chunk's logits about as large
    as the input, divided by ``k`` (the next power of two of ``N / ceil(V / H)``, over ``k``)."""
    per = -(-rows // max(1, -(-v // max(h, 1))))
    return max(1, min((1 << max(per - 1, 0).bit_length()) // factor, rows))


def resolve_options(
    fn: str, options: object, chunk: int, rows: int, h: int, v: int, cd: torch.dtype
) -> tuple[int, torch.dtype]:
    """``(chunk, compute dtype)`` from ``options`` (a ``torch.nn.LinearCrossEntropyOptions``).

    ``batch_chunk_size`` and ``chunking_method`` give the rows per chunk as in torch (``'auto'``
    keeps ours); ``acc_dtype`` float64 computes in float64, float32 or None keep the compute
    dtype, a narrower one raises (the fused loss never accumulates below float32).
    ``acc_policy`` and ``allow_retain_graph`` change nothing: the weight gradient is always
    accumulated in the compute dtype and the backward can always be run twice.
    """
    if options is None:
        return chunk, cd
    if _OPTIONS_CLASS is None or not isinstance(options, _OPTIONS_CLASS):
        raise TypeError(
            f"{fn}: options must be None or a torch.nn.LinearCrossEntropyOptions (torch >= 2.13), "
            f"got {type(options).__name__}"
        )
    size, method = options.batch_chunk_size, options.chunking_method
    by_method = -1
    if method is None:
        by_method = max(rows, 1) if size is None else size  # torch: one chunk unless sized
    elif method != "auto":
        _, _, k = method.partition(":")
        by_method = _aspect_ratio_rows(rows, h, v, int(k or 1))
    if size is not None and by_method not in (-1, size):
        raise ValueError(
            f"{fn}: options.batch_chunk_size={size} and options.chunking_method={method!r} give "
            f"different chunk sizes ({size} vs {by_method}); pass only one"
        )
    by_options = size if size is not None else by_method
    if by_options != -1 and chunk != -1 and by_options != chunk:
        raise ValueError(
            f"{fn}: chunk_size={chunk} and options (batch_chunk_size / chunking_method: "
            f"{by_options} rows) disagree; pass only one"
        )
    if by_options != -1:
        chunk = by_options
    acc = options.acc_dtype
    if acc == torch.float64:
        cd = torch.float64
    elif acc not in (None, torch.float32):
        raise ValueError(
            f"{fn}: options.acc_dtype={acc} is not supported: the fused loss computes and "
            "accumulates in float32 at least (pass acc_dtype=None, torch.float32 or torch.float64)"
        )
    return chunk, cd


def reduce_rows(
    total: Tensor, row_w: Tensor, reduction: str, normalizer: Tensor | float | None, masked: bool
) -> Tensor:
    """The reduced loss from ``total = Σ ℓ`` and the row weights: ``'sum'`` the total; ``'mean'``
    ``total / Σ w_t`` (no counted row: NaN as torch, 0 with a mask, gradient 0 either way), or
    ``total / normalizer`` (a normalizer of 0 gives 0 with gradient 0). No host read."""
    if reduction == "sum":
        return total
    if normalizer is None:
        den = row_w.sum()
    else:
        den = torch.as_tensor(normalizer, dtype=total.dtype, device=total.device)
    some = den != 0
    empty = 0.0 if masked or normalizer is not None else math.nan
    return torch.where(some, total / torch.where(some, den, 1.0), empty)
