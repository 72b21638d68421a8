"""``no_host_sync()``: a context manager that fails on any read of a tensor's value by the host.

On a GPU a value read (``.item()``, ``bool(t)``, ``if t:``, ``float(t)``, ``.tolist()``, a
data-dependent ``nonzero``) waits for every queued kernel. On the CPU nothing waits, so the
read is invisible; this mode makes it visible: every such read goes through
``aten._local_scalar_dense`` (or ``aten.nonzero``/``aten.equal``, which also hand a value to
Python), and the mode raises ``HostSyncError`` there, naming the operator.

Use it around the forward and the backward of the code under test::

    with no_host_sync():
        loss = SF.cross_entropy(x, t, normalizer=n)
        loss.backward()

On CUDA, `cuda_sync_debug` adds torch's own check (``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncError", "NoHostSync", "no_host_sync", "cuda_sync_debug"]

_aten = torch.ops.aten
# operators that return a value to the host (their result's size or content)
_SYNCING = {
    _aten._local_scalar_dense.default,
    _aten.nonzero.default,
    _aten.equal.default,
    _aten.is_nonzero.default,
}


class HostSyncError(RuntimeError):
    """A tensor's value was read by the host inside `no_host_sync`."""


class NoHostSync(TorchDispatchMode):
    """Raises `HostSyncError` on every operator in ``_SYNCING``; counts the operators it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SYNCING or func.overloadpacket in {f.overloadpacket for f in _SYNCING}:
            raise HostSyncError(f"host sync: {func} read a tensor's value")
        self.ops += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync() -> Iterator[NoHostSync]:
    """Inside: any host read of a tensor value raises `HostSyncError` (forward and backward)."""
    with NoHostSync() as mode:
        yield mode


@contextlib.contextmanager
def cuda_sync_debug() -> Iterator[None]:
    """torch's CUDA sync debug mode set to ``"error"`` (a no-op without CUDA)."""
    if not torch.cuda.is_available():
        yield
        return
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)
