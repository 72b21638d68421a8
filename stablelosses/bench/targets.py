"""The speed targets of issue 12, each with its measured ratio, bytes-moved ratio and status.

One row per target and input, from one run (``stablelosses bench --targets``, or
``benchmarks/check_targets.py`` on its JSON or on pytest-benchmark's). Time targets are
checked on forward+backward unless the target names the forward; ``ratio`` is ours ÷ the
reference (medians), ``overhead`` ours − the reference. The bytes column is ours ÷ the same
reference in bytes moved by the eager calls (`stablelosses.bench.traffic`): the
device-independent stand-in for CUDA speed (target: at most 1.3× torch's); for compiled
targets the kernels column shows the kernels the compiled forward+backward launches, ours and
the reference's (`stablelosses.bench.kernels`). A quick run
(``--quick``) has smaller inputs: each target is then checked on its stand-in input, named in
the row. Peak targets allow 0.5% + 4 KiB, as `stablelosses.bench.checks` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stablelosses.bench.checks import peak_within
from stablelosses.bench.report import Key, moved, ratio, render

__all__ = ["BYTES_BOUND", "GOALS", "Goal", "format_goals", "goal_rows"]

BYTES_BOUND = 1.3


@dataclass(frozen=True)
class Goal:
    """One target: ``num`` against ``den`` on ``cases`` (``quick``: stand-ins of a quick run)."""

    fn: str
    cases: tuple[str, ...]
    quick: tuple[str, ...]
    kind: str  # 'ratio' (time), 'overhead' (time difference, seconds), 'peak', 'bytes'
    bound: float
    text: str
    num: str = "stable"
    den: str = "torch"
    mode: str = "fwdbwd"
    strict: bool = False  # below the bound, not at it


_BIG, _BIGQ = ("8192x1000",), ("1024x1000",)


def _goals() -> list[Goal]:
    G = Goal
    g = [
        G("cross_entropy", _BIG, _BIGQ, "ratio", 1.10, "eager ≤ 1.10× F.cross_entropy (keep)"),
        G("focal_loss", _BIG, _BIGQ, "ratio", 1.10, "eager ≤ 1.10× F.cross_entropy (keep)"),
        G("cross_entropy", _BIG, _BIGQ, "peak", 1.0, "peak ≤ F.cross_entropy's (keep 0.67×)"),
        G("softmax", _BIG, _BIGQ, "ratio", 1.15, "≤ 1.15× torch.softmax"),
        G("log_softmax", _BIG, _BIGQ, "ratio", 1.15, "≤ 1.15× torch.log_softmax"),
        G("rmse_loss", ("1e6", "1e7"), ("1e5",), "ratio", 1.20, "≤ 1.20× sqrt(F.mse_loss)"),
        G("sigmoid_focal_loss", ("65536x80",), ("4096x80",), "ratio", 0.85, "≤ 0.85× torchvision's formula"),
        G("sigmoid_focal_loss", ("65536x80",), ("4096x80",), "peak", 0.35,
          "peak ≤ 0.35× torchvision's formula"),
        G("kl_div", _BIG, _BIGQ, "ratio", 1.10, "≤ 1.10× F.kl_div"),
        G("safe_div", ("1e6",), ("1e5",), "ratio", 1.05, "≤ 1.05× where(b != 0, a / b, 0)", den="naive"),
        G("cross_entropy", ("8192x1000", "65536x10", "256x32000"), ("1024x1000", "4096x10"), "ratio", 1.05,
          "compiled ≤ 1.05× compiled F.cross_entropy", num="stable-compiled", den="torch-compiled"),
        G("logsumexp", _BIG, _BIGQ, "ratio", 1.05, "compiled ≤ 1.05× compiled torch.logsumexp",
          num="stable-compiled", den="torch-compiled"),
        G("log_softmax", _BIG, _BIGQ, "ratio", 1.05, "compiled ≤ 1.05× compiled torch.log_softmax",
          num="stable-compiled", den="torch-compiled"),
        G("rmse_loss", ("1e6", "1e7"), ("1e5",), "ratio", 1.05, "compiled ≤ 1.05× compiled sqrt(mse)",
          num="stable-compiled", den="torch-compiled"),
    ]
    for fn, case in (("cross_entropy", "8x10"), ("focal_loss", "8x10"), ("sigmoid_focal_loss", "8x80")):
        g.append(G(fn, (case,), (case,), "overhead", 50e-6, "tiny fwd+bwd ≤ torch + 50 µs"))
    for fn in ("cross_entropy", "softmax"):
        g.append(G(fn, ("8x10",), ("8x10",), "overhead", 25e-6, "tiny forward ≤ torch + 25 µs", mode="fwd"))
    main = {"cross_entropy": "8192x1000", "focal_loss": "8192x1000", "softmax": "8192x1000",
            "log_softmax": "8192x1000", "logsumexp": "8192x1000", "kl_div": "8192x1000",
            "rmse_loss": "1e7", "safe_div": "1e6", "safe_sqrt": "1e6", "xlogy": "1e6"}
    quick = {"1e7": "1e5", "1e6": "1e5", "8192x1000": "1024x1000"}
    for fn, case in main.items():
        g.append(G(fn, (case,), (quick[case],), "bytes", BYTES_BOUND, f"bytes ≤ {BYTES_BOUND}× torch's"))
        g.append(G(fn, (case,), (quick[case],), "peak", 1.0, "peak ≤ torch's"))
    g.append(G("log_cosh_loss", ("1e7",), ("1e5",), "bytes", 1.0, "bytes ≤ log(cosh)'s", den="naive"))
    g.append(G("log_cosh_loss", ("1e7",), ("1e5",), "peak", 1.0, "peak ≤ log(cosh)'s", den="naive"))
    g.append(G("sigmoid_focal_loss", ("65536x80",), ("4096x80",), "bytes", 1.0, "bytes < the formula's",
                strict=True))
    return g


GOALS = _goals()


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:+.3f} ms" if abs(s) >= 1e-3 else f"{s * 1e6:+.1f} µs"


def _row(goal: Goal, case: str, vs: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    row = {"goal": goal, "fn": goal.fn, "case": case, "target": goal.text, "measured": "-",
           "bytes": "-", "kernels": "", "value": None, "status": "not measured"}
    if vs is None:
        return row
    num, den = vs.get(goal.num) or {}, vs.get(goal.den) or {}
    if num.get("kernels") is not None or den.get("kernels") is not None:
        row["kernels"] = f"{num.get('kernels', '?')}/{den.get('kernels', '?')}"
    eager_num, eager_den = goal.num.replace("-compiled", ""), goal.den.replace("-compiled", "")
    b = ratio(moved(vs.get(eager_num)), moved(vs.get(eager_den)))
    row["bytes"] = "-" if b is None else f"{b:.2f}×"
    if goal.kind == "bytes":
        v = b
        row["measured"] = row["bytes"]
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
    head = ["function", "input", "mode", "target", "measured", "bytes ÷ ref", "kernels ours/ref", "status"]
    body = [[r["fn"], r["case"], r["goal"].mode, r["target"], r["measured"], r["bytes"], r["kernels"],
             ("**missed**" if markdown else "MISSED") if r["status"] == "missed" else r["status"]]
            for r in rows]
    table = render(head, body, [True, True, True, True, False, False, False, True], markdown)
    n = {s: sum(r["status"] == s for r in rows) for s in ("met", "missed")}
    other = len(rows) - n["met"] - n["missed"]
    return table + f"\n\n{n['met']} met, {n['missed']} missed, {other} not measured (of {len(rows)})."
