"""Every private torch API stablelosses touches, in one place, each with a fallback.

torch keeps no promise about names that start with an underscore. Each use goes through a
function here that returns the conservative answer when the name is gone, and
``tests/test_compat.py`` checks, on every torch version CI runs (the current one and the
floor in ``pyproject.toml``), that the private name is still there and still answers.

The benchmark harness (``stablelosses.bench``, a tool, not imported by the library) also reads
torch internals, each guarded where it is used: inductor's ``GraphLowering.save_output_code``
for kernel counts (reported as unavailable when missing), the profiler's ``_EventType`` for
CPU peak memory, and ``torch._dynamo.config``'s recompile limits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# Documented in "Extending PyTorch" but only importable from a private module path.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported)

_functorch = getattr(torch._C, "_functorch", None)
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_current_node = getattr(torch._C, "_current_autograd_node", None)
_softmax_bwd = getattr(torch, "_softmax_backward_data", None)
_log_softmax_bwd = getattr(torch, "_log_softmax_backward_data", None)
_disable_functorch = getattr(torch._C, "_DisableFuncTorch", None)
# Sets grad mode without the context-manager object torch.set_grad_enabled builds (0.65 → 0.20
# µs per switch and back). Fallback: torch.set_grad_enabled, which also sets it when called.
set_grad_mode: Any = getattr(torch._C, "_set_grad_enabled", torch.set_grad_enabled)
_is_fake: Any
try:
    from torch._subclasses.fake_tensor import is_fake as _is_fake
except ImportError:  # pragma: no cover - other torch versions
    _is_fake = None


def functorch_transforms_active() -> bool:
    """True while a ``torch.func`` transform (vmap, grad, jvp, …) runs.

    Fallback: True, which only disables in-place fast paths.
    """
    if _transforms_active is None:
        return True
    return bool(_transforms_active())


def nested_forward_transforms() -> bool:
    """True while two or more ``torch.func`` forward-mode transforms are stacked
    (``jacfwd(jacfwd(f))``, ``jvp`` of ``jvp``).

    Fallback: False (no interpreter stack to read: the guard that uses it stays off).
    """
    stack_of = getattr(_functorch, "get_interpreter_stack", None)
    jvp = getattr(getattr(_functorch, "TransformType", None), "Jvp", None)
    if stack_of is None or jvp is None:
        return False
    stack = stack_of() or ()
    return sum(1 for level in stack if level.key() == jvp) >= 2


def _wrapped_check_functions() -> tuple[Any, ...] | None:
    """functorch's two wrapper checks, looked up once (None where either is missing)."""
    if _functorch is None:
        return None
    names = ("is_functorch_wrapped_tensor", "is_legacy_batchedtensor")
    checks = tuple(getattr(_functorch, n, None) for n in names)
    return None if any(c is None for c in checks) else checks


_wrapped_checks = _wrapped_check_functions()


def is_transform_wrapped(t: Tensor) -> bool:
    """True when ``t`` is a functorch wrapper (a batched or a grad-tracking tensor).

    Fallback: True, the conservative answer (in-place fast paths off).
    """
    if _wrapped_checks is None:
        return True
    is_wrapped, is_legacy_batched = _wrapped_checks
    return bool(is_wrapped(t) or is_legacy_batched(t))


def under_transform(*tensors: torch.Tensor | None) -> bool:
    """True while a ``torch.func`` transform runs or any of ``tensors`` is a functorch wrapper
    (also the legacy batched tensor of a vmap over a backward: gradcheck's batched grad,
    ``is_grads_batched``): an unbatched buffer then cannot take them in place."""
    if functorch_transforms_active():
        return True
    for t in tensors:  # (a loop, not any() over a generator: this runs on every tiny call)
        if t is not None and is_transform_wrapped(t):
            return True
    return False


def forward_ad_active() -> bool:
    """True while a ``torch.autograd.forward_ad`` level is open (also ``torch.func.jvp``'s).

    Fallback: True, which keeps Function.apply's full path (setup_context, saved tensors).
    """
    level = getattr(torch.autograd.forward_ad, "_current_level", None)
    return True if level is None else level >= 0


def current_autograd_node() -> Any:
    """The autograd Node being run by the engine (in a backward), or None.

    Fallback: None; the NaN detector then names the backward op without its forward op.
    """
    if _current_node is None:
        return None
    return _current_node()


def foreach_norm(tensors: list[Tensor], ord: float, dtype: torch.dtype | None = None) -> list[Tensor]:
    """Per-tensor vector norms in one fused kernel (``torch._foreach_norm``).

    Fallback: one ``torch.linalg.vector_norm`` per tensor (same values, more kernels).
    """
    fused = getattr(torch, "_foreach_norm", None)
    if fused is not None:
        try:
            return list(fused(tensors, ord, dtype=dtype))
        except (TypeError, RuntimeError):  # an older signature without dtype
            pass
    return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]


def softmax_backward(grad: Tensor, output: Tensor, dim: int) -> Tensor:
    """``y · (g − Σ g·y)`` along ``dim`` from the softmax output ``y``, in torch's fused kernel.

    Fallback: the same formula in three public ops (one more pass over memory).
    """
    if _softmax_bwd is None:
        return output * (grad - (grad * output).sum(dim, keepdim=True))
    return _softmax_bwd(grad, output, dim, output.dtype)


def assume_constant_result(fn: Any) -> Any:
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo``.

    torch's decorator imports Dynamo (and with it inductor and triton, about a second) only to
    set one attribute that Dynamo reads when it traces a call of ``fn``; setting it here keeps
    ``import stablelosses`` light. ``tests/test_compat.py`` checks that torch's decorator sets
    the same attribute. Fallback: none needed (an attribute Dynamo does not read is harmless).
    """
    fn._dynamo_marked_constant = True
    return fn


def log_softmax_backward(grad: Tensor, output: Tensor, dim: int, inplace: bool = False) -> Tensor:
    """``g − exp(y) · Σ g`` along ``dim`` from the log-softmax output ``y``, in torch's kernel;
    with ``inplace``, written over ``grad`` (the caller's own buffer) where both are contiguous.

    Fallback: the same formula in public ops.
    """
    if _log_softmax_bwd is None:
        return grad - torch.exp(output) * grad.sum(dim, keepdim=True)
    if inplace and grad.is_contiguous() and output.is_contiguous():
        # with other strides the kernel's aliased output comes out wrong
        return _log_softmax_bwd(grad, output, dim, output.dtype, out=grad)
    return _log_softmax_bwd(grad, output, dim, output.dtype)


def is_zero_tensor(t: Tensor) -> bool:
    """True for forward-mode AD's storage-less zero tangent (``torch._efficientzerotensor``).

    Reading such a tensor inside a dispatch mode crashes the process; it holds only zeros.
    Fallback: False (a torch without the method has no such tensors either).
    """
    probe = getattr(t, "_is_zerotensor", None)
    return bool(probe()) if probe is not None else False


def is_fake(t: Tensor) -> bool:
    """True for a tensor that holds no values: a FakeTensor (``torch.compile``'s tracing) or meta.

    Fallback: the class name, so a fake tensor is still never read.
    """
    if t.device.type == "meta":
        return True
    if _is_fake is None:
        return type(t).__name__ in ("FakeTensor", "FunctionalTensor")
    return bool(_is_fake(t))


def transform_free_value(t: Tensor) -> Tensor | None:
    """The plain tensor under the ``torch.func`` wrappers of ``t`` (vmap's batched tensors hold the
    whole batch, grad/jvp's wrappers the primal), or None when it cannot be had.

    Read it only inside :func:`functorch_disabled`. Fallback: None (the caller skips it).
    """
    if not is_transform_wrapped(t):
        return t
    unwrap = getattr(_functorch, "get_unwrapped", None) if _functorch is not None else None
    check = getattr(_functorch, "is_functorch_wrapped_tensor", None) if _functorch is not None else None
    if unwrap is None or check is None:
        return None
    for _ in range(64):  # one wrapper per nested transform
        if not check(t):
            return t
        t = unwrap(t)
    return None


def functorch_disabled() -> Any:
    """A context in which torch operators on plain tensors bypass the active ``torch.func``
    transforms, so reading a value (``.item()``) is an ordinary read.

    Fallback: None; the caller then reads nothing while a transform is active.
    """
    return None if _disable_functorch is None else _disable_functorch()
