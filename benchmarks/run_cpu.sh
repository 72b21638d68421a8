#!/usr/bin/env bash
# CPU benchmarks with a warm allocator: the pytest-benchmark suite (default subset; set
# STABLELOSSES_BENCH_FULL=1 for the full grid) and `stablelosses bench`, then the target check.
# Results go to $OUT (default: ./bench-results). Usage: benchmarks/run_cpu.sh [--compile]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench-results}"
mkdir -p "$OUT"
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-4294967296}"
export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-68719476736}"
export MALLOC_TOP_PAD_="${MALLOC_TOP_PAD_:-268435456}"
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" -m stablelosses.bench "$@" --json "$OUT/bench_cpu.json" --markdown "$OUT/bench_cpu.md" \
    | tee "$OUT/bench_cpu.txt"
"$PY" -m pytest benchmarks/test_bench_losses.py --benchmark-only -q -k cpu \
    --benchmark-json "$OUT/pytest_bench_cpu.json" > "$OUT/pytest_bench_cpu.txt" 2>&1
tail -3 "$OUT/pytest_bench_cpu.txt"
"$PY" benchmarks/check_targets.py "$OUT/bench_cpu.json" --markdown "$OUT/targets_cpu.md" --quiet
