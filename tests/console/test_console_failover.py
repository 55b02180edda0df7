"""Failover of the console's ring under load, end to end on loopback: a real fleet host, real
in-process agents joined with tokens, real stage-worker processes, mutual TLS everywhere. Four
greedy streams decode through a 2-stage ring on two agents (paged: batched in one step per
stage; one case on a 3-stage paged ring whose stage 0 runs in the console) while one agent is
paused, its worker SIGKILLed, or the agent gone altogether (unplugged); its stage comes back in place
or moves to a standby agent,
and every answer is identical to the undisturbed unsplit run, with no request lost. Without a
standby the streams wait for the hold time (a resume within it saves them) and then fail with an
error that says why. A standby whose KV budget cannot hold the paged ring's pool is refused by name."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest

from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from console.fleet.distribution import Distributor
from console.fleet.errors import LayoutError
from console.fleet.failover import FailoverSettings
from console.fleet.failover_plan import (
    PAUSED,
    RESTARTING,
    SERVING,
    UNREACHABLE,
    Move,
    Reconnect,
    StageReport,
    Wait,
    check_standby,
    moved_layout,
    plan_recovery,
    ring_alarm,
)
from console.fleet.ring_layout import AgentEndpoint, AgentTarget, RingLayout
from console.fleet.ring_runtime import PoolBudgetRefusedError, pool_refusal, ring_pool_blocks, stage_pool_blocks
from engine.control.messages import WorkerSettings
from engine.generation.generator import UnavailableError
from engine.generation.request import GenerationRequest
from engine.shards.manifest import load_manifest
from tests.conftest import PROMPT_IDS
from tests.support.agent_helpers import FakeIdle, console
from tests.support.asyncutil import run
from tests.support.loopback import free_port

N = 48
PROMPTS = (PROMPT_IDS, PROMPT_IDS[:7], PROMPT_IDS[4:], PROMPT_IDS[:12])
WORKER = WorkerSettings(threads=1, exact=True)


pytestmark = pytest.mark.usefixtures("private_keyring")


@contextlib.asynccontextmanager
async def _ring(tmp_path: Path, export: Path, settings: FailoverSettings, *, standby: bool, runtime: str = "paged",
                first: int = 0):
    """desk-a serves stage ``first`` (1: the console hosts stage 0), desk-b the next, desk-c (if
    ``standby``) waits; yields the running distributor and the agents by name."""
    async with console(tmp_path / "console") as con:
        agents: dict[str, AgentService] = {}
        try:
            for name in ("desk-a", "desk-b", "desk-c") if standby else ("desk-a", "desk-b"):
                agent = AgentService(tmp_path / name, AgentSettings(name=name, interface="127.0.0.1", control_port=0,
                                                                    data_port=0, kv_pool_mb=32,
                                                                    warm_spare="off"),  # the cold path
                                     idle_source=FakeIdle(1e6), power=lambda: None)
                agents[name] = agent
                await agent.async_start()
                await agent.async_join(con.enrollment, con.token())
            control = {name: f"127.0.0.1:{a.control_port}" for name, a in agents.items()}
            layout = RingLayout.of([AgentTarget(control["desk-a"], first, free_port(), "desk-a"),
                                    AgentTarget(control["desk-b"], first + 1, free_port(), "desk-b")])
            spare = [AgentEndpoint(control["desk-c"], free_port(), "desk-c")] if standby else []
            async with Distributor(con, export, layout, worker=WORKER, standby=spare, failover=settings,
                                   runtime=runtime) as dist:
                assert (await dist.async_run()).ok
                yield dist, agents
        finally:
            for agent in agents.values():
                await agent.async_close()


async def _generate_disturbed(dist: Distributor, disturb, *, after: int = 8):
    """The four streams at once; ``disturb()`` runs when the first stream has ``after`` tokens.
    Returns each prompt's tokens (or its exception), each stream's length at the disturbance and
    the seconds from the disturbance to the last stream's end."""
    got: dict[tuple, list[int]] = {p: [] for p in PROMPTS}
    errors: dict[tuple, BaseException] = {}
    at_disturbance: dict[tuple, int] = {}
    disturbed = asyncio.Event()
    when = [0.0]

    async def consume(prompt):
        try:
            async for event in dist.coordinator.stream(GenerationRequest(prompt, N, ignore_eos=True)):
                got[prompt].append(event.token_id)
                if len(got[prompt]) == after and not disturbed.is_set():
                    disturbed.set()
                    at_disturbance.update({p: len(t) for p, t in got.items()})
                    when[0] = time.monotonic()
                    await disturb()
        except UnavailableError as exc:
            errors[prompt] = exc

    await asyncio.gather(*(consume(p) for p in PROMPTS))
    return got, errors, at_disturbance, time.monotonic() - when[0]


@pytest.mark.slow
@pytest.mark.parametrize("how, agent, grace, runtime", [
    ("pause", 1, 30.0, "paged"), ("pause", 0, 30.0, "paged"), ("kill", 1, 30.0, "paged"), ("kill", 0, 0.0, "paged"),
    ("unplug", 1, 30.0, "paged"), ("kill", 0, 0.0, "paged-stage0-in-console")])
def test_a_lost_stage_comes_back_or_moves_to_the_standby_and_answers_are_identical(
        tmp_path, tiny_export, unsplit_greedy, how, agent, grace, runtime):
    first = 1 if runtime == "paged-stage0-in-console" else 0  # the console hosts stage 0: a 3-stage export
    runtime = runtime.split("-")[0]
    export = tiny_export("llama", 2 + first)
    stage = agent + first
    # a pause is heard from the hub, a dead or restarted worker seen by the ring watch: both long
    # before this step timeout
    step_timeout = 30.0
    settings = FailoverSettings(step_timeout_s=step_timeout, hold_s=60.0, restart_grace_s=grace, move_s=120.0)
    victim_name = ("desk-a", "desk-b")[agent]

    async def main():
        async with _ring(tmp_path, export, settings, standby=True, runtime=runtime, first=first) as (dist, agents):
            victim = agents[victim_name]
            pid = victim.worker_pid

            async def disturb():
                if how == "pause":
                    await victim.async_set_manual_pause(True)
                elif how == "kill":
                    os.kill(pid, signal.SIGKILL)
                else:  # the PC is gone: its agent answers nothing, its worker is gone
                    await victim.async_close()

            got, errors, at_disturbance, tail_s = await _generate_disturbed(dist, disturb)
            health = await dist.async_health()
            labels = [t.label for t in dist.layout.targets]
            states = {name: a.status() for name, a in agents.items()}
            spares = [e.name for e in dist.recovery.standby]
            assert [a.assignment.runtime for a in agents.values() if a.assignment] == \
                [runtime] * len([a for a in agents.values() if a.assignment])
            return got, errors, at_disturbance, tail_s, dist.coordinator.metrics(), list(dist.recovery.moves), \
                health, labels, states, pid, spares

    got, errors, at_disturbance, tail_s, metrics, moves, health, labels, states, pid, spares = run(main())
    assert "kv_blocks_total" in metrics
    assert metrics["sched_replays_total"] >= 1 and metrics["kv_blocks_used"] == 0
    if first:  # stage 0 ran in the console before and after the move of stage 1
        assert metrics['stage_compute_ms_per_step{stage="0"}'] > 0 and metrics["stages"] == 3
    assert not errors
    assert all(n < N for n in at_disturbance.values())  # every stream was mid-answer
    for prompt in PROMPTS:
        assert tuple(got[prompt]) == unsplit_greedy(prompt, N)
    assert metrics["failovers_total"] >= 1 and metrics["requests_failed_total"] == 0
    assert metrics["requests_finished_total"] == len(PROMPTS) + 2  # + two one-token health checks
    assert health.ok
    moved = how != "kill" or grace == 0.0
    if moved:
        assert [(m.stage, m.from_agent, m.to_agent) for m in moves] == [(stage, victim_name, "desk-c")]
        expected = ["desk-a", "desk-b"]
        expected[agent] = "desk-c"
        assert labels == expected
        assert states["desk-c"].worker.state == "running" and states["desk-c"].stage == stage
        assert states[victim_name].worker.state == "stopped"  # it does not serve beside its replacement
        assert spares == [victim_name]  # it waits as a standby now
    else:
        assert moves == [] and labels == ["desk-a", "desk-b"]
        assert states[victim_name].worker.restarts >= 1 and states[victim_name].worker.pid != pid
        assert states["desk-c"].worker.state == "stopped" and states["desk-c"].stage is None
        assert spares == ["desk-c"]
    assert tail_s < step_timeout  # noticed at once, not after a step timeout
    if how == "pause":
        assert "paused" in moves[0].why


@pytest.mark.slow
def test_without_a_standby_streams_wait_for_a_resume_then_fail_clearly_after_the_hold(tmp_path, tiny_export,
                                                                                     unsplit_greedy):
    export = tiny_export("llama", 2)
    settings = FailoverSettings(step_timeout_s=10.0, hold_s=60.0, restart_grace_s=30.0, move_s=60.0)

    async def main():
        async with _ring(tmp_path, export, settings, standby=False) as (dist, agents):
            desk_b = agents["desk-b"]

            async def pause_briefly():
                await desk_b.async_set_manual_pause(True)
                await asyncio.sleep(1.0)  # a short pause: the streams are held meanwhile
                await desk_b.async_set_manual_pause(False)

            resumed = await _generate_disturbed(dist, pause_briefly)

            async def pause_for_good():
                await desk_b.async_set_manual_pause(True)

            dist.failover = replace(settings, hold_s=5.0)  # read at each failure

            started = time.monotonic()
            failed = await _generate_disturbed(dist, pause_for_good)
            return resumed, failed, time.monotonic() - started, dist.coordinator.metrics()

    resumed, failed, failed_after_s, metrics = run(main())
    got, errors, at_disturbance, _ = resumed
    assert not errors and all(n < N for n in at_disturbance.values())
    for prompt in PROMPTS:
        assert tuple(got[prompt]) == unsplit_greedy(prompt, N)

    _, errors, _, _ = failed
    assert set(errors) == set(PROMPTS)  # every held stream fails, none hangs
    message = str(errors[PROMPT_IDS])
    assert "no replacement within 5 s" in message and "desk-b" in message and "paused" in message
    assert "no standby agent is free" in message
    assert 5.0 <= failed_after_s < 5.0 + 30.0
    assert metrics["requests_failed_total"] == len(PROMPTS)


# -- the decisions, without sockets ------------------------------------------------------------------

def test_the_paged_pool_is_the_tightest_budget_and_a_smaller_standby_is_refused_by_name(tiny_export):
    manifest = load_manifest(tiny_export("llama", 2))
    blocks = {mb: stage_pool_blocks(manifest, WORKER, 1, "desk-b", mb) for mb in (16, 32)}
    assert blocks[16] < blocks[32]
    assert ring_pool_blocks(manifest, WORKER, [(0, "desk-a", 32), (1, "desk-b", 16)]) == blocks[16]
    assert pool_refusal(manifest, WORKER, 1, "desk-c", 32, blocks[16]) is None
    why = pool_refusal(manifest, WORKER, 1, "desk-c", 16, blocks[32])
    assert why is not None and f"fewer than the ring's {blocks[32]}" in why
    assert re.search(r"kv_pool_mb to at least \d+ MiB", why)
    with pytest.raises(PoolBudgetRefusedError, match="desk-b .stage 1. gives its KV pool 0 MiB"):
        ring_pool_blocks(manifest, WORKER, [(0, "desk-a", 32), (1, "desk-b", 0)])


C = AgentEndpoint("10.0.0.9:7210", 7211, "desk-c")
D = AgentEndpoint("10.0.0.10:7210", 7211, "desk-d")


def _reports(*conditions: str) -> list[StageReport]:
    return [StageReport(i, f"desk-{i}", c) for i, c in enumerate(conditions)]


def test_plan_recovery_reconnects_waits_or_moves():
    assert plan_recovery(_reports(SERVING, SERVING), {}, [C], 10.0) == Reconnect()
    # a crash its agent is restarting: wait for it within the grace, move after it
    wait = plan_recovery(_reports(SERVING, RESTARTING), {1: 3.0}, [C], 10.0)
    assert isinstance(wait, Wait) and "come back" in wait.why
    assert plan_recovery(_reports(SERVING, RESTARTING), {1: 10.0}, [C], 10.0).moves == ((1, C),)
    # paused or unreachable: move at once, one standby per lost stage, in pool order
    assert plan_recovery(_reports(PAUSED, UNREACHABLE), {0: 0.0, 1: 0.0}, [C, D], 10.0).moves == ((0, C), (1, D))
    assert plan_recovery(_reports(PAUSED, UNREACHABLE), {}, [D], 10.0).moves == ((0, D),)
    # nothing to move to: wait, saying why
    stuck = plan_recovery(_reports(SERVING, PAUSED), {1: 1.0}, [], 10.0)
    assert isinstance(stuck, Wait) and "desk-1 is paused" in stuck.why and "no standby" in stuck.why
    assert isinstance(plan_recovery(_reports(PAUSED), {}, [C], 0.0), Move)


def test_moved_layout_swaps_the_agent_and_releases_the_old_one():
    layout = RingLayout.of([AgentTarget("10.0.0.5:7210", 1, 7211, "desk-a"),
                            AgentTarget("10.0.0.6:7210", 2, 7211, "desk-b")])
    moved, released = moved_layout(layout, [(2, C)])
    assert moved.local_stage0 and [(t.label, t.stage, t.data_port) for t in moved.targets] == \
        [("desk-a", 1, 7211), ("desk-c", 2, 7211)]
    assert released == (AgentEndpoint("10.0.0.6:7210", 7211, "desk-b"),)
    moved.check(3)
    check_standby(layout, [C, D])
    with pytest.raises(LayoutError, match="both in the ring and a standby"):
        check_standby(layout, [AgentEndpoint("10.0.0.6:7210", 7300)])
    with pytest.raises(LayoutError, match="data port"):
        check_standby(layout, [AgentEndpoint("10.0.0.5:7310", 7211)])


def test_ring_alarm_sees_lost_and_replaced_workers_but_not_one_slow_answer():
    serving = [StageReport(0, "desk-a", SERVING, pid=10), StageReport(1, "desk-b", SERVING, pid=20)]
    assert ring_alarm(serving, {0: 10, 1: 20}, {}) is None
    assert ring_alarm(serving, {}, {}) is None  # no baseline yet
    assert "pid 21 -> 20" in ring_alarm(serving, {0: 10, 1: 21}, {})  # crashed and restarted between looks
    restarting = [serving[0], StageReport(1, "desk-b", RESTARTING, "worker backoff")]
    assert "desk-b is restarting" in ring_alarm(restarting, {0: 10, 1: 20}, {})
    gone = [serving[0], StageReport(1, "desk-b", UNREACHABLE, "timed out")]
    assert ring_alarm(gone, {0: 10, 1: 20}, {1: 1}) is None
    assert "unreachable" in ring_alarm(gone, {0: 10, 1: 20}, {1: 2})
