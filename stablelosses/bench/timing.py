"""Callables of the variants, and their interleaved timing with ``torch.utils.benchmark``.

Each variant becomes a no-argument callable (`make_callable`): ``fwd`` runs the forward on
inputs that do not require grad, ``fwdbwd`` the forward plus ``torch.autograd.grad`` of the
differentiable inputs. Compiled variants are compiled (and their kernels counted) on the first
call, before any timing. `interleaved` times every variant once per round with a
``torch.utils.benchmark.Timer`` (which synchronizes CUDA), rotating the order each round so a
slow drift of a shared machine hits all variants alike, and merges the rounds into one
``Measurement`` per variant (its ``median`` is what the tables show).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.benchmark import Measurement, Timer

from stablelosses.bench.cases import Spec, kornia_available
from stablelosses.bench.kernels import KernelCount, capture_output_code, count_kernels
from stablelosses.bench.memory import peak_memory

__all__ = ["VARIANT_TABLE_HEAD", "available", "bench_fused_call", "calibrate", "compare_variants",
           "interleaved", "kernel_count", "make_callable", "round_robin", "round_robin_with_peaks", "timer",
           "variant_ids"]

_COMPILED: dict[tuple[Any, ...], Callable[..., Tensor]] = {}
_KERNELS: dict[tuple[Any, ...], KernelCount | None] = {}

#: Variants that need an optional package, and the check that it is importable.
OPTIONAL = {"kornia": kornia_available}


def available(variant: str) -> bool:
    """False for a variant whose optional package (kornia) is not installed."""
    check = OPTIONAL.get(variant.replace("-compiled", ""))
    return check is None or check()


def variant_ids(spec: Spec, compiled: bool, only_available: bool = True) -> list[str]:
    """Variant ids in table order: eager ones, ``one-pass``, then the compiled ones."""
    ids = list(spec.variants) + ["one-pass"]
    if compiled:
        ids += [v + "-compiled" for v in spec.variants]
    return [v for v in ids if not only_available or available(v)]


def _configure_compile() -> None:
    """Raise dynamo's recompile limits: the same baseline code object is compiled per shape."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096


def _variant_function(spec: Spec, variant: str, key: tuple[Any, ...]) -> Callable[..., Tensor]:
    """The function of ``variant``; compiled ones (ours with ``fullgraph=True``) made once per key."""
    if not variant.endswith("-compiled"):
        return spec.variants[variant]
    base = variant[: -len("-compiled")]
    ck = (spec.name, variant) + tuple(key)
    if ck not in _COMPILED:
        _configure_compile()
        _COMPILED[ck] = torch.compile(spec.variants[base], fullgraph=(base == "stable"), dynamic=False)
    return _COMPILED[ck]


def kernel_count(spec: Spec, variant: str, mode: str, key: tuple[Any, ...] = ()) -> KernelCount | None:
    """Kernels the compiled ``variant`` launches per call, counted when `make_callable` compiled it.

    ``None`` for an eager variant, or one compiled before (dynamo's cache hit shows no code).
    """
    if not variant.endswith("-compiled"):
        return None
    return _KERNELS.get((spec.variants[variant[: -len("-compiled")]], mode) + tuple(key))


def _first_call(spec: Spec, variant: str, mode: str, key: tuple[Any, ...], call: Callable[[], Any]) -> None:
    """Run ``call`` once; for a compiled variant, count the kernels of the graphs it compiles."""
    if not variant.endswith("-compiled"):
        call()
        return
    kk = (spec.variants[variant[: -len("-compiled")]], mode) + tuple(key)
    with capture_output_code() as codes:
        call()
    if kk not in _KERNELS or (codes and _KERNELS[kk] is None):
        _KERNELS[kk] = count_kernels(codes) if codes else None


def make_callable(spec: Spec, variant: str, tensors: Sequence[Tensor], grad_idx: Sequence[int],
                  mode: str, device: str, key: tuple[Any, ...] = ()) -> Callable[[], Any]:
    """A no-argument callable that runs one ``fwd`` or ``fwdbwd`` of ``variant``.

    Calls it once (this compiles a compiled variant and raises what the variant raises). On
    CUDA the callable synchronizes before it returns (pytest-benchmark times it as it is).
    """
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
    if variant == "one-pass":
        x = tensors[0].detach()

        def one_pass() -> Tensor:
            y = torch.neg(x)
            if sync is not None:
                sync()
            return y

        one_pass()
        return one_pass

    f = _variant_function(spec, variant, key)
    if mode == "fwd":
        args = [t.detach() for t in tensors]

        def fwd() -> Tensor:
            out = f(*args)
            if sync is not None:
                sync()
            return out

        _first_call(spec, variant, mode, key, fwd)
        return fwd

    args = [t.detach().requires_grad_(i in grad_idx) for i, t in enumerate(tensors)]
    wrt = [args[i] for i in grad_idx]
    grad_out: list[Tensor | None] = []  # ones like the output, made on the first call

    def fwdbwd() -> tuple[Tensor, ...]:
        o = f(*args)
        if not grad_out:
            grad_out.append(None if o.dim() == 0 else torch.ones_like(o))
        gs = torch.autograd.grad(o, wrt, grad_outputs=grad_out[0])
        if sync is not None:
            sync()
        return gs

    _first_call(spec, variant, mode, key, fwdbwd)
    return fwdbwd


def timer(call: Callable[[], Any], label: str, sub_label: str, description: str) -> Timer:
    """A ``torch.utils.benchmark.Timer`` of ``call()`` with the current thread count."""
    return Timer(stmt="call()", globals={"call": call}, label=label, sub_label=sub_label,
                 description=description, num_threads=torch.get_num_threads())


def calibrate(timer: Timer, sample_s: float, warm_s: float, min_warm: int) -> int:
    """Warm up (allocator pages, caches) and return the calls per sample for ``sample_s``.

    Each ``timeit(1)`` runs the statement three times (``Timer`` warms up twice first).
    """
    done, per, t0 = 0, float("inf"), time.perf_counter()
    while (done < min_warm or time.perf_counter() - t0 < warm_s) and done < 300:
        m = timer.timeit(1)
        done, per = done + 1, min(per, m.raw_times[0] / m.number_per_run)
    return max(1, min(100_000, round(sample_s / max(per, 1e-7))))


def interleaved(calls: dict[str, Callable[[], Any]], label: str, sub_label: str, rounds: int,
                sample_s: float, warm_s: float, min_warm: int) -> dict[str, Measurement]:
    """``rounds`` rounds; each times every variant once (order rotated per round).

    Returns one merged ``Measurement`` per variant: ``.times`` holds a per-call time per round.
    """
    names = list(calls)
    timers = {v: timer(calls[v], label, sub_label, v) for v in names}
    number = {v: calibrate(timers[v], sample_s, warm_s, min_warm) for v in names}
    parts: dict[str, list[Measurement]] = {v: [] for v in names}
    for r in range(rounds):
        k = r % max(len(names), 1)
        for v in names[k:] + names[:k]:
            parts[v].append(timers[v].timeit(number[v]))
    return {v: Measurement.merge(parts[v])[0] for v in names if parts[v]}


def round_robin(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Wall-clock seconds of each call in ``repeats`` rounds that run every call once, in turn
    (after one warm-up call each): the scripts' way to time whole fused losses, where one call
    takes seconds and a ``Timer``'s calibration would take minutes."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return times


def round_robin_with_peaks(
    calls: dict[str, Callable[[], Any]], repeats: int, device: str = "cpu"
) -> tuple[dict[str, list[float]], dict[str, float], dict[str, int]]:
    """`round_robin`'s times, their medians and each call's peak memory (`peak_memory`): what the
    fused-loss scripts print against their baseline."""
    times = round_robin(calls, repeats)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return times, medians, {name: peak_memory(call, device) for name, call in calls.items()}


def bench_fused_call(
    benchmark: Any, call: Callable[[], Any], rounds: int, device: str = "cpu", **info: Any
) -> None:
    """pytest-benchmark's timing of one fused-loss variant's forward+backward ``call`` (``rounds``
    rounds of one call after a warm-up), with ``info`` and the call's peak memory in
    ``extra_info``; every gradient it returns must be finite."""
    benchmark.extra_info.update(mode="fwdbwd", threads=torch.get_num_threads(), **info)
    result = benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=1)
    benchmark.extra_info["peak_bytes"] = peak_memory(call, device)
    assert all(torch.isfinite(r).all() for r in result)


# The header of `compare_variants`' rows.
VARIANT_TABLE_HEAD = (
    "| case | variant | median time | peak | against | time ratio | peak ratio |\n"
    "|---|---|---|---|---|---|---|"
)


def compare_variants(
    label: str, calls: dict[str, Callable[[], Any]], repeats: int, against: dict[str, str],
    device: str = "cpu",
) -> list[str]:
    """What the fused-loss scripts report for one case: the ``calls`` timed interleaved
    (`round_robin_with_peaks`), a printed line per variant (median, every time, peak, and its
    ratios to the variant ``against`` names for it, if that one ran), and the Markdown rows
    under `VARIANT_TABLE_HEAD`."""
    times, med, peaks = round_robin_with_peaks(calls, repeats, device)
    print(f"{label} ({torch.get_num_threads()} threads, {repeats} interleaved repeats)")
    rows = []
    for v in calls:
        base = against.get(v, "")
        ratio, tr, pr = "", "—", "—"
        if base in calls:
            tr, pr = f"{med[v] / med[base]:.2f}", f"{peaks[v] / peaks[base]:.2f}"
            ratio = f"  vs {base}: time {med[v] / med[base]:.3f}, peak {peaks[v] / peaks[base]:.3f}"
        print(f"  {v:17s} median {med[v]:7.3f} s  (all: {', '.join(f'{t:.2f}' for t in times[v])})  "
              f"peak {peaks[v] / 2**20:7.1f} MiB{ratio}", flush=True)
        rows.append(f"| {label} | {v} | {med[v]:.2f} s | {peaks[v] / 2**20:.0f} MiB | {base or '—'} "
                    f"| {tr} | {pr} |")
    return rows
