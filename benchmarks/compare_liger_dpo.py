"""DPO from hidden states: ``stablelosses`` against Liger-Kernel's ``LigerFusedLinearDPOLoss``.

Ours: ``SF.linear_sequence_logps`` for the policy (chunk engine, backward recomputes the logits)
and, without grad, for the reference model, then ``SF.dpo_loss``. Liger:
``LigerFusedLinearDPOLoss(compiled=False, use_ref_model=True)`` (its pure-torch chunked path,
which computes the gradients in the forward). Both get the same ``(2B, T, H)`` hidden states
(chosen first, then rejected), the same ``(V, H)`` weights and labels with the prompt ignored.
Forward and backward with respect to the policy's hidden states and weight.

Also one hazard row: the same batch with a ``-inf`` bias at token 0 (a banned token; the ignored
positions' labels are ``-100``, which a masked-multiply gather clamps to token 0).

``python benchmarks/compare_liger_dpo.py [--shape B,T,H,V] [--repeats R]`` prints the medians,
peaks and a markdown table. Needs ``liger-kernel`` (the ``bench`` extra), never a runtime
dependency.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

import stablelosses.functional as SF
from stablelosses.bench.timing import round_robin_with_peaks


def make(b: int, t: int, h: int, v: int, beta: float, masked_bias: bool) -> dict[str, Callable[[], Any]]:
    """The two forward+backward callables on one batch of ``b`` pairs."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * b, t, h, generator=g).requires_grad_(True)
    w = (torch.randn(v, h, generator=g) * h**-0.5).requires_grad_(True)
    bias = torch.zeros(v)
    if masked_bias:
        bias[0] = -float("inf")
    ref_x = x.detach() + 0.1 * torch.randn(2 * b, t, h, generator=g)
    ref_w = w.detach() + 0.01 * torch.randn(v, h, generator=g)
    labels = torch.randint(1, v, (2 * b, t), generator=g)
    labels[:, : t // 8] = -100

    def ours() -> Any:
        lp = SF.linear_sequence_logps(x, w, labels, linear_bias=bias)
        with torch.no_grad():
            ref = SF.linear_sequence_logps(ref_x, ref_w, labels, linear_bias=bias)
        loss = SF.dpo_loss(lp[:b], lp[b:], ref[:b], ref[b:], beta=beta)
        return (loss, *torch.autograd.grad(loss, (x, w)))

    def liger() -> Any:
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

        fn = LigerFusedLinearDPOLoss(beta=beta, compiled=False, use_ref_model=True)
        out = fn(w, x, labels, bias, ref_x, ref_w, bias)
        loss = out[0] if isinstance(out, tuple) else out
        return (loss, *torch.autograd.grad(loss, (x, w)))

    return {"stable": ours, "liger": liger}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="4,512,1024,32000", help="B (pairs),T,H,V")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    b, t, h, v = (int(s) for s in args.shape.split(","))
    calls = make(b, t, h, v, 0.1, False)
    results = {k: c() for k, c in calls.items()}  # warm-up, and the values compared
    diff = max((a - c).abs().max().item() for a, c in zip(results["stable"], results["liger"]))
    _, med, peaks = round_robin_with_peaks(calls, args.repeats)
    masked = make(b, t, h, v, 0.1, True)
    hazard = {k: all(torch.isfinite(r).all().item() for r in c()) for k, c in masked.items()}
    print(f"{2 * b}x{t}x{h}x{v} ({torch.get_num_threads()} threads, {args.repeats} interleaved repeats); "
          f"largest difference of loss and gradients: {diff:.3g}")
    print("\n| variant | median time | peak | time ÷ liger | peak ÷ liger | finite with a -inf bias entry |")
    print("|---|---|---|---|---|---|")
    for k in calls:
        print(f"| {k} | {med[k]:.2f} s | {peaks[k] / 2**20:.0f} MiB | {med[k] / med['liger']:.2f} "
              f"| {peaks[k] / peaks['liger']:.2f} | {'yes' if hazard[k] else 'no'} |")


if __name__ == "__main__":
    main()
