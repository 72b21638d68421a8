"""Settings shared by the benchmark suites in ``benchmarks/``.

Run them with ``pytest benchmarks/ --benchmark-only`` (they are not collected by a plain
``pytest``: ``testpaths`` is ``tests`` and ``stablelosses``). ``benchmarks/run_cpu.sh`` does that
with the environment below set.

* ``torch.set_num_threads(2)`` (``STABLELOSSES_BENCH_THREADS`` to change it), the thread count
  the targets are stated for.
* The allocator: CPU timings of large fresh buffers swing with page faults whenever glibc hands
  freed memory back to the kernel. Start the process with ``MALLOC_MMAP_THRESHOLD_``,
  ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_TOP_PAD_`` set high (the values are
  ``stablelosses.bench.memory.MALLOC_ENV``); glibc reads them at start-up, so they cannot be set from
  here. The header of the run says whether they are set; ``stablelosses bench`` sets them
  itself by re-executing.
  With them set, 1 GiB of heap is touched once at session start so that first calls of a
  shape do not fault while the heap grows.
* ``STABLELOSSES_BENCH_FULL=1`` runs the full grid (all shapes, float32 and bfloat16, compiled
  variants in both modes); the default is a modest subset.
* At the end of the session the speed targets table (each target with its measured ratio,
  bytes-moved ratio and met / missed) is printed from the benchmarks that ran
  (``benchmarks/check_targets.py`` prints the same table from ``--benchmark-json``).
* Display: pytest-benchmark's tables are split per function *and* input (group ``focal_loss``,
  case ``focal_loss-8192x1000-float32-cpu``, test ``test_fwd``/``test_fwdbwd``), so the variants
  that compete sit in one table. ``--benchmark-group-by`` still overrides this.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict

import pytest
import torch

from stablelosses.bench.memory import MALLOC_ENV, prefault_heap

THREADS = int(os.environ.get("STABLELOSSES_BENCH_THREADS", "2"))
torch.set_num_threads(THREADS)


def pytest_sessionstart(session):
    # Touch 1 GiB of heap once: with MALLOC_ENV set it stays in the heap, warm.
    if all(k in os.environ for k in MALLOC_ENV):
        prefault_heap("cpu")


def pytest_configure(config):
    # torch.compile's own deprecation warnings (torch.jit internals) are not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:torch")
    config.addinivalue_line("filterwarnings", "ignore::FutureWarning:torch")


def pytest_report_header(config):
    missing = [k for k in MALLOC_ENV if k not in os.environ]
    lines = [
        f"stablelosses benchmarks: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"full grid: {os.environ.get('STABLELOSSES_BENCH_FULL') == '1'}, "
        f"CUDA: {torch.cuda.is_available()}"
    ]
    if missing:
        env = " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items())
        lines.append(
            "WARNING: allocator environment not set (" + ", ".join(missing) + "): large-buffer "
            f"CPU timings will include page faults. Run as: {env} pytest benchmarks/ "
            "--benchmark-only  (or benchmarks/run_cpu.sh)"
        )
    return lines


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    mod = sys.modules.get("test_bench_losses") or sys.modules.get("benchmarks.test_bench_losses")
    records = getattr(mod, "RECORDS", None)
    if not records:
        return
    from targets import format_goals, goal_rows

    from stablelosses.bench.report import index

    terminalreporter.write_sep("-", "speed targets (float32, fwd+bwd unless the mode says fwd)")
    terminalreporter.write_line(format_goals(goal_rows(index(records))))


@pytest.hookimpl(hookwrapper=True)
def pytest_benchmark_group_stats(config, benchmarks, group_by):
    outcome = yield
    if group_by != "group":
        return
    groups = defaultdict(list)
    for bench in benchmarks:
        params = bench.get("params") or {}
        key = " ".join(str(p) for p in (bench["group"], params.get("case"),
                                        bench["name"].split("[")[0]) if p)
        groups[key].append(bench)
    for items in groups.values():
        items.sort(key=lambda b: b["name"])
    outcome.force_result(sorted(groups.items(), key=lambda kv: kv[0]))
