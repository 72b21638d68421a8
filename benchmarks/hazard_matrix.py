r"""The post-training hazard matrix: the same torture inputs fed to the naive formulas of the
public trainers, to torch's built-ins and to stablelosses; value and gradient finiteness per cell.

    PYTHONPATH=. python benchmarks/hazard_matrix.py            # print the table
    PYTHONPATH=. python benchmarks/hazard_matrix.py --write    # regenerate docs/hazard-matrix.md

The naive spellings are transcribed in ``naive_post_training.py`` (beside this file). The
stablelosses columns are whatever ``stablelosses.functional`` holds when the script runs (a
function that is missing, on an older checkout, is listed as absent). Liger-Kernel's chunked
losses are included when ``liger_kernel`` imports (it is not a dependency). Every cell is one
forward and one backward in float32 on the CPU; a cell reads ``value / gradient`` with ✓ (every
entry finite), ``NaN``, ``inf`` (no NaN, some ±inf) or ``error``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import pathlib
import platform
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import stablelosses
import stablelosses.functional as SF

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("naive_post_training", HERE / "naive_post_training.py")
assert _spec is not None and _spec.loader is not None
naive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(naive)

INF = float("inf")
B, T, V, H = 2, 4, 8, 6


@dataclasses.dataclass
class Case:
    """One torture input: every tensor any column needs (float leaves get fresh copies per cell)."""

    s: Tensor  # (B, T, V) student logits
    t: Tensor  # (B, T, V) teacher logits
    mask: Tensor  # (B, T) bool, True = counted token
    labels: Tensor  # (B, T) int64, -100 where not counted
    logps: Tensor  # (B, T) policy token log-probs
    old_logps: Tensor
    ref_logps: Tensor
    advantages: Tensor  # (B,)
    chosen: Tensor  # (B,) sequence log-probs (ORPO)
    rejected: Tensor
    hs: Tensor  # (B, T, H) student hidden states
    ws: Tensor  # (V, H)
    bs: Tensor  # (V,)
    ht: Tensor
    wt: Tensor
    bt: Tensor
    temperature: float = 1.0

    def fresh(self) -> Case:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor) and v.is_floating_point():
                v = v.detach().clone().requires_grad_()
            out[f.name] = v
        return Case(**out)

    def leaves(self) -> list[Tensor]:
        return [v for v in vars(self).values() if isinstance(v, Tensor) and v.requires_grad]

    @property
    def count(self) -> Tensor:
        return self.mask.sum()


def _base(seed: int = 0, scale: float = 2.0) -> Case:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g)

    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    labels = torch.where(mask, torch.randint(1, V, (B, T), generator=g), -100)
    logps = -torch.rand(B, T, generator=g) * 3
    return Case(
        s=r(B, T, V) * scale, t=r(B, T, V) * scale, mask=mask, labels=labels, logps=logps,
        old_logps=logps + 0.1 * r(B, T), ref_logps=logps + 0.1 * r(B, T), advantages=r(B),
        chosen=-torch.rand(B, generator=g) * 5, rejected=-torch.rand(B, generator=g) * 5,
        hs=r(B, T, H), ws=r(V, H), bs=r(V), ht=r(B, T, H), wt=r(V, H), bt=r(V),
    )


def _ordinary() -> Case:
    return _base()


def _empty_completion() -> Case:
    c = _base()
    c.mask[1] = False
    c.labels[1] = -100
    return c


def _minus_inf_entry() -> Case:
    c = _base()
    c.s[..., 0] = -INF
    c.t[..., 0] = -INF
    c.bs[0] = -INF
    c.bt[0] = -INF
    return c


def _logp_zero() -> Case:
    c = _base()
    c.labels = torch.where(c.mask, 1, -100)
    c.s = torch.full((B, T, V), -200.0)
    c.s[..., 1] = 0.0  # log_softmax at the label is exactly 0 in float32
    c.t = c.s.clone()
    c.bs = torch.full((V,), -200.0)
    c.bs[1] = 0.0
    c.bt = c.bs.clone()
    c.ws, c.wt = c.ws * 1e-3, c.wt * 1e-3
    c.logps = torch.zeros(B, T)
    c.old_logps = torch.zeros(B, T)
    c.ref_logps = torch.zeros(B, T)
    c.chosen = torch.zeros(B)
    return c


def _log_ratio_200() -> Case:
    c = _base()
    pad = ~c.mask
    sign = torch.where(torch.arange(T) % 2 == 0, 1.0, -1.0).expand(B, T)
    c.old_logps = torch.where(pad, c.logps - 200 * sign, c.old_logps)
    c.ref_logps = torch.where(pad, c.logps + 200 * sign, c.ref_logps)
    c.s = torch.where(pad.unsqueeze(-1), 200.0 * c.s.sign(), c.s)
    c.t = torch.where(pad.unsqueeze(-1), -200.0 * c.t.sign(), c.t)
    return c


def _tiny_d() -> Case:
    c = _base()
    g = torch.Generator().manual_seed(1)
    c.t = c.s + 1e-6 * torch.randn(B, T, V, generator=g)
    c.old_logps = c.logps + 1e-6
    c.ref_logps = c.logps + 1e-6
    c.ht, c.wt, c.bt = c.hs.clone(), c.ws + 1e-6, c.bs.clone()
    return c


def _low_temperature() -> Case:
    c = _base(scale=4.0)
    c.temperature = 0.05
    return c


def _all_ignored() -> Case:
    c = _base()
    c.mask[:] = False
    c.labels[:] = -100
    return c


SCENARIOS: list[tuple[str, str, Callable[[], Case]]] = [
    ("ordinary inputs", "random logits, some padding", _ordinary),
    ("empty completion", "one sequence with no counted token", _empty_completion),
    ("`-inf` at index 0", "a masked vocabulary entry (both models; a `-inf` bias for the fused ones)",
     _minus_inf_entry),
    ("logp → 0", "a saturated model: the label's log-prob is exactly 0", _logp_zero),
    ("log-ratio ±200 at padding", "garbage log-ratios (and logits) at padded positions", _log_ratio_200),
    ("d = 1e-6", "teacher = student + 1e-6; log-ratios of 1e-6", _tiny_d),
    ("T = 0.05", "temperature 0.05 (logits of std 4)", _low_temperature),
    ("all-ignored batch", "no counted token in the whole batch", _all_ignored),
]

ALL = {name for name, _, _ in SCENARIOS}
NO_T = ALL - {"T = 0.05"}
POLICY = {"ordinary inputs", "empty completion", "logp → 0", "log-ratio ±200 at padding", "d = 1e-6",
          "all-ignored batch"}
PREFERENCE = {"ordinary inputs", "logp → 0"}


def _ls(x: Tensor, temperature: float) -> Tensor:
    return F.log_softmax(x / temperature, dim=-1)


def _flat(c: Case) -> tuple[Tensor, Tensor]:
    return c.s.flatten(0, 1), c.labels.flatten()


# ------------------------------------------------------------------------------------- columns
# (column name, group, applicable scenarios, callable(case) -> scalar loss)

Column = tuple[str, str, set[str], Callable[[Case], Tensor]]

NAIVE: list[Column] = [
    ("TRL generalized_jsd_loss (β = 0.5)", "naive", ALL,
     lambda c: naive.trl_generalized_jsd_loss(c.s, c.t, c.labels, beta=0.5, temperature=c.temperature)),
    ("TRL generalized_jsd_loss (β = 1, reverse KL)", "naive", ALL,
     lambda c: naive.trl_generalized_jsd_loss(c.s, c.t, c.labels, beta=1.0, temperature=c.temperature)),
    ("reverse KL, probability target", "naive", ALL,
     lambda c: naive.token_mean(naive.prob_target_reverse_kl(c.s, c.t, c.temperature), c.mask)),
    ("JS, probability mixture + 1e-12", "naive", ALL,
     lambda c: naive.token_mean(naive.prob_mixture_js(c.s, c.t, c.temperature), c.mask)),
    ("TRL entropy_from_logits", "naive", ALL,
     lambda c: naive.token_mean(naive.trl_entropy_from_logits(c.s / c.temperature), c.mask)),
    ("TRL GRPO loss (exp of the log-ratio)", "naive", POLICY,
     lambda c: naive.grpo_policy_loss(c.logps, c.old_logps, c.advantages, c.mask)),
    ("TRL k3 KL penalty (GRPO's sequence mean)", "naive", POLICY,
     lambda c: naive.sequence_mean(naive.k3_kl(c.logps, c.ref_logps), c.mask)),
    ("TRL ORPO odds ratio", "naive", PREFERENCE,
     lambda c: naive.orpo_odds_ratio(c.chosen, c.rejected)),
]

TORCH: list[Column] = [
    ("F.kl_div(log_target=True), forward KL", "torch", ALL,
     lambda c: F.kl_div(_ls(c.s, c.temperature)[c.mask], _ls(c.t, c.temperature)[c.mask], log_target=True,
                        reduction="batchmean")),
    ("F.cross_entropy", "torch", NO_T, lambda c: F.cross_entropy(*_flat(c))),
    ("F.cross_entropy(label_smoothing=0.1)", "torch", NO_T,
     lambda c: F.cross_entropy(*_flat(c), label_smoothing=0.1)),
]
if hasattr(F, "linear_cross_entropy"):
    TORCH.append(("F.linear_cross_entropy", "torch", NO_T, lambda c: F.linear_cross_entropy(
        c.hs.flatten(0, 1), c.ws, c.labels.flatten(), linear_bias=c.bs, ignore_index=-100)))


def _takes(fn: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _ours() -> tuple[list[Column], list[str]]:
    cols: list[Column] = []
    for kind in ("forward_kl", "reverse_kl", "jsd", "tvd"):
        cols.append((f"distillation_loss({kind!r})", "stablelosses", ALL,
                     lambda c, k=kind: SF.distillation_loss(c.s, c.t, kind=k, temperature=c.temperature,
                                                            mask=c.mask)))
    cols.append(("linear_distillation_loss('jsd')", "stablelosses", NO_T,
                 lambda c: SF.linear_distillation_loss(c.hs, c.ws, c.ht, c.wt, student_bias=c.bs,
                                                       teacher_bias=c.bt, kind="jsd", mask=c.mask)))
    cols.append(("entropy + masked_mean", "stablelosses", ALL,
                 lambda c: SF.masked_mean(SF.entropy(c.s / c.temperature), c.mask)))
    cols.append(("kl_div(log_target=True), forward KL", "stablelosses", ALL, lambda c: SF.kl_div(
        _ls(c.s, c.temperature)[c.mask], _ls(c.t, c.temperature)[c.mask], log_target=True,
        reduction="batchmean")))
    cols.append(("cross_entropy", "stablelosses", NO_T, lambda c: SF.cross_entropy(*_flat(c))))
    cols.append(("cross_entropy(normalizer=n)", "stablelosses", NO_T,
                 lambda c: SF.cross_entropy(*_flat(c), label_smoothing=0.1, normalizer=c.count)))
    lce = SF.linear_cross_entropy
    extra = {"normalizer": None} if _takes(lce, "normalizer") else {}
    cols.append(("linear_cross_entropy" + ("(normalizer=n)" if extra else ""), "stablelosses", NO_T,
                 lambda c: lce(c.hs.flatten(0, 1), c.ws, c.labels.flatten(), linear_bias=c.bs,
                               **({"normalizer": c.count} if extra else {}))))
    absent = []
    optional: list[tuple[str, set[str], Callable[[Case], Tensor]]] = [
        ("policy_loss", POLICY, lambda c: SF.policy_loss(c.logps, c.old_logps, c.advantages, c.mask)),
        ("kl_penalty + masked_mean", POLICY,
         lambda c: SF.masked_mean(SF.kl_penalty(c.logps, c.ref_logps), c.mask)),
        ("orpo_loss", PREFERENCE, lambda c: SF.orpo_loss(c.chosen, c.rejected)),
        ("token_logps + masked_mean", ALL,
         lambda c: SF.masked_mean(SF.token_logps(c.s, c.labels, temperature=c.temperature), c.mask)),
    ]
    for name, rows, fn in optional:
        if hasattr(SF, name.split(" ")[0]):
            cols.append((name, "stablelosses", rows, fn))
        else:
            absent.append(name.split(" ")[0])
    return cols, absent


def _liger() -> tuple[list[Column], str]:
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - any import failure means: not in this run
        return [], f"not importable here ({type(e).__name__})"
    from importlib.metadata import version as dist_version

    loss = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.5, temperature=1.0)

    def run(c: Case) -> Tensor:
        return loss(c.hs.flatten(0, 1), c.ws, c.ht.flatten(0, 1), c.wt, c.labels.flatten(),
                    student_bias=c.bs, teacher_bias=c.bt)

    version = dist_version("liger-kernel")
    return [("LigerFusedLinearJSDLoss (soft loss only)", "Liger-Kernel", NO_T, run)], (
        f"`LigerFusedLinearJSDLoss` {version} imported; run on the CPU (its chunked loss is torch code)")


def _state(x: Tensor | None) -> str:
    if x is None:
        return "—"
    if torch.isnan(x).any():
        return "NaN"
    if torch.isinf(x).any():
        return "inf"
    return "✓"


def _grad_state(grads: list[Tensor | None]) -> str:
    real = [g for g in grads if g is not None]
    if not real:
        return "—"
    states = {_state(g) for g in real}
    return "NaN" if "NaN" in states else "inf" if "inf" in states else "✓"


def cell(fn: Callable[[Case], Tensor], case: Case) -> str:
    c = case.fresh()
    try:
        loss = fn(c)
        leaves = c.leaves()
        if not loss.requires_grad:
            return f"{_state(loss)} / —"
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    except Exception as e:  # noqa: BLE001 - an exception is a cell's result
        return f"error ({type(e).__name__})"
    return f"{_state(loss.detach())} / {_grad_state(list(grads))}"


def run() -> tuple[list[Column], dict[tuple[str, str], str], list[str], str]:
    ours, absent = _ours()
    liger, liger_note = _liger()
    columns = NAIVE + TORCH + liger + ours
    cases = {name: build() for name, _, build in SCENARIOS}
    results = {}
    for col, _, rows, fn in columns:
        for name, _, _ in SCENARIOS:
            results[(col, name)] = cell(fn, cases[name]) if name in rows else "·"
    return columns, results, absent, liger_note


def render(columns: list[Column], results: dict[tuple[str, str], str], absent: list[str],
           liger_note: str) -> str:
    names = [name for name, _, _ in SCENARIOS]
    lines = [
        "# Hazard matrix: post-training and distillation losses",
        "",
        "Generated by `benchmarks/hazard_matrix.py --write` from one run; do not edit by hand.",
        f"torch {torch.__version__}, stablelosses {stablelosses.__version__}, Python "
        f"{platform.python_version()}, CPU, float32.",
        "",
        "Each cell is one forward and one backward of the loss on the input of its column; it reads",
        "**value / gradient** (every gradient of every input that takes one): ✓ every entry finite,",
        "`NaN`, `inf` (no NaN, some ±inf), `error` (an exception), `·` (the input does not apply to",
        "this loss). The naive rows are the public formulas transcribed in",
        "`benchmarks/naive_post_training.py`: TRL's GKD `generalized_jsd_loss`, `entropy_from_logits`,",
        "GRPO loss, k3 estimator and ORPO odds ratio; the probability-target reverse KL and the",
        "probability-mixture JS of a public report (finite losses, NaN gradients at T = 0.05), and",
        "the entropy, averaged with `(x * mask).sum() / mask.sum()` as it is commonly written.",
        "Finiteness only: the value's accuracy (k3 at d = 1e-6, say) is not in this table.",
        "",
        "The inputs:",
        "",
    ]
    lines += [f"- **{name}**: {desc}." for name, desc, _ in SCENARIOS]
    lines += [""]
    lines.append("| loss | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    group = None
    for col, grp, _, _ in columns:
        if grp != group:
            lines.append(f"| **{grp}** |" + " |" * len(names))
            group = grp
        lines.append(f"| {col} | " + " | ".join(results[(col, n)] for n in names) + " |")
    lines += [
        "",
        "Notes.",
        "",
        "- A forward KL whose teacher puts mass where the student is `-inf` is `+inf` by definition;",
        "  stablelosses returns that value with a finite gradient. No input above does that.",
        "- `cross_entropy` and `kl_div(reduction='batchmean')` keep torch's value on an all-ignored",
        "  batch (NaN: torch's 0/0, by design); pass `normalizer=` (or `mask=`) for 0 with gradient 0",
        "  (see the normalizer page).",
        f"- Liger-Kernel: {liger_note}.",
    ]
    if absent:
        lines.append("- Not in `stablelosses.functional` at this run (their columns appear once they are): "
                     + ", ".join(f"`{a}`" for a in absent) + ".")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="write docs/hazard-matrix.md")
    args = parser.parse_args()
    page = render(*run())
    if args.write:
        (HERE.parent / "docs" / "hazard-matrix.md").write_text(page, encoding="utf-8")
    print(page)


if __name__ == "__main__":
    main()
