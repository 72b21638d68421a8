"""A NaN created inside a stablelosses function (for `stablelosses trace`)."""

import torch

import stablelosses.functional as SF

if __name__ == "__main__":
    logits = torch.randn(4, 3)
    target = torch.full((4,), -100)  # every target ignored
    loss = SF.cross_entropy(logits, target)  # LIBRARY: mean over nothing, 0/0
    print("loss", loss)
