"""The doctor on "finite loss, NaN gradient": a value that a where/min/clamp drops in the forward
still has its backward run, and 0 * inf there is NaN. The report names the backward node, the
forward line that made the non-finite value, the operator and line that did not select it, and
the fix. Inputs as in the public reports: a GRPO ratio at a padded token, the entropy of logits
with a masked (-inf) vocabulary entry, a distillation KL on top-k (-inf) log-probs."""

from __future__ import annotations

import inspect
import pickle

import pytest
import torch
import torch.nn.functional as F

from stablelosses.debug import NonFiniteError, detect_nonfinite


def _line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(lines) if text in ln)


def _grpo(logps, old_logps, mask, adv):
    ratio = torch.exp(logps - old_logps)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
    return torch.where(mask, per_token, 0.0).sum() / mask.sum()


def _entropy(logits):
    logp = torch.log_softmax(logits, -1)
    ent = -(logp.exp() * logp)
    return torch.where(torch.isfinite(logits), ent, 0.0).sum(-1).mean()


def _distill(student, teacher, keep):
    s = torch.log_softmax(student.masked_fill(~keep, float("-inf")), -1)
    t = torch.log_softmax(teacher.masked_fill(~keep, float("-inf")), -1)
    kl = F.kl_div(t, s, log_target=True, reduction="none")  # reverse KL: the student is the target
    return torch.where(keep, kl, 0.0).sum(-1).mean()


def _grpo_inputs():
    logps = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
    old_logps = torch.tensor([[-1.1, -0.4, -95.0]])  # a padded position: stale log-prob
    return logps, old_logps, torch.tensor([[True, True, False]]), torch.tensor([[1.0]])


def _report(fn, *args, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        with detect_nonfinite(**kw):
            fn(*args).backward()
    return info.value


def test_grpo_loss_is_finite_and_its_gradient_is_not():
    logps, old, mask, adv = _grpo_inputs()
    loss = _grpo(logps, old, mask, adv)
    loss.backward()
    assert torch.isfinite(loss) and torch.isnan(logps.grad).any()


def test_grpo_backward_names_the_node_the_exp_line_and_the_min():
    err = _report(_grpo, *_grpo_inputs(), forward=False)
    assert err.phase == "backward" and err.node == "ExpBackward0" and err.forward_op == "aten::exp"
    assert err.lineno == _line_of(_grpo, "ratio = torch.exp")
    ops = [d[0] for d in err.discarded_by]
    assert "aten::minimum" in ops or "aten::clamp" in ops
    assert all(d[2] == _line_of(_grpo, "per_token = -torch.min") for d in err.discarded_by)
    text = str(err)
    assert "0 * inf in ExpBackward0" in text and "not selected by: aten::" in text
    assert "hazards/finite-loss-nan-gradient" in err.hint and "SF.policy_loss" in err.hint
    assert pickle.loads(pickle.dumps(err)).discarded_by == err.discarded_by


def test_grpo_forward_report_points_at_the_ratio_and_the_nan_gradient_page():
    err = _report(_grpo, *_grpo_inputs())
    assert err.phase == "forward" and err.op == "aten::exp" and err.cause == "overflow"
    assert "hazards/finite-loss-nan-gradient" in err.hint


def test_entropy_of_masked_logits_names_the_mul_and_the_where():
    logits = torch.tensor([[0.0, 1.0, float("-inf")], [2.0, 0.0, 1.0]], requires_grad=True)
    loss = _entropy(logits)
    assert torch.isfinite(loss)
    err = _report(_entropy, logits, forward=False)
    assert err.node == "MulBackward0" and err.lineno == _line_of(_entropy, "ent = -(logp.exp() * logp)")
    assert [d[0] for d in err.discarded_by] == ["aten::where"]
    assert err.discarded_by[0][2] == _line_of(_entropy, "torch.where(torch.isfinite")
    assert "finite-loss-nan-gradient" in err.hint


def test_distillation_on_top_k_log_probs_names_the_kl_line():
    keep = torch.tensor([[True, True, False, False]])
    student = torch.tensor([[1.0, 0.5, -1.0, 2.0]], requires_grad=True)
    teacher = torch.tensor([[0.5, 1.0, 3.0, -2.0]])
    loss = _distill(student, teacher, keep)
    loss.backward()
    assert torch.isfinite(loss) and torch.isnan(student.grad).any()
    # the NaN is made in the forward (-inf - -inf inside kl_div) and dropped by the where; its
    # backward then spreads it through the log_softmax: the report is the forward subtraction
    err = _report(_distill, student, teacher, keep)
    assert err.phase == "forward" and err.op == "aten::sub" and err.cause == "invalid"
    assert err.lineno == _line_of(_distill, "kl = F.kl_div")
    assert "hazards/kl-zero-targets" in err.hint


def test_a_nan_gradient_without_a_dropped_value_keeps_its_old_report():
    x = torch.zeros(3, requires_grad=True)
    err = _report(lambda v: torch.sqrt(v).sum(), x, forward=False)
    assert err.discarded_by == [] and "sqrt-at-zero" in err.hint


ZERO_NORM = [
    ("norm", lambda v: v.norm(), "LinalgVectorNormBackward0", "zero-vector"),
    ("v / (sqrt(sum v**2) + eps)", lambda v: (v / (torch.sqrt((v**2).sum()) + 1e-8)).sum(), "SqrtBackward0",
     "sqrt-at-zero"),
    ("pairwise_distance(x, x, eps=0)", lambda v: F.pairwise_distance(v[None], v[None], eps=0).sum(),
     "NormBackward1", "zero-vector"),
]


@pytest.mark.parametrize("case", ZERO_NORM, ids=[c[0] for c in ZERO_NORM])
def test_a_zero_over_zero_at_a_norm_or_sqrt_of_zero_is_not_an_unused_branch(case):
    # the incoming gradient is not 0 because of a where, and the forward value (0) is finite:
    # the backward's own 0/0 at the singular point
    _, fn, node, page = case
    err = _report(fn, torch.zeros(3, requires_grad=True), forward=False)
    assert (err.node, err.cause) == (node, "0/0")
    assert err.discarded_by == [] and "where the forward value" not in str(err)
    assert ": 0/0 (zero over zero)" in str(err).splitlines()[0]
    assert err.hint.endswith(f"docs: hazards/{page}") and "finite-loss-nan-gradient" not in err.hint


def test_a_norm_that_a_clamp_drops_is_still_an_unused_branch():
    v = torch.zeros(3, requires_grad=True)
    err = _report(lambda v: (v / v.norm().clamp_min(1e-8)).sum(), v, forward=False)
    assert err.node == "LinalgVectorNormBackward0" and "finite-loss-nan-gradient" in err.hint
    assert [d[0] for d in err.discarded_by] == ["aten::clamp_min"]
    assert "0/0 in LinalgVectorNormBackward0" in str(err) and "not finite" not in str(err)


SQRT_SCRIPT = '''\
import torch
x = torch.tensor([0.0, 4.0], requires_grad=True)
y = torch.where(x > 0, torch.sqrt(x), 0.0)
loss = y.sum()
print("loss", float(loss.detach()))
loss.backward()
'''


def test_trace_names_the_dropped_branch(tmp_path, capsys):
    from stablelosses import cli

    script = tmp_path / "where_sqrt.py"
    script.write_text(SQRT_SCRIPT)
    assert cli.main(["trace", str(script)]) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    assert "loss 2.0" in text  # the loss is finite
    assert "SqrtBackward0" in text and f"{script}:3" in text
    assert "not selected by: aten::where" in text
    assert "hazards/finite-loss-nan-gradient" in text
