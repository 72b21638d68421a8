r"""logaddexp with defined gradients where both arguments are the same infinity."""

from __future__ import annotations

from torch import Tensor

from stablelosses._autograd.logaddexp import _LogAddExp
from stablelosses._utils import cast, write_out
from stablelosses.functional._operands import _binary_operands


def logaddexp(input: Tensor, other: Tensor, *, out: Tensor | None = None) -> Tensor:
    r"""``log(exp(input) + exp(other))``, with gradients 0 when both are ``-inf``.

    $$ \operatorname{logaddexp}(a, b) = \max(a, b) + \log\!\big(1 + e^{-|a - b|}\big) $$

    The value is ``torch.logaddexp``'s (broadcasting and type promotion as torch; both
    operands are tensors, as torch requires): both ``-inf`` gives ``-inf``, a ``+inf`` gives
    ``+inf``, NaN gives NaN.

    **Gradient.** $\partial/\partial a = \sigma(a - b)$, $\partial/\partial b = \sigma(b - a)$.
    Where both are ``-inf`` (two masked log-probabilities) the output does not move and both
    gradients are **0**; ``torch.logaddexp`` computes $\sigma(-\infty + \infty)$ = NaN. Where
    both are ``+inf`` each gets $\tfrac12$ (the symmetric limit); where only one is ``+inf``
    it gets 1 and the other 0.

    Args:
        input: tensor (a Python number raises ``TypeError``, as in ``torch.logaddexp``).
        other: tensor, broadcastable with ``input``.
        out: the output tensor, as in ``torch.logaddexp``: the result is written into it and
            it is returned; not differentiable (torch's ``RuntimeError`` when an input
            requires grad). Default: ``None``.

    Returns:
        Tensor of the broadcast shape in the promoted floating dtype (float16/bfloat16
        computed in float32).

    Raises:
        TypeError: an operand is not a tensor (as torch), or one is complex.
        RuntimeError: the shapes do not broadcast.

    Shape:
        ``input`` and ``other`` broadcastable; output: the broadcast shape.

    Example:
        >>> import torch
        >>> from stablelosses.functional import logaddexp
        >>> a = torch.tensor([float("-inf"), 0.0], requires_grad=True)
        >>> b = torch.tensor([float("-inf"), 0.0])
        >>> torch.logaddexp(a, b).sum().backward(); a.grad
        tensor([   nan, 0.5000])
        >>> a.grad = None
        >>> logaddexp(a, b).sum().backward(); a.grad
        tensor([0.0000, 0.5000])

    Replaces ``torch.logaddexp``.
    """
    for name, v in (("input", input), ("other", other)):
        if not isinstance(v, Tensor):  # torch.logaddexp takes no Python number either
            raise TypeError(f"logaddexp: {name} must be a torch.Tensor, got {type(v).__name__}")
    a, b, out_dtype = _binary_operands("logaddexp", input, other, ("input", "other"))
    if out is not None:
        return write_out("logaddexp", cast(_LogAddExp.call(a, b), out_dtype), out, input, other)
    return cast(_LogAddExp.call(a, b), out_dtype)
