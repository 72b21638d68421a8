"""Generated from the op specs (``stablelosses/_spec.py``): every public function has one, and
for every argument it lists, each allowed sample value is accepted and each refused one raises
the listed error with a message naming the function and the argument. A new argument is one
``Arg`` line in its op's spec, and it gets these tests."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import stablelosses.functional as SF
from stablelosses._spec import SPECS, Dim

_G = torch.Generator().manual_seed(0)
X = torch.randn(4, 3, generator=_G)
Y = torch.randn(4, 3, generator=_G)
T = torch.tensor([0, 2, 1, 2])
H = torch.randn(4, 5, generator=_G)
W = torch.randn(3, 5, generator=_G)
MASK = torch.tensor([[True, False, True]] * 4)

# op -> a valid call with the keyword arguments under test
CALLS = {
    "cross_entropy": lambda **kw: SF.cross_entropy(X, T, **kw),
    "focal_loss": lambda **kw: SF.focal_loss(X, T, **kw),
    "kl_div": lambda **kw: SF.kl_div(F.log_softmax(X, 1), F.softmax(Y, 1), **kw),
    "info_nce_loss": lambda **kw: SF.info_nce_loss(X, Y, **kw),
    "dice_loss": lambda **kw: SF.dice_loss(torch.sigmoid(X), (Y > 0).float(), **kw),
    "rmse_loss": lambda **kw: SF.rmse_loss(X, Y, **kw),
    "log_cosh_loss": lambda **kw: SF.log_cosh_loss(X, Y, **kw),
    "sigmoid_focal_loss": lambda **kw: SF.sigmoid_focal_loss(X, (Y > 0).float(), **kw),
    "normalize": lambda **kw: SF.normalize(X, **kw),
    "cosine_similarity": lambda **kw: SF.cosine_similarity(X, Y, **kw),
    "linear_cross_entropy": lambda **kw: SF.linear_cross_entropy(H, W, T, **kw),
    "linear_focal_loss": lambda **kw: SF.linear_focal_loss(H, W, T, **kw),
    "softmax": lambda **kw: SF.softmax(X, **{"dim": 1, **kw}),
    "log_softmax": lambda **kw: SF.log_softmax(X, **{"dim": 1, **kw}),
    "logsumexp": lambda **kw: SF.logsumexp(X, **{"dim": 1, **kw}),
    "masked_mean": lambda **kw: SF.masked_mean(X, MASK, **kw),
    "entropy": lambda **kw: SF.entropy(X, **kw),
    "safe_div": lambda **kw: SF.safe_div(X, Y, **kw),
    "safe_sqrt": lambda **kw: SF.safe_sqrt(X.abs(), **kw),
    "xlogy": lambda **kw: SF.xlogy(X, Y.abs(), **kw),
    "logaddexp": lambda **kw: SF.logaddexp(X, Y, **kw),
    # every torch.nn loss (0.4)
    "l1_loss": lambda **kw: SF.l1_loss(X, Y, **kw),
    "mse_loss": lambda **kw: SF.mse_loss(X, Y, **kw),
    "huber_loss": lambda **kw: SF.huber_loss(X, Y, **kw),
    "smooth_l1_loss": lambda **kw: SF.smooth_l1_loss(X, Y, **kw),
    "nll_loss": lambda **kw: SF.nll_loss(F.log_softmax(X, 1), T, **kw),
    "poisson_nll_loss": lambda **kw: SF.poisson_nll_loss(X, Y.abs(), **kw),
    "gaussian_nll_loss": lambda **kw: SF.gaussian_nll_loss(X, Y, Y.abs(), **kw),
    "binary_cross_entropy": lambda **kw: SF.binary_cross_entropy(torch.sigmoid(X), (Y > 0).float(), **kw),
    "binary_cross_entropy_with_logits": lambda **kw: SF.binary_cross_entropy_with_logits(X, (Y > 0).float(), **kw),
    "ctc_loss": lambda **kw: SF.ctc_loss(torch.log_softmax(torch.randn(6, 2, 4, generator=_G), 2),
                                         torch.tensor([[1, 2], [3, 3]]), torch.tensor([6, 6]),
                                         torch.tensor([2, 2]), **kw),
    "cosine_embedding_loss": lambda **kw: SF.cosine_embedding_loss(X, Y, torch.tensor([1.0, -1.0, 1.0, -1.0]), **kw),
    "hinge_embedding_loss": lambda **kw: SF.hinge_embedding_loss(X, Y.sign(), **kw),
    "margin_ranking_loss": lambda **kw: SF.margin_ranking_loss(X, Y, Y.sign(), **kw),
    "multi_margin_loss": lambda **kw: SF.multi_margin_loss(X, T, **kw),
    "multilabel_margin_loss": lambda **kw: SF.multilabel_margin_loss(X, torch.tensor([[0, 2, -1]] * 4), **kw),
    "multilabel_soft_margin_loss": lambda **kw: SF.multilabel_soft_margin_loss(X, (Y > 0).float(), **kw),
    "soft_margin_loss": lambda **kw: SF.soft_margin_loss(X, Y.sign(), **kw),
    "triplet_margin_loss": lambda **kw: SF.triplet_margin_loss(X, Y, X + Y, **kw),
    "triplet_margin_with_distance_loss": lambda **kw: SF.triplet_margin_with_distance_loss(X, Y, X + Y, **kw),
}

CASES = [(op, a.name) for op, spec in sorted(SPECS.items()) for a in spec.args]


def test_every_public_function_has_a_spec_and_a_call():
    assert set(SPECS) == set(SF.__all__) == set(CALLS)


@pytest.mark.parametrize("op", sorted(SPECS))
def test_a_spec_lists_every_parameter_of_its_function(op):
    spec = SPECS[op]
    params = set(inspect.signature(getattr(SF, op)).parameters)
    listed = {a.name for a in spec.args} | set(spec.tensors) | set(spec.elsewhere)
    assert listed == params
    assert spec.replaces and spec.reference


@pytest.mark.parametrize("op, name", CASES)
def test_allowed_values_pass(op, name):
    for value in SPECS[op].arg(name).kind.good:
        out = CALLS[op](**{name: value})
        assert isinstance(out, torch.Tensor)


@pytest.mark.parametrize("op, name", CASES)
def test_refused_values_raise_naming_the_function_and_the_argument(op, name):
    kind = SPECS[op].arg(name).kind
    assert kind.bad, "every argument has a refused sample"
    for value, error in kind.bad:
        with pytest.raises(error) as info:
            CALLS[op](**{name: value})
        if not isinstance(kind, Dim):  # dimension errors are wrap_dim's, in torch's words
            assert f"{op}: " in str(info.value) and name in str(info.value), (value, str(info.value))


def test_one_argument_gives_one_message_everywhere():
    # an argument kind refuses a value with the same words in every op that takes it
    messages: dict[tuple[str, str, int], set[str]] = {}
    for op, name in CASES:
        kind = SPECS[op].arg(name).kind
        for value, error in kind.bad:
            try:
                CALLS[op](**{name: value})
            except error as e:
                messages.setdefault((name, repr(value), id(kind)), set()).add(str(e).replace(f"{op}: ", "", 1))
    drift = {k: v for k, v in messages.items() if len(v) > 1}
    assert not drift


def test_ignore_index_true_is_refused_by_every_op_that_takes_it():
    # a bool is an int in Python: True would silently ignore class 1; torch raises TypeError
    for op in ("cross_entropy", "focal_loss", "linear_cross_entropy", "linear_focal_loss"):
        with pytest.raises(TypeError, match=f"{op}: ignore_index must be an int"):
            CALLS[op](ignore_index=True)
    with pytest.raises(TypeError):
        F.cross_entropy(X, T, ignore_index=True)
