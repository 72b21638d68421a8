"""Parity with torch on the sample inputs PyTorch's own OpInfo and ModuleInfo tests use for the
functions and modules we replace: values (dtype included); in float32/float64 the gradients
with respect to every differentiable tensor (input, target and weight), and forward-mode (jvp)
tangents, wherever torch's are finite; where torch raises, we raise too (``error_inputs`` of
OpInfo and ``module_error_inputs`` of ``module_db``).

``nn.functional.linear_cross_entropy`` (torch >= 2.13; absent from older op_db, then its tests
skip) has three OpInfos: the reference path and two chunked ones (``options=...``). The chunked
ones give the class ``weight`` no gradient (silently) and have no forward mode, where ours is
exact; their values are compared with the chunked op, their gradients and tangents with torch's
reference path (``options=None``) on the same sample.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("expecttest")  # torch.testing._internal needs it (in the test extra)
pytest.importorskip("numpy")
from catalog_helpers import (  # noqa: E402
    assert_error_inputs_match,
    assert_gradients_match_where_finite,
    assert_leaf_gradients,
    assert_module_error_inputs_match,
    assert_neg_view_matches,
    assert_noncontiguous_matches,
    detached,
    dtype_id,
    fresh_leaf,
    sample_args,
)
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.testing._internal.common_modules import module_db  # noqa: E402

import stablelosses as sl  # noqa: E402
import stablelosses.functional as SF  # noqa: E402


def _mse(x, y, **kw):
    return SF.rmse_loss(x, y, **kw) ** 2


ELEMENTWISE = {
    ("xlogy", ""): SF.xlogy,
    ("sqrt", ""): SF.safe_sqrt,
    ("div", "no_rounding_mode"): SF.safe_div,
    ("true_divide", ""): SF.safe_div,
    ("nn.functional.mse_loss", ""): _mse,
    ("logaddexp", ""): SF.logaddexp,
    ("nn.functional.normalize", ""): SF.normalize,
    ("nn.functional.cosine_similarity", ""): SF.cosine_similarity,
}
CLASSIFICATION = {
    ("softmax", ""): SF.softmax,
    ("softmax", "with_dtype"): SF.softmax,
    ("log_softmax", ""): SF.log_softmax,
    ("log_softmax", "with_dtype"): SF.log_softmax,
    ("logsumexp", ""): SF.logsumexp,
    ("nn.functional.cross_entropy", ""): SF.cross_entropy,
    ("nn.functional.kl_div", ""): SF.kl_div,
}
LINEAR = {
    ("nn.functional.linear_cross_entropy", variant): SF.linear_cross_entropy
    for variant in ("", "chunked", "chunked_none")
}
_IN_OP_DB = {(op.name, op.variant_test_name) for op in op_db}
OURS = {**ELEMENTWISE, **CLASSIFICATION, **{k: v for k, v in LINEAR.items() if k in _IN_OP_DB}}
OPS = [op for op in op_db if (op.name, op.variant_test_name) in OURS]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]
GRAD_DTYPES = [torch.float32, torch.float64]


class _MSEFromRMSE(nn.Module):
    """``RMSELoss() ** 2`` stands for ``nn.MSELoss`` in the module samples."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.rmse = sl.RMSELoss(reduction=reduction)

    def forward(self, input, target):
        return self.rmse(input, target) ** 2


MODULES = {nn.MSELoss: _MSEFromRMSE, nn.CrossEntropyLoss: sl.CrossEntropyLoss, nn.KLDivLoss: sl.KLDivLoss}
MODULE_INFOS = {m.module_cls: m for m in module_db if m.module_cls in MODULES}


def _reference(op):
    """torch's function that the gradients and tangents are compared with: the op itself, but
    torch's reference path for linear_cross_entropy's chunked variants (see the module doc)."""
    if op.name == "nn.functional.linear_cross_entropy" and op.variant_test_name:
        return lambda *a, **k: op.op(*a, **{**k, "options": None})
    return op.op


def _op_id(op):
    return f"{op.name}.{op.variant_test_name}".rstrip(".")


def _grad_leaves(args, kwargs):
    return [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.requires_grad]


def _check_samples(op, dtype):
    if dtype not in op.supported_dtypes("cpu"):
        pytest.skip(f"torch's {op.name} does not support {dtype}")
    ours = OURS[(op.name, op.variant_test_name)]
    differentiable = dtype in GRAD_DTYPES
    half = dtype in (torch.float16, torch.bfloat16)
    checked = 0
    for sample in op.sample_inputs("cpu", dtype, requires_grad=differentiable):
        args, kwargs = sample_args(sample, fresh_leaf(differentiable))
        plain_args, plain_kwargs = detached(args, kwargs)
        try:
            expected = op.op(*plain_args, **plain_kwargs)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:  # torch refuses: so must we
            with pytest.raises(type(e) if not isinstance(e, (IndexError, ValueError)) else Exception):
                ours(*plain_args, **plain_kwargs)
            continue
        try:
            got = ours(*args, **kwargs)
        except RuntimeError:
            # allowed only where torch refuses the same leaves requiring grad (nll_loss's weight)
            with pytest.raises(RuntimeError):
                op.op(*args, **kwargs)
            args, kwargs = [args[0], *plain_args[1:]], plain_kwargs
            got = ours(*args, **kwargs)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        tol = {"rtol": 2e-2, "atol": 2e-2} if half else {"rtol": 1e-4, "atol": 1e-5}
        torch.testing.assert_close(got.detach().double(), expected.double(), equal_nan=True, **tol)
        checked += 1
        if differentiable and got.requires_grad:
            _check_gradients(op, ours, args, kwargs, got)
    assert checked > 0


def _check_gradients(op, ours, args, kwargs, got):
    """Gradient of ``sum(w · out)`` w.r.t. each leaf equals torch's where torch's is finite;
    where torch refuses a gradient for a leaf (it raises), ours is checked numerically."""
    assert_leaf_gradients(ours, _reference(op), args, kwargs, got, torch.randn_like(got), forward_ad=True)


def _check_jvp(op, dtype):
    """Forward mode: ``torch.func.jvp`` w.r.t. every differentiable tensor equals torch's tangent
    where that is finite; where torch has no forward derivative, gradcheck's numeric one."""
    ours = OURS[(op.name, op.variant_test_name)]
    checked = 0
    for sample in op.sample_inputs("cpu", dtype, requires_grad=True):
        args, kwargs = sample_args(sample, fresh_leaf(True))
        leaves = _grad_leaves(args, kwargs)
        if not leaves:
            continue

        def call(fn, *vals, args=args, kwargs=kwargs):
            it = iter(vals)

            def pick(t):
                return next(it) if isinstance(t, torch.Tensor) and t.requires_grad else t

            return fn(*[pick(t) for t in args], **{n: pick(t) for n, t in kwargs.items()})

        primals = tuple(t.detach() for t in leaves)
        try:
            _reference(op)(*args, **kwargs)
        except (RuntimeError, ValueError, TypeError, IndexError):  # torch refuses; the value test covers it
            continue
        tangents = tuple(torch.randn_like(p) for p in primals)
        out, tan = torch.func.jvp(lambda *v: call(ours, *v), primals, tangents)
        try:
            r_out, r_tan = torch.func.jvp(lambda *v: call(_reference(op), *v), primals, tangents)
        except RuntimeError:  # torch has no forward derivative here (e.g. nll_loss weight)
            if dtype == torch.float64:
                assert torch.autograd.gradcheck(lambda *v: call(ours, *v),
                                                tuple(p.clone().requires_grad_() for p in primals),
                                                check_forward_ad=True, check_backward_ad=False)
            checked += 1
            continue
        finite = torch.isfinite(r_tan)
        torch.testing.assert_close(tan[finite], r_tan[finite], rtol=1e-4, atol=1e-5)
        checked += 1
    assert checked > 0


def _check_error_inputs(op):
    # types and messages (torch's error_regex), the linear cross-entropy's included
    assert_error_inputs_match(op, OURS[(op.name, op.variant_test_name)])


def _check_module_error_inputs(torch_cls):
    info = MODULE_INFOS[torch_cls]
    if info.module_error_inputs_func is None:  # module_db gained error inputs after torch 2.6
        pytest.skip(f"this torch's module_db has no error inputs for {torch_cls.__name__}")
    assert_module_error_inputs_match(info, torch_cls, MODULES[torch_cls])


def _check_module_inputs(torch_cls, dtype):
    info = MODULE_INFOS[torch_cls]
    checked = 0
    for mi in info.module_inputs_func(info, "cpu", dtype, True, training=True):
        c, f = mi.constructor_input, mi.forward_input
        expected = torch_cls(*c.args, **c.kwargs)(*f.args, **f.kwargs)
        got = MODULES[torch_cls](*c.args, **c.kwargs)(*f.args, **f.kwargs)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, equal_nan=True)
        assert_gradients_match_where_finite(got, expected, (*f.args, *f.kwargs.values()), torch.randn_like(expected))
        checked += 1
    assert checked > 0


def test_every_replaced_op_has_samples():
    assert {(op.name, op.variant_test_name) for op in OPS} == set(OURS)
    assert set(MODULE_INFOS) == set(MODULES)


def test_linear_cross_entropy_opinfos_are_checked():
    if not hasattr(torch.nn.functional, "linear_cross_entropy"):
        pytest.skip("this torch has no F.linear_cross_entropy (torch < 2.13): no OpInfo to run")
    assert set(LINEAR) <= {(op.name, op.variant_test_name) for op in OPS}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", OPS, ids=_op_id)
def test_opinfo_samples(op, dtype):
    _check_samples(op, dtype)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", OPS, ids=_op_id)
def test_opinfo_jvp(op, dtype):
    _check_jvp(op, dtype)


@pytest.mark.parametrize("op", [o for o in OPS if o.supports_gradgrad], ids=_op_id)
def test_opinfo_gradgradcheck(op):
    """torch's ``test_fn_gradgrad``: ``gradgradcheck`` in float64 on every sample whose
    differentiable tensors hold at most 400 elements (the linear losses' double backward takes
    the whole logits: see docs/linear-cross-entropy.md)."""
    ours = OURS[(op.name, op.variant_test_name)]
    checked = 0
    for sample in op.sample_inputs("cpu", torch.float64, requires_grad=True):
        args, kwargs = sample_args(sample, fresh_leaf(True))
        leaves = _grad_leaves(args, kwargs)
        if not leaves or sum(t.numel() for t in leaves) > 400:
            continue
        try:
            _reference(op)(*args, **kwargs)
        except (RuntimeError, ValueError, TypeError, IndexError):  # torch refuses: the value test covers it
            continue

        def call(*vals, args=args, kwargs=kwargs):
            it = iter(vals)

            def pick(t):
                return next(it) if isinstance(t, torch.Tensor) and t.requires_grad else t

            return ours(*[pick(t) for t in args], **{n: pick(t) for n, t in kwargs.items()})

        assert torch.autograd.gradgradcheck(call, tuple(leaves), check_batched_grad=False)
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("op", OPS, ids=_op_id)
def test_opinfo_neg_view(op):
    """torch's ``TestMathBits.test_neg_view``: every float64 sample with its input as a
    negative-bit view (softmax and logsumexp's backward read the input's bits through a dtype
    view, which such a tensor refuses)."""
    ours = OURS[(op.name, op.variant_test_name)]
    samples = op.sample_inputs("cpu", torch.float64, requires_grad=True)
    assert sum(assert_neg_view_matches(ours, s) for s in samples) > 0


@pytest.mark.parametrize("op", OPS, ids=_op_id)
def test_opinfo_noncontiguous_samples(op):
    """torch's ``TestCommon.test_noncontiguous_samples``: every float64 sample with all its
    tensors non-contiguous gives the contiguous value and gradients."""
    ours = OURS[(op.name, op.variant_test_name)]
    samples = op.sample_inputs("cpu", torch.float64, requires_grad=True)
    assert sum(assert_noncontiguous_matches(ours, s) for s in samples) > 0


@pytest.mark.parametrize("op", [o for o in OPS if o.error_inputs_func is not None], ids=_op_id)
def test_opinfo_error_inputs(op):
    _check_error_inputs(op)


def test_module_db_error_inputs():
    _check_module_error_inputs(nn.CrossEntropyLoss)  # the only one of ours with error inputs


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("torch_cls", [nn.MSELoss, nn.CrossEntropyLoss, nn.KLDivLoss], ids=lambda c: c.__name__)
def test_module_db_inputs(torch_cls, dtype):
    _check_module_inputs(torch_cls, dtype)
