"""The part of the NaN doctor callbacks that knows no framework: one `FiniteGuard` per
optimizer (whose step is the framework's) and one `DivergenceMonitor` per model."""

from __future__ import annotations

import logging
import weakref
from typing import Any, cast

import torch
from torch import nn

from stablelosses.debug import DivergenceError, DivergenceMonitor, FiniteGuard

__all__ = ["NaNDoctor", "logger"]

logger = logging.getLogger("stablelosses.integrations")


class _FrameworkSteps:
    """An optimizer seen by `FiniteGuard`: its parameters, a ``zero_grad`` that drops the
    gradients, and a ``step`` that does nothing because the training loop steps right after.

    The optimizer is held weakly: the doctor outlives ``fit`` calls, and the optimizer (its
    parameters and state) must not.
    """

    def __init__(self, optimizer: Any) -> None:
        try:
            self._ref: Any = weakref.ref(optimizer)
        except TypeError:  # an object without weak references: held only until `NaNDoctor.close`
            self._ref = lambda o=optimizer: o

    @property
    def optimizer(self) -> Any:
        return self._ref()

    @property
    def param_groups(self) -> list[dict]:
        opt = self._ref()
        return [] if opt is None else opt.param_groups

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        # straight on the parameters: a torch optimizer skips every parameter whose grad is None
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def _steps(optimizer: Any) -> torch.optim.Optimizer:
    return cast(torch.optim.Optimizer, _FrameworkSteps(optimizer))


class DoctorAttributes:
    """The callbacks' read-only view of their `NaNDoctor` (``self.doctor``)."""

    doctor: NaNDoctor

    @property
    def skipped_steps(self) -> int:
        return self.doctor.skipped_steps

    @property
    def report(self) -> str | None:
        return self.doctor.report

    @property
    def error(self) -> Any:
        return self.doctor.error


class NaNDoctor:
    """Skip-and-count on non-finite gradients, early stop on divergence, for any loop that calls
    `record_loss` after each backward and `before_step` before each optimizer step.

    Args:
        max_consecutive: `FiniteGuard`'s: raise `SkippedStepsError` after this many skipped steps
            in a row (None: never).
        divergence: watch for divergence with a `DivergenceMonitor` (``False``: skip-and-count only).
        window, growth, loss_floor: the `DivergenceMonitor`'s.
    """

    def __init__(self, *, max_consecutive: int | None = None, divergence: bool = True, window: int = 5,
                 growth: float = 1e3, loss_floor: float = 1.0) -> None:
        FiniteGuard(_steps(_Empty()), max_consecutive)  # checks the arguments now, not at the fit
        if divergence:
            DivergenceMonitor(nn.Module(), window, growth, loss_floor=loss_floor).close()
        self.max_consecutive = max_consecutive
        self.divergence = divergence
        self.window, self.growth, self.loss_floor = window, growth, loss_floor
        self.guards: dict[int, FiniteGuard] = {}  # id(optimizer) → its guard, for the current fit
        self._closed_skips = 0  # skips counted by the guards of earlier fits
        self.monitor: DivergenceMonitor | None = None
        self.error: DivergenceError | None = None
        self._losses: list[torch.Tensor] = []
        # a checkpoint's state (`load_state`), applied to the guards and the monitor as they are made
        self._pending_guards: list[dict] = []
        self._pending_monitor: dict[str, Any] | None = None

    @property
    def report(self) -> str | None:
        """The divergence report when the run was stopped, else None."""
        return None if self.error is None else str(self.error)

    @property
    def skipped_steps(self) -> int:
        return (self._closed_skips + sum(g.total_skips for g in self.guards.values())
                + sum(int(g["total_skips"]) for g in self._pending_guards))

    def state(self) -> dict[str, Any]:
        """The counters and the monitor's window, for a checkpoint (plain Python values)."""
        return {"guards": [g.state_dict() for g in self.guards.values()] + self._pending_guards,
                "monitor": self.monitor.state_dict() if self.monitor is not None else self._pending_monitor,
                "closed_skips": self._closed_skips}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state` saved. A framework restores a checkpoint before the fit starts, so
        the guards (in the order they were made) and the monitor take their state as they are made."""
        self._closed_skips = int(state.get("closed_skips", 0))
        self._pending_guards = [dict(g) for g in state.get("guards", [])]
        self._pending_monitor = state.get("monitor")

    @property
    def stopped(self) -> bool:
        return self.error is not None

    def start(self, model: nn.Module, optimizer: Any | None = None) -> None:
        if self.divergence and self.monitor is None:
            opt = getattr(optimizer, "optimizer", optimizer)  # a wrapper's torch optimizer
            self.monitor = DivergenceMonitor(
                model, self.window, self.growth,
                optimizer=opt if isinstance(opt, torch.optim.Optimizer) else None, loss_floor=self.loss_floor)
            if self._pending_monitor is not None:
                self.monitor.load_state_dict(self._pending_monitor)
                self._pending_monitor = None

    def close(self) -> None:
        """Remove the monitor's hooks and let go of the model and optimizers; the next `start`
        makes a fresh monitor and guards (a second ``fit``); `skipped_steps` keeps counting."""
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        self._closed_skips = self.skipped_steps  # restored counters not yet taken up included
        self.guards, self._pending_guards, self._pending_monitor = {}, [], None
        self._losses = []

    def record_loss(self, loss: Any) -> None:
        """The loss of one backward (summed over gradient-accumulation micro-batches)."""
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach().reshape(()).float())

    def before_step(self, optimizers: list[Any]) -> bool:
        """Check the gradients before the loop's optimizer step; returns whether to stop.

        When the run diverges the step's gradients are dropped too, so the model stays at the
        last healthy update. Raises `SkippedStepsError` after ``max_consecutive`` skips in a row.
        """
        losses, self._losses = self._losses, []
        if self.monitor is not None and not self.stopped:
            loss = torch.stack(losses).mean() if losses else torch.zeros(())
            try:
                self.monitor.check(loss)
            except DivergenceError as err:
                self.error = err
                logger.error("stablelosses NaN doctor: stopping the run.\n%s", err)
                for opt in optimizers:
                    _FrameworkSteps(opt).zero_grad()
                return True
        for opt in optimizers:
            guard = self.guards.get(id(opt))
            if guard is None or cast(_FrameworkSteps, guard.optimizer).optimizer is not opt:  # id reused
                guard = self.guards[id(opt)] = FiniteGuard(_steps(opt), self.max_consecutive)
                if self._pending_guards:
                    guard.load_state_dict(self._pending_guards.pop(0))
            if not guard.step():
                logger.warning("stablelosses NaN doctor: optimizer step skipped: NaN/Inf gradients "
                               "(%d in a row, %d in all)", guard.consecutive_skips, guard.total_skips)
        return False


class _Empty:
    param_groups: list[dict] = []
