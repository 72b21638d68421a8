"""stablelosses' own functions as operators: checked at their public boundary.

While a `detect_nonfinite` context is active on a thread, every public function of
``stablelosses`` and ``stablelosses.functional`` (those in their ``__all__``) called on that
thread has its result checked: a NaN or Inf it returns from inputs without one is reported
under the public name (``stablelosses.safe_sqrt``, ``stablelosses.functional.cross_entropy``).
What the function does inside (its ATen operators, a ``log 0`` selected away by a ``where``) is
not looked at, so the check does not depend on how a function is written today. Its backward is
checked the same way: each input that requires grad is passed as a view of its own, whose hook
sees the gradient this call sends it; one that is not finite while the forward's inputs and the
incoming gradients were is reported under the public name, phase ``backward``.

How: each public function is, from import on, a thin wrapper (``stablelosses/_public.py``) that
reads one global, the observer slot. While it is empty the wrapper only calls the function.
`install` puts `call` in the slot (the core never imports this module), and the wrapper then
calls `call` here, which finds this thread's detector in a thread-local
and checks the outputs. Nothing is swapped or patched, so other threads, signatures and
``torch.compile`` see the same objects whether or not a detector is open.

Under ``torch.func`` transforms the outputs are wrappers (vmap's batched tensors, grad's and
jvp's dual wrappers) on which ``.item()`` raises or crashes. The check reads the plain tensor
underneath instead (the whole batch; the primal), with the transforms switched off for the
read. Fake tensors hold no values: their results are not checked, and the detector says so
once. A forward-mode AD dual tensor is read through its primal.
"""

from __future__ import annotations

import inspect
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch.utils._pytree import tree_flatten, tree_map

from stablelosses import _compat
from stablelosses._public import closed, is_public, opened
from stablelosses.debug._causes import float64_copies
from stablelosses.debug._checks import _all_finite, _has_nan
from stablelosses.debug._errors import NonFiniteError, TensorSummary
from stablelosses.debug._frames import _user_line
from stablelosses.debug._report import _judge_inputs, _kind, make_error

__all__ = ["install", "uninstall", "call", "public_functions", "public_name"]

# The -inf outputs docs/design.md defines: log-probabilities of masked entries (a -inf input, which
# is not finite and so never blamed, or a mask= argument) and of zero probabilities (xlogy(x, 0)).
# A -inf from these is silent; from finite inputs and no mask it is an overflow
# (log_softmax([3e38, -3e38])), reported as torch's own is; NaN or +inf is always reported.
NEG_INF_OK = frozenset({"log_softmax", "logsumexp", "xlogy", "logaddexp", "log_sigmoid"})

_local = threading.local()  # .det: this thread's detector; .depth: True inside a public call


def public_name(short: str) -> str:
    """The name a report uses: top-level for the ops ``stablelosses`` re-exports."""
    import stablelosses

    top = short in getattr(stablelosses, "__all__", ())
    return f"stablelosses.{short}" if top else f"stablelosses.functional.{short}"


def public_functions() -> list[tuple[str, Callable[..., Any]]]:
    """(public name, function) for every hooked function in the public namespaces.

    The function is the one the hook calls (``__wrapped__``): for the linear losses that is
    their old-spelling shim, itself a ``functools.wraps`` wrapper of the plain function.
    """
    import stablelosses
    import stablelosses.functional as sf

    seen: dict[int, tuple[str, Callable[..., Any]]] = {}
    for mod in (stablelosses, sf):
        for n in getattr(mod, "__all__", ()):
            f: Any = getattr(mod, n, None)
            if is_public(f) and id(f) not in seen:
                seen[id(f)] = (public_name(n), f.__wrapped__)
    return list(seen.values())


def install(det: Any) -> None:
    """Make ``det`` this thread's detector and switch the public functions' hook on."""
    det._outer_detector = getattr(_local, "det", None)  # a context nested on this thread
    det._said = set()
    _local.det = det
    _local.depth = False
    opened(call)


def uninstall(det: Any) -> None:
    """Undo `install`; after the last open detector the hook is a plain call again."""
    if getattr(_local, "det", None) is det:
        _local.det = getattr(det, "_outer_detector", None)
    closed()


def call(fn: Callable[..., Any], short: str, args: tuple, kwargs: dict) -> Any:
    """Run ``fn``; under this thread's active detector, check what it returns and, when its
    backward runs inside the context, the gradients it sends to its inputs (`_watch_backward`)."""
    det = getattr(_local, "det", None)
    if det is None or getattr(_local, "depth", False) or det._suspended:
        return fn(*args, **kwargs)  # not watched here, or inside another public call
    watch = _watch_backward(det, short, args, kwargs)
    if watch is not None:
        args, kwargs = watch.args, watch.kwargs
    _local.depth = True
    try:
        out = fn(*args, **kwargs)
    finally:
        _local.depth = False
    if watch is not None:
        watch.outputs(out)
    if not det.forward:
        return out
    with det.suspended():  # the checks below run torch operators
        err = _check(det, fn, short, out, args, kwargs)
    if err is not None:
        det._emit(err)
    return out


class _Backward:
    """A public function's backward as one operator: the gradients it sends to its inputs,
    judged against its forward inputs and the gradients it received (see `_watch_backward`)."""

    def __init__(self, det: Any, short: str, args: tuple, kwargs: dict, tensors: list) -> None:
        self.det, self.name = det, public_name(short)
        self.in_finite = all(_all_finite(t) for t in tensors)
        self.in_nan = not self.in_finite and any(_has_nan(t) for t in tensors)
        self.tensors = tensors  # summarised only for a report
        self.module_path = det._module_path()
        self.filename, self.lineno = _user_line(sys._getframe(2))
        self.args, self.kwargs = tree_map(self._alias, (args, kwargs))

    def _alias(self, a: Any) -> Any:
        # a view of its own: the hook sees exactly this call's gradient for the input
        if isinstance(a, torch.Tensor) and a.requires_grad and a.is_floating_point():
            a = a.view_as(a)
            a.register_hook(self._sent)
        return a

    def outputs(self, out: Any) -> None:
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and o.requires_grad:
                o.register_hook(self._received)

    def _received(self, g: torch.Tensor) -> None:
        with self.det.suspended():
            finite = _all_finite(g)
            self.in_finite = self.in_finite and finite
            self.in_nan = self.in_nan or (not finite and _has_nan(g))

    def _sent(self, g: torch.Tensor) -> None:
        if self.det._suspended or getattr(_local, "det", None) is not self.det:
            return  # the backward runs after the context closed, or on another thread
        det: Any = self.det
        with det.suspended():
            if _all_finite(g):
                return
            kind = _kind(det, [g], self.in_finite, self.in_nan)
            err = None if kind is None else make_error(
                op=self.name, phase="backward", kind=kind,
                cause="overflow" if kind == "overflow" else "invalid",
                detail="the gradient it sends to an input is not finite, from finite inputs and "
                       "incoming gradients",
                hint=None, module_path=self.module_path, filename=self.filename, lineno=self.lineno,
                node=self.name, forward_op=None, inputs=[TensorSummary.of(t) for t in self.tensors],
                outputs=[TensorSummary.of(g)])
        if err is not None:
            det._emit(err)


def _watch_backward(det: Any, short: str, args: tuple, kwargs: dict) -> _Backward | None:
    """A `_Backward` for a call whose backward may run inside the context: the detector watches
    the backward, grad mode is on, no ``torch.func`` transform is active and an input requires
    grad. None otherwise."""
    if not det.backward or not torch.is_grad_enabled() or _compat.functorch_transforms_active():
        return None
    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    if not any(t.requires_grad for t in tensors) or any(_compat.is_fake(t) for t in tensors):
        return None
    with det.suspended():  # reading the inputs runs torch operators
        return _Backward(det, short, args, kwargs, tensors)


def _check(det: Any, fn: Any, short: str, out: Any, args: tuple, kwargs: dict) -> NonFiniteError | None:
    """The report for a non-finite result, read with any torch.func transform switched off."""
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.is_floating_point()]
    if not outs:
        return None
    if not _compat.functorch_transforms_active():
        return _judge(det, fn, short, outs, args, kwargs)
    guard = _compat.functorch_disabled()
    if guard is None:
        _skip(det, short, "a torch.func transform is active and this torch cannot read past it")
        return None
    with guard:
        return _judge(det, fn, short, outs, args, kwargs)


def _judge(det: Any, fn: Any, short: str, outs: list, args: tuple, kwargs: dict) -> NonFiniteError | None:
    values = [_plain(o) for o in outs]
    if any(v is None for v in values):
        _skip(det, short, "its result is a fake tensor (no values to check)")
        return None
    if all(_all_finite(v) for v in values):
        return None
    return _diagnose(det, fn, public_name(short), args, kwargs, values)


def _plain(t: torch.Tensor) -> torch.Tensor | None:
    """The values of ``t`` as a plain tensor that can be read, or None (a fake tensor)."""
    if _compat.is_fake(t):
        return None
    p = _compat.transform_free_value(t)
    if p is None or _compat.is_fake(p):
        return None
    if _compat.forward_ad_active():
        p = fwAD.unpack_dual(p).primal
    return p


def _skip(det: Any, short: str, why: str) -> None:
    """Say once per detector why results go unchecked."""
    if why not in det._said:
        det._said.add(why)
        filename, lineno = _user_line(sys._getframe())
        warnings.warn_explicit(
            f"detect_nonfinite: stablelosses functions' results are not checked where {why} "
            f"(first: {public_name(short)}); ATen operators outside stablelosses still are",
            UserWarning, filename or "<unknown>", lineno or 0,
        )


_NO_VALUES = object()


def _plain_input(a: Any) -> Any:
    if not isinstance(a, torch.Tensor):
        return a
    p = _plain(a)
    return _NO_VALUES if p is None else p


def _diagnose(det: Any, fn: Any, name: str, args: tuple, kwargs: dict, outs: list) -> NonFiniteError | None:
    short = name.rsplit(".", 1)[-1]
    if name in det.allow or f"aten::{short}" in det.allow:  # 'safe_sqrt' is normalised to 'aten::safe_sqrt'
        return None
    args, kwargs = tree_map(_plain_input, (args, kwargs))
    flat = tree_flatten((args, kwargs))[0]
    if any(a is _NO_VALUES for a in flat):
        return None  # an input holds no values: nothing can be said about it
    tensors = [a for a in flat if isinstance(a, torch.Tensor)]
    in_finite, in_nan = _judge_inputs(flat, tensors)
    kind = _kind(det, outs, in_finite, in_nan)
    if kind is None:
        return None
    defined = short == "xlogy" or isinstance(kwargs.get("mask"), torch.Tensor)
    if (kind == "overflow" and short in NEG_INF_OK and defined
            and not any(_has_nan(o) or bool((o == float("inf")).any()) for o in outs)):
        return None  # a defined -inf: a masked entry or a zero probability
    cause, detail = _cause(fn, short, kind, args, kwargs, in_finite)
    hint = _HINTS.get((short, cause))
    filename, lineno = _user_line(sys._getframe())
    return make_error(
        op=name, phase="forward", kind=kind, cause=cause, detail=detail, hint=hint,
        module_path=det._module_path(), filename=filename, lineno=lineno, node=None, forward_op=None,
        inputs=[TensorSummary.of(t) for t in tensors], outputs=[TensorSummary.of(o) for o in outs],
    )


# (function, cause) → the catalogued hazard behind a result the contract gives on purpose
_HINTS = {
    ("ctc_loss", "log of zero"): (
        "hint: use zero_infinity=True, or give every input at least the length its target needs "
        "— docs: hazards/ctc-impossible-alignment"),
}


def _infinite_in_float64(fn: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``fn`` gives an infinite value on float64 copies of its inputs too: then the
    value is infinite exactly, not a finite one too large for the dtype."""
    try:
        a64, k64, _ = float64_copies(args, kwargs)
        with torch.no_grad():
            out = fn(*a64, **k64)
    except Exception:  # noqa: BLE001 - a function that does not take float64: say overflow
        return False
    return any(bool(torch.isinf(o).any()) for o in tree_flatten(out)[0]
               if isinstance(o, torch.Tensor) and o.is_floating_point())


def _cause(fn: Any, short: str, kind: str, args: tuple, kwargs: dict, in_finite: bool) -> tuple[str, str]:
    """The phrase and a few words for a public function's non-finite result."""
    if kind == "overflow":
        if _infinite_in_float64(fn, args, kwargs):
            # every exact infinity a stablelosses function returns from finite inputs is a log of
            # a zero probability: xlogy(x < 0, 0), an impossible CTC alignment
            return "log of zero", f"{short} returned an infinite value: the log of a zero probability"
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
