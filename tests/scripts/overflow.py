"""A tiny training loop with a planted exp overflow at step 9 (for `stablelosses trace`)."""

import sys

import torch
from torch import nn


class Weighting(nn.Module):
    def forward(self, y, step):
        return torch.exp(y * 10.0 * step)  # PLANTED: exp(90) overflows float32 at step 9


def main(steps: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    weighting = Weighting()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.ones(16, 1)
    for step in range(steps):
        loss = ((model(x) - y).square() * weighting(y, step) / 1e30).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("done")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
