"""The placement-scale benchmark, run for real on its three quick sizes (about a second): both
variants reach the reference's optimum, the JSON has every run, the section has the table; and
a row of runs cut short says so (no plan, the proven gap)."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.benchmarks import placement_scale as bench


def test_a_quick_run_records_json_and_section(tmp_path):
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    args = parser.parse_args(["--quick", "--rounds", "1", "--json", str(tmp_path / "ps.json"),
                              "--doc", str(tmp_path / "B.md")])
    assert bench.run(args) == 0
    result = json.loads((tmp_path / "ps.json").read_text())
    names = [c["name"] for c in result["cases"]]
    assert names == [c.name for c in bench.QUICK]
    for name in names:
        ref = result["reference"][name]
        assert ref["plan"] and ref["optimal"]
        for variant in ("auto", "cuts"):
            (run,) = result["runs"][name][variant]
            assert run["plan"] and run["optimal"] and run["gap"] == 0.0
            assert run["objective_ms"] == pytest.approx(ref["objective_ms"], rel=1e-6)
    doc = (tmp_path / "B.md").read_text()
    assert "<!-- placement-scale:start -->" in doc and "python -m tests.benchmarks placement-scale --quick" in doc
    assert "| 4×8 alike latency | brute force" in doc and "| 8×16 alike latency | cuts 60 s:" in doc


def test_a_row_cut_short_shows_no_plan_and_the_gap():
    ref = {"plan": True, "optimal": True, "objective_ms": 100.0}
    runs = [{"seconds": 10.2, "plan": True, "objective_ms": 103.0, "optimal": False, "gap": 0.05},
            {"seconds": 10.4, "plan": False},
            {"seconds": 9.9, "plan": True, "objective_ms": 101.0, "optimal": False, "gap": 0.02}]
    secs, vs, proven = bench._cell(runs, ref)
    assert secs == "10.20" and vs == "+3.00 %"
    assert proven == "optimal 0/3, gap ≤ 5 %, no plan 1/3"
    assert bench._cell([{"seconds": 10.0, "plan": False}], ref) == ("10.00", "no plan", "-")
    unproven = {"plan": True, "optimal": False, "objective_ms": 206.0}
    assert bench._cell(runs[:1], unproven)[1] == "-50.00 %"  # better than the reference's best
    assert bench._cell(runs[:1], {"plan": False})[1] == "103.00 ms"
