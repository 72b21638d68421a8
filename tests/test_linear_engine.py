"""The chunk engine (`_autograd/linear.py`) with small test heads, against the unfused float64
computation: values and gradients of every stream's input, weight and bias."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import Tensor

import stablelosses.functional as SF
from stablelosses._autograd.linear import Head, linear_chunks, linear_chunks_reduced


@dataclass(frozen=True)
class LogProbHead(Head):
    """``-log_softmax(u)[t]`` of stream 0 at the label (0 where ``t < 0``)."""

    n_out: int = 1

    def forward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> Tensor:
        (u,), (t,) = logits, rows
        kept = t >= 0
        lp = u.log_softmax(1).gather(1, torch.where(kept, t, 0)[:, None])
        return torch.where(kept[:, None], -lp, 0.0)

    def backward(
        self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...], grad_out: Tensor
    ) -> tuple[Tensor | None, ...]:
        (u,), (t,) = logits, rows
        kept = t >= 0
        s = torch.where(kept[:, None], grad_out, 0.0)
        g = u.softmax(1).mul_(s)
        return (g.scatter_add_(1, torch.where(kept, t, 0)[:, None], -s),)


@dataclass(frozen=True)
class DistillHead(Head):
    """Two streams, two outputs: the student's ``-log p_t`` and ``KL(teacher ‖ student)``."""

    n_out: int = 2

    def forward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> Tensor:
        (s, te), (t,) = logits, rows
        ls, lt = s.log_softmax(1), te.log_softmax(1)
        nll = -ls.gather(1, t[:, None])
        kl = (lt.exp() * (lt - ls)).sum(1, keepdim=True)
        return torch.cat([nll, kl], 1)

    def backward(
        self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...], grad_out: Tensor
    ) -> tuple[Tensor | None, ...]:
        (s, te), (t,) = logits, rows
        ls, lt = s.log_softmax(1), te.log_softmax(1)
        ps, pt = ls.exp(), lt.exp()
        g0, g1 = grad_out[:, :1], grad_out[:, 1:]
        gs = (ps * g0).scatter_add(1, t[:, None], -g0) + g1 * (ps - pt)
        d = lt - ls
        gt = g1 * pt * (d - (pt * d).sum(1, keepdim=True))
        return gs, gt


def _reference(head: Head, streams: list[tuple[Tensor, Tensor, Tensor | None]], t: Tensor) -> Tensor:
    """The head's formula on the whole float64 logits, through autograd (not the head's backward)."""
    us = [x.double() @ w.double().t() + (0.0 if b is None else b.double()) for x, w, b in streams]
    if isinstance(head, LogProbHead):
        kept = t >= 0
        lp = us[0].log_softmax(1).gather(1, torch.where(kept, t, 0)[:, None])
        return torch.where(kept[:, None], -lp, 0.0)
    ls, lt = us[0].log_softmax(1), us[1].log_softmax(1)
    return torch.cat([-ls.gather(1, t[:, None]), (lt.exp() * (lt - ls)).sum(1, keepdim=True)], 1)


def _streams(n: int, specs: list[tuple[int, int, bool]], dtype: torch.dtype = torch.float32,
             seed: int = 0) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for h, v, bias in specs:
        x = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
        w = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_()
        b = torch.randn(v, generator=g).to(dtype).requires_grad_() if bias else None
        out.append((x, w, b))
    return out


def _leaves(streams: list[tuple[Tensor, Tensor, Tensor | None]]) -> list[Tensor]:
    return [v for s in streams for v in s if v is not None]


def _check(head: Head, streams: list[tuple[Tensor, Tensor, Tensor | None]], t: Tensor, chunk: int | None,
           tol: float, reduced: bool = False) -> None:
    n = t.shape[0]
    gen = torch.Generator().manual_seed(1)
    gout = torch.randn(n, head.n_out, generator=gen, dtype=torch.float64)
    leaves = _leaves(streams)
    ref = _reference(head, streams, t)
    ref_grads = torch.autograd.grad((ref * gout).sum(), leaves, allow_unused=True)
    if reduced:
        total, out = linear_chunks_reduced(head, streams, [t], gout, chunk_size=chunk)
        assert not out.requires_grad
        torch.testing.assert_close(total.double(), (ref * gout).sum(), atol=tol, rtol=tol)
        grads = torch.autograd.grad(total * 3.0, leaves, allow_unused=True)
        ref_grads = tuple(None if r is None else 3.0 * r for r in ref_grads)
    else:
        out = linear_chunks(head, streams, [t], chunk_size=chunk)
        grads = torch.autograd.grad((out * gout.to(out.dtype)).sum(), leaves, allow_unused=True)
    assert out.shape == (n, head.n_out)
    torch.testing.assert_close(out.double(), ref.detach(), atol=tol, rtol=tol)
    for leaf, g, r in zip(leaves, grads, ref_grads):
        assert g is not None and g.dtype == leaf.dtype and g.shape == leaf.shape
        torch.testing.assert_close(g.double(), torch.zeros_like(g, dtype=torch.float64) if r is None else r.double(),
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("reduced", [False, True])
@pytest.mark.parametrize("chunk", [None, 1, 3, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_one_stream_matches_float64(chunk: int | None, bias: bool, reduced: bool) -> None:
    streams = _streams(10, [(5, 11, bias)], torch.float64)
    t = torch.tensor([0, 3, 10, -1, 5, 5, 2, -1, 7, 1])
    _check(LogProbHead(), streams, t, chunk, 1e-10, reduced)


@pytest.mark.parametrize("reduced", [False, True])
@pytest.mark.parametrize("chunk", [None, 4])
def test_two_streams_match_float64(chunk: int | None, reduced: bool) -> None:
    streams = _streams(9, [(6, 13, True), (4, 13, False)], torch.float64)
    t = torch.randint(0, 13, (9,), generator=torch.Generator().manual_seed(3))
    _check(DistillHead(), streams, t, chunk, 1e-10, reduced)


def test_float32_inputs_compute_in_float32() -> None:
    streams = _streams(10, [(5, 11, True), (3, 11, True)], torch.float32)
    t = torch.randint(0, 11, (10,), generator=torch.Generator().manual_seed(4))
    _check(DistillHead(), streams, t, 3, 1e-5)
    assert linear_chunks(DistillHead(), streams, [t]).dtype == torch.float32


@pytest.mark.parametrize("reduced", [False, True])
def test_no_rows(reduced: bool) -> None:
    streams = _streams(0, [(5, 11, True), (3, 11, False)])
    t = torch.zeros(0, dtype=torch.long)
    leaves = _leaves(streams)
    if reduced:
        total, out = linear_chunks_reduced(DistillHead(), streams, [t], torch.ones(2), chunk_size=4)
        assert total.item() == 0.0
    else:
        out = linear_chunks(DistillHead(), streams, [t], chunk_size=4)
        total = out.sum()
    assert out.shape == (0, 2)
    grads = torch.autograd.grad(total, leaves)
    for leaf, g in zip(leaves, grads):
        assert g.shape == leaf.shape and bool((g == 0).all())


@pytest.mark.parametrize("reduced", [False, True])
def test_bf16_weight_is_converted_block_by_block(monkeypatch: pytest.MonkeyPatch, reduced: bool) -> None:
    import stablelosses._autograd.linear as engine

    streams = _streams(8, [(6, 10, True)], torch.bfloat16)
    monkeypatch.setattr(engine, "W_BLOCK_BYTES", 3 * 6 * 4)  # 3 vocabulary rows per block
    seen: list[tuple[torch.Size, torch.dtype]] = []
    real_to = Tensor.to

    def spy(self: Tensor, *args: object, **kwargs: object) -> Tensor:
        out = real_to(self, *args, **kwargs)  # type: ignore[call-overload]
        if self.dtype == torch.bfloat16 and out.dtype == torch.float32 and self.dim() == 2 and self.shape[1] == 6:
            seen.append((self.shape, out.dtype))
        return out

    t = torch.tensor([0, 3, 9, -1, 5, 5, 2, 1])
    with monkeypatch.context() as m:
        m.setattr(Tensor, "to", spy)
        _check(LogProbHead(), streams, t, 3, 2e-2, reduced)
    w = streams[0][1]
    # every converted piece of the weight is a block of at most 3 rows; the input's chunks are 3 rows too
    assert all(s[0] <= 3 for s, _ in seen) and any(s[0] == 3 for s, _ in seen)
    assert w.grad is None  # torch.autograd.grad, not .backward


def test_stream_without_grad_gets_no_backward_work() -> None:
    streams = _streams(6, [(5, 7, True), (4, 7, True)])
    teacher = tuple(None if v is None else v.detach() for v in streams[1])
    calls: list[int] = []

    @dataclass(frozen=True)
    class Counting(DistillHead):
        def backward(self, logits, rows, grad_out):  # type: ignore[no-untyped-def]
            calls.append(len(logits))
            return super().backward(logits, rows, grad_out)[0], None

    t = torch.randint(0, 7, (6,), generator=torch.Generator().manual_seed(5))
    out = linear_chunks(Counting(), [streams[0], teacher], [t], chunk_size=4)  # type: ignore[list-item]
    gx, gw = torch.autograd.grad(out.sum(), [streams[0][0], streams[0][1]])
    assert calls == [2, 2] and gx.shape == (6, 5) and gw.shape == (7, 5)


def test_double_backward_raises() -> None:
    streams = _streams(4, [(3, 5, False)], torch.float64)
    t = torch.tensor([0, 1, 2, 3])
    out = linear_chunks(LogProbHead(), streams, [t])
    (gx,) = torch.autograd.grad(out.sum(), [streams[0][0]], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gx.sum().backward()


def test_bad_arguments_raise() -> None:
    x, w = torch.randn(4, 3), torch.randn(5, 3)
    with pytest.raises(ValueError, match="stream 0"):
        linear_chunks(LogProbHead(), [(x, torch.randn(5, 2), None)], [torch.zeros(4, dtype=torch.long)])
    with pytest.raises(ValueError, match="first dim must be N"):
        linear_chunks(LogProbHead(), [(x, w, None)], [torch.zeros(3, dtype=torch.long)])
    with pytest.raises(ValueError, match="chunk_size"):
        linear_chunks(LogProbHead(), [(x, w, None)], [torch.zeros(4, dtype=torch.long)], chunk_size=0)
    with pytest.raises(ValueError, match="bias"):
        linear_chunks(LogProbHead(), [(x, w, torch.zeros(4))], [torch.zeros(4, dtype=torch.long)])


@pytest.mark.slow
@pytest.mark.parametrize("reduced", [False, True])
def test_compiled_matches_eager(reduced: bool) -> None:
    streams = _streams(10, [(6, 13, True), (4, 13, False)])
    t = torch.randint(0, 13, (10,), generator=torch.Generator().manual_seed(6))
    coef = torch.tensor([1.0, 0.5])

    def f(s0x: Tensor, s0w: Tensor, s0b: Tensor, s1x: Tensor, s1w: Tensor, t: Tensor) -> Tensor:
        st = [(s0x, s0w, s0b), (s1x, s1w, None)]
        if reduced:
            return linear_chunks_reduced(DistillHead(), st, [t], coef, chunk_size=4)[0]
        return (linear_chunks(DistillHead(), st, [t], chunk_size=4) * coef).sum()

    args = (*streams[0], streams[1][0], streams[1][1], t)
    leaves = _leaves(streams)
    eager = f(*args)  # type: ignore[arg-type]
    g_eager = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)  # type: ignore[arg-type]
    g_comp = torch.autograd.grad(compiled, leaves)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("reduced", [False, True])
def test_compiled_without_any_gradient_matches_eager(reduced: bool) -> None:
    # nothing requires grad (an evaluation loop): the compiled call must still trace
    x, w = torch.randn(7, 4, dtype=torch.float64), torch.randn(9, 4, dtype=torch.float64)
    t = torch.randint(0, 9, (7,), generator=torch.Generator().manual_seed(8))

    def f(x: Tensor, w: Tensor, t: Tensor) -> Tensor:
        if reduced:
            return linear_chunks_reduced(LogProbHead(), [(x, w, None)], [t], torch.ones(1), chunk_size=3)[0]
        return linear_chunks(LogProbHead(), [(x, w, None)], [t], chunk_size=3).sum()

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, t), f(x, w, t))


@dataclass(frozen=True)
class WeightedLogProbHead(LogProbHead):
    """``scale · w_t · (-log p_t)``: per-class weights as a constant, ``scale`` a numeric field."""

    scale: float = 1.0
    numeric: ClassVar[tuple[str, ...]] = ("scale",)

    def forward(self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...]) -> Tensor:
        t, cw = rows
        return super().forward(logits, (t,)) * cw[t.clamp(min=0)][:, None] * self.scale

    def backward(
        self, logits: tuple[Tensor, ...], rows: tuple[Tensor, ...], grad_out: Tensor
    ) -> tuple[Tensor | None, ...]:
        t, cw = rows
        return super().backward(logits, (t,), grad_out * cw[t.clamp(min=0)][:, None] * self.scale)


def test_consts_are_passed_whole_and_dtype_sets_the_compute_dtype() -> None:
    streams = _streams(9, [(4, 6, True)])
    t = torch.tensor([0, 5, 3, -1, 2, 2, 1, 4, 0])
    cw = torch.rand(6, generator=torch.Generator().manual_seed(7), dtype=torch.float64) + 0.5
    head = WeightedLogProbHead(scale=0.5)
    out = linear_chunks(head, streams, [t], chunk_size=4, consts=[cw], dtype=torch.float64)
    assert out.dtype == torch.float64
    ref = _reference(LogProbHead(), streams, t) * cw[t.clamp(min=0)][:, None] * 0.5
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    leaves = _leaves(streams)
    got = torch.autograd.grad(out.sum(), leaves)
    want = torch.autograd.grad(ref.sum(), leaves)
    for g, r in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_compiled_numeric_field_may_be_symbolic() -> None:
    streams = _streams(8, [(4, 6, False)])
    t = torch.tensor([0, 5, 3, -1, 2, 2, 1, 4])
    cw = torch.ones(6)
    x, w, _ = streams[0]

    def f(x: Tensor, w: Tensor, scale: float) -> Tensor:
        head = WeightedLogProbHead(scale=scale)
        return linear_chunks_reduced(head, [(x, w, None)], [t], torch.ones(1), chunk_size=3, consts=[cw])[0]

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for scale in (0.5, 2.0):  # a Python float argument: a SymFloat under dynamic=True
        got = compiled(x, w, scale)
        want = f(x, w, scale)
        torch.testing.assert_close(got, want)
        for a, b in zip(torch.autograd.grad(got, [x, w]), torch.autograd.grad(want, [x, w])):
            torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_compiled_chunk_op_carries_its_output_width():
    # The outputs' width is an argument of the custom op, so it is in the traced graph and in the
    # compile caches' keys: a cached graph of a head whose state changed width (the token-logps
    # head went from 1 to 2 state columns) was reused, and its fake shapes no longer fit.
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    h, w, lab = torch.randn(4, 3), torch.randn(5, 3), torch.tensor([0, 1, 2, 3])
    torch.compile(lambda a: SF.linear_token_logps(a, w, lab), backend=backend, fullgraph=True)(h)
    calls = [n for gm in graphs for n in gm.graph.nodes
             if n.op == "call_function" and "linear_chunks" in str(n.target)]
    assert calls and all(n.args[1] == 3 for n in calls)  # log p_t, then the state (M, S)
