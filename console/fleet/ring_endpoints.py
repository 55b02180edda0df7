"""Which data port each agent of a ring listens on, decided from the fleet service's settings."""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping

from console.fleet.errors import LayoutError
from console.fleet.ring_layout import AgentEndpoint
from console.fleet_api.agent_record import AgentRecord
from engine.placement.types import Plan


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
            raise LayoutError(f"the plan places a stage on {stage.pc_id[:16]}…, which the fleet service no longer "
                              "lists; refresh the fleet and place the model again")
        index = per_address.get(record.address, 0)
        per_address[record.address] = index + 1
        port = pick_free(record.address) if data_port == 0 else data_port + index
        endpoints[stage.pc_id] = AgentEndpoint(record.control_address, port, record.name, record.node_id)
    return endpoints
