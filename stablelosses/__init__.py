"""stablelosses: numerically stable loss functions for PyTorch.

Exact forward values and finite, defined gradients at the points where the textbook formulas
compute 0/0, inf·0, inf−inf, log 0, sqrt'(0) or overflow in exp.

>>> import torch, stablelosses as sl
>>> x = torch.zeros(3, requires_grad=True)
>>> sl.safe_sqrt(x).sum().backward()
>>> x.grad
tensor([0., 0., 0.])
"""

from stablelosses import _torch_import  # noqa: F401 - first: torch without its NumPy warning

# isort: split
from stablelosses import functional
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

__version__ = "0.2.0"

__all__ = [
    "CrossEntropyLoss",
    "DiceLoss",
    "FocalLoss",
    "InfoNCELoss",
    "KLDivLoss",
    "LinearCrossEntropyLoss",
    "LinearFocalLoss",
    "LogCoshLoss",
    "RMSELoss",
    "SigmoidFocalLoss",
    "cosine_similarity",
    "entropy",
    "functional",
    "log_softmax",
    "logaddexp",
    "logsumexp",
    "masked_mean",
    "normalize",
    "safe_div",
    "safe_sqrt",
    "softmax",
    "xlogy",
    "backend",
    "get_backend",
    "set_backend",
    "__version__",
]

# Every torch.nn loss (0.4)
from stablelosses.losses import (  # noqa: E402
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

__all__ += [
    "BCELoss",
    "BCEWithLogitsLoss",
    "CosineEmbeddingLoss",
    "CTCLoss",
    "GaussianNLLLoss",
    "HingeEmbeddingLoss",
    "HuberLoss",
    "L1Loss",
    "MarginRankingLoss",
    "MSELoss",
    "MultiLabelMarginLoss",
    "MultiLabelSoftMarginLoss",
    "MultiMarginLoss",
    "NLLLoss",
    "PoissonNLLLoss",
    "SmoothL1Loss",
    "SoftMarginLoss",
    "TripletMarginLoss",
    "TripletMarginWithDistanceLoss",
]
