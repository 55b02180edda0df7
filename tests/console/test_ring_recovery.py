"""RingRecovery's loop over an in-memory ring: what it asks, what it decides, what it does.

The ring here is a :class:`~console.fleet.failover.RecoverableRing` over a dict of agent
statuses, recording every redial and move; no sockets, no processes. The real side (the
Distributor over real agents) is tests/console/test_console_failover.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from console.fleet.errors import AgentFailure, NoReplacementError
from console.fleet.failover import FailoverSettings, RingRecovery
from console.fleet.ring_layout import AgentEndpoint, AgentTarget, RingLayout
from engine.control.messages import AgentStatus, FetchProgress, WorkerStatus
from tests.support.asyncutil import run

EXPORT = "tiny-int4"
FAST = FailoverSettings(hold_s=0.5, restart_grace_s=0.2, poll_s=0.01, status_timeout_s=0.1)


def status(stage: int | None, *, state: str = "serving", worker: str = "running", pid: int = 100,
           export_id: str = EXPORT) -> AgentStatus:
    return AgentStatus(node_id="n", fleet_id="f", name="pc", version="0", state=state,
                       paused_reasons=("in use",) if state == "paused" else (), inventory={},
                       export_id=export_id, stage=stage, fetch=FetchProgress(), worker=WorkerStatus(worker, pid),
                       api_url=None)


@dataclass
class MemoryRing:
    """A ring whose agents answer from ``agents`` (control -> status, or the error text of one
    that does not answer); a move serves each moved stage on its new agent at once."""

    layout: RingLayout
    agents: dict[str, AgentStatus | str]
    export_id: str = EXPORT
    failover: FailoverSettings = FAST
    redials: list[object] = field(default_factory=list)
    moves: list[tuple[RingLayout, tuple[AgentEndpoint, ...]]] = field(default_factory=list)
    failures: tuple[AgentFailure, ...] = ()

    async def async_agent_status(self, control: str, timeout: float) -> AgentStatus | str:
        assert timeout == self.failover.status_timeout_s
        return self.agents[control]

    async def async_redial(self, path: object) -> None:
        self.redials.append(path)

    async def async_move(self, layout: RingLayout, released: Sequence[AgentEndpoint]) -> tuple[AgentFailure, ...]:
        self.moves.append((layout, tuple(released)))
        self.layout = layout
        for target in layout.targets:
            self.agents[target.control] = status(target.stage)
        for endpoint in released:
            self.agents[endpoint.control] = status(None, worker="stopped")
        return self.failures


def agent(n: int | str) -> str:
    return f"10.0.0.{n}:7210"


def two_stages(answers: dict[int, AgentStatus | str] | None = None) -> MemoryRing:
    """Stage 0 on agent 1 ("a"), stage 1 on agent 2 ("b"), both serving unless ``answers`` (by
    agent number) says otherwise; agent 3 answers only when ``answers`` names it."""
    layout = RingLayout((AgentTarget(agent(1), 0, name="a"), AgentTarget(agent(2), 1, name="b")), local_stage0=False)
    statuses = {1: status(0), 2: status(1), **(answers or {})}
    return MemoryRing(layout, {agent(n): s for n, s in statuses.items()})


def test_every_stage_serving_again_redials_and_moves_nothing():
    ring = two_stages()
    path = object()
    recovery = RingRecovery(ring)
    assert run(recovery.async_recover(path, "step timeout")) is path
    assert ring.redials == [path] and ring.moves == [] and recovery.moves == []


def test_a_paused_stage_moves_to_the_standby_and_its_agent_becomes_one():
    standby = AgentEndpoint(agent(3), name="c")
    ring = two_stages({2: status(1, state="paused"), 3: status(None, state="idle", worker="stopped")})
    recovery = RingRecovery(ring, [standby])
    path = object()
    assert run(recovery.async_recover(path, "paused")) is path
    (layout, released), = ring.moves
    assert [(t.control, t.stage) for t in layout.targets] == [(agent(1), 0), (agent(3), 1)]
    assert released == (AgentEndpoint(agent(2), name="b"),)
    assert recovery.standby == list(released)  # the agent that lost the stage waits as a standby
    (move,) = recovery.moves
    assert (move.stage, move.from_agent, move.to_agent) == (1, "b", "c") and "paused" in move.why
    assert ring.redials == [path]  # after the move, every stage serves: the path is redialled


def test_a_restarting_worker_gets_its_grace_before_it_is_moved():
    ring = two_stages({2: status(1, worker="backoff"), 3: status(None, state="idle", worker="stopped")})
    recovery = RingRecovery(ring, [AgentEndpoint(agent(3), name="c")])
    run(recovery.async_recover(object(), "crash"))
    (move,) = recovery.moves
    assert move.seconds >= 0 and "restarting" in move.why


def test_without_a_standby_the_recovery_fails_after_the_hold_naming_the_stage_and_why():
    ring = two_stages({2: "cannot reach the agent at https://10.0.0.2:7210"})
    recovery = RingRecovery(ring)
    with pytest.raises(NoReplacementError, match=r"no replacement within 0 s: stage 1 on b is unreachable "
                                                 r"\(cannot reach the agent.*no standby agent is free"):
        run(recovery.async_recover(object(), "step timeout"))
    assert ring.moves == [] and ring.redials == []


def test_a_paused_standby_is_not_used():
    ring = two_stages({2: status(1, state="paused"), 3: status(None, state="paused", worker="stopped")})
    recovery = RingRecovery(ring, [AgentEndpoint(agent(3), name="c")])
    with pytest.raises(NoReplacementError, match="stage 1 on b is paused"):
        run(recovery.async_recover(object(), "paused"))
    assert ring.moves == []


def test_a_lost_stage_goes_to_the_standby_holding_its_warm_spare_first():
    cold, warm = AgentEndpoint(agent(3), name="c"), AgentEndpoint(agent(4), name="d")
    ring = two_stages({2: status(1, state="paused"), 3: status(None, state="idle", worker="stopped"),
                       4: status(None, state="idle", worker="stopped")})
    recovery = RingRecovery(ring, [cold, warm])
    recovery.spares = {agent(3): 0, agent(4): 1}  # d holds stage 1's spare
    run(recovery.async_recover(object(), "paused"))
    (move,) = recovery.moves
    assert (move.stage, move.to_agent) == (1, "d")
    assert agent(4) not in recovery.spares  # its spare serves the stage now
    (record,) = recovery.timeline
    assert record["reason"] == "paused" and record["started"] <= record["serving"] <= record["redialled"]


def test_pairing_prefers_warm_standbys_then_takes_the_rest_in_order():
    from console.fleet.failover_plan import pair_standbys, spare_stages

    a, b, c = (AgentEndpoint(agent(n), name=n) for n in ("a", "b", "c"))
    assert pair_standbys([0, 1], [a, b, c], {agent("b"): 1}) == ((0, a), (1, b))
    assert pair_standbys([0, 1], [a, b], {agent("a"): 1, agent("b"): 0}) == ((0, b), (1, a))
    assert pair_standbys([0, 1, 2], [a], {}) == ((0, a),)  # as many moves as standbys
    layout = RingLayout((AgentTarget(agent(1), 0), AgentTarget(agent(2), 1), AgentTarget(agent(5), 2)),
                        local_stage0=False)
    assert spare_stages(layout, [a, b, c]) == {agent("a"): 2, agent("b"): 1, agent("c"): 0}
    assert spare_stages(layout, []) == {}
