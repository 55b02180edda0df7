"""The agents' tags as the fleet service keeps them: ``agent-tags.json`` in its state dir.

Two words per agent: the tags the agent reports of itself (its settings, ``deskfleet agent
--tags``; they arrive with every status poll) and the tags an admin set from the service (admin
API, ``deskfleet fleet tag``, the console). The admin's word wins while it stands; taking it away
(``None``) lets the agent's own count again. Both are kept, so an approved agent shows its tags
after a restart of the service before its first poll.

The file is written only when something changed (a poll that reports the same tags writes
nothing) and atomically (:mod:`console.fleet.state_file`); a file that does not parse stops the
service with `FleetStateError` naming it and is left in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from console.fleet.errors import FleetStateError
from console.fleet.state_file import read_agents, write_json
from engine.control.tags import parse_tags
from engine.errors import TagError

TAGS_FILE = "agent-tags.json"
FORMAT = 1
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
    """The file's one owner (the service's FleetModel holds it, on the service's loop)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / TAGS_FILE
        self._tags: dict[str, AgentTags] = self._load()

    def get(self, node_id: str) -> AgentTags:
        return self._tags.get(node_id, AgentTags())

    def note_reported(self, node_id: str, tags: tuple[str, ...]) -> None:
        """What the agent said of itself in its last status (saved when it changed)."""
        old = self.get(node_id)
        if old.reported != tags:
            self._save({**self._tags, node_id: AgentTags(tags, old.admin)})

    def set_admin(self, node_id: str, tags: tuple[str, ...] | None) -> AgentTags:
        """The admin's tags for ``node_id`` (validated); None takes them away."""
        tags = None if tags is None else parse_tags(tags)
        new = AgentTags(self.get(node_id).reported, tags)
        self._save({**self._tags, node_id: new})
        return new

    def discard(self, node_id: str) -> None:
        if node_id in self._tags:
            self._save({k: v for k, v in self._tags.items() if k != node_id})

    def _save(self, tags: dict[str, AgentTags]) -> None:
        body = {k: {"reported": list(v.reported), "admin": None if v.admin is None else list(v.admin)}
                for k, v in tags.items() if v.reported or v.admin is not None}
        write_json(self.path, {"format": FORMAT, "agents": body}, _WHAT)
        self._tags = tags

    def _load(self) -> dict[str, AgentTags]:
        agents = read_agents(self.path, _WHAT, FORMAT, "the admin's tags must then be set again")
        out = {}
        for node_id, entry in agents.items():
            try:
                if not isinstance(entry, dict):
                    raise TagError("the entry is not an object")
                admin = entry.get("admin")
                out[node_id] = AgentTags(parse_tags(entry.get("reported", [])),
                                         None if admin is None else parse_tags(admin))
            except TagError as exc:
                raise FleetStateError(f"{_WHAT} in {self.path} has a malformed entry for {node_id!r} ({exc}); "
                                        "it was left in place: fix or remove that entry") from exc
        return out
