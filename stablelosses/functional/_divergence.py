"""kl_div (stub: being written)."""


def kl_div(input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    raise NotImplementedError
