r"""The torch.nn losses that have no hazard: torch's own computation behind a thin wrapper.

Each function here has torch's signature and calls the torch function it replaces. The wrapper
adds only what the contract asks of every stablelosses function:

- ``reduction`` (after torch's mapping of the deprecated ``size_average``/``reduce``) is checked
  first, with a message that names the function and the argument;
- float16/bfloat16 tensors are computed in float32 (torch's float32 result on the upcast inputs,
  rounded to the input dtype; float32 under autocast, as torch's losses);
- an error torch raises keeps its type and gains the function's name and the arguments' shapes
  and dtypes (torch's broadcast and dtype messages name no argument).

``tests/test_torch_losses.py`` says why nothing else is needed: over extreme finite inputs
(±1e4, ±1e30, 0, subnormals) no value or gradient is non-finite where the exact one is finite.
``multi_margin_loss`` and ``multilabel_margin_loss`` add one rule to torch's: a NaN score makes
that sample's loss NaN (torch's kernels drop it and return a finite number); so does a NaN target
in ``hinge_embedding_loss`` (torch's reads it as neither 1 nor -1).
``triplet_margin_loss`` (and the default distance of ``triplet_margin_with_distance_loss``) scales
its distance where a power would overflow: torch's overflows for entries of 1e30 in float32
(found by that test). ``poisson_nll_loss(log_input=False)`` writes its product as ``xlogy``: torch's
``0 · log 0`` is NaN at a zero count with a zero rate (``eps=0``). These two are the formulas of
this file that are not torch's.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from stablelosses._compat import forward_ad_active, functorch_transforms_active, is_transform_wrapped
from stablelosses._spec import TORCH_INVALID, check_torch_reduction
from stablelosses._utils import (
    _LOW_PRECISION,
    autocast_to_float32,
    broadcast_shapes,
    cast,
    legacy_reduction,
    take,
)
from stablelosses._utils import reduce as _reduce
from stablelosses.functional._xlogy import xlogy

__all__ = [
    "l1_loss",
    "mse_loss",
    "huber_loss",
    "smooth_l1_loss",
    "poisson_nll_loss",
    "binary_cross_entropy",
    "hinge_embedding_loss",
    "margin_ranking_loss",
    "multi_margin_loss",
    "multilabel_margin_loss",
    "triplet_margin_loss",
    "triplet_margin_with_distance_loss",
]


# ------------------------------------------------------------------------- shared by the catalog


def check_reduction(fn: str, reduction: object, size_average: object = None, reduce: object = None, *,
                    alias: bool = True, invalid: str = TORCH_INVALID) -> str:
    """torch's mapping of the deprecated pair onto ``reduction`` (with torch's warning), then the
    checked reduction: ``'elementwise_mean'`` is ``'mean'`` (with torch's warning) where the torch
    function takes it (``alias``), and a bad one's message holds torch's words (``invalid``)."""
    resolved = legacy_reduction(size_average, reduce, reduction)  # type: ignore[arg-type]
    return check_torch_reduction(fn, resolved, alias=alias, invalid=invalid)


def check_tensors(fn: str, **tensors: object) -> None:
    """``TypeError`` naming the argument when a tensor argument is not a tensor (``None`` passes)."""
    for name, value in tensors.items():
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(value).__name__}")


def out_dtype(*tensors: Tensor | torch.dtype | None) -> torch.dtype | None:
    """The dtype a built-in loss returns for these floating operands (tensors, or dtypes from
    `float_of`): their promoted dtype, and float32 for float16/bfloat16 under autocast (on the
    first tensor's device). ``None`` when none is floating."""
    dtype = None
    for t in tensors:
        d = t.dtype if isinstance(t, Tensor) else t
        if isinstance(d, torch.dtype) and d.is_floating_point:
            dtype = d if dtype is None else torch.promote_types(dtype, d)
    if dtype in _LOW_PRECISION:
        first = next((t for t in tensors if isinstance(t, Tensor)), None)
        if first is not None and autocast_to_float32(first):
            return torch.float32
    return dtype


def float_of(*tensors: Tensor) -> torch.dtype:
    """The dtype of one step of torch's composite formula on these operands (``x - y + eps``,
    ``x * x + eps``, ``exp(x)``): their promoted dtype, or the default float dtype when none is
    floating (an integer tensor meets a float scalar). ``triplet_margin_loss(int64, float16,
    int64)`` is float32 in torch for that reason: its ``anchor - negative`` is integer."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype if dtype.is_floating_point or dtype.is_complex else torch.get_default_dtype()


def up(t: Any) -> Any:
    """float16/bfloat16 tensors → float32 (a differentiable cast); anything else unchanged."""
    if isinstance(t, Tensor) and t.dtype in _LOW_PRECISION:
        return t.float()
    return t


def _describe(names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    parts = [
        f"{name}: {v.dtype} {tuple(v.shape)}"
        for name, v in (*zip(names, args), *kwargs.items())
        if isinstance(v, Tensor)
    ]
    return "; ".join(parts)


def call_torch(
    fn: str, torch_fn: Callable[..., Tensor], names: tuple[str, ...], *args: Any, **kwargs: Any
) -> Tensor:
    """``torch_fn(*args, **kwargs)``; an error it raises keeps its type and names ``fn`` and the
    arguments (``names``: the positional arguments' names). Traced code calls it plainly."""
    if torch.compiler.is_compiling():
        return torch_fn(*args, **kwargs)
    try:
        return torch_fn(*args, **kwargs)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        message = f"{fn}: {e} ({_describe(names, args, kwargs)})"
        try:
            renamed = type(e)(message)
        except Exception:  # noqa: BLE001 - an exception class with another constructor: keep torch's
            raise e from None
        raise renamed from None


def check_fits_input(fn: str, input: Tensor, **others: Tensor | None) -> None:
    """torch's kernels that write the loss into ``input``'s shape (an in-place step, or an output
    made like ``input``): an argument that broadcasts ``input`` to a larger shape is their
    RuntimeError, here naming the argument. Shapes that do not broadcast at all are left to
    torch's own error (its words name the sizes)."""
    for name, other in others.items():
        if other is None or other.shape == input.shape:
            continue
        try:
            shape = broadcast_shapes(input.shape, other.shape)
        except RuntimeError:
            continue
        if shape != input.shape:
            raise RuntimeError(
                f"{fn}: {name} of shape {list(other.shape)} would broadcast input to a larger shape "
                f"(output with shape {list(input.shape)} doesn't match the broadcast shape {list(shape)})"
            )


def scalar_type(dtype: torch.dtype) -> str:
    """torch's C++ name of a dtype, as its messages write it: ``Float``, ``Half``, ``Long``."""
    return torch.empty(0, dtype=dtype, device="meta").type().rsplit(".", 1)[-1].removesuffix("Tensor")


def check_same_dtype(fn: str, input: Tensor, weight: Tensor | None) -> None:
    """torch's kernels that take ``weight`` in ``input``'s dtype only: the same RuntimeError in
    torch's words (``expected scalar type Float but found Half``), naming the argument."""
    if weight is not None and weight.dtype != input.dtype:
        raise RuntimeError(
            f"{fn}: weight must have input's dtype: expected scalar type {scalar_type(input.dtype)} "
            f"but found {scalar_type(weight.dtype)}"
        )


# torch's words for an integer or bool tensor its kernels refuse ({dtype}: torch's scalar type)
NOT_IMPLEMENTED = "\"{kernel}\" not implemented for '{{dtype}}'"
CANNOT_CAST = "result type Float can't be cast to the desired output type {dtype}"


def check_floating_input(fn: str, name: str, t: Tensor, error: type[Exception], torch_words: str) -> None:
    """``error`` (torch's type for this function) when ``t`` is not floating point (an integer or
    bool tensor, which torch's kernel refuses), with torch's words (``{dtype}``: its scalar type)."""
    if not (t.is_floating_point() or t.is_complex()):
        words = torch_words.format(dtype=scalar_type(t.dtype))
        raise error(f"{fn}: {name} must be a floating-point tensor, got {t.dtype} ({words})")


def needs_grad(t: Tensor) -> bool:
    """``t`` may need a gradient or a tangent: it requires grad, a ``torch.func`` transform wraps
    it, or a forward-AD level is open (a dual tensor neither requires grad nor is wrapped).
    While compiling, any active transform stands for the wrapper test, which Dynamo cannot
    trace (a graph break): a compiled ``torch.func.grad``/``vmap``/``jvp`` keeps the term, and
    a plain compiled graph with a constant weight does not trace it."""
    if torch.compiler.is_compiling():
        return t.requires_grad or functorch_transforms_active() or forward_ad_active()
    return t.requires_grad or forward_ad_active() or is_transform_wrapped(t)


def with_grad_only(term: Tensor) -> Tensor:
    """A term that adds 0 to the value and its gradient to the backward: ``term − detach(term)``
    (0 where the term is not finite, so an ``inf`` value stays ``inf``)."""
    value = term.detach()
    return torch.where(torch.isfinite(value), term - value, 0.0)


def _has_parameter(torch_fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(torch_fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False


# torch 2.13 added ``weight=`` to l1/mse/huber; before it the same formula is written here. l1
# always takes the written formula (torch's own eager one): compiled, torch 2.13's F.l1_loss
# drops its weight (the unweighted value, no weight gradient; aot_eager alike)
_TORCH_WEIGHT = {f: _has_parameter(f, "weight") for f in (F.mse_loss, F.huber_loss)}


def _weighted(
    fn: str, unweighted: Tensor, input: Tensor, weight: Tensor, reduction: str, mean_by_weight: bool
) -> Tensor:
    """torch 2.13's weighted l1/mse (``mean`` = Σ w·ℓ / Σ w) and huber (``mean`` = mean(w·ℓ))."""
    if weight.size() != input.size():
        raise ValueError(
            f"{fn}: Weights and input must have the same size (weight {tuple(weight.shape)}, "
            f"input {tuple(input.shape)})"
        )
    loss = unweighted * weight
    if reduction == "mean" and mean_by_weight:
        return loss.sum() / weight.sum()
    return _reduce(loss, reduction)


# ------------------------------------------------------------------------------- the functions


def _pointwise(
    fn: str, torch_fn: Callable[..., Tensor], input: Tensor, target: Tensor, reduction: str,
    weight: Tensor | None, mean_by_weight: bool, dtype_of_input: bool = False, **options: Any,
) -> Tensor:
    check_tensors(fn, input=input, target=target, weight=weight)
    # torch's dtype: the promoted one, or input's for kernels that write into input's dtype
    dtype = out_dtype(input, weight) if dtype_of_input else out_dtype(input, target, weight)
    x, y = up(input), up(target)
    if weight is None:
        res = call_torch(fn, torch_fn, ("input", "target"), x, y, reduction=reduction, **options)
    elif _TORCH_WEIGHT.get(torch_fn, False):
        res = call_torch(
            fn, torch_fn, ("input", "target"), x, y, reduction=reduction, weight=up(weight), **options
        )
    else:
        res = call_torch(fn, torch_fn, ("input", "target"), x, y, reduction="none", **options)
        res = _weighted(fn, res, input, up(weight), reduction, mean_by_weight)
    return res if dtype is None else cast(res, dtype)


def l1_loss(
    input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
    reduction: str = "mean", weight: Tensor | None = None,
) -> Tensor:
    r"""Mean absolute error, torch's ``F.l1_loss``: $\ell_i = w_i\,|x_i - y_i|$.

    Reductions: none $\ell$; sum $\sum_i \ell_i$; mean $\frac1N\sum_i \ell_i$, or
    $\sum_i \ell_i / \sum_i w_i$ with ``weight`` (torch 2.13's rule).

    **Gradient.** torch's: $w_i\,\operatorname{sign}(x_i - y_i)$, 0 at a zero residual. No
    hazard: a finite input gives a finite value and gradient.

    Args:
        input: the predictions, any shape.
        target: the values to match, broadcastable with ``input`` (torch warns when the sizes
            differ).
        size_average: deprecated (as in torch); with ``reduce`` it overrides ``reduction``:
            ``False`` sums the absolute errors.
        reduce: deprecated (as in torch); ``False`` keeps one absolute error per element.
        reduction: ``'none'`` ($\ell$) | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        weight: $w$, one weight per element of ``input`` (its size), or ``None``. Default:
            ``None``.

    Returns:
        The mean or summed absolute error, or for ``'none'`` the errors in the broadcast shape;
        torch's dtype (float16/bfloat16 computed in float32 and rounded back).

    Raises:
        ValueError: ``reduction`` is not one of the above; ``weight``'s size is not ``input``'s.
        RuntimeError: the shapes do not broadcast (the message names ``input`` and ``target``).

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> SF.l1_loss(torch.tensor([1.0, -2.0]), torch.tensor([0.0, 0.0]))
        tensor(1.5000)
        >>> SF.l1_loss(torch.tensor([1.0, -2.0]), torch.tensor([0.0, 0.0]), weight=torch.tensor([1.0, 3.0]))
        tensor(1.7500)

    Replaces ``torch.nn.functional.l1_loss``.
    """
    red = check_reduction("l1_loss", reduction, size_average, reduce)
    return _pointwise("l1_loss", F.l1_loss, input, target, red, weight, True)


def mse_loss(
    input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
    reduction: str = "mean", weight: Tensor | None = None,
) -> Tensor:
    r"""Mean squared error, torch's ``F.mse_loss``: $\ell_i = w_i\,(x_i - y_i)^2$.

    Reductions as [`l1_loss`][stablelosses.functional.l1_loss] (``mean`` with ``weight`` is
    $\sum_i \ell_i / \sum_i w_i$).

    **Gradient.** torch's: $2 w_i (x_i - y_i)$. No hazard: the square overflows only where the
    exact value is not representable (float32 residuals above about 1.8e19).

    Args:
        input: the predictions, any shape.
        target: broadcastable with ``input``.
        size_average: deprecated (as in torch); ``False`` asks for the sum of squares.
        reduce: deprecated (as in torch); ``False`` asks for every squared error.
        reduction: ``'none'`` | ``'mean'`` (by $\sum_i w_i$ when weighted) | ``'sum'``. Default:
            ``'mean'``.
        weight: $w_i$ for each squared error, ``input``'s size; or ``None``. Default: ``None``.

    Returns:
        A scalar, or the weighted squares $\ell$ for ``'none'``; torch's dtype.

    Raises:
        ValueError: ``reduction`` is not one of the above; ``weight``'s size is not ``input``'s.
        RuntimeError: the shapes do not broadcast.

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> SF.mse_loss(torch.tensor([1.0, -2.0]), torch.tensor([0.0, 0.0]))
        tensor(2.5000)

    Replaces ``torch.nn.functional.mse_loss``.
    """
    red = check_reduction("mse_loss", reduction, size_average, reduce)
    return _pointwise("mse_loss", F.mse_loss, input, target, red, weight, True)


def huber_loss(
    input: Tensor, target: Tensor, reduction: str = "mean", delta: float = 1.0, weight: Tensor | None = None
) -> Tensor:
    r"""Huber loss, torch's ``F.huber_loss``.

    $$ \ell_i = w_i \begin{cases} \tfrac12 r_i^2 & |r_i| < \delta \\
       \delta\,(|r_i| - \tfrac12\delta) & \text{otherwise} \end{cases},\qquad r = x - y. $$

    Reductions: none, sum, mean ($\frac1N\sum_i \ell_i$, also with ``weight``: torch's rule).

    **Gradient.** torch's: $w_i\,\operatorname{clamp}(r_i, -\delta, \delta)$. No hazard.

    Args:
        input: the predictions, any shape.
        target: broadcastable with ``input``.
        reduction: ``'none'`` | ``'mean'`` (over elements, weighted or not) | ``'sum'``.
            Default: ``'mean'``.
        delta: $\delta$, where the square turns linear, ``> 0``. Default: ``1.0``.
        weight: $w_i$ per element, ``input``'s size; or ``None``. Default: ``None``.

    Returns:
        A scalar, or the Huber terms $\ell$ (broadcast shape) for ``'none'``; torch's dtype.

    Raises:
        ValueError: ``reduction`` is not one of the above; ``weight``'s size is not ``input``'s.
        RuntimeError: ``delta <= 0`` (torch's check), or the shapes do not broadcast.

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> SF.huber_loss(torch.tensor([0.5, 3.0]), torch.zeros(2), reduction="none")
        tensor([0.1250, 2.5000])

    Replaces ``torch.nn.functional.huber_loss``.
    """
    red = check_reduction("huber_loss", reduction)
    return _pointwise("huber_loss", F.huber_loss, input, target, red, weight, False, True, delta=delta)


def smooth_l1_loss(
    input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
    reduction: str = "mean", beta: float = 1.0,
) -> Tensor:
    r"""Smooth L1 loss, torch's ``F.smooth_l1_loss``.

    $$ \ell_i = \begin{cases} \tfrac{0.5\,r_i^2}{\beta} & |r_i| < \beta \\
       |r_i| - \tfrac12\beta & \text{otherwise} \end{cases} $$

    ($\beta = 0$ is the L1 loss.) **Gradient.** torch's: $\operatorname{clamp}(r_i/\beta, -1, 1)$.
    No hazard.

    Args:
        input: the predictions, any shape.
        target: broadcastable with ``input``.
        size_average: deprecated (as in torch); ``False``: the sum.
        reduce: deprecated (as in torch); ``False``: no reduction.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'`` of the smooth-L1 terms. Default: ``'mean'``.
        beta: $\beta$, where the square turns linear, ``>= 0``. Default: ``1.0``.

    Returns:
        A scalar, or for ``'none'`` one term per element of the broadcast shape; torch's dtype.

    Raises:
        ValueError: ``reduction`` is not one of the above.
        RuntimeError: ``beta < 0`` (torch's check), or the shapes do not broadcast.

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> SF.smooth_l1_loss(torch.tensor([0.5, 3.0]), torch.zeros(2), reduction="none")
        tensor([0.1250, 2.5000])

    Replaces ``torch.nn.functional.smooth_l1_loss``.
    """
    red = check_reduction("smooth_l1_loss", reduction, size_average, reduce)
    return _pointwise("smooth_l1_loss", F.smooth_l1_loss, input, target, red, None, False, beta=beta)


def poisson_nll_loss(
    input: Tensor, target: Tensor, log_input: bool = True, full: bool = False,
    size_average: bool | None = None, eps: float = 1e-8, reduce: bool | None = None, reduction: str = "mean",
) -> Tensor:
    r"""Poisson negative log-likelihood, torch's ``F.poisson_nll_loss``.

    $$ \ell_i = e^{x_i} - y_i x_i \ (\text{log\_input}),\qquad
       \ell_i = x_i - y_i \log(x_i + \epsilon) \ (\text{otherwise}), $$

    plus Stirling's $y\log y - y + \tfrac12\log(2\pi y)$ for $y > 1$ with ``full=True``.

    **Gradient.** torch's ($e^{x} - y$, or $1 - y/(x+\epsilon)$). With ``log_input=False``
    the product is ``xlogy``: a zero count at a zero rate (``eps=0``) gives 0 with gradient 1
    (torch: $0 \cdot \log 0$ = NaN, value and gradient). Otherwise no hazard in the input:
    $e^{x}$ overflows only where the exact value does. With ``full=True`` the target's gradient
    at $y = 0$ is $-x$ (or $-\log(x + \epsilon)$), where torch's is NaN: its Stirling term,
    masked to 0 for $y \le 1$, still differentiates $y \log y$ there ($0 \cdot (-\infty)$).
    Here the term sees $y = 2$ wherever it is masked (double where): the same value, and the
    term's gradient is 0 for $y \le 1$, as torch's is for $0 < y \le 1$.

    Args:
        input: the rate (or its log), any shape.
        target: counts, broadcastable with ``input``.
        log_input: ``input`` is the log-rate. Default: ``True``.
        full: add Stirling's term. Default: ``False``.
        size_average: deprecated (as in torch); ``False`` sums the negative log-likelihoods.
        eps: added to the rate before the log when ``log_input=False``. Default: ``1e-8``.
        reduce: deprecated (as in torch); ``False`` gives the per-element negative
            log-likelihoods.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'`` over the elements. Default: ``'mean'``.

    Returns:
        The mean or total negative log-likelihood, or the per-element $\ell$ for ``'none'``
        (broadcast shape); torch's dtype.

    Raises:
        ValueError: ``reduction`` is not one of the above.
        RuntimeError: the shapes do not broadcast.

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> SF.poisson_nll_loss(torch.zeros(2), torch.tensor([1.0, 2.0]))
        tensor(1.)

    Replaces ``torch.nn.functional.poisson_nll_loss``.
    """
    fn = "poisson_nll_loss"
    # torch's poisson_nll_loss checks the three names itself: no 'elementwise_mean'
    red = check_reduction(fn, reduction, size_average, reduce, alias=False)
    check_tensors(fn, input=input, target=target)
    # torch's formula: exp(input) (or input + eps) is the default float dtype for an integer input
    dtype = out_dtype(input, float_of(input), target)
    y = up(target)
    # with full=True: torch's terms without Stirling's, then Stirling's added and reduced as
    # torch's formula does
    if log_input:
        res = call_torch(fn, F.poisson_nll_loss, ("input", "target"), up(input), y, log_input=True,
                         eps=eps, reduction="none" if full else red)
    else:
        # torch's input - target·log(input + eps), with 0·log 0 = 0 (xlogy): a zero count at a
        # zero rate (eps = 0) has likelihood 1, where torch gives NaN
        res = call_torch(fn, _rate_terms, ("input", "target"), up(input), y, eps)
        res = res if full else _reduce(res, red)
    if full:
        counted = y > 1  # (a NaN target is NaN through the other term)
        ys = torch.where(counted, y, 2.0)
        stirling = ys * torch.log(ys) - ys + 0.5 * torch.log(2 * math.pi * ys)
        res = _reduce(res + torch.where(counted, stirling, 0.0), red)
    return res if dtype is None else cast(res, dtype)


def _rate_terms(x: Tensor, y: Tensor, eps: float) -> Tensor:
    return x - xlogy(y, x + eps)


def binary_cross_entropy(
    input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
    reduce: bool | None = None, reduction: str = "mean",
) -> Tensor:
    r"""Binary cross-entropy on probabilities, torch's ``F.binary_cross_entropy``.

    $$ \ell_i = -w_i\,\big(y_i \log x_i + (1 - y_i)\log(1 - x_i)\big), $$

    each log clamped at $-100$ (torch's rule), so $x \in \{0, 1\}$ gives a finite value.

    **Gradient.** torch's, $w_i\,(x_i - y_i)/\max((1 - x_i)\,x_i,\ 10^{-12})$. For logits use
    [`binary_cross_entropy_with_logits`][stablelosses.functional.binary_cross_entropy_with_logits].

    Args:
        input: probabilities in $[0, 1]$, any shape.
        target: same shape as ``input``.
        weight: broadcastable to ``input``, or ``None``. Default: ``None``.
        size_average: deprecated (as in torch); ``False`` sums the cross-entropies.
        reduce: deprecated (as in torch); ``False`` returns them per element.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Returns:
        A scalar, or ``input``'s shape for ``'none'``; torch's dtype.

    Raises:
        ValueError: ``reduction`` is not one of the above; the sizes of ``input`` and
            ``target`` differ (torch's check).
        RuntimeError: an entry of ``input`` is outside $[0, 1]$ (torch's check).

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> SF.binary_cross_entropy(torch.tensor([1.0, 0.5]), torch.tensor([0.0, 1.0]), reduction="none")
        tensor([100.0000,   0.6931])

    Replaces ``torch.nn.functional.binary_cross_entropy``.
    """
    fn = "binary_cross_entropy"
    red = check_reduction(fn, reduction, size_average, reduce)
    check_tensors(fn, input=input, target=target, weight=weight)
    if target.dtype != input.dtype:  # torch's kernel takes one dtype (its RuntimeError)
        raise RuntimeError(f"{fn}: target must have input's dtype {input.dtype}, got {target.dtype}")
    dtype = out_dtype(input, target)
    w = up(weight)
    res = call_torch(
        fn, F.binary_cross_entropy, ("input", "target"), up(input), up(target),
        weight=None if w is None else w.detach(), reduction=red,
    )
    if w is not None and needs_grad(w):
        # torch's kernel gives weight no gradient: ∂ℓ/∂w = the unweighted term (value unchanged).
        # The term is R(ℓ·w) − R(ℓ·detach(w)) on an ℓ in the graph: its value and its own input
        # tangent are 0 (no doubled jvp: torch.no_grad does not stop forward AD), while its
        # input gradient, 0 in value, depends on w, so the mixed second derivative input×weight
        # exists (double backward and hessian), as ∂ℓ/∂w depends on input.
        plain = F.binary_cross_entropy(up(input), up(target), reduction="none")
        res = res + with_grad_only(_reduce(plain * w, red) - _reduce(plain * w.detach(), red))
    return res if dtype is None else cast(res, dtype)


def hinge_embedding_loss(
    input: Tensor, target: Tensor, margin: float = 1.0, size_average: bool | None = None,
    reduce: bool | None = None, reduction: str = "mean",
) -> Tensor:
    r"""Hinge embedding loss, torch's ``F.hinge_embedding_loss``.

    $$ \ell_i = \begin{cases} x_i & y_i = 1 \\ \max(0, \Delta - x_i) & y_i = -1 \end{cases} $$

    A NaN target makes its element's loss NaN (torch's kernel reads it as neither 1 nor -1 and
    returns a finite number). Elsewhere the value is torch's.

    **Gradient.** torch's. No hazard.

    Args:
        input: distances, any shape.
        target: $\pm 1$ (similar or dissimilar pair), broadcastable with ``input``.
        margin: $\Delta$, the distance a dissimilar pair must exceed. Default: ``1.0``.
        size_average: deprecated (as in torch); ``False`` adds the terms up.
        reduce: deprecated (as in torch); ``False`` leaves one term per pair.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'`` over the pairs. Default: ``'mean'``.

    Returns:
        A scalar, or one $\ell_i$ per pair (the broadcast shape) for ``'none'``; torch's dtype
        (an integer for an integer ``input``, as torch).

    Raises:
        ValueError: ``reduction`` is not one of the above.
        RuntimeError: the shapes do not broadcast; ``'mean'`` of an integer ``input`` (torch's).

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> SF.hinge_embedding_loss(torch.tensor([0.3, 0.3]), torch.tensor([1.0, -1.0]), reduction="none")
        tensor([0.3000, 0.7000])

    Replaces ``torch.nn.functional.hinge_embedding_loss``.
    """
    fn = "hinge_embedding_loss"
    red = check_reduction(fn, reduction, size_average, reduce)
    check_tensors(fn, input=input, target=target)
    dtype = out_dtype(input)  # torch's kernel writes in input's dtype
    y = up(target)
    loss = call_torch(
        fn, F.hinge_embedding_loss, ("input", "target"), up(input), y, margin=margin, reduction="none"
    )
    if loss.is_floating_point():
        # NaN in, NaN out: torch's kernel reads a NaN target as neither 1 nor -1 (both terms)
        loss = torch.where(torch.isnan(y), float("nan"), loss)
    # (an integer input's loss is torch's integer: it holds no NaN, and its 'mean' is torch's
    # RuntimeError, here naming the function)
    res = call_torch(fn, _reduce, ("input",), loss, red)
    return res if dtype is None else cast(res, dtype)


def margin_ranking_loss(
    input1: Tensor, input2: Tensor, target: Tensor, margin: float = 0, size_average: bool | None = None,
    reduce: bool | None = None, reduction: str = "mean",
) -> Tensor:
    r"""Margin ranking loss, torch's ``F.margin_ranking_loss``:
    $\ell_i = \max(0, -y_i\,(x_{1,i} - x_{2,i}) + \Delta)$.

    **Gradient.** torch's. No hazard.

    Args:
        input1: scores, any shape.
        input2: scores, the same number of dimensions as ``input1``.
        target: $\pm 1$ (1: ``input1`` should rank higher; -1: lower), the same number of
            dimensions.
        margin: $\Delta$, by how much the right one must lead. Default: ``0``.
        size_average: deprecated (as in torch); ``False`` means the sum over pairs.
        reduce: deprecated (as in torch); ``False`` means no reduction.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Returns:
        A scalar, or $\ell$ for ``'none'`` (the three inputs' broadcast shape); torch's dtype.

    Raises:
        ValueError: ``reduction`` is not one of the above.
        RuntimeError: the number of dimensions differs, or the shapes do not broadcast.

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> SF.margin_ranking_loss(torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([1.0]))
        tensor(1.)

    Replaces ``torch.nn.functional.margin_ranking_loss``.
    """
    fn = "margin_ranking_loss"
    red = check_reduction(fn, reduction, size_average, reduce)
    check_tensors(fn, input1=input1, input2=input2, target=target)
    dtype = out_dtype(input1, input2, target)
    res = call_torch(
        fn, F.margin_ranking_loss, ("input1", "input2", "target"), up(input1), up(input2), up(target),
        margin=margin, reduction=red,
    )
    return res if dtype is None else cast(res, dtype)


def _nan_rows(
    fn: str, torch_fn: Callable[..., Tensor], input: Tensor, target: Tensor, red: str, **options: Any
) -> Tensor:
    """torch's per-sample loss, NaN for a sample with a NaN score (torch's kernels skip it),
    reduced as torch does (sum, or the mean over samples)."""
    dtype = out_dtype(input)
    x = up(input)
    loss = call_torch(fn, torch_fn, ("input", "target"), x, target, reduction="none", **options)
    nan = torch.isnan(x).any(-1) if x.dim() > 0 else torch.isnan(x)
    loss = torch.where(nan, torch.full_like(loss, float("nan")), loss)
    res = _reduce(loss, red)
    return res if dtype is None else cast(res, dtype)


def multi_margin_loss(
    input: Tensor, target: Tensor, p: int = 1, margin: float = 1.0, weight: Tensor | None = None,
    size_average: bool | None = None, reduce: bool | None = None, reduction: str = "mean",
) -> Tensor:
    r"""Multi-class hinge loss, torch's ``F.multi_margin_loss``, with NaN in → NaN out.

    $$ \ell_n = \frac{1}{C}\sum_{j \ne t_n} w_{t_n}\max(0, \Delta - x_{n,t_n} + x_{n,j})^p $$

    A NaN score makes its sample's loss NaN (torch's kernel compares ``NaN > 0``, drops the
    term and returns a finite number). Elsewhere the value and gradient are torch's.

    Args:
        input: scores ``(N, C)`` or ``(C,)``.
        target: class indices ``(N,)`` or ``()``, int64.
        p: 1 or 2. Default: ``1``.
        margin: $\Delta$. Default: ``1.0``.
        weight: per-class weight ``(C,)``, or ``None``. Default: ``None``.
        size_average: deprecated (as in torch); ``False`` sums over the samples.
        reduce: deprecated (as in torch); ``False`` gives $\ell_n$ per sample.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'`` over the ``N`` samples. Default: ``'mean'``.

    Returns:
        A scalar, or ``(N,)`` for ``'none'``; ``input``'s dtype.

    Raises:
        ValueError: ``reduction`` is not one of the above; ``p`` is not 1 or 2 (torch's check).
        RuntimeError: a bad shape, target dtype or target value (torch's checks).

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> x = torch.tensor([[0.1, float("nan"), 0.8], [0.1, 0.2, 0.4]])
        >>> SF.multi_margin_loss(x, torch.tensor([2, 2]), reduction="none")
        tensor([   nan, 0.5000])

    Replaces ``torch.nn.functional.multi_margin_loss``.
    """
    fn = "multi_margin_loss"
    red = check_reduction(fn, reduction, size_average, reduce)
    check_tensors(fn, input=input, target=target, weight=weight)
    check_same_dtype(fn, input, weight)
    w = up(weight)
    res = _nan_rows(
        fn, F.multi_margin_loss, input, target, red, p=p, margin=margin,
        weight=None if w is None else w.detach(),
    )
    if w is not None and needs_grad(w):
        # torch's kernel gives weight no gradient: ∂ℓ_n/∂w_c = [t_n = c] · the unweighted loss
        with torch.no_grad():
            plain = F.multi_margin_loss(up(input), target, p=p, margin=margin, reduction="none")
        res = res + cast(with_grad_only(_reduce(plain * take(w, target), red)), res.dtype)
    return res


def multilabel_margin_loss(
    input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
    reduction: str = "mean",
) -> Tensor:
    r"""Multi-label hinge loss, torch's ``F.multilabel_margin_loss``, with NaN in → NaN out.

    $$ \ell_n = \sum_{j \in T_n,\ i \notin T_n} \frac{\max(0, 1 - (x_{n,j} - x_{n,i}))}{C} $$

    with $T_n$ the targets before the first $-1$ in ``target[n]``. A NaN score makes its
    sample's loss NaN (torch's kernel drops it). Elsewhere torch's value and gradient.

    Args:
        input: scores ``(N, C)`` or ``(C,)``.
        target: int64 class indices of the same shape, padded with ``-1``.
        size_average: deprecated (as in torch); ``False`` totals the samples' losses.
        reduce: deprecated (as in torch); ``False`` returns each sample's.
        reduction: ``'none'`` | ``'mean'`` (over samples) | ``'sum'``. Default: ``'mean'``.

    Returns:
        A scalar, or the ``N`` losses $\ell_n$ for ``'none'`` (a scalar for ``(C,)`` scores);
        ``input``'s dtype.

    Raises:
        ValueError: ``reduction`` is not one of the above.
        RuntimeError: a bad shape, target dtype or target value (torch's checks).

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> x = torch.tensor([[0.1, 0.2, 0.4, 0.8]])
        >>> SF.multilabel_margin_loss(x, torch.tensor([[3, 0, -1, 1]]))
        tensor(0.8500)

    Replaces ``torch.nn.functional.multilabel_margin_loss``.
    """
    fn = "multilabel_margin_loss"
    red = check_reduction(fn, reduction, size_average, reduce)
    check_tensors(fn, input=input, target=target)
    # torch 2.13's compiled decomposition gives another value than its kernel (with a -1 in the
    # target, or any set of targets: 0.955 for 0.768): traced code spells the formula out
    kernel = _multilabel_margin_formula if torch.compiler.is_compiling() else F.multilabel_margin_loss
    return _nan_rows(fn, kernel, input, target, red)


def _multilabel_margin_formula(x: Tensor, target: Tensor, reduction: str = "none") -> Tensor:
    """torch's kernel as tensor ops, per sample (``reduction='none'``): the targets are the
    entries before the first -1; Σ over target j and non-target i of relu(1 − x_j + x_i), over C."""
    if x.dim() == 0:  # one score, as torch's kernel reads a 0-d input: a (1,) row, a 0-d loss
        return _multilabel_margin_formula(x.reshape(1), target.reshape(1), reduction)
    classes = x.size(-1)
    counted = (target >= 0).long().cumprod(-1)  # 1 before the first -1
    safe_t = target * counted
    is_target = torch.zeros_like(target).scatter_reduce(-1, safe_t, counted, "amax")
    x_t = x.gather(-1, safe_t)  # (..., j)
    hinge = (1 - x_t.unsqueeze(-1) + x.unsqueeze(-2)).clamp_min(0)  # (..., j, i)
    pair = counted.unsqueeze(-1) * (1 - is_target).unsqueeze(-2)
    return torch.where(pair.bool(), hinge, 0.0).sum((-1, -2)) / classes


def _distance(x1: Tensor, x2: Tensor, p: float, eps: float) -> Tensor:
    r"""torch's ``pairwise_distance`` $\lVert x_1 - x_2 + \epsilon\rVert_p$, computed as
    $s\,\lVert d/s\rVert_p$ with $s$ a power of 2 (a constant: the norm is homogeneous, so its
    derivative through $s$ is 0) just large enough that no power overflows: rows of 1e30 in
    float32 give 1.7e30, where torch's gives inf. Every other row has $s = 1$ (torch's value,
    bit for bit), and a scaled row keeps its small entries (dividing by the largest entry sent a
    1e-20 beside 1e30 to 0: its gradient, a sign for $p = 1$, lost). ``p <= 1`` never scales (no
    power overflows); ``p <= 0`` is not homogeneous: torch's function."""
    if p <= 0:
        return torch.pairwise_distance(x1, x2, p, eps)
    d = x1 - x2 + eps
    if d.dim() > 0 and d.shape[-1] == 0:
        # no features: every distance is 0 (torch's value); amax has no identity for an empty
        # dimension (a size-0 dimension is specialised by torch.compile anyway: no extra guard)
        return torch.linalg.vector_norm(d, p, dim=-1)
    # (a 0-dim difference is one feature: torch's norm over dim -1 of a scalar is |d|)
    m = d.detach().abs().amax(-1, keepdim=True)
    zero = m == 0
    # Σ|v|^p of fewer than 2^63 entries of at most `top` stays finite; p <= 1: |v|^p <= |v| + 1
    top = (torch.finfo(d.dtype).max / 2.0**63) ** (1.0 / p) if p > 1 else math.inf
    s = torch.exp2(torch.ceil(torch.log2(m / top))).clamp_min(1.0)
    # an infinite row: no scaling (‖inf‖ = inf)
    s = torch.where(m == math.inf, 1.0, s)
    # a zero row: double where, the norm of a row of ones, then the defined 0 (torch's value and
    # zero gradient; vector_norm's second derivative at 0 is NaN, this one is 0). The row is made
    # safe by adding 1 (d is 0 there; + 0 elsewhere is exact), whose backward is no pass
    v = (d + zero) / s
    return torch.where(zero.squeeze(-1), 0.0, torch.linalg.vector_norm(v, p, dim=-1) * s.squeeze(-1))


def _triplet_terms(
    anchor: Tensor, positive: Tensor, negative: Tensor, margin: float, p: float, eps: float, swap: bool
) -> Tensor:
    dist_pos = _distance(anchor, positive, p, eps)
    dist_neg = _distance(anchor, negative, p, eps)
    if swap:
        dist_neg = torch.minimum(dist_neg, _distance(positive, negative, p, eps))
    return (margin + dist_pos - dist_neg).clamp_min(0)


def triplet_margin_loss(
    anchor: Tensor, positive: Tensor, negative: Tensor, margin: float = 1.0, p: float = 2, eps: float = 1e-6,
    swap: bool = False, size_average: bool | None = None, reduce: bool | None = None, reduction: str = "mean",
) -> Tensor:
    r"""Triplet margin loss, ``F.triplet_margin_loss``'s formula without overflow in the distance.

    $$ \ell_i = \max(d(a_i, p_i) - d(a_i, n_i) + \Delta, 0),\qquad
       d(x, y) = \lVert x - y + \epsilon\rVert_p $$

    The distance is computed as $s\,\lVert (x - y + \epsilon)/s\rVert_p$ with $s$ a power of 2
    scaling the largest $|x_j - y_j + \epsilon|$ below the overflow of its $p$-th power (about
    6e9 for $p = 2$ in float32): torch's ``pairwise_distance`` raises each entry to the power $p$
    first, which overflows for entries of 1e30 in float32 (the loss is then ``inf`` or NaN where
    the exact one is finite). Elsewhere $s = 1$ and the value is torch's, bit for bit.

    **Gradient.** torch's: $\partial d/\partial x = \operatorname{sign}(r)\,|r|^{p-1}/d^{p-1}$
    with $r = x - y + \epsilon$ (0 where the distance is 0, with a second derivative of 0 there:
    torch's double backward is NaN at a zero distance, also where the hinge is inactive).

    Args:
        anchor: ``(N, D)``, ``(D,)`` or ``()`` (one feature, as torch).
        positive: as ``anchor``.
        negative: as ``anchor``.
        margin: $\Delta$. Default: ``1.0``.
        p: the norm degree (``p <= 0``: torch's distance). Default: ``2``.
        eps: added to the difference. Default: ``1e-6``.
        swap: use $\min(d(a, n), d(p, n))$ as the negative distance. Default: ``False``.
        size_average: deprecated (as in torch); ``False`` sums over the triplets.
        reduce: deprecated (as in torch); ``False`` keeps one loss per triplet.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Returns:
        A scalar, or ``(N,)`` for ``'none'``; torch's dtype (half computed in float32).

    Raises:
        ValueError: ``reduction`` is not one of the above; ``margin <= 0`` (torch's check).
        RuntimeError: the numbers of dimensions differ, or the shapes do not broadcast.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import stablelosses.functional as SF
        >>> a, pos, neg = torch.zeros(1, 2), torch.full((1, 2), 1e30), torch.full((1, 2), 2e30)
        >>> F.triplet_margin_loss(a, pos, neg, eps=0.0)
        tensor(nan)
        >>> SF.triplet_margin_loss(a, pos, neg, eps=0.0)
        tensor(0.)

    Replaces ``torch.nn.functional.triplet_margin_loss``.
    """
    fn = "triplet_margin_loss"
    red = check_reduction(fn, reduction, size_average, reduce)
    check_tensors(fn, anchor=anchor, positive=positive, negative=negative)
    if margin <= 0:
        raise ValueError(f"{fn}: margin must be greater than 0, got {margin}")
    if not anchor.dim() == positive.dim() == negative.dim():
        raise RuntimeError(
            f"{fn}: The anchor, positive, and negative tensors are expected to have the same number of "
            f"dimensions, but got: anchor {anchor.dim()}D, positive {positive.dim()}D, and negative "
            f"{negative.dim()}D inputs"
        )
    # torch's dtype: that of its distances (an integer pair's difference + eps is the default
    # float dtype: int64 anchor and negative with float16 positive give float32)
    pairs = [(anchor, positive), (anchor, negative)] + ([(positive, negative)] if swap else [])
    dtype = out_dtype(anchor, *(float_of(a, b) for a, b in pairs))
    loss = call_torch(
        fn, _triplet_terms, ("anchor", "positive", "negative"), up(anchor), up(positive), up(negative),
        margin, p, eps, swap,
    )
    res = _reduce(loss, red)
    return res if dtype is None else cast(res, dtype)


def triplet_margin_with_distance_loss(
    anchor: Tensor, positive: Tensor, negative: Tensor, *,
    distance_function: Callable[[Tensor, Tensor], Tensor] | None = None, margin: float = 1.0,
    swap: bool = False, reduction: str = "mean",
) -> Tensor:
    r"""Triplet loss with a distance of your choice, torch's ``F.triplet_margin_with_distance_loss``:
    $\ell_i = \max(d(a_i, p_i) - d(a_i, n_i) + \Delta, 0)$, $d$ = ``distance_function``
    (``torch.pairwise_distance`` when ``None``).

    The default distance (``None``, or the ``nn.PairwiseDistance`` the module stores) is
    computed scaled, as in [`triplet_margin_loss`][stablelosses.functional.triplet_margin_loss]:
    no overflow for entries of 1e30 in float32.

    **Gradient.** torch's, through ``distance_function`` (a custom one's hazards are its own);
    the default distance's second derivative at a zero distance is 0 (torch's: NaN).

    Args:
        anchor: any shape ``distance_function`` takes.
        positive: the same number of dimensions as ``anchor``.
        negative: the same number of dimensions as ``anchor``.
        distance_function: a callable of two tensors, or ``None``. Default: ``None``.
        margin: $\Delta > 0$. Default: ``1.0``.
        swap: use $\min(d(a, n), d(p, n))$. Default: ``False``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Returns:
        A scalar, or the distances' shape for ``'none'``; torch's dtype (that of the
        distances: float16/bfloat16 inputs are computed in float32 and rounded back, unless
        ``distance_function`` returns another dtype).

    Raises:
        ValueError: ``reduction`` is not one of the above; ``margin <= 0`` (torch's check).
        RuntimeError: the numbers of dimensions differ (torch's check).

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> a = torch.zeros(1, 2)
        >>> SF.triplet_margin_with_distance_loss(a, a, a + 3.0)
        tensor(0.)

    Replaces ``torch.nn.functional.triplet_margin_with_distance_loss``.
    """
    fn = "triplet_margin_with_distance_loss"
    red = check_reduction(fn, reduction, alias=False)  # torch's checks the three names itself
    check_tensors(fn, anchor=anchor, positive=positive, negative=negative)
    distance = _scaled(distance_function)
    if distance is distance_function:  # a user's: its distances' dtype
        dtype = out_dtype(anchor, positive, negative)
    else:  # torch's pairwise distance: as triplet_margin_loss (an integer pair's is the default dtype)
        pairs = [(anchor, positive), (anchor, negative)] + ([(positive, negative)] if swap else [])
        dtype = out_dtype(anchor, *(float_of(a, b) for a, b in pairs))
    res = call_torch(
        fn, F.triplet_margin_with_distance_loss, ("anchor", "positive", "negative"), up(anchor), up(positive),
        up(negative), distance_function=distance, margin=margin, swap=swap, reduction=red,
    )
    # only the upcast is ours: a float32 result of half inputs goes back to their dtype; any
    # other is torch's (a user's distance that returns float64 or float16 sets the dtype)
    return cast(res, dtype) if dtype in _LOW_PRECISION and res.dtype == torch.float32 else res


def _scaled(distance_function: Any) -> Any:
    """torch's pairwise distance as `_distance` computes it (scaled): for ``None`` (p = 2,
    eps = 1e-6), ``F.pairwise_distance`` and an ``nn.PairwiseDistance`` (what the module stores by
    default; its ``norm`` and ``eps``). Any other callable is the user's, unchanged."""
    if distance_function is None or distance_function is F.pairwise_distance:
        return functools.partial(_distance, p=2.0, eps=1e-6)
    if isinstance(distance_function, torch.nn.PairwiseDistance) and not distance_function.keepdim:
        return functools.partial(_distance, p=distance_function.norm, eps=distance_function.eps)
    return distance_function
