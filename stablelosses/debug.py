r"""Find the first NaN/Inf in a training step, and skip optimizer steps on non-finite gradients.

Two tools:

- [`detect_nonfinite`][stablelosses.debug.detect_nonfinite]: a context manager that watches every
  ATen operator, in the forward and in the backward, and stops at the **first** one that turns
  finite values into NaN or Inf. The error names the operator, the phase, the module path, the
  user source line and the input ranges.
- [`FiniteGuard`][stablelosses.debug.FiniteGuard]: wraps an optimizer; `guard.step()` steps
  only when every gradient is finite, otherwise drops the gradients and counts the skip.
"""

from __future__ import annotations

import linecache
import math
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "NonFiniteError",
    "NonFiniteWarning",
    "SkippedStepsError",
    "TensorSummary",
    "detect_nonfinite",
    "FiniteGuard",
]

# --------------------------------------------------------------------------------------------
# errors


@dataclass(frozen=True)
class TensorSummary:
    """What a report says about one tensor: dtype, shape, range and non-finite counts."""

    dtype: torch.dtype
    shape: tuple
    min: Optional[float]
    max: Optional[float]
    nan: int
    posinf: int
    neginf: int

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.posinf == 0 and self.neginf == 0

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSummary":
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


class NonFiniteError(RuntimeError):
    r"""A NaN or Inf was created (raised by `detect_nonfinite` and `FiniteGuard`).

    Attributes:
        op: the ATen operator that produced it, e.g. ``'aten::exp'`` (None for `FiniteGuard`).
        phase: ``'forward'`` or ``'backward'``.
        kind: ``'overflow'`` (finite inputs, an ±inf output) or ``'nan'`` (a NaN output from
            inputs without NaN).
        module_path: dotted path of the innermost ``nn.Module`` running, e.g. ``'net.0'``, or None.
        location: ``'file.py:LINE'`` of the first frame outside torch and stablelosses; for a
            backward operator, the forward line that created its autograd node.
        filename, lineno, source: the parts of ``location`` and the source line's text.
        node: in the backward, the autograd node name (``'SqrtBackward0'``), else None.
        forward_op: in the backward, the forward operator the node belongs to, when known.
        inputs: a list of `TensorSummary`, one per tensor input (dtype, shape, min, max).
        outputs: a list of `TensorSummary`, one per floating output.
    """

    def __init__(self, message: str = "", **info: Any) -> None:
        super().__init__(message)
        self.op: Optional[str] = info.get("op")
        self.phase: Optional[str] = info.get("phase")
        self.kind: Optional[str] = info.get("kind")
        self.module_path: Optional[str] = info.get("module_path")
        self.filename: Optional[str] = info.get("filename")
        self.lineno: Optional[int] = info.get("lineno")
        self.source: Optional[str] = info.get("source")
        self.node: Optional[str] = info.get("node")
        self.forward_op: Optional[str] = info.get("forward_op")
        self.inputs: list = list(info.get("inputs", ()))
        self.outputs: list = list(info.get("outputs", ()))

    @property
    def location(self) -> Optional[str]:
        if self.filename is None:
            return None
        return f"{self.filename}:{self.lineno}"

    def __reduce__(self):  # keep the attributes across pickling (multiprocessing)
        info = {k: v for k, v in self.__dict__.items()}
        return (_rebuild_error, (type(self), str(self), info))


def _rebuild_error(cls, message, info):
    err = cls.__new__(cls)
    RuntimeError.__init__(err, message)
    err.__dict__.update(info)
    return err


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


# --------------------------------------------------------------------------------------------
# where code lives: frames inside torch are skipped; stablelosses' own ops are trusted

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Files of this package that count as user code (the naive formulas, the demo, the CLI's runpy).
_PKG_USER_FILES = {os.path.join(_PKG_DIR, f) for f in ("_demo.py", "naive.py", "cli.py", "__main__.py")}
_DEBUG_FILE = os.path.abspath(__file__)

_SKIP, _USER, _TRUSTED = 0, 1, 2
_code_kind: dict = {}


def _kind_of(code) -> int:
    kind = _code_kind.get(code)
    if kind is None:
        fn = code.co_filename
        absfn = os.path.abspath(fn) if not fn.startswith("<") else fn
        if absfn == _DEBUG_FILE or absfn.startswith(_TORCH_DIR) or fn.startswith("<frozen"):
            kind = _SKIP
        elif absfn.startswith(_PKG_DIR) and absfn not in _PKG_USER_FILES:
            kind = _TRUSTED
        elif "/torch/" in fn and ("/_dynamo/" in fn or "/_inductor/" in fn):
            kind = _SKIP
        else:
            kind = _USER
        _code_kind[code] = kind
    return kind


def _user_frame(frame):
    """(first user frame, whether a stablelosses frame was passed to reach it)."""
    trusted = False
    while frame is not None:
        kind = _kind_of(frame.f_code)
        if kind == _USER:
            return frame, trusted
        if kind == _TRUSTED:
            trusted = True
        frame = frame.f_back
    return None, trusted


def _nearest_is_trusted(frame) -> bool:
    """Whether the innermost frame outside torch belongs to stablelosses' own ops."""
    while frame is not None:
        kind = _kind_of(frame.f_code)
        if kind != _SKIP:
            return kind == _TRUSTED
        frame = frame.f_back
    return False


# --------------------------------------------------------------------------------------------
# operators that only move, select or fill values: their non-finite outputs never come
# from arithmetic (a -inf here comes from a -inf scalar or input), so they are not checked.

_NOT_ARITHMETIC = frozenset(
    "aten::" + name
    for name in """
    masked_fill masked_fill_ fill fill_ full full_like new_full scalar_tensor where
    empty empty_like empty_strided new_empty new_empty_strided empty_permuted
    zeros zeros_like ones ones_like new_zeros new_ones zero_
    index_fill index_fill_ masked_scatter masked_scatter_
    gather index index_select masked_select take take_along_dim
    cat stack hstack vstack clone contiguous lift_fresh lift_fresh_copy detach alias
    constant_pad_nd pad reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d
    slice_scatter select_scatter diagonal_scatter as_strided_scatter
    tril triu tril_ triu_ flip roll repeat repeat_interleave diag diag_embed
    sort topk max min amax amin kthvalue median maximum minimum fmax fmin clamp clamp_
    _local_scalar_dense set_ resize_ unfold split_with_sizes_copy unbind_copy
    """.split()
)

_SKIP_FUNC, _CHECK = 0, 1
_func_info: dict = {}


def _info(func):
    """Per-operator: (skip?, indices of arguments it writes to)."""
    info = _func_info.get(id(func))  # OpOverload hashes in Python; id() does not
    if info is None:
        schema = func._schema
        name = schema.name
        skip = name in _NOT_ARITHMETIC or getattr(func, "is_view", False)
        writes = tuple(
            i
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        info = (skip, writes, func)  # holding func keeps its id valid
        _func_info[id(func)] = info
    return info


def _all_finite(t) -> bool:
    """Exact and cheap: a finite sum means every element is finite; otherwise look closer."""
    if not isinstance(t, torch.Tensor):
        if isinstance(t, (list, tuple)):  # the _foreach_ operators
            return all(_all_finite(x) for x in t)
        return True
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    if t.layout is not torch.strided or t.device.type == "meta":
        return True
    if t.is_complex():
        t = torch.view_as_real(t)
    s = t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()
    if math.isfinite(s.item()):
        return True
    return bool(torch.isfinite(t).all())


def _has_nan(t) -> bool:
    if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
        return False
    if t.layout is not torch.strided or t.numel() == 0:
        return False
    return bool(torch.isnan(t).any())


# --------------------------------------------------------------------------------------------
# detect_nonfinite

_FWD_KEY = "stablelosses.debug.forward"


@dataclass(frozen=True)
class _ForwardRecord:
    op: str
    module_path: Optional[str]
    filename: Optional[str]
    lineno: Optional[int]
    trusted: bool


class _Mode(TorchDispatchMode):
    def __init__(self, owner: "detect_nonfinite") -> None:
        super().__init__()
        self.owner = owner
        self.pending: list = []  # [(outputs, record, age)] awaiting their grad_fn

    def _flush(self) -> None:
        keep = []
        for outs, rec, age in self.pending:
            node = None
            for o in outs:
                node = o.grad_fn
                if node is not None:
                    break
            if node is not None:
                md = node.metadata
                if _FWD_KEY not in md:
                    md[_FWD_KEY] = rec
            elif age < 3:
                keep.append((outs, rec, age + 1))
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
            # an in-place operator overwrites its input: look at it before
            before = [_all_finite(args[i]) if i < len(args) else True for i in writes]
        out = func(*args, **kwargs)
        if skip or owner._suspended:
            return out
        node = torch._C._current_autograd_node()
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
            owner._found(func, args, kwargs, checked, node, writes, before)
        return out

    def _record(self, func, args, out) -> None:
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
        frame, trusted = _user_frame(sys._getframe(2))
        if frame is not None:
            filename, lineno = frame.f_code.co_filename, frame.f_lineno
        else:
            filename = lineno = None
        owner = self.owner
        rec = _ForwardRecord(func._schema.name, owner._module_path(), filename, lineno, trusted)
        self.pending.append((outs, rec, 0))


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
    divides 0 by 0 and is reported). The internals of stablelosses' own functions are trusted
    (their deliberate ``-inf`` outputs for masked entries, e.g. ``log 0`` selected away by a
    ``where``, are not reported). ``allow`` adds operator names to ignore.

    **Cost.** One reduction per floating output (a sum: a finite sum proves every element
    finite; ``isfinite().all()`` runs only when it is not) and one read of the result; inputs
    are examined only when an output is not finite; in-place operators also check the tensor
    they overwrite, before. The Python dispatch costs some microseconds per operator, so steps
    of many small operators slow down most: a training step of a 3-layer MLP (batch 256,
    width 256, one CPU thread) takes about 1.6–1.9× the plain step, against 2.0–2.2× for
    ``torch.autograd.detect_anomaly`` (``benchmarks/test_bench_debug.py``), which moreover
    misses NaN in the forward and Inf gradients.

    **Limits.** Only operators that run inside the context on this thread are seen (and the
    backward, whose operators run inside the context when ``.backward()`` is called in it).
    ``torch.compile``: TorchDispatch modes are not traced into compiled graphs, so code compiled
    and called inside the context may run eagerly (Dynamo skips frames while such a mode is
    active) or as one opaque compiled call whose inner operators are not checked; check a
    non-finite result of compiled code by running the same code eagerly under this context.
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
        self._warned: set = set()
        self._suspended = False
        self._mode: Optional[_Mode] = None
        self._hooks: list = []
        self._stack: list = []
        self._stack_modules: list = []
        self._names: dict = {}
        self._thread = None

    # -- module paths --------------------------------------------------------------------
    def _module_path(self) -> Optional[str]:
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
    def __enter__(self) -> "detect_nonfinite":
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
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
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

        opts = dict(forward=self.forward, backward=self.backward, nan=self.nan, inf=self.inf,
                    mode=self.mode, allow=self.allow)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with detect_nonfinite(**opts):
                return fn(*args, **kwargs)

        return wrapper

    # -- reporting -------------------------------------------------------------------------
    def _found(self, func, args, kwargs, out, node, writes, before) -> None:
        self._suspended = True  # summaries below run torch ops
        try:
            err = self._diagnose(func, args, kwargs, out, node, writes, before)
        finally:
            self._suspended = False
        if err is None:
            return
        self.reports.append(err)
        if self.mode == "raise":
            raise err
        key = (err.op, err.phase, err.filename, err.lineno)
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn_explicit(
                str(err), NonFiniteWarning, err.filename or "<unknown>", err.lineno or 0
            )

    def _diagnose(self, func, args, kwargs, out, node, writes, before):
        name = func._schema.name
        overload = func._schema.overload_name or "default"
        if name in self.allow or f"{name}.{overload}" in self.allow:
            return None
        flat_args, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat_args if isinstance(a, torch.Tensor)]
        if not tensors and node is None:
            return None  # a factory: its value comes from its arguments
        # inputs: those written in place are judged from before the call
        written = {id(t) for t in tree_flatten([args[i] for i in writes if i < len(args)])[0]}
        in_finite, in_nan = True, False
        for t in tensors:
            if id(t) in written:
                continue
            if not _all_finite(t):
                in_finite = False
                in_nan = in_nan or _has_nan(t)
        if before is not None and not all(before):
            in_finite = False
            in_nan = True  # unknown which: be conservative, only a clean input is blamed
        for a in flat_args:
            if isinstance(a, (float, complex)) and not _finite_number(a):
                in_finite = False
                in_nan = in_nan or a != a
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        out_nan = any(_has_nan(o) for o in outs)
        if out_nan and not in_nan and self.nan:
            kind = "nan"
        elif in_finite and not out_nan and self.inf:
            kind = "overflow"
        elif in_finite and out_nan and not self.nan and self.inf and any(
            _has_inf(o) for o in outs
        ):
            kind = "overflow"
        else:
            return None
        phase = "backward" if node is not None else "forward"
        frame = sys._getframe(1)
        rec = None
        node_name = forward_op = None
        if node is not None:
            node_name = node.name()
            rec = node.metadata.get(_FWD_KEY)
            if rec is not None:
                forward_op = rec.op
                if rec.trusted:
                    return None
            if _nearest_is_trusted(frame):
                return None  # a stablelosses Function's own backward
            if rec is not None:
                module_path, filename, lineno = rec.module_path, rec.filename, rec.lineno
            else:
                module_path = filename = lineno = None
                # the backward ran without a forward record: name the frame that ran it
                uf, _ = _user_frame(frame)
                if uf is not None:
                    filename, lineno = uf.f_code.co_filename, uf.f_lineno
        else:
            if _nearest_is_trusted(frame):
                return None
            module_path = self._module_path()
            uf, _ = _user_frame(frame)
            filename, lineno = (uf.f_code.co_filename, uf.f_lineno) if uf is not None else (None, None)
        source = linecache.getline(filename, lineno).strip() if filename else None
        inputs = [TensorSummary.of(t) for t in tensors]
        outputs = [TensorSummary.of(o) for o in outs if o.is_floating_point() or o.is_complex()]
        info = dict(op=name, phase=phase, kind=kind, module_path=module_path, filename=filename,
                    lineno=lineno, source=source or None, node=node_name, forward_op=forward_op,
                    inputs=inputs, outputs=outputs)
        return NonFiniteError(_format(info), **info)


def _has_inf(t) -> bool:
    return bool(torch.isinf(t).any()) if t.is_floating_point() and t.numel() else False


def _finite_number(x) -> bool:
    try:
        return math.isfinite(x) if isinstance(x, float) else (math.isfinite(x.real) and math.isfinite(x.imag))
    except (TypeError, ValueError):
        return True


def _normalize_op(name: str) -> str:
    name = str(name)
    if "::" not in name:
        name = "aten::" + name
    return name


def _format(info: dict) -> str:
    what = "NaN" if info["kind"] == "nan" else "Inf (overflow)"
    src = "inputs without NaN" if info["kind"] == "nan" else "finite inputs"
    lines = [f"{info['op']} produced {what} from {src} in the {info['phase']}"]
    if info["phase"] == "backward":
        fwd = f" (forward {info['forward_op']})" if info["forward_op"] else ""
        lines[0] += f" of {info['node']}{fwd}"
    lines.append(f"  module:   {info['module_path'] or '(none)'}")
    where = "forward line" if info["phase"] == "backward" else "location"
    if info["filename"]:
        lines.append(f"  {where}: {info['filename']}:{info['lineno']}")
        if info["source"]:
            lines.append(f"      {info['source']}")
    else:
        lines.append(f"  {where}: (unknown)")
    for i, s in enumerate(info["inputs"]):
        lines.append(f"  input {i}:  {s}")
    for i, s in enumerate(info["outputs"]):
        lines.append(f"  output {i}: {s}")
    return "\n".join(lines)


def _child_name(parent, module) -> str:
    for n, m in parent.named_children():
        if m is module:
            return n
    for n, m in parent.named_modules():
        if m is module and n:
            return n
    return type(module).__name__


def _root_name(module) -> str:
    """The variable name the calling code holds the module in, else its class name."""
    frame, _ = _user_frame(sys._getframe(1))
    while frame is not None:
        for scope in (frame.f_locals, frame.f_globals):
            for k, v in scope.items():
                if v is module and not k.startswith("_") and k != "self":
                    return k
        frame = frame.f_back
        if frame is not None and _kind_of(frame.f_code) != _USER:
            break
    return type(module).__name__


# --------------------------------------------------------------------------------------------
# FiniteGuard


class FiniteGuard:
    r"""Step the optimizer only when every gradient is finite.

    ``guard.step()`` checks all gradients of the optimizer's parameters with one fused
    reduction (the largest magnitude per tensor through ``torch._foreach_norm(grads, inf)``,
    stacked, then one host read) and then either steps the optimizer or, when any gradient
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
        optimizer: any ``torch.optim.Optimizer``.
        max_consecutive: raise after this many skips in a row; ``None`` never raises.

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

    def __init__(self, optimizer: torch.optim.Optimizer, max_consecutive: Optional[int] = None) -> None:
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
            by_device: dict = {}
            for g in grads:
                by_device.setdefault((g.device, g.dtype), []).append(g)
            flags = []
            for gs in by_device.values():
                # the largest magnitude per tensor: NaN if any NaN, inf if any inf; it cannot
                # overflow as a 2-norm would
                norms = torch._foreach_norm(gs, math.inf)
                flags.append(torch.isfinite(torch.stack(norms)).all().to(grads[0].device))
            ok = flags[0] if len(flags) == 1 else torch.stack(flags).all()
            bad = (~ok).to(torch.int32).reshape(1)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            if bad is None:
                bad = torch.zeros(1, dtype=torch.int32)
            if dist.get_backend() == "nccl" and bad.device.type != "cuda":
                bad = bad.cuda()
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bad is None or int(bad.item()) == 0

    def step(self, *, scaler: Optional[Any] = None) -> bool:
        """Step if every gradient is finite; else drop the gradients and count a skip.

        Args:
            scaler: a ``torch.amp.GradScaler``; the guard unscales (if not done yet), checks,
                and steps through ``scaler.step``. Call ``scaler.update()`` after.

        Returns:
            Whether the optimizer stepped.

        Raises:
            SkippedStepsError: the skip made ``max_consecutive`` skips in a row.
        """
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
