"""DivergenceMonitor: catch a run whose loss or gradient norm explodes, before it is inf."""

from __future__ import annotations

import math
import warnings
from collections import deque
from typing import Any

import torch
from torch import nn

from stablelosses._compat import foreach_norm
from stablelosses.debug._errors import DivergenceError, DivergenceWarning
from stablelosses.debug._frames import _root_name
from stablelosses.debug._precursors import (
    batchnorm_precursors,
    fastest_module,
    format_divergence,
    update_ratio,
)

__all__ = ["DivergenceMonitor"]

_QUANTITIES = ("loss", "gradient norm")


def _norms_and_loss(
    grads: list[torch.Tensor | None], loss: torch.Tensor, wide: bool = False
) -> list[float]:
    """Per-tensor gradient 2-norms (0 for a missing gradient), then the loss, read in one sync.

    The norms are fused per (device, dtype); ``wide`` accumulates them in float64 (about 3x the
    cost on CPU), which `DivergenceMonitor.check` asks for only when a norm overflowed.
    """
    by_key: dict[tuple[Any, Any], list[int]] = {}
    for i, g in enumerate(grads):
        if g is not None:
            by_key.setdefault((g.device, g.dtype), []).append(i)
    if len(by_key) == 1 and not wide:
        # the common case, one device and dtype: the norms and the loss in one stack, one read
        ((device, dtype), idx), = by_key.items()
        group = [g for g in (grads[i] for i in idx) if g is not None]
        ld = loss.detach().reshape(())
        if ld.device == device and ld.dtype == dtype:
            *values, value_loss = torch.stack([*foreach_norm(group, 2), ld]).tolist()
            per = [0.0] * len(grads)
            for i, v in zip(idx, values):
                per[i] = v
            return [*per, value_loss]
    stacks, order = [], []
    for idx in by_key.values():
        group = [g for g in (grads[i] for i in idx) if g is not None]
        st = torch.stack(list(foreach_norm(group, 2, torch.float64 if wide else None)))
        stacks.append(st.to(loss.device, torch.float64))
        order.extend(idx)
    read = torch.cat([*stacks, loss.detach().reshape(1).to(torch.float64)])
    *values, value_loss = read.tolist()  # the one host sync
    per = [0.0] * len(grads)
    for i, v in zip(order, values):
        per[i] = v
    return [*per, value_loss]


class DivergenceMonitor:
    r"""Raise (or warn) when the loss or the gradient norm explodes, while both are still finite.

    Call `check` once per step, after ``loss.backward()`` and before ``optimizer.step()``. It
    keeps the loss and the global gradient norm $\|g\|_2$ of the last ``window`` steps and
    fires at the first finite step where either has grown by more than ``growth`` against
    them (one such step is enough: the next may already be ``inf``). The gradient norm grows by
    ``growth`` when it exceeds ``growth`` times the smallest norm in the window. The loss, which
    may be negative (a negative log-likelihood, an ELBO), grows by ``growth`` when it rises above
    the smallest loss in the window $m$ by more than ``growth`` $\cdot\max(|m|, \text{loss\_floor})$:
    a loss that improves through zero never fires, and one near zero must rise to about
    ``growth * loss_floor`` before it counts. Non-finite values are not judged (use
    `detect_nonfinite` or `FiniteGuard` for those); the point is to
    stop a few steps *before* the loss is ``inf``.

    The message names the step, the growth, the module (by its path in ``model``) whose
    gradient norm grew the most, and known precursors found by looking at the model: a
    BatchNorm in training mode that normalised over fewer than 32 values per channel in the
    last batch, and, with an ``optimizer``, the largest update-to-weight ratio
    $\mathrm{lr}\cdot\|g\|/\|w\|$.

    **Cost.** One fused norm over the gradients (per-tensor norms; again in float64 only when
    one overflowed) and one read of those norms and the loss from the device per `check`, and
    one forward hook per BatchNorm that records the input's shape.

    **Limits.** A loss whose healthy scale is far below ``loss_floor`` (say ``1e-6``) is judged
    against ``loss_floor``: lower it for such losses. The gradient norm's growth is relative, so
    a norm that falls near zero and jumps back up can count, and so does a single corrupted batch
    whose loss jumps by more than ``growth`` (raise ``growth`` or use ``'warn'`` if such batches
    are expected). A run that jumps from healthy to ``inf`` in one step is not seen while finite.

    Args:
        model: the ``nn.Module`` being trained.
        window: steps of history (``>= 1``). Default: ``5``.
        growth: the factor (``> 1``) that counts as divergence. Default: ``1e3``.
        mode: ``'raise'`` raises `DivergenceError`; ``'warn'`` issues a `DivergenceWarning`,
            then starts a fresh window. Default: ``'raise'``.
        optimizer: optional, keyword-only; its learning rates give the update-to-weight ratio.
        loss_floor: keyword-only; the smallest scale (``> 0``) a loss's rise is measured
            against. Default: ``1.0``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``optimizer`` is not an optimizer.
        ValueError: ``window < 1``, ``growth <= 1``, ``loss_floor <= 0`` or an unknown ``mode``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from stablelosses.debug import DivergenceMonitor, DivergenceError
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> net = nn.Sequential(nn.BatchNorm2d(1), nn.Conv2d(1, 1, [1, 16]))
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.3)
        >>> monitor = DivergenceMonitor(net, optimizer=opt)
        >>> x, losses = torch.rand(1, 1, 1, 16), []
        >>> try:
        ...     for step in range(10):
        ...         opt.zero_grad()
        ...         loss = (net(x) - 1).square().sum()
        ...         loss.backward()
        ...         losses.append(loss.item())
        ...         _ = monitor.check(loss)
        ...         opt.step()
        ... except DivergenceError as err:
        ...     print(err.step, err.quantity, err.module_type, all(map(math.isfinite, losses)))
        2 loss BatchNorm2d True
    """

    def __init__(
        self,
        model: nn.Module,
        window: int = 5,
        growth: float = 1e3,
        mode: str = "raise",
        *,
        optimizer: torch.optim.Optimizer | None = None,
        loss_floor: float = 1.0,
    ) -> None:
        # the contract's positional order: (model, window, growth, mode); the rest by keyword
        if not isinstance(model, nn.Module):
            raise TypeError(f"DivergenceMonitor: model must be an nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "DivergenceMonitor: optimizer must be a torch.optim.Optimizer or None, got "
                f"{type(optimizer).__name__}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"DivergenceMonitor: window must be an int >= 1, got {window!r}")
        if isinstance(growth, bool) or not isinstance(growth, (int, float)) or not growth > 1:
            raise ValueError(f"DivergenceMonitor: growth must be a number > 1, got {growth!r}")
        if (isinstance(loss_floor, bool) or not isinstance(loss_floor, (int, float))
                or not 0 < loss_floor < math.inf):
            raise ValueError(f"DivergenceMonitor: loss_floor must be a finite number > 0, got {loss_floor!r}")
        self.loss_floor = float(loss_floor)
        if mode not in ("raise", "warn"):
            raise ValueError(f"DivergenceMonitor: mode must be 'raise' or 'warn', got {mode!r}")
        self.model, self.optimizer = model, optimizer
        self.window, self.growth, self.mode = window, float(growth), mode
        name = _root_name(model)  # walks the caller's frames: once
        self.root = name if name != type(model).__name__ else "model"
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        self._owners = [n.rpartition(".")[0] for n, _ in named]
        self._names = {id(p): n for n, p in named}
        self._bn: dict[str, tuple[str, bool, int]] = {}
        self._hooks = [
            m.register_forward_hook(self._bn_hook(path))
            for path, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
        ]
        self.reset()

    def _bn_hook(self, path: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1]:
                values = x.numel() // x.shape[1]  # shapes only: no host sync
                self._bn[path] = (type(module).__name__, module.training, values)

        return hook

    def reset(self) -> None:
        """Forget the history (after lowering the learning rate, or a planned jump in the loss)."""
        self.steps = 0
        self._values: dict[str, deque[float]] = {q: deque(maxlen=self.window + 1) for q in _QUANTITIES}
        self._per_param: deque[list[float]] = deque(maxlen=self.window + 1)

    def close(self) -> None:
        """Remove the BatchNorm hooks this monitor put on the model."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def check(self, loss: torch.Tensor) -> bool:
        """Record this step's loss and gradient norm; fire if the run diverges.

        Args:
            loss: the scalar loss of the step (after ``backward()``).

        Returns:
            Whether it fired (only ever ``True`` in ``'warn'`` mode).

        Raises:
            DivergenceError: in ``'raise'`` mode, when the run diverges.
            ValueError: ``loss`` is not a one-element tensor.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"DivergenceMonitor.check: loss must be a one-element tensor, got {shape}")
        grads = [p.grad for p in self._params]
        *per, value_loss = _norms_and_loss(grads, loss)
        if math.isfinite(value_loss) and not all(map(math.isfinite, per)):
            *per, value_loss = _norms_and_loss(grads, loss, wide=True)  # float32 ‖g‖ overflowed?
        value_norm = math.sqrt(math.fsum(v * v for v in per))
        step, self.steps = self.steps, self.steps + 1
        values = {"loss": value_loss, "gradient norm": value_norm}
        if not all(math.isfinite(v) for v in values.values()):
            return False  # non-finite: not this monitor's job
        self._per_param.append(per)
        fired = None
        for q in _QUANTITIES:
            v = values[q]
            window = [*self._values[q]][-self.window:]
            if q == "loss":
                ref = min(window, default=None)
                scale = max(abs(ref), self.loss_floor) if ref is not None else 0.0
            else:
                ref = min((x for x in window if x > 0), default=None)
                scale = ref if ref is not None else 0.0
            if fired is None and ref is not None and self._grew(q, v, ref, scale):
                fired = (q, v, (ref, len(window) - window.index(ref), scale))
            self._values[q].append(v)
        if fired is None:
            return False
        self._fire(step, *fired)
        return True

    def _grew(self, quantity: str, value: float, ref: float, scale: float) -> bool:
        """Whether ``value`` grew by more than ``growth`` from ``ref`` (the loss: its rise vs ``scale``)."""
        if quantity == "loss":
            return value - ref > self.growth * scale
        return value > self.growth * ref

    def _fire(self, step: int, quantity: str, value: float, against: tuple[float, int, float]) -> None:
        ref, span, scale = against  # the window's reference, steps since it, the scale judged by
        growth = (value - ref) / scale if quantity == "loss" else value / ref
        info: dict[str, Any] = dict(
            step=step, quantity=quantity, growth=growth, value=value, ref=ref, span=span,
            losses=list(self._values["loss"]), norms=list(self._values["gradient norm"]),
        )
        top = fastest_module(list(self._per_param), self._owners, self.model)
        if top is not None:
            path, cls, first, last, grown = top
            info.update(module_path=f"{self.root}.{path}" if path else self.root, module_type=cls,
                        module_ref=first, module_last=last, module_growth=grown)
        precursors = batchnorm_precursors(self._bn, self.root)
        if self.optimizer is not None:
            ratio = update_ratio(self.optimizer, self._names, self.root)
            if ratio:
                precursors.append(ratio)
        info["precursors"] = precursors
        err = DivergenceError(format_divergence(info), **info)
        if self.mode == "raise":
            raise err
        warnings.warn(str(err), DivergenceWarning, stacklevel=3)
        self.reset_window()

    def reset_window(self) -> None:
        """Start a fresh window but keep counting steps (what ``'warn'`` mode does after firing)."""
        steps = self.steps
        self.reset()
        self.steps = steps

    def state_dict(self) -> dict[str, Any]:
        """Settings, step count and the window's history (plain Python values)."""
        return {
            "window": self.window, "growth": self.growth, "mode": self.mode, "steps": self.steps,
            "loss_floor": self.loss_floor,
            "values": {q: list(v) for q, v in self._values.items()},
            "per_param": [list(v) for v in self._per_param],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved (the model and optimizer are not part of it)."""
        self.window, self.growth, self.mode = int(state["window"]), float(state["growth"]), state["mode"]
        self.loss_floor = float(state.get("loss_floor", self.loss_floor))
        self.reset()
        self.steps = int(state["steps"])
        for q in _QUANTITIES:  # an older state's "pending" entry is not needed: a step fires at once
            self._values[q].extend(float(v) for v in state["values"][q])
        self._per_param.extend([float(x) for x in v] for v in state["per_param"])

    def __repr__(self) -> str:
        return (f"DivergenceMonitor({type(self.model).__name__}, window={self.window}, "
                f"growth={self.growth:g}, mode={self.mode!r}, steps={self.steps})")
