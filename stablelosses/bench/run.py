"""One benchmark run: every (function, shape, dtype) of a tier, every variant and mode.

`run` returns a JSON-able dict (``schema``, ``machine``, ``settings``, ``results``, ``notes``,
``describe``); one record per (function, case, dtype, device, mode, variant) holds the median
time, the time of each interleaved round, the bytes moved (`stablelosses.bench.traffic`), the
peak memory of forward+backward and, for compiled variants, the kernel count.
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stablelosses.bench.cases import DTYPES, Case, Spec, make_inputs, specs
from stablelosses.bench.memory import MALLOC_ENV, peak_memory, prefault_heap
from stablelosses.bench.timing import interleaved, kernel_count, make_callable, variant_ids
from stablelosses.bench.traffic import bytes_moved

__all__ = ["MODES", "SCHEMA", "TIERS", "Settings", "extras", "input_sizes", "run", "run_case", "selected",
           "tier_settings"]

SCHEMA = "stablelosses-bench/2"
MODES = ("fwd", "fwdbwd")
TIERS = ("quick", "default", "full")


@dataclass
class Settings:
    """What one run measures and how long it samples."""

    tier: str = "default"
    device: str = "cpu"
    compile: bool = False
    dtypes: tuple[str, ...] = ("float32",)
    modes: tuple[str, ...] = MODES
    compile_modes: tuple[str, ...] | None = None  # modes with compiled variants (None: all)
    only: tuple[str, ...] | None = None
    repeats: int = 9
    sample_s: float = 0.04
    warm_s: float = 0.2
    min_warm: int = 5
    peak: bool = True
    bytes: bool = True
    prefault_mb: int | None = None  # heap touched before the run (None: 1024 MiB, or the environment's)


def tier_settings(tier: str) -> dict[str, Any]:
    """Repeats and sample lengths of a tier."""
    if tier == "quick":  # a smoke run: its inputs are small (the largest buffers are a few MiB)
        return {"repeats": 3, "sample_s": 0.004, "warm_s": 0.01, "min_warm": 1, "prefault_mb": 128}
    return {"repeats": 9, "sample_s": 0.04, "warm_s": 0.2, "min_warm": 5}


def selected(settings: Settings) -> list[tuple[Spec, Case, str]]:
    """(spec, case, dtype) triples of the run, in order."""
    out = []
    for spec in specs().values():
        if settings.only and spec.name not in settings.only:
            continue
        for case in spec.cases:
            if settings.tier not in case.tiers:
                continue
            out += [(spec, case, dt) for dt in settings.dtypes if dt == "float32" or case.kind != "tiny"]
    return out


def short_error(e: BaseException) -> str:
    """``Type: first line`` of an exception, at most 200 characters."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:200]


def _check_values(a: Any, b: Any, dtype: torch.dtype) -> str | None:
    """None when the two forward outputs agree (loosely: this is a sanity check)."""
    a, b = a.float(), b.float()
    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    if not torch.allclose(a, b, rtol=tol, atol=tol, equal_nan=True):
        return f"max abs diff {float((a - b).abs().max()):.3g}"
    return None


def input_sizes(tensors: Sequence[Any], grad_idx: Sequence[int]) -> dict[str, int]:
    """``grad_bytes`` (the tensors that get a gradient) and ``input_bytes`` (all) of one input."""
    return {"grad_bytes": sum(tensors[i].numel() * tensors[i].element_size() for i in grad_idx),
            "input_bytes": sum(t.numel() * t.element_size() for t in tensors)}


def extras(spec: Spec, v: str, mode: str, key: tuple[Any, ...], call: Callable[[], Any],
           measure_bytes: bool = True) -> dict[str, Any]:
    """Bytes moved (eager variants, when ``measure_bytes``) and kernel count (compiled)."""
    rec: dict[str, Any] = {}
    compiled = v.endswith("-compiled")
    if measure_bytes and not compiled:
        moved = bytes_moved(call)
        rec.update(bytes_read=moved.read, bytes_written=moved.written, aten_ops=moved.ops)
    kc = kernel_count(spec, v, mode, key) if compiled else None
    if kc is not None:
        rec.update(kernels=kc.total, kernels_generated=kc.generated, kernels_extern=kc.extern)
    return rec


def run_case(spec: Spec, case: Case, dtype_name: str, settings: Settings,
             records: list[dict[str, Any]], notes: list[str]) -> None:
    """Measure every variant of one (spec, case, dtype) in every mode; append the records."""
    tensors, grad_idx = make_inputs(spec, case, DTYPES[dtype_name], settings.device)
    base = {"fn": spec.name, "case": case.label, "kind": case.kind, "shape": list(case.shape),
            "dtype": dtype_name, "device": settings.device, **input_sizes(tensors, grad_idx)}
    key = (tuple(case.shape), dtype_name, settings.device)
    where = f"{spec.name} {case.label} {dtype_name}"
    for mode in settings.modes:
        compiled = settings.compile and (settings.compile_modes is None or mode in settings.compile_modes)
        calls: dict[str, Callable[[], Any]] = {}
        errors: dict[str, str] = {}
        for v in variant_ids(spec, compiled):
            try:
                calls[v] = make_callable(spec, v, tensors, grad_idx, mode, settings.device, key)
            except Exception as e:  # noqa: BLE001 - a failing variant is reported, the run goes on
                errors[v] = short_error(e)
        times = interleaved(calls, spec.name, f"{case.label} {dtype_name} {mode}", settings.repeats,
                            settings.sample_s, settings.warm_s, settings.min_warm)
        mismatch = None
        if mode == "fwd" and spec.check_ref in calls and "stable" in calls:
            mismatch = _check_values(calls["stable"](), calls[str(spec.check_ref)](), DTYPES[dtype_name])
            if mismatch:
                notes.append(f"{where}: stable differs from {spec.check_ref}: {mismatch}")
        for v in variant_ids(spec, compiled):
            rec: dict[str, Any] = dict(base, mode=mode, variant=v)
            if v in errors:
                rec.update(error=errors[v], median_s=None, times_s=[], inner=0)
            else:
                m = times[v]
                rec.update(error=None, median_s=m.median, times_s=list(m.times), inner=m.number_per_run)
                rec.update(extras(spec, v, mode, key, calls[v], settings.bytes))
                if settings.peak and mode == "fwdbwd":
                    try:
                        rec["peak_bytes"] = peak_memory(calls[v], settings.device)
                    except RuntimeError as e:
                        notes.append(f"{where} {v}: peak memory failed: {short_error(e)}")
            if v == "stable" and mismatch:
                rec["value_mismatch"] = mismatch
            records.append(rec)
        del calls


def _progress(total: int, enabled: bool) -> Any:
    """tqdm's bar on stderr (the ``bench`` extra), else a line per case, else nothing."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return None
    return tqdm(total=total, unit="case", leave=True, dynamic_ncols=True)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str) -> dict[str, Any]:
    """CPU, threads, versions, date, allocator environment, load (and the GPU on CUDA)."""
    info: dict[str, Any] = {
        "cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "malloc_env": {k: os.environ.get(k) for k in MALLOC_ENV}, "kornia": None,
    }
    try:
        import kornia  # type: ignore[import-not-found]

        info["kornia"] = kornia.__version__
    except ImportError:
        pass
    if hasattr(os, "getloadavg"):
        info["loadavg_1m"] = os.getloadavg()[0]
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda_version"] = torch.version.cuda
    return info


def run(settings: Settings, progress: bool = True) -> dict[str, Any]:
    """Run the benchmark and return the JSON-able result.

    Ctrl-C (SIGINT) stops after the current case; the result then holds the finished cases
    and a note that says so.
    """
    jobs = selected(settings)
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    records: list[dict[str, Any]] = []
    notes: list[str] = []
    prefault_heap(settings.device,
                  None if "STABLELOSSES_BENCH_PREFAULT_MB" in os.environ else settings.prefault_mb)
    bar = _progress(len(jobs), progress)
    t0 = time.perf_counter()
    done = 0
    try:
        for spec, case, dt in jobs:
            if bar is not None:
                bar.set_description_str(f"{spec.name} {case.label} {dt}")
            run_case(spec, case, dt, settings, records, notes)
            done += 1
            if bar is not None:
                bar.update(1)
    except KeyboardInterrupt:  # e.g. `timeout --signal=INT`: keep what was measured
        notes.append(f"interrupted after {done} of {len(jobs)} cases; the results are partial")
    finally:
        if bar is not None:
            bar.close()
    for fn, v, err in sorted({(r["fn"], r["variant"], r["error"]) for r in records if r.get("error")}):
        notes.append(f"{fn} {v}: {err}")
    s = dict(settings.__dict__)
    s["only"] = list(settings.only) if settings.only else None
    machine = machine_info(settings.device)
    machine["loadavg_1m_start"] = load_start
    return {"schema": SCHEMA, "machine": machine, "settings": s,
            "elapsed_s": round(time.perf_counter() - t0, 1),
            "describe": {name: sp.describe for name, sp in specs().items()},
            "results": records, "notes": notes}
