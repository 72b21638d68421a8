"""``stablelosses trace SCRIPT.py``: run a script under `detect_nonfinite` (and, with ``--watch``,
a `DivergenceMonitor` on every ``loss.backward()``).

Exit status: 0 when the script ran clean, 1 when a NaN/Inf was created (or, with ``--watch``,
the run diverged), the script's own ``sys.exit`` code otherwise, and 1 when it died of an
uncaught exception, as under ``python`` (its traceback, from the script's own frames on, goes to
stderr; a `SkippedStepsError` from `FiniteGuard` is such a crash, not a pass).

``--watch`` limits: the model is the first ``nn.Module`` called at the top level (not from
inside another module) whose parameters the first watched backward reaches; a script that
trains two models at once is watched for that one only. The optimizer is the first one whose
``step()`` updates that model's parameters (from its first step on). Only ``Tensor.backward``
is watched, not ``torch.autograd.backward`` or ``torch.autograd.grad``.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from stablelosses.debug._detector import detect_nonfinite
from stablelosses.debug._divergence import DivergenceMonitor
from stablelosses.debug._errors import DivergenceError, NonFiniteError, NonFiniteWarning

__all__ = ["run_trace"]

_PROG = "stablelosses trace"


def _graph_leaves(root: Any) -> set[int]:
    """ids of the leaf tensors (parameters) a backward from ``root`` reaches."""
    seen, leaves, todo = set(), set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            leaves.add(id(var))
        todo.extend(fn for fn, _ in node.next_functions)
    return leaves


class _Watch:
    """A `DivergenceMonitor` after every ``Tensor.backward()`` of a script that knows nothing of it."""

    def __init__(self, detector: detect_nonfinite) -> None:
        self.detector = detector
        self.monitor: DivergenceMonitor | None = None
        self._roots: list[weakref.ref] = []
        self._depth = 0
        self._handles: list[Any] = []
        self._backward: Any = None

    def __enter__(self) -> _Watch:
        from torch.nn.modules import module as m
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._handles = [
            m.register_module_forward_pre_hook(self._pre),
            m.register_module_forward_hook(self._post, always_call=True),
            register_optimizer_step_pre_hook(self._on_step),
        ]
        self._backward = torch.Tensor.backward
        watch = self

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            watch._backward(tensor, *args, **kwargs)
            watch.after_backward(tensor)

        torch.Tensor.backward = backward  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.backward = self._backward  # type: ignore[method-assign]
        for h in self._handles:
            h.remove()
        if self.monitor is not None:
            self.monitor.close()

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0 and self.monitor is None and all(r() is not module for r in self._roots):
            self._roots.append(weakref.ref(module))
        self._depth += 1

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        mon = self.monitor
        if mon is not None and mon.optimizer is None:
            ids = {id(p) for p in mon.model.parameters()}
            if any(id(p) in ids for g in optimizer.param_groups for p in g["params"]):
                mon.optimizer = optimizer

    def _find_model(self, loss: torch.Tensor) -> nn.Module | None:
        leaves = _graph_leaves(loss.grad_fn)
        best, hits = None, 0
        for ref in self._roots:
            module = ref()
            if module is None:
                continue
            n = sum(id(p) in leaves for p in module.parameters())
            if n > hits:
                best, hits = module, n
        return best

    def after_backward(self, loss: torch.Tensor) -> None:
        if loss.numel() != 1:
            return
        det = self.detector
        det._suspended = True  # the monitor's norms are not the script's operators
        try:
            if self.monitor is None:
                model = self._find_model(loss) if loss.grad_fn is not None else None
                if model is None:
                    return
                self.monitor = DivergenceMonitor(model)
                self._roots = []
            self.monitor.check(loss)
        finally:
            det._suspended = False


def _print_crash(exc: BaseException, script: str) -> None:
    """The traceback from the script's first frame on (not the CLI's or runpy's)."""
    target = os.path.abspath(script)
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != target:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def _run(
    script: str, args: list[str], detector: detect_nonfinite, watch: bool, warn: bool
) -> tuple[Any, ...]:
    """Run the script; (exit status, crash exception or None, divergence error or None)."""
    old_argv, folder = sys.argv, os.path.dirname(os.path.abspath(script))
    sys.argv = [script, *args]
    sys.path.insert(0, folder)
    status, diverged = 0, None
    crash: BaseException | None = None
    try:
        with warnings.catch_warnings():
            if warn:
                warnings.simplefilter("ignore", NonFiniteWarning)
            with detector:
                if watch:
                    with _Watch(detector):
                        runpy.run_path(script, run_name="__main__")
                else:
                    runpy.run_path(script, run_name="__main__")
    except NonFiniteError as e:
        if not any(e is r for r in detector.reports):  # not the detector's: e.g. SkippedStepsError
            crash, status = e, 1
    except DivergenceError as e:
        diverged = e
    except SystemExit as e:
        code = e.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - any crash of the script exits 1, as under python
        crash, status = e, 1
    finally:
        sys.argv = old_argv
        if folder in sys.path:
            sys.path.remove(folder)
    return status, crash, diverged


def run_trace(script: str, args: list[str], *, warn: bool = False, watch: bool = False, **opts: Any) -> int:
    """Run ``script`` with ``args`` as ``python script args`` would; report; return the exit status.

    Args:
        script: path of the script.
        args: its arguments (a leading ``--`` is dropped).
        warn: carry on after the first NaN/Inf and list every distinct one.
        watch: also run a `DivergenceMonitor` after every ``loss.backward()``.
        **opts: ``forward``, ``backward``, ``nan``, ``inf``, ``allow`` of `detect_nonfinite`.
    """
    if not os.path.isfile(script):
        print(f"{_PROG}: error: no such file: {script}", file=sys.stderr)
        return 2
    if args[:1] == ["--"]:
        args = args[1:]
    detector = detect_nonfinite(mode="warn" if warn else "raise", **opts)
    status, crash, diverged = _run(script, list(args), detector, watch, warn)
    if crash is not None:
        _print_crash(crash, script)
    reports = detector.reports
    if reports and warn:
        unique = list(detector._warned.values())  # warn mode: the first report of each line
        print(f"{_PROG}: {len(unique)} distinct NaN/Inf creations in {script}:")
        for r in unique:
            print(str(r), end="\n\n")
    elif reports:
        print(f"{_PROG}: first NaN/Inf created in {script}:")
        print(str(reports[0]))
    if diverged is not None:
        print(f"{_PROG}: the run diverged in {script}:")
        print(str(diverged))
    if reports or diverged is not None:
        return 1
    if crash is None:
        print(f"{_PROG}: no NaN/Inf created in {script}")
    return status
