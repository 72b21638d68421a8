"""``stablelosses trace SCRIPT.py``: run a script under `detect_nonfinite` (and, with ``--watch``,
a `DivergenceMonitor` on every ``loss.backward()``).

Exit status: 0 when the script ran clean, 1 when a NaN/Inf was created (or, with ``--watch``,
the run diverged), the script's own ``sys.exit`` code otherwise, and 2 when it died of an
uncaught exception before any NaN/Inf was created (its traceback, from the script's own frames
on, goes to stderr, and the report says that no NaN/Inf was seen before the crash; a
`SkippedStepsError` from `FiniteGuard` is such a crash, not a pass).

Threads: the main thread and every thread the script starts with ``threading`` (thread pools
included) are watched, each under its own detector; a report names the thread it came from.
Operators run by other processes (``DataLoader`` workers) or by threads started outside Python
are not seen, and the closing line says what was watched.

``--watch`` limits: the model is the first ``nn.Module`` called at the top level (not from
inside another module) whose parameters the first watched backward reaches; a script that
trains two models at once is watched for that one only. The optimizer is the first one whose
``step()`` updates that model's parameters (from its first step on). Only ``Tensor.backward``
is watched, not ``torch.autograd.backward`` or ``torch.autograd.grad``.
"""

from __future__ import annotations

import math
import os
import runpy
import sys
import threading
import traceback
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from stablelosses.debug._causes import DIVERGENCE_HINT
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
        with self.detector.suspended():  # the monitor's norms are not the script's operators
            if self.monitor is None:
                model = self._find_model(loss) if loss.grad_fn is not None else None
                if model is None:
                    return
                self.monitor = DivergenceMonitor(model)
                self._roots = []
            self.monitor.check(loss)


class _ThreadDetector(detect_nonfinite):
    """A worker thread's detector: keeps every report and neither raises nor warns, so the
    script's threads run on as without the trace; the reports are printed at the end."""

    def _emit(self, err: NonFiniteError) -> None:
        self.reports.append(err)


class _Threads:
    """Runs every thread the script starts (``Thread.start``) under its own `_ThreadDetector`."""

    def __init__(self, opts: dict[str, Any]) -> None:
        self.opts = opts
        self.started: list[str] = []
        self.reports: list[tuple[str, NonFiniteError]] = []  # (thread name, report)
        self._lock = threading.Lock()
        self._start: Any = None

    def __enter__(self) -> _Threads:
        self._start = threading.Thread.start
        watch = self

        def start(thread: threading.Thread) -> None:
            inner = thread.run  # bound here: a subclass's own run() is watched too

            def run() -> None:
                det = _ThreadDetector(**watch.opts)
                try:
                    with det:
                        inner()
                finally:
                    with watch._lock:
                        watch.reports.extend((thread.name, r) for r in det.reports)

            thread.run = run  # type: ignore[method-assign]
            with watch._lock:
                watch.started.append(thread.name)
            watch._start(thread)

        threading.Thread.start = start  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        threading.Thread.start = self._start  # type: ignore[method-assign]


class _Losses:
    """The last few one-element losses ``Tensor.backward()`` was called on, kept on device (no
    host read per step): after a report, whether the run had been growing before it."""

    def __init__(self, detector: detect_nonfinite) -> None:
        self.detector = detector
        self.values: list[torch.Tensor] = []
        self._backward: Any = None

    def __enter__(self) -> _Losses:
        self._backward = torch.Tensor.backward
        rec = self

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            if tensor.numel() == 1 and threading.current_thread() is threading.main_thread():
                with rec.detector.suspended():  # a copy of the loss is not the script's operator
                    rec.values = [*rec.values[-7:], tensor.detach().reshape(()).to(torch.float64, copy=True)]
            rec._backward(tensor, *args, **kwargs)

        torch.Tensor.backward = backward  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.backward = self._backward  # type: ignore[method-assign]

    def grew(self) -> bool:
        """Whether the finite losses before the first non-finite one grew tenfold or more: a
        monitor (``--watch``) had steps in which to see the growth while the loss was finite."""
        finite = []
        for v in self.values:
            try:
                x = float(v)
            except (RuntimeError, NotImplementedError):  # a loss without values (meta, fake)
                return False
            if not math.isfinite(x):
                break
            finite.append(abs(x))
        return len(finite) >= 2 and finite[-1] > 10 * max(min(finite[:-1]), 1e-12)


def _print_crash(exc: BaseException, script: str) -> None:
    """The traceback from the script's first frame on (not the CLI's or runpy's)."""
    target = os.path.abspath(script)
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != target:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def _run(
    script: str, args: list[str], detector: detect_nonfinite, watch: bool, warn: bool,
    threads: _Threads, losses: _Losses,
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
            with detector, threads, losses:
                if watch:
                    with _Watch(detector):
                        runpy.run_path(script, run_name="__main__")
                else:
                    runpy.run_path(script, run_name="__main__")
    except NonFiniteError as e:
        if not any(e is r for r in detector.reports):  # not the detector's: e.g. SkippedStepsError
            crash, status = e, 2
    except DivergenceError as e:
        diverged = e
    except SystemExit as e:
        code = e.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - any other crash of the script: exit 2, never a pass
        crash, status = e, 2
    finally:
        sys.argv = old_argv
        if folder in sys.path:
            sys.path.remove(folder)
    return status, crash, diverged


def _with_hint(report: NonFiniteError, watch: bool, losses: _Losses) -> str:
    """The report's text, its ``--watch`` advice kept only where ``--watch`` can help."""
    text = str(report)
    if DIVERGENCE_HINT not in text:
        return text
    if not watch and losses.grew():
        return text
    why = ("`--watch` was on and did not stop it while the loss was finite" if watch else
           "the loss went from finite to inf within one step, too fast for `--watch` to stop it sooner")
    return text.replace(DIVERGENCE_HINT, "hint: the run is diverging, not this operator; " + why + ": lower "
                        "the learning rate or clip gradients — docs: debugging (Divergence before inf)")


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
    threads = _Threads(opts)
    losses = _Losses(detector)
    status, crash, diverged = _run(script, list(args), detector, watch, warn, threads, losses)
    if crash is not None:
        _print_crash(crash, script)
    reports = detector.reports
    if reports and warn:
        unique = list(detector._warned.values())  # warn mode: the first report of each line
        print(f"{_PROG}: {len(unique)} distinct NaN/Inf creations in {script}:")
        for r in unique:
            print(_with_hint(r, watch, losses), end="\n\n")
    elif reports:
        print(f"{_PROG}: first NaN/Inf created in {script}:")
        print(_with_hint(reports[0], watch, losses))
    shown: set[tuple] = set()
    for name, r in threads.reports:
        key = (name, r.op, r.phase, r.filename, r.lineno)
        if key in shown or (shown and not warn):
            continue  # one per thread and line with --warn; else the first only
        shown.add(key)
        print(f"{_PROG}: NaN/Inf created in thread {name!r} of {script}:")
        print(_with_hint(r, watch, losses), end="\n\n" if warn else "\n")
    if diverged is not None:
        print(f"{_PROG}: the run diverged in {script}:")
        print(str(diverged))
    if reports or threads.reports or diverged is not None:
        return 1
    n = len(threads.started)
    watched = "the main thread" + (f" and the {n} thread{'s' if n != 1 else ''} it started" if n else "")
    if crash is not None:
        print(f"{_PROG}: {script} crashed ({type(crash).__name__}, traceback above); no NaN/Inf was "
              f"created before the crash (watched: {watched})")
        return 2
    print(f"{_PROG}: no NaN/Inf created in {script} (watched: {watched}; not other processes, "
          "such as DataLoader workers)")
    return status
