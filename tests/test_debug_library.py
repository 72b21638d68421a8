"""detect_nonfinite sees inside stablelosses: its public functions are checked at their boundary."""

from __future__ import annotations

import math
import os
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from debug_helpers import line_of, raised

import stablelosses as sl
import stablelosses.functional as SF
from stablelosses.debug import NonFiniteError, NonFiniteWarning, detect_nonfinite
from stablelosses.functional import cross_entropy as early_cross_entropy  # bound before any context

HERE = os.path.abspath(__file__)
INF = math.inf


def lineno_of(marker: str) -> int:
    """Line number of the first line of this file containing ``marker``."""
    return line_of(HERE, marker)


# ---- reported -----------------------------------------------------------------------------


def test_safe_sqrt_of_a_negative_is_reported_under_its_public_name():
    x = torch.tensor([-1.0])
    err = raised(lambda: sl.safe_sqrt(x))  # MARK-sqrt
    assert torch.isnan(torch.sqrt(x)).all()  # torch agrees: NaN, created from a finite input
    assert err.op == "stablelosses.safe_sqrt"
    assert (err.phase, err.kind, err.cause) == ("forward", "nan", "invalid")
    assert err.filename == HERE and err.lineno == lineno_of("MARK-sqrt")
    assert "sl.safe_sqrt(x)" in err.source
    assert err.inputs[0].min == err.inputs[0].max == -1.0
    text = str(err)
    assert "stablelosses.safe_sqrt produced NaN" in text and "invalid (sqrt of a negative)" in text


def test_safe_div_overflow_is_reported():
    den = torch.tensor(1e-45)
    assert torch.isinf(torch.div(1.0, den))  # the reference: 1 / 1e-45 overflows float32
    err = raised(lambda: sl.safe_div(1.0, den))
    assert err.op == "stablelosses.safe_div"
    assert (err.kind, err.cause) == ("overflow", "overflow")
    assert err.inputs[0].max == pytest.approx(1.4e-45, rel=0.01)
    assert err.outputs[0].posinf == 1
    assert ": overflow (" in str(err)


def test_xlogy_of_a_negative_at_zero_is_a_log_of_zero():
    # -1 * log 0 = +inf: infinite exactly (in float64 too), not a finite value too large
    err = raised(lambda: sl.xlogy(torch.tensor([-1.0]), torch.tensor([0.0])))
    assert (err.op, err.kind, err.cause) == ("stablelosses.xlogy", "overflow", "log of zero")
    assert ": log of zero (" in str(err).splitlines()[0]


def test_ctc_loss_of_an_impossible_alignment_is_a_log_of_zero_with_its_page():
    log_probs = torch.randn(2, 1, 5).log_softmax(-1)  # 2 frames for a 3-label target
    err = raised(lambda: SF.ctc_loss(log_probs, torch.tensor([[1, 2, 3]]), torch.tensor([2]),
                                     torch.tensor([3]), reduction="sum"))
    assert (err.op, err.cause) == ("stablelosses.functional.ctc_loss", "log of zero")
    assert err.hint.endswith("docs: hazards/ctc-impossible-alignment") and "zero_infinity=True" in err.hint
    assert str(err).splitlines()[-1].strip() == err.hint


@pytest.mark.parametrize("weight", [None, "zero"])
def test_cross_entropy_with_nothing_counted_is_0_over_0(weight):
    logits = torch.randn(3, 4, requires_grad=True)
    if weight is None:
        target, w = torch.full((3,), -100), None  # every target ignored
    else:
        target, w = torch.tensor([0, 1, 0]), torch.tensor([0.0, 0.0, 1.0, 1.0])  # zero weights
    assert torch.isnan(F.cross_entropy(logits, target, weight=w))  # torch: NaN as well
    err = raised(lambda: SF.cross_entropy(logits, target, weight=w))
    assert err.op == "stablelosses.functional.cross_entropy"
    assert (err.kind, err.cause) == ("nan", "0/0")
    assert "0/0 (reduction='mean'" in str(err)


def test_a_name_imported_before_the_context_is_checked_too():
    err = raised(lambda: early_cross_entropy(torch.randn(2, 3), torch.full((2,), -100)))
    assert err.op == "stablelosses.functional.cross_entropy"


def test_module_class_reports_the_function_and_the_module_path():
    criterion = sl.CrossEntropyLoss()
    err = raised(lambda: criterion(torch.randn(2, 3), torch.full((2,), -100)))
    assert err.op == "stablelosses.functional.cross_entropy"
    assert err.module_path == "criterion"


def test_warn_mode_and_allow_by_public_name():
    x = torch.tensor([-1.0])
    with pytest.warns(NonFiniteWarning, match="stablelosses.safe_sqrt"):
        with detect_nonfinite(mode="warn") as d:
            y = sl.safe_sqrt(x)
    assert torch.isnan(y).all() and len(d.reports) == 1
    for allow in ("stablelosses.safe_sqrt", "safe_sqrt"):
        with detect_nonfinite(allow=[allow]) as d:
            sl.safe_sqrt(x)
        assert d.reports == []


# ---- silent -------------------------------------------------------------------------------


def test_contract_minus_inf_outputs_are_silent():
    x = torch.randn(2, 3, requires_grad=True)
    mask = torch.tensor([[True, False, True], [False, False, False]])
    with detect_nonfinite() as d:
        logp = sl.log_softmax(x, -1, mask=mask)  # -inf on masked entries
        lse = sl.logsumexp(torch.full((2, 3), -INF), -1)  # all -inf slice
        xl = sl.xlogy(torch.ones(2), torch.zeros(2))  # log p = -inf for p = 0
        p = sl.softmax(x, -1, mask=mask)  # an all-masked row: zeros
        (logp.masked_fill(~mask, 0).sum() + p.sum()).backward()
    assert d.reports == []
    assert torch.isneginf(logp[~mask]).all() and torch.isneginf(lse).all() and torch.isneginf(xl).all()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("x", [[3e38, -3e38], [60000.0, -60000.0]])
def test_minus_inf_overflow_from_finite_inputs_is_reported(x):
    # the contract's -inf values are masked entries and zero probabilities; a -inf log-softmax
    # of finite logits without a mask is an overflow, reported as torch's own is
    t = torch.tensor(x, dtype=torch.float32 if abs(x[0]) > 1e5 else torch.float16)
    for fn in (sl.log_softmax, torch.log_softmax):
        with pytest.raises(NonFiniteError, match="overflow"), detect_nonfinite():
            fn(t, -1)
    with detect_nonfinite() as d:  # with a mask, its -inf entries are defined
        sl.log_softmax(torch.tensor([1.0, 2.0]), -1, mask=torch.tensor([True, False]))
    assert d.reports == []


def test_internal_intermediates_on_the_way_to_a_finite_result_are_silent():
    x = torch.zeros(3, requires_grad=True)
    logits = torch.tensor([[10.0, -200.0], [0.0, -INF]], requires_grad=True)
    with detect_nonfinite() as d:
        loss = (
            sl.safe_sqrt(x).sum()  # sqrt'(0) internally
            + sl.safe_div(torch.ones(3), x).sum()  # a / 0 selected away
            + SF.rmse_loss(x, torch.zeros(3))  # sqrt of a zero mean
            + SF.focal_loss(logits, torch.tensor([0, 0]), gamma=0.5)  # p_t -> 1, a -inf logit
            + SF.cross_entropy(logits, torch.tensor([0, 0]), label_smoothing=0.1)
            + SF.log_cosh_loss(torch.tensor([1000.0]), torch.zeros(1))  # cosh overflows
        )
        loss.backward()
    assert d.reports == []
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


def test_nan_input_is_not_blamed_on_the_library():
    with detect_nonfinite() as d:
        y = sl.safe_sqrt(torch.tensor([float("nan"), 1.0]))
    assert d.reports == [] and torch.isnan(y[0])


# ---- a hook fixed at import: nothing swapped, per thread -----------------------------------


def test_nothing_is_swapped_while_a_context_is_open():
    objs = {n: getattr(SF, n) for n in SF.__all__}
    codes = {n: f.__code__ for n, f in objs.items()}
    with detect_nonfinite():
        assert {n: getattr(SF, n) for n in SF.__all__} == objs
        assert {n: f.__code__ for n, f in objs.items()} == codes
        with detect_nonfinite():  # nested: still checked inside, and after the inner one closes
            with pytest.raises(NonFiniteError):
                sl.safe_sqrt(torch.tensor([-1.0]))
        with pytest.raises(NonFiniteError):
            sl.safe_sqrt(torch.tensor([-1.0]))
    assert {n: f.__code__ for n, f in objs.items()} == codes
    assert torch.isnan(sl.safe_sqrt(torch.tensor([-1.0])))  # unwatched: plain NaN


def test_other_threads_are_not_checked():
    out = []

    def other():
        out.append(sl.safe_sqrt(torch.tensor([-1.0])))

    with detect_nonfinite() as d:
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert d.reports == [] and torch.isnan(out[0])


def test_values_match_outside_the_context():
    x = torch.rand(4, 5) * 3
    t = torch.randint(0, 5, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with detect_nonfinite():
            inside = (sl.safe_sqrt(x), SF.cross_entropy(x, t), sl.logsumexp(x, 1))
    outside = (sl.safe_sqrt(x), SF.cross_entropy(x, t), sl.logsumexp(x, 1))
    for a, b in zip(inside, outside):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(outside[1], F.cross_entropy(x, t))


def test_which_package_files_count_as_user_code():
    # the naive formulas, the demo, the bench harness and the CLI are user code wherever they
    # move inside the package; the numerical core is library code, checked at its boundary
    from stablelosses.debug._frames import _PKG_DIR, _is_user_file

    for rel in ("_demo.py", "_naive.py", "naive.py", "bench/cases.py", "cli.py", "__main__.py"):
        assert _is_user_file(os.path.join(_PKG_DIR, rel)), rel
    for rel in ("functional/_sqrt.py", "functional/_operands.py", "_autograd/sqrt.py", "losses.py", "_utils.py", "_compat.py"):
        assert not _is_user_file(os.path.join(_PKG_DIR, rel)), rel


def test_every_public_function_is_checked():
    # a public function that is not the hooked wrapper (added to __all__ some other way) would be
    # silently unchecked: every public function must be one the detector covers
    import inspect

    from stablelosses.debug._boundary import public_functions

    covered = {name.rsplit(".", 1)[-1] for name, _ in public_functions()}
    # the backend switches configure, they compute nothing the detector could check
    config = {"set_backend", "get_backend", "backend"}
    for mod in (sl, SF):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if callable(obj) and not inspect.isclass(obj) and name not in config:
                assert name in covered, name
    assert {"safe_sqrt", "cross_entropy", "rmse_loss", "log_softmax"} <= covered


# ---- the backward of a public function, as one operator ------------------------------------------


@pytest.mark.parametrize("dtype, x, upstream", [(torch.float16, 1e-7, 100.0), (torch.float32, 1e-30, 1e30)])
def test_overflow_in_a_public_functions_backward_is_reported(dtype, x, upstream):
    # d sqrt / dx = 1 / (2 sqrt x): finite inputs and upstream gradient, an Inf gradient
    x = torch.tensor([x], dtype=dtype, requires_grad=True)
    with pytest.raises(NonFiniteError) as info, detect_nonfinite():
        (sl.safe_sqrt(x) * upstream).sum().backward()
    err = info.value
    assert err.op == "stablelosses.safe_sqrt" and err.phase == "backward" and err.kind == "overflow"
    assert "in the backward of stablelosses.safe_sqrt" in str(err)
    assert err.lineno == line_of(__file__, "(sl.safe_sqrt(x) * upstream).sum().backward()")


def test_a_public_functions_backward_is_not_blamed_for_what_it_received_or_was_given():
    x = torch.tensor([1e-30], requires_grad=True)
    with detect_nonfinite() as d:
        y = sl.safe_sqrt(x)
    (y * 1e30).sum().backward()  # after the context: not watched
    assert d.reports == [] and torch.isinf(x.grad).all()
    x.grad = None
    with detect_nonfinite(mode="warn") as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (sl.safe_sqrt(x) * torch.tensor([float("nan")])).sum().backward()  # a NaN gradient came in
    assert all(r.op != "stablelosses.safe_sqrt" for r in d.reports)
    # masked logits (-inf inputs) with finite gradients: silent, and the same gradient as unwatched
    logits = torch.tensor([[2.0, -INF, 0.5], [-INF, -INF, -INF]], requires_grad=True)
    with detect_nonfinite() as d:
        SF.cross_entropy(logits, torch.tensor([0, 1]), label_smoothing=0.1).backward()
    watched = logits.grad.clone()
    logits.grad = None
    SF.cross_entropy(logits, torch.tensor([0, 1]), label_smoothing=0.1).backward()
    assert d.reports == [] and torch.equal(watched, logits.grad)
