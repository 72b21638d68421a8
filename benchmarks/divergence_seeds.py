"""DivergenceMonitor on 200 runs of the BatchNorm seed net: false alarms and caught divergences.

``python benchmarks/divergence_seeds.py [--runs 200] [--lr 0.1] [--steps 30]``

The seed net (``BatchNorm2d(1)`` over 16 values, ``Conv2d(1, 1, [1, 16])``, target 1, squared
error, plain SGD) trained from ``torch.manual_seed(seed)`` for ``seed`` in ``range(runs)``. A run
*diverges* when its unwatched loss becomes non-finite within ``steps`` steps; at ``lr=0.1`` that
is 123 of the 200. The same run is then repeated with a ``DivergenceMonitor`` (default settings)
checking every step: a *false alarm* is a firing on a run that never diverges, a divergence is
*caught* when the monitor fires on a finite loss before the first non-finite one. Watching must
not change the run (asserted). Prints the counts and the runs the monitor got wrong.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from stablelosses.debug import DivergenceError, DivergenceMonitor


def seed_net(seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.BatchNorm2d(1), nn.Conv2d(1, 1, (1, 16)))
    return net, torch.optim.SGD(net.parameters(), lr=lr), torch.rand(1, 1, 1, 16)


def train(
    seed: int, lr: float, steps: int, watch: bool, loss_floor: float = 1.0
) -> tuple[list[float], int | None]:
    """The losses, and the step the monitor fired at (None: it did not)."""
    net, opt, x = seed_net(seed, lr)
    monitor = DivergenceMonitor(net, optimizer=opt, loss_floor=loss_floor) if watch else None
    losses: list[float] = []
    for _ in range(steps):
        opt.zero_grad()
        loss = (net(x) - 1).square().sum()
        loss.backward()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break  # diverged; what follows is NaN arithmetic (slow on denormals)
        if monitor is not None:
            try:
                monitor.check(loss)
            except DivergenceError as err:
                return losses, err.step
        opt.step()
    return losses, None


def experiment(
    runs: int = 200, lr: float = 0.1, steps: int = 30, loss_floor: float = 1.0
) -> dict[str, list[int]]:
    """Seeds by outcome: diverged, caught, missed (diverged, not caught in time), false alarms."""
    out: dict[str, list[int]] = {"diverged": [], "caught": [], "missed": [], "false_alarm": []}
    for seed in range(runs):
        plain, _ = train(seed, lr, steps, watch=False)
        first_bad = next((i for i, v in enumerate(plain) if not math.isfinite(v)), None)
        watched, fired = train(seed, lr, steps, watch=True, loss_floor=loss_floor)
        same = all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(watched, plain))
        assert same and len(watched) <= len(plain), f"seed {seed}: watching changed the run"
        if first_bad is None:
            if fired is not None:
                out["false_alarm"].append(seed)
            continue
        out["diverged"].append(seed)
        ok = fired is not None and fired < first_bad and all(map(math.isfinite, watched))
        out["caught" if ok else "missed"].append(seed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--loss-floor", type=float, default=1.0,
                        help="the monitor's loss_floor (a tiny one judges the loss's rise as before 0.3)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = experiment(args.runs, args.lr, args.steps, args.loss_floor)
    print(f"{args.runs} runs (lr {args.lr:g}, {args.steps} steps, loss_floor {args.loss_floor:g}): "
          f"{len(out['diverged'])} diverged, "
          f"{len(out['caught'])} caught before the first non-finite loss, {len(out['missed'])} missed, "
          f"{len(out['false_alarm'])} false alarms")
    for k in ("missed", "false_alarm"):
        if out[k]:
            print(f"  {k}: seeds {out[k]}")


if __name__ == "__main__":
    main()
