"""The agents the admin approved for placement, kept in the fleet service's state database.

Each entry keeps where the agent was last seen, so an approved agent is listed (and polled) after
a fleet service restart even on a network that drops multicast. An approval is one row written in
one small transaction (1,000 agents cost 1,000 row inserts, not 1,000 rewrites of a growing
file); a damaged database stops the fleet service with `FleetStateError`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType

from console.fleet.errors import FleetStateError
from console.fleet.fleet_state import fleet_db, state_errors
from engine.state.db import StateDB


@dataclass(frozen=True)
class Approval:
    node_id: str
    name: str
    address: str
    control_port: int
    fleet_id: str
    approved_at: str  # ISO 8601, UTC


class ApprovalBook:
    """Approved agents by node id: in memory, written through to the state database of ``state_dir``."""

    def __init__(self, state_dir: Path) -> None:
        self._state_dir = Path(state_dir)
        self.path = self._db.path
        self._approved = self._load()

    @property
    def _db(self) -> StateDB:
        return fleet_db(self._state_dir)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._approved

    @property
    def approved(self) -> Mapping[str, Approval]:
        return MappingProxyType(self._approved)

    def add(self, node_id: str, name: str, address: str, control_port: int, fleet_id: str) -> Approval:
        approval = Approval(node_id, name, address, control_port, fleet_id,
                            dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
        with state_errors():
            self._db.put_approval(**asdict(approval))
        self._approved = {**self._approved, node_id: approval}
        return approval

    def discard(self, node_id: str) -> None:
        if node_id in self._approved:
            with state_errors():
                self._db.delete_approval(node_id)
            self._approved = {k: v for k, v in self._approved.items() if k != node_id}

    def _load(self) -> dict[str, Approval]:
        approved = {}
        with state_errors():
            rows = self._db.approvals()
        for row in rows:
            approval = Approval(**row)
            if not isinstance(approval.control_port, int):
                raise FleetStateError(f"the approved agents in {self.path} have a malformed entry for "
                                      f"{approval.node_id!r} (control_port {approval.control_port!r})")
            approved[approval.node_id] = approval
        return approved
