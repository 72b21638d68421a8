"""CUDA benchmark and checks of the Triton kernels, one JSON.

Benchmark: class-index cross-entropy, forward+backward, bf16, at the shapes of
``docs/gpu-kernels.md`` (8192×32000 and 8192×128256), and the softmax family at 8192×4096. Rows
per shape: torch eager (``F.cross_entropy``), ``torch.compile`` of it, our torch path, our
kernels, and Liger-Kernel's cross-entropy when ``liger_kernel`` is importable (carry its wheel:
``benchmarks/run_cuda.sh``). Columns: median milliseconds of forward+backward (CUDA events), the
kernel launches of one call (profiler), the peak memory above the inputs, and the fraction of the
HBM bandwidth that one read of the logits plus one write of the gradient would take at that time.
Every variant's loss and gradient are checked against torch in float32.

Checks (``--checks``): no host sync (``torch.cuda.set_sync_debug_mode("error")``) in the forward
and backward of every kernel; a CUDA-graph capture of the kernels replays to the eager values; an
out-of-range target is a device-side assert (in a subprocess: it poisons the CUDA context).

Usage (on a CUDA machine): ``python benchmarks/bench_triton.py --checks --json OUT.json``
(``--quick``: small shapes; ``--device cpu``: a dry run at tiny shapes under
``TRITON_INTERPRET=1``). ``benchmarks/run_cuda.sh`` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import stablelosses as sl
import stablelosses.functional as SF
from stablelosses import _backend

# Peak HBM bandwidth by device name (bytes/s): H100 SXM 3.35 TB/s, H200 4.8 TB/s.
HBM_PEAK = {"H100": 3.35e12, "H200": 4.8e12}
CE_SHAPES = [(8192, 32000, torch.bfloat16), (8192, 128256, torch.bfloat16)]
CE_QUICK = [(1024, 32000, torch.bfloat16)]
SOFTMAX_SHAPES = [(8192, 4096, torch.bfloat16)]
TINY = [(8, 300, torch.bfloat16)]


def _peak_bw(name: str) -> float:
    return next((v for k, v in HBM_PEAK.items() if k in name), 3.35e12)


def _liger() -> Callable | None:
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except ImportError:
        return None
    return lambda x, t: liger_cross_entropy(x, t)


def ce_variants(compile_: bool) -> dict[str, Callable]:
    def ours(name: str) -> Callable:
        def f(x, t):
            with sl.backend(name):
                return SF.cross_entropy(x, t)

        return f

    out: dict[str, Callable] = {"torch eager": F.cross_entropy}
    if compile_:
        out["torch.compile"] = torch.compile(F.cross_entropy, dynamic=False)
    out.update({"ours, torch path": ours("torch"), "ours, triton": ours("triton")})
    liger = _liger()
    if liger is not None:
        out["liger-kernel"] = liger
    return out


def softmax_variants() -> dict[str, dict[str, Callable]]:
    def ours(fn: Callable, name: str) -> Callable:
        def f(x, _g):
            with sl.backend(name):
                return fn(x, -1)

        return f

    out = {}
    for op, ref in (("softmax", torch.softmax), ("log_softmax", torch.log_softmax),
                    ("logsumexp", torch.logsumexp)):
        out[op] = {
            "torch eager": lambda x, _g, ref=ref: ref(x, -1),
            "ours, torch path": ours(getattr(SF, op), "torch"),
            "ours, triton": ours(getattr(SF, op), "triton"),
        }
    return out


def _step(f: Callable, x: torch.Tensor, t: torch.Tensor) -> None:
    x.grad = None
    out = f(x, t)
    out.backward(t if t.is_floating_point() else None)


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def time_ms(f: Callable, x: torch.Tensor, t: torch.Tensor, reps: int) -> float:
    for _ in range(3):
        _step(f, x, t)
    if x.device.type == "cpu":  # the dry run
        t0 = time.perf_counter()
        for _ in range(reps):
            _step(f, x, t)
        return (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        _step(f, x, t)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def launches(f: Callable, x: torch.Tensor, t: torch.Tensor) -> int:
    if x.device.type == "cpu":
        return 0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(f, x, t)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def peak_bytes(f: Callable, x: torch.Tensor, t: torch.Tensor) -> int:
    """Peak allocated memory of one forward+backward above what was allocated before it."""
    if x.device.type == "cpu":
        return 0
    x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(f, x, t)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def copy_bandwidth(dev: str) -> float:
    """Bytes/s of a device-to-device copy of 2 GiB (read + write counted): the practical peak."""
    if dev != "cuda":
        return 0.0
    a = torch.empty(2**30, dtype=torch.int16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    return 10 * 2 * a.numel() * 2 / (s.elapsed_time(e) * 1e-3)


def bench_ce(dev: str, shapes, reps: int, peak: float, rows: list, bad: list) -> None:
    vs = ce_variants(compile_=dev == "cuda")
    for n, v, dtype in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, v, device=dev, dtype=dtype, generator=g).requires_grad_()
        t = torch.randint(0, v, (n,), device=dev, generator=g)
        xf = x.detach().float().requires_grad_()  # the reference: torch in float32
        ref = F.cross_entropy(xf, t)
        (gref,) = torch.autograd.grad(ref, xf)
        del xf
        atol = 2 * torch.finfo(dtype).eps * float(gref.abs().max())
        ideal = 2 * n * v * x.element_size()  # read the logits once, write the gradient once
        for name, f in vs.items():
            t0 = time.time()
            try:
                loss = f(x, t)
                (gx,) = torch.autograd.grad(loss, x)
                ok = bool(torch.allclose(loss.float(), ref, rtol=2e-2, atol=1e-3)
                          and torch.allclose(gx.float(), gref, rtol=2e-2, atol=atol))
                del loss, gx
                ms = time_ms(f, x, t, reps)
                k = launches(f, x, t)
                mem = peak_bytes(f, x, t)
            except Exception as e:  # noqa: BLE001 - a failing variant is a row, not a crash
                print(f"ce {name} {n}x{v}: {type(e).__name__}: {e}", file=sys.stderr)
                bad.append(f"ce {name} {n}x{v}")
                continue
            row = dict(op="cross_entropy", shape=f"{n}x{v}", dtype=str(dtype).replace("torch.", ""),
                       variant=name, ms=ms, launches=k, peak_mib=mem / 2**20, tbps=ideal / ms / 1e9,
                       hbm=ideal / (ms * 1e-3) / peak, ok=ok, setup_s=time.time() - t0)
            rows.append(row)
            if not ok:
                bad.append(f"ce {name} {n}x{v}")
            print(f"{row['shape']:>12} {row['dtype']:>8} {name:>17} {ms:8.3f} ms {k:3d} launches "
                  f"{row['peak_mib']:9.1f} MiB {row['tbps']:6.2f} TB/s {100 * row['hbm']:5.1f}% HBM ok={ok}",
                  flush=True)
        del x, t, ref, gref
        if dev == "cuda":
            torch.cuda.empty_cache()


def bench_softmax(dev: str, shapes, reps: int, peak: float, rows: list, bad: list) -> None:
    for n, v, dtype in shapes:
        g = torch.Generator(device=dev).manual_seed(1)
        x = torch.randn(n, v, device=dev, dtype=dtype, generator=g).requires_grad_()
        for op, vs_op in softmax_variants().items():
            grad = torch.randn((n, v) if op != "logsumexp" else (n,), device=dev, dtype=dtype, generator=g)
            # forward x read + y written, backward x (or y) and g read + dx written
            ideal = (2 if op == "logsumexp" else 5) * n * v * x.element_size()
            xf = x.detach().float().requires_grad_()
            (ref,) = torch.autograd.grad(vs_op["torch eager"](xf, grad.float()), xf, grad.float())
            atol = 2 * torch.finfo(dtype).eps * float(ref.abs().max())
            for name, f in vs_op.items():
                try:
                    (gx,) = torch.autograd.grad(f(x, grad), x, grad)
                    ok = bool(torch.allclose(gx.float(), ref, rtol=2e-2, atol=atol))
                    ms = time_ms(f, x, grad, reps)
                    k = launches(f, x, grad)
                except Exception as e:  # noqa: BLE001 - a failing variant is a row, not a crash
                    print(f"{op} {name} {n}x{v}: {type(e).__name__}: {e}", file=sys.stderr)
                    bad.append(f"{op} {name}")
                    continue
                row = dict(op=op, shape=f"{n}x{v}", dtype=str(dtype).replace("torch.", ""), variant=name,
                           ms=ms, launches=k, tbps=ideal / ms / 1e9, hbm=ideal / (ms * 1e-3) / peak, ok=ok)
                rows.append(row)
                if not ok:
                    bad.append(f"{op} {name}")
                print(f"{row['shape']:>12} {row['dtype']:>8} {op + ': ' + name:>30} {ms:8.3f} ms "
                      f"{k:3d} launches {row['tbps']:6.2f} TB/s {100 * row['hbm']:5.1f}% HBM ok={ok}",
                      flush=True)
        del x


# --- checks ------------------------------------------------------------------------------------


def _kernel_calls(dev: str) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """One forward+backward per kernel (every feature on), returning the outputs and gradients."""
    g = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(64, 1000, device=dev, dtype=torch.bfloat16, generator=g)
    t = torch.randint(0, 1000, (64,), device=dev, generator=g)
    w = torch.rand(1000, device=dev, generator=g)
    keep = torch.rand(64, device=dev, generator=g) > 0.2
    soft = torch.rand(64, 1000, device=dev, generator=g).to(torch.bfloat16)

    def fb(fn: Callable) -> Callable[[], list[torch.Tensor]]:
        def run() -> list[torch.Tensor]:
            xi = x.detach().requires_grad_()
            y = fn(xi)
            (gx,) = torch.autograd.grad(y, xi, torch.ones_like(y))
            return [y, gx]

        return run

    def head() -> list[torch.Tensor]:
        kern = _backend.kernel_for("linear_chunk_head", x.float())
        assert kern is not None
        step = kern(x.float(), t, w, -100, 0.1, None, torch.ones(64, device=dev))
        return [step.loss, step.grad]

    return {
        "cross_entropy": fb(lambda xi: SF.cross_entropy(xi, t, w, label_smoothing=0.1, mask=keep)),
        "focal_loss": fb(lambda xi: SF.focal_loss(xi, t, 2.0, w, reduction="sum")),
        "softmax": fb(lambda xi: SF.softmax(xi, -1)),
        "log_softmax": fb(lambda xi: SF.log_softmax(xi, -1)),
        "logsumexp": fb(lambda xi: SF.logsumexp(xi, -1)),
        "sigmoid_focal_loss": fb(lambda xi: SF.sigmoid_focal_loss(xi, soft, mask=soft > 0.1,
                                                                  reduction="mean")),
        "linear_chunk_head": head,
    }


_OUT_OF_RANGE = """
import torch, stablelosses as sl, stablelosses.functional as SF
sl.set_backend("triton")
x = torch.randn(4, 10, device="cuda")
SF.cross_entropy(x, torch.tensor([1, 2, 3, 10], device="cuda"))
torch.cuda.synchronize()
print("NO ASSERT")
"""


def run_checks(dev: str) -> dict:
    out: dict = {"sync_debug": {}, "graph_capture": {}, "out_of_range": None}
    with sl.backend("triton"):
        calls = _kernel_calls(dev)
        for name, call in calls.items():
            call()  # compile and warm up (lazy initialization may synchronize once)
            _sync(dev)
            try:
                if dev == "cuda":
                    torch.cuda.set_sync_debug_mode("error")
                call()
                out["sync_debug"][name] = "ok"
            except Exception as e:  # noqa: BLE001 - recorded
                out["sync_debug"][name] = f"{type(e).__name__}: {e}"[:300]
            finally:
                if dev == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
        if dev == "cuda":
            for name, call in calls.items():
                try:
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        call()
                    torch.cuda.current_stream().wait_stream(s)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        captured = call()
                    graph.replay()
                    torch.cuda.synchronize()
                    eager = call()
                    same = all(torch.allclose(a.float(), b.float(), equal_nan=True)
                               for a, b in zip(captured, eager))
                    out["graph_capture"][name] = "ok" if same else "replay differs from eager"
                except Exception as e:  # noqa: BLE001 - recorded
                    out["graph_capture"][name] = f"{type(e).__name__}: {e}"[:300]
    if dev == "cuda":
        run = subprocess.run([sys.executable, "-c", _OUT_OF_RANGE], capture_output=True, text=True,
                             timeout=120, env=os.environ.copy())
        text = run.stdout + run.stderr
        asserted = run.returncode != 0 and "NO ASSERT" not in text and (
            "device-side assert" in text or "out of range" in text)
        out["out_of_range"] = {"asserted": asserted, "rc": run.returncode, "tail": text[-600:]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--checks", action="store_true")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cpu: a dry run at tiny shapes (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("bench_triton: needs CUDA (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    name_of = torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)"
    peak = _peak_bw(name_of)
    rows: list = []
    bad: list = []
    result: dict = {"device": name_of, "torch": torch.__version__, "hbm_peak_bytes_per_s": peak}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    result["liger_kernel"] = _liger() is not None
    result["copy_bytes_per_s"] = copy_bandwidth(dev)
    if args.checks:
        checks = run_checks(dev)
        result["checks"] = checks
        fails = [f"{k} {n}" for k in ("sync_debug", "graph_capture")
                 for n, v in checks[k].items() if v != "ok"]
        if checks["out_of_range"] is not None and not checks["out_of_range"]["asserted"]:
            fails.append("out_of_range")
        print("checks:", "all ok" if not fails else fails, flush=True)
        bad += fails
    if not args.no_bench:
        ce = TINY if dev == "cpu" else CE_QUICK if args.quick else CE_SHAPES
        bench_ce(dev, ce, args.reps if dev == "cuda" else 2, peak, rows, bad)
        sm = TINY if dev == "cpu" else SOFTMAX_SHAPES
        bench_softmax(dev, sm, args.reps if dev == "cuda" else 2, peak, rows, bad)
    result["rows"] = rows
    result["failed"] = bad
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
