"""The public functions' one hook: a count of open ``detect_nonfinite`` contexts.

Every function in ``stablelosses.functional.__all__`` (and so every op re-exported at the top
level, and every module class, which calls these) is the wrapper `public` makes when the
namespace is built. The wrapper reads one module global, `watchers`. While it is 0 (no
detector open anywhere in the process) it calls the function and nothing else happens: under
``torch.compile`` the read becomes a guard on a constant, with no graph break. While a
detector is open it hands the call to ``stablelosses.debug._boundary.call``, which looks at
this thread's detector and checks what the function returns.

Nothing is ever swapped: the wrapper is the public object from import on, ``functools.wraps``
keeps its name, docstring and (through ``__wrapped__``) its signature, and the count is changed
only under a lock by `opened` and `closed`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["public", "opened", "closed", "is_public"]

F = TypeVar("F", bound=Callable[..., Any])

watchers = 0  # detect_nonfinite contexts open in the process (all threads)
_lock = threading.Lock()


def opened() -> None:
    """A detector opened: public functions now hand their calls to the boundary check."""
    global watchers
    with _lock:
        watchers += 1


def closed() -> None:
    """A detector closed; when it was the last one, the wrappers are plain calls again."""
    global watchers
    with _lock:
        watchers = max(0, watchers - 1)


def public(fn: F, namespace: str) -> F:
    """``fn`` as the public function ``namespace.<its name>``, with the detector's hook."""

    @functools.wraps(fn)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        if watchers:
            from stablelosses.debug._boundary import call

            return call(fn, hooked.__name__, args, kwargs)
        return fn(*args, **kwargs)

    hooked.__module__ = namespace  # where pickle and repr find the public object
    hooked.__qualname__ = hooked.__name__
    hooked._stablelosses_public = True  # type: ignore[attr-defined]
    return hooked  # type: ignore[return-value]


def is_public(obj: Any) -> bool:
    """Whether ``obj`` is a public function carrying the hook."""
    return getattr(obj, "_stablelosses_public", False) is True
