"""The seed of a diverging run (for `stablelosses trace --watch`): BatchNorm over 16 values, SGD.

Unmodified training code: the loss grows 0.83 -> 74 -> 1.1e7 -> 4.4e22 -> inf -> NaN.
"""

import torch
from torch import nn

if __name__ == "__main__":
    torch.manual_seed(0)
    net = nn.Sequential(nn.BatchNorm2d(1), nn.Conv2d(1, 1, [1, 16]))
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    x = torch.rand(1, 1, 1, 16)
    for step in range(10):
        opt.zero_grad()
        loss = (net(x) - 1).square().sum()
        loss.backward()
        print(f"step {step}: loss {loss.item():.3g}")
        opt.step()
