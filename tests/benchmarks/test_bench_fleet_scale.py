"""The fleet-scale benchmark, run for real at a toy size: a ``deskfleet fleet`` process and 6
simulated agents in one worker, a 3 s window; every figure is in the JSON and the section has
the table with the command that made it."""

from __future__ import annotations

import argparse
import json

from tests.benchmarks import fleet_scale as bench


def test_a_toy_run_records_json_and_section(tmp_path, private_keyring):
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    args = parser.parse_args(["--agents", "6", "--window", "3", "--settle", "0", "--flap-per-s", "4",
                              "--register-s", "1", "--json", str(tmp_path / "fleet-scale.json"),
                              "--doc", str(tmp_path / "B.md")])
    assert bench.run(args) == 0
    (result,) = json.loads((tmp_path / "fleet-scale.json").read_text())["results"]
    assert result["agents"] == 6 and result["listed"] == 6 and result["approved"] == 6
    assert result["service_cores"] > 0 and result["service_rss_mb"] > 20
    assert result["registrations"] >= 6 and result["register_p95_ms"] >= result["register_p50_ms"] > 0
    assert result["join_p95_ms"] >= result["join_p50_ms"] > 0 and result["joins_per_s"] > 0
    assert result["tokens_per_s"] > 0 and result["approvals_per_s"] > 0 and not result["errors"]
    doc = (tmp_path / "B.md").read_text()
    assert "<!-- fleet-scale:start -->" in doc and "python -m tests.benchmarks fleet-scale --agents 6" in doc
    assert "| 6 | single | this tree |" in doc
