"""A ring a reconnect cannot repair: every agent reports its stage running, yet the steps stop
again after each reconnect (a stopped or overloaded worker its agent cannot see). After
``max_reconnects`` plain reconnects in a row without one token answered, the held requests fail
with RingUnrepairableError ("cannot be repaired", naming the stages), never an IndexError.

The policy over the in-memory ring of test_ring_recovery (fast); the real thing (slow): a real
2-stage paged ring on real agents whose last stage's worker is SIGSTOPped mid-answer.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace

import pytest

from console.fleet.failover import FailoverSettings, RingRecovery, RingUnrepairableError
from engine.generation.generator import UnavailableError
from engine.generation.request import GenerationRequest
from tests.conftest import PROMPT_IDS
from tests.console.test_ring_recovery import status, two_stages
from tests.support.asyncutil import run


class Tokens:
    """The coordinator's token count as the recovery sees it (what async_watch wires up)."""

    def __init__(self) -> None:
        self.n = 0.0

    def __call__(self) -> float:
        return self.n


def _recovery(max_reconnects: int = 2):
    ring = two_stages()
    ring.failover = replace(ring.failover, max_reconnects=max_reconnects)
    recovery = RingRecovery(ring)
    tokens = Tokens()
    recovery._tokens = tokens  # noqa: SLF001 - what async_watch(coordinator) sets
    return ring, recovery, tokens


def test_plain_reconnects_without_progress_end_in_cannot_be_repaired_naming_the_stages():
    ring, recovery, _ = _recovery(max_reconnects=2)
    path = object()
    assert run(recovery.async_recover(path, "a step got no reply")) is path
    assert run(recovery.async_recover(path, "a step got no reply")) is path
    with pytest.raises(RingUnrepairableError, match=r"cannot be repaired: 2 reconnect\(s\) in a row .*"
                                                    r"stage 0 on a, stage 1 on b.*stuck") as caught:
        run(recovery.async_recover(path, "a step got no reply"))
    assert caught.value.stage is None  # two stages, both reporting running: no one to blame
    assert len(ring.redials) == 2 and ring.moves == []  # the third did not redial a stuck ring again


def test_a_token_answered_or_a_new_worker_between_failures_starts_the_count_afresh():
    ring, recovery, tokens = _recovery(max_reconnects=1)
    path = object()
    for _ in range(4):  # the ring answered between each failure: every failure is a first
        run(recovery.async_recover(path, "timeout"))
        tokens.n += 3
    for pid in (200, 300, 400):  # no token, but the worker was replaced each time: not the same stuck one
        ring.agents["10.0.0.2:7210"] = status(1, pid=pid)
        run(recovery.async_recover(path, "timeout"))
    assert len(ring.redials) == 7
    with pytest.raises(RingUnrepairableError):
        run(recovery.async_recover(path, "timeout"))


def test_a_recovery_that_moved_a_stage_is_not_a_plain_reconnect():
    ring, recovery, _ = _recovery(max_reconnects=1)
    path = object()
    run(recovery.async_recover(path, "timeout"))
    # a paused agent whose pause ends within the recovery: not serving at the first look
    ring.agents["10.0.0.2:7210"] = status(1, state="paused")

    async def resume_soon():
        await asyncio.sleep(0.05)
        ring.agents["10.0.0.2:7210"] = status(1)

    async def both():
        await asyncio.gather(recovery.async_recover(path, "paused"), resume_soon())

    run(both())
    run(recovery.async_recover(path, "timeout"))  # counted afresh after the pause
    assert len(ring.redials) == 3


def test_without_a_coordinator_to_watch_reconnects_go_on():
    ring = two_stages()
    recovery = RingRecovery(ring)
    for _ in range(5):
        run(recovery.async_recover(object(), "timeout"))
    assert len(ring.redials) == 5


@pytest.mark.slow
@pytest.mark.usefixtures("private_keyring")
def test_a_stopped_worker_fails_the_held_request_as_cannot_be_repaired_not_an_index_error(tmp_path, tiny_export):
    from tests.console.test_console_failover import _ring

    settings = FailoverSettings(step_timeout_s=2.0, hold_s=8.0, restart_grace_s=1.0, move_s=20.0, watch_s=0.5)

    async def main():
        async with _ring(tmp_path, tiny_export("llama", 2), settings, standby=False) as (dist, agents):
            stopped: list[int] = []
            tokens = 0
            try:
                async for _ in dist.coordinator.stream(GenerationRequest(PROMPT_IDS, 400, ignore_eos=True)):
                    tokens += 1
                    if tokens == 4:
                        stopped.append(agents["desk-b"].worker_pid)
                        os.kill(stopped[0], signal.SIGSTOP)  # alive to its agent, answering nothing
            except UnavailableError as exc:
                return exc, tokens, dist.coordinator.metrics(), await dist.async_health()
            finally:
                for pid in stopped:
                    os.kill(pid, signal.SIGCONT)
            raise AssertionError("the stream finished although its last stage was stopped")

    error, tokens, metrics, health = run(main())
    message = str(error)
    assert tokens == 4
    assert "cannot be repaired" in message and "stage 1 on desk-b" in message and "stuck" in message
    assert "IndexError" not in message and "lost its stages" not in message
    assert metrics["failovers_total"] == settings.max_reconnects + 1
    assert metrics["requests_failed_total"] == 1
    assert not health.ok
