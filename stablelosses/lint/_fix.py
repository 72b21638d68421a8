"""``--fix``: the LibCST codemod that puts each finding's replacement in place of its expression
and adds the imports the replacements use; everything else (formatting, comments) is kept.

LibCST is the optional ``fix`` extra (``pip install "stablelosses[fix]"``); it is imported only
here, and only when a fix is asked for.
"""

from __future__ import annotations

import io
import tokenize
from collections.abc import Sequence

from stablelosses.lint._rules import Finding

__all__ = ["apply_fixes", "require_libcst"]


def require_libcst():
    """The ``libcst`` module, or an ImportError that names the extra to install."""
    try:
        import libcst
    except ImportError:
        raise ImportError(
            "stablelosses lint --fix/--diff needs LibCST: pip install 'stablelosses[fix]'"
        ) from None
    return libcst


def _char_col(lines: list[str], line: int, byte_col: int) -> int:
    """ast's columns count UTF-8 bytes; LibCST's count characters."""
    text = lines[line - 1] if 0 < line <= len(lines) else ""
    return len(text.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


def _comment_lines(source: str) -> list[tuple[int, int]]:
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                out.append(tok.start)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return out


def select_fixes(source: str, findings: Sequence[Finding]) -> list[Finding]:
    """The fixable findings whose spans overlap no other chosen one (the outer first) and hold
    no comment (a replacement would drop it)."""
    comments = _comment_lines(source)
    chosen: list[Finding] = []
    spans: list[tuple[tuple[int, int], tuple[int, int]]] = []
    order = sorted((f for f in findings if f.fix), key=lambda f: ((f.line, f.col), tuple(-v for v in f.end)))
    for f in order:
        a, b = (f.line, f.col), f.end
        if any(not (b <= s[0] or s[1] <= a) for s in spans):
            continue
        if any(a <= c <= b for c in comments):
            continue
        chosen.append(f)
        spans.append((a, b))
    return chosen


def apply_fixes(source: str, findings: Sequence[Finding]) -> tuple[str, int]:
    """The source with the chosen findings rewritten, and how many were."""
    require_libcst()
    import libcst as cst
    from libcst.codemod import CodemodContext
    from libcst.codemod.visitors import AddImportsVisitor
    from libcst.metadata import MetadataWrapper, PositionProvider

    lines = source.splitlines()
    chosen = select_fixes(source, findings)
    if not chosen:
        return source, 0
    by_span = {}
    for f in chosen:
        (el, ec) = f.end
        key = (f.line, _char_col(lines, f.line, f.col), el, _char_col(lines, el, ec))
        by_span[key] = f

    wrapper = MetadataWrapper(cst.parse_module(source))
    positions = wrapper.resolve(PositionProvider)
    done: list[Finding] = []

    # a binding goes only with the rewrite that stops reading it: never when that rewrite finds
    # no expression at its span
    spans = {(r.start.line, r.start.column, r.end.line, r.end.column)
             for node, r in positions.items() if isinstance(node, cst.BaseExpression)}
    drop_lines = {st.lineno for key, f in by_span.items() if key in spans for st in f.drop}

    class _Replace(cst.CSTTransformer):
        def on_leave(self, original, updated):
            if isinstance(original, cst.SimpleStatementLine) and len(original.body) == 1:
                r = positions.get(original)
                if r is not None and r.start.line in drop_lines:
                    return cst.RemoveFromParent()
                return updated
            if not isinstance(original, cst.BaseExpression):
                return updated
            r = positions.get(original)
            if r is None:
                return updated
            f = by_span.get((r.start.line, r.start.column, r.end.line, r.end.column))
            if f is None:
                return updated
            assert f.fix is not None
            new = cst.parse_expression(f.fix)
            if getattr(updated, "lpar", None) and hasattr(new, "lpar"):
                new = new.with_changes(lpar=updated.lpar, rpar=updated.rpar)
            done.append(f)
            return new

    tree = wrapper.module.visit(_Replace())
    context = CodemodContext()
    for f in done:
        for module, asname in sorted(f.imports, key=lambda t: (t[0], t[1] or "")):
            AddImportsVisitor.add_needed_import(context, module, asname=None if asname == module else asname)
    tree = AddImportsVisitor(context).transform_module(tree)
    return tree.code, len(done)
