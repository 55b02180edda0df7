"""Failover through warm spares on the console's (paged) ring, end to end on loopback: a real
fleet host, real agents joined with tokens, real worker processes, mutual TLS. desk-a and desk-b
serve a 2-stage ring, each with a warm spare beside its worker; desk-c is a standby holding a
spare of stage 1. A worker SIGKILLed mid-answer is replaced by its own spare (the spare's pid
serves, nothing moves); a stage whose PC is taken back moves to the standby, whose spare serves
it. Either way every answer is identical to the undisturbed unsplit greedy run."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from console.fleet.distribution import Distributor
from console.fleet.failover import FailoverSettings
from console.fleet.ring_layout import AgentEndpoint, AgentTarget, RingLayout
from engine.control.messages import WorkerSettings
from engine.generation.request import GenerationRequest
from tests.conftest import PROMPT_IDS
from tests.support.agent_helpers import FakeIdle, console
from tests.support.asyncutil import run
from tests.support.loopback import free_port

N = 40
PROMPTS = (PROMPT_IDS, PROMPT_IDS[:9])
WORKER = WorkerSettings(threads=1, exact=True)

pytestmark = pytest.mark.usefixtures("private_keyring")


async def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:.0f} s")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _ring(tmp_path: Path, export: Path, settings: FailoverSettings):
    async with console(tmp_path / "console") as con:
        agents: dict[str, AgentService] = {}
        try:
            for name in ("desk-a", "desk-b", "desk-c"):
                agent = AgentService(tmp_path / name, AgentSettings(name=name, interface="127.0.0.1", control_port=0,
                                                                    data_port=0, kv_pool_mb=32, warm_spare="on"),
                                     idle_source=FakeIdle(1e6), power=lambda: None)
                agent._supervisor.spare_delay_s = 0.2  # the test waits for the spares anyway
                agents[name] = agent
                await agent.async_start()
                await agent.async_join(con.enrollment, con.token())
            control = {name: f"127.0.0.1:{a.control_port}" for name, a in agents.items()}
            layout = RingLayout.of([AgentTarget(control["desk-a"], 0, free_port(), "desk-a"),
                                    AgentTarget(control["desk-b"], 1, free_port(), "desk-b")])
            standby = [AgentEndpoint(control["desk-c"], free_port(), "desk-c")]
            async with Distributor(con, export, layout, worker=WORKER, standby=standby, failover=settings) as dist:
                assert (await dist.async_run()).ok
                assert dist.recovery.spares == {control["desk-c"]: 1}  # the standby spares the last stage
                await _until(lambda: all(a.spare_ready for a in agents.values()), 60, "every agent holds a spare")
                assert agents["desk-c"].worker_pid is None and agents["desk-c"].assignment is None
                yield dist, agents
        finally:
            for agent in agents.values():
                await agent.async_close()


async def _answers(dist: Distributor, disturb, after: int = 8) -> dict[tuple, list[int]]:
    got: dict[tuple, list[int]] = {p: [] for p in PROMPTS}
    done = asyncio.Event()

    async def consume(prompt):
        async for event in dist.coordinator.stream(GenerationRequest(prompt, N, ignore_eos=True)):
            got[prompt].append(event.token_id)
            if len(got[prompt]) == after and not done.is_set():
                done.set()
                await disturb()

    await asyncio.wait_for(asyncio.gather(*(consume(p) for p in PROMPTS)), 90)
    return got


@pytest.mark.slow
def test_the_warm_spare_serves_in_place_then_on_the_standby_and_answers_are_identical(tmp_path, tiny_export,
                                                                                     unsplit_greedy):
    export = tiny_export("llama", 2)
    settings = FailoverSettings(step_timeout_s=30.0, hold_s=60.0, restart_grace_s=30.0, move_s=60.0)

    async def main():
        async with _ring(tmp_path, export, settings) as (dist, agents):
            desk_b, desk_c = agents["desk-b"], agents["desk-c"]
            control_b = f"127.0.0.1:{desk_b.control_port}"
            spare_b, worker_b = desk_b.spare_pid, desk_b.worker_pid
            killed = await _answers(dist, lambda: _kill(worker_b))
            in_place = (list(dist.recovery.moves), [t.label for t in dist.layout.targets], desk_b.worker_pid,
                        desk_c.worker_pid)
            await _until(lambda: desk_b.spare_ready and desk_b.spare_pid != spare_b, 60, "desk-b spares again")

            spare_c = desk_c.spare_pid
            paused = await _answers(dist, lambda: _pause_mid_answer(desk_b))  # its user is back
            moved = (list(dist.recovery.moves), [t.label for t in dist.layout.targets], desk_c.worker_pid)
            await desk_b.async_set_manual_pause(False)  # it waits as a standby of stage 1 when its user is done
            await _until(lambda: desk_b.spare_ready, 60, "desk-b holds a spare of its old stage again")
            return (killed, in_place, spare_b, worker_b, paused, moved, spare_c, dict(dist.recovery.spares),
                    control_b, dist.coordinator.metrics())

    killed, in_place, spare_b, worker_b, paused, moved, spare_c, spares, control_b, metrics = run(main())
    for got in (killed, paused):
        for prompt in PROMPTS:
            assert tuple(got[prompt]) == unsplit_greedy(prompt, N)
    assert metrics["failovers_total"] >= 2 and metrics["requests_failed_total"] == 0

    moves, labels, serving_b, serving_c = in_place
    assert moves == [] and labels == ["desk-a", "desk-b"] and serving_c is None
    assert serving_b == spare_b != worker_b  # the spare is the serving worker now

    moves, labels, serving_c = moved
    assert [(m.stage, m.from_agent, m.to_agent) for m in moves] == [(1, "desk-b", "desk-c")]
    assert labels == ["desk-a", "desk-c"]
    assert serving_c == spare_c  # the standby's spare took the stage
    assert spares == {control_b: 1}  # the agent that lost it spares it now


async def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _term_pending(pid: int) -> bool:
    """Whether a SIGTERM waits, undelivered, for the (stopped) process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/status") as status:
        masks = [int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask & (1 << (signal.SIGTERM - 1)) for mask in masks)


async def _pause_mid_answer(agent: AgentService) -> None:
    """Pause ``agent`` (its user is back) while the streams are surely in flight. A pause stops the
    agent's warm spare first and only then sends its worker SIGTERM; under load that took long
    enough for the 32 tokens left to be answered before the worker stopped, and no move was
    needed. So the worker is held (SIGSTOP: no step moves) until the pause's SIGTERM waits for
    it, then let go: it drains and exits as a paused worker does, with the streams unfinished."""
    pid = agent.worker_pid
    os.kill(pid, signal.SIGSTOP)
    pausing = asyncio.create_task(agent.async_set_manual_pause(True))
    try:
        await _until(lambda: pausing.done() or _term_pending(pid), 30, "the pause's SIGTERM for the worker")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    await pausing
