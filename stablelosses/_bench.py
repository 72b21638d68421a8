r"""``stablelosses bench``: time stablelosses against the PyTorch built-ins and the naive formulas.

Usage::

    stablelosses bench [--device cpu|cuda] [--compile] [--quick | --full] [--json PATH]
                       [--markdown PATH] [--only FN[,FN...]] [--dtype float32[,bfloat16]]
                       [--modes fwd,fwdbwd] [--compile-modes fwdbwd] [--repeats R]
                       [--threads T] [--no-peak] [--no-progress] [--no-reexec]

What it does, for every function, input shape, dtype and device of the chosen tier:

* builds the inputs once, then one callable per *variant*: ``torch`` (the built-in it replaces),
  ``naive`` (the formula users post; ``naive-double-where`` for ``safe_div``), ``kornia``
  (``kornia.losses.focal_loss``, only when kornia is importable), ``stable`` (ours) and
  ``one-pass`` (``torch.neg`` of the input: one read-and-write pass over it, the memory-bandwidth
  floor); with ``--compile`` also ``<variant>-compiled`` (``torch.compile``, built and warmed up
  before any timing; ours with ``fullgraph=True``);
* times two modes: ``fwd`` (forward on inputs that do not require grad) and ``fwdbwd`` (forward
  plus ``torch.autograd.grad`` for the differentiable inputs);
* **interleaves** the variants: every repeat times each variant once (A B C, B C A, ...), so slow
  drifts of a shared machine hit all variants alike, and reports the **median** per variant;
* measures the **peak memory** of one forward+backward per variant: on CUDA
  ``torch.cuda.max_memory_allocated`` above the memory in use before the call; on CPU the
  allocation events of ``torch.profiler`` (``profile_memory=True``), summed in time order —
  the high-water mark of bytes allocated during the call and not yet freed (inputs excluded,
  the returned gradients included, so a fused loss can reach 1.0x the gradient size);
* prints a table of ratios — ours / built-in, ours / naive, ours / one-pass, compiled ours /
  compiled built-in, peak / built-in's peak, peak / gradient size — and with ``--json PATH``
  writes every raw number (all repeats, per variant, shape, dtype, device, mode; peak bytes;
  machine: CPU model, threads, torch version) for ``benchmarks/check_targets.py``.

Tiers: ``--quick`` uses small shapes and few repeats (under a minute on 2 CPU cores without
``--compile``); the default uses the shapes the targets are stated for (classification
8192x1000, few-class 65536x10, detection 65536x80, regression 1e6 and 1e7 elements, tiny
inputs), float32; ``--full`` adds the LLM vocabulary (256x32000) and segmentation
(16x21x128x128) shapes and bfloat16. Default and full take 9 interleaved repeats, quick 3.

CPU timings of large fresh buffers swing with page faults when glibc returns freed memory to
the kernel. Unless ``--no-reexec`` is given, the command re-executes itself with
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set high (see :data:`MALLOC_ENV`) when
they are absent, so freed buffers stay in the heap and are reused warm, and it touches
1 GiB of heap once at start (:func:`prefault_heap`) so that the first calls of each shape do
not fault while the heap grows. It sets
``torch.set_num_threads(--threads)`` (default 2).

On CUDA every timed callable ends with ``torch.cuda.synchronize()``.

Exit status: 0 on success (also when some variants failed; they are listed), 2 on bad arguments,
130 when interrupted (Ctrl-C / SIGINT: the table and ``--json`` still hold the finished cases).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

#: Environment that keeps glibc from returning freed large buffers to the kernel (no mmap for
#: big allocations, no trimming of the heap top), so repeated calls reuse warm pages.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(4 * 1024**3),
    "MALLOC_TRIM_THRESHOLD_": str(64 * 1024**3),
    "MALLOC_TOP_PAD_": str(256 * 1024**2),
}

SCHEMA = "stablelosses-bench/1"
MODES = ("fwd", "fwdbwd")
TIERS = ("quick", "default", "full")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


# --------------------------------------------------------------------------------------------
# Baselines: the built-ins and the naive snippets, written as users write them.
# --------------------------------------------------------------------------------------------

def _sf():
    import stablelosses.functional as SF  # noqa: N812

    return SF


def ce_torch(x: Tensor, t: Tensor) -> Tensor:
    return F.cross_entropy(x, t)


def focal_naive(x: Tensor, t: Tensor) -> Tensor:
    # The classic FocalLoss snippet: softmax -> log -> gather.
    p = torch.softmax(x, dim=1)
    logp = torch.log(p)
    idx = t.unsqueeze(1)
    pt = p.gather(1, idx).squeeze(1)
    logpt = logp.gather(1, idx).squeeze(1)
    return (-((1 - pt) ** 2.0) * logpt).mean()


def focal_kornia(x: Tensor, t: Tensor) -> Tensor:
    from kornia.losses import focal_loss

    return focal_loss(x, t, alpha=None, gamma=2.0, reduction="mean")


def sigmoid_focal_torchvision(x: Tensor, t: Tensor) -> Tensor:
    # torchvision.ops.sigmoid_focal_loss, written out (alpha=0.25, gamma=2, reduction='mean').
    p = torch.sigmoid(x)
    ce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
    p_t = p * t + (1 - p) * (1 - t)
    loss = ce * ((1 - p_t) ** 2.0)
    alpha_t = 0.25 * t + (1 - 0.25) * (1 - t)
    loss = alpha_t * loss
    return loss.mean()


def rmse_torch(x: Tensor, y: Tensor) -> Tensor:
    return torch.sqrt(F.mse_loss(x, y))


def logcosh_naive(x: Tensor, y: Tensor) -> Tensor:
    return torch.log(torch.cosh(x - y)).mean()


def softmax_torch(x: Tensor) -> Tensor:
    return torch.softmax(x, dim=-1)


def softmax_naive(x: Tensor) -> Tensor:
    e = torch.exp(x)
    return e / e.sum(dim=-1, keepdim=True)


def log_softmax_torch(x: Tensor) -> Tensor:
    return torch.log_softmax(x, dim=-1)


def log_softmax_naive(x: Tensor) -> Tensor:
    e = torch.exp(x)
    return torch.log(e / e.sum(dim=-1, keepdim=True))


def logsumexp_torch(x: Tensor) -> Tensor:
    return torch.logsumexp(x, dim=-1)


def logsumexp_naive(x: Tensor) -> Tensor:
    return torch.log(torch.exp(x).sum(dim=-1))


def kl_torch(x: Tensor, t: Tensor) -> Tensor:
    return F.kl_div(x, t, reduction="batchmean")


def kl_naive(x: Tensor, t: Tensor) -> Tensor:
    return (t * (torch.log(t) - x)).sum() / x.shape[0]


def div_torch(a: Tensor, b: Tensor) -> Tensor:
    return torch.div(a, b)


def div_where(a: Tensor, b: Tensor) -> Tensor:
    return torch.where(b != 0, a / b, 0.0)


def div_double_where(a: Tensor, b: Tensor) -> Tensor:
    zero = b == 0
    return torch.where(zero, 0.0, a / torch.where(zero, 1.0, b))


def sqrt_torch(x: Tensor) -> Tensor:
    return torch.sqrt(x)


def xlogy_torch(x: Tensor, y: Tensor) -> Tensor:
    return torch.special.xlogy(x, y)


def xlogy_naive(x: Tensor, y: Tensor) -> Tensor:
    return x * torch.log(y)


# Ours, looked up at call time so that a function being rewritten is picked up as it is.
def ce_stable(x: Tensor, t: Tensor) -> Tensor:
    return _sf().cross_entropy(x, t)


def focal_stable(x: Tensor, t: Tensor) -> Tensor:
    return _sf().focal_loss(x, t, gamma=2.0)


def sigmoid_focal_stable(x: Tensor, t: Tensor) -> Tensor:
    return _sf().sigmoid_focal_loss(x, t, alpha=0.25, gamma=2.0, reduction="mean")


def rmse_stable(x: Tensor, y: Tensor) -> Tensor:
    return _sf().rmse_loss(x, y)


def logcosh_stable(x: Tensor, y: Tensor) -> Tensor:
    return _sf().log_cosh_loss(x, y)


def softmax_stable(x: Tensor) -> Tensor:
    return _sf().softmax(x, -1)


def log_softmax_stable(x: Tensor) -> Tensor:
    return _sf().log_softmax(x, -1)


def logsumexp_stable(x: Tensor) -> Tensor:
    return _sf().logsumexp(x, -1)


def kl_stable(x: Tensor, t: Tensor) -> Tensor:
    return _sf().kl_div(x, t, reduction="batchmean")


def div_stable(a: Tensor, b: Tensor) -> Tensor:
    return _sf().safe_div(a, b)


def sqrt_stable(x: Tensor) -> Tensor:
    return _sf().safe_sqrt(x)


def xlogy_stable(x: Tensor, y: Tensor) -> Tensor:
    return _sf().xlogy(x, y)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

Inputs = Tuple[List[Tensor], Tuple[int, ...]]  # tensors, indices of the differentiable ones


def _randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _class_inputs(shape, dtype, gen) -> Inputs:
    c = shape[1]
    tshape = (shape[0],) + tuple(shape[2:])
    return [_randn(shape, dtype, gen, 2.0), torch.randint(0, c, tshape, generator=gen)], (0,)


def _binary_target_inputs(shape, dtype, gen) -> Inputs:
    t = (torch.rand(shape, generator=gen) < 0.02).to(dtype)
    return [_randn(shape, dtype, gen, 2.0), t], (0,)


def _regression_inputs(shape, dtype, gen) -> Inputs:
    return [_randn(shape, dtype, gen), _randn(shape, dtype, gen)], (0,)


def _logits_inputs(shape, dtype, gen) -> Inputs:
    return [_randn(shape, dtype, gen, 2.0)], (0,)


def _kl_inputs(shape, dtype, gen) -> Inputs:
    x = torch.log_softmax(torch.randn(shape, generator=gen), dim=-1).to(dtype)
    t = torch.softmax(torch.randn(shape, generator=gen), dim=-1).to(dtype)
    return [x, t], (0,)


def _div_inputs(shape, dtype, gen) -> Inputs:
    b = torch.randn(shape, generator=gen)
    b = torch.where(torch.rand(shape, generator=gen) < 0.1, 0.0, b)
    return [_randn(shape, dtype, gen), b.to(dtype)], (0, 1)


def _sqrt_inputs(shape, dtype, gen) -> Inputs:
    x = torch.rand(shape, generator=gen)
    x = torch.where(x < 0.1, 0.0, x)
    return [x.to(dtype)], (0,)


def _xlogy_inputs(shape, dtype, gen) -> Inputs:
    x = torch.rand(shape, generator=gen)
    x = torch.where(x < 0.1, 0.0, x)
    return [x.to(dtype), torch.rand(shape, generator=gen).to(dtype) + 0.01], (0, 1)


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One input shape of one function; ``tiers`` says in which runs it appears."""

    label: str
    shape: Tuple[int, ...]
    kind: str
    tiers: Tuple[str, ...]


@dataclass
class Spec:
    """One function: its inputs, variants and which variant plays which role in the table."""

    name: str
    make: Callable[..., Inputs]
    variants: Dict[str, Callable[..., Tensor]]
    cases: List[Case]
    torch_ref: Optional[str] = "torch"     # the built-in it replaces ("÷ built-in")
    naive_ref: Optional[str] = "naive"     # the naive formula ("÷ naive")
    check_ref: Optional[str] = None        # a variant with the same value, checked after timing
    describe: Dict[str, str] = field(default_factory=dict)


_Q, _D, _FULL = ("quick",), ("default", "full"), ("full",)
_ALL = ("quick", "default", "full")


def _cls_cases() -> List[Case]:
    return [
        Case("8192x1000", (8192, 1000), "classification", _D),
        Case("65536x10", (65536, 10), "few-class", _D),
        Case("256x32000", (256, 32000), "llm-vocab", _FULL),
        Case("16x21x128x128", (16, 21, 128, 128), "segmentation", _FULL),
        Case("1024x1000", (1024, 1000), "classification", _Q),
        Case("4096x10", (4096, 10), "few-class", _Q),
        Case("8x10", (8, 10), "tiny", _ALL),
    ]


def _rows_cases() -> List[Case]:
    return [
        Case("8192x1000", (8192, 1000), "classification", _D),
        Case("256x32000", (256, 32000), "llm-vocab", _FULL),
        Case("1024x1000", (1024, 1000), "classification", _Q),
        Case("8x10", (8, 10), "tiny", _ALL),
    ]


def _elem_cases(default_1e7: bool = False) -> List[Case]:
    return [
        Case("1e6", (1_000_000,), "regression", _D),
        Case("1e7", (10_000_000,), "regression", _D if default_1e7 else _FULL),
        Case("1e5", (100_000,), "regression", _Q),
        Case("16", (16,), "tiny", _ALL),
    ]


@functools.lru_cache(maxsize=None)
def _kornia_available() -> bool:
    import importlib

    try:
        importlib.import_module("kornia.losses")
    except Exception:
        return False
    return True


def specs() -> Dict[str, Spec]:
    """The benchmark registry: one :class:`Spec` per public function, in table order."""
    focal_variants = {"torch": ce_torch, "naive": focal_naive, "kornia": focal_kornia,
                      "stable": focal_stable}
    out = [
        Spec("cross_entropy", _class_inputs, {"torch": ce_torch, "stable": ce_stable},
             _cls_cases(), naive_ref=None, check_ref="torch",
             describe={"torch": "F.cross_entropy"}),
        Spec("focal_loss", _class_inputs, focal_variants, _cls_cases(), check_ref="naive",
             describe={"torch": "F.cross_entropy (the speed reference)",
                       "naive": "softmax -> log -> gather snippet",
                       "kornia": "kornia.losses.focal_loss"}),
        Spec("sigmoid_focal_loss", _binary_target_inputs,
             {"torch": sigmoid_focal_torchvision, "stable": sigmoid_focal_stable},
             [Case("65536x80", (65536, 80), "detection", _D),
              Case("4096x80", (4096, 80), "detection", _Q),
              Case("8x80", (8, 80), "tiny", _ALL)],
             naive_ref=None, check_ref="torch",
             describe={"torch": "torchvision.ops.sigmoid_focal_loss formula, written out"}),
        Spec("rmse_loss", _regression_inputs, {"torch": rmse_torch, "stable": rmse_stable},
             _elem_cases(default_1e7=True), naive_ref=None, check_ref="torch",
             describe={"torch": "torch.sqrt(F.mse_loss(x, y))"}),
        Spec("log_cosh_loss", _regression_inputs, {"naive": logcosh_naive, "stable": logcosh_stable},
             _elem_cases(default_1e7=True), torch_ref=None, check_ref="naive",
             describe={"naive": "torch.log(torch.cosh(x - y)).mean()"}),
        Spec("softmax", _logits_inputs,
             {"torch": softmax_torch, "naive": softmax_naive, "stable": softmax_stable},
             _rows_cases(), check_ref="torch",
             describe={"torch": "torch.softmax", "naive": "exp(x) / exp(x).sum()"}),
        Spec("log_softmax", _logits_inputs,
             {"torch": log_softmax_torch, "naive": log_softmax_naive, "stable": log_softmax_stable},
             _rows_cases(), check_ref="torch",
             describe={"torch": "torch.log_softmax", "naive": "log(exp(x) / exp(x).sum())"}),
        Spec("logsumexp", _logits_inputs,
             {"torch": logsumexp_torch, "naive": logsumexp_naive, "stable": logsumexp_stable},
             _rows_cases(), check_ref="torch",
             describe={"torch": "torch.logsumexp", "naive": "log(exp(x).sum())"}),
        Spec("kl_div", _kl_inputs, {"torch": kl_torch, "naive": kl_naive, "stable": kl_stable},
             _rows_cases(), check_ref="torch",
             describe={"torch": "F.kl_div(reduction='batchmean')",
                       "naive": "(t * (log t - x)).sum() / N"}),
        Spec("safe_div", _div_inputs,
             {"torch": div_torch, "naive": div_where, "naive-double-where": div_double_where,
              "stable": div_stable},
             _elem_cases(), naive_ref="naive-double-where", check_ref="naive-double-where",
             describe={"torch": "torch.div", "naive": "torch.where(b != 0, a / b, 0)",
                       "naive-double-where": "where(b == 0, 0, a / where(b == 0, 1, b))"}),
        Spec("safe_sqrt", _sqrt_inputs, {"torch": sqrt_torch, "stable": sqrt_stable},
             _elem_cases(), naive_ref=None, check_ref="torch", describe={"torch": "torch.sqrt"}),
        Spec("xlogy", _xlogy_inputs,
             {"torch": xlogy_torch, "naive": xlogy_naive, "stable": xlogy_stable},
             _elem_cases(), check_ref="torch",
             describe={"torch": "torch.special.xlogy", "naive": "x * log(y)"}),
    ]
    return {s.name: s for s in out}


def make_inputs(spec: Spec, case: Case, dtype: torch.dtype, device: str, seed: int = 0) -> Inputs:
    """Deterministic inputs for ``case`` (built on CPU, then moved)."""
    gen = torch.Generator().manual_seed(seed)
    tensors, grad_idx = spec.make(case.shape, dtype, gen)
    return [t.to(device) for t in tensors], grad_idx


# --------------------------------------------------------------------------------------------
# Callables
# --------------------------------------------------------------------------------------------

_COMPILE_CACHE: Dict[Tuple[Any, ...], Callable[..., Tensor]] = {}


def configure_compile() -> None:
    """Raise dynamo's recompile limits: the same baseline code object is compiled per shape."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096


def variant_function(spec: Spec, variant: str, key: Tuple[Any, ...] = ()) -> Callable[..., Tensor]:
    """The function of ``variant`` (``stable``, ``torch-compiled``, ...); compiled ones are made
    once per ``key`` and cached. Ours is compiled with ``fullgraph=True``."""
    if variant.endswith("-compiled"):
        base = variant[: -len("-compiled")]
        ck = (spec.name, variant) + tuple(key)
        if ck not in _COMPILE_CACHE:
            configure_compile()
            _COMPILE_CACHE[ck] = torch.compile(
                spec.variants[base], fullgraph=(base == "stable"), dynamic=False
            )
        return _COMPILE_CACHE[ck]
    return spec.variants[variant]


#: Variants that need an optional package, and the check that it is importable.
OPTIONAL = {"kornia": _kornia_available}


def available(variant: str) -> bool:
    """False for a variant whose optional package (kornia) is not installed."""
    check = OPTIONAL.get(variant.replace("-compiled", ""))
    return check is None or check()


def variant_ids(spec: Spec, compiled: bool, only_available: bool = True) -> List[str]:
    """Variant ids in table order: eager ones, ``one-pass``, then the compiled ones."""
    ids = list(spec.variants) + ["one-pass"]
    if compiled:
        ids += [v + "-compiled" for v in spec.variants]
    return [v for v in ids if not only_available or available(v)]


def _sync_fn(device: str) -> Optional[Callable[[], None]]:
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else None


def make_callable(spec: Spec, variant: str, tensors: Sequence[Tensor], grad_idx: Sequence[int],
                  mode: str, device: str, key: Tuple[Any, ...] = ()) -> Callable[[], Any]:
    """A no-argument callable that runs one forward (``fwd``) or forward+backward (``fwdbwd``)
    of ``variant``; on CUDA it synchronizes before returning. Calls it once (this compiles a
    compiled variant and raises what the variant raises, e.g. ``NotImplementedError``)."""
    sync = _sync_fn(device)
    if variant == "one-pass":
        x = tensors[0].detach()

        def one_pass():
            y = torch.neg(x)
            if sync is not None:
                sync()
            return y

        one_pass()
        return one_pass

    f = variant_function(spec, variant, key)
    if mode == "fwd":
        args = [t.detach() for t in tensors]

        def fwd():
            out = f(*args)
            if sync is not None:
                sync()
            return out

        fwd()
        return fwd

    args = [t.detach().requires_grad_(i in grad_idx) for i, t in enumerate(tensors)]
    wrt = [args[i] for i in grad_idx]
    out = f(*args)
    grad_out = None if out.dim() == 0 else torch.ones_like(out)
    torch.autograd.grad(out, wrt, grad_outputs=grad_out)
    del out

    def fwdbwd():
        o = f(*args)
        gs = torch.autograd.grad(o, wrt, grad_outputs=grad_out)
        if sync is not None:
            sync()
        return gs

    return fwdbwd


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------

class _quiet_stderr:
    """Silence file descriptor 2 (kineto prints start/stop lines from C++)."""

    def __enter__(self):
        sys.stderr.flush()
        self.saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        return self

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)
        return False


def peak_memory(call: Callable[[], Any], device: str) -> int:
    """Peak bytes allocated during one ``call()`` above what was allocated before it.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU: the allocation events recorded by
    ``torch.profiler`` with ``profile_memory=True`` (they include the buffers of compiled
    kernels), summed in time order; the maximum of the running sum is the peak.
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
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        res = call()
        del res
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
    events.sort()
    cur = peak = 0
    for _, size in events:
        cur += size
        peak = max(peak, cur)
    return int(peak)


def prefault_heap(device: str, mib: Optional[int] = None) -> int:
    """Grow glibc's heap once by ``mib`` MiB of touched pages (default 1024, or
    ``STABLELOSSES_BENCH_PREFAULT_MB``), then free it.

    With :data:`MALLOC_ENV` in effect the freed pages stay in the heap, so the first calls of
    each shape reuse touched memory instead of page-faulting while the heap grows (without it
    glibc hands the block straight back and this costs only the time to fill it). CPU only;
    returns the bytes touched.
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


def time_per_call(call: Callable[[], Any], n: int) -> float:
    """Seconds per call, averaged over ``n`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n


def warm_and_calibrate(call: Callable[[], Any], sample_s: float, warm_s: float,
                       min_warm: int) -> int:
    """Warm up (allocator pages, caches) and return the calls per sample for ``sample_s``."""
    done, t0 = 0, time.perf_counter()
    while done < min_warm or time.perf_counter() - t0 < warm_s:
        call()
        done += 1
        if done >= 1000:
            break
    per = max(time_per_call(call, 1), 1e-7)
    per = min(per, (time.perf_counter() - t0) / done)
    return max(1, min(100_000, int(round(sample_s / per))))


def interleaved_medians(calls: Dict[str, Callable[[], Any]], inner: Dict[str, int],
                        repeats: int) -> Dict[str, List[float]]:
    """``repeats`` rounds; each round times every variant once, the order rotated per round."""
    names = list(calls)
    times: Dict[str, List[float]] = {v: [] for v in names}
    for r in range(repeats):
        k = r % len(names)
        for v in names[k:] + names[:k]:
            times[v].append(time_per_call(calls[v], inner[v]))
    return times


# --------------------------------------------------------------------------------------------
# Progress, machine info
# --------------------------------------------------------------------------------------------

class Progress:
    """A text progress bar on stderr (tqdm's when tqdm is installed)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.n, self.enabled, self.t0 = total, 0, enabled, time.perf_counter()
        self._tqdm = None
        if enabled:
            try:
                from tqdm import tqdm

                self._tqdm = tqdm(total=total, file=sys.stderr, unit="case", leave=True)
            except Exception:
                self._tqdm = None

    def show(self, label: str) -> None:
        """Name the case now running (text bar only)."""
        if self.enabled and self._tqdm is None:
            self._draw(label)
        elif self._tqdm is not None:
            self._tqdm.set_description_str(label[:48])

    def update(self, label: str) -> None:
        self.n += 1
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.set_description_str(label[:48])
            self._tqdm.update(1)
            return
        self._draw(label)

    def _draw(self, label: str) -> None:
        width = 28
        filled = int(width * self.n / max(self.total, 1))
        el = time.perf_counter() - self.t0
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.n}/{self.total} "
                         f"{el:5.0f}s {label[:48]:<48}")
        sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str) -> Dict[str, Any]:
    info: Dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "malloc_env": {k: os.environ.get(k) for k in MALLOC_ENV},
        "kornia": None,
    }
    try:
        import kornia

        info["kornia"] = kornia.__version__
    except Exception:
        pass
    try:
        info["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda_version"] = torch.version.cuda
    return info


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

@dataclass
class Settings:
    tier: str = "default"
    device: str = "cpu"
    compile: bool = False
    dtypes: Tuple[str, ...] = ("float32",)
    modes: Tuple[str, ...] = MODES
    compile_modes: Optional[Tuple[str, ...]] = None  # modes with compiled variants (None: all)
    only: Optional[Tuple[str, ...]] = None
    repeats: int = 9
    sample_s: float = 0.04
    warm_s: float = 0.15
    min_warm: int = 5
    peak: bool = True


def tier_settings(tier: str) -> Dict[str, Any]:
    if tier == "quick":
        return {"repeats": 3, "sample_s": 0.006, "warm_s": 0.02, "min_warm": 2}
    return {"repeats": 9, "sample_s": 0.04, "warm_s": 0.2, "min_warm": 5}


def selected(settings: Settings) -> List[Tuple[Spec, Case, str]]:
    """(spec, case, dtype) triples of the run, in order."""
    out = []
    for spec in specs().values():
        if settings.only and spec.name not in settings.only:
            continue
        for case in spec.cases:
            if settings.tier not in case.tiers:
                continue
            for dt in settings.dtypes:
                if dt != "float32" and case.kind == "tiny":
                    continue
                out.append((spec, case, dt))
    return out


def _short_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    first = msg[0] if msg else ""
    return f"{type(e).__name__}: {first}"[:200]


def _check_values(a: Any, b: Any, dtype: torch.dtype) -> Optional[str]:
    """None when the two forward outputs agree (loosely: this is a sanity check)."""
    try:
        a, b = a.float(), b.float()
        rtol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
        if not torch.allclose(a, b, rtol=rtol, atol=rtol, equal_nan=True):
            return f"max abs diff {float((a - b).abs().max()):.3g}"
    except Exception as e:  # pragma: no cover - reporting only
        return _short_error(e)
    return None


def run_case(spec: Spec, case: Case, dtype_name: str, settings: Settings,
             records: List[Dict[str, Any]], notes: List[str]) -> None:
    dtype = _DTYPES[dtype_name]
    tensors, grad_idx = make_inputs(spec, case, dtype, settings.device)
    grad_bytes = sum(tensors[i].numel() * tensors[i].element_size() for i in grad_idx)
    input_bytes = sum(t.numel() * t.element_size() for t in tensors)
    base = {"fn": spec.name, "case": case.label, "kind": case.kind, "shape": list(case.shape),
            "dtype": dtype_name, "device": settings.device, "grad_bytes": grad_bytes,
            "input_bytes": input_bytes}
    key = (tuple(case.shape), dtype_name, settings.device)
    for mode in settings.modes:
        calls: Dict[str, Callable[[], Any]] = {}
        inner: Dict[str, int] = {}
        errors: Dict[str, str] = {}
        compiled = settings.compile and (settings.compile_modes is None
                                          or mode in settings.compile_modes)
        for v in variant_ids(spec, compiled):
            try:
                c = make_callable(spec, v, tensors, grad_idx, mode, settings.device, key)
                inner[v] = warm_and_calibrate(c, settings.sample_s, settings.warm_s,
                                              settings.min_warm)
                calls[v] = c
            except Exception as e:  # a variant that fails is reported, the run goes on
                errors[v] = _short_error(e)
        times = interleaved_medians(calls, inner, settings.repeats)
        peaks: Dict[str, int] = {}
        if settings.peak and mode == "fwdbwd":
            for v, c in calls.items():
                try:
                    peaks[v] = peak_memory(c, settings.device)
                except Exception as e:
                    notes.append(f"{spec.name} {case.label} {v}: peak memory failed: {_short_error(e)}")
        mismatch = None
        if mode == "fwd" and spec.check_ref in calls and "stable" in calls:
            mismatch = _check_values(calls["stable"](), calls[spec.check_ref](), dtype)
            if mismatch:
                notes.append(f"{spec.name} {case.label} {dtype_name}: stable differs from "
                             f"{spec.check_ref}: {mismatch}")
        for v in variant_ids(spec, compiled):
            rec = dict(base, mode=mode, variant=v)
            if v in errors:
                rec.update(error=errors[v], median_s=None, times_s=[], inner=0)
            else:
                rec.update(error=None, median_s=statistics.median(times[v]), times_s=times[v],
                           inner=inner[v])
            if v in peaks:
                rec["peak_bytes"] = peaks[v]
            if v == "stable" and mismatch:
                rec["value_mismatch"] = mismatch
            records.append(rec)
        del calls


def run(settings: Settings, progress: bool = True) -> Dict[str, Any]:
    """Run the benchmark and return the JSON-able result (``schema``, ``machine``,
    ``settings``, ``results``, ``notes``, ``describe``)."""
    jobs = selected(settings)
    try:
        load_start: Optional[float] = os.getloadavg()[0]
    except OSError:
        load_start = None
    records: List[Dict[str, Any]] = []
    notes: List[str] = []
    prefault_heap(settings.device)
    bar = Progress(len(jobs), enabled=progress)
    t0 = time.perf_counter()
    done = 0
    try:
        for spec, case, dt in jobs:
            bar.show(f"{spec.name} {case.label} {dt}")
            run_case(spec, case, dt, settings, records, notes)
            done += 1
            bar.update(f"{spec.name} {case.label} {dt}")
    except KeyboardInterrupt:  # e.g. `timeout --signal=INT`: keep what was measured
        notes.append(f"interrupted after {done} of {len(jobs)} cases; the results are partial")
    finally:
        bar.close()
    errors = sorted({(r["fn"], r["variant"], r["error"]) for r in records if r.get("error")})
    for fn, v, err in errors:
        notes.append(f"{fn} {v}: {err}")
    s = dict(settings.__dict__)
    s["only"] = list(settings.only) if settings.only else None
    machine = machine_info(settings.device)
    machine["loadavg_1m_start"] = load_start
    return {
        "schema": SCHEMA,
        "machine": machine,
        "settings": s,
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "describe": {name: sp.describe for name, sp in specs().items()},
        "results": records,
        "notes": notes,
    }


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------

def _index(results: Sequence[Dict[str, Any]]) -> Dict[Tuple, Dict[str, Dict[str, Any]]]:
    out: Dict[Tuple, Dict[str, Dict[str, Any]]] = {}
    for r in results:
        k = (r["fn"], r["case"], r["dtype"], r["device"], r["mode"])
        out.setdefault(k, {})[r["variant"]] = r
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b <= 0 or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def ratio_rows(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per (function, shape, dtype, device, mode) with the ratios of the table."""
    all_specs = specs()
    rows = []
    for (fn, case, dt, dev, mode), vs in _index(result["results"]).items():
        spec = all_specs.get(fn)
        tref = spec.torch_ref if spec else "torch"
        nref = spec.naive_ref if spec else "naive"

        def med(v):
            r = vs.get(v) if v else None
            return r.get("median_s") if r else None

        def peak(v):
            r = vs.get(v) if v else None
            return r.get("peak_bytes") if r else None

        ours = med("stable")
        grad_bytes = next(iter(vs.values()))["grad_bytes"]
        rows.append({
            "fn": fn, "case": case, "dtype": dt, "device": dev, "mode": mode,
            "stable_ms": None if ours is None else ours * 1e3,
            "vs_torch": _ratio(ours, med(tref)),
            "vs_naive": _ratio(ours, med(nref)),
            "vs_kornia": _ratio(ours, med("kornia")),
            "vs_one_pass": _ratio(ours, med("one-pass")),
            "compiled_ms": None if med("stable-compiled") is None else med("stable-compiled") * 1e3,
            "c_vs_torch_c": _ratio(med("stable-compiled"), med(f"{tref or nref}-compiled")),
            "c_vs_torch": _ratio(med("stable-compiled"), med(tref or nref)),
            "peak_mib": None if peak("stable") is None else peak("stable") / 2**20,
            "peak_vs_ref": _ratio(peak("stable"), peak(tref or nref)),
            "peak_vs_grad": _ratio(peak("stable"), grad_bytes),
            "error": (vs.get("stable") or {}).get("error"),
        })
    return rows


_COLUMNS = [
    ("function", "fn", "s"), ("shape", "case", "s"), ("dtype", "dtype", "s"), ("mode", "mode", "s"),
    ("ours ms", "stable_ms", ".3f"), ("÷torch", "vs_torch", ".2f"), ("÷naive", "vs_naive", ".2f"),
    ("÷kornia", "vs_kornia", ".2f"), ("÷1-pass", "vs_one_pass", ".1f"),
    ("comp ms", "compiled_ms", ".3f"), ("comp÷torch-comp", "c_vs_torch_c", ".2f"),
    ("comp÷torch", "c_vs_torch", ".2f"), ("peak MiB", "peak_mib", ".1f"),
    ("peak÷torch", "peak_vs_ref", ".2f"),
    ("peak÷grad", "peak_vs_grad", ".2f"),
]


def format_table(result: Dict[str, Any], markdown: bool = False) -> str:
    """The ratio table as text (or a Markdown table). Columns with no value are left out."""
    rows = ratio_rows(result)
    cols = [c for c in _COLUMNS if c[2] == "s" or any(r.get(c[1]) is not None for r in rows)]

    def cell(r, c):
        v = r.get(c[1])
        if c[1] == "stable_ms" and v is None:
            return "n/a" if not r.get("error") else "ERROR"
        if v is None:
            return "-"
        return v if c[2] == "s" else format(v, c[2])

    body = [[str(cell(r, c)) for c in cols] for r in rows]
    head = [c[0] for c in cols]
    if markdown:
        lines = ["| " + " | ".join(head) + " |",
                 "|" + "|".join("---" if c[2] == "s" else "---:" for c in cols) + "|"]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if cols[i][2] == "s" else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    lines = [fmt(head), "  ".join("-" * w for w in widths)]
    lines += [fmt(b) for b in body]
    return "\n".join(lines)


def format_header(result: Dict[str, Any]) -> str:
    m = result["machine"]
    return (f"stablelosses bench — {m['cpu_model']}, {m['torch_threads']} threads, torch "
            f"{m['torch_version']}, device {result['settings']['device']}"
            + (f" ({m['cuda_device']})" if m.get("cuda_device") else "")
            + f", {m['date_utc']}, tier {result['settings']['tier']}"
            + f", {result['settings']['repeats']} interleaved repeats (medians)")


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _csv(choices: Sequence[str], what: str):
    def parse(s: str) -> Tuple[str, ...]:
        items = tuple(x.strip() for x in s.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(
                f"invalid {what} {', '.join(bad) or repr(s)} (choose from {', '.join(choices)})")
        return items
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="stablelosses bench",
        description="Time stablelosses against the PyTorch built-ins, the naive formulas and a "
                    "one-pass memory-bandwidth floor; print a table of ratios (medians of "
                    "interleaved repeats) and the peak memory of forward+backward.",
        epilog="The JSON written by --json is read by benchmarks/check_targets.py.",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device (default cpu)")
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile'd variants (compiled before timing; slow to build)")
    tier = p.add_mutually_exclusive_group()
    tier.add_argument("--quick", action="store_true",
                      help="small shapes, few repeats (under a minute on 2 CPU cores without --compile)")
    tier.add_argument("--full", action="store_true",
                      help="all shapes (adds LLM-vocabulary and segmentation) and bfloat16")
    p.add_argument("--json", metavar="PATH", help="write the raw numbers to PATH")
    p.add_argument("--markdown", metavar="PATH", help="write the ratio table as Markdown to PATH")
    p.add_argument("--only", type=_csv(list(specs()), "function"), metavar="FN[,FN...]",
                   help="only these functions")
    p.add_argument("--dtype", type=_csv(list(_DTYPES), "dtype"), metavar="DT[,DT...]",
                   help="dtypes (default float32; --full: float32,bfloat16)")
    p.add_argument("--modes", type=_csv(list(MODES), "mode"), metavar="M[,M...]",
                   help="fwd, fwdbwd or both (default both)")
    p.add_argument("--compile-modes", type=_csv(list(MODES), "mode"), metavar="M[,M...]",
                   help="with --compile: the modes that get compiled variants (default: all)")
    p.add_argument("--repeats", type=int, metavar="R", help="interleaved repeats per variant")
    p.add_argument("--threads", type=int, default=2, metavar="T",
                   help="torch.set_num_threads (default 2)")
    p.add_argument("--no-peak", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-reexec", action="store_true",
                   help="do not re-execute with the MALLOC_* environment when it is missing")
    return p


def _reexec(argv: Sequence[str]) -> None:
    env = dict(os.environ)
    env.update({k: v for k, v in MALLOC_ENV.items() if k not in env})
    env["STABLELOSSES_BENCH_REEXEC"] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "stablelosses._bench", *argv], env)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``stablelosses bench``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        build_parser().error(f"argument --repeats: must be >= 1, got {args.repeats}")
    if args.threads < 1:
        build_parser().error(f"argument --threads: must be >= 1, got {args.threads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("stablelosses bench: error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if (not args.no_reexec and not os.environ.get("STABLELOSSES_BENCH_REEXEC")
            and any(k not in os.environ for k in MALLOC_ENV)):
        _reexec(argv)

    tier = "quick" if args.quick else ("full" if args.full else "default")
    kw = tier_settings(tier)
    if args.repeats is not None:
        kw["repeats"] = args.repeats
    dtypes = args.dtype or (("float32", "bfloat16") if tier == "full" else ("float32",))
    settings = Settings(tier=tier, device=args.device, compile=args.compile, dtypes=dtypes,
                        modes=args.modes or MODES, compile_modes=args.compile_modes,
                        only=args.only, peak=not args.no_peak, **kw)
    torch.set_num_threads(args.threads)
    result = run(settings, progress=not args.no_progress)
    print(format_header(result))
    print(format_table(result))
    if result["notes"]:
        print("\nnotes:")
        for n in result["notes"]:
            print(f"  - {n}")
    print(f"\n(ratios: ours ÷ reference, medians; < 1 is faster. peak = bytes allocated during "
          f"one forward+backward. {result['elapsed_s']:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_header(result) + "\n\n" + format_table(result, markdown=True) + "\n")
        print(f"wrote {args.markdown}")
    return 130 if any(n.startswith("interrupted") for n in result["notes"]) else 0


if __name__ == "__main__":
    sys.exit(main())
