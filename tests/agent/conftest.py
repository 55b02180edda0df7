"""What the tray and first-run tests share: a started QtAgentTray over a real AgentService."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from agent.service.service import AgentService
from agent.service.settings import AgentSettings, save_settings
from agent.tray.bridge import START_TIMEOUT_S, AgentBridge
from agent.tray.tray import QtAgentTray
from tests.support.agent_helpers import FakeIdle

LOGIN = ["/usr/bin/deskfleet", "agent", "--state-dir", "/tmp/a dir"]


def tray_settings(**over) -> AgentSettings:
    return replace(AgentSettings(name="desk-1", interface="127.0.0.1", control_port=0, data_port=0,
                                 pause_on_battery=False, resume_after_idle_s=0.5), **over)


def _loop_tasks(bridge: AgentBridge) -> str:
    """Every task on the bridge's loop with where it waits: what a hung start is stuck on."""
    import io

    async def dump() -> str:
        out = io.StringIO()
        for task in asyncio.all_tasks():
            task.print_stack(limit=8, file=out)
        return out.getvalue()

    try:
        return bridge.loop.run(dump(), 10, what="listing the loop's tasks")
    except Exception as exc:
        return f"(could not list them: {exc!r})"


@pytest.fixture
def start_tray(qtbot, tmp_path):
    """``start_tray(idle=FakeIdle())`` -> a started QtAgentTray over a real AgentService."""
    trays = []

    def start(idle: FakeIdle | None = None, state_dir: Path | None = None) -> QtAgentTray:
        state_dir = state_dir or tmp_path / "agent"
        save_settings(state_dir, tray_settings())  # as the app's load_settings does on a first run
        service = AgentService(state_dir, tray_settings(), idle_source=idle or FakeIdle(), power=lambda: None)
        bridge = AgentBridge(service, poll_interval_ms=200)
        tray = QtAgentTray(bridge, LOGIN, confirm_leave=lambda: True)
        trays.append(tray)
        bridge.start()
        try:
            qtbot.waitUntil(lambda: (bridge.running and bridge.status is not None) or bridge.start_error is not None,
                            timeout=int((START_TIMEOUT_S + 10) * 1000))
        except Exception:
            pytest.fail(f"the tray did not start: running={bridge.running}, status={bridge.status}, "
                        f"start future={bridge._start_future}; the agent loop's tasks:\n{_loop_tasks(bridge)}")
        assert bridge.start_error is None, f"the agent service did not start: {bridge.start_error!r}"
        return tray

    yield start
    for tray in trays:
        tray.shutdown()
        assert not tray.bridge.loop.running
