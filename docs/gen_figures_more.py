"""Figures of the hazard pages for the 0.2 ops: zero vectors, logaddexp, empty masks,
masked entropy, Dice on empty masks.

Run at build time by ``docs/hooks.py`` after ``docs/gen_figures.py`` (whose ``Row``/``Figure``/
``render`` machinery this module reuses), or by hand: ``python docs/gen_figures_more.py [OUT]``.
Every figure calls the real functions of :mod:`stablelosses.functional`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import stablelosses.functional as SF

_DOCS = Path(__file__).resolve().parent


def _base():
    """docs/gen_figures.py, loaded once under the name the mkdocs hook gives it."""
    name = "_sl_gen_figures"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _DOCS / "gen_figures.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def figures() -> list:
    g = _base()
    Row, Figure, leaf_of = g.Row, g.Figure, g._leaf
    ray = _with_zero(np.linspace(-1, 1, 201))
    figs = []

    # --- zero vectors: normalize, cosine_similarity, info_nce_loss --------------------------
    other = torch.tensor([[1.0, 1.0]])

    def curve(r: torch.Tensor) -> torch.Tensor:
        """The vector [r, r²]: the zero vector at r = 0, turning as r moves."""
        return torch.stack([r, r * r])[None]

    def norm_case(fn):
        def case(r):
            leaf = leaf_of(r)
            return fn(curve(leaf))[0, 0], leaf
        return case

    def cos_case(fn):
        def case(r):
            leaf = leaf_of(r)
            return fn(curve(leaf), other)[0], leaf
        return case

    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.5], [0.3, -1.0]])

    def nce_case(fn):
        def case(r):
            leaf = leaf_of(r)
            q = torch.cat([curve(leaf), keys[1:] + 0.1])
            return fn(q, keys), leaf
        return case

    figs.append(Figure("zero-vector", [
        Row("normalize([r, r²])[0]", ray, "r (r = 0: the zero vector)",
            norm_case(lambda x: x / x.norm(dim=1, keepdim=True)), norm_case(SF.normalize),
            "naive: x / x.norm(dim=1, keepdim=True)", "stablelosses: normalize(x)",
            "first component", "∂/∂r", singular=0.0, var="r"),
        Row("cosine_similarity([r, r²], [1, 1])", ray, "r (r = 0: x1 is the zero vector)",
            cos_case(F.cosine_similarity), cos_case(SF.cosine_similarity),
            "naive: F.cosine_similarity (eps=1e-8)", "stablelosses: cosine_similarity",
            "cosine", "∂/∂r", singular=0.0, var="r", linthresh=1.0, grad_scale="symlog"),
        Row("info_nce_loss, query 0 = [r, r²], N = 4", ray, "r (r = 0: query 0 is zero)",
            nce_case(lambda q, k: F.cross_entropy(F.normalize(q) @ F.normalize(k).T / 0.07,
                                                  torch.arange(4))),
            nce_case(SF.info_nce_loss),
            "naive: F.cross_entropy(F.normalize(q) @ F.normalize(k).T / τ, arange(N))",
            "stablelosses: info_nce_loss(q, k)", "loss", "∂loss/∂r", singular=0.0, var="r",
            linthresh=1.0, grad_scale="symlog"),
    ]))

    # --- logaddexp(-inf, -inf) in a log-space forward recursion -----------------------------
    def dp_case(lae):
        # Two steps of a CTC/HMM-style forward algorithm over 4 states: states 2 and 3 are not
        # reachable yet (-inf), so state 3's update is logaddexp(-inf, -inf). The emission
        # log-score x is shared by states 0, 2 and 3 (as a tied parameter would be).
        def case(x):
            leaf = leaf_of(x)
            alpha0 = torch.tensor([0.0, 0.5, float("-inf"), float("-inf")]) + leaf * torch.tensor(
                [1.0, 0.0, 1.0, 1.0])
            alpha1 = torch.stack([alpha0[0]] + [lae(alpha0[s], alpha0[s - 1]) for s in (1, 2, 3)])
            return torch.logsumexp(alpha1, 0), leaf
        return case

    figs.append(Figure("logaddexp-neg-inf", [Row(
        "log-space forward recursion with unreachable states", np.linspace(-4, 5, 181),
        "emission log-score x", dp_case(torch.logaddexp), dp_case(SF.logaddexp),
        "naive: torch.logaddexp", "stablelosses: logaddexp", "log-likelihood", "∂/∂x")]))

    # --- masked mean over an empty mask -----------------------------------------------------
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def mm_case(fn):
        def case(x):
            leaf = leaf_of(x)
            mask = torch.arange(4) < x  # x ≤ 0: no valid entry
            return fn(leaf * weights, mask), leaf
        return case

    figs.append(Figure("masked-mean-empty", [Row(
        "mean of x·[1, 2, 3, 4] over the entries i < x", np.linspace(-2, 4, 241),
        "x (the loss scale and the number of valid entries)",
        mm_case(lambda v, m: (v * m).sum() / m.sum()), mm_case(SF.masked_mean),
        "naive: (loss * mask).sum() / mask.sum()", "stablelosses: masked_mean(loss, mask)",
        "masked mean", "∂/∂x", singular=0.0, var="x")]))

    # --- entropy with a masked action -------------------------------------------------------
    def ent_case(fn):
        def case(x):
            leaf = leaf_of(x)
            return fn(torch.stack([leaf, torch.tensor(0.0), torch.tensor(float("-inf"))])), leaf
        return case

    figs.append(Figure("masked-entropy", [Row(
        "entropy of logits [x, 0, −inf] (action 2 masked)", np.linspace(-8, 8, 161), "logit x",
        ent_case(lambda z: -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum()),
        ent_case(SF.entropy),
        "naive: -(softmax(z) * log_softmax(z)).sum()", "stablelosses: entropy(z)",
        "entropy", "∂H/∂x")]))

    # --- Dice loss, both empty --------------------------------------------------------------
    # Image 0 has an object, image 1 is empty and predicted empty: one such image in the batch.
    target = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    base = torch.tensor([[0.0, 0.5, 0.1, 0.7], [0.0, 0.0, 0.0, 0.0]])
    coeff = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])

    def dice_case(fn):
        def case(x):
            leaf = leaf_of(x)
            # Both images come out of the same parameter x, as from one network; image 1's
            # output is 0 whatever x is (x · 0).
            pred = base + leaf * coeff
            return fn(pred, target), leaf
        return case

    def naive_dice(p, t):
        return (1 - 2 * (p * t).sum(1) / (p.sum(1) + t.sum(1))).mean()

    figs.append(Figure("dice-empty", [Row(
        "batch Dice loss; image 1 empty in prediction and target", np.linspace(0, 1, 101),
        "predicted probability x of pixel 0 in image 0", dice_case(naive_dice), dice_case(SF.dice_loss),
        "naive: (1 − 2Σpt / (Σp + Σt)).mean()", "stablelosses: dice_loss(p, t)", "loss", "∂loss/∂x")]))

    # --- GRPO: a padded token whose log-ratio overflows exp ---------------------------------
    advantage = torch.tensor([1.0])
    old = torch.tensor([[-1.1, 0.0]])
    keep = torch.tensor([[True, False]])  # token 1 is padding

    def naive_grpo(logps):  # TRL's spelling: exp, clip, min, then the mask multiply
        ratio = torch.exp(logps - old)
        per_token = -torch.min(ratio * advantage, torch.clamp(ratio, 0.8, 1.2) * advantage)
        return (per_token * keep).sum() / keep.sum()

    def grpo_case(fn):
        def case(d):
            leaf = leaf_of(d)
            return fn(torch.stack([torch.tensor(-1.0), leaf])[None]), leaf
        return case

    figs.append(Figure("grpo-padding", [
        Row("GRPO loss; token 1 is padding with log-ratio d", np.linspace(-150, 150, 301),
            "log-ratio d of the padded token (exp overflows float32 above 88.7)",
            grpo_case(naive_grpo),
            grpo_case(lambda lp: SF.policy_loss(lp, old, advantage, keep, loss_type="bnpo")),
            "naive: exp, clip, min, × mask (TRL)", "stablelosses: policy_loss",
            "loss", "∂loss/∂logp of the padded token")]))
    return figs


def _with_zero(xs: np.ndarray) -> np.ndarray:
    return np.union1d(xs, [0.0])


def main(out_dir: Path | None = None) -> list[str]:
    """Write every figure of this module; return the problems found on the stablelosses side."""
    return _base().main(out_dir, figures)

if __name__ == "__main__":
    found = main(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
    for line in found:
        print("problem:", line, file=sys.stderr)
    sys.exit(1 if found else 0)
