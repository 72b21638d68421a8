"""Files in, findings out: discovery, notebooks, ``# noqa``, ``--select``/``--ignore``, and the
text and JSON reports of the ``stablelosses lint`` command."""

from __future__ import annotations

import ast
import difflib
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from stablelosses.lint._analysis import Module
from stablelosses.lint._rules import RULES, Finding, check_tree

__all__ = ["Report", "lint_source", "iter_files", "run"]

_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*))?", re.I)
_SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", "build", "dist"}


@dataclass
class Report:
    """One finding, placed in a file (``cell`` for a notebook), columns 1-based in characters."""

    path: str
    line: int
    column: int
    end_line: int
    end_column: int
    code: str
    message: str
    fix: str | None
    no_fix: str | None
    cell: int | None = None

    @property
    def docs(self) -> str:
        return f"lint#{self.code.lower()}, hazards/{RULES[self.code].page}"

    def text(self) -> str:
        where = f"{self.path}:cell {self.cell}" if self.cell is not None else self.path
        tail = f"fix: {self.fix}" if self.fix else f"no automatic fix: {self.no_fix}"
        return f"{where}:{self.line}:{self.column}: {self.code} {self.message} [{tail}] (docs: {self.docs})"

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("path", "cell", "line", "column", "end_line", "end_column",
                                           "code", "message", "fix", "no_fix", "docs")}
        d["name"] = RULES[self.code].name
        return d


def selected(code: str, select: Sequence[str] | None, ignore: Sequence[str] | None) -> bool:
    """Prefix match as ruff does: ``SL1`` selects SL101..SL199."""
    if select and not any(code.startswith(s) for s in select):
        return False
    return not (ignore and any(code.startswith(s) for s in ignore))


def _noqa(line: str, code: str) -> bool:
    mt = _NOQA.search(line)
    if mt is None:
        return False
    codes = mt.group("codes")
    return codes is None or code in {c.upper() for c in re.split(r"[\s,]+", codes) if c}


def lint_source(source: str, select: Sequence[str] | None = None, ignore: Sequence[str] | None = None,
                tree: ast.Module | None = None, path: str = "") -> list[Finding]:
    """The findings in one module's source, after ``# noqa`` and the selection.

    Example:
        >>> from stablelosses.lint import lint_source
        >>> [f.code for f in lint_source("import torch\\ny = torch.log(torch.softmax(x, -1))\\n")]
        ['SL102']
    """
    m = Module(source, tree, path)
    lines = source.splitlines()
    out = []
    for f in check_tree(m):
        if not selected(f.code, select, ignore):
            continue
        text = lines[f.line - 1] if f.line <= len(lines) else ""
        if _noqa(text, f.code):
            continue
        out.append(f)
    return out


def _report(path: str, source: str, f: Finding, cell: int | None = None, line0: int = 0) -> Report:
    lines = source.splitlines()

    def col(line: int, byte: int) -> int:
        t = lines[line - 1] if line <= len(lines) else ""
        return len(t.encode("utf-8")[:byte].decode("utf-8", errors="ignore")) + 1

    el, ec = f.end
    return Report(path, f.line + line0, col(f.line, f.col), el + line0, col(el, ec), f.code, f.message,
                  f.fix, f.no_fix, cell)


def iter_files(paths: Iterable[str]) -> Iterator[Path]:
    """``.py`` files (and ``.ipynb`` notebooks) under each path, sorted, hidden folders skipped."""
    for p in map(Path, paths):
        if p.is_dir():
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
                for name in sorted(files):
                    if name.endswith((".py", ".ipynb")):
                        yield Path(root) / name
        else:
            yield p


def _notebook_cells(text: str) -> list[str]:
    nb = json.loads(text)
    cells = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            cells.append("")
            continue
        src = cell.get("source", "")
        src = "".join(src) if isinstance(src, list) else src
        # IPython magics and shell escapes are not Python: blank them out, keep the line count
        cells.append("\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in src.splitlines()))
    return cells


def _fix_loop(source: str, select, ignore, path: str) -> tuple[str, int]:
    """Apply fixes until none is left (an outer rewrite can expose an inner one): 5 passes at most."""
    from stablelosses.lint._fix import apply_fixes

    total = 0
    for _ in range(5):
        new, n = apply_fixes(source, lint_source(source, select, ignore, path=path))
        if n == 0 or new == source:
            break
        source, total = new, total + n
    return source, total


@dataclass
class _FileResult:
    reports: list[Report]
    errors: list[str]
    diff: str = ""
    fixed: int = 0


def _one_file(path: Path, select, ignore, fix: bool = False, diff: bool = False) -> _FileResult:
    name = str(path)
    try:
        with open(path, encoding="utf-8", newline="") as fh:  # newline="": \r\n stays \r\n
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        return _FileResult([], [f"{name}: cannot read: {e}"])
    if name.endswith(".ipynb"):
        try:
            cells = _notebook_cells(text)
        except ValueError as e:
            return _FileResult([], [f"{name}: not a notebook: {e}"])
        reports = []
        for i, src in enumerate(cells, 1):
            try:
                tree = ast.parse(src)
            except SyntaxError:
                continue  # a cell of another language, or a half-written one
            reports += [_report(name, src, f, cell=i) for f in lint_source(src, select, ignore, tree, name)]
        return _FileResult(reports, [])
    try:
        tree = ast.parse(text, filename=name)
    except (SyntaxError, ValueError) as e:
        return _FileResult([], [f"{name}: cannot parse: {e}"])
    res = _FileResult([], [])
    if fix or diff:
        try:
            new, _ = _fix_loop(text, select, ignore, name)
        except _cst_error() as e:  # newer syntax than the installed LibCST parses
            res.errors.append(f"{name}: not fixed: LibCST cannot parse it: {str(e).splitlines()[0]}")
            new = text
        if new != text:
            # counted as the report counts: the findings that were there and are gone (a rewrite
            # that exposes a second one, log(hand softmax) -> log(SF.softmax) -> SF.log_softmax,
            # is one finding fixed in two steps)
            res.fixed = fixed_count(lint_source(text, select, ignore, tree, name),
                                    lint_source(new, select, ignore, path=name))
            res.diff = "".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True), name, name))
            if fix:
                with open(path, "w", encoding="utf-8", newline="") as fh:
                    fh.write(new)
                text, tree = new, ast.parse(new, filename=name)
    if not diff:
        res.reports = [_report(name, text, f) for f in lint_source(text, select, ignore, tree, name)]
    return res


def fixed_count(before: Sequence[Finding], after: Sequence[Finding]) -> int:
    """The findings that were there and are gone, code by code: a finding that a rewrite
    introduced (of another code) is reported as remaining, never subtracted from the fixed."""
    gone = Counter(f.code for f in before)
    gone.subtract(Counter(f.code for f in after))
    return sum(n for n in gone.values() if n > 0)


def _cst_error() -> type[Exception]:
    import libcst

    return libcst.ParserSyntaxError


def _lint_many(paths: list[Path], select, ignore) -> Iterator[_FileResult]:
    """Lint-only over many files: one process per core (forked, so nothing is imported again)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from functools import partial

    jobs = min(os.cpu_count() or 1, 8)
    if jobs < 2 or len(paths) < 64 or "fork" not in multiprocessing.get_all_start_methods():
        yield from (_one_file(p, select, ignore) for p in paths)
        return
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        yield from pool.map(partial(_one_file, select=select, ignore=ignore), paths, chunksize=16)


def fixable(r: Report, reports: Sequence[Report]) -> bool:
    """Has a rewrite, or lies inside one that has (the outer rewrite removes it); never in a
    notebook, which ``--fix`` does not rewrite."""
    if r.cell is not None:
        return False
    if r.fix is not None:
        return True
    a, b = (r.line, r.column), (r.end_line, r.end_column)
    return any(o.fix is not None and o.path == r.path and o.cell == r.cell
               and (o.line, o.column) <= a and b <= (o.end_line, o.end_column) for o in reports)


def run(paths: Sequence[str], *, select=None, ignore=None, fmt: str = "text", fix: bool = False,
        diff: bool = False, out=None) -> int:
    """The ``stablelosses lint`` command: 1 when findings remain (or, with ``--diff``, a file
    would change), 0 when clean, 2 when a path cannot be read or parsed."""
    out = out or sys.stdout
    files = list(iter_files(paths))
    if fix or diff:
        from stablelosses.lint._fix import require_libcst

        require_libcst()
        results: Iterable[_FileResult] = (_one_file(p, select, ignore, fix, diff) for p in files)
    else:
        results = _lint_many(files, select, ignore)
    reports: list[Report] = []
    fixed = 0
    changed = broken = False
    for res in results:
        for e in res.errors:
            print(e, file=sys.stderr)
        broken = broken or bool(res.errors)
        if res.diff:
            changed = True
            fixed += res.fixed
            if diff:
                out.write(res.diff)
        reports += res.reports
    if fmt == "json":
        json.dump([r.as_dict() for r in reports], out, indent=1)
        out.write("\n")
    else:
        for r in reports:
            print(r.text(), file=out)
        if fix:
            print(f"fixed {fixed}, {len(reports)} remaining", file=sys.stderr)
        elif reports:
            n_fix = sum(fixable(r, reports) for r in reports)
            print(f"found {len(reports)} ({n_fix} fixable with --fix)", file=sys.stderr)
    if broken:
        return 2
    return 1 if reports or (diff and changed) else 0
