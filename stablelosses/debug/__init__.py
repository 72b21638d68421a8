r"""Find the first NaN/Inf in a training step, skip optimizer steps on non-finite gradients,
and catch a diverging run before its loss is infinite.

- [`detect_nonfinite`][stablelosses.debug.detect_nonfinite]: a context manager that watches every
  ATen operator, in the forward and in the backward, and stops at the **first** one that turns
  finite values into NaN or Inf. The error names the operator, the phase, the module path, the
  user source line and the input ranges.
- [`FiniteGuard`][stablelosses.debug.FiniteGuard]: wraps an optimizer; `guard.step()` steps
  only when every gradient is finite, otherwise drops the gradients and counts the skip.
- [`DivergenceMonitor`][stablelosses.debug.DivergenceMonitor]: `monitor.check(loss)` after the
  backward raises `DivergenceError` when the loss or gradient norm explodes, while still finite,
  naming the fastest-growing module and known precursors (tiny BatchNorm batches, large
  update-to-weight ratios).

One module per job: ``_errors`` (exceptions, `TensorSummary`), ``_frames`` (which frame is user
code), ``_checks`` (cheap finiteness tests), ``_detector`` (`detect_nonfinite`), ``_report``
and ``_causes`` (what a report says), ``_boundary`` (stablelosses' own functions as operators),
``_guard`` (`FiniteGuard`), ``_divergence`` and ``_precursors`` (`DivergenceMonitor`), ``_trace``
(the ``stablelosses trace`` command).
"""

from __future__ import annotations

from stablelosses.debug._detector import detect_nonfinite
from stablelosses.debug._divergence import DivergenceMonitor
from stablelosses.debug._errors import (
    DivergenceError,
    DivergenceWarning,
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
    "DivergenceMonitor",
    "DivergenceError",
    "DivergenceWarning",
]
