r"""``stablelosses lint``: find the hazardous spellings in a codebase, and rewrite them.

The rules (codes ``SL101``...) look at the syntax tree of each file with the standard library's
``ast``, so finding needs nothing but Python; ``--fix`` and ``--diff`` rewrite through LibCST (the
optional ``fix`` extra) and keep formatting and comments. A rule rewrites only where the new call
has the old value wherever the old code was finite; the others report and say why they do not.

- ``_analysis``: import aliases, calls by qualified name, names bound once (``p = softmax(x)``);
- ``_rules``: the rules and the `RULES` table;
- ``_fix``: the LibCST codemod;
- ``_runner``: files, notebooks, ``# noqa``, selection, the text and JSON reports;
- ``flake8_plugin``: the Flake8 entry point (lint only).

Example:
    >>> from stablelosses.lint import lint_source
    >>> src = "import torch\nimport torch.nn.functional as F\nr = torch.sqrt(F.mse_loss(a, b))\n"
    >>> [(f.code, f.fix) for f in lint_source(src)]
    [('SL101', 'SF.rmse_loss(a, b)')]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from stablelosses.lint._rules import RULES, Finding, Rule
from stablelosses.lint._runner import lint_source, run

__all__ = ["RULES", "Finding", "Rule", "lint_source", "main"]


def _codes(text: str) -> list[str]:
    return [c.strip().upper() for c in text.split(",") if c.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stablelosses lint",
        description="Find numerically hazardous spellings (sqrt of an MSE, log of softmax, "
        "hand-written softmax, ...) and, with --fix, rewrite them into the stable call. Exit 1 when "
        "there are findings, 0 when clean, 2 when a file cannot be read or parsed.",
    )
    p.add_argument("paths", nargs="*", metavar="PATH", help="files, folders or notebooks (.ipynb)")
    p.add_argument("--select", type=_codes, default=None, metavar="CODES",
                   help="only these codes or prefixes, comma-separated (SL101,SL11)")
    p.add_argument("--ignore", type=_codes, default=None, metavar="CODES",
                   help="skip these codes or prefixes")
    p.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    p.add_argument("--fix", action="store_true", help="rewrite the fixable findings in place (needs libcst)")
    p.add_argument("--diff", action="store_true", help="print the fixes as a diff; change nothing")
    p.add_argument("--list-rules", action="store_true", help="print the rules and exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``stablelosses lint ARGS``; returns the exit status.

    Example:
        >>> from stablelosses.lint import main
        >>> main(["--list-rules"])  # doctest: +ELLIPSIS
        SL101 sqrt-of-mse: square root of an MSE or a mean of squares
        ...
        0
    """
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.list_rules:
        for r in RULES.values():
            print(f"{r.code} {r.name}: {r.summary}")
        return 0
    unknown = [c for c in (args.select or []) + (args.ignore or [])
               if not any(code.startswith(c) for code in RULES)]
    if unknown:
        print(f"stablelosses lint: error: unknown rule code(s): {', '.join(unknown)} "
              "(--list-rules prints the codes)", file=sys.stderr)
        return 2
    if not args.paths:
        print("stablelosses lint: error: give at least one PATH (or --list-rules)", file=sys.stderr)
        return 2
    if args.fix and args.diff:
        print("stablelosses lint: error: --fix and --diff cannot be used together", file=sys.stderr)
        return 2
    if args.diff and args.format == "json":  # a diff on stdout would not be JSON
        print("stablelosses lint: error: --diff and --format json cannot be used together", file=sys.stderr)
        return 2
    try:
        return run(args.paths, select=args.select, ignore=args.ignore, fmt=args.format, fix=args.fix,
                   diff=args.diff)
    except ImportError as e:
        print(f"stablelosses lint: error: {e}", file=sys.stderr)
        return 2
