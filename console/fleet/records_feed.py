"""The fleet's agent records as the admin API shows them, cheap at 1,000 agents.

The ``records`` event carries every agent (``admin_shapes.agent_json``, a status with its whole
inventory each): at 1,000 agents that is ~1.5 MB, and the fleet model changes many times a
second (registrations every 30 s per agent, polls, pauses). Two things keep it affordable:

- :class:`AgentJsonCache` keeps each record's JSON until the record changes (the fleet model
  keeps an unchanged record as the same object), refreshing only ``last_seen_s``.
- :class:`RecordsPublisher` publishes at once after a quiet spell, otherwise at most once per
  ``every_s`` with the records as they are by then; the feed keeps only the newest ``records``
  event (``EventFeed(latest_only=...)``), each being the whole list.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

from console.fleet_api.admin_shapes import agent_json
from console.fleet_api.agent_record import AgentRecord

RECORDS_EVERY_S = 0.3


class AgentJsonCache:
    """``dump(records)``: the records' JSON, reusing each unchanged record's from last time."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[AgentRecord, dict[str, Any]]] = {}

    def dump(self, records: Iterable[AgentRecord], now: float | None = None) -> list[dict[str, Any]]:
        now = time.monotonic() if now is None else now
        fresh: dict[str, tuple[AgentRecord, dict[str, Any]]] = {}
        out = []
        for record in records:
            hit = self._cache.get(record.key)
            if hit is not None and hit[0] is record:
                data = dict(hit[1])  # a shallow copy: only the age moves on
                # as agent_json computes it
                data["last_seen_s"] = None if record.last_seen is None else round(max(0.0, now - record.last_seen), 3)
            else:
                data = agent_json(record, now=now)
            fresh[record.key] = (record, data)
            out.append(data)
        self._cache = fresh
        return out


class RecordsPublisher:
    """``on_records(records)`` as the fleet model's listener; ``publish(agents_json)`` is called
    at once when the last one is ``every_s`` old, else once when it will be."""

    def __init__(self, records: Callable[[], Iterable[AgentRecord]], publish: Callable[[list[dict[str, Any]]], None],
                 *, every_s: float = RECORDS_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._records, self._publish = records, publish
        self.every_s, self._clock = every_s, clock
        self.cache = AgentJsonCache()
        self._last = float("-inf")
        self._pending: asyncio.TimerHandle | None = None

    def on_records(self, records: tuple[AgentRecord, ...]) -> None:
        if self._pending is not None:
            return  # the scheduled one will carry these
        wait = self._last + self.every_s - self._clock()
        if wait > 0:
            try:
                self._pending = asyncio.get_running_loop().call_later(wait, self.flush)
                return
            except RuntimeError:  # no loop (a pure caller): publish now
                pass
        self.flush()

    def flush(self) -> None:
        """Publish the records as they are now (and forget a scheduled publish)."""
        self.cancel()
        self._last = self._clock()
        self._publish(self.cache.dump(self._records()))

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
