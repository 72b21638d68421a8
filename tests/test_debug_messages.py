"""Reports name the singularity with searchable phrases and hint the stablelosses fix."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from stablelosses.debug import NonFiniteError, detect_nonfinite

INF = math.inf


def raised(fn) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        with detect_nonfinite():
            fn()
    return info.value


def _rmse_at_zero():
    x = torch.zeros(3, requires_grad=True)
    torch.sqrt(F.mse_loss(x, torch.zeros(3))).backward()


def _pow_half_at_zero():
    x = torch.zeros(3, requires_grad=True)
    (x**0.5).sum().backward()


def _focal_gamma_half():
    p = torch.ones(1, requires_grad=True)
    ((1 - p) ** 0.3).sum().backward()


def _log_of_softmax():
    logits = torch.tensor([[10.0, -200.0]], requires_grad=True)
    torch.log(F.softmax(logits, 1)).sum().backward()


def _log_of_indexed_sl_softmax():
    import stablelosses as sl

    logits = torch.tensor([[10.0, -200.0]], requires_grad=True)
    torch.log(sl.softmax(logits, 1)[torch.arange(1), torch.tensor([1])]).sum().backward()


def _log_of_indexed_softmax():
    logits = torch.tensor([[10.0, -200.0]], requires_grad=True)
    torch.log(torch.softmax(logits, 1)[:, 1].unsqueeze(1)).sum().backward()


def _where_div():
    b = torch.tensor([2.0, 0.0], requires_grad=True)
    torch.where(b != 0, torch.ones(2) / b, torch.zeros(2)).sum().backward()


def _div_by_norm_of_zero():
    v = torch.zeros(3, requires_grad=True)
    v / v.norm()


def _focal_sqrt_of_softmax():
    logits = torch.tensor([[30.0, -30.0]], requires_grad=True)
    p = torch.softmax(logits, 1)
    ((1 - p[:, 0]) ** 0.5).sum().backward()  # the README's focal term, gamma = 0.5


def _logaddexp_neg_inf():
    a = torch.full((1,), -INF, requires_grad=True)
    torch.logaddexp(a, a).sum().backward()


def _entropy_of_masked_logits():
    z = torch.tensor([[1.0, 2.0, -INF]], requires_grad=True)
    p, logp = torch.softmax(z, -1), torch.log_softmax(z, -1)
    -(p * logp).sum()


def _kl_div_zero_target():
    z = torch.tensor([[1.0, 2.0, -INF]], requires_grad=True)
    F.kl_div(torch.log_softmax(z, -1), torch.tensor([[0.5, 0.5, 0.0]]), reduction="batchmean")


def _gaussian_nll_float16_below_floor():
    var = torch.full((3,), 1e-8, dtype=torch.float16, requires_grad=True)
    F.gaussian_nll_loss(torch.zeros(3, dtype=torch.float16), torch.ones(3, dtype=torch.float16), var)


def _ctc_impossible():
    log_probs = torch.randn(2, 1, 5).log_softmax(-1)  # 2 frames for a 3-label target
    F.ctc_loss(log_probs, torch.tensor([[1, 2, 3]]), torch.tensor([2]), torch.tensor([3]), reduction="sum")


def _cosine_embedding_float16_zero():
    a, b = torch.zeros(2, 3, dtype=torch.float16), torch.ones(2, 3, dtype=torch.float16)
    F.cosine_embedding_loss(a, b, torch.tensor([1, 1]))


CASES = [
    # (id, fn, op, phase, cause, hint page or None)
    ("1/0", lambda: torch.ones(2) / torch.zeros(2), "aten::div", "forward", "division by zero",
     "division-by-zero"),
    ("0/0", lambda: torch.zeros(2) / torch.zeros(2), "aten::div", "forward", "0/0", "division-by-zero"),
    ("1/1e-45", lambda: torch.ones(1) / torch.tensor(1e-45), "aten::div", "forward", "overflow", None),
    ("reciprocal(0)", lambda: torch.zeros(1).reciprocal(), "aten::reciprocal", "forward",
     "division by zero", None),
    ("exp(100)", lambda: torch.exp(torch.tensor(100.0)), "aten::exp", "forward", "overflow",
     "softmax-logsumexp"),
    ("log(0)", lambda: torch.log(torch.zeros(1)), "aten::log", "forward", "log of zero", None),
    ("log1p(-1)", lambda: torch.log1p(-torch.ones(1)), "aten::log1p", "forward", "log of zero", None),
    ("sqrt(-1)", lambda: torch.sqrt(-torch.ones(1)), "aten::sqrt", "forward", "invalid", "sqrt-at-zero"),
    ("log(-1)", lambda: torch.log(-torch.ones(1)), "aten::log", "forward", "invalid", None),
    ("inf-inf", lambda: torch.full((1,), INF) - torch.full((1,), INF), "aten::sub", "forward", "invalid",
     None),
    ("0*inf", lambda: torch.zeros(1) * torch.full((1,), INF), "aten::mul", "forward", "invalid", None),
    ("matmul", lambda: torch.full((8, 8), 1e19) @ torch.full((8, 8), 1e19), "aten::mm", "forward",
     "overflow", None),
    ("masked softmax", lambda: torch.softmax(torch.full((2, 2), -INF), -1), "aten::_softmax", "forward",
     "0/0", "softmax-logsumexp"),
    ("rmse at 0", _rmse_at_zero, "aten::div", "backward", "division by zero", "sqrt-at-zero"),
    ("x**0.5 at 0", _pow_half_at_zero, "aten::pow", "backward", "division by zero", "sqrt-at-zero"),
    ("(1-p)**0.3", _focal_gamma_half, "aten::pow", "backward", "division by zero",
     "focal-gamma-below-one"),
    ("log(softmax)", _log_of_softmax, "aten::log", "forward", "log of zero", "focal-log-zero"),
    ("log(sl.softmax[idx])", _log_of_indexed_sl_softmax, "aten::log", "forward", "log of zero",
     "focal-log-zero"),
    ("log(softmax[idx])", _log_of_indexed_softmax, "aten::log", "forward", "log of zero", "focal-log-zero"),
    ("log(cosh)", lambda: torch.log(torch.cosh(torch.tensor([100.0]))), "aten::cosh", "forward",
     "overflow", "log-cosh-overflow"),
    ("float16 square", lambda: torch.tensor([300.0], dtype=torch.float16) ** 2, "aten::pow", "forward",
     "overflow", "half-precision-overflow"),
    ("where(b != 0, a / b)", _where_div, "aten::div", "forward", "division by zero", "division-by-zero"),
    ("x.div_(0)", lambda: torch.ones(3).div_(0), "aten::div_", "forward", "division by zero",
     "division-by-zero"),
    ("x.div_(zeros)", lambda: torch.zeros(3).div_(torch.zeros(3)), "aten::div_", "forward", "0/0",
     "division-by-zero"),
    ("v / v.norm() at 0", _div_by_norm_of_zero, "aten::div", "forward", "0/0", "zero-vector"),
    ("(1 - p[:, 0]) ** 0.5", _focal_sqrt_of_softmax, "aten::pow", "backward", "division by zero",
     "focal-gamma-below-one"),
    ("logaddexp(-inf, -inf) backward", _logaddexp_neg_inf, "aten::sub", "backward", "invalid",
     "logaddexp-neg-inf"),
    ("-(p * logp) masked", _entropy_of_masked_logits, "aten::mul", "forward", "invalid", "masked-entropy"),
    ("kl_div zero target", _kl_div_zero_target, "aten::mul", "forward", "invalid", "kl-zero-targets"),
    ("bce_with_logits(±inf)", lambda: F.binary_cross_entropy_with_logits(
        torch.tensor([INF, -INF]), torch.tensor([1.0, 0.0])), "aten::binary_cross_entropy_with_logits",
     "forward", "invalid", "bce-with-logits-inf"),
    ("soft_margin_loss(-100, 1)", lambda: F.soft_margin_loss(torch.tensor([-100.0]), torch.tensor([1.0])),
     "aten::soft_margin_loss", "forward", "overflow", "soft-margin-overflow"),
    ("float16 gaussian_nll_loss", _gaussian_nll_float16_below_floor, "aten::div", "forward", "overflow",
     "gaussian-nll-variance-floor"),
    ("ctc_loss impossible", _ctc_impossible, "aten::_ctc_loss", "forward", "log of zero",
     "ctc-impossible-alignment"),
    ("float16 cosine_embedding_loss zero", _cosine_embedding_float16_zero, "aten::div", "forward", "0/0",
     "cosine-embedding-zero-vector"),
    ("zeros.log_()", lambda: torch.zeros(3).log_(), "aten::log_", "forward", "log of zero", None),
    # poles: the value is infinite, not a finite result too large for the dtype
    ("atanh(1)", lambda: torch.atanh(torch.ones(1)), "aten::atanh", "forward", "log of zero", None),
    ("logit(1)", lambda: torch.logit(torch.ones(1)), "aten::logit", "forward", "log of zero", None),
    ("logit(0)", lambda: torch.special.logit(torch.zeros(1)), "aten::logit", "forward", "log of zero", None),
    ("lgamma(-2)", lambda: torch.lgamma(-2 * torch.ones(1)), "aten::lgamma", "forward", "log of zero", None),
    ("erfinv(-1)", lambda: torch.erfinv(-torch.ones(1)), "aten::erfinv", "forward", "log of zero", None),
    ("digamma(0)", lambda: torch.digamma(torch.zeros(1)), "aten::digamma", "forward", "division by zero",
     None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cause_and_hint(case):
    _, fn, op, phase, cause, page = case
    err = raised(fn)
    assert (err.op, err.phase, err.cause) == (op, phase, cause)
    text = str(err)
    assert f": {cause} (" in text.splitlines()[0]
    if page is None:
        assert err.hint is None and "hint:" not in text
    else:
        assert err.hint.startswith("hint: use sl.") and err.hint.endswith(f" — docs: hazards/{page}")
        assert text.splitlines()[-1].strip() == err.hint


def test_every_hinted_page_exists():
    import os

    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "hazards")
    for *_, page in CASES:
        if page is not None:
            assert os.path.isfile(os.path.join(docs, f"{page}.md")), page


@pytest.mark.parametrize("op", ["div_", "log_", "mul_"])
def test_in_place_operator_is_judged_by_the_input_it_read(op):
    x = torch.full((3,), 1e30) if op == "mul_" else torch.zeros(3) if op == "log_" else torch.ones(3)
    read = x.clone()
    err = raised(lambda: getattr(x, op)(*{"div_": (0,), "log_": (), "mul_": (1e30,)}[op]))
    assert (err.inputs[0].min, err.inputs[0].max) == (read.min().item(), read.max().item())
    assert err.inputs[0].finite and not err.outputs[0].finite
    assert "inputs already as large as inf" not in str(err)


def test_in_place_operator_on_a_non_finite_input_is_not_blamed():
    with detect_nonfinite():
        torch.tensor([INF, 1.0]).mul_(2.0)
        torch.tensor([math.nan, 1.0]).div_(0.0)


MEAN_OVER_NOTHING = [
    ("mean of empty", lambda: torch.zeros(0).mean(), "aten::mean"),
    ("cross_entropy, every target ignored",
     lambda: F.cross_entropy(torch.randn(2, 3), torch.tensor([-100, -100])), "aten::nll_loss_forward"),
    ("var of one value", lambda: torch.randn(1).var(), "aten::var"),
    ("LayerNorm eps=0, constant row", lambda: torch.nn.LayerNorm(3, eps=0)(torch.ones(2, 3)),
     "aten::native_layer_norm"),
    ("float64 LayerNorm eps=0",
     lambda: torch.nn.LayerNorm(3, eps=0).double()(torch.ones(2, 3, dtype=torch.float64)),
     "aten::native_layer_norm"),
]


@pytest.mark.filterwarnings("ignore:.*degrees of freedom")
@pytest.mark.parametrize("case", MEAN_OVER_NOTHING, ids=[c[0] for c in MEAN_OVER_NOTHING])
def test_nan_from_a_mean_over_nothing_is_zero_over_zero(case):
    _, fn, op = case
    err = raised(fn)
    assert (err.op, err.kind, err.cause) == (op, "nan", "0/0")
    assert ": 0/0 (" in str(err).splitlines()[0]


def test_nan_from_an_overflowed_intermediate_is_still_overflow():
    # 3e38 * 10 = inf, then inf - inf = NaN; in float64 the product is exact: the dtype is to blame
    err = raised(lambda: torch.dot(torch.tensor([3e38, -3e38]), torch.full((2,), 10.0)))
    assert (err.op, err.kind, err.cause) == ("aten::dot", "nan", "overflow")


def test_kind_is_unchanged_for_compatibility():
    # kind stays 'overflow' (an Inf) or 'nan'; cause carries the finer name
    assert raised(lambda: torch.ones(1) / torch.zeros(1)).kind == "overflow"
    assert raised(lambda: torch.zeros(1) / torch.zeros(1)).kind == "nan"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_overflow_from_already_huge_inputs_is_called_divergence(dtype):
    huge = 1e24 if dtype != torch.float64 else 1e160  # past the square root of the dtype's largest
    w = torch.full((4, 4), huge, dtype=dtype)
    err = raised(lambda: w @ w)
    assert (err.op, err.cause) == ("aten::mm", "overflow")
    head = str(err).splitlines()[0]
    assert "diverging" in head and f"{huge:.3g}" in head
    assert "--watch" in err.hint and "DivergenceMonitor" in err.hint
    assert str(err).splitlines()[-1].strip() == err.hint


def test_overflow_from_moderate_inputs_is_not_called_divergence():
    for fn in (lambda: torch.exp(torch.tensor(100.0)), lambda: torch.tensor([300.0], dtype=torch.float16) ** 2,
               lambda: torch.full((8, 8), 1e19) @ torch.full((8, 8), 1e19)):
        err = raised(fn)
        assert "diverging" not in str(err) and "--watch" not in str(err)
