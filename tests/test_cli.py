"""The command line: trace, --help and argument errors (the demo: test_demo.py; bench: test_bench.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from debug_helpers import line_of

from stablelosses import cli

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "stablelosses", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
    )


def run_code(code):
    """``python -c code`` in a fresh interpreter that imports this checkout's package."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))


# ---- trace --------------------------------------------------------------------------------


@pytest.mark.slow  # a fresh interpreter per run (torch import); the in-process tests cover the logic
def test_trace_finds_the_planted_overflow():
    script = os.path.join(SCRIPTS, "overflow.py")
    proc = run("trace", script)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    planted = line_of(script, "PLANTED")
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


@pytest.mark.slow  # a fresh interpreter per run (torch import); the in-process tests cover the logic
def test_trace_crash_exits_2_with_the_scripts_traceback():
    script = os.path.join(SCRIPTS, "crash.py")
    proc = run("trace", script)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no NaN/Inf was created before the crash" in proc.stdout
    crash = line_of(script, "# CRASH")
    assert f'File "{script}", line {crash}, in load' in proc.stderr
    assert proc.stderr.strip().endswith("KeyError: 'missing'")
    assert "cli.py" not in proc.stderr and "runpy" not in proc.stderr and "_trace.py" not in proc.stderr


def test_trace_does_not_pass_a_script_that_died_of_skipped_steps_error(capsys):
    # SkippedStepsError is a NonFiniteError, but not one the detector raised: it is a crash
    script = os.path.join(SCRIPTS, "crash.py")
    assert cli.main(["trace", script, "guard"]) == 2
    out, err = capsys.readouterr()
    assert "no NaN/Inf created" not in out
    assert "SkippedStepsError" in err and "2 optimizer steps skipped" in err


def test_trace_script_crashing_for_another_reason_exits_2_not_1(capsys):
    # 1 means "NaN/Inf found": a ValueError before any tensor op is a crash, reported as one
    script = os.path.join(SCRIPTS, "crash.py")
    assert cli.main(["trace", script, "config"]) == 2
    out, err = capsys.readouterr()
    assert "crash.py crashed (ValueError, traceback above)" in out
    assert "no NaN/Inf was created before the crash" in out
    assert f'File "{script}", line {line_of(script, "# CONFIG")}, in <module>' in err
    assert err.strip().endswith("ValueError: bad config file")


@pytest.mark.parametrize("how, thread", [("pool", "loader_0"), ("sub", "feeder")])
def test_trace_reports_a_nan_made_in_a_worker_thread_naming_it(how, thread, capsys):
    script = os.path.join(SCRIPTS, "thread_nan.py")
    assert cli.main(["trace", script, how]) == 1
    out = capsys.readouterr().out
    assert "done" in out and "no NaN/Inf created" not in out  # the script ran on; no all-clear
    assert f"NaN/Inf created in thread '{thread}' of {script}" in out
    assert "aten::log produced NaN" in out and f"thread_nan.py:{line_of(script, '# WORKER')}" in out


def test_trace_all_clear_says_which_threads_were_watched(capsys):
    assert cli.main(["trace", os.path.join(SCRIPTS, "thread_nan.py"), "clean"]) == 0
    out = capsys.readouterr().out
    assert "no NaN/Inf created" in out and "watched: the main thread and the 1 thread it started" in out
    assert cli.main(["trace", os.path.join(SCRIPTS, "healthy.py"), "--steps", "3"]) == 0
    assert "(watched: the main thread;" in capsys.readouterr().out


def test_trace_hint_recommends_watch_only_when_it_can_help(capsys):
    # finite to inf in one step: --watch would print the same report, so it is not recommended
    script = os.path.join(SCRIPTS, "jump.py")
    assert cli.main(["trace", script]) == 1
    out = capsys.readouterr().out
    assert "the run is diverging" in out and "--watch" in out.split("hint:")[1]
    assert "trace --watch" not in out and "too fast for `--watch`" in out
    assert cli.main(["trace", "--watch", script]) == 1
    out = capsys.readouterr().out
    assert "trace --watch" not in out and "`--watch` was on and did not stop it" in out
    # a loss that grew over steps first: --watch stops it while finite, so it is recommended
    assert cli.main(["trace", os.path.join(SCRIPTS, "diverge.py")]) == 1
    out = capsys.readouterr().out
    assert "the run is diverging" in out and "`stablelosses trace --watch SCRIPT.py`" in out


def test_trace_passes_the_scripts_exit_code(capsys):
    script = os.path.join(SCRIPTS, "crash.py")
    assert cli.main(["trace", script, "exit", "3"]) == 3
    assert cli.main(["trace", script, "exit", "0"]) == 0
    capsys.readouterr()


def test_trace_reports_a_nan_made_inside_stablelosses(capsys):
    script = os.path.join(SCRIPTS, "library_nan.py")
    assert cli.main(["trace", script]) == 1
    out = capsys.readouterr().out
    line = line_of(script, "# LIBRARY")
    assert "stablelosses.functional.cross_entropy produced NaN" in out and "0/0" in out
    assert f"library_nan.py:{line}" in out


@pytest.mark.slow  # a fresh interpreter per run (torch import); the in-process tests cover the logic
def test_trace_watch_stops_a_diverging_run_before_inf():
    script = os.path.join(SCRIPTS, "diverge.py")
    proc = run("trace", "--watch", script)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the run diverged" in proc.stdout and "at step 2" in proc.stdout
    assert "net.0 (BatchNorm2d)" in proc.stdout and "16 values per channel" in proc.stdout
    assert "lr 0.3" in proc.stdout  # the optimizer was found from its first step
    assert "step 3: loss" not in proc.stdout  # stopped inside step 3's backward
    assert "inf" not in proc.stdout.split("the run diverged")[0]
    # without --watch the same script is only caught once a value is infinite
    plain = run("trace", script)
    assert plain.returncode == 1 and "first NaN/Inf created" in plain.stdout
    assert "the run is diverging" in plain.stdout and "trace --watch" in plain.stdout
    assert "step 3: loss" in plain.stdout


def test_trace_watch_healthy_script_exits_0(capsys):
    import torch

    backward = torch.Tensor.backward
    assert cli.main(["trace", "--watch", os.path.join(SCRIPTS, "healthy.py"), "--steps", "3"]) == 0
    assert "no NaN/Inf created" in capsys.readouterr().out
    assert torch.Tensor.backward is backward  # put back


# ---- help and errors ----------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["trace", "--help"], ["bench", "--help"]])
def test_help_and_version_import_no_torch(args):
    # as `python -m stablelosses ARGS` runs (runpy), then which modules got imported
    code = ("import runpy, sys\n"
            f"sys.argv = ['stablelosses', *{args!r}]\n"
            "try:\n    runpy.run_module('stablelosses', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "print('\\nTORCH' if 'torch' in sys.modules else '\\nNO TORCH')\n")
    proc = run_code(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("NO TORCH"), proc.stdout[-300:]
    assert ("stablelosses 0.2" in proc.stdout) == (args == ["--version"])


def test_the_package_loads_torch_on_first_use_of_a_public_name():
    code = ("import sys, stablelosses as sl\n"
            "before = 'torch' in sys.modules\n"
            "f = sl.safe_sqrt\n"
            "print(before, 'torch' in sys.modules, f.__module__, sl.debug.__name__, 'CrossEntropyLoss' in dir(sl))\n"
            "try:\n    sl.no_such_name\nexcept AttributeError as e:\n    print(e)\n")
    proc = run_code(code)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    assert first.split()[:2] == ["False", "True"] and first.split()[3:] == ["stablelosses.debug", "True"]
    assert second == "module 'stablelosses' has no attribute 'no_such_name'"


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"], ["trace", "--help"], ["bench", "--help"]])
def test_help_in_process(args, capsys):
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "usage: stablelosses" in out  # bench: its own parser's help
    assert "issue" not in out.lower()  # options are named by what they do


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


@pytest.mark.slow  # a fresh interpreter per run (torch import); the in-process tests cover the logic
def test_help_and_bad_arguments_subprocess():
    proc = run("trace", "--help")
    assert proc.returncode == 0 and "SCRIPT.py" in proc.stdout
    proc = run("--frobnicate")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "error" in proc.stderr
