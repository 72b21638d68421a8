"""Kernel count of compiled calls: how many kernels inductor's generated code launches.

`capture_output_code` records the Python wrapper that inductor writes for every graph it
compiles (also on a cache hit: inductor hands the cached wrapper to the same hook), and
`count_kernels` counts, in each wrapper's ``call`` function, the launches of generated kernels
(``cpp_fused_*`` on CPU, ``triton_*`` on CUDA) and the calls of extern kernels (aten operators
inductor did not fuse, e.g. ``extern_kernels.mm``). A forward+backward compiled like torch's
own function shows one or two generated kernels per direction and no extern call.

The hook is ``GraphLowering.save_output_code`` (what ``torch._inductor.utils.run_and_get_code``
uses); on a torch without it the count is ``None``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["KernelCount", "capture_output_code", "count_kernels"]

_DEF = re.compile(r"^(\w+)\s*=\s*async_compile\.\w+\(", re.MULTILINE)
_EXTERN = re.compile(r"\b(extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?|aten\.\w+(?:\.\w+)?)\s*\(")


@dataclass(frozen=True)
class KernelCount:
    """Kernels launched by the compiled graphs of one call."""

    generated: int
    extern: int
    graphs: int

    @property
    def total(self) -> int:
        return self.generated + self.extern


def _call_body(code: str) -> str:
    start = code.find("def call(")
    if start < 0:
        return ""
    end = code.find("\nrunner = ", start)
    if end < 0:
        end = code.find("\ndef get_args(", start)
    return code[start:] if end < 0 else code[start:end]


def count_kernels(codes: list[str]) -> KernelCount:
    """Count generated-kernel launches and extern calls in inductor output code."""
    generated = extern = 0
    for code in codes:
        names = set(_DEF.findall(code))
        body = _call_body(code)
        for name in names:
            generated += len(re.findall(rf"\b{re.escape(name)}(?:\.run)?\(", body))
        extern += len(_EXTERN.findall(body))
    return KernelCount(generated, extern, len(codes))


@contextlib.contextmanager
def capture_output_code() -> Iterator[list[str] | None]:
    """Yield a list that receives the wrapper code of every graph inductor compiles inside.

    Yields ``None`` when this torch has no ``GraphLowering.save_output_code`` hook.
    """
    try:
        from torch._inductor.graph import GraphLowering
    except ImportError:  # pragma: no cover - torch without inductor
        yield None
        return
    if not hasattr(GraphLowering, "save_output_code"):  # pragma: no cover - other torch versions
        yield None
        return
    codes: list[str] = []
    saved: Any = GraphLowering.save_output_code
    GraphLowering.save_output_code = codes.append  # type: ignore[assignment]
    try:
        yield codes
    finally:
        GraphLowering.save_output_code = saved  # type: ignore[method-assign]
