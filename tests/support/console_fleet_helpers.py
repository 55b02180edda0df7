"""Helpers for the console's fleet and placement tests: a console (fleet host) with real agents
joined to it, all in-process on loopback, and a bounded wait."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from console.fleet.fleet import FleetModel
from engine.control.fleet_services import FleetHost
from tests.support.agent_helpers import FakeIdle, console


def agent(root: Path, name: str, **settings) -> AgentService:
    s = AgentSettings(name=name, interface="127.0.0.1", control_port=0, data_port=0, **settings)
    return AgentService(root / name, s, idle_source=FakeIdle(1e6), power=lambda: None)


@dataclass
class Fleet:
    host: FleetHost
    agents: dict[str, AgentService]  # by name
    fleet: FleetModel

    def node(self, name: str) -> str:
        return self.agents[name].status().node_id


@contextlib.asynccontextmanager
async def joined_fleet(root: Path, names: tuple[str, ...] = ("alpha", "beta"), *, exports=None,
                       seeds: bool = False) -> AsyncIterator[Fleet]:
    """A console in ``root/console`` and agents ``names`` joined to it; the FleetModel is attached
    to the hub but has no mDNS browser (tests add one where they need it)."""
    async with console(root / "console", exports) as host:
        fleet = FleetModel(root / "console", host.credentials)
        detach = fleet.attach_hub(host.hub)
        extra = {"seeds": (f"127.0.0.1:{host.hub.port}",)} if seeds else {}
        agents = {n: agent(root, n, **extra) for n in names}
        started = []
        try:
            for a in agents.values():
                await a.async_start()
                started.append(a)
                await a.async_join(host.enrollment, host.token())
            yield Fleet(host, agents, fleet)
        finally:
            detach()
            for a in started:
                await a.async_close()

