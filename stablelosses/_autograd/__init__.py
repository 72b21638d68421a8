"""Private ``torch.autograd.Function`` classes, one file per hazard family."""

from __future__ import annotations

import inspect

import torch


def cache_forward_signatures() -> None:
    """Precompute ``inspect.signature`` of every stablelosses Function's ``forward``.

    ``Function.apply`` binds default arguments with ``inspect.signature(forward)`` on every
    call when ``setup_context`` is defined; a cached ``__signature__`` makes that a lookup.
    Eager calls skip ``Function.apply`` (`fast_apply`), so this serves the calls under
    ``torch.func`` transforms, which go through it: ``torch.func.grad`` of an 8×10
    ``cross_entropy`` measured 1.34 ms with the cache and 1.40 ms without (medians of two
    interleaved runs each, noisy); eager fwd+bwd measured 270 µs both ways.
    """
    pending = list(torch.autograd.Function.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__.startswith("stablelosses.") and "forward" in vars(cls):
            fwd = cls.forward
            if getattr(fwd, "__signature__", None) is None:
                fwd.__signature__ = inspect.signature(fwd)  # type: ignore[attr-defined]
