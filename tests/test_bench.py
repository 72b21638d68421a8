"""The benchmark harness: bytes counter, kernel count, a tiny run, the tables and the CLI.

Speed is not asserted here (benchmarks only); these tests check that the harness measures what
it says it measures.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.nn.functional as F

from stablelosses import cli
from stablelosses.bench import cli as bench_cli
from stablelosses.bench.cases import specs
from stablelosses.bench.checks import TARGETS
from stablelosses.bench.kernels import count_kernels
from stablelosses.bench.report import format_table, index, ratio_rows
from stablelosses.bench.run import Settings, run
from stablelosses.bench.targets import GOALS, format_goals, goal_rows
from stablelosses.bench.timing import kernel_count, make_callable
from stablelosses.bench.traffic import BytesMoved, bytes_moved, tensor_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 1000


# ---- bytes moved ---------------------------------------------------------------------------


def test_add_reads_two_inputs_and_writes_one_output():
    a, b = torch.ones(N), torch.ones(N)
    with BytesMoved() as moved:
        torch.add(a, b)
    assert (moved.read, moved.written, moved.ops) == (2 * N * 4, N * 4, 1)
    assert moved.total == 3 * N * 4
    assert dict(moved.per_op) == {"add": 3 * N * 4}


def test_dtype_size_counts():
    a = torch.ones(N, dtype=torch.float64)
    with BytesMoved() as moved:
        a.to(torch.float16)
    assert (moved.read, moved.written) == (N * 8, N * 2)


def test_in_place_reads_and_writes_like_out_of_place():
    a, b = torch.ones(N), torch.ones(N)
    with BytesMoved() as moved:
        a.mul_(b)
    assert (moved.read, moved.written) == (2 * N * 4, N * 4)


def test_views_and_allocators_move_nothing():
    a = torch.ones(10, 100)
    with BytesMoved() as moved:
        v = a.view(100, 10).t().unsqueeze(0)[0].detach()
        torch.empty(N)
        torch.empty_like(a)
    assert (moved.total, moved.ops) == (0, 0)
    assert v.shape == (10, 100)


def test_broadcast_argument_counts_its_distinct_elements():
    x, row = torch.ones(100, 10), torch.ones(10)
    assert tensor_bytes(row.expand(100, 10)) == 10 * 4
    with BytesMoved() as moved:
        x * row.expand(100, 10)
    assert moved.read == (N + 10) * 4 and moved.written == N * 4


def test_backward_is_counted():
    x = torch.ones(N, requires_grad=True)
    with BytesMoved() as fwd:
        x.exp().sum()
    with BytesMoved() as both:
        torch.autograd.grad(x.exp().sum(), [x])
    # forward: exp reads N, writes N; sum reads N, writes 1 (4-byte scalars)
    assert fwd.total == (2 * N + N + 1) * 4
    # backward adds at least exp's backward (grad expanded from a scalar times exp(x): >= 2N)
    assert both.total >= fwd.total + 2 * N * 4
    assert both.ops > fwd.ops


def test_bytes_moved_of_cross_entropy_matches_its_passes():
    x, t = torch.randn(64, 100, requires_grad=True), torch.randint(0, 100, (64,))
    moved = bytes_moved(lambda: F.cross_entropy(x, t))
    # log_softmax reads and writes the logits; nll_loss reads one log-probability per row
    assert moved.per_op["_log_softmax"] == 2 * 64 * 100 * 4
    # the target, one entry per row; the loss and the total weight
    assert moved.per_op["nll_loss_forward"] == 64 * 8 + 64 * 4 + 2 * 4
    assert 2 * 64 * 100 * 4 <= moved.total < 3 * 64 * 100 * 4


def test_indexed_operators_count_what_they_touch():
    src = torch.randn(64, 100)
    index = torch.randint(0, 100, (64, 1))
    with BytesMoved() as moved:
        got = src.gather(1, index)
    assert moved.read == 64 * 8 + 64 * 4 and moved.written == got.numel() * 4
    dest, ones = torch.zeros(64, 100), torch.ones(64, 1)
    with BytesMoved() as moved:
        dest.scatter_add_(1, index, ones)
    assert moved.read == 64 * 8 + 64 * 4 and moved.written == 64 * 4


# ---- kernel count --------------------------------------------------------------------------

_CODE = '''
cpp_fused_add_0 = async_compile.cpp_pybinding(['float*'], r\'\'\'
void kernel(float* x) {}
\'\'\')
triton_red_fused_1 = async_compile.triton('triton_red_fused_1', \'\'\'
def triton_red_fused_1(): pass
\'\'\')

class Runner:
    def call(self, args):
        buf0 = empty_strided_cpu((4, ), (1, ), torch.float32)
        cpp_fused_add_0(buf0)
        extern_kernels.mm(buf0, buf0, out=buf1)
        triton_red_fused_1.run(buf0, stream=stream0)
        cpp_fused_add_0(buf1)
        return (buf0, )

runner = Runner(partitions=[])
call = runner.call

def get_args():
    cpp_fused_add_0(nothing)
'''


def test_count_kernels_counts_launches_in_call():
    kc = count_kernels([_CODE, _CODE])
    assert (kc.generated, kc.extern, kc.graphs, kc.total) == (6, 2, 2, 8)
    assert count_kernels([]).total == 0


@pytest.mark.slow
def test_kernel_count_of_compiled_calls():
    spec = specs()["logsumexp"]
    x = torch.randn(8, 10)
    counts = {}
    for v in ("torch-compiled", "stable-compiled"):
        call = make_callable(spec, v, [x], (0,), "fwdbwd", "cpu", key=("test-8x10",))
        assert torch.isfinite(call()[0]).all()
        counts[v] = kernel_count(spec, v, "fwdbwd", ("test-8x10",))
    for kc in counts.values():
        assert kc is not None and kc.graphs == 2  # forward and backward
        assert kc.generated >= 2 and kc.total == kc.generated + kc.extern
    assert kernel_count(spec, "stable", "fwdbwd", ("test-8x10",)) is None


# ---- a tiny run ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run():
    settings = Settings(tier="quick", only=("safe_sqrt", "softmax"), repeats=2, sample_s=5e-4,
                        warm_s=0.0, min_warm=1)
    return run(settings, progress=False)


@pytest.mark.slow  # times a real run of the harness
def test_tiny_run_records_every_variant_and_mode(tiny_run):
    recs = tiny_run["results"]
    assert tiny_run["schema"].startswith("stablelosses-bench/")
    keys = {(r["fn"], r["case"], r["mode"], r["variant"]) for r in recs}
    for fn, cases, variants in (("safe_sqrt", ("1e5", "16"), ("torch", "stable", "one-pass")),
                                ("softmax", ("1024x1000", "8x10"), ("torch", "naive", "stable", "one-pass"))):
        for case in cases:
            for mode in ("fwd", "fwdbwd"):
                for v in variants:
                    assert (fn, case, mode, v) in keys
    for r in recs:
        assert r["error"] is None, r
        assert r["median_s"] > 0 and len(r["times_s"]) == 2
        assert r["bytes_read"] > 0 and r["bytes_written"] > 0 and r["aten_ops"] >= 1
        assert ("peak_bytes" in r) == (r["mode"] == "fwdbwd")


@pytest.mark.slow  # times a real run of the harness
def test_tiny_run_bytes_of_torch_softmax_are_one_read_one_write(tiny_run):
    (rec,) = [r for r in tiny_run["results"]
              if (r["fn"], r["case"], r["mode"], r["variant"]) == ("softmax", "1024x1000", "fwd", "torch")]
    assert rec["bytes_read"] == rec["bytes_written"] == 1024 * 1000 * 4


@pytest.mark.slow  # times a real run of the harness
def test_tiny_run_tables(tiny_run):
    rows = ratio_rows(tiny_run)
    assert len(rows) == 8
    soft = next(r for r in rows if (r["fn"], r["case"], r["mode"]) == ("softmax", "1024x1000", "fwdbwd"))
    assert soft["vs_torch"] > 0 and soft["bytes_vs_ref"] > 0 and soft["peak_vs_ref"] > 0
    text = format_table(tiny_run)
    for col in ("ours ms", "÷torch", "MB moved", "bytes÷torch", "peak÷torch"):
        assert col in text.splitlines()[0]
    md = format_table(tiny_run, markdown=True)
    assert md.startswith("| function |") and md.count("\n") == 2 + len(rows) - 1


@pytest.mark.slow  # times a real run of the harness
def test_tiny_run_goal_table(tiny_run):
    rows = goal_rows(index(tiny_run["results"]))
    soft = [r for r in rows if r["fn"] == "softmax"]
    assert {r["target"] for r in soft} >= {"≤ 1.15× torch.softmax", "bytes ≤ 1.3× torch's"}
    for r in soft:
        assert r["status"] in ("met", "missed") or "compiled" in r["target"], r
    bytes_row = next(r for r in soft if r["goal"].kind == "bytes")
    assert bytes_row["measured"] == bytes_row["bytes"].replace("×", "") + "×"
    text = format_goals(rows)
    assert "not measured" in text  # the compiled targets: no --compile in this run


def _fake_run(stable_s: float, torch_s: float, stable_bytes: int, torch_bytes: int) -> dict:
    def rec(v, s, b, peak):
        return {"fn": "softmax", "case": "8192x1000", "dtype": "float32", "device": "cpu",
                "mode": "fwdbwd", "variant": v, "median_s": s, "error": None, "grad_bytes": 4,
                "bytes_read": b, "bytes_written": 0, "peak_bytes": peak}
    return index([rec("torch", torch_s, torch_bytes, 10**6),
                  rec("stable", stable_s, stable_bytes, 2 * 10**6)])


def test_goal_met_and_missed_from_the_numbers():
    rows = goal_rows(_fake_run(1.1, 1.0, 130, 100))
    by = {r["target"]: r for r in rows if r["fn"] == "softmax" and r["case"] == "8192x1000"}
    assert by["≤ 1.15× torch.softmax"]["status"] == "met"
    assert by["≤ 1.15× torch.softmax"]["measured"] == "1.10×"
    assert by["≤ 1.15× torch.softmax"]["bytes"] == "1.30×"
    assert by["bytes ≤ 1.3× torch's"]["status"] == "met"
    assert by["peak ≤ torch's"]["status"] == "missed"
    rows = goal_rows(_fake_run(1.2, 1.0, 131, 100))
    by = {r["target"]: r for r in rows if r["fn"] == "softmax" and r["case"] == "8192x1000"}
    assert by["≤ 1.15× torch.softmax"]["status"] == "missed"
    assert by["bytes ≤ 1.3× torch's"]["status"] == "missed"


def test_every_goal_names_a_function_and_variants_of_the_registry():
    reg = specs()
    for g in GOALS:
        assert g.fn in reg
        for v in (g.num, g.den):
            assert v.replace("-compiled", "") in reg[g.fn].variants, (g, v)
        for case in g.cases + g.quick:
            assert case in {c.label for c in reg[g.fn].cases}, (g, case)


def test_every_per_input_check_of_checks_csv_is_well_formed():
    reg = specs()
    assert len(TARGETS) == 50
    for t in TARGETS:
        assert t.fn in reg, t
        assert t.kind in ("time", "overhead", "peak", "peak_grad"), t
        assert (t.den is None) == (t.kind == "peak_grad"), t
        for v in (t.num, t.den or "stable"):
            assert v.replace("-compiled", "") in reg[t.fn].variants, (t, v)
        assert 0 < t.bound < 2, t
    # the input predicates read the record kind and shape as they are written
    few = {"kind": "few-class", "shape": [65536, 10]}
    by_text = {t.text: t.where(few) for t in TARGETS if t.fn == "focal_loss"}
    assert by_text["peak <= 0.6x F.cross_entropy's"] and by_text["eager <= 1.30x F.cross_entropy"]
    assert not by_text["eager <= 1.10x F.cross_entropy"]


# ---- the command line ----------------------------------------------------------------------


def test_stablelosses_bench_dispatches_to_the_bench_package(monkeypatch):
    calls = []
    monkeypatch.setattr("stablelosses.bench.main", lambda argv: calls.append(argv) or 0)
    assert cli.main(["bench", "--quick", "--json", "out.json"]) == 0
    assert calls == [["--quick", "--json", "out.json"]]


@pytest.mark.parametrize("args, message", [
    (["--repeats", "0"], "--repeats: must be >= 1"),
    (["--threads", "0"], "--threads: must be >= 1"),
    (["--only", "nope"], "invalid function nope"),
    (["--quick", "--full"], "not allowed with"),
])
def test_bench_bad_arguments(args, message, capsys):
    assert cli.main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err


@pytest.mark.slow  # times a real run of the harness
def test_bench_main_quick_subset_writes_json_markdown_and_targets(tmp_path, capsys):
    js, md = tmp_path / "b.json", tmp_path / "b.md"
    code = bench_cli.main(["--quick", "--only", "safe_sqrt", "--repeats", "1", "--no-reexec",
                           "--no-progress", "--targets", "--raw", "--json", str(js), "--markdown", str(md)])
    assert code == 0
    out = capsys.readouterr().out
    assert "speed targets" in out and "bytes ≤ 1.3× torch's" in out
    assert "issue" not in out.lower()  # the table is named by what it measures
    assert "Times are in" in out  # torch.utils.benchmark.Compare's table
    data = json.loads(js.read_text())
    assert {r["fn"] for r in data["results"]} == {"safe_sqrt"}
    assert md.read_text().count("| safe_sqrt |") == 4


def _script(name: str):
    path = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_bench_script_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # times a real run of the harness
def test_check_targets_and_make_docs_on_a_quick_run(tiny_run, tmp_path, capsys):
    js = tmp_path / "bench.json"
    js.write_text(json.dumps(tiny_run))
    code = _script("check_targets").main([str(js), "--quiet", "--goals-markdown", str(tmp_path / "goals.md")])
    assert code in (0, 1)
    out = capsys.readouterr().out
    assert "checks:" in out and "speed targets" in out and "issue-12" not in out
    assert "| softmax |" in (tmp_path / "goals.md").read_text()
    page_path = tmp_path / "benchmarks.md"
    assert _script("make_docs").main([str(js), "--out", str(page_path)]) == 0
    page = page_path.read_text()
    for section in ("## Machine and run", "## Ratios", "## Speed targets", "## Per-input checks",
                    "## Raw medians", "## Bytes moved", "## How to rerun"):
        assert section in page
    assert "| softmax | 1024x1000 | float32 | fwdbwd |" in page
