"""README's python snippets run as written and print what their comments claim.

Every ``print(expr)  # text`` line in a fenced ``python`` block is checked: ``str(expr)`` must
equal ``text``. The blocks run in order, each in a fresh namespace.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
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


def _readme() -> str:
    return README.read_text(encoding="utf-8")


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled:UserWarning")
@pytest.mark.filterwarnings("ignore:Error detected in:UserWarning")
def test_readme_headline_is_what_torch_prints_for_the_readmes_own_example():
    import torch
    import torch.nn as nn

    text = _readme()
    (line,) = [ln for ln in _blocks()[0].splitlines() if ln.startswith("torch.sqrt(nn.MSELoss()")]
    x = torch.zeros(4, requires_grad=True)
    with torch.autograd.detect_anomaly(check_nan=True):
        try:
            exec(line.split("#")[0], {"torch": torch, "nn": nn, "x": x})
        except RuntimeError as e:
            printed = str(e).splitlines()[0]
        else:  # pragma: no cover - the README's example must fail under anomaly mode
            raise AssertionError("the README's example raised no anomaly")
    headline = text.split("```\n", 2)[1].strip()
    assert headline == f"RuntimeError: {printed}"


def test_readme_says_clone_and_venv_before_any_install():
    text = _readme()
    first_pip = text.index("pip install")
    assert text.index("git clone") < first_pip and text.index("python3 -m venv .venv") < first_pip
    assert 'pip install -e ".[fix]"' in text and '"stablelosses[fix]"' not in text


def test_readme_quick_subset_names_existing_files_and_skips_slow_tests():
    (cmd,) = [ln for ln in _readme().splitlines() if ln.startswith('pytest -m "not slow" ')]
    files = cmd.split()[4:]
    assert files and all((README.parent / f).is_file() for f in files), files


def test_readme_cross_entropy_row_says_label_smoothing_over_inf_differs_and_by_how_much():
    import torch
    import torch.nn.functional as F

    import stablelosses.functional as SF

    (row,) = [ln for ln in _readme().splitlines() if ln.startswith("| `nn.CrossEntropyLoss(...)`")]
    what = row.split(" | ")[2]
    assert not what.startswith("nothing") and "label smoothing" in what and "ε/C" in what
    x, t = torch.tensor([[2.0, -math.inf, 0.5]]), torch.tensor([0])
    assert "`[[2, -inf, 0.5]]`, target 0, `label_smoothing=0.1`" in what  # the inputs below
    ours = SF.cross_entropy(x, t, label_smoothing=0.1)
    theirs = F.cross_entropy(x, t, label_smoothing=0.1)
    assert f"give {ours.item():.4f} where torch gives `{theirs.item()}`" in what


@pytest.mark.slow  # collects the whole suite (about 20 s on an idle machine)
def test_readme_test_count_is_about_right():
    got = re.search(r"about ([\d,]+) tests", _readme())
    assert got, "the README gives the test suite's size"
    said = int(got.group(1).replace(",", ""))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=README.parent, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    n = int(re.search(r"(\d+) tests? collected", proc.stdout).group(1))
    assert 0.8 * n <= said <= 1.2 * n, (said, n)
