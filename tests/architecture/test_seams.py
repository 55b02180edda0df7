"""The narrow protocols the shells' modules call through are implemented by their real sides,
checked by mypy (structural typing: a renamed or re-typed member breaks it):

- ``agent.service.control_api.ControlledAgent``: what the control API calls; ``AgentService``;
- ``console.fleet.failover.RecoverableRing``: what failover does to a ring; ``Distributor``
  and the in-memory ring of tests/console/test_ring_recovery.py.

A side that lacks a member is in the same file and must be the one error reported.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MYPY_CACHE = Path(tempfile.gettempdir()) / "deskfleet-mypy-cache"

SIDES = '''\
from agent.service.control_api import ControlledAgent
from agent.service.service import AgentService
from console.fleet.distribution import Distributor
from console.fleet.failover import RecoverableRing
from tests.console.test_ring_recovery import MemoryRing


def agent_service(side: AgentService) -> ControlledAgent:
    return side


def distributor(side: Distributor) -> RecoverableRing:
    return side


def memory_ring(side: MemoryRing) -> RecoverableRing:
    return side


class RedialOnly:
    async def async_redial(self, path: object) -> None: ...


def redial_only(side: RedialOnly) -> RecoverableRing:
    return side  # line 25: not a RecoverableRing
'''


def test_the_real_sides_implement_the_protocols_and_a_partial_one_does_not(tmp_path):
    sides = tmp_path / "sides.py"
    sides.write_text(SIDES)
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                             "--cache-dir", str(MYPY_CACHE), "--follow-imports=silent", str(sides)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, result.stdout + result.stderr
    # (the path is the one mypy first saw this file at: its cache replays an unchanged file's errors)
    assert "sides.py:25: error: Incompatible return value type" in errors[0]
    assert '"RedialOnly", expected "RecoverableRing"' in errors[0]
