"""A healthy training loop with a -inf attention mask (for `trace`): nothing to report."""

import sys

import torch
from torch import nn

if __name__ == "__main__":
    assert sys.argv[1:] == ["--steps", "3"], sys.argv
    torch.manual_seed(0)
    proj = nn.Linear(8, 8)
    opt = torch.optim.SGD(proj.parameters(), lr=0.1)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    for _ in range(3):
        x = torch.randn(2, 5, 8)
        q = proj(x)
        scores = (q @ x.transpose(1, 2)).masked_fill(causal, float("-inf"))
        loss = torch.softmax(scores, -1).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("trained")
