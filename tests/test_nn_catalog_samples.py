"""Parity with torch on PyTorch's own OpInfo and ModuleInfo samples for every torch.nn loss
of the catalog (``SF.<name>`` against ``F.<name>``, ``sl.<Class>`` against ``nn.<Class>``).

- values in float32/float64 equal torch's wherever torch's are finite (the hazard functions
  may be finite where torch is not); dtype and shape equal;
- float16/bfloat16: torch's float32 result on the upcast inputs, rounded to the input dtype;
- gradients with respect to every floating tensor equal torch's where torch's are finite;
  where torch refuses a gradient (``weight``, ``pos_weight``) ours is checked numerically;
- where torch raises on a sample or an ``error_inputs`` entry, ours raises the same type.

The op samples are subsampled (every k-th, at most ``MAX_SAMPLES`` per op and dtype) so the
file runs in about a minute on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("expecttest")  # torch.testing._internal needs it (in the test extra)
pytest.importorskip("numpy")
from catalog_helpers import (  # noqa: E402
    MODULE_FN,
    assert_error_inputs_match,
    assert_gradients_match_where_finite,
    assert_leaf_gradients,
    assert_module_error_inputs_match,
    assert_neg_view_matches,
    assert_noncontiguous_matches,
    detach,
    detached,
    dtype_id,
    fresh_leaf,
    sample_args,
)
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.testing._internal.common_modules import module_db  # noqa: E402

import stablelosses as sl  # noqa: E402
import stablelosses.functional as SF  # noqa: E402

NAMES = (
    "l1_loss", "mse_loss", "huber_loss", "smooth_l1_loss", "nll_loss", "poisson_nll_loss", "gaussian_nll_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "ctc_loss", "cosine_embedding_loss",
    "hinge_embedding_loss", "margin_ranking_loss", "multi_margin_loss", "multilabel_margin_loss",
    "multilabel_soft_margin_loss", "soft_margin_loss", "triplet_margin_loss", "triplet_margin_with_distance_loss",
)
# where these differ from torch, torch is not finite (or the value is NaN by our NaN rule)
HAZARDS = {"binary_cross_entropy_with_logits", "gaussian_nll_loss", "ctc_loss", "cosine_embedding_loss",
           "soft_margin_loss", "multilabel_soft_margin_loss", "nll_loss"}
OPS = [op for op in op_db if op.name.startswith("nn.functional.") and op.name[len("nn.functional."):] in NAMES
       and op.variant_test_name == ""]
MAX_SAMPLES = 12
FLOATS = [torch.float32, torch.float64]
HALVES = [torch.float16, torch.bfloat16]

# the 21 losses: AdaptiveLogSoftmaxWithLoss is a layer, LinearCrossEntropyLoss has its own section
CLASSES = sorted(n for n in dir(nn) if n.endswith("Loss")
                 and n not in ("AdaptiveLogSoftmaxWithLoss", "LinearCrossEntropyLoss"))
# CrossEntropyLoss and KLDivLoss: their module samples run in tests/test_torch_samples.py
MODULE_INFOS = {m.module_cls.__name__: m for m in module_db
                if m.module_cls.__name__ in CLASSES and m.module_cls.__name__ not in ("CrossEntropyLoss", "KLDivLoss")}


def _fn_name(op) -> str:
    return op.name[len("nn.functional."):]


def _op_id(op) -> str:
    return _fn_name(op)


def _subsample(samples):
    samples = list(samples)
    step = max(1, len(samples) // MAX_SAMPLES)
    return samples[::step][:MAX_SAMPLES]


def _upcast(v):
    if isinstance(v, torch.Tensor) and v.dtype in HALVES:
        return v.detach().float()
    return detach(v)


def _compare_values(name, got, expected, tol):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    got, expected = got.detach().double(), expected.detach().double()
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got[finite], expected[finite], **tol)
    if name not in HAZARDS:
        torch.testing.assert_close(got[~finite], expected[~finite], equal_nan=True)


def _check_gradients(ours, ref, args, kwargs, got, seed):
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed), dtype=got.dtype)
    assert_leaf_gradients(ours, ref, args, kwargs, got, w, independent_is_zero=True)


def test_every_torch_loss_is_in_the_catalog():
    assert len(CLASSES) == 21
    import torch.nn.functional as F

    torch_fns = {n for n in dir(F) if n.endswith("_loss") and callable(getattr(F, n))}
    torch_fns |= {"binary_cross_entropy", "binary_cross_entropy_with_logits", "nll_loss", "kl_div", "cross_entropy"}
    torch_fns -= {"linear_cross_entropy"}
    assert torch_fns <= set(SF.__all__)
    for name in CLASSES:
        assert issubclass(getattr(sl, name), torch.nn.modules.loss._Loss), name
    assert {_fn_name(op) for op in OPS} == set(NAMES)


@pytest.mark.parametrize("dtype", FLOATS, ids=dtype_id)
@pytest.mark.parametrize("op", OPS, ids=_op_id)
def test_opinfo_samples(op, dtype):
    if dtype not in op.supported_dtypes("cpu"):
        pytest.skip(f"torch's {op.name} does not support {dtype}")
    name = _fn_name(op)
    ours = getattr(SF, name)
    checked = 0
    for i, sample in enumerate(_subsample(op.sample_inputs("cpu", dtype, requires_grad=True))):
        args, kwargs = sample_args(sample, fresh_leaf(True))
        plain_args, plain_kwargs = detached(args, kwargs)
        try:
            expected = op.op(*plain_args, **plain_kwargs)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:  # torch refuses: so must we
            with pytest.raises(type(e)):
                ours(*plain_args, **plain_kwargs)
            continue
        got = ours(*args, **kwargs)
        _compare_values(name, got, expected, {"rtol": 1e-4, "atol": 1e-5})
        if got.requires_grad:
            _check_gradients(ours, op.op, args, kwargs, got, i)
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("dtype", HALVES, ids=dtype_id)
@pytest.mark.parametrize("op", OPS, ids=_op_id)
def test_opinfo_samples_half_is_torch_float32_rounded(op, dtype):
    name = _fn_name(op)
    ours = getattr(SF, name)
    checked = 0
    for sample in _subsample(op.sample_inputs("cpu", dtype, requires_grad=False)):
        args, kwargs = sample_args(sample, detach)
        up_args, up_kwargs = sample_args(sample, _upcast)
        try:
            expected = op.op(*up_args, **up_kwargs)
        except (RuntimeError, ValueError, TypeError, IndexError):
            continue
        got = ours(*args, **kwargs)
        if name == "ctc_loss":  # log_probs' dtype
            assert got.dtype == dtype
        else:
            assert got.dtype == torch.promote_types(dtype, expected.dtype) or got.dtype == dtype
        # rounding the same float32 value (our formula may differ from torch's in the last
        # float32 bit for the hazard functions): at most one half-precision ulp apart
        tol = {"rtol": 8e-3, "atol": 1e-3} if dtype == torch.bfloat16 else {"rtol": 1e-3, "atol": 1e-4}
        exp_half = expected.to(got.dtype)
        _compare_values(name, got, exp_half, tol)
        if name not in HAZARDS:
            assert torch.equal(got, exp_half) or torch.allclose(got, exp_half, equal_nan=True)
        checked += 1
    if checked == 0:
        pytest.skip("no sample that torch accepts in float32")


@pytest.mark.parametrize("op", OPS, ids=_op_id)
def test_opinfo_neg_view(op):
    """torch's ``TestMathBits.test_neg_view`` on the subsampled float64 samples."""
    samples = _subsample(op.sample_inputs("cpu", torch.float64, requires_grad=True))
    assert sum(assert_neg_view_matches(getattr(SF, _fn_name(op)), s) for s in samples) > 0


@pytest.mark.parametrize("op", OPS, ids=_op_id)
def test_opinfo_noncontiguous_samples(op):
    """torch's ``TestCommon.test_noncontiguous_samples`` on the subsampled float64 samples."""
    samples = _subsample(op.sample_inputs("cpu", torch.float64, requires_grad=True))
    assert sum(assert_noncontiguous_matches(getattr(SF, _fn_name(op)), s) for s in samples) > 0


@pytest.mark.parametrize("op", [o for o in OPS if o.error_inputs_func is not None], ids=_op_id)
def test_opinfo_error_inputs(op):
    assert_error_inputs_match(op, getattr(SF, _fn_name(op)))


@pytest.mark.parametrize("cls", sorted(MODULE_INFOS), ids=str)
def test_module_db_inputs(cls):
    info = MODULE_INFOS[cls]
    torch_cls, our_cls = getattr(nn, cls), getattr(sl, cls)
    checked = 0
    for dtype in FLOATS:
        for i, mi in enumerate(_subsample(info.module_inputs_func(info, "cpu", dtype, True, training=True))):
            c, f = mi.constructor_input, mi.forward_input
            theirs, ours = torch_cls(*c.args, **c.kwargs), our_cls(*c.args, **c.kwargs)
            ours.load_state_dict(theirs.state_dict())  # torch's state loads into ours
            expected = theirs(*f.args, **f.kwargs)
            got = ours(*f.args, **f.kwargs)
            _compare_values(MODULE_FN[cls], got, expected, {"rtol": 1e-4, "atol": 1e-5})
            w = torch.randn(expected.shape, generator=torch.Generator().manual_seed(i), dtype=expected.dtype)
            assert_gradients_match_where_finite(got, expected, (*f.args, *f.kwargs.values()), w)
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("cls", sorted(n for n, m in MODULE_INFOS.items() if m.module_error_inputs_func), ids=str)
def test_module_db_error_inputs(cls):
    assert_module_error_inputs_match(MODULE_INFOS[cls], getattr(nn, cls), getattr(sl, cls))


