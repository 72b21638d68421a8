"""Name the singularity behind a report, and the stablelosses replacement for catalogued hazards.

A report says *what happened* with one of five phrases people can search for:

| phrase | when |
|---|---|
| ``division by zero`` | a finite non-zero numerator over 0 (also ``0 ** negative``, ``rsqrt(0)``,
  ``digamma(0)``) |
| ``0/0`` | zero over zero, a softmax over a slice that is entirely ``-inf``, and any other NaN
  from finite inputs that the operator also gives with every value exact (a mean over nothing,
  the variance of one value, a LayerNorm with ``eps=0`` over a constant row) |
| ``log of zero`` | ``log(0)``, ``log1p(-1)``, ``xlogy(x != 0, 0)``, a CTC loss with no alignment,
  the poles that are logs inside (``atanh(±1)``, ``logit(0)``, ``logit(1)``, ``lgamma(0)``,
  ``erfinv(±1)``) |
| ``overflow`` | a finite result too large (``exp(100.)``), or NaN from finite operands whose
  intermediate overflowed (a matmul of ``±1e30``) |
| ``invalid`` | outside the domain (``sqrt``/``log`` of a negative), ``inf - inf``, ``0 * inf`` |

Everything here runs only on the reporting path (after a non-finite value was found), so it
may look at values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["name_cause", "float64_copies", "nan_without_overflow", "hint_for", "torch_function_of",
           "diverging_inputs", "DIVERGENCE_HINT"]

_DIV = {"div", "div_", "true_divide", "true_divide_", "floor_divide", "remainder", "fmod"}
_RECIP = {"reciprocal", "reciprocal_", "rsqrt", "rsqrt_"}
_LOG = {"log", "log_", "log2", "log10", "log1p", "log1p_", "xlogy", "xlogy_", "special_xlogy"}
_POW = {"pow", "pow_", "float_power"}
_DOMAIN = {"sqrt", "sqrt_", "acos", "asin", "acosh", "atanh", "lgamma", "digamma", "polygamma",
           "erfinv", "special_erfinv"} | _LOG | _POW
_CTC = {"ctc_loss", "_ctc_loss"}


def _nonpositive_integer(x: torch.Tensor) -> torch.Tensor:
    return (x <= 0) & (x == x.floor())


# poles: the exact value is ±inf (a log of zero inside: atanh(x) = ½·log((1+x)/(1−x)),
# logit(p) = log p − log(1−p), lgamma = log|Γ|, erfinv(y) ~ sqrt(−log(1−|y|)); Γ'/Γ ~ −1/x)
_POLES: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {
    **dict.fromkeys(("atanh", "atanh_", "arctanh", "arctanh_"), ("log of zero", lambda x: x.abs() == 1)),
    **dict.fromkeys(("logit", "logit_", "special_logit"), ("log of zero", lambda x: (x == 0) | (x == 1))),
    **dict.fromkeys(("lgamma", "lgamma_", "special_gammaln"), ("log of zero", _nonpositive_integer)),
    **dict.fromkeys(("erfinv", "erfinv_", "special_erfinv"), ("log of zero", lambda x: x.abs() == 1)),
    **dict.fromkeys(("digamma", "digamma_", "special_digamma", "special_psi"),
                    ("division by zero", _nonpositive_integer)),
}
_SOFTMAX = {"_softmax", "_log_softmax", "softmax", "log_softmax", "logsumexp", "_safe_softmax"}


def _short(op: str) -> str:
    return op.split("::", 1)[-1].split(".", 1)[0]


def _t(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return torch.tensor(float(x))
    return None


def _any(mask: torch.Tensor) -> bool:
    return bool(mask.any())


def _division(num: torch.Tensor, den: torch.Tensor, out_nan: bool) -> str | None:
    num, den = torch.broadcast_tensors(num.to(torch.float64), den.to(torch.float64))
    if out_nan and _any((num == 0) & (den == 0)):
        return "0/0"
    if _any((den == 0) & (num != 0) & torch.isfinite(num)):
        return "division by zero"
    return None


def name_cause(
    op: str,
    args: Sequence[Any],
    outs: Sequence[torch.Tensor],
    in_finite: bool,
    exact_nan: Callable[[], bool | None] | None = None,
) -> str:
    """One of the five phrases for an ATen operator ``op`` whose outputs ``outs`` are not finite.

    Args:
        op: the operator name, ``'aten::div'`` (overload optional).
        args: its positional arguments (tensors or Python numbers).
        outs: its tensor outputs.
        in_finite: whether every input was finite.
        exact_nan: for a NaN from finite inputs: whether the operator gives NaN there with no
            rounding or overflow to blame (see `nan_without_overflow`); None when unknown.
    """
    name = _short(op)
    out_nan = any(bool(torch.isnan(o).any()) for o in outs if o.is_floating_point())
    a0 = _t(args[0]) if args else None
    a1 = _t(args[1]) if len(args) > 1 else None
    if name in _DIV and a0 is not None and a1 is not None:
        found = _division(a0, a1, out_nan)
        if found:
            return found
    if name in _RECIP and a0 is not None:
        found = _division(torch.ones(()), a0, out_nan)
        if found:
            return found
    if name in _POW and a0 is not None and a1 is not None:
        base, expo = torch.broadcast_tensors(a0.to(torch.float64), a1.to(torch.float64))
        if _any((base == 0) & (expo < 0)):
            return "division by zero"
    if name in _LOG and a0 is not None:
        if name == "log1p":
            zero = a0 == -1
        elif name.endswith("xlogy") and a1 is not None:
            x, y = torch.broadcast_tensors(a0, a1)
            zero = (y == 0) & (x != 0)
        else:
            zero = a0 == 0
        if _any(zero):
            return "log of zero"
    if name in _POLES and a0 is not None and in_finite and not out_nan:
        phrase, at_pole = _POLES[name]
        if _any(at_pole(a0)):
            return phrase
    if name in _CTC and in_finite and not out_nan:
        return "log of zero"  # -log of a zero likelihood: no alignment exists
    if name in _SOFTMAX and out_nan and a0 is not None and a0.is_floating_point():
        dim = args[1] if len(args) > 1 and isinstance(args[1], int) else -1
        if a0.dim() and _any((a0 == float("-inf")).all(dim)):
            return "0/0"
        return "invalid"
    if in_finite:
        if out_nan and name in _DOMAIN:
            return "invalid"
        if out_nan and exact_nan is not None and exact_nan():
            return "0/0"  # no value overflowed: a mean over nothing, the variance of one value
        return "overflow"
    return "invalid"


def float64_copies(args: Sequence[Any], kwargs: dict) -> tuple[tuple, dict, bool]:
    """``args`` and ``kwargs`` with every floating tensor a detached float64 copy, and whether
    any of them was narrower than float64: the inputs of an operator run again, on the reporting
    path, with no rounding or overflow of the original dtype (an in-place one writes its copies)."""
    narrow = False

    def wide(a: Any) -> Any:
        nonlocal narrow
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            narrow = narrow or a.dtype != torch.float64
            return a.detach().to(torch.float64, copy=True)
        return a

    args64, kwargs64 = tree_map(wide, (tuple(args), dict(kwargs)))
    return args64, kwargs64, narrow


def nan_without_overflow(func: Any, args: Sequence[Any], kwargs: dict) -> bool | None:
    """Whether ATen operator ``func``, which made NaN from finite inputs, makes it with no value
    overflowing: run again in float64, it still does (from float64 inputs: none of them is past
    the square root of the largest float64). None when it cannot be run again (a collective, a
    random operator) or fails.

    Runs only on the reporting path; every tensor is copied first, so an in-place operator
    writes to its copies.
    """
    if not str(getattr(func, "name", lambda: "")()).startswith("aten::"):
        return None
    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        return None
    try:
        args64, kwargs64, narrow = float64_copies(args, kwargs)
        if not narrow:  # float64 already: judge by the inputs' size
            flat = tree_flatten((args64, kwargs64))[0]
            big = torch.finfo(torch.float64).max ** 0.5
            return all(float(t.abs().amax()) <= big for t in flat
                       if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel())
        with torch.no_grad():
            out = func(*args64, **kwargs64)
        if out is None:  # in place, returns nothing (_foreach_*_): the copies hold the result
            out = args64
    except Exception:  # noqa: BLE001 - an operator that cannot be run on float64 copies
        return None
    return any(bool(torch.isnan(o).any()) for o in tree_flatten(out)[0]
               if isinstance(o, torch.Tensor) and o.is_floating_point())


_DETAIL = {
    "division by zero": "a finite non-zero numerator over 0",
    "0/0": "zero over zero",
    "log of zero": "log(0) = -inf",
    "overflow": "a finite result too large for the dtype",
    "invalid": "outside the domain, inf - inf or 0 * inf",
}


def detail_of(cause: str) -> str:
    """A few words that say what the phrase means."""
    return _DETAIL.get(cause, "")


# autograd nodes that only select, reshape or copy values: looked through to find the softmax
_PASSTHROUGH = ("Index", "Select", "Slice", "View", "Unsqueeze", "Squeeze", "Expand", "Permute",
                "Transpose", "Reshape", "Clone", "Alias", "Gather", "Narrow", "Unbind", "Take",
                "AsStrided", "Split", "Chunk", "Flatten", "Unfold", "TBackward", "Contiguous")


def _source_node(t: Any) -> str:
    """The name of the autograd node that made ``t``, past indexing and reshaping ('' if none)."""
    node = t.grad_fn if isinstance(t, torch.Tensor) else None
    for _ in range(32):
        if node is None:
            return ""
        name = node.name()
        if not any(p in name for p in _PASSTHROUGH):
            return name
        nxt = [fn for fn, _ in node.next_functions if fn is not None]
        node = nxt[0] if nxt else None
    return ""


DIVERGENCE_HINT = (
    "hint: the run is diverging, not this operator: stop it while the loss is still finite with "
    "`stablelosses trace --watch SCRIPT.py` (a DivergenceMonitor), then lower the learning rate or "
    "clip gradients — docs: debugging (Divergence before inf)"
)


def diverging_inputs(cause: str, tensors: Sequence[torch.Tensor]) -> float | None:
    """The largest |input| when an overflow came from inputs that were already huge, else None.

    Huge: past the square root of the dtype's largest value (about 1.8e19 in float32), so that
    one product of two such values overflows; that is where a diverging run's activations are
    when they first overflow. float16 is left out: its overflow from moderate inputs is its own
    hazard.
    """
    if cause != "overflow":
        return None
    top = None
    for t in tensors:
        if not t.is_floating_point() or t.dtype == torch.float16 or t.numel() == 0:
            continue
        m = float(t.detach().abs().amax())
        if m > torch.finfo(t.dtype).max ** 0.5 and (top is None or m > top):
            top = m
    return top


def _both_neg_inf(args: Sequence[Any]) -> bool:
    """The first two arguments are -inf at the same position (``-inf - (-inf)``)."""
    a, b = (_t(args[0]) if args else None), (_t(args[1]) if len(args) > 1 else None)
    if a is None or b is None or not a.is_floating_point() or not b.is_floating_point():
        return False
    try:
        a, b = torch.broadcast_tensors(a, b)
    except RuntimeError:
        return False
    return _any((a == float("-inf")) & (b == float("-inf")))


def _is_norm(node: str | None, fwd: str) -> bool:
    """An autograd node (or forward operator) that is a vector norm."""
    return bool(node) and (str(node).startswith(("NormBackward", "LinalgVectorNormBackward"))) or fwd in (
        "norm", "linalg_vector_norm")


# torch.nn.functional losses whose hazards have a page of their own: (replacement, page)
_TORCH_FUNCTION_HINTS = {
    "binary_cross_entropy_with_logits": ("sl.BCEWithLogitsLoss", "bce-with-logits-inf"),
    "soft_margin_loss": ("sl.SoftMarginLoss", "soft-margin-overflow"),
    "gaussian_nll_loss": ("sl.GaussianNLLLoss", "gaussian-nll-variance-floor"),
    "ctc_loss": ("sl.CTCLoss (zero_infinity=True for a zero loss)", "ctc-impossible-alignment"),
    "cosine_embedding_loss": ("sl.CosineEmbeddingLoss", "cosine-embedding-zero-vector"),
    "kl_div": ("sl.KLDivLoss", "kl-zero-targets"),
}


def torch_function_of(frame: Any) -> str | None:
    """The name of the outermost ``torch.nn.functional`` function on the stack of ``frame``
    (the one user code called), or None."""
    found = None
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith("torch/nn/functional.py"):
            found = frame.f_code.co_name
        elif found is not None:
            break
        frame = frame.f_back
    return found


def _hint(use: str, page: str) -> str:
    return f"hint: use {use} — docs: hazards/{page}"


def hint_for(
    op: str,
    cause: str,
    args: Sequence[Any],
    node: str | None = None,
    forward_op: str | None = None,
    torch_function: str | None = None,
) -> str | None:
    """The stablelosses replacement and docs page when the report is a catalogued hazard.

    ``torch_function`` is the ``torch.nn.functional`` function the operator ran inside, if any
    (see `torch_function_of`).
    """
    name = _short(op)
    fwd = _short(forward_op) if forward_op else ""
    a0 = args[0] if args else None
    half = isinstance(a0, torch.Tensor) and a0.dtype in (torch.float16, torch.bfloat16)
    if torch_function in _TORCH_FUNCTION_HINTS:
        # inside a torch loss whose hazards have a page: that page, whatever operator inside it
        return _hint(*_TORCH_FUNCTION_HINTS[torch_function])
    if node == "SqrtBackward0" or fwd == "sqrt" or (name == "sqrt" and cause == "invalid"):
        return _hint("sl.safe_sqrt / sl.RMSELoss", "sqrt-at-zero")
    if node == "PowBackward0" or (name in _POW and cause == "division by zero"):
        expo = args[1] if len(args) > 1 else None
        if isinstance(expo, (int, float)) and expo in (-0.5, 0.5) and not _source_node(a0).startswith("Rsub"):
            return _hint("sl.safe_sqrt / sl.RMSELoss", "sqrt-at-zero")
        # (1 - p) ** gamma, whatever gamma: the focal modulating factor
        return _hint("sl.FocalLoss / sl.SigmoidFocalLoss for (1 - p) ** gamma", "focal-gamma-below-one")
    if node == "LogaddexpBackward0" or fwd == "logaddexp":
        return _hint("sl.logaddexp", "logaddexp-neg-inf")
    if name in ("mul", "mul_") and cause == "invalid" and len(args) > 1:
        srcs = {_source_node(args[0]), _source_node(args[1])}
        if "LogSoftmaxBackward0" in srcs and srcs & {"SoftmaxBackward0", "ExpBackward0"}:
            # p * log p with p = 0 at a -inf logit
            return _hint("sl.entropy(logits, mask=)", "masked-entropy")
    if node == "LogBackward0" or fwd == "log" or (name in ("log", "log_") and cause == "log of zero"):
        src = _source_node(a0)
        if node == "LogBackward0" or fwd == "log" or "Softmax" in src:
            return _hint("sl.log_softmax / sl.FocalLoss", "focal-log-zero")
        return None
    if name in _SOFTMAX and cause in ("0/0", "invalid"):
        return _hint("sl.softmax / sl.log_softmax with mask=", "softmax-logsumexp")
    if name in ("sub", "sub_", "rsub") and cause == "invalid" and _both_neg_inf(args):
        # log q - log p where both are -inf: a masked or top-k vocabulary entry in a KL
        return _hint("sl.kl_div, or a distillation loss with mask= (the masked entries dropped, "
                     "not subtracted)", "kl-zero-targets")
    if name in ("exp", "exp_") and cause == "overflow":
        if _source_node(a0).startswith("SubBackward"):
            # exp(logp - old_logp): a policy ratio; a where/min that drops it later keeps the loss
            # finite, and its backward is 0 * inf = NaN
            return ("hint: exp of a difference (a ratio exp(logp - old_logp)?) overflowed; if a "
                    "where/min/mask drops it later the loss stays finite but the gradient is 0 * inf = "
                    "NaN: clamp the exponent or select its input before the exp, or use "
                    "SF.policy_loss — docs: hazards/finite-loss-nan-gradient")
        return _hint("sl.logsumexp / sl.softmax / sl.CrossEntropyLoss", "softmax-logsumexp")
    if name == "cosh" and cause == "overflow":
        return _hint("sl.LogCoshLoss", "log-cosh-overflow")
    if half and cause == "overflow" and name in _POW | {"mul", "mul_", "square", "mse_loss"}:
        return _hint("sl.RMSELoss", "half-precision-overflow")
    if _is_norm(node, fwd) or (name in _DIV and cause == "0/0" and len(args) > 1
                               and _is_norm(_source_node(args[1]), "")):
        # the norm of a zero vector: its backward x / ‖x‖ at 0, or x / x.norm() itself
        return _hint("sl.normalize / sl.cosine_similarity, or sl.safe_sqrt of a squared norm", "zero-vector")
    if name in _DIV and cause in ("division by zero", "0/0") or node == "DivBackward0":
        return _hint("sl.safe_div", "division-by-zero")
    return None
