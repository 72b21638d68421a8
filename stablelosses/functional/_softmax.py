r"""The softmax family: drop-in replacements for ``torch.logsumexp``, ``torch.softmax`` and
``torch.log_softmax`` with defined values and gradients on all-``-inf`` and ``+inf`` slices, and
a ``mask=`` argument.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from stablelosses import _backend
from stablelosses._autograd.softmax import _LogSoftmax, _LogSumExp, _Softmax
from stablelosses._spec import check_flag, check_float_dtype, check_int
from stablelosses._utils import (
    broadcasts_to,
    cast,
    check_floating,
    check_same_device,
    check_tensor,
    compute_dtype,
    wrap_dim,
    wrap_dims,
    write_out,
)
from stablelosses.functional._operands import _LOW, _float_result


def _positional_dtype(fn: str, stacklevel: object, dtype: object) -> object:
    """The third positional argument: ``F.softmax``'s legacy ``_stacklevel`` (an int torch
    ignores, and so do we) or ``torch.softmax``'s ``dtype``."""
    if isinstance(stacklevel, torch.dtype):
        if dtype is not None:
            raise TypeError(f"{fn}: dtype given twice, as the third argument and as dtype=")
        return stacklevel
    check_int(fn, "_stacklevel", stacklevel)
    return dtype


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
        x = x.to(check_float_dtype(fn, "dtype", dtype))
    x = check_floating(fn, "input", x)  # after the cast: torch's "not implemented for 'Long'"
    if dim is None:
        raise TypeError(f"{fn}: dim must be an int, got None (the implicit dim is not supported)")
    d = wrap_dim(fn, dim, x.ndim)
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"{fn}: mask must be a bool torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"{fn}: mask must have dtype torch.bool (True = takes part), got {mask.dtype}")
        if not broadcasts_to(mask.shape, x.shape):
            raise ValueError(
                f"{fn}: mask of shape {tuple(mask.shape)} does not broadcast to input of shape "
                f"{tuple(x.shape)}"
            )
        check_same_device(fn, mask, x.device)
    return x, d


def _softmax_like(fn_apply, name: str, input: Tensor, dim: int, mask: Tensor | None,
                  dtype: torch.dtype | None) -> Tensor:
    x, d = _check_softmax_args(name, input, dim, mask, dtype)
    out = _backend.dispatch(name, x, d, mask, dtype)  # the kernels when selected, else None
    if out is not None:
        return out
    out_dtype = _softmax_out_dtype(x, dtype)
    if mask is not None:
        x = x.masked_fill(~mask.to(x.device), float("-inf"))
    scalar = x.ndim == 0
    xc = x.reshape(1) if scalar else x
    y = fn_apply(cast(xc, compute_dtype(xc)), d)
    if scalar:
        y = y.reshape(())
    return cast(y, out_dtype)


def logsumexp(input: Tensor, dim: int | Sequence[int], keepdim: bool = False, *,
              out: Tensor | None = None) -> Tensor:
    r"""``log Σ exp(input)`` over ``dim``, with defined gradients on ``±inf`` slices.

    $$ \operatorname{logsumexp}(x)_i = \log \sum_j \exp(x_{ij}) $$

    The value is ``torch.logsumexp``'s, bit for bit: a slice of all ``-inf`` gives ``-inf``, a
    slice with a ``+inf`` entry gives ``+inf``, a NaN gives NaN, and where $\log \sum$
    rounds $1 + \delta$ to 1 it rounds as torch does (``[0, -20]`` gives 0 in float32; the
    exact value is ``2.06e-9``). Keeping that tail would cost two more passes over the input
    (1.43x torch's bytes moved); `cross_entropy` keeps its own (its backward needs the softmax
    anyway), `log_softmax` rounds as torch does too.

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
        out: the output tensor, as in ``torch.logsumexp``: the result is written into it and it
            is returned; not differentiable (torch's ``RuntimeError`` when ``input`` requires
            grad). Default: ``None``.

    Returns:
        The reduced tensor, in ``input``'s dtype (float16/bfloat16 computed in float32).

    Raises:
        TypeError: ``input`` is not a tensor or ``dim`` is not an int or a sequence of ints.
        IndexError: ``dim`` is out of range.
        RuntimeError: ``dim`` repeats a dimension or is empty (torch's type; also a
            ``ValueError``).

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
    if out is not None:
        return write_out("logsumexp", logsumexp(input, dim, keepdim), out, input)
    x = _float_result(check_tensor("logsumexp", "input", input))
    dims = wrap_dims("logsumexp", dim, x.ndim, allow_empty=False)
    check_flag("logsumexp", "keepdim", keepdim)
    y = _backend.dispatch("logsumexp", x, dims, keepdim)  # the kernels when selected, else None
    if y is not None:
        return y
    out_dtype = x.dtype
    if x.ndim == 0:
        return cast(_LogSumExp.call(cast(x.reshape(1), compute_dtype(x)), (0,), False), out_dtype)
    return cast(_LogSumExp.call(cast(x, compute_dtype(x)), dims, keepdim), out_dtype)


def softmax(input: Tensor, dim: int, _stacklevel: int = 3, dtype: torch.dtype | None = None, *,
            mask: Tensor | None = None) -> Tensor:
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
        _stacklevel: ``F.softmax``'s legacy positional argument, ignored as torch ignores it;
            a ``torch.dtype`` here is ``torch.softmax(input, dim, dtype)``'s. Default: ``3``.
        dtype: cast ``input`` to this dtype first, as in ``torch.softmax``. Default: ``None``.
        mask: optional bool tensor broadcastable to ``input`` (keyword-only). Default: ``None``.

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
    dtype = _positional_dtype("softmax", _stacklevel, dtype)  # type: ignore[assignment]
    return _softmax_like(_Softmax.call, "softmax", input, dim, mask, dtype)


def log_softmax(input: Tensor, dim: int, _stacklevel: int = 3, dtype: torch.dtype | None = None, *,
                mask: Tensor | None = None) -> Tensor:
    r"""Log-softmax over ``dim`` with an optional boolean ``mask``; masked entries are ``-inf``.

    $$ \operatorname{log\_softmax}(x)_{ij} = x_{ij} - \log \sum_k \exp(x_{ik}) $$

    ``mask`` as in [`softmax`][stablelosses.functional.softmax]. Masked entries give ``-inf``;
    an all-masked slice gives ``-inf`` everywhere (``torch.log_softmax``: NaN); a slice with
    $k$ ``+inf`` entries gives $-\log k$ on them and ``-inf`` elsewhere. On every slice with a
    finite maximum the value is torch's kernel on $x - \max x$, the shift torch's kernel makes
    itself, so it rounds as ``torch.log_softmax`` does: where $\log \sum$ rounds $1 + \delta$
    to 1 the argmax entry is 0 (``[20, 0, -1]`` in float32; the exact value is ``-2.8e-9``).
    Its exact tail $-\log1p(\delta)$ would cost one more pass over the input; `cross_entropy`
    keeps its own (the Triton kernels keep it too).

    **Gradient.** $g - \operatorname{softmax}(x)\sum g$ from the saved output. An output that
    is ``-inf`` (masked entry, all-masked slice, entry dominated by ``+inf``) does not move when
    any input moves, so its incoming gradient is ignored and its input's gradient is $0$; e.g.
    label smoothing's $-\varepsilon/C$ on a masked class does not leak into the other classes.
    Forward-mode AD is supported (the tangent of a ``-inf`` output is 0). A ``finfo.min``
    slice is an ordinary slice ($-\log n$), as in torch.

    Args:
        input: floating-point tensor (cast to ``dtype`` first when given, as ``torch.log_softmax``).
        dim: the dimension normalised over.
        _stacklevel: ``F.log_softmax``'s legacy positional argument, ignored as torch ignores
            it; a ``torch.dtype`` here is ``torch.log_softmax(input, dim, dtype)``'s. Default: ``3``.
        dtype: see ``input``. Default: ``None``.
        mask: bool, broadcastable to ``input``, True = takes part; ``None``: all do
            (keyword-only). Default: ``None``.

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
    dtype = _positional_dtype("log_softmax", _stacklevel, dtype)  # type: ignore[assignment]
    return _softmax_like(_LogSoftmax.call, "log_softmax", input, dim, mask, dtype)
