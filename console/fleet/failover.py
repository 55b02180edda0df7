"""Failover for the console's ring: when a stage stops answering, find out why and get it back.

The coordinator holds every stream and calls :meth:`RingRecovery.async_recover`. It asks every
agent of the ring for its status (short timeouts) and decides, in pure code
(:func:`console.fleet.failover_plan.plan_recovery`), then acts through the ring (a
:class:`RecoverableRing`: the :class:`~console.fleet.distribution.Distributor`):

- every stage serving again (a crashed worker its supervisor restarted, a pause that ended, a
  link that came back): reconnect the path and let the coordinator replay;
- a stage whose agent is unreachable, paused, stopped or given other work: move it to a free
  standby agent (assign it the stage with the lost stage's next hop, fetch, start), re-assign
  the upstream agent's next hop (its worker restarts; the replay rebuilds KV everywhere), and
  redial the first stage if stage 0 moved. The agent that lost the stage has its worker stopped
  and becomes a standby itself;
- a crashed worker whose agent is restarting it: wait for it up to ``restart_grace_s``, then move
  it to a standby if there is one;
- nothing to move to: wait (the agent may resume) until ``hold_s``, then fail the held streams
  with :class:`~console.fleet.errors.NoReplacementError` naming each lost stage and why;
- every agent reports its stage running, yet the steps stop again after each reconnect before one
  token is answered (a stuck worker: stopped, or too slow for the step timeout): after
  ``max_reconnects`` such reconnects in a row, fail the held streams with
  :class:`RingUnrepairableError` ("cannot be repaired"), naming the stages and why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from console.fleet.errors import AgentFailure, NoReplacementError
from console.fleet.failover_plan import (
    SERVING,
    UNREACHABLE,
    Move,
    Reconnect,
    StageMove,
    StageReport,
    Wait,
    check_standby,
    moved_layout,
    plan_recovery,
    ring_alarm,
    stage_condition,
    standby_usable,
)
from console.fleet.ring_layout import AgentEndpoint, RingLayout
from engine.control.messages import AgentStatus
from engine.errors import DeskfleetError
from engine.paged.coordinator import BatchCoordinator
from engine.paged.ring_path import PagedRingPath

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FailoverSettings:
    """How the console's ring fails over.

    ``step_timeout_s``: a step unanswered this long means a stage is lost (size it above the
    slowest prefill chunk). ``watch_s``: how often the agents of a running ring are asked for
    their status, so a crashed or paused worker is noticed before any step times out (0: never).
    ``hold_s``: how long held requests wait for a lost stage to come back
    or move. ``restart_grace_s``: how long a crashed worker gets to come back on its own agent
    before its stage moves to a standby. ``move_s``: the most a move may take once begun (fetch
    and start; the coordinator gives up at ``hold_s + move_s``). ``status_timeout_s``: each status
    question to an agent during recovery; ``poll_s``: how often they are asked.
    ``max_reconnects``: reconnects in a row of a ring whose every agent reports its stage running
    and which then answered no token before failing again; the next such failure is
    :class:`RingUnrepairableError` (a reconnect cannot repair a stuck worker).
    """

    step_timeout_s: float = 10.0
    watch_s: float = 1.0
    hold_s: float = 60.0
    restart_grace_s: float = 20.0
    move_s: float = 300.0
    status_timeout_s: float = 2.0
    poll_s: float = 0.25
    max_reconnects: int = 2

    @property
    def coordinator_hold_s(self) -> float:
        return self.hold_s + self.move_s


class RingUnrepairableError(NoReplacementError):
    """The ring kept failing after plain reconnects (every agent reporting its stage running,
    no token answered in between): a stage's worker is stuck where its agent cannot see it. The
    held requests fail with it; ``stage`` is the suspected stage when one is known, else None."""

    def __init__(self, message: str, stage: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage


@dataclass
class _Reconnected:
    """The last recovery was a plain reconnect: the workers' pids then and the coordinator's
    token count at the redial (a later failure with both unchanged made no progress)."""

    pids: dict[int, int | None]
    tokens: float
    streak: int  # plain reconnects in a row without progress, this one included


class RecoverableRing(Protocol):
    """What :class:`RingRecovery` needs of the ring it keeps up: what the ring is, a quick look at
    one agent, and the two things recovery does to it. :class:`~console.fleet.distribution.
    Distributor` implements it and owns every piece of state these change."""

    @property
    def layout(self) -> RingLayout:
        """Which agent serves which stage now."""
        ...

    @property
    def export_id(self) -> str: ...

    @property
    def failover(self) -> FailoverSettings:
        """Read at each failure (it may be replaced between them)."""
        ...

    async def async_agent_status(self, control: str, timeout: float) -> AgentStatus | str:
        """The status of the agent at ``control`` (HOST:PORT), or why it did not answer within
        ``timeout`` seconds."""
        ...

    async def async_redial(self, path: PagedRingPath) -> None:
        """Every stage serves again: redial the first stage on ``path`` (DeskfleetError, OSError
        or TimeoutError when it cannot)."""
        ...

    async def async_move(self, layout: RingLayout, released: Sequence[AgentEndpoint]) -> tuple[AgentFailure, ...]:
        """Serve on ``layout``: the ``released`` agents stop serving their lost stage, every agent
        whose assignment changed is assigned, fetched and started; the failures (empty: all serve)."""
        ...


class RingRecovery:
    """The coordinator's ``recover`` hook for a ring (a :class:`RecoverableRing`); ``standby`` is
    the ordered pool of approved agents that may take over a stage."""

    def __init__(self, ring: RecoverableRing, standby: Sequence[AgentEndpoint] = ()) -> None:
        check_standby(ring.layout, standby)
        self._ring = ring
        self.standby: list[AgentEndpoint] = list(standby)
        self.moves: list[StageMove] = []
        # control address -> the stage whose warm spare that standby holds (the ring keeps it)
        self.spares: dict[str, int] = {}
        # one entry per recovery, monotonic times: started (the coordinator held its streams),
        # serving (every stage reported serving again), redialled (the path is up: replay begins)
        self.timeline: list[dict[str, float | str]] = []
        # the coordinator's tokens answered so far (set by async_watch): a reconnect that made no
        # progress before the next failure did not repair the ring
        self._tokens: Callable[[], float] | None = None
        self._reconnected: _Reconnected | None = None

    async def _async_survey(self, *, with_standby: bool = True) -> tuple[list[StageReport], list[AgentEndpoint]]:
        """Every ring stage's report and the standbys usable now, asked all at once."""
        ring = self._ring
        targets, pool = ring.layout.targets, list(self.standby) if with_standby else []
        timeout = ring.failover.status_timeout_s
        statuses = await asyncio.gather(*(ring.async_agent_status(c, timeout) for c in
                                          [t.control for t in targets] + [e.control for e in pool]))
        reports = [StageReport(t.stage, t.label, *stage_condition(s, ring.export_id, t.stage),
                               pid=s.worker.pid if isinstance(s, AgentStatus) else None)
                   for t, s in zip(targets, statuses, strict=False)]
        usable = [e for e, s in zip(pool, statuses[len(targets):], strict=True) if standby_usable(s)]
        return reports, usable

    async def async_watch(self, coordinator: BatchCoordinator) -> None:
        """Runs beside a healthy ring: every ``watch_s`` ask its agents, and fail over at once
        when :func:`ring_alarm` says so. Baselines start afresh after every failover. It also
        lets the recovery see whether a reconnect made progress (the tokens answered)."""
        self._tokens = lambda: coordinator.metrics()["tokens_generated_total"]
        pids: dict[int, int | None] = {}
        streak: dict[int, int] = {}
        seen_failovers = -1.0
        while (every := self._ring.failover.watch_s) > 0:
            await asyncio.sleep(every)
            failovers = coordinator.metrics()["failovers_total"]
            if coordinator.recovering or failovers != seen_failovers:
                pids.clear()
                streak.clear()
                seen_failovers = failovers
                if coordinator.recovering:
                    continue
            try:
                reports, _ = await self._async_survey(with_standby=False)
            except Exception:  # a bug here must not end the watch for good
                log.exception("ring watch: surveying the agents failed")
                continue
            if coordinator.recovering:
                continue
            for r in reports:
                streak[r.stage] = streak.get(r.stage, 0) + 1 if r.condition == UNREACHABLE else 0
            alarm = ring_alarm(reports, pids, streak)
            if alarm is not None:
                coordinator.request_failover(alarm)
                continue
            pids = {r.stage: r.pid for r in reports}

    async def async_recover(self, path: PagedRingPath, reason: str) -> PagedRingPath:
        """Bring the ring back (see the module docstring); NoReplacementError after ``hold_s``.
        A paged ring's path redials under a new session (the workers drop the old session's pool
        state with its connection) and the scheduler replays."""
        settings = self._ring.failover
        record: dict[str, float | str] = {"reason": reason, "started": time.monotonic()}
        self.timeline.append(record)
        del self.timeline[:-32]
        deadline = time.monotonic() + settings.hold_s
        lost_since: dict[int, float] = {}
        last_why = ""
        tokens = self._tokens() if self._tokens is not None else None
        before, self._reconnected = self._reconnected, None
        first = True
        while True:
            reports, usable = await self._async_survey()
            now = time.monotonic()
            for report in reports:
                if report.condition == SERVING:
                    lost_since.pop(report.stage, None)
                else:
                    lost_since.setdefault(report.stage, now)
            decision = plan_recovery(reports, {s: now - t for s, t in lost_since.items()}, usable,
                                     settings.restart_grace_s, self.spares)
            if isinstance(decision, Reconnect):
                plain = self._plain_reconnect(first, reports, before, tokens) if tokens is not None else None
                record["serving"] = now
                try:
                    await self._ring.async_redial(path)
                    record["redialled"] = time.monotonic()
                    self._reconnected = plain
                    return path
                except (DeskfleetError, OSError, TimeoutError) as exc:
                    decision = Wait(f"every agent reports its stage running, but the console cannot reach the "
                                    f"first stage ({exc})")
            first = False
            if isinstance(decision, Move) and now < deadline:
                await self._async_move(decision)
                continue
            why = decision.why
            if now >= deadline:
                raise NoReplacementError(
                    f"no replacement within {settings.hold_s:.0f} s: {why}. Resume the PC, add a standby agent "
                    "or re-plan the ring without it")
            if why != last_why:
                log.warning("failover (%s): %s", reason, why)
                last_why = why
            await asyncio.sleep(settings.poll_s)

    def _plain_reconnect(self, first: bool, reports: Sequence[StageReport], before: _Reconnected | None,
                         tokens: float) -> _Reconnected | None:
        """This recovery's reconnect as a plain one (every stage serving at the first look),
        counted on from ``before`` when the same workers answered no token since; None when a
        stage was not serving at the first look (it was moved, restarted or resumed).
        RingUnrepairableError once the count passes ``max_reconnects``."""
        if not first:
            return None
        pids = {r.stage: r.pid for r in reports}
        same = before is not None and before.pids == pids and before.tokens == tokens
        streak = before.streak + 1 if same and before is not None else 1
        limit = self._ring.failover.max_reconnects
        if streak > limit:
            stages = ", ".join(f"stage {r.stage} on {r.agent}" for r in reports)
            raise RingUnrepairableError(
                f"the ring cannot be repaired: {limit} reconnect(s) in a row brought it back with every agent "
                f"reporting its stage running ({stages}), and each time its steps stopped again before one "
                "token was answered. A stage's worker is stuck (stopped, or too slow for the step "
                f"timeout of {self._ring.failover.step_timeout_s:.0f} s): restart that PC's agent, raise the "
                "step timeout, or re-plan the ring without it",
                reports[0].stage if len(reports) == 1 else None)
        return _Reconnected(pids, tokens, streak)

    async def _async_move(self, move: Move) -> None:
        """Put each moved stage on its standby, re-point the upstream agents, start what changed."""
        started = time.monotonic()
        old = {t.stage: t for t in self._ring.layout.targets}
        layout, released = moved_layout(self._ring.layout, move.moves)
        for _, endpoint in move.moves:
            self.standby.remove(endpoint)
            self.spares.pop(endpoint.control, None)  # its spare serves the stage now
        log.warning("failover: moving %s", ", ".join(f"stage {s} from {old[s].label} to {e.name or e.control}"
                                                     for s, e in move.moves))
        failures = await self._ring.async_move(layout, released)
        self.standby.extend(released)  # the agents that lost their stage wait as standbys
        for failure in failures:
            log.warning("failover: %s (stage %d) could not take its part: %s", failure.agent, failure.stage,
                        failure.message)
        seconds = time.monotonic() - started
        for stage, endpoint in move.moves:
            self.moves.append(StageMove(stage, old[stage].label, endpoint.name or endpoint.control, move.why, seconds))
