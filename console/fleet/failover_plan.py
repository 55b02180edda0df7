"""What a failover does, decided in pure code: no sockets, no clients, no clocks.

:mod:`console.fleet.failover` asks the ring's agents for their status and acts; this module
turns what they said into the next step. Each agent's status becomes a :class:`StageReport`
(:func:`stage_condition`); :func:`ring_alarm` says whether a running ring should fail over now;
:func:`plan_recovery` picks the next step of a recovery — :class:`Reconnect` (every stage serves
again), :class:`Move` (these stages to these standbys) or :class:`Wait` (and why);
:func:`moved_layout` is the layout after a move and :func:`check_standby` refuses a standby pool
that clashes with the ring. :func:`spare_stages` says which stage each standby keeps a warm spare
of, and :func:`pair_standbys` gives a lost stage the standby holding its spare first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from console.fleet.errors import LayoutError
from console.fleet.ring_layout import AgentEndpoint, AgentTarget, RingLayout
from engine.control.messages import AgentStatus

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
                  usable: Sequence[AgentEndpoint], restart_grace_s: float,
                  spares: Mapping[str, int] | None = None) -> Reconnect | Wait | Move:
    """The next step of a recovery. ``lost_for`` is how long each stage has not been serving;
    ``usable`` the free standbys in order of preference; ``spares``: control address -> the
    stage whose warm spare that standby holds (it takes that stage first: promoting a spare is
    milliseconds, loading a shard seconds)."""
    lost = [r for r in reports if r.condition != SERVING]
    if not lost:
        return Reconnect()
    movable = [r for r in lost if r.condition != RESTARTING or lost_for.get(r.stage, 0.0) >= restart_grace_s]
    moves = pair_standbys([r.stage for r in movable], usable, spares or {})
    if moves:
        moved = {stage for stage, _ in moves}
        return Move(moves, "; ".join(r.describe() for r in movable if r.stage in moved))
    waiting = "; ".join(r.describe() for r in lost)
    if movable:
        return Wait(f"{waiting}, and no standby agent is free to take it (none configured, or all paused "
                    "or unreachable)")
    return Wait(f"{waiting}; waiting for its worker to come back")


def pair_standbys(stages: Sequence[int], usable: Sequence[AgentEndpoint],
                  spares: Mapping[str, int]) -> tuple[tuple[int, AgentEndpoint], ...]:
    """Each lost stage (in order) with a standby: one holding that stage's spare if free, else
    the first free one; as many pairs as there are standbys."""
    free = list(usable)
    chosen: dict[int, AgentEndpoint] = {}
    for stage in stages:
        warm = next((e for e in free if spares.get(e.control) == stage), None)
        if warm is not None:
            chosen[stage] = warm
            free.remove(warm)
    for stage in stages:
        if stage not in chosen and free:
            chosen[stage] = free.pop(0)
    return tuple((stage, chosen[stage]) for stage in stages if stage in chosen)


def spare_stages(layout: RingLayout, standby: Sequence[AgentEndpoint]) -> dict[str, int]:
    """Which stage each standby holds a warm spare of: round-robin from the last stage back (the
    last stage is always on an agent, stage 0 may be in the fleet service)."""
    stages = [t.stage for t in reversed(layout.targets)]
    return {e.control: stages[i % len(stages)] for i, e in enumerate(standby)} if stages else {}


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
