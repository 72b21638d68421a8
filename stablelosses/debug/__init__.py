r"""Find the first NaN/Inf in a training step, skip optimizer steps on non-finite gradients,
and catch a diverging run before its loss is infinite.

- [`detect_nonfinite`][stablelosses.debug.detect_nonfinite]: a context manager that watches every
  ATen operator, in the forward and in the backward, and stops at the **first** one that turns
  finite values into NaN or Inf. The error names the operator, the phase, the module path, the
  user source line and the input ranges.
- [`FiniteGuard`][stablelosses.debug.FiniteGuard]: wraps an optimizer; `guard.step()` steps
  only when every gradient is finite, otherwise drops the gradients and counts the skip.

One module per job: ``_errors`` (exceptions, `TensorSummary`), ``_frames`` (which frame is user
code), ``_checks`` (cheap finiteness tests), ``_detector`` (`detect_nonfinite`), ``_guard``
(`FiniteGuard`).
"""

from __future__ import annotations

from stablelosses.debug._detector import detect_nonfinite
from stablelosses.debug._errors import (
    NonFiniteError,
    NonFiniteWarning,
    SkippedStepsError,
    TensorSummary,
)
from stablelosses.debug._guard import FiniteGuard

__all__ = [
    "NonFiniteError",
    "NonFiniteWarning",
    "SkippedStepsError",
    "TensorSummary",
    "detect_nonfinite",
    "FiniteGuard",
]
