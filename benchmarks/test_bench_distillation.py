"""Fused linear distillation against the unfused path: time and peak memory.

Variants (forward+backward, gradients with respect to the student's hidden states and weight;
the teacher takes none): ``unfused`` (``SF.distillation_loss(F.linear(hs, Ws), F.linear(ht, Wt))``,
the same loss on materialised logits), ``trl`` (TRL's ``generalized_jsd_loss`` on the same
logits, transcribed in ``naive_post_training.py``) and ``stable``
(``SF.linear_distillation_loss``); ``liger`` (Liger-Kernel's ``LigerFusedLinearJSDLoss``, its
soft loss only, default ``compiled=True`` and ``chunk_size``) where ``liger_kernel`` imports (a
bench-only package, not a dependency). ``kind='jsd'``, ``beta=0.5``.

``pytest benchmarks/test_bench_distillation.py`` times each variant and records the peak memory
of one call in ``extra_info['peak_bytes']``; ``test_memory`` (not timed) checks that the fused
path's peak is at most 1/4 of the unfused one's. Default case ``N=4096, H=1024, V=32000``
float32 (both models). ``python benchmarks/test_bench_distillation.py [--repeats R]`` measures
the variants interleaved and prints medians, peaks and the ratios against ``unfused``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import stablelosses.functional as SF
from stablelosses.bench.memory import fused_peak_ratio
from stablelosses.bench.timing import VARIANT_TABLE_HEAD, bench_fused_call, compare_variants

ROUNDS = int(os.environ.get("STABLELOSSES_BENCH_ROUNDS", "3"))
try:
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss  # type: ignore[import-not-found]
except Exception:  # noqa: BLE001 - any import failure: the variant is skipped
    LigerFusedLinearJSDLoss = None
VARIANTS = ("unfused", "trl", "stable", "liger")
CASES = [("4096x1024x32000-float32", 4096, 1024, 32000, torch.float32)]

_spec = importlib.util.spec_from_file_location(
    "naive_post_training", pathlib.Path(__file__).resolve().parent / "naive_post_training.py")
assert _spec is not None and _spec.loader is not None
naive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(naive)


def make_call(label: str, variant: str, device: str = "cpu") -> Callable[[], Any]:
    """The forward+backward callable of ``variant`` on case ``label``."""
    _, n, h, v, dtype = next(c for c in CASES if c[0] == label)
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(n, h, generator=g).to(device, dtype).requires_grad_(True)
    ws = (torch.randn(v, h, generator=g) * h**-0.5).to(device, dtype).requires_grad_(True)
    ht = torch.randn(n, h, generator=g).to(device, dtype)
    wt = (torch.randn(v, h, generator=g) * h**-0.5).to(device, dtype)
    mask = torch.ones(n, dtype=torch.bool, device=device)
    mask[::17] = False
    labels = torch.where(mask, 1, -100)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    liger = None
    if variant == "liger":
        liger = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.5)

    def loss() -> torch.Tensor:
        if liger is not None:
            return liger(hs, ws, ht, wt, labels)
        if variant == "stable":
            return SF.linear_distillation_loss(hs, ws, ht, wt, kind="jsd", mask=mask)
        s, t = F.linear(hs, ws), F.linear(ht, wt)
        if variant == "trl":
            return naive.trl_generalized_jsd_loss(s, t, labels, beta=0.5)
        return SF.distillation_loss(s, t, kind="jsd", mask=mask)

    def call() -> Any:
        out = torch.autograd.grad(loss(), (hs, ws))
        sync()
        return out

    return call


_NO_LIGER = pytest.mark.skip(reason="liger_kernel does not import here")
PARAMS = [pytest.param(c[0], v, id=f"{c[0]}-cpu-{v}",
                       marks=[_NO_LIGER] if v == "liger" and LigerFusedLinearJSDLoss is None else [])
          for c in CASES for v in VARIANTS]


@pytest.mark.parametrize("case,variant", PARAMS)
def test_fwdbwd(benchmark, case, variant):
    call = make_call(case, variant)
    benchmark.group = "linear_distillation_loss " + case
    bench_fused_call(benchmark, call, ROUNDS, fn="linear_distillation_loss", case=case, variant=variant)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_memory(case):
    """The fused path's peak is at most 1/4 of the unfused path's, with the same gradients."""
    fused, unfused = make_call(case, "stable"), make_call(case, "unfused")
    ratio = fused_peak_ratio(case, fused, unfused, rtol=1e-4, atol=1e-6)
    assert ratio <= 0.25


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; unfused always")
    args = parser.parse_args()
    wanted = ["unfused"] + [v for v in args.variants.split(",") if v != "unfused"
                            and (v != "liger" or LigerFusedLinearJSDLoss is not None)]
    torch.set_num_threads(args.threads)
    rows = []
    for label, *_ in CASES:
        calls = {v: make_call(label, v) for v in wanted}
        rows += compare_variants(label, calls, args.repeats, {v: "unfused" for v in calls})
    print("\n" + VARIANT_TABLE_HEAD)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
