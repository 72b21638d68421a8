"""mkdocs hooks: draw the hazard figures (docs/gen_figures.py) before every build.

The figures go to ``docs/figures/`` (gitignored) before mkdocs collects the files, so the
pages can link them like any other image. Under ``mkdocs serve`` the figures are redrawn only
when a Python file of the package or the figure script changed since the last drawing, which
also keeps the written PNGs from triggering an endless rebuild loop.

A problem on the stablelosses side (an exception, a non-finite stable value) is logged as a
warning, so ``mkdocs build --strict`` fails rather than publishing a figure without the
stable curve.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.figures")

_DOCS = Path(__file__).resolve().parent
_ROOT = _DOCS.parent
_last: dict = {"stamp": None, "problems": []}


def _stamp() -> tuple:
    sources = sorted((_ROOT / "stablelosses").rglob("*.py")) + [_DOCS / "gen_figures.py"]
    sources.append(_DOCS / "gen_figures_more.py")
    return tuple((str(p), p.stat().st_mtime_ns) for p in sources)


def on_pre_build(config, **kwargs) -> None:
    stamp = _stamp()
    out_dir = Path(config["docs_dir"]) / "figures"
    if stamp != _last["stamp"] or not out_dir.is_dir():
        # Under `mkdocs serve`, drop the imported package so the figures use the edited code.
        for name in [m for m in sys.modules if m == "stablelosses" or m.startswith("stablelosses.")]:
            del sys.modules[name]
        spec = importlib.util.spec_from_file_location("_sl_gen_figures", _DOCS / "gen_figures.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        _last["problems"] = module.main(out_dir)
        # The figures of the later hazard pages (they reuse gen_figures' Row/Figure/render).
        spec = importlib.util.spec_from_file_location("_sl_gen_figures_more", _DOCS / "gen_figures_more.py")
        more = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = more
        spec.loader.exec_module(more)
        _last["problems"] += more.main(out_dir)
        _last["stamp"] = stamp
    for problem in _last["problems"]:
        log.warning("figure: %s", problem)
