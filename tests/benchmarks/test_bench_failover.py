"""The failover benchmark's arithmetic and its section, from synthetic runs (the benchmark itself
needs the default model and real agents: the lead runs it)."""

from __future__ import annotations

from pathlib import Path

from tests.benchmarks import failover as bench


def test_the_breakdown_splits_a_cold_start_and_a_promoted_spare():
    run = {"kill_mono": 100.0, "times": [99.9, 100.0, 101.9, 102.0]}
    recovery = {"started": 100.2, "serving": 100.5, "redialled": 100.55}
    cold = {"promoted": False, "spawned": 5.0, "entered": 6.5, "opened": 9.0, "listening": 9.1, "ready": 9.1}
    parts = bench.breakdown(run, recovery, cold)
    assert round(parts["notice_s"], 3) == 0.2 and round(parts["bring_up_s"], 3) == 0.3
    assert round(parts["redial_s"], 3) == 0.05 and round(parts["replay_s"], 3) == 1.35  # to the token at 101.9
    assert parts["spawn_imports_s"] == 1.5 and parts["compile_s"] == 2.5 and parts["activate_s"] is None
    spare = {"promoted": True, "spawned": 1.0, "entered": 2.0, "opened": 4.0, "activated": 9.0, "listening": 9.02,
             "ready": 9.03}
    parts = bench.breakdown(run, recovery, spare)
    assert parts["spare_promoted"] and round(parts["activate_s"], 3) == 0.02 and parts["compile_s"] is None
    assert bench.breakdown({"times": []}, None, None)["notice_s"] is None  # no kill, no recovery: nothing seen


def test_the_section_has_the_verdict_against_3_s_and_the_breakdown_table():
    def run(mode, delay, promoted):
        return {"mode": mode, "added_delay_s": delay, "median_gap_s": 0.09,
                "move_s": 0.6 if mode == "standby" else None,
                "identical": True, "notice_s": 0.2, "bring_up_s": 0.1, "spawn_imports_s": None, "compile_s": None,
                "activate_s": 0.01, "redial_s": 0.03, "replay_s": 1.5, "replay_tok_s": 270.0,
                "spare_promoted": promoted}

    result = {"machine": {"cores": 2, "openvino": "x", "load_average": [0.1, 0.1, 0.1], "date": "d"},
              "prompt_tokens": 299, "new_tokens": 213, "exact": False, "step_timeout_s": 10.0, "watch_s": 1.0,
              "warm_spare": "on", "token_budget": 256, "reference_median_gap_s": 0.09, "healthy_at_end": True,
              "runs": [run("restart", 1.8, True), run("standby", 3.4, True)]}
    text = bench.render(result, Path("docs/bench/failover.json"))
    assert "| restart | 1.8 | 1.80 s | 1.80 s | 90 ms | - | 1/1 | < 3 s | met |" in text
    assert "| standby | 3.4 | 3.40 s | 3.40 s | 90 ms | 0.60 s | 1/1 | < 3 s | **missed** |" in text
    assert "| restart | 0.20 s | 0.10 s | - | - | 0.01 s | 0.03 s | 1.50 s | 270 | 1/1 |" in text
