"""pytest-benchmark suites: stablelosses against the built-ins, the naive formulas and kornia.

One group per function (``benchmark.group``); parametrized over ``case`` =
function-shape-dtype-device and ``variant`` (ids ``torch``, ``naive``, ``stable``, ``kornia``,
``one-pass``, ``<variant>-compiled``); ``test_fwd`` times the forward, ``test_fwdbwd`` forward
plus ``torch.autograd.grad``. The registry (inputs, baselines, shapes) is the one of
``stablelosses bench`` (``stablelosses/bench/cases.py``), so both report the same things.

Compiled variants are built and warmed up before the timed calls. ``extra_info`` holds, for
``benchmarks/check_targets.py`` (which prints the speed targets table from it): the bytes moved
by one call (``bytes_read``, ``bytes_written``, ``aten_ops``; eager variants), the kernel count
of a compiled variant (``kernels``, ``kernels_generated``, ``kernels_extern``) and the peak
memory of one forward+backward (``peak_bytes``, with ``grad_bytes``, the size of the gradient).

Environment: ``STABLELOSSES_BENCH_FULL=1`` for the full grid (adds the LLM-vocabulary and
segmentation shapes, 1e7-element inputs everywhere, bfloat16); ``STABLELOSSES_BENCH_COMPILE=0``
to leave out compiled variants (default: compiled variants of float32, non-tiny inputs, in
``test_fwdbwd``; the full grid compiles everything).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from stablelosses.bench import cases as C
from stablelosses.bench import timing as T
from stablelosses.bench.memory import peak_memory
from stablelosses.bench.run import Settings, extras, input_sizes, selected

FULL = os.environ.get("STABLELOSSES_BENCH_FULL") == "1"
COMPILE = os.environ.get("STABLELOSSES_BENCH_COMPILE", "1") != "0"
TIER = "full" if FULL else "default"
ROUNDS = int(os.environ.get("STABLELOSSES_BENCH_ROUNDS", "7"))
SAMPLE_S = 0.02
DTYPES = ("float32", "bfloat16") if FULL else ("float32",)
HAS_CUDA = torch.cuda.is_available()
#: One record per benchmark of the session, in `stablelosses bench`'s JSON format: conftest.py
#: prints the speed targets table from them at the end of the session.
RECORDS: list[dict[str, Any]] = []


#: case id ("fn-label-dtype-device") → (spec, case, dtype, device)
CASES: dict[str, tuple[C.Spec, C.Case, str, str]] = {}


def _cases(mode: str) -> list[Any]:
    params = []
    for spec, case, dt in selected(Settings(tier=TIER, dtypes=DTYPES)):
        for dev in ("cpu", "cuda"):
            cid = f"{spec.name}-{case.label}-{dt}-{dev}"
            CASES[cid] = (spec, case, dt, dev)
            compiled = COMPILE and (FULL or (mode == "fwdbwd" and dt == "float32" and case.kind != "tiny"))
            for v in T.variant_ids(spec, compiled=compiled, only_available=False):
                marks = []
                if dev == "cuda" and not HAS_CUDA:
                    marks.append(pytest.mark.skip(reason="needs CUDA"))
                params.append(pytest.param(cid, v, marks=marks, id=f"{cid}-{v}"))
    return params


_INPUTS: dict[str, Any] = {}


def _inputs(cid: str):
    if cid not in _INPUTS:
        _INPUTS.clear()  # parameters come case by case: keep one case's tensors alive
        spec, case, dt, dev = CASES[cid]
        _INPUTS[cid] = C.make_inputs(spec, case, C.DTYPES[dt], dev)
    return _INPUTS[cid]


def _run(benchmark, cid: str, variant: str, mode: str):
    spec, case, dt, dev = CASES[cid]
    fn = spec.name
    if not T.available(variant):
        pytest.skip(f"{variant}: optional package not installed")
    tensors, grad_idx = _inputs(cid)
    key = (case.label, dt, dev)
    call = T.make_callable(spec, variant, tensors, grad_idx, mode, dev, key)
    inner = T.calibrate(T.timer(call, fn, cid, variant), SAMPLE_S, warm_s=0.1, min_warm=3)
    benchmark.group = fn
    benchmark.extra_info.update(
        fn=fn, case=case.label, dtype=dt, device=dev, mode=mode, variant=variant, shape=list(case.shape),
        **input_sizes(tensors, grad_idx), threads=torch.get_num_threads(), torch_version=torch.__version__,
    )
    result = benchmark.pedantic(call, rounds=ROUNDS, iterations=inner, warmup_rounds=1)
    benchmark.extra_info.update(extras(spec, variant, mode, key, call))
    if mode == "fwdbwd":
        benchmark.extra_info["peak_bytes"] = peak_memory(call, dev)
    if benchmark.stats is not None:  # None under --benchmark-disable
        RECORDS.append(dict(benchmark.extra_info, median_s=benchmark.stats.stats.median, error=None,
                            kind=case.kind))
    if variant.startswith("stable"):
        outs = result if isinstance(result, tuple) else (result,)
        for o in outs:
            assert torch.isfinite(o).all(), f"{fn} {variant}: non-finite result"


@pytest.mark.parametrize("case,variant", _cases("fwd"))
def test_fwd(benchmark, case, variant):
    _run(benchmark, case, variant, "fwd")


@pytest.mark.parametrize("case,variant", _cases("fwdbwd"))
def test_fwdbwd(benchmark, case, variant):
    _run(benchmark, case, variant, "fwdbwd")
