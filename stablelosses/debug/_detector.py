"""detect_nonfinite: stop at the first operator that turns finite values into NaN or Inf."""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from stablelosses._compat import TorchDispatchMode, current_autograd_node
from stablelosses.debug import _boundary
from stablelosses.debug._checks import _all_finite, _info, _normalize_op, _snapshot
from stablelosses.debug._errors import NonFiniteError, NonFiniteWarning
from stablelosses.debug._frames import _child_name, _root_name, _user_frame
from stablelosses.debug._report import _SELECTORS, FWD_KEY, diagnose

# --------------------------------------------------------------------------------------------
# compiled code while a detector is open

# Dynamo skips every frame while a TorchDispatchMode is active, and a fullgraph=True function
# that compiled nothing raises ("found no compiled frames"). So while any detector is open,
# compiled code runs eagerly by the public stance "force_eager" (its operators are checked);
# the stance is process-wide, so the first detector to open sets it and the last to close
# restores what it found. (Setting it imports torch._dynamo, which the dispatch mode's first
# operator imports anyway: torch wraps __torch_dispatch__ in torch._disable_dynamo.)
_stance_lock = threading.Lock()
_stance: list = [0, None]  # [open detectors, the set_stance object to undo, or None]


def _compile_eagerly(opening: bool) -> None:
    with _stance_lock:
        count, undo = _stance
        if opening:
            if count == 0:
                try:
                    undo = torch.compiler.set_stance("force_eager")
                except RuntimeError:  # opened inside a torch.compile region: leave it be
                    undo = None
            _stance[:] = [count + 1, undo]
        else:
            count = max(0, count - 1)
            if count == 0 and undo is not None:
                with contextlib.suppress(RuntimeError):  # closed inside a torch.compile region
                    undo.__exit__(None, None, None)
                undo = None
            _stance[:] = [count, undo]


# --------------------------------------------------------------------------------------------
# detect_nonfinite


@dataclass(frozen=True)
class _ForwardRecord:
    op: str
    module_path: str | None
    filename: str | None
    lineno: int | None
    trusted: bool
    # the records of the forward operators that read this one's output (filled as they run);
    # records only, no autograd nodes, so the graph holds no cycle through them
    consumers: list = field(default_factory=list, compare=False, hash=False, repr=False)


class _Mode(TorchDispatchMode):
    def __init__(self, owner: detect_nonfinite) -> None:
        super().__init__()
        self.owner = owner
        self.pending: list = []  # [(outputs, record, age)] awaiting their grad_fn

    def _flush(self) -> None:
        keep = []
        for outs, rec, age, ins in self.pending:
            node = None
            for o in outs:
                node = o.grad_fn
                if node is not None:
                    break
            if node is not None:
                md = node.metadata
                if FWD_KEY not in md:
                    md[FWD_KEY] = rec
                    for i in ins:  # tell the producers of the inputs who read them
                        src = i.metadata.get(FWD_KEY)
                        if src is not None and len(src.consumers) < 64:
                            src.consumers.append(rec)
            elif age < 3:
                keep.append((outs, rec, age + 1, ins))
        self.pending = keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        owner = self.owner
        if self.pending:
            self._flush()
        skip, writes, _ = _info(func)
        before = None
        if writes and not skip:
            # an in-place operator overwrites its input: keep its values from before (a copy, no
            # host sync) for the report, which judges and names the operator by its inputs; an
            # out= tensor (a keyword) may be one of them: exp(x, out=x)
            params = func._schema.arguments
            before = _snapshot([args[i] if i < len(args) else kwargs.get(params[i].name) for i in writes])
        out = func(*args, **kwargs)
        if owner._suspended:
            return out
        if skip:
            # never reported, but a where/min/masked_fill is what drops a value whose backward
            # later makes the NaN: record it so the report can name it
            if owner.backward and torch.is_grad_enabled() and current_autograd_node() is None:
                # views and copies only link the chain: no frame lookup for them
                self._record(func, args, out, where=func._schema.name in _SELECTORS)
            return out
        node = current_autograd_node()
        in_backward = node is not None
        if in_backward:
            if not owner.backward:
                return out
        else:
            if owner.backward and torch.is_grad_enabled():
                self._record(func, args, out)
            if not owner.forward:
                return out
        checked = out
        if type(out) is torch.Tensor:
            ok = _all_finite(out)
        elif isinstance(out, (tuple, list)):
            ok = all(_all_finite(o) for o in out)
        elif out is None and writes:  # in place and returns nothing (_foreach_add_ ...)
            checked = [args[i] for i in writes if i < len(args)]
            ok = _all_finite(checked)
        else:
            ok = True
        if not ok:
            owner._found(func, args, kwargs, checked, node, before)
        return out

    def _record(self, func, args, out, where: bool = True) -> None:
        needs = False
        for a in args:
            if type(a) is torch.Tensor and a.requires_grad:
                needs = True
                break
            if isinstance(a, (list, tuple)) and any(
                isinstance(x, torch.Tensor) and x.requires_grad for x in a
            ):
                needs = True
                break
        if not needs:
            return
        outs = [out] if isinstance(out, torch.Tensor) else [
            o for o in (out if isinstance(out, (tuple, list)) else ()) if isinstance(o, torch.Tensor)
        ]
        if not outs:
            return
        frame, trusted = _user_frame(sys._getframe(2)) if where else (None, True)
        if frame is not None:
            filename, lineno = frame.f_code.co_filename, frame.f_lineno
        else:
            filename = lineno = None
        owner = self.owner
        rec = _ForwardRecord(func._schema.name, owner._module_path(), filename, lineno, trusted)
        ins = []
        for a in args:
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    ins.append(t.grad_fn)
        self.pending.append((outs, rec, 0, ins))


class detect_nonfinite:
    r"""Stop at the first operator that turns finite values into NaN or Inf.

    Inside the context every ATen operator is watched, in the forward and (when it runs inside
    the context) in the backward. The first one whose output holds an Inf while no input held
    NaN/Inf (an **overflow**: ``exp(92.)`` in float32, ``x**2`` in float16, ``1/0``), or whose
    output holds a NaN while no input held a NaN (``0/0``, ``inf - inf``, ``0 * inf``, a
    fully masked ``softmax``), raises `NonFiniteError`. Values that merely flow on are not
    reported: once a NaN exists, later operators are not blamed for it.

    The error names the operator (``aten::exp``), the phase (``forward`` or ``backward`` — in
    the backward with the autograd node, ``SqrtBackward0``, and its forward operator), the
    module path (``net.0``, ``model.layer1.0.conv``), the source line (the first frame outside
    torch and stablelosses; in the backward, the forward line that created the node), the
    dtype, shape, min and max of every input, and the kind (``'overflow'`` or ``'nan'``).

    **What is not reported.** Operators that only copy, select or fill values (``masked_fill``,
    ``where``, ``fill_``, ``full``, ``cat``, ``index``, ``gather``, view operators, ``clone``,
    ``max``/``min`` …) never count, so ``scores.masked_fill(~mask, float('-inf'))`` and additive
    ``-inf`` attention masks stay silent, as long as no row is masked entirely (that ``softmax``
    divides 0 by 0 and is reported). ``allow`` adds operator names to ignore.

    **stablelosses' own functions** are checked at their public boundary, as one operator each:
    a NaN/Inf one returns from inputs without one is reported under its public name
    (``stablelosses.safe_sqrt``, ``stablelosses.functional.cross_entropy``), while what it
    computes inside on the way to a finite result (a ``log 0`` selected away by a ``where``) and
    the ``-inf`` outputs the design contract (``docs/design.md``) defines (``log_softmax`` on
    masked entries, ``logsumexp`` of an all ``-inf`` slice, ``xlogy(x, 0)``) stay silent. Their
    backward is one operator too: a gradient one sends to an input that is not finite, from
    finite inputs and incoming gradients, is reported under its public name in the backward.

    **What the message says.** ``err.cause`` is one of ``'division by zero'``, ``'0/0'``,
    ``'log of zero'``, ``'overflow'`` and ``'invalid'``; for a catalogued hazard ``err.hint``
    (also the message's last line) names the stablelosses replacement and the docs page.

    **Cost.** One reduction per floating output (a sum: a finite sum proves every element
    finite; ``isfinite().all()`` runs only when it is not) and one read of the result; inputs
    are examined only when an output is not finite; an in-place operator first copies the tensor
    it overwrites (no host read), so that a report judges it by the values it read. The Python
    dispatch costs some microseconds per operator, so steps of many small operators slow down
    most: a training step of a 3-layer MLP (batch 256, width 256, one CPU thread) takes about
    1.6–1.9× the plain step, against 2.0–2.2× for
    ``torch.autograd.detect_anomaly`` (``benchmarks/test_bench_debug.py``), which moreover
    misses NaN in the forward and Inf gradients.

    **Limits.** Only operators that run inside the context on this thread are seen (and the
    backward, whose operators run inside the context when ``.backward()`` is called in it).
    ``torch.compile``: TorchDispatch modes are not traced into compiled graphs, so while a
    context is open compiled code runs eagerly (``torch.compiler.set_stance("force_eager")``,
    set by the first context to open and restored by the last to close; in every thread), and
    its operators are checked; ``fullgraph=True`` does not raise for it.
    ``torch.func`` transforms (``vmap``, ``grad``, ``jvp``, ``jacrev``, ``hessian``) and
    ``torch.autograd.forward_ad`` run as without the context; a stablelosses function's result is
    read through the transform's wrappers (the whole batch, the primal). Results on fake tensors
    are not checked (they hold no values); a `UserWarning` says so once per context.
    Custom C++/CUDA kernels are seen as one operator; operators that write only to outputs
    given through ``out=`` are checked like any other. Distributed collectives are checked as
    operators.

    Args:
        forward: check operators of the forward (everything outside ``backward()``).
        backward: check operators of the backward; also records, per autograd node, the forward
            line and module that created it.
        nan: report NaN created from inputs without NaN.
        inf: report ±Inf created from finite inputs.
        mode: ``'raise'`` raises `NonFiniteError` at the first one; ``'warn'`` issues a
            `NonFiniteWarning` per distinct (operator, line) and carries on.
        allow: operator names never reported, with or without the ``aten::`` prefix and
            overload (``'exp'``, ``'aten::pow'``, ``'aten::div.Tensor'``).

    Attributes:
        reports: every `NonFiniteError` found, in order (also in ``'raise'`` mode, so a
            report survives code that catches the exception).

    Raises:
        NonFiniteError: in ``'raise'`` mode, at the first non-finite value created.
        ValueError: for a ``mode`` other than ``'raise'`` or ``'warn'``.

    Example:
        >>> import torch
        >>> from stablelosses.debug import detect_nonfinite, NonFiniteError
        >>> x = torch.tensor([[1.0, 100.0]], requires_grad=True)
        >>> try:
        ...     with detect_nonfinite():
        ...         torch.exp(x * 10).sum().backward()
        ... except NonFiniteError as err:
        ...     print(err.op, err.phase, err.kind, err.inputs[0].max)
        aten::exp forward overflow 1000.0
        >>> with detect_nonfinite():  # a masked -inf is not an error
        ...     s = torch.zeros(2, 2).masked_fill(torch.eye(2, dtype=torch.bool), float("-inf"))
        ...     p = torch.softmax(s, -1)
    """

    def __init__(
        self,
        *,
        forward: bool = True,
        backward: bool = True,
        nan: bool = True,
        inf: bool = True,
        mode: str = "raise",
        allow: Iterable[str] = (),
    ) -> None:
        if mode not in ("raise", "warn"):
            raise ValueError(f"detect_nonfinite: mode must be 'raise' or 'warn', got {mode!r}")
        if isinstance(allow, str):
            allow = (allow,)
        self.forward = bool(forward)
        self.backward = bool(backward)
        self.nan = bool(nan)
        self.inf = bool(inf)
        self.mode = mode
        self.allow = frozenset(_normalize_op(a) for a in allow)
        self.reports: list = []
        self._warned: dict[tuple, NonFiniteError] = {}  # (op, phase, file, line) → its first report
        self._suspended = False
        self._mode: _Mode | None = None
        self._hooks: list = []
        self._stack: list = []
        self._stack_modules: list = []
        self._names: dict = {}
        self._thread: int | None = None

    # -- module paths --------------------------------------------------------------------
    def _module_path(self) -> str | None:
        if self._stack and threading.get_ident() == self._thread:
            return self._stack[-1]
        return None

    def _pre_hook(self, module, args):
        if threading.get_ident() != self._thread:
            return
        name = self._names.get(module)
        if name is None:
            if self._stack:
                parent = self._stack[-1]
                child = _child_name(self._stack_modules[-1], module)
                name = f"{parent}.{child}"
            else:
                name = _root_name(module)
                for sub, m in module.named_modules():
                    self._names.setdefault(m, f"{name}.{sub}" if sub else name)
                self._names[module] = name
        self._stack.append(name)
        self._stack_modules.append(module)

    def _post_hook(self, module, args, output):
        if threading.get_ident() != self._thread:
            return
        if self._stack_modules and self._stack_modules[-1] is module:
            self._stack.pop()
            self._stack_modules.pop()

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> detect_nonfinite:
        if self._mode is not None:
            raise RuntimeError("detect_nonfinite: this context is already active")
        from torch.nn.modules import module as _m

        self._thread = threading.get_ident()
        self._stack, self._stack_modules, self._names = [], [], {}
        self._hooks = [
            _m.register_module_forward_pre_hook(self._pre_hook),
            _m.register_module_forward_hook(self._post_hook, always_call=True),
        ]
        self._mode = _Mode(self)
        self._mode.__enter__()
        _boundary.install(self)
        _compile_eagerly(True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                _compile_eagerly(False)
                _boundary.uninstall(self)
                mode.pending.clear()
                mode.__exit__(exc_type, exc, tb)
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._stack, self._stack_modules, self._names = [], [], {}

    def __call__(self, fn):
        """Use as a decorator: the function runs inside a fresh context with these options."""
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with detect_nonfinite(forward=self.forward, backward=self.backward, nan=self.nan,
                                  inf=self.inf, mode=self.mode, allow=self.allow):
                return fn(*args, **kwargs)

        return wrapper

    # -- reporting -------------------------------------------------------------------------
    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The detector's own torch operators (summaries, checks, norms) inside: not watched."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    def _found(self, func, args, kwargs, out, node, before) -> None:
        with self.suspended():  # summaries below run torch ops
            err = diagnose(self, func, args, kwargs, out, node, before, sys._getframe())
        if err is not None:
            self._emit(err)

    def _emit(self, err: NonFiniteError) -> None:
        """Keep the report; raise it, or warn once per (operator, phase, line)."""
        self.reports.append(err)
        if self.mode == "raise":
            raise err
        key = (err.op, err.phase, err.filename, err.lineno)
        if key not in self._warned:
            self._warned[key] = err
            warnings.warn_explicit(
                str(err), NonFiniteWarning, err.filename or "<unknown>", err.lineno or 0
            )
