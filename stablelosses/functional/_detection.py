"""sigmoid_focal_loss (stub: being written)."""


def sigmoid_focal_loss(input, target, alpha=0.25, gamma=2.0, reduction="none"):
    raise NotImplementedError
