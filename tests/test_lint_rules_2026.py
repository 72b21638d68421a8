"""The post-training rules (SL114-SL122) on the spellings real code uses: for each rule a spelling
it must report and one it must leave alone, each modeled on the public code named beside it
(the structure and the hazardous line kept, the names our own). Every safe rewrite is run: the
old value where the old code was finite, and a finite value and gradient where it was not."""

from __future__ import annotations

import textwrap

import pytest
import torch

import stablelosses.functional as SF
from stablelosses.lint import lint_source

libcst = pytest.importorskip("libcst")
from stablelosses.lint._runner import _fix_loop  # noqa: E402

HEAD = "import torch\nimport torch.nn.functional as F\n"


def codes(src: str) -> list[str]:
    return sorted({f.code for f in lint_source(HEAD + textwrap.dedent(src))})


def fixed(src: str) -> str:
    return _fix_loop(HEAD + textwrap.dedent(src), None, None, "")[0]


def run(src: str, fn: str, *args):
    env: dict = {"SF": SF}
    exec(compile(src, "<rule>", "exec"), env)
    leaves = [a.detach().clone().requires_grad_() for a in args]
    out = env[fn](*leaves)
    grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    return out.detach(), grads


def assert_rewrite_agrees(old: str, new: str, fn: str, *args):
    """``fn`` rewritten gives the original's values and gradients on ordinary inputs."""
    (v0, g0), (v1, g1) = run(old, fn, *args), run(new, fn, *args)
    torch.testing.assert_close(v1, v0)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a)


# (code, hazardous spelling, spelling left alone, where the spellings are from)
CASES = [
    ("SL114", """
        def compute_loss(logps, old_logps, adv):
            log_ratio = logps - old_logps
            coef = torch.exp(log_ratio)
            return -torch.min(coef * adv, torch.clamp(coef, 0.8, 1.2) * adv)
     """, """
        def compute_loss(logps, old_logps, adv):
            d = logps - old_logps
            d = torch.clamp(d, min=-20.0, max=20.0)
            ratio = torch.exp(d)
            return -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
     """, "TRL GRPOTrainer coef_1 = exp(log_importance_weights); verl compute_policy_loss clamps first"),
    ("SL114", """
        def clipped_ppo_loss(advantage, log_pi, log_old_pi):
            ratio = torch.exp(log_pi - log_old_pi)
            return torch.min(ratio * advantage, torch.clip(ratio, 0.8, 1.2) * advantage).mean()
     """, """
        def loss_fn(logps, adv):
            return torch.exp(logps - logps.detach()) * adv
     """, "PPO examples exp(log_pi - log_old_pi); TRL's exp(x - x.detach()) is a ratio of 1"),
    ("SL115", """
        def odds(chosen_logps, rejected_logps):
            return (chosen_logps - rejected_logps) - (
                torch.log1p(-torch.exp(chosen_logps)) - torch.log1p(-torch.exp(rejected_logps)))
     """, """
        def mixture(s, t, beta_t):
            return torch.logsumexp(torch.stack([s + torch.log1p(-beta_t), t + torch.log(beta_t)]), 0)
     """, "Liger-Kernel / TRL ORPO log-odds; TRL's JSD mixture log1p(-beta)"),
    ("SL116", """
        def kl(ref_logps, logps):
            return torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
     """, """
        def kl(ref_logps, logps):
            return torch.expm1(ref_logps - logps) - (ref_logps - logps)
     """, "TRL GRPOTrainer per_token_kl; the expm1 form"),
    ("SL116", """
        def approx_kl(log_probs, log_probs_base):
            log_ratio = log_probs.float() - log_probs_base.float()
            log_ratio = (-log_ratio).exp() - 1 + log_ratio
            return log_ratio
     """, """
        def approx_kl(log_probs, log_probs_base):
            log_ratio = log_probs.float() - log_probs_base.float()
            return log_ratio ** 2 / 2.0
     """, "OpenRLHF compute_approx_kl k3 and k2"),
    ("SL117", """
        def compute_loss(per_token_logps, old_per_token_logps, adv, completion_mask):
            coef = torch.exp(per_token_logps - old_per_token_logps)
            per_token_loss = -torch.min(coef * adv, torch.clamp(coef, 0.8, 1.2) * adv)
            return (per_token_loss * completion_mask).sum()
     """, """
        def compute_loss(logits, labels, completion_mask):
            per_token_logps = F.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
            return -(per_token_logps * completion_mask).sum()
     """, "TRL / Liger GRPO per-token loss times completion_mask; an NLL on log_softmax"),
    ("SL118", """
        def sinc(a):
            return torch.where(a == 0, 1, torch.sin(a) / a)
     """, """
        def renorm_factor(norm, maxnorm, eps):
            return torch.where(norm > maxnorm, maxnorm / (norm + eps), 1.0)
     """, "torch._refs sinc; torch._refs renorm (the divisor has an eps)"),
    ("SL118", """
        def safe_log(x):
            return torch.where(x > 0, torch.log(x), 0.0)
     """, """
        def stability(mask_logits, delta):
            area_i = torch.sum(mask_logits > delta, dim=-1).float()
            area_u = torch.sum(mask_logits > -delta, dim=-1).float()
            return torch.where(area_u > 0, area_i / area_u, 1.0)
     """, "the where-log guard of many losses; SAM's stability score divides counts (no gradient)"),
    ("SL119", """
        def entropy(log_prob):
            return -(torch.exp(log_prob) * log_prob).sum(0)
     """, """
        def entropy(logits):
            normalized = torch.log_softmax(logits, -1)
            p = normalized.exp()
            return -(normalized * p).nansum(-1)
     """, "torch.distributions Binomial.entropy; transformers' logits processor uses nansum"),
    ("SL120", """
        def jsd(student_log_probs, teacher_log_probs, support_mask=None):
            if support_mask is not None:
                raise NotImplementedError
            return F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
     """, """
        def kl_penalty(logprob, ref_logprob):
            return F.kl_div(ref_logprob, logprob, log_target=True, reduction="none").sum(-1)
     """, "TRL distillation _jsd_divergence (top-k support); verl's full-vocabulary kl penalty"),
    ("SL121", """
        def forward(h, attention_mask):
            return (h * attention_mask.unsqueeze(-1)).sum(dim=1) / attention_mask.sum(dim=1, keepdim=True)
     """, """
        def loss_fn(per_token_loss, mask):
            return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
     """, "ModernBERT mean pooling; TRL GRPO's clamped per-sequence mean"),
    ("SL122", """
        def gaussian_nll(input, target, var, eps=1e-6):
            var = var.clone()
            with torch.no_grad():
                var.clamp_(min=eps)
            return 0.5 * (torch.log(var) + (input - target) ** 2 / var)
     """, """
        def clip_weights(critic, c):
            with torch.no_grad():
                for p in critic.parameters():
                    p.clamp_(-c, c)
     """, "torch.nn.functional.gaussian_nll_loss; WGAN weight clipping"),
]


@pytest.mark.parametrize("code, bad, good, source", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule_on_real_spellings(code, bad, good, source):
    assert code in codes(bad), source
    assert code not in codes(good), source


def test_log1mexp_rewrite_is_exact_where_finite_and_finite_near_zero():
    src = fixed("""
        def odds(c, r):
            return (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    """)
    assert "log1p(-torch.exp(" in src and "expm1" in src
    old = HEAD + textwrap.dedent("""
        def odds(c, r):
            return (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    """)
    c = torch.tensor([-0.2, -1.5, -3.0], dtype=torch.float64)
    r = torch.tensor([-2.0, -0.4, -4.0], dtype=torch.float64)
    assert_rewrite_agrees(old, src, "odds", c, r)
    near = torch.tensor([-1e-9, -0.5]), torch.tensor([-2.0, -3.0])
    v0, g0 = run(old, "odds", *near)
    v1, g1 = run(src, "odds", *near)
    assert not torch.isfinite(v0).all() and torch.isfinite(v1).all()
    assert all(torch.isfinite(g).all() for g in g1)
    # against float64: log(1 - exp(x)) at x = -1e-9 is log(1e-9)
    expect = (2.0 - torch.tensor(1e-9, dtype=torch.float64).log()
              + torch.log1p(-torch.exp(torch.tensor(-2.0, dtype=torch.float64))))
    torch.testing.assert_close(v1[0].double(), expect, rtol=1e-5, atol=1e-5)


def test_k3_rewrite_keeps_the_value_and_is_accurate_at_small_d():
    src = """
        def kl(ref_logps, logps):
            return torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
    """
    old, new = HEAD + textwrap.dedent(src), fixed(src)
    assert "torch.expm1(ref_logps - logps) - (ref_logps - logps)" in new
    a = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    b = torch.tensor([-1.3, -1.2, -0.9], dtype=torch.float64)
    assert_rewrite_agrees(old, new, "kl", a, b)
    ref = run(new, "kl", a, a + 1e-4)[0]  # float64 reference, d = 1e-4
    low_old = run(old, "kl", a.float(), (a + 1e-4).float())[0].double()
    low_new = run(new, "kl", a.float(), (a + 1e-4).float())[0].double()
    err_old = ((low_old - ref).abs() / ref).max()
    err_new = ((low_new - ref).abs() / ref).max()
    assert err_new < err_old / 10


def test_double_where_rewrite_keeps_the_value_and_makes_the_gradient_finite():
    src = """
        def safe_log(x):
            return torch.where(x > 0, torch.log(x), 0.0)
    """
    old, new = HEAD + textwrap.dedent(src), fixed(src)
    assert "torch.log(torch.where(x > 0, x, 1))" in new
    x = torch.tensor([0.0, 2.0, -1.0], dtype=torch.float64)
    (v0, g0), (v1, g1) = run(old, "safe_log", x), run(new, "safe_log", x)
    torch.testing.assert_close(v1, v0)
    assert torch.isnan(g0[0]).any() and torch.isfinite(g1[0]).all()
    torch.testing.assert_close(g1[0][1], g0[0][1])


def test_entropy_rewrite_is_zero_at_masked_entries():
    src = """
        def entropy(log_prob):
            return -(torch.exp(log_prob) * log_prob).sum(-1)
    """
    old, new = HEAD + textwrap.dedent(src), fixed(src)
    assert "SF.xlogy(log_prob.exp(), log_prob.exp())" in new
    lp = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0], [0.5, -1.0, 3.0]], dtype=torch.float64), -1)
    assert_rewrite_agrees(old, new, "entropy", lp)
    masked = torch.log_softmax(torch.tensor([[0.0, float("-inf"), 2.0]]), -1)
    v0, _ = run(old, "entropy", masked)
    v1, g1 = run(new, "entropy", masked)
    assert torch.isnan(v0).all() and torch.isfinite(v1).all() and torch.isfinite(g1[0]).all()


def test_row_mean_rewrite_is_zero_for_an_empty_row():
    src = """
        def loss_fn(per_token_loss, completion_mask):
            return per_token_loss.sum(-1) / completion_mask.sum(-1)
    """
    old, new = HEAD + textwrap.dedent(src), fixed(src)
    assert "SF.safe_div(per_token_loss.sum(-1), completion_mask.sum(-1))" in new
    x = torch.tensor([[1.0, 2.0], [0.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    (v0, _), (v1, g1) = run(old, "loss_fn", x, m), run(new, "loss_fn", x, m)
    torch.testing.assert_close(v1[0], v0[0])
    assert torch.isnan(v0[1]) and v1[1] == 0 and all(torch.isfinite(g).all() for g in g1 if g is not None)
