"""The admin API's event feed (docs/ADMIN_API.md, "Events"): its kinds, an event, a long-poll's
answer. The fleet service publishes them (:mod:`console.fleet.service_events`); the console's
views follow them through :class:`~console.fleet_api.admin_client.AdminClient`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class EventKind(StrEnum):
    """What an event is about (its ``kind`` on the wire, this value)."""

    RECORDS = "records"  # every agent record, each time one changes
    HUB = "hub"  # an agent's report or registration at the hub
    TOKEN = "token"  # the current join token
    TOKENS = "tokens"  # the join-token list
    EXPORT = "export"  # an export's progress or end
    PROGRESS = "progress"  # an agent's progress in a ring's bring-up
    RING = "ring"  # a ring's phase or report changed
    RING_REMOVED = "ring_removed"
    HEALTH = "health"  # a ring's status changed
    METRICS = "metrics"
    KEYS = "keys"  # the API keys (no secrets)
    JOB = "job"  # a job started, finished or failed
    ERROR = "error"  # a background failure no job owns


KINDS = frozenset(EventKind)


@dataclass(frozen=True)
class Event:
    """One item of the event feed: ``kind`` as the doc's table lists, ``data`` its object."""

    seq: int
    at: float
    kind: EventKind
    data: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", EventKind(self.kind))  # its value is as good (tests, a replayed feed)


@dataclass(frozen=True)
class EventBatch:
    """One long-poll answer: ``reset`` means the events start with a fresh snapshot."""

    events: tuple[Event, ...]
    next: int
    reset: bool
