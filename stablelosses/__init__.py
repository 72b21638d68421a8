"""stablelosses: numerically stable loss functions for PyTorch.

Exact forward values and finite, defined gradients at the points where the textbook formulas
compute 0/0, inf·0, inf−inf, log 0, sqrt'(0) or overflow in exp.

>>> import torch, stablelosses as sl
>>> x = torch.zeros(3, requires_grad=True)
>>> sl.safe_sqrt(x).sum().backward()
>>> x.grad
tensor([0., 0., 0.])
"""

# ruff: noqa: F405 - the public names come from `_api` through `__getattr__` (star import for type checkers)
from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
    # post-training (0.4)
    "DPOLoss",
    "ORPOLoss",
    "SimPOLoss",
    "CPOLoss",
    "KTOLoss",
    "PolicyLoss",
    "token_logps",
    "sequence_logps",
    "kl_penalty",
    "DistillationLoss",
    "LinearDistillationLoss",
    # every torch.nn loss (0.4)
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

if TYPE_CHECKING:  # type checkers and editors see the names where they live
    from stablelosses._api import *  # noqa: F403


def __getattr__(name: str) -> Any:
    """A submodule is imported by name; any other public name loads the library (torch first)
    on its first use, as a plain ``import stablelosses`` did."""
    import importlib
    import importlib.util
    import sys

    if name.startswith("__"):
        raise AttributeError(f"module 'stablelosses' has no attribute {name!r}")
    full = f"stablelosses.{name}"
    if full in sys.modules:  # being imported: `from stablelosses import functional` inside it
        return sys.modules[full]
    if importlib.util.find_spec(full) is not None:
        return importlib.import_module(full)
    if name in __all__:
        api = importlib.import_module("stablelosses._api")
        g = globals()
        for n in __all__:
            if n not in g and hasattr(api, n):
                g[n] = getattr(api, n)
        if name in g:
            return g[name]
    raise AttributeError(f"module 'stablelosses' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
