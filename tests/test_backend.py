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


@pytest.mark.slow
def test_compiled_call_that_first_loads_the_package_reads_no_kernel_table():
    """A compiled function whose trace first touches ``stablelosses.<name>`` loads the package,
    and with it the kernels, which fill the backend table mid-trace. The table was read (and
    guarded) before that by a ``stablelosses.functional`` call in the same trace: Dynamo's
    "Guard failed on the same frame it was created" (fresh process: the import order is the
    point)."""
    code = (
        "import torch\n"
        "import stablelosses.functional as SF\n"
        "import stablelosses as sl\n"
        "x, t = torch.randn(4, 5), torch.tensor([0, 1, 2, 3])\n"
        "f = lambda z: SF.cross_entropy(z, t) + sl.safe_sqrt(z * z).sum()\n"
        "out = torch.compile(f, fullgraph=True, backend='eager')(x)\n"
        "torch.testing.assert_close(out, f(x))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the backend table: the kernels register on top, the core asks after its checks ------------

import ast  # noqa: E402
import pathlib  # noqa: E402

import stablelosses.functional as SF  # noqa: E402

_PKG = pathlib.Path(sl.__file__).parent


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every module a file imports (``from a import b`` counts as ``a`` and ``a.b``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_the_core_imports_no_kernels_and_the_kernels_no_public_functions():
    core = [*(_PKG / "functional").glob("*.py"), *(_PKG / "_autograd").glob("*.py"), _PKG / "losses.py",
            _PKG / "_backend.py", _PKG / "_utils.py"]
    for path in core:
        bad = {m for m in _imported_modules(path) if m.startswith("stablelosses._triton")}
        assert not bad, f"{path.relative_to(_PKG)} imports {bad}"
    for path in (_PKG / "_triton").glob("*.py"):
        bad = {m for m in _imported_modules(path) if m.startswith("stablelosses.functional")}
        assert not bad, f"{path.relative_to(_PKG)} imports {bad}"


def test_the_kernels_are_registered_by_import_stablelosses():
    assert {"cross_entropy", "focal_loss", "softmax", "log_softmax", "logsumexp", "sigmoid_focal_loss",
            "linear_chunk_head"} <= set(_backend._KERNELS)


@pytest.fixture
def spy(monkeypatch):
    """Every registered kernel replaced by a recorder that declines (the torch path runs), and
    the kernels selected for every tensor."""
    calls = []
    monkeypatch.setattr(_backend, "use_triton", lambda x: True)
    for name in list(_backend._KERNELS):
        monkeypatch.setitem(_backend._KERNELS, name,
                            lambda *a, name=name, **k: calls.append((name, a, k)))
    return calls


_X, _T = torch.randn(3, 4), torch.tensor([0, 1, 2])
BAD_CALLS = [
    ("cross_entropy", lambda: SF.cross_entropy(_X, _T, reduction="avg"), ValueError, "reduction must be"),
    ("cross_entropy", lambda: SF.cross_entropy(_X, _T, label_smoothing=1.5), RuntimeError, "label_smoothing"),
    ("cross_entropy", lambda: SF.cross_entropy(_X, _T, ignore_index=1.5), TypeError, "ignore_index"),
    ("focal_loss", lambda: SF.focal_loss(_X, _T, gamma=-1.0), ValueError, "gamma"),
    ("focal_loss", lambda: SF.focal_loss(_X, _T, reduction="avg"), ValueError, "reduction must be"),
    ("softmax", lambda: SF.softmax(_X, 2), IndexError, "dim"),
    ("log_softmax", lambda: SF.log_softmax(_X, -1, mask=torch.ones(3, 4)), TypeError, "mask"),
    ("logsumexp", lambda: SF.logsumexp(_X, -1, keepdim=1), TypeError, "keepdim"),
    ("sigmoid_focal_loss", lambda: SF.sigmoid_focal_loss(_X, _X, alpha=2.0), ValueError, "alpha"),
    ("sigmoid_focal_loss", lambda: SF.sigmoid_focal_loss(_X, _X[:2]), ValueError, "size"),
]


@pytest.mark.parametrize("name,call,exc,match", BAD_CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CALLS)])
def test_argument_checks_run_before_any_kernel_dispatch(spy, name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()
    assert spy == []


def test_a_kernel_gets_the_checked_arguments_and_declining_runs_the_torch_path(spy):
    ref = torch.nn.functional.cross_entropy(_X, _T, reduction="sum", label_smoothing=0.5)
    out = SF.cross_entropy(_X, _T, size_average=False, label_smoothing=1 / 2)  # legacy: 'sum'
    torch.testing.assert_close(out, ref)
    ((name, args, kw),) = spy
    assert name == "cross_entropy" and args[4] == "sum" and type(args[5]) is float
    assert kw["torch_path"].__name__ == "cross_entropy"
    SF.log_softmax(_X, -1)
    SF.logsumexp(_X, [1])
    assert spy[1][0] == "log_softmax" and spy[1][1][1] == 1  # dim wrapped
    assert spy[2][0] == "logsumexp" and tuple(spy[2][1][1]) == (1,)


def test_a_kernels_result_is_returned(monkeypatch):
    monkeypatch.setattr(_backend, "use_triton", lambda x: True)
    monkeypatch.setitem(_backend._KERNELS, "softmax", lambda x, *a: torch.full_like(x, 7.0))
    assert torch.equal(SF.softmax(_X, -1), torch.full_like(_X, 7.0))
    monkeypatch.setattr(_backend, "use_triton", lambda x: False)
    torch.testing.assert_close(SF.softmax(_X, -1), torch.softmax(_X, -1))
