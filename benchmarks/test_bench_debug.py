"""Overhead of the debugging tools on a small MLP training step.

One group, ``debug``; ids ``plain`` (eager, no checks), ``detect_nonfinite``,
``detect_anomaly`` (``torch.autograd.detect_anomaly``) and ``monitor`` (the plain step plus
``DivergenceMonitor.check`` between backward and ``optimizer.step()``). The step: forward of a
3-layer MLP (batch 256, width 256), cross-entropy (``loss`` parameter: ``torch`` for
``F.cross_entropy``, ``stablelosses`` for ``SF.cross_entropy``, which ``detect_nonfinite`` also
checks at its boundary), backward, SGD step; the context is entered inside the timed call, as in
a training loop. ``test_overhead_ratio`` checks ``detect_nonfinite`` stays under about 2× the
plain step and ``test_monitor_overhead`` that ``check`` costs under about 5% of it; both time
interleaved (plain and watched alternate) so that load from other processes hits both alike.
``test_hook_cost_with_no_detector_open`` times the public functions (which carry the detector's
hook: one global read) against the plain functions they wrap, on tiny inputs where a fixed
cost shows most, and checks the difference stays under 1 µs per call for ``safe_sqrt``.
Run with ``pytest benchmarks/test_bench_debug.py -s`` to see the ratios.
"""

from __future__ import annotations

import contextlib
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stablelosses.functional as SF
from stablelosses.debug import DivergenceMonitor, detect_nonfinite

BATCH, WIDTH, CLASSES = 256, 256, 10


def _anomaly():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled"
        return torch.autograd.detect_anomaly()


CONTEXTS = {
    "plain": contextlib.nullcontext,
    "detect_nonfinite": detect_nonfinite,
    "detect_anomaly": _anomaly,
}


def make_step(loss_fn=F.cross_entropy, monitor=False):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(),
        nn.Linear(WIDTH, WIDTH), nn.ReLU(),
        nn.Linear(WIDTH, CLASSES),
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, t = torch.randn(BATCH, WIDTH), torch.randint(0, CLASSES, (BATCH,))
    check = DivergenceMonitor(model, optimizer=opt).check if monitor else None

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), t)
        loss.backward()
        if check is not None:
            check(loss)
        opt.step()
        return loss

    return step


LOSSES = {"torch": F.cross_entropy, "stablelosses": SF.cross_entropy}


@pytest.mark.benchmark(group="debug")
@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("variant", [*CONTEXTS, "monitor"])
def test_training_step(benchmark, variant, loss):
    monitor = variant == "monitor"
    step = make_step(LOSSES[loss], monitor=monitor)
    ctx = contextlib.nullcontext if monitor else CONTEXTS[variant]

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with ctx():
                return step()

    for _ in range(3):
        run()
    loss = benchmark(run)
    assert torch.isfinite(loss)


def _median_time(fn, repeats=30):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _interleaved_ratio(plain, watched, rounds=5, repeats=10) -> float:
    """Median over rounds of (median watched time / median plain time), one CPU thread.

    Plain and watched alternate round by round, so load from other processes on a shared CPU
    hits both sides alike.
    """
    threads = torch.get_num_threads()
    # one thread: the checks' cost is Python per operator or per step, the hard case for the
    # ratio, and it does not swing with other processes competing for cores
    torch.set_num_threads(1)
    try:
        for _ in range(3):
            plain(), watched()
        ratios = []
        for _ in range(rounds):
            p = _median_time(plain, repeats)
            ratios.append(_median_time(watched, repeats) / p)
    finally:
        torch.set_num_threads(threads)
    return sorted(ratios)[rounds // 2]


def _under(step, ctx):
    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with ctx():
                step()

    return run


@pytest.mark.parametrize("loss", list(LOSSES))
def test_overhead_ratio(loss):
    """Interleaved medians: detect_nonfinite within ~2× of plain (2.5× allowed for noise)."""
    step = make_step(LOSSES[loss])
    ratio = _interleaved_ratio(_under(step, contextlib.nullcontext), _under(step, detect_nonfinite))
    print(f"\ndetect_nonfinite / plain ({loss} cross_entropy) = {ratio:.2f}")
    assert ratio < 2.5, ratio


def test_monitor_overhead():
    """Interleaved medians: DivergenceMonitor.check under ~5% of the step (10% allowed for noise)."""
    plain = _under(make_step(), contextlib.nullcontext)
    watched = _under(make_step(monitor=True), contextlib.nullcontext)
    ratio = _interleaved_ratio(plain, watched, rounds=9, repeats=20)
    print(f"\n(step + DivergenceMonitor.check) / step = {ratio:.3f}")
    assert ratio < 1.10, ratio


def _per_call(fn, args, calls=200, repeats=9):
    return _median_time(lambda: [fn(*args) for _ in range(calls)], repeats) / calls


def test_hook_cost_with_no_detector_open():
    """Public (hooked) minus plain function per call, interleaved medians: under 1 µs where it
    can be seen (``safe_sqrt``, the cheapest call); printed for the others."""
    x, t, v = torch.randn(8, 10), torch.randint(0, 10, (8,)), torch.rand(16)
    cases = {"safe_sqrt 16": (SF.safe_sqrt, (v,)), "rmse_loss 16": (SF.rmse_loss, (v, v.flip(0))),
             "cross_entropy 8x10": (SF.cross_entropy, (x, t))}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, (public, args) in cases.items():
            plain = public.__wrapped__
            for _ in range(300):
                public(*args), plain(*args)
            diffs, base = [], []
            for _ in range(21):
                p = _per_call(plain, args)
                diffs.append(_per_call(public, args) - p)
                base.append(p)
            diff, plain_s = sorted(diffs)[10], sorted(base)[10]
            print(f"\n{name} forward: plain {plain_s * 1e6:.2f} µs, hooked - plain {diff * 1e6:+.3f} µs")
            if name == "safe_sqrt 16":
                assert diff < 1e-6, (name, diff)
    finally:
        torch.set_num_threads(threads)
