"""The NaN doctor inside the training loops people use.

- `stablelosses.integrations.lightning.NaNDoctorCallback`: a Lightning callback;
- `stablelosses.integrations.transformers.NaNDoctorCallback`: a ``transformers.TrainerCallback``.

Both do what `FiniteGuard` and `DivergenceMonitor` do by hand: an optimizer step whose gradients
hold NaN/Inf is skipped (the gradients are dropped) and counted, and a run whose loss or gradient
norm explodes while still finite is stopped with the monitor's report in the log
(``logging.getLogger("stablelosses.integrations")``). The framework-independent part is
``_doctor.NaNDoctor``. Each submodule imports its framework; this package imports neither.
"""

from __future__ import annotations

__all__: list[str] = []
