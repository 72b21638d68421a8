r"""normalize and cosine_similarity: exact unit vectors, 0 with gradient 0 for a zero vector."""

from __future__ import annotations

import torch
from torch import Tensor

from stablelosses._autograd.vector import _Normalize
from stablelosses._spec import check_nonnegative, check_p_norm
from stablelosses._utils import broadcast_shapes, cast, check_floating, compute_dtype, wrap_dim, write_out
from stablelosses.functional._operands import _binary_operands


def _normalize_below_one(x: Tensor, p: float, dim: int, eps: float) -> Tensor:
    """``p < 1`` is no norm (for ``p <= 0`` it is 0 as soon as one entry is): torch's formula,
    ``eps`` defaulting to torch's ``1e-12``, with the zero-vector rule (0, gradient 0)."""
    if x.shape[dim] == 0:
        return x.clone()
    n = torch.linalg.vector_norm(x, p, dim, keepdim=True)
    y = x / n.clamp_min(eps if eps > 0.0 else 1e-12)
    if eps > 0.0:
        return y
    return torch.where(x.abs().amax(dim, keepdim=True) == 0, 0.0, y)


def normalize(
    input: Tensor, p: float = 2.0, dim: int = 1, eps: float = 0.0, out: Tensor | None = None
) -> Tensor:
    r"""Divide ``input`` by its $p$-norm over ``dim``; a zero vector gives 0 with gradient 0.

    $$ \operatorname{normalize}(x) = \frac{x}{\max(\lVert x\rVert_p,\ \epsilon)} $$

    The norm is computed as $s\,\lVert x/s\rVert_p$ with $s = \max_i |x_i|$, so no square
    overflows or underflows: entries of ``1e20``, ``3e38`` or ``1e-30`` in float32 give the
    exact unit vector (``F.normalize`` gives 0 for the first two and a wrong length for the
    third). With ``eps = 0`` (the default) a zero vector gives 0; with ``eps > 0`` this is
    ``F.normalize``'s formula, value and gradient. A NaN (or an infinite entry) gives NaN
    over its vector.

    **Gradient.** $\big(g - \langle g, y\rangle\, w\big)/\lVert x\rVert_p$ with
    $w = \partial\lVert x\rVert_p/\partial x$ ($w = y$ for $p = 2$). At the zero vector
    (``eps = 0``) it is defined as **0**: $x/\lVert x\rVert$ has no limit at 0, and 0 is the
    minimal-norm choice. ``F.normalize`` with its default ``eps=1e-12`` gives $g/\epsilon$ =
    ``1e12`` there. Where $\lVert x\rVert_p < \epsilon$ the gradient is $g/\epsilon$ (the
    clamp), as torch's.

    Args:
        input: floating-point tensor.
        p: exponent of the norm, a float or ``inf``. Below 1 (not a norm: ``0.5``, ``0``,
            ``-1``, as ``F.normalize`` accepts) the value is torch's formula with
            ``torch.linalg.vector_norm``, without the scaling above, and ``eps = 0`` means
            torch's ``1e-12`` except at the zero vector. Default: ``2.0``.
        dim: dimension to normalise over. Default: ``1``.
        eps: lower bound of the divisor, as in ``F.normalize``. Default: ``0.0``.
        out: the output tensor, as in ``F.normalize``: the result is written into it (resized
            as torch resizes) and it is returned; not differentiable (torch's ``RuntimeError``
            when ``input`` requires grad). Default: ``None``.

    Returns:
        Tensor of ``input``'s shape and dtype (float16/bfloat16 computed in float32).

    Raises:
        TypeError: ``input`` is not a floating-point tensor, or ``p``/``eps``/``dim`` has the
            wrong type.
        ValueError: ``p`` is NaN or ``eps < 0``.
        IndexError: ``dim`` is out of range.

    Shape:
        Any shape; the norm is taken over ``dim``.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> from stablelosses.functional import normalize
        >>> x = torch.zeros(1, 3, requires_grad=True)
        >>> F.normalize(x)[0, 0].backward(); x.grad
        tensor([[1.0000e+12, 0.0000e+00, 0.0000e+00]])
        >>> x.grad = None
        >>> normalize(x)[0, 0].backward(); x.grad
        tensor([[0., 0., 0.]])
        >>> F.normalize(torch.tensor([[3e20, 4e20]]))
        tensor([[0., 0.]])
        >>> normalize(torch.tensor([[3e20, 4e20]]))
        tensor([[0.6000, 0.8000]])

    References:
        Blue, "A portable Fortran program to find the Euclidean norm of a vector", ACM TOMS
        1978 (scaling before squaring).

    Replaces ``torch.nn.functional.normalize`` (which defaults to ``eps=1e-12``).
    """
    x = check_floating("normalize", "input", input)
    pf, e = check_p_norm("normalize", p), check_nonnegative("normalize", "eps", eps)
    d = wrap_dim("normalize", dim, x.ndim)
    out_dtype = x.dtype
    xc = x.reshape(1) if x.ndim == 0 else x
    xw = xc.to(compute_dtype(xc))
    if pf >= 1.0:
        y = _Normalize.call(xw, pf, d, e)[0]
        if y.requires_grad and y.dtype == out_dtype:
            # backward saved y: the caller edits a copy in place, as F.normalize's result (one
            # pass here; recomputing y in backward would cost four)
            y = y.clone()
    else:
        y = _normalize_below_one(xw, pf, d, e)
    if out is not None:
        return write_out("normalize", cast(y.reshape(x.shape), out_dtype), out, input)
    return cast(y.reshape(x.shape), out_dtype)


def cosine_similarity(x1: Tensor, x2: Tensor, dim: int = 1, eps: float = 0.0) -> Tensor:
    r"""Cosine of the angle between ``x1`` and ``x2`` along ``dim``; 0 with gradient 0 for a zero vector.

    $$ \cos(x_1, x_2) = \sum_i \frac{x_{1,i}}{\max(\lVert x_1\rVert_2, \epsilon)}\,
       \frac{x_{2,i}}{\max(\lVert x_2\rVert_2, \epsilon)} $$

    Each vector is normalised first, with the scaled norms of
    [`normalize`][stablelosses.functional.normalize], so entries of ``1e20``, ``3e38`` or
    ``1e-30`` give the exact cosine. Broadcasting and type promotion as
    ``F.cosine_similarity``; with ``eps > 0`` the value is torch's. NaN gives NaN.

    **Gradient.** The derivative of the formula above, through the defined gradient of
    ``normalize``: when either vector is zero (``eps = 0``) the cosine is 0 and both
    gradients are **0** (``F.cosine_similarity`` gives $\hat x_2/\epsilon$ = ``1e8`` with its
    default ``eps=1e-8``). Where $0 < \lVert x\rVert < \epsilon$ this is the true derivative
    of the clamped formula, while torch's backward ignores the clamp there.

    Args:
        x1: first input.
        x2: second input, broadcastable with ``x1``.
        dim: dimension of the vectors. Default: ``1``.
        eps: lower bound of each norm. Default: ``0.0`` (torch: ``1e-8``).

    Returns:
        The broadcast shape without ``dim``, in the promoted dtype (float16/bfloat16 computed in
        float32).

    Raises:
        TypeError: an input is not a tensor, or ``eps``/``dim`` has the wrong type.
        ValueError: ``eps < 0``.
        RuntimeError: the shapes do not broadcast.
        IndexError: ``dim`` is out of range.

    Shape:
        ``x1``: $(*_1, D, *_2)$, ``x2`` broadcastable to it; output $(*_1, *_2)$.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> from stablelosses.functional import cosine_similarity
        >>> x = torch.zeros(1, 2, requires_grad=True)
        >>> F.cosine_similarity(x, torch.tensor([[1.0, 0.0]])).backward(); x.grad
        tensor([[100000000.,         0.]])
        >>> x.grad = None
        >>> cosine_similarity(x, torch.tensor([[1.0, 0.0]])).backward(); x.grad
        tensor([[0., 0.]])

    Replaces ``torch.nn.functional.cosine_similarity`` / ``nn.CosineSimilarity``.
    """
    for name, v in (("x1", x1), ("x2", x2)):
        if not isinstance(v, Tensor):
            raise TypeError(f"cosine_similarity: {name} must be a torch.Tensor, got {type(v).__name__}")
    a, b, out_dtype = _binary_operands("cosine_similarity", x1, x2, ("x1", "x2"))
    e = check_nonnegative("cosine_similarity", "eps", eps)
    shape = broadcast_shapes(a.shape, b.shape)
    d = wrap_dim("cosine_similarity", dim, len(shape))
    if len(shape) == 0:
        shape = torch.Size([1])
    a, b = a.expand(shape), b.expand(shape)
    ua, _ = _Normalize.call(a, 2.0, d, e)
    ub, _ = _Normalize.call(b, 2.0, d, e)
    out = (ua * ub).sum(d)
    return cast(out, out_dtype)


__all__ = ["normalize", "cosine_similarity"]
