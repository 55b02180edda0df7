"""The console-fleet benchmark's own tests: its figures from heartbeat stamps (pure), and a tiny
real run under Xvfb (a real service process, 20 simulated agents, the console window on the Fleet
page) that records the JSON, the section and a screenshot of the page with its many agents."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.benchmarks.console_fleet import percentile, pooled, refresh_blocks, stalls, summarise


def test_a_refresh_block_is_the_longest_stall_within_its_window_and_lag_counts_every_stall():
    beat = 0.005
    # stamps every 5 ms, but a 100 ms gap after 0.050 and a 40 ms one after 0.400
    beats = [i * beat for i in range(11)] + [0.150 + i * beat for i in range(51)]
    beats += [0.440 + i * beat for i in range(10)]
    assert max(s for _, s in stalls(beats, beat)) == pytest.approx(0.095)
    blocks = refresh_blocks(beats, [0.052, 0.300, 0.395, 9.0], beat, window_s=0.2)
    # 0.052 began in the long gap; 0.300 sees only the 35 ms stall at 0.400 (within 200 ms);
    # 0.395 likewise; 9.0 lies after the last stamp and is left out
    assert blocks == pytest.approx([0.095, 0.035, 0.035])
    assert percentile([1, 2, 3, 4, 100], 95) == 100 and percentile([5], 50) == 5
    raw = {"variant": "new", "agents": 3, "rows": 3, "start": 0.0, "end": 0.5, "beat_s": beat, "beats": beats,
           "refresh": [(0.052, 0.06), (0.3, 0.301)], "receive": [(0.05, 0.0505)], "cpu_s": 0.25}
    s = summarise(raw)
    assert s["blocks_ms"] == pytest.approx([95, 35]) and s["refresh_ms"] == pytest.approx([8, 1])
    assert s["cpu_cores"] == pytest.approx(0.5) and s["lag_max_ms"] == pytest.approx(95)
    both = pooled([s, dict(s, blocks_ms=[10.0], refreshes=1, snapshots=1)])
    assert both["block_max_ms"] == pytest.approx(95) and both["refreshes_per_s"] == pytest.approx(3)
    # a loop too busy to stamp at all: the whole run is one stall, and each refresh in it is blocked by it
    starved = summarise(dict(raw, beats=[], refresh=[(0.1, 0.4)], end=0.5))
    assert starved["blocks_ms"] == pytest.approx([495]) and starved["lag_max_ms"] == pytest.approx(495)


def test_a_tiny_run_under_xvfb_records_json_section_and_a_screenshot(tmp_path):
    from tests.benchmarks.console_fleet import COMMAND, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    shot = tmp_path / "fleet-page.png"
    args = parser.parse_args(["--agents", "20", "--runs", "1", "--seconds", "3", "--variants", "new",
                              "--screenshot", str(shot), "--json", str(tmp_path / "cf.json"),
                              "--doc", str(tmp_path / "BENCHMARKS.md")])
    assert COMMAND.run(args) == 0
    data = json.loads((tmp_path / "cf.json").read_text())
    (row,) = data["table"]
    assert row["agents"] == 20 and row["variant"] == "new" and row["refreshes_per_s"] > 0
    (run,) = data["runs"]
    assert run["rows"] >= 20 and run["blocks_ms"] and all(b >= 0 for b in run["blocks_ms"])
    doc = (tmp_path / "BENCHMARKS.md").read_text()
    assert "<!-- console-fleet:start -->" in doc and "python -m tests.benchmarks console-fleet" in doc
    assert "| 20 | new |" in doc
    from PySide6.QtGui import QImage

    image = QImage(str(shot))
    assert image.width() >= 1100 and image.height() >= 700  # the whole window, its table full of agents
