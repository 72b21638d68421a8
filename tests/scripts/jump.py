"""A run that goes from a steady loss to inf in one step (for `stablelosses trace`'s hint): the
learning rate makes one step so large that the next forward overflows; no monitor could see it
coming while the loss was finite."""

import torch
from torch import nn

if __name__ == "__main__":
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=1e22)
    x, y = torch.ones(8, 4), torch.zeros(8, 1)
    for step in range(3):
        opt.zero_grad()
        loss = (net(x) - y).square().mean()
        loss.backward()
        print(f"step {step}: loss {loss.item():.3g}")
        opt.step()
