"""The built docs site works offline: no page loads a script or a stylesheet from another host,
and no TeX is left for a script to typeset (docs/math_hook.py renders it to MathML at build time).

Usage: python .ci/check_site.py SITE_DIR  (exit 1, listing the offending pages, when it does not)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

EXTERNAL = re.compile(r'<(?:script|link)\b[^>]*\b(?:src|href)="(?:https?:)?//[^"]*"', re.I)
RAW_TEX = re.compile(r'class="arithmatex"')


def problems(site: Path) -> list[str]:
    out = []
    pages = sorted(site.rglob("*.html"))
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for m in EXTERNAL.finditer(text):
            if "preconnect" not in m.group(0):
                out.append(f"{page.relative_to(site)}: external resource {m.group(0)[:120]}")
        if RAW_TEX.search(text):
            out.append(f"{page.relative_to(site)}: math left as TeX for a script")
    if not pages:
        out.append(f"no pages under {site}")
    return out


if __name__ == "__main__":
    found = problems(Path(sys.argv[1]))
    for p in found:
        print(p)
    print(f"site offline check: {len(found)} problems")
    sys.exit(1 if found else 0)
