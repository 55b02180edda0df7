"""The agents the admin approved for placement, kept in the fleet service's state dir.

One JSON file, replaced atomically on every change, one agent a line. Each entry keeps where the
agent was last seen, so an approved agent is listed (and polled) after a fleet service restart even on
a network that drops multicast. Each entry's JSON is made once and kept: re-encoding a thousand
entries (``asdict`` and the pure-Python indenting encoder) took ~70 ms per approval at 1,000
agents. A file that does not parse stops the fleet service with `FleetStateError` and is left in place.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType

from console.fleet.errors import FleetStateError
from console.fleet.state_file import read_agents
from engine.atomic_file import write_text_atomic

APPROVALS_FILE = "approved-agents.json"
FORMAT = 1
_WHAT = "the approved-agents list"


@dataclass(frozen=True)
class Approval:
    node_id: str
    name: str
    address: str
    control_port: int
    fleet_id: str
    approved_at: str  # ISO 8601, UTC


class ApprovalBook:
    """Approved agents by node id, persisted in ``state_dir / APPROVALS_FILE``."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / APPROVALS_FILE
        self._approved = self._load()
        self._lines = {k: _line(k, v) for k, v in self._approved.items()}  # node id -> its entry's JSON

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._approved

    @property
    def approved(self) -> Mapping[str, Approval]:
        return MappingProxyType(self._approved)

    def add(self, node_id: str, name: str, address: str, control_port: int, fleet_id: str) -> Approval:
        approval = Approval(node_id, name, address, control_port, fleet_id,
                            dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
        self._save({**self._approved, node_id: approval}, {**self._lines, node_id: _line(node_id, approval)})
        return approval

    def discard(self, node_id: str) -> None:
        if node_id in self._approved:
            self._save({k: v for k, v in self._approved.items() if k != node_id},
                       {k: v for k, v in self._lines.items() if k != node_id})

    def _save(self, approved: dict[str, Approval], lines: dict[str, str]) -> None:
        text = f'{{"format": {FORMAT}, "agents": {{\n' + ",\n".join(lines[k] for k in sorted(lines)) + "\n}}\n"
        try:
            write_text_atomic(self.path, text)
        except OSError as exc:
            raise FleetStateError(f"cannot write {_WHAT} to {self.path}: {exc}; check free disk space "
                                    "and the state directory's permissions") from exc
        self._approved, self._lines = approved, lines

    def _load(self) -> dict[str, Approval]:
        """The approvals in the file; FleetStateError naming what is wrong (the file is left as it is)."""
        agents = read_agents(self.path, _WHAT, FORMAT, "the agents must then be approved again")
        approved = {}
        for node_id, entry in agents.items():
            try:
                approval = Approval(**entry)
                if not (isinstance(approval.control_port, int) and approval.node_id == node_id
                        and all(isinstance(getattr(approval, f), str) for f in
                                ("node_id", "name", "address", "fleet_id", "approved_at"))):
                    raise TypeError("a field has the wrong type")
            except TypeError as exc:
                raise FleetStateError(f"{_WHAT} in {self.path} has a malformed entry for {node_id!r} "
                                        f"({exc}); it was left in place: fix or remove that entry") from exc
            approved[node_id] = approval
        return approved


def _line(node_id: str, approval: Approval) -> str:
    """One agent's line of the file: ``"<node id>": {entry}`` (the C encoder: no indent)."""
    return f"{json.dumps(node_id)}: {json.dumps(asdict(approval), sort_keys=True)}"
