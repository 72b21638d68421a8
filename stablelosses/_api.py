"""Everything ``import stablelosses`` offers, loaded on first use (``stablelosses.__getattr__``),
so that ``stablelosses --help`` and ``--version`` answer without importing torch.

New public names go here and into ``__all__`` in ``stablelosses/__init__.py``.
"""

# ruff: noqa: F401 - imported to be re-exported by `stablelosses.__getattr__`


from stablelosses import _torch_import  # noqa: F401 - first: torch without its NumPy warning

# isort: split
from stablelosses import functional

# isort: split
# The kernels register themselves into the core's backend table (stablelosses/_backend.py);
# this imports no triton. Nothing in functional/, _autograd/ or losses.py imports _triton.
from stablelosses import _triton
from stablelosses._backend import backend, get_backend, set_backend
from stablelosses.functional import (
    cosine_similarity,
    entropy,
    log_softmax,
    logaddexp,
    logsumexp,
    masked_mean,
    normalize,
    safe_div,
    safe_sqrt,
    softmax,
    xlogy,
)
from stablelosses.losses import (
    CrossEntropyLoss,
    DiceLoss,
    FocalLoss,
    InfoNCELoss,
    KLDivLoss,
    LinearCrossEntropyLoss,
    LinearFocalLoss,
    LogCoshLoss,
    RMSELoss,
    SigmoidFocalLoss,
)

# isort: split
# post-training and distillation (0.4)
from stablelosses.functional import kl_penalty, sequence_logps, token_logps
from stablelosses.losses import (
    CPOLoss,
    DistillationLoss,
    DPOLoss,
    KTOLoss,
    LinearDistillationLoss,
    ORPOLoss,
    PolicyLoss,
    SimPOLoss,
)

# isort: split
# every torch.nn loss (0.4)
from stablelosses.losses import (
    BCELoss,
    BCEWithLogitsLoss,
    CosineEmbeddingLoss,
    CTCLoss,
    GaussianNLLLoss,
    HingeEmbeddingLoss,
    HuberLoss,
    L1Loss,
    MarginRankingLoss,
    MSELoss,
    MultiLabelMarginLoss,
    MultiLabelSoftMarginLoss,
    MultiMarginLoss,
    NLLLoss,
    PoissonNLLLoss,
    SmoothL1Loss,
    SoftMarginLoss,
    TripletMarginLoss,
    TripletMarginWithDistanceLoss,
)
