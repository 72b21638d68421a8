"""What every stablelosses Function shares: forward-mode AD that still compiles.

torch.compile (Dynamo, torch 2.13) refuses to trace an ``autograd.Function`` that defines a
``jvp`` staticmethod ("Unsupported custom jvp"), while ``torch.func.jvp``/``jacfwd``/``hessian``
need one. A `StableFunction` subclass defines ``jvp`` and gets a twin subclass whose ``jvp``
is the base class's; its ``call`` applies the twin while compiling and the Function itself
otherwise. Both share ``forward``, ``setup_context``, ``backward`` and the vmap rule, so the
compiled and the eager graphs run the same code. A call that a backward or a tangent can follow
goes through ``Function.apply`` (no C++ ``apply`` that skips its argument binding); one that none
can follow (grad mode off or nothing requiring grad, outside transforms and forward AD) is the
value only, the design's item 4: the Function's own ``forward``, without ``Function.apply``'s
bookkeeping. Compiled code gets first-order reverse mode only, which is all torch.compile
supports through custom Functions anyway.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from stablelosses._compat import (
    forward_ad_active,
    functorch_transforms_active,
    nested_forward_transforms,
    set_grad_mode,
)


def backward_can_follow(*args: Any) -> bool:
    """A backward or a tangent can follow a call on ``args``: grad mode with a tensor among
    them that requires grad, a ``torch.func`` transform (its wrappers carry the gradient) or an
    open forward-AD level."""
    if functorch_transforms_active() or forward_ad_active():
        return True
    if not torch.is_grad_enabled():
        return False
    for a in args:  # (a loop, not any() over a generator: this runs on every tiny call)
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
    return False


_POSITIONAL = inspect.Signature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)])


class StableFunction(torch.autograd.Function):
    """An ``autograd.Function`` that also compiles, and computes only the value where no
    backward can follow. Call a subclass as ``_SafeSqrt.call(x)``, with every argument of
    ``forward`` given positionally: "go to definition" on the class name lands on the Function.

    Each subclass defines ``jvp`` (``torch.func``'s forward mode needs it). At class creation
    (``__init_subclass__``) it gets its ``call`` and a jvp-free twin subclass, which ``call``
    applies while compiling. Where no backward or tangent can follow (`backward_can_follow`),
    ``call`` gives the value only, outside ``Function.apply``: the Function's ``value``
    staticmethod where it has one (``forward``'s outputs without what only the backward reads),
    else ``forward`` itself.
    """

    # set on each subclass by __init_subclass__ (a staticmethod: Dynamo inlines it, where it
    # refuses a classmethod that reads a class attribute of an autograd.Function)
    call: ClassVar[Callable[..., Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if vars(cls).get("_twin", False):
            return
        if "jvp" not in vars(cls):
            raise TypeError(f"{cls.__name__}: a StableFunction defines jvp")
        # Function.apply binds the arguments to ``inspect.signature(forward)`` on every call
        # (for setup_context's defaults; `call` passes every argument positionally). Eagerly
        # the signature is ``(*args)``, which binds as it stands (9 arguments: 9.8 → 3.8 µs
        # per call); the twin keeps the real one on a copy of the same function, because
        # Dynamo binds through it and refuses ``*args``.
        forward: Any = cls.forward
        real: Any = types.FunctionType(forward.__code__, forward.__globals__, forward.__name__,
                                  forward.__defaults__, forward.__closure__)
        real.__kwdefaults__, real.__qualname__ = forward.__kwdefaults__, forward.__qualname__
        real.__signature__ = inspect.signature(forward)
        forward.__signature__ = _POSITIONAL
        twin = type(cls.__name__ + "Compiled", (cls,),
                    {"jvp": torch.autograd.Function.jvp, "forward": staticmethod(real),
                     "__module__": cls.__module__, "_twin": True})
        cls.call = staticmethod(_caller(cls, twin))


def _caller(cls: Any, twin: Any) -> Callable[..., Any]:
    """``cls``'s ``call``: ``twin.apply`` while compiling, the value only where no backward or
    tangent can follow, else ``cls.apply``."""
    value = vars(cls).get("value", cls.forward)

    def call(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return twin.apply(*args)
        if functorch_transforms_active() and nested_forward_transforms():
            raise _nested_forward_error()
        if not backward_can_follow(*args):
            # The design's item 4: a call that no backward or tangent can follow computes the
            # value only. Here that is the Function's own forward, without the graph
            # bookkeeping of Function.apply (argument binding, setup_context, saving): the same
            # aten ops and bytes, less host time per call (the same on any device; an 8x10
            # no-grad log_softmax: 25.8 → 16.6 µs above torch's own call). Grad mode off, as
            # Function.apply runs forward: the same spelling (in place on fresh buffers, where
            # inplace_ok allows it) and so the same values as a call that records a graph.
            # (The switch is _compat.set_grad_mode: the no_grad context manager costs about
            # 4 µs per call, torch.set_grad_enabled called as a function 0.65 µs, this 0.20.)
            prev = torch.is_grad_enabled()
            set_grad_mode(False)
            try:
                return value(*args)
            finally:
                set_grad_mode(prev)
        return cls.apply(*args)

    call.__name__ = "call"
    call.__qualname__ = cls.__name__ + ".call"
    return call


def save_input(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    """``setup_context`` of a one-input Function differentiated from its input: saves it for
    reverse and forward mode."""
    (x,) = inputs
    ctx.save_for_backward(x)
    ctx.save_for_forward(x)


def save_output(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    """``setup_context`` of a one-input Function differentiated from its output: saves it for
    reverse and forward mode."""
    ctx.save_for_backward(output)
    ctx.save_for_forward(output)


def times_saved(scale: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``backward`` and ``jvp`` of a one-input elementwise Function that saved one tensor
    (:func:`save_input`, :func:`save_output`): ``scale(saved, g)``, the same map of the incoming
    gradient and of the tangent. Use as ``backward = jvp = staticmethod(times_saved(scale))``."""

    def derivative(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (saved,) = ctx.saved_tensors
        return scale(saved, g)

    return derivative


def tangent_sum(grads: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The jvp of an elementwise Function from its input gradients: ``Σ gᵢ · tᵢ`` over the
    tangents given (0, shaped like ``grads[0]``, when none is)."""
    out = torch.zeros_like(grads[0])
    for g, t in zip(grads, tangents):
        if t is not None:
            out = out + g * t
    return out


def _nested_forward_error() -> RuntimeError:
    # torch's own bug, silent: the second and higher derivatives come out 0 through any
    # custom autograd.Function under nested forward mode (pytorch/pytorch#197867).
    return RuntimeError(
        "stablelosses: nested forward-mode transforms (jacfwd(jacfwd(f)), jvp of jvp) give "
        "zero second derivatives through custom autograd Functions in this torch "
        "(pytorch/pytorch#197867); use torch.func.hessian (jacfwd over jacrev) or "
        "jacrev(jacrev(f)), which are exact"
    )
