r"""Bytes moved: a device-independent count of the memory traffic of a call.

`BytesMoved` is a ``TorchDispatchMode``: for every aten operator that runs while it is active
(forward, and the backward that autograd runs on the same thread or its worker threads), it
adds the bytes of the tensors the operator reads (its tensor arguments) and writes (its tensor
results). On a GPU a loss is bandwidth-bound, so this count, measured on the CPU, tells how a
function will compare on CUDA: one more full-size pass shows up as one more tensor's bytes.

Conventions (the model is "each operator reads its inputs once and writes its outputs once",
as an unfused eager kernel does):

* a tensor counts its distinct elements: an ``expand``\ ed argument (stride 0) counts the
  elements of the tensor it was expanded from, not its broadcast size;
* view operators (``view``, ``expand``, ``transpose``, ``select``, ``detach``, ...) move
  nothing and count 0; so do the allocators ``empty``/``empty_like``/``empty_strided``;
  ``new_zeros``/``new_ones``/``new_full`` count what they write (their ``self`` gives only
  dtype and device);
* an in-place operator reads its arguments and writes its result (the same memory): ``add_``
  of two N-element tensors counts 3N elements, as ``add`` does; an ``out=`` tensor counts
  as written only (the kernel overwrites it), also where it is one of the inputs;
* Python scalars count nothing; a 0-dimensional tensor counts its one element;
* indexed reads and writes move what they touch: ``gather`` (and ``nll_loss``'s forward) reads
  its index and the gathered elements (not the whole source), an in-place ``scatter_``/``scatter_add_``/
  ``scatter_reduce_`` reads its index and source and writes as many elements (not the whole
  destination).

Known limit: an operator whose CPU kernel makes several passes internally (``logsumexp``:
max, subtract, exp, sum; ``vector_norm`` with a wider ``dtype``: a converted copy first) is
counted as one read of its input, so its true traffic is under-counted, on torch's side as on
ours.

Compiled code (``torch.compile``) is not counted here: its fused kernels are not aten calls
(see `stablelosses.bench.kernels` for the compiled side).

Example:
    >>> import torch
    >>> from stablelosses.bench.traffic import BytesMoved
    >>> a, b = torch.ones(1000), torch.ones(1000)
    >>> with BytesMoved() as moved:
    ...     c = torch.add(a, b)
    >>> moved.read, moved.written, moved.ops
    (8000, 4000, 1)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["BytesMoved", "bytes_moved", "tensor_bytes"]

_ALLOCATORS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
_SCATTER_INPLACE = {"scatter_", "scatter_add_", "scatter_reduce_"}
_NLL_FORWARD = {"nll_loss_forward", "nll_loss2d_forward"}
_NEW_LIKE = {"new_zeros", "new_ones", "new_full"}


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of ``t``: dimensions of stride 0 (broadcast) count once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return 0
        if stride != 0:
            n *= size
    return n * t.element_size()


def _sum_bytes(tree: Any) -> int:
    leaves, _ = tree_flatten(tree)
    return sum(tensor_bytes(x) for x in leaves if isinstance(x, torch.Tensor))


class BytesMoved(TorchDispatchMode):
    """Count the bytes read and written by every aten operator run inside the ``with`` block.

    Attributes:
        read: bytes of the tensor arguments, summed over operators.
        written: bytes of the tensor results, summed over operators.
        ops: number of operators counted (views and allocators excluded).
        per_op: ``Counter`` of bytes moved (read + written) per operator name.
    """

    def __init__(self) -> None:
        super().__init__()
        self.read = 0
        self.written = 0
        self.ops = 0
        self.per_op: Counter[str] = Counter()

    @property
    def total(self) -> int:
        """Bytes read plus bytes written."""
        return self.read + self.written

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in _ALLOCATORS:
            return out
        r, w = _indexed_bytes(name, args, kwargs, out)
        self.read += r
        self.written += w
        self.ops += 1
        self.per_op[name] += r + w
        return out


def _indexed_bytes(name: str, args: tuple[Any, ...], kwargs: Any, out: Any) -> tuple[int, int]:
    """Bytes read and written by one operator (see the module's conventions)."""
    if name == "gather" and len(args) >= 3 and isinstance(args[2], torch.Tensor):
        index = args[2]
        touched = index.numel() * args[0].element_size()
        return tensor_bytes(index) + touched, _sum_bytes(out)
    if name in _NEW_LIKE:
        # new_zeros/new_full/new_ones take dtype and device from ``self``, never its values
        return 0, _sum_bytes(out)
    if name in _NLL_FORWARD and len(args) >= 2 and isinstance(args[1], torch.Tensor):
        # reads the target and one log-probability per target (plus the weight), not all C
        target = args[1]
        touched = target.numel() * args[0].element_size()
        return tensor_bytes(target) + touched + _sum_bytes(args[2:]), _sum_bytes(out)
    if name in _SCATTER_INPLACE and len(args) >= 3 and isinstance(args[2], torch.Tensor):
        index = args[2]
        src = _sum_bytes(args[3:]) if len(args) > 3 else 0
        touched = index.numel() * args[0].element_size()
        return tensor_bytes(index) + src, touched
    # an out= tensor is written (the result), not read
    inputs = {k: v for k, v in kwargs.items() if k != "out"} if kwargs else kwargs
    return _sum_bytes((args, inputs)), _sum_bytes(out)


def bytes_moved(call: Callable[[], Any]) -> BytesMoved:
    """Run ``call()`` once under `BytesMoved` and return the counter."""
    with BytesMoved() as moved:
        res = call()
        del res
    return moved
