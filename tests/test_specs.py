"""The argument checks of every public function (``stablelosses/_spec.py``): for every
Python-level argument, each allowed sample is accepted and each refused one raises the listed
error with a message naming the function and the argument. The samples live here, one table
per kind of argument; a new argument is one line in ``ARGS``."""

from __future__ import annotations

import enum
import inspect

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import stablelosses.functional as SF

_G = torch.Generator().manual_seed(0)
X = torch.randn(4, 3, generator=_G)
Y = torch.randn(4, 3, generator=_G)
T = torch.tensor([0, 2, 1, 2])
H = torch.randn(4, 5, generator=_G)
W = torch.randn(3, 5, generator=_G)
MASK = torch.tensor([[True, False, True]] * 4)
INF, NAN = float("inf"), float("nan")


class Reduction(getattr(enum, "StrEnum", str), enum.Enum):  # a typed config's reduction (3.11+: StrEnum)
    SUM = "sum"
    AVG = "avg"


def _first(out):
    return out[0] if isinstance(out, tuple) else out


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
    # post-training (0.4)
    "token_logps": lambda **kw: SF.token_logps(X, T.clamp(max=2), **kw),
    "sequence_logps": lambda **kw: SF.sequence_logps(X[None], T[None].clamp(max=2), **kw),
    # (the log-probs of return_entropy's pair)
    "linear_token_logps": lambda **kw: _first(SF.linear_token_logps(H, W, T.clamp(max=2), **kw)),
    "linear_sequence_logps": lambda **kw: SF.linear_sequence_logps(H[None], W, T[None].clamp(max=2), **kw),
    "dpo_loss": lambda **kw: SF.dpo_loss(-X[:, 0].abs(), -X[:, 1].abs(), -Y[:, 0].abs(), -Y[:, 1].abs(), **kw),
    "orpo_loss": lambda **kw: SF.orpo_loss(-X[:, 0].abs(), -X[:, 1].abs(), **kw),
    "simpo_loss": lambda **kw: SF.simpo_loss(X[:, 0], X[:, 1], **kw),
    "cpo_loss": lambda **kw: SF.cpo_loss(X[:, 0], X[:, 1], **kw),
    "kto_loss": lambda **kw: SF.kto_loss(X[:, 0], X[:, 1], MASK[:, 0] & (T > 0), **kw),
    "policy_loss": lambda **kw: SF.policy_loss(X, Y, X[:, 0], MASK, ref_logps=Y, **kw),
    "kl_penalty": lambda **kw: SF.kl_penalty(X, Y, **kw),
    "distillation_loss": lambda **kw: SF.distillation_loss(X, Y, **kw),
    "linear_distillation_loss": lambda **kw: SF.linear_distillation_loss(H, W, H, W, **kw),
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

# ------------------------------------------------------------ the samples, one per kind
# (allowed values, (refused value, the error it raises) pairs)
REDUCTION = (("none", "mean", "sum", Reduction.SUM, np.str_("sum")),
             (("avg", ValueError), (None, ValueError), (1, ValueError), (Reduction.AVG, ValueError)))
KL_REDUCTION = (("none", "batchmean", "mean", "sum", np.str_("batchmean")), REDUCTION[1])
FLAG = ((True, False), ((1, TypeError), ("yes", TypeError), (None, TypeError), (np.bool_(True), TypeError),
                        (torch.tensor(True), TypeError)))
# torch's int arguments: an int, a NumPy integer, a 0-d integer tensor; never a bool
IGNORE_INDEX = ((0, 5, -100, np.int64(1), np.int32(-100), torch.tensor(1), torch.tensor(1, dtype=torch.uint8)),
                ((True, TypeError), (False, TypeError), (1.0, TypeError), ("1", TypeError),
                 (np.bool_(True), TypeError), (np.float64(1), TypeError), (torch.tensor(1.0), TypeError),
                 (torch.tensor(True), TypeError), (torch.tensor([1, 2]), TypeError)))
LINEAR_IGNORE_INDEX = ((None, 0, 5, -100),
                       ((True, TypeError), (False, TypeError), (1.0, TypeError), ("1", TypeError)))
# a dimension of a 2-d input
DIM = ((0, 1, -1, np.int64(1), torch.tensor(1)),
       ((2, IndexError), (-3, IndexError), (1.0, TypeError), (True, TypeError), (np.bool_(True), TypeError),
        (torch.tensor(1.0), TypeError), (torch.tensor(True), TypeError)))
DIMS = ((*DIM[0], (0, 1), [1], [np.int64(0)], ()), (*DIM[1], ((1, -1), ValueError)))
NONEMPTY_DIMS = (DIMS[0][:-1], (*DIMS[1], ((), ValueError)))
OPTIONAL_DIMS = ((None, *DIMS[0]), DIMS[1])
OPTIONAL_NONEMPTY_DIMS = ((None, *NONEMPTY_DIMS[0]), NONEMPTY_DIMS[1])
# torch's float arguments: a number, a NumPy number, a 0-d tensor that does not require grad
EPS = ((0.0, 0, 0.5, 1e30, INF, np.float32(0.5), np.int64(0), torch.tensor(1e-3), torch.tensor(0)),
       ((-1, ValueError), (-0.1, ValueError), (NAN, ValueError), ("0", TypeError), (True, TypeError),
        (None, TypeError), (torch.tensor([1e-3]), TypeError), (torch.tensor(1e-3, requires_grad=True), TypeError),
        (torch.tensor(-1.0), ValueError)))
FINITE_NONNEGATIVE = ((0.0, 0, 0.5, 2, 1e30, np.float64(2)),
                      ((-1, ValueError), (-1.0, ValueError), (NAN, ValueError), (INF, ValueError),
                       (1e309, ValueError), ("2", TypeError), (True, TypeError), (None, TypeError),
                       (torch.tensor(2.0), TypeError)))
LABEL_SMOOTHING = ((0.0, 0, 0.1, 1.0, 1, True, np.float32(0.1), np.bool_(False), torch.tensor(0.1),
                    torch.tensor(0)),
                   ((-0.1, RuntimeError), (1.5, RuntimeError), (NAN, RuntimeError), ("0.1", TypeError),
                    (None, TypeError), (torch.tensor([0.1]), TypeError),
                    (torch.tensor(0.1, requires_grad=True), TypeError), (torch.tensor(1.5), RuntimeError)))
FLOAT_DTYPE = ((None, torch.float32, torch.float64, torch.float16),
               ((torch.int64, TypeError), ("float32", TypeError), (float, TypeError)))
FILL = ((0.0, 1, -2.5, INF, NAN), (("0", TypeError), (True, TypeError), (None, TypeError)))
TEMPERATURE = ((0.07, 1, 2.5, torch.tensor(0.5)),
               ((0, ValueError), (-1.0, ValueError), (INF, ValueError), (NAN, ValueError), ("0.1", TypeError),
                (True, TypeError), (None, TypeError), (torch.ones(2), ValueError), (torch.tensor(-1.0), ValueError)))
ALPHA = ((0.25, 0, 1.0, -1), ((1.5, ValueError), (-0.5, ValueError), (NAN, ValueError), ("0.25", TypeError),
                              (True, TypeError), (None, TypeError)))
P_NORM = ((2.0, 1, 0.5, INF, torch.tensor(2.0)),
          ((NAN, ValueError), ("2", TypeError), (True, TypeError), (None, TypeError)))
Z_LOSS = ((0.0, 0, 1e-4, 1), ((-1e-4, ValueError), (INF, ValueError), (NAN, ValueError), ("0", TypeError),
                              (True, TypeError), (None, TypeError)))
SOFTCAP = ((None, 30.0, 1, 1e38), ((0, ValueError), (-1.0, ValueError), (INF, ValueError), (NAN, ValueError),
                                   ("30", TypeError), (True, TypeError)))
CHUNK_SIZE = ((None, 1, 7, 4096), ((0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError)))
TORCHVISION_REDUCTION = (REDUCTION[0], tuple(list(REDUCTION[1])))  # its own message prefix
# the torch.nn losses' replacements: torch's words appended ("avg is not a valid value for
# reduction"; gaussian_nll and multilabel_soft_margin: "avg is not valid"), which torch's tests match
TORCH_REDUCTION = (REDUCTION[0], tuple(list(REDUCTION[1])))
TORCH_REDUCTION_NOT_VALID = (REDUCTION[0], tuple(list(REDUCTION[1])))
# post-training and distillation (0.4)
BETA = ((0.1, 0, 2.0), ((-0.1, ValueError), (NAN, ValueError), (INF, ValueError), ("0.1", TypeError),
                        (True, TypeError), (None, TypeError)))
PROBABILITY = ((0.0, 0, 0.1, 1.0), ((-0.1, ValueError), (1.5, ValueError), (NAN, ValueError), ("0.1", TypeError),
                                    (True, TypeError), (None, TypeError)))
FINITE_REAL = ((0.5, 0, -1.0), (("0.5", TypeError), (True, TypeError), (None, TypeError), (NAN, ValueError),
                                 (INF, ValueError), (-INF, ValueError)))
FLOAT_TEMPERATURE = ((0.05, 1, 2.5), ((0, ValueError), (-1.0, ValueError), (INF, ValueError), (NAN, ValueError),
                                      ("0.1", TypeError), (True, TypeError), (None, TypeError),
                                      (torch.tensor([0.5, 1.0]), TypeError)))
NORMALIZER = ((None, 4, 0, 1024.0, torch.tensor(3.0), torch.tensor(0)),
              ((-1, ValueError), (INF, ValueError), (NAN, ValueError), ("4", TypeError), (True, TypeError),
               (torch.ones(2), ValueError)))


def _choice(*values):
    return values, (("nope", ValueError), (None, ValueError), (1, ValueError))


_LINEAR = {"ignore_index": LINEAR_IGNORE_INDEX, "reduction": REDUCTION, "z_loss": Z_LOSS, "softcap": SOFTCAP,
           "chunk_size": CHUNK_SIZE}

# op -> its Python-level arguments and their samples; the tensors; the parameters checked
# elsewhere (torch's deprecated size_average/reduce, torch's legacy positionals, out=)
ARGS: dict[str, dict[str, tuple]] = {
    "cross_entropy": {"reduction": TORCH_REDUCTION, "label_smoothing": LABEL_SMOOTHING, "ignore_index": IGNORE_INDEX},
    "focal_loss": {"reduction": REDUCTION, "gamma": FINITE_NONNEGATIVE, "ignore_index": IGNORE_INDEX},
    "kl_div": {"reduction": KL_REDUCTION, "log_target": FLAG},
    "info_nce_loss": {"temperature": TEMPERATURE, "reduction": REDUCTION, "symmetric": FLAG},
    "dice_loss": {"dims": OPTIONAL_NONEMPTY_DIMS, "reduction": REDUCTION, "smooth": FINITE_NONNEGATIVE},
    "rmse_loss": {"reduction": REDUCTION, "eps": EPS},
    "log_cosh_loss": {"reduction": REDUCTION},
    "sigmoid_focal_loss": {"reduction": TORCHVISION_REDUCTION, "alpha": ALPHA, "gamma": FINITE_NONNEGATIVE},
    "normalize": {"p": P_NORM, "dim": DIM, "eps": EPS},
    "cosine_similarity": {"dim": DIM, "eps": EPS},
    "linear_cross_entropy": {**_LINEAR, "label_smoothing": LABEL_SMOOTHING},
    "linear_focal_loss": {**_LINEAR, "gamma": FINITE_NONNEGATIVE},
    "softmax": {"dim": DIM, "dtype": FLOAT_DTYPE},
    "log_softmax": {"dim": DIM, "dtype": FLOAT_DTYPE},
    "logsumexp": {"dim": NONEMPTY_DIMS, "keepdim": FLAG},
    "masked_mean": {"dim": OPTIONAL_DIMS, "keepdim": FLAG},
    "entropy": {"dim": DIM},
    "safe_div": {"fill": FILL},
    "safe_sqrt": {},
    "xlogy": {},
    "logaddexp": {},
    "token_logps": {"ignore_index": IGNORE_INDEX, "temperature": TEMPERATURE},
    "sequence_logps": {"ignore_index": IGNORE_INDEX, "average": FLAG, "temperature": TEMPERATURE},
    "linear_token_logps": {"ignore_index": IGNORE_INDEX, "temperature": FLOAT_TEMPERATURE,
                           "chunk_size": CHUNK_SIZE, "return_entropy": FLAG},
    "linear_sequence_logps": {"ignore_index": IGNORE_INDEX, "average": FLAG, "temperature": FLOAT_TEMPERATURE,
                              "chunk_size": CHUNK_SIZE},
    "dpo_loss": {"beta": BETA, "loss_type": _choice("sigmoid", "robust", "hinge", "ipo", "apo_zero", "apo_down"),
                 "label_smoothing": PROBABILITY, "reduction": REDUCTION},
    "orpo_loss": {"beta": BETA, "reduction": REDUCTION},
    "simpo_loss": {"beta": BETA, "gamma_beta_ratio": FINITE_REAL, "label_smoothing": PROBABILITY,
                   "reduction": REDUCTION},
    "cpo_loss": {"beta": BETA, "label_smoothing": PROBABILITY, "reduction": REDUCTION},
    "kto_loss": {"beta": BETA, "desirable_weight": BETA, "undesirable_weight": BETA, "reduction": REDUCTION},
    "policy_loss": {
        "clip_eps": ((0.2, 0, 0.5), ((-0.1, ValueError), (1.0, ValueError), (NAN, ValueError), ("0.2", TypeError),
                                     (True, TypeError), (None, TypeError))),
        "clip_eps_high": ((None, 0.28, 0), ((-0.1, ValueError), (INF, ValueError), (NAN, ValueError),
                                            ("0.28", TypeError), (True, TypeError))),
        "importance": _choice("token", "sequence"), "loss_type": _choice("grpo", "bnpo", "dr_grpo", "dapo"),
        "beta": BETA, "kl_estimator": _choice("k1", "k2", "k3"), "normalizer": NORMALIZER,
    },
    "kl_penalty": {"estimator": _choice("k1", "k2", "k3")},
    "distillation_loss": {"kind": _choice("forward_kl", "reverse_kl", "jsd", "tvd"), "beta": PROBABILITY,
                          "temperature": FLOAT_TEMPERATURE, "reduction": REDUCTION, "normalizer": NORMALIZER},
    "linear_distillation_loss": {"kind": _choice("forward_kl", "reverse_kl", "jsd", "tvd"), "beta": PROBABILITY,
                                 "temperature": FLOAT_TEMPERATURE, "reduction": REDUCTION,
                                 "normalizer": NORMALIZER, "chunk_size": CHUNK_SIZE},
}
_CLASS_TENSORS = ("input", "target", "weight", "mask")
_LINEAR_TENSORS = ("input", "linear_weight", "target", "linear_bias", "weight", "mask")
TENSORS = {
    "cross_entropy": _CLASS_TENSORS, "focal_loss": _CLASS_TENSORS, "kl_div": ("input", "target", "mask"),
    "info_nce_loss": ("query", "key", "mask"), "dice_loss": ("input", "target", "mask"),
    "rmse_loss": ("input", "target", "mask"), "log_cosh_loss": ("input", "target", "mask"),
    "sigmoid_focal_loss": ("input", "target", "mask"), "normalize": ("input",),
    "cosine_similarity": ("x1", "x2"), "linear_cross_entropy": _LINEAR_TENSORS,
    "linear_focal_loss": _LINEAR_TENSORS, "softmax": ("input", "mask"), "log_softmax": ("input", "mask"),
    "logsumexp": ("input",), "masked_mean": ("input", "mask"), "entropy": ("logits", "mask"),
    "safe_div": ("input", "other"), "safe_sqrt": ("input",), "xlogy": ("input", "other"),
    "logaddexp": ("input", "other"),
    "token_logps": ("logits", "labels"), "sequence_logps": ("logits", "labels"),
    "linear_token_logps": ("input", "linear_weight", "labels", "linear_bias"),
    "linear_sequence_logps": ("input", "linear_weight", "labels", "linear_bias"),
    "dpo_loss": ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps"),
    "orpo_loss": ("chosen_logps", "rejected_logps"), "simpo_loss": ("chosen_logps", "rejected_logps"),
    "cpo_loss": ("chosen_logps", "rejected_logps"), "kto_loss": ("policy_logps", "ref_logps", "desirable"),
    "policy_loss": ("logps", "old_logps", "advantages", "mask", "ref_logps"),
    "kl_penalty": ("logps", "ref_logps"),
    "distillation_loss": ("student_logits", "teacher_logits", "mask"),
    "linear_distillation_loss": ("student_input", "student_weight", "teacher_input", "teacher_weight",
                                 "student_bias", "teacher_bias", "mask"),
}
ELSEWHERE = {
    "kto_loss": ("kl",),  # a number or a tensor, used as given (tested in test_preference.py)
    "focal_loss": ("normalizer",),  # tested in test_normalizer.py, as cross_entropy's
    "cross_entropy": ("size_average", "reduce", "normalizer"),
    "kl_div": ("size_average", "reduce", "legacy"),
    "linear_cross_entropy": ("options", "process_group", "vocab_start", "normalizer"),
    "linear_focal_loss": ("options", "process_group", "vocab_start", "normalizer"),
    "softmax": ("_stacklevel",), "log_softmax": ("_stacklevel",),
    "logsumexp": ("out",), "logaddexp": ("out",), "normalize": ("out",), "safe_div": ("rounding_mode",),
}
# every torch.nn loss (0.4): the wrapper checks reduction (and zero_infinity, ignore_index); the
# tensors are torch's; every other parameter is checked by torch's own function, as given
_CATALOG = ("l1_loss", "mse_loss", "huber_loss", "smooth_l1_loss", "nll_loss", "poisson_nll_loss",
            "gaussian_nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "ctc_loss",
            "cosine_embedding_loss", "hinge_embedding_loss", "margin_ranking_loss", "multi_margin_loss",
            "multilabel_margin_loss", "multilabel_soft_margin_loss", "soft_margin_loss", "triplet_margin_loss",
            "triplet_margin_with_distance_loss")
_CATALOG_TENSORS = {"input", "target", "weight", "pos_weight", "var", "input1", "input2", "x1", "x2",
                    "anchor", "positive", "negative", "log_probs", "targets", "input_lengths",
                    "target_lengths"}
for _op in _CATALOG:
    _params = list(inspect.signature(getattr(SF, _op)).parameters)
    ARGS[_op] = {"reduction": TORCH_REDUCTION_NOT_VALID if _op in ("gaussian_nll_loss", "multilabel_soft_margin_loss")
                 else TORCH_REDUCTION}
    if _op == "ctc_loss":
        ARGS[_op]["zero_infinity"] = FLAG
    if _op == "nll_loss":
        ARGS[_op]["ignore_index"] = IGNORE_INDEX
    TENSORS[_op] = tuple(n for n in _params if n in _CATALOG_TENSORS)
    ELSEWHERE[_op] = tuple(n for n in _params if n not in _CATALOG_TENSORS and n not in ARGS[_op])
DIM_KINDS = {id(k[1]) for k in (DIM, DIMS, NONEMPTY_DIMS, OPTIONAL_DIMS, OPTIONAL_NONEMPTY_DIMS)}
CASES = [(op, name) for op, args in sorted(ARGS.items()) for name in args]


def test_every_public_function_has_its_arguments_listed_and_a_call():
    assert set(ARGS) == set(SF.__all__) == set(CALLS) == set(TENSORS)


@pytest.mark.parametrize("op", sorted(ARGS))
def test_the_table_lists_every_parameter_of_its_function(op):
    params = set(inspect.signature(getattr(SF, op)).parameters)
    assert set(ARGS[op]) | set(TENSORS[op]) | set(ELSEWHERE.get(op, ())) == params


@pytest.mark.parametrize("op, name", CASES)
def test_allowed_values_pass(op, name):
    for value in ARGS[op][name][0]:
        out = CALLS[op](**{name: value})
        assert isinstance(out, torch.Tensor), value


@pytest.mark.parametrize("op, name", CASES)
def test_refused_values_raise_naming_the_function_and_the_argument(op, name):
    good, bad = ARGS[op][name]
    assert bad, "every argument has a refused sample"
    for value, error in bad:
        with pytest.raises(error) as info:
            CALLS[op](**{name: value})
        if id(bad) not in DIM_KINDS:  # dimension range errors are wrap_dim's, in torch's words
            assert f"{op}: " in str(info.value) and name in str(info.value), (value, str(info.value))


def test_one_argument_gives_one_message_everywhere():
    # an argument kind refuses a value with the same words in every op that takes it
    messages: dict[tuple[str, str, int], set[str]] = {}
    for op, name in CASES:
        for value, error in ARGS[op][name][1]:
            try:
                CALLS[op](**{name: value})
            except error as e:
                messages.setdefault((name, f"{value!r} {type(value)}", id(ARGS[op][name])), set()).add(
                    str(e).replace(f"{op}: ", "", 1))
    drift = {k: v for k, v in messages.items() if len(v) > 1}
    assert not drift


def test_ignore_index_true_is_refused_by_every_op_that_takes_it():
    # a bool is an int in Python: True would silently ignore class 1; torch raises TypeError
    for op in ("cross_entropy", "focal_loss", "linear_cross_entropy", "linear_focal_loss"):
        with pytest.raises(TypeError, match=f"{op}: ignore_index must be an int"):
            CALLS[op](ignore_index=True)
    with pytest.raises(TypeError):
        F.cross_entropy(X, T, ignore_index=True)
