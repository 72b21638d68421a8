"""From a non-finite output to a `NonFiniteError`: is it new, where was it made, what to say."""

from __future__ import annotations

import linecache
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from stablelosses.debug._causes import (
    DIVERGENCE_HINT,
    detail_of,
    diverging_inputs,
    hint_for,
    name_cause,
    nan_without_overflow,
    torch_function_of,
)
from stablelosses.debug._checks import _all_finite, _finite_number, _has_inf, _has_nan
from stablelosses.debug._errors import NonFiniteError, TensorSummary
from stablelosses.debug._frames import _nearest_is_trusted, _user_line

FWD_KEY = "stablelosses.debug.forward"


def _judge_inputs(flat_args, tensors) -> tuple[bool, bool]:
    """(every input finite, some input NaN)."""
    in_finite, in_nan = True, False
    for t in tensors:
        if not _all_finite(t):
            in_finite = False
            in_nan = in_nan or _has_nan(t)
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


def _out_names(func) -> frozenset[str]:
    """The names of an ``.out`` overload's output arguments (``out``, ``values``, ``indices``)."""
    return frozenset(a.name for a in func._schema.arguments if getattr(a, "is_out", False))


def diagnose(det, func, args, kwargs, out, node, before, frame) -> NonFiniteError | None:
    """The report for an operator whose output is not finite, or None when it is not to blame.

    ``before`` maps ``id`` of each tensor an in-place operator overwrote to a copy taken before
    the call: the operator is judged, named and summarised by the values it read.
    """
    name = func._schema.name
    overload = func._schema.overload_name or "default"
    if name in det.allow or f"{name}.{overload}" in det.allow:
        return None
    # an out= tensor is written, not read: what it held before (torch.empty's garbage) is no input
    kwargs = {k: v for k, v in kwargs.items() if k not in _out_names(func)}
    if before:
        args, kwargs = tree_map(lambda a: before.get(id(a), a) if isinstance(a, torch.Tensor) else a,
                                (args, kwargs))
    flat_args, _ = tree_flatten((args, kwargs))
    tensors = [a for a in flat_args if isinstance(a, torch.Tensor)]
    if not tensors and node is None:
        return None  # a factory: its value comes from its arguments
    in_finite, in_nan = _judge_inputs(flat_args, tensors)
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    kind = _kind(det, outs, in_finite, in_nan)
    if kind is None:
        return None
    where = _locate(det, node, frame)
    if where is None:
        return None
    module_path, filename, lineno, node_name, forward_op = where
    cause = name_cause(name, args, outs, in_finite, lambda: nan_without_overflow(func, args, kwargs))
    torch_fn = torch_function_of(frame) if node is None else None
    hint = hint_for(name, cause, args, node_name, forward_op, torch_fn)
    detail = None
    huge = diverging_inputs(cause, tensors)
    if huge is not None:
        detail = f"inputs already as large as {huge:.3g}: the run is diverging"
        hint = DIVERGENCE_HINT
    discarded = None
    if node is not None and kind == "nan" and huge is None:
        unused = unused_branch(node, name, tensors, outs)
        if unused is not None:
            detail, discarded = unused
            hint = UNUSED_BRANCH_HINT
    err = make_error(
        op=name, phase="backward" if node is not None else "forward", kind=kind, cause=cause,
        hint=hint, detail=detail, module_path=module_path, filename=filename, lineno=lineno, node=node_name,
        forward_op=forward_op, inputs=[TensorSummary.of(t) for t in tensors],
        outputs=[TensorSummary.of(o) for o in outs if o.is_floating_point() or o.is_complex()],
        discarded_by=discarded,
        # a backward with no forward record is located by the frame that runs it, not the forward
        forward_line=node is not None and forward_op is not None,
    )
    # [(op, filename, lineno, source)]: the forward operators that did not select this value
    err.discarded_by = discarded or []  # type: ignore[attr-defined]
    return err


# forward operators that pick some elements of an input and drop the others: a value they drop
# still has its backward run, with an incoming gradient of 0
_SELECTORS = frozenset({"aten::where", "aten::minimum", "aten::maximum", "aten::min", "aten::max",
                        "aten::clamp", "aten::clamp_min", "aten::clamp_max", "aten::clip",
                        "aten::masked_fill", "aten::masked_fill_", "aten::masked_select", "aten::index",
                        "aten::nan_to_num", "aten::_masked_softmax", "aten::gather"})

UNUSED_BRANCH_HINT = (
    "hint: the loss is finite because a where/min dropped this value, but autograd still runs its "
    "backward: keep the op's input finite where the value is not used (clamp the exponent, or "
    "select the input first: torch.where(mask, x, 0) before the exp/log; the double where), or use "
    "SF.policy_loss / SF.safe_sqrt / SF.safe_div / SF.xlogy — docs: hazards/finite-loss-nan-gradient"
)


def _zero_times_nonfinite(tensors, outs) -> str | None:
    """At some NaN output, one input is 0 and another ±inf (``'0 * inf'``), or both are 0
    (``'0/0'``); None otherwise."""
    nan = None
    for o in outs:
        if o.is_floating_point():
            nan = torch.isnan(o)
            break
    if nan is None or len(tensors) < 2:
        return None
    try:
        vals = torch.broadcast_tensors(*[t.detach() for t in tensors[:2]], nan)
    except RuntimeError:
        return None
    a, b, at = vals
    if bool((((a == 0) & torch.isinf(b)) | ((b == 0) & torch.isinf(a)))[at].any()):
        return "0 * inf"
    if bool(((a == 0) & (b == 0))[at].any()):
        return "0/0"
    return None


def unused_branch(node, name: str, tensors, outs) -> tuple[str, list] | None:
    """When a backward NaN is 0 times the inf (or 0 / 0) of a forward value that later
    where/min/clamp operators did not select: the words for it, and (op, file, line, source) of
    each such selector downstream of the node's forward operator (three at most, nearest first).

    A 0/0 with no such selector is the operator's own singular point (the backward of a norm or
    a sqrt at 0), not an unused branch: None.
    """
    rec = node.metadata.get(FWD_KEY)
    if rec is None:
        return None
    zero = _zero_times_nonfinite(tensors, outs)
    if zero is None and not any(t.is_floating_point() and bool(torch.isinf(t).any()) for t in tensors):
        return None
    seen: set[int] = set()
    todo: list = list(rec.consumers)
    found: list = []
    while todo and len(seen) < 256 and len(found) < 3:
        r = todo.pop(0)
        if id(r) in seen:
            continue
        seen.add(id(r))
        if r.op in _SELECTORS:
            if all((f.op, f.filename, f.lineno) != (r.op, r.filename, r.lineno) for f in found):
                found.append(r)
            continue
        todo.extend(r.consumers)
    if zero == "0 * inf":
        what = (f"0 * inf in {node.name()}: its incoming gradient is 0 where the forward value of {rec.op} "
                "is not finite")
    elif zero == "0/0":
        what = f"0/0 in {node.name()}: its incoming gradient is 0 at a singular point of {rec.op}"
    else:
        what = f"inf - inf or 0 * inf in {node.name()} on the non-finite forward values of {rec.op}"
    if not found:
        return (what, []) if zero == "0 * inf" else None
    first = found[0]
    where = f"{first.filename}:{first.lineno}" if first.filename else "(unknown)"
    sel = [(f.op, f.filename, f.lineno,
            (linecache.getline(f.filename, int(f.lineno or 0)).strip() if f.filename else "") or None)
           for f in found]
    return (f"{what}; {first.op} at {where} did not select that value, so the loss is finite", sel)


def _unused_lines(info: dict) -> list[str]:
    out = []
    for op, filename, lineno, source in info.get("discarded_by") or ():
        out.append(f"  not selected by: {op} at {filename}:{lineno}")
        if source:
            out.append(f"      {source}")
    return out


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
    where = "forward line" if info.get("forward_line", info["phase"] == "backward") else "location"
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
    lines += _unused_lines(info)
    if info.get("hint"):
        lines.append(f"  {info['hint']}")
    return "\n".join(lines)
