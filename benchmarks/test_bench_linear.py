"""Fused linear cross-entropy against torch: time and peak memory.

Variants: ``torch`` (``F.cross_entropy(F.linear(x, W), t)``, torch's reference), ``torch-chunked``
(torch >= 2.13's ``F.linear_cross_entropy(x, W, t, options=nn.LinearCrossEntropyOptions())``),
``stable`` (``SF.linear_cross_entropy``), and with ``label_smoothing=0.1``: ``torch-chunked-ls``
(torch's chunked path has no smoothing: it falls back to its reference, with a warning) and
``stable-ls``.

``pytest benchmarks/test_bench_linear.py`` times forward+backward (``torch.autograd.grad`` with
respect to ``x`` and ``W``) of each variant and records the peak
memory of one call in ``extra_info['peak_bytes']``; ``test_memory`` (not timed) checks with
``torch.profiler``'s allocation events that the fused path never allocates an ``(N, V)``
buffer and that its peak is at most 1/4 of the unfused one.

Default case: ``N=4096, H=1024, V=32000`` float32 (the issue's target shape).
``STABLELOSSES_BENCH_FULL=1`` adds ``V=128256`` (``N=2048`` and ``N=4096``) and bfloat16 input
and weights. ``STABLELOSSES_BENCH_ROUNDS`` (default 3) sets the rounds.

``python benchmarks/test_bench_linear.py [--full] [--repeats R] [--variants a,b,...]`` measures
the variants *interleaved* (torch, torch-chunked, stable, ..., then again) and prints medians,
peaks and each one's time and peak ratio against ``torch-chunked`` (``stable-ls`` against
``torch-chunked-ls``), with a markdown row per variant: the fairer comparison on a machine whose
load changes during the run.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stablelosses.functional as SF
from stablelosses.bench.memory import cpu_allocation_events, peak_memory
from stablelosses.bench.timing import VARIANT_TABLE_HEAD, bench_fused_call, compare_variants
from stablelosses.functional._linear import default_chunk_size

FULL = os.environ.get("STABLELOSSES_BENCH_FULL") == "1"
ROUNDS = int(os.environ.get("STABLELOSSES_BENCH_ROUNDS", "3"))
HAS_CUDA = torch.cuda.is_available()
HAS_TORCH_LCE = hasattr(F, "linear_cross_entropy") and hasattr(nn, "LinearCrossEntropyOptions")
VARIANTS = ("torch", "torch-chunked", "stable", "torch-chunked-ls", "stable-ls")
# the variant each one's ratios are taken against in main()
BASELINE = {"torch": "torch-chunked", "stable": "torch-chunked", "stable-ls": "torch-chunked-ls"}

# (label, N, H, V, dtype of input and weight, tier)
CASES = [
    ("4096x1024x32000-float32", 4096, 1024, 32000, torch.float32, "default"),
    ("2048x1024x128256-float32", 2048, 1024, 128256, torch.float32, "full"),
    ("4096x1024x128256-float32", 4096, 1024, 128256, torch.float32, "full"),
    ("4096x1024x32000-bfloat16", 4096, 1024, 32000, torch.bfloat16, "full"),
]


def _params(with_variant: bool) -> list[Any]:
    out = []
    for label, *_, tier in CASES:
        for dev in ("cpu", "cuda"):
            marks = []
            if tier == "full" and not FULL:
                marks.append(pytest.mark.skip(reason="large case: set STABLELOSSES_BENCH_FULL=1"))
            if dev == "cuda" and not HAS_CUDA:
                marks.append(pytest.mark.skip(reason="needs CUDA"))
            cid = f"{label}-{dev}"
            for v in VARIANTS if with_variant else (None,):
                vid = cid if v is None else f"{cid}-{v}"
                args = (cid, v) if with_variant else (cid,)
                vmarks = list(marks)
                if v is not None and v.startswith("torch-chunked") and not HAS_TORCH_LCE:
                    vmarks.append(pytest.mark.skip(reason="torch < 2.13 has no F.linear_cross_entropy"))
                out.append(pytest.param(*args, marks=vmarks, id=vid))
    return out


def make_call(cid: str, variant: str) -> tuple[Callable[[], Any], tuple[int, int, int, int]]:
    """Inputs of case ``cid`` and the forward+backward callable of ``variant``."""
    label, dev = cid.rsplit("-", 1)
    _, n, h, v, dtype, _ = next(c for c in CASES if c[0] == label)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(dev, dtype).requires_grad_(True)
    w = (torch.randn(v, h, generator=g) * h**-0.5).to(dev, dtype).requires_grad_(True)
    t = torch.randint(0, v, (n,), generator=g).to(dev)
    t[::17] = -100
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    ls = 0.1 if variant.endswith("-ls") else 0.0

    def loss() -> torch.Tensor:
        if variant == "torch":
            return F.cross_entropy(F.linear(x, w), t)
        if variant.startswith("torch-chunked"):
            opts = nn.LinearCrossEntropyOptions()
            return F.linear_cross_entropy(x, w, t, label_smoothing=ls, options=opts)  # type: ignore[attr-defined]
        return SF.linear_cross_entropy(x, w, t, label_smoothing=ls)

    def call() -> Any:
        out = torch.autograd.grad(loss(), (x, w))
        sync()
        return out
    return call, (n, h, v, torch.finfo(dtype).bits // 8)


@pytest.mark.parametrize("case,variant", _params(True))
def test_fwdbwd(benchmark, case, variant):
    call, (n, h, v, size) = make_call(case, variant)
    benchmark.group = "linear_cross_entropy " + case
    bench_fused_call(benchmark, call, ROUNDS, case.rsplit("-", 1)[1], fn="linear_cross_entropy", case=case,
                     variant=variant, shape=[n, h, v])


def allocations(call: Callable[[], Any]) -> list[int]:
    """Sizes of the CPU allocations (positive events) that ``torch.profiler`` records in one call."""
    return [size for _, size in cpu_allocation_events(call) if size > 0]


@pytest.mark.parametrize("case", [p for p in _params(False) if "cuda" not in p.id])
def test_memory(case):
    """No ``(N, V)`` logits buffer in the fused path, and peak ≤ 1/4 of the unfused path's."""
    fused, (n, h, v, size) = make_call(case, "stable")
    unfused, _ = make_call(case, "torch")
    nv_bytes = n * v * 4  # the logits in float32 (the compute dtype)
    # The largest buffers the fused path may hold: one chunk's logits, the float32 gradient of
    # the weight (V, H) and of the input (N, H).
    allowed = max(default_chunk_size(v, torch.float32) * v, v * h, n * h) * 4
    largest_fused = max(allocations(fused))
    assert max(allocations(unfused)) >= n * v * size  # the check can see an (N, V) buffer
    assert largest_fused <= allowed < nv_bytes, f"fused path allocated {largest_fused} bytes at once"
    peak_fused, peak_unfused = peak_memory(fused, "cpu"), peak_memory(unfused, "cpu")
    print(f"\n{case}: peak fused {peak_fused / 2**20:.0f} MiB, unfused {peak_unfused / 2**20:.0f} MiB, "
          f"ratio {peak_fused / peak_unfused:.3f}; largest fused allocation {largest_fused / 2**20:.1f} MiB")
    assert peak_fused <= peak_unfused / 4


def main() -> None:
    import warnings

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="also the large cases")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", default="",
                        help="run the cases whose label contains one of these (comma-separated)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # torch's chunked path warns that it falls back to its reference for label smoothing
    warnings.filterwarnings("ignore", "linear_cross_entropy: ``options`` ignored")
    wanted = [v for v in args.variants.split(",") if HAS_TORCH_LCE or not v.startswith("torch-chunked")]
    rows = []
    for label, *_, tier in CASES:
        if (tier == "full" and not args.full) or not any(o in label for o in args.only.split(",")):
            continue
        cid = f"{label}-{args.device}"
        calls = {v: make_call(cid, v)[0] for v in wanted}
        rows += compare_variants(label, calls, args.repeats, BASELINE, args.device)
    print("\n" + VARIANT_TABLE_HEAD)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
