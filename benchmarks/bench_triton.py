"""CUDA benchmark of the Triton kernels: cross-entropy and the softmax family,
forward+backward, one table.

Rows per shape: torch eager (``F.cross_entropy``), torch.compile of it, our torch path, our
kernels, and Liger-Kernel's cross-entropy when ``liger_kernel`` is importable. Columns: median
milliseconds of forward+backward (CUDA events), the kernel launches of one call (profiler), and
the bytes of one read of the logits plus one write of the gradient per second, against the
4.8 TB/s HBM peak of an H200. Every variant's loss and gradient are checked against torch eager.
The softmax rows count the ideal bytes of forward+backward: x read and y written, then y and the
incoming gradient read and the gradient written (logsumexp: x read, the gradient written).

Usage (on a CUDA machine): ``python benchmarks/bench_triton.py --json OUT.json --markdown OUT.md``
(``--quick``: small shapes only). ``benchmarks/run_cuda.sh`` runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import stablelosses as sl
import stablelosses.functional as SF

HBM_PEAK = 4.8e12  # bytes/s, H200
SHAPES = [  # (N, V, dtype)
    (8192, 131072, torch.bfloat16),
    (8192, 1000, torch.float32),
    (65536, 10, torch.float32),
    (4096, 32768, torch.bfloat16),
]
QUICK = [(1024, 4096, torch.bfloat16), (1024, 1000, torch.float32)]
# softmax family, forward+backward: (N, V, dtype); ideal bytes = read x + write y (forward) and
# read y + read g + write dx (backward; logsumexp: read x, write dx)
SOFTMAX_SHAPES = [(8192, 4096, torch.bfloat16), (8192, 4096, torch.float32), (4096, 32768, torch.bfloat16)]
SOFTMAX_QUICK = [(1024, 4096, torch.bfloat16)]


def _liger():
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except ImportError:
        return None
    return lambda x, t: liger_cross_entropy(x, t)


def variants(compile_: bool = True):
    compiled = torch.compile(F.cross_entropy, dynamic=False)

    def ours(name):
        def f(x, t):
            with sl.backend(name):
                return SF.cross_entropy(x, t)

        return f

    out = {"torch eager": F.cross_entropy}
    if compile_:
        out["torch.compile"] = compiled
    out.update({"ours, torch path": ours("torch"), "ours, triton": ours("triton")})
    liger = _liger()
    if liger is not None:
        out["liger-kernel"] = liger
    return out


def _step(f, x, t):
    x.grad = None
    out = f(x, t)
    out.backward(t if t.is_floating_point() else None)


def softmax_variants():
    def ours(fn, name):
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


def time_ms(f, x, t, reps: int) -> float:
    for _ in range(3):
        _step(f, x, t)
    if x.device.type == "cpu":  # the --device cpu dry run (under TRITON_INTERPRET=1)
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


def launches(f, x, t) -> int:
    from torch.profiler import ProfilerActivity, profile

    if x.device.type == "cpu":
        return 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(f, x, t)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--markdown")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cpu: a dry run at tiny shapes (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("bench_triton: needs CUDA (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    rows, bad = [], []
    vs = variants(compile_=dev == "cuda")
    name_of = torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)"
    tiny = [(8, 300, torch.bfloat16), (8, 100, torch.float32)]
    for n, v, dtype in tiny if dev == "cpu" else QUICK if args.quick else SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, v, device=dev, dtype=dtype, generator=g).requires_grad_()
        t = torch.randint(0, v, (n,), device=dev, generator=g)
        xf = x.detach().float().requires_grad_()  # the reference: torch in float32
        ref = F.cross_entropy(xf, t)
        (gref,) = torch.autograd.grad(ref, xf)
        atol = 2 * torch.finfo(dtype).eps * float(gref.abs().max())
        ideal = 2 * n * v * x.element_size()  # read the logits, write the gradient
        for name, f in vs.items():
            t0 = time.time()
            try:
                loss = f(x, t)
                (gx,) = torch.autograd.grad(loss, x)
                ok = torch.allclose(loss.float(), ref, rtol=2e-2, atol=1e-3) and torch.allclose(
                    gx.float(), gref, rtol=2e-2, atol=atol)
                ms = time_ms(f, x, t, args.reps)
                k = launches(f, x, t)
            except Exception as e:  # noqa: BLE001 - a failing variant is a row, not a crash
                print(f"{name} {n}x{v}: {type(e).__name__}: {e}", file=sys.stderr)
                bad.append(name)
                continue
            row = dict(shape=f"{n}x{v}", dtype=str(dtype).replace("torch.", ""), variant=name, ms=ms,
                       launches=k, tbps=ideal / ms / 1e9, hbm=ideal / ms / 1e-3 / HBM_PEAK, ok=ok,
                       setup_s=time.time() - t0)
            rows.append(row)
            if not ok:
                bad.append(name)
            print(f"{row['shape']:>12} {row['dtype']:>8} {name:>17} {ms:8.3f} ms {k:3d} launches "
                  f"{row['tbps']:6.2f} TB/s {100 * row['hbm']:5.1f}% HBM  ok={ok}", flush=True)
        del x, t, ref, gref
        torch.cuda.empty_cache()
    for n, v, dtype in tiny[:1] if dev == "cpu" else SOFTMAX_QUICK if args.quick else SOFTMAX_SHAPES:
        g = torch.Generator(device=dev).manual_seed(1)
        x = torch.randn(n, v, device=dev, dtype=dtype, generator=g).requires_grad_()
        for op, vs_op in softmax_variants().items():
            grad = torch.randn((n, v) if op != "logsumexp" else (n,), device=dev, dtype=dtype, generator=g)
            ideal = (2 if op == "logsumexp" else 5) * n * v * x.element_size()
            xf = x.detach().float().requires_grad_()  # the reference: torch in float32
            (ref,) = torch.autograd.grad(vs_op["torch eager"](xf, grad.float()), xf, grad.float())
            atol = 2 * torch.finfo(dtype).eps * float(ref.abs().max())
            for name, f in vs_op.items():
                try:
                    (gx,) = torch.autograd.grad(f(x, grad), x, grad)
                    ok = torch.allclose(gx.float(), ref, rtol=2e-2, atol=atol)
                    ms = time_ms(f, x, grad, args.reps)
                    k = launches(f, x, grad)
                except Exception as e:  # noqa: BLE001 - a failing variant is a row, not a crash
                    print(f"{op} {name} {n}x{v}: {type(e).__name__}: {e}", file=sys.stderr)
                    bad.append(f"{op} {name}")
                    continue
                row = dict(shape=f"{n}x{v}", dtype=str(dtype).replace("torch.", ""), variant=f"{op}: {name}",
                           ms=ms, launches=k, tbps=ideal / ms / 1e9, hbm=ideal / ms / 1e-3 / HBM_PEAK, ok=ok)
                rows.append(row)
                if not ok:
                    bad.append(f"{op} {name}")
                print(f"{row['shape']:>12} {row['dtype']:>8} {row['variant']:>30} {ms:8.3f} ms "
                      f"{k:3d} launches {row['tbps']:6.2f} TB/s {100 * row['hbm']:5.1f}% HBM  ok={ok}",
                      flush=True)
        del x
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": name_of, "torch": torch.__version__, "rows": rows}, fh,
                      indent=1)
    if args.markdown:
        lines = [f"Device: {name_of}, torch {torch.__version__}", "",
                 "| shape | dtype | variant | fwd+bwd ms | launches | TB/s (1 read + 1 write) "
                 "| % of HBM peak |",
                 "|---|---|---|---:|---:|---:|---:|"]
        lines += [f"| {r['shape']} | {r['dtype']} | {r['variant']} | {r['ms']:.3f} | {r['launches']} | "
                  f"{r['tbps']:.2f} | {100 * r['hbm']:.1f} |" for r in rows]
        with open(args.markdown, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
