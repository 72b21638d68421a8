r"""safe_sqrt: ``torch.sqrt`` with a gradient of 0 at 0."""

from __future__ import annotations

from torch import Tensor

from stablelosses._autograd.sqrt import _SafeSqrt
from stablelosses._utils import cast, check_tensor, compute_dtype
from stablelosses.functional._operands import _float_result


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
    return cast(_SafeSqrt.call(cast(x, compute_dtype(x))), out_dtype)
