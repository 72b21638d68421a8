r"""distillation_loss: forward/reverse KL, generalised JSD and total variation between a
student's and a teacher's logits, exact with masked (``-inf``) vocabularies."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stablelosses._autograd.distillation import KINDS, _distillation
from stablelosses._spec import REDUCTION, Arg, OneOf, OpSpec, Real
from stablelosses._utils import check_floating, promote_types, upcast
from stablelosses.functional._masked import check_mask
from stablelosses.functional._normalizer import NORMALIZER, check_normalizer, divide

KIND = OneOf(KINDS)
BETA = Real(
    (("in [0, 1]", lambda v: 0.0 <= v <= 1.0),),
    good=(0.0, 0.5, 1, 0.1),
    bad=((-0.1, ValueError), (1.5, ValueError), (float("nan"), ValueError), ("0.5", TypeError),
         (True, TypeError), (None, TypeError)),
)
# a Python number: the logits are divided inside the Function (no (N, V) copy is kept)
DISTILLATION_TEMPERATURE = Real(
    (("a finite float > 0", lambda v: 0 < v < float("inf")),),
    type_words="a float > 0",
    good=(0.05, 1, 2.5),
    bad=((0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
         ("0.1", TypeError), (True, TypeError), (None, TypeError), (torch.tensor(0.5), TypeError)),
)
DISTILLATION_ARGS = (
    Arg("kind", KIND), Arg("beta", BETA), Arg("temperature", DISTILLATION_TEMPERATURE),
    Arg("reduction", REDUCTION), Arg("normalizer", NORMALIZER),
)

SPEC = OpSpec(
    "distillation_loss",
    DISTILLATION_ARGS,
    replaces="TRL's generalized_jsd_loss (GKD), hand-written KL/JSD/TVD distillation losses",
    reference="float64 torch formulas on log_softmax; TRL's generalized_jsd_loss transcribed",
    tensors=("student_logits", "teacher_logits", "mask"),
)


def check_distillation_args(fn: str, spec: OpSpec, kind: Any, beta: Any, temperature: Any,
                            reduction: Any, normalizer: Any) -> tuple[str, float, float, str, Any]:
    """The checked scalar arguments shared by `distillation_loss` and its fused form."""
    kind, beta, temperature, reduction, normalizer = spec.check(kind, beta, temperature, reduction, normalizer)
    check_normalizer(fn, normalizer, reduction)
    return kind, beta, temperature, reduction, normalizer


def reduce_tokens(loss: Tensor, mask: Tensor | None, reduction: str, normalizer: Any) -> Tensor:
    """The token reduction of the distillation losses: ``loss`` is 0 on the False tokens of
    ``mask``; ``'mean'`` divides the sum by ``normalizer``, else by the number of True tokens,
    and gives 0 (gradient 0) for a zero denominator."""
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    if normalizer is None:
        normalizer = loss.new_full((), loss.numel()) if mask is None else mask.sum()
    return divide(total, normalizer)


def distillation_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    reduction: str = "mean",
    normalizer: float | Tensor | None = None,
) -> Tensor:
    r"""Distillation divergence between a student's and a teacher's logits, token by token.

    With $a = s / T$, $b = t / T$ (the logits divided by the temperature; **no** $T^2$ factor,
    as TRL's GKD), $\log q = \operatorname{log\_softmax}(a)$ (student) and
    $\log p = \operatorname{log\_softmax}(b)$ (teacher) over the last dimension, each token
    gives (a sum over the vocabulary):

    $$
    \begin{aligned}
    \text{forward\_kl}&: \operatorname{KL}(p\,\|\,q) = \textstyle\sum_v p_v (\log p_v - \log q_v),\\
    \text{reverse\_kl}&: \operatorname{KL}(q\,\|\,p),\\
    \text{jsd}&: \beta\,\operatorname{KL}(p\,\|\,M) + (1-\beta)\,\operatorname{KL}(q\,\|\,M),
      \quad \log M = \operatorname{logaddexp}(\log q + \log(1-\beta),\ \log p + \log\beta),\\
    \text{tvd}&: \tfrac12 \textstyle\sum_v |p_v - q_v|.
    \end{aligned}
    $$

    ``'jsd'`` is TRL's ``generalized_jsd_loss``: ``beta=0`` is the forward KL and ``beta=1``
    the reverse KL (the mixture is taken in log space in between). Reductions over the tokens
    (every dimension but the last): ``'none'`` the per-token values, 0 where ``mask`` is False;
    ``'sum'`` their sum; ``'mean'`` the sum divided by the number of True tokens, or by
    ``normalizer`` when given; a zero denominator (a fully masked batch) gives 0 with gradient 0.

    **The ``-inf`` contract** (a masked or top-k vocabulary):

    - a term whose weight is zero (teacher $p_v = 0$ in the forward KL, student $q_v = 0$ in the
      reverse KL, either side in the JSD's two sums) contributes **0 with gradient 0**, also
      where the other side is $-\infty$ too;
    - JSD (with $0 < \beta < 1$) and TVD are **finite for every input**;
    - a forward KL where the teacher has mass ($\log p_v > -\infty$) and the student is
      $-\infty$ is $+\infty$, the true value, never NaN (the same for the reverse KL with the
      sides swapped);
    - a row whose logits are all $-\infty$ is an empty distribution (every probability 0).

    **Gradient** with respect to the scaled student logits (divide by $T$ for $s$):
    forward KL $q \sum p - p$; reverse KL $q\,(r - \sum q r)$ with $r = \log q - \log p$
    (0 where $q = 0$); JSD $(1-\beta)\, q\,(r - \sum q r)$ with $r = \log q - \log M$; TVD
    $\tfrac12 q\,(\sigma - \sum \sigma q)$ with $\sigma = \operatorname{sign}(q - p)$
    ($\sigma = 0$ where $p = q$, the minimal-norm subgradient); the teacher's are the mirror
    images. On a row whose value is $+\infty$ the gradient with respect to the side whose
    derivative diverges (the teacher for the forward KL, the student for the reverse) is
    defined as 0; the other side's stays finite. A teacher whose logits require grad gets its
    gradient. Every gradient is written in differentiable operations: double backward and
    forward-mode AD (``torch.func.jvp``) are exact.

    float16 and bfloat16 logits are computed in float32 (``T = 0.05`` included); a NaN logit
    makes its token's value NaN.

    **Mask.** ``mask`` (bool, True = counts) broadcastable to ``student_logits.shape[:-1]``:
    a False token gives 0 with gradient 0 and its logits are never read (a NaN there does no
    harm).

    Args:
        student_logits: $(\dots, V)$ student logits (the distribution being trained).
        teacher_logits: $(\dots, V)$ teacher logits, the shape of ``student_logits``.
        kind: ``'forward_kl'`` | ``'reverse_kl'`` | ``'jsd'`` | ``'tvd'``. Default:
            ``'forward_kl'``.
        beta: the JSD interpolation $\beta \in [0, 1]$ (``'jsd'`` only). Default: ``0.5``.
        temperature: $T > 0$, a Python number dividing both logits. Default: ``1.0``.
        mask: bool tensor broadcastable to the token shape ``student_logits.shape[:-1]``, True =
            counts. Default: ``None`` (every token counts).
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        normalizer: replaces the denominator of ``'mean'``: a number $\ge 0$ or a 0-dim tensor
            (e.g. the token count over gradient accumulation and ranks, see the normalizer
            page); a tensor's value is not checked (that would sync). Default: ``None``.

    Shape:
        - student_logits, teacher_logits: $(\dots, V)$.
        - mask: broadcastable to $(\dots)$.
        - output: $(\dots)$ for ``'none'``, else a scalar.

    Returns:
        The loss: float32 for float16/bfloat16 logits (float64 when either is float64).

    Raises:
        ValueError: ``kind`` unknown; ``beta`` outside $[0, 1]$; ``temperature`` not a finite
            number $> 0$; ``reduction`` unknown; ``normalizer`` negative, infinite or NaN, a
            tensor that is not 0-dim, or given with a ``reduction`` other than ``'mean'``;
            the two logits' shapes differ; ``mask`` does not broadcast to the token shape.
        TypeError: a logit tensor not floating point; ``mask`` not bool; a Python argument of
            the wrong type.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> import stablelosses.functional as SF
        >>> s = torch.tensor([[1.0, 0.0, float("-inf")]], requires_grad=True)
        >>> t = torch.tensor([[2.0, 0.0, float("-inf")]])
        >>> ls, lt = F.log_softmax(s, -1), F.log_softmax(t, -1)
        >>> F.kl_div(ls, lt, log_target=True, reduction="sum")  # 0·(−inf − (−inf)): NaN
        tensor(nan, grad_fn=...)
        >>> loss = SF.distillation_loss(s, t)
        >>> loss
        tensor(0.0266, grad_fn=...)
        >>> loss.backward()
        >>> s.grad
        tensor([[-0.1497,  0.1497,  0.0000]])

    References:
        Agarwal et al., On-Policy Distillation of Language Models: Learning from Self-Generated
        Mistakes (GKD, 2024); TRL's ``GKDTrainer.generalized_jsd_loss``.
    """
    fn = "distillation_loss"
    check_floating(fn, "student_logits", student_logits)
    check_floating(fn, "teacher_logits", teacher_logits)
    kind, beta, temperature, reduction, normalizer = check_distillation_args(
        fn, SPEC, kind, beta, temperature, reduction, normalizer)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"{fn}: student_logits and teacher_logits must have the same shape, got "
            f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}"
        )
    if student_logits.dim() == 0:
        raise ValueError(f"{fn}: student_logits must have a vocabulary dimension, got a 0-d tensor")
    tokens = student_logits.shape[:-1]
    rows = None
    if mask is not None:
        rows = check_mask(fn, mask, tokens, "the token shape", device=student_logits.device)
        rows = rows.to(student_logits.device).expand(tokens)
    dtype = promote_types(upcast(student_logits).dtype, upcast(teacher_logits).dtype)
    s, t = student_logits.to(dtype), teacher_logits.to(dtype)
    loss = _distillation(s, t, rows, kind, beta, temperature)
    return reduce_tokens(loss, rows, reduction, normalizer)
