"""What the torch.nn catalog tests and torch's own samples share: the module → function table,
an OpInfo sample's arguments as fresh leaves or detached, the comparisons of our gradients
with torch's on a sample, and of our errors with torch's on its error inputs."""

from __future__ import annotations

import pytest
import torch

# name of the module class -> the function it calls
MODULE_FN = {
    "BCELoss": "binary_cross_entropy", "BCEWithLogitsLoss": "binary_cross_entropy_with_logits",
    "CTCLoss": "ctc_loss", "CosineEmbeddingLoss": "cosine_embedding_loss", "CrossEntropyLoss": "cross_entropy",
    "GaussianNLLLoss": "gaussian_nll_loss", "HingeEmbeddingLoss": "hinge_embedding_loss", "HuberLoss": "huber_loss",
    "KLDivLoss": "kl_div", "L1Loss": "l1_loss", "MSELoss": "mse_loss", "MarginRankingLoss": "margin_ranking_loss",
    "MultiLabelMarginLoss": "multilabel_margin_loss", "MultiLabelSoftMarginLoss": "multilabel_soft_margin_loss",
    "MultiMarginLoss": "multi_margin_loss", "NLLLoss": "nll_loss", "PoissonNLLLoss": "poisson_nll_loss",
    "SmoothL1Loss": "smooth_l1_loss", "SoftMarginLoss": "soft_margin_loss",
    "TripletMarginLoss": "triplet_margin_loss", "TripletMarginWithDistanceLoss": "triplet_margin_with_distance_loss",
}


def dtype_id(d) -> str:
    """A dtype as a test id (``float32``)."""
    return str(d).replace("torch.", "")


def sample_args(sample, f):
    """``f`` applied to each of an OpInfo sample's values: ``(args, kwargs)``, the input first."""
    return [f(v) for v in (sample.input, *sample.args)], {k: f(v) for k, v in sample.kwargs.items()}


def fresh_leaf(differentiable: bool):
    """``f`` for `sample_args`: each tensor a fresh copy, a leaf that requires grad when
    ``differentiable`` and floating (so targets and weights get gradients too)."""
    def f(v):
        if isinstance(v, torch.Tensor):
            v = v.detach().clone()
            if differentiable and v.is_floating_point():
                v.requires_grad_()
        return v

    return f


def detach(v):
    """``v`` detached if it is a tensor."""
    return v.detach() if isinstance(v, torch.Tensor) else v


def detached(args, kwargs):
    """``(args, kwargs)`` with every tensor detached."""
    return [detach(v) for v in args], {k: detach(v) for k, v in kwargs.items()}


def assert_error_inputs_match(op, ours) -> None:
    """Each of the OpInfo ``op``'s error inputs raises its error type, with a message that its
    ``error_regex`` matches (torch's tests use ``assertRaisesRegex``), from torch's op and from
    ``ours``."""
    for ei in op.error_inputs(torch.device("cpu")):
        s = ei.sample_input
        match = ei.error_regex or None
        with pytest.raises(ei.error_type, match=match):
            op.op(s.input, *s.args, **s.kwargs)
        with pytest.raises(ei.error_type, match=match):
            ours(s.input, *s.args, **s.kwargs)


def assert_module_error_inputs_match(info, torch_cls, our_cls) -> None:
    """Each of the ModuleInfo ``info``'s error inputs (at least one) raises its error type, with a
    message that its ``error_regex`` matches, from torch's module and from ours, where torch's
    test_modules expects it: in the constructor (``CONSTRUCTION_ERROR``) or in the forward of a
    module that was built (``FORWARD_ERROR``)."""
    from torch.testing._internal.common_modules import ModuleErrorEnum

    errors = list(info.module_error_inputs_func(info, "cpu", torch.float32, False, training=True))
    assert errors
    for e in errors:
        c, f = e.module_error_input.constructor_input, e.module_error_input.forward_input
        for cls in (torch_cls, our_cls):
            if e.error_on == ModuleErrorEnum.CONSTRUCTION_ERROR:
                with pytest.raises(e.error_type, match=e.error_regex or None):
                    cls(*c.args, **c.kwargs)
            else:
                m = cls(*c.args, **c.kwargs)
                with pytest.raises(e.error_type, match=e.error_regex or None):
                    m(*f.args, **f.kwargs)


def assert_gradients_match_where_finite(got, expected, inputs, w, rtol=1e-4, atol=1e-5):
    """The gradients of ``Σ w·got`` and ``Σ w·expected`` with respect to every tensor in
    ``inputs`` that requires grad agree wherever torch's is finite."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves or not expected.requires_grad:
        return
    g_exp = torch.autograd.grad((expected * w).sum(), leaves, allow_unused=True)
    g_got = torch.autograd.grad((got * w).sum(), leaves, allow_unused=True)
    for a, b in zip(g_got, g_exp):
        if b is not None:
            finite = torch.isfinite(b)
            torch.testing.assert_close(a[finite], b[finite], rtol=rtol, atol=atol)


def only_leaf(args, kwargs, leaf):
    """``args`` and ``kwargs`` with every tensor but ``leaf`` detached."""
    def d(v):
        return v if v is leaf else v.detach() if isinstance(v, torch.Tensor) else v

    return [d(v) for v in args], {k: d(v) for k, v in kwargs.items()}


def assert_leaf_gradients(ours, ref, args, kwargs, got, w, *, independent_is_zero=False, forward_ad=False):
    """For each tensor of ``args``/``kwargs`` that requires grad, on its own: the gradient of
    ``Σ w·got`` equals that of ``Σ w·ref(...)`` (the other tensors detached) wherever torch's is
    finite. Where torch refuses a gradient for that tensor (it raises), ours must give one, checked
    by ``gradcheck`` in float64 (with its forward mode when ``forward_ad``).
    ``independent_is_zero``: where torch's value does not depend on the tensor (it does not
    require grad: a target read only by comparisons) ours must be 0 there; else that case is a
    refusal like the others."""
    leaves = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.requires_grad]
    for leaf in leaves:
        a, k = only_leaf(args, kwargs, leaf)
        (g_got,) = torch.autograd.grad((got * w).sum(), leaf, retain_graph=True, allow_unused=True)
        try:
            expected = ref(*a, **k)
            g_exp = None
            if expected.requires_grad or not independent_is_zero:
                (g_exp,) = torch.autograd.grad((expected * w).sum(), leaf, allow_unused=True)
        except RuntimeError:  # torch is "not differentiable with respect to" this argument
            assert g_got is not None, "a floating tensor that requires grad got no gradient"
            if leaf.dtype == torch.float64:
                def f(v, a=a, k=k, leaf=leaf):
                    return ours(*[v if t is leaf else t for t in a], **{n: v if t is leaf else t for n, t in k.items()})

                assert torch.autograd.gradcheck(f, (leaf.detach().clone().requires_grad_(),),
                                                check_forward_ad=forward_ad)
            continue
        if g_exp is None:
            assert g_got is None or not g_got.any()
            continue
        g_got = torch.zeros_like(g_exp) if g_got is None else g_got
        finite = torch.isfinite(g_exp)
        torch.testing.assert_close(g_got[finite], g_exp[finite], rtol=1e-4, atol=1e-5)


def assert_neg_view_matches(ours, sample) -> bool:
    """torch's ``TestMathBits.test_neg_view`` on one float64 sample: the input as a
    negative-bit view of its negation (the same values, ``torch._neg_view``) gives the same
    value, and, where it requires grad, the same gradient for an incoming gradient that is a
    negative-bit view too. False where the plain sample raises (its error is tested elsewhere)."""
    x = sample.input
    if not isinstance(x, torch.Tensor):
        return False
    try:
        expected = ours(x, *sample.args, **sample.kwargs)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return False
    with torch.no_grad():
        negated = torch.neg(x.detach())
    view = torch._neg_view(negated).requires_grad_(x.requires_grad)
    assert view.is_neg()
    got = ours(view, *sample.args, **sample.kwargs)
    torch.testing.assert_close(got, expected, equal_nan=True)
    if x.requires_grad and expected.requires_grad:
        g = torch.randn(expected.shape, dtype=expected.dtype, generator=torch.Generator().manual_seed(0))
        (want,) = torch.autograd.grad(expected, x, g)
        (have,) = torch.autograd.grad(got, view, torch._neg_view(torch.neg(g)))
        torch.testing.assert_close(have, want, equal_nan=True)
    return True


def assert_noncontiguous_matches(ours, sample) -> bool:
    """torch's ``TestCommon.test_noncontiguous_samples`` on one float64 sample: every tensor
    argument made non-contiguous (``noncontiguous_like``: the values interleaved with NaN that no
    correct read touches) gives the same value and the same gradients. False where the plain
    sample raises (its error is tested elsewhere)."""
    try:
        expected = ours(sample.input, *sample.args, **sample.kwargs)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return False
    strided = sample.noncontiguous()
    got = ours(strided.input, *strided.args, **strided.kwargs)
    torch.testing.assert_close(got, expected, equal_nan=True)
    leaves = [v for v in (sample.input, *sample.args, *sample.kwargs.values())
              if isinstance(v, torch.Tensor) and v.requires_grad]
    strided_leaves = [v for v in (strided.input, *strided.args, *strided.kwargs.values())
                      if isinstance(v, torch.Tensor) and v.requires_grad]
    if leaves and expected.requires_grad:
        g = torch.randn(expected.shape, dtype=expected.dtype, generator=torch.Generator().manual_seed(0))
        want = torch.autograd.grad(expected, leaves, g, allow_unused=True)
        have = torch.autograd.grad(got, strided_leaves, g, allow_unused=True)
        for a, b in zip(have, want):
            if b is None:
                assert a is None or not a.any()
            else:
                torch.testing.assert_close(a, b, equal_nan=True)
    return True
