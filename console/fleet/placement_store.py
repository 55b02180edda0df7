"""The fleet service's placements, persisted: the ``placements`` table of its state database.

A placement is what ``POST /admin/v1/placements`` measured, calibrated and solved for a model:
its id, the model, the context, the export spec, the measured inputs and the plan (replaced by
each re-solve). The store writes a placement's row (one transaction) on every change and reads
the table once when the service starts, so a placement id keeps working after a restart. A row
that does not parse is a clear error naming the database, never an empty list.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from console.fleet.errors import FleetStateError
from console.fleet.fleet_state import fleet_db, state_errors
from console.fleet_api.admin_decode import inputs_from_json
from console.fleet_api.admin_shapes import ShapeError, inputs_json, plan_from_json, plan_json, spec_from_json, spec_json
from console.fleet_api.errors import FleetServiceError
from console.fleet_api.exports import ExportSpec
from console.fleet_api.placement import PlacementInputs
from engine.control.tags import parse_tags
from engine.errors import TagError
from engine.placement.types import Plan
from engine.state.db import StateDB

WHAT = "the list of placements"
_ID = re.compile(r"p([0-9]+)")


class PlacementNotFoundError(FleetServiceError):
    """A placement id names no placement the service holds (made here, or kept in its state database)."""


@dataclass
class Placement:
    """One placement; ``plan`` is replaced by a re-solve (then saved again). ``context_reason``
    says how the service chose the context (or "as given; auto would be …"); ``include_tags`` /
    ``exclude_tags`` are the tags it was asked to keep to (a re-solve may ask others)."""

    id: str
    model: str
    context: int
    spec: ExportSpec
    inputs: PlacementInputs
    plan: Plan
    context_reason: str = ""
    include_tags: tuple[str, ...] = ()
    exclude_tags: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "model": self.model, "context": self.context, "spec": spec_json(self.spec),
                "inputs": inputs_json(self.inputs), "plan": plan_json(self.plan),
                "context_reason": self.context_reason, "include_tags": list(self.include_tags),
                "exclude_tags": list(self.exclude_tags)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Placement:
        """(A file from before tags and the context's reason reads with none of either.)"""
        return cls(id=str(data["id"]), model=str(data["model"]), context=int(data["context"]),
                   spec=spec_from_json(data.get("spec")), inputs=inputs_from_json(data["inputs"]),
                   plan=plan_from_json(data["plan"]), context_reason=str(data.get("context_reason") or ""),
                   include_tags=parse_tags(data.get("include_tags") or [], "include_tags"),
                   exclude_tags=parse_tags(data.get("exclude_tags") or [], "exclude_tags"))


class PlacementStore:
    """The file's one owner: the placements in memory (by id, in creation order), written
    through on every change. Ids are p1, p2, …; a restart goes on after the highest one kept."""

    def __init__(self, state_dir: Path) -> None:
        self._state_dir = Path(state_dir)
        self.path = self._db.path
        self._items: dict[str, Placement] = self._load()
        self._last = max((int(m.group(1)) for p in self._items if (m := _ID.fullmatch(p))), default=0)

    @property
    def _db(self) -> StateDB:
        return fleet_db(self._state_dir)

    def _load(self) -> dict[str, Placement]:
        with state_errors():
            docs = self._db.placements()
        try:
            return {p.id: p for p in (Placement.from_json(d) for d in docs)}
        except (KeyError, TypeError, ValueError, AttributeError, ShapeError, TagError) as exc:
            raise FleetStateError(f"{WHAT} in {self.path} is damaged ({exc}); it was left as it is: restore it "
                                  "from a backup") from exc

    def new_id(self) -> str:
        self._last += 1
        while f"p{self._last}" in self._items:
            self._last += 1
        return f"p{self._last}"

    def __setitem__(self, placement_id: str, placement: Placement) -> None:
        if placement_id != placement.id:
            raise ValueError(f"placement {placement.id!r} stored under {placement_id!r}")
        self.put(placement)

    def put(self, placement: Placement) -> Placement:
        """Add or replace ``placement`` (a re-solved plan too) and write the file."""
        with state_errors():
            self._db.put_placement(placement.id, placement.to_json())
        self._items[placement.id] = placement
        return placement

    def get(self, placement_id: str) -> Placement:
        placement = self._items.get(placement_id)
        if placement is None:
            raise PlacementNotFoundError(f"there is no placement {placement_id!r} (placements: "
                                         f"{', '.join(self._items) or 'none'}); place the model again")
        return placement

    def __contains__(self, placement_id: object) -> bool:
        return placement_id in self._items
