r"""token_logps and sequence_logps: each token's log-probability under ``softmax(logits / T)``,
and their masked sum or mean per sequence: the one primitive the preference and policy losses
read their per-sequence numbers from.

The row is the row core's class-index row (``rows.index_row``, through cross-entropy's
Function): the exact tail of ``log p_t`` as ``p_t → 1``, ``-inf`` logits at other classes read
as probability 0, a label at a ``-inf`` logit ``-inf`` with the finite gradient
``onehot − softmax``, and ignored positions 0 with gradient 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stablelosses._autograd.cross_entropy import _ClassIndexCE
from stablelosses._autograd.linear import compute_dtype, linear_chunks, stream_logits, whole_logits_needed
from stablelosses._autograd.token_logps import token_logps_head
from stablelosses._spec import check_chunk_size, check_flag, check_int, check_real, check_temperature
from stablelosses._utils import check_floating, check_tensor, no_autocast, target_index_errors, upcast
from stablelosses.functional._masked import entropy as entropy_of


def check_linear_logps_args(fn: str, ignore_index: object, temperature: object, chunk_size: object,
                            flag: object, flag_name: str) -> tuple[int, Any, int | None, bool]:
    """The scalar arguments of the linear forms. ``temperature``: a Python number, or a 0-d
    floating tensor that does not require grad (a constant of the engine's rows), checked on the
    host in eager mode and never read while tracing (``float(T)`` cannot be traced; there an
    invalid value gives NaN, as `check_temperature` does)."""
    if (isinstance(temperature, Tensor) and temperature.ndim == 0 and temperature.is_floating_point()
            and not temperature.requires_grad):
        t = check_temperature(fn, temperature)
    else:
        t = check_real(fn, "temperature", temperature,
                       (("a finite float > 0", lambda v: 0 < v < float("inf")),), type_words="a float > 0",
                       tensor=True)
    return (check_int(fn, "ignore_index", ignore_index, tensor=True), t, check_chunk_size(fn, chunk_size),
            check_flag(fn, flag_name, flag))


def check_labels(fn: str, logits_shape: torch.Size, labels: object, what: str = "logits") -> Tensor:
    """Raise unless ``labels`` is an integer tensor of shape ``logits_shape[:-1]``."""
    t = check_tensor(fn, "labels", labels)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{fn}: labels must be an integer tensor of class indices, got {t.dtype}")
    if len(logits_shape) == 0:
        raise ValueError(f"{fn}: {what} must have a class (last) dimension, got a 0-d tensor")
    if tuple(t.shape) != tuple(logits_shape[:-1]):
        raise ValueError(
            f"{fn}: labels shape {tuple(t.shape)} must be {what} shape without its last "
            f"dimension, {tuple(logits_shape[:-1])}"
        )
    return t


def scaled(x: Tensor, temperature: float | Tensor) -> Tensor:
    """``x / T``; ``x`` itself at ``T = 1`` (a Python check on a Python number).

    A tensor ``T`` (learnable): ``±inf / T = ±inf`` for every ``T > 0``, so an infinite logit
    gives ``T`` no gradient (the division's ``∂/∂T = −x/T²`` is ``inf`` there, and times the
    zero gradient of a ``-inf`` class NaN). Double where: the division that ``T`` is
    differentiated through never sees an infinite ``x``; ``x`` keeps its gradient ``1/T``."""
    if isinstance(temperature, Tensor):
        t = temperature.to(x.dtype)
        inf = torch.isinf(x)
        return torch.where(inf, x / t.detach(), torch.where(inf, 0.0, x) / t)
    return x if temperature == 1.0 else x / temperature


def logps_rows(x: Tensor, labels: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """``(log p_t, valid)`` of the rows of ``x`` ``(N, V)`` at ``labels`` ``(N,)``: the negated
    class-index cross-entropy, 0 with gradient 0 on invalid rows (ignored labels and rows of
    all ``-inf`` logits, as `cross_entropy` counts them)."""
    target = labels.long()
    ignored = target == ignore_index
    # any in-range index serves the ignored rows; an out-of-range label raises in nll_loss
    idx = target.clamp(0, max(x.shape[1] - 1, 0))
    loss, invalid = _ClassIndexCE.call(x, target, idx, ignored, None, ignore_index, 0.0, 1, True)[:2]
    return torch.rsub(loss, 0.0), ~invalid  # 0 − loss: +0.0 at invalid rows


def _token_logps(fn: str, logits: Tensor, labels: Tensor, ignore_index: int,
                 temperature: float | Tensor) -> tuple[Tensor, Tensor]:
    x = check_floating(fn, "logits", logits)
    lab = check_labels(fn, x.shape, labels)
    if x.shape[-1] == 0:
        raise ValueError(f"{fn}: logits must have at least one class, got shape {tuple(x.shape)}")
    if lab.device != x.device:
        raise RuntimeError(f"{fn}: labels is on {lab.device} and logits on {x.device}")
    xs = scaled(upcast(x), temperature)
    logp, valid = target_index_errors(
        fn, lambda: logps_rows(xs.reshape(-1, x.shape[-1]), lab.reshape(-1), ignore_index))
    return logp.view(lab.shape), valid.view(lab.shape)


def token_logps(
    logits: Tensor, labels: Tensor, *, ignore_index: int = -100, temperature: float = 1.0
) -> Tensor:
    r"""Each token's log-probability: ``log_softmax(logits / T)`` at ``labels``.

    $$ \ell_i = \frac{x_{i,t_i}}{T} - \log\sum_j e^{x_{ij}/T}, \qquad
       \ell_i = 0 \text{ where } t_i = \text{ignore\_index} $$

    The hand-written ``log_softmax(logits, -1).gather(-1, labels)`` (TRL's
    ``selective_log_softmax``) has three hazards. An ignored (padding) position still reads its
    row, so a row of all ``-inf`` or ``1e30`` logits there is NaN and poisons the masked sum
    (``0 · nan``); here an ignored position is 0 whatever its row holds. A ``-inf`` logit (a
    banned token, a top-k vocabulary) at another class is probability 0, read exactly. A label
    at a ``-inf`` logit gives ``-inf``, the true value. And ``log p_t`` keeps its exact tail as
    ``p_t → 1`` (``log1p`` of the other classes' mass, not ``x_t − lse`` rounded to 0), which
    ORPO's ``log(1 − p)`` needs.

    **Gradient.** $\partial \ell_i/\partial x_{ij} = (\delta_{j t_i} - p_{ij})/T$, finite also
    when the label's logit is ``-inf`` (then $\delta - p$); 0 for every entry of an ignored
    position and of a row whose logits are all ``-inf`` (counted as ignored, as in
    `cross_entropy`). A NaN row that is not ignored is NaN. A learnable temperature gets
    $\partial \ell_i/\partial T = -\sum_j (\delta_{j t_i} - p_{ij})\, x_{ij}/T^2$ over the finite
    logits: an infinite logit is infinite at every $T > 0$ and adds nothing (not $0 \cdot \infty$).

    Args:
        logits: ``(..., V)`` floating point.
        labels: ``(...)`` integer class indices (``logits.shape[:-1]``).
        ignore_index: label value of positions that give 0. Default: ``-100``.
        temperature: ``T > 0``, a float or a 0-d tensor. A learnable one (``requires_grad``)
            is not read (no host sync): a value that is not finite and > 0 gives NaN.
            Default: ``1.0``.

    Returns:
        ``labels.shape``, ``logits``' dtype (float32 for float16/bfloat16 logits, which are
        computed in float32).

    Raises:
        TypeError: ``logits`` is not floating point or ``labels`` is not an integer tensor.
        ValueError: ``labels`` is not ``logits.shape[:-1]``, ``logits`` has no class, or
            ``temperature`` is not a finite number > 0.
        IndexError: a label that is not ``ignore_index`` is out of range.

    Shape:
        ``logits``: $(*, V)$; ``labels``: $(*)$; output: $(*)$.

    Example:
        >>> import torch
        >>> import stablelosses.functional as SF
        >>> x = torch.tensor([[0.0, float("-inf")], [float("-inf")] * 2], requires_grad=True)
        >>> labels = torch.tensor([0, -100])
        >>> naive = torch.log_softmax(x, -1).gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1)
        >>> (naive * (labels != -100)).sum().backward(); x.grad
        tensor([[0., 0.],
                [nan, nan]])
        >>> x.grad = None
        >>> SF.token_logps(x, labels).sum().backward(); x.grad.abs()
        tensor([[0., 0.],
                [0., 0.]])

    References:
        TRL ``trl/trainer/utils.py``, ``selective_log_softmax``.

    Replaces ``torch.log_softmax(logits / T, -1).gather(-1, labels[..., None]).squeeze(-1)``
    followed by a mask multiply.
    """
    fn = "token_logps"
    ignore_index = check_int(fn, "ignore_index", ignore_index, tensor=True)
    temperature = check_temperature(fn, temperature)
    return _token_logps(fn, logits, labels, ignore_index, temperature)[0]


def masked_sum_or_mean(logp: Tensor, valid: Tensor, average: bool) -> Tensor:
    """The sum over the last dimension, or the sum over the count of valid positions (clamped to
    1: an empty sequence is 0 with gradient 0)."""
    total = logp.sum(-1)
    if not average:
        return total
    return total / valid.sum(-1, dtype=logp.dtype).clamp(min=1.0)


def sequence_logps(
    logits: Tensor, labels: Tensor, *, ignore_index: int = -100, average: bool = False,
    temperature: float = 1.0,
) -> Tensor:
    r"""Each sequence's log-probability: the sum (or mean) of its token log-probs over the last
    dimension of ``labels``.

    $$ s_b = \sum_t \ell_{bt}, \qquad \bar s_b = \frac{\sum_t \ell_{bt}}{\max(1, n_b)} $$

    with $\ell$ from [`token_logps`][stablelosses.functional.token_logps] and $n_b$ the count
    of positions that are not ignored. The length-normalised mean (SimPO, CPO, ORPO, IPO) of
    an empty completion is ``0/0`` = NaN in the hand-written ``(logp * mask).sum(-1) /
    mask.sum(-1)`` (TRL #3339); here it is 0 with gradient 0.

    **Gradient.** That of `token_logps`, times $1/\max(1, n_b)$ for the mean; 0 at ignored
    positions and for every position of an empty sequence.

    Args:
        logits: ``(..., T, V)`` floating point.
        labels: ``(..., T)`` integer class indices.
        ignore_index: label value of positions that do not count. Default: ``-100``.
        average: the mean over the counted positions instead of the sum. Default: ``False``.
        temperature: ``T > 0``, a float or a 0-d tensor. Default: ``1.0``.

    Returns:
        ``labels.shape[:-1]``, ``logits``' dtype (float32 for float16/bfloat16 logits).

    Raises:
        TypeError: as `token_logps`, or ``average`` is not a bool.
        ValueError: as `token_logps`, or ``labels`` is 0-d.

    Shape:
        ``logits``: $(*, T, V)$; ``labels``: $(*, T)$; output: $(*)$.

    Example:
        >>> import torch
        >>> import stablelosses.functional as SF
        >>> x = torch.zeros(2, 3, 4, requires_grad=True)
        >>> labels = torch.tensor([[1, 2, 3], [-100, -100, -100]])  # an empty completion
        >>> SF.sequence_logps(x, labels, average=True)
        tensor([-1.3863,  0.0000], grad_fn=<DivBackward0>)

    References:
        TRL ``trl/experimental/cpo/cpo_trainer.py``, ``CPOTrainer.get_batch_logps``.

    Replaces ``(token_logps * mask).sum(-1)`` and ``… / mask.sum(-1)``.
    """
    fn = "sequence_logps"
    ignore_index = check_int(fn, "ignore_index", ignore_index, tensor=True)
    average = check_flag(fn, "average", average)
    temperature = check_temperature(fn, temperature)
    if isinstance(labels, Tensor) and labels.dim() == 0:
        raise ValueError(f"{fn}: labels must have a sequence (last) dimension, got a 0-d tensor")
    logp, valid = _token_logps(fn, logits, labels, ignore_index, temperature)
    return masked_sum_or_mean(logp, valid, average)


def _linear_token_logps(
    fn: str, input: Tensor, linear_weight: Tensor, labels: Tensor, linear_bias: Tensor | None,
    ignore_index: int, temperature: float | Tensor, chunk_size: int | None, entropy: bool,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """``(log p, entropy or None, labels)`` in the engine's compute dtype, ``labels``' shape."""
    x = check_floating(fn, "input", input)
    w = check_floating(fn, "linear_weight", linear_weight)
    if w.dim() != 2:
        raise ValueError(f"{fn}: linear_weight must be (V, H), got shape {tuple(w.shape)}")
    if x.dim() == 0 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"{fn}: input's last dimension must be H = {w.shape[1]} (linear_weight (V, H)), got shape "
            f"{tuple(x.shape)}"
        )
    if w.shape[0] == 0:
        raise ValueError(f"{fn}: linear_weight must have at least one class, got shape {tuple(w.shape)}")
    b = None
    if linear_bias is not None:
        b = check_floating(fn, "linear_bias", linear_bias)
        if tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"{fn}: linear_bias shape {tuple(b.shape)} must be (V,) = ({w.shape[0]},)")
    lab = check_labels(fn, x.shape, labels, "input")
    n = lab.numel()
    flat = lab.reshape(n).long()
    rows: tuple[Tensor, ...] = (flat, flat != ignore_index)
    scaled_t = isinstance(temperature, Tensor) or temperature != 1.0
    if scaled_t:
        # 1/T per row, a constant of the engine's rows (float64: exact for float64 logits)
        if isinstance(temperature, Tensor):
            inv_t = 1.0 / temperature.detach().to(device=x.device, dtype=torch.float64).reshape(1)
        else:
            inv_t = torch.full((1,), 1.0 / temperature, dtype=torch.float64, device=x.device)
        rows = (*rows, inv_t.expand(n))
    # ignored rows' hidden states never reach the matmuls (a NaN there would reach dW as 0 · NaN)
    x2 = torch.where(rows[1].unsqueeze(1), x.reshape(n, x.shape[-1]), 0.0)

    def dense(logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> Tensor:
        # the head's outputs as differentiable ops of the whole logits: the double backward,
        # and the whole call where the engine cannot serve it
        u = logits[0] * rows[2].to(logits[0].dtype).unsqueeze(1) if scaled_t else logits[0]
        cols = [logps_rows(u, rows[0], ignore_index)[0]]
        if entropy:
            cols.append(torch.where(rows[1], entropy_of(u), 0.0))
        return torch.stack(cols, 1)

    if whole_logits_needed():
        with no_autocast(x.device.type):
            out = dense((stream_logits(x2, w, b, compute_dtype([x, w, b])),), rows)
    else:
        out = target_index_errors(fn, lambda: linear_chunks(
            token_logps_head(entropy, scaled_t), [(x2, w, b)], rows, chunk_size=chunk_size, dense=dense))
    logp = out[:, 0].view(lab.shape)
    return logp, (out[:, 1].view(lab.shape) if entropy else None), lab


def linear_token_logps(
    input: Tensor, linear_weight: Tensor, labels: Tensor, *, linear_bias: Tensor | None = None,
    ignore_index: int = -100, temperature: float = 1.0, chunk_size: int | None = None,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""`token_logps` of the logits ``input @ linear_weight.T + linear_bias`` without holding them.

    $$ \ell_i = \log\operatorname{softmax}\!\big((h_i W^\top + b)/T\big)_{t_i}, \qquad
       H_i = -\sum_j p_{ij}\log p_{ij} $$

    The rows are processed in chunks of ``chunk_size`` rows on the library's one chunk engine:
    only ``chunk_size × V`` logits exist at once, and the backward recomputes each chunk's
    logits. The values are those of [`token_logps`][stablelosses.functional.token_logps] on
    the float32 (float64 for float64 inputs) logits, 0 with gradient 0 at ignored positions,
    except that ``log p_t`` rounds as ``log_softmax`` does as ``p_t → 1`` (the exact tail
    would cost each chunk five more passes). With ``return_entropy=True`` the same pass
    gives each token's entropy, finite with ``-inf`` logits (the ``nan_to_num`` of
    ``-(p * log p)`` gives the right value with a NaN gradient, TRL #7221) and 0 at ignored
    positions.

    A row with a ``+inf`` logit (a product past ``finfo.max``, an infinite bias, or a logit that
    overflows once divided by ``temperature``) gives the limit, as `token_logps`: uniform over
    the ``+inf`` entries, ``-inf`` with a finite gradient for a finite label.

    **Gradient.** With respect to the logits
    $(g_\ell(\delta_{jt} - p_j) - g_H\,p_j(\log p_j + H))/T$, 0 where $p_j = 0$ and on ignored
    rows, then through the matmul to ``input``, ``linear_weight`` and ``linear_bias``; a
    backward with ``create_graph=True`` (double backward) recomputes the logits whole and
    returns the gradient as a graph. Under a ``torch.func`` transform (``grad``, ``vmap``,
    ``jvp``, ``jacrev``, ``hessian``) and forward-mode AD the logits are formed whole instead,
    the same values.

    Args:
        input: hidden states ``(..., H)``.
        linear_weight: the output layer ``(V, H)``.
        labels: ``(...)`` integer class indices.
        linear_bias: ``(V,)`` or ``None``. Default: ``None``.
        ignore_index: label value of positions that give 0. Default: ``-100``.
        temperature: ``T > 0`` (a 0-d tensor is used as a constant). Default: ``1.0``.
        chunk_size: rows per chunk; ``None``: the engine's default (64 MiB of logits).
            Default: ``None``.
        return_entropy: also return each token's entropy. Default: ``False``.

    Returns:
        ``labels.shape`` in float32 (float64 when an input is float64), or ``(logps, entropy)``.

    Raises:
        TypeError: a tensor has the wrong dtype, or a scalar argument the wrong type.
        ValueError: the shapes do not fit, or a scalar argument is out of range.
        IndexError: a label that is not ``ignore_index`` is out of range (as the logits forms;
            also a ``RuntimeError``, the type of the gather that finds it).

    Example:
        >>> import torch
        >>> import stablelosses.functional as SF
        >>> h, w = torch.randn(2, 3, 8), torch.randn(50, 8, requires_grad=True)
        >>> labels = torch.tensor([[1, 2, -100], [4, -100, -100]])
        >>> logps, ent = SF.linear_token_logps(h, w, labels, return_entropy=True)
        >>> logps.shape, bool((logps[labels == -100] == 0).all())
        (torch.Size([2, 3]), True)
        >>> torch.allclose(logps, SF.token_logps(h @ w.T, labels), atol=1e-5)
        True

    Replaces ``torch.log_softmax(F.linear(input, W, b) / T, -1).gather(...)``.
    """
    fn = "linear_token_logps"
    ignore_index, temperature, chunk_size, return_entropy = check_linear_logps_args(
        fn, ignore_index, temperature, chunk_size, return_entropy, "return_entropy"
    )
    logp, ent, _ = _linear_token_logps(fn, input, linear_weight, labels, linear_bias, ignore_index,
                                       temperature, chunk_size, return_entropy)
    return (logp, ent) if ent is not None else logp


def linear_sequence_logps(
    input: Tensor, linear_weight: Tensor, labels: Tensor, *, linear_bias: Tensor | None = None,
    ignore_index: int = -100, average: bool = False, temperature: float = 1.0,
    chunk_size: int | None = None,
) -> Tensor:
    r"""`sequence_logps` of the logits ``input @ linear_weight.T + linear_bias`` without holding
    them: the sum (or mean) over the last dimension of `linear_token_logps`.

    Every preference loss is a cheap function of these per-sequence numbers, so
    ``dpo_loss(*linear_sequence_logps(...).chunk(2), ...)`` is a fused DPO: no per-loss chunked
    class. An empty sequence gives 0 with gradient 0 (also for ``average=True``).

    **Gradient.** That of `linear_token_logps`, times $1/\max(1, n_b)$ for the mean.

    Args:
        input: hidden states ``(..., T, H)``.
        linear_weight: the output layer ``(V, H)``.
        labels: ``(..., T)`` integer class indices.
        linear_bias: ``(V,)`` or ``None``. Default: ``None``.
        ignore_index: label value of positions that do not count. Default: ``-100``.
        average: the mean over the counted positions instead of the sum. Default: ``False``.
        temperature: ``T > 0``. Default: ``1.0``.
        chunk_size: rows per chunk; ``None``: the engine's default. Default: ``None``.

    Returns:
        ``labels.shape[:-1]`` in float32 (float64 when an input is float64).

    Raises:
        TypeError: a tensor has the wrong dtype, or a scalar argument the wrong type.
        ValueError: the shapes do not fit, ``labels`` is 0-d, or a scalar argument is out of range.
        IndexError: a label that is not ``ignore_index`` is out of range (as the logits forms;
            also a ``RuntimeError``, the type of the gather that finds it).

    Example:
        >>> import torch
        >>> import stablelosses.functional as SF
        >>> h, w = torch.randn(2, 3, 8), torch.randn(50, 8)
        >>> labels = torch.tensor([[1, 2, 3], [-100, -100, -100]])  # an empty sequence
        >>> SF.linear_sequence_logps(h, w, labels, average=True)[1]
        tensor(0.)

    Replaces ``(log_softmax(h @ W.T).gather(...) * mask).sum(-1)`` (and ``/ mask.sum(-1)``).
    """
    fn = "linear_sequence_logps"
    ignore_index, temperature, chunk_size, average = check_linear_logps_args(
        fn, ignore_index, temperature, chunk_size, average, "average"
    )
    if isinstance(labels, Tensor) and labels.dim() == 0:
        raise ValueError(f"{fn}: labels must have a sequence (last) dimension, got a 0-d tensor")
    logp, _, lab = _linear_token_logps(fn, input, linear_weight, labels, linear_bias, ignore_index,
                                       temperature, chunk_size, False)
    return masked_sum_or_mean(logp, lab != ignore_index, average)
