"""One simulated agent: joined through the real enrolment, its control API the real one
(:func:`agent.service.control_api.build_app`, mutual TLS with its own fleet certificate), its
registrations and events the real agent's calls (:mod:`agent.service.fleet_link`).

What it fakes is only what lies behind the control API: there is no worker, no shard store and
no idle monitor. It answers status polls, probes, pause / resume and deny-list pushes as the real
agent does; routes that would start work (assign, fetch, worker start, calibrate, spare, link
measure) are refused with 409 and a message saying this is a simulated agent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from agent.service import pause
from agent.service.control_api import build_app
from agent.service.fleet_link import NOTIFY_TIMEOUT_S, async_register_with_seeds, service_connector
from engine import __version__
from engine.control.enrollment import Joined, async_join
from engine.control.links import LinkMeasurement
from engine.control.messages import AgentStatus, Assignment, ControlRequestError, FetchProgress, WorkerStatus
from engine.discovery.advertisement import Advertisement, instance_name
from engine.http_limits import LimitedAppRunner
from engine.trust.fleet_ca import Credentials
from engine.trust.tls_peer import PeerIdentityError

GIB = 1 << 30


def sim_inventory(index: int) -> dict[str, Any]:
    """A plausible office PC's inventory (the real format of ``Inventory.to_dict``): half of the
    PCs have an integrated GPU, every third an NPU; 8-32 GiB of RAM."""
    devices = [{"name": "CPU", "kind": "CPU", "full_name": "Simulated office CPU", "memory_bytes": None}]
    if index % 2 == 0:
        devices.append({"name": "GPU", "kind": "GPU", "full_name": "Simulated iGPU", "memory_bytes": 4 * GIB})
    if index % 3 == 0:
        devices.append({"name": "NPU", "kind": "NPU", "full_name": "Simulated NPU", "memory_bytes": None})
    ram = (8, 16, 32)[index % 3] * GIB
    return {"format": 1, "devices": devices, "ram_total": ram, "ram_available": ram // 2, "os": "Linux (simulated)",
            "cpu_cores": {"physical": 4, "logical": 8}, "battery_percent": None, "on_ac": None,
            "disk_free": 100 * GIB}


def _refuse(what: str) -> ControlRequestError:
    return ControlRequestError(f"this is a simulated agent (tests.support.sim_fleet): it does not {what}", 409)


@dataclass
class SimAgent:
    """One fake agent. ``async_join`` then ``async_open``; ``async_register`` at the real
    interval; ``async_set_local_pause`` is the person at the PC coming and going."""

    name: str
    index: int
    host: str = "127.0.0.1"
    creds: Credentials | None = None
    service_node_id: str | None = None
    deny: frozenset[str] = frozenset()
    local_paused: bool = False
    remote_paused: bool = False
    polls: int = 0
    control_port: int = 0
    inventory: dict[str, Any] = field(default_factory=dict)
    on_remote: Callable[[SimAgent, bool], None] | None = None  # told of the console's pause / resume
    _runner: web.AppRunner | None = None

    def __post_init__(self) -> None:
        self.inventory = self.inventory or sim_inventory(self.index)
        self.instance = instance_name(self.name, f"{self.index:04d}")

    # ---- what the control API asks of it (agent.service.control_api.ControlledAgent) ---------

    @property
    def reasons(self) -> tuple[str, ...]:
        return ((pause.REMOTE,) if self.remote_paused else ()) + ((pause.IN_USE,) if self.local_paused else ())

    def state(self) -> str:
        if self.creds is None:
            return "not-joined"
        return "paused" if self.reasons else "idle"

    def status(self) -> AgentStatus:
        self.polls += 1
        creds = self.creds
        return AgentStatus(node_id=creds.node_id if creds else "", fleet_id=creds.fleet_id if creds else "",
                           name=self.name, version=__version__, state=self.state(), paused_reasons=self.reasons,
                           inventory=self.inventory, export_id=None, stage=None, fetch=FetchProgress(),
                           worker=WorkerStatus(), api_url=None, kv_pool_mb=1024, tags=self.tags,
                           cpu_percent=self.cpu_percent(), memory_used_bytes=self.inventory["ram_total"] // 2)

    @property
    def tags(self) -> tuple[str, ...]:
        """Four floors, three departments: something for tag filters to select."""
        return (("finance", "sales", "support")[self.index % 3], f"floor-{self.index % 4 + 1}")

    def cpu_percent(self) -> float:
        """A PC's load that wanders with time: 5-65 %, busier while the person is at it."""
        phase = (time.monotonic() / 60.0 + self.index * 0.37) % 1.0
        return round(5.0 + 30.0 * phase + (30.0 if self.local_paused else 0.0), 1)

    def probe(self) -> dict[str, Any]:
        creds = self.creds
        return {"node_id": creds.node_id if creds else "", "fleet_id": creds.fleet_id if creds else "",
                "name": self.name, "version": __version__, "state": self.state(), "control_port": self.control_port}

    async def async_assign(self, assignment: Assignment) -> None:
        raise _refuse("serve stages")

    async def async_begin_fetch(self, bandwidth_cap: int | None = None) -> None:
        raise _refuse("fetch shards")

    async def async_start_worker(self) -> None:
        raise _refuse("run a worker")

    async def async_stop_worker(self, *, drain: bool = False) -> None:
        return None  # no worker: already stopped

    async def async_set_remote_pause(self, paused: bool) -> None:
        self.remote_paused = paused
        if self.on_remote is not None:
            self.on_remote(self, paused)

    async def async_measure_link(self, host: str, port: int, *, samples: int = 5, nbytes: int = 1 << 20,
                                 node_id: str | None = None) -> LinkMeasurement:
        raise _refuse("measure links")

    async def async_set_deny(self, deny: tuple[str, ...], *, api_key: str | None = None) -> None:
        self.deny = frozenset(deny)

    async def async_set_fleet_api(self, api_url: str) -> None:
        self.api_url = api_url

    async def async_calibrate(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        raise _refuse("calibrate")

    async def async_hold_spare(self, assignment: Assignment) -> None:
        raise _refuse("hold spares")

    async def async_drop_spare(self) -> None:
        return None

    # ---- its I/O: the real agent's calls -----------------------------------------------------

    async def async_join(self, enrollment: str, token: str, *, timeout: float = 30.0) -> Joined:
        joined = await async_join(enrollment, token, self.name, info=self.inventory, timeout=timeout)
        self.creds, self.service_node_id = joined.credentials, joined.console_node_id
        return joined

    async def async_open(self) -> int:
        """Serve the control API on ``host`` (a free port), as the real agent does; the port."""
        assert self.creds is not None, "join first"
        runner = LimitedAppRunner(build_app(self), access_log=None, handler_cancellation=True, what="control API")
        await runner.setup()
        site = web.TCPSite(runner, self.host, 0, ssl_context=self.creds.server_context())
        await site.start()
        self._runner, self.control_port = runner, runner.addresses[0][1]
        return self.control_port

    async def async_close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def registration(self) -> dict[str, Any]:
        """The body the real agent registers with (``AgentService.async_register``)."""
        assert self.creds is not None
        ad = Advertisement(instance=self.instance, node_id=self.creds.node_id, fleet_id=self.creds.fleet_id,
                           version=__version__, devices=tuple(d["name"] for d in self.inventory["devices"]),
                           memory_bytes=self.inventory["ram_total"], state=self.state(),
                           control_port=self.control_port, addresses=(self.host,))
        return {"advertisement": ad.to_properties(), "control_port": self.control_port, "address": self.host}

    async def async_register(self, hub: str) -> float | None:
        """Register at the hub ``hub`` (HOST:PORT); the round trip in seconds, None if refused."""
        assert self.creds is not None
        start = time.perf_counter()
        accepted = await async_register_with_seeds(self.creds, self.service_node_id, (hub,), self.registration())
        return time.perf_counter() - start if accepted else None

    async def async_set_local_pause(self, paused: bool, hub: str) -> bool:
        """The person at the PC: paused (in use) or back to idle, and the hub told, as the real
        agent's ``async_tell_service`` does; whether the hub took it."""
        assert self.creds is not None
        self.local_paused = paused
        body = {"node_id": self.creds.node_id, "event": "paused" if paused else "resumed",
                "reasons": list(self.reasons), "export_id": None, "stage": None, "detail": None}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=NOTIFY_TIMEOUT_S),
                                             connector=service_connector(self.service_node_id)) as session:
                async with session.post(f"https://{hub}/v1/events", json=body,
                                        ssl=self.creds.client_context()) as resp:
                    return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError, PeerIdentityError) as exc:
            raise ConnectionError(f"{self.name} could not tell the hub at {hub} it {body['event']}: {exc}") from exc


async def async_wait(coro, timeout: float, what: str):
    """``coro`` within ``timeout`` s, else TimeoutError naming ``what``."""
    try:
        return await asyncio.wait_for(coro, timeout)
    except TimeoutError:
        raise TimeoutError(f"timed out after {timeout:g} s {what}") from None
