"""Cheap finiteness checks and the operators that are never blamed."""

from __future__ import annotations

import math

import torch

from stablelosses._compat import is_fake, is_zero_tensor

# --------------------------------------------------------------------------------------------
# operators that only move, select or fill values: their non-finite outputs never come
# from arithmetic (a -inf here comes from a -inf scalar or input), so they are not checked.

_NOT_ARITHMETIC = frozenset(
    "aten::" + name
    for name in """
    masked_fill masked_fill_ fill fill_ full full_like new_full scalar_tensor where
    empty empty_like empty_strided new_empty new_empty_strided empty_permuted
    zeros zeros_like ones ones_like new_zeros new_ones zero_
    index_fill index_fill_ masked_scatter masked_scatter_
    _efficientzerotensor
    gather index index_select masked_select take take_along_dim
    cat stack hstack vstack clone contiguous lift_fresh lift_fresh_copy detach alias
    constant_pad_nd pad reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d
    slice_scatter select_scatter diagonal_scatter as_strided_scatter
    tril triu tril_ triu_ flip roll repeat repeat_interleave diag diag_embed
    sort topk max min amax amin kthvalue median maximum minimum fmax fmin clamp clamp_
    _local_scalar_dense set_ resize_ unfold split_with_sizes_copy unbind_copy
    """.split()
)

_func_info: dict = {}


def _info(func):
    """Per-operator: (skip?, indices of arguments it writes to)."""
    info = _func_info.get(id(func))  # OpOverload hashes in Python; id() does not
    if info is None:
        schema = func._schema
        name = schema.name
        skip = name in _NOT_ARITHMETIC or getattr(func, "is_view", False)
        writes = tuple(
            i
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        info = (skip, writes, func)  # holding func keeps its id valid
        _func_info[id(func)] = info
    return info


def _unreadable(t: torch.Tensor) -> bool:
    """No values to read (meta, fake), or reading them crashes: forward AD's zero tensors."""
    if t.layout is not torch.strided or t.device.type == "meta":
        return True
    if type(t) is not torch.Tensor and is_fake(t):  # a plain Tensor is never fake: skip the call
        return True
    return is_zero_tensor(t)


def _all_finite(t) -> bool:
    """Exact and cheap: a finite sum means every element is finite; otherwise look closer."""
    if not isinstance(t, torch.Tensor):
        if isinstance(t, (list, tuple)):  # the _foreach_ operators
            return all(_all_finite(x) for x in t)
        return True
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    if _unreadable(t):
        return True
    if t.is_complex():
        t = torch.view_as_real(t)
    s = t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()
    if math.isfinite(s.item()):
        return True
    return bool(torch.isfinite(t).all())


def _snapshot(written) -> dict[int, torch.Tensor]:
    """Copies of the floating tensors an in-place operator is about to overwrite, by ``id``."""
    copies: dict[int, torch.Tensor] = {}
    for t in written:
        for x in (t if isinstance(t, (list, tuple)) else (t,)):
            if (isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())
                    and x.numel() and not _unreadable(x)):
                copies[id(x)] = x.detach().clone()
    return copies


def _has_nan(t) -> bool:
    if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
        return False
    if t.numel() == 0 or _unreadable(t):
        return False
    return bool(torch.isnan(t).any())


def _has_inf(t) -> bool:
    if not t.is_floating_point() or t.numel() == 0 or _unreadable(t):
        return False
    return bool(torch.isinf(t).any())


def _finite_number(x) -> bool:
    try:
        return math.isfinite(x) if isinstance(x, float) else (math.isfinite(x.real) and math.isfinite(x.imag))
    except (TypeError, ValueError):
        return True


def _normalize_op(name: str) -> str:
    name = str(name)
    if "::" not in name and not name.startswith("stablelosses."):
        name = "aten::" + name
    return name

