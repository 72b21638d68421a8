"""The demo (``python -m stablelosses``): every hazard, naive beside stable, a clean table."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from stablelosses import _demo, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXPECTED_HAZARDS = [
    "sqrt at 0", "RMSE", "b = 0", "z = [92, 1]", "fully masked", "logsumexp of all -inf",
    "log_softmax", "xlogy", "[[10, -200]]", "γ=0.5 at p_t", "sigmoid focal", "label smoothing",
    "kl_div", "log(cosh(x))", "float16 RMSE", "normalize a zero vector", "cosine similarity",
    "logaddexp(-inf, -inf)", "empty mask", "entropy", "Dice", "InfoNCE",
    # every torch.nn loss (0.4)
    "BCE with logits", "Gaussian NLL", "CTC", "cosine embedding", "soft margin",
    # post-training and distillation (0.4)
    "GRPO ratio", "ORPO log-odds", "forward KL distillation", "token log-probs", "DPO",
]

# A fresh install: torch and stablelosses, no numpy. The finder makes `import numpy` fail as it
# does when numpy is not installed, for the whole process (torch's C++ import included).
NO_NUMPY = textwrap.dedent("""
    import importlib.abc, runpy, sys

    class NoNumpy(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "numpy" or name.startswith("numpy."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoNumpy())
    sys.argv = ["stablelosses"]
    runpy.run_module("stablelosses", run_name="__main__")
    assert "numpy" not in sys.modules or sys.modules["numpy"] is None
""")


def run_python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="default")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env, check=False)


def test_demo_data_covers_every_hazard():
    names = [h.name for h in _demo.HAZARDS]
    assert len(names) == len(set(names)) == len(EXPECTED_HAZARDS)
    for part in EXPECTED_HAZARDS:
        assert sum(part in n for n in names) >= 1, part


@pytest.mark.parametrize("hazard", _demo.HAZARDS, ids=lambda h: h.name)
def test_demo_naive_fails_where_stable_is_finite(hazard):
    naive = _demo.evaluate(hazard, "naive")
    assert naive.error is None
    assert not naive.ok, f"the naive formula is fine: {naive.value_text} {naive.grad_text}"
    stable = _demo.evaluate(hazard, "stable")
    assert stable.error is None, stable.error
    assert stable.ok, f"{stable.value_text} {stable.grad_text}"


def test_demo_reports_an_exception_in_its_cell():
    def boom(*_):
        raise NotImplementedError("not there")

    h = _demo.Hazard("boom", lambda: (_demo._t(1.0),), boom, boom)
    res = _demo.evaluate(h, "stable")
    assert res.error == "NotImplementedError: not there" and not res.ok
    lines = _demo.render([h]).splitlines()
    assert lines[2] == "boom" and lines[4].startswith("  stablelosses") and "error" in lines[4]


@pytest.mark.slow  # a fresh interpreter (torch import)
def test_demo_subprocess_prints_the_table_without_warnings():
    proc = run_python("-m", "stablelosses", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no torch warning, nothing else
    lines = proc.stdout.splitlines()
    header = lines[0]
    assert header.split()[:2] == ["hazard,", "formula"]
    col_value = header.index("value")
    for h in _demo.HAZARDS:
        i = lines.index(h.name)  # the hazard's name, alone on its line, then naive and stable
        naive, stable = lines[i + 1], lines[i + 2]
        assert naive.startswith("  naive ") and stable.startswith("  stablelosses "), (naive, stable)
        assert naive.rstrip().endswith("NaN/inf"), naive
        assert "nan" in naive[col_value:] or "inf" in naive[col_value:], naive
        assert stable.rstrip().endswith("ok"), stable
        # the columns line up: the value starts where the header says
        for row in (naive, stable):
            assert row[col_value - 2:col_value] == "  " and row[col_value] != " ", row


def test_every_demo_column_has_a_header():
    lines = _demo.render().splitlines()
    header, rule = lines[0], lines[1]
    # the rule line has one dash run per column; each run starts under a header word
    starts = [i for i, c in enumerate(rule) if c == "-" and (i == 0 or rule[i - 1] == " ")]
    assert len(starts) == 4
    for i in starts:
        assert header[i] != " ", (i, header)
    assert header.split()[-1] == "ok?"


def test_demo_table_fits_in_100_columns():
    text = _demo.render()
    assert max(len(ln) for ln in text.splitlines()) <= 100, max(text.splitlines(), key=len)


def test_demo_dice_row_has_both_masks_empty_and_shows_the_defined_value():
    (dice,) = [h for h in _demo.HAZARDS if h.name.startswith("Dice")]
    pred, target = dice.inputs()
    assert not pred.any() and not target.any()  # every sample: prediction and target empty
    assert _demo.evaluate(dice, "stable").value_text == "0"  # empty against empty: a perfect match


@pytest.mark.slow  # a fresh interpreter (torch import)
def test_demo_without_numpy_prints_no_torch_warning():
    proc = run_python("-c", NO_NUMPY, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "NumPy" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    assert proc.stderr == ""
    n = len(_demo.HAZARDS)
    assert f"{n} of {n} stablelosses calls are finite" in proc.stdout


def test_demo_render_in_process(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert f"of {len(_demo.HAZARDS)} naive formulas give NaN/inf" in out
    assert cli.main(["demo"]) == 0


def _scripted(x):
    return x + 1


def test_pytest_configuration_silences_the_known_torch_warnings_and_no_other():
    # the configured filters are in force inside a test; record what gets through them
    import warnings

    import torch
    import torch.nn.functional as F

    with warnings.catch_warnings(record=True) as record:
        torch.testing.make_tensor((2,), dtype=torch.float32, device="cpu", low=1.0, high=1.0)
        torch.jit.script(_scripted)
        F.mse_loss(torch.zeros(4, 5), torch.zeros(5))
        torch.nn.MSELoss(size_average=False)
        F.kl_div(torch.zeros(2, 3), torch.zeros(2, 3), reduction="mean")
    assert [str(w.message) for w in record] == []
    with warnings.catch_warnings(record=True) as record:
        warnings.warn("a new warning from the library", UserWarning, stacklevel=1)
        warnings.warn("torch.jit.script is new here", DeprecationWarning, stacklevel=1)
    assert len(record) == 2  # anything else is still seen


def test_readme_says_how_to_get_the_right_torch_build_before_the_install_commands():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    cpu = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in readme
    assert readme.index(cpu) < readme.index("pip install -e . && python -m stablelosses")
    assert readme.index(cpu) < readme.index('pip install -e ".[test]"')
    # plain `pip install torch` is the CUDA build on Linux, not the CPU one
    assert "`pip install torch` first if you want the CPU build" not in readme.replace("\n", " ")


def test_docs_warn_about_torchvision_and_timm_pulling_a_mismatched_torch():
    migration = open(os.path.join(ROOT, "docs", "migration.md"), encoding="utf-8").read()
    section = migration[migration.index("## torchvision `sigmoid_focal_loss`"):]
    section = section[: section.index("\n## ", 1)]
    assert "does not import" in section and "download.pytorch.org/whl/cpu" in section
    assert "timm" in section and "upgrade torch" in section
    assert "operator torchvision::nms does not exist" in section  # what the mismatch prints


def test_migration_torchvision_recipe_pins_the_pair_ci_installs():
    # torchvision 0.M is built for torch 2.(M - 15) exactly (its wheel's Requires-Dist: 0.28.0
    # requires torch==2.13.0); the recipe pins that pair, and the torch is the one CI installs
    import re

    migration = open(os.path.join(ROOT, "docs", "migration.md"), encoding="utf-8").read()
    section = _section(migration, "## torchvision `sigmoid_focal_loss`")
    (line,) = [ln for ln in section.splitlines() if ln.startswith("pip install") and "torchvision==" in ln]
    torch_v = re.search(r'"torch==(2\.(\d+)\.\d+)"', line)
    vision_v = re.search(r'"torchvision==0\.(\d+)\.\d+"', line)
    assert torch_v and vision_v and "--index-url https://download.pytorch.org/whl/cpu" in line
    assert int(vision_v.group(1)) == int(torch_v.group(2)) + 15
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert f'"torch=={torch_v.group(1)}"' in ci


def _section(text: str, heading: str) -> str:
    part = text[text.index(heading):]
    return part[: part.index("\n## ", 1)]


def test_migration_kornia_section_says_ignored_nan_rows_give_nan_gradients_and_mask_drops_them():
    import torch
    import torch.nn.functional as F

    import stablelosses.functional as SF

    section = _section(open(os.path.join(ROOT, "docs", "migration.md"), encoding="utf-8").read(),
                       "## kornia `focal_loss`")
    flat = " ".join(section.split())
    assert "NaN" in flat and "ignore_index" in flat and "mask=" in flat and "as in torch" in flat
    # what the page claims: the ignored row's NaN reaches its gradient, as in torch; mask= drops it
    target = torch.tensor([-100, 1])
    for fn in (F.cross_entropy, SF.focal_loss):
        x = torch.tensor([[math.nan, 0.0], [1.0, 2.0]], requires_grad=True)
        fn(x, target).backward()
        assert x.grad[0].isnan().all() and x.grad[1].isfinite().all()
    x = torch.tensor([[math.nan, 0.0], [1.0, 2.0]], requires_grad=True)
    SF.focal_loss(x, target, mask=torch.tensor([False, True])).backward()
    assert (x.grad[0] == 0).all()


def test_readme_focal_row_says_a_scalar_alpha_is_a_constant_weight_that_cancels_in_mean():
    import torch

    import stablelosses.functional as SF

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    (row,) = [ln for ln in readme.splitlines() if ln.startswith("| hand-written softmax→log `FocalLoss`")]
    assert "scalar `alpha`" in row and "cancels in `'mean'`" in row
    x, t = torch.randn(5, 3), torch.tensor([0, 1, 2, 1, 0])
    w = torch.full((3,), 0.25)
    torch.testing.assert_close(SF.focal_loss(x, t, weight=w), SF.focal_loss(x, t))
    torch.testing.assert_close(SF.focal_loss(x, t, weight=w, reduction="sum"),
                               0.25 * SF.focal_loss(x, t, reduction="sum"))


def test_demo_explains_the_two_rows_that_differ_by_definition():
    import torch

    from stablelosses._demo import HAZARDS, evaluate, render

    by_name = {h.name: h for h in HAZARDS}
    masked = by_name["log_softmax with a masked row"]
    smooth = by_name["cross_entropy, label smoothing, -inf logit"]
    assert masked.note and smooth.note
    # what the masked row's sentence claims: the gradients differ, and agree once the loss
    # leaves the masked entries out
    n, s = evaluate(masked, "naive"), evaluate(masked, "stable")
    assert not torch.equal(n.grad[0], s.grad[0]) and "differ by definition" in masked.note
    keep = torch.tensor([[True, True, False], [False] * 3])
    grads = []
    for fn in (masked.naive, masked.stable):
        x = masked.inputs()[0].requires_grad_(True)
        fn(x)[keep].sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1])
    # the smoothing row's sentence quotes the computed value
    assert evaluate(smooth, "stable").value_text in smooth.note and "change of definition" in smooth.note
    assert evaluate(smooth, "naive").value_text == "inf"
    text = render()
    assert masked.note.split(":")[0] in text.replace("\n  ", " ")


def _in_float64(hazard, pick=lambda *xs: xs):
    """The row's naive formula on float64 copies of (a part of) its inputs: exp(200),
    1 - exp(-1e-9) and sigmoid(-200) do not round there, so it is a reference that does not share
    the float32 failure (nor our code)."""
    def inputs():
        return pick(*(x.double() if x.is_floating_point() else x for x in hazard.inputs()))
    return _demo.evaluate(replace(hazard, inputs=inputs), "naive")


def _post_training_row(prefix):
    (h,) = [h for h in _demo.HAZARDS if h.name.startswith(prefix)]
    return h, _demo.evaluate(h, "stable")


@pytest.mark.parametrize("prefix", ["GRPO ratio", "ORPO log-odds", "DPO"])
def test_demo_post_training_row_matches_its_formula_in_float64(prefix):
    import torch

    h, ours = _post_training_row(prefix)
    ref = _in_float64(h)
    assert ref.ok, (ref.value_text, ref.grad_text)
    torch.testing.assert_close(ours.value.double(), ref.value, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-5, atol=1e-12)


def test_demo_grpo_row_gives_the_masked_position_an_exact_zero_gradient():
    h, ours = _post_training_row("GRPO ratio")
    mask = h.inputs()[3]
    assert not mask[0, 1] and ours.grad[0, 1] == 0  # not exp(200) · 0
    assert _demo.evaluate(h, "naive").grad[0, 1].isnan()


def test_demo_distillation_row_matches_the_forward_kl_over_the_finite_vocabulary():
    import torch

    h, ours = _post_training_row("forward KL distillation")
    student, teacher = h.inputs()
    assert student[0, 2] == teacher[0, 2] == -math.inf  # the masked entry: no mass on either side
    ref = _in_float64(h, pick=lambda s, t: (s[..., :2], t[..., :2]))
    assert ref.ok
    torch.testing.assert_close(ours.value.double(), ref.value, rtol=1e-5, atol=0)
    torch.testing.assert_close(ours.grad[..., :2].double(), ref.grad, rtol=1e-5, atol=0)
    assert ours.grad[0, 2] == 0
    assert _demo.evaluate(h, "naive").value.isnan()  # 0 · (-inf - (-inf))


def test_demo_token_logps_row_gives_the_ignored_row_zero_with_gradient_zero():
    import torch

    h, ours = _post_training_row("token log-probs")
    logits, labels = h.inputs()
    assert labels[1] == -100 and (logits[1] == -math.inf).all() and logits[0, 2] == -math.inf
    ref = _in_float64(h, pick=lambda x, t: (x[:1], t[:1]))
    assert ref.ok
    torch.testing.assert_close(ours.value[:1].double(), ref.value, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.grad[:1].double(), ref.grad, rtol=1e-6, atol=0)
    assert ours.value[1] == 0 and (ours.grad[1] == 0).all()
    assert _demo.evaluate(h, "naive").grad[1].isnan().all()
