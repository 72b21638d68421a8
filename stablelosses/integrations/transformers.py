"""`NaNDoctorCallback` for the Transformers ``Trainer``.

Example:
    ```python
    from transformers import Trainer
    from stablelosses.integrations.transformers import NaNDoctorCallback

    doctor = NaNDoctorCallback(max_consecutive=20)
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[doctor])
    trainer.train()
    print(doctor.skipped_steps, doctor.report)  # None when the run did not diverge
    ```
"""

from __future__ import annotations

from typing import Any

import torch

from stablelosses.integrations._doctor import DoctorAttributes, NaNDoctor

try:
    from transformers import TrainerCallback
except ImportError:
    TrainerCallback = None  # type: ignore[assignment,misc]

__all__ = ["NaNDoctorCallback"]


def _loss_of(output: Any) -> Any:
    if isinstance(output, dict) or hasattr(output, "keys"):
        try:
            return output["loss"]
        except (KeyError, TypeError):
            return None
    return getattr(output, "loss", None)


class NaNDoctorCallback(DoctorAttributes, TrainerCallback if TrainerCallback is not None else object):  # type: ignore[misc]
    """FiniteGuard's skip-and-count and DivergenceMonitor's early stop, as a ``TrainerCallback``.

    In ``on_pre_optimizer_step`` (after the backward and gradient clipping): a step whose
    gradients hold NaN/Inf is skipped, its gradients dropped and the skip counted (a warning in
    the log; `SkippedStepsError` after ``max_consecutive`` in a row; the learning-rate schedule
    still advances). A run whose loss or gradient norm grows by more than ``growth`` while still
    finite is stopped (``control.should_training_stop``) before that step is applied, and the
    monitor's report is logged (``logging.getLogger("stablelosses.integrations")``, level ERROR)
    and kept in `report`.

    The loss is read from the model's output (``outputs.loss``, as every Transformers model with
    labels returns it) by a forward hook, averaged over gradient-accumulation micro-batches; a
    model without one is judged on its gradient norm only.

    Args:
        max_consecutive: `SkippedStepsError` from ``on_pre_optimizer_step``, which ends
            ``trainer.train()``, after this many skipped steps in a row (None: never).
        divergence: also end training on divergence with ``control.should_training_stop``
            (``False``: skip-and-count only).
        window, growth, loss_floor: as in `DivergenceMonitor`, which watches ``outputs.loss``
            (the mean over the accumulated micro-batches) and the gradient norm.

    Attributes:
        skipped_steps: optimizer steps skipped because of NaN/Inf gradients, over every
            ``train()`` this callback took part in.
        report: the text of `error`, as logged when training was stopped; else None.
        error: the `DivergenceError` that set ``control.should_training_stop``, else None.
    """

    def __init__(self, *, max_consecutive: int | None = None, divergence: bool = True, window: int = 5,
                 growth: float = 1e3, loss_floor: float = 1.0) -> None:
        if TrainerCallback is None:
            raise ImportError("stablelosses.integrations.transformers needs transformers: "
                              "pip install transformers")
        self.doctor = NaNDoctor(max_consecutive=max_consecutive, divergence=divergence, window=window,
                                growth=growth, loss_floor=loss_floor)
        self._hook: Any = None

    def _forward_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self.doctor.record_loss(_loss_of(output))

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if model is not None:
            self.doctor.start(model, optimizer)
            if self._hook is None:
                self._hook = model.register_forward_hook(self._forward_hook)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.doctor.close()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                              **kwargs: Any) -> Any:
        if optimizer is None:
            return control
        if self.doctor.stopped:
            self.doctor.before_step([])
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            return control
        if self.doctor.before_step([optimizer]):
            control.should_training_stop = True
        return control
