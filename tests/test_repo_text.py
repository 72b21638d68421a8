"""The repository refers to no document outside it: no issue numbers, no "DESIGN principle N".

The contract is docs/design.md, cited by section name ("design: Exact tails"); work items live
in the tracker, not in comments, docstrings, help texts or pages.
"""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREES = ("stablelosses", "docs", "benchmarks", "tests", ".ci")
FILES = ("README.md", "mkdocs.yml", "pyproject.toml")
SUFFIXES = (".py", ".md", ".yml", ".toml", ".csv", ".sh", ".cfg", ".txt", "run")
# "issue 12", "issue-12", "Issue #9"; "DESIGN" / "DESIGN.md" (the old contract's name); "principle 8"
OUTSIDE = re.compile(r"(?i:\bissues?[- ]?#?\d+)|\bDESIGN\b|(?i:\bprinciple \d+)")

# Files another change is rewriting at the time of writing, with the number of such references
# they still hold. Remove an entry when its file is fixed (the test fails while it is stale).
PENDING: dict[str, int] = {}


def _files():
    for tree in TREES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, tree)):
            dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "figures")]
            for name in filenames:
                if name.endswith(SUFFIXES):
                    yield os.path.join(dirpath, name)
    for name in FILES:
        yield os.path.join(ROOT, name)


def _hits(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    # this file names the patterns it looks for; test_bench/test_cli assert their absence
    return [m.group(0) for m in OUTSIDE.finditer(text) if not _is_negative_check(text, m)]


def _is_negative_check(text, m):
    line = text[text.rfind("\n", 0, m.start()) + 1:text.find("\n", m.end())]
    return "not in" in line


def test_no_reference_to_a_document_outside_the_repo():
    found = {}
    for path in _files():
        if not os.path.isfile(path) or os.path.samefile(path, __file__):
            continue
        hits = _hits(path)
        if hits:
            found[os.path.relpath(path, ROOT).replace(os.sep, "/")] = hits
    unexpected = {p: h for p, h in found.items() if len(h) != PENDING.get(p, 0)}
    assert unexpected == {}, "cite docs/design.md by section name instead: " + repr(unexpected)
    fixed = [p for p in PENDING if p not in found]
    assert fixed == [], f"no longer hold a reference: drop them from PENDING: {fixed}"


def _pyproject_floor() -> tuple[str, str]:
    """(torch floor, Python floor) as pyproject.toml states them."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    torch = re.search(r'^dependencies = \[[^\]]*"torch>=([\d.]+)"', text, re.M)
    python = re.search(r'^requires-python = ">=([\d.]+)"', text, re.M)
    assert torch and python, "pyproject.toml names the torch and Python floors"
    return torch.group(1), python.group(1)


def test_docs_home_install_section_matches_pyproject_and_gets_the_cpu_torch_first():
    torch_floor, python_floor = _pyproject_floor()
    with open(os.path.join(ROOT, "docs", "index.md"), encoding="utf-8") as f:
        page = f.read()
    install = page[page.index("## Install"):page.index("\n## ", page.index("## Install") + 1)]
    said_torch = re.findall(r"torch >= ([\d.]+)", install)
    said_python = re.findall(r"Python ([\d.]+) or newer", install)
    assert said_torch == [torch_floor] and said_python == [python_floor], (said_torch, said_python)
    cpu = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in install and install.index(cpu) < install.index("pip install .")


def test_docs_math_is_rendered_at_build_time_without_a_script():
    import importlib.util

    import pytest

    pytest.importorskip("latex2mathml")
    spec = importlib.util.spec_from_file_location("_math_hook", os.path.join(ROOT, "docs", "math_hook.py"))
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    html = ('<p>a <span class="arithmatex">\\(x &lt; \\sqrt{y}\\)</span> b</p>'
            '<div class="arithmatex">\\[\\frac{1}{2}\\]</div>')
    out = hook.render(html)
    assert "arithmatex" not in out and out.count("<math") == 2 and "<msqrt>" in out and "<mfrac>" in out
    assert 'display="block"' in out and "<mo>&#x0003C;</mo>" in out  # the &lt; unescaped, then encoded
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        config = f.read()
    assert "docs/math_hook.py" in config and "mathjax" not in config.lower()
    assert not re.search(r"^\s*- https?://", config, re.M)  # no script or stylesheet from a CDN


def test_no_control_characters_in_the_text():
    # a docstring written with escapes read as control characters ("\b" of "\bigl", "\t" of
    # "\top") renders its formula broken; tabs are no indentation here either
    bad = []
    for path in _files():
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if re.search(r"[\x00-\x08\x0b-\x1f\x7f]", line.rstrip("\r\n")) or "\t" in line:
                    bad.append(f"{os.path.relpath(path, ROOT)}:{n}")
    assert not bad, bad
