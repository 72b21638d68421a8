"""``stablelosses bench``: argument parsing, the allocator re-exec, and what is printed.

The parser imports no torch (``stablelosses bench --help`` answers without it): the lists it
takes (functions, dtypes, modes) are checked against the case registry after parsing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from stablelosses.bench.run import Settings

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _csv(s: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in s.split(",") if x.strip())
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {s!r}")
    return items


def _check_lists(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The list arguments against the registry (imported here: it needs torch)."""
    from stablelosses.bench.cases import DTYPES, specs
    from stablelosses.bench.run import MODES

    for flag, what, choices in (("only", "function", list(specs())), ("dtype", "dtype", list(DTYPES)),
                                ("modes", "mode", MODES), ("compile_modes", "mode", MODES)):
        bad = [x for x in getattr(args, flag) or () if x not in choices]
        if bad:
            parser.error(f"argument --{flag.replace('_', '-')}: invalid {what} {', '.join(bad)} "
                         f"(choose from {', '.join(choices)})")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``stablelosses bench``."""
    p = _Parser(
        prog="stablelosses bench",
        description="Time stablelosses against the PyTorch built-ins and the naive formulas; print "
                    "a table (under 100 columns) of the time ratios, each as the median and the "
                    "spread over interleaved rounds with noise marked, and the bytes moved. --wide "
                    "adds the one-pass memory-bandwidth floor, the peak memory of forward+backward "
                    "and, with --compile, the compiled calls and their kernel count.",
        epilog="The JSON written by --json is read by benchmarks/check_targets.py (the design's "
               "speed targets, met or missed, in a source checkout) and benchmarks/make_docs.py.",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device (default cpu)")
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile'd variants (compiled before timing; slow to build)")
    tier = p.add_mutually_exclusive_group()
    tier.add_argument("--quick", action="store_true",
                      help="small shapes, 3 rounds of short samples: a smoke run of about 20 s on 2 CPU "
                           "cores (18 s measured, 2026-12-07; longer on a busy machine); rough timings")
    tier.add_argument("--full", action="store_true",
                      help="all shapes (adds LLM-vocabulary and segmentation) and bfloat16")
    p.add_argument("--json", metavar="PATH", help="write the raw numbers to PATH")
    p.add_argument("--markdown", metavar="PATH", help="write the ratio table as Markdown to PATH")
    p.add_argument("--wide", action="store_true",
                   help="print every column (one-pass floor, MB moved, compiled, peak memory): about "
                        "150 columns, as written by --markdown")
    p.add_argument("--raw", action="store_true",
                   help="also print every median as torch.utils.benchmark.Compare does")
    p.add_argument("--only", type=_csv, metavar="FN[,FN...]",
                   help="only these functions (a wrong name lists the choices)")
    p.add_argument("--dtype", type=_csv, metavar="DT[,DT...]",
                   help="float32, bfloat16, float16, float64 (default float32; --full: "
                        "float32,bfloat16)")
    p.add_argument("--modes", type=_csv, metavar="M[,M...]",
                   help="fwd, fwdbwd or both (default both)")
    p.add_argument("--compile-modes", type=_csv, metavar="M[,M...]",
                   help="with --compile: the modes that get compiled variants (default: all)")
    p.add_argument("--repeats", type=int, metavar="R", help="interleaved repeats per variant")
    p.add_argument("--threads", type=int, default=2, metavar="T", help="torch.set_num_threads (default 2)")
    p.add_argument("--no-peak", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--no-bytes", action="store_true", help="skip the bytes-moved count")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-reexec", action="store_true",
                   help="do not re-execute with the MALLOC_* environment when it is missing")
    return p


def _reexec(argv: Sequence[str]) -> NoReturn:
    from stablelosses.bench.memory import MALLOC_ENV

    env = dict(os.environ)
    env.update({k: v for k, v in MALLOC_ENV.items() if k not in env})
    env["STABLELOSSES_BENCH_REEXEC"] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "stablelosses.bench", *argv], env)


def _settings(args: argparse.Namespace) -> Settings:
    from stablelosses.bench.run import MODES, Settings, tier_settings

    tier = "quick" if args.quick else ("full" if args.full else "default")
    kw = tier_settings(tier)
    if args.repeats is not None:
        kw["repeats"] = args.repeats
    dtypes = args.dtype or (("float32", "bfloat16") if tier == "full" else ("float32",))
    return Settings(tier=tier, device=args.device, compile=args.compile, dtypes=dtypes,
                    modes=args.modes or MODES, compile_modes=args.compile_modes, only=args.only,
                    peak=not args.no_peak, bytes=not args.no_bytes, **kw)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``stablelosses bench``; returns the exit status.

    0 on success (also when some variants failed; they are listed), 2 on bad arguments, 130
    when interrupted (the table and ``--json`` still hold the finished cases).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"argument --repeats: must be >= 1, got {args.repeats}")
    if args.threads < 1:
        parser.error(f"argument --threads: must be >= 1, got {args.threads}")
    from stablelosses import _torch_import  # noqa: F401 - torch without its NumPy warning

    _check_lists(parser, args)
    import torch

    from stablelosses.bench.memory import MALLOC_ENV
    from stablelosses.bench.report import (
        compare_table,
        format_header,
        format_summary,
        format_table,
        summary_legend,
    )
    from stablelosses.bench.run import run

    if args.device == "cuda" and not torch.cuda.is_available():
        print("stablelosses bench: error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if (not args.no_reexec and not os.environ.get("STABLELOSSES_BENCH_REEXEC")
            and any(k not in os.environ for k in MALLOC_ENV)):
        _reexec(argv)
    torch.set_num_threads(args.threads)
    result = run(_settings(args), progress=not args.no_progress)
    result["command"] = shlex.join(["stablelosses", "bench", *argv])
    print(textwrap.fill(format_header(result), 100, subsequent_indent="  "))
    print(format_table(result) if args.wide else format_summary(result))
    if args.raw:
        print("\n" + compare_table(result))
    if result["notes"]:
        print("\nnotes:")
        for n in result["notes"]:
            print(textwrap.fill(n, 100, initial_indent="  - ", subsequent_indent="    "))
    if args.wide:
        print("\n(ratios: ours ÷ reference, medians; < 1 is faster. MB moved: bytes read + written "
              "by the aten ops of one call.\n peak = bytes allocated during one forward+backward.)")
    else:
        print("\n" + summary_legend(result))
    print(f"took {result['elapsed_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_header(result) + "\n\n" + format_table(result, markdown=True) + "\n")
        print(f"wrote {args.markdown}")
    return 130 if any(n.startswith("interrupted") for n in result["notes"]) else 0
