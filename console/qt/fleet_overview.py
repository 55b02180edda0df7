"""What the console's Dashboard shows, decided without Qt: the fleet's agents by state (with a
colour each), the rings served and their models, the figures of the moment (requests now,
tokens per second, failovers today) and a short CPU / memory history per agent for sparklines.

Everything comes from what the fleet service already sends: the agent records (each with its
last status: ``cpu_percent``, ``memory_used_bytes``), the ring events of the feed and
``GET /admin/v1/metrics`` (per-ring coordinator metrics, plus ``failovers_today``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from console.fleet_api.agent_record import UNKNOWN_STATE, UNVERIFIED_STATE, AgentRecord, Membership
from console.fleet_api.ring_status import RingPhase

HISTORY_S = 300.0  # how far back a sparkline reaches
SAMPLE_S = 2.0  # one sample per agent per this many seconds at most
UNREACHABLE = "unreachable"
AWAITING = "awaiting approval"

# the order and colour of every state the Dashboard counts (a state not listed counts as "other")
STATES: tuple[tuple[str, str], ...] = (
    ("serving", "#1e8e3e"), ("idle", "#5f6368"), ("fetching", "#1a73e8"), ("paused", "#f9ab00"),
    (AWAITING, "#a142f4"), (UNREACHABLE, "#d93025"), ("error", "#b3261e"), (UNVERIFIED_STATE, "#9aa0a6"),
    (UNKNOWN_STATE, "#bdc1c6"), ("other", "#dadce0"),
)
COLOURS = dict(STATES)


def dashboard_state(record: AgentRecord) -> str:
    """The state a member is counted under: unreachable (its last poll failed) before what it
    said last, members not approved yet apart."""
    if record.reachable is False:
        return UNREACHABLE
    if not record.approved and record.state != UNVERIFIED_STATE:
        return AWAITING
    return record.state if record.state in COLOURS else "other"


def awaiting_approval(records: Iterable[AgentRecord]) -> list[AgentRecord]:
    """The members waiting for the admin's approval that the admin can approve now (an unverified
    claim cannot be; an unreachable PC is shown as such)."""
    return [r for r in members(records) if dashboard_state(r) == AWAITING]


def members(records: Iterable[AgentRecord]) -> list[AgentRecord]:
    return [r for r in records if r.membership is Membership.MEMBER]


@dataclass(frozen=True)
class StateCount:
    state: str
    count: int
    colour: str


def state_counts(records: Iterable[AgentRecord]) -> tuple[StateCount, ...]:
    """This fleet's members by state, in `STATES` order, states with none left out."""
    counts: dict[str, int] = {}
    for record in members(records):
        state = dashboard_state(record)
        counts[state] = counts.get(state, 0) + 1
    return tuple(StateCount(s, counts[s], colour) for s, colour in STATES if counts.get(s))


@dataclass(frozen=True)
class RingLine:
    """One served ring: its id, model, phase, stage count and tokens per second now."""

    ring: str
    model: str
    phase: str
    stages: int
    tok_s: float | None
    active_streams: int | None


@dataclass(frozen=True)
class Figures:
    """The numbers of the moment over every ring: ``None`` when no ring reports them."""

    models: tuple[str, ...]  # the models served now (a ring in phase "serving"), sorted
    rings_serving: int
    requests_now: int | None
    tok_s: float | None
    failovers_today: int | None


def ring_lines(rings: Mapping[str, Mapping[str, Any]], metrics: Mapping[str, Mapping[str, float]]) -> list[RingLine]:
    """A line per ring of the feed's ``ring`` events (ring id -> its JSON), with its metrics."""
    out = []
    for ring_id in sorted(rings):
        ring, sample = rings[ring_id], metrics.get(ring_id, {})
        stages = len((ring.get("plan") or {}).get("stages") or ())
        tok_s = sample.get("tokens_per_second")
        active = sample.get("active_streams")
        out.append(RingLine(ring_id, str(ring.get("model", "")), str(ring.get("phase", "")), stages,
                            None if tok_s is None else float(tok_s), None if active is None else int(active)))
    return out


def figures(lines: Sequence[RingLine], failovers_today: int | None) -> Figures:
    serving = [r for r in lines if r.phase == RingPhase.SERVING]
    rates = [r.tok_s for r in serving if r.tok_s is not None]
    active = [r.active_streams for r in serving if r.active_streams is not None]
    return Figures(tuple(sorted({r.model for r in serving})), len(serving), sum(active) if active else None,
                   sum(rates) if rates else None, failovers_today)


@dataclass(frozen=True)
class LoadPoint:
    at: float
    cpu_percent: float | None
    memory_fraction: float | None  # memory used / the PC's RAM


class LoadHistory:
    """CPU % and memory used per agent (by key) over the last ``window_s``, from the records'
    statuses sampled at most every ``sample_s`` (a record set arrives on every change)."""

    def __init__(self, window_s: float = HISTORY_S, sample_s: float = SAMPLE_S) -> None:
        self.window_s, self.sample_s = window_s, sample_s
        self._points: dict[str, deque[LoadPoint]] = {}

    def add(self, records: Iterable[AgentRecord], now: float) -> None:
        """Sample every reachable member's last status at ``now`` (monotonic seconds)."""
        present = set()
        for record in members(records):
            present.add(record.key)
            status = record.status
            if status is None or record.reachable is False:
                continue
            if status.cpu_percent is None and status.memory_used_bytes is None:
                continue
            points = self._points.setdefault(record.key, deque())
            if points and now - points[-1].at < self.sample_s:
                continue
            total = status.inventory.get("ram_total") or record.memory_bytes
            memory = (status.memory_used_bytes / total
                      if status.memory_used_bytes is not None and isinstance(total, int) and total > 0 else None)
            points.append(LoadPoint(now, status.cpu_percent, None if memory is None else min(1.0, memory)))
        for key in list(self._points):
            points = self._points[key]
            while points and now - points[0].at > self.window_s:
                points.popleft()
            if key not in present or not points:
                del self._points[key]

    def cpu(self, key: str) -> list[float]:
        return [p.cpu_percent for p in self._points.get(key, ()) if p.cpu_percent is not None]

    def memory(self, key: str) -> list[float]:
        """Memory used as a fraction of the PC's RAM, oldest first."""
        return [p.memory_fraction for p in self._points.get(key, ()) if p.memory_fraction is not None]

    def latest(self, key: str) -> LoadPoint | None:
        points = self._points.get(key)
        return points[-1] if points else None

    def busiest(self, limit: int) -> list[str]:
        """The ``limit`` agents with the highest CPU now (then memory), keys."""
        def load(key: str) -> tuple[float, float]:
            p = self._points[key][-1]
            return (p.cpu_percent or 0.0, p.memory_fraction or 0.0)
        return sorted(self._points, key=load, reverse=True)[:limit]
