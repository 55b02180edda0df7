"""The failover benchmark's per-step view of the replay, from synthetic step logs: which steps are
the replay's, and the section's rows for pipelined and unpipelined runs."""

from __future__ import annotations

from pathlib import Path

from engine.paged.coordinator import StepTiming
from tests.benchmarks import failover as bench


def test_the_replay_steps_are_those_sent_from_the_redial_and_answered_by_the_next_token():
    log = [StepTiming(7, 99.0, 99.1, 1, 1, (40.0, 41.0)),  # before the kill: not the replay's
           StepTiming(9, 100.5, 101.4, 256, 0, (420.0, 430.0)),
           StepTiming(10, 100.5, 101.9, 149, 1, (300.0, 310.0)),
           StepTiming(11, 101.95, 102.0, 1, 1, (40.0, 41.0))]  # the decode after it
    run = {"times": [99.2, 101.9, 102.0]}
    steps = bench.replay_steps(log, {"redialled": 100.5}, run)
    assert [s["tokens"] for s in steps] == [256, 149]
    assert round(steps[1]["answered_s"], 3) == 1.4 and round(steps[0]["round_trip_ms"]) == 900
    assert steps[1]["stage_ms"] == [300.0, 310.0] and not steps[1]["failed"]
    assert bench.replay_steps(log, None, run) == [] and bench.replay_steps(log, {"started": 1.0}, run) == []


def test_the_section_splits_pipelined_runs_from_unpipelined_ones_and_shows_the_median_runs_steps():
    def run(pipeline, replay, sent2):
        steps = [{"tokens": 256, "sent_s": 0.0, "answered_s": 0.6, "stage_ms": [250.0, 260.0]},
                 {"tokens": 149, "sent_s": sent2, "answered_s": replay, "stage_ms": [150.0, 160.0]}]
        return {"mode": "standby", "pipeline": pipeline, "added_delay_s": replay + 1.0, "median_gap_s": 0.05,
                "move_s": 0.6, "identical": True, "notice_s": 0.1, "bring_up_s": 0.7, "spawn_imports_s": None,
                "compile_s": None, "activate_s": 0.0, "redial_s": 0.02, "replay_s": replay, "replay_tok_s": 400.0,
                "spare_promoted": True, "replay_steps": steps}

    result = {"machine": {"cores": 2, "openvino": "x", "load_average": [0.1, 0.1, 0.1], "date": "d"},
              "prompt_tokens": 299, "new_tokens": 213, "exact": False, "step_timeout_s": 10.0, "watch_s": 1.0,
              "warm_spare": "on", "token_budget": 256, "reference_median_gap_s": 0.05, "healthy_at_end": True,
              "runs": [run(True, 0.8, 0.0), run(False, 1.1, 0.6), run(True, 0.9, 0.0), run(True, 2.0, 0.0)]}
    text = bench.render(result, Path("docs/bench/failover.json"))
    assert "| standby | 1.8, 1.9, 3.0 | 1.90 s |" in text
    assert "| standby, no pipelining | 2.1 | 2.10 s |" in text
    assert "| standby | 0.90 s | 256+149: 256 tok 0.00-0.60 s [250/260 ms], 149 tok 0.00-0.90 s [150/160 ms] |" in text
    assert "| standby, no pipelining | 1.10 s | 256+149: 256 tok 0.00-0.60 s [250/260 ms], 149 tok 0.60-1.10 s" in text
