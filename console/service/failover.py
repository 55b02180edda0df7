"""Failover for the console's ring: when a stage stops answering, find out why and get it back.

The coordinator holds every stream and calls :meth:`RingRecovery.async_recover`. It asks every
agent of the ring for its status (short timeouts) and decides, in pure code (:func:`plan_recovery`):

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
  with :class:`~console.service.errors.NoReplacementError` naming each lost stage and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from console.service.errors import LayoutError, NoReplacementError
from console.service.ring_layout import AgentEndpoint, AgentTarget, RingLayout
from engine.control.messages import AgentStatus, parse_hostport
from engine.control.client import ControlClient, ControlError
from engine.errors import DeskfleetError
from engine.coordinator.ring import RingPath
from engine.wire.address import Address

if TYPE_CHECKING:
    from console.service.distribution import Distributor
    from engine.coordinator.coordinator import Coordinator

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
    """

    step_timeout_s: float = 10.0
    watch_s: float = 1.0
    hold_s: float = 60.0
    restart_grace_s: float = 20.0
    move_s: float = 300.0
    status_timeout_s: float = 2.0
    poll_s: float = 0.25

    @property
    def coordinator_hold_s(self) -> float:
        return self.hold_s + self.move_s


# what a stage's agent reports during recovery
SERVING = "serving"
RESTARTING = "restarting"  # reachable, its supervisor is bringing the worker back
PAUSED = "paused"
UNREACHABLE = "unreachable"
STOPPED = "stopped"  # its worker stopped or failed for good
ELSEWHERE = "elsewhere"  # it now has another assignment


@dataclass(frozen=True)
class StageReport:
    """One stage of the ring as its agent reported it: ``condition`` is one of the names above."""

    stage: int
    agent: str
    condition: str
    detail: str = ""
    pid: int | None = None  # the worker's process id when serving

    def describe(self) -> str:
        return f"stage {self.stage} on {self.agent} is {self.condition}" + (f" ({self.detail})" if self.detail else "")


@dataclass(frozen=True)
class Reconnect:
    """Every stage serves: redial the path, replay."""


@dataclass(frozen=True)
class Wait:
    """Nothing to do yet; ``why`` is what the held requests are waiting for."""

    why: str


@dataclass(frozen=True)
class Move:
    """Move each (stage, standby) now."""

    moves: tuple[tuple[int, AgentEndpoint], ...]
    why: str


@dataclass(frozen=True)
class StageMove:
    """A move that was made (kept for reports and tests)."""

    stage: int
    from_agent: str
    to_agent: str
    why: str
    seconds: float


def stage_condition(status: AgentStatus | str, export_id: str, stage: int) -> tuple[str, str]:
    """(condition, detail) of a ring stage from its agent's status, or the error text of a
    status request that failed."""
    if isinstance(status, str):
        return UNREACHABLE, status
    if status.state == "paused":
        return PAUSED, ", ".join(status.paused_reasons) or "paused"
    if status.export_id != export_id or status.stage != stage:
        return ELSEWHERE, f"it now serves {status.export_id} stage {status.stage}"
    worker = status.worker
    if worker.state == "running":
        return SERVING, ""
    if worker.state in ("starting", "backoff"):
        return RESTARTING, f"worker {worker.state}, {worker.restarts} restart(s): {worker.last_error or 'no error'}"
    return STOPPED, f"worker {worker.state}: {worker.last_error or 'no reason given'}"


def ring_alarm(reports: Sequence[StageReport], previous_pids: Mapping[int, int | None],
               unreachable_streak: Mapping[int, int]) -> str | None:
    """Why a running ring should fail over now, or None. A worker that was replaced since the
    last look (crashed and restarted between two looks) lost its streams too; an agent must miss
    two looks in a row to count as unreachable (one slow answer is not a lost PC)."""
    for r in reports:
        if r.condition == UNREACHABLE and unreachable_streak.get(r.stage, 0) < 2:
            continue
        if r.condition != SERVING:
            return r.describe()
        before = previous_pids.get(r.stage)
        if before is not None and r.pid is not None and before != r.pid:
            return f"stage {r.stage} on {r.agent} restarted its worker (pid {before} -> {r.pid})"
    return None


def standby_usable(status: AgentStatus | str) -> bool:
    """A standby can take a stage when it answers, belongs to a fleet and is not paused."""
    return isinstance(status, AgentStatus) and status.state not in ("paused", "not-joined")


def plan_recovery(reports: Sequence[StageReport], lost_for: Mapping[int, float],
                  usable: Sequence[AgentEndpoint], restart_grace_s: float) -> Reconnect | Wait | Move:
    """The next step of a recovery. ``lost_for`` is how long each stage has not been serving;
    ``usable`` the free standbys in order of preference."""
    lost = [r for r in reports if r.condition != SERVING]
    if not lost:
        return Reconnect()
    movable = [r for r in lost if r.condition != RESTARTING or lost_for.get(r.stage, 0.0) >= restart_grace_s]
    moves = tuple((r.stage, endpoint) for r, endpoint in zip(movable, usable, strict=False))
    if moves:
        return Move(moves, "; ".join(r.describe() for r in movable[:len(moves)]))
    waiting = "; ".join(r.describe() for r in lost)
    if movable:
        return Wait(f"{waiting}, and no standby agent is free to take it (none configured, or all paused "
                    "or unreachable)")
    return Wait(f"{waiting}; waiting for its worker to come back")


def check_standby(layout: RingLayout, standby: Sequence[AgentEndpoint]) -> None:
    """LayoutError unless every standby is an agent outside the ring with a data address of its own."""
    taken = {(t.host, t.port) for t in layout.targets}
    data = {t.data_address for t in layout.targets}
    for endpoint in standby:
        target = AgentTarget(endpoint.control, 0, endpoint.data_port, endpoint.name, endpoint.node_id)
        if (target.host, target.port) in taken:
            raise LayoutError(f"{target.label} is both in the ring and a standby; a standby must be another agent")
        if target.data_address in data:
            raise LayoutError(f"standby {target.label} would listen on {target.data_address}, which another "
                              "agent of the ring uses; give it its own data port")
        taken.add((target.host, target.port))
        data.add(target.data_address)


def moved_layout(layout: RingLayout, moves: Sequence[tuple[int, AgentEndpoint]]
                 ) -> tuple[RingLayout, tuple[AgentEndpoint, ...]]:
    """The layout with each moved stage on its standby, and the agents that lost their stage (as
    endpoints, to become standbys)."""
    by_stage = dict(moves)
    targets, released = [], []
    for target in layout.targets:
        endpoint = by_stage.get(target.stage)
        if endpoint is None:
            targets.append(target)
            continue
        released.append(AgentEndpoint(target.control, target.data_port, target.name, target.node_id))
        targets.append(AgentTarget(endpoint.control, target.stage, endpoint.data_port, endpoint.name,
                                   endpoint.node_id))
    return replace(layout, targets=tuple(targets)), tuple(released)


class RingRecovery:
    """The coordinator's ``recover`` hook for a :class:`Distributor`'s ring; ``standby`` is the
    ordered pool of approved agents that may take over a stage."""

    def __init__(self, distributor: Distributor, standby: Sequence[AgentEndpoint] = ()) -> None:
        check_standby(distributor.layout, standby)
        self._dist = distributor
        self.standby: list[AgentEndpoint] = list(standby)
        self.moves: list[StageMove] = []
        self._quick: dict[str, ControlClient] = {}

    def _client(self, control: str) -> ControlClient:
        if control not in self._quick or self._quick[control].node_id != self._dist.node_id_of(control):
            host, port = parse_hostport(control, "the agent's control address")
            self._quick[control] = ControlClient(self._dist.host.credentials, host, port,
                                                 timeout=self._dist.failover.status_timeout_s,
                                                 node_id=self._dist.node_id_of(control))
        return self._quick[control]

    async def _async_status(self, control: str) -> AgentStatus | str:
        try:
            return await self._client(control).async_status()
        except ControlError as exc:
            return str(exc)

    async def _async_survey(self, *, with_standby: bool = True) -> tuple[list[StageReport], list[AgentEndpoint]]:
        """Every ring stage's report and the standbys usable now, asked all at once."""
        targets, pool = self._dist.layout.targets, list(self.standby) if with_standby else []
        statuses = await asyncio.gather(*(self._async_status(c) for c in
                                          [t.control for t in targets] + [e.control for e in pool]))
        reports = [StageReport(t.stage, t.label, *stage_condition(s, self._dist.export_id, t.stage),
                               pid=s.worker.pid if isinstance(s, AgentStatus) else None)
                   for t, s in zip(targets, statuses, strict=False)]
        usable = [e for e, s in zip(pool, statuses[len(targets):], strict=True) if standby_usable(s)]
        return reports, usable

    async def async_watch(self, coordinator: Coordinator) -> None:
        """Runs beside a healthy ring: every ``watch_s`` ask its agents, and fail over at once
        when :func:`ring_alarm` says so. Baselines start afresh after every failover."""
        pids: dict[int, int | None] = {}
        streak: dict[int, int] = {}
        seen_failovers = -1.0
        while (every := self._dist.failover.watch_s) > 0:
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

    async def async_recover(self, path: RingPath, reason: str) -> RingPath:
        """Bring the ring back (see the module docstring); NoReplacementError after ``hold_s``."""
        settings = self._dist.failover
        deadline = time.monotonic() + settings.hold_s
        lost_since: dict[int, float] = {}
        last_why = ""
        while True:
            reports, usable = await self._async_survey()
            now = time.monotonic()
            for report in reports:
                if report.condition == SERVING:
                    lost_since.pop(report.stage, None)
                else:
                    lost_since.setdefault(report.stage, now)
            decision = plan_recovery(reports, {s: now - t for s, t in lost_since.items()}, usable,
                                     settings.restart_grace_s)
            if isinstance(decision, Reconnect):
                try:
                    await self._async_reconnect(path)
                    return path
                except (DeskfleetError, OSError, TimeoutError) as exc:
                    decision = Wait(f"every agent reports its stage running, but the console cannot reach the "
                                    f"first stage ({exc})")
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

    async def _async_reconnect(self, path: RingPath) -> None:
        layout = self._dist.layout
        first = None if layout.local_stage0 else Address(layout.targets[0].host, layout.targets[0].data_port)
        await asyncio.wait_for(path.async_reconnect(first), self._dist.timeouts.dial_s + 5)

    async def _async_move(self, move: Move) -> None:
        """Put each moved stage on its standby, re-point the upstream agents, start what changed."""
        started = time.monotonic()
        old = {t.stage: t for t in self._dist.layout.targets}
        layout, released = moved_layout(self._dist.layout, move.moves)
        for _, endpoint in move.moves:
            self.standby.remove(endpoint)
        self._dist.replace_layout(layout)
        log.warning("failover: moving %s", ", ".join(f"stage {s} from {old[s].label} to {e.name or e.control}"
                                                     for s, e in move.moves))
        # the agents that lost their stage stop serving it (a paused one must not restart it on
        # resume, a crashed one not come back beside its replacement), then wait as standbys; an
        # unreachable one must not hold up the move, so this runs beside the bring-up
        for endpoint in released:
            self._dist.forget_assignment(endpoint.control)
        releasing = asyncio.gather(*(self._async_release(e) for e in released))
        failures = await self._dist.async_bring_up(self._dist.changed_targets())
        await releasing
        self.standby.extend(released)
        for failure in failures:
            log.warning("failover: %s (stage %d) could not take its part: %s", failure.agent, failure.stage,
                        failure.message)
        seconds = time.monotonic() - started
        for stage, endpoint in move.moves:
            self.moves.append(StageMove(stage, old[stage].label, endpoint.name or endpoint.control, move.why, seconds))

    async def _async_release(self, endpoint: AgentEndpoint) -> None:
        with contextlib.suppress(ControlError):
            await self._dist.client(endpoint.control).async_stop_worker()
