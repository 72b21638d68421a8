"""Functional API: the stable ops and the losses.

``import stablelosses.functional as SF`` gives every function; the module classes that wrap
the losses live in `stablelosses.losses` (and at the top level).
"""

from stablelosses.functional._cross_entropy import cross_entropy
from stablelosses.functional._dice import dice_loss
from stablelosses.functional._div import safe_div
from stablelosses.functional._focal import focal_loss
from stablelosses.functional._info_nce import info_nce_loss
from stablelosses.functional._kl_div import kl_div
from stablelosses.functional._linear import linear_cross_entropy, linear_focal_loss
from stablelosses.functional._log_cosh import log_cosh_loss
from stablelosses.functional._logaddexp import logaddexp
from stablelosses.functional._masked import entropy, masked_mean
from stablelosses.functional._rmse import rmse_loss
from stablelosses.functional._sigmoid_focal import sigmoid_focal_loss
from stablelosses.functional._softmax import log_softmax, logsumexp, softmax
from stablelosses.functional._sqrt import safe_sqrt
from stablelosses.functional._vector import cosine_similarity, normalize
from stablelosses.functional._xlogy import xlogy

# isort: split
# post-training (0.4): token log-probs, preference and policy losses
from stablelosses.functional._distillation import distillation_loss, linear_distillation_loss
from stablelosses.functional._policy import kl_penalty, policy_loss
from stablelosses.functional._preference import cpo_loss, dpo_loss, kto_loss, orpo_loss, simpo_loss
from stablelosses.functional._token_logps import (
    linear_sequence_logps,
    linear_token_logps,
    sequence_logps,
    token_logps,
)

__all__ = [
    "safe_sqrt",
    "safe_div",
    "logsumexp",
    "softmax",
    "log_softmax",
    "xlogy",
    "rmse_loss",
    "cross_entropy",
    "focal_loss",
    "sigmoid_focal_loss",
    "kl_div",
    "log_cosh_loss",
    "normalize",
    "cosine_similarity",
    "logaddexp",
    "masked_mean",
    "entropy",
    "info_nce_loss",
    "dice_loss",
    "linear_cross_entropy",
    "linear_focal_loss",
    # post-training (0.4)
    "token_logps",
    "sequence_logps",
    "dpo_loss",
    "orpo_loss",
    "simpo_loss",
    "cpo_loss",
    "kto_loss",
    "policy_loss",
    "kl_penalty",
    "linear_token_logps",
    "linear_sequence_logps",
    "distillation_loss",
    "linear_distillation_loss",
]

# Every torch.nn loss (0.4): torch's signature; the hazards fixed, the rest torch's computation
from stablelosses.functional._bce_logits import binary_cross_entropy_with_logits  # noqa: E402
from stablelosses.functional._cosine_embedding import cosine_embedding_loss  # noqa: E402
from stablelosses.functional._ctc import ctc_loss  # noqa: E402
from stablelosses.functional._gaussian_nll import gaussian_nll_loss  # noqa: E402
from stablelosses.functional._nll import nll_loss  # noqa: E402
from stablelosses.functional._soft_margin import multilabel_soft_margin_loss, soft_margin_loss  # noqa: E402
from stablelosses.functional._torch_losses import (  # noqa: E402
    binary_cross_entropy,
    hinge_embedding_loss,
    huber_loss,
    l1_loss,
    margin_ranking_loss,
    mse_loss,
    multi_margin_loss,
    multilabel_margin_loss,
    poisson_nll_loss,
    smooth_l1_loss,
    triplet_margin_loss,
    triplet_margin_with_distance_loss,
)

__all__ += [
    "l1_loss",
    "mse_loss",
    "huber_loss",
    "smooth_l1_loss",
    "nll_loss",
    "poisson_nll_loss",
    "gaussian_nll_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "ctc_loss",
    "cosine_embedding_loss",
    "hinge_embedding_loss",
    "margin_ranking_loss",
    "multi_margin_loss",
    "multilabel_margin_loss",
    "multilabel_soft_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "triplet_margin_with_distance_loss",
]

# Each public function is the wrapper that carries the NaN detector's hook (stablelosses/_public.py):
# one read of a global while no detector is open. Applied here, once, when the namespace is built.
from stablelosses._public import public as _public  # noqa: E402

for _name in __all__:
    globals()[_name] = _public(globals()[_name], __name__)
del _name, _public
