#!/usr/bin/env python
"""Check benchmark results against the stablelosses speed and memory targets.

Usage::

    python benchmarks/check_targets.py RESULT.json [RESULT.json ...]
        [--modes fwd,fwdbwd] [--dtype float32] [--strict] [--markdown PATH] [--quiet] [--exit-zero]

Each file is either the ``--json`` output of ``stablelosses bench`` or pytest-benchmark's
``--benchmark-json`` output of ``pytest benchmarks/``. Ratios are formed inside one file (one
run), between variants of the same function, input, dtype, device and mode, from medians.

Prints one line per (target, input, mode): ``ok``, ``MISS`` (with both numbers) or ``skip``
(a reference that is not in the run: kornia not installed, compiled variants not timed).
Exit status 1 when any target is missed — also when our variant failed or is missing while
its reference was timed (e.g. ``NotImplementedError``) — else 0 (also with ``--exit-zero``: a
report, not a gate); ``--strict`` also fails on skips. Time targets are checked in every mode
given by ``--modes`` (default: both ``fwd`` and ``fwdbwd``; a target holds only if it holds for
both); memory targets use the peak of forward+backward, with a slack of 0.5% + 4 KiB (a scalar
or a per-row vector more than the reference does not count as a miss). Targets are stated for
float32 with 2 threads; a run with another thread count gets a warning.

After the per-input checks it prints the speed targets table: every target with its measured
value, its bytes-moved ratio, aten-op count, compiled kernel count and met / missed
(``--no-goals`` to leave it out; ``--goals-markdown PATH`` writes it as Markdown). The checks
and the targets live beside this script, in ``checks.py`` (with ``checks.csv``) and ``targets.py``.

This is a check, not a unit test: run it after a benchmark, e.g.::

    stablelosses bench --compile --json bench.json && python benchmarks/check_targets.py bench.json
"""

from __future__ import annotations

import argparse
import json
import sys

from checks import evaluate, line, load, markdown
from targets import format_goals, goal_rows


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="check_targets.py", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", metavar="RESULT.json")
    p.add_argument("--modes", default="fwd,fwdbwd",
                   help="modes whose times are checked (default fwd,fwdbwd)")
    p.add_argument("--dtype", default="float32", help="dtypes checked, comma separated (default float32)")
    p.add_argument("--strict", action="store_true", help="skipped targets fail too")
    p.add_argument("--markdown", metavar="PATH", help="also write the outcomes as a Markdown table")
    p.add_argument("--quiet", action="store_true", help="print only misses and the summary")
    p.add_argument("--exit-zero", action="store_true",
                   help="exit 0 also when a target is missed (a report, e.g. of a noisy CI run)")
    p.add_argument("--no-goals", action="store_true", help="leave out the speed targets table")
    p.add_argument("--goals-markdown", metavar="PATH", help="write the speed targets table as Markdown")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in ("fwd", "fwdbwd")]
    if bad:
        p.error(f"argument --modes: invalid mode {bad[0]!r} (choose from fwd, fwdbwd)")
    dtypes = [d for d in args.dtype.split(",") if d]

    failed = False
    md: list[str] = []
    goals_md: list[str] = []
    for path in args.files:
        try:
            index, machine = load(path)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            print(f"check_targets.py: error: {path}: {e}", file=sys.stderr)
            return 2
        outcomes = evaluate(index, modes, dtypes)
        n = {s: sum(o.status == s for o in outcomes) for s in ("ok", "MISS", "skip")}
        print(f"== {path}: {machine.get('cpu_model')}, threads {machine.get('torch_threads')}, "
              f"torch {machine.get('torch_version', '?')}")
        if machine.get("torch_threads") not in (None, 2):
            print(f"warning: the targets are stated for 2 threads; this run used "
                  f"{machine.get('torch_threads')}")
        for o in outcomes:
            if not args.quiet or o.status == "MISS":
                print(line(o))
        print(f"-- {len(outcomes)} checks: {n['ok']} hold, {n['MISS']} missed, {n['skip']} not measured")
        if not outcomes:
            print("warning: no target applies to this file (no float32 results?)")
        failed |= n["MISS"] > 0 or (args.strict and (n["skip"] > 0 or not outcomes))
        md.append(f"### {path}\n\n" + markdown(outcomes))
        if not args.no_goals:
            rows = goal_rows(index)
            print(f"\nspeed targets ({path}):\n")
            print(format_goals(rows))
            goals_md.append(f"### {path}\n\n" + format_goals(rows, markdown=True))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n\n".join(md) + "\n")
    if args.goals_markdown:
        with open(args.goals_markdown, "w") as f:
            f.write("\n\n".join(goals_md) + "\n")
    return 1 if failed and not args.exit_zero else 0


if __name__ == "__main__":
    sys.exit(main())
