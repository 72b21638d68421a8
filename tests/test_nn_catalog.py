"""The torch.nn catalog as a whole: every loss class and function exists with torch's signature;
the modules load torch's state, repr, deepcopy and pickle as torch's; float16/bfloat16 is
torch's float32 result rounded; torch.func and torch.compile(fullgraph=True) work; errors keep
torch's type and name the argument. The hazards have their own files (test_bce_logits.py,
test_gaussian_nll.py, test_ctc.py, test_cosine_embedding.py, test_soft_margin.py, test_nll.py);
the functions without a hazard are in test_torch_losses.py."""

from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from catalog_helpers import MODULE_FN
from torch import nn

import stablelosses as sl
import stablelosses.functional as SF

CLASSES = sorted(n for n in dir(nn) if n.endswith("Loss")
                 and n not in ("AdaptiveLogSoftmaxWithLoss", "LinearCrossEntropyLoss"))
FUNCTIONS = sorted(
    {n for n in dir(F) if n.endswith("_loss") and n != "linear_cross_entropy"}
    | {"binary_cross_entropy", "binary_cross_entropy_with_logits", "nll_loss", "kl_div", "cross_entropy"}
)
NEW = [f for f in FUNCTIONS if f not in ("kl_div", "cross_entropy")]


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def case(name: str, dtype=torch.float64):
    """A valid call of ``name``: (positional tensors, keyword arguments); every floating
    positional tensor is one torch differentiates (or ours does)."""
    g = _g()

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    x, y = r(4, 3), r(4, 3)
    t = torch.tensor([0, 2, 1, 2])
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=dtype)
    table = {
        "l1_loss": ((x, y), {}),
        "mse_loss": ((x, y), {}),
        "huber_loss": ((x, 3 * y), {"delta": 1.5}),
        "smooth_l1_loss": ((x, 3 * y), {"beta": 0.5}),
        "nll_loss": ((x.log_softmax(1), t), {}),
        "poisson_nll_loss": ((x, y.abs()), {}),
        "gaussian_nll_loss": ((x, y, y.abs() + 0.1), {}),
        "binary_cross_entropy": ((x.sigmoid(), y.sigmoid()), {}),
        "binary_cross_entropy_with_logits": ((x, y.sigmoid()), {}),
        "ctc_loss": ((r(6, 2, 4).log_softmax(2), torch.tensor([[1, 2], [3, 3]]), torch.tensor([6, 5]),
                      torch.tensor([2, 2])), {}),
        "cosine_embedding_loss": ((x, y, sign), {"margin": 0.1}),
        "hinge_embedding_loss": ((x, sign[:, None].expand(4, 3).contiguous()), {}),
        "margin_ranking_loss": ((x[:, 0], y[:, 0], sign), {}),
        "multi_margin_loss": ((x, t), {}),
        "multilabel_margin_loss": ((x, torch.tensor([[0, 2, -1]] * 4)), {}),
        "multilabel_soft_margin_loss": ((x, y.sigmoid()), {}),
        "soft_margin_loss": ((x, sign[:, None].expand(4, 3).contiguous()), {}),
        "triplet_margin_loss": ((x, y, r(4, 3)), {}),
        "triplet_margin_with_distance_loss": ((x, y, r(4, 3)), {}),
        "kl_div": ((x.log_softmax(1), y.softmax(1)), {"reduction": "batchmean"}),
        "cross_entropy": ((x, t), {}),
    }
    return table[name]


def _float_positions(args):
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]


# ------------------------------------------------------------------------------------ existence


def test_there_are_21_classes_and_every_function():
    assert len(CLASSES) == 21
    for name in CLASSES:
        assert name in sl.__all__ and issubclass(getattr(sl, name), torch.nn.modules.loss._Loss)
    for name in FUNCTIONS:
        assert name in SF.__all__


@pytest.mark.parametrize("name", NEW)
def test_function_has_torchs_signature(name):
    ours = inspect.signature(getattr(SF, name)).parameters
    theirs = inspect.signature(getattr(F, name)).parameters
    for (n1, p1), (n2, p2) in zip(ours.items(), theirs.items()):
        assert (n1, p1.default, p1.kind) == (n2, p2.default, p2.kind)
    assert list(ours)[: len(theirs)] == list(theirs)


@pytest.mark.parametrize("name", CLASSES)
def test_class_has_torchs_constructor(name):
    ours = inspect.signature(getattr(sl, name).__init__).parameters
    theirs = inspect.signature(getattr(nn, name).__init__).parameters
    assert [(n, p.default) for n, p in theirs.items()] == [(n, p.default) for n, p in ours.items()][: len(theirs)]


def _constructed(name):
    kw = {}
    if name in ("BCELoss", "BCEWithLogitsLoss", "NLLLoss", "CrossEntropyLoss", "MultiLabelSoftMarginLoss",
                "MultiMarginLoss"):
        kw["weight"] = torch.rand(3, generator=_g())
    if name == "BCEWithLogitsLoss":
        kw["pos_weight"] = torch.rand(3, generator=_g(1))
    return getattr(nn, name)(**kw), getattr(sl, name)(**{k: torch.zeros_like(v) for k, v in kw.items()})


@pytest.mark.parametrize("name", CLASSES)
def test_module_state_repr_copy_pickle(name):
    theirs, ours = _constructed(name)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())  # torch's state loads into ours
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v)
    assert repr(ours).startswith(f"{name}(")
    if name not in ("CrossEntropyLoss", "KLDivLoss"):  # those two show their configuration
        assert repr(ours) == repr(theirs)
    clone = copy.deepcopy(ours)
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    restored = pickle.loads(pickle.dumps(ours))
    for m in (clone, loaded, restored):
        assert type(m) is type(ours) and list(m.state_dict()) == list(ours.state_dict())


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_module_equals_torch_module(name, reduction):
    args, kw = case(MODULE_FN[name])
    kw = {k: v for k, v in kw.items() if k not in ("reduction", "margin", "delta", "beta")}
    ours, theirs = getattr(sl, name)(reduction=reduction), getattr(nn, name)(reduction=reduction)
    torch.testing.assert_close(ours(*args, **kw), theirs(*args, **kw))


# ------------------------------------------------------------------------- values and dtypes


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_equals_torch_in_float32_and_float64(name, reduction):
    for dtype in (torch.float32, torch.float64):
        args, kw = case(name, dtype)
        kw = {**kw, "reduction": reduction}
        got, expected = getattr(SF, name)(*args, **kw), getattr(F, name)(*args, **kw)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_is_torchs_float32_result_rounded(name, dtype):
    args, kw = case(name, torch.float32)
    half = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    up = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in half]
    expected = getattr(F, name)(*up, **kw, reduction="none").to(dtype)
    got = getattr(SF, name)(*half, **kw, reduction="none")
    assert got.dtype == dtype
    # the hazard functions compute torch's value with their own float32 spelling: one ulp apart at most
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(got, expected, rtol=ulp, atol=ulp)
    leaves = [a.clone().requires_grad_() if a.is_floating_point() else a for a in half]
    float_leaves = [a for a in leaves if a.is_floating_point()]
    out = getattr(SF, name)(*leaves, **kw)
    grads = torch.autograd.grad(out, float_leaves, allow_unused=True)
    for a, gr in zip(float_leaves, grads):
        assert gr is None or gr.dtype == a.dtype


# ------------------------------------------------------------------------------- transforms


@pytest.mark.parametrize("name", [n for n in NEW if n != "ctc_loss"])
def test_torch_func_grad_and_vmap(name):
    args, kw = case(name)
    pos = _float_positions(args)[0]

    def f(v, *rest):
        a = list(rest)
        a.insert(pos, v)
        return getattr(SF, name)(*a, **kw)

    rest = [a for i, a in enumerate(args) if i != pos]
    g = torch.func.grad(f)(args[pos], *rest)
    leaf = args[pos].clone().requires_grad_()
    (expected,) = torch.autograd.grad(f(leaf, *rest), leaf)
    torch.testing.assert_close(g, expected)
    batched = torch.stack([args[pos], args[pos] * 0.5])
    out = torch.vmap(lambda v: f(v, *rest))(batched)
    torch.testing.assert_close(out[1], f(args[pos] * 0.5, *rest))


@pytest.mark.parametrize("name", [n for n in NEW if n not in ("ctc_loss", "multilabel_margin_loss",
                                                                  "multi_margin_loss")])
def test_double_backward(name):
    # torch has double backward for these; ctc and the margin kernels have none in torch
    args, kw = case(name)
    pos = _float_positions(args)
    leaves = [a.clone().requires_grad_() if i in pos else a for i, a in enumerate(args)]
    if name == "binary_cross_entropy":  # torch's own gradgradcheck range
        leaves = [a.clamp(0.05, 0.95).detach().requires_grad_() if i in pos else a for i, a in enumerate(leaves)]
    if name == "triplet_margin_with_distance_loss":
        kw = {"distance_function": lambda a, b: (a - b).pow(2).sum(-1)}
    fl = [leaves[i] for i in pos]

    def f(*v):
        it = iter(v)
        return getattr(SF, name)(*[next(it) if i in pos else a for i, a in enumerate(leaves)], **kw)

    assert torch.autograd.gradgradcheck(f, fl)


@pytest.mark.slow
def test_ctc_does_not_compile_fullgraph_in_torch_either():
    # aten._ctc_loss's output shape depends on data: Dynamo refuses torch's own op in one graph
    torch._dynamo.reset()
    args, kw = case("ctc_loss", torch.float32)
    with pytest.raises(Exception, match="Dynamic shape operator"):
        torch.compile(lambda *a: F.ctc_loss(*a), fullgraph=True)(*args)
    compiled = torch.compile(lambda *a: SF.ctc_loss(*a))  # with a graph break, as torch's
    torch.testing.assert_close(compiled(*args), SF.ctc_loss(*args))


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in NEW if n != "ctc_loss"])
def test_compile_fullgraph(name):
    torch._dynamo.reset()
    args, kw = case(name, torch.float32)
    fn = getattr(SF, name)
    compiled = torch.compile(lambda *a: fn(*a, **kw), fullgraph=True)
    leaves = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
    out = compiled(*leaves)
    torch.testing.assert_close(out, fn(*args, **kw), rtol=1e-5, atol=1e-6)
    out.backward()
    eager = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
    fn(*eager, **kw).backward()
    for a, b in zip(leaves, eager):
        if a.is_floating_point() and b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


WEIGHTED = {  # the catalog losses whose torch kernel gives `weight` no gradient (ours adds it)
    "nll_loss": lambda x, w: SF.nll_loss(x.log_softmax(1), torch.tensor([0, 2, 1, 2]), weight=w),
    "multi_margin_loss": lambda x, w: SF.multi_margin_loss(x, torch.tensor([0, 2, 1, 2]), weight=w),
    "binary_cross_entropy": lambda x, w: SF.binary_cross_entropy(x.sigmoid(), torch.full_like(x, 0.3),
                                                                 weight=w.expand(4, 3)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WEIGHTED))
def test_compile_fullgraph_with_a_constant_weight(name):
    # the weight-gradient term is decided without tracing functorch's wrapper test
    torch._dynamo.reset()
    x = torch.randn(4, 3, generator=_g(), requires_grad=True)
    w = torch.tensor([0.5, 2.0, 1.0])
    out = torch.compile(WEIGHTED[name], fullgraph=True, backend="eager")(x, w)
    torch.testing.assert_close(out, WEIGHTED[name](x, w))
    (g,) = torch.autograd.grad(out, x)
    torch.testing.assert_close(g, torch.autograd.grad(WEIGHTED[name](x, w), x)[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WEIGHTED))
def test_compiled_torch_func_gives_the_weight_its_gradient(name):
    # Dynamo traces torch.func transforms: inside them the weight is a wrapper whose
    # requires_grad is False, and the weight-gradient term must stay (it was silently 0)
    torch._dynamo.reset()
    x = torch.randn(4, 3, generator=_g())
    w = torch.tensor([0.5, 2.0, 1.0])

    def f(w):
        return WEIGHTED[name](x, w)

    torch.testing.assert_close(torch.compile(torch.func.grad(f), fullgraph=True, backend="eager")(w),
                               torch.func.grad(f)(w))
    v = torch.tensor([1.0, -3.0, 0.25])
    jvp = torch.compile(lambda w, v: torch.func.jvp(f, (w,), (v,))[1], fullgraph=True, backend="eager")
    torch.testing.assert_close(jvp(w, v), torch.func.jvp(f, (w,), (v,))[1])


@pytest.mark.parametrize("name", sorted(WEIGHTED))
def test_forward_ad_tangent_of_the_weight(name):
    # a dual weight neither requires grad nor is a functorch wrapper: its tangent was dropped
    x = torch.randn(4, 3, generator=_g(), dtype=torch.float64)
    w = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    v = torch.tensor([1.0, -3.0, 0.25], dtype=torch.float64)
    with torch.autograd.forward_ad.dual_level():
        out = WEIGHTED[name](x, torch.autograd.forward_ad.make_dual(w, v))
        tangent = torch.autograd.forward_ad.unpack_dual(out).tangent
    leaf = w.clone().requires_grad_()
    (grad,) = torch.autograd.grad(WEIGHTED[name](x, leaf), leaf)
    assert tangent is not None
    torch.testing.assert_close(tangent, grad @ v)


# ----------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("name", NEW)
def test_bad_reduction_is_a_value_error_naming_the_argument(name):
    args, kw = case(name)
    with pytest.raises(ValueError, match=f"{name}: reduction must be 'none', 'mean' or 'sum', got 'avg'"):
        getattr(SF, name)(*args, **{**kw, "reduction": "avg"})


def _torch_outcome(call):
    """``(value or exception type, message, [(warning category, text)])`` of ``call()``."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out, msg = call(), ""
        except Exception as e:  # noqa: BLE001 - compared with torch's
            out, msg = type(e), str(e)
    return out, msg, [(w.category, str(w.message)) for w in caught]


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("reduction", ["elementwise_mean", "abc"])
def test_reduction_is_read_as_torchs_get_enum_reads_it(name, reduction):
    # torch's losses read reduction with torch.nn._reduction.get_enum: 'elementwise_mean' is
    # 'mean' with a deprecation UserWarning (where the function uses get_enum; poisson_nll,
    # gaussian_nll, multilabel_soft_margin and triplet_margin_with_distance check the names
    # themselves and refuse it), and a bad name's message holds torch's words
    args, kw = case(name)
    kw = {**kw, "reduction": reduction}
    exp, exp_msg, exp_warn = _torch_outcome(lambda: getattr(F, name)(*args, **kw))
    got, got_msg, got_warn = _torch_outcome(lambda: getattr(SF, name)(*args, **kw))
    if isinstance(exp, type):
        assert got is exp and exp_msg in got_msg
        return
    torch.testing.assert_close(got, exp)
    assert got.dtype == exp.dtype
    assert exp_warn and set(exp_warn) <= set(got_warn)


@pytest.mark.parametrize("name", [n for n in FUNCTIONS if "size_average" in inspect.signature(getattr(F, n)).parameters])
@pytest.mark.parametrize("legacy", [{"size_average": False}, {"reduce": False}, {"size_average": True, "reduce": True}])
def test_legacy_arguments_warn_as_torch(name, legacy):
    # torch.nn._reduction.legacy_get_string's deprecation UserWarning, word for word; the reduction
    # is not read then (torch ignores it: reduction='bogus' passes)
    args, kw = case(name)
    kw = {**kw, **legacy, "reduction": "bogus"}
    exp, _, exp_warn = _torch_outcome(lambda: getattr(F, name)(*args, **kw))
    got, _, got_warn = _torch_outcome(lambda: getattr(SF, name)(*args, **kw))
    if isinstance(exp, type):  # torch's multilabel_soft_margin and poisson_nll check the name anyway
        assert got is exp
        kw["reduction"] = "mean"
        exp, _, exp_warn = _torch_outcome(lambda: getattr(F, name)(*args, **kw))
        got, _, got_warn = _torch_outcome(lambda: getattr(SF, name)(*args, **kw))
    torch.testing.assert_close(got, exp)
    assert got_warn == exp_warn


@pytest.mark.parametrize("name", CLASSES)
def test_module_takes_elementwise_mean_where_torchs_does(name):
    # torch's module passes reduction to its function: 'elementwise_mean' is 'mean' with the
    # deprecation warning where that function reads it with get_enum, else its ValueError
    args, kw = case(MODULE_FN[name])
    kw = {k: v for k, v in kw.items() if k not in ("reduction", "margin", "delta", "beta")}

    def run(cls):
        return _torch_outcome(lambda: cls(reduction="elementwise_mean")(*args, **kw))

    exp, _, exp_warn = run(getattr(nn, name))
    got, _, got_warn = run(getattr(sl, name))
    if isinstance(exp, type):
        assert got is exp
        return
    torch.testing.assert_close(got, exp)
    assert exp_warn and set(exp_warn) <= set(got_warn)


def test_kl_div_ignores_reduction_after_a_legacy_argument():
    x, y = torch.randn(4, 3).log_softmax(1), torch.randn(4, 3).softmax(1)
    expected = F.kl_div(x, y, reduce=False, reduction="bogus")
    torch.testing.assert_close(SF.kl_div(x, y, reduce=False, reduction="bogus"), expected)
    # and torch's 'mean' warning is not emitted: size_average=False is the sum
    _, _, warned = _torch_outcome(lambda: SF.kl_div(x, y, size_average=False))
    assert [w for _, w in warned if "batchmean" in w] == []


@pytest.mark.parametrize("name", ["l1_loss", "mse_loss", "smooth_l1_loss", "soft_margin_loss", "huber_loss",
                                  "poisson_nll_loss", "hinge_embedding_loss"])
def test_broadcast_error_keeps_torchs_type_and_names_the_arguments(name):
    x, y = torch.randn(2, 3), torch.randn(4)
    with pytest.raises(RuntimeError) as theirs:
        getattr(F, name)(x, y)
    with pytest.raises(type(theirs.value), match=rf"{name}: .*input: torch.float32 \(2, 3\); target: torch.float32 \(4,\)"):
        getattr(SF, name)(x, y)


def test_target_dtype_error_names_the_argument():
    with pytest.raises(RuntimeError, match="nll_loss: target must be an integer tensor"):
        SF.nll_loss(torch.randn(2, 3), torch.tensor([0.0, 1.0]))
    with pytest.raises(RuntimeError, match="nll_loss: weight must have input's dtype"):
        SF.nll_loss(torch.randn(2, 3), torch.tensor([0, 1]), weight=torch.ones(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="multi_margin_loss: weight must have input's dtype"):
        SF.multi_margin_loss(torch.randn(2, 3), torch.tensor([0, 1]), weight=torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("name", NEW)
def test_a_non_tensor_is_a_type_error(name):
    args, kw = case(name)
    with pytest.raises(TypeError, match=f"{name}: "):
        getattr(SF, name)([1.0], *args[1:], **kw)


@pytest.mark.parametrize("name", NEW)
def test_nan_in_nan_out(name):
    args, kw = case(name)
    pos = _float_positions(args)[0]
    x = args[pos].clone()
    x.view(-1)[0] = float("nan")
    a = list(args)
    a[pos] = x
    if name == "binary_cross_entropy":  # torch refuses a probability outside [0, 1], NaN included
        with pytest.raises(RuntimeError):
            SF.binary_cross_entropy(*a, **kw)
        return
    out = getattr(SF, name)(*a, **{**kw, "reduction": "sum"})
    assert torch.isnan(out)


def test_cosine_embedding_nan_beside_a_zero_vector_stays_nan():
    out = SF.cosine_embedding_loss(torch.tensor([[float("nan"), 1.0]]), torch.zeros(1, 2), torch.tensor([1.0]))
    assert torch.isnan(out)


# torch has no forward-mode derivative for these kernels, so neither do we
NO_FORWARD_AD = ("ctc_loss", "multi_margin_loss", "multilabel_margin_loss")


@pytest.mark.parametrize("name", [n for n in NEW if n not in NO_FORWARD_AD])
def test_jvp_equals_torchs(name):
    args, kw = case(name)
    pos = _float_positions(args)[0]

    def at(fn):
        def f(v):
            a = list(args)
            a[pos] = v
            return fn(*a, **kw)

        return f

    tangent = torch.randn(args[pos].shape, generator=_g(7), dtype=args[pos].dtype)
    out, tan = torch.func.jvp(at(getattr(SF, name)), (args[pos],), (tangent,))
    out_t, tan_t = torch.func.jvp(at(getattr(F, name)), (args[pos],), (tangent,))
    torch.testing.assert_close(out, out_t)
    torch.testing.assert_close(tan, tan_t)


@pytest.mark.parametrize("name", NO_FORWARD_AD)
def test_no_forward_mode_where_torch_has_none(name):
    args, kw = case(name)
    pos = _float_positions(args)[0]
    a = list(args)

    def f(v):
        a[pos] = v
        return getattr(SF, name)(*a, **kw)

    with pytest.raises(RuntimeError, match="forward AD"):
        torch.func.jvp(f, (args[pos],), (torch.ones_like(args[pos]),))


MIXED = [(torch.float16, torch.float32), (torch.float32, torch.float64), (torch.float64, torch.float32),
         (torch.bfloat16, torch.float16), (torch.float32, torch.float16)]


@pytest.mark.parametrize("name", [n for n in NEW if n != "ctc_loss"])
def test_mixed_dtypes_give_torchs_dtype_or_torchs_error(name):
    args, kw = case(name, torch.float32)
    pos = _float_positions(args)
    for d0, d1 in MIXED:
        a = list(args)
        for j, i in enumerate(pos):
            a[i] = a[i].to(d0 if j == 0 else d1)
        try:
            expected = getattr(F, name)(*a, **kw).dtype
        except NotImplementedError:  # torch's CPU kernel has no half precision; ours computes in float32
            assert getattr(SF, name)(*a, **kw).dtype == a[pos[0]].dtype
            continue
        except RuntimeError as e:
            if "not implemented for" in str(e):  # the same, as torch < 2.7 words it
                assert getattr(SF, name)(*a, **kw).dtype == a[pos[0]].dtype
                continue
            with pytest.raises(RuntimeError, match=f"{name}: "):
                getattr(SF, name)(*a, **kw)
            continue
        assert getattr(SF, name)(*a, **kw).dtype == expected, (d0, d1)


@pytest.mark.parametrize("log_input", [True, False])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_poisson_nll_full_target_gradient_at_zero_count_is_finite(log_input, reduction):
    """full=True: torch's target gradient at a zero count is NaN (its masked Stirling term still
    differentiates y·log y there); ours is the other term's, -x (or -log(x + eps)). Values and
    every other gradient are torch's, bit for bit."""
    x = torch.tensor([[0.5, 2.0, 3.0], [1.0, 1.5, 0.2]], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0.0, 0.5, 4.0], dtype=torch.float64, requires_grad=True)
    want = F.poisson_nll_loss(x, y, log_input=log_input, full=True, reduction=reduction)
    got = SF.poisson_nll_loss(x, y, log_input=log_input, full=True, reduction=reduction)
    assert torch.equal(got, want)
    (gx_want, gy_want), (gx, gy) = (torch.autograd.grad(v.sum(), (x, y)) for v in (want, got))
    assert torch.isnan(gy_want[0]) and torch.equal(gx, gx_want) and torch.equal(gy[1:], gy_want[1:])
    scale = {"none": 1.0, "sum": 1.0, "mean": 1 / 6}[reduction]
    other = x.detach()[:, 0] if log_input else torch.log(x.detach()[:, 0] + 1e-8)
    torch.testing.assert_close(gy[0], -other.sum() * scale)
