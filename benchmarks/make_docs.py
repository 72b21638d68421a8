#!/usr/bin/env python
"""Write ``docs/benchmarks.md`` from a ``stablelosses bench --json`` result.

Usage::

    python benchmarks/make_docs.py BENCH.json [--pytest PYTEST_BENCH.json] [--notes NOTES.md]
                                   [--out docs/benchmarks.md]

The page holds: the machine and the command, what each variant calls, the ratio table (time,
bytes moved, kernels of compiled calls, peak memory), the speed-target table (each target with
its measured value, bytes-moved ratio, aten-op count, compiled kernel count and met / missed),
the per-input checks (holds / MISS / not measured, from ``check_targets.py``), the raw medians
and bytes moved of every variant, an optional hand-written notes section (``--notes``), and how
to rerun. Every number comes from the one JSON given; the command shown is the one recorded in
it (``--command`` only for a JSON that has none).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checks import Outcome, evaluate, load
from targets import format_goals, goal_rows

from stablelosses.bench.report import format_table, index

HERE = os.path.dirname(os.path.abspath(__file__))


def _targets_section(result: dict[str, Any], modes: list[str]) -> str:
    outcomes = evaluate(index(result["results"]), modes, ["float32"])
    n = {s: sum(o.status == s for o in outcomes) for s in ("ok", "MISS", "skip")}
    # One row per (target, input): a time target holds only if it holds in every mode.
    rows: dict[Any, list[Outcome]] = {}
    for o in outcomes:
        fn, case, dtype, device, _mode = o.key
        rows.setdefault((o.target, fn, case, dtype, device), []).append(o)
    lines = ["| status | function | input | target | measured |", "|---|---|---|---|---|"]
    for (t, fn, case, _dtype, _device), os_ in rows.items():
        if any(o.status == "MISS" for o in os_):
            status = "**MISS**"
        elif all(o.status == "ok" for o in os_):
            status = "holds"
        elif any(o.status == "ok" for o in os_):
            status = "holds (partly measured)"
        else:
            status = "not measured"
        detail = "<br>".join(
            (f"{o.key[4]}: " if t.kind in ("time", "overhead") else "") + o.detail for o in os_)
        lines.append(f"| {status} | `{fn}` | {case} | {t.text} | {detail} |")
    summary = (f"{n['ok']} checks hold, **{n['MISS']} missed**, {n['skip']} not measured "
               f"(float32, time targets checked in {' and '.join(modes)}).")
    return summary + "\n\n" + "\n".join(lines)


def _pytest_section(path: str, command: str) -> str:
    with open(path) as f:
        data = json.load(f)
    n = sum(1 for b in data.get("benchmarks", []) if (b.get("extra_info") or {}).get("fn"))
    index, _ = load(path)
    outcomes = evaluate(index, ["fwd", "fwdbwd"], ["float32"])
    k = {s: sum(o.status == s for o in outcomes) for s in ("ok", "MISS", "skip")}
    lines = [
        f"`{command}`: {n} benchmarks (pytest-benchmark {data.get('version', '?')}, "
        f"{data.get('datetime', '')[:16]}). Each variant is timed on its own there (no "
        "interleaving), so its ratios are noisier than the table above. `check_targets.py` on "
        f"its JSON: {k['ok']} checks hold, {k['MISS']} missed, {k['skip']} not measured.",
        "",
        "| status | function | input | mode | target | measured |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        if o.status != "MISS":
            continue
        fn, case, dtype, device, mode = o.key
        lines.append(f"| **MISS** | `{fn}` | {case} | {mode} | {o.target.text} | {o.detail} |")
    return "\n".join(lines)


_VARIANT_ORDER = ["torch", "naive", "naive-double-where", "kornia", "stable", "one-pass",
                  "torch-compiled", "naive-compiled", "naive-double-where-compiled", "kornia-compiled",
                  "stable-compiled"]


def _variant_table(records: list[dict[str, Any]], cell: Callable[[dict[str, Any]], str],
                   order: list[str] | None = None) -> str:
    """One row per (function, input, dtype, mode), one column per variant (in ``order`` first)."""
    by: dict[Any, dict[str, Any]] = {}
    variants: list[str] = []
    for r in records:
        by.setdefault((r["fn"], r["case"], r["dtype"], r["mode"]), {})[r["variant"]] = r
        if r["variant"] not in variants:
            variants.append(r["variant"])
    if order is not None:
        variants = [v for v in order if v in variants] + [v for v in variants if v not in order]
    lines = ["| function | input | mode | " + " | ".join(variants) + " |",
             "|---|---|---|" + "---:|" * len(variants)]
    for (fn, case, dt, mode), vs in by.items():
        cells = ["" if vs.get(v) is None else cell(vs[v]) for v in variants]
        lines.append(f"| {fn} | {case} {dt} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _bytes_section(result: dict[str, Any]) -> str:
    """MB moved (read + written by the aten ops of one call) per variant, eager variants only."""
    measured = [r for r in result["results"] if r.get("bytes_read") is not None]
    if not measured:
        return "(not measured in this run)"
    return _variant_table(measured, lambda r: (f"{(r['bytes_read'] + r['bytes_written']) / 1e6:.4g} "
                                               f"({r.get('aten_ops', '?')} ops)"))


def _raw_cell(r: dict[str, Any]) -> str:
    """The median in ms, and the peak memory when measured."""
    if r.get("median_s") is None:
        return "err"
    ms = r["median_s"] * 1e3
    cell = f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"
    if r.get("peak_bytes") is not None:
        cell += f" ({r['peak_bytes'] / 2**20:.1f} MiB)"
    return cell


def _raw_section(result: dict[str, Any]) -> str:
    return _variant_table(result["results"], _raw_cell, _VARIANT_ORDER)


def _command_from_settings(s: dict[str, Any]) -> str:
    """The ``stablelosses bench`` flags that give these settings (for a JSON without ``command``)."""
    flags = ["stablelosses bench"]
    if s.get("tier") in ("quick", "full"):
        flags.append(f"--{s['tier']}")
    if s.get("compile"):
        flags.append("--compile")
    if s.get("device", "cpu") != "cpu":
        flags.append(f"--device {s['device']}")
    if s.get("only"):
        flags.append("--only " + ",".join(s["only"]))
    return " ".join(flags + ["--json BENCH.json"])


def _describe_section(result: dict[str, Any]) -> str:
    """What each variant of the functions in the run calls (``stable`` is ours, by default the
    stablelosses function of the same name; ``one-pass`` is ``torch.neg`` of the first input)."""
    in_run: dict[str, list[str]] = {}
    for r in result["results"]:
        vs = in_run.setdefault(r["fn"], [])
        if r["variant"] not in vs and not r["variant"].endswith("-compiled") and r["variant"] != "one-pass":
            vs.append(r["variant"])
    describe = result.get("describe") or {}
    lines = ["| function | variant | what it calls |", "|---|---|---|"]
    for fn, vs in in_run.items():
        for v in vs:
            what = (describe.get(fn) or {}).get(v)
            if not what:
                what = f"stablelosses.functional.{fn}" if v == "stable" else ""
            lines.append(f"| {fn} | {v} | {what} |")
    return ("`one-pass` is `torch.neg` of the first input (one read and one write: the "
            "memory-bandwidth floor); `<variant>-compiled` is `torch.compile` of the variant "
            "(ours with `fullgraph=True`).\n\n" + "\n".join(lines))


def _spellings_section() -> str:
    """benchmarks/spellings.md (the measurements behind the code's special choices), one
    heading level down, so that the history lives on this page and the code keeps one number."""
    text = (Path(__file__).parent / "spellings.md").read_text().strip()
    return "\n".join("#" + line if line.startswith("#") else line for line in text.splitlines())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make_docs.py")
    p.add_argument("bench")
    p.add_argument("--pytest",
                   help="pytest-benchmark JSON of the same session (its target check is summarized)")
    p.add_argument("--notes", help="Markdown file inserted as the observations section")
    p.add_argument("--command",
                   help="the command that produced BENCH.json, for a JSON that does not record it")
    p.add_argument("--pytest-command", default="pytest benchmarks/ --benchmark-only -k cpu",
                   help="the command that produced the pytest JSON")
    p.add_argument("--out", default=os.path.join(HERE, "..", "docs", "benchmarks.md"))
    args = p.parse_args(argv)
    with open(args.bench) as f:
        result = json.load(f)
    m, s = result["machine"], result["settings"]
    command = result.get("command") or args.command or _command_from_settings(s)
    threads = m.get("torch_threads")
    kornia = m.get("kornia")
    parts = [
        "# Benchmarks",
        "",
        "Speed, bytes moved and peak memory of stablelosses against the PyTorch built-ins it "
        "replaces, the naive formulas people post"
        + (", kornia's `focal_loss`" if kornia else "")
        + " and a memory-bandwidth floor. Generated by `benchmarks/make_docs.py` from a real run; "
        "the numbers below are from that run only.",
        "",
        "## Machine and run",
        "",
        f"- CPU: **{m['cpu_model']}** ({m['cpu_count']} cores visible), "
        f"**{m['torch_threads']} threads** (`torch.set_num_threads`)",
        f"- torch {m['torch_version']}, Python {m['python']}, kornia {m.get('kornia') or 'not installed'}",
        f"- date: {m['date_utc']}; 1-minute load average at the start / end of the run: "
        f"{m.get('loadavg_1m_start') or float('nan'):.2f} / {m.get('loadavg_1m', float('nan')):.2f} "
        f"(the run itself keeps {threads} threads busy)",
        f"- command: `{command}` ({result['elapsed_s']:.0f} s); tier `{s['tier']}`, "
        f"device `{s['device']}`, dtypes {', '.join(s['dtypes'])}, {s['repeats']} interleaved "
        f"repeats per variant, medians",
        "- allocator environment: "
        + ", ".join(f"`{k}={v}`" for k, v in (m.get("malloc_env") or {}).items()),
        "",
        "## What is compared",
        "",
        _describe_section(result),
        "",
        "## Ratios",
        "",
        "Ours ÷ reference, medians of interleaved repeats; below 1 is faster. `fwd` is the forward "
        "on inputs that do not require grad, `fwdbwd` the forward plus `torch.autograd.grad`. "
        "Columns: `÷torch` the built-in replaced (`F.cross_entropy` for `focal_loss`, the "
        "torchvision formula for `sigmoid_focal_loss`); `÷naive` the naive snippet (the "
        "double-`where` idiom for `safe_div`); `÷1-pass` one read-and-write pass over the input "
        "(`torch.neg`), i.e. \"× the physical minimum\"; `comp` our `torch.compile`d function, "
        "against the compiled built-in and the eager built-in; `kernels ours/torch` the kernels "
        "the compiled forward (+backward) launches, ours and the built-in's (generated plus extern "
        "kernels, from inductor's output code); `MB moved` the bytes read plus written by the aten "
        "operators of one eager call and `bytes÷torch` ours against the built-in's (the "
        "device-independent stand-in for GPU speed: a loss on a GPU is bandwidth-bound); `peak` "
        "the peak bytes allocated during one forward+backward, against the built-in's and against "
        "the gradient's size.",
        "",
        format_table(result, markdown=True),
        "",
        "## Speed targets",
        "",
        "Every speed target, from the same run (`python benchmarks/check_targets.py` "
        "prints this table from the run's JSON). Time targets are on "
        "forward+backward unless the mode says `fwd`. On every row, for the same input and mode: "
        "`bytes ÷ ref` is ours against the same reference in bytes moved by the eager calls, "
        "`ops ours/ref` the aten operators of the eager calls (each one a kernel launch on a GPU) "
        "and `kernels ours/ref` the kernels of the compiled calls (empty without `--compile`). "
        "A target whose input or variant is not in this run says \"not measured\". The "
        "exactness target is checked by the test suite, not by this run.",
        "",
        format_goals(goal_rows(index(result["results"])), markdown=True),
        "",
        "## Per-input checks",
        "",
        "From `python benchmarks/check_targets.py` on the same JSON. A time check holds only if "
        "it holds for the forward and for forward+backward.",
        "",
        _targets_section(result, ["fwd", "fwdbwd"]),
        "",
    ]
    if args.pytest:
        parts += ["## pytest-benchmark suite", "", _pytest_section(args.pytest, args.pytest_command), ""]
    if args.notes:
        with open(args.notes) as f:
            parts += [f.read().strip(), ""]
    if result.get("notes"):
        parts += ["## Run notes", ""] + [f"- {n}" for n in result["notes"]] + [""]
    parts += [_spellings_section(), ""]
    parts += [
        "## Raw medians",
        "",
        "Milliseconds per call; in parentheses the peak memory of one forward+backward.",
        "",
        _raw_section(result),
        "",
        "## Bytes moved",
        "",
        "MB read plus written by the aten operators of one eager call (in parentheses the number "
        "of operators), per variant: the device-independent count behind the `bytes÷torch` "
        "column.",
        "",
        _bytes_section(result),
        "",
        "## How to rerun",
        "",
        "```bash",
        "stablelosses bench                               # eager, default shapes, float32",
        "stablelosses bench --compile --json bench.json   # + compiled variants, raw numbers",
        "stablelosses bench --quick                       # small shapes, few repeats",
        "stablelosses bench --full                        # all shapes, float32 + bfloat16",
        "python benchmarks/check_targets.py bench.json    # the targets table; exit 1 listing misses",
        "python benchmarks/make_docs.py bench.json        # regenerate this page",
        "",
        "# pytest-benchmark suites (not part of the default `pytest` run)",
        "benchmarks/run_cpu.sh                            # sets the allocator environment",
        "STABLELOSSES_BENCH_FULL=1 pytest benchmarks/ --benchmark-only   # full grid",
        "OUT=results benchmarks/run_cuda.sh               # on a GPU machine",
        "```",
        "",
        "`stablelosses bench` re-executes itself with `MALLOC_MMAP_THRESHOLD_`, "
        "`MALLOC_TRIM_THRESHOLD_` and `MALLOC_TOP_PAD_` set high so that freed large buffers stay "
        "in glibc's heap (no page faults on reuse), and uses 2 threads unless `--threads` says "
        "otherwise. Run it on an otherwise "
        "idle machine: on a shared one the 2-thread parallel regions wait for descheduled "
        "threads and every ratio drifts. The details are in `benchmarks/README.md`.",
        "",
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(parts))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
