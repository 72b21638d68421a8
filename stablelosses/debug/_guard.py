"""FiniteGuard: step the optimizer only when every gradient is finite."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from stablelosses.debug._errors import SkippedStepsError

# --------------------------------------------------------------------------------------------
# FiniteGuard


class FiniteGuard:
    r"""Step the optimizer only when every gradient is finite.

    ``guard.step()`` checks all gradients of the optimizer's parameters with one fused
    reduction (the largest magnitude over all gradients, ``torch.nn.utils.get_total_norm(grads,
    inf)``, then one host read) and then either steps the optimizer or, when any gradient
    holds NaN/Inf, sets every gradient to ``None``, counts the skip and returns ``False``. After
    ``max_consecutive`` skips in a row it raises `SkippedStepsError` (a `NonFiniteError`).

    Under ``torch.distributed`` (when initialized) the flag is all-reduced (one ``MAX``
    all-reduce of a single value), so every rank skips the same steps and replicas stay
    identical even when only one rank saw a NaN.

    **With other tools.**
    ``clip_grad_norm_``: clip first, then ``guard.step()``; a NaN/Inf gradient makes the total
    norm non-finite and clipping spreads it, so the step is skipped either way (leave
    ``error_if_nonfinite=False``). LR schedulers: call ``scheduler.step()`` every iteration as
    usual; skipped steps still advance the schedule (PyTorch may warn once if the very first
    optimizer step is skipped). ``torch.amp.GradScaler``: pass it, ``guard.step(scaler=scaler)``,
    then call ``scaler.update()``; the guard unscales the gradients (unless you already called
    ``scaler.unscale_(optimizer)``, e.g. to clip), checks them, and calls ``scaler.step`` only when
    they are finite. Early in training the scaler's overflows are normal and counted as skips:
    set ``max_consecutive`` above a few dozen with a scaler.

    Args:
        optimizer: any ``torch.optim.Optimizer``; one that needs a closure (LBFGS) gets it
            through ``guard.step(closure)``.
        max_consecutive: raise after this many skips in a row; ``None`` never raises.

    Attributes:
        loss: what the closure returned at the last ``guard.step(closure)`` (else None).

    Example:
        >>> import torch
        >>> from stablelosses.debug import FiniteGuard
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> guard = FiniteGuard(torch.optim.SGD([w], lr=0.1), max_consecutive=3)
        >>> torch.sqrt(w - 1).sum().backward()  # gradient inf at 0
        >>> guard.step(), guard.consecutive_skips, w.grad
        (False, 1, None)
        >>> (w * w).sum().backward()
        >>> guard.step(), guard.consecutive_skips, w.detach()
        (True, 0, tensor([0.8000, 0.8000]))
    """

    def __init__(self, optimizer: torch.optim.Optimizer, max_consecutive: int | None = None) -> None:
        if max_consecutive is not None:
            if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int):
                raise TypeError(
                    "FiniteGuard: max_consecutive must be an int or None, "
                    f"got {type(max_consecutive).__name__}"
                )
            if max_consecutive < 1:
                raise ValueError(f"FiniteGuard: max_consecutive must be >= 1, got {max_consecutive}")
        self.optimizer = optimizer
        self.max_consecutive = max_consecutive
        self._consecutive = 0
        self._total = 0
        self._steps = 0
        self.loss: Any = None

    @property
    def consecutive_skips(self) -> int:
        """Skipped steps in a row, up to now (0 after a step)."""
        return self._consecutive

    @property
    def total_skips(self) -> int:
        """All skipped steps."""
        return self._total

    @property
    def steps(self) -> int:
        """Steps taken."""
        return self._steps

    def _grads(self) -> list:
        grads = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    g = g.coalesce()._values()
                grads.append(g)
        return grads

    def grads_finite(self) -> bool:
        """Whether every gradient is finite (agreed over all ranks when distributed)."""
        grads = self._grads()
        bad = None
        if grads:
            # The largest magnitude over all gradients (fused per device and dtype): NaN if any
            # is NaN, inf if any is inf; it cannot overflow as a 2-norm would.
            top = torch.nn.utils.get_total_norm(grads, math.inf, foreach=True)
            bad = (~torch.isfinite(top)).to(torch.int32).reshape(1)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            if bad is None:
                bad = torch.zeros(1, dtype=torch.int32)
            if dist.get_backend() == "nccl" and bad.device.type != "cuda":
                bad = bad.cuda()
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bad is None or int(bad.item()) == 0

    def step(self, closure: Callable[[], Any] | None = None, *, scaler: Any | None = None) -> bool:
        """Step if every gradient is finite; else drop the gradients and count a skip.

        Args:
            closure: as for ``optimizer.step(closure)`` (LBFGS needs one): it clears the
                gradients, computes the loss, calls ``backward`` and returns the loss. The guard
                calls it once and checks the gradients it produced; when they are finite, the
                optimizer steps with it, and its first call inside the optimizer returns that
                same loss and gradients instead of computing them again. The loss is kept as
                `loss`.
            scaler: a ``torch.amp.GradScaler``; the guard unscales (if not done yet), checks,
                and steps through ``scaler.step``. Call ``scaler.update()`` after.

        Returns:
            Whether the optimizer stepped.

        Raises:
            SkippedStepsError: the skip made ``max_consecutive`` skips in a row.
            ValueError: both ``closure`` and an enabled ``scaler`` (``GradScaler.step`` takes no
                closure).
        """
        if closure is not None:
            if scaler is not None and scaler.is_enabled():
                raise ValueError(
                    "FiniteGuard.step: closure and scaler cannot be used together "
                    "(GradScaler.step does not support a closure), got both"
                )
            with torch.enable_grad():
                first = closure()
            self.loss = first
            pending = [first]

            def replay() -> Any:
                if pending:  # the optimizer's first evaluation: the one already checked
                    return pending.pop()
                return closure()

            if self.grads_finite():
                self.optimizer.step(replay)
                self._consecutive = 0
                self._steps += 1
                return True
            return self._skip()
        if scaler is not None and scaler.is_enabled():
            from torch.amp.grad_scaler import OptState

            state = scaler._per_optimizer_states[id(self.optimizer)]
            if state["stage"] is OptState.READY:
                scaler.unscale_(self.optimizer)
        if self.grads_finite():
            if scaler is not None and scaler.is_enabled():
                scaler.step(self.optimizer)
            else:
                self.optimizer.step()
            self._consecutive = 0
            self._steps += 1
            return True
        return self._skip()

    def _skip(self) -> bool:
        """Drop the gradients, count the skip, raise after ``max_consecutive`` in a row."""
        self.optimizer.zero_grad(set_to_none=True)
        self._consecutive += 1
        self._total += 1
        if self.max_consecutive is not None and self._consecutive >= self.max_consecutive:
            raise SkippedStepsError(
                f"FiniteGuard: {self._consecutive} optimizer steps skipped in a row because of "
                f"NaN/Inf gradients (max_consecutive={self.max_consecutive}, {self._total} skipped "
                f"in all); find the first one with stablelosses.debug.detect_nonfinite()",
                self._consecutive,
                self._total,
            )
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The counters (not the optimizer's state: save that with ``optimizer.state_dict()``)."""
        return {
            "consecutive_skips": self._consecutive,
            "total_skips": self._total,
            "steps": self._steps,
            "max_consecutive": self.max_consecutive,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters saved by `state_dict`."""
        self._consecutive = int(state["consecutive_skips"])
        self._total = int(state["total_skips"])
        self._steps = int(state.get("steps", 0))
        if "max_consecutive" in state:
            self.max_consecutive = state["max_consecutive"]

    def __repr__(self) -> str:
        return (f"FiniteGuard({type(self.optimizer).__name__}, max_consecutive={self.max_consecutive}, "
                f"steps={self._steps}, skipped={self._total})")
