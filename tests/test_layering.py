"""The arrows point down only: the core imports none of the tools built on top of it.

The core is `functional/`, `_autograd/`, `losses.py` and the private helpers they use. The NaN
doctor (`debug`), the linter (`lint`), the framework callbacks (`integrations`), the benchmark
harness (`bench`) and the kernels (`_triton`) register through the core's slots (the observer
in `_public.py`, the backend table in `_backend.py`); the core never names them, not even in a
function-level import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "stablelosses"
TOOLS = ("debug", "lint", "integrations", "bench", "_triton")
CORE_DIRS = ("functional", "_autograd")
CORE_FILES = (
    "losses.py", "_utils.py", "_spec.py", "_compat.py", "_public.py", "_backend.py",
    "_torch_import.py", "naive.py",
)


def _core_files() -> list[Path]:
    files = [p for d in CORE_DIRS for p in sorted((PKG / d).rglob("*.py"))]
    return files + [PKG / f for f in CORE_FILES if (PKG / f).exists()]


def _imported_modules(path: Path) -> list[str]:
    """Every module an import statement in ``path`` names, at any depth (absolute form)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(PKG)))
def test_core_file_imports_no_tool(path):
    bad = [
        m for m in _imported_modules(path)
        if any(m == f"stablelosses.{t}" or m.startswith(f"stablelosses.{t}.") for t in TOOLS)
    ]
    assert bad == [], f"{path.relative_to(PKG)} imports {bad}: the core must not import the tools"


def test_using_the_losses_loads_no_tool():
    """The kernels' registration module (``stablelosses._triton``, which imports no triton) is
    loaded by ``import stablelosses`` to fill the backend table; the kernels themselves, triton
    and the other tools are not."""
    code = (
        "import sys, torch, stablelosses as sl, stablelosses.functional as SF\n"
        "x = torch.randn(4, 5, requires_grad=True)\n"
        "SF.cross_entropy(x, torch.tensor([0, 1, 2, 3])).backward()\n"
        "sl.FocalLoss()(x, torch.tensor([0, 1, 2, 3])).backward()\n"
        "SF.softmax(x, 1); SF.logsumexp(x, 1); SF.rmse_loss(x, x.detach())\n"
        f"print(sorted(m for m in sys.modules if (m.split('.')[:2] in "
        f"[['stablelosses', t] for t in {TOOLS!r}] and m != 'stablelosses._triton') "
        "or m.split('.')[0] == 'triton'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _stable_functions() -> list[type]:
    import stablelosses.functional  # noqa: F401  (imports every Function's module)
    from stablelosses._autograd._base import StableFunction

    found, todo = [], list(StableFunction.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if not vars(cls).get("_twin", False) and "call" in vars(cls):  # (not one refused at creation)
            found.append(cls)
    return found


def test_functions_are_called_through_their_class():
    """"Go to definition" on a Function call lands on the Function: each `StableFunction` is
    called as ``Cls.call(...)``, and no module of the core binds its caller to another name."""
    functions = _stable_functions()
    assert len(functions) >= 20
    callers = {id(cls.call): cls for cls in functions}
    assert len(callers) == len(functions)  # one caller per Function, not an inherited one
    for cls in functions:
        assert cls.call.__qualname__ == f"{cls.__name__}.call"
    for path in _core_files():
        name = ".".join(path.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
        module = sys.modules.get(name)
        if module is None:
            continue
        aliases = [k for k, v in vars(module).items() if id(v) in callers]
        assert not aliases, f"{name} binds a Function's caller to {aliases}"


def test_a_stable_function_without_jvp_is_refused_at_class_creation():
    import torch

    from stablelosses._autograd._base import StableFunction

    with pytest.raises(TypeError, match="_NoJvp: a StableFunction defines jvp"):
        class _NoJvp(StableFunction):
            @staticmethod
            def forward(x: torch.Tensor) -> torch.Tensor:
                return x
