"""From a non-finite output to a `NonFiniteError`: is it new, where was it made, what to say."""

from __future__ import annotations

import linecache
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from stablelosses.debug._causes import DIVERGENCE_HINT, detail_of, diverging_inputs, hint_for, name_cause
from stablelosses.debug._checks import _all_finite, _finite_number, _has_inf, _has_nan
from stablelosses.debug._errors import NonFiniteError, TensorSummary
from stablelosses.debug._frames import _nearest_is_trusted, _user_line

FWD_KEY = "stablelosses.debug.forward"


def _judge_inputs(args, flat_args, tensors, writes, before) -> tuple[bool, bool]:
    """(every input finite, some input NaN); tensors written in place count from before the call."""
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
    return in_finite, in_nan


def _kind(det, outs, in_finite: bool, in_nan: bool) -> str | None:
    out_nan = any(_has_nan(o) for o in outs)
    if out_nan and not in_nan and det.nan:
        return "nan"
    if in_finite and not out_nan and det.inf:
        return "overflow"
    if in_finite and out_nan and not det.nan and det.inf and any(_has_inf(o) for o in outs):
        return "overflow"
    return None


def _locate(det, node, frame) -> tuple[Any, ...] | None:
    """(module_path, filename, lineno, node name, forward op), or None inside stablelosses."""
    if node is None:
        if _nearest_is_trusted(frame):
            return None  # inside a stablelosses function: checked at its boundary
        return det._module_path(), *_user_line(frame), None, None
    rec = node.metadata.get(FWD_KEY)
    if rec is not None and rec.trusted:
        return None
    if _nearest_is_trusted(frame):
        return None  # a stablelosses Function's own backward
    if rec is not None:
        return rec.module_path, rec.filename, rec.lineno, node.name(), rec.op
    # the backward ran without a forward record: name the frame that ran it
    return None, *_user_line(frame), node.name(), None


def diagnose(det, func, args, kwargs, out, node, writes, before, frame) -> NonFiniteError | None:
    """The report for an operator whose output is not finite, or None when it is not to blame."""
    name = func._schema.name
    overload = func._schema.overload_name or "default"
    if name in det.allow or f"{name}.{overload}" in det.allow:
        return None
    flat_args, _ = tree_flatten((args, kwargs))
    tensors = [a for a in flat_args if isinstance(a, torch.Tensor)]
    if not tensors and node is None:
        return None  # a factory: its value comes from its arguments
    in_finite, in_nan = _judge_inputs(args, flat_args, tensors, writes, before)
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    kind = _kind(det, outs, in_finite, in_nan)
    if kind is None:
        return None
    where = _locate(det, node, frame)
    if where is None:
        return None
    module_path, filename, lineno, node_name, forward_op = where
    cause = name_cause(name, args, outs, in_finite)
    hint = hint_for(name, cause, args, node_name, forward_op)
    detail = None
    huge = diverging_inputs(cause, tensors)
    if huge is not None:
        detail = f"inputs already as large as {huge:.3g}: the run is diverging"
        hint = DIVERGENCE_HINT
    return make_error(
        op=name, phase="backward" if node is not None else "forward", kind=kind, cause=cause,
        hint=hint, detail=detail, module_path=module_path, filename=filename, lineno=lineno, node=node_name,
        forward_op=forward_op, inputs=[TensorSummary.of(t) for t in tensors],
        outputs=[TensorSummary.of(o) for o in outs if o.is_floating_point() or o.is_complex()],
    )


def make_error(**info: Any) -> NonFiniteError:
    """A `NonFiniteError` whose message is `format_report` of ``info``."""
    filename, lineno = info.get("filename"), info.get("lineno")
    source = linecache.getline(filename, int(lineno or 0)).strip() if filename else ""
    info["source"] = source or None
    return NonFiniteError(format_report(info), **info)


def format_report(info: dict) -> str:
    """The multi-line message: headline with the cause, module, line, inputs, outputs, hint."""
    what = "NaN" if info["kind"] == "nan" else "Inf"
    src = "inputs without NaN" if info["kind"] == "nan" else "finite inputs"
    head = f"{info['op']} produced {what} from {src} in the {info['phase']}"
    if info["phase"] == "backward":
        fwd = f" (forward {info['forward_op']})" if info.get("forward_op") else ""
        head += f" of {info['node']}{fwd}"
    cause = info.get("cause")
    if cause:
        head += f": {cause} ({info.get('detail') or detail_of(cause)})"
    lines = [head, f"  module:   {info.get('module_path') or '(none)'}"]
    where = "forward line" if info["phase"] == "backward" else "location"
    if info.get("filename"):
        lines.append(f"  {where}: {info['filename']}:{info['lineno']}")
        if info.get("source"):
            lines.append(f"      {info['source']}")
    else:
        lines.append(f"  {where}: (unknown)")
    for i, s in enumerate(info.get("inputs", ())):
        lines.append(f"  input {i}:  {s}")
    for i, s in enumerate(info.get("outputs", ())):
        lines.append(f"  output {i}: {s}")
    if info.get("hint"):
        lines.append(f"  {info['hint']}")
    return "\n".join(lines)
