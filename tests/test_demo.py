"""The demo (``python -m stablelosses``): every hazard, naive beside stable, a clean table."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from stablelosses import _demo, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXPECTED_HAZARDS = [
    "sqrt at 0", "RMSE", "b = 0", "z = [92, 1]", "fully masked", "logsumexp of all -inf",
    "log_softmax", "xlogy", "[[10, -200]]", "γ=0.5 at p_t", "sigmoid focal", "label smoothing",
    "kl_div", "log(cosh(x))", "float16 RMSE", "normalize a zero vector", "cosine similarity",
    "logaddexp(-inf, -inf)", "empty mask", "entropy", "Dice", "InfoNCE",
]

# A fresh install: torch and stablelosses, no numpy. The finder makes `import numpy` fail as it
# does when numpy is not installed, for the whole process (torch's C++ import included).
NO_NUMPY = textwrap.dedent("""
    import importlib.abc, runpy, sys

    class NoNumpy(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "numpy" or name.startswith("numpy."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoNumpy())
    sys.argv = ["stablelosses"]
    runpy.run_module("stablelosses", run_name="__main__")
    assert "numpy" not in sys.modules or sys.modules["numpy"] is None
""")


def run_python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="default")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env, check=False)


def test_demo_data_covers_every_hazard():
    names = [h.name for h in _demo.HAZARDS]
    assert len(names) == len(set(names)) == len(EXPECTED_HAZARDS)
    for part in EXPECTED_HAZARDS:
        assert sum(part in n for n in names) >= 1, part


@pytest.mark.parametrize("hazard", _demo.HAZARDS, ids=lambda h: h.name)
def test_demo_naive_fails_where_stable_is_finite(hazard):
    naive = _demo.evaluate(hazard, "naive")
    assert naive.error is None
    assert not naive.ok, f"the naive formula is fine: {naive.value_text} {naive.grad_text}"
    stable = _demo.evaluate(hazard, "stable")
    assert stable.error is None, stable.error
    assert stable.ok, f"{stable.value_text} {stable.grad_text}"


def test_demo_reports_an_exception_in_its_cell():
    def boom(*_):
        raise NotImplementedError("not there")

    h = _demo.Hazard("boom", lambda: (_demo._t(1.0),), boom, boom)
    res = _demo.evaluate(h, "stable")
    assert res.error == "NotImplementedError: not there" and not res.ok
    assert "error" in _demo.render([h]).splitlines()[2]


def test_demo_subprocess_prints_the_table_without_warnings():
    proc = run_python("-m", "stablelosses", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no torch warning, nothing else
    lines = proc.stdout.splitlines()
    header = lines[0]
    assert header.split()[:3] == ["hazard", "naive", "value"]
    col_stable = header.index("stable value")
    for h in _demo.HAZARDS:
        (row,) = [ln for ln in lines if ln.startswith(h.name)]
        naive_part, stable_part = row[:col_stable], row[col_stable:]
        assert "NaN/inf" in naive_part, row
        assert ("nan" in naive_part or "inf" in naive_part), row
        assert stable_part.rstrip().endswith("ok"), row
    # the columns line up: every row has its stable value where the header says
    for ln in lines[2:2 + len(_demo.HAZARDS)]:
        assert ln[col_stable - 2:col_stable] == "  "


def test_every_demo_column_has_a_header():
    lines = _demo.render().splitlines()
    header, rule = lines[0], lines[1]
    # the rule line has one dash run per column; each run starts under a header word
    starts = [i for i, c in enumerate(rule) if c == "-" and (i == 0 or rule[i - 1] == " ")]
    assert len(starts) == 7
    for i in starts:
        assert header[i] != " ", (i, header)
    assert "naive ok?" in header and "stable ok?" in header


def test_demo_without_numpy_prints_no_torch_warning():
    proc = run_python("-c", NO_NUMPY, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "NumPy" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    assert proc.stderr == ""
    n = len(_demo.HAZARDS)
    assert f"{n} of {n} stablelosses calls are finite" in proc.stdout


def test_demo_render_in_process(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert f"of {len(_demo.HAZARDS)} naive formulas give NaN/inf" in out
    assert cli.main(["demo"]) == 0
