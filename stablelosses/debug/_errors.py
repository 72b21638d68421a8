"""The exceptions and warnings of `stablelosses.debug`, and the tensor summary they carry."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorSummary:
    """What a report says about one tensor: dtype, shape, range and non-finite counts."""

    dtype: torch.dtype
    shape: tuple
    min: float | None
    max: float | None
    nan: int
    posinf: int
    neginf: int

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.posinf == 0 and self.neginf == 0

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSummary:
        dtype, shape = t.dtype, tuple(t.shape)
        lo = hi = None
        nan = posinf = neginf = 0
        with torch.no_grad():
            x = t.detach()
            if x.is_complex():
                x = torch.view_as_real(x)
            if x.is_sparse:
                x = x.coalesce().values()
            if x.numel() and x.dtype is not torch.bool:
                if x.is_floating_point():
                    nan = int(torch.isnan(x).sum())
                    posinf = int((x == math.inf).sum())
                    neginf = int((x == -math.inf).sum())
                    lo, hi = float(x.amin()), float(x.amax())
                else:
                    lo, hi = float(x.min()), float(x.max())
        return cls(dtype, shape, lo, hi, nan, posinf, neginf)

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        text = f"{dt}[{', '.join(map(str, self.shape))}]"
        if self.min is not None:
            text += f" min={self.min:.6g} max={self.max:.6g}"
        bad = [f"{n} {k}" for n, k in ((self.nan, "nan"), (self.posinf, "+inf"), (self.neginf, "-inf")) if n]
        if bad:
            text += " (" + ", ".join(bad) + ")"
        return text


class _ReportError(RuntimeError):
    """A ``RuntimeError`` whose report fields, named in ``_fields`` (``_lists``: list-valued),
    are attributes, taken from the keyword arguments (None, or an empty list, when absent)
    and kept across pickling (multiprocessing)."""

    _fields: tuple[str, ...] = ()
    _lists: tuple[str, ...] = ()

    def __init__(self, message: str = "", **info: Any) -> None:
        super().__init__(message)
        for name in self._fields:
            setattr(self, name, info.get(name))
        for name in self._lists:
            setattr(self, name, list(info.get(name, ())))

    def __reduce__(self):
        return (_rebuild_error, (type(self), str(self), dict(self.__dict__)))


def _rebuild_error(cls, message, info):
    err = cls.__new__(cls)
    RuntimeError.__init__(err, message)
    err.__dict__.update(info)
    return err


class NonFiniteError(_ReportError):
    r"""A NaN or Inf was created (raised by `detect_nonfinite` and `FiniteGuard`).

    Attributes:
        op: the ATen operator that produced it, e.g. ``'aten::exp'``, or the public stablelosses
            function, e.g. ``'stablelosses.safe_sqrt'`` (None for `FiniteGuard`).
        phase: ``'forward'`` or ``'backward'``.
        kind: ``'overflow'`` (finite inputs, an ±inf output) or ``'nan'`` (a NaN output from
            inputs without NaN).
        cause: what happened, one of ``'division by zero'`` (a finite non-zero numerator over
            0), ``'0/0'``, ``'log of zero'``, ``'overflow'`` (a finite result too large) and
            ``'invalid'`` (sqrt/log of a negative, inf - inf, 0 * inf); None for `FiniteGuard`.
        hint: for a catalogued hazard, the stablelosses replacement and docs page
            (``'hint: use sl.safe_sqrt / sl.RMSELoss — docs: hazards/sqrt-at-zero'``), else None.
        module_path: dotted path of the innermost ``nn.Module`` running, e.g. ``'net.0'``, or None.
        location: ``'file.py:LINE'`` of the first frame outside torch and stablelosses; for a
            backward operator, the forward line that created its autograd node (when the forward
            ran inside the context; else the line running the backward, as in a custom
            Function's own ``backward``).
        filename, lineno, source: the parts of ``location`` and the source line's text.
        node: in the backward, the autograd node name (``'SqrtBackward0'``), else None.
        forward_op: in the backward, the forward operator the node belongs to, when known.
        inputs: a list of `TensorSummary`, one per tensor input (dtype, shape, min, max).
        outputs: a list of `TensorSummary`, one per floating output.
    """

    _fields = ("op", "phase", "kind", "cause", "hint", "module_path", "filename", "lineno", "source",
               "node", "forward_op")
    _lists = ("inputs", "outputs")

    op: str | None
    phase: str | None
    kind: str | None
    cause: str | None
    hint: str | None
    module_path: str | None
    filename: str | None
    lineno: int | None
    source: str | None
    node: str | None
    forward_op: str | None
    inputs: list[TensorSummary]
    outputs: list[TensorSummary]

    @property
    def location(self) -> str | None:
        if self.filename is None:
            return None
        return f"{self.filename}:{self.lineno}"


class NonFiniteWarning(RuntimeWarning):
    """Issued instead of `NonFiniteError` by ``detect_nonfinite(mode='warn')``."""


class SkippedStepsError(NonFiniteError):
    """`FiniteGuard` skipped ``max_consecutive`` optimizer steps in a row.

    Attributes:
        consecutive: skipped steps in a row.
        total: skipped steps since the guard was made (or loaded).
    """

    def __init__(self, message: str, consecutive: int, total: int) -> None:
        super().__init__(message)
        self.consecutive = consecutive
        self.total = total


class DivergenceError(_ReportError):
    """`DivergenceMonitor` saw the loss or the gradient norm grow by more than ``growth``.

    Raised while both are still finite, so the model and the optimizer state are still
    usable (lower the learning rate and resume from the last checkpoint).

    Attributes:
        step: the `DivergenceMonitor.check` call (0-based) at which it fired.
        quantity: ``'loss'`` or ``'gradient norm'``, the one that grew.
        growth: how much it grew: its value now over the smallest value in the window.
        module_path: the module whose gradient norm grew the most (``'net.0'``), or None.
        module_type: its class name (``'BatchNorm2d'``), or None.
        precursors: the known causes found by looking at the model, one sentence each.
    """

    _fields = ("step", "quantity", "growth", "module_path", "module_type")
    _lists = ("precursors",)

    step: int | None
    quantity: str | None
    growth: float | None
    module_path: str | None
    module_type: str | None
    precursors: list[str]


class DivergenceWarning(RuntimeWarning):
    """Issued instead of `DivergenceError` by ``DivergenceMonitor(mode='warn')``."""
