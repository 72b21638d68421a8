"""stablelosses' own functions as operators: checked at their public boundary.

While a `detect_nonfinite` context is active, every public function of ``stablelosses`` and
``stablelosses.functional`` (those in their ``__all__``) runs through a check of its result:
a NaN or Inf it returns from inputs without one is reported under the public name
(``stablelosses.safe_sqrt``, ``stablelosses.functional.cross_entropy``). What the function does
inside (its ATen operators, a ``log 0`` selected away by a ``where``) is not looked at, so the
check does not depend on how a function is written today.

How: on entering the first context, each function's ``__code__`` is swapped for a small
trampoline that calls `call` with the function's original code (a copy of the function); on
leaving the last context the original code is put back. Swapping the code, rather than the
module attribute, reaches every reference to the function: ``from stablelosses.functional
import cross_entropy`` made before the context, and the module classes in ``losses.py``.
Functions with a closure cannot have their code swapped and are left unchecked (none today).
"""

from __future__ import annotations

import inspect
import sys
import threading
import types
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from stablelosses.debug._checks import _all_finite, _has_nan
from stablelosses.debug._errors import NonFiniteError, TensorSummary
from stablelosses.debug._frames import _user_line
from stablelosses.debug._report import _judge_inputs, _kind, make_error

__all__ = ["install", "uninstall", "call", "public_functions"]

# The contract's defined -inf outputs: log-probabilities of masked entries or zero probabilities,
# logsumexp of an all -inf slice. A -inf from these is silent; NaN or +inf is still reported.
NEG_INF_OK = frozenset({"log_softmax", "logsumexp", "xlogy", "logaddexp", "log_sigmoid"})

_lock = threading.Lock()
_installed: dict[int, tuple[types.FunctionType, types.CodeType]] = {}  # key -> (function, code)
_calls: dict[int, tuple[types.FunctionType, str]] = {}  # key -> (copy of the original, name)
_users = 0
_local = threading.local()  # .det: the detector of this thread; .depth: inside a public call

_TEMPLATE = (
    "def {name}(*args, **kwargs):\n"
    "    return __import__('stablelosses.debug._boundary', fromlist=['call']).call({key}, args, kwargs)\n"
)


def public_functions() -> list[tuple[str, types.FunctionType]]:
    """(public name, function) for every plain Python function in the public namespaces."""
    import stablelosses
    import stablelosses.functional as sf

    seen: dict[int, tuple[str, types.FunctionType]] = {}
    for mod, prefix in ((stablelosses, "stablelosses"), (sf, "stablelosses.functional")):
        for n in getattr(mod, "__all__", ()):
            f = getattr(mod, n, None)
            # a functools.wraps wrapper (the linear losses' old-spelling shim) calls the plain
            # function it wraps: swapping that one's code covers every call
            f = getattr(f, "__wrapped__", f)
            if isinstance(f, types.FunctionType) and id(f) not in seen and not f.__closure__:
                seen[id(f)] = (f"{prefix}.{n}", f)
    return list(seen.values())


def _trampoline(f: types.FunctionType, key: int) -> types.CodeType:
    scope: dict[str, Any] = {}
    src = _TEMPLATE.format(name=f.__name__, key=key)
    exec(compile(src, __file__, "exec"), scope)  # noqa: S102 - a fixed template, no user input
    code: types.CodeType = scope[f.__name__].__code__
    if sys.version_info >= (3, 11):
        code = code.replace(co_qualname=f.__qualname__)
    return code


def install(det: Any) -> None:
    """Route the public functions through `call` for ``det``'s thread (first user swaps code)."""
    global _users
    with _lock:
        if _users == 0:
            for key, (name, f) in enumerate(public_functions()):
                copy = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__)
                copy.__kwdefaults__ = f.__kwdefaults__
                copy.__qualname__ = f.__qualname__
                _calls[key] = (copy, name)
                _installed[key] = (f, f.__code__)
                f.__code__ = _trampoline(f, key)
        _users += 1
    det._outer_detector = getattr(_local, "det", None)  # a context nested on this thread
    _local.det = det
    _local.depth = 0


def uninstall(det: Any) -> None:
    """Undo `install`; the last user puts every original code back."""
    global _users
    if getattr(_local, "det", None) is det:
        _local.det = getattr(det, "_outer_detector", None)
    with _lock:
        _users -= 1
        if _users == 0:
            for f, code in _installed.values():
                f.__code__ = code
            _installed.clear()
            _calls.clear()


def call(key: int, args: tuple, kwargs: dict) -> Any:
    """Run public function ``key``; on this thread's active detector, check what it returns."""
    fn, name = _calls[key]
    det = getattr(_local, "det", None)
    if det is None or _local.depth or det._suspended or not det.forward:
        return fn(*args, **kwargs)  # not watched here, or inside another public call
    _local.depth = 1
    try:
        out = fn(*args, **kwargs)
    finally:
        _local.depth = 0
    det._suspended = True  # the checks below run torch operators
    try:
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.is_floating_point()]
        if all(_all_finite(o) for o in outs):
            return out
        err = _diagnose(det, fn, name, args, kwargs, outs)
    finally:
        det._suspended = False
    if err is not None:
        det._emit(err)
    return out


def _diagnose(det: Any, fn: Any, name: str, args: tuple, kwargs: dict, outs: list) -> NonFiniteError | None:
    short = name.rsplit(".", 1)[-1]
    if name in det.allow or f"aten::{short}" in det.allow:  # 'safe_sqrt' is normalised to 'aten::safe_sqrt'
        return None
    flat = tree_flatten((args, kwargs))[0]
    tensors = [a for a in flat if isinstance(a, torch.Tensor)]
    in_finite, in_nan = _judge_inputs(args, flat, tensors, (), None)
    kind = _kind(det, outs, in_finite, in_nan)
    if kind is None:
        return None
    if (kind == "overflow" and short in NEG_INF_OK
            and not any(_has_nan(o) or bool((o == float("inf")).any()) for o in outs)):
        return None  # a defined -inf: a masked entry or a zero probability
    cause, detail = _cause(fn, short, kind, args, kwargs, in_finite)
    filename, lineno = _user_line(sys._getframe())
    return make_error(
        op=name, phase="forward", kind=kind, cause=cause, detail=detail, hint=None,
        module_path=det._module_path(), filename=filename, lineno=lineno, node=None, forward_op=None,
        inputs=[TensorSummary.of(t) for t in tensors], outputs=[TensorSummary.of(o) for o in outs],
    )


def _cause(fn: Any, short: str, kind: str, args: tuple, kwargs: dict, in_finite: bool) -> tuple[str, str]:
    """The phrase and a few words for a public function's non-finite result."""
    if kind == "overflow":
        return "overflow", f"{short} returned a value too large for the dtype from finite inputs"
    if not in_finite:
        return "invalid", "inf - inf or 0 * inf on infinite inputs"
    if short == "safe_sqrt":
        return "invalid", "sqrt of a negative"
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
        bound.apply_defaults()
        reduction = bound.arguments.get("reduction")
    except (TypeError, ValueError):
        reduction = None
    if reduction in ("mean", "batchmean"):
        return "0/0", (
            f"reduction={reduction!r} over nothing counted: every target ignored, zero weights or an "
            "empty input; torch gives NaN too"
        )
    return "invalid", "outside the function's domain"
