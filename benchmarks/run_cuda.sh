#!/usr/bin/env bash
# One prepared GPU check, under 10 minutes in all (each step has its own time limit):
#   1. the CUDA unit tests (tests parametrized with the `device` fixture, id `cuda`),
#   2. no host sync inside any loss (torch.cuda.set_sync_debug_mode('error')),
#   3. `stablelosses bench --device cuda --compile` (compiled variants for forward+backward),
#   4. the pytest-benchmark suite on CUDA (eager variants, forward+backward),
#   5. benchmarks/check_targets.py on the bench JSON,
#   6. the Triton kernels: their tests natively on CUDA (tests/test_triton.py, graph capture and
#      sync-debug included) and benchmarks/bench_triton.py (torch eager, torch.compile, our torch
#      path, our kernels, Liger-Kernel's cross-entropy when its wheel is carried: put
#      liger_kernel-*.whl in bench-wheels/, the device machine reaches no registry).
# Writes logs and JSON into $OUT (default ./bench-results-cuda). Exit status: 1 if a step failed.
# Usage: benchmarks/run_cuda.sh        (PYTHON=... to pick the interpreter;
#        ONLY=triton for step 6 alone, under 4 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench-results-cuda}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # works without an installed package too
status=0
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS
    echo "== $name (limit ${secs}s)"
    timeout --signal=INT --kill-after=10 "$secs" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "== $name: exit $rc in $((SECONDS - t0))s"
    [ "$rc" -eq 0 ] || status=1
}

"$PY" - <<'PYEOF' | tee "$OUT/machine.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name())
PYEOF

ONLY="${ONLY:-all}"
if [ "$ONLY" != triton ]; then
step cuda_tests 140 "$PY" -m pytest -q tests -k cuda
step cuda_sync 45 "$PY" -m pytest -q benchmarks/test_cuda_sync.py
# SIGINT at the limit: the bench stops after the current case and still writes its JSON.
step bench_cuda 280 "$PY" -m stablelosses.bench --device cuda --compile --compile-modes fwdbwd --targets \
    --no-progress --json "$OUT/bench_cuda.json" --markdown "$OUT/bench_cuda.md"
STABLELOSSES_BENCH_COMPILE=0 STABLELOSSES_BENCH_ROUNDS=5 \
    step pytest_bench_cuda 60 "$PY" -m pytest -q benchmarks/test_bench_losses.py --benchmark-only \
    -k "cuda and fwdbwd" --benchmark-json "$OUT/pytest_bench_cuda.json"
fi
# The Triton kernels: a CUDA tests step of their own, then the kernel bench.
if ls bench-wheels/liger_kernel-*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-deps --no-index bench-wheels/liger_kernel-*.whl > "$OUT/liger_install.log" 2>&1 \
        || echo "== liger-kernel wheel did not install (see $OUT/liger_install.log)"
fi
step triton_cuda_tests 90 "$PY" -m pytest -q tests/test_triton.py -p no:randomly
step triton_bench 150 "$PY" benchmarks/bench_triton.py --json "$OUT/triton_bench.json" \
    --markdown "$OUT/triton_bench.md"
if [ -f "$OUT/bench_cuda.json" ]; then
    "$PY" benchmarks/check_targets.py "$OUT/bench_cuda.json" --markdown "$OUT/targets_cuda.md" \
        > "$OUT/targets_cuda.txt" 2>&1
    echo "== targets: exit $? (see $OUT/targets_cuda.txt)"
    grep -E '^(MISS|--)' "$OUT/targets_cuda.txt" | head -40
fi
exit $status
