r"""The hazard catalog as data: each naive PyTorch formula beside its stablelosses function.

Every `Hazard` holds a name, a factory for its inputs, the naive formula (the snippet people
write or the built-in) and the stablelosses call. `evaluate` runs one side (forward value and
the gradient of ``output.sum()`` with respect to one input) and `render` prints the table that
``python -m stablelosses`` shows. The docs reuse `HAZARDS`.

Example:
    >>> from stablelosses._demo import HAZARDS, evaluate
    >>> h = next(h for h in HAZARDS if h.name == "log(cosh(x)) at x = 1000")
    >>> naive = evaluate(h, "naive")
    >>> naive.value_text, naive.grad_text, naive.ok
    ('inf', 'nan', False)
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import stablelosses.functional as SF
from stablelosses import naive

_INF = math.inf

__all__ = ["HAZARDS", "Hazard", "Result", "evaluate", "render"]


@dataclass(frozen=True)
class Hazard:
    """One row of the demo.

    Attributes:
        name: short title of the hazard.
        inputs: builds fresh input tensors (the one at ``grad_arg`` gets ``requires_grad``).
        naive: the naive formula, called as ``naive(*inputs)``.
        stable: the stablelosses call, called as ``stable(*inputs)``.
        grad_arg: which input's gradient is shown.
        inf_ok: the exact value holds ±inf (a masked entry, the logsumexp of nothing), so an
            infinite value is right; a NaN never is.
        note: one sentence under the row where the two sides differ by definition (not by a
            NaN), or "".
    """

    name: str
    inputs: Callable[[], tuple[torch.Tensor, ...]]
    naive: Callable[..., torch.Tensor]
    stable: Callable[..., torch.Tensor]
    grad_arg: int = 0
    inf_ok: bool = False
    note: str = ""


@dataclass(frozen=True)
class Result:
    """One side of a row: the value, the gradient, whether both are sound, or an error."""

    value: torch.Tensor | None
    grad: torch.Tensor | None
    error: str | None = None
    inf_ok: bool = False

    @property
    def ok(self) -> bool:
        if self.error is not None or self.value is None:
            return False
        v = self.value.detach().float()
        if torch.isnan(v).any():
            return False
        if not self.inf_ok and torch.isinf(v).any():
            return False
        return self.grad is None or bool(torch.isfinite(self.grad.float()).all())

    @property
    def value_text(self) -> str:
        return self.error if self.error is not None else _fmt(self.value)

    @property
    def grad_text(self) -> str:
        return "" if self.error is not None else _fmt(self.grad)


def _fmt(t: torch.Tensor | None) -> str:
    if t is None:
        return "-"
    vals = t.detach().double().reshape(-1).tolist()
    parts = [_num(v) for v in vals[:4]] + (["…"] if len(vals) > 4 else [])
    return parts[0] if t.dim() == 0 else "[" + ", ".join(parts) + "]"


def _num(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "0"
    return f"{v:.4g}"


def _t(*values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def _long(*values):
    return torch.tensor(values, dtype=torch.long)


HAZARDS: Sequence[Hazard] = (
    Hazard(
        "sqrt at 0",
        lambda: (_t(0.0, 4.0),),
        torch.sqrt,
        SF.safe_sqrt,
    ),
    Hazard(
        "RMSE of a zero residual",
        lambda: (_t(1.0, 2.0), _t(1.0, 2.0)),
        naive.sqrt_mse,
        SF.rmse_loss,
    ),
    Hazard(
        "a / b with b = 0 (where(b != 0, a/b, 0))",
        lambda: (_t(1.0, 2.0), _t(0.0, 4.0)),
        naive.where_div,
        SF.safe_div,
    ),
    Hazard(
        "softmax exp(z)/sum exp(z), z = [92, 1]",
        lambda: (_t(92.0, 1.0),),
        lambda z: naive.exp_softmax(z, 0),
        lambda z: SF.softmax(z, 0),
    ),
    Hazard(
        "softmax of a fully masked row",
        lambda: (_t(1.0, 2.0, 3.0),),
        lambda x: naive.masked_softmax(x, torch.zeros(3, dtype=torch.bool)),
        lambda x: SF.softmax(x, -1, mask=torch.zeros(3, dtype=torch.bool)),
    ),
    Hazard(
        "logsumexp of all -inf",
        lambda: (_t(-_INF, -_INF),),
        lambda x: torch.logsumexp(x, 0),
        lambda x: SF.logsumexp(x, 0),
        inf_ok=True,
    ),
    Hazard(
        "log_softmax with a masked row",
        lambda: (torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]),),
        lambda x: naive.masked_log_softmax(x, torch.tensor([[True, True, False], [False] * 3])),
        lambda x: SF.log_softmax(x, -1, mask=torch.tensor([[True, True, False], [False] * 3])),
        inf_ok=True,
        note="The finite gradients differ by definition: in torch the masked output (-inf minus "
        "the row's logsumexp) still pulls on the unmasked logits, while here a masked output is a "
        "constant -inf with no gradient; a loss that leaves masked entries out gets the same "
        "gradient from both.",
    ),
    Hazard(
        "xlogy(x, y) at x = y = 0, d/dy",
        lambda: (_t(0.0, 1.0), _t(0.0, 2.0)),
        torch.xlogy,
        SF.xlogy,
        grad_arg=1,
    ),
    Hazard(
        "focal loss snippet, logits [[10, -200]]",
        lambda: (torch.tensor([[10.0, -200.0]]), _long(1)),
        naive.classic_focal,
        lambda x, t: SF.focal_loss(x, t, gamma=2.0),
    ),
    Hazard(
        "focal loss γ=0.5 at p_t → 1",
        lambda: (torch.tensor([[20.0, 0.0]]), _long(0)),
        lambda x, t: naive.logpt_focal(x, t, 0.5),
        lambda x, t: SF.focal_loss(x, t, gamma=0.5),
    ),
    Hazard(
        "sigmoid focal (torchvision) logit 20, γ=0.5",
        lambda: (torch.tensor(20.0), torch.tensor(1.0)),
        lambda x, y: naive.torchvision_sigmoid_focal(x, y, gamma=0.5),
        lambda x, y: SF.sigmoid_focal_loss(x, y, gamma=0.5),
    ),
    Hazard(
        "cross_entropy, label smoothing, -inf logit",
        lambda: (torch.tensor([[2.0, -_INF, 0.5]]), _long(0)),
        lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1),
        lambda x, t: SF.cross_entropy(x, t, label_smoothing=0.1),
        note="A change of definition: torch gives the -inf (masked) class its share ε/C of the "
        "smoothing, whose -log p is inf, while stablelosses spreads ε over the finite classes "
        "only, so the loss is finite (0.2764).",
    ),
    Hazard(
        "kl_div, zero target at -inf log-prob",
        lambda: (torch.tensor([[-0.5, -_INF]]).log_softmax(-1), torch.tensor([[1.0, 0.0]])),
        lambda x, p: F.kl_div(x, p, reduction="batchmean"),
        lambda x, p: SF.kl_div(x, p, reduction="batchmean"),
    ),
    Hazard(
        "log(cosh(x)) at x = 1000",
        lambda: (torch.tensor(1000.0), torch.tensor(0.0)),
        lambda x, y: naive.log_cosh(x, y, reduction="none"),
        SF.log_cosh_loss,
    ),
    Hazard(
        "normalize a zero vector (x / x.norm())",
        lambda: (torch.zeros(2, 3),),
        naive.unit_vector,
        lambda x: SF.normalize(x, dim=-1),
    ),
    Hazard(
        "cosine similarity with a zero vector",
        lambda: (torch.zeros(1, 3), torch.tensor([[1.0, 2.0, 2.0]])),
        naive.cosine_formula,
        lambda a, b: SF.cosine_similarity(a, b, dim=-1),
    ),
    Hazard(
        "logaddexp(-inf, -inf)",
        lambda: (_t(-_INF, 0.0), _t(-_INF, 1.0)),
        torch.logaddexp,
        SF.logaddexp,
        inf_ok=True,
    ),
    Hazard(
        "mean over an empty mask",
        lambda: (_t(0.7, 1.3, 0.2),),
        lambda x: naive.masked_mean_formula(x, torch.zeros(3, dtype=torch.bool)),
        lambda x: SF.masked_mean(x, torch.zeros(3, dtype=torch.bool)),
    ),
    Hazard(
        "entropy of logits with a -inf action",
        lambda: (torch.tensor([[1.0, 2.0, -_INF]]),),
        naive.softmax_entropy,
        SF.entropy,
    ),
    Hazard(
        "Dice loss, both masks empty",
        lambda: (torch.zeros(2, 4), torch.zeros(2, 4)),
        naive.dice_formula,
        SF.dice_loss,
    ),
    Hazard(
        "InfoNCE with a zero embedding",
        lambda: (torch.tensor([[0.0, 0.0], [1.0, 0.5], [-0.3, 1.0]]),
                 torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.2]])),
        naive.info_nce_formula,
        SF.info_nce_loss,
    ),
    Hazard(
        "float16 RMSE, residual 300",
        lambda: (_t(300.0, 300.0, dtype=torch.float16), _t(0.0, 0.0, dtype=torch.float16)),
        naive.sqrt_mse,
        SF.rmse_loss,
    ),
)


# Every torch.nn loss (0.4): the five that torch 2.13 still gets wrong, its call beside ours
HAZARDS = (
    *HAZARDS,
    Hazard(
        "BCE with logits at ±inf logits (targets 1, 0)",
        lambda: (_t(_INF, -_INF), _t(1.0, 0.0)),
        lambda x, t: F.binary_cross_entropy_with_logits(x, t, reduction="none"),
        lambda x, t: SF.binary_cross_entropy_with_logits(x, t, reduction="none"),
    ),
    Hazard(
        "Gaussian NLL, float16 var 1e-12 below eps",
        lambda: (_t(0.01, 1.0, dtype=torch.float16), _t(0.0, 0.0, dtype=torch.float16),
                 _t(1e-12, 1.0, dtype=torch.float16)),
        F.gaussian_nll_loss,
        SF.gaussian_nll_loss,
        grad_arg=2,
    ),
    Hazard(
        "CTC, impossible alignment (3 labels, 2 frames)",
        lambda: (torch.tensor([[[-1.2, -0.9, -1.2]], [[-0.7, -1.5, -1.2]]]), _long(1, 2, 1).reshape(1, 3),
                 _long(2), _long(3)),
        F.ctc_loss,
        SF.ctc_loss,
        inf_ok=True,
    ),
    Hazard(
        "cosine embedding loss, float16 zero vector",
        lambda: (torch.zeros(1, 3, dtype=torch.float16), torch.ones(1, 3, dtype=torch.float16),
                 _t(1.0, dtype=torch.float16)),
        F.cosine_embedding_loss,
        SF.cosine_embedding_loss,
    ),
    Hazard(
        "soft margin loss at margin -100",
        lambda: (_t(-100.0), _t(1.0)),
        F.soft_margin_loss,
        SF.soft_margin_loss,
    ),
)


# Post-training and distillation (0.4): TRL-style trainer code (stablelosses.naive).
HAZARDS = (
    *HAZARDS,
    Hazard(
        "GRPO ratio exp(logp - old), masked log-ratio 200",
        lambda: (torch.tensor([[-1.0, 0.0]]), torch.tensor([[-1.0, -200.0]]), _t(1.0),
                 torch.tensor([[True, False]])),
        naive.grpo_policy_loss,
        SF.policy_loss,
    ),
    Hazard(
        "ORPO log-odds log1p(-exp(logp)) at logp = -1e-9",
        lambda: (_t(-1e-9, -0.5), _t(-1.0, -1.0)),
        naive.orpo_odds_ratio,
        SF.orpo_loss,
    ),
    Hazard(
        "forward KL distillation, -inf (masked) vocabulary",
        lambda: (torch.tensor([[1.0, 0.0, -_INF]]), torch.tensor([[2.0, 0.0, -_INF]])),
        naive.forward_kl_formula,
        SF.distillation_loss,
    ),
    Hazard(
        "token log-probs, ignored (-100) row of -inf",
        lambda: (torch.tensor([[2.0, 0.5, -_INF], [-_INF] * 3]), _long(0, -100)),
        naive.gather_token_logps,
        SF.token_logps,
    ),
    Hazard(
        "DPO -log(sigmoid(β·margin)) at margin -2000",
        lambda: (_t(-2050.0, -10.0), _t(-50.0, -12.0), _t(0.0, 0.0), _t(0.0, 0.0)),
        naive.dpo_formula,
        SF.dpo_loss,
    ),
)


def evaluate(hazard: Hazard, side: str) -> Result:
    """Run ``hazard.naive`` or ``hazard.stable`` ('naive' | 'stable'): value and gradient."""
    fn = hazard.naive if side == "naive" else hazard.stable
    inputs = [t.clone() for t in hazard.inputs()]
    x = inputs[hazard.grad_arg].requires_grad_(True)
    try:
        with torch.autograd.set_detect_anomaly(False):
            out = fn(*inputs)
            out.sum().backward()
    except Exception as e:  # noqa: BLE001 - the table reports any failure in its cell
        return Result(None, None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:60]}")
    return Result(out.detach(), x.grad, inf_ok=hazard.inf_ok)


def rows(hazards: Sequence[Hazard] = HAZARDS) -> list:
    """``[(hazard, naive Result, stable Result)]``."""
    return [(h, evaluate(h, "naive"), evaluate(h, "stable")) for h in hazards]


def render(hazards: Sequence[Hazard] = HAZARDS) -> str:
    """The aligned text table (under 100 columns): per hazard, its name, then the naive formula's
    value and gradient on one line and the stablelosses call's on the next."""
    header = ("hazard, formula", "value", "gradient", "ok?")
    body: list[tuple[str, ...]] = []
    marks = []
    for h, n, s in rows(hazards):
        body.append((h.name,))
        body.append(("  naive", n.value_text, n.grad_text, _mark(n)))
        body.append(("  stablelosses", s.value_text, s.grad_text, _mark(s)))
        body.extend((ln,) for ln in textwrap.wrap(h.note, 96, initial_indent="  ", subsequent_indent="  "))
        marks.append((_mark(n), _mark(s)))
    cells = [header, *(r for r in body if len(r) > 1)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()

    out = [line(header), "  ".join("-" * w for w in widths).rstrip()]
    out += [line(r) if len(r) > 1 else r[0] for r in body]
    bad_naive = sum(m[0] == "NaN/inf" for m in marks)
    out.append("")
    out.append(
        f"{bad_naive} of {len(marks)} naive formulas give NaN/inf in the value or gradient;"
    )
    good = sum(m[1] == "ok" for m in marks)
    out.append(f"{good} of {len(marks)} stablelosses calls are finite and defined.")
    out.append("ok: no NaN, no overflow, finite gradient (-inf allowed where it is the exact value).")
    return "\n".join(out)


def _mark(r: Result) -> str:
    if r.error is not None:
        return "error"
    return "ok" if r.ok else "NaN/inf"
