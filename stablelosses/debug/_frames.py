"""Where code lives: frames inside torch are skipped; stablelosses' own functions are trusted."""

from __future__ import annotations

import os
import sys

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DEBUG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Files of this package that count as user code: the demo, the naive formulas people write
# (wherever they live: any module whose name holds "naive"), the benchmark harness and the CLI
# (its runpy). Everything else in the package is library code, checked at its public boundary.
_PKG_USER_FILES = {os.path.join(_PKG_DIR, f) for f in ("_demo.py", "cli.py", "__main__.py")}


def _is_user_file(absfn: str) -> bool:
    rel = absfn[len(_PKG_DIR):]
    return absfn in _PKG_USER_FILES or "naive" in os.path.basename(rel) or rel.startswith(
        ("bench" + os.sep, "demo" + os.sep, "_demo" + os.sep)
    )


_SKIP, _USER, _TRUSTED = 0, 1, 2
_code_kind: dict = {}


def _kind_of(code) -> int:
    kind = _code_kind.get(code)
    if kind is None:
        fn = code.co_filename
        absfn = os.path.abspath(fn) if not fn.startswith("<") else fn
        if absfn.startswith((_DEBUG_DIR, _TORCH_DIR)) or fn.startswith("<frozen"):
            kind = _SKIP
        elif absfn.startswith(_PKG_DIR) and not _is_user_file(absfn):
            kind = _TRUSTED
        elif "/torch/" in fn and ("/_dynamo/" in fn or "/_inductor/" in fn):
            kind = _SKIP
        else:
            kind = _USER
        _code_kind[code] = kind
    return kind


def _user_frame(frame):
    """(first user frame, whether a stablelosses frame was passed to reach it)."""
    trusted = False
    while frame is not None:
        kind = _kind_of(frame.f_code)
        if kind == _USER:
            return frame, trusted
        if kind == _TRUSTED:
            trusted = True
        frame = frame.f_back
    return None, trusted


def _user_line(frame) -> tuple[str | None, int | None]:
    """(file name, line number) of the first user frame from ``frame`` outward, or (None, None)."""
    uf, _ = _user_frame(frame)
    return (uf.f_code.co_filename, uf.f_lineno) if uf is not None else (None, None)


def _nearest_is_trusted(frame) -> bool:
    """Whether the innermost frame outside torch belongs to stablelosses' own ops."""
    while frame is not None:
        kind = _kind_of(frame.f_code)
        if kind != _SKIP:
            return kind == _TRUSTED
        frame = frame.f_back
    return False


def _child_name(parent, module) -> str:
    for n, m in parent.named_children():
        if m is module:
            return n
    for n, m in parent.named_modules():
        if m is module and n:
            return n
    return type(module).__name__


def _root_name(module) -> str:
    """The variable name the calling code holds the module in, else its class name."""
    frame, _ = _user_frame(sys._getframe(1))
    while frame is not None:
        for scope in (frame.f_locals, frame.f_globals):
            for k, v in scope.items():
                if v is module and not k.startswith("_") and k != "self":
                    return k
        frame = frame.f_back
        if frame is not None and _kind_of(frame.f_code) != _USER:
            break
    return type(module).__name__

