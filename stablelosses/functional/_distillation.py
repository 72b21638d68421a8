r"""distillation_loss: forward/reverse KL, generalised JSD and total variation between a
student's and a teacher's logits, exact with masked (``-inf``) vocabularies."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stablelosses._autograd.distillation import KINDS, DistillationHead, _Distillation, pad_vocab
from stablelosses._autograd.linear import (
    compute_dtype,
    linear_chunks,
    linear_chunks_reduced,
    stream_logits,
    whole_logits_needed,
)
from stablelosses._spec import (
    check_chunk_size,
    check_normalizer,
    check_real,
    check_reduction,
    quoted,
)
from stablelosses._utils import check_floating, divide, no_autocast, promote_types, upcast
from stablelosses.functional._masked import check_mask


def check_distillation_args(fn: str, kind: Any, beta: Any, temperature: Any,
                            reduction: Any, normalizer: Any) -> tuple[str, float, float, str, Any]:
    """The checked scalar arguments shared by `distillation_loss` and its fused form (also by
    the modules at construction). ``temperature`` is a Python number: the logits are divided
    inside the Function, so no ``(N, V)`` copy is kept."""
    if not (type(kind) is str and kind in KINDS):
        raise ValueError(f"{fn}: kind must be {quoted(KINDS)}, got {kind!r}")
    b = check_real(fn, "beta", beta, (("in [0, 1]", lambda v: 0.0 <= v <= 1.0),))
    t = check_real(fn, "temperature", temperature, (("a finite float > 0", lambda v: 0 < v < float("inf")),),
                   type_words="a float > 0", tensor=True)
    r = check_reduction(fn, reduction)
    return kind, b, t, r, check_normalizer(fn, normalizer, r)


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
    student_logits: Tensor, teacher_logits: Tensor, *, kind: str = "forward_kl", beta: float = 0.5,
    temperature: float = 1.0, mask: Tensor | None = None, reduction: str = "mean",
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
        tensor(0.0671, grad_fn=...)
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
        fn, kind, beta, temperature, reduction, normalizer)
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
    loss = _Distillation.call(s, t, rows, kind, beta, temperature)
    return reduce_tokens(loss, rows, reduction, normalizer)


def _check_linear_tensors(fn: str, si: Any, sw: Any, ti: Any, tw: Any, sb: Any, tb: Any) -> None:
    for name, t in (("student_input", si), ("student_weight", sw), ("teacher_input", ti),
                    ("teacher_weight", tw)):
        check_floating(fn, name, t)
    for name, b in (("student_bias", sb), ("teacher_bias", tb)):
        if b is not None:
            check_floating(fn, name, b)
    if si.dim() == 0:
        raise ValueError(f"{fn}: student_input must have a hidden dimension, got a 0-d tensor")
    if si.shape[:-1] != ti.shape[:-1]:
        raise ValueError(
            f"{fn}: student_input and teacher_input must have the same token shape, got "
            f"{tuple(si.shape)} and {tuple(ti.shape)}"
        )
    for side, x, w, b in (("student", si, sw, sb), ("teacher", ti, tw, tb)):
        if w.dim() != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(
                f"{fn}: {side}_weight must have shape (V, {x.shape[-1]}) for {side}_input of shape "
                f"{tuple(x.shape)}, got {tuple(w.shape)}"
            )
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"{fn}: {side}_bias must have shape ({w.shape[0]},), got {tuple(b.shape)}")


def linear_distillation_loss(
    student_input: Tensor, student_weight: Tensor, teacher_input: Tensor, teacher_weight: Tensor, *,
    student_bias: Tensor | None = None, teacher_bias: Tensor | None = None, kind: str = "forward_kl",
    beta: float = 0.5, temperature: float = 1.0, mask: Tensor | None = None, reduction: str = "mean",
    normalizer: float | Tensor | None = None, chunk_size: int | None = None,
) -> Tensor:
    r"""`distillation_loss` from both models' hidden states, without holding either ``(N, V)``.

    Equal to ``distillation_loss(F.linear(student_input, student_weight, student_bias),
    F.linear(teacher_input, teacher_weight, teacher_bias), ...)`` (the same formulas, the same
    ``-inf`` contract, the same reductions and ``normalizer``), computed by the chunk engine:
    ``chunk_size`` rows of both logits at a time (in float32, float64 for float64 inputs),
    never the whole ``(N, V_s)`` and ``(N, V_t)``.

    **Vocabularies of different sizes.** When $V_s \ne V_t$ the narrower logits are padded with
    $-\infty$ to the wider size, exactly: the model with the smaller vocabulary puts probability
    0 on the extra classes. So a forward KL where the teacher has mass on a class beyond the
    student's vocabulary is $+\infty$, JSD and TVD stay finite, and the padded columns carry no
    gradient. (Liger-Kernel pads with zeros, a logit of 0: a wrong, finite probability.)

    **Gradients.** The student's input, weight and bias get theirs; the teacher side is
    computed only when one of its tensors requires grad (otherwise no teacher logit gradient is
    formed). A backward with ``create_graph=True`` (double backward, a gradient penalty)
    recomputes both logits whole and returns the gradient as a graph. Under a ``torch.func``
    transform (``grad``, ``vmap``, ``jvp``, ``jacrev``, ``hessian``) and forward-mode AD both
    logits are formed whole instead, the same values.
    A ``normalizer`` tensor gets its gradient (``−loss / normalizer``); ``mask`` is a constant.

    Args:
        student_input: $(\dots, H_s)$ hidden states.
        student_weight: $(V_s, H_s)$ output layer of the student.
        teacher_input: $(\dots, H_t)$ hidden states with the token shape of ``student_input``.
        teacher_weight: $(V_t, H_t)$ output layer of the teacher.
        student_bias: $(V_s,)$ or ``None``. Default: ``None``.
        teacher_bias: $(V_t,)$ or ``None``. Default: ``None``.
        kind: as in `distillation_loss`. Default: ``'forward_kl'``.
        beta: as in `distillation_loss`. Default: ``0.5``.
        temperature: as in `distillation_loss`. Default: ``1.0``.
        mask: bool, broadcastable to the token shape ``student_input.shape[:-1]``. Default: ``None``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        normalizer: as in `distillation_loss`. Default: ``None``.
        chunk_size: rows per chunk of the flattened tokens (``None``: the engine's default, the
            chunk's logits within 64 MiB). Default: ``None``.

    Returns:
        The token shape for ``'none'``, else a scalar; float32 (float64 for float64 inputs).

    Raises:
        ValueError: as `distillation_loss`; the token shapes of the two inputs differ; a weight or
            bias whose shape does not fit its input; ``chunk_size`` < 1.
        TypeError: a tensor argument not floating point; a Python argument of the wrong type.

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> hs, ht = torch.randn(6, 8), torch.randn(6, 16)
        >>> ws = torch.randn(50, 8, requires_grad=True)
        >>> wt = torch.randn(60, 16)  # the teacher knows 10 more classes
        >>> loss = SF.linear_distillation_loss(hs, ws, ht, wt, kind="jsd", chunk_size=4)
        >>> loss.backward()
        >>> bool(loss.isfinite()) and bool(ws.grad.isfinite().all())
        True
    """
    fn = "linear_distillation_loss"
    _check_linear_tensors(fn, student_input, student_weight, teacher_input, teacher_weight,
                          student_bias, teacher_bias)
    kind, beta, temperature, reduction, normalizer = check_distillation_args(
        fn, kind, beta, temperature, reduction, normalizer)
    chunk_size = check_chunk_size(fn, chunk_size)
    tokens = student_input.shape[:-1]
    rows: tuple[Tensor, ...] = ()
    m = None
    xs, xt = student_input, teacher_input
    if mask is not None:
        m = check_mask(fn, mask, tokens, "the token shape", device=student_input.device)
        m = m.to(student_input.device).expand(tokens).reshape(-1)
        rows = (m,)
        # a masked token's hidden states are never multiplied (select): a NaN in padding
        # reaches no gradient, the linear weights' included
        keep = m.reshape(*tokens, 1)
        xs, xt = torch.where(keep, xs, 0.0), torch.where(keep, xt, 0.0)

    def on_logits(logits: tuple[Tensor, ...], token_mask: Tensor | None, red: str, norm: Any) -> Tensor:
        # the loss on both whole logits, the narrower vocabulary padded with -inf as the head
        # pads it: the double backward's dense form, and the whole call where the engine cannot
        v = max(u.shape[-1] for u in logits)
        us, ut = (pad_vocab(u, v) for u in logits)
        return distillation_loss(us, ut, kind=kind, beta=beta, temperature=temperature, mask=token_mask,
                                 reduction=red, normalizer=norm)

    if whole_logits_needed():
        cd = compute_dtype([xs, student_weight, student_bias, xt, teacher_weight, teacher_bias])
        with no_autocast(student_input.device.type):
            logits = (stream_logits(xs, student_weight, student_bias, cd),
                      stream_logits(xt, teacher_weight, teacher_bias, cd))
            return on_logits(logits, mask, reduction, normalizer)
    grad_on = torch.is_grad_enabled()

    def wants(*ts: Tensor | None) -> bool:
        return grad_on and any(t is not None and t.requires_grad for t in ts)

    head = DistillationHead(kind, beta, temperature, m is not None,
                            wants(student_input, student_weight, student_bias),
                            wants(teacher_input, teacher_weight, teacher_bias))

    def dense(logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> Tensor:
        return on_logits(logits, rows[0] if rows else None, "none", None).unsqueeze(1)

    streams = ((xs.reshape(-1, xs.shape[-1]), student_weight, student_bias),
               (xt.reshape(-1, xt.shape[-1]), teacher_weight, teacher_bias))
    if reduction == "none":
        return linear_chunks(head, streams, rows, chunk_size=chunk_size, dense=dense)[:, 0].reshape(tokens)
    n = streams[0][0].shape[0]
    cd = compute_dtype([t for s in streams for t in s])
    keep = torch.ones(n, dtype=cd, device=student_input.device) if m is None else m.to(cd)
    if reduction == "mean":
        if normalizer is None:
            normalizer = keep.sum()
        keep = divide(keep, normalizer.detach() if isinstance(normalizer, Tensor) else normalizer)
    total, _ = linear_chunks_reduced(head, streams, rows, keep.unsqueeze(1), chunk_size=chunk_size,
                                     dense=dense)
    if reduction == "mean" and isinstance(normalizer, Tensor) and normalizer.requires_grad:
        # the rows were weighted by 1 / normalizer as a constant; × n/n (exactly 1, 0 where
        # n = 0) gives the normalizer its gradient −total / n
        total = total * divide(normalizer.detach(), normalizer)
    return total
