"""Which implementation the public functions run: the pure-PyTorch path or the Triton kernels.

The choice is made per call from things the graph cannot see differently — the selected
backend, the tensor's device and dtype, whether triton is installed, whether ``torch.compile``,
a ``torch.func`` transform or forward-mode AD is active — never from tensor values or sizes.

* ``"torch"``: the pure-PyTorch path everywhere.
* ``"triton"``: the kernels in ``stablelosses._triton`` for CUDA tensors, and for CPU tensors
  while ``TRITON_INTERPRET=1`` (how the tests run them without a GPU); other CPU tensors, other
  devices and float64 take the torch path.
* ``"auto"`` (the default): ``"torch"`` until a device run has shown the kernels faster than the
  torch path at every benchmark shape (``docs/gpu-kernels.md`` keeps that record).

Selection, by precedence: the innermost :func:`backend` context, then :func:`set_backend`,
then the environment variable ``STABLELOSSES_BACKEND`` (read at each call while neither is
set), then ``"auto"``. This module never imports triton.

The kernels sit on top of the core: ``stablelosses._triton`` registers one function per op into
the backend table (:func:`register_kernel`) when ``stablelosses`` is imported, and a public
function asks :func:`dispatch` after its own argument checks. Nothing in ``functional/``,
``_autograd/`` or ``losses.py`` imports ``_triton``.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from stablelosses._compat import forward_ad_active, functorch_transforms_active

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "STABLELOSSES_BACKEND"

# True once a device run has shown the kernels faster at every benchmark shape; until then
# "auto" means "torch" until a device run shows the kernels faster (docs/gpu-kernels.md).
_AUTO_PICKS_TRITON = False

_global: list[str | None] = [None]
_scoped: contextvars.ContextVar[str | None] = contextvars.ContextVar("stablelosses_backend", default=None)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The backend table: op name -> kernel. A kernel takes the public function (the torch path, for
# its double backward) and that function's checked arguments, and returns the result, or None
# for a call outside what it covers (then the torch path runs).
Kernel = Callable[..., Any]
_KERNELS: dict[str, Kernel] = {}


def triton_installed() -> bool:
    """True when the ``triton`` package can be imported (looked up, not imported)."""
    return importlib.util.find_spec("triton") is not None


def _check_name(fn: str, name: object) -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"{fn}: backend must be 'auto', 'torch' or 'triton', got {name!r}")
    if name == "triton" and not triton_installed():
        raise RuntimeError(f"{fn}: backend 'triton' needs the triton package (pip install triton)")
    return name


def set_backend(name: str) -> None:
    r"""Select the implementation of the softmax-family functions and the classification losses.

    Args:
        name: ``'auto'`` (the default: the torch path until a device run has shown the kernels
            faster), ``'torch'`` (the pure-PyTorch path everywhere) or ``'triton'`` (the fused
            Triton kernels for CUDA tensors, and for CPU tensors under ``TRITON_INTERPRET=1``).

    Raises:
        ValueError: ``name`` is not one of the three.
        RuntimeError: ``'triton'`` while the triton package is not installed.

    Example:
        >>> import stablelosses as sl
        >>> sl.set_backend("torch")
        >>> sl.get_backend()
        'torch'
        >>> sl.set_backend("auto")
    """
    _global[0] = _check_name("set_backend", name)


def get_backend() -> str:
    """The backend in force here: the innermost :func:`backend` context, else
    :func:`set_backend`'s, else ``STABLELOSSES_BACKEND``, else ``'auto'``.

    Raises:
        ValueError: ``STABLELOSSES_BACKEND`` names no backend.
    """
    name = _scoped.get()
    if name is None:
        name = _global[0]
    if name is None:
        env = os.environ.get(ENV_VAR, "").strip().lower()
        name = _check_name(ENV_VAR, env) if env else "auto"
    return name


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Run the block with backend ``name`` (``'auto'``, ``'torch'`` or ``'triton'``), then restore
    the previous choice. Context-local: each thread and asyncio task has its own.

    Raises:
        ValueError: ``name`` is not one of the three.
        RuntimeError: ``'triton'`` while the triton package is not installed.

    Example:
        >>> import torch, stablelosses as sl
        >>> with sl.backend("torch"):
        ...     sl.get_backend()
        'torch'
    """
    token = _scoped.set(_check_name("backend", name))
    try:
        yield
    finally:
        _scoped.reset(token)


def use_triton(x: torch.Tensor) -> bool:
    """True when a call on ``x`` should run the Triton kernels (see the module docstring).

    Inductor generates its own kernels, so while compiling the torch spelling is traced; the
    kernels are first order, so ``torch.func`` transforms and forward-mode AD take the torch path.
    """
    if torch.compiler.is_compiling():  # first: Dynamo cannot trace a ContextVar lookup
        return False
    name = get_backend()
    if name == "auto":
        name = "triton" if _AUTO_PICKS_TRITON else "torch"
    if name != "triton" or x.dtype not in _KERNEL_DTYPES:
        return False
    if x.device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
            return False
    elif x.device.type != "cuda":
        return False
    if functorch_transforms_active() or forward_ad_active():
        return False
    return triton_installed()


def register_kernel(name: str, kernel: Kernel) -> None:
    """Put ``kernel`` into the backend table under op ``name`` (``stablelosses._triton`` does this
    for its kernels; a second registration replaces the first)."""
    _KERNELS[name] = kernel


def kernel_for(name: str, x: torch.Tensor) -> Kernel | None:
    """The kernel registered under ``name`` when a call on ``x`` should run the kernels
    (:func:`use_triton`), else ``None``.

    The table is never read while compiling: Dynamo would then guard on it, and
    ``stablelosses._triton`` fills it when the top-level package first loads, possibly in the
    middle of a trace. In eager mode the table is read first: an empty one (the top-level
    package not loaded) answers before :func:`use_triton`'s backend and environment look-ups.
    """
    if torch.compiler.is_compiling():
        return None
    kernel = _KERNELS.get(name)
    if kernel is None or not use_triton(x):
        return None
    return kernel


def dispatch(name: str, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """The kernel registered under ``name`` on ``(x, *args, **kwargs)`` when the kernels are
    selected for ``x``, else ``None`` (then the caller runs its torch path).

    A public function calls this after its own argument checks, with the checked values.
    """
    kernel = kernel_for(name, x)
    return None if kernel is None else kernel(x, *args, **kwargs)
