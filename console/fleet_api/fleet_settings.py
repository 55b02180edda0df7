"""The console's own settings, parsed once from the command line, and the pure decisions that
depend on them: where the state lives, and which data port each agent of a ring listens on.

Ports are fixed by default so that agents configured with this console's addresses (enrollment
for joining, hub for unicast registration) keep working across restarts; 0 asks the OS for a
free one (tests, or a second console on one PC).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from console.fleet.errors import LayoutError
from console.fleet.ring_layout import DEFAULT_DATA_PORT, AgentEndpoint
from console.fleet_api.agent_record import AgentRecord
from engine.api.server import ApiSettings
from engine.control.messages import WorkerSettings
from engine.placement.planner import Plan

ENROLLMENT_PORT = 7220
HUB_PORT = 7221
API_PORT = 8000


def default_state_dir() -> Path:
    """The platform's per-user data directory for the console (the fleet CA lives there)."""
    if os.name == "nt":
        return Path(os.environ.get("LOCALAPPDATA", Path.home())) / "Deskfleet" / "console"
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "deskfleet" / "console"


@dataclass(frozen=True)
class ConsoleSettings:
    """``interface`` is the one IPv4 address the console binds everything to (enrollment, hub,
    mDNS browsing, the ring's return port, the OpenAI API): agents must reach it.
    ``data_port`` is the port agents' stage workers listen on; 0 picks free ports on this
    machine, which only makes sense for agents running on this PC (tests, demos)."""

    state_dir: Path
    interface: str = "127.0.0.1"
    api_port: int = API_PORT
    enrollment_port: int = ENROLLMENT_PORT
    hub_port: int = HUB_PORT
    data_port: int = DEFAULT_DATA_PORT
    worker: WorkerSettings = WorkerSettings()
    api: ApiSettings = field(default_factory=ApiSettings)
    refresh_s: float = 5.0  # how often member agents are polled for their status
    metrics_s: float = 1.0  # how often the coordinator's metrics are sampled
    calibration_steps: int = 16
    runtime: str = "paged"  # how a ring serves a CPU/GPU export: "paged" or "stateful" (console.fleet.ring_runtime)
    # The fleet service the console attaches to: None is the local one over <state_dir>/admin.sock
    # (started detached when none runs); an https:// URL is a service elsewhere, reached with the
    # admin credentials folder ``admin_cert`` and, if given, pinned to ``service_node_id``.
    service_url: str | None = None
    admin_cert: Path | None = None
    service_node_id: str | None = None
    admin_port: int | None = 7222  # the admin API's TLS port of a local service this console starts (None: socket only)

    @property
    def api_url(self) -> str:
        return f"http://{self.interface}:{self.api_port}/v1"


def free_port(host: str) -> int:
    """A TCP port nobody listens on at ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ring_endpoints(plan: Plan, records: Mapping[str, AgentRecord], data_port: int, *,
                   pick_free: Callable[[str], int] = free_port) -> dict[str, AgentEndpoint]:
    """Each planned agent's control address and the data port its stage listens on.

    Agents on distinct PCs all use ``data_port``; agents sharing one address (several agents on
    one PC) get ``data_port``, ``data_port + 1``... in stage order. ``data_port`` 0 picks free
    ports (agents on this machine only)."""
    endpoints: dict[str, AgentEndpoint] = {}
    per_address: dict[str, int] = {}
    for stage in plan.stages:
        if stage.pc_id in endpoints:
            continue
        record = records.get(stage.pc_id)
        if record is None or not record.control_port:
            raise LayoutError(f"the plan places a stage on {stage.pc_id[:16]}…, which the console no longer "
                              "lists; refresh the fleet and place the model again")
        index = per_address.get(record.address, 0)
        per_address[record.address] = index + 1
        port = pick_free(record.address) if data_port == 0 else data_port + index
        endpoints[stage.pc_id] = AgentEndpoint(record.control_address, port, record.name, record.node_id)
    return endpoints
