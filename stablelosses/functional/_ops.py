r"""The elementwise stable ops: drop-in replacements for ``torch.sqrt``, ``torch.div`` and
``torch.special.xlogy`` with finite, defined gradients at their singular points, and the
binary-operand promotion they share (`stablelosses.functional._softmax` holds the softmax family).
"""

from __future__ import annotations

from numbers import Number

import torch
from torch import Tensor

from stablelosses._autograd.div import _safe_div
from stablelosses._autograd.sqrt import _safe_sqrt
from stablelosses._autograd.xlogy import _xlogy
from stablelosses._utils import broadcast_shapes, check_tensor, compute_dtype, promote_types

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
        if a.shape != b.shape:
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
    if ta.shape != tb.shape:
        _check_broadcast(fn, ta, tb, names)
    return ta, tb, out_dtype


def _check_broadcast(fn: str, a: Tensor, b: Tensor, names: tuple[str, str]) -> None:
    try:
        broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        raise RuntimeError(
            f"{fn}: the shapes of {names[0]} {tuple(a.shape)} and {names[1]} {tuple(b.shape)} "
            "do not broadcast"
        ) from None


def safe_sqrt(input: Tensor) -> Tensor:
    r"""Square root whose gradient at 0 is 0 instead of ``inf``.

    $$ \operatorname{safe\_sqrt}(x) = \sqrt{x} $$

    **Gradient.** $\frac{1}{2\sqrt{x}}$ for $x > 0$; at $x = 0$ it is defined as $0$, the
    minimal-norm subgradient (``torch.sqrt`` gives ``inf``, and ``inf · 0`` from an upstream
    zero is the ``SqrtBackward0 returned nan values`` error). Negative input gives NaN in value
    and gradient, as ``torch.sqrt``; NaN stays NaN. Forward mode (``torch.func.jvp``,
    ``jacfwd``, ``hessian``, ``torch.autograd.forward_ad``) uses the same derivative: the
    tangent at $x = 0$ is $0$. Double backward is finite at 0.

    Args:
        input: tensor of any shape. Integer tensors are promoted to the default float dtype;
            float16/bfloat16 are computed in float32 and returned in their own dtype.

    Returns:
        Tensor of the same shape as ``input``.

    Raises:
        TypeError: ``input`` is not a tensor.

    Example:
        >>> import torch
        >>> from stablelosses.functional import safe_sqrt
        >>> x = torch.zeros(2, requires_grad=True)
        >>> torch.sqrt(x).sum().backward(); x.grad
        tensor([inf, inf])
        >>> x.grad = None
        >>> safe_sqrt(x).sum().backward(); x.grad
        tensor([0., 0.])

    Replaces ``torch.sqrt``.
    """
    x = _float_result(check_tensor("safe_sqrt", "input", input))
    out_dtype = x.dtype
    return _safe_sqrt(x.to(compute_dtype(x))).to(out_dtype)


def safe_div(input: Tensor | float, other: Tensor | float, *, fill: float = 0.0) -> Tensor:
    r"""Division that returns ``fill`` where the divisor is 0, with zero gradients there.

    $$ \operatorname{safe\_div}(a, b) = \begin{cases} a / b & b \ne 0 \\ \text{fill} & b = 0 \end{cases} $$

    Like TensorFlow's ``divide_no_nan`` (with a configurable ``fill``), except that a NaN
    ``input`` stays NaN even where ``other == 0`` (a NaN is an upstream bug and is not hidden).
    Broadcasting and type promotion as ``torch.div``.

    **Gradient.** Where ``other == 0`` both gradients are defined as $0$ (for a finite incoming
    gradient). Elsewhere
    $\partial/\partial a = g / b$ and $\partial/\partial b = -(g/b)\cdot(a/b)$, with the quotient
    reused from the output (never $a/b^2$, which overflows first). The popular idiom
    ``torch.where(b != 0, a / b, 0)`` has the right value but a NaN gradient, because the
    discarded branch's ``inf`` meets a zero gradient in ``DivBackward``. Forward mode uses the
    same partial derivatives (tangent $\dot a / b - \dot b\,(a/b)/b$, $0$ where $b = 0$).

    Args:
        input: dividend (tensor or number).
        other: divisor (tensor or number), broadcastable with ``input``.
        fill: value where ``other == 0``. Default: ``0.0``.

    Returns:
        Tensor of the broadcast shape, in the dtype ``torch.div`` returns; two Python numbers
        give a 0-dim tensor of the default dtype, as ``torch.div(1, 2)``.

    Raises:
        TypeError: an operand is neither a tensor nor a real number, or ``fill`` is not a real
            number.
        RuntimeError: the shapes do not broadcast.

    Example:
        >>> import torch
        >>> from stablelosses.functional import safe_div
        >>> a = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> b = torch.tensor([0.0, 4.0], requires_grad=True)
        >>> torch.where(b != 0, a / b, 0).sum().backward(); a.grad
        tensor([   nan, 0.2500])
        >>> a.grad = b.grad = None
        >>> safe_div(a, b).sum().backward(); a.grad, b.grad
        (tensor([0.0000, 0.2500]), tensor([ 0.0000, -0.1250]))

    Replaces ``torch.div`` and ``torch.where(b != 0, a / b, fill)``.
    """
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        raise TypeError(f"safe_div: fill must be a real number, got {type(fill).__name__}")
    a, b, out_dtype = _binary_operands("safe_div", input, other, ("input", "other"), two_numbers=True)
    return _safe_div(a, b, float(fill)).to(out_dtype)


def xlogy(input: Tensor | float, other: Tensor | float) -> Tensor:
    r"""``input · log(other)``, 0 where ``input == 0``, with finite gradients at 0 · log 0.

    $$
    \operatorname{xlogy}(x, y) =
    \begin{cases} 0 & x = 0,\ y \text{ not NaN} \\ x \log y & \text{otherwise} \end{cases}
    $$

    The forward value is exactly ``torch.special.xlogy`` (broadcasting, type promotion, NaN
    ``other`` gives NaN).

    **Gradient.** $\partial/\partial y = x / y$, defined $0$ where $x = 0$ (also at $y = 0$,
    where torch gives $0/0$ = NaN). $\partial/\partial x = \log y$, defined $0$ where $x = 0$
    and $y \le 0$, exactly torch's value (for $x = 0$, $y > 0$ it is $\log y$, as torch).
    Forward mode (``jvp``, ``jacfwd``, ``hessian``) uses the same partial derivatives.

    Args:
        input: the factor ``x`` (tensor or number).
        other: the argument of the log ``y`` (tensor or number), broadcastable with ``input``.

    Returns:
        Tensor of the broadcast shape, in the dtype ``torch.special.xlogy`` returns.

    Raises:
        TypeError: neither operand is a tensor.
        RuntimeError: the shapes do not broadcast.

    Example:
        >>> import torch
        >>> from stablelosses.functional import xlogy
        >>> p = torch.tensor([0.0, 0.5], requires_grad=True)
        >>> (p * torch.log(p)).sum().backward(); p.grad
        tensor([   nan, 0.3069])
        >>> p.grad = None
        >>> xlogy(p, p).sum().backward(); p.grad
        tensor([0.0000, 0.3069])

    Replaces ``torch.special.xlogy`` and ``x * torch.log(y)``.
    """
    x, y, out_dtype = _binary_operands("xlogy", input, other, ("input", "other"))
    return _xlogy(x, y).to(out_dtype)
