"""The ring-model benchmark records its prediction table (JSON and its own section) from the
frozen inputs it names, and places the 1-box measurement beside the matching 1-box row."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.benchmarks.__main__ import main
from tests.benchmarks.ring_model import USERS, render, run


def test_the_prediction_table_is_recorded_with_the_measurement_beside_the_one_box_row(tmp_path, capsys):
    doc, out = tmp_path / "BENCHMARKS.md", tmp_path / "ring_model.json"
    doc.write_text("# Benchmarks\n\n<!-- other:start -->\nkept\n<!-- other:end -->\n")
    args = argparse.Namespace(measured={1: 31.0, 16: 99.0}, measured_source="a test", measured_micro_batches=2,
                              json=out, doc=doc)
    assert run(args) == 0

    result = json.loads(out.read_text())
    smol, big = result["sets"]
    for s in (smol, big):
        assert {r["users"] for r in s["rows"]} == set(USERS)
        layouts = {r["layout"] for r in s["rows"]}
        assert {"2 PCs, 2 stages, M=2", "4 PCs, 4 stages, M=4", "4 PCs, 2 rings of 2 stages, M=2 each"} <= layouts
        for r in s["rows"]:
            assert r["aggregate_tok_s"] == pytest.approx(r["users"] * 1000 / r["period_ms"])  # even splits
            assert r["best_aggregate_tok_s"] >= r["aggregate_tok_s"] * (1 - 1e-9)
    measured = {(r["layout"], r["users"]): r["measured_tok_s"] for r in smol["rows"] if "measured_tok_s" in r}
    assert measured == {("1 box, 2 stages, M=2", 1): 31.0, ("1 box, 2 stages, M=2", 16): 99.0}
    assert not any("measured_tok_s" in r for r in big["rows"])
    text = doc.read_text()
    assert "kept" in text and "<!-- ring-model:start -->" in text and render(result, out) in text
    assert "prediction only" in text and "Assumptions" in text
    assert "### SmolLM2-135M" in capsys.readouterr().out


def test_a_malformed_measurement_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["ring-model", "--measured", "eight=80"])
    assert exit_.value.code == 2
    assert "USERS=TOK_S" in capsys.readouterr().err
