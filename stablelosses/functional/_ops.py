r"""The stable ops: drop-in replacements for ``torch.sqrt``, ``torch.div``, ``torch.logsumexp``,
``torch.softmax``, ``torch.log_softmax`` and ``torch.special.xlogy`` with finite, defined
gradients at their singular points.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Number

import torch
from torch import Tensor

from stablelosses._autograd.div import _safe_div
from stablelosses._autograd.softmax import _log_softmax, _logsumexp, _softmax
from stablelosses._autograd.sqrt import _safe_sqrt
from stablelosses._autograd.xlogy import _xlogy
from stablelosses._utils import broadcast_shapes, check_tensor, compute_dtype, promote_types, wrap_dim

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


def _softmax_out_dtype(x: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """softmax/log_softmax are on CUDA autocast's float32 list (not on CPU's)."""
    if dtype is not None:
        return dtype
    if x.dtype in _LOW and x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.float32
    return x.dtype


def _check_softmax_args(
    fn: str, input: object, dim: object, mask: object, dtype: object
) -> tuple[Tensor, int]:
    x = check_tensor(fn, "input", input)
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"{fn}: dtype must be a floating-point torch.dtype or None, got {dtype!r}")
        x = x.to(dtype)
    if not x.is_floating_point():
        raise TypeError(
            f"{fn}: input must be a floating-point tensor (float16, bfloat16, float32 or float64), "
            f"got {x.dtype}"
        )
    if dim is None:
        raise TypeError(f"{fn}: dim must be an int, got None (the implicit dim is not supported)")
    d = wrap_dim(fn, dim, x.ndim)
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"{fn}: mask must be a bool torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"{fn}: mask must have dtype torch.bool (True = takes part), got {mask.dtype}")
        try:
            shape = broadcast_shapes(mask.shape, x.shape)
        except RuntimeError:
            shape = None
        if shape != x.shape:
            raise ValueError(
                f"{fn}: mask of shape {tuple(mask.shape)} does not broadcast to input of shape "
                f"{tuple(x.shape)}"
            )
    return x, d


def _softmax_like(fn_apply, name: str, input: Tensor, dim: int, mask: Tensor | None,
                  dtype: torch.dtype | None) -> Tensor:
    x, d = _check_softmax_args(name, input, dim, mask, dtype)
    out_dtype = _softmax_out_dtype(x, dtype)
    if mask is not None:
        x = x.masked_fill(~mask.to(x.device), float("-inf"))
    scalar = x.ndim == 0
    xc = x.reshape(1) if scalar else x
    y = fn_apply(xc.to(compute_dtype(xc)), d)
    if scalar:
        y = y.reshape(())
    return y.to(out_dtype)


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


def logsumexp(input: Tensor, dim: int | Sequence[int], keepdim: bool = False) -> Tensor:
    r"""``log Σ exp(input)`` over ``dim``, with defined gradients on ``±inf`` slices.

    $$ \operatorname{logsumexp}(x)_i = \log \sum_j \exp(x_{ij}) $$

    Same value as ``torch.logsumexp``: a slice of all ``-inf`` gives ``-inf``, a slice with a
    ``+inf`` entry gives ``+inf``, a NaN gives NaN. Over one dimension it is computed as
    $m + \operatorname{log1p}(\sum_{j \ne \arg\max} e^{x_j - m})$, correctly rounded also
    where $\log \sum$ rounds $1 + \delta$ to 1 (``[0, -20]`` gives ``2.06e-9``; torch: 0).

    **Gradient.** $\operatorname{softmax}(x)$ over ``dim``: $\exp(x - \operatorname{lse})$
    normalised by its computed sum, so it is the exact softmax at every magnitude (on a
    ``finfo.min`` slice, or ``[-1e30, -1e30]``, torch's $\exp(x - \operatorname{lse})$ is 1 per
    entry; here it is $1/n$). On an all-``-inf`` slice it is defined as $0$ (torch computes
    $\exp(-\infty + \infty)$ = NaN); on a slice with $k$ ``+inf`` entries it is the limit
    $1/k$ on those entries and $0$ elsewhere. Forward-mode AD (``torch.func.jvp``, ``jacfwd``,
    ``hessian``) uses the same softmax. A finite fill value (``finfo.min``) is an ordinary
    number; only ``-inf`` entries are masked.

    Args:
        input: floating-point (or integer, promoted) tensor.
        dim: dimension or dimensions to reduce.
        keepdim: keep the reduced dimensions with size 1. Default: ``False``.

    Returns:
        The reduced tensor, in ``input``'s dtype (float16/bfloat16 computed in float32).

    Raises:
        TypeError: ``input`` is not a tensor or ``dim`` is not an int or a sequence of ints.
        IndexError: ``dim`` is out of range.

    Example:
        >>> import torch
        >>> from stablelosses.functional import logsumexp
        >>> x = torch.full((2,), float("-inf"), requires_grad=True)
        >>> torch.logsumexp(x, 0).backward(); x.grad
        tensor([nan, nan])
        >>> x.grad = None
        >>> logsumexp(x, 0).backward(); x.grad
        tensor([0., 0.])

    Replaces ``torch.logsumexp``.
    """
    x = _float_result(check_tensor("logsumexp", "input", input))
    if isinstance(dim, (list, tuple)):
        dims = tuple(wrap_dim("logsumexp", d, x.ndim) for d in dim)
        if len(set(dims)) != len(dims):
            raise ValueError(f"logsumexp: dim has repeated dimensions, got {tuple(dim)}")
        if not dims:
            raise ValueError("logsumexp: dim must name at least one dimension, got ()")
    else:
        dims = (wrap_dim("logsumexp", dim, x.ndim),)
    if not isinstance(keepdim, bool):
        raise TypeError(f"logsumexp: keepdim must be a bool, got {type(keepdim).__name__}")
    out_dtype = x.dtype
    if x.ndim == 0:
        return _logsumexp(x.reshape(1).to(compute_dtype(x)), (0,), False).to(out_dtype)
    return _logsumexp(x.to(compute_dtype(x)), dims, keepdim).to(out_dtype)


def softmax(input: Tensor, dim: int, *, mask: Tensor | None = None,
            dtype: torch.dtype | None = None) -> Tensor:
    r"""Softmax over ``dim`` with an optional boolean ``mask``, exact on masked and ``±inf`` slices.

    $$ \operatorname{softmax}(x)_{ij} = \frac{\exp(x_{ij})}{\sum_k \exp(x_{ik})} $$

    ``mask`` (bool, broadcastable to ``input``; True = takes part) acts as
    ``input.masked_fill(~mask, -inf)``. An all-masked or all-``-inf`` slice gives zeros
    (``torch.softmax`` gives NaN); a slice with $k$ ``+inf`` entries gives the limit $1/k$ on
    them and 0 elsewhere (torch: NaN). NaN input gives a NaN slice.

    **Gradient.** $y \odot (g - \langle g, y\rangle)$ from the saved output: $0$ for masked
    entries and for all-masked slices, finite on ``+inf`` slices. Forward-mode AD
    (``torch.func.jvp``, ``jacfwd``) uses the same formula. A slice filled with the finite
    ``finfo.min`` is an ordinary slice (uniform), as in torch; only ``-inf`` masks.

    Args:
        input: floating-point tensor.
        dim: dimension along which softmax is computed.
        mask: optional bool tensor broadcastable to ``input``. Default: ``None``.
        dtype: cast ``input`` to this dtype first, as in ``torch.softmax``. Default: ``None``.

    Returns:
        Tensor of ``input``'s shape and dtype (float16/bfloat16 computed in float32).

    Raises:
        TypeError: ``input`` is not floating point, or ``mask`` is not a bool tensor.
        ValueError: ``mask`` does not broadcast to ``input``.
        IndexError: ``dim`` is out of range.

    Example:
        >>> import torch
        >>> from stablelosses.functional import softmax
        >>> z = torch.tensor([92.0, 90.0])
        >>> torch.exp(z) / torch.exp(z).sum()
        tensor([nan, nan])
        >>> softmax(z, 0)
        tensor([0.8808, 0.1192])
        >>> softmax(torch.zeros(2, 3), -1, mask=torch.tensor([[True, True, False], [False, False, False]]))
        tensor([[0.5000, 0.5000, 0.0000],
                [0.0000, 0.0000, 0.0000]])

    Replaces ``torch.softmax`` / ``F.softmax`` and ``softmax(x.masked_fill(~mask, -inf))``.
    """
    return _softmax_like(_softmax, "softmax", input, dim, mask, dtype)


def log_softmax(input: Tensor, dim: int, *, mask: Tensor | None = None,
                dtype: torch.dtype | None = None) -> Tensor:
    r"""Log-softmax over ``dim`` with an optional boolean ``mask``; masked entries are ``-inf``.

    $$ \operatorname{log\_softmax}(x)_{ij} = x_{ij} - \log \sum_k \exp(x_{ik}) $$

    ``mask`` as in [`softmax`][stablelosses.functional.softmax]. Masked entries give ``-inf``;
    an all-masked slice gives ``-inf`` everywhere (``torch.log_softmax``: NaN); a slice with
    $k$ ``+inf`` entries gives $-\log k$ on them and ``-inf`` elsewhere.

    **Gradient.** $g - \operatorname{softmax}(x)\sum g$ from the saved output. An output that
    is ``-inf`` (masked entry, all-masked slice, entry dominated by ``+inf``) does not move when
    any input moves, so its incoming gradient is ignored and its input's gradient is $0$; e.g.
    label smoothing's $-\varepsilon/C$ on a masked class does not leak into the other classes.
    Forward-mode AD is supported (the tangent of a ``-inf`` output is 0). A ``finfo.min``
    slice is an ordinary slice ($-\log n$), as in torch.

    Args:
        input: floating-point tensor (cast to ``dtype`` first when given, as ``torch.log_softmax``).
        dim: the dimension normalised over.
        mask: bool, broadcastable to ``input``, True = takes part; ``None``: all do. Default: ``None``.
        dtype: see ``input``. Default: ``None``.

    Returns:
        The log-probabilities: ``input``'s shape and dtype (half precision computed in float32).

    Raises:
        TypeError: as [`softmax`][stablelosses.functional.softmax] (``input`` not floating
            point, ``mask`` not bool).
        ValueError: as `softmax` (``mask`` does not broadcast); IndexError: ``dim`` out of range.

    Example:
        >>> import torch
        >>> from stablelosses.functional import log_softmax
        >>> x = torch.full((1, 3), float("-inf"), requires_grad=True)
        >>> torch.log_softmax(x, -1)
        tensor([[nan, nan, nan]], grad_fn=<LogSoftmaxBackward0>)
        >>> y = log_softmax(x, -1); y
        tensor([[-inf, -inf, -inf]], grad_fn=<_LogSoftmaxBackward>)
        >>> y[0, 0].backward(); x.grad
        tensor([[0., 0., 0.]])

    Replaces ``torch.log_softmax`` / ``F.log_softmax``.
    """
    return _softmax_like(_log_softmax, "log_softmax", input, dim, mask, dtype)
