"""How busy the agent's PC is, in its status: the CPU meter's windows, the status fields' parsing
(old agents and odd values read as unknown), and a real joined agent reporting both over its
mutual-TLS control API."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from agent.service.machine_load import LoadMeter
from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from engine.control.client import ControlClient
from engine.control.messages import AgentStatus, FetchProgress, WorkerStatus
from tests.support.agent_helpers import FakeIdle, console
from tests.support.asyncutil import run

pytestmark = pytest.mark.usefixtures("private_keyring")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_cpu_meter_measures_windows_of_at_least_its_minimum():
    clock = Clock()
    meter = LoadMeter(min_window_s=1.0, clock=clock)
    assert meter.cpu_percent() is None  # no window has passed since it started
    burn(0.3)
    clock.now += 1.5
    first = meter.cpu_percent()
    assert first is not None and 0.0 < first <= 100.0  # this process alone kept a core busy
    burn(0.1)
    clock.now += 0.5  # too soon for a new window: the same figure
    assert meter.cpu_percent() == first
    sample = meter.sample()
    assert sample.cpu_percent == first
    assert 0 < sample.memory_used_bytes <= psutil.virtual_memory().total


def _status(**extra) -> dict:
    base = AgentStatus("n", "f", "pc", "1", "idle", (), {}, None, None, FetchProgress(), WorkerStatus(), None)
    return {**base.to_dict(), **extra}


def test_the_status_carries_cpu_and_memory_and_reads_odd_values_as_unknown():
    status = AgentStatus.from_dict(_status(cpu_percent=37.5, memory_used_bytes=3 << 30))
    assert (status.cpu_percent, status.memory_used_bytes) == (37.5, 3 << 30)
    assert AgentStatus.from_dict(status.to_dict()) == status
    old = _status()
    del old["cpu_percent"], old["memory_used_bytes"]  # an agent from before them
    assert AgentStatus.from_dict(old).cpu_percent is None and AgentStatus.from_dict(old).memory_used_bytes is None
    for cpu, memory in ((101.0, -1), ("50", 1.5), (True, True), (None, None)):
        odd = AgentStatus.from_dict(_status(cpu_percent=cpu, memory_used_bytes=memory))
        assert (odd.cpu_percent, odd.memory_used_bytes) == (None, None)


def test_a_joined_agent_reports_its_pcs_cpu_and_memory_over_the_control_api(tmp_path):
    async def main():
        async with console(tmp_path / "console") as con:
            settings = AgentSettings(name="desk-load", interface="127.0.0.1", control_port=0, data_port=0)
            agent = AgentService(tmp_path / "agent", settings, idle_source=FakeIdle(1e6), power=lambda: None)
            await agent.async_start()
            try:
                await agent.async_join(con.enrollment, con.token())
                client = ControlClient(con.credentials, "127.0.0.1", agent.control_port)
                first = await client.async_status()
                await asyncio.sleep(1.2)  # one meter window
                second = await client.async_status()
                return first, second
            finally:
                await agent.async_close()

    first, second = run(main())
    total = psutil.virtual_memory().total
    assert 0 < first.memory_used_bytes <= total and 0 < second.memory_used_bytes <= total
    assert second.cpu_percent is not None and 0.0 <= second.cpu_percent <= 100.0
    assert second.inventory["ram_available"] > 0  # the fresh inventory facts still come with it

