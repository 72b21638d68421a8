r"""One declarative spec per public op: its Python-level arguments, what each allows, the torch
function it replaces and its reference.

A spec drives the op's argument checks and its generated tests (``tests/test_specs.py``):
the wrapper in ``functional/_<op>.py`` calls ``SPEC.check(...)`` once with its scalar arguments,
and every message has one form, ``"<fn>: <arg> must be <allowed>, got <value>"`` (the value's
type name for a ``TypeError``). The kinds (`OneOf`, `Flag`, `Int`, `Real`, `Dim`) carry sample
values that pass and that fail, so a new argument is one `Arg` line with a kind, and it gets
its check, its message and its tests.

The checks read Python attributes only (``type``, ``isinstance``, comparisons of Python
numbers), never a tensor's values: no host sync, and they trace under ``torch.compile``.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Arg", "OpSpec", "OneOf", "Flag", "Int", "Real", "FloatDtype", "Dim", "SPECS", "spec"]

_F32_MAX = torch.finfo(torch.float32).max
Bad = tuple[tuple[Any, type[Exception]], ...]  # (value, the exception it raises)


def quoted(values: Sequence[str]) -> str:
    """``'a', 'b' or 'c'``."""
    q = [repr(v) for v in values]
    return q[0] if len(q) == 1 else ", ".join(q[:-1]) + " or " + q[-1]


def _real(v: object, bools: bool) -> bool:
    """Whether ``v`` is a real Python or NumPy number (a bool only when ``bools``); a tensor is not."""
    t = type(v)
    if t is float or t is int:
        return True
    if t is bool:
        return bools
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


class Kind:
    """What one argument allows. ``check`` returns the value to compute with or raises."""

    good: tuple[Any, ...] = ()
    bad: Bad = ()
    shape_dependent = False  # checked against the input's ndim by its wrapper (``wrap_dim``)

    def check(self, fn: str, name: str, value: object) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True)
class OneOf(Kind):
    """A string out of ``values`` (``ValueError``). ``prefix``: words before the argument's name
    (torchvision's ``Invalid reduction:``)."""

    values: tuple[str, ...]
    prefix: str = ""
    good: tuple[Any, ...] = ()
    bad: Bad = (("avg", ValueError), (None, ValueError), (1, ValueError))

    def __post_init__(self) -> None:
        if not self.good:
            object.__setattr__(self, "good", self.values)

    def check(self, fn: str, name: str, value: object) -> str:
        if type(value) is str and value in self.values:
            return value
        raise ValueError(f"{fn}: {self.prefix}{name} must be {quoted(self.values)}, got {value!r}")


@dataclass(frozen=True)
class Flag(Kind):
    """A bool, and nothing else (``TypeError``): not an int, a string or a tensor."""

    good: tuple[Any, ...] = (True, False)
    bad: Bad = ((1, TypeError), ("yes", TypeError), (None, TypeError))

    def check(self, fn: str, name: str, value: object) -> bool:
        if type(value) is bool:
            return value
        raise TypeError(f"{fn}: {name} must be a bool, got {type(value).__name__}")


@dataclass(frozen=True)
class Int(Kind):
    """An int, not a bool (``TypeError``: ``True`` would silently be 1); ``None`` when
    ``optional``; at least ``minimum`` when given (``ValueError``)."""

    minimum: int | None = None
    optional: bool = False
    good: tuple[Any, ...] = (0, 5, -100)
    bad: Bad = ((True, TypeError), (False, TypeError), (1.0, TypeError), ("1", TypeError))

    def check(self, fn: str, name: str, value: object) -> int | None:
        if value is None and self.optional:
            return None
        if type(value) is not int and (isinstance(value, bool) or not isinstance(value, int)):
            words = "an int or None" if self.optional else "an int"
            raise TypeError(f"{fn}: {name} must be {words}, got {type(value).__name__}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{fn}: {name} must be >= {self.minimum}, got {value}")
        return int(value)


Rule = tuple[str, Callable[[float], bool]]  # (the allowed values in words, the test)


@dataclass(frozen=True)
class Real(Kind):
    """A real number (Python or NumPy; a bool only with ``bools``, as torch's float arguments
    take one), returned as a float. ``rules``: ``(words, test)`` pairs tried in order; the first
    that fails raises ``error`` with its words. ``optional``: ``None`` passes; ``tensor0d``: a
    0-dim tensor passes unchecked (a learnable value; reading it would sync)."""

    rules: tuple[Rule, ...] = ()
    type_words: str = "a float"
    bools: bool = False
    optional: bool = False
    tensor0d: bool = False
    error: type[Exception] = ValueError
    good: tuple[Any, ...] = ()
    bad: Bad = ()

    def check(self, fn: str, name: str, value: object) -> Any:
        if value is None and self.optional:
            return None
        if self.tensor0d and isinstance(value, torch.Tensor):
            if value.ndim != 0:
                raise ValueError(f"{fn}: {name} must be a number or a 0-dim tensor, got shape "
                                 f"{tuple(value.shape)}")
            return value
        if not _real(value, self.bools):
            raise TypeError(f"{fn}: {name} must be {self.type_words}, got {type(value).__name__}")
        v = float(value)  # type: ignore[arg-type]
        for words, ok in self.rules:
            if not ok(v):
                raise self.error(f"{fn}: {name} must be {words}, got {value}")  # as given: -1, not -1.0
        return v


@dataclass(frozen=True)
class FloatDtype(Kind):
    """A floating-point ``torch.dtype`` or ``None`` (``TypeError``)."""

    good: tuple[Any, ...] = (None, torch.float32, torch.float64, torch.float16)
    bad: Bad = ((torch.int64, TypeError), ("float32", TypeError), (float, TypeError))

    def check(self, fn: str, name: str, value: object) -> Any:
        if value is None or (isinstance(value, torch.dtype) and value.is_floating_point):
            return value
        raise TypeError(f"{fn}: {name} must be a floating-point torch.dtype or None, got {value!r}")


@dataclass(frozen=True)
class Dim(Kind):
    """A dimension of the input (``many``: or a list/tuple of them), checked by the wrapper
    with ``wrap_dim``/``wrap_dims`` against the input's ndim: ``TypeError`` for a non-int,
    ``IndexError`` out of range, ``ValueError`` for a repeat (and an empty list unless
    ``empty``). Samples are for a 2-d input."""

    many: bool = False
    empty: bool = True
    optional: bool = False  # None: every dimension
    shape_dependent = True
    good: tuple[Any, ...] = (0, 1, -1)
    bad: Bad = ((2, IndexError), (-3, IndexError), (1.0, TypeError), (True, TypeError))

    def __post_init__(self) -> None:
        if self.many:
            good = (*self.good, (0, 1), [1]) + (((),) if self.empty else ())
            bad = (*self.bad, ((1, -1), ValueError)) + ((((), ValueError),) if not self.empty else ())
            object.__setattr__(self, "good", good)
            object.__setattr__(self, "bad", bad)
        if self.optional:
            object.__setattr__(self, "good", (None, *self.good))

    def check(self, fn: str, name: str, value: object) -> Any:  # by wrap_dim(s), with the ndim
        return value


@dataclass(frozen=True)
class Arg:
    """One Python-level argument of an op and what it allows."""

    name: str
    kind: Kind

    def check(self, fn: str, value: object) -> Any:
        return self.kind.check(fn, self.name, value)


SPECS: dict[str, OpSpec] = {}


@dataclass(frozen=True)
class OpSpec:
    """The spec of the public function ``name``.

    ``args``: its scalar arguments in the order ``check`` takes them (every parameter that is
    not a tensor); ``tensors``: its tensor arguments, checked on dtype and shape by the wrapper;
    ``elsewhere``: the parameters the spec does not cover: torch's deprecated
    ``size_average``/``reduce`` (accepted as torch does) and objects with their own checks
    (``options``, ``process_group``, ``vocab_start``). ``replaces``: the torch (or
    ecosystem) function it stands in for; ``reference``: what its values and tests are held to.
    Creating a spec registers it in `SPECS`.
    """

    name: str
    args: tuple[Arg, ...]
    replaces: str
    reference: str
    tensors: tuple[str, ...] = ()
    elsewhere: tuple[str, ...] = ()
    _checked: tuple[Arg, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_checked", tuple(a for a in self.args if not a.kind.shape_dependent))
        SPECS[self.name] = self

    def arg(self, name: str) -> Arg:
        for a in self.args:
            if a.name == name:
                return a
        raise KeyError(f"{self.name} has no argument {name!r}")

    def check(self, *values: object) -> list[Any]:
        """The checked values of the non-dimension ``args``, given in their order."""
        return self.check_as(self.name, *values)

    def check_as(self, fn: str, *values: object) -> list[Any]:
        """`check`, with ``fn`` naming the caller in the messages (a module class)."""
        return [a.kind.check(fn, a.name, v) for a, v in zip(self._checked, values)]


def spec(name: str) -> OpSpec:
    """The spec of the public function ``name``."""
    return SPECS[name]


# ---------------------------------------------------------------------------------- the kinds
# The arguments several ops share, defined once: the same values pass and the same message
# fails everywhere.


def _nonneg(v: float) -> bool:
    return v >= 0  # False for NaN


def _finite(v: float) -> bool:
    return v != float("inf")  # a comparison, not math.isinf: Dynamo traces it on a SymFloat


REDUCTIONS = ("none", "mean", "sum")
REDUCTION = OneOf(REDUCTIONS)
REAL = Real(good=(0.0, 1, -2.5, float("inf"), float("nan")),
            bad=(("0", TypeError), (True, TypeError), (None, TypeError), (1j, TypeError)))
NONNEGATIVE = Real(
    ((">= 0", _nonneg),),
    good=(0.0, 0, 0.5, 1e30, float("inf")),
    bad=((-1, ValueError), (-0.1, ValueError), (float("nan"), ValueError), ("0", TypeError),
         (True, TypeError), (None, TypeError)),
)
FINITE_NONNEGATIVE = Real(
    ((">= 0", _nonneg), ("finite and >= 0", _finite)),
    good=(0.0, 0, 0.5, 2, 1e30),
    bad=((-1, ValueError), (-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
         (1e309, ValueError), ("2", TypeError), (True, TypeError), (None, TypeError),
         (torch.tensor(2.0), TypeError)),
)
GAMMA = FINITE_NONNEGATIVE
# torch's cross_entropy parses label_smoothing as a float: a bool or a NumPy float passes, and a
# value outside [0, 1] is its RuntimeError
LABEL_SMOOTHING = Real(
    (("between 0.0 and 1.0", lambda v: 0.0 <= v <= 1.0),),
    bools=True, error=RuntimeError,
    good=(0.0, 0, 0.1, 1.0, 1, True),
    bad=((-0.1, RuntimeError), (1.5, RuntimeError), (float("nan"), RuntimeError), ("0.1", TypeError),
         (None, TypeError)),
)
IGNORE_INDEX = Int()  # torch: a bool is refused, as every non-int
# torch's linear_cross_entropy: None means -100
OPTIONAL_IGNORE_INDEX = Int(optional=True, good=(None, 0, 5, -100))
DIM = Dim()
DIMS = Dim(many=True)
NONEMPTY_DIMS = Dim(many=True, empty=False)
KEEPDIM = Flag()
# F.kl_div's reductions; torchvision's reduction message starts with "Invalid reduction:"
KL_REDUCTION = OneOf(("none", "batchmean", "mean", "sum"))
TORCHVISION_REDUCTION = OneOf(REDUCTIONS, prefix="Invalid reduction: ")
FLAG = Flag()
EPS = NONNEGATIVE
SMOOTH = FINITE_NONNEGATIVE
FILL = Real(type_words="a real number", good=(0.0, 1, -2.5, float("inf"), float("nan")),
            bad=(("0", TypeError), (True, TypeError), (None, TypeError)))
FLOAT_DTYPE = FloatDtype()
OPTIONAL_DIMS = Dim(many=True, optional=True)
OPTIONAL_NONEMPTY_DIMS = Dim(many=True, optional=True, empty=False)
TEMPERATURE = Real(
    (("a finite float > 0", lambda v: 0 < v < float("inf")),),
    type_words="a float > 0", tensor0d=True,
    good=(0.07, 1, 2.5, torch.tensor(0.5)),
    bad=((0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
         ("0.1", TypeError), (True, TypeError), (None, TypeError), (torch.ones(2), ValueError)),
)
# [0, 1] (also rejects inf and NaN), or torchvision's -1 for no weighting: any other value
# (1.5, -0.5, 1e300) would weight one class negatively or by a huge factor
ALPHA = Real(
    (("in [0, 1], or -1 for no weighting", lambda v: 0.0 <= v <= 1.0 or v == -1.0),),
    good=(0.25, 0, 1.0, -1),
    bad=((1.5, ValueError), (-0.5, ValueError), (float("nan"), ValueError), ("0.25", TypeError),
         (True, TypeError), (None, TypeError)),
)
P_NORM = Real(
    (("a number or inf", lambda v: v == v),),
    type_words="a float (inf allowed)",
    good=(2.0, 1, 0.5, float("inf")),
    bad=((float("nan"), ValueError), ("2", TypeError), (True, TypeError), (None, TypeError)),
)
Z_LOSS = Real(
    ((">= 0", _nonneg), ("finite", _finite)),
    good=(0.0, 0, 1e-4, 1),
    bad=((-1e-4, ValueError), (float("inf"), ValueError), (float("nan"), ValueError), ("0", TypeError),
         (True, TypeError), (None, TypeError)),
)
# applied in float32 (or the input's wider dtype): above float32's max the cap becomes inf there
# and c·tanh(u/c) is inf·0 = NaN
SOFTCAP = Real(
    ((f"None or a finite number > 0 and at most float32's max ({_F32_MAX:.4g})",
      lambda v: 0 < v <= _F32_MAX),),
    optional=True,
    good=(None, 30.0, 1, 1e38),
    bad=((0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
         ("30", TypeError), (True, TypeError)),
)
CHUNK_SIZE = Int(minimum=1, optional=True, good=(None, 1, 7, 4096),
                 bad=((0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError)))
