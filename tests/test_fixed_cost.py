"""The per-call shortcuts that keep the fixed cost low (design: Speed) compute what the general
code computes.

* a forward under ``no_grad`` gives the same values as with grad, and forward-mode AD inside
  ``no_grad`` still gets its tangent;
* ``_utils.broadcast_shapes`` / ``_utils.promote_types`` (built once, plain Python) agree with
  torch's, errors included, and are torch's own under ``torch.compile``;
* the first-order backwards that run fewer passes (``inplace_ok``: each lowers the bytes moved)
  equal the differentiable ones that double backward uses.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import stablelosses.functional as SF
from stablelosses._utils import broadcast_shapes, promote_types

D = torch.float64
_G = torch.Generator().manual_seed(0)


def _randn(*shape):
    return torch.randn(*shape, dtype=D, generator=_G)


def _pos(*shape):
    return torch.rand(*shape, dtype=D, generator=_G) + 0.1


_LABELS = torch.tensor([0, 4, 1, 2])

# class-index rows with every hazard (the cross-entropy family)
_HAZARD_ROWS = torch.tensor([
    [2.0, 0.5, -float("inf"), 1.0, 0.0],  # a masked class
    [-float("inf")] * 5,  # fully masked
    [float("inf"), 1.0, float("inf"), 0.0, 0.0],  # +inf row, +inf target
    [float("inf"), 1.0, 0.0, 0.0, 0.0],  # +inf row, finite target
    [40.0, 0.0, 0.0, 0.0, 0.0],  # p_t -> 1: the exact tail
    [3.4e38, -3.4e38, 0.0, 1.0, 2.0],  # finfo extremes
    [float("nan"), 0.0, 0.0, 0.0, 0.0],  # NaN in, NaN out
    [1.0, 2.0, 3.0, 4.0, 5.0],  # an ignored target
])
_HAZARD_TARGETS = torch.tensor([0, 1, 0, 1, 0, 4, 2, -100])

# every public function on a small input: (call, inputs)
CALLS = {
    "safe_sqrt": (SF.safe_sqrt, lambda: (torch.tensor([0.0, 0.5, 2.0], dtype=D),)),
    "safe_div": (SF.safe_div, lambda: (_randn(4, 3), torch.tensor([0.0, 2.0, -1.0], dtype=D))),
    "xlogy": (SF.xlogy, lambda: (torch.tensor([[0.0, 1.0, 2.0]], dtype=D),
                                 torch.tensor([0.0, 0.5, 3.0], dtype=D))),
    "logsumexp": (lambda x: SF.logsumexp(x, -1), lambda: (_randn(4, 5),)),
    "softmax": (lambda x: SF.softmax(x, -1), lambda: (_randn(4, 5),)),
    "log_softmax": (lambda x: SF.log_softmax(x, -1), lambda: (_randn(4, 5),)),
    "rmse_loss": (SF.rmse_loss, lambda: (_randn(4, 5), _randn(4, 5))),
    "rmse_loss-none": (lambda x, y: SF.rmse_loss(x, y, "none"), lambda: (_randn(4, 5), _randn(5))),
    "cross_entropy": (SF.cross_entropy, lambda: (_randn(4, 5), torch.tensor([0, 1, 4, 2]))),
    "focal_loss": (SF.focal_loss, lambda: (_randn(4, 5), torch.tensor([0, 1, 4, 2]))),
    "sigmoid_focal_loss": (SF.sigmoid_focal_loss, lambda: (_randn(4, 5), (_pos(4, 5) > 0.6).to(D))),
    "kl_div": (lambda x, t: SF.kl_div(x, t, reduction="batchmean"),
               lambda: (torch.log_softmax(_randn(4, 5), -1), torch.softmax(_randn(4, 5), -1))),
    "log_cosh_loss": (SF.log_cosh_loss, lambda: (_randn(4, 5), _randn(4, 5))),
    "normalize": (SF.normalize, lambda: (torch.cat([_randn(3, 5), torch.zeros(1, 5, dtype=D)]),)),
    "cosine_similarity": (SF.cosine_similarity, lambda: (_randn(4, 5), _randn(1, 5))),
    "logaddexp": (SF.logaddexp, lambda: (torch.tensor([-float("inf"), 1.0], dtype=D),
                                         torch.tensor([-float("inf"), 2.0], dtype=D))),
    "masked_mean": (lambda x: SF.masked_mean(x, torch.tensor([True, False, True, True, False]), dim=-1),
                    lambda: (_randn(4, 5),)),
    "entropy": (SF.entropy, lambda: (torch.tensor([[0.0, -float("inf"), 1.0], [1.0, 2.0, 3.0]], dtype=D),)),
    "info_nce_loss": (SF.info_nce_loss, lambda: (_randn(4, 5), _randn(4, 5))),
    "dice_loss": (SF.dice_loss, lambda: (_pos(2, 5) / 2, (_pos(2, 5) > 0.5).to(D))),
    "linear_cross_entropy": (SF.linear_cross_entropy, lambda: (_randn(4, 3), _randn(5, 3), _LABELS)),
    "linear_cross_entropy-none": (lambda x, w, t: SF.linear_cross_entropy(x, w, t, reduction="none"),
                                  lambda: (_randn(4, 3), _randn(5, 3), _LABELS)),
    "linear_focal_loss": (SF.linear_focal_loss, lambda: (_randn(4, 3), _randn(5, 3), _LABELS)),
    # a reference model's log-probs are the usual forward without grad (DPO, GRPO)
    "token_logps": (SF.token_logps, lambda: (_HAZARD_ROWS.double(), _HAZARD_TARGETS)),
    "sequence_logps": (lambda x, t: SF.sequence_logps(x, t, average=True),
                       lambda: (_HAZARD_ROWS.double().view(2, 4, 5), _HAZARD_TARGETS.view(2, 4))),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_no_grad_forward_equals_the_recorded_forward(name):
    call, make = CALLS[name]
    args = make()
    with torch.no_grad():
        fast = call(*args)
    leaves = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
    recorded = call(*leaves)
    assert recorded.requires_grad and not fast.requires_grad
    torch.testing.assert_close(fast, recorded.detach(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", list(CALLS))
def test_forward_on_inputs_without_grad_in_grad_mode_equals_the_recorded_forward(name):
    # grad mode on, no input requiring grad (a validation step without torch.no_grad): the
    # value-only path, which runs forward with grad mode off as Function.apply does
    call, make = CALLS[name]
    args = make()
    fast = call(*args)
    leaves = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
    recorded = call(*leaves)
    assert recorded.requires_grad and not fast.requires_grad
    torch.testing.assert_close(fast, recorded.detach(), rtol=0, atol=0, equal_nan=True)


def test_value_only_path_takes_the_in_place_spelling_in_grad_mode():
    # log_softmax on inputs that do not require grad, grad mode on: the forward's in-place
    # spelling (7 operators), not the select that a recorded graph would need (9)
    from stablelosses.bench.traffic import bytes_moved

    x = torch.randn(8, 10)
    assert torch.is_grad_enabled()
    assert bytes_moved(lambda: SF.log_softmax(x, -1)).ops <= 7


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("gamma", [None, 0.0, 0.5, 2.0])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_value_only_class_index_forward_is_the_recorded_one_on_hazard_rows(dtype, gamma, weighted, reduction):
    # a detached input takes the value-only path (no Function, no gradient row), a grad-requiring
    # one the Function: the same bits on every hazard row
    x = _HAZARD_ROWS.to(dtype)
    w = torch.linspace(0.5, 1.5, 5, dtype=dtype) if weighted else None

    def call(inp):
        if gamma is None:
            return SF.cross_entropy(inp, _HAZARD_TARGETS, weight=w, reduction=reduction)
        return SF.focal_loss(inp, _HAZARD_TARGETS, gamma=gamma, weight=w, reduction=reduction)

    fast = call(x)
    recorded = call(x.clone().requires_grad_(True))
    assert recorded.requires_grad and not fast.requires_grad
    torch.testing.assert_close(fast, recorded.detach(), rtol=0, atol=0, equal_nan=True)


def test_cross_entropy_forward_ad_inside_no_grad_gets_the_functions_tangent():
    # a dual level keeps the Function (its jvp), not the value-only path's plain ops
    x, t = _HAZARD_ROWS[:5].double(), _HAZARD_TARGETS[:5]
    tan = torch.ones_like(x)
    with torch.no_grad(), fwAD.dual_level():
        tangent = fwAD.unpack_dual(SF.cross_entropy(fwAD.make_dual(x, tan), t, reduction="none")).tangent
    with fwAD.dual_level():
        expected = fwAD.unpack_dual(SF.cross_entropy(fwAD.make_dual(x, tan), t, reduction="none")).tangent
    assert tangent is not None and torch.isfinite(tangent).all()
    torch.testing.assert_close(tangent, expected, rtol=0, atol=0)


def test_forward_ad_inside_no_grad_still_pushes_the_tangent():
    x = torch.tensor([0.0, 0.25, 4.0], dtype=D)
    t = torch.tensor([1.0, 1.0, 1.0], dtype=D)
    with torch.no_grad(), fwAD.dual_level():
        out = SF.safe_sqrt(fwAD.make_dual(x, t))
        tangent = fwAD.unpack_dual(out).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent, torch.tensor([0.0, 1.0, 0.25], dtype=D))


_SHAPES = [(), (1,), (3,), (0,), (2, 3), (2, 1), (1, 3), (4, 1, 3), (5, 2, 1), (0, 1), (1, 0), (3, 0)]


@pytest.mark.parametrize("a, b", list(itertools.product(_SHAPES, repeat=2)), ids=str)
def test_broadcast_shapes_agrees_with_torch(a, b):
    try:
        expected = torch.broadcast_shapes(a, b)
    except RuntimeError:
        with pytest.raises(RuntimeError, match="Shape mismatch"):
            broadcast_shapes(a, b)
        return
    got = broadcast_shapes(a, b)
    assert isinstance(got, torch.Size)
    assert got == expected


def test_broadcast_shapes_three_shapes():
    assert broadcast_shapes((2, 1, 1), (1, 3, 1), (4,)) == torch.broadcast_shapes((2, 1, 1), (1, 3, 1), (4,))
    with pytest.raises(RuntimeError, match="Shape mismatch"):
        broadcast_shapes((2, 1), (1, 3), (4,))


@pytest.mark.slow
def test_broadcast_shapes_and_promote_types_compile_to_torchs():
    def f(a, b):
        s = broadcast_shapes(a.shape, b.shape)
        return a.expand(s).to(promote_types(a.dtype, b.dtype)) + b

    a, b = torch.ones(2, 1), torch.ones(3, dtype=D)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(a, b), f(a, b))


_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.uint16]


@pytest.mark.parametrize("a, b", list(itertools.product(_DTYPES, repeat=2)), ids=str)
def test_promote_types_agrees_with_torch(a, b):
    try:
        expected = torch.promote_types(a, b)
    except RuntimeError as e:  # e.g. uint16 with a signed type: torch refuses, and so do we
        with pytest.raises(type(e)):
            promote_types(a, b)
        return
    assert promote_types(a, b) == expected


def _grads(call, args, create_graph):
    leaves = [a.detach().requires_grad_(True) for a in args]
    out = call(*leaves)
    return torch.autograd.grad(out, leaves, torch.ones_like(out), create_graph=create_graph)


@pytest.mark.filterwarnings("ignore:Using a target size")
@pytest.mark.parametrize("name, call, make", [
    ("xlogy", SF.xlogy, lambda: (torch.tensor([[0.0, 0.0, 1.5, -2.0, 0.0]], dtype=D),
                                 torch.tensor([[0.0], [-1.0], [2.0]], dtype=D))),
    ("safe_div", SF.safe_div, lambda: (_randn(3, 4), torch.tensor([0.0, 2.0, -0.5, 1e-300], dtype=D))),
    ("safe_sqrt", SF.safe_sqrt, lambda: (torch.tensor([0.0, 1e-300, 2.0, 0.0], dtype=D),)),
    ("rmse_loss", SF.rmse_loss, lambda: (_randn(3, 4), _randn(4))),
])
def test_first_order_backward_equals_the_differentiable_one(name, call, make):
    # create_graph=True runs the backward in grad mode: the double-backward-safe spelling
    args = make()
    lean = _grads(call, args, create_graph=False)
    full = _grads(call, args, create_graph=True)
    for a, b in zip(lean, full):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0, equal_nan=True)


def test_rmse_backward_reuses_the_forward_residual_and_matches_torch():
    x, y = _randn(6, 5), _randn(5)
    ours = _grads(SF.rmse_loss, (x, y), create_graph=False)
    with pytest.warns(UserWarning, match="target size"):
        ref = _grads(lambda a, b: torch.sqrt(F.mse_loss(a, b)), (x, y), create_graph=False)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.filterwarnings("ignore:Using a target size")
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("fn", [SF.rmse_loss, SF.log_cosh_loss], ids=["rmse_loss", "log_cosh_loss"])
def test_residual_output_double_backward_and_target_grad(fn, reduction):
    # the residual the Function returns for its backward is differentiable itself: second
    # derivatives flow back through it (gradgradcheck), and the target gets -grad_input
    x, y = _randn(3, 4).requires_grad_(), _randn(4).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: fn(a, b, reduction), (x, y))
    assert torch.autograd.gradgradcheck(lambda a, b: fn(a, b, reduction), (x, y))


def test_value_only_path_restores_grad_mode_after_an_error():
    # an out-of-range class index raises inside the value-only forward (torch's IndexError);
    # grad mode is back on afterwards
    x = torch.randn(2, 3)
    assert torch.is_grad_enabled()
    with pytest.raises(IndexError):
        SF.cross_entropy(x, torch.tensor([0, 7]))
    assert torch.is_grad_enabled()
