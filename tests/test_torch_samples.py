"""Parity with torch on the sample inputs PyTorch's own OpInfo tests use for the functions
we replace: values (dtype included) and, in float32/float64, gradients wherever torch's are
finite. Where torch raises, we raise too."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("expecttest")  # torch.testing._internal needs it (in the test extra)
pytest.importorskip("numpy")
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

import stablelosses.functional as SF  # noqa: E402

OURS = {
    ("softmax", ""): SF.softmax,
    ("softmax", "with_dtype"): SF.softmax,
    ("log_softmax", ""): SF.log_softmax,
    ("log_softmax", "with_dtype"): SF.log_softmax,
    ("logsumexp", ""): SF.logsumexp,
    ("xlogy", ""): SF.xlogy,
    ("sqrt", ""): SF.safe_sqrt,
    ("div", "no_rounding_mode"): SF.safe_div,
    ("true_divide", ""): SF.safe_div,
    ("nn.functional.cross_entropy", ""): SF.cross_entropy,
    ("nn.functional.kl_div", ""): SF.kl_div,
    ("nn.functional.mse_loss", ""): lambda x, y, **kw: SF.rmse_loss(x, y, **kw) ** 2,
}
OPS = [op for op in op_db if (op.name, op.variant_test_name) in OURS]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]


def test_every_replaced_op_has_samples():
    assert {(op.name, op.variant_test_name) for op in OPS} == set(OURS)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("op", OPS, ids=lambda op: f"{op.name}.{op.variant_test_name}".rstrip("."))
def test_opinfo_samples(op, dtype):
    if dtype not in op.supported_dtypes("cpu"):
        pytest.skip(f"torch's {op.name} does not support {dtype}")
    ours = OURS[(op.name, op.variant_test_name)]
    differentiable = dtype in (torch.float32, torch.float64)
    half = dtype in (torch.float16, torch.bfloat16)
    checked = 0
    for sample in op.sample_inputs("cpu", dtype, requires_grad=differentiable):
        args, kwargs = (sample.input, *sample.args), sample.kwargs
        try:
            expected = op.op(*args, **kwargs)
        except Exception as e:  # torch refuses: so must we
            with pytest.raises(type(e) if not isinstance(e, (IndexError, ValueError)) else Exception):
                ours(*args, **kwargs)
            continue
        got = ours(*args, **kwargs)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        tol = {"rtol": 2e-2, "atol": 2e-2} if half else {"rtol": 1e-4, "atol": 1e-5}
        torch.testing.assert_close(got.double(), expected.double(), equal_nan=True, **tol)
        checked += 1
        if differentiable and expected.requires_grad:
            leaves = [t for t in args if isinstance(t, torch.Tensor) and t.requires_grad]
            w = torch.randn_like(expected)
            g_exp = torch.autograd.grad((expected * w).sum(), leaves, allow_unused=True)
            g_got = torch.autograd.grad((got * w).sum(), leaves, allow_unused=True)
            for a, b in zip(g_got, g_exp):
                if b is None:
                    continue
                a = torch.zeros_like(b) if a is None else a
                finite = torch.isfinite(b)
                torch.testing.assert_close(a[finite], b[finite], rtol=1e-4, atol=1e-5)
    assert checked > 0
