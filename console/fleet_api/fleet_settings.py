"""The fleet service's settings, parsed once from the command line (``deskfleet fleet run``, or
``deskfleet console`` for the local service it starts and the one it attaches to): where the
state lives, the ports, and how rings are served.

Ports are fixed by default so that agents configured with this service's addresses (enrollment
for joining, hub for unicast registration) keep working across restarts; 0 asks the OS for a
free one (tests, or a second service on one PC). The state dir keeps its old
name (``deskfleet/console``): enrolled fleets' CA and state live there.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.api.server import ApiSettings
from engine.control.messages import WorkerSettings

ENROLLMENT_PORT = 7220
HUB_PORT = 7221
API_PORT = 8000
DEFAULT_DATA_PORT = 7211  # an agent's default data port (agent.service.settings.AgentSettings)


def add_listen_arguments(p: argparse.ArgumentParser) -> None:
    """The fleet service's interface and ports, for `deskfleet fleet` and for the local service
    `deskfleet console` starts."""
    p.add_argument("--interface", default=None, metavar="ADDR",
                   help="IPv4 address to serve agents and browse mDNS on (default: the address of the default "
                        "route's interface; 127.0.0.1 keeps everything on this PC)")
    p.add_argument("--api-port", type=int, default=API_PORT,
                   help=f"port of the OpenAI-compatible API over every ring (default {API_PORT}; 0: any free)")
    p.add_argument("--enrollment-port", type=int, default=ENROLLMENT_PORT,
                   help=f"port where PCs redeem join tokens (default {ENROLLMENT_PORT}; 0: any free)")
    p.add_argument("--hub-port", type=int, default=HUB_PORT,
                   help=f"port of the shard hub and unicast registration (default {HUB_PORT}; 0: any free)")


def default_state_dir() -> Path:
    """The platform's per-user data directory for the fleet service (the fleet CA lives there)."""
    if os.name == "nt":
        return Path(os.environ.get("LOCALAPPDATA", Path.home())) / "Deskfleet" / "console"
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "deskfleet" / "console"


@dataclass(frozen=True)
class FleetSettings:
    """``interface`` is the one IPv4 address the fleet service binds everything to (enrollment, hub,
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
    runtime: str = "paged"  # how a ring serves: "paged" (an NPU-target export static; console.fleet.ring_runtime)
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


