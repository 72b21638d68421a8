r"""Fused output layer + loss for large vocabularies: ``linear_cross_entropy``, ``linear_focal_loss``."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from stablelosses._autograd._base import fast_apply
from stablelosses._autograd.linear import LinearLossConfig, _LinearLossReduced, _LinearLossRows
from stablelosses._utils import (
    autocast_to_float32,
    check_floating,
    check_gamma,
    check_nonnegative,
    check_real,
    check_reduction,
    check_tensor,
    promote_types,
)
from stablelosses.functional._classification import _INDEX_DTYPES, _check_label_smoothing
from stablelosses.functional._masked import check_mask

# Logits of one chunk: at most this many bytes (64 MiB) in the compute dtype.
CHUNK_BYTES = 64 * 2**20

_rows, _reduced = fast_apply(_LinearLossRows), fast_apply(_LinearLossReduced)


def default_chunk_size(vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk for ``chunk_size=None``: the chunk's logits fit in ``CHUNK_BYTES``.

    The largest power of two that fits (at least 1 row); it depends on the vocabulary and the
    compute dtype only, so any problem whose logits exceed 64 MiB is split.
    """
    rows = max(1, CHUNK_BYTES // (max(vocab, 1) * (torch.finfo(dtype).bits // 8)))
    return 1 << (rows.bit_length() - 1)


def _check_args(
    fn: str, input: object, weight: object, target: object, bias: object, ignore_index: object,
    reduction: object, z_loss: object, softcap: object, chunk_size: object,
) -> tuple[float, float | None, int]:
    check_reduction(fn, reduction)
    x = check_floating(fn, "input", input)
    w = check_floating(fn, "weight", weight)
    t = check_tensor(fn, "target", target)
    if x.dim() == 0:
        raise ValueError(f"{fn}: input must have shape (..., H), got a 0-d tensor")
    if w.dim() != 2 or w.shape[1] != x.shape[-1]:
        raise RuntimeError(
            f"{fn}: weight must have shape (V, H) with H = input.shape[-1] = {x.shape[-1]}, "
            f"got {list(w.shape)}"
        )
    if bias is not None:
        b = check_floating(fn, "bias", bias)
        if b.shape != (w.shape[0],):
            raise RuntimeError(f"{fn}: bias must have shape ({w.shape[0]},) or be None, got {list(b.shape)}")
    if t.dtype not in _INDEX_DTYPES:
        raise RuntimeError(f"{fn}: target must hold class indices (int64 or uint8), got {t.dtype}")
    if t.shape != x.shape[:-1]:
        raise ValueError(
            f"{fn}: target must have shape {list(x.shape[:-1])} (input's without H), got {list(t.shape)}"
        )
    return check_linear_options(fn, ignore_index, z_loss, softcap, chunk_size)


_F32_MAX = torch.finfo(torch.float32).max


def check_linear_options(
    fn: str, ignore_index: object, z_loss: object, softcap: object, chunk_size: object,
) -> tuple[float, float | None, int]:
    """``(z_loss, softcap, chunk)`` checked (``chunk`` -1 for automatic): the arguments that
    need no tensor, also checked by the modules at construction."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{fn}: ignore_index must be an int, got {type(ignore_index).__name__}")
    z = check_nonnegative(fn, "z_loss", z_loss)
    if not math.isfinite(z):
        raise ValueError(f"{fn}: z_loss must be finite, got {z}")
    cap = None
    if softcap is not None:
        cap = check_real(fn, "softcap", softcap)
        # the cap is applied in float32 (or the input's wider dtype): above float32's max it
        # becomes inf there and c·tanh(u/c) is inf·0 = NaN
        if not (0 < cap <= _F32_MAX):
            raise ValueError(
                f"{fn}: softcap must be None or a finite number > 0 and at most float32's max "
                f"({_F32_MAX:.4g}), got {softcap}"
            )
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(f"{fn}: chunk_size must be an int or None, got {type(chunk_size).__name__}")
        if chunk_size < 1:
            raise ValueError(f"{fn}: chunk_size must be >= 1, got {chunk_size}")
    return z, cap, -1 if chunk_size is None else chunk_size


def _linear_loss(
    fn: str, input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int,
    reduction: str, label_smoothing: float, z_loss: float, softcap: float | None, gamma: float | None,
    chunk_size: int, mask: Tensor | None = None,
) -> Tensor:
    tensors = (input, weight) if bias is None else (input, weight, bias)
    cd = torch.float64 if any(v.dtype == torch.float64 for v in tensors) else torch.float32
    chunk = default_chunk_size(weight.shape[0], cd) if chunk_size < 0 else chunk_size
    cfg = LinearLossConfig(fn, int(ignore_index), label_smoothing, z_loss, softcap, gamma, chunk)
    x = input.reshape(-1, input.shape[-1])
    t = target.reshape(-1).long()
    kept = None
    if mask is not None:
        # a masked-out row is an ignored row whose hidden state is never read (select, no multiply)
        m = check_mask(fn, mask, target.shape, "the per-row loss", device=x.device).to(x.device)
        m = m.expand(target.shape).reshape(-1)
        x = torch.where(m[:, None], x, 0.0)
        t = torch.where(m, t, int(ignore_index))
        kept = (t != int(ignore_index)).any() if reduction == "mean" else None
    out_dtype = input.dtype
    for v in tensors[1:]:
        out_dtype = promote_types(out_dtype, v.dtype)
    if out_dtype in (torch.float16, torch.bfloat16) and autocast_to_float32(input):
        out_dtype = torch.float32
    if reduction == "none":
        return _rows(x, weight, bias, t, cfg, cd).reshape(target.shape).to(out_dtype)
    grad_on = torch.is_grad_enabled()
    needs = (
        grad_on and input.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    loss = _reduced(x, weight, bias, t, cfg, reduction == "mean", needs, cd)[0]
    if kept is not None:
        loss = torch.where(kept, loss, 0.0)  # no kept row: 0 (masked_mean), not 0 / 0
    return loss.to(out_dtype)


def linear_cross_entropy(
    input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *, ignore_index: int = -100,
    reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
    chunk_size: int | None = None, mask: Tensor | None = None,
) -> Tensor:
    r"""Cross-entropy of a linear layer's logits, computed chunk by chunk: the $(N, V)$ logits never exist.

    With logits $u = x W^\top + b$ (softcapped to $l = c \tanh(u / c)$ when `softcap=c`, a
    $-\infty$ entry staying $-\infty$), the value equals
    `cross_entropy(l, target, ignore_index=..., reduction=..., label_smoothing=ε)` plus the
    z-loss: for row $i$ with its $K_i$ unmasked classes $U_i$ (logit $\ne -\infty$),

    $$
    \ell_i = (1 - \varepsilon)(-\log p_{i,t_i}) + \frac{\varepsilon}{K_i} \sum_{c \in U_i} (-\log p_{i,c})
             + z \operatorname{logsumexp}(l_i)^2,
    $$

    and $\ell_i = 0$ when $t_i$ is `ignore_index` or every logit of row $i$ is $-\infty$ (such a
    row is not counted). `'mean'` divides $\sum_i \ell_i$ by the number of kept rows (NaN when
    there is none, as torch, with zero gradients; 0 with a `mask`), `'sum'` sums, `'none'`
    returns $\ell$ with the shape of `target`. A finite logit such as `finfo.min` is an
    ordinary logit; only $-\infty$ masks.

    The rows are processed in chunks of `chunk_size` rows; each chunk computes its logits, loss
    and gradient in float32 (float64 for float64 inputs), so peak memory is one chunk's logits
    plus the gradient of `weight`. For `'mean'`/`'sum'` the gradients are computed during the
    forward (the backward only scales them: no second matmul pass); `'none'` recomputes each
    chunk in the backward. The chunk loop is a Python loop over `N`: `torch.compile` unrolls it
    and specialises on `N` (no value-dependent branch, no host sync).

    **Gradient**: $\partial \ell_i / \partial l_{i,c} = (1 + 2 z \operatorname{lse}_i)\, p_{i,c}
    - (1 - \varepsilon)[c = t_i] - \frac{\varepsilon}{K_i}[c \in U_i]$, times
    $1 - \tanh^2(u/c)$ under softcapping; then $\partial/\partial x = g W$,
    $\partial/\partial W = g^\top x$, $\partial/\partial b = \sum_i g_i$. $\log p_t$ and
    $\operatorname{lse}$ are computed as $(l_t - m) - \operatorname{log1p}(\sum_{j \ne \arg\max} e^{l_j - m})$
    (exact as $p_t \to 1$). Defined values: a masked ($-\infty$) class gets gradient exactly 0,
    so a vocabulary entry masked by a $-\infty$ bias gets an exactly zero weight row unless it is
    a target; ignored and fully masked rows get gradient 0. First order only: differentiating
    the gradient (double backward, `torch.func.hessian`) raises `RuntimeError`; forward-mode AD
    is not implemented.

    **Mask.** ``mask`` (bool, True = counts) broadcastable to ``target`` drops rows: a False
    row becomes an ignored row (the chunked code's own path) and its hidden state is replaced
    by 0 before the matmul, so a NaN in padding reaches no gradient (``weight``'s included).
    ``'mean'`` divides by the kept rows; with a mask, no row kept by ``mask`` and
    ``ignore_index`` gives **0** with gradient 0 instead of NaN. ``mask=None`` adds nothing.

    Args:
        input: hidden states $(N, H)$ or $(\dots, H)$, any float dtype (float16/bfloat16 are
            computed in float32).
        weight: output-layer weight $(V, H)$, as `nn.Linear.weight`.
        target: class indices (int64 or uint8) of shape `input.shape[:-1]`.
        bias: output-layer bias $(V)$ or `None`. Default: `None`.
        ignore_index: target value that contributes nothing. Default: `-100`.
        reduction: `'none'` | `'mean'` | `'sum'`. Default: `'mean'`.
        label_smoothing: $\varepsilon \in [0, 1]$, spread over the unmasked classes. Default: `0.0`.
        z_loss: coefficient $z \ge 0$ of the PaLM auxiliary loss $z \operatorname{lse}^2$ per kept
            row. Default: `0.0`.
        softcap: $c > 0$ for Gemma 2's $c \tanh(l / c)$ logit soft-capping, or `None`.
        chunk_size: rows per chunk, or `None` for a size that keeps one chunk's logits within
            64 MiB (a power of two, from $V$ and the dtype).
        mask: bool tensor, True = counts, broadcastable to ``target`` (keyword-only);
            ``None``: every entry counts. Default: ``None``.

    Returns:
        The loss: a scalar, or shape of `target` for `'none'`; dtype of `input` and `weight`
        promoted (float32 for float16/bfloat16 inside autocast). Gradients come back in each
        parameter's dtype.

    Raises:
        ValueError: bad `reduction`, `target` shape, negative or infinite `z_loss`, `softcap`
            not $> 0$, `chunk_size < 1`, 0-d `input`.
        TypeError: non-float `input`/`weight`/`bias`, non-int `ignore_index`/`chunk_size`,
            non-number `label_smoothing`/`z_loss`/`softcap`.
        RuntimeError: `weight`/`bias` shape, `target` dtype, `label_smoothing` outside $[0, 1]$,
            a target index out of range (raised by the gather), double backward.
        ValueError: ``mask`` does not broadcast to the unreduced loss (TypeError: not bool).

    Shape:
        input $(\dots, H)$, weight $(V, H)$, bias $(V)$, target $(\dots)$; output $()$ or $(\dots)$.

    Example:
        >>> import torch, torch.nn.functional as F, stablelosses.functional as SF
        >>> x = torch.randn(6, 4, requires_grad=True)
        >>> W = torch.randn(10, 4, requires_grad=True)
        >>> t = torch.tensor([1, 2, 3, -100, 5, 6])
        >>> loss = SF.linear_cross_entropy(x, W, t, chunk_size=4)
        >>> torch.allclose(loss, F.cross_entropy(x @ W.T, t))
        True
        >>> loss.backward()
        >>> bool(W.grad[0].abs().sum() > 0)
        True

    References:
        Wijmans et al., *Cut Your Losses in Large-Vocabulary Language Models* (2024);
        Hsu et al., *Liger Kernel* (2024); Chowdhery et al., *PaLM* (2022) for the z-loss;
        Gemma Team, *Gemma 2* (2024) for soft-capping.

    Replaces `F.cross_entropy(F.linear(input, weight, bias), target)`.
    """
    fn = "linear_cross_entropy"
    z, cap, chunk = _check_args(
        fn, input, weight, target, bias, ignore_index, reduction, z_loss, softcap, chunk_size
    )
    eps = _check_label_smoothing(fn, label_smoothing)  # cross_entropy's check: the same values pass
    return _linear_loss(
        fn, input, weight, target, bias, ignore_index, reduction, eps, z, cap, None, chunk, mask
    )


def linear_focal_loss(
    input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *, gamma: float = 2.0,
    ignore_index: int = -100, reduction: str = "mean", z_loss: float = 0.0, softcap: float | None = None,
    chunk_size: int | None = None, mask: Tensor | None = None,
) -> Tensor:
    r"""Focal loss of a linear layer's logits, chunked like `linear_cross_entropy`.

    Equals `focal_loss(l, target, gamma=γ, ignore_index=..., reduction=...)` on the logits $l$
    of `linear_cross_entropy` (bias, softcap) plus the same z-loss:

    $$
    \ell_i = (1 - p_{i,t_i})^{\gamma} (-\log p_{i,t_i}) + z \operatorname{logsumexp}(l_i)^2,
    $$

    with $1 - p_t = -\operatorname{expm1}(\log p_t)$ and $\log p_t$ computed from the other
    classes, so the loss keeps full relative accuracy at large margins. Ignored and fully
    masked rows, the reductions and `'mean'`'s denominator are those of `linear_cross_entropy`;
    `gamma=0` equals it.

    **Gradient**: $\partial \ell_i / \partial l_{i,c} = A_i (p_{i,c} - [c = t_i])
    + 2 z \operatorname{lse}_i\, p_{i,c}$ with
    $A = (1 - p_t)^\gamma (1 + \gamma p_t r)$, $r = -\log p_t / (1 - p_t)$ ($r = 1$ at $p_t = 1$),
    finite for every $\gamma \ge 0$; then through softcap and the linear layer as in
    `linear_cross_entropy`. First order only (double backward raises `RuntimeError`).

    **Mask.** As in `linear_cross_entropy`: a False row of ``mask`` (broadcastable to
    ``target``) is an ignored row that is never read; a masked ``'mean'`` with no kept row is 0.

    Args:
        input: hidden states $(\dots, H)$.
        weight: output-layer weight $(V, H)$.
        target: class indices of shape `input.shape[:-1]`.
        bias: output-layer bias $(V)$ or `None`. Default: `None`.
        gamma: focusing parameter $\gamma \ge 0$, finite. Default: `2.0`.
        ignore_index: target value that contributes nothing. Default: `-100`.
        reduction: `'none'` | `'mean'` | `'sum'`. Default: `'mean'`.
        z_loss: z-loss coefficient $\ge 0$. Default: `0.0`.
        softcap: logit soft-capping $c > 0$ or `None`. Default: `None`.
        chunk_size: rows per chunk or `None` (automatic). Default: `None`.
        mask: bool tensor, True = counts, broadcastable to ``target`` (keyword-only);
            ``None``: every entry counts. Default: ``None``.

    Returns:
        The loss, as `linear_cross_entropy`.

    Raises:
        ValueError: `gamma` negative, infinite or NaN; and as `linear_cross_entropy`.
        TypeError: `gamma` not a number; and as `linear_cross_entropy`.
        RuntimeError: as `linear_cross_entropy`.
        ValueError: ``mask`` does not broadcast to the unreduced loss (TypeError: not bool).

    Shape:
        input $(\dots, H)$, weight $(V, H)$, bias $(V)$, target $(\dots)$; output $()$ or $(\dots)$.

    Example:
        >>> import torch, stablelosses.functional as SF
        >>> x = torch.tensor([[30.0, 0.0]], requires_grad=True)
        >>> W = torch.eye(2)
        >>> SF.linear_focal_loss(x, W, torch.tensor([0]), gamma=0.5)  # exact tail; softmax then log: 0
        tensor(2.8625e-20, grad_fn=...)

    References:
        Lin et al., *Focal Loss for Dense Object Detection* (2017).

    Replaces `focal_loss(F.linear(input, weight, bias), target)`.
    """
    fn = "linear_focal_loss"
    z, cap, chunk = _check_args(
        fn, input, weight, target, bias, ignore_index, reduction, z_loss, softcap, chunk_size
    )
    g = check_gamma(fn, gamma)
    return _linear_loss(
        fn, input, weight, target, bias, ignore_index, reduction, 0.0, z, cap, g, chunk, mask
    )

