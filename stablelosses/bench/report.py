"""The tables of a run: ratios (text or Markdown), the header line and torch's ``Compare``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from stablelosses.bench.cases import specs

__all__ = ["compare_table", "format_header", "format_summary", "format_table", "index", "noisy",
           "ratio_rows", "round_ratios", "summary_legend"]

Key = tuple[str, str, str, str, str]  # fn, case, dtype, device, mode


def index(results: Sequence[dict[str, Any]]) -> dict[Key, dict[str, dict[str, Any]]]:
    """Records indexed by (fn, case, dtype, device, mode), then by variant."""
    out: dict[Key, dict[str, dict[str, Any]]] = {}
    for r in results:
        out.setdefault((r["fn"], r["case"], r["dtype"], r["device"], r["mode"]), {})[r["variant"]] = r
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing, not finite, or ``b <= 0``."""
    if a is None or b is None or b <= 0 or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def moved(rec: dict[str, Any] | None) -> int | None:
    """Bytes read plus written by a record's variant (None when not measured)."""
    if not rec or rec.get("bytes_read") is None:
        return None
    return int(rec["bytes_read"]) + int(rec["bytes_written"])


def _field(vs: dict[str, dict[str, Any]], variant: str | None, name: str) -> Any:
    r = vs.get(variant) if variant else None
    return r.get(name) if r else None


def ratio_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (function, shape, dtype, device, mode) with the ratios of the table."""
    all_specs = specs()
    rows = []
    for (fn, case, dt, dev, mode), vs in index(result["results"]).items():
        spec = all_specs.get(fn)
        tref = spec.torch_ref if spec else "torch"
        nref = spec.naive_ref if spec else "naive"
        ref = spec.ref if spec else "torch"

        def med(v: str | None, vs: dict[str, dict[str, Any]] = vs) -> float | None:
            return _field(vs, v, "median_s")

        ours, comp, ours_moved = med("stable"), med("stable-compiled"), moved(vs.get("stable"))
        peak = _field(vs, "stable", "peak_bytes")
        grad_bytes = next(iter(vs.values()))["grad_bytes"]
        k_ours, k_ref = _field(vs, "stable-compiled", "kernels"), _field(vs, f"{ref}-compiled", "kernels")
        rows.append({
            "fn": fn, "case": case, "dtype": dt, "device": dev, "mode": mode,
            "stable_ms": None if ours is None else ours * 1e3,
            "vs_torch": ratio(ours, med(tref)),
            "vs_naive": ratio(ours, med(nref)),
            "vs_kornia": ratio(ours, med("kornia")),
            "vs_one_pass": ratio(ours, med("one-pass")),
            "mb_moved": None if ours_moved is None else ours_moved / 1e6,
            "bytes_vs_ref": ratio(ours_moved, moved(vs.get(ref))),
            "compiled_ms": None if comp is None else comp * 1e3,
            "c_vs_torch_c": ratio(comp, med(f"{ref}-compiled")),
            "c_vs_torch": ratio(comp, med(ref)),
            "kernels": None if k_ours is None and k_ref is None else f"{_s(k_ours)}/{_s(k_ref)}",
            "peak_mib": None if peak is None else peak / 2**20,
            "peak_vs_ref": ratio(peak, _field(vs, ref, "peak_bytes")),
            "peak_vs_grad": ratio(peak, grad_bytes),
            "error": (vs.get("stable") or {}).get("error"),
        })
    return rows


def _s(v: Any) -> str:
    return "?" if v is None else str(v)


COLUMNS = [
    ("function", "fn", "s"), ("shape", "case", "s"), ("dtype", "dtype", "s"), ("mode", "mode", "s"),
    ("ours ms", "stable_ms", ".3f"), ("÷torch", "vs_torch", ".2f"), ("÷naive", "vs_naive", ".2f"),
    ("÷kornia", "vs_kornia", ".2f"), ("÷1-pass", "vs_one_pass", ".1f"),
    ("MB moved", "mb_moved", ".4g"), ("bytes÷torch", "bytes_vs_ref", ".2f"),
    ("comp ms", "compiled_ms", ".3f"), ("comp÷torch-comp", "c_vs_torch_c", ".2f"),
    ("comp÷torch", "c_vs_torch", ".2f"), ("kernels ours/torch", "kernels", "r"),
    ("peak MiB", "peak_mib", ".1f"), ("peak÷torch", "peak_vs_ref", ".2f"),
    ("peak÷grad", "peak_vs_grad", ".2f"),
]


def render(head: Sequence[str], body: Sequence[Sequence[str]], left: Sequence[bool], markdown: bool) -> str:
    """An aligned text table (or a Markdown table); ``left`` marks left-aligned columns."""
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if lf else "---:" for lf in left) + "|"]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(head)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if lf else c.rjust(w) for c, w, lf in zip(cells, widths, left)).rstrip()

    return "\n".join([fmt(head), "  ".join("-" * w for w in widths)] + [fmt(b) for b in body])


def format_table(result: dict[str, Any], markdown: bool = False) -> str:
    """The ratio table as text (or Markdown). Columns with no value are left out."""
    rows = ratio_rows(result)
    cols = [c for c in COLUMNS if c[2] == "s" or any(r.get(c[1]) is not None for r in rows)]

    def cell(r: dict[str, Any], c: tuple[str, str, str]) -> str:
        v = r.get(c[1])
        if c[1] == "stable_ms" and v is None:
            return "ERROR" if r.get("error") else "n/a"
        if v is None:
            return "-"
        return str(v) if c[2] in ("s", "r") else format(v, c[2])

    body = [[cell(r, c) for c in cols] for r in rows]
    return render([c[0] for c in cols], body, [c[2] == "s" for c in cols], markdown)


def format_header(result: dict[str, Any]) -> str:
    """One line: machine, threads, torch, device, date, tier, repeats."""
    m, s = result["machine"], result["settings"]
    return (f"stablelosses bench — {m['cpu_model']}, {m['torch_threads']} threads, torch "
            f"{m['torch_version']}, device {s['device']}"
            + (f" ({m['cuda_device']})" if m.get("cuda_device") else "")
            + f", {m['date_utc']}, tier {s['tier']}, {s['repeats']} interleaved repeats (medians)")


def compare_table(result: dict[str, Any]) -> str:
    """Every median as ``torch.utils.benchmark.Compare`` prints it (one block per function)."""
    from torch.utils.benchmark import Compare, Measurement, TaskSpec

    ms = []
    for r in result["results"]:
        if r.get("times_s"):
            spec = TaskSpec(stmt=r["variant"], setup="", label=r["fn"],
                            sub_label=f"{r['case']} {r['dtype']} {r['mode']}", description=r["variant"],
                            num_threads=result["machine"].get("torch_threads") or 1)
            ms.append(Measurement(number_per_run=1, raw_times=list(r["times_s"]), task_spec=spec))
    cmp = Compare(ms)
    cmp.trim_significant_figures()
    return str(cmp)


def round_ratios(ours: dict[str, Any] | None, ref: dict[str, Any] | None) -> list[float]:
    """``ours ÷ ref`` per interleaved round (round i of each ran back to back), [] if either is
    missing: the spread of the ratio over the rounds, which the medians alone hide."""
    if not ours or not ref:
        return []
    out = [ratio(a, b) for a, b in zip(ours.get("times_s") or [], ref.get("times_s") or [])]
    return sorted(r for r in out if r is not None)


def _short(v: float) -> str:
    """A ratio in at most 4 characters: 0.93, 9.99, 45, 450, >999."""
    if v < 9.995:
        return f"{v:.2f}"
    return f"{v:.0f}" if v < 999.5 else ">999"


def noisy(rounds: list[float]) -> bool:
    """Whether per-round ratios (sorted) say nothing: their spread includes 1 (faster in one
    round, slower in another), or the rounds disagree by more than 3×."""
    return len(rounds) > 1 and (rounds[0] <= 1.0 <= rounds[-1] or rounds[-1] > 3 * rounds[0])


def _spread_cell(rounds: list[float]) -> str:
    """``median (min–max)`` over the rounds; ``~`` marks noise (see `noisy`)."""
    if not rounds:
        return "-"
    n = len(rounds)
    med = rounds[n // 2] if n % 2 else (rounds[n // 2 - 1] + rounds[n // 2]) / 2
    lo, hi = rounds[0], rounds[-1]
    cell = _short(med) if n == 1 else f"{_short(med)} {_short(lo)}–{_short(hi)}"
    return cell + ("~" if noisy(rounds) else "")


SUMMARY = ("function", "shape", "mode", "ours ms", "÷torch", "÷naive", "bytes÷t")
_DT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}


def format_summary(result: dict[str, Any]) -> str:
    """The console table, under 100 columns: per row our median time, the time ratios against
    the built-in and the naive formula as ``median min–max`` over the interleaved rounds, marked
    ``~`` where they are noise (`noisy`), and the bytes ratio against torch (counted, not timed).
    """
    all_specs = specs()
    keys = index(result["results"])
    several = len({k[2] for k in keys}) > 1  # dtypes: one (the default) is said in the header
    body = []
    for (fn, case, dt, _dev, mode), vs in keys.items():
        spec = all_specs.get(fn)
        ours = vs.get("stable")
        t = ours.get("median_s") if ours else None
        ms = ("ERROR" if ours and ours.get("error") else "n/a") if t is None else f"{t * 1e3:.3f}"
        tref, nref = (spec.torch_ref, spec.naive_ref) if spec else ("torch", "naive")
        by = ratio(moved(ours), moved(vs.get(spec.ref if spec else "torch")))
        shape = f"{case} {_DT.get(dt, dt)}" if several else case
        body.append([fn, shape, mode, ms, _spread_cell(round_ratios(ours, vs.get(tref) if tref else None)),
                     _spread_cell(round_ratios(ours, vs.get(nref) if nref else None)),
                     "-" if by is None else f"{by:.2f}"])
    return render(list(SUMMARY), body, [True, True, True, False, False, False, False], markdown=False)


def summary_legend(result: dict[str, Any]) -> str:
    """What the summary's cells mean, and how far its timings can be trusted."""
    n = result["settings"].get("repeats")
    lines = [
        f"÷torch, ÷naive: ours ÷ reference in each interleaved round: median min–max of {n} rounds;",
        "  < 1 is faster. ~ marks noise: the spread includes 1 or spans more than 3×, so no",
        "  difference was measured, whatever the median says.",
        "bytes÷t: bytes read + written by the aten ops of one call ÷ torch's (counted, not timed).",
    ]
    if n is not None and n < 5:
        lines.append(f"{n} rounds of short samples: a smoke run with rough timings; for numbers to")
        lines.append("  quote, run without --quick (9 rounds) on an idle machine.")
    return "\n".join(lines)
