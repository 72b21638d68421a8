"""stablelosses lint: every rule fires on its hazard and not on the stable spelling; every
rewrite keeps the value where the old code was finite; --fix turns three NaN stories finite."""

from __future__ import annotations

import ast
import importlib.metadata
import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import stablelosses.functional as SF
from stablelosses.cli import main as cli_main
from stablelosses.lint import RULES, lint_source
from stablelosses.lint._runner import run
from stablelosses.lint.flake8_plugin import Plugin

HEADER = ("import math\nimport torch\nimport torch as th\nimport torch.nn.functional as F\n"
          "from torch import nn\n")

# (code, expression that fires, expression of the stable or harmless spelling)
CASES = [
    ("SL101", "torch.sqrt(F.mse_loss(x, y))", "SF.rmse_loss(x, y)"),
    ("SL101", "th.sqrt(nn.MSELoss(reduction='sum')(x, y))", "torch.sqrt(x.abs())"),
    ("SL101", "rmse_loss((x - y).pow(2).mean().sqrt())", "torch.sqrt(x.abs().mean())"),
    ("SL101", "rmse_loss(torch.sqrt(((x - y) ** 2).mean()))", "torch.sqrt(((x - y) ** 2).mean())"),
    ("SL101", "rmse_loss(torch.sqrt(((x - y) ** 2).sum(-1)))", "rmse_loss(torch.sqrt((x * x).sum(-1)))"),
    ("SL102", "torch.log(F.softmax(x, -1))", "F.log_softmax(x, -1)"),
    ("SL102", "x.softmax(dim=1).log()", "torch.log(x.abs())"),
    ("SL102", "torch.log(F.softmax(x, 1).gather(1, t[:, None]).squeeze(1))",
     "torch.log(x.abs().gather(1, t[:, None]))"),
    ("SL103", "x.exp() / x.exp().sum(-1, keepdim=True)", "torch.softmax(x, -1)"),
    ("SL103", "torch.exp(x - x.max(1, keepdim=True)[0]) / "
              "torch.sum(torch.exp(x - x.max(1, keepdim=True)[0]), dim=1, keepdim=True)",
     "x.exp() / y.exp().sum(-1, keepdim=True)"),
    ("SL104", "torch.log(torch.sigmoid(x))", "F.logsigmoid(x)"),
    ("SL104", "torch.log(1 - x.sigmoid())", "torch.log(1 - x.abs().clamp(max=0.5))"),
    ("SL105", "F.binary_cross_entropy(torch.sigmoid(x), p)", "F.binary_cross_entropy_with_logits(x, p)"),
    ("SL105", "F.binary_cross_entropy(th.sigmoid(x), p, reduction='sum')", "F.binary_cross_entropy(p, p)"),
    ("SL106", "(1 - torch.softmax(x, -1)) ** gamma", "(1 - torch.softmax(x, -1)) ** 2"),
    ("SL106", "(1 - p) ** 0.5", "(1 - beta) ** step"),
    ("SL107", "x / x.norm(dim=-1, keepdim=True)", "F.normalize(x, dim=-1)"),
    ("SL107", "x / torch.linalg.vector_norm(x, dim=1, keepdim=True)",
     "x / (x.norm(dim=-1, keepdim=True) + 1e-8)"),
    ("SL107", "x / th.norm(x, 2, 1, True)", "x / y.norm(dim=-1, keepdim=True)"),
    ("SL108", "torch.sqrt(F.mse_loss(x, y) + 1e-8)", "torch.sqrt(x.abs() + 1e-8)"),
    ("SL108", "torch.log(torch.softmax(x, -1) + 1e-8)", "torch.log(x.abs() + 1e-8)"),
    ("SL108", "torch.log(p + eps)", "torch.log(x + 1.0)"),
    ("SL109", "torch.softmax(x.masked_fill(~mask, float('-inf')), dim=-1)",
     "torch.softmax(x.masked_fill(~mask, -1e9), -1)"),
    ("SL109", "F.log_softmax(x.masked_fill(mask, -math.inf), -1)",
     "torch.nan_to_num(torch.softmax(x.masked_fill(~mask, float('-inf')), -1))"),
    ("SL110", "F.kl_div(F.softmax(x, -1), p, reduction='batchmean')", "F.kl_div(F.log_softmax(x, -1), p)"),
    ("SL111", "(x * mask).sum() / mask.sum()", "(x * mask).sum() / mask.sum().clamp(min=1)"),
    ("SL111", "torch.sum(x * w, 1) / torch.sum(w, 1)", "torch.sum(x * w, 1) / torch.sum(w, 1).clamp(min=1)"),
    ("SL112", "torch.log(torch.cosh(x - y))", "SF.log_cosh_loss(x, y)"),
    ("SL112", "x.cosh().log()", "torch.log(x.abs() + 1)"),
    ("SL113", "torch.log(torch.exp(x).sum(-1))", "torch.logsumexp(x, -1)"),
    ("SL113", "x.exp().sum().log()", "torch.exp(x - x.amax(-1, keepdim=True))"),
    ("SL113", "loss_fn(logits)", "torch.exp(-x.abs())"),
    # the post-training rules (real code of each: tests/test_lint_rules_2026.py)
    ("SL114", "torch.exp(logp - old_logp)", "torch.exp(logp - logp.detach())"),
    ("SL114", "torch.exp(log_ratio)", "torch.exp(torch.clamp(log_ratio, max=20.0))"),
    ("SL115", "torch.log1p(-torch.exp(logp))", "torch.log(-torch.expm1(logp))"),
    ("SL115", "torch.log(1 - logp.exp())", "torch.log1p(-p)"),
    ("SL116", "torch.exp(ref_logp - logp) - (ref_logp - logp) - 1",
     "torch.expm1(ref_logp - logp) - (ref_logp - logp)"),
    ("SL116", "log_ratio.exp() - 1 - log_ratio", "torch.expm1(log_ratio) - log_ratio"),
    ("SL117", "torch.log(p) * mask", "F.log_softmax(x, -1) * mask"),
    ("SL118", "torch.where(x > 0, torch.sqrt(x), 0.0)", "torch.where(x > 0, torch.sqrt(torch.where(x > 0, x, 1)), 0.0)"),
    ("SL118", "torch.where(w > 0, y / w, 0.0)", "torch.where(w > 0, y / 2, 0.0)"),
    ("SL118", "in_loss(torch.nan_to_num(torch.log(-logp)))", "in_loss(torch.nan_to_num(F.log_softmax(logp, -1)))"),
    ("SL119", "torch.exp(logp) * logp", "SF.xlogy(p, p)"),
    ("SL119", "p * torch.log(p)", "p * torch.log(x.abs() + 1)"),
    ("SL120", "F.kl_div(logp, ref_logp.masked_fill(~mask, float('-inf')), log_target=True, reduction='none')",
     "F.kl_div(logp, ref_logp, log_target=True, reduction='none')"),
    ("SL121", "in_loss(logp.sum(-1) / completion_mask.sum(-1))",
     "in_loss(logp.sum(-1) / completion_mask.sum(-1).clamp(min=1))"),
    ("SL122", "def f(var, x):\n    var = var.clone()\n    with torch.no_grad():\n        var.clamp_(min=1e-6)\n"
              "    return 0.5 * (torch.log(var) + x ** 2 / var)\n",
     "def f(var, x):\n    with torch.no_grad():\n        var.clamp_(-0.01, 0.01)\n    return x * 2\n"),
]


# an expression inside a function named like a loss (the rules that need one)
IN_LOSS = {"loss_fn": "def loss_fn(logits):\n    return torch.exp(logits).mean()\n"}


def _src(expr: str) -> str:
    head = "".join(v for k, v in IN_LOSS.items() if expr.startswith(k + "("))
    if expr.startswith("def f("):  # a block of statements: f(var, x)
        return f"{HEADER}{expr}r = f(w + 0.5, x)\n"
    if expr.startswith("in_loss("):  # evaluated inside a function named like a loss
        inner = expr[len("in_loss("):-1]
        return (f"{HEADER}def compute_loss(logp, completion_mask):\n    return {inner}\n"
                "r = compute_loss(logp, completion_mask)\n")
    if expr.startswith("rmse_loss("):  # evaluated inside the loss function
        inner = expr[len("rmse_loss("):-1]
        return f"{HEADER}def rmse_loss_of(x, y):\n    return {inner}\nr = rmse_loss_of(x, y)\n"
    return f"{HEADER}{head}r = {expr}\n"


def _inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, dtype=torch.float64, generator=g)
    y = torch.randn(4, 5, dtype=torch.float64, generator=g)
    mask = torch.rand(4, 5, generator=g) > 0.4
    mask[:, 0] = True
    p = torch.softmax(torch.randn(4, 5, dtype=torch.float64, generator=g), -1)
    logp = torch.log_softmax(torch.randn(4, 5, dtype=torch.float64, generator=g), -1)
    old_logp = logp + 0.1 * torch.randn(4, 5, dtype=torch.float64, generator=g)
    return dict(x=x, y=y, mask=mask, w=mask.double(), p=p, logits=x, gamma=0.5, beta=0.9, step=3,
                eps=1e-8, t=torch.tensor([0, 1, 2, 4]), logp=logp, old_logp=old_logp,
                ref_logp=old_logp, log_ratio=logp - old_logp, completion_mask=mask.double())


def _eval(src: str):
    env = {"SF": SF, **_inputs()}
    exec(compile(src, "<lint>", "exec"), env)
    return env["r"]


def test_every_rule_has_a_case_and_a_docs_section():
    assert {c for c, _, _ in CASES} == set(RULES)
    page = (Path(__file__).parents[1] / "docs" / "lint.md").read_text()
    for code, rule in RULES.items():
        assert f"## {code}" in page, code
        assert (Path(__file__).parents[1] / "docs" / "hazards" / f"{rule.page}.md").exists()


@pytest.mark.parametrize("code, bad, good", CASES, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(CASES)])
def test_rule_fires_on_the_hazard_only(code, bad, good):
    assert [f.code for f in lint_source(_src(bad))] == [code]
    assert [f.code for f in lint_source(_src(good))] == []
    # both examples are code that runs
    _eval(_src(bad))
    _eval(_src(good))


FIXABLE = [(c, bad) for c, bad, _ in CASES if lint_source(_src(bad))[0].fix]


def test_most_rules_have_a_rewrite():
    assert len({c for c, _ in FIXABLE}) >= 10
    no_fix = [f for c, bad, _ in CASES for f in lint_source(_src(bad)) if not f.fix]
    assert all(f.no_fix for f in no_fix)  # a rule without a rewrite says why


@pytest.mark.parametrize("code, bad", FIXABLE, ids=[f"{c}-{i}" for i, (c, _) in enumerate(FIXABLE)])
def test_rewrite_keeps_the_value(code, bad):
    pytest.importorskip("libcst")
    from stablelosses.lint._fix import apply_fixes

    src = _src(bad)
    new, n = apply_fixes(src, lint_source(src))
    assert n == 1
    assert "import stablelosses.functional as SF" in new or "SF." not in new.split("r = ")[1]
    assert lint_source(new, select=[code]) == []
    old_value, new_value = _eval(src), _eval(new)
    finite = torch.isfinite(old_value)
    assert finite.any()
    torch.testing.assert_close(new_value[finite], old_value[finite], rtol=1e-10, atol=1e-12)


def test_aliases_and_imports():
    src = textwrap.dedent("""\
        import torch as th
        from torch.nn import functional as fn
        from torch import sqrt, log
        from torch.nn.functional import mse_loss, softmax
        a = sqrt(mse_loss(x, y))
        b = log(softmax(z, dim=-1))
        c = th.log(fn.softmax(z, 1))
        d = np.log(np.exp(z).sum())
        """)
    assert [f.code for f in lint_source(src)] == ["SL101", "SL102", "SL102"]


def test_names_bound_once_are_seen_through_and_rebound_ones_are_not():
    once = "def f(x):\n    p = torch.softmax(x, -1)\n    return torch.log(p)\n"
    twice = "def f(x):\n    p = torch.softmax(x, -1)\n    p = p * 2\n    return torch.log(p)\n"
    moved = "def f(x):\n    p = torch.softmax(x, -1)\n    x = x + 1\n    return torch.log(p)\n"
    assert [f.fix for f in lint_source(once)] == ["SF.log_softmax(x, -1)"]
    assert lint_source(twice) == []
    assert lint_source(moved) == []  # x changed after p was made: log_softmax(x) is not log(p)


def test_log_of_a_selection_from_softmax():
    src = textwrap.dedent("""\
        def focal(logits, t, gamma):
            p = torch.softmax(logits, dim=1)
            pt = p.gather(1, t[:, None]).squeeze(1)
            return -((1 - pt) ** gamma) * torch.log(pt)
        """)
    found = {f.code: f for f in lint_source(src)}
    assert sorted(found) == ["SL102", "SL106"]
    assert found["SL102"].fix == "SF.log_softmax(logits, 1).gather(1, t[:, None]).squeeze(1)"
    assert [f.fix for f in lint_source("y = torch.log(torch.softmax(z, -1)[:, 0])\n")] == [
        "SF.log_softmax(z, -1)[:, 0]"]
    assert lint_source("y = torch.log((torch.softmax(z, -1))[:, 0])\n")[0].fix is None


def test_self_attribute_criterion():
    src = textwrap.dedent("""\
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.crit = nn.MSELoss()

            def forward(self, a, b):
                return torch.sqrt(self.crit(a, b))
        """)
    assert [(f.code, f.fix) for f in lint_source(src)] == [("SL101", "SF.rmse_loss(a, b)")]


def test_gradient_only_rules_are_silent_without_a_gradient():
    body = "    r = torch.sqrt(F.mse_loss(x, y))\n    q = (1 - p) ** 0.5\n    s = torch.log(p + 1e-8)\n"
    plain = f"def f(x, y, p):\n{body}"
    assert [f.code for f in lint_source(plain)] == ["SL101", "SL106", "SL108"]
    assert lint_source(f"@torch.no_grad()\n{plain}") == []
    assert lint_source(f"def f(x, y, p):\n    with torch.inference_mode():\n    {body.replace(chr(10) + '    ', chr(10) + '        ')}") == []
    assert lint_source(f"class AudioFeatureExtractor:\n    {plain.replace(chr(10), chr(10) + '    ')}") == []
    assert lint_source(plain, path="models/x/processing_x.py") == []
    assert len(lint_source(plain, path="models/x/modeling_x.py")) == 3


def test_exp_of_logits_shifted_in_the_function_is_not_reported():
    shifted = "def f_loss(logits):\n    logits = logits - logits.amax(-1, keepdim=True)\n    return torch.exp(logits)\n"
    bare = "def f_loss(logits):\n    return torch.exp(logits)\n"
    assert lint_source(shifted) == [] and [f.code for f in lint_source(bare)] == ["SL113"]
    assert lint_source(bare.replace("f_loss", "mean")) == []  # not in a loss: the mean of a distribution
    assert lint_source("class CLIPLoss:\n    def f(self):\n        return self.logit_scale.exp()\n") == []
    lse = "def f(x):\n    shifted = x - x.amax(-1, keepdim=True)\n    return torch.log(torch.exp(shifted).sum(-1))\n"
    assert lint_source(lse) == []  # already shifted: it cannot overflow
    empty = "def f(x):\n    if x.numel() == 0:\n        return torch.log(torch.exp(x).sum(-1))\n"
    assert lint_source(empty) == []  # an empty tensor has no value to overflow
    assert len(lint_source(empty.replace("if x.numel() == 0:", "if x.ndim == 0:"))) == 1


def test_rms_of_data_is_not_reported_outside_a_loss():
    rms = "def rms(x):\n    return x.pow(2).mean().sqrt()\n"
    assert lint_source(rms) == []
    assert [f.code for f in lint_source(rms.replace("def rms", "def rms_loss"))] == ["SL101"]
    mse = "def rms(x, y):\n    return torch.sqrt(F.mse_loss(x, y))\n"
    assert [f.code for f in lint_source(mse)] == ["SL101"]  # an MSE is a loss wherever it is


def test_inplace_masked_fill_reports_without_fix():
    src = "def f(s, m):\n    s.masked_fill_(m, float('-inf'))\n    return s.softmax(-1)\n"
    (f,) = lint_source(src)
    assert f.code == "SL109" and f.fix is None and "in place" in f.no_fix


def test_noqa_select_ignore():
    src = _src("torch.log(torch.softmax(x, -1))  # noqa: SL102") + "s = torch.sqrt(F.mse_loss(x, y))  # noqa\n"
    assert lint_source(src) == []
    src2 = _src("torch.log(torch.softmax(x, -1))  # noqa: SL101")
    assert [f.code for f in lint_source(src2)] == ["SL102"]
    both = _src("torch.log(torch.softmax(x, -1))") + "s = torch.sqrt(F.mse_loss(x, y))\n"
    assert [f.code for f in lint_source(both, select=["SL101"])] == ["SL101"]
    assert [f.code for f in lint_source(both, ignore=["SL10"])] == []
    assert [f.code for f in lint_source(both, select=["SL1"], ignore=["SL101"])] == ["SL102"]


def test_command_output_and_exit_codes(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text(_src("torch.log(torch.softmax(x, -1))"))
    clean = tmp_path / "clean.py"
    clean.write_text(_src("F.log_softmax(x, -1)"))
    assert cli_main(["lint", str(clean)]) == 0
    assert cli_main(["lint", str(bad)]) == 1
    out = capsys.readouterr().out.strip()
    assert out == (f"{bad}:6:5: SL102 log of softmax: the softmax underflows to 0 and log 0 is -inf (NaN "
                   "gradient) [fix: SF.log_softmax(x, -1)] (docs: lint#sl102, hazards/focal-log-zero)")
    assert cli_main(["lint", "--format", "json", str(tmp_path)]) == 1
    (rec,) = json.loads(capsys.readouterr().out)
    assert rec["path"] == str(bad) and (rec["line"], rec["column"], rec["end_column"]) == (6, 5, 36)
    assert rec["code"] == "SL102" and rec["name"] == "log-of-softmax" and rec["fix"] == "SF.log_softmax(x, -1)"
    assert cli_main(["lint", "--ignore", "SL102", str(bad)]) == 0
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    assert cli_main(["lint", str(broken)]) == 2
    assert "cannot parse" in capsys.readouterr().err
    assert cli_main(["lint", "--fix", "--diff", str(bad)]) == 2
    capsys.readouterr()
    # a diff followed by the JSON list was not JSON: refused, nothing on stdout
    assert cli_main(["lint", "--diff", "--format", "json", str(bad)]) == 2
    assert capsys.readouterr().out == ""
    assert cli_main(["lint", "--no-such-option", str(bad)]) == 2


def test_notebook(tmp_path, capsys):
    nb = {"cells": [
        {"cell_type": "markdown", "source": ["# title"]},
        {"cell_type": "code", "source": ["%matplotlib inline\n", "import torch\n"]},
        {"cell_type": "code", "source": "y = torch.log(torch.sigmoid(z))\n"},
    ], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    assert cli_main(["lint", str(path)]) == 1
    out = capsys.readouterr()
    assert out.out.startswith(f"{path}:cell 3:1:5: SL104")
    # --fix does not rewrite notebooks: their findings are not counted as fixable
    assert "found 1 (0 fixable with --fix)" in out.err


def test_flake8_plugin_class():
    src = _src("torch.log(torch.sigmoid(x))")
    rows = list(Plugin(ast.parse(src), src.splitlines(True)).run())
    assert [(r[0], r[1], r[2].split()[0]) for r in rows] == [(6, 4, "SL104")]
    assert "F.logsigmoid(x)" in rows[0][2]


def test_flake8_entry_point(tmp_path):
    pytest.importorskip("flake8")
    eps = importlib.metadata.entry_points(group="flake8.extension")
    if not any(e.name == "SL" and e.value.startswith("stablelosses") for e in eps):
        pytest.skip("stablelosses is not installed (pip install -e .): no flake8 entry point")
    f = tmp_path / "m.py"
    f.write_text(_src("torch.log(torch.sigmoid(x))") + "s = torch.log(torch.sigmoid(x))  # noqa: SL104\n")
    res = subprocess.run([sys.executable, "-m", "flake8", "--select", "SL", str(f)],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 1, res.stderr
    assert res.stdout.splitlines() == [f"{f}:6:5: SL104 log of sigmoid: the sigmoid rounds to 0 (or 1) and "
                                       "the log is -inf (NaN gradient) (use F.logsigmoid(x))"]


def test_pre_commit_hooks_file():
    yaml = pytest.importorskip("yaml")
    hooks = yaml.safe_load((Path(__file__).parents[1] / ".pre-commit-hooks.yaml").read_text())
    assert {h["id"]: h["entry"] for h in hooks} == {"stablelosses-lint": "stablelosses lint",
                                                    "stablelosses-lint-fix": "stablelosses lint --fix"}
    assert all(h["language"] == "python" and "python" in h["types_or"] for h in hooks)


# ------------------------------------------------------------------------------ --fix


STORY = '''\
import torch
import torch.nn.functional as F
from torch import nn


def rmse(pred, y):
    criterion = nn.MSELoss()
    return torch.sqrt(criterion(pred, y))  # the RMSE, as posted


def softmax(x):
    e = torch.exp(x)
    return e / e.sum(dim=-1, keepdim=True)


def focal(logits, target, gamma=2.0):
    p = F.softmax(logits, dim=1)
    logp = torch.log(p)
    logpt = logp.gather(1, target[:, None]).squeeze(1)
    pt = p.gather(1, target[:, None]).squeeze(1)
    return (-(1 - pt) ** gamma * logpt).mean()
'''


def _load(path: Path):
    env: dict = {"__name__": path.stem}
    exec(compile(path.read_text(), str(path), "exec"), env)
    return env


def _grads(env) -> dict[str, torch.Tensor]:
    """The gradient of each story at the input that made it NaN."""
    out = {}
    pred = torch.ones(3, requires_grad=True)  # a perfect prediction: sqrt'(0) * 0
    env["rmse"](pred, torch.ones(3)).backward()
    out["rmse"] = pred.grad
    x = torch.tensor([[100.0, 0.0, -3.0]], requires_grad=True)  # exp(100) = inf in float32
    env["softmax"](x)[0, 0].backward()
    out["softmax"] = x.grad
    z = torch.tensor([[0.0, 200.0, 1.0]], requires_grad=True)  # p of class 0 underflows to 0
    env["focal"](z, torch.tensor([0])).backward()
    out["focal"] = z.grad
    return out


def test_fix_turns_three_nan_stories_finite(tmp_path, capsys):
    pytest.importorskip("libcst")
    path = tmp_path / "story.py"
    path.write_text(STORY)
    before = _grads(_load(path))
    assert all(not torch.isfinite(g).all() for g in before.values()), before
    assert cli_main(["lint", "--diff", str(path)]) == 1
    diff = capsys.readouterr().out
    assert path.read_text() == STORY  # --diff changes nothing
    assert "+import stablelosses.functional as SF" in diff
    assert cli_main(["lint", "--fix", str(path)]) == 1  # SL106 stays: report only
    remaining = capsys.readouterr().out.splitlines()
    assert [ln.split()[1] for ln in remaining] == ["SL106"]
    fixed = path.read_text()
    assert "return SF.rmse_loss(pred, y)  # the RMSE, as posted" in fixed  # comment kept
    assert "    return SF.softmax(x, -1)\n" in fixed
    assert "    logp = SF.log_softmax(logits, 1)\n" in fixed
    assert fixed.count("import stablelosses.functional as SF") == 1
    after = _grads(_load(path))
    assert all(torch.isfinite(g).all() for g in after.values()), after
    # the healthy points give what the old code gave
    old, new = _load(tmp_path / "story.py"), None
    path.write_text(STORY)
    new, old = old, _load(path)
    x = torch.randn(4, 6)
    t = torch.tensor([0, 1, 2, 3])
    torch.testing.assert_close(new["softmax"](x), old["softmax"](x))
    torch.testing.assert_close(new["focal"](x, t), old["focal"](x, t))
    torch.testing.assert_close(new["rmse"](x, x + 1), old["rmse"](x, x + 1))


def test_fix_keeps_formatting_and_is_idempotent(tmp_path):
    pytest.importorskip("libcst")
    src = textwrap.dedent("""\
        import torch  # torch
        import stablelosses.functional as SF


        def f(x,   y):   # odd spacing stays
            a = (torch.log(torch.softmax(x, -1)))
            b = torch.log(torch.sigmoid(torch.log(torch.softmax(y, 0))))
            return a,   b
        """)
    path = tmp_path / "f.py"
    path.write_text(src)
    assert run([str(path)], fix=True, out=io.StringIO()) == 0
    new = path.read_text()
    assert new.splitlines()[0] == "import torch  # torch"
    assert "def f(x,   y):   # odd spacing stays" in new and "return a,   b" in new
    assert "a = (SF.log_softmax(x, -1))" in new
    assert "b = torch.nn.functional.logsigmoid(SF.log_softmax(y, 0))" in new
    assert new.count("import stablelosses.functional as SF") == 1
    assert run([str(path)], fix=True, out=io.StringIO()) == 0
    assert path.read_text() == new


def test_fix_and_diff_keep_windows_line_endings(tmp_path):
    # a CRLF file: only the rewritten line changes, every line keeps its \r\n
    pytest.importorskip("libcst")
    src = "import torch\r\n\r\n\r\ndef f(x):  # keep\r\n    return torch.log(torch.softmax(x, -1))\r\n"
    path = tmp_path / "w.py"
    path.write_bytes(src.encode())
    out = io.StringIO()
    assert run([str(path)], diff=True, out=out) == 1
    assert [ln for ln in out.getvalue().splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")] == [
        "+import stablelosses.functional as SF",
        "-    return torch.log(torch.softmax(x, -1))",
        "+    return SF.log_softmax(x, -1)",
    ]
    assert run([str(path)], fix=True, out=io.StringIO()) == 0
    new = path.read_bytes().decode()
    assert new.count("\r\n") == new.count("\n") == 6 and "return SF.log_softmax(x, -1)\r\n" in new


def test_fix_leaves_a_commented_expression_alone(tmp_path):
    pytest.importorskip("libcst")
    src = "import torch\ny = torch.log(\n    torch.softmax(x, -1)  # keep me\n)\n"
    path = tmp_path / "c.py"
    path.write_text(src)
    assert run([str(path)], fix=True, out=io.StringIO()) == 1
    assert path.read_text() == src


def test_fix_without_libcst_says_what_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "libcst", None)
    path = tmp_path / "m.py"
    path.write_text(_src("torch.log(torch.sigmoid(x))"))
    assert cli_main(["lint", "--fix", str(path)]) == 2
    assert "pip install 'stablelosses[fix]'" in capsys.readouterr().err
    assert cli_main(["lint", str(path)]) == 1  # finding needs no libcst


def test_lint_module_imports_no_optional_dependency():
    code = ("import sys; import stablelosses.lint, stablelosses.lint.flake8_plugin; "
            "print([m for m in ('libcst', 'flake8') if m in sys.modules])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


def test_math_constant_neg_inf_spellings():
    for spelling in ("float('-inf')", "-float('inf')", "-math.inf", "-torch.inf", 'float("-Infinity")'):
        assert [f.code for f in lint_source(_src(f"torch.softmax(x.masked_fill(m, {spelling}), -1)"))] == ["SL109"]


def test_many_files_in_parallel_give_the_serial_report(tmp_path, monkeypatch):
    for i in range(70):
        (tmp_path / f"m{i:02d}.py").write_text(_src("torch.log(torch.sigmoid(x))" if i % 7 else "x + 1"))
    parallel, serial = io.StringIO(), io.StringIO()
    assert run([str(tmp_path)], fmt="json", out=parallel) == 1
    monkeypatch.setattr("os.cpu_count", lambda: 1)  # one process
    assert run([str(tmp_path)], fmt="json", out=serial) == 1
    got = json.loads(parallel.getvalue())
    assert got == json.loads(serial.getvalue()) and len(got) == 60
    assert [r["path"] for r in got] == sorted(r["path"] for r in got)
