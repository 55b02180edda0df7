"""The speedups benchmark's parts that need no model: the WAN emulator measured against its own
delay, and the section it adds to the report. (The ring measurements need the default model and
worker processes: run the benchmark.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.benchmarks.speedups import render, wan_accuracy


def test_the_wan_emulator_is_measured_against_its_delay():
    got = asyncio.run(asyncio.wait_for(wan_accuracy((5.0,), samples=3, burst=4), 60))
    assert list(got) == ["5"]
    row = got["5"]
    # never under the configured delay (tests/wire/test_wan.py's assertion); how far over is the figure
    assert 0 <= row["round_trip_over_ms"] <= row["round_trip_over_max_ms"] and row["burst_over_ms"] >= 0
    assert row["burst_messages"] == 4


def test_the_report_has_the_wan_emulator_table():
    variant = {"median_tok_per_s": 10.0, "acceptance_rate": None, "median_k": None}
    result = {
        "command": "python -m tests.benchmarks speedups", "prompt_tokens": 40, "new_tokens": 64, "warmups": 1,
        "runs": 3, "machine": {"date": "now", "cores": 2, "openvino": "x", "load_average": [0.0]},
        "delays": {"0.0": {name: variant for name in ("naive", "lookup", "draft", "full stack")}},
        "replies": {"top-1": 3.0, "full logits": 1.0},
        "ttft": {"history_tokens": 1000, "warm_over_cold": 0.1, "cold_ttft_ms": 900, "warm_ttft_ms": 90,
                 "prefix_hits": 1},
        "rewind": {"cached_tokens": 512, "mask_share_of_step": 0.001, "mask_rewind_ms": 0.01,
                   "physical_trim_ms": 3.5, "decode_step_ms": 20.0},
        "wan_accuracy": {"10": {"round_trip_over_ms": 0.41, "round_trip_over_max_ms": 1.2, "burst_over_ms": 3.25,
                                "burst_messages": 20}},
    }
    text = render(result, Path("docs/bench/speedups.json"))
    assert "| 10 | 0.41 / 1.20 | 3.25 (20 × 64 KiB) |" in text
    del result["wan_accuracy"]  # a run recorded before the emulator was measured
    assert "WAN emulator against its setting" not in render(result, Path("x.json"))
