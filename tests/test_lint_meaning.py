"""``--fix`` never changes what the code means: each case below is a reproducer of a
rewrite that changed the value, the gradient, or broke the code; after ``--fix`` the code gives
the same value and gradient as before, or it is not rewritten."""

from __future__ import annotations

import ast
import builtins
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch

import stablelosses.functional as SF
from stablelosses.lint import Finding, lint_source, main
from stablelosses.lint._runner import fixed_count, run

libcst = pytest.importorskip("libcst")
from stablelosses.lint._fix import apply_fixes  # noqa: E402

ROOT = Path(__file__).parents[1]


def _fix(src: str) -> str:
    new = src
    for _ in range(5):
        out, n = apply_fixes(new, lint_source(new))
        if n == 0:
            break
        new = out
    return new


def _run(src: str, fn: str, *args, seed: int = 0):
    """Value and input gradients of ``fn(*args)`` defined in ``src`` (fresh RNG for each run)."""
    env: dict = {"SF": SF, "torch": torch}
    exec(compile(src, "<case>", "exec"), env)
    args = [a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
            for a in args]
    torch.manual_seed(seed)
    value = env[fn](*args)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(value.sum(), leaves, allow_unused=True)
    return value.detach(), grads


def _same_meaning(src: str, fn: str, *args) -> str:
    new = _fix(src)
    v0, g0 = _run(src, fn, *args)
    v1, g1 = _run(new, fn, *args)
    torch.testing.assert_close(v1, v0, rtol=1e-6, atol=1e-9)
    for a, b in zip(g0, g1):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-9)
    return new


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ------------------------------------------------------------------ 1. re-evaluating a bound value

BODY_TWICE = textwrap.dedent("""\
    import torch
    import torch.nn.functional as F

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5)).double()

        def forward(self, x, t):
            p = F.softmax(self.body(x), 1)
            loss = -torch.log(p).gather(1, t[:, None]).mean()
            return loss

    net = None

    def f(x, t):
        global net
        if net is None:
            torch.manual_seed(1)
            net = Net()
        return net(x, t)
    """)


def test_a_module_call_behind_a_name_is_not_evaluated_again():
    (f,) = lint_source(BODY_TWICE)
    assert f.code == "SL102" and f.fix is None and "again" in f.no_fix
    assert _fix(BODY_TWICE) == BODY_TWICE


def test_an_inplace_change_between_binding_and_use_blocks_the_rewrite():
    src = textwrap.dedent("""\
        import torch
        def f(x):
            p = torch.softmax(x, -1)
            p[:, 0] = 0.5
            return torch.log(p)
        """)
    (f,) = lint_source(src)
    assert f.fix is None
    src2 = src.replace("p[:, 0] = 0.5", "x.mul_(2)")
    assert all(f.fix is None for f in lint_source(src2))


def test_a_pure_value_used_once_is_moved_with_no_dead_line():
    src = textwrap.dedent("""\
        import torch
        import torch.nn.functional as F
        def f(a, b):
            mse = F.mse_loss(a, b)
            return torch.sqrt(mse)
        """)
    new = _same_meaning(src, "f", _x(5), _x(5, seed=1))
    assert "mse =" not in new and "return SF.rmse_loss(a, b)" in new
    # used twice: the binding stays (it is still read)
    src2 = src.replace("return torch.sqrt(mse)", "return torch.sqrt(mse) + mse")
    new2 = _same_meaning(src2, "f", _x(5), _x(5, seed=1))
    assert "mse = F.mse_loss(a, b)" in new2


@pytest.mark.parametrize("body, fix", [
    ("    p = torch.softmax(z, -1)\n    return -(p * torch.log(p)).sum(-1)\n", "SF.xlogy(p, p)"),
    ("    logp = F.log_softmax(z, -1)\n    return -(torch.exp(logp) * logp).sum(-1)\n",
     "SF.xlogy(logp.exp(), logp.exp())"),
], ids=["p-log-p", "exp-logp-logp"])
def test_a_binding_the_rewrite_still_reads_stays(body, fix):
    src = f"import torch\nimport torch.nn.functional as F\ndef f(z):\n{body}"
    new = _same_meaning(src, "f", _x(3, 4))
    assert body.splitlines()[0] in new and fix in new


def test_a_binding_read_in_a_nested_function_stays():
    src = textwrap.dedent("""\
        import torch
        import torch.nn.functional as F
        def f(a, b):
            mse = F.mse_loss(a, b)
            def half():
                return mse / 2
            return torch.sqrt(mse) + half()
        """)
    new = _same_meaning(src, "f", _x(5), _x(5, seed=1))
    assert "mse = F.mse_loss(a, b)" in new and "SF.rmse_loss(a, b)" in new


def test_a_module_level_binding_stays():
    src = textwrap.dedent("""\
        import torch
        import torch.nn.functional as F
        a, b = torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
        mse = F.mse_loss(a, b)
        rmse = torch.sqrt(mse)
        def f():
            return mse
        """)
    new = _fix(src)
    assert "mse = F.mse_loss(a, b)" in new and "rmse = SF.rmse_loss(a, b)" in new
    env: dict = {"SF": SF}
    exec(new, env)
    assert env["f"]() == 1


# ------------------------------------------------------------------ 2. F is not torch's F there

def test_a_local_F_is_not_torch_functional():
    src = textwrap.dedent("""\
        import torch
        def f(x):
            B, T, F = x.shape
            return torch.log(torch.sigmoid(x)) * F
        """)
    new = _same_meaning(src, "f", _x(2, 3, 4))
    assert "F.logsigmoid" not in new or "import torch.nn.functional" not in new
    assert "torch.nn.functional.logsigmoid" in new


def test_an_import_inside_another_function_is_not_seen():
    src = textwrap.dedent("""\
        import torch
        def g(x):
            import torch.nn.functional as F
            return F.relu(x)
        def f(x):
            return torch.log(torch.sigmoid(x))
        """)
    new = _same_meaning(src, "f", _x(6))
    assert "torch.nn.functional.logsigmoid(x)" in new


def test_F_bound_to_something_else_at_module_level_gets_no_F_rewrite():
    src = "import torch\nF = 3\ndef f(x):\n    return torch.log(torch.sigmoid(x)) * F\n"
    new = _same_meaning(src, "f", _x(6))
    assert "F = 3" in new


# ------------------------------------------------------------------ 3. self.crit of another class

def test_self_attribute_is_resolved_in_its_own_class_only():
    src = textwrap.dedent("""\
        import torch
        from torch import nn

        class A(nn.Module):
            def __init__(self):
                super().__init__()
                self.crit = nn.MSELoss()

        class B(nn.Module):
            def __init__(self):
                super().__init__()
                self.crit = nn.L1Loss()

            def forward(self, a, b):
                return torch.sqrt(self.crit(a, b))

        def f(a, b):
            return B()(a, b)
        """)
    assert all(f.code != "SL101" or f.fix is None for f in lint_source(src))
    _same_meaning(src, "f", torch.zeros(4, dtype=torch.float64) + 2, torch.zeros(4, dtype=torch.float64))


# ------------------------------------------------------------------ 4. three value changes

def test_sqrt_of_clamped_mse_is_not_rewritten_to_plus_eps():
    src = "import torch\nimport torch.nn.functional as F\ndef f(a, b):\n    return torch.sqrt(F.mse_loss(a, b).clamp_min(1e-8))\n"
    (f,) = lint_source(src)
    assert f.fix is None
    a = torch.full((4,), 1e-4, dtype=torch.float64)
    _same_meaning(src, "f", a, torch.zeros(4, dtype=torch.float64))


def test_max_shift_over_another_dim_is_not_a_softmax():
    src = ("import torch\ndef f(x):\n    e = torch.exp(x - x.max(0, keepdim=True)[0])\n"
           "    return e / e.sum(1, keepdim=True)\n")
    _same_meaning(src, "f", _x(3, 4))
    same = src.replace("x.max(0,", "x.max(1,")
    new = _same_meaning(same, "f", _x(3, 4))
    assert "SF.softmax(x, 1)" in new


def test_norm_with_dtype_keeps_its_dtype():
    src = ("import torch\ndef f(x):\n"
           "    return x / torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float64)\n")
    x = _x(3, 4).float()
    new = _same_meaning(src, "f", x)
    env: dict = {"SF": SF, "torch": torch}
    exec(new, env)
    assert env["f"](x).dtype == torch.float64


# ------------------------------------------------------------------ 5. SL108 with a tensor eps

def test_sqrt_mse_plus_tensor_eps_is_not_given_to_rmse_loss():
    src = textwrap.dedent("""\
        import torch
        import torch.nn.functional as F

        class L(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("eps", torch.tensor(1e-6, dtype=torch.float64))

            def forward(self, a, b):
                return torch.sqrt(F.mse_loss(a, b) + self.eps)

        def f(a, b):
            return L()(a, b)
        """)
    _same_meaning(src, "f", _x(4), _x(4, seed=2))
    lit = "import torch\nimport torch.nn.functional as F\ndef f(a, b):\n    return torch.sqrt(F.mse_loss(a, b) + 1e-6)\n"
    assert "eps=1e-6" in _same_meaning(lit, "f", _x(4), _x(4, seed=2))


# ------------------------------------------------------------------ 6. NumPy masked means

def test_numpy_masked_mean_is_not_turned_into_torch():
    src = textwrap.dedent("""\
        import numpy as np
        def f(x, m):
            return (x * m).sum() / m.sum()
        """)
    new = _fix(src)
    env: dict = {}
    exec(new, env)
    import numpy as np

    out = env["f"](np.arange(4.0), np.array([1.0, 0.0, 1.0, 0.0]))
    assert isinstance(out, np.floating) and out == 1.0
    assert "SF." not in new


# ------------------------------------------------------------------ 7. the command

def test_select_with_an_unknown_code_exits_2_and_names_it(tmp_path, capsys):
    p = tmp_path / "a.py"
    p.write_text("import torch\ny = torch.log(torch.softmax(x, -1))\n")
    assert main(["--select", "SL1O2", str(p)]) == 2
    assert "SL1O2" in capsys.readouterr().err
    assert main(["--ignore", "XX9", str(p)]) == 2
    assert "XX9" in capsys.readouterr().err
    assert main(["--select", "SL10", str(p)]) == 1  # a prefix of real codes is fine


def test_list_rules_needs_no_path(capsys):
    assert main(["--list-rules"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SL101 ")
    assert main([]) == 2  # no path and no --list-rules


COUNT = textwrap.dedent("""\
    import torch
    import torch.nn.functional as F

    def loss(x, y, z, w):
        a = torch.log(torch.sigmoid(torch.log(torch.softmax(z, 0))))
        b = torch.sqrt(F.mse_loss(x, y))
        c = torch.log(torch.softmax(torch.log(torch.sigmoid(w)), -1))
        return a.sum() + b + c.sum()
    """)


def test_found_fixable_and_fixed_agree(tmp_path, capsys):
    p = tmp_path / "c.py"
    p.write_text(COUNT)
    assert run([str(p)]) == 1
    err = capsys.readouterr().err
    found = int(err.split("(")[1].split()[0])
    run([str(p)], fix=True)
    err = capsys.readouterr().err
    fixed = int(err.split("fixed ")[1].split(",")[0])
    assert found == fixed, (found, fixed)


# ``stablelosses/__init__`` imports torch (the package's loss functions); the lint package itself
# must not, so that the CLI can run it without torch. The check loads ``stablelosses.lint`` under an
# empty parent package with ``import torch`` made to fail.
NO_TORCH = """
import importlib.abc, runpy, sys, types
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported by the linter: " + name)
sys.meta_path.insert(0, Block())
pkg = types.ModuleType("stablelosses")
pkg.__path__ = [sys.argv[1] + "/stablelosses"]
sys.modules["stablelosses"] = pkg
sys.argv = ["stablelosses lint", *sys.argv[2:]]
runpy.run_module("stablelosses.lint", run_name="__main__")
"""


@pytest.mark.parametrize("args", [["PATH"], ["--diff", "PATH"], ["--fix", "PATH"], ["--list-rules"],
                                  ["--format", "json", "PATH"]])
def test_lint_imports_no_torch(tmp_path, args):
    p = tmp_path / "a.py"
    p.write_text("import torch\ny = torch.log(torch.softmax(x, -1))\n")
    argv = [str(p) if a == "PATH" else a for a in args]
    res = subprocess.run([sys.executable, "-c", NO_TORCH, str(ROOT), *argv], capture_output=True,
                         text=True, cwd=tmp_path, check=False)
    assert "torch imported" not in res.stderr, res.stderr
    assert res.returncode == (0 if args in (["--list-rules"], ["--fix", "PATH"]) else 1), res.stderr
    if "--fix" in args:
        assert "SF.log_softmax(x, -1)" in p.read_text()


def test_a_rewrite_in_two_steps_counts_once(tmp_path, capsys):
    p = tmp_path / "s.py"
    p.write_text("import torch\ndef f(x):\n    return torch.log(x.exp() / x.exp().sum(-1, keepdim=True))\n")
    assert run([str(p)]) == 1
    assert "found 1 (1 fixable" in capsys.readouterr().err
    assert run([str(p)], fix=True) == 0
    assert "fixed 1, 0 remaining" in capsys.readouterr().err
    assert "SF.log_softmax(x, -1)" in p.read_text()


def test_fixed_log1mexp_lints_clean_and_counts_as_fixed(tmp_path, capsys):
    p = tmp_path / "o.py"
    p.write_text("import torch\ndef odds(x):\n    return torch.log1p(-torch.exp(x))\n")
    assert run([str(p)], fix=True) == 0
    assert "fixed 1, 0 remaining" in capsys.readouterr().err
    assert run([str(p)]) == 0  # a pre-commit hook that fixed passes on its next run
    x = torch.tensor([-0.3, -0.7, -5.0, float("-inf")], dtype=torch.float64)  # both branches
    _same_meaning("import torch\ndef odds(x):\n    return torch.log1p(-torch.exp(x))\n", "odds", x)


def test_fixed_counts_the_findings_gone_not_the_ones_a_rewrite_made():
    def at(code: str) -> Finding:
        return Finding(code, ast.parse("x").body[0], "")

    assert fixed_count([at("SL115")], [at("SL118")]) == 1
    assert fixed_count([at("SL117"), at("SL102")], [at("SL117")]) == 1
    assert fixed_count([at("SL102")], [at("SL102")]) == 0


# ------------------------------------------------------------------ 8. the output of --fix lints clean

def _corpus() -> list[tuple[str, str]]:
    """Every hazardous example of the test suite with a rewrite (and the fetched real snippets of
    ``tests/lint_corpus/hazardous/`` where they are present)."""
    from test_lint import CASES, _src
    from test_lint_rules_2026 import CASES as POST_TRAINING
    from test_lint_rules_2026 import HEAD

    out = [(f"{c}-{i}", _src(bad)) for i, (c, bad, _) in enumerate(CASES)]
    out += [(f"{c}-post-{i}", HEAD + textwrap.dedent(bad)) for i, (c, bad, _, _) in enumerate(POST_TRAINING)]
    out += [(p.stem, p.read_text()) for p in sorted((ROOT / "tests/lint_corpus/hazardous").glob("*.py"))]
    return [(name, src) for name, src in out if any(f.fix for f in lint_source(src))]


CORPUS = _corpus()


def _unbound_reads(src: str) -> set[tuple[str, str]]:
    """(function, name) for each name a function reads that neither it nor the module binds."""
    tree = ast.parse(src)

    def bound(node: ast.AST) -> set[str]:
        out = set(dir(builtins))
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
                out.add(n.id)
            elif isinstance(n, ast.arg):
                out.add(n.arg)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                out |= {(a.asname or a.name).split(".")[0] for a in n.names}
        return out

    module = bound(tree)
    return {(fn.name, n.id) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            and n.id not in module | bound(fn)}


@pytest.mark.parametrize("src", [s for _, s in CORPUS], ids=[n for n, _ in CORPUS])
def test_fixed_code_lints_clean_and_fixing_again_changes_nothing(src):
    before = lint_source(src)
    new = _fix(src)
    assert _unbound_reads(new) <= _unbound_reads(src)  # no binding deleted that is still read
    after = lint_source(new)
    report_only = Counter(f.code for f in before if f.fix is None)
    # what is left was there before and had no rewrite: no rule fires on a rewrite's output
    assert not Counter(f.code for f in after) - report_only, [(f.code, f.line) for f in after]
    assert all(f.fix is None for f in after)
    assert _fix(new) == new
