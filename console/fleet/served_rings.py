"""What the fleet service serves, persisted: the ``served_rings`` table of its state database.

One entry per ring: its id, the model (by its library name), the plan it was placed with, the
export spec, the export once it exists, its standbys and the return port its coordinator listens
on; plus the API's port. The service writes a ring's row (one transaction) each time the ring is
created, has exported, or is stopped, and reads the table once at start to
re-form every ring with no admin action: agents keep their verified shards, and the same return
port and API address give every agent the assignment it already holds, so running workers keep
running. A row that does not parse is a clear error, never an empty fleet.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from console.fleet.errors import FleetStateError
from console.fleet.fleet_state import fleet_db, state_errors
from console.fleet_api.admin_shapes import ShapeError, plan_from_json, plan_json, spec_from_json, spec_json
from console.fleet_api.errors import FleetServiceError
from console.fleet_api.exports import ExportSpec
from engine.placement.types import Plan
from engine.state.db import StateDB

_RING_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}")


class RingIdError(FleetServiceError):
    """A ring id is not 1-32 letters, digits, '.', '_' or '-' (starting with a letter or digit)."""


def check_ring_id(ring: str) -> str:
    if not isinstance(ring, str) or not _RING_ID.fullmatch(ring):
        raise RingIdError(f"{ring!r} is not a ring id: use 1-32 letters, digits, '.', '_' or '-', "
                          "starting with a letter or digit")
    return ring


def next_ring_id(existing: Iterable[str]) -> str:
    """The first of r1, r2, … not in ``existing``."""
    taken = set(existing)
    n = 1
    while f"r{n}" in taken:
        n += 1
    return f"r{n}"


@dataclass(frozen=True)
class ServedRing:
    """One ring the service serves (or is bringing up). ``standby`` None: every approved agent
    outside the service's rings stands by for it."""

    ring: str
    model: str
    plan: Plan
    spec: ExportSpec = ExportSpec()
    export_id: str | None = None
    standby: tuple[str, ...] | None = None
    return_port: int = 0
    created: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        check_ring_id(self.ring)

    @property
    def node_ids(self) -> tuple[str, ...]:
        """The agents the plan places stages on, in stage order (each once)."""
        return tuple(dict.fromkeys(s.pc_id for s in self.plan.stages))

    def to_json(self) -> dict[str, Any]:
        return {"ring": self.ring, "model": self.model, "plan": plan_json(self.plan), "spec": spec_json(self.spec),
                "export_id": self.export_id, "standby": None if self.standby is None else list(self.standby),
                "return_port": self.return_port, "created": self.created}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServedRing:
        standby = data.get("standby")
        return cls(ring=str(data["ring"]), model=str(data["model"]), plan=plan_from_json(data["plan"]),
                   spec=spec_from_json(data.get("spec")), export_id=data.get("export_id"),
                   standby=None if standby is None else tuple(str(s) for s in standby),
                   return_port=int(data.get("return_port") or 0), created=float(data.get("created") or 0.0))


@dataclass(frozen=True)
class ServedState:
    """Everything the file holds. ``api_port`` 0: not fixed yet (the first start picks one)."""

    api_port: int = 0
    rings: tuple[ServedRing, ...] = ()

    def ring(self, ring_id: str) -> ServedRing | None:
        return next((r for r in self.rings if r.ring == ring_id), None)

    def with_ring(self, ring: ServedRing) -> ServedState:
        """``ring`` added, or replacing the entry of the same id (in place, keeping the order)."""
        if self.ring(ring.ring) is None:
            return replace(self, rings=(*self.rings, ring))
        return replace(self, rings=tuple(ring if r.ring == ring.ring else r for r in self.rings))

    def without_ring(self, ring_id: str) -> ServedState:
        return replace(self, rings=tuple(r for r in self.rings if r.ring != ring_id))


class ServedRings:
    """The table's one owner (the fleet service): ``state`` in memory, written through on change."""

    def __init__(self, state_dir: Path) -> None:
        self._state_dir = Path(state_dir)
        self.path = self._db.path
        self.state = self._load()

    @property
    def _db(self) -> StateDB:
        return fleet_db(self._state_dir)

    def _load(self) -> ServedState:
        with state_errors():
            docs, api_port = self._db.served_rings(), self._db.setting("api_port")
        try:
            return ServedState(api_port=int(api_port or 0), rings=tuple(ServedRing.from_json(r) for r in docs))
        except (KeyError, TypeError, ValueError, ShapeError, RingIdError) as exc:
            raise FleetStateError(f"the served rings in {self.path} are damaged ({exc}); it was left as it is: "
                                  "restore it from a backup, or stop that ring's entry with the admin API") from exc

    def put(self, ring: ServedRing) -> ServedRing:
        with state_errors():
            self._db.put_served_ring(ring.ring, ring.to_json())
        self.state = self.state.with_ring(ring)
        return ring

    def remove(self, ring_id: str) -> None:
        if self.state.ring(ring_id) is not None:
            with state_errors():
                self._db.delete_served_ring(ring_id)
            self.state = self.state.without_ring(ring_id)

    def set_api_port(self, port: int) -> None:
        if port != self.state.api_port:
            with state_errors():
                self._db.set_setting("api_port", port)
            self.state = replace(self.state, api_port=port)
