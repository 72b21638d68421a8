"""Per-input checks of a result file against the speed and memory bounds of the design.

Used by ``benchmarks/check_targets.py``. A result file is the ``--json`` output of
``stablelosses bench`` or pytest-benchmark's ``--benchmark-json`` output of ``pytest
benchmarks/``; ratios are formed inside one file (one run), between variants of the same
function, input, dtype, device and mode, from medians. Each check is ``ok``, ``MISS`` (with
both numbers) or ``skip`` (a reference that is not in the run). Memory checks use the peak of
forward+backward, with a slack of 0.5% + 4 KiB.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stablelosses.bench.cases import specs
from stablelosses.bench.report import Key, index

__all__ = ["TARGETS", "Outcome", "Target", "evaluate", "line", "load", "markdown"]

# Memory targets allow 0.5% + 4 KiB: scalars and per-row vectors are not what they are about.
PEAK_SLACK_REL = 0.005
PEAK_SLACK_BYTES = 4096


def peak_within(peak: float, ref: float, bound: float) -> bool:
    """``peak <= bound * ref``, with the memory targets' slack of 0.5% + 4 KiB."""
    return peak <= bound * ref * (1 + PEAK_SLACK_REL) + PEAK_SLACK_BYTES


# ---------------------------------------------------------------------------------------------
# Inputs of a target
# ---------------------------------------------------------------------------------------------

def _classes(r: dict[str, Any]) -> int:
    shape = r.get("shape") or []
    return int(shape[1]) if len(shape) > 1 else 0


def big_c(r):
    return r["kind"] != "tiny" and _classes(r) >= 1000


def small_c(r):
    return r["kind"] != "tiny" and 0 < _classes(r) < 100


def few_class(r):
    return r["kind"] == "few-class"


def not_tiny(r):
    return r["kind"] != "tiny"


def tiny(r):
    return r["kind"] == "tiny"


def numel(n: int) -> Callable[[dict[str, Any]], bool]:
    def pred(r):
        shape = r.get("shape") or []
        total = 1
        for s in shape:
            total *= int(s)
        return r["kind"] != "tiny" and total == n
    return pred


@dataclass(frozen=True)
class Target:
    fn: str
    where: Callable[[dict[str, Any]], bool]
    kind: str  # 'time' | 'peak' | 'peak_grad' | 'overhead'
    num: str
    den: str | None
    bound: float
    text: str


def _where(name: str) -> Callable[[dict[str, Any]], bool]:
    if name.startswith("numel="):
        return numel(int(name.removeprefix("numel=")))
    preds = {"big_c": big_c, "small_c": small_c, "few_class": few_class, "not_tiny": not_tiny, "tiny": tiny}
    return preds[name]


def _targets() -> list[Target]:
    """The rows of ``checks.csv`` (beside this file): one table, read as it is written."""
    text = (Path(__file__).parent / "checks.csv").read_text(encoding="utf-8")
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    return [Target(r["fn"], _where(r["where"]), r["kind"], r["num"], r["den"] or None, float(r["bound"]),
                   r["text"]) for r in rows]


TARGETS = _targets()


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def load(path: str) -> tuple[dict[Key, dict[str, dict[str, Any]]], dict[str, Any]]:
    """Records of one result file, indexed by (fn, case, dtype, device, mode) then variant."""
    with open(path) as f:
        data = json.load(f)
    records: list[dict[str, Any]] = []
    machine: dict[str, Any] = {}
    if isinstance(data, dict) and str(data.get("schema", "")).startswith("stablelosses-bench"):
        records = data["results"]
        machine = data.get("machine", {})
    elif isinstance(data, dict) and "benchmarks" in data:
        mi = data.get("machine_info", {})
        machine = {"cpu_model": (mi.get("cpu") or {}).get("brand_raw"), "torch_threads": None}
        for b in data["benchmarks"]:
            e = b.get("extra_info") or {}
            if "fn" not in e or "variant" not in e:
                continue
            r = dict(e)
            r["median_s"] = b["stats"]["median"]
            r.setdefault("kind", "tiny" if _is_tiny_label(e.get("case", "")) else "")
            r["error"] = None
            records.append(r)
        _fill_kinds(records)
        versions = {b.get("extra_info", {}).get("torch_version") for b in data["benchmarks"]} - {None}
        if versions:
            machine["torch_version"] = ", ".join(sorted(versions))
        threads = {b.get("extra_info", {}).get("threads") for b in data["benchmarks"]}
        threads.discard(None)
        if len(threads) == 1:
            machine["torch_threads"] = threads.pop()
    else:
        raise ValueError(f"{path}: neither a 'stablelosses bench --json' file nor a "
                         f"pytest-benchmark JSON file")
    return index(records), machine


def _is_tiny_label(label: str) -> bool:
    return label in ("8x10", "8x80", "16")


def _fill_kinds(records: list[dict[str, Any]]) -> None:
    """pytest-benchmark records carry no ``kind``: take it from the case registry."""
    kinds = {(s.name, c.label): c.kind for s in specs().values() for c in s.cases}
    for r in records:
        r["kind"] = kinds.get((r["fn"], r["case"]), r.get("kind") or "")


# ---------------------------------------------------------------------------------------------
# Checking
# ---------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    status: str  # 'ok' | 'MISS' | 'skip'
    target: Target
    key: Key
    value: float | None
    detail: str


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def _fmt_b(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def evaluate(index: dict[Key, dict[str, dict[str, Any]]], modes: Sequence[str],
             dtypes: Sequence[str]) -> list[Outcome]:
    out: list[Outcome] = []
    for t in TARGETS:
        for key, vs in sorted(index.items()):
            fn, _case, dtype, _device, mode = key
            if fn != t.fn or dtype not in dtypes:
                continue
            any_rec = next(iter(vs.values()))
            if not t.where(any_rec):
                continue
            if t.kind in ("time", "overhead") and mode not in modes:
                continue
            if t.kind in ("peak", "peak_grad") and mode != "fwdbwd":
                continue
            num, den = vs.get(t.num), vs.get(t.den) if t.den else None
            field = "median_s" if t.kind in ("time", "overhead") else "peak_bytes"

            def val(r: dict[str, Any] | None, field: str = field) -> Any:
                return None if r is None or r.get("error") else r.get(field)

            nv, dv = val(num), val(den)
            if t.den is not None and dv is None:
                why = (den or {}).get("error") or f"'{t.den}' not in this run"
                out.append(Outcome("skip", t, key, None, why))
                continue
            if nv is None:
                why = (num or {}).get("error") or f"'{t.num}' not in this run"
                status = "MISS" if not t.num.endswith("-compiled") or num is not None else "skip"
                out.append(Outcome(status, t, key, None, f"no measurement of {t.num}: {why}"))
                continue
            if t.kind == "time":
                v = nv / dv
                detail = f"{t.num} {_fmt_s(nv)} / {t.den} {_fmt_s(dv)} = {v:.2f} (bound {t.bound:.2f})"
            elif t.kind == "overhead":
                v = nv - dv
                detail = (f"{t.num} {_fmt_s(nv)} - {t.den} {_fmt_s(dv)} = {_fmt_s(v)} "
                          f"(bound {_fmt_s(t.bound)})")
            elif t.kind == "peak":
                v = nv / dv if dv > 0 else float("inf")
                detail = f"peak {t.num} {_fmt_b(nv)} / {t.den} {_fmt_b(dv)} = {v:.3f} (bound {t.bound:.2f})"
            else:
                g = (num or {}).get("grad_bytes") or 0
                v = nv / g if g else float("inf")
                detail = f"peak {t.num} {_fmt_b(nv)} / gradient {_fmt_b(g)} = {v:.3f} (bound {t.bound:.2f})"
            if t.kind in ("peak", "peak_grad"):
                ref = dv if t.kind == "peak" else ((num or {}).get("grad_bytes") or 0)
                ok = peak_within(nv, ref, t.bound)
            else:
                ok = v <= t.bound
            out.append(Outcome("ok" if ok else "MISS", t, key, v, detail))
    return out


def line(o: Outcome) -> str:
    fn, case, dtype, device, mode = o.key
    mode_s = mode if o.target.kind in ("time", "overhead") else "fwdbwd"
    return (f"{o.status:<4}  {fn:<18} {case:<14} {dtype:<8} {device:<4} {mode_s:<6}  "
            f"{o.target.text}: {o.detail}")


def markdown(outcomes: Sequence[Outcome]) -> str:
    lines = ["| status | function | input | mode | target | measured |", "|---|---|---|---|---|---|"]
    for o in outcomes:
        fn, case, dtype, device, mode = o.key
        status = {"ok": "holds", "MISS": "**MISS**", "skip": "not measured"}[o.status]
        lines.append(f"| {status} | `{fn}` | {case} {dtype} {device} | {mode} | {o.target.text} | "
                     f"{o.detail} |")
    return "\n".join(lines)


