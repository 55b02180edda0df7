"""Responses kept for ``GET``/``DELETE /v1/responses/{id}`` and ``previous_response_id``: each with the
conversation it ends (its input and output as chat messages, what a follow-up continues).

Kept in the API server's memory, by the key that created it (another key's id reads as not found:
no response is visible across keys), for ``ttl_s`` (default a day), and bounded: at most
``per_owner`` responses and ``per_owner_bytes`` per key, ``max_entries`` and ``max_bytes`` in all; past
a bound the oldest go first (the key's own, for its bounds). A restart of the service forgets them:
a follow-up naming a forgotten id is a 404 that says so.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_ENTRIES = 4096
MAX_BYTES = 256 << 20
PER_OWNER = 512
PER_OWNER_BYTES = 32 << 20
TTL_S = 24 * 3600.0


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    response: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]
    size: int
    expires_at: float


class ResponseStore:
    """The bounded store of the module docstring (one event loop's: not thread-safe)."""

    def __init__(self, *, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES, per_owner: int = PER_OWNER,
                 per_owner_bytes: int = PER_OWNER_BYTES, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.max_bytes, self.per_owner, self.per_owner_bytes = (max_entries, max_bytes, per_owner,
                                                                                   per_owner_bytes)
        self.ttl_s, self.clock = ttl_s, clock
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._bytes = 0
        self._owner_bytes: collections.Counter[str] = collections.Counter()
        self._owner_count: collections.Counter[str] = collections.Counter()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, owner: str, response: dict[str, Any], conversation: tuple[dict[str, Any], ...]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.per_owner_bytes:
            return  # larger than a key may keep: answered, not stored (GET says not found)
        self._expire()
        while self._owner_count[owner] >= self.per_owner or self._owner_bytes[owner] + size > self.per_owner_bytes:
            self._drop(next(k for k, v in self._entries.items() if v.owner == owner))
        while self._entries and (len(self._entries) >= self.max_entries or self._bytes + size > self.max_bytes):
            self._drop(next(iter(self._entries)))
        self._entries[response["id"]] = StoredResponse(owner, response, conversation, size, self.clock() + self.ttl_s)
        self._bytes += size
        self._owner_bytes[owner] += size
        self._owner_count[owner] += 1

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The response, if ``owner`` stored it and it has not expired or been dropped."""
        self._expire()
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, owner: str, response_id: str) -> bool:
        if self.get(owner, response_id) is None:
            return False
        self._drop(response_id)
        return True

    def _expire(self) -> None:
        now = self.clock()
        while self._entries and next(iter(self._entries.values())).expires_at <= now:
            self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id)
        self._bytes -= entry.size
        self._owner_bytes[entry.owner] -= entry.size
        self._owner_count[entry.owner] -= 1
        if not self._owner_count[entry.owner]:
            del self._owner_count[entry.owner], self._owner_bytes[entry.owner]
