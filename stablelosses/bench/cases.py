"""What is benchmarked: one `Spec` per function, its input shapes (`Case`) and its variants.

Variants: ``torch`` (the built-in replaced), ``naive`` (a formula from `stablelosses.naive`),
``kornia`` (optional), ``stable`` (ours). The timing adds ``one-pass`` and ``<variant>-compiled``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from stablelosses import naive

__all__ = ["DTYPES", "Case", "Inputs", "Spec", "make_inputs", "specs"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}

Inputs = tuple[list[Tensor], tuple[int, ...]]  # tensors, indices of the differentiable ones


# ---- the built-ins, with the arguments of the comparison ---------------------------------
# Module-level functions (not lambdas): torch.compile caches per code object, and the kernel
# count is keyed by the function.

def ce_torch(x: Tensor, t: Tensor) -> Tensor:
    return F.cross_entropy(x, t)


SMOOTHING = 0.1  # the label_smoothing of the ``cross_entropy_smoothing`` comparison


def ce_smoothing_torch(x: Tensor, t: Tensor) -> Tensor:
    return F.cross_entropy(x, t, label_smoothing=SMOOTHING)


def ce_weight_torch(x: Tensor, t: Tensor, w: Tensor) -> Tensor:
    return F.cross_entropy(x, t, weight=w)


def ce_probs_torch(x: Tensor, p: Tensor) -> Tensor:
    return F.cross_entropy(x, p)


def rmse_torch(x: Tensor, y: Tensor) -> Tensor:
    return naive.sqrt_mse(x, y)


def sigmoid_focal_torchvision(x: Tensor, t: Tensor) -> Tensor:
    return naive.torchvision_sigmoid_focal(x, t, 0.25, 2.0, "mean")


def focal_naive(x: Tensor, t: Tensor) -> Tensor:
    return naive.classic_focal(x, t, 2.0)


def focal_kornia(x: Tensor, t: Tensor) -> Tensor:
    from kornia.losses import focal_loss  # type: ignore[import-not-found]

    return focal_loss(x, t, alpha=None, gamma=2.0, reduction="mean")


def logcosh_naive(x: Tensor, y: Tensor) -> Tensor:
    return naive.log_cosh(x, y)


def softmax_torch(x: Tensor) -> Tensor:
    return torch.softmax(x, dim=-1)


def log_softmax_torch(x: Tensor) -> Tensor:
    return torch.log_softmax(x, dim=-1)


def logsumexp_torch(x: Tensor) -> Tensor:
    return torch.logsumexp(x, dim=-1)


def kl_torch(x: Tensor, t: Tensor) -> Tensor:
    return F.kl_div(x, t, reduction="batchmean")


def div_torch(a: Tensor, b: Tensor) -> Tensor:
    return torch.div(a, b)


def sqrt_torch(x: Tensor) -> Tensor:
    return torch.sqrt(x)


def xlogy_torch(x: Tensor, y: Tensor) -> Tensor:
    return torch.special.xlogy(x, y)


# ---- ours, looked up at call time (a function being rewritten is picked up as it is) -------

def _sf():
    import stablelosses.functional as SF

    return SF


def ce_stable(x: Tensor, t: Tensor) -> Tensor:
    return _sf().cross_entropy(x, t)


def ce_smoothing_stable(x: Tensor, t: Tensor) -> Tensor:
    return _sf().cross_entropy(x, t, label_smoothing=SMOOTHING)


def ce_weight_stable(x: Tensor, t: Tensor, w: Tensor) -> Tensor:
    return _sf().cross_entropy(x, t, weight=w)


def ce_probs_stable(x: Tensor, p: Tensor) -> Tensor:
    return _sf().cross_entropy(x, p)


def focal_stable(x: Tensor, t: Tensor) -> Tensor:
    return _sf().focal_loss(x, t, gamma=2.0)


def sigmoid_focal_stable(x: Tensor, t: Tensor) -> Tensor:
    return _sf().sigmoid_focal_loss(x, t, alpha=0.25, gamma=2.0, reduction="mean")


def rmse_stable(x: Tensor, y: Tensor) -> Tensor:
    return _sf().rmse_loss(x, y)


def logcosh_stable(x: Tensor, y: Tensor) -> Tensor:
    return _sf().log_cosh_loss(x, y)


def softmax_stable(x: Tensor) -> Tensor:
    return _sf().softmax(x, -1)


def log_softmax_stable(x: Tensor) -> Tensor:
    return _sf().log_softmax(x, -1)


def logsumexp_stable(x: Tensor) -> Tensor:
    return _sf().logsumexp(x, -1)


def kl_stable(x: Tensor, t: Tensor) -> Tensor:
    return _sf().kl_div(x, t, reduction="batchmean")


def div_stable(a: Tensor, b: Tensor) -> Tensor:
    return _sf().safe_div(a, b)


def sqrt_stable(x: Tensor) -> Tensor:
    return _sf().safe_sqrt(x)


def xlogy_stable(x: Tensor, y: Tensor) -> Tensor:
    return _sf().xlogy(x, y)


# ---- inputs ------------------------------------------------------------------------------

def _randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _class_inputs(shape, dtype, gen) -> Inputs:
    tshape = (shape[0],) + tuple(shape[2:])
    return [_randn(shape, dtype, gen, 2.0), torch.randint(0, shape[1], tshape, generator=gen)], (0,)


def _weighted_class_inputs(shape, dtype, gen) -> Inputs:
    (x, t), grad_idx = _class_inputs(shape, dtype, gen)
    w = (torch.rand(shape[1], generator=gen) + 0.5).to(dtype)  # a class weight in [0.5, 1.5)
    return [x, t, w], grad_idx


def _prob_target_inputs(shape, dtype, gen) -> Inputs:
    p = torch.softmax(torch.randn(shape, generator=gen) * 2.0, dim=1).to(dtype)
    return [_randn(shape, dtype, gen, 2.0), p], (0,)


def _binary_target_inputs(shape, dtype, gen) -> Inputs:
    t = (torch.rand(shape, generator=gen) < 0.02).to(dtype)
    return [_randn(shape, dtype, gen, 2.0), t], (0,)


def _regression_inputs(shape, dtype, gen) -> Inputs:
    return [_randn(shape, dtype, gen), _randn(shape, dtype, gen)], (0,)


def _logits_inputs(shape, dtype, gen) -> Inputs:
    return [_randn(shape, dtype, gen, 2.0)], (0,)


def _kl_inputs(shape, dtype, gen) -> Inputs:
    x = torch.log_softmax(torch.randn(shape, generator=gen), dim=-1).to(dtype)
    t = torch.softmax(torch.randn(shape, generator=gen), dim=-1).to(dtype)
    return [x, t], (0,)


def _div_inputs(shape, dtype, gen) -> Inputs:
    b = torch.randn(shape, generator=gen)
    b = torch.where(torch.rand(shape, generator=gen) < 0.1, 0.0, b)
    return [_randn(shape, dtype, gen), b.to(dtype)], (0, 1)


def _sqrt_inputs(shape, dtype, gen) -> Inputs:
    x = torch.rand(shape, generator=gen)
    return [torch.where(x < 0.1, 0.0, x).to(dtype)], (0,)


def _xlogy_inputs(shape, dtype, gen) -> Inputs:
    x = torch.rand(shape, generator=gen)
    x = torch.where(x < 0.1, 0.0, x)
    return [x.to(dtype), torch.rand(shape, generator=gen).to(dtype) + 0.01], (0, 1)


# ---- the registry --------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One input shape of one function; ``tiers`` says in which runs it appears."""

    label: str
    shape: tuple[int, ...]
    kind: str
    tiers: tuple[str, ...]


@dataclass
class Spec:
    """One function: its inputs, variants and which variant plays which role in the table."""

    name: str
    make: Callable[..., Inputs]
    variants: dict[str, Callable[..., Tensor]]
    cases: list[Case]
    torch_ref: str | None = "torch"     # the built-in it replaces ("÷torch")
    naive_ref: str | None = "naive"     # the naive formula ("÷naive")
    check_ref: str | None = None        # a variant with the same value, checked after timing
    describe: dict[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        """The reference of the bytes-moved, kernel and peak ratios (the built-in, else naive)."""
        return self.torch_ref or self.naive_ref or "torch"


_Q, _D, _FULL, _ALL = ("quick",), ("default", "full"), ("full",), ("quick", "default", "full")


def _cls_cases(llm_default: bool = False) -> list[Case]:
    return [
        Case("8192x1000", (8192, 1000), "classification", _D),
        Case("65536x10", (65536, 10), "few-class", _D),
        Case("256x32000", (256, 32000), "llm-vocab", _D if llm_default else _FULL),
        Case("16x21x128x128", (16, 21, 128, 128), "segmentation", _FULL),
        Case("1024x1000", (1024, 1000), "classification", _Q),
        Case("4096x10", (4096, 10), "few-class", _Q),
        Case("8x10", (8, 10), "tiny", _ALL),
    ]


def _ce_variant_cases() -> list[Case]:
    return [
        Case("8192x1000", (8192, 1000), "classification", _D),
        Case("1024x1000", (1024, 1000), "classification", _Q),
    ]


def _rows_cases() -> list[Case]:
    return [
        Case("8192x1000", (8192, 1000), "classification", _D),
        Case("256x32000", (256, 32000), "llm-vocab", _FULL),
        Case("1024x1000", (1024, 1000), "classification", _Q),
        Case("8x10", (8, 10), "tiny", _ALL),
    ]


def _elem_cases(default_1e7: bool = False) -> list[Case]:
    return [
        Case("1e6", (1_000_000,), "regression", _D),
        Case("1e7", (10_000_000,), "regression", _D if default_1e7 else _FULL),
        Case("1e5", (100_000,), "regression", _Q),
        Case("16", (16,), "tiny", _ALL),
    ]


@functools.cache
def kornia_available() -> bool:
    """Whether ``kornia.losses`` imports (the ``kornia`` variant needs it)."""
    try:
        importlib.import_module("kornia.losses")
    except ImportError:
        return False
    return True


@functools.cache
def specs() -> dict[str, Spec]:
    """The benchmark registry: one `Spec` per public function, in table order."""
    tiny_sigmoid = [Case("65536x80", (65536, 80), "detection", _D),
                    Case("4096x80", (4096, 80), "detection", _Q), Case("8x80", (8, 80), "tiny", _ALL)]
    out = [
        Spec("cross_entropy", _class_inputs, {"torch": ce_torch, "stable": ce_stable},
             _cls_cases(llm_default=True), naive_ref=None, check_ref="torch",
             describe={"torch": "F.cross_entropy"}),
        Spec("cross_entropy_smoothing", _class_inputs,
             {"torch": ce_smoothing_torch, "stable": ce_smoothing_stable}, _ce_variant_cases(),
             naive_ref=None, check_ref="torch",
             describe={"torch": f"F.cross_entropy(label_smoothing={SMOOTHING})",
                       "stable": f"cross_entropy(label_smoothing={SMOOTHING})"}),
        Spec("cross_entropy_weight", _weighted_class_inputs,
             {"torch": ce_weight_torch, "stable": ce_weight_stable}, _ce_variant_cases(),
             naive_ref=None, check_ref="torch",
             describe={"torch": "F.cross_entropy(weight=w), a class weight in [0.5, 1.5)",
                       "stable": "cross_entropy(weight=w)"}),
        Spec("cross_entropy_probs", _prob_target_inputs,
             {"torch": ce_probs_torch, "stable": ce_probs_stable}, _ce_variant_cases(),
             naive_ref=None, check_ref="torch",
             describe={"torch": "F.cross_entropy with probability targets",
                       "stable": "cross_entropy with probability targets"}),
        Spec("focal_loss", _class_inputs,
             {"torch": ce_torch, "naive": focal_naive, "kornia": focal_kornia, "stable": focal_stable},
             _cls_cases(llm_default=True), check_ref="naive",
             describe={"torch": "F.cross_entropy (the speed reference)",
                       "naive": "naive.classic_focal: softmax -> log -> gather",
                       "kornia": "kornia.losses.focal_loss"}),
        Spec("sigmoid_focal_loss", _binary_target_inputs,
             {"torch": sigmoid_focal_torchvision, "stable": sigmoid_focal_stable}, tiny_sigmoid,
             naive_ref=None, check_ref="torch",
             describe={"torch": "naive.torchvision_sigmoid_focal (torchvision's formula)"}),
        Spec("rmse_loss", _regression_inputs, {"torch": rmse_torch, "stable": rmse_stable},
             _elem_cases(default_1e7=True), naive_ref=None, check_ref="torch",
             describe={"torch": "naive.sqrt_mse: torch.sqrt(F.mse_loss(x, y))"}),
        Spec("log_cosh_loss", _regression_inputs, {"naive": logcosh_naive, "stable": logcosh_stable},
             _elem_cases(default_1e7=True), torch_ref=None, check_ref="naive",
             describe={"naive": "naive.log_cosh: torch.log(torch.cosh(x - y)).mean()"}),
        Spec("softmax", _logits_inputs,
             {"torch": softmax_torch, "naive": naive.exp_softmax, "stable": softmax_stable},
             _rows_cases(), check_ref="torch",
             describe={"torch": "torch.softmax", "naive": "naive.exp_softmax: exp(x) / exp(x).sum()"}),
        Spec("log_softmax", _logits_inputs,
             {"torch": log_softmax_torch, "naive": naive.exp_log_softmax, "stable": log_softmax_stable},
             _rows_cases(), check_ref="torch",
             describe={"torch": "torch.log_softmax",
                       "naive": "naive.exp_log_softmax: log(exp(x) / exp(x).sum())"}),
        Spec("logsumexp", _logits_inputs,
             {"torch": logsumexp_torch, "naive": naive.exp_logsumexp, "stable": logsumexp_stable},
             _rows_cases(), check_ref="torch",
             describe={"torch": "torch.logsumexp", "naive": "naive.exp_logsumexp: log(exp(x).sum())"}),
        Spec("kl_div", _kl_inputs, {"torch": kl_torch, "naive": naive.formula_kl_div, "stable": kl_stable},
             _rows_cases(), check_ref="torch",
             describe={"torch": "F.kl_div(reduction='batchmean')",
                       "naive": "naive.formula_kl_div: (t * (log t - x)).sum() / N"}),
        Spec("safe_div", _div_inputs,
             {"torch": div_torch, "naive": naive.where_div, "naive-double-where": naive.double_where_div,
              "stable": div_stable},
             _elem_cases(), naive_ref="naive-double-where", check_ref="naive-double-where",
             describe={"torch": "torch.div", "naive": "naive.where_div: torch.where(b != 0, a / b, 0)",
                       "naive-double-where": "naive.double_where_div"}),
        Spec("safe_sqrt", _sqrt_inputs, {"torch": sqrt_torch, "stable": sqrt_stable},
             _elem_cases(), naive_ref=None, check_ref="torch", describe={"torch": "torch.sqrt"}),
        Spec("xlogy", _xlogy_inputs,
             {"torch": xlogy_torch, "naive": naive.x_log_y, "stable": xlogy_stable},
             _elem_cases(), check_ref="torch",
             describe={"torch": "torch.special.xlogy", "naive": "naive.x_log_y: x * log(y)"}),
    ]
    return {s.name: s for s in out}


def make_inputs(spec: Spec, case: Case, dtype: torch.dtype, device: str, seed: int = 0) -> Inputs:
    """Deterministic inputs for ``case`` (built on CPU, then moved to ``device``)."""
    gen = torch.Generator().manual_seed(seed)
    tensors, grad_idx = spec.make(case.shape, dtype, gen)
    return [t.to(device) for t in tensors], grad_idx
