"""Each principal's share of a paged ring (issue 29 deliverable 2, issue 33 deliverable 3), pure.

A request's choices and its prompt's prefill are streams of one
:class:`~engine.generation.principal.Principal` (an API key, a fleet member, or the one anonymous
party of a server without keys). While streams of several principals are added and not ended, the
step composer (:mod:`engine.paged.step_composer`) asks this module three things:

- **slots**: how many of the ring's ``max_streams`` each principal may have running
  (:meth:`FairShare.slot_shares`). A waiting stream of a principal under its share is admitted
  first; when every slot is taken, a principal over its share gives one up (its newest stream not
  in flight is preempted: its blocks stay in the prefix cache, it re-prefills cheaply later).
- **a step's rows and token budget**: each principal's demand this step (decode rows, prefill
  chunks, admissions: :func:`demands`) is met up to its share (:meth:`FairShare.step_shares`).
- **in which order**: the one served least first (tokens / weight, a virtual clock per principal:
  start-time fair queueing), a batch principal's clock counted :data:`BATCH_LEAD` ahead (so
  interactive goes first when both wait, until a batch one has waited that long), then the oldest
  stream's: :meth:`FairShare.order`. The order is deterministic.

Every split is weighted max-min fair (:func:`split`): each principal with demand first gets one
unit in that order (so a batch key is never starved, however many interactive keys wait: while it
waits its clock stands still and theirs move past it), then shares in
proportion to its weight (:data:`~engine.generation.principal.PRIORITY_WEIGHTS`), and what a
principal does not need goes to the others (work-conserving). With one principal at work nothing
is capped: the composer behaves exactly as without this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from engine.generation.principal import Principal, PrincipalId
from engine.paged.state import Drafts, SchedulerConfig, StreamState

K = TypeVar("K")
BATCH_LEAD = 64.0  # virtual tokens a batch principal's clock counts ahead of an interactive one's
KEPT_CLOCKS = 4096  # principals whose clock is kept while they have no stream (a key book's worth)


def split(total: int, demands: Mapping[K, int], weights: Mapping[K, int], order: Sequence[K]) -> dict[K, int]:
    """``total`` units over ``demands``, weighted max-min fair: nobody gets more than it asks; each
    one asking first gets one unit (in ``order``, while units last), then the rest is shared in
    proportion to ``weights`` (water-filling: a small demand is met whole and its unused share goes
    to the others), whole units left over going one by one in ``order``."""
    give = {k: 0 for k in demands}
    left = total
    for k in order:
        if left and demands.get(k, 0) > 0:
            give[k], left = 1, left - 1
    active = [k for k in order if demands.get(k, 0) > give[k]]
    while left > 0 and active:
        weight = sum(weights[k] for k in active)
        fits = [k for k in active if (demands[k] - give[k]) * weight <= left * weights[k]]
        if fits:  # met whole: their unused share goes round again
            for k in fits:
                left -= demands[k] - give[k]
                give[k] = demands[k]
            active = [k for k in active if k not in fits]
            continue
        shares = {k: left * weights[k] // weight for k in active}  # each below its demand (none fit)
        for k in active:
            give[k] += shares[k]
        left -= sum(shares.values())
        for k in active:
            if not left:
                break
            give[k] += 1
            left -= 1
        break
    return give


@dataclass(frozen=True)
class Demand:
    """What one principal could use of the step being composed: rows and new tokens."""

    rows: int = 0
    tokens: int = 0

    def __add__(self, other: Demand) -> Demand:
        return Demand(self.rows + other.rows, self.tokens + other.tokens)


def demands(running: Iterable[StreamState], waiting: Iterable[StreamState], config: SchedulerConfig, drafts: Drafts,
            admissible: Mapping[PrincipalId, int]) -> dict[PrincipalId, Demand]:
    """Each principal's demand this step, an upper bound of what the composer would give it
    uncapped: a decode row (with its drafts) per decoding stream not in flight, a prefill chunk per
    prefilling one (or per one whose earlier chunks are in flight, when prefill is pipelined), and
    a first chunk per waiting stream it may admit (``admissible``: slots it may still take)."""
    out: dict[PrincipalId, Demand] = {}

    def add(s: StreamState, tokens: int) -> None:
        p = s.request.principal.id
        out[p] = out.get(p, Demand()) + Demand(1, tokens)

    for s in running:
        if s.cancelled:
            continue
        if s.in_flight is None:
            add(s, 1 + len(drafts.get(s.stream_id, ((), None))[0]) if s.pending == 1
                else min(config.prefill_chunk, s.pending))
        elif config.pipeline_prefill and s.unfed > 0:
            add(s, min(config.prefill_chunk, s.unfed))
    taken: dict[PrincipalId, int] = {}
    for s in waiting:
        p = s.request.principal.id
        if taken.get(p, 0) < admissible.get(p, 0):
            taken[p] = taken.get(p, 0) + 1
            add(s, min(config.prefill_chunk, len(s.tokens)))
    return out


class StepShares:
    """What each principal may still take of the step being composed (rows and tokens); a
    principal not named here has no cap."""

    def __init__(self, rows: Mapping[PrincipalId, int], tokens: Mapping[PrincipalId, int]) -> None:
        self._rows = dict(rows)
        self._tokens = dict(tokens)

    def room(self, principal: PrincipalId) -> int:
        """New tokens ``principal`` may still bring in one more row (0: its share is used up)."""
        if principal not in self._rows:
            return 1 << 30
        return self._tokens[principal] if self._rows[principal] > 0 else 0

    def take(self, principal: PrincipalId, tokens: int) -> None:
        if principal in self._rows:
            self._rows[principal] -= 1
            self._tokens[principal] -= tokens


class FairShare:
    """The principals' virtual clocks across steps. A principal's clock is kept while it has no
    stream (a chat user between two questions keeps what it was served), at most
    :data:`KEPT_CLOCKS` of them (:meth:`keep_only`)."""

    def __init__(self) -> None:
        self._clock: dict[PrincipalId, float] = {}  # tokens served / weight
        self._floor = 0.0  # the least served clock of the principals ordered last

    def order(self, principals: Iterable[Principal], oldest: Mapping[PrincipalId, int]) -> list[Principal]:
        """``principals`` in serving order: the one served least first, a batch one's clock counted
        :data:`BATCH_LEAD` ahead, then the oldest stream (``oldest``: its smallest stream id). A
        newcomer, or one back after a while, starts level with the least served of those at work,
        never behind them (no credit for having been away)."""
        principals = list(principals)
        for p in principals:
            self._clock[p.id] = max(self._clock.get(p.id, self._floor), self._floor)
        self._floor = min(self._clock[p.id] for p in principals)
        return sorted(principals, key=lambda p: (self._clock[p.id] + BATCH_LEAD * p.priority.rank, oldest[p.id]))

    def served(self, principal: Principal, tokens: int) -> None:
        """``principal`` got ``tokens`` of a step: its clock moves by tokens / weight."""
        self._clock[principal.id] = self._clock.get(principal.id, 0.0) + tokens / principal.weight

    def keep_only(self, live: Iterable[PrincipalId]) -> None:
        """Past :data:`KEPT_CLOCKS`, forget the least served principals without streams (a
        forgotten one starts level with the others when it comes back)."""
        if len(self._clock) <= KEPT_CLOCKS:
            return
        keep = set(live)
        idle = sorted((c, p) for p, c in self._clock.items() if p not in keep)
        for _, p in idle[:len(self._clock) - KEPT_CLOCKS]:
            del self._clock[p]

    @staticmethod
    def slot_shares(streams: Mapping[PrincipalId, int], slots: int,
                    order: Sequence[Principal]) -> dict[PrincipalId, int]:
        """How many of ``slots`` each principal may hold running, for its ``streams`` (running and
        waiting)."""
        return split(slots, streams, {p.id: p.weight for p in order}, [p.id for p in order])

    @staticmethod
    def step_shares(wants: Mapping[PrincipalId, Demand], rows: int, tokens: int,
                    order: Sequence[Principal]) -> StepShares:
        """Each principal's rows and tokens of a step of at most ``rows`` rows and ``tokens`` new
        tokens, for its demand ``wants`` this step."""
        weights = {p.id: p.weight for p in order}
        ids = [p.id for p in order if p.id in wants]
        return StepShares(split(rows, {p: wants[p].rows for p in ids}, weights, ids),
                          split(tokens, {p: wants[p].tokens for p in ids}, weights, ids))


class StepFairness:
    """The shares of the step being composed, as the composer spends them: each principal's slots
    and running streams, and what it may still take of the step (:class:`StepShares`)."""

    def __init__(self, order: Sequence[Principal], slots: Mapping[PrincipalId, int],
                 running: Mapping[PrincipalId, int]) -> None:
        self.order = list(order)
        self.slots = dict(slots)
        self.running = dict(running)
        self.shares = StepShares({}, {})  # uncapped until :meth:`divide`
        self.withheld = 0  # rows that waited because their principal's share of the step was used up

    def room(self, s: StreamState, want: int) -> int:
        """Up to ``want`` new tokens for a row of ``s`` within its principal's share (0: none now)."""
        room = min(want, self.shares.room(s.request.principal.id))
        if room < 1 <= want:
            self.withheld += 1
        return room

    def take(self, s: StreamState, tokens: int) -> None:
        self.shares.take(s.request.principal.id, tokens)

    def divide(self, running: Sequence[StreamState], waiting: Sequence[StreamState], config: SchedulerConfig,
               drafts: Drafts, rows: int, tokens: int, skip: set) -> None:
        """Share the step's ``rows`` and ``tokens`` by the principals' demands, once the slots are
        rebalanced: a waiting stream counts only if a free slot is there for it (in order)."""
        free = config.max_streams - len(running)
        line: dict[PrincipalId, int] = {}
        for s in waiting:
            if s.stream_id not in skip:
                line[s.request.principal.id] = line.get(s.request.principal.id, 0) + 1
        admissible: dict[PrincipalId, int] = {}
        for p in self.order:
            take = min(free, line.get(p.id, 0), max(0, self.slots.get(p.id, 0) - self.running.get(p.id, 0)))
            admissible[p.id], free = take, free - take
        wants = demands(running, [s for s in waiting if s.stream_id not in skip], config, drafts, admissible)
        self.shares = FairShare.step_shares(wants, rows, tokens, self.order)

    def admitted(self, s: StreamState) -> None:
        p = s.request.principal.id
        self.running[p] = self.running.get(p, 0) + 1

    def left(self, s: StreamState) -> None:
        """``s`` stopped running (preempted) in this step."""
        self.running[s.request.principal.id] -= 1

    def next_waiting(self, waiting: Iterable[StreamState], skip: set) -> StreamState | None:
        """The waiting stream to admit next: the first in line of the first principal (in order)
        under its slot share with room left in this step (None: nobody may be admitted)."""
        line = [s for s in waiting if s.stream_id not in skip]
        for p in self.order:
            if self.running.get(p.id, 0) < self.slots.get(p.id, 0) and self.shares.room(p.id) > 0:
                first = next((s for s in line if s.request.principal.id == p.id), None)
                if first is not None:
                    return first
        return None

    def admissible(self, waiting: Iterable[StreamState], skip: set) -> int:
        """Waiting streams that principals under their slot share may admit now."""
        line: dict[PrincipalId, int] = {}
        for s in waiting:
            if s.stream_id not in skip:
                line[s.request.principal.id] = line.get(s.request.principal.id, 0) + 1
        return sum(min(n, max(0, self.slots.get(p, 0) - self.running.get(p, 0))) for p, n in line.items())

    def victim(self, running: Sequence[StreamState]) -> StreamState | None:
        """The stream to preempt so a principal under its slot share can take a slot when none is
        free: the newest stream not in flight of the principal most over its share (None: nobody is
        over, or every stream of those who are is in flight). A principal's last stream is never
        taken: with more principals than slots they take turns as streams end, without churn."""
        over = sorted((p for p in self.order if self.running.get(p.id, 0) > max(1, self.slots.get(p.id, 0))),
                      key=lambda p: (self.slots.get(p.id, 0) - self.running.get(p.id, 0), -p.priority.rank))
        for p in over:
            mine = [s for s in running if s.request.principal.id == p.id and s.in_flight is None and not s.cancelled]
            if mine:
                return max(mine, key=lambda s: s.order)
        return None


def plan_step(fair: FairShare, streams: Iterable[StreamState], running: Sequence[StreamState],
              config: SchedulerConfig) -> StepFairness | None:
    """The slot shares of the next step over ``streams`` (every stream added and not ended): None
    while they are all one principal's (nothing is capped then). Its rows and tokens are shared by
    :meth:`StepFairness.divide`, once the slots are rebalanced."""
    principals: dict[PrincipalId, Principal] = {}
    oldest: dict[PrincipalId, int] = {}
    counts: dict[PrincipalId, int] = {}
    for s in streams:
        p = s.request.principal
        principals.setdefault(p.id, p)
        oldest[p.id] = min(oldest.get(p.id, s.stream_id), s.stream_id)
        counts[p.id] = counts.get(p.id, 0) + 1
    fair.keep_only(principals)
    if len(principals) < 2:
        return None
    order = fair.order(principals.values(), oldest)
    slots = FairShare.slot_shares(counts, config.max_streams, order)
    held: dict[PrincipalId, int] = {}
    for s in running:
        held[s.request.principal.id] = held.get(s.request.principal.id, 0) + 1
    return StepFairness(order, slots, held)
