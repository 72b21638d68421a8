"""Argument edges: a bool ``ignore_index`` (True is class 1 in Python) and a ``mask`` on another
device (moved without a word) are refused; module constructors check every argument as their
function does; the scalar types and call forms torch takes; an output edited in place."""

import enum
import inspect
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import stablelosses as sl
import stablelosses.functional as SF


@pytest.mark.parametrize("fn", [SF.cross_entropy, SF.focal_loss], ids=["cross_entropy", "focal_loss"])
@pytest.mark.parametrize("value", [True, False])
def test_bool_ignore_index_is_rejected_as_torch_does(fn, value):
    x, t = torch.randn(3, 4), torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="ignore_index must be an int, got bool"):
        fn(x, t, ignore_index=value)
    # torch refuses it too
    with pytest.raises(TypeError):
        torch.nn.functional.cross_entropy(x, t, ignore_index=value)


x4, t4 = torch.randn(3, 4), torch.tensor([0, 1, 2])
MASKED_CALLS = {
    "cross_entropy": lambda m: SF.cross_entropy(x4, t4, mask=m),
    "focal_loss": lambda m: SF.focal_loss(x4, t4, mask=m),
    "rmse_loss": lambda m: SF.rmse_loss(x4[:, 0], x4[:, 1], mask=m),
    "kl_div": lambda m: SF.kl_div(x4[:, 0], x4[:, 1].sigmoid(), mask=m),
    "sigmoid_focal_loss": lambda m: SF.sigmoid_focal_loss(x4[:, 0], x4[:, 1].sigmoid(), mask=m),
    "masked_mean": lambda m: sl.masked_mean(x4[:, 0], m),
    "softmax": lambda m: sl.softmax(x4[:, 0], 0, mask=m),
    "log_softmax": lambda m: sl.log_softmax(x4[:, 0], 0, mask=m),
    "entropy": lambda m: sl.entropy(x4[:, 0], mask=m, dim=0),
}


@pytest.mark.parametrize("name", list(MASKED_CALLS))
def test_mask_on_another_device_raises_instead_of_moving(name):
    call = MASKED_CALLS[name]
    ok = torch.tensor([True, False, True])
    assert not torch.isnan(call(ok)).any()  # same device: fine
    with pytest.raises(RuntimeError, match="same device"):
        call(ok.to("meta"))


def _outcome(call, x):
    """Value (or the error type) and the input gradient's shape of one call."""
    try:
        out = call()
    except (IndexError, RuntimeError, ValueError) as e:
        return type(e).__name__
    (g,) = torch.autograd.grad(out.sum(), x, allow_unused=True)
    return out.detach(), None if g is None else g.shape


ZERO_CLASS_CASES = [
    ((3, 0), (3, 0), torch.float32),  # probabilities over no class
    ((0, 0), (0,), torch.int64),
    ((0, 0), (0, 0), torch.float32),
    ((2, 0, 3), (2, 0, 3), torch.float32),
    ((3, 0), (3,), torch.int64),  # any index is out of bounds: torch's IndexError
]


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("shapes", ZERO_CLASS_CASES, ids=str)
def test_zero_classes_give_what_torch_gives(shapes, label_smoothing, reduction):
    # 0.2 raised amax's internal IndexError ("Expected reduction dim 1 to have non-zero size")
    xs, ts, tdt = shapes
    x = torch.zeros(xs, requires_grad=True)
    t = torch.zeros(ts, dtype=tdt)
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)
    ours = _outcome(lambda: SF.cross_entropy(x, t, **kw), x)
    theirs = _outcome(lambda: torch.nn.functional.cross_entropy(x, t, **kw), x)
    if isinstance(theirs, str):
        assert ours == theirs
    else:
        torch.testing.assert_close(ours[0], theirs[0], equal_nan=True)
        assert ours[1] == theirs[1]


def test_focal_loss_and_info_nce_on_empty_batches_give_torch_nan():
    x = torch.zeros(0, 0, requires_grad=True)
    assert torch.isnan(SF.focal_loss(x, torch.zeros(0, dtype=torch.long)))
    q = torch.zeros(0, 8, requires_grad=True)
    for symmetric in (False, True):
        loss = SF.info_nce_loss(q, torch.zeros(0, 8), symmetric=symmetric)
        assert torch.isnan(loss)  # the hand-written InfoNCE: cross_entropy of a 0x0 matrix
        (g,) = torch.autograd.grad(loss, q)
        assert g.shape == (0, 8)
    assert SF.info_nce_loss(q, torch.zeros(0, 8), reduction="none").shape == (0,)
    # with a mask an empty denominator is 0, as everywhere else
    assert SF.cross_entropy(x, torch.zeros(0, dtype=torch.long), mask=torch.zeros(0, dtype=torch.bool)) == 0


_LEAVES: list[torch.Tensor] = []  # the float meta tensors of the call under test


def _meta(*shape, dtype=torch.float32):
    t = torch.empty(*shape, device="meta", dtype=dtype)
    if dtype.is_floating_point:
        _LEAVES.append(t.requires_grad_())
    return t


def _long(*shape):
    return _meta(*shape, dtype=torch.long)


def _bool(*shape):
    return _meta(*shape, dtype=torch.bool)


# every public function on meta tensors: an operand made on the host (a tensor without
# ``device=``) or a value read by the host (``.item()``, ``bool(t)``) fails here, as it would
# mix devices or wait for the GPU on CUDA
META_CALLS = {
    "softmax": lambda: SF.softmax(_meta(3, 4), -1),
    "log_softmax": lambda: SF.log_softmax(_meta(3, 4), -1),
    "logsumexp": lambda: SF.logsumexp(_meta(3, 4), -1),
    "cross_entropy": lambda: SF.cross_entropy(_meta(3, 4), _long(3)),
    "cross_entropy_smoothing": lambda: SF.cross_entropy(_meta(3, 4), _long(3), label_smoothing=0.1),
    "cross_entropy_probs": lambda: SF.cross_entropy(_meta(3, 4), _meta(3, 4)),
    "focal_loss": lambda: SF.focal_loss(_meta(3, 4), _long(3)),
    "sigmoid_focal_loss": lambda: SF.sigmoid_focal_loss(_meta(3, 4), _meta(3, 4)),
    "kl_div": lambda: SF.kl_div(_meta(3, 4), _meta(3, 4), reduction="batchmean"),
    "rmse_loss": lambda: SF.rmse_loss(_meta(3, 4), _meta(3, 4)),
    "log_cosh_loss": lambda: SF.log_cosh_loss(_meta(3, 4), _meta(3, 4)),
    "normalize": lambda: SF.normalize(_meta(3, 4)),
    "cosine_similarity": lambda: SF.cosine_similarity(_meta(3, 4), _meta(3, 4)),
    "logaddexp": lambda: SF.logaddexp(_meta(3), _meta(3)),
    "masked_mean": lambda: SF.masked_mean(_meta(3), _bool(3)),
    "entropy": lambda: SF.entropy(_meta(3, 4)),
    "info_nce_loss": lambda: SF.info_nce_loss(_meta(3, 4), _meta(3, 4)),
    "dice_loss": lambda: SF.dice_loss(_meta(3, 4), _meta(3, 4)),
    "safe_div": lambda: SF.safe_div(_meta(3), _meta(3)),
    "safe_sqrt": lambda: SF.safe_sqrt(_meta(3)),
    "xlogy": lambda: SF.xlogy(_meta(3), _meta(3)),
    "linear_cross_entropy": lambda: SF.linear_cross_entropy(_meta(3, 4), _meta(5, 4), _long(3)),
    "linear_focal_loss": lambda: SF.linear_focal_loss(_meta(3, 4), _meta(5, 4), _long(3)),
    # post-training and distillation (0.4)
    "token_logps": lambda: SF.token_logps(_meta(2, 3, 5), _long(2, 3)),
    "sequence_logps": lambda: SF.sequence_logps(_meta(2, 3, 5), _long(2, 3)),
    "linear_token_logps": lambda: SF.linear_token_logps(_meta(2, 3, 4), _meta(5, 4), _long(2, 3)),
    "linear_sequence_logps": lambda: SF.linear_sequence_logps(_meta(2, 3, 4), _meta(5, 4), _long(2, 3)),
    "dpo_loss": lambda: SF.dpo_loss(_meta(3), _meta(3), _meta(3), _meta(3)),
    "orpo_loss": lambda: SF.orpo_loss(_meta(3), _meta(3)),
    "simpo_loss": lambda: SF.simpo_loss(_meta(3), _meta(3)),
    "cpo_loss": lambda: SF.cpo_loss(_meta(3), _meta(3)),
    "kto_loss": lambda: SF.kto_loss(_meta(3), _meta(3), _bool(3)),
    "policy_loss": lambda: SF.policy_loss(_meta(2, 3), _meta(2, 3), _meta(2), _bool(2, 3), ref_logps=_meta(2, 3)),
    "kl_penalty": lambda: SF.kl_penalty(_meta(2, 3), _meta(2, 3)),
    "distillation_loss": lambda: SF.distillation_loss(_meta(3, 5), _meta(3, 5)),
    "linear_distillation_loss": lambda: SF.linear_distillation_loss(_meta(3, 4), _meta(5, 4), _meta(3, 4), _meta(5, 4)),
    # every torch.nn loss (0.4)
    "l1_loss": lambda: SF.l1_loss(_meta(3, 4), _meta(3, 4)),
    "mse_loss": lambda: SF.mse_loss(_meta(3, 4), _meta(3, 4)),
    "huber_loss": lambda: SF.huber_loss(_meta(3, 4), _meta(3, 4)),
    "smooth_l1_loss": lambda: SF.smooth_l1_loss(_meta(3, 4), _meta(3, 4)),
    "nll_loss": lambda: SF.nll_loss(_meta(3, 4), _long(3)),
    "poisson_nll_loss": lambda: SF.poisson_nll_loss(_meta(3, 4), _meta(3, 4)),
    "binary_cross_entropy": lambda: SF.binary_cross_entropy(_meta(3, 4), _meta(3, 4)),
    "binary_cross_entropy_with_logits": lambda: SF.binary_cross_entropy_with_logits(_meta(3, 4), _meta(3, 4)),
    "cosine_embedding_loss": lambda: SF.cosine_embedding_loss(_meta(3, 4), _meta(3, 4), _meta(3)),
    "hinge_embedding_loss": lambda: SF.hinge_embedding_loss(_meta(3, 4), _meta(3, 4)),
    "margin_ranking_loss": lambda: SF.margin_ranking_loss(_meta(3), _meta(3), _meta(3)),
    "multi_margin_loss": lambda: SF.multi_margin_loss(_meta(3, 4), _long(3)),
    "multilabel_margin_loss": lambda: SF.multilabel_margin_loss(_meta(3, 4), _long(3, 4)),
    "multilabel_soft_margin_loss": lambda: SF.multilabel_soft_margin_loss(_meta(3, 4), _meta(3, 4)),
    "soft_margin_loss": lambda: SF.soft_margin_loss(_meta(3, 4), _meta(3, 4)),
    "triplet_margin_loss": lambda: SF.triplet_margin_loss(_meta(3, 4), _meta(3, 4), _meta(3, 4)),
    "triplet_margin_with_distance_loss": lambda: SF.triplet_margin_with_distance_loss(
        _meta(3, 4), _meta(3, 4), _meta(3, 4)),
}
# Left out, as torch's own cannot run them on meta tensors: ``ctc_loss`` (aten::_ctc_loss has no
# meta kernel) and ``gaussian_nll_loss`` (torch's ``var < 0`` check reads the values; ours keeps
# that check and its ValueError, outside torch.compile and torch.func).
# torch has no meta kernel for these operators' backward: forward only
_NO_META_BACKWARD = {"multi_margin_loss", "multilabel_margin_loss"}


def test_meta_calls_cover_every_public_function():
    called = {name.split("_smoothing")[0].split("_probs")[0] for name in META_CALLS}
    assert set(SF.__all__) - called == {"ctc_loss", "gaussian_nll_loss"}


@pytest.mark.parametrize("name", list(META_CALLS))
def test_meta_tensors_give_the_shape_without_computing(name):
    # torch's counterparts all run on meta tensors (shape inference, FSDP's deferred init);
    # the backward too, so no gradient is made on the host either
    _LEAVES.clear()
    out = META_CALLS[name]()
    out = out[0] if isinstance(out, tuple) else out
    assert out.device.type == "meta"
    if name in _NO_META_BACKWARD:
        return
    out.sum().backward()
    grads = [t.grad for t in _LEAVES if t.grad is not None]
    assert grads and all(g.device.type == "meta" for g in grads)


# ------------------------------------------------------------------------------------------
# Module constructors check every argument with their function's check and message
# ------------------------------------------------------------------------------------------

# module -> (its function, positional arguments that build it, constructor arguments the
# function does not take: the layer's own, torch's deprecated aliases, the class weight)
MODULES = {
    sl.RMSELoss: ("rmse_loss", (), ()),
    sl.CrossEntropyLoss: ("cross_entropy", (), ("weight", "size_average", "reduce")),
    sl.FocalLoss: ("focal_loss", (), ("weight",)),
    sl.SigmoidFocalLoss: ("sigmoid_focal_loss", (), ()),
    sl.KLDivLoss: ("kl_div", (), ("size_average", "reduce")),
    sl.LogCoshLoss: ("log_cosh_loss", (), ()),
    sl.InfoNCELoss: ("info_nce_loss", (), ()),
    sl.DiceLoss: ("dice_loss", (), ()),
    sl.LinearCrossEntropyLoss: ("linear_cross_entropy", (5, 3), (
        "in_features", "num_classes", "legacy", "out_features", "bias", "device", "dtype", "weight", "options")),
    sl.LinearFocalLoss: ("linear_focal_loss", (5, 3), (
        "in_features", "num_classes", "legacy", "out_features", "bias", "device", "dtype", "weight", "options")),
    sl.DistillationLoss: ("distillation_loss", (), ()),
    sl.LinearDistillationLoss: ("linear_distillation_loss", (), ()),
}
_SHAPE_FREE = (TypeError, RuntimeError)  # a dimension's range and repeats need the input


def _module_cases():
    from test_specs import ARGS, DIM_KINDS

    for cls, (fn, _, _) in MODULES.items():
        built_with = inspect.signature(cls.__init__).parameters
        for name, (_, bad) in ARGS[fn].items():
            if name not in built_with:  # a call's argument (normalizer), not the module's
                continue
            if (cls.__name__, name) in CHECKED_IN_FORWARD:
                continue
            for value, error in bad:
                if id(bad) in DIM_KINDS and error is not TypeError and value != ():
                    continue
                yield pytest.param(cls, fn, name, value, error, id=f"{cls.__name__}-{name}-{value!r}")


# torch's module checks these in forward (its ModuleInfo error input builds the module and expects
# the forward to raise): tests/test_modules.py checks ours raises there
CHECKED_IN_FORWARD = {("CrossEntropyLoss", "label_smoothing")}


def test_every_module_in_losses_is_listed():
    import stablelosses.losses as losses

    found = {c for c in vars(losses).values() if isinstance(c, type) and issubclass(c, losses._Loss)
             and c.__module__ == losses.__name__ and not c.__name__.startswith("_")}
    assert found == set(MODULES)


@pytest.mark.parametrize("cls", list(MODULES), ids=lambda c: c.__name__)
def test_every_constructor_argument_is_checked(cls):
    from test_specs import ARGS

    fn, _, other = MODULES[cls]
    params = set(inspect.signature(cls.__init__).parameters) - {"self"}
    assert params - set(other) <= set(ARGS[fn])


@pytest.mark.parametrize("cls, fn, name, value, error", list(_module_cases()))
def test_module_constructor_raises_the_functions_error(cls, fn, name, value, error):
    from test_specs import CALLS

    with pytest.raises(error) as built:
        cls(*MODULES[cls][1], **{name: value})
    with pytest.raises(error) as called:
        CALLS[fn](**{name: value})
    assert str(built.value).startswith(f"{cls.__name__}: ")
    assert str(built.value).replace(cls.__name__, fn, 1) == str(called.value)


@pytest.mark.parametrize("make", [
    lambda: sl.CrossEntropyLoss(ignore_index=1.5), lambda: sl.CrossEntropyLoss(ignore_index=True),
    lambda: sl.FocalLoss(ignore_index=True), lambda: sl.DiceLoss(dims=()),
    lambda: sl.CrossEntropyLoss(weight=torch.tensor([1, 2, 3])), lambda: sl.DiceLoss(dims=(1, 1)),
], ids=["ce-float", "ce-bool", "focal-bool", "dice-empty-dims", "ce-int-weight", "dice-repeated-dims"])
def test_issue_examples_raise_at_construction(make):
    with pytest.raises((TypeError, ValueError), match=r"^(CrossEntropyLoss|FocalLoss|DiceLoss): "):
        make()


def test_modules_store_the_checked_values():
    ce = sl.CrossEntropyLoss(ignore_index=np.int64(3), reduction=np.str_("sum"), label_smoothing=torch.tensor(0.25))
    assert (type(ce.ignore_index), type(ce.reduction), type(ce.label_smoothing)) == (int, str, float)
    assert repr(ce) == "CrossEntropyLoss(ignore_index=3, reduction='sum', label_smoothing=0.25)"


# ------------------------------------------------------------------------------------------
# The scalar types torch's argument parser takes, and what it refuses (torch 2.13, tried)
# ------------------------------------------------------------------------------------------

X = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
T = torch.tensor([0, 2, 1, 2])


class _Reduction(getattr(enum, "StrEnum", str), enum.Enum):  # 3.11+: enum.StrEnum
    SUM = "sum"


def _accepts(call):
    try:
        call()
    except (TypeError, RuntimeError):  # torch's parser: TypeError (RuntimeError for a bool tensor)
        return False
    return True


# (argument, value, torch's call, ours); each row's torch outcome is asserted, not assumed
_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
PARSER = [
    *[("reduction", v, lambda v: F.cross_entropy(X, T, reduction=v), lambda v: SF.cross_entropy(X, T, reduction=v))
      for v in (_Reduction.SUM, np.str_("sum"))],
    *[("ignore_index", v, lambda v: F.cross_entropy(X, T, ignore_index=v),
       lambda v: SF.cross_entropy(X, T, ignore_index=v))
      for v in (np.int64(1), np.int32(1), np.uint8(1), torch.tensor(1), torch.tensor(1, dtype=torch.uint8),
                True, np.bool_(True), 1.0, np.float64(1), torch.tensor(1.0), torch.tensor(True),
                torch.tensor([1, 2]))],
    *[("label_smoothing", v, lambda v: F.cross_entropy(X, T, label_smoothing=v),
       lambda v: SF.cross_entropy(X, T, label_smoothing=v))
      for v in (np.float32(0.1), np.int64(0), np.bool_(False), True, torch.tensor(0.1), torch.tensor(0),
                torch.tensor([0.1]), torch.tensor(0.1, requires_grad=True), "0.1", 1j)],
    *[("dim", v, lambda v: F.softmax(X, v), lambda v: SF.softmax(X, v))
      for v in (np.int64(1), torch.tensor(1), torch.tensor(1, dtype=torch.uint8), True, np.bool_(True),
                torch.tensor(1.0), torch.tensor(True), torch.tensor([1]), 1.0)],
    *[("dim", v, lambda v: torch.logsumexp(X, v), lambda v: SF.logsumexp(X, v))
      for v in (np.int64(1), torch.tensor(1), [np.int64(1)], (torch.tensor(1),), True)],
    *[("eps", v, lambda v: F.cosine_similarity(X, X, eps=v), lambda v: SF.cosine_similarity(X, X, eps=v))
      for v in (np.float32(1e-3), torch.tensor(1e-3), torch.tensor([1e-3]), torch.tensor(1e-3, requires_grad=True),
                "1e-3")],
    *[("eps", v, lambda v: F.normalize(X, eps=v), lambda v: SF.normalize(X, eps=v))
      for v in (np.float32(1e-3), torch.tensor(1e-3))],
]


@pytest.mark.parametrize("name, value, theirs, ours", PARSER,
                         ids=[f"{r[0]}-{type(r[1]).__name__}-{r[1]!r}" for r in PARSER])
def test_scalar_types_as_torchs_parser(name, value, theirs, ours):
    if name == "dim" and isinstance(value, torch.Tensor) and _TORCH < (2, 13):
        pytest.skip("torch < 2.13's parser refuses a 0-d tensor dim; stablelosses follows the current one's")
    accepted = _accepts(lambda: theirs(value))
    if accepted:
        out = ours(value)
        if name in ("reduction", "ignore_index", "label_smoothing"):
            plain = {"reduction": "sum", "ignore_index": 1}.get(name) or float(value)
            assert torch.equal(out, SF.cross_entropy(X, T, **{name: plain}))
        else:
            assert torch.equal(out, ours(1 if name == "dim" else 1e-3))
    else:
        with pytest.raises((TypeError, RuntimeError), match=name):
            ours(value)


def test_a_str_subclass_message_does_not_contradict_itself():
    class R(getattr(enum, "StrEnum", str), enum.Enum):
        AVG = "avg"

    with pytest.raises(ValueError, match=r"reduction must be 'none', 'mean' or 'sum', got 'avg' \(R\)$"):
        SF.rmse_loss(X, X, reduction=R.AVG)


# ------------------------------------------------------------------------------------------
# An output edited in place: works where torch's twin works (or raises torch's own error)
# ------------------------------------------------------------------------------------------

_Y = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def _plain_focal(x, reduction):
    lp = F.log_softmax(x, 1).gather(1, T[:, None])[:, 0]
    loss = -((1 - lp.exp()) ** 2) * lp
    return loss if reduction == "none" else getattr(loss, reduction)()


def _plain_reduce(loss, reduction):
    return loss if reduction == "none" else getattr(loss, reduction)()


def _gathered(z):
    return torch.log_softmax(z, -1).gather(-1, T[:, None]).squeeze(-1)


def _log_odds(c, r):
    return (c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))


def _forward_kl(s, t):
    return F.kl_div(torch.log_softmax(s, -1), torch.log_softmax(t, -1), log_target=True, reduction="none").sum(-1)


# public function -> (ours, the torch twin or its plain formula), both of (x, reduction)
TWINS = {
    "cross_entropy": (lambda x, r: SF.cross_entropy(x, T, reduction=r), lambda x, r: F.cross_entropy(x, T, reduction=r)),
    "focal_loss": (lambda x, r: SF.focal_loss(x, T, reduction=r), _plain_focal),
    "kl_div": (lambda x, r: SF.kl_div(x, _Y.softmax(1), reduction=r), lambda x, r: F.kl_div(x, _Y.softmax(1), reduction=r)),
    "info_nce_loss": (lambda x, r: SF.info_nce_loss(x, _Y, reduction=r),
                      lambda x, r: F.cross_entropy(F.normalize(x) @ F.normalize(_Y.to(x.dtype)).T / 0.07,
                                                   torch.arange(4), reduction=r)),
    "dice_loss": (lambda x, r: SF.dice_loss(x.sigmoid(), (_Y > 0).double(), reduction=r),
                  lambda x, r: _plain_reduce(1 - 2 * (x.sigmoid() * (_Y > 0)).sum(1)
                                             / (x.sigmoid().sum(1) + (_Y > 0).sum(1)), r)),
    "rmse_loss": (lambda x, r: SF.rmse_loss(x, _Y, reduction=r), lambda x, r: torch.sqrt(F.mse_loss(x, _Y, reduction=r))),
    "log_cosh_loss": (lambda x, r: SF.log_cosh_loss(x, _Y, reduction=r),
                      lambda x, r: _plain_reduce(torch.log(torch.cosh(x - _Y)), r)),
    "sigmoid_focal_loss": (lambda x, r: SF.sigmoid_focal_loss(x, (_Y > 0).double(), reduction=r),
                           lambda x, r: _plain_reduce(F.binary_cross_entropy_with_logits(
                               x, (_Y > 0).double(), reduction="none"), r)),
    "normalize": (lambda x, r: SF.normalize(x), lambda x, r: F.normalize(x)),
    "cosine_similarity": (lambda x, r: SF.cosine_similarity(x, _Y), lambda x, r: F.cosine_similarity(x, _Y)),
    "linear_cross_entropy": (lambda x, r: SF.linear_cross_entropy(x, _Y[:3].to(x.dtype), T, reduction=r),
                             lambda x, r: F.cross_entropy(x @ _Y[:3].to(x.dtype).T, T, reduction=r)),
    "linear_focal_loss": (lambda x, r: SF.linear_focal_loss(x, _Y[:3].to(x.dtype), T, reduction=r),
                          lambda x, r: _plain_focal(x @ _Y[:3].to(x.dtype).T, r)),
    "softmax": (lambda x, r: SF.softmax(x, 1), lambda x, r: torch.softmax(x, 1)),
    "log_softmax": (lambda x, r: SF.log_softmax(x, 1), lambda x, r: torch.log_softmax(x, 1)),
    "logsumexp": (lambda x, r: SF.logsumexp(x, 1), lambda x, r: torch.logsumexp(x, 1)),
    "masked_mean": (lambda x, r: SF.masked_mean(x, _Y > 0), lambda x, r: (x * (_Y > 0)).sum() / (_Y > 0).sum()),
    "entropy": (lambda x, r: SF.entropy(x), lambda x, r: -(x.softmax(1) * x.log_softmax(1)).sum(1)),
    "safe_div": (lambda x, r: SF.safe_div(x, _Y), lambda x, r: x / _Y),
    "safe_sqrt": (lambda x, r: SF.safe_sqrt(x.abs()), lambda x, r: torch.sqrt(x.abs())),
    "xlogy": (lambda x, r: SF.xlogy(x, _Y.abs()), lambda x, r: torch.special.xlogy(x, _Y.abs())),
    "logaddexp": (lambda x, r: SF.logaddexp(x, _Y), lambda x, r: torch.logaddexp(x, _Y)),
    # post-training and distillation (0.4)
    "token_logps": (lambda x, r: SF.token_logps(x, T), lambda x, r: _gathered(x)),
    "sequence_logps": (lambda x, r: SF.sequence_logps(x[None], T[None]), lambda x, r: _gathered(x).sum(-1)),
    "linear_token_logps": (lambda x, r: SF.linear_token_logps(x, _Y[:3].to(x.dtype), T),
                           lambda x, r: _gathered(x @ _Y[:3].to(x.dtype).T)),
    "linear_sequence_logps": (lambda x, r: SF.linear_sequence_logps(x[None], _Y[:3].to(x.dtype), T[None]),
                              lambda x, r: _gathered(x @ _Y[:3].to(x.dtype).T).sum(-1)),
    "dpo_loss": (lambda x, r: SF.dpo_loss(x[:, 0], x[:, 1], _Y[:, 0].to(x.dtype), _Y[:, 1].to(x.dtype), reduction=r),
                 lambda x, r: _plain_reduce(-F.logsigmoid(0.1 * ((x[:, 0] - x[:, 1]) - (_Y[:, 0] - _Y[:, 1]).to(x.dtype))),
                                            r)),
    "orpo_loss": (lambda x, r: SF.orpo_loss(-x[:, 0].abs() - 0.1, -x[:, 1].abs() - 0.1, reduction=r),
                  lambda x, r: _plain_reduce(-0.1 * F.logsigmoid(_log_odds(-x[:, 0].abs() - 0.1, -x[:, 1].abs() - 0.1)),
                                             r)),
    "simpo_loss": (lambda x, r: SF.simpo_loss(x[:, 0], x[:, 1], reduction=r),
                   lambda x, r: _plain_reduce(-F.logsigmoid(2.0 * (x[:, 0] - x[:, 1] - 0.5)), r)),
    "cpo_loss": (lambda x, r: SF.cpo_loss(x[:, 0], x[:, 1], reduction=r),
                 lambda x, r: _plain_reduce(-F.logsigmoid(0.1 * (x[:, 0] - x[:, 1])), r)),
    "kto_loss": (lambda x, r: SF.kto_loss(x[:, 0], _Y[:, 0].to(x.dtype), T > 0, reduction=r),
                 lambda x, r: _plain_reduce(torch.where(T > 0, torch.sigmoid(-0.1 * (x[:, 0] - _Y[:, 0].to(x.dtype))),
                                                        torch.sigmoid(0.1 * (x[:, 0] - _Y[:, 0].to(x.dtype)))), r)),
    "policy_loss": (lambda x, r: SF.policy_loss(x, _Y.to(x.dtype), torch.ones(4, dtype=x.dtype),
                                                torch.ones(4, 3, dtype=torch.bool)),
                    lambda x, r: (-torch.exp(x - _Y.to(x.dtype)).clamp(max=1.2)).mean()),
    "kl_penalty": (lambda x, r: SF.kl_penalty(x, _Y.to(x.dtype)),
                   lambda x, r: torch.expm1(_Y.to(x.dtype) - x) - (_Y.to(x.dtype) - x)),
    "distillation_loss": (lambda x, r: SF.distillation_loss(x, _Y.to(x.dtype), reduction=r),
                          lambda x, r: _plain_reduce(_forward_kl(x, _Y.to(x.dtype)), r)),
    "linear_distillation_loss": (
        lambda x, r: SF.linear_distillation_loss(x, _Y[:3].to(x.dtype), _Y.to(x.dtype), _Y[:3].to(x.dtype), reduction=r),
        lambda x, r: _plain_reduce(_forward_kl(x @ _Y[:3].to(x.dtype).T, _Y.to(x.dtype) @ _Y[:3].to(x.dtype).T), r)),
}


def _edited_backward(f, reduction, dtype):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    x.requires_grad_()
    y = f(x, reduction)
    y.mul_(2)
    try:
        y.sum().backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)  # torch's own error, nothing else
        return "torch's in-place error"
    return "works"


def test_every_public_function_has_a_twin():
    assert set(TWINS) == set(SF.__all__)


def _catalog_args(op, x):
    y = _Y.to(x.dtype)
    sign, t01 = torch.where(y > 0, 1.0, -1.0).to(x.dtype), (y > 0).to(x.dtype)
    return {
        "l1_loss": (x, y), "mse_loss": (x, y), "huber_loss": (x, y), "smooth_l1_loss": (x, y),
        "soft_margin_loss": (x, sign), "multilabel_soft_margin_loss": (x, t01),
        "binary_cross_entropy_with_logits": (x, t01), "poisson_nll_loss": (x, y.abs()),
        "hinge_embedding_loss": (x, sign), "binary_cross_entropy": (x.sigmoid(), t01),
        "nll_loss": (x.log_softmax(1), T), "gaussian_nll_loss": (x, y, y.abs() + 0.1),
        "cosine_embedding_loss": (x, y, sign[:, 0]), "margin_ranking_loss": (x[:, 0], y[:, 0], sign[:, 0]),
        "multi_margin_loss": (x, T), "multilabel_margin_loss": (x, torch.tensor([[0, 2, -1]] * 4)),
        "triplet_margin_loss": (x, y, y.flip(0)), "triplet_margin_with_distance_loss": (x, y, y.flip(0)),
        "ctc_loss": (x.log_softmax(1)[:, None], torch.tensor([[1, 2]]), torch.tensor([4]), torch.tensor([2])),
    }[op]


for _op in ("l1_loss", "mse_loss", "huber_loss", "smooth_l1_loss", "nll_loss", "poisson_nll_loss",
            "gaussian_nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "ctc_loss",
            "cosine_embedding_loss", "hinge_embedding_loss", "margin_ranking_loss", "multi_margin_loss",
            "multilabel_margin_loss", "multilabel_soft_margin_loss", "soft_margin_loss", "triplet_margin_loss",
            "triplet_margin_with_distance_loss"):
    TWINS[_op] = (lambda x, r, op=_op: getattr(SF, op)(*_catalog_args(op, x), reduction=r),
                  lambda x, r, op=_op: getattr(F, op)(*_catalog_args(op, x), reduction=r))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("op", sorted(TWINS))
def test_an_output_edited_in_place_behaves_as_torchs(op, reduction, dtype):
    ours, theirs = TWINS[op]
    got, want = _edited_backward(ours, reduction, dtype), _edited_backward(theirs, reduction, dtype)
    if op == "ctc_loss" and want == "torch's in-place error":
        # ours is torch's value plus the select of the impossible samples' inf: no node saves the
        # output, so the edit works (and scales the gradient, as an edit of any sum would)
        assert got == "works"
        return
    assert got == want


def test_normalize_edited_in_place_gives_the_gradient_of_the_edit():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    for f, v in ((SF.normalize, x), (F.normalize, x2)):
        y = f(v)
        y.mul_(torch.arange(4.0, dtype=torch.float64))
        y.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


# ------------------------------------------------------------------------------------------
# torch's call forms
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_legacy_positional_stacklevel_and_dtype(name):
    ours, theirs = getattr(SF, name), getattr(F, name)
    torch.testing.assert_close(ours(X, 1, 3, torch.float64), theirs(X, 1, 3, torch.float64), rtol=0, atol=0)
    assert ours(X, 1, 3, torch.float64).dtype == torch.float64
    # torch.softmax's own third positional is the dtype
    torch.testing.assert_close(ours(X, 1, torch.float64), getattr(torch, name)(X, 1, torch.float64),
                               rtol=0, atol=0)
    with pytest.raises(TypeError, match=f"{name}: _stacklevel must be an int"):
        ours(X, 1, "3")
    with pytest.raises(TypeError, match=f"{name}: dtype given twice"):
        ours(X, 1, torch.float64, torch.float32)


@pytest.mark.parametrize("legacy", [(None, None, "sum"), (None, None, "batchmean", True), (True, False),
                                    (False, None), (False, True, "none"), (None, True)])
def test_kl_div_legacy_positionals_as_torch(legacy):
    x, t = F.log_softmax(X, 1), F.softmax(X.flip(0), 1)
    if len(legacy) > 3 and legacy[3]:
        t = t.log()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = F.kl_div(x, t, *legacy)
        got = SF.kl_div(x, t, *legacy)
    torch.testing.assert_close(got, expected)


def test_kl_div_legacy_positionals_refused_where_ambiguous():
    x, t = F.log_softmax(X, 1), F.softmax(X, 1)
    with pytest.raises(ValueError, match="kl_div: reduction must be"):
        SF.kl_div(x, t, None)  # torch's size_average=None, or a reduction of None: say which
    with pytest.raises(TypeError, match="kl_div: size_average or reduce given twice"):
        SF.kl_div(x, t, None, None, "sum", size_average=False)
    with pytest.raises(TypeError, match="kl_div: takes at most 4 positional"):
        SF.kl_div(x, t, "sum", False, "mean")


@pytest.mark.parametrize("op, ours, theirs", [
    ("logsumexp", lambda out: SF.logsumexp(X, 1, out=out), lambda out: torch.logsumexp(X, 1, out=out)),
    ("logaddexp", lambda out: SF.logaddexp(X, X.flip(0), out=out), lambda out: torch.logaddexp(X, X.flip(0), out=out)),
    ("normalize", lambda out: SF.normalize(X, out=out), lambda out: F.normalize(X, out=out)),
])
def test_out_as_torch(op, ours, theirs):
    for shape in ((4,), (4, 3), (0,)):
        a, b = torch.full(shape, 7.0), torch.full(shape, 7.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns when it resizes a non-empty out
            assert ours(a) is a and theirs(b) is b
        torch.testing.assert_close(a, b)
    with pytest.raises(RuntimeError, match="result type Float can't be cast"):
        ours(torch.empty(0, dtype=torch.long))
    xg = X.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=f"{op}\\(\\): functions with out=... arguments don't support automatic"):
        {"logsumexp": lambda: SF.logsumexp(xg, 1, out=torch.empty(4)),
         "logaddexp": lambda: SF.logaddexp(xg, X, out=torch.empty(4, 3)),
         "normalize": lambda: SF.normalize(xg, out=torch.empty(4, 3))}[op]()
    with torch.no_grad():
        assert torch.isfinite({"logsumexp": lambda: SF.logsumexp(xg, 1, out=torch.empty(4)),
                               "logaddexp": lambda: SF.logaddexp(xg, X, out=torch.empty(4, 3)),
                               "normalize": lambda: SF.normalize(xg, out=torch.empty(4, 3))}[op]()).all()


def test_safe_div_rounding_mode_refused_with_the_reason():
    assert torch.equal(SF.safe_div(X, X.flip(0), rounding_mode=None), SF.safe_div(X, X.flip(0)))
    for mode in ("floor", "trunc"):
        with pytest.raises(NotImplementedError, match="safe_div: rounding_mode=.* gradient 0 everywhere"):
            SF.safe_div(X, X, rounding_mode=mode)


@pytest.mark.slow
@pytest.mark.parametrize("call", [
    lambda x: SF.log_softmax(x, 1, 3, torch.float64),
    lambda x: SF.kl_div(x.log_softmax(1), x.detach().flip(0).softmax(1), None, None, "sum"),
    lambda x: SF.cross_entropy(x, T, reduction=_Reduction.SUM),
    lambda x: SF.normalize(x) * 2,
    lambda x: SF.safe_div(x, x.detach() + 1),
], ids=["log_softmax-legacy", "kl_div-legacy", "str-subclass-reduction", "normalize-copy", "safe_div-copy"])
def test_call_forms_compile_fullgraph(call):
    x = X.clone().requires_grad_()
    torch._dynamo.reset()
    got = torch.compile(call, fullgraph=True)(x)
    torch.testing.assert_close(got, call(x))


_INT = torch.arange(6).view(2, 3)
_DTYPE_CALLS = {
    "softmax": (lambda: SF.softmax(_INT, 1), lambda: torch.softmax(_INT, 1)),
    "log_softmax": (lambda: SF.log_softmax(_INT, 1), lambda: torch.log_softmax(_INT, 1)),
    "cross_entropy weight": (
        lambda: SF.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), torch.ones(3, dtype=torch.long)),
        lambda: F.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), torch.ones(3, dtype=torch.long)),
    ),
    "focal_loss input": (lambda: SF.focal_loss(_INT, torch.tensor([0, 1])),
                         lambda: F.cross_entropy(_INT, torch.tensor([0, 1]))),
}


@pytest.mark.parametrize("name", list(_DTYPE_CALLS))
def test_an_integer_tensor_is_a_type_error_naming_it_and_torchs_runtime_error(name):
    """torch raises RuntimeError ("... not implemented for 'Long'"); ours names the argument and
    is both a TypeError (the library's rule) and that RuntimeError (torch's type)."""
    ours, theirs = _DTYPE_CALLS[name]
    with pytest.raises(RuntimeError):
        theirs()
    with pytest.raises(RuntimeError, match="must be a floating-point tensor") as info:
        ours()
    assert isinstance(info.value, TypeError)


_P = torch.softmax(torch.randn(3, 4), 1)
_LEGACY_CALLS = {
    "cross_entropy size_average": lambda z: SF.cross_entropy(z, t4, size_average=False),
    "kl_div reduce": lambda z: SF.kl_div(z.log_softmax(1), _P, reduce=False).sum(),
    "kl_div elementwise_mean": lambda z: SF.kl_div(z.log_softmax(1), _P, reduction="elementwise_mean"),
    "mse_loss reduce": lambda z: SF.mse_loss(z, _P, reduce=False).sum(),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_LEGACY_CALLS))
def test_deprecated_reduction_arguments_compile_fullgraph(name):
    """torch's deprecation warning is eager only: Dynamo cannot trace warnings.warn, and
    fullgraph=True raised Unsupported where torch's own call with the same arguments compiles."""
    call = _LEGACY_CALLS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = call(x4)
        got = torch.compile(call, fullgraph=True)(x4)
    torch.testing.assert_close(got, want)
