"""Vocabulary-parallel linear losses under torch.distributed: ``python dist_linear.py WORLD``.

WORLD gloo processes on CPU. Each builds the same full problem, keeps its shard of the
vocabulary (plain tensor + ``process_group=``, uneven shards through ``vocab_start=``, and a
``Shard(0)`` DTensor) and checks the loss and the gradients against the one-process
``SF.linear_cross_entropy`` / ``SF.linear_focal_loss`` on the full matrix: float64 to 1e-12
relative, float32 to a few ulp; every rank's loss must be bit-identical. Uneven shards with the
default ``vocab_start`` and empty shards (WORLD 3: torch's split (2, 2, 0) of 4 classes) too. On 2
ranks it also counts the collectives (2 all-reduces in the forward, 1 in the backward, no host
read), checks that a layout with an overlap or a gap raises ValueError, that two heads on one
group whose shard sizes agree on one rank only each get their own layout, and that the output
dtype under autocast and the target-dtype error are the one-process call's, and that
``torch.compile`` gives the eager loss and gradients. Exits 0 when every
case passes on every rank; prints one line per case on rank 0.
"""

from __future__ import annotations

import math
import os
import socket
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

INF = float("inf")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prefixed(prefix: str) -> Callable[[str], str]:
    return lambda message: f"{prefix}: {message}"


def _bounds(v: int, world: int, uneven: bool | str) -> list[int]:
    """Shard starts (world + 1 numbers): even-ish (torch's Shard(0) split), deliberately uneven,
    or with the first or the last rank's shard empty (``'empty_first'`` / ``'empty_last'``)."""
    if uneven == "empty_first":
        return [0, *(0 if r == 0 else (v * r) // (world - 1) for r in range(1, world)), v]
    if uneven == "empty_last":
        return [*((v * r) // (world - 1) for r in range(world)), v]
    if not uneven:
        per = -(-v // world)
        return [min(r * per, v) for r in range(world)] + [v]
    cuts = sorted({max(1, (v * (r + 1)) // (world + 1)) for r in range(world - 1)})
    return [0, *cuts, v]


def _problem(case: dict, dtype: torch.dtype):
    g = torch.Generator().manual_seed(case.get("seed", 0))
    n, h, v = case.get("n", 24), case.get("h", 5), case["v"]
    x = torch.randn(n, h, generator=g, dtype=torch.float64) * 2
    w = torch.randn(v, h, generator=g, dtype=torch.float64)
    b = torch.randn(v, generator=g, dtype=torch.float64)
    t = torch.randint(0, v, (n,), generator=g)
    t[3] = -100
    cw = torch.rand(v, generator=g, dtype=torch.float64) + 0.5
    if case.get("huge_margin"):
        x[0] = 0.0
        b[int(t[0])] = 60.0  # p_t = 1 - ~1e-26: the loss is read off log1p of the rest
    if case.get("tie"):  # row 1's max logit is on the first and on the last shard: R gets its 1
        x[1] = 0.0
        b[0] = b[-1] = b.max() + 1.0
    if case.get("masked_shard") is not None:  # every logit of one shard -inf, no target there
        lo, hi = case["masked_shard"]
        b[lo:hi] = -INF
        t = torch.where((t >= lo) & (t < hi), lo - 1 if lo > 0 else hi, t)
    if case.get("all_masked"):
        b[:] = -INF
    x, w, b, t, cw = (a.to(dtype) if a.is_floating_point() else a for a in (x, w, b, t, cw))
    for c, val in case.get("big", {}).items():  # +inf logits (the limit), or "max": finfo.max
        b[c] = torch.finfo(dtype).max if val == "max" else val
        t[c + 4] = c  # a target at that class
    if case.get("big"):
        cw[4] = 0.0  # a zero class weight: its +inf terms are 0
        t[5] = 4
    return [x, w, b, t, cw]


def _check(case: dict, rank: int, world: int, dtype: torch.dtype) -> str:
    import stablelosses.functional as SF

    x, w, b, t, cw = _problem(case, dtype)
    v = w.shape[0]
    fn = SF.linear_focal_loss if "gamma" in case else SF.linear_cross_entropy
    kw = dict(case.get("kw", {}))
    if "gamma" in case:
        kw["gamma"] = case["gamma"]
    mask = None
    if case.get("mask"):
        mask = torch.ones(x.shape[0], dtype=torch.bool)
        mask[::5] = False
        kw["mask"] = mask
    use_b = case.get("bias", True)
    cw_mode = case.get("class_weight")  # None | "replicated" | "sharded"
    bounds = _bounds(v, world, case.get("uneven", False))
    lo, hi = bounds[rank], bounds[rank + 1]
    # one process, full matrix
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    bs = b.clone().requires_grad_() if use_b else None
    full_kw = dict(kw, weight=cw if cw_mode else None, chunk_size=case.get("chunk", 7))
    ref = fn(xs, ws, t, linear_bias=bs, **full_kw)
    go = torch.linspace(0.5, 1.5, ref.numel(), dtype=ref.dtype).reshape(ref.shape)
    ref_g = torch.autograd.grad(ref, [a for a in (xs, ws, bs) if a is not None], go)
    # the sharded call
    xp = x.clone().requires_grad_()
    if case.get("dtensor"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        wp = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
        bp = distribute_tensor(b, mesh, [Shard(0)]).requires_grad_() if use_b else None
        lo, hi = bounds_dt = _bounds(v, world, False)[rank], _bounds(v, world, False)[rank + 1]
        del bounds_dt
        cwp = None
        if cw_mode == "sharded":
            cwp = distribute_tensor(cw, mesh, [Shard(0)])
        elif cw_mode == "replicated":
            cwp = cw
        got = fn(xp, wp, t, linear_bias=bp, weight=cwp, chunk_size=case.get("chunk", 5), **kw)
        leaves = [a for a in (xp, wp, bp) if a is not None]
        grads = list(torch.autograd.grad(got, leaves, go))
        grads = [g.full_tensor()[lo:hi] if hasattr(g, "full_tensor") else g for g in grads]
    else:
        wp = w[lo:hi].clone().requires_grad_()
        bp = b[lo:hi].clone().requires_grad_() if use_b else None
        cwp = {"sharded": cw[lo:hi], "replicated": cw, None: None}[cw_mode]
        got = fn(xp, wp, t, linear_bias=bp, weight=cwp, chunk_size=case.get("chunk", 5),
                 process_group=dist.group.WORLD,
                 vocab_start=None if v % world == 0 or case.get("default_start") else lo, **kw)
        grads = list(torch.autograd.grad(got, [a for a in (xp, wp, bp) if a is not None], go))
    expected = [ref_g[0], ref_g[1][lo:hi]] + ([ref_g[2][lo:hi]] if use_b else [])
    ulp = torch.finfo(dtype).eps
    rtol, atol = (1e-12, 1e-14) if dtype == torch.float64 else (4 * ulp, 4 * ulp)
    torch.testing.assert_close(got, ref, equal_nan=True, rtol=rtol, atol=atol)
    if case.get("big"):  # and the row core on the materialized logits (the limit on +inf rows)
        core = (SF.focal_loss if "gamma" in case else SF.cross_entropy)(
            torch.nn.functional.linear(x, w, b), t, weight=cw if cw_mode else None, **kw)
        torch.testing.assert_close(got, core, rtol=rtol, atol=atol)
    grtol, gatol = (rtol, atol) if dtype == torch.float64 else (1e-5, 1e-6)
    for name, a, e in zip(("input", "weight", "bias"), grads, expected):
        torch.testing.assert_close(a, e, rtol=grtol, atol=gatol, msg=_prefixed(f"{case['name']}: grad {name}"))
    # every rank holds the identical loss, bit for bit
    mine = got.detach().reshape(-1).clone()
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    assert all(torch.equal(e, mine) or (e.isnan() & mine.isnan()).all() for e in every), case["name"]
    fin = torch.isfinite(ref.reshape(-1))  # the error of the finite entries (+inf rows: equal above)
    g64, r64 = got.reshape(-1)[fin].double(), ref.reshape(-1)[fin].double()
    err = ((g64 - r64).abs() / r64.abs().clamp(min=1e-300)).max().item() if fin.any() else math.nan
    return f"{case['name']}: ok (max relative error {err:.2e})"


CASES = [
    dict(name="mean (default vocab_start)", v=12),
    dict(name="mean", v=11),
    dict(name="sum z softcap smoothing replicated-weight", v=11, kw=dict(reduction="sum", z_loss=1e-2,
         softcap=3.0, label_smoothing=0.1), class_weight="replicated"),
    dict(name="none sharded-weight smoothing mask uneven", v=11, kw=dict(reduction="none", label_smoothing=0.2),
         class_weight="sharded", mask=True, uneven=True),
    dict(name="focal mean z", v=11, gamma=2.0, kw=dict(z_loss=1e-3)),
    dict(name="masked shard smoothing z", v=12, masked_shard=(6, 12), kw=dict(label_smoothing=0.1, z_loss=1e-2)),
    dict(name="all masked (NaN mean, zero grads)", v=11, all_masked=True),
    dict(name="huge margin (exact tail)", v=11, huge_margin=True, kw=dict(reduction="none")),
    dict(name="no bias", v=9, bias=False, kw=dict(reduction="sum")),
    dict(name="tie at the max across shards", v=11, tie=True, kw=dict(reduction="none", label_smoothing=0.1)),
    dict(name="float32 smoothing z", v=11, dtype=torch.float32, kw=dict(label_smoothing=0.1, z_loss=1e-3)),
    dict(name="dtensor smoothing z softcap", v=11, dtensor=True, kw=dict(label_smoothing=0.1, z_loss=1e-2,
         softcap=4.0)),
    dict(name="dtensor none sharded-weight", v=11, dtensor=True, kw=dict(reduction="none"),
         class_weight="sharded"),
    dict(name="dtensor focal float32", v=11, dtensor=True, gamma=1.5, dtype=torch.float32),
]
CASES += [
    dict(name="uneven shards, default vocab_start", v=11, uneven=True, default_start=True,
         kw=dict(label_smoothing=0.1), class_weight="replicated"),
    dict(name="empty last shard, default vocab_start", v=9, uneven="empty_last", default_start=True,
         kw=dict(reduction="none", label_smoothing=0.1, z_loss=1e-2), class_weight="sharded"),
    dict(name="empty first shard focal softcap", v=9, uneven="empty_first", gamma=2.0, kw=dict(softcap=3.0)),
    dict(name="+inf logits on both shards smoothing weight", v=11, big={2: INF, 8: INF},
         kw=dict(reduction="none", label_smoothing=0.1), class_weight="replicated"),
    dict(name="+inf logit focal weight", v=11, big={8: INF}, gamma=2.0, dtype=torch.float32,
         kw=dict(reduction="none"), class_weight="sharded"),
    dict(name="finfo.max logit, no +inf, smoothing weight", v=11, big={2: "max"},
         kw=dict(reduction="none", label_smoothing=0.1), class_weight="replicated"),
]
CASES_3 = [  # torch's even split of V = 4 over 3 ranks is (2, 2, 0)
    dict(name="3 ranks (2, 2, 0) default vocab_start", v=4, n=10, default_start=True,
         kw=dict(label_smoothing=0.1), class_weight="replicated"),
    dict(name="3 ranks dtensor (2, 2, 0) none", v=4, n=10, dtensor=True, kw=dict(reduction="none", z_loss=1e-2)),
]
CASES_4 = [
    dict(name="4 ranks uneven smoothing z", v=13, uneven=True, kw=dict(label_smoothing=0.1, z_loss=1e-2),
         class_weight="replicated"),
    dict(name="4 ranks dtensor (4, 4, 4, 1) none", v=13, dtensor=True, kw=dict(reduction="none", softcap=3.0)),
    dict(name="4 ranks float32 focal mask", v=13, gamma=2.0, dtype=torch.float32, mask=True),
]


def _collectives(rank: int, world: int) -> list[str]:
    """The forward makes 2 all-reduces, the backward 1, no host read once the layout is known;
    a layout that does not cover the vocabulary exactly once raises ValueError on every rank."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import stablelosses.functional as SF

    x, w, b, t, _ = _problem(dict(v=11, seed=1), torch.float64)
    lo, hi = _bounds(11, world, True)[rank : rank + 2]
    xp, wp, bp = x.clone().requires_grad_(), w[lo:hi].clone().requires_grad_(), b[lo:hi].clone().requires_grad_()
    kw = dict(linear_bias=bp, label_smoothing=0.1, z_loss=1e-3, chunk_size=5, process_group=dist.group.WORLD)
    SF.linear_cross_entropy(xp, wp, t, **kw)  # the first call checks the layout (one all-gather)
    counts: dict[str, int] = {}
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_gather_into_tensor")}

    def counting(name: str) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            counts[name] = counts.get(name, 0) + 1
            return real[name](*args, **kwargs)

        return call

    class NoHostRead(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten._local_scalar_dense.default:
                raise AssertionError("a value was read on the host")
            return func(*args, **(kwargs or {}))

    for name in real:
        setattr(dist, name, counting(name))
    try:
        with NoHostRead():
            loss = SF.linear_cross_entropy(xp, wp, t, **kw)
            forward = dict(counts)
            loss.backward()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    assert forward == {"all_reduce": 2}, forward
    assert counts == {"all_reduce": 3}, counts
    lines = [f"collectives: ok (forward {forward}, forward and backward {counts}, no host read)"]
    for what, start in (("overlap", 0), ("gap", lo + (rank == world - 1))):
        # a fresh group: the layout is checked on the first call per (group, rows, vocab_start)
        group = dist.new_group(list(range(world)))
        try:
            SF.linear_cross_entropy(xp, wp, t, linear_bias=bp, process_group=group, vocab_start=start)
        except ValueError as e:
            assert "do not cover the 11 classes [0, 11) exactly once" in str(e), str(e)
        else:
            raise AssertionError(f"a layout with a {what} did not raise")
        lines.append(f"layout with a {what} raises ValueError: ok")
    return lines


def _two_heads(rank: int, world: int) -> list[str]:
    """Two heads on one group whose shards agree in size on rank 0 and not on rank 1 (8 classes
    split 4 + 4, 9 split 4 + 5), each called twice in turn: every rank checks each head's layout
    once, and each loss is the one-process loss (rank 0 used to take head B's layout from its
    cache while rank 1 waited in the all-gather: a hang, here a timeout of the group)."""
    import datetime

    import stablelosses.functional as SF

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=30))
    heads = []
    for v, seed in ((8, 3), (9, 4)):
        x, w, _, t, _ = _problem(dict(v=v, seed=seed), torch.float64)
        lo, hi = [0, 4, v][rank : rank + 2]
        heads.append((x, w, w[lo:hi].clone(), t))
    for _ in range(2):
        for x, w, shard, t in heads:
            got = SF.linear_cross_entropy(x, shard, t, process_group=group)
            torch.testing.assert_close(got, SF.linear_cross_entropy(x, w, t), rtol=1e-12, atol=0)
    return ["two heads on one group, shard sizes agreeing on one rank only: ok"]


def _as_one_process(rank: int, world: int) -> list[str]:
    """What the one-process call settles without a value: its output dtype under autocast
    (float32 for bfloat16 inputs, as torch's loss) and its target-dtype error (int32 refused)."""
    import stablelosses.functional as SF

    x, w, _, t, _ = _problem(dict(v=11, seed=2), torch.float32)
    lo, hi = _bounds(11, world, True)[rank : rank + 2]
    kw = dict(process_group=dist.group.WORLD, vocab_start=lo)
    lines = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        xb, wb = x.bfloat16(), w.bfloat16()
        one = SF.linear_cross_entropy(xb, wb, t)
        sharded = SF.linear_cross_entropy(xb, wb[lo:hi], t, **kw)
    assert sharded.dtype == one.dtype == torch.float32, (sharded.dtype, one.dtype)
    torch.testing.assert_close(sharded, one)
    lines.append("bfloat16 under autocast gives float32, as one process: ok")
    for fn in (SF.linear_cross_entropy, SF.linear_focal_loss):
        try:
            fn(x, w[lo:hi], t.int(), **kw)
        except RuntimeError as e:
            assert "target must hold class indices (int64 or uint8)" in str(e), str(e)
        else:
            raise AssertionError(f"{fn.__name__}: an int32 target did not raise")
    lines.append("an int32 target raises RuntimeError, as one process: ok")
    # torch.compile: the sharded call runs eagerly inside the compiled function (a graph break;
    # Dynamo crashed reconstructing its head), so the loss and gradients are the eager ones
    xs, ws = x.clone().requires_grad_(), w[lo:hi].clone().requires_grad_()
    xe, we = x.clone().requires_grad_(), w[lo:hi].clone().requires_grad_()
    kw = dict(kw, label_smoothing=0.1, z_loss=1e-3)
    compiled = torch.compile(lambda x, w: SF.linear_cross_entropy(x, w, t, **kw) * 2.0, backend="aot_eager")
    got, want = compiled(xs, ws), SF.linear_cross_entropy(xe, we, t, **kw) * 2.0
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(got, [xs, ws]), torch.autograd.grad(want, [xe, we])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    lines.append("under torch.compile the eager loss and gradients: ok")
    return lines


def _worker(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case in {2: CASES, 3: CASES_3, 4: CASES_4}[world]:
            dtype = case.get("dtype", torch.float64)
            assert isinstance(dtype, torch.dtype)
            line = _check(case, rank, world, dtype)
            if rank == 0:
                print(line, flush=True)
        if world == 2:
            for line in _collectives(rank, world) + _two_heads(rank, world) + _as_one_process(rank, world):
                if rank == 0:
                    print(line, flush=True)
    finally:
        dist.destroy_process_group()


def main() -> int:
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    # fork where there is one: this parent has run no torch op yet, and it saves interpreter starts
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    mp.start_processes(_worker, args=(world, _free_port()), nprocs=world, join=True, start_method=method)
    print(f"all cases passed on {world} ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
