"""`NaNDoctorCallback` for Lightning (``lightning.pytorch``, or the older ``pytorch_lightning``).

Example:
    ```python
    import lightning as L
    from stablelosses.integrations.lightning import NaNDoctorCallback

    doctor = NaNDoctorCallback(max_consecutive=20)
    trainer = L.Trainer(max_epochs=10, callbacks=[doctor])
    trainer.fit(model, data)
    print(doctor.skipped_steps, doctor.report)  # None when the run did not diverge
    ```
"""

from __future__ import annotations

from typing import Any

from stablelosses.integrations._doctor import DoctorAttributes, NaNDoctor

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef,assignment]
    except ImportError:
        Callback = None  # type: ignore[assignment,misc]

__all__ = ["NaNDoctorCallback"]


class NaNDoctorCallback(DoctorAttributes, Callback if Callback is not None else object):  # type: ignore[misc]
    """FiniteGuard's skip-and-count and DivergenceMonitor's early stop, as a Lightning callback.

    Before each optimizer step (after the backward, gradient clipping and AMP unscaling): a step
    whose gradients hold NaN/Inf is skipped, its gradients dropped and the skip counted (a
    warning in the log; `SkippedStepsError` after ``max_consecutive`` in a row). A run whose loss
    or gradient norm grows by more than ``growth`` while still finite is stopped
    (``trainer.should_stop``) before that step is applied, and the monitor's report is logged
    (``logging.getLogger("stablelosses.integrations")``, level ERROR) and kept in `report`.

    Manual optimization: the hooks still run when ``self.manual_backward`` and
    ``optimizer.step()`` are used.

    Args:
        max_consecutive: `SkippedStepsError` from ``on_before_optimizer_step``, which ends
            ``trainer.fit``, after this many skipped steps in a row (None: never).
        divergence: also stop the fit on divergence with ``trainer.should_stop`` (``False``:
            skip-and-count only).
        window, growth, loss_floor: as in `DivergenceMonitor`, which watches the loss handed to
            ``on_before_backward`` and the gradient norm.

    Attributes:
        skipped_steps: optimizer steps skipped because of NaN/Inf gradients, over every ``fit``
            this callback took part in.
        report: the text of `error`, as logged when the fit was stopped; else None.
        error: the `DivergenceError` that set ``trainer.should_stop``, else None.
    """

    def __init__(self, *, max_consecutive: int | None = None, divergence: bool = True, window: int = 5,
                 growth: float = 1e3, loss_floor: float = 1.0) -> None:
        if Callback is None:
            raise ImportError("stablelosses.integrations.lightning needs Lightning: pip install lightning")
        super().__init__()
        self.doctor = NaNDoctor(max_consecutive=max_consecutive, divergence=divergence, window=window,
                                growth=growth, loss_floor=loss_floor)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        opts = trainer.optimizers
        self.doctor.start(pl_module, opts[0] if len(opts) == 1 else None)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.doctor.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # After every fit, also one that raised: the doctor lets go of the model and optimizers,
        # and so does this callback: Lightning binds the module's ``log``/``log_dict`` onto each
        # callback at setup (the next fit binds them again), which keeps the module, its trainer
        # and their optimizers alive as long as the callback lives.
        self.doctor.close()
        for name in ("log", "log_dict"):
            self.__dict__.pop(name, None)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self.doctor.record_loss(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.doctor.stopped:
            self.doctor.before_step([])
            for group in optimizer.param_groups:  # stopping: apply nothing more
                for p in group["params"]:
                    p.grad = None
            return
        if self.doctor.before_step([optimizer]):
            trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        """The skip counters and the divergence window, saved in Lightning's checkpoints."""
        return self.doctor.state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict`'s counters and window (``trainer.fit(ckpt_path=...)`` calls this
        before the fit starts): a resumed run keeps counting its skips in a row."""
        self.doctor.load_state(state_dict)
