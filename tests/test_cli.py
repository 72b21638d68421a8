"""The command line: trace, --help and argument errors (the demo: test_demo.py; bench: test_bench.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stablelosses import cli

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "stablelosses", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
    )


# ---- trace --------------------------------------------------------------------------------


def test_trace_finds_the_planted_overflow():
    script = os.path.join(SCRIPTS, "overflow.py")
    proc = run("trace", script)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    planted = next(i for i, ln in enumerate(open(script), 1) if "PLANTED" in ln)
    assert f"overflow.py:{planted}" in proc.stdout
    assert "aten::exp" in proc.stdout and "forward" in proc.stdout
    assert "module:   weighting" in proc.stdout
    assert "min=90" in proc.stdout


def test_trace_healthy_script_passes_args(capsys):
    # in process: runpy with sys.argv set and __name__ == '__main__'
    argv = list(sys.argv)
    status = cli.main(["trace", os.path.join(SCRIPTS, "healthy.py"), "--steps", "3"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "trained" in out and "no NaN/Inf created" in out
    assert sys.argv == argv


def test_trace_in_process_warn_mode_and_exit_code(capsys):
    script = os.path.join(SCRIPTS, "overflow.py")
    assert cli.main(["trace", script, "3"]) == 0  # stops before the overflow
    assert cli.main(["trace", "--warn", script, "12"]) == 1
    out = capsys.readouterr().out
    assert "distinct NaN/Inf creations" in out and "aten::exp" in out
    assert cli.main(["trace", "--allow", "exp", "--no-backward", "--no-nan", script, "12"]) == 0


def test_trace_missing_script(capsys):
    assert cli.main(["trace", "no/such/script.py"]) == 2
    assert "no such file" in capsys.readouterr().err


# ---- help and errors ----------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"], ["trace", "--help"], ["bench", "--help"]])
def test_help_in_process(args, capsys):
    assert cli.main(args) == 0
    assert "usage: stablelosses" in capsys.readouterr().out  # bench: its own parser's help


@pytest.mark.parametrize(
    "args, message",
    [
        (["frobnicate"], "invalid choice"),
        (["--nope"], "unrecognized arguments"),
        (["trace"], "required"),
        (["bench", "--device"], "expected one argument"),
        (["bench", "--json"], "expected one argument"),
        (["demo", "extra"], "unrecognized arguments"),
    ],
)
def test_bad_arguments_in_process(args, message, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err


def test_help_and_bad_arguments_subprocess():
    proc = run("trace", "--help")
    assert proc.returncode == 0 and "SCRIPT.py" in proc.stdout
    proc = run("--frobnicate")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "error" in proc.stderr
