"""The Flake8 plugin (lint only): ``flake8 --select SL``. Flake8 handles ``# noqa`` itself.

Registered as the ``SL`` entry point of ``flake8.extension``; nothing here imports flake8.

Example:
    >>> import ast
    >>> from stablelosses.lint.flake8_plugin import Plugin
    >>> src = "import torch\\ny = torch.log(torch.sigmoid(x))\\n"
    >>> plugin = Plugin(ast.parse(src), src.splitlines(True))
    >>> [(line, col, msg.split()[0]) for line, col, msg, _ in plugin.run()]
    [(2, 4, 'SL104')]
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from typing import Any

from stablelosses import __version__
from stablelosses.lint._analysis import Module
from stablelosses.lint._rules import check_tree

__all__ = ["Plugin"]


class Plugin:
    """Flake8 calls ``Plugin(tree, lines).run()``; each result is ``(line, col, message, type)``."""

    name = "stablelosses"
    version = __version__

    def __init__(self, tree: ast.Module, lines: Sequence[str] | None = None, filename: str = "") -> None:
        self.tree = tree
        self.lines = list(lines) if lines is not None else None
        self.filename = filename

    def run(self) -> Iterator[tuple[int, int, str, Any]]:
        if self.lines is not None:
            source = "".join(self.lines)
        else:
            try:
                with open(self.filename, encoding="utf-8") as fh:
                    source = fh.read()
            except OSError:
                source = ast.unparse(self.tree)
        for f in check_tree(Module(source, self.tree, self.filename)):
            hint = f"use {f.fix}" if f.fix else f.no_fix
            yield f.line, f.col, f"{f.code} {f.message} ({hint})", type(self)
