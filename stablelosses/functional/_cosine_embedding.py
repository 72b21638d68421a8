r"""cosine_embedding_loss whose zero vector has gradient 0.

torch's cosine is $\langle x_1, x_2\rangle / \sqrt{(\lVert x_1\rVert^2 + 10^{-12})(\lVert x_2\rVert^2
+ 10^{-12})}$: at a zero $x_1$ the value is 0, but the gradient is $x_2$ divided by
$\sqrt{10^{-12}}\,\lVert x_2\rVert$, about $10^6/\sqrt{D}$ per element (−5.8e5 for $D = 3$ and
target 1). Here the cosine of a zero vector is 0 with gradient 0, as
[`cosine_similarity`][stablelosses.functional.cosine_similarity]; elsewhere torch's formula with
the two roots taken apart (torch's product of the squared norms overflows float32 from norms of
about 1e10, giving a cosine of 0 or NaN; a norm above about 1.8e19 still overflows its square,
as in torch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stablelosses._utils import cast
from stablelosses._utils import reduce as _reduce
from stablelosses.functional._torch_losses import (
    call_torch,
    check_reduction,
    check_tensors,
    float_of,
    out_dtype,
    up,
)

__all__ = ["cosine_embedding_loss"]

_EPSILON = 1e-12  # torch's, inside its square root


def _check_dims(fn: str, input1: Tensor, input2: Tensor, target: Tensor) -> int:
    """torch's checks: a 1-D target with 2-D inputs, a 0-D target with 1-D inputs."""
    if target.dim() not in (0, 1):
        raise RuntimeError(
            f"{fn}: 0D or 1D target tensor expected, multi-target not supported "
            f"(target {tuple(target.shape)})"
        )
    want = target.dim() + 1
    if input1.dim() != want or input2.dim() != want:
        raise RuntimeError(
            f"{fn}: {target.dim()}D target tensor expects {want}D input tensors, but found inputs with sizes "
            f"input1 {list(input1.shape)} and input2 {list(input2.shape)}"
        )
    return target.dim()


def _terms(x1: Tensor, x2: Tensor, target: Tensor, margin: float, dim: int) -> Tensor:
    # selected on the singular set only: a NaN in either vector keeps the NaN cosine
    nan = torch.isnan(x1).any(dim) | torch.isnan(x2).any(dim)
    zero = ((x1 == 0).all(dim) | (x2 == 0).all(dim)) & ~nan
    # a zero vector's cosine is 0 with gradient 0: compute on a safe copy, then select
    safe = zero.unsqueeze(dim)
    a = torch.where(safe, 1.0, x1)
    b = torch.where(safe, 1.0, x2)
    # each root taken alone: torch's product of the two squared norms overflows float32 from
    # norms of about 1e10 (a cosine of 0 or NaN where it is representable). N-sized: the passes
    # over the vectors are torch's (a norm above ~1.8e19 overflows its square, as in torch)
    prod = (a * b).sum(dim)
    denom = ((a * a).sum(dim) + _EPSILON).sqrt() * ((b * b).sum(dim) + _EPSILON).sqrt()
    cos = torch.where(zero, 0.0, prod / denom)
    pos = 1 - cos
    neg = (cos - margin).clamp_min(0)
    loss = torch.where(target == 1, pos, 0.0) + torch.where(target == -1, neg, 0.0)
    # NaN in, NaN out: torch's formula reads a NaN target as neither 1 nor -1 (a loss of 0)
    return torch.where(torch.isnan(target), float("nan"), loss)


def cosine_embedding_loss(
    input1: Tensor, input2: Tensor, target: Tensor, margin: float = 0, size_average: bool | None = None,
    reduce: bool | None = None, reduction: str = "mean",
) -> Tensor:
    r"""Cosine embedding loss; a zero vector gets gradient 0 (torch: about $10^6/\sqrt{D}$).

    $$ \ell_n = \begin{cases} 1 - \cos(x_{1,n}, x_{2,n}) & y_n = 1 \\
       \max(0, \cos(x_{1,n}, x_{2,n}) - \Delta) & y_n = -1 \\ 0 & \text{otherwise} \end{cases}
       \qquad \cos = \frac{\langle x_1, x_2\rangle}{\sqrt{(\lVert x_1\rVert^2 + 10^{-12})
       (\lVert x_2\rVert^2 + 10^{-12})}} $$

    torch's formula and value. A NaN target makes its pair's loss NaN (torch's formula reads it
    as neither 1 nor -1 and gives 0). Reductions: none ``(N,)``; sum; mean.

    **Gradient.** torch's where both vectors are nonzero. Where $x_1$ or $x_2$ is the zero
    vector (every entry 0) the cosine is 0, as torch's, and both gradients are defined as
    **0**: the cosine has no limit at the zero vector, and 0 is the minimal-norm choice (as
    [`cosine_similarity`][stablelosses.functional.cosine_similarity]). torch gives
    $x_2/(10^{-6}\lVert x_2\rVert)$ there: $-5.8\cdot 10^5$ per element for $D = 3$.
    ``target`` gets no gradient (torch's). NaN gives NaN.

    Args:
        input1: ``(N, D)`` or ``(D,)``.
        input2: ``input1``'s shape.
        target: $\pm 1$, ``(N,)`` or ``()``.
        margin: $\Delta$, in $[-1, 1]$. Default: ``0``.
        size_average: deprecated (as in torch); with ``reduce`` it overrides ``reduction``:
            ``False`` sums $\ell_n$ over the pairs.
        reduce: deprecated (as in torch); ``False`` returns one $\ell_n$ per pair.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Returns:
        A scalar, or ``(N,)`` for ``'none'`` (``()`` for ``(D,)`` vectors); the promoted dtype of
        ``input1`` and ``input2`` (half computed in float32).

    Raises:
        ValueError: ``reduction`` is not one of the above.
        TypeError: ``input1``, ``input2`` or ``target`` is not a tensor.
        RuntimeError: the numbers of dimensions do not fit (torch's checks, naming the
            arguments), or the shapes do not broadcast.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import stablelosses.functional as SF
        >>> x1 = torch.zeros(1, 3, requires_grad=True)
        >>> x2, y = torch.ones(1, 3), torch.tensor([1.0])
        >>> SF.cosine_embedding_loss(x1, x2, y).backward()
        >>> x1.grad
        tensor([[0., 0., 0.]])
        >>> x1.grad = None
        >>> F.cosine_embedding_loss(x1, x2, y).backward()
        >>> x1.grad
        tensor([[-577350.2500, -577350.2500, -577350.2500]])

    Replaces ``torch.nn.functional.cosine_embedding_loss``.
    """
    fn = "cosine_embedding_loss"
    red = check_reduction(fn, reduction, size_average, reduce)
    check_tensors(fn, input1=input1, input2=input2, target=target)
    dim = _check_dims(fn, input1, input2, target)
    # torch's formula: an integer input's x·x + EPSILON is the default float dtype
    dtype = out_dtype(input1, float_of(input1), float_of(input2))
    names = ("input1", "input2", "target")
    if dim == 0:
        # one pair as a batch of one: every intermediate 0-d would get a float64 tangent under
        # forward AD (torch 2.13: a 0-d float32 tensor with a Python float, e.g. sum + EPSILON)
        def one_pair(x1: Tensor, x2: Tensor, y: Tensor) -> Tensor:
            return _terms(x1[None], x2[None], y[None], margin, 1).squeeze(0)

        loss = call_torch(fn, one_pair, names, up(input1), up(input2), target)
    else:
        loss = call_torch(fn, _terms, names, up(input1), up(input2), target, margin, dim)
    res = _reduce(loss, red)
    return res if dtype is None else cast(res, dtype)
