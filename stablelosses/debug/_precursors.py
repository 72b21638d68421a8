"""What `DivergenceMonitor` says when it fires: the fastest-growing module and known precursors.

Runs only when the monitor fires, so it may read values from the device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["fastest_module", "batchnorm_precursors", "update_ratio", "format_divergence"]

BN_MIN_VALUES = 32  # fewer values per channel than this make the batch variance unreliable


def _positive_min(values: Sequence[float]) -> float | None:
    pos = [v for v in values if v > 0 and math.isfinite(v)]
    return min(pos) if pos else None


def fastest_module(
    history: Sequence[Sequence[float]], owners: Sequence[str], model: nn.Module
) -> tuple[str, str, float, float, float] | None:
    """(path, class name, first norm, last norm, growth) of the module whose gradient grew most.

    Args:
        history: per check, the gradient norm of every parameter (params in order).
        owners: per parameter, the path of the module that holds it (``''`` for the model).
        model: the model, to name the class of each module.
    """
    if not history or not owners:
        return None
    best = None
    for path in dict.fromkeys(owners):
        cols = [i for i, o in enumerate(owners) if o == path]
        series = [math.sqrt(math.fsum(h[i] * h[i] for i in cols)) for h in history]
        ref, last = _positive_min(series[:-1]), series[-1]
        if ref is None or not math.isfinite(last):
            continue
        growth = last / ref
        if best is None or growth > best[4]:
            module = model.get_submodule(path) if path else model
            best = (path, type(module).__name__, ref, last, growth)
    return best


def batchnorm_precursors(seen: dict[str, tuple[str, bool, int]], root: str) -> list[str]:
    """A sentence for each BatchNorm that normalised over fewer than 32 values per channel."""
    out = []
    for path, (cls, training, values) in seen.items():
        if training and values < BN_MIN_VALUES:
            out.append(
                f"{_join(root, path)} ({cls}) in training mode normalised over {values} values per "
                f"channel in the last batch (fewer than {BN_MIN_VALUES}): its batch variance is tiny "
                "and noisy and it amplifies small differences; use larger batches, GroupNorm/"
                "LayerNorm, or .eval() it"
            )
    return out


def update_ratio(optimizer: Any, names: dict[int, str], root: str) -> str | None:
    """The largest ``lr·‖g‖/‖w‖`` over the optimizer's parameters, as a sentence."""
    best = None
    for group in optimizer.param_groups:
        lr = float(group.get("lr", 0.0))
        for p in group["params"]:
            if p.grad is None:
                continue
            w = float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64))
            g = float(torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float64))
            if w > 0 and math.isfinite(g):
                ratio = lr * g / w
                if best is None or ratio > best[0]:
                    best = (ratio, names.get(id(p), "?"), lr)
    if best is None:
        return None
    ratio, name, lr = best
    return (
        f"largest update-to-weight ratio lr·‖g‖/‖w‖ = {ratio:.3g} at {_join(root, name)} (lr {lr:g}); "
        "above about 1e-2 one step rewrites the weight"
    )


def _join(root: str, path: str) -> str:
    return f"{root}.{path}" if path else root


def format_divergence(info: dict[str, Any]) -> str:
    """The message of a `DivergenceError`."""
    lines = [
        f"DivergenceMonitor: at step {info['step']} the {info['quantity']} "
        f"{'rose by' if info['quantity'] == 'loss' else 'grew'} {info['growth']:.3g}x "
        f"{'its scale ' if info['quantity'] == 'loss' else ''}"
        f"within {info['span']} steps ({info['ref']:.3g} -> {info['value']:.3g}), while still finite",
        f"  loss: {' -> '.join(f'{v:.3g}' for v in info['losses'])}",
        f"  gradient norm: {' -> '.join(f'{v:.3g}' for v in info['norms'])}",
    ]
    if info.get("module_path") is not None:
        lines.append(
            f"  fastest-growing gradient: {info['module_path']} ({info['module_type']}), "
            f"‖g‖ {info['module_ref']:.3g} -> {info['module_last']:.3g} ({info['module_growth']:.3g}x)"
        )
    for p in info.get("precursors", ()):
        lines.append(f"  precursor: {p}")
    lines.append(
        "  hint: lower the learning rate or add warm-up, clip gradients (clip_grad_norm_); "
        "docs: debugging (Divergence before inf)"
    )
    return "\n".join(lines)
