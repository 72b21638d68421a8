"""The speed targets, each with its measured ratio, bytes-moved ratio, aten-op and kernel counts.

One row per target and input, from one run (``benchmarks/check_targets.py`` on the JSON of
``stablelosses bench --compile --json``, or on pytest-benchmark's). Time targets are
checked on forward+backward unless the row's mode is ``fwd``; ``ratio`` is ours ÷ the
reference (medians), ``overhead`` ours − the reference. Every row also shows, for the same
input and mode: ``bytes ÷ ref``, ours ÷ the same reference in bytes moved by the eager calls
(`stablelosses.bench.traffic`, the device-independent stand-in for CUDA speed); ``ops
ours/ref``, the aten operators of the eager calls (each is a kernel launch on a GPU); and
``kernels ours/ref``, the kernels the compiled calls launch (`stablelosses.bench.kernels`;
only in a ``--compile`` run). A quick run (``--quick``) has smaller inputs: each target is
then checked on its stand-in input, named in the row. Peak targets allow 0.5% + 4 KiB, as
`checks.py` (beside this file) does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from checks import peak_within

from stablelosses.bench.report import Key, moved, ratio, render

__all__ = ["GOALS", "KINDS", "OPS_BOUND", "Goal", "format_goals", "goal_rows"]

#: Kinds of target: time ratio, time difference (seconds), peak-memory ratio, bytes-moved
#: ratio, aten operators of one eager call (a count), kernels of the compiled call (a ratio).
KINDS = ("ratio", "overhead", "peak", "bytes", "ops", "kernels")
OPS_BOUND = 20  # aten operators of one eager forward+backward of cross_entropy / focal_loss


@dataclass(frozen=True)
class Goal:
    """One target: ``num`` against ``den`` on ``cases`` (``quick``: stand-ins of a quick run)."""

    fn: str
    cases: tuple[str, ...]
    quick: tuple[str, ...]
    kind: str  # one of KINDS
    bound: float
    text: str
    num: str = "stable"
    den: str = "torch"
    mode: str = "fwdbwd"
    strict: bool = False  # below the bound, not at it


# The quick tier's stand-in of each input of the default tier.
_QUICK = {"8192x1000": "1024x1000", "256x32000": "1024x1000", "65536x10": "4096x10",
          "65536x80": "4096x80", "1e6": "1e5", "1e7": "1e5"}

_CE_ALL = ("8192x1000", "256x32000", "65536x10")
_CE_VARIANTS = ("cross_entropy_smoothing", "cross_entropy_weight", "cross_entropy_probs")

#: Per function: the reference variant of its targets, its name in the target text, and the
#: inputs its eager, bytes, compiled and peak targets are checked on.
_REF: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "cross_entropy": ("torch", "F.cross_entropy", _CE_ALL),
    "focal_loss": ("torch", "F.cross_entropy", _CE_ALL),
    "cross_entropy_smoothing": ("torch", "F.cross_entropy(label_smoothing=0.1)", ("8192x1000",)),
    "cross_entropy_weight": ("torch", "F.cross_entropy(weight=w)", ("8192x1000",)),
    "cross_entropy_probs": ("torch", "F.cross_entropy(probabilities)", ("8192x1000",)),
    "softmax": ("torch", "torch.softmax", ("8192x1000",)),
    "log_softmax": ("torch", "torch.log_softmax", ("8192x1000",)),
    "logsumexp": ("torch", "torch.logsumexp", ("8192x1000",)),
    "rmse_loss": ("torch", "sqrt(F.mse_loss)", ("1e6", "1e7")),
    "kl_div": ("torch", "F.kl_div", ("8192x1000",)),
    "log_cosh_loss": ("naive", "log(cosh(x - y)).mean()", ("1e6", "1e7")),
    "safe_div": ("naive", "where(b != 0, a / b, 0)", ("1e6",)),
    "sigmoid_focal_loss": ("torch", "torchvision's formula", ("65536x80",)),
    "safe_sqrt": ("torch", "torch.sqrt", ("1e6",)),
    "xlogy": ("torch", "torch.special.xlogy", ("1e6",)),
}
#: The tiny input of each function that has one (fixed-cost targets).
_TINY = {"cross_entropy": "8x10", "focal_loss": "8x10", "softmax": "8x10", "log_softmax": "8x10",
         "logsumexp": "8x10", "kl_div": "8x10", "rmse_loss": "16", "log_cosh_loss": "16",
         "safe_div": "16", "sigmoid_focal_loss": "8x80", "safe_sqrt": "16", "xlogy": "16"}


def _quick(cases: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(_QUICK[c] for c in cases))


def _g(fn: str, cases: Sequence[str], kind: str, bound: float, text: str, **kw: Any) -> Goal:
    den = kw.pop("den", _REF[fn][0])
    return Goal(fn, tuple(cases), _quick(cases), kind, bound, text, den=den, **kw)


def _goals() -> list[Goal]:
    """The speed targets, in the order of their table."""
    g: list[Goal] = []
    # cross_entropy (class indices) and focal_loss, both against F.cross_entropy
    for fn in ("cross_entropy", "focal_loss"):
        g.append(_g(fn, _CE_ALL, "bytes", 1.0, "bytes ≤ 1.0× F.cross_entropy's"))
        g.append(_g(fn, ("8192x1000",), "ops", OPS_BOUND, f"≤ {OPS_BOUND} aten ops"))
        g.append(_g(fn, ("8192x1000", "256x32000"), "ratio", 1.10,
                    "eager ≤ 1.10× F.cross_entropy (C ≥ 1000)"))
        g.append(_g(fn, ("65536x10",), "ratio", 1.30, "eager ≤ 1.30× F.cross_entropy (C = 10)"))
    for fn in _CE_VARIANTS:
        ref = _REF[fn][1]
        g.append(_g(fn, _REF[fn][2], "bytes", 1.15, f"bytes ≤ 1.15× {ref}'s"))
        g.append(_g(fn, _REF[fn][2], "ratio", 1.15, f"eager ≤ 1.15× {ref}"))
    for fn in ("softmax", "log_softmax", "logsumexp"):
        ref = _REF[fn][1]
        g.append(_g(fn, _REF[fn][2], "bytes", 1.3, f"bytes ≤ 1.3× {ref}'s"))
        g.append(_g(fn, _REF[fn][2], "ratio", 1.15, f"eager ≤ 1.15× {ref}"))
    for fn, bound in (("rmse_loss", 1.20), ("kl_div", 1.10), ("log_cosh_loss", 1.10), ("safe_div", 1.05)):
        ref = _REF[fn][1]
        g.append(_g(fn, _REF[fn][2], "bytes", 1.2, f"bytes ≤ 1.2× {ref}'s"))
        g.append(_g(fn, _REF[fn][2], "ratio", bound, f"eager ≤ {bound:.2f}× {ref}"))
    sf = ("65536x80",)
    g.append(_g("sigmoid_focal_loss", sf, "bytes", 1.0, "bytes ≤ 1.0× torchvision's formula's"))
    g.append(_g("sigmoid_focal_loss", sf, "ratio", 0.85, "eager ≤ 0.85× torchvision's formula"))
    g.append(_g("sigmoid_focal_loss", sf, "peak", 0.5, "peak ≤ 0.5× torchvision's formula's"))
    # every function, compiled with fullgraph=True
    for fn, (den, ref, cases) in _REF.items():
        g.append(_g(fn, cases, "kernels", 1.0, f"compiled: kernels ≤ compiled {ref}'s",
                    num="stable-compiled", den=f"{den}-compiled"))
        g.append(_g(fn, cases, "ratio", 1.05, f"compiled ≤ 1.05× compiled {ref}",
                    num="stable-compiled", den=f"{den}-compiled"))
    # fixed cost: the tiny inputs
    for fn, case in _TINY.items():
        g.append(Goal(fn, (case,), (case,), "overhead", 50e-6, f"tiny fwd+bwd ≤ {_REF[fn][1]} + 50 µs",
                      den=_REF[fn][0]))
        g.append(Goal(fn, (case,), (case,), "overhead", 25e-6,
                      f"tiny no-grad forward ≤ {_REF[fn][1]} + 25 µs", den=_REF[fn][0], mode="fwd"))
    # memory: the peak of forward+backward (sigmoid_focal_loss has its own bound above)
    for fn, (_den, ref, cases) in _REF.items():
        if fn != "sigmoid_focal_loss":
            g.append(_g(fn, cases, "peak", 1.0, f"peak ≤ {ref}'s"))
    return g


GOALS = _goals()


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:+.3f} ms" if abs(s) >= 1e-3 else f"{s * 1e6:+.1f} µs"


def _pair(a: Any, b: Any) -> str:
    return "" if a is None and b is None else f"{'?' if a is None else a}/{'?' if b is None else b}"


def _row(goal: Goal, case: str, vs: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    row = {"goal": goal, "fn": goal.fn, "case": case, "target": goal.text, "measured": "-",
           "bytes": "-", "ops": "", "kernels": "", "value": None, "status": "not measured"}
    if vs is None:
        return row
    num, den = vs.get(goal.num) or {}, vs.get(goal.den) or {}
    eager_num, eager_den = goal.num.replace("-compiled", ""), goal.den.replace("-compiled", "")
    e_num, e_den = vs.get(eager_num) or {}, vs.get(eager_den) or {}
    c_num, c_den = vs.get(f"{eager_num}-compiled") or {}, vs.get(f"{eager_den}-compiled") or {}
    row["ops"] = _pair(e_num.get("aten_ops"), e_den.get("aten_ops"))
    row["kernels"] = _pair(c_num.get("kernels"), c_den.get("kernels"))
    b = ratio(moved(e_num), moved(e_den))
    row["bytes"] = "-" if b is None else f"{b:.2f}×"
    v: float | None
    if goal.kind == "bytes":
        v = b
        row["measured"] = row["bytes"]
    elif goal.kind == "ops":
        v = num.get("aten_ops")
        row["measured"] = "-" if v is None else f"{v} ops"
    elif goal.kind == "kernels":
        k, kd = num.get("kernels"), den.get("kernels")
        if k is None or kd is None:
            v = None
        else:  # ours ÷ the reference's (0 ÷ 0 is 1: both launch nothing)
            v = k / kd if kd else (1.0 if k == 0 else float("inf"))
        row["measured"] = "-" if v is None else f"{k} vs {kd} kernels"
    elif goal.kind == "peak":
        v = ratio(num.get("peak_bytes"), den.get("peak_bytes"))
        row["measured"] = "-" if v is None else f"{v:.2f}× peak"
    elif goal.kind == "ratio":
        v = ratio(num.get("median_s"), den.get("median_s"))
        row["measured"] = "-" if v is None else f"{v:.2f}×"
    else:
        a, d = num.get("median_s"), den.get("median_s")
        v = None if a is None or d is None else a - d
        row["measured"] = "-" if v is None else _fmt_time(v)
    if v is None:
        err = num.get("error") or den.get("error")
        row["status"] = f"error: {err}" if err else "not measured"
        return row
    row["value"] = v
    if goal.kind == "peak":  # a scalar or a per-row vector more is not what a peak target is about
        met = peak_within(num["peak_bytes"], den["peak_bytes"], goal.bound)
    else:
        met = v < goal.bound if goal.strict else v <= goal.bound
    row["status"] = "met" if met else "missed"
    return row


def goal_rows(index: dict[Key, dict[str, dict[str, Any]]], dtype: str = "float32") -> list[dict[str, Any]]:
    """One row per (target, input) of the functions in the run: measured, bytes ratio, met/missed.

    A target whose input (or variant) is not in the run gets a row that says "not measured".
    """
    by_case: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    devices = sorted({k[3] for k in index})
    for (fn, case, dt, _dev, mode), vs in index.items():
        if dt == dtype:
            by_case[(fn, case, mode)] = vs
    present = {k[0] for k in index}
    rows = []
    for goal in GOALS:
        if goal.fn not in present:  # a run with --only: the other functions are not in it
            continue
        found = [c for c in goal.cases + goal.quick if (goal.fn, c, goal.mode) in by_case]
        for case in dict.fromkeys(found or goal.cases):
            rows.append(_row(goal, case, by_case.get((goal.fn, case, goal.mode))))
    for r in rows:
        r["device"] = ",".join(devices)
    return rows


def format_goals(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """The target table; the last line counts met / missed / not measured."""
    head = ["function", "input", "mode", "target", "measured", "bytes ÷ ref", "ops ours/ref",
            "kernels ours/ref", "status"]
    missed = "**missed**" if markdown else "MISSED"
    body = [[r["fn"], r["case"], r["goal"].mode, r["target"], r["measured"], r["bytes"], r["ops"],
             r["kernels"], missed if r["status"] == "missed" else r["status"]] for r in rows]
    table = render(head, body, [True, True, True, True, False, False, False, False, True], markdown)
    n = {s: sum(r["status"] == s for r in rows) for s in ("met", "missed")}
    other = len(rows) - n["met"] - n["missed"]
    return table + f"\n\n{n['met']} met, {n['missed']} missed, {other} not measured (of {len(rows)})."
