#!/usr/bin/env bash
# One prepared GPU run of the Triton kernels, at most 8 minutes on one H100, with no network.
#   1. kernel_tests: tests/test_triton.py natively on CUDA (values, gradients, hazards, half
#      precision against the torch path; the CUDA-graph capture and sync-debug test),
#   2. cuda_tests: every other test parametrized on the `device` fixture with id `cuda`, and
#      benchmarks/test_cuda_sync.py (no host sync in the torch path of any loss),
#   3. bench: benchmarks/bench_triton.py --checks: no host sync in any kernel's forward and
#      backward (torch.cuda.set_sync_debug_mode("error")), a CUDA-graph capture of each kernel
#      replaying to the eager values, an out-of-range target as a device-side assert, then
#      cross-entropy fwd+bwd in bf16 at 8192x32000 and 8192x128256 (torch eager, torch.compile,
#      our torch path, our kernels, Liger-Kernel) and the softmax family at 8192x4096.
# Writes $OUT/cuda_run.json (one JSON: the machine, each step's exit status, time and summary,
# and the benchmark rows and checks) beside the step logs. Exit status 1 if a step failed.
#
# The device machine reaches no registry: Liger-Kernel travels as a wheel. Here, once:
#   python3 -m pip download --no-deps --only-binary=:all: -d bench-wheels liger-kernel==0.8.5
# (bench-wheels/ is git-ignored; name it in the device run's `carry`). Every *.whl there is
# installed offline into a private folder on the device, nothing else is touched.
# Usage: benchmarks/run_cuda.sh        (PYTHON=... picks the interpreter; default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench-results-cuda}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
if ls bench-wheels/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/sl-bench-wheels \
        bench-wheels/*.whl > "$OUT/wheels.log" 2>&1 || echo "== carried wheels did not install (see wheels.log)"
    export PYTHONPATH="/tmp/sl-bench-wheels${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"  # works without an installed package too
status=0
: > "$OUT/steps.tsv"
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS
    echo "== $name (limit ${secs}s)"
    timeout --signal=INT --kill-after=10 "$secs" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 15 "$OUT/$name.log"
    echo "== $name: exit $rc in $((SECONDS - t0))s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/$name.log")" >> "$OUT/steps.tsv"
    [ "$rc" -eq 0 ] || status=1
}

step kernel_tests 140 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton.py
step cuda_tests 100 "$PY" -m pytest -q -p no:cacheprovider tests -k "cuda and not test_triton" -m "not slow"
if [ -f benchmarks/test_cuda_sync.py ]; then  # the torch path's own no-host-sync check
    step torch_path_sync 40 "$PY" -m pytest -q -p no:cacheprovider benchmarks/test_cuda_sync.py
fi
step bench 190 "$PY" benchmarks/bench_triton.py --checks --json "$OUT/bench.json"

"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys

import torch

out = pathlib.Path(sys.argv[1])
run = {"torch": torch.__version__, "cuda": torch.version.cuda,
       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "steps": {}}
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, secs, last = line.split("\t", 3)
    run["steps"][name] = {"exit": int(rc), "seconds": int(secs), "last_line": last}
bench = out / "bench.json"
run["bench"] = json.loads(bench.read_text()) if bench.exists() else None
(out / "cuda_run.json").write_text(json.dumps(run, indent=1))
print("wrote", out / "cuda_run.json")
PYEOF
exit $status
