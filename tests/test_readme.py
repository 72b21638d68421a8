"""README's python snippets run as written and print what their comments claim.

Every ``print(expr)  # text`` line in a fenced ``python`` block is checked: ``str(expr)`` must
equal ``text``. The blocks run in order, each in a fresh namespace.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
_PRINT = re.compile(r"^(\s*)print\((.*)\)\s+#\s*(.*?)\s*$")


def _blocks() -> list[str]:
    return _BLOCK.findall(README.read_text(encoding="utf-8"))


def _instrument(code: str) -> tuple[str, int]:
    """Turn ``print(expr)  # text`` into a check of ``str(expr) == text``; count them."""
    lines, checks = [], 0
    for line in code.splitlines():
        m = _PRINT.match(line)
        if m:
            indent, expr, text = m.groups()
            lines.append(f"{indent}__check({expr}, {text!r})")
            checks += 1
        else:
            lines.append(line)
    return "\n".join(lines), checks


def test_readme_has_python_snippets():
    assert len(_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_snippet_runs_and_prints_what_it_claims(index):
    code, checks = _instrument(_blocks()[index])
    seen: list[tuple[str, str]] = []

    def check(value, text):
        seen.append((str(value), text))

    namespace = {"__check": check, "__name__": "__readme__"}
    exec(compile(code, f"README.md[python block {index}]", "exec"), namespace)
    assert len(seen) == checks > 0, "every print runs and carries its expected output"
    for got, claimed in seen:
        assert got == claimed
