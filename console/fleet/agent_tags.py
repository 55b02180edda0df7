"""The agents' tags as the fleet service keeps them: a table of its state database.

Two words per agent: the tags the agent reports of itself (its settings, ``deskfleet agent
--tags``; they arrive with every status poll) and the tags an admin set from the service (admin
API, ``deskfleet fleet tag``, the console). The admin's word wins while it stands; taking it away
(``None``) lets the agent's own count again. Both are kept, so an approved agent shows its tags
after a restart of the service before its first poll.

An agent's row is written only when something changed (a poll that reports the same tags writes
nothing), one small transaction; a damaged database or a malformed tag stops the service with
`FleetStateError` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from console.fleet.errors import FleetStateError
from console.fleet.fleet_state import fleet_db, state_errors
from engine.control.tags import parse_tags
from engine.errors import TagError
from engine.state.db import StateDB

_WHAT = "the agents' tags"


@dataclass(frozen=True)
class AgentTags:
    """``admin`` is None while the admin has set nothing for this agent."""

    reported: tuple[str, ...] = ()
    admin: tuple[str, ...] | None = None

    @property
    def effective(self) -> tuple[str, ...]:
        return self.reported if self.admin is None else self.admin

    @property
    def set_by(self) -> str:
        return "agent" if self.admin is None else "admin"


class TagBook:
    """The tags' one owner (the service's FleetModel holds it, on the service's loop)."""

    def __init__(self, state_dir: Path) -> None:
        self._state_dir = Path(state_dir)
        self.path = self._db.path
        self._tags: dict[str, AgentTags] = self._load()

    @property
    def _db(self) -> StateDB:
        return fleet_db(self._state_dir)

    def get(self, node_id: str) -> AgentTags:
        return self._tags.get(node_id, AgentTags())

    def note_reported(self, node_id: str, tags: tuple[str, ...]) -> None:
        """What the agent said of itself in its last status (saved when it changed)."""
        old = self.get(node_id)
        if old.reported != tags:
            self._save(node_id, AgentTags(tags, old.admin))

    def set_admin(self, node_id: str, tags: tuple[str, ...] | None) -> AgentTags:
        """The admin's tags for ``node_id`` (validated); None takes them away."""
        tags = None if tags is None else parse_tags(tags)
        new = AgentTags(self.get(node_id).reported, tags)
        self._save(node_id, new)
        return new

    def discard(self, node_id: str) -> None:
        if node_id in self._tags:
            with state_errors():
                self._db.delete_agent_tags(node_id)
            self._tags = {k: v for k, v in self._tags.items() if k != node_id}

    def _save(self, node_id: str, tags: AgentTags) -> None:
        with state_errors():
            self._db.put_agent_tags(node_id, list(tags.reported), None if tags.admin is None else list(tags.admin))
        self._tags = {**self._tags, node_id: tags}

    def _load(self) -> dict[str, AgentTags]:
        with state_errors():
            rows = self._db.agent_tags()
        out = {}
        for node_id, (reported, admin) in rows.items():
            try:
                out[node_id] = AgentTags(parse_tags(reported), None if admin is None else parse_tags(admin))
            except TagError as exc:
                raise FleetStateError(f"{_WHAT} in {self.path} have a malformed entry for {node_id!r} ({exc}); "
                                      "set that agent's tags again") from exc
        return out
