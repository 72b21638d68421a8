"""Measure ``stablelosses lint`` on code nobody here wrote.

The hazardous corpus is a list of places in public repositories (``tests/lint_corpus/hazardous.json``:
repository, path, commit, line range, the rule codes that name the hazard there). The snippets
themselves are not in this repository: ``--fetch`` downloads each file at its commit from GitHub
into ``tests/lint_corpus/hazardous/`` (ignored by git), with the source in a header comment;
``--from-local ROOT`` takes them from local checkouts laid out as ``ROOT/owner+name/path``.

Measured, in one run:

- **recall**: the snippets where a finding with one of the expected codes is reported;
- **--fix finiteness**: for the snippets with a rewrite, the code after ``--fix`` compiles, and
  where ``tests/lint_corpus/runs.py`` has inputs for it, the rewritten code is run next to the old
  one: finite value and gradient at the input that made the old one non-finite, the old value and
  gradient at a healthy input;
- **docs**: every finding names a rule whose docs section and hazard page exist;
- **false alarms** on a clean set (the installed transformers, lightning, torch, timm and
  torchvision sources, found without importing them): every finding is looked up in
  ``tests/lint_corpus/clean_verdicts.json`` (read by hand: true or false, and why); the unread ones
  are listed.

Run: ``PYTHONPATH=. python benchmarks/lint_corpus.py [--fetch | --from-local ROOT] [--clean]``.
Without the snippets (no network, no checkouts) ``--clean`` measures the clean set alone.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "lint_corpus"
CACHE = CORPUS / "hazardous"
# the clean set: installed packages whose sources are linted for false alarms
CLEAN = ("transformers", "lightning", "torch", "timm", "torchvision")
PRELUDE = "import math\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"


def manifest() -> list[dict]:
    return json.loads((CORPUS / "hazardous.json").read_text(encoding="utf-8"))


def _slice(text: str, lines: list[int] | None) -> str:
    if lines is None:
        return text
    a, b = lines
    return textwrap.dedent("\n".join(text.splitlines()[a - 1:b])) + "\n"


def _header(e: dict) -> str:
    span = f"#L{e['lines'][0]}-L{e['lines'][1]}" if e["lines"] else ""
    return (f"# source: https://github.com/{e['repo']}/blob/{e['commit']}/{e['path']}{span}\n"
            f"# expect: {', '.join(e['expect'])}\n")


def materialize(fetch: bool, local: Path | None) -> None:
    CACHE.mkdir(exist_ok=True)
    for e in manifest():
        if local is not None:
            text = (local / e["repo"].replace("/", "+") / e["path"]).read_text(encoding="utf-8")
        elif fetch:
            url = f"https://raw.githubusercontent.com/{e['repo']}/{e['commit']}/{urllib.parse.quote(e['path'])}"
            with urllib.request.urlopen(url, timeout=30) as r:  # noqa: S310 - a fixed https host
                text = r.read().decode("utf-8")
        else:
            return
        (CACHE / f"{e['id']}.py").write_text(_header(e) + _slice(text, e["lines"]), encoding="utf-8")


def _grads_finite(value, leaves) -> bool:
    import torch

    if not torch.isfinite(value).all():
        return False
    grads = torch.autograd.grad(value.sum(), leaves, allow_unused=True)
    return all(g is None or bool(torch.isfinite(g).all()) for g in grads)


def _value_and_grads(value, leaves):
    import torch

    grads = torch.autograd.grad(value.sum(), leaves, allow_unused=True)
    return value.detach(), [None if g is None else g.detach() for g in grads]


def execute(eid: str, old_src: str, new_src: str) -> str | None:
    """'finite' (old non-finite at the hazard input, new finite there and equal at the healthy
    one), 'changed' (values differ at the healthy input), 'still' (new still non-finite),
    'old-finite' (the hazard input did not break the old code), or None (no inputs for it)."""
    import torch

    sys.path.insert(0, str(CORPUS))
    from runs import RUNS  # type: ignore[import-not-found]

    if eid not in RUNS:
        return None
    run = RUNS[eid]

    def env_of(src: str) -> dict:
        env: dict = {"__name__": f"corpus_{eid}"}
        exec(compile(PRELUDE + src, f"<{eid}>", "exec"), env)
        return env

    old, new = env_of(old_src), env_of(new_src)
    torch.manual_seed(0)
    v, leaves = run(old, "hazard")
    if _grads_finite(v, leaves):
        return "old-finite"
    torch.manual_seed(0)
    v, leaves = run(new, "hazard")
    if not _grads_finite(v, leaves):
        return "still"
    torch.manual_seed(0)
    v0, g0 = _value_and_grads(*run(old, "healthy"))
    torch.manual_seed(0)
    v1, g1 = _value_and_grads(*run(new, "healthy"))

    def close(a, b) -> bool:
        if a is None or b is None:
            return a is None and b is None
        return torch.allclose(b, a, rtol=1e-4, atol=1e-6, equal_nan=True)

    same = torch.allclose(v1, v0, rtol=1e-5, atol=1e-7) and all(close(a, b) for a, b in zip(g0, g1))
    return "finite" if same else "changed"


def accuracy(eid: str, old_src: str, new_src: str) -> tuple[float, float] | None:
    """The largest relative error of the old and of the rewritten code in float32 against the
    rewritten code in float64, on the same float32 inputs (None: no inputs for it)."""
    import torch

    sys.path.insert(0, str(CORPUS))
    from runs import ACCURACY  # type: ignore[import-not-found]

    if eid not in ACCURACY:
        return None
    envs = []
    for src in (old_src, new_src):
        env: dict = {"__name__": f"corpus_{eid}"}
        exec(compile(PRELUDE + src, f"<{eid}>", "exec"), env)
        envs.append(env)
    ref = ACCURACY[eid](envs[1], torch.float64)

    def err(v):
        return float(((v.double() - ref).abs() / ref.abs()).max())

    return err(ACCURACY[eid](envs[0], torch.float32)), err(ACCURACY[eid](envs[1], torch.float32))


def hazardous() -> dict:
    from stablelosses.lint import RULES, lint_source
    from stablelosses.lint._runner import _fix_loop

    rows = []
    for e in manifest():
        path = CACHE / f"{e['id']}.py"
        src = path.read_text(encoding="utf-8")
        found = lint_source(src, path=str(path))
        codes = sorted({f.code for f in found})
        hit = any(c in e["expect"] for c in codes)
        fixable = any(f.fix for f in found)
        # the k3 rewrite (SL116) fixes a cancellation, not an inf: measured by ``accuracy``
        accuracy_only = fixable and all(f.code == "SL116" for f in found if f.fix)
        row = {"id": e["id"], "source": f"{e['repo']}/{e['path']}", "expect": e["expect"], "found": codes,
               "hit": hit, "fixable": fixable, "accuracy_only": accuracy_only, "compiles": None, "run": None}
        if fixable:
            new, _ = _fix_loop(src, None, None, str(path))
            try:
                compile(new, str(path), "exec")
                row["compiles"] = True
            except SyntaxError:
                row["compiles"] = False
            row["run"] = execute(e["id"], src, new) if row["compiles"] else None
            row["accuracy"] = accuracy(e["id"], src, new) if row["compiles"] else None
        for f in found:
            page = ROOT / "docs" / "hazards" / f"{RULES[f.code].page}.md"
            row.setdefault("docs_ok", True)
            row["docs_ok"] = row["docs_ok"] and page.exists()
        rows.append(row)
    n = len(rows)
    hits = sum(r["hit"] for r in rows)
    fixable = [r for r in rows if r["fixable"]]
    finite = sum(r["run"] == "finite" for r in fixable)
    nonfinite = [r for r in fixable if not r["accuracy_only"]]
    kinds = ("finite", "changed", "still", "old-finite", None)
    return {"rows": rows, "n": n, "recall": hits / n, "hits": hits,
            "any_finding": sum(bool(r["found"]) for r in rows), "fixable": len(fixable),
            "compiles": sum(bool(r["compiles"]) for r in fixable), "made_finite": finite,
            "finite_share": finite / max(1, len(fixable)), "fixable_nonfinite": len(nonfinite),
            "finite_share_nonfinite": finite / max(1, len(nonfinite)),
            "runs": {str(k): sum(r["run"] == k for r in fixable) for k in kinds},
            "accuracy": {r["id"]: r["accuracy"] for r in rows if r.get("accuracy")},
            "docs_ok": all(r.get("docs_ok", True) for r in rows)}


def clean() -> dict:
    """Findings on the installed sources of ``CLEAN``, with their verdicts (keyed
    ``path:line:code`` for the installed versions)."""
    import importlib.util

    from stablelosses.lint._runner import _lint_many, iter_files

    verdicts = json.loads((CORPUS / "clean_verdicts.json").read_text(encoding="utf-8"))
    roots = []
    for mod in CLEAN:
        # located, not imported: the linter reads only the .py files, and a torchvision whose
        # compiled operators do not match the installed torch cannot be imported
        spec = importlib.util.find_spec(mod)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"clean set: {mod} is not installed (pip install --no-deps {mod})")
        roots.append(Path(next(iter(spec.submodule_search_locations))))
    files = list(iter_files(str(r) for r in roots))
    out = []
    for res in _lint_many(files, None, None):
        for r in res.reports:
            rel = r.path.split("site-packages/", 1)[-1]
            line = Path(r.path).read_text(encoding="utf-8").splitlines()[r.line - 1].strip()
            key = f"{rel}:{r.line}:{r.code}"
            out.append({"key": key, "line": line, "verdict": verdicts.get(key, {}).get("verdict"),
                        "why": verdicts.get(key, {}).get("why")})
    false = sum(o["verdict"] == "false" for o in out)
    per = {mod: {"findings": 0, "false": 0} for mod in CLEAN}
    for o in out:
        src = per.setdefault(o["key"].split("/", 1)[0], {"findings": 0, "false": 0})
        src["findings"] += 1
        src["false"] += o["verdict"] == "false"
    return {"files": len(files), "findings": len(out), "false": false, "per_source": per,
            "unread": [o["key"] for o in out if o["verdict"] is None],
            "false_share": false / max(1, len(out)), "rows": out}


def _print_clean(c: dict) -> None:
    print(f"clean set: {c['files']} files, {c['findings']} findings, {c['false']} false "
          f"({100 * c['false_share']:.1f}%), unread {len(c['unread'])}")
    for src, n in c["per_source"].items():
        print(f"  {src}: {n['findings']} findings, {n['false']} false")
    for k in c["unread"]:
        print(f"  unread: {k}")


def _clean_only(a: argparse.Namespace) -> int:
    c = clean()
    _print_clean(c)
    if a.json:
        text = json.dumps({"clean": c}, indent=1, ensure_ascii=False, default=str)
        a.json.write_text(text, encoding="utf-8")
    return 0 if c["false_share"] <= 0.1 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fetch", action="store_true", help="download the snippets from GitHub first")
    p.add_argument("--from-local", type=Path, default=None, help="take the snippets from local checkouts")
    p.add_argument("--clean", action="store_true", help="also lint the clean set")
    p.add_argument("--json", type=Path, default=None, help="write the full results here")
    a = p.parse_args(argv)
    materialize(a.fetch, a.from_local)
    if not any(CACHE.glob("*.py")):
        print("no snippets: run with --fetch (network) or --from-local ROOT", file=sys.stderr)
        if not a.clean:
            return 2
        print("hazardous set skipped; clean set only", file=sys.stderr)
        return _clean_only(a)
    h = hazardous()
    print(f"hazardous snippets: {h['n']}; expected hazard found: {h['hits']} ({100 * h['recall']:.1f}%); "
          f"any finding: {h['any_finding']}")
    print(f"fixable: {h['fixable']}; compile after --fix: {h['compiles']}; made finite with the old values "
          f"elsewhere: {h['made_finite']} ({100 * h['finite_share']:.1f}% of all fixable; "
          f"{100 * h['finite_share_nonfinite']:.1f}% of the {h['fixable_nonfinite']} whose hazard is an inf "
          f"or NaN, not a cancellation); runs: {h['runs']}")
    for k, (before, after) in h["accuracy"].items():
        print(f"  accuracy {k}: float32 relative error {before:.1e} before --fix, {after:.1e} after")
    for r in h["rows"]:
        if r["fixable"] and r["run"] != "finite":
            print(f"  fixable, not shown finite: {r['id']} {r['source']} {r['found']} run={r['run']}")
    print(f"every finding names an existing docs page: {h['docs_ok']}")
    for r in h["rows"]:
        if not r["hit"]:
            print(f"  missed {r['id']} {r['source']} (expected {'/'.join(r['expect'])}, found {r['found']})")
    result = {"hazardous": h}
    if a.clean:
        c = clean()
        result["clean"] = c
        _print_clean(c)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1, ensure_ascii=False, default=str), encoding="utf-8")
    ok = h["recall"] >= 0.9 and h["finite_share_nonfinite"] >= 0.7
    ok = ok and (not a.clean or result["clean"]["false_share"] <= 0.1)
    return 0 if ok and not math.isnan(h["recall"]) else 1


if __name__ == "__main__":
    sys.exit(main())
