"""What every stablelosses Function shares: forward-mode AD that still compiles.

torch.compile (Dynamo, torch 2.13) refuses to trace an ``autograd.Function`` that defines a
``jvp`` staticmethod ("Unsupported custom jvp"), while ``torch.func.jvp``/``jacfwd``/``hessian``
need one. :func:`applier` builds, for a Function that defines ``jvp``, a twin subclass whose
``jvp`` is the base class's, and returns a function that calls the twin while compiling and
the original otherwise. Both share ``forward``, ``setup_context``, ``backward`` and the vmap
rule, so the compiled and the eager graphs run the same code. One ``forward`` branches on
``is_compiling()``, with its measurement: the class-index row of cross-entropy and focal loss
(``rows.fused_index_row``: one ``exp`` where inductor's softmax decomposition makes two). The
probability-target backward skips one select while compiling (measured, in its comment). The
in-place fast paths (``inplace_ok``) are off while compiling, where
functionalization undoes them anyway, so a compiled graph traces their out-of-place spelling
of the same values. ``rmse_loss`` has one spelling: its float64-accumulated norm is one
reduction that inductor fuses (0.99x compiled torch at 1e6 elements, 0.83x at 1e7, in the
2026-12-05 run of docs/benchmarks.md).
Compiled code gets first-order reverse mode only, which is all torch.compile supports through
custom Functions anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stablelosses._compat import (
    direct_apply,
    forward_ad_active,
    functorch_transforms_active,
    nested_forward_transforms,
)

_grad_enabled = torch.is_grad_enabled


def _any_requires_grad(args: tuple[Any, ...]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def applier(cls: Any) -> Callable[..., Any]:
    """``cls.apply``, through a jvp-free twin of ``cls`` under torch.compile.

    Use as ``_sqrt = applier(_SafeSqrt)`` next to the Function, then ``_sqrt(x)`` with every
    argument of ``forward`` given positionally (outside transforms and compilation the call
    goes straight to the C++ ``apply``, without binding defaults).
    """
    if "jvp" not in vars(cls):
        raise TypeError(f"{cls.__name__}: applier is for Functions that define jvp")
    twin: Any = type(
        cls.__name__ + "Compiled",
        (cls,),
        {"jvp": torch.autograd.Function.jvp, "__module__": cls.__module__},
    )

    return fast_apply(cls, compiled=twin)


def _nested_forward_error() -> RuntimeError:
    # torch's own bug, silent: the second and higher derivatives come out 0 through any
    # custom autograd.Function under nested forward mode (pytorch/pytorch#197867).
    return RuntimeError(
        "stablelosses: nested forward-mode transforms (jacfwd(jacfwd(f)), jvp of jvp) give "
        "zero second derivatives through custom autograd Functions in this torch "
        "(pytorch/pytorch#197867); use torch.func.hessian (jacfwd over jacrev) or "
        "jacrev(jacrev(f)), which are exact"
    )


def fast_apply(cls: Any, compiled: Any = None) -> Callable[..., Any]:
    """``cls.apply`` with two per-call shortcuts (every argument given positionally).

    Outside compilation and functorch transforms: ``forward`` itself when no tensor argument
    requires grad (or under ``no_grad``) and no forward-mode level is open: there is no graph
    to record and no tangent to push, and ``Function.apply``'s bookkeeping (saving, marking
    seven outputs) would be most of a tiny call. Else the C++ ``apply`` without
    ``Function.apply``'s binding of defaults (``inspect``, ~40 µs).
    While compiling it calls ``compiled.apply`` (`applier`'s jvp-free twin) when given.
    """
    fast = direct_apply(cls)
    forward = cls.forward
    traced = cls if compiled is None else compiled

    def apply(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return traced.apply(*args)
        if functorch_transforms_active():
            if nested_forward_transforms():
                raise _nested_forward_error()
            return cls.apply(*args)
        if not forward_ad_active() and not (_grad_enabled() and _any_requires_grad(args)):
            return forward(*args)
        return fast(*args)

    apply.__name__ = apply.__qualname__ = cls.__name__ + ".apply"
    return apply
