"""Peak memory of one call, and the allocator settings that keep CPU timings steady.

CPU timings of large fresh buffers swing with page faults when glibc returns freed memory to
the kernel. `MALLOC_ENV` keeps freed buffers in the heap (glibc reads it at start-up, so
``stablelosses bench`` re-executes itself with it), and `prefault_heap` touches the heap once
so that the first calls of each shape do not fault while it grows.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["MALLOC_ENV", "fused_peak_ratio", "peak_memory", "prefault_heap"]

#: Environment that keeps glibc from returning freed large buffers to the kernel (no mmap for
#: big allocations, no trimming of the heap top), so repeated calls reuse warm pages.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(4 * 1024**3),
    "MALLOC_TRIM_THRESHOLD_": str(64 * 1024**3),
    "MALLOC_TOP_PAD_": str(256 * 1024**2),
}


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (kineto prints start/stop lines from C++)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_memory(call: Callable[[], Any], device: str) -> int:
    """Peak bytes allocated during one ``call()`` above what was allocated before it.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: the allocation events recorded by
    ``torch.profiler`` with ``profile_memory=True`` (they include the buffers of compiled
    kernels), summed in time order; the maximum of the running sum is the peak. Inputs are
    excluded; the returned gradients are included.
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        res = call()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del res
        return int(peak)
    cur = peak = 0
    for _, size in cpu_allocation_events(call):
        cur += size
        peak = max(peak, cur)
    return int(peak)


def cpu_allocation_events(call: Callable[[], Any]) -> list[tuple[int, int]]:
    """``(start ns, bytes)`` of every CPU allocation (positive) and free (negative) that
    ``torch.profiler`` records during one ``call()``, in time order."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        res = call()
        del res
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
    return sorted(events)


def prefault_heap(device: str, mib: int | None = None) -> int:
    """Grow glibc's heap once by ``mib`` MiB of touched pages (default 1024, or
    ``STABLELOSSES_BENCH_PREFAULT_MB``), then free it. CPU only; returns the bytes touched.

    With `MALLOC_ENV` in effect the freed pages stay in the heap, so the first calls of each
    shape reuse touched memory instead of page-faulting while the heap grows.
    """
    if torch.device(device).type != "cpu":
        return 0
    if mib is None:
        mib = int(os.environ.get("STABLELOSSES_BENCH_PREFAULT_MB", "1024"))
    if mib <= 0:
        return 0
    block = torch.empty(mib * 2**20, dtype=torch.uint8)
    block.fill_(0)
    del block
    return mib * 2**20


def fused_peak_ratio(case: str, fused: Callable[[], Any], unfused: Callable[[], Any], rtol: float,
                     atol: float) -> float:
    """The fused call's CPU peak over the unfused one's, after checking that the two return the
    same tensors (the fused losses' memory benchmarks); prints both peaks."""
    import torch

    for a, b in zip(fused(), unfused()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    peak_fused, peak_unfused = peak_memory(fused, "cpu"), peak_memory(unfused, "cpu")
    print(f"\n{case}: peak fused {peak_fused / 2**20:.0f} MiB, unfused {peak_unfused / 2**20:.0f} MiB, "
          f"ratio {peak_fused / peak_unfused:.3f}")
    return peak_fused / peak_unfused
