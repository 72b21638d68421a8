"""``torch.func`` transforms nested two deep (design: Composable): ``jacrev``, ``hessian``
(forward over reverse), ``jacrev(jacrev(f))`` and ``jacrev(jacfwd(f))`` of every loss equal
torch's (or the naive formula's) in float64; ``jacfwd(jacfwd(f))``, which torch computes as
zeros through any custom autograd Function, raises instead of returning a wrong number.

Regression: ``jacrev``/``hessian`` of ``cross_entropy`` and ``focal_loss`` raised "element 0
of tensors does not require grad" and ``jacrev(jacrev(f))`` returned zeros.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import hessian, jacfwd, jacrev

import stablelosses as sl
import stablelosses.functional as SF
from stablelosses import naive

D = torch.float64
_T = torch.tensor([1, 0, 4])


def _x():
    return torch.randn(3, 5, dtype=D, generator=torch.Generator().manual_seed(0)) * 2


_P = torch.softmax(torch.randn(3, 5, dtype=D, generator=torch.Generator().manual_seed(1)), 1)


_W = torch.rand(5, dtype=D, generator=torch.Generator().manual_seed(2)) + 0.1


def _focal_ref(z, gamma=2.0):
    lp = F.log_softmax(z, 1).gather(1, _T[:, None])
    return (-(1 - lp.exp()) ** gamma * lp).mean()


# name -> (ours, reference), both of the logits only
CASES = {
    "cross_entropy": (lambda z: SF.cross_entropy(z, _T), lambda z: F.cross_entropy(z, _T)),
    "cross_entropy-weight": (
        lambda z: SF.cross_entropy(z, _T, weight=_W), lambda z: F.cross_entropy(z, _T, weight=_W)),
    "cross_entropy-smoothing": (
        lambda z: SF.cross_entropy(z, _T, label_smoothing=0.1),
        lambda z: F.cross_entropy(z, _T, label_smoothing=0.1)),
    "cross_entropy-probs": (lambda z: SF.cross_entropy(z, _P), lambda z: F.cross_entropy(z, _P)),
    "focal_loss": (lambda z: SF.focal_loss(z, _T, gamma=2.0), _focal_ref),
    "focal_loss-weight-sum": (
        lambda z: SF.focal_loss(z, _T, weight=_W, gamma=0.5, reduction="sum"),
        lambda z: (_W[_T] * -(1 - F.log_softmax(z, 1).gather(1, _T[:, None]).squeeze(1).exp()) ** 0.5
                   * F.log_softmax(z, 1).gather(1, _T[:, None]).squeeze(1)).sum()),
    "log_softmax": (lambda z: SF.log_softmax(z, 1).sin().sum(), lambda z: F.log_softmax(z, 1).sin().sum()),
    "softmax": (lambda z: SF.softmax(z, 1).sin().sum(), lambda z: F.softmax(z, 1).sin().sum()),
    "logsumexp": (lambda z: SF.logsumexp(z, 1).sin().sum(), lambda z: torch.logsumexp(z, 1).sin().sum()),
    "kl_div": (
        lambda z: SF.kl_div(F.log_softmax(z, 1), _P, reduction="batchmean"),
        lambda z: F.kl_div(F.log_softmax(z, 1), _P, reduction="batchmean")),
    "rmse_loss": (lambda z: SF.rmse_loss(z, _P), lambda z: torch.sqrt(F.mse_loss(z, _P))),
    "log_cosh_loss": (lambda z: SF.log_cosh_loss(z, _P), lambda z: naive.log_cosh(z, _P)),
    "sigmoid_focal_loss": (
        lambda z: SF.sigmoid_focal_loss(z, _P, reduction="mean"),
        lambda z: naive.torchvision_sigmoid_focal(z, _P, reduction="mean")),
    "entropy": (
        lambda z: SF.entropy(z, dim=1).sum(), lambda z: -(F.softmax(z, 1) * F.log_softmax(z, 1)).sum()),
}

NESTINGS = {
    "jacrev": jacrev,
    "hessian": hessian,
    "jacrev-jacrev": lambda f: jacrev(jacrev(f)),
    "jacrev-jacfwd": lambda f: jacrev(jacfwd(f)),
}


@pytest.mark.parametrize("nesting", list(NESTINGS))
@pytest.mark.parametrize("name", list(CASES))
def test_nested_transforms_match_the_reference(name, nesting):
    ours, ref = CASES[name]
    transform = NESTINGS[nesting]
    x = _x()
    torch.testing.assert_close(transform(ours)(x), transform(ref)(x), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("nesting", ["hessian", "jacrev-jacrev"])
def test_nested_reverse_transforms_are_the_limit_on_hazard_rows(nesting):
    # a +inf row and a fully masked row: the derivatives are those of the limit (the +inf row
    # at a large finite margin) and 0 on the masked row, never NaN
    x = torch.tensor([[float("inf"), float("inf"), 0.0], [-float("inf")] * 3, [0.5, -1.0, 2.0]], dtype=D)
    t = torch.tensor([1, 0, 2])
    far = torch.tensor([[400.0, 400.0, 0.0], [0.0, 0.0, 0.0], [0.5, -1.0, 2.0]], dtype=D)
    for gamma in (0.0, 2.0):
        def ours(z, gamma=gamma):
            return SF.focal_loss(z, t, gamma=gamma, reduction="sum")

        def ref(z, gamma=gamma):
            lp = F.log_softmax(z, 1).gather(1, t[:, None]).squeeze(1)
            keep = torch.tensor([1.0, 0.0, 1.0], dtype=D)  # the masked row counts as ignored
            return (keep * -(1 - lp.exp()) ** gamma * lp).sum()

        got = NESTINGS[nesting](ours)(x)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, NESTINGS[nesting](ref)(far), rtol=1e-9, atol=1e-12)


def test_nan_rows_stay_nan_under_hessian():
    x = _x()
    x[1, 2] = float("nan")
    h = hessian(lambda z: SF.cross_entropy(z, _T, reduction="sum"))(x)
    assert torch.isnan(h[1]).any() and torch.isfinite(h[0]).all() and torch.isfinite(h[2]).all()


@pytest.mark.parametrize("name", ["cross_entropy", "focal_loss", "log_softmax", "rmse_loss"])
def test_nested_forward_mode_raises_instead_of_returning_zeros(name):
    ours, _ = CASES[name]
    with pytest.raises(RuntimeError, match=r"nested forward-mode transforms .*hessian"):
        jacfwd(jacfwd(ours))(_x())


def test_torch_still_zeroes_nested_forward_mode_through_a_custom_function():
    # Why the raise above exists: torch returns zeros for d²/dx² of x² through a custom
    # Function under jacfwd(jacfwd(f)). When this fails, torch fixed it: lift the guard in
    # stablelosses/_autograd/_base.py (nested_forward_transforms) and its test above.
    class Square(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])
            ctx.save_for_forward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            return 2 * ctx.saved_tensors[0] * g

        @staticmethod
        def jvp(ctx, t):
            return 2 * ctx.saved_tensors[0] * t

    x = torch.tensor([3.0], dtype=D)
    second = jacfwd(jacfwd(lambda z: Square.apply(z).sum()))(x)
    assert second.item() == 0.0  # the true value is 2


# A batched backward: vmap over the incoming gradient of torch.autograd.grad, as
# gradcheck(check_batched_grad=True), jacobian(vectorize=True) and is_grads_batched=True run it.
# name -> (function, float64 inputs); every one once wrote its gradient in place into an
# unbatched buffer with a batched operand ("vmap: aten::mul_ ... is not possible").
def _rand(*shape, seed):
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed))


BATCHED_BACKWARD = {
    "logsumexp-0d": (lambda v: SF.logsumexp(v, (0,), True), lambda: (torch.tensor(-4.83, dtype=D),)),
    "logsumexp-5x5": (lambda v: SF.logsumexp(v, (1,), False), lambda: (_rand(5, 5, seed=3),)),
    # a differentiable class weight with label smoothing: the double backward runs the
    # Function's backward with a batched gradient ("vmap: aten::scatter_add_ ...")
    "cross_entropy-weight-smoothing": (
        lambda x, w: SF.cross_entropy(x, torch.tensor([1, -100, 4]), weight=w, reduction="sum", label_smoothing=0.1),
        lambda: (_x(), _W)),
    # the fused linear losses' per-row outputs: the chunk loop writes into unbatched buffers
    "linear_cross_entropy-none": (
        lambda x, w: SF.linear_cross_entropy(x, w, _T, reduction="none", chunk_size=2),
        lambda: (_rand(3, 4, seed=4), _rand(5, 4, seed=5))),
    "linear_cross_entropy-none-1d": (
        lambda x, w: SF.linear_cross_entropy(x, w, torch.tensor(2), reduction="none"),
        lambda: (_rand(4, seed=4), _rand(5, 4, seed=5))),
    "linear_focal_loss-none": (
        lambda x, w: SF.linear_focal_loss(x, w, _T, reduction="none", weight=_W),
        lambda: (_rand(3, 4, seed=4), _rand(5, 4, seed=5))),
    "linear_token_logps": (  # out= matmuls: "Batching rule not implemented for aten::alias"
        lambda x, w: SF.linear_token_logps(x, w, _T),
        lambda: (_rand(3, 4, seed=4), _rand(5, 4, seed=5))),
    "linear_distillation_loss-none": (
        lambda x, w, xt: SF.linear_distillation_loss(x, w, xt, _rand(5, 2, seed=6), kind="jsd", reduction="none"),
        lambda: (_rand(3, 4, seed=4), _rand(5, 4, seed=5), _rand(3, 2, seed=7))),
}


@pytest.mark.parametrize("name", list(BATCHED_BACKWARD))
def test_batched_backward_passes_gradcheck(name):
    f, inputs = BATCHED_BACKWARD[name]
    args = tuple(t.requires_grad_() for t in inputs())
    assert torch.autograd.gradcheck(f, args, check_batched_grad=True)
    assert torch.autograd.gradgradcheck(f, args, check_batched_grad=True)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_linear_cross_entropy_module_gradients_batched_over_outputs(reduction):
    # the reference is the unfused form, cross_entropy of the logits (torch's own
    # LinearCrossEntropyLoss exists from torch 2.13 only, and gives the same)
    m = sl.LinearCrossEntropyLoss(5, 4, reduction=reduction, dtype=D)
    lin = m.linear

    def ref(x, t):
        return F.cross_entropy(F.linear(x, lin.weight, lin.bias), t, reduction=reduction)

    x, t = _rand(8, 5, seed=8).requires_grad_(), torch.tensor([0, 3, 1, 2, 2, 0, 1, 3])
    go = torch.eye(8, dtype=D) if reduction == "none" else torch.arange(1.0, 4.0, dtype=D)
    # create_graph: the batched gradient is differentiable again
    (got,) = torch.autograd.grad(m(x, t), x, go, is_grads_batched=True, create_graph=True)
    (want,) = torch.autograd.grad(ref(x, t), x, go, is_grads_batched=True, create_graph=True)
    torch.testing.assert_close(got, want)
    second = torch.autograd.grad(got.sin().sum(), lin.weight)[0]
    torch.testing.assert_close(second, torch.autograd.grad(want.sin().sum(), lin.weight)[0])


def test_jacrev_of_linear_cross_entropy_per_row_equals_the_unfused_form():
    x, w = _rand(3, 4, seed=4), _rand(5, 4, seed=5)
    got = jacrev(lambda a, b: SF.linear_cross_entropy(a, b, _T, reduction="none"), (0, 1))(x, w)
    want = jacrev(lambda a, b: F.cross_entropy(a @ b.T, _T, reduction="none"), (0, 1))(x, w)
    torch.testing.assert_close(got, want)
