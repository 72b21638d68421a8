"""A script that crashes (for `stablelosses trace` exit codes): KeyError, sys.exit(N), or FiniteGuard
giving up on NaN gradients (``guard``), or a ValueError before any tensor op (``config``)."""

import sys


def load(key):
    return {}[key]  # CRASH


def guarded_steps():
    import torch

    from stablelosses.debug import FiniteGuard

    w = torch.nn.Parameter(torch.ones(2))
    guard = FiniteGuard(torch.optim.SGD([w], lr=0.1), max_consecutive=2)
    for _ in range(2):
        w.grad = torch.tensor([float("nan"), 0.0])  # a gradient that arrived non-finite
        guard.step()


if __name__ == "__main__":
    if sys.argv[1:2] == ["exit"]:
        sys.exit(int(sys.argv[2]))
    if sys.argv[1:2] == ["guard"]:
        guarded_steps()
    if sys.argv[1:2] == ["config"]:
        raise ValueError("bad config file")  # CONFIG
    load("missing")
