"""The public functions' one hook: an observer slot that the NaN doctor fills.

Every function in ``stablelosses.functional.__all__`` (and so every op re-exported at the top
level, and every module class, which calls these) is the wrapper `public` makes when the
namespace is built. The wrapper reads one module global, `observer`. While it is ``None`` (no
``detect_nonfinite`` context open anywhere in the process) it calls the function and nothing
else happens: under ``torch.compile`` the read becomes a guard on a constant, with no graph
break. While a detector is open the slot holds the doctor's ``call(fn, name, args, kwargs)``,
and the wrapper hands the call to it.

The core never imports the doctor: ``stablelosses.debug`` registers itself here through
`opened` and leaves through `closed` (the arrows point down only). Nothing is ever swapped:
the wrapper is the public object from import on, ``functools.wraps`` keeps its name, docstring
and (through ``__wrapped__``) its signature, and the slot is changed only under a lock.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["public", "opened", "closed", "is_public"]

F = TypeVar("F", bound=Callable[..., Any])
Observer = Callable[[Callable[..., Any], str, tuple, dict], Any]

observer: Observer | None = None  # the doctor's call while a detector is open, else None
_open = 0  # detect_nonfinite contexts open in the process (all threads)
_lock = threading.Lock()


def opened(call: Observer) -> None:
    """A detector opened: public functions now hand their calls to ``call``."""
    global observer, _open
    with _lock:
        _open += 1
        observer = call


def closed() -> None:
    """A detector closed; when it was the last one, the wrappers are plain calls again."""
    global observer, _open
    with _lock:
        _open = max(0, _open - 1)
        if _open == 0:
            observer = None


def public(fn: F, namespace: str) -> F:
    """``fn`` as the public function ``namespace.<its name>``, with the observer hook."""

    @functools.wraps(fn)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        watch = observer
        if watch is not None:
            return watch(fn, hooked.__name__, args, kwargs)
        return fn(*args, **kwargs)

    hooked.__module__ = namespace  # where pickle and repr find the public object
    hooked.__qualname__ = hooked.__name__
    hooked._stablelosses_public = True  # type: ignore[attr-defined]
    return hooked  # type: ignore[return-value]


def is_public(obj: Any) -> bool:
    """Whether ``obj`` is a public function carrying the hook."""
    return getattr(obj, "_stablelosses_public", False) is True
