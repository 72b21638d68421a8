"""Overhead of ``detect_nonfinite`` on a small MLP training step, beside ``detect_anomaly``.

One group, ``debug``; ids ``plain`` (eager, no checks), ``detect_nonfinite`` and
``detect_anomaly`` (``torch.autograd.detect_anomaly``). The step: forward of a 3-layer MLP
(batch 256, width 256), cross-entropy, backward, SGD step; the context is entered inside the
timed call, as in a training loop. ``test_overhead_ratio`` checks the cost stays under about 2×
the plain step (run it with the others: ``pytest benchmarks/test_bench_debug.py``).
"""

from __future__ import annotations

import contextlib
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stablelosses.debug import detect_nonfinite

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


def make_step():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(),
        nn.Linear(WIDTH, WIDTH), nn.ReLU(),
        nn.Linear(WIDTH, CLASSES),
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, t = torch.randn(BATCH, WIDTH), torch.randint(0, CLASSES, (BATCH,))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), t)
        loss.backward()
        opt.step()
        return loss

    return step


@pytest.mark.benchmark(group="debug")
@pytest.mark.parametrize("variant", list(CONTEXTS), ids=list(CONTEXTS))
def test_training_step(benchmark, variant):
    step, ctx = make_step(), CONTEXTS[variant]

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


def test_overhead_ratio():
    """Interleaved medians: detect_nonfinite within ~2× of plain (2.5× allowed for noise)."""
    step = make_step()

    def under(ctx):
        def run():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with ctx():
                    step()
        return run

    plain, watched = under(contextlib.nullcontext), under(detect_nonfinite)
    threads = torch.get_num_threads()
    # one thread: the check's cost is Python per operator, so this is the hard case for the
    # ratio, and it does not swing with other processes competing for cores
    torch.set_num_threads(1)
    try:
        for _ in range(3):
            plain(), watched()
        p, w = [], []
        for _ in range(5):
            p.append(_median_time(plain, 10))
            w.append(_median_time(watched, 10))
    finally:
        torch.set_num_threads(threads)
    ratio = sorted(w)[2] / sorted(p)[2]
    print(f"\ndetect_nonfinite / plain = {ratio:.2f}")
    assert ratio < 2.5, ratio
