"""Several hosts on one machine: the console and three agents, each in its own network namespace
on one bridge (root only), with real mDNS between them and an emulated WAN delay on the console's
links into the ring: discover -> join -> approve -> distribute -> answer -> lose the agent serving
the last stage mid-answer -> a standby takes over and the answer completes, identical.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PROMPT_IDS
from tests.fleet.netns import namespaces, why_unavailable

ROOT = Path(__file__).resolve().parents[2]
_REASON = why_unavailable()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_REASON is not None, reason=f"multi-host harness unavailable: {_REASON}"),
]


def test_console_and_three_agents_in_their_own_namespaces(tmp_path, tiny_export):
    export = tiny_export("llama", 3)
    with namespaces(4) as hosts:
        console, agents = hosts[0], hosts[1:]
        config = {"state": str(tmp_path), "console": {"ns": console.name, "address": console.address},
                  "agents": [{"ns": h.name, "address": h.address} for h in agents],
                  "export": str(export), "reference": str(tiny_export("llama", 1)), "prompt": list(PROMPT_IDS)}
        (tmp_path / "config.json").write_text(json.dumps(config))
        scenario = [sys.executable, "-m", "tests.fleet.netns_scenario", str(tmp_path / "config.json")]
        done = subprocess.run(console.argv(scenario), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["steps"][:4] == ["discovered", "approved", "distributed", "answered"], result
    assert result["health_ok"] and result["first_answer_identical"]
    assert result.get("after_kill_identical") is True, result
    assert result["failovers"] >= 1
    # the console's hops in and out of the ring cross a 5 ms (each way) emulated link
    assert result["ring_step_ms"] >= 2 * 5.0
