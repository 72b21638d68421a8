"""Per-sequence log-probabilities from hidden states: time and peak memory, fused against unfused.

Variants: ``unfused`` (``log_softmax(h @ W.T, -1)`` gathered at the labels, masked and summed
per sequence: what TRL's trainers do on the model's logits), ``stable-logits``
(``SF.sequence_logps`` on ``h @ W.T``: the same logits, our row) and ``stable``
(``SF.linear_sequence_logps``: the token log-prob head on the chunk engine, no ``(N, V)``
logits). Each call is forward+backward: ``torch.autograd.grad`` of ``Σ_b c_b · logp_b`` (fixed
random ``c``, a stand-in for any preference loss on top) with respect to ``h`` and ``W``.

``pytest benchmarks/test_bench_post.py`` times each variant (pytest-benchmark) at a CPU-sized
default case (the target's rows and vocabulary, ``H = 256``) and records one call's peak in
``extra_info['peak_bytes']``; ``test_memory`` (not timed) checks the fused peak against ¼ of
the unfused one and the gradients against each other. ``STABLELOSSES_BENCH_FULL=1``
adds the issue's target shape ``B=8, T=512, H=1024, V=32000`` float32.

``python benchmarks/test_bench_post.py [--full] [--repeats R]`` measures the variants
interleaved and prints medians, peaks and ratios against ``unfused``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

import stablelosses.functional as SF
from stablelosses.bench.memory import fused_peak_ratio
from stablelosses.bench.timing import VARIANT_TABLE_HEAD, bench_fused_call, compare_variants

FULL = os.environ.get("STABLELOSSES_BENCH_FULL") == "1"
ROUNDS = int(os.environ.get("STABLELOSSES_BENCH_ROUNDS", "3"))
VARIANTS = ("unfused", "stable-logits", "stable")

# (label, B, T, H, V, tier)
CASES = [
    ("8x512x256x32000", 8, 512, 256, 32000, "default"),
    ("8x512x1024x32000", 8, 512, 1024, 32000, "full"),
]


def unfused_sequence_logps(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The hand-written spelling: full log-softmax of the logits, gather, mask multiply, sum."""
    mask = labels != -100
    lp = torch.log_softmax(h @ w.T, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (lp * mask).sum(-1)


def make_call(label: str, variant: str) -> Callable[[], Any]:
    """Inputs of case ``label`` and the forward+backward callable of ``variant``."""
    _, b, t, hd, v, _ = next(c for c in CASES if c[0] == label)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(b, t, hd, generator=g).requires_grad_(True)
    w = (torch.randn(v, hd, generator=g) * hd**-0.5).requires_grad_(True)
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[:, : t // 8] = -100  # the prompt
    coef = torch.randn(b, generator=g)

    def logps() -> torch.Tensor:
        if variant == "unfused":
            return unfused_sequence_logps(h, w, labels)
        if variant == "stable-logits":
            return SF.sequence_logps(h @ w.T, labels)
        return SF.linear_sequence_logps(h, w, labels)

    def call() -> Any:
        return torch.autograd.grad((logps() * coef).sum(), (h, w))

    return call


def _params() -> list[Any]:
    out = []
    for label, *_, tier in CASES:
        skip = pytest.mark.skip(reason="set STABLELOSSES_BENCH_FULL=1")
        marks = [] if tier == "default" or FULL else [skip]
        out += [pytest.param(label, v, marks=marks, id=f"{label}-{v}") for v in VARIANTS]
    return out


@pytest.mark.parametrize("case,variant", _params())
def test_fwdbwd(benchmark, case, variant):
    call = make_call(case, variant)
    benchmark.group = "sequence_logps " + case
    bench_fused_call(benchmark, call, ROUNDS, fn="linear_sequence_logps", case=case, variant=variant)


@pytest.mark.parametrize("case", [label for label, *_, tier in CASES if tier == "default" or FULL])
def test_memory(case):
    """The fused peak is at most ¼ of the unfused one, and the gradients agree."""
    fused, unfused = make_call(case, "stable"), make_call(case, "unfused")
    ratio = fused_peak_ratio(case, fused, unfused, rtol=1e-4, atol=1e-4)
    assert ratio <= 0.25


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="also the issue's target shape")
    parser.add_argument("--only", default="", help="run the cases whose label contains this")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for label, *_, tier in CASES:
        if (tier == "full" and not args.full) or args.only not in label:
            continue
        calls = {v: make_call(label, v) for v in VARIANTS}
        rows += compare_variants(label, calls, args.repeats, {v: "unfused" for v in calls})
    print("\n" + VARIANT_TABLE_HEAD)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
