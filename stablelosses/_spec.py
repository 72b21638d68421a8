r"""The argument checks of the public functions and the module classes: one plain function per
kind of argument, each ``check_<kind>(fn, name, value, ...)`` returning the value to compute
with or raising with one message form, ``"<fn>: <name> must be <allowed>, got <value>"`` (the
value's type name for a ``TypeError``).

The scalar types are those torch's argument parser takes for the same kind of argument:

- an int: a Python ``int`` (an ``IntEnum`` too), a NumPy integer, or (where the torch twin
  takes an int: ``ignore_index``, ``dim``) a 0-d integer tensor; never a ``bool``, a float or a
  bool tensor;
- a float: a Python ``int`` or ``float``, a NumPy number, or (where the torch twin takes a
  float: ``label_smoothing``, ``eps``, ``p``) a 0-d real tensor that does not require grad; a
  ``bool`` only where torch's parser takes one and it means something (``label_smoothing``);
- a reduction: a ``str`` (a ``str`` subclass too: ``enum.StrEnum``, ``np.str_``);
- a flag: a Python ``bool`` only (torch refuses an int, a NumPy bool and a tensor).

A tensor given for an int or a float is read on the host, as torch's parser reads it: pass a
Python number where the call must not sync. Under ``torch.compile`` Dynamo traces a NumPy
scalar as a tensor, so a checked NumPy value can break the graph (``fullgraph=True`` refuses it
where its value is compared, as for ``label_smoothing`` or ``dim``): pass Python numbers there.
Every other check reads Python attributes only (``type``, comparisons of Python numbers), never
a tensor's values: no host sync, and it traces under ``torch.compile``. The values each check
allows and refuses are tried in ``tests/test_specs.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stablelosses._compat import functorch_transforms_active, is_fake

__all__ = [
    "REDUCTIONS", "KL_REDUCTIONS", "quoted", "check_reduction", "check_torch_reduction", "TORCH_INVALID",
    "check_flag", "check_int",
    "check_real", "check_float_dtype", "check_dims",
    "check_nonnegative", "check_finite_nonnegative", "check_label_smoothing", "check_temperature",
    "check_alpha", "check_p_norm", "check_z_loss", "check_softcap", "check_chunk_size", "check_fill",
]

REDUCTIONS = ("none", "mean", "sum")
KL_REDUCTIONS = ("none", "batchmean", "mean", "sum")  # F.kl_div's
_F32_MAX = torch.finfo(torch.float32).max
Rule = tuple[str, Callable[[float], bool]]  # (the allowed values in words, the test)


def quoted(values: Sequence[str]) -> str:
    """``'a', 'b' or 'c'``."""
    q = [repr(v) for v in values]
    return q[0] if len(q) == 1 else ", ".join(q[:-1]) + " or " + q[-1]


def _shown(value: object) -> str:
    """``value`` as a message shows it: a ``str`` subclass (``StrEnum``) as its text and type,
    so the message never reads "must be 'sum', got <R.SUM: 'sum'>"."""
    if isinstance(value, str) and type(value) is not str:
        return f"{str.__str__(value)!r} ({type(value).__name__})"
    return repr(value)


def _numpy(value: object) -> bool:
    return type(value).__module__ == "numpy"


def check_reduction(fn: str, value: object, allowed: Sequence[str] = REDUCTIONS, prefix: str = "",
                    name: str = "reduction") -> str:
    """One of ``allowed`` as a plain ``str`` (``ValueError`` otherwise, as torch's). ``prefix``:
    words before the argument's name (torchvision's ``Invalid reduction:``)."""
    return check_choice(fn, name, value, allowed, prefix)


# torch.nn._reduction.get_enum's: the deprecated alias of 'mean', and the words of its error
_ELEMENTWISE_MEAN = "reduction='elementwise_mean' is deprecated. Please use reduction='mean' instead."
TORCH_INVALID = "is not a valid value for reduction"


def check_torch_reduction(fn: str, value: object, allowed: Sequence[str] = REDUCTIONS, *,
                          alias: bool = True, invalid: str = TORCH_INVALID) -> str:
    """The ``reduction`` of a function that replaces a torch.nn loss: `check_reduction`, with
    torch's words in the message (``"abc is not a valid value for reduction"``, or ``invalid``:
    each torch function's own, which torch's tests match). ``alias``: the torch function reads
    ``reduction`` with ``torch.nn._reduction.get_enum``, which takes the deprecated
    ``'elementwise_mean'`` for ``'mean'`` with its ``UserWarning``."""
    if alias and isinstance(value, str) and value == "elementwise_mean":
        if not torch.compiler.is_compiling():  # Dynamo cannot trace warnings.warn
            warnings.warn(_ELEMENTWISE_MEAN, UserWarning, stacklevel=3)
        return "mean"
    try:
        return check_choice(fn, "reduction", value, allowed)
    except ValueError as e:
        shown = str.__str__(value) if isinstance(value, str) else str(value)
        raise ValueError(f"{e} ({shown} {invalid})") from None


def check_flag(fn: str, name: str, value: object) -> bool:
    """A Python ``bool``, and nothing else (``TypeError``), as torch's bool arguments."""
    if type(value) is bool:
        return value
    raise TypeError(f"{fn}: {name} must be a bool, got {type(value).__name__}")


def _numpy_item(value: object) -> object:
    """A NumPy scalar as the Python scalar it holds (``item``: Dynamo traces it, where it
    traces neither ``int()`` of one nor its ``dtype``); anything else as it is."""
    # an array is no scalar, as for torch's parser (a 0-d one too: refused); Dynamo traces a
    # NumPy scalar as an array, so a compiled call cannot tell them apart
    if _numpy(value) and hasattr(value, "item") and (
            type(value).__name__ != "ndarray" or torch.compiler.is_compiling()):
        return value.item()  # type: ignore[union-attr]
    return value


def _as_int(value: object, tensor: bool = True) -> int | None:
    """``value`` as an int where torch's parser takes it as one (a tensor only when
    ``tensor``), else ``None``."""
    t = type(value)
    if t is int:
        return value  # type: ignore[return-value]
    if isinstance(value, torch.SymInt):
        return value  # type: ignore[return-value] # made symbolic by compile(dynamic=True)
    if _numpy(value):
        value = _numpy_item(value)  # a NumPy integer holds an int, a NumPy bool a bool
        t = type(value)
    if t is bool:
        return None
    if isinstance(value, int):
        return int(value)  # an int subclass (IntEnum), a NumPy integer
    if tensor and isinstance(value, torch.Tensor) and value.dim() == 0 and not (
            value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        return int(value)  # a host read, as torch's parser's
    return None


def check_int(fn: str, name: str, value: object, *, minimum: int | None = None,
              optional: bool = False, tensor: bool = False) -> Any:
    """An int (see the module's list; ``TypeError`` for a bool: ``True`` would silently be 1);
    ``None`` when ``optional``; at least ``minimum`` when given (``ValueError``); a 0-d integer
    tensor only with ``tensor`` (where the torch twin takes one)."""
    if value is None and optional:
        return None
    v = _as_int(value, tensor)
    if v is None:
        words = "an int or None" if optional else "an int"
        raise TypeError(f"{fn}: {name} must be {words}, got {type(value).__name__}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{fn}: {name} must be >= {minimum}, got {v}")
    return v


def _as_real(value: object, bools: bool, tensor: bool) -> float | None:
    """``value`` as a float where torch's parser takes it as one (a bool only when ``bools``)."""
    t = type(value)
    if t is float or t is int:
        return float(value)  # type: ignore[arg-type]
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return value  # type: ignore[return-value] # a Python number made symbolic by compile(dynamic=True)
    if _numpy(value):
        value = _numpy_item(value)  # a NumPy number holds an int or a float, a NumPy bool a bool
        t = type(value)
    if t is bool:
        return float(value) if bools else None  # type: ignore[arg-type]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tensor and isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad and not (
            value.is_complex() or (value.dtype == torch.bool and not bools)):
        return float(value)  # a host read, as torch's parser's
    return None


def check_real(fn: str, name: str, value: object, rules: Sequence[Rule] = (), *,
               type_words: str = "a float", bools: bool = False, optional: bool = False,
               tensor: bool = False, error: type[Exception] = ValueError) -> Any:
    """A real number as a float (see the module's list). ``rules``: ``(words, test)`` pairs tried
    in order; the first that fails raises ``error`` with its words. ``optional``: ``None``
    passes; ``tensor``: a 0-d tensor that does not require grad passes (where the torch twin
    takes one)."""
    if value is None and optional:
        return None
    v = _as_real(value, bools, tensor)
    if v is None:
        if tensor and isinstance(value, torch.Tensor) and (value.dim() != 0 or value.requires_grad):
            raise TypeError(f"{fn}: {name} must be {type_words} (a tensor only 0-d, not requiring grad), "
                            f"got a tensor of shape {tuple(value.shape)}"
                            + (" that requires grad" if value.requires_grad else ""))
        raise TypeError(f"{fn}: {name} must be {type_words}, got {type(value).__name__}")
    for words, ok in rules:
        if not ok(v):
            shown = value if isinstance(value, (int, float)) else v  # as given: -1, not -1.0
            raise error(f"{fn}: {name} must be {words}, got {shown}")
    return v


def check_float_dtype(fn: str, name: str, value: object) -> Any:
    """A floating-point ``torch.dtype`` or ``None`` (``TypeError``)."""
    if value is None or (isinstance(value, torch.dtype) and value.is_floating_point):
        return value
    raise TypeError(f"{fn}: {name} must be a floating-point torch.dtype or None, got {value!r}")


def check_dims(fn: str, name: str, value: object, *, empty: bool = True, optional: bool = False,
               tensor: bool = True) -> Any:
    """What a module can check of a dimension argument before it sees the input: ints (or a
    list/tuple of them), not an empty list unless ``empty``, no dimension named twice the same
    way. The range (and a repeat such as ``(1, -1)``) needs the input's ndim: the function
    checks it (``wrap_dims``, with the same messages)."""
    if value is None and optional:
        return None
    seq = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if not seq and not empty:
        raise ValueError(f"{fn}: {name} must name at least one dimension, got ()")
    ints = []
    for d in seq:
        i = _as_int(d, tensor)
        if i is None:
            raise TypeError(f"{fn}: {name} must be an int, got {type(d).__name__}")
        ints.append(i)
    if len(set(ints)) != len(ints):
        raise ValueError(f"{fn}: {name} has repeated dimensions, got {seq}")
    return value


# ------------------------------------------------------------------- the arguments ops share
# Defined once: the same values pass and the same message fails everywhere.


def _nonneg(v: float) -> bool:
    return v >= 0  # False for NaN


def _finite(v: float) -> bool:
    return v != float("inf")  # a comparison, not math.isinf: Dynamo traces it on a SymFloat


def check_nonnegative(fn: str, name: str, value: object) -> float:
    """``eps``: a float >= 0 (inf allowed; a 0-d tensor as torch's ``eps``)."""
    return check_real(fn, name, value, ((">= 0", _nonneg),), tensor=True)


def check_finite_nonnegative(fn: str, name: str, value: object) -> float:
    """``gamma``, ``smooth``: a finite float >= 0."""
    return check_real(fn, name, value, ((">= 0", _nonneg), ("finite and >= 0", _finite)))


def check_label_smoothing(fn: str, value: object, name: str = "label_smoothing") -> float:
    """torch's ``cross_entropy`` parses it as a float (a bool passes) and raises its
    ``RuntimeError`` outside [0, 1]; the message also has the words of torch's
    ``nn.LinearCrossEntropyLoss`` constructor (one message for every op that takes it, so a
    module raises its function's)."""
    try:
        return check_real(fn, name, value, (("between 0.0 and 1.0", lambda v: 0.0 <= v <= 1.0),),
                          bools=True, tensor=True, error=RuntimeError)
    except RuntimeError as e:
        raise RuntimeError(f"{e} (expected {name} to be in range [0, 1], got {value})") from None


def check_temperature(fn: str, value: object, name: str = "temperature") -> Any:
    """A finite float > 0, or a 0-dim tensor.

    A tensor that does not require grad is read and checked as a number (a host read, as
    torch's parser's). A learnable one (``requires_grad``) is not read, since that would sync
    every step, nor is any tensor while compiling, under ``torch.func`` or without values (meta,
    fake): there a value that is not finite and > 0 becomes NaN (a select on the tensor, whose
    gradient passes where the value is valid), never a silently wrong loss."""
    rule = (("a finite float > 0", lambda v: 0 < v < float("inf")),)
    if isinstance(value, torch.Tensor):
        if value.ndim != 0:
            raise ValueError(f"{fn}: {name} must be a number or a 0-dim tensor, got shape "
                             f"{tuple(value.shape)}")
        if (value.requires_grad or value.is_meta or torch.compiler.is_compiling()
                or functorch_transforms_active() or is_fake(value)):
            return torch.where((value > 0) & (value < float("inf")), value, float("nan"))
        check_real(fn, name, float(value), rule, type_words="a float > 0")
        return value
    return check_real(fn, name, value, rule, type_words="a float > 0")


def check_alpha(fn: str, value: object, name: str = "alpha") -> float:
    """[0, 1] (also rejects inf and NaN), or torchvision's -1 for no weighting: any other value
    (1.5, -0.5, 1e300) would weight one class negatively or by a huge factor."""
    return check_real(fn, name, value,
                      (("in [0, 1], or -1 for no weighting", lambda v: 0.0 <= v <= 1.0 or v == -1.0),))


def check_p_norm(fn: str, value: object, name: str = "p") -> float:
    return check_real(fn, name, value, (("a number or inf", lambda v: v == v),),
                      type_words="a float (inf allowed)", tensor=True)


def check_z_loss(fn: str, value: object, name: str = "z_loss") -> float:
    return check_real(fn, name, value, ((">= 0", _nonneg), ("finite", _finite)))


# the words built once: a format of a float inside traced code is a graph break under dynamic=True
_SOFTCAP_RULES: tuple[Rule, ...] = (
    (f"None or a finite number > 0 and at most float32's max ({_F32_MAX:.4g})", lambda v: 0 < v <= _F32_MAX),
)


def check_softcap(fn: str, value: object, name: str = "softcap") -> Any:
    """Applied in float32 (or the input's wider dtype): above float32's max the cap becomes inf
    there and c·tanh(u/c) is inf·0 = NaN."""
    return check_real(fn, name, value, _SOFTCAP_RULES, optional=True)


def check_chunk_size(fn: str, value: object, name: str = "chunk_size") -> Any:
    return check_int(fn, name, value, minimum=1, optional=True)


def check_fill(fn: str, value: object, name: str = "fill") -> float:
    return check_real(fn, name, value, type_words="a real number")


def check_normalizer(fn: str, value: object, reduction: object) -> Any:
    """``normalizer=`` of the token losses: ``None``, a finite number ``>= 0`` or a 0-dim real
    tensor (its value is not read: no host sync), with ``reduction='mean'`` only (there is no
    other denominator to replace)."""
    if value is None:
        return None
    if reduction != "mean":
        raise ValueError(
            f"{fn}: normalizer replaces the denominator of reduction='mean', got reduction={reduction!r}"
        )
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{fn}: normalizer must be a number or a 0-dim real tensor, got a "
                             f"{value.dtype} tensor of shape {list(value.shape)}")
        return value
    return check_real(fn, "normalizer", value, (("finite and >= 0", lambda v: 0 <= v < float("inf")),),
                      type_words="a number >= 0, a 0-dim tensor or None")


def check_choice(fn: str, name: str, value: object, values: Sequence[str], prefix: str = "") -> str:
    """One of the strings ``values`` (``ValueError`` otherwise), as a plain ``str`` (a ``str``
    subclass gives the equal plain one). ``prefix``: words before the argument's name."""
    if type(value) is str and value in values:
        return value
    if isinstance(value, str):
        for v in values:
            if value == v:
                return v
    raise ValueError(f"{fn}: {prefix}{name} must be {quoted(values)}, got {_shown(value)}")


def check_finite_nonnegative_real(fn: str, name: str, value: object) -> float:
    """A finite float ``>= 0`` (``beta`` and the weights of the preference and policy losses)."""
    return check_real(fn, name, value, ((">= 0", _nonneg), ("finite and >= 0", _finite)))
