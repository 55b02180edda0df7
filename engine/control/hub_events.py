"""What the hub keeps of its members' reports, and how much of it any one member may make it keep.

An agent reports a pause, a resume or a lost worker to the hub (``POST /v1/events``) and
registers there on networks that drop multicast (``POST /v1/register``). Every member holds a
fleet certificate, approved or not, so these bodies come from insiders the hub cannot trust
with its memory: a member must not be able to fill the fleet service, slow its only loop or
push other members' reports out (issue 29, H1). Hence, all pure and unit-testable:

- a small body limit per route (:data:`MAX_EVENT_BODY_BYTES`, :data:`MAX_REGISTRATION_BODY_BYTES`;
  413 naming it beyond);
- an event keeps only the fields an event needs, each trimmed (:func:`event_body`): nothing else
  a member sent is stored, logged or republished on the admin feed;
- a rate per member (:class:`MemberRate`: a token bucket, :data:`EVENTS_PER_MINUTE` with a
  burst of :data:`EVENT_BURST`; 429 with ``Retry-After`` beyond);
- a log bounded per member and in total, in events and in bytes (:class:`EventLog`): a member
  over its share loses its own oldest reports, and when the whole log is full the member
  holding the most bytes loses its oldest, so one member's flood never evicts another's news.
"""

from __future__ import annotations

import collections
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.control.messages import ControlRequestError

EVENT_KINDS = ("paused", "resumed", "worker-lost")  # worker-lost: its stage worker died (a failover now)
MAX_EVENT_BODY_BYTES = 4 << 10  # a real report is ~300 bytes: its reasons, export id, stage and a short detail
MAX_REGISTRATION_BODY_BYTES = 16 << 10  # the agent's advertisement, address, port and tags: ~1 KiB
MAX_REASONS = 8
MAX_REASON_CHARS = 64
MAX_DETAIL_CHARS = 256
MAX_EXPORT_ID_CHARS = 128
MAX_STAGE = 1023
EVENTS_PER_MINUTE = 30.0  # per member, reports and registrations together (an agent registers every 30 s)
EVENT_BURST = 10
KEEP_PER_MEMBER = 32  # events a member's reports may hold in the log
MAX_BYTES_PER_MEMBER = 32 << 10
KEEP_EVENTS = 1000  # events in all
MAX_HELD_BYTES = 1 << 20  # bytes in all
EVENT_OVERHEAD_BYTES = 160  # what an event costs besides its body: node id, kind, time, the object
RATE_TABLE_PRUNE_AT = 4096  # members with a bucket before idle (full) buckets are dropped


@dataclass(frozen=True)
class AgentEvent:
    """An agent's report: ``event`` is paused/resumed/worker-lost/registered; ``body`` what the hub
    kept of it (:func:`event_body`; a registration's whole body, at most
    :data:`MAX_REGISTRATION_BODY_BYTES`); ``received`` is monotonic time."""

    node_id: str
    event: str
    body: dict
    received: float
    size: int = field(default=0, compare=False)  # bytes it holds in the log (see :func:`held_size`)


def held_size(body: Mapping[str, Any]) -> int:
    """The bytes an event with ``body`` is counted as holding: its JSON plus a fixed overhead."""
    return EVENT_OVERHEAD_BYTES + len(json.dumps(body, separators=(",", ":"), ensure_ascii=True))


def check_body_size(length: int | None, limit: int, what: str) -> None:
    """ControlRequestError 413 naming ``limit`` when a ``what`` body of ``length`` bytes is too large."""
    if length is not None and length > limit:
        raise ControlRequestError(f"{what} body is {length} bytes; the limit is {limit} bytes", 413)


def _short(value: Any, limit: int) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def event_body(data: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a report the hub keeps, each trimmed; ControlRequestError 400 for an unknown
    ``event``. Anything else the member sent is dropped here, before it is stored or published."""
    event = data.get("event")
    if event not in EVENT_KINDS:
        raise ControlRequestError("event must be " + ", ".join(repr(k) for k in EVENT_KINDS[:-1])
                                  + f" or {EVENT_KINDS[-1]!r}")
    reasons = data.get("reasons")
    kept = [r[:MAX_REASON_CHARS] for r in reasons if isinstance(r, str)][:MAX_REASONS] \
        if isinstance(reasons, list) else []
    stage = data.get("stage")
    stage = stage if isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage <= MAX_STAGE else None
    return {"event": event, "reasons": kept, "export_id": _short(data.get("export_id"), MAX_EXPORT_ID_CHARS),
            "stage": stage, "detail": _short(data.get("detail"), MAX_DETAIL_CHARS)}


def public_body(event: AgentEvent) -> dict[str, Any]:
    """What the admin feed republishes of ``event``: a report's kept fields; of a registration,
    only where the agent said it listens (its full body goes to the fleet model, not the feed)."""
    if event.event == "registered":
        port = event.body.get("control_port")
        return {"address": _short(event.body.get("address"), 255),
                "control_port": port if isinstance(port, int) and not isinstance(port, bool) else None}
    return dict(event.body)


@dataclass
class _Bucket:
    tokens: float
    at: float


class MemberRate:
    """A token bucket per member: ``per_minute`` reports a minute, ``burst`` at once. Pure (the
    clock is passed in); the table of buckets is pruned of idle ones, so it stays bounded by the
    members that report."""

    def __init__(self, per_minute: float = EVENTS_PER_MINUTE, burst: int = EVENT_BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if per_minute <= 0 or burst < 1:
            raise ValueError(f"MemberRate needs per_minute > 0 and burst >= 1, got {per_minute}, {burst}")
        self.per_minute, self.burst = per_minute, burst
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def admit(self, node_id: str) -> float | None:
        """Count one report of ``node_id``: None when admitted, else the seconds until it would be."""
        now = self._clock()
        bucket = self._buckets.get(node_id)
        if bucket is None:
            if len(self._buckets) >= RATE_TABLE_PRUNE_AT:
                self._prune(now)
            bucket = self._buckets[node_id] = _Bucket(float(self.burst), now)
        rate = self.per_minute / 60.0
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * rate)
        bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return None
        return (1.0 - bucket.tokens) / rate

    def _prune(self, now: float) -> None:
        rate = self.per_minute / 60.0
        for node_id in [n for n, b in self._buckets.items() if b.tokens + (now - b.at) * rate >= self.burst]:
            del self._buckets[node_id]

    def __len__(self) -> int:
        return len(self._buckets)


class ReportRateError(ControlRequestError):
    """Raised (429) for a member's report beyond its rate; ``retry_after_s`` says when one would pass."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, 429)
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> str:
        """``Retry-After``: whole seconds, rounded up, at least 1."""
        return str(max(1, math.ceil(self.retry_after_s)))


class EventLog:
    """The hub's recent events, oldest first, bounded per member (``per_member`` events,
    ``member_bytes``) and in all (``keep`` events, ``max_bytes``). See the module docstring for
    who loses what when a bound is reached."""

    def __init__(self, *, keep: int = KEEP_EVENTS, max_bytes: int = MAX_HELD_BYTES,
                 per_member: int = KEEP_PER_MEMBER, member_bytes: int = MAX_BYTES_PER_MEMBER) -> None:
        self.keep, self.max_bytes = keep, max_bytes
        self.per_member, self.member_bytes = per_member, member_bytes
        self._order: collections.OrderedDict[int, AgentEvent] = collections.OrderedDict()  # arrival -> event
        self._by_member: dict[str, collections.deque[int]] = {}  # node id -> its arrivals, oldest first
        self._member_held: collections.Counter[str] = collections.Counter()
        self._held = 0
        self._next = 0
        self.evicted = 0

    @property
    def held_bytes(self) -> int:
        """The bytes the log counts itself as holding (:func:`held_size` of every event)."""
        return self._held

    def member_bytes_held(self, node_id: str) -> int:
        return self._member_held[node_id]

    def append(self, event: AgentEvent) -> None:
        node = event.node_id
        self._order[self._next] = event
        self._by_member.setdefault(node, collections.deque()).append(self._next)
        self._next += 1
        self._member_held[node] += event.size
        self._held += event.size
        mine = self._by_member[node]
        while len(mine) > self.per_member or (self._member_held[node] > self.member_bytes and len(mine) > 1):
            self._evict(node)
        while len(self._order) > self.keep or self._held > self.max_bytes:
            self._evict(max(self._member_held, key=lambda n: (self._member_held[n], len(self._by_member[n]))))

    def _evict(self, node: str) -> None:
        mine = self._by_member[node]
        old = self._order.pop(mine.popleft())
        self._member_held[node] -= old.size
        self._held -= old.size
        self.evicted += 1
        if not mine:
            del self._by_member[node]
            del self._member_held[node]

    def __iter__(self) -> Iterator[AgentEvent]:
        return iter(list(self._order.values()))

    def __len__(self) -> int:
        return len(self._order)

    def of(self, node_id: str) -> list[AgentEvent]:
        """``node_id``'s events still held, oldest first."""
        return [self._order[i] for i in self._by_member.get(node_id, ())]
