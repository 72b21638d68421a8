"""Backend selection (``stablelosses.set_backend``, ``backend``, ``STABLELOSSES_BACKEND``): needs
no triton; the kernels themselves are tested in ``tests/test_triton.py``."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

import stablelosses as sl
from stablelosses import _backend


@pytest.fixture(autouse=True)
def _restore_backend(monkeypatch):
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    saved = _backend._global[0]
    yield
    _backend._global[0] = saved


def test_default_is_auto_and_auto_means_torch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert sl.get_backend() == "auto"
    assert not _backend.use_triton(torch.zeros(2, 3))


def test_set_backend_and_context_restore(monkeypatch):
    monkeypatch.setattr(_backend, "triton_installed", lambda: True)
    sl.set_backend("torch")
    assert sl.get_backend() == "torch"
    with sl.backend("triton"):
        assert sl.get_backend() == "triton"
        with sl.backend("auto"):
            assert sl.get_backend() == "auto"
        assert sl.get_backend() == "triton"
    assert sl.get_backend() == "torch"


def test_context_is_thread_local(monkeypatch):
    monkeypatch.setattr(_backend, "triton_installed", lambda: True)
    seen = []
    with sl.backend("triton"):
        t = threading.Thread(target=lambda: seen.append(sl.get_backend()))
        t.start()
        t.join()
    assert seen == ["auto"]


def test_environment_variable(monkeypatch):
    monkeypatch.setenv(_backend.ENV_VAR, "torch")
    assert sl.get_backend() == "torch"
    sl.set_backend("auto")  # an explicit choice wins over the environment
    assert sl.get_backend() == "auto"


@pytest.mark.parametrize("bad", ["cuda", "", None, 1])
def test_bad_names_raise(bad):
    with pytest.raises(ValueError, match="set_backend: backend must be 'auto', 'torch' or 'triton'"):
        sl.set_backend(bad)
    with pytest.raises(ValueError, match="backend: backend must be"):
        with sl.backend(bad):
            pass


def test_bad_environment_variable_raises(monkeypatch):
    monkeypatch.setenv(_backend.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="STABLELOSSES_BACKEND: backend must be"):
        sl.get_backend()


def test_triton_without_the_package_raises(monkeypatch):
    monkeypatch.setattr(_backend, "triton_installed", lambda: False)
    with pytest.raises(RuntimeError, match="set_backend: backend 'triton' needs the triton package"):
        sl.set_backend("triton")


def test_selection_by_device_dtype_and_interpreter(monkeypatch):
    monkeypatch.setattr(_backend, "triton_installed", lambda: True)
    sl.set_backend("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not _backend.use_triton(torch.zeros(2, 3))  # CPU without the interpreter: torch
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _backend.use_triton(torch.zeros(2, 3))
    assert _backend.use_triton(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert not _backend.use_triton(torch.zeros(2, 3, dtype=torch.float64))
    assert not _backend.use_triton(torch.zeros(2, 3, device="meta"))
    # torch.func transforms and forward-mode AD: the torch path (the kernels are first order)
    seen = []

    def f(x):
        seen.append(_backend.use_triton(x))
        return x.sum()

    torch.func.grad(f)(torch.zeros(3))
    with torch.autograd.forward_ad.dual_level():
        seen.append(_backend.use_triton(torch.zeros(3)))
    assert seen == [False, False]


def test_torch_backend_unchanged_results():
    x = torch.randn(4, 5, requires_grad=True)
    t = torch.tensor([0, 1, 2, 3])
    with sl.backend("torch"):
        a = sl.functional.cross_entropy(x, t)
    b = sl.functional.cross_entropy(x, t)
    assert torch.equal(a, b)


def test_import_does_not_import_triton():
    code = "import sys, stablelosses; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_compiled_call_traces_the_torch_path(monkeypatch):
    """Under torch.compile the selection is never traced (no ContextVar or environment lookup
    in the graph): fullgraph compiles with the triton backend selected, and equals eager."""
    monkeypatch.setattr(_backend, "triton_installed", lambda: True)
    x = torch.randn(4, 5)
    t = torch.tensor([0, 1, 2, 3])

    def f(x):
        return sl.functional.cross_entropy(x, t) + sl.functional.logsumexp(x, -1).sum()

    with sl.backend("triton"):
        out = torch.compile(f, fullgraph=True)(x)
    torch.testing.assert_close(out, f(x))
