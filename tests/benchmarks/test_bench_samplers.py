"""The samplers benchmark: its pure parts (modes, per-round ratios, the choosing micro-benchmark,
the table) and (slow lane) a tiny run for real over a paged worker process per stage of the tiny model."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.benchmarks import samplers as bench


def test_the_modes_are_penalised_exactly_where_named():
    for mode in bench.MODES:
        params = bench.sampling_for(mode, 7)
        assert params.penalised == mode.endswith("+penalties")
        assert params.greedy == mode.startswith("greedy")


def _round(users: int, mode: str, r: int, step_ms: float, warmup: bool = False) -> dict:
    return {"users": users, "mode": mode, "round": r, "warmup": warmup, "tokens_per_s": 1000 / step_ms,
            "step_interval_ms": step_ms}


def test_ratios_are_against_greedy_of_the_same_round_and_warmups_do_not_count():
    rounds = [_round(1, "greedy", 0, 1.0, warmup=True), _round(1, "greedy+penalties", 0, 99.0, warmup=True),
              _round(1, "greedy", 1, 10.0), _round(1, "greedy+penalties", 1, 11.0),
              _round(1, "greedy", 2, 20.0), _round(1, "greedy+penalties", 2, 21.0),
              _round(1, "greedy", 3, 30.0), _round(1, "greedy+penalties", 3, 36.0)]
    summary = {s["mode"]: s for s in bench.summarise(rounds)}
    assert summary["greedy"]["step_vs_greedy"] == 1.0 and summary["greedy"]["step_interval_ms"] == 20.0
    assert summary["greedy+penalties"]["step_vs_greedy"] == pytest.approx(1.1)  # 1.1, 1.05, 1.2


def test_the_choosing_costs_cover_every_mode_and_render():
    costs = bench.decide_costs(vocab=64, users=[1, 3], history=20, reps=2)
    assert [c["users"] for c in costs] == [1, 3] and all(c[m] > 0 for c in costs for m in bench.MODES)
    result = {"command": "python -m tests.benchmarks samplers", "model": "tiny", "stages": 2, "new_tokens": 4,
              "repeats": 1, "warmups": 0, "uptime": "up", "load_average_end": [1.0], "vocab": 64, "history": 20,
              "micro_reps": 2, "decide_costs": costs,
              "machine": {"cores": 2, "cpu": "x", "date": "today", "load_average": [1.0]},
              "summary": bench.summarise([_round(1, m, 0, 10.0) for m in bench.MODES])}
    text = bench.markdown(result)
    assert "| 1 | greedy+penalties |" in text and "sampled+penalties µs" in text


@pytest.mark.slow  # worker processes for two stages, a few rounds
def test_a_tiny_run_records_json_and_section(tiny_export, tmp_path):
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    args = parser.parse_args(["--export", str(tiny_export("llama", 2)), "--users", "1,2", "--new-tokens", "6",
                              "--repeats", "1", "--warmups", "0", "--micro-reps", "2", "--history", "16",
                              "--json", str(tmp_path / "s.json"), "--doc", str(tmp_path / "B.md")])
    assert bench.run(args) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert {(s["users"], s["mode"]) for s in result["summary"]} == {(u, m) for u in (1, 2) for m in bench.MODES}
    assert all(r["tokens"] == 6 * r["users"] for r in result["rounds"])
    assert "<!-- samplers:start -->" in (tmp_path / "B.md").read_text()
