"""detect_nonfinite under torch.func transforms, threads and torch.compile; signatures kept.

Each test is one way the detector used to break programs that run fine without it: forward-mode
AD crashed the process (a dispatch mode reading forward AD's storage-less zero tangents), vmap,
jacrev and hessian of stablelosses functions raised (a value read on batched tensors), threads
calling stablelosses functions while another opened a context raised KeyError, and signatures
read ``(*args, **kwargs)`` while a context was open.
"""

from __future__ import annotations

import inspect
import sys
import threading
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, hessian, jacrev, jvp, vmap

import stablelosses as sl
import stablelosses.functional as SF
from stablelosses.debug import NonFiniteError, detect_nonfinite

D = torch.float64
_G = torch.Generator().manual_seed(20)
X = torch.randn(4, 3, dtype=D, generator=_G)
V = torch.randn(4, 3, dtype=D, generator=_G)
T = torch.tensor([0, 2, 1, 0])
P = torch.softmax(torch.randn(4, 3, dtype=D, generator=_G), -1)
Y = torch.randn(4, 3, dtype=D, generator=_G)

# a scalar function of one (4, 3) tensor per loss the README advertises jvp and hessian for
LOSSES = {
    "cross_entropy": lambda z: SF.cross_entropy(z, T),
    "focal_loss": lambda z: SF.focal_loss(z, T, gamma=2.0),
    "kl_div": lambda z: SF.kl_div(torch.log_softmax(z, -1), P, reduction="batchmean"),
    "rmse_loss": lambda z: SF.rmse_loss(z, Y),
    "torch": lambda z: (z * 2.0).sum(),
}


def _quiet(fn):
    """fn() inside a detector that must neither report nor say it skipped something; its result."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with detect_nonfinite() as det:
            out = fn()
    assert det.reports == []
    assert [str(w.message) for w in record if "detect_nonfinite" in str(w.message)] == []
    return out


def _outcome(fn):
    """("value", result) or ("raises", type, message): what fn() does."""
    try:
        return ("value", fn())
    except Exception as e:  # noqa: BLE001 - compared below
        return ("raises", type(e), str(e))


def _same(inside, outside):
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(LOSSES))
def test_jvp_inside_the_context(name):
    f = LOSSES[name]
    _same(_quiet(lambda: jvp(f, (X,), (V,))), jvp(f, (X,), (V,)))


@pytest.mark.parametrize("name", list(LOSSES))
def test_forward_ad_inside_the_context(name):
    f = LOSSES[name]

    def tangent():
        with fwAD.dual_level():
            out = f(fwAD.make_dual(X, V))
            return fwAD.unpack_dual(out).primal, fwAD.unpack_dual(out).tangent

    _same(_quiet(tangent), tangent())


@pytest.mark.parametrize("transform", ["hessian", "jacrev(jacrev)"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_second_derivatives_inside_the_context(name, transform):
    # the detector changes nothing: the same Hessian, or the same exception where the op itself
    # does not support that transform without a detector
    f = LOSSES[name]
    second = hessian(f) if transform == "hessian" else jacrev(jacrev(f))
    outside = _outcome(lambda: second(X))
    inside = _outcome(lambda: _quiet(lambda: second(X)))
    assert inside[0] == outside[0], (inside, outside)
    if outside[0] == "value":
        _same(inside[1], outside[1])
        torch.testing.assert_close(outside[1], jacrev(jacrev(f))(X))
    else:
        assert inside[1:] == outside[1:]


def test_per_sample_gradients_and_jacrev_inside_the_context():
    def one(z, t):
        return SF.cross_entropy(z[None], t[None])

    per_sample = _quiet(lambda: vmap(grad(one))(X, T))
    _same(per_sample, vmap(grad(one))(X, T))
    soft = _quiet(lambda: vmap(lambda z: sl.softmax(z, -1))(X))
    _same(soft, torch.softmax(X, -1))
    for f in (lambda z: sl.softmax(z, -1), lambda z: SF.rmse_loss(z, Y, reduction="none")):
        _same(_quiet(lambda: jacrev(f)(X)), jacrev(f)(X))
    # the same result, or the same exception where the op does not support jacrev on its own
    ce = jacrev(lambda z: SF.cross_entropy(z, T, reduction="none"))
    outside, inside = _outcome(lambda: ce(X)), _outcome(lambda: _quiet(lambda: ce(X)))
    assert inside[0] == outside[0] and (outside[0] == "value" or inside[1:] == outside[1:])


def test_a_nan_made_under_vmap_or_jvp_is_still_reported():
    neg = torch.tensor([[4.0, -1.0], [1.0, 9.0]])
    for run in (lambda: vmap(sl.safe_sqrt)(neg), lambda: jvp(sl.safe_sqrt, (neg,), (torch.ones(2, 2),))):
        with pytest.raises(NonFiniteError) as info:
            with detect_nonfinite():
                run()
        err = info.value
        assert err.op == "stablelosses.safe_sqrt" and (err.kind, err.cause) == ("nan", "invalid")
        assert err.inputs[0].min == -1.0  # read from the plain tensor under the wrapper
        assert err.outputs[0].nan == 1


def test_fake_tensors_are_skipped_and_the_detector_says_so_once():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.warns(UserWarning, match="fake tensor") as record:
        with detect_nonfinite() as det:
            with FakeTensorMode() as fake:
                x = fake.from_tensor(torch.tensor([-1.0, 4.0]))
                y = sl.safe_sqrt(x)
                SF.cross_entropy(fake.from_tensor(X), fake.from_tensor(T))
    assert y.shape == (2,) and det.reports == []
    assert sum("fake tensor" in str(w.message) for w in record) == 1


def test_threads_calling_while_contexts_open_and_close():
    # other threads' calls run while this thread opens and closes contexts: they must neither
    # fail nor be checked (their NaN is not this thread's report). A tiny switch interval makes
    # the interpreter change threads often enough to land inside an open or a close.
    small = torch.tensor([4.0])
    want = sl.safe_sqrt(X.abs())
    stop = threading.Event()
    errors: list[BaseException] = []
    calls = [0]

    def worker():
        try:
            while not stop.is_set():
                _same(sl.safe_sqrt(X.abs()), want)
                assert torch.isnan(sl.safe_sqrt(-small)).all() and sl.safe_sqrt(small) == 2.0
                calls[0] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    interval = sys.getswitchinterval()
    threads = [threading.Thread(target=worker) for _ in range(3)]
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for i in range(1000):
            with detect_nonfinite() as det:
                if i % 100 == 0:
                    _same(sl.safe_sqrt(X.abs()), want)
            assert det.reports == []
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
    assert errors == [] and calls[0] > 0


def test_signatures_are_the_real_ones_in_every_thread_while_a_context_is_open():
    import stablelosses.functional._cross_entropy as impl

    real = inspect.signature(impl.cross_entropy)
    assert next(iter(real.parameters)) == "input"
    want = {n: inspect.signature(getattr(SF, n)) for n in SF.__all__}
    seen = {}

    def other():
        seen.update({n: inspect.signature(getattr(SF, n)) for n in SF.__all__})

    with detect_nonfinite():
        assert inspect.signature(SF.cross_entropy) == real
        assert {n: inspect.signature(getattr(SF, n)) for n in SF.__all__} == want
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == want
    for n, sig in want.items():
        # the public object's signature is the implementation's, never the hook's (*args, **kwargs)
        assert sig == inspect.signature(inspect.unwrap(getattr(SF, n))), n
        assert "kwargs" not in sig.parameters, n


@pytest.mark.slow
def test_compiled_fullgraph_with_no_detector_open():
    # the hook is one global read: under torch.compile it is a guard, not a graph break
    torch._dynamo.reset()
    f = torch.compile(lambda z, y: SF.cross_entropy(z, T) + SF.rmse_loss(z, y) + sl.safe_sqrt(z * z).sum(),
                      fullgraph=True, backend="eager")
    want = SF.cross_entropy(X, T) + SF.rmse_loss(X, Y) + X.abs().sum()
    torch.testing.assert_close(f(X, Y), want)
    with detect_nonfinite():  # opened and closed: the count is back to 0, the graph still whole
        pass
    torch.testing.assert_close(f(X * 1.0, Y), want)


@pytest.mark.slow
def test_compiled_fullgraph_model_runs_checked_inside_the_context():
    # a dispatch mode makes Dynamo skip every frame, and fullgraph=True then raised "found no
    # compiled frames": inside the context compiled code runs eagerly, its operators checked
    torch._dynamo.reset()
    compiled = []

    def backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Sequential(torch.nn.Linear(3, 1)))
    with torch.no_grad():
        net[0].weight.fill_(0.5)
    model = torch.compile(net, fullgraph=True, backend=backend)
    x = torch.randn(2, 3)
    with detect_nonfinite() as det:
        model(x).sum().backward()
    assert det.reports == [] and compiled == []
    with pytest.raises(NonFiniteError) as info:
        with detect_nonfinite():
            model(torch.full((2, 3), 3e38)).sum().backward()  # 3 * 3e38 * w with |w| ~ 0.5
    assert info.value.op == "aten::addmm" and info.value.module_path.endswith("0")
    model(x)  # the context closed: compiled again
    assert len(compiled) == 1
