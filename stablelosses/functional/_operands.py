r"""The operand rules the binary ops share (``safe_div``, ``xlogy``, ``logaddexp``,
``cosine_similarity``): torch's type promotion for tensor/number pairs, the device rule of a
0-dim CPU tensor, and the broadcast check; and integer input → the default float dtype.
"""

from __future__ import annotations

from numbers import Number

import torch
from torch import Tensor

from stablelosses._utils import broadcast_shapes, promote_types

_LOW = (torch.float16, torch.bfloat16)
_WORK = (torch.float32, torch.float64)


def _float_result(x: Tensor) -> Tensor:
    """Integer and bool tensors → the default float dtype (as ``torch.sqrt`` promotes)."""
    if x.is_floating_point():
        return x
    if x.is_complex():
        raise TypeError(f"complex tensors are not supported, got {x.dtype}")
    return x.to(torch.get_default_dtype())


def _category(dtype: torch.dtype) -> int:
    return 2 if dtype.is_floating_point else (0 if dtype == torch.bool else 1)


def _result_type(a: object, b: object) -> torch.dtype:
    """``torch.result_type`` for a tensor/number pair, written with ``promote_types`` so that
    it traces under ``torch.compile`` (``result_type`` itself breaks the graph).

    Priority: dimensioned tensors, then 0-dim tensors, then Python numbers; a lower-priority
    operand only matters when its category (bool < integer < float) is higher.
    """
    groups: list[list[torch.dtype]] = [[], [], []]
    for v in (a, b):
        if isinstance(v, Tensor):
            groups[0 if v.ndim > 0 else 1].append(v.dtype)
        elif isinstance(v, bool):
            groups[2].append(torch.bool)
        elif isinstance(v, int):
            groups[2].append(torch.int64)
        else:
            groups[2].append(torch.get_default_dtype())
    result: torch.dtype | None = None
    for dtypes in groups:
        if not dtypes:
            continue
        d = dtypes[0] if len(dtypes) == 1 else promote_types(dtypes[0], dtypes[1])
        if result is None or _category(d) > _category(result):
            result = d
    assert result is not None
    return result


def _binary_operands(fn: str, a: object, b: object, names: tuple[str, str],
                     two_numbers: bool = False) -> tuple[Tensor, Tensor, torch.dtype]:
    """Tensors for a binary op, with torch's type promotion (ints → default float).

    ``two_numbers``: two Python numbers make a CPU tensor, as ``torch.div(1, 2)`` does;
    otherwise (as ``torch.special.xlogy``) at least one operand must be a tensor.
    """
    if (type(a) is Tensor and type(b) is Tensor and a.dtype == b.dtype and a.dtype in _WORK
            and a.device == b.device):
        # the common case, decided on dtypes and devices alone: nothing to promote or move
        _check_broadcast(fn, a, b, names)
        return a, b, a.dtype
    if not two_numbers and not isinstance(a, Tensor) and not isinstance(b, Tensor):
        raise TypeError(f"{fn}: {names[0]} or {names[1]} must be a torch.Tensor, got "
                        f"{type(a).__name__} and {type(b).__name__}")
    for name, v in zip(names, (a, b)):
        if not isinstance(v, (Tensor, Number)) or isinstance(v, complex):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor or a real number, got {type(v).__name__}")
        if isinstance(v, Tensor) and v.is_complex():
            raise TypeError(f"{fn}: {name} must be a real tensor, got {v.dtype}")
    out_dtype = _result_type(a, b)
    if not out_dtype.is_floating_point:
        out_dtype = torch.get_default_dtype()
    device = a.device if isinstance(a, Tensor) else b.device if isinstance(b, Tensor) else torch.device("cpu")
    if isinstance(a, Tensor) and isinstance(b, Tensor) and a.device != b.device:
        # A 0-dim CPU tensor mixes with any device, as in torch.
        if a.ndim == 0 and a.device.type == "cpu":
            device = b.device
        elif not (b.ndim == 0 and b.device.type == "cpu"):
            raise RuntimeError(
                f"{fn}: expected {names[0]} and {names[1]} on the same device, got "
                f"{a.device} and {b.device}"
            )
    work = torch.float32 if out_dtype in _LOW else out_dtype
    ta, tb = (
        v.to(device=device, dtype=work)
        if isinstance(v, Tensor)
        else torch.tensor(v, dtype=work, device=device)
        for v in (a, b)
    )
    _check_broadcast(fn, ta, tb, names)
    return ta, tb, out_dtype


def _torch_broadcast_words(a: tuple[int, ...], b: tuple[int, ...]) -> str:
    """torch's message for shapes that do not broadcast (``infer_size``: the last mismatch)."""
    ndim = max(len(a), len(b))
    for i in range(ndim - 1, -1, -1):
        da = a[i - ndim + len(a)] if i - ndim + len(a) >= 0 else 1
        db = b[i - ndim + len(b)] if i - ndim + len(b) >= 0 else 1
        if da != db and 1 not in (da, db):
            return (f"The size of tensor a ({da}) must match the size of tensor b ({db}) at "
                    f"non-singleton dimension {i}")
    return "shapes do not broadcast"


def _check_broadcast(fn: str, a: Tensor, b: Tensor, names: tuple[str, str]) -> None:
    """``RuntimeError`` naming ``fn`` and both arguments (torch's words, which name neither, in
    parentheses) unless the shapes of ``a`` and ``b`` broadcast. Equal shapes return at once."""
    if a.shape == b.shape:
        return
    try:
        broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        sa, sb = tuple(a.shape), tuple(b.shape)
        raise RuntimeError(
            f"{fn}: the shapes of {names[0]} {sa} and {names[1]} {sb} do not broadcast "
            f"({_torch_broadcast_words(sa, sb)})"
        ) from None
