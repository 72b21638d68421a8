"""The docs pages' python snippets stay true: they parse, name only what the package has, and
the values their comments claim are what the code prints today.

A claim is a comment that starts with ``tensor(`` (or is a bare number or bool) after
``print(expr)`` or after a bare expression, continued on the comment-only lines below it whose
``#`` is in the same column; the text after the printed value (``: the whole batch``) is prose
and is not compared. Whitespace is not compared (torch pads columns), ``...`` stands for
anything, and a claim with neither ``grad_fn=`` nor ``...`` is compared with the value's
``grad_fn`` left out. Every block with a claim runs in a fresh namespace (about 4 s in all). The
README has its own, stricter harness (``tests/test_readme.py``).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md"))
_BLOCK = re.compile(r"^( *)```python[^\n]*\n(.*?)^\1```", re.S | re.M)
_GRAD_FN = re.compile(r",\s*grad_fn=<\w+>")
_MODULES = {"SF": "stablelosses.functional", "sl": "stablelosses"}
_ATTR = re.compile(r"\b(stablelosses(?:\.functional|\.debug)?|SF|sl)\.([A-Za-z_]\w*)")
_FROM = re.compile(r"^\s*from (stablelosses[\w.]*) import (.+)$", re.M)


def _blocks(page: Path) -> list[str]:
    out = []
    for indent, code in _BLOCK.findall(page.read_text(encoding="utf-8")):
        out.append("\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in code.splitlines()))
    return out


def _leading_value(comment: str) -> str | None:
    """The printed value a comment starts with: one or more ``tensor(...)`` groups, or a word."""
    comment = comment.strip()
    if re.fullmatch(r"-?[\d.e+-]+|True|False|nan|inf|-inf", comment):
        return comment
    end, depth, i = 0, 0, 0
    while comment.startswith("tensor(", i):
        for j in range(i, len(comment)):
            depth += comment[j] == "("
            depth -= comment[j] == ")"
            if depth == 0 and comment[j] == ")":
                end = j + 1
                break
        else:
            return None
        i = end + 1 if comment[end:end + 1] == " " else len(comment)
    return comment[:end] or None


def _claims(code: str) -> list[tuple[int, str]]:
    """(index of the top-level statement, claimed value) for each checkable comment."""
    lines = code.splitlines()
    found = []
    for k, node in enumerate(ast.parse(code).body):
        if not isinstance(node, ast.Expr):
            continue
        last = lines[node.end_lineno - 1]
        if "#" not in last:
            continue
        column = last.index("#")
        comment = last[column + 1:]
        n = node.end_lineno  # comment-only lines with the "#" in the same column continue it
        while n < len(lines) and lines[n][:column].isspace() and lines[n][column:column + 1] == "#":
            comment += " " + lines[n][column + 1:]
            n += 1
        value = _leading_value(comment)
        if value is not None:
            found.append((k, value))
    return found


def _cases():
    for page in PAGES:
        for i, code in enumerate(_blocks(page)):
            if _claims(code):
                yield pytest.param(page, i, id=f"{page.relative_to(ROOT / 'docs')}[{i}]")


def _matches(got: str, claimed: str) -> bool:
    if "grad_fn=" not in claimed and "..." not in claimed:
        got = _GRAD_FN.sub("", got)
    got, claimed = re.sub(r"\s+", "", got), re.sub(r"\s+", "", claimed)
    pattern = ".*?".join(re.escape(part) for part in claimed.split("..."))
    return re.fullmatch(pattern, got) is not None


def test_every_docs_python_block_parses():
    bad = []
    for page in PAGES:
        for i, code in enumerate(_blocks(page)):
            try:
                ast.parse(code)
            except SyntaxError as e:
                bad.append(f"{page.relative_to(ROOT)}[{i}]: {e}")
    assert not bad, bad


def test_docs_snippets_name_only_what_the_package_has():
    missing = set()
    for page in [*PAGES, ROOT / "README.md"]:
        for code in _blocks(page):
            for mod, name in _ATTR.findall(code):
                if not hasattr(importlib.import_module(_MODULES.get(mod, mod)), name):
                    missing.add(f"{page.relative_to(ROOT)}: {mod}.{name}")
            for mod, names in _FROM.findall(code):
                module = importlib.import_module(mod)
                for name in names.strip("()").split(","):
                    name = name.split(" as ")[0].strip()
                    if name and not hasattr(module, name):
                        missing.add(f"{page.relative_to(ROOT)}: from {mod} import {name}")
    assert not missing, sorted(missing)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("page", "index"), list(_cases()))
def test_docs_snippet_prints_what_its_comments_claim(page, index):
    code = _blocks(page)[index]
    claims = dict(_claims(code))
    namespace: dict = {"__name__": "__docs__"}
    seen = []
    for k, node in enumerate(ast.parse(code).body):
        if k in claims:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                value = eval(compile(ast.Expression(node.value), str(page), "eval"), namespace)
            got = buf.getvalue().strip() if value is None else repr(value)
            seen.append((got, claims[k]))
        else:
            exec(compile(ast.Module([node], []), str(page), "exec"), namespace)
    wrong = [(got, claimed) for got, claimed in seen if not _matches(got, claimed)]
    assert len(seen) == len(claims) and not wrong, wrong
