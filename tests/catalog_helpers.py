"""What the torch.nn catalog tests share: the module → function table and the comparison of a
module's gradients with torch's on a sample."""

from __future__ import annotations

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
