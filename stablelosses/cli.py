r"""The ``stablelosses`` command (also ``python -m stablelosses``).

- no arguments, or ``demo``: the hazard table, naive formula beside stablelosses.
- ``trace [--watch] SCRIPT.py [ARGS...]``: run a script under
  [`detect_nonfinite`][stablelosses.debug.detect_nonfinite]; report the first NaN/Inf created
  (exit 1) or that there was none (exit 0); a script that calls ``sys.exit`` exits with its own
  code, and one that crashes before any NaN/Inf exits 2 with its traceback.
- ``lint [--fix | --diff] [--format json] [--select CODES] [--ignore CODES] PATH...``: find
  the hazardous spellings and rewrite them into the stable calls (`stablelosses.lint`).
- ``bench [--device cuda] [--compile] [--quick] [--json PATH] ...``: the speed comparison
  (`stablelosses.bench`).

Bad arguments print one line to stderr and exit 2.

Example:
    >>> from stablelosses.cli import main
    >>> main(["--version"])
    stablelosses 0.2.0
    0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]

_PROG = "stablelosses"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and no exit on errors."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise _UsageError(f"{self.prog}: error: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=_PROG,
        description="Numerically stable losses for PyTorch. Without a command: the hazard demo.",
    )
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    sub.add_parser(
        "demo",
        help="the hazard table: naive PyTorch formulas beside stablelosses (the default)",
        description="For each hazard, the naive formula's value and gradient beside the "
        "stablelosses function's.",
    )

    t = sub.add_parser(
        "trace",
        help="run a script under detect_nonfinite and report the first NaN/Inf",
        description="Run SCRIPT (as `python SCRIPT ARGS...` would, with __name__ == '__main__') "
        "under stablelosses.debug.detect_nonfinite. Exit 1 with a report of the first operator "
        "that created a NaN/Inf (or, with --watch, of a diverging run), 0 when none was created, "
        "the script's own exit code when it calls sys.exit, and 2 when it crashed (an uncaught "
        "exception) before any NaN/Inf was created. Threads the script starts are watched too.",
    )
    t.add_argument("--watch", action="store_true",
                   help="also run a DivergenceMonitor after every loss.backward(): stop a diverging "
                   "run before its loss is inf")
    t.add_argument("--warn", action="store_true",
                   help="do not stop at the first one: report every distinct one at the end")
    t.add_argument("--no-forward", dest="forward", action="store_false", help="skip the forward")
    t.add_argument("--no-backward", dest="backward", action="store_false", help="skip the backward")
    t.add_argument("--no-nan", dest="nan", action="store_false", help="do not report NaN")
    t.add_argument("--no-inf", dest="inf", action="store_false", help="do not report Inf")
    t.add_argument("--allow", action="append", default=[], metavar="OP",
                   help="operator to ignore, e.g. aten::exp (repeatable)")
    t.add_argument("script", metavar="SCRIPT.py", help="the script to run")
    t.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")

    # `bench ARGS` is handed to stablelosses.bench before parsing (it has its own parser and
    # --help); this entry only lists the command.
    sub.add_parser(
        "bench",
        help="speed of stablelosses against the built-ins and the naive formulas "
        "(`stablelosses bench --help`)",
        add_help=False,
    )
    # `lint ARGS` is handed to stablelosses.lint.main as bench's are.
    sub.add_parser(
        "lint",
        help="find hazardous spellings (sqrt of an MSE, log of softmax, ...) and --fix them "
        "(`stablelosses lint --help`)",
        add_help=False,
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        if argv and argv[0] == "bench":
            return _bench(argv)
        if argv and argv[0] == "lint":
            return _lint(argv)
        args = parser.parse_args(argv)
    except _UsageError as e:
        print(str(e).splitlines()[0], file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    if args.version:
        from stablelosses import __version__

        print(f"{_PROG} {__version__}")
        return 0
    if args.command in (None, "demo"):
        return _demo()
    if args.command == "trace":
        return _trace(args)
    raise AssertionError(args.command)  # pragma: no cover


def _demo() -> int:
    from stablelosses import _torch_import  # noqa: F401 - torch without its NumPy warning
    from stablelosses._demo import render

    print(render())
    return 0


def _bench(argv: list) -> int:
    """Hand ``bench ARGS`` to ``stablelosses.bench.main(ARGS)``, which parses them itself (and
    imports torch only after its ``--help``)."""
    from stablelosses.bench import main as bench_main

    try:
        return int(bench_main(argv[1:]) or 0)
    except SystemExit as e:  # its argparse: --help, or a bad argument (already reported)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


def _lint(argv: list) -> int:
    """Hand ``lint ARGS`` to ``stablelosses.lint.main(ARGS)``."""
    from stablelosses.lint import main as lint_main

    try:
        return lint_main(argv[1:])
    except SystemExit as e:  # its argparse: --help, or a bad argument (already reported)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


def _trace(args: argparse.Namespace) -> int:
    from stablelosses import _torch_import  # noqa: F401 - torch without its NumPy warning
    from stablelosses.debug._trace import run_trace

    return run_trace(args.script, list(args.args), warn=args.warn, watch=args.watch, forward=args.forward,
                     backward=args.backward, nan=args.nan, inf=args.inf, allow=args.allow)
