"""Helpers shared by the NaN-doctor tests."""

from __future__ import annotations

import pytest

from stablelosses.debug import NonFiniteError, detect_nonfinite


def line_of(path: str, marker: str) -> int:
    """Line number of the first line of ``path`` containing ``marker`` (not this lookup)."""
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "lineno_of" not in line:
                return i
    raise LookupError(marker)


def raised(fn, **opts) -> NonFiniteError:
    """The NonFiniteError that ``fn()`` raises under ``detect_nonfinite(**opts)``."""
    with pytest.raises(NonFiniteError) as info:
        with detect_nonfinite(**opts):
            fn()
    return info.value
