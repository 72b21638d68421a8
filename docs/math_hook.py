"""mkdocs hook: render the math to MathML at build time, so the site needs no script and no
network to show it.

``pymdownx.arithmatex`` (generic mode) wraps every ``$…$`` / ``$$…$$`` of the pages and the
docstrings in ``<span class="arithmatex">\\(…\\)</span>`` or ``<div class="arithmatex">\\[…\\]</div>``;
this hook replaces each with the MathML that ``latex2mathml`` writes, which browsers draw
natively (MathML Core). TeX it cannot convert is logged as a warning, so
``mkdocs build --strict`` fails rather than publishing raw TeX.
"""

from __future__ import annotations

import html
import logging
import re

log = logging.getLogger("mkdocs.hooks.math")

_MATH = re.compile(
    r'<(?P<tag>span|div) class="arithmatex">\s*'
    r"(?:\\\((?P<inline>.*?)\\\)|\\\[(?P<block>.*?)\\\])"
    r"\s*</(?P=tag)>",
    re.S,
)


def to_mathml(tex: str, display: bool) -> str:
    """The MathML of one TeX formula (``display``: a block)."""
    from latex2mathml.converter import convert

    return convert(tex.strip(), display="block" if display else "inline")


def render(text: str, where: str = "") -> str:
    """``text`` with every arithmatex span or div replaced by its MathML."""

    def one(m: re.Match) -> str:
        block = m.group("block") is not None
        tex = html.unescape(m.group("block") if block else m.group("inline"))
        try:
            out = to_mathml(tex, block)
        except Exception as e:  # noqa: BLE001 - any converter failure is a build warning
            log.warning("math in %s not rendered (%s: %s): %s", where, type(e).__name__, e, tex[:80])
            return m.group(0)
        return f'<div class="math">{out}</div>' if block else out

    return _MATH.sub(one, text)


def on_page_content(content: str, page, **kwargs) -> str:
    return render(content, page.file.src_path)
